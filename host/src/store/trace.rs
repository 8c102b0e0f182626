//! Appending to the trace with group commit.
//!
//! Rule: an event is acknowledged only once it is committed. A caller of
//! [`SqliteStore::append_events`](super::SqliteStore) queues its events and then takes the
//! database lock; whoever holds the lock commits *every* queued event in one transaction
//! (group commit), so under concurrency one commit serves many calls and no call returns
//! before its own events are in the database. With SQLite in WAL mode and
//! `synchronous=NORMAL`, a committed transaction survives a crash of the process (it is in
//! the WAL file); a power loss can lose the last commits, which `synchronous=FULL` would
//! prevent at the price of an fsync per commit.
//!
//! Each event's hash is computed exactly as [`Store::verify_trace`](super::Store) checks
//! it: hex sha256 of the RFC 8785 canonical JSON of
//! `{"seq","at_ms","kind","subject","payload","prev_hash"}`, built here without a second
//! serialization (a unit test holds the two equal).

use std::sync::Mutex;

use anyhow::{Context as _, anyhow};
use rusqlite::{OptionalExtension as _, Transaction, params};
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

/// Events waiting for a commit, and what happened to earlier batches.
#[derive(Default)]
pub(super) struct Queue {
    events: Vec<NewEvent>,
    /// Ticket of the newest queued batch.
    next: u64,
    /// Every batch with a ticket up to this one has been written (or failed).
    done: u64,
    /// Recently failed ticket ranges and why (at most [`MAX_FAILURES`]).
    failed: Vec<(u64, u64, String)>,
}

const MAX_FAILURES: usize = 64;

pub(super) struct GroupCommit {
    queue: Mutex<Queue>,
}

impl Default for GroupCommit {
    fn default() -> Self {
        Self {
            queue: Mutex::new(Queue::default()),
        }
    }
}

impl GroupCommit {
    fn queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `events`; returns the batch's ticket.
    pub(super) fn enqueue(&self, events: Vec<NewEvent>) -> u64 {
        let mut q = self.queue();
        q.next += 1;
        q.events.extend(events);
        q.next
    }

    /// Called with the database lock held: `Err(result)` when the batch `ticket` was
    /// already handled by an earlier commit, else everything queued (the caller commits
    /// it) with the lowest and highest tickets it covers.
    pub(super) fn take_or_done(
        &self,
        ticket: u64,
    ) -> Result<(Vec<NewEvent>, u64, u64), anyhow::Result<()>> {
        let mut q = self.queue();
        if q.done >= ticket {
            return Err(
                match q
                    .failed
                    .iter()
                    .find(|(lo, hi, _)| (*lo..=*hi).contains(&ticket))
                {
                    Some((_, _, why)) => Err(anyhow!("appending to the trace failed: {why}")),
                    None => Ok(()),
                },
            );
        }
        Ok((std::mem::take(&mut q.events), q.done + 1, q.next))
    }

    /// Records that batches up to `hi` (from `lo`) were written, or failed with `error`.
    pub(super) fn finish(&self, lo: u64, hi: u64, error: Option<String>) {
        let mut q = self.queue();
        q.done = q.done.max(hi);
        if let Some(why) = error {
            if q.failed.len() == MAX_FAILURES {
                q.failed.remove(0);
            }
            q.failed.push((lo, hi, why));
        }
    }
}

/// Appends `events` in `tx`, chained after the current head. Returns (first seq, last hash).
pub(super) fn append_in(
    tx: &Transaction<'_>,
    events: &[NewEvent],
) -> anyhow::Result<Option<(i64, String)>> {
    if events.is_empty() {
        return Ok(None);
    }
    let last: Option<(i64, String)> = tx
        .query_row(
            "SELECT seq, hash FROM trace_events ORDER BY seq DESC LIMIT 1",
            [],
            |row| Ok((row.get(0)?, row.get(1)?)),
        )
        .optional()?;
    let (mut seq, mut prev) = match last {
        Some((seq, hash)) => (seq, hash),
        None => (0, GENESIS_HASH.to_owned()),
    };
    let first = seq + 1;
    let at_ms = now_ms();
    let at = ms_to_sql(at_ms)?;
    let mut insert = tx.prepare_cached(&format!(
        "INSERT INTO trace_events ({TRACE_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)"
    ))?;
    for e in events {
        seq += 1;
        let payload = serde_json_canonicalizer::to_string(&e.payload)
            .context("canonicalizing a trace payload")?;
        let hash = chained_hash(seq, at_ms, e.kind, &e.subject, &payload, &prev)?;
        insert.execute(params![seq, at, e.kind, e.subject, payload, prev, hash])?;
        prev = hash;
    }
    Ok(Some((first, prev)))
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
    let string = |s: &str| serde_json_canonicalizer::to_string(&s).context("canonicalizing text");
    let mut text = String::with_capacity(canonical_payload.len() + 200);
    text.push_str("{\"at_ms\":");
    text.push_str(&serde_json_canonicalizer::to_string(&at_ms)?);
    text.push_str(",\"kind\":");
    text.push_str(&string(kind)?);
    text.push_str(",\"payload\":");
    text.push_str(canonical_payload);
    text.push_str(",\"prev_hash\":");
    text.push_str(&string(prev_hash)?);
    text.push_str(",\"seq\":");
    text.push_str(&serde_json_canonicalizer::to_string(&seq)?);
    text.push_str(",\"subject\":");
    text.push_str(&string(subject)?);
    text.push('}');
    Ok(hex::encode(Sha256::digest(text.as_bytes())))
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
            let canonical = serde_json_canonicalizer::to_string(&payload).unwrap();
            let fast = chained_hash(7, 1_700_000_000_123, text, text, &canonical, text).unwrap();
            let reparsed: serde_json::Value = serde_json::from_str(&canonical).unwrap();
            let slow = super::super::trace_hash(7, 1_700_000_000_123, text, text, &reparsed, text)
                .unwrap();
            assert_eq!(fast, slow, "{text:?}");
        }
    }
}
