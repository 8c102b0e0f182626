//! Stage 8, outcome: what the call produced, in terms the model may see and the trace keeps.
//!
//! Rules:
//! - `completed | refused(category) | unknown`. Categories are bounded ([`Category`]); an
//!   adapter's or server's words appear only quoted, clipped, as untrusted detail.
//! - A non-read call that was interrupted (deadline, trap, memory, fuel, host failure) is
//!   **unknown**, never failed: it may have reached the upstream, and it is not retried.
//! - Handles the adapter returned become tokens in the session's reference table, bound to
//!   the mapping load and revision that produced them, with the scalar fields of the record
//!   they came in as facts (an artifact's `sha256` and `bytes`, a destination's `label`).
//! - Each upstream request the adapter made is one `upstream-request` event (protocol
//!   layer) linked to the call; payloads stay digests and safe summaries. Each content
//!   item of its answer is an observation ([`crate::store::observations`]), named in that
//!   event by id and committed with the call's events.
//! - An upstream answer the bridge refused (over the mapping's output budget, or from a
//!   connection that broke JSON-RPC) is one `upstream-refused` event naming the budget,
//!   never the content, and decides the outcome whatever the adapter made of it:
//!   `result exceeds budget` (or `unavailable` for a degraded connection) for a read;
//!   `unknown` for a capability with an external effect, whose upstream may have acted
//!   before its answer was refused.

use serde_json::{Map, Value, json};
use sha2::Digest as _;

use crate::contract::{self, Shape};
use crate::pipeline::Call;
use crate::pipeline::execute::Executed;
use crate::pipeline::references::Origin;
use crate::registry::events;
use crate::runtime::{CallFailure, Observation, Refused, RefusedAnswer};
use crate::store::{AttemptState, IntentHandle, NewObservation, observation_id};

/// A bounded category toward the model (DESIGN.md §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Category {
    /// The request cannot be served as asked.
    InvalidRequest,
    /// Not permitted.
    Forbidden,
    /// Could not be served now (connection, adapter failure).
    Unavailable,
    /// Too many concurrent calls.
    RateLimited,
    /// Stopped before it finished (a read: nothing changed).
    Interrupted,
    /// The outcome is not known (a non-read interrupted after it may have acted).
    Unknown,
    /// Policy permits nothing like it in this session.
    CapabilityUnavailable,
    /// Policy forbids where it reaches.
    OutsideScope,
    /// The mapping, snapshot, policy or a reference changed since the call was decided.
    StateChanged,
    /// A person must approve this exact call first.
    ApprovalRequired,
    /// Allowed when decided, no longer allowed at execution.
    PolicyNoLongerPermits,
    /// An upstream answer did not fit the mapping's output budget (bytes, items, media
    /// types) and was discarded before the adapter saw it.
    ResultExceedsBudget,
}

impl Category {
    /// The words the model sees.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidRequest => "invalid request",
            Self::Forbidden => "forbidden",
            Self::Unavailable => "unavailable",
            Self::RateLimited => "rate limited",
            Self::Interrupted => "interrupted",
            Self::Unknown => "unknown",
            Self::CapabilityUnavailable => "capability unavailable for this task",
            Self::OutsideScope => "outside approved scope",
            Self::StateChanged => "state changed",
            Self::ApprovalRequired => "approval required",
            Self::PolicyNoLongerPermits => "policy no longer permits",
            Self::ResultExceedsBudget => "result exceeds budget",
        }
    }
}

/// A completed call's result.
#[derive(Debug, Clone)]
pub struct Completed {
    /// The capability (local name).
    pub capability: String,
    /// The mapping that served it.
    pub mapping: String,
    /// The contract result as JSON, handles already tokens; `None` for a function without
    /// a result.
    pub value: Option<Value>,
    /// The upstream requests behind it, for provenance.
    pub observations: Vec<Observation>,
    /// sha256 of `value` as JSON text.
    pub content_sha256: String,
    /// Set when the result was not the call's own answer but what reconciliation found
    /// after that answer was lost: the intent and how it was found.
    pub reconciled: Option<Value>,
    /// The handles of the result, with their adapter locators, kept with the intent when
    /// the capability is compensable ([`crate::pipeline::compensate`]); empty otherwise.
    pub handles: Vec<IntentHandle>,
}

