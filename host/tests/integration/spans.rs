//! OpenTelemetry spans (issue 32) from `airlock serve` to a real OTLP/HTTP receiver
//! ([`crate::common::otlp`], decoding the exporter's protobuf), with the official Python
//! MCP SDK as the client in both protocol generations and the notes fixture as the stdio
//! upstream, whose call log records the `_meta.traceparent` each request carried.
//!
//! What must hold: a call's server span continues the client's `_meta.traceparent`; its
//! stages are its children, the upstream request's client span is the child of
//! `execute`, and the upstream received that client span as its parent, on the same
//! trace; a call without trace context, or with a malformed one, starts a new trace and
//! still runs; an unsampled parent exports nothing but still propagates; the call's
//! audit event names the trace; the call's log lines carry the trace id; no span holds an
//! argument value. Also: a name the session is not offered never names a span; a legacy
//! HTTP session is recorded by the digest of its id; `initialize` and `server/discover`
//! have server spans; `--otlp` sets and overrides the endpoint, and a malformed one is
//! refused before anything starts; the last spans are exported at `SIGTERM`; an adapter's
//! `resources/read` has a client span carried upstream on stdio and HTTP; an upstream
//! `isError` is its client span's error. The HTTP header as the parent:
//! `http_upstream.rs`.

use std::collections::BTreeSet;

use serde_json::{Value, json};

use crate::common::otlp::{self, Got, Receiver};
use crate::common::*;

const T1: &str = "0af7651916cd43dd8448eb211c80319c";
const P1: &str = "b7ad6b7169203331";
const T4: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const P4: &str = "00f067aa0ba902b7";
const T5: &str = "5ce929d0e0e47364bf92f3577b34da6a";
/// An argument value the calls send: no span may hold it.
const QUERY: &str = "checkpoint";

/// Runs `fixtures/python/trace_client.py` against `airlock serve` on `d` in `mode`;
/// returns its report and the server's stderr (JSON log lines).
fn run_python(d: &Deployment, mode: &str, calls: &Value) -> (Value, String) {
    let config = d.write_config();
    let spec = json!({
        "command": airlock_bin(),
        "args": ["serve", "--config", config],
        "env": {
            "AIRLOCK_STATE_DIR": d.state_dir(),
            "AIRLOCK_CACHE_DIR": test_cache_dir(),
            "AIRLOCK_LOG": "airlock=info",
            "AIRLOCK_LOG_FORMAT": "json",
        },
    });
    let out = std::process::Command::new("python3")
        .arg(workspace().join("fixtures/python/trace_client.py"))
        .arg(spec.to_string())
        .arg(mode)
        .arg(calls.to_string())
        .env("PYTHONPATH", python_site())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("python3 runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "the Python client failed ({mode}): {stderr}\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let report = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    (report, stderr)
}

/// The spans whose parent is `span`.
fn children<'a>(spans: &'a [Got], span: &Got) -> Vec<&'a Got> {
    spans
        .iter()
        .filter(|s| s.parent == span.span_id && s.trace_id == span.trace_id)
        .collect()
}

/// The server span of a `tools/call` on trace `trace`.
fn server_call<'a>(spans: &'a [Got], trace: &str) -> &'a Got {
    spans
        .iter()
        .find(|s| s.kind == otlp::SERVER && s.trace_id == trace && s.name.starts_with("tools/call"))
        .unwrap_or_else(|| panic!("no tools/call server span on trace {trace}: {spans:#?}"))
}

/// Checks the spans of one completed `search_sources` call whose server span is
/// `server` (its upstream over stdio), and returns the `traceparent` its upstream request
/// must have carried.
fn completed_call(spans: &[Got], server: &Got, protocol: &str) -> String {
    completed_call_over(spans, server, protocol, "pipe")
}

