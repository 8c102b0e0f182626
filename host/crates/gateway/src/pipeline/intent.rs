//! Stage 5, intent: one stable effect id (and idempotency key) for the call, and the
//! receipt consumed with it.
//!
//! Rules (DESIGN.md §5.5):
//! - Every call gets an intent id (`int_…`; a read's is recorded in its outcome event). A
//!   call whose function has an effect, or whose contract takes a host-supplied
//!   `idempotency-key`, also gets an idempotency key (`idk_` + 32 hex), a durable intent
//!   row and an `intent-created` event, written before anything runs.
//! - A receipt is consumed in the same store transaction that creates the intent, with the
//!   call's trace so far: of concurrent attempts on one receipt exactly one wins. The
//!   receipt must match the call as it stands now — requester, session, capability, mapping
//!   revision, snapshot, the policy digest in force now, normalized arguments, artifact
//!   digest — or it is refused and the refusal, naming what changed, is traced.

use serde_json::json;
use sha2::Digest as _;

use crate::host::Host;
use crate::pipeline::approve::{Receipt, ReceiptProof, prove_receipt};
use crate::pipeline::authorize::{Authorized, binding};
use crate::pipeline::{Call, Category, Outcome};
use crate::registry::events;
use crate::store::approvals::random_id;
use crate::store::{
    ConsumeAs, Consumption, IntentRecord, IntentState, NewEvent, NewIntent, ReceiptBinding,
    ReceiptRefusal, TraceEvent,
};

/// An authorized call with its intent.
pub struct Intended {
    authorized: Authorized,
    intent_id: String,
    idempotency_key: Option<String>,
}

impl Intended {
    /// The authorized call.
    pub fn authorized(&self) -> &Authorized {
        &self.authorized
    }

    /// The intent id.
    pub fn intent_id(&self) -> &str {
        &self.intent_id
    }

    /// The idempotency key, when the call has one.
    pub fn idempotency_key(&self) -> Option<&str> {
        self.idempotency_key.as_deref()
    }
}

/// Whether a shape has a host-supplied field anywhere.
fn takes_key(shape: &crate::contract::Shape) -> bool {
    use crate::contract::Shape;
    match shape {
        Shape::HostSupplied(_) => true,
        Shape::Record(fields) => fields.iter().any(|(_, s, _)| takes_key(s)),
        Shape::Option(s) | Shape::List(s) => takes_key(s),
        Shape::Tuple(items) => items.iter().any(takes_key),
        _ => false,
    }
}

