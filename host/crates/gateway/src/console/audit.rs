//! The audit package of a run: what a reviewer needs to know what an Airlock served
//! between two points of its trace, as one JSON document (`GET
//! /console/trace/audit.json?from=SEQ&to=SEQ`).
//!
//! Rule: **digests and reviewed facts, never credentials or unreviewed raw content.** The
//! package holds: the trace range and a checkpoint of the trace head (seq, MAC, key id —
//! never the key); the configuration events of the range with their MACs — policies
//! loaded (digest, files), catalogues offered (digest, capability names), mapping
//! revisions and state changes (including `fixture-tested`, with the fixture digest),
//! snapshots taken and drift found (digests and tool names, not the tools' raw JSON),
//! contract reviews; every mapping revision the store holds (digests, pins, state,
//! reviewer — not its manifest text, which may name environment values); every contract
//! review (its approved WIT files: reviewed, public content); and the calls of the range
//! counted by outcome. Event payloads are the trace's own safe summaries (the trace never
//! holds arguments, answers or secrets). Upstream tools' descriptions and schemas stay out:
//! they are the server's raw content; their digests are in the pins.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::registry::events;
use crate::store::Store;

/// The format's version, the package's first field.
pub const FORMAT: u32 = 1;

/// The kinds of the configuration events a package carries.
pub const CONFIGURATION_KINDS: [&str; 10] = [
    events::POLICY_LOADED,
    events::CATALOG_OFFERED,
    events::MAPPING_REVISION,
    events::MAPPING_STATE,
    events::MAPPING_LOADED,
    events::SNAPSHOT_TAKEN,
    events::DRIFT_FOUND,
    events::CONNECTION_REVISION,
    crate::store::contracts::CONTRACT_APPROVED,
    crate::store::contracts::CONTRACT_ERRONEOUS,
];

/// The audit package of the trace from `from` to `to` (inclusive; clamped to the
/// trace), as JSON. Reads the range in windows of [`super::trace::WINDOW`] events (each a
/// read of its own), keeping the configuration events and counting the outcomes.
///
/// # Errors
/// The store fails.
pub fn package(store: &dyn Store, from: i64, to: i64) -> anyhow::Result<Value> {
    let head = store.trace_checkpoint()?;
    let to = to.min(head.seq);
    let from = from.max(1);
    // Read in windows of the trace (newest first), so no read holds the store for the
    // whole range and only configuration events are kept; outcomes are only counted.
    let mut kinds: Vec<&str> = CONFIGURATION_KINDS.to_vec();
    kinds.push(events::CALL_OUTCOME);
    let mut configuration = Vec::new();
    let mut outcomes: BTreeMap<String, u64> = BTreeMap::new();
    let mut top = to.saturating_add(1);
    while top > from {
        let floor = top.saturating_sub(super::trace::WINDOW).max(from);
        for e in store.trace_window(top, floor, &kinds)? {
            if e.kind == events::CALL_OUTCOME {
                let outcome = e.payload.get("outcome").and_then(Value::as_str);
                *outcomes
                    .entry(outcome.unwrap_or("?").to_string())
                    .or_default() += 1;
            } else {
                configuration.push(json!({
                    "seq": e.seq,
                    "at_ms": e.at_ms,
                    "kind": e.kind,
                    "subject": e.subject,
                    "payload": e.payload,
                    "mac": e.hash,
                    "key_id": e.key_id,
                }));
            }
        }
        top = floor;
    }
    configuration.reverse();
    let mut mappings = Vec::new();
    for latest in store.mappings()? {
        for r in store.mapping_revisions(&latest.name)? {
            mappings.push(json!({
                "name": r.name,
                "revision": r.revision,
                "state": r.state.as_str(),
                "manifest_sha256": r.manifest_digest,
                "component_sha256": r.component_sha256,
                "connection": r.connection_id,
                "connection_revision": r.config_revision,
                "snapshot_digest": r.snapshot_digest,
                "pins": r.pins,
                "reviewer": r.reviewer,
                "reason": r.reason,
                "created_ms": r.created_ms,
                "state_changed_ms": r.state_changed_ms,
            }));
        }
    }
    let contracts: Vec<Value> = store
        .contract_reviews()?
        .into_iter()
        .map(|c| {
            json!({
                "package": c.package,
                "digest": c.digest,
                "state": c.state.as_str(),
                "reviewer": c.reviewer,
                "reason": c.reason,
                "files": serde_json::from_str::<Value>(&c.files).unwrap_or(Value::Null),
                "created_ms": c.created_ms,
            })
        })
        .collect();
    Ok(json!({
        "airlock_audit_package": FORMAT,
        "generated_ms": crate::store::now_ms(),
        "trace": {
            "from": from,
            "to": to,
            "checkpoint": {
                "seq": head.seq,
                "head": head.head,
                "key_id": head.key_id,
                "at_ms": head.at_ms,
                "mac": head.mac,
            },
        },
        "calls": outcomes,
        "configuration_events": configuration,
        "mappings": mappings,
        "contracts": contracts,
    }))
}
