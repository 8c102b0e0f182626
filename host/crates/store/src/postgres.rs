//! The shared state store on PostgreSQL, for several hosts on one database
//! (`store = "postgres://…"` in the serve configuration).
//!
//! Rules this module enforces, the same as [`SqliteStore`](super::SqliteStore)'s:
//! - **One trace chain across hosts.** Every write transaction first takes one
//!   transaction-level advisory lock ([`WRITE_LOCK`], `pg_advisory_xact_lock`), so writers
//!   on every host are serialized exactly as SQLite's `BEGIN IMMEDIATE` serializes them in
//!   one file: an append reads the head and writes `head + 1` with no other writer in
//!   between, and `seq` is the primary key besides. Each event is MACed with the host key
//!   over its exact stored bytes (`payload` is `TEXT`, never `jsonb`, which would re-order
//!   and re-space it); every host must hold the same key (`[trace] key` or
//!   `AIRLOCK_TRACE_KEY`), and an append refuses a head MACed with another.
//! - **The trace is append-only**: triggers refuse `UPDATE`, `DELETE` and `TRUNCATE`.
//! - **A receipt is consumed once**: its row is locked (`SELECT … FOR UPDATE`), then
//!   consumed by a conditional `UPDATE … WHERE state = 'approved' RETURNING`, in the
//!   transaction that inserts the intent under a UNIQUE `approval_id`; of any number of
//!   concurrent consumers on any number of hosts exactly one wins.
//! - **A database this build cannot trust is refused and never modified**: one holding
//!   tables but no `airlock_schema` table, or a schema version above
//!   [`PG_SCHEMA_VERSION`].
//!
//! Migrations: `airlock_schema` holds one row, the schema version; [`PG_MIGRATIONS`]`[i]`
//! takes version `i` to `i + 1`, each applied at open in its own transaction under the
//! write lock (so two hosts starting at once migrate once). PostgreSQL's numbering starts
//! at the SQLite schema 7 layout (no PostgreSQL store predates the keyed trace).
//!
//! Accepted targets ([`is_postgres_target`]): a URL `postgres://…` or `postgresql://…`,
//! or libpq key/value text (`host=/run/postgresql dbname=airlock`); a `host` that starts
//! with `/` is a Unix-socket folder. No TLS: this build connects with `NoTls`, so use a
//! Unix socket or a loopback address; `sslmode=require` is refused.
//!
//! Sync over async: the [`Store`](crate::Store) trait is synchronous and is called from tokio tasks.
//! The connections' I/O runs on one dedicated thread owning a current-thread runtime;
//! a store method waits on the client's futures with `futures_executor::block_on`, which
//! (unlike tokio's `block_on`) works on any thread, inside a runtime or not, because a
//! `tokio_postgres::Client` only talks to its connection task over channels. A call
//! blocks its caller's thread for the round trips, as a SQLite call blocks it for the
//! file I/O. Times are unix milliseconds; integers are `BIGINT`.
//!
//! Changes reach other hosts by `LISTEN/NOTIFY`: a write that changes what serving hosts
//! re-read (mapping revisions and states, approval decisions) calls `pg_notify` on
//! [`CHANGES_CHANNEL`] in its transaction (delivered at commit, never for a rollback), and
//! each store listens on a connection of its own ([`Hosts::changes`]).
//!
//! Differences from SQLite: appends are not group-committed (each call is its own
//! transaction); PostgreSQL `TEXT` cannot hold a NUL character, so a subject, kind or
//! other field containing one is refused with the server's error.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail};
use futures_executor::block_on;
use tokio_postgres::config::{Host, SslMode};
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Config, GenericClient, NoTls, Row, Statement, Transaction};

use super::CONTRACT_COLUMNS;
use super::approvals::{
    APPROVAL_COLUMNS, ApprovalDecision, ApprovalRecord, ApprovalState, ConsumeAs, Consumption,
    DecisionEffect, INTENT_COLUMNS, IntentHandle, IntentRecord, IntentState, NewApproval,
    NewIntent, ReceiptBinding, ReceiptRefusal, Waiting, random_id,
};
use super::archive;
use super::contracts::{self, ContractRecord, ContractReviews, NewContractApproval};
use super::intents::{ATTEMPT_COLUMNS, AttemptRecord, AttemptState, IntentFilter, Resolution};
use super::key::{self, Checkpoint, TraceKey};
use super::plans;
use super::rows;
use super::shared;
use super::trace::{self, NewEvent};
use super::{
    Approvals, CONNECTION_SELECT, ChainCheck, ConnectionRecord, ConnectionRevision, Connections,
    GENESIS_HASH, Hosts, Intents, MAPPING_COLUMNS, MIN_PREFIX, MappingRecord, MappingState,
    Mappings, NewMappingRevision, NewObservation, SNAPSHOT_SUMMARY_SELECT, SnapshotObservation,
    SnapshotSummary, Snapshots, StoredEvent, StoredSnapshot, TRACE_COLUMNS, TRACE_KEYED, Trace,
    TraceEvent, TraceVerification, canonical, is_hex, ms_to_sql, new_connection_id, now_ms,
    with_revision,
};

/// Schema version this build writes and understands in a PostgreSQL store.
pub const PG_SCHEMA_VERSION: i64 = 7;

/// The advisory lock every write transaction takes first (`pg_advisory_xact_lock`):
/// "Airlock1" in ASCII.
pub const WRITE_LOCK: i64 = 0x4169_726c_6f63_6b31;

/// The `LISTEN/NOTIFY` channel on which a write that changes what serving hosts re-read
/// (a mapping revision or state, an approval decision) tells every host, at commit.
pub const CHANGES_CHANNEL: &str = "airlock_changes";

/// How long the change listener waits before connecting again after losing its
/// connection.
const LISTEN_RETRY: Duration = Duration::from_secs(1);

/// Connections one store keeps open at most; a caller waits for a free one beyond that.
const MAX_CONNECTIONS: usize = 8;

/// How long connecting may take when the target names no `connect_timeout`.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a caller waits for a free connection before failing.
const POOL_WAIT: Duration = Duration::from_secs(30);

/// Rows read per page while verifying the trace.
const VERIFY_PAGE: i64 = 5000;

/// Migration `i` takes the schema from version `i` to version `i + 1`.
pub const PG_MIGRATIONS: &[&str] = &[
    // 0 → 1: the whole store as SQLite schema 7 has it.
    r#"
CREATE TABLE airlock_schema (version BIGINT NOT NULL);
INSERT INTO airlock_schema (version) VALUES (0);

CREATE FUNCTION airlock_refuse() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    RAISE EXCEPTION '%', TG_ARGV[0];
END
$fn$;

CREATE TABLE connections (
    connection_id TEXT PRIMARY KEY,
    name          TEXT NOT NULL UNIQUE,
    first_seen_ms BIGINT NOT NULL
);

CREATE TABLE connection_revisions (
    connection_id TEXT NOT NULL REFERENCES connections (connection_id),
    revision      BIGINT NOT NULL CHECK (revision >= 1),
    config_digest TEXT NOT NULL,
    config        TEXT NOT NULL,
    created_ms    BIGINT NOT NULL,
    PRIMARY KEY (connection_id, revision),
    UNIQUE (connection_id, config_digest)
);

CREATE TABLE snapshots (
    digest          TEXT PRIMARY KEY,
    connection_id   TEXT NOT NULL,
    config_revision BIGINT NOT NULL,
    body            TEXT NOT NULL,
    first_seen_ms   BIGINT NOT NULL,
    FOREIGN KEY (connection_id, config_revision)
        REFERENCES connection_revisions (connection_id, revision)
);
CREATE INDEX snapshots_by_connection ON snapshots (connection_id);
CREATE TRIGGER snapshots_are_immutable BEFORE UPDATE ON snapshots
    FOR EACH ROW EXECUTE FUNCTION airlock_refuse('snapshots are immutable');

CREATE TABLE snapshot_observations (
    id             BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    digest         TEXT NOT NULL REFERENCES snapshots (digest),
    observed_at_ms BIGINT NOT NULL
);
CREATE INDEX snapshot_observations_by_digest ON snapshot_observations (digest);

CREATE TABLE mappings (
    name             TEXT NOT NULL,
    revision         BIGINT NOT NULL CHECK (revision >= 1),
    manifest_digest  TEXT NOT NULL,
    component_sha256 TEXT NOT NULL,
    connection_id    TEXT NOT NULL,
    config_revision  BIGINT NOT NULL,
    snapshot_digest  TEXT,
    pins             TEXT NOT NULL,
    state            TEXT NOT NULL CHECK (state IN ('candidate', 'fixture-tested', 'limited',
                         'active', 'degraded', 'review-required', 'retiring', 'historical')),
    reviewer         TEXT,
    reason           TEXT NOT NULL,
    created_ms       BIGINT NOT NULL,
    state_changed_ms BIGINT NOT NULL,
    manifest_text    TEXT,
    PRIMARY KEY (name, revision)
);

CREATE TABLE trace_events (
    seq       BIGINT PRIMARY KEY,
    at_ms     BIGINT NOT NULL,
    kind      TEXT NOT NULL,
    subject   TEXT NOT NULL,
    payload   TEXT NOT NULL,
    prev_hash TEXT NOT NULL,
    hash      TEXT NOT NULL,
    key_id    TEXT
);
CREATE TRIGGER trace_events_append_only BEFORE UPDATE OR DELETE ON trace_events
    FOR EACH ROW EXECUTE FUNCTION airlock_refuse('trace events are append-only');
CREATE TRIGGER trace_events_no_truncate BEFORE TRUNCATE ON trace_events
    FOR EACH STATEMENT EXECUTE FUNCTION airlock_refuse('trace events are append-only');
CREATE INDEX trace_events_mapping_proofs ON trace_events (subject, seq)
    WHERE kind IN ('mapping-revision', 'mapping-state-changed', 'trace-keyed');
-- The events that prove an approval or an intent, found by the id their payload names
-- (Trace::approval_proofs, Trace::intent_proofs).
CREATE INDEX trace_events_approval_proofs ON trace_events (((payload::jsonb ->> 'approval')), seq)
    WHERE kind IN ('approval-requested', 'approval-decided', 'receipt-consumed');
CREATE INDEX trace_events_intent_proofs ON trace_events (((payload::jsonb ->> 'intent')), seq)
    WHERE kind = 'intent-created';

CREATE TABLE approvals (
    id               TEXT PRIMARY KEY,
    state            TEXT NOT NULL CHECK (state IN ('pending', 'approved', 'denied', 'revoked',
                         'consumed', 'expired')),
    mode             TEXT NOT NULL CHECK (mode IN ('elicitation', 'input-required', 'out-of-band')),
    requester        TEXT NOT NULL,
    session          TEXT NOT NULL,
    profile          TEXT NOT NULL,
    capability       TEXT NOT NULL,
    mapping          TEXT NOT NULL,
    mapping_revision BIGINT NOT NULL,
    snapshot_digest  TEXT NOT NULL,
    policy_digest    TEXT NOT NULL,
    args_digest      TEXT NOT NULL,
    artifact_digest  TEXT,
    summary          TEXT NOT NULL,
    nonce            TEXT NOT NULL,
    created_ms       BIGINT NOT NULL,
    expires_ms       BIGINT NOT NULL,
    decided_by       TEXT,
    decided_ms       BIGINT,
    reason           TEXT,
    consumed_ms      BIGINT,
    intent_id        TEXT UNIQUE
);
CREATE INDEX approvals_by_state ON approvals (state);
CREATE INDEX approvals_open_by_binding
    ON approvals (requester, session, capability, args_digest, created_ms)
    WHERE state IN ('pending', 'approved');

CREATE TABLE intents (
    id               TEXT PRIMARY KEY,
    idempotency_key  TEXT NOT NULL UNIQUE,
    call_id          TEXT NOT NULL,
    approval_id      TEXT UNIQUE REFERENCES approvals (id),
    requester        TEXT NOT NULL,
    session          TEXT NOT NULL,
    capability       TEXT NOT NULL,
    mapping          TEXT NOT NULL,
    mapping_revision BIGINT NOT NULL,
    args_digest      TEXT NOT NULL,
    effect_class     TEXT NOT NULL,
    state            TEXT NOT NULL CHECK (state IN ('prepared', 'completed', 'failed', 'unknown')),
    created_ms       BIGINT NOT NULL,
    updated_ms       BIGINT NOT NULL,
    resolution       TEXT,
    resolved_ms      BIGINT
);
CREATE INDEX intents_open ON intents (mapping, created_ms) WHERE state IN ('prepared', 'unknown');

CREATE TABLE intent_attempts (
    intent_id        TEXT NOT NULL REFERENCES intents (id),
    attempt          BIGINT NOT NULL CHECK (attempt >= 1),
    state            TEXT NOT NULL CHECK (state IN ('prepared', 'sent', 'acknowledged',
                         'result-observed', 'receipt-verified', 'committed')),
    requests         BIGINT NOT NULL DEFAULT 0,
    answered         BIGINT NOT NULL DEFAULT 0,
    last_request_id  TEXT,
    prepared_ms      BIGINT NOT NULL,
    sent_ms          BIGINT,
    acknowledged_ms  BIGINT,
    observed_ms      BIGINT,
    verified_ms      BIGINT,
    committed_ms     BIGINT,
    PRIMARY KEY (intent_id, attempt)
);

CREATE TABLE observations (
    seq              BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id               TEXT NOT NULL UNIQUE,
    connection_id    TEXT NOT NULL,
    connection       TEXT NOT NULL,
    snapshot_digest  TEXT NOT NULL,
    method           TEXT NOT NULL CHECK (method IN ('tools/call', 'resources/read')),
    target           TEXT NOT NULL,
    arguments_sha256 TEXT NOT NULL,
    item             TEXT NOT NULL,
    kind             TEXT NOT NULL,
    media_type       TEXT NOT NULL,
    sha256           TEXT NOT NULL,
    bytes            BIGINT NOT NULL CHECK (bytes >= 0),
    request_id       TEXT NOT NULL,
    call_id          TEXT NOT NULL,
    retrieved_ms     BIGINT NOT NULL,
    last_seen_ms     BIGINT NOT NULL,
    seen             BIGINT NOT NULL CHECK (seen >= 1),
    previous         TEXT REFERENCES observations (id)
);
CREATE INDEX observations_by_identity
    ON observations (connection_id, method, target, arguments_sha256, item, last_seen_ms);
CREATE TRIGGER observations_keep_provenance
    BEFORE UPDATE OF seq, id, connection_id, connection, snapshot_digest, method, target,
        arguments_sha256, item, kind, media_type, sha256, bytes, request_id, call_id,
        retrieved_ms, previous
    ON observations
    FOR EACH ROW EXECUTE FUNCTION airlock_refuse('an observation''s provenance is immutable');
CREATE TRIGGER observations_no_delete BEFORE DELETE ON observations
    FOR EACH ROW EXECUTE FUNCTION airlock_refuse('observations are not deleted');
"#,
    // 1 → 2: references shared by the hosts (crate::shared), by token digest.
    r#"
CREATE TABLE reference_bindings (
    token_sha256 TEXT PRIMARY KEY,
    scope        TEXT NOT NULL,
    kind         TEXT NOT NULL,
    mapping      TEXT NOT NULL,
    revision     BIGINT NOT NULL,
    locator      TEXT NOT NULL,
    facts        TEXT NOT NULL,
    expires_ms   BIGINT NOT NULL,
    created_ms   BIGINT NOT NULL
);
CREATE INDEX reference_bindings_by_scope ON reference_bindings (scope, expires_ms);
"#,
    // 2 → 3: the events that change an intent's state after its creation carry
    // `intent_state` (Trace::intent_proofs, Trace::intents_open_in_trace_only), found by the
    // intent their payload names; reads' outcome events stay out of the index.
    r#"
CREATE INDEX trace_events_intent_states ON trace_events (((payload::jsonb ->> 'intent')), seq)
    WHERE kind IN ('call-outcome', 'call-refused', 'intent-resolved', 'intent-held')
    AND (payload::jsonb ->> 'intent_state') IS NOT NULL;
"#,
    // 3 → 4: contract reviews (crate::contracts), as SQLite's migration 11.
    r#"
CREATE TABLE contract_reviews (
    package          TEXT PRIMARY KEY,
    digest           TEXT NOT NULL,
    state            TEXT NOT NULL CHECK (state IN ('approved', 'erroneous')),
    reviewer         TEXT NOT NULL,
    reason           TEXT NOT NULL,
    files            TEXT NOT NULL,
    created_ms       BIGINT NOT NULL,
    state_changed_ms BIGINT NOT NULL
);
CREATE TRIGGER contract_reviews_keep_digest
    BEFORE UPDATE OF package, digest, files, created_ms ON contract_reviews
    FOR EACH ROW EXECUTE FUNCTION airlock_refuse('a contract review''s digest and files are immutable');
CREATE TRIGGER contract_reviews_no_delete BEFORE DELETE ON contract_reviews
    FOR EACH ROW EXECUTE FUNCTION airlock_refuse('contract reviews are not deleted');
CREATE INDEX trace_events_contract_proofs ON trace_events (subject, seq)
    WHERE kind IN ('contract-approved', 'contract-marked-erroneous');
"#,
    // 4 → 5: compensation, as SQLite's migration 12.
    r#"
ALTER TABLE intents ADD COLUMN compensates TEXT REFERENCES intents (id);
ALTER TABLE intents ADD COLUMN handles TEXT;
CREATE UNIQUE INDEX intents_one_compensation ON intents (compensates)
    WHERE compensates IS NOT NULL AND state <> 'failed';
CREATE TRIGGER intents_keep_compensates BEFORE UPDATE OF compensates ON intents
    FOR EACH ROW WHEN (OLD.compensates IS DISTINCT FROM NEW.compensates)
    EXECUTE FUNCTION airlock_refuse('what an intent compensates never changes');
CREATE TRIGGER intents_handles_once BEFORE UPDATE OF handles ON intents
    FOR EACH ROW WHEN (OLD.handles IS NOT NULL AND NEW.handles IS DISTINCT FROM OLD.handles)
    EXECUTE FUNCTION airlock_refuse('an intent''s handles are written once');
"#,
    // 5 → 6: trace retention, as SQLite's migration 13: archived events may be deleted,
    // and only they (a trigger's WHEN cannot hold a subquery here, so a function decides).
    r#"
CREATE INDEX trace_events_archives ON trace_events (seq) WHERE kind = 'trace-archived';
CREATE FUNCTION airlock_trace_delete() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    IF OLD.seq > coalesce((SELECT (payload::jsonb ->> 'to_seq')::bigint FROM trace_events
            WHERE kind = 'trace-archived' ORDER BY seq DESC LIMIT 1), 0) THEN
        RAISE EXCEPTION 'trace events are append-only: only archived events may be deleted';
    END IF;
    RETURN OLD;
END
$fn$;
DROP TRIGGER trace_events_append_only ON trace_events;
CREATE TRIGGER trace_events_append_only BEFORE UPDATE ON trace_events
    FOR EACH ROW EXECUTE FUNCTION airlock_refuse('trace events are append-only');
CREATE TRIGGER trace_events_delete_archived_only BEFORE DELETE ON trace_events
    FOR EACH ROW EXECUTE FUNCTION airlock_trace_delete();
"#,
    // 6 → 7: a connection's newest state change without a scan, as SQLite's migration 14.
    r#"
CREATE INDEX trace_events_connection_states ON trace_events (subject, seq)
    WHERE kind = 'connection-state';
"#,
];

