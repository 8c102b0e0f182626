//! Output budgets and observations (issue 9): real `airlock serve` processes in front of
//! the hostile fixture server (`airlock fixture hostile-server`), which answers with a
//! 50 MiB result, a media type outside the mapping's list, too many items, malformed
//! JSON-RPC, or instructions in its error text. Each test checks what the model is told,
//! that the refused answer reached neither the adapter nor the trace (the store is read
//! directly), and that the host keeps serving.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::*;
use rmcp::model::CallToolResult;
use rmcp::service::{RoleClient, RunningService};
use serde_json::{Value, json};

type Client = RunningService<RoleClient, ()>;

/// Longest any call may take before the test calls the host hung.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// `source-library` (connection `notes`) over the hostile server, its manifest passed
/// through `edit`; the server logs to `calls.jsonl`.
fn library_over_hostile(edit: impl FnOnce(String) -> String) -> Deployment {
    let d = Deployment::with_notes();
    let hostile = d.hostile_connection("notes", "calls.jsonl", &[]);
    d.replace_connections(&hostile)
        .mapping_edited("source-library", edit)
}

async fn call_ok(client: &Client, name: &str, args: Value) -> CallToolResult {
    tokio::time::timeout(CALL_TIMEOUT, call(client, name, args))
        .await
        .unwrap_or_else(|_| panic!("{name}: no answer within {CALL_TIMEOUT:?}"))
        .unwrap_or_else(|e| panic!("{name}: protocol error {e}"))
}

/// A search that must fail; returns its text.
async fn refused(client: &Client, name: &str, args: Value) -> String {
    let result = call_ok(client, name, args).await;
    let text = text_of(&result);
    assert_eq!(result.is_error, Some(true), "{text}");
    text
}

/// A search that must succeed.
async fn searches(client: &Client, name: &str, query: &str) -> CallToolResult {
    let result = call_ok(client, name, json!({ "query": query })).await;
    assert_ne!(result.is_error, Some(true), "{}", text_of(&result));
    result
}

/// The trace events of `kind`.
fn events<'a>(trace: &'a [Value], kind: &str) -> Vec<&'a Value> {
    trace.iter().filter(|e| e["kind"] == kind).collect()
}

/// How many observation rows the calls `calls` left.
fn observations_of(d: &Deployment, calls: &[&str]) -> i64 {
    let db = d.database();
    calls
        .iter()
        .map(|c| {
            db.query_row(
                "SELECT count(*) FROM observations WHERE call_id = ?1",
                [c],
                |r| r.get::<_, i64>(0),
            )
            .unwrap()
        })
        .sum()
}

