//! Shared by the bench binaries that drive `airlock serve` processes: the HTTP caller,
//! starting a front, reviewing the notes mapping, process facts.
#![allow(dead_code)]

use std::path::Path;

use rmcp::model::JsonObject;
use serde_json::{Value, json};

/// The JSON object of `v` (any other value: an empty object).
pub fn args(v: Value) -> JsonObject {
    match v {
        Value::Object(o) => o,
        _ => JsonObject::new(),
    }
}

/// One keep-alive HTTP/1.1 connection to `airlock serve --http`, posting stateless
/// (2026-07-28) requests to `/mcp` as a Streamable HTTP client does.
pub struct HttpCaller {
    send: hyper::client::conn::http1::SendRequest<http_body_util::Full<bytes::Bytes>>,
    authority: String,
    next_id: u64,
}

impl HttpCaller {
    pub async fn connect(authority: &str) -> Self {
        let stream = tokio::net::TcpStream::connect(authority).await.unwrap();
        stream.set_nodelay(true).unwrap();
        let (send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .unwrap();
        tokio::spawn(conn);
        Self {
            send,
            authority: authority.to_string(),
            next_id: 1,
        }
    }

    /// `tools/call` of `tool`; the result's JSON (plain JSON or the SSE event that carries
    /// it). Panics on anything but a 200 with a result that is not an error.
    pub async fn call(&mut self, tool: &str, arguments: &JsonObject) -> Value {
        use http_body_util::BodyExt as _;
        self.next_id += 1;
        let body = json!({
            "jsonrpc": "2.0",
            "id": self.next_id,
            "method": "tools/call",
            "params": {
                "name": tool,
                "arguments": arguments,
                "_meta": {
                    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
                    "io.modelcontextprotocol/clientCapabilities": {},
                    "io.modelcontextprotocol/clientInfo": {"name": "bench", "version": "1"},
                },
            },
        });
        let request = http::Request::post("/mcp")
            .header(http::header::HOST, &self.authority)
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(http::header::ACCEPT, "application/json, text/event-stream")
            .header("MCP-Protocol-Version", "2026-07-28")
            .header("Mcp-Method", "tools/call")
            .header("Mcp-Name", tool)
            .body(http_body_util::Full::new(bytes::Bytes::from(
                serde_json::to_vec(&body).unwrap(),
            )))
            .unwrap();
        self.send.ready().await.unwrap();
        let response = self.send.send_request(request).await.unwrap();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let text = std::str::from_utf8(&bytes).unwrap();
        assert_eq!(status, 200, "{text}");
        let message: Value = serde_json::from_str(text).unwrap_or_else(|_| {
            text.lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
                .find(|v| v.get("result").is_some() || v.get("error").is_some())
                .unwrap_or_else(|| panic!("no JSON-RPC answer in {text}"))
        });
        let result = &message["result"];
        assert!(
            result.is_object() && result["isError"] != true,
            "{tool} failed: {message}"
        );
        result.clone()
    }
}

/// Starts `airlock serve --http 127.0.0.1:0` on `config`; the child and its `host:port`.
/// `AIRLOCK_BENCH_HTTP_WORKERS`, when set, is passed as `--workers` (else serve's default).
pub async fn serve_http(
    bin: &Path,
    config: &Path,
    state_dir: &Path,
    cache_dir: &Path,
) -> (tokio::process::Child, String) {
    use tokio::io::AsyncBufReadExt as _;
    let mut child = tokio::process::Command::new(bin)
        .arg("serve")
        .arg("--config")
        .arg(config)
        .args(["--http", "127.0.0.1:0"])
        .args(
            std::env::var("AIRLOCK_BENCH_HTTP_WORKERS")
                .ok()
                .map(|n| ["--workers".to_string(), n])
                .into_iter()
                .flatten(),
        )
        .env("AIRLOCK_STATE_DIR", state_dir)
        .env("AIRLOCK_CACHE_DIR", cache_dir)
        .env("AIRLOCK_LOG", log_filter())
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines
            .next_line()
            .await
            .unwrap()
            .expect("airlock serve --http exited before serving");
        if let Some(url) = line.strip_prefix("airlock: serving MCP over HTTP at http://") {
            break url.trim_end_matches("/mcp").to_string();
        }
        eprintln!("{line}");
    };
    // Keep draining its log so the child never blocks on a full pipe.
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            eprintln!("{line}");
        }
    });
    (child, addr)
}

/// The log filter of the airlock processes a bench starts (`AIRLOCK_BENCH_LOG`, default `warn`).
pub fn log_filter() -> String {
    std::env::var("AIRLOCK_BENCH_LOG").unwrap_or_else(|_| "warn".into())
}

/// The resident set of process `pid` in KiB (0 when unknown).
/// CPU time (ns) the process `pid` has run, over its live threads
/// (`/proc/PID/task/*/schedstat`); 0 when unknown.
pub fn cpu_ns(pid: Option<u32>) -> u64 {
    let Some(pid) = pid else { return 0 };
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

pub fn rss_kib(pid: Option<u32>) -> u64 {
    let Some(pid) = pid else { return 0 };
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Discovers and approves the notes mapping with `bin` in `state`, as an operator would.
pub fn review(bin: &Path, config: &Path, state: &Path) {
    let config = config.to_str().unwrap();
    for args in [
        &["discover", "notes", "--config", config][..],
        &[
            "review",
            "approve",
            "source-library",
            "--config",
            config,
            "--reviewer",
            "bench",
        ],
    ] {
        let out = std::process::Command::new(bin)
            .env("AIRLOCK_STATE_DIR", state)
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{} {args:?}: {}",
            bin.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Searches the notes through the HTTP front at `addr` (a connection of its own) and
/// returns `retrieve_source`'s arguments for the first hit's reference.
///
/// # Panics
/// When the search fails or returns no reference.
pub async fn mint_reference(addr: &str) -> JsonObject {
    let hits = HttpCaller::connect(addr)
        .await
        .call(
            "search_sources",
            &args(json!({"query": "keepalive", "limit": 1})),
        )
        .await;
    args(json!({
        "reference": hits["structuredContent"]["result"][0]["reference"]
            .as_str()
            .unwrap_or_else(|| panic!("no reference in {hits}"))
    }))
}