const _: () = assert!(PG_MIGRATIONS.len() as i64 == PG_SCHEMA_VERSION);

/// Whether a `store` setting names a PostgreSQL database: a `postgres://` or
/// `postgresql://` URL, or libpq key/value text (a `key=value` pair first).
pub fn is_postgres_target(target: &str) -> bool {
    let t = target.trim_start();
    t.starts_with("postgres://")
        || t.starts_with("postgresql://")
        || t.split_whitespace()
            .next()
            .and_then(|first| first.split_once('='))
            .is_some_and(|(k, _)| {
                !k.is_empty() && k.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
            })
}

/// The thread that runs the connections' I/O: a current-thread runtime, stopped (and
/// its connections closed) when the store is dropped.
struct IoThread {
    handle: tokio::runtime::Handle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl IoThread {
    fn start() -> anyhow::Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the PostgreSQL I/O runtime")?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("airlock-postgres".into())
            .spawn(move || {
                runtime.block_on(async {
                    let _ = stopped.await;
                });
            })
            .context("starting the PostgreSQL I/O thread")?;
        Ok(Self {
            handle,
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for IoThread {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[derive(Default)]
struct PoolState {
    idle: Vec<Conn>,
    open: usize,
}

/// One connection and the statements prepared on it (by SQL text): each statement is
/// parsed and planned once per connection, so a query costs one round trip.
struct Conn {
    client: Client,
    statements: Mutex<HashMap<String, Statement>>,
}

/// A client or transaction with its connection's prepared statements: the same calls as
/// `tokio_postgres`'s, taking SQL text.
struct Sql<'a, C> {
    c: &'a C,
    statements: &'a Mutex<HashMap<String, Statement>>,
}

impl<C: GenericClient + Sync> Sql<'_, C> {
    async fn prepare(&self, sql: &str) -> Result<Statement, tokio_postgres::Error> {
        let cached = self
            .statements
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(sql)
            .cloned();
        if let Some(statement) = cached {
            return Ok(statement);
        }
        let statement = self.c.prepare(sql).await?;
        self.statements
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(sql.to_owned(), statement.clone());
        Ok(statement)
    }

    async fn query(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, tokio_postgres::Error> {
        let statement = self.prepare(sql).await?;
        self.c.query(&statement, params).await
    }

    async fn query_opt(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, tokio_postgres::Error> {
        let statement = self.prepare(sql).await?;
        self.c.query_opt(&statement, params).await
    }

    async fn query_one(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, tokio_postgres::Error> {
        let statement = self.prepare(sql).await?;
        self.c.query_one(&statement, params).await
    }

    async fn execute(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, tokio_postgres::Error> {
        let statement = self.prepare(sql).await?;
        self.c.execute(&statement, params).await
    }
}

/// A few connections, opened on demand.
struct Pool {
    config: Config,
    shown: String,
    state: Mutex<PoolState>,
    freed: Condvar,
    // Dropped last: the clients above are dropped before their I/O thread stops.
    io: IoThread,
}

/// A connection lent by the pool; returned on drop (a closed one is discarded).
struct Lease<'p> {
    pool: &'p Pool,
    client: Option<Conn>,
}

impl Lease<'_> {
    fn conn(&mut self) -> &mut Conn {
        self.client
            .as_mut()
            .expect("a lease holds its client until dropped")
    }

    fn client(&mut self) -> &mut Client {
        &mut self.conn().client
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        let mut state = self.pool.lock();
        match self.client.take() {
            Some(c) if !c.client.is_closed() => state.idle.push(c),
            _ => state.open = state.open.saturating_sub(1),
        }
        drop(state);
        self.pool.freed.notify_one();
    }
}

impl Pool {
    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn get(&self) -> anyhow::Result<Lease<'_>> {
        let deadline = std::time::Instant::now() + POOL_WAIT;
        let mut state = self.lock();
        loop {
            while let Some(client) = state.idle.pop() {
                if client.client.is_closed() {
                    state.open = state.open.saturating_sub(1);
                    continue;
                }
                return Ok(Lease {
                    pool: self,
                    client: Some(client),
                });
            }
            if state.open < MAX_CONNECTIONS {
                state.open += 1;
                drop(state);
                return match self.connect() {
                    Ok(client) => Ok(Lease {
                        pool: self,
                        client: Some(client),
                    }),
                    Err(e) => {
                        self.lock().open -= 1;
                        self.freed.notify_one();
                        Err(e)
                    }
                };
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                bail!(
                    "the PostgreSQL store at {}: no free connection after {}s ({MAX_CONNECTIONS} in use)",
                    self.shown,
                    POOL_WAIT.as_secs()
                );
            }
            state = self
                .freed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn connect(&self) -> anyhow::Result<Conn> {
        let config = self.config.clone();
        let task = self.io.handle.spawn(async move {
            let (client, connection) = config.connect(NoTls).await?;
            tokio::spawn(async move {
                let _ = connection.await;
            });
            Ok::<_, tokio_postgres::Error>(client)
        });
        match block_on(task) {
            Ok(Ok(client)) => Ok(Conn {
                client,
                statements: Mutex::default(),
            }),
            Ok(Err(e)) => Err(anyhow!(
                "cannot reach the PostgreSQL store at {} ({}): check that the server runs and \
                 accepts this user, and the `store` setting; nothing was written",
                self.shown,
                pg_error(&e)
            )),
            Err(e) => Err(anyhow!("connecting to PostgreSQL: {e}")),
        }
    }
}

/// A PostgreSQL error in words: the server's message (and detail) when there is one.
fn pg_error(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        let mut s = db.message().to_owned();
        if let Some(detail) = db.detail() {
            s.push_str(" — ");
            s.push_str(detail);
        }
        return s;
    }
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        let text = cause.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        source = cause.source();
    }
    s
}

/// [`Store`](crate::Store) on a PostgreSQL database shared by several hosts. Open one value per
/// process and share it; it keeps up to eight connections.
pub struct PostgresStore {
    /// The connection that holds this host's liveness lock ([`Hosts::register_host`]);
    /// dropped before the pool's I/O thread stops.
    liveness: Mutex<Option<Client>>,
    pool: Pool,
    key: TraceKey,
    changes: tokio::sync::watch::Sender<u64>,
    /// This host's calls waiting to append their events (group commit, as the SQLite
    /// store does: [`super::trace`]).
    commit: super::trace::GroupCommit,
    /// Held by the one caller of this host that writes the queued batches; the others
    /// wait on it and most find their batch already committed.
    appending: Mutex<()>,
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("target", &self.pool.shown)
            .field("key_id", &self.key.id())
            .finish()
    }
}

/// `target` without its password: `user@host:port/dbname` (a socket folder as the host).
fn describe(config: &Config) -> String {
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .map(|h| match h {
            Host::Tcp(name) => name.clone(),
            Host::Unix(path) => path.display().to_string(),
        })
        .collect();
    let port = config.get_ports().first().copied().unwrap_or(5432);
    format!(
        "{}@{}:{port}/{}",
        config.get_user().unwrap_or("(default user)"),
        if hosts.is_empty() {
            "(default host)".to_owned()
        } else {
            hosts.join(",")
        },
        config
            .get_dbname()
            .or(config.get_user())
            .unwrap_or("(default database)")
    )
}

/// Parses a `store` target into a client configuration. Errors never repeat the target
/// (it may hold a password).
pub fn parse_target(target: &str) -> anyhow::Result<Config> {
    let mut config: Config = target.trim().parse().map_err(|e: tokio_postgres::Error| {
        anyhow!(
            "the `store` setting is not a PostgreSQL connection string ({}): give a URL \
             such as postgres://airlock@localhost/airlock or \
             postgresql:///airlock?host=/run/postgresql, or key/value text such as \
             `host=/run/postgresql dbname=airlock`",
            pg_error(&e)
        )
    })?;
    if config.get_ssl_mode() == SslMode::Require {
        bail!(
            "the `store` setting asks for TLS (sslmode=require), which this build does not \
             have: connect over a Unix socket (host=/run/postgresql) or a loopback address \
             with sslmode=disable or prefer"
        );
    }
    if config.get_hosts().is_empty() {
        bail!(
            "the `store` setting names no host: add one (a socket folder such as \
             host=/run/postgresql, or a name such as localhost)"
        );
    }
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(CONNECT_TIMEOUT);
    }
    if config.get_application_name().is_none() {
        config.application_name("airlock");
    }
    Ok(config)
}

impl PostgresStore {
    /// Connects to `target` (see [`is_postgres_target`]), refuses a database this build
    /// must not touch, applies pending migrations, and takes the host key: `key` when
    /// given, else [`key::KEY_ENV`], else `state_dir`'s key file (created when missing and
    /// the trace holds no MACed event yet). Every host on one database must hold the same
    /// key.
    ///
    /// # Errors
    /// A malformed target, an unreachable server or refused login (the message names the
    /// target without its password), a foreign or newer schema, no key source (no key,
    /// no environment variable and no state folder), a missing key file once the trace is
    /// keyed.
    pub fn open(
        target: &str,
        state_dir: Option<&Path>,
        key: Option<TraceKey>,
    ) -> anyhow::Result<Self> {
        let config = parse_target(target)?;
        let shown = describe(&config);
        let pool = Pool {
            config,
            shown: shown.clone(),
            state: Mutex::new(PoolState::default()),
            freed: Condvar::new(),
            io: IoThread::start()?,
        };
        let mut lease = pool.get()?;
        let key = match key {
            Some(key) => key,
            None => match TraceKey::from_env()? {
                Some(key) => key,
                None => {
                    let Some(dir) = state_dir else {
                        bail!(
                            "the PostgreSQL store at {shown} needs the trace key: set [trace] \
                             key in the configuration or {}, the same on every host; nothing \
                             was written",
                            key::KEY_ENV
                        );
                    };
                    airlock_core::private_fs::ensure_private_dir(
                        dir,
                        "state folder",
                        "or choose another --state-dir",
                    )?;
                    match TraceKey::read_file(dir)? {
                        Some(key) => key,
                        None => {
                            let keyed = block_on(keyed_trace(lease.client()))
                                .with_context(|| format!("the PostgreSQL store at {shown}"))?;
                            if let Some(id) = keyed {
                                bail!(
                                    "the trace key file {} is missing, but the trace in the \
                                     PostgreSQL store at {shown} is MACed with key {id}: give \
                                     this host the key the other hosts use ([trace] key or \
                                     {}); nothing was written",
                                    dir.join(key::KEY_FILE).display(),
                                    key::KEY_ENV
                                );
                            }
                            TraceKey::create_file(dir)?
                        }
                    }
                }
            },
        };
        block_on(migrate(lease.client(), &shown))?;
        drop(lease);
        let store = Self {
            liveness: Mutex::new(None),
            pool,
            key,
            changes: tokio::sync::watch::Sender::new(0),
            commit: super::trace::GroupCommit::default(),
            appending: Mutex::new(()),
        };
        store.listen();
        Ok(store)
    }

    /// Starts the change listener on the I/O thread (it ends with the store): one
    /// connection of its own that `LISTEN`s on [`CHANGES_CHANNEL`] and moves
    /// [`Hosts::changes`] on each notification; after a lost connection it connects
    /// again every [`LISTEN_RETRY`] and signals once (changes made meanwhile were not
    /// heard).
    fn listen(&self) {
        let config = self.pool.config.clone();
        let changes = self.changes.clone();
        let shown = self.pool.shown.clone();
        self.pool.io.handle.spawn(async move {
            loop {
                match config.connect(NoTls).await {
                    Ok((client, mut connection)) => {
                        let heard = changes.clone();
                        // Notifications arrive as messages of the connection it drives.
                        let driver = tokio::spawn(async move {
                            while let Some(message) =
                                std::future::poll_fn(|cx| connection.poll_message(cx)).await
                            {
                                match message {
                                    Ok(tokio_postgres::AsyncMessage::Notification(_)) => {
                                        heard.send_modify(|n| *n = n.wrapping_add(1));
                                    }
                                    Ok(_) => {}
                                    Err(_) => break,
                                }
                            }
                        });
                        match client
                            .batch_execute(&format!("LISTEN {CHANGES_CHANNEL}"))
                            .await
                        {
                            Ok(()) => {
                                changes.send_modify(|n| *n = n.wrapping_add(1));
                                let _ = driver.await;
                            }
                            Err(e) => {
                                tracing::warn!(
                                    "the PostgreSQL store at {shown}: LISTEN failed: {}",
                                    pg_error(&e)
                                );
                                driver.abort();
                            }
                        }
                        drop(client);
                    }
                    Err(e) => tracing::warn!(
                        "the PostgreSQL store at {shown}: listening for changes: {}",
                        pg_error(&e)
                    ),
                }
                tokio::time::sleep(LISTEN_RETRY).await;
            }
        });
    }

    /// The host key the trace is MACed with.
    pub fn key(&self) -> &TraceKey {
        &self.key
    }

    /// The target without its password (`user@host:port/dbname`).
    pub fn target(&self) -> &str {
        &self.pool.shown
    }

    fn context(&self, what: &str) -> String {
        format!("the PostgreSQL store at {}: {what}", self.pool.shown)
    }

    /// Runs `work` on a pooled connection.
    /// The events `sql` selects (its one parameter bound to `param`) that `accept` takes by
    /// kind and subject and whose MAC verifies with this store's key; the others are passed
    /// over (an unkeyed or forged event proves nothing).
    fn genuine_events(
        &self,
        what: &str,
        sql: &str,
        param: &str,
        accept: impl Fn(&str, &str) -> bool,
    ) -> anyhow::Result<Vec<TraceEvent>> {
        let key = &self.key;
        self.read(what, async |c| {
            let rows = c.query(sql, &[&param]).await.map_err(db)?;
            let mut out = Vec::new();
            for row in &rows {
                let e = rows::stored_event(row)?;
                let genuine = e.key_id.as_deref() == Some(key.id())
                    && accept(&e.kind, &e.subject)
                    && key.verify_event(
                        e.seq,
                        e.at,
                        &e.kind,
                        &e.subject,
                        &e.payload,
                        &e.prev_hash,
                        &e.hash,
                    );
                if !genuine {
                    continue;
                }
                out.push(TraceEvent {
                    seq: e.seq,
                    at_ms: u64::try_from(e.at).unwrap_or(0),
                    payload: serde_json::from_str(&e.payload)?,
                    kind: e.kind,
                    subject: e.subject,
                    prev_hash: e.prev_hash,
                    hash: e.hash,
                    key_id: e.key_id,
                });
            }
            Ok(out)
        })
    }

    fn read<T>(
        &self,
        what: &str,
        work: impl AsyncFnOnce(&Sql<'_, Client>) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let mut lease = self.pool.get()?;
        let conn = lease.conn();
        let sql = Sql {
            c: &conn.client,
            statements: &conn.statements,
        };
        block_on(work(&sql)).with_context(|| self.context(what))
    }

    /// Runs `work` in a write transaction that holds [`WRITE_LOCK`]; commits when it
    /// returns `Ok`, rolls back otherwise.
    fn write<T>(
        &self,
        what: &str,
        work: impl AsyncFnOnce(&Sql<'_, Transaction<'_>>) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let mut lease = self.pool.get()?;
        let Conn { client, statements } = lease.conn();
        block_on(async {
            let tx = client.transaction().await.map_err(db)?;
            let sql = Sql { c: &tx, statements };
            sql.execute("SELECT pg_advisory_xact_lock($1)", &[&WRITE_LOCK])
                .await
                .map_err(db)?;
            let out = work(&sql).await?;
            tx.commit().await.map_err(db)?;
            Ok::<_, anyhow::Error>(out)
        })
        .with_context(|| self.context(what))
    }

    /// [`Self::write`] that appends `events` after `work`, in the same transaction.
    fn transact<T>(
        &self,
        what: &str,
        events: &[NewEvent],
        work: impl AsyncFnOnce(&Sql<'_, Transaction<'_>>) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let key = &self.key;
        self.write(what, async |tx| {
            let out = work(tx).await?;
            append_in(tx, key, events).await?;
            Ok(out)
        })
    }
}

/// A PostgreSQL error as an `anyhow` error carrying the server's words.
pub(crate) fn db(e: tokio_postgres::Error) -> anyhow::Error {
    anyhow!(pg_error(&e))
}

/// The id of a key that MACed an event, when the store's schema exists and has one.
async fn keyed_trace(c: &Client) -> anyhow::Result<Option<String>> {
    let exists: bool = c
        .query_one("SELECT to_regclass('trace_events') IS NOT NULL", &[])
        .await
        .map_err(db)?
        .get(0);
    if !exists {
        return Ok(None);
    }
    Ok(c.query_opt(
        "SELECT key_id FROM trace_events WHERE key_id IS NOT NULL LIMIT 1",
        &[],
    )
    .await
    .map_err(db)?
    .map(|r| r.get(0)))
}

/// Applies migrations up to [`PG_SCHEMA_VERSION`], each in its own transaction under the
/// write lock, re-reading the version each time (another host may be migrating).
async fn migrate(client: &mut Client, shown: &str) -> anyhow::Result<()> {
    loop {
        let tx = client.transaction().await.map_err(db)?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&WRITE_LOCK])
            .await
            .map_err(db)?;
        let has_schema: bool = tx
            .query_one("SELECT to_regclass('airlock_schema') IS NOT NULL", &[])
            .await
            .map_err(db)?
            .get(0);
        let version: i64 = if has_schema {
            tx.query_opt("SELECT version FROM airlock_schema", &[])
                .await
                .map_err(db)?
                .map(|r| r.get(0))
                .ok_or_else(|| {
                    anyhow!(
                        "the PostgreSQL store at {shown} has an empty airlock_schema table \
                         (it was altered); nothing was changed"
                    )
                })?
        } else {
            let tables: i64 = tx
                .query_one(
                    "SELECT count(*) FROM pg_catalog.pg_tables WHERE schemaname = current_schema()",
                    &[],
                )
                .await
                .map_err(db)?
                .get(0);
            if tables > 0 {
                bail!(
                    "the PostgreSQL database at {shown} holds {tables} tables but no Airlock \
                     schema version (airlock_schema), so it was not written by Airlock; \
                     nothing was changed — give Airlock a database of its own"
                );
            }
            0
        };
        if version > PG_SCHEMA_VERSION {
            bail!(
                "the PostgreSQL store at {shown} was written by a newer Airlock (schema \
                 {version}; this build knows up to {PG_SCHEMA_VERSION}); nothing was changed"
            );
        }
        if version < 0 {
            bail!(
                "the PostgreSQL store at {shown} has schema version {version}, which no \
                 Airlock writes; nothing was changed"
            );
        }
        if version == PG_SCHEMA_VERSION {
            return Ok(());
        }
        tx.batch_execute(PG_MIGRATIONS[version as usize])
            .await
            .map_err(db)
            .with_context(|| {
                format!(
                    "the PostgreSQL store at {shown}: migrating schema {version} → {}",
                    version + 1
                )
            })?;
        tx.execute("UPDATE airlock_schema SET version = $1", &[&(version + 1)])
            .await
            .map_err(db)?;
        tx.commit().await.map_err(db).with_context(|| {
            format!(
                "the PostgreSQL store at {shown}: committing schema {}",
                version + 1
            )
        })?;
    }
}

async fn latest_mapping(
    c: &Sql<'_, impl GenericClient + Sync>,
    name: &str,
) -> anyhow::Result<Option<MappingRecord>> {
    c.query_opt(
        &format!(
            "SELECT {MAPPING_COLUMNS} FROM mappings WHERE name = $1 \
             ORDER BY revision DESC LIMIT 1"
        ),
        &[&name],
    )
    .await
    .map_err(db)?
    .map(|r| rows::mapping(&r))
    .transpose()
}

async fn load_snapshot(
    c: &Sql<'_, impl GenericClient + Sync>,
    digest: &str,
) -> anyhow::Result<Option<StoredSnapshot>> {
    c.query_opt(
        &format!(
            "{} WHERE s.digest = $1 GROUP BY s.digest",
            rows::SNAPSHOT_SELECT
        ),
        &[&digest],
    )
    .await
    .map_err(db)?
    .map(|r| rows::stored_snapshot(&r))
    .transpose()
}

async fn load_approval(
    c: &Sql<'_, impl GenericClient + Sync>,
    id: &str,
    for_update: bool,
) -> anyhow::Result<Option<ApprovalRecord>> {
    let lock = if for_update { " FOR UPDATE" } else { "" };
    c.query_opt(
        &format!("SELECT {APPROVAL_COLUMNS} FROM approvals WHERE id = $1{lock}"),
        &[&id],
    )
    .await
    .map_err(db)?
    .map(|r| rows::approval(&r))
    .transpose()
}

async fn load_intent(
    c: &Sql<'_, impl GenericClient + Sync>,
    id: &str,
) -> anyhow::Result<Option<IntentRecord>> {
    c.query_opt(
        &format!("SELECT {INTENT_COLUMNS} FROM intents WHERE id = $1"),
        &[&id],
    )
    .await
    .map_err(db)?
    .map(|r| rows::intent(&r))
    .transpose()
}

async fn insert_attempt(
    tx: &Sql<'_, Transaction<'_>>,
    intent: &str,
    attempt: i64,
    now: i64,
) -> anyhow::Result<()> {
    tx.execute(
        "INSERT INTO intent_attempts (intent_id, attempt, state, prepared_ms) \
         VALUES ($1, $2, 'prepared', $3)",
        &[&intent, &attempt, &now],
    )
    .await
    .map_err(db)?;
    Ok(())
}

async fn insert_intent(
    tx: &Sql<'_, Transaction<'_>>,
    intent: &NewIntent,
    approval_id: Option<&str>,
    now: i64,
) -> anyhow::Result<()> {
    tx.execute(
        "INSERT INTO intents (id, idempotency_key, call_id, approval_id, requester, session, \
         capability, mapping, mapping_revision, args_digest, effect_class, state, created_ms, \
         updated_ms, compensates) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, 'prepared', $12, $12, $13)",
        &[
            &intent.id,
            &intent.idempotency_key,
            &intent.call_id,
            &approval_id,
            &intent.requester,
            &intent.session,
            &intent.capability,
            &intent.mapping,
            &intent.mapping_revision,
            &intent.args_digest,
            &intent.effect_class,
            &now,
            &intent.compensates,
        ],
    )
    .await
    .map_err(db)?;
    insert_attempt(tx, &intent.id, 1, now).await
}

/// The head `(seq, hash)` a new event chains to, read under the write lock.
async fn head(tx: &Sql<'_, Transaction<'_>>, key: &TraceKey) -> anyhow::Result<(i64, String)> {
    let last = tx
        .query_opt(
            "SELECT seq, hash, key_id FROM trace_events ORDER BY seq DESC LIMIT 1",
            &[],
        )
        .await
        .map_err(db)?;
    match last {
        None => Ok((0, GENESIS_HASH.to_owned())),
        Some(row) => {
            let seq: i64 = row.get(0);
            let hash: String = row.get(1);
            let id: Option<String> = row.get(2);
            match id {
                Some(id) if id != key.id() => bail!(
                    "the trace's newest event ({seq}) is MACed with key {id}, but this host \
                     holds key {} ({}): every host on one PostgreSQL store must hold the same \
                     key ([trace] key or {}); nothing was appended",
                    key.id(),
                    key.source(),
                    key::KEY_ENV
                ),
                _ => Ok((seq, hash)),
            }
        }
    }
}

/// Appends `events` inside the write transaction `tx`, chained after the head and MACed
/// with `key`, in one statement.
async fn append_in(
    tx: &Sql<'_, Transaction<'_>>,
    key: &TraceKey,
    events: &[NewEvent],
) -> anyhow::Result<()> {
    if events.is_empty() {
        return Ok(());
    }
    let (mut seq, mut prev) = head(tx, key).await?;
    let at = ms_to_sql(now_ms())?;
    let n = events.len();
    let (mut seqs, mut kinds, mut subjects, mut payloads, mut prevs, mut macs) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for e in events {
        seq += 1;
        let payload = trace::canonical(&e.payload)?;
        let mac = key.event_mac(seq, at, e.kind, &e.subject, &payload, &prev);
        seqs.push(seq);
        kinds.push(e.kind.to_owned());
        subjects.push(e.subject.clone());
        payloads.push(payload);
        prevs.push(std::mem::replace(&mut prev, mac.clone()));
        macs.push(mac);
    }
    tx.execute(
        &format!(
            "INSERT INTO trace_events ({TRACE_COLUMNS}) \
             SELECT s, $2, k, sub, p, ph, h, $8 \
             FROM unnest($1::bigint[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[]) \
             AS t(s, k, sub, p, ph, h)"
        ),
        &[
            &seqs,
            &at,
            &kinds,
            &subjects,
            &payloads,
            &prevs,
            &macs,
            &key.id(),
        ],
    )
    .await
    .map_err(db)?;
    Ok(())
}

/// The newest `trace-archived` event, through the partial index `trace_events_archives`.
const NEWEST_MARK_SQL: &str = "SELECT seq, at_ms, kind, subject, payload, prev_hash, hash, key_id \
     FROM trace_events WHERE kind = 'trace-archived' ORDER BY seq DESC LIMIT 1";

/// The PostgreSQL store's side of an archive pass ([`archive::ArchiveBackend`]). Several
/// hosts may run passes: the mark is appended under the write lock only if no other host
/// sealed one meanwhile.
struct PgArchive<'s>(&'s PostgresStore);

