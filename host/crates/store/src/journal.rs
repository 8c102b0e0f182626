//! The trace journal: a call's trace events and observations made durable with one
//! `write(2)` before its answer, then moved into the chained trace off the call's path.
//!
//! Rule: **a call is acknowledged only once its events are durable, and every reader of the
//! trace sees every acknowledged call.** On the embedded store a call's events and
//! observations ([`super::Trace::append_call`]) are one *record*, appended to this
//! process's journal file and written (one `write(2)`, no `fsync`: durable against a crash
//! of the process, like a commit under `synchronous=NORMAL`) before the call may answer.
//! The records then move into `trace_events` (chained and MACed there as any event) and
//! `observations`, in the order they were written, exactly once:
//! - by the `airlock-trace-journal` thread of the writing process, every
//!   [`INGEST_INTERVAL`] while records wait (or every [`INTERVAL_ENV`] milliseconds), at
//!   most [`INGEST_BATCH_BYTES`] per transaction;
//! - by **any** process, before it reads the trace or the observations, or appends to the
//!   trace itself (so the chain's order is the order things became durable, and a reader
//!   in another process — `airlock trace verify` while `airlock serve` runs — sees every
//!   call that was answered);
//! - at every open of the store (the journals of a process that stopped or crashed).
//!
//! Exactly once: each journal has a row in `trace_journals` holding how many of its bytes
//! are in the trace; a pass advances it in the same transaction that appends the records.
//!
//! Files: `trace-journal/` in the state folder (mode 0700, checked as the state folder
//! is: [`airlock_core::private_fs`]), one file per writing process at a time, named
//! `<database file name>.<24 hex>.journal` (mode 0600, `O_NOFOLLOW`), which the writer
//! holds an exclusive `flock` on while it lives. A file past [`ROTATE_BYTES`] is *sealed*
//! (its final size recorded) and a new one begun; a sealed file whose every byte is in the
//! trace is deleted, then its row. A journal another process finds unlocked has lost its
//! writer: it is sealed at its last whole record, and a partial record after it (the
//! writer died inside `write(2)`, so that call never answered) is dropped with a warning.
//!
//! Record format (integers big-endian): `ALJ1`, the body's length (u32, at most
//! [`MAX_RECORD_BYTES`]), the HMAC-SHA256 under the host key of the journal's name, the
//! record's offset and the body ([`super::key`]), then the body: `at_ms` (u64), the
//! number of events (u32) and each event's kind, subject and payload (its canonical JSON
//! text), the number of observations (u32) and each observation's fields in their
//! declared order ([`NewObservation`]); a text is its byte length (u32) then its UTF-8
//! bytes, a number a u64. Nothing may follow the last field. A record moved or copied to
//! another offset or file, edited, or written without the key fails its MAC; a body that
//! does not decode is refused whole.
//!
//! What fails closed: a record that is not a record, fails its MAC or does not decode
//! stops the ingestion of its journal there (nothing after it is moved, nothing is
//! skipped) and is reported by [`super::Trace::verify_trace`]; a journal whose row says
//! bytes are still to come but whose file is gone is reported the same way. While this
//! process's own journal cannot be moved into the store (a bad record, a database that
//! refuses the rows), its appends are refused, so calls answer "could not record this
//! call" instead of piling up records no reader will see. What a journal cannot see:
//! like the newest events of the trace, records deleted from the end of a journal before
//! they were moved (a deleted newest event is caught by checkpoints,
//! [`super::Trace::verify_trace_against`]; a deleted unmoved record is not, until it was
//! moved).

