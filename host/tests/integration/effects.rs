//! Effects that happen exactly once, on real processes: `airlock serve` with the delivery
//! fixture (which can lose its answer after delivering), the real outbox-delivery
//! component, a real SQLite store, and rmcp's client approving in band.
//!
//! Every "delivered once" is read from the delivery server's own outbox folder and call
//! log, never from the host's word.

use rmcp::model::ElicitationAction;
use serde_json::Value;

use crate::approvals::{Person, deliver_args, prepared};
use crate::common::*;
use airlock::pipeline::Category;

fn deployment(server_args: &[&str]) -> Deployment {
    edited(server_args, |m| m)
}

/// The deployment with the delivery's deadline at the ceiling (60 s): for the tests that
/// stop a call in flight themselves (a cancel, a kill) and must not race the adapter's
/// own 5 s deadline on a loaded machine, where reaching the withheld answer alone can
/// take seconds. What they assert is what the stop did, not how soon it came.
fn patient(server_args: &[&str]) -> Deployment {
    edited(server_args, |m| {
        assert!(
            m.contains("deadline_ms = 5000"),
            "the delivery's deadline moved"
        );
        m.replace("deadline_ms = 5000", "deadline_ms = 60000")
    })
}

/// The deployment with the outbox-delivery manifest passed through `edit`.
pub(crate) fn edited(server_args: &[&str], edit: impl FnOnce(String) -> String) -> Deployment {
    Deployment::with_notes()
        .mapping("source-library")
        .with_outbox_edited(server_args, edit)
        .policy(POLICY)
        .tables(PROFILES)
}

/// A manifest edit: the delivery capability confirms its effect with `flags` after it.
pub(crate) fn narrowed(flags: &'static str) -> impl FnOnce(String) -> String {
    move |m| {
        m.replace(
            r#"effect = "external-effect""#,
            &format!("effect = \"external-effect\"\n{flags}"),
        )
    }
}