impl archive::ArchiveBackend for PgArchive<'_> {
    fn newest_mark_event(&self) -> anyhow::Result<Option<StoredEvent>> {
        self.0.read("reading the newest archive mark", async |c| {
            let row = c.query_opt(NEWEST_MARK_SQL, &[]).await.map_err(db)?;
            row.as_ref().map(rows::stored_event).transpose()
        })
    }

    fn events_after(
        &self,
        after: i64,
        through: i64,
        limit: i64,
    ) -> anyhow::Result<Vec<StoredEvent>> {
        self.0.read("reading events to archive", async |c| {
            c.query(
                &format!(
                    "SELECT {TRACE_COLUMNS} FROM trace_events WHERE seq > $1 AND seq <= $2 \
                     ORDER BY seq LIMIT $3"
                ),
                &[&after, &through, &limit],
            )
            .await
            .map_err(db)?
            .iter()
            .map(rows::stored_event)
            .collect()
        })
    }

    fn times_after(&self, after: i64, limit: i64) -> anyhow::Result<Vec<(i64, i64)>> {
        self.0.read("reading event times", async |c| {
            Ok(c.query(
                "SELECT seq, at_ms FROM trace_events WHERE seq > $1 ORDER BY seq LIMIT $2",
                &[&after, &limit],
            )
            .await
            .map_err(db)?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect())
        })
    }

    fn head_seq(&self) -> anyhow::Result<i64> {
        self.0.read("reading the trace head", async |c| {
            Ok(
                c.query_one("SELECT coalesce(max(seq), 0) FROM trace_events", &[])
                    .await
                    .map_err(db)?
                    .get(0),
            )
        })
    }

    fn events_at(&self, seqs: &[i64]) -> anyhow::Result<Vec<StoredEvent>> {
        let seqs = seqs.to_vec();
        self.0.read("reading kept events", async |c| {
            c.query(
                &format!(
                    "SELECT {TRACE_COLUMNS} FROM trace_events \
                     WHERE seq = ANY($1::bigint[]) ORDER BY seq"
                ),
                &[&seqs],
            )
            .await
            .map_err(db)?
            .iter()
            .map(rows::stored_event)
            .collect()
        })
    }

    fn needs(&self, now_ms: u64) -> anyhow::Result<archive::Needs> {
        let now = ms_to_sql(now_ms)?;
        self.0.read("reading what the trace must keep", async |c| {
            let ids = |rows: Vec<Row>| rows.iter().map(|r| r.get::<_, String>(0)).collect();
            Ok(archive::Needs {
                approvals: ids(c
                    .query(
                        "SELECT id FROM approvals WHERE state IN ('pending', 'approved') \
                         OR expires_ms > $1 OR intent_id IN \
                         (SELECT id FROM intents WHERE state IN ('prepared', 'unknown'))",
                        &[&now],
                    )
                    .await
                    .map_err(db)?),
                intents: ids(c
                    .query(
                        "SELECT id FROM intents WHERE state IN ('prepared', 'unknown')",
                        &[],
                    )
                    .await
                    .map_err(db)?),
            })
        })
    }

    fn intent_closed_in_trace(&self, id: &str) -> anyhow::Result<bool> {
        self.0.read("reading an intent's closing event", async |c| {
            // The terms repeat the index trace_events_intent_states' definition.
            Ok(c
                .query_opt(
                    "SELECT 1 FROM trace_events \
                     WHERE kind IN ('call-outcome', 'call-refused', 'intent-resolved', 'intent-held') \
                     AND (payload::jsonb ->> 'intent_state') IS NOT NULL \
                     AND (payload::jsonb ->> 'intent') = $1 \
                     AND (payload::jsonb ->> 'intent_state') IN ('completed', 'failed') LIMIT 1",
                    &[&id],
                )
                .await
                .map_err(db)?
                .is_some())
        })
    }

    fn append_mark(
        &self,
        previous: Option<i64>,
        mark: &archive::ArchiveMark,
    ) -> anyhow::Result<i64> {
        let key = &self.0.key;
        let event = NewEvent::new(
            archive::TRACE_ARCHIVED,
            "trace",
            serde_json::to_value(mark)?,
        );
        self.0.write("appending the archive mark", async |tx| {
            let newest: Option<i64> = tx
                .query_opt(NEWEST_MARK_SQL, &[])
                .await
                .map_err(db)?
                .map(|r| r.get(0));
            if newest != previous {
                bail!(
                    "another host archived the trace meanwhile (its newest mark is now event \
                     {newest:?}); this pass's segment {} will be replaced by the next pass",
                    mark.segment
                );
            }
            append_in(tx, key, std::slice::from_ref(&event)).await?;
            Ok(tx
                .query_one("SELECT max(seq) FROM trace_events", &[])
                .await
                .map_err(db)?
                .get(0))
        })
    }

    fn delete_archived(&self, to_seq: i64, kept: &[i64], limit: i64) -> anyhow::Result<u64> {
        let kept = kept.to_vec();
        self.0.write("deleting archived events", async |tx| {
            tx.execute(
                "DELETE FROM trace_events WHERE seq IN (SELECT seq FROM trace_events \
                 WHERE seq <= $1 AND NOT (seq = ANY($2::bigint[])) ORDER BY seq LIMIT $3)",
                &[&to_seq, &kept, &limit],
            )
            .await
            .map_err(db)
        })
    }

    fn reclaim(&self) -> anyhow::Result<u64> {
        // VACUUM (not FULL) makes the deleted rows' space reusable without locking out
        // writers; it returns to the file system only what ends the table.
        self.0.read("vacuuming the trace", async |c| {
            let size = async || -> anyhow::Result<i64> {
                Ok(
                    c.query_one("SELECT pg_total_relation_size('trace_events')", &[])
                        .await
                        .map_err(db)?
                        .get(0),
                )
            };
            let before = size().await?;
            c.c.batch_execute("VACUUM trace_events").await.map_err(db)?;
            let after = size().await?;
            Ok(u64::try_from(before - after).unwrap_or(0))
        })
    }
}

