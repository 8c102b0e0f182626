//! The `artifact-delivery` contract (`airlock:contracts/artifact-delivery@0.2.0`): prepare an
//! artifact, list the destinations the upstream offers, deliver the artifact to one of them
//! at most once, and find out afterwards whether a delivery happened.
//!
//! Effect classes, declared by the host: `prepare` local transformation,
//! `list-destinations` read, `deliver` **external effect**, `query` read. The host calls
//! `query` itself to reconcile a delivery whose outcome is unknown (a dropped connection, a
//! timeout); it is never offered to the model.
//!
//! Implement [`Guest`] (also named [`ArtifactDelivery`]) and export it with
//! [`crate::export_artifact_delivery!`]. The rules an implementation relies on:
//!
//! - **Handles.** An [`ArtifactRef`] or a [`DestinationRef`] holds the adapter's own locator
//!   (the upstream's artifact id, its destination id). The host swaps it for an opaque
//!   token before the model sees it, and back before the adapter gets it: the adapter
//!   always reads and writes its own locators.
//! - **Host-supplied idempotency key.** [`DeliverRequest::idempotency_key`] and
//!   [`QueryRequest::idempotency_key`] ([`IdempotencyKey`]) never come from the model: the
//!   host fills them with the call's intent key, the same on every attempt of one approved
//!   call. Pass it to the upstream unchanged, so that a repeated request delivers nothing
//!   twice, and look deliveries up by it in `query`.
//! - **Never retry a delivery.** A `deliver` whose upstream request failed in an unknown
//!   way returns an error; the host reconciles through `query`, never by calling
//!   `deliver` again blindly.
//!
//! Upstream failures convert with `?`: [`crate::upstream::UpstreamError`] and
//! [`crate::upstream::StructuredError`] implement `Into<ContractError>` (see
//! [`crate::upstream`] for the table).

pub use crate::bindings_delivery::exports::airlock::contracts::artifact_delivery::{
    ArtifactRef, ContractError, DeliverRequest, Delivery, Destination, DestinationRef,
    DestinationsRequest, Guest, IdempotencyKey, PrepareRequest, PreparedArtifact, QueryRequest,
};

/// The contract's trait under a descriptive name; the same trait as [`Guest`].
pub use crate::bindings_delivery::exports::airlock::contracts::artifact_delivery::Guest as ArtifactDelivery;

impl ContractError {
    /// A [`ContractError::InvalidRequest`] with `why`.
    pub fn invalid_request(why: impl Into<String>) -> Self {
        ContractError::InvalidRequest(why.into())
    }

    /// A [`ContractError::Unavailable`] with `why`.
    pub fn unavailable(why: impl Into<String>) -> Self {
        ContractError::Unavailable(why.into())
    }

    /// A [`ContractError::UpstreamFailed`] with `why`.
    pub fn upstream_failed(why: impl Into<String>) -> Self {
        ContractError::UpstreamFailed(why.into())
    }

    /// A [`ContractError::Conflict`] with `why`: the idempotency key was already used for a
    /// different delivery.
    pub fn conflict(why: impl Into<String>) -> Self {
        ContractError::Conflict(why.into())
    }
}
