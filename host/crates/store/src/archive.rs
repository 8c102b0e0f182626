//! Trace retention: the trace's oldest events sealed into archived segments, the chain
//! still verifiable from event 1.
//!
//! Rule: **an event leaves the store only inside a segment the chain itself names, and
//! never while something still needs it.** An archive pass ([`crate::Trace::archive_trace`],
//! `run_pass`) takes the oldest events not yet archived whose time is before a cutoff (a
//! prefix of the chain, at most [`ArchiveRequest::max_events`] at once), checks their chain,
//! writes them to a segment file exactly as stored, then appends a `trace-archived` event
//! ([`TRACE_ARCHIVED`], payload [`ArchiveMark`]) naming the segment: its range, the MAC it
//! starts from, its head (the MAC of its last event), the file's sha256 and the events up
//! to its end that stay in the store ([`ArchiveMark::kept`]). Only then are the segment's
//! other events deleted, a bounded batch per transaction (a database trigger refuses
//! deleting any event after the newest archived range), and the freed space given back
//! (SQLite: `PRAGMA incremental_vacuum`; PostgreSQL: `VACUUM`).
//!
//! What stays (`keeps`): the events that prove a mapping's revisions and states, a
//! contract review or the keyed trace's start (always: few, and they prove what serves);
//! an approval's events while its request or receipt may still be used, or while the intent
//! it authorized is open; an open intent's events (open by its row, or by the trace: no
//! event closed it). Only MACed events are kept (an unkeyed one proves nothing).
//!
//! Verification ([`crate::Trace::verify_trace`]): from the newest `trace-archived` event
//! (its MAC checked on its own), every stored event up to its `to_seq` is MAC-checked on
//! its own and must be one it kept, every one it kept must be there, and the event after
//! `to_seq` must link to its `head`; from there the chain is checked as before. So a removed
//! segment (its events and its mark) breaks the chain where the mark was, and a kept proof
//! deleted is named. [`verify_segments`] checks a folder of segments offline: each
//! segment's chain from its `prev_hash`, each link between segments from event 1 (a missing
//! segment is a gap), each file a `trace-archived` event names against that event's range,
//! head and sha256, and the newest against the store's mark.
//!
//! Segment file (format [`SEGMENT_FORMAT`]): JSON Lines, UTF-8. Line 1 is a
//! [`SegmentHeader`]; each further line one [`SegmentEvent`] in seq order, its payload the
//! exact text stored (so each MAC recomputes). Named `trace-<from>-<to>.jsonl` (seqs, 12
//! digits), mode 0600 in a private folder, written to a temporary name, synced and renamed:
//! a segment file is whole or absent.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::io::{BufRead as _, Read as _, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use super::key::{Checkpoint, TraceKey};
use super::{ChainCheck, GENESIS_HASH, StoredEvent, TRACE_KEYED};

/// Kind of the event that seals a segment; its payload is an [`ArchiveMark`], its subject
/// `"trace"`.
pub const TRACE_ARCHIVED: &str = "trace-archived";

/// The `format` of a segment header.
pub const SEGMENT_FORMAT: &str = "airlock-trace-segment/1";

/// Most events one pass seals into one segment unless asked otherwise (a first pass over
/// a large trace makes several segments, one per pass).
pub const DEFAULT_SEGMENT_EVENTS: i64 = 100_000;

/// The file in the archive folder a pass holds an exclusive `flock` on.
pub const LOCK_FILE: &str = ".archive.lock";

/// Events read from the store per hold of its connection while a segment is written.
pub(crate) const READ_CHUNK: i64 = 2_000;

/// Archived events deleted per transaction (each holds the write lock briefly).
pub(crate) const DELETE_CHUNK: i64 = 2_000;

/// Longest line accepted in a segment file (bytes): an event's payload is at most a
/// journal record's size.
const MAX_LINE_BYTES: u64 = (super::journal::MAX_RECORD_BYTES as u64) + 4096;

/// Kinds of the events that are never archived away: they prove what serves (a mapping
/// revision's state, a contract review) and where the keyed trace began.
const ALWAYS_KEPT: [&str; 5] = [
    "mapping-revision",
    "mapping-state-changed",
    TRACE_KEYED,
    super::contracts::CONTRACT_APPROVED,
    super::contracts::CONTRACT_ERRONEOUS,
];

/// Kinds of the events that prove an approval (payload `"approval"`).
const APPROVAL_KINDS: [&str; 3] = ["approval-requested", "approval-decided", "receipt-consumed"];

/// Kinds of the events that change an intent's state after its creation (with
/// `"intent_state"` in their payload).
const INTENT_STATE_KINDS: [&str; 4] = [
    "call-outcome",
    "call-refused",
    "intent-resolved",
    "intent-held",
];

/// What a `trace-archived` event records: one sealed segment and what stays in the store
/// up to its end.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArchiveMark {
    /// The segment's file name in the archive folder (`trace-<from>-<to>.jsonl`).
    pub segment: String,
    /// Seq of its first event (1, or the previous mark's `to_seq` + 1).
    pub from_seq: i64,
    /// Seq of its last event.
    pub to_seq: i64,
    /// The MAC its first event links to (64 zeros for event 1).
    pub prev_hash: String,
    /// The MAC of its last event: what the event after `to_seq` links to.
    pub head: String,
    /// Hex sha256 of the segment file's bytes.
    pub sha256: String,
    /// The seqs up to `to_seq` that stay in the store (ascending): every other event up
    /// to `to_seq` is only in the segments.
    pub kept: Vec<i64>,
    /// The cutoff of the pass (unix ms, at most the time of the pass): every sealed event
    /// is older.
    pub cutoff_ms: u64,
}

/// A verified [`ArchiveMark`] and the seq of its event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Archived {
    /// Seq of the `trace-archived` event.
    pub event_seq: i64,
    /// What it records.
    pub mark: ArchiveMark,
}

impl Archived {
    /// The mark of stored event `e`, which must be a `trace-archived` event MACed with
    /// `key` and carry a well-formed mark. Errors say which, in words.
    pub(crate) fn from_event(key: &TraceKey, e: &StoredEvent) -> Result<Self, String> {
        let seq = e.seq;
        if e.kind != TRACE_ARCHIVED {
            return Err(format!("event {seq} is a `{}` event, not a mark", e.kind));
        }
        if !e.is_genuine(key) {
            return Err(format!(
                "event {seq} (`{TRACE_ARCHIVED}`) does not verify with this host's key {}: it \
                 was altered or forged, so what it says was archived cannot be trusted",
                key.id()
            ));
        }
        let mark: ArchiveMark = serde_json::from_str(&e.payload)
            .map_err(|err| format!("event {seq}'s archive mark does not parse: {err}"))?;
        mark.check(seq)?;
        Ok(Self {
            event_seq: seq,
            mark,
        })
    }
}

impl ArchiveMark {
    /// Checks the mark's own shape, `event_seq` being its event's seq.
    fn check(&self, event_seq: i64) -> Result<(), String> {
        let bad = |why: String| Err(format!("event {event_seq}'s archive mark {why}"));
        if self.from_seq < 1 || self.to_seq < self.from_seq || self.to_seq >= event_seq {
            return bad(format!(
                "names an impossible range {}..={}",
                self.from_seq, self.to_seq
            ));
        }
        if self.segment != segment_name(self.from_seq, self.to_seq) {
            return bad(format!(
                "names segment {:?}, not the range's file name",
                self.segment
            ));
        }
        for (name, hex) in [
            ("prev_hash", &self.prev_hash),
            ("head", &self.head),
            ("sha256", &self.sha256),
        ] {
            if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                return bad(format!("has a {name} that is not 64 hex digits"));
            }
        }
        if self.from_seq == 1 && self.prev_hash != GENESIS_HASH {
            return bad("starts at event 1 without linking to 64 zeros".into());
        }
        if !self.kept.windows(2).all(|w| w[0] < w[1])
            || self.kept.first().is_some_and(|s| *s < 1)
            || self.kept.last().is_some_and(|s| *s > self.to_seq)
        {
            return bad("lists kept events out of order or outside its range".into());
        }
        Ok(())
    }
}

/// The file name of the segment of events `from..=to`.
pub fn segment_name(from: i64, to: i64) -> String {
    format!("trace-{from:012}-{to:012}.jsonl")
}

/// The range of a segment file name, `None` for any other name.
pub fn parse_segment_name(name: &str) -> Option<(i64, i64)> {
    let middle = name.strip_prefix("trace-")?.strip_suffix(".jsonl")?;
    let (from, to) = middle.split_once('-')?;
    let digits = |s: &str| s.len() == 12 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(from) || !digits(to) {
        return None;
    }
    let (from, to) = (from.parse().ok()?, to.parse().ok()?);
    (from >= 1 && to >= from).then_some((from, to))
}

