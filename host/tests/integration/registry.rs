//! The registry against real processes: connection identity, discovery snapshots, drift,
//! pins and mapping lifecycle, the hash-chained trace, the store's failure modes.

use crate::common::*;
use airlock::pipeline::Category;
use serde_json::{Value, json};

/// A deployment whose notes server drifts (`--drift-on-call KIND`) after its first
/// tools/call.
fn drifting(kind: &str) -> Deployment {
    let d = Deployment::with_notes();
    d.notes_args(&["--drift-on-call", kind])
        .mapping("source-library")
}

fn refused_as_state_changed(result: &rmcp::model::CallToolResult) -> bool {
    result.is_error == Some(true) && text_of(result).starts_with("state changed:")
}

/// Each drift kind, arriving mid-session: the server's list_changed notification makes the
/// very next call re-check, find the pinned tool changed, refuse with "state changed"
/// before anything reaches the server, notify the client, and drop the capabilities from
/// tools/list. The review shows the classified change.
#[tokio::test]
async fn each_drift_kind_mid_session_blocks_the_next_call_before_the_server() {
    let cases = [
        ("description", "description-changed", "read_note"),
        ("schema", "type-changed", "read_note"),
        ("required", "required-property-added", "read_note"),
        ("annotations", "annotations-changed", "read_note"),
        ("rename", "possibly-renamed", "fetch_note"),
        ("remove", "removed", "read_note"),
    ];
    for (kind, change, key) in cases {
        let d = drifting(kind);
        d.approve_all();
        let notices = Notices::default();
        let client = d.serve_with(notices.clone()).await;
        let tools = client.peer().list_all_tools().await.unwrap();
        assert_eq!(
            tools.len(),
            2,
            "{kind}: both capabilities offered before drift"
        );

        // The first call reaches the server, which drifts and notifies before answering.
        let hits = call(&client, "search_sources", json!({"query": "checkpoint"}))
            .await
            .unwrap();
        assert_ne!(hits.is_error, Some(true), "{kind}: {}", text_of(&hits));
        let reference = references(&hits)[0].clone();
        assert_eq!(d.upstream_tool_calls(), ["search_notes"], "{kind}");

        // The very next call is refused before it reaches the server.
        let next = call(&client, "retrieve_source", json!({"reference": reference}))
            .await
            .unwrap();
        assert!(
            refused_as_state_changed(&next),
            "{kind}: {}",
            text_of(&next)
        );
        assert!(
            text_of(&next).contains("review-required"),
            "{kind}: {}",
            text_of(&next)
        );
        let again = call(&client, "search_sources", json!({"query": "wal"}))
            .await
            .unwrap();
        assert!(refused_as_state_changed(&again), "{kind}");
        assert_eq!(
            d.upstream_tool_calls(),
            ["search_notes"],
            "{kind}: a refused call reached the server"
        );

        // The client was told, and the capabilities left the catalogue.
        assert!(
            notices.wait_beyond(0, 10).await,
            "{kind}: no tools/list_changed"
        );
        let tools = client.peer().list_all_tools().await.unwrap();
        assert!(tools.is_empty(), "{kind}: still offered: {tools:?}");
        client.cancel().await.ok();

        // The store says why, with the classified drift.
        let show = d.airlock_json(&["review", "show", "source-library"]);
        assert_eq!(
            show["current"]["state"], "review-required",
            "{kind}: {show:#}"
        );
        let events = d.trace();
        let found = events
            .iter()
            .find(|e| e["kind"] == "drift-found")
            .unwrap_or_else(|| panic!("{kind}: no drift-found event"));
        let drift = found["payload"]["drift"].as_array().unwrap();
        assert!(
            drift
                .iter()
                .any(|d| d["change"] == change && d["key"] == key && d["item"] == "tool"),
            "{kind}: expected {change} on {key}, got {drift:?}"
        );
        if kind == "rename" {
            // The renamed tool is not followed: the pins name read_note only.
            assert_eq!(
                drift
                    .iter()
                    .find(|d| d["change"] == "possibly-renamed")
                    .unwrap()["from"],
                "read_note"
            );
            assert!(!d.upstream_tool_calls().contains(&"fetch_note".to_string()));
        }
        assert!(
            events
                .iter()
                .any(|e| e["kind"] == "call-refused" && e["payload"]["state"] == "review-required"),
            "{kind}: refusal not traced"
        );
        assert!(d.airlock_ok(&["trace", "verify"]).contains("intact"));
    }
}

