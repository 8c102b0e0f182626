//! The attempts of an intent, and how an intent whose outcome was unknown is resolved.
//!
//! Rules (DESIGN.md §5.8, §8):
//! - An attempt moves prepared → sent → acknowledged → result observed → receipt verified
//!   → committed, and each state is written **when it becomes true**: `sent` is durable
//!   before the request's bytes reach the upstream, so a host that dies at any point
//!   leaves a record that says whether anything may have gone out.
//! - An attempt is `sent` while some request it made has no answer and `acknowledged`
//!   once every request it made was answered (a request that got no answer — the
//!   connection closed, it timed out, it was cancelled — keeps the attempt `sent`: its
//!   effect is unknown).
//! - An intent's outcome is written once: `prepared` → `completed | failed | unknown`;
//!   only an `unknown` intent (or a `prepared` one a previous host run left behind) can be
//!   **resolved** afterwards, and a resolution records how (a contract query, a retry
//!   with the same key, or a person), by whom, and the evidence.

use anyhow::{Context as _, bail};
use rusqlite::{OptionalExtension as _, params};
use serde::Serialize;
use serde_json::Value;

use super::approvals::{INTENT_COLUMNS, IntentRecord, IntentState};
use super::trace::NewEvent;
use super::{SqliteStore, ms_to_sql, now_ms};
use crate::rows;

/// Where one attempt of an intent is (DESIGN.md §5.8), in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum AttemptState {
    /// Recorded; nothing sent upstream yet.
    Prepared,
    /// A request went (or was about to go) to the upstream, and not all were answered.
    Sent,
    /// Every request the attempt sent was answered.
    Acknowledged,
    /// The adapter returned its contract result.
    ResultObserved,
    /// The host checked the result against what was approved (e.g. a delivery's
    /// `artifact-sha256` against the approved artifact).
    ReceiptVerified,
    /// The outcome and the call's trace were committed.
    Committed,
}

impl AttemptState {
    /// Every state, in order.
    pub const ALL: [Self; 6] = [
        Self::Prepared,
        Self::Sent,
        Self::Acknowledged,
        Self::ResultObserved,
        Self::ReceiptVerified,
        Self::Committed,
    ];

    /// The stored name (kebab-case).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Prepared => "prepared",
            Self::Sent => "sent",
            Self::Acknowledged => "acknowledged",
            Self::ResultObserved => "result-observed",
            Self::ReceiptVerified => "receipt-verified",
            Self::Committed => "committed",
        }
    }

    pub(super) fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|v| v.as_str() == s)
    }

    /// The column holding the time this state was reached.
    pub(super) fn column(self) -> &'static str {
        match self {
            Self::Prepared => "prepared_ms",
            Self::Sent => "sent_ms",
            Self::Acknowledged => "acknowledged_ms",
            Self::ResultObserved => "observed_ms",
            Self::ReceiptVerified => "verified_ms",
            Self::Committed => "committed_ms",
        }
    }
}

impl std::fmt::Display for AttemptState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One stored attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AttemptRecord {
    /// The intent.
    pub intent_id: String,
    /// From 1.
    pub attempt: u32,
    /// Where it is.
    pub state: AttemptState,
    /// Upstream requests it sent.
    pub requests: u32,
    /// Of those, how many were answered.
    pub answered: u32,
    /// The JSON-RPC id of its last upstream request, once known.
    pub last_request_id: Option<String>,
    /// Milliseconds since the Unix epoch at which each state was reached (`None`: not
    /// reached), in [`AttemptState::ALL`] order.
    pub at_ms: [Option<u64>; 6],
}

/// How an unknown intent was resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ResolutionMethod {
    /// The contract's query (by idempotency key) said what happened.
    Query,
    /// An idempotent retry with the same key returned the outcome.
    Retry,
    /// A person decided, with `airlock intents resolve`.
    Person,
    /// Nothing could have been sent: the attempt never reached `sent`.
    NothingSent,
}

impl ResolutionMethod {
    /// The kebab-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Query => "query",
            Self::Retry => "retry",
            Self::Person => "person",
            Self::NothingSent => "nothing-sent",
        }
    }
}

/// A resolution: the final state, how, by whom and with what evidence.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Resolution {
    /// `completed` or `failed`.
    pub state: IntentState,
    /// How.
    pub method: ResolutionMethod,
    /// Who: a person's name, or `airlock` for the host's own reconciliation.
    pub by: String,
    /// What showed it (safe summary: ids, digests, a person's words), a JSON object.
    pub evidence: Value,
    /// For a completed compensable effect: the handles of the record found
    /// ([`crate::IntentRecord::handles`]); empty otherwise. Not part of the stored
    /// resolution text.
    #[serde(skip)]
    pub handles: Vec<crate::IntentHandle>,
}

