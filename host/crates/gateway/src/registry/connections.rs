//! Connection supervision: each configured upstream connection's lifecycle, its latest
//! snapshot, and whether it may serve.
//!
//! Rule: **only a `ready` connection serves, and a connection is ready only once it was
//! started, initialized, snapshotted and every mapping bound to it judged against its
//! pins.** The lifecycle ([`ConnectionStatus`]):
//!
//! | from | to | when |
//! |---|---|---|
//! | — | `connecting` | first use (at start, or a mapping loaded while serving) |
//! | `connecting`, `disconnected` | `ready` | started within `start_timeout`, discovered, snapshot recorded, mappings judged |
//! | `connecting`, `ready` | `disconnected` | it failed to start (or in time), or its server exited: restarted in the background, waiting 0.5 s, doubling up to 30 s ([`MIN_RESTART_INTERVAL`]) |
//! | `ready` | `degraded` | its server broke the protocol: refused, not restarted by itself |
//! | `ready` | `stalled` | its server left [`STALL_AFTER`](crate::upstream::STALL_AFTER) requests in a row unanswered until their callers stopped waiting (their deadlines): refused, and probed with `ping` every [`STALL_PROBE_INTERVAL`] |
//! | `stalled` | `ready` | it answered (a probe, or a request still in flight) |
//! | any | `stopped` | the host is shutting down |
//!
//! Every transition is traced (`connection-state`) and logged. A connection whose server
//! announced a change (`list_changed`, counted at the transport) or whose last
//! re-discovery failed is stale: the next call re-discovers first (see
//! [`crate::pipeline::recheck`]); in the background it is re-discovered on each
//! announcement (at most once per [`MIN_REDISCOVERY_INTERVAL`]) and every
//! `snapshot_interval`. A re-discovery that fails makes it unhealthy until one succeeds.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use arc_swap::ArcSwap;
use serde_json::{Value, json};

