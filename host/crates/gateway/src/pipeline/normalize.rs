//! Stage 2, normalize: the candidate becomes a request in the contract's own types.
//!
//! Rules (DESIGN.md §5.2):
//! - The capability is resolved in **this session's** catalogue: it must exist, be in the
//!   session's profile, and either be offered now or have been offered to this session
//!   before (then later stages say `state changed`). Anything else is "unknown tool", with
//!   no hint of what exists elsewhere.
//! - Arguments convert strictly into the contract function's WIT types
//!   ([`crate::contract`]): an unknown or missing property, a wrong type, or a value for a
//!   host-supplied field refuses the call (`invalid request`, a tool result with
//!   `isError: true` whose text names the path and what was expected, so the model can
//!   correct it — SEP-1303) and nothing runs.
//! - Every handle argument resolves in the session's reference table, for its kind, its
//!   mapping and the revision that serves now ([`crate::pipeline::references`]); one
//!   that does not is refused the same way, saying which reference to use instead.
//! - The **normalized-arguments digest** is sha256 of the RFC 8785 canonical JSON of the
//!   converted value with each handle replaced by its locator and host-supplied fields
//!   left out: it names the consequence (what the handles stand for), not the tokens.
//! - The catalogue it is resolved against is current: if the capability's connection
//!   announced a change (or its last re-discovery failed), it is re-discovered first,
//!   bounded by the call's deadline, so that nothing later (a decision, a receipt) rests on
//!   a snapshot the server already replaced. A mapping that does not serve then ends the
//!   call with `state changed` before any decision or approval.
//! - Facts policy may use come from resolved handles: a `destination-ref` is the call's
//!   destination scope (its locator); an `artifact-ref`'s `bytes` fact is the artifact
//!   size and its `sha256` fact the artifact digest.

use std::sync::Arc;

use serde_json::{Map, Value, json};
use sha2::Digest as _;
use wasmtime::component::Val;

use crate::contract;
use crate::host::Host;
use crate::pipeline::candidate::Candidate;
use crate::pipeline::references::{Origin, Resolved};
use crate::pipeline::{Call, Category, Outcome};
use crate::registry::events;
use crate::registry::live::{Capability, Catalog};

/// One handle argument as resolved.
#[derive(Debug, Clone)]
pub struct HandleUse {
    /// The handle kind (WIT alias, e.g. `destination-ref`).
    pub kind: String,
    /// The token the model passed.
    pub token: String,
    /// What it resolved to.
    pub resolved: Resolved,
}

/// A request in the contract's types, bound to one capability of one catalogue.
pub struct Normalized {
    candidate: Candidate,
    catalog: Arc<Catalog>,
    index: usize,
    param: Val,
    args_digest: String,
    handles: Vec<HandleUse>,
    revision: i64,
    snapshot: Arc<String>,
}

impl Normalized {
    /// The connection's snapshot digest when the request was normalized.
    pub fn snapshot(&self) -> &str {
        &self.snapshot
    }

    /// The candidate it came from.
    pub fn candidate(&self) -> &Candidate {
        &self.candidate
    }

    /// The capability.
    pub fn capability(&self) -> &Capability {
        &self.catalog.capabilities[self.index]
    }

    /// The catalogue it was resolved in.
    pub fn catalog(&self) -> &Arc<Catalog> {
        &self.catalog
    }

    /// The contract value (host-supplied fields still empty).
    pub fn param(&self) -> &Val {
        &self.param
    }

    /// sha256 of the canonical normalized arguments.
    pub fn args_digest(&self) -> &str {
        &self.args_digest
    }

    /// The handle arguments, resolved.
    pub fn handles(&self) -> &[HandleUse] {
        &self.handles
    }

    /// The mapping revision serving when the request was normalized.
    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// The argument handle the contract gives `role`, if the call names one (a contract
    /// lets a request hold at most one of each role).
    fn with_role(&self, role: crate::contract::HandleRole) -> Option<&HandleUse> {
        let contract = &self.capability().mapping.contract;
        self.handles
            .iter()
            .find(|h| contract.handle_role(&h.kind) == Some(role))
    }

    /// The call's scope for policy: the locator of its argument handle of role `scope`
    /// (`context.destination`), if any.
    pub fn scope(&self) -> Option<&str> {
        self.with_role(crate::contract::HandleRole::Scope)
            .map(|h| &*h.resolved.locator)
    }

