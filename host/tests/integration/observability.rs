//! Metrics (issue 32): `airlock serve` with a metrics listener (`[telemetry] metrics`),
//! and `/metrics` on the HTTP front behind its bearer tokens. The counters move by exactly
//! the calls, refusals and approvals a test made; the gauges follow the store (an approval
//! decided by another process); the text passes `promtool check metrics` (Debian's
//! `prometheus` package, which `.ci/run` installs); no label holds a requester or an
//! argument.

use serde_json::{Value, json};

use crate::common::*;
use crate::http::{Reply, raw};

fn get(addr: &str, path: &str, token: Option<&str>) -> Reply {
    let mut head = format!("GET {path} HTTP/1.1\r\nHost: {addr}");
    if let Some(t) = token {
        head.push_str(&format!("\r\nAuthorization: Bearer {t}"));
    }
    raw(addr, &head, b"")
}

/// The metrics text at `addr`, waiting (up to 60 s) for the listener to come up.
pub(crate) fn scrape(addr: &str) -> String {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while std::net::TcpStream::connect(addr).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "no metrics listener at {addr}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let r = get(addr, "/metrics", None);
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(
        r.header("content-type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    r.body
}

/// The value of the sample `line` (a metric name with its labels, exactly as rendered:
/// labels in name order), 0 when it is absent.
pub(crate) fn sample(text: &str, line: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(line)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// Runs `promtool check metrics` on `text`; panics with its findings when it fails.
fn promtool_accepts(text: &str) {
    use std::io::Write as _;
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool (Debian package `prometheus`; .ci/run installs it)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics:\n{}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn calls(capability: &str, outcome: &str, category: &str) -> String {
    format!(
        "airlock_calls_total{{capability=\"{capability}\",category=\"{category}\",outcome=\"{outcome}\"}}"
    )
}

#[tokio::test]
async fn counters_move_by_exactly_the_calls_refusals_and_approvals_made() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let d = approvals_deployment().tables(&format!("[telemetry]\nmetrics = \"{addr}\"\n"));
    d.approve_all();
    let client = d.serve_profile("publisher", ()).await;

    let before = scrape(&addr);
    promtool_accepts(&before);
    for line in [
        "airlock_connection_state{connection=\"notes\",state=\"ready\"} 1",
        "airlock_connection_state{connection=\"notes\",state=\"stalled\"} 0",
        "airlock_mapping_state{mapping=\"outbox-delivery\",state=\"active\"} 1",
        "airlock_approvals_pending 0",
    ] {
        assert!(before.contains(line), "{line} in:\n{before}");
    }
    assert!(
        !before.contains("airlock_calls_total{"),
        "no call yet:\n{before}"
    );

    // Two reads, an approval asked for, one asked again, an unknown tool, bad arguments.
    let (artifact, team) = crate::approvals::prepared(&client, "team-reports").await;
    let deliver = crate::approvals::deliver_args(&artifact, &team);
    for _ in 0..2 {
        let r = call(&client, "deliver_artifact", deliver.clone())
            .await
            .unwrap();
        assert!(
            text_of(&r).starts_with("approval required:"),
            "{}",
            text_of(&r)
        );
    }
    assert!(call(&client, "no_such_tool", json!({})).await.is_err());
    refused_arguments(
        call(
            &client,
            "list_destinations",
            json!({"bogus": "secret-value-7"}),
        )
        .await,
    );

    let text = scrape(&addr);
    promtool_accepts(&text);
    for (line, n) in [
        (calls("prepare_artifact", "completed", ""), 1.0),
        (calls("list_destinations", "completed", ""), 1.0),
        (calls("deliver_artifact", "approval-required", ""), 2.0),
        (calls("(unoffered)", "invalid", ""), 1.0),
        (
            calls("list_destinations", "refused", "invalid request"),
            1.0,
        ),
        (
            "airlock_approvals_requested_total{mode=\"out-of-band\"}".into(),
            1.0,
        ),
        // Counted from the trace event of the start (Registry::trace).
        (
            "airlock_connection_transitions_total{connection=\"notes\",to=\"ready\"}".into(),
            1.0,
        ),
        ("airlock_approvals_pending".into(), 1.0),
        (
            "airlock_call_duration_seconds_count{capability=\"deliver_artifact\"}".into(),
            2.0,
        ),
        // The unknown tool and the bad arguments end inside normalization.
        (
            "airlock_call_stage_duration_seconds_count{stage=\"normalize\"}".into(),
            4.0,
        ),
    ] {
        assert_eq!(sample(&text, &line), n, "{line} in:\n{text}");
    }
    assert_eq!(d.sends(), 0, "nothing was delivered");
    // No requester, argument or reference is a label.
    for secret in [
        "alice",
        "secret-value-7",
        "Q3 report",
        "team-reports",
        "ref_",
        "ses_",
    ] {
        assert!(!text.contains(secret), "{secret} in:\n{text}");
    }
    assert!(
        sample(&text, "airlock_approvals_pending_oldest_age_seconds") > 0.0,
        "{text}"
    );

    // `airlock status`, from another process while the host serves.
    let st = d.airlock_json(&["status"]);
    assert_eq!(st["waiting"]["approvals_pending"], 1, "{st}");
    assert_eq!(
        st["approvals_pending"][0]["capability"], "deliver_artifact",
        "{st}"
    );
    assert_eq!(st["approvals_pending"][0]["requester"], "alice", "{st}");
    assert_eq!(st["approvals_pending"][0]["mode"], "out-of-band", "{st}");
    let connections = st["connections"].as_array().unwrap();
    assert_eq!(connections.len(), 2, "{st}");
    for c in connections {
        assert_eq!(c["state"], "ready", "{st}");
    }
    for m in st["mappings"].as_array().unwrap() {
        assert_eq!(m["state"], "active", "{st}");
    }
    assert!(st["trace"]["head_seq"].as_i64().unwrap() > 0, "{st}");
    let shown = d.airlock_ok(&["status"]);
    assert!(shown.contains("approvals    1 pending"), "{shown}");
    assert!(
        shown.contains("deliver_artifact  by alice  out-of-band"),
        "{shown}"
    );

    // Another process approves: the next scrape reads the store.
    let id = {
        let r = call(&client, "deliver_artifact", deliver.clone())
            .await
            .unwrap();
        let t = text_of(&r);
        let at = t.find("apr_").unwrap();
        t[at..at + 28].to_string()
    };
    d.airlock_json(&["approvals", "approve", &id, "--by", "bob", "--yes"]);
    let text = scrape(&addr);
    assert_eq!(sample(&text, "airlock_approvals_pending"), 0.0, "{text}");
    let done = call(&client, "deliver_artifact", deliver).await.unwrap();
    assert_ne!(done.is_error, Some(true), "{}", text_of(&done));
    assert_eq!(d.sends(), 1);
    let text = scrape(&addr);
    assert_eq!(
        sample(&text, &calls("deliver_artifact", "completed", "")),
        1.0,
        "{text}"
    );
    assert_eq!(
        sample(&text, &calls("deliver_artifact", "approval-required", "")),
        3.0
    );
    assert_eq!(
        sample(
            &text,
            "airlock_approvals_requested_total{mode=\"out-of-band\"}"
        ),
        1.0
    );
    // Only the calls that ran an adapter: the two reads and the delivery.
    let instances = sample(
        &text,
        "airlock_adapter_instantiation_seconds_count{from=\"spare\"}",
    ) + sample(
        &text,
        "airlock_adapter_instantiation_seconds_count{from=\"new\"}",
    );
    assert_eq!(instances, 3.0, "{text}");
    promtool_accepts(&text);

    // Only GET /metrics.
    assert_eq!(get(&addr, "/", None).status, 404);
    let post = raw(
        &addr,
        &format!("POST /metrics HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0"),
        b"",
    );
    assert_eq!(post.status, 405);
    assert_eq!(post.header("allow"), Some("GET, HEAD"));
    client.cancel().await.ok();

    // A host that stopped leaves its last traced states: `stopped`.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let st = d.airlock_json(&["status"]);
        let states: Vec<&str> = st["connections"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["state"].as_str().unwrap_or(""))
            .collect();
        if states.iter().all(|s| *s == "stopped") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{st}");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

#[tokio::test]
async fn the_http_fronts_metrics_need_the_same_bearer_token_as_mcp() {
    let d = crate::http::auth_deployment();
    let s = crate::http::serve_http(&d, "127.0.0.1:0");
    let alice = crate::http::alice();

    let anonymous = get(&s.addr, "/metrics", None);
    assert_eq!(anonymous.status, 401, "{anonymous:?}");
    assert!(anonymous.header("www-authenticate").is_some());
    assert!(!anonymous.body.contains("airlock_"), "{}", anonymous.body);

    for _ in 0..3 {
        let r = crate::http::post_stateless(
            &s,
            Some(&alice),
            "tools/call",
            json!({"name": "search_sources", "arguments": {"query": "checkpoint"}}),
            "",
        );
        assert_eq!(r.status, 200, "{r:?}");
        assert_ne!(r.message()["result"]["isError"], Value::Bool(true), "{r:?}");
    }
    let r = get(&s.addr, "/metrics", Some(&alice));
    assert_eq!(r.status, 200, "{r:?}");
    promtool_accepts(&r.body);
    assert_eq!(
        sample(&r.body, &calls("search_sources", "completed", "")),
        3.0,
        "{}",
        r.body
    );
    assert!(r.body.contains("airlock_mcp_sessions 0"), "{}", r.body);
    for secret in ["alice", "analyst", "checkpoint"] {
        assert!(!r.body.contains(secret), "{secret} in:\n{}", r.body);
    }

    // A tool the catalogue has but bob's profile (`searcher`) hides: counted, never named.
    let bob = crate::http::token("bob", json!({}));
    let hidden = crate::http::post_stateless(
        &s,
        Some(&bob),
        "tools/call",
        json!({"name": "retrieve_source", "arguments": {"source": "ref_x"}}),
        "",
    );
    assert!(hidden.message()["error"].is_object(), "{hidden:?}");
    // A legacy session is counted while it is open.
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "raw-test", "version": "1"}}})
    .to_string();
    let opened = raw(
        &s.addr,
        &format!(
            "POST /mcp HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {alice}\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nContent-Length: {}",
            s.addr,
            init.len()
        ),
        init.as_bytes(),
    );
    let id = opened
        .header("mcp-session-id")
        .expect("a session id")
        .to_string();
    let r = get(&s.addr, "/metrics", Some(&alice));
    assert_eq!(
        sample(&r.body, &calls("(unoffered)", "invalid", "")),
        1.0,
        "{}",
        r.body
    );
    assert!(!r.body.contains("retrieve_source"), "{}", r.body);
    assert!(r.body.contains("airlock_mcp_sessions 1"), "{}", r.body);
    let deleted = raw(
        &s.addr,
        &format!(
            "DELETE /mcp HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {alice}\r\nMcp-Session-Id: {id}\r\nMCP-Protocol-Version: 2025-11-25",
            s.addr
        ),
        b"",
    );
    assert!(deleted.status < 300, "{deleted:?}");
    let r = get(&s.addr, "/metrics", Some(&alice));
    assert!(r.body.contains("airlock_mcp_sessions 0"), "{}", r.body);
}

