//! `airlock serve` over stdio with the notes fixture server: the walking skeleton, end to
//! end, and every refusal it must make before anything reaches the upstream server.

use crate::common::*;
use serde_json::{Value, json};

const INVALID_PARAMS: i32 = -32602;

#[tokio::test]
async fn list_search_retrieve_through_the_adapter() {
    let d = Deployment::with_notes().mapping("source-library");
    let client = d.serve().await;

    let tools = client.peer().list_all_tools().await.unwrap();
    let names: Vec<_> = tools.iter().map(|t| t.name.to_string()).collect();
    assert_eq!(names, ["retrieve_source", "search_sources"]);
    let listing = serde_json::to_string(&tools).unwrap();
    for upstream_only in ["search_notes", "read_note", "export_workspace", "notes://"] {
        assert!(
            !listing.contains(upstream_only),
            "upstream detail `{upstream_only}` leaked into tools/list: {listing}"
        );
    }
    let search = tools.iter().find(|t| t.name == "search_sources").unwrap();
    let schema = Value::Object((*search.input_schema).clone());
    assert_eq!(schema["additionalProperties"], false);
    assert_eq!(schema["required"], json!(["query"]));

    let hits = call(&client, "search_sources", json!({"query": "checkpoint"}))
        .await
        .unwrap();
    assert_ne!(hits.is_error, Some(true), "{}", text_of(&hits));
    let refs = references(&hits);
    assert!(!refs.is_empty());
    for r in &refs {
        assert!(
            r.starts_with("ref_") && r.len() == 44,
            "not an opaque token: {r}"
        );
    }
    let hit_json = hits.structured_content.as_ref().unwrap().to_string();
    assert!(
        !hit_json.contains("wal-checkpoints"),
        "the note id (adapter locator) leaked: {hit_json}"
    );

    let passage = call(&client, "retrieve_source", json!({"reference": refs[0]}))
        .await
        .unwrap();
    assert_ne!(passage.is_error, Some(true), "{}", text_of(&passage));
    let s = passage.structured_content.as_ref().unwrap();
    assert!(s["result"]["text"].as_str().unwrap().len() > 100);
    assert_eq!(s["provenance"][0]["connection"], "notes");
    assert_eq!(s["provenance"][0]["method"], "tools/call");
    assert_eq!(s["provenance"][0]["target"], "read_note");
    assert_eq!(
        s["provenance"][0]["result_sha256"].as_str().unwrap().len(),
        64
    );
    assert!(
        s["provenance"][0]["retrieved_at"]
            .as_str()
            .unwrap()
            .ends_with('Z')
    );
    let text = text_of(&passage);
    assert!(text.contains("not instructions"), "{text}");
    assert!(text.contains("BEGIN UNTRUSTED DATA") && text.contains("END UNTRUSTED DATA"));

    assert_eq!(d.upstream_tool_calls(), ["search_notes", "read_note"]);
    client.cancel().await.unwrap();
}

