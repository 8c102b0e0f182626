//! A store you can trust (issue 12): the state folder, database, `-wal`/`-shm` files and
//! trace key are private or refused with nothing written; the trace is MACed with the host
//! key over the exact stored bytes and anchored by checkpoints outside the database, so
//! every tampering below is reported by `airlock trace verify [--checkpoint FILE]`.
//!
//! Each test is written as the attacker would work: with write access to the files, the
//! append-only triggers dropped, and without the key.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use airlock::store::{SqliteStore, Trace as _};
use serde_json::{Value, json};
use sha2::Digest as _;

use crate::common::Deployment;

/// Everything under `dir` (names, kinds, sizes and contents), to prove nothing was
/// written.
fn listing(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries {
        let path = e.unwrap().path();
        let meta = std::fs::symlink_metadata(&path).unwrap();
        let what = if meta.file_type().is_symlink() {
            format!("link -> {}", std::fs::read_link(&path).unwrap().display())
        } else if meta.is_dir() {
            out.extend(listing(&path));
            "dir".into()
        } else {
            format!(
                "file {}",
                hex::encode(sha2::Sha256::digest(std::fs::read(&path).unwrap()))
            )
        };
        out.push((path, what));
    }
    out.sort();
    out
}

fn deployment() -> Deployment {
    Deployment::with_notes().mapping("source-library")
}

/// A store with a few events in `dir`, closed again.
fn store_in(dir: &Path) {
    let store = SqliteStore::open(dir).unwrap();
    for i in 0..3 {
        store.append_trace("test", "s", &json!({"i": i})).unwrap();
    }
}

/// `airlock serve` fails at start with an error containing every one of `needles`, and
/// the files under `watched` are exactly as they were.
fn refused(d: &Deployment, needles: &[&str], watched: &[&Path]) {
    // serve_expecting_failure writes the configuration (the same bytes) again.
    d.write_config();
    let before: Vec<_> = watched.iter().map(|w| listing(w)).collect();
    let (ok, stderr) = d.serve_expecting_failure();
    assert!(!ok, "serve must refuse: {stderr}");
    for needle in needles {
        assert!(stderr.contains(needle), "missing {needle:?} in: {stderr}");
    }
    assert!(stderr.contains("nothing was written"), "{stderr}");
    let after: Vec<_> = watched.iter().map(|w| listing(w)).collect();
    assert_eq!(before, after, "something was written");
    assert!(d.upstream_calls().is_empty(), "an upstream was started");
}

#[test]
fn a_state_folder_others_can_write_is_refused_and_nothing_is_written() {
    let d = deployment();
    let state = d.state_dir();
    std::fs::create_dir_all(&state).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o777)).unwrap();
    refused(
        &d,
        &[
            "state folder",
            "writable by group or others (mode 0777)",
            &format!("chmod 700 {}", state.display()),
        ],
        &[&state],
    );
    assert!(listing(&state).is_empty(), "no database, no key file");
}

#[test]
fn a_group_writable_database_is_refused_and_left_alone() {
    let d = deployment();
    let state = d.state_dir();
    store_in(&state);
    let db = state.join("airlock.db");
    std::fs::set_permissions(&db, std::fs::Permissions::from_mode(0o660)).unwrap();
    refused(
        &d,
        &[
            "state database",
            "writable by group or others (mode 0660)",
            &format!("chmod 600 {}", db.display()),
        ],
        &[&state],
    );
}

#[test]
fn a_database_owned_by_someone_else_is_refused() {
    let d = deployment();
    let state = d.state_dir();
    store_in(&state);
    let db = state.join("airlock.db");
    let other = 65534; // nobody
    let path = std::ffi::CString::new(db.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path; -1 leaves the group alone.
    if unsafe { libc::chown(path.as_ptr(), other, u32::MAX) } != 0 {
        eprintln!(
            "skipped: cannot chown a file to uid {other} without root ({})",
            std::io::Error::last_os_error()
        );
        return;
    }
    refused(
        &d,
        &[
            "state database",
            &format!("is owned by uid {other}, not by this user"),
            "chown",
        ],
        &[&state],
    );
}

#[test]
fn a_symlinked_state_folder_is_refused() {
    let d = deployment();
    let real = d.dir.path().join("another-store");
    store_in(&real);
    std::os::unix::fs::symlink(&real, d.state_dir()).unwrap();
    refused(
        &d,
        &["state folder", "is a symbolic link", "use the real folder"],
        &[&real, d.dir.path()],
    );
}

#[test]
fn a_symlinked_database_is_refused() {
    let d = deployment();
    let state = d.state_dir();
    std::fs::create_dir_all(&state).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).unwrap();
    let other = d.dir.path().join("other");
    store_in(&other);
    std::os::unix::fs::symlink(other.join("airlock.db"), state.join("airlock.db")).unwrap();
    refused(
        &d,
        &["state database", "is a symbolic link"],
        &[&state, &other],
    );
}