/// Creates the call's intent, consuming its receipt if it has one (see the module rules).
///
/// # Errors
/// The receipt could not be consumed, or the store failed.
pub(super) fn intent(
    host: &Host,
    call: &mut Call,
    authorized: Authorized,
) -> Result<Intended, Outcome> {
    let n = authorized.normalized();
    let cap = n.capability();
    let durable = cap.semantics.class.has_effect()
        || takes_key(&cap.function.params[0].1)
        || authorized.receipt().is_some();
    let intent_id = random_id("int_", 16);
    let idempotency_key = durable.then(|| random_id("idk_", 16));
    let session = &n.candidate().session;
    call.intent = Some(intent_id.clone());
    if !durable {
        // A read's intent is only an id: the outcome event carries it.
        return Ok(Intended {
            authorized,
            intent_id,
            idempotency_key,
        });
    }
    let compensates = n.candidate().compensates().map(str::to_string);
    let mut created = json!({
        "intent": intent_id,
        "capability": cap.name,
        "effect_class": cap.semantics.class,
        "idempotency_key_sha256": idempotency_key.as_ref().map(|k| hex::encode(sha2::Sha256::digest(k.as_bytes()))),
        "receipt": authorized.receipt().map(|r| r.approval()),
        // The rest of the stored row, under the MAC: the proof of it (prove_intent).
        "call": call.id,
        "requester": session.requester().name,
        "session": session.id_text(),
        "mapping": cap.mapping.name,
        "mapping_revision": n.revision(),
        "args_digest": n.args_digest(),
        // Which host delivers it: no other host reconciles it while this one lives.
        "host": host.instance(),
        // The state this event gives the intent (prove_intent): every later change of
        // state is an event naming the intent with its `intent_state`.
        "intent_state": IntentState::Prepared,
    });
    if let Some(original) = &compensates {
        // Under the MAC with the rest of the row (prove_intent); absent on every other
        // intent, so their events are unchanged.
        created["compensates"] = json!(original);
    }
    call.event(events::INTENT_CREATED, created);
    let record = NewIntent {
        compensates,
        id: intent_id.clone(),
        idempotency_key: idempotency_key.clone().unwrap_or_default(),
        call_id: call.id.clone(),
        requester: session.requester().name.clone(),
        session: session.id_text().to_string(),
        capability: cap.name.clone(),
        mapping: cap.mapping.name.clone(),
        mapping_revision: n.revision(),
        args_digest: n.args_digest().to_string(),
        effect_class: cap.semantics.class.as_str().to_string(),
    };
    let store = host.registry().store();
    let Some(receipt) = authorized.receipt().cloned() else {
        let so_far = call.take_events();
        return match store.create_intent(&record, so_far.clone()) {
            Ok(()) => {
                call.durable_intent = Some(intent_id.clone());
                Ok(Intended {
                    authorized,
                    intent_id,
                    idempotency_key,
                })
            }
            Err(e) => {
                call.events = so_far;
                tracing::error!("recording the intent failed: {e:#}");
                Err(Outcome::refused(
                    Category::Unavailable,
                    "the host could not record the call's intent; nothing was done",
                ))
            }
        };
    };
    // Bound to the policy in force now: a policy changed while the person was being asked
    // invalidates the answer.
    let bound = binding(n, host.policy().current().digest());
    let how = match receipt.answered_in_band() {
        Some((by, nonce)) => ConsumeAs::AnsweredInBand { by, nonce },
        None => ConsumeAs::Approved,
    };
    let proof = stored_receipt_proof(store, &receipt, &bound);
    let refused_by_trace = match proof {
        Ok(ReceiptProof::Proven) => None,
        Ok(ReceiptProof::Refused(refusal)) => Some(refusal),
        Ok(ReceiptProof::Tampered(why)) => {
            return Err(tampered_receipt(call, &receipt, &why));
        }
        Err(e) => {
            return Err(tampered_receipt(
                call,
                &receipt,
                &format!("its proofs could not be read: {e:#}"),
            ));
        }
    };
    let so_far = call.take_events();
    let mut events = so_far.clone();
    events.push(NewEvent::new(
        events::RECEIPT_CONSUMED,
        call.id.clone(),
        json!({
            "stage": "approved",
            "call": call.id,
            "approval": receipt.approval(),
            "mode": receipt.mode(),
            "intent": intent_id,
        }),
    ));
    let consumed = match refused_by_trace {
        Some(refusal) => Ok(Consumption::Refused(refusal)),
        None => store.consume_receipt(receipt.approval(), &bound, how, &record, events),
    };
    match consumed {
        Ok(Consumption::Consumed(..)) => {
            call.durable_intent = Some(intent_id.clone());
            tracing::info!(approval = receipt.approval(), intent = %intent_id, "receipt consumed");
            Ok(Intended {
                authorized,
                intent_id,
                idempotency_key,
            })
        }
        Ok(Consumption::Refused(refusal)) => {
            // Nothing was written: the call's events so far wait for its outcome.
            call.events = so_far;
            call.event(
                events::RECEIPT_REFUSED,
                json!({"approval": receipt.approval(), "mode": receipt.mode(), "refusal": refusal}),
            );
            tracing::info!(approval = receipt.approval(), ?refusal, "receipt refused");
            Err(refusal_outcome(refusal))
        }
        Err(e) => {
            call.events = so_far;
            tracing::error!("consuming the receipt failed: {e:#}");
            Err(Outcome::refused(
                Category::Unavailable,
                "the host could not use the approval; nothing was done",
            ))
        }
    }
}

/// Whether the MACed trace proves `receipt` for a call bound to `bound`, read before the
/// row. The row is only the trace's cache: a receipt the MACed trace does not prove (a
/// row set to approved, rebound or given a longer life by hand) is refused before
/// anything is consumed; one the trace itself refuses is not handed to the store at all.
/// The trace is read before the row: a consumption committed between the two reads
/// (another call, on this host or another) then shows as a spent row the trace does not
/// yet record — refused as used — never as a usable row the trace contradicts.
///
/// # Errors
/// The store cannot be read.
fn stored_receipt_proof(
    store: &dyn crate::store::Store,
    receipt: &Receipt,
    bound: &ReceiptBinding,
) -> anyhow::Result<ReceiptProof> {
    let proofs = store.approval_proofs(receipt.approval())?;
    let record = store.approval(receipt.approval())?;
    let proof = prove_receipt(
        &proofs,
        record.as_ref(),
        receipt.approval(),
        bound,
        receipt.answered_in_band().is_some(),
        crate::store::now_ms(),
    );
    if proof != ReceiptProof::Proven {
        return Ok(proof);
    }
    Ok(
        match crate::pipeline::approve::proofs_not_whole(store, &proofs)? {
            Some(why) => ReceiptProof::Tampered(why),
            None => proof,
        },
    )
}

