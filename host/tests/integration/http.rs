//! `airlock serve --http` as a real process: the Streamable HTTP front and its OAuth 2.1
//! resource server. Tokens are minted here with a test-only key pair (`fixtures/jwt/`);
//! requests are the official Python MCP SDK over Streamable HTTP, or raw HTTP/1.1 written
//! on a `TcpStream` (so every status code is the server's own, unsoftened by a client).

use std::io::{BufRead as _, Read as _, Write as _};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{Value, json};

const ISSUER: &str = "https://issuer.test";
const AUDIENCE: &str = "http://airlock.test/mcp";
const METADATA_URL: &str = "http://airlock.test/.well-known/oauth-protected-resource/mcp";
const MAX_BODY: usize = 65536;

pub(crate) const POLICY: &str = r#"
@id("use")
permit (principal, action == Airlock::Action::"use-profile", resource);

@id("research-needs-analyst")
forbid (principal, action == Airlock::Action::"use-profile", resource == Airlock::Profile::"research")
unless { principal in Airlock::Role::"analyst" };

@id("no-mallory")
forbid (principal == Airlock::Requester::"mallory", action == Airlock::Action::"use-profile", resource);

@id("reads")
permit (principal, action == Airlock::Action::"call", resource)
when { resource.effect_class == "read" };
"#;

pub(crate) const PROFILES: &str = r#"
[[profile]]
name = "research"
capabilities = ["search_sources", "retrieve_source"]

[[profile]]
name = "searcher"
capabilities = ["search_sources"]
"#;

pub(crate) fn auth_tables() -> String {
    format!(
        "[http]\nmax_body_bytes = {MAX_BODY}\n\n[http.auth]\nissuer = \"{ISSUER}\"\naudience = \"{AUDIENCE}\"\njwks_file = {:?}\nrequired_scopes = [\"mcp\"]\nroles_claim = \"roles\"\nprofile_claim = \"airlock_profile\"\n",
        workspace()
            .join("fixtures/jwt/jwks.json")
            .display()
            .to_string()
    )
}

/// The notes server with `source-library`, two profiles, [`POLICY`], `[http.auth]`.
pub(crate) fn auth_deployment() -> Deployment {
    let d = Deployment::with_notes()
        .mapping("source-library")
        .policy(POLICY)
        .top("default_profile = \"searcher\"\n")
        .tables(PROFILES)
        .tables(&auth_tables());
    d.approve_all();
    d
}

fn now() -> i64 {
    jsonwebtoken::get_current_timestamp() as i64
}

/// Good claims for `sub`, with `extra` merged in (`null` removes a claim).
fn claims(sub: &str, extra: Value) -> Value {
    let mut c = json!({
        "iss": ISSUER, "aud": AUDIENCE, "sub": sub,
        "iat": now(), "exp": now() + 600, "scope": "mcp",
    });
    for (k, v) in extra.as_object().unwrap() {
        if v.is_null() {
            c.as_object_mut().unwrap().remove(k);
        } else {
            c[k] = v.clone();
        }
    }
    c
}

fn sign_with(claims: &Value, key_file: &str, kid: &str) -> String {
    let der = std::fs::read(workspace().join("fixtures/jwt").join(key_file)).unwrap();
    let mut header = Header::new(Algorithm::ES256);
    header.kid = Some(kid.into());
    jsonwebtoken::encode(&header, claims, &EncodingKey::from_ec_der(&der)).unwrap()
}

pub(crate) fn token(sub: &str, extra: Value) -> String {
    sign_with(&claims(sub, extra), "issuer.pk8.der", "test-issuer-1")
}

pub(crate) fn alice() -> String {
    token(
        "alice",
        json!({"roles": ["analyst"], "airlock_profile": "research"}),
    )
}

