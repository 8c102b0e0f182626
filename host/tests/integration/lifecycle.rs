//! Connections that fail, recover and shut down cleanly, on real processes: a broken
//! upstream at start never stops the others; a killed upstream leaves the list, is reaped
//! and comes back re-snapshotted; SIGTERM stops every process of an upstream's group;
//! `kill -9` of the host takes its children with it; `airlock discover` of a silent
//! server times out and leaves nothing; a refused mapping is refused alone.

use std::time::{Duration, Instant};

use crate::common::*;
use rmcp::ServiceExt as _;
use rmcp::transport::TokioChildProcess;
use serde_json::{Value, json};

/// One line of `/proc/PID/stat`: (pid, state, ppid, pgrp).
fn stat(pid: u32) -> Option<(u32, char, u32, u32)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &text[text.rfind(')')? + 2..];
    let mut fields = rest.split(' ');
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    let pgrp = fields.next()?.parse().ok()?;
    Some((pid, state, ppid, pgrp))
}

fn all_processes() -> Vec<(u32, char, u32, u32)> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(stat)
        .collect()
}

fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

/// Children of `parent`: (pid, state, command line).
fn children(parent: u32) -> Vec<(u32, char, String)> {
    all_processes()
        .into_iter()
        .filter(|p| p.2 == parent)
        .map(|p| (p.0, p.1, cmdline(p.0)))
        .collect()
}

/// Living (not zombie) members of process group `pgid`.
fn group_alive(pgid: u32) -> Vec<(u32, String)> {
    all_processes()
        .into_iter()
        .filter(|p| p.3 == pgid && p.1 != 'Z')
        .map(|p| (p.0, cmdline(p.0)))
        .collect()
}

fn alive(pid: u32) -> bool {
    stat(pid).is_some_and(|s| s.1 != 'Z')
}

async fn until(secs: u64, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cond()
}

/// Every descendant of `parent`, nearest first.
fn descendants(parent: u32) -> Vec<(u32, char, String)> {
    let mut found = children(parent);
    let mut i = 0;
    while i < found.len() {
        let next = children(found[i].0);
        found.extend(next);
        i += 1;
    }
    found
}

/// The single upstream server process of `airlock` whose command line contains `what`:
/// a child, or a confined server (the child of the confinement helper, `airlock
/// __airlock-confine`, which is airlock's child).
async fn upstream_child(airlock: u32, what: &str) -> u32 {
    let mut found = None;
    assert!(
        until(20, || {
            found = descendants(airlock)
                .into_iter()
                .find(|c| c.2.contains(what) && c.1 != 'Z')
                .map(|c| c.0);
            found.is_some()
        })
        .await,
        "no `{what}` child of airlock {airlock}: {:?}",
        children(airlock)
    );
    found.unwrap()
}

fn kill(pid: u32, signal: i32) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe {
        libc::kill(pid as i32, signal);
    }
}

fn tool_names(tools: &[rmcp::model::Tool]) -> Vec<String> {
    tools.iter().map(|t| t.name.to_string()).collect()
}