/// The server restarts with other arguments and a drifted catalogue: a new configuration
/// revision, so the mapping needs review before it serves; `discover` shows the drift;
/// a new approval restores service as a new revision.
#[tokio::test]
async fn drift_seen_at_start_requires_review_and_a_new_approval_restores_service() {
    let d = Deployment::with_notes().mapping("source-library");
    d.approve_all();
    let d = d.notes_args(&["--drift", "description"]);
    let client = d.serve_unreviewed().await;
    assert!(client.peer().list_all_tools().await.unwrap().is_empty());
    client.cancel().await.ok();
    let show = d.airlock_json(&["review", "show", "source-library"]);
    assert_eq!(show["current"]["state"], "review-required");
    assert!(
        show["current"]["reason"]
            .as_str()
            .unwrap()
            .contains("connection configuration changed"),
        "{show:#}"
    );
    let config = d.write_config();
    let discovered = d.airlock_json(&["discover", "notes", "--config", config.to_str().unwrap()]);
    assert_eq!(discovered["config_revision"], 2);
    // Against the pinned snapshot, the reviewer sees what changed.
    assert_eq!(discovered["mappings"][0]["would_serve"], false);
    assert!(
        discovered["mappings"][0]["drift"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["change"] == "description-changed" && x["key"] == "read_note"),
        "{discovered:#}"
    );
    // A reviewer approves the new catalogue: a new revision that serves.
    d.approve("source-library", "bob", &[]);
    let client = d.serve_unreviewed().await;
    assert_eq!(client.peer().list_all_tools().await.unwrap().len(), 2);
    let r = call(&client, "search_sources", json!({"query": "wal"}))
        .await
        .unwrap();
    assert_ne!(r.is_error, Some(true), "{}", text_of(&r));
    client.cancel().await.ok();
    let revisions = d.airlock_json(&["review", "show", "source-library"])["revisions"].clone();
    let states: Vec<&str> = revisions
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["state"].as_str().unwrap())
        .collect();
    assert_eq!(
        states,
        ["historical", "historical", "active"],
        "{revisions:#}"
    );
    assert!(
        revisions[1]["reason"]
            .as_str()
            .unwrap()
            .contains("(was review-required)"),
        "{revisions:#}"
    );
}

/// Two connections whose servers report the same display name share nothing: separate
/// ids and snapshots, and an approval for one does not let a mapping on the other serve.
#[tokio::test]
async fn a_server_with_the_same_display_name_inherits_nothing() {
    let d = Deployment::with_notes()
        .connection(
            "[[connection]]\nname = \"twin\"\ncommand = \"@airlock\"\nargs = [\"fixture\", \"notes-server\", \"--twin\"]\n",
        )
        .mapping("source-library")
        .mapping_edited_as("source-library", "twin-library", |t| {
            t.replace("name = \"source-library\"", "name = \"twin-library\"")
                .replace("connection = \"notes\"", "connection = \"twin\"")
                .replace("name = \"search_sources\"", "name = \"twin_search\"")
                .replace("name = \"retrieve_source\"", "name = \"twin_retrieve\"")
        });
    let config = d.write_config();
    let config = config.to_str().unwrap();
    let notes = d.airlock_json(&["discover", "notes", "--config", config]);
    let twin = d.airlock_json(&["discover", "twin", "--config", config]);
    assert_eq!(
        notes["server"]["name"], twin["server"]["name"],
        "same display name"
    );
    assert_ne!(notes["connection_id"], twin["connection_id"]);
    assert_ne!(notes["snapshot"], twin["snapshot"]);
    d.approve("source-library", "alice", &[]);

    // The twin's mapping cannot borrow the other connection's snapshot...
    let out = d.airlock(&[
        "review",
        "approve",
        "twin-library",
        "--config",
        config,
        "--reviewer",
        "mallory",
        "--snapshot",
        notes["snapshot"].as_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("belongs to"), "{err}");

    // ...and is not offered: it was never approved for its own connection.
    let client = d.serve_unreviewed().await;
    let names: Vec<String> = client
        .peer()
        .list_all_tools()
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.name.to_string())
        .collect();
    assert_eq!(names, ["retrieve_source", "search_sources"]);
    // Never offered to this session: unknown, with no hint that it exists.
    let r = call(&client, "twin_search", json!({"query": "x"})).await;
    assert_eq!(r.as_ref().err().and_then(error_code), Some(-32602), "{r:?}");
    client.cancel().await.ok();
    let show = d.airlock_json(&["review", "show", "twin-library"]);
    assert_eq!(show["current"]["state"], "candidate");
}