/// A running `airlock serve --http`, killed on drop.
pub(crate) struct Served {
    child: std::process::Child,
    /// `127.0.0.1:PORT`.
    pub(crate) addr: String,
    stderr: Arc<Mutex<String>>,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Served {
    fn url(&self) -> String {
        format!("http://{}/mcp", self.addr)
    }

    /// Stops the host with `SIGTERM` and waits (at most 30 s) for it to exit.
    pub(crate) fn terminate(&mut self) -> std::process::ExitStatus {
        // SAFETY: kill(2) has no memory-safety preconditions.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "airlock serve --http did not stop on SIGTERM:\n{}",
                self.stderr.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The pids of the processes airlock started (its upstream servers).
    fn children(&self) -> Vec<u32> {
        let mut pids = Vec::new();
        let task_dir = format!("/proc/{}/task", self.child.id());
        for t in std::fs::read_dir(task_dir).unwrap().flatten() {
            let list = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
            pids.extend(
                list.split_whitespace()
                    .filter_map(|p| p.parse::<u32>().ok()),
            );
        }
        pids
    }
}

/// Starts `airlock serve --config … --http ADDR` and waits for the URL it prints.
pub(crate) fn serve_http(d: &Deployment, addr: &str) -> Served {
    serve_http_with(d, addr, &[])
}

/// Like [`serve_http`], with `extra` arguments after `--http ADDR` (e.g. `--otlp URL`).
pub(crate) fn serve_http_with(d: &Deployment, addr: &str, extra: &[&str]) -> Served {
    let config = d.write_config();
    let mut child = std::process::Command::new(airlock_bin())
        .arg("serve")
        .arg("--config")
        .arg(&config)
        .arg("--http")
        .arg(addr)
        .args(extra)
        .env("AIRLOCK_LOG", "airlock=info")
        .env("AIRLOCK_CACHE_DIR", test_cache_dir())
        .env("AIRLOCK_STATE_DIR", d.state_dir())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = Arc::new(Mutex::new(String::new()));
    let (tx, rx) = std::sync::mpsc::channel();
    let pipe = child.stderr.take().unwrap();
    let log = stderr.clone();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(pipe).lines() {
            let Ok(line) = line else { return };
            if let Some(url) = line.strip_prefix("airlock: serving MCP over HTTP at http://") {
                let _ = tx.send(url.trim_end_matches("/mcp").to_string());
            }
            log.lock().unwrap().push_str(&(line + "\n"));
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(180))
        .unwrap_or_else(|_| {
            panic!(
                "airlock serve --http did not start:\n{}",
                stderr.lock().unwrap()
            )
        });
    Served {
        child,
        addr,
        stderr,
    }
}

/// One HTTP response.
#[derive(Debug)]
pub(crate) struct Reply {
    pub(crate) status: u16,
    headers: Vec<(String, String)>,
    pub(crate) body: String,
}

impl Reply {
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The JSON-RPC message of the body (plain JSON, or the SSE event that carries one).
    pub(crate) fn message(&self) -> Value {
        if let Ok(v) = serde_json::from_str::<Value>(&self.body) {
            return v;
        }
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
            .find(|v| v.get("result").is_some() || v.get("error").is_some())
            .unwrap_or_else(|| panic!("no JSON-RPC answer in: {self:?}"))
    }
}

/// Writes `head` (request line and headers, without the final blank line; `Connection:
/// close` is added) and `body` to `addr`, and reads the whole response.
pub(crate) fn raw(addr: &str, head: &str, body: &[u8]) -> Reply {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut req = format!("{head}\r\nConnection: close\r\n\r\n").into_bytes();
    req.extend_from_slice(body);
    // The server may answer (413, 401) and close before reading everything we send.
    let _ = s.write_all(&req);
    let mut bytes = Vec::new();
    let _ = s.read_to_end(&mut bytes);
    parse_reply(&bytes)
}

fn parse_reply(bytes: &[u8]) -> Reply {
    let text = String::from_utf8_lossy(bytes).into_owned();
    let (head, rest) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("not an HTTP response: {text:?}"));
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    Reply {
        status,
        headers,
        body,
    }
}

fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    out
}

/// A 2026-07-28 (stateless) JSON-RPC request body.
/// A stateless request's body: `params` with the `_meta` members 2026-07-28 requires
/// (members `params` already has in its `_meta`, e.g. `traceparent`, are kept).
fn stateless(method: &str, params: Value) -> String {
    let mut params = params;
    let mut meta = json!({
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {},
        "io.modelcontextprotocol/clientInfo": {"name": "raw-test", "version": "1"},
    });
    if let Some(Value::Object(own)) = params.get("_meta") {
        for (k, v) in own {
            meta[k] = v.clone();
        }
    }
    params["_meta"] = meta;
    json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).to_string()
}

/// POSTs a stateless `method` to `/mcp` with `token` (if any) and `extra` header lines.
pub(crate) fn post_stateless(
    s: &Served,
    token: Option<&str>,
    method: &str,
    params: Value,
    extra: &str,
) -> Reply {
    let body = stateless(method, params.clone());
    let mut head = format!(
        "POST /mcp HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nMCP-Protocol-Version: 2026-07-28\r\nMcp-Method: {method}\r\nContent-Length: {}",
        s.addr,
        body.len()
    );
    if let Some(name) = params.get("name").and_then(Value::as_str) {
        head.push_str(&format!("\r\nMcp-Name: {name}"));
    }
    if let Some(t) = token {
        head.push_str(&format!("\r\nAuthorization: Bearer {t}"));
    }
    head.push_str(extra);
    raw(&s.addr, &head, body.as_bytes())
}

fn tool_names(reply: &Reply) -> Vec<String> {
    assert_eq!(reply.status, 200, "{reply:?}");
    reply.message()["result"]["tools"]
        .as_array()
        .unwrap_or_else(|| panic!("{reply:?}"))
        .iter()
        .map(|t| t["name"].as_str().unwrap().to_string())
        .collect()
}

