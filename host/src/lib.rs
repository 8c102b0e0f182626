//! Airlock: runs reviewed MCP adapters as WebAssembly components between an AI
//! application (a model-facing MCP client) and upstream MCP servers.

pub mod cli;
pub mod config;
pub mod contract;
pub mod pipeline;
pub mod registry;
pub mod runtime;
pub mod store;
pub mod upstream;

/// Folder holding the adapters this build compiled and pinned (one folder per mapping,
/// each with its component and pinned `mapping.toml`).
pub const ADAPTER_BUNDLE: &str = env!("AIRLOCK_ADAPTER_BUNDLE");
