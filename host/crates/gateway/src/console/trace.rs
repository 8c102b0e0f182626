//! The console's trace browser: each call's life as the trace recorded it, newest first,
//! and the trace's verification against its checkpoints.
//!
//! Rules:
//! - **Bounded reads, whatever the trace's length.** The list reads the trace in windows
//!   of [`WINDOW`] sequence numbers below the page's start (a range read on the primary
//!   key, [`crate::store::Trace::trace_window`]), at most [`MAX_SCAN`] sequence numbers a page,
//!   and lists a call by its `call-outcome` event; a page that found fewer than
//!   [`PAGE_CALLS`] calls says how far down it searched and links the next window. So a
//!   page of a 1 000 000-event trace costs what a page of a short one does; no filter
//!   ever scans the whole trace.
//! - **One call's life** is the events naming it between its `call-candidate` and its
//!   `call-outcome` (a call's events are written between those two: the candidate
//!   first, the outcome last), with the approval and intent rows it names.
//! - **Filters** (capability, requester, outcome — which also matches a refusal's
//!   category — and `since`/`until` as durations ago) compare whole values from the
//!   candidate and outcome events; the values are shown escaped, never interpreted.
//! - **Verification** recomputes the whole chain (as `airlock trace verify --checkpoint`):
//!   a person asks for it with a link, and its cost is the trace's length.

use std::collections::HashMap;

use maud::{Markup, html};

use super::pages::{layout, when};
use crate::registry::events;
use crate::store::TraceEvent;

/// Sequence numbers read per window.
pub const WINDOW: i64 = 20_000;
/// Most sequence numbers one page searches.
pub const MAX_SCAN: i64 = 200_000;
/// Most calls one page lists.
pub const PAGE_CALLS: usize = 50;
/// How far below a call's outcome its candidate is looked for when the list's window
/// did not hold it.
const CANDIDATE_REACH: i64 = 5_000;

/// The kinds of the events that tell one call's life.
pub const CALL_KINDS: [&str; 16] = [
    events::CALL_CANDIDATE,
    events::CALL_DECIDED,
    events::CALL_REFUSED,
    events::CALL_CONTAINED,
    events::APPROVAL_REQUESTED,
    events::APPROVAL_DECIDED,
    events::RECEIPT_CONSUMED,
    events::RECEIPT_REFUSED,
    events::INTENT_CREATED,
    events::INTENT_HELD,
    events::INTENT_RESOLVED,
    events::UPSTREAM_REQUEST,
    events::UPSTREAM_REFUSED,
    events::CALL_OUTCOME,
    "approval-required",
    "input-required",
];

/// The list's filters, as the query string gave them (empty: any).
#[derive(Debug, Default, Clone)]
pub struct Filter {
    pub capability: String,
    pub requester: String,
    pub outcome: String,
    /// As typed: a duration (`15m`, `2h`, `7d`): calls that ended at most this long ago.
    pub since: String,
    /// As typed: a duration: calls that ended at least this long ago.
    pub until: String,
    /// `since` and `until` as unix ms (set by [`Filter::resolve`]).
    pub(super) since_ms: Option<u64>,
    pub(super) until_ms: Option<u64>,
}

impl Filter {
    /// Reads `since` and `until` against `now_ms`.
    ///
    /// # Errors
    /// One is not a duration (`humantime`: `90s`, `15m`, `2h`, `7d`, …).
    pub fn resolve(mut self, now_ms: u64) -> anyhow::Result<Self> {
        let ago = |text: &str, name: &str| -> anyhow::Result<Option<u64>> {
            if text.trim().is_empty() {
                return Ok(None);
            }
            let d = humantime::parse_duration(text.trim()).map_err(|_| {
                anyhow::anyhow!(
                    "{name} `{}`: expected a duration such as 15m, 2h or 7d",
                    airlock_core::text::safe(text, 40)
                )
            })?;
            Ok(Some(now_ms.saturating_sub(
                u64::try_from(d.as_millis()).unwrap_or(u64::MAX),
            )))
        };
        self.since_ms = ago(&self.since, "since")?;
        self.until_ms = ago(&self.until, "until")?;
        Ok(self)
    }

