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
//! argument value. The HTTP front and an HTTP upstream: `http_upstream.rs`.

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
