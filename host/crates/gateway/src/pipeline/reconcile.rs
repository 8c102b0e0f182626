//! Reconciliation: deciding what happened to an intent whose outcome is unknown.
//!
//! Rules (DESIGN.md §5.8, §8):
//! - An unknown outcome is **never retried blindly**: only a capability the contract and
//!   mapping declare idempotent, and not queryable, is sent again — as a new attempt of
//!   the same intent, with the same idempotency key ([`retry_same_key`]). Otherwise it is
//!   decided by evidence only:
//!   an attempt that never reached `sent` did nothing (`failed`, nothing sent); otherwise
//!   the contract's query, asked with the intent's idempotency key, says whether the
//!   effect happened (`completed`) or not (`failed` — only once no request of the intent
//!   can still be processed: the connection that carried it is gone); everything else is
//!   **held for a person** (`airlock intents resolve`).
//! - An unknown call is reconciled at once, within the call (its answer then says what
//!   the query found); intents a stopped host left open are reconciled before any new call
//!   of their mapping runs ([`before_calls`]).
//! - Every resolution is one store transaction with its `intent-resolved` event: the
//!   final state, the method, who decided (`airlock` for the host) and the evidence.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use wasmtime::component::Val;

use crate::contract::{self, ContractFunction};
use crate::host::Host;
use crate::registry::events;
use crate::registry::live::ActiveMapping;
use crate::runtime::CallContext;
use crate::store::{
    AttemptState, IntentFilter, IntentHandle, IntentRecord, IntentState, NewEvent, Resolution,
    ResolutionMethod,
};

/// Longest wait for a closed connection to come back before a query is given up.
pub const RESTART_WAIT: Duration = Duration::from_secs(5);

/// On a shared store, how often (at most, per mapping, on its calls) a host looks for
/// intents that other hosts left open when they stopped.
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(1);

/// What the contract's query said.
#[derive(Debug, Clone, PartialEq)]
pub enum Finding {
    /// The effect happened: the record the query returned (JSON, adapter locators still
    /// in place) and its shape.
    Happened(Value),
    /// The upstream has no record of the effect.
    NotFound,
    /// The query could not be asked or answered; why.
    Undecided(String),
}