    fn admits(&self, call: &CallRow) -> bool {
        let is = |want: &str, have: Option<&str>| want.is_empty() || have == Some(want);
        let at = call.outcome.at_ms;
        self.since_ms.is_none_or(|s| at >= s)
            && self.until_ms.is_none_or(|u| at <= u)
            && is(&self.capability, call.capability())
            && is(&self.requester, call.requester())
            && (self.outcome.is_empty()
                || call.outcome() == Some(self.outcome.as_str())
                || call.category() == Some(self.outcome.as_str()))
    }

    fn query(&self) -> String {
        form_urlencoded::Serializer::new(String::new())
            .append_pair("capability", &self.capability)
            .append_pair("requester", &self.requester)
            .append_pair("outcome", &self.outcome)
            .append_pair("since", &self.since)
            .append_pair("until", &self.until)
            .finish()
    }
}

/// One listed call: its outcome and, when found, its candidate.
#[derive(Debug, Clone)]
pub struct CallRow {
    pub outcome: TraceEvent,
    pub candidate: Option<TraceEvent>,
}

impl CallRow {
    fn id(&self) -> &str {
        &self.outcome.subject
    }
    fn candidate_field(&self, key: &str) -> Option<&str> {
        self.candidate.as_ref()?.payload.get(key)?.as_str()
    }
    fn capability(&self) -> Option<&str> {
        self.candidate_field("capability")
    }
    fn requester(&self) -> Option<&str> {
        self.candidate_field("requester")
    }
    fn outcome(&self) -> Option<&str> {
        self.outcome.payload.get("outcome")?.as_str()
    }
    fn category(&self) -> Option<&str> {
        self.outcome.payload.get("category")?.as_str()
    }
}

/// A page of the list: the calls, and where the search stopped.
#[derive(Debug)]
pub struct ListPage {
    pub calls: Vec<CallRow>,
    /// The lowest sequence number searched (the next page starts below it); `None` when
    /// the search reached the trace's start.
    pub next_before: Option<i64>,
    /// Sequence numbers searched.
    pub scanned: i64,
}

/// Lists the calls whose outcome is below `before`, newest first (module rules).
///
/// # Errors
/// The store fails.
pub fn list(
    store: &dyn crate::store::Store,
    before: i64,
    filter: &Filter,
) -> anyhow::Result<ListPage> {
    let mut calls = Vec::new();
    let mut top = before;
    let mut scanned = 0;
    while top > 1 && scanned < MAX_SCAN && calls.len() < PAGE_CALLS {
        let from = (top - WINDOW).max(1);
        let window =
            store.trace_window(top, from, &[events::CALL_CANDIDATE, events::CALL_OUTCOME])?;
        scanned += top - from;
        let mut candidates: HashMap<String, TraceEvent> = HashMap::new();
        let mut outcomes = Vec::new();
        for e in window {
            if e.kind == events::CALL_OUTCOME {
                outcomes.push(e);
            } else {
                candidates.entry(e.subject.clone()).or_insert(e);
            }
        }
        // Outcomes near the window's floor may have their candidate just below it.
        let missing = outcomes
            .iter()
            .any(|o| !candidates.contains_key(&o.subject));
        if missing && from > 1 {
            for e in store.trace_window(
                from,
                (from - CANDIDATE_REACH).max(1),
                &[events::CALL_CANDIDATE],
            )? {
                candidates.entry(e.subject.clone()).or_insert(e);
            }
        }
        // Calls older than `since` are below this window's oldest: none is left to find.
        let older_than_since = filter
            .since_ms
            .is_some_and(|s| outcomes.last().is_some_and(|o| o.at_ms < s));
        // Newest first; a page stops at a call boundary, so the next starts right below.
        for o in outcomes {
            let row = CallRow {
                candidate: candidates.remove(&o.subject),
                outcome: o,
            };
            if filter.admits(&row) {
                calls.push(row);
                if calls.len() == PAGE_CALLS {
                    let next = calls.last().map(|c| c.outcome.seq);
                    return Ok(ListPage {
                        calls,
                        next_before: next,
                        scanned,
                    });
                }
            }
        }
        top = from;
        if older_than_since {
            top = 1;
        }
    }
    Ok(ListPage {
        calls,
        next_before: (top > 1).then_some(top),
        scanned,
    })
}

