//! HTTP upstream connections: `[[connection]] url = …` to the notes fixture served over
//! Streamable HTTP on loopback (`airlock fixture notes-server --http 127.0.0.1:0`), through
//! the real `airlock` binary and the source-library adapter.
//!
//! The fixture logs the sha256 of every request's `Authorization` header, so the tests can
//! prove the configured secret arrived (and nothing else did) without the log holding it.

use std::time::{Duration, Instant};

use rmcp::ServiceExt as _;
use rmcp::transport::TokioChildProcess;
use serde_json::{Value, json};
use sha2::Digest as _;

use crate::common::*;

/// The environment variable the tests' `[secrets]` entry reads.
const SECRET_ENV: &str = "AIRLOCK_TEST_HTTP_UPSTREAM_TOKEN";
const SECRET: &str = "s3cret-upstream-token-5d1c";

/// A running `airlock fixture notes-server --http`, killed when dropped.
pub(crate) struct Fixture {
    child: std::process::Child,
    addr: String,
    args: Vec<String>,
}

impl Fixture {
    /// Starts the fixture on `addr` (`127.0.0.1:0` picks a port) with `extra` arguments,
    /// logging to `log`.
    pub(crate) fn start(addr: &str, log: &std::path::Path, extra: &[&str]) -> Self {
        let mut args = vec![
            "fixture".to_string(),
            "notes-server".to_string(),
            "--call-log".to_string(),
            log.display().to_string(),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        Self::spawn(addr, args)
    }

    fn spawn(addr: &str, args: Vec<String>) -> Self {
        use std::io::BufRead as _;
        let mut child = std::process::Command::new(airlock_bin())
            .args(&args)
            .args(["--http", addr])
            .env_clear()
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let url = line
            .trim()
            .strip_prefix("listening ")
            .unwrap_or_else(|| panic!("no listening line: {line:?}"));
        let addr = url
            .strip_prefix("http://")
            .and_then(|u| u.strip_suffix("/mcp"))
            .unwrap()
            .to_string();
        Self { child, addr, args }
    }

    pub(crate) fn url(&self) -> String {
        format!("http://{}/mcp", self.addr)
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts it again on the same port (retrying while the port is not yet free).
    fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if std::net::TcpListener::bind(&self.addr).is_ok() || Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        *self = Self::spawn(&self.addr.clone(), self.args.clone());
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.kill();
    }
}

fn sha256(text: &str) -> String {
    hex::encode(sha2::Sha256::digest(text.as_bytes()))
}

/// The HTTP connection block `notes` to `url`, its Authorization from secret
/// `notes-token`, with `more` TOML lines (e.g. `credential_scope = "x"`).
fn http_connection(url: &str, more: &str) -> String {
    format!(
        "[[connection]]\nname = \"notes\"\nurl = {url:?}\n{more}headers = {{ \"Authorization\" = {{ secret = \"notes-token\", prefix = \"Bearer \" }} }}\n"
    )
}

const SECRETS: &str = "[secrets]\nnotes-token = { env = \"AIRLOCK_TEST_HTTP_UPSTREAM_TOKEN\" }\n";

/// `d` with source-library and its `notes` connection the HTTP fixture at `url`.
fn deployment(d: Deployment, url: &str, more: &str) -> Deployment {
    d.mapping("source-library")
        .replace_connections(&http_connection(url, more))
        .tables(SECRETS)
}

/// `airlock ARGS` on `d` with the secret's variable set to `secret`.
fn airlock_with(d: &Deployment, secret: &str, args: &[&str]) -> std::process::Output {
    std::process::Command::new(airlock_bin())
        .env("AIRLOCK_CACHE_DIR", test_cache_dir())
        .env("AIRLOCK_STATE_DIR", d.state_dir())
        .env(SECRET_ENV, secret)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap()
}

fn ok(out: std::process::Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `airlock discover notes --json` with `secret`.
fn discover(d: &Deployment, secret: &str) -> Value {
    let config = d.write_config();
    let out = airlock_with(
        d,
        secret,
        &[
            "discover",
            "notes",
            "--config",
            config.to_str().unwrap(),
            "--json",
        ],
    );
    serde_json::from_str(&ok(out, "discover")).unwrap()
}

/// Discovers `notes` and approves source-library, with the right secret.
fn approve(d: &Deployment) {
    discover(d, SECRET);
    let config = d.write_config();
    ok(
        airlock_with(
            d,
            SECRET,
            &[
                "review",
                "approve",
                "source-library",
                "--config",
                config.to_str().unwrap(),
                "--reviewer",
                "tests",
            ],
        ),
        "review approve",
    );
}

/// `airlock serve` (stdio) on `d` with `secret`, counting list_changed notices.
async fn serve(
    d: &Deployment,
    secret: &str,
) -> rmcp::service::RunningService<rmcp::service::RoleClient, Notices> {
    let mut cmd = d.serve_command();
    cmd.env(SECRET_ENV, secret);
    Notices::default()
        .serve(TokioChildProcess::new(cmd).unwrap())
        .await
        .expect("MCP initialize with airlock serve")
}

fn names(tools: &[rmcp::model::Tool]) -> Vec<String> {
    tools.iter().map(|t| t.name.to_string()).collect()
}

async fn until_names<H: rmcp::ClientHandler>(
    client: &rmcp::service::RunningService<rmcp::service::RoleClient, H>,
    secs: u64,
    want: impl Fn(&[String]) -> bool,
) -> (bool, Vec<String>) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let got = client
            .peer()
            .list_all_tools()
            .await
            .map(|t| names(&t))
            .unwrap_or_default();
        if want(&got) || Instant::now() > deadline {
            return (want(&got), got);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn connection_states(d: &Deployment) -> Vec<(String, String)> {
    d.trace()
        .iter()
        .filter(|e| e["kind"] == "connection-state" && e["subject"] == "notes")
        .map(|e| {
            (
                e["payload"]["to"].as_str().unwrap_or_default().to_string(),
                e["payload"]["reason"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
        })
        .collect()
}

/// The `authorization_sha256` of every HTTP request the fixture logged.
fn authorizations(d: &Deployment) -> Vec<Value> {
    d.upstream_calls()
        .iter()
        .filter(|c| c.get("http").is_some())
        .map(|c| c["authorization_sha256"].clone())
        .collect()
}

#[tokio::test]
async fn an_http_upstream_lists_and_calls_through_the_notes_adapter_with_its_secret() {
    let d = Deployment::with_notes();
    let fixture = Fixture::start(
        "127.0.0.1:0",
        &d.dir.path().join("calls.jsonl"),
        &["--require-bearer", SECRET],
    );
    let d = deployment(d, &fixture.url(), "credential_scope = \"notes-ro\"\n");
    let report = discover(&d, SECRET);
    assert_eq!(
        report["protocol_version"], "2026-07-28",
        "Auto negotiated the 2026-07-28 generation: {report}"
    );
    assert_eq!(report["counts"]["tools"], 3, "{report}");
    approve(&d);
    let client = serve(&d, SECRET).await;
    let tools = client.peer().list_all_tools().await.unwrap();
    assert_eq!(names(&tools), ["retrieve_source", "search_sources"]);
    let hits = call(&client, "search_sources", json!({"query": "checkpoint"}))
        .await
        .unwrap();
    assert_ne!(hits.is_error, Some(true), "{}", text_of(&hits));
    let refs = references(&hits);
    assert!(!refs.is_empty());
    let passage = call(&client, "retrieve_source", json!({"reference": refs[0]}))
        .await
        .unwrap();
    assert_ne!(passage.is_error, Some(true), "{}", text_of(&passage));
    let s = passage.structured_content.as_ref().unwrap();
    assert_eq!(s["provenance"][0]["connection"], "notes");
    assert_eq!(s["provenance"][0]["target"], "read_note");
    client.cancel().await.unwrap();

    assert_eq!(d.upstream_tool_calls(), ["search_notes", "read_note"]);
    // Every request carried the secret, and nothing else.
    let auth = authorizations(&d);
    assert!(auth.len() >= 10, "{auth:?}");
    let want = Value::String(sha256(&format!("Bearer {SECRET}")));
    assert!(auth.iter().all(|a| *a == want), "{auth:?}");
    // The secret's value is nowhere a reviewer or the trace can read.
    let trace = serde_json::to_string(&d.trace()).unwrap();
    assert!(trace.contains("connection-revision"), "{trace}");
    assert!(!trace.contains(SECRET), "the trace holds the secret");
    let show = d.airlock_ok(&["review", "show", "source-library", "--json"]);
    assert!(!show.contains(SECRET), "{show}");
    let snapshots = d.airlock_ok(&["snapshots", "list", "--json"]);
    assert!(!snapshots.contains(SECRET), "{snapshots}");
    let db = std::fs::read(d.state_dir().join("airlock.db")).unwrap();
    assert!(
        !String::from_utf8_lossy(&db).contains(SECRET),
        "the store holds the secret"
    );
}

#[tokio::test]
async fn a_legacy_http_upstream_is_reached_with_initialize() {
    let d = Deployment::with_notes();
    let fixture = Fixture::start(
        "127.0.0.1:0",
        &d.dir.path().join("calls.jsonl"),
        &["--legacy-only"],
    );
    let d = deployment(d, &fixture.url(), "");
    let report = discover(&d, SECRET);
    assert_eq!(report["protocol_version"], "2025-11-25", "{report}");
    let methods: Vec<String> = d
        .upstream_calls()
        .iter()
        .filter_map(|c| c["method"].as_str().map(str::to_string))
        .collect();
    assert!(
        methods.starts_with(&["server/discover".to_string(), "initialize".to_string()]),
        "probed with server/discover, fell back to initialize: {methods:?}"
    );
    approve(&d);
    let client = serve(&d, SECRET).await;
    let hits = call(&client, "search_sources", json!({"query": "checkpoint"}))
        .await
        .unwrap();
    assert_ne!(hits.is_error, Some(true), "{}", text_of(&hits));
    assert_eq!(d.upstream_tool_calls(), ["search_notes"]);
    client.cancel().await.unwrap();
}

/// A server that answers `server/discover` with an empty result (the conformance suite's
/// 2025-11-25 server does) is not either generation to rmcp's Auto probe: Airlock asks
/// again with `initialize` alone.
#[tokio::test]
async fn a_server_answering_discover_with_an_empty_result_is_asked_again_with_initialize() {
    let d = Deployment::with_notes();
    let fixture = Fixture::start(
        "127.0.0.1:0",
        &d.dir.path().join("calls.jsonl"),
        &["--discover-empty"],
    );
    let d = deployment(d, &fixture.url(), "");
    // After the empty discover answer Airlock opens the connection again with
    // `initialize`; `notifications/initialized` must reach the server before the
    // discovery's `tools/list` (the HTTP bridge once let them overtake each other: rmcp's
    // client then posted `tools/list` where it waited for `initialized` and quit, in 3 of
    // 40 runs on a busy machine, and this discover failed).
    let config = d.write_config();
    let out = airlock_with(
        &d,
        SECRET,
        &[
            "discover",
            "notes",
            "--config",
            config.to_str().unwrap(),
            "--json",
        ],
    );
    let report: Value = serde_json::from_str(&ok(out, "discover")).unwrap();
    assert_eq!(report["counts"]["tools"], 3, "{report}");
    assert_ne!(report["protocol_version"], "", "{report}");
    let methods: Vec<String> = d
        .upstream_calls()
        .iter()
        .filter_map(|c| c["method"].as_str().map(str::to_string))
        .collect();
    assert!(
        methods.starts_with(&["server/discover".to_string(), "initialize".to_string()]),
        "{methods:?}"
    );
}

#[tokio::test]
async fn without_its_secret_the_http_connection_is_down_and_the_others_serve() {
    let d = Deployment::with_notes();
    let fixture = Fixture::start(
        "127.0.0.1:0",
        &d.dir.path().join("calls.jsonl"),
        &["--require-bearer", SECRET],
    );
    let d = deployment(d, &fixture.url(), "").with_outbox(&[]);
    approve(&d);
    let config = d.write_config();
    ok(
        airlock_with(
            &d,
            SECRET,
            &["discover", "outbox", "--config", config.to_str().unwrap()],
        ),
        "discover outbox",
    );
    ok(
        airlock_with(
            &d,
            SECRET,
            &[
                "review",
                "approve",
                "outbox-delivery",
                "--config",
                config.to_str().unwrap(),
                "--reviewer",
                "tests",
            ],
        ),
        "approve outbox",
    );
    // A rotated (here: wrong) secret value is the same configuration revision: nothing
    // needs review, but the server refuses it.
    let wrong = "wrong-token-9a8b";
    let client = serve(&d, wrong).await;
    let (ok_names, got) =
        until_names(&client, 10, |n| n.contains(&"deliver_artifact".to_string())).await;
    assert!(ok_names, "{got:?}");
    assert!(
        !got.contains(&"search_sources".to_string()),
        "the refused connection offers nothing: {got:?}"
    );
    let states = connection_states(&d);
    let down = states
        .iter()
        .find(|(to, _)| to == "disconnected")
        .unwrap_or_else(|| panic!("{states:?}"));
    assert!(
        down.1.contains("server/discover") && down.1.contains("Auth required"),
        "the reason says the server wants a credential: {}",
        down.1
    );
    assert!(!down.1.contains(wrong), "{}", down.1);
    client.cancel().await.unwrap();
    let want = Value::String(sha256(&format!("Bearer {wrong}")));
    assert!(authorizations(&d).contains(&want));
    assert!(d.upstream_tool_calls().is_empty());
}

#[tokio::test]
async fn a_killed_http_upstream_leaves_the_list_and_comes_back_on_the_same_port() {
    let d = Deployment::with_notes();
    let mut fixture = Fixture::start("127.0.0.1:0", &d.dir.path().join("calls.jsonl"), &[]);
    let d = deployment(d, &fixture.url(), "");
    approve(&d);
    let client = serve(&d, SECRET).await;
    let notices = client.service().clone();
    assert_eq!(
        names(&client.peer().list_all_tools().await.unwrap()),
        ["retrieve_source", "search_sources"]
    );
    let seen = notices.count();
    fixture.kill();
    assert!(
        notices.wait_beyond(seen, 20).await,
        "the client is told the list changed (the bridge's ping noticed)"
    );
    let (gone, got) = until_names(&client, 5, |n| n.is_empty()).await;
    assert!(gone, "{got:?}");
    fixture.restart();
    let (back, got) =
        until_names(&client, 30, |n| n == ["retrieve_source", "search_sources"]).await;
    assert!(back, "{got:?}");
    let hits = call(&client, "search_sources", json!({"query": "checkpoint"}))
        .await
        .unwrap();
    assert_ne!(hits.is_error, Some(true), "{}", text_of(&hits));
    client.cancel().await.unwrap();
    let states: Vec<String> = connection_states(&d).into_iter().map(|s| s.0).collect();
    // Restarts that found the port still closed add more `disconnected` in between.
    let mut dedup = states.clone();
    dedup.dedup();
    assert_eq!(
        dedup,
        ["connecting", "ready", "disconnected", "ready", "stopped"],
        "{states:?}"
    );
    assert!(
        d.trace()
            .iter()
            .any(|e| e["kind"] == "connection-restarted" && e["subject"] == "notes")
    );
}

#[tokio::test]
async fn identity_is_url_and_credential_scope_never_the_secret_value() {
    let d = Deployment::with_notes();
    let fixture = Fixture::start("127.0.0.1:0", &d.dir.path().join("calls.jsonl"), &[]);
    let other = Fixture::start("127.0.0.1:0", &d.dir.path().join("other.jsonl"), &[]);
    let d = deployment(d, &fixture.url(), "credential_scope = \"ro\"\n");
    let first = discover(&d, SECRET);
    let rotated = discover(&d, "another-value");
    assert_eq!(first["config_revision"], rotated["config_revision"]);
    assert_eq!(rotated["new_revision"], false, "{rotated}");
    approve(&d);

    // A new credential scope is a new revision: the approved mapping does not serve.
    let d = d.replace_connections(&http_connection(
        &fixture.url(),
        "credential_scope = \"rw\"\n",
    ));
    let rescoped = discover(&d, SECRET);
    assert_eq!(rescoped["new_revision"], true, "{rescoped}");
    assert_eq!(rescoped["connection_id"], first["connection_id"]);
    let client = serve(&d, SECRET).await;
    let tools = client.peer().list_all_tools().await.unwrap();
    assert!(names(&tools).is_empty(), "{:?}", names(&tools));
    client.cancel().await.unwrap();

    // So is a new URL.
    let d = d.replace_connections(&http_connection(
        &other.url(),
        "credential_scope = \"ro\"\n",
    ));
    let moved = discover(&d, SECRET);
    assert_eq!(moved["new_revision"], true, "{moved}");
    assert_ne!(moved["config_revision"], first["config_revision"]);
    let revisions: Vec<Value> = d
        .trace()
        .into_iter()
        .filter(|e| e["kind"] == "connection-revision")
        .collect();
    assert_eq!(revisions.len(), 3, "{revisions:?}");
}

/// `airlock grants MANIFEST --config FILE` for an HTTP connection shows what the host's own
/// connection may reach (the URL's host and port, no redirect, no proxy, the secret
/// headers only there), never a secret's value; plain http:// to a host that is not
/// loopback is FLAGGED (exit status 2), https is not. No server runs: review reads only.
#[test]
fn grants_with_config_shows_what_the_hosts_connection_to_an_http_server_reaches() {
    // Review reads the configuration (its secret resolves); no state folder.
    let review = |args: &[&str]| {
        std::process::Command::new(airlock_bin())
            .env_remove("AIRLOCK_STATE_DIR")
            .env_remove("AIRLOCK_LOG")
            .env(SECRET_ENV, SECRET)
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap()
    };
    let grants = |d: &Deployment, json: bool| {
        let config = d.write_config();
        let manifest = d.manifests()[0].display().to_string();
        let mut args = vec!["grants", &manifest, "--config", config.to_str().unwrap()];
        if json {
            args.push("--json");
        }
        let out = review(&args);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!stdout.contains(SECRET), "a secret value leaked: {stdout}");
        assert!(!stderr.contains(SECRET), "a secret value leaked: {stderr}");
        (out.status.code(), stdout, stderr)
    };
    let tail =
        "redirects refused (a 3xx is a failure); no proxy, not even one from the environment";

    let d = deployment(Deployment::with_notes(), "https://mcp.example.com/mcp", "");
    let (code, text, stderr) = grants(&d, false);
    assert_eq!(code, Some(0), "{text}{stderr}");
    assert!(
        text.contains(&format!(
            "    host's connection    network: https://mcp.example.com:443 only (the URL's host and port; a name reaches any address it resolves to); {tail}\n"
        )),
        "{text}"
    );
    assert!(
        text.contains(
            "                         credentials: Authorization (secret `notes-token`) sent only to https://mcp.example.com:443; values never shown\n"
        ),
        "{text}"
    );
    assert!(!text.contains("FLAGGED"), "{text}");
    let (code, json, _) = grants(&d, true);
    assert_eq!(code, Some(0));
    let v: Value = serde_json::from_str(&json).unwrap();
    let c = &v["connection"];
    assert_eq!(c["transport"], "streamable-http");
    assert_eq!(c["insecure_http"], false);
    assert_eq!(c["confinement"], json!([]));
    assert_eq!(
        c["host_connection"],
        json!([
            format!(
                "network: https://mcp.example.com:443 only (the URL's host and port; a name reaches any address it resolves to); {tail}"
            ),
            "credentials: Authorization (secret `notes-token`) sent only to https://mcp.example.com:443; values never shown",
        ])
    );

    // Plain http:// to a host that is not loopback: allowed by the configuration, FLAGGED
    // in review.
    let d = deployment(
        Deployment::with_notes(),
        "http://10.1.2.3:8080/mcp",
        "allow_insecure_http = true\n",
    );
    let (code, text, stderr) = grants(&d, false);
    assert_eq!(code, Some(2), "{text}{stderr}");
    assert!(
        text.contains(&format!(
            "    host's connection    network: http://10.1.2.3:8080 only (the URL's host and port; a name reaches any address it resolves to), UNENCRYPTED: plain http:// to a host that is not loopback (`allow_insecure_http = true`); {tail}\n"
        )),
        "{text}"
    );
    assert!(
        text.contains(
            "credentials: Authorization (secret `notes-token`) sent only to http://10.1.2.3:8080, UNENCRYPTED; values never shown\n"
        ),
        "{text}"
    );
    assert!(
        text.contains(
            "  FLAGGED   the host reaches the connection's server UNENCRYPTED (`allow_insecure_http = true`, plain http:// to a host that is not loopback)"
        ),
        "{text}"
    );
    assert!(
        text.contains("FLAGGED: the host reaches the connection's server unencrypted"),
        "{text}"
    );
    assert!(
        stderr.contains("unencrypted (allow_insecure_http)"),
        "{stderr}"
    );
    let (code, json, _) = grants(&d, true);
    assert_eq!(code, Some(2));
    let v: Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["connection"]["insecure_http"], true);
    assert_eq!(
        v["connection"]["host_connection"][1],
        "credentials: Authorization (secret `notes-token`) sent only to http://10.1.2.3:8080, UNENCRYPTED; values never shown"
    );
    let config = d.write_config();
    let manifest = d.manifests()[0].display().to_string();
    let out = review(&[
        "grants",
        &manifest,
        "--config",
        config.to_str().unwrap(),
        "--allow-flagged",
    ]);
    assert_eq!(out.status.code(), Some(0));
}

#[test]
fn hostile_http_connections_are_refused_at_load_with_the_connection_named() {
    let cases = [
        (
            "[[connection]]\nname = \"notes\"\nurl = \"http://10.1.2.3/mcp\"\n".to_string(),
            "allow_insecure_http = true",
        ),
        (
            "[[connection]]\nname = \"notes\"\nurl = \"https://a.example/mcp\"\ncommand = \"@airlock\"\n".into(),
            "not both",
        ),
        (
            "[[connection]]\nname = \"notes\"\nurl = \"https://a.example/mcp\"\nargs = [\"x\"]\n".into(),
            "`args` applies only",
        ),
        (
            "[[connection]]\nname = \"notes\"\nurl = \"https://a.example/mcp\"\nheaders = { \"Authorization\" = { value = \"Bearer literal\" } }\n".into(),
            "named secret",
        ),
        (
            "[[connection]]\nname = \"notes\"\nurl = \"https://a.example/mcp\"\nheaders = { \"Authorization\" = { secret = \"missing\" } }\n".into(),
            "does not define",
        ),
    ];
    for (block, needle) in cases {
        let d = Deployment::with_notes()
            .mapping("source-library")
            .replace_connections(&block);
        let (success, stderr) = d.serve_expecting_failure();
        assert!(!success, "{block}");
        assert!(stderr.contains(needle), "{block}: {stderr}");
        assert!(stderr.contains("connection `notes`"), "{stderr}");
        assert!(!stderr.contains("Bearer literal"), "{stderr}");
    }
}

/// `airlock serve --http` with `[http.auth]` in front, an HTTP upstream behind: the
/// model-facing client's bearer token authenticates it to Airlock and goes no further;
/// the upstream sees only the configured secret.
#[tokio::test]
async fn the_front_token_never_reaches_an_http_upstream() {
    use jsonwebtoken::{Algorithm, EncodingKey, Header};
    use rmcp::transport::StreamableHttpClientTransport;
    use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
    use std::io::BufRead as _;

    const ISSUER: &str = "https://issuer.test";
    const AUDIENCE: &str = "http://airlock.test/mcp";
    let d = Deployment::with_notes();
    let fixture = Fixture::start(
        "127.0.0.1:0",
        &d.dir.path().join("calls.jsonl"),
        &["--require-bearer", SECRET],
    );
    let d = deployment(d, &fixture.url(), "").tables(&format!(
        "[http.auth]\nissuer = \"{ISSUER}\"\naudience = \"{AUDIENCE}\"\njwks_file = {:?}\nrequired_scopes = [\"mcp\"]\n",
        workspace()
            .join("fixtures/jwt/jwks.json")
            .display()
            .to_string()
    ));
    approve(&d);
    let now = jsonwebtoken::get_current_timestamp() as i64;
    let claims = json!({
        "iss": ISSUER, "aud": AUDIENCE, "sub": "alice",
        "iat": now, "exp": now + 600, "scope": "mcp",
    });
    let der = std::fs::read(workspace().join("fixtures/jwt/issuer.pk8.der")).unwrap();
    let mut header = Header::new(Algorithm::ES256);
    header.kid = Some("test-issuer-1".into());
    let jwt = jsonwebtoken::encode(&header, &claims, &EncodingKey::from_ec_der(&der)).unwrap();

    let config = d.write_config();
    let mut child = std::process::Command::new(airlock_bin())
        .args(["serve", "--config", config.to_str().unwrap(), "--http"])
        .arg("127.0.0.1:0")
        .env("AIRLOCK_LOG", "airlock=info")
        .env("AIRLOCK_CACHE_DIR", test_cache_dir())
        .env("AIRLOCK_STATE_DIR", d.state_dir())
        .env(SECRET_ENV, SECRET)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let log_w = log.clone();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines() {
            let Ok(line) = line else { return };
            if let Some(url) = line.strip_prefix("airlock: serving MCP over HTTP at ") {
                let _ = tx.send(url.trim().to_string());
            }
            log_w.lock().unwrap().push_str(&(line + "\n"));
        }
    });
    let front = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("airlock serve --http did not start");
    // reqwest's rustls backend is built without a provider of its own.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let transport = StreamableHttpClientTransport::with_client(
        reqwest::Client::new(),
        StreamableHttpClientTransportConfig::with_uri(front).auth_header(jwt.clone()),
    );
    let client = ().serve(transport).await.expect("MCP over HTTP to airlock");
    let hits = call(&client, "search_sources", json!({"query": "checkpoint"}))
        .await
        .unwrap();
    assert_ne!(hits.is_error, Some(true), "{}", text_of(&hits));
    let _ = client.cancel().await;
    let _ = child.kill();
    let _ = child.wait();