/// `fixtures/python/http_client.py URL TOKEN MODE [REFERENCE]`, its JSON output.
fn python(s: &Served, token: &str, mode: &str, reference: Option<&str>) -> Value {
    let mut cmd = std::process::Command::new("python3");
    cmd.arg(workspace().join("fixtures/python/http_client.py"))
        .arg(s.url())
        .arg(token)
        .arg(mode);
    if let Some(r) = reference {
        cmd.arg(r);
    }
    let out = cmd
        .env("PYTHONPATH", python_site())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "the Python client failed ({mode}): {}\n{}\nserver: {}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout),
        s.stderr.lock().unwrap()
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

#[test]
fn the_python_sdk_lists_and_calls_with_a_bearer_token_in_both_generations() {
    let d = auth_deployment();
    let s = serve_http(&d, "127.0.0.1:0");
    let alice = alice();
    let mut minted = None;
    for (mode, protocol) in [("legacy", "2025-11-25"), ("2026-07-28", "2026-07-28")] {
        let out = python(&s, &alice, mode, None);
        assert_eq!(out["protocol"], protocol, "{out}");
        assert_eq!(
            out["tools"],
            json!(["retrieve_source", "search_sources"]),
            "{out}"
        );
        assert_eq!(out["search_error"], false, "{out}");
        assert!(!out["references"].as_array().unwrap().is_empty(), "{out}");
        // Every reference of the first search resolves after a second search reported
        // the same notes with other snippets (the research loop), and so does the first.
        assert_eq!(out["second_search_error"], false, "{out}");
        let rest = out["first_search_retrieves"].as_array().unwrap();
        assert!(
            !rest.is_empty(),
            "the first search found several notes: {out}"
        );
        assert!(rest.iter().all(|r| r == "ok"), "{out}");
        assert_eq!(out["retrieve_error"], false, "{out}");
        assert!(out["retrieved_chars"].as_u64().unwrap() > 100, "{out}");
        minted.get_or_insert(out["references"][0].as_str().unwrap().to_string());
    }
    let minted = minted.unwrap();
    // Another client of the same principal (stateless) resolves alice's reference ...
    let again = python(&s, &alice, "2026-07-28", Some(&minted));
    assert_eq!(again["retrieve_error"], false, "{again}");
    // ... another principal, in the same profile, does not.
    let carol = token(
        "carol",
        json!({"roles": ["analyst"], "airlock_profile": "research"}),
    );
    for mode in ["legacy", "2026-07-28"] {
        let other = python(&s, &carol, mode, Some(&minted));
        assert_eq!(other["tools"], json!(["retrieve_source", "search_sources"]));
        // Refused as a tool result the model reads (SEP-1303), never run.
        assert_eq!(other["retrieve_error"], true, "{other}");
        assert!(other.get("retrieve_code").is_none(), "{other}");
        assert!(other.get("retrieved_chars").is_none(), "{other}");
        assert!(
            other["retrieve_text"]
                .as_str()
                .unwrap()
                .contains("not valid in this session"),
            "{other}"
        );
    }
    let tools = d.upstream_tool_calls();
    assert!(tools.contains(&"search_notes".to_string()), "{tools:?}");
    assert!(tools.contains(&"read_note".to_string()), "{tools:?}");
    // The token reached no upstream: not in what the notes server received, nor in its
    // environment or command line.
    let signature = alice.rsplit('.').next().unwrap();
    let log = std::fs::read_to_string(d.dir.path().join("calls.jsonl")).unwrap();
    assert!(!log.contains(signature) && !log.contains(&alice));
    let children = s.children();
    assert!(!children.is_empty(), "the notes server runs under airlock");
    for pid in children {
        for f in ["environ", "cmdline"] {
            let bytes = std::fs::read(format!("/proc/{pid}/{f}")).unwrap_or_default();
            let text = String::from_utf8_lossy(&bytes);
            assert!(!text.contains(signature), "the token is in /proc/{pid}/{f}");
        }
    }
    // Sessions were opened for the token subjects, over http.
    let opened: Vec<Value> = d
        .trace()
        .into_iter()
        .filter(|e| e["kind"] == "session-opened")
        .collect();
    let text = serde_json::to_string(&opened).unwrap();
    assert!(
        text.contains("\"alice\"") && text.contains("\"carol\""),
        "{text}"
    );
    assert!(text.contains("\"http\""), "{text}");
    assert!(!text.contains(signature), "the token is in the trace");
}

#[test]
fn tokens_that_do_not_verify_get_401_and_reach_nothing() {
    let d = auth_deployment();
    let s = serve_http(&d, "127.0.0.1:0");
    let call = json!({"name": "search_sources", "arguments": {"query": "checkpoint"}});
    let payload = |c: &Value| {
        const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let bytes = c.to_string().into_bytes();
        let mut out = String::new();
        for chunk in bytes.chunks(3) {
            let n =
                chunk.iter().fold(0u32, |n, b| (n << 8) | u32::from(*b)) << (8 * (3 - chunk.len()));
            for i in 0..=chunk.len() {
                out.push(A[((n >> (18 - 6 * i)) & 63) as usize] as char);
            }
        }
        out
    };
    let good = claims(
        "alice",
        json!({"roles": ["analyst"], "airlock_profile": "research"}),
    );
    let alg_none = format!("eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0.{}.", payload(&good));
    let cases: Vec<(&str, Option<String>)> = vec![
        ("missing", None),
        (
            "expired",
            Some(token("alice", json!({"exp": now() - 3600}))),
        ),
        (
            "wrong audience",
            Some(token("alice", json!({"aud": "http://elsewhere.test/mcp"}))),
        ),
        (
            "wrong issuer",
            Some(token("alice", json!({"iss": "https://evil.test"}))),
        ),
        ("alg none", Some(alg_none)),
        (
            "wrong key",
            Some(sign_with(&good, "other.pk8.der", "test-issuer-1")),
        ),
        ("garbage", Some("not-a-token".into())),
        ("huge", Some("a".repeat(20_000))),
    ];
    for (name, t) in &cases {
        let r = post_stateless(&s, t.as_deref(), "tools/call", call.clone(), "");
        assert_eq!(r.status, 401, "{name}: {r:?}");
        let challenge = r
            .header("www-authenticate")
            .unwrap_or_else(|| panic!("{name}: {r:?}"));
        assert!(
            challenge.starts_with(&format!("Bearer resource_metadata=\"{METADATA_URL}\"")),
            "{name}: {challenge}"
        );
        assert_eq!(
            challenge.contains("error=\"invalid_token\""),
            t.is_some(),
            "{name}: {challenge}"
        );
    }
    // Valid, but without the required scope: 403 insufficient_scope.
    let r = post_stateless(
        &s,
        Some(&token(
            "alice",
            json!({"scope": "other", "roles": ["analyst"]}),
        )),
        "tools/call",
        call.clone(),
        "",
    );
    assert_eq!(r.status, 403, "{r:?}");
    let challenge = r.header("www-authenticate").unwrap();
    assert!(
        challenge.contains("error=\"insufficient_scope\"") && challenge.contains("scope=\"mcp\""),
        "{challenge}"
    );
    assert_eq!(
        d.upstream_tool_calls(),
        Vec::<String>::new(),
        "a refused request reached the upstream"
    );
    // The same call with a good token does reach it.
    let r = post_stateless(&s, Some(&alice()), "tools/call", call, "");
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.message()["result"]["isError"], json!(false), "{r:?}");
    assert_eq!(d.upstream_tool_calls(), ["search_notes"]);
    // A stateless request answered by one message gets it as a JSON body, not a stream.
    assert_eq!(r.header("content-type"), Some("application/json"), "{r:?}");
    assert!(
        serde_json::from_str::<Value>(&r.body).is_ok(),
        "not one JSON body: {r:?}"
    );
}

