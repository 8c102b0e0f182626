//! Policy-approved calls under attack: what an adversarial review of the approval path
//! found (each test here failed before its fix, or covers a guard that no other test
//! noticed when it was removed).
//!
//! In-process hosts (real delivery fixture process, real component, real SQLite) so the
//! test can act at exact points of a call (inside an elicitation, between two calls).

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use airlock::config::{Profile, RequesterConfig, ServeConfig};
use airlock::host::Host;
use airlock::pipeline::{
    self, Asker, Candidate, Category, ClientAbilities, ElicitAnswer, NoAsker, Outcome, Retry,
    Session,
};
use airlock::registry::live::MappingSource;
use airlock::store::{NewEvent, SqliteStore, Trace as _};
use airlock::upstream::StdioServer;

use serde_json::{Value, json};

// The approvals policy of the process tests (reads anywhere; the publisher prepares, and
// delivers once approved; never to the partner drop).
use crate::common::{self, POLICY};

struct Delivery {
    host: Arc<Host>,
    dir: tempfile::TempDir,
}

impl Delivery {
    async fn start() -> Self {
        Self::start_with(&["operator"], &[]).await
    }

    /// A host whose requester `alice` holds `roles`, the delivery server started with
    /// `extra` arguments (e.g. `--change-when FILE add-tool`).
    async fn start_with(roles: &[&str], extra: &[String]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let policy = dir.path().join("airlock.cedar");
        std::fs::write(&policy, POLICY).unwrap();
        let log = dir.path().join("outbox-calls.jsonl");
        std::fs::write(&log, "").unwrap();
        let mut connections = BTreeMap::new();
        connections.insert(
            "outbox".to_string(),
            StdioServer {
                command: PathBuf::from(env!("CARGO_BIN_EXE_airlock")),
                args: vec![
                    "fixture".into(),
                    "delivery-server".into(),
                    "--outbox".into(),
                    dir.path().join("outbox").display().to_string(),
                    "--call-log".into(),
                    log.display().to_string(),
                ]
                .into_iter()
                .chain(extra.iter().cloned())
                .collect(),
                cwd: dir.path().to_path_buf(),
                env: BTreeMap::new(),
                owner: None,
                credential_scope: None,
                identity_files: vec![],
                confine: None,
            }
            .into(),
        );
        let mut profiles = BTreeMap::new();
        profiles.insert("publisher".to_string(), Profile::everything("publisher"));
        let config = ServeConfig {
            connections,
            state_dir: Some(dir.path().join("state")),
            cache_dir: Some(PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("compiled-cache")),
            policy_files: vec![policy],
            profiles,
            requester: RequesterConfig {
                name: "alice".into(),
                roles: roles.iter().map(|r| r.to_string()).collect(),
            },
            ..ServeConfig::empty()
        };
        let manifest = Path::new(airlock::ADAPTER_BUNDLE).join("outbox-delivery/mapping.toml");
        let host = Host::start_with(&config, vec![MappingSource::from_file(&manifest).unwrap()])
            .await
            .unwrap();
        airlock::cli::demo::approve_all(&host, "tests")
            .await
            .unwrap();
        Self { host, dir }
    }

    fn session(&self) -> Arc<Session> {
        self.host.stdio_session(Some("publisher")).unwrap()
    }

    fn sends(&self) -> usize {
        std::fs::read_to_string(self.dir.path().join("outbox-calls.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("\"send_file\""))
            .count()
    }

    fn trace(&self) -> Vec<airlock::store::TraceEvent> {
        self.host.registry().store().trace(0, usize::MAX).unwrap()
    }

    async fn run(
        &self,
        session: &Arc<Session>,
        name: &str,
        args: Value,
        abilities: ClientAbilities,
        retry: Option<Retry>,
        asker: &dyn Asker,
    ) -> Outcome {
        let candidate = Candidate::new(
            session.clone(),
            name,
            args.as_object().cloned(),
            abilities,
            retry,
        );
        // The outcome, once the call's trace is committed (`Finished::respond`).
        pipeline::run(&self.host, candidate, asker)
            .await
            .respond(|o| o)
            .await
            .unwrap_or_else(|o| o)
    }

    async fn ok(&self, session: &Arc<Session>, name: &str, args: Value) -> Value {
        match self
            .run(
                session,
                name,
                args,
                ClientAbilities::plain(),
                None,
                &NoAsker,
            )
            .await
        {
            Outcome::Completed(c) => c.value.unwrap(),
            other => panic!("{name}: {other:?}"),
        }
    }

    /// Prepares an artifact and finds the team-reports destination: (artifact, destination).
    async fn prepared(&self, session: &Arc<Session>) -> (String, String) {
        let a = self
            .ok(
                session,
                "prepare_artifact",
                json!({"title": "Q3 report", "media-type": "text/markdown", "content": "# Q3\n"}),
            )
            .await;
        let list = self.ok(session, "list_destinations", json!({})).await;
        let team = list
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["label"] == "Team reports outbox")
            .unwrap_or_else(|| panic!("{list}"))["destination"]
            .as_str()
            .unwrap()
            .to_string();
        (a["artifact"].as_str().unwrap().to_string(), team)
    }
}

fn deliver(artifact: &str, destination: &str) -> Value {
    json!({"artifact": artifact, "destination": destination})
}

