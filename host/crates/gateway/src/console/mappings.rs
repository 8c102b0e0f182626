//! The console's mapping review: per mapping, the four questions a reviewer asks — what
//! did the server advertise, what did Airlock derive from it for the model, what did
//! fixtures establish, who may use it under current policy — with drift as a
//! side-by-side diff, the adapter's grants, and the reviewer's decisions.
//!
//! Rules:
//! - **The same facts as the CLI.** The page is built from [`crate::review::review_show`]
//!   (`airlock review show`), drift from [`crate::registry::drift::diff`] (the one place
//!   that decides what is meaning-bearing), grants from [`crate::review::grants`]
//!   (`airlock grants --html`: one renderer for both), decisions through
//!   [`crate::review::approve`] and [`crate::registry::Registry::retire`].
//! - **Upstream text is hostile.** Tool names, descriptions, schemas and the server's
//!   instructions come from a third-party server: they are shown escaped, as text, never
//!   as markup, and never followed as links.
//! - **What policy says is asked, not guessed.** The policy check runs the host's own
//!   decision ([`crate::policy::PolicyEngine::decide_call`]) for each capability, profile
//!   and the requester typed in, without argument facts (as `tools/list` does); it needs
//!   the console of a serving host (`serve --http` with `[http] console = true`).

use std::collections::BTreeSet;

use maud::{Markup, html};
use serde_json::Value;

use super::pages::{layout, when};
use crate::registry::drift::{Catalogue, Drift};
use crate::review::ReviewShow;
use crate::store::{MappingRecord, StoredSnapshot};

/// The list of mappings.
pub fn list_page(mappings: &[MappingRecord]) -> Markup {
    layout(
        "Mappings",
        html! {
            h1 { "Mappings" }
            p { "Each mapping's latest revision. Open one for what its server advertised, what the model is offered, what fixtures established and who may use it." }
            table {
                thead { tr { th { "mapping" } th { "revision" } th { "state" } th { "reviewer" } th { "since" } } }
                tbody {
                    @for m in mappings {
                        tr {
                            td { a href={ "/console/mappings/" (m.name) } { (m.name) } }
                            td { (m.revision) }
                            td.state { (m.state.as_str()) }
                            td { (m.reviewer.as_deref().unwrap_or("")) }
                            td { (when(m.state_changed_ms)) }
                        }
                    }
                }
            }
        },
    )
}

/// One row of the policy check: a capability in a profile, and policy's answer.
pub struct PolicyRow {
    pub capability: String,
    pub profile: String,
    /// `allow`, `require-approval`, `deny (category)`, or why it is not offered there.
    pub answer: String,
    pub determining: Vec<String>,
}

/// What the live host knows of one capability of the mapping.
pub struct Derived {
    pub name: String,
    pub description: String,
    pub schema: Value,
}

/// Everything the mapping page shows.
pub struct MappingView<'a> {
    pub show: &'a ReviewShow,
    /// The pinned snapshot's tools the mapping uses, by name (raw JSON), when the snapshot
    /// is stored.
    pub pinned_tools: Vec<(String, Option<Value>)>,
    /// The capabilities as the serving host offers them, when the console runs in one.
    pub derived: Option<Vec<Derived>>,
    /// The policy check, when asked and the console runs in a serving host.
    pub policy: Option<(String, Vec<PolicyRow>)>,
    /// Whether the console can check policy (it runs in a serving host).
    pub can_check_policy: bool,
    /// Whether the console can approve (it knows the serve configuration).
    pub can_approve: bool,
    pub csrf: &'a str,
    pub person: &'a str,
    pub notice: Option<&'a str>,
    /// Why policy does not let this person review or retire it.
    pub review_refused: Option<String>,
    pub retire_refused: Option<String>,
}

