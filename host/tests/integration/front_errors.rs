//! The model-facing front answers everything, on a real `airlock serve` over stdio: each
//! hostile line is written raw to its stdin and must be answered, with the right id and
//! code, within a short time, and a normal request after it still works. A 2026-07-28
//! client (the official Python SDK) hears about changes on `subscriptions/listen`.

use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::common::*;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout};

/// How long an answer may take.
const PROMPT: Duration = Duration::from_secs(5);

/// `airlock serve` driven by hand: raw lines in, JSON lines out.
struct Raw {
    _child: Child,
    stdin: ChildStdin,
    stdout: tokio::io::Lines<BufReader<ChildStdout>>,
}

impl Raw {
    async fn start(d: &Deployment) -> Self {
        let mut cmd = d.serve_command();
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        let mut child = cmd.spawn().expect("spawn airlock serve");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut raw = Self {
            _child: child,
            stdin,
            stdout,
        };
        raw.send(
            json!({
                "jsonrpc": "2.0", "id": 0, "method": "initialize",
                "params": {
                    "protocolVersion": "2025-11-25",
                    "capabilities": {},
                    "clientInfo": {"name": "raw", "version": "0"},
                },
            })
            .to_string()
            .as_bytes(),
        )
        .await;
        let init = raw.answer(&json!(0)).await;
        assert_eq!(init["result"]["protocolVersion"], "2025-11-25", "{init}");
        raw.send(br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#)
            .await;
        raw
    }

    /// Writes `line` and its newline.
    async fn send(&mut self, line: &[u8]) {
        self.stdin.write_all(line).await.unwrap();
        self.stdin.write_all(b"\n").await.unwrap();
        self.stdin.flush().await.unwrap();
    }

    /// The next response (notifications skipped), within [`PROMPT`].
    async fn next_response(&mut self) -> Value {
        let deadline = Instant::now() + PROMPT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = tokio::time::timeout(left, self.stdout.next_line())
                .await
                .expect("no answer within the time allowed")
                .unwrap()
                .expect("airlock serve closed stdout");
            let message: Value = serde_json::from_str(&line).expect("a JSON line");
            if message.get("method").is_none() {
                return message;
            }
        }
    }

    /// The response to `id`; any other response first fails the test.
    async fn answer(&mut self, id: &Value) -> Value {
        let message = self.next_response().await;
        assert_eq!(&message["id"], id, "an answer to another id: {message}");
        message
    }

    /// Sends `line`, expects an error with `id` and `code` at once.
    async fn refused(&mut self, line: &[u8], id: Value, code: i64) -> Value {
        let started = Instant::now();
        self.send(line).await;
        let answer = self.answer(&id).await;
        assert_eq!(
            answer["error"]["code"],
            code,
            "{}: {answer}",
            String::from_utf8_lossy(&line[..line.len().min(200)])
        );
        assert!(started.elapsed() < PROMPT);
        answer
    }

    /// A normal request still works: `tools/list` names, in order.
    async fn tools(&mut self, id: i64) -> Vec<String> {
        self.send(
            json!({"jsonrpc": "2.0", "id": id, "method": "tools/list"})
                .to_string()
                .as_bytes(),
        )
        .await;
        let listed = self.answer(&json!(id)).await;
        listed["result"]["tools"]
            .as_array()
            .unwrap_or_else(|| panic!("{listed}"))
            .iter()
            .map(|t| t["name"].as_str().unwrap().to_string())
            .collect()
    }
}

fn call_line(id: Value, params: &str) -> Vec<u8> {
    format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{params}}}"#).into_bytes()
}