/// Tells every listening host, at commit of `tx`, that `what` changed.
async fn notify(tx: &Sql<'_, Transaction<'_>>, what: &str) -> anyhow::Result<()> {
    tx.execute("SELECT pg_notify($1, $2)", &[&CHANGES_CHANNEL, &what])
        .await
        .map_err(db)?;
    Ok(())
}

const OBSERVATION_UPSERT: &str = "INSERT INTO observations (id, connection_id, connection, \
     snapshot_digest, method, target, arguments_sha256, item, kind, media_type, sha256, bytes, \
     request_id, call_id, retrieved_ms, last_seen_ms, seen, previous) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $15, 1, \
     (SELECT id FROM observations WHERE connection_id = $2 AND method = $5 AND target = $6 \
      AND arguments_sha256 = $7 AND item = $8 AND id <> $1 \
      ORDER BY last_seen_ms DESC, seq DESC LIMIT 1)) \
     ON CONFLICT (id) DO UPDATE SET \
     last_seen_ms = GREATEST(observations.last_seen_ms, EXCLUDED.last_seen_ms), \
     seen = observations.seen + 1";

async fn write_observations(
    tx: &Sql<'_, Transaction<'_>>,
    observations: &[NewObservation],
) -> anyhow::Result<()> {
    for o in observations {
        let bytes = i64::try_from(o.bytes)?;
        let retrieved = ms_to_sql(o.retrieved_ms)?;
        let params: [&(dyn ToSql + Sync); 15] = [
            &o.id,
            &o.connection_id,
            &o.connection,
            &o.snapshot_digest,
            &o.method,
            &o.target,
            &o.arguments_sha256,
            &o.item,
            &o.kind,
            &o.media_type,
            &o.sha256,
            &bytes,
            &o.request_id,
            &o.call_id,
            &retrieved,
        ];
        tx.execute(OBSERVATION_UPSERT, &params).await.map_err(db)?;
    }
    Ok(())
}

