//! The review of a mapping, one renderer for the command line (`airlock review`,
//! `airlock snapshots`, `airlock grants`) and the [`console`](crate::console): what is
//! recorded for a mapping, what its capabilities serve with, how its pins stand against
//! its connection's latest snapshot, and the approval that pins them.
//!
//! Rules:
//! - A review shows what the store and the trace prove: a serving revision the trace does
//!   not prove is shown TAMPERED (and is not served); a fixture-tested pass is the one its
//!   MACed trace event records.
//! - An approval pins the digests of a snapshot of the mapping's *current* connection
//!   revision, verifies the component against the manifest's pin first, and records the
//!   reviewer and time as a new mapping revision.
//! - Upstream-supplied text (server names, tool names, descriptions) is printed escaped and
//!   clipped: it is untrusted.
//!
//! [`grants`] is the security review of one adapter (`airlock grants MANIFEST`);
//! [`snapshots`] shows recorded snapshots and their tools.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context as _, Result, bail};
use serde::Serialize;
use serde_json::Value;

use crate::config::ServeConfig;
use crate::contract::EffectSemantics;
use crate::registry::drift::{Catalogue, Drift};
use crate::registry::live::{MappingSource, mapping_dir_manifests, open_registry};
use crate::registry::{Pins, Registry, short};
use crate::runtime::host_api::{self, HostVersion};
use crate::store::MappingRecord;

pub mod grants;
pub mod snapshots;

pub use airlock_core::text::{safe, safe_lines};
pub use snapshots::{snapshot_show, snapshots_list, snapshots_text, tool_show};

/// Formats unix milliseconds as RFC 3339.
pub fn time(ms: u64) -> String {
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms))
        .to_string()
}

/// One mapping's standing against a snapshot.
#[derive(Debug, Serialize)]
pub struct MappingCheck {
    /// Mapping name.
    pub mapping: String,
    /// Its latest revision.
    pub revision: i64,
    /// Its recorded state.
    pub state: String,
    /// Whether it would serve against this snapshot.
    pub would_serve: bool,
    /// Why not, if not.
    pub reason: Option<String>,
    /// Meaning-bearing drift on its pinned tools.
    pub drift: Vec<Drift>,
}

/// Judges `record`'s pins of `tools` against `catalogue` as if the mapping served, so a
/// reviewer sees the drift either way: would it serve, why not, and the meaning-bearing
/// drift on its pinned tools.
pub fn check(
    registry: &Registry,
    record: &MappingRecord,
    tools: &[String],
    catalogue: &Catalogue,
) -> MappingCheck {
    // Judge the pins as if the mapping served, so a reviewer sees the drift either way.
    let mut probe = record.clone();
    if !probe.state.serves() && probe.snapshot_digest.is_some() {
        probe.state = crate::store::MappingState::Active;
    }
    let verdict = registry.evaluate(&probe, tools, catalogue);
    let (would_serve, reason, drift) = match verdict {
        crate::registry::Verdict::Serves => (record.state.serves(), None, vec![]),
        crate::registry::Verdict::Blocked { reason, drift, .. } => (false, Some(reason), drift),
    };
    let reason = if reason.is_none() && !record.state.serves() {
        Some(format!("state is {}: {}", record.state, record.reason))
    } else {
        reason
    };
    MappingCheck {
        mapping: record.name.clone(),
        revision: record.revision,
        state: record.state.to_string(),
        would_serve,
        reason,
        drift,
    }
}

/// A server's self-reported name and version (an observation, not an identity), escaped
/// and clipped.
pub fn server_label(server: &Value) -> String {
    let name = server.get("name").and_then(Value::as_str).unwrap_or("?");
    let version = server.get("version").and_then(Value::as_str).unwrap_or("?");
    format!("{:?} {}", safe(name, 80), safe(version, 40))
}

