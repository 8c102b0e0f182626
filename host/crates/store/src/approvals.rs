//! Approvals, receipts and intents in the store.
//!
//! Rules this module enforces (DESIGN.md §5 steps 4–5):
//! - **An approval binds the exact consequence.** A request records requester, session,
//!   profile, capability, mapping and revision, snapshot digest, policy digest, the digest
//!   of the normalized arguments, the artifact digest (when there is one), a deterministic
//!   summary, a nonce and an expiry on the host clock. Approved, it is a **receipt**.
//! - **A receipt is consumed once, together with the intent it authorizes.** Consumption
//!   and the intent row are written in one `BEGIN IMMEDIATE` transaction, and the intent
//!   references the approval under a UNIQUE constraint: of any number of concurrent
//!   attempts, exactly one consumes it. A use with another requester, session,
//!   capability, arguments, mapping revision, snapshot or policy is refused and says which
//!   of these changed; so is a use after expiry.
//! - **States move one way**: pending → approved | denied | revoked | expired; approved →
//!   consumed | revoked | expired. Nothing leaves denied, revoked, consumed or expired.
//!   An in-band answer (an elicitation accepted by the person at the client) takes a
//!   pending request straight to consumed, recording who answered.
//!
//! Accepted forms: approval ids `apr_` + 24 lowercase hex digits (a unique prefix of at
//! least 12 characters is accepted by [`Approvals::approval`](super::Approvals::approval)); intent ids
//! `int_` + 32 hex; idempotency keys `idk_` + 32 hex. Times are unix milliseconds.

use crate::rows;
use anyhow::{Context as _, anyhow, bail};
use rusqlite::{OptionalExtension as _, Transaction, TransactionBehavior, params};
use serde::{Deserialize, Serialize};

use super::trace::{self, NewEvent};
use super::{SqliteStore, ms_to_sql, now_ms};

/// Where an approval request is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ApprovalState {
    /// Waiting for a person.
    Pending,
    /// A person approved it: a receipt, usable once until it expires.
    Approved,
    /// A person declined (or cancelled) it.
    Denied,
    /// Withdrawn after it was created or approved.
    Revoked,
    /// Used by one call (see `intent_id`).
    Consumed,
    /// Its time ran out before it was used.
    Expired,
}

impl ApprovalState {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Approved => "approved",
            Self::Denied => "denied",
            Self::Revoked => "revoked",
            Self::Consumed => "consumed",
            Self::Expired => "expired",
        }
    }

    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<Self> {
        [
            Self::Pending,
            Self::Approved,
            Self::Denied,
            Self::Revoked,
            Self::Consumed,
            Self::Expired,
        ]
        .into_iter()
        .find(|v| v.as_str() == s)
    }
}

impl std::fmt::Display for ApprovalState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How the person was asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ApprovalMode {
    /// `elicitation/create` to a 2025-11-25 client, answered in the same call.
    Elicitation,
    /// An `input_required` result (MRTR) to a 2026-07-28 client, answered on its retry.
    InputRequired,
    /// `airlock approvals approve ID` at a terminal; the call is repeated afterwards.
    OutOfBand,
}

impl ApprovalMode {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Elicitation => "elicitation",
            Self::InputRequired => "input-required",
            Self::OutOfBand => "out-of-band",
        }
    }

    pub(super) fn parse(s: &str) -> Option<Self> {
        [Self::Elicitation, Self::InputRequired, Self::OutOfBand]
            .into_iter()
            .find(|v| v.as_str() == s)
    }
}

/// What a receipt is bound to: every field must match at use. Recorded whole in the
/// `approval-requested` event, whose MAC makes it the proof of the stored row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReceiptBinding {
    pub requester: String,
    pub session: String,
    pub capability: String,
    pub mapping: String,
    pub mapping_revision: i64,
    pub snapshot_digest: String,
    pub policy_digest: String,
    /// sha256 of the canonical normalized arguments (handles as locators).
    pub args_digest: String,
    /// sha256 of the artifact the arguments name, as reported when it was prepared.
    pub artifact_digest: Option<String>,
}

/// A new approval request.
#[derive(Debug, Clone)]
pub struct NewApproval {
    pub binding: ReceiptBinding,
    pub profile: String,
    pub mode: ApprovalMode,
    /// The deterministic description the person approves.
    pub summary: String,
    /// Lifetime of the pending request, ms.
    pub ttl_ms: u64,
}

