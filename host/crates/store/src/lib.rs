//! The state store: connections and their configuration revisions, snapshots, mapping
//! revisions and the trace, in one embedded SQLite database (`airlock.db`, WAL mode) under
//! the state directory, or in a PostgreSQL database shared by several hosts ([`postgres`]).
//! Everything else opens it with [`open`] (the one place that decides which, from a
//! [`Target`]) and reaches it through the [`Store`] trait, so callers do not know which. The
//! trait is split by concern ([`Connections`], [`Snapshots`], [`Mappings`],
//! [`ContractReviews`], [`Trace`], [`Approvals`], [`Intents`], [`Hosts`]); a caller imports the ones it calls. Every write
//! rule is a pure plan ([`plans`]) and every row is read by one parser, both backends
//! sharing them; each backend only runs them in its own SQL.
//!
//! The rules this module enforces:
//! - **The trace is append-only, MACed and chained.** [`Store`] has no method that updates
//!   or deletes a trace event, and database triggers refuse `UPDATE`/`DELETE` on the table.
//!   Each event carries an HMAC-SHA256 under the host key ([`key`]) of its exact stored
//!   bytes and of the previous event's MAC; [`Trace::verify_trace`] recomputes the chain and
//!   names the first event that was edited, unlinked, removed, reordered or recomputed
//!   without the key, and [`Trace::verify_trace_against`] checks the head against
//!   checkpoints kept outside the database (deleted newest events, a deleted trace).
//! - **The state folder and database are private** ([`airlock_core::private_fs`]): owned by this
//!   user, writable by no one else, never a symbolic link (nor the `-wal`, `-shm` and
//!   `-journal` files beside the database, nor the key file). A refusal writes nothing.
//! - **Snapshots are immutable and content-addressed.** A body is stored once per digest and
//!   never rewritten (a trigger refuses updates); offering a different body, connection or
//!   configuration revision under an existing digest is an error. Each sighting is recorded
//!   as its own observation row with its own time.
//! - **A database this build cannot trust is refused and never modified.** A file that is not
//!   a SQLite database or fails `PRAGMA quick_check`, a database written by a newer schema
//!   (`PRAGMA user_version` above [`SCHEMA_VERSION`]), or a SQLite database holding tables
//!   but no Airlock schema version is checked through a read-only connection *before* the
//!   journal mode is switched or any migration runs, and opening fails with a message that
//!   says nothing was changed.
//!
//! Accepted forms: a state directory (created with mode 0700 when missing) holding
//! [`DATABASE_FILE`] and the key file [`key::KEY_FILE`], or an explicit database file path
//! (its folder is the state folder). A missing or empty file becomes a new database
//! (created with mode 0600). Schema upgrades are versioned migrations
//! driven by `PRAGMA user_version`, each applied in its own transaction.
//!
//! Connection settings: WAL journal, `synchronous=NORMAL`, foreign keys on, a 5 s busy
//! timeout, the query planner stability guarantee (a cached statement keeps its plan), and write transactions that take the write lock up front (`BEGIN IMMEDIATE`), so
//! several processes (a running `airlock serve` and `airlock review approve`) can share one
//! database. Times are unix milliseconds.
//!
//! Crates: this one uses only `airlock-core` among Airlock's crates, and nothing that runs
//! Wasm, speaks MCP or evaluates policy (`cargo test -p airlock-store` builds without
//! wasmtime, rmcp or cedar); everything above it uses it (as `airlock::store`).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, anyhow, bail};
use rusqlite::{Connection, OpenFlags, OptionalExtension, TransactionBehavior, params};

pub mod approvals;
pub mod archive;
pub mod contracts;
pub mod intents;
pub mod journal;
pub mod key;
pub mod observations;
pub mod plans;
pub mod postgres;
mod rows;
pub mod shared;
pub mod target;
pub mod trace;
mod wal_checkpoint;

pub use approvals::{
    ApprovalDecision, ApprovalMode, ApprovalRecord, ApprovalState, ConsumeAs, Consumption,
    IntentHandle, IntentRecord, IntentState, NewApproval, NewIntent, ReceiptBinding,
    ReceiptRefusal, Waiting,
};
pub use contracts::{ContractRecord, ContractReviews, ContractState, NewContractApproval};
pub use intents::{AttemptRecord, AttemptState, IntentFilter, Resolution, ResolutionMethod};
pub use key::{Checkpoint, KeySource, TraceKey};
pub use observations::{NewObservation, observation_id};
pub use postgres::PostgresStore;
pub use target::{Target, open};
pub use trace::NewEvent;

/// Schema version this build writes and understands (`PRAGMA user_version`).
pub const SCHEMA_VERSION: i64 = 14;

/// File name of the database inside the state directory.
pub const DATABASE_FILE: &str = "airlock.db";

/// `prev_hash` of the first trace event: 64 zeros.
const GENESIS_HASH: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// How long a statement waits for another connection's lock before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Shortest snapshot digest prefix accepted by [`Snapshots::snapshot`].
const MIN_PREFIX: usize = 8;

/// Migration `i` takes the schema from version `i` to version `i + 1`.
const MIGRATIONS: &[&str] = &[
    // 0 → 1: connections, snapshots, mappings, trace.
    r#"
CREATE TABLE connections (
    connection_id TEXT PRIMARY KEY,
    name          TEXT NOT NULL UNIQUE,
    first_seen_ms INTEGER NOT NULL
) STRICT;

CREATE TABLE connection_revisions (
    connection_id TEXT NOT NULL REFERENCES connections (connection_id),
    revision      INTEGER NOT NULL CHECK (revision >= 1),
    config_digest TEXT NOT NULL,
    config        TEXT NOT NULL,
    created_ms    INTEGER NOT NULL,
    PRIMARY KEY (connection_id, revision),
    UNIQUE (connection_id, config_digest)
) STRICT;

CREATE TABLE snapshots (
    digest          TEXT PRIMARY KEY,
    connection_id   TEXT NOT NULL,
    config_revision INTEGER NOT NULL,
    body            TEXT NOT NULL,
    first_seen_ms   INTEGER NOT NULL,
    FOREIGN KEY (connection_id, config_revision)
        REFERENCES connection_revisions (connection_id, revision)
) STRICT;
CREATE INDEX snapshots_by_connection ON snapshots (connection_id);

CREATE TRIGGER snapshots_are_immutable BEFORE UPDATE ON snapshots
BEGIN
    SELECT RAISE(ABORT, 'snapshots are immutable');
END;

CREATE TABLE snapshot_observations (
    id             INTEGER PRIMARY KEY,
    digest         TEXT NOT NULL REFERENCES snapshots (digest),
    observed_at_ms INTEGER NOT NULL
) STRICT;
CREATE INDEX snapshot_observations_by_digest ON snapshot_observations (digest);

CREATE TABLE mappings (
    name             TEXT NOT NULL,
    revision         INTEGER NOT NULL CHECK (revision >= 1),
    manifest_digest  TEXT NOT NULL,
    component_sha256 TEXT NOT NULL,
    connection_id    TEXT NOT NULL,
    config_revision  INTEGER NOT NULL,
    snapshot_digest  TEXT,
    pins             TEXT NOT NULL,
    state            TEXT NOT NULL CHECK (state IN ('candidate', 'fixture-tested', 'limited',
                         'active', 'degraded', 'review-required', 'retiring', 'historical')),
    reviewer         TEXT,
    reason           TEXT NOT NULL,
    created_ms       INTEGER NOT NULL,
    state_changed_ms INTEGER NOT NULL,
    PRIMARY KEY (name, revision)
) STRICT;

CREATE TABLE trace_events (
    seq       INTEGER PRIMARY KEY,
    at_ms     INTEGER NOT NULL,
    kind      TEXT NOT NULL,
    subject   TEXT NOT NULL,
    payload   TEXT NOT NULL,
    prev_hash TEXT NOT NULL,
    hash      TEXT NOT NULL
) STRICT;

CREATE TRIGGER trace_events_no_update BEFORE UPDATE ON trace_events
BEGIN
    SELECT RAISE(ABORT, 'trace events are append-only');
END;
CREATE TRIGGER trace_events_no_delete BEFORE DELETE ON trace_events
BEGIN
    SELECT RAISE(ABORT, 'trace events are append-only');
END;
"#,
    // 1 → 2: each mapping revision keeps the manifest text it was recorded from, so a
    // reviewer can diff grants and limits between revisions (`airlock grants --diff`).
    r#"
ALTER TABLE mappings ADD COLUMN manifest_text TEXT;
"#,
    // 2 → 3: approvals (requests and the receipts they become) and intents. A receipt is
    // consumed in the same transaction that creates the intent it authorizes (UNIQUE
    // approval_id), so one receipt authorizes at most one intent.
    r#"
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
    mapping_revision INTEGER NOT NULL,
    snapshot_digest  TEXT NOT NULL,
    policy_digest    TEXT NOT NULL,
    args_digest      TEXT NOT NULL,
    artifact_digest  TEXT,
    summary          TEXT NOT NULL,
    nonce            TEXT NOT NULL,
    created_ms       INTEGER NOT NULL,
    expires_ms       INTEGER NOT NULL,
    decided_by       TEXT,
    decided_ms       INTEGER,
    reason           TEXT,
    consumed_ms      INTEGER,
    intent_id        TEXT UNIQUE
) STRICT;
CREATE INDEX approvals_by_binding ON approvals (requester, session, capability, args_digest);
CREATE INDEX approvals_by_state ON approvals (state);

CREATE TABLE intents (
    id               TEXT PRIMARY KEY,
    idempotency_key  TEXT NOT NULL UNIQUE,
    call_id          TEXT NOT NULL,
    approval_id      TEXT UNIQUE REFERENCES approvals (id),
    requester        TEXT NOT NULL,
    session          TEXT NOT NULL,
    capability       TEXT NOT NULL,
    mapping          TEXT NOT NULL,
    mapping_revision INTEGER NOT NULL,
    args_digest      TEXT NOT NULL,
    effect_class     TEXT NOT NULL,
    state            TEXT NOT NULL CHECK (state IN ('prepared', 'completed', 'failed', 'unknown')),
    created_ms       INTEGER NOT NULL,
    updated_ms       INTEGER NOT NULL
) STRICT;
"#,
    // 3 → 4: finding the open approval of a binding reads only open approvals, newest
    // first, however many consumed ones the binding has (repeated identical calls).
    r#"
CREATE INDEX approvals_open_by_binding
    ON approvals (requester, session, capability, args_digest, created_ms)
    WHERE state IN ('pending', 'approved');
"#,
    // 4 → 5: the attempts of an intent, each state written when it becomes true
    // (DESIGN.md §5.8), and how an intent whose outcome was unknown was resolved.
    r#"
CREATE TABLE intent_attempts (
    intent_id        TEXT NOT NULL REFERENCES intents (id),
    attempt          INTEGER NOT NULL CHECK (attempt >= 1),
    state            TEXT NOT NULL CHECK (state IN ('prepared', 'sent', 'acknowledged',
                         'result-observed', 'receipt-verified', 'committed')),
    requests         INTEGER NOT NULL DEFAULT 0,
    answered         INTEGER NOT NULL DEFAULT 0,
    last_request_id  TEXT,
    prepared_ms      INTEGER NOT NULL,
    sent_ms          INTEGER,
    acknowledged_ms  INTEGER,
    observed_ms      INTEGER,
    verified_ms      INTEGER,
    committed_ms     INTEGER,
    PRIMARY KEY (intent_id, attempt)
) STRICT;
ALTER TABLE intents ADD COLUMN resolution TEXT;
ALTER TABLE intents ADD COLUMN resolved_ms INTEGER;
CREATE INDEX intents_open ON intents (mapping, created_ms) WHERE state IN ('prepared', 'unknown');
"#,
    // 5 → 6: observations, one per content item of an accepted upstream answer
    // (store/observations.rs): content-addressed ids, a changed item linked to what it was
    // (`previous`), provenance immutable (only last_seen_ms and seen move).
    r#"
CREATE TABLE observations (
    seq              INTEGER PRIMARY KEY,
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
    bytes            INTEGER NOT NULL CHECK (bytes >= 0),
    request_id       TEXT NOT NULL,
    call_id          TEXT NOT NULL,
    retrieved_ms     INTEGER NOT NULL,
    last_seen_ms     INTEGER NOT NULL,
    seen             INTEGER NOT NULL CHECK (seen >= 1),
    previous         TEXT REFERENCES observations (id)
) STRICT;
CREATE INDEX observations_by_identity
    ON observations (connection_id, method, target, arguments_sha256, item, last_seen_ms);
CREATE TRIGGER observations_keep_provenance
    BEFORE UPDATE OF seq, id, connection_id, connection, snapshot_digest, method, target,
        arguments_sha256, item, kind, media_type, sha256, bytes, request_id, call_id,
        retrieved_ms, previous
    ON observations
BEGIN
    SELECT RAISE(ABORT, 'an observation''s provenance is immutable');
END;
CREATE TRIGGER observations_no_delete BEFORE DELETE ON observations
BEGIN
    SELECT RAISE(ABORT, 'observations are not deleted');
END;
"#,
    // 6 → 7: trace events are MACed with the host key (store/key.rs): `key_id` names the
    // key; events written before stay unkeyed (NULL) and are pinned by the `trace-keyed`
    // event the store appends right after this migration, whose MAC covers their head.
    // The partial index finds the events that prove a mapping's serving state (see
    // Trace::mapping_proofs) without a scan; other events do not enter it.
    r#"
ALTER TABLE trace_events ADD COLUMN key_id TEXT;
CREATE INDEX trace_events_mapping_proofs ON trace_events (subject, seq)
    WHERE kind IN ('mapping-revision', 'mapping-state-changed', 'trace-keyed');
"#,
    // 7 → 8: the events that prove an approval (Trace::approval_proofs) or an intent
    // (Trace::intent_proofs) are found by the id their payload names, without a scan;
    // other events do not enter these indexes.
    r#"
CREATE INDEX trace_events_approval_proofs
    ON trace_events (json_extract(payload, '$.approval'), seq)
    WHERE kind IN ('approval-requested', 'approval-decided', 'receipt-consumed');
CREATE INDEX trace_events_intent_proofs
    ON trace_events (json_extract(payload, '$.intent'), seq)
    WHERE kind = 'intent-created';
"#,
    // 8 → 9: the events that change an intent's state after its creation carry
    // `intent_state` (Trace::intent_proofs, Trace::intents_open_in_trace_only); this index
    // finds them by the intent their payload names. Reads' outcome events, which name an
    // intent but change none, stay out of it.
    r#"
CREATE INDEX trace_events_intent_states
    ON trace_events (json_extract(payload, '$.intent'), seq)
    WHERE kind IN ('call-outcome', 'call-refused', 'intent-resolved', 'intent-held')
    AND json_extract(payload, '$.intent_state') IS NOT NULL;
"#,
    // 9 → 10: the trace journals (store/journal.rs): a call's events are durable in a
    // journal file before its answer and moved into the trace after it; each journal's
    // row says how many of its bytes are in the trace (advanced in the transaction that
    // moves them: exactly once) and, once no record follows, its final size.
    r#"
CREATE TABLE trace_journals (
    id         INTEGER PRIMARY KEY,
    name       TEXT NOT NULL UNIQUE,
    ingested   INTEGER NOT NULL CHECK (ingested >= 0),
    sealed     INTEGER CHECK (sealed >= 0),
    created_ms INTEGER NOT NULL
) STRICT;
"#,
    // 10 → 11: contract reviews (contracts.rs): one row per operator contract package,
    // pinned by digest; the digest and files of a review never change (a trigger refuses
    // it), only its state may move from approved to erroneous. The events that prove a
    // review are found by the package they name (`subject`), without a scan.
    r#"
CREATE TABLE contract_reviews (
    package          TEXT PRIMARY KEY,
    digest           TEXT NOT NULL,
    state            TEXT NOT NULL CHECK (state IN ('approved', 'erroneous')),
    reviewer         TEXT NOT NULL,
    reason           TEXT NOT NULL,
    files            TEXT NOT NULL,
    created_ms       INTEGER NOT NULL,
    state_changed_ms INTEGER NOT NULL
) STRICT;
CREATE TRIGGER contract_reviews_keep_digest BEFORE UPDATE OF package, digest, files, created_ms
    ON contract_reviews
    BEGIN SELECT RAISE(ABORT, 'a contract review''s digest and files are immutable'); END;
CREATE TRIGGER contract_reviews_no_delete BEFORE DELETE ON contract_reviews
    BEGIN SELECT RAISE(ABORT, 'contract reviews are not deleted'); END;
CREATE INDEX trace_events_contract_proofs ON trace_events (subject, seq)
    WHERE kind IN ('contract-approved', 'contract-marked-erroneous');
"#,
    // 11 → 12: compensation (plans.rs): an intent may compensate another (fixed at
    // creation; one open or completed compensation per intent), and a completed
    // compensable effect keeps the handles its result carried, written once.
    r#"
ALTER TABLE intents ADD COLUMN compensates TEXT REFERENCES intents (id);
ALTER TABLE intents ADD COLUMN handles TEXT;
CREATE UNIQUE INDEX intents_one_compensation ON intents (compensates)
    WHERE compensates IS NOT NULL AND state <> 'failed';
CREATE TRIGGER intents_keep_compensates BEFORE UPDATE OF compensates ON intents
    WHEN OLD.compensates IS NOT NEW.compensates
    BEGIN SELECT RAISE(ABORT, 'what an intent compensates never changes'); END;
CREATE TRIGGER intents_handles_once BEFORE UPDATE OF handles ON intents
    WHEN OLD.handles IS NOT NULL AND NEW.handles IS NOT OLD.handles
    BEGIN SELECT RAISE(ABORT, 'an intent''s handles are written once'); END;
"#,
    // 12 → 13: trace retention (archive.rs). Archived events may be deleted, and only
    // they: the trigger refuses deleting any event after the newest `trace-archived`
    // event's range. The partial index finds that event without a scan.
    r#"
CREATE INDEX trace_events_archives ON trace_events (seq) WHERE kind = 'trace-archived';
DROP TRIGGER trace_events_no_delete;
CREATE TRIGGER trace_events_no_delete BEFORE DELETE ON trace_events
    WHEN OLD.seq > coalesce((SELECT json_extract(payload, '$.to_seq') FROM trace_events
        WHERE kind = 'trace-archived' ORDER BY seq DESC LIMIT 1), 0)
BEGIN
    SELECT RAISE(ABORT, 'trace events are append-only: only archived events may be deleted');
END;
"#,
    // 13 → 14: a connection's newest state change (Trace::connection_state, `airlock
    // status`) without a scan.
    r#"
CREATE INDEX trace_events_connection_states ON trace_events (subject, seq)
    WHERE kind = 'connection-state';
"#,
];

/// Columns of `contract_reviews`, in [`rows::contract`]'s order.
pub(crate) const CONTRACT_COLUMNS: &str =
    "package, digest, state, reviewer, reason, files, created_ms, state_changed_ms";

/// The SQL (SQLite) of [`Trace::intent_proofs`]: both terms of each half repeat an
/// expression index's definition word for word (`trace_events_intent_proofs`, migration
/// 8; `trace_events_intent_states`, migration 9), so each half reads its index.
fn intent_proofs_sql() -> String {
    format!(
        "SELECT {TRACE_COLUMNS} FROM trace_events \
         WHERE kind = 'intent-created' AND json_extract(payload, '$.intent') = ?1 \
         UNION ALL \
         SELECT {TRACE_COLUMNS} FROM trace_events \
         WHERE kind IN ('call-outcome', 'call-refused', 'intent-resolved', 'intent-held') \
         AND json_extract(payload, '$.intent_state') IS NOT NULL \
         AND json_extract(payload, '$.intent') = ?1 \
         ORDER BY seq"
    )
}

