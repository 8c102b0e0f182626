//! Stage 7, execute: the adapter runs in a fresh wasmtime Store from its mapping's
//! `InstancePre`, under its grants, memory limit and deadline (see [`crate::runtime`]).
//!
//! Rules:
//! - Only a [`Ready`] call executes, and it executes exactly the contract value the
//!   re-check produced (host-supplied fields filled in); the adapter reaches only the
//!   upstream tools its mapping pins, on its own connection.
//! - A call with a durable intent runs as an [`Attempt`]: each of its upstream requests is
//!   recorded `sent` before it goes out and answered (or not) when it ends. Reads record
//!   nothing: they pay for no intent they do not need.
//! - When the host records (`airlock serve --record`, [`crate::record`]), the call keeps
//!   its upstream exchanges and is written, redacted, as one fixture file once it ran
//!   (the file write is on the call's path: recording is an author's tool). When it does
//!   not, nothing is kept: one check of an `Option` per call, one per upstream request.

use std::sync::Arc;

use crate::host::Host;
use crate::pipeline::Call;
use crate::pipeline::attempt::Attempt;
use crate::pipeline::recheck::Ready;
use crate::runtime::{CallContext, CallOutcome};

/// What the adapter did.
pub struct Executed {
    ready: Ready,
    result: CallOutcome,
    attempt: Option<Arc<Attempt>>,
}

impl Executed {
    /// The ready call it ran.
    pub fn ready(&self) -> &Ready {
        &self.ready
    }

    /// Where the adapter call's time went.
    pub fn timings(&self) -> crate::runtime::CallTimings {
        self.result.timings
    }

    pub(super) fn into_parts(self) -> (Ready, CallOutcome, Option<Arc<Attempt>>) {
        (self.ready, self.result, self.attempt)
    }
}

/// Runs the adapter for `ready`; `cancel` ends the adapter's upstream waits; with
/// `trace`, each upstream request gets a client span under it.
pub(super) async fn execute(
    host: &Host,
    call: &mut Call,
    ready: Ready,
    cancel: Option<tokio_util::sync::CancellationToken>,
    trace: Option<crate::upstream::spans::CallTrace>,
) -> Executed {
    let cap = ready.intended().authorized().normalized().capability();
    let mapping = &cap.mapping;
    let attempt = call
        .durable_intent
        .as_deref()
        .map(|intent| Arc::new(Attempt::new(host.registry().shared_store(), intent, 1)));
    let context = CallContext {
        intent_id: Some(ready.intended().intent_id().to_string()),
        idempotency_key: ready.intended().idempotency_key().map(str::to_string),
        attempt: 1,
        attempts: attempt
            .clone()
            .map(|a| a as Arc<dyn crate::runtime::AttemptLog>),
        cancel,
        record: host.recorder().is_some(),
        trace,
    };
    let mut result = mapping
        .adapter
        .call(
            &cap.function.name,
            std::slice::from_ref(ready.param()),
            mapping.grant.clone(),
            context,
        )
        .await;
    if let Some(recorder) = host.recorder() {
        record(recorder, &ready, &mut result);
    }
    Executed {
        ready,
        result,
        attempt,
    }
}

/// Writes the call and its upstream exchanges as one fixture file (`serve --record`). A
/// failure to write is logged; the call's answer is not affected.
fn record(recorder: &crate::record::Recorder, ready: &Ready, outcome: &mut CallOutcome) {
    use crate::record::{CallRecord, ContractCall, Fixture, FixtureConnection, FixtureMapping};
    let cap = ready.intended().authorized().normalized().capability();
    let mapping = &cap.mapping;
    let function = &cap.function;
    // Handles as the adapter's own locators: replay gives the adapter what it got here.
    let mut locators = |_: &str, locator: &str| -> anyhow::Result<String> { Ok(locator.into()) };
    let input = match function.params.first() {
        Some((_, shape)) => crate::contract::val_to_json(shape, ready.param(), &mut locators),
        None => Ok(serde_json::Value::Null),
    };
    let outcome_record = match (&outcome.result, &function.result) {
        (Ok(val), Some(shape)) => {
            crate::contract::val_to_json(shape, val, &mut locators).map(CallRecord::Result)
        }
        (Ok(_), None) => Ok(CallRecord::Result(serde_json::Value::Null)),
        (Err(failure), _) => Ok(CallRecord::Failure(failure.kind().to_string())),
    };
    let (input, outcome_record) = match (input, outcome_record) {
        (Ok(i), Ok(o)) => (i, o),
        (Err(e), _) | (_, Err(e)) => {
            tracing::warn!(mapping = %mapping.name, "not recorded: {e:#}");
            return;
        }
    };
    let record = mapping.record();
    let fixture = Fixture {
        airlock_fixture: crate::record::FIXTURE_FORMAT,
        mapping: FixtureMapping {
            name: mapping.name.clone(),
            revision: record.revision,
            manifest_sha256: mapping.manifest_digest.clone(),
        },
        connection: FixtureConnection {
            name: mapping.connection.name.clone(),
            id: mapping.connection.revision.connection_id.clone(),
        },
        snapshot_digest: mapping.grant.snapshot.load().to_string(),
        recorded_at: humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string(),
        redacted_fields: Vec::new(),
        call: ContractCall {
            function: function.name.clone(),
            input,
            idempotency_key: ready.intended().idempotency_key().map(str::to_string),
            outcome: outcome_record,
        },
        exchanges: std::mem::take(&mut outcome.exchanges),
    };
    match recorder.write(fixture) {
        Ok(path) => {
            tracing::info!(mapping = %mapping.name, path = %path.display(), "call recorded")
        }
        Err(e) => tracing::warn!(mapping = %mapping.name, "not recorded: {e:#}"),
    }
}
