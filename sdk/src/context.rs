//! The call this adapter instance serves (`airlock:host/context@0.2.0`).
//!
//! Calling anything here makes the component import `airlock:host/context@0.2.0`, so it
//! **targets `airlock:host@0.2.0`**: its world is `airlock:worlds/<contract>-adapter@0.2.0`
//! (`wit/worlds-v0.2.0/worlds.wit`), which exports the same contract interface as the
//! 0.1.0-host world and imports `upstream` and `log` unchanged. Nothing else changes for
//! the adapter: the same export macro, the same [`crate::upstream`] and [`crate::log`].
//! A host older than 0.2.0 refuses such a component at load; an adapter that never calls
//! this module keeps targeting `airlock:host@0.1.0`.
//!
//! Each call runs in a fresh instance, so an answer holds for the whole call.

pub use crate::bindings_host::airlock::host0_2_0::context::Intent;

#[cfg(target_arch = "wasm32")]
use crate::bindings_host::airlock::host0_2_0::context as raw;

/// The intent this call carries out: its id (`int_…`), its idempotency key (`idk_…`, the
/// same on every attempt of the intent) and the attempt number (from 1). `None` for a
/// read, which has no effect to make exactly once. For the host's reconciliation query it
/// is the intent being reconciled.
///
/// Pass [`Intent::idempotency_key`] to the upstream unchanged; never make up a key.
pub fn current_intent() -> Option<Intent> {
    #[cfg(target_arch = "wasm32")]
    return raw::current_intent();
    #[cfg(not(target_arch = "wasm32"))]
    return crate::native::current_intent();
}

/// Milliseconds left before the call's deadline, rounded down; 0 once it has passed.
/// Past the deadline the host stops the instance and upstream requests fail as
/// `unavailable`.
pub fn remaining_ms() -> u64 {
    #[cfg(target_arch = "wasm32")]
    return raw::remaining_ms();
    #[cfg(not(target_arch = "wasm32"))]
    return crate::native::remaining_ms();
}