/// The SQL (SQLite) of [`Trace::intents_open_in_trace_only`]: the intents of mapping `?1`
/// whose `intent-created` event carries `intent_state`, which no state event closes, and
/// whose row is missing or not open.
/// `INDEXED BY`: on a young trace the planner would rather scan the whole table than walk
/// the partial index of creations; the trace grows with every call, the index only with
/// effects.
fn intents_open_in_trace_only_sql() -> &'static str {
    "SELECT json_extract(c.payload, '$.intent') \
     FROM trace_events AS c INDEXED BY trace_events_intent_proofs \
     WHERE c.kind = 'intent-created' AND json_extract(c.payload, '$.mapping') = ?1 \
     AND json_extract(c.payload, '$.intent_state') IS NOT NULL \
     AND NOT EXISTS (SELECT 1 FROM trace_events e \
         WHERE e.kind IN ('call-outcome', 'call-refused', 'intent-resolved', 'intent-held') \
         AND json_extract(e.payload, '$.intent_state') IS NOT NULL \
         AND json_extract(e.payload, '$.intent') = json_extract(c.payload, '$.intent') \
         AND json_extract(e.payload, '$.intent_state') IN ('completed', 'failed')) \
     AND NOT EXISTS (SELECT 1 FROM intents i \
         WHERE i.id = json_extract(c.payload, '$.intent') AND i.state IN ('prepared', 'unknown')) \
     ORDER BY c.seq LIMIT ?2"
}

/// Kind of the event that starts the keyed part of a trace migrated from schema 6: its
/// payload names how many unkeyed events precede it and their head hash, and its MAC
/// covers that head.
pub const TRACE_KEYED: &str = "trace-keyed";

/// The newest `trace-archived` event (SQLite), through the partial index
/// `trace_events_archives` (the kind term repeats its WHERE clause).
const NEWEST_MARK_SQL: &str = "SELECT seq, at_ms, kind, subject, payload, prev_hash, hash, key_id \
     FROM trace_events WHERE kind = 'trace-archived' ORDER BY seq DESC LIMIT 1";

/// The SQLite store's side of an archive pass ([`archive::ArchiveBackend`]).
struct SqliteArchive<'s>(&'s SqliteStore);

impl archive::ArchiveBackend for SqliteArchive<'_> {
    fn newest_mark_event(&self) -> anyhow::Result<Option<StoredEvent>> {
        let conn = self.0.lock_all_moved()?;
        Ok(conn
            .prepare_cached(NEWEST_MARK_SQL)?
            .query_row([], |r| rows::stored_event(r))
            .optional()?)
    }

    fn events_after(
        &self,
        after: i64,
        through: i64,
        limit: i64,
    ) -> anyhow::Result<Vec<StoredEvent>> {
        let conn = self.0.lock();
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT {TRACE_COLUMNS} FROM trace_events WHERE seq > ?1 AND seq <= ?2 \
             ORDER BY seq LIMIT ?3"
        ))?;
        let events = stmt
            .query_map(params![after, through, limit], |r| rows::stored_event(r))?
            .collect::<rusqlite::Result<_>>()?;
        Ok(events)
    }

    fn times_after(&self, after: i64, limit: i64) -> anyhow::Result<Vec<(i64, i64)>> {
        let conn = self.0.lock();
        let mut stmt = conn.prepare_cached(
            "SELECT seq, at_ms FROM trace_events WHERE seq > ?1 ORDER BY seq LIMIT ?2",
        )?;
        let times = stmt
            .query_map(params![after, limit], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<rusqlite::Result<_>>()?;
        Ok(times)
    }

    fn head_seq(&self) -> anyhow::Result<i64> {
        let conn = self.0.lock();
        Ok(conn
            .prepare_cached("SELECT coalesce(max(seq), 0) FROM trace_events")?
            .query_row([], |r| r.get(0))?)
    }

    fn events_at(&self, seqs: &[i64]) -> anyhow::Result<Vec<StoredEvent>> {
        let conn = self.0.lock();
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT {TRACE_COLUMNS} FROM trace_events \
             WHERE seq IN (SELECT value FROM json_each(?1)) ORDER BY seq"
        ))?;
        let events = stmt
            .query_map(params![serde_json::to_string(seqs)?], |r| {
                rows::stored_event(r)
            })?
            .collect::<rusqlite::Result<_>>()?;
        Ok(events)
    }

    fn needs(&self, now_ms: u64) -> anyhow::Result<archive::Needs> {
        let conn = self.0.lock();
        let ids =
            |sql: &str, now: Option<i64>| -> rusqlite::Result<std::collections::HashSet<String>> {
                let mut stmt = conn.prepare_cached(sql)?;
                match now {
                    Some(now) => stmt.query_map(params![now], |r| r.get(0))?.collect(),
                    None => stmt.query_map([], |r| r.get(0))?.collect(),
                }
            };
        Ok(archive::Needs {
            approvals: ids(
                "SELECT id FROM approvals WHERE state IN ('pending', 'approved') \
                 OR expires_ms > ?1 \
                 OR intent_id IN (SELECT id FROM intents WHERE state IN ('prepared', 'unknown'))",
                Some(ms_to_sql(now_ms)?),
            )?,
            intents: ids(
                "SELECT id FROM intents WHERE state IN ('prepared', 'unknown')",
                None,
            )?,
        })
    }

    fn intent_closed_in_trace(&self, id: &str) -> anyhow::Result<bool> {
        let conn = self.0.lock();
        // The terms repeat the index trace_events_intent_states' definition.
        let closed: Option<i64> = conn
            .prepare_cached(
                "SELECT 1 FROM trace_events \
                 WHERE kind IN ('call-outcome', 'call-refused', 'intent-resolved', 'intent-held') \
                 AND json_extract(payload, '$.intent_state') IS NOT NULL \
                 AND json_extract(payload, '$.intent') = ?1 \
                 AND json_extract(payload, '$.intent_state') IN ('completed', 'failed') LIMIT 1",
            )?
            .query_row(params![id], |r| r.get(0))
            .optional()?;
        Ok(closed.is_some())
    }

    fn append_mark(
        &self,
        previous: Option<i64>,
        mark: &archive::ArchiveMark,
    ) -> anyhow::Result<i64> {
        let mut conn = self.0.lock_in_order()?;
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let newest: Option<i64> = tx
            .prepare_cached(NEWEST_MARK_SQL)?
            .query_row([], |r| r.get(0))
            .optional()?;
        if newest != previous {
            bail!(
                "another process archived the trace meanwhile (its newest mark is now event \
                 {newest:?}); this pass's segment {} will be replaced by the next pass",
                mark.segment
            );
        }
        let event = NewEvent::new(
            archive::TRACE_ARCHIVED,
            "trace",
            serde_json::to_value(mark)?,
        );
        let (seq, _) =
            trace::append_in(&tx, &self.0.key, &[event])?.context("appending the archive mark")?;
        tx.commit()?;
        Ok(seq)
    }

    fn delete_archived(&self, to_seq: i64, kept: &[i64], limit: i64) -> anyhow::Result<u64> {
        let mut conn = self.0.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let n = tx
            .prepare_cached(
                "DELETE FROM trace_events WHERE seq IN (SELECT seq FROM trace_events \
             WHERE seq <= ?1 AND seq NOT IN (SELECT value FROM json_each(?2)) \
             ORDER BY seq LIMIT ?3)",
            )?
            .execute(params![to_seq, serde_json::to_string(kept)?, limit])?;
        tx.commit()?;
        Ok(n as u64)
    }

    fn reclaim(&self) -> anyhow::Result<u64> {
        let (mode, page): (i64, i64) = {
            let conn = self.0.lock();
            (
                conn.pragma_query_value(None, "auto_vacuum", |r| r.get(0))?,
                conn.pragma_query_value(None, "page_size", |r| r.get(0))?,
            )
        };
        if mode != 2 {
            // Not incremental: the freed pages are reused by new events instead.
            return Ok(0);
        }
        let mut pages = 0i64;
        loop {
            let conn = self.0.lock();
            let free: i64 = conn.pragma_query_value(None, "freelist_count", |r| r.get(0))?;
            if free == 0 {
                break;
            }
            let step = free.min(RECLAIM_PAGES);
            conn.execute_batch(&format!("PRAGMA incremental_vacuum({step})"))?;
            pages += step;
        }
        Ok(u64::try_from(pages * page).unwrap_or(0))
    }
}

/// Pages an incremental vacuum step gives back per hold of the connection.
const RECLAIM_PAGES: i64 = 1_000;

/// What the store's refusals suggest instead of fixing the path.
const ELSEWHERE: &str = "or choose another --state-dir";

const _: () = assert!(MIGRATIONS.len() as i64 == SCHEMA_VERSION);

/// Lifecycle states of a mapping revision (DESIGN.md §2). Only [`Limited`](Self::Limited)
/// and [`Active`](Self::Active) serve new calls; see [`MappingState::can_become`] for the
/// allowed transitions.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum MappingState {
    /// Recorded, not yet tested against fixtures.
    Candidate,
    /// Passed its fixtures; does not serve yet.
    FixtureTested,
    /// Serves within its limited scope.
    Limited,
    /// Serves.
    Active,
    /// Temporarily not serving (for example its upstream is failing); may serve again.
    Degraded,
    /// Stopped by meaning-bearing drift; never serves again. Approval creates a new revision.
    ReviewRequired,
    /// Being withdrawn; only becomes historical.
    Retiring,
    /// Final: superseded or withdrawn.
    Historical,
}

impl MappingState {
    /// Every state, in lifecycle order.
    pub const ALL: [MappingState; 8] = [
        Self::Candidate,
        Self::FixtureTested,
        Self::Limited,
        Self::Active,
        Self::Degraded,
        Self::ReviewRequired,
        Self::Retiring,
        Self::Historical,
    ];

    /// The kebab-case name used in the store, the CLI and trace events
    /// (`"candidate"`, `"fixture-tested"`, … `"historical"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Candidate => "candidate",
            Self::FixtureTested => "fixture-tested",
            Self::Limited => "limited",
            Self::Active => "active",
            Self::Degraded => "degraded",
            Self::ReviewRequired => "review-required",
            Self::Retiring => "retiring",
            Self::Historical => "historical",
        }
    }

    /// Parses the name produced by [`as_str`](Self::as_str); anything else is `None`.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|state| state.as_str() == s)
    }

    /// Whether a mapping revision in this state serves new calls: only `limited` and `active`.
    pub fn serves(self) -> bool {
        matches!(self, Self::Limited | Self::Active)
    }

    /// Whether `self → to` is an allowed transition. A state never "becomes" itself;
    /// `review-required` only moves on to `retiring` or `historical` (approval creates a new
    /// revision instead); `historical` is final.
    pub fn can_become(self, to: Self) -> bool {
        use MappingState::*;
        match self {
            Candidate => matches!(
                to,
                FixtureTested | Limited | Active | ReviewRequired | Retiring | Historical
            ),
            FixtureTested => matches!(
                to,
                Limited | Active | ReviewRequired | Retiring | Historical
            ),
            Limited => matches!(
                to,
                Active | Degraded | ReviewRequired | Retiring | Historical
            ),
            Active => matches!(
                to,
                Limited | Degraded | ReviewRequired | Retiring | Historical
            ),
            Degraded => matches!(
                to,
                Active | Limited | ReviewRequired | Retiring | Historical
            ),
            ReviewRequired => matches!(to, Retiring | Historical),
            Retiring => matches!(to, Historical),
            Historical => false,
        }
    }
}

impl fmt::Display for MappingState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Result of [`Connections::connection_revision`]: the connection's local id and the revision
/// number of the given configuration digest.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ConnectionRevision {
    /// Locally assigned id, `"conn-"` + 12 lowercase hex; stable for the connection name.
    pub connection_id: String,
    /// Configured connection name.
    pub name: String,
    /// Configuration revision, 1-based.
    pub revision: i64,
    /// Digest of the configuration this revision stands for.
    pub config_digest: String,
    /// True when this digest was new for the connection (a revision was created now).
    pub created: bool,
}

/// A connection with its latest configuration revision.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ConnectionRecord {
    /// Locally assigned id (`"conn-"` + 12 lowercase hex).
    pub connection_id: String,
    /// Configured connection name.
    pub name: String,
    /// Latest configuration revision, 1-based.
    pub revision: i64,
    /// Digest of the latest configuration.
    pub config_digest: String,
    /// Safe JSON summary of the latest configuration (no secrets).
    pub config: serde_json::Value,
    /// When the connection name was first seen, unix ms.
    pub first_seen_ms: u64,
}

/// Result of [`Snapshots::put_snapshot`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SnapshotObservation {
    /// The snapshot digest (lowercase hex).
    pub digest: String,
    /// True when the body was stored for the first time by this call.
    pub new: bool,
    /// Time of this observation, unix ms.
    pub observed_at_ms: u64,
}

/// A stored snapshot with its body and observation summary.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StoredSnapshot {
    /// Content digest (lowercase hex).
    pub digest: String,
    /// Connection the snapshot was taken from.
    pub connection_id: String,
    /// Configuration revision of that connection at the time.
    pub config_revision: i64,
    /// The snapshot body, as stored (canonical JSON parsed back).
    pub body: serde_json::Value,
    /// First observation, unix ms.
    pub first_seen_ms: u64,
    /// Latest observation, unix ms.
    pub last_seen_ms: u64,
    /// Number of observations (at least 1).
    pub observations: u64,
}

/// A snapshot without its body, as listed by [`Snapshots::snapshots`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SnapshotSummary {
    /// Content digest (lowercase hex).
    pub digest: String,
    /// Connection the snapshot was taken from.
    pub connection_id: String,
    /// Configuration revision of that connection at the time.
    pub config_revision: i64,
    /// First observation, unix ms.
    pub first_seen_ms: u64,
    /// Latest observation, unix ms.
    pub last_seen_ms: u64,
    /// Number of observations (at least 1).
    pub observations: u64,
}

/// A mapping revision to record with [`Mappings::add_mapping_revision`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct NewMappingRevision {
    /// Mapping name.
    pub name: String,
    /// sha256 (hex) of the reviewed manifest.
    pub manifest_digest: String,
    /// sha256 (hex) of the adapter component.
    pub component_sha256: String,
    /// Connection the mapping is bound to.
    pub connection_id: String,
    /// Configuration revision of that connection the mapping was reviewed against.
    pub config_revision: i64,
    /// Snapshot the pins were taken from, when known.
    pub snapshot_digest: Option<String>,
    /// Pinned tool schema/description digests (JSON, shape owned by the pins module).
    pub pins: serde_json::Value,
    /// Initial lifecycle state.
    pub state: MappingState,
    /// Who approved this revision, when someone did.
    pub reviewer: Option<String>,
    /// Why this revision exists, in words.
    pub reason: String,
    /// The manifest text this revision was recorded from (kept for diffs between
    /// revisions; it holds secret names, never secret values).
    pub manifest_text: Option<String>,
}

/// One stored mapping revision.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MappingRecord {
    /// Mapping name.
    pub name: String,
    /// Revision, 1-based, per name.
    pub revision: i64,
    /// sha256 (hex) of the reviewed manifest.
    pub manifest_digest: String,
    /// sha256 (hex) of the adapter component.
    pub component_sha256: String,
    /// Connection the mapping is bound to.
    pub connection_id: String,
    /// Configuration revision of that connection.
    pub config_revision: i64,
    /// Snapshot the pins were taken from, when known.
    pub snapshot_digest: Option<String>,
    /// Pinned digests (JSON).
    pub pins: serde_json::Value,
    /// Current lifecycle state.
    pub state: MappingState,
    /// Who approved this revision, when someone did.
    pub reviewer: Option<String>,
    /// Reason of the latest state change (or of the revision's creation).
    pub reason: String,
    /// When the revision was recorded, unix ms.
    pub created_ms: u64,
    /// The manifest text this revision was recorded from (`None` for revisions recorded
    /// before schema 2 or without one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub manifest_text: Option<String>,
    /// When the state last changed, unix ms.
    pub state_changed_ms: u64,
}

impl MappingRecord {
    /// For a historical revision: the serving state (`active` or `limited`) it had when a
    /// later revision superseded it, as [`Mappings::add_mapping_revision`] wrote it into the
    /// reason; `None` if it did not serve then or is not historical.
    pub fn superseded_while_serving(&self) -> Option<MappingState> {
        if self.state != MappingState::Historical {
            return None;
        }
        let was = self.reason.rsplit_once("(was ")?.1.strip_suffix(')')?;
        MappingState::parse(was).filter(|s| s.serves())
    }
}

/// One trace event. For an event with a `key_id` (every event this build writes), `hash`
/// is the hex HMAC-SHA256 under the host key of its stored bytes, chained through
/// `prev_hash` ([`key`] has the encoding). For an event written before schema 7 (no
/// `key_id`), `hash` is hex sha256 of the RFC 8785 canonical JSON of
/// `{"seq","at_ms","kind","subject","payload","prev_hash"}`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TraceEvent {
    /// Position in the trace, starting at 1, without gaps.
    pub seq: i64,
    /// When the event was appended, unix ms.
    pub at_ms: u64,
    /// Event kind (DESIGN.md vocabulary, e.g. `"mapping.state"`).
    pub kind: String,
    /// What the event is about (a mapping name, a connection id, …).
    pub subject: String,
    /// Safe summary payload, as stored (canonical JSON parsed back).
    pub payload: serde_json::Value,
    /// Hash of the previous event, or 64 zeros for the first.
    pub prev_hash: String,
    /// MAC of this event (hex HMAC-SHA256), or its unkeyed hash (hex sha256) for an
    /// event written before schema 7.
    pub hash: String,
    /// Id of the key that MACed it (16 hex); `None` for an event written before schema 7.
    pub key_id: Option<String>,
}

/// Result of [`Trace::verify_trace`] and [`Trace::verify_trace_against`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TraceVerification {
    /// Number of events in the trace (in the store).
    pub events: u64,
    /// The newest archived seq: events up to it are in segment files
    /// ([`archive`]), only the kept ones in the store; `None` when nothing was archived.
    pub archived_to: Option<i64>,
    /// Recorded hash of the last event, or 64 zeros for an empty trace.
    pub head: String,
    /// The first bad seq and why, in words; `None` when the whole chain (and every
    /// checkpoint given) verifies.
    pub first_bad: Option<(i64, String)>,
    /// Id of the key the events were checked with (16 hex).
    pub key_id: String,
    /// Where that key came from (a key file, a named secret, the environment).
    pub key_source: String,
    /// How many events (at the start) were written before schema 7, without a MAC.
    pub unkeyed: u64,
    /// How many checkpoints were checked.
    pub checkpoints: u64,
    /// The highest event a verified checkpoint anchors, when one was given.
    pub anchored_seq: Option<i64>,
    /// What the verification covers and what it cannot see, in words (one line each).
    pub coverage: Vec<String>,
}

/// Connection identity: each configured connection's local id and its configuration
/// revisions (DESIGN.md §2 "connection"). A connection's revision follows its
/// configuration digest; nothing here grants anything.
pub trait Connections: Send + Sync {
    /// Connection identity. `name` is the configured connection name. First sight of a name
    /// assigns a local id (`"conn-"` + 12 lowercase hex from the OS random source). A
    /// `config_digest` not seen before for this connection becomes the next revision (1, 2,
    /// …); one seen before returns its existing revision with `created = false` (its stored
    /// config is not replaced). `config` is the safe JSON summary of the configuration.
    /// Errors: empty name or digest, database failure.
    fn connection_revision(
        &self,
        name: &str,
        config_digest: &str,
        config: &serde_json::Value,
    ) -> anyhow::Result<ConnectionRevision>;

