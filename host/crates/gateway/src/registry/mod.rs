//! The registry: connection identity, discovery snapshots, mapping pins and lifecycle.
//!
//! Rules this module enforces (DESIGN.md §1–§2, §7):
//! - **A name is not an identity.** Each configured connection gets a locally assigned id
//!   (`conn-…`). Its configuration revision is the sha256 of the RFC 8785 canonical JSON of
//!   the transport (command path, the executable's sha256, the sha256 of the first
//!   non-option argument when it names a file — an interpreter's script — and of any
//!   `identity_files`, args,
//!   working directory, environment variable names and the sha256 of each value), the
//!   credential scope reference and the owner; for an HTTP connection the URL, the header
//!   names with the secret names they come from (never a secret's value), the credential
//!   scope and the owner (see [`crate::upstream::http::http_identity`]). A new
//!   digest is a new revision; a mapping approved against another revision does not serve.
//!   The server-reported name and version are observations inside a snapshot, never keys.
//! - **Discovery grants nothing.** A snapshot records what a connection reported; only a
//!   reviewer's approval (a new mapping revision carrying pins) lets a mapping serve.
//! - **Pins.** A mapping revision pins connection id + configuration revision + the schema
//!   and description digest of every upstream tool its manifest lists. A mapping serves only
//!   in `limited` or `active`, and only while every pin matches the connection's current
//!   snapshot and the server's reported name is the one the reviewer saw. Anything else
//!   moves it to `review-required`, from which only a new approval (a new revision) leads
//!   back to serving.
//! - **Everything is traced**: revisions, snapshots, drift, state changes, approvals.
//! - **Serving state is proven by the trace, never trusted from a row alone.** A record
//!   in a serving state (`limited`, `active`) serves only when a `mapping-revision` event
//!   whose MAC verifies with the host key records that revision with the same state,
//!   manifest digest, component and pins, and the `mapping-state-changed` events for it
//!   since (the latest one decides) leave it in that state; or when the `trace-keyed`
//!   event of the schema 7 migration attested it so. Anything else — a row set to
//!   `active` by hand, pins copied from another row, a revision row no event records —
//!   is refused, traced once as `mapping-tampered`, and shown as tampered by
//!   `review show` ([`Registry::prove`]).

pub mod anchor;
pub mod catalog;
pub mod connections;
pub mod contracts;
pub mod drain;
pub mod drift;
pub mod live;
pub mod loading;
pub use airlock_runtime::manifest;
pub mod reload;
pub mod retention;
pub mod sync;
#[cfg(test)]
pub(crate) mod testkit;

use std::collections::BTreeMap;
use std::io::Read as _;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context as _, Result, bail};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sha2::Digest as _;

use crate::registry::drift::{Catalogue, Change, Drift, ItemDigests, ItemKind};
use crate::registry::manifest::MappingManifest;
use crate::store::{
    ConnectionRevision, MappingRecord, MappingState, NewMappingRevision, SnapshotObservation,
    Store, StoredSnapshot,
};
use crate::upstream::{RawDiscovery, StdioServer, UpstreamServer};

/// Trace event kinds written by the host. Payloads are digests and safe summaries.
pub mod events {
    /// A connection configuration digest seen for the first time.
    pub const CONNECTION_REVISION: &str = "connection-revision";
    /// A discovery snapshot was taken.
    pub const SNAPSHOT_TAKEN: &str = "snapshot-taken";
    /// Discovery failed.
    pub const SNAPSHOT_FAILED: &str = "snapshot-failed";
    /// Meaning-bearing drift on a mapping's pinned tools.
    pub const DRIFT_FOUND: &str = "drift-found";
    /// A mapping revision was recorded (first sight, changed manifest, approval).
    pub const MAPPING_REVISION: &str = "mapping-revision";
    /// A mapping's lifecycle state changed.
    pub const MAPPING_STATE: &str = "mapping-state-changed";
    /// A mapping was loaded into a running host.
    pub const MAPPING_LOADED: &str = "mapping-loaded";
    /// A mapping was unloaded from a running host.
    pub const MAPPING_UNLOADED: &str = "mapping-unloaded";
    /// A changed manifest arrived while a reviewed revision serves; it waits for approval.
    pub const MAPPING_STAGED: &str = "mapping-staged";
    /// A new or changed mapping failed verification; the old revision (if any) serves on.
    pub const MAPPING_LOAD_FAILED: &str = "mapping-load-failed";
    /// A call was refused because of the mapping's state or pins.
    pub const CALL_REFUSED: &str = "call-refused";
    /// An adapter call was contained (deadline, memory, fuel, output, trap...).
    pub const CALL_CONTAINED: &str = "call-contained";

    // The life of a call (product layer), linked by `call` ids to the protocol layer.

