//! The serve configuration: which upstream connections exist and which reviewed mappings
//! to load.
//!
//! Rule: read strictly (unknown keys fail), resolve every relative path against the
//! configuration file's folder, and resolve each connection's command to one executable
//! path at load time. Connections get no environment but what `env` lists.
//!
//! Accepted form:
//!
//! ```toml
//! [[connection]]
//! name = "notes"                 # [a-z0-9-_], unique
//! command = "@airlock"           # a path, a name looked up on the host's PATH, or
//!                                # "@airlock" = this airlock binary (for its fixtures)
//! args = ["fixture", "notes-server"]
//! cwd = "."                      # default: the configuration file's folder
//! env = { LANG = "C.UTF-8" }     # the complete environment; default: empty
//! owner = "platform-team"        # optional; part of the connection's configuration digest
//! credential_scope = "notes-ro"  # optional reference (never a secret); part of the digest
//! identity_files = ["lib/server-helpers.js"]  # optional: more files whose contents are
//!                                # part of the connection's identity (see registry)
//! confine = true                 # the kernel confines the server (crate::upstream::confine):
//!                                # deny by default (the default); false = unconfined: a WARN
//!                                # at start, FLAGGED in `airlock grants --config`
//! namespaces = true              # own user, mount, PID, network namespaces (default true)
//! [[connection.grants.filesystem]]   # beyond the defaults (system folders, the command's
//! path = "docs"                  # install folder, the script's package, a private TMPDIR);
//! access = "read-only"           # relative to this file; must exist; or "read-write"
//!                                # (a missing read-write folder is made, owner-only)
//! [connection.limits]            # of a confined server
//! processes = 256                # at once in its PID namespace (default 256)
//! open_files = 1024              # RLIMIT_NOFILE (default 1024)
//! address_space = 8589934592     # RLIMIT_AS in bytes (default unlimited)
//!
//! [[connection]]                 # an HTTP upstream: `url` instead of `command`
//! name = "notes-remote"          # (args, cwd, env, identity_files are refused with url)
//! url = "https://mcp.example.com/mcp"   # https://, or http:// to a loopback host only
//! allow_insecure_http = false    # true lets http:// reach a host that is not loopback
//! credential_scope = "notes-ro"  # part of the connection's identity, as for commands
//! headers = { "Authorization" = { secret = "notes-token", prefix = "Bearer " },
//!             "X-Tenant" = { value = "acme" } }   # a literal only for non-credential
//!                                # headers; see crate::upstream::http for the rules
//!
//! [[mapping]]
//! manifest = "adapters/source-library/mapping.toml"
//!
//! [[contract]]                   # an operator's contract package (crate::contract::package):
//! path = "contracts/workspace-edits"   # a folder: contract.toml + WIT (+ deps/); relative
//!                                # to this file. Built-in contracts need no entry. A mapping
//!                                # may bind it once `airlock contracts approve` pinned it
//!
//! mappings_dir = "mappings"      # optional: a watched folder of mappings, one sub-folder
//!                                # each holding mapping.toml + its component; hot-reloaded
//! state_dir = "state"            # optional: the store's folder (default: see default_state_dir)
//! store = "postgres://airlock@localhost/airlock"  # optional: the shared PostgreSQL store
//!                                # of several hosts (also postgresql://…, or libpq text
//!                                # such as "host=/run/postgresql dbname=airlock"; see
//!                                # crate::store::postgres); default "sqlite": airlock.db
//!                                # in state_dir
//! snapshot_interval = "10m"      # re-discover every connection this often (default 10m;
//!                                # "off" = only on start and list_changed)
//! start_timeout = "10s"          # how long one connection may take to start: spawn,
//!                                # initialize and discovery (default 10s, 1s..=10m); a
//!                                # connection that takes longer is disconnected and
//!                                # retried in the background
//!
//! policy = ["airlock.cedar"]     # Cedar policy files, in order (default: the built-in
//!                                # policy, see crate::policy::DEFAULT_POLICY)
//! default_profile = "research"   # the profile a session gets without --profile
//!
//! [requester]                    # who a stdio session acts for (never the model's say)
//! name = "alice"                 # default: the operating-system user running airlock
//! roles = ["operator"]           # Cedar `Airlock::Role` parents of the requester
//!
//! [[profile]]                    # what a session may be offered; none configured = one
//! name = "research"              # implicit profile `default` offering every capability
//! capabilities = ["search_sources", "retrieve_source"]   # local names, or ["*"]
//! connections = ["notes"]        # optional scope: only capabilities on these connections
//!
//! [approvals]
//! ttl = "15m"                    # how long a pending approval or an unused receipt lives
//! elicitation_timeout = "5m"     # how long a call waits for a person's answer
//!
//! [secrets]                      # named secrets for mappings' env grants and for
//!                                # HTTP connections' headers
//! notes-token = { env = "NOTES_TOKEN" }   # read from airlock's own environment at start
//!
//! [trace]                        # the trace's host key and checkpoints (crate::store::key)
//! key = "trace-key"              # a [secrets] entry holding the key (at least 32 bytes);
//!                                # default: AIRLOCK_TRACE_KEY, else <state_dir>/trace.key
//! checkpoint_file = "anchor/trace-checkpoints.jsonl"  # append-only; default
//!                                # <state_dir>/trace-checkpoints.jsonl
//! checkpoint_interval = "5m"     # default 5m (1s..=1d); "off" = only at shutdown
//! retain = "30d"                 # archive events older than this (1s..=100 years);
//!                                # default: keep every event in the store
//! retain_events = 10000000       # and/or keep at most this many (1000..=2^32-1)
//! archive_dir = "archive"        # segment files; default <state_dir>/trace-archive
//!
//! [telemetry]
//! metrics = "127.0.0.1:9464"     # also serve GET /metrics here (Prometheus text, no
//!                                # authentication; crate::metrics); default: none
//! otlp = "http://127.0.0.1:4318"  # export OpenTelemetry spans (OTLP/HTTP protobuf) to
//!                                # this collector (/v1/traces added to a bare base URL;
//!                                # crate::telemetry); default: no spans
//!
//! [http]                         # `serve --http`: see crate::front::http
//! [http.auth]                    # bearer tokens: see crate::front::auth
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, bail};
use serde::Deserialize;

use crate::upstream::confine::{Confinement, PathGrant};
use crate::upstream::http::{HeaderValueSource, HttpHeader, HttpServer};
use crate::upstream::{StdioServer, UpstreamServer};

/// How often a serving host re-discovers each connection when the configuration does not
/// say (`snapshot_interval`): servers that change without announcing `list_changed` are
/// caught within this time.
pub const DEFAULT_SNAPSHOT_INTERVAL: std::time::Duration = std::time::Duration::from_secs(600);

/// How long one connection may take to start (spawn, `initialize`, discovery) when the
/// configuration does not say (`start_timeout`).
pub const DEFAULT_START_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The command value that means "this airlock executable".
pub const SELF_COMMAND: &str = "@airlock";

/// A loaded serve configuration with every path resolved.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Connections by name.
    pub connections: BTreeMap<String, UpstreamServer>,
    /// Mapping manifest paths, in file order.
    pub mappings: Vec<PathBuf>,
    /// Operator contract package folders (`[[contract]] path`), in file order; the
    /// built-in packages are always there besides ([`crate::registry::contracts::ContractSet::judge`]).
    pub contract_packages: Vec<PathBuf>,
    /// A watched folder of mappings (`<dir>/<mapping>/mapping.toml`), hot-reloaded.
    pub mappings_dir: Option<PathBuf>,
    /// The store's folder, from the file (`state_dir`); the command line may override it.
    pub state_dir: Option<PathBuf>,
    /// Which store: SQLite in the state folder (default) or a shared PostgreSQL (`store`).
    pub store: StoreSetting,
    /// Re-discover every connection this often (besides start and `list_changed`);
    /// default [`DEFAULT_SNAPSHOT_INTERVAL`], `None` = off.
    pub snapshot_interval: Option<std::time::Duration>,
    /// How long one connection may take to start or restart: spawn, `initialize` and
    /// discovery together (`start_timeout`; default [`DEFAULT_START_TIMEOUT`]).
    pub start_timeout: std::time::Duration,
    /// Where compiled components are cached; `None` compiles on every start. Set by the
    /// command line (`--cache-dir`), not by the file.
    pub cache_dir: Option<PathBuf>,
    /// Named secrets, already read.
    pub secrets: BTreeMap<String, Secret>,
    /// The requester of a stdio session (`[requester]`).
    pub requester: RequesterConfig,
    /// Profiles by name. Never empty: without `[[profile]]` entries it holds the implicit
    /// profile [`IMPLICIT_PROFILE`] offering every capability.
    pub profiles: BTreeMap<String, Profile>,
    /// `default_profile`, checked to name a profile.
    pub default_profile: Option<String>,
    /// Cedar policy files, in order; empty means the built-in default policy.
    pub policy_files: Vec<PathBuf>,
    /// `[approvals]`.
    pub approvals: ApprovalSettings,
    /// `[http]`: the HTTP front (`serve --http`), see [`crate::front::http`].
    pub http: crate::front::http::HttpSettings,
    /// `[trace]`: the trace's host key and checkpoints.
    pub trace: TraceSettings,
    /// `[telemetry]`: metrics and spans.
    pub telemetry: TelemetrySettings,
}

