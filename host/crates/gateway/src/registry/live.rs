//! The live registry: what a running host serves right now — its upstream connections
//! with their latest snapshots, the loaded mapping revisions and their capabilities, and
//! changed manifests staged for review.
//!
//! Rules:
//! - A mapping serves only under its recorded revision and pins (see [`crate::registry`]);
//!   verification, compilation and linking happen before any upstream process starts, so a
//!   refused component never causes upstream traffic.
//! - The catalog is swapped atomically; a call keeps the catalog (and mapping revision) it
//!   started with. Every loaded mapping has a load generation unique in this process, so a
//!   reference minted under one load never resolves under another.
//! - A connection whose server announced a change (`list_changed`, counted at the
//!   transport) or whose last re-discovery failed is stale: the next call re-discovers
//!   first (see [`crate::pipeline::recheck`]).
//! - Every change to what could be offered bumps [`Live::changes`], which the fronts turn
//!   into `notifications/tools/list_changed` for their clients.
//! - Connections have a lifecycle ([`ConnectionStatus`]): `connecting` → `ready`;
//!   `disconnected` (it failed to start within `start_timeout`, or its server exited:
//!   retried in the background, waiting 0.5 s, doubling up to 30 s); `degraded` (its
//!   server broke the protocol: not restarted by itself); `stopped` (the host is shutting
//!   down). Only a `ready` connection's capabilities are offered. Every transition is
//!   traced (`connection-state`) and logged. A connection serves again only after it was
//!   started, initialized, snapshotted and every mapping bound to it judged against its
//!   pins.
//! - At start, every connection starts in parallel; one that fails never stops the host.
//!   A mapping that cannot be loaded (component not matching its pin, a capability name
//!   another mapping already offers, a connection that cannot be identified) is refused
//!   alone (`mapping-load-failed`); the host refuses to start only when every mapping is.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;

use anyhow::{Context as _, Result, bail};
use rmcp::model::JsonObject;
use serde_json::{Value, json};
use sha2::Digest as _;

use crate::config::ServeConfig;
use crate::contract::{self, ContractFunction, EffectSemantics, Shape};
use crate::registry::drift::Catalogue;
use crate::registry::manifest::MappingManifest;
use crate::registry::{Registry, Verdict};
use crate::runtime::{LoadedAdapter, Runtime, UpstreamGrant};
use crate::store::{ConnectionRevision, MappingRecord};
use crate::upstream::Connection;

/// One loaded mapping revision: its adapter, what it may reach upstream, the connection it
/// is bound to, and its current record (revision, lifecycle state, pins).
pub struct ActiveMapping {
    /// The mapping's name.
    pub name: String,
    /// The compiled adapter.
    pub adapter: LoadedAdapter,
    /// What the adapter may reach upstream.
    pub grant: Arc<UpstreamGrant>,
    /// The upstream tools the manifest lists (each must stay pinned to serve).
    pub tools: Vec<String>,
    /// The connection this mapping is bound to.
    pub connection: Arc<ConnectionState>,
    /// sha256 of the manifest text this revision was loaded from.
    pub manifest_digest: String,
    /// Where the manifest came from (`None` for in-memory sources).
    pub manifest_path: Option<PathBuf>,
    /// This load's generation: unique per loaded mapping in this process.
    pub generation: u64,
    /// The contract interface it implements, e.g. `airlock:contracts/source-retrieval@0.1.0`.
    pub contract: String,
    /// The reviewed data class (`[mapping] data_class`).
    pub data_class: String,
    /// The contract's host-only query function, when a capability of this mapping is
    /// reconciled through one ([`contract::query_function`]).
    pub query: Option<ContractFunction>,
    /// Set once the intents this mapping's calls left open (unknown, or prepared by a
    /// host that stopped) were reconciled: no call of the mapping runs before.
    pub reconciled: tokio::sync::OnceCell<()>,
    /// On a shared store, when intents that other, stopped hosts left open were last
    /// looked for (see [`crate::pipeline::reconcile::before_calls`]).
    pub swept: std::sync::Mutex<Option<std::time::Instant>>,
    record: ArcSwap<MappingRecord>,
}

impl ActiveMapping {
    /// The mapping's current record as this host knows it.
    pub fn record(&self) -> Arc<MappingRecord> {
        self.record.load_full()
    }

    /// True when the mapping may serve new calls (`limited` or `active`).
    pub fn serves(&self) -> bool {
        self.record.load().state.serves()
    }

    /// Replaces the mapping's record as this host knows it.
    pub fn set_record(&self, record: MappingRecord) {
        self.record.store(Arc::new(record));
    }
}

/// Source of load generations.
static NEXT_GENERATION: AtomicU64 = AtomicU64::new(1);

/// One running upstream connection with its identity and its latest snapshot.
pub struct ConnectionState {
    /// The configured name.
    pub name: String,
    /// The rmcp client now serving (replaced when the connection is restarted).
    current: Arc<ArcSwap<Connection>>,
    /// Serializes restarts; holds when the last one was tried.
    restarting: tokio::sync::Mutex<Option<std::time::Instant>>,
    /// Local id and configuration revision.
    pub revision: ConnectionRevision,
    catalogue: ArcSwap<Catalogue>,
    /// Shared with the grants of the mappings bound to it (observations record it).
    snapshot: Arc<ArcSwap<String>>,
    /// `list_changed` notifications the current catalogue already covers.
    seen: AtomicU64,
    /// False after a re-discovery failed, until one succeeds: calls are refused meanwhile.
    healthy: std::sync::atomic::AtomicBool,
    refresh: tokio::sync::Mutex<()>,
    /// Where the connection is in its lifecycle.
    status: ArcSwap<ConnectionStatus>,
}

/// Where a connection is in its lifecycle (DESIGN.md §2). Only [`ConnectionStatus::Ready`]
/// serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnectionStatus {
    /// Being started for the first time.
    Connecting,
    /// Started, initialized, snapshotted; its mappings were judged against their pins.
    Ready,
    /// Not running: it failed to start (or to start in time), or its server exited. The
    /// host starts it again in the background, with backoff.
    Disconnected(String),
    /// Its server broke the protocol: refused, and not restarted by itself.
    Degraded(String),
    /// The host is shutting down; its server was stopped.
    Stopped,
}

impl ConnectionStatus {
    /// The state's name, as traced.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Connecting => "connecting",
            Self::Ready => "ready",
            Self::Disconnected(_) => "disconnected",
            Self::Degraded(_) => "degraded",
            Self::Stopped => "stopped",
        }
    }

    /// Why it is not ready (the host's words), if it says.
    pub fn reason(&self) -> Option<&str> {
        match self {
            Self::Disconnected(why) | Self::Degraded(why) => Some(why),
            _ => None,
        }
    }
}

impl std::fmt::Display for ConnectionStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.reason() {
            Some(why) => write!(f, "{} ({why})", self.as_str()),
            None => f.write_str(self.as_str()),
        }
    }
}

/// A call being run (see [`Live::call_started`]); dropping it ends the count.
pub struct InFlight<'a>(&'a Live);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.drained.notify_waiters();
        }
    }
}

impl ConnectionState {
    /// The rmcp client now serving.
    pub fn connection(&self) -> Arc<Connection> {
        self.current.load_full()
    }

    /// The cell holding the serving client, shared with the mappings' upstream grants.
    pub fn connection_cell(&self) -> Arc<ArcSwap<Connection>> {
        self.current.clone()
    }

