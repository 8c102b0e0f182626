//! The life of one call (DESIGN.md §5): one module per stage, each handing a typed value to
//! the next.
//!
//! ```text
//!  Candidate ─normalize─▶ Normalized ─authorize─▶ Authorized ────────────────────────┐
//!                                          └────▶ PendingApproval ─approve─▶ Authorized (+ Receipt)
//!  Authorized ─intent─▶ Intended ─recheck─▶ Ready ─execute─▶ Executed ─outcome─▶ Outcome
//! ```
//!
//! Rules this module enforces:
//! - **No stage can be skipped.** Each value can be built only by its own stage (private
//!   fields, no public constructor): [`recheck`] takes an [`intent::Intended`], which only
//!   [`intent`] makes, which takes an [`authorize::Authorized`], which only a policy allow
//!   or an approval receipt makes. The front can build a [`Candidate`] and read an
//!   [`Outcome`]; nothing in between.
//! - **Decided twice.** Policy decides at [`authorize`] and again at [`recheck`],
//!   immediately before the adapter runs, with the then-current policy, mapping state and
//!   revision, snapshot, connection health and reference validity.
//! - **Every call is traced, and acknowledged only once traced.** The events of one call
//!   (candidate, decision, approval, receipt, intent, each upstream request, outcome) are
//!   linked by the call id and made durable — on the embedded store one trace-journal
//!   record per call ([`crate::store::journal`]), on a shared store one transaction shared
//!   by concurrent calls (group commit) — before the front can reach the outcome
//!   ([`Finished`] holds a failure to record in its place); a receipt's consumption
//!   commits with the intent it creates, and the observations of the content a call
//!   ingested are recorded with its events.
//! - [`offer`] computes what a session is offered: profile ∩ serving mappings ∩ healthy
//!   connections ∩ policy.

pub mod approve;
pub mod attempt;
pub mod authorize;
pub mod candidate;
pub mod compensate;
pub mod execute;
pub mod intent;
pub mod normalize;
pub mod offer;
pub mod outcome;
pub mod recheck;
pub mod reconcile;
pub mod references;
pub mod refusals;
pub mod session;

use std::sync::Arc;
use std::time::Instant;

use serde_json::{Value, json};

pub use candidate::{Asker, Candidate, ClientAbilities, ElicitAnswer, NoAsker, Retry};
pub use outcome::{Category, Completed, Outcome};
pub use session::{Requester, Session, SessionId};

use crate::host::Host;
use crate::registry::events;
use crate::store::{IntentState, NewEvent, NewObservation};

/// The running state of one call: its id, its session, and the trace events not yet
/// committed.
pub struct Call {
    /// `call_` + 24 hex digits.
    pub(crate) id: String,
    pub(crate) session: Arc<Session>,
    started: Instant,
    last: Instant,
    /// Microseconds spent in each stage, in order (recorded in the outcome event).
    stages: Vec<(&'static str, u64)>,
    events: Vec<NewEvent>,
    /// The content the call ingested, committed with its events.
    observations: Vec<NewObservation>,
    /// The durable intent whose state the outcome sets, if any.
    durable_intent: Option<String>,
    /// The digest of the policy that allowed the call at the re-check.
    rechecked_policy: Option<std::sync::Arc<str>>,
    /// The call's intent id, once it has one.
    intent: Option<String>,
    /// Set when the call's effect ended unknown: what reconciling it needs.
    unknown: Option<UnknownEffect>,
    /// Cancelled when the model-facing request is.
    cancel: Option<tokio_util::sync::CancellationToken>,
    /// The mapping serving the call's capability, once normalization found it (named in
    /// the log line of a refusal, [`refusals`]).
    mapping: Option<Arc<crate::registry::live::ActiveMapping>>,
    /// The kind of containment that stopped the adapter, if the host stopped it (counted
    /// by the metrics).
    contained: Option<&'static str>,
    /// Set once normalization found the capability offered to the call's session: only
    /// then is its name a metrics label ([`crate::metrics`]) or a span name.
    offered: bool,
    /// The request's server span and when the call started by the wall clock, when the
    /// host exports spans ([`crate::telemetry`]).
    trace: Option<(opentelemetry::Context, std::time::SystemTime)>,
}

/// What the host needs to reconcile a call whose effect ended unknown.
struct UnknownEffect {
    mapping: Arc<crate::registry::live::ActiveMapping>,
    intent: String,
    queryable: bool,
    revision: i64,
    /// The contract function and the exact value it ran with, kept for an idempotent
    /// capability: a retry sends the same value, with the same idempotency key.
    retry: Option<(crate::contract::ContractFunction, wasmtime::component::Val)>,
    /// The connection that carried the call's requests.
    carrier: Arc<crate::upstream::Connection>,
}

impl Call {
    fn new(session: Arc<Session>) -> Self {
        let now = Instant::now();
        Self {
            id: crate::store::approvals::random_id("call_", 12),
            session,
            started: now,
            last: now,
            stages: Vec::with_capacity(12),
            events: Vec::with_capacity(8),
            observations: Vec::new(),
            durable_intent: None,
            rechecked_policy: None,
            intent: None,
            unknown: None,
            cancel: None,
            mapping: None,
            contained: None,
            offered: false,
            trace: None,
        }
    }