    /// A session opened: its requester, profile and transport (stage `bound`).
    pub const SESSION_OPENED: &str = "session-opened";
    /// A legacy (2025-11-25) MCP session opened on the HTTP front: its requester and the
    /// sha256 of its `Mcp-Session-Id` (the id itself is a credential and never traced).
    pub const MCP_SESSION_OPENED: &str = "mcp-session-opened";
    /// A legacy MCP session ended: why (`deleted` by the client, `idle` past
    /// `session_idle`, `evicted` as the oldest idle one past `max_sessions_per_principal`,
    /// `gone` when the transport closed it) and how long it was open.
    pub const MCP_SESSION_ENDED: &str = "mcp-session-ended";
    /// A session was offered a catalogue different from its previous one: the RFC 8785
    /// digest of the exact list, in order, and the capability names (stage `offered`).
    pub const CATALOG_OFFERED: &str = "catalog-offered";
    /// A `tools/call` arrived: capability, digest of the raw arguments, the offered
    /// catalogue digest the session saw (stage `requested`).
    pub const CALL_CANDIDATE: &str = "call-candidate";
    /// The policy decision: verdict, category, policy digest, determining policies, the
    /// normalized-arguments digest.
    pub const CALL_DECIDED: &str = "call-decided";
    /// A person was asked to approve a call (mode, approval id, summary digest).
    pub const APPROVAL_REQUESTED: &str = "approval-requested";
    /// A person answered (approved, declined, cancelled) or an approval was revoked.
    pub const APPROVAL_DECIDED: &str = "approval-decided";
    /// A receipt was consumed, creating the call's intent (stage `approved`).
    pub const RECEIPT_CONSUMED: &str = "receipt-consumed";
    /// A receipt could not be used (consumed, expired, bound to something that changed).
    pub const RECEIPT_REFUSED: &str = "receipt-refused";
    /// The call's intent: one effect id and idempotency key digest for every attempt.
    pub const INTENT_CREATED: &str = "intent-created";
    /// An intent whose outcome was unknown was resolved: how (query, retry, person), by
    /// whom, the final state and the evidence.
    pub const INTENT_RESOLVED: &str = "intent-resolved";
    /// A reconciliation of an unknown intent ran and could not decide (the upstream was
    /// unreachable, or the contract cannot be asked): the intent is held for a person.
    pub const INTENT_HELD: &str = "intent-held";
    /// A stored intent the trace does not prove (inserted or edited in the store): not
    /// reconciled; the intent, its mapping and why (see `pipeline::intent::prove_intent`).
    pub const INTENT_TAMPERED: &str = "intent-tampered";
    /// An upstream connection that had closed was started again.
    pub const CONNECTION_RESTARTED: &str = "connection-restarted";
    /// An upstream connection changed state (`connecting`, `ready`, `disconnected`,
    /// `degraded`, `stopped`): connection id, from, to, and the reason (the host's words).
    pub const CONNECTION_STATE: &str = "connection-state";
    /// One upstream request an adapter made (protocol layer): connection id, snapshot,
    /// method, target, JSON-RPC request id, result digest, bytes, time, and the ids of
    /// the observations (one per content item) its answer became.
    pub const UPSTREAM_REQUEST: &str = "upstream-request";
    /// An upstream answer the bridge refused before the adapter saw it (protocol layer):
    /// connection id, method, target, JSON-RPC request id, which budget it broke
    /// (`bytes`, `items`, `media-type`, `malformed-media-type`, `malformed`) or
    /// `degraded-connection`; never its content.
    pub const UPSTREAM_REFUSED: &str = "upstream-refused";
    /// A confined upstream server's egress proxy refused a destination (its connection
    /// does not grant it): connection id, host and port as the server asked, the reason,
    /// and how many the proxy has refused since that server started. Once per destination
    /// per start.
    pub const UPSTREAM_EGRESS_REFUSED: &str = "upstream-egress-refused";
    /// How the call ended: completed, failed(category), unknown, refused, approval
    /// required, input required (stage `executed` when it ran).
    pub const CALL_OUTCOME: &str = "call-outcome";
    /// A policy was loaded (start or hot reload): its digest and files.
    pub const POLICY_LOADED: &str = "policy-loaded";
    /// A changed policy was refused; the previous one keeps deciding.
    pub const POLICY_LOAD_FAILED: &str = "policy-load-failed";
    /// A mapping record in a serving state that the trace does not prove (edited by hand
    /// in the store): revision, the state and digests the row claims, and why it is not
    /// proven. The mapping is refused.
    pub const MAPPING_TAMPERED: &str = "mapping-tampered";
    /// The oldest events were sealed into a segment file and left the store (written by
    /// the store itself, [`crate::store::archive`]): the segment's range, the MAC it starts
    /// from, its head, the file's sha256 and the events up to its end the store kept.
    pub const TRACE_ARCHIVED: &str = crate::store::archive::TRACE_ARCHIVED;
}

/// sha256 (hex) of a file's bytes, streamed.
///
/// # Errors
/// The file cannot be read.
pub fn file_sha256(path: &Path) -> Result<String> {
    let mut file = std::fs::File::open(path)
        .with_context(|| format!("reading {} to compute its sha256", path.display()))?;
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

/// The configuration revision of a stdio connection: `(digest, summary)`. The summary is
/// the canonicalized JSON the digest covers; environment values appear only as sha256.
/// Not covered (say so in reviews): modules an interpreter loads besides its script unless
/// listed in `identity_files`, and the executable being swapped between hashing and start.
///
/// # Errors
/// The executable, the script or an identity file cannot be read.
pub fn stdio_identity(server: &StdioServer) -> Result<(String, Value)> {
    // An interpreter's script is code too: when the first argument that is not an option
    // names a file (against the working directory), it is hashed with the executable.
    let script = server
        .args
        .iter()
        .find(|a| !a.starts_with('-'))
        .map(|a| (a.clone(), server.cwd.join(a)))
        .filter(|(_, path)| path.is_file());
    let script = match script {
        Some((arg, path)) => json!({"arg": arg, "sha256": file_sha256(&path)?}),
        None => Value::Null,
    };
    let mut files = serde_json::Map::new();
    for f in &server.identity_files {
        files.insert(f.display().to_string(), Value::String(file_sha256(f)?));
    }
    // Values change behaviour as much as names do; the configuration holds them in the
    // clear already, the digest summary keeps only their hashes.
    let env: serde_json::Map<String, Value> = server
        .env
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                Value::String(hex::encode(sha2::Sha256::digest(v.as_bytes()))),
            )
        })
        .collect();
    let mut summary = json!({
        "transport": "stdio",
        "command": server.command.display().to_string(),
        "command_sha256": file_sha256(&server.command)?,
        "script": script,
        "identity_files": files,
        "args": server.args,
        "cwd": server.cwd.display().to_string(),
        "env_names": server.env.keys().collect::<Vec<_>>(),
        "env_value_sha256": env,
        "credential_scope": server.credential_scope,
        "owner": server.owner,
    });
    // A confined server's grants are part of its identity: widening them is drift. (An
    // unconfined connection's summary has no such key, as before confinement existed.)
    if let Some(confine) = &server.confine {
        summary["confinement"] = confine.summary();
    }
    Ok((drift::canonical_digest(&summary), summary))
}

/// What a mapping revision pins: per upstream tool, the digests the reviewer approved, and
/// the configuration digest and server name of the snapshot they came from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pins {
    /// Upstream tool name → digests.
    pub tools: BTreeMap<String, ItemDigests>,
    /// The connection configuration digest the snapshot was taken under.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_digest: Option<String>,
    /// The server's reported name in that snapshot (an observation; a change is drift).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
    /// Whom a revision approved as `limited` is offered to: `profile:NAME` and
    /// `requester:NAME` entries ([`Registry::approve_tools_with`]); nobody else sees or
    /// calls it. Empty for a revision approved `active`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub limited_to: Vec<String>,
}

