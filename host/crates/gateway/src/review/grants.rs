//! The security reviewer's view of one adapter (`airlock grants MANIFEST`).
//!
//! Rule: the review reads what the host would enforce, never what the adapter claims. It
//! loads the mapping manifest as the host does, refuses a component whose sha256 differs
//! from the pin (the host's own error, [`crate::registry::manifest::verify_pin`]), decodes the
//! component's real imports and exports from the binary with wasmtime, and gives every
//! import a verdict: the host API, the baseline every adapter gets (captured stdio,
//! clocks, random, granted variables only), a grant that justifies it, or FLAGGED.
//!
//! What justifies an import:
//!
//! | import | justified by |
//! |---|---|
//! | `airlock:host/*` at a version this host provides ([`crate::runtime::host_api`]) | the host API |
//! | `airlock:host/*` at any other version | nothing: the host refuses to load it (FLAGGED) |
//! | `wasi:io/*`, `wasi:cli/{stdin,stdout,stderr,exit,terminal-*}`, `wasi:clocks/*`, `wasi:random/*` | baseline |
//! | `wasi:cli/environment` | baseline: the adapter sees only its granted variables |
//! | `wasi:filesystem/*` | a `[[grants.filesystem]]` entry |
//! | `wasi:sockets/{tcp,tcp-create-socket}` | `tcp_connect` or `tcp_listen` |
//! | `wasi:sockets/{udp,udp-create-socket}` | `udp_send` |
//! | `wasi:sockets/ip-name-lookup` | a named host in `tcp_connect` or `udp_send` |
//! | `wasi:sockets/{network,instance-network}` | any network grant |
//! | `wasi:http/*` | nothing: this host does not link it (FLAGGED) |
//! | anything else | nothing (FLAGGED) |
//!
//! The review also names the `airlock:host` version the component targets (the highest
//! among its `airlock:host` imports) and each capability's effective effect semantics:
//! the host's declaration for the contract function as the mapping confirmed and narrowed
//! it, beside the declaration itself.
//!
//! Secret and environment values never appear in a review: only variable names and the
//! names of the secrets they come from.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context as _, Result, bail};
use serde::Serialize;
use wasmtime::component::types::ComponentItem;
use wasmtime::{Config, Engine};

use crate::contract::EffectSemantics;
use crate::registry::manifest::{Limits, MappingManifest};
use crate::runtime::grants::{Access, Destination, EnvValue, Grants};
use crate::runtime::host_api::{self, HostVersion};

/// Placeholder shown where an upstream tool or resource digest will go once the registry
/// pins them.
pub const DIGEST_NOT_PINNED: &str =
    "not pinned (no review recorded; pass --state-dir to read the store)";
/// What the review says of a resource URI prefix: reads are checked against the prefix, not
/// pinned by digest (resource contents change by nature).
pub const RESOURCE_PREFIX_NOTE: &str = "URI prefix: every read is checked against it";

/// Everything a reviewer needs to accept or refuse one mapping.
#[derive(Debug, Clone, Serialize)]
pub struct Review {
    /// The manifest path, as given.
    pub manifest: String,
    /// `[mapping]`.
    pub mapping: MappingView,
    /// The component file and its verified digest.
    pub component: ComponentView,
    /// The `airlock:host` version the component targets, from its imports (the highest
    /// among them); `None` when it imports nothing from `airlock:host` or imports a
    /// version this host does not provide (then that import is flagged).
    pub host_version: Option<HostVersion>,
    /// The declared grants (names only for the environment).
    pub grants: GrantsView,
    /// The limits, defaults applied.
    pub limits: Limits,
    /// The operator's settings (`[settings]`), which the adapter reads through
    /// `airlock:host/settings@0.3.0`; part of the manifest a reviewer approves.
    pub settings: crate::runtime::manifest::Settings,
    /// The component's imports, each with a verdict, sorted by name.
    pub imports: Vec<ImportReview>,
    /// The component's exports, sorted by name.
    pub exports: Vec<ExportReview>,
    /// What the mapping may ask of its upstream server.
    pub upstream: UpstreamView,
    /// The capabilities the model sees.
    pub capabilities: Vec<CapabilityView>,
    /// How many imports are flagged.
    pub flagged: usize,
    /// Why the host would refuse to load this mapping, in the host's words (the
    /// registry's contract check, [`crate::registry::live::check_contract`], and the
    /// runtime's export check): each one flags the review. Empty when it would load.
    pub refusals: Vec<String>,
    /// The registry's record of this mapping (with `--state-dir`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub registry: Option<RegistryView>,
    /// Changes since an earlier revision (`--diff REV`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub diff: Option<RevisionDiff>,
    /// The mapping's connection as a serve configuration defines it (`--config FILE`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub connection: Option<ConnectionView>,
    /// The most consequential class among the contract's functions the model may call,
    /// as words (`read`, `external effect`), or `unknown` for a contract this review could
    /// not resolve.
    #[serde(skip)]
    pub contract_effect_class: String,
    /// Pinned upstream tools the server does not itself call read-only while the mapping
    /// offers them only as reads ([`crate::registry::annotation_conflicts`]), against the
    /// connection's latest snapshot (`--config`) or the revision's pinned one; approving
    /// needs `--acknowledge-annotations`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub annotation_conflicts: Vec<String>,
}

impl Review {
    /// The most consequential class among the capabilities the manifest confirms.
    fn mapping_class(&self) -> Option<crate::contract::EffectClass> {
        self.capabilities
            .iter()
            .filter_map(|c| c.effect.map(|e| e.class))
            .max_by_key(|c| {
                crate::contract::EffectClass::ALL
                    .iter()
                    .position(|x| x == c)
            })
    }

    /// Shows each listed tool's own annotations from `catalogue` and what they conflict
    /// with ([`Review::annotation_conflicts`]).
    fn judge_annotations(&mut self, catalogue: &crate::registry::drift::Catalogue) {
        for item in &mut self.upstream.tools {
            if item.server_hints.is_none() {
                item.server_hints = catalogue.tool(&item.name).map(server_hints);
            }
        }
        let tools: Vec<String> = self.upstream.tools.iter().map(|t| t.name.clone()).collect();
        self.annotation_conflicts = self
            .mapping_class()
            .map(|class| crate::registry::annotation_conflicts(catalogue, &tools, class))
            .unwrap_or_default();
    }
}

/// How the serve configuration launches or reaches the mapping's connection, and what
/// its latest snapshot offers that the mapping leaves unreachable. Environment variables
/// and headers by name only, never a value.
#[derive(Debug, Clone, Serialize)]
pub struct ConnectionView {
    /// The serve configuration, as given.
    pub config: String,
    /// `stdio` (a child process) or `streamable-http`.
    pub transport: &'static str,
    /// The executable (stdio).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    /// Its arguments (stdio).
    pub args: Vec<String>,
    /// Its working directory (stdio).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// The names of its environment variables (stdio); values are never shown.
    pub env: Vec<String>,
    /// The endpoint (Streamable HTTP).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// The names of the headers sent (Streamable HTTP), with the secret each value comes
    /// from, if any; values are never shown.
    pub headers: Vec<String>,
    /// The connection's latest snapshot in the store, if the store has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// Tools that snapshot offers which the mapping's `[upstream] tools` does not list:
    /// the adapter cannot reach them (which is the point of a mapping; listed so a
    /// reviewer sees what is left out).
    pub unreachable_tools: Vec<String>,
    /// Tools the mapping lists that the snapshot does not offer (a call would fail).
    pub missing_tools: Vec<String>,
    /// How the kernel confines the server process (stdio), one line per kind —
    /// filesystem, network, processes, limits — with "none (deny by default)" for an
    /// empty kind; one `UNCONFINED` line for a server that runs with the host's
    /// filesystem, network and processes.
    pub confinement: Vec<String>,
    /// Whether the server runs unconfined (`confine = false`): FLAGGED (exit status 2).
    pub unconfined: bool,
    /// What the host's own outbound connection to the server may reach (Streamable HTTP),
    /// one line per kind — network, credentials — as `host_connection_lines` words it;
    /// secret names only, never a value.
    pub host_connection: Vec<String>,
    /// Whether the host sends requests, credential headers included, as plain `http://` to
    /// a host that is not loopback (`allow_insecure_http = true`): FLAGGED (exit status 2).
    pub insecure_http: bool,
}