    /// The latest catalogue.
    pub fn catalogue(&self) -> Arc<Catalogue> {
        self.catalogue.load_full()
    }

    /// The latest snapshot's digest (empty before the first snapshot).
    pub fn snapshot_digest(&self) -> Arc<String> {
        self.snapshot.load_full()
    }

    /// Where the connection is in its lifecycle now.
    pub fn status(&self) -> Arc<ConnectionStatus> {
        self.status.load_full()
    }

    /// False after a re-discovery failed, until one succeeds.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire) && self.connection().is_open()
    }

    /// True when the server announced a change the current snapshot does not cover, or
    /// the last re-discovery failed.
    pub fn is_stale(&self) -> bool {
        self.connection().list_changed_count() > self.seen.load(Ordering::Acquire)
            || !self.healthy.load(Ordering::Acquire)
    }
}

/// `Live::start` serves once every connection's first start succeeded or failed, except
/// that it does not wait for a straggler: once the first connection is done it waits at
/// most [`START_WAIT_FACTOR`] times as long as that one took, and at least this long
/// (never beyond `start_timeout`). A connection still starting then comes later.
pub const START_WAIT_MIN: Duration = Duration::from_secs(2);

/// See [`START_WAIT_MIN`].
pub const START_WAIT_FACTOR: u32 = 3;

/// Least time between two restarts of one connection.
pub const MIN_RESTART_INTERVAL: std::time::Duration = std::time::Duration::from_millis(500);
/// Longest wait between two restart attempts of a connection that keeps failing.
const MAX_RESTART_BACKOFF: std::time::Duration = std::time::Duration::from_secs(30);

fn h_again(host: &std::sync::Weak<Live>) -> Option<Arc<Live>> {
    host.upgrade()
}

/// Restarts a connection whose server exited (or never started), waiting longer after
/// each failure (from [`MIN_RESTART_INTERVAL`], doubling, at most
/// [`MAX_RESTART_BACKOFF`]); gives up when the host is gone or stopping, or someone else
/// restarted it. Calls meanwhile are refused as unavailable.
async fn restart_with_backoff(host: impl Into<Option<Arc<Live>>>, state: Arc<ConnectionState>) {
    let Some(host) = host.into() else { return };
    let weak = Arc::downgrade(&host);
    drop(host);
    let mut wait = MIN_RESTART_INTERVAL;
    loop {
        tokio::time::sleep(wait).await;
        let Some(h) = weak.upgrade() else { return };
        if h.is_closing() || !state.connection().has_exited() {
            return;
        }
        match h.restart_connection(&state).await {
            Ok(()) => return,
            Err(e) => {
                tracing::debug!(connection = %state.name, "restart failed: {e:#}; next try in {} ms", wait.as_millis());
            }
        }
        drop(h);
        wait = (wait * 2).min(MAX_RESTART_BACKOFF);
    }
}

/// One model-facing capability.
pub struct Capability {
    /// Local name (what the model calls).
    pub name: String,
    /// Reviewed description.
    pub description: String,
    /// The contract function it runs.
    pub function: ContractFunction,
    /// The derived input schema (a closed JSON object schema).
    pub input_schema: Arc<JsonObject>,
    /// Its effective semantics: the host's declaration for the function, confirmed by the
    /// reviewed mapping and narrowed where it says so (never widened; never from server
    /// annotations).
    pub semantics: EffectSemantics,
    /// The mapping that serves it.
    pub mapping: Arc<ActiveMapping>,
}

/// The loaded mappings and their capabilities at one moment. Swapped atomically on
/// reload; a call keeps the catalog (and mapping revision) it started with.
#[derive(Default)]
pub struct Catalog {
    /// Every loaded capability, serving or not (see [`Catalog::offered`]).
    pub capabilities: Vec<Capability>,
    /// Loaded mappings by name.
    pub mappings: BTreeMap<String, Arc<ActiveMapping>>,
}

impl Catalog {
    /// The capabilities offered to the model now: those whose mapping serves.
    pub fn offered(&self) -> impl Iterator<Item = &Capability> {
        self.capabilities.iter().filter(|c| c.mapping.serves())
    }

    /// Looks a capability up by its local name.
    pub fn capability(&self, name: &str) -> Option<&Capability> {
        self.capabilities.iter().find(|c| c.name == name)
    }
}

/// Shortest time between two background re-discoveries of one connection.
pub const MIN_REDISCOVERY_INTERVAL: Duration = Duration::from_secs(1);

/// How long discovery may wait for each list page.
pub const DISCOVERY_TIMEOUT: Duration = Duration::from_secs(30);

/// The live registry of a running host: connections, the registry store, the current
/// catalog, staged mappings. Shared by all sessions.
pub struct Live {
    runtime: Runtime,
    registry: Registry,
    config: ServeConfig,
    connections: tokio::sync::Mutex<BTreeMap<String, Arc<ConnectionState>>>,
    catalog: ArcSwap<Catalog>,
    changes: tokio::sync::watch::Sender<u64>,
    reload: tokio::sync::Mutex<()>,
    /// Changed manifests waiting for approval while their reviewed revision serves.
    staged: std::sync::Mutex<BTreeMap<String, LoadedMapping>>,
    /// Set once the host stops: new calls are refused, nothing is restarted.
    closing: std::sync::atomic::AtomicBool,
    /// Calls being run now.
    in_flight: std::sync::atomic::AtomicUsize,
    /// Woken when `in_flight` drops to zero.
    drained: tokio::sync::Notify,
}

/// A bound mapping and its capabilities.
type LoadedMapping = (Arc<ActiveMapping>, Vec<Capability>);

/// The outcome of binding a mapping.
enum Bound {
    /// Bound to its recorded revision: swap it in.
    Loaded(Arc<ActiveMapping>, Vec<Capability>),
    /// An unreviewed change while a reviewed revision serves: keep it aside.
    Staged(Arc<ActiveMapping>, Vec<Capability>),
}

/// A mapping to load: its manifest and the component bytes it pins.
pub struct MappingSource {
    /// The parsed manifest.
    pub manifest: MappingManifest,
    /// sha256 (hex) of the manifest's text.
    pub manifest_digest: String,
    /// The manifest's text.
    pub text: String,
    /// Where it was read from, if from a file.
    pub path: Option<PathBuf>,
    /// The component bytes (verified against the pin when loaded).
    pub component: Vec<u8>,
}

impl MappingSource {
    /// Reads the manifest at `path` and the component file it names.
    ///
    /// # Errors
    /// Unreadable or invalid manifest or component file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading mapping manifest {}", path.display()))?;
        let manifest =
            MappingManifest::parse_in(&text, &path.display().to_string(), path.parent())?;
        let base = path.parent().unwrap_or(Path::new("."));
        let component = crate::runtime::read_component(&manifest.component_path(base))
            .with_context(|| format!("mapping `{}`", manifest.mapping.name))?;
        Ok(Self {
            manifest,
            manifest_digest: crate::registry::manifest_digest(&text),
            text,
            path: Some(path.to_path_buf()),
            component,
        })
    }

    /// A source from manifest text and component bytes held in memory.
    ///
    /// # Errors
    /// The manifest does not parse.
    pub fn from_memory(text: &str, source: &str, component: Vec<u8>) -> Result<Self> {
        Ok(Self {
            manifest: MappingManifest::parse(text, source)?,
            manifest_digest: crate::registry::manifest_digest(text),
            text: text.to_string(),
            path: None,
            component,
        })
    }
}