/// Changing the connection's executable (same path, different bytes) is a new
/// configuration revision: the mapping moves to review-required and is not offered.
#[tokio::test]
async fn changing_the_connection_executable_requires_review() {
    let d = Deployment::with_notes();
    // Installed under app/ (a confined server reads its install folder, the one above
    // `bin`: never the deployment folder, which holds the state).
    let bin = d.dir.path().join("app/bin");
    std::fs::create_dir_all(&bin).unwrap();
    let exe = bin.join("notes-server");
    std::fs::copy(airlock_bin(), &exe).unwrap();
    let d = d
        .replace_connections(&format!(
            "[[connection]]\nname = \"notes\"\ncommand = {:?}\nargs = [\"fixture\", \"notes-server\"]\n",
            exe.display().to_string()
        ))
        .mapping("source-library");
    let client = d.serve().await;
    assert_eq!(client.peer().list_all_tools().await.unwrap().len(), 2);
    client.cancel().await.ok();

    // Same path, one byte more: a different executable, installed the way an upgrade
    // is (write beside, rename over).
    use std::io::Write as _;
    let next = bin.join("notes-server.new");
    std::fs::copy(&exe, &next).unwrap();
    std::fs::OpenOptions::new()
        .append(true)
        .open(&next)
        .unwrap()
        .write_all(b"\0")
        .unwrap();
    std::fs::rename(&next, &exe).unwrap();
    let client = d.serve_unreviewed().await;
    assert!(client.peer().list_all_tools().await.unwrap().is_empty());
    // Never offered to this session: unknown, with no hint that it exists.
    let r = call(&client, "search_sources", json!({"query": "x"})).await;
    assert_eq!(r.as_ref().err().and_then(error_code), Some(-32602), "{r:?}");
    client.cancel().await.ok();
    let show = d.airlock_json(&["review", "show", "source-library"]);
    assert_eq!(show["current"]["state"], "review-required");
    assert_eq!(show["current"]["config_revision"], 2);
    assert!(
        d.trace()
            .iter()
            .any(|e| e["kind"] == "connection-revision" && e["payload"]["revision"] == 2)
    );
}

/// An approval recorded while the host serves is picked up without a restart, and the
/// client is told the tool list changed; a retirement takes the capabilities away again.
#[tokio::test]
async fn approval_and_retirement_reach_a_running_host() {
    let d = Deployment::with_notes().mapping("source-library");
    let notices = Notices::default();
    let client = d.serve_with(notices.clone()).await;
    assert!(client.peer().list_all_tools().await.unwrap().is_empty());
    // Never offered to this session: unknown, with no hint that it exists.
    let r = call(&client, "search_sources", json!({"query": "x"})).await;
    assert_eq!(r.as_ref().err().and_then(error_code), Some(-32602), "{r:?}");
    assert!(d.upstream_tool_calls().is_empty());

    d.approve("source-library", "alice", &[]);
    assert!(
        notices.wait_beyond(0, 10).await,
        "no tools/list_changed after approval"
    );
    assert_eq!(client.peer().list_all_tools().await.unwrap().len(), 2);
    let r = call(&client, "search_sources", json!({"query": "wal"}))
        .await
        .unwrap();
    assert_ne!(r.is_error, Some(true), "{}", text_of(&r));

    let seen = notices.count();
    d.airlock_ok(&["review", "retire", "source-library", "--reviewer", "alice"]);
    assert!(
        notices.wait_beyond(seen, 10).await,
        "no tools/list_changed after retirement"
    );
    assert!(client.peer().list_all_tools().await.unwrap().is_empty());
    let r = call(&client, "search_sources", json!({"query": "wal"}))
        .await
        .unwrap();
    assert!(refused_as_state_changed(&r), "{}", text_of(&r));
    assert_eq!(d.upstream_tool_calls(), ["search_notes"]);
    client.cancel().await.ok();
}

