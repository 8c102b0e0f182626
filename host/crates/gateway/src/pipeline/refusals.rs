//! One log line per refused call.
//!
//! Rule: **every call the pipeline refuses leaves exactly one log line**, written when the
//! call ends, naming the call, the capability, its mapping and connection when the call
//! got that far, the refusal's category and its safe detail (what the model was told).
//! Categories that say something is wrong with the host's upstreams or its budgets —
//! `rate limited`, `interrupted` (a deadline, a cancellation), `unavailable`, `unknown`,
//! `result exceeds budget` — are logged at WARN; the others (invalid arguments and
//! references, policy denials, approvals asked for, state changed) at INFO. A flood is
//! bounded: at most [`LINES_PER_SECOND`] lines per category in each one-second window;
//! the first line of a category after a window that dropped some says how many were not
//! logged. Completed calls log nothing here (the trace has them all).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::pipeline::Category;

/// Most lines one category writes in one second.
pub const LINES_PER_SECOND: u32 = 5;

/// How many categories there are ([`index`] gives each its window; its match is
/// exhaustive, so a new category does not compile until it has one).
const CATEGORIES: usize = 12;

/// Whether `category` is logged at WARN (something about the host's upstreams or budgets)
/// rather than INFO.
pub fn warns(category: Category) -> bool {
    matches!(
        category,
        Category::RateLimited
            | Category::Interrupted
            | Category::Unavailable
            | Category::Unknown
            | Category::ResultExceedsBudget
    )
}

/// The window of `category`, in `0..CATEGORIES`.
fn index(category: Category) -> usize {
    match category {
        Category::InvalidRequest => 0,
        Category::Forbidden => 1,
        Category::Unavailable => 2,
        Category::RateLimited => 3,
        Category::Interrupted => 4,
        Category::Unknown => 5,
        Category::CapabilityUnavailable => 6,
        Category::OutsideScope => 7,
        Category::StateChanged => 8,
        Category::ApprovalRequired => 9,
        Category::PolicyNoLongerPermits => 10,
        Category::ResultExceedsBudget => 11,
    }
}

/// One category's current window.
#[derive(Clone, Copy)]
struct Window {
    started: Instant,
    logged: u32,
    /// Lines not written in windows since the last line that was.
    dropped: u64,
}

/// The refusals' log, one per host: each refused call through [`RefusalLog::refused`].
pub struct RefusalLog {
    windows: Mutex<[Window; CATEGORIES]>,
}

impl Default for RefusalLog {
    fn default() -> Self {
        let now = Instant::now();
        Self {
            windows: Mutex::new(
                [Window {
                    started: now,
                    logged: 0,
                    dropped: 0,
                }; CATEGORIES],
            ),
        }
    }
}

/// What one refused call's line says.
pub struct Refusal<'a> {
    /// The call's id (`call_…`), as in its trace events.
    pub call: &'a str,
    /// The tool the model called.
    pub capability: &'a str,
    /// The mapping that serves it, once the call found it.
    pub mapping: Option<&'a str>,
    /// That mapping's connection.
    pub connection: Option<&'a str>,
    /// The category the model was told.
    pub category: Category,
    /// The safe detail the model was told.
    pub detail: &'a str,
}

impl RefusalLog {
    /// Whether a line of `category` may be written at `now`; when it may, how many were
    /// dropped since the last one written.
    fn admit(&self, category: Category, now: Instant) -> Option<u64> {
        let mut windows = self
            .windows
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let w = &mut windows[index(category)];
        if now.duration_since(w.started) >= Duration::from_secs(1) {
            w.started = now;
            w.logged = 0;
        }
        if w.logged >= LINES_PER_SECOND {
            w.dropped += 1;
            return None;
        }
        w.logged += 1;
        Some(std::mem::take(&mut w.dropped))
    }

    /// Logs `r` (module rule); returns whether a line was written.
    pub fn refused(&self, r: &Refusal<'_>) -> bool {
        let Some(dropped) = self.admit(r.category, Instant::now()) else {
            return false;
        };
        let (mapping, connection) = (r.mapping.unwrap_or("-"), r.connection.unwrap_or("-"));
        let category = r.category.as_str();
        // The tool name and the detail may carry the model's text: escaped, the name cut.
        let capability = airlock_core::text::safe(r.capability, 128);
        let detail = airlock_core::text::safe(r.detail, 2048);
        if warns(r.category) {
            tracing::warn!(call = %r.call, capability = %capability, mapping = %mapping, connection = %connection, category, dropped, "call refused: {detail}");
        } else {
            tracing::info!(call = %r.call, capability = %capability, mapping = %mapping, connection = %connection, category, dropped, "call refused: {detail}");
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_category_is_bounded_per_second_and_counts_what_it_dropped() {
        let log = RefusalLog::default();
        let t0 = Instant::now();
        for _ in 0..LINES_PER_SECOND {
            assert_eq!(log.admit(Category::RateLimited, t0), Some(0));
        }
        assert_eq!(log.admit(Category::RateLimited, t0), None);
        assert_eq!(log.admit(Category::RateLimited, t0), None);
        // Another category has its own window.
        assert_eq!(log.admit(Category::InvalidRequest, t0), Some(0));
        // The next window's first line says how many were dropped; then none again.
        let t1 = t0 + Duration::from_millis(1000);
        assert_eq!(log.admit(Category::RateLimited, t1), Some(2));
        assert_eq!(log.admit(Category::RateLimited, t1), Some(0));
    }

    #[test]
    fn every_category_has_its_own_window_and_a_level() {
        let all = [
            Category::InvalidRequest,
            Category::Forbidden,
            Category::Unavailable,
            Category::RateLimited,
            Category::Interrupted,
            Category::Unknown,
            Category::CapabilityUnavailable,
            Category::OutsideScope,
            Category::StateChanged,
            Category::ApprovalRequired,
            Category::PolicyNoLongerPermits,
            Category::ResultExceedsBudget,
        ];
        let indexes: std::collections::BTreeSet<usize> = all.iter().map(|c| index(*c)).collect();
        assert_eq!(indexes.len(), CATEGORIES);
        assert!(indexes.iter().all(|i| *i < CATEGORIES));
        assert!(warns(Category::RateLimited) && warns(Category::Interrupted));
        assert!(!warns(Category::InvalidRequest) && !warns(Category::Forbidden));
    }
}