/// Whether a `limited` revision with scope `limited_to` ([`Pins::limited_to`]) is offered
/// to a session of profile `profile` acting for requester `requester`.
pub fn in_limited_scope(limited_to: &[String], profile: &str, requester: &str) -> bool {
    limited_to.iter().any(|s| {
        s.strip_prefix("profile:") == Some(profile)
            || s.strip_prefix("requester:") == Some(requester)
    })
}

/// The upstream tools among `tools` that `catalogue`'s server does not itself call
/// read-only (its `annotations.readOnlyHint` is not `true`), each as a sentence, when the
/// mapping's most consequential capability is `class` and that class changes nothing
/// upstream (`read` or `local-transformation`); empty otherwise. Server annotations are
/// untrusted hints (MCP 2025-11-25, "Tool annotations"): they never make a call more
/// trusted, but a server saying its own tool writes is worth a reviewer's explicit answer
/// before a mapping offers it as a read (`review approve --acknowledge-annotations`).
pub fn annotation_conflicts(
    catalogue: &drift::Catalogue,
    tools: &[String],
    class: crate::contract::EffectClass,
) -> Vec<String> {
    use crate::contract::EffectClass;
    if !matches!(class, EffectClass::Read | EffectClass::LocalTransformation) {
        return Vec::new();
    }
    tools
        .iter()
        .filter_map(|name| {
            let tool = catalogue.tool(name)?;
            let said = match tool["annotations"].get("readOnlyHint") {
                Some(Value::Bool(true)) => return None,
                Some(Value::Bool(false)) => "readOnlyHint false",
                _ => "no readOnlyHint",
            };
            let destructive = if tool["annotations"].get("destructiveHint") == Some(&Value::Bool(false)) {
                ""
            } else {
                ", not said non-destructive"
            };
            Some(format!(
                "upstream tool `{}`: the server does not call it read-only ({said}{destructive}), but the mapping offers it only through {class} capabilities",
                airlock_core::text::safe(name, 200)
            ))
        })
        .collect()
}

/// Checks a `--limited-to` scope: each entry `profile:NAME` or `requester:NAME`.
///
/// # Errors
/// An entry of another form, or an empty name.
pub fn check_limited_scope(limited_to: &[String]) -> Result<()> {
    for s in limited_to {
        let ok = ["profile:", "requester:"]
            .iter()
            .any(|p| s.strip_prefix(p).is_some_and(|n| !n.trim().is_empty()));
        if !ok {
            bail!(
                "--limited-to `{s}`: name a profile or a requester, as `profile:NAME` or `requester:NAME`"
            );
        }
    }
    Ok(())
}

/// The server's reported name in a catalogue (`""` when absent).
fn server_name(c: &Catalogue) -> String {
    c.server_info
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string()
}

impl Pins {
    /// Reads pins stored with a mapping revision (`null` or `{}` = none).
    pub fn from_value(value: &Value) -> Self {
        serde_json::from_value(value.clone()).unwrap_or_default()
    }

    /// As stored.
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }
}

/// What loading a manifest recorded.
#[derive(Debug, Clone, PartialEq)]
pub enum Registration {
    /// The mapping revision that binds this manifest (new or existing).
    Recorded(Box<MappingRecord>),
    /// The manifest differs from the serving revision and no review covers it: nothing
    /// was recorded; the serving revision keeps serving until a reviewer approves this
    /// manifest.
    Staged {
        /// Why it is not the serving revision.
        reason: String,
    },
}

/// Whether a mapping revision may serve against a connection's current snapshot.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Its state serves and every pin matches.
    Serves,
    /// Not serving: why (safe text) and the classified drift, if any.
    Blocked {
        /// One line for a person.
        reason: String,
        /// Classified differences against the pinned snapshot (empty when the reason is
        /// the state or the configuration revision).
        drift: Vec<Drift>,
        /// True when the verdict itself should move a serving mapping to
        /// `review-required` (pins broken or configuration changed); false when the
        /// state alone already keeps it from serving.
        needs_review: bool,
    },
}

/// The sha256 (hex) of a mapping manifest's text.
pub fn manifest_digest(text: &str) -> String {
    hex::encode(sha2::Sha256::digest(text.as_bytes()))
}

/// What an approval binds from the mapping side: its name, the upstream tools its
/// manifest lists, and the exact manifest and component.
#[derive(Debug, Clone)]
pub struct MappingIdentity<'a> {
    /// Mapping name.
    pub name: &'a str,
    /// Upstream tools the manifest lists (each is pinned).
    pub tools: &'a [String],
    /// sha256 of the manifest text.
    pub manifest_digest: &'a str,
    /// The manifest text, kept with the revision.
    pub manifest_text: Option<&'a str>,
    /// The component's sha256 (already verified against the pin).
    pub component_sha256: &'a str,
}

/// How [`Registry::approve_tools_with`] approves.
#[derive(Debug, Clone, Copy, Default)]
pub struct ApprovalOptions<'a> {
    /// `profile:NAME` / `requester:NAME` entries: approve as `limited` to them.
    pub limited_to: &'a [String],
    /// The mapping's most consequential capability class, for the annotation check
    /// ([`annotation_conflicts`]); `None` skips it.
    pub class: Option<crate::contract::EffectClass>,
    /// The reviewer read the conflicts the check reports and approves anyway.
    pub acknowledge_annotations: bool,
}

/// The registry over one [`Store`].
#[derive(Clone)]
pub struct Registry {
    store: Arc<dyn Store>,
    /// Tampered records already traced (name, revision, state, digests), so a record
    /// re-read every store poll is traced once.
    tampered: Arc<std::sync::Mutex<std::collections::BTreeSet<String>>>,
    /// The host's metrics ([`crate::metrics`]): the events [`Registry::trace`] appends
    /// move their counters.
    metrics: Arc<crate::metrics::Metrics>,
}