/// [`completed_call`], the upstream reached over `upstream` (`pipe` or `tcp`).
fn completed_call_over(spans: &[Got], server: &Got, protocol: &str, upstream: &str) -> String {
    assert_eq!(server.name, "tools/call search_sources", "{server:#?}");
    assert_eq!(server.service, "airlock");
    assert_eq!(server.attr("mcp.method.name"), Some("tools/call"));
    assert_eq!(server.attr("gen_ai.tool.name"), Some("search_sources"));
    assert_eq!(server.attr("gen_ai.operation.name"), Some("execute_tool"));
    assert_eq!(server.attr("network.transport"), Some("pipe"));
    assert_eq!(server.attr("mcp.protocol.version"), Some(protocol));
    assert_eq!(server.attr("airlock.outcome"), Some("completed"));
    assert!(server.attr("jsonrpc.request.id").is_some(), "{server:#?}");
    assert!(
        server.attr("airlock.call.id").unwrap().starts_with("call_"),
        "{server:#?}"
    );
    assert_ne!(server.status, 2, "{server:#?}");
    let stages = children(spans, server);
    let names: BTreeSet<&str> = stages.iter().map(|s| s.name.as_str()).collect();
    for stage in [
        "normalize",
        "authorize",
        "intent",
        "recheck",
        "execute",
        "outcome",
        "commit",
    ] {
        assert!(
            names.contains(stage),
            "no {stage} span under {server:#?}: {stages:#?}"
        );
    }
    for s in &stages {
        assert_eq!(s.kind, otlp::INTERNAL, "{s:#?}");
        assert!(
            s.start_ns >= server.start_ns && s.end_ns <= server.end_ns,
            "stage {} outside its request: {s:#?} {server:#?}",
            s.name
        );
    }
    let execute = stages.iter().find(|s| s.name == "execute").unwrap();
    assert!(
        execute.attr("airlock.execute.upstream_us").is_some(),
        "{execute:#?}"
    );
    let clients = children(spans, execute);
    assert_eq!(clients.len(), 1, "one upstream request: {clients:#?}");
    let client = clients[0];
    assert_eq!(client.kind, otlp::CLIENT);
    assert_eq!(client.name, "tools/call search_notes");
    assert_eq!(client.attr("mcp.method.name"), Some("tools/call"));
    assert_eq!(client.attr("gen_ai.tool.name"), Some("search_notes"));
    assert_eq!(client.attr("network.transport"), Some(upstream));
    assert_eq!(client.attr("airlock.connection"), Some("notes"));
    assert!(client.attr("jsonrpc.request.id").is_some(), "{client:#?}");
    format!("00-{}-{}-01", client.trace_id, client.span_id)
}