/// Opens the store `config` names: by default SQLite in its state folder (or the default
/// one); with `store = "postgres://…"` the shared PostgreSQL store. Either way with the
/// host key its `[trace] key` names (else the store's default key, see
/// [`crate::store::SqliteStore::open`]; for PostgreSQL the state folder's key file is the
/// last resort, and every host must hold the same key).
///
/// # Errors
/// No state folder can be determined (SQLite); the store cannot be opened.
pub fn open_registry(config: &ServeConfig) -> Result<Registry> {
    let dir = config
        .state_dir
        .clone()
        .or_else(crate::config::default_state_dir);
    let key = config.trace.host_key()?;
    let store = crate::store::open(&config.store, dir.as_deref(), key)?;
    Ok(Registry::new(store))
}

/// A loaded (verified, compiled, linked) mapping that is not yet bound to a connection.
struct Prepared {
    source: MappingSource,
    contract: crate::contract::Contract,
    adapter: LoadedAdapter,
}

impl Live {
    /// Starts the configured connections and loads the configured mappings (the
    /// `[[mapping]]` entries and every mapping in `mappings_dir`).
    ///
    /// # Errors
    /// Any connection that fails to start, any mapping that fails to load.
    pub async fn start(config: &ServeConfig) -> Result<Arc<Self>> {
        let mut sources = config
            .mappings
            .iter()
            .map(|p| MappingSource::from_file(p))
            .collect::<Result<Vec<_>>>()?;
        if let Some(dir) = &config.mappings_dir {
            for path in mapping_dir_manifests(dir)? {
                sources.push(MappingSource::from_file(&path)?);
            }
        }
        Self::start_with(config, sources).await
    }

    /// Like [`Live::start`], with mappings given in memory.
    ///
    /// # Errors
    /// As [`Live::start`].
    pub async fn start_with(
        config: &ServeConfig,
        sources: Vec<MappingSource>,
    ) -> Result<Arc<Self>> {
        let registry = open_registry(config)?;
        Self::start_with_registry(config, sources, registry).await
    }

    /// Like [`Live::start_with`], on an open registry.
    ///
    /// # Errors
    /// As [`Live::start`].
    pub async fn start_with_registry(
        config: &ServeConfig,
        sources: Vec<MappingSource>,
        registry: Registry,
    ) -> Result<Arc<Self>> {
        let runtime = Runtime::with_cache(config.cache_dir.as_deref())?;
        let host = Arc::new(Self {
            runtime,
            registry,
            config: config.clone(),
            connections: tokio::sync::Mutex::new(BTreeMap::new()),
            catalog: ArcSwap::from_pointee(Catalog::default()),
            changes: tokio::sync::watch::Sender::new(0),
            reload: tokio::sync::Mutex::new(()),
            staged: std::sync::Mutex::new(BTreeMap::new()),
            closing: std::sync::atomic::AtomicBool::new(false),
            in_flight: std::sync::atomic::AtomicUsize::new(0),
            drained: tokio::sync::Notify::new(),
        });
        // Verify pins, compile and link every mapping before any upstream process starts:
        // a refused component never causes upstream traffic. A mapping that fails is
        // refused alone.
        let total = sources.len();
        let mut refused: Vec<String> = Vec::new();
        let mut names = BTreeSet::new();
        let mut prepared = Vec::new();
        for source in sources {
            let name = source.manifest.mapping.name.clone();
            let path = source.path.clone();
            if !names.insert(name.clone()) {
                let e = anyhow::anyhow!(
                    "two mappings are named `{name}`; the later one ({}) is refused",
                    path.as_deref()
                        .map(|p| p.display().to_string())
                        .unwrap_or_else(|| "memory".into())
                );
                refused.push(host.refuse_mapping(&name, path.as_deref(), &e));
                continue;
            }
            match host.prepare(source) {
                Ok(p) => prepared.push(p),
                Err(e) => refused.push(host.refuse_mapping(&name, path.as_deref(), &e)),
            }
        }
        // Every connection a mapping uses starts now, in parallel, each within
        // `start_timeout`; one that fails is disconnected (retried in the background).
        let mut budgets: BTreeMap<String, u64> = BTreeMap::new();
        for p in &prepared {
            let m = &p.source.manifest;
            let b = budgets.entry(m.mapping.connection.clone()).or_default();
            *b = (*b).max(m.limits.max_output_bytes);
        }
        let mut starts = Vec::new();
        for (name, budget) in budgets {
            match host.open_connection(&name, budget, false).await {
                Ok((state, first)) => {
                    host.connections.lock().await.insert(name, state);
                    starts.extend(first);
                }
                Err(e) => {
                    tracing::error!(connection = %name, "connection cannot be started: {e:#}");
                }
            }
        }
        // Serve once every connection is ready or failed — but a straggler is not waited
        // for: see `START_WAIT_MIN`. It keeps starting in the background, and its
        // capabilities appear (with list_changed) once it is ready and its mappings judged.
        let begun = tokio::time::Instant::now();
        let limit = begun + config.start_timeout;
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
        let pending = starts.len();
        for first in starts {
            let done = done_tx.clone();
            tokio::spawn(async move {
                let _ = first.await;
                let _ = done.send(());
            });
        }
        drop(done_tx);
        let mut deadline = limit;
        for finished in 0..pending {
            match tokio::time::timeout_at(deadline, done_rx.recv()).await {
                Ok(Some(())) if finished == 0 => {
                    let first = begun.elapsed();
                    deadline = limit.min(begun + START_WAIT_MIN.max(first * START_WAIT_FACTOR));
                }
                Ok(Some(())) => {}
                Ok(None) | Err(_) => break,
            }
        }
        // Bound and swapped in under the reload lock, which a connection becoming ready
        // takes to judge its mappings: each mapping is judged either here or there.
        let _one = host.reload.lock().await;
        let mut catalog = Catalog::default();
        for p in prepared {
            let name = p.source.manifest.mapping.name.clone();
            let path = p.source.path.clone();
            let bound = match host.bind(p, false).await {
                Ok(Bound::Loaded(m, caps)) => catalog_with(&catalog, &[], (m, caps)),
                Ok(Bound::Staged(..)) => Err(anyhow::anyhow!("nothing is staged at start")),
                Err(e) => Err(e),
            };
            match bound {
                Ok(next) => catalog = next,
                Err(e) => refused.push(host.refuse_mapping(&name, path.as_deref(), &e)),
            }
        }
        if total > 0 && catalog.mappings.is_empty() {
            bail!("no mapping could be loaded:\n  {}", refused.join("\n  "));
        }
        host.catalog.store(Arc::new(catalog));
        drop(_one);
        Ok(host)
    }

    /// Logs and traces a mapping refused at start (the others load); returns the reason.
    fn refuse_mapping(&self, name: &str, path: Option<&Path>, e: &anyhow::Error) -> String {
        let why = format!("mapping `{name}` refused: {e:#}");
        tracing::error!(mapping = %name, "{why}; the other mappings load");
        self.registry.trace(
            crate::registry::events::MAPPING_LOAD_FAILED,
            &path.map_or_else(|| name.to_string(), |p| p.display().to_string()),
            json!({
                "mapping": name,
                "error": format!("{e:#}").chars().take(2000).collect::<String>(),
            }),
        );
        why
    }