#[test]
fn the_token_selects_requester_and_profile_through_policy() {
    let d = auth_deployment();
    let s = serve_http(&d, "127.0.0.1:0");
    let list = |t: &str| post_stateless(&s, Some(t), "tools/list", json!({}), "");
    // alice: analyst, asks for research.
    assert_eq!(
        tool_names(&list(&alice())),
        ["retrieve_source", "search_sources"]
    );
    // bob: no roles, no profile claim: the default profile.
    assert_eq!(
        tool_names(&list(&token("bob", json!({})))),
        ["search_sources"]
    );
    // bob asking for research: policy wants the analyst role.
    let r = list(&token("bob", json!({"airlock_profile": "research"})));
    assert_eq!(r.status, 403, "{r:?}");
    assert!(
        r.body
            .contains("policy does not let requester `bob` use profile `research`"),
        "{r:?}"
    );
    // bob's role comes from the token, not from anything else.
    let r = list(&token(
        "bob",
        json!({"airlock_profile": "research", "roles": "analyst"}),
    ));
    assert_eq!(tool_names(&r), ["retrieve_source", "search_sources"]);
    // mallory may use no profile.
    let r = list(&token("mallory", json!({})));
    assert_eq!(r.status, 403, "{r:?}");
    assert!(
        r.body.contains("policy does not let requester `mallory`"),
        "{r:?}"
    );
    // A profile that does not exist, and subjects that are not principal names.
    let r = list(&token("bob", json!({"airlock_profile": "admin"})));
    assert_eq!(r.status, 403, "{r:?}");
    assert!(
        r.body.contains("profile `admin` is not offered here"),
        "{r:?}"
    );
    for sub in ["bob smith", "bob\nadmin", ""] {
        let r = list(&token(sub, json!({})));
        assert_eq!(r.status, 403, "{sub:?}: {r:?}");
        assert!(r.body.contains("no usable principal"), "{r:?}");
    }
    let r = list(&token("bob", json!({"roles": ["ok", {"x": 1}]})));
    assert_eq!(r.status, 403, "{r:?}");
    // Policy is asked on every request: once it forbids alice, her cached session stops.
    d.rewrite_policy(&format!(
        "{POLICY}\n@id(\"no-alice\")\nforbid (principal == Airlock::Requester::\"alice\", action == Airlock::Action::\"use-profile\", resource);\n"
    ));
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let r = list(&alice());
        if r.status == 403 {
            assert!(
                r.body.contains("policy does not let requester `alice`"),
                "{r:?}"
            );
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the reloaded policy never applied: {r:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        tool_names(&list(&token("bob", json!({})))),
        ["search_sources"]
    );
    let trace = serde_json::to_string(&d.trace()).unwrap();
    assert!(
        !trace.contains("bob smith") && !trace.contains("bob\\nadmin"),
        "a refused subject reached the trace"
    );
}

#[test]
fn metadata_document_and_http_status_codes() {
    let d = auth_deployment();
    let s = serve_http(&d, "127.0.0.1:0");
    let host = format!("Host: {}", s.addr);
    for path in [
        "/.well-known/oauth-protected-resource",
        "/.well-known/oauth-protected-resource/mcp",
    ] {
        let r = raw(&s.addr, &format!("GET {path} HTTP/1.1\r\n{host}"), b"");
        assert_eq!(r.status, 200, "{r:?}");
        let doc: Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(doc["resource"], AUDIENCE);
        assert_eq!(doc["authorization_servers"], json!([ISSUER]));
        assert_eq!(doc["bearer_methods_supported"], json!(["header"]));
        assert_eq!(doc["scopes_supported"], json!(["mcp"]));
    }
    let r = raw(
        &s.addr,
        &format!(
            "POST /.well-known/oauth-protected-resource HTTP/1.1\r\n{host}\r\nContent-Length: 0"
        ),
        b"",
    );
    assert_eq!(r.status, 405, "{r:?}");
    let r = raw(&s.addr, &format!("GET /nowhere HTTP/1.1\r\n{host}"), b"");
    assert_eq!(r.status, 404, "{r:?}");
    // DNS rebinding: a Host that is not allowed is refused, token or not.
    let auth = format!("Authorization: Bearer {}", alice());
    let r = raw(
        &s.addr,
        &format!(
            "GET /mcp HTTP/1.1\r\nHost: evil.test:{}\r\n{auth}",
            s.addr.rsplit(':').next().unwrap()
        ),
        b"",
    );
    assert_eq!(r.status, 403, "{r:?}");
    assert!(r.body.contains("Host header is not allowed"), "{r:?}");
    let r = raw(
        &s.addr,
        "GET /.well-known/oauth-protected-resource HTTP/1.1\r\nHost: evil.test",
        b"",
    );
    assert_eq!(r.status, 403, "{r:?}");
    // The audience's host is allowed by default.
    let r = raw(
        &s.addr,
        "GET /.well-known/oauth-protected-resource HTTP/1.1\r\nHost: airlock.test",
        b"",
    );
    assert_eq!(r.status, 200, "{r:?}");
    // Body ceiling: a declared length over it is 413 before the body is sent ...
    let head = format!(
        "POST /mcp HTTP/1.1\r\n{host}\r\n{auth}\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nContent-Length: {}",
        MAX_BODY + 1
    );
    let r = raw(&s.addr, &head, b"{");
    assert_eq!(r.status, 413, "{r:?}");
    // ... and a chunked body that grows over it is 413 while it streams.
    let mut big = stateless("tools/list", json!({"pad": "x".repeat(MAX_BODY)})).into_bytes();
    let mut chunked = format!("{:x}\r\n", big.len()).into_bytes();
    chunked.append(&mut big);
    chunked.extend_from_slice(b"\r\n0\r\n\r\n");
    let head = format!(
        "POST /mcp HTTP/1.1\r\n{host}\r\n{auth}\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nMCP-Protocol-Version: 2026-07-28\r\nMcp-Method: tools/list\r\nTransfer-Encoding: chunked"
    );
    let r = raw(&s.addr, &head, &chunked);
    assert_eq!(r.status, 413, "{r:?}");
    // Methods the stateless endpoint does not serve.
    for method in ["GET", "DELETE"] {
        let r = raw(
            &s.addr,
            &format!(
                "{method} /mcp HTTP/1.1\r\n{host}\r\n{auth}\r\nAccept: text/event-stream\r\nMCP-Protocol-Version: 2026-07-28"
            ),
            b"",
        );
        assert_eq!(r.status, 405, "{method}: {r:?}");
    }
    let r = raw(
        &s.addr,
        &format!("PUT /mcp HTTP/1.1\r\n{host}\r\n{auth}\r\nContent-Length: 0"),
        b"",
    );
    assert_eq!(r.status, 405, "{r:?}");
    assert!(r.header("allow").is_some(), "{r:?}");
    // MCP-Protocol-Version contradicting the body's _meta: 400.
    let body = stateless("tools/list", json!({}));
    let r = raw(
        &s.addr,
        &format!(
            "POST /mcp HTTP/1.1\r\n{host}\r\n{auth}\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nMCP-Protocol-Version: 2025-11-25\r\nContent-Length: {}",
            body.len()
        ),
        body.as_bytes(),
    );
    assert_eq!(r.status, 400, "{r:?}");
    // Wrong Accept, wrong Content-Type.
    let r = raw(
        &s.addr,
        &format!(
            "POST /mcp HTTP/1.1\r\n{host}\r\n{auth}\r\nContent-Type: application/json\r\nAccept: text/html\r\nMCP-Protocol-Version: 2026-07-28\r\nMcp-Method: tools/list\r\nContent-Length: {}",
            body.len()
        ),
        body.as_bytes(),
    );
    assert_eq!(r.status, 406, "{r:?}");
    let r = raw(
        &s.addr,
        &format!(
            "POST /mcp HTTP/1.1\r\n{host}\r\n{auth}\r\nContent-Type: text/plain\r\nAccept: application/json, text/event-stream\r\nContent-Length: 2"
        ),
        b"{}",
    );
    assert_eq!(r.status, 415, "{r:?}");
    assert_eq!(d.upstream_tool_calls(), Vec::<String>::new());
}

#[test]
fn a_legacy_session_serves_only_the_principal_that_opened_it() {
    let d = auth_deployment();
    let s = serve_http(&d, "127.0.0.1:0");
    let host = format!("Host: {}", s.addr);
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "raw-test", "version": "1"}}})
    .to_string();
    let post = |token: &str, session: Option<&str>, body: &str| {
        let mut head = format!(
            "POST /mcp HTTP/1.1\r\n{host}\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nContent-Length: {}",
            body.len()
        );
        if let Some(id) = session {
            head.push_str(&format!(
                "\r\nMcp-Session-Id: {id}\r\nMCP-Protocol-Version: 2025-11-25"
            ));
        }
        raw(&s.addr, &head, body.as_bytes())
    };
    let alice = alice();
    let r = post(&alice, None, &init);
    assert_eq!(r.status, 200, "{r:?}");
    let id = r
        .header("mcp-session-id")
        .expect("a session id")
        .to_string();
    let list = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}}).to_string();
    let r = post(&alice, Some(&id), &list);
    assert_eq!(tool_names(&r), ["retrieve_source", "search_sources"]);
    // Another principal's token on alice's session: 403, and nothing served.
    let bob = token(
        "bob",
        json!({"roles": ["analyst"], "airlock_profile": "research"}),
    );
    let r = post(&bob, Some(&id), &list);
    assert_eq!(r.status, 403, "{r:?}");
    assert!(r.body.contains("another principal"), "{r:?}");
    // alice with another profile is another principal too.
    let r = post(
        &token("alice", json!({"roles": ["analyst"]})),
        Some(&id),
        &list,
    );
    assert_eq!(r.status, 403, "{r:?}");
    // A session id this front never issued.
    let r = post(&alice, Some("0123456789abcdef"), &list);
    assert_eq!(r.status, 404, "{r:?}");
    // No token at all on the session.
    let r = raw(
        &s.addr,
        &format!(
            "POST /mcp HTTP/1.1\r\n{host}\r\nMcp-Session-Id: {id}\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nContent-Length: {}",
            list.len()
        ),
        list.as_bytes(),
    );
    assert_eq!(r.status, 401, "{r:?}");
}