/// `[telemetry]`: where the host's Prometheus metrics are served besides the HTTP front's
/// `/metrics` ([`crate::metrics`]), and where its spans go ([`crate::telemetry`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TelemetrySettings {
    /// `metrics = "ADDR"`: a listener serving only `GET /metrics`, without
    /// authentication (`serve --metrics ADDR` sets it too); unset: none.
    pub metrics: Option<std::net::SocketAddr>,
    /// `otlp = "URL"`: the OTLP/HTTP traces URL spans are exported to
    /// ([`crate::telemetry::traces_url`]; `serve --otlp URL` sets it too); unset: no
    /// spans are made at all.
    pub otlp: Option<String>,
}

/// `store`: where the state lives (`"sqlite"` or a PostgreSQL target), parsed and opened
/// by the store crate ([`crate::store::Target::parse`], [`crate::store::open`]).
pub use crate::store::Target as StoreSetting;

/// How often a serving host writes a trace checkpoint when `[trace] checkpoint_interval`
/// does not say.
pub const DEFAULT_CHECKPOINT_INTERVAL: std::time::Duration = std::time::Duration::from_secs(300);

/// `[trace]`: where the host key comes from and where checkpoints go
/// ([`crate::store::key`]). Defaults: no named key (the store takes `AIRLOCK_TRACE_KEY`,
/// else its key file), checkpoints in `<state_dir>/trace-checkpoints.jsonl`, every
/// [`DEFAULT_CHECKPOINT_INTERVAL`] and at shutdown.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceSettings {
    /// `key`: the `[secrets]` entry holding the host key, with its value.
    pub key: Option<(String, Secret)>,
    /// `checkpoint_file`, resolved against the configuration's folder.
    pub checkpoint_file: Option<PathBuf>,
    /// `checkpoint_interval`; `None` = only at shutdown.
    pub checkpoint_interval: Option<std::time::Duration>,
    /// `retain`: how long events stay in the store before they are archived
    /// ([`crate::store::archive`]); `None` (the default) keeps them by age.
    pub retain: Option<std::time::Duration>,
    /// `retain_events`: at most this many events stay in the store (the oldest beyond
    /// are archived, whatever their age); `None` (the default) = no bound by count.
    pub retain_events: Option<i64>,
    /// `archive_dir`, resolved against the configuration's folder; default
    /// [`ARCHIVE_DIR`] in the state folder.
    pub archive_dir: Option<PathBuf>,
}

/// The archive folder's name in the state folder when `[trace] archive_dir` does not
/// name one.
pub const ARCHIVE_DIR: &str = "trace-archive";

impl Default for TraceSettings {
    fn default() -> Self {
        Self {
            key: None,
            checkpoint_file: None,
            checkpoint_interval: Some(DEFAULT_CHECKPOINT_INTERVAL),
            retain: None,
            retain_events: None,
            archive_dir: None,
        }
    }
}

impl TraceSettings {
    /// The named host key, when `key` is set.
    ///
    /// # Errors
    /// The secret is shorter than [`crate::store::key::MIN_KEY_BYTES`].
    pub fn host_key(&self) -> Result<Option<crate::store::TraceKey>> {
        self.key
            .as_ref()
            .map(|(name, secret)| crate::store::TraceKey::from_secret(name, &secret.0))
            .transpose()
    }

    /// The checkpoint file: `checkpoint_file`, else [`crate::store::key::CHECKPOINT_FILE`]
    /// in `state_dir`.
    pub fn checkpoint_path(&self, state_dir: &Path) -> PathBuf {
        self.checkpoint_file
            .clone()
            .unwrap_or_else(|| state_dir.join(crate::store::key::CHECKPOINT_FILE))
    }

    /// The archive folder: `archive_dir`, else [`ARCHIVE_DIR`] in `state_dir`.
    pub fn archive_path(&self, state_dir: &Path) -> PathBuf {
        self.archive_dir
            .clone()
            .unwrap_or_else(|| state_dir.join(ARCHIVE_DIR))
    }

    /// Whether events are archived at all (`retain` or `retain_events` is set).
    pub fn archives(&self) -> bool {
        self.retain.is_some() || self.retain_events.is_some()
    }
}

/// The profile a configuration without `[[profile]]` entries gets: every capability.
pub const IMPLICIT_PROFILE: &str = "default";

/// Default lifetime of a pending approval and of an unused receipt (`[approvals] ttl`).
pub const DEFAULT_APPROVAL_TTL: std::time::Duration = std::time::Duration::from_secs(15 * 60);

/// Default time a call waits for a person to answer an elicitation.
pub const DEFAULT_ELICITATION_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5 * 60);

/// Who a stdio session acts for. It comes from the serve configuration (or the
/// operating-system user), never from the model or from client-supplied fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequesterConfig {
    /// The requester's name: `[requester] name`, default the OS user running airlock.
    pub name: String,
    /// Roles (Cedar `Airlock::Role` parents of the requester entity).
    pub roles: Vec<String>,
}

impl Default for RequesterConfig {
    fn default() -> Self {
        Self {
            name: os_user_name(),
            roles: Vec::new(),
        }
    }
}

/// A task profile: which capabilities a session may be offered (DESIGN.md §2). A session's
/// catalogue is profile ∩ serving mappings ∩ healthy connections ∩ policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Profile {
    /// `[a-z0-9-_]`, unique.
    pub name: String,
    /// Local capability names; `None` means every capability (`["*"]`).
    pub capabilities: Option<BTreeSet<String>>,
    /// Connection names the profile is scoped to; `None` means every connection.
    pub connections: Option<BTreeSet<String>>,
}

impl Profile {
    /// The implicit profile: every capability on every connection.
    pub fn everything(name: &str) -> Self {
        Self {
            name: name.to_string(),
            capabilities: None,
            connections: None,
        }
    }

    /// Whether capability `name`, served over connection `connection`, is in this profile.
    pub fn includes(&self, name: &str, connection: &str) -> bool {
        self.capabilities.as_ref().is_none_or(|c| c.contains(name))
            && self
                .connections
                .as_ref()
                .is_none_or(|c| c.contains(connection))
    }
}

/// `[approvals]`: lifetimes of approvals and how long a call waits for a person.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApprovalSettings {
    /// Lifetime of a pending approval request, and of a receipt once approved (host clock).
    pub ttl: std::time::Duration,
    /// How long a call waits for an answer to `elicitation/create`.
    pub elicitation_timeout: std::time::Duration,
}

impl Default for ApprovalSettings {
    fn default() -> Self {
        Self {
            ttl: DEFAULT_APPROVAL_TTL,
            elicitation_timeout: DEFAULT_ELICITATION_TIMEOUT,
        }
    }
}

impl ServeConfig {
    /// Refuses a confined connection whose grants would expose what no server may reach:
    /// the state folder (which holds the store and, by default, the trace key), the
    /// checkpoint file (crate::upstream::confine::check_protected). Checked when a host
    /// starts, with the state folder it will use; an unconfined stdio connection
    /// (`confine = false`) is logged there as a WARN.
    ///
    /// # Errors
    /// Names the connection, the grant and what it would expose.
    pub fn check_confinement(&self) -> Result<()> {
        let protected = self.protected_paths();
        for (name, server) in &self.connections {
            if server.as_stdio().is_some_and(|s| s.confine.is_none()) {
                tracing::warn!(
                    connection = %name,
                    "upstream server runs UNCONFINED (confine = false): it can read and write whatever this user can, reach any network and see every process"
                );
            }
            let Some(server) = connection_confined(server) else {
                continue;
            };
            let (server, confine) = server;
            crate::upstream::confine::check_protected(&confine.paths, &protected)
                .with_context(|| format!("connection `{name}`"))?;
            let defaults =
                crate::upstream::confine::default_paths(&server.command, &server.args, &server.cwd);
            crate::upstream::confine::check_protected(&defaults, &protected).with_context(|| {
                format!(
                    "connection `{name}`: a path every confined server reads (the command's install folder, or its script's package) holds the state; move the state folder (state_dir) or the server"
                )
            })?;
        }
        Ok(())
    }

    /// What no confined server may ever be granted: the state folder (which holds the
    /// store and, by default, the trace key) and the checkpoint file, canonical where they
    /// exist.
    #[must_use]
    pub fn protected_paths(&self) -> Vec<PathBuf> {
        let mut protected: Vec<PathBuf> = Vec::new();
        if let Some(dir) = self.state_dir.clone().or_else(default_state_dir) {
            protected.push(dir);
        }
        if let Some(file) = crate::registry::anchor::checkpoint_path(self) {
            protected.push(file);
        }
        // Compare canonical paths where they exist (grants are canonical).
        protected
            .into_iter()
            .map(|p| p.canonicalize().unwrap_or(p))
            .collect()
    }

