//! Stage 4, approve: a person approves a deterministic description of the exact
//! consequence, and the approval becomes a receipt.
//!
//! Rules (DESIGN.md §5.4):
//! - **The person approves facts the host derived**, never the model's prose: the
//!   capability, its mapping and revision, its effect class, the artifact (title, media
//!   type, size, sha256) and the destination a handle names, the normalized-arguments
//!   digest. Upstream-reported text (titles, labels) is shown escaped and clipped.
//! - **How the person is asked follows the client**:
//!   - a 2025-11-25 client that declared elicitation gets `elicitation/create` (form mode:
//!     one boolean `approve`) within the call; accept with `approve: true` is a receipt,
//!     anything else is a recorded denial;
//!   - a 2026-07-28 client (stateless; servers send it no requests) that declared
//!     elicitation gets an `input_required` result with the same elicitation as an input
//!     request and a `requestState` sealed by rmcp's `RequestStateCodec` (HMAC-SHA256, a
//!     key private to this host process) over the approval id and nonce, bound as
//!     associated data to requester, session, profile, capability and the normalized-
//!     arguments digest, with the approval's TTL. Its retry carries the answer; a tampered,
//!     foreign or expired state fails closed, and a replayed one finds its approval
//!     consumed;
//!   - any other client gets a tool error naming the approval request; a person approves it
//!     with `airlock approvals approve ID`, and the same call (same normalized arguments)
//!     then runs once.
//! - A receipt is not consumed here: [`crate::pipeline::intent`] consumes it in the
//!   transaction that creates the intent.

use std::time::Duration;

use rmcp::model::SealOptions;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sha2::Digest as _;

use crate::contract::Shape;
use crate::host::Host;
use crate::pipeline::authorize::{Authorized, PendingApproval};
use crate::pipeline::candidate::{Asker, ElicitAnswer, Retry};
use crate::pipeline::normalize::Normalized;
use crate::pipeline::{Call, Category, Outcome};
use crate::registry::events;
use crate::store::{
    ApprovalDecision, ApprovalMode, ApprovalRecord, ApprovalState, NewApproval, NewEvent,
    ReceiptBinding, ReceiptRefusal, TraceEvent,
};

/// The key of the one input request an approval asks for.
pub const INPUT_KEY: &str = "approval";

/// The form field the person sets to approve.
pub const APPROVE_FIELD: &str = "approve";

/// A person's approval, ready to be consumed with the intent.
#[derive(Debug, Clone)]
pub struct Receipt {
    approval: String,
    mode: ApprovalMode,
    answered_in_band: Option<(String, Option<String>)>,
}

impl Receipt {
    /// The approval id.
    pub fn approval(&self) -> &str {
        &self.approval
    }

    /// How the person was asked.
    pub fn mode(&self) -> ApprovalMode {
        self.mode
    }

    /// For an answer given at the client: who answered and the nonce the request state
    /// carried (MRTR), else `None` (an approved receipt).
    pub fn answered_in_band(&self) -> Option<(&str, Option<&str>)> {
        self.answered_in_band
            .as_ref()
            .map(|(by, nonce)| (by.as_str(), nonce.as_deref()))
    }
}

/// What the sealed `requestState` holds.
#[derive(Serialize, Deserialize)]
struct SealedState {
    approval: String,
    nonce: String,
}

/// The associated data a `requestState` is bound to.
fn associated_data(n: &Normalized) -> Vec<u8> {
    let s = &n.candidate().session;
    format!(
        "airlock/approval/v1\n{}\n{}\n{}\n{}\n{}",
        s.requester().name,
        s.id_text(),
        s.profile().name,
        n.capability().name,
        n.args_digest()
    )
    .into_bytes()
}

/// The JSON Schema of the approval form: one required boolean.
pub fn approval_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            APPROVE_FIELD: {
                "type": "boolean",
                "title": "Approve this call",
                "description": "true runs the call exactly as described, once; false refuses it",
            }
        },
        "required": [APPROVE_FIELD],
    })
}

/// `text` quoted and escaped (Rust's `{:?}`: control and direction characters escaped);
/// longer than [`QUOTED_ARGUMENT_CHARS`] characters, its start, then `…` with its length
/// and sha256, so that two long texts with one start never look alike.
fn quoted(text: &str) -> String {
    let count = text.chars().count();
    if count <= QUOTED_ARGUMENT_CHARS {
        return format!("{text:?}");
    }
    let clipped: String = text.chars().take(QUOTED_ARGUMENT_CHARS).collect();
    format!(
        "{clipped:?}… ({count} characters, sha256 {})",
        hex::encode(sha2::Sha256::digest(text.as_bytes()))
    )
}

