//! Policy-approved calls on real processes: `airlock serve` with the notes server and the
//! delivery fixture, real components, real SQLite, and real MCP clients (rmcp's, in the
//! 2025-11-25 and the 2026-07-28 generation).
//!
//! Every test that says "never reached" reads the delivery server's own call log.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::common::*;
use airlock::pipeline::Category;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, ClientCapabilities, ClientConfig, ElicitRequestParams,
    ElicitResult, ElicitationAction, Implementation, ProtocolVersion,
};
use rmcp::service::{RequestContext, RoleClient, RunningService};
use rmcp::{ClientHandler, ErrorData as McpError};
use serde_json::{Value, json};

const INVALID_PARAMS: i32 = -32602;

fn deployment() -> Deployment {
    Deployment::with_notes()
        .mapping("source-library")
        .with_outbox(&[])
        .policy(POLICY)
        .tables(PROFILES)
}

/// Every capability name any mapping of the deployment offers.
const ALL_CAPABILITIES: [&str; 5] = [
    "search_sources",
    "retrieve_source",
    "prepare_artifact",
    "list_destinations",
    "deliver_artifact",
];

async fn ok_call<H: ClientHandler>(
    client: &RunningService<RoleClient, H>,
    name: &str,
    args: Value,
) -> Value {
    let r = call(client, name, args).await.unwrap();
    assert_ne!(r.is_error, Some(true), "{name}: {}", text_of(&r));
    r.structured_content.unwrap()["result"].clone()
}

/// Prepares an artifact and finds the destination `dest`; returns their references.
pub(crate) async fn prepared<H: ClientHandler>(
    client: &RunningService<RoleClient, H>,
    dest: &str,
) -> (String, String) {
    let artifact = ok_call(
        client,
        "prepare_artifact",
        json!({"title": "Q3 report", "media-type": "text/markdown", "content": "# Q3\nAll good.\n"}),
    )
    .await;
    let destinations = ok_call(client, "list_destinations", json!({})).await;
    let label = format!("{} outbox", {
        let mut s = dest.replace('-', " ");
        s[..1].make_ascii_uppercase();
        s
    });
    let d = destinations
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["label"] == label.as_str())
        .unwrap_or_else(|| panic!("no destination {label} in {destinations}"));
    (
        artifact["artifact"].as_str().unwrap().to_string(),
        d["destination"].as_str().unwrap().to_string(),
    )
}

/// The approval id (`apr_…`) named in a text.
pub(crate) fn approval_in(text: &str) -> String {
    let at = text
        .find("apr_")
        .unwrap_or_else(|| panic!("no approval id in {text}"));
    text[at..at + 28].to_string()
}

pub(crate) fn deliver_args(artifact: &str, destination: &str) -> Value {
    json!({"artifact": artifact, "destination": destination})
}

#[tokio::test]
async fn a_profile_without_delivery_never_sees_or_reaches_it() {
    let d = deployment();
    d.approve_all();
    let client = d.serve_profile("reader", ()).await;
    let tools = client.peer().list_all_tools().await.unwrap();
    let names: Vec<_> = tools.iter().map(|t| t.name.to_string()).collect();
    assert_eq!(names, ["retrieve_source", "search_sources"]);
    for hidden in ["prepare_artifact", "list_destinations", "deliver_artifact"] {
        let err = call(&client, hidden, json!({})).await.unwrap_err();
        assert_eq!(error_code(&err), Some(INVALID_PARAMS), "{hidden}");
        let message = err.to_string();
        assert!(message.contains("unknown tool"), "{message}");
        for other in ALL_CAPABILITIES.iter().filter(|n| **n != hidden) {
            assert!(!message.contains(other), "{message} names {other}");
        }
    }
    client.cancel().await.unwrap();
    assert!(
        d.outbox_tool_calls().is_empty(),
        "nothing reached the delivery server: {:?}",
        d.outbox_calls()
    );
    // The offer was traced with its digest and exact list.
    let offered: Vec<Value> = d
        .trace()
        .into_iter()
        .filter(|e| e["kind"] == "catalog-offered")
        .collect();
    assert_eq!(offered.len(), 1, "{offered:#?}");
    assert_eq!(
        offered[0]["payload"]["capabilities"],
        json!(["retrieve_source", "search_sources"])
    );
    assert_eq!(offered[0]["payload"]["profile"], "reader");
    assert_eq!(offered[0]["payload"]["requester"], "alice");
}