    /// The secret values of this configuration (what a recorder redaction must remove,
    /// [`crate::record::Redaction::new`]): every `[secrets]` value, every header value of an
    /// HTTP connection (a secret one with its prefix, and bare), the query of an HTTP
    /// connection's URL and each of its values (as written), every `env` value of a stdio
    /// connection.
    pub fn secret_values(&self) -> Vec<String> {
        let mut out: Vec<String> = self.secrets.values().map(|s| s.0.clone()).collect();
        if let Some((_, key)) = &self.trace.key {
            out.push(key.0.clone());
        }
        for server in self.connections.values() {
            match server {
                UpstreamServer::Stdio(s) => out.extend(s.env.values().cloned()),
                UpstreamServer::Http(h) => {
                    // A key in the URL's query (`?api_key=…`): the host's transport errors
                    // name the URL, so its query and each of its values, as written.
                    if let Some(query) = h
                        .url
                        .parse::<http::Uri>()
                        .ok()
                        .and_then(|u| u.query().map(str::to_owned))
                    {
                        out.extend(
                            query
                                .split('&')
                                .filter_map(|pair| pair.split_once('=').map(|(_, v)| v.to_owned())),
                        );
                        out.push(query);
                    }
                    for header in &h.headers {
                        match &header.value {
                            HeaderValueSource::Literal(v) => out.push(v.clone()),
                            HeaderValueSource::Secret { prefix, value, .. } => {
                                out.push(format!("{prefix}{}", value.0));
                                out.push(value.0.clone());
                            }
                        }
                    }
                }
            }
        }
        out
    }

    /// A configuration with no connections or mappings and every other setting at its
    /// default (state folder unset, no re-discovery interval, no cache, the OS user as
    /// requester, the implicit profile, the built-in policy).
    pub fn empty() -> Self {
        let mut profiles = BTreeMap::new();
        profiles.insert(
            IMPLICIT_PROFILE.to_string(),
            Profile::everything(IMPLICIT_PROFILE),
        );
        Self {
            connections: BTreeMap::new(),
            mappings: Vec::new(),
            contract_packages: Vec::new(),
            mappings_dir: None,
            state_dir: None,
            store: StoreSetting::Sqlite,
            snapshot_interval: None,
            start_timeout: DEFAULT_START_TIMEOUT,
            cache_dir: None,
            secrets: BTreeMap::new(),
            requester: RequesterConfig::default(),
            profiles,
            default_profile: None,
            policy_files: Vec::new(),
            approvals: ApprovalSettings::default(),
            http: Default::default(),
            trace: TraceSettings::default(),
            telemetry: TelemetrySettings::default(),
        }
    }

    /// The profile named `requested`, else `default_profile`, else the only profile.
    ///
    /// # Errors
    /// The name is not a configured profile, or several profiles exist and none is chosen.
    pub fn profile(&self, requested: Option<&str>) -> Result<&Profile> {
        let name = match requested.or(self.default_profile.as_deref()) {
            Some(name) => name,
            None if self.profiles.len() == 1 => {
                return Ok(self.profiles.values().next().expect("one profile"));
            }
            None => bail!(
                "the configuration defines several profiles ({}) and no default_profile: choose one with --profile",
                self.profiles.keys().cloned().collect::<Vec<_>>().join(", ")
            ),
        };
        self.profiles.get(name).with_context(|| {
            format!(
                "profile `{name}` is not defined; the configuration defines: {}",
                self.profiles.keys().cloned().collect::<Vec<_>>().join(", ")
            )
        })
    }
}

/// The name of the operating-system user running this process (`getpwuid_r` of the
/// effective uid), else `uid-<n>`.
pub fn os_user_name() -> String {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    let mut buf = vec![0 as libc::c_char; 4096];
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut result: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call; buf outlives the use of pwd's fields.
    let rc = unsafe { libc::getpwuid_r(uid, &mut pwd, buf.as_mut_ptr(), buf.len(), &mut result) };
    if rc == 0 && !result.is_null() && !pwd.pw_name.is_null() {
        // SAFETY: pw_name points into buf, NUL-terminated by getpwuid_r.
        let name = unsafe { std::ffi::CStr::from_ptr(pwd.pw_name) };
        if let Ok(name) = name.to_str()
            && !name.is_empty()
        {
            return name.to_string();
        }
    }
    format!("uid-{uid}")
}