/// How a call ended, as the front renders it.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// The adapter returned a result.
    Completed(Box<Completed>),
    /// Refused or failed, with a bounded category and safe detail (a tool result with
    /// `isError: true`).
    Refused {
        /// The category.
        category: Category,
        /// Safe detail for the model.
        detail: String,
    },
    /// Not a call this session can make at all (an unknown tool): a protocol error,
    /// `-32602`. Arguments that do not convert are a [`Category::InvalidRequest`]
    /// refusal instead (a tool result the model reads, SEP-1303).
    Invalid {
        /// The message.
        message: String,
    },
    /// A person must approve this call out of band; repeating the same call afterwards
    /// runs it once.
    ApprovalRequired {
        /// The approval request's id.
        approval: String,
        /// What the person approves.
        summary: String,
    },
    /// A 2026-07-28 client must ask the person and retry (MRTR).
    InputRequired {
        /// The approval request's id.
        approval: String,
        /// The elicitation message.
        message: String,
        /// The sealed, single-use `requestState`.
        request_state: String,
    },
}

impl Outcome {
    /// A refusal.
    pub fn refused(category: Category, detail: impl Into<String>) -> Self {
        Self::Refused {
            category,
            detail: detail.into(),
        }
    }

    /// The outcome's name and its refusal category (empty unless refused), as the trace
    /// and the metrics name them.
    pub fn names(&self) -> (&'static str, &'static str) {
        match self {
            Self::Completed(_) => ("completed", ""),
            Self::Refused { category, .. } if *category == Category::Unknown => {
                ("unknown", category.as_str())
            }
            Self::Refused { category, .. } => ("refused", category.as_str()),
            Self::Invalid { .. } => ("invalid", ""),
            Self::ApprovalRequired { .. } => ("approval-required", ""),
            Self::InputRequired { .. } => ("input-required", ""),
        }
    }

    /// The safe summary the trace keeps.
    pub fn trace_summary(&self) -> Value {
        match self {
            Self::Completed(c) => json!({
                "outcome": "completed",
                "stage": "executed",
                "content_sha256": c.content_sha256,
                "upstream_requests": c.observations.len(),
            }),
            Self::Refused { category, .. } => json!({
                "outcome": if *category == Category::Unknown { "unknown" } else { "refused" },
                "category": category,
            }),
            Self::Invalid { .. } => json!({"outcome": "invalid"}),
            Self::ApprovalRequired { approval, .. } => {
                json!({"outcome": "approval-required", "approval": approval})
            }
            Self::InputRequired { approval, .. } => {
                json!({"outcome": "input-required", "approval": approval})
            }
        }
    }
}