/// The deterministic description of what approving `n` lets happen: the capability, its
/// mapping revision and effect class (`external-effect`: "cannot be recalled"), then each
/// handle the arguments name as `Kind "locator" (fact value, ...)` with the facts the result
/// that minted it reported (an artifact's title, media type and sha256; a change's path and
/// the digests before and after, which is what an undo restores), then the other arguments
/// (`argument_lines`), then the arguments' digest.
pub fn summarize(n: &Normalized) -> String {
    let cap = n.capability();
    let class = cap.semantics.class;
    let mut lines = vec![format!(
        "Approve `{}` (mapping {}, revision {}): {}{}.",
        cap.name,
        cap.mapping.name,
        n.revision(),
        class.as_str().replace('-', " "),
        if class == crate::contract::EffectClass::ExternalEffect {
            ", which cannot be recalled once done"
        } else {
            ""
        }
    )];
    if let Some(original) = n.candidate().compensates() {
        lines.push(format!(
            "It compensates intent {original}: it undoes that completed effect."
        ));
    }
    // Each handle the call names, by its kind, its locator and the facts its result
    // reported (a title, a digest, a size...): what the person approves the call to act
    // on, for any contract (no kind is named here).
    for h in n.handles() {
        let kind = h
            .kind
            .strip_suffix(crate::contract::HANDLE_SUFFIX)
            .unwrap_or(&h.kind);
        let mut name = kind.replace('-', " ");
        if let Some(first) = name.get(..1) {
            name = first.to_uppercase() + &name[1..];
        }
        let facts: Vec<String> = h
            .resolved
            .facts
            .iter()
            .map(|(k, v)| match v {
                Value::String(t) => format!("{k} {}", quoted(t)),
                other => format!("{k} {other}"),
            })
            .collect();
        lines.push(format!(
            "{name} {}{}.",
            quoted(&h.resolved.locator),
            if facts.is_empty() {
                String::new()
            } else {
                format!(" ({})", facts.join(", "))
            }
        ));
    }
    if let Some(args) = argument_lines(n) {
        lines.push(args);
    }
    lines.push(format!("Arguments digest sha256 {}.", n.args_digest()));
    lines.join("\n")
}

/// Longest string argument the summary quotes whole, in characters; a longer one (or one
/// of several lines) is named by its size and sha256.
const QUOTED_ARGUMENT_CHARS: usize = 80;

/// Most items of a list, or fields of a structured value, the summary shows one by one; a
/// larger one is named by its size and sha256.
const QUOTED_LIST_ITEMS: usize = 16;

/// How deep the summary shows structured values (a list of records is depth 2); deeper
/// ones are named by their size and sha256.
const SHOWN_DEPTH: usize = 2;

/// The model's arguments that are neither handles (listed with their facts) nor
/// host-supplied, in the request record's order, as `Arguments: name "text", name 3,
/// files ["a.md", "b.md"], edits [{old-text "a", new-text "b"}], content 24 bytes sha256
/// HEX.`: a short one-line string quoted (escaped), a number or boolean as is, a short list
/// or record of such values item by item (two levels deep), anything longer by its size and
/// the sha256 of its bytes (of its JSON text when structured), so a person can compare it
/// with what the upstream reports afterwards. `None` when there is none.
fn argument_lines(n: &Normalized) -> Option<String> {
    let cap = n.capability();
    let Some((_, Shape::Record(fields))) = cap.function.params.first() else {
        return None;
    };
    let args = &n.candidate().arguments;
    let shown: Vec<String> = fields
        .iter()
        .filter(|(_, s, _)| !matches!(s, Shape::Handle(_) | Shape::HostSupplied(_)))
        .filter_map(|(name, shape, _)| {
            Some(format!(
                "{name} {}",
                shown_value(args.get(name)?, Some(shape), 0)
            ))
        })
        .collect();
    (!shown.is_empty()).then(|| format!("Arguments: {}.", shown.join(", ")))
}