/// Legacy sessions end: a principal's third session closes its least recently used one,
/// a session unused for `session_idle` is closed, a `DELETE` ends one; a request for an
/// ended session is 404 (the client initializes again), and each opening and end is
/// traced under the sha256 of the session id, never the id.
#[test]
fn legacy_sessions_end_when_idle_or_crowded_and_each_end_is_traced() {
    use sha2::Digest as _;
    let d = Deployment::with_notes()
        .mapping("source-library")
        .policy(POLICY)
        .top("default_profile = \"searcher\"\n")
        .tables(PROFILES)
        .tables(&auth_tables().replace(
            "[http]\n",
            "[http]\nsession_idle = \"3s\"\nmax_sessions_per_principal = 2\n",
        ));
    d.approve_all();
    let s = serve_http(&d, "127.0.0.1:0");
    let host = format!("Host: {}", s.addr);
    let alice = alice();
    let send = |method: &str, session: Option<&str>, body: &str| {
        let mut head = format!(
            "{method} /mcp HTTP/1.1\r\n{host}\r\nAuthorization: Bearer {alice}\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nContent-Length: {}",
            body.len()
        );
        if let Some(id) = session {
            head.push_str(&format!(
                "\r\nMcp-Session-Id: {id}\r\nMCP-Protocol-Version: 2025-11-25"
            ));
        }
        raw(&s.addr, &head, body.as_bytes())
    };
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "raw-test", "version": "1"}}})
    .to_string();
    let list = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}}).to_string();
    let open = || {
        let r = send("POST", None, &init);
        assert_eq!(r.status, 200, "{r:?}");
        r.header("mcp-session-id").unwrap().to_string()
    };
    let status = |id: &str| send("POST", Some(id), &list).status;
    let (a, b) = (open(), open());
    assert_eq!(status(&a), 200);
    // A third: b, the least recently used, is closed.
    let c = open();
    assert_eq!(status(&b), 404, "evicted");
    assert_eq!((status(&a), status(&c)), (200, 200));
    // A DELETE ends one.
    assert_eq!(send("DELETE", Some(&c), "").status / 100, 2);
    assert_eq!(status(&c), 404, "deleted");
    // Unused for longer than session_idle (3 s; swept every 750 ms): closed.
    std::thread::sleep(Duration::from_millis(4500));
    assert_eq!(status(&a), 404, "idle");

    let digest = |id: &str| hex::encode(sha2::Sha256::digest(id.as_bytes()));
    let trace = d.trace();
    let ended: Vec<(String, String)> = trace
        .iter()
        .filter(|e| e["kind"] == "mcp-session-ended")
        .map(|e| {
            (
                e["subject"].as_str().unwrap().to_string(),
                e["payload"]["why"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        ended,
        [
            (digest(&b), "evicted".to_string()),
            (digest(&c), "deleted".to_string()),
            (digest(&a), "idle".to_string()),
        ]
    );
    let opened = trace
        .iter()
        .filter(|e| e["kind"] == "mcp-session-opened" && e["payload"]["requester"] == "alice")
        .count();
    assert_eq!(opened, 3);
    let text = serde_json::to_string(&trace).unwrap();
    for id in [&a, &b, &c] {
        assert!(!text.contains(id.as_str()), "a session id is never traced");
    }
}

/// Every descendant process of `parent` (through `/proc/*/task/*/children`).
fn descendant_pids(parent: u32) -> Vec<u32> {
    let mut found = vec![parent];
    let mut i = 0;
    while i < found.len() {
        let p = found[i];
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) {
            for t in tasks.flatten() {
                let text = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
                found.extend(
                    text.split_whitespace()
                        .filter_map(|c| c.parse::<u32>().ok()),
                );
            }
        }
        i += 1;
    }
    found.remove(0);
    found
}

/// A session whose answer is still being written is never closed to make room: with
/// both of a principal's sessions waiting on a frozen upstream, a third `initialize` is
/// refused with 429 and `Retry-After`, both waiting calls are answered, and once they
/// are, the third opens (closing the least recently used idle one).
#[test]
fn a_session_with_a_request_in_flight_is_never_closed_to_make_room() {
    let d = Deployment::with_notes()
        .mapping("source-library")
        .policy(POLICY)
        .top("default_profile = \"searcher\"\n")
        .tables(PROFILES)
        .tables(&auth_tables().replace("[http]\n", "[http]\nmax_sessions_per_principal = 2\n"));
    d.approve_all();
    let s = serve_http(&d, "127.0.0.1:0");
    let addr = s.addr.clone();
    let alice = alice();
    let send = move |session: Option<&str>, body: &str| {
        let mut head = format!(
            "POST /mcp HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {alice}\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nContent-Length: {}",
            body.len()
        );
        if let Some(id) = session {
            head.push_str(&format!(
                "\r\nMcp-Session-Id: {id}\r\nMCP-Protocol-Version: 2025-11-25"
            ));
        }
        raw(&addr, &head, body.as_bytes())
    };
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "raw-test", "version": "1"}}})
    .to_string();
    let open = |send: &dyn Fn(Option<&str>, &str) -> Reply| {
        let r = send(None, &init);
        (r.status, r.header("mcp-session-id").map(str::to_string), r)
    };
    let (_, a, _) = open(&send);
    let (_, b, _) = open(&send);
    let (a, b) = (a.unwrap(), b.unwrap());
    let notes = descendant_pids(s.child.id())
        .into_iter()
        .find(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains("notes-server"))
        })
        .expect("the notes server");
    let signal = |sig: &str| {
        assert!(
            std::process::Command::new("kill")
                .args([sig, &notes.to_string()])
                .status()
                .unwrap()
                .success()
        );
    };
    signal("-STOP");
    let waiting: Vec<_> = [(a.clone(), 7), (b.clone(), 8)]
        .into_iter()
        .map(|(id, n)| {
            let send = send.clone();
            std::thread::spawn(move || {
                let call = json!({"jsonrpc": "2.0", "id": n, "method": "tools/call",
                    "params": {"name": "search_sources", "arguments": {"query": "wal"}}})
                .to_string();
                (n, send(Some(&id), &call))
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(1000));
    let (status, id, r) = open(&send);
    assert_eq!(status, 429, "{r:?}");
    assert_eq!(id, None, "no session is kept");
    assert_eq!(r.header("retry-after"), Some("1"), "{r:?}");
    assert!(r.body.contains("request in flight"), "{r:?}");
    for w in waiting {
        let (n, r) = w.join().unwrap();
        assert_eq!(r.status, 200, "{r:?}");
        assert!(
            r.body.contains(&format!("\"id\":{n}")) && r.body.contains("\"result\""),
            "the waiting call {n} is answered: {r:?}"
        );
    }
    signal("-CONT");
    let list = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}}).to_string();
    assert_eq!(
        send(Some(&b), &list).status,
        200,
        "b is now the most recently used"
    );
    let (status, c, r) = open(&send);
    assert_eq!(status, 200, "{r:?}");
    assert_eq!(
        send(Some(&a), &list).status,
        404,
        "the least recently used idle one made room"
    );
    assert_eq!(send(Some(&b), &list).status, 200);
    assert_eq!(send(Some(c.as_deref().unwrap()), &list).status, 200);
}