/// Turns what the adapter did into the call's outcome.
pub(super) fn outcome(call: &mut Call, executed: Executed) -> Outcome {
    let (ready, result, attempt) = executed.into_parts();
    let summary = attempt.as_ref().map(|a| a.summary());
    // An effect whose attempt never sent anything certainly did not happen.
    let may_have_acted = summary.is_none_or(|s| s.may_have_acted());
    let n = ready.intended().authorized().normalized();
    let parts = Parts {
        capability: n.capability(),
        revision: n.revision(),
        result,
    };
    let mapping = &parts.capability.mapping;
    let connection_id = &mapping.connection.revision.connection_id;
    record_upstream(call, connection_id, &mapping.name, &parts.result);
    // An effect whose attempt never sent anything certainly did not happen.
    let effectful = parts.capability.semantics.class.has_effect() && may_have_acted;
    if let Some(first) = parts.result.refused.first() {
        return refused_answer(first, effectful);
    }
    let val = match parts.result.result {
        Ok(val) => val,
        Err(failure) => {
            call.event(
                events::CALL_CONTAINED,
                json!({
                    "capability": parts.capability.name,
                    "mapping": mapping.name,
                    "revision": parts.revision,
                    "failure": failure.kind(),
                    "session": call.session.id_text(),
                }),
            );
            call.contained = Some(failure.kind());
            return contained(&mapping.name, failure, effectful);
        }
    };
    let Some(result_shape) = &parts.capability.function.result else {
        return Outcome::Completed(Box::new(Completed {
            capability: parts.capability.name.clone(),
            mapping: mapping.name.clone(),
            value: None,
            observations: parts.result.observations,
            content_sha256: hex::encode(sha2::Sha256::digest(b"null")),
            reconciled: None,
            handles: Vec::new(),
        }));
    };
    let mut json =
        match contract::val_to_json(
            result_shape,
            &val,
            &mut |_, locator| Ok(locator.to_string()),
        ) {
            Ok(j) => j,
            Err(e) => {
                tracing::error!(mapping = %mapping.name, "adapter result did not convert: {e:#}");
                return Outcome::refused(
                    Category::Unknown,
                    "the adapter returned a malformed result",
                );
            }
        };
    // What a compensation would undo by, before the locators become tokens.
    let handles = if parts.capability.semantics.compensable {
        kept_handles(result_shape, &json, &mapping.contract)
    } else {
        Vec::new()
    };
    let origin = Origin {
        mapping: mapping.name.as_str().into(),
        generation: mapping.generation,
        revision: parts.revision,
    };
    call.session.references().mint_all(&origin, |mint| {
        swap_handles(result_shape, &mut json, &mapping.contract, mint)
    });
    let (ok, value) = match json {
        Value::Object(mut o) if o.len() == 1 && o.contains_key("ok") => {
            (true, o.remove("ok").unwrap_or_default())
        }
        Value::Object(mut o) if o.len() == 1 && o.contains_key("err") => {
            (false, o.remove("err").unwrap_or_default())
        }
        other => (true, other),
    };
    if !ok {
        if let Some(s) = summary
            && s.may_have_acted()
            && !s.all_answered()
        {
            // The adapter reports a failure, but a request it sent got no answer: the
            // upstream may have acted on it.
            return unknown_outcome("a request to the upstream was sent and no answer came back");
        }
        return contract_error(&value);
    }
    if let Some(a) = &attempt {
        // The adapter's contract result says the effect was done.
        a.advance(AttemptState::ResultObserved);
        if let Err(why) = verify_receipt(n, &value) {
            tracing::warn!(mapping = %mapping.name, "receipt verification failed: {why}");
            return unknown_outcome(&format!(
                "the upstream's receipt does not match what was approved ({why})"
            ));
        }
        a.advance(AttemptState::ReceiptVerified);
    }
    let content_sha256 = hex::encode(sha2::Sha256::digest(value.to_string().as_bytes()));
    Outcome::Completed(Box::new(Completed {
        capability: parts.capability.name.clone(),
        mapping: mapping.name.clone(),
        value: Some(value),
        observations: parts.result.observations,
        content_sha256,
        reconciled: None,
        handles,
    }))
}

/// Traces what the adapter's upstream requests did (one `upstream-request` event per
/// answered request, with the observations it made, one `upstream-refused` per request the
/// host refused) and logs the adapter's own log lines and stderr at DEBUG.
fn record_upstream(
    call: &mut Call,
    connection_id: &str,
    mapping: &str,
    result: &crate::runtime::CallOutcome,
) {
    for o in &result.observations {
        let ids = observe(call, connection_id, o);
        call.event(
            events::UPSTREAM_REQUEST,
            json!({
                "connection_id": connection_id,
                "connection": o.connection,
                "snapshot": o.snapshot_digest,
                "method": o.method,
                "target": o.target.chars().take(256).collect::<String>(),
                "request_id": o.request_id,
                "result_sha256": o.result_sha256,
                "bytes": o.result_bytes,
                "at": o.retrieved_at,
                "observations": ids,
            }),
        );
    }
    for r in &result.refused {
        let mut payload = json!({
            "connection_id": connection_id,
            "connection": r.connection,
            "method": r.method,
            "target": r.target.chars().take(256).collect::<String>(),
            "request_id": r.request_id,
        });
        if let Some(o) = payload.as_object_mut() {
            match &r.why {
                Refused::Budget(budget) => {
                    o.insert("refused".into(), json!(budget.kind()));
                    o.insert("budget".into(), json!(budget));
                }
                Refused::Degraded(_) => {
                    o.insert("refused".into(), json!("degraded-connection"));
                }
            }
        }
        call.event(events::UPSTREAM_REFUSED, payload);
    }
    for line in &result.logs {
        tracing::debug!(mapping = %mapping, "adapter log: {line}");
    }
    if !result.stderr.is_empty() {
        let shown = &result.stderr[..result.stderr.len().min(2000)];
        tracing::debug!(mapping = %mapping, bytes = result.stderr.len(), "adapter stderr: {}", String::from_utf8_lossy(shown));
    }
}