/// The review lines of a stdio server's confinement ([`ConnectionView::confinement`]).
fn confinement_lines(s: &crate::upstream::StdioServer) -> Vec<String> {
    use crate::upstream::confine;
    let Some(c) = &s.confine else {
        return vec![
            "UNCONFINED: the server runs with the host's filesystem, network, processes and user (`confine` is off for this connection)".to_string(),
        ];
    };
    let mut lines = vec![format!(
        "filesystem: system folders and the command's install folder read-only, a private TMPDIR{}",
        if c.paths.is_empty() {
            "; granted: none (deny by default)".to_string()
        } else {
            format!(
                "; granted: {}",
                c.paths
                    .iter()
                    .map(|p| format!("{} ({})", p.path.display(), p.access))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    )];
    lines.push(if c.tcp_connect.is_empty() {
        "network: none (deny by default)".to_string()
    } else {
        format!(
            "network: tcp_connect {} (through the host's egress proxy; a name reaches its public addresses only)",
            c.tcp_connect.join(", ")
        )
    });
    lines.push(if c.namespaces {
        "processes: own user, mount, PID, network, IPC and UTS namespaces; Landlock keeps it out of other processes".to_string()
    } else {
        "processes: the host's PID and network namespaces (namespaces = false); Landlock keeps it out of other processes".to_string()
    });
    let l = c.limits;
    lines.push(format!(
        "limits: processes {}, open files {}, address space {}; seccomp refuses {} calls (e.g. ptrace, mount, bpf, unshare)",
        l.processes,
        l.open_files,
        l.address_space
            .map_or("unlimited".to_string(), |b| format!("{b} bytes")),
        confine::seccomp::DENIED.len()
    ));
    lines
}

/// The review lines of what the host's own connection to an HTTP server may reach
/// ([`ConnectionView::host_connection`]), and whether it goes as plain `http://` to a host
/// that is not loopback. What holds (`crate::upstream::http`): the host connects to the
/// URL's host and port only, follows no redirect and uses no proxy, and sends the headers
/// from secrets on those requests only.
fn host_connection_lines(h: &crate::upstream::http::HttpServer) -> (Vec<String>, bool) {
    use crate::upstream::http::HeaderValueSource;
    let safe = |t: &str| super::safe(t, 400);
    // The configuration checked the URL when it loaded; an unparsable one reads as itself.
    let parsed: Option<http::Uri> = h.url.parse().ok();
    let scheme = parsed
        .as_ref()
        .and_then(http::Uri::scheme_str)
        .unwrap_or("https")
        .to_ascii_lowercase();
    let (origin, host) = match parsed.as_ref().and_then(http::Uri::authority) {
        Some(a) => {
            let port = a
                .port_u16()
                .unwrap_or(if scheme == "http" { 80 } else { 443 });
            (
                safe(&format!("{scheme}://{}:{port}", a.host())),
                a.host().to_string(),
            )
        }
        None => (safe(&h.url), String::new()),
    };
    let loopback = crate::upstream::http::is_loopback_host(&host);
    let insecure = scheme == "http" && !loopback;
    let transport = if scheme != "http" {
        ""
    } else if insecure {
        ", UNENCRYPTED: plain http:// to a host that is not loopback (`allow_insecure_http = true`)"
    } else {
        ", plain http:// to loopback"
    };
    let mut lines = vec![format!(
        "network: {origin} only (the URL's host and port; a name reaches any address it resolves to){transport}; redirects refused (a 3xx is a failure); no proxy, not even one from the environment"
    )];
    let secrets: Vec<String> = h
        .headers
        .iter()
        .filter_map(|header| match &header.value {
            HeaderValueSource::Secret { name, .. } => {
                Some(format!("{} (secret `{}`)", safe(&header.name), safe(name)))
            }
            HeaderValueSource::Literal(_) => None,
        })
        .collect();
    lines.push(if secrets.is_empty() {
        "credentials: none (no header from a secret)".to_string()
    } else {
        format!(
            "credentials: {} sent only to {origin}{}; values never shown",
            secrets.join(", "),
            if insecure { ", UNENCRYPTED" } else { "" }
        )
    });
    (lines, insecure)
}

/// `[mapping]` of the reviewed manifest.
#[derive(Debug, Clone, Serialize)]
pub struct MappingView {
    /// Mapping name.
    pub name: String,
    /// Contract interface, e.g. `airlock:contracts/source-retrieval@0.1.0`.
    pub contract: String,
    /// Connection name in the serve configuration.
    pub connection: String,
}

/// The component file.
#[derive(Debug, Clone, Serialize)]
pub struct ComponentView {
    /// The file as the manifest names it.
    pub file: String,
    /// Its sha256, which equals the manifest's pin (verified).
    pub sha256: String,
    /// Its size in bytes.
    pub size: u64,
}

/// One filesystem grant.
#[derive(Debug, Clone, Serialize)]
pub struct FilesystemView {
    /// Host folder as written in the manifest.
    pub host: String,
    /// Host folder, canonicalized.
    pub host_resolved: String,
    /// Guest path.
    pub guest: String,
    /// `read-only` or `read-write`.
    pub access: Access,
}

/// Network grants, normalized (`Destination` display form).
#[derive(Debug, Clone, Serialize)]
pub struct NetworkView {
    /// TCP connect destinations.
    pub tcp_connect: Vec<String>,
    /// UDP send destinations.
    pub udp_send: Vec<String>,
    /// TCP listen addresses.
    pub tcp_listen: Vec<String>,
}

/// One environment grant: the variable name and where its value comes from, never the
/// value itself.
#[derive(Debug, Clone, Serialize)]
pub struct EnvView {
    /// Variable name.
    pub name: String,
    /// `literal` (a value written in the manifest, not shown) or `secret`.
    pub source: &'static str,
    /// The secret's name, for `secret`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
}

/// The declared grants.
#[derive(Debug, Clone, Serialize)]
pub struct GrantsView {
    /// Preopened folders.
    pub filesystem: Vec<FilesystemView>,
    /// Socket destinations.
    pub network: NetworkView,
    /// Environment variables (names only).
    pub env: Vec<EnvView>,
}

/// How an import is justified.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Status {
    /// `airlock:host/*`.
    HostApi,
    /// What every adapter gets, contained by the host.
    Baseline,
    /// Justified by a grant in the mapping.
    Granted,
    /// Nothing justifies it.
    Flagged,
}

impl Status {
    fn label(self) -> &'static str {
        match self {
            Self::HostApi => "host-api",
            Self::Baseline => "baseline",
            Self::Granted => "granted",
            Self::Flagged => "FLAGGED",
        }
    }
}

/// One import of the component.
#[derive(Debug, Clone, Serialize)]
pub struct ImportReview {
    /// The import name, e.g. `wasi:io/streams@0.2.6`.
    pub name: String,
    /// `instance`, `func`, `type`, `resource`, `component`, `module` or `core-func`.
    pub kind: &'static str,
    /// What an imported instance declares (functions, types, resources).
    pub items: Vec<Item>,
    /// The verdict.
    pub status: Status,
    /// Why: what justifies it, or what is missing.
    pub reason: String,
}

/// One export of the component.
#[derive(Debug, Clone, Serialize)]
pub struct ExportReview {
    /// The export name.
    pub name: String,
    /// Item kind (as for imports).
    pub kind: &'static str,
    /// What an exported instance declares.
    pub items: Vec<Item>,
    /// What it is to this host.
    pub note: String,
}

/// One item an imported or exported instance declares.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Item {
    /// Its name, e.g. `search`.
    pub name: String,
    /// Its kind (as for imports).
    pub kind: &'static str,
}

/// One upstream tool or resource prefix the mapping may use.
#[derive(Debug, Clone, Serialize)]
pub struct UpstreamItem {
    /// Tool name or URI prefix.
    pub name: String,
    /// Pinned schema digest of the upstream definition; `None` until a reviewer pins it.
    pub digest: Option<String>,
    /// Pinned description digest (title + description).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description_digest: Option<String>,
    /// The server's own annotations in the pinned snapshot (`readOnlyHint`, ...): hints
    /// from an untrusted server, shown for the reviewer, never relied on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_hints: Option<String>,
}

impl UpstreamItem {
    fn pin_text(&self, kind: &str) -> String {
        if kind == "resource" {
            return RESOURCE_PREFIX_NOTE.to_string();
        }
        match &self.digest {
            None => format!("digest: {DIGEST_NOT_PINNED}"),
            Some(schema) => {
                let mut t = format!("digest: schema {}", crate::registry::short(schema));
                if let Some(d) = &self.description_digest {
                    t.push_str(&format!(" description {}", crate::registry::short(d)));
                }
                if let Some(h) = &self.server_hints {
                    t.push_str(&format!(" (server hints, untrusted: {h})"));
                }
                t
            }
        }
    }
}

/// The mapping's record in the registry, when a store is given.
#[derive(Debug, Clone, Serialize)]
pub struct RegistryView {
    /// The latest mapping revision.
    pub revision: i64,
    /// Its lifecycle state.
    pub state: String,
    /// Why it is in that state.
    pub reason: String,
    /// Who approved it, if anyone.
    pub reviewer: Option<String>,
    /// When the revision was recorded (RFC 3339).
    pub recorded: String,
    /// The connection id and configuration revision it is bound to.
    pub connection_id: String,
    /// Configuration revision.
    pub config_revision: i64,
    /// The snapshot its pins come from.
    pub snapshot: Option<String>,
    /// The contract's effect class (host-defined): `read`, ...
    pub effect_class: String,
    /// Whether the manifest under review is the one the revision recorded.
    pub manifest_matches: bool,
}

/// What changed between an earlier mapping revision and the manifest under review (with
/// the latest revision's pins).
#[derive(Debug, Clone, Serialize)]
pub struct RevisionDiff {
    /// The earlier revision.
    pub from: i64,
    /// The latest revision.
    pub to: i64,
    /// One line per change: `+ key = value`, `- key = value`, `~ key: old -> new`.
    pub changes: Vec<String>,
}

