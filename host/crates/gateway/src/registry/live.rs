//! The live registry: what a running host serves right now — its upstream connections
//! with their latest snapshots, the loaded mapping revisions and their capabilities, and
//! changed manifests staged for review. [`Live`] composes the parts, each in its own
//! module with the rule it enforces:
//!
//! | part | module | rule |
//! |---|---|---|
//! | connection supervision | [`super::connections`] | only a `ready` connection serves; it is ready only once started, snapshotted and its mappings judged |
//! | mapping loading | [`super::loading`] | verified, compiled and linked before any upstream traffic; a refused mapping is refused alone |
//! | the live catalogue | [`super::catalog`] | swapped atomically; one capability name, one mapping; one load generation per load |
//! | store sync | [`super::sync`] | the store's latest revision decides; an approval ahead of deployment waits for its manifest |
//! | drain | [`super::drain`] | once stopping, no call starts; the stop waits for the calls in flight |
//!
//! Rules of the whole:
//! - Every change to what could be offered bumps [`Live::changes`], which the fronts turn
//!   into `notifications/tools/list_changed` for their clients.
//! - At start, every mapping is verified, compiled and linked first; then every
//!   connection a mapping uses starts, in parallel; one that fails never stops the host,
//!   and a straggler is not waited for beyond [`START_WAIT_MIN`] / [`START_WAIT_FACTOR`].
//!   The host refuses to start only when every mapping is refused.
//! - Mappings are bound and judged under the reload lock, which a connection becoming
//!   ready takes too: each mapping is judged either at its binding or at its connection's
//!   start, never neither.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use arc_swap::ArcSwap;

use anyhow::{Result, bail};

use crate::config::ServeConfig;
use crate::registry::Registry;
use crate::runtime::Runtime;

pub use super::catalog::{ActiveMapping, Capability, Catalog, LoadedMapping};
pub use super::connections::{
    ConnectionState, ConnectionStatus, DISCOVERY_TIMEOUT, MIN_REDISCOVERY_INTERVAL,
    MIN_RESTART_INTERVAL, START_WAIT_FACTOR, START_WAIT_MIN,
};
pub use super::drain::{Calls, InFlight};
use super::loading::{Bound, Prepared};
pub use super::loading::{MappingSource, check_contract, mapping_dir_manifests};

