//! Adapters built against different `airlock:host` versions in one host: `source-library`
//! imports only `airlock:host@0.1.0`, `outbox-delivery` imports `airlock:host/context@0.2.0`.
//! Real `airlock serve`, real components, the real delivery fixture and its call log.

use airlock::store::{Intents as _, SqliteStore};
use serde_json::{Value, json};

use crate::common::*;

async fn ok_call<H: rmcp::ClientHandler>(
    client: &rmcp::service::RunningService<rmcp::service::RoleClient, H>,
    name: &str,
    args: Value,
) -> Value {
    let r = call(client, name, args).await.unwrap();
    assert_ne!(r.is_error, Some(true), "{name}: {}", text_of(&r));
    r.structured_content.unwrap()["result"].clone()
}

#[tokio::test]
async fn a_0_1_0_and_a_0_2_0_adapter_serve_side_by_side_and_the_key_comes_from_context() {
    let d = approvals_deployment();
    d.approve_all();
    let config = d.write_config();
    let config = config.to_str().unwrap();
    for (mapping, version) in [("source-library", "0.1.0"), ("outbox-delivery", "0.2.0")] {
        let shown = d.airlock_json(&["review", "show", mapping, "--config", config]);
        assert_eq!(shown["host_version"], version, "{mapping}: {shown:#}");
    }
    let unknown = d.airlock_json(&["review", "show", "outbox-delivery"]);
    assert!(unknown["host_version"].is_null());
    assert!(
        unknown["host_version_source"]
            .as_str()
            .unwrap()
            .contains("--config")
    );

    let client = d.serve_profile("publisher", ()).await;
    // The 0.1.0 adapter serves.
    let hits = ok_call(&client, "search_sources", json!({"query": "checkpoint"})).await;
    assert!(!hits.as_array().unwrap().is_empty(), "{hits}");
    // The 0.2.0 adapter serves, and delivers once a person approved.
    let artifact = ok_call(
        &client,
        "prepare_artifact",
        json!({"title": "Q3 report", "media-type": "text/markdown", "content": "# Q3\n"}),
    )
    .await;
    let destinations = ok_call(&client, "list_destinations", json!({})).await;
    let team = destinations
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["label"] == "Team reports outbox")
        .unwrap_or_else(|| panic!("{destinations}"))["destination"]
        .clone();
    let args = json!({"artifact": artifact["artifact"], "destination": team});
    let asked = call(&client, "deliver_artifact", args.clone())
        .await
        .unwrap();
    let text = text_of(&asked);
    let at = text.find("apr_").unwrap_or_else(|| panic!("{text}"));
    d.airlock_ok(&["approvals", "approve", &text[at..at + 28], "--yes"]);
    let done = ok_call(&client, "deliver_artifact", args).await;
    assert_eq!(done["replayed"], false);
    client.cancel().await.unwrap();

    // The key the delivery server received is the intent's, from the store.
    let sent: Vec<Value> = d
        .outbox_calls()
        .into_iter()
        .filter(|c| c["tool"] == "send_file")
        .collect();
    assert_eq!(sent.len(), 1, "{sent:?}");
    let key = sent[0]["arguments"]["idempotency_key"].as_str().unwrap();
    let trace = d.trace();
    let intent = trace
        .iter()
        .find(|e| e["kind"] == "receipt-consumed")
        .expect("receipt-consumed")["payload"]["intent"]
        .as_str()
        .unwrap()
        .to_string();
    let store = SqliteStore::open(&d.state_dir()).unwrap();
    let record = store.intent(&intent).unwrap().expect("the intent row");
    assert_eq!(key, record.intent.idempotency_key);
    assert!(key.starts_with("idk_") && key.len() == 36, "{key}");
}