/// Approval needs a snapshot of the current configuration and every listed tool present.
#[test]
fn approval_refuses_what_it_cannot_pin() {
    let d = Deployment::with_notes().mapping("source-library");
    let config = d.write_config();
    let config = config.to_str().unwrap();
    // No snapshot yet.
    let out = d.airlock(&[
        "review",
        "approve",
        "source-library",
        "--config",
        config,
        "--reviewer",
        "a",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("airlock discover notes"));
    // A snapshot that lacks a listed tool.
    let d = d.notes_args(&["--drift", "remove"]);
    let config = d.write_config();
    let config = config.to_str().unwrap();
    d.airlock_ok(&["discover", "notes", "--config", config]);
    let out = d.airlock(&[
        "review",
        "approve",
        "source-library",
        "--config",
        config,
        "--reviewer",
        "a",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no tool named read_note"));
    // Empty reviewer, unknown mapping.
    let out = d.airlock(&[
        "review",
        "approve",
        "source-library",
        "--config",
        config,
        "--reviewer",
        " ",
    ]);
    assert!(!out.status.success());
    let out = d.airlock(&[
        "review",
        "approve",
        "nope",
        "--config",
        config,
        "--reviewer",
        "a",
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("no configured mapping is named `nope`"));
}

/// Snapshots are content-addressed: the same catalogue seen twice is stored once with two
/// observations; `snapshots show` lists each tool's digests; a paginated server's lists are
/// complete.
#[test]
fn snapshots_are_stored_once_and_pagination_is_followed() {
    let d = Deployment::with_notes();
    let d = d
        .notes_args(&["--page-size", "2", "--extra-tools", "5"])
        .mapping("source-library");
    let config = d.write_config();
    let config = config.to_str().unwrap();
    let a = d.airlock_json(&["discover", "notes", "--config", config]);
    let b = d.airlock_json(&["discover", "notes", "--config", config]);
    assert_eq!(a["snapshot"], b["snapshot"]);
    assert_eq!(a["new_snapshot"], true);
    assert_eq!(b["new_snapshot"], false);
    assert_eq!(
        a["counts"]["tools"], 8,
        "3 tools + 5 synthetic over 4 pages"
    );
    assert_eq!(a["counts"]["resources"], 7);
    assert_eq!(a["counts"]["prompts"], 1);
    assert_eq!(a["counts"]["resource_templates"], 1);
    assert_eq!(b["drift"], json!([]));
    let list = d.airlock_json(&["snapshots", "list"]);
    assert_eq!(list.as_array().unwrap().len(), 1);
    assert_eq!(list[0]["observations"], 2);
    let digest = a["snapshot"].as_str().unwrap();
    let shown = d.airlock_ok(&["snapshots", "show", &digest[..10]]);
    assert!(shown.contains("read_note"), "{shown}");
    assert!(shown.contains("synthetic_0004"), "{shown}");
    let raw = d.airlock_json(&["snapshots", "show", digest]);
    assert_eq!(raw["body"]["tools"].as_array().unwrap().len(), 8);
    // Pages were requested, as the call log shows.
    let lists = d
        .upstream_calls()
        .iter()
        .filter(|c| c["method"] == "tools/list")
        .count();
    assert_eq!(lists, 8, "4 pages per discovery, 2 discoveries");
}

/// The trace is tamper-evident: editing one event's payload in the database is caught by
/// `airlock trace verify`, which names the event and exits 3.
#[tokio::test]
async fn trace_verify_catches_an_edited_row() {
    let d = Deployment::with_notes().mapping("source-library");
    let client = d.serve().await;
    call(&client, "search_sources", json!({"query": "wal"}))
        .await
        .unwrap();
    client.cancel().await.ok();
    assert!(d.airlock_ok(&["trace", "verify"]).contains("intact"));
    let events = d.trace();
    let victim = events
        .iter()
        .find(|e| e["kind"] == "mapping-revision" && e["payload"]["reviewer"] == "tests")
        .expect("the approval is traced");
    let seq = victim["seq"].as_i64().unwrap();

    let db = rusqlite::Connection::open(d.state_dir().join("airlock.db")).unwrap();
    // An attacker with the file drops the append-only triggers first.
    let triggers: Vec<String> = db
        .prepare("SELECT name FROM sqlite_master WHERE type = 'trigger'")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    for t in triggers {
        db.execute_batch(&format!("DROP TRIGGER \"{t}\"")).unwrap();
    }
    let changed = db
        .execute(
            "UPDATE trace_events SET payload = replace(payload, '\"tests\"', '\"nobody\"') WHERE seq = ?1",
            [seq],
        )
        .unwrap();
    assert_eq!(changed, 1);
    drop(db);

    let out = d.airlock(&["trace", "verify"]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&format!("TAMPERED at event {seq}")), "{text}");
    let json = d.airlock(&["trace", "verify", "--json"]);
    let v: Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v["first_bad"][0], seq);
}

/// A corrupt database is refused with a clear error; nothing is overwritten and nothing
/// reaches the upstream server.
#[test]
fn a_corrupt_database_gives_a_clear_error_and_is_left_alone() {
    let d = Deployment::with_notes().mapping("source-library");
    std::fs::create_dir_all(d.state_dir()).unwrap();
    let db = d.state_dir().join("airlock.db");
    let garbage: Vec<u8> = (0..8192u32).map(|i| (i * 7 + 3) as u8).collect();
    std::fs::write(&db, &garbage).unwrap();
    let (ok, stderr) = d.serve_expecting_failure();
    assert!(!ok);
    assert!(
        stderr.contains("not a readable SQLite database"),
        "{stderr}"
    );
    assert!(stderr.contains("nothing was changed"), "{stderr}");
    assert_eq!(std::fs::read(&db).unwrap(), garbage);
    assert!(d.upstream_calls().is_empty(), "{:?}", d.upstream_calls());
    let out = d.airlock(&["trace", "verify"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a readable SQLite database"));
}

/// `airlock grants` with the store: each upstream tool's pinned digests and the server's
/// hints, the contract's effect class, and `--diff REV` listing what changed since an
/// earlier revision (a raised limit, new pins).
#[test]
fn grants_shows_pins_effect_class_and_changes_since_a_revision() {
    let d = Deployment::with_notes().mapping("source-library");
    d.approve_all();
    let manifest = d.manifests()[0].clone();
    let text = std::fs::read_to_string(&manifest).unwrap();
    std::fs::write(
        &manifest,
        text.replace("memory_mib = 64", "memory_mib = 96"),
    )
    .unwrap();
    d.approve("source-library", "bob", &[]);
    let m = manifest.to_str().unwrap();
    let out = d.airlock_ok(&["grants", m, "--diff", "1"]);
    assert!(out.contains("6. Registry"), "{out}");
    assert!(out.contains("effect class           read"), "{out}");
    assert!(
        out.contains("state                  active (approved by bob)"),
        "{out}"
    );
    assert!(out.contains("(server hints, untrusted: read-only"), "{out}");
    assert!(!out.contains("not pinned"), "{out}");
    assert!(
        out.contains("7. Changes since revision 1 (latest: 2)"),
        "{out}"
    );
    assert!(out.contains("~ limits.memory_mib: 64 -> 96"), "{out}");
    assert!(out.contains("~ reviewer: tests -> bob"), "{out}");
    let json = d.airlock_json(&["grants", m]);
    assert_eq!(json["registry"]["revision"], 2);
    assert_eq!(json["registry"]["manifest_matches"], true);
    let pinned = json["upstream"]["tools"][0]["digest"].as_str().unwrap();
    assert_eq!(pinned.len(), 64);
    // The manifest edited after review no longer matches the recorded revision.
    std::fs::write(
        &manifest,
        text.replace("memory_mib = 64", "memory_mib = 128"),
    )
    .unwrap();
    let json = d.airlock_json(&["grants", m]);
    assert_eq!(json["registry"]["manifest_matches"], false);
    let html = d.airlock_ok(&["grants", m, "--html", "--diff", "1"]);
    assert!(
        html.contains("<h2>Registry</h2>") && html.contains("memory_mib"),
        "{html}"
    );
    let out = d.airlock(&["grants", m, "--diff", "9"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("has no revision 9"));
}

/// `snapshot_interval` re-discovers on a timer even when the server never announces a
/// change; an unchanged catalogue is one stored snapshot with several observations.
#[tokio::test]
async fn the_snapshot_interval_re_discovers_on_a_timer() {
    let d = Deployment::with_notes()
        .top("snapshot_interval = \"1s\"\n")
        .mapping("source-library");
    let client = d.serve().await;
    tokio::time::sleep(std::time::Duration::from_millis(3300)).await;
    client.cancel().await.ok();
    let list = d.airlock_json(&["snapshots", "list"]);
    assert_eq!(list.as_array().unwrap().len(), 1, "{list:#}");
    // discover (approval) + start + at least two ticks, one stored body.
    assert!(list[0]["observations"].as_u64().unwrap() >= 4, "{list:#}");
    // The trace records changes, not repetitions: one snapshot-taken per process start.
    let taken = d
        .trace()
        .iter()
        .filter(|e| e["kind"] == "snapshot-taken" && e["subject"] == "notes")
        .count();
    assert_eq!(taken, 2, "discover + serve start");
}

/// A revision approved for another manifest does not keep a host serving the old one when
/// it is retired: the latest revision's state reaches a host that still runs the old
/// manifest (a static `[[mapping]]`, no reload).
#[tokio::test]
async fn retiring_a_later_revision_stops_a_host_running_an_earlier_manifest() {
    let d = Deployment::with_notes().mapping("source-library");
    let notices = Notices::default();
    d.approve_all();
    let client = d.serve_with(notices.clone()).await;
    assert_eq!(client.peer().list_all_tools().await.unwrap().len(), 2);
    let manifest = d.manifests()[0].clone();
    let text = std::fs::read_to_string(&manifest).unwrap();
    std::fs::write(
        &manifest,
        text.replace("memory_mib = 64", "memory_mib = 65"),
    )
    .unwrap();
    d.approve("source-library", "a", &[]);
    // Approved ahead of deployment: the running (earlier) manifest serves on.
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    let r = call(&client, "search_sources", json!({"query": "wal"}))
        .await
        .unwrap();
    assert_ne!(r.is_error, Some(true), "{}", text_of(&r));
    d.airlock_ok(&["review", "retire", "source-library", "--reviewer", "a"]);
    assert!(notices.wait_beyond(0, 10).await, "no tools/list_changed");
    assert!(client.peer().list_all_tools().await.unwrap().is_empty());
    let r = call(&client, "search_sources", json!({"query": "wal"}))
        .await
        .unwrap();
    assert!(refused_as_state_changed(&r), "{}", text_of(&r));
    assert_eq!(d.upstream_tool_calls(), ["search_notes"]);
    client.cancel().await.ok();
}

/// An interpreter's script and the environment's values are part of the connection's
/// identity: changing either is a new configuration revision, so mappings need review.
#[test]
fn an_interpreter_script_or_an_env_value_change_is_a_new_revision() {
    let d = Deployment::with_notes();
    let script = d.dir.path().join("notes.sh");
    let body = format!(
        "exec {:?} fixture notes-server \"$@\"\n",
        airlock_bin().display().to_string()
    );
    std::fs::write(&script, &body).unwrap();
    let connection = |value: &str| {
        format!(
            "[[connection]]\nname = \"notes\"\ncommand = \"sh\"\nargs = [{:?}]\nenv = {{ MODE = {value:?} }}\nconfine = false\n",
            script.display().to_string()
        )
    };
    let d = d
        .replace_connections(&connection("a"))
        .mapping("source-library");
    let config = d.write_config();
    let config = config.to_str().unwrap();
    let first = d.airlock_json(&["discover", "notes", "--config", config]);
    assert_eq!(first["config_revision"], 1);
    let same = d.airlock_json(&["discover", "notes", "--config", config]);
    assert_eq!(same["config_revision"], 1, "nothing changed");
    std::fs::write(&script, format!("# patched\n{body}")).unwrap();
    let patched = d.airlock_json(&["discover", "notes", "--config", config]);
    assert_eq!(patched["config_revision"], 2, "the script changed");
    let d = d.replace_connections(&connection("b"));
    let config = d.write_config();
    let changed = d.airlock_json(&["discover", "notes", "--config", config.to_str().unwrap()]);
    assert_eq!(
        changed["config_revision"], 3,
        "an environment value changed"
    );
    let revision = d
        .trace()
        .into_iter()
        .rfind(|e| e["kind"] == "connection-revision")
        .unwrap();
    assert!(
        !revision.to_string().contains("\"b\""),
        "no env value in the trace"
    );
}

/// A 500-tool catalogue in one page (about 400 KiB) is discovered even though the mapping
/// accepts at most 256 KiB per tool result: discovery has its own ceiling, and the pins of
/// the two tools the mapping uses are checked without reading the whole catalogue again.
#[tokio::test]
async fn a_large_catalogue_in_one_page_is_discovered_and_served() {
    let d = Deployment::with_notes();
    let d = d
        .notes_args(&["--extra-tools", "497"])
        .mapping("source-library");
    let client = d.serve().await;
    assert_eq!(client.peer().list_all_tools().await.unwrap().len(), 2);
    let r = call(&client, "search_sources", json!({"query": "wal"}))
        .await
        .unwrap();
    assert_ne!(r.is_error, Some(true), "{}", text_of(&r));
    client.cancel().await.ok();
    let list = d.airlock_json(&["snapshots", "list"]);
    let digest = list[0]["digest"].as_str().unwrap();
    let raw = d.airlock_json(&["snapshots", "show", digest]);
    assert_eq!(raw["body"]["tools"].as_array().unwrap().len(), 500);
}

/// Approved ahead of deployment, across a restart: a host started before the approved
/// manifest is deployed serves the reviewed one it has (no review-required revision is
/// written), and serves the approved one once it lands.
#[tokio::test]
async fn an_approval_ahead_of_deployment_survives_a_restart() {
    let d = Deployment::with_notes().mapping("source-library");
    d.approve_all();
    let manifest = d.manifests()[0].clone();
    let text = std::fs::read_to_string(&manifest).unwrap();
    let next = text.replace(
        "Search the technical notes library.",
        "Search the notes (next).",
    );
    let staging = d.dir.path().join("staging");
    std::fs::create_dir_all(&staging).unwrap();
    std::fs::copy(
        manifest.with_file_name("source_library.wasm"),
        staging.join("source_library.wasm"),
    )
    .unwrap();
    std::fs::write(staging.join("mapping.toml"), &next).unwrap();
    d.approve(
        "source-library",
        "alice",
        &["--manifest", staging.join("mapping.toml").to_str().unwrap()],
    );
    let client = d.serve_unreviewed().await;
    let tools = client.peer().list_all_tools().await.unwrap();
    assert_eq!(tools.len(), 2, "the deployed, reviewed manifest serves on");
    assert!(tools.iter().any(|t| {
        t.description
            .as_deref()
            .unwrap_or("")
            .starts_with("Search the technical notes library.")
    }));
    client.cancel().await.ok();
    std::fs::write(&manifest, &next).unwrap();
    let client = d.serve_unreviewed().await;
    let tools = client.peer().list_all_tools().await.unwrap();
    assert!(
        tools.iter().any(|t| t
            .description
            .as_deref()
            .unwrap_or("")
            .starts_with("Search the notes (next).")),
        "{tools:?}"
    );
    client.cancel().await.ok();
    let show = d.airlock_json(&["review", "show", "source-library"]);
    assert_eq!(show["revisions"].as_array().unwrap().len(), 2, "{show:#}");
    assert_eq!(show["current"]["state"], "active");
}

/// A server that announces a change and then cannot list its tools: until a discovery
/// succeeds nothing on that connection is current, so calls are refused as unavailable
/// before they reach the server (the mapping's state is not changed: nothing drifted).
#[tokio::test]
async fn a_failed_re_discovery_refuses_calls_until_one_succeeds() {
    let d = drifting("unlistable");
    let client = d.serve().await;
    let hits = call(&client, "search_sources", json!({"query": "checkpoint"}))
        .await
        .unwrap();
    assert_ne!(hits.is_error, Some(true), "{}", text_of(&hits));
    for _ in 0..2 {
        let r = call(&client, "search_sources", json!({"query": "wal"}))
            .await
            .unwrap();
        assert_refused(&r, Category::Unavailable);
    }
    assert_eq!(d.upstream_tool_calls(), ["search_notes"]);
    client.cancel().await.ok();
    let show = d.airlock_json(&["review", "show", "source-library"]);
    assert_eq!(show["current"]["state"], "active");
    assert!(d.trace().iter().any(|e| e["kind"] == "snapshot-failed"));
}

/// A server that changes without announcing it is caught by the interval re-discovery:
/// a silent description drift moves the mapping to review-required, and a silent failure
/// to list refuses calls until a discovery succeeds. Neither reaches the server again.
#[tokio::test]
async fn silent_changes_are_caught_by_the_interval() {
    for (kind, refusal) in [
        ("description", "state changed:"),
        ("unlistable", "unavailable:"),
    ] {
        let d = Deployment::with_notes()
            .top("snapshot_interval = \"1s\"\n")
            .notes_args(&["--drift-on-call", kind, "--silent"])
            .mapping("source-library");
        let client = d.serve().await;
        let hits = call(&client, "search_sources", json!({"query": "checkpoint"}))
            .await
            .unwrap();
        assert_ne!(hits.is_error, Some(true), "{kind}: {}", text_of(&hits));
        tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
        let r = call(&client, "search_sources", json!({"query": "wal"}))
            .await
            .unwrap();
        assert!(text_of(&r).starts_with(refusal), "{kind}: {}", text_of(&r));
        assert_eq!(d.upstream_tool_calls(), ["search_notes"], "{kind}");
        client.cancel().await.ok();
    }
}

/// A first rollout: a revision approved `--limited-to profile:early` is offered to that
/// profile and refused to every other session (listed and called), until `review promote`
/// makes it `active`; both steps are in the trace, and the trace still verifies.
#[tokio::test]
async fn a_limited_rollout_is_offered_to_its_scope_only_until_promoted() {
    let d = crate::common::Deployment::with_notes()
        .mapping("source-library")
        .tables(
            "[[profile]]\nname = \"early\"\ncapabilities = [\"*\"]\n\
             [[profile]]\nname = \"everyone\"\ncapabilities = [\"*\"]\n",
        );
    let config = d.write_config();
    let config = config.to_str().unwrap();
    d.airlock_ok(&["discover", "notes", "--config", config]);
    let out = d.airlock(&[
        "review",
        "approve",
        "source-library",
        "--config",
        config,
        "--reviewer",
        "alice",
        "--limited-to",
        "team:early",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("`profile:NAME` or `requester:NAME`"));
    let out = d.airlock(&[
        "review",
        "approve",
        "source-library",
        "--config",
        config,
        "--reviewer",
        "alice",
        "--limited-to",
        "profile:eraly",
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("no profile `eraly`"));
    let approved = d.airlock_json(&[
        "review",
        "approve",
        "source-library",
        "--config",
        config,
        "--reviewer",
        "alice",
        "--limited-to",
        "profile:early",
    ]);
    assert_eq!(approved["state"], "limited");
    assert_eq!(
        approved["pins"]["limited_to"],
        serde_json::json!(["profile:early"])
    );

    let names = |tools: Vec<rmcp::model::Tool>| {
        tools
            .into_iter()
            .map(|t| t.name.to_string())
            .collect::<Vec<_>>()
    };
    let early = d.serve_profile("early", ()).await;
    assert_eq!(
        names(early.peer().list_all_tools().await.unwrap()),
        ["retrieve_source", "search_sources"]
    );
    let r = crate::common::call(
        &early,
        "search_sources",
        serde_json::json!({"query": "wal"}),
    )
    .await
    .unwrap();
    assert_ne!(r.is_error, Some(true));
    early.cancel().await.unwrap();
    let sent = d.upstream_tool_calls().len();
    let everyone = d.serve_profile("everyone", ()).await;
    assert!(
        everyone.peer().list_all_tools().await.unwrap().is_empty(),
        "not offered outside its scope"
    );
    let err = crate::common::call(
        &everyone,
        "search_sources",
        serde_json::json!({"query": "wal"}),
    )
    .await
    .unwrap_err();
    assert_eq!(
        crate::common::error_code(&err),
        Some(-32602),
        "an unknown tool: {err:?}"
    );
    everyone.cancel().await.unwrap();
    assert_eq!(
        d.upstream_tool_calls().len(),
        sent,
        "nothing reached the server"
    );

    let promoted = d.airlock_json(&["review", "promote", "source-library", "--reviewer", "bob"]);
    assert_eq!(promoted["state"], "active");
    let out = d.airlock(&["review", "promote", "source-library", "--reviewer", "bob"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("not limited"));
    let everyone = d.serve_profile("everyone", ()).await;
    assert_eq!(
        names(everyone.peer().list_all_tools().await.unwrap()).len(),
        2
    );
    everyone.cancel().await.unwrap();
    let states: Vec<_> = d
        .trace()
        .into_iter()
        .filter(|e| {
            e["subject"] == "source-library"
                && (e["kind"] == "mapping-revision" || e["kind"] == "mapping-state-changed")
        })
        .map(|e| {
            e["payload"]["state"]
                .as_str()
                .or(e["payload"]["to"].as_str())
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    assert!(
        states.ends_with(&["limited".to_string(), "active".to_string()]),
        "{states:?}"
    );
    d.airlock_ok(&["trace", "verify"]);
}

/// The effect class meets the upstream tool: a read mapping pinning a tool its own server
/// does not call read-only (here `read_note` says `readOnlyHint: false`) is flagged in
/// review, and approving it needs `--acknowledge-annotations`, which the trace records
/// with the tool.
#[tokio::test]
async fn a_read_mapping_over_a_tool_the_server_calls_writing_needs_an_acknowledged_approval() {
    let d = crate::common::Deployment::with_notes()
        .notes_args(&["--drift", "annotations"])
        .mapping("source-library");
    let config = d.write_config();
    let config = config.to_str().unwrap();
    let manifest = d.manifests()[0].to_str().unwrap().to_string();
    d.airlock_ok(&["discover", "notes", "--config", config]);

    let out = d.airlock(&["grants", &manifest, "--config", config, "--json"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "flagged: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let review: Value = serde_json::from_slice(&out.stdout).unwrap();
    let conflicts = review["annotation_conflicts"].as_array().unwrap();
    assert_eq!(conflicts.len(), 1, "{conflicts:?}");
    let conflict = conflicts[0].as_str().unwrap();
    assert!(
        conflict.contains("`read_note`")
            && conflict.contains("readOnlyHint false")
            && conflict.contains("read capabilities"),
        "{conflict}"
    );
    let read_note = review["upstream"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "read_note")
        .unwrap()
        .clone();
    assert!(
        read_note["server_hints"]
            .as_str()
            .unwrap()
            .contains("may write"),
        "{read_note}"
    );
    let text =
        String::from_utf8_lossy(&d.airlock(&["grants", &manifest, "--config", config]).stdout)
            .into_owned();
    assert!(
        text.contains("FLAGGED   upstream tool `read_note`: the server does not call it read-only"),
        "{text}"
    );

    let out = d.airlock(&[
        "review",
        "approve",
        "source-library",
        "--config",
        config,
        "--reviewer",
        "alice",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("`read_note`") && err.contains("--acknowledge-annotations"),
        "{err}"
    );
    assert_eq!(
        d.airlock_json(&["review", "list"])
            .as_array()
            .map(|a| a.iter().filter(|m| m["state"] == "active").count()),
        Some(0),
        "nothing approved"
    );

    let approved = d.airlock_json(&[
        "review",
        "approve",
        "source-library",
        "--config",
        config,
        "--reviewer",
        "alice",
        "--acknowledge-annotations",
    ]);
    assert_eq!(approved["state"], "active");
    let event = d
        .trace()
        .into_iter()
        .rfind(|e| e["kind"] == "mapping-revision" && e["subject"] == "source-library")
        .unwrap();
    let acknowledged = event["payload"]["acknowledged_annotations"]
        .as_array()
        .unwrap();
    assert_eq!(acknowledged.len(), 1);
    assert!(acknowledged[0].as_str().unwrap().contains("`read_note`"));
    d.airlock_ok(&["trace", "verify"]);
}