/// Line 1 of a segment file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SegmentHeader {
    /// [`SEGMENT_FORMAT`].
    pub format: String,
    /// Seq of the first event.
    pub from_seq: i64,
    /// Seq of the last event.
    pub to_seq: i64,
    /// The MAC the first event links to.
    pub prev_hash: String,
    /// The MAC of the last event.
    pub head: String,
    /// How many event lines follow (`to_seq - from_seq + 1`).
    pub events: u64,
    /// Id of the key the events are MACed with.
    pub key_id: String,
}

/// One event line of a segment file: the event's columns as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SegmentEvent {
    /// Sequence number.
    pub seq: i64,
    /// Time (unix ms), as stored.
    pub at_ms: i64,
    /// Event kind.
    pub kind: String,
    /// Subject.
    pub subject: String,
    /// Payload: the exact canonical JSON text stored.
    pub payload: String,
    /// The previous event's MAC.
    pub prev_hash: String,
    /// This event's MAC (or unkeyed hash before schema 7).
    pub hash: String,
    /// Id of the key that MACed it; `None` before schema 7.
    pub key_id: Option<String>,
}

impl From<&StoredEvent> for SegmentEvent {
    fn from(e: &StoredEvent) -> Self {
        Self {
            seq: e.seq,
            at_ms: e.at,
            kind: e.kind.clone(),
            subject: e.subject.clone(),
            payload: e.payload.clone(),
            prev_hash: e.prev_hash.clone(),
            hash: e.hash.clone(),
            key_id: e.key_id.clone(),
        }
    }
}

impl From<SegmentEvent> for StoredEvent {
    fn from(e: SegmentEvent) -> Self {
        Self {
            seq: e.seq,
            at: e.at_ms,
            kind: e.kind,
            subject: e.subject,
            payload: e.payload,
            prev_hash: e.prev_hash,
            hash: e.hash,
            key_id: e.key_id,
        }
    }
}

/// What an archive pass is asked to do.
#[derive(Debug, Clone)]
pub struct ArchiveRequest {
    /// The archive folder (created private when missing).
    pub dir: PathBuf,
    /// Seal only events older than this (unix ms).
    pub before_ms: u64,
    /// Most events in the segment this pass writes (at least 1).
    pub max_events: i64,
    /// Seal, whatever their age, the events beyond the newest `keep_events` (a bound on
    /// the store's size); `None`: by age only.
    pub keep_events: Option<i64>,
    /// The time the keep rules are judged at (unix ms): an approval whose receipt lives
    /// past it keeps its events.
    pub now_ms: u64,
}

/// What an archive pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ArchiveReport {
    /// The segment sealed by this pass, if any event was old enough.
    pub sealed: Option<Archived>,
    /// Bytes of the segment file written.
    pub segment_bytes: u64,
    /// Archived events deleted from the store (this pass's and any a previous pass left).
    pub deleted: u64,
    /// Bytes given back to the file system (SQLite's freed pages; 0 when the database
    /// does not vacuum incrementally, or on PostgreSQL).
    pub reclaimed_bytes: u64,
    /// The newest archived seq after the pass (0: nothing archived).
    pub archived_to: i64,
}

/// Which approvals and intents still need their events, as the store's rows say.
#[derive(Debug, Clone, Default)]
pub struct Needs {
    /// Approvals pending or approved, whose receipt may still be used, or whose intent is
    /// open.
    pub approvals: HashSet<String>,
    /// Intents whose row is open (`prepared`, `unknown`).
    pub intents: HashSet<String>,
}

/// What one backend does for an archive pass; [`run_pass`] holds the rules. Every method
/// takes and releases the store's connection itself (no hold spans two calls).
pub(crate) trait ArchiveBackend {
    /// The newest `trace-archived` event as stored, if any.
    fn newest_mark_event(&self) -> anyhow::Result<Option<StoredEvent>>;
    /// Up to `limit` events with seq greater than `after`, in seq order (at most
    /// `through` when given).
    fn events_after(
        &self,
        after: i64,
        through: i64,
        limit: i64,
    ) -> anyhow::Result<Vec<StoredEvent>>;
    /// `(seq, at_ms)` of up to `limit` events after `after`, in seq order.
    fn times_after(&self, after: i64, limit: i64) -> anyhow::Result<Vec<(i64, i64)>>;
    /// The head's seq (0 for an empty trace).
    fn head_seq(&self) -> anyhow::Result<i64>;
    /// The stored events with these seqs.
    fn events_at(&self, seqs: &[i64]) -> anyhow::Result<Vec<StoredEvent>>;
    /// What the rows say still needs its events, at `now_ms`.
    fn needs(&self, now_ms: u64) -> anyhow::Result<Needs>;
    /// Whether an event with `intent_state` `completed` or `failed` names intent `id`.
    fn intent_closed_in_trace(&self, id: &str) -> anyhow::Result<bool>;
    /// Appends the `trace-archived` event of `mark` in one transaction in which the newest
    /// mark is still the one at `previous` (its event seq; `None`: no mark yet), else
    /// errors (another process archived meanwhile). Returns the event's seq.
    fn append_mark(&self, previous: Option<i64>, mark: &ArchiveMark) -> anyhow::Result<i64>;
    /// Deletes up to `limit` stored events up to `to_seq` that `kept` does not list, in
    /// one transaction; returns how many.
    fn delete_archived(&self, to_seq: i64, kept: &[i64], limit: i64) -> anyhow::Result<u64>;
    /// Gives freed space back, a bounded step at a time; returns the bytes given back.
    fn reclaim(&self) -> anyhow::Result<u64>;
}

/// Whether stored event `e` is of a kind [`keeps`] may keep (a cheap test on the kind,
/// before its payload is read).
fn may_keep(e: &StoredEvent) -> bool {
    e.key_id.is_some()
        && (ALWAYS_KEPT.contains(&e.kind.as_str())
            || APPROVAL_KINDS.contains(&e.kind.as_str())
            || e.kind == "intent-created"
            || (INTENT_STATE_KINDS.contains(&e.kind.as_str())
                && e.payload.contains("\"intent_state\"")))
}

/// Whether stored event `e` stays in the store when archived, under `needs` and
/// `intent_closed` (whether the trace closed an intent).
pub(crate) fn keeps(
    e: &StoredEvent,
    needs: &Needs,
    intent_closed: &mut dyn FnMut(&str) -> anyhow::Result<bool>,
) -> anyhow::Result<bool> {
    if e.key_id.is_none() {
        return Ok(false);
    }
    let kind = e.kind.as_str();
    if ALWAYS_KEPT.contains(&kind) {
        return Ok(true);
    }
    let approval = APPROVAL_KINDS.contains(&kind);
    let intent_event = kind == "intent-created" || INTENT_STATE_KINDS.contains(&kind);
    if !approval && !intent_event {
        return Ok(false);
    }
    let Ok(payload) = serde_json::from_str::<serde_json::Value>(&e.payload) else {
        return Ok(false);
    };
    let named = |field: &str| payload.get(field).and_then(|v| v.as_str());
    if approval {
        return Ok(named("approval").is_some_and(|id| needs.approvals.contains(id)));
    }
    if kind != "intent-created" && payload.get("intent_state").is_none() {
        // A read's outcome names an intent but changes none.
        return Ok(false);
    }
    let Some(intent) = named("intent") else {
        return Ok(false);
    };
    Ok(needs.intents.contains(intent) || !intent_closed(intent)?)
}