/// `[upstream]`.
#[derive(Debug, Clone, Serialize)]
pub struct UpstreamView {
    /// The connection they are reached on.
    pub connection: String,
    /// Tools the adapter may call.
    pub tools: Vec<UpstreamItem>,
    /// Resource URI prefixes the adapter may read.
    pub resources: Vec<UpstreamItem>,
}

/// One `[[capability]]`.
#[derive(Debug, Clone, Serialize)]
pub struct CapabilityView {
    /// The name the model sees.
    pub name: String,
    /// The contract function it runs.
    pub function: String,
    /// The reviewed description the model sees.
    pub description: String,
    /// Whether the component exports that function in the mapping's contract.
    pub exported: bool,
    /// The capability's effective semantics (class, idempotent, queryable, compensable)
    /// as the host serves it and policy sees it: the contract's declaration, confirmed and
    /// narrowed by the mapping; `None` when this host does not classify the function (it
    /// would not load).
    pub effect: Option<EffectSemantics>,
    /// What the host declares for the function in the contract, before the mapping
    /// narrowed it.
    pub contract_effect: Option<EffectSemantics>,
}

/// Reviews the mapping at `manifest_path`: loads it, reads and verifies its component,
/// and decodes the component's imports and exports.
///
/// # Errors
/// An invalid manifest, an unreadable component, a pin mismatch (the host's error,
/// naming both digests), or bytes that are not a valid component.
pub fn review(
    manifest_path: &Path,
    contracts: &crate::registry::contracts::ContractSet,
) -> Result<Review> {
    let manifest = MappingManifest::load(manifest_path)?;
    // A capability that does not confirm its contract's class gets no review (an unknown
    // or withheld contract is one of the review's refusals instead).
    let served = contracts.get(&manifest.mapping.contract).ok();
    if let Some(contract) = &served {
        manifest.check_semantics(contract)?;
    }
    let base = manifest_path.parent().unwrap_or(Path::new(""));
    let component_path = manifest.component_path(base);
    let bytes = crate::runtime::read_component(&component_path)?;
    crate::registry::manifest::verify_pin(&manifest, &bytes)?;
    let mut config = Config::new();
    config.wasm_component_model(true);
    let engine = Engine::new(&config)
        .map_err(anyhow::Error::from)
        .context("creating the wasmtime engine")?;
    let component = wasmtime::component::Component::new(&engine, &bytes)
        .map_err(anyhow::Error::from)
        .with_context(|| format!("decoding component {}", component_path.display()))?;
    let ty = component.component_type();

    let mut imports: Vec<ImportReview> = ty
        .imports(&engine)
        .map(|(name, ext)| {
            let (status, reason) = classify(name, &manifest.grants);
            ImportReview {
                name: name.to_string(),
                kind: kind_of(&ext.ty),
                items: items_of(&engine, &ext.ty),
                status,
                reason,
            }
        })
        .collect();
    imports.sort_by(|a, b| a.name.cmp(&b.name));
    // A refused host import is flagged above; the version is then unknown.
    let host_version = host_api::host_version(imports.iter().map(|i| i.name.as_str()))
        .ok()
        .flatten();

    let contract = manifest.mapping.contract.as_str();
    let mut contract_items = Vec::new();
    let mut exports: Vec<ExportReview> = ty
        .exports(&engine)
        .map(|(name, ext)| {
            let items = items_of(&engine, &ext.ty);
            let note = if name == contract {
                contract_items.clone_from(&items);
                "the mapping's contract".to_string()
            } else {
                "not used by this host".to_string()
            };
            ExportReview {
                name: name.to_string(),
                kind: kind_of(&ext.ty),
                items,
                note,
            }
        })
        .collect();
    exports.sort_by(|a, b| a.name.cmp(&b.name));

    let flagged = imports
        .iter()
        .filter(|i| i.status == Status::Flagged)
        .count();
    let refusals = load_refusals(&manifest, &exports, &contract_items, contracts);
    let pending = |name: &String| UpstreamItem {
        name: name.clone(),
        digest: None,
        description_digest: None,
        server_hints: None,
    };
    Ok(Review {
        manifest: manifest_path.display().to_string(),
        mapping: MappingView {
            name: manifest.mapping.name.clone(),
            contract: manifest.mapping.contract.clone(),
            connection: manifest.mapping.connection.clone(),
        },
        component: ComponentView {
            file: manifest.component.file.display().to_string(),
            sha256: manifest.pinned_sha256().to_string(),
            size: bytes.len() as u64,
        },
        host_version,
        grants: grants_view(&manifest),
        limits: manifest.limits.clone(),
        settings: manifest.settings.clone(),
        imports,
        exports,
        upstream: UpstreamView {
            connection: manifest.mapping.connection.clone(),
            tools: manifest.upstream.tools.iter().map(pending).collect(),
            resources: manifest.upstream.resources.iter().map(pending).collect(),
        },
        capabilities: manifest
            .capabilities
            .iter()
            .map(|c| CapabilityView {
                name: c.name.clone(),
                function: c.function.clone(),
                description: c.description.clone(),
                exported: contract_items
                    .iter()
                    .any(|i| i.name == c.function && i.kind == "func"),
                effect: served.as_ref().and_then(|k| manifest.semantics(c, k)),
                contract_effect: served.as_ref().and_then(|k| k.semantics(&c.function)),
            })
            .collect(),
        flagged,
        refusals,
        registry: None,
        diff: None,
        connection: None,
        annotation_conflicts: Vec::new(),
        contract_effect_class: served.as_ref().map_or("unknown".to_string(), |c| {
            c.most_consequential().as_str().replace('-', " ")
        }),
    })
}

/// Adds the mapping's connection from the serve configuration `config` (read from
/// `config_path`): its launch details and, when `registry` holds a snapshot of it, the
/// tools the mapping leaves unreachable. A configuration that does not define the
/// connection is a refusal, as when the host loads the mapping.
///
/// # Errors
/// The store fails.
pub fn add_config(
    review: &mut Review,
    config_path: &Path,
    config: &crate::config::ServeConfig,
    registry: Option<&crate::registry::Registry>,
) -> Result<()> {
    use crate::upstream::UpstreamServer;
    let name = &review.mapping.connection;
    let Some(server) = config.connections.get(name) else {
        review.refusals.push(format!(
            "mapping `{}` uses connection `{name}`, which the serve configuration does not define",
            review.mapping.name
        ));
        return Ok(());
    };
    let safe = |t: &str| super::safe(t, 400);
    let mut view = ConnectionView {
        config: config_path.display().to_string(),
        transport: "stdio",
        command: None,
        args: Vec::new(),
        cwd: None,
        env: Vec::new(),
        url: None,
        headers: Vec::new(),
        snapshot: None,
        unreachable_tools: Vec::new(),
        missing_tools: Vec::new(),
        confinement: Vec::new(),
        unconfined: false,
        host_connection: Vec::new(),
        insecure_http: false,
    };
    match server {
        UpstreamServer::Stdio(s) => {
            view.command = Some(safe(&s.command.display().to_string()));
            view.args = s.args.iter().map(|a| safe(a)).collect();
            view.cwd = Some(safe(&s.cwd.display().to_string()));
            view.env = s.env.keys().map(|k| safe(k)).collect();
            view.confinement = confinement_lines(s).iter().map(|l| safe(l)).collect();
            view.unconfined = s.confine.is_none();
        }
        UpstreamServer::Http(h) => {
            view.transport = "streamable-http";
            view.url = Some(safe(&h.url));
            view.headers = h
                .headers
                .iter()
                .map(|header| match &header.value {
                    crate::upstream::http::HeaderValueSource::Secret { name, .. } => {
                        format!("{} (secret `{}`)", safe(&header.name), safe(name))
                    }
                    _ => format!("{} (literal)", safe(&header.name)),
                })
                .collect();
            let (lines, insecure) = host_connection_lines(h);
            view.host_connection = lines;
            view.insecure_http = insecure;
        }
    }
    if let Some(registry) = registry
        && registry.store().connection(name)?.is_some()
        && let Some(latest) = super::snapshots_list(registry, Some(name))?
            .into_iter()
            .next()
        && let Some(snap) = registry.store().snapshot(&latest.digest)?
    {
        let catalogue: crate::registry::drift::Catalogue =
            serde_json::from_value(snap.body).context("the stored snapshot does not parse")?;
        let offered: Vec<String> = catalogue
            .tools
            .iter()
            .filter_map(|t| t.get("name").and_then(serde_json::Value::as_str))
            .map(str::to_string)
            .collect();
        let listed: Vec<&String> = review.upstream.tools.iter().map(|t| &t.name).collect();
        view.unreachable_tools = offered
            .iter()
            .filter(|t| !listed.contains(t))
            .map(|t| safe(t))
            .collect();
        view.missing_tools = listed
            .iter()
            .filter(|t| !offered.contains(t))
            .map(|t| safe(t))
            .collect();
        view.snapshot = Some(latest.digest);
        review.judge_annotations(&catalogue);
    }
    review.connection = Some(view);
    Ok(())
}

