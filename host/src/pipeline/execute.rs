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

/// Runs the adapter for `ready`; `cancel` ends the adapter's upstream waits.
pub(super) async fn execute(
    host: &Host,
    call: &mut Call,
    ready: Ready,
    cancel: Option<tokio_util::sync::CancellationToken>,
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
    };
    let result = mapping
        .adapter
        .call(
            &cap.function.name,
            std::slice::from_ref(ready.param()),
            mapping.grant.clone(),
            context,
        )
        .await;
    Executed {
        ready,
        result,
        attempt,
    }
}
