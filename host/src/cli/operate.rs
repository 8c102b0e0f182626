//! Operator and reviewer commands over the registry: `airlock discover`, `airlock
//! snapshots`, `airlock review` and `airlock trace`. Each returns a report that prints for
//! a person by default and as JSON for tools. The snapshots and review reports, and the
//! approval, are the gateway's ([`crate::review`]: one renderer for these commands and the
//! console), re-exported here under the names the commands use.
//!
//! Rules:
//! - Discovery records a snapshot and shows drift; it changes no mapping's state (a running
//!   host does that when it sees the same drift).
//! - An approval pins the digests of a snapshot of the mapping's *current* connection
//!   revision, verifies the component against the manifest's pin first, and records the
//!   reviewer and time as a new mapping revision ([`crate::review::approve`]).
//! - Upstream-supplied text (server names, tool names, descriptions) is printed escaped and
//!   clipped: it is untrusted.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context as _, Result, bail};
use serde::Serialize;
use serde_json::{Value, json};

use crate::config::ServeConfig;
use crate::registry::drift::{self, Catalogue, Drift};
use crate::registry::live::open_registry;
use crate::registry::{Pins, Registry, short};
use crate::store::TraceEvent;
use crate::upstream::Connection;

pub use crate::review::{
    FixtureTested, MappingCheck, ReviewShow, ShownCapability, approve, check, find_mapping,
    review_list_text, review_show, safe, safe_lines, server_label, snapshot_show, snapshots_list,
    snapshots_text, time, tool_show,
};

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

fn counts(c: &Catalogue) -> Value {
    json!({
        "tools": c.tools.len(),
        "resources": c.resources.len(),
        "resource_templates": c.resource_templates.len(),
        "prompts": c.prompts.len(),
    })
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