/// What the model is told when its receipt was refused: a changed binding is a changed
/// state; a denied or revoked approval forbids; an expired, unusable or unknown one asks
/// anew.
fn refusal_outcome(refusal: ReceiptRefusal) -> Outcome {
    match refusal {
        ReceiptRefusal::Changed(fields) => Outcome::refused(
            Category::StateChanged,
            format!(
                "what this call was approved for changed since ({}); make the call again to ask anew",
                fields.join(", ")
            ),
        ),
        ReceiptRefusal::Expired => Outcome::refused(
            Category::ApprovalRequired,
            "the approval expired before it was used; make the call again to ask anew",
        ),
        ReceiptRefusal::State(state) => match state {
            crate::store::ApprovalState::Denied | crate::store::ApprovalState::Revoked => {
                Outcome::refused(
                    Category::Forbidden,
                    format!("the approval was {state}; nothing was done"),
                )
            }
            _ => Outcome::refused(
                Category::ApprovalRequired,
                format!(
                    "the approval is {state}, so it cannot authorize this call; make the call again to ask anew"
                ),
            ),
        },
        ReceiptRefusal::Nonce | ReceiptRefusal::NotFound => Outcome::refused(
            Category::ApprovalRequired,
            "the approval sent with this call is not valid; make the call again without it to ask anew",
        ),
    }
}

/// Refuses a receipt the trace does not prove ([`ReceiptProof::Tampered`]): logged at
/// ERROR, traced as `receipt-refused` (`tampered`, with why), and told to the model as
/// forbidden with nothing done.
fn tampered_receipt(call: &mut Call, receipt: &Receipt, why: &str) -> Outcome {
    tracing::error!(
        approval = receipt.approval(),
        "refusing a receipt the trace does not prove (edited in the store?): {why}"
    );
    call.event(
        events::RECEIPT_REFUSED,
        json!({"approval": receipt.approval(), "mode": receipt.mode(), "refusal": "tampered", "detail": why}),
    );
    Outcome::refused(
        Category::Forbidden,
        format!(
            "the host's record of approval {} does not match its trace, so it is not used; nothing was done (an operator can inspect it with `airlock approvals show` and `airlock trace verify`)",
            receipt.approval()
        ),
    )
}