impl Registry {
    /// A registry over `store`.
    pub fn new(store: Arc<dyn Store>) -> Self {
        Self {
            store,
            tampered: Arc::default(),
            metrics: Arc::default(),
        }
    }

    /// Whether the trace proves `record`'s serving state (see the module's rule): `None`
    /// when it does (or the record does not serve, so there is nothing to prove), else
    /// why not, in words.
    ///
    /// # Errors
    /// The store fails.
    pub fn prove(&self, record: &MappingRecord) -> Result<Option<String>> {
        if !record.state.serves() {
            return Ok(None);
        }
        let events = self.store.mapping_proofs(&record.name)?;
        // What the trace says about this revision: (state, manifest, component, pins),
        // from its revision event (or the migration's attestation), then its state changes.
        let mut said: Option<(String, Value, Value, Option<Value>, i64)> = None;
        for e in &events {
            let p = &e.payload;
            let this_revision = |v: &Value| v["revision"].as_i64() == Some(record.revision);
            match e.kind.as_str() {
                events::MAPPING_REVISION if this_revision(p) => {
                    said = Some((
                        p["state"].as_str().unwrap_or_default().to_owned(),
                        p["manifest_digest"].clone(),
                        p["component_sha256"].clone(),
                        p.get("pins").cloned(),
                        e.seq,
                    ));
                }
                events::MAPPING_STATE if this_revision(p) => {
                    if let Some(s) = &mut said {
                        s.0 = p["to"].as_str().unwrap_or_default().to_owned();
                        s.4 = e.seq;
                    }
                }
                crate::store::TRACE_KEYED => {
                    let attested = p["mappings"].as_array().and_then(|all| {
                        all.iter()
                            .find(|m| m["name"] == record.name.as_str() && this_revision(m))
                    });
                    if let Some(m) = attested {
                        said = Some((
                            m["state"].as_str().unwrap_or_default().to_owned(),
                            m["manifest_digest"].clone(),
                            m["component_sha256"].clone(),
                            Some(m["pins"].clone()),
                            e.seq,
                        ));
                    }
                }
                _ => {}
            }
        }
        let Some((state, manifest, component, pins, seq)) = said else {
            return Ok(Some(format!(
                "no MACed mapping-revision event records revision {} of `{}`",
                record.revision, record.name
            )));
        };
        let mut wrong = Vec::new();
        if state != record.state.as_str() {
            wrong.push(format!("state {} (the trace says {state})", record.state));
        }
        if manifest != record.manifest_digest.as_str() {
            wrong.push("manifest digest".to_owned());
        }
        if component != record.component_sha256.as_str() {
            wrong.push("component sha256".to_owned());
        }
        match &pins {
            Some(pins) if *pins == record.pins => {}
            Some(_) => wrong.push("pins".to_owned()),
            None => wrong.push("pins (the revision event records none)".to_owned()),
        }
        Ok((!wrong.is_empty()).then(|| {
            format!(
                "revision {} of `{}` differs from what the trace recorded up to event {seq}: {}",
                record.revision,
                record.name,
                wrong.join(", ")
            )
        }))
    }

    /// `record` when the trace proves it ([`Registry::prove`]); otherwise a copy that does
    /// not serve (`review-required`, reason "tampered: …"), traced once as
    /// `mapping-tampered` and logged at ERROR. A store failure refuses it too.
    pub fn proven(&self, record: MappingRecord) -> MappingRecord {
        let why = match self.prove(&record) {
            Ok(None) => return record,
            Ok(Some(why)) => why,
            Err(e) => format!("its proof could not be read: {e:#}"),
        };
        let seen = format!(
            "{}\0{}\0{}\0{}\0{}",
            record.name, record.revision, record.state, record.manifest_digest, record.pins
        );
        let first = self
            .tampered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(seen);
        if first {
            tracing::error!(mapping = %record.name, revision = record.revision, "refusing a mapping record the trace does not prove (edited in the store?): {why}");
            self.trace(
                events::MAPPING_TAMPERED,
                &record.name,
                json!({
                    "revision": record.revision,
                    "state": record.state,
                    "manifest_digest": record.manifest_digest,
                    "component_sha256": record.component_sha256,
                    "why": why,
                }),
            );
        }
        MappingRecord {
            state: MappingState::ReviewRequired,
            reason: format!("tampered: {why}"),
            ..record
        }
    }

    /// The store.
    pub fn store(&self) -> &dyn Store {
        self.store.as_ref()
    }

    /// The store, when several hosts may share it ([`crate::store::Hosts::is_shared`]).
    pub fn store_if_shared(&self) -> Option<Arc<dyn Store>> {
        self.store.is_shared().then(|| self.store.clone())
    }

    /// The store, shared (for the trace writer thread).
    pub fn shared_store(&self) -> Arc<dyn Store> {
        self.store.clone()
    }

    /// The host's metrics.
    pub fn metrics(&self) -> &Arc<crate::metrics::Metrics> {
        &self.metrics
    }

    /// Appends a trace event; a failure to write it is logged, never silently dropped.
    pub fn trace(&self, kind: &str, subject: &str, payload: Value) {
        self.metrics.traced(kind, subject, &payload);
        if let Err(e) = self.store.append_trace(kind, subject, &payload) {
            tracing::error!(kind, subject, "could not append to the trace: {e:#}");
        }
    }

    /// Resolves a configured connection to its id and configuration revision, recording a
    /// new revision when the digest is new.
    ///
    /// # Errors
    /// The executable cannot be hashed; the store fails.
    pub fn identify(&self, name: &str, server: &UpstreamServer) -> Result<ConnectionRevision> {
        let (digest, summary) = match server {
            UpstreamServer::Stdio(s) => {
                stdio_identity(s).with_context(|| format!("identifying connection `{name}`"))?
            }
            UpstreamServer::Http(h) => crate::upstream::http::http_identity(h),
        };
        let rev = self.store.connection_revision(name, &digest, &summary)?;
        if rev.created {
            self.trace(
                events::CONNECTION_REVISION,
                name,
                json!({
                    "connection_id": rev.connection_id,
                    "revision": rev.revision,
                    "config_digest": rev.config_digest,
                    "command_sha256": summary["command_sha256"],
                }),
            );
        }
        Ok(rev)
    }