    /// Verifies, compiles and links one mapping (no upstream traffic).
    fn prepare(&self, source: MappingSource) -> Result<Prepared> {
        let m = &source.manifest;
        if !self.config.connections.contains_key(&m.mapping.connection) {
            bail!(
                "mapping `{}` uses connection `{}`, which the serve configuration does not define",
                m.mapping.name,
                m.mapping.connection
            );
        }
        let contract = check_contract(m)?;
        let mut env = Vec::new();
        for (key, value) in &m.grants.env {
            let value = match value {
                crate::runtime::grants::EnvValue::Value(v) => v.clone(),
                crate::runtime::grants::EnvValue::Secret { secret } => self
                    .config
                    .secrets
                    .get(secret)
                    .map(|s| s.0.clone())
                    .with_context(|| {
                        format!(
                            "mapping `{}`: env grant {key} names secret `{secret}`, which the serve configuration's [secrets] does not define",
                            m.mapping.name
                        )
                    })?,
            };
            env.push((key.clone(), value));
        }
        let adapter = self
            .runtime
            .load_with_env(m, &source.component, &contract.interface, env)?;
        tracing::info!(mapping = %m.mapping.name, sha256 = %adapter.component_sha256(), "mapping verified");
        Ok(Prepared {
            source,
            contract,
            adapter,
        })
    }

    /// The connection `name`; identified and started (in the background) on first use.
    async fn connection(self: &Arc<Self>, name: &str, budget: u64) -> Result<Arc<ConnectionState>> {
        let mut connections = self.connections.lock().await;
        if let Some(c) = connections.get(name) {
            c.connection().raise_message_budget(budget);
            return Ok(c.clone());
        }
        // Started inline: the caller (a mapping loaded while serving) holds the reload lock
        // and binds against the connection's first snapshot, as at start.
        let (state, _) = self.open_connection(name, budget, true).await?;
        connections.insert(name.to_string(), state.clone());
        Ok(state)
    }

    /// Identifies connection `name` and starts it (within `start_timeout`): in the
    /// background, the handle resolving when that first start succeeded or failed; or
    /// `inline` (the caller holds the reload lock), returning once it did. A start that
    /// fails leaves it `disconnected`, with its reason, and retried in the background.
    ///
    /// # Errors
    /// The connection is not configured or cannot be identified (its executable cannot
    /// be read); the store fails.
    async fn open_connection(
        self: &Arc<Self>,
        name: &str,
        budget: u64,
        inline: bool,
    ) -> Result<(Arc<ConnectionState>, Option<tokio::task::JoinHandle<()>>)> {
        let server = self
            .config
            .connections
            .get(name)
            .with_context(|| format!("connection `{name}` is not configured"))?;
        let revision = self.registry.identify(name, server)?;
        tracing::info!(connection = %name, id = %revision.connection_id, revision = revision.revision, upstream = %server.describe(), "starting upstream connection");
        let empty = Catalogue {
            connection_id: revision.connection_id.clone(),
            config_digest: revision.config_digest.clone(),
            server_info: Value::Null,
            protocol_version: String::new(),
            capabilities: Value::Null,
            instructions: None,
            tools: vec![],
            resources: vec![],
            resource_templates: vec![],
            prompts: vec![],
        };
        let state = Arc::new(ConnectionState {
            name: name.to_string(),
            current: Arc::new(ArcSwap::from_pointee(Connection::unstarted(
                name,
                "it is starting".into(),
                budget,
            ))),
            restarting: tokio::sync::Mutex::new(None),
            revision,
            catalogue: ArcSwap::from_pointee(empty),
            snapshot: Arc::new(ArcSwap::from_pointee(String::new())),
            seen: AtomicU64::new(0),
            // Not stale: it is refused for not being open until its first start installs it.
            healthy: std::sync::atomic::AtomicBool::new(true),
            refresh: tokio::sync::Mutex::new(()),
            status: ArcSwap::from_pointee(ConnectionStatus::Connecting),
        });
        self.trace_status(&state, None, &ConnectionStatus::Connecting);
        let (host, s, server) = (self.clone(), state.clone(), server.clone());
        let first = async move {
            let installed = match host.establish(&s, &server, budget).await {
                Ok((connection, raw, seen)) => {
                    host.install(&s, connection, raw, seen, inline).await
                }
                Err(e) => Err(e),
            };
            if let Err(e) = installed {
                let why = format!("{e:#}");
                s.current.store(Arc::new(Connection::unstarted(
                    &s.name,
                    why.clone(),
                    budget,
                )));
                host.set_status(&s, ConnectionStatus::Disconnected(why));
                host.watch_connection(&s);
            }
        };
        if inline {
            first.await;
            return Ok((state, None));
        }
        Ok((state, Some(tokio::spawn(first))))
    }

    /// Starts the server of `state` and discovers its catalogue, together within
    /// `start_timeout`. Returns the connection, the raw discovery and the `list_changed`
    /// count it covers. On failure nothing of the server is left running.
    async fn establish(
        &self,
        state: &ConnectionState,
        server: &crate::upstream::UpstreamServer,
        budget: u64,
    ) -> Result<(Connection, crate::upstream::RawDiscovery, u64)> {
        let name = state.name.as_str();
        let limit = self.config.start_timeout;
        let started = tokio::time::timeout(limit, async {
            let connection = Connection::start(name, server, budget, limit).await?;
            if let Some((sname, sversion)) = connection.server_info() {
                tracing::info!(connection = %name, server = %sname, version = %sversion, "upstream connected (reported name: an observation, not an identity)");
            }
            let seen = connection.list_changed_count();
            let raw = connection
                .discover(DISCOVERY_TIMEOUT.min(limit))
                .await
                .map_err(|e| anyhow::anyhow!("discovery on connection `{name}` failed: {e}"))?;
            anyhow::Ok((connection, raw, seen))
        })
        .await;
        match started {
            Ok(result) => result,
            Err(_) => bail!(
                "connection `{name}` did not start and answer discovery within {} ms (start_timeout); its server was stopped",
                limit.as_millis()
            ),
        }
    }

    /// Puts a freshly established connection into service: records its snapshot, judges
    /// every mapping bound to it against its pins, and only then marks it ready (and tells
    /// the clients the list changed).
    ///
    /// # Errors
    /// The catalogue is malformed; the store fails. The connection is then not installed.
    async fn install(
        self: &Arc<Self>,
        state: &Arc<ConnectionState>,
        connection: Connection,
        raw: crate::upstream::RawDiscovery,
        seen: u64,
        reload_held: bool,
    ) -> Result<()> {
        // Mappings are judged under the reload lock (see `start_with_registry`).
        let _mappings = if reload_held {
            None
        } else {
            Some(self.reload.lock().await)
        };
        let _one = state.refresh.lock().await;
        let catalogue = Registry::catalogue(&state.revision, raw);
        let previous = state.snapshot_digest();
        let observed = self.registry.record_snapshot(
            &state.name,
            &state.revision,
            &catalogue,
            (!previous.is_empty()).then_some(previous.as_str()),
        )?;
        tracing::info!(connection = %state.name, snapshot = %crate::registry::short(&observed.digest), tools = catalogue.tools.len(), "snapshot taken");
        connection.raise_message_budget(state.connection().message_budget());
        // Not healthy until its mappings are judged, though its new connection is open.
        state.healthy.store(false, Ordering::Release);
        state.current.store(Arc::new(connection));
        state.catalogue.store(Arc::new(catalogue));
        state.snapshot.store(Arc::new(observed.digest));
        // Judged before the connection counts as ready: a call that finds it ready also
        // finds every verdict applied.
        self.evaluate_connection(state).await;
        state.seen.store(seen, Ordering::Release);
        state.healthy.store(true, Ordering::Release);
        self.set_status(state, ConnectionStatus::Ready);
        self.notify_changed();
        self.watch_connection(state);
        Ok(())
    }