#[test]
fn without_auth_only_loopback_and_the_configured_requester() {
    let d = Deployment::with_notes()
        .mapping("source-library")
        .tables("[requester]\nname = \"local-user\"\n\n[http]\nallowed_hosts = [\"127.0.0.1\"]\n");
    d.approve_all();
    // A non-loopback address without [http.auth] is refused before anything starts.
    let out = output_within(
        std::process::Command::new(airlock_bin())
            .args(["serve", "--config"])
            .arg(d.write_config())
            .args(["--http", "0.0.0.0:0"])
            .env("AIRLOCK_CACHE_DIR", test_cache_dir())
            .env("AIRLOCK_STATE_DIR", d.state_dir()),
        std::time::Duration::from_secs(60),
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("refusing to serve HTTP on 0.0.0.0:0 without [http.auth]"),
        "{err}"
    );
    let s = serve_http(&d, "127.0.0.1:0");
    // On the SQLite store `serve --http` runs one runtime worker by default.
    assert!(
        s.stderr
            .lock()
            .unwrap()
            .contains("runtime started (--workers) workers=1"),
        "{}",
        s.stderr.lock().unwrap()
    );
    let out = python(&s, "-", "legacy", None);
    assert_eq!(
        out["tools"],
        json!(["retrieve_source", "search_sources"]),
        "{out}"
    );
    assert_eq!(out["retrieve_error"], false, "{out}");
    let out = python(&s, "-", "2026-07-28", None);
    assert_eq!(out["retrieve_error"], false, "{out}");
    // `localhost` is not in this configuration's allowed_hosts.
    let r = raw(&s.addr, "GET /mcp HTTP/1.1\r\nHost: localhost", b"");
    assert_eq!(r.status, 403, "{r:?}");
    // No metadata document without [http.auth].
    let r = raw(
        &s.addr,
        &format!(
            "GET /.well-known/oauth-protected-resource HTTP/1.1\r\nHost: {}",
            s.addr
        ),
        b"",
    );
    assert_eq!(r.status, 404, "{r:?}");
    // Without allowed_origins, a present Origin must still be a loopback one (the spec's
    // MUST): a page on another site that rebinds its name to 127.0.0.1 is refused, and
    // its request reaches nothing (it would be a 404 for this path otherwise).
    let with_origin = |origin: &str| {
        raw(
            &s.addr,
            &format!(
                "GET /nowhere HTTP/1.1\r\nHost: {}\r\nOrigin: {origin}",
                s.addr
            ),
            b"",
        )
    };
    for origin in [
        "http://localhost:5173",
        "http://127.0.0.1",
        "https://[::1]:8443",
        "HTTP://LOCALHOST:3000",
    ] {
        assert_eq!(with_origin(origin).status, 404, "{origin}");
    }
    for origin in [
        "https://evil.test",
        "http://localhost.evil.test",
        "http://127.0.0.1.nip.io:8787",
        "null",
    ] {
        let r = with_origin(origin);
        assert_eq!(r.status, 403, "{origin}: {r:?}");
        assert!(r.body.contains("Origin header is not allowed"), "{r:?}");
    }
    let opened: Vec<Value> = d
        .trace()
        .into_iter()
        .filter(|e| e["kind"] == "session-opened")
        .collect();
    assert_eq!(
        opened.len(),
        1,
        "one session for the one requester: {opened:?}"
    );
    let text = serde_json::to_string(&opened).unwrap();
    assert!(
        text.contains("\"local-user\"") && text.contains("\"http\""),
        "{text}"
    );
}