/// What would make the host refuse to load the mapping, given the component's exports:
/// the registry's contract check, then the runtime's (`Runtime::load`): the contract
/// interface is exported, and so is each capability's function and the query function
/// that reconciles it. The messages are the host's own.
fn load_refusals(
    manifest: &MappingManifest,
    exports: &[ExportReview],
    contract_items: &[Item],
    contracts: &crate::registry::contracts::ContractSet,
) -> Vec<String> {
    let name = &manifest.mapping.name;
    let contract = &manifest.mapping.contract;
    let mut refusals = Vec::new();
    if let Err(e) = crate::registry::live::check_contract(manifest, contracts) {
        refusals.push(format!("{e:#}"));
    }
    if !exports.iter().any(|x| &x.name == contract) {
        refusals.push(format!(
            "mapping `{name}`: the component does not export `{contract}`"
        ));
        return refusals;
    }
    let exported = |function: &str| {
        contract_items
            .iter()
            .any(|i| i.name == function && i.kind == "func")
    };
    for cap in &manifest.capabilities {
        if !exported(&cap.function) {
            refusals.push(format!(
                "mapping `{name}`: the component's `{contract}` has no function `{}`",
                cap.function
            ));
        }
        let query = contracts
            .get(contract)
            .ok()
            .and_then(|k| k.query_function(&cap.function).map(str::to_string));
        if let Some(query) = query.as_deref() {
            let said = |r: &String| {
                r.ends_with(&format!(
                    "has no function `{query}`, which reconciles `{}`",
                    cap.function
                ))
            };
            if !exported(query) && !refusals.iter().any(said) {
                refusals.push(format!(
                    "mapping `{name}`: the component's `{contract}` has no function `{query}`, which reconciles `{}`",
                    cap.function
                ));
            }
        }
    }
    refusals
}

/// Adds the registry's view of the mapping: its latest revision and state, the pinned
/// digests of each upstream tool with the server's own hints from the pinned snapshot,
/// the contract's effect class, and (with `diff_from`) the changes since that revision.
///
/// A mapping the store has not recorded yet (no host has loaded it: the review of a
/// manifest before its first approval) adds nothing; asked for a diff, it is an error.
///
/// # Errors
/// `diff_from` given and the mapping is not recorded, or names no revision of it; the
/// store fails.
pub fn add_registry(
    review: &mut Review,
    manifest_path: &Path,
    registry: &crate::registry::Registry,
    diff_from: Option<i64>,
) -> Result<()> {
    let name = &review.mapping.name.clone();
    let store = registry.store();
    let Some(record) = store.mapping(name)? else {
        if diff_from.is_some() {
            bail!(
                "the store has no record of mapping `{name}` to diff against; a host records it when it first loads the manifest"
            );
        }
        return Ok(());
    };
    let text = std::fs::read_to_string(manifest_path)?;
    let digest = crate::registry::manifest_digest(&text);
    let pins = crate::registry::Pins::from_value(&record.pins);
    let snapshot = record
        .snapshot_digest
        .as_deref()
        .and_then(|d| store.snapshot(d).ok().flatten())
        .and_then(|s| serde_json::from_value::<crate::registry::drift::Catalogue>(s.body).ok());
    for item in &mut review.upstream.tools {
        if let Some(pin) = pins.tools.get(&item.name) {
            item.digest = Some(pin.schema.clone());
            item.description_digest = Some(pin.description.clone());
            item.server_hints = snapshot
                .as_ref()
                .and_then(|c| c.tool(&item.name))
                .map(server_hints);
        }
    }
    if let Some(catalogue) = &snapshot {
        review.judge_annotations(catalogue);
    }
    review.registry = Some(RegistryView {
        revision: record.revision,
        state: record.state.to_string(),
        reason: record.reason.clone(),
        reviewer: record.reviewer.clone(),
        recorded: super::time(record.created_ms),
        connection_id: record.connection_id.clone(),
        config_revision: record.config_revision,
        snapshot: record.snapshot_digest.clone(),
        effect_class: review.contract_effect_class.clone(),
        manifest_matches: record.manifest_digest == digest,
    });
    if let Some(from) = diff_from {
        let old = store
            .mapping_revisions(name)?
            .into_iter()
            .find(|r| r.revision == from)
            .with_context(|| format!("mapping `{name}` has no revision {from}"))?;
        review.diff = Some(RevisionDiff {
            from,
            to: record.revision,
            changes: revision_changes(&old, &record, &text),
        });
    }
    Ok(())
}

/// The server's annotations as words, e.g. `read-only, idempotent`.
fn server_hints(tool: &serde_json::Value) -> String {
    let a = &tool["annotations"];
    let mut words = Vec::new();
    for (key, yes, no) in [
        ("readOnlyHint", "read-only", "may write"),
        ("destructiveHint", "destructive", "not destructive"),
        ("idempotentHint", "idempotent", "not idempotent"),
        ("openWorldHint", "open world", "closed world"),
    ] {
        match a.get(key).and_then(serde_json::Value::as_bool) {
            Some(true) => words.push(yes),
            Some(false) => words.push(no),
            None => {}
        }
    }
    if words.is_empty() {
        "none".to_string()
    } else {
        words.join(", ")
    }
}

/// Flattens a TOML document into `path = value` lines.
fn flatten_toml(
    prefix: &str,
    value: &toml::Value,
    out: &mut std::collections::BTreeMap<String, String>,
) {
    match value {
        toml::Value::Table(t) => {
            for (k, v) in t {
                let p = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten_toml(&p, v, out);
            }
        }
        toml::Value::Array(items) if items.iter().all(|i| i.is_table()) && !items.is_empty() => {
            for (i, v) in items.iter().enumerate() {
                flatten_toml(&format!("{prefix}[{i}]"), v, out);
            }
        }
        other => {
            out.insert(
                prefix.to_string(),
                serde_json::to_string(other).unwrap_or_default(),
            );
        }
    }
}

/// The changes from revision `old` to the manifest text under review and the latest
/// revision `new` (pins, component, connection, state, and every manifest key).
fn revision_changes(
    old: &crate::store::MappingRecord,
    new: &crate::store::MappingRecord,
    text: &str,
) -> Vec<String> {
    let mut changes = Vec::new();
    let mut field = |key: &str, a: String, b: String| {
        if a != b {
            changes.push(format!("~ {key}: {a} -> {b}"));
        }
    };
    field(
        "component sha256",
        old.component_sha256.clone(),
        new.component_sha256.clone(),
    );
    field(
        "connection",
        format!("{} revision {}", old.connection_id, old.config_revision),
        format!("{} revision {}", new.connection_id, new.config_revision),
    );
    field(
        "reviewer",
        old.reviewer.clone().unwrap_or_else(|| "(none)".into()),
        new.reviewer.clone().unwrap_or_else(|| "(none)".into()),
    );
    let (a, b) = (
        crate::registry::Pins::from_value(&old.pins).tools,
        crate::registry::Pins::from_value(&new.pins).tools,
    );
    for (tool, pin) in &b {
        match a.get(tool) {
            None => changes.push(format!(
                "+ pin {tool}: schema {}",
                crate::registry::short(&pin.schema)
            )),
            Some(p) if p != pin => {
                if p.schema != pin.schema {
                    changes.push(format!(
                        "~ pin {tool} schema: {} -> {}",
                        crate::registry::short(&p.schema),
                        crate::registry::short(&pin.schema)
                    ));
                }
                if p.description != pin.description {
                    changes.push(format!(
                        "~ pin {tool} description: {} -> {}",
                        crate::registry::short(&p.description),
                        crate::registry::short(&pin.description)
                    ));
                }
            }
            Some(_) => {}
        }
    }
    for tool in a.keys().filter(|t| !b.contains_key(*t)) {
        changes.push(format!("- pin {tool}"));
    }
    match (
        old.manifest_text.as_deref(),
        toml::from_str::<toml::Value>(text),
    ) {
        (Some(old_text), Ok(now)) => match toml::from_str::<toml::Value>(old_text) {
            Ok(before) => {
                let (mut x, mut y) = (
                    std::collections::BTreeMap::new(),
                    std::collections::BTreeMap::new(),
                );
                flatten_toml("", &before, &mut x);
                flatten_toml("", &now, &mut y);
                for (k, v) in &y {
                    match x.get(k) {
                        None => changes.push(format!("+ {k} = {v}")),
                        Some(o) if o != v => changes.push(format!("~ {k}: {o} -> {v}")),
                        Some(_) => {}
                    }
                }
                for (k, v) in &x {
                    if !y.contains_key(k) {
                        changes.push(format!("- {k} = {v}"));
                    }
                }
            }
            Err(_) => changes.push(format!(
                "! revision {}'s manifest text does not parse",
                old.revision
            )),
        },
        (None, _) => changes.push(format!(
            "! revision {} recorded no manifest text; grants and limits cannot be compared",
            old.revision
        )),
        (_, Err(_)) => changes.push("! the manifest under review does not parse".into()),
    }
    changes
}

