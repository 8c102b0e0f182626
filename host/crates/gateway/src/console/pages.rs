//! The console's HTML (maud: every interpolated string is escaped). No script, one
//! stylesheet from the console itself (the CSP allows nothing else).

use std::time::Duration;

use maud::{DOCTYPE, Markup, html};

use crate::store::{ApprovalRecord, AttemptRecord, AttemptState, IntentRecord};

/// The console's stylesheet (`/console/console.css`).
pub const CSS: &str = "\
body{font-family:system-ui,sans-serif;margin:0;color:#1b1b1b;background:#f6f6f4}\
header{background:#1f2a30;color:#fff;padding:.6em 1.2em;display:flex;gap:1.5em;align-items:baseline}\
header a{color:#cfe3ee}main{padding:1em 1.2em;max-width:72em}\
.approval{background:#fff;border:1px solid #d5d5d0;border-radius:6px;padding:.8em 1em;margin:0 0 1em}\
.approval h2{font-size:1.05em;margin:0 0 .4em}dl{display:grid;grid-template-columns:max-content 1fr;gap:.15em 1em;margin:.4em 0}\
dt{color:#555}dd{margin:0;font-family:ui-monospace,monospace;overflow-wrap:anywhere}\
pre{background:#f1f1ec;padding:.6em;white-space:pre-wrap;overflow-wrap:anywhere}\
.tampered{border-color:#b3261e;background:#fff4f3}.notice{background:#e7f3e7;padding:.5em .8em;border-radius:4px}\
form{display:inline-block;margin-right:.6em}button{font-size:1em;padding:.3em .9em}\
input[type=text]{width:18em}.empty{color:#555}.refusal{color:#8c1d18}\
table{border-collapse:collapse;background:#fff;margin:.4em 0 1em}th,td{border:1px solid #d5d5d0;padding:.25em .6em;text-align:left}";

/// How often a page with nothing to decide reloads itself (seconds): a person waiting
/// at an empty inbox sees the next request arrive without JavaScript. A page with rows
/// does not reload (a reason being typed would be lost).
pub const REFRESH_EMPTY_S: u32 = 5;

pub(super) fn layout(title: &str, body: Markup) -> Markup {
    layout_refreshing(title, body, false)
}

fn layout_refreshing(title: &str, body: Markup, refresh: bool) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                @if refresh {
                    meta http-equiv="refresh" content=(REFRESH_EMPTY_S);
                }
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " — Airlock console" }
                link rel="stylesheet" href="/console/console.css";
            }
            body {
                header {
                    strong { "Airlock console" }
                    a href="/console/approvals" { "Approvals" }
                    a href="/console/intents" { "Held intents" }
                    a href="/console/connections" { "Connections" }
                    a href="/console/trace" { "Trace" }
                }
                main { (body) }
            }
        }
    }
}

/// A page with a heading and one paragraph.
pub fn message(title: &str, text: &str) -> Markup {
    layout(
        title,
        html! {
            h1 { (title) }
            p { (text) }
        },
    )
}