    /// Builds the catalogue of one discovery.
    pub fn catalogue(rev: &ConnectionRevision, raw: RawDiscovery) -> Catalogue {
        let init = &raw.initialize;
        Catalogue {
            connection_id: rev.connection_id.clone(),
            config_digest: rev.config_digest.clone(),
            server_info: init.get("serverInfo").cloned().unwrap_or(Value::Null),
            protocol_version: init
                .get("protocolVersion")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string(),
            capabilities: init.get("capabilities").cloned().unwrap_or(Value::Null),
            instructions: init
                .get("instructions")
                .and_then(Value::as_str)
                .map(str::to_string),
            tools: raw.tools,
            resources: raw.resources,
            resource_templates: raw.resource_templates,
            prompts: raw.prompts,
        }
    }

    /// Stores a snapshot (content-addressed) with this observation's time, and traces it
    /// unless its digest equals `previous` (the last snapshot this host took of the
    /// connection).
    ///
    /// # Errors
    /// The catalogue is malformed (duplicate or missing keys); the store fails.
    pub fn record_snapshot(
        &self,
        connection: &str,
        rev: &ConnectionRevision,
        catalogue: &Catalogue,
        previous: Option<&str>,
    ) -> Result<SnapshotObservation> {
        catalogue
            .validate()
            .with_context(|| format!("connection `{connection}` reported a malformed catalogue"))?;
        let digest = catalogue.digest();
        let body = serde_json::to_value(catalogue)?;
        let observed = self
            .store
            .put_snapshot(&digest, &rev.connection_id, rev.revision, &body)?;
        if previous == Some(digest.as_str()) {
            // Unchanged since this host's last snapshot: the observation row records it;
            // the trace records changes, not repetitions.
            return Ok(observed);
        }
        self.trace(
            events::SNAPSHOT_TAKEN,
            connection,
            json!({
                "connection_id": rev.connection_id,
                "config_revision": rev.revision,
                "snapshot": digest,
                "new": observed.new,
                "tools": catalogue.tools.len(),
                "resources": catalogue.resources.len(),
                "resource_templates": catalogue.resource_templates.len(),
                "prompts": catalogue.prompts.len(),
            }),
        );
        Ok(observed)
    }

    /// Records the mapping as loaded from `manifest`. A revision binds exactly one manifest
    /// digest and one connection revision, so:
    /// - first sight: a `candidate` revision with no pins;
    /// - the latest revision binds this manifest and connection revision: that revision
    ///   (its state decides whether it serves);
    /// - anything else is unreviewed. With `stage`, nothing is written and the caller keeps
    ///   the revision it serves ([`Registration::Staged`]); without, a new revision is
    ///   recorded as `review-required` (`candidate` if it never was reviewed), carrying the
    ///   pins of the tools the manifest still lists so a reviewer sees the drift.
    ///
    /// # Errors
    /// The store fails.
    pub fn register_mapping(
        &self,
        manifest: &MappingManifest,
        manifest_text: Option<&str>,
        manifest_digest: &str,
        component_sha256: &str,
        rev: &ConnectionRevision,
        stage: bool,
    ) -> Result<Registration> {
        let name = &manifest.mapping.name;
        let latest = self.store.mapping(name)?;
        let new = match &latest {
            None => NewMappingRevision {
                name: name.clone(),
                manifest_digest: manifest_digest.to_string(),
                component_sha256: component_sha256.to_string(),
                connection_id: rev.connection_id.clone(),
                config_revision: rev.revision,
                snapshot_digest: None,
                pins: Pins::default().to_value(),
                state: MappingState::Candidate,
                reviewer: None,
                reason: "first seen; not reviewed".into(),
                manifest_text: manifest_text.map(str::to_string),
            },
            Some(latest)
                if latest.manifest_digest == manifest_digest
                    && latest.connection_id == rev.connection_id
                    && latest.config_revision == rev.revision =>
            {
                return Ok(Registration::Recorded(Box::new(latest.clone())));
            }
            Some(latest)
                if latest.state.serves()
                    && latest.connection_id == rev.connection_id
                    && latest.config_revision == rev.revision
                    && let Some(prior) =
                        self.serving_until_deployed(name, manifest_digest, rev)? =>
            {
                // Approved ahead of deployment: the revision of the manifest that is still
                // deployed serves on until the approved one lands.
                return Ok(Registration::Recorded(Box::new(prior)));
            }
            Some(latest) => {
                let reason = if latest.connection_id != rev.connection_id
                    || latest.config_revision != rev.revision
                {
                    format!(
                        "connection configuration changed: its executable, script, args, working directory or environment differ (now {} revision {}; revision {} was bound to {} revision {}); `airlock discover` shows the new catalogue",
                        rev.connection_id,
                        rev.revision,
                        latest.revision,
                        latest.connection_id,
                        latest.config_revision
                    )
                } else {
                    format!(
                        "manifest changed (sha256 {}; revision {} binds {})",
                        short(manifest_digest),
                        latest.revision,
                        short(&latest.manifest_digest)
                    )
                };
                if stage {
                    self.trace(
                        events::MAPPING_STAGED,
                        name,
                        json!({
                            "manifest_digest": manifest_digest,
                            "component_sha256": component_sha256,
                            "serving_revision": latest.revision,
                            "reason": reason,
                        }),
                    );
                    return Ok(Registration::Staged { reason });
                }
                let old = Pins::from_value(&latest.pins);
                let mut pins = Pins {
                    config_digest: old.config_digest.clone(),
                    server_name: old.server_name.clone(),
                    ..Pins::default()
                };
                for tool in &manifest.upstream.tools {
                    if let Some(d) = old.tools.get(tool) {
                        pins.tools.insert(tool.clone(), d.clone());
                    }
                }
                let state = if latest.state == MappingState::Candidate {
                    MappingState::Candidate
                } else {
                    MappingState::ReviewRequired
                };
                NewMappingRevision {
                    name: name.clone(),
                    manifest_digest: manifest_digest.to_string(),
                    component_sha256: component_sha256.to_string(),
                    connection_id: rev.connection_id.clone(),
                    config_revision: rev.revision,
                    snapshot_digest: latest.snapshot_digest.clone(),
                    pins: pins.to_value(),
                    state,
                    reviewer: None,
                    reason,
                    manifest_text: manifest_text.map(str::to_string),
                }
            }
        };
        // The revision and the MACed event that proves it, in one transaction (the store
        // adds "revision").
        let event = crate::store::NewEvent::new(
            events::MAPPING_REVISION,
            name.clone(),
            json!({
                "state": new.state,
                "reason": new.reason,
                "manifest_digest": new.manifest_digest,
                "component_sha256": new.component_sha256,
                "connection_id": new.connection_id,
                "config_revision": new.config_revision,
                "pins": new.pins,
            }),
        );
        let record = self.store.add_mapping_revision_traced(&new, vec![event])?;
        Ok(Registration::Recorded(Box::new(record)))
    }

