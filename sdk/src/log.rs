//! Adapter diagnostics (`airlock:host/log`).
//!
//! The host captures these messages, bounded per call, into its trace; the model never sees
//! them. Messages past the host's per-call budget are dropped. Never log secrets or whole
//! upstream payloads.

pub use crate::bindings::airlock::host::log::Level;

/// Records `message` at `level`.
pub fn log(level: Level, message: &str) {
    #[cfg(target_arch = "wasm32")]
    crate::bindings::airlock::host::log::log(level, message);
    #[cfg(not(target_arch = "wasm32"))]
    crate::native::log(level, message);
}

/// Records a debug message.
pub fn debug(message: &str) {
    log(Level::Debug, message);
}

/// Records an informational message.
pub fn info(message: &str) {
    log(Level::Info, message);
}

/// Records a warning.
pub fn warn(message: &str) {
    log(Level::Warn, message);
}

/// Records an error.
pub fn error(message: &str) {
    log(Level::Error, message);
}