/// One argument value as [`argument_lines`] shows it, `depth` levels inside the arguments;
/// a record's fields in the order its `shape` declares them (whatever order the model sent).
fn shown_value(v: &Value, shape: Option<&Shape>, depth: usize) -> String {
    let digest = |bytes: &[u8]| hex::encode(sha2::Sha256::digest(bytes));
    let shape = match shape {
        Some(Shape::Option(inner)) => Some(&**inner),
        other => other,
    };
    match v {
        Value::String(t)
            if t.chars().count() <= QUOTED_ARGUMENT_CHARS && !t.contains(['\n', '\r']) =>
        {
            quoted(t)
        }
        Value::String(t) => format!("{} bytes sha256 {}", t.len(), digest(t.as_bytes())),
        Value::Number(_) | Value::Bool(_) | Value::Null => v.to_string(),
        Value::Array(items) if depth < SHOWN_DEPTH && items.len() <= QUOTED_LIST_ITEMS => {
            let inner = match shape {
                Some(Shape::List(inner)) => Some(&**inner),
                _ => None,
            };
            let shown: Vec<String> = items
                .iter()
                .map(|i| shown_value(i, inner, depth + 1))
                .collect();
            format!("[{}]", shown.join(", "))
        }
        Value::Object(fields) if depth < SHOWN_DEPTH && fields.len() <= QUOTED_LIST_ITEMS => {
            let declared: Vec<(&str, Option<&Shape>)> = match shape {
                Some(Shape::Record(declared)) => declared
                    .iter()
                    .map(|(name, s, _)| (name.as_str(), Some(s)))
                    .collect(),
                _ => Vec::new(),
            };
            // Declared fields first, in their order; anything else after, as sent.
            let ordered = declared
                .iter()
                .filter_map(|(name, s)| Some((*name, fields.get(*name)?, *s)))
                .chain(
                    fields
                        .iter()
                        .filter(|(k, _)| !declared.iter().any(|(name, _)| name == k))
                        .map(|(k, f)| (k.as_str(), f, None)),
                );
            let shown: Vec<String> = ordered
                .map(|(k, f, s)| {
                    // Record fields are WIT names; anything else is quoted.
                    let plain =
                        !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
                    let key = if plain { k.to_owned() } else { quoted(k) };
                    format!("{key} {}", shown_value(f, s, depth + 1))
                })
                .collect();
            format!("{{{}}}", shown.join(", "))
        }
        other => {
            let text = other.to_string();
            format!(
                "{} bytes of JSON sha256 {}",
                text.len(),
                digest(text.as_bytes())
            )
        }
    }
}

/// Gets a person's approval for `pending` (see the module rules), in the order they
/// apply: the answer a retry carries ([`retry_answer`]), else an approval already made or
/// still pending for this very binding ([`existing_approval`]), else a new request
/// ([`ask`]).
///
/// # Errors
/// The outcome to return instead: approval required (out of band), input required
/// (MRTR), declined, or an invalid request state.
pub(super) async fn approve(
    host: &Host,
    call: &mut Call,
    pending: PendingApproval,
    asker: &dyn Asker,
) -> Result<Authorized, Outcome> {
    let n = pending.normalized();
    let by_client = format!("{} (at the client)", n.candidate().session.requester().name);
    let receipt = if let Some(retry) = &n.candidate().retry {
        retry_answer(host, call, n, retry, by_client)?
    } else if let Some(receipt) = existing_approval(host, call, pending.binding())? {
        receipt
    } else {
        ask(host, call, &pending, asker, by_client).await?
    };
    Ok(Authorized::approved(pending, receipt))
}

/// The retry of an `input_required` call: the person answered at the client. Its
/// request state must open under the host's key for this very call; the answer must be
/// `accept` with `approve = true`.
///
/// # Errors
/// The state does not open (absent, altered, from another call, expired): approval
/// required, traced as a refused receipt. Any other answer: the person's refusal
/// ([`refuse_answer`]).
fn retry_answer(
    host: &Host,
    call: &mut Call,
    n: &Normalized,
    retry: &Retry,
    by_client: String,
) -> Result<Receipt, Outcome> {
    let opened = retry.request_state.as_deref().map(|state| {
        host.request_state()
            .open_json_with::<SealedState>(state, &associated_data(n))
    });
    let sealed = match opened {
        Some(Ok(s)) => s,
        other => {
            let why = match other {
                None => "absent".to_string(),
                Some(Err(e)) => e.to_string(),
                Some(Ok(_)) => unreachable!(),
            };
            call.event(
                events::RECEIPT_REFUSED,
                json!({"mode": ApprovalMode::InputRequired, "refusal": "request-state", "detail": why}),
            );
            return Err(Outcome::refused(
                Category::ApprovalRequired,
                "the approval state sent with this call is not valid (altered, from another call, or expired); make the call again without it to ask anew",
            ));
        }
    };
    let answer = retry.input_responses.get(INPUT_KEY);
    let action = answer.and_then(|a| a.get("action")).and_then(Value::as_str);
    let approved = answer
        .and_then(|a| a.get("content"))
        .and_then(|c| c.get(APPROVE_FIELD))
        .and_then(Value::as_bool)
        == Some(true);
    if action == Some("accept") && approved {
        return Ok(Receipt {
            approval: sealed.approval,
            mode: ApprovalMode::InputRequired,
            answered_in_band: Some((by_client, Some(sealed.nonce))),
        });
    }
    let reason = match action {
        Some("accept") => "answered with approve = false",
        Some("decline") => "declined",
        Some("cancel") => "cancelled",
        _ => "no answer in the retry",
    };
    Err(refuse_answer(
        host,
        call,
        &sealed.approval,
        ApprovalMode::InputRequired,
        &by_client,
        reason,
    ))
}

