//! Airlock: runs reviewed MCP adapters as WebAssembly components between an AI
//! application (a model-facing MCP client) and upstream MCP servers.
//!
//! The host is laid out by stage (DESIGN.md §1, §5):
//! - [`front`]: the MCP server the AI application talks to (stdio today): builds a
//!   candidate from `tools/call`, renders the outcome; nothing else.
//! - [`pipeline`]: the life of one call — candidate → normalize → authorize → (approve)
//!   → intent → re-check → execute → outcome — one module per stage, each a typed value
//!   handed to the next; sessions and their reference tables; what a session is offered.
//! - [`policy`]: Cedar policies, the schema they are validated against, decisions.
//! - [`runtime`]: wasmtime Engine, per-mapping `InstancePre`, fresh Store per call,
//!   grants and limits.
//! - [`upstream`]: one rmcp client per connection, output budgets while reading, raw
//!   discovery capture.
//! - [`registry`]: connection identity, snapshots, drift, pins, mapping lifecycle, the
//!   live catalogue and hot reload.
//! - [`store`]: SQLite — connections, snapshots, mappings, approvals, intents, the
//!   trace, MACed with the host key and chained (group commit), its checkpoints.
//! - [`record`]: recorded fixtures — what `airlock serve --record` writes (redacted) and
//!   `airlock test` replays against the real component with no live connection.
//! - [`contract`]: WIT contract types → model-facing schema, strict JSON ↔ values.
//! - [`canonical`]: RFC 8785 canonical JSON, written directly on the hot path.
//! - [`config`]: the serve configuration.
//! - [`private_fs`]: the owner, mode and no-symlink rules of private folders and files
//!   (state folder, database, trace key, checkpoints, compiled cache).
//! - [`shutdown`]: stopping a serving host — signals, draining calls in flight, stopping
//!   every upstream process group.
//! - [`host`]: the composition root that owns the live registry and the policy engine.
//! - [`cli`]: the `airlock` command line and its operator commands.

pub mod canonical;
pub mod cli;
pub mod config;
pub mod contract;
pub mod front;
#[doc(hidden)]
pub mod fuzzing;
pub mod host;
pub mod jsonrpc;
pub mod pipeline;
pub mod policy;
pub mod private_fs;
pub mod random;
pub mod record;
pub mod registry;
pub mod runtime;
pub mod shutdown;
pub mod store;
pub mod upstream;

/// Folder holding the adapters this build compiled and pinned (one folder per mapping,
/// each with its component and pinned `mapping.toml`).
pub const ADAPTER_BUNDLE: &str = env!("AIRLOCK_ADAPTER_BUNDLE");
