//! Stage 3, authorize: policy decides `allow | deny | require-approval` for the normalized
//! request (see [`crate::policy`] for how Cedar is asked).
//!
//! Rules:
//! - The decision uses the requester, profile, capability (effect class, mapping and its
//!   revision and state, connection, data class), the call's destination scope and artifact
//!   size, the transport and the protocol generation; never anything the model claims.
//! - A denial is a tool result with a bounded category and no hint of what else exists.
//! - Require-approval binds a [`PendingApproval`] to the exact consequence
//!   ([`ReceiptBinding`]: requester, session, capability, mapping and revision, snapshot,
//!   policy digest, normalized-arguments digest) for [`crate::pipeline::approve`].
//! - The decision is traced (`call-decided`) with the policy digest and the policies that
//!   determined it.

use serde_json::json;

use crate::host::Host;
use crate::pipeline::normalize::Normalized;
use crate::pipeline::offer::capability_facts;
use crate::pipeline::{Call, Category, Outcome};
use crate::policy::{CallFacts, Decision, DenyCategory, Verdict};
use crate::registry::events;
use crate::store::ReceiptBinding;

/// A request policy allows, or that a person approved.
pub struct Authorized {
    normalized: Normalized,
    decision: Decision,
    receipt: Option<crate::pipeline::approve::Receipt>,
}

impl Authorized {
    /// The normalized request.
    pub fn normalized(&self) -> &Normalized {
        &self.normalized
    }

    /// The decision it rests on.
    pub fn decision(&self) -> &Decision {
        &self.decision
    }

    /// The approval receipt, when a person approved it.
    pub fn receipt(&self) -> Option<&crate::pipeline::approve::Receipt> {
        self.receipt.as_ref()
    }

    /// A pending approval that a person approved: authorized with its receipt (only
    /// [`crate::pipeline::approve`] holds a [`Receipt`](crate::pipeline::approve::Receipt)).
    pub(super) fn approved(
        pending: PendingApproval,
        receipt: crate::pipeline::approve::Receipt,
    ) -> Self {
        Self {
            normalized: pending.normalized,
            decision: pending.decision,
            receipt: Some(receipt),
        }
    }
}

/// A request that runs only once a person approved exactly it.
pub struct PendingApproval {
    normalized: Normalized,
    decision: Decision,
    binding: ReceiptBinding,
}

impl PendingApproval {
    /// The normalized request.
    pub fn normalized(&self) -> &Normalized {
        &self.normalized
    }

    /// What a receipt for it must be bound to.
    pub fn binding(&self) -> &ReceiptBinding {
        &self.binding
    }

    /// The require-approval decision.
    pub fn decision(&self) -> &Decision {
        &self.decision
    }
}

/// What authorization concluded.
pub enum Authorization {
    /// Policy allows it.
    Allowed(Authorized),
    /// A person must approve it.
    NeedsApproval(PendingApproval),
}

/// The policy facts of a normalized call.
pub(crate) fn call_facts<'a>(n: &'a Normalized) -> CallFacts<'a> {
    let c = n.candidate();
    CallFacts {
        profile: &c.session.profile().name,
        transport: c.session.requester().transport,
        protocol: &c.abilities.protocol,
        destination: n.scope(),
        artifact_bytes: n
            .content()
            .and_then(|f| f.get("bytes"))
            .and_then(serde_json::Value::as_u64),
    }
}

/// The binding a receipt for `n` must carry.
pub(crate) fn binding(n: &Normalized, policy_digest: &str) -> ReceiptBinding {
    let cap = n.capability();
    ReceiptBinding {
        requester: n.candidate().session.requester().name.clone(),
        session: n.candidate().session.id_text().to_string(),
        capability: cap.name.clone(),
        mapping: cap.mapping.name.clone(),
        mapping_revision: n.revision(),
        snapshot_digest: n.snapshot().to_string(),
        policy_digest: policy_digest.to_string(),
        args_digest: n.args_digest().to_string(),
        artifact_digest: n
            .content()
            .and_then(|f| f.get("sha256"))
            .and_then(serde_json::Value::as_str)
            .map(str::to_string),
    }
}

/// The words a denial gives the model.
pub(crate) fn denial(category: DenyCategory) -> Outcome {
    match category {
        DenyCategory::CapabilityUnavailable => Outcome::refused(
            Category::CapabilityUnavailable,
            "this session's policy does not permit this call",
        ),
        DenyCategory::OutsideScope => Outcome::refused(
            Category::OutsideScope,
            "this session's policy does not permit this call where it reaches",
        ),
    }
}

/// Decides `normalized` (see the module rules).
///
/// # Errors
/// A denial, as an [`Outcome`].
pub(super) fn authorize(
    host: &Host,
    call: &mut Call,
    normalized: Normalized,
) -> Result<Authorization, Outcome> {
    let cap = normalized.capability();
    let record = cap.mapping.record();
    let decision = host.policy().decide_call(
        normalized.candidate().session.principal(),
        &capability_facts(cap, normalized.revision(), record.state.as_str()),
        &call_facts(&normalized),
    );
    call.event(
        events::CALL_DECIDED,
        json!({
            "capability": cap.name,
            "mapping": cap.mapping.name,
            "revision": normalized.revision(),
            "decision": decision.verdict,
            "policy_digest": &*decision.policy_digest,
            "determining": decision.determining,
            "errors": decision.errors.len(),
            "args_digest": normalized.args_digest(),
            "effect_class": cap.semantics.class,
        }),
    );
    match decision.verdict {
        Verdict::Allow => Ok(Authorization::Allowed(Authorized {
            normalized,
            decision,
            receipt: None,
        })),
        Verdict::RequireApproval => {
            let binding = binding(&normalized, &decision.policy_digest);
            Ok(Authorization::NeedsApproval(PendingApproval {
                normalized,
                decision,
                binding,
            }))
        }
        Verdict::Deny(category) => {
            tracing::debug!(capability = %cap.name, category = category.as_str(), "denied by policy");
            Err(denial(category))
        }
    }
}
