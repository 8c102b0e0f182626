//! The gateway: everything a serving Airlock host does between the AI application and the
//! adapters, laid out by stage (DESIGN.md §1, §5).
//!
//! - [`front`]: the MCP server the AI application talks to (stdio and Streamable HTTP,
//!   OAuth 2.1 bearer tokens): builds a candidate from `tools/call`, renders the outcome;
//!   nothing else.
//! - [`pipeline`]: the life of one call — candidate → normalize → authorize → (approve)
//!   → intent → re-check → execute → outcome — one module per stage, each a typed value
//!   handed to the next; sessions and their reference tables; what a session is offered.
//! - [`registry`]: connection identity, snapshots, drift, pins, mapping lifecycle, the
//!   live catalogue and hot reload, trace anchoring.
//! - [`config`]: the serve configuration (TOML), parsed and checked whole.
//! - [`shutdown`]: stopping a serving host — signals, draining calls in flight, stopping
//!   every upstream process group.
//! - [`metrics`]: Prometheus metrics with bounded labels; [`telemetry`]: OpenTelemetry
//!   spans with the MCP trace context on both hops; [`status`]: what the store says now.
//! - [`decisions`]: a person's decisions (approvals, intent resolutions), one
//!   implementation for the CLI and the [`console`], the operator's web pages.
//! - [`review`]: the review of a mapping and of an adapter's grants, and the approval that
//!   pins it — one renderer for the CLI (`airlock review`, `snapshots`, `grants`) and the
//!   [`console`].
//! - [`host`]: the composition root that owns the live registry and the policy engine.
//!
//! The rule this crate enforces is the call's: only a policy-approved request reaches an
//! adapter, and every outcome — allowed, refused, unknown — is answered and traced.
//!
//! Crates: this one uses `airlock-runtime`, `airlock-store`, `airlock-upstream`,
//! `airlock-policy` and `airlock-core`, and re-exports them under their module names
//! ([`runtime`], [`store`], …) so the stages name them one way; none of them uses this
//! crate. Only the `airlock` crate (the command line) uses it.

pub mod config;
pub mod console;
pub mod decisions;
pub mod front;
#[doc(hidden)]
pub mod fuzzing;
pub mod host;
pub mod metrics;
pub mod pipeline;
pub mod registry;
pub mod review;
pub mod shutdown;
pub mod status;
pub mod telemetry;

pub use airlock_core::{canonical, jsonrpc, private_fs, random};
pub use airlock_policy as policy;
pub use airlock_runtime as runtime;
pub use airlock_runtime::{ADAPTER_BUNDLE, contract};
pub use airlock_store as store;
pub use airlock_upstream as upstream;
pub use airlock_upstream::record;