/// [`Waiting`]'s one statement, for both backends (`$1`: now, ms). The `IN` term lets
/// SQLite read the partial `intents_open` index.
pub(crate) const WAITING_SQL: &str = "SELECT \
     (SELECT count(*) FROM approvals WHERE state = 'pending' AND expires_ms > $1), \
     (SELECT min(created_ms) FROM approvals WHERE state = 'pending' AND expires_ms > $1), \
     (SELECT count(*) FROM intents WHERE state IN ('prepared', 'unknown') AND state = 'prepared'), \
     (SELECT count(*) FROM intents WHERE state IN ('prepared', 'unknown') AND state = 'unknown')";

/// What waits for a person or for reconciliation, counted at one moment
/// ([`crate::Approvals::waiting`]): the figures `airlock status` shows and the metrics'
/// gauges report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Waiting {
    /// Approval requests still `pending` and not expired.
    pub approvals_pending: u64,
    /// When the oldest of them was made (ms since the epoch); `None` when there is none.
    pub oldest_pending_ms: Option<u64>,
    /// Intents `prepared`: their call is running, or a host stopped while it ran (then
    /// they are reconciled).
    pub intents_prepared: u64,
    /// Intents `unknown`: their effect may or may not have happened, and they are held
    /// until reconciliation or a person resolves them.
    pub intents_unknown: u64,
}

/// One approval request (a receipt once approved).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ApprovalRecord {
    pub id: String,
    pub state: ApprovalState,
    pub mode: ApprovalMode,
    #[serde(flatten)]
    pub binding: ReceiptBinding,
    pub profile: String,
    pub summary: String,
    /// Random, 128 bits hex; bound into an MRTR `requestState`.
    pub nonce: String,
    pub created_ms: u64,
    pub expires_ms: u64,
    pub decided_by: Option<String>,
    pub decided_ms: Option<u64>,
    pub reason: Option<String>,
    pub consumed_ms: Option<u64>,
    pub intent_id: Option<String>,
}

impl ApprovalRecord {
    /// The state as of `now_ms`: pending or approved past `expires_ms` reads as expired.
    pub fn state_at(&self, now_ms: u64) -> ApprovalState {
        match self.state {
            ApprovalState::Pending | ApprovalState::Approved if now_ms >= self.expires_ms => {
                ApprovalState::Expired
            }
            s => s,
        }
    }

    /// Names of the binding fields that differ from `other`.
    pub fn changed_fields(&self, other: &ReceiptBinding) -> Vec<&'static str> {
        self.binding.changed_fields(other)
    }
}

/// What a person's decision does to an approval (the rule both stores apply in their
/// transaction).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum DecisionEffect {
    /// Store this state and expiry (ms since the epoch).
    Becomes(ApprovalState, u64),
    /// The approval's time ran out: mark it expired (the refusal still commits), and
    /// refuse with this message.
    Expired(String),
    /// The decision does not apply to its state: refuse with this message.
    Refused(String),
}

impl ApprovalRecord {
    /// What `decision` at `now_ms` does to this approval: approve or deny a pending one,
    /// revoke a pending or approved one; an approved receipt lives `ttl_ms` from now, other
    /// states keep their expiry. Anything else is refused, naming the state.
    pub(super) fn decision_effect(
        &self,
        decision: ApprovalDecision,
        now_ms: u64,
        ttl_ms: u64,
    ) -> DecisionEffect {
        let id = &self.id;
        let to = match (decision, self.state_at(now_ms)) {
            (ApprovalDecision::Approve, ApprovalState::Pending) => ApprovalState::Approved,
            (ApprovalDecision::Deny, ApprovalState::Pending) => ApprovalState::Denied,
            (ApprovalDecision::Revoke, ApprovalState::Pending | ApprovalState::Approved) => {
                ApprovalState::Revoked
            }
            (_, ApprovalState::Expired) => {
                return DecisionEffect::Expired(format!(
                    "approval `{id}` has expired; the call must be made again to ask anew"
                ));
            }
            (_, s) => {
                return DecisionEffect::Refused(format!(
                    "approval `{id}` is {s}; only a pending approval can be approved or denied, and only a pending or approved one revoked"
                ));
            }
        };
        let expires = match to {
            ApprovalState::Approved => now_ms.saturating_add(ttl_ms),
            _ => self.expires_ms,
        };
        DecisionEffect::Becomes(to, expires)
    }
}

impl ReceiptBinding {
    /// Names of the fields that differ from `other` (`"requester"`, … `"arguments"`,
    /// `"artifact"`), in declaration order; empty when the two bind the same call.
    pub fn changed_fields(&self, other: &ReceiptBinding) -> Vec<&'static str> {
        let b = self;
        let mut changed = Vec::new();
        let checks: [(&'static str, bool); 9] = [
            ("requester", b.requester != other.requester),
            ("session", b.session != other.session),
            ("capability", b.capability != other.capability),
            ("mapping", b.mapping != other.mapping),
            (
                "mapping revision",
                b.mapping_revision != other.mapping_revision,
            ),
            ("snapshot", b.snapshot_digest != other.snapshot_digest),
            ("policy", b.policy_digest != other.policy_digest),
            ("arguments", b.args_digest != other.args_digest),
            ("artifact", b.artifact_digest != other.artifact_digest),
        ];
        for (name, differs) in checks {
            if differs {
                changed.push(name);
            }
        }
        changed
    }
}

