//! Stage 6, re-check: immediately before the adapter runs, everything the decision rested
//! on is checked again (DESIGN.md §5.6).
//!
//! Rules:
//! - **Catalogue current.** If the server announced a change (`list_changed`, counted at the
//!   transport) or the last re-discovery failed, re-discover first, bounded by the call's
//!   deadline; a failure refuses the call (`unavailable`).
//! - **Mapping.** It must still serve, under the revision the call was decided on and the
//!   same load. A mapping swapped for a newer revision meanwhile restarts a call without a
//!   receipt (decided again on what serves now); a call with a receipt is refused: the
//!   receipt was for the old revision.
//! - **Snapshot.** A call with a receipt requires the connection's snapshot to be the one
//!   it was approved against.
//! - **Connection healthy**, **policy** (the current one; with `approved` when the call
//!   holds a receipt) still allows it, and **every reference** still resolves to the same
//!   locator.
//! - A refusal says `state changed` (or `policy no longer permits`, `unavailable`) and the
//!   trace records what changed (`call-refused`).
//! - Then the host-supplied fields (the idempotency key) are filled in.

use std::time::Duration;

use serde_json::json;
use wasmtime::component::Val;

use crate::contract;
use crate::host::Host;
use crate::pipeline::authorize::call_facts;
use crate::pipeline::candidate::Candidate;
use crate::pipeline::intent::Intended;
use crate::pipeline::offer::capability_facts;
use crate::pipeline::references::Origin;
use crate::pipeline::session::Session;
use crate::pipeline::{Call, Category, Outcome};
use crate::policy::Verdict;
use crate::registry::events;
use crate::registry::live::Capability;

/// A call ready to run: re-checked, its host-supplied fields filled in.
pub struct Ready {
    intended: Intended,
    param: Val,
}

impl Ready {
    /// The intended call.
    pub fn intended(&self) -> &Intended {
        &self.intended
    }

    /// The contract value the adapter receives.
    pub fn param(&self) -> &Val {
        &self.param
    }
}

/// Why a call is not ready.
pub(super) enum NotReady {
    /// Refused, with the outcome to return.
    Refused(Outcome),
    /// A newer revision of the mapping serves; the call may start again.
    Superseded(Box<Candidate>),
}

/// Records a refusal before the adapter: `call-refused` with what changed.
fn refused(
    call: &mut Call,
    cap: &Capability,
    session: &Session,
    changed: &str,
    category: Category,
    detail: String,
) -> Outcome {
    let record = cap.mapping.record();
    call.event(
        events::CALL_REFUSED,
        json!({
            "capability": cap.name,
            "mapping": cap.mapping.name,
            "revision": record.revision,
            "state": record.state,
            "category": category,
            "changed": changed,
            "session": session.id_text(),
        }),
    );
    tracing::debug!(capability = %cap.name, mapping = %cap.mapping.name, changed, "refused before the adapter: {}: {detail}", category.as_str());
    Outcome::refused(category, detail)
}

/// The refusal for a mapping that does not serve (`state changed`).
pub(super) fn not_serving(call: &mut Call, cap: &Capability, session: &Session) -> Outcome {
    let record = cap.mapping.record();
    refused(
        call,
        cap,
        session,
        "mapping-state",
        Category::StateChanged,
        format!(
            "this capability is {} and serves no new calls until a reviewer approves it again",
            record.state
        ),
    )
}

/// Re-discovers the capability's connection (it announced a change, or its last
/// re-discovery failed), bounded by the call's deadline.
///
/// # Errors
/// `unavailable` when re-discovery failed or took too long.
pub(super) async fn refresh(host: &Host, call: &mut Call, cap: &Capability) -> Result<(), Outcome> {
    let mapping = &cap.mapping;
    let deadline = Duration::from_millis(mapping.adapter.limits().deadline_ms);
    let refreshed =
        tokio::time::timeout(deadline, host.live().refresh(&mapping.connection, false)).await;
    let failure = match refreshed {
        Ok(Ok(())) => return Ok(()),
        Ok(Err(e)) => format!("{e:#}"),
        Err(_) => format!(
            "re-discovery took longer than the call's {} ms deadline",
            deadline.as_millis()
        ),
    };
    tracing::warn!(mapping = %mapping.name, "re-check could not re-discover: {failure}");
    let session = call.session.clone();
    Err(refused(
        call,
        cap,
        &session,
        "connection",
        Category::Unavailable,
        "the upstream connection's catalogue could not be re-checked; try again later".into(),
    ))
}