#[test]
fn a_python_clients_trace_continues_through_airlock_to_the_stdio_upstream_in_both_generations() {
    for (mode, protocol) in [("2026-07-28", "2026-07-28"), ("legacy", "2025-11-25")] {
        let receiver = Receiver::start();
        let d = Deployment::with_notes()
            .mapping("source-library")
            .tables(&format!("[telemetry]\notlp = {:?}\n", receiver.url()));
        d.approve_all();
        let calls = json!([
            {"meta": {"traceparent": format!("00-{T1}-{P1}-01"), "tracestate": "vendor=abc"}},
            {"meta": null},
            {"meta": {"traceparent": "00-not-a-trace-01"}},
            {"tool": "retrieve_source", "arguments": {"reference": "ref_0000000000000000"},
             "meta": {"traceparent": format!("00-{T4}-{P4}-01")}},
            {"meta": {"traceparent": format!("00-{T5}-{P1}-00")}},
        ]);
        let (report, stderr) = run_python(&d, mode, &calls);
        assert_eq!(report["protocol"], protocol, "{report}");
        let outcomes: Vec<bool> = report["calls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["is_error"].as_bool().unwrap())
            .collect();
        assert_eq!(
            outcomes,
            [false, false, false, true, false],
            "a malformed or unsampled context never fails a call: {report}"
        );

        let spans = receiver.until("the four sampled calls' spans", |spans| {
            spans
                .iter()
                .filter(|s| s.kind == otlp::SERVER && s.name.starts_with("tools/call"))
                .count()
                >= 4
        });
        assert!(receiver.strays.lock().unwrap().is_empty());
        let upstream: Vec<Value> = d
            .upstream_calls()
            .into_iter()
            .filter(|c| c["method"] == "tools/call")
            .collect();
        assert_eq!(upstream.len(), 4, "{upstream:?}");

        // 1. The client's context: Airlock's span is its child, the upstream's parent is
        // Airlock's client span, on the same trace.
        let first = server_call(&spans, T1);
        assert_eq!(first.parent, P1, "{first:#?}");
        let sent = completed_call(&spans, first, protocol);
        assert_eq!(upstream[0]["traceparent"], sent, "{upstream:?}");
        assert_eq!(upstream[0]["tracestate"], "vendor=abc");
        // The audit trace names the span, and the span names the call.
        let trace = d.trace();
        let outcome = trace
            .iter()
            .find(|e| {
                e["kind"] == "call-outcome"
                    && e["payload"]["call"] == first.attr("airlock.call.id").unwrap()
            })
            .expect("the call's outcome event");
        assert_eq!(outcome["payload"]["otel_trace_id"], T1);
        assert_eq!(outcome["payload"]["otel_span_id"], first.span_id);

        // 2 and 3. Without context, and with a malformed one: new traces, roots.
        let roots: Vec<&Got> = spans
            .iter()
            .filter(|s| {
                s.kind == otlp::SERVER && s.name.starts_with("tools/call") && s.parent.is_empty()
            })
            .collect();
        assert_eq!(roots.len(), 2, "{spans:#?}");
        for (root, logged) in roots.iter().zip(&upstream[1..3]) {
            assert_ne!(root.trace_id, T1);
            assert_eq!(
                logged["traceparent"],
                completed_call(&spans, root, protocol)
            );
        }
        assert_ne!(roots[0].trace_id, roots[1].trace_id);

        // 4. A refused call: its category is the span's error, nothing went upstream
        // (four upstream calls are the other four), and its log line carries the trace.
        let refused = server_call(&spans, T4);
        assert_eq!(refused.parent, P4);
        assert_eq!(refused.name, "tools/call retrieve_source");
        assert_eq!(refused.attr("airlock.outcome"), Some("refused"));
        assert_eq!(refused.status, 2, "{refused:#?}");
        let category = refused.attr("error.type").unwrap();
        assert!(!category.is_empty());
        assert!(
            children(&spans, refused)
                .iter()
                .all(|s| s.name != "execute"),
            "a refused call never executes"
        );
        let logged = stderr
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|l| {
                l["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("call refused"))
                    && l["span"]["trace_id"] == T4
            });
        assert!(
            logged.is_some(),
            "no JSON log line of the refusal with its trace id:\n{stderr}"
        );
        let line = logged.unwrap();
        assert_eq!(line["span"]["span_id"], refused.span_id, "{line}");

        // 5. An unsampled parent: nothing exported, the context still goes upstream.
        assert!(spans.iter().all(|s| s.trace_id != T5), "{spans:#?}");
        let unsampled = upstream[3]["traceparent"].as_str().unwrap();
        assert!(
            unsampled.starts_with(&format!("00-{T5}-")) && unsampled.ends_with("-00"),
            "{unsampled}"
        );

        // No span carries an argument value.
        for s in &spans {
            for (k, v) in &s.attributes {
                assert!(!v.contains(QUERY), "{k} = {v} in {s:#?}");
                assert!(!v.contains("ref_0000000000000000"), "{k} = {v}");
            }
        }
    }
}

#[test]
fn without_an_otlp_endpoint_nothing_reaches_the_upstreams_meta() {
    let d = Deployment::with_notes().mapping("source-library");
    d.approve_all();
    let calls = json!([{"meta": {"traceparent": format!("00-{T1}-{P1}-01")}}]);
    let (report, _) = run_python(&d, "2026-07-28", &calls);
    assert_eq!(report["calls"][0]["is_error"], false, "{report}");
    let upstream = d.upstream_calls();
    let call = upstream
        .iter()
        .find(|c| c["method"] == "tools/call")
        .unwrap();
    assert!(call.get("traceparent").is_none(), "{call}");
    let outcome = d
        .trace()
        .into_iter()
        .find(|e| e["kind"] == "call-outcome")
        .unwrap();
    assert!(
        outcome["payload"].get("otel_trace_id").is_none(),
        "{outcome}"
    );
}

/// The same client, Airlock on stdio, the notes fixture over Streamable HTTP: the
/// upstream's request carries Airlock's client span as its parent in `_meta` there too.
#[test]
fn a_python_clients_trace_reaches_an_http_upstream_through_airlock() {
    let receiver = Receiver::start();
    let d = Deployment::with_notes();
    let fixture =
        crate::http_upstream::Fixture::start("127.0.0.1:0", &d.dir.path().join("calls.jsonl"), &[]);
    let d = d
        .mapping("source-library")
        .replace_connections(&format!(
            "[[connection]]\nname = \"notes\"\nurl = {:?}\n",
            fixture.url()
        ))
        .tables(&format!("[telemetry]\notlp = {:?}\n", receiver.url()));
    d.approve_all();
    let calls = json!([{"meta": {"traceparent": format!("00-{T1}-{P1}-01")}}]);
    let (report, _) = run_python(&d, "2026-07-28", &calls);
    assert_eq!(report["calls"][0]["is_error"], false, "{report}");
    let spans = receiver.until("the call's spans", |spans| {
        spans
            .iter()
            .any(|s| s.kind == otlp::SERVER && s.trace_id == T1)
    });
    let server = server_call(&spans, T1);
    assert_eq!(server.parent, P1);
    let sent = completed_call_over(&spans, server, "2026-07-28", "tcp");
    let upstream: Vec<Value> = d
        .upstream_calls()
        .into_iter()
        .filter(|c| c["method"] == "tools/call")
        .collect();
    assert_eq!(upstream.len(), 1, "{upstream:?}");
    assert_eq!(upstream[0]["traceparent"], sent, "{upstream:?}");
}

// ---------------------------------------------------------------------------------------
// The HTTP front: names a client chooses, legacy sessions, `server/discover`, `--otlp`
// and the last spans at `SIGTERM`; an adapter's `resources/read`; a malformed endpoint.

/// The `traceparent` header line (an `extra` of [`post_stateless`]) whose parent is span
/// `P1` on trace `trace`.
fn header(trace: &str) -> String {
    format!("\r\ntraceparent: 00-{trace}-{P1}-01")
}

/// The `[telemetry]` table exporting to `receiver`.
fn otlp_table(receiver: &Receiver) -> String {
    format!("[telemetry]\notlp = {:?}\n", receiver.url())
}

/// The span on trace `trace` of kind `kind` (one only).
fn only<'a>(spans: &'a [Got], trace: &str, kind: i32) -> &'a Got {
    let found: Vec<&Got> = spans
        .iter()
        .filter(|s| s.trace_id == trace && s.kind == kind)
        .collect();
    assert_eq!(
        found.len(),
        1,
        "one span of kind {kind} on {trace}: {spans:#?}"
    );
    found[0]
}

