//! Sessions sharing one host: a reference is bound to the session that received it.

use std::sync::Arc;

use airlock::host::Host;
use airlock::registry::live::MappingSource;
use rmcp::model::JsonObject;
use serde_json::{Value, json};

fn args(v: Value) -> Option<JsonObject> {
    match v {
        Value::Object(o) => Some(o),
        _ => None,
    }
}

async fn host() -> (Arc<Host>, tempfile::TempDir) {
    let state = tempfile::tempdir().unwrap();
    let mut config = airlock::cli::demo::notes_config(env!("CARGO_BIN_EXE_airlock").into());
    config.state_dir = Some(state.path().to_path_buf());
    let manifest =
        std::path::Path::new(airlock::ADAPTER_BUNDLE).join("source-library/mapping.toml");
    let host = Host::start_with(&config, vec![MappingSource::from_file(&manifest).unwrap()])
        .await
        .unwrap();
    airlock::cli::demo::approve_all(&host, "tests")
        .await
        .unwrap();
    (host, state)
}

#[tokio::test]
async fn a_reference_from_another_session_fails_before_the_adapter_runs() {
    let (host, _state) = host().await;
    let (alice, mallory) = (host.front(None).unwrap(), host.front(None).unwrap());
    assert_ne!(alice.session().id(), mallory.session().id());
    let hits = alice
        .call("search_sources", args(json!({"query": "checkpoint"})))
        .await
        .unwrap();
    let token = hits.structured_content.unwrap()["result"][0]["reference"]
        .as_str()
        .unwrap()
        .to_string();
    let sent = host.catalog().mappings["source-library"]
        .connection
        .connection
        .requests_sent();

    let err = mallory
        .call("retrieve_source", args(json!({"reference": token})))
        .await
        .unwrap_err();
    assert_eq!(err.code.0, -32602);
    assert!(
        err.message.contains("not valid in this session"),
        "{}",
        err.message
    );
    assert_eq!(
        host.catalog().mappings["source-library"]
            .connection
            .connection
            .requests_sent(),
        sent,
        "no upstream request for a foreign reference"
    );

    let ok = alice
        .call("retrieve_source", args(json!({"reference": token})))
        .await
        .unwrap();
    assert_ne!(ok.is_error, Some(true));
    assert_eq!(
        host.catalog().mappings["source-library"]
            .connection
            .connection
            .requests_sent(),
        sent + 1
    );
}

#[tokio::test]
async fn a_reference_minted_before_a_retire_fails_after_the_re_approval() {
    let (host, _state) = host().await;
    let s = host.front(None).unwrap();
    let hits = s
        .call("search_sources", args(json!({"query": "checkpoint"})))
        .await
        .unwrap();
    let token = hits.structured_content.unwrap()["result"][0]["reference"]
        .as_str()
        .unwrap()
        .to_string();
    host.registry().retire("source-library", "tests").unwrap();
    host.sync_with_store().await.unwrap();
    airlock::cli::demo::approve_all(&host, "tests")
        .await
        .unwrap();
    let sent = host.catalog().mappings["source-library"]
        .connection
        .connection
        .requests_sent();
    let err = s
        .call("retrieve_source", args(json!({"reference": token})))
        .await
        .unwrap_err();
    assert_eq!(err.code.0, -32602);
    assert!(err.message.contains("issued before"), "{}", err.message);
    assert_eq!(
        host.catalog().mappings["source-library"]
            .connection
            .connection
            .requests_sent(),
        sent,
        "a stale reference reaches nothing upstream"
    );
    // A fresh search under the new revision works.
    let hits = s
        .call("search_sources", args(json!({"query": "checkpoint"})))
        .await
        .unwrap();
    assert_ne!(hits.is_error, Some(true));
}
