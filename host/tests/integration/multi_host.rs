//! Several hosts on one PostgreSQL store: two real `airlock serve --http` processes, each
//! with its own state folder (holding the trace key file shipped from the first), on one
//! database of the test PostgreSQL server (`common::pg`). What one reviewer approved
//! through one host's configuration serves on both; both append to one MACed chain; a
//! retirement recorded in the shared store reaches both (`LISTEN/NOTIFY`) within 1 s.

use std::io::{BufRead as _, Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::time::Duration;

use airlock::store::{PostgresStore, Store as _};
use serde_json::{Value, json};

use crate::common::*;

/// A running `airlock serve --http`, killed on drop.
struct Served {
    child: std::process::Child,
    addr: String,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `airlock serve --config … --http 127.0.0.1:0` with `state_dir`; waits for its URL.
fn serve_http(d: &Deployment, state_dir: &Path) -> Served {
    let config = d.write_config();
    let mut child = std::process::Command::new(airlock_bin())
        .args(["serve", "--config"])
        .arg(&config)
        .args(["--http", "127.0.0.1:0"])
        .env("AIRLOCK_LOG", "airlock=info")
        .env("AIRLOCK_CACHE_DIR", test_cache_dir())
        .env("AIRLOCK_STATE_DIR", state_dir)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let pipe = child.stderr.take().unwrap();
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let seen = log.clone();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(pipe).lines() {
            let Ok(line) = line else { return };
            if let Some(url) = line.strip_prefix("airlock: serving MCP over HTTP at http://") {
                let _ = tx.send(url.trim_end_matches("/mcp").to_string());
            }
            seen.lock().unwrap().push_str(&(line + "\n"));
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(180))
        .unwrap_or_else(|_| {
            panic!(
                "airlock serve --http did not start:\n{}",
                log.lock().unwrap()
            )
        });
    Served { child, addr }
}

/// POSTs a stateless (2026-07-28) `method` to `/mcp` and returns the JSON-RPC answer.
fn post(s: &Served, method: &str, mut params: Value) -> Value {
    params["_meta"] = json!({
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {},
        "io.modelcontextprotocol/clientInfo": {"name": "multi-host-test", "version": "1"},
    });
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).to_string();
    let mut head = format!(
        "POST /mcp HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nMCP-Protocol-Version: 2026-07-28\r\nMcp-Method: {method}\r\nContent-Length: {}\r\nConnection: close",
        s.addr,
        body.len()
    );
    if let Some(name) = params.get("name").and_then(Value::as_str) {
        head.push_str(&format!("\r\nMcp-Name: {name}"));
    }
    let mut stream = std::net::TcpStream::connect(&s.addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    stream
        .write_all(format!("{head}\r\n\r\n{body}").as_bytes())
        .unwrap();
    let mut bytes = Vec::new();
    let _ = stream.read_to_end(&mut bytes);
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let (status_head, rest) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("{text:?}"));
    assert!(status_head.starts_with("HTTP/1.1 200"), "{text}");
    // Plain JSON, a chunked body or SSE: find the JSON-RPC answer in it.
    rest.lines()
        .map(|l| l.strip_prefix("data:").unwrap_or(l).trim())
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v.get("result").is_some() || v.get("error").is_some())
        .unwrap_or_else(|| panic!("no JSON-RPC answer in {text}"))
}

fn tool_names(s: &Served) -> Vec<String> {
    let mut names: Vec<String> = post(s, "tools/list", json!({}))["result"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap().to_owned())
        .collect();
    names.sort();
    names
}

fn search(s: &Served, query: &str) -> Value {
    let r = post(
        s,
        "tools/call",
        json!({"name": "search_sources", "arguments": {"query": query}}),
    );
    assert_ne!(r["result"]["isError"], true, "{r}");
    assert!(r.get("error").is_none(), "{r}");
    r
}