    /// Queues a trace event about this call (its payload gains `"call": id`).
    pub(crate) fn event(&mut self, kind: &'static str, mut payload: Value) {
        if let Some(o) = payload.as_object_mut() {
            o.insert("call".into(), Value::String(self.id.clone()));
        }
        self.events
            .push(NewEvent::new(kind, self.id.clone(), payload));
    }

    /// Takes the queued events (to commit them with a store write of a stage).
    pub(crate) fn take_events(&mut self) -> Vec<NewEvent> {
        std::mem::take(&mut self.events)
    }

    /// Records `took` as part `name` of the stage just ended (a `stage.part` name); the
    /// stages' clock does not move.
    pub(crate) fn detail(&mut self, name: &'static str, took: std::time::Duration) {
        self.stages.push((name, took.as_micros() as u64));
    }

    /// Marks the end of stage `name`.
    pub(crate) fn stage(&mut self, name: &'static str) {
        let now = Instant::now();
        self.stages
            .push((name, now.duration_since(self.last).as_micros() as u64));
        self.last = now;
    }
}

/// A call's outcome, with its trace committed (or the failure to commit it).
#[must_use = "the outcome is reached through `respond`"]
pub struct Finished {
    call: String,
    outcome: Outcome,
    failed: Option<anyhow::Error>,
}

impl Finished {
    /// Renders the outcome with `render`, unless the call's trace could not be committed.
    ///
    /// # Errors
    /// A commit failed: the outcome to render instead (`unknown` when the adapter ran,
    /// `unavailable` otherwise); nothing about the call's result is acknowledged.
    pub async fn respond<R>(self, render: impl FnOnce(Outcome) -> R) -> Result<R, Outcome> {
        let ran = matches!(self.outcome, Outcome::Completed(_));
        match self.failed {
            None => Ok(render(self.outcome)),
            Some(e) => {
                tracing::error!(call = %self.call, "could not commit the call's trace: {e:#}");
                Err(Outcome::refused(
                    if ran {
                        Category::Unknown
                    } else {
                        Category::Unavailable
                    },
                    "the host could not record this call in its trace, so it does not report a result; check the host's state folder",
                ))
            }
        }
    }