/// `airlock review show`: a mapping's revisions, pins, and drift against its connection's
/// latest snapshot; the effect semantics its capabilities serve with; the host version its
/// component targets.
#[derive(Debug, Serialize)]
pub struct ReviewShow {
    /// Latest revision.
    pub current: MappingRecord,
    /// The capabilities of the latest revision's recorded manifest, each with the
    /// effective semantics it serves with (the contract's declaration as the manifest
    /// confirmed and narrowed it).
    pub capabilities: Vec<ShownCapability>,
    /// The operator's settings of the latest revision's recorded manifest (`[settings]`,
    /// which the adapter reads through `airlock:host/settings@0.3.0`); empty without one.
    pub settings: crate::runtime::manifest::Settings,
    /// Why the latest revision's recorded manifest does not parse, when it does not (its
    /// settings are then unknown, not empty).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub manifest_problem: Option<String>,
    /// The `airlock:host` version the revision's component targets (from its imports),
    /// when the component was read (`--config`) and is the revision's.
    pub host_version: Option<HostVersion>,
    /// Where `host_version` comes from, or why it is unknown.
    pub host_version_source: String,
    /// Every revision, oldest first.
    pub revisions: Vec<MappingRecord>,
    /// The connection's latest snapshot, if any.
    pub latest_snapshot: Option<String>,
    /// The check of the pins against it.
    pub check: Option<MappingCheck>,
    /// Set when the latest revision is in a serving state that the trace does not prove
    /// (the row was edited in the store): why, in words. Such a mapping is not served.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tampered: Option<String>,
    /// The newest `airlock test` pass that moved a revision of this mapping to
    /// `fixture-tested`, as its MACed trace event records it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fixture_tested: Option<FixtureTested>,
}

/// A passing `airlock test` run, from its trace event.
#[derive(Debug, Serialize)]
pub struct FixtureTested {
    /// The revision that became `fixture-tested`.
    pub revision: i64,
    /// The fixture folder's digest ([`crate::record::fixtures_digest`]).
    pub fixtures_sha256: String,
    /// How many fixture files it replayed.
    pub fixtures: u64,
    /// Whether stale fixtures (another revision or snapshot) were allowed.
    pub stale_allowed: bool,
    /// When, unix ms.
    pub at_ms: u64,
}

/// The newest verified `mapping-state-changed` event of `name` to `fixture-tested`.
fn fixture_tested(registry: &Registry, name: &str) -> Result<Option<FixtureTested>> {
    let proofs = registry.store().mapping_proofs(name)?;
    Ok(proofs
        .iter()
        .rev()
        .filter(|e| e.kind == crate::registry::events::MAPPING_STATE && e.subject == name)
        .find(|e| e.payload["to"] == "fixture-tested")
        .map(|e| FixtureTested {
            revision: e.payload["revision"].as_i64().unwrap_or(0),
            fixtures_sha256: e.payload["fixtures_sha256"]
                .as_str()
                .unwrap_or("?")
                .to_string(),
            fixtures: e.payload["fixtures"].as_u64().unwrap_or(0),
            stale_allowed: e.payload["stale_allowed"].as_bool().unwrap_or(false),
            at_ms: e.at_ms,
        }))
}

/// One capability of a recorded manifest and the semantics it serves with.
#[derive(Debug, Serialize)]
pub struct ShownCapability {
    /// The name the model sees.
    pub name: String,
    /// The contract function.
    pub function: String,
    /// Effective semantics; `None` when the manifest does not confirm them (see `problem`).
    pub effect: Option<EffectSemantics>,
    /// What the host declares for the function, before the mapping narrowed it.
    pub contract_effect: Option<EffectSemantics>,
    /// Why there are no effective semantics (e.g. a revision recorded before effects were
    /// confirmed in manifests: a host refuses to load that manifest now).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
}

/// The capabilities of recorded manifest `text` with their semantics.
fn shown_capabilities(
    text: Option<&str>,
    contracts: &crate::registry::contracts::ContractSet,
) -> Vec<ShownCapability> {
    let Some(Ok((contract, caps))) = text.map(crate::registry::manifest::recorded_capabilities)
    else {
        return Vec::new();
    };
    let contract = contracts.get(&contract);
    caps.into_iter()
        .map(|c| {
            let semantics = contract
                .as_ref()
                .map_err(|e| anyhow::anyhow!("{e:#}"))
                .and_then(|k| c.semantics(k));
            let (effect, problem) = match semantics {
                Ok(Some(s)) => (Some(s), None),
                Ok(None) => (
                    None,
                    Some("this host declares no effect semantics for it".into()),
                ),
                Err(e) => (None, Some(format!("{e:#}"))),
            };
            ShownCapability {
                contract_effect: contract
                    .as_ref()
                    .ok()
                    .and_then(|k| k.semantics(&c.function)),
                name: c.name,
                function: c.function,
                effect,
                problem,
            }
        })
        .collect()
}