    /// The connection named `name` with its latest revision, or `None` when never seen.
    fn connection(&self, name: &str) -> anyhow::Result<Option<ConnectionRecord>>;

    /// Every connection with its latest revision, by name.
    fn connections(&self) -> anyhow::Result<Vec<ConnectionRecord>>;
}

/// Discovery records: immutable, content-addressed snapshots and each sighting of them
/// (the rule: [`plans::snapshot_write`]).
pub trait Snapshots: Send + Sync {
    /// Content-addressed: the body is stored once per digest; every call records an
    /// observation row with its own time. Errors: a digest that is not hex; a connection
    /// revision that does not exist; a digest already stored with a different body,
    /// connection or configuration revision (snapshots are immutable).
    fn put_snapshot(
        &self,
        digest: &str,
        connection_id: &str,
        config_revision: i64,
        body: &serde_json::Value,
    ) -> anyhow::Result<SnapshotObservation>;

    /// Full digest or a unique hex prefix of at least 8 characters (case-insensitive).
    /// `None` when nothing matches. Errors: a prefix that is not hex or shorter than 8
    /// characters (and not a full digest), or one that matches several snapshots (the error
    /// names how many).
    fn snapshot(&self, digest_or_prefix: &str) -> anyhow::Result<Option<StoredSnapshot>>;

    /// The most recently observed snapshot of the connection, or `None`.
    fn latest_snapshot(&self, connection_id: &str) -> anyhow::Result<Option<StoredSnapshot>>;

    /// Snapshots of one connection (or all), newest `last_seen_ms` first.
    fn snapshots(&self, connection_id: Option<&str>) -> anyhow::Result<Vec<SnapshotSummary>>;
}

/// Mapping revisions and their lifecycle states: a new revision supersedes the latest
/// ([`plans::supersede`]); a state changes only by compare-and-set ([`plans::set_state`]).
pub trait Mappings: Send + Sync {
    /// Latest revision of the mapping, or `None` for an unknown name.
    fn mapping(&self, name: &str) -> anyhow::Result<Option<MappingRecord>>;

    /// Every revision of the mapping, oldest first (empty for an unknown name).
    fn mapping_revisions(&self, name: &str) -> anyhow::Result<Vec<MappingRecord>>;

    /// The latest revision of each mapping, by name.
    fn mappings(&self) -> anyhow::Result<Vec<MappingRecord>>;

    /// Inserts revision = previous latest + 1 (1 for a new name). In the same transaction
    /// the previous latest revision, unless already historical, becomes historical (its
    /// reason gains "; superseded by revision N (was STATE)"). Errors: empty name, database
    /// failure.
    fn add_mapping_revision(&self, new: &NewMappingRevision) -> anyhow::Result<MappingRecord> {
        self.add_mapping_revision_traced(new, Vec::new())
    }