#[test]
fn a_dangling_database_link_creates_nothing_at_its_target() {
    let d = deployment();
    let state = d.state_dir();
    std::fs::create_dir_all(&state).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).unwrap();
    let elsewhere = d.dir.path().join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    let target = elsewhere.join("planted.db");
    std::os::unix::fs::symlink(&target, state.join("airlock.db")).unwrap();
    refused(
        &d,
        &["state database", "is a symbolic link", "planted.db"],
        &[&state, &elsewhere],
    );
    assert!(!target.exists(), "a database was created through the link");
    assert!(listing(&elsewhere).is_empty());
    assert!(!state.join("trace.key").exists());
}

#[test]
fn a_symlinked_write_ahead_log_is_refused() {
    let d = deployment();
    let state = d.state_dir();
    store_in(&state);
    let target = d.dir.path().join("planted-wal");
    std::os::unix::fs::symlink(&target, state.join("airlock.db-wal")).unwrap();
    refused(
        &d,
        &["write-ahead log", "airlock.db-wal", "is a symbolic link"],
        &[&state, d.dir.path()],
    );
    assert!(!target.exists());
}

#[test]
fn a_trace_key_others_can_read_is_refused() {
    let d = deployment();
    let state = d.state_dir();
    store_in(&state);
    let key = state.join("trace.key");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    refused(
        &d,
        &[
            "trace key file",
            "readable by group or others (mode 0644)",
            &format!("chmod 600 {}", key.display()),
        ],
        &[&state],
    );
}

#[test]
fn a_new_store_is_private() {
    let d = deployment();
    let state = d.state_dir();
    store_in(&state);
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&state), 0o700);
    assert_eq!(mode(&state.join("airlock.db")), 0o600);
    assert_eq!(mode(&state.join("trace.key")), 0o600);
    let key = std::fs::read_to_string(state.join("trace.key")).unwrap();
    assert!(
        key.starts_with("airlock-trace-key v1 hmac-sha256 ") && key.len() == 33 + 64 + 1,
        "{key:?}"
    );
}

// ---- the trace ----

/// A deployment whose store holds `n` events and a checkpoint file holding one checkpoint
/// of them (taken with `airlock trace checkpoint`, as an operator would).
fn traced(n: usize) -> (Deployment, PathBuf) {
    let d = deployment();
    let store = SqliteStore::open(&d.state_dir()).unwrap();
    for i in 0..n {
        store
            .append_trace(
                "mapping-state-changed",
                "library",
                &json!({"n": i, "to": "active"}),
            )
            .unwrap();
    }
    drop(store);
    let checkpoint = d.dir.path().join("checkpoints.jsonl");
    let line = d.airlock_ok(&["trace", "checkpoint"]);
    std::fs::write(&checkpoint, &line).unwrap();
    (d, checkpoint)
}

/// The attacker's first move: drop the append-only triggers.
fn attacker(d: &Deployment) -> rusqlite::Connection {
    let db = d.database();
    db.execute_batch("DROP TRIGGER trace_events_no_update; DROP TRIGGER trace_events_no_delete;")
        .unwrap();
    db
}

/// `trace verify` (with `--checkpoint FILE` when given): exit status 3, and the report's
/// first bad event and reason.
fn tampered(d: &Deployment, checkpoint: Option<&Path>) -> (i64, String) {
    let mut args = vec!["trace", "verify", "--json"];
    let file;
    if let Some(c) = checkpoint {
        file = c.display().to_string();
        args.extend(["--checkpoint", file.as_str()]);
    }
    let out = d.airlock(&args);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    (
        v["first_bad"][0].as_i64().unwrap(),
        v["first_bad"][1].as_str().unwrap().to_owned(),
    )
}