    /// The newest revision that binds `manifest_digest` on `rev` and was serving when a
    /// later approval (of another manifest, not deployed yet) superseded it; returned with
    /// its serving state restored, for a host to serve until the approved manifest lands.
    fn serving_until_deployed(
        &self,
        name: &str,
        manifest_digest: &str,
        rev: &ConnectionRevision,
    ) -> Result<Option<MappingRecord>> {
        let revisions = self.store.mapping_revisions(name)?;
        let Some(prior) = revisions.into_iter().rev().find(|r| {
            r.manifest_digest == manifest_digest
                && r.connection_id == rev.connection_id
                && r.config_revision == rev.revision
        }) else {
            return Ok(None);
        };
        Ok(prior.superseded_while_serving().map(|state| MappingRecord {
            state,
            reason: format!(
                "{}; serving until the manifest approved later is deployed",
                prior.reason
            ),
            ..prior
        }))
    }

    /// Decides whether `record` may serve with `tools` (the manifest's upstream tools)
    /// against `current`, the connection's latest snapshot.
    pub fn evaluate(
        &self,
        record: &MappingRecord,
        tools: &[String],
        current: &Catalogue,
    ) -> Verdict {
        if !record.state.serves() {
            return Verdict::Blocked {
                reason: format!(
                    "mapping `{}` is {}: {}",
                    record.name, record.state, record.reason
                ),
                drift: vec![],
                needs_review: false,
            };
        }
        if record.connection_id != current.connection_id || record.snapshot_digest.is_none() {
            return Verdict::Blocked {
                reason: "the mapping is not bound to this connection".into(),
                drift: vec![],
                needs_review: true,
            };
        }
        let pins = Pins::from_value(&record.pins);
        let mut broken = Vec::new();
        for tool in tools {
            let now = current.tool(tool).map(drift::item_digests);
            match (pins.tools.get(tool), now) {
                (Some(pin), Some(now)) if *pin == now => {}
                _ => broken.push(tool.clone()),
            }
        }
        // Fast path: every pin matches, on the same configuration and the same server
        // name. The pinned snapshot is read (and diffed) only to explain a mismatch.
        if broken.is_empty()
            && pins.config_digest.as_deref() == Some(current.config_digest.as_str())
            && pins.server_name.as_deref() == Some(server_name(current).as_str())
        {
            return Verdict::Serves;
        }
        let pinned_snapshot = record
            .snapshot_digest
            .as_deref()
            .and_then(|d| self.store.snapshot(d).ok().flatten())
            .and_then(|s| serde_json::from_value::<Catalogue>(s.body).ok());
        // Classify against the pinned snapshot when it can be read; the pins alone still
        // say which tools broke and whether the server's name changed.
        let mut found: Vec<Drift> = match &pinned_snapshot {
            Some(old) => drift::diff_tools(old, current, tools)
                .into_iter()
                .chain(drift::diff_server(old, current))
                .filter(|d| d.change.is_meaning_bearing())
                .collect(),
            None => vec![],
        };
        let now_name = server_name(current);
        if let Some(pinned_name) = &pins.server_name
            && *pinned_name != now_name
            && !found.iter().any(|d| d.item == ItemKind::Server)
        {
            found.push(Drift {
                item: ItemKind::Server,
                key: String::new(),
                change: Change::ServerNameChanged {
                    from: pinned_name.clone(),
                    to: now_name,
                },
            });
        }
        for tool in &broken {
            let explained = found.iter().any(|d| {
                d.key == *tool
                    || matches!(&d.change, Change::PossiblyRenamed { from } if from == tool)
            });
            if !explained {
                found.push(Drift {
                    item: ItemKind::Tool,
                    key: tool.clone(),
                    change: if current.tool(tool).is_some() {
                        Change::SchemaChanged
                    } else {
                        Change::Removed
                    },
                });
            }
        }
        let pinned_config = pins
            .config_digest
            .as_deref()
            .or(pinned_snapshot.as_ref().map(|c| c.config_digest.as_str()));
        if pinned_config.is_some_and(|d| d != current.config_digest) {
            return Verdict::Blocked {
                reason: "the connection's configuration revision changed since review".into(),
                drift: found,
                needs_review: true,
            };
        }
        if broken.is_empty() && found.is_empty() {
            return Verdict::Serves;
        }
        let summary: Vec<String> = found.iter().take(5).map(ToString::to_string).collect();
        Verdict::Blocked {
            reason: format!("upstream drift on pinned tools: {}", summary.join("; ")),
            drift: found,
            needs_review: true,
        }
    }

    /// Judges `record` against `current` (see [`Registry::evaluate`]) and, when its pins
    /// broke or its configuration changed, records the move to `review-required`. Returns
    /// the record as it stands afterwards.
    ///
    /// # Errors
    /// The store fails.
    pub fn judge(
        &self,
        record: MappingRecord,
        tools: &[String],
        current: &Catalogue,
        snapshot: &str,
    ) -> Result<MappingRecord> {
        if let Verdict::Blocked {
            reason,
            drift,
            needs_review: true,
        } = self.evaluate(&record, tools, current)
            && let Some(new) = self.require_review(&record, &reason, &drift, snapshot)?
        {
            return Ok(new);
        }
        Ok(record)
    }