    /// Moves `state` to `next`, tracing and logging the transition (nothing when it is
    /// already there).
    fn set_status(&self, state: &ConnectionState, next: ConnectionStatus) {
        let previous = state.status.swap(Arc::new(next.clone()));
        if *previous != next {
            self.trace_status(state, Some(&previous), &next);
        }
    }

    fn trace_status(
        &self,
        state: &ConnectionState,
        from: Option<&ConnectionStatus>,
        to: &ConnectionStatus,
    ) {
        tracing::warn!(
            connection = %state.name,
            from = from.map_or("none", |f| f.as_str()),
            "connection is now {to}"
        );
        self.registry.trace(
            crate::registry::events::CONNECTION_STATE,
            &state.name,
            json!({
                "connection_id": state.revision.connection_id,
                "from": from.map(ConnectionStatus::as_str),
                "to": to.as_str(),
                "reason": to.reason().map(|r| r.chars().take(2000).collect::<String>()),
            }),
        );
    }

    /// Starts a connection again after its server closed it (exited, closed stdout) or
    /// never started — never a degraded one, whose server broke the protocol — within
    /// `start_timeout`, re-discovers it and judges its mappings against their pins before
    /// it serves: a server that comes back with a different catalogue meets the same drift
    /// verdicts as one that announced a change. At most one restart per
    /// [`MIN_RESTART_INTERVAL`] per connection; an open connection is left alone.
    ///
    /// # Errors
    /// Restarted too recently; the host is stopping; the server could not be started;
    /// discovery failed.
    pub async fn restart_connection(self: &Arc<Self>, state: &Arc<ConnectionState>) -> Result<()> {
        let mut last = state.restarting.lock().await;
        let old = state.connection();
        if old.is_open() {
            return Ok(());
        }
        if self.is_closing() {
            bail!("the host is shutting down");
        }
        if !old.has_exited() {
            anyhow::bail!(
                "{}",
                old.degraded()
                    .unwrap_or_else(|| format!("connection `{}` is not usable", state.name))
            );
        }
        if let Some(at) = *last
            && at.elapsed() < MIN_RESTART_INTERVAL
        {
            anyhow::bail!(
                "connection `{}` was restarted {} ms ago; not again before {} ms",
                state.name,
                at.elapsed().as_millis(),
                MIN_RESTART_INTERVAL.as_millis()
            );
        }
        *last = Some(std::time::Instant::now());
        let server = self
            .config
            .connections
            .get(&state.name)
            .with_context(|| format!("connection `{}` is not configured", state.name))?;
        tracing::info!(connection = %state.name, "restarting a closed upstream connection");
        let budget = old.message_budget();
        let installed = match self.establish(state, server, budget).await {
            Ok((connection, raw, seen)) => self.install(state, connection, raw, seen, false).await,
            Err(e) => Err(e),
        };
        drop(last);
        if let Err(e) = installed {
            let why = format!("{e:#}");
            self.set_status(state, ConnectionStatus::Disconnected(why));
            return Err(e);
        }
        self.registry.trace(
            crate::registry::events::CONNECTION_RESTARTED,
            &state.name,
            json!({"connection_id": state.revision.connection_id}),
        );
        Ok(())
    }

    /// The connection's server went away (or broke the protocol): it stops serving at
    /// once, the clients are told the list changed, and the transition is traced.
    fn connection_lost(&self, state: &ConnectionState, degraded: bool) {
        // It is refused already: its connection is not open (see `is_healthy`).
        let conn = state.connection();
        let why = conn
            .down_reason()
            .unwrap_or_else(|| "the server closed the connection".into());
        let next = if degraded {
            ConnectionStatus::Degraded(why)
        } else {
            ConnectionStatus::Disconnected(why)
        };
        let was_ready = *state.status() == ConnectionStatus::Ready;
        self.set_status(state, next);
        if was_ready {
            self.notify_changed();
        }
    }

    /// Watches one connection: re-snapshots it whenever its server announces a list
    /// change (and every `snapshot_interval`); the moment its server goes away, takes it
    /// out of service and restarts it with backoff.
    fn watch_connection(self: &Arc<Self>, state: &Arc<ConnectionState>) {
        let host = Arc::downgrade(self);
        let state = Arc::downgrade(state);
        let interval = self.config.snapshot_interval;
        tokio::spawn(async move {
            loop {
                let Some(s) = state.upgrade() else { return };
                let seen = s.seen.load(Ordering::Acquire);
                let conn = s.connection();
                drop(s);
                let periodic = async {
                    match interval {
                        Some(d) => tokio::time::sleep(d).await,
                        None => std::future::pending::<()>().await,
                    }
                };
                enum Woke {
                    Changed(bool),
                    Gone,
                    Degraded,
                }
                let woke = if conn.has_exited() {
                    Woke::Gone
                } else {
                    tokio::select! {
                        () = conn.list_changed_after(seen) => Woke::Changed(false),
                        () = periodic => Woke::Changed(true),
                        () = conn.until_gone() => Woke::Gone,
                        () = conn.until_degraded() => Woke::Degraded,
                    }
                };
                let (Some(h), Some(s)) = (host.upgrade(), state.upgrade()) else {
                    return;
                };
                if h.is_closing() {
                    return;
                }
                let forced = match woke {
                    Woke::Changed(forced) => forced,
                    Woke::Gone => {
                        h.connection_lost(&s, false);
                        drop(h);
                        restart_with_backoff(h_again(&host), s).await;
                        return;
                    }
                    Woke::Degraded => {
                        // Not restarted by itself (a server that broke the protocol).
                        h.connection_lost(&s, true);
                        return;
                    }
                };
                if let Err(e) = h.refresh(&s, forced).await {
                    tracing::warn!(connection = %s.name, "re-discovery failed: {e:#}");
                }
                drop(h);
                if !forced {
                    // At most one announced re-discovery per interval in the background: a
                    // server flooding list_changed costs itself, not the store (calls
                    // still re-check first).
                    tokio::time::sleep(MIN_REDISCOVERY_INTERVAL).await;
                }
                if !Arc::ptr_eq(&conn, &s.connection()) {
                    // Replaced meanwhile (restarted elsewhere): that start watches it.
                    return;
                }
            }
        });
    }

    /// Takes a new snapshot of `state` if the server announced a change since the last
    /// one (or `force`), then re-evaluates every mapping bound to it.
    ///
    /// # Errors
    /// Discovery failed; the store failed.
    pub async fn refresh(
        self: &Arc<Self>,
        state: &Arc<ConnectionState>,
        force: bool,
    ) -> Result<()> {
        let _one = state.refresh.lock().await;
        let connection = state.connection();
        let target = connection.list_changed_count();
        if !force && !state.is_stale() {
            return Ok(());
        }
        if !connection.is_open() {
            // Down: nothing to discover; it serves again once restarted and installed.
            bail!("connection `{}` is {}", state.name, state.status());
        }
        let raw = match connection.discover(DISCOVERY_TIMEOUT).await {
            Ok(raw) => raw,
            Err(e) => {
                // Until a discovery succeeds, nothing on this connection is current.
                state.healthy.store(false, Ordering::Release);
                self.registry.trace(
                    crate::registry::events::SNAPSHOT_FAILED,
                    &state.name,
                    json!({"connection_id": state.revision.connection_id, "error": e.to_string()}),
                );
                bail!("discovery on connection `{}` failed: {e}", state.name);
            }
        };
        let catalogue = Registry::catalogue(&state.revision, raw);
        let previous = state.snapshot_digest();
        let observed = match self.registry.record_snapshot(
            &state.name,
            &state.revision,
            &catalogue,
            Some(previous.as_str()),
        ) {
            Ok(o) => o,
            Err(e) => {
                state.healthy.store(false, Ordering::Release);
                return Err(e);
            }
        };
        state.catalogue.store(Arc::new(catalogue));
        state.snapshot.store(Arc::new(observed.digest));
        // Mappings are judged before the connection counts as current: a call that finds
        // it current also finds every verdict already applied.
        self.evaluate_connection(state).await;
        state.seen.store(target, Ordering::Release);
        state.healthy.store(true, Ordering::Release);
        Ok(())
    }