/// Asks the contract's query function of `mapping` what happened under the intent's key,
/// at most twice: an undecided answer is asked again, after restarting a connection found
/// closed (before, or by the query itself: the answer that was lost is often the
/// connection's last).
pub async fn query(host: &Host, mapping: &Arc<ActiveMapping>, intent: &IntentRecord) -> Finding {
    let Some(function) = mapping.queries.get(&intent.intent.capability) else {
        return Finding::Undecided("the contract has no query for this capability".into());
    };
    let mut finding = Finding::Undecided("not asked".into());
    for _ in 0..2 {
        if let Err(why) = ensure_open(host, mapping).await {
            return Finding::Undecided(why);
        }
        finding = ask(mapping, function, intent).await;
        let closed = async {
            // rmcp notices a closed transport shortly after the request that hit it.
            for _ in 0..20 {
                if !mapping.connection.connection().is_open() {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            false
        };
        // An undecided answer is asked once more (a closed connection is restarted
        // first): a query is a read, retried within its budget of two.
        match &finding {
            Finding::Undecided(why) => {
                let was_closed = closed.await;
                tracing::debug!(mapping = %mapping.name, closed = was_closed, "query undecided ({why}); asking once more");
                continue;
            }
            _ => break,
        }
    }
    finding
}

/// Restarts the mapping's connection if it is closed, waiting at most [`RESTART_WAIT`].
async fn ensure_open(host: &Host, mapping: &Arc<ActiveMapping>) -> Result<(), String> {
    let state = &mapping.connection;
    if state.connection().is_open() {
        return Ok(());
    }
    let deadline = tokio::time::Instant::now() + RESTART_WAIT;
    loop {
        match tokio::time::timeout_at(deadline, host.live().restart_connection(state)).await {
            Ok(Ok(())) if state.connection().is_open() => return Ok(()),
            Ok(Ok(())) => {}
            Ok(Err(e))
                if tokio::time::Instant::now() + crate::registry::live::MIN_RESTART_INTERVAL
                    < deadline =>
            {
                tracing::debug!(mapping = %mapping.name, "restart for a query failed: {e:#}; trying again");
            }
            Ok(Err(e)) => return Err(format!("the upstream is unreachable: {e:#}")),
            Err(_) => {
                return Err(format!(
                    "the upstream did not come back within {} s",
                    RESTART_WAIT.as_secs()
                ));
            }
        }
        tokio::time::sleep(crate::registry::live::MIN_RESTART_INTERVAL).await;
    }
}

/// One call of the query function.
async fn ask(
    mapping: &Arc<ActiveMapping>,
    function: &ContractFunction,
    intent: &IntentRecord,
) -> Finding {
    let param = match query_param(function, &intent.intent.idempotency_key) {
        Ok(p) => p,
        Err(e) => return Finding::Undecided(e),
    };
    let outcome = mapping
        .adapter
        .call(
            &function.name,
            std::slice::from_ref(&param),
            mapping.grant.clone(),
            CallContext {
                intent_id: Some(intent.intent.id.clone()),
                idempotency_key: Some(intent.intent.idempotency_key.clone()),
                attempt: 0,
                attempts: None,
                cancel: None,
                record: false,
                trace: None,
            },
        )
        .await;
    let val = match outcome.result {
        Ok(v) => v,
        Err(failure) => return Finding::Undecided(format!("the query failed: {}", failure.kind())),
    };
    let Some(shape) = &function.result else {
        return Finding::Undecided("the query function returns nothing".into());
    };
    let json = match contract::val_to_json(shape, &val, &mut |_, locator| Ok(locator.to_string())) {
        Ok(j) => j,
        Err(e) => return Finding::Undecided(format!("the query's result did not convert: {e:#}")),
    };
    match json {
        Value::Object(mut o) if o.contains_key("ok") => match o.remove("ok") {
            Some(Value::Null) | None => Finding::NotFound,
            Some(record) => Finding::Happened(record),
        },
        Value::Object(o) if o.contains_key("err") => {
            let err: String = o["err"].to_string().chars().take(300).collect();
            Finding::Undecided(format!("the query was refused (untrusted text): {err}"))
        }
        other => Finding::Undecided(format!(
            "the query returned an unexpected value ({} bytes)",
            other.to_string().len()
        )),
    }
}

/// The query's argument: its record with the host-supplied key filled in.
fn query_param(function: &ContractFunction, key: &str) -> Result<Val, String> {
    let shape = &function
        .params
        .first()
        .ok_or("the query function takes no argument")?
        .1;
    let mut param = contract::json_to_val(shape, &json!({}), &mut |_, _| {
        Err("the query takes no handles".into())
    })
    .map_err(|e| format!("building the query's argument: {e}"))?;
    if contract::fill_host_supplied(shape, &mut param, key) == 0 {
        return Err("the query's argument has no host-supplied key".into());
    }
    Ok(param)
}

/// The safe evidence a found record gives: its scalar fields, clipped.
fn evidence_of(record: &Value) -> Value {
    let mut out = serde_json::Map::new();
    if let Value::Object(o) = record {
        for (k, v) in o {
            match v {
                Value::String(s) => {
                    out.insert(k.clone(), Value::String(s.chars().take(128).collect()));
                }
                Value::Bool(_) | Value::Number(_) => {
                    out.insert(k.clone(), v.clone());
                }
                _ => {}
            }
        }
    }
    Value::Object(out)
}

/// How a reconciliation ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Reconciled {
    /// Resolved completed; the record the query found.
    Completed(Value),
    /// Resolved failed (nothing happened), with the reason.
    Failed(String),
    /// Still unknown, held for a person, with the reason.
    Held(String),
}

/// The handles a resolution as completed keeps ([`crate::store::IntentRecord::handles`]):
/// those of `record` — the ok value of the intent's function (what its query or a retry
/// returned), adapter locators in place — when the intent's capability is compensable;
/// none otherwise, or when the capability no longer serves from `mapping`.
fn resolution_handles(
    host: &Host,
    mapping: &Arc<ActiveMapping>,
    intent: &IntentRecord,
    record: &Value,
) -> Vec<IntentHandle> {
    let catalog = host.catalog();
    let Some(cap) = catalog
        .capability(&intent.intent.capability)
        .filter(|c| c.mapping.name == mapping.name && c.semantics.compensable)
    else {
        return Vec::new();
    };
    match &cap.function.result {
        Some(contract::Shape::Result { ok: Some(ok), .. }) => {
            crate::pipeline::outcome::kept_handles(ok, record, &mapping.contract)
        }
        _ => Vec::new(),
    }
}

/// The `intent-resolved` event of `resolution` of `intent`, written in the resolution's
/// transaction: the intent's id, capability and mapping, the resolution (state, method,
/// who, evidence) and `intent_state`, the state it gives the intent in the trace
/// ([`crate::pipeline::intent::traced_state`]). The host's resolutions and a person's
/// (`airlock intents resolve`) use it alike.
pub fn resolved_event(intent: &IntentRecord, resolution: &Resolution) -> NewEvent {
    let mut payload = json!({
        "intent": intent.intent.id,
        "capability": intent.intent.capability,
        "mapping": intent.intent.mapping,
        "state": resolution.state,
        "intent_state": resolution.state,
        "method": resolution.method,
        "by": resolution.by,
        "evidence": resolution.evidence,
    });
    // The proof of the handles kept with the row (compensate::prove_handles).
    if let Some(digest) = crate::store::plans::handles_sha256(&resolution.handles) {
        payload["handles_sha256"] = json!(digest);
    }
    NewEvent::new(
        events::INTENT_RESOLVED,
        intent.intent.call_id.clone(),
        payload,
    )
}

/// Reconciles one open intent of `mapping` (see the module rules). `carrier`: the
/// connection that carried the intent's requests, `None` when the host that sent them
/// stopped; once it is closed, no request of the intent can still be processed.
pub async fn reconcile(
    host: &Host,
    mapping: &Arc<ActiveMapping>,
    intent: &IntentRecord,
    queryable: bool,
    carrier: Option<&crate::upstream::Connection>,
) -> Reconciled {
    let store = host.registry().store();
    let id = &intent.intent.id;
    let attempts = match store.attempts(id) {
        Ok(a) => a,
        Err(e) => return Reconciled::Held(format!("the store failed: {e:#}")),
    };
    let sent = attempts
        .iter()
        .any(|a| a.state >= AttemptState::Sent || a.requests > 0);
    let resolve = |state: IntentState,
                   method: ResolutionMethod,
                   evidence: Value,
                   handles: Vec<IntentHandle>| {
        let resolution = Resolution {
            handles,
            state,
            method,
            by: "airlock".into(),
            evidence,
        };
        store.resolve_intent(id, &resolution, vec![resolved_event(intent, &resolution)])
    };
    if !sent {
        return match resolve(
            IntentState::Failed,
            ResolutionMethod::NothingSent,
            json!({"attempts": attempts.len(), "sent": 0}),
            Vec::new(),
        ) {
            Ok(_) => Reconciled::Failed("no request of it was ever sent upstream".into()),
            Err(e) => Reconciled::Held(format!("recording the resolution failed: {e:#}")),
        };
    }
    let finding = if queryable {
        query(host, mapping, intent).await
    } else {
        Finding::Undecided("the mapping says this capability cannot be queried".into())
    };
    let carrier_gone = carrier.is_none_or(|c| !c.is_open());
    let decided = match &finding {
        Finding::Happened(record) => Some((
            IntentState::Completed,
            json!({"query": "found", "record": evidence_of(record)}),
        )),
        Finding::NotFound if carrier_gone => Some((
            IntentState::Failed,
            json!({"query": "not-found", "carrier": "gone"}),
        )),
        _ => None,
    };
    if let Some((state, evidence)) = decided {
        let handles = match &finding {
            Finding::Happened(record) => resolution_handles(host, mapping, intent, record),
            _ => Vec::new(),
        };
        return match resolve(state, ResolutionMethod::Query, evidence, handles) {
            Ok(_) => match finding {
                Finding::Happened(record) => Reconciled::Completed(record),
                _ => Reconciled::Failed(
                    "the upstream has no record of it under its idempotency key".into(),
                ),
            },
            Err(e) => Reconciled::Held(format!("recording the resolution failed: {e:#}")),
        };
    }
    let why = match finding {
        Finding::Undecided(why) => why,
        Finding::NotFound => {
            "the upstream has no record of it yet, but the request may still be processed".into()
        }
        Finding::Happened(_) => unreachable!("decided above"),
    };
    let held = json!({"intent": id, "capability": intent.intent.capability, "mapping": intent.intent.mapping, "reason": why});
    if intent.state == IntentState::Prepared {
        // An intent a stopped host left prepared, once it may have sent, is unknown; the
        // held event records the change, in the same transaction.
        let mut held = held;
        held["intent_state"] = json!(IntentState::Unknown);
        let event = NewEvent::new(events::INTENT_HELD, intent.intent.call_id.clone(), held);
        if let Err(e) = store.set_intent_state(id, IntentState::Unknown, vec![event]) {
            tracing::error!(intent = %id, "could not mark a stale intent unknown: {e:#}");
        }
    } else {
        host.registry()
            .trace(events::INTENT_HELD, &intent.intent.call_id, held);
    }
    Reconciled::Held(why)
}

/// How a retry with the same idempotency key ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Retried {
    /// The upstream answered; the intent is resolved completed (method `retry`). The
    /// contract's ok value (JSON, adapter locators in place).
    Completed(Value),
    /// The retry did not settle it; why (the intent stays unknown, held for a person).
    Failed(String),
}