/// The host version of `name`'s component as `config` deploys it, if that component is
/// the one `record` binds: (version, where it comes from).
fn shown_host_version(
    config: Option<&ServeConfig>,
    name: &str,
    record: &MappingRecord,
) -> (Option<HostVersion>, String) {
    use sha2::Digest as _;
    let Some(config) = config else {
        return (
            None,
            "unknown: pass --config FILE to read the component's imports".into(),
        );
    };
    let source = match find_mapping(config, name) {
        Ok(s) => s,
        Err(e) => return (None, format!("unknown: {e:#}")),
    };
    let actual = hex::encode(sha2::Sha256::digest(&source.component));
    if actual != record.component_sha256 {
        return (
            None,
            format!(
                "unknown: the configured component has sha256 {}, not this revision's {}",
                short(&actual),
                short(&record.component_sha256)
            ),
        );
    }
    match host_api::component_host_version(&source.component) {
        Ok(v) => (
            v,
            format!(
                "from the imports of the configured component (sha256 {}, this revision's)",
                short(&actual)
            ),
        ),
        Err(e) => (None, format!("refused: {e:#}")),
    }
}

/// See [`ReviewShow`]. With `config`, the mapping's component as it deploys is read for
/// its host version.
///
/// # Errors
/// Unknown mapping; the store fails.
pub fn review_show(
    registry: &Registry,
    name: &str,
    config: Option<&ServeConfig>,
) -> Result<ReviewShow> {
    let current = registry
        .store()
        .mapping(name)?
        .with_context(|| {
            let known: Vec<String> = registry
                .store()
                .mappings()
                .map(|l| l.into_iter().map(|r| r.name).collect())
                .unwrap_or_default();
            format!(
                "no mapping named `{name}` is recorded (recorded: {}); a mapping is recorded when a host loads it or a reviewer approves it",
                if known.is_empty() { "none".to_string() } else { known.join(", ") }
            )
        })?;
    let revisions = registry.store().mapping_revisions(name)?;
    let latest = registry.store().latest_snapshot(&current.connection_id)?;
    let check = latest.as_ref().and_then(|s| {
        let catalogue: Catalogue = serde_json::from_value(s.body.clone()).ok()?;
        let tools: Vec<String> = Pins::from_value(&current.pins)
            .tools
            .keys()
            .cloned()
            .collect();
        Some(check(registry, &current, &tools, &catalogue))
    });
    let (host_version, host_version_source) = shown_host_version(config, name, &current);
    let tampered = registry.prove(&current)?;
    let parsed = current
        .manifest_text
        .as_deref()
        .map(|t| crate::registry::manifest::MappingManifest::parse(t, name));
    let manifest_problem = match &parsed {
        Some(Err(e)) => Some(format!("{e:#}")),
        _ => None,
    };
    let settings = match parsed {
        Some(Ok(m)) => m.settings,
        _ => Default::default(),
    };
    Ok(ReviewShow {
        settings,
        manifest_problem,
        tampered,
        capabilities: shown_capabilities(current.manifest_text.as_deref(), &{
            // The contracts a host of `config` serves (the built-ins without one).
            match config {
                Some(c) => {
                    crate::registry::contracts::ContractSet::judge(c, Some(registry.store()))?
                }
                None => crate::registry::contracts::ContractSet::built_in(),
            }
        }),
        host_version,
        host_version_source,
        current,
        revisions,
        latest_snapshot: latest.map(|s| s.digest),
        check,
        fixture_tested: fixture_tested(registry, name)?,
    })
}

