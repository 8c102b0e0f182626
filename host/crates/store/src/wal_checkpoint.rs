//! WAL checkpoints off the request path.
//!
//! Rule: a call never waits for a checkpoint. SQLite's automatic checkpoint runs inside the
//! `COMMIT` that pushes the write-ahead log past its threshold, so one call in a few hundred
//! paid for copying ~1000 pages back into the database and two `fsync`s (BENCHMARKS.md §10:
//! SQLite's p99 of ~3 ms on receipts and intents). Here the store's connection reports its
//! WAL size after each commit (`sqlite3_wal_hook`, which also switches the automatic
//! checkpoint off); past [`THRESHOLD_PAGES`] it wakes the `airlock-wal-checkpoint` thread, once
//! until that thread has run, and the thread runs a `PASSIVE` checkpoint on a connection of
//! its own, which copies what no reader still needs while writers go on committing.
//!
//! What does not change: durability (`synchronous=NORMAL` in WAL mode: a commit is durable
//! against a crash of the process, and the checkpoint `fsync`s as before), and the WAL's
//! bound — if the thread cannot keep up the log grows until the next checkpoint, as it would
//! behind a long reader. A `PASSIVE` checkpoint never waits for a lock, so under load one
//! sometimes fails busy; it is retried at the next threshold and logged at debug level, and
//! only [`BUSY_IN_A_ROW`] busy failures in a row (or any other error) are a warning. Where
//! the thread or its connection cannot start, SQLite's automatic checkpoint stays on.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use rusqlite::{Connection, OpenFlags};

/// WAL size (pages) past which a checkpoint is asked for: SQLite's own automatic
/// threshold (`SQLITE_DEFAULT_WAL_AUTOCHECKPOINT`).
pub const THRESHOLD_PAGES: i32 = 1000;

/// The `airlock-wal-checkpoint` thread of one store. Dropping it stops the thread and waits for
/// it, closing its connection: drop it before the store's own connection, so that the
/// store's connection is the last one and, closing, checkpoints and removes the WAL as
/// SQLite always did, before the drop returns.
pub struct WalCheckpointer {
    wake: std::sync::mpsc::SyncSender<()>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// How many checkpoints the thread has run.
    pub done: Arc<AtomicU64>,
}

impl Drop for WalCheckpointer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Full: a wake-up is queued already, and the thread sees `stop` after it.
        let _ = self.wake.try_send(());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Moves `conn`'s checkpoints to an `airlock-wal-checkpoint` thread with its own connection to
/// `path` (the same file, opened without creating it and without following links). `None`
/// when it could not take them over: the automatic checkpoint is then left on (and a
/// warning logged).
pub fn move_off_request_path(
    conn: &mut Connection,
    path: &Path,
    busy: std::time::Duration,
) -> Option<WalCheckpointer> {
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_NO_MUTEX
        | OpenFlags::SQLITE_OPEN_NOFOLLOW;
    // A connection checkpoints only once it has seen the database in WAL mode.
    let own = match Connection::open_with_flags(path, flags).and_then(|c| {
        c.busy_timeout(busy)?;
        let mode: String = c.query_row("PRAGMA journal_mode", [], |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(rusqlite::Error::InvalidParameterName(format!(
                "the database is in journal mode {mode}, not WAL"
            )));
        }
        Ok(c)
    }) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(path = %path.display(), "WAL checkpoints stay on the request path: no second connection ({e})");
            return None;
        }
    };
    let (wake, asked) = std::sync::mpsc::sync_channel::<()>(1);
    let pending = Arc::new(AtomicBool::new(false));
    let running = pending.clone();
    let shown = path.display().to_string();
    let done = Arc::new(AtomicU64::new(0));
    let counted = done.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    let started = std::thread::Builder::new()
        .name("airlock-wal-checkpoint".into())
        .spawn(move || {
            let mut failed = 0u32;
            while asked.recv().is_ok() && !stopped.load(Ordering::Acquire) {
                running.store(false, Ordering::Release);
                match own.wal_checkpoint_v2(None::<&str>, rusqlite::wal::CheckpointMode::PASSIVE) {
                    Ok((log, copied)) => {
                        failed = 0;
                        counted.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(db = %shown, log, copied, "WAL checkpoint");
                    }
                    Err(e) => {
                        failed += 1;
                        if worth_a_warning(&e, failed) {
                            tracing::warn!(db = %shown, failed, "WAL checkpoint failed (retried at the next threshold): {e}");
                        } else {
                            tracing::debug!(db = %shown, failed, "WAL checkpoint busy (retried at the next threshold): {e}");
                        }
                    }
                }
            }
        });
    let thread = match started {
        Ok(t) => t,
        Err(e) => {
            tracing::warn!("WAL checkpoints stay on the request path: no thread ({e})");
            return None;
        }
    };
    let checkpointer = WalCheckpointer {
        wake: wake.clone(),
        stop,
        thread: Some(thread),
        done,
    };
    let hooked = conn.wal_hook(Some(move |_: &mut rusqlite::hooks::Wal, pages: i32| {
        if pages >= THRESHOLD_PAGES && !pending.swap(true, Ordering::AcqRel) {
            // Full: a wake-up is already queued.
            let _ = wake.try_send(());
        }
        Ok(())
    }));
    match hooked {
        Ok(()) => Some(checkpointer),
        Err(e) => {
            tracing::warn!("WAL checkpoints stay on the request path: no WAL hook ({e})");
            let _ = conn.pragma_update(None, "wal_autocheckpoint", THRESHOLD_PAGES);
            None
        }
    }
}

