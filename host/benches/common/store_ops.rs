//! Store operations shared by the benches that measure them (`pipeline` on SQLite, `store`
//! on SQLite and PostgreSQL): the same rows and events, whatever the store.
#![allow(dead_code)]

use airlock::store::{
    ApprovalDecision, ApprovalMode, AttemptState, ConsumeAs, Consumption, IntentState, NewApproval,
    NewEvent, NewIntent, ReceiptBinding, Store,
};
use serde_json::{Value, json};

/// The binding every bench receipt carries (one requester, session and call).
pub fn binding() -> ReceiptBinding {
    ReceiptBinding {
        requester: "alice".into(),
        session: "ses_0".into(),
        capability: "deliver_artifact".into(),
        mapping: "outbox-delivery".into(),
        mapping_revision: 1,
        snapshot_digest: "a".repeat(64),
        policy_digest: "b".repeat(64),
        args_digest: "c".repeat(64),
        artifact_digest: Some("d".repeat(64)),
    }
}

/// `count` approvals of `binding`, each asked for and approved (not timed); their ids.
///
/// # Panics
/// On any store error.
pub fn approved(store: &dyn Store, binding: &ReceiptBinding, count: usize) -> Vec<String> {
    let new = NewApproval {
        binding: binding.clone(),
        profile: "publisher".into(),
        mode: ApprovalMode::OutOfBand,
        summary: "Approve `deliver_artifact`".into(),
        ttl_ms: 900_000,
    };
    (0..count)
        .map(|_| {
            let a = store.create_approval(&new, vec![]).unwrap();
            store
                .decide_approval(
                    &a.id,
                    ApprovalDecision::Approve,
                    "bob",
                    None,
                    900_000,
                    vec![],
                )
                .unwrap()
                .id
        })
        .collect()
}

/// The `i`th bench intent (ids and keys unique per `i`).
pub fn intent(i: usize) -> NewIntent {
    NewIntent {
        compensates: None,
        id: format!("int_{i:032x}"),
        idempotency_key: format!("idk_{i:032x}"),
        call_id: format!("call_{i}"),
        requester: "alice".into(),
        session: "ses_0".into(),
        capability: "deliver_artifact".into(),
        mapping: "outbox-delivery".into(),
        mapping_revision: 1,
        args_digest: "c".repeat(64),
        effect_class: "external-effect".into(),
    }
}

/// Consumes approval `id` (of `binding`) for the `i`th intent in one transaction with
/// its two events, as a delivery call does.
///
/// # Panics
/// When the receipt is not consumed.
pub fn consume(store: &dyn Store, binding: &ReceiptBinding, id: &str, i: usize) {
    let intent = intent(i);
    let event = |kind: &'static str| {
        NewEvent::new(
            kind,
            &intent.call_id,
            json!({"call": intent.call_id, "approval": id, "intent": intent.id}),
        )
    };
    let r = store
        .consume_receipt(
            id,
            binding,
            ConsumeAs::Approved,
            &intent,
            vec![event("receipt-consumed"), event("intent-created")],
        )
        .unwrap();
    assert!(matches!(r, Consumption::Consumed(..)), "{r:?}");
}

/// The four attempt writes of one delivery (sent, acknowledged, observed, verified) on
/// intent `id`, each committed on its own as the call makes it true.
pub fn attempt_writes(store: &dyn Store, id: &str) {
    store.attempt_sending(id, 1).unwrap();
    store.attempt_answered(id, 1, "7", true).unwrap();
    store
        .advance_attempt(id, 1, AttemptState::ResultObserved)
        .unwrap();
    store
        .advance_attempt(id, 1, AttemptState::ReceiptVerified)
        .unwrap();
}

/// A whole effect call's intent bookkeeping for the `i`th intent: create, the four
/// attempt writes, completed.
pub fn effect_call(store: &dyn Store, i: usize) {
    let record = intent(i);
    store.create_intent(&record, vec![]).unwrap();
    attempt_writes(store, &record.id);
    store
        .set_intent_state(&record.id, IntentState::Completed, vec![])
        .unwrap();
}

/// The four trace events of one read call (`call-candidate`, `call-decided`,
/// `upstream-request`, `call-outcome`), payloads shaped as the pipeline writes them.
pub fn call_events(call: &str) -> Vec<NewEvent> {
    let p = |kind: &'static str, extra: Value| {
        let mut o = extra.as_object().cloned().unwrap_or_default();
        o.insert("call".into(), json!(call));
        NewEvent::new(kind, call, Value::Object(o))
    };
    vec![
        p(
            "call-candidate",
            json!({"stage": "requested", "session": "ses_0123456789abcdef0123456789abcdef", "requester": "alice", "profile": "research", "capability": "search_sources", "arguments_sha256": "a".repeat(64), "arguments_bytes": 40, "offered_digest": "b".repeat(64), "protocol": "2025-11-25"}),
        ),
        p(
            "call-decided",
            json!({"capability": "search_sources", "mapping": "source-library", "revision": 1, "decision": {"verdict": "allow"}, "policy_digest": "c".repeat(64), "determining": ["reads"], "errors": 0, "args_digest": "d".repeat(64), "effect_class": "read"}),
        ),
        p(
            "upstream-request",
            json!({"connection_id": "conn-0123456789ab", "connection": "notes", "method": "tools/call", "target": "search_notes", "request_id": "12", "result_sha256": "e".repeat(64), "bytes": 1200, "at": "2026-12-01T10:00:00.000Z"}),
        ),
        p(
            "call-outcome",
            json!({"outcome": "completed", "stage": "executed", "content_sha256": "f".repeat(64), "upstream_requests": 1, "session": "ses_0", "elapsed_us": 120, "stages_us": {"normalize": 5, "authorize": 8}}),
        ),
    ]
}
