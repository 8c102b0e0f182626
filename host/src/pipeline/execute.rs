//! Stage 7, execute: the adapter runs in a fresh wasmtime Store from its mapping's
//! `InstancePre`, under its grants, memory limit and deadline (see [`crate::runtime`]).
//!
//! Rule: only a [`Ready`] call executes, and it executes exactly the contract value the
//! re-check produced (host-supplied fields filled in); the adapter reaches only the
//! upstream tools its mapping pins, on its own connection.

use crate::pipeline::Call;
use crate::pipeline::recheck::Ready;
use crate::runtime::CallOutcome;

/// What the adapter did.
pub struct Executed {
    ready: Ready,
    result: CallOutcome,
}

impl Executed {
    /// The ready call it ran.
    pub fn ready(&self) -> &Ready {
        &self.ready
    }

    pub(super) fn into_parts(self) -> (Ready, CallOutcome) {
        (self.ready, self.result)
    }
}

/// Runs the adapter for `ready`.
pub(super) async fn execute(_call: &mut Call, ready: Ready) -> Executed {
    let cap = ready.intended().authorized().normalized().capability();
    let mapping = &cap.mapping;
    let result = mapping
        .adapter
        .call(
            &cap.function.name,
            std::slice::from_ref(ready.param()),
            mapping.grant.clone(),
            crate::runtime::CallContext {
                intent_id: Some(ready.intended().intent_id().to_string()),
                idempotency_key: ready.intended().idempotency_key().map(str::to_string),
                attempt: 1,
                attempts: None,
                cancel: None,
            },
        )
        .await;
    Executed { ready, result }
}