use std::fs::File;
use std::io::Write as _;
use std::os::unix::fs::{FileExt as _, MetadataExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{Context as _, bail};
use rusqlite::{Connection, TransactionBehavior, params};

use super::key::TraceKey;
use super::observations::{self, NewObservation};
use super::trace::{self, NewEvent, Row};
use super::{ms_to_sql, now_ms};

/// The journal folder's name, in the state folder.
pub const JOURNAL_DIR: &str = "trace-journal";

/// First bytes of every record.
const MAGIC: &[u8; 4] = b"ALJ1";

/// Magic, body length, MAC.
const HEADER_BYTES: usize = 4 + 4 + 32;

/// Largest record body accepted (bytes): a call's events and observations are a few KiB.
pub const MAX_RECORD_BYTES: usize = 16 << 20;

/// A journal file past this size (bytes) is sealed and a new one begun.
pub const ROTATE_BYTES: u64 = 4 << 20;

/// How often the writing process's `airlock-trace-journal` thread looks for records to
/// move into the trace. Moving is cheaper per record in larger transactions (a page the
/// records of many calls update is written to the WAL once; the ignored test
/// `moving_cost` measures it): against every 10 ms, serve took 271 instead of 291 µs of
/// CPU per call at one caller and the same at eight (floor bench, 8 rounds).
pub const INGEST_INTERVAL: Duration = Duration::from_millis(50);

/// Environment variable that sets the thread's interval in milliseconds instead (at least
/// 1), read when the thread starts; tests set it high to hold records in a journal.
pub const INTERVAL_ENV: &str = "AIRLOCK_TRACE_JOURNAL_MS";

/// The thread's interval: [`INTERVAL_ENV`] when it holds a whole number of milliseconds
/// (at least 1), else [`INGEST_INTERVAL`].
fn interval() -> Duration {
    std::env::var(INTERVAL_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|ms| *ms >= 1)
        .map_or(INGEST_INTERVAL, Duration::from_millis)
}

/// Most journal bytes the `airlock-trace-journal` thread moves in one transaction (its
/// hold of the store's connection stays short); a reader's pass moves everything.
pub const INGEST_BATCH_BYTES: u64 = 512 << 10;

/// The journal of one open store: the file this process appends to (made at its first
/// record) and what moving records needs.
pub(super) struct Journal {
    /// The journal folder.
    dir: PathBuf,
    /// `<database file name>.`: what this database's journal files start with.
    prefix: String,
    key: TraceKey,
    /// [`ROTATE_BYTES`], smaller in tests.
    rotate_bytes: u64,
    writer: Mutex<Option<Writer>>,
    /// Set while this process's own records cannot be moved into the store: why. Appends
    /// are refused meanwhile.
    failing: Mutex<Option<String>>,
    /// Records this process appended.
    appended: AtomicU64,
    /// [`Journal::appended`] as it was when a pass last moved all of this process's
    /// records.
    moved: AtomicU64,
}

/// The file this process appends to.
struct Writer {
    id: i64,
    name: String,
    file: File,
    /// Bytes written (the next record's offset).
    size: u64,
    /// A write failed part-way at this offset: the file is sealed there before the next
    /// record goes to a new one.
    broken_at: Option<u64>,
}

/// What one pass over the journals did.
#[derive(Debug, Default)]
pub(super) struct Moved {
    /// Records moved into the trace.
    pub records: u64,
    /// The pass stopped at its budget with bytes left.
    pub more: bool,
    /// Journals that could not be moved (file name), and why (the host's words).
    pub problems: Vec<(String, String)>,
}

/// One row of `trace_journals`.
struct JournalRow {
    id: i64,
    name: String,
    ingested: u64,
    sealed: Option<u64>,
}

/// A decoded record body.
#[derive(Debug, PartialEq)]
struct Body {
    at_ms: u64,
    /// Kind, subject, payload (canonical JSON text).
    events: Vec<(String, String, String)>,
    observations: Vec<NewObservation>,
}

impl Journal {
    /// The journal of the database at `database` (its folder holds [`JOURNAL_DIR`]),
    /// whose records are MACed with `key`. Nothing is created until the first record.
    pub(super) fn new(database: &Path, key: TraceKey) -> Self {
        let folder = database
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let file_name = database
            .file_name()
            .map_or_else(|| "airlock.db".into(), |n| n.to_string_lossy().into_owned());
        Self {
            dir: folder.join(JOURNAL_DIR),
            prefix: format!("{file_name}."),
            key,
            rotate_bytes: ROTATE_BYTES,
            writer: Mutex::new(None),
            failing: Mutex::new(None),
            appended: AtomicU64::new(0),
            moved: AtomicU64::new(0),
        }
    }

    fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
        m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The journal folder.
    pub(super) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether this process appended records that no pass has moved yet.
    pub(super) fn has_unmoved(&self) -> bool {
        self.appended.load(Ordering::Acquire) != self.moved.load(Ordering::Acquire)
    }

    /// Why this process's records cannot be moved into the store, if they cannot.
    pub(super) fn failing(&self) -> Option<String> {
        Self::lock(&self.failing).clone()
    }

    /// Appends one call's `events` and `observations` as one record and returns once it
    /// is written. `conn` gives the store's connection (its lock), taken only to register
    /// a new journal file (the first record, or after a failed write).
    ///
    /// # Errors
    /// This process's records cannot be moved into the store ([`Journal::failing`]); the
    /// record is larger than [`MAX_RECORD_BYTES`]; the file cannot be made or written. In
    /// every case nothing of the record counts as written.
    pub(super) fn append<G>(
        &self,
        conn: impl FnOnce() -> G,
        events: &[NewEvent],
        observations: &[NewObservation],
    ) -> anyhow::Result<()>
    where
        G: std::ops::Deref<Target = Connection>,
    {
        if let Some(why) = self.failing() {
            bail!(
                "the trace journal's records cannot be moved into the store ({why}); nothing \
                 was recorded"
            );
        }
        let body = encode(now_ms(), events, observations)?;
        let mut writer = Self::lock(&self.writer);
        if writer.as_ref().is_none_or(|w| w.broken_at.is_some()) {
            // Lock order: the connection, then the writer.
            drop(writer);
            let conn = conn();
            writer = Self::lock(&self.writer);
            if writer.as_ref().is_none_or(|w| w.broken_at.is_some()) {
                if let Some(old) = writer.take() {
                    seal(&conn, old.id, old.broken_at.unwrap_or(old.size))?;
                }
                *writer = Some(self.open_writer(&conn)?);
            }
        }
        let w = writer.as_mut().expect("a writer was just made");
        let record = frame(&self.key, &w.name, w.size, &body);
        if let Err(e) = w.file.write_all(&record) {
            // A partial record would hide every later one: cut it off, and start a new
            // file at the next record either way.
            let _ = w.file.set_len(w.size);
            w.broken_at = Some(w.size);
            return Err(e).with_context(|| {
                format!(
                    "writing the trace journal {}; nothing was recorded",
                    self.dir.join(&w.name).display()
                )
            });
        }
        w.size += record.len() as u64;
        self.appended.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// Makes this process's journal file and registers it (its row first written once the
    /// file exists and is locked, so a row never names a file that was never made).
    fn open_writer(&self, conn: &Connection) -> anyhow::Result<Writer> {
        airlock_core::private_fs::ensure_private_dir(&self.dir, "trace journal folder", "")?;
        let mut id = [0u8; 12];
        getrandom::fill(&mut id).context("the OS random source failed")?;
        let name = format!("{}{}.journal", self.prefix, hex::encode(id));
        let path = self.dir.join(&name);
        let file = std::fs::OpenOptions::new()
            .append(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .with_context(|| format!("creating the trace journal {}", path.display()))?;
        file.try_lock().map_err(|e| {
            anyhow::anyhow!("locking the new trace journal {}: {e}", path.display())
        })?;
        let registered = conn.execute(
            "INSERT INTO trace_journals (name, ingested, sealed, created_ms) VALUES (?1, 0, NULL, ?2)",
            params![name, ms_to_sql(now_ms())?],
        );
        if let Err(e) = registered {
            let _ = std::fs::remove_file(&path);
            return Err(e).context("registering the trace journal in the store");
        }
        tracing::debug!(journal = %path.display(), "trace journal opened");
        Ok(Writer {
            id: conn.last_insert_rowid(),
            name,
            file,
            size: 0,
            broken_at: None,
        })
    }

    /// Seals this process's journal file when it is past [`ROTATE_BYTES`] (or its last
    /// write failed) and makes the next one, so that no append waits for a new file.
    pub(super) fn rotate(&self, conn: &Connection) -> anyhow::Result<()> {
        let due = Self::lock(&self.writer)
            .as_ref()
            .is_some_and(|w| w.size >= self.rotate_bytes || w.broken_at.is_some());
        if !due {
            return Ok(());
        }
        let next = self.open_writer(conn)?;
        let mut writer = Self::lock(&self.writer);
        if let Some(old) = writer.as_ref()
            && let Err(e) = seal(conn, old.id, old.broken_at.unwrap_or(old.size))
        {
            drop(writer);
            let _ = conn.execute("DELETE FROM trace_journals WHERE id = ?1", params![next.id]);
            let _ = std::fs::remove_file(self.dir.join(&next.name));
            return Err(e);
        }
        // The old file's lock goes with it.
        *writer = Some(next);
        Ok(())
    }

    /// Seals this process's journal file where it ends (the store is closing): no record
    /// follows, and once all of it is moved it is deleted.
    pub(super) fn seal_own(&self, conn: &Connection) -> anyhow::Result<()> {
        let mut writer = Self::lock(&self.writer);
        if let Some(w) = writer.as_ref() {
            seal(conn, w.id, w.broken_at.unwrap_or(w.size))?;
        }
        *writer = None;
        Ok(())
    }

    /// Moves journal records into the trace, oldest journal first, in one write
    /// transaction on `conn` (the caller holds its lock): at most `budget` bytes when
    /// given, else everything. Journals whose writer is gone are sealed; sealed journals
    /// that are all in the trace are deleted. A journal that cannot be moved is skipped
    /// and named in [`Moved::problems`]; if it is this process's own, appends are refused
    /// until a pass moves it. Without `force`, a pass that finds no journal with bytes to
    /// move opens no transaction.
    ///
    /// # Errors
    /// The database fails (the transaction is rolled back; nothing was moved). Appends are
    /// then refused too, until a pass succeeds.
    pub(super) fn ingest(
        &self,
        conn: &mut Connection,
        budget: Option<u64>,
        force: bool,
    ) -> anyhow::Result<Moved> {
        let appended = self.appended.load(Ordering::Acquire);
        let result = self.ingest_inner(conn, budget, force);
        let own = Self::lock(&self.writer).as_ref().map(|w| w.name.clone());
        let mut failing = Self::lock(&self.failing);
        match &result {
            Ok(moved) => {
                let stuck = moved
                    .problems
                    .iter()
                    .find(|(journal, _)| own.as_deref() == Some(journal.as_str()))
                    .map(|(_, why)| why.clone());
                if stuck.is_none() && !moved.more {
                    self.moved.fetch_max(appended, Ordering::AcqRel);
                }
                *failing = stuck;
            }
            Err(e) => *failing = Some(format!("{e:#}")),
        }
        result
    }

    /// Bytes the journals hold beyond what is in the trace (each file's size, a sealed
    /// one's final size at most, minus its row's ingested bytes), every writer's: what a
    /// pass would move. Reads the rows and the files' sizes; moves nothing.
    pub(super) fn backlog_bytes(&self, conn: &Connection) -> anyhow::Result<u64> {
        let mut bytes = 0u64;
        for row in journal_rows(conn)? {
            let size = std::fs::symlink_metadata(self.dir.join(&row.name))
                .map_or(row.ingested, |meta| meta.len());
            let end = row.sealed.map_or(size, |sealed| sealed.min(size));
            bytes = bytes.saturating_add(end.saturating_sub(row.ingested));
        }
        Ok(bytes)
    }

    fn ingest_inner(
        &self,
        conn: &mut Connection,
        budget: Option<u64>,
        force: bool,
    ) -> anyhow::Result<Moved> {
        let mut moved = Moved::default();
        // A cheap look first, outside a write transaction: most passes find nothing.
        let rows = journal_rows(conn)?;
        if rows.is_empty() {
            return Ok(moved);
        }
        let worth = force
            || rows.iter().any(|row| {
                row.sealed.is_some()
                    || std::fs::symlink_metadata(self.dir.join(&row.name))
                        .map_or(true, |meta| meta.len() > row.ingested)
            });
        if !worth {
            return Ok(moved);
        }
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let mut left = budget.unwrap_or(u64::MAX);
        let mut retired = Vec::new();
        for row in journal_rows(&tx)? {
            if left == 0 {
                moved.more = true;
                break;
            }
            if let Step::Retire = self.move_one(&tx, &row, &mut left, &mut moved)? {
                retired.push(row.name.clone());
            }
        }
        tx.commit()?;
        for name in retired {
            let path = self.dir.join(&name);
            match std::fs::remove_file(&path) {
                Ok(()) => {
                    tracing::debug!(journal = %path.display(), "trace journal moved and deleted")
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(journal = %path.display(), "could not delete a trace journal that is all in the trace: {e}")
                }
            }
        }
        Ok(moved)
    }

    /// Moves what `row`'s journal holds beyond its ingested bytes (within `left`).
    fn move_one(
        &self,
        tx: &Connection,
        row: &JournalRow,
        left: &mut u64,
        moved: &mut Moved,
    ) -> anyhow::Result<Step> {
        let path = self.dir.join(&row.name);
        let file = match open_journal(&path) {
            Ok(f) => f,
            Err(e)
                if e.downcast_ref::<std::io::Error>()
                    .is_some_and(|io| io.kind() == std::io::ErrorKind::NotFound) =>
            {
                if row.sealed == Some(row.ingested) {
                    // Deleted after its last byte was moved; only the row was left.
                    tx.execute("DELETE FROM trace_journals WHERE id = ?1", params![row.id])?;
                    return Ok(Step::Kept);
                }
                moved.problems.push((row.name.clone(), format!(
                    "the trace journal {} is missing, but the store says it holds records not yet in the trace (from byte {}{}): they were deleted before they were moved",
                    path.display(),
                    row.ingested,
                    row.sealed.map(|s| format!(" to byte {s}")).unwrap_or_default()
                )));
                return Ok(Step::Kept);
            }
            Err(e) => {
                moved.problems.push((row.name.clone(), format!("{e:#}")));
                return Ok(Step::Kept);
            }
        };
        // Unlocked, the writer is gone (its lock went with it).
        let writer_gone = row.sealed.is_none() && file.try_lock().is_ok();
        let size = file.metadata().map(|m| m.len())?;
        let end = row.sealed.unwrap_or(size).min(size);
        if row.sealed.is_some_and(|s| s > size) {
            moved.problems.push((row.name.clone(), format!(
                "the trace journal {} is shorter ({size} bytes) than when it was sealed ({} bytes): records were cut off before they were moved",
                path.display(),
                row.sealed.unwrap_or(0)
            )));
        }
        let mut at = row.ingested;
        let mut rows_out: Vec<(u64, String, String, String)> = Vec::new();
        let mut seen: Vec<NewObservation> = Vec::new();
        let mut stopped_by_budget = false;
        let mut bad = None;
        while at < end {
            if *left == 0 {
                stopped_by_budget = true;
                break;
            }
            let mut header = [0u8; HEADER_BYTES];
            if end - at < HEADER_BYTES as u64 {
                break;
            }
            file.read_exact_at(&mut header, at)?;
            if &header[..4] != MAGIC {
                bad = Some(format!("the bytes at offset {at} are not a journal record"));
                break;
            }
            let len = u32::from_be_bytes(header[4..8].try_into().expect("4 bytes")) as usize;
            if len > MAX_RECORD_BYTES {
                bad = Some(format!(
                    "the record at offset {at} claims {len} bytes, more than the {MAX_RECORD_BYTES} a record may hold"
                ));
                break;
            }
            let total = HEADER_BYTES as u64 + len as u64;
            if end - at < total {
                // Still being written, or cut off: not whole yet.
                break;
            }
            let mut body = vec![0u8; len];
            file.read_exact_at(&mut body, at + HEADER_BYTES as u64)?;
            if !self.key.verify_journal(&row.name, at, &body, &header[8..]) {
                bad = Some(format!(
                    "the record at offset {at} fails its MAC (edited, moved, or written without the host key {})",
                    self.key.id()
                ));
                break;
            }
            let decoded = match decode(&body) {
                Ok(b) => b,
                Err(e) => {
                    bad = Some(format!("the record at offset {at} does not decode: {e}"));
                    break;
                }
            };
            for (kind, subject, payload) in decoded.events {
                rows_out.push((decoded.at_ms, kind, subject, payload));
            }
            seen.extend(decoded.observations);
            moved.records += 1;
            at += total;
            *left = left.saturating_sub(total);
        }
        if let Some(why) = &bad {
            moved.problems.push((
                row.name.clone(),
                format!(
                    "the trace journal {}: {why}; nothing from there on was moved into the trace",
                    path.display()
                ),
            ));
        }
        if at > row.ingested {
            observations::write_in(tx, &seen)?;
            let rows: Vec<Row<'_>> = rows_out
                .iter()
                .map(|(at_ms, kind, subject, payload)| Row {
                    kind,
                    subject,
                    payload: std::borrow::Cow::Borrowed(payload.as_str()),
                    at_ms: *at_ms,
                })
                .collect();
            trace::append_rows_in(tx, &self.key, &rows)?;
            tx.execute(
                "UPDATE trace_journals SET ingested = ?1 WHERE id = ?2",
                params![ms_to_sql(at)?, row.id],
            )?;
        }
        if stopped_by_budget {
            moved.more = true;
            return Ok(Step::Kept);
        }
        let mut sealed = row.sealed;
        if writer_gone && bad.is_none() {
            if size > at {
                tracing::warn!(
                    journal = %path.display(),
                    bytes = size - at,
                    "dropped a partial record at the end of a trace journal whose writer stopped inside the write (that call never answered)"
                );
            }
            seal(tx, row.id, at)?;
            sealed = Some(at);
        }
        if bad.is_none() && sealed == Some(at) {
            tx.execute("DELETE FROM trace_journals WHERE id = ?1", params![row.id])?;
            return Ok(Step::Retire);
        }
        Ok(Step::Kept)
    }

    /// Deletes this database's journal files that no row names and no writer holds: a
    /// writer that died before registering its file (it holds no record), or a file whose
    /// last byte was moved and whose row was deleted before the file was.
    pub(super) fn remove_orphans(&self, conn: &Connection) -> anyhow::Result<()> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e).with_context(|| format!("listing {}", self.dir.display())),
        };
        let known: std::collections::HashSet<String> =
            journal_rows(conn)?.into_iter().map(|r| r.name).collect();
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.starts_with(&self.prefix)
                || !name.ends_with(".journal")
                || known.contains(&name)
            {
                continue;
            }
            let path = entry.path();
            if let Ok(file) = open_journal(&path)
                && file.try_lock().is_ok()
            {
                let _ = std::fs::remove_file(&path);
            }
        }
        Ok(())
    }
}