/// Asserts that `text` is in no span's name and no attribute's value.
#[track_caller]
fn nowhere(spans: &[Got], text: &str) {
    for s in spans {
        assert!(!s.name.contains(text), "`{text}` names a span: {s:#?}");
        for (k, v) in &s.attributes {
            assert!(!v.contains(text), "`{text}` in {k} = {v}: {s:#?}");
        }
    }
}

/// A tool name the client invents, or the name of a capability its session is not
/// offered, is the client's text: it never names a span nor fills an attribute (the
/// server span stays `tools/call`, without `gen_ai.tool.name`), while the JSON-RPC error
/// answered is still the span's error and the header's trace still its parent. The offered
/// capability, beside it, names its span; `server/discover` has its own server span.
#[test]
fn a_name_the_session_is_not_offered_never_reaches_a_span() {
    use crate::http::{POLICY, PROFILES, post_stateless, serve_http};
    const INVENTED: &str = "invented_tool_5f3a9c";
    const TI: &str = "a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1";
    const TN: &str = "b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2";
    const TS: &str = "c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3";
    const TD: &str = "d4d4d4d4d4d4d4d4d4d4d4d4d4d4d4d4";
    let receiver = Receiver::start();
    // Profile `searcher` is offered `search_sources` only, not `retrieve_source`.
    let d = Deployment::with_notes()
        .mapping("source-library")
        .policy(POLICY)
        .top("default_profile = \"searcher\"\n")
        .tables(PROFILES)
        .tables(&otlp_table(&receiver));
    d.approve_all();
    let served = serve_http(&d, "127.0.0.1:0");
    let call = |name: &str, arguments: Value, trace: &str| {
        post_stateless(
            &served,
            None,
            "tools/call",
            json!({"name": name, "arguments": arguments}),
            &header(trace),
        )
        .message()
    };
    let invented = call(INVENTED, json!({"query": QUERY}), TI);
    let not_offered = call(
        "retrieve_source",
        json!({"reference": "ref_0000000000000000"}),
        TN,
    );
    for answer in [&invented, &not_offered] {
        assert_eq!(answer["error"]["code"], -32602, "{answer}");
    }
    let offered = call("search_sources", json!({"query": QUERY}), TS);
    assert_eq!(offered["result"]["isError"], false, "{offered}");
    let discover = post_stateless(&served, None, "server/discover", json!({}), &header(TD));
    assert!(discover.message().get("result").is_some(), "{discover:?}");

    let spans = receiver.until("three calls and a discover", |spans| {
        [TI, TN, TS, TD].iter().all(|t| {
            spans
                .iter()
                .any(|s| s.kind == otlp::SERVER && s.trace_id == *t)
        })
    });
    for trace in [TI, TN] {
        let server = only(&spans, trace, otlp::SERVER);
        assert_eq!(server.name, "tools/call", "{server:#?}");
        assert_eq!(server.parent, P1);
        assert_eq!(server.attr("mcp.method.name"), Some("tools/call"));
        assert_eq!(server.attr("network.transport"), Some("tcp"));
        assert_eq!(server.attr("gen_ai.tool.name"), None, "{server:#?}");
        assert_eq!(server.attr("gen_ai.operation.name"), None, "{server:#?}");
        assert_eq!(server.attr("mcp.session.id"), None, "stateless: no session");
        // The call was invalid, answered with JSON-RPC error -32602: its code is the
        // span's error.
        assert_eq!(
            server.attr("airlock.outcome"),
            Some("invalid"),
            "{server:#?}"
        );
        assert_eq!(server.attr("error.type"), Some("-32602"), "{server:#?}");
        assert_eq!(server.status, 2, "{server:#?}");
        assert!(
            children(&spans, server).iter().all(|s| s.name != "execute"),
            "a refused call never executes"
        );
        assert!(
            spans
                .iter()
                .all(|s| s.kind != otlp::CLIENT || s.trace_id != trace)
        );
    }
    nowhere(&spans, INVENTED);
    nowhere(&spans, "retrieve_source");
    nowhere(&spans, QUERY);
    // The offered call, in the same deployment, is named after its capability.
    let searched = only(&spans, TS, otlp::SERVER);
    assert_eq!(searched.name, "tools/call search_sources");
    assert_eq!(searched.attr("gen_ai.tool.name"), Some("search_sources"));
    assert_eq!(searched.attr("airlock.outcome"), Some("completed"));
    let discovered = only(&spans, TD, otlp::SERVER);
    assert_eq!(discovered.name, "server/discover", "{discovered:#?}");
    assert_eq!(discovered.parent, P1);
    assert_eq!(discovered.attr("mcp.method.name"), Some("server/discover"));
    assert_eq!(discovered.attr("network.transport"), Some("tcp"));
    assert_eq!(discovered.attr("error.type"), None);
    assert_ne!(discovered.status, 2, "{discovered:#?}");
}