fn intact(d: &Deployment, checkpoint: Option<&Path>) -> Value {
    let mut args = vec!["trace", "verify"];
    let file;
    if let Some(c) = checkpoint {
        file = c.display().to_string();
        args.extend(["--checkpoint", file.as_str()]);
    }
    let v = d.airlock_json(&args);
    assert_eq!(v["first_bad"], Value::Null, "{v}");
    v
}

/// The unkeyed hash of schema 6 (what anyone can recompute without the key).
fn unkeyed_hash(
    seq: i64,
    at_ms: i64,
    kind: &str,
    subject: &str,
    payload: &str,
    prev: &str,
) -> String {
    let payload: Value = serde_json::from_str(payload).unwrap();
    let text = serde_json_canonicalizer::to_string(&json!({
        "seq": seq, "at_ms": at_ms, "kind": kind, "subject": subject,
        "payload": payload, "prev_hash": prev,
    }))
    .unwrap();
    hex::encode(sha2::Sha256::digest(text.as_bytes()))
}

/// Rewrites events `from..` of the chain with recomputed unkeyed hashes, as if they had been
/// written before the key: `key_id` NULL, `hash` the schema 6 sha256.
fn recompute_unkeyed(db: &rusqlite::Connection, from: i64) {
    let mut prev: String = if from == 1 {
        "0".repeat(64)
    } else {
        db.query_row(
            "SELECT hash FROM trace_events WHERE seq = ?1",
            [from - 1],
            |r| r.get(0),
        )
        .unwrap()
    };
    let rows: Vec<(i64, i64, String, String, String)> = db
        .prepare("SELECT seq, at_ms, kind, subject, payload FROM trace_events WHERE seq >= ?1 ORDER BY seq")
        .unwrap()
        .query_map([from], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    for (seq, at, kind, subject, payload) in rows {
        let hash = unkeyed_hash(seq, at, &kind, &subject, &payload, &prev);
        db.execute(
            "UPDATE trace_events SET prev_hash = ?1, hash = ?2, key_id = NULL WHERE seq = ?3",
            rusqlite::params![prev, hash, seq],
        )
        .unwrap();
        prev = hash;
    }
}

#[test]
fn an_edited_payload_with_a_recomputed_unkeyed_chain_is_detected() {
    let (d, _) = traced(4);
    let db = attacker(&d);
    db.execute(
        r#"UPDATE trace_events SET payload = '{"n":1,"to":"retiring"}' WHERE seq = 2"#,
        [],
    )
    .unwrap();
    recompute_unkeyed(&db, 2);
    drop(db);
    let (seq, why) = tampered(&d, None);
    assert_eq!(seq, 2, "{why}");
    assert!(
        why.contains("has no MAC although event 1 before it has one"),
        "{why}"
    );
}

#[test]
fn a_whole_trace_recomputed_without_the_key_is_detected() {
    let (d, checkpoint) = traced(4);
    let db = attacker(&d);
    db.execute(
        r#"UPDATE trace_events SET payload = '{"n":1,"to":"retiring"}' WHERE seq = 2"#,
        [],
    )
    .unwrap();
    recompute_unkeyed(&db, 1);
    drop(db);
    let (seq, why) = tampered(&d, None);
    assert_eq!(seq, 4, "{why}");
    assert!(why.contains("no event is MACed with a key"), "{why}");
    // The checkpoint sees it too: the head is no longer the MAC it recorded.
    let (seq, why) = tampered(&d, Some(&checkpoint));
    assert_eq!(seq, 4, "{why}");
}

#[test]
fn an_edited_payload_keeping_its_key_id_fails_its_mac() {
    let (d, _) = traced(4);
    let db = attacker(&d);
    db.execute(
        r#"UPDATE trace_events SET payload = '{"n":2,"to":"retiring"}' WHERE seq = 3"#,
        [],
    )
    .unwrap();
    drop(db);
    let (seq, why) = tampered(&d, None);
    assert_eq!(seq, 3);
    assert!(why.contains("no longer match its MAC"), "{why}");
}

#[test]
fn a_duplicated_key_in_a_payload_is_detected() {
    let (d, _) = traced(3);
    // {"n":1,"to":"active"} becomes text that most parsers read as "retiring" (first
    // wins) while serde_json reads the original (last wins): the same parsed value, other
    // bytes.
    let db = attacker(&d);
    let before: String = db
        .query_row("SELECT payload FROM trace_events WHERE seq = 2", [], |r| {
            r.get(0)
        })
        .unwrap();
    assert_eq!(before, r#"{"n":1,"to":"active"}"#);
    db.execute(
        r#"UPDATE trace_events SET payload = '{"n":1,"to":"retiring","to":"active"}' WHERE seq = 2"#,
        [],
    )
    .unwrap();
    drop(db);
    let (seq, why) = tampered(&d, None);
    assert_eq!(seq, 2);
    assert!(why.contains("no longer match its MAC"), "{why}");
}

#[test]
fn deleted_newest_events_are_detected_by_the_checkpoint() {
    let (d, checkpoint) = traced(5);
    let db = attacker(&d);
    db.execute("DELETE FROM trace_events WHERE seq >= 4", [])
        .unwrap();
    drop(db);
    // Without the anchor a shortened chain still verifies, and says it cannot tell.
    let v = intact(&d, None);
    assert!(
        v["coverage"].to_string().contains("no checkpoint given"),
        "{v}"
    );
    let (seq, why) = tampered(&d, Some(&checkpoint));
    assert_eq!(seq, 4);
    assert!(why.contains("events 4..=5 are missing"), "{why}");
    assert!(why.contains("the newest events were deleted"), "{why}");
}

#[test]
fn a_deleted_trace_is_detected_by_the_checkpoint() {
    let (d, checkpoint) = traced(3);
    let db = attacker(&d);
    db.execute("DELETE FROM trace_events", []).unwrap();
    drop(db);
    intact(&d, None);
    let (seq, why) = tampered(&d, Some(&checkpoint));
    assert_eq!(seq, 1);
    assert!(why.contains("the whole trace is missing"), "{why}");
}

#[test]
fn a_rolled_back_and_rewritten_chain_is_detected_by_the_checkpoint() {
    // The attacker keeps a copy of the database, lets the host record what it must hide,
    // restores the copy and lets the host write a different history of the same length:
    // every event is genuinely MACed, so only the anchor can tell.
    let (d, _) = traced(3);
    let db_path = d.state_dir().join("airlock.db");
    let copy = d.dir.path().join("copy.db");
    {
        let db = d.database();
        db.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)").unwrap();
    }
    std::fs::copy(&db_path, &copy).unwrap();
    let store = SqliteStore::open(&d.state_dir()).unwrap();
    store
        .append_trace(
            "mapping-state-changed",
            "library",
            &json!({"to": "retiring"}),
        )
        .unwrap();
    let checkpoint = d.dir.path().join("checkpoints.jsonl");
    std::fs::write(&checkpoint, store.trace_checkpoint().unwrap().to_line()).unwrap();
    drop(store);
    for f in ["airlock.db-wal", "airlock.db-shm"] {
        let _ = std::fs::remove_file(d.state_dir().join(f));
    }
    std::fs::copy(&copy, &db_path).unwrap();
    let store = SqliteStore::open(&d.state_dir()).unwrap();
    store
        .append_trace("mapping-state-changed", "library", &json!({"to": "active"}))
        .unwrap();
    drop(store);
    intact(&d, None);
    let (seq, why) = tampered(&d, Some(&checkpoint));
    assert_eq!(seq, 4);
    assert!(why.contains("the chain up to it was rewritten"), "{why}");
}

#[test]
fn an_edited_or_foreign_checkpoint_is_reported() {
    let (d, checkpoint) = traced(3);
    let line = std::fs::read_to_string(&checkpoint).unwrap();
    let mut c: Value = serde_json::from_str(&line).unwrap();
    c["seq"] = json!(2);
    c["head"] = json!("00".repeat(32));
    std::fs::write(&checkpoint, format!("{line}{c}\n")).unwrap();
    let (seq, why) = tampered(&d, Some(&checkpoint));
    assert_eq!(seq, 2);
    assert!(
        why.contains("checkpoint on line 2 does not verify"),
        "{why}"
    );
    std::fs::write(&checkpoint, "not json\n").unwrap();
    let out = d.airlock(&[
        "trace",
        "verify",
        "--checkpoint",
        checkpoint.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("line 1 is not a trace checkpoint"),
        "{out:?}"
    );
}

#[test]
fn an_intact_trace_verifies_against_its_checkpoints_and_says_what_is_covered() {
    let (d, checkpoint) = traced(3);
    // Events after the checkpoint are fine, and said to be not yet anchored.
    let store = SqliteStore::open(&d.state_dir()).unwrap();
    store.append_trace("k", "s", &json!({})).unwrap();
    drop(store);
    let v = intact(&d, Some(&checkpoint));
    assert_eq!(v["anchored_seq"], 3);
    let text = d.airlock_ok(&[
        "trace",
        "verify",
        "--checkpoint",
        checkpoint.to_str().unwrap(),
    ]);
    assert!(text.starts_with("trace intact: 4 events"), "{text}");
    assert!(text.contains("events 1..=4: each MACed with key"), "{text}");
    assert!(text.contains("events 4..=4 are not anchored yet"), "{text}");
}

#[tokio::test]
async fn serve_appends_a_checkpoint_at_shutdown() {
    let d = deployment();
    d.approve_all();
    let client = d.serve().await;
    client.cancel().await.ok();
    let file = d.state_dir().join("trace-checkpoints.jsonl");
    // The host writes it once its upstreams are stopped, after the client left.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !file.exists() && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let text = std::fs::read_to_string(&file).expect("a checkpoint file");
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1, "{text}");
    assert_eq!(lines[0]["format"], "airlock-trace-checkpoint-v1");
    let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let v = intact(&d, Some(&file));
    assert_eq!(v["anchored_seq"], lines[0]["seq"]);
}

// ---- serving state proven by the trace ----

/// The tools `airlock serve` offers on this deployment, and the mapping-tampered events
/// the trace holds afterwards.
async fn offered_and_tampered(d: &Deployment) -> (Vec<String>, Vec<Value>) {
    // Not `serve()`: that approves first, which would record a genuine revision.
    let client = d.serve_unreviewed().await;
    let tools: Vec<String> = client
        .peer()
        .list_all_tools()
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.name.to_string())
        .collect();
    let refused = crate::common::call(&client, "search_sources", json!({"query": "wal"})).await;
    assert!(
        refused.is_err(),
        "a tampered mapping answered a call: {refused:?}"
    );
    client.cancel().await.ok();
    let tampered = d
        .trace()
        .into_iter()
        .filter(|e| e["kind"] == "mapping-tampered")
        .collect();
    (tools, tampered)
}