/// One call's life: the events naming it between `from` and `to` (inclusive), oldest
/// first, at most [`MAX_SCAN`] sequence numbers read.
///
/// # Errors
/// The store fails.
pub fn life(
    store: &dyn crate::store::Store,
    call: &str,
    from: i64,
    to: i64,
) -> anyhow::Result<Vec<TraceEvent>> {
    let from = from.max(to.saturating_sub(MAX_SCAN)).max(1);
    let mut events: Vec<TraceEvent> = store
        .trace_window(to.saturating_add(1), from, &CALL_KINDS)?
        .into_iter()
        .filter(|e| {
            e.subject == call || e.payload.get("call").and_then(|c| c.as_str()) == Some(call)
        })
        .collect();
    events.reverse();
    Ok(events)
}

/// The list page.
pub fn list_page(page: &ListPage, filter: &Filter, head: i64, before: i64) -> Markup {
    let before = before.min(head + 1);
    layout(
        "Trace",
        html! {
            h1 { "Trace" }
            p { "Each call as the trace recorded it, newest first. The trace holds " (head) " events; "
                a href="/console/trace/verify" { "verify the whole chain" } " against the checkpoints (reads every event), or "
                a href={ "/console/trace/audit.json?from=1&to=" (head) } { "export the audit package" }
                " (policies, catalogues, mapping revisions and contracts, digests, fixture references, calls by outcome — no credentials, no raw upstream content)." }
            form method="get" action="/console/trace" {
                label { "capability " input type="text" name="capability" value=(filter.capability); }
                " "
                label { "requester " input type="text" name="requester" value=(filter.requester); }
                " "
                label { "outcome " input type="text" name="outcome" value=(filter.outcome) placeholder="completed, refused, unknown, …"; }
                " "
                label { "since " input type="text" name="since" value=(filter.since) placeholder="2h"; }
                " "
                label { "until " input type="text" name="until" value=(filter.until) placeholder="1h"; }
                " "
                button type="submit" { "Filter" }
            }
            p.searched { "Calls recorded below event #" (before) "; this page searched " (page.scanned) " events." }
            @if page.calls.is_empty() {
                p.empty { "No call here matches." }
            } @else {
                table {
                    thead { tr { th { "when" } th { "call" } th { "requester" } th { "capability" } th { "outcome" } th { "took" } } }
                    tbody {
                        @for c in &page.calls {
                            @let from = c.candidate.as_ref().map_or(c.outcome.seq - CANDIDATE_REACH, |e| e.seq);
                            tr {
                                td { (when(c.outcome.at_ms)) }
                                td { a href={ "/console/trace/calls/" (c.id()) "?from=" (from) "&to=" (c.outcome.seq) } { (c.id()) } }
                                td { (c.requester().unwrap_or("?")) }
                                td { (c.capability().unwrap_or("?")) }
                                td { (c.outcome().unwrap_or("?")) @if let Some(cat) = c.category() { " (" (cat) ")" } }
                                td { @if let Some(us) = c.outcome.payload.get("elapsed_us").and_then(|v| v.as_u64()) { (us) " µs" } }
                            }
                        }
                    }
                }
            }
            @if let Some(next) = page.next_before {
                p { a.next href={ "/console/trace?before=" (next) "&" (filter.query()) } { "Older calls →" } }
            }
        },
    )
}

/// One call's page.
pub fn call_page(
    call: &str,
    life: &[TraceEvent],
    approval: Option<&crate::store::ApprovalRecord>,
    intent: Option<&crate::store::IntentRecord>,
) -> Markup {
    layout(
        "Call",
        html! {
            h1 { "Call " (call) }
            @if life.is_empty() {
                p.empty { "The trace holds no event of this call in that range." }
            }
            @if let Some(a) = approval {
                p { "Approval " (a.id) ": " (a.state.as_str())
                    @if let Some(by) = &a.decided_by { " by " (by) } }
            }
            @if let Some(i) = intent {
                p { "Intent " (i.intent.id) ": " (i.state.as_str()) }
            }
            table {
                thead { tr { th { "#" } th { "when" } th { "event" } th { "what it recorded" } } }
                tbody {
                    @for e in life {
                        tr {
                            td { (e.seq) }
                            td { (when(e.at_ms)) }
                            td { (e.kind) }
                            td { pre { (serde_json::to_string_pretty(&e.payload).unwrap_or_default()) } }
                        }
                    }
                }
            }
            p { a href="/console/trace" { "← all calls" } }
        },
    )
}