/// A deployment whose store is a fresh database, reviewed through its configuration;
/// returns it, the target, and host B's state folder holding A's key file.
fn two_host_deployment() -> (Deployment, String, PathBuf) {
    let target = crate::common::pg::database();
    let d = Deployment::with_notes()
        .mapping("source-library")
        .top(&format!("store = {target:?}\n"));
    d.approve_all();
    let b = d.dir.path().join("state-b");
    std::fs::create_dir(&b).unwrap();
    std::fs::set_permissions(&b, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    std::fs::copy(d.state_dir().join("trace.key"), b.join("trace.key")).unwrap();
    std::fs::set_permissions(
        b.join("trace.key"),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    (d, target, b)
}

#[test]
fn what_one_reviewer_approved_serves_on_both_hosts_and_their_events_make_one_chain() {
    let (d, target, b_state) = two_host_deployment();
    assert!(
        !d.state_dir().join("airlock.db").exists(),
        "the PostgreSQL store writes no SQLite database"
    );
    let a = serve_http(&d, &d.state_dir());
    let b = serve_http(&d, &b_state);
    for s in [&a, &b] {
        assert_eq!(tool_names(s), ["retrieve_source", "search_sources"]);
    }
    search(&a, "checkpoint");
    search(&b, "checkpoint");
    search(&a, "anchor");
    let store = PostgresStore::open(&target, Some(&d.state_dir()), None).unwrap();
    let v = store.verify_trace().unwrap();
    assert!(v.first_bad.is_none(), "{v:?}");
    let events = store.trace(0, 100_000).unwrap();
    let outcomes = events.iter().filter(|e| e.kind == "call-outcome").count();
    assert_eq!(outcomes, 3, "each host's calls are in the one trace");
    // The reviewer's approval (through the configuration, not a host) is in it too.
    assert!(
        events
            .iter()
            .any(|e| e.kind == "mapping-revision" && e.subject == "source-library")
    );
    assert!(!b_state.join("airlock.db").exists());
}

#[test]
fn concurrent_calls_on_two_hosts_append_to_one_unbroken_chain() {
    let (d, target, b_state) = two_host_deployment();
    let a = serve_http(&d, &d.state_dir());
    let b = serve_http(&d, &b_state);
    let before = PostgresStore::open(&target, Some(&d.state_dir()), None)
        .unwrap()
        .trace(0, 100_000)
        .unwrap()
        .len();
    std::thread::scope(|scope| {
        for i in 0..16 {
            let s = if i % 2 == 0 { &a } else { &b };
            scope.spawn(move || {
                search(s, &format!("q{i}"));
            });
        }
    });
    let store = PostgresStore::open(&target, Some(&d.state_dir()), None).unwrap();
    let v = store.verify_trace().unwrap();
    assert!(v.first_bad.is_none(), "{v:?}");
    let events = store.trace(0, 100_000).unwrap();
    assert!(events.len() > before);
    assert_eq!(
        events.iter().filter(|e| e.kind == "call-outcome").count(),
        16,
        "every call on either host is traced once"
    );
    let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(
        seqs,
        (1..=events.len() as i64).collect::<Vec<_>>(),
        "no gap, no fork"
    );
}

#[test]
fn a_host_with_another_key_refuses_to_start_on_a_keyed_store() {
    let (d, _target, _) = two_host_deployment();
    let c_state = d.dir.path().join("state-c");
    std::fs::create_dir(&c_state).unwrap();
    std::fs::set_permissions(
        &c_state,
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    let config = d.write_config();
    let out = std::process::Command::new(airlock_bin())
        .args(["serve", "--config"])
        .arg(&config)
        .args(["--http", "127.0.0.1:0"])
        .env("AIRLOCK_CACHE_DIR", test_cache_dir())
        .env("AIRLOCK_STATE_DIR", &c_state)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("MACed with key") && err.contains("the other hosts use"),
        "{err}"
    );
    assert!(
        !c_state.join("trace.key").exists(),
        "no key of its own was made"
    );
}

#[test]
fn a_retirement_recorded_in_the_shared_store_reaches_both_hosts_within_a_second() {
    let (d, target, b_state) = two_host_deployment();
    let a = serve_http(&d, &d.state_dir());
    let b = serve_http(&d, &b_state);
    for s in [&a, &b] {
        assert_eq!(tool_names(s), ["retrieve_source", "search_sources"]);
    }
    // An operator retires it on the shared store with the CLI (`--store`), and the other
    // operator commands read the same store: review, and the one chain.
    let listed = d.airlock_json(&["--store", &target, "review", "list"]);
    assert!(listed.to_string().contains("source-library"), "{listed}");
    d.airlock_ok(&[
        "--store",
        &target,
        "review",
        "retire",
        "source-library",
        "--reviewer",
        "tests",
    ]);
    let retired = std::time::Instant::now();
    let mut left = vec![&a, &b];
    while !left.is_empty() {
        assert!(
            retired.elapsed() < Duration::from_secs(1),
            "{} host(s) still serve the retired mapping after 1 s",
            left.len()
        );
        left.retain(|s| !tool_names(s).is_empty());
        std::thread::sleep(Duration::from_millis(20));
    }
    println!(
        "both hosts stopped serving {:?} after the retirement",
        retired.elapsed()
    );
    let verified = d.airlock_ok(&["--store", &target, "trace", "verify"]);
    assert!(verified.contains("intact"), "{verified}");
    // A --store that is neither sqlite nor PostgreSQL is a usage error that does not
    // repeat the value (it may hold a password).
    let out = d.airlock(&["--store", "mysql://u:s3cret@h/db", "review", "list"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--store") && !err.contains("s3cret"), "{err}");
}

/// A measurement, not a check: `tools/call` latency over HTTP (debug build, one caller,
/// sequential) with the SQLite store and with the PostgreSQL store, in the same run.
/// `cargo test -p airlock --test integration multi_host::tools_call_latency -- --ignored --nocapture`
#[test]
#[ignore = "a measurement; run it by name"]
fn tools_call_latency_sqlite_vs_postgres() {
    let sqlite = Deployment::with_notes().mapping("source-library");
    sqlite.approve_all();
    let (postgres, _, _) = two_host_deployment();
    for (name, d) in [("sqlite", &sqlite), ("postgres", &postgres)] {
        let s = serve_http(d, &d.state_dir());
        for _ in 0..20 {
            search(&s, "warm");
        }
        let mut us: Vec<u128> = (0..300)
            .map(|i| {
                let start = std::time::Instant::now();
                search(&s, &format!("q{}", i % 7));
                start.elapsed().as_micros()
            })
            .collect();
        us.sort_unstable();
        println!(
            "{name}: tools/call p50 {} µs, p99 {} µs (n = {})",
            us[us.len() / 2],
            us[us.len() * 99 / 100],
            us.len()
        );
    }
}