/// `airlock serve --metrics 127.0.0.1:0` over stdio with `AIRLOCK_LOG_FORMAT=FORMAT`, stdin
/// closed at once; its
/// stderr.
fn serve_logging(format: &str) -> String {
    let d = Deployment::with_notes().mapping("source-library");
    d.approve_all();
    let out = std::process::Command::new(airlock_bin())
        .arg("serve")
        .arg("--config")
        .arg(d.write_config())
        .args(["--metrics", "127.0.0.1:0"])
        .env("AIRLOCK_LOG", "airlock=info")
        .env("AIRLOCK_LOG_FORMAT", format)
        .env("AIRLOCK_CACHE_DIR", test_cache_dir())
        .env("AIRLOCK_STATE_DIR", d.state_dir())
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn json_logs_are_one_object_per_line_and_a_bad_format_says_so() {
    let stderr = serve_logging("json");
    let events: Vec<Value> = stderr
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .collect();
    let serving = events
        .iter()
        .find(|e| e["message"] == "serving MCP on stdio")
        .unwrap_or_else(|| panic!("no JSON event for the start in:\n{stderr}"));
    assert_eq!(serving["level"], "INFO", "{serving}");
    assert!(serving["timestamp"].is_string(), "{serving}");
    assert_eq!(serving["profile"], "default", "{serving}");
    assert!(!stderr.contains(" INFO airlock"), "no text line:\n{stderr}");

    // `--metrics` without [telemetry] in the file: the listener starts.
    assert!(
        stderr.contains("airlock: serving metrics at http://127.0.0.1:"),
        "{stderr}"
    );

    let stderr = serve_logging("yaml");
    assert!(
        stderr.contains("AIRLOCK_LOG_FORMAT=\"yaml\" is not a log format"),
        "{stderr}"
    );
    assert!(stderr.contains("serving MCP on stdio"), "{stderr}");
}