/// A person's decision on a pending request (or a withdrawal).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApprovalDecision {
    /// pending → approved; the receipt lives for the given ttl from now.
    Approve,
    /// pending → denied.
    Deny,
    /// pending | approved → revoked.
    Revoke,
}

/// How a receipt is being consumed.
#[derive(Debug, Clone, Copy)]
pub enum ConsumeAs<'a> {
    /// An approved receipt (out of band).
    Approved,
    /// A pending request answered in band by `by` (elicitation accepted at the client);
    /// `nonce`, when given, must equal the request's (an MRTR `requestState`).
    AnsweredInBand { by: &'a str, nonce: Option<&'a str> },
}

/// Why a receipt could not be consumed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "refusal", content = "detail", rename_all = "kebab-case")]
pub enum ReceiptRefusal {
    /// No such approval.
    NotFound,
    /// Not in a usable state (already consumed, denied, revoked, or still pending).
    State(ApprovalState),
    /// Its time ran out.
    Expired,
    /// Bound to something else: these fields changed since.
    Changed(Vec<&'static str>),
    /// The nonce does not match (a forged or replayed request state).
    Nonce,
}

/// The outcome of [`Approvals::consume_receipt`](super::Approvals::consume_receipt).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Consumption {
    /// Consumed; the intent exists.
    Consumed(Box<ApprovalRecord>, Box<IntentRecord>),
    /// Not consumed; nothing was written.
    Refused(ReceiptRefusal),
}

/// Where an intent is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum IntentState {
    /// Created; about to be attempted.
    Prepared,
    /// The adapter returned a result.
    Completed,
    /// Failed before anything was sent upstream, or the upstream refused.
    Failed,
    /// The outcome is not known (a non-read call interrupted after sending).
    Unknown,
}

impl IntentState {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Prepared => "prepared",
            Self::Completed => "completed",
            Self::Failed => "failed",
            Self::Unknown => "unknown",
        }
    }

    /// The state a stored name (`prepared`, `completed`, `failed`, `unknown`) names.
    pub fn parse(s: &str) -> Option<Self> {
        [Self::Prepared, Self::Completed, Self::Failed, Self::Unknown]
            .into_iter()
            .find(|v| v.as_str() == s)
    }
}

/// A new intent: one stable effect id and idempotency key for every attempt of one call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NewIntent {
    pub id: String,
    pub idempotency_key: String,
    pub call_id: String,
    pub requester: String,
    pub session: String,
    pub capability: String,
    pub mapping: String,
    pub mapping_revision: i64,
    pub args_digest: String,
    pub effect_class: String,
    /// The intent this one compensates (undoes), when it is a compensation started with
    /// `airlock intents compensate`: at most one compensation of an intent is open or
    /// completed at a time (a failed one may be tried again).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compensates: Option<String>,
}

/// One handle a completed effect's result carried, kept with its intent so that the
/// effect can be compensated later ([`IntentRecord::handles`]): the handle kind (a
/// contract's `<x>-ref` name), the adapter's locator (never shown to the model) and the
/// scalar facts of the record it came in (the summary a person approves names them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IntentHandle {
    /// The handle kind, e.g. `change-ref`.
    pub kind: String,
    /// The adapter's locator.
    pub locator: String,
    /// The scalar fields of the record the handle was a field of.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub facts: serde_json::Map<String, serde_json::Value>,
}

/// A stored intent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct IntentRecord {
    #[serde(flatten)]
    pub intent: NewIntent,
    pub approval_id: Option<String>,
    pub state: IntentState,
    pub created_ms: u64,
    pub updated_ms: u64,
    /// How an unknown intent was resolved: `{"method", "by", "evidence"}`.
    pub resolution: Option<serde_json::Value>,
    /// When it was resolved (ms since the epoch).
    pub resolved_ms: Option<u64>,
    /// The handles its result carried, kept when it completed and its capability is
    /// compensable (empty otherwise): what a compensation undoes. Written once; the
    /// completing trace event carries their digest ([`crate::plans::handles_sha256`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub handles: Vec<IntentHandle>,
}