    /// Re-evaluates every serving mapping bound to `state` against its current snapshot;
    /// blocks those whose pins broke and tells the model-facing clients.
    async fn evaluate_connection(&self, state: &ConnectionState) {
        let catalog = self.catalog.load_full();
        let catalogue = state.catalogue();
        let snapshot = state.snapshot_digest();
        let mut changed = false;
        for mapping in catalog.mappings.values() {
            if mapping.connection.name != state.name || !mapping.serves() {
                continue;
            }
            let record = mapping.record();
            if let Verdict::Blocked {
                reason,
                drift,
                needs_review: true,
            } = self.registry.evaluate(&record, &mapping.tools, &catalogue)
            {
                tracing::warn!(mapping = %mapping.name, "{reason}; the mapping now needs review");
                match self
                    .registry
                    .require_review(&record, &reason, &drift, &snapshot)
                {
                    Ok(Some(new)) => mapping.record.store(Arc::new(new)),
                    Ok(None) => {
                        // Changed elsewhere meanwhile; refuse locally all the same.
                        let mut local = (*record).clone();
                        local.state = crate::store::MappingState::ReviewRequired;
                        local.reason = reason.clone();
                        mapping.record.store(Arc::new(local));
                    }
                    Err(e) => {
                        tracing::error!(mapping = %mapping.name, "could not record review-required: {e:#}");
                        let mut local = (*record).clone();
                        local.state = crate::store::MappingState::ReviewRequired;
                        local.reason = reason.clone();
                        mapping.record.store(Arc::new(local));
                    }
                }
                changed = true;
            }
        }
        if changed {
            self.notify_changed();
        }
    }

    /// Binds a prepared mapping to its connection: registers the revision, evaluates its
    /// pins against the connection's snapshot, and builds its capabilities. With `stage`
    /// (a reviewed revision of this mapping serves here), an unreviewed manifest is bound
    /// but marked staged: the caller keeps it aside instead of swapping it in.
    async fn bind(self: &Arc<Self>, p: Prepared, stage: bool) -> Result<Bound> {
        let m = &p.source.manifest;
        let name = m.mapping.name.clone();
        let state = self
            .connection(&m.mapping.connection, m.limits.max_output_bytes)
            .await?;
        let registration = self.registry.register_mapping(
            m,
            Some(&p.source.text),
            &p.source.manifest_digest,
            p.adapter.component_sha256(),
            &state.revision,
            stage,
        )?;
        let mut record = match registration {
            // A serving record must be proven by the trace before anything else.
            crate::registry::Registration::Recorded(record) => self.registry.proven(*record),
            crate::registry::Registration::Staged { reason } => {
                tracing::warn!(mapping = %name, "changed manifest staged; the reviewed revision keeps serving until this one is approved: {reason}");
                let staged = MappingRecord {
                    name: name.clone(),
                    revision: 0,
                    manifest_digest: p.source.manifest_digest.clone(),
                    component_sha256: p.adapter.component_sha256().to_string(),
                    connection_id: state.revision.connection_id.clone(),
                    config_revision: state.revision.revision,
                    snapshot_digest: None,
                    pins: Value::Null,
                    state: crate::store::MappingState::Candidate,
                    reviewer: None,
                    reason: format!("staged, not reviewed: {reason}"),
                    created_ms: 0,
                    state_changed_ms: 0,
                    manifest_text: None,
                };
                let (mapping, caps) = self.assemble(p, state, staged)?;
                return Ok(Bound::Staged(mapping, caps));
            }
        };
        if state.snapshot_digest().is_empty() {
            // The connection has not started yet: its mappings are judged against their
            // pins once it has (see `install`), before anything of theirs is offered.
            tracing::warn!(mapping = %name, connection = %m.mapping.connection, status = %state.status(), "mapping loaded; not offered until its connection starts and its pins are checked");
        } else {
            match self
                .registry
                .evaluate(&record, &m.upstream.tools, &state.catalogue())
            {
                Verdict::Serves => {
                    tracing::info!(mapping = %name, revision = record.revision, state = %record.state, "mapping serves");
                }
                Verdict::Blocked {
                    reason,
                    drift,
                    needs_review,
                } => {
                    if needs_review
                        && let Some(new) = self.registry.require_review(
                            &record,
                            &reason,
                            &drift,
                            &state.snapshot_digest(),
                        )?
                    {
                        record = new;
                    }
                    tracing::warn!(
                        mapping = %name,
                        revision = record.revision,
                        state = %record.state,
                        "mapping loaded but not offered: {reason}. Review it: `airlock discover {connection} --config FILE`, `airlock review show {name}`, then `airlock review approve {name} --config FILE --reviewer NAME`", connection = m.mapping.connection
                    );
                }
            }
        }
        self.registry.trace(
            crate::registry::events::MAPPING_LOADED,
            &name,
            json!({
                "revision": record.revision,
                "state": record.state,
                "component_sha256": p.adapter.component_sha256(),
                "manifest_digest": p.source.manifest_digest,
                "connection_id": state.revision.connection_id,
            }),
        );
        let (mapping, caps) = self.assemble(p, state, record)?;
        Ok(Bound::Loaded(mapping, caps))
    }

    /// Builds the loaded mapping and its capabilities.
    fn assemble(
        &self,
        p: Prepared,
        state: Arc<ConnectionState>,
        record: MappingRecord,
    ) -> Result<(Arc<ActiveMapping>, Vec<Capability>)> {
        let m = &p.source.manifest;
        let name = m.mapping.name.clone();
        let budget =
            crate::runtime::budgets::OutputBudget::from_limits(&m.limits).map_err(|why| {
                anyhow::anyhow!("mapping `{name}`: [limits] allowed_media_types {why}")
            })?;
        let grant = Arc::new(UpstreamGrant {
            mapping: name.clone(),
            connection: state.connection_cell(),
            snapshot: state.snapshot.clone(),
            tools: m.upstream.tools.iter().cloned().collect(),
            resource_prefixes: m.upstream.resources.clone(),
            budget,
        });
        let mapping = Arc::new(ActiveMapping {
            name: name.clone(),
            adapter: p.adapter,
            grant,
            tools: m.upstream.tools.clone(),
            connection: state,
            manifest_digest: p.source.manifest_digest.clone(),
            manifest_path: p.source.path.clone(),
            generation: NEXT_GENERATION.fetch_add(1, Ordering::Relaxed),
            contract: p.contract.interface.clone(),
            data_class: m.mapping.data_class.clone(),
            query: m
                .capabilities
                .iter()
                .find_map(|c| contract::query_function(&p.contract.interface, &c.function))
                .and_then(|q| p.contract.functions.get(q).cloned()),
            reconciled: tokio::sync::OnceCell::new(),
            swept: std::sync::Mutex::new(None),
            record: ArcSwap::from_pointee(record),
        });
        let mut capabilities = Vec::new();
        for cap in &m.capabilities {
            let function = p.contract.functions[&cap.function].clone();
            let input_schema = capability_input_schema(&function)
                .with_context(|| format!("mapping `{name}`, capability `{}`", cap.name))?;
            // The contract's declaration as the reviewed manifest confirmed and narrowed it.
            let semantics = m.semantics(cap).with_context(|| {
                format!(
                    "mapping `{name}`, capability `{}`: no effect semantics",
                    cap.name
                )
            })?;
            capabilities.push(Capability {
                name: cap.name.clone(),
                description: cap.description.clone(),
                function,
                input_schema: Arc::new(input_schema),
                semantics,
                mapping: mapping.clone(),
            });
        }
        Ok((mapping, capabilities))
    }