/// The outcome of a call whose answer was lost and whose effect reconciliation decided:
/// `found` (JSON, adapter locators in place) is the ok value of `shape` (a
/// `result<T, _>`), found by `method` (`query`: the contract's query reported it;
/// `retry`: a retry with the same idempotency key returned it). Handles are minted as for
/// the call's own result. `None` when `shape` is not a result with an ok type.
pub(super) fn reconciled(
    call: &Call,
    mapping: &std::sync::Arc<crate::registry::live::ActiveMapping>,
    revision: i64,
    intent: &crate::store::IntentRecord,
    mut found: Value,
    shape: Option<&Shape>,
    method: &str,
) -> Option<Outcome> {
    let Some(Shape::Result {
        ok: Some(inner), ..
    }) = shape
    else {
        return None;
    };
    // The resolution kept the handles already (reconcile::resolution_handles).
    let origin = Origin {
        mapping: mapping.name.as_str().into(),
        generation: mapping.generation,
        revision,
    };
    call.session.references().mint_all(&origin, |mint| {
        swap_handles(inner, &mut found, &mapping.contract, mint)
    });
    let content_sha256 = hex::encode(sha2::Sha256::digest(found.to_string().as_bytes()));
    let note = match method {
        "retry" => {
            "the call's own answer was lost; the host sent it again with the same idempotency key (the capability is idempotent) and this is the upstream's answer. Nothing was done twice."
        }
        _ => {
            "the call's own answer was lost; the host asked the upstream with the call's idempotency key and it reports this record. Nothing was sent twice."
        }
    };
    Some(Outcome::Completed(Box::new(Completed {
        capability: intent.intent.capability.clone(),
        mapping: mapping.name.clone(),
        value: Some(found),
        observations: Vec::new(),
        content_sha256,
        reconciled: Some(json!({
            "intent": intent.intent.id,
            "method": method,
            "note": note,
        })),
        handles: Vec::new(),
    })))
}

struct Parts<'a> {
    capability: &'a crate::registry::live::Capability,
    revision: i64,
    result: crate::runtime::CallOutcome,
}

/// The words of an unknown outcome: what happened, and that the model must not retry.
pub(crate) const DO_NOT_RETRY: &str = "Do not call it again: the host does not retry it and reconciles it (through the contract's query where it can, otherwise an operator decides with `airlock intents resolve`).";

/// An `unknown` outcome: `why` the host cannot tell whether the effect happened.
pub(crate) fn unknown_outcome(why: &str) -> Outcome {
    Outcome::refused(
        Category::Unknown,
        format!(
            "the outcome is unknown: {why}, so the effect may or may not have happened. {DO_NOT_RETRY}"
        ),
    )
}

/// Checks a completed effect's result against what was approved: the result field the
/// function `confirms` (e.g. a delivery's `artifact-sha256`) must equal the `sha256` of the
/// content handle the call named.
///
/// # Errors
/// What does not match.
fn verify_receipt(n: &crate::pipeline::normalize::Normalized, value: &Value) -> Result<(), String> {
    let Some(field) = n.capability().function.confirms.as_deref() else {
        return Ok(());
    };
    let approved = n
        .content()
        .and_then(|f| f.get("sha256"))
        .and_then(Value::as_str);
    receipt_matches(approved, field, value)
}

/// [`verify_receipt`] on the approved content digest `approved` and the result's `field`.
fn receipt_matches(approved: Option<&str>, field: &str, value: &Value) -> Result<(), String> {
    let reported = value.get(field).and_then(Value::as_str);
    match (approved, reported) {
        (Some(a), Some(r)) if a != r => {
            Err(format!("it reports {field} {r}, the call was for {a}"))
        }
        _ => Ok(()),
    }
}