/// The mapping page (module rules).
pub fn mapping_page(v: &MappingView<'_>) -> Markup {
    let s = v.show;
    let c = &s.current;
    let name = &c.name;
    layout(
        name,
        html! {
            h1 { "Mapping " (name) }
            @if let Some(n) = v.notice {
                p.notice role="status" { "Done: " (n) }
            }
            @if let Some(why) = &s.tampered {
                p.refusal role="alert" { strong { "Tampered: " } "the trace does not prove this revision's state, so it does not serve: " (why) }
            }
            dl {
                dt { "revision" } dd { (c.revision) }
                dt { "state" } dd { (c.state.as_str()) }
                dt { "reviewer" } dd { (c.reviewer.as_deref().unwrap_or("nobody yet")) }
                dt { "reason" } dd { (c.reason) }
                dt { "connection" } dd { (c.connection_id) " (configuration revision " (c.config_revision) ")" }
                dt { "component" } dd { "sha256 " (c.component_sha256) }
                dt { "manifest" } dd { "sha256 " (c.manifest_digest) }
                dt { "host API" } dd { (s.host_version.as_ref().map(|h| h.to_string()).unwrap_or_else(|| "unknown".into())) " — " (s.host_version_source) }
            }

            h2 { "1. What the server advertised" }
            @match &c.snapshot_digest {
                None => p { "No snapshot is pinned: nobody approved this revision against what its server advertises." },
                Some(d) => p { "Pinned snapshot " code { (d) } ". The tools this mapping uses, as the server described them then (the server's own text, shown as text):" },
            }
            @for (tool, raw) in &v.pinned_tools {
                section.approval {
                    h3 { code { (tool) } }
                    @match raw {
                        Some(raw) => {
                            @if let Some(d) = raw.get("description").and_then(Value::as_str) {
                                p.upstream { (d) }
                            }
                            details {
                                summary { "raw JSON" }
                                pre { (serde_json::to_string_pretty(raw).unwrap_or_default()) }
                            }
                        }
                        None => p.empty { "not in the stored snapshot" },
                    }
                }
            }
            @match (&s.latest_snapshot, &s.check) {
                (Some(latest), Some(check)) => {
                    p {
                        "The connection's latest snapshot is " code { (latest) } ": "
                        @if check.would_serve { "the pins hold." } @else { "it would not serve: " (check.reason.as_deref().unwrap_or("")) }
                        @if c.snapshot_digest.as_deref() != Some(latest.as_str()) {
                            " " a href={ "/console/mappings/" (name) "/drift" } { "Compare side by side" }
                        }
                    }
                    @if !check.drift.is_empty() {
                        ul.drift { @for d in &check.drift { li.meaning { (d.to_string()) } } }
                    }
                }
                _ => p { "No snapshot of the connection is stored." },
            }

            h2 { "2. What Airlock offers the model" }
            @match &v.derived {
                Some(derived) => {
                    @for d in derived {
                        section.approval {
                            h3 { code { (d.name) } }
                            p { (d.description) }
                            details { summary { "input schema" } pre { (serde_json::to_string_pretty(&d.schema).unwrap_or_default()) } }
                        }
                    }
                }
                None => p.empty { "The descriptions and schemas the model sees are known to a serving host: open this page in the console of `airlock serve --http`." },
            }
            table {
                thead { tr { th { "capability" } th { "contract function" } th { "effect" } } }
                tbody {
                    @for cap in &s.capabilities {
                        tr {
                            td { (cap.name) }
                            td { (cap.function) }
                            td {
                                @match &cap.effect {
                                    Some(e) => (crate::review::grants::effect_text(e, cap.contract_effect.as_ref())),
                                    None => (cap.problem.as_deref().unwrap_or("unknown")),
                                }
                            }
                        }
                    }
                }
            }

            h2 { "3. What fixtures established" }
            @match &s.fixture_tested {
                Some(f) => p {
                    "Revision " (f.revision) " became fixture-tested " (when(f.at_ms)) ": " (f.fixtures) " fixture(s), digest " code { (f.fixtures_sha256) }
                    @if f.stale_allowed { " (stale fixtures were allowed)" } "."
                },
                None => p { "No `airlock test` run is recorded for this mapping." },
            }

            h2 { "4. Who may use it" }
            @if v.can_check_policy {
                form method="get" action={ "/console/mappings/" (name) } {
                    label { "requester " input type="text" name="requester" required value=(v.policy.as_ref().map(|p| p.0.as_str()).unwrap_or("")); }
                    " "
                    label { "roles " input type="text" name="roles" placeholder="operator, analyst"; }
                    " "
                    button type="submit" { "Check policy" }
                }
                @if let Some((who, rows)) = &v.policy {
                    p { "What current policy answers for " strong { (who) } " (before any argument is known):" }
                    table {
                        thead { tr { th { "capability" } th { "profile" } th { "answer" } th { "decided by" } } }
                        tbody {
                            @for r in rows {
                                tr { td { (r.capability) } td { (r.profile) } td { (r.answer) } td { (r.determining.join(", ")) } }
                            }
                        }
                    }
                }
            } @else {
                p.empty { "Policy is known to a serving host: open this page in the console of `airlock serve --http`, or run `airlock policy check`." }
            }

            h2 { "Grants" }
            @if v.can_approve {
                p { a href={ "/console/mappings/" (name) "/grants" } { "The adapter's grants and imports" } " (what `airlock grants --html` prints)." }
            } @else {
                p.empty { "The grants review reads the adapter's component from the serve configuration: start the console with --config, or open it in the console of `airlock serve --http`." }
            }

            h2 { "Revisions" }
            table {
                thead { tr { th { "revision" } th { "state" } th { "reviewer" } th { "snapshot" } th { "recorded" } } }
                tbody {
                    @for r in s.revisions.iter().rev() {
                        tr {
                            td { (r.revision) } td { (r.state.as_str()) } td { (r.reviewer.as_deref().unwrap_or("")) }
                            td { code { (r.snapshot_digest.as_deref().map(|d| &d[..d.len().min(12)]).unwrap_or("")) } }
                            td { (when(r.created_ms)) }
                        }
                    }
                }
            }

            h2 { "Decide" }
            p { "Deciding as " strong { (v.person) } "." }
            @if v.can_approve {
                @match &v.review_refused {
                    Some(why) => p.refusal { "You may not approve this mapping: " (why) "." },
                    None => @if let Some(latest) = &s.latest_snapshot {
                        form method="post" action={ "/console/mappings/" (name) } {
                            input type="hidden" name="csrf" value=(v.csrf);
                            input type="hidden" name="action" value="approve";
                            input type="hidden" name="revision" value=(c.revision);
                            input type="hidden" name="snapshot" value=(latest);
                            button type="submit" { "Approve against snapshot " (&latest[..latest.len().min(12)]) }
                        }
                    },
                }
            }
            @match &v.retire_refused {
                Some(why) => p.refusal { "You may not retire this mapping: " (why) "." },
                None => form method="post" action={ "/console/mappings/" (name) } {
                    input type="hidden" name="csrf" value=(v.csrf);
                    input type="hidden" name="action" value="retire";
                    input type="hidden" name="revision" value=(c.revision);
                    button type="submit" { "Retire" }
                },
            }
        },
    )
}