    /// Waits for the trace and returns the outcome (for callers that render afterwards).
    pub async fn outcome(self) -> Outcome {
        match self.respond(|o| o).await {
            Ok(o) | Err(o) => o,
        }
    }
}

/// Runs one call through every stage and commits its trace (see [`Finished::respond`]).
pub async fn run(host: &Arc<Host>, candidate: Candidate, asker: &dyn Asker) -> Finished {
    // Counted while it runs, so a stopping host drains it; refused once the host stops.
    let Some(_in_flight) = host.live().call_started() else {
        host.registry().metrics().call_ended(
            None,
            "refused",
            Category::Unavailable.as_str(),
            None,
            &[],
        );
        return Finished {
            call: String::new(),
            outcome: Outcome::refused(
                Category::Unavailable,
                "the host is shutting down; make the call again once it is back",
            ),
            failed: None,
        };
    };
    let mut call = Call::new(candidate.session.clone());
    call.cancel = candidate.cancel.clone();
    call.trace = candidate
        .trace
        .clone()
        .map(|cx| (cx, std::time::SystemTime::now()));
    let capability = candidate.name.clone();
    let mut outcome = stages(host, &mut call, candidate, asker).await;
    let committing = call.trace.is_some().then(std::time::SystemTime::now);
    let failed = finish_off_worker(host, &mut call, &outcome).await.err();
    if let (Some(spans), Some((server, started)), Some(at)) =
        (host.spans(), &call.trace, committing)
    {
        let committed = std::time::SystemTime::now();
        spans.stages(server, *started, &call.stages);
        spans.commit(server, (at, committed), failed.is_some());
    }
    if failed.is_none()
        && let Some(unknown) = call.unknown.take()
    {
        // The unknown outcome is durable; now find out what happened.
        outcome = reconcile_now(host, &call, unknown, outcome).await;
    }
    let refused = match &outcome {
        Outcome::Refused { category, detail } => Some((*category, detail.as_str())),
        Outcome::Invalid { message } => Some((Category::InvalidRequest, message.as_str())),
        _ => None,
    };
    if let Some((category, detail)) = refused {
        host.refusals().refused(&refusals::Refusal {
            call: &call.id,
            capability: &capability,
            mapping: call.mapping.as_deref().map(|m| m.name.as_str()),
            connection: call.mapping.as_deref().map(|m| m.connection.name.as_str()),
            category,
            detail,
        });
    }
    count(host, &call, &capability, &outcome, failed.is_some());
    if let Some((server, _)) = &call.trace {
        describe(server, &call, &capability, &outcome, failed.is_some());
    }
    Finished {
        call: call.id.clone(),
        outcome,
        failed,
    }
}

/// Counts the call that ended with `outcome` in the host's metrics: under its capability
/// once normalization found it offered to the session (`call.offered`), with the outcome
/// the client gets
/// (a trace that could not be committed turns it into `unknown` or `unavailable`, see
/// [`Finished::respond`]).
fn count(host: &Host, call: &Call, capability: &str, outcome: &Outcome, failed: bool) {
    let metrics = host.registry().metrics();
    let mapping = call.mapping.as_deref();
    if let (Some(m), Some(kind)) = (mapping, call.contained) {
        metrics.contained(&m.name, kind);
    }
    let (name, category) = ended_as(outcome, failed);
    metrics.call_ended(
        call.offered.then_some(capability),
        name,
        category,
        Some(call.started.elapsed()),
        &call.stages,
    );
}

/// The outcome name and category the client gets for `outcome`: a trace that could not be
/// committed (`failed`) turns it into `unknown` or `unavailable` ([`Finished::respond`]).
fn ended_as(outcome: &Outcome, failed: bool) -> (&'static str, &'static str) {
    match (failed, outcome) {
        (false, o) => o.names(),
        (true, Outcome::Completed(_)) => ("unknown", Category::Unknown.as_str()),
        (true, _) => ("refused", Category::Unavailable.as_str()),
    }
}

/// Records on the request's server span what the call was (module rules of
/// [`crate::telemetry`]): its id, its capability's name once it was found offered (the span
/// is then `tools/call {name}`), its outcome, and a refusal's category as `error.type`.
fn describe(
    server: &opentelemetry::Context,
    call: &Call,
    capability: &str,
    outcome: &Outcome,
    failed: bool,
) {
    use opentelemetry::KeyValue;
    use opentelemetry::trace::TraceContextExt as _;
    let span = server.span();
    span.set_attribute(KeyValue::new("airlock.call.id", call.id.clone()));
    if call.offered {
        span.update_name(format!("tools/call {capability}"));
        span.set_attribute(KeyValue::new("gen_ai.tool.name", capability.to_string()));
        span.set_attribute(KeyValue::new("gen_ai.operation.name", "execute_tool"));
    }
    let (name, category) = ended_as(outcome, failed);
    span.set_attribute(KeyValue::new("airlock.outcome", name));
    if name != "completed" {
        span.set_attribute(KeyValue::new("error.type", category));
        span.set_status(opentelemetry::trace::Status::error(category));
    }
}

/// The stages in order. A superseded mapping revision found at the re-check restarts a
/// call that holds no receipt (at most twice): it then runs, decided again, on the
/// revision that serves now.
async fn stages(
    host: &Arc<Host>,
    call: &mut Call,
    candidate: Candidate,
    asker: &dyn Asker,
) -> Outcome {
    let mut candidate = candidate;
    let mut restarts = 0;
    loop {
        let normalized = match normalize::normalize(host, call, candidate).await {
            Ok(n) => n,
            Err(o) => return o,
        };
        call.stage("normalize");
        // Intents a stopped host left open are settled before the mapping runs anything.
        reconcile::before_calls(host, &normalized.capability().mapping).await;
        let authorized = match authorize::authorize(host, call, normalized) {
            Ok(authorize::Authorization::Allowed(a)) => a,
            Ok(authorize::Authorization::NeedsApproval(pending)) => {
                call.stage("authorize");
                match approve::approve(host, call, pending, asker).await {
                    Ok(a) => a,
                    Err(o) => return o,
                }
            }
            Err(o) => return o,
        };
        call.stage("authorize");
        let intended = match intent::intent(host, call, authorized) {
            Ok(i) => i,
            Err(o) => return o,
        };
        call.stage("intent");
        let ready = match recheck::recheck(host, call, intended).await {
            Ok(r) => r,
            Err(recheck::NotReady::Refused(o)) => return o,
            Err(recheck::NotReady::Superseded(c)) if restarts < 2 => {
                restarts += 1;
                // The intent made for the superseded revision never ran: close it, so
                // that no one reconciling it reads "may have acted".
                if let Some(intent) = call.durable_intent.take() {
                    call.event(
                        events::CALL_REFUSED,
                        json!({"intent": intent, "changed": "mapping-revision", "restarted": true, "intent_state": IntentState::Failed}),
                    );
                    let closed = host.registry().store().set_intent_state(
                        &intent,
                        IntentState::Failed,
                        call.take_events(),
                    );
                    if let Err(e) = closed {
                        tracing::error!(%intent, "could not close a superseded intent: {e:#}");
                    }
                }
                candidate = *c;
                continue;
            }
            Err(recheck::NotReady::Superseded(_)) => {
                return Outcome::refused(
                    Category::StateChanged,
                    "the capability's mapping changed while the call was being prepared; call it again",
                );
            }
        };
        call.stage("recheck");
        let cap = ready.intended().authorized().normalized().capability();
        let (mapping, queryable) = (cap.mapping.clone(), cap.semantics.queryable);
        let revision = ready.intended().authorized().normalized().revision();
        let carrier = mapping.connection.connection();
        // Only an idempotent effect keeps what a retry needs; reads pay nothing.
        let retry = (call.durable_intent.is_some() && cap.semantics.idempotent)
            .then(|| (cap.function.clone(), ready.param().clone()));
        let cancel = call.cancel.clone();
        // The execute stage's span is live: the upstream requests' client spans are its
        // children (crate::telemetry).
        let live = match (host.spans(), &call.trace) {
            (Some(spans), Some((server, _))) => Some((spans.execute(server), spans.tracer())),
            _ => None,
        };
        let trace = live
            .as_ref()
            .map(|(cx, tracer)| crate::upstream::spans::CallTrace {
                context: cx.clone(),
                tracer: (*tracer).clone(),
            });
        let executed = execute::execute(host, call, ready, cancel, trace).await;
        call.stage("execute");
        let t = executed.timings();
        if !t.queue.is_zero() {
            call.detail("execute.queue", t.queue);
        }
        host.registry()
            .metrics()
            .instantiated(t.spare, t.instantiate);
        if t.spare {
            call.detail("execute.spare", t.instantiate);
        } else {
            call.detail("execute.instantiate", t.instantiate);
            call.detail("execute.store", t.store);
        }
        call.detail("execute.upstream", t.upstream);
        call.detail("execute.guest", t.run.saturating_sub(t.upstream));
        if let Some((cx, _)) = live {
            crate::telemetry::end_execute(&cx, &call.stages);
        }
        let outcome = outcome::outcome(call, executed);
        call.stage("outcome");
        if let (Outcome::Refused { category, .. }, Some(intent)) = (&outcome, &call.durable_intent)
            && *category == Category::Unknown
        {
            call.unknown = Some(UnknownEffect {
                mapping,
                intent: intent.clone(),
                queryable,
                revision,
                retry,
                carrier,
            });
        }
        return outcome;
    }
}

/// Reconciles a call whose effect ended unknown, within the call: the answer then says
/// what the contract's query found (see [`reconcile`]).
async fn reconcile_now(
    host: &Arc<Host>,
    call: &Call,
    unknown: UnknownEffect,
    outcome: Outcome,
) -> Outcome {
    let record = match host.registry().store().intent(&unknown.intent) {
        Ok(Some(r)) => r,
        Ok(None) | Err(_) => return outcome,
    };
    let mut result = reconcile::reconcile(
        host,
        &unknown.mapping,
        &record,
        unknown.queryable,
        Some(&unknown.carrier),
    )
    .await;
    // An idempotent effect that cannot be asked is sent again, with the same key: the
    // upstream replays what it did, or does it once.
    if let (reconcile::Reconciled::Held(_), false, Some((function, param))) =
        (&result, unknown.queryable, &unknown.retry)
    {
        match reconcile::retry_same_key(host, &unknown.mapping, &record, function, param).await {
            reconcile::Retried::Completed(value) => {
                return outcome::reconciled(
                    call,
                    &unknown.mapping,
                    unknown.revision,
                    &record,
                    value,
                    function.result.as_ref(),
                    "retry",
                )
                .unwrap_or(outcome);
            }
            reconcile::Retried::Failed(why) => result = reconcile::Reconciled::Held(why),
        }
    }
    tracing::info!(intent = %unknown.intent, result = ?result, "reconciled an unknown outcome");
    match result {
        reconcile::Reconciled::Completed(found) => {
            // The query returns `result<option<T>, _>`; `T` is the record found.
            let inner = unknown
                .mapping
                .queries
                .get(&record.intent.capability)
                .and_then(|q| q.result.as_ref())
                .and_then(|shape| match shape {
                    crate::contract::Shape::Result { ok: Some(ok), .. } => match &**ok {
                        crate::contract::Shape::Option(inner) => Some((**inner).clone()),
                        _ => None,
                    },
                    _ => None,
                });
            let wrapped = inner.map(|t| crate::contract::Shape::Result {
                ok: Some(Box::new(t)),
                err: None,
            });
            outcome::reconciled(
                call,
                &unknown.mapping,
                unknown.revision,
                &record,
                found,
                wrapped.as_ref(),
                "query",
            )
            .unwrap_or(outcome)
        }
        reconcile::Reconciled::Failed(why) => Outcome::refused(
            Category::Unavailable,
            format!(
                "the call's answer was lost, and the host then asked the upstream: {why}, so nothing happened (intent {}). The call may be made again.",
                unknown.intent
            ),
        ),
        reconcile::Reconciled::Held(why) => Outcome::refused(
            Category::Unknown,
            format!(
                "the outcome is unknown and could not be reconciled now ({why}); it is held for an operator as intent {}. {}",
                unknown.intent,
                outcome::DO_NOT_RETRY
            ),
        ),
    }
}

/// Records the outcome event and commits every queued event of the call (with the
/// intent's final state, when it has a durable intent).
///
/// - A shared store (PostgreSQL: a commit is about a millisecond of waiting on the
///   database, and one host's calls wait for each other's commits, see the store's group
///   commit) commits inside `block_in_place`: the runtime worker's other tasks move to
///   another thread meanwhile, so the front keeps reading requests and the calls that
///   reach their commit queue up and share the next transaction (not on a current-thread
///   runtime, where `block_in_place` is not allowed).
/// - The embedded store makes a call without a durable intent durable with one write to
///   its trace journal ([`crate::store::journal`], a few µs), on the worker; the journal
///   is moved into the trace off the call's path. A call with a durable intent commits
///   its intent's final state with its events in one transaction.
///
/// Either way a call's answer waits for the write that holds its events.
async fn finish_off_worker(host: &Host, call: &mut Call, outcome: &Outcome) -> anyhow::Result<()> {
    let store = host.registry().store();
    let finishing = finishing(call, outcome);
    if store.is_shared() {
        let multi_thread = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        return if multi_thread {
            tokio::task::block_in_place(|| finishing.commit(store))
        } else {
            finishing.commit(store)
        };
    }
    finishing.commit(store)
}

/// A finished call's events and observations, ready to commit.
enum Finishing {
    /// With the final state of its durable intent (id), committed with the intent's row
    /// (and the handles a completed compensable effect keeps).
    Intent(
        String,
        IntentState,
        Vec<NewEvent>,
        Vec<NewObservation>,
        Vec<crate::store::IntentHandle>,
    ),
    /// A call without a durable intent.
    Call(Vec<NewEvent>, Vec<NewObservation>),
}

impl Finishing {
    /// Commits in one transaction, alone.
    fn commit(self, store: &dyn crate::store::Store) -> anyhow::Result<()> {
        match self {
            Finishing::Intent(intent, state, events, observations, handles) => {
                store.finish_intent(&intent, state, events, observations, handles)
            }
            Finishing::Call(events, observations) => store.append_call(events, observations),
        }
    }
}

/// Records the outcome event and takes every queued event and observation of the call
/// (with the intent's final state, when it has a durable intent).
fn finishing(call: &mut Call, outcome: &Outcome) -> Finishing {
    let stages: serde_json::Map<String, Value> = call
        .stages
        .iter()
        .map(|(k, v)| ((*k).to_string(), json!(v)))
        .collect();
    let mut payload = outcome.trace_summary();
    if let Some(o) = payload.as_object_mut() {
        o.insert("session".into(), json!(call.session.id_text()));
        o.insert(
            "elapsed_us".into(),
            json!(call.started.elapsed().as_micros() as u64),
        );
        o.insert("stages_us".into(), Value::Object(stages));
        if let Some(intent) = &call.intent {
            o.insert("intent".into(), json!(intent));
        }
        if let Some(digest) = &call.rechecked_policy {
            o.insert("recheck_policy_digest".into(), json!(&**digest));
        }
        // The request's spans, for an auditor going from this trace to them.
        if let Some((trace_id, span_id)) = call
            .trace
            .as_ref()
            .and_then(|(cx, _)| crate::telemetry::ids(cx))
        {
            o.insert("otel_trace_id".into(), json!(trace_id));
            o.insert("otel_span_id".into(), json!(span_id));
        }
    }
    // A durable intent's final state rides on the outcome event, under its MAC: the
    // trace's proof of the row (intent::prove_intent).
    let durable = call.durable_intent.take().map(|intent| {
        let (state, handles) = match outcome {
            Outcome::Completed(c) => (IntentState::Completed, c.handles.clone()),
            Outcome::Refused { category, .. } if *category == Category::Unknown => {
                (IntentState::Unknown, Vec::new())
            }
            _ => (IntentState::Failed, Vec::new()),
        };
        if let Some(o) = payload.as_object_mut() {
            o.insert("intent_state".into(), json!(state));
            // The proof of the handles kept with the row (compensate::prove_handles).
            if let Some(digest) = crate::store::plans::handles_sha256(&handles) {
                o.insert("handles_sha256".into(), json!(digest));
            }
        }
        (intent, state, handles)
    });
    call.event(events::CALL_OUTCOME, payload);
    let events = call.take_events();
    let observations = std::mem::take(&mut call.observations);
    match durable {
        Some((intent, state, handles)) => {
            Finishing::Intent(intent, state, events, observations, handles)
        }
        None => Finishing::Call(events, observations),
    }
}
