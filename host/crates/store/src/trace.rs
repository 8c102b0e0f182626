//! Appending to the trace with group commit.
//!
//! Rule: an event is acknowledged only once it is committed, and each caller learns the
//! result of the very transaction that held its events. Concurrent callers queue their
//! events and take the database lock; whoever holds it commits everything queued in one
//! transaction (group commit) and answers each queued batch; so under concurrency one
//! commit serves many calls, and a single caller pays one transaction. With SQLite in WAL mode and
//! `synchronous=NORMAL`, a committed transaction survives a crash of the process (it is in
//! the WAL file); a power loss can lose the last commits, which `synchronous=FULL` would
//! prevent at the price of an fsync per commit.
//!
//! Each event's `hash` is its MAC under the host key ([`super::key`]): one HMAC-SHA256 per
//! event over the exact text stored (the payload's canonical JSON, written once) and the
//! previous event's MAC, from a key state precomputed in memory; the head is read in the
//! same transaction, so MACing adds no database round trip. An append refuses to extend a
//! chain whose head was MACed with another key. Events from before schema 7 keep their
//! unkeyed hash, hex sha256 of the RFC 8785 canonical JSON of
//! `{"seq","at_ms","kind","subject","payload","prev_hash"}`, which `chained_hash`
//! recomputes for verification without a second serialization (a unit test holds it
//! equal to the re-parsing form).

use anyhow::Context as _;
use rusqlite::{Connection, OptionalExtension as _};
use sha2::{Digest as _, Sha256};

use super::key::TraceKey;
use super::{GENESIS_HASH, TRACE_COLUMNS, TRACE_KEYED, TraceEvent, ms_to_sql, now_ms};

/// One event to append.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    /// Event kind (see `registry::events`).
    pub kind: &'static str,
    /// What it is about (a call id, a mapping name, an approval id…).
    pub subject: String,
    /// Safe summary: digests, ids, categories; never a payload or a secret.
    pub payload: serde_json::Value,
}

impl NewEvent {
    /// An event of `kind` about `subject`.
    pub fn new(kind: &'static str, subject: impl Into<String>, payload: serde_json::Value) -> Self {
        Self {
            kind,
            subject: subject.into(),
            payload,
        }
    }
}

/// Most rows one INSERT statement writes.
const ROWS_PER_INSERT: usize = 8;

/// Columns per row.
const COLUMNS: usize = 8;

/// The head `(seq, hash)` a new event chains to, inside the open transaction on `tx`;
/// `(0, 64 zeros)` for an empty trace. Errors when the head was MACed with another key
/// than `key` (appending would leave a chain no single key verifies).
fn head(tx: &Connection, key: &TraceKey) -> anyhow::Result<(i64, String)> {
    let last: Option<(i64, String, Option<String>)> = tx
        .prepare_cached("SELECT seq, hash, key_id FROM trace_events ORDER BY seq DESC LIMIT 1")?
        .query_row([], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)))
        .optional()?;
    match last {
        None => Ok((0, GENESIS_HASH.to_owned())),
        Some((seq, _, Some(id))) if id != key.id() => anyhow::bail!(
            "the trace's newest event ({seq}) is MACed with key {id}, but this process holds \
             key {} ({}): run it with the key that wrote the trace (the state folder's {}, \
             trace_key or {}); nothing was appended",
            key.id(),
            key.source(),
            super::key::KEY_FILE,
            super::key::KEY_ENV
        ),
        Some((seq, hash, _)) => Ok((seq, hash)),
    }
}

/// The INSERT statement of `rows` rows (1..=[`ROWS_PER_INSERT`]), built once per size: the
/// per-call path formats no SQL.
fn insert_sql(rows: usize) -> &'static str {
    static SQL: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    let all = SQL.get_or_init(|| {
        (1..=ROWS_PER_INSERT)
            .map(|n| {
                let rows: Vec<String> = (0..n)
                    .map(|i| {
                        let marks: Vec<String> = (1..=COLUMNS)
                            .map(|c| format!("?{}", i * COLUMNS + c))
                            .collect();
                        format!("({})", marks.join(", "))
                    })
                    .collect();
                format!(
                    "INSERT INTO trace_events ({TRACE_COLUMNS}) VALUES {}",
                    rows.join(", ")
                )
            })
            .collect()
    });
    &all[rows - 1]
}