enum Step {
    Retire,
    Kept,
}

/// Records `at` as the final size of journal `id`.
fn seal(conn: &Connection, id: i64, at: u64) -> anyhow::Result<()> {
    conn.execute(
        "UPDATE trace_journals SET sealed = ?1 WHERE id = ?2",
        params![ms_to_sql(at)?, id],
    )?;
    Ok(())
}

fn journal_rows(conn: &Connection) -> anyhow::Result<Vec<JournalRow>> {
    let mut stmt =
        conn.prepare_cached("SELECT id, name, ingested, sealed FROM trace_journals ORDER BY id")?;
    let rows = stmt
        .query_map([], |r| {
            Ok(JournalRow {
                id: r.get(0)?,
                name: r.get(1)?,
                ingested: r.get::<_, i64>(2)?.max(0) as u64,
                sealed: r.get::<_, Option<i64>>(3)?.map(|s| s.max(0) as u64),
            })
        })?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    Ok(rows)
}

/// Opens a journal file for reading, refusing a link, a file that is not regular, another
/// owner's file, or one others may write.
fn open_journal(path: &Path) -> anyhow::Result<File> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) {
                anyhow::anyhow!(
                    "the trace journal {} is a symbolic link; Airlock does not follow links for its private files",
                    path.display()
                )
            } else {
                anyhow::Error::new(e).context(format!("opening the trace journal {}", path.display()))
            }
        })?;
    let meta = file.metadata()?;
    let me = airlock_core::private_fs::effective_uid();
    if !meta.is_file() {
        bail!("the trace journal {} is not a regular file", path.display());
    }
    if meta.uid() != me {
        bail!(
            "the trace journal {} is owned by uid {}, not by this user (uid {me})",
            path.display(),
            meta.uid()
        );
    }
    if meta.mode() & 0o022 != 0 {
        bail!(
            "the trace journal {} is writable by group or others (mode {:04o})",
            path.display(),
            meta.mode() & 0o7777
        );
    }
    Ok(file)
}