/// Queues one observation per item of `o` with the call's trace; returns their ids.
fn observe(call: &mut Call, connection_id: &str, o: &Observation) -> Vec<String> {
    let arguments = o.arguments_sha256.as_deref().unwrap_or_default();
    o.items
        .iter()
        .map(|item| {
            let id = observation_id(
                connection_id,
                o.method,
                &o.target,
                arguments,
                &item.key,
                &item.sha256,
            );
            call.observations.push(NewObservation {
                id: id.clone(),
                connection_id: connection_id.to_string(),
                connection: o.connection.clone(),
                snapshot_digest: o.snapshot_digest.clone(),
                method: o.method.to_string(),
                target: o.target.clone(),
                arguments_sha256: arguments.to_string(),
                item: item.key.clone(),
                kind: item.kind.to_string(),
                media_type: item.media_type.clone(),
                sha256: item.sha256.clone(),
                bytes: item.bytes,
                request_id: o.request_id.clone(),
                call_id: call.id.clone(),
                retrieved_ms: o.retrieved_ms,
            });
            id
        })
        .collect()
}

/// The outcome of a call one of whose upstream answers was refused (see the module rules).
fn refused_answer(r: &RefusedAnswer, effectful: bool) -> Outcome {
    let what = match &r.why {
        Refused::Budget(budget) => format!("{}; it was discarded unread", budget.for_model()),
        Refused::Degraded(_) => "the upstream connection broke the protocol during the call and is degraded; it serves no calls until the host restarts it".to_string(),
    };
    if effectful {
        return unknown_outcome(&format!("{what}, after the upstream may have acted"));
    }
    match r.why {
        Refused::Budget(_) => Outcome::refused(Category::ResultExceedsBudget, what),
        Refused::Degraded(_) => Outcome::refused(Category::Unavailable, what),
    }
}

/// A contained adapter call, as a bounded outcome.
fn contained(mapping: &str, failure: CallFailure, effectful: bool) -> Outcome {
    let unknown = |why: &str| unknown_outcome(&format!("{why} after it may have acted upstream"));
    match failure {
        CallFailure::Busy(b) if b.queue_full => Outcome::refused(
            Category::RateLimited,
            format!(
                "the adapter already runs its maximum of {} concurrent calls and its queue is full; try again in about {} ms",
                b.max_concurrent_calls,
                b.queue_timeout_ms.max(100)
            ),
        ),
        CallFailure::Busy(b) => Outcome::refused(
            Category::RateLimited,
            format!(
                "the adapter ran its maximum of {} concurrent calls for the {} ms this call waited; try again in about {} ms",
                b.max_concurrent_calls,
                b.waited.as_millis(),
                b.queue_timeout_ms.max(100)
            ),
        ),
        CallFailure::DeadlineExceeded(d) if effectful => unknown(&format!(
            "the adapter did not finish within its {} ms deadline",
            d.as_millis()
        )),
        CallFailure::DeadlineExceeded(d) => Outcome::refused(
            Category::Interrupted,
            format!(
                "the adapter did not finish within its {} ms deadline",
                d.as_millis()
            ),
        ),
        CallFailure::FuelExhausted if effectful => {
            unknown("the adapter used up its instruction budget")
        }
        CallFailure::FuelExhausted => Outcome::refused(
            Category::Interrupted,
            "the adapter used up its instruction budget (fuel)",
        ),
        CallFailure::MemoryLimit(bytes) if effectful => unknown(&format!(
            "the adapter exceeded its memory limit of {} MiB",
            bytes >> 20
        )),
        CallFailure::MemoryLimit(bytes) => Outcome::refused(
            Category::Unavailable,
            format!(
                "the adapter exceeded its memory limit of {} MiB",
                bytes >> 20
            ),
        ),
        CallFailure::OutputFlood(bytes) => Outcome::refused(
            Category::Unavailable,
            format!("the adapter wrote more than its {bytes}-byte output budget"),
        ),
        CallFailure::ResultTooLarge(bytes) => Outcome::refused(
            Category::Unavailable,
            format!("the adapter's result exceeded its {bytes}-byte budget"),
        ),
        CallFailure::Trapped(detail) => {
            tracing::warn!(mapping = %mapping, "adapter trapped: {detail}");
            if effectful {
                unknown("the adapter failed")
            } else {
                Outcome::refused(
                    Category::Unavailable,
                    "the adapter failed while handling the request",
                )
            }
        }
        CallFailure::Cancelled if effectful => {
            unknown("the call was cancelled while it was running")
        }
        CallFailure::Cancelled => Outcome::refused(
            Category::Interrupted,
            "the call was cancelled; nothing changed",
        ),
        CallFailure::Host(detail) => {
            tracing::error!(mapping = %mapping, "host failure: {detail}");
            Outcome::refused(Category::Unknown, "the host could not run the adapter")
        }
    }
}