impl ReviewShow {
    /// For a person.
    pub fn to_text(&self) -> String {
        let c = &self.current;
        let mut o = String::new();
        let _ = writeln!(
            o,
            "mapping `{}` revision {}: {}",
            c.name, c.revision, c.state
        );
        if let Some(why) = &self.tampered {
            let _ = writeln!(
                o,
                "  TAMPERED: the trace does not prove this record, so it is not served: {why}"
            );
        }
        let _ = writeln!(o, "  reason: {}", c.reason);
        let _ = writeln!(
            o,
            "  reviewer: {}",
            c.reviewer.as_deref().unwrap_or("(none)")
        );
        let _ = writeln!(o, "  component sha256 {}", c.component_sha256);
        let _ = writeln!(o, "  manifest sha256  {}", c.manifest_digest);
        let _ = writeln!(
            o,
            "  connection {} revision {}",
            c.connection_id, c.config_revision
        );
        let _ = writeln!(
            o,
            "  pinned snapshot {}",
            c.snapshot_digest.as_deref().unwrap_or("(none)")
        );
        let _ = match self.host_version {
            Some(v) => writeln!(
                o,
                "  host version: airlock:host {v}, {}",
                self.host_version_source
            ),
            None => writeln!(o, "  host version: {}", self.host_version_source),
        };
        if c.manifest_text.is_none() {
            let _ = writeln!(o, "  capabilities: unknown (no manifest text recorded)");
        }
        if let Some(problem) = &self.manifest_problem {
            let _ = writeln!(
                o,
                "  recorded manifest does not parse ({}): capabilities and settings unknown",
                problem.escape_debug()
            );
        }
        for cap in &self.capabilities {
            let effect = match (&cap.effect, &cap.problem) {
                (Some(e), _) => grants::effect_text(e, cap.contract_effect.as_ref()),
                (None, problem) => format!(
                    "NOT CONFIRMED: {}",
                    problem.as_deref().unwrap_or("no effect semantics")
                ),
            };
            let _ = writeln!(
                o,
                "  capability {} -> {} [{effect}]",
                cap.name, cap.function
            );
        }
        for (name, value) in &self.settings {
            // Text prints escaped (Debug): no control character reaches the terminal.
            let _ = writeln!(o, "  setting {name} = {value}");
        }
        let pins = Pins::from_value(&c.pins);
        if pins.tools.is_empty() {
            let _ = writeln!(o, "  pins: none (not reviewed)");
        }
        for (tool, d) in &pins.tools {
            let _ = writeln!(
                o,
                "  pin {tool}: schema {} description {}",
                d.schema, d.description
            );
        }
        match (&self.latest_snapshot, &self.check) {
            (Some(s), Some(check)) => {
                let _ = writeln!(o, "against the connection's latest snapshot {}:", short(s));
                match &check.reason {
                    None => {
                        let _ = writeln!(o, "  pins match");
                    }
                    Some(r) => {
                        let _ = writeln!(o, "  {r}");
                    }
                }
                for d in &check.drift {
                    let _ = writeln!(o, "  ! {d}");
                }
            }
            _ => {
                let _ = writeln!(
                    o,
                    "no snapshot of its connection yet: run `airlock discover CONNECTION --config FILE`"
                );
            }
        }
        if let Some(f) = &self.fixture_tested {
            let _ = writeln!(
                o,
                "fixture-tested: revision {} passed {} fixture(s), fixtures sha256 {} at {}{}",
                f.revision,
                f.fixtures,
                f.fixtures_sha256,
                time(f.at_ms),
                if f.stale_allowed {
                    " (stale fixtures allowed: recorded under another revision or snapshot)"
                } else {
                    ""
                }
            );
        }
        let _ = writeln!(o, "revisions:");
        for r in &self.revisions {
            let _ = writeln!(
                o,
                "  {:>3}  {:<16} {}  {}{}",
                r.revision,
                r.state.as_str(),
                time(r.created_ms),
                r.reason,
                r.reviewer
                    .as_deref()
                    .map(|v| format!(" (reviewer {v})"))
                    .unwrap_or_default()
            );
        }
        o
    }
}