/// An approval made out of band for this very `binding` (its receipt), or one still
/// pending (approval required, the same request). `None`: ask anew — there is none, or
/// the one found is in another state or bound to changed fields (traced as a refused
/// receipt naming the fields).
///
/// # Errors
/// A pending out-of-band request for this binding; the store cannot be read.
fn existing_approval(
    host: &Host,
    call: &mut Call,
    binding: &ReceiptBinding,
) -> Result<Option<Receipt>, Outcome> {
    let existing = match host.registry().store().find_approval(binding) {
        Ok(Some(existing)) => existing,
        Ok(None) => return Ok(None),
        Err(e) => {
            tracing::error!("looking up approvals failed: {e:#}");
            return Err(Outcome::refused(
                Category::Unavailable,
                "the host could not read its approvals; try again later",
            ));
        }
    };
    let now = crate::store::now_ms();
    let changed = existing.changed_fields(binding);
    match existing.state_at(now) {
        ApprovalState::Approved if changed.is_empty() => Ok(Some(Receipt {
            approval: existing.id,
            mode: existing.mode,
            answered_in_band: None,
        })),
        ApprovalState::Pending
            if changed.is_empty() && existing.mode == ApprovalMode::OutOfBand =>
        {
            Err(Outcome::ApprovalRequired {
                approval: existing.id,
                summary: existing.summary,
            })
        }
        state => {
            if !changed.is_empty() {
                call.event(
                    events::RECEIPT_REFUSED,
                    json!({
                        "approval": existing.id,
                        "state": state,
                        "refusal": "changed",
                        "changed": changed,
                    }),
                );
            }
            Ok(None)
        }
    }
}

/// Asks anew: records the request (with its `approval-requested` event) and asks in the
/// best mode the client offers — `input_required` for a stateless client that elicits,
/// elicitation for a session that does, else out of band.
///
/// # Errors
/// Out of band: approval required. `input_required`: input required, with the sealed
/// request state. Elicitation: the person's refusal or a missing answer. The store or
/// the sealing fails: unavailable.
async fn ask(
    host: &Host,
    call: &mut Call,
    pending: &PendingApproval,
    asker: &dyn Asker,
    by_client: String,
) -> Result<Receipt, Outcome> {
    let n = pending.normalized();
    let abilities = &n.candidate().abilities;
    let binding = pending.binding().clone();
    let mode = match (abilities.stateless, abilities.elicitation) {
        (true, true) => ApprovalMode::InputRequired,
        (false, true) => ApprovalMode::Elicitation,
        _ => ApprovalMode::OutOfBand,
    };
    let summary = summarize(n);
    let ttl = host.config().approvals.ttl;
    call.event(
        events::APPROVAL_REQUESTED,
        json!({
            "mode": mode,
            "capability": n.capability().name,
            "args_digest": n.args_digest(),
            "summary_sha256": hex::encode(<sha2::Sha256 as sha2::Digest>::digest(summary.as_bytes())),
            "ttl_s": ttl.as_secs(),
            // What the receipt is bound to and how long the request lives, under the MAC:
            // the proof of the stored row (prove_receipt).
            "binding": binding,
            "ttl_ms": u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
        }),
    );
    let new = NewApproval {
        binding,
        profile: n.candidate().session.profile().name.clone(),
        mode,
        summary: summary.clone(),
        ttl_ms: u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
    };
    let record = match host
        .registry()
        .store()
        .create_approval(&new, call.take_events())
    {
        Ok(r) => r,
        Err(e) => {
            tracing::error!("recording an approval request failed: {e:#}");
            return Err(Outcome::refused(
                Category::Unavailable,
                "the host could not record the approval request; try again later",
            ));
        }
    };
    tracing::info!(approval = %record.id, mode = mode.as_str(), capability = %n.capability().name, "approval requested");
    host.registry().metrics().approval_requested(mode.as_str());
    match mode {
        ApprovalMode::OutOfBand => Err(Outcome::ApprovalRequired {
            approval: record.id,
            summary,
        }),
        ApprovalMode::InputRequired => {
            let sealed = host.request_state().seal_json_with(
                &SealedState {
                    approval: record.id.clone(),
                    nonce: record.nonce.clone(),
                },
                &SealOptions::new()
                    .associated_data(&associated_data(n))
                    .ttl(ttl),
            );
            match sealed {
                Ok(state) => Err(Outcome::InputRequired {
                    message: elicitation_message(&summary, &record.id),
                    approval: record.id,
                    request_state: state,
                }),
                Err(e) => {
                    tracing::error!("sealing the request state failed: {e}");
                    Err(Outcome::refused(
                        Category::Unavailable,
                        "the host could not ask for approval; try again later",
                    ))
                }
            }
        }
        ApprovalMode::Elicitation => {
            let message = elicitation_message(&summary, &record.id);
            let timeout: Duration = host.config().approvals.elicitation_timeout;
            match asker.elicit(&message, timeout).await {
                ElicitAnswer::Accept(content)
                    if content.get(APPROVE_FIELD).and_then(Value::as_bool) == Some(true) =>
                {
                    Ok(Receipt {
                        approval: record.id,
                        mode,
                        answered_in_band: Some((by_client, None)),
                    })
                }
                answer => {
                    let reason = match &answer {
                        ElicitAnswer::Accept(_) => "answered with approve = false".to_string(),
                        ElicitAnswer::Decline => "declined".to_string(),
                        ElicitAnswer::Cancel => "cancelled".to_string(),
                        ElicitAnswer::Failed(why) => format!("no answer: {why}"),
                    };
                    Err(refuse_answer(
                        host, call, &record.id, mode, &by_client, &reason,
                    ))
                }
            }
        }
    }
}