    /// The content the call acts on: the facts its result reported for the argument
    /// handle of role `content` (`sha256`, `bytes`...), if any.
    pub fn content(&self) -> Option<&Map<String, Value>> {
        self.with_role(crate::contract::HandleRole::Content)
            .map(|h| h.resolved.facts.as_ref())
    }
}

/// The unknown-tool answer: the same words whatever the reason.
fn unknown_tool(name: &str) -> Outcome {
    let shown: String = name.chars().take(64).collect();
    Outcome::Invalid {
        message: format!("unknown tool `{}`", shown.escape_debug()),
    }
}

/// Normalizes `candidate` (see the module rules).
///
/// # Errors
/// An [`Outcome::Invalid`] for an unknown capability; an `invalid request`
/// [`Outcome::Refused`] for arguments that do not convert or references that do not
/// resolve.
pub(super) async fn normalize(
    host: &Host,
    call: &mut Call,
    candidate: Candidate,
) -> Result<Normalized, Outcome> {
    let raw = serde_json::to_vec(&candidate.arguments).unwrap_or_default();
    call.event(
        events::CALL_CANDIDATE,
        json!({
            "stage": "requested",
            "session": candidate.session.id_text(),
            "requester": candidate.session.requester().name,
            "profile": candidate.session.profile().name,
            "capability": candidate.name.chars().take(128).collect::<String>(),
            "arguments_sha256": hex::encode(sha2::Sha256::digest(&raw)),
            "arguments_bytes": raw.len(),
            "offered_digest": candidate.session.offered_digest(),
            "protocol": candidate.abilities.protocol,
        }),
    );
    let catalog = host.catalog();
    let session = candidate.session.clone();
    let Some(index) = catalog
        .capabilities
        .iter()
        .position(|c| c.name == candidate.name)
    else {
        return Err(unknown_tool(&candidate.name));
    };
    let cap = &catalog.capabilities[index];
    let mapping = &cap.mapping;
    call.mapping = Some(mapping.clone());
    if !session
        .profile()
        .includes(&cap.name, &mapping.connection.name)
    {
        return Err(unknown_tool(&candidate.name));
    }
    // Offered now (serving, healthy, permitted), or offered to this session before.
    if !session.knows(&cap.name) {
        if !crate::pipeline::offer::offerable(host, &session, cap, &candidate.abilities) {
            return Err(unknown_tool(&candidate.name));
        }
        session.remember([cap.name.as_str()]);
    }
    call.offered = true;
    // Decide on the catalogue the server stands behind now.
    if mapping.connection.is_stale() {
        crate::pipeline::recheck::refresh(host, call, cap).await?;
    }
    let record = mapping.record();
    if !record.state.serves() {
        return Err(crate::pipeline::recheck::not_serving(call, cap, &session));
    }
    let origin = Origin {
        mapping: mapping.name.as_str().into(),
        generation: mapping.generation,
        revision: record.revision,
    };
    let (_, shape) = &cap.function.params[0];
    let table = session.references();
    let mut handles = Vec::new();
    let args = Value::Object(candidate.arguments.clone());
    let param = contract::json_to_val(shape, &args, &mut |kind, token| {
        let resolved = table
            .resolve(token, kind, &origin)
            .map_err(|e| e.to_string())?;
        let locator = resolved.locator.to_string();
        handles.push(HandleUse {
            kind: kind.to_string(),
            token: token.to_string(),
            resolved,
        });
        Ok(locator)
    })
    .map_err(|e| {
        tracing::debug!(capability = %cap.name, error = %e, "refused arguments before the adapter");
        Outcome::refused(
            Category::InvalidRequest,
            format!(
                "invalid arguments for `{}`: {e}. Nothing ran; correct the arguments (see the tool's input schema) and call again.",
                cap.name
            ),
        )
    })?;
    let normalized = contract::val_to_json(
        shape,
        &param,
        &mut |_, locator| Ok(locator.to_string()),
    )
    .and_then(|v| {
        crate::canonical::to_string(&v)
            .map(String::into_bytes)
            .map_err(|e| anyhow::anyhow!("canonical JSON: {e}"))
    })
    .map_err(|e| {
        tracing::error!(capability = %cap.name, "normalized arguments did not convert back: {e:#}");
        Outcome::refused(
            Category::InvalidRequest,
            format!("invalid arguments for `{}`", cap.name),
        )
    })?;
    let args_digest = hex::encode(sha2::Sha256::digest(&normalized));
    let snapshot = mapping.connection.snapshot_digest();
    Ok(Normalized {
        candidate,
        catalog,
        index,
        param,
        args_digest,
        handles,
        revision: record.revision,
        snapshot,
    })
}