impl Connections for PostgresStore {
    fn connection_revision(
        &self,
        name: &str,
        config_digest: &str,
        config: &serde_json::Value,
    ) -> anyhow::Result<ConnectionRevision> {
        if name.is_empty() {
            bail!("a connection name must not be empty");
        }
        if config_digest.is_empty() {
            bail!("connection {name:?}: the configuration digest must not be empty");
        }
        let config_text = canonical(config)?;
        let now = ms_to_sql(now_ms())?;
        self.write(&format!("recording connection {name:?}"), async |tx| {
            let existing = tx
                .query_opt(
                    "SELECT connection_id FROM connections WHERE name = $1",
                    &[&name],
                )
                .await
                .map_err(db)?;
            let connection_id: String = match existing {
                Some(row) => row.get(0),
                None => {
                    let mut attempts = 0;
                    loop {
                        let id = new_connection_id()?;
                        let inserted = tx
                            .execute(
                                "INSERT INTO connections (connection_id, name, first_seen_ms) \
                                 VALUES ($1, $2, $3) ON CONFLICT (connection_id) DO NOTHING",
                                &[&id, &name, &now],
                            )
                            .await
                            .map_err(db)?;
                        if inserted == 1 {
                            break id;
                        }
                        attempts += 1;
                        if attempts >= 8 {
                            bail!("could not draw an unused connection id");
                        }
                    }
                }
            };
            let seen = tx
                .query_opt(
                    "SELECT revision FROM connection_revisions \
                     WHERE connection_id = $1 AND config_digest = $2",
                    &[&connection_id, &config_digest],
                )
                .await
                .map_err(db)?;
            let (revision, created) = match seen {
                Some(row) => (row.get::<_, i64>(0), false),
                None => {
                    let revision: i64 = tx
                        .query_one(
                            "SELECT coalesce(max(revision), 0) + 1 FROM connection_revisions \
                             WHERE connection_id = $1",
                            &[&connection_id],
                        )
                        .await
                        .map_err(db)?
                        .get(0);
                    tx.execute(
                        "INSERT INTO connection_revisions \
                         (connection_id, revision, config_digest, config, created_ms) \
                         VALUES ($1, $2, $3, $4, $5)",
                        &[
                            &connection_id,
                            &revision,
                            &config_digest,
                            &config_text,
                            &now,
                        ],
                    )
                    .await
                    .map_err(db)?;
                    (revision, true)
                }
            };
            Ok(ConnectionRevision {
                connection_id,
                name: name.to_owned(),
                revision,
                config_digest: config_digest.to_owned(),
                created,
            })
        })
    }

    fn connection(&self, name: &str) -> anyhow::Result<Option<ConnectionRecord>> {
        self.read(&format!("reading connection {name:?}"), async |c| {
            c.query_opt(&format!("{CONNECTION_SELECT} AND c.name = $1"), &[&name])
                .await
                .map_err(db)?
                .map(|r| rows::connection(&r))
                .transpose()
        })
    }

    fn connections(&self) -> anyhow::Result<Vec<ConnectionRecord>> {
        self.read("listing connections", async |c| {
            c.query(&format!("{CONNECTION_SELECT} ORDER BY c.name"), &[])
                .await
                .map_err(db)?
                .iter()
                .map(rows::connection)
                .collect()
        })
    }
}

impl Snapshots for PostgresStore {
    fn put_snapshot(
        &self,
        digest: &str,
        connection_id: &str,
        config_revision: i64,
        body: &serde_json::Value,
    ) -> anyhow::Result<SnapshotObservation> {
        if !is_hex(digest) {
            bail!("snapshot digest {digest:?} is not hex");
        }
        let digest = digest.to_ascii_lowercase();
        let body_text = canonical(body)?;
        let observed_at_ms = now_ms();
        let now = ms_to_sql(observed_at_ms)?;
        let d = &digest;
        self.write(&format!("recording snapshot {digest}"), async |tx| {
            let known: bool = tx
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM connection_revisions \
                     WHERE connection_id = $1 AND revision = $2)",
                    &[&connection_id, &config_revision],
                )
                .await
                .map_err(db)?
                .get(0);
            if !known {
                bail!(
                    "connection {connection_id:?} has no configuration revision \
                     {config_revision}"
                );
            }
            let stored = tx
                .query_opt(
                    "SELECT connection_id, config_revision, body FROM snapshots WHERE digest = $1",
                    &[d],
                )
                .await
                .map_err(db)?
                .map(|row| plans::StoredSnapshotKey {
                    connection_id: row.get(0),
                    config_revision: row.get(1),
                    body: row.get(2),
                });
            let plan = plans::snapshot_write(
                d,
                connection_id,
                config_revision,
                &body_text,
                stored.as_ref(),
            )?;
            let new = plan == plans::SnapshotWrite::Insert;
            if new {
                tx.execute(
                    "INSERT INTO snapshots \
                     (digest, connection_id, config_revision, body, first_seen_ms) \
                     VALUES ($1, $2, $3, $4, $5)",
                    &[d, &connection_id, &config_revision, &body_text, &now],
                )
                .await
                .map_err(db)?;
            }
            tx.execute(
                "INSERT INTO snapshot_observations (digest, observed_at_ms) VALUES ($1, $2)",
                &[d, &now],
            )
            .await
            .map_err(db)?;
            Ok(SnapshotObservation {
                digest: d.clone(),
                new,
                observed_at_ms,
            })
        })
    }

    fn snapshot(&self, digest_or_prefix: &str) -> anyhow::Result<Option<StoredSnapshot>> {
        if !is_hex(digest_or_prefix) {
            bail!("snapshot digest or prefix {digest_or_prefix:?} is not hex");
        }
        let wanted = digest_or_prefix.to_ascii_lowercase();
        self.read(&format!("reading snapshot {digest_or_prefix}"), async |c| {
            if let Some(found) = load_snapshot(c, &wanted).await? {
                return Ok(Some(found));
            }
            if wanted.len() < MIN_PREFIX {
                bail!(
                    "snapshot prefix {wanted} is too short: give at least {MIN_PREFIX} hex \
                     characters"
                );
            }
            // Hex only, so the pattern holds no LIKE metacharacters.
            let pattern = format!("{wanted}%");
            let matches: Vec<String> = c
                .query(
                    "SELECT digest FROM snapshots WHERE digest LIKE $1 LIMIT 2",
                    &[&pattern],
                )
                .await
                .map_err(db)?
                .iter()
                .map(|r| r.get(0))
                .collect();
            match matches.as_slice() {
                [] => Ok(None),
                [only] => load_snapshot(c, only).await,
                _ => {
                    let count: i64 = c
                        .query_one(
                            "SELECT count(*) FROM snapshots WHERE digest LIKE $1",
                            &[&pattern],
                        )
                        .await
                        .map_err(db)?
                        .get(0);
                    bail!(
                        "snapshot prefix {wanted} is ambiguous: it matches {count} snapshots; \
                         give more characters"
                    )
                }
            }
        })
    }

    fn latest_snapshot(&self, connection_id: &str) -> anyhow::Result<Option<StoredSnapshot>> {
        self.read(
            &format!("reading the latest snapshot of {connection_id}"),
            async |c| {
                let digest = c
                    .query_opt(
                        "SELECT o.digest FROM snapshot_observations o \
                         JOIN snapshots s ON s.digest = o.digest \
                         WHERE s.connection_id = $1 ORDER BY o.id DESC LIMIT 1",
                        &[&connection_id],
                    )
                    .await
                    .map_err(db)?;
                match digest {
                    Some(row) => load_snapshot(c, row.get::<_, &str>(0)).await,
                    None => Ok(None),
                }
            },
        )
    }

    fn snapshots(&self, connection_id: Option<&str>) -> anyhow::Result<Vec<SnapshotSummary>> {
        self.read("listing snapshots", async |c| {
            c.query(
                &format!(
                    "{SNAPSHOT_SUMMARY_SELECT} WHERE $1::text IS NULL OR s.connection_id = $1 \
                     GROUP BY s.digest ORDER BY 5 DESC, 7 DESC"
                ),
                &[&connection_id],
            )
            .await
            .map_err(db)?
            .iter()
            .map(rows::snapshot_summary)
            .collect()
        })
    }
}

impl Mappings for PostgresStore {
    fn mapping(&self, name: &str) -> anyhow::Result<Option<MappingRecord>> {
        self.read(&format!("reading mapping {name:?}"), async |c| {
            latest_mapping(c, name).await
        })
    }

    fn mapping_revisions(&self, name: &str) -> anyhow::Result<Vec<MappingRecord>> {
        self.read(
            &format!("reading revisions of mapping {name:?}"),
            async |c| {
                c.query(
                    &format!(
                        "SELECT {MAPPING_COLUMNS} FROM mappings WHERE name = $1 ORDER BY revision"
                    ),
                    &[&name],
                )
                .await
                .map_err(db)?
                .iter()
                .map(rows::mapping)
                .collect()
            },
        )
    }

    fn mappings(&self) -> anyhow::Result<Vec<MappingRecord>> {
        self.read("listing mappings", async |c| {
            c.query(
                &format!(
                    "SELECT {MAPPING_COLUMNS} FROM mappings m \
                     WHERE revision = (SELECT max(revision) FROM mappings WHERE name = m.name) \
                     ORDER BY name"
                ),
                &[],
            )
            .await
            .map_err(db)?
            .iter()
            .map(rows::mapping)
            .collect()
        })
    }

