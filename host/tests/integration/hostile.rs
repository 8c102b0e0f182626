//! Containment: the `hostile` fixture adapter attacks its sandbox, one attack per test,
//! through a real `airlock serve`. Each test checks that the attack is contained (the
//! adapter's own report is an error, or the host stops the call with the right category)
//! and that the host keeps serving afterwards: the same adapter answers again, in a fresh
//! instance, and so does its neighbour, `source-library`.
//!
//! The adapter reports what happened as one hit titled e.g. `read ok: ...`,
//! `connected: ...` or `error: <io error kind>: ...` (see
//! fixtures/adapters/hostile/src/lib.rs).

use std::io::Read as _;
use std::net::{TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::common::*;
use airlock::pipeline::Category;
use rmcp::model::CallToolResult;
use rmcp::service::{RoleClient, RunningService};
use serde_json::{Value, json};

type Client = RunningService<RoleClient, ()>;

/// Longest any single call may take before the test calls the host hung.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// The bundled `hostile` manifest with its empty `[grants]` line replaced by `grants`.
fn with_grants(manifest: &str, grants: &str) -> String {
    assert!(
        manifest.contains("\n[grants]\n"),
        "the hostile manifest has an empty [grants] line:\n{manifest}"
    );
    if grants.is_empty() {
        return manifest.to_owned();
    }
    manifest.replacen("\n[grants]\n", &format!("\n{grants}\n"), 1)
}

/// A deployment of `hostile` (with `grants`) and `source-library`, both over `notes`.
fn deploy(d: Deployment, grants: &str) -> Deployment {
    let grants = grants.to_owned();
    d.mapping_edited("hostile", move |t| with_grants(&t, &grants))
        .mapping("source-library")
}

/// A deployment with no grants at all.
fn deploy_bare() -> Deployment {
    deploy(Deployment::with_notes(), "")
}

/// Runs `hostile_search` with `query` (bounded by [`CALL_TIMEOUT`]).
async fn attack(client: &Client, query: &str) -> CallToolResult {
    let result = tokio::time::timeout(
        CALL_TIMEOUT,
        call(client, "hostile_search", json!({ "query": query })),
    )
    .await
    .unwrap_or_else(|_| panic!("`{query}`: the host did not answer within {CALL_TIMEOUT:?}"))
    .unwrap_or_else(|e| panic!("`{query}`: the call failed at the protocol level: {e}"));
    eprintln!(
        "hostile_search `{query}` -> is_error={:?}: {}",
        result.is_error,
        result
            .structured_content
            .as_ref()
            .map_or_else(|| text_of(&result), |s| s["result"].to_string())
            .chars()
            .take(300)
            .collect::<String>()
    );
    result
}

/// The adapter's one-line report of an attack that returned.
async fn outcome(client: &Client, query: &str) -> String {
    let result = attack(client, query).await;
    assert_ne!(
        result.is_error,
        Some(true),
        "`{query}` was expected to return a report, got a tool error: {}",
        text_of(&result)
    );
    let s = result.structured_content.as_ref().unwrap();
    let hits = s["result"].as_array().unwrap();
    assert_eq!(hits.len(), 1, "{s}");
    hits[0]["title"].as_str().unwrap().to_owned()
}

/// The host's tool-error text for an attack that the host had to stop.
async fn stopped(client: &Client, query: &str, category: Category) -> String {
    let result = attack(client, query).await;
    let text = assert_refused(&result, category);
    assert!(
        text.len() < 2000,
        "the error is short: {} bytes: {}",
        text.len(),
        &text[..200]
    );
    text
}

/// Deploys `hostile` without grants, runs `query` (which the host must stop), checks the
/// host still serves afterwards and recorded the containment in the trace, and returns the
/// model-facing error text.
async fn stopped_bare(query: &str, category: Category) -> String {
    let d = deploy_bare();
    let client = d.serve().await;
    let text = stopped(&client, query, category).await;
    assert_still_serving(&client).await;
    client.cancel().await.unwrap();
    assert_traced_containment(&d, query);
    text
}

/// The trace holds a `call-contained` event for the hostile mapping, and still verifies.
fn assert_traced_containment(d: &Deployment, query: &str) {
    let events = d.trace();
    let contained: Vec<_> = events
        .iter()
        .filter(|e| e["kind"] == "call-contained" && e["payload"]["mapping"] == "hostile")
        .collect();
    assert_eq!(contained.len(), 1, "`{query}`: {events:#?}");
    assert!(contained[0]["payload"]["failure"].is_string());
    assert!(
        !contained[0]["payload"].to_string().contains(query),
        "the trace keeps no payloads: {}",
        contained[0]["payload"]
    );
    assert!(d.airlock_ok(&["trace", "verify"]).contains("intact"));
}

/// Asserts that an attack's report is an error (the attack was contained).
fn assert_contained(query: &str, title: &str) {
    assert!(
        title.starts_with("error: ") || title.starts_with("bind error: "),
        "`{query}` was not contained: {title}"
    );
}

/// The host still serves: the hostile adapter answers in a fresh instance, and the
/// neighbouring `source-library` mapping searches the notes server.
async fn assert_still_serving(client: &Client) {
    let pong = outcome(client, "ping").await;
    assert_eq!(pong, "pong");
    let hits = tokio::time::timeout(
        CALL_TIMEOUT,
        call(client, "search_sources", json!({ "query": "checkpoint" })),
    )
    .await
    .expect("search_sources answered in time")
    .expect("search_sources call");
    assert_ne!(hits.is_error, Some(true), "{}", text_of(&hits));
    assert!(!references(&hits).is_empty(), "{}", text_of(&hits));
}

/// A folder tree for filesystem attacks, inside the deployment's temporary folder:
/// `fs/data/inside.txt` (granted), `fs/outside.txt` (not granted) and symlinks in `data`
/// pointing at it.
struct Tree {
    data: PathBuf,
    outside: PathBuf,
}

const INSIDE: &str = "inside: the granted folder's content\n";
const OUTSIDE: &str = "SECRET-OUTSIDE-THE-GRANT\n";

fn tree(root: &Path) -> Tree {
    let fs_root = root.join("fs");
    let data = fs_root.join("data");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("inside.txt"), INSIDE).unwrap();
    let outside = fs_root.join("outside.txt");
    std::fs::write(&outside, OUTSIDE).unwrap();
    std::os::unix::fs::symlink(&outside, data.join("link-out")).unwrap();
    std::os::unix::fs::symlink("../outside.txt", data.join("link-rel")).unwrap();
    Tree {
        data: data.canonicalize().unwrap(),
        outside,
    }
}