/// The message of the elicitation: the summary and the request id.
fn elicitation_message(summary: &str, approval: &str) -> String {
    format!("{summary}\nApproval request {approval}. Approve this call?")
}

/// Records a person's refusal (or a missing answer) and says so to the model.
fn refuse_answer(
    host: &Host,
    call: &mut Call,
    approval: &str,
    mode: ApprovalMode,
    by: &str,
    reason: &str,
) -> Outcome {
    let event = NewEvent::new(
        events::APPROVAL_DECIDED,
        approval,
        json!({
            "approval": approval,
            "call": call.id,
            "decision": "denied",
            "mode": mode,
            "reason": reason,
        }),
    );
    if let Err(e) = host.registry().store().decide_approval(
        approval,
        ApprovalDecision::Deny,
        by,
        Some(reason),
        0,
        vec![event],
    ) {
        // Already consumed, expired, or not this request: nothing was approved.
        tracing::info!(approval, "recording the refusal: {e:#}");
        call.event(
            events::RECEIPT_REFUSED,
            json!({"approval": approval, "mode": mode, "refusal": "state", "detail": format!("{e:#}").chars().take(200).collect::<String>()}),
        );
    }
    Outcome::refused(
        Category::Forbidden,
        format!("the person did not approve this call ({reason}); nothing was done"),
    )
}

/// What the trace says of a receipt about to be consumed ([`prove_receipt`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReceiptProof {
    /// The trace proves every claim of the row this consumption relies on: consume it
    /// (the store still checks the row's state, nonce and binding in its transaction).
    Proven,
    /// The row claims what the trace does not record (edited in the store): why, in words.
    Tampered(String),
    /// The trace itself refuses this receipt (not approved, expired, bound to other facts)
    /// and the row agrees: the refusal, as the store would give it. Nothing is consumed.
    Refused(ReceiptRefusal),
}

/// Why the trace is not whole after the first of `proofs` (an approval's or an intent's
/// MACed events), or `None` when every event from it to the head is there.
///
/// A person's decision is an event in the chain: an attacker who can write the store
/// deletes a revocation (and sets the row back) to revive a receipt; the remaining proofs
/// still verify one by one, so the gap is what shows it. Costs one indexed count over the
/// events since the request (bounded by the receipt's life).
///
/// # Errors
/// The store fails.
pub fn proofs_not_whole(
    store: &dyn crate::store::Store,
    proofs: &[TraceEvent],
) -> anyhow::Result<Option<String>> {
    let Some(first) = proofs.iter().map(|e| e.seq).min() else {
        return Ok(None);
    };
    let missing = store.trace_missing_from(first)?;
    Ok((missing > 0).then(|| {
        format!(
            "{missing} trace event(s) after its request (seq {first}) are missing, so a \
             decision may have been deleted; run `airlock trace verify`"
        )
    }))
}