/// One archive pass over `backend` (see the module's rule): finishes the deletion a
/// previous pass left, seals the next segment of events older than `request.before_ms`
/// (when there is one), deletes what it sealed and does not keep, and gives the space back.
///
/// # Errors
/// The store fails; the events to seal do not verify (nothing is sealed: run `airlock
/// trace verify`); the newest mark does not verify; the folder or file cannot be written;
/// another process sealed a segment meanwhile. A failure leaves the store verifiable: a
/// segment file without its mark is replaced by the next pass.
pub(crate) fn run_pass(
    backend: &dyn ArchiveBackend,
    key: &TraceKey,
    request: &ArchiveRequest,
) -> anyhow::Result<ArchiveReport> {
    let mut report = ArchiveReport::default();
    // One pass at a time per folder (serve's and `airlock trace archive`'s), held to the
    // end: what this pass finds unsealed in the folder is then a failed pass's.
    airlock_core::private_fs::ensure_private_dir(
        &request.dir,
        "trace archive folder",
        "or choose another [trace] archive_dir",
    )?;
    let lock_path = request.dir.join(LOCK_FILE);
    let folder_lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&lock_path)
        .with_context(|| format!("opening {}", lock_path.display()))?;
    folder_lock
        .lock()
        .with_context(|| format!("locking {}", lock_path.display()))?;
    let previous = match backend.newest_mark_event()? {
        None => None,
        Some(e) => Some(Archived::from_event(key, &e).map_err(|why| {
            anyhow::anyhow!("{why}; nothing was archived (run `airlock trace verify`)")
        })?),
    };
    if let Some(p) = &previous {
        report.deleted += delete_all(backend, &p.mark)?;
        report.archived_to = p.mark.to_seq;
    }
    let (from, prev_hash) = previous.as_ref().map_or((1, GENESIS_HASH.to_owned()), |p| {
        (p.mark.to_seq + 1, p.mark.head.clone())
    });
    let to = last_old_enough(backend, from, request)?;
    if let Some(to) = to {
        let (mark, bytes) = seal(
            backend,
            key,
            request,
            previous.as_ref(),
            from,
            to,
            prev_hash,
        )?;
        let event_seq = match backend.append_mark(previous.as_ref().map(|p| p.event_seq), &mark) {
            Ok(seq) => seq,
            Err(e) => {
                withdraw(backend, key, &request.dir, &mark.segment);
                return Err(e);
            }
        };
        report.deleted += delete_all(backend, &mark)?;
        report.archived_to = mark.to_seq;
        report.segment_bytes = bytes;
        report.sealed = Some(Archived { event_seq, mark });
    }
    report.reclaimed_bytes = backend.reclaim()?;
    Ok(report)
}

/// Removes segment file `segment` from `dir` after its mark could not be appended,
/// unless the newest mark names that very file (another pass sealed the same range: the
/// same bytes). Left behind, a file no mark names would overlap the next pass's segment
/// and fail `verify_segments`. A failure here is logged: the folder then holds a file
/// `verify_segments` reports, and nothing else is affected.
fn withdraw(backend: &dyn ArchiveBackend, key: &TraceKey, dir: &Path, segment: &str) {
    let named = newest_mark(backend, key)
        .ok()
        .flatten()
        .is_some_and(|a| a.mark.segment == segment);
    if named {
        return;
    }
    if let Err(e) = std::fs::remove_file(dir.join(segment)) {
        tracing::warn!(
            "could not remove the unsealed segment {} ({e}): `trace verify --archive` will \
             report it; delete it by hand",
            dir.join(segment).display()
        );
    }
}

/// Deletes every stored event up to `mark.to_seq` it does not keep, a batch per
/// transaction.
fn delete_all(backend: &dyn ArchiveBackend, mark: &ArchiveMark) -> anyhow::Result<u64> {
    let mut deleted = 0;
    loop {
        let n = backend.delete_archived(mark.to_seq, &mark.kept, DELETE_CHUNK)?;
        deleted += n;
        if n < DELETE_CHUNK as u64 {
            return Ok(deleted);
        }
    }
}

/// The last seq of the longest run of events from `from` on, each older than the cutoff
/// or beyond the newest `keep_events`, and at most `max_events` of them; `None` when the event at `from` is not old enough (or
/// there is none). The run stops at the first event at or after the cutoff, so what is
/// sealed is always a prefix of what is left. Errors on a gap in the seqs.
fn last_old_enough(
    backend: &dyn ArchiveBackend,
    from: i64,
    request: &ArchiveRequest,
) -> anyhow::Result<Option<i64>> {
    let cutoff = i64::try_from(request.before_ms).unwrap_or(i64::MAX);
    let beyond = match request.keep_events {
        Some(keep) => backend.head_seq()? - keep.max(0),
        None => 0,
    };
    let max = request.max_events.max(1);
    let mut last = None;
    let mut expected = from;
    while expected - from < max {
        let want = (max - (expected - from)).min(READ_CHUNK);
        let times = backend.times_after(expected - 1, want)?;
        let n = times.len() as i64;
        for (seq, at) in times {
            if seq != expected {
                bail!(
                    "the trace has no event {expected} (the next stored is {seq}): it does \
                     not verify, so nothing was archived; run `airlock trace verify`"
                );
            }
            if at >= cutoff && seq > beyond {
                return Ok(last);
            }
            last = Some(seq);
            expected += 1;
        }
        if n < want {
            break;
        }
    }
    Ok(last)
}

/// Writes the segment of events `from..=to` (checking their chain from `prev_hash`) and
/// returns its mark and size. Decides what is kept among them and among the events
/// `previous` kept.
#[allow(clippy::too_many_arguments)]
fn seal(
    backend: &dyn ArchiveBackend,
    key: &TraceKey,
    request: &ArchiveRequest,
    previous: Option<&Archived>,
    from: i64,
    to: i64,
    prev_hash: String,
) -> anyhow::Result<(ArchiveMark, u64)> {
    let dir = &request.dir;
    // Segment files that start where this one does were written by a pass that failed
    // (or was killed) before its mark: no mark names them (the newest ends at `from - 1`,
    // and the folder is locked), and left they would overlap this one.
    for entry in std::fs::read_dir(dir)
        .with_context(|| format!("reading the archive folder {}", dir.display()))?
    {
        let entry = entry?;
        let file = entry.file_name().to_string_lossy().into_owned();
        if parse_segment_name(&file).is_some_and(|(f, _)| f == from) {
            std::fs::remove_file(entry.path())
                .with_context(|| format!("removing the unsealed {}", entry.path().display()))?;
        }
    }
    let name = segment_name(from, to);
    let temp = dir.join(format!(".{name}.tmp"));
    // A temporary file of a pass that failed is ours to replace.
    match std::fs::remove_file(&temp) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("removing {}", temp.display())),
    }
    let file = airlock_core::private_fs::create_new_private(&temp)
        .with_context(|| format!("creating segment file {}", temp.display()))?;
    let written = (|| -> anyhow::Result<(String, u64, Vec<StoredEvent>, String)> {
        let mut out = HashingWriter::new(std::io::BufWriter::new(file));
        let mut candidates = Vec::new();
        let mut chain = ChainCheck::starting(key, from, prev_hash.clone());
        let mut head = prev_hash.clone();
        let header_at = |head: &str| SegmentHeader {
            format: SEGMENT_FORMAT.into(),
            from_seq: from,
            to_seq: to,
            prev_hash: prev_hash.clone(),
            head: head.to_owned(),
            events: u64::try_from(to - from + 1).unwrap_or(0),
            key_id: key.id().to_owned(),
        };
        // The head is known only at the end, but the header comes first: the events are
        // MAC-checked twice over (here, then by every verifier), so the head is taken
        // from the store before writing and confirmed at the end.
        let last = backend.events_after(to - 1, to, 1)?;
        let expected_head = match last.first() {
            Some(e) if e.seq == to => e.hash.clone(),
            _ => bail!("event {to} is no longer in the store; nothing was archived"),
        };
        serde_json::to_writer(&mut out, &header_at(&expected_head))?;
        out.write_all(b"\n")?;
        let mut after = from - 1;
        while after < to {
            let events = backend.events_after(after, to, READ_CHUNK)?;
            if events.is_empty() {
                bail!(
                    "event {} is missing from the trace; nothing was archived",
                    after + 1
                );
            }
            for e in events {
                after = e.seq;
                serde_json::to_writer(&mut out, &SegmentEvent::from(&e))?;
                out.write_all(b"\n")?;
                head = e.hash.clone();
                let cloned = may_keep(&e).then(|| clone_event(&e));
                chain.next(e)?;
                if let Some((seq, why)) = chain.first_bad() {
                    bail!(
                        "the trace does not verify at event {seq} ({why}); nothing was \
                         archived: run `airlock trace verify`"
                    );
                }
                if let Some(c) = cloned {
                    candidates.push(c);
                }
            }
        }
        if head != expected_head {
            bail!("event {to}'s MAC changed while it was archived; nothing was archived");
        }
        let (writer, sha256, bytes) = out.finish();
        let file = writer.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        Ok((sha256, bytes, candidates, head))
    })();
    let (sha256, bytes, candidates, head) = match written {
        Ok(w) => w,
        Err(e) => {
            let _ = std::fs::remove_file(&temp);
            return Err(e.context(format!("writing segment {name}")));
        }
    };
    // Decide what stays: this segment's candidates and what earlier marks kept.
    let needs = backend.needs(request.now_ms)?;
    let mut closed: BTreeMap<String, bool> = BTreeMap::new();
    let mut intent_closed = |id: &str| -> anyhow::Result<bool> {
        if let Some(c) = closed.get(id) {
            return Ok(*c);
        }
        let c = backend.intent_closed_in_trace(id)?;
        closed.insert(id.to_owned(), c);
        Ok(c)
    };
    let mut kept = BTreeSet::new();
    if let Some(p) = previous {
        for e in backend.events_at(&p.mark.kept)? {
            if keeps(&e, &needs, &mut intent_closed)? {
                kept.insert(e.seq);
            }
        }
    }
    for e in &candidates {
        if keeps(e, &needs, &mut intent_closed)? {
            kept.insert(e.seq);
        }
    }
    let target = dir.join(&name);
    std::fs::rename(&temp, &target)
        .with_context(|| format!("moving the segment into place as {}", target.display()))?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("syncing the archive folder {}", dir.display()))?;
    Ok((
        ArchiveMark {
            segment: name,
            from_seq: from,
            to_seq: to,
            prev_hash,
            head,
            sha256,
            kept: kept.into_iter().collect(),
            // A cutoff past now means "up to now" (and stays an exact JSON number).
            cutoff_ms: request.before_ms.min(request.now_ms),
        },
        bytes,
    ))
}