#[tokio::test]
async fn a_retired_mapping_set_active_by_hand_is_not_served_and_shown_tampered() {
    let d = deployment();
    d.approve_all();
    d.airlock_ok(&["review", "retire", "source-library", "--reviewer", "tests"]);
    let db = d.database();
    let changed = db
        .execute(
            "UPDATE mappings SET state = 'active', reason = 'approved by tests' \
             WHERE name = 'source-library' AND state = 'retiring'",
            [],
        )
        .unwrap();
    assert_eq!(changed, 1);
    drop(db);
    let (tools, tampered) = offered_and_tampered(&d).await;
    assert!(!tools.contains(&"search_sources".to_string()), "{tools:?}");
    assert_eq!(tampered.len(), 1, "traced once: {tampered:?}");
    let why = tampered[0]["payload"]["why"].as_str().unwrap();
    assert!(
        why.contains("state active (the trace says retiring)"),
        "{why}"
    );
    let show = d.airlock_ok(&["review", "show", "source-library"]);
    assert!(
        show.contains("TAMPERED: the trace does not prove this record"),
        "{show}"
    );
    let json = d.airlock_json(&["review", "show", "source-library"]);
    assert!(
        json["tampered"].as_str().unwrap().contains("retiring"),
        "{json}"
    );
}

