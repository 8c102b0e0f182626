//! Operator and reviewer commands over the registry: `airlock discover`, `airlock
//! snapshots`, `airlock review` and `airlock trace`. Each returns a report that prints for
//! a person by default and as JSON for tools.
//!
//! Rules:
//! - Discovery records a snapshot and shows drift; it changes no mapping's state (a running
//!   host does that when it sees the same drift).
//! - An approval pins the digests of a snapshot of the mapping's *current* connection
//!   revision, verifies the component against the manifest's pin first, and records the
//!   reviewer and time as a new mapping revision.
//! - Upstream-supplied text (server names, tool names, descriptions) is printed escaped and
//!   clipped: it is untrusted.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context as _, Result, bail};
use serde::Serialize;
use serde_json::{Value, json};

use crate::config::ServeConfig;
use crate::contract::EffectSemantics;
use crate::registry::drift::{self, Catalogue, Drift};
use crate::registry::live::{MappingSource, mapping_dir_manifests, open_registry};
use crate::registry::{Pins, Registry, short};
use crate::runtime::host_api::{self, HostVersion};
use crate::store::{MappingRecord, SnapshotSummary, StoredSnapshot, TraceEvent};
use crate::upstream::Connection;

pub use airlock_core::text::{safe, safe_lines};

/// Formats unix milliseconds as RFC 3339.
pub fn time(ms: u64) -> String {
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms))
        .to_string()
}