/// The live registry of a running host: connections, the registry store, the current
/// catalog, staged mappings. Shared by all sessions.
pub struct Live {
    pub(super) runtime: Runtime,
    pub(super) registry: Registry,
    pub(super) config: ServeConfig,
    /// The connections by name ([`super::connections`]).
    pub(super) connections: tokio::sync::Mutex<BTreeMap<String, Arc<ConnectionState>>>,
    /// What is loaded now ([`super::catalog`]).
    pub(super) catalog: ArcSwap<Catalog>,
    pub(super) changes: tokio::sync::watch::Sender<u64>,
    /// Held while mappings are bound, swapped or judged.
    pub(super) reload: tokio::sync::Mutex<()>,
    /// Changed manifests waiting for approval while their reviewed revision serves.
    pub(super) staged: std::sync::Mutex<BTreeMap<String, LoadedMapping>>,
    /// Calls in flight; whether the host is stopping ([`super::drain`]).
    pub(super) calls: Calls,
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
            calls: Calls::default(),
        });
        let total = sources.len();
        let (prepared, mut refused) = host.prepare_all(sources);
        let starts = host.start_connections(&prepared).await;
        super::connections::await_first_starts(starts, config.start_timeout).await;
        // Bound and swapped in under the reload lock, which a connection becoming ready
        // takes to judge its mappings: each mapping is judged either here or there.
        let _one = host.reload.lock().await;
        let catalog = host.bind_all(prepared, &mut refused).await;
        if total > 0 && catalog.mappings.is_empty() {
            bail!("no mapping could be loaded:\n  {}", refused.join("\n  "));
        }
        host.catalog.store(Arc::new(catalog));
        drop(_one);
        Ok(host)
    }

    /// Verifies, compiles and links every mapping before any upstream process starts: a
    /// refused component never causes upstream traffic. A mapping that fails (or reuses
    /// an earlier mapping's name) is refused alone. Returns the prepared mappings and
    /// the reasons of the refused ones.
    fn prepare_all(&self, sources: Vec<MappingSource>) -> (Vec<Prepared>, Vec<String>) {
        let mut refused: Vec<String> = Vec::new();
        let mut names = BTreeSet::new();
        let mut prepared = Vec::new();
        let contracts = super::contracts::ContractSet::judge(&self.config, Some(self.registry.store()))
            .unwrap_or_else(|e| {
                tracing::error!(error = %format!("{e:#}"), "reading contract reviews failed; serving the built-in contracts only");
                super::contracts::ContractSet::built_in()
            });
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
                refused.push(self.refuse_mapping(&name, path.as_deref(), &e));
                continue;
            }
            match super::loading::prepare(&self.runtime, &self.config, &contracts, source) {
                Ok(p) => prepared.push(p),
                Err(e) => refused.push(self.refuse_mapping(&name, path.as_deref(), &e)),
            }
        }
        (prepared, refused)
    }

    /// Starts every connection a prepared mapping uses, in parallel, each within
    /// `start_timeout` and with the largest message budget of its mappings; one that
    /// fails is disconnected (retried in the background). Returns the handles of the
    /// first starts.
    async fn start_connections(
        self: &Arc<Self>,
        prepared: &[Prepared],
    ) -> Vec<tokio::task::JoinHandle<()>> {
        let mut budgets: BTreeMap<String, u64> = BTreeMap::new();
        for p in prepared {
            let m = &p.source.manifest;
            let b = budgets.entry(m.mapping.connection.clone()).or_default();
            *b = (*b).max(m.limits.max_output_bytes);
        }
        let mut starts = Vec::new();
        for (name, budget) in budgets {
            match self.open_connection(&name, budget, false).await {
                Ok((state, first)) => {
                    self.connections.lock().await.insert(name, state);
                    starts.extend(first);
                }
                Err(e) => {
                    tracing::error!(connection = %name, "connection cannot be started: {e:#}");
                }
            }
        }
        starts
    }

    /// Binds every prepared mapping into a fresh catalog (the caller holds the reload
    /// lock); one that cannot be bound, or offers a capability name another already
    /// offers, is refused alone (its reason pushed onto `refused`).
    async fn bind_all(
        self: &Arc<Self>,
        prepared: Vec<Prepared>,
        refused: &mut Vec<String>,
    ) -> Catalog {
        let mut catalog = Catalog::default();
        for p in prepared {
            let name = p.source.manifest.mapping.name.clone();
            let path = p.source.path.clone();
            let bound = match self.bind(p, false).await {
                Ok(Bound::Loaded(m, caps)) => catalog.with((m, caps)),
                Ok(Bound::Staged(..)) => Err(anyhow::anyhow!("nothing is staged at start")),
                Err(e) => Err(e),
            };
            match bound {
                Ok(next) => catalog = next,
                Err(e) => refused.push(self.refuse_mapping(&name, path.as_deref(), &e)),
            }
        }
        catalog
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

    /// A receiver that sees every [`Live::notify_changed`].
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// How many receivers of [`Live::changes`] are alive (each front session's watcher
    /// holds one while its session lives).
    pub fn listeners(&self) -> usize {
        self.changes.receiver_count()
    }

    /// The serve configuration.
    pub fn config(&self) -> &ServeConfig {
        &self.config
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use airlock_fixture_notes::ServeOptions;

    use super::*;
    use crate::registry::testkit::{self, Notes};

    /// The start does not wait for a straggler: with one connection ready and another
    /// that never answers (its `start_timeout` ten minutes), the host serves with the
    /// straggler still `connecting`, its mapping loaded and not offered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_host_serves_without_waiting_for_a_straggler() {
        let notes = Notes::serve(ServeOptions::default()).await;
        // Accepts connections and never answers.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let silent_url = format!("http://{}/mcp", silent.local_addr().unwrap());
        let held = tokio::spawn(async move {
            let mut open = Vec::new();
            while let Ok((stream, _)) = silent.accept().await {
                open.push(stream);
            }
        });
        let state = tempfile::tempdir().unwrap();
        let more = format!(
            "start_timeout = \"10m\"\n[[connection]]\nname = \"silent\"\nurl = {silent_url:?}\n"
        );
        let config = testkit::config(&notes.url, state.path(), &more);
        let straggling = testkit::source_library(|t| {
            t.replace("name = \"source-library\"", "name = \"straggling\"")
                .replace("connection = \"notes\"", "connection = \"silent\"")
                .replace("name = \"search_sources\"", "name = \"search_silent\"")
                .replace("name = \"retrieve_source\"", "name = \"retrieve_silent\"")
        });
        let live = tokio::time::timeout(
            Duration::from_secs(300),
            Live::start_with(&config, vec![testkit::source_library(|t| t), straggling]),
        )
        .await
        .expect("the start waited for the straggler")
        .unwrap();
        let connections = live.connections().await;
        assert_eq!(
            *connections["silent"].status(),
            ConnectionStatus::Connecting
        );
        assert_eq!(*connections["notes"].status(), ConnectionStatus::Ready);
        let catalog = live.catalog();
        assert_eq!(catalog.mappings.len(), 2, "both loaded");
        assert!(
            catalog.mappings["straggling"]
                .connection
                .snapshot_digest()
                .is_empty()
        );
        live.shutdown(Duration::from_secs(5)).await;
        held.abort();
    }

    /// A host with no mapping at all starts (and offers nothing); the host refuses to
    /// start only when there were mappings and every one was refused.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_mapping_is_not_every_mapping_refused() {
        let notes = Notes::serve(ServeOptions::default()).await;
        let (live, _state) = testkit::start(&notes, "", vec![]).await;
        assert!(live.catalog().mappings.is_empty());
        assert!(
            live.connections().await.is_empty(),
            "no mapping uses a connection"
        );
        let state = tempfile::tempdir().unwrap();
        let config = testkit::config(&notes.url, state.path(), "");
        let unknown = testkit::source_library(|t| {
            t.replace("connection = \"notes\"", "connection = \"unknown\"")
        });
        let Err(e) = Live::start_with(&config, vec![unknown]).await else {
            panic!("every mapping refused: the host must not start")
        };
        assert!(
            e.to_string().starts_with("no mapping could be loaded"),
            "{e}"
        );
    }
}