/// Refuses what the store's tables would refuse when the record is moved: an accepted
/// record must move, or it would stop every record after it.
fn check(at_ms: u64, observations: &[NewObservation]) -> anyhow::Result<()> {
    ms_to_sql(at_ms)?;
    for o in observations {
        if !matches!(o.method.as_str(), "tools/call" | "resources/read") {
            bail!(
                "an observation's method is {:?}, not tools/call or resources/read; nothing was recorded",
                o.method
            );
        }
        i64::try_from(o.bytes).with_context(|| {
            format!(
                "an observation's size {} is out of range; nothing was recorded",
                o.bytes
            )
        })?;
        ms_to_sql(o.retrieved_ms).context("an observation's time; nothing was recorded")?;
    }
    Ok(())
}

/// The body of one record (see the module doc).
fn encode(
    at_ms: u64,
    events: &[NewEvent],
    observations: &[NewObservation],
) -> anyhow::Result<Vec<u8>> {
    check(at_ms, observations)?;
    let mut body = Vec::with_capacity(2048);
    let put_u64 = |b: &mut Vec<u8>, n: u64| b.extend_from_slice(&n.to_be_bytes());
    let put_count = |b: &mut Vec<u8>, n: usize| -> anyhow::Result<()> {
        b.extend_from_slice(
            &u32::try_from(n)
                .context("too many items for a journal record")?
                .to_be_bytes(),
        );
        Ok(())
    };
    let put = |b: &mut Vec<u8>, text: &str| -> anyhow::Result<()> {
        b.extend_from_slice(
            &u32::try_from(text.len())
                .context("a text too long for a journal record")?
                .to_be_bytes(),
        );
        b.extend_from_slice(text.as_bytes());
        Ok(())
    };
    put_u64(&mut body, at_ms);
    put_count(&mut body, events.len())?;
    for e in events {
        put(&mut body, e.kind)?;
        put(&mut body, &e.subject)?;
        put(&mut body, &trace::canonical(&e.payload)?)?;
    }
    put_count(&mut body, observations.len())?;
    for o in observations {
        for text in [
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
        ] {
            put(&mut body, text)?;
        }
        put_u64(&mut body, o.bytes);
        put(&mut body, &o.request_id)?;
        put(&mut body, &o.call_id)?;
        put_u64(&mut body, o.retrieved_ms);
    }
    if body.len() > MAX_RECORD_BYTES {
        bail!(
            "a call's trace record is {} bytes, more than the {MAX_RECORD_BYTES} a journal record may hold; nothing was recorded",
            body.len()
        );
    }
    Ok(body)
}