fn clone_event(e: &StoredEvent) -> StoredEvent {
    StoredEvent {
        seq: e.seq,
        at: e.at,
        kind: e.kind.clone(),
        subject: e.subject.clone(),
        payload: e.payload.clone(),
        prev_hash: e.prev_hash.clone(),
        hash: e.hash.clone(),
        key_id: e.key_id.clone(),
    }
}

/// A writer that hashes and counts what passes through it.
struct HashingWriter<W> {
    inner: W,
    hash: Sha256,
    bytes: u64,
}

impl<W: std::io::Write> HashingWriter<W> {
    fn new(inner: W) -> Self {
        Self {
            inner,
            hash: Sha256::new(),
            bytes: 0,
        }
    }

    fn finish(self) -> (W, String, u64) {
        (self.inner, hex::encode(self.hash.finalize()), self.bytes)
    }
}

impl<W: std::io::Write> std::io::Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// One segment file read back: its header, events and the sha256 of its bytes.
#[derive(Debug)]
pub(crate) struct Segment {
    /// Line 1.
    pub(crate) header: SegmentHeader,
    /// The events, in file order.
    pub(crate) events: Vec<StoredEvent>,
    /// Hex sha256 of the file's bytes.
    pub(crate) sha256: String,
}

/// Reads segment file `path`.
///
/// # Errors
/// The file cannot be read, a line is longer than an event can be, is not UTF-8 JSON of
/// the expected shape, or the header names another format; the error names the line.
pub(crate) fn read_segment(path: &Path) -> anyhow::Result<Segment> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut reader = std::io::BufReader::new(file);
    let mut hash = Sha256::new();
    let mut header: Option<SegmentHeader> = None;
    let mut events = Vec::new();
    let mut line = Vec::new();
    for number in 1usize.. {
        line.clear();
        let n = (&mut reader)
            .take(MAX_LINE_BYTES + 1)
            .read_until(b'\n', &mut line)
            .with_context(|| format!("{}: reading line {number}", path.display()))?;
        if n == 0 {
            break;
        }
        hash.update(&line);
        if line.last() != Some(&b'\n') {
            bail!(
                "{}: line {number} {}",
                path.display(),
                if n as u64 > MAX_LINE_BYTES {
                    "is longer than any event can be"
                } else {
                    "does not end with a newline (the file was cut short)"
                }
            );
        }
        let text = std::str::from_utf8(&line[..line.len() - 1])
            .with_context(|| format!("{}: line {number} is not UTF-8", path.display()))?;
        if header.is_none() {
            let h: SegmentHeader = serde_json::from_str(text)
                .with_context(|| format!("{}: line 1 is not a segment header", path.display()))?;
            if h.format != SEGMENT_FORMAT {
                bail!(
                    "{}: format {:?} is not {SEGMENT_FORMAT:?}",
                    path.display(),
                    h.format
                );
            }
            header = Some(h);
        } else {
            let e: SegmentEvent = serde_json::from_str(text).with_context(|| {
                format!("{}: line {number} is not a trace event", path.display())
            })?;
            events.push(e.into());
        }
    }
    let header = header.with_context(|| format!("{}: the file is empty", path.display()))?;
    Ok(Segment {
        header,
        events,
        sha256: hex::encode(hash.finalize()),
    })
}

/// What [`verify_segments`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SegmentsVerification {
    /// The folder checked.
    pub dir: PathBuf,
    /// Segment files found.
    pub segments: u64,
    /// Events in them.
    pub events: u64,
    /// The last seq the segments cover without a gap from event 1 (0: none).
    pub through_seq: i64,
    /// The first fault and why, in words; `None` when everything holds.
    pub first_bad: Option<(i64, String)>,
    /// What the check covers, one line each.
    pub coverage: Vec<String>,
}

/// Checks the segment files in `dir` with `key`: each file's chain (MACs and links from
/// its `prev_hash`), the links between files from event 1 (a gap or an overlap is a
/// fault), each file a `trace-archived` event inside the segments (or `store_mark`, the
/// store's newest) names against that event's range, head and sha256, and that
/// `store_mark`'s segment ends the run. Checkpoints naming an event in the segments must
/// hold its MAC. Files that are not named like segments are ignored.
///
/// # Errors
/// The folder cannot be read. A file that cannot be read or parsed is a fault.
pub fn verify_segments(
    dir: &Path,
    key: &TraceKey,
    store_mark: Option<&Archived>,
    checkpoints: &[(usize, Checkpoint)],
) -> anyhow::Result<SegmentsVerification> {
    let mut files: Vec<(i64, i64, String)> = Vec::new();
    for entry in std::fs::read_dir(dir)
        .with_context(|| format!("reading the archive folder {}", dir.display()))?
    {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some((from, to)) = parse_segment_name(&name) {
            files.push((from, to, name));
        }
    }
    files.sort();
    let mut v = SegmentsVerification {
        dir: dir.to_path_buf(),
        segments: files.len() as u64,
        ..SegmentsVerification::default()
    };
    let fault = |v: &mut SegmentsVerification, seq: i64, why: String| {
        if v.first_bad.is_none() {
            v.first_bad = Some((seq, why));
        }
    };
    let wanted: BTreeMap<i64, &Checkpoint> = checkpoints.iter().map(|(_, c)| (c.seq, c)).collect();
    let mut checked_points = 0u64;
    let mut marks: Vec<Archived> = Vec::new();
    let mut found: BTreeMap<String, (i64, i64, String, String)> = BTreeMap::new();
    let (mut expected, mut prev) = (1i64, GENESIS_HASH.to_owned());
    let (mut keyed_seen, mut unkeyed_start) = (false, true);
    for (from, to, name) in &files {
        if *from > expected {
            fault(
                &mut v,
                expected,
                format!(
                    "events {expected}..={} are in no segment: a segment file is missing \
                     before {name}",
                    from - 1
                ),
            );
        } else if *from < expected {
            fault(
                &mut v,
                *from,
                format!(
                    "{name} overlaps the segment before it (which ends at {})",
                    expected - 1
                ),
            );
        }
        let segment = match read_segment(&dir.join(name)) {
            Ok(s) => s,
            Err(e) => {
                fault(&mut v, *from, format!("{e:#}"));
                expected = to + 1;
                continue;
            }
        };
        let h = &segment.header;
        if h.from_seq != *from || h.to_seq != *to {
            fault(
                &mut v,
                *from,
                format!(
                    "{name}'s header names events {}..={}, not its file name's",
                    h.from_seq, h.to_seq
                ),
            );
        }
        if *from == expected && h.prev_hash != prev {
            fault(
                &mut v,
                *from,
                format!(
                    "{name} does not link to the segment before it: it starts from {}, but \
                     event {}'s MAC is {prev}",
                    h.prev_hash,
                    from - 1
                ),
            );
        }
        let mut chain = ChainCheck::starting(key, *from, h.prev_hash.clone());
        let mut last_hash = h.prev_hash.clone();
        let mut count = 0u64;
        // Only events before the first MACed one, in a run that starts at event 1, may
        // lack a MAC (written before schema 7): anyone can compute an unkeyed hash, so an
        // unkeyed event anywhere else proves nothing.
        if *from != expected || v.first_bad.is_some() {
            unkeyed_start = false;
        }
        for e in segment.events {
            count += 1;
            match &e.key_id {
                Some(_) => keyed_seen = true,
                None if keyed_seen || !unkeyed_start => fault(
                    &mut v,
                    e.seq,
                    format!(
                        "event {} in {name} has no MAC: only the events before the first MACed \
                         one, from event 1, may lack one (written before schema 7), so this \
                         one was written without the key",
                        e.seq
                    ),
                ),
                None => {}
            }
            if let Some(c) = wanted.get(&e.seq) {
                checked_points += 1;
                if c.head != e.hash {
                    fault(
                        &mut v,
                        e.seq,
                        format!(
                            "event {}'s MAC in {name} is not the one a checkpoint recorded \
                             ({}): the archived chain was rewritten",
                            e.seq, c.head
                        ),
                    );
                }
            }
            if e.kind == TRACE_ARCHIVED {
                match Archived::from_event(key, &e) {
                    Ok(a) => marks.push(a),
                    Err(why) => fault(&mut v, e.seq, why),
                }
            }
            last_hash = e.hash.clone();
            chain.next(e)?;
        }
        if let Some((seq, why)) = chain.first_bad().cloned() {
            fault(&mut v, seq, format!("in {name}: {why}"));
        }
        if count != h.events || count != u64::try_from(to - from + 1).unwrap_or(0) {
            fault(
                &mut v,
                *from,
                format!(
                    "{name} holds {count} events, not the {} its range needs",
                    to - from + 1
                ),
            );
        }
        if last_hash != h.head {
            fault(
                &mut v,
                *to,
                format!(
                    "{name}'s header names head {}, but its last event's MAC is {last_hash}",
                    h.head
                ),
            );
        }
        v.events += count;
        found.insert(
            name.clone(),
            (*from, *to, last_hash.clone(), segment.sha256),
        );
        prev = last_hash;
        expected = expected.max(to + 1);
    }
    if v.events > 0 && !keyed_seen {
        fault(
            &mut v,
            1,
            format!(
                "no event in the segments of {} is MACed with a key: a trace this build wrote \
                 has MACed events, so these were written without the key",
                dir.display()
            ),
        );
    }
    v.through_seq = if files.first().is_some_and(|(f, _, _)| *f == 1) {
        expected - 1
    } else {
        0
    };
    marks.extend(store_mark.cloned());
    for a in &marks {
        let m = &a.mark;
        match found.get(&m.segment) {
            None => fault(
                &mut v,
                m.from_seq,
                format!(
                    "segment {} (events {}..={}), sealed by event {}, is missing from {}",
                    m.segment,
                    m.from_seq,
                    m.to_seq,
                    a.event_seq,
                    dir.display()
                ),
            ),
            Some((from, to, head, sha)) => {
                if (*from, *to) != (m.from_seq, m.to_seq) || *head != m.head || *sha != m.sha256 {
                    fault(
                        &mut v,
                        m.from_seq,
                        format!(
                            "{} is not the segment event {} sealed (its bytes, range or head \
                             differ): it was altered or replaced",
                            m.segment, a.event_seq
                        ),
                    );
                }
            }
        }
    }
    if let Some(a) = store_mark {
        let through = v.through_seq;
        if through < a.mark.to_seq {
            fault(
                &mut v,
                through + 1,
                format!(
                    "the store has archived events up to {}, but the segments in {} cover \
                     only up to {through}",
                    a.mark.to_seq,
                    dir.display(),
                ),
            );
        }
        v.coverage.push(format!(
            "segments: events 1..={} in {} file(s), each MAC-checked and linked from event 1; \
             the store's newest mark (event {}) names the last",
            a.mark.to_seq, v.segments, a.event_seq
        ));
    } else if v.segments > 0 {
        v.coverage.push(format!(
            "segments: events 1..={} in {} file(s), each MAC-checked and linked from event 1",
            v.through_seq, v.segments
        ));
    } else {
        v.coverage
            .push(format!("no segment file in {}", dir.display()));
    }
    let sealed = marks.len();
    if sealed > 0 {
        v.coverage.push(format!(
            "{sealed} segment(s) checked against the `{TRACE_ARCHIVED}` event that sealed them"
        ));
    }
    if checked_points > 0 {
        v.coverage.push(format!(
            "{checked_points} checkpoint(s) naming archived events checked against the segments"
        ));
    }
    Ok(v)
}