/// Text for `airlock review list`.
pub fn review_list_text(list: &[MappingRecord]) -> String {
    let mut o = String::new();
    if list.is_empty() {
        o.push_str("no mappings recorded; a host records each mapping when it first loads it\n");
    }
    for r in list {
        let _ = writeln!(
            o,
            "{:<24} rev {:>3}  {:<16} {}  {}",
            r.name,
            r.revision,
            r.state.as_str(),
            r.connection_id,
            r.reason
        );
    }
    o
}

/// Finds the manifest of mapping `name` among the configuration's mappings.
///
/// # Errors
/// No configured manifest declares that mapping; a manifest does not read.
pub fn find_mapping(config: &ServeConfig, name: &str) -> Result<MappingSource> {
    let mut paths = config.mappings.clone();
    if let Some(dir) = &config.mappings_dir {
        paths.extend(mapping_dir_manifests(dir)?);
    }
    let mut seen = Vec::new();
    for path in paths {
        let source = MappingSource::from_file(&path)?;
        if source.manifest.mapping.name == name {
            return Ok(source);
        }
        seen.push(source.manifest.mapping.name);
    }
    bail!(
        "no configured mapping is named `{name}` (configured: {})",
        seen.join(", ")
    )
}

/// `airlock review approve`: verifies the component against its pin, resolves the
/// connection's current revision, and pins `snapshot` (default: the connection's latest).
/// `manifest` approves a manifest outside the configuration (staged for deployment: a host
/// loads it without review once it lands in its mappings folder).
///
/// # Errors
/// See [`Registry::approve_tools`]; the component does not match its pin; no snapshot.
pub fn approve(
    config: &ServeConfig,
    name: &str,
    reviewer: &str,
    snapshot: Option<&str>,
    manifest: Option<&Path>,
    limited_to: &[String],
    acknowledge_annotations: bool,
) -> Result<MappingRecord> {
    let source = match manifest {
        None => find_mapping(config, name)?,
        Some(path) => {
            let source = MappingSource::from_file(path)?;
            if source.manifest.mapping.name != name {
                bail!(
                    "{} declares mapping `{}`, not `{name}`",
                    path.display(),
                    source.manifest.mapping.name
                );
            }
            source
        }
    };
    crate::registry::manifest::verify_pin(&source.manifest, &source.component)?;
    crate::registry::check_limited_scope(limited_to)?;
    for scope in limited_to {
        if let Some(profile) = scope.strip_prefix("profile:")
            && !config.profiles.contains_key(profile)
        {
            bail!(
                "--limited-to {scope}: the configuration has no profile `{profile}` (it has: {})",
                config
                    .profiles
                    .keys()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    let registry = open_registry(config)?;
    let conn_name = &source.manifest.mapping.connection;
    let server = config
        .connections
        .get(conn_name)
        .with_context(|| format!("mapping `{name}` uses connection `{conn_name}`, which the configuration does not define"))?;
    let rev = registry.identify(conn_name, server)?;
    let snap = match snapshot {
        Some(d) => registry
            .store()
            .snapshot(d)?
            .with_context(|| format!("no snapshot matches `{d}`"))?,
        None => registry
            .store()
            .latest_snapshot(&rev.connection_id)?
            .with_context(|| format!("connection `{conn_name}` has no snapshot yet: run `airlock discover {conn_name} --config FILE` and read what it reports first"))?,
    };
    // The mapping's most consequential capability, as its contract declares it.
    let contracts = crate::registry::contracts::ContractSet::judge(config, Some(registry.store()))?;
    let contract = crate::registry::live::check_contract(&source.manifest, &contracts)?;
    let class = source
        .manifest
        .capabilities
        .iter()
        .filter_map(|c| source.manifest.semantics(c, &contract))
        .map(|s| s.class)
        .max_by_key(|c| {
            crate::contract::EffectClass::ALL
                .iter()
                .position(|x| x == c)
        });
    registry.approve_tools_with(
        &crate::registry::MappingIdentity {
            name,
            tools: &source.manifest.upstream.tools,
            manifest_digest: &source.manifest_digest,
            manifest_text: Some(&source.text),
            component_sha256: source.manifest.pinned_sha256(),
        },
        &rev,
        &snap,
        reviewer,
        &crate::registry::ApprovalOptions {
            limited_to,
            class,
            acknowledge_annotations,
        },
    )
}