/// Sends an idempotent effect again with the same idempotency key (DESIGN.md §5 rule
/// "retry by semantics": only what the contract declares idempotent, only with the same
/// key): a new attempt of the same intent, recorded like the first. `param` is the exact
/// value the first attempt ran with (the key already filled in).
pub async fn retry_same_key(
    host: &Host,
    mapping: &Arc<ActiveMapping>,
    intent: &IntentRecord,
    function: &ContractFunction,
    param: &Val,
) -> Retried {
    if let Err(why) = ensure_open(host, mapping).await {
        return Retried::Failed(why);
    }
    let store = host.registry().store();
    let id = &intent.intent.id;
    let number = match store.new_attempt(id) {
        Ok(n) => n,
        Err(e) => return Retried::Failed(format!("the store failed: {e:#}")),
    };
    let attempt = Arc::new(crate::pipeline::attempt::Attempt::new(
        host.registry().shared_store(),
        id,
        number,
    ));
    let outcome = mapping
        .adapter
        .call(
            &function.name,
            std::slice::from_ref(param),
            mapping.grant.clone(),
            CallContext {
                intent_id: Some(id.clone()),
                idempotency_key: Some(intent.intent.idempotency_key.clone()),
                attempt: number,
                attempts: Some(attempt.clone() as Arc<dyn crate::runtime::AttemptLog>),
                cancel: None,
                record: false,
                trace: None,
            },
        )
        .await;
    let summary = attempt.summary();
    let val = match outcome.result {
        Ok(v) => v,
        Err(failure) => return Retried::Failed(format!("the retry failed: {}", failure.kind())),
    };
    let Some(shape) = &function.result else {
        return Retried::Failed("the function returns nothing to confirm it".into());
    };
    let json = match contract::val_to_json(shape, &val, &mut |_, locator| Ok(locator.to_string())) {
        Ok(j) => j,
        Err(e) => return Retried::Failed(format!("the retry's result did not convert: {e:#}")),
    };
    let value = match json {
        Value::Object(mut o) if o.contains_key("ok") && summary.all_answered() => {
            o.remove("ok").unwrap_or_default()
        }
        Value::Object(o) if o.contains_key("err") => {
            let err: String = o["err"].to_string().chars().take(300).collect();
            return Retried::Failed(format!("the retry was refused (untrusted text): {err}"));
        }
        _ => return Retried::Failed("the retry's answer was lost too".into()),
    };
    attempt.advance(AttemptState::ResultObserved);
    let resolution = Resolution {
        handles: resolution_handles(host, mapping, intent, &value),
        state: IntentState::Completed,
        method: ResolutionMethod::Retry,
        by: "airlock".into(),
        evidence: json!({"attempt": number, "record": evidence_of(&value)}),
    };
    match store.resolve_intent(id, &resolution, vec![resolved_event(intent, &resolution)]) {
        Ok(_) => Retried::Completed(value),
        Err(e) => Retried::Failed(format!("recording the resolution failed: {e:#}")),
    }
}