/// Asserts that `marker` appears nowhere in the trace or the store's observations.
fn nowhere_in_the_trace(d: &Deployment, marker: &str) {
    let trace = serde_json::to_string(&d.trace()).unwrap();
    assert!(!trace.contains(marker), "`{marker}` reached the trace");
    let db = d.database();
    let rows: i64 = db
        .query_row(
            "SELECT count(*) FROM observations \
             WHERE instr(target, ?1) OR instr(media_type, ?1) OR instr(kind, ?1)",
            [marker],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(rows, 0, "`{marker}` reached the observations");
}

/// Peak resident set of `airlock serve` may grow by at most the mapping's byte budget
/// plus this margin while it refuses a 50 MiB answer. Why 8 MiB: measured on the 2-core
/// dev machines, VmHWM grew 1.9-2.4 MiB over two such answers with a 1 MiB budget (the
/// transport keeps at most budget + 1 bytes of a line before it only scans for the id;
/// the rest is allocator and per-call instance noise, which does not scale with the
/// answer). Holding the answer even once would add 50 MiB.
const RSS_MARGIN_KIB: u64 = 8 * 1024;

#[tokio::test]
async fn a_50_mib_answer_is_refused_while_it_streams_and_never_held() {
    const BUDGET: u64 = 1 << 20;
    let d = library_over_hostile(|t| {
        t.replace(
            "max_output_bytes = 262144",
            &format!("max_output_bytes = {BUDGET}"),
        )
        .replace("deadline_ms = 5000", "deadline_ms = 30000")
    });
    let (client, pid) = d.serve_with_pid().await;
    // Warm up the same path on normal answers, so the baseline holds what every call holds.
    for _ in 0..3 {
        searches(&client, "search_sources", "notes").await;
    }
    let before = (proc_status_kib(pid, "VmHWM"), proc_status_kib(pid, "VmRSS"));
    let started = Instant::now();
    for _ in 0..2 {
        let text = refused(&client, "search_sources", json!({"query": "mode:huge"})).await;
        assert!(
            text.starts_with(&format!(
                "result exceeds budget: an upstream answer was larger than the mapping's {BUDGET}-byte budget"
            )),
            "{text}"
        );
        assert!(!text.contains("HOSTILE"), "{text}");
    }
    let elapsed = started.elapsed();
    let after = (proc_status_kib(pid, "VmHWM"), proc_status_kib(pid, "VmRSS"));
    eprintln!(
        "airlock serve: VmHWM {} KiB before, {} KiB after two 50 MiB answers (+{} KiB); VmRSS {} -> {} KiB; budget {} KiB, margin {} KiB; {:?}",
        before.0,
        after.0,
        after.0.saturating_sub(before.0),
        before.1,
        after.1,
        BUDGET / 1024,
        RSS_MARGIN_KIB,
        elapsed
    );
    assert!(
        after.0 <= before.0 + BUDGET / 1024 + RSS_MARGIN_KIB,
        "peak RSS grew from {} to {} KiB",
        before.0,
        after.0
    );
    // The requests were sent; their answers were refused on arrival.
    let huge = d
        .upstream_calls()
        .iter()
        .filter(|c| c["arguments"]["query"] == "mode:huge")
        .count();
    assert_eq!(huge, 2);
    searches(&client, "search_sources", "notes").await;
    client.cancel().await.unwrap();

    let trace = d.trace();
    let refusals = events(&trace, "upstream-refused");
    assert_eq!(refusals.len(), 2, "{refusals:?}");
    for r in &refusals {
        assert_eq!(r["payload"]["refused"], "bytes");
        assert_eq!(r["payload"]["budget"]["limit"], BUDGET);
        assert_eq!(r["payload"]["target"], "search_notes");
    }
    let calls: Vec<&str> = refusals
        .iter()
        .map(|r| r["payload"]["call"].as_str().unwrap())
        .collect();
    for c in &calls {
        let outcome = trace
            .iter()
            .find(|e| e["kind"] == "call-outcome" && e["payload"]["call"] == *c)
            .unwrap();
        assert_eq!(outcome["payload"]["category"], "result-exceeds-budget");
        assert!(
            !trace
                .iter()
                .any(|e| e["kind"] == "upstream-request" && e["payload"]["call"] == *c),
            "a refused answer is no upstream-request observation"
        );
    }
    assert_eq!(observations_of(&d, &calls), 0);
    nowhere_in_the_trace(&d, "HOSTILE");
}

#[tokio::test]
async fn a_media_type_outside_the_list_is_refused_and_a_listed_one_passes() {
    let d = library_over_hostile(|t| t);
    let client = d.serve().await;
    let text = refused(
        &client,
        "search_sources",
        json!({"query": "mode:media-type"}),
    )
    .await;
    assert_eq!(
        text,
        "result exceeds budget: an upstream answer carried a media type the mapping does not accept; it was discarded unread"
    );
    searches(&client, "search_sources", "notes").await;
    client.cancel().await.unwrap();
    let trace = d.trace();
    let r = events(&trace, "upstream-refused");
    assert_eq!(r.len(), 1);
    assert_eq!(r[0]["payload"]["refused"], "media-type");
    assert_eq!(
        r[0]["payload"]["budget"]["media_type"],
        "application/x-msdownload"
    );
    assert_eq!(r[0]["payload"]["budget"]["index"], 1);
    assert_eq!(
        observations_of(&d, &[r[0]["payload"]["call"].as_str().unwrap()]),
        0
    );
    nowhere_in_the_trace(&d, "HOSTILE-MEDIA");

    // The same answer, with the type listed: accepted, and observed as what it is.
    let d = library_over_hostile(|t| {
        t.replace(
            "max_output_bytes = 262144",
            "max_output_bytes = 262144\nallowed_media_types = [\"text/*\", \"application/json\", \"application/x-msdownload\"]",
        )
    });
    let client = d.serve().await;
    searches(&client, "search_sources", "mode:media-type").await;
    client.cancel().await.unwrap();
    let kinds: Vec<(String, String, String)> = d
        .database()
        .prepare("SELECT item, kind, media_type FROM observations ORDER BY seq")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let kinds: Vec<(&str, &str, &str)> = kinds
        .iter()
        .map(|(a, b, c)| (a.as_str(), b.as_str(), c.as_str()))
        .collect();
    assert_eq!(
        kinds,
        [
            ("content/0", "text", "text/plain"),
            ("content/1", "resource", "application/x-msdownload"),
            ("structuredContent", "structured", "application/json"),
        ]
    );
}

#[tokio::test]
async fn too_many_items_are_refused_and_a_larger_budget_passes() {
    let d = library_over_hostile(|t| t);
    let client = d.serve().await;
    let text = refused(
        &client,
        "search_sources",
        json!({"query": "mode:many-items"}),
    )
    .await;
    assert_eq!(
        text,
        "result exceeds budget: an upstream answer had 1002 content items; the mapping accepts at most 64; it was discarded unread"
    );
    searches(&client, "search_sources", "notes").await;
    client.cancel().await.unwrap();
    let trace = d.trace();
    let r = events(&trace, "upstream-refused");
    assert_eq!(r.len(), 1);
    assert_eq!(r[0]["payload"]["refused"], "items");
    assert_eq!(r[0]["payload"]["budget"]["actual"], 1002);
    nowhere_in_the_trace(&d, "HOSTILE-ITEM");

    let d = library_over_hostile(|t| {
        t.replace(
            "max_output_bytes = 262144",
            "max_output_bytes = 262144\nmax_output_items = 2000",
        )
    });
    let client = d.serve().await;
    searches(&client, "search_sources", "mode:many-items").await;
    client.cancel().await.unwrap();
    let rows: i64 = d
        .database()
        .query_row("SELECT count(*) FROM observations", [], |r| r.get(0))
        .unwrap();
    assert_eq!(rows, 1002, "one observation per accepted item");
}

/// The notes server with `source-library`, and the hostile server as connection
/// `hostile` with a copy of `source-library` (`hostile_search`, `hostile_retrieve`).
fn two_connections() -> Deployment {
    let d = Deployment::with_notes().mapping("source-library");
    let hostile = d.hostile_connection("hostile", "hostile-calls.jsonl", &[]);
    d.connection(&hostile)
        .mapping_edited_as("source-library", "hostile-library", |t| {
            t.replace("name = \"source-library\"", "name = \"hostile-library\"")
                .replace("connection = \"notes\"", "connection = \"hostile\"")
                .replace("name = \"search_sources\"", "name = \"hostile_search\"")
                .replace("name = \"retrieve_source\"", "name = \"hostile_retrieve\"")
        })
}

#[tokio::test]
async fn malformed_json_rpc_degrades_its_connection_and_the_other_keeps_serving() {
    for mode in ["garbage", "binary", "not-jsonrpc", "wrong-id"] {
        let d = two_connections();
        let client = d.serve().await;
        // Offered both capabilities, as a client that lists tools first is.
        assert_eq!(client.list_all_tools().await.unwrap().len(), 4);
        searches(&client, "search_sources", "checkpoint").await;
        let hit = searches(&client, "hostile_search", "note").await;
        let reference = references(&hit).remove(0);

        // Answered when the connection broke, not at the 5 s deadline: the words say so
        // (the deadline answers `interrupted`), however slowly a loaded machine runs.
        let text = refused(
            &client,
            "hostile_search",
            json!({ "query": format!("mode:{mode}") }),
        )
        .await;
        assert_eq!(
            text,
            "unavailable: the upstream connection broke the protocol during the call and is degraded; it serves no calls until the host restarts it",
            "{mode}"
        );
        // Every later call on it answers at once, with the reason.
        for (name, args) in [
            ("hostile_search", json!({"query": "note"})),
            ("hostile_retrieve", json!({"reference": reference})),
        ] {
            let text = refused(&client, name, args).await;
            assert!(
                text.starts_with("unavailable: the upstream connection is degraded"),
                "{mode} {name}: {text}"
            );
        }
        // The other connection keeps serving; the degraded one is no longer offered.
        searches(&client, "search_sources", "checkpoint").await;
        let offered: Vec<String> = client
            .list_all_tools()
            .await
            .unwrap()
            .into_iter()
            .map(|t| t.name.to_string())
            .collect();
        assert!(
            offered.contains(&"search_sources".to_string())
                && !offered.contains(&"hostile_search".to_string()),
            "{mode}: {offered:?}"
        );
        client.cancel().await.unwrap();

        let sent = d
            .logged_calls("hostile-calls.jsonl")
            .iter()
            .filter(|c| c["method"] == "tools/call")
            .count();
        assert_eq!(
            sent, 2,
            "{mode}: nothing more was sent on the degraded connection"
        );
        let trace = d.trace();
        let r = events(&trace, "upstream-refused");
        assert_eq!(r.len(), 1, "{mode}");
        assert_eq!(r[0]["payload"]["refused"], "degraded-connection");
        assert_eq!(
            events(&trace, "call-refused")
                .iter()
                .filter(|e| e["payload"]["changed"] == "connection-degraded")
                .count(),
            2,
            "{mode}"
        );
        nowhere_in_the_trace(&d, "HOSTILE");
    }
}

#[tokio::test]
async fn remote_error_text_reaches_the_model_only_quoted_marked_and_bounded() {
    let d = library_over_hostile(|t| t);
    let client = d.serve().await;
    let text = refused(
        &client,
        "search_sources",
        json!({"query": "mode:tool-error"}),
    )
    .await;
    client.cancel().await.unwrap();
    let prefix = "invalid request: invalid-request; the adapter reported (untrusted text): \"";
    assert!(text.starts_with(prefix), "{text}");
    assert!(text.ends_with('"'), "quoted to the end: {text}");
    assert!(!text.contains('\n'), "one line: {text}");
    assert!(
        text.chars().count() < prefix.len() + 520,
        "bounded (the server sent more than 20 KB): {} chars",
        text.chars().count()
    );
    // The instruction is inside the quotes only.
    let quoted = &text[prefix.len() - 1..];
    assert!(quoted.contains("IGNORE PREVIOUS INSTRUCTIONS"));
    assert!(!text[..prefix.len() - 1].contains("IGNORE"));
    let trace = d.trace();
    let outcome = events(&trace, "call-outcome")
        .into_iter()
        .find(|e| e["payload"]["category"] == "invalid-request")
        .expect("the call's outcome");
    assert_eq!(outcome["payload"]["outcome"], "refused");
    nowhere_in_the_trace(&d, "IGNORE PREVIOUS");
}

/// One row of the `observations` table.
struct ObservationRow {
    id: String,
    target: String,
    sha256: String,
    previous: Option<String>,
    seen: i64,
    snapshot: String,
    media_type: String,
    item: String,
}

#[tokio::test]
async fn accepted_items_become_observations_and_a_changed_resource_links_to_what_it_was() {
    let d = Deployment::with_notes();
    let hostile = d.hostile_connection("notes", "calls.jsonl", &[]);
    let d = d
        .replace_connections(&hostile)
        .mapping_edited("hostile", |t| {
            t.replace("resources = []", "resources = [\"hostile://\"]")
        });
    let client = d.serve().await;
    let title = |r: &CallToolResult| {
        r.structured_content.as_ref().unwrap()["result"][0]["title"]
            .as_str()
            .unwrap()
            .to_string()
    };
    for (query, expected) in [
        ("resource hostile://fixed", "resource ok: fixed content"),
        ("resource hostile://fixed", "resource ok: fixed content"),
        ("resource hostile://counter", "resource ok: read number 1"),
        ("resource hostile://counter", "resource ok: read number 2"),
    ] {
        assert_eq!(
            title(&searches(&client, "hostile_search", query).await),
            expected
        );
    }
    for (query, expected) in [
        (
            "resource hostile://mode/media-type",
            "result exceeds budget: an upstream answer carried a media type the mapping does not accept; it was discarded unread",
        ),
        (
            "resource hostile://mode/many-items",
            "result exceeds budget: an upstream answer had 1000 content items; the mapping accepts at most 64; it was discarded unread",
        ),
    ] {
        assert_eq!(
            refused(&client, "hostile_search", json!({ "query": query })).await,
            expected
        );
    }
    client.cancel().await.unwrap();

    let db = d.database();
    let rows: Vec<ObservationRow> = db
        .prepare(
            "SELECT id, target, sha256, previous, seen, snapshot_digest, media_type, item \
             FROM observations ORDER BY seq",
        )
        .unwrap()
        .query_map([], |r| {
            Ok(ObservationRow {
                id: r.get(0)?,
                target: r.get(1)?,
                sha256: r.get(2)?,
                previous: r.get(3)?,
                seen: r.get(4)?,
                snapshot: r.get(5)?,
                media_type: r.get(6)?,
                item: r.get(7)?,
            })
        })
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let targets: Vec<&str> = rows.iter().map(|r| r.target.as_str()).collect();
    assert_eq!(
        targets,
        ["hostile://fixed", "hostile://counter", "hostile://counter"],
        "the same content twice is one observation; refused answers are none"
    );
    let (fixed, first, second) = (&rows[0], &rows[1], &rows[2]);
    assert_eq!(fixed.seen, 2, "seen twice");
    assert_eq!(fixed.previous, None);
    assert_ne!(first.sha256, second.sha256, "the counter's content changed");
    assert_eq!(
        second.previous.as_deref(),
        Some(first.id.as_str()),
        "linked to what it was"
    );
    for r in &rows {
        assert_eq!(r.media_type, "text/plain");
        assert_eq!(r.item, "contents/0");
        assert_eq!(r.sha256.len(), 64);
    }
    // Each observation names the connection's snapshot, and the trace names each one.
    let snapshots: Vec<String> = db
        .prepare("SELECT digest FROM snapshots")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert!(
        rows.iter().all(|r| snapshots.contains(&r.snapshot)),
        "{snapshots:?}"
    );
    let trace = d.trace();
    let requests = events(&trace, "upstream-request");
    assert_eq!(requests.len(), 4);
    for (e, row) in requests.iter().zip([fixed, fixed, first, second]) {
        assert_eq!(e["payload"]["observations"], json!([row.id]));
        assert_eq!(e["payload"]["snapshot"], row.snapshot.as_str());
    }
    assert_eq!(events(&trace, "upstream-refused").len(), 2);
    nowhere_in_the_trace(&d, "HOSTILE");
}

/// The adapter itself, run in-process against the hostile server: for an answer over
/// budget it gets an `upstream-error` (and says so in its report), never the answer.
#[tokio::test]
async fn the_adapter_gets_an_upstream_error_never_the_refused_answer() {
    use airlock::registry::manifest::MappingManifest;
    use airlock::runtime::budgets::OutputBudget;
    use airlock::runtime::{CallContext, Refused, Runtime, UpstreamGrant, read_component};
    use airlock::upstream::{Connection, StdioServer};
    use wasmtime::component::Val;

    let dir = bundle().join("hostile");
    let mut manifest = MappingManifest::load(&dir.join("mapping.toml")).unwrap();
    // What this test asserts is what the adapter gets, not how soon: the mapping's 2 s
    // deadline (reading and refusing a 5 MB answer on a loaded 2-core machine can take
    // longer) would turn a slow run into an `interrupted` call that proves nothing.
    manifest.limits.deadline_ms = 60_000;
    let component = read_component(&manifest.component_path(&dir)).unwrap();
    let runtime = Runtime::new().unwrap();
    let adapter = runtime
        .load(
            &manifest,
            &component,
            &airlock::contract::load_contract(&manifest.mapping.contract).unwrap(),
        )
        .unwrap();
    let budget = OutputBudget::from_limits(&manifest.limits).unwrap();
    let cwd = tempfile::tempdir().unwrap();
    for (mode, error) in [
        (
            "media-type",
            "last error: protocol-error: airlock: content item 1 of the upstream answer has media type application/x-msdownload, which the mapping does not accept",
        ),
        (
            "many-items",
            "last error: protocol-error: airlock: the upstream answer has 1002 content items; the mapping accepts at most 64",
        ),
        (
            "huge",
            "last error: output-too-large: the answer exceeded the 262144-byte budget",
        ),
    ] {
        let server = StdioServer {
            command: airlock_bin(),
            args: [
                "fixture",
                "hostile-server",
                "--mode",
                mode,
                "--huge-bytes",
                "5000000",
            ]
            .map(String::from)
            .to_vec(),
            cwd: cwd.path().to_path_buf(),
            env: BTreeMap::new(),
            owner: None,
            credential_scope: None,
            identity_files: vec![],
            confine: None,
        };
        let connection = Connection::start_stdio(
            "hostile",
            &server,
            budget.max_bytes,
            airlock::upstream::INITIALIZE_TIMEOUT,
        )
        .await
        .unwrap();
        let grant = Arc::new(UpstreamGrant {
            mapping: "hostile".into(),
            connection: Arc::new(arc_swap::ArcSwap::from_pointee(connection)),
            snapshot: Arc::new(arc_swap::ArcSwap::from_pointee("snapshot".to_string())),
            tools: ["search_notes".to_string()].into(),
            resource_prefixes: vec![],
            budget: budget.clone(),
        });
        let request = Val::Record(vec![
            ("query".into(), Val::String("many-calls 1".into())),
            ("limit".into(), Val::Option(None)),
        ]);
        let out = adapter
            .call("search", &[request], grant, CallContext::default())
            .await;
        let report = format!("{:?}", out.result);
        assert!(report.contains("calls ok: 0"), "{mode}: {report}");
        assert!(report.contains(error), "{mode}: {report}");
        assert!(!report.contains("HOSTILE"), "{mode}: {report}");
        assert!(out.observations.is_empty(), "{mode}");
        assert_eq!(out.refused.len(), 1, "{mode}");
        assert!(matches!(out.refused[0].why, Refused::Budget(_)), "{mode}");
    }
}