    /// The current catalog (every loaded capability; [`Catalog::offered`] filters).
    pub fn catalog(&self) -> Arc<Catalog> {
        self.catalog.load_full()
    }

    /// The running connections.
    pub async fn connections(&self) -> BTreeMap<String, Arc<ConnectionState>> {
        self.connections.lock().await.clone()
    }

    /// The wasmtime runtime.
    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    /// The registry (store and trace).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Tells every front that what could be offered may have changed (they send
    /// `notifications/tools/list_changed` to their clients).
    pub fn notify_changed(&self) {
        self.changes.send_modify(|n| *n += 1);
    }

    /// Counts a call as running until the guard drops; `None` once the host is stopping
    /// (the call must be refused).
    pub fn call_started(&self) -> Option<InFlight<'_>> {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        let guard = InFlight(self);
        (!self.is_closing()).then_some(guard)
    }

    /// Calls running now.
    pub fn calls_in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// True once the host is stopping.
    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// Marks the host as stopping: new calls are refused, no connection is restarted.
    pub fn begin_shutdown(&self) {
        self.closing.store(true, Ordering::Release);
    }

    /// Waits until no call runs, at most `limit`. Returns false when calls still ran.
    pub async fn drain(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let drained = self.drained.notified();
            if self.calls_in_flight() == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, drained).await.is_err() {
                return self.calls_in_flight() == 0;
            }
        }
    }

    /// Stops every connection: each server and its process group gets `SIGTERM`, then
    /// `SIGKILL` after `grace` (all connections at once). Marks the host as stopping.
    pub async fn shutdown(&self, grace: Duration) {
        self.begin_shutdown();
        let states: Vec<Arc<ConnectionState>> =
            self.connections.lock().await.values().cloned().collect();
        let mut stops = tokio::task::JoinSet::new();
        for state in &states {
            state.healthy.store(false, Ordering::Release);
            let conn = state.connection();
            stops.spawn(async move { conn.terminate(grace).await });
        }
        while stops.join_next().await.is_some() {}
        for state in &states {
            self.set_status(state, ConnectionStatus::Stopped);
        }
    }

    /// A receiver that sees every [`Live::notify_changed`].
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Re-reads every loaded mapping's record from the store (an approval or retirement
    /// made by `airlock review` while this host runs) and applies it. Returns true when the
    /// offered catalog changed. Rules:
    /// - the latest revision binds the loaded manifest: its state and pins decide;
    /// - it binds a staged manifest and serves: the staged mapping is swapped in;
    /// - it binds another manifest and serves (approved ahead of deployment): the loaded
    ///   revision keeps serving until that manifest arrives;
    /// - it binds another manifest and does not serve (retired, review-required...): the
    ///   loaded revision stops serving too.
    ///
    /// # Errors
    /// The store fails.
    pub async fn sync_with_store(&self) -> Result<bool> {
        let _one = self.reload.lock().await;
        let catalog = self.catalog.load_full();
        let mut changed = false;
        let mut next: Option<Catalog> = None;
        for mapping in catalog.mappings.values() {
            let Some(latest) = self.registry.store().mapping(&mapping.name)? else {
                continue;
            };
            let current = mapping.record();
            if latest.revision == current.revision && latest.state == current.state {
                continue;
            }
            let was = mapping.serves();
            if latest.manifest_digest != mapping.manifest_digest {
                let staged = {
                    let mut staged = self.staged.lock().unwrap_or_else(|e| e.into_inner());
                    match staged.get(&mapping.name) {
                        Some((m, _))
                            if m.manifest_digest == latest.manifest_digest
                                && latest.state.serves() =>
                        {
                            staged.remove(&mapping.name)
                        }
                        _ => None,
                    }
                };
                if let Some((staged, caps)) = staged {
                    let record = self.judge(latest, &staged.tools, &staged.connection)?;
                    tracing::info!(mapping = %mapping.name, revision = record.revision, state = %record.state, "approved staged manifest swapped in");
                    self.registry.trace(
                        crate::registry::events::MAPPING_LOADED,
                        &mapping.name,
                        json!({
                            "revision": record.revision,
                            "state": record.state,
                            "component_sha256": staged.adapter.component_sha256(),
                            "manifest_digest": staged.manifest_digest,
                            "connection_id": staged.connection.revision.connection_id,
                        }),
                    );
                    staged.record.store(Arc::new(record));
                    let base = next.take().unwrap_or_else(|| catalog_with_all(&catalog));
                    next = Some(catalog_with(
                        &base,
                        &[mapping.name.as_str()],
                        (staged, caps),
                    )?);
                    changed = true;
                    continue;
                }
                if latest.state.serves() {
                    // Approved ahead of deployment: serve on until the manifest arrives.
                    continue;
                }
                let mut local = (*current).clone();
                local.state = latest.state;
                local.reason = format!(
                    "revision {} ({}) superseded this one: {}",
                    latest.revision, latest.state, latest.reason
                );
                tracing::info!(mapping = %mapping.name, revision = latest.revision, state = %latest.state, "a later revision stops this one");
                mapping.record.store(Arc::new(local));
                changed |= was != mapping.serves();
                continue;
            }
            let record = self.judge(latest, &mapping.tools, &mapping.connection)?;
            if record.revision == current.revision
                && record.state == current.state
                && record.reason == current.reason
            {
                // Judged as before (a refused record re-read every poll).
                continue;
            }
            tracing::info!(mapping = %mapping.name, revision = record.revision, state = %record.state, "mapping record changed in the store");
            mapping.record.store(Arc::new(record));
            changed |= was != mapping.serves();
        }
        if let Some(next) = next {
            self.catalog.store(Arc::new(next));
        }
        if changed {
            self.notify_changed();
        }
        Ok(changed)
    }

    /// Judges `record` against its connection's current snapshot; before the connection's
    /// first snapshot there is nothing to judge against, and the judgement happens when
    /// it is ready (see `install`).
    fn judge(
        &self,
        record: MappingRecord,
        tools: &[String],
        state: &ConnectionState,
    ) -> Result<MappingRecord> {
        // A serving record the trace does not prove is refused (crate::registry::Registry::prove).
        let record = self.registry.proven(record);
        let snapshot = state.snapshot_digest();
        if snapshot.is_empty() {
            return Ok(record);
        }
        self.registry
            .judge(record, tools, &state.catalogue(), &snapshot)
    }

    /// Loads (or reloads) the mapping at `path` and swaps it into the catalog atomically.
    /// Calls already running finish on the revision they started with. On failure the old
    /// revision, if any, keeps serving, and the failure is traced.
    ///
    /// # Errors
    /// The manifest or component is invalid or unverifiable; compiling failed.
    pub async fn load_mapping_file(self: &Arc<Self>, path: &Path) -> Result<String> {
        let _one = self.reload.lock().await;
        let result = async {
            let source = MappingSource::from_file(path)?;
            let name = source.manifest.mapping.name.clone();
            let current = self.catalog.load_full();
            if let Some(old) = current.mappings.get(&name) {
                let bytes_sha256 = hex::encode(sha2::Sha256::digest(&source.component));
                if old.manifest_digest == source.manifest_digest
                    && old.adapter.component_sha256() == bytes_sha256
                {
                    return Ok((name, false));
                }
                if old.manifest_path.as_deref() != Some(path) {
                    bail!(
                        "mapping `{name}` is already loaded from {}",
                        old.manifest_path
                            .as_deref()
                            .map(|p| p.display().to_string())
                            .unwrap_or_else(|| "memory".into())
                    );
                }
            }
            // Verify and compile off the request path.
            let host = self.clone();
            let prepared = tokio::task::spawn_blocking(move || host.prepare(source))
                .await
                .context("the compile task failed")??;
            let serving = current.mappings.get(&name).is_some_and(|m| m.serves());
            match self.bind(prepared, serving).await? {
                Bound::Loaded(mapping, caps) => {
                    self.staged
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&name);
                    let current = self.catalog.load_full();
                    let next = catalog_with(&current, &[name.as_str()], (mapping, caps))?;
                    self.catalog.store(Arc::new(next));
                    Ok((name, true))
                }
                Bound::Staged(mapping, caps) => {
                    self.staged
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(name.clone(), (mapping, caps));
                    Ok((name, false))
                }
            }
        }
        .await;
        match result {
            Ok((name, swapped)) => {
                if swapped {
                    tracing::info!(mapping = %name, manifest = %path.display(), "mapping revision swapped in");
                    self.notify_changed();
                }
                Ok(name)
            }
            Err(e) => {
                tracing::error!(manifest = %path.display(), "mapping not loaded; any previous revision keeps serving: {e:#}");
                self.registry.trace(
                    crate::registry::events::MAPPING_LOAD_FAILED,
                    &path.display().to_string(),
                    json!({"error": format!("{e:#}").chars().take(2000).collect::<String>()}),
                );
                Err(e)
            }
        }
    }

    /// Unloads mapping `name`: its capabilities leave the catalog and no reference minted
    /// for it resolves again (its load generation is gone). Calls already running finish.
    pub async fn unload_mapping(&self, name: &str) -> bool {
        let _one = self.reload.lock().await;
        self.staged
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
        let current = self.catalog.load_full();
        let Some(old) = current.mappings.get(name).cloned() else {
            return false;
        };
        let next = Catalog {
            capabilities: current
                .capabilities
                .iter()
                .filter(|c| c.mapping.name != name)
                .map(Capability::clone_shallow)
                .collect(),
            mappings: current
                .mappings
                .iter()
                .filter(|(n, _)| *n != name)
                .map(|(n, m)| (n.clone(), m.clone()))
                .collect(),
        };
        // References minted under it carry its load generation: they no longer resolve.
        self.catalog.store(Arc::new(next));
        self.registry.trace(
            crate::registry::events::MAPPING_UNLOADED,
            name,
            json!({"revision": old.record().revision}),
        );
        tracing::info!(mapping = %name, "mapping unloaded; its references are revoked");
        self.notify_changed();
        true
    }

    /// The serve configuration.
    pub fn config(&self) -> &ServeConfig {
        &self.config
    }
}