fn eliciting() -> ClientAbilities {
    ClientAbilities {
        protocol: "2025-11-25".into(),
        stateless: false,
        elicitation: true,
    }
}

fn stateless() -> ClientAbilities {
    ClientAbilities {
        protocol: "2026-07-28".into(),
        stateless: true,
        elicitation: true,
    }
}

type Hook = Box<dyn Fn() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// A person at a 2025-11-25 client: runs `before` (something that happens while the
/// question is on screen), then gives `answer`.
struct Answer {
    before: Hook,
    answer: ElicitAnswer,
    asked: AtomicUsize,
}

impl Answer {
    fn new(answer: ElicitAnswer) -> Self {
        Self::after(answer, || async {})
    }

    fn after<F, Fut>(answer: ElicitAnswer, before: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        Self {
            before: Box::new(move || Box::pin(before())),
            answer,
            asked: AtomicUsize::new(0),
        }
    }
}

impl Asker for Answer {
    fn elicit<'a>(
        &'a self,
        _message: &'a str,
        _timeout: Duration,
    ) -> Pin<Box<dyn Future<Output = ElicitAnswer> + Send + 'a>> {
        self.asked.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move {
            (self.before)().await;
            self.answer.clone()
        })
    }
}

// ---------------------------------------------------------------------------------------
// Found: an elicitation receipt was not bound to the policy in force when it was used.
//
// The elicitation flow builds the receipt binding from the decision taken *before* the
// person was asked (authorize), and consumes it against that same stale binding; the
// re-check only asks the new policy "would an approved call be allowed?". So a policy
// change while the person is looking at the form does not invalidate the approval, unlike
// the out-of-band and MRTR flows (which re-authorize on the repeated call and then find
// `changed: ["policy"]`). The trace then shows the call decided under the old digest and
// holds no record that it ran under the new one.
// ---------------------------------------------------------------------------------------
#[tokio::test]
async fn a_policy_change_during_the_question_invalidates_the_answer() {
    let d = Delivery::start().await;
    let s = d.session();
    let (artifact, team) = d.prepared(&s).await;
    let old = d.host.policy().current().digest().to_string();
    let host = d.host.clone();
    let dir = d.dir.path().to_path_buf();
    let asker = Answer::after(ElicitAnswer::Accept(json!({"approve": true})), move || {
        // While the person reads the form, the security team ships a new policy version
        // (here: same rules, new text; any policy that still permits an approved
        // delivery behaves the same).
        std::fs::write(
            dir.join("airlock.cedar"),
            format!("{POLICY}\n// revised while a person was being asked\n"),
        )
        .unwrap();
        assert!(host.reload_policy().unwrap(), "the new policy loaded");
        async {}
    });
    let outcome = d
        .run(
            &s,
            "deliver_artifact",
            deliver(&artifact, &team),
            eliciting(),
            None,
            &asker,
        )
        .await;
    assert_eq!(asker.asked.load(Ordering::SeqCst), 1);
    let new = d.host.policy().current().digest().to_string();
    assert_ne!(old, new);
    let trace = d.trace();
    let decided: Vec<_> = trace
        .iter()
        .filter(|e| e.kind == "call-decided" && e.payload["capability"] == "deliver_artifact")
        .collect();
    eprintln!(
        "outcome: {:?}\nsends: {}\ndecided under: {:?}\npolicy now: {new}",
        matches!(outcome, Outcome::Completed(_)),
        d.sends(),
        decided
            .iter()
            .map(|e| e.payload["policy_digest"].clone())
            .collect::<Vec<_>>()
    );
    // Issue 8 §6: "a use after the mapping revision, snapshot or policy changed fails".
    assert!(
        !matches!(outcome, Outcome::Completed(_)),
        "the receipt bound to policy {old} was used under policy {new}"
    );
    assert_eq!(d.sends(), 0, "the delivery reached the upstream");
}