    assert_eq!(d.upstream_tool_calls(), ["search_notes"]);
    let auth = authorizations(&d);
    let secret = Value::String(sha256(&format!("Bearer {SECRET}")));
    let front_token = Value::String(sha256(&format!("Bearer {jwt}")));
    assert!(!auth.is_empty());
    assert!(
        !auth.contains(&front_token),
        "the front's token was forwarded"
    );
    assert!(auth.iter().all(|a| *a == secret), "{auth:?}");
    let log = log.lock().unwrap();
    assert!(!log.contains(SECRET), "the log holds the upstream secret");
    drop(fixture);
}

/// The official conformance suite's client scenarios (`@modelcontextprotocol/conformance`
/// 0.1.16, `client --suite all`) with Airlock's upstream client under test
/// (`airlock discover` against each scenario server, fixtures/conformance/
/// upstream-client.sh), checked against fixtures/conformance/
/// expected-failures-upstream-client.yml: an unexpected failure or a listed scenario that
/// now passes fails the test.
#[test]
fn the_conformance_client_scenarios_match_their_baseline() {
    let modules = node_modules();
    let node = modules.join("node/bin/node");
    let entry = modules.join("@modelcontextprotocol/conformance/dist/index.js");
    assert!(
        node.is_file() && entry.is_file(),
        "the conformance suite or Node 22 is not installed: run `npm ci --prefix fixtures/npm`"
    );
    let out = tempfile::tempdir().unwrap();
    let script = workspace().join("fixtures/conformance/upstream-client.sh");
    let output = std::process::Command::new(node)
        .arg(entry)
        .args(["client", "--suite", "all", "--command"])
        .arg(&script)
        .arg("--expected-failures")
        .arg(workspace().join("fixtures/conformance/expected-failures-upstream-client.yml"))
        .arg("-o")
        .arg(out.path())
        .env("NO_COLOR", "1")
        .env("AIRLOCK_BIN", airlock_bin())
        .env("AIRLOCK_CACHE_DIR", test_cache_dir())
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let summary: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with('✓') || l.starts_with('✗') || l.starts_with("Total:"))
        .collect();
    eprintln!("conformance client scenarios:\n{}", summary.join("\n"));
    assert!(
        output.status.success() && text.contains("Baseline check passed"),
        "{text}"
    );
    assert!(
        summary
            .iter()
            .any(|l| l.starts_with("✓ auth/resource-mismatch")),
        "{text}"
    );
}