/// A legacy (2025-11-25) HTTP session: `initialize` has a server span continuing the
/// header's trace; the session's later requests record `mcp.session.id` as the first 16
/// hex digits of the SHA-256 of the `Mcp-Session-Id` (a bearer value), never the id.
#[test]
fn a_legacy_http_session_is_recorded_by_the_digest_of_its_id_never_the_id() {
    use crate::http::{raw, serve_http};
    use sha2::Digest as _;
    const TA: &str = "e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5";
    const TB: &str = "f6f6f6f6f6f6f6f6f6f6f6f6f6f6f6f6";
    const TC: &str = "0707070707070707070707070707070a";
    let receiver = Receiver::start();
    let d = Deployment::with_notes()
        .mapping("source-library")
        .tables(&otlp_table(&receiver));
    d.approve_all();
    let served = serve_http(&d, "127.0.0.1:0");
    let post = |session: Option<&str>, trace: &str, body: Value| {
        let body = body.to_string();
        let mut head = format!(
            "POST /mcp HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nContent-Length: {}{}",
            served.addr,
            body.len(),
            header(trace)
        );
        if let Some(id) = session {
            head.push_str(&format!(
                "\r\nMcp-Session-Id: {id}\r\nMCP-Protocol-Version: 2025-11-25"
            ));
        }
        raw(&served.addr, &head, body.as_bytes())
    };
    let r = post(
        None,
        TA,
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "raw-test", "version": "1"}}}),
    );
    assert_eq!(r.status, 200, "{r:?}");
    let id = r
        .header("mcp-session-id")
        .expect("a session id")
        .to_string();
    // A request id of the client's choosing, long: answered whole, recorded clipped.
    let long_id = "L".repeat(5000);
    let r = post(
        Some(&id),
        TB,
        json!({"jsonrpc": "2.0", "id": long_id, "method": "tools/list", "params": {}}),
    );
    assert!(r.message()["result"]["tools"].is_array(), "{r:?}");
    assert_eq!(r.message()["id"], long_id.as_str());
    let r = post(
        Some(&id),
        TC,
        json!({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {
            "name": "search_sources", "arguments": {"query": QUERY}}}),
    );
    assert_eq!(r.message()["result"]["isError"], false, "{r:?}");

    let spans = receiver.until("initialize, a list and a call", |spans| {
        [TA, TB, TC].iter().all(|t| {
            spans
                .iter()
                .any(|s| s.kind == otlp::SERVER && s.trace_id == *t)
        })
    });
    let digest = hex::encode(sha2::Sha256::digest(id.as_bytes()))[..16].to_string();
    let initialize = only(&spans, TA, otlp::SERVER);
    assert_eq!(initialize.name, "initialize", "{initialize:#?}");
    assert_eq!(initialize.parent, P1);
    assert_eq!(initialize.attr("mcp.method.name"), Some("initialize"));
    assert_eq!(initialize.attr("network.transport"), Some("tcp"));
    assert_eq!(initialize.attr("jsonrpc.request.id"), Some("1"));
    assert_ne!(initialize.status, 2, "{initialize:#?}");
    assert_eq!(
        initialize.attr("mcp.session.id"),
        None,
        "initialize carries no session id yet"
    );
    let listed = only(&spans, TB, otlp::SERVER);
    assert_eq!(listed.name, "tools/list");
    let recorded = listed.attr("jsonrpc.request.id").unwrap();
    assert!(
        recorded.starts_with("LLLL") && recorded.chars().count() <= 65,
        "a client's id is clipped to 64 characters: {} characters",
        recorded.chars().count()
    );
    assert_eq!(listed.attr("mcp.protocol.version"), Some("2025-11-25"));
    let called = only(&spans, TC, otlp::SERVER);
    assert_eq!(called.name, "tools/call search_sources");
    for s in [listed, called] {
        assert_eq!(s.attr("mcp.session.id"), Some(digest.as_str()), "{s:#?}");
    }
    assert!(id.len() > 16, "{id}");
    nowhere(&spans, &id);
}