/// Maps a contract error (JSON of `contract-error`) onto a bounded category, quoting any
/// adapter-supplied text as untrusted detail.
fn contract_error(value: &Value) -> Outcome {
    let (case, payload) = match value {
        Value::String(case) => (case.as_str(), None),
        Value::Object(o) => match o.iter().next() {
            Some((case, payload)) => (case.as_str(), payload.as_str()),
            None => ("unknown", None),
        },
        _ => ("unknown", None),
    };
    let category = match case {
        "invalid-request" | "not-found" | "conflict" => Category::InvalidRequest,
        "unavailable" | "upstream-failed" => Category::Unavailable,
        _ => Category::Unknown,
    };
    let detail = match payload {
        Some(text) => {
            let clipped: String = text.chars().take(500).collect();
            format!("{case}; the adapter reported (untrusted text): {clipped:?}")
        }
        None => case.to_string(),
    };
    Outcome::Refused { category, detail }
}

/// Longest fact string kept with a reference.
const MAX_FACT_CHARS: usize = 256;

/// Mints a token for (kind, locator, facts, the names of the facts that identify the
/// object: [`contract::Contract::identity_facts`]).
pub(crate) type Mint<'a> = dyn FnMut(&str, &str, Map<String, Value>, &[String]) -> String + 'a;

/// The handles in `value` (of `shape`, a type of `contract`, handles holding adapter
/// locators), each with its kind, locator and the facts [`swap_handles`] would mint it
/// with: what an intent keeps to be compensated later.
pub(crate) fn kept_handles(
    shape: &Shape,
    value: &Value,
    contract: &contract::Contract,
) -> Vec<IntentHandle> {
    let mut kept = Vec::new();
    let mut copy = value.clone();
    swap_handles(
        shape,
        &mut copy,
        contract,
        &mut |kind, locator, facts, _| {
            kept.push(IntentHandle {
                kind: kind.to_string(),
                locator: locator.to_string(),
                facts,
            });
            locator.to_string()
        },
    );
    kept
}