/// A random id `prefix` + `bytes` hex-encoded random bytes.
pub fn random_id(prefix: &str, bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    airlock_core::random::fill(&mut buf);
    format!("{prefix}{}", hex::encode(buf))
}

pub(super) const APPROVAL_COLUMNS: &str = "id, state, mode, requester, session, profile, capability, mapping, \
     mapping_revision, snapshot_digest, policy_digest, args_digest, artifact_digest, summary, \
     nonce, created_ms, expires_ms, decided_by, decided_ms, reason, consumed_ms, intent_id";

pub(super) const INTENT_COLUMNS: &str = "id, idempotency_key, call_id, approval_id, requester, \
     session, capability, mapping, mapping_revision, args_digest, effect_class, state, \
     created_ms, updated_ms, resolution, resolved_ms, compensates, handles";

fn load_approval(tx: &Transaction<'_>, id: &str) -> rusqlite::Result<Option<ApprovalRecord>> {
    tx.prepare_cached(&format!(
        "SELECT {APPROVAL_COLUMNS} FROM approvals WHERE id = ?1"
    ))?
    .query_row(params![id], |r| rows::approval(r))
    .optional()
}

fn insert_intent(
    tx: &Transaction<'_>,
    intent: &NewIntent,
    approval_id: Option<&str>,
    now: i64,
) -> anyhow::Result<()> {
    tx.prepare_cached(
        "INSERT INTO intents (id, idempotency_key, call_id, approval_id, requester, session, \
         capability, mapping, mapping_revision, args_digest, effect_class, state, created_ms, \
         updated_ms, compensates) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, 'prepared', ?12, ?12, ?13)",
    )?
    .execute(params![
        intent.id,
        intent.idempotency_key,
        intent.call_id,
        approval_id,
        intent.requester,
        intent.session,
        intent.capability,
        intent.mapping,
        intent.mapping_revision,
        intent.args_digest,
        intent.effect_class,
        now,
        intent.compensates,
    ])?;
    super::intents::insert_attempt(tx, &intent.id, 1, now)?;
    Ok(())
}

