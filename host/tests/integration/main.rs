//! Airlock's integration tests, linked into one test binary.
//!
//! Each module drives real parts: the `airlock` binary or an in-process `Host`, real
//! fixture MCP servers over stdio, real components built from `adapters/` and
//! `fixtures/adapters/`, real Python and TypeScript MCP clients. One binary instead of
//! one per file: every test binary links wasmtime, cranelift and rmcp, so twelve of them
//! cost twelve links and several gigabytes of `target/` for no isolation the harness
//! does not already give (each test builds its own deployment in its own temp folder).
//! Run one area with `cargo test -p airlock --test integration approvals::`.

mod common;

mod approvals;
mod approvals_hostile;
mod author_kit;
mod budgets;
mod confine;
mod conformance;
mod console;
mod contracts;
mod demo;
mod effects;
mod filesystem;
mod front_errors;
mod grants_cli;
mod host_versions;
mod hostile;
mod http;
mod http_upstream;
mod inspector;
mod knowledge_edits;
mod lifecycle;
mod memory_graph;
mod multi_host;
mod observability;
mod python_client;
mod python_server;
mod registry;
mod reload;
mod replay;
mod retention;
mod serve;
mod sessions;
mod spans;
mod store_suite;
mod store_trust;
mod version_control;
mod workspace_edits;