/// What the MACed trace proves of the receipt of approval `approval` (its full id) for a
/// call bound to `bound`, at `now_ms`, given the stored `record` and its proofs `events`
/// ([`crate::store::Trace::approval_proofs`]). The trace decides; the row is only
/// compared with it, so a row edited in the store proves nothing and a race with such an
/// edit cannot pass either. The rule:
/// - exactly one `approval-requested` event names the approval, and the binding it
///   recorded equals the row's field for field (else tampered) and the call's (else
///   refused: changed);
/// - no `receipt-consumed` event after the request names it: a receipt is used once,
///   whatever its row says since (else tampered when the row claims it is usable,
///   refused otherwise);
/// - approved out of band (`in_band` false): the last `approval-decided` event after the
///   request says `approved`; answered at the client (`in_band` true): no decision was
///   recorded. Else tampered when the row claims it is usable, refused otherwise;
/// - the lifetime: before that decision's (or, in band, the request's) time plus the
///   `ttl_ms` it recorded. Else tampered when the row claims it is not expired, refused
///   (expired) otherwise.
///
/// Requests recorded before the binding entered the event (schema 7 and older) are not
/// proven: such a receipt is refused as tampered and the call must ask anew.
pub fn prove_receipt(
    events: &[TraceEvent],
    record: Option<&ApprovalRecord>,
    approval: &str,
    bound: &ReceiptBinding,
    in_band: bool,
    now_ms: u64,
) -> ReceiptProof {
    let Some(record) = record else {
        return ReceiptProof::Refused(ReceiptRefusal::NotFound);
    };
    let tampered = |why: String| ReceiptProof::Tampered(why);
    let names = |e: &&TraceEvent| e.payload["approval"].as_str() == Some(approval);
    let requests: Vec<&TraceEvent> = events
        .iter()
        .filter(names)
        .filter(|e| e.kind == events::APPROVAL_REQUESTED)
        .collect();
    let request = match requests.as_slice() {
        [one] => *one,
        [] => {
            return tampered(format!(
                "no MACed approval-requested event records approval {approval}"
            ));
        }
        several => {
            return tampered(format!(
                "{} approval-requested events record approval {approval}; one request has one",
                several.len()
            ));
        }
    };
    let recorded = match ReceiptBinding::deserialize(&request.payload["binding"]) {
        Ok(b) => b,
        Err(e) => {
            return tampered(format!(
                "the request event (seq {}) records no binding to check the row against: {e}",
                request.seq
            ));
        }
    };
    let rebound = recorded.changed_fields(&record.binding);
    if !rebound.is_empty() {
        return tampered(format!(
            "the row is bound to other facts than the request event (seq {}) recorded: {}",
            request.seq,
            rebound.join(", ")
        ));
    }
    let changed = recorded.changed_fields(bound);
    if !changed.is_empty() {
        return ReceiptProof::Refused(ReceiptRefusal::Changed(changed));
    }
    let state = record.state_at(now_ms);
    let claims_usable = state
        == if in_band {
            ApprovalState::Pending
        } else {
            ApprovalState::Approved
        };
    let last_decision = events
        .iter()
        .rev()
        .filter(names)
        .find(|e| e.kind == events::APPROVAL_DECIDED && e.seq > request.seq);
    let decision = |d: &TraceEvent| {
        format!(
            "{} (seq {})",
            d.payload["decision"].as_str().unwrap_or("?"),
            d.seq
        )
    };
    let unusable = |why: String| {
        if claims_usable {
            ReceiptProof::Tampered(why)
        } else {
            ReceiptProof::Refused(ReceiptRefusal::State(state))
        }
    };
    // One receipt, one use: a consumption the trace records is final, whatever the row
    // says since.
    if let Some(used) = events
        .iter()
        .filter(names)
        .find(|e| e.kind == events::RECEIPT_CONSUMED && e.seq > request.seq)
    {
        return unusable(format!(
            "the trace records its use already: receipt-consumed (seq {})",
            used.seq
        ));
    }
    let (from, lifetime) = match (in_band, last_decision) {
        (true, None) => (request, "the request"),
        (true, Some(d)) => {
            return unusable(format!(
                "the trace records a decision on it already: {}",
                decision(d)
            ));
        }
        (false, None) => {
            return unusable("the trace records no decision on it".to_owned());
        }
        (false, Some(d)) if d.payload["decision"] == "approved" => (d, "the approval"),
        (false, Some(d)) => {
            return unusable(format!("its last recorded decision is {}", decision(d)));
        }
    };
    let Some(ttl_ms) = from.payload["ttl_ms"].as_u64() else {
        return tampered(format!(
            "{lifetime} event (seq {}) records no lifetime",
            from.seq
        ));
    };
    let ends = from.at_ms.saturating_add(ttl_ms);
    if now_ms < ends {
        return ReceiptProof::Proven;
    }
    if state == ApprovalState::Expired {
        return ReceiptProof::Refused(ReceiptRefusal::Expired);
    }
    tampered(format!(
        "{lifetime} recorded at seq {} lived {ttl_ms} ms and ended {} ms ago, but the row says {state}",
        from.seq,
        now_ms - ends
    ))
}

#[cfg(test)]
mod tests {