/// OpenTelemetry spans (issue 32) on the HTTP front and toward an HTTP upstream: the
/// front takes the `traceparent` header when `_meta` carries none, `_meta` wins over the
/// header, a malformed header is ignored; the upstream's request carries Airlock's client
/// span as its parent in `_meta` over Streamable HTTP. Spans are decoded by a real OTLP
/// receiver ([`crate::common::otlp`]).
#[test]
fn spans_follow_the_http_header_or_meta_and_reach_an_http_upstream() {
    use crate::common::otlp::{self, Receiver};
    use crate::http::{post_stateless, serve_http};
    const HEADER: &str = "11111111111111111111111111111111";
    const META: &str = "22222222222222222222222222222222";
    const LISTED: &str = "33333333333333333333333333333333";
    const PARENT: &str = "0102030405060708";
    let receiver = Receiver::start();
    let d = Deployment::with_notes();
    let fixture = Fixture::start("127.0.0.1:0", &d.dir.path().join("calls.jsonl"), &[]);
    let d = d
        .mapping("source-library")
        .replace_connections(&format!(
            "[[connection]]\nname = \"notes\"\nurl = {:?}\n",
            fixture.url()
        ))
        .tables(&format!("[telemetry]\notlp = {:?}\n", receiver.url()));
    d.approve_all();
    let served = serve_http(&d, "127.0.0.1:0");
    let search = json!({"name": "search_sources", "arguments": {"query": "checkpoint"}});
    let header = |trace: &str| format!("\r\ntraceparent: 00-{trace}-{PARENT}-01");
    // The header alone.
    let r = post_stateless(&served, None, "tools/call", search.clone(), &header(HEADER));
    assert_eq!(r.message()["result"]["isError"], false, "{r:?}");
    // `_meta` and the header: `_meta` wins.
    let mut with_meta = search.clone();
    with_meta["_meta"] = json!({"traceparent": format!("00-{META}-{PARENT}-01")});
    let r = post_stateless(&served, None, "tools/call", with_meta, &header(HEADER));
    assert_eq!(r.message()["result"]["isError"], false, "{r:?}");
    // A malformed header: a new trace, the call runs.
    let r = post_stateless(
        &served,
        None,
        "tools/call",
        search,
        "\r\ntraceparent: 00-zz-yy-01",
    );
    assert_eq!(r.message()["result"]["isError"], false, "{r:?}");
    let r = post_stateless(&served, None, "tools/list", json!({}), &header(LISTED));
    assert!(r.message()["result"]["tools"].is_array(), "{r:?}");

    let spans = receiver.until("three calls and a list", |spans| {
        spans.iter().filter(|s| s.kind == otlp::SERVER).count() >= 4
    });
    let server = |trace: &str| {
        spans
            .iter()
            .find(|s| s.kind == otlp::SERVER && s.trace_id == trace)
            .unwrap_or_else(|| panic!("no server span on {trace}: {spans:#?}"))
    };
    let upstream: Vec<Value> = d
        .upstream_calls()
        .into_iter()
        .filter(|c| c["method"] == "tools/call")
        .collect();
    assert_eq!(upstream.len(), 3, "{upstream:?}");
    let roots: Vec<_> = spans
        .iter()
        .filter(|s| s.kind == otlp::SERVER && s.parent.is_empty())
        .collect();
    assert_eq!(
        roots.len(),
        1,
        "only the malformed header starts a trace: {roots:#?}"
    );
    for (trace, logged) in [
        (HEADER, &upstream[0]),
        (META, &upstream[1]),
        (roots[0].trace_id.as_str(), &upstream[2]),
    ] {
        let call = server(trace);
        assert_eq!(call.name, "tools/call search_sources");
        assert_eq!(call.attr("network.transport"), Some("tcp"));
        assert_eq!(call.attr("mcp.protocol.version"), Some("2026-07-28"));
        if trace != roots[0].trace_id {
            assert_eq!(call.parent, PARENT);
        }
        let execute = spans
            .iter()
            .find(|s| s.parent == call.span_id && s.name == "execute")
            .unwrap_or_else(|| panic!("no execute span under {call:#?}"));
        let client = spans
            .iter()
            .find(|s| s.parent == execute.span_id && s.kind == otlp::CLIENT)
            .unwrap_or_else(|| panic!("no client span under {execute:#?}"));
        assert_eq!(client.name, "tools/call search_notes");
        assert_eq!(client.attr("network.transport"), Some("tcp"));
        assert_eq!(
            logged["traceparent"],
            format!("00-{trace}-{}-01", client.span_id),
            "the HTTP upstream continues Airlock's client span: {logged}"
        );
    }
    let listed = server(LISTED);
    assert_eq!(listed.name, "tools/list");
    assert_eq!(listed.attr("mcp.method.name"), Some("tools/list"));
    assert_eq!(listed.parent, PARENT);
}