/// The newest mark of `backend`'s trace, MAC-checked with `key`.
///
/// # Errors
/// The store fails, or the newest `trace-archived` event does not verify or parse.
pub(crate) fn newest_mark(
    backend: &dyn ArchiveBackend,
    key: &TraceKey,
) -> anyhow::Result<Option<Archived>> {
    backend
        .newest_mark_event()?
        .map(|e| Archived::from_event(key, &e).map_err(|why| anyhow::anyhow!(why)))
        .transpose()
}

/// How many events are missing from `seq..=head` of a trace whose newest mark is `mark`:
/// up to the mark, the kept events from `seq` on that `below` (the stored seqs from `seq`
/// to the mark's `to_seq`) lacks; after it, the seqs from `max(seq, to_seq + 1)` to `head`
/// that the `count` stored there do not fill.
pub(crate) fn missing_from(
    seq: i64,
    mark: Option<&Archived>,
    below: &[i64],
    count: i64,
    head: i64,
) -> u64 {
    let to = mark.map_or(0, |a| a.mark.to_seq);
    let kept_missing = mark.map_or(0, |a| {
        a.mark
            .kept
            .iter()
            .filter(|k| **k >= seq && !below.contains(k))
            .count() as u64
    });
    kept_missing + super::missing(seq.max(to + 1), count, head)
}

/// What an export ([`crate::Trace::export_trace`]) wrote.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Exported {
    /// The segment file.
    pub path: PathBuf,
    /// Its first and last seq.
    pub from_seq: i64,
    /// Its last seq.
    pub to_seq: i64,
    /// Hex sha256 of its bytes.
    pub sha256: String,
    /// Its size in bytes.
    pub bytes: u64,
}