pub use airlock_core::Secret;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    connection: Vec<RawConnection>,
    #[serde(default)]
    mapping: Vec<RawMapping>,
    #[serde(default)]
    contract: Vec<RawContract>,
    #[serde(default)]
    secrets: BTreeMap<String, RawSecret>,
    mappings_dir: Option<PathBuf>,
    state_dir: Option<PathBuf>,
    store: Option<String>,
    snapshot_interval: Option<String>,
    start_timeout: Option<String>,
    #[serde(default)]
    policy: Vec<PathBuf>,
    default_profile: Option<String>,
    requester: Option<RawRequester>,
    #[serde(default)]
    profile: Vec<RawProfile>,
    approvals: Option<RawApprovals>,
    http: Option<crate::front::http::RawHttp>,
    trace: Option<RawTrace>,
    telemetry: Option<RawTelemetry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTelemetry {
    metrics: Option<String>,
    otlp: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTrace {
    key: Option<String>,
    checkpoint_file: Option<PathBuf>,
    checkpoint_interval: Option<String>,
    retain: Option<String>,
    retain_events: Option<i64>,
    archive_dir: Option<PathBuf>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRequester {
    name: Option<String>,
    #[serde(default)]
    roles: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProfile {
    name: String,
    capabilities: Vec<String>,
    connections: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawApprovals {
    ttl: Option<String>,
    elicitation_timeout: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSecret {
    env: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConnection {
    name: String,
    command: Option<String>,
    args: Option<Vec<String>>,
    cwd: Option<PathBuf>,
    env: Option<BTreeMap<String, String>>,
    owner: Option<String>,
    credential_scope: Option<String>,
    identity_files: Option<Vec<PathBuf>>,
    url: Option<String>,
    allow_insecure_http: Option<bool>,
    headers: Option<BTreeMap<String, RawHeader>>,
    confine: Option<bool>,
    namespaces: Option<bool>,
    grants: Option<RawProcessGrants>,
    limits: Option<RawProcessLimits>,
}

/// `[connection.grants]` of a stdio connection: what its confined server may reach
/// beyond the defaults (crate::upstream::confine).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProcessGrants {
    #[serde(default)]
    filesystem: Vec<RawPathGrant>,
    #[serde(default)]
    network: RawProcessNetwork,
}

/// One `[[connection.grants.filesystem]]` entry.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPathGrant {
    path: PathBuf,
    access: crate::upstream::confine::Access,
}

/// `[connection.grants.network]`.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawProcessNetwork {
    #[serde(default)]
    tcp_connect: Vec<String>,
}

/// `[connection.limits]` of a confined stdio connection.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProcessLimits {
    processes: Option<u64>,
    open_files: Option<u64>,
    address_space: Option<u64>,
}

/// One header of an HTTP connection: exactly one of `secret` (with an optional `prefix`)
/// or `value`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHeader {
    secret: Option<String>,
    prefix: Option<String>,
    value: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMapping {
    manifest: PathBuf,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawContract {
    path: PathBuf,
}

impl ServeConfig {
    /// Reads the configuration at `path`.
    ///
    /// # Errors
    /// Unreadable file, TOML errors, unknown keys, duplicate connection names, a command
    /// that cannot be found, a working directory that does not exist.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading serve configuration {}", path.display()))?;
        let path = &std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
        let base = path
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        let base = if base.as_os_str().is_empty() {
            PathBuf::from(".")
        } else {
            base
        };
        Self::parse(&text, &base).with_context(|| format!("serve configuration {}", path.display()))
    }

    /// Parses configuration `text`, resolving relative paths against `base`.
    ///
    /// # Errors
    /// As [`ServeConfig::load`].
    pub fn parse(text: &str, base: &Path) -> Result<Self> {
        let raw: RawConfig = toml::from_str(text)?;
        let secrets = secrets(raw.secrets)?;
        let connections = connections(raw.connection, &secrets, base)?;
        let mappings_dir = raw.mappings_dir.map(|d| base.join(d));
        if raw.mapping.is_empty() && mappings_dir.is_none() {
            bail!(
                "the configuration defines no [[mapping]] and no mappings_dir: there would be nothing to serve"
            );
        }
        let snapshot_interval = snapshot_interval(raw.snapshot_interval)?;
        let start_timeout = match raw.start_timeout {
            None => DEFAULT_START_TIMEOUT,
            Some(text) => parse_bounded_duration("start_timeout", &text, 1, 600)?,
        };
        let mappings = listed_once(
            raw.mapping.iter().map(|m| base.join(&m.manifest)),
            "mapping manifest",
        )?;
        let contract_packages = listed_once(
            raw.contract.iter().map(|c| base.join(&c.path)),
            "contract package",
        )?;
        let requester = requester(raw.requester)?;
        let profiles = profiles(raw.profile, &connections)?;
        if let Some(name) = &raw.default_profile
            && !profiles.contains_key(name)
        {
            bail!(
                "default_profile `{name}` is not a defined profile (defined: {})",
                profiles.keys().cloned().collect::<Vec<_>>().join(", ")
            );
        }
        let policy_files = listed_once(raw.policy.iter().map(|f| base.join(f)), "policy file")?;
        let approvals = approvals(raw.approvals)?;
        let store = match raw.store.as_deref() {
            None => StoreSetting::Sqlite,
            Some(text) => StoreSetting::parse(text).context("store")?,
        };
        let trace = trace(raw.trace, &secrets, base)?;
        Ok(Self {
            connections,
            mappings,
            contract_packages,
            mappings_dir,
            state_dir: raw.state_dir.map(|d| base.join(d)),
            store,
            snapshot_interval,
            start_timeout,
            cache_dir: None,
            secrets,
            requester,
            profiles,
            default_profile: raw.default_profile,
            policy_files,
            approvals,
            http: crate::front::http::HttpSettings::from_raw(raw.http, base)?,
            trace,
            telemetry: telemetry(raw.telemetry)?,
        })
    }
}

/// `[telemetry]`: `metrics` must be a socket address (`127.0.0.1:9464`, `[::1]:9464`),
/// `otlp` an http(s) URL ([`crate::telemetry::traces_url`]).
fn telemetry(raw: Option<RawTelemetry>) -> Result<TelemetrySettings> {
    let Some(t) = raw else {
        return Ok(TelemetrySettings::default());
    };
    Ok(TelemetrySettings {
        metrics: t.metrics.map(|a| parse_metrics_addr(&a)).transpose()?,
        otlp: t
            .otlp
            .map(|u| crate::telemetry::traces_url(&u))
            .transpose()
            .context("[telemetry] otlp")?,
    })
}

/// A metrics listener's address, as `[telemetry] metrics` or `serve --metrics` gives it.
///
/// # Errors
/// Not an IP address and port (host names are not resolved).
pub fn parse_metrics_addr(text: &str) -> Result<std::net::SocketAddr> {
    text.parse().with_context(|| {
        format!("metrics address `{text}`: expected an IP address and port such as 127.0.0.1:9464 or [::1]:9464")
    })
}

/// `[secrets]`: each value read from the environment variable it names, now (a missing
/// or non-UTF-8 variable is an error naming both).
fn secrets(raw: BTreeMap<String, RawSecret>) -> Result<BTreeMap<String, Secret>> {
    let mut secrets = BTreeMap::new();
    for (name, source) in raw {
        let value = std::env::var(&source.env).with_context(|| {
            format!(
                "secret `{name}`: environment variable {} is not set (or not UTF-8)",
                source.env
            )
        })?;
        secrets.insert(name, Secret(value));
    }
    Ok(secrets)
}

/// `[[connection]]`s by name: each either `command` (stdio) or `url` (Streamable HTTP),
/// never both or neither; a name defined twice is an error.
fn connections(
    raw: Vec<RawConnection>,
    secrets: &BTreeMap<String, Secret>,
    base: &Path,
) -> Result<BTreeMap<String, UpstreamServer>> {
    let mut connections = BTreeMap::new();
    for mut c in raw {
        check_name("connection", &c.name)?;
        let name = c.name.clone();
        let server: UpstreamServer = match (c.command.take(), c.url.take()) {
            (Some(_), Some(_)) => bail!(
                "connection `{name}`: give either `command` (a child process over stdio) or `url` (Streamable HTTP), not both"
            ),
            (None, None) => bail!(
                "connection `{name}`: give `command` (a child process over stdio) or `url` (Streamable HTTP)"
            ),
            (None, Some(url)) => http_connection(c, url, secrets)?.into(),
            (Some(command), None) => stdio_connection(c, &command, base)?.into(),
        };
        if connections.insert(name.clone(), server).is_some() {
            bail!("connection `{name}` is defined twice");
        }
    }
    Ok(connections)
}

/// `snapshot_interval`: [`DEFAULT_SNAPSHOT_INTERVAL`] when absent, `None` for `"off"`,
/// else a duration of at least 1 s.
fn snapshot_interval(raw: Option<String>) -> Result<Option<std::time::Duration>> {
    match raw {
        None => Ok(Some(DEFAULT_SNAPSHOT_INTERVAL)),
        Some(text) if text == "off" => Ok(None),
        Some(text) => {
            let d = humantime::parse_duration(&text).with_context(|| {
                format!(
                    "snapshot_interval `{text}`: expected a duration such as \"10m\", or \"off\""
                )
            })?;
            if d < std::time::Duration::from_secs(1) {
                bail!("snapshot_interval `{text}` is shorter than the minimum of 1s");
            }
            Ok(Some(d))
        }
    }
}

/// `paths` in order, refusing one listed twice (`what` names it in the error).
fn listed_once(paths: impl Iterator<Item = PathBuf>, what: &str) -> Result<Vec<PathBuf>> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for path in paths {
        if !seen.insert(path.clone()) {
            bail!("{what} {} is listed twice", path.display());
        }
        out.push(path);
    }
    Ok(out)
}

/// `[requester]`: the stdio front's requester (default: the OS user, no roles); names and
/// roles are checked as principal names.
fn requester(raw: Option<RawRequester>) -> Result<RequesterConfig> {
    let Some(r) = raw else {
        return Ok(RequesterConfig::default());
    };
    let name = match r.name {
        Some(name) => {
            check_principal_name("[requester] name", &name)?;
            name
        }
        None => os_user_name(),
    };
    for role in &r.roles {
        check_principal_name("[requester] roles", role)?;
    }
    Ok(RequesterConfig {
        name,
        roles: r.roles,
    })
}

/// `[[profile]]`s by name (the implicit profile offering everything when none is
/// defined). Each lists capabilities (names, or `["*"]` alone) and optionally the
/// connections it may use, which must be defined in `connections`.
fn profiles(
    raw: Vec<RawProfile>,
    connections: &BTreeMap<String, UpstreamServer>,
) -> Result<BTreeMap<String, Profile>> {
    let mut profiles = BTreeMap::new();
    for p in raw {
        check_name("profile", &p.name)?;
        if p.capabilities.is_empty() {
            bail!(
                "profile `{}`: `capabilities` is empty, so it would offer nothing (list capability names, or [\"*\"] for every one)",
                p.name
            );
        }
        let capabilities = if p.capabilities.iter().any(|c| c == "*") {
            if p.capabilities.len() > 1 {
                bail!(
                    "profile `{}`: `capabilities` mixes \"*\" with names; use one or the other",
                    p.name
                );
            }
            None
        } else {
            let mut set = BTreeSet::new();
            for c in &p.capabilities {
                if !set.insert(c.clone()) {
                    bail!("profile `{}`: capability `{c}` is listed twice", p.name);
                }
            }
            Some(set)
        };
        let connections = match p.connections {
            None => None,
            Some(list) => {
                let mut set = BTreeSet::new();
                for c in list {
                    if !connections.contains_key(&c) {
                        bail!(
                            "profile `{}`: connection `{c}` is not defined in this configuration",
                            p.name
                        );
                    }
                    set.insert(c);
                }
                Some(set)
            }
        };
        let profile = Profile {
            name: p.name.clone(),
            capabilities,
            connections,
        };
        if profiles.insert(p.name.clone(), profile).is_some() {
            bail!("profile `{}` is defined twice", p.name);
        }
    }
    if profiles.is_empty() {
        profiles.insert(
            IMPLICIT_PROFILE.to_string(),
            Profile::everything(IMPLICIT_PROFILE),
        );
    }
    Ok(profiles)
}

/// `[approvals]`: `ttl` (1 s to 7 days) and `elicitation_timeout` (1 s to 1 day).
fn approvals(raw: Option<RawApprovals>) -> Result<ApprovalSettings> {
    let mut approvals = ApprovalSettings::default();
    if let Some(a) = raw {
        if let Some(text) = a.ttl {
            approvals.ttl = parse_bounded_duration("[approvals] ttl", &text, 1, 7 * 24 * 3600)?;
        }
        if let Some(text) = a.elicitation_timeout {
            approvals.elicitation_timeout =
                parse_bounded_duration("[approvals] elicitation_timeout", &text, 1, 24 * 3600)?;
        }
    }
    Ok(approvals)
}

/// `[trace]`: the key (a secret `[secrets]` defines, checked to make a host key now), the
/// checkpoint file and interval (default [`DEFAULT_CHECKPOINT_INTERVAL`], `"off"`, or
/// 1 s to 1 day).
fn trace(
    raw: Option<RawTrace>,
    secrets: &BTreeMap<String, Secret>,
    base: &Path,
) -> Result<TraceSettings> {
    let mut trace = TraceSettings::default();
    let Some(t) = raw else {
        return Ok(trace);
    };
    if let Some(name) = t.key {
        let secret = secrets.get(&name).cloned().with_context(|| {
            format!("[trace] key names secret `{name}`, which [secrets] does not define")
        })?;
        let settings = TraceSettings {
            key: Some((name, secret)),
            ..TraceSettings::default()
        };
        settings.host_key().context("[trace] key")?;
        trace.key = settings.key;
    }
    trace.checkpoint_file = t.checkpoint_file.map(|f| base.join(f));
    trace.checkpoint_interval = match t.checkpoint_interval.as_deref() {
        None => Some(DEFAULT_CHECKPOINT_INTERVAL),
        Some("off") => None,
        Some(text) => Some(parse_bounded_duration(
            "[trace] checkpoint_interval",
            text,
            1,
            24 * 3600,
        )?),
    };
    trace.retain = t
        .retain
        .map(|text| parse_bounded_duration("[trace] retain", &text, 1, 100 * 365 * 24 * 3600))
        .transpose()?;
    trace.retain_events = match t.retain_events {
        Some(n) if !(1_000..=i64::from(u32::MAX)).contains(&n) => bail!(
            "[trace] retain_events {n} must be between 1000 and {} (events kept in the store)",
            u32::MAX
        ),
        other => other,
    };
    trace.archive_dir = t.archive_dir.map(|d| base.join(d));
    if trace.archive_dir.is_some() && !trace.archives() {
        bail!(
            "[trace] archive_dir is set but neither retain nor retain_events is: nothing \
             would be archived (set retain = \"30d\", for example)"
        );
    }
    Ok(trace)
}

/// A `[[connection]]` with `command`: a child process over stdio.
fn stdio_connection(c: RawConnection, command: &str, base: &Path) -> Result<StdioServer> {
    let confine = confinement(&c, base)?;
    if c.allow_insecure_http.is_some() || c.headers.is_some() {
        bail!(
            "connection `{}`: `allow_insecure_http` and `headers` apply only to a connection with `url`",
            c.name
        );
    }
    let cwd = base.join(c.cwd.unwrap_or_else(|| PathBuf::from(".")));
    let cwd = cwd.canonicalize().with_context(|| {
        format!(
            "connection `{}`: working directory {} does not exist",
            c.name,
            cwd.display()
        )
    })?;
    let command =
        resolve_command(command, base).with_context(|| format!("connection `{}`", c.name))?;
    let env = c.env.unwrap_or_default();
    for key in env.keys() {
        if key.is_empty() || key.contains('=') || key.contains('\0') {
            bail!(
                "connection `{}`: invalid environment variable name `{key}`",
                c.name
            );
        }
    }
    Ok(StdioServer {
        command,
        args: c.args.unwrap_or_default(),
        cwd,
        env,
        confine,
        owner: c.owner,
        credential_scope: c.credential_scope,
        identity_files: c
            .identity_files
            .unwrap_or_default()
            .iter()
            .map(|f| base.join(f))
            .collect(),
    })
}

/// A confined stdio connection's server and confinement; `None` for any other.
fn connection_confined(server: &UpstreamServer) -> Option<(&StdioServer, &Confinement)> {
    let server = server.as_stdio()?;
    Some((server, server.confine.as_ref()?))
}

/// Whether a stdio connection is confined when its configuration does not say
/// (`confine`).
pub const CONFINED_BY_DEFAULT: bool = true;

/// The confinement of a stdio connection from `confine`, `namespaces`, `grants` and
/// `limits`: `None` when unconfined (then the other three are refused: they would mean
/// nothing). Granted paths resolve against the configuration's folder; a read-only one
/// must exist, a read-write folder that does not is made (owner-only) when the server
/// starts.
fn confinement(c: &RawConnection, base: &Path) -> Result<Option<Confinement>> {
    let name = &c.name;
    if !c.confine.unwrap_or(CONFINED_BY_DEFAULT) {
        for (key, given) in [
            ("namespaces", c.namespaces.is_some()),
            ("grants", c.grants.is_some()),
            ("limits", c.limits.is_some()),
        ] {
            if given {
                bail!(
                    "connection `{name}`: `{key}` applies only to a confined server; this connection is unconfined (set `confine = true`)"
                );
            }
        }
        return Ok(None);
    }
    let mut confinement = Confinement::deny_by_default();
    if let Some(namespaces) = c.namespaces {
        confinement.namespaces = namespaces;
    }
    if let Some(grants) = &c.grants {
        for grant in &grants.filesystem {
            let path = base.join(&grant.path);
            if grant.access == crate::upstream::confine::Access::ReadWrite && !path.exists() {
                // A server's own data folder: made (owner-only) when the server starts.
                if !path.is_absolute() || path.components().any(|c| c.as_os_str() == "..") {
                    bail!(
                        "connection `{name}`: granted path {} does not exist and is not absolute without `..`",
                        path.display()
                    );
                }
                // Where it will be: its deepest existing folder canonical (the identity
                // does not change once it is made; no symbolic link in what is mounted).
                confinement.paths.push(PathGrant {
                    path: crate::upstream::confine::resolved(&path),
                    access: grant.access,
                });
                continue;
            }
            let path = path.canonicalize().with_context(|| {
                format!(
                    "connection `{name}`: granted path {} does not exist",
                    path.display()
                )
            })?;
            confinement.paths.push(PathGrant {
                path,
                access: grant.access,
            });
        }
        confinement
            .tcp_connect
            .clone_from(&grants.network.tcp_connect);
    }
    crate::upstream::confine::check_network(&confinement)
        .with_context(|| format!("connection `{name}`"))?;
    crate::upstream::confine::check_protected(&confinement.paths, &[])
        .with_context(|| format!("connection `{name}`"))?;
    if let Some(limits) = &c.limits {
        let defaults = crate::upstream::confine::Limits::DEFAULT;
        confinement.limits = crate::upstream::confine::Limits {
            processes: limits.processes.unwrap_or(defaults.processes),
            open_files: limits.open_files.unwrap_or(defaults.open_files),
            address_space: limits.address_space.or(defaults.address_space),
        };
        for (key, value, least) in [
            ("processes", confinement.limits.processes, 1),
            ("open_files", confinement.limits.open_files, 16),
            (
                "address_space",
                confinement.limits.address_space.unwrap_or(u64::MAX),
                16 << 20,
            ),
        ] {
            if value < least {
                bail!("connection `{name}`: limits.{key} = {value} is below {least}");
            }
        }
    }
    Ok(Some(confinement))
}

/// A `[[connection]]` with `url`: Streamable HTTP (rules: [`crate::upstream::http`]).
fn http_connection(
    c: RawConnection,
    url: String,
    secrets: &BTreeMap<String, Secret>,
) -> Result<HttpServer> {
    let name = &c.name;
    for (key, given) in [
        ("args", c.args.is_some()),
        ("cwd", c.cwd.is_some()),
        ("env", c.env.is_some()),
        ("identity_files", c.identity_files.is_some()),
        ("confine", c.confine.is_some()),
        ("namespaces", c.namespaces.is_some()),
        ("grants", c.grants.is_some()),
        ("limits", c.limits.is_some()),
    ] {
        if given {
            bail!(
                "connection `{name}`: `{key}` applies only to a connection with `command`; an HTTP connection (`url`) has no process"
            );
        }
    }
    let allow_insecure_http = c.allow_insecure_http.unwrap_or(false);
    crate::upstream::http::check_url(name, &url, allow_insecure_http)?;
    let mut headers = Vec::new();
    let mut seen = BTreeSet::new();
    for (header, raw) in c.headers.unwrap_or_default() {
        if !seen.insert(header.to_ascii_lowercase()) {
            bail!("connection `{name}`: header `{header}` is given twice (names ignore case)");
        }
        let value = match (raw.secret, raw.value) {
            (Some(_), Some(_)) => bail!(
                "connection `{name}`: header `{header}` takes either `secret` or `value`, not both"
            ),
            (None, None) => bail!(
                "connection `{name}`: header `{header}` needs `secret = \"NAME\"` (a [secrets] entry) or, for a non-credential header, `value`"
            ),
            (Some(secret), None) => {
                crate::upstream::http::check_header(name, &header, false)?;
                let value = secrets.get(&secret).cloned().with_context(|| {
                    format!(
                        "connection `{name}`: header `{header}` names secret `{secret}`, which [secrets] does not define"
                    )
                })?;
                HeaderValueSource::Secret {
                    name: secret,
                    prefix: raw.prefix.unwrap_or_default(),
                    value,
                }
            }
            (None, Some(value)) => {
                if raw.prefix.is_some() {
                    bail!(
                        "connection `{name}`: header `{header}`: `prefix` goes with `secret`, not with a literal `value`"
                    );
                }
                crate::upstream::http::check_header(name, &header, true)?;
                HeaderValueSource::Literal(value)
            }
        };
        // Checked here, so a bad value fails at load with the header's name (never the
        // value itself).
        let text = match &value {
            HeaderValueSource::Literal(v) => v.clone(),
            HeaderValueSource::Secret { prefix, value, .. } => format!("{prefix}{}", value.0),
        };
        if http::HeaderValue::from_str(&text).is_err() {
            bail!(
                "connection `{name}`: the value of header `{header}` is not a valid header value (control characters or non-ASCII)"
            );
        }
        headers.push(HttpHeader {
            name: header,
            value,
        });
    }
    Ok(HttpServer {
        url,
        headers,
        allow_insecure_http,
        owner: c.owner,
        credential_scope: c.credential_scope,
    })
}

/// A name of the configuration's own things (connections, profiles): `[a-z0-9-_]+`.
fn check_name(what: &str, name: &str) -> Result<()> {
    if name.is_empty()
        || name.len() > 64
        || !name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
    {
        bail!("{what} name `{name}` must be 1 to 64 of a-z, 0-9, `-`, `_`");
    }
    Ok(())
}

/// A principal or role name: 1 to 128 printable characters, no control characters.
fn check_principal_name(what: &str, name: &str) -> Result<()> {
    if name.is_empty() || name.len() > 128 || name.chars().any(char::is_control) {
        bail!(
            "{what} `{}` must be 1 to 128 printable characters",
            name.escape_debug()
        );
    }
    Ok(())
}

/// Parses a duration such as "15m" between `min_s` and `max_s` seconds.
fn parse_bounded_duration(
    what: &str,
    text: &str,
    min_s: u64,
    max_s: u64,
) -> Result<std::time::Duration> {
    let d = humantime::parse_duration(text)
        .with_context(|| format!("{what} `{text}`: expected a duration such as \"15m\""))?;
    if d < std::time::Duration::from_secs(min_s) || d > std::time::Duration::from_secs(max_s) {
        bail!("{what} `{text}` must be between {min_s} s and {max_s} s");
    }
    Ok(d)
}

/// The default compiled-component cache: `$XDG_CACHE_HOME/airlock/compiled`, else
/// `$HOME/.cache/airlock/compiled`, else none.
pub fn default_cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|h| PathBuf::from(h).join(".cache"))
        })?;
    Some(base.join("airlock").join("compiled"))
}