#[tokio::test]
async fn a_policy_denial_never_reaches_the_server_and_names_nothing_hidden() {
    let d = deployment();
    d.approve_all();
    let client = d.serve_profile("publisher", ()).await;
    let (artifact, partner) = prepared(&client, "partner-drop").await;
    let r = call(
        &client,
        "deliver_artifact",
        deliver_args(&artifact, &partner),
    )
    .await
    .unwrap();
    let text = assert_refused(&r, Category::OutsideScope);
    for name in ALL_CAPABILITIES {
        assert!(!text.contains(name), "the denial names `{name}`: {text}");
    }
    for hidden in [
        "partner",
        "operator",
        "no-partner-drop",
        "alice",
        "send_file",
    ] {
        assert!(
            !text.contains(hidden),
            "the denial reveals `{hidden}`: {text}"
        );
    }
    assert_eq!(d.sends(), 0, "a denied call never reaches the server");
    assert!(d.delivered("partner-drop").is_empty());
    // The reader profile is denied the same capability outright, and a reader session
    // that somehow names it learns nothing.
    client.cancel().await.unwrap();
    let decided: Vec<Value> = d
        .trace()
        .into_iter()
        .filter(|e| e["kind"] == "call-decided" && e["payload"]["capability"] == "deliver_artifact")
        .collect();
    assert_eq!(decided.len(), 1);
    assert_eq!(decided[0]["payload"]["decision"]["verdict"], "deny");
    assert_eq!(
        decided[0]["payload"]["determining"],
        json!(["no-partner-drop"])
    );
    assert_eq!(
        decided[0]["payload"]["policy_digest"]
            .as_str()
            .unwrap()
            .len(),
        64
    );
}