/// Whether the trace proves the facts of the stored intent `record`: `None` when it does,
/// else why not, in words. `events` are its MACed proofs
/// ([`crate::store::Trace::intent_proofs`]). The rule: exactly one `intent-created` event
/// names the intent, and it recorded the row's call, requester, session, capability,
/// mapping and revision, effect class, arguments digest, receipt, and the sha256 of its
/// idempotency key (`null` for an intent without one). An intent row inserted or edited by
/// hand is therefore never reconciled (no query is asked, nothing is retried) and cannot be
/// resolved by a person.
///
/// The row's state is proven too, for intents created since schema 9 (their
/// `intent-created` event carries `intent_state`): [`traced_state`] of the events must
/// agree with it — open (`prepared` or `unknown`), `completed` or `failed`. A row set to
/// `completed` by hand while the trace leaves it unknown is therefore refused like an
/// edited one. Older intents are proven by their creation only.
///
/// Intents created before these facts entered the event (schema 7 and older) are not
/// proven.
pub fn prove_intent(events: &[TraceEvent], record: &IntentRecord) -> Option<String> {
    let i = &record.intent;
    let created: Vec<&TraceEvent> = events
        .iter()
        .filter(|e| e.kind == events::INTENT_CREATED && e.payload["intent"] == i.id.as_str())
        .collect();
    let event = match created.as_slice() {
        [one] => *one,
        [] => {
            return Some(format!(
                "no MACed intent-created event records intent {}",
                i.id
            ));
        }
        several => {
            return Some(format!(
                "{} intent-created events record intent {}; one intent has one",
                several.len(),
                i.id
            ));
        }
    };
    let p = &event.payload;
    let key_sha256 = (!i.idempotency_key.is_empty())
        .then(|| hex::encode(sha2::Sha256::digest(i.idempotency_key.as_bytes())));
    let checks: [(&str, bool); 11] = [
        ("call", p["call"] == i.call_id.as_str()),
        ("requester", p["requester"] == i.requester.as_str()),
        ("session", p["session"] == i.session.as_str()),
        ("capability", p["capability"] == i.capability.as_str()),
        ("mapping", p["mapping"] == i.mapping.as_str()),
        (
            "mapping revision",
            p["mapping_revision"] == i.mapping_revision,
        ),
        ("effect class", p["effect_class"] == i.effect_class.as_str()),
        ("arguments", p["args_digest"] == i.args_digest.as_str()),
        ("receipt", p["receipt"] == json!(record.approval_id)),
        ("compensates", p["compensates"] == json!(i.compensates)),
        (
            "idempotency key",
            p["idempotency_key_sha256"] == json!(key_sha256),
        ),
    ];
    let differ: Vec<&str> = checks
        .into_iter()
        .filter(|(_, same)| !same)
        .map(|(name, _)| name)
        .collect();
    if !differ.is_empty() {
        return Some(format!(
            "the row differs from what the intent-created event (seq {}) recorded: {}",
            event.seq,
            differ.join(", ")
        ));
    }
    // Created before schema 9: its state changes carry no `intent_state`.
    p.get("intent_state")?;
    let traced = traced_state(events, &i.id);
    let open = |s: IntentState| matches!(s, IntentState::Prepared | IntentState::Unknown);
    let agree = traced.0 == record.state || (open(traced.0) && open(record.state));
    (!agree).then(|| match traced.1 {
        Some(seq) => format!(
            "the row says {} but the trace says {} (seq {seq})",
            record.state.as_str(),
            traced.0.as_str()
        ),
        None => format!(
            "the row says {} but the trace says {}: no event after intent-created (seq {}) changed its state",
            record.state.as_str(),
            traced.0.as_str(),
            event.seq
        ),
    })
}

/// The state the MACed `events` (an intent's proofs, [`crate::store::Trace::intent_proofs`],
/// in seq order) give intent `id`, with the seq of the event that gave it (`None`: only
/// its creation). An intent starts `prepared`; each later event naming it with an
/// `intent_state` moves it, until one says `completed` or `failed` — the first final
/// state wins, as in the store, which changes only an open row.
pub fn traced_state(events: &[TraceEvent], id: &str) -> (IntentState, Option<i64>) {
    let mut state = (IntentState::Prepared, None);
    for e in events {
        if e.kind == events::INTENT_CREATED || e.payload["intent"] != id {
            continue;
        }
        let Some(next) = e.payload["intent_state"]
            .as_str()
            .and_then(IntentState::parse)
        else {
            continue;
        };
        state = (next, Some(e.seq));
        if matches!(next, IntentState::Completed | IntentState::Failed) {
            break;
        }
    }
    state
}

#[cfg(test)]
mod tests {
    //! [`prove_intent`] on hand-made proofs: the branches the host never writes (two
    //! `intent-created` events for one intent) are still decided by the trace.
    use super::*;
    use crate::store::IntentState;

    fn record() -> IntentRecord {
        IntentRecord {
            intent: NewIntent {
                compensates: None,
                id: "int_1".into(),
                idempotency_key: "idk_1".into(),
                call_id: "call_1".into(),
                requester: "alice".into(),
                session: "s1".into(),
                capability: "deliver_artifact".into(),
                mapping: "outbox-delivery".into(),
                mapping_revision: 1,
                args_digest: "c".repeat(64),
                effect_class: "external".into(),
            },
            approval_id: None,
            state: IntentState::Prepared,
            created_ms: 1,
            updated_ms: 1,
            resolution: None,
            resolved_ms: None,
            handles: Vec::new(),
        }
    }

    fn created(seq: i64, r: &IntentRecord) -> TraceEvent {
        let i = &r.intent;
        TraceEvent {
            seq,
            at_ms: 1,
            kind: events::INTENT_CREATED.into(),
            subject: i.call_id.clone(),
            payload: json!({
                "intent": i.id, "call": i.call_id, "requester": i.requester,
                "session": i.session, "capability": i.capability, "mapping": i.mapping,
                "mapping_revision": i.mapping_revision, "effect_class": i.effect_class,
                "args_digest": i.args_digest, "receipt": null,
                "idempotency_key_sha256": hex::encode(sha2::Sha256::digest(i.idempotency_key.as_bytes())),
            }),
            prev_hash: String::new(),
            hash: String::new(),
            key_id: None,
        }
    }