/// The result of `airlock discover`.
#[derive(Debug, Serialize)]
pub struct DiscoverReport {
    /// Configured connection name.
    pub connection: String,
    /// Local connection id.
    pub connection_id: String,
    /// Configuration revision.
    pub config_revision: i64,
    /// Whether this configuration digest was new.
    pub new_revision: bool,
    /// The snapshot's digest.
    pub snapshot: String,
    /// Whether the snapshot's content was new.
    pub new_snapshot: bool,
    /// Reported server name and version (observations).
    pub server: Value,
    /// The protocol version the client negotiated (`2026-07-28` after `server/discover`,
    /// `2025-11-25` after `initialize`).
    pub protocol_version: String,
    /// Counts per list.
    pub counts: Value,
    /// Drift against the previous snapshot of this connection.
    pub previous: Option<String>,
    /// Classified drift against `previous`.
    pub drift: Vec<Drift>,
    /// Per mapping bound to this connection: its verdict against this snapshot.
    pub mappings: Vec<MappingCheck>,
    /// With `--learn`: what the confined server was refused, and the grants that would
    /// allow it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub learned: Option<crate::cli::learn::Learned>,
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

/// `airlock discover CONNECTION`: starts the connection, takes a snapshot now, and
/// classifies the drift against the previous snapshot and each mapping's pins. With
/// `learn`, also reports what the confined server was refused meanwhile and the grants
/// that would allow it ([`crate::cli::learn`]).
///
/// # Errors
/// Unknown connection; `learn` on a connection that is not a confined stdio server; the
/// server fails to start or to answer discovery (with `learn`, the error says what it was
/// refused, as far as its last stderr lines tell); the store fails.
pub async fn discover(config: &ServeConfig, name: &str, learn: bool) -> Result<DiscoverReport> {
    config.check_confinement()?;
    let server = config.connections.get(name).with_context(|| {
        format!(
            "the configuration has no connection named `{name}` (it has: {})",
            config
                .connections
                .keys()
                .cloned()
                .collect::<Vec<_>>()
                .join(", ")
        )
    })?;
    let granted = if learn {
        let Some(stdio) = server.as_stdio() else {
            bail!("--learn applies to a stdio connection; `{name}` is reached over HTTP");
        };
        let Some(confinement) = &stdio.confine else {
            bail!(
                "--learn runs a confined server; connection `{name}` is unconfined (confine = false)"
            );
        };
        let mut granted =
            crate::upstream::confine::default_paths(&stdio.command, &stdio.args, &stdio.cwd);
        granted.extend(confinement.paths.iter().cloned());
        let network = crate::cli::learn::Network {
            granted: confinement.tcp_connect.clone(),
            observed: confinement.namespaces,
        };
        Some((granted, network))
    } else {
        None
    };
    let registry = open_registry(config)?;
    let rev = registry.identify(name, server)?;
    let previous = registry.store().latest_snapshot(&rev.connection_id)?;
    // Start and discovery together are bounded by `start_timeout`; on any failure the
    // server's whole process group is stopped (nothing is left running).
    let limit = config.start_timeout;
    // Learning, the egress proxy runs even without grants: what it refuses is reported.
    let mut server = server.clone();
    if learn && let Some(c) = server.as_stdio_mut().and_then(|s| s.confine.as_mut()) {
        c.report_egress = true;
    }
    // Refusals are heard from before the server starts: a start that fails still teaches.
    let (report, mut refusals) = crate::upstream::confine::proxy::Reporter::new();
    let mut refused = move || {
        let mut all = Vec::new();
        while let Ok(r) = refusals.try_recv() {
            all.push(r);
        }
        all
    };
    let started = tokio::time::timeout(limit, async {
        let conn = Connection::start_reporting(
            name,
            &server,
            crate::registry::manifest::MAX_OUTPUT_BYTES,
            limit,
            Some(report),
        )
        .await?;
        let raw = conn
            .discover(limit)
            .await
            .map_err(|e| anyhow::anyhow!("discovery on connection `{name}` failed: {e}"))?;
        conn.terminate(crate::shutdown::STOP_GRACE).await;
        // Every line it wrote, read: what it said just before discovery may still be in
        // the pipe.
        let stderr = conn
            .stderr_tail_at_end(std::time::Duration::from_secs(2))
            .await;
        anyhow::Ok((raw, stderr))
    })
    .await;
    let mut learn_from = |stderr: &[String]| {
        granted.as_ref().map(|(granted, network)| {
            crate::cli::learn::learn(
                &refused(),
                stderr,
                granted,
                network,
                &config.protected_paths(),
            )
        })
    };
    let (raw, learned) = match started {
        Ok(Ok((raw, stderr))) => (raw, learn_from(&stderr)),
        // What the server said before it failed is in the error: learn from it.
        Ok(Err(e)) => {
            let text = format!("{e:#}");
            let lines: Vec<String> = text.lines().map(str::to_string).collect();
            match learn_from(&lines) {
                Some(learned) => bail!("{text}\n{}", learned.to_text().trim_end()),
                None => return Err(e),
            }
        }
        Err(_) => anyhow::bail!(
            "connection `{name}` did not start and answer discovery within {} ms (start_timeout); its server was stopped",
            limit.as_millis()
        ),
    };
    let catalogue = Registry::catalogue(&rev, raw);
    let observed = registry.record_snapshot(name, &rev, &catalogue, None)?;
    let previous_catalogue = previous
        .as_ref()
        .and_then(|p| serde_json::from_value::<Catalogue>(p.body.clone()).ok());
    let drift = previous_catalogue
        .as_ref()
        .map(|old| drift::diff(old, &catalogue))
        .unwrap_or_default();
    let mut mappings = Vec::new();
    for record in registry.store().mappings()? {
        if record.connection_id != rev.connection_id {
            continue;
        }
        let tools: Vec<String> = Pins::from_value(&record.pins)
            .tools
            .keys()
            .cloned()
            .collect();
        mappings.push(check(&registry, &record, &tools, &catalogue));
    }
    Ok(DiscoverReport {
        connection: name.to_string(),
        connection_id: rev.connection_id.clone(),
        config_revision: rev.revision,
        new_revision: rev.created,
        snapshot: observed.digest,
        new_snapshot: observed.new,
        server: catalogue.server_info.clone(),
        protocol_version: catalogue.protocol_version.clone(),
        counts: counts(&catalogue),
        previous: previous.map(|p| p.digest),
        drift,
        mappings,
        learned,
    })
}

fn check(
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

fn counts(c: &Catalogue) -> Value {
    json!({
        "tools": c.tools.len(),
        "resources": c.resources.len(),
        "resource_templates": c.resource_templates.len(),
        "prompts": c.prompts.len(),
    })
}

fn server_label(server: &Value) -> String {
    let name = server.get("name").and_then(Value::as_str).unwrap_or("?");
    let version = server.get("version").and_then(Value::as_str).unwrap_or("?");
    format!("{:?} {}", safe(name, 80), safe(version, 40))
}

impl DiscoverReport {
    /// For a person.
    pub fn to_text(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "connection `{}` = {} revision {}{}",
            self.connection,
            self.connection_id,
            self.config_revision,
            if self.new_revision {
                " (new configuration revision)"
            } else {
                ""
            }
        );
        let _ = writeln!(
            o,
            "server reports itself as {} (an observation, not an identity); protocol {}",
            server_label(&self.server),
            if self.protocol_version.is_empty() {
                "unknown"
            } else {
                &self.protocol_version
            }
        );
        let _ = writeln!(
            o,
            "snapshot {}{}: {} tools, {} resources, {} resource templates, {} prompts",
            self.snapshot,
            if self.new_snapshot {
                " (new)"
            } else {
                " (same content as seen before)"
            },
            self.counts["tools"],
            self.counts["resources"],
            self.counts["resource_templates"],
            self.counts["prompts"]
        );
        match &self.previous {
            None => {
                let _ = writeln!(o, "no earlier snapshot of this connection");
            }
            Some(prev) if self.drift.is_empty() => {
                let _ = writeln!(o, "no drift since snapshot {}", short(prev));
            }
            Some(prev) => {
                let _ = writeln!(o, "drift since snapshot {}:", short(prev));
                for d in &self.drift {
                    let _ = writeln!(
                        o,
                        "  {} {d}",
                        if d.change.is_meaning_bearing() {
                            "!"
                        } else {
                            "·"
                        }
                    );
                }
            }
        }
        if !self.mappings.is_empty() {
            let _ = writeln!(
                o,
                "to pin exactly this snapshot: airlock review approve MAPPING --config FILE --reviewer NAME --snapshot {}",
                self.snapshot
            );
        }
        for m in &self.mappings {
            match (&m.reason, m.would_serve) {
                (None, true) => {
                    let _ = writeln!(
                        o,
                        "mapping `{}` (revision {}, {}): pins match",
                        m.mapping, m.revision, m.state
                    );
                }
                (reason, _) => {
                    let _ = writeln!(
                        o,
                        "mapping `{}` (revision {}, {}): would not serve: {}",
                        m.mapping,
                        m.revision,
                        m.state,
                        reason.as_deref().unwrap_or("")
                    );
                    for d in &m.drift {
                        let _ = writeln!(o, "  ! {d}");
                    }
                }
            }
        }
        if let Some(learned) = &self.learned {
            o.push_str(&learned.to_text());
        }
        o
    }
}

/// `airlock snapshots list`.
///
/// # Errors
/// Unknown connection; the store fails.
pub fn snapshots_list(
    registry: &Registry,
    connection: Option<&str>,
) -> Result<Vec<SnapshotSummary>> {
    let id = match connection {
        None => None,
        Some(name) => Some(
            registry
                .store()
                .connection(name)?
                .with_context(|| format!("no connection named `{name}` is recorded"))?
                .connection_id,
        ),
    };
    registry.store().snapshots(id.as_deref())
}

/// Text for `airlock snapshots list`.
pub fn snapshots_text(list: &[SnapshotSummary]) -> String {
    let mut o = String::new();
    if list.is_empty() {
        o.push_str("no snapshots recorded; run `airlock discover CONNECTION --config FILE`\n");
    }
    for s in list {
        let _ = writeln!(
            o,
            "{}  {} rev {}  first {}  last {}  seen {}x",
            s.digest,
            s.connection_id,
            s.config_revision,
            time(s.first_seen_ms),
            time(s.last_seen_ms),
            s.observations
        );
    }
    o
}

/// `airlock snapshots show`: the snapshot with each item's digests.
///
/// # Errors
/// Unknown or ambiguous digest; the store fails.
pub fn snapshot_show(registry: &Registry, digest: &str) -> Result<(StoredSnapshot, String)> {
    let snap = registry
        .store()
        .snapshot(digest)?
        .with_context(|| format!("no snapshot matches `{digest}`"))?;
    let catalogue: Catalogue =
        serde_json::from_value(snap.body.clone()).context("the stored snapshot does not parse")?;
    let mut o = String::new();
    let _ = writeln!(o, "snapshot {}", snap.digest);
    let _ = writeln!(
        o,
        "connection {} revision {}",
        snap.connection_id, snap.config_revision
    );
    let _ = writeln!(
        o,
        "first seen {}, last seen {}, {} observation(s)",
        time(snap.first_seen_ms),
        time(snap.last_seen_ms),
        snap.observations
    );
    let _ = writeln!(
        o,
        "server {} protocol {}",
        server_label(&catalogue.server_info),
        safe(&catalogue.protocol_version, 40)
    );
    for (label, items, key) in [
        ("tools", &catalogue.tools, "name"),
        ("resources", &catalogue.resources, "uri"),
        (
            "resource templates",
            &catalogue.resource_templates,
            "uriTemplate",
        ),
        ("prompts", &catalogue.prompts, "name"),
    ] {
        let _ = writeln!(o, "{label} ({}):", items.len());
        for item in items {
            let d = drift::item_digests(item);
            let _ = writeln!(
                o,
                "  {:<40} schema {}  description {}",
                safe(item.get(key).and_then(Value::as_str).unwrap_or("?"), 80),
                short(&d.schema),
                short(&d.description)
            );
        }
    }
    Ok((snap, o))
}

/// `airlock snapshots show DIGEST --tool NAME`: one upstream tool of a snapshot, for an
/// adapter author: its digests, title and description (untrusted text, quoted and made
/// safe for a terminal), annotations, and its input and output schemas as outlines (one
/// line per property: JSON pointer, type, required or optional, bounds, description),
/// each followed by the schema's raw JSON. Returns the tool's raw definition and the text.
///
/// # Errors
/// No snapshot matches `digest`, it does not parse, or it has no tool `name` (the error
/// lists the tools it has).
pub fn tool_show(registry: &Registry, digest: &str, name: &str) -> Result<(Value, String)> {
    let snap = registry
        .store()
        .snapshot(digest)?
        .with_context(|| format!("no snapshot matches `{digest}`"))?;
    let catalogue: Catalogue =
        serde_json::from_value(snap.body.clone()).context("the stored snapshot does not parse")?;
    let Some(tool) = catalogue
        .tools
        .iter()
        .find(|t| t.get("name").and_then(Value::as_str) == Some(name))
    else {
        let names: Vec<String> = catalogue
            .tools
            .iter()
            .filter_map(|t| t.get("name").and_then(Value::as_str))
            .map(|n| safe(n, 80))
            .collect();
        bail!(
            "snapshot {} has no tool `{}`; its tools: {}",
            short(&snap.digest),
            safe(name, 80),
            if names.is_empty() {
                "(none)".to_string()
            } else {
                names.join(", ")
            }
        );
    };
    let d = drift::item_digests(tool);
    let mut o = String::new();
    let _ = writeln!(o, "tool {} in snapshot {}", safe(name, 80), snap.digest);
    let _ = writeln!(
        o,
        "connection {} revision {}, server {}",
        snap.connection_id,
        snap.config_revision,
        server_label(&catalogue.server_info)
    );
    let _ = writeln!(o, "schema digest       {}", d.schema);
    let _ = writeln!(o, "description digest  {}", d.description);
    let text = |key: &str| tool.get(key).and_then(Value::as_str).map(|t| safe(t, 2000));
    let _ = writeln!(
        o,
        "title               {}",
        text("title").map_or("(none)".into(), |t| format!("\"{t}\""))
    );
    let _ = writeln!(
        o,
        "description         {}",
        text("description").map_or("(none)".into(), |t| format!(
            "\"{t}\" (the server's words: untrusted)"
        ))
    );
    if let Some(a) = tool.get("annotations") {
        let _ = writeln!(o, "annotations         {}", safe(&a.to_string(), 400));
    }
    for (label, key) in [
        ("input schema", "inputSchema"),
        ("output schema", "outputSchema"),
    ] {
        let _ = writeln!(o);
        match tool.get(key) {
            None | Some(Value::Null) => {
                let _ = writeln!(
                    o,
                    "{label}: none declared{}",
                    if key == "outputSchema" {
                        " (the result's shape is known only from a call: structuredContent or a text block)"
                    } else {
                        ""
                    }
                );
            }
            Some(schema) => {
                let _ = writeln!(o, "{label} (pointer, type, required, bounds, description):");
                let mut lines = Vec::new();
                schema_outline(schema, "", true, 0, &mut lines);
                for line in lines {
                    let _ = writeln!(o, "  {line}");
                }
                let _ = writeln!(o, "{label} as JSON:");
                let raw = serde_json::to_string_pretty(schema).unwrap_or_default();
                for line in raw.lines() {
                    let _ = writeln!(o, "  {}", safe(line, 400));
                }
            }
        }
    }
    Ok((tool.clone(), o))
}

/// Deepest nesting [`schema_outline`] follows (a schema can be deeper or recursive).
const OUTLINE_DEPTH: usize = 8;

/// Appends one line for `schema` at JSON pointer `at` (`/` for the root), then one per
/// property of an object and for the items of an array, recursively up to
/// [`OUTLINE_DEPTH`]. `$ref`s are named, not followed.
fn schema_outline(schema: &Value, at: &str, required: bool, depth: usize, out: &mut Vec<String>) {
    let Some(obj) = schema.as_object() else {
        out.push(format!(
            "{}  {}",
            if at.is_empty() { "/" } else { at },
            safe(&schema.to_string(), 80)
        ));
        return;
    };
    let ty = match obj.get("type") {
        Some(Value::String(t)) => t.clone(),
        Some(Value::Array(ts)) => ts
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join("|"),
        _ if obj.contains_key("$ref") => format!("$ref {}", obj["$ref"].as_str().unwrap_or("?")),
        _ if obj.contains_key("anyOf") => "anyOf".to_string(),
        _ if obj.contains_key("oneOf") => "oneOf".to_string(),
        _ => "any".to_string(),
    };
    let mut line = format!(
        "{:<28} {:<10} {}",
        if at.is_empty() {
            "/".to_string()
        } else {
            safe(at, 80)
        },
        safe(&ty, 40),
        if required { "required" } else { "optional" }
    );
    for key in [
        "enum",
        "const",
        "default",
        "minimum",
        "maximum",
        "minLength",
        "maxLength",
        "minItems",
        "maxItems",
        "pattern",
        "format",
        "additionalProperties",
    ] {
        if let Some(v) = obj.get(key).filter(|v| !v.is_object()) {
            let _ = write!(line, "  {key}={}", safe(&v.to_string(), 120));
        }
    }
    if let Some(d) = obj.get("description").and_then(Value::as_str) {
        let _ = write!(line, "  \"{}\"", safe(d, 200));
    }
    out.push(line);
    if depth >= OUTLINE_DEPTH {
        return;
    }
    if let Some(props) = obj.get("properties").and_then(Value::as_object) {
        let needed: Vec<&str> = obj
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        for (name, sub) in props {
            let pointer = format!("{at}/{}", name.replace('~', "~0").replace('/', "~1"));
            schema_outline(
                sub,
                &pointer,
                needed.contains(&name.as_str()),
                depth + 1,
                out,
            );
        }
    }
    if let Some(items) = obj.get("items").filter(|i| i.is_object()) {
        schema_outline(items, &format!("{at}/[]"), true, depth + 1, out);
    }
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
                (Some(e), _) => crate::cli::review::effect_text(e, cap.contract_effect.as_ref()),
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

/// `airlock trace list` text.
pub fn trace_text(events: &[TraceEvent]) -> String {
    let mut o = String::new();
    for e in events {
        let _ = writeln!(
            o,
            "{:>6}  {}  {:<22} {:<24} {}",
            e.seq,
            time(e.at_ms),
            e.kind,
            safe(&e.subject, 60),
            safe(&e.payload.to_string(), 160)
        );
    }
    o
}

/// `airlock trace verify` for a person: intact or where it was tampered, then what the
/// verification covers (the key, unkeyed events from before schema 7, checkpoints).
pub fn verification_text(v: &crate::store::TraceVerification) -> String {
    let mut o = match &v.first_bad {
        None => format!("trace intact: {} events, head {}\n", v.events, v.head),
        Some((seq, why)) => format!(
            "trace TAMPERED at event {seq}: {why} ({} events read)\n",
            v.events
        ),
    };
    for line in &v.coverage {
        o.push_str("  ");
        o.push_str(line);
        o.push('\n');
    }
    o
}

/// The text of a segments check ([`crate::store::archive::verify_segments`]).
pub fn segments_text(v: &crate::store::archive::SegmentsVerification) -> String {
    let mut o = match &v.first_bad {
        None => format!(
            "archive intact: {} segment(s) in {}, events 1..={}\n",
            v.segments,
            v.dir.display(),
            v.through_seq
        ),
        Some((seq, why)) => format!(
            "archive TAMPERED at event {seq}: {why} ({} segment(s) in {})\n",
            v.segments,
            v.dir.display()
        ),
    };
    for line in &v.coverage {
        o.push_str("  ");
        o.push_str(line);
        o.push('\n');
    }
    o
}

/// Opens the registry of a state folder given directly (commands without `--config`): its
/// SQLite database, or the shared PostgreSQL store `--store` names (the folder, if any,
/// then only provides the key file when AIRLOCK_TRACE_KEY is not set). Every command that
/// opens a store by its state folder opens it here.
///
/// # Errors
/// The store cannot be opened; no state folder for the embedded store.
pub fn registry_at(state_dir: Option<&Path>) -> Result<Registry> {
    let target = crate::cli::shared_store().map_or(crate::store::Target::Sqlite, |target| {
        crate::store::Target::Postgres(target.to_owned())
    });
    let store = crate::store::open(&target, state_dir, None)?;
    Ok(Registry::new(store))
}

/// The registry of the store `config` names when that is the shared PostgreSQL store
/// (or `--store` names one), else the SQLite database of its state folder when there is
/// one; `None` when there is no store to read.
///
/// # Errors
/// The store cannot be opened.
pub fn registry_of_config(config: &crate::config::ServeConfig) -> Result<Option<Registry>> {
    if matches!(config.store, crate::config::StoreSetting::Postgres(_)) {
        return crate::registry::live::open_registry(config).map(Some);
    }
    match config
        .state_dir
        .clone()
        .or_else(crate::config::default_state_dir)
    {
        Some(dir)
            if crate::cli::shared_store().is_some()
                || std::fs::symlink_metadata(dir.join(crate::store::DATABASE_FILE)).is_ok() =>
        {
            registry_at(Some(&dir)).map(Some)
        }
        _ => Ok(None),
    }
}