#[tokio::test]
async fn every_hostile_line_is_answered_and_the_session_goes_on() {
    let d = Deployment::with_notes().mapping("source-library");
    d.approve_all();
    let mut s = Raw::start(&d).await;
    let offered = ["retrieve_source", "search_sources"];
    assert_eq!(s.tools(1).await, offered);

    // Not JSON: -32700 with the id found in the raw bytes.
    let deep = format!(r#"{{"query":{}"x"{}}}"#, "[".repeat(200), "]".repeat(200));
    let parse_errors: Vec<(Vec<u8>, Value)> = vec![
        (
            call_line(
                json!(101),
                &format!(r#"{{"name":"search_sources","arguments":{deep}}}"#),
            ),
            json!(101),
        ),
        (
            call_line(
                json!("lone"),
                r#"{"name":"search_sources","arguments":{"query":"\ud800"}}"#,
            ),
            json!("lone"),
        ),
        (
            call_line(
                json!(103),
                r#"{"name":"search_sources","arguments":{"query":"x","limit":1e400}}"#,
            ),
            json!(103),
        ),
        (
            {
                let mut l = call_line(
                    json!(104),
                    r#"{"name":"search_sources","arguments":{"query":"X"}}"#,
                );
                let at = l.iter().position(|&b| b == b'X').unwrap();
                l.splice(at..=at, [0xff, 0xfe]);
                l
            },
            json!(104),
        ),
        (b"{this is not json".to_vec(), Value::Null),
    ];
    for (line, id) in parse_errors {
        s.refused(&line, id, -32700).await;
        assert_eq!(s.tools(2).await, offered);
    }

    // Longer than 16 MiB: skipped to its newline, answered with its id.
    let huge = call_line(
        json!(105),
        &format!(
            r#"{{"name":"search_sources","arguments":{{"query":"{}"}}}}"#,
            "a".repeat(17 * 1024 * 1024)
        ),
    );
    let started = Instant::now();
    s.refused(&huge, json!(105), -32600).await;
    eprintln!("over-long line answered in {:?}", started.elapsed());
    assert_eq!(s.tools(3).await, offered);

    // A batch: every request in it is refused, the notification in it is not answered.
    s.send(br#"[{"jsonrpc":"2.0","id":106,"method":"tools/list"},{"jsonrpc":"2.0","method":"notifications/initialized"},{"jsonrpc":"2.0","id":107,"method":"ping"}]"#)
        .await;
    for id in [106, 107] {
        let a = s.answer(&json!(id)).await;
        assert_eq!(a["error"]["code"], -32600, "{a}");
        assert!(
            a["error"]["message"].as_str().unwrap().contains("batch"),
            "{a}"
        );
    }
    assert_eq!(s.tools(4).await, offered);

    // JSON, but not a request.
    s.refused(
        br#"{"jsonrpc":"1.0","id":108,"method":"tools/list"}"#,
        json!(108),
        -32600,
    )
    .await;
    s.refused(
        br#"{"jsonrpc":"2.0","id":{"x":1},"method":"tools/list"}"#,
        Value::Null,
        -32600,
    )
    .await;
    s.refused(
        br#"{"jsonrpc":"2.0","id":null,"method":"tools/list"}"#,
        Value::Null,
        -32600,
    )
    .await;

    // A served method with params of the wrong shape: -32602, never -32601.
    let a = s
        .refused(
            &call_line(json!(109), r#"{"arguments":{}}"#),
            json!(109),
            -32602,
        )
        .await;
    assert!(
        a["error"]["message"].as_str().unwrap().contains("name"),
        "{a}"
    );
    s.refused(
        &call_line(json!(110), r#"{"name":"search_sources","arguments":"wal"}"#),
        json!(110),
        -32602,
    )
    .await;
    // Duplicate keys in arguments: which query was meant is ambiguous.
    let a = s
        .refused(
            &call_line(
                json!(111),
                r#"{"name":"search_sources","arguments":{"query":"wal","query":"secret"}}"#,
            ),
            json!(111),
            -32602,
        )
        .await;
    assert!(
        a["error"]["message"].as_str().unwrap().contains("twice"),
        "{a}"
    );
    // An unknown method: -32601.
    s.refused(
        br#"{"jsonrpc":"2.0","id":112,"method":"tools/destroy","params":{}}"#,
        json!(112),
        -32601,
    )
    .await;
    // An unknown tool stays -32602 (the spec's own example).
    s.refused(
        &call_line(json!(113), r#"{"name":"read_note","arguments":{"id":"x"}}"#),
        json!(113),
        -32602,
    )
    .await;

    // Notifications are never answered, however malformed: the next line is the answer
    // to the next request.
    for note in [
        &br#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":[1]}"#[..],
        br#"{"jsonrpc":"1.0","method":"notifications/initialized"}"#,
        br#"{"jsonrpc":"2.0","method":"notifications/x","params":{"a":1,"a":2}}"#,
    ] {
        s.send(note).await;
    }
    assert_eq!(s.tools(5).await, offered);

    // Arguments that do not convert are a tool result the model reads (SEP-1303).
    s.send(&call_line(
        json!(114),
        r#"{"name":"search_sources","arguments":{"query":42}}"#,
    ))
    .await;
    let a = s.answer(&json!(114)).await;
    assert_eq!(a["result"]["isError"], true, "{a}");
    let text = a["result"]["content"][0]["text"].as_str().unwrap();
    assert!(
        text.starts_with(
            "invalid request: invalid arguments for `search_sources`: /query: expected a string"
        ),
        "{text}"
    );
    // null is not a string either, and 2.0 is an integer.
    s.send(&call_line(
        json!(115),
        r#"{"name":"search_sources","arguments":{"query":null}}"#,
    ))
    .await;
    assert_eq!(s.answer(&json!(115)).await["result"]["isError"], true);
    s.send(&call_line(
        json!(116),
        r#"{"name":"search_sources","arguments":{"query":"wal","limit":2.0}}"#,
    ))
    .await;
    let a = s.answer(&json!(116)).await;
    assert_ne!(a["result"]["isError"], true, "{a}");
    assert!(
        d.upstream_tool_calls() == ["search_notes"],
        "only the valid call reached the server"
    );

    // The order is fixed across calls.
    for id in 6..9 {
        assert_eq!(s.tools(id).await, offered);
    }
}

/// The Python listen client (`fixtures/python/listen_client.py`), driven line by line.
struct Listener {
    child: Child,
    stderr: std::path::PathBuf,
    stdin: ChildStdin,
    stdout: tokio::io::Lines<BufReader<ChildStdout>>,
}

impl Listener {
    async fn start(d: &Deployment) -> (Self, Value) {
        let config = d.write_config();
        let stderr = d.dir.path().join("python.stderr");
        let spec = json!({
            "command": airlock_bin(),
            "args": ["serve", "--config", config],
            "env": {
                "AIRLOCK_STATE_DIR": d.state_dir(),
                "AIRLOCK_CACHE_DIR": test_cache_dir(),
                "AIRLOCK_LOG": "warn",
            },
        });
        let mut child = tokio::process::Command::new("python3")
            .arg(workspace().join("fixtures/python/listen_client.py"))
            .arg(spec.to_string())
            .env("PYTHONPATH", python_site())
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 runs");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut l = Self {
            child,
            stderr,
            stdin,
            stdout,
        };
        let ready = l.read().await;
        (l, ready)
    }

    async fn read(&mut self) -> Value {
        let line = tokio::time::timeout(Duration::from_secs(40), self.stdout.next_line())
            .await
            .expect("the Python client said nothing")
            .unwrap()
            .unwrap_or_else(|| {
                std::thread::sleep(Duration::from_secs(1));
                panic!(
                    "the Python client exited: {}",
                    std::fs::read_to_string(&self.stderr).unwrap_or_default()
                )
            });
        serde_json::from_str(&line).unwrap()
    }

    async fn command(&mut self, command: &str) -> Value {
        self.stdin
            .write_all(format!("{command}\n").as_bytes())
            .await
            .unwrap();
        self.stdin.flush().await.unwrap();
        eprintln!("listen client <- {command}");
        let answer = self.read().await;
        eprintln!("listen client -> {answer}");
        answer
    }

    /// Leaves the subscription; the client must exit cleanly.
    async fn quit(mut self) {
        self.stdin.write_all(b"quit\n").await.unwrap();
        self.stdin.flush().await.unwrap();
        let status = tokio::time::timeout(Duration::from_secs(20), self.child.wait())
            .await
            .expect("the Python client did not exit")
            .unwrap();
        assert!(
            status.success(),
            "{}",
            std::fs::read_to_string(&self.stderr).unwrap_or_default()
        );
    }

    /// Waits for change events until the offered tools satisfy `done`.
    async fn wait_until(&mut self, done: impl Fn(&[Value]) -> bool) -> Value {
        for _ in 0..5 {
            let event = self.command("wait").await;
            assert_eq!(
                event["event"], "ToolsListChanged",
                "no change event: {event}"
            );
            if done(event["tools"].as_array().unwrap()) {
                return event;
            }
        }
        panic!("the tools never changed as expected");
    }
}

/// A 2026-07-28 client listening on `subscriptions/listen` hears that an approval made
/// the tools appear and that drift took them away, and sees the cache hints.
#[tokio::test]
async fn a_2026_07_28_client_hears_approvals_and_drift_on_listen() {
    let d = Deployment::with_notes()
        .notes_args(&["--drift-on-call", "description"])
        .mapping("source-library");
    let (mut l, ready) = Listener::start(&d).await;
    assert_eq!(ready["protocol"], "2026-07-28", "{ready}");
    assert_eq!(
        ready["honored"],
        json!({"toolsListChanged": true}),
        "{ready}"
    );
    assert_eq!(
        ready["tools"],
        json!([]),
        "nothing is approved yet: {ready}"
    );
    assert_eq!(ready["ttl_ms"], 60_000, "{ready}");
    assert_eq!(ready["cache_scope"], "private", "{ready}");

    // An approval while the client listens.
    d.approve("source-library", "alice", &[]);
    let event = l.wait_until(|tools| !tools.is_empty()).await;
    assert_eq!(event["tools"], json!(["retrieve_source", "search_sources"]));

    // The first call makes the server drift (and announce it); the next call is refused.
    let hits = l
        .command(r#"call search_sources {"query": "checkpoint"}"#)
        .await;
    assert_eq!(hits["is_error"], false, "{hits}");
    let reference = hits["structured"]["result"][0]["reference"]
        .as_str()
        .unwrap();
    let next = l
        .command(&format!(
            r#"call retrieve_source {{"reference": "{reference}"}}"#
        ))
        .await;
    assert_eq!(next["is_error"], true, "{next}");
    let event = l.wait_until(|tools| tools.is_empty()).await;
    assert_eq!(event["tools"], json!([]));
    l.quit().await;
}