#[tokio::test]
async fn a_forged_revision_row_with_copied_pins_is_not_served_and_shown_tampered() {
    // The attack of issue 12: a mapping row set to `active` by hand, pins copied from
    // another (approved) row. Every column but the revision is a genuine approval's.
    let d = deployment();
    d.approve_all();
    let db = d.database();
    let inserted = db
        .execute(
            "INSERT INTO mappings (name, revision, manifest_digest, component_sha256, \
             connection_id, config_revision, snapshot_digest, pins, state, reviewer, reason, \
             created_ms, state_changed_ms, manifest_text) \
             SELECT name, revision + 1, manifest_digest, component_sha256, connection_id, \
             config_revision, snapshot_digest, pins, 'active', 'mallory', 'approved by mallory', \
             created_ms, state_changed_ms, manifest_text FROM mappings \
             WHERE name = 'source-library' AND state = 'active'",
            [],
        )
        .unwrap();
    assert_eq!(inserted, 1);
    db.execute(
        "UPDATE mappings SET state = 'historical' WHERE name = 'source-library' \
         AND reviewer = 'tests'",
        [],
    )
    .unwrap();
    drop(db);
    let (tools, tampered) = offered_and_tampered(&d).await;
    assert!(!tools.contains(&"search_sources".to_string()), "{tools:?}");
    assert_eq!(tampered.len(), 1, "{tampered:?}");
    let why = tampered[0]["payload"]["why"].as_str().unwrap();
    assert!(
        why.contains("no MACed mapping-revision event records revision 2"),
        "{why}"
    );
    let show = d.airlock_ok(&["review", "show", "source-library"]);
    assert!(show.contains("TAMPERED"), "{show}");
}