/// `serve --http --otlp URL` exports to URL with no `[telemetry]` table, and the spans
/// of a call answered just before `SIGTERM` still reach the collector: they were
/// exported before the process ended (nothing is waited for after it exited).
#[test]
fn serve_http_takes_otlp_from_the_command_line_and_exports_the_last_spans_when_stopped() {
    use crate::http::{post_stateless, serve_http_with};
    let receiver = Receiver::start();
    let d = Deployment::with_notes().mapping("source-library");
    d.approve_all();
    let mut served = serve_http_with(&d, "127.0.0.1:0", &["--otlp", &receiver.url()]);
    let r = post_stateless(
        &served,
        None,
        "tools/call",
        json!({"name": "search_sources", "arguments": {"query": QUERY}}),
        &header(T1),
    );
    assert_eq!(r.message()["result"]["isError"], false, "{r:?}");
    let status = served.terminate();
    assert!(status.success(), "{status:?}");
    let spans = receiver.spans();
    let server = spans
        .iter()
        .find(|s| s.kind == otlp::SERVER && s.trace_id == T1)
        .unwrap_or_else(|| {
            panic!("the call's server span was not exported at shutdown: {spans:#?}")
        });
    assert_eq!(server.name, "tools/call search_sources");
    assert_eq!(server.parent, P1);
    let stages: BTreeSet<&str> = children(&spans, server)
        .iter()
        .map(|s| s.name.as_str())
        .collect();
    assert!(
        stages.contains("execute") && stages.contains("commit"),
        "{stages:?}"
    );
    assert!(
        spans
            .iter()
            .any(|s| s.kind == otlp::CLIENT && s.trace_id == T1),
        "the upstream request's client span: {spans:#?}"
    );
    assert!(receiver.strays.lock().unwrap().is_empty());
}

/// `serve --otlp URL` (stdio) exports to URL without a `[telemetry]` table, and instead
/// of the table's `otlp` when there is one: that collector receives nothing.
#[tokio::test]
async fn serve_otlp_on_the_command_line_sets_or_overrides_the_configured_endpoint() {
    use rmcp::ServiceExt as _;
    for configured in [false, true] {
        let given = Receiver::start();
        let overridden = Receiver::start();
        let mut d = Deployment::with_notes().mapping("source-library");
        if configured {
            d = d.tables(&otlp_table(&overridden));
        }
        d.approve_all();
        let mut cmd = d.serve_command();
        cmd.arg("--otlp").arg(given.url());
        let client = ().serve(rmcp::transport::TokioChildProcess::new(cmd).unwrap()).await.unwrap();
        let r = call(&client, "search_sources", json!({"query": QUERY}))
            .await
            .unwrap();
        assert_ne!(r.is_error, Some(true), "{}", text_of(&r));
        client.cancel().await.unwrap();
        let spans = given.until("the call's spans at --otlp", |spans| {
            spans
                .iter()
                .any(|s| s.kind == otlp::SERVER && s.name == "tools/call search_sources")
        });
        let server = spans
            .iter()
            .find(|s| s.kind == otlp::SERVER && s.name == "tools/call search_sources")
            .unwrap();
        assert_eq!(server.attr("network.transport"), Some("pipe"));
        assert!(
            overridden.spans().is_empty() && overridden.strays.lock().unwrap().is_empty(),
            "configured {configured}: the overridden endpoint received spans"
        );
    }
}

