//! `airlock policy`: explain a decision to an operator, validate the policy files, print
//! the schema.
//!
//! Rule: `policy check` decides exactly as a serving host would — the same policy files,
//! the same entities (the capability's effect class from the contract, its mapping's
//! revision and state from the store when there is one, its connection and data class from
//! the manifest) and the same two questions — and shows both answers and the policies that
//! determined them. Handle arguments are given as the adapter's locators (an operator has
//! no session tokens): a `destination-ref` field names the destination scope.

use anyhow::{Context as _, Result, bail};
use serde::Serialize;
use serde_json::Value;
use sha2::Digest as _;

use crate::config::ServeConfig;
use crate::contract;
use crate::policy::{CallFacts, CapabilityFacts, Decision, Policy, PolicyEngine, Principal};
use crate::registry::manifest::MappingManifest;

/// What `policy check` found.
#[derive(Debug, Serialize)]
pub struct Check {
    pub requester: String,
    pub roles: Vec<String>,
    pub profile: String,
    pub profile_in_reach: bool,
    pub use_profile: Decision,
    pub capability: String,
    pub mapping: String,
    pub mapping_revision: i64,
    pub mapping_state: String,
    pub effect_class: String,
    pub destination: Option<String>,
    pub args_digest: Option<String>,
    /// The decision as a serving host makes it (approved = false, then true on a deny).
    pub decision: Decision,
    /// The decision for a call holding a receipt (approved = true).
    pub with_receipt: Decision,
    pub policy_digest: String,
    pub files: Vec<crate::policy::PolicyFile>,
    /// Where each determining policy came from.
    pub origins: Vec<(String, String)>,
}

/// Inputs of `policy check`.
pub struct CheckRequest<'a> {
    pub config: &'a ServeConfig,
    pub requester: &'a str,
    pub roles: &'a [String],
    pub profile: Option<&'a str>,
    pub capability: &'a str,
    pub args: Option<&'a str>,
    pub artifact_bytes: Option<u64>,
    /// The registry, when a state folder exists (for the mapping's revision and state).
    pub registry: Option<&'a crate::registry::Registry>,
}

/// Decides like a serving host and explains it.
///
/// # Errors
/// The policy does not load, the capability is not in any configured mapping, or the
/// arguments are not valid for it.
pub fn check(req: &CheckRequest<'_>) -> Result<Check> {
    let policy = Policy::load(&req.config.policy_files)?;
    let profile = req.config.profile(req.profile)?.clone();
    let mut manifests = Vec::new();
    for path in &req.config.mappings {
        manifests.push(MappingManifest::load(path)?);
    }
    if let Some(dir) = &req.config.mappings_dir {
        for path in crate::registry::live::mapping_dir_manifests(dir)? {
            manifests.push(MappingManifest::load(&path)?);
        }
    }
    let (manifest, cap) = manifests
        .iter()
        .find_map(|m| {
            m.capabilities
                .iter()
                .find(|c| c.name == req.capability)
                .map(|c| (m, c))
        })
        .with_context(|| {
            format!(
                "no configured mapping offers a capability named `{}`",
                req.capability
            )
        })?;
    let function = cap.function.clone();
    let c = crate::registry::contracts::ContractSet::judge(
        req.config,
        req.registry.map(|r| r.store()),
    )?
    .get(&manifest.mapping.contract)?;
    // As the capability would serve: the contract's declaration as the mapping narrowed it.
    let semantics = manifest
        .semantics(cap, &c)
        .with_context(|| format!("{}#{function} has no effect semantics", c.interface))?;
    let (revision, state) = match req.registry {
        Some(r) => match r.store().mapping(&manifest.mapping.name)? {
            Some(rec) => (rec.revision, rec.state.as_str().to_string()),
            None => (0, "candidate".to_string()),
        },
        None => (0, "active".to_string()),
    };
    let mut destination = None;
    let mut args_digest = None;
    if let Some(text) = req.args {
        let args: Value = serde_json::from_str(text).context("--args is not JSON")?;
        let f = &c.functions[&function];
        let (_, shape) = &f.params[0];
        let val = contract::json_to_val(shape, &args, &mut |kind, locator| {
            if c.handle_role(kind) == Some(crate::contract::HandleRole::Scope) {
                destination = Some(locator.to_string());
            }
            Ok(locator.to_string())
        })
        .map_err(|e| anyhow::anyhow!("--args for `{}`: {e}", req.capability))?;
        let normalized = contract::val_to_json(shape, &val, &mut |_, l| Ok(l.to_string()))?;
        let bytes = serde_json_canonicalizer::to_vec(&normalized)?;
        args_digest = Some(hex::encode(sha2::Sha256::digest(&bytes)));
    }
    let principal = Principal::new(req.requester, req.roles, "stdio")?;
    let engine = PolicyEngine::new(policy);
    let facts = CapabilityFacts {
        name: req.capability,
        contract: &c.interface,
        function: &function,
        effect_class: semantics.class.as_str(),
        idempotent: semantics.idempotent,
        queryable: semantics.queryable,
        compensable: semantics.compensable,
        mapping: &manifest.mapping.name,
        mapping_revision: revision,
        mapping_state: &state,
        connection: &manifest.mapping.connection,
        data_class: &manifest.mapping.data_class,
    };
    let call = CallFacts {
        profile: &profile.name,
        transport: "stdio",
        protocol: "2025-11-25",
        destination: destination.as_deref(),
        artifact_bytes: req.artifact_bytes,
    };
    let decision = engine.decide_call(&principal, &facts, &call);
    let with_receipt = engine.decide_call_with(&engine.current(), &principal, &facts, &call, true);
    let use_profile = engine.may_use_profile(&principal, &profile.name);
    let current = engine.current();
    let origins = decision
        .determining
        .iter()
        .chain(&with_receipt.determining)
        .map(|id| (id.clone(), current.origin(id).unwrap_or("?").to_string()))
        .collect();
    Ok(Check {
        requester: req.requester.to_string(),
        roles: req.roles.to_vec(),
        profile_in_reach: profile.includes(req.capability, &manifest.mapping.connection),
        profile: profile.name,
        use_profile,
        capability: req.capability.to_string(),
        mapping: manifest.mapping.name.clone(),
        mapping_revision: revision,
        mapping_state: state,
        effect_class: semantics.class.as_str().to_string(),
        destination,
        args_digest,
        policy_digest: decision.policy_digest.to_string(),
        files: current.files().to_vec(),
        decision,
        with_receipt,
        origins,
    })
}

