//! A person's decisions, shared by every surface that takes them (`airlock approvals`,
//! `airlock intents resolve`, the console): approve, deny or revoke an approval request;
//! resolve an intent whose outcome is unknown.
//!
//! Rules: a row the trace does not prove is never decided (nor shown as decidable);
//! approving records who approved and when, and gives the receipt its lifetime from that
//! moment; the receipt still authorizes only the exact call it describes, once, while the
//! mapping revision, snapshot and policy it is bound to are unchanged. Every decision is
//! traced (`approval-decided`) in the same transaction as the row's new state. Only an
//! intent whose outcome is `unknown` (or one a stopped host left `prepared`) can be
//! resolved, once, as `completed` or `failed`, with evidence; the resolution records who
//! decided and is traced (`intent-resolved`).

use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use serde_json::json;

use crate::registry::Registry;
use crate::registry::events;
use crate::store::{
    ApprovalDecision, ApprovalRecord, ApprovalState, IntentRecord, IntentState, NewEvent,
    Resolution, ResolutionMethod,
};

/// Why the trace does not prove the row `r`, or `None` when it does
/// ([`crate::pipeline::approve::prove_receipt`], with the row's own binding and the state
/// the row claims: a pending row must have no recorded decision, an approved one the
/// approval; rows that no longer authorize anything are checked for their binding only).
///
/// # Errors
/// The store fails.
pub fn tampered(registry: &Registry, r: &ApprovalRecord, now_ms: u64) -> Result<Option<String>> {
    Ok(tampered_all(registry, std::slice::from_ref(r), now_ms)?
        .pop()
        .flatten())
}

/// [`tampered`] for each of `rows` (a page of the inbox), with one count of the trace's
/// missing events for the whole page instead of one per row: the events missing after the
/// page's oldest proof are at least those missing after any other, so when none are,
/// every row's trace is whole; only when some are is each row counted on its own. (One
/// count per row costs the events since each request — millions for a request pending
/// under load.)
///
/// # Errors
/// The store fails.
pub fn tampered_all(
    registry: &Registry,
    rows: &[ApprovalRecord],
    now_ms: u64,
) -> Result<Vec<Option<String>>> {
    use crate::pipeline::approve::{ReceiptProof, prove_receipt};
    let store = registry.store();
    let mut out = Vec::with_capacity(rows.len());
    // Rows proven and still authorizing something: their proofs' first seq.
    let mut to_count = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        let proofs = store.approval_proofs(&r.id)?;
        let in_band = r.state_at(now_ms) != ApprovalState::Approved;
        out.push(
            match prove_receipt(&proofs, Some(r), &r.id, &r.binding, in_band, now_ms) {
                ReceiptProof::Tampered(why) => Some(why),
                ReceiptProof::Refused(_) => None,
                ReceiptProof::Proven
                    if matches!(
                        r.state_at(now_ms),
                        ApprovalState::Approved | ApprovalState::Pending
                    ) =>
                {
                    to_count.push((i, proofs));
                    None
                }
                ReceiptProof::Proven => None,
            },
        );
    }
    let oldest = to_count
        .iter()
        .filter_map(|(_, p)| p.iter().map(|e| e.seq).min())
        .min();
    if let Some(oldest) = oldest
        && store.trace_missing_from(oldest)? > 0
    {
        for (i, proofs) in &to_count {
            out[*i] = crate::pipeline::approve::proofs_not_whole(store, proofs)?;
        }
    }
    Ok(out)
}

/// Refuses to act on a row the trace does not prove ([`tampered`]): a person must not
/// approve (or be shown as approvable) facts someone wrote into the store.
///
/// # Errors
/// The row is tampered (the error says why and what to run), or the store fails.
pub fn refuse_tampered(registry: &Registry, r: &ApprovalRecord) -> Result<()> {
    match tampered(registry, r, crate::store::now_ms())? {
        None => Ok(()),
        Some(why) => anyhow::bail!(
            "approval `{}` does not match the trace (edited in the store?), so it cannot be decided: {why}; `airlock trace verify` checks the rest",
            r.id
        ),
    }
}

/// Records a person's decision on approval `id`.
///
/// # Errors
/// Unknown id, or the approval is not in a state the decision applies to.
pub fn decide(
    registry: &Registry,
    id: &str,
    decision: ApprovalDecision,
    by: &str,
    reason: Option<&str>,
    ttl: Duration,
) -> Result<ApprovalRecord> {
    let store = registry.store();
    let record = store.approval(id)?.with_context(|| {
        format!("no approval `{id}` in this state folder (`airlock approvals list` shows them)")
    })?;
    refuse_tampered(registry, &record)?;
    let word = match decision {
        ApprovalDecision::Approve => "approved",
        ApprovalDecision::Deny => "denied",
        ApprovalDecision::Revoke => "revoked",
    };
    let event = NewEvent::new(
        events::APPROVAL_DECIDED,
        record.id.clone(),
        json!({
            "approval": record.id,
            "decision": word,
            "mode": crate::store::ApprovalMode::OutOfBand,
            "by": by,
            "reason": reason,
            "stage": if decision == ApprovalDecision::Approve { Some("approved") } else { None },
            // The receipt's lifetime from now, under the MAC (pipeline::approve::prove_receipt).
            "ttl_ms": u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
        }),
    );
    store.decide_approval(
        &record.id,
        decision,
        by,
        reason,
        u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
        vec![event],
    )
}

/// Why the trace does not prove the intent row `r`
/// ([`crate::pipeline::intent::prove_intent`]), or `None` when it does.
///
/// # Errors
/// The store fails.
pub fn intent_tampered(registry: &Registry, r: &IntentRecord) -> Result<Option<String>> {
    let proofs = registry.store().intent_proofs(&r.intent.id)?;
    Ok(crate::pipeline::intent::prove_intent(&proofs, r))
}

/// A person resolves an unknown intent as `state` (`completed`: it happened; `failed`:
/// it did not) with `evidence` (what they saw upstream; at most 2 000 characters kept),
/// once; traced (`intent-resolved`) with `by`.
///
/// # Errors
/// Unknown id; the intent has a definite outcome already; `state` is not completed or
/// failed; no evidence.
pub fn resolve_intent(
    registry: &Registry,
    id: &str,
    state: IntentState,
    by: &str,
    evidence: &str,
) -> Result<IntentRecord> {
    if !matches!(state, IntentState::Completed | IntentState::Failed) {
        bail!("an intent is resolved as `completed` (it happened) or `failed` (it did not happen)");
    }
    if evidence.trim().is_empty() {
        bail!("evidence is required: say what you saw upstream that decides it");
    }
    let store = registry.store();
    let record = store
        .intent(id)?
        .with_context(|| format!("no intent `{id}` (`airlock intents list` shows them)"))?;
    if let Some(why) = intent_tampered(registry, &record)? {
        bail!(
            "intent `{}` does not match the trace (edited in the store?), so it cannot be resolved: {why}; `airlock trace verify` checks the rest",
            record.intent.id
        );
    }
    let evidence: String = evidence.chars().take(2000).collect();
    let resolution = Resolution {
        handles: Vec::new(),
        state,
        method: ResolutionMethod::Person,
        by: by.to_string(),
        evidence: json!({"statement": evidence}),
    };
    let event = crate::pipeline::reconcile::resolved_event(&record, &resolution);
    store.resolve_intent(&record.intent.id, &resolution, vec![event])
}