    /// [`Mappings::add_mapping_revision`] with `events` appended in the same transaction, each
    /// object payload gaining `"revision": N` (the new revision): the row and the event
    /// that proves it are committed together, or neither.
    fn add_mapping_revision_traced(
        &self,
        new: &NewMappingRevision,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<MappingRecord>;

    /// Compare-and-set on the latest revision: `Ok(Some(record))` after the change;
    /// `Ok(None)` when the latest revision's state is not `expected` (someone else changed
    /// it); `Err` when `expected → to` is not a valid transition or the mapping does not
    /// exist.
    fn set_mapping_state(
        &self,
        name: &str,
        expected: MappingState,
        to: MappingState,
        reason: &str,
    ) -> anyhow::Result<Option<MappingRecord>> {
        self.set_mapping_state_traced(name, expected, to, reason, Vec::new())
    }

    /// [`Mappings::set_mapping_state`] with `events` appended in the same transaction when the
    /// state changes (each object payload gaining `"revision": N`); nothing is appended
    /// when it does not.
    fn set_mapping_state_traced(
        &self,
        name: &str,
        expected: MappingState,
        to: MappingState,
        reason: &str,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<Option<MappingRecord>>;
}

/// The append-only, MACed and chained trace: appending, reading, verifying, checkpoints,
/// and the MAC-checked proofs of serving state (mappings, approvals, intents) read from it.
pub trait Trace: Send + Sync {
    /// The key the trace is MACed with; every host on one shared store holds the same.
    fn trace_key(&self) -> &TraceKey;

    /// Appends one event: seq = previous + 1 (starting at 1), at_ms = now, prev_hash =
    /// previous event's hash or 64 zeros, hash = the hex HMAC-SHA256 under the host key of
    /// the stored fields ([`key`] has the encoding), key_id = the key's id. The payload is
    /// stored as canonical JSON text; the returned event carries it as stored. Errors when
    /// the newest event was MACed with another key.
    fn append_trace(
        &self,
        kind: &str,
        subject: &str,
        payload: &serde_json::Value,
    ) -> anyhow::Result<TraceEvent>;

    /// Appends `events` in order, chained as [`Trace::append_trace`] does, and returns once
    /// they are committed: `Ok` means every event is in the database, an error means none
    /// is. Concurrent callers share one transaction (group commit, see [`trace`]), each
    /// answered with the result of the transaction that held its events.
    fn append_events(&self, events: Vec<NewEvent>) -> anyhow::Result<()>;

    /// One call's `events` with the observations of the content it ingested (see
    /// [`observations`]): both are recorded, or neither, and `Ok` means they are durable.
    /// The embedded store writes them as one record of its trace journal ([`journal`]),
    /// moved into the chain and the observations table off the call's path and before
    /// anything reads either; a shared store commits them in one transaction with
    /// concurrent callers' (group commit), as [`Trace::append_events`] does.
    ///
    /// # Errors
    /// Nothing was recorded: the store cannot write, or (embedded store) its own journal
    /// cannot be moved into the trace, or the observations hold what the table refuses.
    fn append_call(
        &self,
        events: Vec<NewEvent>,
        observations: Vec<NewObservation>,
    ) -> anyhow::Result<()>;

    /// Moves every trace journal's records into the database's tables now (the embedded
    /// store, [`journal`]); a shared store keeps no journal, so there is nothing to do.
    /// Readers through this trait never need it (each read moves them first); a reader of
    /// the database's tables themselves (SQL, a test, a benchmark) does.
    ///
    /// # Errors
    /// The database fails.
    fn move_journals(&self) -> anyhow::Result<()> {
        Ok(())
    }

    /// Up to `limit` events with seq greater than `after_seq`, in seq order.
    fn trace(&self, after_seq: i64, limit: usize) -> anyhow::Result<Vec<TraceEvent>>;

    /// The events of one of `kinds` with `from <= seq < before`, newest first: a range
    /// read on the primary key, so its cost is bounded by `before - from` whatever the
    /// trace's length (the console's trace browser reads the trace in such windows).
    ///
    /// # Errors
    /// The database fails.
    fn trace_window(
        &self,
        before: i64,
        from: i64,
        kinds: &[&str],
    ) -> anyhow::Result<Vec<TraceEvent>>;

    /// Recomputes the chain from seq 1 with the host key: detects an edited byte of any
    /// stored field (MAC mismatch, even when the text still parses to the same JSON), a
    /// broken link (prev_hash differs from the previous event's hash), a missing or
    /// reordered event (seq gap), an event MACed with another key, and unkeyed events
    /// after keyed ones (a chain recomputed without the key). Reports the first bad seq
    /// and why, in words a reviewer understands. Cannot see deleted newest events: see
    /// [`Trace::verify_trace_against`].
    fn verify_trace(&self) -> anyhow::Result<TraceVerification> {
        self.verify_trace_against(&[])
    }

    /// [`Trace::verify_trace`], then checks each checkpoint (with the line it came from):
    /// it must verify with the host key, and the trace must still hold its event with
    /// the same MAC. So deleted newest events, a deleted whole trace and a chain rewritten
    /// up to a checkpointed event are reported.
    fn verify_trace_against(
        &self,
        checkpoints: &[(usize, key::Checkpoint)],
    ) -> anyhow::Result<TraceVerification>;

    /// A checkpoint of the trace head now (seq + head MAC), MACed with the host key.
    fn trace_checkpoint(&self) -> anyhow::Result<key::Checkpoint>;

    /// The events that can prove the serving state of mapping `name`, in seq order: its
    /// `mapping-revision` and `mapping-state-changed` events and every [`TRACE_KEYED`]
    /// event (which attests the mapping records at migration), **only those whose MAC
    /// verifies with the host key** (an unkeyed or forged event proves nothing). Read
    /// through a partial index, not a scan of the trace.
    fn mapping_proofs(&self, name: &str) -> anyhow::Result<Vec<TraceEvent>>;

    /// The newest `connection-state` event of connection `name` whose MAC verifies with
    /// the host key (what state it entered, when, and why), if the store holds one. Read
    /// through a partial index (the connection's state events only), not a scan of the
    /// trace. An archived one is not there; a forged or unkeyed one is passed over.
    ///
    /// # Errors
    /// The store fails.
    fn connection_state(&self, name: &str) -> anyhow::Result<Option<TraceEvent>>;

    /// The events that can prove approval `id` (its id in full), in seq order: the
    /// `approval-requested`, `approval-decided` and `receipt-consumed` events whose
    /// payload names it (`"approval": id`), **only those whose MAC verifies with the host
    /// key**. Read
    /// through an expression index, not a scan of the trace. The rule they prove is
    /// `airlock::pipeline::approve::prove_receipt`'s.
    fn approval_proofs(&self, id: &str) -> anyhow::Result<Vec<TraceEvent>>;

    /// The events that can prove intent `id` (its id in full), in seq order: the
    /// `intent-created` events whose payload names it (`"intent": id`) and the events that
    /// changed its state since (`call-outcome`, `call-refused`, `intent-resolved`,
    /// `intent-held` naming it with an `intent_state`), **only those whose MAC verifies
    /// with the host key**, read through two expression indexes. The rule they prove is
    /// `airlock::pipeline::intent::prove_intent`'s.
    fn intent_proofs(&self, id: &str) -> anyhow::Result<Vec<TraceEvent>>;

    /// The ids of mapping `mapping`'s intents that the trace leaves open while their row
    /// does not (closed, or missing), oldest first, at most `limit`: an `intent-created`
    /// event records them (with `intent_state`, so written since schema 9), no later event
    /// names them with `intent_state` `completed` or `failed`, and no row of theirs is
    /// `prepared` or `unknown` (open rows are listed, and proven, from the intents table).
    /// So it finds rows closed or deleted by hand, however many intents are open. One query
    /// over the trace's intent indexes and the intents table's key. A **prefilter**: the
    /// events are not MAC-checked here, so the caller proves each id it acts on
    /// ([`Trace::intent_proofs`]); a forged closing event hides an intent from this list
    /// and is caught by [`Trace::verify_trace`].
    ///
    /// # Errors
    /// The store fails.
    fn intents_open_in_trace_only(
        &self,
        mapping: &str,
        limit: usize,
    ) -> anyhow::Result<Vec<String>>;

    /// How many events are missing from the trace between `seq` and its head: the head's
    /// seq minus `seq`, plus one, minus the events stored there (one indexed count, read in
    /// one snapshot). Seqs are consecutive and each is inside its event's MAC, so an event
    /// deleted from the middle of the chain leaves a gap no one without the key can close;
    /// a deleted tail is caught by the checkpoints ([`Checkpoint`]), not here.
    ///
    /// # Errors
    /// The store fails.
    fn trace_missing_from(&self, seq: i64) -> anyhow::Result<u64>;

    /// Bytes every writer's trace journal holds that are not yet moved into the trace
    /// (what a reader's next pass would move first, [`journal`]), now: read without moving
    /// them. 0 for a store without journals (PostgreSQL).
    ///
    /// # Errors
    /// The store fails.
    fn journal_backlog_bytes(&self) -> anyhow::Result<u64> {
        Ok(0)
    }

    /// [`Trace::journal_backlog_bytes`] as it was when this store value was opened, just
    /// before opening moved the journals into the trace ([`journal`]: every reader
    /// moves them first): what another process's calls had waiting when a reader such as
    /// `airlock status` looked. 0 for a store without journals.
    fn journal_backlog_at_open(&self) -> u64 {
        0
    }

    /// The newest archive mark ([`archive`]): what the newest `trace-archived` event
    /// says, its MAC checked; `None` when nothing was archived.
    ///
    /// # Errors
    /// The store fails, or that event does not verify with the host key or does not
    /// parse (what it says cannot be trusted).
    fn archive_mark(&self) -> anyhow::Result<Option<archive::Archived>>;

    /// One archive pass ([`archive`] has the rule): seals the oldest events older than
    /// `request.before_ms` into a segment file in `request.dir`, keeps what is still
    /// needed, deletes the rest from the store and gives the space back. Runs off the
    /// call path; each step holds the store briefly.
    ///
    /// # Errors
    /// The store fails; the events to seal do not verify (nothing is sealed); the newest
    /// mark does not verify; the folder or file cannot be written; another process sealed
    /// a segment meanwhile. Nothing is lost on any of them.
    fn archive_trace(
        &self,
        request: &archive::ArchiveRequest,
    ) -> anyhow::Result<archive::ArchiveReport>;

    /// Writes the stored events after the newest archive mark (from event 1 when there
    /// is none) through the head as one segment file in `dir`; with
    /// the archive folder's segments beside it, the folder verifies from event 1.
    ///
    /// # Errors
    /// The store fails, the trace is empty past the mark, or the file cannot be written.
    fn export_trace(&self, dir: &Path) -> anyhow::Result<archive::Exported>;
}

/// Approval requests and their receipts: a person's decision
/// ([`ApprovalRecord`]'s decision rule) and consumption with the intent it creates
/// ([`plans::check_consumption`]: expired → state → nonce → changed fields).
pub trait Approvals: Send + Sync {
    /// Records a pending approval request (new id `apr_…`, random nonce, expiry now +
    /// `ttl_ms`) and `events` (each payload gains `"approval": id`) in one transaction.
    fn create_approval(
        &self,
        new: &NewApproval,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<ApprovalRecord>;

    /// The approval with id `id` (or a unique prefix of at least 12 characters).
    /// Errors: a too short or ambiguous prefix.
    fn approval(&self, id: &str) -> anyhow::Result<Option<ApprovalRecord>>;

    /// Approvals, newest first, optionally only those stored in `state`, at most `limit`.
    fn approvals(
        &self,
        state: Option<ApprovalState>,
        limit: usize,
    ) -> anyhow::Result<Vec<ApprovalRecord>>;

    /// The next page of [`Approvals::approvals`] (same order: `created_ms` descending, then
    /// `id`): those after `after`, the `(created_ms, id)` of the last approval of the page
    /// before (exclusive; `None`: the first page), at most `limit`. A page boundary never
    /// skips or repeats an approval, whatever is created meanwhile (newer ones are on
    /// earlier pages).
    fn approvals_after(
        &self,
        state: Option<ApprovalState>,
        after: Option<(u64, &str)>,
        limit: usize,
    ) -> anyhow::Result<Vec<ApprovalRecord>>;

    /// The newest pending or approved request with the same requester, session, capability
    /// and arguments digest as `binding` (other fields may differ: the caller reports them).
    fn find_approval(&self, binding: &ReceiptBinding) -> anyhow::Result<Option<ApprovalRecord>>;

    /// A person's decision (see [`ApprovalDecision`]); an approval's receipt lives `ttl_ms`
    /// from now. Errors name the approval's state when the decision does not apply.
    fn decide_approval(
        &self,
        id: &str,
        decision: ApprovalDecision,
        by: &str,
        reason: Option<&str>,
        ttl_ms: u64,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<ApprovalRecord>;

    /// Consumes receipt `id` for `intent`, creating the intent, in one transaction with
    /// `events`; refused (nothing written) unless every field of `binding` matches, the
    /// state fits `how`, and it has not expired.
    fn consume_receipt(
        &self,
        id: &str,
        binding: &ReceiptBinding,
        how: ConsumeAs<'_>,
        intent: &NewIntent,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<Consumption>;

    /// What waits at `now_ms` ([`Waiting`]), in one consistent read through the
    /// `approvals_by_state` and `intents_open` indexes (no scan of closed rows).
    ///
    /// # Errors
    /// The store fails.
    fn waiting(&self, now_ms: u64) -> anyhow::Result<Waiting>;
}

/// Intents and their attempts: one stable effect id across every attempt, its outcome,
/// and the resolution of an unknown one ([`plans::check_resolvable`]).
pub trait Intents: Send + Sync {
    /// Records an intent that needs no receipt, with `events`, in one transaction.
    fn create_intent(&self, intent: &NewIntent, events: Vec<NewEvent>) -> anyhow::Result<()>;

    /// Moves a prepared intent to its outcome state, with `events`. Errors: not prepared.
    fn set_intent_state(
        &self,
        id: &str,
        state: IntentState,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<()>;

    /// [`Intents::set_intent_state`] with the observations of the call and, for a
    /// completed compensable effect, the handles its result carried
    /// ([`IntentRecord::handles`]), in the same transaction.
    ///
    /// # Errors
    /// Not prepared; handles with another state than completed
    /// ([`plans::handles_text`]).
    fn finish_intent(
        &self,
        id: &str,
        state: IntentState,
        events: Vec<NewEvent>,
        observations: Vec<NewObservation>,
        handles: Vec<IntentHandle>,
    ) -> anyhow::Result<()>;

    /// The intent `id`.
    fn intent(&self, id: &str) -> anyhow::Result<Option<IntentRecord>>;

    /// Durably records that attempt `attempt` of intent `intent` is about to send an
    /// upstream request (the attempt becomes `sent`), before the request is written.
    /// Errors: the attempt is past the point of sending (it has a result), or the store
    /// failed — the caller then sends nothing.
    fn attempt_sending(&self, intent: &str, attempt: u32) -> anyhow::Result<()>;

    /// Durably records how one upstream request of the attempt ended: `answered` (a
    /// JSON-RPC result or error arrived) or not (closed, timed out, cancelled). The
    /// attempt becomes `acknowledged` once every request it sent was answered.
    fn attempt_answered(
        &self,
        intent: &str,
        attempt: u32,
        request_id: &str,
        answered: bool,
    ) -> anyhow::Result<()>;

    /// Durably moves an attempt to `to` (result observed, receipt verified).
    fn advance_attempt(&self, intent: &str, attempt: u32, to: AttemptState) -> anyhow::Result<()>;

    /// Starts the next attempt of an intent (a retry with the same idempotency key);
    /// returns its number.
    fn new_attempt(&self, intent: &str) -> anyhow::Result<u32>;

    /// The attempts of an intent, oldest first.
    fn attempts(&self, intent: &str) -> anyhow::Result<Vec<AttemptRecord>>;

    /// Intents matching `filter`, newest first.
    fn intents(&self, filter: &IntentFilter) -> anyhow::Result<Vec<IntentRecord>>;

    /// Resolves an `unknown` intent (or one a stopped host left `prepared`) with
    /// `resolution`, in one transaction with `events`. Errors: no such intent; it already
    /// has a definite outcome.
    fn resolve_intent(
        &self,
        id: &str,
        resolution: &Resolution,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<IntentRecord>;
}

/// What several hosts on one store share: change signals, live-host registration and
/// shared references. The embedded store serves one host and answers with its defaults.
pub trait Hosts: Send + Sync {
    /// A signal, when the store can give one, that another process or host changed what
    /// a serving host re-reads (mapping records, approvals): the value moves on each
    /// change (and once after the store's listener reconnects, since changes may have been
    /// missed). `None` (SQLite): no signal, the host polls. The PostgreSQL store sends it
    /// through `LISTEN/NOTIFY`.
    fn changes(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        None
    }

    /// Whether several hosts may serve from this store at once (PostgreSQL). Then
    /// references are kept here too ([`Hosts::write_references`]), sessions of one
    /// principal have one id on every host, and an open intent of another live host is
    /// left to it. `false` (SQLite): one host at a time.
    fn is_shared(&self) -> bool {
        false
    }

    /// Registers this process as live host `instance` until the store is dropped (see
    /// [`shared`]). The embedded store needs nothing. Errors: the registration could not
    /// be made (then other hosts would take this one for stopped).
    fn register_host(&self, instance: &str) -> anyhow::Result<()> {
        let _ = instance;
        Ok(())
    }

    /// Whether host `instance` (not this process) is alive. The embedded store serves one
    /// host at a time: any other instance that wrote here has stopped (`false`).
    fn host_alive(&self, instance: &str) -> anyhow::Result<bool> {
        let _ = instance;
        Ok(false)
    }

    /// Writes shared references of one scope in one transaction: `put` are inserted (or,
    /// for a token already there in the same scope, their expiry moved), `drop` (token
    /// digests) deleted, and the scope's expired rows removed. Errors: the store is not
    /// shared; database failure.
    fn write_references(
        &self,
        scope: &str,
        put: &[shared::SharedReference],
        drop: &[String],
    ) -> anyhow::Result<()> {
        let _ = (scope, put, drop);
        anyhow::bail!("references are kept in the host's memory with this store")
    }

    /// The shared reference with token digest `token_sha256` minted in `scope`, if any
    /// (expired ones included: the caller says so). Errors: the store is not shared;
    /// database failure.
    fn find_reference(
        &self,
        scope: &str,
        token_sha256: &str,
    ) -> anyhow::Result<Option<shared::SharedReference>> {
        let _ = (scope, token_sha256);
        anyhow::bail!("references are kept in the host's memory with this store")
    }
}

/// The state store: every concern at once. Object safe (`Arc<dyn Store>`), and every
/// method is one transaction (or one consistent read). Implemented for every type that
/// implements each concern; a caller imports the concern traits whose methods it calls
/// (`use airlock_store::{Approvals, Intents}`).
pub trait Store:
    Connections + Snapshots + Mappings + ContractReviews + Trace + Approvals + Intents + Hosts
{
}

impl<T> Store for T where
    T: Connections
        + Snapshots
        + Mappings
        + ContractReviews
        + Trace
        + Approvals
        + Intents
        + Hosts
        + ?Sized
{
}

/// [`Store`] on one SQLite database file. One connection per value, behind a mutex; open
/// one value per process and share it.
pub struct SqliteStore {
    /// Dropped first (fields drop in order): its thread and connection are gone before
    /// `conn` closes (see [`wal_checkpoint::WalCheckpointer`]).
    checkpointer: Option<wal_checkpoint::WalCheckpointer>,
    /// The `airlock-trace-journal` thread, started with this process's first journal
    /// record; stopped (taken) in `Drop` before the journal's last pass.
    mover: Mutex<Option<journal::Mover>>,
    conn: std::sync::Arc<Mutex<Connection>>,
    path: PathBuf,
    commit: trace::GroupCommit,
    /// Where calls' events are durable before their answer ([`journal`]).
    journal: std::sync::Arc<journal::Journal>,
    key: TraceKey,
    /// [`Trace::journal_backlog_at_open`].
    backlog_at_open: u64,
}

impl fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl Drop for SqliteStore {
    /// Stops the `airlock-trace-journal` thread and moves this process's journal into the
    /// trace (its file is then deleted; if that fails, the next open moves it), and commits
    /// what is still queued for group commit: nothing acknowledged is left behind.
    fn drop(&mut self) {
        let mover = self
            .mover
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        drop(mover);
        {
            let mut conn = self.lock();
            let last = self
                .journal
                .seal_own(&conn)
                .and_then(|()| self.journal.ingest(&mut conn, None, false));
            match last {
                Ok(moved) => {
                    for (_, why) in moved.problems {
                        tracing::error!("trace journal: {why}");
                    }
                }
                Err(e) => tracing::error!(
                    "moving the trace journal into the store at close failed (the next open moves it): {e:#}"
                ),
            }
        }
        if !self.commit.has_queued() {
            return;
        }
        let leftover = trace::Slot::default();
        if let Err(e) = self.commit.commit(
            &leftover,
            || self.lock(),
            |conn, all, seen| self.write_calls(conn, all, seen),
        ) {
            tracing::warn!("committing the trace events still queued at close failed: {e:#}");
        }
    }
}

impl SqliteStore {
    /// Writes the queued calls' `observations` and `events` in one transaction on `conn`
    /// (the writer's connection, its lock held): both are committed, or neither.
    fn write_calls(
        &self,
        conn: &Connection,
        events: &[NewEvent],
        observations: &[NewObservation],
    ) -> anyhow::Result<()> {
        // Cached statements for BEGIN and COMMIT too: this runs once per call (or per
        // batch of calls that finished together).
        (|| -> anyhow::Result<()> {
            conn.prepare_cached("BEGIN IMMEDIATE")?.execute([])?;
            let written = observations::write_in(conn, observations)
                .and_then(|()| trace::append_in(conn, &self.key, events))
                .and_then(|_| {
                    conn.prepare_cached("COMMIT")?.execute([])?;
                    Ok(())
                });
            if written.is_err() && !conn.is_autocommit() {
                let _ = conn.execute_batch("ROLLBACK");
            }
            written
        })()
        .with_context(|| self.context(&format!("appending {} trace events", events.len())))
    }

    /// [`open_with_key`](Self::open_with_key) with the key from [`key::KEY_ENV`] when it
    /// is set, else from the state folder's key file (created when missing).
    pub fn open(state_dir: &Path) -> anyhow::Result<Self> {
        Self::open_with_key(state_dir, None)
    }

    /// Creates `state_dir` (mode 0700) if missing and opens
    /// `state_dir/`[`DATABASE_FILE`] with [`open_file_with_key`](Self::open_file_with_key).
    /// Refuses, writing nothing, a state folder that is a symbolic link, not a folder, not
    /// owned by this user or writable by group or others.
    pub fn open_with_key(state_dir: &Path, key: Option<TraceKey>) -> anyhow::Result<Self> {
        airlock_core::private_fs::ensure_private_dir(state_dir, "state folder", ELSEWHERE)?;
        Self::open_file_with_key(&state_dir.join(DATABASE_FILE), key)
    }

    /// [`open_file_with_key`](Self::open_file_with_key) with the default key (see
    /// [`open`](Self::open)).
    pub fn open_file(path: &Path) -> anyhow::Result<Self> {
        Self::open_file_with_key(path, None)
    }

    /// Opens (creating when missing, mode 0600) the database file at `path`, whose folder
    /// is the state folder. Refuses — writing nothing — a folder, database, `-wal`, `-shm`
    /// or `-journal` file or key file that breaks [`airlock_core::private_fs`]'s rules (a link,
    /// another owner, writable by others; a key readable by others), a file that is not a
    /// readable SQLite database, fails `PRAGMA quick_check`, was written by a newer schema,
    /// or holds tables but no Airlock schema version; and a missing key file when the
    /// trace already holds MACed events. Then switches to WAL, applies pending migrations,
    /// creates the key file if there is none (and no `key` was given), and pins an unkeyed
    /// trace from before schema 7 with a [`TRACE_KEYED`] event.
    ///
    /// `key`: the host key (a named secret); `None` takes [`key::KEY_ENV`] when set, else
    /// the state folder's [`key::KEY_FILE`].
    pub fn open_file_with_key(path: &Path, key: Option<TraceKey>) -> anyhow::Result<Self> {
        use airlock_core::private_fs::{Access, check_private_dir, check_private_file};
        let shown = path.display();
        let folder = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        if !check_private_dir(folder, "state folder", ELSEWHERE)? {
            bail!(
                "the state folder {} does not exist; nothing was written",
                folder.display()
            );
        }
        let exists = check_private_file(
            path,
            "state database",
            ELSEWHERE,
            Access::NotWritableByOthers,
        )?;
        for (suffix, what) in [
            ("-wal", "state database's write-ahead log"),
            ("-shm", "state database's shared-memory file"),
            ("-journal", "state database's rollback journal"),
        ] {
            let mut beside = path.as_os_str().to_owned();
            beside.push(suffix);
            check_private_file(
                Path::new(&beside),
                what,
                ELSEWHERE,
                Access::NotWritableByOthers,
            )?;
        }
        let key = match key {
            Some(key) => Some(key),
            None => match TraceKey::from_env()? {
                Some(key) => Some(key),
                None => TraceKey::read_file(folder)?,
            },
        };
        if exists {
            precheck(path)?;
        } else {
            create_private_file(path)?;
        }

        // SQLite opens every file with O_NOFOLLOW anyway; NOFOLLOW also refuses a link
        // put in place since the checks above, with its own error.
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX
            | OpenFlags::SQLITE_OPEN_NOFOLLOW;
        let mut conn = Connection::open_with_flags(path, flags)
            .with_context(|| format!("opening state database {shown}"))?;
        if !exists || std::fs::metadata(path).is_ok_and(|m| m.len() == 0) {
            // Before the first table: a new database gives archived events' space back
            // (archive.rs); one made before schema 13 reuses it for new events instead
            // (`PRAGMA auto_vacuum = INCREMENTAL` then `VACUUM`, by hand, converts it).
            conn.pragma_update(None, "auto_vacuum", "INCREMENTAL")
                .with_context(|| format!("configuring state database {shown}"))?;
        }
        configure(&conn).with_context(|| format!("configuring state database {shown}"))?;
        let version: i64 = conn
            .pragma_query_value(None, "user_version", |row| row.get(0))
            .with_context(|| format!("state database {shown}: reading the schema version"))?;
        let key = match key {
            Some(key) => key,
            None => {
                // Before schema 7 no event has a MAC, so a first key is made safely.
                let keyed: Option<String> = if version >= 7 {
                    conn.query_row(
                        "SELECT key_id FROM trace_events WHERE key_id IS NOT NULL LIMIT 1",
                        [],
                        |row| row.get(0),
                    )
                    .optional()
                    .with_context(|| format!("state database {shown}: reading the trace"))?
                } else {
                    None
                };
                if let Some(id) = keyed {
                    bail!(
                        "the trace key file {} is missing, but the trace in {shown} is MACed \
                         with key {id}: restore the key file (or give that key with [trace] \
                         key or {}); a new key would not verify the events already written; \
                         nothing was written",
                        folder.join(key::KEY_FILE).display(),
                        key::KEY_ENV
                    );
                }
                TraceKey::create_file(folder)?
            }
        };
        migrate(&mut conn, path, &key)?;
        let checkpointer = wal_checkpoint::move_off_request_path(&mut conn, path, BUSY_TIMEOUT);
        let journal = journal::Journal::new(path, key.clone());
        // What waits in the journals, as found (`airlock status` reports it); unreadable
        // rows are the ingestion's to report.
        let backlog_at_open = journal.backlog_bytes(&conn).unwrap_or(0);
        // The journals of processes that stopped: moved into the trace before anything
        // reads it. A journal that cannot be moved is reported and kept.
        let recovered = journal
            .ingest(&mut conn, None, true)
            .and_then(|moved| journal.remove_orphans(&conn).map(|()| moved))
            .with_context(|| format!("state database {shown}: moving the trace journals"))?;
        for (_, why) in recovered.problems {
            tracing::error!("trace journal: {why}");
        }
        Ok(Self {
            checkpointer,
            mover: Mutex::new(None),
            conn: std::sync::Arc::new(Mutex::new(conn)),
            path: path.to_path_buf(),
            commit: trace::GroupCommit::default(),
            journal: std::sync::Arc::new(journal),
            key,
            backlog_at_open,
        })
    }

    /// How many WAL checkpoints the store's `airlock-wal-checkpoint` thread has run, or `None`
    /// when SQLite's automatic checkpoint runs inside commits instead (the thread or its
    /// connection could not start; see `store::wal_checkpoint`).
    pub fn wal_checkpoints(&self) -> Option<u64> {
        self.checkpointer
            .as_ref()
            .map(|c| c.done.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// The host key the trace is MACed with.
    pub fn key(&self) -> &TraceKey {
        &self.key
    }

    /// Path of the database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The events `sql` selects (its one parameter bound to `param`) that `accept` takes by
    /// kind and subject and whose MAC verifies with this store's key; the others are passed
    /// over (an unkeyed or forged event proves nothing).
    fn genuine_events(
        &self,
        sql: &str,
        param: &str,
        accept: impl Fn(&str, &str) -> bool,
    ) -> anyhow::Result<Vec<TraceEvent>> {
        let conn = self.lock_all_moved()?;
        let mut stmt = conn.prepare_cached(sql)?;
        let mut rows = stmt.query(params![param])?;
        let mut out = Vec::new();
        while let Some(row) = rows.next()? {
            let seq: i64 = row.get(0)?;
            let at: i64 = row.get(1)?;
            let kind: String = row.get(2)?;
            let subject: String = row.get(3)?;
            let payload: String = row.get(4)?;
            let prev_hash: String = row.get(5)?;
            let hash: String = row.get(6)?;
            let key_id: Option<String> = row.get(7)?;
            let genuine = key_id.as_deref() == Some(self.key.id())
                && accept(&kind, &subject)
                && self
                    .key
                    .verify_event(seq, at, &kind, &subject, &payload, &prev_hash, &hash);
            if !genuine {
                continue;
            }
            out.push(TraceEvent {
                seq,
                at_ms: u64::try_from(at).unwrap_or(0),
                kind,
                subject,
                payload: serde_json::from_str(&payload)?,
                prev_hash,
                hash,
                key_id,
            });
        }
        Ok(out)
    }

    fn lock(&self) -> MutexGuard<'_, Connection> {
        // A panic while holding the lock dropped any open transaction, which rolled back,
        // so the connection is still consistent.
        self.conn
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The connection, with this process's journal records moved into the trace first, so
    /// that what it appends next follows them in the chain (nothing to do, and no write
    /// transaction, when every record it appended is moved).
    fn lock_in_order(&self) -> anyhow::Result<MutexGuard<'_, Connection>> {
        let mut conn = self.lock();
        if self.journal.has_unmoved() {
            self.journal
                .ingest(&mut conn, None, false)
                .with_context(|| self.context("moving the trace journal into the trace"))?;
        }
        Ok(conn)
    }

    /// The connection, with every journal's records (this process's and any other's)
    /// moved into the trace first: a reader of the trace or of the observations sees every
    /// call that was answered. Journals that cannot be moved are left out (and reported by
    /// [`Trace::verify_trace`]).
    fn lock_all_moved(&self) -> anyhow::Result<MutexGuard<'_, Connection>> {
        let mut conn = self.lock();
        self.journal
            .ingest(&mut conn, None, false)
            .with_context(|| self.context("moving the trace journals into the trace"))?;
        Ok(conn)
    }

    /// Starts the `airlock-trace-journal` thread unless it runs.
    fn start_mover(&self) {
        let mut mover = self
            .mover
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if mover.is_none() {
            match journal::Mover::start(self.journal.clone(), self.conn.clone()) {
                Ok(m) => *mover = Some(m),
                Err(e) => tracing::warn!(
                    "no airlock-trace-journal thread ({e}): journal records move into the trace when the store is next read or closed"
                ),
            }
        }
    }

    fn context(&self, what: &str) -> String {
        format!("state database {}: {what}", self.path.display())
    }
}

/// Refuses, through a read-only connection, a file this build must not touch.
fn precheck(path: &Path) -> anyhow::Result<()> {
    let shown = path.display();
    let unreadable = |e: &dyn fmt::Display| {
        anyhow!(
            "state database {shown} is not a readable SQLite database ({e}); nothing was \
             changed — move it aside to start a new one"
        )
    };
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags).map_err(|e| unreadable(&e))?;
    conn.busy_timeout(BUSY_TIMEOUT)
        .map_err(|e| unreadable(&e))?;
    let version: i64 = conn
        .pragma_query_value(None, "user_version", |row| row.get(0))
        .map_err(|e| unreadable(&e))?;
    if version > SCHEMA_VERSION {
        bail!(
            "state database {shown} was written by a newer Airlock (schema {version}; this \
             build knows up to {SCHEMA_VERSION}); nothing was changed"
        );
    }
    let mut problems = Vec::new();
    {
        let mut stmt = conn
            .prepare("PRAGMA quick_check")
            .map_err(|e| unreadable(&e))?;
        let rows = stmt
            .query_map([], |row| row.get::<_, String>(0))
            .map_err(|e| unreadable(&e))?;
        for row in rows {
            let line = row.map_err(|e| unreadable(&e))?;
            if line != "ok" {
                problems.push(line);
            }
        }
    }
    if !problems.is_empty() {
        let more = problems.len().saturating_sub(3);
        problems.truncate(3);
        let mut message = format!("quick_check: {}", problems.join("; "));
        if more > 0 {
            message.push_str(&format!("; and {more} more"));
        }
        return Err(unreadable(&message));
    }
    if version < 0 {
        bail!(
            "state database {shown} has schema version {version}, which no Airlock writes; \
             nothing was changed — move it aside to start a new one"
        );
    }
    if version == 0 {
        let objects: i64 = conn
            .query_row("SELECT count(*) FROM sqlite_schema", [], |row| row.get(0))
            .map_err(|e| unreadable(&e))?;
        if objects > 0 {
            bail!(
                "state database {shown} holds tables but no Airlock schema version, so it \
                 was not written by Airlock; nothing was changed — move it aside to start a \
                 new one"
            );
        }
    }
    Ok(())
}

fn configure(conn: &Connection) -> rusqlite::Result<()> {
    conn.busy_timeout(BUSY_TIMEOUT)?;
    let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |row| row.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(rusqlite::Error::InvalidParameterName(format!(
            "journal_mode=WAL was refused (mode is {mode})"
        )));
    }
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    conn.pragma_update(None, "foreign_keys", true)?;
    // One plan per statement whatever its bound values: without the query planner stability
    // guarantee, SQLite re-prepares a cached statement after each bind when a bound value
    // could change its plan (here: the partial index of open approvals), which made every
    // approval lookup a fresh parse. Statements are cached (`prepare_cached`) on the call
    // path; the cache holds them all.
    conn.set_db_config(
        rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG,
        true,
    )?;
    conn.set_prepared_statement_cache_capacity(64);
    Ok(())
}

/// Applies migrations from the current `user_version` up to [`SCHEMA_VERSION`], each in its
/// own `BEGIN IMMEDIATE` transaction that re-reads the version (another process may be
/// migrating the same file). The step to schema 7 also appends the [`TRACE_KEYED`] event
/// (MACed with `key`) when the trace holds events.
fn migrate(conn: &mut Connection, path: &Path, key: &TraceKey) -> anyhow::Result<()> {
    let shown = path.display();
    loop {
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .with_context(|| format!("state database {shown}: starting a migration"))?;
        let version: i64 = tx.pragma_query_value(None, "user_version", |row| row.get(0))?;
        if version > SCHEMA_VERSION {
            bail!(
                "state database {shown} was written by a newer Airlock (schema {version}; \
                 this build knows up to {SCHEMA_VERSION}); nothing was changed"
            );
        }
        if version == SCHEMA_VERSION {
            return Ok(());
        }
        let index = usize::try_from(version)
            .with_context(|| format!("state database {shown}: schema version {version}"))?;
        tx.execute_batch(MIGRATIONS[index]).with_context(|| {
            format!(
                "state database {shown}: migrating schema {version} → {}",
                version + 1
            )
        })?;
        if version + 1 == 7 {
            // The trace becomes keyed: pin the unkeyed events (and attest the mapping
            // records as they stand) with a MACed event, in the same transaction, so an
            // unkeyed trace is accepted only as it was when this build first opened it.
            trace::mark_keyed(&tx, key)
                .with_context(|| format!("state database {shown}: starting the keyed trace"))?;
        }
        tx.pragma_update(None, "user_version", version + 1)?;
        tx.commit().with_context(|| {
            format!("state database {shown}: committing schema {}", version + 1)
        })?;
    }
}

fn create_private_file(path: &Path) -> anyhow::Result<()> {
    match airlock_core::private_fs::create_new_private(path) {
        Ok(_) => Ok(()),
        // Another process created it first; the SQLite open that follows checks nothing
        // more than a fresh file needs.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e).with_context(|| format!("creating state database {}", path.display())),
    }
}

/// The host clock: unix milliseconds.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

fn ms_to_sql(ms: u64) -> anyhow::Result<i64> {
    i64::try_from(ms).map_err(|_| anyhow!("time {ms} ms is out of range"))
}

fn canonical(value: &serde_json::Value) -> anyhow::Result<String> {
    airlock_core::canonical::to_string(value).context("canonicalizing JSON")
}

fn is_hex(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_hexdigit())
}

fn new_connection_id() -> anyhow::Result<String> {
    let mut bytes = [0u8; 6];
    getrandom::fill(&mut bytes).map_err(|e| anyhow!("reading the OS random source: {e}"))?;
    Ok(format!("conn-{}", hex::encode(bytes)))
}

/// Hex sha256 of the canonical JSON of the chained fields of one trace event (the
/// re-parsing form of [`trace::chained_hash`], which a unit test holds equal).
#[cfg(test)]
fn trace_hash(
    seq: i64,
    at_ms: u64,
    kind: &str,
    subject: &str,
    payload: &serde_json::Value,
    prev_hash: &str,
) -> anyhow::Result<String> {
    use sha2::{Digest as _, Sha256};
    let chained = serde_json::json!({
        "seq": seq,
        "at_ms": at_ms,
        "kind": kind,
        "subject": subject,
        "payload": payload,
        "prev_hash": prev_hash,
    });
    let bytes = serde_json_canonicalizer::to_vec(&chained).context("canonicalizing event")?;
    Ok(hex::encode(Sha256::digest(&bytes)))
}

const CONNECTION_SELECT: &str = "SELECT c.connection_id, c.name, r.revision, r.config_digest, \
     r.config, c.first_seen_ms \
     FROM connections c JOIN connection_revisions r ON r.connection_id = c.connection_id \
     WHERE r.revision = (SELECT max(revision) FROM connection_revisions \
                         WHERE connection_id = c.connection_id)";

const SNAPSHOT_SUMMARY_SELECT: &str = "SELECT s.digest, s.connection_id, s.config_revision, \
     s.first_seen_ms, max(o.observed_at_ms), count(o.id), max(o.id) \
     FROM snapshots s JOIN snapshot_observations o ON o.digest = s.digest";

const MAPPING_COLUMNS: &str = "name, revision, manifest_digest, component_sha256, \
     connection_id, config_revision, snapshot_digest, pins, state, reviewer, reason, \
     created_ms, state_changed_ms, manifest_text";

fn latest_mapping(conn: &Connection, name: &str) -> rusqlite::Result<Option<MappingRecord>> {
    conn.query_row(
        &format!(
            "SELECT {MAPPING_COLUMNS} FROM mappings WHERE name = ?1 \
             ORDER BY revision DESC LIMIT 1"
        ),
        params![name],
        |r| rows::mapping(r),
    )
    .optional()
}

const TRACE_COLUMNS: &str = "seq, at_ms, kind, subject, payload, prev_hash, hash, key_id";

fn load_snapshot(conn: &Connection, digest: &str) -> rusqlite::Result<Option<StoredSnapshot>> {
    conn.query_row(
        &format!(
            "{} WHERE s.digest = ?1 GROUP BY s.digest",
            rows::SNAPSHOT_SELECT
        ),
        params![digest],
        |r| rows::stored_snapshot(r),
    )
    .optional()
}

/// The embedded store serves one host: no change signal, no shared references.
impl Hosts for SqliteStore {}

impl Connections for SqliteStore {
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
        let mut conn = self.lock();
        let mut run = || -> anyhow::Result<ConnectionRevision> {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let existing: Option<String> = tx
                .query_row(
                    "SELECT connection_id FROM connections WHERE name = ?1",
                    params![name],
                    |row| row.get(0),
                )
                .optional()?;
            let connection_id = match existing {
                Some(id) => id,
                None => {
                    let mut attempts = 0;
                    loop {
                        let id = new_connection_id()?;
                        let inserted = tx.execute(
                            "INSERT INTO connections (connection_id, name, first_seen_ms) \
                             VALUES (?1, ?2, ?3) ON CONFLICT (connection_id) DO NOTHING",
                            params![id, name, now],
                        )?;
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
            let seen: Option<i64> = tx
                .query_row(
                    "SELECT revision FROM connection_revisions \
                     WHERE connection_id = ?1 AND config_digest = ?2",
                    params![connection_id, config_digest],
                    |row| row.get(0),
                )
                .optional()?;
            let (revision, created) = match seen {
                Some(revision) => (revision, false),
                None => {
                    let revision: i64 = tx.query_row(
                        "SELECT coalesce(max(revision), 0) + 1 FROM connection_revisions \
                         WHERE connection_id = ?1",
                        params![connection_id],
                        |row| row.get(0),
                    )?;
                    tx.execute(
                        "INSERT INTO connection_revisions \
                         (connection_id, revision, config_digest, config, created_ms) \
                         VALUES (?1, ?2, ?3, ?4, ?5)",
                        params![connection_id, revision, config_digest, config_text, now],
                    )?;
                    (revision, true)
                }
            };
            tx.commit()?;
            Ok(ConnectionRevision {
                connection_id,
                name: name.to_owned(),
                revision,
                config_digest: config_digest.to_owned(),
                created,
            })
        };
        run().with_context(|| self.context(&format!("recording connection {name:?}")))
    }

    fn connection(&self, name: &str) -> anyhow::Result<Option<ConnectionRecord>> {
        let conn = self.lock();
        conn.query_row(
            &format!("{CONNECTION_SELECT} AND c.name = ?1"),
            params![name],
            |r| rows::connection(r),
        )
        .optional()
        .with_context(|| self.context(&format!("reading connection {name:?}")))
    }

    fn connections(&self) -> anyhow::Result<Vec<ConnectionRecord>> {
        let conn = self.lock();
        let run = || -> rusqlite::Result<Vec<ConnectionRecord>> {
            let mut stmt = conn.prepare(&format!("{CONNECTION_SELECT} ORDER BY c.name"))?;
            stmt.query_map([], |r| rows::connection(r))?.collect()
        };
        run().with_context(|| self.context("listing connections"))
    }
}

impl Snapshots for SqliteStore {
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
        let mut conn = self.lock();
        let mut run = || -> anyhow::Result<SnapshotObservation> {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let revision_known: bool = tx.query_row(
                "SELECT EXISTS (SELECT 1 FROM connection_revisions \
                 WHERE connection_id = ?1 AND revision = ?2)",
                params![connection_id, config_revision],
                |row| row.get(0),
            )?;
            if !revision_known {
                bail!(
                    "connection {connection_id:?} has no configuration revision \
                     {config_revision}"
                );
            }
            let stored = tx
                .query_row(
                    "SELECT connection_id, config_revision, body FROM snapshots \
                     WHERE digest = ?1",
                    params![digest],
                    |row| {
                        Ok(plans::StoredSnapshotKey {
                            connection_id: row.get(0)?,
                            config_revision: row.get(1)?,
                            body: row.get(2)?,
                        })
                    },
                )
                .optional()?;
            let plan = plans::snapshot_write(
                &digest,
                connection_id,
                config_revision,
                &body_text,
                stored.as_ref(),
            )?;
            if plan == plans::SnapshotWrite::Insert {
                tx.execute(
                    "INSERT INTO snapshots \
                     (digest, connection_id, config_revision, body, first_seen_ms) \
                     VALUES (?1, ?2, ?3, ?4, ?5)",
                    params![digest, connection_id, config_revision, body_text, now],
                )?;
            }
            let new = plan == plans::SnapshotWrite::Insert;
            tx.execute(
                "INSERT INTO snapshot_observations (digest, observed_at_ms) VALUES (?1, ?2)",
                params![digest, now],
            )?;
            tx.commit()?;
            Ok(SnapshotObservation {
                digest: digest.clone(),
                new,
                observed_at_ms,
            })
        };
        run().with_context(|| self.context(&format!("recording snapshot {digest}")))
    }

    fn snapshot(&self, digest_or_prefix: &str) -> anyhow::Result<Option<StoredSnapshot>> {
        if !is_hex(digest_or_prefix) {
            bail!("snapshot digest or prefix {digest_or_prefix:?} is not hex");
        }
        let wanted = digest_or_prefix.to_ascii_lowercase();
        let conn = self.lock();
        let run = || -> anyhow::Result<Option<StoredSnapshot>> {
            if let Some(found) = load_snapshot(&conn, &wanted)? {
                return Ok(Some(found));
            }
            if wanted.len() < MIN_PREFIX {
                bail!(
                    "snapshot prefix {wanted} is too short: give at least {MIN_PREFIX} hex \
                     characters"
                );
            }
            // Hex only, so the pattern holds no GLOB metacharacters.
            let pattern = format!("{wanted}*");
            let matches: Vec<String> = {
                let mut stmt =
                    conn.prepare("SELECT digest FROM snapshots WHERE digest GLOB ?1 LIMIT 2")?;
                stmt.query_map(params![pattern], |row| row.get(0))?
                    .collect::<rusqlite::Result<_>>()?
            };
            match matches.as_slice() {
                [] => Ok(None),
                [only] => Ok(load_snapshot(&conn, only)?),
                _ => {
                    let count: i64 = conn.query_row(
                        "SELECT count(*) FROM snapshots WHERE digest GLOB ?1",
                        params![pattern],
                        |row| row.get(0),
                    )?;
                    bail!(
                        "snapshot prefix {wanted} is ambiguous: it matches {count} snapshots; \
                         give more characters"
                    )
                }
            }
        };
        run().with_context(|| self.context(&format!("reading snapshot {digest_or_prefix}")))
    }

    fn latest_snapshot(&self, connection_id: &str) -> anyhow::Result<Option<StoredSnapshot>> {
        let conn = self.lock();
        let run = || -> rusqlite::Result<Option<StoredSnapshot>> {
            let digest: Option<String> = conn
                .query_row(
                    "SELECT o.digest FROM snapshot_observations o \
                     JOIN snapshots s ON s.digest = o.digest \
                     WHERE s.connection_id = ?1 ORDER BY o.id DESC LIMIT 1",
                    params![connection_id],
                    |row| row.get(0),
                )
                .optional()?;
            match digest {
                Some(digest) => load_snapshot(&conn, &digest),
                None => Ok(None),
            }
        };
        run().with_context(|| {
            self.context(&format!("reading the latest snapshot of {connection_id}"))
        })
    }

    fn snapshots(&self, connection_id: Option<&str>) -> anyhow::Result<Vec<SnapshotSummary>> {
        let conn = self.lock();
        let run = || -> rusqlite::Result<Vec<SnapshotSummary>> {
            let mut stmt = conn.prepare(&format!(
                "{SNAPSHOT_SUMMARY_SELECT} WHERE ?1 IS NULL OR s.connection_id = ?1 \
                 GROUP BY s.digest ORDER BY 5 DESC, 7 DESC"
            ))?;
            stmt.query_map(params![connection_id], |r| rows::snapshot_summary(r))?
                .collect()
        };
        run().with_context(|| self.context("listing snapshots"))
    }
}

impl Mappings for SqliteStore {
    fn mapping(&self, name: &str) -> anyhow::Result<Option<MappingRecord>> {
        let conn = self.lock();
        latest_mapping(&conn, name)
            .with_context(|| self.context(&format!("reading mapping {name:?}")))
    }

    fn mapping_revisions(&self, name: &str) -> anyhow::Result<Vec<MappingRecord>> {
        let conn = self.lock();
        let run = || -> rusqlite::Result<Vec<MappingRecord>> {
            let mut stmt = conn.prepare(&format!(
                "SELECT {MAPPING_COLUMNS} FROM mappings WHERE name = ?1 ORDER BY revision"
            ))?;
            stmt.query_map(params![name], |r| rows::mapping(r))?
                .collect()
        };
        run().with_context(|| self.context(&format!("reading revisions of mapping {name:?}")))
    }

    fn mappings(&self) -> anyhow::Result<Vec<MappingRecord>> {
        let conn = self.lock();
        let run = || -> rusqlite::Result<Vec<MappingRecord>> {
            let mut stmt = conn.prepare(&format!(
                "SELECT {MAPPING_COLUMNS} FROM mappings m \
                 WHERE revision = (SELECT max(revision) FROM mappings WHERE name = m.name) \
                 ORDER BY name"
            ))?;
            stmt.query_map([], |r| rows::mapping(r))?.collect()
        };
        run().with_context(|| self.context("listing mappings"))
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
        let mut conn = self.lock_in_order()?;
        let mut run = || -> anyhow::Result<MappingRecord> {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let previous = latest_mapping(&tx, &new.name)?;
            let plan = plans::supersede(
                previous.as_ref(),
                new,
                serde_json::from_str(&pins_text)?,
                now_u,
            );
            let revision = plan.record.revision;
            if let Some(retire) = &plan.retire {
                tx.execute(
                    "UPDATE mappings SET state = ?1, reason = ?2, state_changed_ms = ?3 \
                     WHERE name = ?4 AND revision = ?5",
                    params![
                        MappingState::Historical.as_str(),
                        retire.reason,
                        now,
                        new.name,
                        retire.revision
                    ],
                )?;
            }
            tx.execute(
                &format!(
                    "INSERT INTO mappings ({MAPPING_COLUMNS}) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?12, ?13)"
                ),
                params![
                    new.name,
                    revision,
                    new.manifest_digest,
                    new.component_sha256,
                    new.connection_id,
                    new.config_revision,
                    new.snapshot_digest,
                    pins_text,
                    new.state.as_str(),
                    new.reviewer,
                    new.reason,
                    now,
                    new.manifest_text
                ],
            )?;
            trace::append_in(&tx, &self.key, &with_revision(events.clone(), revision))?;
            tx.commit()?;
            Ok(plan.record)
        };
        run().with_context(|| {
            self.context(&format!("recording a revision of mapping {:?}", new.name))
        })
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
        let mut conn = self.lock_in_order()?;
        let mut run = || -> anyhow::Result<Option<MappingRecord>> {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let latest = latest_mapping(&tx, name)?;
            let Some(changed) = plans::set_state(name, latest, expected, to, reason, now_u)? else {
                return Ok(None);
            };
            tx.execute(
                "UPDATE mappings SET state = ?1, reason = ?2, state_changed_ms = ?3 \
                 WHERE name = ?4 AND revision = ?5",
                params![to.as_str(), reason, now, name, changed.revision],
            )?;
            trace::append_in(
                &tx,
                &self.key,
                &with_revision(events.clone(), changed.revision),
            )?;
            tx.commit()?;
            Ok(Some(changed))
        };
        run().with_context(|| {
            self.context(&format!("changing the state of mapping {name:?} to {to}"))
        })
    }
}

impl ContractReviews for SqliteStore {
    fn contract_review(&self, package: &str) -> anyhow::Result<Option<ContractRecord>> {
        let conn = self.lock();
        latest_contract(&conn, package)
            .with_context(|| self.context(&format!("reading contract review {package:?}")))
    }

    fn contract_reviews(&self) -> anyhow::Result<Vec<ContractRecord>> {
        let conn = self.lock();
        let run = || -> rusqlite::Result<Vec<ContractRecord>> {
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {CONTRACT_COLUMNS} FROM contract_reviews ORDER BY package"
            ))?;
            stmt.query_map([], |r| rows::contract(r))?.collect()
        };
        run().with_context(|| self.context("listing contract reviews"))
    }

    fn approve_contract(&self, new: &NewContractApproval) -> anyhow::Result<ContractRecord> {
        let now_u = now_ms();
        let now = ms_to_sql(now_u)?;
        let mut conn = self.lock_in_order()?;
        let mut run = || -> anyhow::Result<ContractRecord> {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let current = latest_contract(&tx, &new.package)?;
            let record = match contracts::plan_approval(current, new, now_u)? {
                contracts::ApprovalPlan::Unchanged(r) => return Ok(r),
                contracts::ApprovalPlan::Insert(r) => r,
            };
            tx.execute(
                &format!(
                    "INSERT INTO contract_reviews ({CONTRACT_COLUMNS}) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7)"
                ),
                params![
                    record.package,
                    record.digest,
                    record.state.as_str(),
                    record.reviewer,
                    record.reason,
                    record.files,
                    now
                ],
            )?;
            trace::append_in(&tx, &self.key, &[contracts::event_for(&record)])?;
            tx.commit()?;
            Ok(record)
        };
        run().with_context(|| {
            self.context(&format!(
                "recording the approval of contract {:?}",
                new.package
            ))
        })
    }

    fn mark_contract_erroneous(
        &self,
        package: &str,
        reviewer: &str,
        reason: &str,
    ) -> anyhow::Result<Option<ContractRecord>> {
        let now_u = now_ms();
        let now = ms_to_sql(now_u)?;
        let mut conn = self.lock_in_order()?;
        let mut run = || -> anyhow::Result<Option<ContractRecord>> {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let current = latest_contract(&tx, package)?;
            let Some(record) =
                contracts::plan_erroneous(package, current, reviewer, reason, now_u)?
            else {
                return Ok(None);
            };
            tx.execute(
                "UPDATE contract_reviews SET state = ?1, reviewer = ?2, reason = ?3, \
                 state_changed_ms = ?4 WHERE package = ?5",
                params![record.state.as_str(), reviewer, reason, now, package],
            )?;
            trace::append_in(&tx, &self.key, &[contracts::event_for(&record)])?;
            tx.commit()?;
            Ok(Some(record))
        };
        run().with_context(|| self.context(&format!("marking contract {package:?} erroneous")))
    }

    fn contract_proofs(&self, package: &str) -> anyhow::Result<Vec<TraceEvent>> {
        // The kind term repeats the partial index's WHERE clause word for word (migration
        // 11), so SQLite uses it.
        self.genuine_events(
            &format!(
                "SELECT {TRACE_COLUMNS} FROM trace_events \
                 WHERE kind IN ('contract-approved', 'contract-marked-erroneous') \
                 AND subject = ?1 ORDER BY seq"
            ),
            package,
            |_, subject| subject == package,
        )
        .with_context(|| self.context(&format!("reading the proofs of contract {package:?}")))
    }
}

fn latest_contract(conn: &Connection, package: &str) -> rusqlite::Result<Option<ContractRecord>> {
    conn.query_row(
        &format!("SELECT {CONTRACT_COLUMNS} FROM contract_reviews WHERE package = ?1"),
        params![package],
        |r| rows::contract(r),
    )
    .optional()
}

impl Trace for SqliteStore {
    fn trace_key(&self) -> &TraceKey {
        &self.key
    }

    fn append_trace(
        &self,
        kind: &str,
        subject: &str,
        payload: &serde_json::Value,
    ) -> anyhow::Result<TraceEvent> {
        let mut conn = self.lock_in_order()?;
        let mut run = || -> anyhow::Result<TraceEvent> {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let event = trace::append_one(&tx, &self.key, kind, subject, payload)?;
            tx.commit()?;
            Ok(event)
        };
        run().with_context(|| self.context(&format!("appending trace event {kind:?}")))
    }

    fn append_events(&self, events: Vec<NewEvent>) -> anyhow::Result<()> {
        if events.is_empty() {
            return Ok(());
        }
        // This process's journal first: the chain keeps the order things became durable.
        drop(self.lock_in_order()?);
        self.commit.append(
            events,
            Vec::new(),
            || self.lock(),
            |conn, all, seen| self.write_calls(conn, all, seen),
        )
    }

    fn append_call(
        &self,
        events: Vec<NewEvent>,
        observations: Vec<NewObservation>,
    ) -> anyhow::Result<()> {
        if events.is_empty() && observations.is_empty() {
            return Ok(());
        }
        self.journal
            .append(|| self.lock(), &events, &observations)
            .with_context(|| self.context("recording a call in the trace journal"))?;
        self.start_mover();
        Ok(())
    }

    fn move_journals(&self) -> anyhow::Result<()> {
        drop(self.lock_all_moved()?);
        Ok(())
    }

    fn trace(&self, after_seq: i64, limit: usize) -> anyhow::Result<Vec<TraceEvent>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let conn = self.lock_all_moved()?;
        let run = || -> rusqlite::Result<Vec<TraceEvent>> {
            let mut stmt = conn.prepare(&format!(
                "SELECT {TRACE_COLUMNS} FROM trace_events WHERE seq > ?1 ORDER BY seq LIMIT ?2"
            ))?;
            stmt.query_map(params![after_seq, limit], |r| rows::trace_event(r))?
                .collect()
        };
        run().with_context(|| self.context("reading the trace"))
    }

    fn trace_window(
        &self,
        before: i64,
        from: i64,
        kinds: &[&str],
    ) -> anyhow::Result<Vec<TraceEvent>> {
        let kinds = serde_json::to_string(kinds)?;
        let conn = self.lock_all_moved()?;
        let run = || -> rusqlite::Result<Vec<TraceEvent>> {
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {TRACE_COLUMNS} FROM trace_events WHERE seq < ?1 AND seq >= ?2 \
                 AND kind IN (SELECT value FROM json_each(?3)) ORDER BY seq DESC"
            ))?;
            stmt.query_map(params![before, from, kinds], |r| rows::trace_event(r))?
                .collect()
        };
        run().with_context(|| self.context("reading a window of the trace"))
    }