/// The delivery server's `send_file` and `lookup_delivery` requests, with their keys.
fn keyed(d: &Deployment, tool: &str) -> Vec<String> {
    d.outbox_calls()
        .iter()
        .filter(|c| c["method"] == "tools/call" && c["tool"] == tool)
        .map(|c| {
            c["arguments"]["idempotency_key"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect()
}

/// Serves `d` (every mapping approved) to a client that approves in band, prepares an
/// artifact and delivers it to the team reports outbox; returns the client and the answer.
pub(crate) async fn deliver(
    d: &Deployment,
) -> (
    rmcp::service::RunningService<rmcp::service::RoleClient, Person>,
    rmcp::model::CallToolResult,
) {
    d.approve_all();
    let client = d
        .serve_profile("publisher", Person::new(ElicitationAction::Accept))
        .await;
    let (artifact, team) = prepared(&client, "team-reports").await;
    let r = call(&client, "deliver_artifact", deliver_args(&artifact, &team))
        .await
        .unwrap();
    (client, r)
}

fn intents(d: &Deployment, state: &str) -> Vec<Value> {
    d.airlock_json(&["intents", "list", "--state", state])
        .as_array()
        .unwrap()
        .clone()
}

fn show(d: &Deployment, id: &str) -> Value {
    d.airlock_json(&["intents", "show", id])
}

/// `intents resolve ID --as STATE` is refused because the row does not match the trace.
fn resolve_is_refused_as_tampered(d: &Deployment, id: &str, state: &str) {
    let refused = d.airlock(&[
        "intents",
        "resolve",
        id,
        "--as",
        state,
        "--evidence",
        "what I saw upstream",
    ]);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("does not match the trace"), "{stderr}");
}

/// A new host's first call of the outbox mapping (`list_destinations`, a read): the
/// mapping's open intents are reconciled before it runs.
async fn first_call_on_a_new_host(d: &Deployment) {
    let client = d
        .serve_profile("publisher", Person::new(ElicitationAction::Accept))
        .await;
    let r = call(&client, "list_destinations", serde_json::json!({}))
        .await
        .unwrap();
    assert_ne!(r.is_error, Some(true), "{}", text_of(&r));
    client.cancel().await.unwrap();
}

/// A new host's first call traces `intent-tampered` for `id` as its `nth` such event,
/// saying `why`, and the upstream is asked no more queries than the `asked` before.
async fn traced_tampered_on_a_new_host(
    d: &Deployment,
    id: &str,
    nth: usize,
    why: &str,
    asked: usize,
) {
    first_call_on_a_new_host(d).await;
    let tampered = tampered_events(d);
    assert_eq!(tampered.len(), nth, "{tampered:#?}");
    assert_eq!(tampered[nth - 1]["payload"]["intent"], id);
    assert!(
        tampered[nth - 1]["payload"]["why"]
            .as_str()
            .is_some_and(|w| w.contains(why)),
        "{tampered:#?}"
    );
    assert_eq!(
        keyed(d, "lookup_delivery").len(),
        asked,
        "the upstream was asked about an intent edited in the store"
    );
}

/// The trace's `intent-tampered` events.
fn tampered_events(d: &Deployment) -> Vec<Value> {
    d.trace()
        .into_iter()
        .filter(|e| e["kind"] == "intent-tampered")
        .collect()
}

#[tokio::test]
async fn a_delivery_whose_answer_is_lost_is_reconciled_by_query_not_repeated() {
    let d = deployment(&["--fail-after-send"]);
    let (client, r) = deliver(&d).await;
    let text = text_of(&r);
    assert_ne!(r.is_error, Some(true), "{text}");
    assert!(text.starts_with("Reconciled (intent int_"), "{text}");
    let structured = r.structured_content.clone().unwrap();
    assert_eq!(structured["reconciled"]["method"], "query");
    // The query reports the delivery made earlier: nothing new was delivered.
    assert_eq!(structured["result"]["replayed"], true);
    client.cancel().await.unwrap();

    // Exactly one delivery, one send, and the query used the send's key.
    assert_eq!(d.delivered("team-reports").len(), 1);
    let sends = keyed(&d, "send_file");
    assert_eq!(sends.len(), 1, "never sent twice: {:?}", d.outbox_calls());
    assert_eq!(keyed(&d, "lookup_delivery"), sends);

    // The intent went unknown (durably), then completed by query, with evidence.
    let done = intents(&d, "completed");
    let intent = done
        .iter()
        .find(|i| i["capability"] == "deliver_artifact")
        .expect("the delivery's intent is completed");
    assert_eq!(intent["resolution"]["method"], "query");
    assert_eq!(intent["resolution"]["by"], "airlock");
    assert_eq!(intent["idempotency_key"].as_str().unwrap(), sends[0]);
    let shown = show(&d, intent["id"].as_str().unwrap());
    let attempts = shown["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0]["state"], "sent", "its answer never came");
    assert_eq!(attempts[0]["requests"], 1);
    assert_eq!(attempts[0]["answered"], 0);
    let kinds: Vec<String> = d
        .trace()
        .iter()
        .map(|e| e["kind"].as_str().unwrap().to_string())
        .collect();
    let unknown = d
        .trace()
        .iter()
        .position(|e| e["kind"] == "call-outcome" && e["payload"]["outcome"] == "unknown")
        .unwrap_or_else(|| panic!("no unknown outcome traced: {kinds:?}"));
    let resolved = kinds
        .iter()
        .position(|k| k == "intent-resolved")
        .expect("the resolution is traced");
    assert!(
        unknown < resolved,
        "unknown first, then resolved: {kinds:?}"
    );
}

#[tokio::test]
async fn without_a_query_an_unknown_delivery_is_held_for_a_person_and_never_retried() {
    // The reviewed mapping says this upstream can be neither asked nor safely repeated.
    let d = edited(
        &["--fail-after-send"],
        narrowed("idempotent = false\nqueryable = false"),
    );
    let (client, r) = deliver(&d).await;
    let text = text_of(&r);
    assert_refused(&r, Category::Unknown);
    assert!(text.contains("held for an operator"), "{text}");
    assert!(text.contains("Do not call it again"), "{text}");
    client.cancel().await.unwrap();
    assert_eq!(keyed(&d, "send_file").len(), 1, "no retry");
    assert!(keyed(&d, "lookup_delivery").is_empty(), "nothing to ask");
    assert_eq!(d.delivered("team-reports").len(), 1);

    let held = intents(&d, "unknown");
    assert_eq!(held.len(), 1, "{held:#?}");
    let id = held[0]["id"].as_str().unwrap().to_string();
    let text = d.airlock_ok(&["intents", "show", &id]);
    assert!(text.contains("airlock intents resolve"), "{text}");

    // A person resolves it, with evidence; the resolution is recorded and traced.
    let out = d.airlock(&["intents", "resolve", &id, "--as", "completed"]);
    assert!(!out.status.success(), "evidence is required");
    let blank = d.airlock(&[
        "intents",
        "resolve",
        &id,
        "--as",
        "completed",
        "--evidence",
        " \t ",
    ]);
    assert!(!blank.status.success(), "blank evidence is no evidence");
    let stderr = String::from_utf8_lossy(&blank.stderr);
    assert!(stderr.contains("evidence is required"), "{stderr}");
    assert_eq!(intents(&d, "unknown").len(), 1, "still held");
    let resolved = d.airlock_json(&[
        "intents",
        "resolve",
        &id,
        "--as",
        "completed",
        "--evidence",
        "the team-reports outbox holds the Q3 report",
        "--by",
        "bob",
    ]);
    assert_eq!(resolved["intent"]["state"], "completed");
    assert_eq!(resolved["intent"]["resolution"]["method"], "person");
    assert_eq!(resolved["intent"]["resolution"]["by"], "bob");
    assert_eq!(
        show(&d, &id)["tampered"],
        Value::Null,
        "the resolution's event proves the row's new state"
    );
    let again = d.airlock(&[
        "intents",
        "resolve",
        &id,
        "--as",
        "failed",
        "--evidence",
        "changed my mind",
    ]);
    assert!(!again.status.success());
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(stderr.contains("is completed"), "{stderr}");
    let event = d
        .trace()
        .into_iter()
        .find(|e| e["kind"] == "intent-resolved")
        .expect("traced");
    assert_eq!(event["payload"]["by"], "bob");
    assert_eq!(event["payload"]["intent"], id.as_str());
}

/// The pids of `airlock serve` processes running this deployment's configuration.
fn serve_pids(d: &Deployment) -> Vec<i32> {
    let config = d.write_config().display().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                let args: Vec<&[u8]> = c.split(|b| *b == 0).collect();
                args.contains(&b"serve".as_slice()) && args.contains(&config.as_bytes())
            })
        })
        .collect()
}