    //! [`prove_receipt`] branch by branch, on hand-made proofs: the branches a DB writer
    //! without the key cannot reach through the host (two requests for one approval, a
    //! decision recorded before its request, a decision on an in-band request, a call
    //! bound to other facts) are still decided by the trace.
    use super::*;
    use crate::store::{ApprovalMode, ApprovalRecord, ApprovalState, ReceiptBinding, TraceEvent};

    const ID: &str = "apr_000000000001";
    const NOW: u64 = 1_000_000;

    fn binding() -> ReceiptBinding {
        ReceiptBinding {
            requester: "alice".into(),
            session: "s1".into(),
            capability: "deliver_artifact".into(),
            mapping: "outbox-delivery".into(),
            mapping_revision: 1,
            snapshot_digest: "a".repeat(64),
            policy_digest: "b".repeat(64),
            args_digest: "c".repeat(64),
            artifact_digest: None,
        }
    }

    fn event(seq: i64, kind: &str, payload: Value) -> TraceEvent {
        TraceEvent {
            seq,
            at_ms: NOW - 1_000,
            kind: kind.into(),
            subject: ID.into(),
            payload,
            prev_hash: String::new(),
            hash: String::new(),
            key_id: None,
        }
    }

    fn request(seq: i64) -> TraceEvent {
        event(
            seq,
            events::APPROVAL_REQUESTED,
            json!({"approval": ID, "binding": binding(), "ttl_ms": 60_000}),
        )
    }

    fn decided(seq: i64, decision: &str) -> TraceEvent {
        event(
            seq,
            events::APPROVAL_DECIDED,
            json!({"approval": ID, "decision": decision, "ttl_ms": 60_000}),
        )
    }

    fn row(state: ApprovalState, mode: ApprovalMode) -> ApprovalRecord {
        ApprovalRecord {
            id: ID.into(),
            state,
            mode,
            binding: binding(),
            profile: "default".into(),
            summary: String::new(),
            nonce: "0".repeat(32),
            created_ms: NOW - 1_000,
            expires_ms: NOW + 60_000,
            decided_by: None,
            decided_ms: None,
            reason: None,
            consumed_ms: None,
            intent_id: None,
        }
    }

    fn prove(events: &[TraceEvent], state: ApprovalState, in_band: bool) -> ReceiptProof {
        let mode = if in_band {
            ApprovalMode::InputRequired
        } else {
            ApprovalMode::OutOfBand
        };
        prove_receipt(
            events,
            Some(&row(state, mode)),
            ID,
            &binding(),
            in_band,
            NOW,
        )
    }

    fn tampered_with(proof: &ReceiptProof, words: &str) {
        match proof {
            ReceiptProof::Tampered(why) => assert!(why.contains(words), "{why}"),
            other => panic!("expected tampered ({words}), got {other:?}"),
        }
    }

    #[test]
    fn a_genuine_receipt_is_proven_out_of_band_and_in_band() {
        let out = [request(1), decided(2, "approved")];
        assert_eq!(
            prove(&out, ApprovalState::Approved, false),
            ReceiptProof::Proven
        );
        assert_eq!(
            prove(&[request(1)], ApprovalState::Pending, true),
            ReceiptProof::Proven
        );
    }

    #[test]
    fn two_requests_for_one_approval_prove_nothing() {
        let proofs = [request(1), request(2), decided(3, "approved")];
        tampered_with(
            &prove(&proofs, ApprovalState::Approved, false),
            "2 approval-requested events",
        );
    }

    #[test]
    fn a_decision_recorded_before_its_request_is_no_decision() {
        let proofs = [decided(1, "approved"), request(2)];
        tampered_with(
            &prove(&proofs, ApprovalState::Approved, false),
            "no decision",
        );
    }

    #[test]
    fn an_in_band_answer_to_a_request_already_decided_is_refused() {
        let proofs = [request(1), decided(2, "denied")];
        tampered_with(
            &prove(&proofs, ApprovalState::Pending, true),
            "a decision on it already",
        );
        // The row agrees it is denied: refused, not tampered.
        assert_eq!(
            prove(&proofs, ApprovalState::Denied, true),
            ReceiptProof::Refused(ReceiptRefusal::State(ApprovalState::Denied))
        );
    }

    #[test]
    fn a_call_bound_to_other_facts_than_the_request_is_refused_as_changed() {
        let proofs = [request(1), decided(2, "approved")];
        let mut other = binding();
        other.args_digest = "d".repeat(64);
        let record = row(ApprovalState::Approved, ApprovalMode::OutOfBand);
        match prove_receipt(&proofs, Some(&record), ID, &other, false, NOW) {
            ReceiptProof::Refused(ReceiptRefusal::Changed(fields)) => {
                assert!(!fields.is_empty(), "{fields:?}");
            }
            other => panic!("expected refused (changed), got {other:?}"),
        }
    }