/// The verification's page.
pub fn verify_page(v: &crate::store::TraceVerification, checkpoints: usize) -> Markup {
    layout(
        "Trace verification",
        html! {
            h1 { "Trace verification" }
            @match &v.first_bad {
                None => p.notice role="status" { "The chain verifies: " (v.events) " events, head " (v.head.get(..12).unwrap_or(&v.head)) ", key " (v.key_id) "." },
                Some((seq, why)) => p.refusal role="alert" { "Broken at event #" (seq) ": " (why) },
            }
            p { (checkpoints) " checkpoint(s) read; " (v.checkpoints) " checked"
                @if let Some(a) = v.anchored_seq { ", the newest anchors event #" (a) } "." }
            ul { @for line in &v.coverage { li { (line) } } }
            p { a href="/console/trace" { "← the trace" } }
        },
    )
}

#[cfg(test)]
mod tests_support {
    use super::*;
    use crate::store::{NewEvent, SqliteStore, Trace as _};
    use serde_json::json;

    /// `calls` calls, each a candidate, `noise` unrelated events and an outcome; call `n`
    /// is alice's `search` when even, bob's `deliver` when odd, refused every third.
    pub(super) fn trace_of(calls: usize, noise: usize) -> (tempfile::TempDir, SqliteStore) {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).unwrap();
        let mut batch = Vec::new();
        for n in 0..calls {
            let id = format!("call_{n:05}");
            let (requester, capability) = if n % 2 == 0 {
                ("alice", "search")
            } else {
                ("bob", "deliver")
            };
            batch.push(NewEvent::new(
                events::CALL_CANDIDATE,
                id.clone(),
                json!({"call": id, "requester": requester, "capability": capability}),
            ));
            for _ in 0..noise {
                batch.push(NewEvent::new(events::SESSION_OPENED, "ses", json!({})));
            }
            let outcome = if n % 3 == 0 {
                json!({"call": id, "outcome": "refused", "category": "outside approved scope"})
            } else {
                json!({"call": id, "outcome": "completed"})
            };
            batch.push(NewEvent::new(events::CALL_OUTCOME, id, outcome));
            if batch.len() > 5_000 {
                store.append_events(std::mem::take(&mut batch)).unwrap();
            }
        }
        store.append_events(batch).unwrap();
        (dir, store)
    }
}

#[cfg(test)]
mod tests {
    use super::tests_support::trace_of;
    use super::*;
    use crate::store::{SqliteStore, Trace as _};

    fn all_pages(store: &SqliteStore, filter: &Filter) -> Vec<String> {
        let head = store.trace_checkpoint().unwrap().seq;
        let mut before = head + 1;
        let mut seen = Vec::new();
        for round in 0.. {
            assert!(round < 1_000, "the pages never end");
            let page = list(store, before, filter).unwrap();
            assert!(page.calls.len() <= PAGE_CALLS);
            assert!(page.scanned <= MAX_SCAN + WINDOW, "{}", page.scanned);
            for c in &page.calls {
                assert!(c.outcome.seq < before);
                assert!(c.candidate.is_some(), "{} lost its candidate", c.id());
            }
            seen.extend(page.calls.iter().map(|c| c.id().to_string()));
            match page.next_before {
                Some(next) => {
                    assert!(next < before, "a page must move down");
                    before = next;
                }
                None => break,
            }
        }
        seen
    }

