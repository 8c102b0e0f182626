//! What a session is offered (`tools/list`): profile ∩ serving mappings ∩ healthy
//! connections ∩ policy.
//!
//! Rules:
//! - A capability is offered when it is in the session's profile, its mapping serves
//!   (`active`, or `limited` and the session's profile or requester is in its scope:
//!   [`crate::registry::Pins::limited_to`]; pins matching), its connection is healthy (open, last
//!   re-discovery succeeded), and policy does not deny it outright for this requester and
//!   profile (allow or require-approval, decided without argument facts).
//! - The model sees the local name, the reviewed description and the input schema derived
//!   from the contract, never an upstream name or description.
//! - The order is fixed: sorted by capability name (byte order), the same on every call
//!   whatever order mappings were loaded or reloaded in, so a client's cache and the
//!   digest below change only when what is offered changes.
//! - The offered catalogue's digest is sha256 of the RFC 8785 canonical JSON of the exact
//!   list sent, order included; a session whose offer changed gets a `catalog-offered`
//!   trace event with it.

use rmcp::model::Tool;
use serde_json::json;
use sha2::Digest as _;

use crate::host::Host;
use crate::pipeline::candidate::ClientAbilities;
use crate::pipeline::session::Session;
use crate::policy::{CallFacts, CapabilityFacts, Verdict};
use crate::registry::events;
use crate::registry::live::Capability;
use crate::store::NewEvent;

/// The catalogue offered to one session now.
#[derive(Debug, Clone)]
pub struct Offered {
    /// The tools, sorted by name.
    pub tools: Vec<Tool>,
    /// sha256 of their canonical JSON.
    pub digest: String,
}

/// The policy facts of a capability as it serves now.
pub(crate) fn capability_facts<'a>(
    cap: &'a Capability,
    revision: i64,
    state: &'a str,
) -> CapabilityFacts<'a> {
    CapabilityFacts {
        name: &cap.name,
        contract: &cap.mapping.contract.interface,
        function: &cap.function.name,
        effect_class: cap.semantics.class.as_str(),
        idempotent: cap.semantics.idempotent,
        queryable: cap.semantics.queryable,
        compensable: cap.semantics.compensable,
        mapping: &cap.mapping.name,
        mapping_revision: revision,
        mapping_state: state,
        connection: &cap.mapping.connection.name,
        data_class: &cap.mapping.data_class,
    }
}

/// Whether `cap` is offered to `session` now (see the module rules).
pub fn offerable(
    host: &Host,
    session: &Session,
    cap: &Capability,
    abilities: &ClientAbilities,
) -> bool {
    let mapping = &cap.mapping;
    if !session
        .profile()
        .includes(&cap.name, &mapping.connection.name)
        || !mapping.serves()
        || !mapping.connection.is_healthy()
    {
        return false;
    }
    let record = mapping.record();
    // A limited rollout is offered to the profiles and requesters it names, nobody else.
    if record.state == crate::store::MappingState::Limited
        && !crate::registry::in_limited_scope(
            &crate::registry::Pins::from_value(&record.pins).limited_to,
            &session.profile().name,
            session.principal().name(),
        )
    {
        return false;
    }
    let decision = host.policy().decide_call(
        session.principal(),
        &capability_facts(cap, record.revision, record.state.as_str()),
        &CallFacts {
            profile: &session.profile().name,
            transport: session.requester().transport,
            protocol: &abilities.protocol,
            destination: None,
            artifact_bytes: None,
        },
    );
    !matches!(decision.verdict, Verdict::Deny(_))
}

/// The catalogue offered to `session` now; the session remembers the names as offered,
/// and a changed offer is traced.
pub fn offered(host: &Host, session: &Session, abilities: &ClientAbilities) -> Offered {
    let catalog = host.catalog();
    let mut tools: Vec<Tool> = catalog
        .capabilities
        .iter()
        .filter(|c| offerable(host, session, c, abilities))
        .map(|c| {
            Tool::new(
                c.name.clone(),
                c.description.clone(),
                c.input_schema.clone(),
            )
        })
        .collect();
    tools.sort_by(|a, b| a.name.cmp(&b.name));
    let canonical = serde_json::to_value(&tools)
        .ok()
        .and_then(|v| serde_json_canonicalizer::to_vec(&v).ok())
        .unwrap_or_default();
    let digest = hex::encode(sha2::Sha256::digest(&canonical));
    session.remember(tools.iter().map(|t| t.name.as_ref()));
    if session.offer_differs(&digest) {
        let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
        let event = NewEvent::new(
            events::CATALOG_OFFERED,
            session.id_text(),
            json!({
                "stage": "offered",
                "session": session.id_text(),
                "requester": session.requester().name,
                "profile": session.profile().name,
                "digest": digest,
                "capabilities": names,
                "policy_digest": &**host.policy().current().digest(),
            }),
        );
        match host.registry().store().append_events(vec![event]) {
            Ok(()) => session.record_offer(&digest),
            Err(e) => tracing::error!(
                "could not trace the offered catalogue (it is traced again with the next list): {e:#}"
            ),
        }
    }
    Offered { tools, digest }
}
