//! Airlock: runs reviewed MCP adapters as WebAssembly components between an AI
//! application (a model-facing MCP client) and upstream MCP servers.
//!
//! Stages, one module each:
//! - [`gateway`]: the MCP server the AI application talks to (`tools/list`, `tools/call`).
//! - [`contract`]: WIT contract types → model-facing schema, strict JSON ↔ values.
//! - [`references`]: opaque handles in place of adapter locators.
//! - [`runtime`]: wasmtime Engine, per-mapping `InstancePre`, fresh Store per call.
//! - [`upstream`]: one rmcp client per connection, output budgets while reading.
//! - [`manifest`], [`grants`] and [`config`]: reviewed mapping manifests, their grants
//!   (deny by default), and the serve configuration.
//! - [`demo`]: the embedded default session that `airlock demo` runs.
//! - [`review`]: the security reviewer's view of one adapter (`airlock grants`).

pub mod config;
pub mod contract;
pub mod demo;
pub mod drift;
pub mod gateway;
pub mod grants;
pub mod manifest;
pub mod operate;
pub mod references;
pub mod registry;
pub mod reload;
pub mod review;
pub mod runtime;
pub mod store;
pub mod upstream;

/// Folder holding the adapters this build compiled and pinned (one folder per mapping,
/// each with its component and pinned `mapping.toml`).
pub const ADAPTER_BUNDLE: &str = env!("AIRLOCK_ADAPTER_BUNDLE");