    fn verify_trace_against(
        &self,
        checkpoints: &[(usize, Checkpoint)],
    ) -> anyhow::Result<TraceVerification> {
        let mut conn = self.lock();
        // Every journal's records first: a journal that cannot be moved is a finding.
        let journals = self
            .journal
            .ingest(&mut conn, None, false)
            .with_context(|| self.context("moving the trace journals into the trace"))?;
        let mut run = || -> anyhow::Result<TraceVerification> {
            // One read transaction: a consistent view even while others append.
            let tx = conn.transaction_with_behavior(TransactionBehavior::Deferred)?;
            let mark = tx
                .prepare_cached(NEWEST_MARK_SQL)?
                .query_row([], |r| rows::stored_event(r))
                .optional()?
                .map(|e| archive::Archived::from_event(&self.key, &e).map_err(|why| (e.seq, why)));
            let mut stmt = tx.prepare(&format!(
                "SELECT {TRACE_COLUMNS} FROM trace_events ORDER BY seq"
            ))?;
            let mut rows = stmt.query([])?;
            let wanted: std::collections::BTreeSet<i64> =
                checkpoints.iter().map(|(_, c)| c.seq).collect();
            let mut recorded: std::collections::BTreeMap<i64, String> = Default::default();
            let mut chain = ChainCheck::after_mark(&self.key, mark);
            while let Some(row) = rows.next()? {
                let stored = rows::stored_event(row)?;
                if wanted.contains(&stored.seq) {
                    recorded.insert(stored.seq, stored.hash.clone());
                }
                chain.next(stored)?;
            }
            let mut verified = chain.finish(checkpoints, &recorded);
            journal_findings(&mut verified, &journals.problems, self.journal.dir());
            Ok(verified)
        };
        run().with_context(|| self.context("verifying the trace"))
    }