/// Which intents to list.
#[derive(Debug, Clone, Default)]
pub struct IntentFilter {
    /// Only intents in these outcome states (empty: any).
    pub states: Vec<IntentState>,
    /// Only intents of this mapping.
    pub mapping: Option<String>,
    /// Only intents created before this time (ms since the epoch).
    pub created_before_ms: Option<u64>,
    /// Only the compensations of this intent.
    pub compensates: Option<String>,
    /// At most this many, newest first.
    pub limit: usize,
}

pub(super) const ATTEMPT_COLUMNS: &str = "intent_id, attempt, state, requests, answered, last_request_id, \
     prepared_ms, sent_ms, acknowledged_ms, observed_ms, verified_ms, committed_ms";

/// Inserts attempt `attempt` of `intent`, prepared at `now`.
pub(super) fn insert_attempt(
    tx: &rusqlite::Transaction<'_>,
    intent: &str,
    attempt: u32,
    now: i64,
) -> rusqlite::Result<()> {
    tx.prepare_cached(
        "INSERT INTO intent_attempts (intent_id, attempt, state, prepared_ms) VALUES (?1, ?2, 'prepared', ?3)",
    )?
    .execute(params![intent, attempt, now])?;
    Ok(())
}

/// Marks the newest attempt of `intent` committed (with the outcome's transaction).
pub(super) fn commit_attempt(
    tx: &rusqlite::Transaction<'_>,
    intent: &str,
    now: i64,
) -> rusqlite::Result<()> {
    tx.prepare_cached(
        "UPDATE intent_attempts SET state = 'committed', committed_ms = ?2 \
         WHERE intent_id = ?1 AND attempt = (SELECT MAX(attempt) FROM intent_attempts WHERE intent_id = ?1)",
    )?
    .execute(params![intent, now])?;
    Ok(())
}

impl SqliteStore {
    pub(super) fn attempt_sending_impl(&self, intent: &str, attempt: u32) -> anyhow::Result<()> {
        let now = ms_to_sql(now_ms())?;
        let conn = self.lock();
        // One statement is its own transaction: no BEGIN/COMMIT round trips.
        let n = conn
            .prepare_cached(
                "UPDATE intent_attempts SET state = 'sent', requests = requests + 1, \
                 sent_ms = COALESCE(sent_ms, ?3) \
                 WHERE intent_id = ?1 AND attempt = ?2 AND state IN ('prepared', 'sent', 'acknowledged')",
            )?
            .execute(params![intent, attempt, now])
            .with_context(|| self.context("recording that a request is being sent"))?;
        if n != 1 {
            bail!("attempt {attempt} of intent `{intent}` cannot send any more");
        }
        Ok(())
    }

    pub(super) fn attempt_answered_impl(
        &self,
        intent: &str,
        attempt: u32,
        request_id: &str,
        answered: bool,
    ) -> anyhow::Result<()> {
        let now = ms_to_sql(now_ms())?;
        let conn = self.lock();
        conn.prepare_cached(
            "UPDATE intent_attempts SET \
               answered = answered + ?4, \
               last_request_id = NULLIF(?3, ''), \
               state = CASE WHEN answered + ?4 >= requests THEN 'acknowledged' ELSE 'sent' END, \
               acknowledged_ms = CASE WHEN answered + ?4 >= requests THEN ?5 ELSE acknowledged_ms END \
             WHERE intent_id = ?1 AND attempt = ?2 AND state IN ('sent', 'acknowledged')",
        )?
        .execute(params![intent, attempt, request_id, i64::from(answered), now])
        .with_context(|| self.context("recording an upstream answer"))?;
        Ok(())
    }

    pub(super) fn advance_attempt_impl(
        &self,
        intent: &str,
        attempt: u32,
        to: AttemptState,
    ) -> anyhow::Result<()> {
        let now = ms_to_sql(now_ms())?;
        let conn = self.lock();
        let sql = format!(
            "UPDATE intent_attempts SET state = ?3, {} = ?4 WHERE intent_id = ?1 AND attempt = ?2",
            to.column()
        );
        conn.prepare_cached(&sql)?
            .execute(params![intent, attempt, to.as_str(), now])
            .with_context(|| self.context("recording an attempt's progress"))?;
        Ok(())
    }