/// The tool names either catalogue lists, sorted.
fn tool_names(a: &Catalogue, b: &Catalogue) -> Vec<String> {
    let mut names = BTreeSet::new();
    for t in a.tools.iter().chain(&b.tools) {
        if let Some(n) = t.get("name").and_then(Value::as_str) {
            names.insert(n.to_string());
        }
    }
    names.into_iter().collect()
}

fn tool<'a>(c: &'a Catalogue, name: &str) -> Option<&'a Value> {
    c.tools
        .iter()
        .find(|t| t.get("name").and_then(Value::as_str) == Some(name))
}

/// A tool as a reviewer compares it: its description, then the rest of its JSON.
fn shown_tool(t: Option<&Value>) -> (String, String) {
    match t {
        None => ("(absent)".into(), String::new()),
        Some(t) => {
            let description = t
                .get("description")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            let mut rest = t.clone();
            if let Some(o) = rest.as_object_mut() {
                o.remove("description");
            }
            (
                description,
                serde_json::to_string_pretty(&rest).unwrap_or_default(),
            )
        }
    }
}

/// Drift between two snapshots of one connection, side by side: per tool, the old and the
/// new description and JSON, the classified changes beside them, meaning-bearing ones
/// marked.
pub fn drift_page(
    name: &str,
    old: &StoredSnapshot,
    new: &StoredSnapshot,
    old_catalogue: &Catalogue,
    new_catalogue: &Catalogue,
    drift: &[Drift],
    pinned: &BTreeSet<String>,
) -> Markup {
    layout(
        "Drift",
        html! {
            h1 { "Drift of " (name) "'s connection" }
            p { "From snapshot " code { (old.digest) } " (" (when(old.first_seen_ms)) ") to " code { (new.digest) } " (" (when(new.first_seen_ms)) "). "
                "Changes marked " strong.meaning { "meaning-bearing" } " move the mapping to review-required when they touch a tool it pins; the rest are recorded only." }
            @let server: Vec<&Drift> = drift.iter().filter(|d| d.key.is_empty()).collect();
            @if !server.is_empty() {
                ul { @for d in server { li.meaning[d.change.is_meaning_bearing()] { (d.to_string()) } } }
            }
            table.diff {
                thead { tr { th { "tool" } th { "before" } th { "after" } th { "changes" } } }
                tbody {
                    @for t in tool_names(old_catalogue, new_catalogue) {
                        @let changes: Vec<&Drift> = drift.iter().filter(|d| d.key == t).collect();
                        @let (old_d, old_rest) = shown_tool(tool(old_catalogue, &t));
                        @let (new_d, new_rest) = shown_tool(tool(new_catalogue, &t));
                        tr.changed[!changes.is_empty()] id={ "tool-" (t) } {
                            td { code { (t) } @if pinned.contains(&t) { br; small { "pinned" } } }
                            td.before { p.upstream { (old_d) } @if old_rest != new_rest { pre { (old_rest) } } }
                            td.after { p.upstream { (new_d) } @if old_rest != new_rest { pre { (new_rest) } } }
                            td {
                                @if changes.is_empty() { "unchanged" }
                                ul { @for d in &changes {
                                    li.meaning[d.change.is_meaning_bearing() && pinned.contains(&t)] {
                                        (d.to_string())
                                        @if d.change.is_meaning_bearing() && pinned.contains(&t) { " — meaning-bearing" }
                                    }
                                } }
                            }
                        }
                    }
                }
            }
            p { a href={ "/console/mappings/" (name) } { "← the mapping" } }
        },
    )
}