#[tokio::test]
async fn require_approval_waits_for_a_person_then_runs_exactly_once() {
    let d = deployment();
    d.approve_all();
    let client = d.serve_profile("publisher", ()).await;
    let (artifact, team) = prepared(&client, "team-reports").await;

    let r = call(&client, "deliver_artifact", deliver_args(&artifact, &team))
        .await
        .unwrap();
    let text = assert_refused(&r, Category::ApprovalRequired);
    assert!(
        text.contains("Q3 report") && text.contains("team-reports"),
        "{text}"
    );
    assert!(text.contains("cannot be recalled"), "{text}");
    let id = approval_in(&text);
    assert_eq!(d.sends(), 0, "no upstream call before the approval");

    // Asking again before anyone approved names the same request.
    let again = call(&client, "deliver_artifact", deliver_args(&artifact, &team))
        .await
        .unwrap();
    assert_eq!(approval_in(&text_of(&again)), id);

    let shown = d.airlock_json(&["approvals", "show", &id]);
    assert_eq!(shown["state"], "pending");
    assert_eq!(shown["mode"], "out-of-band");
    assert_eq!(shown["requester"], "alice");
    assert_eq!(shown["capability"], "deliver_artifact");
    assert_eq!(shown["artifact_digest"].as_str().unwrap().len(), 64);
    assert!(
        !text.contains("airlock approvals"),
        "the model is not handed the approval command: {text}"
    );
    // Without a terminal to confirm on (no controlling tty: setsid), approving needs --yes.
    let out = std::process::Command::new("setsid")
        .arg("-w")
        .arg(airlock_bin())
        .args(["approvals", "approve", &id])
        .env("AIRLOCK_STATE_DIR", d.state_dir())
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no terminal"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        d.airlock_json(&["approvals", "show", &id])["state"],
        "pending"
    );
    let approved = d.airlock_json(&["approvals", "approve", &id, "--by", "bob", "--yes"]);
    assert_eq!(approved["state"], "approved");
    assert_eq!(approved["decided_by"], "bob");

    let done = call(&client, "deliver_artifact", deliver_args(&artifact, &team))
        .await
        .unwrap();
    assert_ne!(done.is_error, Some(true), "{}", text_of(&done));
    assert_eq!(
        done.structured_content.unwrap()["result"]["replayed"],
        false
    );
    assert_eq!(d.sends(), 1);
    assert_eq!(d.delivered("team-reports").len(), 1);

    // The receipt is spent: the same call asks anew and sends nothing.
    let third = call(&client, "deliver_artifact", deliver_args(&artifact, &team))
        .await
        .unwrap();
    let text = text_of(&third);
    assert!(text.starts_with("approval required:"), "{text}");
    assert_ne!(approval_in(&text), id, "a new request, not the used one");
    assert_eq!(d.sends(), 1);
    assert_eq!(d.delivered("team-reports").len(), 1);
    assert_eq!(
        d.airlock_json(&["approvals", "show", &id])["state"],
        "consumed"
    );
    client.cancel().await.unwrap();

    // The whole life of the approved call, in order and linked by its call id.
    let trace = d.trace();
    let consumed = trace
        .iter()
        .find(|e| e["kind"] == "receipt-consumed")
        .expect("receipt-consumed");
    let call_id = consumed["payload"]["call"].as_str().unwrap();
    let kinds: Vec<&str> = trace
        .iter()
        .filter(|e| e["payload"]["call"] == call_id)
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        [
            "call-candidate",
            "call-decided",
            "intent-created",
            "receipt-consumed",
            "upstream-request",
            "call-outcome"
        ]
    );
    let of = |kind: &str| {
        trace
            .iter()
            .find(|e| e["kind"] == kind && e["payload"]["call"] == call_id)
            .unwrap()
    };
    let intent = of("intent-created")["payload"]["intent"].as_str().unwrap();
    assert_eq!(of("receipt-consumed")["payload"]["intent"], intent);
    assert_eq!(of("receipt-consumed")["payload"]["approval"], id.as_str());
    assert_eq!(of("upstream-request")["payload"]["target"], "send_file");
    assert!(of("upstream-request")["payload"]["request_id"].is_string());
    assert_eq!(of("call-outcome")["payload"]["outcome"], "completed");
    // The approval that the receipt came from was requested by an earlier call and
    // decided by a person, both in the trace.
    let requested = trace
        .iter()
        .find(|e| e["kind"] == "approval-requested" && e["payload"]["approval"] == id.as_str())
        .expect("approval-requested");
    assert_ne!(requested["payload"]["call"], call_id);
    assert!(trace.iter().any(|e| e["kind"] == "approval-decided"
        && e["payload"]["approval"] == id.as_str()
        && e["payload"]["by"] == "bob"));
    // No payload leaks into the trace.
    let all = serde_json::to_string(&trace).unwrap();
    assert!(
        !all.contains("All good."),
        "the artifact content is not traced"
    );
    assert!(d.airlock_ok(&["trace", "verify"]).contains("intact"));
}