    fn mapping_proofs(&self, name: &str) -> anyhow::Result<Vec<TraceEvent>> {
        // The kind term repeats the partial index's WHERE clause word for word, so SQLite
        // uses it.
        self.genuine_events(
            &format!(
                "SELECT {TRACE_COLUMNS} FROM trace_events \
                 WHERE kind IN ('mapping-revision', 'mapping-state-changed', 'trace-keyed') \
                 AND subject IN (?1, 'trace') ORDER BY seq"
            ),
            name,
            |kind, subject| subject == name || kind == TRACE_KEYED,
        )
        .with_context(|| self.context(&format!("reading the proofs of mapping {name:?}")))
    }

    fn connection_state(&self, name: &str) -> anyhow::Result<Option<TraceEvent>> {
        // The kind term repeats the partial index's WHERE clause word for word.
        self.genuine_events(
            &format!(
                "SELECT {TRACE_COLUMNS} FROM trace_events \
                 WHERE kind = 'connection-state' AND subject = ?1 ORDER BY seq DESC"
            ),
            name,
            |_, subject| subject == name,
        )
        .map(|events| events.into_iter().next())
        .with_context(|| self.context(&format!("reading the state of connection {name:?}")))
    }

    fn approval_proofs(&self, id: &str) -> anyhow::Result<Vec<TraceEvent>> {
        // Both terms repeat the expression index's definition word for word (migration 8).
        self.genuine_events(
            &format!(
                "SELECT {TRACE_COLUMNS} FROM trace_events \
                 WHERE kind IN ('approval-requested', 'approval-decided', 'receipt-consumed') \
                 AND json_extract(payload, '$.approval') = ?1 ORDER BY seq"
            ),
            id,
            |_, _| true,
        )
        .with_context(|| self.context(&format!("reading the proofs of approval {id:?}")))
    }

    fn intent_proofs(&self, id: &str) -> anyhow::Result<Vec<TraceEvent>> {
        self.genuine_events(&intent_proofs_sql(), id, |_, _| true)
            .with_context(|| self.context(&format!("reading the proofs of intent {id:?}")))
    }

    fn intents_open_in_trace_only(
        &self,
        mapping: &str,
        limit: usize,
    ) -> anyhow::Result<Vec<String>> {
        let conn = self.lock_all_moved()?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        conn.prepare_cached(intents_open_in_trace_only_sql())
            .and_then(|mut stmt| {
                stmt.query_map(params![mapping, limit], |r| r.get::<_, String>(0))?
                    .collect::<Result<Vec<_>, _>>()
            })
            .with_context(|| {
                self.context(&format!(
                    "listing the intents of {mapping:?} the trace leaves open"
                ))
            })
    }

    fn journal_backlog_at_open(&self) -> u64 {
        self.backlog_at_open
    }

    fn journal_backlog_bytes(&self) -> anyhow::Result<u64> {
        let conn = self.lock();
        self.journal
            .backlog_bytes(&conn)
            .with_context(|| self.context("reading the trace journals' rows"))
    }

    fn trace_missing_from(&self, seq: i64) -> anyhow::Result<u64> {
        let mark = self.archive_mark()?;
        let conn = self.lock_all_moved()?;
        let run = || -> rusqlite::Result<u64> {
            let to = mark.as_ref().map_or(0, |a| a.mark.to_seq);
            let (count, head): (i64, i64) = conn
                .prepare_cached(
                    "SELECT count(*), coalesce(max(seq), 0) FROM trace_events WHERE seq >= ?1",
                )?
                .query_row(params![seq.max(to + 1)], |r| Ok((r.get(0)?, r.get(1)?)))?;
            let below: Vec<i64> = match &mark {
                Some(a) if seq <= to => conn
                    .prepare_cached("SELECT seq FROM trace_events WHERE seq >= ?1 AND seq <= ?2")?
                    .query_map(params![seq, a.mark.to_seq], |r| r.get(0))?
                    .collect::<rusqlite::Result<_>>()?,
                _ => Vec::new(),
            };
            Ok(archive::missing_from(
                seq,
                mark.as_ref(),
                &below,
                count,
                head,
            ))
        };
        run().with_context(|| self.context("counting the trace's events"))
    }

    fn archive_mark(&self) -> anyhow::Result<Option<archive::Archived>> {
        let backend = SqliteArchive(self);
        archive::newest_mark(&backend, &self.key)
    }

    fn archive_trace(
        &self,
        request: &archive::ArchiveRequest,
    ) -> anyhow::Result<archive::ArchiveReport> {
        archive::run_pass(&SqliteArchive(self), &self.key, request)
            .with_context(|| self.context("archiving the trace"))
    }

    fn export_trace(&self, dir: &Path) -> anyhow::Result<archive::Exported> {
        archive::export(&SqliteArchive(self), &self.key, dir)
            .with_context(|| self.context("exporting the trace"))
    }

    fn trace_checkpoint(&self) -> anyhow::Result<Checkpoint> {
        let conn = self.lock_all_moved()?;
        let head: Option<(i64, String)> = conn
            .prepare_cached("SELECT seq, hash FROM trace_events ORDER BY seq DESC LIMIT 1")
            .and_then(|mut stmt| {
                stmt.query_row([], |row| Ok((row.get(0)?, row.get(1)?)))
                    .optional()
            })
            .with_context(|| self.context("reading the trace head"))?;
        let (seq, head) = head.unwrap_or((0, GENESIS_HASH.to_owned()));
        Ok(self.key.checkpoint(seq, &head, now_ms()))
    }
}

