//! Record and replay: `airlock serve --record DIR` writes redacted fixtures from real
//! calls of a real client through the real notes server; `airlock test MANIFEST
//! --fixtures DIR` replays them against the real component with no upstream process.

use std::path::{Path, PathBuf};

use rmcp::ServiceExt as _;
use rmcp::transport::TokioChildProcess;
use serde_json::{Value, json};

use crate::common::{Deployment, call, confined, references};

/// A secret in the notes connection's environment (and, by the model's query, in what the
/// adapter sends upstream): it must appear in no fixture.
const SECRET: &str = "tok-5ecret-4242-zz";

/// The notes connection with [`SECRET`] in its environment.
fn notes_with_secret(d: &Deployment) -> String {
    let log = d.dir.path().join("calls.jsonl");
    format!(
        "[[connection]]\nname = \"notes\"\ncommand = \"@airlock\"\nargs = [\"fixture\", \"notes-server\", \"--call-log\", {:?}]\nenv = {{ NOTES_TOKEN = {SECRET:?} }}\n{}",
        log.display().to_string(),
        confined(&[(&log, "read-write")])
    )
}

/// A connection whose command would leave `marker` behind if anything started it.
fn marker_connection(d: &Deployment, marker: &Path) -> String {
    let script = d.dir.path().join("would-start.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\ntouch {:?}\nexit 1\n",
            marker.display().to_string()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    format!(
        "[[connection]]\nname = \"notes\"\ncommand = {:?}\nconfine = false\n",
        script.display().to_string()
    )
}

/// Approves `source-library` on a deployment whose notes connection holds [`SECRET`],
/// serves it with `--record` (redacting member `snippet` too), and makes three calls
/// through a real client: a search, a retrieve of its first hit, and a search for the
/// secret. Returns the deployment and the fixture folder.
async fn recorded() -> (Deployment, PathBuf) {
    let d = Deployment::with_notes().mapping("source-library");
    let d = {
        let c = notes_with_secret(&d);
        d.replace_connections(&c)
    };
    d.approve_all();
    let fixtures = d.dir.path().join("fixtures");
    let mut cmd = d.serve_command();
    cmd.arg("--record")
        .arg(&fixtures)
        .arg("--redact")
        .arg("Snippet");
    let client =
        ().serve(TokioChildProcess::new(cmd).unwrap())
            .await
            .expect("MCP initialize with airlock serve --record");
    let hits = call(&client, "search_sources", json!({"query": "checkpoint"}))
        .await
        .unwrap();
    assert_ne!(hits.is_error, Some(true), "{hits:?}");
    let refs = references(&hits);
    assert!(!refs.is_empty());
    let passage = call(&client, "retrieve_source", json!({"reference": refs[0]}))
        .await
        .unwrap();
    assert_ne!(passage.is_error, Some(true), "{passage:?}");
    let secret = call(&client, "search_sources", json!({"query": SECRET}))
        .await
        .unwrap();
    assert_ne!(secret.is_error, Some(true), "{secret:?}");
    client.cancel().await.unwrap();
    (d, fixtures)
}

fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn read(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn write(path: &Path, v: &Value) {
    std::fs::write(path, serde_json::to_string_pretty(v).unwrap()).unwrap();
}

/// `airlock test` on the deployment's mapping with `extra` arguments: (exit code, stdout,
/// stderr).
fn test(d: &Deployment, fixtures: &Path, extra: &[&str]) -> (i32, String, String) {
    test_mapping(d, "source-library", fixtures, extra)
}

/// [`test`] for mapping `name`.
fn test_mapping(
    d: &Deployment,
    name: &str,
    fixtures: &Path,
    extra: &[&str],
) -> (i32, String, String) {
    let manifest = d.mapping_dir(name).join("mapping.toml");
    let config = d.write_config();
    let mut args = vec![
        "test",
        manifest.to_str().unwrap(),
        "--fixtures",
        fixtures.to_str().unwrap(),
        "--config",
        config.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let out = d.airlock(&args);
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn recorded_calls_replay_with_no_upstream_process_and_hold_no_secret() {
    let (d, fixtures) = recorded().await;
    assert_eq!(
        files(&fixtures),
        ["0001-search.json", "0002-retrieve.json", "0003-search.json"]
    );
    for name in files(&fixtures) {
        let text = std::fs::read_to_string(fixtures.join(&name)).unwrap();
        assert!(!text.contains(SECRET), "{name} holds the secret:\n{text}");
        assert!(
            text.contains("\n  \"exchanges\": ["),
            "pretty-printed: {text}"
        );
    }
    let first = read(&fixtures.join("0001-search.json"));
    assert_eq!(first["mapping"]["name"], "source-library");
    assert_eq!(first["mapping"]["revision"], 1);
    assert!(
        first["connection"]["id"]
            .as_str()
            .unwrap()
            .starts_with("conn-")
    );
    assert_eq!(first["snapshot_digest"].as_str().unwrap().len(), 64);
    assert_eq!(first["call"]["function"], "search");
    assert_eq!(first["call"]["input"]["query"], "checkpoint");
    assert_eq!(first["exchanges"][0]["method"], "tools/call");
    assert_eq!(first["exchanges"][0]["params"]["name"], "search_notes");
    assert!(first["exchanges"][0]["answer"]["result"]["content"].is_array());
    assert_eq!(first["redacted_fields"], json!(["snippet"]));
    let text = std::fs::read_to_string(fixtures.join("0001-search.json")).unwrap();
    assert!(
        text.contains("\"snippet\": \"[redacted]\""),
        "the --redact field: {text}"
    );
    let third = read(&fixtures.join("0003-search.json"));
    assert_eq!(third["call"]["input"]["query"], "[redacted]");
    assert_eq!(
        third["exchanges"][0]["params"]["arguments"]["query"],
        "[redacted]"
    );
    // The connection now points at a command that leaves a marker if anything starts it.
    let marker = d.dir.path().join("upstream-started");
    let d = {
        let c = marker_connection(&d, &marker);
        d.replace_connections(&c)
    };
    let upstream_before = d.upstream_calls().len();
    let (code, stdout, stderr) = test(&d, &fixtures, &["--json"]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["passed"], true);
    assert_eq!(report["functions"], json!({"retrieve": 1, "search": 2}));
    assert_eq!(report["not_exercised"], json!([]));
    assert_eq!(report["error_paths"], json!([]));
    assert!(
        report["error_cases_not_exercised"]
            .to_string()
            .contains("retrieve → err(not-found)"),
        "{report}"
    );
    assert_eq!(report["fixtures"][1]["exchanges_used"], 1);
    assert_eq!(report["state_after"], "active");
    assert!(
        report["state_note"]
            .as_str()
            .unwrap()
            .contains("only a candidate"),
        "{report}"
    );
    assert!(!marker.exists(), "airlock test started the upstream");
    assert_eq!(d.upstream_calls().len(), upstream_before);
    // The human report names the functions and says it passed.
    let (code, stdout, _) = test(&d, &fixtures, &[]);
    assert_eq!(code, 0);
    assert!(
        stdout.contains("functions exercised: retrieve ×1, search ×2"),
        "{stdout}"
    );
    assert!(stdout.contains("PASSED"), "{stdout}");
    assert!(!marker.exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unrecorded_request_fails_with_missing_fixture_naming_it() {
    let (d, fixtures) = recorded().await;
    // The adapter now asks for another query than the recording answered.
    let path = fixtures.join("0001-search.json");
    let mut f = read(&path);
    f["call"]["input"]["query"] = json!("never asked before");
    write(&path, &f);
    let (code, stdout, _) = test(&d, &fixtures, &[]);
    assert_eq!(code, 1, "{stdout}");
    assert!(stdout.contains("FAIL 0001-search.json"), "{stdout}");
    assert!(
        stdout.contains(
            "missing fixture: tools/call `search_notes` with arguments {\"query\":\"never asked before\""
        ),
        "{stdout}"
    );
    assert!(stdout.contains("pass 0002-retrieve.json"), "{stdout}");
    // A removed exchange is a missing fixture too, never a fall-through to anything.
    let path = fixtures.join("0002-retrieve.json");
    let mut f = read(&path);
    f["exchanges"] = json!([]);
    write(&path, &f);
    let (code, stdout, _) = test(&d, &fixtures, &["--json"]);
    assert_eq!(code, 1);
    let report: Value = serde_json::from_str(&stdout).unwrap();
    let problems = report["fixtures"][1]["problems"].to_string();
    assert!(
        problems.contains("missing fixture: tools/call `read_note`"),
        "{problems}"
    );
    assert_eq!(report["passed"], false);
}

#[tokio::test(flavor = "multi_thread")]
async fn stale_fixtures_are_refused_naming_both_unless_allowed() {
    let (d, fixtures) = recorded().await;
    // A new revision of the mapping (approved again): the fixtures are revision 1's.
    d.approve("source-library", "second-reviewer", &[]);
    let (code, stdout, stderr) = test(&d, &fixtures, &[]);
    assert_eq!(code, 1, "{stdout}\n{stderr}");
    assert!(stdout.contains("REFUSED stale:"), "{stdout}");
    assert!(
        stdout.contains("recorded under mapping `source-library` revision 1")
            && stdout.contains("the mapping under test is revision 2"),
        "{stdout}"
    );
    assert!(stderr.contains("--allow-stale"), "{stderr}");
    let (code, stdout, _) = test(&d, &fixtures, &["--allow-stale"]);
    assert_eq!(code, 0, "{stdout}");
    assert!(
        stdout.contains("replayed anyway (--allow-stale)"),
        "{stdout}"
    );
    // Another snapshot digest.
    let path = fixtures.join("0002-retrieve.json");
    let mut f = read(&path);
    let recorded_snapshot = f["snapshot_digest"].as_str().unwrap().to_string();
    f["snapshot_digest"] = json!("ab".repeat(32));
    f["mapping"]["revision"] = json!(2);
    write(&path, &f);
    let (code, stdout, _) = test(&d, &fixtures, &["--json"]);
    assert_eq!(code, 1);
    let report: Value = serde_json::from_str(&stdout).unwrap();
    let stale = report["stale"].to_string();
    assert!(
        stale.contains("0002-retrieve.json: recorded under snapshot abababab")
            && stale.contains(&format!("bound to snapshot {}", &recorded_snapshot[..12])),
        "{stale}"
    );
    assert_eq!(test(&d, &fixtures, &["--allow-stale"]).0, 0);
    // Without any store (a CI machine with only the crate and its fixtures) nothing can
    // say which revision or snapshot is under test: stale until allowed.
    let manifest = d.mapping_dir("source-library").join("mapping.toml");
    let no_state = d.dir.path().join("no-state");
    let run = |extra: &[&str]| {
        let out = std::process::Command::new(crate::common::airlock_bin())
            .env_remove("AIRLOCK_STATE_DIR")
            .env("XDG_STATE_HOME", &no_state)
            .arg("test")
            .arg(&manifest)
            .arg("--fixtures")
            .arg(&fixtures)
            .args(extra)
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (code, stdout) = run(&[]);
    assert_eq!(code, 1, "{stdout}");
    assert!(stdout.contains("no store to compare with"), "{stdout}");
    let (code, stdout) = run(&["--allow-stale"]);
    assert_eq!(code, 0, "{stdout}");
    assert!(
        stdout.contains("PASSED: state unchanged: no store"),
        "{stdout}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn hostile_fixture_files_get_a_clear_error() {
    let (d, fixtures) = recorded().await;
    let path = fixtures.join("0002-retrieve.json");
    let good = std::fs::read(&path).unwrap();
    // Not JSON.
    std::fs::write(&path, b"{\"airlock_fixture\": 1, ").unwrap();
    let (code, _, stderr) = test(&d, &fixtures, &[]);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("fixture 0002-retrieve.json: is not JSON"),
        "{stderr}"
    );
    // Wrong types.
    let mut v: Value = serde_json::from_slice(&good).unwrap();
    v["exchanges"] = json!("all of them");
    write(&path, &v);
    let (code, _, stderr) = test(&d, &fixtures, &[]);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("fixture 0002-retrieve.json: does not have the fixture shape"),
        "{stderr}"
    );
    // An unknown member.
    let mut v: Value = serde_json::from_slice(&good).unwrap();
    v["call"]["also"] = json!(1);
    write(&path, &v);
    let (code, _, stderr) = test(&d, &fixtures, &[]);
    assert_eq!(code, 2);
    assert!(stderr.contains("unknown field `also`"), "{stderr}");
    // Huge.
    let huge = vec![b' '; (16 << 20) + 1];
    std::fs::write(&path, huge).unwrap();
    let (code, _, stderr) = test(&d, &fixtures, &[]);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("over the 16777216 bytes a fixture may be"),
        "{stderr}"
    );
    // Another mapping's fixture.
    let mut v: Value = serde_json::from_slice(&good).unwrap();
    v["mapping"]["name"] = json!("someone-else");
    write(&path, &v);
    let (code, _, stderr) = test(&d, &fixtures, &[]);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("recorded for mapping `someone-else`"),
        "{stderr}"
    );
    // An input of the wrong contract type fails that fixture (exit 1), not the run.
    let mut v: Value = serde_json::from_slice(&good).unwrap();
    v["call"]["input"] = json!({"reference": 42});
    write(&path, &v);
    let (code, stdout, _) = test(&d, &fixtures, &[]);
    assert_eq!(code, 1, "{stdout}");
    assert!(
        stdout.contains("the recorded input does not have the contract's type for `retrieve`"),
        "{stdout}"
    );
    // A recorded upstream error: the adapter's error path is exercised and reported, and
    // its result differs from the recorded success.
    let mut v: Value = serde_json::from_slice(&good).unwrap();
    v["exchanges"][0]["answer"] = json!({"error": {"message": "the library is closed"}});
    write(&path, &v);
    let (code, stdout, _) = test(&d, &fixtures, &["--json"]);
    assert_eq!(code, 1, "{stdout}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    let paths = report["error_paths"].to_string();
    assert!(
        paths.contains("retrieve ← tools/call read_note: error")
            && paths.contains("retrieve → err("),
        "{paths}"
    );
    let exercised = report["error_paths"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p.as_str().unwrap().starts_with("retrieve → err("))
        .unwrap()
        .clone();
    assert!(
        !report["error_cases_not_exercised"]
            .as_array()
            .unwrap()
            .contains(&exercised),
        "{report}"
    );
    assert!(
        report["fixtures"][1]["problems"][0]
            .as_str()
            .unwrap()
            .starts_with("returned {\"err\":"),
        "{report}"
    );
    // A recorded answer over the manifest's output budget (max_output_bytes = 262144) is
    // refused in replay as it would be live: the adapter never sees it.
    let mut v: Value = serde_json::from_slice(&good).unwrap();
    v["exchanges"][0]["answer"]["result"]["content"][0]["text"] = json!("x".repeat(300_000));
    write(&path, &v);
    let (code, stdout, _) = test(&d, &fixtures, &["--json"]);
    assert_eq!(code, 1, "{stdout}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    assert!(
        report["error_paths"]
            .to_string()
            .contains("retrieve ← tools/call read_note: refused (airlock: the upstream answer exceeded the mapping's output budget of 262144 bytes"),
        "{report}"
    );
    assert_eq!(report["fixtures"][1]["passed"], false);
    // No fixture at all.
    let empty = d.dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let (code, _, stderr) = test(&d, &empty, &[]);
    assert_eq!(code, 2);
    assert!(stderr.contains("holds no fixture"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_candidate_that_passes_becomes_fixture_tested_and_review_shows_the_digest() {
    let (_recording, fixtures) = recorded().await;
    // Another host's store, where the mapping was loaded but never reviewed: a candidate.
    let d = Deployment::with_notes().mapping("source-library");
    let config = d.write_config();
    d.airlock_ok(&["discover", "notes", "--config", config.to_str().unwrap()]);
    let client = d.serve_unreviewed().await;
    client.cancel().await.unwrap();
    let show = d.airlock_json(&["review", "show", "source-library"]);
    assert_eq!(show["current"]["state"], "candidate", "{show}");
    // Its connection id differs, so its snapshot digest does: stale until allowed.
    let (code, stdout, _) = test(&d, &fixtures, &[]);
    assert_eq!(code, 1, "{stdout}");
    assert!(stdout.contains("recorded under snapshot"), "{stdout}");
    assert_eq!(
        d.airlock_json(&["review", "show", "source-library"])["current"]["state"],
        "candidate"
    );
    let (code, stdout, _) = test(&d, &fixtures, &["--allow-stale", "--json"]);
    assert_eq!(code, 0, "{stdout}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["state_before"], "candidate");
    assert_eq!(report["state_after"], "fixture-tested");
    let digest = report["fixtures_sha256"].as_str().unwrap().to_string();
    assert_eq!(digest.len(), 64);
    let show = d.airlock_ok(&["review", "show", "source-library"]);
    assert!(show.contains("revision 1: fixture-tested"), "{show}");
    assert!(
        show.contains(&format!("fixtures sha256 {digest}"))
            && show.contains("stale fixtures allowed"),
        "{show}"
    );
    // The change is a MACed trace event carrying the digest.
    let event = d
        .trace()
        .into_iter()
        .rev()
        .find(|e| e["kind"] == "mapping-state-changed")
        .unwrap();
    assert_eq!(event["payload"]["to"], "fixture-tested");
    assert_eq!(event["payload"]["fixtures_sha256"], digest.as_str());
    assert_eq!(event["key_id"].as_str().unwrap().len(), 16);
    assert!(d.airlock_ok(&["trace", "verify"]).contains("trace intact"));
    // Passing again changes nothing more; approving it makes it serve.
    let (code, stdout, _) = test(&d, &fixtures, &["--allow-stale"]);
    assert_eq!(code, 0);
    assert!(
        stdout.contains("is fixture-tested (only a candidate"),
        "{stdout}"
    );
    d.approve("source-library", "reviewer", &[]);
    let client = d.serve_unreviewed().await;
    let hits = call(&client, "search_sources", json!({"query": "checkpoint"}))
        .await
        .unwrap();
    assert!(!references(&hits).is_empty());
    client.cancel().await.unwrap();
    let show = d.airlock_ok(&["review", "show", "source-library"]);
    assert!(
        show.contains("fixture-tested: revision 1 passed 3 fixture(s)"),
        "{show}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_effect_call_replays_with_its_recorded_idempotency_key() {
    use crate::approvals::{Person, deliver_args, prepared};
    use crate::common::{POLICY, PROFILES};
    let d = Deployment::with_notes()
        .mapping("source-library")
        .with_outbox(&[])
        .policy(POLICY)
        .tables(PROFILES);
    d.approve_all();
    let fixtures = d.dir.path().join("fixtures");
    let mut cmd = d.serve_command();
    cmd.arg("--profile")
        .arg("publisher")
        .arg("--record")
        .arg(&fixtures);
    let client = Person::new(rmcp::model::ElicitationAction::Accept)
        .serve(TokioChildProcess::new(cmd).unwrap())
        .await
        .unwrap();
    let (artifact, team) = prepared(&client, "team-reports").await;
    let r = call(&client, "deliver_artifact", deliver_args(&artifact, &team))
        .await
        .unwrap();
    assert_ne!(r.is_error, Some(true), "{r:?}");
    client.cancel().await.unwrap();
    assert_eq!(d.sends(), 1);
    assert_eq!(
        files(&fixtures),
        [
            "0001-prepare.json",
            "0002-list-destinations.json",
            "0003-deliver.json"
        ]
    );
    let deliver = read(&fixtures.join("0003-deliver.json"));
    let key = deliver["call"]["idempotency_key"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(key.starts_with("idk_"), "{deliver}");
    assert_eq!(
        deliver["exchanges"][0]["params"]["arguments"]["idempotency_key"],
        key.as_str()
    );
    let (code, stdout, stderr) = test_mapping(&d, "outbox-delivery", &fixtures, &[]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(
        stdout.contains("functions exercised: deliver ×1, list-destinations ×1, prepare ×1"),
        "{stdout}"
    );
    // Nothing was delivered again: the replayed upstream is not the delivery server.
    assert_eq!(d.sends(), 1);
}