/// A malformed OTLP endpoint, on the command line (stdio or `--http`) or in
/// `[telemetry] otlp`, is refused with a message naming it before anything starts: no
/// upstream server was started, nothing was traced.
#[test]
fn a_malformed_otlp_endpoint_is_refused_before_anything_starts() {
    let d = Deployment::with_notes().mapping("source-library");
    d.approve_all();
    let config = d.write_config();
    let traced = d.trace().len();
    let sent = d.upstream_calls().len();
    for bad in ["127.0.0.1:4318", "ftp://collector/v1/traces", "http://"] {
        for http in [false, true] {
            let mut cmd = std::process::Command::new(airlock_bin());
            cmd.arg("serve").arg("--config").arg(&config);
            if http {
                cmd.args(["--http", "127.0.0.1:0"]);
            }
            cmd.args(["--otlp", bad])
                .env("AIRLOCK_CACHE_DIR", test_cache_dir())
                .env("AIRLOCK_STATE_DIR", d.state_dir());
            let out = output_within(&mut cmd, std::time::Duration::from_secs(20));
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{bad} (http {http}): {stderr}");
            assert!(
                stderr.contains("--otlp") && stderr.contains("expected an http:// or https:// URL"),
                "{bad}: {stderr}"
            );
        }
    }
    // Credentials are refused and never printed, even as the refused value.
    let mut cmd = std::process::Command::new(airlock_bin());
    cmd.arg("serve")
        .arg("--config")
        .arg(&config)
        .args(["--otlp", "http://user:s3cretPW@collector:4318"])
        .env("AIRLOCK_CACHE_DIR", test_cache_dir())
        .env("AIRLOCK_STATE_DIR", d.state_dir());
    let out = output_within(&mut cmd, std::time::Duration::from_secs(20));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("OTEL_EXPORTER_OTLP_HEADERS"), "{stderr}");
    assert!(
        !stderr.contains("s3cretPW"),
        "the password is printed: {stderr}"
    );
    let configured = Deployment::with_notes()
        .mapping("source-library")
        .tables("[telemetry]\notlp = \"127.0.0.1:4318\"\n");
    let (ok, stderr) = configured.serve_expecting_failure();
    assert!(!ok, "{stderr}");
    assert!(
        stderr.contains("[telemetry] otlp")
            && stderr.contains("expected an http:// or https:// URL"),
        "{stderr}"
    );
    assert_eq!(
        d.upstream_calls().len(),
        sent,
        "no upstream server was started"
    );
    assert!(configured.upstream_calls().is_empty());
    assert_eq!(d.trace().len(), traced, "nothing was traced");
}