pub(super) fn when(ms: u64) -> String {
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// In how long `ms` comes, in words (`"in 12m 3s"`, `"passed"`).
fn until(ms: u64, now: u64) -> String {
    if ms <= now {
        return "passed".into();
    }
    let secs = (ms - now) / 1000;
    format!(
        "in {}",
        humantime::format_duration(Duration::from_secs(secs))
    )
}

/// One row of the inbox.
pub struct InboxRow {
    pub approval: ApprovalRecord,
    /// Why the trace does not prove the row (then it is shown, never decidable).
    pub tampered: Option<String>,
    /// Why policy does not let this person approve it (then no Approve button).
    pub refused: Option<String>,
}

/// The login form of a console of people: the person pastes the bearer token they hold
/// for this Airlock (`why`: the last attempt's refusal).
pub fn token_login(why: Option<&str>) -> Markup {
    layout(
        "Log in",
        html! {
            h1 { "Log in" }
            p { "Paste the access token (a bearer token for this Airlock, as its MCP endpoint takes) you act with. The console acts as its subject, in its roles; policy decides what you may do." }
            @if let Some(why) = why {
                p.refusal role="alert" { "Refused: " (why) }
            }
            form method="post" action="/console/login" {
                label { "Access token " input type="password" name="token" required autocomplete="off"; }
                " "
                button type="submit" { "Log in" }
            }
        },
    )
}

/// The approvals inbox: each pending approval with exactly what approving it lets happen,
/// and the forms that decide it (`tampered` rows are shown, never decidable); `next`: the
/// `after` of the next page, when there may be one.
pub fn inbox(
    rows: &[InboxRow],
    approved: &[(ApprovalRecord, Option<String>)],
    now: u64,
    csrf: &str,
    operator: &str,
    notice: Option<&str>,
    next: Option<&str>,
) -> Markup {
    layout_refreshing(
        "Approvals",
        html! {
            h1 { "Pending approvals" }
            p { "Deciding as " strong { (operator) } ". An approval lets the exact call below run once, while its mapping revision, snapshot and policy are unchanged." }
            @if let Some(n) = notice {
                p.notice role="status" { "Decided: " (n) }
            }
            @if rows.is_empty() {
                p.empty { "Nothing waits for a person." }
            }
            @for InboxRow { approval: r, tampered, refused } in rows {
                @let b = &r.binding;
                section.approval.tampered[tampered.is_some()] id=(r.id) {
                    h2 { (b.capability) " — requested by " (b.requester) }
                    @if let Some(why) = tampered {
                        p { strong { "Tampered: " } "the trace does not prove this request, so it authorizes nothing and cannot be decided: " (why) }
                    }
                    dl {
                        dt { "approval" } dd { (r.id) }
                        dt { "asked by" } dd { (r.mode.as_str()) }
                        dt { "mapping" } dd { (b.mapping) " revision " (b.mapping_revision) }
                        dt { "profile" } dd { (r.profile) }
                        dt { "arguments" } dd { "sha256 " (b.args_digest) }
                        @if let Some(a) = &b.artifact_digest {
                            dt { "artifact" } dd { "sha256 " (a) }
                        }
                        dt { "snapshot" } dd { (b.snapshot_digest) }
                        dt { "policy" } dd { (b.policy_digest) }
                        dt { "created" } dd { (when(r.created_ms)) }
                        dt { "expires" } dd { (when(r.expires_ms)) " (" (until(r.expires_ms, now)) ")" }
                    }
                    p { "What it lets happen:" }
                    pre { (r.summary) }
                    @if let (None, Some(why)) = (tampered, refused) {
                        p.refusal { "You may not approve this: " (why) "." }
                    }
                    @if tampered.is_none() {
                        @if refused.is_none() {
                            form method="post" action={ "/console/approvals/" (r.id) } {
                                input type="hidden" name="csrf" value=(csrf);
                                input type="hidden" name="decision" value="approve";
                                button type="submit" { "Approve" }
                            }
                        }
                        form method="post" action={ "/console/approvals/" (r.id) } {
                            input type="hidden" name="csrf" value=(csrf);
                            input type="hidden" name="decision" value="deny";
                            input type="text" name="reason" placeholder="reason (optional)" aria-label="reason";
                            button type="submit" { "Deny" }
                        }
                    }
                }
            }
            @if let Some(after) = next {
                p { a.next href={ "/console/approvals?after=" (after) } { "Older requests →" } }
            }
            @if !approved.is_empty() {
                h2 { "Approved, not used yet" }
                p { "Each of these lets its exact call run once until its receipt expires; revoking it stops that." }
                table {
                    thead { tr { th { "approval" } th { "capability" } th { "requested by" } th { "approved by" } th { "receipt expires" } th {} } }
                    tbody {
                        @for (r, refused) in approved {
                            tr id={ "approved-" (r.id) } {
                                td { (r.id) }
                                td { (r.binding.capability) }
                                td { (r.binding.requester) }
                                td { (r.decided_by.as_deref().unwrap_or("")) }
                                td { (when(r.expires_ms)) " (" (until(r.expires_ms, now)) ")" }
                                td {
                                    @match refused {
                                        Some(why) => span.refusal { "You may not revoke it: " (why) },
                                        None => form method="post" action={ "/console/approvals/" (r.id) } {
                                            input type="hidden" name="csrf" value=(csrf);
                                            input type="hidden" name="decision" value="revoke";
                                            button type="submit" { "Revoke" }
                                        },
                                    }
                                }
                            }
                        }
                    }
                }
            }
        },
        rows.is_empty() && next.is_none() && approved.is_empty(),
    )
}

/// Held intents: each effect whose outcome is unknown, with what was sent and when, and
/// the form that resolves it once (`tampered` rows are shown, never resolvable).
pub fn intents(
    rows: &[(IntentRecord, Vec<AttemptRecord>, Option<String>)],
    csrf: &str,
    operator: &str,
    notice: Option<&str>,
) -> Markup {
    layout_refreshing(
        "Held intents",
        html! {
            h1 { "Held intents" }
            p { "Each of these effects may or may not have happened upstream: its answer was lost and it could not be asked or safely repeated. Check the upstream, then say what you saw. Resolving as " strong { (operator) } "; each intent is resolved once." }
            @if let Some(n) = notice {
                p.notice role="status" { "Resolved: " (n) }
            }
            @if rows.is_empty() {
                p.empty { "No intent is held for a person." }
            }
            @for (r, attempts, tampered) in rows {
                @let i = &r.intent;
                section.approval.tampered[tampered.is_some()] id=(i.id) {
                    h2 { (i.capability) " — requested by " (i.requester) }
                    @if let Some(why) = tampered {
                        p { strong { "Tampered: " } "the trace does not prove this intent, so it cannot be resolved: " (why) }
                    }
                    dl {
                        dt { "intent" } dd { (i.id) }
                        dt { "state" } dd { (r.state.as_str()) }
                        dt { "mapping" } dd { (i.mapping) " revision " (i.mapping_revision) }
                        dt { "effect" } dd { (i.effect_class) }
                        dt { "call" } dd { (i.call_id) }
                        dt { "arguments" } dd { "sha256 " (i.args_digest) }
                        @if let Some(a) = &r.approval_id {
                            dt { "approval" } dd { (a) }
                        }
                        dt { "created" } dd { (when(r.created_ms)) }
                        @for a in attempts {
                            dt { "attempt " (a.attempt) }
                            dd {
                                (a.state.as_str()) " — " (a.requests) " request(s) sent, " (a.answered) " answered"
                                @if let Some(id) = &a.last_request_id { ", last request id " (id) }
                                @for (state, at) in AttemptState::ALL.iter().zip(a.at_ms) {
                                    @if let Some(at) = at { br; (state.as_str()) " " (when(at)) }
                                }
                            }
                        }
                    }
                    @if tampered.is_none() {
                        form method="post" action={ "/console/intents/" (i.id) } {
                            input type="hidden" name="csrf" value=(csrf);
                            label { "What you saw upstream " input type="text" name="evidence" required; }
                            " "
                            button type="submit" name="as" value="completed" { "It happened" }
                            button type="submit" name="as" value="failed" { "It did not happen" }
                        }
                    }
                }
            }
        },
        rows.is_empty(),
    )
}

/// How long ago `ms` was, in words.
fn ago(ms: u64, now: u64) -> String {
    format!(
        "{} ago",
        humantime::format_duration(Duration::from_secs(now.saturating_sub(ms) / 1000))
    )
}

/// What the connections page shows of a connection besides its status line.
pub struct ConnectionExtra {
    /// The protocol version its latest snapshot negotiated.
    pub protocol: Option<String>,
    /// Restarts by this host since it started (`None`: not in a serving host).
    pub restarts: Option<u64>,
}

/// Connections and mappings as the store last saw them, what waits, and the trace's head
/// ([`crate::status::read`]); `extra` is per connection, in order.
pub fn connections(s: &crate::status::Status, extra: &[ConnectionExtra]) -> Markup {
    let now = s.at_ms;
    layout(
        "Connections",
        html! {
            h1 { "Connections" }
            p { "Each connection's state is the one its host last traced (a host that stopped leaves its last state); the protocol is the one its latest snapshot negotiated; restarts are counted by the serving host this console runs in (— outside one)." }
            table {
                thead { tr { th { "connection" } th { "state" } th { "since" } th { "why" } th { "revision" } th { "protocol" } th { "restarts" } } }
                tbody {
                    @for (i, c) in s.connections.iter().enumerate() {
                        @let x = extra.get(i);
                        tr {
                            td { (c.name) }
                            td.state { (c.state.as_deref().unwrap_or("not traced")) }
                            td { @if let Some(at) = c.since_ms { (ago(at, now)) } }
                            td { (c.reason.as_deref().unwrap_or("")) }
                            td { (c.revision) }
                            td { (x.and_then(|x| x.protocol.as_deref()).unwrap_or("")) }
                            td { @match x.and_then(|x| x.restarts) { Some(n) => (n), None => "—" } }
                        }
                    }
                }
            }
            h2 { "Mappings" }
            table {
                thead { tr { th { "mapping" } th { "revision" } th { "state" } th { "since" } } }
                tbody {
                    @for m in &s.mappings {
                        tr { td { (m.name) } td { (m.revision) } td { (m.state) } td { (ago(m.since_ms, now)) } }
                    }
                }
            }
            h2 { "Waiting" }
            p {
                a href="/console/approvals" { (s.waiting.approvals_pending) " approval(s) pending" }
                ", "
                a href="/console/intents" { (s.waiting.intents_unknown) " intent(s) held" }
                ", " (s.waiting.intents_prepared) " prepared"
            }
            h2 { "Trace" }
            p {
                "head #" (s.trace.head_seq)
                @if let Some(to) = s.trace.archived_to { ", archived up to #" (to) }
                ", journal backlog " (s.trace.journal_backlog_bytes) " B"
                @if let Some(c) = &s.trace.last_checkpoint { ", last checkpoint #" (c.seq) " " (ago(c.at_ms, now)) }
            }
        },
    )
}