    fn add_mapping_revision_traced(
        &self,
        new: &NewMappingRevision,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<MappingRecord> {
        if new.name.is_empty() {
            bail!("a mapping name must not be empty");
        }
        let pins_text = canonical(&new.pins)?;
        let now_u = now_ms();
        let now = ms_to_sql(now_u)?;
        let key = &self.key;
        self.write(
            &format!("recording a revision of mapping {:?}", new.name),
            async |tx| {
                let previous = latest_mapping(tx, &new.name).await?;
                let plan = plans::supersede(
                    previous.as_ref(),
                    new,
                    serde_json::from_str(&pins_text)?,
                    now_u,
                );
                let revision = plan.record.revision;
                if let Some(retire) = &plan.retire {
                    tx.execute(
                        "UPDATE mappings SET state = $1, reason = $2, state_changed_ms = $3 \
                         WHERE name = $4 AND revision = $5",
                        &[
                            &MappingState::Historical.as_str(),
                            &retire.reason,
                            &now,
                            &new.name,
                            &retire.revision,
                        ],
                    )
                    .await
                    .map_err(db)?;
                }
                tx.execute(
                    &format!(
                        "INSERT INTO mappings ({MAPPING_COLUMNS}) \
                         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $12, $13)"
                    ),
                    &[
                        &new.name,
                        &revision,
                        &new.manifest_digest,
                        &new.component_sha256,
                        &new.connection_id,
                        &new.config_revision,
                        &new.snapshot_digest,
                        &pins_text,
                        &new.state.as_str(),
                        &new.reviewer,
                        &new.reason,
                        &now,
                        &new.manifest_text,
                    ],
                )
                .await
                .map_err(db)?;
                append_in(tx, key, &with_revision(events.clone(), revision)).await?;
                notify(tx, "mapping").await?;
                Ok(plan.record)
            },
        )
    }

    fn set_mapping_state_traced(
        &self,
        name: &str,
        expected: MappingState,
        to: MappingState,
        reason: &str,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<Option<MappingRecord>> {
        plans::check_transition(name, expected, to)?;
        let now_u = now_ms();
        let now = ms_to_sql(now_u)?;
        let key = &self.key;
        self.write(
            &format!("changing the state of mapping {name:?} to {to}"),
            async |tx| {
                let latest = latest_mapping(tx, name).await?;
                let Some(changed) = plans::set_state(name, latest, expected, to, reason, now_u)?
                else {
                    return Ok(None);
                };
                tx.execute(
                    "UPDATE mappings SET state = $1, reason = $2, state_changed_ms = $3 \
                     WHERE name = $4 AND revision = $5",
                    &[&to.as_str(), &reason, &now, &name, &changed.revision],
                )
                .await
                .map_err(db)?;
                append_in(tx, key, &with_revision(events.clone(), changed.revision)).await?;
                notify(tx, "mapping").await?;
                Ok(Some(changed))
            },
        )
    }
}

impl ContractReviews for PostgresStore {
    fn contract_review(&self, package: &str) -> anyhow::Result<Option<ContractRecord>> {
        self.read(&format!("reading contract review {package:?}"), async |c| {
            latest_contract(c, package, "").await
        })
    }

    fn contract_reviews(&self) -> anyhow::Result<Vec<ContractRecord>> {
        self.read("listing contract reviews", async |c| {
            c.query(
                &format!("SELECT {CONTRACT_COLUMNS} FROM contract_reviews ORDER BY package"),
                &[],
            )
            .await
            .map_err(db)?
            .iter()
            .map(rows::contract)
            .collect()
        })
    }

    fn approve_contract(&self, new: &NewContractApproval) -> anyhow::Result<ContractRecord> {
        let now_u = now_ms();
        let now = ms_to_sql(now_u)?;
        let key = &self.key;
        self.write(
            &format!("recording the approval of contract {:?}", new.package),
            async |tx| {
                // One writer at a time (the store's write lock); the row lock and the
                // primary key are a second line: a racing first approval fails its insert.
                let current = latest_contract(tx, &new.package, " FOR UPDATE").await?;
                let record = match contracts::plan_approval(current, new, now_u)? {
                    contracts::ApprovalPlan::Unchanged(r) => return Ok(r),
                    contracts::ApprovalPlan::Insert(r) => r,
                };
                tx.execute(
                    &format!(
                        "INSERT INTO contract_reviews ({CONTRACT_COLUMNS}) \
                         VALUES ($1, $2, $3, $4, $5, $6, $7, $7)"
                    ),
                    &[
                        &record.package,
                        &record.digest,
                        &record.state.as_str(),
                        &record.reviewer,
                        &record.reason,
                        &record.files,
                        &now,
                    ],
                )
                .await
                .map_err(db)?;
                append_in(tx, key, &[contracts::event_for(&record)]).await?;
                notify(tx, "mapping").await?;
                Ok(record)
            },
        )
    }

    fn mark_contract_erroneous(
        &self,
        package: &str,
        reviewer: &str,
        reason: &str,
    ) -> anyhow::Result<Option<ContractRecord>> {
        let now_u = now_ms();
        let now = ms_to_sql(now_u)?;
        let key = &self.key;
        self.write(
            &format!("marking contract {package:?} erroneous"),
            async |tx| {
                let current = latest_contract(tx, package, " FOR UPDATE").await?;
                let Some(record) =
                    contracts::plan_erroneous(package, current, reviewer, reason, now_u)?
                else {
                    return Ok(None);
                };
                tx.execute(
                    "UPDATE contract_reviews SET state = $1, reviewer = $2, reason = $3, \
                     state_changed_ms = $4 WHERE package = $5",
                    &[&record.state.as_str(), &reviewer, &reason, &now, &package],
                )
                .await
                .map_err(db)?;
                append_in(tx, key, &[contracts::event_for(&record)]).await?;
                notify(tx, "mapping").await?;
                Ok(Some(record))
            },
        )
    }

    fn contract_proofs(&self, package: &str) -> anyhow::Result<Vec<TraceEvent>> {
        self.genuine_events(
            &format!("reading the proofs of contract {package:?}"),
            &format!(
                "SELECT {TRACE_COLUMNS} FROM trace_events \
                 WHERE kind IN ('contract-approved', 'contract-marked-erroneous') \
                 AND subject = $1 ORDER BY seq"
            ),
            package,
            |_, subject| subject == package,
        )
    }
}

/// The review of `package`; `lock` is `""` or `" FOR UPDATE"` (in a write).
async fn latest_contract(
    c: &Sql<'_, impl GenericClient + Sync>,
    package: &str,
    lock: &str,
) -> anyhow::Result<Option<ContractRecord>> {
    c.query_opt(
        &format!("SELECT {CONTRACT_COLUMNS} FROM contract_reviews WHERE package = $1{lock}"),
        &[&package],
    )
    .await
    .map_err(db)?
    .map(|r| rows::contract(&r))
    .transpose()
}

impl Trace for PostgresStore {
    fn trace_key(&self) -> &TraceKey {
        &self.key
    }

    fn append_trace(
        &self,
        kind: &str,
        subject: &str,
        payload: &serde_json::Value,
    ) -> anyhow::Result<TraceEvent> {
        let payload_text = trace::canonical(payload)?;
        let payload: serde_json::Value =
            serde_json::from_str(&payload_text).context("re-reading canonical payload")?;
        let key = &self.key;
        self.write(&format!("appending trace event {kind:?}"), async |tx| {
            let (last, prev_hash) = head(tx, key).await?;
            let seq = last + 1;
            let at_ms = now_ms();
            let at = ms_to_sql(at_ms)?;
            let hash = key.event_mac(seq, at, kind, subject, &payload_text, &prev_hash);
            tx.execute(
                &format!(
                    "INSERT INTO trace_events ({TRACE_COLUMNS}) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
                ),
                &[
                    &seq,
                    &at,
                    &kind,
                    &subject,
                    &payload_text,
                    &prev_hash,
                    &hash,
                    &key.id(),
                ],
            )
            .await
            .map_err(db)?;
            Ok(TraceEvent {
                seq,
                at_ms,
                kind: kind.to_owned(),
                subject: subject.to_owned(),
                payload: payload.clone(),
                prev_hash,
                hash,
                key_id: Some(key.id().to_owned()),
            })
        })
    }

    fn append_events(&self, events: Vec<NewEvent>) -> anyhow::Result<()> {
        self.append_call(events, Vec::new())
    }

    fn append_call(
        &self,
        events: Vec<NewEvent>,
        observations: Vec<NewObservation>,
    ) -> anyhow::Result<()> {
        if events.is_empty() && observations.is_empty() {
            return Ok(());
        }
        // Group commit within this host: while one caller's transaction holds the
        // database's write lock, the calls that arrive queue up and the next writer commits
        // all of them in one transaction, so the serialized chain is taken once per batch,
        // not once per call. Each caller gets the result of the transaction that held its
        // own events.
        let key = &self.key;
        self.commit.append(
            events,
            observations,
            || self.appending.lock().unwrap_or_else(|e| e.into_inner()),
            |_, all, seen| {
                self.write(
                    &format!("appending {} trace events", all.len()),
                    async |tx| {
                        write_observations(tx, seen).await?;
                        append_in(tx, key, all).await
                    },
                )
            },
        )
    }

    fn trace(&self, after_seq: i64, limit: usize) -> anyhow::Result<Vec<TraceEvent>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.read("reading the trace", async |c| {
            c.query(
                &format!(
                    "SELECT {TRACE_COLUMNS} FROM trace_events WHERE seq > $1 ORDER BY seq LIMIT $2"
                ),
                &[&after_seq, &limit],
            )
            .await
            .map_err(db)?
            .iter()
            .map(rows::trace_event)
            .collect()
        })
    }

    fn trace_window(
        &self,
        before: i64,
        from: i64,
        kinds: &[&str],
    ) -> anyhow::Result<Vec<TraceEvent>> {
        let kinds: Vec<String> = kinds.iter().map(|k| (*k).to_string()).collect();
        self.read("reading a window of the trace", async |c| {
            c.query(
                &format!(
                    "SELECT {TRACE_COLUMNS} FROM trace_events WHERE seq < $1 AND seq >= $2 \
                     AND kind = ANY($3) ORDER BY seq DESC"
                ),
                &[&before, &from, &kinds],
            )
            .await
            .map_err(db)?
            .iter()
            .map(rows::trace_event)
            .collect()
        })
    }

    fn verify_trace_against(
        &self,
        checkpoints: &[(usize, Checkpoint)],
    ) -> anyhow::Result<TraceVerification> {
        let mut lease = self.pool.get()?;
        let client = lease.client();
        block_on(async {
            // One snapshot for every page: a consistent view while other hosts append.
            let tx = client
                .build_transaction()
                .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
                .read_only(true)
                .start()
                .await
                .map_err(db)?;
            let wanted: std::collections::BTreeSet<i64> =
                checkpoints.iter().map(|(_, c)| c.seq).collect();
            let mut recorded: std::collections::BTreeMap<i64, String> = Default::default();
            let mark = tx
                .query_opt(NEWEST_MARK_SQL, &[])
                .await
                .map_err(db)?
                .as_ref()
                .map(rows::stored_event)
                .transpose()?
                .map(|e| archive::Archived::from_event(&self.key, &e).map_err(|why| (e.seq, why)));
            let mut chain = ChainCheck::after_mark(&self.key, mark);
            let mut after = i64::MIN;
            loop {
                let rows = tx
                    .query(
                        &format!(
                            "SELECT {TRACE_COLUMNS} FROM trace_events WHERE seq > $1 \
                             ORDER BY seq LIMIT $2"
                        ),
                        &[&after, &VERIFY_PAGE],
                    )
                    .await
                    .map_err(db)?;
                let full = rows.len() as i64 == VERIFY_PAGE;
                for row in &rows {
                    let stored = rows::stored_event(row)?;
                    after = stored.seq;
                    if wanted.contains(&stored.seq) {
                        recorded.insert(stored.seq, stored.hash.clone());
                    }
                    chain.next(stored)?;
                }
                if !full {
                    break;
                }
            }
            tx.commit().await.map_err(db)?;
            Ok::<_, anyhow::Error>(chain.finish(checkpoints, &recorded))
        })
        .with_context(|| self.context("verifying the trace"))
    }

    fn trace_checkpoint(&self) -> anyhow::Result<Checkpoint> {
        let head = self.read("reading the trace head", async |c| {
            Ok(c.query_opt(
                "SELECT seq, hash FROM trace_events ORDER BY seq DESC LIMIT 1",
                &[],
            )
            .await
            .map_err(db)?
            .map(|r| (r.get::<_, i64>(0), r.get::<_, String>(1))))
        })?;
        let (seq, head) = head.unwrap_or((0, GENESIS_HASH.to_owned()));
        Ok(self.key.checkpoint(seq, &head, now_ms()))
    }

    fn mapping_proofs(&self, name: &str) -> anyhow::Result<Vec<TraceEvent>> {
        self.genuine_events(
            &format!("reading the proofs of mapping {name:?}"),
            &format!(
                "SELECT {TRACE_COLUMNS} FROM trace_events \
                 WHERE kind IN ('mapping-revision', 'mapping-state-changed', 'trace-keyed') \
                 AND subject IN ($1, 'trace') ORDER BY seq"
            ),
            name,
            |kind, subject| subject == name || kind == TRACE_KEYED,
        )
    }

    fn connection_state(&self, name: &str) -> anyhow::Result<Option<TraceEvent>> {
        self.genuine_events(
            &format!("reading the state of connection {name:?}"),
            &format!(
                "SELECT {TRACE_COLUMNS} FROM trace_events \
                 WHERE kind = 'connection-state' AND subject = $1 ORDER BY seq DESC"
            ),
            name,
            |_, subject| subject == name,
        )
        .map(|events| events.into_iter().next())
    }

    fn approval_proofs(&self, id: &str) -> anyhow::Result<Vec<TraceEvent>> {
        // Both terms repeat the expression index's definition (trace_events_approval_proofs).
        self.genuine_events(
            &format!("reading the proofs of approval {id:?}"),
            &format!(
                "SELECT {TRACE_COLUMNS} FROM trace_events \
                 WHERE kind IN ('approval-requested', 'approval-decided', 'receipt-consumed') \
                 AND (payload::jsonb ->> 'approval') = $1 ORDER BY seq"
            ),
            id,
            |_, _| true,
        )
    }

    fn trace_missing_from(&self, seq: i64) -> anyhow::Result<u64> {
        let mark = self.archive_mark()?;
        let to = mark.as_ref().map_or(0, |a| a.mark.to_seq);
        let (count, head, below): (i64, i64, Vec<i64>) =
            self.read("counting the trace's events", async |c| {
                let row = c
                    .query_one(
                        "SELECT count(*), coalesce(max(seq), 0) FROM trace_events WHERE seq >= $1",
                        &[&seq.max(to + 1)],
                    )
                    .await
                    .map_err(db)?;
                let below = if seq <= to {
                    c.query(
                        "SELECT seq FROM trace_events WHERE seq >= $1 AND seq <= $2",
                        &[&seq, &to],
                    )
                    .await
                    .map_err(db)?
                    .iter()
                    .map(|r| r.get(0))
                    .collect()
                } else {
                    Vec::new()
                };
                Ok((row.get(0), row.get(1), below))
            })?;
        Ok(archive::missing_from(
            seq,
            mark.as_ref(),
            &below,
            count,
            head,
        ))
    }

    fn archive_mark(&self) -> anyhow::Result<Option<archive::Archived>> {
        archive::newest_mark(&PgArchive(self), &self.key)
    }

    fn archive_trace(
        &self,
        request: &archive::ArchiveRequest,
    ) -> anyhow::Result<archive::ArchiveReport> {
        archive::run_pass(&PgArchive(self), &self.key, request)
            .with_context(|| self.context("archiving the trace"))
    }

    fn export_trace(&self, dir: &Path) -> anyhow::Result<archive::Exported> {
        archive::export(&PgArchive(self), &self.key, dir)
            .with_context(|| self.context("exporting the trace"))
    }

    fn intent_proofs(&self, id: &str) -> anyhow::Result<Vec<TraceEvent>> {
        // Each half repeats an expression index's definition (trace_events_intent_proofs,
        // trace_events_intent_states), so each reads its index.
        self.genuine_events(
            &format!("reading the proofs of intent {id:?}"),
            &format!(
                "SELECT {TRACE_COLUMNS} FROM trace_events \
                 WHERE kind = 'intent-created' \
                 AND (payload::jsonb ->> 'intent') = $1 \
                 UNION ALL \
                 SELECT {TRACE_COLUMNS} FROM trace_events \
                 WHERE kind IN ('call-outcome', 'call-refused', 'intent-resolved', 'intent-held') \
                 AND (payload::jsonb ->> 'intent_state') IS NOT NULL \
                 AND (payload::jsonb ->> 'intent') = $1 \
                 ORDER BY seq"
            ),
            id,
            |_, _| true,
        )
    }

    fn intents_open_in_trace_only(
        &self,
        mapping: &str,
        limit: usize,
    ) -> anyhow::Result<Vec<String>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.read(
            &format!("listing the intents of {mapping:?} the trace leaves open"),
            async |c| {
                let rows = c
                    .query(
                        "SELECT (c.payload::jsonb ->> 'intent') FROM trace_events c \
                         WHERE c.kind = 'intent-created' \
                         AND (c.payload::jsonb ->> 'mapping') = $1 \
                         AND (c.payload::jsonb ->> 'intent_state') IS NOT NULL \
                         AND NOT EXISTS (SELECT 1 FROM trace_events e \
                             WHERE e.kind IN ('call-outcome', 'call-refused', 'intent-resolved', 'intent-held') \
                             AND (e.payload::jsonb ->> 'intent_state') IS NOT NULL \
                             AND (e.payload::jsonb ->> 'intent') = (c.payload::jsonb ->> 'intent') \
                             AND (e.payload::jsonb ->> 'intent_state') IN ('completed', 'failed')) \
                         AND NOT EXISTS (SELECT 1 FROM intents i \
                             WHERE i.id = (c.payload::jsonb ->> 'intent') \
                             AND i.state IN ('prepared', 'unknown')) \
                         ORDER BY c.seq LIMIT $2",
                        &[&mapping, &limit],
                    )
                    .await
                    .map_err(db)?;
                rows.iter()
                    .map(|r| r.try_get::<_, Option<String>>(0).map(Option::unwrap_or_default))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(db)
            },
        )
    }
}