#[tokio::test]
async fn a_host_killed_mid_delivery_reconciles_before_the_next_call_and_delivers_once() {
    let d = patient(&["--hang-after-send"]);
    d.approve_all();
    let client = d
        .serve_profile("publisher", Person::new(ElicitationAction::Accept))
        .await;
    let (artifact, team) = prepared(&client, "team-reports").await;
    let peer = client.peer().clone();
    let mut params = rmcp::model::CallToolRequestParams::new("deliver_artifact");
    params.arguments = deliver_args(&artifact, &team).as_object().cloned();
    let in_flight = tokio::spawn(async move { peer.call_tool(params).await });
    // Wait until the delivery is on the server's disk, with its answer withheld: the file
    // and then its ledger line (a file without one is no delivery to the fixture).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let ledger = d.dir.path().join("outbox").join(".deliveries.jsonl");
    let recorded = || {
        std::fs::read_to_string(&ledger)
            .is_ok_and(|t| t.lines().any(|l| l.contains("team-reports")))
    };
    while d.delivered("team-reports").is_empty() || !recorded() {
        assert!(
            std::time::Instant::now() < deadline,
            "the delivery never happened"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let pids = serve_pids(&d);
    assert_eq!(pids.len(), 1, "one airlock serve: {pids:?}");
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &pids[0].to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    assert!(in_flight.await.unwrap().is_err(), "the call got no answer");
    drop(client);
    let prepared_before = intents(&d, "prepared");
    assert!(
        prepared_before
            .iter()
            .any(|i| i["capability"] == "deliver_artifact"),
        "the stopped host left the delivery prepared: {prepared_before:#?}"
    );

    // A new host: the first call of the mapping waits for the reconciliation.
    first_call_on_a_new_host(&d).await;
    let done = intents(&d, "completed");
    let intent = done
        .iter()
        .find(|i| i["capability"] == "deliver_artifact")
        .unwrap_or_else(|| {
            panic!(
                "reconciled before the next call: {:#?}",
                d.airlock_json(&["intents", "list"])
            )
        });
    assert_eq!(intent["resolution"]["method"], "query");
    assert_eq!(d.delivered("team-reports").len(), 1, "delivered once");
    assert_eq!(keyed(&d, "send_file").len(), 1, "sent once");
    assert_eq!(keyed(&d, "lookup_delivery").len(), 1, "asked once");
    // The resolution comes before the next call's outcome in the trace.
    let trace = d.trace();
    let resolved = trace
        .iter()
        .position(|e| e["kind"] == "intent-resolved")
        .expect("resolved");
    let last_outcome = trace
        .iter()
        .rposition(|e| e["kind"] == "call-outcome")
        .unwrap();
    assert!(resolved < last_outcome);
}

/// The delivery server's `notifications/cancelled` lines.
fn cancellations(d: &Deployment) -> Vec<Value> {
    d.outbox_calls()
        .into_iter()
        .filter(|c| c["method"] == "notifications/cancelled")
        .collect()
}

async fn wait_for_delivery(d: &Deployment) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while d.delivered("team-reports").is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the delivery never happened"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

async fn wait_for_intent(d: &Deployment, state: &str) -> Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        if let Some(i) = intents(d, state)
            .into_iter()
            .find(|i| i["capability"] == "deliver_artifact")
        {
            return i;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no {state} delivery intent: {:#?}",
            d.airlock_json(&["intents", "list"])
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_delivery_that_times_out_cancels_the_upstream_request_and_is_reconciled() {
    let d = edited(&["--hang-after-send"], |m| {
        m.replace("deadline_ms = 5000", "deadline_ms = 1500")
    });
    let (client, r) = deliver(&d).await;
    let text = text_of(&r);
    // The answer never came; the query found the delivery.
    assert_ne!(r.is_error, Some(true), "{text}");
    assert!(text.starts_with("Reconciled"), "{text}");
    client.cancel().await.unwrap();
    let cancelled = cancellations(&d);
    assert_eq!(
        cancelled.len(),
        1,
        "the timeout reached the upstream: {:?}",
        d.outbox_calls()
    );
    assert_eq!(keyed(&d, "send_file").len(), 1);
    assert_eq!(d.delivered("team-reports").len(), 1);
    let intent = wait_for_intent(&d, "completed").await;
    assert_eq!(intent["resolution"]["method"], "query");
}

#[tokio::test]
async fn a_model_cancelled_delivery_cancels_upstream_is_unknown_then_reconciled() {
    use rmcp::model::{CallToolRequest, CallToolRequestParams, ClientRequest};
    use rmcp::service::PeerRequestOptions;
    let d = patient(&["--hang-after-send"]);
    d.approve_all();
    let client = d
        .serve_profile("publisher", Person::new(ElicitationAction::Accept))
        .await;
    let (artifact, team) = prepared(&client, "team-reports").await;
    let mut params = CallToolRequestParams::new("deliver_artifact");
    params.arguments = deliver_args(&artifact, &team).as_object().cloned();
    let handle = client
        .peer()
        .send_request_with_option(
            ClientRequest::CallToolRequest(CallToolRequest::new(params)),
            PeerRequestOptions::no_options(),
        )
        .await
        .unwrap();
    wait_for_delivery(&d).await;
    assert!(cancellations(&d).is_empty(), "nothing cancelled yet");
    handle
        .cancel(Some("the person stopped it".into()))
        .await
        .unwrap();
    // The host cancels its upstream request, records unknown, and reconciles.
    let intent = wait_for_intent(&d, "completed").await;
    assert_eq!(intent["resolution"]["method"], "query");
    assert_eq!(cancellations(&d).len(), 1, "{:?}", d.outbox_calls());
    let kinds: Vec<Value> = d
        .trace()
        .into_iter()
        .filter(|e| e["kind"] == "call-outcome" && e["payload"]["outcome"] == "unknown")
        .collect();
    assert_eq!(
        kinds.len(),
        1,
        "a cancelled effect is unknown, never failed"
    );
    // The model's cancel stopped the call (not the adapter's deadline, which would also
    // cancel the upstream request).
    let contained: Vec<Value> = d
        .trace()
        .into_iter()
        .filter(|e| e["kind"] == "call-contained")
        .collect();
    assert!(
        contained
            .iter()
            .any(|e| e["payload"]["failure"] == "cancelled"),
        "the model's cancel reached the call: {contained:?}"
    );
    client.cancel().await.unwrap();
    assert_eq!(keyed(&d, "send_file").len(), 1, "never sent again");
    assert_eq!(d.delivered("team-reports").len(), 1);
}

#[tokio::test]
async fn an_idempotent_delivery_that_cannot_be_queried_is_retried_with_the_same_key() {
    // Queryable narrowed away; idempotent (the contract's) kept.
    let d = edited(&["--fail-after-send"], narrowed("queryable = false"));
    let (client, r) = deliver(&d).await;
    let text = text_of(&r);
    assert_ne!(r.is_error, Some(true), "{text}");
    let structured = r.structured_content.clone().unwrap();
    assert_eq!(structured["reconciled"]["method"], "retry", "{text}");
    assert_eq!(
        structured["result"]["replayed"], true,
        "the server replayed"
    );
    client.cancel().await.unwrap();
    // Two sends, one key, one delivery; nothing asked.
    let sends = keyed(&d, "send_file");
    assert_eq!(sends.len(), 2, "{:?}", d.outbox_calls());
    assert_eq!(sends[0], sends[1], "the retry reuses the key");
    assert!(keyed(&d, "lookup_delivery").is_empty());
    assert_eq!(d.delivered("team-reports").len(), 1);
    let intent = wait_for_intent(&d, "completed").await;
    assert_eq!(intent["resolution"]["method"], "retry");
    assert_eq!(intent["idempotency_key"].as_str().unwrap(), sends[0]);
    let shown = show(&d, intent["id"].as_str().unwrap());
    let attempts = shown["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{attempts:#?}");
    assert_eq!(attempts[0]["state"], "sent");
    assert_eq!(attempts[1]["answered"], 1);
}

#[tokio::test]
async fn an_unanswered_send_the_query_cannot_find_is_held_while_its_request_may_still_run() {
    // The server holds the send without delivering and never answers; it stays up, so
    // the request may still be processed: "not found" proves nothing yet.
    let d = edited(&["--hang-before-send"], |m| {
        m.replace("deadline_ms = 5000", "deadline_ms = 1500")
    });
    let (client, r) = deliver(&d).await;
    let text = text_of(&r);
    assert_refused(&r, Category::Unknown);
    assert!(text.contains("may still be processed"), "{text}");
    client.cancel().await.unwrap();
    assert_eq!(keyed(&d, "send_file").len(), 1, "never re-sent");
    assert!(
        !keyed(&d, "lookup_delivery").is_empty(),
        "the query was asked"
    );
    assert!(d.delivered("team-reports").is_empty());
    let held = intents(&d, "unknown");
    assert_eq!(
        held.len(),
        1,
        "held, not failed: {:#?}",
        d.airlock_json(&["intents", "list"])
    );
    assert!(intents(&d, "failed").is_empty());
}

/// An intent row written into the store by hand — a copy of a genuine delivery under a
/// new id, set to `unknown`, or the genuine one with its arguments edited — is proven by
/// nothing in the MACed trace: the next host does not query the upstream about it
/// (`intent-tampered` is traced instead), `intents show` says TAMPERED, and a person
/// cannot resolve it; the genuine intent is proven again once restored.
#[tokio::test]
async fn an_intent_written_into_the_store_is_neither_reconciled_nor_resolvable() {
    // Queryable: an unknown intent of this mapping is reconciled by asking the upstream.
    let d = deployment(&["--fail-after-send"]);
    let (client, r) = deliver(&d).await;
    assert!(
        text_of(&r).starts_with("Reconciled (intent int_"),
        "{}",
        text_of(&r)
    );
    client.cancel().await.unwrap();
    let done = intents(&d, "completed");
    let genuine = done
        .iter()
        .find(|i| i["capability"] == "deliver_artifact")
        .expect("the delivery's intent")
        .clone();
    let id = genuine["id"].as_str().unwrap().to_string();
    assert_eq!(
        show(&d, &id)["tampered"],
        Value::Null,
        "a genuine intent is proven"
    );
    assert_eq!(
        keyed(&d, "lookup_delivery").len(),
        1,
        "asked once, in the call"
    );

    let forged = "int_f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0";
    let db = rusqlite::Connection::open(d.state_dir().join("airlock.db")).unwrap();
    db.execute_batch(&format!(
        "CREATE TEMP TABLE copy AS SELECT * FROM intents WHERE id = '{id}';
         UPDATE copy SET id = '{forged}', call_id = 'call_forged', approval_id = NULL,
             idempotency_key = 'idk_forged', state = 'unknown', resolution = NULL,
             resolved_ms = NULL;
         INSERT INTO intents SELECT * FROM copy;
         CREATE TEMP TABLE tries AS SELECT * FROM intent_attempts WHERE intent_id = '{id}';
         UPDATE tries SET intent_id = '{forged}';
         INSERT INTO intent_attempts SELECT * FROM tries;"
    ))
    .unwrap();
    let shown = show(&d, forged);
    assert!(
        shown["tampered"]
            .as_str()
            .is_some_and(|w| w.contains("no MACed intent-created event")),
        "{shown:#}"
    );
    assert!(
        d.airlock_ok(&["intents", "show", forged])
            .starts_with("TAMPERED: ")
    );
    resolve_is_refused_as_tampered(&d, forged, "failed");

    // A new host: the mapping's first call reconciles the open intents first; the forged
    // one is not acted on, so the upstream is asked nothing about it.
    first_call_on_a_new_host(&d).await;
    assert_eq!(
        keyed(&d, "lookup_delivery").len(),
        1,
        "the upstream was asked about a forged intent: {:?}",
        d.outbox_calls()
    );
    assert_eq!(
        intents(&d, "unknown").len(),
        1,
        "the forged row is left as it is"
    );
    let tampered = tampered_events(&d);
    assert_eq!(tampered.len(), 1, "{tampered:#?}");
    assert_eq!(tampered[0]["payload"]["intent"], forged);

    // The genuine intent with its arguments edited is not proven either; restored, it is.
    db.execute(
        "UPDATE intents SET args_digest = ?2 WHERE id = ?1",
        rusqlite::params![id, "0".repeat(64)],
    )
    .unwrap();
    let shown = show(&d, &id);
    assert!(
        shown["tampered"]
            .as_str()
            .is_some_and(|w| w.contains("arguments")),
        "{shown:#}"
    );
    db.execute(
        "UPDATE intents SET args_digest = ?2 WHERE id = ?1",
        rusqlite::params![id, genuine["args_digest"].as_str().unwrap()],
    )
    .unwrap();
    assert_eq!(show(&d, &id)["tampered"], Value::Null);
}

/// The state of an intent is proven by the trace too: an unknown delivery set to
/// `completed` by hand (so that no one reconciles it or sees it held) is shown TAMPERED,
/// cannot be resolved, and the next host's first call of the mapping traces
/// `intent-tampered` for it — found from the trace, since its row no longer says open —
/// without asking the upstream about it. Restored to `unknown`, it is proven again.
#[tokio::test]
async fn an_unknown_intent_closed_by_hand_in_the_store_is_found_from_the_trace() {
    let d = edited(&["--hang-before-send"], |m| {
        m.replace("deadline_ms = 5000", "deadline_ms = 1500")
    });
    let (client, r) = deliver(&d).await;
    assert!(text_of(&r).starts_with("unknown:"), "{}", text_of(&r));
    client.cancel().await.unwrap();
    let held = intents(&d, "unknown");
    assert_eq!(held.len(), 1, "{held:#?}");
    let id = held[0]["id"].as_str().unwrap().to_string();
    assert_eq!(
        show(&d, &id)["tampered"],
        Value::Null,
        "a genuine unknown intent is proven"
    );
    let asked = keyed(&d, "lookup_delivery").len();

    let db = rusqlite::Connection::open(d.state_dir().join("airlock.db")).unwrap();
    db.execute(
        "UPDATE intents SET state = 'completed' WHERE id = ?1",
        rusqlite::params![id],
    )
    .unwrap();
    assert!(
        intents(&d, "unknown").is_empty(),
        "nothing lists it as held any more"
    );
    let shown = show(&d, &id);
    assert!(
        shown["tampered"]
            .as_str()
            .is_some_and(|w| w.contains("the row says completed but the trace says unknown")),
        "{shown:#}"
    );
    let listed = d.airlock_ok(&["intents", "list"]);
    let line = listed.lines().find(|l| l.starts_with(&id)).unwrap();
    assert!(line.contains("TAMPERED"), "{listed}");
    assert_eq!(
        intents(&d, "completed")
            .iter()
            .find(|i| i["id"] == id.as_str())
            .map(|i| i["tampered"].is_string()),
        Some(true)
    );
    resolve_is_refused_as_tampered(&d, &id, "completed");

    traced_tampered_on_a_new_host(&d, &id, 1, "the trace says unknown", asked).await;

    db.execute(
        "UPDATE intents SET state = 'unknown' WHERE id = ?1",
        rusqlite::params![id],
    )
    .unwrap();
    assert_eq!(show(&d, &id)["tampered"], Value::Null);

    // Deleted by hand, attempts and all: found from the trace too.
    db.execute_batch(&format!(
        "DELETE FROM intent_attempts WHERE intent_id = '{id}'; DELETE FROM intents WHERE id = '{id}';"
    ))
    .unwrap();
    traced_tampered_on_a_new_host(&d, &id, 2, "the store has no row for it", asked).await;
}