fn verdict_text(d: &Decision) -> String {
    match d.verdict {
        crate::policy::Verdict::Allow => "allow".into(),
        crate::policy::Verdict::RequireApproval => "require-approval".into(),
        crate::policy::Verdict::Deny(c) => format!("deny ({})", c.as_str()),
    }
}

impl Check {
    /// The explanation for people.
    pub fn to_text(&self) -> String {
        let mut out = format!(
            "decision: {}\n  requester  {}{}\n  profile    {} (use-profile: {}){}\n  capability {} — mapping {} revision {} ({}), effect {}\n",
            verdict_text(&self.decision),
            self.requester,
            if self.roles.is_empty() {
                String::new()
            } else {
                format!(" (roles {})", self.roles.join(", "))
            },
            self.profile,
            verdict_text(&self.use_profile),
            if self.profile_in_reach {
                ""
            } else {
                " — NOT in this profile: the session would not be offered it (unknown tool)"
            },
            self.capability,
            self.mapping,
            self.mapping_revision,
            self.mapping_state,
            self.effect_class,
        );
        if let Some(d) = &self.destination {
            out.push_str(&format!("  destination {d}\n"));
        }
        if let Some(d) = &self.args_digest {
            out.push_str(&format!("  arguments  sha256 {d}\n"));
        }
        out.push_str(&format!(
            "  with a receipt (approved = true): {}\n",
            verdict_text(&self.with_receipt)
        ));
        out.push_str(&format!("  policy     {}\n", self.policy_digest));
        for f in &self.files {
            out.push_str(&format!(
                "    {} ({} policies, sha256 {})\n",
                f.label,
                f.policies,
                crate::registry::short(&f.sha256)
            ));
        }
        if self.origins.is_empty() {
            out.push_str("  determined by: no policy permits it (default deny)\n");
        } else {
            out.push_str("  determined by:\n");
            for (id, file) in &self.origins {
                out.push_str(&format!("    {id} ({file})\n"));
            }
        }
        for e in self.decision.errors.iter().chain(&self.with_receipt.errors) {
            out.push_str(&format!("  evaluation error (policy skipped): {e}\n"));
        }
        out
    }
}

/// `airlock policy validate`: loads the configuration's policy.
///
/// # Errors
/// It does not load or validate.
pub fn validate(config: &ServeConfig) -> Result<Policy> {
    let policy = Policy::load(&config.policy_files)?;
    if policy.files().is_empty() {
        bail!("no policy files");
    }
    Ok(policy)
}