/// Replaces every handle in `value` (of `shape`, a type of `contract`, handles
/// holding adapter locators) with `mint(kind, locator, facts, identity)`, where facts are
/// the scalar fields of the record the handle is a field of and identity is what the
/// contract declares identifies an object of that kind.
pub(crate) fn swap_handles(
    shape: &Shape,
    value: &mut Value,
    contract: &contract::Contract,
    mint: &mut Mint<'_>,
) {
    match (shape, value) {
        (Shape::Handle(kind), Value::String(s)) => {
            let token = mint(kind, s, Map::new(), contract.identity_facts(kind));
            *s = token;
        }
        (Shape::Record(fields), Value::Object(obj)) => {
            let facts: Map<String, Value> = fields
                .iter()
                .filter(|(_, s, _)| contract::is_fact(s))
                .filter_map(|(name, _, _)| {
                    let v = obj.get(name)?;
                    match v {
                        Value::String(text) => Some((
                            name.clone(),
                            Value::String(text.chars().take(MAX_FACT_CHARS).collect()),
                        )),
                        Value::Number(_) | Value::Bool(_) => Some((name.clone(), v.clone())),
                        _ => None,
                    }
                })
                .collect();
            for (name, field_shape, _) in fields {
                let Some(v) = obj.get_mut(name) else { continue };
                match (field_shape, v) {
                    (Shape::Handle(kind), Value::String(s)) => {
                        let identity = contract.identity_facts(kind);
                        let token = mint(kind, s, facts.clone(), identity);
                        *s = token;
                    }
                    (s, v) => swap_handles(s, v, contract, mint),
                }
            }
        }
        (Shape::List(item), Value::Array(items)) => {
            for v in items {
                swap_handles(item, v, contract, mint);
            }
        }
        (Shape::Option(inner), v) if !v.is_null() => swap_handles(inner, v, contract, mint),
        (Shape::Tuple(shapes), Value::Array(items)) => {
            for (s, v) in shapes.iter().zip(items) {
                swap_handles(s, v, contract, mint);
            }
        }
        (Shape::Result { ok, err }, Value::Object(obj)) => {
            if let (Some(s), Some(v)) = (ok, obj.get_mut("ok")) {
                swap_handles(s, v, contract, mint);
            }
            if let (Some(s), Some(v)) = (err, obj.get_mut("err")) {
                swap_handles(s, v, contract, mint);
            }
        }
        (Shape::Variant(cases), Value::Object(obj)) => {
            for (case, payload) in cases {
                if let (Some(s), Some(v)) = (payload, obj.get_mut(case)) {
                    swap_handles(s, v, contract, mint);
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Facts that describe one result never make its handle another object: a
    /// destination reported by two deliveries of different artifacts keeps its token, and
    /// so does a source reported by two searches with different snippets; an artifact
    /// whose declared identity (`sha256`) changed gets a new one.
    #[test]
    fn only_a_declared_identity_fact_replaces_a_reference() {
        use crate::pipeline::references::{Origin, ReferenceTable, ResolveError};
        let table = ReferenceTable::default();
        let origin = Origin {
            mapping: "m".into(),
            generation: 1,
            revision: 1,
        };
        let swap = |interface: &str, function: &str, mut value: Value| {
            let c = contract::load_contract(interface).unwrap();
            let Some(Shape::Result { ok: Some(ok), .. }) = &c.functions[function].result else {
                panic!("{function} returns a result");
            };
            table.mint_all(&origin, |mint| swap_handles(ok, &mut value, &c, mint));
            value
        };
        const DELIVERY: &str = "airlock:contracts/artifact-delivery@0.2.0";
        const RETRIEVAL: &str = "airlock:contracts/source-retrieval@0.1.0";
        let delivery = |sha: char| {
            swap(
                DELIVERY,
                "deliver",
                json!({
                    "delivery-id": "d",
                    "artifact-sha256": sha.to_string().repeat(64),
                    "destination": "team",
                    "delivered-at": "2026-12-05T09:00:00Z",
                    "replayed": false,
                }),
            )
        };
        let (first, second) = (delivery('a'), delivery('b'));
        assert_eq!(first["destination"], second["destination"]);
        let hits = |snippet: &str| {
            swap(
                RETRIEVAL,
                "search",
                json!([{"reference": "wal", "title": "WAL", "version": "3", "snippet": snippet}]),
            )
        };
        let (first, second) = (hits("…checkpoint…"), hits("…wal…"));
        assert_eq!(first[0]["reference"], second[0]["reference"]);
        let prepared = |sha: char| {
            swap(
                DELIVERY,
                "prepare",
                json!({
                    "artifact": "file-1",
                    "sha256": sha.to_string().repeat(64),
                    "bytes": 3,
                    "title": "t",
                    "media-type": "text/plain",
                }),
            )
        };
        let (old, new) = (prepared('a'), prepared('b'));
        assert_ne!(
            old["artifact"], new["artifact"],
            "other content, another artifact"
        );
        assert_eq!(
            table.resolve(old["artifact"].as_str().unwrap(), "artifact-ref", &origin),
            Err(ResolveError::NotValid),
            "what the old reference named is gone"
        );
    }

    #[test]
    fn a_receipt_for_another_artifact_than_approved_does_not_verify() {
        let a = "a".repeat(64);
        let b = "b".repeat(64);
        assert!(
            receipt_matches(Some(&a), "artifact-sha256", &json!({"artifact-sha256": a})).is_ok()
        );
        let e = receipt_matches(Some(&a), "artifact-sha256", &json!({"artifact-sha256": b}))
            .unwrap_err();
        assert!(e.contains(&b) && e.contains(&a), "{e}");
        // Nothing to compare: a result that names no artifact, or a call without one.
        assert!(receipt_matches(Some(&a), "artifact-sha256", &json!({"delivery-id": "d"})).is_ok());
        assert!(receipt_matches(None, "artifact-sha256", &json!({"artifact-sha256": b})).is_ok());
    }
}
