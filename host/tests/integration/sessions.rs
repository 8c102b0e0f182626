//! Sessions sharing one host: a reference is bound to the session that received it.

use std::sync::Arc;

use crate::common::assert_refused;
use airlock::host::Host;
use airlock::pipeline::Category;
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
        .connection()
        .requests_sent();

    // A tool result the model reads (SEP-1303), not a protocol error.
    let refused = mallory
        .call("retrieve_source", args(json!({"reference": token})))
        .await
        .unwrap();
    let text = assert_refused(&refused, Category::InvalidRequest);
    assert!(text.contains("not valid in this session"), "{text}");
    assert_eq!(
        host.catalog().mappings["source-library"]
            .connection
            .connection()
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
            .connection()
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
        .connection()
        .requests_sent();
    let refused = s
        .call("retrieve_source", args(json!({"reference": token})))
        .await
        .unwrap();
    let text = assert_refused(&refused, Category::InvalidRequest);
    assert!(text.contains("issued before"), "{text}");
    assert_eq!(
        host.catalog().mappings["source-library"]
            .connection
            .connection()
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

/// The load that broke the shared reference table (every retrieval minted anew, and a full
/// table evicted other sessions' live references): one session, then eight at once, every
/// search's references used right away and the first ones again later; nothing fails.
/// (The bench runs the same loop for 200 000 calls: `cargo bench -p airlock --bench pipeline`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_calls_in_one_session_and_across_eight_never_fail() {
    let (host, _state) = host().await;
    for sessions in [1usize, 8] {
        let mut tasks = Vec::new();
        for _ in 0..sessions {
            let front = host.front(None).unwrap();
            tasks.push(tokio::spawn(async move {
                let mut first: Option<String> = None;
                let mut failed: Vec<String> = Vec::new();
                for i in 0..600 / sessions {
                    let hits = front
                        .call(
                            "search_sources",
                            args(json!({"query": "checkpoint", "limit": 3})),
                        )
                        .await
                        .unwrap();
                    let refs: Vec<String> = hits.structured_content.unwrap()["result"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|h| h["reference"].as_str().unwrap().to_string())
                        .collect();
                    let first = first.get_or_insert_with(|| refs[0].clone()).clone();
                    assert_eq!(refs[0], first, "the same source keeps its token");
                    let pick = if i % 2 == 0 {
                        &refs[i % refs.len()]
                    } else {
                        &first
                    };
                    let r = front
                        .call("retrieve_source", args(json!({"reference": pick})))
                        .await
                        .unwrap();
                    if r.is_error == Some(true) {
                        failed.push(format!("call {i}: {:?}", r.content));
                    }
                }
                (failed, front.session().references().len())
            }));
        }
        for t in tasks {
            let (failed, held) = t.await.unwrap();
            assert!(
                failed.is_empty(),
                "{sessions} session(s): {} retrievals failed, the first: {:?}",
                failed.len(),
                failed.first()
            );
            assert!(held <= 3, "one token per source, not per hit: {held}");
        }
    }
}

/// Nothing is acknowledged that is not durably recorded, and nothing recorded is lost: a
/// call's events are durable in the trace journal before it answers; once the database
/// refuses to take them (what a full disk does to every trace write), the journal cannot
/// be moved, and every call after that is refused ("could not record this call") instead
/// of piling up records no reader would see. When the database takes writes again, what
/// was acknowledged is all there, and calls are answered again.
#[tokio::test]
async fn a_call_whose_trace_cannot_be_committed_reports_no_result() {
    let (host, state) = host().await;
    let store = host.registry().store();
    let front = host.front(None).unwrap();
    let ok = front
        .call("search_sources", args(json!({"query": "checkpoint"})))
        .await
        .unwrap();
    assert_ne!(ok.is_error, Some(true));
    store.move_journals().unwrap();
    let raw = rusqlite::Connection::open(state.path().join("airlock.db")).unwrap();
    let outcomes = |raw: &rusqlite::Connection| -> i64 {
        raw.query_row(
            "SELECT count(*) FROM trace_events WHERE kind = 'call-outcome'",
            [],
            |r| r.get(0),
        )
        .unwrap()
    };
    assert_eq!(outcomes(&raw), 1);
    raw.execute_batch(
        "CREATE TRIGGER full_disk BEFORE INSERT ON trace_events
         BEGIN SELECT RAISE(ABORT, 'disk full'); END;",
    )
    .unwrap();
    // This call's record is durable in the journal (it may be answered); moving it fails.
    let written = front
        .call("search_sources", args(json!({"query": "keepalive"})))
        .await
        .unwrap();
    let acknowledged = written.is_error != Some(true);
    let err = store.move_journals().unwrap_err();
    assert!(format!("{err:#}").contains("disk full"), "{err:#}");
    // From now on nothing is acknowledged.
    let r = front
        .call("search_sources", args(json!({"query": "checkpoint"})))
        .await
        .unwrap();
    let text = assert_refused(&r, Category::Unknown);
    assert!(text.contains("could not record this call"), "{text}");
    assert!(r.structured_content.is_none(), "no result leaks: {r:?}");
    // The disk has room again: the acknowledged call is in the trace, the refused one is
    // not, and calls are answered again.
    raw.execute_batch("DROP TRIGGER full_disk").unwrap();
    store.move_journals().unwrap();
    assert_eq!(outcomes(&raw), 1 + i64::from(acknowledged));
    let again = front
        .call("search_sources", args(json!({"query": "checkpoint"})))
        .await
        .unwrap();
    assert_ne!(again.is_error, Some(true), "{again:?}");
    assert!(store.verify_trace().unwrap().first_bad.is_none());
}