    /// Moves a serving mapping to `review-required` because of `verdict`, tracing the drift
    /// and the state change. Returns the new record, or `None` when it no longer served.
    ///
    /// # Errors
    /// The store fails.
    pub fn require_review(
        &self,
        record: &MappingRecord,
        reason: &str,
        drift: &[Drift],
        snapshot: &str,
    ) -> Result<Option<MappingRecord>> {
        if !drift.is_empty() {
            self.trace(
                events::DRIFT_FOUND,
                &record.name,
                json!({
                    "revision": record.revision,
                    "pinned_snapshot": record.snapshot_digest,
                    "current_snapshot": snapshot,
                    "drift": drift,
                }),
            );
        }
        let event = crate::store::NewEvent::new(
            events::MAPPING_STATE,
            record.name.clone(),
            json!({
                "from": record.state,
                "to": MappingState::ReviewRequired,
                "reason": reason,
            }),
        );
        self.store.set_mapping_state_traced(
            &record.name,
            record.state,
            MappingState::ReviewRequired,
            reason,
            vec![event],
        )
    }

    /// Approves a mapping: records `reviewer`, the time and the pins taken from `snapshot`
    /// (which must belong to the mapping's connection revision) as a new revision in state
    /// `active`.
    ///
    /// # Errors
    /// A tool the manifest lists is missing from the snapshot; the snapshot belongs to
    /// another connection or revision; the mapping is historical; the store fails.
    pub fn approve_tools(
        &self,
        mapping: &MappingIdentity<'_>,
        rev: &ConnectionRevision,
        snapshot: &StoredSnapshot,
        reviewer: &str,
    ) -> Result<MappingRecord> {
        self.approve_tools_with(
            mapping,
            rev,
            snapshot,
            reviewer,
            &ApprovalOptions::default(),
        )
    }

    /// [`Registry::approve_tools`] with `options`: approved as `limited` to the profiles
    /// and requesters `options.limited_to` names (`profile:NAME`, `requester:NAME`; see
    /// [`Pins::limited_to`]) when it is not empty, a first rollout promoted to `active`
    /// later ([`Registry::promote`]); and, given the mapping's class, checked against
    /// what the server says of its own tools ([`annotation_conflicts`]): a conflict needs
    /// `options.acknowledge_annotations`, and each acknowledged one is recorded in the
    /// revision's `mapping-revision` event (`acknowledged_annotations`).
    ///
    /// # Errors
    /// As [`Registry::approve_tools`]; a scope entry of another form; an annotation
    /// conflict not acknowledged (the message lists them and says how).
    pub fn approve_tools_with(
        &self,
        mapping: &MappingIdentity<'_>,
        rev: &ConnectionRevision,
        snapshot: &StoredSnapshot,
        reviewer: &str,
        options: &ApprovalOptions<'_>,
    ) -> Result<MappingRecord> {
        let limited_to = options.limited_to;
        check_limited_scope(limited_to)?;
        let mut scope: Vec<String> = limited_to.to_vec();
        scope.sort();
        scope.dedup();
        let state = if scope.is_empty() {
            MappingState::Active
        } else {
            MappingState::Limited
        };
        let MappingIdentity {
            name,
            tools,
            manifest_digest,
            manifest_text,
            component_sha256,
        } = *mapping;
        if reviewer.trim().is_empty() {
            bail!("--reviewer is empty: an approval records who approved it (is $USER set?)");
        }
        if snapshot.connection_id != rev.connection_id || snapshot.config_revision != rev.revision {
            bail!(
                "snapshot {} belongs to {} revision {}, not to connection `{}` ({} revision {}); run `airlock discover {} --config FILE` first",
                short(&snapshot.digest),
                snapshot.connection_id,
                snapshot.config_revision,
                rev.name,
                rev.connection_id,
                rev.revision,
                rev.name
            );
        }
        let catalogue: Catalogue = serde_json::from_value(snapshot.body.clone())
            .context("the stored snapshot does not parse")?;
        let mut pins = Pins {
            config_digest: Some(catalogue.config_digest.clone()),
            server_name: Some(server_name(&catalogue)),
            limited_to: scope.clone(),
            ..Pins::default()
        };
        let mut missing = Vec::new();
        for tool in tools {
            match catalogue.tool(tool) {
                Some(t) => {
                    pins.tools.insert(tool.clone(), drift::item_digests(t));
                }
                None => missing.push(tool.clone()),
            }
        }
        if !missing.is_empty() {
            bail!(
                "snapshot {} has no tool named {}; the mapping cannot be approved against it",
                short(&snapshot.digest),
                missing.join(", ")
            );
        }
        let conflicts = options
            .class
            .map(|class| annotation_conflicts(&catalogue, tools, class))
            .unwrap_or_default();
        if !conflicts.is_empty() && !options.acknowledge_annotations {
            bail!(
                "mapping `{name}` pins upstream tools its server does not call read-only:\n  {}\nread the tools (`airlock snapshots show {} --tool NAME`); if the mapping still only reads, approve again with --acknowledge-annotations (recorded in the trace)",
                conflicts.join("\n  "),
                short(&snapshot.digest)
            );
        }
        if let Some(latest) = self.store.mapping(name)?
            && latest.state == MappingState::Historical
        {
            bail!("mapping `{name}` is historical; it cannot be approved again");
        }
        let pins = pins.to_value();
        let event = crate::store::NewEvent::new(events::MAPPING_REVISION, name.to_string(), {
            let mut payload = json!({
                "state": state,
                "reviewer": reviewer,
                "snapshot": snapshot.digest,
                "pins": pins,
                "manifest_digest": manifest_digest,
                "component_sha256": component_sha256,
            });
            if !conflicts.is_empty() {
                payload["acknowledged_annotations"] = json!(conflicts);
            }
            payload
        });
        self.store.add_mapping_revision_traced(
            &NewMappingRevision {
                name: name.to_string(),
                manifest_digest: manifest_digest.to_string(),
                component_sha256: component_sha256.to_string(),
                connection_id: rev.connection_id.clone(),
                config_revision: rev.revision,
                snapshot_digest: Some(snapshot.digest.clone()),
                pins,
                state,
                reviewer: Some(reviewer.to_string()),
                reason: if scope.is_empty() {
                    format!("approved by {reviewer}")
                } else {
                    format!("approved by {reviewer}, limited to {}", scope.join(", "))
                },
                manifest_text: manifest_text.map(str::to_string),
            },
            vec![event],
        )
    }