fn connection_states(d: &Deployment, connection: &str) -> Vec<(String, String)> {
    d.trace()
        .iter()
        .filter(|e| e["kind"] == "connection-state" && e["subject"] == connection)
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

/// The notes connection (source-library) and an `outbox` connection (outbox-delivery)
/// whose server is `sh` running the delivery fixture, unless the file `mode` in the
/// deployment says `exit` (it exits at once) or `silent` (it never answers). The
/// configuration stays the same either way, so both mappings can be approved first.
fn with_switchable_outbox() -> (Deployment, std::path::PathBuf) {
    let d = Deployment::with_notes().mapping("source-library");
    let mode = d.dir.path().join("mode");
    let outbox = d.dir.path().join("outbox");
    let log = d.dir.path().join("outbox-calls.jsonl");
    std::fs::write(&log, "").unwrap();
    let script = format!(
        "m=$(cat '{mode}' 2>/dev/null); case \"$m\" in exit) echo leaving >&2; exit 3;; silent) exec sleep 1000;; esac; exec '{bin}' fixture delivery-server --outbox '{outbox}' --call-log '{log}'",
        mode = mode.display(),
        bin = airlock_bin().display(),
        outbox = outbox.display(),
        log = log.display(),
    );
    let d = d
        .connection(&format!(
            "[[connection]]\nname = \"outbox\"\ncommand = \"sh\"\nargs = [\"-c\", {script:?}]\nenv = {{ PATH = \"/usr/bin:/bin\" }}\nconfine = false\n"
        ))
        .mapping("outbox-delivery");
    (d, mode)
}

const OUTBOX_TOOLS: [&str; 3] = ["prepare_artifact", "list_destinations", "deliver_artifact"];

/// Starts `airlock serve` with a list_changed counter; returns the client and its pid.
async fn serve_counting(
    d: &Deployment,
) -> (
    rmcp::service::RunningService<rmcp::service::RoleClient, Notices>,
    Notices,
    u32,
) {
    let transport = TokioChildProcess::new(d.serve_command()).expect("spawn airlock serve");
    let pid = transport.id().expect("airlock serve has a pid");
    let notices = Notices::default();
    let client = notices
        .clone()
        .serve(transport)
        .await
        .expect("MCP initialize with airlock serve");
    (client, notices, pid)
}

/// A broken `outbox` at start (`mode`: exits at once, or never answers): `serve` answers
/// at once with the notes capabilities, which work; outbox's are absent; the outbox
/// connection is traced `disconnected` with its reason.
async fn broken_at_start(mode_text: &str, timeout: &str) {
    let (d, mode) = with_switchable_outbox();
    let d = d.top(&format!("start_timeout = \"{timeout}\"\n"));
    d.approve_all();
    std::fs::write(&mode, mode_text).unwrap();
    let started = Instant::now();
    let (client, _notices, _pid) = serve_counting(&d).await;
    let tools = client.peer().list_all_tools().await.unwrap();
    let elapsed = started.elapsed();
    assert_eq!(
        tool_names(&tools),
        ["retrieve_source", "search_sources"],
        "only the notes capabilities"
    );
    let hits = call(&client, "search_sources", json!({"query": "checkpoint"}))
        .await
        .unwrap();
    assert_ne!(hits.is_error, Some(true), "{}", text_of(&hits));
    assert!(
        elapsed < Duration::from_secs(15),
        "serving took {elapsed:?} (start_timeout {timeout})"
    );
    let states = connection_states(&d, "outbox");
    if mode_text == "silent" {
        // Still within its start_timeout: connecting, and nothing of it offered.
        assert_eq!(states, [("connecting".to_string(), String::new())]);
    } else {
        assert!(
            states
                .iter()
                .any(|(to, why)| to == "disconnected" && why.contains("exited")),
            "{states:?}"
        );
    }
    assert!(
        connection_states(&d, "notes")
            .iter()
            .any(|(to, _)| to == "ready")
    );
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn an_upstream_that_exits_at_start_does_not_stop_the_others() {
    broken_at_start("exit", "10s").await;
}

#[tokio::test]
async fn a_silent_upstream_at_start_does_not_hold_up_the_others() {
    // Its start_timeout is far longer than the whole test may take.
    broken_at_start("silent", "60s").await;
}

#[tokio::test]
async fn an_upstream_that_cannot_be_executed_does_not_stop_the_others() {
    let d = Deployment::with_notes().mapping("source-library");
    d.approve_all();
    let program = d.dir.path().join("not-a-program");
    std::fs::write(&program, "#!/bin/sh\nexit 0\n").unwrap(); // mode 0644: not executable
    let d = d
        .connection(&format!(
            "[[connection]]\nname = \"outbox\"\ncommand = {:?}\nconfine = false\n",
            program.display().to_string()
        ))
        .mapping("outbox-delivery");
    let (client, _notices, _pid) = serve_counting(&d).await;
    let tools = client.peer().list_all_tools().await.unwrap();
    assert_eq!(tool_names(&tools), ["retrieve_source", "search_sources"]);
    let hits = call(&client, "search_sources", json!({"query": "wal"}))
        .await
        .unwrap();
    assert_ne!(hits.is_error, Some(true), "{}", text_of(&hits));
    let states = connection_states(&d, "outbox");
    assert!(
        states
            .iter()
            .any(|(to, why)| to == "disconnected" && why.contains("starting upstream server")),
        "{states:?}"
    );
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn a_failed_upstream_comes_back_judged_and_announced() {
    let (d, mode) = with_switchable_outbox();
    d.approve_all();
    std::fs::write(&mode, "exit").unwrap();
    let (client, notices, _pid) = serve_counting(&d).await;
    let before = notices.count();
    let tools = client.peer().list_all_tools().await.unwrap();
    assert_eq!(tool_names(&tools), ["retrieve_source", "search_sources"]);
    // The server works again: the background retry starts, snapshots and judges it.
    std::fs::remove_file(&mode).unwrap();
    assert!(
        notices.wait_beyond(before, 30).await,
        "list_changed when outbox is ready"
    );
    let (ok, names) = until_names(&client, 10, |names| {
        OUTBOX_TOOLS.iter().all(|t| names.contains(&t.to_string()))
    })
    .await;
    assert!(ok, "{names:?}");
    let states: Vec<String> = connection_states(&d, "outbox")
        .into_iter()
        .map(|s| s.0)
        .collect();
    assert_eq!(
        states.first().map(String::as_str),
        Some("connecting"),
        "{states:?}"
    );
    assert_eq!(
        states.last().map(String::as_str),
        Some("ready"),
        "{states:?}"
    );
    assert!(states.contains(&"disconnected".to_string()), "{states:?}");
    client.cancel().await.unwrap();
}

/// Waits (up to `secs`) until tools/list satisfies `want`; returns the last names seen.
async fn until_names<H: rmcp::ClientHandler>(
    client: &rmcp::service::RunningService<rmcp::service::RoleClient, H>,
    secs: u64,
    want: impl Fn(&[String]) -> bool,
) -> (bool, Vec<String>) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let names = client
            .peer()
            .list_all_tools()
            .await
            .map(|t| tool_names(&t))
            .unwrap_or_default();
        if want(&names) || Instant::now() > deadline {
            return (want(&names), names);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_killed_upstream_leaves_the_list_is_reaped_and_comes_back() {
    let d = Deployment::with_notes().mapping("source-library");
    d.approve_all();
    let (client, notices, airlock) = serve_counting(&d).await;
    assert_eq!(
        tool_names(&client.peer().list_all_tools().await.unwrap()),
        ["retrieve_source", "search_sources"]
    );
    let server = upstream_child(airlock, "notes-server").await;
    let seen = notices.count();
    kill(server, libc::SIGKILL);
    assert!(
        notices.wait_beyond(seen, 10).await,
        "the client is told the list changed"
    );
    // Reaped at once: no zombie child left behind.
    assert!(
        until(3, || !children(airlock).iter().any(|c| c.1 == 'Z')).await,
        "zombie children: {:?}",
        children(airlock)
    );
    let during = client.peer().list_all_tools().await.unwrap();
    let back_already = tool_names(&during).contains(&"search_sources".to_string());
    if !back_already {
        // A call meanwhile gets an answer the model can read, at once.
        let started = Instant::now();
        let answer = call(&client, "search_sources", json!({"query": "wal"})).await;
        assert!(started.elapsed() < Duration::from_secs(5));
        match answer {
            Ok(result) => {
                assert_eq!(result.is_error, Some(true), "{}", text_of(&result));
            }
            Err(e) => {
                assert!(
                    error_code(&e).is_some(),
                    "a JSON-RPC answer, not a hang: {e}"
                );
            }
        }
    }
    // It comes back, re-snapshotted and judged, and serves again.
    let (ok, names) = until_names(&client, 20, |names| {
        names == ["retrieve_source", "search_sources"]
    })
    .await;
    assert!(ok, "{names:?}");
    let hits = call(&client, "search_sources", json!({"query": "checkpoint"}))
        .await
        .unwrap();
    assert_ne!(hits.is_error, Some(true), "{}", text_of(&hits));
    let again = upstream_child(airlock, "notes-server").await;
    assert_ne!(again, server, "a new server process");
    let states: Vec<String> = connection_states(&d, "notes")
        .into_iter()
        .map(|s| s.0)
        .collect();
    assert_eq!(
        states,
        ["connecting", "ready", "disconnected", "ready"],
        "every transition is traced"
    );
    assert!(
        d.trace()
            .iter()
            .any(|e| e["kind"] == "connection-restarted" && e["subject"] == "notes")
    );
    client.cancel().await.unwrap();
}

/// An upstream that stops answering (frozen with SIGSTOP) is taken out of service after
/// three calls in a row ran into their deadline: `stalled`, traced and announced, its tools
/// gone, so later calls do not wait for deadlines; once it answers again (SIGCONT; the
/// host probes it with `ping`) it is `ready` and serves, with no restart.
#[tokio::test]
async fn a_frozen_upstream_is_stalled_after_three_missed_deadlines_and_recovers() {
    let d = Deployment::with_notes().mapping_edited("source-library", |t| {
        t.replace("deadline_ms = 5000", "deadline_ms = 400")
    });
    d.approve_all();
    let (client, notices, airlock) = serve_counting(&d).await;
    let search = || call(&client, "search_sources", json!({"query": "wal"}));
    assert_ne!(search().await.unwrap().is_error, Some(true));
    let server = upstream_child(airlock, "notes-server").await;
    kill(server, libc::SIGSTOP);
    for _ in 0..3 {
        let r = search().await.unwrap();
        assert_refused(&r, airlock::pipeline::Category::Interrupted);
    }
    let (ok, names) = until_names(&client, 10, |names| names.is_empty()).await;
    assert!(ok, "its tools leave the list: {names:?}");
    let seen = notices.count();
    assert!(seen > 0, "the client was told the list changed");
    // A call now is refused at once, not after a deadline.
    let started = Instant::now();
    match search().await {
        Ok(r) => assert_eq!(r.is_error, Some(true), "{}", text_of(&r)),
        Err(e) => assert!(error_code(&e).is_some(), "{e}"),
    }
    assert!(started.elapsed() < Duration::from_millis(300));

    kill(server, libc::SIGCONT);
    let (ok, names) = until_names(&client, 10, |names| {
        names == ["retrieve_source", "search_sources"]
    })
    .await;
    assert!(ok, "back once it answers: {names:?}");
    assert_ne!(search().await.unwrap().is_error, Some(true));
    assert_eq!(
        upstream_child(airlock, "notes-server").await,
        server,
        "the same process: not restarted"
    );
    let states = connection_states(&d, "notes");
    let names: Vec<&str> = states.iter().map(|s| s.0.as_str()).collect();
    assert_eq!(names, ["connecting", "ready", "stalled", "ready"]);
    assert!(
        states[2].1.contains("3 requests in a row unanswered"),
        "{states:?}"
    );
    client.cancel().await.unwrap();
}

/// The notes connection run as `sh -c 'sleep & exec notes-server'`: the server has a
/// child of its own in its process group.
fn notes_with_a_grandchild(d: Deployment) -> Deployment {
    let log = d.dir.path().join("calls.jsonl");
    let script = format!(
        "sleep 1000 & exec '{}' fixture notes-server --call-log '{}'",
        airlock_bin().display(),
        log.display()
    );
    d.replace_connections(&format!(
        "[[connection]]\nname = \"notes\"\ncommand = \"sh\"\nargs = [\"-c\", {script:?}]\nenv = {{ PATH = \"/usr/bin:/bin\" }}\nconfine = false\n"
    ))
}

#[tokio::test]
async fn sigterm_stops_every_process_of_the_upstream_group() {
    let d = notes_with_a_grandchild(Deployment::with_notes()).mapping("source-library");
    d.approve_all();
    let mut cmd = d.serve_command();
    cmd.stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let transport = TokioChildProcess::new(cmd).unwrap();
    let airlock = transport.id().unwrap();
    let client = ().serve(transport).await.unwrap();
    assert_eq!(client.peer().list_all_tools().await.unwrap().len(), 2);
    let server = upstream_child(airlock, "notes-server").await;
    let pgid = stat(server).unwrap().3;
    assert_eq!(pgid, server, "the server leads its own process group");
    assert_ne!(pgid, stat(airlock).unwrap().3, "not the host's group");
    assert!(
        until(5, || group_alive(pgid).len() >= 2).await,
        "the server and its sleep: {:?}",
        group_alive(pgid)
    );
    kill(airlock, libc::SIGTERM);
    assert!(
        until(15, || !alive(airlock)).await,
        "airlock stops on SIGTERM"
    );
    assert!(
        until(5, || group_alive(pgid).is_empty()).await,
        "left running: {:?}",
        group_alive(pgid)
    );
    drop(client);
}

#[tokio::test]
async fn stdin_eof_stops_every_process_of_the_upstream_group() {
    let d = notes_with_a_grandchild(Deployment::with_notes()).mapping("source-library");
    d.approve_all();
    let (client, airlock) = d.serve_with_pid().await;
    let server = upstream_child(airlock, "notes-server").await;
    assert!(until(5, || group_alive(server).len() >= 2).await);
    // Closing the client closes airlock's stdin.
    client.cancel().await.unwrap();
    assert!(until(15, || !alive(airlock)).await, "airlock stops at EOF");
    assert!(
        until(5, || group_alive(server).is_empty()).await,
        "left running: {:?}",
        group_alive(server)
    );
}

#[tokio::test]
async fn kill_9_of_airlock_takes_its_upstream_servers_with_it() {
    let (d, _mode) = with_switchable_outbox();
    d.approve_all();
    let (client, airlock) = d.serve_with_pid().await;
    let notes = upstream_child(airlock, "notes-server").await;
    let outbox = upstream_child(airlock, "delivery-server").await;
    kill(airlock, libc::SIGKILL);
    assert!(
        until(10, || !alive(notes) && !alive(outbox)).await,
        "children outlived a killed host: notes {:?}, outbox {:?}",
        stat(notes),
        stat(outbox)
    );
    drop(client);
}

#[test]
fn discover_of_a_silent_server_times_out_and_leaves_nothing() {
    let d = Deployment::with_notes().mapping("source-library");
    // A unique duration names this test's processes.
    let marker = format!("{}", 100_000 + std::process::id());
    let script = format!("sleep {marker} & exec sleep {marker}");
    let d = d
        .connection(&format!(
            "[[connection]]\nname = \"silent\"\ncommand = \"sh\"\nargs = [\"-c\", {script:?}]\nenv = {{ PATH = \"/usr/bin:/bin\" }}\n"
        ))
        .top("start_timeout = \"2s\"\n");
    let config = d.write_config();
    let started = Instant::now();
    let out = d.airlock(&["discover", "silent", "--config", config.to_str().unwrap()]);
    let elapsed = started.elapsed();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("start_timeout") || stderr.contains("no answer to initialize"),
        "{stderr}"
    );
    assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
    let leftovers = || {
        all_processes()
            .into_iter()
            .filter(|p| p.1 != 'Z' && cmdline(p.0).contains(&format!("sleep {marker}")))
            .map(|p| p.0)
            .collect::<Vec<_>>()
    };
    let deadline = Instant::now() + Duration::from_secs(3);
    while !leftovers().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(leftovers().is_empty(), "left running: {:?}", leftovers());
}

#[tokio::test]
async fn a_mapping_whose_component_does_not_match_its_pin_is_refused_alone() {
    let d = Deployment::with_notes()
        .mapping("source-library")
        .with_outbox(&[]);
    d.approve_all();
    let wasm = d
        .mapping_dir("outbox-delivery")
        .join("outbox_delivery.wasm");
    let mut bytes = std::fs::read(&wasm).unwrap();
    bytes.extend_from_slice(&[0x00, 0x05, 0x04, b'e', b'v', b'i', b'l']);
    std::fs::write(&wasm, &bytes).unwrap();
    let outbox_before = d.outbox_calls().len();
    let client = d.serve_unreviewed().await;
    let tools = client.peer().list_all_tools().await.unwrap();
    assert_eq!(tool_names(&tools), ["retrieve_source", "search_sources"]);
    let failed: Vec<Value> = d
        .trace()
        .into_iter()
        .filter(|e| e["kind"] == "mapping-load-failed")
        .collect();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0]["payload"]["mapping"], "outbox-delivery");
    assert!(
        failed[0]["payload"]["error"]
            .as_str()
            .unwrap()
            .contains("sha256"),
        "{failed:?}"
    );
    assert_eq!(
        d.outbox_calls().len(),
        outbox_before,
        "a refused component causes no upstream traffic"
    );
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn a_second_mapping_offering_the_same_capability_name_is_refused_alone() {
    let d = Deployment::with_notes()
        .mapping("source-library")
        .mapping_edited_as("source-library", "source-library-copy", |t| {
            t.replacen(
                "name = \"source-library\"",
                "name = \"source-library-copy\"",
                1,
            )
        });
    d.approve_all();
    let client = d.serve_unreviewed().await;
    let tools = client.peer().list_all_tools().await.unwrap();
    assert_eq!(tool_names(&tools), ["retrieve_source", "search_sources"]);
    let hits = call(&client, "search_sources", json!({"query": "wal"}))
        .await
        .unwrap();
    assert_ne!(hits.is_error, Some(true), "{}", text_of(&hits));
    let failed: Vec<Value> = d
        .trace()
        .into_iter()
        .filter(|e| e["kind"] == "mapping-load-failed")
        .collect();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0]["payload"]["mapping"], "source-library-copy");
    let error = failed[0]["payload"]["error"].as_str().unwrap();
    assert!(
        error.contains("offered by two mappings") && error.contains("search_sources"),
        "{error}"
    );
    client.cancel().await.unwrap();
}