#[test]
fn without_auth_host_ports_origins_and_policy_are_checked_on_every_request() {
    let policy = "@id(\"use\")\npermit (principal, action == Airlock::Action::\"use-profile\", resource);\n\n@id(\"reads\")\npermit (principal, action == Airlock::Action::\"call\", resource)\nwhen { resource.effect_class == \"read\" };\n";
    let d = Deployment::with_notes()
        .mapping("source-library")
        .policy(policy)
        .tables("[requester]\nname = \"local-user\"\n\n[http]\nallowed_hosts = [\"127.0.0.1:1\", \"localhost\"]\nallowed_origins = [\"http://app.test\", \"http://localhost:*\"]\n");
    d.approve_all();
    let s = serve_http(&d, "127.0.0.1:0");
    // `/nowhere` is answered by this front alone (rmcp never sees it): 404 once the Host
    // and Origin checks pass, 403 when one of them fails.
    let get = |extra: &str| raw(&s.addr, &format!("GET /nowhere HTTP/1.1\r\n{extra}"), b"");
    assert_eq!(get("Host: 127.0.0.1:1").status, 404);
    assert_eq!(get("Host: localhost:4444").status, 404);
    let r = get("Host: 127.0.0.1:2");
    assert_eq!(
        r.status, 403,
        "an entry with a port allows that port only: {r:?}"
    );
    assert!(r.body.contains("Host header is not allowed"), "{r:?}");
    assert_eq!(get("Host: 127.0.0.1").status, 403);
    assert_eq!(
        get("Host: localhost\r\nOrigin: http://app.test").status,
        404
    );
    assert_eq!(
        get("Host: localhost\r\nOrigin: http://localhost:3000").status,
        404
    );
    for origin in [
        "http://evil.test",
        "https://app.test",
        "http://app.test:8080",
        "null",
    ] {
        let r = get(&format!("Host: localhost\r\nOrigin: {origin}"));
        assert_eq!(r.status, 403, "{origin}: {r:?}");
        assert!(r.body.contains("Origin header is not allowed"), "{r:?}");
    }
    // The one fixed session is re-asked use-profile on every request.
    let list = || {
        let body = stateless("tools/list", json!({}));
        raw(
            &s.addr,
            &format!(
                "POST /mcp HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nMCP-Protocol-Version: 2026-07-28\r\nMcp-Method: tools/list\r\nContent-Length: {}",
                body.len()
            ),
            body.as_bytes(),
        )
    };
    assert_eq!(tool_names(&list()), ["retrieve_source", "search_sources"]);
    d.rewrite_policy(&format!(
        "{policy}\n@id(\"no-local\")\nforbid (principal == Airlock::Requester::\"local-user\", action == Airlock::Action::\"use-profile\", resource);\n"
    ));
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let r = list();
        if r.status == 403 {
            assert!(
                r.body
                    .contains("policy does not let requester `local-user` use profile"),
                "{r:?}"
            );
            break;
        }
        assert_eq!(r.status, 200, "{r:?}");
        assert!(
            std::time::Instant::now() < deadline,
            "the reloaded policy never applied: {r:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_cached_session_is_bound_to_the_roles_and_the_body_limit_is_inclusive() {
    let d = auth_deployment();
    let s = serve_http(&d, "127.0.0.1:0");
    let list = |t: &str| post_stateless(&s, Some(t), "tools/list", json!({}), "");
    // alice as an analyst opens (and caches) a research session ...
    assert_eq!(
        tool_names(&list(&alice())),
        ["retrieve_source", "search_sources"]
    );
    // ... which alice without the role does not get: policy is asked for her as she is.
    for roles in [json!([]), json!(["reader"]), Value::Null] {
        let r = list(&token(
            "alice",
            json!({"roles": roles, "airlock_profile": "research"}),
        ));
        assert_eq!(r.status, 403, "{roles}: {r:?}");
        assert!(
            r.body
                .contains("policy does not let requester `alice` use profile `research`"),
            "{r:?}"
        );
    }
    // A body of exactly max_body_bytes is read; one byte more is not.
    let host = format!("Host: {}", s.addr);
    let auth = format!("Authorization: Bearer {}", alice());
    let sized = |n: usize| {
        let mut body = stateless("tools/list", json!({"pad": ""}));
        let pad = n - body.len();
        body = stateless("tools/list", json!({"pad": "x".repeat(pad)}));
        assert_eq!(body.len(), n);
        raw(
            &s.addr,
            &format!(
                "POST /mcp HTTP/1.1\r\n{host}\r\n{auth}\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nMCP-Protocol-Version: 2026-07-28\r\nMcp-Method: tools/list\r\nContent-Length: {n}"
            ),
            body.as_bytes(),
        )
    };
    assert_eq!(
        tool_names(&sized(MAX_BODY)),
        ["retrieve_source", "search_sources"]
    );
    let r = sized(MAX_BODY + 1);
    assert_eq!(r.status, 413, "{r:?}");
    assert!(
        r.body.contains(&format!(
            "Payload Too Large: request body exceeds {MAX_BODY} bytes"
        )),
        "{r:?}"
    );
}

/// One principal in sixteen concurrent sessions over HTTP — eight 2025-11-25 sessions
/// (each with its own references) and eight 2026-07-28 clients (which share the
/// principal's) — each running the research loop (search, search again with another
/// query, then read every hit of the first search) several times with its own queries:
/// not one valid reference is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_principal_in_sixteen_concurrent_sessions_never_loses_a_reference() {
    use rmcp::ServiceExt as _;
    use rmcp::service::{ClientLifecycleMode, ClientServiceExt as _};
    use rmcp::transport::StreamableHttpClientTransport;
    use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
    let d = auth_deployment();
    let s = serve_http(&d, "127.0.0.1:0");
    // reqwest's rustls backend is built without a provider of its own.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let queries = ["checkpoint", "wal", "starvation", "storage", "connections"];
    let mut tasks = Vec::new();
    for worker in 0..16usize {
        let (url, token) = (s.url(), alice());
        tasks.push(tokio::spawn(async move {
            let transport = StreamableHttpClientTransport::with_client(
                reqwest::Client::new(),
                StreamableHttpClientTransportConfig::with_uri(url).auth_header(token),
            );
            let client = if worker % 2 == 0 {
                ().serve(transport).await.expect("2025-11-25 over HTTP")
            } else {
                ().serve_with_lifecycle(
                    transport,
                    ClientLifecycleMode::Discover {
                        preferred_versions: vec![rmcp::model::ProtocolVersion::V_2026_07_28],
                    },
                )
                .await
                .expect("2026-07-28 over HTTP")
            };
            let (mut found, mut failed) = (0, Vec::new());
            for round in 0..6 {
                let first = queries[(worker + round) % queries.len()];
                let second = queries[(worker + round + 1) % queries.len()];
                let (n, f) = research_loop(&client, first, second).await;
                found += n;
                failed.extend(f);
            }
            let _ = client.cancel().await;
            (found, failed)
        }));
    }
    let (mut found, mut failed) = (0, Vec::new());
    for t in tasks {
        let (n, f) = t.await.unwrap();
        found += n;
        failed.extend(f);
    }
    assert!(found > 100, "the searches found notes: {found}");
    assert_eq!(
        failed,
        Vec::<String>::new(),
        "valid references refused ({} of {found}); server log:\n{}",
        failed.len(),
        s.stderr.lock().unwrap()
    );
}
