//! Compensation: undoing a completed effect through the undo its contract declares.
//!
//! Rules:
//! - Only a `completed` intent whose capability is compensable — its contract function
//!   declares `compensable-by` and the reviewed mapping did not narrow that away — can be
//!   compensated, and only by the handles its result carried: kept with the intent when it
//!   completed ([`crate::store::IntentRecord::handles`]) and proven, with the rest of the
//!   row, by the trace (the completing event's `handles_sha256` under its MAC). A row the
//!   trace does not prove undoes nothing.
//! - The undo takes one record whose fields are handles of kinds the original's result
//!   carries, or host-supplied (the contract loader checks it, `check_undo`): each handle
//!   field takes the one kept handle of its kind (none or several: refused, naming them);
//!   host-supplied fields are the host's, as on every call.
//! - A compensation is an **ordinary call** of the undo's capability in a session of its
//!   own, so normalization, policy, a person's approval (whose summary names the intent
//!   undone, the handle and the facts its result reported: for a file, the digest it
//!   restores), its own intent and reconciliation all apply unchanged. Its intent records
//!   `compensates` under the MAC.
//! - At most one compensation of an intent is open or completed at a time (the store's
//!   unique index); a failed one may be tried again.

use std::sync::Arc;

use anyhow::{Context as _, Result, bail};
use rmcp::model::JsonObject;
use serde_json::Value;

use crate::contract::Shape;
use crate::host::Host;
use crate::pipeline::intent::prove_intent;
use crate::pipeline::references::Origin;
use crate::pipeline::{Candidate, ClientAbilities, Session};
use crate::registry::events;
use crate::store::{IntentFilter, IntentHandle, IntentRecord, IntentState, TraceEvent};

/// A compensation ready to run: the call of the undo's capability and what it undoes.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The intent being compensated.
    pub original: IntentRecord,
    /// The undo's model-facing capability (local name), in the original's mapping.
    pub capability: String,
    /// The contract function it runs (the original function's `compensable-by`).
    pub function: String,
    /// The undo's arguments: each handle field holds a token minted in the plan's session
    /// for the kept locator.
    pub arguments: JsonObject,
    /// Each handle field and the kept handle it undoes by.
    pub undoes: Vec<(String, IntentHandle)>,
    /// The mapping revision the undo runs on (the one serving now; it may be newer than
    /// the original's).
    pub revision: i64,
}

impl Plan {
    /// The candidate call of the plan in `session` (the session the plan minted its
    /// tokens in), marked as the compensation of the original intent.
    pub fn candidate(&self, session: Arc<Session>) -> Candidate {
        Candidate::new(
            session,
            self.capability.clone(),
            Some(self.arguments.clone()),
            ClientAbilities::plain(),
            None,
        )
        .compensating(self.original.intent.id.clone())
    }
}