impl SqliteStore {
    /// Runs `work` and appends `events` in one `BEGIN IMMEDIATE` transaction.
    pub(super) fn transact<T>(
        &self,
        what: &str,
        events: &[NewEvent],
        work: impl FnOnce(&Transaction<'_>) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let mut conn = self.lock_in_order()?;
        let run = || -> anyhow::Result<T> {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let out = work(&tx)?;
            trace::append_in(&tx, &self.key, events)?;
            tx.commit()?;
            Ok(out)
        };
        run().with_context(|| self.context(what))
    }

    pub(super) fn create_approval_impl(
        &self,
        new: &NewApproval,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<ApprovalRecord> {
        let id = random_id("apr_", 12);
        let nonce = random_id("", 16);
        let now = now_ms();
        let expires = now.saturating_add(new.ttl_ms);
        let events: Vec<NewEvent> = events
            .into_iter()
            .map(|mut e| {
                if let Some(o) = e.payload.as_object_mut() {
                    o.entry("approval")
                        .or_insert_with(|| serde_json::Value::String(id.clone()));
                }
                e
            })
            .collect();
        self.transact("recording an approval request", &events, |tx| {
            let b = &new.binding;
            tx.execute(
                &format!(
                    "INSERT INTO approvals ({APPROVAL_COLUMNS}) VALUES (?1, 'pending', ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, NULL, NULL, NULL, NULL, NULL)"
                ),
                params![
                    id,
                    new.mode.as_str(),
                    b.requester,
                    b.session,
                    new.profile,
                    b.capability,
                    b.mapping,
                    b.mapping_revision,
                    b.snapshot_digest,
                    b.policy_digest,
                    b.args_digest,
                    b.artifact_digest,
                    new.summary,
                    nonce,
                    ms_to_sql(now)?,
                    ms_to_sql(expires)?,
                ],
            )?;
            load_approval(tx, &id)?.ok_or_else(|| anyhow!("the approval just written is missing"))
        })
    }

    pub(super) fn approval_impl(&self, id: &str) -> anyhow::Result<Option<ApprovalRecord>> {
        let id = id.trim();
        if id.len() < 12 || !id.is_ascii() {
            bail!(
                "approval id `{id}` is too short: give the full id (apr_…) or at least 12 characters of it"
            );
        }
        let conn = self.lock();
        let mut stmt = conn.prepare(&format!(
            "SELECT {APPROVAL_COLUMNS} FROM approvals WHERE id = ?1 OR (length(?1) < 28 AND substr(id, 1, length(?1)) = ?1) LIMIT 2"
        ))?;
        let rows: Vec<ApprovalRecord> = stmt
            .query_map(params![id], |r| rows::approval(r))?
            .collect::<rusqlite::Result<_>>()
            .with_context(|| self.context("reading an approval"))?;
        match rows.len() {
            0 => Ok(None),
            1 => Ok(rows.into_iter().next()),
            _ => bail!("approval id prefix `{id}` matches several approvals; give more of it"),
        }
    }

    pub(super) fn waiting_impl(&self, now_ms: u64) -> anyhow::Result<Waiting> {
        let now = ms_to_sql(now_ms)?;
        let conn = self.lock();
        conn.prepare_cached(WAITING_SQL)?
            .query_row(params![now], |r| rows::waiting(r))
            .with_context(|| self.context("counting what waits"))
    }

    pub(super) fn approvals_impl(
        &self,
        state: Option<ApprovalState>,
        after: Option<(u64, &str)>,
        limit: usize,
    ) -> anyhow::Result<Vec<ApprovalRecord>> {
        let conn = self.lock();
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let (after_ms, after_id) = match after {
            Some((ms, id)) => (Some(i64::try_from(ms).unwrap_or(i64::MAX)), Some(id)),
            None => (None, None),
        };
        let mut stmt = conn.prepare(&format!(
            "SELECT {APPROVAL_COLUMNS} FROM approvals WHERE (?1 IS NULL OR state = ?1) \
             AND (?2 IS NULL OR created_ms < ?2 OR (created_ms = ?2 AND id > ?3)) \
             ORDER BY created_ms DESC, id LIMIT ?4"
        ))?;
        stmt.query_map(
            params![state.map(|s| s.as_str()), after_ms, after_id, limit],
            |r| rows::approval(r),
        )?
        .collect::<rusqlite::Result<_>>()
        .with_context(|| self.context("listing approvals"))
    }

    /// The newest open approval of a binding; served by the `approvals_open_by_binding`
    /// partial index (the `WHERE` must name the index's states exactly for SQLite to use it).
    pub(super) fn find_approval_impl(
        &self,
        binding: &ReceiptBinding,
    ) -> anyhow::Result<Option<ApprovalRecord>> {
        let conn = self.lock();
        conn.prepare_cached(&find_open_sql())?
            .query_row(
                params![
                    binding.requester,
                    binding.session,
                    binding.capability,
                    binding.args_digest
                ],
                |r| rows::approval(r),
            )
            .optional()
            .with_context(|| self.context("looking up an approval"))
    }

    pub(super) fn decide_approval_impl(
        &self,
        id: &str,
        decision: ApprovalDecision,
        by: &str,
        reason: Option<&str>,
        ttl_ms: u64,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<ApprovalRecord> {
        let now = now_ms();
        // The expiry is recorded even though the decision fails: the closure returns the
        // refusal as a value so that the transaction commits.
        let outcome = self.transact("deciding an approval", &[], |tx| {
            let Some(record) = load_approval(tx, id)? else {
                return Ok(Err(format!("no approval `{id}`")));
            };
            let (to, expires) = match record.decision_effect(decision, now, ttl_ms) {
                DecisionEffect::Becomes(to, expires) => (to, ms_to_sql(expires)?),
                DecisionEffect::Expired(why) => {
                    tx.execute(
                        "UPDATE approvals SET state = 'expired' WHERE id = ?1 AND state IN ('pending', 'approved')",
                        params![id],
                    )?;
                    return Ok(Err(why));
                }
                DecisionEffect::Refused(why) => return Ok(Err(why)),
            };
            tx.execute(
                "UPDATE approvals SET state = ?2, decided_by = ?3, decided_ms = ?4, reason = ?5, expires_ms = ?6 WHERE id = ?1",
                params![id, to.as_str(), by, ms_to_sql(now)?, reason, expires],
            )?;
            trace::append_in(tx, &self.key, &events)?;
            Ok(Ok(load_approval(tx, id)?
                .ok_or_else(|| anyhow!("approval `{id}` vanished"))?))
        })?;
        outcome.map_err(|why| anyhow!(why))
    }

    pub(super) fn consume_receipt_impl(
        &self,
        id: &str,
        binding: &ReceiptBinding,
        how: ConsumeAs<'_>,
        intent: &NewIntent,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<Consumption> {
        let now = now_ms();
        let mut conn = self.lock_in_order()?;
        let mut run = || -> anyhow::Result<Consumption> {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let Some(record) = load_approval(&tx, id)? else {
                return Ok(Consumption::Refused(ReceiptRefusal::NotFound));
            };
            match crate::plans::check_consumption(&record, binding, how, now) {
                Ok(()) => {}
                Err(ReceiptRefusal::Expired) => {
                    tx.execute(
                        "UPDATE approvals SET state = 'expired' WHERE id = ?1 AND state IN ('pending', 'approved')",
                        params![id],
                    )?;
                    tx.commit()?;
                    return Ok(Consumption::Refused(ReceiptRefusal::Expired));
                }
                Err(refusal) => return Ok(Consumption::Refused(refusal)),
            }
            let now_sql = ms_to_sql(now)?;
            let updated = match how {
                ConsumeAs::Approved => tx
                    .prepare_cached(
                        "UPDATE approvals SET state = 'consumed', consumed_ms = ?2, intent_id = ?3 WHERE id = ?1 AND state = 'approved'",
                    )?
                    .execute(params![id, now_sql, intent.id])?,
                ConsumeAs::AnsweredInBand { by, .. } => tx
                    .prepare_cached(
                        "UPDATE approvals SET state = 'consumed', consumed_ms = ?2, intent_id = ?3, decided_by = ?4, decided_ms = ?2 WHERE id = ?1 AND state = 'pending'",
                    )?
                    .execute(params![id, now_sql, intent.id, by])?,
            };
            if updated != 1 {
                return Ok(Consumption::Refused(crate::plans::lost_consumption(
                    &record, now,
                )));
            }
            insert_intent(&tx, intent, Some(id), now_sql)?;
            trace::append_in(&tx, &self.key, &events)?;
            let approval = load_approval(&tx, id)?.ok_or_else(|| anyhow!("approval vanished"))?;
            let stored = tx
                .prepare_cached(&format!(
                    "SELECT {INTENT_COLUMNS} FROM intents WHERE id = ?1"
                ))?
                .query_row(params![intent.id], |r| rows::intent(r))?;
            tx.commit()?;
            Ok(Consumption::Consumed(Box::new(approval), Box::new(stored)))
        };
        run().with_context(|| self.context("consuming a receipt"))
    }

    pub(super) fn create_intent_impl(
        &self,
        intent: &NewIntent,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<()> {
        let now = ms_to_sql(now_ms())?;
        self.transact("recording an intent", &events, |tx| {
            insert_intent(tx, intent, None, now)
        })
    }

    pub(super) fn set_intent_state_impl(
        &self,
        id: &str,
        state: IntentState,
        events: Vec<NewEvent>,
        observations: &[super::NewObservation],
        handles: &[IntentHandle],
    ) -> anyhow::Result<()> {
        let now = ms_to_sql(now_ms())?;
        let handles = crate::plans::handles_text(state, handles)?;
        self.transact("recording an intent's outcome", &events, |tx| {
            super::observations::write_in(tx, observations)?;
            let n = tx
                .prepare_cached(
                    "UPDATE intents SET state = ?2, updated_ms = ?3, handles = ?4 WHERE id = ?1 AND state = 'prepared'",
                )?
                .execute(params![id, state.as_str(), now, handles])?;
            if n != 1 {
                return Err(crate::plans::not_prepared(id));
            }
            // An unknown outcome leaves the attempt where it stopped (sent, acknowledged):
            // that is the evidence a reconciler starts from.
            if state != IntentState::Unknown {
                super::intents::commit_attempt(tx, id, now)?;
            }
            Ok(())
        })
    }

    pub(super) fn intent_impl(&self, id: &str) -> anyhow::Result<Option<IntentRecord>> {
        let conn = self.lock();
        conn.query_row(
            &format!("SELECT {INTENT_COLUMNS} FROM intents WHERE id = ?1"),
            params![id],
            |r| rows::intent(r),
        )
        .optional()
        .with_context(|| self.context("reading an intent"))
    }
}

/// The query behind [`SqliteStore::find_approval_impl`].
fn find_open_sql() -> String {
    format!(
        "SELECT {APPROVAL_COLUMNS} FROM approvals WHERE requester = ?1 AND session = ?2 AND capability = ?3 AND args_digest = ?4 AND state IN ('pending', 'approved') ORDER BY created_ms DESC LIMIT 1"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Approvals as _;

    /// However many consumed approvals a binding has, the lookup of its open one searches
    /// the partial index, not the binding's rows.
    #[test]
    fn finding_the_open_approval_uses_the_partial_index() {
        let (_dir, s) = store();
        let conn = s.lock();
        let plan: Vec<String> = conn
            .prepare(&format!("EXPLAIN QUERY PLAN {}", find_open_sql()))
            .unwrap()
            .query_map(params!["a", "b", "c", "d"], |row| row.get::<_, String>(3))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        let plan = plan.join("; ");
        assert!(plan.contains("approvals_open_by_binding"), "{plan}");
        assert!(
            !plan.contains("TEMP B-TREE"),
            "sorts instead of reading the index: {plan}"
        );
    }

    fn binding() -> ReceiptBinding {
        ReceiptBinding {
            requester: "alice".into(),
            session: "ses_1".into(),
            capability: "deliver_artifact".into(),
            mapping: "outbox-delivery".into(),
            mapping_revision: 2,
            snapshot_digest: "a".repeat(64),
            policy_digest: "b".repeat(64),
            args_digest: "c".repeat(64),
            artifact_digest: Some("d".repeat(64)),
        }
    }

    fn request(mode: ApprovalMode, ttl_ms: u64) -> NewApproval {
        NewApproval {
            binding: binding(),
            profile: "publisher".into(),
            mode,
            summary: "Approve `deliver_artifact`".into(),
            ttl_ms,
        }
    }

    fn intent(n: usize) -> NewIntent {
        NewIntent {
            compensates: None,
            id: format!("int_{n}"),
            idempotency_key: format!("idk_{n}"),
            call_id: format!("call_{n}"),
            requester: "alice".into(),
            session: "ses_1".into(),
            capability: "deliver_artifact".into(),
            mapping: "outbox-delivery".into(),
            mapping_revision: 2,
            args_digest: "c".repeat(64),
            effect_class: "external-effect".into(),
        }
    }

    fn store() -> (tempfile::TempDir, SqliteStore) {
        let dir = tempfile::tempdir().unwrap();
        let s = SqliteStore::open(dir.path()).unwrap();
        (dir, s)
    }

    #[test]
    fn thirty_two_concurrent_consumers_of_one_receipt_leave_one_intent() {
        let (dir, s) = store();
        let a = s
            .create_approval(&request(ApprovalMode::OutOfBand, 60_000), vec![])
            .unwrap();
        s.decide_approval(
            &a.id,
            ApprovalDecision::Approve,
            "bob",
            None,
            60_000,
            vec![],
        )
        .unwrap();
        let path = dir.path().to_path_buf();
        let won = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for n in 0..32 {
                let (path, id, won) = (&path, &a.id, &won);
                scope.spawn(move || {
                    // Each thread its own connection, as separate processes would have.
                    let s = SqliteStore::open(path).unwrap();
                    let r = s
                        .consume_receipt(id, &binding(), ConsumeAs::Approved, &intent(n), vec![])
                        .unwrap();
                    match r {
                        Consumption::Consumed(..) => {
                            won.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        }
                        Consumption::Refused(ReceiptRefusal::State(ApprovalState::Consumed)) => {}
                        other => panic!("{other:?}"),
                    }
                });
            }
        });
        assert_eq!(won.into_inner(), 1);
        let conn = s.lock();
        let intents: i64 = conn
            .query_row("SELECT count(*) FROM intents", [], |r| r.get(0))
            .unwrap();
        assert_eq!(intents, 1);
    }

    #[test]
    fn a_receipt_for_other_facts_is_refused_and_names_what_changed() {
        let (_dir, s) = store();
        let a = s
            .create_approval(&request(ApprovalMode::OutOfBand, 60_000), vec![])
            .unwrap();
        assert_eq!(
            s.consume_receipt(&a.id, &binding(), ConsumeAs::Approved, &intent(0), vec![])
                .unwrap(),
            Consumption::Refused(ReceiptRefusal::State(ApprovalState::Pending)),
            "a pending request is no receipt"
        );
        s.decide_approval(
            &a.id,
            ApprovalDecision::Approve,
            "bob",
            None,
            60_000,
            vec![],
        )
        .unwrap();
        let mut other = binding();
        other.args_digest = "e".repeat(64);
        other.mapping_revision = 3;
        other.session = "ses_2".into();
        match s
            .consume_receipt(&a.id, &other, ConsumeAs::Approved, &intent(0), vec![])
            .unwrap()
        {
            Consumption::Refused(ReceiptRefusal::Changed(fields)) => {
                assert_eq!(fields, ["session", "mapping revision", "arguments"])
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            s.consume_receipt(&a.id, &binding(), ConsumeAs::Approved, &intent(1), vec![])
                .unwrap(),
            Consumption::Consumed(..)
        ));
        assert_eq!(
            s.consume_receipt(&a.id, &binding(), ConsumeAs::Approved, &intent(2), vec![])
                .unwrap(),
            Consumption::Refused(ReceiptRefusal::State(ApprovalState::Consumed)),
            "a second use fails"
        );
        assert_eq!(
            s.consume_receipt(
                "apr_000000000000000000000000",
                &binding(),
                ConsumeAs::Approved,
                &intent(3),
                vec![]
            )
            .unwrap(),
            Consumption::Refused(ReceiptRefusal::NotFound)
        );
    }

    #[test]
    fn states_move_one_way_and_expire_on_the_host_clock() {
        let (_dir, s) = store();
        let a = s
            .create_approval(&request(ApprovalMode::OutOfBand, 60_000), vec![])
            .unwrap();
        s.decide_approval(&a.id, ApprovalDecision::Deny, "bob", Some("no"), 0, vec![])
            .unwrap();
        for d in [
            ApprovalDecision::Approve,
            ApprovalDecision::Deny,
            ApprovalDecision::Revoke,
        ] {
            let err = s
                .decide_approval(&a.id, d, "bob", None, 60_000, vec![])
                .unwrap_err();
            assert!(format!("{err:#}").contains("denied"), "{err:#}");
        }
        let b = s
            .create_approval(&request(ApprovalMode::OutOfBand, 0), vec![])
            .unwrap();
        let err = s
            .decide_approval(
                &b.id,
                ApprovalDecision::Approve,
                "bob",
                None,
                60_000,
                vec![],
            )
            .unwrap_err();
        assert!(format!("{err:#}").contains("expired"), "{err:#}");
        assert_eq!(
            s.approval(&b.id).unwrap().unwrap().state,
            ApprovalState::Expired
        );
        // An approved receipt that outlives its ttl is refused as expired.
        let c = s
            .create_approval(&request(ApprovalMode::OutOfBand, 60_000), vec![])
            .unwrap();
        s.decide_approval(&c.id, ApprovalDecision::Approve, "bob", None, 0, vec![])
            .unwrap();
        assert_eq!(
            s.consume_receipt(&c.id, &binding(), ConsumeAs::Approved, &intent(0), vec![])
                .unwrap(),
            Consumption::Refused(ReceiptRefusal::Expired)
        );
        // Revocation of an approved receipt.
        let e = s
            .create_approval(&request(ApprovalMode::OutOfBand, 60_000), vec![])
            .unwrap();
        s.decide_approval(
            &e.id,
            ApprovalDecision::Approve,
            "bob",
            None,
            60_000,
            vec![],
        )
        .unwrap();
        s.decide_approval(&e.id, ApprovalDecision::Revoke, "carol", None, 0, vec![])
            .unwrap();
        assert_eq!(
            s.consume_receipt(&e.id, &binding(), ConsumeAs::Approved, &intent(0), vec![])
                .unwrap(),
            Consumption::Refused(ReceiptRefusal::State(ApprovalState::Revoked))
        );
    }

    #[test]
    fn an_in_band_answer_needs_the_request_nonce() {
        let (_dir, s) = store();
        let a = s
            .create_approval(&request(ApprovalMode::InputRequired, 60_000), vec![])
            .unwrap();
        let forged = ConsumeAs::AnsweredInBand {
            by: "alice",
            nonce: Some("00000000000000000000000000000000"),
        };
        assert_eq!(
            s.consume_receipt(&a.id, &binding(), forged, &intent(0), vec![])
                .unwrap(),
            Consumption::Refused(ReceiptRefusal::Nonce)
        );
        let genuine = ConsumeAs::AnsweredInBand {
            by: "alice",
            nonce: Some(&a.nonce),
        };
        let Consumption::Consumed(record, intent_record) = s
            .consume_receipt(&a.id, &binding(), genuine, &intent(1), vec![])
            .unwrap()
        else {
            panic!("not consumed");
        };
        assert_eq!(record.decided_by.as_deref(), Some("alice"));
        assert_eq!(intent_record.approval_id.as_deref(), Some(a.id.as_str()));
        assert_eq!(intent_record.state, IntentState::Prepared);
    }

    #[test]
    fn hostile_ids_are_refused_clearly() {
        let (_dir, s) = store();
        for id in ["", "apr_", "short", "apr_'; DROP TABLE approvals; --"] {
            match s.approval(id) {
                Ok(None) => {}
                Err(e) => assert!(format!("{e:#}").contains("too short"), "{e:#}"),
                Ok(Some(r)) => panic!("{id:?} found {r:?}"),
            }
        }
        let a = s
            .create_approval(&request(ApprovalMode::OutOfBand, 60_000), vec![])
            .unwrap();
        let b = s
            .create_approval(&request(ApprovalMode::OutOfBand, 60_000), vec![])
            .unwrap();
        assert_eq!(
            s.approval(&a.id[..16]).unwrap().unwrap().id,
            a.id,
            "a unique prefix"
        );
        let shared =
            a.id.chars()
                .zip(b.id.chars())
                .take_while(|(x, y)| x == y)
                .count();
        if shared >= 12 {
            assert!(s.approval(&a.id[..shared]).is_err(), "an ambiguous prefix");
        }
    }
}
