//! Recorded snapshots as a reviewer reads them (`airlock snapshots list|show`, `airlock
//! snapshots show DIGEST --tool NAME`): each item with its digests, one tool with its
//! schemas outlined.
//!
//! Rule: everything a snapshot holds is the upstream server's words, untrusted: names,
//! titles, descriptions, annotations and schemas are printed escaped and clipped; a schema
//! is outlined to a bounded depth (eight levels) and its `$ref`s are named, not
//! followed.

use std::fmt::Write as _;

use anyhow::{Context as _, Result, bail};
use serde_json::Value;

use super::{safe, server_label, time};
use crate::registry::drift::{self, Catalogue};
use crate::registry::{Registry, short};
use crate::store::{SnapshotSummary, StoredSnapshot};

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