/// Reconciles the intents `mapping`'s calls left open — every `unknown` one, and the
/// `prepared` ones a host that stopped left behind — once per loaded mapping, before its
/// first call runs; an intent another live host created is left to it. On a shared store
/// the calls also look, every [`SWEEP_INTERVAL`] at most, for intents of hosts that have
/// stopped since (their liveness lock is free) and reconcile those.
pub async fn before_calls(host: &Host, mapping: &Arc<ActiveMapping>) {
    mapping
        .reconciled
        .get_or_init(|| sweep(host, mapping, true))
        .await;
    if host.registry().store().is_shared() {
        let due = {
            let mut swept = mapping.swept.lock().unwrap_or_else(|e| e.into_inner());
            let now = std::time::Instant::now();
            let due = swept.is_none_or(|at| now.duration_since(at) >= SWEEP_INTERVAL);
            if due {
                *swept = Some(now);
            }
            due
        };
        if due {
            sweep(host, mapping, false).await;
        }
    }
}

/// Which host created an intent, as its MACed `intent-created` event records it (`None`
/// for intents recorded before hosts were named).
fn creator(proofs: &[crate::store::TraceEvent], id: &str) -> Option<String> {
    proofs
        .iter()
        .find(|e| e.kind == events::INTENT_CREATED && e.payload["intent"] == id)
        .and_then(|e| e.payload["host"].as_str())
        .map(str::to_owned)
}