/// Reads a record body (see the module doc), refusing a short, long or malformed one.
fn decode(body: &[u8]) -> Result<Body, String> {
    struct Cursor<'a>(&'a [u8]);
    impl<'a> Cursor<'a> {
        fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
            if self.0.len() < n {
                return Err(format!("it ends {} bytes early", n - self.0.len()));
            }
            let (head, rest) = self.0.split_at(n);
            self.0 = rest;
            Ok(head)
        }
        fn u32(&mut self) -> Result<usize, String> {
            Ok(u32::from_be_bytes(self.take(4)?.try_into().expect("4 bytes")) as usize)
        }
        fn u64(&mut self) -> Result<u64, String> {
            Ok(u64::from_be_bytes(
                self.take(8)?.try_into().expect("8 bytes"),
            ))
        }
        fn text(&mut self) -> Result<String, String> {
            let n = self.u32()?;
            let bytes = self.take(n)?;
            std::str::from_utf8(bytes)
                .map(str::to_owned)
                .map_err(|e| format!("a text is not UTF-8 ({e})"))
        }
        /// A count of items each at least `min` bytes long (bounded by what is left).
        fn count(&mut self, min: usize) -> Result<usize, String> {
            let n = self.u32()?;
            if n.saturating_mul(min) > self.0.len() {
                return Err(format!("it claims {n} items, more than its bytes can hold"));
            }
            Ok(n)
        }
    }
    let mut c = Cursor(body);
    let at_ms = c.u64()?;
    let n = c.count(12)?;
    let mut events = Vec::with_capacity(n);
    for _ in 0..n {
        events.push((c.text()?, c.text()?, c.text()?));
    }
    let n = c.count(13 * 4 + 16)?;
    let mut observations = Vec::with_capacity(n);
    for _ in 0..n {
        observations.push(NewObservation {
            id: c.text()?,
            connection_id: c.text()?,
            connection: c.text()?,
            snapshot_digest: c.text()?,
            method: c.text()?,
            target: c.text()?,
            arguments_sha256: c.text()?,
            item: c.text()?,
            kind: c.text()?,
            media_type: c.text()?,
            sha256: c.text()?,
            bytes: c.u64()?,
            request_id: c.text()?,
            call_id: c.text()?,
            retrieved_ms: c.u64()?,
        });
    }
    if !c.0.is_empty() {
        return Err(format!("{} bytes follow its last field", c.0.len()));
    }
    Ok(Body {
        at_ms,
        events,
        observations,
    })
}

/// One whole record: magic, length, MAC of (journal, offset, body), body.
fn frame(key: &TraceKey, journal: &str, offset: u64, body: &[u8]) -> Vec<u8> {
    let mut record = Vec::with_capacity(HEADER_BYTES + body.len());
    record.extend_from_slice(MAGIC);
    record.extend_from_slice(&(body.len() as u32).to_be_bytes());
    record.extend_from_slice(&key.journal_mac(journal, offset, body));
    record.extend_from_slice(body);
    record
}

