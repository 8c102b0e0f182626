//! Hot reload of a watched mappings folder, against a running `airlock serve` with clients
//! calling concurrently.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::common::*;
use serde_json::json;

/// Writes `text` to `path` the way a deploy tool does: beside it, then rename over.
fn replace_file(path: &std::path::Path, bytes: &[u8]) {
    let tmp = path.with_extension("incoming");
    std::fs::write(&tmp, bytes).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Polls the trace until an event of `kind` appears (up to 10 s).
async fn wait_for_event(d: &Deployment, kind: &str) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(e) = d.trace().into_iter().find(|e| e["kind"] == kind) {
            return e;
        }
        assert!(Instant::now() < deadline, "no `{kind}` event in the trace");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_changed_mapping_swaps_in_while_clients_call_with_zero_failed_calls() {
    let d = Deployment::with_notes().mapping("source-library").watched();
    let client = Arc::new(d.serve().await);
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let mut workers = Vec::new();
    for _ in 0..4 {
        let (client, stop, ok, failed) = (client.clone(), stop.clone(), ok.clone(), failed.clone());
        workers.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                match call(&client, "search_sources", json!({"query": "checkpoint"})).await {
                    Ok(r) if r.is_error != Some(true) => ok.fetch_add(1, Ordering::SeqCst),
                    other => {
                        eprintln!("failed call: {other:?}");
                        failed.fetch_add(1, Ordering::SeqCst)
                    }
                };
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // A reviewed change: a new local description (a new manifest digest, same pins),
    // approved from a staging copy before it is deployed.
    let manifest = d.mapping_dir("source-library").join("mapping.toml");
    let text = std::fs::read_to_string(&manifest).unwrap();
    let changed = text.replace(
        "Search the technical notes library.",
        "Search the notes (revised).",
    );
    assert_ne!(text, changed);
    let staging = d.dir.path().join("staging");
    std::fs::create_dir_all(&staging).unwrap();
    std::fs::copy(
        d.mapping_dir("source-library").join("source_library.wasm"),
        staging.join("source_library.wasm"),
    )
    .unwrap();
    std::fs::write(staging.join("mapping.toml"), &changed).unwrap();
    d.approve(
        "source-library",
        "alice",
        &["--manifest", staging.join("mapping.toml").to_str().unwrap()],
    );
    // Approved ahead of deployment: the running revision keeps serving meanwhile.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        client
            .peer()
            .list_all_tools()
            .await
            .unwrap()
            .iter()
            .any(|t| t
                .description
                .as_deref()
                .is_some_and(|d| d.starts_with("Search the technical notes library.")))
    );
    let landed = Instant::now();
    replace_file(&manifest, changed.as_bytes());
    let swapped = loop {
        let tools = client.peer().list_all_tools().await.unwrap();
        if tools.iter().any(|t| {
            t.description
                .as_deref()
                .is_some_and(|s| s.starts_with("Search the notes (revised)."))
        }) {
            break landed.elapsed();
        }
        assert!(
            landed.elapsed() < Duration::from_secs(10),
            "the new revision never served"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::SeqCst);
    for w in workers {
        w.await.unwrap();
    }
    eprintln!(
        "swap visible after {swapped:?}; {} calls ok, {} failed",
        ok.load(Ordering::SeqCst),
        failed.load(Ordering::SeqCst)
    );
    assert_eq!(failed.load(Ordering::SeqCst), 0);
    assert!(ok.load(Ordering::SeqCst) > 10);
    // The approved revision serves.
    let show = d.airlock_json(&["review", "show", "source-library"]);
    assert_eq!(show["current"]["state"], "active", "{show:#}");
    assert_eq!(show["current"]["revision"], 2);
    assert_eq!(show["current"]["reviewer"], "alice");
    let r = call(&client, "search_sources", json!({"query": "wal"}))
        .await
        .unwrap();
    assert_ne!(r.is_error, Some(true));
}

#[tokio::test]
async fn a_digest_mismatched_component_is_refused_and_the_old_revision_keeps_serving() {
    let d = Deployment::with_notes().mapping("source-library").watched();
    let client = d.serve().await;
    let before = call(&client, "search_sources", json!({"query": "wal"}))
        .await
        .unwrap();
    assert_ne!(before.is_error, Some(true));
    // Another component's bytes under the pinned file name.
    let component = d.mapping_dir("source-library").join("source_library.wasm");
    let rogue = std::fs::read(bundle().join("rogue-call/rogue_call.wasm")).unwrap();
    replace_file(&component, &rogue);
    let event = wait_for_event(&d, "mapping-load-failed").await;
    let error = event["payload"]["error"].as_str().unwrap();
    assert!(error.contains("sha256"), "{error}");
    // Still offered, still served by the old revision.
    assert_eq!(client.peer().list_all_tools().await.unwrap().len(), 2);
    let after = call(&client, "search_sources", json!({"query": "wal"}))
        .await
        .unwrap();
    assert_ne!(after.is_error, Some(true), "{}", text_of(&after));
    assert_eq!(
        d.airlock_json(&["review", "show", "source-library"])["current"]["revision"],
        1,
        "no revision recorded for refused bytes"
    );
    client.cancel().await.ok();
}

#[tokio::test]
async fn removing_a_mapping_closes_its_capabilities_and_references() {
    let d = Deployment::with_notes().mapping("source-library").watched();
    let notices = Notices::default();
    d.approve_all();
    let client = d.serve_with(notices.clone()).await;
    let hits = call(&client, "search_sources", json!({"query": "checkpoint"}))
        .await
        .unwrap();
    let reference = references(&hits)[0].clone();

    let folder = d.mapping_dir("source-library");
    let parked = d.dir.path().join("parked");
    std::fs::rename(&folder, &parked).unwrap();
    assert!(
        notices.wait_beyond(0, 10).await,
        "no tools/list_changed on removal"
    );
    assert!(client.peer().list_all_tools().await.unwrap().is_empty());
    let gone = call(&client, "retrieve_source", json!({"reference": reference})).await;
    assert_eq!(
        gone.as_ref().err().and_then(error_code),
        Some(-32602),
        "{gone:?}"
    );
    wait_for_event(&d, "mapping-unloaded").await;

    // Back again: the capability returns, but a reference minted before removal does not.
    let seen = notices.count();
    std::fs::rename(&parked, &folder).unwrap();
    assert!(
        notices.wait_beyond(seen, 10).await,
        "no tools/list_changed on return"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while client.peer().list_all_tools().await.unwrap().len() != 2 {
        assert!(Instant::now() < deadline, "the mapping did not come back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stale =
        refused_arguments(call(&client, "retrieve_source", json!({"reference": reference})).await);
    assert!(stale.contains("issued before"), "{stale}");
    assert_eq!(
        d.upstream_tool_calls(),
        ["search_notes"],
        "nothing after removal reached the server"
    );
    client.cancel().await.ok();
}

#[tokio::test]
async fn a_new_mapping_dropped_into_the_folder_loads_unreviewed_until_approved() {
    let d = Deployment::with_notes().watched();
    let notices = Notices::default();
    let client = d.serve_with(notices.clone()).await;
    assert!(client.peer().list_all_tools().await.unwrap().is_empty());
    // Stage the mapping outside, then move it in whole.
    let staged = Deployment::with_notes().mapping("source-library");
    let from = staged.mapping_dir("source-library");
    let to = d.dir.path().join("mappings").join("source-library");
    std::fs::rename(&from, &to).unwrap();
    wait_for_event(&d, "mapping-loaded").await;
    assert!(
        client.peer().list_all_tools().await.unwrap().is_empty(),
        "unreviewed: not offered"
    );
    let config = d.write_config();
    d.airlock_ok(&["discover", "notes", "--config", config.to_str().unwrap()]);
    let seen = notices.count();
    d.approve("source-library", "alice", &[]);
    assert!(notices.wait_beyond(seen, 10).await);
    assert_eq!(client.peer().list_all_tools().await.unwrap().len(), 2);
    client.cancel().await.ok();
}

/// A changed manifest dropped in without review (here: another component with a folder
/// grant and new capability names) is staged: the reviewed revision keeps serving, the
/// new capabilities are not offered, nothing is recorded as a revision; once a reviewer
/// approves it, it is swapped in.
#[tokio::test]
async fn an_unreviewed_change_is_staged_while_the_reviewed_revision_serves() {
    let d = Deployment::with_notes().mapping("source-library").watched();
    let notices = Notices::default();
    d.approve_all();
    let client = d.serve_with(notices.clone()).await;
    let names = |tools: Vec<rmcp::model::Tool>| -> Vec<String> {
        tools.into_iter().map(|t| t.name.to_string()).collect()
    };
    assert_eq!(
        names(client.peer().list_all_tools().await.unwrap()),
        ["retrieve_source", "search_sources"]
    );
    let secret = d.dir.path().join("secret");
    std::fs::create_dir_all(&secret).unwrap();
    std::fs::write(secret.join("key.txt"), "TOP-SECRET").unwrap();
    let manifest = d.mapping_dir("source-library").join("mapping.toml");
    let text = std::fs::read_to_string(&manifest).unwrap();
    let swapped = text
        .replace("name = \"search_sources\"", "name = \"search_everything\"")
        .replace(
            "[grants]",
            &format!(
                "[[grants.filesystem]]\nhost = {:?}\nguest = \"/data\"\naccess = \"read-write\"",
                secret.display().to_string()
            ),
        );
    replace_file(&manifest, swapped.as_bytes());
    let event = wait_for_event(&d, "mapping-staged").await;
    assert_eq!(event["payload"]["serving_revision"], 1);
    // The reviewed revision still serves; the new names are not offered or callable.
    assert_eq!(
        names(client.peer().list_all_tools().await.unwrap()),
        ["retrieve_source", "search_sources"]
    );
    let r = call(&client, "search_everything", json!({"query": "x"})).await;
    assert_eq!(r.as_ref().err().and_then(error_code), Some(-32602), "{r:?}");
    let r = call(&client, "search_sources", json!({"query": "wal"}))
        .await
        .unwrap();
    assert_ne!(r.is_error, Some(true), "{}", text_of(&r));
    let show = d.airlock_json(&["review", "show", "source-library"]);
    assert_eq!(
        show["current"]["revision"], 1,
        "nothing recorded for the staged manifest"
    );
    assert_eq!(show["current"]["state"], "active");

    // A reviewer approves what is in the folder: it is swapped in.
    let seen = notices.count();
    d.approve("source-library", "alice", &[]);
    assert!(
        notices.wait_beyond(seen, 10).await,
        "no tools/list_changed after approval"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = names(client.peer().list_all_tools().await.unwrap());
        if now == ["retrieve_source", "search_everything"]
            || now == ["search_everything", "retrieve_source"]
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the approved staged manifest never served: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = call(&client, "search_everything", json!({"query": "wal"}))
        .await
        .unwrap();
    assert_ne!(r.is_error, Some(true), "{}", text_of(&r));
    client.cancel().await.ok();
}
