//! Airlock: runs reviewed MCP adapters as WebAssembly components between an AI
//! application (a model-facing MCP client) and upstream MCP servers.
//!
//! This crate is the `airlock` command line ([`cli`]: `serve`, the operator commands,
//! the author kit, `demo`). Everything else lives in crates whose dependencies run one
//! way (README "Layout" draws the graph); this crate re-exports each under the module
//! name the code, the tests and the benchmarks use:
//! - [`front`], [`pipeline`], [`registry`], [`config`], [`shutdown`], [`host`],
//!   [`review`] (crate `airlock-gateway`): the MCP server the AI application talks to, the
//!   life of one call stage by stage, the live catalogue, the serve configuration,
//!   stopping a host, the composition root, the review of a mapping (the CLI's and the
//!   console's).
//! - [`runtime`], [`contract`] and [`registry::manifest`] (crate `airlock-runtime`):
//!   wasmtime Engine, per-mapping `InstancePre`, a fresh Store per call, grants, limits
//!   and output budgets; WIT contract types → model-facing schema, strict JSON ↔ values.
//! - [`upstream`] and [`record`] (crate `airlock-upstream`): one rmcp client per
//!   connection, output budgets while reading, raw discovery capture; recorded fixtures
//!   (what `airlock serve --record` writes, redacted, and `airlock test` replays).
//! - [`store`] (crate `airlock-store`): SQLite or a shared PostgreSQL — connections,
//!   snapshots, mappings, approvals, intents, the trace (MACed with the host key,
//!   chained, journaled), its checkpoints.
//! - [`policy`] (crate `airlock-policy`): Cedar policies, their schema, decisions.
//! - [`canonical`], [`random`], [`private_fs`], [`jsonrpc`] (crate `airlock-core`): RFC
//!   8785 canonical JSON, OS random bytes, the owner/mode/no-symlink rules of private
//!   folders and files, JSON-RPC framing.
//!
//! Crates: this one uses all of the above; none of them uses it.

pub mod cli;

#[doc(hidden)]
pub use airlock_gateway::fuzzing;
pub use airlock_gateway::{
    ADAPTER_BUNDLE, config, console, decisions, front, host, metrics, pipeline, registry, review,
    shutdown, status, telemetry,
};
pub use airlock_gateway::{
    canonical, contract, jsonrpc, policy, private_fs, random, record, runtime, store, upstream,
};