fn fs_grant(data: &Path, access: &str) -> String {
    format!(
        "[[grants.filesystem]]\nhost = {:?}\nguest = \"/data\"\naccess = \"{access}\"\n",
        data.display().to_string()
    )
}

/// A deployment whose `hostile` mapping is granted `fs/data` at `/data` with `access`.
fn deploy_fs(access: &str) -> (Deployment, Tree) {
    let d = Deployment::with_notes();
    let t = tree(d.dir.path());
    let grants = fs_grant(&t.data, access);
    (deploy(d, &grants), t)
}

// ---------------------------------------------------------------------------------------
// Filesystem

#[tokio::test]
async fn fs_dotdot_cannot_leave_the_granted_folder() {
    let (d, t) = deploy_fs("read-only");
    assert!(t.outside.is_file());
    let client = d.serve().await;
    let title = outcome(&client, "fs-dotdot").await;
    assert_contained("fs-dotdot", &title);
    assert!(!title.contains("SECRET"), "{title}");
    assert_still_serving(&client).await;
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn fs_absolute_host_paths_are_not_visible() {
    let (d, t) = deploy_fs("read-only");
    let client = d.serve().await;
    let title = outcome(&client, "fs-absolute").await;
    assert_contained("fs-absolute", &title);
    assert!(!title.contains("root:"), "{title}");
    // Nor through the granted folder's own host path.
    let own = format!("fs-read {}", t.data.join("inside.txt").display());
    let title = outcome(&client, &own).await;
    assert_contained(&own, &title);
    assert_still_serving(&client).await;
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn fs_symlinks_pointing_outside_the_grant_are_not_followed() {
    let (d, _t) = deploy_fs("read-write");
    let client = d.serve().await;
    for query in ["fs-symlink", "fs-read /data/link-rel"] {
        let title = outcome(&client, query).await;
        assert_contained(query, &title);
        assert!(!title.contains("SECRET"), "{query}: {title}");
    }
    assert_still_serving(&client).await;
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn fs_a_read_only_grant_is_readable_and_not_writable() {
    let (d, t) = deploy_fs("read-only");
    let client = d.serve().await;
    let title = outcome(&client, "fs-read").await;
    assert!(INSIDE.len() <= 40);
    assert_eq!(title, format!("read ok: {}", INSIDE.replace('\n', " ")));
    let title = outcome(&client, "fs-write").await;
    assert_contained("fs-write", &title);
    assert!(
        !t.data.join("new.txt").exists(),
        "a read-only grant was written through"
    );
    assert_still_serving(&client).await;
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn fs_a_read_write_grant_is_writable_inside_only() {
    let (d, t) = deploy_fs("read-write");
    let client = d.serve().await;
    let title = outcome(&client, "fs-write").await;
    assert_eq!(title, "write ok");
    assert_eq!(
        std::fs::read_to_string(t.data.join("new.txt")).unwrap(),
        "written by hostile\n"
    );
    // Write access does not widen what `..` reaches.
    let title = outcome(&client, "fs-dotdot").await;
    assert_contained("fs-dotdot", &title);
    assert_still_serving(&client).await;
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn fs_without_a_grant_nothing_is_visible() {
    let d = Deployment::with_notes();
    let _t = tree(d.dir.path());
    let d = deploy(d, "");
    let client = d.serve().await;
    for query in ["fs-read", "fs-absolute", "fs-write"] {
        let title = outcome(&client, query).await;
        assert_contained(query, &title);
    }
    assert_still_serving(&client).await;
    client.cancel().await.unwrap();
}

// ---------------------------------------------------------------------------------------
// Network

/// A loopback TCP listener that reports, for each connection it accepts, the first bytes
/// it received.
struct Listener {
    port: u16,
    accepted: mpsc::Receiver<Vec<u8>>,
}

impl Listener {
    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let (tx, accepted) = mpsc::channel();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                stream
                    .set_read_timeout(Some(Duration::from_secs(5)))
                    .unwrap();
                let mut bytes = Vec::new();
                let _ = stream.take(64).read_to_end(&mut bytes);
                if tx.send(bytes).is_err() {
                    break;
                }
            }
        });
        Self { port, accepted }
    }

    /// What the next connection sent, if one arrives within `wait`.
    fn next(&self, wait: Duration) -> Option<Vec<u8>> {
        self.accepted.recv_timeout(wait).ok()
    }
}

/// A port next to `port` (above it, or below it at the top of the range).
fn neighbour(port: u16) -> u16 {
    if port == u16::MAX { port - 1 } else { port + 1 }
}

#[tokio::test]
async fn tcp_a_granted_address_is_reachable_and_nothing_else_is() {
    let granted = Listener::start();
    let other = Listener::start();
    let d = deploy(
        Deployment::with_notes(),
        &format!(
            "[grants.network]\ntcp_connect = [\"127.0.0.1:{}\"]\n",
            granted.port
        ),
    );
    let client = d.serve().await;

    let query = format!("tcp-connect 127.0.0.1:{}", granted.port);
    let title = outcome(&client, &query).await;
    assert_eq!(title, format!("connected: 127.0.0.1:{}", granted.port));
    assert_eq!(
        granted.next(Duration::from_secs(5)).as_deref(),
        Some(&b"hostile\n"[..]),
        "the granted listener received the adapter's bytes"
    );

    for query in [
        // The neighbouring port.
        format!("tcp-connect 127.0.0.1:{}", neighbour(granted.port)),
        // Another listening port on the same address.
        format!("tcp-connect 127.0.0.1:{}", other.port),
        // The same port on another loopback address, and over IPv6.
        format!("tcp-connect 127.0.0.2:{}", granted.port),
        format!("tcp-connect [::1]:{}", granted.port),
        // The granted address by name: no named host is granted, so no lookup.
        format!("tcp-connect localhost:{}", granted.port),
        // Cloud metadata.
        "tcp-connect 169.254.169.254:80".to_string(),
    ] {
        let title = outcome(&client, &query).await;
        assert_contained(&query, &title);
    }
    assert_eq!(other.next(Duration::from_millis(500)), None);
    assert_eq!(granted.next(Duration::from_millis(500)), None);
    assert_still_serving(&client).await;
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn tcp_without_a_grant_every_connection_is_refused() {
    let listener = Listener::start();
    let d = deploy_bare();
    let client = d.serve().await;
    let query = format!("tcp-connect 127.0.0.1:{}", listener.port);
    let title = outcome(&client, &query).await;
    assert_contained(&query, &title);
    assert_eq!(
        listener.next(Duration::from_millis(500)),
        None,
        "an ungranted connection reached the listener"
    );
    assert_still_serving(&client).await;
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn udp_datagrams_reach_only_a_granted_destination() {
    let granted = UdpSocket::bind("127.0.0.1:0").unwrap();
    granted
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let granted_port = granted.local_addr().unwrap().port();
    let other = UdpSocket::bind("127.0.0.1:0").unwrap();
    other
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let other_port = other.local_addr().unwrap().port();

    // No grant: no UDP at all.
    {
        let d = deploy_bare();
        let client = d.serve().await;
        let query = format!("udp-send 127.0.0.1:{granted_port}");
        let title = outcome(&client, &query).await;
        assert_contained(&query, &title);
        assert_still_serving(&client).await;
        client.cancel().await.unwrap();
    }
    let mut buf = [0u8; 64];
    granted
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    assert!(
        granted.recv_from(&mut buf).is_err(),
        "an ungranted datagram arrived"
    );

    // A grant for one destination.
    let d = deploy(
        Deployment::with_notes(),
        &format!("[grants.network]\nudp_send = [\"127.0.0.1:{granted_port}\"]\n"),
    );
    let client = d.serve().await;
    let query = format!("udp-send 127.0.0.1:{other_port}");
    let title = outcome(&client, &query).await;
    assert_contained(&query, &title);
    assert!(
        other.recv_from(&mut buf).is_err(),
        "a datagram reached an ungranted port"
    );
    let query = format!("udp-send 127.0.0.1:{granted_port}");
    let title = outcome(&client, &query).await;
    assert_eq!(title, "sent: 7 bytes");
    granted
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let (n, _) = granted.recv_from(&mut buf).expect("the granted datagram");
    assert_eq!(&buf[..n], b"hostile");
    assert_still_serving(&client).await;
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn dns_without_a_named_host_grant_fails() {
    let d = deploy_bare();
    let client = d.serve().await;
    for query in ["dns localhost", "dns example.com"] {
        let title = outcome(&client, query).await;
        assert_contained(query, &title);
    }
    assert_still_serving(&client).await;
    client.cancel().await.unwrap();
}

/// Granting one named host lets the adapter resolve that name only; every other name is
/// refused before any DNS query (wasmtime-wasi alone would resolve any name once lookup is
/// on).
#[tokio::test]
async fn dns_only_granted_names_resolve() {
    let d = deploy(
        Deployment::with_notes(),
        "[grants.network]\ntcp_connect = [\"localhost:9\"]\n",
    );
    let client = d.serve().await;
    for query in ["dns localhost", "dns LocalHost", "dns 127.0.0.1"] {
        let title = outcome(&client, query).await;
        assert!(title.starts_with("resolved: "), "`{query}`: {title}");
    }
    for query in [
        "dns example.com",
        "dns localhost.example",
        "dns ip6-localhost",
        "dns metadata.google.internal",
    ] {
        let title = outcome(&client, query).await;
        assert_contained(query, &title);
    }
    assert_still_serving(&client).await;
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn dns_connect_a_named_host_resolving_to_loopback_is_refused() {
    let listener = Listener::start();
    let d = deploy(
        Deployment::with_notes(),
        &format!(
            "[grants.network]\ntcp_connect = [\"localhost:{}\"]\n",
            listener.port
        ),
    );
    let client = d.serve().await;
    let query = format!("dns-connect localhost:{}", listener.port);
    let title = outcome(&client, &query).await;
    assert_contained(&query, &title);
    assert_eq!(
        listener.next(Duration::from_millis(500)),
        None,
        "a name that resolves to loopback reached the loopback listener"
    );
    assert_still_serving(&client).await;
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn dns_connect_a_named_host_reaches_loopback_only_when_the_ip_is_granted_too() {
    let listener = Listener::start();
    let d = deploy(
        Deployment::with_notes(),
        &format!(
            "[grants.network]\ntcp_connect = [\"localhost:{0}\", \"127.0.0.1:{0}\"]\n",
            listener.port
        ),
    );
    let client = d.serve().await;
    let query = format!("dns-connect localhost:{}", listener.port);
    let title = outcome(&client, &query).await;
    assert_eq!(title, format!("connected: 127.0.0.1:{}", listener.port));
    assert_eq!(
        listener.next(Duration::from_secs(5)).as_deref(),
        Some(&b"hostile\n"[..])
    );
    assert_still_serving(&client).await;
    client.cancel().await.unwrap();
}

// ---------------------------------------------------------------------------------------
// Environment

#[tokio::test]
async fn env_the_host_environment_is_never_inherited_and_grants_are_given() {
    // The test process (and so `airlock serve`) has HOME and PATH; the adapter must not.
    assert!(std::env::var_os("PATH").is_some());
    let d = deploy(
        Deployment::with_notes(),
        "[grants.env]\nGREETING = \"hello\"\n",
    );
    let client = d.serve().await;
    assert_eq!(outcome(&client, "env GREETING").await, "set: hello");
    for query in [
        "env HOME",
        "env PATH",
        "env AIRLOCK_LOG",
        "env AIRLOCK_CACHE_DIR",
    ] {
        let title = outcome(&client, query).await;
        assert_contained(query, &title);
    }
    assert_eq!(outcome(&client, "env-all").await, "vars: GREETING");
    assert_still_serving(&client).await;
    client.cancel().await.unwrap();
}

// ---------------------------------------------------------------------------------------
// Resource exhaustion and traps

#[tokio::test]
async fn spin_is_interrupted_at_the_deadline() {
    let d = deploy_bare();
    let client = d.serve().await;
    let started = Instant::now();
    let text = stopped(&client, "spin", Category::Interrupted).await;
    let elapsed = started.elapsed();
    assert!(text.contains("2000 ms"), "{text}");
    assert!(
        elapsed >= Duration::from_millis(1900) && elapsed < Duration::from_secs(10),
        "deadline is 2 s, took {elapsed:?}"
    );
    assert_still_serving(&client).await;
    client.cancel().await.unwrap();
    assert_traced_containment(&d, "spin");
    let events = d.trace();
    let e = events
        .iter()
        .find(|e| e["kind"] == "call-contained")
        .unwrap();
    assert_eq!(e["payload"]["failure"], "deadline");
}

#[tokio::test]
async fn memory_bomb_stops_at_the_memory_limit() {
    let text = stopped_bare("memory-bomb", Category::Unavailable).await;
    assert!(text.contains("memory limit"), "{text}");
    assert!(text.contains("32 MiB"), "{text}");
}

#[tokio::test]
async fn memory_bomb_that_handles_failure_gets_less_than_its_limit() {
    let d = deploy_bare();
    let client = d.serve().await;
    let title = outcome(&client, "memory-bomb-graceful").await;
    let mib: u64 = title
        .strip_prefix("allocation failed after ")
        .and_then(|r| r.strip_suffix(" MiB"))
        .unwrap_or_else(|| panic!("unexpected report: {title}"))
        .parse()
        .unwrap();
    assert!((16..32).contains(&mib), "{title}");
    assert_still_serving(&client).await;
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn recurse_stack_overflow_traps_and_is_reported_as_unavailable() {
    stopped_bare("recurse", Category::Unavailable).await;
}

#[tokio::test]
async fn recurse_native_wasm_stack_overflow_traps_and_is_reported_as_unavailable() {
    stopped_bare("recurse-native", Category::Unavailable).await;
}

#[tokio::test]
async fn sleep_blocked_in_the_host_is_interrupted_at_the_deadline() {
    let d = deploy_bare();
    let client = d.serve().await;
    let started = Instant::now();
    stopped(&client, "sleep", Category::Interrupted).await;
    let elapsed = started.elapsed();
    assert!(
        elapsed < Duration::from_secs(10),
        "deadline is 2 s, took {elapsed:?}"
    );
    assert_still_serving(&client).await;
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn tcp_hang_waiting_on_a_silent_peer_is_interrupted_at_the_deadline() {
    let listener = Listener::start();
    let d = deploy(
        Deployment::with_notes(),
        &format!(
            "[grants.network]\ntcp_connect = [\"127.0.0.1:{}\"]\n",
            listener.port
        ),
    );
    let client = d.serve().await;
    let started = Instant::now();
    stopped(
        &client,
        &format!("tcp-hang 127.0.0.1:{}", listener.port),
        Category::Interrupted,
    )
    .await;
    let elapsed = started.elapsed();
    assert!(
        elapsed < Duration::from_secs(10),
        "deadline is 2 s, took {elapsed:?}"
    );
    assert_still_serving(&client).await;
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn tcp_listen_without_a_listen_grant_is_refused() {
    let d = deploy(
        Deployment::with_notes(),
        "[grants.network]\ntcp_connect = [\"127.0.0.1:9\"]\n",
    );
    let client = d.serve().await;
    for query in ["tcp-listen 127.0.0.1:0", "tcp-listen 0.0.0.0:0"] {
        let title = outcome(&client, query).await;
        assert_contained(query, &title);
    }
    assert_still_serving(&client).await;
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn fuel_a_spin_is_stopped_by_its_instruction_budget() {
    let d = Deployment::with_notes()
        .mapping_edited("hostile", |t| {
            t.replacen("memory_mib = 32", "memory_mib = 32\nfuel = 50000000", 1)
        })
        .mapping("source-library");
    let client = d.serve().await;
    // The refusal names its cause: fuel, not the 2 s deadline (whose refusal says
    // "deadline"), however slowly a loaded machine runs the spin.
    let text = stopped(&client, "spin", Category::Interrupted).await;
    assert!(
        text.contains("fuel") && !text.contains("deadline"),
        "stopped by fuel, not the deadline: {text}"
    );
    assert_still_serving(&client).await;
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn stdout_flood_stops_at_the_output_budget() {
    let d = deploy_bare();
    let client = d.serve().await;
    // Unavailable and named as a flood: the budget stopped it, not the 2 s deadline
    // (which would answer `interrupted`), however slowly a loaded machine runs it.
    let text = stopped(&client, "stdout-flood", Category::Unavailable).await;
    assert!(
        text.contains("65536-byte output budget"),
        "the flood is named as such: {text}"
    );
    assert!(!text.contains("flood flood"), "{text}");
    assert_still_serving(&client).await;
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn stdout_flood_ignoring_write_errors_stops_at_the_output_budget() {
    let d = deploy_bare();
    let client = d.serve().await;
    // As above: the category and the words name the budget, not the deadline.
    let text = stopped(&client, "stdout-flood-quiet", Category::Unavailable).await;
    assert!(!text.contains("flood flood"), "{text}");
    assert!(
        text.contains("65536-byte output budget"),
        "the flood is named as such: {text}"
    );
    assert_still_serving(&client).await;
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn huge_result_is_refused_at_the_result_budget() {
    let text = stopped_bare("huge-result", Category::Unavailable).await;
    assert!(text.contains("1048576-byte budget"), "{text}");
}

#[tokio::test]
async fn panic_traps_and_its_message_does_not_reach_the_model() {
    let text = stopped_bare("panic", Category::Unavailable).await;
    assert!(!text.contains("on purpose"), "{text}");
}

// ---------------------------------------------------------------------------------------
// Limits above the host ceilings

#[tokio::test]
async fn limits_above_the_host_ceilings_refuse_to_start() {
    for (from, to, key) in [
        ("memory_mib = 32", "memory_mib = 4096", "memory_mib"),
        ("deadline_ms = 2000", "deadline_ms = 600000", "deadline_ms"),
        (
            "max_result_bytes = 1048576",
            "max_result_bytes = 1073741824",
            "max_result_bytes",
        ),
        (
            "max_stdio_bytes = 65536",
            "max_stdio_bytes = 1073741824",
            "max_stdio_bytes",
        ),
        (
            "memory_mib = 32",
            "memory_mib = 32\nfuel = 10000000000000",
            "fuel",
        ),
    ] {
        let d = Deployment::with_notes()
            .mapping_edited("hostile", |t| {
                assert!(t.contains(from), "{t}");
                t.replacen(from, to, 1)
            })
            .mapping("source-library");
        let (ok, stderr) = d.serve_expecting_failure();
        assert!(!ok, "serve must refuse `{to}`");
        assert!(
            stderr.contains(key) && stderr.contains("host ceiling"),
            "`{to}`: the refusal names the key and the ceiling: {stderr}"
        );
        assert!(
            d.upstream_calls().is_empty(),
            "nothing may reach the upstream: {:?}",
            d.upstream_calls()
        );
    }
}

// ---------------------------------------------------------------------------------------
// Neighbours while an adapter misbehaves

/// The spinners' deadline in the neighbour tests: long enough that a loaded machine still
/// answers the neighbour while every spinner runs, so the tests wait on that order of
/// events rather than on a wall-clock bound.
const SPIN_DEADLINE_MS: u64 = 10_000;

/// `hostile` spinning for [`SPIN_DEADLINE_MS`] beside `source-library`, no grants.
fn deploy_spinners() -> Deployment {
    Deployment::with_notes()
        .mapping_edited("hostile", |t| {
            assert!(t.contains("deadline_ms = 2000"), "{t}");
            t.replace(
                "deadline_ms = 2000",
                &format!("deadline_ms = {SPIN_DEADLINE_MS}"),
            )
        })
        .mapping("source-library")
}

/// Starts `count` spinning calls (each runs until [`SPIN_DEADLINE_MS`] interrupts it).
async fn start_spinners(
    client: &std::sync::Arc<Client>,
    count: usize,
) -> Vec<tokio::task::JoinHandle<CallToolResult>> {
    let mut spinning = Vec::new();
    for _ in 0..count {
        let client = client.clone();
        spinning.push(tokio::spawn(async move { attack(&client, "spin").await }));
    }
    // The spinners' requests are written before the neighbour's; give the host a moment
    // to hand them to its workers (if it has not, the test is only easier, never wrong:
    // what it asserts is checked against the spinners' own answers below).
    tokio::time::sleep(Duration::from_millis(300)).await;
    spinning
}

/// While adapters spin (more than the machine has cores, so that every runtime worker
/// could be taken), a call to the neighbouring mapping is answered while they still
/// spin: a spinning guest must not starve the host. The order of events is the test —
/// the neighbour's answer arrives before any spinner's — not a wall-clock bound.
#[tokio::test]
async fn neighbours_are_served_while_adapters_spin() {
    let d = deploy_spinners();
    let client = std::sync::Arc::new(d.serve().await);
    // `airlock serve` on stdio runs one runtime worker (`--workers`); spin on more guests
    // than there are cores anyway, so that the test holds for any worker count.
    let spinners = std::thread::available_parallelism().map_or(2, |n| n.get()) + 1;
    let spinning = start_spinners(&client, spinners).await;
    let started = Instant::now();
    let hits = tokio::time::timeout(
        CALL_TIMEOUT,
        call(&client, "search_sources", json!({ "query": "checkpoint" })),
    )
    .await
    .expect("search_sources answered in time")
    .expect("search_sources call");
    let waited = started.elapsed();
    let answered_while_spinning = spinning.iter().all(|s| !s.is_finished());
    assert_ne!(hits.is_error, Some(true), "{}", text_of(&hits));
    for s in spinning {
        assert_refused(&s.await.unwrap(), Category::Interrupted);
    }
    assert!(
        answered_while_spinning,
        "with {spinners} adapters spinning, the neighbour's search was answered only after \
         a spinner's {SPIN_DEADLINE_MS} ms deadline ended it (it waited {waited:?})"
    );
}

/// The same, call after call: while every runtime worker runs a spinning adapter, the
/// neighbour's answers keep coming promptly, not only the first. A guest that yields
/// without letting its worker poll the IO driver (wasmtime's plain `Yield`, which tokio
/// runs again at once from its LIFO slot) leaves each read and write of the neighbour's
/// call waiting for the driver's occasional turn: hundreds of milliseconds per call.
/// Promptly is measured against the same searches on the same host just before, with
/// nothing spinning (a loaded machine slows both), and with a floor of 1 s for the five.
#[tokio::test]
async fn neighbours_are_served_promptly_call_after_call_while_adapters_spin() {
    let d = deploy_spinners();
    let client = std::sync::Arc::new(d.serve().await);
    async fn five_searches(client: &Client) -> Vec<Duration> {
        let mut waits = Vec::new();
        for _ in 0..5 {
            let started = Instant::now();
            let hits = tokio::time::timeout(
                CALL_TIMEOUT,
                call(client, "search_sources", json!({ "query": "checkpoint" })),
            )
            .await
            .expect("search_sources answered in time")
            .expect("search_sources call");
            waits.push(started.elapsed());
            assert_ne!(hits.is_error, Some(true), "{}", text_of(&hits));
        }
        waits
    }
    let quiet: Duration = five_searches(&client).await.iter().sum();
    let spinners = std::thread::available_parallelism().map_or(2, |n| n.get());
    let spinning = start_spinners(&client, spinners).await;
    let waits = five_searches(&client).await;
    let still_spinning = spinning.iter().all(|s| !s.is_finished());
    for s in spinning {
        assert_refused(&s.await.unwrap(), Category::Interrupted);
    }
    let total: Duration = waits.iter().sum();
    let bound = (quiet * 10).max(Duration::from_secs(1));
    assert!(
        still_spinning && total < bound,
        "with {spinners} adapters spinning (still spinning after the searches: \
         {still_spinning}), the neighbour's five searches waited {waits:?} ({total:?} in all; \
         the same five with nothing spinning took {quiet:?}; bound {bound:?})"
    );
}

// ---------------------------------------------------------------------------------------
// Upstream resources

#[tokio::test]
async fn resources_are_read_only_under_the_mapping_prefixes_and_nothing_else_is_sent() {
    let d = Deployment::with_notes()
        .mapping_edited("hostile", |t| {
            t.replace("resources = []", "resources = [\"notes://\"]")
        })
        .mapping("source-library");
    let client = d.serve().await;
    let ok = outcome(&client, "resource notes://wal-checkpoints").await;
    assert!(ok.starts_with("resource ok:"), "{ok}");
    for uri in [
        "file:///etc/passwd",
        "notes:/wal-checkpoints",
        "notes://../wal-checkpoints",
        "notes://x/%2e%2e/wal-checkpoints",
    ] {
        let title = outcome(&client, &format!("resource {uri}")).await;
        assert!(title.contains("not-permitted"), "{uri}: {title}");
    }
    let reads: Vec<String> = d
        .upstream_calls()
        .iter()
        .filter(|c| c["method"] == "resources/read")
        .map(|c| c["uri"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(
        reads,
        ["notes://wal-checkpoints"],
        "only the permitted read was sent"
    );
    assert_still_serving(&client).await;
    client.cancel().await.unwrap();
}

// ---------------------------------------------------------------------------------------
// Per-call and per-adapter budgets

#[tokio::test]
async fn a_call_may_make_only_its_budget_of_upstream_requests() {
    let d = Deployment::with_notes()
        .mapping_edited("hostile", |t| {
            t.replace("[limits]", "[limits]\nmax_upstream_requests = 3")
        })
        .mapping("source-library");
    let client = d.serve().await;
    let title = outcome(&client, "many-calls 5").await;
    assert!(title.starts_with("calls ok: 3;"), "{title}");
    assert!(title.contains("not-permitted"), "{title}");
    assert_eq!(
        d.upstream_tool_calls().len(),
        3,
        "only three requests were sent"
    );
    assert_still_serving(&client).await;
    client.cancel().await.unwrap();
}

/// `hostile` with `limits` (TOML lines) added to its `[limits]`, beside `source-library`.
fn hostile_limited(limits: &str) -> Deployment {
    Deployment::with_notes()
        .mapping_edited("hostile", |t| {
            t.replace("[limits]", &format!("[limits]\n{limits}"))
        })
        .mapping("source-library")
}

#[tokio::test]
async fn calls_past_the_concurrency_limit_are_rate_limited() {
    let d = hostile_limited("max_concurrent_calls = 1");
    let client = std::sync::Arc::new(d.serve().await);
    let spinner = {
        let client = client.clone();
        tokio::spawn(async move { attack(&client, "spin").await })
    };
    tokio::time::sleep(Duration::from_millis(400)).await;
    let refused = attack(&client, "ping").await;
    let text = assert_refused(&refused, Category::RateLimited);
    // It waited its queue_timeout_ms (250 by default) for the one instance, then was told
    // when to try again.
    assert!(
        text.contains("concurrent calls for the 2") && text.contains("try again in about 250 ms"),
        "{text}"
    );
    assert_refused(&spinner.await.unwrap(), Category::Interrupted);
    assert_still_serving(&client).await;
}

/// A burst over the concurrency cap waits its turn instead of being refused at once: with
/// one instance, a call arriving while another sleeps 400 ms runs after it (its wait is
/// the `execute.queue` stage of its trace event); with no queue, it is refused at once,
/// having run nothing.
#[tokio::test]
async fn calls_past_the_concurrency_limit_wait_in_a_bounded_queue() {
    let d = hostile_limited("max_concurrent_calls = 1\nqueue_timeout_ms = 3000");
    let client = std::sync::Arc::new(d.serve().await);
    let sleeper = {
        let client = client.clone();
        tokio::spawn(async move { outcome(&client, "sleep-ms 400").await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        outcome(&client, "ping").await,
        "pong",
        "it waited, then ran"
    );
    assert_eq!(sleeper.await.unwrap(), "slept 400 ms");
    let waited: Vec<u64> = d
        .trace()
        .into_iter()
        .filter(|e| e["kind"] == "call-outcome")
        .filter_map(|e| e["payload"]["stages_us"]["execute.queue"].as_u64())
        .collect();
    assert_eq!(waited.len(), 1, "only the second call queued: {waited:?}");
    assert!(
        waited[0] >= 150_000,
        "it waited for the sleeper: {waited:?}"
    );
    drop(client);

    let d = hostile_limited("max_concurrent_calls = 1\nmax_queued_calls = 0");
    let client = std::sync::Arc::new(d.serve().await);
    let sleeper = {
        let client = client.clone();
        tokio::spawn(async move { outcome(&client, "sleep-ms 400").await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = std::time::Instant::now();
    let refused = attack(&client, "ping").await;
    let text = assert_refused(&refused, Category::RateLimited);
    assert!(text.contains("its queue is full"), "{text}");
    assert!(
        started.elapsed() < Duration::from_millis(250),
        "refused at once"
    );
    assert_eq!(sleeper.await.unwrap(), "slept 400 ms");
}

/// A call already running when the server announces a catalogue change sends nothing more
/// upstream: its verdict covered the catalogue as it was when it started.
#[tokio::test]
async fn a_running_call_sends_nothing_upstream_after_the_server_announces_a_change() {
    let d = Deployment::with_notes();
    let d = d
        .notes_args(&["--drift-on-call", "description"])
        .mapping("hostile");
    let client = d.serve().await;
    let title = outcome(&client, "many-calls 5").await;
    assert!(title.starts_with("calls ok: 1;"), "{title}");
    assert!(title.contains("catalogue changed"), "{title}");
    assert_eq!(
        d.upstream_tool_calls().len(),
        1,
        "nothing was sent after the notification"
    );
    client.cancel().await.unwrap();
}

/// Parses `remember`'s report (`static=N small@A=N large@A=N self-check=N`) into its fields.
fn remembered(report: &str) -> std::collections::BTreeMap<String, String> {
    report
        .split_whitespace()
        .map(|part| {
            let (key, value) = part
                .split_once('=')
                .unwrap_or_else(|| panic!("`remember` part without `=`: {report}"));
            (key.to_owned(), value.to_owned())
        })
        .collect()
}

/// An adapter with a filesystem or network grant never runs in a spare instance: its
/// preopens and socket policy are made when its call starts (`runtime` module rules).
#[tokio::test]
async fn an_adapter_with_filesystem_or_network_grants_is_instantiated_for_each_call() {
    let fs = Deployment::with_notes();
    let t = tree(fs.dir.path());
    let grants = fs_grant(&t.data, "read-only");
    for d in [
        deploy(fs, &grants),
        deploy(
            Deployment::with_notes(),
            "[grants.network]\ntcp_connect = [\"127.0.0.1:9\"]\n",
        ),
    ] {
        let client = d.serve().await;
        for _ in 0..3 {
            assert_eq!(outcome(&client, "ping").await, "pong");
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        client.cancel().await.unwrap();
        let stages: Vec<Value> = d
            .trace()
            .into_iter()
            .filter(|e| e["kind"] == "call-outcome")
            .map(|e| e["payload"]["stages_us"].clone())
            .collect();
        assert_eq!(stages.len(), 3, "{stages:?}");
        for s in &stages {
            assert!(
                s.get("execute.instantiate").is_some() && s.get("execute.spare").is_none(),
                "{stages:?}"
            );
        }
    }
}

/// Every call gets a fresh instance in memory that no earlier call can have written: the
/// host reuses pooled slots and keeps 4 MiB of each memory resident between calls
/// (`runtime::KEEP_RESIDENT_BYTES`), so this is the test that fails if a slot came back
/// dirty or an instance were kept for the next call. The adapter leaves a mark in a static,
/// in a block inside the resident part and in one reaching past it; the next calls must
/// see none of it, in blocks at the same addresses (else the check would prove nothing),
/// while the adapter's own self-check shows that it does see a mark that is there.
#[tokio::test]
async fn a_call_sees_nothing_an_earlier_call_left_in_memory() {
    let d = deploy_bare();
    let client = d.serve().await;
    let first = remembered(&outcome(&client, "remember").await);
    for call in 1..4 {
        // A neighbour's call between them, so the slot is handed out more than once.
        assert_eq!(outcome(&client, "ping").await, "pong");
        // Time for the spare made after `ping`'s answer: this call runs in it.
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        let again = remembered(&outcome(&client, "remember").await);
        assert_eq!(
            again["static"], "0",
            "call {call} saw an earlier call's static: {again:?}"
        );
        assert_eq!(
            again.keys().collect::<Vec<_>>(),
            first.keys().collect::<Vec<_>>(),
            "the blocks landed at the same addresses as in the first call: {first:?} / {again:?}"
        );
        for block in first.keys().filter(|k| k.contains('@')) {
            assert_eq!(
                again[block], "0",
                "call {call}: block {block} still held an earlier call's bytes: {again:?}"
            );
        }
        assert_ne!(
            again["self-check"], "0",
            "the adapter must see its own mark, else a zero proves nothing: {again:?}"
        );
    }
    assert_eq!(first["static"], "0", "{first:?}");
    client.cancel().await.unwrap();
    // The later `remember` calls ran in spare instances, made ahead of their calls
    // (`runtime` module rules): those are fresh too.
    let spares = d
        .trace()
        .iter()
        .filter(|e| e["kind"] == "call-outcome")
        .filter(|e| e["payload"]["stages_us"].get("execute.spare").is_some())
        .count();
    assert!(spares >= 3, "{spares} calls ran in a spare instance");
}

/// `airlock serve` on the bare deployment (every mapping approved), driven with raw
/// JSON-RPC lines: the deployment, the child, its stdin and its stdout's lines.
fn raw_serve() -> (
    Deployment,
    tokio::process::Child,
    tokio::process::ChildStdin,
    tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
) {
    use tokio::io::AsyncBufReadExt as _;
    let d = deploy_bare();
    d.approve_all();
    let mut child = d
        .serve_command()
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stdin = child.stdin.take().unwrap();
    let lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    (d, child, stdin, lines)
}

/// A client that closes its stdin while a `tools/call` is in flight still gets that call's
/// answer before `airlock serve` ends its stdout (every request that carries an id gets
/// an answer): here the spinning adapter's deadline (2 s) ends the call, and its answer
/// is the last line written.
#[tokio::test]
async fn a_call_in_flight_when_the_client_closes_stdin_is_answered_before_serve_exits() {
    use tokio::io::AsyncWriteExt as _;
    let (_d, mut child, mut stdin, mut lines) = raw_serve();
    for v in [
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "raw", "version": "1"}}}),
        json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
        json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
            "params": {"name": "hostile_search", "arguments": {"query": "spin"}}}),
    ] {
        let mut line = serde_json::to_vec(&v).unwrap();
        line.push(b'\n');
        stdin.write_all(&line).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(stdin);
    // Everything written until serve ends its stdout.
    let mut seen = Vec::new();
    let until = Instant::now() + Duration::from_secs(20);
    while let Ok(Ok(Some(line))) = tokio::time::timeout_at(until.into(), lines.next_line()).await {
        seen.push(serde_json::from_str::<Value>(&line).unwrap());
    }
    assert_eq!(seen.first().map(|m| &m["id"]), Some(&json!(1)), "{seen:?}");
    let answer = seen
        .iter()
        .find(|m| m["id"] == 2)
        .unwrap_or_else(|| panic!("the call in flight is answered: {seen:?}"));
    assert_eq!(answer["result"]["isError"], true, "{answer}");
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .expect("serve exits once the call is answered")
        .unwrap();
    assert!(status.success(), "{status:?}");
}

/// A `tools/call` the client cancels in flight (`notifications/cancelled`) is stopped at
/// once — the spinning adapter is interrupted at its next epoch tick, not at its 2 s
/// deadline — and gets no answer (MCP: a receiver of a cancellation does not answer the
/// cancelled request); the next request is answered, and the trace records the call.
/// Driven with raw JSON-RPC lines, so the test sees exactly what `airlock serve` writes.
#[tokio::test]
async fn a_call_the_client_cancels_stops_at_once_and_gets_no_answer() {
    use tokio::io::AsyncWriteExt as _;
    let (d, mut child, mut stdin, mut lines) = raw_serve();
    let mut send = async |v: Value| {
        let mut line = serde_json::to_vec(&v).unwrap();
        line.push(b'\n');
        stdin.write_all(&line).await.unwrap();
    };
    send(
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "raw", "version": "1"}}}),
    )
    .await;
    let init: Value = serde_json::from_str(&lines.next_line().await.unwrap().unwrap()).unwrap();
    assert_eq!(init["id"], 1, "{init}");
    send(json!({"jsonrpc": "2.0", "method": "notifications/initialized"})).await;
    send(json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
        "params": {"name": "hostile_search", "arguments": {"query": "spin"}}}))
    .await;
    let call_sent = Instant::now();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let cancelled_at = Instant::now();
    send(
        json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
        "params": {"requestId": 2, "reason": "the user pressed stop"}}),
    )
    .await;
    send(json!({"jsonrpc": "2.0", "id": 3, "method": "ping"})).await;
    // Everything written until well past the spinning call's deadline (2 s).
    let mut seen = Vec::new();
    let until = Instant::now() + Duration::from_secs(3);
    while let Ok(Ok(Some(line))) = tokio::time::timeout_at(until.into(), lines.next_line()).await {
        seen.push(serde_json::from_str::<Value>(&line).unwrap());
    }
    assert!(
        seen.iter()
            .any(|m| m["id"] == 3 && m.get("result").is_some()),
        "the ping is answered: {seen:?}"
    );
    assert!(
        !seen.iter().any(|m| m["id"] == 2),
        "the cancelled call is not answered: {seen:?}"
    );
    drop(stdin);
    let _ = tokio::time::timeout(Duration::from_secs(20), child.wait()).await;
    let trace = d.trace();
    let outcome = trace
        .iter()
        .find(|e| e["kind"] == "call-outcome")
        .unwrap_or_else(|| panic!("the cancelled call is traced: {trace:#?}"));
    let elapsed = Duration::from_micros(outcome["payload"]["elapsed_us"].as_u64().unwrap());
    // Not cancelled, it would have run to its 2 s deadline: anything shorter was the
    // cancellation (the whole slack below 2 s is the loaded machine's, not a guess).
    assert!(
        elapsed < Duration::from_secs(2),
        "stopped when cancelled ({:?} after the call started), not at the 2 s deadline: {elapsed:?}; {outcome}",
        cancelled_at.duration_since(call_sent)
    );
}

/// `airlock serve` for `d` with its log (stderr) written to `log`.
async fn serve_logging_to(d: &Deployment, log: &Path) -> Client {
    use rmcp::ServiceExt as _;
    let file = std::fs::File::create(log).unwrap();
    let (transport, _) = rmcp::transport::TokioChildProcess::builder(d.serve_command())
        .stderr(file)
        .spawn()
        .unwrap();
    ().serve(transport).await.unwrap()
}

/// The `call refused` lines of the log at `log`.
fn refusal_lines(log: &Path) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .filter(|l| l.contains("call refused:"))
        .map(str::to_owned)
        .collect()
}

/// Every refused call leaves one log line naming its call, capability, mapping,
/// connection and category: a rate-limited call at WARN, invalid arguments and an unknown
/// tool at INFO; a completed call none. A flood is bounded per category and second, and
/// the next line says how many were dropped: lines written plus lines dropped is every
/// refusal.
#[tokio::test]
async fn every_refused_call_leaves_one_log_line_and_a_flood_is_bounded() {
    let d = hostile_limited("max_concurrent_calls = 1\nmax_queued_calls = 0");
    d.approve_all();
    let log = d.dir.path().join("serve.log");
    let client = std::sync::Arc::new(serve_logging_to(&d, &log).await);
    assert_eq!(outcome(&client, "ping").await, "pong");
    let sleeper = {
        let client = client.clone();
        tokio::spawn(async move { outcome(&client, "sleep-ms 500").await })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_refused(&attack(&client, "ping").await, Category::RateLimited);
    sleeper.await.unwrap();
    let r = call(&client, "search_sources", json!({"query": 7}))
        .await
        .unwrap();
    assert_refused(&r, Category::InvalidRequest);
    assert!(call(&client, "no_such\u{1b}tool", json!({})).await.is_err());
    let lines = refusal_lines(&log);
    assert_eq!(lines.len(), 3, "{lines:#?}");
    assert!(
        lines[0].contains(" WARN ")
            && lines[0].contains("capability=hostile_search")
            && lines[0].contains("mapping=hostile ")
            && lines[0].contains("connection=notes ")
            && lines[0].contains("category=\"rate limited\""),
        "{}",
        lines[0]
    );
    assert!(
        lines[1].contains(" INFO ")
            && lines[1].contains("mapping=source-library ")
            && lines[1].contains("category=\"invalid request\""),
        "{}",
        lines[1]
    );
    assert!(
        lines[2].contains("mapping=- ") && !lines[2].contains('\u{1b}'),
        "an unknown tool, its name escaped: {}",
        lines[2]
    );

    // A flood: 40 refusals at once, then one more a second later.
    let mut flood = tokio::task::JoinSet::new();
    for _ in 0..40 {
        let client = client.clone();
        flood.spawn(async move {
            call(&client, "search_sources", json!({"query": 7}))
                .await
                .unwrap()
        });
    }
    while let Some(r) = flood.join_next().await {
        assert_refused(&r.unwrap(), Category::InvalidRequest);
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let r = call(&client, "search_sources", json!({"query": 7}))
        .await
        .unwrap();
    assert_refused(&r, Category::InvalidRequest);
    let lines = refusal_lines(&log);
    let flood = &lines[3..];
    let dropped: u64 = flood
        .iter()
        .map(|l| {
            let at = l.find("dropped=").unwrap() + "dropped=".len();
            l[at..]
                .split(|c: char| !c.is_ascii_digit())
                .next()
                .unwrap()
                .parse::<u64>()
                .unwrap()
        })
        .sum();
    assert!(flood.len() < 41, "bounded: {} lines", flood.len());
    assert!(dropped > 0, "{flood:#?}");
    assert_eq!(flood.len() as u64 + dropped, 41, "{flood:#?}");
}