/// Busy checkpoints in a row before one is worth a warning: [`THRESHOLD_PAGES`] more pages
/// each, so the WAL has grown past ~32 MiB (4 KiB pages) by then.
pub const BUSY_IN_A_ROW: u32 = 8;

/// Whether the `failed`-th checkpoint failure in a row, `e`, is worth a warning. A
/// `PASSIVE` checkpoint never waits (SQLite does not call the busy handler for it), so it
/// fails `SQLITE_BUSY` whenever a writer holds a lock it needs at that instant; the next
/// threshold retries it, and that is only worth a warning when it keeps happening (the WAL
/// then grows). Any other error is worth one at once.
fn worth_a_warning(e: &rusqlite::Error, failed: u32) -> bool {
    let busy = matches!(
        e.sqlite_error_code(),
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
    );
    !busy || failed >= BUSY_IN_A_ROW
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Commits past the threshold wake the thread, which checkpoints: the WAL's frames end
    /// up in the database file, copied by the thread (its count says so), not by a commit.
    #[test]
    fn the_thread_checkpoints_what_the_commits_wrote() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let mut conn = Connection::open(&path).unwrap();
        let mode: String = conn
            .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
            .unwrap();
        assert_eq!(mode, "wal");
        conn.execute_batch("CREATE TABLE t (x BLOB)").unwrap();
        let checkpointer =
            move_off_request_path(&mut conn, &path, std::time::Duration::from_secs(5))
                .expect("the checkpoints move to the thread");
        let done = checkpointer.done.clone();
        let db_bytes = || std::fs::metadata(&path).unwrap().len();
        let before = db_bytes();
        // Each row spills onto overflow pages: well past the threshold.
        for _ in 0..1200 {
            conn.execute("INSERT INTO t VALUES (zeroblob(4000))", [])
                .unwrap();
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while db_bytes() < before + 1000 * 4096 || done.load(Ordering::Relaxed) == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "no checkpoint copied the WAL into the database ({} bytes, {} checkpoints)",
                db_bytes(),
                done.load(Ordering::Relaxed)
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        // Stopped before the store's connection closes: that close is then the last one,
        // and removes the WAL before it returns.
        drop(checkpointer);
        drop(conn);
        assert!(!dir.path().join("t.db-wal").exists());
    }

    /// A database that is not in WAL mode keeps SQLite's own behaviour.
    #[test]
    fn a_database_not_in_wal_mode_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let mut conn = Connection::open(&path).unwrap();
        conn.execute_batch("CREATE TABLE t (x)").unwrap();
        assert!(
            move_off_request_path(&mut conn, &path, std::time::Duration::from_secs(1)).is_none()
        );
    }

    #[test]
    fn a_busy_checkpoint_warns_only_when_it_keeps_failing_and_any_other_error_at_once() {
        let busy = rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_BUSY),
            None,
        );
        let locked = rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_LOCKED),
            None,
        );
        let full = rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_FULL),
            None,
        );
        for failed in 1..BUSY_IN_A_ROW {
            assert!(!worth_a_warning(&busy, failed), "{failed}");
            assert!(!worth_a_warning(&locked, failed), "{failed}");
            assert!(worth_a_warning(&full, failed), "{failed}");
        }
        assert!(worth_a_warning(&busy, BUSY_IN_A_ROW));
        assert!(worth_a_warning(&locked, BUSY_IN_A_ROW + 1));
    }
}