/// One event ready to be chained: its kind, subject, payload as the canonical JSON text to
/// store, and its time (unix ms).
pub(super) struct Row<'a> {
    pub kind: &'a str,
    pub subject: &'a str,
    pub payload: std::borrow::Cow<'a, str>,
    pub at_ms: u64,
}

/// Appends `events` inside the open write transaction on `tx`, chained after the current
/// head and MACed with `key`, all at the time of the call. Returns (first seq, last MAC).
pub(super) fn append_in(
    tx: &Connection,
    key: &TraceKey,
    events: &[NewEvent],
) -> anyhow::Result<Option<(i64, String)>> {
    let at = now_ms();
    let rows = events
        .iter()
        .map(|e| {
            Ok(Row {
                kind: e.kind,
                subject: &e.subject,
                payload: std::borrow::Cow::Owned(canonical(&e.payload)?),
                at_ms: at,
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    append_rows_in(tx, key, &rows)
}

/// Appends `rows` inside the open write transaction on `tx`, in order, chained after the
/// current head and MACed with `key`; each keeps its own time. Returns (first seq, last MAC).
pub(super) fn append_rows_in(
    tx: &Connection,
    key: &TraceKey,
    rows: &[Row<'_>],
) -> anyhow::Result<Option<(i64, String)>> {
    if rows.is_empty() {
        return Ok(None);
    }
    let (mut seq, mut prev) = head(tx, key)?;
    let first = seq + 1;
    // MACs are computed first, then rows written ROWS_PER_INSERT at a time (one statement
    // per chunk is cheaper than one per row).
    let mut macs = Vec::with_capacity(rows.len());
    for r in rows {
        seq += 1;
        let at = ms_to_sql(r.at_ms)?;
        let mac = key.event_mac(seq, at, r.kind, r.subject, &r.payload, &prev);
        macs.push((seq, at, prev, mac.clone()));
        prev = mac;
    }
    let key_id = key.id();
    for (chunk, chunk_macs) in rows
        .chunks(ROWS_PER_INSERT)
        .zip(macs.chunks(ROWS_PER_INSERT))
    {
        let mut insert = tx.prepare_cached(insert_sql(chunk.len()))?;
        let mut values: Vec<&dyn rusqlite::ToSql> = Vec::with_capacity(chunk.len() * COLUMNS);
        for (r, (seq, at, prev, mac)) in chunk.iter().zip(chunk_macs) {
            values.extend([
                seq as &dyn rusqlite::ToSql,
                at,
                &r.kind,
                &r.subject,
                &r.payload,
                prev,
                mac,
                &key_id,
            ]);
        }
        insert.execute(values.as_slice())?;
    }
    Ok(Some((first, prev)))
}

/// Appends one event inside the open write transaction on `tx` and returns it as stored.
pub(super) fn append_one(
    tx: &Connection,
    key: &TraceKey,
    kind: &str,
    subject: &str,
    payload: &serde_json::Value,
) -> anyhow::Result<TraceEvent> {
    let payload_text = canonical(payload)?;
    // The event carries the payload as stored (canonical JSON parsed back).
    let payload: serde_json::Value =
        serde_json::from_str(&payload_text).context("re-reading canonical payload")?;
    let (last, prev_hash) = head(tx, key)?;
    let seq = last + 1;
    let at_ms = now_ms();
    let at = ms_to_sql(at_ms)?;
    let hash = key.event_mac(seq, at, kind, subject, &payload_text, &prev_hash);
    tx.prepare_cached(&format!(
        "INSERT INTO trace_events ({TRACE_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)"
    ))?
    .execute(rusqlite::params![
        seq,
        at,
        kind,
        subject,
        payload_text,
        prev_hash,
        hash,
        key.id()
    ])?;
    Ok(TraceEvent {
        seq,
        at_ms,
        kind: kind.to_owned(),
        subject: subject.to_owned(),
        payload,
        prev_hash,
        hash,
        key_id: Some(key.id().to_owned()),
    })
}

/// Pins a trace written before schema 7, inside the migration's transaction on `tx`: when
/// it holds events, appends a [`TRACE_KEYED`] event naming how many unkeyed events precede
/// it and their head, and attesting the latest revision of every mapping as it stands
/// (name, revision, state, manifest and component digests, pins), so the key covers both
/// from now on.
pub(super) fn mark_keyed(tx: &Connection, key: &TraceKey) -> anyhow::Result<()> {
    let newest: Option<(i64, String)> = tx
        .query_row(
            "SELECT seq, hash FROM trace_events ORDER BY seq DESC LIMIT 1",
            [],
            |row| Ok((row.get(0)?, row.get(1)?)),
        )
        .optional()?;
    let Some((seq, hash)) = newest else {
        return Ok(());
    };
    let mut mappings = Vec::new();
    {
        let mut stmt = tx.prepare(
            "SELECT name, revision, state, manifest_digest, component_sha256, pins FROM mappings m \
             WHERE revision = (SELECT max(revision) FROM mappings WHERE name = m.name) \
             ORDER BY name",
        )?;
        let rows = stmt.query_map([], |row| {
            Ok((
                row.get::<_, String>(0)?,
                row.get::<_, i64>(1)?,
                row.get::<_, String>(2)?,
                row.get::<_, String>(3)?,
                row.get::<_, String>(4)?,
                row.get::<_, String>(5)?,
            ))
        })?;
        for row in rows {
            let (name, revision, state, manifest_digest, component_sha256, pins) = row?;
            let pins: serde_json::Value =
                serde_json::from_str(&pins).context("a mapping's pins are not JSON")?;
            mappings.push(serde_json::json!({
                "name": name,
                "revision": revision,
                "state": state,
                "manifest_digest": manifest_digest,
                "component_sha256": component_sha256,
                "pins": pins,
            }));
        }
    }
    append_one(
        tx,
        key,
        TRACE_KEYED,
        "trace",
        &serde_json::json!({
            "unkeyed_events": seq,
            "unkeyed_head": hash,
            "key_id": key.id(),
            "mappings": mappings,
        }),
    )?;
    Ok(())
}

/// RFC 8785 canonical JSON of `value` ([`airlock_core::canonical::to_string`]: trace payloads
/// stay on its fast path).
pub(super) fn canonical(value: &serde_json::Value) -> anyhow::Result<String> {
    airlock_core::canonical::to_string(value).context("canonicalizing a trace payload")
}

/// The event hash from the canonical payload text, without re-serializing the payload.
/// RFC 8785 orders object keys by UTF-16 code units: at_ms, kind, payload, prev_hash, seq,
/// subject.
pub(super) fn chained_hash(
    seq: i64,
    at_ms: u64,
    kind: &str,
    subject: &str,
    canonical_payload: &str,
    prev_hash: &str,
) -> anyhow::Result<String> {
    let mut text = String::with_capacity(canonical_payload.len() + 200);
    text.push_str("{\"at_ms\":");
    text.push_str(&serde_json_canonicalizer::to_string(&at_ms)?);
    text.push_str(",\"kind\":");
    airlock_core::canonical::push_string(kind, &mut text);
    text.push_str(",\"payload\":");
    text.push_str(canonical_payload);
    text.push_str(",\"prev_hash\":");
    airlock_core::canonical::push_string(prev_hash, &mut text);
    text.push_str(",\"seq\":");
    text.push_str(&serde_json_canonicalizer::to_string(&seq)?);
    text.push_str(",\"subject\":");
    airlock_core::canonical::push_string(subject, &mut text);
    text.push('}');
    Ok(hex::encode(Sha256::digest(text.as_bytes())))
}

/// The result slot of one queued batch, filled by whoever commits it.
pub(super) type Slot = std::sync::Arc<std::sync::OnceLock<Result<(), String>>>;

/// One queued batch: a call's events, its observations, and where its result goes.
type Batch = (Vec<NewEvent>, Vec<super::NewObservation>, Slot);

/// Events waiting for a commit. Concurrent callers queue here, then take the database
/// lock; whoever holds it commits everything queued in one transaction and fills the
/// result slot of every batch it committed. A caller returns its own batch's result, and
/// nothing else: there is no counter to infer success from.
#[derive(Default)]
pub(super) struct GroupCommit {
    queue: std::sync::Mutex<Vec<Batch>>,
    /// Transactions written (tests count them).
    transactions: std::sync::atomic::AtomicU64,
}

impl GroupCommit {
    /// Queues `events` and `observations`; returns their result slot.
    pub(super) fn enqueue(
        &self,
        events: Vec<NewEvent>,
        observations: Vec<super::NewObservation>,
    ) -> Slot {
        let slot = Slot::default();
        self.queue.lock().unwrap_or_else(|e| e.into_inner()).push((
            events,
            observations,
            slot.clone(),
        ));
        slot
    }

    /// Transactions written so far.
    #[cfg(test)]
    pub(super) fn transactions(&self) -> u64 {
        self.transactions.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether a batch waits for a commit.
    pub(super) fn has_queued(&self) -> bool {
        !self
            .queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    /// Takes everything queued (called with the database lock held).
    fn take(&self) -> Vec<Batch> {
        std::mem::take(&mut *self.queue.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Appends one call's `events` and `observations` by group commit: queues them, takes
    /// the writer's lock (`lock`), and unless an earlier holder already committed them,
    /// writes everything queued in one transaction (`write`, given the lock's guard) and
    /// answers every batch it took. Returns the result of the transaction that held this
    /// call's own batch, never another's.
    ///
    /// # Errors
    /// That transaction's error (the same words for every batch it held).
    pub(super) fn append<G>(
        &self,
        events: Vec<NewEvent>,
        observations: Vec<super::NewObservation>,
        lock: impl FnOnce() -> G,
        write: impl FnOnce(&G, &[NewEvent], &[super::NewObservation]) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        let mine = self.enqueue(events, observations);
        self.commit(&mine, lock, write)
    }

    /// The second half of [`GroupCommit::append`], for a batch queued earlier
    /// ([`GroupCommit::enqueue`]): takes the writer's lock and, unless an earlier holder
    /// already committed `mine`, writes everything queued in one transaction. Returns the
    /// result of the transaction that held `mine`.
    ///
    /// # Errors
    /// That transaction's error.
    pub(super) fn commit<G>(
        &self,
        mine: &Slot,
        lock: impl FnOnce() -> G,
        write: impl FnOnce(&G, &[NewEvent], &[super::NewObservation]) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        let guard = lock();
        let answered = |slot: &Slot| {
            slot.get().map(|r| {
                r.clone()
                    .map_err(|why| anyhow::anyhow!("appending to the trace failed: {why}"))
            })
        };
        if let Some(result) = answered(mine) {
            // Committed (or failed) by whoever held the lock before us.
            return result;
        }
        let (mut all, mut seen, mut slots) = (Vec::new(), Vec::new(), Vec::new());
        for (events, observations, slot) in self.take() {
            all.extend(events);
            seen.extend(observations);
            slots.push(slot);
        }
        let result = write(&guard, &all, &seen);
        self.transactions
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let shared = result.as_ref().map(|_| ()).map_err(|e| format!("{e:#}"));
        for slot in &slots {
            let _ = slot.set(shared.clone());
        }
        // Our own batch was among those taken (it was queued before we locked).
        answered(mine).unwrap_or(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fast_hash_equals_the_verifiers() {
        let hostile = [
            "plain",
            "quote\" backslash\\ slash/",
            "ctl \u{0} \u{1f} \u{7f} \n\r\t\u{8}\u{c}",
            "unicode é 🦀 \u{2028}\u{2029} \u{fffd}",
            "",
        ];
        for text in hostile {
            let payload = serde_json::json!({"z": text, "a": [1, 2.5, -3, 1e21], "m": {"b": null, "a": true}});
            // The fast path's own shapes: integers near the limit, nesting, insertion
            // order that is not sorted, non-ASCII keys (fallback).
            let simple = serde_json::json!({"zz": 9007199254740992u64, "b": -9007199254740992i64, "a": {"y": [true, null, text], "x": 0}, "é": 1});
            assert_eq!(
                super::canonical(&simple).unwrap(),
                serde_json_canonicalizer::to_string(&simple).unwrap()
            );
            let big = serde_json::json!({"n": 9007199254740993u64, "f": 0.1});
            assert_eq!(
                super::canonical(&big).unwrap(),
                serde_json_canonicalizer::to_string(&big).unwrap()
            );
            let canonical = serde_json_canonicalizer::to_string(&payload).unwrap();
            assert_eq!(super::canonical(&payload).unwrap(), canonical, "{text:?}");
            let fast = chained_hash(7, 1_700_000_000_123, text, text, &canonical, text).unwrap();
            let reparsed: serde_json::Value = serde_json::from_str(&canonical).unwrap();
            let slow = super::super::trace_hash(7, 1_700_000_000_123, text, text, &reparsed, text)
                .unwrap();
            assert_eq!(fast, slow, "{text:?}");
        }
    }

    /// The per-event cost of chaining, before (schema 6: the unkeyed sha256 over a
    /// canonical text built per event) and now (one HMAC-SHA256 over the stored fields from
    /// the precomputed key state), on the per-call events of a read. A measurement, not a
    /// check: `cargo test -p airlock --lib -- --ignored --nocapture per_event_chaining_cost`.
    #[test]
    #[ignore = "a measurement; run it by name"]
    fn per_event_chaining_cost() {
        let key = super::super::key::TraceKey::from_bytes(
            &[1u8; 32],
            super::super::key::KeySource::Environment,
        )
        .unwrap();
        let payload = canonical(&serde_json::json!({"outcome": "completed", "stage": "executed", "content_sha256": "f".repeat(64), "upstream_requests": 1, "session": "ses_0", "elapsed_us": 120, "stages_us": {"normalize": 5, "authorize": 8}})).unwrap();
        let prev = "a".repeat(64);
        let n = 200_000;
        let time = |f: &dyn Fn(i64) -> String| {
            let start = std::time::Instant::now();
            let mut last = String::new();
            for i in 0..n {
                last = f(i);
            }
            assert_eq!(last.len(), 64);
            start.elapsed().as_nanos() as f64 / n as f64
        };
        let before = time(&|i| {
            chained_hash(
                i,
                1_700_000_000_000,
                "call-outcome",
                "call_1",
                &payload,
                &prev,
            )
            .unwrap()
        });
        let after = time(&|i| {
            key.event_mac(
                i,
                1_700_000_000_000,
                "call-outcome",
                "call_1",
                &payload,
                &prev,
            )
        });
        println!(
            "per event ({} payload bytes): unkeyed sha256 chain {before:.0} ns, HMAC-SHA256 {after:.0} ns",
            payload.len()
        );
    }

    /// On the embedded store each call is one trace-journal record, answered with its own
    /// write's result: calls finishing together on one thread are recorded without a
    /// group commit, a call the store would refuse fails alone, before anything of it is
    /// written, and the calls around it are recorded; a call whose caller went away
    /// after it was recorded loses nothing at close.
    #[test]
    fn each_call_is_recorded_alone_and_a_refused_one_fails_alone() {
        use super::super::{SqliteStore, Trace as _};
        let dir = tempfile::tempdir().unwrap();
        let store = std::sync::Arc::new(SqliteStore::open(dir.path()).unwrap());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let round = |calls: Vec<Vec<super::super::NewObservation>>| {
            let store = store.clone();
            runtime.block_on(async move {
                let tasks: Vec<_> = calls
                    .into_iter()
                    .enumerate()
                    .map(|(t, observations)| {
                        let store = store.clone();
                        tokio::spawn(async move {
                            let event =
                                NewEvent::new("test", format!("t{t}"), serde_json::json!({"t": t}));
                            tokio::task::yield_now().await;
                            store
                                .append_call(vec![event], observations)
                                .map_err(|e| format!("{e:#}"))
                        })
                    })
                    .collect();
                let mut results = Vec::new();
                for task in tasks {
                    results.push(task.await.unwrap());
                }
                results
            })
        };
        let results = round(vec![Vec::new(); 8]);
        assert!(results.iter().all(Result::is_ok), "{results:?}");
        assert_eq!(store.trace(0, usize::MAX).unwrap().len(), 8);
        assert_eq!(
            store.commit.transactions(),
            0,
            "no group commit: one journal record each"
        );

        // One call's observation breaks a CHECK of the observations table: it is refused,
        // nothing of it is written, and the calls beside it are recorded.
        let mut broken = super::super::observations::tests::item("notes://x", "aaaa", 1);
        broken.method = "tools/bogus".into();
        let results = round(vec![Vec::new(), vec![broken], Vec::new()]);
        assert!(results[0].is_ok() && results[2].is_ok(), "{results:?}");
        let refused = results[1].as_ref().unwrap_err();
        assert!(refused.contains("nothing was recorded"), "{refused}");
        let all = store.trace(0, usize::MAX).unwrap();
        assert_eq!(all.len(), 10);
        assert_eq!(
            all.iter().filter(|e| e.subject == "t1").count(),
            1,
            "the refused call left nothing"
        );
        assert!(store.verify_trace().unwrap().first_bad.is_none());

        // A call recorded just before the store closes is moved into the trace at close.
        store
            .append_call(
                vec![NewEvent::new("test", "dropped", serde_json::json!({}))],
                Vec::new(),
            )
            .unwrap();
        drop(runtime);
        drop(std::sync::Arc::into_inner(store).expect("the last handle"));
        let reopened = SqliteStore::open(dir.path()).unwrap();
        let all = reopened.trace(0, usize::MAX).unwrap();
        assert_eq!(all.len(), 11);
        assert_eq!(all[10].subject, "dropped");
        assert!(reopened.verify_trace().unwrap().first_bad.is_none());
    }

    /// Concurrent callers share transactions, and still every caller's events are all
    /// committed, in its own order, with a chain that verifies; a call with more events than
    /// one INSERT writes is split across statements without a gap.
    #[test]
    fn concurrent_callers_each_get_their_own_events_committed_in_order() {
        use super::super::{SqliteStore, Trace as _};
        let dir = tempfile::tempdir().unwrap();
        let store = std::sync::Arc::new(SqliteStore::open(dir.path()).unwrap());
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let store = store.clone();
                std::thread::spawn(move || {
                    for i in 0..50 {
                        // 1..=19 events: below, at and across ROWS_PER_INSERT.
                        let n = 1 + (t * 50 + i) % 19;
                        let events = (0..n)
                            .map(|k| {
                                NewEvent::new(
                                    "test",
                                    format!("t{t}"),
                                    serde_json::json!({"i": i, "k": k}),
                                )
                            })
                            .collect();
                        store.append_events(events).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let all = store.trace(0, usize::MAX).unwrap();
        let expected: usize = (0..8)
            .flat_map(|t| (0..50).map(move |i| 1 + (t * 50 + i) % 19))
            .sum();
        assert_eq!(all.len(), expected);
        assert!(store.verify_trace().unwrap().first_bad.is_none());
        for t in 0..8 {
            let mine: Vec<(u64, u64)> = all
                .iter()
                .filter(|e| e.subject == format!("t{t}"))
                .map(|e| {
                    (
                        e.payload["i"].as_u64().unwrap(),
                        e.payload["k"].as_u64().unwrap(),
                    )
                })
                .collect();
            let mut sorted = mine.clone();
            sorted.sort_unstable();
            assert_eq!(mine, sorted, "caller t{t}'s events out of order");
            assert_eq!(
                mine.len(),
                (0..50).map(|i| 1 + (t * 50 + i) % 19).sum::<usize>()
            );
        }
    }
}