/// The default state folder: `$XDG_STATE_HOME/airlock`, else `$HOME/.local/state/airlock`,
/// else none.
pub fn default_state_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_STATE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|h| PathBuf::from(h).join(".local").join("state"))
        })?;
    Some(base.join("airlock"))
}

/// Resolves a configured command to an executable path.
fn resolve_command(command: &str, base: &Path) -> Result<PathBuf> {
    if command == SELF_COMMAND {
        return std::env::current_exe().context("locating the airlock executable");
    }
    if command.is_empty() {
        bail!("command is empty");
    }
    let candidate = Path::new(command);
    if candidate.components().count() > 1 || candidate.is_absolute() {
        let path = base.join(candidate);
        if !path.is_file() {
            bail!("command {} does not exist", path.display());
        }
        return Ok(path.canonicalize()?);
    }
    let search = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&search)
        .map(|dir| dir.join(command))
        .find(|p| p.is_file())
        .with_context(|| format!("command `{command}` was not found on PATH"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_configuration_secrets_are_what_is_redacted() {
        // PATH: a variable every test environment has, standing in for a token.
        let path = std::env::var("PATH").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let config = ServeConfig::parse(
            r#"
mappings_dir = "mappings"

[secrets]
token = { env = "PATH" }

[[connection]]
name = "local"
command = "/bin/sh"
env = { API_KEY = "k-1234567890" }

[[connection]]
name = "remote"
url = "http://127.0.0.1:9/mcp?tenant=t1&api_key=q-5ecret-77"
headers = { "Authorization" = { secret = "token", prefix = "Bearer " }, "X-Tenant" = { value = "tenant-acme" } }
"#,
            dir.path(),
        )
        .unwrap();
        let r = crate::record::Redaction::new(config.secret_values(), &[]);
        let mut v = json!({
            "a": format!("Bearer {path}"),
            "b": "key k-1234567890 used",
            "c": "for tenant-acme",
            "d": "nothing secret",
            "e": "the HTTP request to http://127.0.0.1:9/mcp?tenant=t1&api_key=q-5ecret-77 failed",
            "f": "echoed q-5ecret-77",
        });
        r.apply(&mut v);
        assert_eq!(
            v,
            json!({
                "a": "[redacted]",
                "b": "key [redacted] used",
                "c": "for [redacted]",
                "d": "nothing secret",
                "e": "the HTTP request to http://127.0.0.1:9/mcp?[redacted] failed",
                "f": "echoed [redacted]",
            })
        );
    }

    #[test]
    fn relative_paths_resolve_against_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = ServeConfig::parse(
            "[[connection]]\nname = \"notes\"\ncommand = \"@airlock\"\nargs = [\"fixture\"]\n[[mapping]]\nmanifest = \"m/mapping.toml\"\n",
            dir.path(),
        )
        .unwrap();
        assert_eq!(cfg.mappings, vec![dir.path().join("m/mapping.toml")]);
        let notes = cfg.connections["notes"].as_stdio().unwrap();
        assert!(notes.env.is_empty(), "no environment unless declared");
        assert_eq!(notes.cwd, dir.path().canonicalize().unwrap());
    }

    #[test]
    fn hostile_configs_fail_clearly() {
        let dir = tempfile::tempdir().unwrap();
        let cases = [
            (
                "[[connection]]\nname = \"a\"\ncommand = \"@airlock\"\n[[connection]]\nname = \"a\"\ncommand = \"@airlock\"\n",
                "twice",
            ),
            (
                "[[connection]]\nname = \"a\"\ncommand = \"no-such-binary-xyz\"\n",
                "not found on PATH",
            ),
            (
                "[[connection]]\nname = \"a\"\ncommand = \"./missing\"\n",
                "does not exist",
            ),
            (
                "[[connection]]\nname = \"a\"\ncommand = \"@airlock\"\ncwd = \"nowhere\"\n",
                "working directory",
            ),
            (
                "[[connection]]\nname = \"A B\"\ncommand = \"@airlock\"\n",
                "must be",
            ),
            (
                "[[connection]]\nname = \"a\"\ncommand = \"@airlock\"\nenv = { \"X=Y\" = \"1\" }\n",
                "environment variable",
            ),
            (
                "[[connection]]\nname = \"a\"\ncommand = \"@airlock\"\ninherit_env = true\n",
                "unknown field",
            ),
            (
                "[[mapping]]\nmanifest = \"m.toml\"\n[[mapping]]\nmanifest = \"m.toml\"\n",
                "twice",
            ),
            ("", "no [[mapping]]"),
            (
                "mappings_dir = \"m\"\nsnapshot_interval = \"soon\"\n",
                "snapshot_interval",
            ),
            (
                "mappings_dir = \"m\"\nsnapshot_interval = \"10ms\"\n",
                "minimum",
            ),
            (
                "[[connection]]\nname = \"a\"\ncommand = \"@airlock\"\n",
                "no [[mapping]]",
            ),
        ];
        for (text, needle) in cases {
            let err = format!("{:#}", ServeConfig::parse(text, dir.path()).unwrap_err());
            assert!(err.contains(needle), "expected `{needle}` in: {err}");
        }
    }

    const MAPPING: &str = "[[mapping]]\nmanifest = \"m/mapping.toml\"\n";

    #[test]
    fn the_store_setting_selects_sqlite_or_postgres_and_refuses_anything_else() {
        let dir = tempfile::tempdir().unwrap();
        let parse =
            |store: &str| ServeConfig::parse(&format!("store = {store:?}\n{MAPPING}"), dir.path());
        assert_eq!(
            ServeConfig::parse(MAPPING, dir.path()).unwrap().store,
            StoreSetting::Sqlite
        );
        assert_eq!(parse("sqlite").unwrap().store, StoreSetting::Sqlite);
        for target in [
            "postgres://airlock:pw@localhost/airlock",
            "postgresql:///airlock?host=/run/postgresql",
            "host=/run/postgresql dbname=airlock",
        ] {
            assert_eq!(
                parse(target).unwrap().store,
                StoreSetting::Postgres(target.into())
            );
        }
        let shown = format!("{:?}", parse("postgres://u:hunter2@localhost/db").unwrap());
        assert!(!shown.contains("hunter2"), "the password in Debug: {shown}");
        for (hostile, says) in [
            ("mysql://u:hunter2@h/db", "must be \"sqlite\""),
            ("", "must be \"sqlite\""),
            ("/var/lib/airlock/airlock.db", "must be \"sqlite\""),
            (
                "postgres://u:hunter2@[::1/db",
                "not a PostgreSQL connection string",
            ),
            ("postgres://u:hunter2@localhost/db?sslmode=require", "TLS"),
            (
                "host=/tmp bogus_option=hunter2",
                "not a PostgreSQL connection string",
            ),
        ] {
            let err = format!("{:#}", parse(hostile).unwrap_err());
            assert!(err.contains(says), "{hostile}: {err}");
            assert!(err.contains("store"), "{hostile}: {err}");
            assert!(!err.contains("hunter2"), "{hostile}: the password in {err}");
        }
    }

    #[test]
    fn the_trace_table_names_a_key_and_where_checkpoints_go() {
        let dir = tempfile::tempdir().unwrap();
        // SAFETY: the variable names are this test's own; no other test reads or writes them.
        unsafe {
            std::env::set_var("AIRLOCK_CONFIG_TEST_TRACE_KEY", "k".repeat(32));
            std::env::set_var("AIRLOCK_CONFIG_TEST_SHORT_KEY", "short");
        }
        let secrets = "[secrets]\nk = { env = \"AIRLOCK_CONFIG_TEST_TRACE_KEY\" }\nshort = { env = \"AIRLOCK_CONFIG_TEST_SHORT_KEY\" }\n";
        let cfg = ServeConfig::parse(
            &format!("{MAPPING}[trace]\nkey = \"k\"\ncheckpoint_file = \"anchor/c.jsonl\"\ncheckpoint_interval = \"off\"\n{secrets}"),
            dir.path(),
        )
        .unwrap();
        let key = cfg.trace.host_key().unwrap().unwrap();
        assert_eq!(key.source(), &crate::store::KeySource::Secret("k".into()));
        assert_eq!(cfg.trace.checkpoint_interval, None);
        assert_eq!(
            cfg.trace.checkpoint_path(Path::new("/state")),
            dir.path().join("anchor/c.jsonl")
        );
        let retained = ServeConfig::parse(
            &format!(
                "{MAPPING}[trace]\nretain = \"30d\"\nretain_events = 5000\narchive_dir = \"old\"\n"
            ),
            dir.path(),
        )
        .unwrap();
        assert_eq!(
            retained.trace.retain,
            Some(std::time::Duration::from_secs(30 * 86_400))
        );
        assert_eq!(retained.trace.retain_events, Some(5000));
        assert_eq!(
            retained.trace.archive_path(Path::new("/state")),
            dir.path().join("old")
        );
        let defaults = ServeConfig::parse(MAPPING, dir.path()).unwrap();
        assert_eq!(defaults.trace, TraceSettings::default());
        assert!(!defaults.trace.archives(), "by default every event stays");
        assert_eq!(
            defaults.trace.archive_path(Path::new("/state")),
            Path::new("/state/trace-archive")
        );
        assert_eq!(
            defaults.trace.checkpoint_path(Path::new("/state")),
            Path::new("/state/trace-checkpoints.jsonl")
        );
        for (table, needle) in [
            (
                "[trace]\nkey = \"nope\"\n",
                "which [secrets] does not define",
            ),
            ("[trace]\nkey = \"short\"\n", "at least 32"),
            (
                "[trace]\ncheckpoint_interval = \"soon\"\n",
                "checkpoint_interval",
            ),
            ("[trace]\ncheckpoint_interval = \"10ms\"\n", "between 1 s"),
            ("[trace]\nkeys = \"k\"\n", "unknown field"),
            (
                "[trace]\nretain = \"0s\"\n",
                "[trace] retain `0s` must be between 1 s",
            ),
            (
                "[trace]\nretain = \"forever\"\n",
                "[trace] retain `forever`",
            ),
            (
                "[trace]\nretain_events = 10\n",
                "retain_events 10 must be between 1000",
            ),
            ("[trace]\nretain_events = -1\n", "must be between 1000"),
            ("[trace]\nretain_events = \"many\"\n", "retain_events"),
            (
                "[trace]\narchive_dir = \"a\"\n",
                "neither retain nor retain_events",
            ),
        ] {
            let err = ServeConfig::parse(&format!("{MAPPING}{table}{secrets}"), dir.path())
                .map(|_| ())
                .unwrap_err();
            let err = format!("{err:#}");
            assert!(err.contains(needle), "expected `{needle}` in: {err}");
            assert!(!err.contains(&"k".repeat(32)), "the key in an error: {err}");
        }
    }

    #[test]
    fn an_http_connection_takes_its_credential_from_a_named_secret() {
        let dir = tempfile::tempdir().unwrap();
        // SAFETY: the variable name is this test's own; no other test reads or writes it.
        unsafe { std::env::set_var("AIRLOCK_CONFIG_TEST_HTTP_SECRET", "v4lue") };
        let cfg = ServeConfig::parse(
            &format!(
                "[[connection]]\nname = \"remote\"\nurl = \"https://mcp.example.com/mcp\"\ncredential_scope = \"ro\"\nheaders = {{ \"Authorization\" = {{ secret = \"tok\", prefix = \"Bearer \" }}, \"X-Tenant\" = {{ value = \"acme\" }} }}\n{MAPPING}[secrets]\ntok = {{ env = \"AIRLOCK_CONFIG_TEST_HTTP_SECRET\" }}\n"
            ),
            dir.path(),
        )
        .unwrap();
        let UpstreamServer::Http(h) = &cfg.connections["remote"] else {
            panic!("not an HTTP connection");
        };
        assert_eq!(h.url, "https://mcp.example.com/mcp");
        assert_eq!(h.credential_scope.as_deref(), Some("ro"));
        assert!(!h.allow_insecure_http);
        assert_eq!(h.headers.len(), 2);
        assert!(matches!(
            &h.headers[0].value,
            HeaderValueSource::Secret { name, prefix, value }
                if name == "tok" && prefix == "Bearer " && value.0 == "v4lue"
        ));
        assert_eq!(
            h.headers[1].value,
            HeaderValueSource::Literal("acme".into())
        );
        assert!(
            !format!("{cfg:?}").contains("v4lue"),
            "Debug shows the secret"
        );
    }

    #[test]
    fn a_confined_server_beside_the_state_is_refused_at_start_and_an_unconfined_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        // The command sits in the folder that holds the state: its install folder, read
        // by default, would expose the store.
        std::fs::write(root.join("server"), "#!/bin/sh\n").unwrap();
        let text = |confine: bool| {
            format!(
                "state_dir = \"state\"\n[[connection]]\nname = \"n\"\ncommand = \"./server\"\nconfine = {confine}\n{MAPPING}"
            )
        };
        let cfg = ServeConfig::parse(&text(true), &root).unwrap();
        let e = cfg.check_confinement().unwrap_err();
        let chain = format!("{e:#}");
        assert!(chain.contains("install folder"), "{chain}");
        assert!(chain.contains("must never reach"), "{chain}");
        let cfg = ServeConfig::parse(&text(false), &root).unwrap();
        cfg.check_confinement().unwrap();
        // A declared grant that holds the checkpoint file, elsewhere than the state.
        std::fs::create_dir_all(root.join("app")).unwrap();
        std::fs::rename(root.join("server"), root.join("app/server")).unwrap();
        let cfg = ServeConfig::parse(
            &format!(
                "state_dir = \"state\"\n[trace]\ncheckpoint_file = \"anchor/c.jsonl\"\n[[connection]]\nname = \"n\"\ncommand = \"app/server\"\n[[connection.grants.filesystem]]\npath = \"anchor\"\naccess = \"read-write\"\n{MAPPING}"
            ),
            &root,
        )
        .unwrap();
        let e = cfg.check_confinement().unwrap_err();
        assert!(format!("{e:#}").contains("c.jsonl"), "{e:#}");
    }

    #[test]
    fn a_confined_connection_reads_its_grants_and_limits() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("docs")).unwrap();
        let cfg = ServeConfig::parse(
            &format!(
                "[[connection]]\nname = \"n\"\ncommand = \"@airlock\"\nconfine = true\nnamespaces = false\n[[connection.grants.filesystem]]\npath = \"docs\"\naccess = \"read-write\"\n[connection.limits]\nprocesses = 32\naddress_space = 1073741824\n{MAPPING}"
            ),
            dir.path(),
        )
        .unwrap();
        let s = cfg.connections["n"].as_stdio().unwrap();
        let c = s.confine.as_ref().expect("confined");
        assert!(!c.namespaces);
        assert_eq!(c.paths.len(), 1);
        assert_eq!(
            c.paths[0].path,
            dir.path().join("docs").canonicalize().unwrap()
        );
        assert_eq!(
            c.paths[0].access,
            crate::upstream::confine::Access::ReadWrite
        );
        assert_eq!(c.limits.processes, 32);
        assert_eq!(c.limits.open_files, 1024);
        assert_eq!(c.limits.address_space, Some(1 << 30));
        // A read-write folder that does not exist yet is accepted, and not made by reading.
        let cfg = ServeConfig::parse(
            &format!(
                "[[connection]]\nname = \"n\"\ncommand = \"@airlock\"\n[[connection.grants.filesystem]]\npath = \"new/data\"\naccess = \"read-write\"\n{MAPPING}"
            ),
            dir.path(),
        )
        .unwrap();
        let c = cfg.connections["n"]
            .as_stdio()
            .unwrap()
            .confine
            .clone()
            .unwrap();
        assert_eq!(c.paths[0].path, dir.path().join("new/data"));
        assert!(!dir.path().join("new").exists());
        // Unset: as CONFINED_BY_DEFAULT says.
        let cfg = ServeConfig::parse(
            &format!("[[connection]]\nname = \"n\"\ncommand = \"@airlock\"\n{MAPPING}"),
            dir.path(),
        )
        .unwrap();
        assert_eq!(
            cfg.connections["n"].as_stdio().unwrap().confine.is_some(),
            CONFINED_BY_DEFAULT
        );
    }

    #[test]
    fn hostile_confinement_settings_fail_clearly() {
        let dir = tempfile::tempdir().unwrap();
        let cmd = "command = \"@airlock\"\n";
        let cases: Vec<(String, &str)> = vec![
            (
                format!("{cmd}confine = false\nnamespaces = true\n"),
                "`namespaces` applies only to a confined server",
            ),
            (
                format!("{cmd}confine = false\n[connection.limits]\nprocesses = 3\n"),
                "`limits` applies only to a confined server",
            ),
            (
                format!(
                    "{cmd}confine = true\n[[connection.grants.filesystem]]\npath = \"nowhere\"\naccess = \"read-only\"\n"
                ),
                "does not exist",
            ),
            (
                format!(
                    "{cmd}confine = true\n[[connection.grants.filesystem]]\npath = \"/\"\naccess = \"read-only\"\n"
                ),
                "the whole filesystem",
            ),
            (
                format!(
                    "{cmd}confine = true\n[[connection.grants.filesystem]]\npath = \".\"\naccess = \"everything\"\n"
                ),
                "unknown variant",
            ),
            (
                format!(
                    "{cmd}confine = true\nnamespaces = false\n[connection.grants.network]\ntcp_connect = [\"api.example.com:443\"]\n"
                ),
                "needs `namespaces = true`",
            ),
            (
                format!(
                    "{cmd}confine = true\n[connection.grants.network]\ntcp_connect = [\"api.example.com\"]\n"
                ),
                "has no port",
            ),
            (
                format!(
                    "{cmd}confine = true\n[connection.grants.network]\ntcp_connect = [\"bad host:443\"]\n"
                ),
                "not an IP address, CIDR network or DNS name",
            ),
            (
                format!("{cmd}confine = true\n[connection.limits]\nopen_files = 3\n"),
                "limits.open_files = 3 is below 16",
            ),
            (
                format!("{cmd}confine = true\n[connection.limits]\nthreads = 3\n"),
                "unknown field",
            ),
            (
                "url = \"https://a.example/mcp\"\nconfine = true\n".into(),
                "`confine` applies only",
            ),
        ];
        for (body, expected) in cases {
            let text = format!("[[connection]]\nname = \"n\"\n{body}{MAPPING}");
            let e = ServeConfig::parse(&text, dir.path()).unwrap_err();
            let chain = format!("{e:#}");
            assert!(chain.contains(expected), "{body}: {chain}");
        }
    }

    #[test]
    fn hostile_http_connections_fail_clearly() {
        let dir = tempfile::tempdir().unwrap();
        // SAFETY: the variable name is this test's own; no other test reads or writes it.
        unsafe { std::env::set_var("AIRLOCK_CONFIG_TEST_BAD_SECRET", "line\nbreak") };
        let url = "url = \"https://a.example/mcp\"\n";
        let cases: Vec<(String, &str)> = vec![
            (format!("command = \"@airlock\"\n{url}"), "not both"),
            (String::new(), "give `command`"),
            (format!("{url}args = []\n"), "`args` applies only"),
            (format!("{url}cwd = \".\"\n"), "`cwd` applies only"),
            (format!("{url}env = {{}}\n"), "`env` applies only"),
            (
                format!("{url}identity_files = []\n"),
                "`identity_files` applies only",
            ),
            (format!("{url}inherit_env = true\n"), "unknown field"),
            (
                "command = \"@airlock\"\nheaders = {}\n".into(),
                "apply only to a connection with `url`",
            ),
            (
                "command = \"@airlock\"\nallow_insecure_http = true\n".into(),
                "apply only to a connection with `url`",
            ),
            (
                "url = \"http://192.168.1.9/mcp\"\n".into(),
                "allow_insecure_http = true",
            ),
            ("url = \"ftp://a.example/\"\n".into(), "scheme `ftp`"),
            ("url = \"https://u:p@a.example/\"\n".into(), "user-info"),
            ("url = \"\"\n".into(), "url"),
            (
                format!("{url}headers = {{ \"Authorization\" = {{ value = \"Bearer abc\" }} }}\n"),
                "named secret",
            ),
            (
                format!("{url}headers = {{ \"X-Api-Key\" = {{ value = \"abc\" }} }}\n"),
                "named secret",
            ),
            (
                format!("{url}headers = {{ \"Authorization\" = {{ secret = \"nope\" }} }}\n"),
                "does not define",
            ),
            (
                format!("{url}headers = {{ \"X-A\" = {{ secret = \"bad\", value = \"v\" }} }}\n"),
                "not both",
            ),
            (
                format!("{url}headers = {{ \"X-A\" = {{ prefix = \"p\" }} }}\n"),
                "needs `secret",
            ),
            (
                format!("{url}headers = {{ \"X-A\" = {{ value = \"v\", prefix = \"p\" }} }}\n"),
                "`prefix` goes with `secret`",
            ),
            (
                format!("{url}headers = {{ \"X-A\" = {{ value = \"v\", extra = 1 }} }}\n"),
                "unknown field",
            ),
            (
                format!("{url}headers = {{ \"Mcp-Session-Id\" = {{ value = \"v\" }} }}\n"),
                "set by the MCP transport",
            ),
            (
                format!("{url}headers = {{ \"Host\" = {{ value = \"evil\" }} }}\n"),
                "set by the MCP transport",
            ),
            (
                format!(
                    "{url}headers = {{ \"X-A\" = {{ value = \"v\" }}, \"x-a\" = {{ value = \"w\" }} }}\n"
                ),
                "given twice",
            ),
            (
                format!("{url}headers = {{ \"X A\" = {{ value = \"v\" }} }}\n"),
                "not a valid HTTP header name",
            ),
            (
                format!("{url}headers = {{ \"X-A\" = {{ value = \"a\\nb\" }} }}\n"),
                "not a valid header value",
            ),
            (
                format!("{url}headers = {{ \"Authorization\" = {{ secret = \"bad\" }} }}\n"),
                "not a valid header value",
            ),
        ];
        for (body, needle) in cases {
            let text = format!(
                "[[connection]]\nname = \"remote\"\n{body}{MAPPING}[secrets]\nbad = {{ env = \"AIRLOCK_CONFIG_TEST_BAD_SECRET\" }}\n"
            );
            let err = format!("{:#}", ServeConfig::parse(&text, dir.path()).unwrap_err());
            assert!(
                err.contains(needle),
                "expected `{needle}` in: {err}\n{text}"
            );
            if needle != "unknown field" {
                assert!(err.contains("remote"), "the connection is named: {err}");
            }
            assert!(
                !err.contains("line\nbreak"),
                "a secret value in an error: {err}"
            );
        }
    }

    #[test]
    fn telemetry_metrics_takes_a_socket_address_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = ServeConfig::parse(
            &format!("{MAPPING}[telemetry]\nmetrics = \"127.0.0.1:9464\"\n"),
            dir.path(),
        )
        .unwrap();
        assert_eq!(
            cfg.telemetry.metrics,
            Some("127.0.0.1:9464".parse().unwrap())
        );
        let defaults = ServeConfig::parse(MAPPING, dir.path()).unwrap();
        assert_eq!(defaults.telemetry, TelemetrySettings::default());
        let spans = ServeConfig::parse(
            &format!("{MAPPING}[telemetry]\notlp = \"http://127.0.0.1:4318\"\n"),
            dir.path(),
        )
        .unwrap();
        assert_eq!(
            spans.telemetry.otlp.as_deref(),
            Some("http://127.0.0.1:4318/v1/traces")
        );
        for (table, needle) in [
            (
                "[telemetry]\nmetrics = \"localhost:9464\"\n",
                "IP address and port",
            ),
            (
                "[telemetry]\nmetrics = \"127.0.0.1\"\n",
                "IP address and port",
            ),
            ("[telemetry]\nmetrics = 9464\n", "metrics"),
            ("[telemetry]\nspans = true\n", "unknown field"),
            (
                "[telemetry]\notlp = \"127.0.0.1:4318\"\n",
                "expected an http:// or https:// URL",
            ),
            ("[telemetry]\notlp = 4318\n", "otlp"),
        ] {
            let err = format!(
                "{:#}",
                ServeConfig::parse(&format!("{MAPPING}{table}"), dir.path()).unwrap_err()
            );
            assert!(err.contains(needle), "{table}: {err}");
        }
    }
}