impl Approvals for PostgresStore {
    fn create_approval(
        &self,
        new: &NewApproval,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<ApprovalRecord> {
        let id = random_id("apr_", 12);
        let nonce = random_id("", 16);
        let now = now_ms();
        let expires = now.saturating_add(new.ttl_ms);
        let (now_sql, expires_sql) = (ms_to_sql(now)?, ms_to_sql(expires)?);
        let events: Vec<NewEvent> = events
            .into_iter()
            .map(|mut e| {
                if let Some(o) = e.payload.as_object_mut() {
                    o.entry("approval")
                        .or_insert_with(|| serde_json::Value::String(id.clone()));
                }
                e
            })
            .collect();
        let id = &id;
        self.transact("recording an approval request", &events, async |tx| {
            let b = &new.binding;
            tx.execute(
                &format!(
                    "INSERT INTO approvals ({APPROVAL_COLUMNS}) VALUES ($1, 'pending', $2, $3, \
                     $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, NULL, NULL, \
                     NULL, NULL, NULL)"
                ),
                &[
                    id,
                    &new.mode.as_str(),
                    &b.requester,
                    &b.session,
                    &new.profile,
                    &b.capability,
                    &b.mapping,
                    &b.mapping_revision,
                    &b.snapshot_digest,
                    &b.policy_digest,
                    &b.args_digest,
                    &b.artifact_digest,
                    &new.summary,
                    &nonce,
                    &now_sql,
                    &expires_sql,
                ],
            )
            .await
            .map_err(db)?;
            load_approval(tx, id, false)
                .await?
                .ok_or_else(|| anyhow!("the approval just written is missing"))
        })
    }

    fn approval(&self, id: &str) -> anyhow::Result<Option<ApprovalRecord>> {
        let id = id.trim();
        if id.len() < 12 || !id.is_ascii() {
            bail!(
                "approval id `{id}` is too short: give the full id (apr_…) or at least 12 characters of it"
            );
        }
        let rows = self.read("reading an approval", async |c| {
            c.query(
                &format!(
                    "SELECT {APPROVAL_COLUMNS} FROM approvals WHERE id = $1 \
                     OR (length($1) < 28 AND starts_with(id, $1)) LIMIT 2"
                ),
                &[&id],
            )
            .await
            .map_err(db)?
            .iter()
            .map(rows::approval)
            .collect::<anyhow::Result<Vec<_>>>()
        })?;
        match rows.len() {
            0 => Ok(None),
            1 => Ok(rows.into_iter().next()),
            _ => bail!("approval id prefix `{id}` matches several approvals; give more of it"),
        }
    }

    fn approvals(
        &self,
        state: Option<ApprovalState>,
        limit: usize,
    ) -> anyhow::Result<Vec<ApprovalRecord>> {
        self.approvals_after(state, None, limit)
    }

    fn approvals_after(
        &self,
        state: Option<ApprovalState>,
        after: Option<(u64, &str)>,
        limit: usize,
    ) -> anyhow::Result<Vec<ApprovalRecord>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let state = state.map(|s| s.as_str());
        let after_ms = after.map(|(ms, _)| i64::try_from(ms).unwrap_or(i64::MAX));
        let after_id = after.map(|(_, id)| id.to_string());
        self.read("listing approvals", async |c| {
            c.query(
                &format!(
                    "SELECT {APPROVAL_COLUMNS} FROM approvals WHERE ($1::text IS NULL OR state = $1) \
                     AND ($2::bigint IS NULL OR created_ms < $2 OR (created_ms = $2 AND id > $3::text)) \
                     ORDER BY created_ms DESC, id LIMIT $4"
                ),
                &[&state, &after_ms, &after_id, &limit],
            )
            .await
            .map_err(db)?
            .iter()
            .map(rows::approval)
            .collect()
        })
    }

    fn find_approval(&self, binding: &ReceiptBinding) -> anyhow::Result<Option<ApprovalRecord>> {
        self.read("looking up an approval", async |c| {
            c.query_opt(
                &format!(
                    "SELECT {APPROVAL_COLUMNS} FROM approvals WHERE requester = $1 AND \
                     session = $2 AND capability = $3 AND args_digest = $4 AND state IN \
                     ('pending', 'approved') ORDER BY created_ms DESC LIMIT 1"
                ),
                &[
                    &binding.requester,
                    &binding.session,
                    &binding.capability,
                    &binding.args_digest,
                ],
            )
            .await
            .map_err(db)?
            .map(|r| rows::approval(&r))
            .transpose()
        })
    }