    pub(super) fn new_attempt_impl(&self, intent: &str) -> anyhow::Result<u32> {
        let now = ms_to_sql(now_ms())?;
        self.transact("recording a new attempt", &[], |tx| {
            let next: u32 = tx.query_row(
                "SELECT COALESCE(MAX(attempt), 0) + 1 FROM intent_attempts WHERE intent_id = ?1",
                params![intent],
                |r| r.get(0),
            )?;
            insert_attempt(tx, intent, next, now)?;
            Ok(next)
        })
    }

    pub(super) fn attempts_impl(&self, intent: &str) -> anyhow::Result<Vec<AttemptRecord>> {
        let conn = self.lock();
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT {ATTEMPT_COLUMNS} FROM intent_attempts WHERE intent_id = ?1 ORDER BY attempt"
        ))?;
        let rows = stmt
            .query_map(params![intent], |r| rows::attempt(r))?
            .collect::<rusqlite::Result<Vec<_>>>()
            .with_context(|| self.context("reading an intent's attempts"))?;
        Ok(rows)
    }

    pub(super) fn intents_impl(&self, filter: &IntentFilter) -> anyhow::Result<Vec<IntentRecord>> {
        let conn = self.lock();
        let states: Vec<&str> = filter.states.iter().map(|s| s.as_str()).collect();
        let states_json = serde_json::to_string(&states)?;
        let before = match filter.created_before_ms {
            Some(ms) => ms_to_sql(ms)?,
            None => i64::MAX,
        };
        let limit = i64::try_from(filter.limit.max(1)).unwrap_or(i64::MAX);
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT {INTENT_COLUMNS} FROM intents \
             WHERE (?1 = '[]' OR state IN (SELECT value FROM json_each(?1))) \
               AND (?2 IS NULL OR mapping = ?2) AND created_ms < ?3 \
               AND (?5 IS NULL OR compensates = ?5) \
             ORDER BY created_ms DESC, id LIMIT ?4"
        ))?;
        let rows = stmt
            .query_map(
                params![
                    states_json,
                    filter.mapping,
                    before,
                    limit,
                    filter.compensates
                ],
                |r| rows::intent(r),
            )?
            .collect::<rusqlite::Result<Vec<_>>>()
            .with_context(|| self.context("listing intents"))?;
        Ok(rows)
    }

    pub(super) fn resolve_intent_impl(
        &self,
        id: &str,
        resolution: &Resolution,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<IntentRecord> {
        let text = crate::plans::check_resolution(resolution)?;
        let handles = crate::plans::handles_text(resolution.state, &resolution.handles)?;
        let now = ms_to_sql(now_ms())?;
        self.transact("resolving an intent", &events, |tx| {
            let current: Option<String> = tx
                .query_row("SELECT state FROM intents WHERE id = ?1", params![id], |r| {
                    r.get(0)
                })
                .optional()?;
            crate::plans::check_resolvable(id, current.as_deref())?;
            tx.prepare_cached(
                "UPDATE intents SET state = ?2, updated_ms = ?3, resolution = ?4, resolved_ms = ?3, \
                 handles = ?5 WHERE id = ?1",
            )?
            .execute(params![id, resolution.state.as_str(), now, text, handles])?;
            Ok(tx.query_row(
                &format!("SELECT {INTENT_COLUMNS} FROM intents WHERE id = ?1"),
                params![id],
                |r| rows::intent(r),
            )?)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Intents as _, NewIntent};

    fn store() -> (tempfile::TempDir, SqliteStore) {
        let dir = tempfile::tempdir().unwrap();
        let s = SqliteStore::open(dir.path()).unwrap();
        (dir, s)
    }

    fn intent(s: &SqliteStore, n: u32) -> String {
        let record = NewIntent {
            compensates: None,
            id: format!("int_{n:032x}"),
            idempotency_key: format!("idk_{n:032x}"),
            call_id: format!("call_{n}"),
            requester: "alice".into(),
            session: "ses_1".into(),
            capability: "deliver_artifact".into(),
            mapping: "outbox-delivery".into(),
            mapping_revision: 1,
            args_digest: "c".repeat(64),
            effect_class: "external-effect".into(),
        };
        s.create_intent(&record, vec![]).unwrap();
        record.id
    }

    fn person(state: IntentState) -> Resolution {
        Resolution {
            handles: Vec::new(),
            state,
            method: ResolutionMethod::Person,
            by: "bob".into(),
            evidence: serde_json::json!({"statement": "seen"}),
        }
    }

    #[test]
    fn an_attempt_is_sent_until_every_request_is_answered() {
        let (_d, s) = store();
        let id = intent(&s, 1);
        let state = |s: &SqliteStore| s.attempts(&id).unwrap()[0].clone();
        assert_eq!(state(&s).state, AttemptState::Prepared);
        s.attempt_sending(&id, 1).unwrap();
        s.attempt_sending(&id, 1).unwrap();
        s.attempt_answered(&id, 1, "3", true).unwrap();
        let a = state(&s);
        assert_eq!(
            (a.state, a.requests, a.answered),
            (AttemptState::Sent, 2, 1)
        );
        // An unanswered request leaves the attempt sent.
        s.attempt_answered(&id, 1, "4", false).unwrap();
        assert_eq!(state(&s).state, AttemptState::Sent);
        assert_eq!(state(&s).last_request_id.as_deref(), Some("4"));
        assert!(state(&s).at_ms[1].is_some() && state(&s).at_ms[2].is_none());
    }

    #[test]
    fn nothing_is_sent_once_an_attempt_has_a_result() {
        let (_d, s) = store();
        let id = intent(&s, 2);
        s.attempt_sending(&id, 1).unwrap();
        s.attempt_answered(&id, 1, "1", true).unwrap();
        s.advance_attempt(&id, 1, AttemptState::ResultObserved)
            .unwrap();
        let err = s.attempt_sending(&id, 1).unwrap_err().to_string();
        assert!(err.contains("cannot send any more"), "{err}");
        // And an attempt that does not exist cannot send either.
        assert!(s.attempt_sending(&id, 9).is_err());
    }

    #[test]
    fn only_an_unknown_or_stale_prepared_intent_is_resolved_and_only_once() {
        let (_d, s) = store();
        let id = intent(&s, 3);
        s.set_intent_state(&id, IntentState::Unknown, vec![])
            .unwrap();
        // The attempt of an unknown outcome is left where it stopped.
        assert_eq!(s.attempts(&id).unwrap()[0].state, AttemptState::Prepared);
        let bad = s.resolve_intent(&id, &person(IntentState::Unknown), vec![]);
        assert!(bad.is_err(), "resolving to unknown is refused");
        let r = s
            .resolve_intent(&id, &person(IntentState::Completed), vec![])
            .unwrap();
        assert_eq!(r.state, IntentState::Completed);
        assert_eq!(r.resolution.as_ref().unwrap()["by"], "bob");
        assert!(r.resolved_ms.is_some());
        let again = format!(
            "{:#}",
            s.resolve_intent(&id, &person(IntentState::Failed), vec![])
                .unwrap_err()
        );
        assert!(again.contains("is completed"), "{again}");
        // A completed call's intent is never resolved.
        let done = intent(&s, 4);
        s.set_intent_state(&done, IntentState::Completed, vec![])
            .unwrap();
        assert_eq!(s.attempts(&done).unwrap()[0].state, AttemptState::Committed);
        assert!(
            s.resolve_intent(&done, &person(IntentState::Failed), vec![])
                .is_err()
        );
        let missing = s
            .resolve_intent("int_missing", &person(IntentState::Failed), vec![])
            .unwrap_err();
        assert!(format!("{missing:#}").contains("no intent"), "{missing:#}");
    }

    #[test]
    fn intents_are_listed_by_state_and_mapping_newest_first() {
        let (_d, s) = store();
        let a = intent(&s, 5);
        let b = intent(&s, 6);
        s.set_intent_state(&a, IntentState::Unknown, vec![])
            .unwrap();
        let unknown = s
            .intents(&IntentFilter {
                compensates: None,
                states: vec![IntentState::Unknown],
                limit: 10,
                ..Default::default()
            })
            .unwrap();
        assert_eq!(unknown.len(), 1);
        assert_eq!(unknown[0].intent.id, a);
        let all = s
            .intents(&IntentFilter {
                compensates: None,
                mapping: Some("outbox-delivery".into()),
                limit: 10,
                ..Default::default()
            })
            .unwrap();
        assert_eq!(all.len(), 2);
        let none = s
            .intents(&IntentFilter {
                compensates: None,
                mapping: Some("other".into()),
                limit: 10,
                ..Default::default()
            })
            .unwrap();
        assert!(none.is_empty());
        let _ = b;
        // A hostile filter value is data, not SQL.
        let odd = s
            .intents(&IntentFilter {
                compensates: None,
                mapping: Some("x' OR '1'='1".into()),
                limit: 10,
                ..Default::default()
            })
            .unwrap();
        assert!(odd.is_empty());
    }
}