impl Capability {
    fn clone_shallow(&self) -> Self {
        Self {
            name: self.name.clone(),
            description: self.description.clone(),
            function: self.function.clone(),
            input_schema: self.input_schema.clone(),
            semantics: self.semantics,
            mapping: self.mapping.clone(),
        }
    }
}

/// A shallow copy of `current`.
fn catalog_with_all(current: &Catalog) -> Catalog {
    Catalog {
        capabilities: current
            .capabilities
            .iter()
            .map(Capability::clone_shallow)
            .collect(),
        mappings: current.mappings.clone(),
    }
}

/// `current` without the mappings named in `replace`, plus `added`.
///
/// # Errors
/// A capability name `added` offers is already offered by another mapping.
fn catalog_with(
    current: &Catalog,
    replace: &[&str],
    added: (Arc<ActiveMapping>, Vec<Capability>),
) -> Result<Catalog> {
    let (mapping, caps) = added;
    let mut capabilities: Vec<Capability> = current
        .capabilities
        .iter()
        .filter(|c| !replace.contains(&c.mapping.name.as_str()) && c.mapping.name != mapping.name)
        .map(Capability::clone_shallow)
        .collect();
    for cap in caps {
        if let Some(other) = capabilities.iter().find(|c| c.name == cap.name) {
            bail!(
                "capability name `{}` is offered by two mappings (`{}` and `{}`)",
                cap.name,
                other.mapping.name,
                mapping.name
            );
        }
        capabilities.push(cap);
    }
    let mut mappings = current.mappings.clone();
    mappings.insert(mapping.name.clone(), mapping);
    Ok(Catalog {
        capabilities,
        mappings,
    })
}

/// The mapping manifests in a watched mappings folder: `<dir>/<name>/mapping.toml`, sorted.
///
/// # Errors
/// The folder cannot be read.
pub fn mapping_dir_manifests(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let entries = std::fs::read_dir(dir)
        .with_context(|| format!("reading the mappings folder {}", dir.display()))?;
    for entry in entries {
        let path = entry?.path().join("mapping.toml");
        if path.is_file() {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}

/// A capability's input schema: the schema of its contract function's single record
/// parameter.
fn capability_input_schema(function: &ContractFunction) -> Result<JsonObject> {
    match function.params.as_slice() {
        [(_, shape @ Shape::Record(_))] => match contract::json_schema(shape) {
            Value::Object(o) => Ok(o),
            _ => bail!("derived schema is not an object"),
        },
        _ => bail!(
            "contract function `{}` must take exactly one record parameter to be offered as a capability",
            function.name
        ),
    }
}

/// The load-time check of a mapping against its contract, without a component or a
/// serve configuration: the contract is one this host knows, every capability names one
/// of its functions, the host declares effect semantics for that function, and it is not
/// a host-only function (reconciliation's `query`). `airlock grants` runs the same check.
///
/// # Errors
/// The first rule broken, naming the mapping, the capability and the function.
pub fn check_contract(m: &MappingManifest) -> Result<contract::Contract> {
    let contract = contract::load_contract(&m.mapping.contract)
        .with_context(|| format!("mapping `{}`", m.mapping.name))?;
    for cap in &m.capabilities {
        if !contract.functions.contains_key(&cap.function) {
            bail!(
                "mapping `{}`: capability `{}` names function `{}`, which contract {} does not have",
                m.mapping.name,
                cap.name,
                cap.function,
                contract.interface
            );
        }
        match contract::effect_semantics(&contract.interface, &cap.function) {
            None => bail!(
                "mapping `{}`: capability `{}`: this host declares no effect semantics for {}#{}, so it cannot be offered",
                m.mapping.name,
                cap.name,
                contract.interface,
                cap.function
            ),
            Some(s) if s.host_only => bail!(
                "mapping `{}`: capability `{}`: {}#{} is called by the host only (reconciliation) and may not be offered to the model",
                m.mapping.name,
                cap.name,
                contract.interface,
                cap.function
            ),
            Some(_) => {}
        }
    }
    Ok(contract)
}