/// Why the trace does not prove intent `id` as the store holds it now (its row read
/// first, then its proofs, so a state change committed in between shows in both), or
/// `None` when it does. A missing row the trace knows is unproven too.
fn unproven_now(store: &dyn crate::store::Store, id: &str) -> Option<String> {
    let row = match store.intent(id) {
        Ok(Some(row)) => row,
        Ok(None) => {
            return Some(
                "the trace records this intent as open, but the store has no row for it".into(),
            );
        }
        Err(e) => return Some(format!("its row could not be read: {e:#}")),
    };
    match store.intent_proofs(id) {
        Ok(proofs) => crate::pipeline::intent::prove_intent(&proofs, &row),
        Err(e) => Some(format!("its proofs could not be read: {e:#}")),
    }
}

/// Reconciles the open intents of `mapping` that no live host is delivering. `first`: the
/// sweep before this load's first call, which also takes this host's own leftovers;
/// otherwise (shared stores, every [`SWEEP_INTERVAL`] at most) only intents of other
/// hosts that have stopped.
async fn sweep(host: &Host, mapping: &Arc<ActiveMapping>, first: bool) {
    let filter = IntentFilter {
        compensates: None,
        states: vec![IntentState::Unknown, IntentState::Prepared],
        mapping: Some(mapping.name.clone()),
        created_before_ms: None,
        limit: 1000,
    };
    let store = host.registry().store();
    let open = match store.intents(&filter) {
        Ok(list) => list,
        Err(e) => {
            tracing::error!(mapping = %mapping.name, "could not list open intents: {e:#}");
            return;
        }
    };
    let catalog = host.catalog();
    let mut alive: std::collections::HashMap<String, bool> = std::collections::HashMap::new();
    let tampered = |id: &str, why: &str| {
        tracing::error!(intent = %id, mapping = %mapping.name, "not reconciling an intent the trace does not prove (edited in the store?): {why}");
        host.registry().trace(
            events::INTENT_TAMPERED,
            id,
            json!({"intent": id, "mapping": mapping.name, "why": why}),
        );
    };
    if first {
        // Trace-driven: an intent the trace leaves open whose row says otherwise, or has
        // no row, was closed or deleted by hand; nothing would list it as open.
        match store.intents_open_in_trace_only(&mapping.name, filter.limit) {
            Ok(ids) => {
                for id in &ids {
                    if let Some(why) = unproven_now(store, id) {
                        tampered(id, &why);
                    }
                }
            }
            Err(e) => {
                tracing::error!(mapping = %mapping.name, "could not list the intents the trace leaves open: {e:#}");
            }
        }
    }
    for intent in open {
        // Only intents the trace proves are acted on: a row written by hand asks no
        // query and retries nothing.
        let proofs = store.intent_proofs(&intent.intent.id);
        let unproven = match &proofs {
            Ok(proofs) => crate::pipeline::intent::prove_intent(proofs, &intent),
            Err(e) => Some(format!("its proofs could not be read: {e:#}")),
        };
        if unproven.is_some() {
            // The listing may be older than the proofs: another host may have closed the
            // intent in between. Only what still disagrees on a fresh read is tampering.
            if let Some(why) = unproven_now(store, &intent.intent.id)
                && first
            {
                tampered(&intent.intent.id, &why);
            }
            continue;
        }
        let owner = proofs
            .as_deref()
            .ok()
            .and_then(|p| creator(p, &intent.intent.id));
        match owner.as_deref() {
            // Another host's intent: its host delivers and reconciles it while it lives.
            Some(other) if other != host.instance() => {
                let lives = match alive.get(other) {
                    Some(v) => *v,
                    None => {
                        let v = store.host_alive(other).unwrap_or_else(|e| {
                            tracing::warn!(host = %other, "could not tell whether a host is alive (taken for alive): {e:#}");
                            true
                        });
                        alive.insert(other.to_owned(), v);
                        v
                    }
                };
                if lives {
                    continue;
                }
                tracing::info!(intent = %intent.intent.id, mapping = %mapping.name, host = %other, "reconciling an intent a stopped host left open");
            }
            // This host's own, or an unnamed one: only the first sweep takes them.
            _ if !first => continue,
            // A prepared intent of this host run belongs to a call in flight.
            _ if intent.state == IntentState::Prepared
                && intent.created_ms >= host.started_ms() =>
            {
                continue;
            }
            _ => {}
        }
        let queryable = catalog
            .capability(&intent.intent.capability)
            .is_some_and(|c| c.semantics.queryable);
        // A prepared intent of a stopped host, or an unknown one whose connection the call
        // saw: either way the request's sender is gone.
        let r = reconcile(host, mapping, &intent, queryable, None).await;
        tracing::info!(intent = %intent.intent.id, mapping = %mapping.name, result = ?r, "reconciled an open intent");
    }
}