// ---------------------------------------------------------------------------------------
// Found: group commit acknowledged trace events that were never committed.
//
// `GroupCommit::take_or_done` decides "my batch was handled by someone else" from
// `done >= ticket` and then looks for a failure covering the ticket in a list capped at
// 64 entries. When more than 64 later batches fail before a waiting caller gets the
// database lock, its failure has been evicted and the caller gets `Ok(())` for events
// that are not in the database. Here every insert fails (a trigger stands for a full
// disk / I/O error), so every `Ok` is an acknowledged event that does not exist.
// ---------------------------------------------------------------------------------------
#[test]
fn a_failed_trace_write_is_never_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(SqliteStore::open(dir.path()).unwrap());
    {
        let conn = rusqlite::Connection::open(dir.path().join("airlock.db")).unwrap();
        conn.execute_batch(
            "CREATE TRIGGER attack_disk_full BEFORE INSERT ON trace_events
             BEGIN SELECT RAISE(ABORT, 'simulated write failure'); END;",
        )
        .unwrap();
    }
    let acknowledged = Arc::new(AtomicUsize::new(0));
    let refused = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = (0..96)
        .map(|t| {
            let (store, acknowledged, refused) =
                (store.clone(), acknowledged.clone(), refused.clone());
            std::thread::spawn(move || {
                for i in 0..300 {
                    let e = NewEvent::new("attack", format!("t{t}-{i}"), json!({"i": i}));
                    match store.append_events(vec![e]) {
                        Ok(()) => acknowledged.fetch_add(1, Ordering::Relaxed),
                        Err(_) => refused.fetch_add(1, Ordering::Relaxed),
                    };
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let stored = store.trace(0, usize::MAX).unwrap().len();
    let acknowledged = acknowledged.load(Ordering::Relaxed);
    eprintln!(
        "acknowledged {acknowledged}, refused {}, stored {stored}",
        refused.load(Ordering::Relaxed)
    );
    assert_eq!(stored, 0, "the trigger refuses every insert");
    assert_eq!(
        acknowledged, 0,
        "append_events returned Ok for events that were never committed"
    );
}

// ---------------------------------------------------------------------------------------
// Guards no other test noticed when they were removed.
// ---------------------------------------------------------------------------------------

/// MRTR: a decline (or cancel, or `approve: false`) on the retry delivers nothing, and the
/// same requestState cannot be turned into an accept afterwards.
#[tokio::test]
async fn mrtr_decline_delivers_nothing_and_cannot_be_flipped_to_accept() {
    let d = Delivery::start().await;
    let s = d.session();
    let (artifact, team) = d.prepared(&s).await;
    for answer in [
        json!({"action": "decline"}),
        json!({"action": "cancel"}),
        json!({"action": "accept", "content": {"approve": false}}),
        json!({"action": "accept", "content": {"approve": "true"}}),
        json!({"action": "accept"}),
    ] {
        let Outcome::InputRequired { request_state, .. } = d
            .run(
                &s,
                "deliver_artifact",
                deliver(&artifact, &team),
                stateless(),
                None,
                &NoAsker,
            )
            .await
        else {
            panic!("expected input_required");
        };
        let retry = |answer: Value| Retry {
            request_state: Some(request_state.clone()),
            input_responses: [("approval".to_string(), answer)].into(),
        };
        match d
            .run(
                &s,
                "deliver_artifact",
                deliver(&artifact, &team),
                stateless(),
                Some(retry(answer.clone())),
                &NoAsker,
            )
            .await
        {
            Outcome::Refused { category, .. } => {
                assert_eq!(category, Category::Forbidden, "{answer}")
            }
            other => panic!("{answer}: {other:?}"),
        }
        // The refused state, replayed with an accept.
        let flipped = d
            .run(
                &s,
                "deliver_artifact",
                deliver(&artifact, &team),
                stateless(),
                Some(retry(
                    json!({"action": "accept", "content": {"approve": true}}),
                )),
                &NoAsker,
            )
            .await;
        assert!(
            !matches!(flipped, Outcome::Completed(_)),
            "{answer}: {flipped:?}"
        );
    }
    assert_eq!(d.sends(), 0);
}

/// Elicitation: `accept` with `approve: false` (or content that is not `true`) is a refusal.
#[tokio::test]
async fn elicitation_accept_without_approve_true_delivers_nothing() {
    let d = Delivery::start().await;
    let s = d.session();
    let (artifact, team) = d.prepared(&s).await;
    for content in [
        json!({"approve": false}),
        json!({"approve": "true"}),
        json!({}),
        json!(null),
    ] {
        let asker = Answer::new(ElicitAnswer::Accept(content.clone()));
        let outcome = d
            .run(
                &s,
                "deliver_artifact",
                deliver(&artifact, &team),
                eliciting(),
                None,
                &asker,
            )
            .await;
        assert_eq!(asker.asked.load(Ordering::SeqCst), 1);
        assert!(
            matches!(
                outcome,
                Outcome::Refused {
                    category: Category::Forbidden,
                    ..
                }
            ),
            "{content}: {outcome:?}"
        );
    }
    assert_eq!(d.sends(), 0);
}

/// A policy that still permits an approved delivery in general but forbids this one,
/// loaded between the approval and its use (out of band, receipt already approved): the
/// re-check at execution refuses it. (Guards `recheck`'s policy decision.)
#[tokio::test]
async fn recheck_uses_the_current_policy_for_a_call_that_holds_a_receipt() {
    let d = Delivery::start().await;
    let s = d.session();
    let (artifact, team) = d.prepared(&s).await;
    let host = d.host.clone();
    let dir = d.dir.path().to_path_buf();
    let asker = Answer::after(ElicitAnswer::Accept(json!({"approve": true})), move || {
        std::fs::write(
            dir.join("airlock.cedar"),
            format!(
                "{POLICY}\n@id(\"no-team\")\nforbid (principal, action == Airlock::Action::\"call\", resource) when {{ context has destination && context.destination == Airlock::Scope::\"team-reports\" }};\n"
            ),
        )
        .unwrap();
        assert!(host.reload_policy().unwrap());
        async {}
    });
    let outcome = d
        .run(
            &s,
            "deliver_artifact",
            deliver(&artifact, &team),
            eliciting(),
            None,
            &asker,
        )
        .await;
    // The receipt is bound to the policy it was given under (refused at consumption,
    // `state changed`); were it not, the re-check's decision with the current policy
    // refuses it (`policy no longer permits`).
    assert!(
        matches!(
            outcome,
            Outcome::Refused {
                category: Category::PolicyNoLongerPermits | Category::StateChanged,
                ..
            }
        ),
        "{outcome:?}"
    );
    assert_eq!(d.sends(), 0);
}

/// Hostile `requestState` values fail closed and never panic the host.
#[tokio::test]
async fn hostile_request_states_fail_closed() {
    let d = Delivery::start().await;
    let s = d.session();
    let (artifact, team) = d.prepared(&s).await;
    let Outcome::InputRequired { request_state, .. } = d
        .run(
            &s,
            "deliver_artifact",
            deliver(&artifact, &team),
            stateless(),
            None,
            &NoAsker,
        )
        .await
    else {
        panic!("expected input_required");
    };
    let parts: Vec<&str> = request_state.split('.').collect();
    let mut hostile = vec![
        String::new(),
        ".".into(),
        "rs1".into(),
        "rs1.".into(),
        "rs1..".into(),
        "rs2....".into(),
        "rs1.\u{0}.\u{0}".into(),
        "rs1.é🦀.x".into(),
        format!("rs1.{}", "A".repeat(2_000_000)),
        format!("rs2.{}.{}", "k".repeat(400), "A".repeat(100)),
        request_state.to_uppercase(),
        format!("{request_state}."),
        format!("{request_state}A"),
    ];
    if parts.len() >= 2 {
        hostile.push(parts[..parts.len() - 1].join("."));
        hostile.push(format!("{}.{}", parts[0], parts[parts.len() - 1]));
    }
    for state in hostile {
        let retry = Retry {
            request_state: Some(state.clone()),
            input_responses: [(
                "approval".to_string(),
                json!({"action": "accept", "content": {"approve": true}}),
            )]
            .into(),
        };
        let outcome = d
            .run(
                &s,
                "deliver_artifact",
                deliver(&artifact, &team),
                stateless(),
                Some(retry),
                &NoAsker,
            )
            .await;
        assert!(
            matches!(
                outcome,
                Outcome::Refused {
                    category: Category::ApprovalRequired,
                    ..
                }
            ),
            "{:?}: {outcome:?}",
            state.chars().take(40).collect::<String>()
        );
    }
    assert_eq!(d.sends(), 0);
}

// ---------------------------------------------------------------------------------------
// Found: a policy file with ~150 nested parentheses aborted the process (stack
// overflow in cedar-policy-core's CST→AST conversion, `to_expr_or_special`), instead of
// being refused with file and line. At start this kills `airlock serve`/`policy validate`
// (SIGABRT); on hot reload it kills a running host, with every session and in-flight
// call (the reload runs on a 2 MiB tokio worker stack). Measured on the debug build:
// 120 levels load, 150 abort on the 8 MiB main thread.
// ---------------------------------------------------------------------------------------
fn nested_policy(depth: usize) -> String {
    format!(
        "{POLICY}\n@id(\"deep\")\npermit (principal, action == Airlock::Action::\"call\", resource) when {{ {}false{} }};\n",
        "(".repeat(depth),
        ")".repeat(depth)
    )
}

#[test]
fn a_deeply_nested_policy_is_refused_not_fatal() {
    let d = common::Deployment::with_notes()
        .mapping("source-library")
        .with_outbox(&[])
        .policy(&nested_policy(2_000))
        .tables(common::PROFILES);
    let config = d.write_config();
    let out = d.airlock(&["policy", "validate", "--config", config.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!(
        "status {:?}; stderr: {}",
        out.status,
        stderr.chars().take(300).collect::<String>()
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "refused with a message (exit 1), not killed by a signal: {stderr}"
    );
}

#[tokio::test]
async fn a_deeply_nested_policy_on_hot_reload_leaves_the_host_serving() {
    let d = common::approvals_deployment();
    d.approve_all();
    let client = d.serve_profile("publisher", ()).await;
    assert!(!client.peer().list_all_tools().await.unwrap().is_empty());
    d.rewrite_policy(&nested_policy(2_000));
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    // The previous policy should keep deciding (`policy-load-failed` in the trace).
    let listed = client.peer().list_all_tools().await;
    assert!(
        listed.is_ok(),
        "the host died on a policy it should have refused: {listed:?}"
    );
}

// ---------------------------------------------------------------------------------------
// More guards of the re-check at execution (before these tests, every one of its checks
// could be removed without any test failing).
// ---------------------------------------------------------------------------------------

/// The upstream's catalogue changes (a tool is added: informational drift, the mapping
/// keeps serving) while the person is being asked: the receipt was for the old snapshot.
#[tokio::test]
async fn a_snapshot_change_during_the_question_stops_the_delivery() {
    let trigger = tempfile::tempdir().unwrap();
    let file = trigger.path().join("change-now");
    let d = Delivery::start_with(
        &["operator"],
        &[
            "--change-when".into(),
            file.display().to_string(),
            "add-tool".into(),
        ],
    )
    .await;
    let s = d.session();
    let (artifact, team) = d.prepared(&s).await;
    let host = d.host.clone();
    let before = host.catalog().mappings["outbox-delivery"]
        .connection
        .snapshot_digest();
    let asker = Answer::after(ElicitAnswer::Accept(json!({"approve": true})), move || {
        std::fs::write(&file, "").unwrap();
        let host = host.clone();
        let before = before.clone();
        async move {
            // The server notices within 50 ms and announces list_changed; give the host
            // time to hear it (it re-discovers at the latest in the re-check).
            for _ in 0..40 {
                tokio::time::sleep(Duration::from_millis(50)).await;
                let c = host.catalog();
                let state = &c.mappings["outbox-delivery"].connection;
                if state.is_stale() || state.snapshot_digest() != before {
                    break;
                }
            }
        }
    });
    let outcome = d
        .run(
            &s,
            "deliver_artifact",
            deliver(&artifact, &team),
            eliciting(),
            None,
            &asker,
        )
        .await;
    assert!(
        matches!(
            outcome,
            Outcome::Refused {
                category: Category::StateChanged,
                ..
            }
        ),
        "{outcome:?}"
    );
    assert_eq!(d.sends(), 0);
}

/// A reviewer approves the mapping again (a new revision serves) while the person is
/// being asked: the receipt was for the old revision.
#[tokio::test]
async fn a_new_mapping_revision_during_the_question_stops_the_delivery() {
    let d = Delivery::start().await;
    let s = d.session();
    let (artifact, team) = d.prepared(&s).await;
    let host = d.host.clone();
    let asker = Answer::after(ElicitAnswer::Accept(json!({"approve": true})), move || {
        let host = host.clone();
        async move {
            airlock::cli::demo::approve_all(&host, "carol")
                .await
                .unwrap();
        }
    });
    let revision = d.host.catalog().mappings["outbox-delivery"]
        .record()
        .revision;
    let outcome = d
        .run(
            &s,
            "deliver_artifact",
            deliver(&artifact, &team),
            eliciting(),
            None,
            &asker,
        )
        .await;
    assert_ne!(
        d.host.catalog().mappings["outbox-delivery"]
            .record()
            .revision,
        revision,
        "a new revision serves"
    );
    assert!(
        matches!(
            outcome,
            Outcome::Refused {
                category: Category::StateChanged,
                ..
            }
        ),
        "{outcome:?}"
    );
    assert_eq!(d.sends(), 0);
}

/// A capability in the session's profile that policy denies outright for this requester
/// (no `operator` role: not even an approval would permit it) is not offered, and calling
/// it is "unknown tool" — the offer's policy filter (`offer::offerable`) has no other test.
#[tokio::test]
async fn a_capability_policy_denies_outright_is_neither_offered_nor_named() {
    let d = Delivery::start_with(&[], &[]).await;
    let front = d.host.front(Some("publisher")).unwrap();
    let names: Vec<String> = front.list().iter().map(|t| t.name.to_string()).collect();
    assert_eq!(
        names,
        ["list_destinations", "prepare_artifact"],
        "{names:?}"
    );
    let err = front
        .call(
            "deliver_artifact",
            json!({"artifact": "ref_0000000000000000000000000000000000000000", "destination": "x"})
                .as_object()
                .cloned(),
        )
        .await
        .unwrap_err();
    assert!(err.message.contains("unknown tool"), "{}", err.message);
    assert_eq!(d.sends(), 0);
}

// ---------------------------------------------------------------------------------------
// Found: a call restarted after its mapping was swapped (recheck → `Superseded`) left
// its first durable intent `prepared` forever: `stages` creates a second intent and
// overwrites `call.durable_intent`, so the outcome is written to the second only. A
// `prepared` intent of an effectful capability is exactly what an operator must reconcile
// as "may have acted" — here nothing ran. Reproduced under load: `prepare_artifact`
// (local transformation, durable intent) in 8 loops while the mapping is re-approved.
// ---------------------------------------------------------------------------------------
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_call_closes_the_intent_it_superseded() {
    let d = Arc::new(Delivery::start().await);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut loops = Vec::new();
    for i in 0..8 {
        let (d, stop) = (d.clone(), stop.clone());
        loops.push(tokio::spawn(async move {
            let s = d.session();
            let mut n = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let _ = d
                    .run(
                        &s,
                        "prepare_artifact",
                        json!({"title": format!("t{i}-{n}"), "media-type": "text/plain", "content": "x"}),
                        ClientAbilities::plain(),
                        None,
                        &NoAsker,
                    )
                    .await;
                n += 1;
            }
            n
        }));
    }
    for _ in 0..25 {
        tokio::time::sleep(Duration::from_millis(120)).await;
        airlock::cli::demo::approve_all(&d.host, "carol")
            .await
            .unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let mut calls = 0;
    for l in loops {
        calls += l.await.unwrap();
    }
    let trace = d.trace();
    let mut by_call: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for e in trace.iter().filter(|e| e.kind == "intent-created") {
        by_call
            .entry(e.payload["call"].as_str().unwrap().to_string())
            .or_default()
            .push(e.payload["intent"].as_str().unwrap().to_string());
    }
    let restarted: Vec<_> = by_call.iter().filter(|(_, v)| v.len() > 1).collect();
    let store = d.host.registry().store();
    let orphans: Vec<String> = by_call
        .values()
        .flatten()
        .filter(|id| {
            store
                .intent(id)
                .unwrap()
                .is_some_and(|r| r.state == airlock::store::IntentState::Prepared)
        })
        .cloned()
        .collect();
    eprintln!(
        "{calls} calls, {} restarted, {} intents still prepared after every call returned",
        restarted.len(),
        orphans.len()
    );
    assert!(orphans.is_empty(), "orphan prepared intents: {orphans:?}");
    // Every intent's state, the superseded ones' `failed` included, is the trace's.
    for id in by_call.values().flatten() {
        let row = store.intent(id).unwrap().unwrap();
        let proofs = store.intent_proofs(id).unwrap();
        assert_eq!(
            airlock::pipeline::intent::prove_intent(&proofs, &row),
            None,
            "{row:#?}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Found (low): the artifact digest a receipt records was never checked. `changed_fields`
// compares requester, session, capability, mapping, revision, snapshot, policy and the
// arguments digest — the arguments digest covers the artifact's *locator*, not its
// content — and re-minting a locator keeps the token and silently replaces its facts.
// So if an upstream ever issues the same artifact id for other content (state wiped,
// ids derived from titles, a buggy or hostile server), an approved receipt for
// "artifact X (sha256 A)" delivers content B, and the token the model holds now reports
// sha256 B. The delivery result's own `artifact-sha256` is not compared either.
// ---------------------------------------------------------------------------------------
#[test]
fn a_reference_whose_object_changed_is_replaced() {
    use airlock::pipeline::references::{Origin, ReferenceTable, ResolveError};
    let t = ReferenceTable::default();
    let o = Origin {
        mapping: "outbox-delivery".into(),
        generation: 1,
        revision: 1,
    };
    // What artifact-delivery declares identifies an artifact.
    let contract =
        airlock::contract::load_contract("airlock:contracts/artifact-delivery@0.2.0").unwrap();
    let sha = contract.identity_facts("artifact-ref");
    assert_eq!(sha, ["sha256"]);
    let facts = |sha: char, bytes: u64| {
        let mut f = serde_json::Map::new();
        f.insert("sha256".into(), json!(sha.to_string().repeat(64)));
        f.insert("bytes".into(), json!(bytes));
        f
    };
    let approved = t.mint(&o, "artifact-ref", "file-0001", facts('a', 12), sha);
    let same = t.mint(&o, "artifact-ref", "file-0001", facts('a', 12), sha);
    assert_eq!(approved, same, "the same object keeps its token");
    let later = t.mint(&o, "artifact-ref", "file-0001", facts('b', 9_000_000), sha);
    assert_ne!(
        approved, later,
        "another object under the same id gets another token"
    );
    assert_eq!(
        t.resolve(&approved, "artifact-ref", &o),
        Err(ResolveError::NotValid),
        "the old token no longer stands for anything"
    );
    assert_eq!(
        t.resolve(&later, "artifact-ref", &o).unwrap().facts["sha256"],
        "b".repeat(64)
    );
}

// ---------------------------------------------------------------------------------------
// A receipt is proven by the trace, not by its row. Someone who can write `airlock.db`
// (and not the host key) sets a pending approval to approved, rebinds an approved receipt
// to other arguments, revives a revoked one or lengthens its life; the row then says
// "approved, for this call, still valid", and only the MACed `approval-requested` /
// `approval-decided` events say otherwise. Each case is refused before anything is
// consumed, is traced as `receipt-refused` (`tampered`), and sends nothing.
// ---------------------------------------------------------------------------------------

impl Delivery {
    /// The attacker: a connection of their own to the host's database file.
    fn attacker(&self) -> rusqlite::Connection {
        rusqlite::Connection::open(self.dir.path().join("state").join("airlock.db")).unwrap()
    }

    /// Asks for the delivery `args` out of band (a plain client): the new approval's id.
    async fn ask(&self, session: &Arc<Session>, args: Value) -> String {
        match self
            .run(
                session,
                "deliver_artifact",
                args,
                ClientAbilities::plain(),
                None,
                &NoAsker,
            )
            .await
        {
            Outcome::ApprovalRequired { approval, .. } => approval,
            other => panic!("expected an approval request, got {other:?}"),
        }
    }

    /// A person's out-of-band decision, as `airlock approvals approve|revoke` records it.
    fn decide(&self, id: &str, decision: airlock::store::ApprovalDecision, ttl: Duration) {
        airlock::cli::approvals::decide(self.host.registry(), id, decision, "carol", None, ttl)
            .unwrap();
    }

    /// Makes the call again (as the model does once a person approved): the outcome.
    async fn again(&self, session: &Arc<Session>, args: Value) -> Outcome {
        self.run(
            session,
            "deliver_artifact",
            args,
            ClientAbilities::plain(),
            None,
            &NoAsker,
        )
        .await
    }

    /// The `tampered` receipt refusals traced for approval `id`.
    fn tampered_refusals(&self, id: &str) -> Vec<Value> {
        self.trace()
            .into_iter()
            .filter(|e| {
                e.kind == "receipt-refused"
                    && e.payload["approval"] == id
                    && e.payload["refusal"] == "tampered"
            })
            .map(|e| e.payload)
            .collect()
    }
}

/// The outcome is the refusal of a receipt the trace does not prove: `Forbidden`, naming
/// the approval and saying nothing was done.
fn assert_refused_as_tampered(outcome: &Outcome, approval: &str) {
    match outcome {
        Outcome::Refused {
            category: Category::Forbidden,
            detail,
        } => assert!(
            detail.contains(approval) && detail.contains("does not match its trace"),
            "{detail}"
        ),
        other => panic!("expected the receipt to be refused as tampered, got {other:?}"),
    }
}

/// A pending request set to `approved` in the database is not a receipt; approved by a
/// person (the positive control: the same proof check passes), the same call runs once.
#[tokio::test]
async fn a_request_approved_in_the_database_is_not_a_receipt() {
    let d = Delivery::start().await;
    let s = d.session();
    let (artifact, team) = d.prepared(&s).await;
    let id = d.ask(&s, deliver(&artifact, &team)).await;
    let far = airlock::store::now_ms() + 3_600_000;
    let changed = d
        .attacker()
        .execute(
            "UPDATE approvals SET state = 'approved', decided_by = 'mallory', decided_ms = ?2, expires_ms = ?3 WHERE id = ?1",
            rusqlite::params![id, far as i64 - 3_600_000, far as i64],
        )
        .unwrap();
    assert_eq!(changed, 1);
    let out = d.again(&s, deliver(&artifact, &team)).await;
    assert_refused_as_tampered(&out, &id);
    assert_eq!(d.sends(), 0, "a forged approval delivered");
    let refusals = d.tampered_refusals(&id);
    assert_eq!(refusals.len(), 1, "{refusals:?}");
    assert!(
        refusals[0]["detail"]
            .as_str()
            .unwrap()
            .contains("no decision"),
        "{refusals:?}"
    );
    // The row was not consumed by the refusal; the attacker's edit is still there.
    let state: String = d
        .attacker()
        .query_row("SELECT state FROM approvals WHERE id = ?1", [&id], |r| {
            r.get(0)
        })
        .unwrap();
    assert_eq!(state, "approved");
    // `approvals show` says so; a person cannot decide on it.
    let registry = d.host.registry();
    let now = airlock::store::now_ms();
    let row = registry.store().approval(&id).unwrap().unwrap();
    let why = airlock::cli::approvals::tampered(registry, &row, now).unwrap();
    assert!(
        why.as_deref().is_some_and(|w| w.contains("no decision")),
        "{why:?}"
    );
    assert!(
        airlock::cli::approvals::show_text(&row, now, why.as_deref()).starts_with("TAMPERED: ")
    );

    // A genuine request, approved by a person, runs once.
    let (artifact2, _) = d.prepared(&s).await;
    let id2 = d.ask(&s, deliver(&artifact2, &team)).await;
    d.decide(
        &id2,
        airlock::store::ApprovalDecision::Approve,
        Duration::from_secs(600),
    );
    let row2 = registry.store().approval(&id2).unwrap().unwrap();
    assert_eq!(
        airlock::cli::approvals::tampered(registry, &row2, airlock::store::now_ms()).unwrap(),
        None,
        "a genuine approval is proven"
    );
    match d.again(&s, deliver(&artifact2, &team)).await {
        Outcome::Completed(_) => {}
        other => panic!("a genuinely approved receipt must run: {other:?}"),
    }
    assert_eq!(d.sends(), 1);
}

/// An approved receipt rebound in the database to other arguments does not let those run.
#[tokio::test]
async fn an_approved_receipt_rebound_to_other_arguments_is_refused() {
    let d = Delivery::start().await;
    let s = d.session();
    let (wanted, team) = d.prepared(&s).await;
    let (other, _) = d.prepared(&s).await;
    // The call the attacker wants run is asked for, and stays pending.
    let pending = d.ask(&s, deliver(&other, &team)).await;
    // A person approves another, harmless-looking delivery.
    let approved = d.ask(&s, deliver(&wanted, &team)).await;
    d.decide(
        &approved,
        airlock::store::ApprovalDecision::Approve,
        Duration::from_secs(600),
    );
    // The attacker moves the approved receipt onto the pending call's arguments.
    let db = d.attacker();
    let digest: String = db
        .query_row(
            "SELECT args_digest FROM approvals WHERE id = ?1",
            [&pending],
            |r| r.get(0),
        )
        .unwrap();
    db.execute(
        "UPDATE approvals SET args_digest = ?2 WHERE id = ?1",
        rusqlite::params![approved, digest],
    )
    .unwrap();
    // A pending request rebound in the database cannot be approved by a person either.
    db.execute(
        "UPDATE approvals SET capability = 'list_destinations' WHERE id = ?1",
        [&pending],
    )
    .unwrap();
    let refused = airlock::cli::approvals::decide(
        d.host.registry(),
        &pending,
        airlock::store::ApprovalDecision::Approve,
        "carol",
        None,
        Duration::from_secs(600),
    )
    .unwrap_err()
    .to_string();
    assert!(
        refused.contains("does not match the trace") && refused.contains("capability"),
        "{refused}"
    );
    let out = d.again(&s, deliver(&other, &team)).await;
    assert_refused_as_tampered(&out, &approved);
    assert_eq!(d.sends(), 0, "a rebound receipt delivered other arguments");
    let refusals = d.tampered_refusals(&approved);
    assert!(
        refusals[0]["detail"]
            .as_str()
            .unwrap()
            .contains("arguments"),
        "{refusals:?}"
    );
}

/// A revoked receipt set back to approved, and an approved one whose life was lengthened
/// in the database after it ended, are both refused.
#[tokio::test]
async fn a_revived_or_lengthened_receipt_is_refused() {
    use airlock::store::ApprovalDecision::{Approve, Revoke};
    let d = Delivery::start().await;
    let s = d.session();
    let (artifact, team) = d.prepared(&s).await;
    let far = (airlock::store::now_ms() + 3_600_000) as i64;

    let revoked = d.ask(&s, deliver(&artifact, &team)).await;
    d.decide(&revoked, Approve, Duration::from_secs(600));
    d.decide(&revoked, Revoke, Duration::from_secs(600));
    d.attacker()
        .execute(
            "UPDATE approvals SET state = 'approved' WHERE id = ?1",
            [&revoked],
        )
        .unwrap();
    let out = d.again(&s, deliver(&artifact, &team)).await;
    assert_refused_as_tampered(&out, &revoked);
    assert!(
        d.tampered_refusals(&revoked)[0]["detail"]
            .as_str()
            .unwrap()
            .contains("revoked"),
        "{:?}",
        d.tampered_refusals(&revoked)
    );
    // Out of the attacker's way: the revived row is revoked again for the next case.
    d.attacker()
        .execute(
            "UPDATE approvals SET state = 'revoked' WHERE id = ?1",
            [&revoked],
        )
        .unwrap();

    let (artifact2, _) = d.prepared(&s).await;
    let short = d.ask(&s, deliver(&artifact2, &team)).await;
    d.decide(&short, Approve, Duration::from_millis(50));
    tokio::time::sleep(Duration::from_millis(120)).await;
    d.attacker()
        .execute(
            "UPDATE approvals SET expires_ms = ?2 WHERE id = ?1",
            rusqlite::params![short, far],
        )
        .unwrap();
    let out = d.again(&s, deliver(&artifact2, &team)).await;
    assert_refused_as_tampered(&out, &short);
    assert!(
        d.tampered_refusals(&short)[0]["detail"]
            .as_str()
            .unwrap()
            .contains("lived 50 ms"),
        "{:?}",
        d.tampered_refusals(&short)
    );
    assert_eq!(d.sends(), 0);
}

/// A receipt used once and set back to `approved` in the database (its intent let go of
/// it) is not a second receipt: the trace records its consumption (`receipt-consumed`),
/// so the same call made again within the receipt's life is refused and sends nothing
/// more.
#[tokio::test]
async fn a_consumed_receipt_set_back_to_approved_is_refused() {
    let d = Delivery::start().await;
    let s = d.session();
    let (artifact, team) = d.prepared(&s).await;
    let id = d.ask(&s, deliver(&artifact, &team)).await;
    d.decide(
        &id,
        airlock::store::ApprovalDecision::Approve,
        Duration::from_secs(600),
    );
    match d.again(&s, deliver(&artifact, &team)).await {
        Outcome::Completed(_) => {}
        other => panic!("a genuinely approved receipt must run: {other:?}"),
    }
    assert_eq!(d.sends(), 1);
    // The row set back, and the intent that used it let go of it (one receipt, one
    // intent: `intents.approval_id` is unique).
    let db = d.attacker();
    let changed = db
        .execute(
            "UPDATE approvals SET state = 'approved', consumed_ms = NULL WHERE id = ?1",
            [&id],
        )
        .unwrap();
    assert_eq!(changed, 1);
    db.execute(
        "UPDATE intents SET approval_id = NULL WHERE approval_id = ?1",
        [&id],
    )
    .unwrap();
    let out = d.again(&s, deliver(&artifact, &team)).await;
    assert_eq!(d.sends(), 1, "a used receipt delivered again: {out:?}");
    assert_refused_as_tampered(&out, &id);
}

/// Deleting the revocation from the trace (the delete trigger dropped first: whoever can
/// write the file can) and setting the row back to `approved` does not revive the
/// receipt: the remaining proofs verify one by one, but the trace after the request is no
/// longer whole ([`airlock::pipeline::approve::proofs_not_whole`]), so the receipt is
/// refused as tampered and nothing is sent.
#[tokio::test]
async fn a_revocation_deleted_from_the_trace_does_not_revive_the_receipt() {
    use airlock::store::ApprovalDecision::{Approve, Revoke};
    let d = Delivery::start().await;
    let s = d.session();
    let (artifact, team) = d.prepared(&s).await;
    let id = d.ask(&s, deliver(&artifact, &team)).await;
    d.decide(&id, Approve, Duration::from_secs(600));
    d.decide(&id, Revoke, Duration::from_secs(600));
    // Later events, so the revocation is not the newest one.
    let (other, _) = d.prepared(&s).await;
    let _ = d.ask(&s, deliver(&other, &team)).await;
    let db = d.attacker();
    db.execute_batch("DROP TRIGGER trace_events_no_delete;")
        .unwrap();
    let deleted = db
        .execute(
            "DELETE FROM trace_events WHERE kind = 'approval-decided' \
             AND json_extract(payload, '$.approval') = ?1 \
             AND json_extract(payload, '$.decision') = 'revoked'",
            [&id],
        )
        .unwrap();
    assert_eq!(deleted, 1);
    db.execute(
        "UPDATE approvals SET state = 'approved' WHERE id = ?1",
        [&id],
    )
    .unwrap();
    let out = d.again(&s, deliver(&artifact, &team)).await;
    assert_eq!(d.sends(), 0, "a revoked receipt delivered: {out:?}");
    assert_refused_as_tampered(&out, &id);
}