#[tokio::test]
async fn an_approval_for_one_destination_does_not_deliver_to_another() {
    let d = deployment();
    d.approve_all();
    let client = d.serve_profile("publisher", ()).await;
    let (artifact, team) = prepared(&client, "team-reports").await;
    let (_, archive) = prepared(&client, "archive").await;
    let r = call(&client, "deliver_artifact", deliver_args(&artifact, &team))
        .await
        .unwrap();
    let id = approval_in(&text_of(&r));
    d.airlock_ok(&["approvals", "approve", &id, "--yes"]);
    let other = call(
        &client,
        "deliver_artifact",
        deliver_args(&artifact, &archive),
    )
    .await
    .unwrap();
    let text = text_of(&other);
    assert!(text.starts_with("approval required:"), "{text}");
    assert_ne!(approval_in(&text), id);
    assert_eq!(d.sends(), 0, "the approval for X did not run Y");
    assert_eq!(
        d.airlock_json(&["approvals", "show", &id])["state"],
        "approved",
        "the receipt for X is still unused"
    );
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn thirty_two_concurrent_uses_of_one_receipt_deliver_once() {
    let d = deployment();
    d.approve_all();
    let client = Arc::new(d.serve_profile("publisher", ()).await);
    let (artifact, team) = prepared(&client, "team-reports").await;
    let r = call(&client, "deliver_artifact", deliver_args(&artifact, &team))
        .await
        .unwrap();
    let id = approval_in(&text_of(&r));
    d.airlock_ok(&["approvals", "approve", &id, "--yes"]);
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let (client, args) = (client.clone(), deliver_args(&artifact, &team));
        tasks.push(tokio::spawn(async move {
            call(&client, "deliver_artifact", args).await.unwrap()
        }));
    }
    let mut delivered = 0;
    for t in tasks {
        let r = t.await.unwrap();
        if r.is_error != Some(true) {
            delivered += 1;
        } else {
            let text = text_of(&r);
            assert!(
                text.starts_with("approval required:"),
                "a loser is told to ask anew: {text}"
            );
        }
    }
    assert_eq!(delivered, 1, "exactly one attempt consumed the receipt");
    assert_eq!(d.sends(), 1);
    assert_eq!(d.delivered("team-reports").len(), 1);
}

