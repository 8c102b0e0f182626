//! Airlock's foundation: the pieces every other Airlock crate stands on, none of which
//! knows what a call, a mapping or a store is.
//!
//! - [`canonical`]: RFC 8785 canonical JSON, written directly on the hot path (digests of
//!   arguments, trace payloads, policy versions).
//! - [`destination`]: network destinations as grants name them, and the address ranges a
//!   named host may not resolve to without an explicit grant.
//! - [`random`]: random bytes for ids, tokens and nonces, each byte from the OS source and
//!   handed out once.
//! - [`private_fs`]: the owner, mode and no-symlink rules of private folders and files
//!   (state folder, database, trace key, checkpoints, compiled cache).
//! - [`jsonrpc`]: JSON-RPC framing shared by the model-facing front and the upstream
//!   transport (the id of a message that does not parse, found in its raw bytes).
//! - [`text`]: untrusted text escaped for people (controls, bidi and invisible characters).
//! - [`Secret`]: a configured secret value whose `Debug` output is redacted.
//!
//! Rule: this crate depends on no other Airlock crate, and on nothing that runs Wasm,
//! speaks MCP, evaluates policy or opens a database. Every other crate may use it.

pub mod canonical;
pub mod destination;
pub mod jsonrpc;
pub mod private_fs;
pub mod random;
pub mod text;

/// A secret value (a `[secrets]` entry, a header value drawn from one). Its `Debug` output
/// is redacted, so a configuration or connection printed with `{:?}` shows no secret.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}