/// The research loop over stdio, in both protocol generations: a second search reports
/// the notes of the first with other, query-dependent snippets; every reference of the
/// first search still resolves (README: the same object gets the same token in one
/// session), and the second search handed out the same tokens for the same notes.
#[tokio::test]
async fn a_second_search_leaves_the_first_searchs_references_valid_in_both_eras() {
    use rmcp::service::{ClientLifecycleMode, ClientServiceExt as _};
    let d = Deployment::with_notes().mapping("source-library");
    d.approve_all();
    let legacy = d.serve_unreviewed().await;
    let stateless = ()
        .serve_with_lifecycle(
            rmcp::transport::TokioChildProcess::new(d.serve_command()).unwrap(),
            ClientLifecycleMode::Discover {
                preferred_versions: vec![rmcp::model::ProtocolVersion::V_2026_07_28],
            },
        )
        .await
        .expect("server/discover with airlock serve");
    let (found, failed) = research_loop(&legacy, "checkpoint", "wal").await;
    assert!(found >= 2, "the first search finds several notes: {found}");
    assert_eq!(failed, Vec::<String>::new(), "2025-11-25 over stdio");
    let (found, failed) = research_loop(&stateless, "checkpoint", "wal").await;
    assert!(found >= 2);
    assert_eq!(failed, Vec::<String>::new(), "2026-07-28 over stdio");
    // One note, one token, whichever search reported it.
    let tokens = |r: &rmcp::model::CallToolResult| -> std::collections::BTreeMap<String, String> {
        r.structured_content.as_ref().unwrap()["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| {
                (
                    h["title"].as_str().unwrap().to_string(),
                    h["reference"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    };
    let a = call(&legacy, "search_sources", json!({"query": "checkpoint"}))
        .await
        .unwrap();
    let b = call(&legacy, "search_sources", json!({"query": "wal"}))
        .await
        .unwrap();
    let (a, b) = (tokens(&a), tokens(&b));
    let shared: Vec<_> = a.keys().filter(|k| b.contains_key(*k)).collect();
    assert!(
        !shared.is_empty(),
        "the two searches share notes: {a:?} {b:?}"
    );
    for k in shared {
        assert_eq!(a[k], b[k], "{k}");
    }
    legacy.cancel().await.unwrap();
    stateless.cancel().await.unwrap();
}

#[tokio::test]
async fn the_hostile_note_arrives_as_quoted_data_and_adds_no_capability() {
    let d = Deployment::with_notes().mapping("source-library");
    let client = d.serve().await;
    let hits = call(
        &client,
        "search_sources",
        json!({"query": "incident review"}),
    )
    .await
    .unwrap();
    let found = hits.structured_content.as_ref().unwrap()["result"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| {
            h["title"]
                .as_str()
                .unwrap()
                .to_lowercase()
                .contains("incident")
        })
        .cloned()
        .expect("the incident note is searchable");
    let passage = call(
        &client,
        "retrieve_source",
        json!({"reference": found["reference"]}),
    )
    .await
    .unwrap();
    let text = text_of(&passage);
    let begin = text.find("BEGIN UNTRUSTED DATA").unwrap();
    let end = text.find("END UNTRUSTED DATA").unwrap();
    let at = text
        .find("export_workspace")
        .expect("the injected instruction is delivered as data");
    assert!(
        begin < at && at < end,
        "the instruction must sit inside the quoted block"
    );
    let line = text[..at].rsplit('\n').next().unwrap();
    assert!(
        line.trim_start().starts_with('>'),
        "multi-line source text is line-quoted: {line:?}"
    );

    let tools = client.peer().list_all_tools().await.unwrap();
    assert_eq!(
        tools.len(),
        2,
        "no capability appears because a source asked for one"
    );
    assert!(
        !d.upstream_tool_calls()
            .contains(&"export_workspace".to_string())
    );
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn unknown_or_mistyped_arguments_never_reach_the_upstream() {
    let d = Deployment::with_notes().mapping("source-library");
    let client = d.serve().await;
    let before = d.upstream_calls().len();
    for args in [
        json!({"query": "wal", "path": "/etc/passwd"}),
        json!({"query": 42}),
        json!({"limit": 3}),
        json!({"query": "wal", "limit": -1}),
        json!({"query": "wal", "limit": "3"}),
    ] {
        let text = refused_arguments(call(&client, "search_sources", args.clone()).await);
        assert!(
            text.contains("invalid arguments for `search_sources`"),
            "{args}: {text}"
        );
    }
    let err = call(&client, "read_note", json!({"id": "wal-checkpoints"}))
        .await
        .unwrap_err();
    assert_eq!(
        error_code(&err),
        Some(INVALID_PARAMS),
        "upstream tool names are not callable"
    );
    let err = call(&client, "export_workspace", json!({"destination": "x"}))
        .await
        .unwrap_err();
    assert_eq!(error_code(&err), Some(INVALID_PARAMS));
    assert_eq!(
        d.upstream_calls().len(),
        before,
        "refused calls must not reach the upstream: {:?}",
        d.upstream_calls()
    );
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn forged_and_foreign_references_fail_before_any_upstream_request() {
    let d = Deployment::with_notes().mapping("source-library");
    let a = d.serve().await;
    let b = d.serve().await;
    let hits = call(&a, "search_sources", json!({"query": "checkpoint"}))
        .await
        .unwrap();
    let token = references(&hits)[0].clone();
    let reads_before = d
        .upstream_tool_calls()
        .iter()
        .filter(|t| *t == "read_note")
        .count();

    // Another airlock process cannot use it (it never minted it). The session binding
    // inside one host is tested in sessions.rs.
    let err = refused_arguments(call(&b, "retrieve_source", json!({"reference": token})).await);
    assert!(err.contains("not valid in this session"), "{err}");
    // Forged tokens, and the raw locator the adapter used, fail the same way.
    for forged in [
        "ref_0000000000000000000000000000000000000000".to_string(),
        {
            // Same token with its last digit changed.
            let last = if token.ends_with('0') { "1" } else { "0" };
            format!("{}{last}", &token[..token.len() - 1])
        },
        "wal-checkpoints".to_string(),
        "../../etc/passwd".to_string(),
    ] {
        let err =
            refused_arguments(call(&a, "retrieve_source", json!({"reference": forged})).await);
        assert!(err.contains("/reference"), "{forged}: {err}");
    }
    let reads_after = d
        .upstream_tool_calls()
        .iter()
        .filter(|t| *t == "read_note")
        .count();
    assert_eq!(
        reads_after, reads_before,
        "no read_note may be sent for a bad reference"
    );

    // The owner still can.
    let ok = call(&a, "retrieve_source", json!({"reference": token}))
        .await
        .unwrap();
    assert_ne!(ok.is_error, Some(true), "{}", text_of(&ok));
    a.cancel().await.unwrap();
    b.cancel().await.unwrap();
}

#[tokio::test]
async fn an_adapter_calling_a_tool_outside_its_mapping_is_refused_and_nothing_is_sent() {
    let d = Deployment::with_notes().mapping("rogue-call");
    let client = d.serve().await;
    let result = call(&client, "rogue_search", json!({"query": "anything"}))
        .await
        .unwrap();
    assert_eq!(result.is_error, Some(true));
    let text = text_of(&result);
    assert!(
        text.contains("not-permitted") || text.contains("not listed"),
        "{text}"
    );
    assert!(
        !d.upstream_tool_calls()
            .contains(&"export_workspace".to_string()),
        "export_workspace reached the upstream: {:?}",
        d.upstream_calls()
    );
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn a_component_whose_digest_differs_from_its_pin_is_refused_naming_both() {
    let d = Deployment::with_notes().mapping("source-library");
    let wasm = d.mapping_dir("source-library").join("source_library.wasm");
    let mut bytes = std::fs::read(&wasm).unwrap();
    let pinned = {
        use sha2::Digest as _;
        hex::encode(sha2::Sha256::digest(&bytes))
    };
    // Append a custom section: still a valid component, different bytes.
    bytes.extend_from_slice(&[0x00, 0x05, 0x04, b'e', b'v', b'i', b'l']);
    std::fs::write(&wasm, &bytes).unwrap();
    let actual = {
        use sha2::Digest as _;
        hex::encode(sha2::Sha256::digest(&bytes))
    };
    let (ok, stderr) = d.serve_expecting_failure();
    assert!(!ok, "serve must refuse to start");
    assert!(
        stderr.contains(&pinned) && stderr.contains(&actual),
        "both digests named: {stderr}"
    );
    assert!(
        d.upstream_calls().is_empty(),
        "nothing may reach the upstream: {:?}",
        d.upstream_calls()
    );
}

#[tokio::test]
async fn an_oversized_upstream_result_is_refused_while_reading() {
    let d = Deployment::with_notes().mapping_edited("source-library", |t| {
        t.replace("max_output_bytes = 262144", "max_output_bytes = 8192")
    });
    let client = d.serve().await;
    let hits = call(
        &client,
        "search_sources",
        json!({"query": "storage engine handbook", "limit": 10}),
    )
    .await
    .unwrap();
    let handbook = hits.structured_content.as_ref().unwrap()["result"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| {
            h["title"]
                .as_str()
                .unwrap()
                .to_lowercase()
                .contains("handbook")
        })
        .cloned()
        .expect("the long note is searchable");
    let result = call(
        &client,
        "retrieve_source",
        json!({"reference": handbook["reference"]}),
    )
    .await
    .unwrap();
    assert_eq!(result.is_error, Some(true), "{}", text_of(&result));
    let text = text_of(&result);
    assert!(
        text.contains("8192") || text.contains("budget") || text.contains("too large"),
        "{text}"
    );
    assert!(
        text.len() < 2000,
        "the oversized body must not pass: {} bytes",
        text.len()
    );
    assert!(
        d.upstream_tool_calls().contains(&"read_note".to_string()),
        "the request was sent; its answer was refused"
    );
    // The connection survives: a small note still reads.
    let small = call(&client, "search_sources", json!({"query": "keepalive"}))
        .await
        .unwrap();
    let r = references(&small)[0].clone();
    let ok = call(&client, "retrieve_source", json!({"reference": r}))
        .await
        .unwrap();
    assert_ne!(ok.is_error, Some(true), "{}", text_of(&ok));
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn an_adapter_that_loops_forever_is_interrupted_and_the_next_call_succeeds() {
    let metrics = format!("127.0.0.1:{}", free_port());
    let d = Deployment::with_notes()
        .mapping("spin-forever")
        .mapping("source-library")
        .tables(&format!("[telemetry]\nmetrics = \"{metrics}\"\n"));
    let client = d.serve().await;
    let started = std::time::Instant::now();
    // A missing deadline must fail this test, not hang it.
    let result = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        call(&client, "spin_search", json!({"query": "spin"})),
    )
    .await
    .expect("the deadline must interrupt the adapter")
    .unwrap();
    let elapsed = started.elapsed();
    assert_refused(&result, airlock::pipeline::Category::Interrupted);
    assert!(
        elapsed < std::time::Duration::from_secs(5),
        "deadline is 1 s, took {elapsed:?}"
    );
    assert!(
        d.upstream_tool_calls().is_empty(),
        "the spinning search never reached the upstream"
    );
    // Counted: the containment by its kind, the call by its category.
    let text = crate::observability::scrape(&metrics);
    for line in [
        "airlock_adapter_contained_total{kind=\"deadline\",mapping=\"spin-forever\"}",
        "airlock_calls_total{capability=\"spin_search\",category=\"interrupted\",outcome=\"refused\"}",
    ] {
        assert_eq!(
            crate::observability::sample(&text, line),
            1.0,
            "{line} in:\n{text}"
        );
    }

    // The same adapter serves the next calls, in fresh instances, and so does its neighbour.
    let hits = call(&client, "spin_search", json!({"query": "checkpoint"}))
        .await
        .unwrap();
    assert_ne!(hits.is_error, Some(true), "{}", text_of(&hits));
    let token = references(&hits)[0].clone();
    let ok = call(&client, "spin_retrieve", json!({"reference": token}))
        .await
        .unwrap();
    assert_ne!(ok.is_error, Some(true), "{}", text_of(&ok));
    let hits = call(&client, "search_sources", json!({"query": "keepalive"}))
        .await
        .unwrap();
    assert_ne!(hits.is_error, Some(true));
    client.cancel().await.unwrap();
}

/// A call that runs in a spare instance (made after the mapping's previous call, before
/// this one arrived) gets its own deadline, counted from when it starts: the spare here
/// waits longer than the 1 s deadline before its call spins, and the spin still runs for
/// the whole deadline (a deadline left from when the spare was made would interrupt it at
/// once). The trace says which calls ran in a spare (`execute.spare`) and which were
/// instantiated on the call's path (`execute.instantiate`).
#[tokio::test]
async fn a_call_in_a_spare_instance_gets_its_whole_deadline_from_its_start() {
    let d = Deployment::with_notes().mapping("spin-forever");
    let client = d.serve().await;
    let first = call(&client, "spin_search", json!({"query": "checkpoint"}))
        .await
        .unwrap();
    assert_ne!(first.is_error, Some(true), "{}", text_of(&first));
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let started = std::time::Instant::now();
    let spun = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        call(&client, "spin_search", json!({"query": "spin"})),
    )
    .await
    .expect("the deadline must interrupt the adapter")
    .unwrap();
    let elapsed = started.elapsed();
    assert!(
        text_of(&spun).starts_with("interrupted"),
        "{}",
        text_of(&spun)
    );
    assert!(
        elapsed >= std::time::Duration::from_millis(900)
            && elapsed < std::time::Duration::from_secs(5),
        "the deadline is 1 s from the call's start; it was interrupted after {elapsed:?}"
    );
    // After the interrupted call, the next one runs in a spare again (made after its
    // answer was written, so give that a moment).
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let again = call(&client, "spin_search", json!({"query": "checkpoint"}))
        .await
        .unwrap();
    assert_ne!(again.is_error, Some(true), "{}", text_of(&again));
    client.cancel().await.unwrap();
    let stages: Vec<Value> = d
        .trace()
        .into_iter()
        .filter(|e| e["kind"] == "call-outcome")
        .map(|e| e["payload"]["stages_us"].clone())
        .collect();
    assert_eq!(stages.len(), 3, "{stages:?}");
    assert!(
        stages[0].get("execute.instantiate").is_some() && stages[0].get("execute.spare").is_none(),
        "the first call has no spare to run in: {stages:?}"
    );
    for later in &stages[1..] {
        assert!(
            later.get("execute.spare").is_some() && later.get("execute.instantiate").is_none(),
            "a later call runs in the spare made after the one before: {stages:?}"
        );
    }
}

#[tokio::test]
async fn upstream_servers_start_with_only_their_declared_environment() {
    let d = Deployment::with_notes().mapping("source-library");
    let env_log = d.dir.path().join("env.txt");
    // A second connection to the notes server that records its environment.
    std::fs::write(&env_log, "").unwrap();
    let d = d.connection(&format!(
        "[[connection]]\nname = \"probe\"\ncommand = \"@airlock\"\nargs = [\"fixture\", \"notes-server\", \"--env-log\", {:?}]\nenv = {{ DECLARED = \"yes\" }}\n{}",
        env_log.display().to_string(),
        confined(&[(&env_log, "read-write")])
    ));
    let manifest = d.mapping_dir("source-library").join("mapping.toml");
    let probe = d.dir.path().join("mappings/probe");
    std::fs::create_dir_all(&probe).unwrap();
    for f in ["mapping.toml", "source_library.wasm"] {
        std::fs::copy(d.mapping_dir("source-library").join(f), probe.join(f)).unwrap();
    }
    let text = std::fs::read_to_string(&manifest).unwrap();
    std::fs::write(
        probe.join("mapping.toml"),
        text.replace("name = \"source-library\"", "name = \"probe\"")
            .replace("connection = \"notes\"", "connection = \"probe\"")
            .replace("search_sources", "probe_search")
            .replace("retrieve_source", "probe_retrieve"),
    )
    .unwrap();
    let config = d.write_config();
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str(&format!(
        "[[mapping]]\nmanifest = {:?}\n",
        probe.join("mapping.toml").display().to_string()
    ));
    std::fs::write(&config, text).unwrap();

    let mut cmd = tokio::process::Command::new(airlock_bin());
    cmd.arg("serve").arg("--config").arg(&config);
    cmd.env("AIRLOCK_CACHE_DIR", test_cache_dir());
    cmd.env("AIRLOCK_HOST_CANARY", "must-not-leak");
    let client = rmcp::ServiceExt::serve((), rmcp::transport::TokioChildProcess::new(cmd).unwrap())
        .await
        .unwrap();
    let names = std::fs::read_to_string(&env_log).unwrap();
    let names: Vec<&str> = names.lines().collect();
    // TMPDIR: the confined server's private temporary folder (upstream::confine).
    assert_eq!(
        names,
        ["DECLARED", "TMPDIR"],
        "the upstream saw more than its declared environment"
    );
    client.cancel().await.unwrap();
}