/// Writes the events after the newest mark (from event 1 without one) through the head
/// as one segment file in `dir`, reading them a chunk at a time and checking their chain
/// as they go; the file verifies as any segment does.
///
/// # Errors
/// The store fails, nothing is stored past the mark, the events do not verify (nothing is
/// left behind), or the file cannot be written (an existing file of that name is not
/// replaced).
pub(crate) fn export(
    backend: &dyn ArchiveBackend,
    key: &TraceKey,
    dir: &Path,
) -> anyhow::Result<Exported> {
    let (from, prev_hash) = match newest_mark(backend, key)? {
        Some(a) => (a.mark.to_seq + 1, a.mark.head),
        None => (1, GENESIS_HASH.to_owned()),
    };
    let head = backend
        .times_after(from - 1, i64::MAX)?
        .last()
        .map(|(seq, _)| *seq)
        .context("the trace holds no event to export")?;
    airlock_core::private_fs::ensure_private_dir(dir, "export folder", "or choose another --out")?;
    let name = segment_name(from, head);
    let path = dir.join(&name);
    let file = airlock_core::private_fs::create_new_private(&path)
        .with_context(|| format!("creating {}", path.display()))?;
    let written = (|| -> anyhow::Result<(String, u64)> {
        let last = backend.events_after(head - 1, head, 1)?;
        let head_hash = last
            .first()
            .map(|e| e.hash.clone())
            .context("the head moved")?;
        let mut out = HashingWriter::new(std::io::BufWriter::new(file));
        let header = SegmentHeader {
            format: SEGMENT_FORMAT.into(),
            from_seq: from,
            to_seq: head,
            prev_hash: prev_hash.clone(),
            head: head_hash,
            events: u64::try_from(head - from + 1).unwrap_or(0),
            key_id: key.id().to_owned(),
        };
        serde_json::to_writer(&mut out, &header)?;
        out.write_all(b"\n")?;
        let mut chain = ChainCheck::starting(key, from, prev_hash);
        let mut after = from - 1;
        while after < head {
            let events = backend.events_after(after, head, READ_CHUNK)?;
            if events.is_empty() {
                bail!("event {} is missing from the trace", after + 1);
            }
            for e in events {
                after = e.seq;
                serde_json::to_writer(&mut out, &SegmentEvent::from(&e))?;
                out.write_all(b"\n")?;
                chain.next(e)?;
            }
            if let Some((seq, why)) = chain.first_bad() {
                bail!(
                    "the trace does not verify at event {seq} ({why}): run `airlock trace verify`"
                );
            }
        }
        let (writer, sha, bytes) = out.finish();
        writer
            .into_inner()
            .map_err(|e| e.into_error())?
            .sync_all()?;
        Ok((sha, bytes))
    })();
    match written {
        Ok((sha256, bytes)) => Ok(Exported {
            path,
            from_seq: from,
            to_seq: head,
            sha256,
            bytes,
        }),
        Err(e) => {
            let _ = std::fs::remove_file(&path);
            Err(e.context(format!("writing {}", path.display())))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{SqliteStore, Trace as _};
    use serde_json::json;

    fn open() -> (tempfile::TempDir, SqliteStore, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(&dir.path().join("state")).unwrap();
        let archive = dir.path().join("archive");
        (dir, store, archive)
    }

    fn request(dir: &Path) -> ArchiveRequest {
        ArchiveRequest {
            dir: dir.to_path_buf(),
            before_ms: u64::MAX,
            max_events: DEFAULT_SEGMENT_EVENTS,
            keep_events: None,
            now_ms: crate::now_ms(),
        }
    }

    fn append(store: &SqliteStore, n: usize) {
        for i in 0..n {
            store
                .append_trace("call-outcome", "call-1", &json!({"n": i}))
                .unwrap();
        }
    }

    /// The mark of a pass over everything older than now into `dir` (one must seal).
    fn sealed(store: &SqliteStore, dir: &Path) -> ArchiveMark {
        store
            .archive_trace(&request(dir))
            .unwrap()
            .sealed
            .unwrap()
            .mark
    }

    /// An event of call `call` that closes intent `intent` (`completed`).
    fn close_in_trace(store: &SqliteStore, call: &str, intent: &str) {
        store
            .append_trace(
                "call-outcome",
                call,
                &json!({"intent": intent, "intent_state": "completed"}),
            )
            .unwrap();
    }

    fn stored_seqs(store: &SqliteStore) -> Vec<i64> {
        store
            .trace(0, usize::MAX)
            .unwrap()
            .iter()
            .map(|e| e.seq)
            .collect()
    }

    fn raw(store: &SqliteStore) -> std::sync::MutexGuard<'_, rusqlite::Connection> {
        store.lock()
    }

    /// A pass seals the prefix, deletes what it does not keep, and the store and the
    /// segments both still verify, from event 1.
    #[test]
    fn a_pass_seals_the_prefix_and_everything_still_verifies() {
        let (_d, store, dir) = open();
        store
            .append_trace("mapping-revision", "notes", &json!({"revision": 1}))
            .unwrap();
        append(&store, 30);
        let report = store.archive_trace(&request(&dir)).unwrap();
        let sealed = report.sealed.clone().expect("a segment was sealed");
        assert_eq!((sealed.mark.from_seq, sealed.mark.to_seq), (1, 31));
        assert_eq!(sealed.mark.kept, vec![1], "the mapping's proof stays");
        assert_eq!(report.deleted, 30);
        assert!(dir.join(&sealed.mark.segment).is_file());
        append(&store, 5);
        assert_eq!(stored_seqs(&store), [1, 32, 33, 34, 35, 36, 37]);
        let v = store.verify_trace().unwrap();
        assert_eq!(v.first_bad, None, "{v:?}");
        assert_eq!(v.archived_to, Some(31));
        assert_eq!(store.trace_missing_from(1).unwrap(), 0);
        assert_eq!(store.mapping_proofs("notes").unwrap().len(), 1);
        let mark = store.archive_mark().unwrap();
        let s = verify_segments(&dir, store.key(), mark.as_ref(), &[]).unwrap();
        assert_eq!(s.first_bad, None, "{s:?}");
        assert_eq!((s.segments, s.events, s.through_seq), (1, 31, 31));

        // A second pass seals from where the first ended, its mark inside.
        let second = store.archive_trace(&request(&dir)).unwrap();
        let m2 = second.sealed.expect("second segment").mark;
        assert_eq!((m2.from_seq, m2.to_seq), (32, 37));
        assert_eq!(m2.kept, vec![1]);
        assert_eq!(stored_seqs(&store), [1, 38]);
        assert_eq!(store.verify_trace().unwrap().first_bad, None);
        let mark = store.archive_mark().unwrap();
        let s = verify_segments(&dir, store.key(), mark.as_ref(), &[]).unwrap();
        assert_eq!(s.first_bad, None, "{s:?}");
        assert_eq!(s.through_seq, 37);
        // Nothing old enough: no segment, nothing deleted.
        let idle = store
            .archive_trace(&ArchiveRequest {
                before_ms: 1,
                ..request(&dir)
            })
            .unwrap();
        assert_eq!((idle.sealed, idle.deleted), (None, 0));
    }

    /// Events at or after the cutoff stay, and a pass seals at most `max_events`.
    #[test]
    fn the_cutoff_and_the_segment_size_bound_a_pass() {
        let (_d, store, dir) = open();
        append(&store, 10);
        let report = store
            .archive_trace(&ArchiveRequest {
                max_events: 4,
                ..request(&dir)
            })
            .unwrap();
        assert_eq!(report.sealed.unwrap().mark.to_seq, 4);
        let at5 = store.trace(4, 1).unwrap()[0].at_ms;
        let report = store
            .archive_trace(&ArchiveRequest {
                before_ms: at5,
                ..request(&dir)
            })
            .unwrap();
        assert_eq!(report.sealed, None, "event 5 is not older than the cutoff");
        // By count: all but the newest 3 of the 11 (the first pass's mark is one).
        let report = store
            .archive_trace(&ArchiveRequest {
                before_ms: 0,
                keep_events: Some(3),
                ..request(&dir)
            })
            .unwrap();
        assert_eq!(report.sealed.unwrap().mark.to_seq, 8);
        assert_eq!(store.verify_trace().unwrap().first_bad, None);
    }

    /// An open intent's events and a usable approval's stay; once closed, the next pass
    /// archives them.
    #[test]
    fn what_is_still_needed_stays_until_it_is_not() {
        let (_d, store, dir) = open();
        store
            .append_trace(
                "intent-created",
                "call-9",
                &json!({"intent": "int_open", "intent_state": "prepared"}),
            )
            .unwrap();
        store
            .append_trace(
                "approval-requested",
                "call-9",
                &json!({"approval": "apr_x"}),
            )
            .unwrap();
        store
            .append_trace("call-outcome", "call-9", &json!({"intent": "int_open"}))
            .unwrap();
        append(&store, 3);
        let m = sealed(&store, &dir);
        assert_eq!(
            m.kept,
            vec![1],
            "open by the trace: no event closed it; a read's outcome and an approval without a row are not needed"
        );
        assert_eq!(store.intent_proofs("int_open").unwrap().len(), 1);
        close_in_trace(&store, "call-9", "int_open");
        let m = sealed(&store, &dir);
        assert!(m.kept.is_empty(), "closed: {m:?}");
        assert!(store.intent_proofs("int_open").unwrap().is_empty());
        assert_eq!(store.verify_trace().unwrap().first_bad, None);
    }

    /// A kept proof deleted or altered, the mark deleted, or an unarchived event deleted:
    /// each is named.
    #[test]
    fn tampering_below_and_at_the_mark_is_found() {
        let (_d, store, dir) = open();
        store
            .append_trace("mapping-revision", "notes", &json!({"revision": 1}))
            .unwrap();
        append(&store, 5);
        store.archive_trace(&request(&dir)).unwrap();
        append(&store, 2);
        // The trigger refuses deleting an event after the archived range.
        let refused = raw(&store).execute("DELETE FROM trace_events WHERE seq = 8", []);
        assert!(
            refused
                .unwrap_err()
                .to_string()
                .contains("only archived events"),
            "an unarchived event cannot be deleted"
        );
        // Altered kept event.
        {
            let c = raw(&store);
            c.execute_batch("DROP TRIGGER trace_events_no_update")
                .unwrap();
            c.execute(
                "UPDATE trace_events SET payload = '{\"revision\":2}' WHERE seq = 1",
                [],
            )
            .unwrap();
        }
        let v = store.verify_trace().unwrap();
        let (seq, why) = v.first_bad.unwrap();
        assert_eq!(seq, 1);
        assert!(why.contains("was altered"), "{why}");
        // Deleted kept event (the trigger allows it below the mark: the mark names it).
        raw(&store)
            .execute("DELETE FROM trace_events WHERE seq = 1", [])
            .unwrap();
        let v = store.verify_trace().unwrap();
        let (_, why) = v.first_bad.unwrap();
        assert!(why.contains("proofs still needed were deleted"), "{why}");
        assert!(store.trace_missing_from(1).unwrap() >= 1);
    }

    /// Deleting the mark (with the trigger dropped) breaks the chain where it was.
    #[test]
    fn a_deleted_mark_breaks_the_chain() {
        let (_d, store, dir) = open();
        append(&store, 5);
        let m = store.archive_trace(&request(&dir)).unwrap().sealed.unwrap();
        append(&store, 2);
        {
            let c = raw(&store);
            c.execute_batch("DROP TRIGGER trace_events_no_delete")
                .unwrap();
            c.execute("DELETE FROM trace_events WHERE seq = ?1", [m.event_seq])
                .unwrap();
        }
        let v = store.verify_trace().unwrap();
        let (_, why) = v.first_bad.unwrap();
        assert!(why.contains("missing"), "{why}");
    }

    /// A forged mark is refused by the verification and by the next pass.
    #[test]
    fn a_forged_mark_is_refused() {
        let (_d, store, dir) = open();
        append(&store, 3);
        {
            let c = raw(&store);
            c.execute(
                "INSERT INTO trace_events (seq, at_ms, kind, subject, payload, prev_hash, hash, key_id) \
                 VALUES (4, 0, 'trace-archived', 'trace', '{}', ?1, ?1, ?2)",
                rusqlite::params!["0".repeat(64), store.key().id()],
            )
            .unwrap();
        }
        let v = store.verify_trace().unwrap();
        assert!(v.first_bad.unwrap().1.contains("forged"));
        let err = store.archive_trace(&request(&dir)).unwrap_err();
        assert!(
            format!("{err:#}").contains("nothing was archived"),
            "{err:#}"
        );
        assert_eq!(stored_seqs(&store).len(), 4, "nothing was deleted");
    }

    /// A pass refuses to seal events that do not verify (it never launders tampering).
    #[test]
    fn a_pass_refuses_a_chain_that_does_not_verify() {
        let (_d, store, dir) = open();
        append(&store, 4);
        {
            let c = raw(&store);
            c.execute_batch("DROP TRIGGER trace_events_no_update")
                .unwrap();
            c.execute("UPDATE trace_events SET subject = 'x' WHERE seq = 2", [])
                .unwrap();
        }
        let err = store.archive_trace(&request(&dir)).unwrap_err();
        assert!(
            format!("{err:#}").contains("does not verify at event 2"),
            "{err:#}"
        );
        assert_eq!(stored_seqs(&store).len(), 4);
        let left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left, [LOCK_FILE], "no segment or temporary file is left");
    }

    /// Removing, editing or cutting a segment file is found offline.
    #[test]
    fn segment_files_are_checked() {
        let (_d, store, dir) = open();
        append(&store, 6);
        store
            .archive_trace(&ArchiveRequest {
                max_events: 3,
                ..request(&dir)
            })
            .unwrap();
        store.archive_trace(&request(&dir)).unwrap();
        let mark = store.archive_mark().unwrap();
        let ok = verify_segments(&dir, store.key(), mark.as_ref(), &[]).unwrap();
        assert_eq!(ok.first_bad, None, "{ok:?}");
        assert_eq!(ok.segments, 2);
        let first = dir.join(segment_name(1, 3));
        let bytes = std::fs::read(&first).unwrap();

        // Edited: one byte of an event's subject.
        let text = String::from_utf8(bytes.clone())
            .unwrap()
            .replacen("call-1", "call-2", 1);
        std::fs::write(&first, text).unwrap();
        let v = verify_segments(&dir, store.key(), mark.as_ref(), &[]).unwrap();
        assert!(v.first_bad.is_some(), "an edited segment is found");

        // Bytes changed where no MAC covers them (the header's spacing): the sha256 its
        // mark recorded no longer holds.
        let text =
            String::from_utf8(bytes.clone())
                .unwrap()
                .replacen("{\"format\"", "{ \"format\"", 1);
        std::fs::write(&first, text).unwrap();
        let v = verify_segments(&dir, store.key(), mark.as_ref(), &[]).unwrap();
        assert!(
            v.first_bad.unwrap().1.contains("altered or replaced"),
            "a reformatted segment"
        );

        // Cut short.
        std::fs::write(&first, &bytes[..bytes.len() - 10]).unwrap();
        let v = verify_segments(&dir, store.key(), mark.as_ref(), &[]).unwrap();
        assert!(v.first_bad.unwrap().1.contains("cut short"));

        // Removed: a gap from event 1, and the mark that sealed it names it.
        std::fs::remove_file(&first).unwrap();
        let v = verify_segments(&dir, store.key(), mark.as_ref(), &[]).unwrap();
        let (seq, why) = v.first_bad.unwrap();
        assert_eq!(seq, 1);
        assert!(why.contains("in no segment"), "{why}");
        assert_eq!(v.through_seq, 0);

        // Hostile lines: not JSON, another format, an unknown field.
        for (text, wanted) in [
            ("not json\n", "not a segment header"),
            (
                "{\"format\":\"x\",\"from_seq\":1,\"to_seq\":3,\"prev_hash\":\"\",\"head\":\"\",\"events\":3,\"key_id\":\"\"}\n",
                "is not",
            ),
            (
                "{\"format\":\"airlock-trace-segment/1\",\"from_seq\":1,\"to_seq\":3,\"prev_hash\":\"\",\"head\":\"\",\"events\":3,\"key_id\":\"\",\"extra\":1}\n",
                "not a segment header",
            ),
        ] {
            std::fs::write(&first, text).unwrap();
            let err = read_segment(&first).unwrap_err();
            assert!(format!("{err:#}").contains(wanted), "{err:#}");
            let v = verify_segments(&dir, store.key(), mark.as_ref(), &[]).unwrap();
            assert!(v.first_bad.is_some());
        }
    }

    /// A checkpoint naming an archived event holds against the segment, and one whose
    /// MAC differs is reported.
    #[test]
    fn checkpoints_of_archived_events_are_checked_in_the_segments() {
        let (_d, store, dir) = open();
        append(&store, 3);
        let point = store.trace_checkpoint().unwrap();
        append(&store, 2);
        store.archive_trace(&request(&dir)).unwrap();
        let v = store.verify_trace_against(&[(1, point.clone())]).unwrap();
        assert_eq!(v.first_bad, None, "{v:?}");
        let mark = store.archive_mark().unwrap();
        let s = verify_segments(&dir, store.key(), mark.as_ref(), &[(1, point.clone())]).unwrap();
        assert_eq!(s.first_bad, None);
        let forged = store
            .key()
            .checkpoint(point.seq, &"a".repeat(64), point.at_ms);
        let s = verify_segments(&dir, store.key(), mark.as_ref(), &[(1, forged)]).unwrap();
        assert!(s.first_bad.unwrap().1.contains("checkpoint"));
    }

    /// The export holds the events after the mark; with the segments it verifies from
    /// event 1.
    #[test]
    fn an_export_completes_the_segments() {
        let (_d, store, dir) = open();
        append(&store, 4);
        store.archive_trace(&request(&dir)).unwrap();
        append(&store, 3);
        let out = tempfile::tempdir().unwrap();
        let copy = out.path().join("copy");
        airlock_core::private_fs::ensure_private_dir(&copy, "copy", "").unwrap();
        for e in std::fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), copy.join(e.file_name())).unwrap();
        }
        let exported = store.export_trace(&copy).unwrap();
        assert_eq!((exported.from_seq, exported.to_seq), (5, 8));
        let s = verify_segments(&copy, store.key(), None, &[]).unwrap();
        assert_eq!(s.first_bad, None, "{s:?}");
        assert_eq!(s.through_seq, 8);
        assert!(
            store.export_trace(&copy).is_err(),
            "an existing file is not replaced"
        );
    }

    /// A backend whose mark is appended only after another store sealed a segment first
    /// (two passes at once: `serve` and `airlock trace archive`).
    struct Racing<'s> {
        inner: crate::SqliteArchive<'s>,
        other: &'s SqliteStore,
        dir: PathBuf,
        max_events: i64,
    }

    impl ArchiveBackend for Racing<'_> {
        fn newest_mark_event(&self) -> anyhow::Result<Option<StoredEvent>> {
            self.inner.newest_mark_event()
        }
        fn events_after(&self, a: i64, t: i64, l: i64) -> anyhow::Result<Vec<StoredEvent>> {
            self.inner.events_after(a, t, l)
        }
        fn times_after(&self, a: i64, l: i64) -> anyhow::Result<Vec<(i64, i64)>> {
            self.inner.times_after(a, l)
        }
        fn head_seq(&self) -> anyhow::Result<i64> {
            self.inner.head_seq()
        }
        fn events_at(&self, seqs: &[i64]) -> anyhow::Result<Vec<StoredEvent>> {
            self.inner.events_at(seqs)
        }
        fn needs(&self, now_ms: u64) -> anyhow::Result<Needs> {
            self.inner.needs(now_ms)
        }
        fn intent_closed_in_trace(&self, id: &str) -> anyhow::Result<bool> {
            self.inner.intent_closed_in_trace(id)
        }
        fn append_mark(&self, previous: Option<i64>, mark: &ArchiveMark) -> anyhow::Result<i64> {
            self.other
                .archive_trace(&ArchiveRequest {
                    max_events: self.max_events,
                    ..request(&self.dir)
                })
                .unwrap();
            self.inner.append_mark(previous, mark)
        }
        fn delete_archived(&self, to: i64, kept: &[i64], limit: i64) -> anyhow::Result<u64> {
            self.inner.delete_archived(to, kept, limit)
        }
        fn reclaim(&self) -> anyhow::Result<u64> {
            self.inner.reclaim()
        }
    }

    /// Of two passes at once into two folders (two hosts of one shared store; passes into
    /// one folder wait for each other), one seals; the other withdraws its segment
    /// (unless it is the very file the winner sealed, byte for byte), and the winner's
    /// folder verifies.
    #[test]
    fn the_loser_of_two_passes_at_once_leaves_no_segment_behind() {
        let (d, store, dir) = open();
        let winners = d.path().join("winner");
        append(&store, 10);
        let other = SqliteStore::open(&d.path().join("state")).unwrap();
        for (winner_max, loser_file) in [(4, Some(segment_name(1, 10))), (100, None)] {
            let racing = Racing {
                inner: crate::SqliteArchive(&store),
                other: &other,
                dir: winners.clone(),
                max_events: winner_max,
            };
            let err = run_pass(&racing, store.key(), &request(&dir)).unwrap_err();
            assert!(
                format!("{err:#}").contains("archived the trace meanwhile"),
                "{err:#}"
            );
            if let Some(file) = loser_file {
                assert!(
                    !dir.join(file).exists(),
                    "the unsealed segment is withdrawn"
                );
            }
            let mark = store.archive_mark().unwrap();
            let s = verify_segments(&winners, store.key(), mark.as_ref(), &[]).unwrap();
            assert_eq!(s.first_bad, None, "{s:?}");
            assert_eq!(store.verify_trace().unwrap().first_bad, None);
            append(&store, 3);
        }
    }

    /// A segment file a killed pass left (no mark names it) is removed by the next pass
    /// that starts there, so the folder still verifies.
    #[test]
    fn a_killed_passs_segment_is_removed_by_the_next_pass() {
        let (_d, store, dir) = open();
        append(&store, 6);
        store
            .archive_trace(&ArchiveRequest {
                max_events: 3,
                ..request(&dir)
            })
            .unwrap();
        let orphan = dir.join(segment_name(4, 9));
        std::fs::write(&orphan, "left by a killed pass\n").unwrap();
        let m = sealed(&store, &dir);
        assert_eq!(m.from_seq, 4);
        assert!(!orphan.exists() || m.segment == segment_name(4, 9));
        let mark = store.archive_mark().unwrap();
        let s = verify_segments(&dir, store.key(), mark.as_ref(), &[]).unwrap();
        assert_eq!(s.first_bad, None, "{s:?}");
    }

    /// Writes a segment of `n` unkeyed events from `from` after `prev` (what anyone can
    /// compute: the schema-6 sha256 chain, no key) into `dir`.
    fn forged_segment(dir: &Path, from: i64, n: i64, prev: &str) {
        let mut prev = prev.to_owned();
        let mut lines = Vec::new();
        for seq in from..from + n {
            let payload = "{\"forged\":true}".to_owned();
            let hash = crate::trace::chained_hash(seq, 1_000, "call-outcome", "c", &payload, &prev)
                .unwrap();
            lines.push(
                serde_json::to_string(&SegmentEvent {
                    seq,
                    at_ms: 1_000,
                    kind: "call-outcome".into(),
                    subject: "c".into(),
                    payload,
                    prev_hash: prev.clone(),
                    hash: hash.clone(),
                    key_id: None,
                })
                .unwrap(),
            );
            prev = hash;
        }
        let header = SegmentHeader {
            format: SEGMENT_FORMAT.into(),
            from_seq: from,
            to_seq: from + n - 1,
            prev_hash: lines
                .first()
                .map(|l| serde_json::from_str::<SegmentEvent>(l).unwrap().prev_hash)
                .unwrap(),
            head: prev,
            events: n as u64,
            key_id: "0".repeat(16),
        };
        let mut text = serde_json::to_string(&header).unwrap() + "\n";
        for l in lines {
            text += &(l + "\n");
        }
        std::fs::write(dir.join(segment_name(from, from + n - 1)), text).unwrap();
    }

    /// Events without a MAC prove nothing: a folder forged from event 1 without the key,
    /// or unkeyed events after MACed segments (an "export" forged beside them), are
    /// faults.
    #[test]
    fn segments_without_macs_are_refused() {
        let (d, store, dir) = open();
        let key = store.key().clone();
        let forged = d.path().join("forged");
        std::fs::create_dir(&forged).unwrap();
        forged_segment(&forged, 1, 5, GENESIS_HASH);
        let v = verify_segments(&forged, &key, None, &[]).unwrap();
        assert!(
            v.first_bad.unwrap().1.contains("MACed with a key"),
            "a wholly forged folder"
        );

        append(&store, 4);
        store.archive_trace(&request(&dir)).unwrap();
        let mark = store.archive_mark().unwrap().unwrap();
        forged_segment(&dir, mark.mark.to_seq + 1, 3, &mark.mark.head);
        let v = verify_segments(&dir, &key, Some(&mark), &[]).unwrap();
        let (seq, why) = v.first_bad.unwrap();
        assert_eq!(seq, mark.mark.to_seq + 1);
        assert!(why.contains("has no MAC"), "{why}");
        let v = verify_segments(&dir, &key, None, &[]).unwrap();
        assert!(v.first_bad.is_some(), "without the store's mark too");
    }

    /// A genuine mark (appended with the key) whose shape is wrong, or whose head the
    /// next event does not link to, is a fault of the store's verification and stops a
    /// pass.
    #[test]
    fn a_mark_that_does_not_hold_is_reported() {
        let good = |to: i64| ArchiveMark {
            segment: segment_name(1, to),
            from_seq: 1,
            to_seq: to,
            prev_hash: GENESIS_HASH.into(),
            head: "a".repeat(64),
            sha256: "b".repeat(64),
            kept: (1..=to).collect(),
            cutoff_ms: 0,
        };
        let cases: Vec<(ArchiveMark, &str)> = vec![
            (
                ArchiveMark {
                    to_seq: 9,
                    ..good(3)
                },
                "impossible range",
            ),
            (
                ArchiveMark {
                    segment: "../x".into(),
                    ..good(3)
                },
                "not the range's file name",
            ),
            (
                ArchiveMark {
                    kept: vec![3, 2],
                    ..good(3)
                },
                "out of order",
            ),
            (
                ArchiveMark {
                    kept: vec![99],
                    ..good(3)
                },
                "outside its range",
            ),
            (good(3), "does not link"),
        ];
        for (mark, wanted) in cases {
            let (_d, store, dir) = open();
            append(&store, 3);
            store
                .append_trace(
                    TRACE_ARCHIVED,
                    "trace",
                    &serde_json::to_value(&mark).unwrap(),
                )
                .unwrap();
            append(&store, 1);
            let (_, why) = store.verify_trace().unwrap().first_bad.expect(wanted);
            assert!(why.contains(wanted), "{wanted}: {why}");
            if wanted != "does not link" {
                let err = store.archive_trace(&request(&dir)).unwrap_err();
                assert!(
                    format!("{err:#}").contains("nothing was archived"),
                    "{err:#}"
                );
            }
        }
    }

    /// An intent whose row is still open keeps its events even when an event claims it
    /// closed (the row and the trace disagree: keep the proofs).
    #[test]
    fn an_open_row_keeps_its_intents_events() {
        let (_d, store, dir) = open();
        let created = crate::NewEvent::new(
            "intent-created",
            "call_1",
            json!({"intent": "int_1", "intent_state": "prepared"}),
        );
        crate::Intents::create_intent(
            &store,
            &crate::NewIntent {
                compensates: None,
                id: "int_1".into(),
                idempotency_key: "idk_1".into(),
                call_id: "call_1".into(),
                requester: "alice".into(),
                session: "ses_1".into(),
                capability: "deliver".into(),
                mapping: "m".into(),
                mapping_revision: 1,
                args_digest: "c".repeat(64),
                effect_class: "external-effect".into(),
            },
            vec![created],
        )
        .unwrap();
        close_in_trace(&store, "call_1", "int_1");
        let m = sealed(&store, &dir);
        assert_eq!(m.kept, vec![1, 2], "{m:?}");
        assert_eq!(store.intent_proofs("int_1").unwrap().len(), 2);
    }

    /// A new database vacuums incrementally, and a pass gives the space back.
    #[test]
    fn a_new_database_gives_archived_space_back() {
        let (_d, store, dir) = open();
        let mode: i64 = raw(&store)
            .pragma_query_value(None, "auto_vacuum", |r| r.get(0))
            .unwrap();
        assert_eq!(mode, 2, "incremental");
        let big = "x".repeat(2000);
        for _ in 0..300 {
            store
                .append_trace("call-outcome", "c", &json!({"pad": big}))
                .unwrap();
        }
        let report = store.archive_trace(&request(&dir)).unwrap();
        assert!(report.reclaimed_bytes > 300 * 1000, "{report:?}");
    }

    #[test]
    fn segment_names_round_trip_and_others_are_not_segments() {
        assert_eq!(parse_segment_name(&segment_name(1, 99)), Some((1, 99)));
        for name in [
            "trace-1-2.jsonl",
            "trace-000000000002-000000000001.jsonl",
            "trace-000000000000-000000000001.jsonl",
            "other.jsonl",
            ".trace-000000000001-000000000002.jsonl.tmp",
        ] {
            assert_eq!(parse_segment_name(name), None, "{name}");
        }
    }
}