    #[test]
    fn a_receipt_the_trace_records_as_used_is_not_usable_again() {
        let used = event(
            3,
            events::RECEIPT_CONSUMED,
            json!({"approval": ID, "stage": "approved"}),
        );
        let proofs = [request(1), decided(2, "approved"), used];
        tampered_with(
            &prove(&proofs, ApprovalState::Approved, false),
            "its use already",
        );
        assert_eq!(
            prove(&proofs, ApprovalState::Consumed, false),
            ReceiptProof::Refused(ReceiptRefusal::State(ApprovalState::Consumed))
        );
        let in_band = [
            request(1),
            event(2, events::RECEIPT_CONSUMED, json!({"approval": ID})),
        ];
        tampered_with(
            &prove(&in_band, ApprovalState::Pending, true),
            "its use already",
        );
    }

    #[test]
    fn a_long_quoted_text_is_clipped_with_its_length_and_digest() {
        assert_eq!(quoted("a\u{1b}b"), "\"a\\u{1b}b\"");
        let short = "x".repeat(QUOTED_ARGUMENT_CHARS);
        assert_eq!(quoted(&short), format!("{short:?}"));
        let (a, b) = (format!("{short}-one"), format!("{short}-two"));
        let (qa, qb) = (quoted(&a), quoted(&b));
        assert_ne!(qa, qb, "two long texts with one start do not look alike");
        assert!(
            qa.starts_with(&format!("{short:?}… (84 characters, sha256 ")),
            "{qa}"
        );
        assert!(qa.ends_with(&format!(
            "{})",
            hex::encode(sha2::Sha256::digest(a.as_bytes()))
        )));
    }

    #[test]
    fn structured_arguments_are_shown_two_levels_deep_and_deeper_by_digest() {
        use serde_json::json;
        let sha = |v: &Value| hex::encode(sha2::Sha256::digest(v.to_string().as_bytes()));
        assert_eq!(
            shown_value(&json!([{"old-text": "a", "new-text": "b\n"}]), None, 0),
            format!(
                r#"[{{old-text "a", new-text 2 bytes sha256 {}}}]"#,
                hex::encode(sha2::Sha256::digest(b"b\n"))
            )
        );
        assert_eq!(
            shown_value(&json!([1, true, null]), None, 0),
            "[1, true, null]"
        );
        // A record's fields in their declared order, whatever order they came in.
        let edit = Shape::Record(vec![
            ("old-text".into(), Shape::String, None),
            ("new-text".into(), Shape::String, None),
        ]);
        let edits = Shape::Option(Box::new(Shape::List(Box::new(edit))));
        assert_eq!(
            shown_value(
                &json!([{"new-text": "b", "extra": 1, "old-text": "a"}]),
                Some(&edits),
                0
            ),
            r#"[{old-text "a", new-text "b", extra 1}]"#
        );
        // A key that is not a WIT name is quoted, escapes and all.
        assert_eq!(
            shown_value(&json!({"a b\u{202e}": 1}), None, 0),
            r#"{"a b\u{202e}" 1}"#
        );
        let inner = json!([1]);
        assert_eq!(
            shown_value(&json!([[inner]]), None, 0),
            format!("[[3 bytes of JSON sha256 {}]]", sha(&inner))
        );
        // Records deeper than two levels, and with more than 16 fields, by digest too.
        let deep = json!([{"a": 1}]);
        assert_eq!(
            shown_value(&json!([deep]), None, 0),
            format!(
                "[[{} bytes of JSON sha256 {}]]",
                r#"{"a":1}"#.len(),
                sha(&json!({"a": 1}))
            )
        );
        let wide: serde_json::Map<String, Value> =
            (0..17).map(|i| (format!("f{i}"), json!(i))).collect();
        let wide = Value::Object(wide);
        assert!(
            shown_value(&wide, None, 0).ends_with(&format!("bytes of JSON sha256 {}", sha(&wide)))
        );
        // Only WIT-like names go unquoted; strings inside records are escaped like any.
        for (key, shown) in [("", r#""""#), ("a b", r#""a b""#), ("а", r#""а""#)] {
            let mut m = serde_json::Map::new();
            m.insert(key.to_owned(), json!(1));
            assert_eq!(
                shown_value(&Value::Object(m), None, 0),
                format!("{{{shown} 1}}")
            );
        }
        assert_eq!(
            shown_value(&json!([{"old-text": "a\u{202e}b"}]), None, 0),
            r#"[{old-text "a\u{202e}b"}]"#
        );
        let long: Value = (0..17).map(|i| json!(i)).collect();
        assert_eq!(
            shown_value(&long, None, 0),
            format!(
                "{} bytes of JSON sha256 {}",
                long.to_string().len(),
                sha(&long)
            )
        );
    }
}