    fn decide_approval(
        &self,
        id: &str,
        decision: ApprovalDecision,
        by: &str,
        reason: Option<&str>,
        ttl_ms: u64,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<ApprovalRecord> {
        let now = now_ms();
        let key = &self.key;
        // The expiry is recorded even though the decision fails: the refusal is returned
        // as a value so that the transaction commits.
        let outcome = self.write("deciding an approval", async |tx| {
            let Some(record) = load_approval(tx, id, true).await? else {
                return Ok(Err(format!("no approval `{id}`")));
            };
            let (to, expires) = match record.decision_effect(decision, now, ttl_ms) {
                DecisionEffect::Becomes(to, expires) => (to, ms_to_sql(expires)?),
                DecisionEffect::Expired(why) => {
                    tx.execute(
                        "UPDATE approvals SET state = 'expired' WHERE id = $1 AND state IN ('pending', 'approved')",
                        &[&id],
                    )
                    .await
                    .map_err(db)?;
                    return Ok(Err(why));
                }
                DecisionEffect::Refused(why) => return Ok(Err(why)),
            };
            tx.execute(
                "UPDATE approvals SET state = $2, decided_by = $3, decided_ms = $4, reason = $5, expires_ms = $6 WHERE id = $1",
                &[&id, &to.as_str(), &by, &ms_to_sql(now)?, &reason, &expires],
            )
            .await
            .map_err(db)?;
            append_in(tx, key, &events).await?;
            notify(tx, "approval").await?;
            Ok(Ok(load_approval(tx, id, false)
                .await?
                .ok_or_else(|| anyhow!("approval `{id}` vanished"))?))
        })?;
        outcome.map_err(|why| anyhow!(why))
    }

    fn consume_receipt(
        &self,
        id: &str,
        binding: &ReceiptBinding,
        how: ConsumeAs<'_>,
        intent: &NewIntent,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<Consumption> {
        let now = now_ms();
        let now_sql = ms_to_sql(now)?;
        let key = &self.key;
        // A refusal commits too (it writes nothing but, for an expired receipt, its
        // expiry).
        self.write("consuming a receipt", async |tx| {
            let Some(record) = load_approval(tx, id, true).await? else {
                return Ok(Consumption::Refused(ReceiptRefusal::NotFound));
            };
            match plans::check_consumption(&record, binding, how, now) {
                Ok(()) => {}
                Err(ReceiptRefusal::Expired) => {
                    tx.execute(
                        "UPDATE approvals SET state = 'expired' WHERE id = $1 AND state IN ('pending', 'approved')",
                        &[&id],
                    )
                    .await
                    .map_err(db)?;
                    return Ok(Consumption::Refused(ReceiptRefusal::Expired));
                }
                Err(refusal) => return Ok(Consumption::Refused(refusal)),
            }
            let updated = match how {
                ConsumeAs::Approved => tx
                    .query_opt(
                        &format!(
                            "UPDATE approvals SET state = 'consumed', consumed_ms = $2, intent_id = $3 \
                             WHERE id = $1 AND state = 'approved' RETURNING {APPROVAL_COLUMNS}"
                        ),
                        &[&id, &now_sql, &intent.id],
                    )
                    .await
                    .map_err(db)?,
                ConsumeAs::AnsweredInBand { by, .. } => tx
                    .query_opt(
                        &format!(
                            "UPDATE approvals SET state = 'consumed', consumed_ms = $2, intent_id = $3, \
                             decided_by = $4, decided_ms = $2 WHERE id = $1 AND state = 'pending' \
                             RETURNING {APPROVAL_COLUMNS}"
                        ),
                        &[&id, &now_sql, &intent.id, &by],
                    )
                    .await
                    .map_err(db)?,
            };
            let Some(updated) = updated else {
                return Ok(Consumption::Refused(plans::lost_consumption(&record, now)));
            };
            let approval = rows::approval(&updated)?;
            insert_intent(tx, intent, Some(id), now_sql).await?;
            append_in(tx, key, &events).await?;
            let stored = load_intent(tx, &intent.id)
                .await?
                .ok_or_else(|| anyhow!("the intent just written is missing"))?;
            Ok(Consumption::Consumed(Box::new(approval), Box::new(stored)))
        })
    }

    fn waiting(&self, now_ms: u64) -> anyhow::Result<Waiting> {
        let now = ms_to_sql(now_ms)?;
        self.read("counting what waits", async |c| {
            let row = c
                .query_one(crate::approvals::WAITING_SQL, &[&now])
                .await
                .map_err(db)?;
            rows::waiting(&row)
        })
    }
}

impl Intents for PostgresStore {
    fn create_intent(&self, intent: &NewIntent, events: Vec<NewEvent>) -> anyhow::Result<()> {
        let now = ms_to_sql(now_ms())?;
        self.transact("recording an intent", &events, async |tx| {
            insert_intent(tx, intent, None, now).await
        })
    }

    fn set_intent_state(
        &self,
        id: &str,
        state: IntentState,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<()> {
        self.finish_intent(id, state, events, Vec::new(), Vec::new())
    }

    fn finish_intent(
        &self,
        id: &str,
        state: IntentState,
        events: Vec<NewEvent>,
        observations: Vec<NewObservation>,
        handles: Vec<IntentHandle>,
    ) -> anyhow::Result<()> {
        let now = ms_to_sql(now_ms())?;
        let handles = plans::handles_text(state, &handles)?;
        self.transact("recording an intent's outcome", &events, async |tx| {
            write_observations(tx, &observations).await?;
            let n = tx
                .execute(
                    "UPDATE intents SET state = $2, updated_ms = $3, handles = $4 WHERE id = $1 AND state = 'prepared'",
                    &[&id, &state.as_str(), &now, &handles],
                )
                .await
                .map_err(db)?;
            if n != 1 {
                return Err(plans::not_prepared(id));
            }
            // An unknown outcome leaves the attempt where it stopped (sent, acknowledged):
            // that is the evidence a reconciler starts from.
            if state != IntentState::Unknown {
                tx.execute(
                    "UPDATE intent_attempts SET state = 'committed', committed_ms = $2 \
                     WHERE intent_id = $1 AND attempt = \
                     (SELECT MAX(attempt) FROM intent_attempts WHERE intent_id = $1)",
                    &[&id, &now],
                )
                .await
                .map_err(db)?;
            }
            Ok(())
        })
    }

    fn intent(&self, id: &str) -> anyhow::Result<Option<IntentRecord>> {
        self.read("reading an intent", async |c| load_intent(c, id).await)
    }

    fn attempt_sending(&self, intent: &str, attempt: u32) -> anyhow::Result<()> {
        let now = ms_to_sql(now_ms())?;
        let attempt_sql = i64::from(attempt);
        // One statement is its own transaction; it writes no trace event, so it takes no
        // lock.
        let n = self.read("recording that a request is being sent", async |c| {
            c.execute(
                "UPDATE intent_attempts SET state = 'sent', requests = requests + 1, \
                 sent_ms = COALESCE(sent_ms, $3) \
                 WHERE intent_id = $1 AND attempt = $2 AND state IN ('prepared', 'sent', 'acknowledged')",
                &[&intent, &attempt_sql, &now],
            )
            .await
            .map_err(db)
        })?;
        if n != 1 {
            bail!("attempt {attempt} of intent `{intent}` cannot send any more");
        }
        Ok(())
    }

    fn attempt_answered(
        &self,
        intent: &str,
        attempt: u32,
        request_id: &str,
        answered: bool,
    ) -> anyhow::Result<()> {
        let now = ms_to_sql(now_ms())?;
        let attempt = i64::from(attempt);
        let answered = i64::from(answered);
        self.read("recording an upstream answer", async |c| {
            c.execute(
                "UPDATE intent_attempts SET \
                   answered = answered + $4, \
                   last_request_id = NULLIF($3, ''), \
                   state = CASE WHEN answered + $4 >= requests THEN 'acknowledged' ELSE 'sent' END, \
                   acknowledged_ms = CASE WHEN answered + $4 >= requests THEN $5 ELSE acknowledged_ms END \
                 WHERE intent_id = $1 AND attempt = $2 AND state IN ('sent', 'acknowledged')",
                &[&intent, &attempt, &request_id, &answered, &now],
            )
            .await
            .map_err(db)?;
            Ok(())
        })
    }

    fn advance_attempt(&self, intent: &str, attempt: u32, to: AttemptState) -> anyhow::Result<()> {
        let now = ms_to_sql(now_ms())?;
        let attempt = i64::from(attempt);
        let sql = format!(
            "UPDATE intent_attempts SET state = $3, {} = $4 WHERE intent_id = $1 AND attempt = $2",
            to.column()
        );
        self.read("recording an attempt's progress", async |c| {
            c.execute(&sql, &[&intent, &attempt, &to.as_str(), &now])
                .await
                .map_err(db)?;
            Ok(())
        })
    }

    fn new_attempt(&self, intent: &str) -> anyhow::Result<u32> {
        let now = ms_to_sql(now_ms())?;
        self.write("recording a new attempt", async |tx| {
            let next: i64 = tx
                .query_one(
                    "SELECT COALESCE(MAX(attempt), 0) + 1 FROM intent_attempts WHERE intent_id = $1",
                    &[&intent],
                )
                .await
                .map_err(db)?
                .get(0);
            insert_attempt(tx, intent, next, now).await?;
            Ok(u32::try_from(next)?)
        })
    }

    fn attempts(&self, intent: &str) -> anyhow::Result<Vec<AttemptRecord>> {
        self.read("reading an intent's attempts", async |c| {
            c.query(
                &format!(
                    "SELECT {ATTEMPT_COLUMNS} FROM intent_attempts WHERE intent_id = $1 ORDER BY attempt"
                ),
                &[&intent],
            )
            .await
            .map_err(db)?
            .iter()
            .map(rows::attempt)
            .collect()
        })
    }

    fn intents(&self, filter: &IntentFilter) -> anyhow::Result<Vec<IntentRecord>> {
        let states: Vec<String> = filter
            .states
            .iter()
            .map(|s| s.as_str().to_owned())
            .collect();
        let before = match filter.created_before_ms {
            Some(ms) => ms_to_sql(ms)?,
            None => i64::MAX,
        };
        let limit = i64::try_from(filter.limit.max(1)).unwrap_or(i64::MAX);
        self.read("listing intents", async |c| {
            c.query(
                &format!(
                    "SELECT {INTENT_COLUMNS} FROM intents \
                     WHERE (cardinality($1::text[]) = 0 OR state = ANY ($1)) \
                       AND ($2::text IS NULL OR mapping = $2) AND created_ms < $3 \
                       AND ($5::text IS NULL OR compensates = $5) \
                     ORDER BY created_ms DESC, id LIMIT $4"
                ),
                &[
                    &states,
                    &filter.mapping,
                    &before,
                    &limit,
                    &filter.compensates,
                ],
            )
            .await
            .map_err(db)?
            .iter()
            .map(rows::intent)
            .collect()
        })
    }

    fn resolve_intent(
        &self,
        id: &str,
        resolution: &Resolution,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<IntentRecord> {
        let text = plans::check_resolution(resolution)?;
        let handles = plans::handles_text(resolution.state, &resolution.handles)?;
        let now = ms_to_sql(now_ms())?;
        self.transact("resolving an intent", &events, async |tx| {
            let current: Option<String> = tx
                .query_opt("SELECT state FROM intents WHERE id = $1 FOR UPDATE", &[&id])
                .await
                .map_err(db)?
                .map(|r| r.get(0));
            plans::check_resolvable(id, current.as_deref())?;
            tx.execute(
                "UPDATE intents SET state = $2, updated_ms = $3, resolution = $4, resolved_ms = $3, \
                 handles = $5 WHERE id = $1",
                &[&id, &resolution.state.as_str(), &now, &text, &handles],
            )
            .await
            .map_err(db)?;
            load_intent(tx, id)
                .await?
                .ok_or_else(|| anyhow!("intent `{id}` vanished"))
        })
    }
}

impl Hosts for PostgresStore {
    fn changes(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        Some(self.changes.subscribe())
    }

    fn is_shared(&self) -> bool {
        true
    }

    fn register_host(&self, instance: &str) -> anyhow::Result<()> {
        let (class, object) = shared::liveness_keys(instance);
        let conn = self
            .pool
            .connect()
            .with_context(|| self.context("registering this host"))?;
        block_on(
            conn.client
                .execute("SELECT pg_advisory_lock($1, $2)", &[&class, &object]),
        )
        .map_err(db)
        .with_context(|| self.context("taking this host's liveness lock"))?;
        *self.liveness.lock().unwrap_or_else(|e| e.into_inner()) = Some(conn.client);
        Ok(())
    }

    fn host_alive(&self, instance: &str) -> anyhow::Result<bool> {
        let (class, object) = shared::liveness_keys(instance);
        self.read("asking whether a host is alive", async |c| {
            let taken: bool = c
                .query_one("SELECT pg_try_advisory_lock($1, $2)", &[&class, &object])
                .await
                .map_err(db)?
                .get(0);
            if taken {
                // The lock was free: its holder is gone. Give it back at once.
                c.execute("SELECT pg_advisory_unlock($1, $2)", &[&class, &object])
                    .await
                    .map_err(db)?;
            }
            Ok(!taken)
        })
    }

    fn write_references(
        &self,
        scope: &str,
        put: &[shared::SharedReference],
        drop: &[String],
    ) -> anyhow::Result<()> {
        let now = ms_to_sql(now_ms())?;
        let mut tokens = Vec::with_capacity(put.len());
        let mut kinds = Vec::with_capacity(put.len());
        let mut mappings = Vec::with_capacity(put.len());
        let mut revisions = Vec::with_capacity(put.len());
        let mut locators = Vec::with_capacity(put.len());
        let mut facts = Vec::with_capacity(put.len());
        let mut expires = Vec::with_capacity(put.len());
        for r in put {
            if r.scope != scope {
                bail!(
                    "a reference of scope {} written under scope {scope}",
                    r.scope
                );
            }
            tokens.push(r.token_sha256.clone());
            kinds.push(r.kind.clone());
            mappings.push(r.mapping.clone());
            revisions.push(r.revision);
            locators.push(r.locator.clone());
            facts.push(serde_json::Value::Object(r.facts.clone()).to_string());
            expires.push(ms_to_sql(r.expires_ms)?);
        }
        let drop = drop.to_vec();
        let mut lease = self.pool.get()?;
        let Conn { client, statements } = lease.conn();
        block_on(async {
            let tx = client.transaction().await.map_err(db)?;
            let sql = Sql { c: &tx, statements };
            if !drop.is_empty() {
                sql.execute(
                    "DELETE FROM reference_bindings WHERE scope = $1 AND token_sha256 = ANY($2)",
                    &[&scope, &drop],
                )
                .await
                .map_err(db)?;
            }
            sql.execute(
                "DELETE FROM reference_bindings WHERE scope = $1 AND expires_ms < $2",
                &[&scope, &now],
            )
            .await
            .map_err(db)?;
            if !tokens.is_empty() {
                // One statement for the whole batch; a token already there keeps its row
                // (and its scope): only its expiry moves, and only within its own scope.
                sql.execute(
                    "INSERT INTO reference_bindings (token_sha256, scope, kind, mapping, \
                     revision, locator, facts, expires_ms, created_ms) \
                     SELECT t, $1, k, m, r, l, f, e, $9 FROM UNNEST($2::text[], $3::text[], \
                     $4::text[], $5::bigint[], $6::text[], $7::text[], $8::bigint[]) \
                     AS u(t, k, m, r, l, f, e) \
                     ON CONFLICT (token_sha256) DO UPDATE SET expires_ms = EXCLUDED.expires_ms \
                     WHERE reference_bindings.scope = EXCLUDED.scope",
                    &[
                        &scope, &tokens, &kinds, &mappings, &revisions, &locators, &facts,
                        &expires, &now,
                    ],
                )
                .await
                .map_err(db)?;
            }
            tx.commit().await.map_err(db)?;
            Ok::<_, anyhow::Error>(())
        })
        .with_context(|| self.context("writing references"))
    }

    fn find_reference(
        &self,
        scope: &str,
        token_sha256: &str,
    ) -> anyhow::Result<Option<shared::SharedReference>> {
        self.read("reading a reference", async |c| {
            let Some(row) = c
                .query_opt(
                    "SELECT kind, mapping, revision, locator, facts, expires_ms \
                     FROM reference_bindings WHERE token_sha256 = $1 AND scope = $2",
                    &[&token_sha256, &scope],
                )
                .await
                .map_err(db)?
            else {
                return Ok(None);
            };
            let facts = match rows::json(&row, 4)? {
                serde_json::Value::Object(m) => m,
                other => bail!("reference facts are not an object: {other}"),
            };
            Ok(Some(shared::SharedReference {
                token_sha256: token_sha256.to_owned(),
                scope: scope.to_owned(),
                kind: row.try_get(0).map_err(db)?,
                mapping: row.try_get(1).map_err(db)?,
                revision: row.try_get(2).map_err(db)?,
                locator: row.try_get(3).map_err(db)?,
                facts,
                expires_ms: rows::ms(&row, 5)?,
            }))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_recognized_and_hostile_ones_refused_without_echoing_a_password() {
        for t in [
            "postgres://a@localhost/db",
            "postgresql:///db?host=/tmp",
            "host=/run/postgresql dbname=airlock",
            "  dbname=x host=localhost",
        ] {
            assert!(is_postgres_target(t), "{t}");
        }
        for t in [
            "",
            "state",
            "/var/lib/airlock",
            "sqlite",
            "C:\\x",
            "=x",
            "Host=x",
        ] {
            assert!(!is_postgres_target(t), "{t}");
        }
        for (t, says) in [
            (
                "postgres://u:hunter2@[::1/db",
                "not a PostgreSQL connection string",
            ),
            (
                "host=/tmp dbname='unterminated hunter2",
                "not a PostgreSQL connection string",
            ),
            ("postgres://u:hunter2@localhost/db?sslmode=require", "TLS"),
            (
                "host=/tmp nonsense=hunter2",
                "not a PostgreSQL connection string",
            ),
            ("dbname=x password=hunter2", "names no host"),
        ] {
            let err = format!("{:#}", parse_target(t).unwrap_err());
            assert!(err.contains(says), "{t}: {err}");
            assert!(!err.contains("hunter2"), "{t}: the password in {err}");
        }
        let config = parse_target("postgres://u:hunter2@localhost:5433/db").unwrap();
        assert_eq!(describe(&config), "u@localhost:5433/db");
        assert_eq!(config.get_connect_timeout(), Some(&CONNECT_TIMEOUT));
    }

    #[test]
    fn an_unreachable_server_is_named_without_its_password_and_fails_fast() {
        let dir = tempfile::tempdir().unwrap();
        let target = format!(
            "host={} port=5999 user=u password=hunter2 dbname=db",
            dir.path().display()
        );
        let start = std::time::Instant::now();
        let err = format!(
            "{:#}",
            PostgresStore::open(&target, None, None).unwrap_err()
        );
        assert!(err.contains("cannot reach the PostgreSQL store"), "{err}");
        assert!(err.contains(&dir.path().display().to_string()), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(5));
    }
}