    #[test]
    fn pages_list_every_call_once_newest_first_across_windows() {
        // 2 400 calls × 23 events: 55 200 events, nearly three windows; calls straddle
        // every window's floor.
        let (_dir, store) = trace_of(2_400, 21);
        let seen = all_pages(&store, &Filter::default());
        let expected: Vec<String> = (0..2_400).rev().map(|n| format!("call_{n:05}")).collect();
        assert_eq!(seen, expected);
        // Filters compare whole values and lose no call at a window's edge.
        let bob = Filter {
            requester: "bob".into(),
            capability: "deliver".into(),
            ..Filter::default()
        };
        let seen = all_pages(&store, &bob);
        assert_eq!(seen.len(), 1_200);
        assert!(
            seen.iter()
                .all(|id| id[5..].parse::<usize>().unwrap() % 2 == 1)
        );
        let refused = Filter {
            outcome: "refused".into(),
            ..Filter::default()
        };
        assert_eq!(all_pages(&store, &refused).len(), 800);
        let by_category = Filter {
            outcome: "outside approved scope".into(),
            ..Filter::default()
        };
        assert_eq!(all_pages(&store, &by_category).len(), 800);
        let partial = Filter {
            requester: "bo".into(),
            ..Filter::default()
        };
        assert!(all_pages(&store, &partial).is_empty());
    }

    #[test]
    fn a_page_that_matches_nothing_stops_after_its_bound() {
        let (_dir, store) = trace_of(12_000, 20);
        let head = store.trace_checkpoint().unwrap().seq;
        assert!(head > MAX_SCAN);
        let nobody = Filter {
            requester: "mallory".into(),
            ..Filter::default()
        };
        let page = list(&store, head + 1, &nobody).unwrap();
        assert!(page.calls.is_empty());
        assert_eq!(page.scanned, MAX_SCAN);
        assert_eq!(page.next_before, Some(head + 1 - MAX_SCAN));
    }

    #[test]
    fn a_calls_life_is_its_own_events_in_order() {
        let (_dir, store) = trace_of(30, 2);
        let head = store.trace_checkpoint().unwrap().seq;
        let page = list(&store, head + 1, &Filter::default()).unwrap();
        let c = page.calls.iter().find(|c| c.id() == "call_00007").unwrap();
        let from = c.candidate.as_ref().unwrap().seq;
        let life = life(&store, "call_00007", from, c.outcome.seq).unwrap();
        let kinds: Vec<&str> = life.iter().map(|e| e.kind.as_str()).collect();
        assert_eq!(kinds, [events::CALL_CANDIDATE, events::CALL_OUTCOME]);
        // A wider range still holds only this call's events.
        let wide = super::life(&store, "call_00007", 1, c.outcome.seq + 100).unwrap();
        assert_eq!(wide.len(), 2);
        assert!(
            super::life(&store, "call_99999", 1, 1_000)
                .unwrap()
                .is_empty()
        );
        // Hostile bounds from a query string neither overflow nor read out of range.
        for (from, to) in [
            (i64::MIN, i64::MIN),
            (i64::MAX, i64::MIN),
            (i64::MIN, -1),
            (5, 2),
        ] {
            assert!(
                super::life(&store, "call_00007", from, to)
                    .unwrap()
                    .is_empty()
            );
        }
    }
}

#[cfg(test)]
mod time_filter {
    use super::tests_support::trace_of;
    use super::*;
    use crate::store::Trace as _;

    #[test]
    fn since_and_until_bound_the_calls_by_when_they_ended() {
        let (_dir, store) = trace_of(30, 2);
        let head = store.trace_checkpoint().unwrap().seq;
        let now = crate::store::now_ms();
        let with = |since: &str, until: &str| {
            let f = Filter {
                since: since.into(),
                until: until.into(),
                ..Filter::default()
            }
            .resolve(now)
            .unwrap();
            list(&store, head + 1, &f).unwrap()
        };
        assert_eq!(with("1h", "").calls.len(), 30);
        assert_eq!(with("", "").calls.len(), 30);
        assert!(with("", "1h").calls.is_empty());
        // Everything ended within the hour: a window older than `since` ends the search.
        let none = with("1h", "30m");
        assert!(none.calls.is_empty());
        let bad = Filter {
            since: "soon".into(),
            ..Filter::default()
        }
        .resolve(now)
        .unwrap_err();
        assert!(
            format!("{bad:#}").contains("expected a duration"),
            "{bad:#}"
        );
    }
}