#[tokio::test]
async fn an_approved_mapping_is_proven_and_served() {
    // The guard's other side: what a reviewer approved serves, and nothing is flagged.
    let d = deployment();
    d.approve_all();
    let client = d.serve_unreviewed().await;
    let tools = client.peer().list_all_tools().await.unwrap();
    assert!(tools.iter().any(|t| t.name == "search_sources"));
    client.cancel().await.ok();
    assert!(!d.trace().iter().any(|e| e["kind"] == "mapping-tampered"));
    let json = d.airlock_json(&["review", "show", "source-library"]);
    assert_eq!(json.get("tampered"), None, "{json}");
}

// ---- the key from a named secret; checkpoints at an interval ----

#[tokio::test]
async fn a_named_secret_keys_the_trace_and_checkpoints_come_at_the_interval() {
    let secret = "0123456789abcdef0123456789abcdef-test-key";
    let d = deployment().tables(
        "[trace]\nkey = \"trace-key\"\ncheckpoint_interval = \"1s\"\n\
         [secrets]\ntrace-key = { env = \"AIRLOCK_TEST_TRACE_KEY\" }\n",
    );
    let config = d.write_config();
    let run = |args: &[&str], key: Option<&str>| {
        let mut cmd = std::process::Command::new(crate::common::airlock_bin());
        cmd.env("AIRLOCK_CACHE_DIR", crate::common::test_cache_dir())
            .env("AIRLOCK_STATE_DIR", d.state_dir())
            .env("AIRLOCK_TEST_TRACE_KEY", secret)
            .env_remove("AIRLOCK_TRACE_KEY")
            .args(args)
            .stdin(std::process::Stdio::null());
        if let Some(key) = key {
            cmd.env("AIRLOCK_TRACE_KEY", key);
        }
        cmd.output().unwrap()
    };
    let out = run(
        &["discover", "notes", "--config", config.to_str().unwrap()],
        None,
    );
    assert!(out.status.success(), "{out:?}");
    assert!(
        !d.state_dir().join("trace.key").exists(),
        "a key file beside a named key"
    );

    // Serve for a few intervals: a checkpoint when the head moved, none while it stands
    // still, one at shutdown.
    let mut cmd = d.serve_command();
    cmd.env("AIRLOCK_TEST_TRACE_KEY", secret);
    let transport = rmcp::transport::TokioChildProcess::new(cmd).unwrap();
    let client = rmcp::ServiceExt::serve((), transport).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(3500)).await;
    client.cancel().await.ok();
    let file = d.state_dir().join("trace-checkpoints.jsonl");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let lines = loop {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        if text.lines().count() >= 2 || std::time::Instant::now() > deadline {
            break text;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    let count = lines.lines().count();
    assert!((2..=3).contains(&count), "{lines}");

    // Without a configuration, commands take the key from AIRLOCK_TRACE_KEY …
    let out = run(
        &[
            "trace",
            "verify",
            "--json",
            "--checkpoint",
            file.to_str().unwrap(),
        ],
        Some(secret),
    );
    assert!(out.status.success(), "{out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["key_source"], "environment variable AIRLOCK_TRACE_KEY");
    assert_eq!(v["checkpoints"], count);
    // … and without it they refuse rather than start a new key.
    let out = run(&["trace", "verify"], None);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("is missing, but the trace"), "{stderr}");
    assert!(!d.state_dir().join("trace.key").exists());
    // Another key fails every MAC and checkpoint.
    let out = run(
        &["trace", "verify"],
        Some("another key, 32 bytes long or more"),
    );
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("not with this host's key"),
        "{out:?}"
    );
}

