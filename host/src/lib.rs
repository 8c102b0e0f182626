//! Airlock: runs reviewed MCP adapters as WebAssembly components between an AI
//! application (a model-facing MCP client) and upstream MCP servers.
//!
//! The host is laid out by stage (DESIGN.md §1, §5), in crates whose dependencies run one
//! way. This crate uses `airlock-runtime`, `airlock-store`, `airlock-upstream`,
//! `airlock-policy` and `airlock-core`, and re-exports them under their module names; none
//! of them uses this crate.
//! - [`front`]: the MCP server the AI application talks to (stdio and Streamable HTTP):
//!   builds a candidate from `tools/call`, renders the outcome; nothing else.
//! - [`pipeline`]: the life of one call — candidate → normalize → authorize → (approve)
//!   → intent → re-check → execute → outcome — one module per stage, each a typed value
//!   handed to the next; sessions and their reference tables; what a session is offered.
//! - [`policy`] (crate `airlock-policy`): Cedar policies, the schema they are validated
//!   against, decisions.
//! - [`runtime`] (crate `airlock-runtime`): wasmtime Engine, per-mapping `InstancePre`,
//!   fresh Store per call, grants and limits; the mapping manifest
//!   ([`registry::manifest`]) it loads.
//! - [`upstream`] (crate `airlock-upstream`): one rmcp client per connection, output
//!   budgets while reading, raw discovery capture.
//! - [`registry`]: connection identity, snapshots, drift, pins, mapping lifecycle, the
//!   live catalogue and hot reload.
//! - [`store`] (crate `airlock-store`): SQLite or a shared PostgreSQL — connections,
//!   snapshots, mappings, approvals, intents, the trace (MACed with the host key, chained,
//!   journaled), its checkpoints.
//! - [`record`] (crate `airlock-upstream`): recorded fixtures — what `airlock serve
//!   --record` writes (redacted) and `airlock test` replays against the real component
//!   with no live connection.
//! - [`contract`] (crate `airlock-runtime`): WIT contract types → model-facing schema, strict JSON ↔ values.
//! - [`canonical`], [`random`], [`private_fs`], [`jsonrpc`] (crate `airlock-core`): RFC 8785
//!   canonical JSON, OS random bytes, the owner/mode/no-symlink rules of private folders
//!   and files, JSON-RPC framing.
//! - [`config`]: the serve configuration.
//! - [`shutdown`]: stopping a serving host — signals, draining calls in flight, stopping
//!   every upstream process group.
//! - [`host`]: the composition root that owns the live registry and the policy engine.
//! - [`cli`]: the `airlock` command line and its operator commands.

pub mod cli;
pub mod config;
pub mod front;
#[doc(hidden)]
pub mod fuzzing;
pub mod host;
pub mod pipeline;
pub mod registry;
pub mod shutdown;

pub use airlock_core::{canonical, jsonrpc, private_fs, random};
pub use airlock_policy as policy;
pub use airlock_store as store;
pub use airlock_upstream as upstream;
pub use airlock_upstream::record;

pub use airlock_runtime as runtime;
pub use airlock_runtime::{ADAPTER_BUNDLE, contract};