/// Plans the compensation of intent `id` in `session`: checks every rule of the module
/// and mints the undo's handle tokens into `session`.
///
/// # Errors
/// What forbids it, as a sentence that says what to do: no such intent; not completed;
/// not proven by the trace; not compensable; the undo not mapped or not offered to the
/// session's profile; nothing kept to undo by; already compensated; the store failed.
pub fn plan(host: &Host, session: &Arc<Session>, id: &str) -> Result<Plan> {
    let store = host.registry().store();
    let Some(original) = store.intent(id)? else {
        bail!("no intent `{id}` (airlock intents list shows them)");
    };
    if original.state != IntentState::Completed {
        bail!(
            "intent {id} is {}: only a completed effect can be compensated",
            original.state.as_str()
        );
    }
    let proofs = store
        .intent_proofs(id)
        .context("reading the intent's proofs in the trace")?;
    if let Some(why) = prove_intent(&proofs, &original) {
        bail!("intent {id} is not what the trace recorded ({why}); nothing is undone by it");
    }
    if let Some(why) = prove_handles(&proofs, &original) {
        bail!("intent {id}: {why}; nothing is undone by it");
    }
    let catalog = host.catalog();
    let i = &original.intent;
    let Some(cap) = catalog
        .capability(&i.capability)
        .filter(|c| c.mapping.name == i.mapping)
    else {
        bail!(
            "capability `{}` of mapping {} does not serve on this host: load the mapping (its configuration) to compensate it",
            i.capability,
            i.mapping
        );
    };
    let contract = &cap.mapping.contract;
    let Some(undo) = contract
        .functions
        .get(&cap.function.name)
        .and_then(|f| f.undo.clone())
    else {
        bail!(
            "`{}` cannot be compensated: its contract function `{}` ({}) declares no undo (compensable-by)",
            i.capability,
            cap.function.name,
            contract.interface
        );
    };
    if !cap.semantics.compensable {
        bail!(
            "`{}` cannot be compensated: its mapping declares it not compensable",
            i.capability
        );
    }
    let Some(undo_cap) = catalog
        .capabilities
        .iter()
        .find(|c| c.mapping.name == i.mapping && c.function.name == undo)
    else {
        bail!(
            "mapping {} offers no capability for `{undo}`, the undo of `{}`: a reviewed revision of it must map `{undo}` to compensate",
            i.mapping,
            cap.function.name
        );
    };
    if !undo_cap.mapping.serves() {
        bail!(
            "mapping {} does not serve now (state {}); nothing is undone",
            i.mapping,
            undo_cap.mapping.record().state
        );
    }
    let offered = crate::pipeline::offer::offered(host, session, &ClientAbilities::plain());
    if !offered.tools.iter().any(|t| t.name == undo_cap.name) {
        bail!(
            "requester `{}` with profile `{}` is not offered `{}`: choose a profile that is (--profile)",
            session.requester().name,
            session.profile().name,
            undo_cap.name
        );
    }
    if original.handles.is_empty() {
        bail!(
            "intent {id} kept no handle to undo it by (it completed before this host kept them, or its capability was not compensable then)"
        );
    }
    let open: Vec<IntentRecord> = store
        .intents(&IntentFilter {
            compensates: Some(id.to_string()),
            limit: 16,
            ..IntentFilter::default()
        })?
        .into_iter()
        .filter(|c| c.state != IntentState::Failed)
        .collect();
    if let Some(c) = open.first() {
        bail!(
            "intent {id} is already compensated by intent {} ({}); a compensation is tried again only after it failed",
            c.intent.id,
            c.state.as_str()
        );
    }
    let Some((_, Shape::Record(fields))) = undo_cap.function.params.first() else {
        bail!("`{undo}` does not take one record (the contract loader refuses that)");
    };
    let mut undoes = Vec::new();
    for (field, shape, _) in fields {
        let Shape::Handle(kind) = shape else { continue };
        let of_kind: Vec<&IntentHandle> = original
            .handles
            .iter()
            .filter(|h| &h.kind == kind)
            .collect();
        match of_kind.as_slice() {
            [one] => undoes.push((field.clone(), (*one).clone())),
            [] => bail!(
                "`{undo}` undoes by a {kind} in `{field}`, and intent {id}'s result carried none"
            ),
            several => bail!(
                "intent {id}'s result carried {} handles of kind {kind}; `{undo}` undoes by one: call `{}` with the one to undo instead",
                several.len(),
                undo_cap.name
            ),
        }
    }
    let revision = undo_cap.mapping.record().revision;
    let origin = Origin {
        mapping: undo_cap.mapping.name.as_str().into(),
        generation: undo_cap.mapping.generation,
        revision,
    };
    let mut arguments = JsonObject::new();
    session.references().mint_all(&origin, |mint| {
        for (field, h) in &undoes {
            let token = mint(
                &h.kind,
                &h.locator,
                h.facts.clone(),
                contract.identity_facts(&h.kind),
            );
            arguments.insert(field.clone(), Value::String(token));
        }
    });
    Ok(Plan {
        capability: undo_cap.name.clone(),
        function: undo,
        arguments,
        undoes,
        revision,
        original,
    })
}

