//! Attack findings against issue 8 (policy-approved calls).
//!
//! Sections:
//! - **BUG** tests fail today: each demonstrates a real defect (see the report).
//! - **GUARD** tests pass today: each covers a guard that no other test notices (found by
//!   removing the guard and seeing every other test still pass).
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
use airlock::store::{NewEvent, SqliteStore, Store as _};
use airlock::upstream::StdioServer;
use serde_json::{Value, json};

const POLICY: &str = r#"
@id("any-profile")
permit (principal, action == Airlock::Action::"use-profile", resource);

@id("reads")
permit (principal, action == Airlock::Action::"call", resource)
when { resource.effect_class == "read" };

@id("publisher-prepares")
permit (principal, action == Airlock::Action::"call", resource)
when { context.profile == Airlock::Profile::"publisher" && resource.effect_class == "local-transformation" };

@id("publisher-delivers-with-approval")
permit (principal in Airlock::Role::"operator", action == Airlock::Action::"call", resource)
when {
    context.profile == Airlock::Profile::"publisher" &&
    resource.effect_class == "external-effect" &&
    context.approved
};

@id("no-partner-drop")
@category("outside-scope")
forbid (principal, action == Airlock::Action::"call", resource)
when { context has destination && context.destination == Airlock::Scope::"partner-drop" };
"#;

struct Delivery {
    host: Arc<Host>,
    dir: tempfile::TempDir,
}

impl Delivery {
    async fn start() -> Self {
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
                ],
                cwd: dir.path().to_path_buf(),
                env: BTreeMap::new(),
                owner: None,
                credential_scope: None,
                identity_files: vec![],
            },
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
                roles: vec!["operator".into()],
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

    fn rewrite_policy(&self, text: &str) {
        std::fs::write(self.dir.path().join("airlock.cedar"), text).unwrap();
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
        pipeline::run(&self.host, candidate, asker).await
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

/// An elicitation answer given after `before` ran (with the host at hand).
struct Answer<F: Fn() + Send + Sync> {
    before: F,
    answer: ElicitAnswer,
    asked: AtomicUsize,
}

impl<F: Fn() + Send + Sync> Asker for Answer<F> {
    fn elicit<'a>(
        &'a self,
        _message: &'a str,
        _timeout: Duration,
    ) -> Pin<Box<dyn Future<Output = ElicitAnswer> + Send + 'a>> {
        self.asked.fetch_add(1, Ordering::SeqCst);
        (self.before)();
        Box::pin(async move { self.answer.clone() })
    }
}

// ---------------------------------------------------------------------------------------
// BUG 1: an elicitation receipt is not bound to the policy in force when it is used.
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
async fn bug_elicitation_receipt_survives_a_policy_change_during_the_question() {
    let d = Delivery::start().await;
    let s = d.session();
    let (artifact, team) = d.prepared(&s).await;
    let old = d.host.policy().current().digest().to_string();
    let host = d.host.clone();
    let dir = d.dir.path().to_path_buf();
    let asker = Answer {
        before: move || {
            // While the person reads the form, the security team ships a new policy
            // version (here: same rules, new text; any policy that still permits an
            // approved delivery behaves the same).
            std::fs::write(
                dir.join("airlock.cedar"),
                format!("{POLICY}\n// revised while a person was being asked\n"),
            )
            .unwrap();
            assert!(host.reload_policy().unwrap(), "the new policy loaded");
        },
        answer: ElicitAnswer::Accept(json!({"approve": true})),
        asked: AtomicUsize::new(0),
    };
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
// BUG 2: group commit acknowledges trace events that were never committed.
//
// `GroupCommit::take_or_done` decides "my batch was handled by someone else" from
// `done >= ticket` and then looks for a failure covering the ticket in a list capped at
// 64 entries. When more than 64 later batches fail before a waiting caller gets the
// database lock, its failure has been evicted and the caller gets `Ok(())` for events
// that are not in the database. Here every insert fails (a trigger stands for a full
// disk / I/O error), so every `Ok` is an acknowledged event that does not exist.
// ---------------------------------------------------------------------------------------
#[test]
fn bug_group_commit_acknowledges_events_it_never_wrote() {
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
// GUARD tests: pass today; no other test fails when these guards are removed.
// ---------------------------------------------------------------------------------------

/// MRTR: a decline (or cancel, or `approve: false`) on the retry delivers nothing, and the
/// same requestState cannot be turned into an accept afterwards.
#[tokio::test]
async fn guard_mrtr_decline_delivers_nothing_and_cannot_be_flipped_to_accept() {
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
async fn guard_elicitation_accept_without_approve_true_delivers_nothing() {
    let d = Delivery::start().await;
    let s = d.session();
    let (artifact, team) = d.prepared(&s).await;
    for content in [
        json!({"approve": false}),
        json!({"approve": "true"}),
        json!({}),
        json!(null),
    ] {
        let asker = Answer {
            before: || {},
            answer: ElicitAnswer::Accept(content.clone()),
            asked: AtomicUsize::new(0),
        };
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
async fn guard_recheck_uses_the_current_policy_for_a_call_that_holds_a_receipt() {
    let d = Delivery::start().await;
    let s = d.session();
    let (artifact, team) = d.prepared(&s).await;
    let host = d.host.clone();
    let dir = d.dir.path().to_path_buf();
    let asker = Answer {
        before: move || {
            std::fs::write(
                dir.join("airlock.cedar"),
                format!(
                    "{POLICY}\n@id(\"no-team\")\nforbid (principal, action == Airlock::Action::\"call\", resource) when {{ context has destination && context.destination == Airlock::Scope::\"team-reports\" }};\n"
                ),
            )
            .unwrap();
            assert!(host.reload_policy().unwrap());
        },
        answer: ElicitAnswer::Accept(json!({"approve": true})),
        asked: AtomicUsize::new(0),
    };
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
                category: Category::PolicyNoLongerPermits,
                ..
            }
        ),
        "{outcome:?}"
    );
    assert_eq!(d.sends(), 0);
}

/// Hostile `requestState` values fail closed and never panic the host.
#[tokio::test]
async fn guard_hostile_request_states_fail_closed() {
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

/// Deeply nested or very long Cedar policies are refused or accepted, never a crash (a hot
/// reload of such a file must not take the host down).
#[test]
fn guard_hostile_policy_texts_do_not_crash() {
    let texts = [
        format!(
            "permit (principal, action, resource) when {{ {}true{} }};",
            "(".repeat(20_000),
            ")".repeat(20_000)
        ),
        format!(
            "permit (principal, action, resource) when {{ true{} }};",
            " || true".repeat(50_000)
        ),
        format!(
            "permit (principal, action, resource) when {{ {}true }};",
            "!".repeat(50_000)
        ),
        format!(
            "permit (principal, action, resource) when {{ {}1{} == 1 }};",
            "[".repeat(20_000),
            "]".repeat(20_000)
        ),
    ];
    for (i, text) in texts.iter().enumerate() {
        let r =
            airlock::policy::Policy::from_texts(&[(format!("hostile-{i}.cedar"), text.clone())]);
        eprintln!(
            "case {i}: {}",
            match &r {
                Ok(_) => "accepted".to_string(),
                Err(e) => format!("{e:#}").chars().take(200).collect(),
            }
        );
    }
}
