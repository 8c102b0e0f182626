//! One attempt of a durable intent, as the adapter's upstream requests happen.
//!
//! Rule (DESIGN.md §5.8): every transition is written to the store at the moment it
//! becomes true — `sent` before the request's bytes reach the upstream (a failed write
//! sends nothing), `acknowledged` when every request sent was answered. What the attempt
//! saw also decides the outcome class of a failed effect: nothing sent → the effect
//! certainly did not happen (`failed`); a request sent and not answered, or an adapter
//! that failed after sending → `unknown`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use crate::runtime::AttemptLog;
use crate::store::{AttemptState, Intents};

/// The store-backed [`AttemptLog`] of one attempt: it needs only the store's
/// [`Intents`].
pub struct Attempt {
    store: Arc<dyn Intents>,
    intent: String,
    number: u32,
    sent: AtomicU32,
    answered: AtomicU32,
    lost: AtomicBool,
}

/// What one attempt saw of its upstream requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AttemptSummary {
    /// Requests recorded as sent.
    pub sent: u32,
    /// Of those, answered.
    pub answered: u32,
    /// Some request got no answer (closed, timed out, cancelled).
    pub lost: bool,
}

impl AttemptSummary {
    /// True when something may have reached the upstream.
    pub fn may_have_acted(&self) -> bool {
        self.sent > 0
    }

    /// True when every request that was sent was answered.
    pub fn all_answered(&self) -> bool {
        !self.lost && self.answered >= self.sent
    }
}

impl Attempt {
    /// Attempt `number` of `intent` (already recorded as prepared).
    pub fn new(store: Arc<dyn Intents>, intent: &str, number: u32) -> Self {
        Self {
            store,
            intent: intent.to_string(),
            number,
            sent: AtomicU32::new(0),
            answered: AtomicU32::new(0),
            lost: AtomicBool::new(false),
        }
    }

    /// The attempt's number, from 1.
    pub fn number(&self) -> u32 {
        self.number
    }

    /// What the attempt saw so far.
    pub fn summary(&self) -> AttemptSummary {
        AttemptSummary {
            sent: self.sent.load(Ordering::Acquire),
            answered: self.answered.load(Ordering::Acquire),
            lost: self.lost.load(Ordering::Acquire),
        }
    }

    /// Durably moves the attempt to `to`; a failure is logged (the outcome's commit,
    /// which follows, reports a store that fails).
    pub fn advance(&self, to: AttemptState) {
        if let Err(e) = self.store.advance_attempt(&self.intent, self.number, to) {
            tracing::error!(intent = %self.intent, attempt = self.number, "could not record {to}: {e:#}");
        }
    }
}

impl AttemptLog for Attempt {
    fn sending(&self, method: &'static str, target: &str) -> Result<(), String> {
        self.store
            .attempt_sending(&self.intent, self.number)
            .map_err(|e| {
                tracing::error!(intent = %self.intent, %method, %target, "could not record a request before sending it: {e:#}");
                format!("{e:#}")
            })?;
        self.sent.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    fn finished(&self, method: &'static str, target: &str, request_id: &str, answered: bool) {
        if answered {
            self.answered.fetch_add(1, Ordering::AcqRel);
        } else {
            self.lost.store(true, Ordering::Release);
        }
        if let Err(e) = self
            .store
            .attempt_answered(&self.intent, self.number, request_id, answered)
        {
            tracing::error!(intent = %self.intent, %method, %target, "could not record an upstream answer: {e:#}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{NewIntent, SqliteStore};

    #[test]
    fn a_request_the_store_cannot_record_is_refused_and_counts_as_not_sent() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Intents> = Arc::new(SqliteStore::open(dir.path()).unwrap());
        let record = NewIntent {
            compensates: None,
            id: "int_1".into(),
            idempotency_key: "idk_1".into(),
            call_id: "call_1".into(),
            requester: "alice".into(),
            session: "ses_1".into(),
            capability: "deliver_artifact".into(),
            mapping: "outbox-delivery".into(),
            mapping_revision: 1,
            args_digest: "c".repeat(64),
            effect_class: "external-effect".into(),
        };
        store.create_intent(&record, vec![]).unwrap();
        // Attempt 1 already has its result: the store refuses to record another request.
        store.attempt_sending("int_1", 1).unwrap();
        store.attempt_answered("int_1", 1, "1", true).unwrap();
        store
            .advance_attempt("int_1", 1, AttemptState::ResultObserved)
            .unwrap();
        for number in [1, 9] {
            let attempt = Attempt::new(store.clone(), "int_1", number);
            let refused = attempt.sending("tools/call", "send_file");
            assert!(refused.is_err(), "attempt {number}: {refused:?}");
            let summary = attempt.summary();
            assert_eq!(summary.sent, 0, "attempt {number}");
            assert!(!summary.may_have_acted(), "attempt {number}");
        }
        // The store's record is unchanged: one request, answered.
        let attempts = store.attempts("int_1").unwrap();
        assert_eq!((attempts[0].requests, attempts[0].answered), (1, 1));
    }
}
