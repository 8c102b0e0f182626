//! The `source-retrieval` contract (`airlock:contracts/source-retrieval@0.1.0`): search a set
//! of sources, then retrieve one by reference. Effect class: read; idempotent.
//!
//! Implement [`Guest`] (also named [`SourceRetrieval`]) and export it with
//! [`crate::export_source_retrieval!`]. A [`SourceRef`] holds the adapter's own locator (a
//! note id, a relative path); the host swaps it for an opaque token before the model sees it,
//! and back before the adapter gets it.

pub use crate::bindings::exports::airlock::contracts::source_retrieval::{
    ContractError, Guest, RetrieveRequest, SearchRequest, SourceHit, SourcePassage, SourceRef,
};

/// The contract's trait under a descriptive name; the same trait as [`Guest`].
pub use crate::bindings::exports::airlock::contracts::source_retrieval::Guest as SourceRetrieval;

impl ContractError {
    /// A [`ContractError::InvalidRequest`] with `why`.
    pub fn invalid_request(why: impl Into<String>) -> Self {
        ContractError::InvalidRequest(why.into())
    }

    /// A [`ContractError::UpstreamFailed`] with `why`.
    pub fn upstream_failed(why: impl Into<String>) -> Self {
        ContractError::UpstreamFailed(why.into())
    }
}