/// An adapter built against `airlock:host@0.3.0` reads its mapping's operator settings:
/// what the reviewed manifest's `[settings]` says reaches the component, the reviewer sees
/// it, a changed setting is a new revision that serves nothing until it is reviewed, and
/// the model's arguments are only ever arguments.
#[tokio::test]
async fn a_0_3_0_adapter_reads_the_reviewed_settings_and_a_changed_setting_needs_review() {
    let d = Deployment::with_notes().mapping("settings-echo");
    d.approve_all();
    let config = d.write_config();
    let config = config.to_str().unwrap();
    let shown = d.airlock_json(&["review", "show", "settings-echo", "--config", config]);
    assert_eq!(shown["host_version"], "0.3.0", "{shown:#}");
    assert_eq!(
        shown["settings"],
        json!({"follow-links": false, "max-results": 20, "repository": "/srv/repositories/project"})
    );
    let text = d.airlock_ok(&["review", "show", "settings-echo", "--config", config]);
    assert!(
        text.contains("setting max-results = 20")
            && text.contains("repository = \"/srv/repositories/project\""),
        "{text}"
    );

    // A recorded manifest that no longer parses (edited in the store) is said, not shown as
    // "no settings"; its hostile text reaches the terminal escaped.
    let db = d.database();
    let kept: String = db
        .query_row(
            "SELECT manifest_text FROM mappings WHERE name = 'settings-echo'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    db.execute(
        "UPDATE mappings SET manifest_text = ?1 WHERE name = 'settings-echo'",
        ["[mapping\u{1b}[2J"],
    )
    .unwrap();
    let text = d.airlock_ok(&["review", "show", "settings-echo", "--config", config]);
    assert!(
        text.contains("recorded manifest does not parse (") && !text.contains('\u{1b}'),
        "{text}"
    );
    let shown = d.airlock_json(&["review", "show", "settings-echo", "--config", config]);
    assert!(shown["manifest_problem"].is_string(), "{shown:#}");
    db.execute(
        "UPDATE mappings SET manifest_text = ?1 WHERE name = 'settings-echo'",
        [&kept],
    )
    .unwrap();
    drop(db);

    let client = d.serve_unreviewed().await;
    let hits = ok_call(&client, "echo_settings", json!({"query": ""})).await;
    let titles: Vec<&str> = hits
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["title"].as_str().unwrap())
        .collect();
    assert_eq!(
        titles,
        [
            "follow-links = false",
            "max-results = 20",
            "repository = \"/srv/repositories/project\""
        ]
    );
    // The model can only search and retrieve: a value it sends is an argument, never a
    // setting, and the adapter still answers the reviewed value.
    let r = call(
        &client,
        "echo_settings",
        json!({"query": "repository", "repository": "/etc"}),
    )
    .await
    .unwrap();
    assert_eq!(
        r.is_error,
        Some(true),
        "unknown arguments are refused: {}",
        text_of(&r)
    );
    let one = ok_call(&client, "echo_settings", json!({"query": "repository"})).await;
    let reference = one[0]["reference"].as_str().unwrap().to_string();
    let passage = ok_call(&client, "echo_setting", json!({"reference": reference})).await;
    assert_eq!(passage["text"], "/srv/repositories/project");
    client.cancel().await.unwrap();

    // Moving the repository changes the manifest, not the component: a new revision that
    // serves nothing until a reviewer approves it, and the diff names the setting.
    let manifest = d.mapping_dir("settings-echo").join("mapping.toml");
    let text = std::fs::read_to_string(&manifest).unwrap();
    std::fs::write(
        &manifest,
        text.replace("/srv/repositories/project", "/srv/moved/project"),
    )
    .unwrap();
    let client = d.serve_unreviewed().await;
    let offered = client.peer().list_all_tools().await.unwrap();
    assert!(
        offered.is_empty(),
        "a changed setting is an unreviewed revision: {offered:?}"
    );
    client.cancel().await.unwrap();
    let out = d.airlock(&[
        "grants",
        manifest.to_str().unwrap(),
        "--config",
        config,
        "--diff",
        "1",
    ]);
    let diff = String::from_utf8_lossy(&out.stdout);
    assert!(
        diff.contains(
            "settings.repository: \"/srv/repositories/project\" -> \"/srv/moved/project\""
        ),
        "{diff}"
    );
    d.approve_all();
    let client = d.serve_unreviewed().await;
    let one = ok_call(&client, "echo_settings", json!({"query": "repository"})).await;
    assert_eq!(one[0]["title"], "repository = \"/srv/moved/project\"");
    client.cancel().await.unwrap();
}
