//! Trace retention on a serving host: every so often, the events older than `[trace]
//! retain` (or beyond the newest `retain_events`) are sealed into segment files in the
//! archive folder and leave the store ([`crate::store::archive`] has the rule and what
//! stays).
//!
//! Rule: archiving runs off the call path (a blocking task, each step holding the store
//! briefly) and never stops the host: a failed pass is logged at ERROR and the next one
//! tries again; nothing is lost by a failure. A pass that sealed a full segment is
//! followed at once by another, so a host catches up with a large trace in segments of
//! [`crate::store::archive::DEFAULT_SEGMENT_EVENTS`] events.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::config::{ServeConfig, TraceSettings};
use crate::host::Host;
use crate::store::archive::{ArchiveReport, ArchiveRequest, DEFAULT_SEGMENT_EVENTS};

/// Shortest time between two passes.
const MIN_INTERVAL: Duration = Duration::from_secs(1);

/// Longest time between two passes.
const MAX_INTERVAL: Duration = Duration::from_secs(600);

/// Time between passes for `trace`: a tenth of `retain` (so the store holds at most about
/// 1.1 × `retain`), within 1 s..=10 min; a minute when only
/// `retain_events` bounds it.
pub fn interval(trace: &TraceSettings) -> Duration {
    match trace.retain {
        Some(retain) => (retain / 10).clamp(MIN_INTERVAL, MAX_INTERVAL),
        None => Duration::from_secs(60),
    }
}

/// The archive folder of `config`: `[trace] archive_dir`, else
/// [`crate::config::ARCHIVE_DIR`] in the state folder; `None` when neither can be
/// determined.
pub fn archive_path(config: &ServeConfig) -> Option<PathBuf> {
    if let Some(dir) = &config.trace.archive_dir {
        return Some(dir.clone());
    }
    let state = config
        .state_dir
        .clone()
        .or_else(crate::config::default_state_dir)?;
    Some(config.trace.archive_path(&state))
}

/// The request of a pass at `now_ms` under `trace`, into `dir`.
pub fn request(trace: &TraceSettings, dir: PathBuf, now_ms: u64) -> ArchiveRequest {
    let before_ms = trace.retain.map_or(0, |retain| {
        now_ms.saturating_sub(u64::try_from(retain.as_millis()).unwrap_or(u64::MAX))
    });
    ArchiveRequest {
        dir,
        before_ms,
        max_events: DEFAULT_SEGMENT_EVENTS,
        keep_events: trace.retain_events,
        now_ms,
    }
}

/// One line for a pass that did something, `None` for one that did nothing.
pub fn report_line(report: &ArchiveReport) -> Option<String> {
    let sealed = report.sealed.as_ref().map(|a| {
        format!(
            "events {}..={} sealed into {} ({} bytes, {} kept in the store)",
            a.mark.from_seq,
            a.mark.to_seq,
            a.mark.segment,
            report.segment_bytes,
            a.mark.kept.len()
        )
    });
    if sealed.is_none() && report.deleted == 0 && report.reclaimed_bytes == 0 {
        return None;
    }
    Some(format!(
        "{}; {} archived events deleted from the store, {} bytes given back",
        sealed.unwrap_or_else(|| "no new segment".into()),
        report.deleted,
        report.reclaimed_bytes
    ))
}

/// Runs archive passes every [`interval`] while `host` lives, when `[trace] retain` or
/// `retain_events` is set.
pub fn spawn(host: &Arc<Host>) {
    let trace = host.config().trace.clone();
    if !trace.archives() {
        return;
    }
    let Some(dir) = archive_path(host.config()) else {
        tracing::error!(
            "[trace] retain is set but no state folder is known for the archive: set \
             [trace] archive_dir; nothing will be archived"
        );
        return;
    };
    let every = interval(&trace);
    let weak = Arc::downgrade(host);
    tokio::spawn(async move {
        let mut wait = every;
        loop {
            tokio::time::sleep(wait).await;
            let Some(host) = weak.upgrade() else { return };
            let registry = host.registry().clone();
            drop(host);
            let req = request(&trace, dir.clone(), crate::store::now_ms());
            let pass =
                tokio::task::spawn_blocking(move || registry.store().archive_trace(&req)).await;
            wait = every;
            match pass {
                Ok(Ok(report)) => {
                    if let Some(line) = report_line(&report) {
                        tracing::info!("trace archive: {line}");
                    }
                    let full = report.sealed.as_ref().is_some_and(|a| {
                        a.mark.to_seq - a.mark.from_seq + 1 >= DEFAULT_SEGMENT_EVENTS
                    });
                    if full {
                        wait = Duration::ZERO;
                    }
                }
                Ok(Err(e)) => tracing::error!(
                    "trace archive pass failed (nothing was lost; the next pass tries again): {e:#}"
                ),
                Err(e) => tracing::error!("the trace archive task failed: {e}"),
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_interval_follows_retain_within_bounds() {
        let with = |retain: Option<u64>, events: Option<i64>| TraceSettings {
            retain: retain.map(Duration::from_secs),
            retain_events: events,
            ..TraceSettings::default()
        };
        assert_eq!(interval(&with(Some(120), None)), Duration::from_secs(12));
        assert_eq!(interval(&with(Some(2), None)), MIN_INTERVAL);
        assert_eq!(interval(&with(Some(30 * 86_400), None)), MAX_INTERVAL);
        assert_eq!(interval(&with(None, Some(5000))), Duration::from_secs(60));
        let r = request(&with(Some(60), Some(5000)), PathBuf::from("/a"), 100_000);
        assert_eq!((r.before_ms, r.keep_events), (40_000, Some(5000)));
        let r = request(&with(None, Some(5000)), PathBuf::from("/a"), 100_000);
        assert_eq!(
            r.before_ms, 0,
            "by count only: no event is old enough by age"
        );
    }
}