/// Re-checks `intended` (see the module rules).
pub(super) async fn recheck(
    host: &Host,
    call: &mut Call,
    intended: Intended,
) -> Result<Ready, NotReady> {
    let a = intended.authorized();
    let n = a.normalized();
    let cap = n.capability();
    let mapping = &cap.mapping;
    let has_receipt = a.receipt().is_some();
    let session = n.candidate().session.clone();
    let refuse = |call: &mut Call, changed: &str, category: Category, detail: String| {
        NotReady::Refused(refused(call, cap, &session, changed, category, detail))
    };

    // The connection's catalogue is current.
    let state = &mapping.connection;
    if state.is_stale() {
        refresh(host, call, cap).await.map_err(NotReady::Refused)?;
    }

    // The mapping still serves, the same load and revision.
    let current = host.catalog().mappings.get(&mapping.name).cloned();
    match current {
        None => {
            return Err(refuse(
                call,
                "mapping-unloaded",
                Category::StateChanged,
                "this capability is no longer served".into(),
            ));
        }
        Some(cur) if cur.generation != mapping.generation => {
            if has_receipt {
                return Err(refuse(
                    call,
                    "mapping-revision",
                    Category::StateChanged,
                    "a new revision of this capability's mapping serves since the call was approved; make the call again to ask anew".into(),
                ));
            }
            return Err(NotReady::Superseded(Box::new(n.candidate().again())));
        }
        Some(_) => {}
    }
    let record = mapping.record();
    if !record.state.serves() {
        return Err(NotReady::Refused(not_serving(
            call,
            cap,
            &n.candidate().session,
        )));
    }
    if record.revision != n.revision() {
        if has_receipt {
            return Err(refuse(
                call,
                "mapping-revision",
                Category::StateChanged,
                format!(
                    "this capability is at revision {} now, not the revision {} this call was approved for",
                    record.revision,
                    n.revision()
                ),
            ));
        }
        return Err(NotReady::Superseded(Box::new(n.candidate().again())));
    }
    if has_receipt && *state.snapshot_digest() != n.snapshot() {
        return Err(refuse(
            call,
            "snapshot",
            Category::StateChanged,
            "the upstream connection's catalogue changed since this call was approved; make the call again to ask anew".into(),
        ));
    }
    if state.connection().degraded().is_some() {
        return Err(refuse(
            call,
            "connection-degraded",
            Category::Unavailable,
            "the upstream connection is degraded: its server broke the protocol, and it serves no calls until the host restarts it".into(),
        ));
    }
    if !state.is_healthy() {
        return Err(refuse(
            call,
            "connection",
            Category::Unavailable,
            "the upstream connection is not available; try again later".into(),
        ));
    }

    // The current policy still allows it.
    let decision = host.policy().decide_call_with(
        &host.policy().current(),
        n.candidate().session.principal(),
        &capability_facts(cap, record.revision, record.state.as_str()),
        &call_facts(n),
        has_receipt,
    );
    call.rechecked_policy = Some(decision.policy_digest.clone());
    if decision.verdict != Verdict::Allow {
        return Err(refuse(
            call,
            "policy",
            Category::PolicyNoLongerPermits,
            "the policy in force now does not permit this call".into(),
        ));
    }

    // Every reference still stands for the same object.
    let origin = Origin {
        mapping: mapping.name.as_str().into(),
        generation: mapping.generation,
        revision: record.revision,
    };
    let table = n.candidate().session.references();
    for h in n.handles() {
        match table.resolve(&h.token, &h.kind, &origin) {
            Ok(r) if r.locator == h.resolved.locator => {}
            Ok(_) | Err(_) => {
                return Err(refuse(
                    call,
                    "reference",
                    Category::StateChanged,
                    format!(
                        "a {} this call names is no longer valid; ask for a fresh one",
                        h.kind
                    ),
                ));
            }
        }
    }

    let mut param = n.param().clone();
    if let Some(key) = intended.idempotency_key() {
        contract::fill_host_supplied(&cap.function.params[0].1, &mut param, key);
    }
    n.candidate().session.remember([cap.name.as_str()]);
    Ok(Ready { intended, param })
}
