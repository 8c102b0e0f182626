//! Airlock's foundation: the pieces every other Airlock crate stands on, none of which
//! knows what a call, a mapping or a store is.
//!
//! - [`canonical`]: RFC 8785 canonical JSON, written directly on the hot path (digests of
//!   arguments, trace payloads, policy versions).
//! - [`random`]: random bytes for ids, tokens and nonces, each byte from the OS source and
//!   handed out once.
//! - [`private_fs`]: the owner, mode and no-symlink rules of private folders and files
//!   (state folder, database, trace key, checkpoints, compiled cache).
//! - [`jsonrpc`]: JSON-RPC framing shared by the model-facing front and the upstream
//!   transport (the id of a message that does not parse, found in its raw bytes).
//!
//! Rule: this crate depends on no other Airlock crate, and on nothing that runs Wasm,
//! speaks MCP, evaluates policy or opens a database. Every other crate may use it.

pub mod canonical;
pub mod jsonrpc;
pub mod private_fs;
pub mod random;