fn grants_view(manifest: &MappingManifest) -> GrantsView {
    let g = &manifest.grants;
    let filesystem = manifest
        .grants_section
        .filesystem
        .iter()
        .zip(&g.filesystem)
        .map(|(written, (resolved, guest, access))| FilesystemView {
            host: written.host.display().to_string(),
            host_resolved: resolved.display().to_string(),
            guest: guest.clone(),
            access: *access,
        })
        .collect();
    let shown = |list: &[Destination]| list.iter().map(ToString::to_string).collect();
    GrantsView {
        filesystem,
        network: NetworkView {
            tcp_connect: shown(&g.tcp_connect),
            udp_send: shown(&g.udp_send),
            tcp_listen: shown(&g.tcp_listen),
        },
        env: g
            .env
            .iter()
            .map(|(name, value)| match value {
                EnvValue::Value(_) => EnvView {
                    name: name.clone(),
                    source: "literal",
                    secret: None,
                },
                EnvValue::Secret { secret } => EnvView {
                    name: name.clone(),
                    source: "secret",
                    secret: Some(secret.clone()),
                },
            })
            .collect(),
    }
}

fn kind_of(item: &ComponentItem) -> &'static str {
    match item {
        ComponentItem::ComponentFunc(_) => "func",
        ComponentItem::CoreFunc(_) => "core-func",
        ComponentItem::Module(_) => "module",
        ComponentItem::Component(_) => "component",
        ComponentItem::ComponentInstance(_) => "instance",
        ComponentItem::Type(_) => "type",
        ComponentItem::Resource(_) => "resource",
    }
}

fn items_of(engine: &Engine, item: &ComponentItem) -> Vec<Item> {
    match item {
        ComponentItem::ComponentInstance(instance) => {
            let mut items: Vec<Item> = instance
                .exports(engine)
                .map(|(name, ext)| Item {
                    name: name.to_string(),
                    kind: kind_of(&ext.ty),
                })
                .collect();
            items.sort_by(|a, b| a.name.cmp(&b.name));
            items
        }
        _ => Vec::new(),
    }
}