    #[test]
    fn one_matching_event_proves_the_intent_and_two_prove_nothing() {
        let r = record();
        assert_eq!(prove_intent(&[created(1, &r)], &r), None);
        let why = prove_intent(&[created(1, &r), created(2, &r)], &r).unwrap();
        assert!(why.contains("2 intent-created events"), "{why}");
        let mut edited = r.clone();
        edited.intent.effect_class = "read".into();
        let why = prove_intent(&[created(1, &r)], &edited).unwrap();
        assert!(why.contains("effect class"), "{why}");
        // What a compensation undoes is part of the row the trace proves, both ways.
        let mut compensation = r.clone();
        compensation.intent.compensates = Some("int_0".into());
        let why = prove_intent(&[created(1, &r)], &compensation).unwrap();
        assert!(why.contains("compensates"), "{why}");
        let mut traced = created(1, &compensation);
        traced.payload["compensates"] = json!("int_0");
        assert_eq!(prove_intent(&[traced.clone()], &compensation), None);
        let why = prove_intent(&[traced], &r).unwrap();
        assert!(why.contains("compensates"), "{why}");
    }

    /// `created` as written since schema 9, with `intent_state`.
    fn created_v9(seq: i64, r: &IntentRecord) -> TraceEvent {
        let mut e = created(seq, r);
        e.payload["intent_state"] = json!("prepared");
        e
    }

    fn moved(seq: i64, kind: &str, id: &str, state: &str) -> TraceEvent {
        TraceEvent {
            seq,
            at_ms: 1,
            kind: kind.into(),
            subject: "call_1".into(),
            payload: json!({"intent": id, "intent_state": state}),
            prev_hash: String::new(),
            hash: String::new(),
            key_id: None,
        }
    }

    #[test]
    fn the_first_final_state_the_trace_records_is_the_one_the_row_must_hold() {
        let r = record();
        let open = [created_v9(1, &r)];
        let unknown = [
            created_v9(1, &r),
            moved(4, events::CALL_OUTCOME, "int_1", "unknown"),
        ];
        let resolved = [
            created_v9(1, &r),
            moved(4, events::CALL_OUTCOME, "int_1", "unknown"),
            moved(6, events::INTENT_RESOLVED, "int_1", "failed"),
            // A later event cannot reopen or change a final state.
            moved(9, events::INTENT_HELD, "int_1", "unknown"),
            moved(10, events::INTENT_RESOLVED, "int_1", "completed"),
        ];
        assert_eq!(traced_state(&open, "int_1"), (IntentState::Prepared, None));
        assert_eq!(
            traced_state(&unknown, "int_1"),
            (IntentState::Unknown, Some(4))
        );
        assert_eq!(
            traced_state(&resolved, "int_1"),
            (IntentState::Failed, Some(6))
        );
        // Another intent's events move nothing.
        let other = [
            created_v9(1, &r),
            moved(2, events::CALL_OUTCOME, "int_2", "completed"),
        ];
        assert_eq!(traced_state(&other, "int_1").0, IntentState::Prepared);

        let with = |state: IntentState| IntentRecord { state, ..r.clone() };
        // Open agrees with open, prepared or unknown.
        assert_eq!(prove_intent(&open, &with(IntentState::Unknown)), None);
        assert_eq!(prove_intent(&unknown, &with(IntentState::Prepared)), None);
        assert_eq!(prove_intent(&resolved, &with(IntentState::Failed)), None);
        // A row closed by hand while the trace leaves it open.
        let why = prove_intent(&unknown, &with(IntentState::Completed)).unwrap();
        assert!(
            why.contains("the row says completed but the trace says unknown (seq 4)"),
            "{why}"
        );
        let why = prove_intent(&open, &with(IntentState::Failed)).unwrap();
        assert!(why.contains("no event after intent-created"), "{why}");
        // A closed row reopened or flipped by hand.
        assert!(prove_intent(&resolved, &with(IntentState::Unknown)).is_some());
        assert!(prove_intent(&resolved, &with(IntentState::Completed)).is_some());
        // Created before schema 9: proven by its creation only.
        assert_eq!(
            prove_intent(&[created(1, &r)], &with(IntentState::Completed)),
            None
        );
    }
}