impl Approvals for SqliteStore {
    fn create_approval(
        &self,
        new: &NewApproval,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<ApprovalRecord> {
        self.create_approval_impl(new, events)
    }

    fn approval(&self, id: &str) -> anyhow::Result<Option<ApprovalRecord>> {
        self.approval_impl(id)
    }

    fn approvals(
        &self,
        state: Option<ApprovalState>,
        limit: usize,
    ) -> anyhow::Result<Vec<ApprovalRecord>> {
        self.approvals_impl(state, None, limit)
    }

    fn approvals_after(
        &self,
        state: Option<ApprovalState>,
        after: Option<(u64, &str)>,
        limit: usize,
    ) -> anyhow::Result<Vec<ApprovalRecord>> {
        self.approvals_impl(state, after, limit)
    }

    fn find_approval(&self, binding: &ReceiptBinding) -> anyhow::Result<Option<ApprovalRecord>> {
        self.find_approval_impl(binding)
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
        self.decide_approval_impl(id, decision, by, reason, ttl_ms, events)
    }

    fn consume_receipt(
        &self,
        id: &str,
        binding: &ReceiptBinding,
        how: ConsumeAs<'_>,
        intent: &NewIntent,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<Consumption> {
        self.consume_receipt_impl(id, binding, how, intent, events)
    }

    fn waiting(&self, now_ms: u64) -> anyhow::Result<Waiting> {
        self.waiting_impl(now_ms)
    }
}

impl Intents for SqliteStore {
    fn create_intent(&self, intent: &NewIntent, events: Vec<NewEvent>) -> anyhow::Result<()> {
        self.create_intent_impl(intent, events)
    }

    fn set_intent_state(
        &self,
        id: &str,
        state: IntentState,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<()> {
        self.set_intent_state_impl(id, state, events, &[], &[])
    }

    fn finish_intent(
        &self,
        id: &str,
        state: IntentState,
        events: Vec<NewEvent>,
        observations: Vec<NewObservation>,
        handles: Vec<IntentHandle>,
    ) -> anyhow::Result<()> {
        self.set_intent_state_impl(id, state, events, &observations, &handles)
    }

    fn intent(&self, id: &str) -> anyhow::Result<Option<IntentRecord>> {
        self.intent_impl(id)
    }

    fn attempt_sending(&self, intent: &str, attempt: u32) -> anyhow::Result<()> {
        self.attempt_sending_impl(intent, attempt)
    }

    fn attempt_answered(
        &self,
        intent: &str,
        attempt: u32,
        request_id: &str,
        answered: bool,
    ) -> anyhow::Result<()> {
        self.attempt_answered_impl(intent, attempt, request_id, answered)
    }

    fn advance_attempt(&self, intent: &str, attempt: u32, to: AttemptState) -> anyhow::Result<()> {
        self.advance_attempt_impl(intent, attempt, to)
    }

    fn new_attempt(&self, intent: &str) -> anyhow::Result<u32> {
        self.new_attempt_impl(intent)
    }

    fn attempts(&self, intent: &str) -> anyhow::Result<Vec<AttemptRecord>> {
        self.attempts_impl(intent)
    }

    fn intents(&self, filter: &IntentFilter) -> anyhow::Result<Vec<IntentRecord>> {
        self.intents_impl(filter)
    }

    fn resolve_intent(
        &self,
        id: &str,
        resolution: &Resolution,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<IntentRecord> {
        self.resolve_intent_impl(id, resolution, events)
    }
}

/// Adds what the trace journals' last pass found to `verified`: a journal that could not
/// be moved into the trace is the first finding after the chain's own (at the seq its
/// records would have taken), and the coverage says what was checked.
fn journal_findings(verified: &mut TraceVerification, problems: &[(String, String)], dir: &Path) {
    if let Some((_, why)) = problems.first()
        && verified.first_bad.is_none()
    {
        let next = i64::try_from(verified.events)
            .unwrap_or(i64::MAX)
            .saturating_add(1);
        verified.first_bad = Some((
            next,
            format!(
                "{why} (the trace journal's records would follow event {}; {} journal(s) in {} could not be moved)",
                verified.events,
                problems.len(),
                dir.display()
            ),
        ));
    }
    verified.coverage.push(format!(
        "trace journals: every record of {} was moved into the chain before it was checked{}",
        dir.display(),
        if problems.is_empty() {
            String::new()
        } else {
            format!(", except {} journal(s) that could not be", problems.len())
        }
    ));
}

/// `events` with `"revision": revision` added to each object payload.
fn with_revision(mut events: Vec<NewEvent>, revision: i64) -> Vec<NewEvent> {
    for e in &mut events {
        if let Some(map) = e.payload.as_object_mut() {
            map.insert("revision".into(), revision.into());
        }
    }
    events
}

/// One trace row as stored.
#[derive(Debug)]
pub(crate) struct StoredEvent {
    seq: i64,
    at: i64,
    kind: String,
    subject: String,
    payload: String,
    prev_hash: String,
    hash: String,
    key_id: Option<String>,
}

impl StoredEvent {
    /// Whether this event is MACed with `key` (its `key_id`) and its stored bytes still
    /// match that MAC: an authentic event, whatever its place in the chain.
    pub(crate) fn is_genuine(&self, key: &TraceKey) -> bool {
        self.key_id.as_deref() == Some(key.id())
            && key.verify_event(
                self.seq,
                self.at,
                &self.kind,
                &self.subject,
                &self.payload,
                &self.prev_hash,
                &self.hash,
            )
    }
}

/// The verification of a chain, one stored event at a time (in seq order).
pub(crate) struct ChainCheck<'k> {
    key: &'k TraceKey,
    events: u64,
    expected_seq: i64,
    prev: String,
    /// Seq of the first keyed event seen.
    keyed_from: Option<i64>,
    unkeyed: u64,
    first_bad: Option<(i64, String)>,
    /// The store's newest archive mark: the events up to its `to_seq` are only checked
    /// one by one (and must be ones it kept), the chain starts after it.
    archived: Option<archive::Archived>,
    /// The kept events up to the mark seen so far.
    kept_seen: u64,
}

impl<'k> ChainCheck<'k> {
    /// The check of a whole trace, from event 1 and 64 zeros.
    pub(crate) fn new(key: &'k TraceKey) -> Self {
        Self::starting(key, 1, GENESIS_HASH.to_owned())
    }

    /// The check of a run of events that starts at `seq` and links to `prev` (a segment).
    pub(crate) fn starting(key: &'k TraceKey, seq: i64, prev: String) -> Self {
        Self {
            key,
            events: 0,
            expected_seq: seq,
            prev,
            keyed_from: None,
            unkeyed: 0,
            first_bad: None,
            archived: None,
            kept_seen: 0,
        }
    }

    /// The check of a store whose newest archive mark is `mark` (verified), or whose mark
    /// is bad (`Err((seq, why))`: the fault is reported first, and the chain is checked
    /// from event 1).
    pub(crate) fn after_mark(
        key: &'k TraceKey,
        mark: Option<Result<archive::Archived, (i64, String)>>,
    ) -> Self {
        match mark {
            None => Self::new(key),
            Some(Err(fault)) => {
                let mut check = Self::new(key);
                check.first_bad = Some(fault);
                check
            }
            Some(Ok(a)) => {
                let mut check = Self::starting(key, a.mark.to_seq + 1, a.mark.head.clone());
                check.archived = Some(a);
                check
            }
        }
    }

    /// The first fault so far.
    pub(crate) fn first_bad(&self) -> Option<&(i64, String)> {
        self.first_bad.as_ref()
    }

    pub(crate) fn next(&mut self, e: StoredEvent) -> anyhow::Result<()> {
        self.events += 1;
        if let Some(a) = self.archived.take_if(|a| e.seq <= a.mark.to_seq) {
            let fault = self.check_below_mark(&a, &e);
            self.archived = Some(a);
            if self.first_bad.is_none() {
                self.first_bad = fault;
            }
            return Ok(());
        }
        if self.first_bad.is_none() {
            self.first_bad = self.check(&e)?;
        }
        if e.key_id.is_some() && self.keyed_from.is_none() {
            self.keyed_from = Some(e.seq);
        } else if e.key_id.is_none() && self.keyed_from.is_none() {
            self.unkeyed += 1;
        }
        self.expected_seq = e.seq.saturating_add(1);
        self.prev = e.hash;
        Ok(())
    }

    /// Checks one stored event against the chain so far; `Some((seq, why))` when it is bad.
    fn check(&self, e: &StoredEvent) -> anyhow::Result<Option<(i64, String)>> {
        let (seq, expected_seq, prev) = (e.seq, self.expected_seq, self.prev.as_str());
        if seq != expected_seq {
            let why = if expected_seq == 1 {
                format!(
                    "event {expected_seq} is missing: the trace starts at event {seq} (events \
                     were deleted or renumbered)"
                )
            } else if seq > expected_seq {
                format!(
                    "event {expected_seq} is missing: event {} is followed by event {seq} \
                     (events were deleted or renumbered)",
                    expected_seq - 1
                )
            } else {
                format!(
                    "event {seq} is out of order after event {}",
                    expected_seq - 1
                )
            };
            return Ok(Some((expected_seq, why)));
        }
        if e.prev_hash != prev {
            let why = if seq == 1 {
                format!(
                    "event 1 does not start the chain: its prev_hash is {}, not 64 zeros \
                     (the chain was altered)",
                    e.prev_hash
                )
            } else {
                format!(
                    "event {seq} does not link to event {}: its prev_hash is {} but \
                     event {}'s hash is {prev} (an event was altered, removed or inserted)",
                    seq - 1,
                    e.prev_hash,
                    seq - 1
                )
            };
            return Ok(Some((seq, why)));
        }
        let Some(key_id) = &e.key_id else {
            return self.check_unkeyed(e);
        };
        if key_id != self.key.id() {
            return Ok(Some((
                seq,
                format!(
                    "event {seq} is MACed with key {key_id}, not with this host's key {} \
                     ({}): verify with the key that wrote the trace",
                    self.key.id(),
                    self.key.source()
                ),
            )));
        }
        if !self.key.verify_event(
            seq,
            e.at,
            &e.kind,
            &e.subject,
            &e.payload,
            &e.prev_hash,
            &e.hash,
        ) {
            return Ok(Some((
                seq,
                format!(
                    "event {seq} was altered: its stored bytes (time, kind, subject, payload \
                     or link) no longer match its MAC"
                ),
            )));
        }
        Ok(None)
    }

    /// An event stored up to the archive mark `a`: it must be MACed with the key (kept
    /// events are keyed; one still awaiting deletion was checked in its segment and must
    /// still be genuine), and counts toward the kept ones when `a` lists it.
    fn check_below_mark(
        &mut self,
        a: &archive::Archived,
        e: &StoredEvent,
    ) -> Option<(i64, String)> {
        let seq = e.seq;
        let genuine = e.is_genuine(self.key);
        if a.mark.kept.binary_search(&seq).is_ok() {
            self.kept_seen += 1;
        }
        (!genuine).then(|| {
            (
                seq,
                format!(
                    "event {seq}, kept in the store when events up to {} were archived (event \
                     {}), was altered: its stored bytes no longer match its MAC under this \
                     host's key",
                    a.mark.to_seq, a.event_seq
                ),
            )
        })
    }

    /// An event from before schema 7: unkeyed, so accepted only before the first keyed
    /// one, in the canonical form the store wrote, with its sha256 hash.
    fn check_unkeyed(&self, e: &StoredEvent) -> anyhow::Result<Option<(i64, String)>> {
        let seq = e.seq;
        if let Some(first) = self.keyed_from {
            return Ok(Some((
                seq,
                format!(
                    "event {seq} has no MAC although event {first} before it has one: only \
                     events written before the key (schema 7) may lack one, so the chain \
                     from here was rewritten without the key"
                ),
            )));
        }
        let Ok(at_ms) = u64::try_from(e.at) else {
            return Ok(Some((
                seq,
                format!("event {seq} has a negative time {}", e.at),
            )));
        };
        let canonical_text = match serde_json::from_str::<serde_json::Value>(&e.payload)
            .map_err(anyhow::Error::from)
            .and_then(|v| trace::canonical(&v))
        {
            Ok(text) => text,
            Err(err) => {
                return Ok(Some((
                    seq,
                    format!("event {seq}'s payload is not valid JSON ({err}); it was altered"),
                )));
            }
        };
        if canonical_text != e.payload {
            return Ok(Some((
                seq,
                format!(
                    "event {seq}'s payload is not the canonical JSON the store writes (a \
                     duplicated key, reordered keys or added spaces): it was altered"
                ),
            )));
        }
        let recomputed =
            trace::chained_hash(seq, at_ms, &e.kind, &e.subject, &e.payload, &e.prev_hash)?;
        if recomputed != e.hash {
            return Ok(Some((
                seq,
                format!(
                    "event {seq} was altered: its contents (time, kind, subject or payload) no \
                     longer match its recorded hash"
                ),
            )));
        }
        Ok(None)
    }

    /// The result, after every event was read: the chain's first fault, else the first
    /// checkpoint that does not hold.
    fn finish(
        mut self,
        checkpoints: &[(usize, Checkpoint)],
        recorded: &std::collections::BTreeMap<i64, String>,
    ) -> TraceVerification {
        let last = self.expected_seq - 1;
        if let Some(a) = &self.archived
            && self.first_bad.is_none()
            && self.kept_seen < a.mark.kept.len() as u64
        {
            self.first_bad = Some((
                a.mark.to_seq,
                format!(
                    "{} of the {} events kept in the store when events up to {} were archived \
                     (event {}) are missing: proofs still needed were deleted",
                    a.mark.kept.len() as u64 - self.kept_seen,
                    a.mark.kept.len(),
                    a.mark.to_seq,
                    a.event_seq
                ),
            ));
        }
        if self.first_bad.is_none() && self.events > 0 && self.keyed_from.is_none() {
            self.first_bad = Some((
                last,
                format!(
                    "no event is MACed with a key: this build MACs every event and marks an \
                     older trace with a `{TRACE_KEYED}` event when it opens it, so the whole \
                     trace was rewritten without the key"
                ),
            ));
        }
        let mut anchored: Option<i64> = None;
        let mut archived_points = 0u64;
        for (line, c) in checkpoints {
            let fault = if !self.key.verifies(c) {
                Some((
                    c.seq,
                    format!(
                        "the checkpoint on line {line} does not verify with this host's key \
                         {} (it names key {}): it was edited, or written with another key",
                        self.key.id(),
                        c.key_id
                    ),
                ))
            } else if c.seq > last {
                let when = time_text(c.at_ms);
                Some((
                    last + 1,
                    if last == 0 {
                        format!(
                            "the whole trace is missing: the checkpoint on line {line} \
                             ({when}) says it reached event {}, and no event is left (every \
                             event was deleted)",
                            c.seq
                        )
                    } else {
                        format!(
                            "events {}..={} are missing: the checkpoint on line {line} \
                             ({when}) says the trace reached event {}, but it ends at event \
                             {last} (the newest events were deleted)",
                            last + 1,
                            c.seq,
                            c.seq
                        )
                    },
                ))
            } else if let Some(a) = self
                .archived
                .as_ref()
                .filter(|a| c.seq <= a.mark.to_seq && !recorded.contains_key(&c.seq))
            {
                if c.seq == a.mark.to_seq && c.head != a.mark.head {
                    Some((
                        c.seq,
                        format!(
                            "event {}'s MAC is not the one the checkpoint on line {line} \
                             recorded ({}), but the archive mark (event {}) says {}: the \
                             chain up to it was rewritten",
                            c.seq, c.head, a.event_seq, a.mark.head
                        ),
                    ))
                } else {
                    archived_points += 1;
                    None
                }
            } else if c.seq > 0 && recorded.get(&c.seq) != Some(&c.head) {
                Some((
                    c.seq,
                    format!(
                        "event {}'s MAC is not the one the checkpoint on line {line} recorded \
                         ({}): the chain up to it was rewritten",
                        c.seq, c.head
                    ),
                ))
            } else {
                anchored = anchored.max(Some(c.seq));
                None
            };
            if self.first_bad.is_none() {
                self.first_bad = fault;
            }
        }
        let mut coverage = Vec::new();
        if let Some(a) = &self.archived {
            coverage.push(format!(
                "events 1..={}: archived into segments, the newest ({}) sealed by event {} \
                 with its head; {} of them kept in the store, each MAC-checked on its own; \
                 `airlock trace verify --archive DIR` checks the segments",
                a.mark.to_seq,
                a.mark.segment,
                a.event_seq,
                a.mark.kept.len()
            ));
        }
        if archived_points > 0 {
            coverage.push(format!(
                "{archived_points} checkpoint(s) name archived events: --archive DIR checks them \
                 against the segments"
            ));
        }
        match self.keyed_from {
            Some(first) if last >= first => coverage.push(format!(
                "events {first}..={last}: each MACed with key {} ({}) over its stored bytes \
                 and the previous event's MAC",
                self.key.id(),
                self.key.source()
            )),
            _ => {}
        }
        if self.unkeyed > 0 {
            coverage.push(format!(
                "events 1..={}: written before the trace was keyed (schema 7); each is checked \
                 by the unkeyed sha256 chain and its canonical form, and their head is MACed \
                 by event {}, so they cannot change without the key either",
                self.unkeyed,
                self.unkeyed + 1
            ));
        }
        match anchored {
            None if checkpoints.is_empty() => coverage.push(
                "no checkpoint given: deleted newest events, or a deleted trace, cannot be \
                 seen without one (--checkpoint FILE)"
                    .into(),
            ),
            None => coverage.push("no checkpoint held".into()),
            Some(seq) if seq < last => coverage.push(format!(
                "anchored by checkpoints up to event {seq}; events {}..={last} are not \
                 anchored yet",
                seq + 1
            )),
            Some(seq) => coverage.push(format!("anchored by checkpoints up to event {seq}")),
        }
        TraceVerification {
            events: self.events,
            archived_to: self.archived.as_ref().map(|a| a.mark.to_seq),
            head: self.prev,
            first_bad: self.first_bad,
            key_id: self.key.id().to_owned(),
            key_source: self.key.source().to_string(),
            unkeyed: self.unkeyed,
            checkpoints: checkpoints.len() as u64,
            anchored_seq: anchored,
            coverage,
        }
    }
}

/// A unix-ms time as RFC 3339 (UTC, seconds).
fn time_text(ms: u64) -> String {
    humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// Events missing from the seqs `from..=head` when `count` of them are stored (0 for an
/// empty range).
pub(crate) fn missing(from: i64, count: i64, head: i64) -> u64 {
    let expected = if head >= from { head - from + 1 } else { 0 };
    u64::try_from(expected - count).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use sha2::{Digest as _, Sha256};

    fn open_temp() -> (tempfile::TempDir, SqliteStore) {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(&dir.path().join("state")).unwrap();
        (dir, store)
    }

    /// A caller can hold only the concerns it uses, and [`Store`] is every concern at
    /// once: what one concern writes, another reads, through the same store.
    #[test]
    fn each_concern_is_a_trait_of_its_own_and_a_store_is_all_of_them() {
        fn record(trace: &dyn Trace) -> TraceEvent {
            trace.append_trace("test", "s", &json!({"n": 1})).unwrap()
        }
        fn newest(store: &dyn Store) -> Option<TraceEvent> {
            store.trace(0, 100).unwrap().pop()
        }
        let (_dir, store) = open_temp();
        let written = record(&store);
        let hosts: &dyn Hosts = &store;
        assert!(!hosts.is_shared(), "the embedded store serves one host");
        assert_eq!(newest(&store), Some(written));
    }

    /// The trace's commits do not checkpoint: the store's thread does, once the WAL passes
    /// its threshold, and the store's files are as SQLite leaves them when it closes.
    #[test]
    fn the_stores_checkpoints_run_on_its_thread() {
        let (dir, store) = open_temp();
        assert_eq!(store.wal_checkpoints(), Some(0));
        let big = "x".repeat(3000);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let mut n = 0;
        while store.wal_checkpoints() == Some(0) {
            assert!(
                std::time::Instant::now() < deadline,
                "no checkpoint after {n} commits"
            );
            store
                .append_trace("test", "s", &json!({"n": n, "pad": big}))
                .unwrap();
            n += 1;
        }
        drop(store);
        let state = dir.path().join("state");
        assert!(
            !state.join("airlock.db-wal").exists(),
            "the last close removes the WAL"
        );
    }

    /// The plan of `sql` with `params`, one step per line.
    fn plan(store: &SqliteStore, sql: &str, params: impl rusqlite::Params) -> String {
        let conn = store.lock();
        let mut stmt = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
        let steps: Vec<String> = stmt
            .query_map(params, |row| row.get::<_, String>(3))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        steps.join("\n")
    }

    /// An intent's proofs and the trace's open intents are read through the intent
    /// indexes, never by scanning the trace (which grows with every call).
    #[test]
    fn intent_proofs_and_open_intents_read_the_intent_indexes() {
        let (_dir, store) = open_temp();
        let proofs = plan(&store, &intent_proofs_sql(), params!["int_1"]);
        assert!(proofs.contains("trace_events_intent_proofs"), "{proofs}");
        assert!(proofs.contains("trace_events_intent_states"), "{proofs}");
        assert!(!proofs.contains("SCAN trace_events"), "{proofs}");
        let open = plan(&store, intents_open_in_trace_only_sql(), params!["m", 10]);
        assert!(open.contains("trace_events_intent_proofs"), "{open}");
        assert!(open.contains("trace_events_intent_states"), "{open}");
    }

    /// A raw connection to the store's file, as an attacker with file access would use.
    fn raw(store: &SqliteStore) -> Connection {
        let conn = Connection::open(store.path()).unwrap();
        conn.busy_timeout(BUSY_TIMEOUT).unwrap();
        conn
    }

    fn digest_of(n: u32) -> String {
        hex::encode(Sha256::digest(n.to_le_bytes()))
    }

    #[test]
    fn a_schema_1_database_is_migrated_in_place_and_keeps_its_rows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(DATABASE_FILE);
        {
            let conn = rusqlite::Connection::open(&path).unwrap();
            conn.execute_batch(MIGRATIONS[0]).unwrap();
            conn.execute_batch(
                "INSERT INTO mappings (name, revision, manifest_digest, component_sha256, \
                 connection_id, config_revision, snapshot_digest, pins, state, reviewer, \
                 reason, created_ms, state_changed_ms) VALUES ('old', 1, 'm', 'c', \
                 'conn-000000000000', 1, NULL, '{}', 'active', 'alice', 'approved', 1, 1); \
                 PRAGMA user_version = 1;",
            )
            .unwrap();
        }
        let store = SqliteStore::open_file(&path).unwrap();
        let old = store.mapping("old").unwrap().unwrap();
        assert_eq!(old.state, MappingState::Active);
        assert_eq!(old.reviewer.as_deref(), Some("alice"));
        assert_eq!(old.manifest_text, None);
        let mut next = new_mapping("old", MappingState::Active);
        next.manifest_text = Some("[mapping]\nname = \"old\"\n".into());
        let rec = store.add_mapping_revision(&next).unwrap();
        assert_eq!(rec.revision, 2);
        assert_eq!(
            store.mapping("old").unwrap().unwrap().manifest_text,
            next.manifest_text
        );
        drop(store);
        let conn = rusqlite::Connection::open(&path).unwrap();
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version, SCHEMA_VERSION);
    }

    fn new_mapping(name: &str, state: MappingState) -> NewMappingRevision {
        NewMappingRevision {
            name: name.into(),
            manifest_digest: digest_of(1),
            component_sha256: digest_of(2),
            connection_id: "conn-000000000000".into(),
            config_revision: 1,
            snapshot_digest: Some(digest_of(3)),
            pins: json!({"search": {"schema": digest_of(4)}}),
            state,
            reviewer: Some("alice".into()),
            reason: "initial review".into(),
            manifest_text: None,
        }
    }

    #[test]
    fn fresh_directory_is_migrated_to_current_schema_in_wal() {
        let (dir, store) = open_temp();
        assert_eq!(
            store.path(),
            dir.path().join("state").join(DATABASE_FILE).as_path()
        );
        let conn = raw(&store);
        let version: i64 = conn
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .unwrap();
        assert_eq!(version, SCHEMA_VERSION);
        let mode: String = conn
            .pragma_query_value(None, "journal_mode", |r| r.get(0))
            .unwrap();
        assert_eq!(mode, "wal");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let dir_mode = std::fs::metadata(dir.path().join("state"))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(dir_mode & 0o077, 0, "state directory is private");
            let file_mode = std::fs::metadata(store.path())
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(file_mode & 0o077, 0, "database file is private");
        }
        assert!(store.connections().unwrap().is_empty());
        assert!(store.mappings().unwrap().is_empty());
        let verification = store.verify_trace().unwrap();
        assert_eq!(verification.events, 0);
        assert_eq!(verification.head, GENESIS_HASH);
        assert_eq!(verification.first_bad, None);
    }

    #[test]
    fn reopening_keeps_data() {
        let dir = tempfile::tempdir().unwrap();
        let id = {
            let store = SqliteStore::open(dir.path()).unwrap();
            store.append_trace("test", "s", &json!({"n": 1})).unwrap();
            store
                .connection_revision("notes", "d1", &json!({"command": "notes"}))
                .unwrap()
                .connection_id
        };
        let store = SqliteStore::open(dir.path()).unwrap();
        let record = store.connection("notes").unwrap().unwrap();
        assert_eq!(record.connection_id, id);
        assert_eq!(record.config, json!({"command": "notes"}));
        assert_eq!(store.trace(0, 10).unwrap().len(), 1);
        assert_eq!(store.verify_trace().unwrap().first_bad, None);
    }

    #[test]
    fn newer_schema_is_refused_and_file_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(DATABASE_FILE);
        {
            let conn = Connection::open(&path).unwrap();
            conn.execute_batch(&format!(
                "CREATE TABLE future (x); PRAGMA user_version = {};",
                SCHEMA_VERSION + 1
            ))
            .unwrap();
        }
        let before = std::fs::read(&path).unwrap();
        let err = SqliteStore::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("written by a newer Airlock"), "{err}");
        assert!(
            err.contains(&format!(
                "schema {}; this build knows up to {SCHEMA_VERSION}",
                SCHEMA_VERSION + 1
            )),
            "{err}"
        );
        assert!(err.contains("nothing was changed"), "{err}");
        assert!(err.contains(&path.display().to_string()), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), before);
        assert!(!dir.path().join("airlock.db-wal").exists());
    }

    #[test]
    fn garbage_file_is_refused_and_file_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(DATABASE_FILE);
        let garbage: Vec<u8> = b"this is not a database, just some text\n"
            .iter()
            .copied()
            .cycle()
            .take(8192)
            .collect();
        std::fs::write(&path, &garbage).unwrap();
        let err = SqliteStore::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("is not a readable SQLite database"), "{err}");
        assert!(
            err.contains("file is not a database"),
            "sqlite's own words: {err}"
        );
        assert!(err.contains("move it aside"), "{err}");
        assert!(err.contains("nothing was changed"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), garbage);
        assert!(!dir.path().join("airlock.db-wal").exists());
    }

    #[test]
    fn foreign_sqlite_database_is_refused_and_file_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(DATABASE_FILE);
        {
            let conn = Connection::open(&path).unwrap();
            conn.execute_batch("CREATE TABLE photos (id INTEGER PRIMARY KEY, path TEXT);")
                .unwrap();
        }
        let before = std::fs::read(&path).unwrap();
        let err = SqliteStore::open_file(&path).unwrap_err().to_string();
        assert!(err.contains("not written by Airlock"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), before);
    }

    #[test]
    fn empty_file_becomes_a_new_database() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty.db");
        std::fs::write(&path, b"").unwrap();
        let store = SqliteStore::open_file(&path).unwrap();
        store.append_trace("k", "s", &json!(null)).unwrap();
    }

    #[test]
    fn connection_ids_are_stable_and_revisions_follow_digests() {
        let (_dir, store) = open_temp();
        let first = store
            .connection_revision("notes", "digest-a", &json!({"v": 1}))
            .unwrap();
        assert!(first.created);
        assert_eq!(first.revision, 1);
        assert_eq!(first.name, "notes");
        let suffix = first.connection_id.strip_prefix("conn-").unwrap();
        assert_eq!(suffix.len(), 12);
        assert!(
            suffix
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        );

        let again = store
            .connection_revision("notes", "digest-a", &json!({"v": 1}))
            .unwrap();
        assert_eq!(again.connection_id, first.connection_id);
        assert_eq!(again.revision, 1);
        assert!(!again.created);

        let second = store
            .connection_revision("notes", "digest-b", &json!({"v": 2}))
            .unwrap();
        assert_eq!(second.connection_id, first.connection_id);
        assert_eq!(second.revision, 2);
        assert!(second.created);

        let old = store
            .connection_revision("notes", "digest-a", &json!({"v": "ignored"}))
            .unwrap();
        assert_eq!(old.revision, 1);
        assert!(!old.created);

        let latest = store.connection("notes").unwrap().unwrap();
        assert_eq!(latest.revision, 2);
        assert_eq!(latest.config_digest, "digest-b");
        assert_eq!(latest.config, json!({"v": 2}));
        assert!(store.connection("absent").unwrap().is_none());
        assert!(store.connection_revision("", "d", &json!({})).is_err());
    }

    #[test]
    fn two_names_never_share_ids() {
        let (_dir, store) = open_temp();
        let mut ids = std::collections::BTreeSet::new();
        for i in 0..20 {
            let r = store
                .connection_revision(&format!("server-{i}"), "same-digest", &json!({}))
                .unwrap();
            assert_eq!(r.revision, 1);
            assert!(ids.insert(r.connection_id));
        }
        let listed = store.connections().unwrap();
        assert_eq!(listed.len(), 20);
        assert!(listed.windows(2).all(|w| w[0].name < w[1].name));
    }

    #[test]
    fn snapshots_are_stored_once_and_observed_each_time() {
        let (_dir, store) = open_temp();
        let conn = store.connection_revision("notes", "d", &json!({})).unwrap();
        let digest = digest_of(10);
        let body = json!({"tools": [{"name": "search"}], "protocol": "2025-06-18"});
        let first = store
            .put_snapshot(&digest, &conn.connection_id, 1, &body)
            .unwrap();
        assert!(first.new);
        let second = store
            .put_snapshot(&digest, &conn.connection_id, 1, &body)
            .unwrap();
        assert!(!second.new);
        assert!(second.observed_at_ms >= first.observed_at_ms);

        let stored = store.snapshot(&digest).unwrap().unwrap();
        assert_eq!(stored.body, body);
        assert_eq!(stored.observations, 2);
        assert_eq!(stored.first_seen_ms, first.observed_at_ms);
        assert_eq!(stored.last_seen_ms, second.observed_at_ms);

        let by_prefix = store.snapshot(&digest[..8]).unwrap().unwrap();
        assert_eq!(by_prefix.digest, digest);
        let upper = store
            .snapshot(&digest[..12].to_uppercase())
            .unwrap()
            .unwrap();
        assert_eq!(upper.digest, digest);
        assert!(store.snapshot(&digest[..7]).is_err(), "prefix too short");
        assert!(store.snapshot("not-hex!").is_err());

        // Immutable: a different body under the same digest is refused.
        let err = store
            .put_snapshot(&digest, &conn.connection_id, 1, &json!({"tools": []}))
            .unwrap_err();
        assert!(format!("{err:#}").contains("different body"), "{err:#}");
        // Unknown connection revision is refused.
        assert!(
            store
                .put_snapshot(&digest_of(11), &conn.connection_id, 9, &body)
                .is_err()
        );
        // The trigger refuses rewriting a body even with raw SQL.
        assert!(
            raw(&store)
                .execute("UPDATE snapshots SET body = '{}'", [])
                .is_err()
        );
    }

    #[test]
    fn ambiguous_prefix_names_the_count() {
        let (_dir, store) = open_temp();
        let conn = store.connection_revision("notes", "d", &json!({})).unwrap();
        let a = format!("abcdef01{}", "0".repeat(56));
        let b = format!("abcdef01{}", "1".repeat(56));
        let c = format!("abcdef02{}", "2".repeat(56));
        for (i, d) in [&a, &b, &c].into_iter().enumerate() {
            store
                .put_snapshot(d, &conn.connection_id, 1, &json!({"i": i}))
                .unwrap();
        }
        let err = format!("{:#}", store.snapshot("abcdef01").unwrap_err());
        assert!(err.contains("ambiguous"), "{err}");
        assert!(err.contains("matches 2 snapshots"), "{err}");
        let err = format!("{:#}", store.snapshot("abcdef0").unwrap_err());
        assert!(err.contains("too short"), "{err}");
        assert_eq!(store.snapshot("abcdef02").unwrap().unwrap().digest, c);
        assert!(store.snapshot("abcdef03").unwrap().is_none());
    }

    #[test]
    fn latest_snapshot_and_listing_follow_observations() {
        let (_dir, store) = open_temp();
        let notes = store.connection_revision("notes", "d", &json!({})).unwrap();
        let other = store.connection_revision("other", "d", &json!({})).unwrap();
        let (a, b) = (digest_of(20), digest_of(21));
        store
            .put_snapshot(&a, &notes.connection_id, 1, &json!({"a": 1}))
            .unwrap();
        store
            .put_snapshot(&b, &notes.connection_id, 1, &json!({"b": 1}))
            .unwrap();
        store
            .put_snapshot(&digest_of(22), &other.connection_id, 1, &json!({"c": 1}))
            .unwrap();
        assert_eq!(
            store
                .latest_snapshot(&notes.connection_id)
                .unwrap()
                .unwrap()
                .digest,
            b
        );
        // Seeing `a` again makes it the latest.
        store
            .put_snapshot(&a, &notes.connection_id, 1, &json!({"a": 1}))
            .unwrap();
        assert_eq!(
            store
                .latest_snapshot(&notes.connection_id)
                .unwrap()
                .unwrap()
                .digest,
            a
        );
        let listed = store.snapshots(Some(&notes.connection_id)).unwrap();
        assert_eq!(
            listed.iter().map(|s| s.digest.as_str()).collect::<Vec<_>>(),
            [a.as_str(), b.as_str()]
        );
        assert_eq!(listed[0].observations, 2);
        assert_eq!(store.snapshots(None).unwrap().len(), 3);
        assert!(store.latest_snapshot("conn-unknown").unwrap().is_none());
    }

    #[test]
    fn new_mapping_revision_makes_the_previous_historical() {
        let (_dir, store) = open_temp();
        let first = store
            .add_mapping_revision(&new_mapping("library", MappingState::Candidate))
            .unwrap();
        assert_eq!(first.revision, 1);
        let second = store
            .add_mapping_revision(&new_mapping("library", MappingState::Active))
            .unwrap();
        assert_eq!(second.revision, 2);
        let revisions = store.mapping_revisions("library").unwrap();
        assert_eq!(revisions.len(), 2);
        assert_eq!(revisions[0].revision, 1);
        assert_eq!(revisions[0].state, MappingState::Historical);
        assert!(
            revisions[0]
                .reason
                .ends_with("; superseded by revision 2 (was candidate)"),
            "{}",
            revisions[0].reason
        );
        assert_eq!(revisions[1], second);
        assert_eq!(store.mapping("library").unwrap().unwrap(), second);

        store
            .add_mapping_revision(&new_mapping("other", MappingState::Limited))
            .unwrap();
        let all = store.mappings().unwrap();
        assert_eq!(
            all.iter()
                .map(|m| (m.name.as_str(), m.revision))
                .collect::<Vec<_>>(),
            [("library", 2), ("other", 1)]
        );
        assert!(store.mapping("absent").unwrap().is_none());
        assert!(store.mapping_revisions("absent").unwrap().is_empty());
    }

    #[test]
    fn set_mapping_state_is_compare_and_set() {
        let (_dir, store) = open_temp();
        store
            .add_mapping_revision(&new_mapping("library", MappingState::Active))
            .unwrap();
        let changed = store
            .set_mapping_state(
                "library",
                MappingState::Active,
                MappingState::ReviewRequired,
                "tool schema changed",
            )
            .unwrap()
            .unwrap();
        assert_eq!(changed.state, MappingState::ReviewRequired);
        assert_eq!(changed.reason, "tool schema changed");
        assert_eq!(store.mapping("library").unwrap().unwrap(), changed);

        // Stale expectation: someone else already moved it.
        let stale = store
            .set_mapping_state(
                "library",
                MappingState::Active,
                MappingState::Degraded,
                "upstream failing",
            )
            .unwrap();
        assert_eq!(stale, None);
        assert_eq!(
            store.mapping("library").unwrap().unwrap().state,
            MappingState::ReviewRequired
        );

        // review-required never serves again.
        let err = store
            .set_mapping_state(
                "library",
                MappingState::ReviewRequired,
                MappingState::Active,
                "approve",
            )
            .unwrap_err();
        assert!(err.to_string().contains("cannot become"), "{err}");
        assert!(
            store
                .set_mapping_state("absent", MappingState::Active, MappingState::Degraded, "x")
                .is_err()
        );
    }

    #[test]
    fn transition_table_spot_checks() {
        use MappingState::*;
        for state in MappingState::ALL {
            assert!(!state.can_become(state), "{state} → itself");
            assert_eq!(MappingState::parse(state.as_str()), Some(state));
            assert_eq!(serde_json::to_value(state).unwrap(), json!(state.as_str()));
            assert_eq!(state.to_string(), state.as_str());
            if state != Historical {
                assert!(state.can_become(Historical), "{state} → historical");
            }
        }
        assert!(!ReviewRequired.can_become(Active));
        assert!(!ReviewRequired.can_become(Limited));
        assert!(ReviewRequired.can_become(Retiring));
        assert!(!Historical.can_become(Candidate));
        assert!(!Retiring.can_become(Active));
        assert!(Candidate.can_become(FixtureTested));
        assert!(!FixtureTested.can_become(Candidate));
        assert!(!FixtureTested.can_become(Degraded));
        assert!(Degraded.can_become(Active));
        assert!(Active.can_become(Limited));
        assert!(!Candidate.can_become(Degraded));
        assert_eq!(
            MappingState::ALL
                .into_iter()
                .filter(|s| s.serves())
                .collect::<Vec<_>>(),
            [Limited, Active]
        );
        assert_eq!(MappingState::parse("Active"), None);
        assert_eq!(MappingState::parse("review_required"), None);
    }

    fn three_events(store: &SqliteStore) -> Vec<TraceEvent> {
        (1..=3)
            .map(|i| {
                store
                    .append_trace("mapping.state", "library", &json!({"n": i}))
                    .unwrap()
            })
            .collect()
    }

    /// What an attacker with write access to the file does first.
    fn drop_guards(conn: &Connection) {
        conn.execute_batch(
            "DROP TRIGGER trace_events_no_update; DROP TRIGGER trace_events_no_delete;",
        )
        .unwrap();
    }

    #[test]
    fn trace_chain_verifies() {
        let (_dir, store) = open_temp();
        let events = three_events(&store);
        assert_eq!(events[0].seq, 1);
        assert_eq!(events[0].prev_hash, GENESIS_HASH);
        assert_eq!(events[1].prev_hash, events[0].hash);
        assert_eq!(events[2].prev_hash, events[1].hash);
        let expected = store.key().event_mac(
            1,
            events[0].at_ms as i64,
            "mapping.state",
            "library",
            r#"{"n":1}"#,
            GENESIS_HASH,
        );
        assert_eq!(events[0].hash, expected);
        assert_eq!(events[0].key_id.as_deref(), Some(store.key().id()));
        assert_eq!(store.trace(0, 100).unwrap(), events);
        assert_eq!(store.trace(1, 1).unwrap(), events[1..2]);
        let verification = store.verify_trace().unwrap();
        assert_eq!(verification.events, 3);
        assert_eq!(verification.head, events[2].hash);
        assert_eq!(verification.first_bad, None);

        // Raw SQL cannot update or delete while the guards stand.
        let conn = raw(&store);
        assert!(
            conn.execute("UPDATE trace_events SET kind = 'x' WHERE seq = 2", [])
                .is_err()
        );
        assert!(
            conn.execute("DELETE FROM trace_events WHERE seq = 2", [])
                .is_err()
        );
    }

    #[test]
    fn edited_payload_is_reported() {
        let (_dir, store) = open_temp();
        three_events(&store);
        let conn = raw(&store);
        drop_guards(&conn);
        conn.execute(
            "UPDATE trace_events SET payload = '{\"n\":20}' WHERE seq = 2",
            [],
        )
        .unwrap();
        let (seq, why) = store.verify_trace().unwrap().first_bad.unwrap();
        assert_eq!(seq, 2);
        assert!(why.contains("altered"), "{why}");
    }

    #[test]
    fn deleted_middle_event_is_reported() {
        let (_dir, store) = open_temp();
        three_events(&store);
        let conn = raw(&store);
        drop_guards(&conn);
        conn.execute("DELETE FROM trace_events WHERE seq = 2", [])
            .unwrap();
        let verification = store.verify_trace().unwrap();
        assert_eq!(verification.events, 2);
        let (seq, why) = verification.first_bad.unwrap();
        assert_eq!(seq, 2);
        assert!(why.contains("missing"), "{why}");
    }

    #[test]
    fn edited_prev_hash_is_reported() {
        let (_dir, store) = open_temp();
        three_events(&store);
        let conn = raw(&store);
        drop_guards(&conn);
        conn.execute(
            "UPDATE trace_events SET prev_hash = ?1 WHERE seq = 3",
            params!["ab".repeat(32)],
        )
        .unwrap();
        let (seq, why) = store.verify_trace().unwrap().first_bad.unwrap();
        assert_eq!(seq, 3);
        assert!(why.contains("does not link to event 2"), "{why}");
    }

    #[test]
    fn renumbered_events_are_reported() {
        let (_dir, store) = open_temp();
        three_events(&store);
        let conn = raw(&store);
        drop_guards(&conn);
        // Swap events 1 and 2.
        conn.execute_batch(
            "UPDATE trace_events SET seq = 100 WHERE seq = 1; \
             UPDATE trace_events SET seq = 1 WHERE seq = 2; \
             UPDATE trace_events SET seq = 2 WHERE seq = 100;",
        )
        .unwrap();
        let (seq, _why) = store.verify_trace().unwrap().first_bad.unwrap();
        assert_eq!(seq, 1);
    }

    #[test]
    fn hostile_trace_inputs_round_trip() {
        let (_dir, store) = open_temp();
        let long = "x".repeat(1 << 20);
        let cases = [
            ("it's \"quoted\"; DROP TABLE trace_events; --", "'); --"),
            ("nul\0inside", "sub\0ject\0"),
            (long.as_str(), long.as_str()),
            ("", ""),
            ("émoji 🚀 \u{202e}rtl", "\u{feff}bom"),
        ];
        for (kind, subject) in cases {
            let payload = json!({"kind": kind, "nested": [subject, 1.5, null, {"\0": true}]});
            let event = store.append_trace(kind, subject, &payload).unwrap();
            let read = store.trace(event.seq - 1, 1).unwrap();
            assert_eq!(read, std::slice::from_ref(&event));
            assert_eq!(read[0].kind, kind);
            assert_eq!(read[0].subject, subject);
            assert_eq!(read[0].payload, payload);
        }
        let verification = store.verify_trace().unwrap();
        assert_eq!(verification.events, cases.len() as u64);
        assert_eq!(verification.first_bad, None);
    }

    #[test]
    fn two_processes_append_to_one_chain() {
        let dir = tempfile::tempdir().unwrap();
        let a = SqliteStore::open(dir.path()).unwrap();
        let b = SqliteStore::open(dir.path()).unwrap();
        std::thread::scope(|scope| {
            for (store, who) in [(&a, "a"), (&b, "b")] {
                scope.spawn(move || {
                    for i in 0..50 {
                        store.append_trace("test", who, &json!({"i": i})).unwrap();
                    }
                });
            }
        });
        let verification = a.verify_trace().unwrap();
        assert_eq!(verification.events, 100);
        assert_eq!(verification.first_bad, None);
        assert_eq!(b.verify_trace().unwrap(), verification);
    }

    /// A schema 6 database with `n` unkeyed events, as an older Airlock wrote it.
    fn schema_6_with_events(path: &Path, n: i64) {
        let conn = rusqlite::Connection::open(path).unwrap();
        for m in &MIGRATIONS[..6] {
            conn.execute_batch(m).unwrap();
        }
        conn.pragma_update(None, "user_version", 6).unwrap();
        let mut prev = GENESIS_HASH.to_owned();
        for seq in 1..=n {
            let payload = json!({"n": seq});
            let hash = trace_hash(seq, 1000 + seq as u64, "old", "s", &payload, &prev).unwrap();
            conn.execute(
                "INSERT INTO trace_events (seq, at_ms, kind, subject, payload, prev_hash, hash) \
                 VALUES (?1, ?2, 'old', 's', ?3, ?4, ?5)",
                params![seq, 1000 + seq, canonical(&payload).unwrap(), prev, hash],
            )
            .unwrap();
            prev = hash;
        }
    }

    #[test]
    fn a_schema_6_trace_is_pinned_by_the_key_and_says_what_is_covered() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(DATABASE_FILE);
        schema_6_with_events(&path, 3);
        let store = SqliteStore::open_file(&path).unwrap();
        let events = store.trace(0, 100).unwrap();
        assert_eq!(events.len(), 4);
        assert!(events[..3].iter().all(|e| e.key_id.is_none()));
        let marker = &events[3];
        assert_eq!(marker.kind, TRACE_KEYED);
        assert_eq!(marker.payload["unkeyed_events"], 3);
        assert_eq!(marker.payload["unkeyed_head"], json!(events[2].hash));
        assert_eq!(marker.prev_hash, events[2].hash);
        store.append_trace("new", "s", &json!({})).unwrap();
        let v = store.verify_trace().unwrap();
        assert_eq!(v.first_bad, None, "{v:?}");
        assert_eq!((v.events, v.unkeyed), (5, 3));
        assert!(
            v.coverage
                .iter()
                .any(|l| l.starts_with("events 4..=5: each MACed")),
            "{v:?}"
        );
        assert!(
            v.coverage
                .iter()
                .any(|l| l.starts_with("events 1..=3: written before the trace was keyed")),
            "{v:?}"
        );
        drop(store);
        // Opening again adds no second marker.
        let store = SqliteStore::open_file(&path).unwrap();
        assert_eq!(store.trace(0, 100).unwrap().len(), 5);

        // An unkeyed event rewritten with a recomputed sha256 chain breaks the link the
        // marker's MAC covers.
        let conn = raw(&store);
        drop_guards(&conn);
        let payload = json!({"n": 20});
        let h1 = trace_hash(1, 1001, "old", "s", &payload, GENESIS_HASH).unwrap();
        conn.execute(
            "UPDATE trace_events SET payload = ?1, hash = ?2 WHERE seq = 1",
            params![canonical(&payload).unwrap(), h1],
        )
        .unwrap();
        let mut prev = h1;
        for seq in 2..=3i64 {
            let payload = json!({"n": seq});
            let h = trace_hash(seq, 1000 + seq as u64, "old", "s", &payload, &prev).unwrap();
            conn.execute(
                "UPDATE trace_events SET prev_hash = ?1, hash = ?2 WHERE seq = ?3",
                params![prev, h, seq],
            )
            .unwrap();
            prev = h;
        }
        let (seq, why) = store.verify_trace().unwrap().first_bad.unwrap();
        assert_eq!(seq, 4, "{why}");
        assert!(why.contains("does not link to event 3"), "{why}");
    }

    #[test]
    fn an_unkeyed_payload_that_is_not_canonical_is_reported() {
        // Before the key, the only guard on a payload's text is that the store wrote it
        // canonical: a duplicated key that parses to the same value is still caught.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(DATABASE_FILE);
        schema_6_with_events(&path, 2);
        let store = SqliteStore::open_file(&path).unwrap();
        let conn = raw(&store);
        drop_guards(&conn);
        conn.execute(
            r#"UPDATE trace_events SET payload = '{"n":7,"n":1}' WHERE seq = 1"#,
            [],
        )
        .unwrap();
        let (seq, why) = store.verify_trace().unwrap().first_bad.unwrap();
        assert_eq!(seq, 1);
        assert!(why.contains("not the canonical JSON"), "{why}");
    }

    #[test]
    fn a_trace_keyed_by_another_key_is_not_extended() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).unwrap();
        store.append_trace("k", "s", &json!({})).unwrap();
        drop(store);
        let other = TraceKey::from_bytes(&[9u8; 32], KeySource::Environment).unwrap();
        let store = SqliteStore::open_with_key(dir.path(), Some(other)).unwrap();
        let err = store.append_trace("k", "s", &json!({})).unwrap_err();
        assert!(format!("{err:#}").contains("is MACed with key"), "{err:#}");
        let (seq, why) = store.verify_trace().unwrap().first_bad.unwrap();
        assert_eq!(seq, 1);
        assert!(why.contains("not with this host's key"), "{why}");
        assert_eq!(store.trace(0, 10).unwrap().len(), 1, "nothing appended");
    }

    #[test]
    fn a_missing_key_file_is_refused_once_the_trace_is_keyed() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).unwrap();
        store.append_trace("k", "s", &json!({})).unwrap();
        drop(store);
        std::fs::remove_file(dir.path().join(key::KEY_FILE)).unwrap();
        let err = SqliteStore::open(dir.path()).unwrap_err();
        assert!(err.to_string().contains("is missing"), "{err}");
        assert!(
            !dir.path().join(key::KEY_FILE).exists(),
            "no new key was made"
        );
    }

    #[test]
    fn store_is_object_safe() {
        let (_dir, store) = open_temp();
        let shared: std::sync::Arc<dyn Store> = std::sync::Arc::new(store);
        shared.append_trace("k", "s", &json!({})).unwrap();
    }
}