/// An adapter's `resources/read` (the `hostile` fixture adapter's `resource` attack, the
/// only adapter that reads resources) has its own client span under the call's
/// `execute`, without a target or the URI (an argument), and the upstream received that
/// span as its parent in `_meta`: over stdio (the direct path) and over Streamable HTTP
/// (rmcp's).
#[tokio::test]
async fn an_adapters_resource_read_has_a_client_span_whose_context_reaches_the_upstream() {
    use crate::http_upstream::Fixture;
    for (transport, http) in [("pipe", false), ("tcp", true)] {
        let receiver = Receiver::start();
        let d = Deployment::with_notes();
        let fixture =
            http.then(|| Fixture::start("127.0.0.1:0", &d.dir.path().join("calls.jsonl"), &[]));
        let mut d = d
            .mapping_edited("hostile", |t| {
                t.replace("resources = []", "resources = [\"notes://\"]")
            })
            .mapping("source-library")
            .tables(&otlp_table(&receiver));
        if let Some(f) = &fixture {
            d = d.replace_connections(&format!(
                "[[connection]]\nname = \"notes\"\nurl = {:?}\n",
                f.url()
            ));
        }
        let client = d.serve().await;
        let r = call(
            &client,
            "hostile_search",
            json!({"query": "resource notes://wal-checkpoints"}),
        )
        .await
        .unwrap();
        let title = r
            .structured_content
            .as_ref()
            .map(|s| s["result"][0]["title"].clone());
        assert!(
            title
                .as_ref()
                .and_then(Value::as_str)
                .is_some_and(|t| t.starts_with("resource ok:")),
            "{transport}: {r:?}"
        );
        client.cancel().await.unwrap();
        let spans = receiver.until("the resource read's client span", |spans| {
            spans
                .iter()
                .any(|s| s.kind == otlp::CLIENT && s.name == "resources/read")
        });
        let read = spans
            .iter()
            .find(|s| s.kind == otlp::CLIENT && s.name == "resources/read")
            .unwrap();
        assert_eq!(read.attr("mcp.method.name"), Some("resources/read"));
        assert_eq!(read.attr("gen_ai.tool.name"), None, "{read:#?}");
        assert_eq!(read.attr("airlock.connection"), Some("notes"));
        assert_eq!(read.attr("network.transport"), Some(transport));
        assert!(read.attr("jsonrpc.request.id").is_some(), "{read:#?}");
        assert_ne!(read.status, 2, "{read:#?}");
        let execute = spans
            .iter()
            .find(|s| s.span_id == read.parent && s.trace_id == read.trace_id)
            .unwrap_or_else(|| panic!("no parent of {read:#?}"));
        assert_eq!(execute.name, "execute");
        let server = spans
            .iter()
            .find(|s| s.span_id == execute.parent && s.trace_id == read.trace_id)
            .unwrap();
        assert_eq!(server.kind, otlp::SERVER);
        assert_eq!(server.name, "tools/call hostile_search");
        nowhere(&spans, "wal-checkpoints");
        let reads: Vec<Value> = d
            .upstream_calls()
            .into_iter()
            .filter(|c| c["method"] == "resources/read")
            .collect();
        assert_eq!(reads.len(), 1, "{transport}: {reads:?}");
        assert_eq!(
            reads[0]["traceparent"],
            format!("00-{}-{}-01", read.trace_id, read.span_id),
            "{transport}: the upstream continues Airlock's client span: {reads:?}"
        );
    }
}

/// An upstream answer with `isError: true` is the error of its client span
/// (`error.type` = `tool_error`, as the MCP conventions name it), and the call that got
/// it is not `completed`; the search before it, answered, has no error on either span.
#[tokio::test]
async fn an_upstream_tool_error_is_the_error_of_its_client_span() {
    let receiver = Receiver::start();
    let d = Deployment::with_notes()
        .mapping("source-library")
        .tables(&otlp_table(&receiver));
    let client = d.serve().await;
    let ok = call(&client, "search_sources", json!({"query": QUERY}))
        .await
        .unwrap();
    assert_ne!(ok.is_error, Some(true), "{}", text_of(&ok));
    // A blank query: the notes server answers `isError: true`.
    let failed = call(&client, "search_sources", json!({"query": " "}))
        .await
        .unwrap();
    assert_eq!(failed.is_error, Some(true), "{}", text_of(&failed));
    client.cancel().await.unwrap();
    let spans = receiver.until("both calls' client spans", |spans| {
        spans.iter().filter(|s| s.kind == otlp::CLIENT).count() >= 2
    });
    let mut clients: Vec<&Got> = spans.iter().filter(|s| s.kind == otlp::CLIENT).collect();
    clients.sort_by_key(|s| s.start_ns);
    assert_eq!(clients.len(), 2, "{clients:#?}");
    let server_of = |client: &Got| {
        let execute = spans
            .iter()
            .find(|s| s.span_id == client.parent && s.trace_id == client.trace_id)
            .unwrap();
        spans
            .iter()
            .find(|s| s.span_id == execute.parent && s.trace_id == client.trace_id)
            .unwrap()
    };
    let (answered, errored) = (clients[0], clients[1]);
    assert_eq!(answered.attr("error.type"), None, "{answered:#?}");
    assert_ne!(answered.status, 2, "{answered:#?}");
    assert_eq!(
        server_of(answered).attr("airlock.outcome"),
        Some("completed")
    );
    assert_eq!(errored.name, "tools/call search_notes");
    assert_eq!(
        errored.attr("error.type"),
        Some("tool_error"),
        "{errored:#?}"
    );
    assert_eq!(errored.status, 2, "{errored:#?}");
    assert!(errored.attr("jsonrpc.request.id").is_some(), "{errored:#?}");
    let server = server_of(errored);
    assert_ne!(
        server.attr("airlock.outcome"),
        Some("completed"),
        "{server:#?}"
    );
    assert_eq!(server.status, 2, "{server:#?}");
}