// ---- the trace journal: durable before the answer, in the trace for every reader ----

/// `airlock serve` on stdio, `n` calls of `search_sources`, each answered.
async fn answered<H: rmcp::ClientHandler>(
    client: &rmcp::service::RunningService<rmcp::RoleClient, H>,
    n: usize,
) {
    crate::common::searched(client, "checkpoint", n).await;
}

fn outcomes(trace: &[Value]) -> usize {
    trace.iter().filter(|e| e["kind"] == "call-outcome").count()
}

/// Call outcomes in the database's own table, read without moving any journal.
fn outcomes_in_database(d: &Deployment) -> i64 {
    d.database()
        .query_row(
            "SELECT count(*) FROM trace_events WHERE kind = 'call-outcome'",
            [],
            |r| r.get(0),
        )
        .unwrap()
}

fn journals(d: &Deployment) -> Vec<PathBuf> {
    std::fs::read_dir(d.state_dir().join("trace-journal"))
        .map(|entries| entries.map(|e| e.unwrap().path()).collect())
        .unwrap_or_default()
}

/// A call is answered only once its events are durable (in the serving process's trace
/// journal), and every reader sees every answered call: another process while `airlock
/// serve` runs, and the next process after it was killed (`kill -9`: no shutdown, no
/// last pass), which moves the dead host's journal into the chain and deletes it.
#[tokio::test]
async fn answered_calls_are_in_the_trace_while_serve_runs_and_after_it_is_killed() {
    let d = Deployment::with_notes().mapping("source-library");
    let (client, pid) = d.serve_with_pid().await;
    answered(&client, 20).await;
    // Read by another process at once, while the host serves.
    assert_eq!(outcomes(&d.trace()), 20);
    answered(&client, 20).await;
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    // Dead once it is gone, or a zombie whose every other thread has exited too: a killed
    // leader shows `Z` while its other threads still hold the file table (and the
    // journal's lock) until they are through their own exit.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let dead = || {
        let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| s.split(") ").nth(1).is_some_and(|r| r.starts_with('Z')));
        let threads = std::fs::read_dir(format!("/proc/{pid}/task")).map(Iterator::count);
        match (zombie, threads) {
            (Ok(zombie), Ok(threads)) => zombie && threads <= 1,
            _ => true,
        }
    };
    while !dead() {
        assert!(
            std::time::Instant::now() < deadline,
            "airlock serve did not die"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    drop(client);
    assert_eq!(
        journals(&d).len(),
        1,
        "the killed host's journal is left behind"
    );
    let trace = d.trace();
    assert_eq!(outcomes(&trace), 40, "every answered call, once");
    assert!(
        journals(&d).is_empty(),
        "moved, then deleted: {:?}",
        journals(&d)
    );
    intact(&d, None);
}

/// A record of a stopped host's journal edited by someone without the key is reported by
/// `trace verify` (exit status 3), and nothing from it on enters the chain.
#[tokio::test]
async fn an_edited_journal_record_is_reported_by_trace_verify() {
    let d = Deployment::with_notes().mapping("source-library");
    // The serving process's own thread does not move its journal within the test.
    let (client, pid) = d
        .serve_with_pid_env(&[("AIRLOCK_TRACE_JOURNAL_MS", "3600000")])
        .await;
    answered(&client, 3).await;
    let stop = |sig: &str| {
        assert!(
            std::process::Command::new("kill")
                .args([sig, &pid.to_string()])
                .status()
                .unwrap()
                .success()
        )
    };
    stop("-STOP");
    assert_eq!(outcomes_in_database(&d), 0, "nothing moved yet");
    let files = journals(&d);
    assert_eq!(files.len(), 1);
    let mut bytes = std::fs::read(&files[0]).unwrap();
    let at = bytes.windows(9).rposition(|w| w == b"call-outc").unwrap();
    bytes[at] = b'C';
    std::fs::write(&files[0], &bytes).unwrap();
    stop("-KILL");
    drop(client);
    let (_, why) = tampered(&d, None);
    assert!(why.contains("fails its MAC"), "{why}");
    assert!(why.contains("trace-journal"), "{why}");
}