/// The names of the functions among `items`, comma-separated.
fn functions(items: &[Item]) -> String {
    items
        .iter()
        .filter(|i| i.kind == "func")
        .map(|i| i.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

fn listed(list: &[Destination]) -> String {
    list.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The verdict for one import `name` under `grants` (see the module table).
pub fn classify(name: &str, grants: &Grants) -> (Status, String) {
    let flagged = |what: &str| {
        (
            Status::Flagged,
            format!("imports {name} but the mapping grants {what}"),
        )
    };
    let unknown = || {
        (
            Status::Flagged,
            format!(
                "unknown import {name}: neither the host API, the baseline nor a grant justifies it"
            ),
        )
    };
    let Some((package, rest)) = name.split_once('/') else {
        return unknown();
    };
    let interface = rest.split('@').next().unwrap_or(rest);
    let baseline = || {
        (
            Status::Baseline,
            "baseline (captured stdio, clocks, random)".to_string(),
        )
    };
    match package {
        "airlock:host" => match host_api::host_import(name) {
            Ok(Some(v)) => (Status::HostApi, format!("host API (airlock:host {v})")),
            Ok(None) => unknown(),
            Err(e) => (
                Status::Flagged,
                format!("{e:#}; the host refuses to load this component"),
            ),
        },
        "wasi:io" | "wasi:clocks" | "wasi:random" => baseline(),
        "wasi:cli" => match interface {
            "stdin" | "stdout" | "stderr" | "exit" => baseline(),
            t if t.starts_with("terminal-") => baseline(),
            "environment" => (
                Status::Baseline,
                format!(
                    "baseline: sees only granted variables ({} granted)",
                    grants.env.len()
                ),
            ),
            _ => unknown(),
        },
        "wasi:filesystem" => {
            if grants.filesystem.is_empty() {
                flagged("no filesystem access")
            } else {
                let folders = grants
                    .filesystem
                    .iter()
                    .map(|(_, guest, access)| {
                        let access = match access {
                            Access::ReadOnly => "read-only",
                            Access::ReadWrite => "read-write",
                        };
                        format!("{guest} ({access})")
                    })
                    .collect::<Vec<_>>()
                    .join(", ");
                (
                    Status::Granted,
                    format!(
                        "{}: {folders}",
                        plural(
                            grants.filesystem.len(),
                            "filesystem grant",
                            "filesystem grants"
                        )
                    ),
                )
            }
        }
        "wasi:sockets" => match interface {
            "tcp" | "tcp-create-socket" => {
                if grants.tcp_connect.is_empty() && grants.tcp_listen.is_empty() {
                    flagged("no TCP access (tcp_connect or tcp_listen)")
                } else {
                    let mut parts = Vec::new();
                    if !grants.tcp_connect.is_empty() {
                        parts.push(format!("tcp_connect {}", listed(&grants.tcp_connect)));
                    }
                    if !grants.tcp_listen.is_empty() {
                        parts.push(format!("tcp_listen {}", listed(&grants.tcp_listen)));
                    }
                    (Status::Granted, parts.join("; "))
                }
            }
            "udp" | "udp-create-socket" => {
                if grants.udp_send.is_empty() {
                    flagged("no UDP access (udp_send)")
                } else {
                    (
                        Status::Granted,
                        format!("udp_send {}", listed(&grants.udp_send)),
                    )
                }
            }
            "ip-name-lookup" => {
                let named: Vec<Destination> = grants
                    .tcp_connect
                    .iter()
                    .chain(&grants.udp_send)
                    .filter(|d| matches!(d, Destination::Named { .. }))
                    .cloned()
                    .collect();
                if named.is_empty() {
                    flagged("no named host (name lookup stays off)")
                } else {
                    (
                        Status::Granted,
                        format!("named hosts {} (only these names resolve)", listed(&named)),
                    )
                }
            }
            "network" | "instance-network" => {
                let n = grants.tcp_connect.len() + grants.udp_send.len() + grants.tcp_listen.len();
                if n == 0 {
                    flagged("no network access")
                } else {
                    (
                        Status::Granted,
                        plural(n, "network grant", "network grants"),
                    )
                }
            }
            _ => unknown(),
        },
        "wasi:http" => (
            Status::Flagged,
            format!("imports {name} but this host does not link wasi:http"),
        ),
        _ => unknown(),
    }
}

const DENY: &str = "none (deny by default)";

impl RegistryView {
    fn lines(&self) -> Vec<(&'static str, String)> {
        vec![
            ("revision", self.revision.to_string()),
            ("state", format!("{} ({})", self.state, self.reason)),
            (
                "reviewer",
                self.reviewer.clone().unwrap_or_else(|| "(none)".into()),
            ),
            ("recorded", self.recorded.clone()),
            (
                "connection",
                format!("{} revision {}", self.connection_id, self.config_revision),
            ),
            (
                "pinned snapshot",
                self.snapshot.clone().unwrap_or_else(|| "(none)".into()),
            ),
            ("effect class", self.effect_class.clone()),
            (
                "manifest",
                if self.manifest_matches {
                    "the one this revision recorded".to_string()
                } else {
                    "DIFFERS from the one this revision recorded".to_string()
                },
            ),
        ]
    }
}

impl Review {
    /// Whether anything is flagged: an import, a reason the host would refuse to load the
    /// mapping, an unconfined server or an unencrypted HTTP connection (exit status 2).
    pub fn has_flagged(&self) -> bool {
        self.flagged > 0
            || !self.refusals.is_empty()
            || self.unconfined()
            || self.insecure_http()
            || !self.annotation_conflicts.is_empty()
    }

    /// Whether `--config` showed a connection whose server runs unconfined.
    pub fn unconfined(&self) -> bool {
        self.connection.as_ref().is_some_and(|c| c.unconfined)
    }

    /// Whether `--config` showed an HTTP connection the host reaches as plain `http://` to
    /// a host that is not loopback.
    pub fn insecure_http(&self) -> bool {
        self.connection.as_ref().is_some_and(|c| c.insecure_http)
    }

    /// The review as pretty-printed JSON.
    pub fn to_json(&self) -> String {
        // Serializing plain owned data cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// The review as plain text for a terminal: the heading, then the numbered sections in
    /// order (6 and 7 only when the registry was read or a diff asked for).
    pub fn to_text(&self) -> String {
        let mut o = String::new();
        let w = &mut o;
        let _ = writeln!(w, "Adapter review: mapping `{}`", self.mapping.name);
        let _ = writeln!(w, "manifest: {}", self.manifest);
        let _ = writeln!(w);
        let _ = writeln!(w, "1. Mapping and component");
        for (key, value) in self.identity_lines() {
            let _ = writeln!(w, "  {key:<23}{value}");
        }
        let _ = writeln!(w);
        self.write_grants(w);
        let _ = writeln!(w);
        self.write_imports_and_exports(w);
        let _ = writeln!(w);
        self.write_verdict(w);
        let _ = writeln!(w);
        self.write_upstream(w);
        if let Some(c) = &self.connection {
            self.write_connection(w, c);
        }
        if let Some(r) = &self.registry {
            let _ = writeln!(w);
            let _ = writeln!(w, "6. Registry");
            for (key, value) in r.lines() {
                let _ = writeln!(w, "  {key:<23}{value}");
            }
        }
        if let Some(d) = &self.diff {
            let _ = writeln!(w);
            let _ = writeln!(w, "7. Changes since revision {} (latest: {})", d.from, d.to);
            if d.changes.is_empty() {
                let _ = writeln!(w, "  (none)");
            }
            for c in &d.changes {
                let _ = writeln!(w, "  {c}");
            }
        }
        o
    }

    /// Section 2: every grant kind (an empty one denied) and every limit.
    fn write_grants(&self, w: &mut String) {
        let _ = writeln!(w, "2. Grants (deny by default) and limits");
        for (kind, lines) in self.grant_lines() {
            if lines.is_empty() {
                let _ = writeln!(w, "  {kind:<23}{DENY}");
            }
            for line in lines {
                let _ = writeln!(w, "  {kind:<23}{line}");
            }
        }
        for (key, value) in self.limit_lines() {
            let _ = writeln!(w, "  {key:<23}{value}");
        }
        if self.settings.is_empty() {
            let _ = writeln!(w, "  {:<23}none", "settings");
        }
        for (name, value) in &self.settings {
            // Text settings print escaped (Debug), so no control character reaches the terminal.
            let _ = writeln!(w, "  {:<23}{name} = {value}", "setting");
        }
    }

    /// Section 3: each import with its verdict and reason, each export with its functions.
    fn write_imports_and_exports(&self, w: &mut String) {
        let _ = writeln!(
            w,
            "3. Component imports ({}) and exports ({}), decoded from the binary",
            self.imports.len(),
            self.exports.len()
        );
        let width = self.imports.iter().map(|i| i.name.len()).max().unwrap_or(0);
        for i in &self.imports {
            let _ = writeln!(
                w,
                "  import  {:<10}{:<width$}  {}",
                i.status.label(),
                i.name,
                i.reason
            );
        }
        for x in &self.exports {
            let functions = functions(&x.items);
            let _ = writeln!(
                w,
                "  export  {:<10}{}  {}{}",
                x.kind,
                x.name,
                x.note,
                if functions.is_empty() {
                    String::new()
                } else {
                    format!("; functions: {functions}")
                }
            );
        }
    }

    /// Section 4: the verdict, then each flagged import, each reason the host would
    /// refuse to load the mapping, and a connection flagged with `--config`.
    fn write_verdict(&self, w: &mut String) {
        let _ = writeln!(w, "4. Verdict: {}", self.verdict());
        for i in self.imports.iter().filter(|i| i.status == Status::Flagged) {
            let _ = writeln!(w, "  FLAGGED   {}", i.reason);
        }
        for r in &self.refusals {
            let _ = writeln!(w, "  FLAGGED   the host would refuse to load it: {r}");
        }
        for c in &self.annotation_conflicts {
            let _ = writeln!(
                w,
                "  FLAGGED   {c} (approving needs --acknowledge-annotations)"
            );
        }
        if self.unconfined() {
            let _ = writeln!(
                w,
                "  FLAGGED   the connection's server runs UNCONFINED (`confine = false`): it can read and write whatever the host's user can, reach any network and see every process"
            );
        }
        if self.insecure_http() {
            let _ = writeln!(
                w,
                "  FLAGGED   the host reaches the connection's server UNENCRYPTED (`allow_insecure_http = true`, plain http:// to a host that is not loopback): anyone on the path can read and alter its requests, credential headers included, and its answers"
            );
        }
    }

    /// Section 5 up to the connection: the pinned tools and resources (none: denied),
    /// then each capability with its effect and its reviewed description.
    fn write_upstream(&self, w: &mut String) {
        let _ = writeln!(
            w,
            "5. Upstream (connection `{}`) and capabilities",
            self.upstream.connection
        );
        let width = self
            .upstream
            .tools
            .iter()
            .chain(&self.upstream.resources)
            .map(|i| i.name.len())
            .max()
            .unwrap_or(0);
        for (kind, list) in [
            ("tool", &self.upstream.tools),
            ("resource", &self.upstream.resources),
        ] {
            if list.is_empty() {
                let _ = writeln!(w, "  {kind:<10}{DENY}");
            }
            for item in list {
                let _ = writeln!(
                    w,
                    "  {kind:<10}{:<width$}  {}",
                    item.name,
                    item.pin_text(kind)
                );
            }
        }
        for c in &self.capabilities {
            let effect = match (&c.effect, &c.contract_effect) {
                (Some(e), declared) => format!(" [{}]", effect_text(e, declared.as_ref())),
                (None, _) => " [no effect semantics: the host will refuse to offer it]".to_string(),
            };
            let _ = writeln!(
                w,
                "  capability {} -> {}{effect}{}",
                c.name,
                c.function,
                if c.exported {
                    ""
                } else {
                    " (NOT EXPORTED by the component: the host will refuse to load this mapping)"
                }
            );
            let _ = writeln!(w, "    \"{}\"", c.description);
        }
    }

    /// The rest of section 5 with `--config`: the configured connection `c` (transport,
    /// what it runs or where it connects, variable and header names, how its server is
    /// confined or what the host's own connection to it may reach), then the tools its
    /// latest snapshot offers that the mapping does not list, and the reverse.
    fn write_connection(&self, w: &mut String, c: &ConnectionView) {
        let _ = writeln!(
            w,
            "  connection             {} ({}, from {})",
            self.upstream.connection, c.transport, c.config
        );
        for (key, value) in [
            ("command", c.command.clone()),
            (
                "args",
                (!c.args.is_empty()).then(|| format!("{:?}", c.args)),
            ),
            ("cwd", c.cwd.clone()),
            (
                "env (names)",
                Some(if c.env.is_empty() {
                    "none".to_string()
                } else {
                    c.env.join(", ")
                }),
            ),
            ("url", c.url.clone()),
            (
                "headers (names)",
                (!c.headers.is_empty()).then(|| c.headers.join(", ")),
            ),
        ] {
            if let Some(value) = value {
                let _ = writeln!(w, "    {key:<21}{value}");
            }
        }
        for (i, line) in c.confinement.iter().enumerate() {
            let key = if i == 0 { "confinement" } else { "" };
            let _ = writeln!(w, "    {key:<21}{line}");
        }
        for (i, line) in c.host_connection.iter().enumerate() {
            let key = if i == 0 { "host's connection" } else { "" };
            let _ = writeln!(w, "    {key:<21}{line}");
        }
        match &c.snapshot {
            None => {
                let _ = writeln!(
                    w,
                    "    unreachable tools    unknown: no snapshot of the connection in the store (airlock discover {})",
                    self.upstream.connection
                );
            }
            Some(digest) => {
                let list = |l: &[String]| {
                    if l.is_empty() {
                        "none".to_string()
                    } else {
                        l.join(", ")
                    }
                };
                let _ = writeln!(
                    w,
                    "    unreachable tools    {} (offered in snapshot {}, not listed by the mapping)",
                    list(&c.unreachable_tools),
                    crate::registry::short(digest)
                );
                if !c.missing_tools.is_empty() {
                    let _ = writeln!(
                        w,
                        "    MISSING tools        {} (listed by the mapping, not offered by the server)",
                        list(&c.missing_tools)
                    );
                }
            }
        }
    }

    /// One sentence: every import justified, or how many are flagged.
    pub fn verdict(&self) -> String {
        let imports = if self.flagged == 0 {
            "every import is justified".to_string()
        } else {
            format!(
                "{} FLAGGED: nothing in the mapping justifies {}",
                plural(self.flagged, "import", "imports"),
                if self.flagged == 1 { "it" } else { "them" }
            )
        };
        let imports = if self.unconfined() {
            format!("{imports}; FLAGGED: the connection's server runs unconfined")
        } else {
            imports
        };
        let imports = if self.insecure_http() {
            format!("{imports}; FLAGGED: the host reaches the connection's server unencrypted")
        } else {
            imports
        };
        let imports = if self.annotation_conflicts.is_empty() {
            imports
        } else {
            format!(
                "{imports}; FLAGGED: the server does not call {} read-only",
                plural(
                    self.annotation_conflicts.len(),
                    "pinned tool",
                    "pinned tools"
                )
            )
        };
        if self.refusals.is_empty() {
            imports
        } else {
            format!(
                "{imports}; FLAGGED: the host would refuse to load this mapping ({})",
                plural(self.refusals.len(), "reason", "reasons")
            )
        }
    }

    /// The review as one self-contained HTML page (inline style, no external assets,
    /// every value escaped): the heading and verdict, then one table per section.
    pub fn to_html(&self) -> String {
        let e = escape_html;
        let mut o = String::new();
        let w = &mut o;
        self.write_html_heading(w);
        let _ = writeln!(w, "<h2>Mapping and component</h2>\n<table>");
        let _ = writeln!(
            w,
            "<tr><th>manifest</th><td><code>{}</code></td></tr>",
            e(&self.manifest)
        );
        for (k, v) in self.identity_lines() {
            let _ = writeln!(w, "<tr><th>{k}</th><td><code>{}</code></td></tr>", e(&v));
        }
        self.write_html_grants(w);
        self.write_html_imports_and_exports(w);
        self.write_html_upstream(w);
        if let Some(r) = &self.registry {
            let _ = writeln!(w, "</table>\n<h2>Registry</h2>\n<table>");
            for (key, value) in r.lines() {
                let _ = writeln!(w, "<tr><th>{}</th><td>{}</td></tr>", e(key), e(&value));
            }
        }
        if let Some(d) = &self.diff {
            let _ = writeln!(
                w,
                "</table>\n<h2>Changes since revision {} (latest: {})</h2>\n<table>",
                d.from, d.to
            );
            for c in &d.changes {
                let _ = writeln!(w, "<tr><td><code>{}</code></td></tr>", e(c));
            }
        }
        let _ = writeln!(w, "</table>\n</body>\n</html>");
        o
    }

    /// The page up to its first table: the document head, the title, the verdict and the
    /// flagged imports and refusals.
    fn write_html_heading(&self, w: &mut String) {
        let e = escape_html;
        let _ = write!(
            w,
            "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
             <title>Adapter review: {}</title>\n<style>\n{STYLE}</style>\n</head>\n<body>\n",
            e(&self.mapping.name)
        );
        let _ = writeln!(
            w,
            "<h1>Adapter review: <code>{}</code></h1>\n<p class=\"verdict {}\">Verdict: {}.</p>",
            e(&self.mapping.name),
            if self.has_flagged() { "flagged" } else { "ok" },
            e(&self.verdict())
        );
        let flagged: Vec<String> = self
            .imports
            .iter()
            .filter(|i| i.status == Status::Flagged)
            .map(|i| format!("<li>FLAGGED: {}</li>", e(&i.reason)))
            .chain(self.refusals.iter().map(|r| {
                format!(
                    "<li>FLAGGED: the host would refuse to load it: {}</li>",
                    e(r)
                )
            }))
            .chain(
                self.annotation_conflicts
                    .iter()
                    .map(|c| format!("<li>FLAGGED: {}</li>", e(c))),
            )
            .collect();
        if !flagged.is_empty() {
            let _ = writeln!(w, "<ul class=\"flagged\">\n{}\n</ul>", flagged.join("\n"));
        }
    }

    /// The grants (an empty kind denied) and limits tables.
    fn write_html_grants(&self, w: &mut String) {
        let e = escape_html;
        let _ = writeln!(w, "</table>\n<h2>Grants (deny by default)</h2>\n<table>");
        for (kind, lines) in self.grant_lines() {
            let cell = if lines.is_empty() {
                format!("<span class=\"deny\">{DENY}</span>")
            } else {
                lines
                    .iter()
                    .map(|l| format!("<code>{}</code>", e(l)))
                    .collect::<Vec<_>>()
                    .join("<br>")
            };
            let _ = writeln!(w, "<tr><th>{}</th><td>{cell}</td></tr>", e(kind));
        }
        let _ = writeln!(w, "</table>\n<h2>Limits</h2>\n<table>");
        for (key, value) in self.limit_lines() {
            let _ = writeln!(w, "<tr><th>{}</th><td>{}</td></tr>", e(key), e(&value));
        }
        let _ = writeln!(
            w,
            "</table>\n<h2>Settings (the operator's, never the model's)</h2>\n<table>"
        );
        if self.settings.is_empty() {
            let _ = writeln!(w, "<tr><td>none</td></tr>");
        }
        for (name, value) in &self.settings {
            let _ = writeln!(
                w,
                "<tr><th>{}</th><td><code>{}</code></td></tr>",
                e(name),
                e(&value.to_string())
            );
        }
    }

    /// The imports (verdict, reason, functions) and exports tables.
    fn write_html_imports_and_exports(&self, w: &mut String) {
        let e = escape_html;
        let _ = writeln!(
            w,
            "</table>\n<h2>Imports ({})</h2>\n<table>\n<tr><th>verdict</th><th>import</th><th>why</th><th>functions</th></tr>",
            self.imports.len()
        );
        for i in &self.imports {
            let class = match i.status {
                Status::Flagged => "flagged",
                _ => "ok",
            };
            let _ = writeln!(
                w,
                "<tr class=\"{class}\"><td>{}</td><td><code>{}</code></td><td>{}</td><td><small>{}</small></td></tr>",
                e(i.status.label()),
                e(&i.name),
                e(&i.reason),
                e(&functions(&i.items))
            );
        }
        let _ = writeln!(
            w,
            "</table>\n<h2>Exports ({})</h2>\n<table>",
            self.exports.len()
        );
        for x in &self.exports {
            let _ = writeln!(
                w,
                "<tr><td><code>{}</code></td><td>{}</td><td>{}</td><td><small>{}</small></td></tr>",
                e(&x.name),
                e(x.kind),
                e(&x.note),
                e(&functions(&x.items))
            );
        }
    }

    /// The upstream tools and resources (none: denied) and capabilities tables.
    fn write_html_upstream(&self, w: &mut String) {
        let e = escape_html;
        let _ = writeln!(
            w,
            "</table>\n<h2>Upstream (connection <code>{}</code>)</h2>\n<table>",
            e(&self.upstream.connection)
        );
        for (kind, list) in [
            ("tool", &self.upstream.tools),
            ("resource", &self.upstream.resources),
        ] {
            if list.is_empty() {
                let _ = writeln!(
                    w,
                    "<tr><th>{kind}</th><td class=\"deny\" colspan=\"2\">{DENY}</td></tr>"
                );
            }
            for item in list {
                let _ = writeln!(
                    w,
                    "<tr><th>{kind}</th><td><code>{}</code></td><td>{}</td></tr>",
                    e(&item.name),
                    e(&item.pin_text(kind))
                );
            }
        }
        let _ = writeln!(
            w,
            "</table>\n<h2>Capabilities</h2>\n<table>\n<tr><th>name</th><th>function</th><th>effect</th><th>description the model sees</th></tr>"
        );
        for c in &self.capabilities {
            let effect = c.effect.as_ref().map_or_else(
                || "no effect semantics: the host will refuse to offer it".to_string(),
                |x| effect_text(x, c.contract_effect.as_ref()),
            );
            let _ = writeln!(
                w,
                "<tr class=\"{}\"><td><code>{}</code></td><td><code>{}</code>{}</td><td>{}</td><td>{}</td></tr>",
                if c.exported && c.effect.is_some() {
                    "ok"
                } else {
                    "flagged"
                },
                e(&c.name),
                e(&c.function),
                if c.exported {
                    ""
                } else {
                    " (not exported by the component)"
                },
                e(&effect),
                e(&c.description)
            );
        }
    }

    /// (key, value) lines naming the mapping and its verified component.
    fn identity_lines(&self) -> Vec<(&'static str, String)> {
        let host_version = match self.host_version {
            Some(v) => format!("airlock:host {v} (the highest version among its imports)"),
            None if self
                .imports
                .iter()
                .any(|i| i.name.starts_with("airlock:host/") && i.status == Status::Flagged) =>
            {
                "none this host provides (see the flagged import)".to_string()
            }
            None => "none (it imports nothing from airlock:host)".to_string(),
        };
        vec![
            ("name", self.mapping.name.clone()),
            ("contract", self.mapping.contract.clone()),
            ("connection", self.mapping.connection.clone()),
            ("component", self.component.file.clone()),
            (
                "sha256",
                format!("{} (matches the pin)", self.component.sha256),
            ),
            ("size", format!("{} bytes", self.component.size)),
            ("host version", host_version),
        ]
    }

    /// (grant kind, one line per grant) for every kind, in a fixed order.
    fn grant_lines(&self) -> Vec<(&'static str, Vec<String>)> {
        let g = &self.grants;
        let access = |a: Access| match a {
            Access::ReadOnly => "read-only",
            Access::ReadWrite => "read-write",
        };
        vec![
            (
                "filesystem",
                g.filesystem
                    .iter()
                    .map(|f| {
                        format!(
                            "{} -> {} ({}; host folder {})",
                            f.host,
                            f.guest,
                            access(f.access),
                            f.host_resolved
                        )
                    })
                    .collect(),
            ),
            ("tcp_connect", g.network.tcp_connect.clone()),
            ("udp_send", g.network.udp_send.clone()),
            ("tcp_listen", g.network.tcp_listen.clone()),
            (
                "env",
                g.env
                    .iter()
                    .map(|v| match &v.secret {
                        Some(secret) => format!("{} (from secret `{secret}`)", v.name),
                        None => format!("{} (literal value in the manifest)", v.name),
                    })
                    .collect(),
            ),
        ]
    }

    fn limit_lines(&self) -> Vec<(&'static str, String)> {
        let l = &self.limits;
        vec![
            ("memory_mib", l.memory_mib.to_string()),
            ("deadline_ms", l.deadline_ms.to_string()),
            ("max_output_bytes", l.max_output_bytes.to_string()),
            ("max_output_items", l.max_output_items.to_string()),
            ("allowed_media_types", l.allowed_media_types.join(", ")),
            ("max_result_bytes", l.max_result_bytes.to_string()),
            ("max_stdio_bytes", l.max_stdio_bytes.to_string()),
            ("max_concurrent_calls", l.max_concurrent_calls.to_string()),
            ("queue_timeout_ms", l.queue_timeout_ms.to_string()),
            ("max_queued_calls", l.max_queued_calls.to_string()),
            ("max_upstream_requests", l.max_upstream_requests.to_string()),
            (
                "fuel",
                l.fuel.map_or_else(
                    || "not set (the deadline bounds each call)".to_string(),
                    |f| f.to_string(),
                ),
            ),
        ]
    }
}

/// The `style-src` source (`'sha256-…'`, CSP Level 3 §8.4) of the stylesheet
/// [`Review::to_html`] inlines: a page with a strict Content-Security-Policy (the console's)
/// allows that stylesheet and no other.
pub fn style_hash() -> String {
    use base64::Engine as _;
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(format!("\n{STYLE}").as_bytes());
    format!(
        "sha256-{}",
        base64::engine::general_purpose::STANDARD.encode(digest)
    )
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:2em;max-width:70em;color:#222}\n\
table{border-collapse:collapse;margin-bottom:1em}\n\
th,td{border:1px solid #ccc;padding:.3em .6em;text-align:left;vertical-align:top}\n\
tr.flagged td{background:#fde2e1}\n\
.verdict.flagged{color:#a40000;font-weight:bold}\n\
.verdict.ok{color:#0a6b0a;font-weight:bold}\n\
.deny{color:#666}\n";

/// `e`'s class and the flags it has, e.g. `external-effect, idempotent, queryable`, and
/// what the mapping narrowed away from `declared` (`narrowed by the mapping: not queryable`).
pub fn effect_text(e: &EffectSemantics, declared: Option<&EffectSemantics>) -> String {
    let mut out = e.class.to_string();
    let flags = [
        (
            "idempotent",
            e.idempotent,
            declared.is_some_and(|d| d.idempotent),
        ),
        (
            "queryable",
            e.queryable,
            declared.is_some_and(|d| d.queryable),
        ),
        (
            "compensable",
            e.compensable,
            declared.is_some_and(|d| d.compensable),
        ),
    ];
    for (name, on, _) in flags {
        if on {
            out.push_str(", ");
            out.push_str(name);
        }
    }
    let narrowed: Vec<String> = flags
        .iter()
        .filter(|(_, on, was)| *was && !on)
        .map(|(name, ..)| format!("not {name}"))
        .collect();
    if !narrowed.is_empty() {
        out.push_str("; narrowed by the mapping: ");
        out.push_str(&narrowed.join(", "));
    }
    out
}

/// Escapes `text` for HTML element content and quoted attribute values.
pub fn escape_html(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grants(network: &str) -> Grants {
        let section: crate::runtime::grants::GrantsSection = toml::from_str(network).unwrap();
        Grants::resolve(&section, None).unwrap()
    }

    #[test]
    fn imports_are_justified_only_by_their_grants() {
        let none = Grants::default();
        for (name, status) in [
            ("airlock:host/upstream@0.1.0", Status::HostApi),
            ("airlock:host/log@0.1.0", Status::HostApi),
            ("airlock:host/context@0.2.0", Status::HostApi),
            ("airlock:host/context@0.3.0", Status::Flagged),
            ("airlock:host/settings@0.3.0", Status::HostApi),
            ("airlock:host/settings@0.2.0", Status::Flagged),
            ("airlock:host/upstream@0.1.1", Status::Flagged),
            ("airlock:host/upstream@0.2.0", Status::Flagged),
            ("airlock:hostile/upstream@0.1.0", Status::Flagged),
            ("wasi:io/streams@0.2.6", Status::Baseline),
            ("wasi:cli/terminal-stdout@0.2.6", Status::Baseline),
            ("wasi:cli/environment@0.2.6", Status::Baseline),
            ("wasi:clocks/monotonic-clock@0.2.6", Status::Baseline),
            ("wasi:random/random@0.2.6", Status::Baseline),
            ("wasi:filesystem/preopens@0.2.6", Status::Flagged),
            ("wasi:sockets/tcp@0.2.6", Status::Flagged),
            ("wasi:sockets/udp-create-socket@0.2.6", Status::Flagged),
            ("wasi:sockets/ip-name-lookup@0.2.6", Status::Flagged),
            ("wasi:sockets/instance-network@0.2.6", Status::Flagged),
            ("wasi:http/outgoing-handler@0.2.6", Status::Flagged),
            ("wasi:cli/run@0.2.6", Status::Flagged),
            ("evil:backdoor/open", Status::Flagged),
            ("plain-function", Status::Flagged),
        ] {
            assert_eq!(classify(name, &none).0, status, "{name}");
        }
        let (_, why) = classify("wasi:filesystem/preopens@0.2.6", &none);
        assert_eq!(
            why,
            "imports wasi:filesystem/preopens@0.2.6 but the mapping grants no filesystem access"
        );

        let tcp = grants("network = { tcp_connect = [\"api.example.com:443\"] }");
        assert_eq!(classify("wasi:sockets/tcp@0.2.6", &tcp).0, Status::Granted);
        assert_eq!(
            classify("wasi:sockets/ip-name-lookup@0.2.6", &tcp).0,
            Status::Granted
        );
        assert_eq!(
            classify("wasi:sockets/network@0.2.6", &tcp).0,
            Status::Granted
        );
        assert_eq!(classify("wasi:sockets/udp@0.2.6", &tcp).0, Status::Flagged);
        let ip_only = grants("network = { udp_send = [\"192.0.2.1:53\"] }");
        assert_eq!(
            classify("wasi:sockets/ip-name-lookup@0.2.6", &ip_only).0,
            Status::Flagged
        );
        assert_eq!(
            classify("wasi:sockets/udp@0.2.6", &ip_only).0,
            Status::Granted
        );
        let env = grants("env = { A = \"1\", B = { secret = \"b\" } }");
        assert_eq!(
            classify("wasi:cli/environment@0.2.6", &env).1,
            "baseline: sees only granted variables (2 granted)"
        );
    }

    fn http_server(url: &str, insecure: bool) -> crate::upstream::http::HttpServer {
        use crate::upstream::http::{HeaderValueSource, HttpHeader, HttpServer};
        HttpServer {
            url: url.into(),
            headers: vec![
                HttpHeader {
                    name: "Authorization".into(),
                    value: HeaderValueSource::Secret {
                        name: "notes-token".into(),
                        prefix: "Bearer ".into(),
                        value: airlock_core::Secret("hunter2-value".into()),
                    },
                },
                HttpHeader {
                    name: "X-Tenant".into(),
                    value: HeaderValueSource::Literal("acme".into()),
                },
            ],
            allow_insecure_http: insecure,
            owner: None,
            credential_scope: None,
        }
    }

    #[test]
    fn an_http_connection_shows_what_the_hosts_connection_reaches_and_flags_plain_http() {
        let tail =
            "redirects refused (a 3xx is a failure); no proxy, not even one from the environment";
        let (lines, insecure) =
            host_connection_lines(&http_server("https://mcp.example.com/mcp", false));
        assert!(!insecure);
        assert_eq!(
            lines,
            [
                format!(
                    "network: https://mcp.example.com:443 only (the URL's host and port; a name reaches any address it resolves to); {tail}"
                ),
                "credentials: Authorization (secret `notes-token`) sent only to https://mcp.example.com:443; values never shown".to_string(),
            ]
        );

        // Plain http:// to loopback is the default's exception, not flagged (nor is
        // allow_insecure_http when the URL does not use it).
        for url in [
            "http://127.0.0.1:8080/mcp",
            "http://[::1]:9/mcp",
            "http://localhost/mcp",
        ] {
            let (lines, insecure) = host_connection_lines(&http_server(url, true));
            assert!(!insecure, "{url}");
            assert!(
                lines[0].contains(", plain http:// to loopback;"),
                "{url}: {lines:?}"
            );
        }
        let (lines, _) = host_connection_lines(&http_server("http://[::1]:9/mcp", false));
        assert!(
            lines[0].starts_with("network: http://[::1]:9 only ("),
            "{lines:?}"
        );
        let (_, insecure) = host_connection_lines(&http_server("https://10.1.2.3/mcp", true));
        assert!(!insecure);

        let (lines, insecure) =
            host_connection_lines(&http_server("http://10.1.2.3:8080/mcp", true));
        assert!(insecure);
        assert_eq!(
            lines,
            [
                format!(
                    "network: http://10.1.2.3:8080 only (the URL's host and port; a name reaches any address it resolves to), UNENCRYPTED: plain http:// to a host that is not loopback (`allow_insecure_http = true`); {tail}"
                ),
                "credentials: Authorization (secret `notes-token`) sent only to http://10.1.2.3:8080, UNENCRYPTED; values never shown".to_string(),
            ]
        );
        assert!(!format!("{lines:?}").contains("hunter2"));

        let mut bare = http_server("https://mcp.example.com:8443/mcp", false);
        bare.headers.clear();
        let (lines, _) = host_connection_lines(&bare);
        assert_eq!(lines[1], "credentials: none (no header from a secret)");
        assert!(lines[0].starts_with("network: https://mcp.example.com:8443 only ("));
    }

    #[test]
    fn html_escaping_covers_markup_and_quotes() {
        assert_eq!(
            escape_html("<a href=\"x\">&'</a>"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;&lt;/a&gt;"
        );
    }
}