/// Why the trace does not prove `record`'s kept handles (`None`: proven): the event that
/// completed the intent (`call-outcome` or `intent-resolved` with `intent_state`
/// completed) carries `handles_sha256` of exactly what the row holds — or none, when the
/// row holds none.
pub fn prove_handles(events: &[TraceEvent], record: &IntentRecord) -> Option<String> {
    let id = record.intent.id.as_str();
    let completing: Vec<&TraceEvent> = events
        .iter()
        .filter(|e| {
            matches!(
                e.kind.as_str(),
                events::CALL_OUTCOME | events::INTENT_RESOLVED
            ) && e.payload["intent"] == id
                && e.payload["intent_state"] == "completed"
        })
        .collect();
    let [event] = completing.as_slice() else {
        return Some(format!(
            "{} events record its completion; one proves what it kept",
            completing.len()
        ));
    };
    let recorded = event.payload.get("handles_sha256").and_then(Value::as_str);
    let stored = crate::store::plans::handles_sha256(&record.handles);
    (recorded != stored.as_deref()).then(|| {
        format!(
            "the handles stored with it are not those its completion (trace seq {}) recorded",
            event.seq
        )
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::store::NewIntent;

    fn record(handles: Vec<IntentHandle>) -> IntentRecord {
        IntentRecord {
            intent: NewIntent {
                id: "int_1".into(),
                idempotency_key: "idk_1".into(),
                call_id: "call_1".into(),
                requester: "alice".into(),
                session: "s1".into(),
                capability: "write_workspace_file".into(),
                mapping: "workspace-edits".into(),
                mapping_revision: 1,
                args_digest: "c".repeat(64),
                effect_class: "reversible-mutation".into(),
                compensates: None,
            },
            approval_id: None,
            state: IntentState::Completed,
            created_ms: 1,
            updated_ms: 1,
            resolution: None,
            resolved_ms: None,
            handles,
        }
    }

    fn handle(locator: &str) -> IntentHandle {
        IntentHandle {
            kind: "change-ref".into(),
            locator: locator.into(),
            facts: json!({"path": "notes.md"}).as_object().unwrap().clone(),
        }
    }

    fn event(seq: i64, kind: &str, payload: Value) -> TraceEvent {
        TraceEvent {
            seq,
            at_ms: 1,
            kind: kind.into(),
            subject: "call_1".into(),
            payload,
            prev_hash: String::new(),
            hash: String::new(),
            key_id: None,
        }
    }

    fn completion(seq: i64, kind: &str, handles: &[IntentHandle]) -> TraceEvent {
        let mut p = json!({"intent": "int_1", "intent_state": "completed"});
        if let Some(d) = crate::store::plans::handles_sha256(handles) {
            p["handles_sha256"] = json!(d);
        }
        event(seq, kind, p)
    }

    #[test]
    fn only_the_handles_the_completion_recorded_are_proven() {
        let kept = vec![handle("idk_1")];
        let r = record(kept.clone());
        for kind in [events::CALL_OUTCOME, events::INTENT_RESOLVED] {
            assert_eq!(prove_handles(&[completion(3, kind, &kept)], &r), None);
        }
        // Another locator, another fact, one handle more or fewer: not proven.
        let mut other_fact = handle("idk_1");
        other_fact.facts.insert("path".into(), json!("other.md"));
        for stored in [
            vec![handle("idk_2")],
            vec![other_fact],
            vec![handle("idk_1"), handle("idk_1")],
            vec![],
        ] {
            let why = prove_handles(
                &[completion(3, events::CALL_OUTCOME, &kept)],
                &record(stored),
            )
            .unwrap();
            assert!(why.contains("trace seq 3"), "{why}");
        }
        // Handles the completion never recorded (a row given some afterwards).
        let why = prove_handles(&[completion(3, events::CALL_OUTCOME, &[])], &r).unwrap();
        assert!(why.contains("not those"), "{why}");
        // No completion, or two: nothing to prove them by.
        for events in [
            vec![],
            vec![
                completion(3, events::CALL_OUTCOME, &kept),
                completion(4, events::INTENT_RESOLVED, &kept),
            ],
        ] {
            let why = prove_handles(&events, &r).unwrap();
            assert!(why.contains("events record its completion"), "{why}");
        }
        // Events of other intents, other states or other kinds do not count.
        let noise = [
            event(
                1,
                events::CALL_OUTCOME,
                json!({"intent": "int_2", "intent_state": "completed"}),
            ),
            event(
                2,
                events::CALL_OUTCOME,
                json!({"intent": "int_1", "intent_state": "unknown"}),
            ),
            event(
                5,
                events::INTENT_CREATED,
                json!({"intent": "int_1", "intent_state": "completed"}),
            ),
            completion(3, events::CALL_OUTCOME, &kept),
        ];
        assert_eq!(prove_handles(&noise, &r), None);
    }
}