use super::live::Live;
use crate::registry::drift::Catalogue;
use crate::registry::{Registry, Verdict};
use crate::store::ConnectionRevision;
use crate::upstream::Connection;

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
    pub(super) snapshot: Arc<ArcSwap<String>>,
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
    /// Its server stopped answering (module table): refused, probed until it answers.
    Stalled(String),
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
            Self::Stalled(_) => "stalled",
            Self::Stopped => "stopped",
        }
    }

    /// Why it is not ready (the host's words), if it says.
    pub fn reason(&self) -> Option<&str> {
        match self {
            Self::Disconnected(why) | Self::Degraded(why) | Self::Stalled(why) => Some(why),
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

impl ConnectionState {
    /// A connection `name` of `revision` that is starting: `connecting`, its client an
    /// [unstarted](Connection::unstarted) one with a message budget of `budget` bytes (so
    /// it is refused as not open until its first start installs a real one), an empty
    /// catalogue and snapshot digest, no `list_changed` covered, and not stale.
    pub fn new(name: &str, revision: ConnectionRevision, budget: u64) -> Self {
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
        Self {
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
        }
    }

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

    /// False after a re-discovery failed, until one succeeds, and while its server is
    /// stalled.
    pub fn is_healthy(&self) -> bool {
        let conn = self.connection();
        self.healthy.load(Ordering::Acquire) && conn.is_open() && !conn.is_stalled()
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

/// How often a stalled connection is probed with `ping`.
pub const STALL_PROBE_INTERVAL: Duration = Duration::from_secs(1);

/// How long a probe waits for its answer.
const STALL_PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Takes a stalled connection out of service and probes it until it answers. Returns
/// whether its watcher goes on: `true` once it answered (in service again) or its server
/// exited (the watcher then restarts it); `false` when it was replaced or the host is
/// closing or gone.
async fn probe_stalled(
    host: &std::sync::Weak<Live>,
    state: &std::sync::Weak<ConnectionState>,
    conn: &Arc<Connection>,
) -> bool {
    {
        let (Some(h), Some(s)) = (host.upgrade(), state.upgrade()) else {
            return false;
        };
        h.connection_stalled(&s);
    }
    loop {
        if conn.has_exited() {
            return true;
        }
        if !conn.is_stalled() || conn.ping(STALL_PROBE_TIMEOUT).await.is_ok() {
            let (Some(h), Some(s)) = (host.upgrade(), state.upgrade()) else {
                return false;
            };
            if !Arc::ptr_eq(conn, &s.connection()) {
                return false;
            }
            h.connection_answered(&s);
            return true;
        }
        tokio::time::sleep(STALL_PROBE_INTERVAL).await;
        let (Some(h), Some(s)) = (host.upgrade(), state.upgrade()) else {
            return false;
        };
        if h.is_closing() || !Arc::ptr_eq(conn, &s.connection()) {
            return false;
        }
    }
}

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

/// Waits for the first starts of the connections (`starts`): until every one succeeded
/// or failed, except that a straggler is not waited for — once the first is done, at
/// most [`START_WAIT_FACTOR`] times as long as that one took and at least
/// [`START_WAIT_MIN`], never beyond `start_timeout` from now. A connection still starting
/// then keeps starting in the background; its capabilities appear (with `list_changed`)
/// once it is ready and its mappings judged.
pub(super) async fn await_first_starts(
    starts: Vec<tokio::task::JoinHandle<()>>,
    start_timeout: Duration,
) {
    let begun = tokio::time::Instant::now();
    let limit = begun + start_timeout;
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
}

/// Shortest time between two background re-discoveries of one connection.
pub const MIN_REDISCOVERY_INTERVAL: Duration = Duration::from_secs(1);

/// How long discovery may wait for each list page.
pub const DISCOVERY_TIMEOUT: Duration = Duration::from_secs(30);

impl Live {
    /// The connection `name`; identified and started (in the background) on first use.
    pub(super) async fn connection(
        self: &Arc<Self>,
        name: &str,
        budget: u64,
    ) -> Result<Arc<ConnectionState>> {
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
    pub(super) async fn open_connection(
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
        let state = Arc::new(ConnectionState::new(name, revision, budget));
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
            // Heard from before the server starts: a start that fails traces them too.
            let (report, refusals) = crate::upstream::confine::proxy::Reporter::new();
            self.trace_egress_refusals(state, refusals);
            let connection =
                Connection::start_reporting(name, server, budget, limit, Some(report)).await?;
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

    /// Traces what the egress proxy of `state`'s server refused (`upstream-egress-refused`:
    /// connection id, host, port, reason, and how many it has refused so far) and logs
    /// each at WARN, until that server's proxy stops. The proxy reports each destination
    /// once per start, at most [`MAX_REPORTED`](crate::upstream::confine::proxy::MAX_REPORTED)
    /// of them ([`Reporter`](crate::upstream::confine::proxy::Reporter)): a server that
    /// tries destination after destination cannot grow the trace without bound.
    fn trace_egress_refusals(
        &self,
        state: &ConnectionState,
        mut refusals: tokio::sync::mpsc::Receiver<crate::upstream::confine::proxy::Refused>,
    ) {
        let (registry, name, id) = (
            self.registry.clone(),
            state.name.clone(),
            state.revision.connection_id.clone(),
        );
        tokio::spawn(async move {
            while let Some(r) = refusals.recv().await {
                tracing::warn!(connection = %name, host = %airlock_core::text::safe(&r.host, 256), port = r.port, "the upstream server's egress was refused: {}", airlock_core::text::safe(&r.reason, 512));
                registry.trace(
                    crate::registry::events::UPSTREAM_EGRESS_REFUSED,
                    &name,
                    json!({
                        "connection_id": id,
                        "host": r.host,
                        "port": r.port,
                        "reason": r.reason,
                        "count": r.count,
                    }),
                );
            }
        });
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

    /// A stalled connection (module table) out of service until it answers again.
    fn connection_stalled(&self, state: &ConnectionState) {
        let conn = state.connection();
        let why = format!(
            "its server left {} requests in a row unanswered until their callers stopped waiting",
            conn.unanswered_in_a_row()
        );
        let was_ready = *state.status() == ConnectionStatus::Ready;
        self.set_status(state, ConnectionStatus::Stalled(why));
        if was_ready {
            self.notify_changed();
        }
    }

    /// A stalled connection answered: in service again.
    fn connection_answered(&self, state: &ConnectionState) {
        if matches!(*state.status(), ConnectionStatus::Stalled(_)) {
            self.set_status(state, ConnectionStatus::Ready);
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
                    Stalled,
                }
                let woke = if conn.has_exited() {
                    Woke::Gone
                } else {
                    tokio::select! {
                        () = conn.list_changed_after(seen) => Woke::Changed(false),
                        () = periodic => Woke::Changed(true),
                        () = conn.until_gone() => Woke::Gone,
                        () = conn.until_degraded() => Woke::Degraded,
                        () = conn.until_stalled() => Woke::Stalled,
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
                    Woke::Stalled => {
                        drop((h, s));
                        if !probe_stalled(&host, &state, &conn).await {
                            return;
                        }
                        continue;
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
                    Ok(Some(new)) => mapping.set_record(new),
                    Ok(None) => {
                        // Changed elsewhere meanwhile; refuse locally all the same.
                        let mut local = (*record).clone();
                        local.state = crate::store::MappingState::ReviewRequired;
                        local.reason = reason.clone();
                        mapping.set_record(local);
                    }
                    Err(e) => {
                        tracing::error!(mapping = %mapping.name, "could not record review-required: {e:#}");
                        let mut local = (*record).clone();
                        local.state = crate::store::MappingState::ReviewRequired;
                        local.reason = reason.clone();
                        mapping.set_record(local);
                    }
                }
                changed = true;
            }
        }
        if changed {
            self.notify_changed();
        }
    }

    /// Stops every connection: each server and its process group gets `SIGTERM`, then
    /// `SIGKILL` after `grace` (all connections at once). Marks the host as stopping.
    pub async fn shutdown(&self, grace: Duration) {
        self.calls.begin_shutdown();
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
}

#[cfg(test)]
mod tests {
    use airlock_fixture_notes::ServeOptions;

    use super::*;
    use crate::registry::events;
    use crate::registry::testkit::{self, Notes};

    fn revision() -> ConnectionRevision {
        ConnectionRevision {
            connection_id: "conn-000000000001".into(),
            name: "notes".into(),
            revision: 1,
            config_digest: "d".repeat(64),
            created: true,
        }
    }

    /// The traced names, and the reason shown beside a state that is not ready.
    #[test]
    fn a_status_says_its_name_and_why_it_does_not_serve() {
        let all = [
            (ConnectionStatus::Connecting, "connecting"),
            (ConnectionStatus::Ready, "ready"),
            (
                ConnectionStatus::Disconnected("gone".into()),
                "disconnected (gone)",
            ),
            (
                ConnectionStatus::Degraded("bad frame".into()),
                "degraded (bad frame)",
            ),
            (ConnectionStatus::Stopped, "stopped"),
        ];
        for (status, shown) in all {
            assert_eq!(status.to_string(), shown);
            assert!(shown.starts_with(status.as_str()));
            assert_eq!(status.reason().is_some(), shown.contains('('));
        }
    }

    /// A connection being started is `connecting` with nothing discovered, refused (its
    /// client is not open) but not stale (the first start discovers anyway), and carries
    /// its mappings' message budget.
    #[test]
    fn a_starting_connection_is_refused_but_not_stale() {
        let state = ConnectionState::new("notes", revision(), 4096);
        assert_eq!(*state.status(), ConnectionStatus::Connecting);
        assert!(state.snapshot_digest().is_empty());
        assert!(state.catalogue().tools.is_empty());
        assert_eq!(state.catalogue().connection_id, "conn-000000000001");
        assert!(!state.is_healthy(), "not open until its first start");
        assert!(!state.is_stale());
        assert!(
            state.connection().has_exited(),
            "the watcher would start it"
        );
        assert_eq!(state.connection().message_budget(), 4096);
        assert!(Arc::ptr_eq(
            &state.connection(),
            &state.connection_cell().load_full()
        ));
    }

    /// The host does not wait for a straggler: once one start is done, at most
    /// `START_WAIT_FACTOR` times its time and at least `START_WAIT_MIN`, even with a
    /// long `start_timeout`; with none done, `start_timeout` bounds the wait.
    #[tokio::test]
    async fn the_start_does_not_wait_for_a_straggler() {
        let never = || tokio::spawn(std::future::pending::<()>());
        let quick = tokio::spawn(async {});
        let waited = tokio::time::timeout(
            Duration::from_secs(600),
            await_first_starts(vec![quick, never()], Duration::from_secs(3600)),
        )
        .await;
        assert!(
            waited.is_ok(),
            "the straggler held the start for ten minutes"
        );
        let none = tokio::time::timeout(
            Duration::from_secs(600),
            await_first_starts(vec![never()], Duration::from_millis(10)),
        )
        .await;
        assert!(none.is_ok(), "start_timeout bounds the wait");
        await_first_starts(vec![], Duration::from_secs(3600)).await;
    }

    /// Connecting → ready only once started, snapshotted (recorded in the store) and its
    /// mappings judged; every transition traced. A re-discovery happens when stale or
    /// forced; shutdown stops the connection (refused, `stopped`, never restarted).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_serves_once_started_snapshotted_and_judged() {
        let notes = Notes::serve(ServeOptions::default()).await;
        let (live, _state) = testkit::start(&notes, "", vec![testkit::source_library(|t| t)]).await;
        let state = live.connections().await["notes"].clone();
        testkit::until("the connection is ready", || {
            *state.status() == ConnectionStatus::Ready
        })
        .await;
        assert!(state.is_healthy());
        assert!(!state.is_stale());
        let digest = state.snapshot_digest();
        let stored = live.registry().store().snapshot(&digest).unwrap().unwrap();
        assert_eq!(stored.connection_id, state.revision.connection_id);
        assert!(state.catalogue().tool("read_note").is_some());
        let mapping = &live.catalog().mappings["source-library"];
        assert!(Arc::ptr_eq(&mapping.connection, &state));
        assert_eq!(
            *mapping.grant.snapshot.load_full(),
            *digest,
            "the grant sees the snapshot"
        );

        let states: Vec<_> = live
            .registry()
            .store()
            .trace(0, 100_000)
            .unwrap()
            .into_iter()
            .filter(|e| e.kind == events::CONNECTION_STATE)
            .map(|e| (e.payload["from"].clone(), e.payload["to"].clone()))
            .collect();
        assert_eq!(
            states,
            [
                (Value::Null, json!("connecting")),
                (json!("connecting"), json!("ready"))
            ]
        );

        let sent = state.connection().requests_sent();
        live.refresh(&state, false).await.unwrap();
        assert_eq!(
            state.connection().requests_sent(),
            sent,
            "not stale: nothing sent"
        );
        live.refresh(&state, true).await.unwrap();
        assert!(
            state.connection().requests_sent() > sent,
            "forced: re-discovered"
        );
        assert_eq!(
            state.snapshot_digest(),
            digest,
            "the same catalogue, the same snapshot"
        );

        live.shutdown(Duration::from_secs(5)).await;
        assert_eq!(*state.status(), ConnectionStatus::Stopped);
        assert!(!state.is_healthy());
        assert!(live.is_closing());
        let e = live.restart_connection(&state).await.unwrap_err();
        assert_eq!(e.to_string(), "the host is shutting down");
    }

    /// A host over the notes fixture (served with `options`) with `source-library`
    /// approved and serving, and its connection.
    async fn serving(notes: &Notes) -> (Arc<Live>, tempfile::TempDir, Arc<ConnectionState>) {
        let (live, state_dir) =
            testkit::start(notes, "", vec![testkit::source_library(|t| t)]).await;
        let state = live.connections().await["notes"].clone();
        testkit::until("the connection is ready", || {
            *state.status() == ConnectionStatus::Ready
        })
        .await;
        testkit::approve(&live, "source-library");
        live.sync_with_store().await.unwrap();
        assert!(live.catalog().mappings["source-library"].serves());
        (live, state_dir, state)
    }

    /// Calls `read_note` on the connection directly (the fixture drifts after it).
    async fn read_a_note(state: &ConnectionState) {
        let mut args = rmcp::model::JsonObject::new();
        args.insert("id".into(), json!("wal-checkpoints"));
        state
            .connection()
            .call_tool("read_note", args, Duration::from_secs(60), None, None)
            .await
            .map_err(|(e, _)| e)
            .unwrap();
    }

    /// A server that announces a change makes its connection stale; the re-discovery
    /// judges every serving mapping against its pins before the connection counts as
    /// current again: a broken pin moves the mapping to `review-required`, and the
    /// clients are told.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_drifted_server_sends_its_mappings_to_review_before_it_is_current() {
        let notes = Notes::serve(ServeOptions {
            drift_on_call: Some(airlock_fixture_notes::DriftKind::Schema),
            // With sessions (2025-11-25), so the server that drifts is the one asked next.
            legacy_only: true,
            ..ServeOptions::default()
        })
        .await;
        let (live, _state_dir, state) = serving(&notes).await;
        let mut changes = live.changes();
        changes.borrow_and_update();
        let before = state.snapshot_digest();
        read_a_note(&state).await;
        // The watcher may re-discover first; either way the change is then covered.
        testkit::until("the announced change is seen", || {
            state.is_stale() || *state.snapshot_digest() != *before
        })
        .await;
        live.refresh(&state, false).await.unwrap();
        assert!(!state.is_stale());
        assert!(state.is_healthy());
        assert_ne!(*state.snapshot_digest(), *before, "a new snapshot");
        let mapping = live.catalog().mappings["source-library"].clone();
        let record = mapping.record();
        assert_eq!(record.state, crate::store::MappingState::ReviewRequired);
        assert!(!mapping.serves());
        assert_eq!(live.catalog().offered().count(), 0);
        assert!(changes.has_changed().unwrap(), "the fronts are told");
        live.shutdown(Duration::from_secs(5)).await;
    }

    /// A re-discovery that fails leaves the connection unhealthy (calls refused) and
    /// stale, traced as `snapshot-failed`; the mappings keep their records.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_re_discovery_refuses_until_one_succeeds() {
        let notes = Notes::serve(ServeOptions {
            drift_on_call: Some(airlock_fixture_notes::DriftKind::Unlistable),
            // With sessions (2025-11-25), so the server that drifts is the one asked next.
            legacy_only: true,
            ..ServeOptions::default()
        })
        .await;
        let (live, _state_dir, state) = serving(&notes).await;
        read_a_note(&state).await;
        testkit::until("the announced change is seen", || state.is_stale()).await;
        assert!(live.refresh(&state, true).await.is_err());
        assert!(!state.is_healthy());
        assert!(state.is_stale(), "the next call re-discovers first");
        assert_eq!(*state.status(), ConnectionStatus::Ready, "still connected");
        let kinds = testkit::trace_kinds(&live);
        assert!(
            kinds.contains(&(events::SNAPSHOT_FAILED.to_string(), "notes".to_string())),
            "{kinds:?}"
        );
        assert!(live.catalog().mappings["source-library"].serves());
        assert!(live.call_started().is_some(), "the host is not stopping");
        live.shutdown(Duration::from_secs(5)).await;
        assert!(live.call_started().is_none(), "stopping: no call starts");
    }

    /// A connection that cannot start leaves the host serving: `disconnected` with its
    /// reason, its mapping loaded but not offered; once its server is there, the
    /// background restart brings it to `ready` (traced as restarted).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_that_cannot_start_is_retried_until_it_serves() {
        let port = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            probe.local_addr().unwrap().port()
        };
        let url = format!("http://127.0.0.1:{port}/mcp");
        let dir = tempfile::tempdir().unwrap();
        let config = testkit::config(&url, dir.path(), "start_timeout = \"2s\"");
        let live = Live::start_with(&config, vec![testkit::source_library(|t| t)])
            .await
            .unwrap();
        let state = live.connections().await["notes"].clone();
        testkit::until("the failed start is recorded", || {
            matches!(*state.status(), ConnectionStatus::Disconnected(_))
        })
        .await;
        assert!(!state.is_healthy());
        assert!(live.catalog().mappings.contains_key("source-library"));
        assert_eq!(live.catalog().offered().count(), 0);
        let why = state.status().reason().unwrap().to_string();
        assert!(!why.is_empty());

        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .unwrap();
        let server = tokio::spawn(airlock_fixture_notes::serve_http_on(
            ServeOptions::default(),
            listener,
        ));
        // The backoff waits up to MAX_RESTART_BACKOFF between tries: two of them at most.
        testkit::until_within(
            "the restarted connection is ready",
            MAX_RESTART_BACKOFF * 4,
            || *state.status() == ConnectionStatus::Ready,
        )
        .await;
        assert!(state.is_healthy());
        assert!(!state.snapshot_digest().is_empty());
        // Traced once the restarted connection is installed, just after it turns ready.
        let restarted = (
            events::CONNECTION_RESTARTED.to_string(),
            "notes".to_string(),
        );
        testkit::until("the restart is traced", || {
            testkit::trace_kinds(&live).contains(&restarted)
        })
        .await;
        live.shutdown(Duration::from_secs(5)).await;
        server.abort();
    }
}