    /// Promotes a `limited` mapping revision to `active`: offered to every session its
    /// profile includes from now on.
    ///
    /// # Errors
    /// Unknown mapping, a revision that is not `limited`, the store fails.
    pub fn promote(&self, name: &str, reviewer: &str) -> Result<MappingRecord> {
        let latest = self
            .store
            .mapping(name)?
            .with_context(|| format!("no mapping named `{name}` is recorded"))?;
        if latest.state != MappingState::Limited {
            bail!(
                "mapping `{name}` revision {} is {}, not limited: only a limited rollout is promoted",
                latest.revision,
                latest.state
            );
        }
        let reason = format!("promoted to active by {reviewer}");
        let event = crate::store::NewEvent::new(
            events::MAPPING_STATE,
            name.to_string(),
            json!({"from": latest.state, "to": MappingState::Active, "reason": reason}),
        );
        self.store
            .set_mapping_state_traced(
                name,
                MappingState::Limited,
                MappingState::Active,
                &reason,
                vec![event],
            )?
            .with_context(|| format!("mapping `{name}` changed state meanwhile; try again"))
    }

    /// Moves a mapping to `retiring` (it stops serving new calls).
    ///
    /// # Errors
    /// Unknown mapping, an invalid transition, the store fails.
    pub fn retire(&self, name: &str, reviewer: &str) -> Result<MappingRecord> {
        let latest = self
            .store
            .mapping(name)?
            .with_context(|| format!("no mapping named `{name}` is recorded"))?;
        let reason = format!("retired by {reviewer}");
        let event = crate::store::NewEvent::new(
            events::MAPPING_STATE,
            name.to_string(),
            json!({"from": latest.state, "to": MappingState::Retiring, "reason": reason}),
        );
        self.store
            .set_mapping_state_traced(
                name,
                latest.state,
                MappingState::Retiring,
                &reason,
                vec![event],
            )?
            .with_context(|| format!("mapping `{name}` changed state meanwhile; try again"))
    }
}

/// The first 12 characters of a digest, for people.
pub fn short(digest: &str) -> &str {
    &digest[..digest.len().min(12)]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{NewEvent, SqliteStore};

    /// Only a mapping that changes nothing upstream is checked, and only a tool its server
    /// calls read-only (`readOnlyHint: true`) passes; an absent hint is not read-only (the
    /// MCP default).
    #[test]
    fn annotation_conflicts_are_tools_not_called_read_only_under_a_read_mapping() {
        use crate::contract::EffectClass;
        let catalogue: drift::Catalogue = serde_json::from_value(json!({
            "connection_id": "conn-000000000000",
            "config_digest": "c",
            "server_info": {},
            "protocol_version": "2025-11-25",
            "capabilities": {},
            "instructions": null,
            "resources": [],
            "resource_templates": [],
            "prompts": [],
            "tools": [
                {"name": "ro", "annotations": {"readOnlyHint": true}},
                {"name": "rw", "annotations": {"readOnlyHint": false, "destructiveHint": false}},
                {"name": "silent"},
            ],
        }))
        .unwrap();
        let tools: Vec<String> = ["ro", "rw", "silent", "absent"].map(String::from).to_vec();
        let read = annotation_conflicts(&catalogue, &tools, EffectClass::Read);
        assert_eq!(read.len(), 2, "{read:?}");
        assert!(
            read[0].contains("`rw`") && read[0].contains("readOnlyHint false)"),
            "{read:?}"
        );
        assert!(
            read[1].contains("`silent`")
                && read[1].contains("no readOnlyHint, not said non-destructive"),
            "{read:?}"
        );
        assert_eq!(
            annotation_conflicts(&catalogue, &tools, EffectClass::LocalTransformation).len(),
            2
        );
        for class in [EffectClass::ReversibleMutation, EffectClass::ExternalEffect] {
            assert!(annotation_conflicts(&catalogue, &tools, class).is_empty());
        }
    }

    fn approved(registry: &Registry) -> MappingRecord {
        let new = NewMappingRevision {
            name: "library".into(),
            manifest_digest: "m".repeat(64),
            component_sha256: "c".repeat(64),
            connection_id: "conn-000000000000".into(),
            config_revision: 1,
            snapshot_digest: Some("s".repeat(64)),
            pins: json!({"tools": {"search": {"schema": "a", "description": "b"}}}),
            state: MappingState::Active,
            reviewer: Some("alice".into()),
            reason: "approved by alice".into(),
            manifest_text: None,
        };
        let event = NewEvent::new(
            events::MAPPING_REVISION,
            "library",
            json!({"state": new.state, "pins": new.pins, "manifest_digest": new.manifest_digest, "component_sha256": new.component_sha256}),
        );
        registry
            .store()
            .add_mapping_revision_traced(&new, vec![event])
            .unwrap()
    }

    #[test]
    fn only_what_the_trace_recorded_serves() {
        let dir = tempfile::tempdir().unwrap();
        let registry = Registry::new(Arc::new(SqliteStore::open(dir.path()).unwrap()));
        let record = approved(&registry);
        assert_eq!(registry.prove(&record).unwrap(), None);
        // Each field the trace binds, changed alone, is refused.
        let forged = [
            MappingRecord {
                revision: record.revision + 1,
                ..record.clone()
            },
            MappingRecord {
                manifest_digest: "x".repeat(64),
                ..record.clone()
            },
            MappingRecord {
                component_sha256: "x".repeat(64),
                ..record.clone()
            },
            MappingRecord {
                pins: json!({"tools": {}}),
                ..record.clone()
            },
            MappingRecord {
                state: MappingState::Limited,
                ..record.clone()
            },
        ];
        for f in forged {
            let why = registry.prove(&f).unwrap().expect("must be refused");
            let refused = registry.proven(f);
            assert!(!refused.state.serves(), "{why}");
        }
        let retired = registry.retire("library", "bob").unwrap();
        let reactivated = MappingRecord {
            state: MappingState::Active,
            ..retired
        };
        let why = registry.prove(&reactivated).unwrap().unwrap();
        assert!(why.contains("the trace says retiring"), "{why}");
    }
}
