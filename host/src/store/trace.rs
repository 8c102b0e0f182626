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
//! Each event's hash is computed exactly as [`Store::verify_trace`](super::Store) checks
//! it: hex sha256 of the RFC 8785 canonical JSON of
//! `{"seq","at_ms","kind","subject","payload","prev_hash"}`, built here without a second
//! serialization (a unit test holds the two equal).

use anyhow::Context as _;
use rusqlite::{Connection, OptionalExtension as _};
use sha2::{Digest as _, Sha256};

use super::{GENESIS_HASH, TRACE_COLUMNS, ms_to_sql, now_ms};

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

/// Appends `events` inside the open write transaction on `tx`, chained after the current
/// head. Returns (first seq, last hash).
pub(super) fn append_in(
    tx: &Connection,
    events: &[NewEvent],
) -> anyhow::Result<Option<(i64, String)>> {
    if events.is_empty() {
        return Ok(None);
    }
    let last: Option<(i64, String)> = tx
        .prepare_cached("SELECT seq, hash FROM trace_events ORDER BY seq DESC LIMIT 1")?
        .query_row([], |row| Ok((row.get(0)?, row.get(1)?)))
        .optional()?;
    let (mut seq, mut prev) = match last {
        Some((seq, hash)) => (seq, hash),
        None => (0, GENESIS_HASH.to_owned()),
    };
    let first = seq + 1;
    let at_ms = now_ms();
    let at = ms_to_sql(at_ms)?;
    // Rows are computed first, then written ROWS_PER_INSERT at a time (one statement per
    // chunk is cheaper than one per row).
    let mut rows = Vec::with_capacity(events.len());
    for e in events {
        seq += 1;
        let payload = canonical(&e.payload)?;
        let hash = chained_hash(seq, at_ms, e.kind, &e.subject, &payload, &prev)?;
        rows.push((seq, e.kind, e.subject.as_str(), payload, prev, hash.clone()));
        prev = hash;
    }
    for chunk in rows.chunks(ROWS_PER_INSERT) {
        let placeholders: Vec<String> = (0..chunk.len())
            .map(|i| {
                let b = i * 7;
                format!(
                    "(?{}, ?{}, ?{}, ?{}, ?{}, ?{}, ?{})",
                    b + 1,
                    b + 2,
                    b + 3,
                    b + 4,
                    b + 5,
                    b + 6,
                    b + 7
                )
            })
            .collect();
        let mut insert = tx.prepare_cached(&format!(
            "INSERT INTO trace_events ({TRACE_COLUMNS}) VALUES {}",
            placeholders.join(", ")
        ))?;
        let mut values: Vec<&dyn rusqlite::ToSql> = Vec::with_capacity(chunk.len() * 7);
        for (seq, kind, subject, payload, prev, hash) in chunk {
            values.extend([
                seq as &dyn rusqlite::ToSql,
                &at,
                kind,
                subject,
                payload,
                prev,
                hash,
            ]);
        }
        insert.execute(values.as_slice())?;
    }
    Ok(Some((first, prev)))
}

/// RFC 8785 canonical JSON of `value`. Trace payloads are made of ASCII keys, strings,
/// integers within ±2^53, booleans, null, arrays and objects; for those the canonical form
/// is written directly (keys sorted; for ASCII keys byte order is UTF-16 order; integers as
/// their digits; strings escaped as RFC 8785 says, which is serde_json's escaping). Any
/// other value is canonicalized by `serde_json_canonicalizer`. A unit test holds the two
/// equal.
pub(super) fn canonical(value: &serde_json::Value) -> anyhow::Result<String> {
    let mut out = String::with_capacity(256);
    if write_simple(value, &mut out) {
        return Ok(out);
    }
    serde_json_canonicalizer::to_string(value).context("canonicalizing a trace payload")
}

/// Writes the canonical form of a "simple" value; false (output unusable) otherwise.
fn write_simple(value: &serde_json::Value, out: &mut String) -> bool {
    use serde_json::Value;
    const SAFE: u64 = 1 << 53;
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(true) => out.push_str("true"),
        Value::Bool(false) => out.push_str("false"),
        Value::Number(n) => {
            if let Some(u) = n.as_u64().filter(|u| *u <= SAFE) {
                out.push_str(itoa::Buffer::new().format(u));
            } else if let Some(i) = n.as_i64().filter(|i| i.unsigned_abs() <= SAFE) {
                out.push_str(itoa::Buffer::new().format(i));
            } else {
                return false;
            }
        }
        Value::String(s) => push_string(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                if !write_simple(item, out) {
                    return false;
                }
            }
            out.push(']');
        }
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            if entries.iter().any(|(k, _)| !k.is_ascii()) {
                return false;
            }
            entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                push_string(k, out);
                out.push(':');
                if !write_simple(v, out) {
                    return false;
                }
            }
            out.push('}');
        }
    }
    true
}

/// A JSON string as RFC 8785 writes it: `"` and `\` escaped, the short escapes
/// `\b \f \n \r \t`, other control characters as `\u00xx` (lowercase), nothing else.
fn push_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                out.push_str(&format!("\\u{:04x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push('"');
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
    push_string(kind, &mut text);
    text.push_str(",\"payload\":");
    text.push_str(canonical_payload);
    text.push_str(",\"prev_hash\":");
    push_string(prev_hash, &mut text);
    text.push_str(",\"seq\":");
    text.push_str(&serde_json_canonicalizer::to_string(&seq)?);
    text.push_str(",\"subject\":");
    push_string(subject, &mut text);
    text.push('}');
    Ok(hex::encode(Sha256::digest(text.as_bytes())))
}

/// The result slot of one queued batch, filled by whoever commits it.
type Slot = std::sync::Arc<std::sync::OnceLock<Result<(), String>>>;

/// One queued batch: a call's events, its observations, and where its result goes.
type Batch = (Vec<NewEvent>, Vec<super::NewObservation>, Slot);

/// Events waiting for a commit. Concurrent callers queue here, then take the database
/// lock; whoever holds it commits everything queued in one transaction and fills the
/// result slot of every batch it committed. A caller returns its own batch's result, and
/// nothing else: there is no counter to infer success from.
#[derive(Default)]
pub(super) struct GroupCommit {
    queue: std::sync::Mutex<Vec<Batch>>,
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

    /// Takes everything queued (called with the database lock held).
    pub(super) fn take(&self) -> Vec<Batch> {
        std::mem::take(&mut *self.queue.lock().unwrap_or_else(|e| e.into_inner()))
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

    /// Concurrent callers share transactions, and still every caller's events are all
    /// committed, in its own order, with a chain that verifies; a call with more events than
    /// one INSERT writes is split across statements without a gap.
    #[test]
    fn concurrent_callers_each_get_their_own_events_committed_in_order() {
        use super::super::{SqliteStore, Store as _};
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