/// The writing process's `airlock-trace-journal` thread: moves its records into the
/// trace every [`interval`] while there are any, seals its file past
/// [`ROTATE_BYTES`]. Dropping it stops the thread and waits for it.
pub(super) struct Mover {
    stop: std::sync::mpsc::SyncSender<()>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Mover {
    fn drop(&mut self) {
        let _ = self.stop.try_send(());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Mover {
    /// Starts the thread for `journal` on the store's connection `conn`.
    pub(super) fn start(
        journal: Arc<Journal>,
        conn: Arc<Mutex<Connection>>,
    ) -> std::io::Result<Self> {
        let (stop, stopped) = std::sync::mpsc::sync_channel::<()>(1);
        let every = interval();
        let thread = std::thread::Builder::new()
            .name("airlock-trace-journal".into())
            .spawn(move || {
                let mut failed = 0u32;
                let mut reported = std::collections::HashSet::new();
                loop {
                    match stopped.recv_timeout(every) {
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                        _ => return,
                    }
                    if !journal.has_unmoved() && journal.failing().is_none() {
                        continue;
                    }
                    loop {
                        let mut conn = conn.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                        // Records are known to wait: no cheap look first.
                        let moved = journal.ingest(&mut conn, Some(INGEST_BATCH_BYTES), true);
                        let rotated = journal.rotate(&conn);
                        drop(conn);
                        match moved.and_then(|m| rotated.map(|()| m)) {
                            Ok(moved) => {
                                failed = 0;
                                for (_, why) in &moved.problems {
                                    if reported.insert(why.clone()) {
                                        tracing::error!("trace journal: {why}");
                                    }
                                }
                                if moved.more {
                                    continue;
                                }
                            }
                            Err(e) => {
                                failed += 1;
                                if failed.is_power_of_two() {
                                    tracing::error!(failed, "could not move trace journal records into the store (calls are refused until it can): {e:#}");
                                }
                            }
                        }
                        break;
                    }
                }
            })?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::{SqliteStore, Trace as _};
    use super::*;

    fn key() -> TraceKey {
        TraceKey::from_bytes(&[7u8; 32], super::super::key::KeySource::Environment).unwrap()
    }

    /// A migrated database in a temp folder, its path, and its key.
    fn database() -> (tempfile::TempDir, PathBuf, TraceKey) {
        let dir = tempfile::tempdir().unwrap();
        drop(SqliteStore::open(dir.path()).unwrap());
        let key = TraceKey::read_file(dir.path()).unwrap().unwrap();
        let path = dir.path().join(super::super::DATABASE_FILE);
        (dir, path, key)
    }

    /// One "process": its own connection to the database and its own journal.
    struct Process {
        conn: Connection,
        journal: Journal,
    }

    impl Process {
        fn new(path: &Path, key: &TraceKey) -> Self {
            let conn = Connection::open(path).unwrap();
            conn.busy_timeout(Duration::from_secs(5)).unwrap();
            Self {
                conn,
                journal: Journal::new(path, key.clone()),
            }
        }

        fn call(&self, subject: &str) -> anyhow::Result<()> {
            let events = vec![
                NewEvent::new(
                    "call-candidate",
                    subject,
                    serde_json::json!({"call": subject}),
                ),
                NewEvent::new(
                    "call-outcome",
                    subject,
                    serde_json::json!({"call": subject, "outcome": "completed"}),
                ),
            ];
            let seen = vec![super::super::observations::tests::item(
                &format!("notes://{subject}"),
                "aaaa",
                1,
            )];
            self.journal.append(|| &self.conn, &events, &seen)
        }

        fn ingest(&mut self, budget: Option<u64>) -> Moved {
            self.journal.ingest(&mut self.conn, budget, false).unwrap()
        }

        fn own_file(&self) -> PathBuf {
            let name = self
                .journal
                .writer
                .lock()
                .unwrap()
                .as_ref()
                .unwrap()
                .name
                .clone();
            self.journal.dir.join(name)
        }
    }

    fn subjects(conn: &Connection, kind: &str) -> Vec<String> {
        conn.prepare("SELECT subject FROM trace_events WHERE kind = ?1 ORDER BY seq")
            .unwrap()
            .query_map([kind], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }

    fn count(conn: &Connection, sql: &str) -> i64 {
        conn.query_row(sql, [], |r| r.get(0)).unwrap()
    }

    fn verify(dir: &Path) -> Option<(i64, String)> {
        SqliteStore::open(dir)
            .unwrap()
            .verify_trace()
            .unwrap()
            .first_bad
    }

    #[test]
    fn a_record_round_trips_and_its_frame_is_bound_to_name_and_offset() {
        let events = vec![NewEvent::new(
            "call-outcome",
            "call_1",
            serde_json::json!({"z": "quote\" \u{2028} 🦀", "a": 1}),
        )];
        let seen = vec![super::super::observations::tests::item(
            "notes://é \u{0}",
            "aaaa",
            7,
        )];
        let body = encode(1_700_000_000_000, &events, &seen).unwrap();
        let decoded = decode(&body).unwrap();
        assert_eq!(
            decoded,
            Body {
                at_ms: 1_700_000_000_000,
                events: vec![(
                    "call-outcome".to_string(),
                    "call_1".to_string(),
                    trace::canonical(&events[0].payload).unwrap()
                )],
                observations: seen,
            }
        );
        let k = key();
        let record = frame(&k, "a.db.00.journal", 80, &body);
        assert_eq!(&record[..4], MAGIC);
        assert_eq!(record.len(), HEADER_BYTES + body.len());
        assert!(k.verify_journal("a.db.00.journal", 80, &body, &record[8..40]));
        assert!(!k.verify_journal("a.db.00.journal", 0, &body, &record[8..40]));
    }

    #[test]
    fn a_malformed_body_is_refused_whole() {
        let events = vec![NewEvent::new("k", "s", serde_json::json!({"a": 1}))];
        let seen = vec![super::super::observations::tests::item(
            "notes://x",
            "aaaa",
            7,
        )];
        let body = encode(1, &events, &seen).unwrap();
        // Every cut is refused, and so is a byte more.
        for cut in 0..body.len() {
            assert!(decode(&body[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = body.clone();
        longer.push(0);
        assert!(
            decode(&longer)
                .unwrap_err()
                .contains("follow its last field")
        );
        // A count no body could hold is refused before anything is allocated for it.
        let mut huge = 1u64.to_be_bytes().to_vec();
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(
            decode(&huge)
                .unwrap_err()
                .contains("more than its bytes can hold")
        );
        // A text that is not UTF-8.
        let mut bad = 1u64.to_be_bytes().to_vec();
        bad.extend_from_slice(&1u32.to_be_bytes());
        for text in [&b"k"[..], b"\xff", b"{}"] {
            bad.extend_from_slice(&(text.len() as u32).to_be_bytes());
            bad.extend_from_slice(text);
        }
        bad.extend_from_slice(&0u32.to_be_bytes());
        assert!(decode(&bad).unwrap_err().contains("not UTF-8"));
    }

    #[test]
    fn records_move_once_in_order_and_the_file_goes_with_its_last_byte() {
        let (dir, path, key) = database();
        let mut p = Process::new(&path, &key);
        for s in ["call_a", "call_b", "call_c"] {
            p.call(s).unwrap();
        }
        let file = p.own_file();
        let meta = std::fs::symlink_metadata(&file).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        assert_eq!(
            std::fs::symlink_metadata(&p.journal.dir).unwrap().mode() & 0o777,
            0o700
        );
        // Durable, not yet in the trace: the whole file is the backlog, for any reader.
        assert!(subjects(&p.conn, "call-outcome").is_empty());
        assert!(p.journal.has_unmoved());
        let written = meta.len();
        assert_eq!(p.journal.backlog_bytes(&p.conn).unwrap(), written);
        let other = Process::new(&path, &key);
        assert_eq!(other.journal.backlog_bytes(&other.conn).unwrap(), written);
        // A budget of one byte still moves one whole record.
        let first = p.ingest(Some(1));
        assert_eq!((first.records, first.more), (1, true));
        assert_eq!(subjects(&p.conn, "call-outcome"), ["call_a"]);
        let left = p.journal.backlog_bytes(&p.conn).unwrap();
        assert!(left > 0 && left < written, "{left} of {written}");
        let rest = p.ingest(None);
        assert_eq!((rest.records, rest.more), (2, false));
        assert!(!p.journal.has_unmoved());
        assert_eq!(other.journal.backlog_bytes(&other.conn).unwrap(), 0);
        drop(other);
        assert_eq!(
            subjects(&p.conn, "call-outcome"),
            ["call_a", "call_b", "call_c"]
        );
        assert_eq!(count(&p.conn, "SELECT count(*) FROM observations"), 3);
        // Nothing twice.
        assert_eq!(p.ingest(None).records, 0);
        assert_eq!(
            count(
                &p.conn,
                "SELECT count(*) FROM trace_events WHERE kind = 'call-candidate'"
            ),
            3
        );
        // Closing: sealed where it ends, moved, deleted with its row.
        p.journal.seal_own(&p.conn).unwrap();
        p.ingest(None);
        assert!(!file.exists());
        assert_eq!(count(&p.conn, "SELECT count(*) FROM trace_journals"), 0);
        drop(p);
        assert_eq!(verify(dir.path()), None);
    }

    #[test]
    fn another_process_moves_a_live_writers_whole_records_only() {
        let (dir, path, key) = database();
        let writer = Process::new(&path, &key);
        let mut reader = Process::new(&path, &key);
        writer.call("call_a").unwrap();
        writer.call("call_b").unwrap();
        let file = writer.own_file();
        let whole = std::fs::metadata(&file).unwrap().len();
        // A record being written: its header and half its body are in the file.
        let body = encode(
            1,
            &[NewEvent::new("x", "call_partial", serde_json::json!({}))],
            &[],
        )
        .unwrap();
        let record = frame(&key, "whatever", whole, &body);
        std::fs::OpenOptions::new()
            .append(true)
            .open(&file)
            .unwrap()
            .write_all(&record[..record.len() / 2])
            .unwrap();
        let moved = reader.ingest(None);
        assert_eq!(moved.records, 2);
        assert!(moved.problems.is_empty(), "{:?}", moved.problems);
        assert_eq!(subjects(&reader.conn, "call-outcome"), ["call_a", "call_b"]);
        // The writer lives (it holds the file's lock): not sealed, not deleted.
        assert!(file.exists());
        let sealed: Option<i64> = reader
            .conn
            .query_row("SELECT sealed FROM trace_journals", [], |r| r.get(0))
            .unwrap();
        assert_eq!(sealed, None);
        // The write completes (as the writer's next record would begin where it ends):
        // here the half record is taken back and the writer goes on.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&file)
            .unwrap()
            .set_len(whole)
            .unwrap();
        writer.call("call_c").unwrap();
        assert_eq!(reader.ingest(None).records, 1);
        assert_eq!(
            subjects(&reader.conn, "call-outcome"),
            ["call_a", "call_b", "call_c"]
        );
        drop((writer, reader));
        assert_eq!(verify(dir.path()), None);
    }

    #[test]
    fn a_stopped_writers_journal_is_sealed_at_its_last_whole_record() {
        let (dir, path, key) = database();
        let writer = Process::new(&path, &key);
        writer.call("call_a").unwrap();
        writer.call("call_b").unwrap();
        let file = writer.own_file();
        // The writer died inside its third write(2).
        let body = encode(
            1,
            &[NewEvent::new("x", "call_torn", serde_json::json!({}))],
            &[],
        )
        .unwrap();
        let whole = std::fs::metadata(&file).unwrap().len();
        let record = frame(&key, "whatever", whole, &body);
        std::fs::OpenOptions::new()
            .append(true)
            .open(&file)
            .unwrap()
            .write_all(&record[..HEADER_BYTES + 3])
            .unwrap();
        // Its lock goes with its process (here: with its journal's file).
        drop(writer);
        // The next open moves what it wrote: nothing torn, nothing lost, nothing left.
        let store = SqliteStore::open(dir.path()).unwrap();
        let outcomes: Vec<String> = store
            .trace(0, usize::MAX)
            .unwrap()
            .into_iter()
            .filter(|e| e.kind == "call-outcome")
            .map(|e| e.subject)
            .collect();
        assert_eq!(outcomes, ["call_a", "call_b"]);
        assert!(!file.exists());
        assert_eq!(
            count(&store.lock(), "SELECT count(*) FROM trace_journals"),
            0
        );
        assert!(store.verify_trace().unwrap().first_bad.is_none());
    }

    #[test]
    fn an_edited_record_stops_its_journal_is_reported_and_refuses_the_writer() {
        let (dir, path, key) = database();
        let mut writer = Process::new(&path, &key);
        for s in ["call_a", "call_b", "call_c"] {
            writer.call(s).unwrap();
        }
        let file = writer.own_file();
        let bytes = std::fs::read(&file).unwrap();
        let second = HEADER_BYTES + u32::from_be_bytes(bytes[4..8].try_into().unwrap()) as usize;
        // One byte of the second record's body: `call_b` becomes `call_B`.
        let at = second
            + HEADER_BYTES
            + bytes[second + HEADER_BYTES..]
                .windows(6)
                .position(|w| w == b"call_b")
                .unwrap()
            + 5;
        let mut edited = bytes.clone();
        edited[at] = b'B';
        std::fs::write(&file, &edited).unwrap();

        let mut reader = Process::new(&path, &key);
        let moved = reader.ingest(None);
        assert_eq!(moved.records, 1, "the record before the edit moves");
        assert_eq!(moved.problems.len(), 1);
        let why = &moved.problems[0].1;
        assert!(
            why.contains(&format!("offset {second} fails its MAC")),
            "{why}"
        );
        assert_eq!(subjects(&reader.conn, "call-outcome"), ["call_a"]);
        // The writer learns it at its next pass and records nothing more.
        writer.ingest(None);
        let refused = writer.call("call_d").unwrap_err().to_string();
        assert!(
            refused.contains("fails its MAC") && refused.contains("nothing was recorded"),
            "{refused}"
        );
        // `trace verify` names it.
        let (_, found) = verify(dir.path()).expect("a finding");
        assert!(found.contains("fails its MAC"), "{found}");
        // Put back, everything moves and the writer records again.
        std::fs::write(&file, &bytes).unwrap();
        assert_eq!(writer.ingest(None).records, 2);
        writer.call("call_d").unwrap();
        assert_eq!(writer.ingest(None).records, 1);
        assert_eq!(
            subjects(&writer.conn, "call-outcome"),
            ["call_a", "call_b", "call_c", "call_d"]
        );
        drop((writer, reader));
        assert_eq!(verify(dir.path()), None);
    }

    #[test]
    fn hostile_journal_bytes_are_reported_never_moved() {
        let (_dir, path, key) = database();
        let writer = Process::new(&path, &key);
        writer.call("call_a").unwrap();
        let file = writer.own_file();
        let good = std::fs::read(&file).unwrap();
        let body_len = good.len() - HEADER_BYTES;
        let other_key =
            TraceKey::from_bytes(&[9u8; 32], super::super::key::KeySource::Environment).unwrap();
        let cases: Vec<(&str, Vec<u8>, &str)> = vec![
            (
                "not a record",
                b"GARBAGE-GARBAGE-GARBAGE-GARBAGE-GARBAGE-GARBAGE".to_vec(),
                "not a journal record",
            ),
            (
                "a length past the limit",
                {
                    let mut b = good.clone();
                    b[4..8].copy_from_slice(&u32::MAX.to_be_bytes());
                    b
                },
                "claims",
            ),
            (
                "another key's MAC",
                frame(
                    &other_key,
                    &file.file_name().unwrap().to_string_lossy(),
                    0,
                    &good[HEADER_BYTES..],
                ),
                "fails its MAC",
            ),
            (
                "a record moved to another offset",
                {
                    let mut b = frame(&key, &file.file_name().unwrap().to_string_lossy(), 0, b"{}");
                    b.extend_from_slice(&good);
                    b
                },
                "does not decode",
            ),
            (
                "a MACed body that is not a record",
                frame(
                    &key,
                    &file.file_name().unwrap().to_string_lossy(),
                    0,
                    br#"{"at_ms":1,"events":[],"observations":[],"x":1}"#,
                ),
                "does not decode",
            ),
        ];
        let _ = body_len;
        for (what, bytes, expected) in cases {
            std::fs::write(&file, &bytes).unwrap();
            let mut reader = Process::new(&path, &key);
            let moved = reader.ingest(None);
            assert_eq!(moved.records, 0, "{what}");
            assert_eq!(moved.problems.len(), 1, "{what}: {:?}", moved.problems);
            assert!(
                moved.problems[0].1.contains(expected),
                "{what}: {:?}",
                moved.problems
            );
            assert!(subjects(&reader.conn, "call-outcome").is_empty(), "{what}");
        }
        // The moved record's case: the first record ({}) decodes badly and stops the
        // journal, so the good record behind it (at another offset than its MAC says)
        // never moves either.
    }

    #[test]
    fn a_journal_deleted_before_it_was_moved_is_reported() {
        let (dir, path, key) = database();
        let writer = Process::new(&path, &key);
        writer.call("call_a").unwrap();
        let file = writer.own_file();
        drop(writer);
        std::fs::remove_file(&file).unwrap();
        let mut reader = Process::new(&path, &key);
        let moved = reader.ingest(None);
        assert_eq!(moved.problems.len(), 1);
        assert!(
            moved.problems[0].1.contains("is missing"),
            "{:?}",
            moved.problems
        );
        let (_, found) = verify(dir.path()).expect("a finding");
        assert!(found.contains("deleted before they were moved"), "{found}");
    }

    #[test]
    fn a_journal_replaced_by_a_link_is_refused() {
        let (_dir, path, key) = database();
        let writer = Process::new(&path, &key);
        writer.call("call_a").unwrap();
        let file = writer.own_file();
        let elsewhere = file.with_extension("elsewhere");
        std::fs::rename(&file, &elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &file).unwrap();
        let mut reader = Process::new(&path, &key);
        let moved = reader.ingest(None);
        assert_eq!(moved.records, 0);
        assert!(
            moved.problems[0].1.contains("symbolic link"),
            "{:?}",
            moved.problems
        );
    }

    #[test]
    fn a_rotated_journal_is_moved_before_the_next_and_deleted() {
        let (dir, path, key) = database();
        let mut p = Process::new(&path, &key);
        p.journal.rotate_bytes = 1;
        p.call("call_a").unwrap();
        let first = p.own_file();
        p.journal.rotate(&p.conn).unwrap();
        p.call("call_b").unwrap();
        let second = p.own_file();
        assert_ne!(first, second);
        // The first file's lock went with it; sealed, it is not taken for a dead writer's.
        let moved = p.ingest(None);
        assert_eq!(moved.records, 2);
        assert!(moved.problems.is_empty(), "{:?}", moved.problems);
        assert!(!first.exists() && second.exists());
        assert_eq!(subjects(&p.conn, "call-outcome"), ["call_a", "call_b"]);
        drop(p);
        assert_eq!(verify(dir.path()), None);
    }

    /// What moving a read call's record costs per record, by batch size, with and without
    /// its observations (a read call: 4 events of the sizes `airlock serve` writes, 2
    /// observations seen again). A measurement, not a check:
    /// `cargo test --release -p airlock --lib -- --ignored --nocapture moving_cost`.
    #[test]
    #[ignore = "a measurement; run it by name"]
    fn moving_cost() {
        let call_events = |i: usize| {
            let call = format!("call_{i:024}");
            vec![
                NewEvent::new(
                    "call-candidate",
                    call.clone(),
                    serde_json::json!({"arguments_bytes": 31, "arguments_sha256": "3".repeat(64), "call": call, "capability": "search_sources", "offered_digest": null, "profile": "default", "protocol": "2025-11-25", "requester": "root", "session": "ses_44125fcd00ac1a3d2885caab0eadbc2c", "stage": "requested"}),
                ),
                NewEvent::new(
                    "call-decided",
                    call.clone(),
                    serde_json::json!({"args_digest": "a".repeat(64), "call": call, "capability": "search_sources", "decision": {"verdict": "allow"}, "determining": ["builtin-reads"], "effect_class": "read", "errors": 0, "mapping": "source-library", "policy_digest": "8".repeat(64), "revision": 2}),
                ),
                NewEvent::new(
                    "upstream-request",
                    call.clone(),
                    serde_json::json!({"at": "2026-12-04T12:23:26.782Z", "bytes": 658, "call": call, "connection": "notes", "connection_id": "conn-9d60e1a14613", "method": "tools/call", "observations": ["obs_bdc54753526320bdaef07c0a72a07071", "obs_ee4c7ab5ef4f3b25be7354f3096a3fc5"], "request_id": "1099511627776", "result_sha256": "5".repeat(64), "snapshot": "d".repeat(64), "target": "search_notes"}),
                ),
                NewEvent::new(
                    "call-outcome",
                    call.clone(),
                    serde_json::json!({"call": call, "content_sha256": "b".repeat(64), "elapsed_us": 903, "intent": "int_d37d5f3bebc7ba554285e9d1f7b5f907", "outcome": "completed", "recheck_policy_digest": "8".repeat(64), "session": "ses_44125fcd00ac1a3d2885caab0eadbc2c", "stage": "executed", "stages_us": {"authorize": 5, "execute": 560, "execute.guest": 121, "execute.upstream": 268, "intent": 1, "normalize": 9, "outcome": 17, "recheck": 2}, "upstream_requests": 1}),
                ),
            ]
        };
        for (with_observations, batch) in [(true, 10usize), (true, 50), (true, 200), (false, 50)] {
            let (_dir, path, key) = database();
            let mut p = Process::new(&path, &key);
            let calls = 2000;
            let mut moving = std::time::Duration::ZERO;
            for i in 0..calls {
                let seen: Vec<NewObservation> = if with_observations {
                    ["contents/0", "structuredContent"]
                        .iter()
                        .map(|item| {
                            let mut o = super::super::observations::tests::item(
                                "notes://x",
                                "aaaa",
                                1 + i as u64,
                            );
                            o.item = (*item).to_string();
                            o.id = format!("obs_{item}");
                            o
                        })
                        .collect()
                } else {
                    Vec::new()
                };
                p.journal
                    .append(|| &p.conn, &call_events(i), &seen)
                    .unwrap();
                if (i + 1) % batch == 0 {
                    let start = std::time::Instant::now();
                    p.ingest(None);
                    moving += start.elapsed();
                }
            }
            println!(
                "observations {with_observations}, {batch} records a transaction: {:.1} µs a record",
                moving.as_secs_f64() * 1e6 / calls as f64
            );
        }
    }

    #[test]
    fn concurrent_movers_move_every_record_exactly_once() {
        let (dir, path, key) = database();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let movers: Vec<_> = (0..3)
            .map(|_| {
                let (path, key, stop) = (path.clone(), key.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut p = Process::new(&path, &key);
                    while !stop.load(Ordering::Acquire) {
                        p.journal.ingest(&mut p.conn, Some(4096), false).unwrap();
                    }
                })
            })
            .collect();
        let (wpath, wkey) = (path.clone(), key.clone());
        let writing = std::thread::spawn(move || {
            let w = Process::new(&wpath, &wkey);
            for i in 0..300 {
                w.call(&format!("call_{i:03}")).unwrap();
            }
            w
        });
        let writer = writing.join().unwrap();
        stop.store(true, Ordering::Release);
        for m in movers {
            m.join().unwrap();
        }
        let mut last = Process::new(&path, &key);
        last.ingest(None);
        let all = subjects(&last.conn, "call-outcome");
        let expected: Vec<String> = (0..300).map(|i| format!("call_{i:03}")).collect();
        assert_eq!(all, expected, "each once, in the order written");
        drop((writer, last));
        assert_eq!(verify(dir.path()), None);
    }
}