#[tokio::test]
async fn a_policy_change_between_approval_and_use_invalidates_the_receipt() {
    let d = deployment();
    d.approve_all();
    let client = d.serve_profile("publisher", ()).await;
    let (artifact, team) = prepared(&client, "team-reports").await;
    let r = call(&client, "deliver_artifact", deliver_args(&artifact, &team))
        .await
        .unwrap();
    let id = approval_in(&text_of(&r));
    d.airlock_ok(&["approvals", "approve", &id, "--yes"]);
    // A new policy version (same decisions, other text) is hot-reloaded.
    d.rewrite_policy(&format!("{POLICY}\n// revised by the security team\n"));
    wait_for_trace(&d, |e| {
        e["kind"] == "policy-loaded" && !e["payload"]["previous"].is_null()
    })
    .await;
    let r = call(&client, "deliver_artifact", deliver_args(&artifact, &team))
        .await
        .unwrap();
    let text = text_of(&r);
    assert!(text.starts_with("approval required:"), "{text}");
    assert_ne!(approval_in(&text), id);
    assert_eq!(d.sends(), 0);
    let refused = d
        .trace()
        .into_iter()
        .find(|e| e["kind"] == "receipt-refused" && e["payload"]["approval"] == id.as_str())
        .expect("the stale receipt is traced");
    assert_eq!(refused["payload"]["changed"], json!(["policy"]));
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn a_hot_reloaded_policy_decides_the_next_call_and_a_broken_one_is_refused() {
    let d = deployment();
    d.approve_all();
    let client = d.serve_profile("publisher", ()).await;
    ok_call(&client, "search_sources", json!({"query": "checkpoint"})).await;
    // A policy that does not validate is refused; the old one keeps deciding.
    d.rewrite_policy("permit (principal, action, resource) when { resource.nope };");
    wait_for_trace(&d, |e| e["kind"] == "policy-load-failed").await;
    ok_call(&client, "search_sources", json!({"query": "checkpoint"})).await;
    let sent = d.upstream_tool_calls().len();
    // Reads forbidden from now on.
    d.rewrite_policy(&format!(
        "{POLICY}\n@id(\"no-reads\")\nforbid (principal, action == Airlock::Action::\"call\", resource) when {{ resource.effect_class == \"read\" }};\n"
    ));
    wait_for_trace(&d, |e| {
        e["kind"] == "policy-loaded" && !e["payload"]["previous"].is_null()
    })
    .await;
    let r = call(&client, "search_sources", json!({"query": "checkpoint"}))
        .await
        .unwrap();
    let text = text_of(&r);
    assert!(
        text.starts_with("capability unavailable for this task:"),
        "{text}"
    );
    assert_eq!(
        d.upstream_tool_calls().len(),
        sent,
        "nothing reached the notes server"
    );
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn a_policy_file_that_does_not_validate_refuses_to_start() {
    let d = Deployment::with_notes()
        .mapping("source-library")
        .with_outbox(&[])
        .tables(PROFILES)
        .top("default_profile = \"reader\"\n")
        .policy(
            "permit (principal, action == Airlock::Action::\"call\", resource)\nwhen { resource.effect_clas == \"read\" };\n",
        );
    let (ok, stderr) = d.serve_expecting_failure();
    assert!(!ok);
    assert!(stderr.contains("airlock.cedar:2:"), "{stderr}");
    assert!(
        stderr.contains("effect_class"),
        "the fix is suggested: {stderr}"
    );
    assert!(
        d.outbox_calls().is_empty(),
        "no upstream was started: {:?}",
        d.outbox_calls()
    );
}

#[tokio::test]
async fn a_reference_is_a_capability_of_one_kind() {
    let d = deployment();
    d.approve_all();
    let client = d.serve_profile("publisher", ()).await;
    let hits = call(&client, "search_sources", json!({"query": "checkpoint"}))
        .await
        .unwrap();
    let source = references(&hits)[0].clone();
    let (artifact, team) = prepared(&client, "team-reports").await;
    // A retrieval reference is not a delivery target, nor an artifact.
    for args in [
        deliver_args(&artifact, &source),
        deliver_args(&source, &team),
        json!({"artifact": artifact, "destination": team, "idempotency-key": "idk_chosen_by_the_model"}),
    ] {
        refused_arguments(call(&client, "deliver_artifact", args.clone()).await);
    }
    // The same object gets the same token in one session.
    let hits2 = call(&client, "search_sources", json!({"query": "checkpoint"}))
        .await
        .unwrap();
    assert_eq!(references(&hits2)[0], source);
    client.cancel().await.unwrap();
    // A reference from this session is nothing in another one.
    let other = d.serve_profile("publisher", ()).await;
    let err =
        refused_arguments(call(&other, "retrieve_source", json!({"reference": source})).await);
    assert!(err.contains("not valid in this session"), "{err}");
    other.cancel().await.unwrap();
    assert_eq!(d.sends(), 0);
}

async fn wait_for_trace(d: &Deployment, what: impl Fn(&Value) -> bool) {
    for _ in 0..100 {
        if d.trace().iter().any(&what) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("the expected trace event did not appear: {:#?}", d.trace());
}

// ---- asking through the client ----

/// A 2025-11-25 client that declares elicitation and answers every request with `action`
/// (accept with `approve: true`, decline, cancel), counting the requests.
#[derive(Clone)]
pub(crate) struct Person {
    action: ElicitationAction,
    pub(crate) asked: Arc<AtomicUsize>,
    last: Arc<std::sync::Mutex<String>>,
}

impl Person {
    pub(crate) fn new(action: ElicitationAction) -> Self {
        Self {
            action,
            asked: Arc::default(),
            last: Arc::default(),
        }
    }
}

impl ClientHandler for Person {
    fn get_info(&self) -> ClientConfig {
        ClientConfig::new(
            ClientCapabilities::builder().enable_elicitation().build(),
            Implementation::new("approval-test-client", "1.0.0"),
        )
    }

    async fn create_elicitation(
        &self,
        request: ElicitRequestParams,
        _context: RequestContext<RoleClient>,
    ) -> Result<ElicitResult, McpError> {
        self.asked.fetch_add(1, Ordering::SeqCst);
        if let ElicitRequestParams::FormElicitationParams { message, .. } = &request {
            *self.last.lock().unwrap() = message.clone();
        }
        Ok(match self.action {
            ElicitationAction::Accept => {
                ElicitResult::new(ElicitationAction::Accept).with_content(json!({"approve": true}))
            }
            ref other => ElicitResult::new(other.clone()),
        })
    }
}

#[tokio::test]
async fn elicitation_accept_delivers_once_and_decline_or_cancel_deliver_nothing() {
    for (action, delivers) in [
        (ElicitationAction::Accept, true),
        (ElicitationAction::Decline, false),
        (ElicitationAction::Cancel, false),
    ] {
        let d = deployment();
        d.approve_all();
        let person = Person::new(action.clone());
        let client = d.serve_profile("publisher", person.clone()).await;
        let (artifact, team) = prepared(&client, "team-reports").await;
        let r = call(&client, "deliver_artifact", deliver_args(&artifact, &team))
            .await
            .unwrap();
        assert_eq!(person.asked.load(Ordering::SeqCst), 1, "{action:?}");
        let message = person.last.lock().unwrap().clone();
        assert!(
            message.contains("Q3 report")
                && message.contains("sha256")
                && message.contains("team-reports"),
            "the person sees the exact consequence: {message}"
        );
        assert_eq!(
            r.is_error != Some(true),
            delivers,
            "{action:?}: {}",
            text_of(&r)
        );
        assert_eq!(d.sends(), usize::from(delivers), "{action:?}");
        assert_eq!(d.delivered("team-reports").len(), usize::from(delivers));
        if !delivers {
            assert!(text_of(&r).starts_with("forbidden:"), "{}", text_of(&r));
        }
        client.cancel().await.unwrap();
        let approvals = d.airlock_json(&["approvals", "list"]);
        let a = &approvals.as_array().unwrap()[0];
        assert_eq!(a["mode"], "elicitation", "the mode is recorded");
        assert_eq!(a["state"], if delivers { "consumed" } else { "denied" });
        assert_eq!(a["decided_by"], "alice (at the client)");
    }
}

/// A 2026-07-28 client (rmcp in `Discover` mode) that answers input requests.
async fn stateless(d: &Deployment, person: Person) -> RunningService<RoleClient, Person> {
    use rmcp::service::{ClientLifecycleMode, ClientServiceExt as _};
    let mut cmd = d.serve_command();
    cmd.arg("--profile").arg("publisher");
    person
        .serve_with_lifecycle(
            rmcp::transport::TokioChildProcess::new(cmd).unwrap(),
            ClientLifecycleMode::Discover {
                preferred_versions: vec![ProtocolVersion::V_2026_07_28],
            },
        )
        .await
        .expect("server/discover with airlock serve")
}

fn params(name: &str, args: Value) -> CallToolRequestParams {
    let mut p = CallToolRequestParams::new(name.to_string());
    p.arguments = args.as_object().cloned();
    p
}

#[tokio::test]
async fn a_stateless_client_approves_through_input_required_once() {
    let d = deployment();
    d.approve_all();
    let person = Person::new(ElicitationAction::Accept);
    let client = stateless(&d, person.clone()).await;
    let (artifact, team) = prepared(&client, "team-reports").await;
    // rmcp's client drives the MRTR round itself: it answers the input request through
    // the handler and retries with the echoed requestState.
    let r = client
        .call_tool(params("deliver_artifact", deliver_args(&artifact, &team)))
        .await
        .unwrap();
    assert_ne!(r.is_error, Some(true), "{}", text_of(&r));
    assert_eq!(person.asked.load(Ordering::SeqCst), 1);
    assert_eq!(d.sends(), 1);
    let approvals = d.airlock_json(&["approvals", "list"]);
    assert_eq!(approvals[0]["mode"], "input-required");
    assert_eq!(approvals[0]["state"], "consumed");
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn a_tampered_or_replayed_request_state_fails_closed() {
    let d = deployment();
    d.approve_all();
    let client = stateless(&d, Person::new(ElicitationAction::Accept)).await;
    let (artifact, team) = prepared(&client, "team-reports").await;
    let first = client
        .peer()
        .call_tool_once(params("deliver_artifact", deliver_args(&artifact, &team)))
        .await
        .unwrap();
    let CallToolResponse::InputRequired(required) = first else {
        panic!("expected input_required, got {first:?}");
    };
    let state = required.request_state.clone().unwrap();
    let requests = required.input_requests.clone().unwrap();
    assert!(requests.contains_key("approval"));
    let accept = json!({"action": "accept", "content": {"approve": true}});
    let retry = |state: String, args: Value| {
        let mut p = params("deliver_artifact", args);
        p.request_state = Some(state);
        p.input_responses = Some([("approval".to_string(), accept.clone())].into());
        p
    };
    let refused = |r: CallToolResponse| match r {
        CallToolResponse::Complete(r) => assert_refused(&r, Category::ApprovalRequired),
        other => panic!("expected a refusal, got {other:?}"),
    };
    // Tampered: one character changed.
    let mut bytes = state.clone().into_bytes();
    let i = bytes.len() / 2;
    bytes[i] = if bytes[i] == b'A' { b'B' } else { b'A' };
    let tampered = String::from_utf8(bytes).unwrap();
    let text = refused(
        client
            .peer()
            .call_tool_once(retry(tampered, deliver_args(&artifact, &team)))
            .await
            .unwrap(),
    );
    assert!(text.contains("not valid"), "{text}");
    // Bound to the arguments: the same state for another destination fails.
    let (_, archive) = prepared(&client, "archive").await;
    refused(
        client
            .peer()
            .call_tool_once(retry(state.clone(), deliver_args(&artifact, &archive)))
            .await
            .unwrap(),
    );
    assert_eq!(d.sends(), 0);
    // The genuine retry delivers.
    match client
        .peer()
        .call_tool_once(retry(state.clone(), deliver_args(&artifact, &team)))
        .await
        .unwrap()
    {
        CallToolResponse::Complete(r) => assert_ne!(r.is_error, Some(true), "{}", text_of(&r)),
        other => panic!("{other:?}"),
    }
    assert_eq!(d.sends(), 1);
    // Replayed: refused, nothing sent again.
    let text = refused(
        client
            .peer()
            .call_tool_once(retry(state, deliver_args(&artifact, &team)))
            .await
            .unwrap(),
    );
    assert!(text.contains("consumed"), "{text}");
    assert_eq!(d.sends(), 1);
    assert_eq!(d.delivered("team-reports").len(), 1);
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn an_expired_request_state_fails_closed() {
    let d = deployment().tables("[approvals]\nttl = \"1s\"\n");
    d.approve_all();
    let client = stateless(&d, Person::new(ElicitationAction::Accept)).await;
    let (artifact, team) = prepared(&client, "team-reports").await;
    let CallToolResponse::InputRequired(required) = client
        .peer()
        .call_tool_once(params("deliver_artifact", deliver_args(&artifact, &team)))
        .await
        .unwrap()
    else {
        panic!("expected input_required");
    };
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let mut p = params("deliver_artifact", deliver_args(&artifact, &team));
    p.request_state = required.request_state;
    p.input_responses = Some(
        [(
            "approval".to_string(),
            json!({"action": "accept", "content": {"approve": true}}),
        )]
        .into(),
    );
    match client.peer().call_tool_once(p).await.unwrap() {
        CallToolResponse::Complete(r) => {
            let text = assert_refused(&r, Category::ApprovalRequired);
            assert!(text.contains("not valid"), "{text}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(d.sends(), 0);
    client.cancel().await.unwrap();
}

// ---- what an approval is bound to ----

/// A deployment whose delivery server changes its catalogue (`kind`) once `trigger` exists.
fn changing(kind: &str) -> (Deployment, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let trigger = dir.path().join("change-now");
    let t = trigger.display().to_string();
    // The confined server sees the trigger's folder because it is granted (read-only).
    let d = Deployment::with_notes()
        .mapping("source-library")
        .with_outbox_granted(
            &["--change-when", &t, kind],
            &[(dir.path(), "read-only")],
            |m| m,
        )
        .policy(POLICY)
        .tables(PROFILES);
    std::mem::forget(dir);
    (d, trigger)
}

/// Requests and approves a delivery to team-reports; returns the approval id and the
/// references.
async fn approved_delivery<H: ClientHandler>(
    d: &Deployment,
    client: &RunningService<RoleClient, H>,
) -> (String, String, String) {
    let (artifact, team) = prepared(client, "team-reports").await;
    let r = call(client, "deliver_artifact", deliver_args(&artifact, &team))
        .await
        .unwrap();
    let id = approval_in(&text_of(&r));
    d.airlock_ok(&["approvals", "approve", &id, "--yes"]);
    (id, artifact, team)
}

#[tokio::test]
async fn description_drift_after_the_approval_stops_the_delivery() {
    let (d, trigger) = changing("description");
    d.approve_all();
    let notices = Notices::default();
    let client = d.serve_profile("publisher", notices.clone()).await;
    let (id, artifact, team) = approved_delivery(&d, &client).await;
    std::fs::write(&trigger, "").unwrap();
    assert!(
        notices.wait_beyond(0, 10).await,
        "the client hears list_changed"
    );
    let r = call(&client, "deliver_artifact", deliver_args(&artifact, &team))
        .await
        .unwrap();
    let text = text_of(&r);
    assert!(text.starts_with("state changed:"), "{text}");
    assert_eq!(d.sends(), 0, "nothing reached the server");
    assert_eq!(
        d.airlock_json(&["approvals", "show", &id])["state"],
        "approved",
        "the receipt was not spent on a call that could not run"
    );
    assert!(
        d.trace()
            .iter()
            .any(|e| e["kind"] == "call-refused" && e["payload"]["changed"] == "mapping-state")
    );
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn a_snapshot_change_after_the_approval_needs_a_new_one() {
    // A new tool appears upstream: informational drift, the mapping keeps serving, but the
    // approval was given against the previous snapshot.
    let (d, trigger) = changing("add-tool");
    d.approve_all();
    let notices = Notices::default();
    let client = d.serve_profile("publisher", notices.clone()).await;
    let (id, artifact, team) = approved_delivery(&d, &client).await;
    std::fs::write(&trigger, "").unwrap();
    // The host re-discovers on the server's list_changed (the client is not told: what it
    // is offered did not change): wait for the snapshot with the fifth tool.
    wait_for_trace(&d, |e| {
        e["kind"] == "snapshot-taken" && e["payload"]["tools"] == 5
    })
    .await;
    let r = call(&client, "deliver_artifact", deliver_args(&artifact, &team))
        .await
        .unwrap();
    let text = text_of(&r);
    assert!(text.starts_with("approval required:"), "{text}");
    assert_ne!(approval_in(&text), id);
    assert_eq!(d.sends(), 0);
    let refused = d
        .trace()
        .into_iter()
        .find(|e| e["kind"] == "receipt-refused" && e["payload"]["approval"] == id.as_str())
        .expect("the stale receipt is traced");
    assert_eq!(refused["payload"]["changed"], json!(["snapshot"]));
    client.cancel().await.unwrap();
}

#[tokio::test]
async fn a_new_mapping_revision_after_the_approval_needs_a_new_one() {
    let d = deployment();
    d.approve_all();
    let client = d.serve_profile("publisher", ()).await;
    let (id, artifact, team) = approved_delivery(&d, &client).await;
    // A reviewer approves the mapping again: a new revision serves.
    d.approve("outbox-delivery", "carol", &[]);
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    let err =
        refused_arguments(call(&client, "deliver_artifact", deliver_args(&artifact, &team)).await);
    assert!(err.contains("issued before"), "{err}");
    assert_eq!(d.sends(), 0);
    assert_eq!(
        d.airlock_json(&["approvals", "show", &id])["state"],
        "approved"
    );
    // Fresh references under the new revision: the old receipt (revision 1) still does
    // not apply; a new approval is asked for.
    let (artifact, team) = prepared(&client, "team-reports").await;
    let r = call(&client, "deliver_artifact", deliver_args(&artifact, &team))
        .await
        .unwrap();
    let text = text_of(&r);
    assert!(text.starts_with("approval required:"), "{text}");
    assert!(text.contains("revision 2"), "{text}");
    assert_eq!(d.sends(), 0);
    client.cancel().await.unwrap();
}
