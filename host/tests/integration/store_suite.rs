//! The store suite: the [`Store`] trait's semantics, each test run against SQLite **and**
//! against a real PostgreSQL (started by the tests, see `common::pg`). Test names end in
//! `::sqlite` or `::postgres`; `cargo test -p airlock --test integration store_suite::`
//! runs both. Tampering goes through each database directly, as an attacker holding the
//! database (but not the key) would.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use airlock::store::{
    ApprovalDecision, ApprovalMode, ApprovalState, Approvals as _, AttemptState, Connections as _,
    ConsumeAs, Consumption, ContractReviews as _, Hosts as _, IntentFilter, IntentHandle,
    IntentState, MappingState, Mappings as _, NewApproval, NewEvent, NewIntent, NewMappingRevision,
    PostgresStore, ReceiptBinding, ReceiptRefusal, Resolution, ResolutionMethod, SqliteStore,
    Store, Target, Trace as _, TraceKey, open,
};
use serde_json::json;

use crate::common::pg;

/// The key every store of a test is opened with (two hosts share it).
const KEY: &str = "0123456789abcdef0123456789abcdef-store-suite";

fn key() -> TraceKey {
    TraceKey::from_secret("store-suite", KEY).unwrap()
}

/// One backend's database for one test, and how to open more stores on it.
pub enum Db {
    Sqlite(tempfile::TempDir),
    Postgres(String),
}

impl Db {
    fn new(backend: &str) -> Self {
        match backend {
            "sqlite" => Db::Sqlite(tempfile::tempdir().unwrap()),
            "postgres" => Db::Postgres(pg::database()),
            other => panic!("no backend {other}"),
        }
    }

    /// Another store on the same database (another process or host would hold one),
    /// opened as every command and host opens one ([`airlock::store::open`]).
    fn open(&self) -> Arc<dyn Store> {
        match self {
            Db::Sqlite(dir) => open(&Target::Sqlite, Some(dir.path()), Some(key())).unwrap(),
            Db::Postgres(target) => {
                open(&Target::Postgres(target.clone()), None, Some(key())).unwrap()
            }
        }
    }

    /// Runs `sql` on the database directly, with the append-only guards switched off.
    fn tamper(&self, sql: &str) {
        match self {
            Db::Sqlite(dir) => {
                let conn = rusqlite::Connection::open(dir.path().join("airlock.db")).unwrap();
                conn.execute_batch(
                    "DROP TRIGGER IF EXISTS trace_events_no_update; \
                     DROP TRIGGER IF EXISTS trace_events_no_delete;",
                )
                .unwrap();
                conn.execute_batch(sql).unwrap();
            }
            Db::Postgres(target) => pg::exec(
                target,
                &format!("ALTER TABLE trace_events DISABLE TRIGGER USER; {sql}"),
            )
            .unwrap(),
        }
    }

    /// Runs `sql` on the database directly with every guard in place: the database's
    /// refusal, if it refuses.
    fn try_exec(&self, sql: &str) -> Result<(), String> {
        match self {
            Db::Sqlite(dir) => rusqlite::Connection::open(dir.path().join("airlock.db"))
                .unwrap()
                .execute_batch(sql)
                .map_err(|e| e.to_string()),
            Db::Postgres(target) => pg::exec(target, sql),
        }
    }

    /// `SELECT count(*) FROM {table}`.
    fn count(&self, table: &str) -> i64 {
        let sql = format!("SELECT count(*) FROM {table}");
        match self {
            Db::Sqlite(dir) => rusqlite::Connection::open(dir.path().join("airlock.db"))
                .unwrap()
                .query_row(&sql, [], |r| r.get(0))
                .unwrap(),
            Db::Postgres(target) => pg::query(target, &sql)[0][0]
                .as_deref()
                .unwrap()
                .parse()
                .unwrap(),
        }
    }
}

/// Each test body, once per backend: `name::sqlite` and `name::postgres`.
macro_rules! both {
    ($(fn $name:ident($db:ident, $store:ident) $body:block)*) => {$(
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            #[allow(unused_variables)]
            fn run(backend: &str) {
                let $db = Db::new(backend);
                #[allow(unused_variables)]
                let $store = $db.open();
                $body
            }
            #[test]
            fn sqlite() {
                run("sqlite")
            }
            #[test]
            fn postgres() {
                run("postgres")
            }
        }
    )*};
}

fn binding() -> ReceiptBinding {
    ReceiptBinding {
        requester: "alice".into(),
        session: "ses_1".into(),
        capability: "deliver_artifact".into(),
        mapping: "outbox-delivery".into(),
        mapping_revision: 2,
        snapshot_digest: "a".repeat(64),
        policy_digest: "b".repeat(64),
        args_digest: "c".repeat(64),
        artifact_digest: Some("d".repeat(64)),
    }
}

fn request(mode: ApprovalMode, ttl_ms: u64) -> NewApproval {
    NewApproval {
        binding: binding(),
        profile: "publisher".into(),
        mode,
        summary: "Approve `deliver_artifact`".into(),
        ttl_ms,
    }
}

fn intent(n: usize) -> NewIntent {
    NewIntent {
        compensates: None,
        id: format!("int_{n}"),
        idempotency_key: format!("idk_{n}"),
        call_id: format!("call_{n}"),
        requester: "alice".into(),
        session: "ses_1".into(),
        capability: "deliver_artifact".into(),
        mapping: "outbox-delivery".into(),
        mapping_revision: 2,
        args_digest: "c".repeat(64),
        effect_class: "external-effect".into(),
    }
}

fn new_mapping(name: &str, state: MappingState, connection_id: &str) -> NewMappingRevision {
    NewMappingRevision {
        name: name.into(),
        manifest_digest: "m".repeat(64),
        component_sha256: "c".repeat(64),
        connection_id: connection_id.into(),
        config_revision: 1,
        snapshot_digest: None,
        pins: json!({"tools": {"b": "2", "a": "1"}}),
        state,
        reviewer: None,
        reason: "recorded".into(),
        manifest_text: Some("name = \"x\"\n".into()),
    }
}

fn approved(store: &dyn Store) -> String {
    let a = store
        .create_approval(&request(ApprovalMode::OutOfBand, 60_000), vec![])
        .unwrap();
    store
        .decide_approval(
            &a.id,
            ApprovalDecision::Approve,
            "bob",
            None,
            60_000,
            vec![],
        )
        .unwrap();
    a.id
}

/// A contract approval of `package` with digest `digest`.
fn contract(package: &str, digest: &str) -> airlock::store::NewContractApproval {
    airlock::store::NewContractApproval {
        package: package.into(),
        digest: digest.into(),
        reviewer: "alice".into(),
        reason: "reviewed".into(),
        files: r#"{"contract.toml":"format = 1"}"#.into(),
    }
}

/// Whether `sql` fails on the database directly (the store's own guards, not the trace's).
fn refused_directly(db: &Db, sql: &str) -> bool {
    match db {
        Db::Sqlite(dir) => rusqlite::Connection::open(dir.path().join("airlock.db"))
            .unwrap()
            .execute_batch(sql)
            .is_err(),
        Db::Postgres(target) => pg::exec(target, sql).is_err(),
    }
}

both! {
    fn a_contract_is_approved_once_per_name_proven_by_its_event_and_marked_erroneous_once(db, store) {
        use airlock::store::ContractState;
        use airlock::store::contracts::disproof;
        let p = "example:workspace@1.0.0";
        assert_eq!(store.contract_review(p).unwrap(), None);
        let a = store.approve_contract(&contract(p, "aa")).unwrap();
        assert_eq!((a.state, a.digest.as_str()), (ContractState::Approved, "aa"));
        let proofs = store.contract_proofs(p).unwrap();
        assert_eq!(proofs.len(), 1);
        assert_eq!(disproof(&a, &proofs), None);
        // The same approval again writes nothing; another digest under the name is refused.
        assert_eq!(store.approve_contract(&contract(p, "aa")).unwrap(), a);
        assert_eq!(store.contract_proofs(p).unwrap().len(), 1);
        let err = format!("{:#}", store.approve_contract(&contract(p, "bb")).unwrap_err());
        assert!(err.contains("aa") && err.contains("bb"), "{err}");
        // Another host sees it.
        assert_eq!(db.open().contract_review(p).unwrap(), Some(a.clone()));
        assert_eq!(store.contract_reviews().unwrap(), std::slice::from_ref(&a));
        // The digest and files never change, and a review is never deleted.
        for sql in [
            "UPDATE contract_reviews SET digest = 'cc'",
            "UPDATE contract_reviews SET files = '{}'",
            "UPDATE contract_reviews SET package = 'example:other@1.0.0'",
            "UPDATE contract_reviews SET created_ms = 0",
            "UPDATE contract_reviews SET state = 'bogus'",
            "DELETE FROM contract_reviews",
        ] {
            assert!(refused_directly(&db, sql), "{sql}");
        }
        // Only contract events prove a review: another event about the package is not one.
        store
            .append_trace("mapping-revision", p, &json!({"package": p, "digest": "zz"}))
            .unwrap();
        assert_eq!(disproof(&a, &store.contract_proofs(p).unwrap()), None);
        let marked = store.mark_contract_erroneous(p, "bob", "wrong class").unwrap().unwrap();
        assert_eq!(marked.state, ContractState::Erroneous);
        assert_eq!(store.mark_contract_erroneous(p, "bob", "again").unwrap(), None);
        let proofs = store.contract_proofs(p).unwrap();
        assert_eq!(proofs.len(), 2);
        assert_eq!(disproof(&marked, &proofs), None);
        // A row set back to approved without the key is not proven by the trace.
        db.tamper("UPDATE contract_reviews SET state = 'approved'");
        let forged = store.contract_review(p).unwrap().unwrap();
        assert_eq!(forged.state, ContractState::Approved);
        let why = disproof(&forged, &store.contract_proofs(p).unwrap()).unwrap();
        assert!(why.contains("erroneous"), "{why}");
        assert!(store.mark_contract_erroneous("example:none@1.0.0", "bob", "x").is_err());
    }

    fn what_waits_counts_open_approvals_and_intents_only(db, store) {
        use airlock::store::{Waiting, now_ms};
        assert_eq!(store.waiting(now_ms()).unwrap(), Waiting::default());
        let first = store.create_approval(&request(ApprovalMode::OutOfBand, 60_000), vec![]).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(2));
        store.create_approval(&request(ApprovalMode::Elicitation, 60_000), vec![]).unwrap();
        let denied = store.create_approval(&request(ApprovalMode::OutOfBand, 60_000), vec![]).unwrap();
        store.decide_approval(&denied.id, ApprovalDecision::Deny, "bob", None, 60_000, vec![]).unwrap();
        // Expires long before the moment counted below, though still stored as pending.
        store.create_approval(&request(ApprovalMode::OutOfBand, 1), vec![]).unwrap();
        approved(&*store);
        for n in 1..=5 {
            store.create_intent(&intent(n), vec![]).unwrap();
        }
        store.set_intent_state("int_2", IntentState::Unknown, vec![]).unwrap();
        store.set_intent_state("int_3", IntentState::Completed, vec![]).unwrap();
        store.set_intent_state("int_4", IntentState::Failed, vec![]).unwrap();
        let at = now_ms() + 30_000;
        let expected = Waiting {
            approvals_pending: 2,
            oldest_pending_ms: Some(first.created_ms),
            intents_prepared: 2,
            intents_unknown: 1,
        };
        assert_eq!(store.waiting(at).unwrap(), expected);
        // Another process counts the same.
        assert_eq!(db.open().waiting(at).unwrap(), expected);
        // Past every expiry nothing is pending; the intents still wait.
        let later = store.waiting(at + 120_000).unwrap();
        assert_eq!((later.approvals_pending, later.oldest_pending_ms), (0, None));
        assert_eq!((later.intents_prepared, later.intents_unknown), (2, 1));
    }

    fn a_connections_state_is_its_newest_genuine_state_event(db, store) {
        assert!(store.connection_state("notes").unwrap().is_none());
        store.append_trace("connection-state", "notes", &json!({"from": null, "to": "ready"})).unwrap();
        store.append_trace("connection-state", "web", &json!({"from": null, "to": "ready"})).unwrap();
        store.append_trace("connection-restarted", "notes", &json!({})).unwrap();
        let stalled = store.append_trace("connection-state", "notes", &json!({"from": "ready", "to": "stalled", "reason": "no answer in 5 s"})).unwrap();
        let newest = store.connection_state("notes").unwrap().unwrap();
        assert_eq!((newest.seq, newest.payload["to"].as_str()), (stalled.seq, Some("stalled")));
        assert_eq!(store.connection_state("web").unwrap().unwrap().payload["to"], "ready");
        assert_eq!(db.open().connection_state("notes").unwrap().unwrap().seq, stalled.seq);
        assert!(store.connection_state("no-such").unwrap().is_none());
        // A row written without the key proves nothing: the newest is not taken from it.
        db.tamper(
            "INSERT INTO trace_events (seq, at_ms, kind, subject, payload, prev_hash, hash, key_id) \
             SELECT max(seq) + 1, 0, 'connection-state', 'notes', '{\"to\":\"ready\"}', 'x', 'y', NULL FROM trace_events",
        );
        let seen = store.connection_state("notes").unwrap().unwrap();
        assert_eq!(seen.seq, stalled.seq, "the forged newest row is passed over");
    }

    fn open_gives_the_targets_backend_and_a_second_open_the_same_database(db, store) {
        assert_eq!(store.is_shared(), matches!(db, Db::Postgres(_)));
        assert_eq!(store.trace_key().id(), key().id());
        let event = store.append_trace("test", "s", &json!({"n": 1})).unwrap();
        let other = db.open();
        let seen = other.trace(event.seq - 1, 10).unwrap();
        assert_eq!(seen.len(), 1, "one database");
        assert_eq!(seen[0].hash, event.hash);
    }

    fn approval_and_intent_proofs_are_the_macd_events_naming_them_and_nothing_else(db, store) {
        let requested = NewEvent::new("approval-requested", "call_1", json!({"binding": binding(), "ttl_ms": 60_000}));
        let a = store.create_approval(&request(ApprovalMode::OutOfBand, 60_000), vec![requested]).unwrap();
        let decided = NewEvent::new("approval-decided", a.id.clone(), json!({"approval": a.id, "decision": "approved", "ttl_ms": 60_000}));
        store.decide_approval(&a.id, ApprovalDecision::Approve, "bob", None, 60_000, vec![decided]).unwrap();
        store.append_trace("receipt-consumed", "call_1", &json!({"approval": a.id})).unwrap();
        // Noise: other kinds naming the approval, and another approval's events.
        store.append_trace("receipt-refused", "call_2", &json!({"approval": a.id})).unwrap();
        let other = store.create_approval(&request(ApprovalMode::OutOfBand, 60_000), vec![NewEvent::new("approval-requested", "call_3", json!({}))]).unwrap();
        let created = NewEvent::new("intent-created", "call_1", json!({"intent": "int_1", "capability": "deliver_artifact"}));
        store.create_intent(&intent(1), vec![created]).unwrap();
        store.append_trace("intent-resolved", "call_1", &json!({"intent": "int_1"})).unwrap();

        let proofs = store.approval_proofs(&a.id).unwrap();
        let kinds: Vec<&str> = proofs.iter().map(|e| e.kind.as_str()).collect();
        assert_eq!(kinds, ["approval-requested", "approval-decided", "receipt-consumed"]);
        assert_eq!(proofs[0].payload["approval"], a.id.as_str(), "the store names the approval in its request event");
        assert_eq!(proofs[0].payload["binding"]["args_digest"], "c".repeat(64));
        assert_eq!(store.approval_proofs(&other.id).unwrap().len(), 1);
        assert!(store.approval_proofs("apr_000000000000000000000000").unwrap().is_empty());
        let intents = store.intent_proofs("int_1").unwrap();
        assert_eq!(intents.len(), 1);
        assert_eq!(intents[0].kind, "intent-created");
        assert!(store.intent_proofs("int_2").unwrap().is_empty());

        // An event whose bytes were edited in the database no longer proves anything.
        let seq = proofs[1].seq;
        db.tamper(&format!(
            "UPDATE trace_events SET payload = replace(payload, '\"approved\"', '\"approved\" ') WHERE seq = {seq}"
        ));
        let kinds: Vec<String> = store.approval_proofs(&a.id).unwrap().into_iter().map(|e| e.kind).collect();
        assert_eq!(kinds, ["approval-requested", "receipt-consumed"], "the edited decision is passed over");
    }

    fn an_intents_state_changes_are_its_proofs_and_the_trace_lists_what_it_leaves_open(db, store) {
        let created = |n: usize, mapping: &str, marked: bool| {
            let mut p = json!({"intent": format!("int_{n}"), "mapping": mapping});
            if marked {
                p["intent_state"] = json!("prepared");
            }
            let mut new = intent(n);
            new.mapping = mapping.into();
            store.create_intent(&new, vec![NewEvent::new("intent-created", format!("call_{n}"), p)]).unwrap();
        };
        let outcome = |n: usize, state: IntentState| {
            NewEvent::new("call-outcome", format!("call_{n}"), json!({"intent": format!("int_{n}"), "intent_state": state}))
        };
        created(1, "m", true);
        created(2, "m", true);
        created(3, "other", true);
        created(4, "m", false); // written before schema 9
        created(5, "m", true);
        store.finish_intent("int_1", IntentState::Completed, vec![outcome(1, IntentState::Completed)], vec![], vec![]).unwrap();
        store.finish_intent("int_2", IntentState::Unknown, vec![outcome(2, IntentState::Unknown)], vec![], vec![]).unwrap();
        let resolved = NewEvent::new("intent-resolved", "call_5", json!({"intent": "int_5", "state": "failed", "intent_state": "failed"}));
        store.finish_intent("int_5", IntentState::Unknown, vec![outcome(5, IntentState::Unknown)], vec![], vec![]).unwrap();
        store.resolve_intent("int_5", &Resolution { state: IntentState::Failed, method: ResolutionMethod::Person, by: "bob".into(), evidence: json!({}), handles: vec![] }, vec![resolved]).unwrap();
        // Noise: a read's outcome names an intent but changes no state.
        store.append_trace("call-outcome", "call_1", &json!({"intent": "int_1", "outcome": "refused"})).unwrap();

        let kinds = |id: &str| -> Vec<(String, serde_json::Value)> {
            store.intent_proofs(id).unwrap().into_iter().map(|e| (e.kind, e.payload["intent_state"].clone())).collect()
        };
        assert_eq!(kinds("int_1"), [("intent-created".to_string(), json!("prepared")), ("call-outcome".to_string(), json!("completed"))]);
        assert_eq!(kinds("int_5").len(), 3, "{:?}", kinds("int_5"));
        // Open in the trace and in their rows (int_2 unknown, int_3 prepared): not listed.
        assert!(store.intents_open_in_trace_only("m", 10).unwrap().is_empty());
        assert!(store.intents_open_in_trace_only("other", 10).unwrap().is_empty());

        // Closed or deleted by hand while the trace leaves them open: listed, by mapping.
        db.tamper("UPDATE intents SET state = 'completed' WHERE id = 'int_2'");
        db.tamper("DELETE FROM intent_attempts WHERE intent_id = 'int_3'; DELETE FROM intents WHERE id = 'int_3'");
        assert_eq!(store.intent("int_2").unwrap().unwrap().state, IntentState::Completed);
        assert_eq!(store.intents_open_in_trace_only("m", 10).unwrap(), ["int_2"]);
        assert_eq!(store.intents_open_in_trace_only("other", 10).unwrap(), ["int_3"]);
        assert!(store.intents_open_in_trace_only("m", 0).unwrap().is_empty());
        // A closed row the trace closes too (int_1, int_5), or a legacy one (int_4): not.
        // A state event whose bytes were edited proves nothing.
        let seq = store.intent_proofs("int_1").unwrap()[1].seq;
        db.tamper(&format!("UPDATE trace_events SET payload = replace(payload, 'completed', 'failed') WHERE seq = {seq}"));
        assert_eq!(kinds("int_1").len(), 1, "the edited outcome is passed over");
    }

    fn connection_ids_are_stable_and_revisions_follow_digests(db, store) {
        let a = store.connection_revision("notes", "d1", &json!({"command": "x"})).unwrap();
        assert!(a.created && a.revision == 1 && a.connection_id.starts_with("conn-"));
        let again = store.connection_revision("notes", "d1", &json!({"command": "y"})).unwrap();
        assert_eq!((again.revision, again.created, &again.connection_id), (1, false, &a.connection_id));
        let b = store.connection_revision("notes", "d2", &json!({"command": "z"})).unwrap();
        assert_eq!((b.revision, b.created), (2, true));
        let other = store.connection_revision("files", "d1", &json!({})).unwrap();
        assert_ne!(other.connection_id, a.connection_id);
        let record = store.connection("notes").unwrap().unwrap();
        assert_eq!((record.revision, record.config), (2, json!({"command": "z"})));
        let names: Vec<String> = store.connections().unwrap().into_iter().map(|c| c.name).collect();
        assert_eq!(names, ["files", "notes"]);
        assert!(store.connection("nope").unwrap().is_none());
        assert!(store.connection_revision("", "d", &json!({})).is_err());
        assert!(store.connection_revision("n", "", &json!({})).is_err());
    }

    fn snapshots_are_immutable_stored_once_and_observed_each_time(db, store) {
        let c = store.connection_revision("notes", "d1", &json!({})).unwrap();
        let digest = "ab".repeat(32);
        let body = json!({"tools": [{"name": "t", "description": "é \"q\""}]});
        let first = store.put_snapshot(&digest.to_uppercase(), &c.connection_id, 1, &body).unwrap();
        assert!(first.new);
        assert_eq!(first.digest, digest);
        let second = store.put_snapshot(&digest, &c.connection_id, 1, &body).unwrap();
        assert!(!second.new);
        let got = store.snapshot(&digest[..8]).unwrap().unwrap();
        assert_eq!((got.body, got.observations), (body.clone(), 2));
        let err = format!("{:#}", store.put_snapshot(&digest, &c.connection_id, 1, &json!({})).unwrap_err());
        assert!(err.contains("immutable"), "{err}");
        let err = format!("{:#}", store.put_snapshot(&"ef".repeat(32), &c.connection_id, 9, &body).unwrap_err());
        assert!(err.contains("no configuration revision 9"), "{err}");
        assert!(store.put_snapshot("not hex", &c.connection_id, 1, &body).is_err());
        // A second snapshot sharing the first 8 characters makes that prefix ambiguous.
        let near = format!("{}{}", &digest[..8], "0".repeat(56));
        store.put_snapshot(&near, &c.connection_id, 1, &json!({"v": 2})).unwrap();
        let err = format!("{:#}", store.snapshot(&digest[..8]).unwrap_err());
        assert!(err.contains("matches 2 snapshots"), "{err}");
        assert!(format!("{:#}", store.snapshot("abab").unwrap_err()).contains("too short"));
        assert!(store.snapshot("%").is_err(), "a LIKE/GLOB metacharacter is refused");
        assert!(store.snapshot(&"f".repeat(64)).unwrap().is_none());
        assert_eq!(store.latest_snapshot(&c.connection_id).unwrap().unwrap().digest, near);
        let listed: Vec<String> = store.snapshots(Some(&c.connection_id)).unwrap().into_iter().map(|s| s.digest).collect();
        assert_eq!(listed, [near.clone(), digest.clone()]);
        assert_eq!(store.snapshots(None).unwrap().len(), 2);
        assert!(store.snapshots(Some("conn-none")).unwrap().is_empty());
    }

    fn a_new_mapping_revision_makes_the_previous_historical_and_state_changes_are_compare_and_set(db, store) {
        let c = store.connection_revision("notes", "d1", &json!({})).unwrap();
        let one = store.add_mapping_revision(&new_mapping("m", MappingState::Active, &c.connection_id)).unwrap();
        assert_eq!(one.revision, 1);
        assert_eq!(one.pins, json!({"tools": {"a": "1", "b": "2"}}));
        let two = store
            .add_mapping_revision_traced(
                &new_mapping("m", MappingState::Candidate, &c.connection_id),
                vec![NewEvent::new("mapping-revision", "m", json!({"state": "candidate"}))],
            )
            .unwrap();
        assert_eq!(two.revision, 2);
        let revisions = store.mapping_revisions("m").unwrap();
        assert_eq!(revisions[0].state, MappingState::Historical);
        assert_eq!(revisions[0].superseded_while_serving(), Some(MappingState::Active));
        assert_eq!(store.mapping("m").unwrap().unwrap(), two);
        assert_eq!(store.mappings().unwrap().len(), 1);
        let events = store.trace(0, 10).unwrap();
        assert_eq!(events[0].payload, json!({"state": "candidate", "revision": 2}));
        // Compare-and-set: the wrong expected state changes nothing.
        assert!(store.set_mapping_state("m", MappingState::Active, MappingState::Retiring, "x").unwrap().is_none());
        let err = format!("{:#}", store.set_mapping_state("m", MappingState::Historical, MappingState::Active, "x").unwrap_err());
        assert!(err.contains("cannot become"), "{err}");
        assert!(store.set_mapping_state("nope", MappingState::Candidate, MappingState::FixtureTested, "x").is_err());
        let moved = store
            .set_mapping_state_traced(
                "m",
                MappingState::Candidate,
                MappingState::FixtureTested,
                "tested",
                vec![NewEvent::new("mapping-state-changed", "m", json!({"to": "fixture-tested"}))],
            )
            .unwrap()
            .unwrap();
        assert_eq!((moved.state, moved.reason.as_str()), (MappingState::FixtureTested, "tested"));
        assert_eq!(store.mapping("m").unwrap().unwrap().state, MappingState::FixtureTested);
        let proofs = store.mapping_proofs("m").unwrap();
        assert_eq!(proofs.len(), 2);
        assert_eq!(proofs[1].payload["revision"], 2);
        assert!(store.mapping_proofs("other").unwrap().is_empty());
        assert!(store.verify_trace().unwrap().first_bad.is_none());
        // A forged proof (edited without the key) proves nothing.
        db.tamper("UPDATE trace_events SET payload = '{\"revision\":2,\"to\":\"active\"}' WHERE seq = 2");
        assert_eq!(store.mapping_proofs("m").unwrap().len(), 1);
    }

    fn the_trace_is_one_verified_chain_and_each_tampering_is_named(db, store) {
        let hostile = ["quote\" back\\slash", "unicode é 🦀 \u{2028}", "ctl \n\t\u{1f}", "'; DROP TABLE trace_events; --"];
        for (i, text) in hostile.iter().enumerate() {
            let e = store.append_trace("test", text, &json!({"text": text, "n": i, "z": null})).unwrap();
            assert_eq!(e.seq, i as i64 + 1);
            assert_eq!(e.subject, *text);
        }
        let events = store.trace(0, 100).unwrap();
        assert_eq!(events.len(), 4);
        assert_eq!(events[3].payload["text"], hostile[3]);
        assert_eq!(events[1].prev_hash, events[0].hash);
        assert_eq!(store.trace(2, 1).unwrap()[0].seq, 3);
        let v = store.verify_trace().unwrap();
        assert_eq!((v.events, v.first_bad.clone()), (4, None), "{v:?}");
        let checkpoint = store.trace_checkpoint().unwrap();
        assert_eq!(checkpoint.seq, 4);
        assert!(store.verify_trace_against(&[(1, checkpoint.clone())]).unwrap().first_bad.is_none());
        // The same JSON with a duplicated key: the stored bytes changed, so the MAC fails.
        db.tamper("UPDATE trace_events SET payload = '{\"n\":1,\"n\":1,\"text\":\"unicode é 🦀 \u{2028}\",\"z\":null}' WHERE seq = 2");
        let (seq, why) = store.verify_trace().unwrap().first_bad.unwrap();
        assert_eq!(seq, 2, "{why}");
        assert!(why.contains("altered"), "{why}");
    }

    fn deleted_newest_events_and_a_deleted_trace_are_caught_by_a_checkpoint(db, store) {
        store.append_events((0..5).map(|i| NewEvent::new("test", "s", json!({"i": i}))).collect()).unwrap();
        let checkpoint = store.trace_checkpoint().unwrap();
        db.tamper("DELETE FROM trace_events WHERE seq > 3");
        assert!(store.verify_trace().unwrap().first_bad.is_none(), "without a checkpoint a shortened trace looks intact");
        let (seq, why) = store.verify_trace_against(&[(1, checkpoint.clone())]).unwrap().first_bad.unwrap();
        assert_eq!(seq, 4);
        assert!(why.contains("events 4..=5 are missing"), "{why}");
        db.tamper("DELETE FROM trace_events");
        let (_, why) = store.verify_trace_against(&[(1, checkpoint)]).unwrap().first_bad.unwrap();
        assert!(why.contains("whole trace is missing"), "{why}");
    }

    fn the_trace_refuses_edits_and_deletes_through_the_database(db, store) {
        store.append_trace("test", "s", &json!({})).unwrap();
        let refused = match &db {
            Db::Sqlite(dir) => {
                let conn = rusqlite::Connection::open(dir.path().join("airlock.db")).unwrap();
                ["UPDATE trace_events SET kind = 'x'", "DELETE FROM trace_events"]
                    .iter()
                    .map(|sql| conn.execute_batch(sql).unwrap_err().to_string())
                    .collect::<Vec<_>>()
            }
            Db::Postgres(target) => ["UPDATE trace_events SET kind = 'x'", "DELETE FROM trace_events", "TRUNCATE trace_events"]
                .iter()
                .map(|sql| pg::exec(target, sql).unwrap_err())
                .collect(),
        };
        for err in refused {
            assert!(err.contains("append-only"), "{err}");
        }
        assert_eq!(db.count("trace_events"), 1);
    }

    fn concurrent_appenders_on_separate_stores_make_one_chain(db, store) {
        std::thread::scope(|scope| {
            for t in 0..4 {
                let other = db.open();
                scope.spawn(move || {
                    for i in 0..25 {
                        let n = 1 + (t * 25 + i) % 11;
                        other
                            .append_events((0..n).map(|k| NewEvent::new("test", format!("t{t}"), json!({"i": i, "k": k}))).collect())
                            .unwrap();
                    }
                });
            }
        });
        let expected: usize = (0..4).flat_map(|t| (0..25).map(move |i| 1 + (t * 25 + i) % 11)).sum();
        let v = store.verify_trace().unwrap();
        assert_eq!((v.events as usize, v.first_bad), (expected, None));
    }

    fn an_event_deleted_from_the_middle_of_the_trace_leaves_a_counted_gap(db, store) {
        for i in 0..6 {
            store.append_trace("test", "s", &json!({"i": i})).unwrap();
        }
        assert_eq!(store.trace_missing_from(1).unwrap(), 0);
        assert_eq!(store.trace_missing_from(99).unwrap(), 0, "past the head");
        db.tamper("DELETE FROM trace_events WHERE seq IN (3, 4)");
        assert_eq!(store.trace_missing_from(1).unwrap(), 2);
        assert_eq!(store.trace_missing_from(3).unwrap(), 2);
        assert_eq!(store.trace_missing_from(5).unwrap(), 0, "after the gap");
    }

    fn concurrent_appenders_on_one_store_each_commit_their_own_events_once(db, store) {
        // One store, 8 threads: their batches share transactions (group commit); every
        // event lands exactly once, each thread's in its own order, and the chain holds.
        let _ = &db;
        std::thread::scope(|scope| {
            for t in 0..8 {
                let store = &store;
                scope.spawn(move || {
                    for i in 0..40 {
                        store
                            .append_events(vec![
                                NewEvent::new("test", format!("t{t}"), json!({"i": i, "k": 0})),
                                NewEvent::new("test", format!("t{t}"), json!({"i": i, "k": 1})),
                            ])
                            .unwrap();
                    }
                });
            }
        });
        let events = store.trace(0, 10_000).unwrap();
        for t in 0..8 {
            let mine: Vec<(i64, i64)> = events
                .iter()
                .filter(|e| e.subject == format!("t{t}"))
                .map(|e| (e.payload["i"].as_i64().unwrap(), e.payload["k"].as_i64().unwrap()))
                .collect();
            let expected: Vec<(i64, i64)> = (0..40).flat_map(|i| [(i, 0), (i, 1)]).collect();
            assert_eq!(mine, expected, "thread {t}");
        }
        let v = store.verify_trace().unwrap();
        assert_eq!((v.events, v.first_bad), (640, None));
    }

    fn thirty_two_concurrent_consumers_of_one_receipt_leave_one_intent(db, store) {
        let id = approved(&*store);
        let won = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for n in 0..32 {
                let (id, won) = (&id, &won);
                // Each consumer on a store of its own, as separate processes would be.
                let s = db.open();
                scope.spawn(move || {
                    match s.consume_receipt(id, &binding(), ConsumeAs::Approved, &intent(n), vec![NewEvent::new("receipt-consumed", "call", json!({"n": n}))]).unwrap() {
                        Consumption::Consumed(..) => {
                            won.fetch_add(1, Ordering::SeqCst);
                        }
                        Consumption::Refused(ReceiptRefusal::State(ApprovalState::Consumed)) => {}
                        other => panic!("{other:?}"),
                    }
                });
            }
        });
        assert_eq!(won.into_inner(), 1);
        assert_eq!(db.count("intents"), 1);
        assert_eq!(store.trace(0, 100).unwrap().len(), 1, "only the winner's event");
        assert!(store.verify_trace().unwrap().first_bad.is_none());
    }

    fn a_receipt_for_other_facts_is_refused_and_names_what_changed(db, store) {
        let a = store.create_approval(&request(ApprovalMode::OutOfBand, 60_000), vec![NewEvent::new("approval-requested", "call", json!({}))]).unwrap();
        assert_eq!(store.trace(0, 10).unwrap()[0].payload["approval"], a.id);
        assert_eq!(
            store.consume_receipt(&a.id, &binding(), ConsumeAs::Approved, &intent(0), vec![]).unwrap(),
            Consumption::Refused(ReceiptRefusal::State(ApprovalState::Pending))
        );
        store.decide_approval(&a.id, ApprovalDecision::Approve, "bob", None, 60_000, vec![]).unwrap();
        assert_eq!(store.find_approval(&binding()).unwrap().unwrap().state, ApprovalState::Approved);
        let mut other = binding();
        other.args_digest = "e".repeat(64);
        other.mapping_revision = 3;
        other.session = "ses_2".into();
        match store.consume_receipt(&a.id, &other, ConsumeAs::Approved, &intent(0), vec![]).unwrap() {
            Consumption::Refused(ReceiptRefusal::Changed(fields)) => assert_eq!(fields, ["session", "mapping revision", "arguments"]),
            other => panic!("{other:?}"),
        }
        let Consumption::Consumed(approval, stored) = store.consume_receipt(&a.id, &binding(), ConsumeAs::Approved, &intent(1), vec![]).unwrap() else {
            panic!("not consumed");
        };
        assert_eq!((approval.state, approval.intent_id.as_deref()), (ApprovalState::Consumed, Some("int_1")));
        assert_eq!((stored.state, stored.approval_id.as_deref()), (IntentState::Prepared, Some(a.id.as_str())));
        assert_eq!(
            store.consume_receipt(&a.id, &binding(), ConsumeAs::Approved, &intent(2), vec![]).unwrap(),
            Consumption::Refused(ReceiptRefusal::State(ApprovalState::Consumed))
        );
        assert_eq!(
            store.consume_receipt("apr_000000000000000000000000", &binding(), ConsumeAs::Approved, &intent(3), vec![]).unwrap(),
            Consumption::Refused(ReceiptRefusal::NotFound)
        );
        assert!(store.find_approval(&binding()).unwrap().is_none());
        assert_eq!(store.approvals(Some(ApprovalState::Consumed), 10).unwrap().len(), 1);
        assert_eq!(store.approvals(None, 10).unwrap().len(), 1);
        assert_eq!(db.count("intents"), 1);
    }

    fn approvals_page_without_skipping_or_repeating(db, store) {
        // Seven pending (several share a millisecond: the id breaks the tie), one denied.
        let mut made = Vec::new();
        for n in 0..8 {
            let mut r = request(ApprovalMode::OutOfBand, 60_000);
            r.binding.args_digest = format!("{n:064x}");
            made.push(store.create_approval(&r, vec![]).unwrap().id);
            if n % 3 == 2 {
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
        }
        store.decide_approval(&made[4], ApprovalDecision::Deny, "bob", None, 0, vec![]).unwrap();
        let whole: Vec<String> = store.approvals(Some(ApprovalState::Pending), 100).unwrap().into_iter().map(|a| a.id).collect();
        assert_eq!(whole.len(), 7);
        let mut paged = Vec::new();
        let mut after: Option<(u64, String)> = None;
        for round in 0.. {
            assert!(round < 5, "the pages never end: {paged:?}");
            let page = store
                .approvals_after(Some(ApprovalState::Pending), after.as_ref().map(|(ms, id)| (*ms, id.as_str())), 3)
                .unwrap();
            if page.is_empty() {
                break;
            }
            assert!(page.len() <= 3);
            let last = page.last().unwrap();
            after = Some((last.created_ms, last.id.clone()));
            paged.extend(page.into_iter().map(|a| a.id));
        }
        assert_eq!(paged, whole, "pages of 3 are the whole list, in order");
        // A cursor past everything is an empty page; the first page is the list's head.
        assert!(store.approvals_after(None, Some((0, "")), 10).unwrap().is_empty());
        assert_eq!(store.approvals_after(None, None, 2).unwrap().len(), 2);
    }

    fn trace_windows_are_bounded_filtered_and_newest_first(db, store) {
        let base = store.trace(0, usize::MAX).unwrap().last().map_or(0, |e| e.seq);
        for n in 0..10 {
            let kind = if n % 2 == 0 { "call-candidate" } else { "call-outcome" };
            store.append_trace(kind, &format!("call_{n}"), &serde_json::json!({"n": n})).unwrap();
        }
        store.append_trace("policy-loaded", "policy", &serde_json::json!({})).unwrap();
        let seqs = |before: i64, from: i64, kinds: &[&str]| -> Vec<i64> {
            store.trace_window(before, from, kinds).unwrap().iter().map(|e| e.seq).collect()
        };
        let all = seqs(base + 100, base + 1, &["call-candidate", "call-outcome"]);
        assert_eq!(all, (base + 1..=base + 10).rev().collect::<Vec<_>>(), "newest first");
        let outcomes = store.trace_window(base + 100, base + 1, &["call-outcome"]).unwrap();
        assert_eq!(outcomes.len(), 5);
        assert!(outcomes.iter().all(|e| e.kind == "call-outcome"));
        // `before` excludes, `from` includes.
        assert_eq!(seqs(base + 5, base + 3, &["call-candidate", "call-outcome"]), [base + 4, base + 3]);
        assert!(seqs(base + 5, base + 5, &["call-outcome"]).is_empty());
        assert!(seqs(base + 100, base + 1, &[]).is_empty());
        assert_eq!(seqs(base + 100, base + 1, &["policy-loaded"]), [base + 11]);
    }

    fn approval_states_move_one_way_and_expire_on_the_host_clock(db, store) {
        let a = store.create_approval(&request(ApprovalMode::OutOfBand, 60_000), vec![]).unwrap();
        store.decide_approval(&a.id, ApprovalDecision::Deny, "bob", Some("no"), 0, vec![]).unwrap();
        for d in [ApprovalDecision::Approve, ApprovalDecision::Deny, ApprovalDecision::Revoke] {
            let err = store.decide_approval(&a.id, d, "bob", None, 60_000, vec![]).unwrap_err();
            assert!(format!("{err:#}").contains("denied"), "{err:#}");
        }
        let b = store.create_approval(&request(ApprovalMode::OutOfBand, 0), vec![]).unwrap();
        let err = store.decide_approval(&b.id, ApprovalDecision::Approve, "bob", None, 60_000, vec![]).unwrap_err();
        assert!(format!("{err:#}").contains("expired"), "{err:#}");
        assert_eq!(store.approval(&b.id).unwrap().unwrap().state, ApprovalState::Expired);
        let c = store.create_approval(&request(ApprovalMode::OutOfBand, 60_000), vec![]).unwrap();
        store.decide_approval(&c.id, ApprovalDecision::Approve, "bob", None, 0, vec![]).unwrap();
        assert_eq!(
            store.consume_receipt(&c.id, &binding(), ConsumeAs::Approved, &intent(0), vec![]).unwrap(),
            Consumption::Refused(ReceiptRefusal::Expired)
        );
        assert_eq!(store.approval(&c.id).unwrap().unwrap().state, ApprovalState::Expired, "the expiry is recorded");
        let e = approved(&*store);
        store.decide_approval(&e, ApprovalDecision::Revoke, "carol", None, 0, vec![]).unwrap();
        assert_eq!(
            store.consume_receipt(&e, &binding(), ConsumeAs::Approved, &intent(0), vec![]).unwrap(),
            Consumption::Refused(ReceiptRefusal::State(ApprovalState::Revoked))
        );
        assert!(format!("{:#}", store.decide_approval("apr_nope", ApprovalDecision::Approve, "b", None, 0, vec![]).unwrap_err()).contains("no approval"));
        assert_eq!(db.count("intents"), 0);
    }

    fn an_in_band_answer_needs_the_request_nonce(db, store) {
        let a = store.create_approval(&request(ApprovalMode::InputRequired, 60_000), vec![]).unwrap();
        let forged = ConsumeAs::AnsweredInBand { by: "alice", nonce: Some("00000000000000000000000000000000") };
        assert_eq!(store.consume_receipt(&a.id, &binding(), forged, &intent(0), vec![]).unwrap(), Consumption::Refused(ReceiptRefusal::Nonce));
        let genuine = ConsumeAs::AnsweredInBand { by: "alice", nonce: Some(&a.nonce) };
        let Consumption::Consumed(record, _) = store.consume_receipt(&a.id, &binding(), genuine, &intent(1), vec![]).unwrap() else {
            panic!("not consumed");
        };
        assert_eq!(record.decided_by.as_deref(), Some("alice"));
    }

    fn hostile_approval_ids_are_refused_clearly(db, store) {
        for id in ["", "apr_", "short", "apr_'; DROP TABLE approvals; --", "apr_%%%%%%%%%%%%"] {
            match store.approval(id) {
                Ok(None) => {}
                Err(e) => assert!(format!("{e:#}").contains("too short"), "{e:#}"),
                Ok(Some(r)) => panic!("{id:?} found {r:?}"),
            }
        }
        let a = store.create_approval(&request(ApprovalMode::OutOfBand, 60_000), vec![]).unwrap();
        assert_eq!(store.approval(&a.id[..16]).unwrap().unwrap().id, a.id, "a unique prefix");
        assert_eq!(db.count("approvals"), 1);
    }

    fn an_attempt_is_sent_until_every_request_is_answered_and_outcomes_are_written_once(db, store) {
        store.create_intent(&intent(1), vec![]).unwrap();
        store.attempt_sending("int_1", 1).unwrap();
        store.attempt_sending("int_1", 1).unwrap();
        store.attempt_answered("int_1", 1, "7", true).unwrap();
        assert_eq!(store.attempts("int_1").unwrap()[0].state, AttemptState::Sent);
        store.attempt_answered("int_1", 1, "8", true).unwrap();
        let a = &store.attempts("int_1").unwrap()[0];
        assert_eq!((a.state, a.requests, a.answered, a.last_request_id.as_deref()), (AttemptState::Acknowledged, 2, 2, Some("8")));
        store.advance_attempt("int_1", 1, AttemptState::ResultObserved).unwrap();
        assert!(store.attempt_sending("int_1", 1).is_err(), "nothing is sent once there is a result");
        assert_eq!(store.new_attempt("int_1").unwrap(), 2);
        store.set_intent_state("int_1", IntentState::Completed, vec![]).unwrap();
        let err = format!("{:#}", store.set_intent_state("int_1", IntentState::Failed, vec![]).unwrap_err());
        assert!(err.contains("not prepared"), "{err}");
        let attempts = store.attempts("int_1").unwrap();
        assert_eq!((attempts[0].state, attempts[1].state), (AttemptState::ResultObserved, AttemptState::Committed));
        assert!(attempts[1].at_ms[5].is_some());
        assert_eq!(store.intent("int_1").unwrap().unwrap().state, IntentState::Completed);
        assert!(store.intent("int_9").unwrap().is_none());
    }

    fn only_an_unknown_intent_is_resolved_and_only_once_and_listing_filters(db, store) {
        store.create_intent(&intent(1), vec![]).unwrap();
        store.create_intent(&intent(2), vec![]).unwrap();
        store.set_intent_state("int_1", IntentState::Unknown, vec![]).unwrap();
        let person = Resolution { state: IntentState::Completed, method: ResolutionMethod::Person, by: "carol".into(), evidence: json!({"said": "it went"}), handles: vec![] };
        let listed = store.intents(&IntentFilter { states: vec![IntentState::Unknown], limit: 10, ..Default::default() }).unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(store.intents(&IntentFilter { mapping: Some("outbox-delivery".into()), limit: 10, ..Default::default() }).unwrap().len(), 2);
        assert!(store.intents(&IntentFilter { mapping: Some("other".into()), limit: 10, ..Default::default() }).unwrap().is_empty());
        assert!(store.intents(&IntentFilter { created_before_ms: Some(0), limit: 10, ..Default::default() }).unwrap().is_empty());
        let resolved = store.resolve_intent("int_1", &person, vec![NewEvent::new("intent-resolved", "int_1", json!({}))]).unwrap();
        assert_eq!(resolved.state, IntentState::Completed);
        assert_eq!(resolved.resolution.unwrap()["by"], "carol");
        let err = format!("{:#}", store.resolve_intent("int_1", &person, vec![]).unwrap_err());
        assert!(err.contains("is completed"), "{err}");
        assert!(format!("{:#}", store.resolve_intent("int_9", &person, vec![]).unwrap_err()).contains("no intent"));
        let bad = Resolution { state: IntentState::Unknown, ..person };
        assert!(store.resolve_intent("int_2", &bad, vec![]).is_err());
        assert_eq!(store.trace(0, 10).unwrap().len(), 1, "refusals append nothing");
    }

    fn a_completed_intent_keeps_its_handles_once_and_has_one_compensation_at_a_time(db, store) {
        let kept = vec![IntentHandle {
            kind: "change-ref".into(),
            locator: "idk_1".into(),
            facts: json!({"path": "a.md", "bytes": 3}).as_object().unwrap().clone(),
        }];
        store.create_intent(&intent(1), vec![]).unwrap();
        // Only a completed effect keeps what undoes it.
        let err = format!("{:#}", store.finish_intent("int_1", IntentState::Unknown, vec![], vec![], kept.clone()).unwrap_err());
        assert!(err.contains("only when it completes"), "{err}");
        assert_eq!(store.intent("int_1").unwrap().unwrap().state, IntentState::Prepared, "nothing was written");
        store.finish_intent("int_1", IntentState::Completed, vec![], vec![], kept.clone()).unwrap();
        assert_eq!(store.intent("int_1").unwrap().unwrap().handles, kept);
        // Written once: the database itself refuses a second write.
        let refused = db.try_exec("UPDATE intents SET handles = '[]' WHERE id = 'int_1'").unwrap_err();
        assert!(refused.contains("written once"), "{refused}");
        // A resolution as completed keeps them too; as failed, it may not.
        store.create_intent(&intent(2), vec![]).unwrap();
        store.set_intent_state("int_2", IntentState::Unknown, vec![]).unwrap();
        let found = Resolution { state: IntentState::Completed, method: ResolutionMethod::Query, by: "airlock".into(), evidence: json!({}), handles: kept.clone() };
        let failed = Resolution { state: IntentState::Failed, ..found.clone() };
        assert!(format!("{:#}", store.resolve_intent("int_2", &failed, vec![]).unwrap_err()).contains("only when it completes"));
        assert_eq!(store.resolve_intent("int_2", &found, vec![]).unwrap().handles, kept);

        // One compensation open or completed at a time; a failed one may be tried again.
        let compensation = |n: usize| NewIntent { compensates: Some("int_1".into()), ..intent(n) };
        store.create_intent(&compensation(3), vec![]).unwrap();
        assert!(store.create_intent(&compensation(4), vec![]).is_err(), "a second one while the first is open");
        assert!(store.intent("int_4").unwrap().is_none());
        store.set_intent_state("int_3", IntentState::Failed, vec![]).unwrap();
        store.create_intent(&compensation(4), vec![]).unwrap();
        store.set_intent_state("int_4", IntentState::Completed, vec![]).unwrap();
        assert!(store.create_intent(&compensation(5), vec![]).is_err(), "nor once one completed");
        let of = store.intents(&IntentFilter { compensates: Some("int_1".into()), limit: 10, ..Default::default() }).unwrap();
        let ids: Vec<&str> = of.iter().map(|i| i.intent.id.as_str()).collect();
        assert_eq!(ids.len(), 2, "{ids:?}");
        assert!(ids.contains(&"int_3") && ids.contains(&"int_4"));
        assert_eq!(of[0].intent.compensates.as_deref(), Some("int_1"));
        assert!(store.intents(&IntentFilter { compensates: Some("int_2".into()), limit: 10, ..Default::default() }).unwrap().is_empty());
        // What an intent compensates never changes.
        let refused = db.try_exec("UPDATE intents SET compensates = 'int_2' WHERE id = 'int_4'").unwrap_err();
        assert!(refused.contains("never changes"), "{refused}");
    }

    fn observations_commit_with_their_events_or_not_at_all(db, store) {
        let item = |sha: &str, ms: u64| airlock::store::NewObservation {
            id: airlock::store::observation_id("conn-1", "resources/read", "notes://x", "", "contents/0", sha),
            connection_id: "conn-1".into(),
            connection: "notes".into(),
            snapshot_digest: "snap".into(),
            method: "resources/read".into(),
            target: "notes://x".into(),
            arguments_sha256: String::new(),
            item: "contents/0".into(),
            kind: "text".into(),
            media_type: "text/markdown".into(),
            sha256: sha.into(),
            bytes: 10,
            request_id: "7".into(),
            call_id: "call_1".into(),
            retrieved_ms: ms,
        };
        store.append_call(vec![NewEvent::new("test", "c", json!({}))], vec![item("aaaa", 1)]).unwrap();
        store.append_call(vec![], vec![item("aaaa", 2)]).unwrap();
        store.append_call(vec![], vec![item("bbbb", 3)]).unwrap();
        // The embedded store's calls are in its trace journal until moved into the tables.
        store.move_journals().unwrap();
        assert_eq!(db.count("observations"), 2, "the same content is referenced, not repeated");
        let mut broken = item("zzzz", u64::MAX);
        broken.bytes = 1;
        assert!(store.append_call(vec![NewEvent::new("test", "c", json!({}))], vec![broken]).is_err());
        store.move_journals().unwrap();
        assert_eq!((db.count("observations"), store.trace(0, 10).unwrap().len()), (2, 1));
    }
}

/// What a PostgreSQL database Airlock did not write looks like to it, and what it does.
mod postgres_only {
    use super::*;
    use airlock::store::shared::{SharedReference, token_digest};

    fn reference(token: &str, scope: &str, expires_ms: u64) -> SharedReference {
        SharedReference {
            token_sha256: token_digest(token),
            scope: scope.into(),
            kind: "source-ref".into(),
            mapping: "source-library".into(),
            revision: 3,
            locator: "wal-checkpoints".into(),
            facts: json!({"bytes": 12}).as_object().unwrap().clone(),
            expires_ms,
        }
    }

    #[test]
    fn a_reference_written_by_one_host_is_found_by_another_in_its_scope_only() {
        let target = pg::database();
        let a = PostgresStore::open(&target, None, Some(key())).unwrap();
        let b = PostgresStore::open(&target, None, Some(key())).unwrap();
        assert!(a.is_shared());
        let later = airlock::store::now_ms() + 60_000;
        let r = reference("ref_one", "ses_a", later);
        a.write_references("ses_a", std::slice::from_ref(&r), &[])
            .unwrap();
        assert_eq!(
            b.find_reference("ses_a", &r.token_sha256).unwrap(),
            Some(r.clone())
        );
        assert_eq!(
            b.find_reference("ses_b", &r.token_sha256).unwrap(),
            None,
            "another session"
        );
        // The token itself is nowhere in the database.
        let rows = pg::query(
            &target,
            "SELECT token_sha256, locator FROM reference_bindings",
        );
        assert_eq!(rows.len(), 1);
        assert!(!format!("{rows:?}").contains("ref_one"));
        // Another scope writing the same digest neither takes the row nor moves its expiry.
        let hijack = reference("ref_one", "ses_b", later + 1_000_000);
        b.write_references("ses_b", std::slice::from_ref(&hijack), &[])
            .unwrap();
        assert_eq!(
            b.find_reference("ses_a", &r.token_sha256).unwrap(),
            Some(r.clone())
        );
        assert_eq!(b.find_reference("ses_b", &r.token_sha256).unwrap(), None);
        // A batch naming another scope than its own is refused whole.
        assert!(a.write_references("ses_a", &[hijack], &[]).is_err());
        // The same scope renews it; a drop deletes it; expired rows go at the next write.
        let renewed = reference("ref_one", "ses_a", later + 5_000);
        a.write_references("ses_a", std::slice::from_ref(&renewed), &[])
            .unwrap();
        assert_eq!(
            b.find_reference("ses_a", &r.token_sha256).unwrap(),
            Some(renewed)
        );
        a.write_references("ses_a", &[], std::slice::from_ref(&r.token_sha256))
            .unwrap();
        assert_eq!(b.find_reference("ses_a", &r.token_sha256).unwrap(), None);
        let old = reference("ref_old", "ses_a", 1);
        a.write_references("ses_a", std::slice::from_ref(&old), &[])
            .unwrap();
        a.write_references("ses_a", &[reference("ref_new", "ses_a", later)], &[])
            .unwrap();
        assert_eq!(b.find_reference("ses_a", &old.token_sha256).unwrap(), None);
        // The embedded store keeps references in the host's memory: it refuses, loudly.
        let dir = tempfile::tempdir().unwrap();
        let sqlite = SqliteStore::open_with_key(dir.path(), Some(key())).unwrap();
        assert!(!sqlite.is_shared());
        assert!(sqlite.write_references("ses_a", &[], &[]).is_err());
        assert!(sqlite.find_reference("ses_a", "x").is_err());
    }

    #[test]
    fn a_host_is_alive_while_its_store_lives_and_asking_takes_nothing() {
        let target = pg::database();
        let a = PostgresStore::open(&target, None, Some(key())).unwrap();
        let b = PostgresStore::open(&target, None, Some(key())).unwrap();
        a.register_host("hst_a").unwrap();
        assert!(b.host_alive("hst_a").unwrap(), "A holds its lock");
        assert!(!b.host_alive("hst_never").unwrap(), "no one holds it");
        // Asking gave the lock back: a host registering under that id gets it at once.
        let c = PostgresStore::open(&target, None, Some(key())).unwrap();
        c.register_host("hst_never").unwrap();
        assert!(b.host_alive("hst_never").unwrap());
        drop(a);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while b.host_alive("hst_a").unwrap() {
            assert!(
                std::time::Instant::now() < deadline,
                "A's lock outlived its store"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    #[test]
    fn a_foreign_database_is_refused_and_left_unchanged() {
        let target = pg::database();
        pg::exec(
            &target,
            "CREATE TABLE accounts (id int); INSERT INTO accounts VALUES (1)",
        )
        .unwrap();
        let err = format!(
            "{:#}",
            PostgresStore::open(&target, None, Some(key())).unwrap_err()
        );
        assert!(
            err.contains("not written by Airlock") && err.contains("nothing was changed"),
            "{err}"
        );
        let tables = pg::query(
            &target,
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'",
        );
        assert_eq!(tables, vec![vec![Some("accounts".to_owned())]]);
    }

    #[test]
    fn a_newer_schema_is_refused_and_left_unchanged() {
        let target = pg::database();
        drop(PostgresStore::open(&target, None, Some(key())).unwrap());
        pg::exec(&target, "UPDATE airlock_schema SET version = 99").unwrap();
        let err = format!(
            "{:#}",
            PostgresStore::open(&target, None, Some(key())).unwrap_err()
        );
        assert!(err.contains("newer Airlock (schema 99"), "{err}");
        assert_eq!(
            pg::query(&target, "SELECT version FROM airlock_schema"),
            vec![vec![Some("99".to_owned())]]
        );
    }

    #[test]
    fn hosts_opening_one_new_database_at_once_migrate_it_once() {
        let target = pg::database();
        std::thread::scope(|scope| {
            for _ in 0..6 {
                scope.spawn(|| drop(PostgresStore::open(&target, None, Some(key())).unwrap()));
            }
        });
        assert_eq!(
            pg::query(&target, "SELECT version FROM airlock_schema"),
            vec![vec![Some(
                airlock::store::postgres::PG_SCHEMA_VERSION.to_string()
            )]]
        );
    }

    #[test]
    fn a_schema_1_store_is_migrated_to_the_current_schema_keeping_its_trace() {
        let target = pg::database();
        let before = {
            let store = PostgresStore::open(&target, None, Some(key())).unwrap();
            store.append_trace("test", "s", &json!({"n": 1})).unwrap();
            store.trace(0, 10).unwrap()
        };
        // Exactly the state a schema-1 build leaves: no reference_bindings table (2), no
        // index of intent state events (3), no contract reviews (4), no compensation (5),
        // no deletion of archived events (6), no index of connection states (7).
        pg::exec(
            &target,
            "DROP TABLE reference_bindings; DROP INDEX trace_events_intent_states; \
             DROP TABLE contract_reviews; DROP INDEX trace_events_contract_proofs; \
             DROP INDEX intents_one_compensation; \
             DROP TRIGGER intents_keep_compensates ON intents; \
             DROP TRIGGER intents_handles_once ON intents; \
             ALTER TABLE intents DROP COLUMN compensates, DROP COLUMN handles; \
             DROP INDEX trace_events_archives; \
             DROP INDEX trace_events_connection_states; \
             DROP TRIGGER trace_events_delete_archived_only ON trace_events; \
             DROP FUNCTION airlock_trace_delete(); \
             DROP TRIGGER trace_events_append_only ON trace_events; \
             CREATE TRIGGER trace_events_append_only BEFORE UPDATE OR DELETE ON trace_events \
                 FOR EACH ROW EXECUTE FUNCTION airlock_refuse('trace events are append-only'); \
             UPDATE airlock_schema SET version = 1",
        )
        .unwrap();
        let store = PostgresStore::open(&target, None, Some(key())).unwrap();
        assert_eq!(
            pg::query(&target, "SELECT version FROM airlock_schema"),
            vec![vec![Some(
                airlock::store::postgres::PG_SCHEMA_VERSION.to_string()
            )]]
        );
        assert_eq!(
            pg::query(
                &target,
                "SELECT count(*) FROM pg_indexes WHERE indexname = 'trace_events_intent_states'"
            ),
            vec![vec![Some("1".to_owned())]]
        );
        assert_eq!(
            pg::query(
                &target,
                "SELECT count(*) FROM pg_indexes WHERE indexname = 'trace_events_connection_states'"
            ),
            vec![vec![Some("1".to_owned())]]
        );
        assert_eq!(store.contract_reviews().unwrap(), []);
        // After migration 6: events are still append-only until archived.
        let refused = pg::exec(&target, "DELETE FROM trace_events").unwrap_err();
        assert!(refused.contains("only archived events"), "{refused}");
        assert!(pg::exec(&target, "UPDATE trace_events SET subject = 'x'").is_err());
        let r = reference("ref_after", "ses_a", airlock::store::now_ms() + 60_000);
        store
            .write_references("ses_a", std::slice::from_ref(&r), &[])
            .unwrap();
        assert_eq!(
            store.find_reference("ses_a", &r.token_sha256).unwrap(),
            Some(r)
        );
        assert!(
            store
                .intents_open_in_trace_only("m", 10)
                .unwrap()
                .is_empty()
        );
        assert_eq!(store.trace(0, 10).unwrap(), before);
        assert!(store.verify_trace().unwrap().first_bad.is_none());
    }

    #[test]
    fn a_host_with_another_key_appends_nothing_and_says_why() {
        let target = pg::database();
        let a = PostgresStore::open(&target, None, Some(key())).unwrap();
        a.append_trace("test", "s", &json!({})).unwrap();
        let other = TraceKey::from_secret("other", &"z".repeat(40)).unwrap();
        let b = PostgresStore::open(&target, None, Some(other)).unwrap();
        let err = format!("{:#}", b.append_trace("test", "s", &json!({})).unwrap_err());
        assert!(
            err.contains("every host on one PostgreSQL store must hold the same key"),
            "{err}"
        );
        assert_eq!(a.trace(0, 10).unwrap().len(), 1);
    }

    #[test]
    fn without_a_key_the_state_folder_key_is_used_and_a_missing_one_refused_once_keyed() {
        let target = pg::database();
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let first = PostgresStore::open(&target, Some(&state), None).unwrap();
        first.append_trace("test", "s", &json!({})).unwrap();
        assert!(state.join("trace.key").is_file());
        let again = PostgresStore::open(&target, Some(&state), None).unwrap();
        assert_eq!(again.key().id(), first.key().id());
        let elsewhere: PathBuf = dir.path().join("fresh");
        let err = format!(
            "{:#}",
            PostgresStore::open(&target, Some(&elsewhere), None).unwrap_err()
        );
        assert!(
            err.contains("is missing") && err.contains("MACed with key"),
            "{err}"
        );
        assert!(!elsewhere.join("trace.key").exists(), "no new key was made");
        let err = format!(
            "{:#}",
            PostgresStore::open(&target, None, None).unwrap_err()
        );
        assert!(err.contains("needs the trace key"), "{err}");
    }

    #[test]
    fn a_missing_database_and_a_refused_login_are_named() {
        let _ = pg::server();
        let err = format!(
            "{:#}",
            PostgresStore::open(&pg::target("no_such_db"), None, Some(key())).unwrap_err()
        );
        assert!(
            err.contains("cannot reach the PostgreSQL store") && err.contains("no_such_db"),
            "{err}"
        );
        let err = format!(
            "{:#}",
            PostgresStore::open(
                &format!("{} user=mallory", pg::target("postgres")),
                None,
                Some(key())
            )
            .unwrap_err()
        );
        assert!(err.contains("mallory"), "{err}");
    }

    #[test]
    fn a_nul_character_is_refused_and_nothing_is_written() {
        let target = pg::database();
        let store = PostgresStore::open(&target, None, Some(key())).unwrap();
        let err = format!(
            "{:#}",
            store
                .append_trace("test", "nul \u{0} here", &json!({}))
                .unwrap_err()
        );
        assert!(err.contains("0x00"), "{err}");
        assert!(store.trace(0, 10).unwrap().is_empty());
    }

    /// LISTEN/NOTIFY: a mapping change or an approval decision made through one store
    /// (another host) signals every other store at commit; a trace append does not.
    #[test]
    fn a_change_made_through_one_store_is_signalled_to_another_at_commit() {
        let target = pg::database();
        let a = PostgresStore::open(&target, None, Some(key())).unwrap();
        let b = PostgresStore::open(&target, None, Some(key())).unwrap();
        let mut signal = a.changes().expect("the PostgreSQL store signals changes");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let wait = |signal: &mut tokio::sync::watch::Receiver<u64>, within: std::time::Duration| {
            runtime.block_on(async { tokio::time::timeout(within, signal.changed()).await.is_ok() })
        };
        // The listener signals once when its LISTEN is in place ("re-read, you may have
        // missed something"); from then on it hears every change.
        // What a signal may take on a loaded machine: the waits below return as soon as
        // it comes; only a signal that never comes waits this long (and fails).
        const HEARD: std::time::Duration = std::time::Duration::from_secs(30);
        let ready = std::time::Instant::now();
        while *signal.borrow() == 0 {
            assert!(ready.elapsed() < HEARD, "the listener never listened");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        signal.borrow_and_update();
        b.append_trace("test", "s", &json!({})).unwrap();
        assert!(
            !wait(&mut signal, std::time::Duration::from_millis(300)),
            "a trace append is no change to re-read"
        );
        let c = b.connection_revision("notes", "d1", &json!({})).unwrap();
        let start = std::time::Instant::now();
        b.add_mapping_revision(&new_mapping("m", MappingState::Active, &c.connection_id))
            .unwrap();
        assert!(wait(&mut signal, HEARD), "a new revision is signalled");
        let heard = start.elapsed();
        b.set_mapping_state("m", MappingState::Active, MappingState::Retiring, "r")
            .unwrap()
            .unwrap();
        assert!(wait(&mut signal, HEARD), "a state change is signalled");
        let id = b
            .create_approval(&request(ApprovalMode::OutOfBand, 60_000), vec![])
            .unwrap()
            .id;
        b.decide_approval(&id, ApprovalDecision::Approve, "bob", None, 60_000, vec![])
            .unwrap();
        assert!(wait(&mut signal, HEARD), "a decision is signalled");
        // A refused change commits no notification.
        assert!(
            b.set_mapping_state("m", MappingState::Active, MappingState::Retiring, "r")
                .unwrap()
                .is_none()
        );
        assert!(!wait(&mut signal, std::time::Duration::from_millis(300)));
        println!("a new revision was heard by the other store after {heard:?}");
        assert!(
            SqliteStore::open_with_key(tempfile::tempdir().unwrap().path(), Some(key()))
                .unwrap()
                .changes()
                .is_none()
        );
    }

    /// The sync store inside tokio tasks on a multi-thread and a current-thread runtime.
    #[test]
    fn the_store_works_inside_tokio_runtimes() {
        let target = pg::database();
        let store: Arc<dyn Store> =
            Arc::new(PostgresStore::open(&target, None, Some(key())).unwrap());
        let multi = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let s = store.clone();
        multi.block_on(async move {
            let tasks: Vec<_> = (0..8)
                .map(|i| {
                    let s = s.clone();
                    tokio::spawn(
                        async move { s.append_trace("test", "m", &json!({"i": i})).unwrap() },
                    )
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
        });
        let current = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        current.block_on(async { store.append_trace("test", "c", &json!({})).unwrap() });
        assert_eq!(store.verify_trace().unwrap().events, 9);
        // Dropping the store inside a runtime is fine too.
        current.block_on(async move { drop(store) });
    }

    /// A measurement, not a check: one store operation's latency on each backend.
    /// `cargo test -p airlock --test integration store_suite::postgres_only::latency -- --ignored --nocapture`
    #[test]
    #[ignore = "a measurement; run it by name"]
    fn latency() {
        for backend in ["sqlite", "postgres"] {
            let db = Db::new(backend);
            let store = db.open();
            let n = 500;
            let time = |f: &dyn Fn(usize)| {
                let start = std::time::Instant::now();
                for i in 0..n {
                    f(i);
                }
                start.elapsed().as_micros() as f64 / n as f64
            };
            let append = time(&|i| {
                store
                    .append_events(vec![NewEvent::new("call-outcome", "c", json!({"i": i}))])
                    .unwrap()
            });
            let find = time(&|_| {
                store.find_approval(&binding()).unwrap();
            });
            let consume = time(&|i| {
                let id = approved(&*store);
                store
                    .consume_receipt(&id, &binding(), ConsumeAs::Approved, &intent(i), vec![])
                    .unwrap();
            });
            println!(
                "{backend}: append_events {append:.0} µs, find_approval {find:.0} µs, create+approve+consume {consume:.0} µs"
            );
        }
    }
}

/// An archive pass's request: everything older than now, into `dir`.
fn archive_request(dir: &std::path::Path) -> airlock::store::archive::ArchiveRequest {
    airlock::store::archive::ArchiveRequest {
        dir: dir.to_path_buf(),
        before_ms: u64::MAX,
        max_events: 100_000,
        keep_events: None,
        now_ms: airlock::store::now_ms(),
    }
}

both! {
    fn an_archive_pass_keeps_what_is_still_needed_and_every_host_still_verifies(db, store) {
        use airlock::store::archive::verify_segments;
        let folder = tempfile::tempdir().unwrap();
        let archive = folder.path().join("archive");
        let pending = store
            .create_approval(
                &request(ApprovalMode::OutOfBand, 60_000),
                vec![NewEvent::new("approval-requested", "call_1", json!({}))],
            )
            .unwrap();
        for n in [1, 2] {
            let created = NewEvent::new(
                "intent-created",
                format!("call_{n}"),
                json!({"intent": format!("int_{n}"), "intent_state": "prepared"}),
            );
            store.create_intent(&intent(n), vec![created]).unwrap();
        }
        let closed = NewEvent::new("call-outcome", "call_2", json!({"intent": "int_2", "intent_state": "completed"}));
        store.set_intent_state("int_2", IntentState::Completed, vec![closed]).unwrap();
        store.append_trace("mapping-revision", "library", &json!({"revision": 1})).unwrap();
        for i in 0..20 {
            store.append_trace("call-outcome", "c", &json!({"i": i})).unwrap();
        }
        let before = db.count("trace_events");
        let report = store.archive_trace(&archive_request(&archive)).unwrap();
        let sealed = report.sealed.expect("a segment");
        assert_eq!((sealed.mark.from_seq, sealed.mark.to_seq), (1, before));
        // The pending approval's request, the open intent's creation, the mapping's event.
        assert_eq!(sealed.mark.kept.len(), 3, "{:?}", sealed.mark);
        assert_eq!(report.deleted as i64, before - 3);
        assert_eq!(db.count("trace_events"), 4, "the kept events and the mark");
        // Every host proves what it needs and verifies the chain.
        let other = db.open();
        for s in [&store, &other] {
            let v = s.verify_trace().unwrap();
            assert_eq!(v.first_bad, None, "{v:?}");
            assert_eq!(v.archived_to, Some(before));
            assert_eq!(s.approval_proofs(&pending.id).unwrap().len(), 1);
            assert_eq!(s.intent_proofs("int_1").unwrap().len(), 1);
            assert!(s.intent_proofs("int_2").unwrap().is_empty(), "closed: archived");
            assert_eq!(s.mapping_proofs("library").unwrap().len(), 1);
            assert_eq!(s.trace_missing_from(1).unwrap(), 0);
        }
        let mark = other.archive_mark().unwrap();
        let segments = verify_segments(&archive, other.trace_key(), mark.as_ref(), &[]).unwrap();
        assert_eq!(segments.first_bad, None, "{segments:?}");
        assert_eq!(segments.through_seq, before);
        // The database refuses deleting an event after the archived range.
        assert!(refused_directly(&db, "DELETE FROM trace_events WHERE kind = 'trace-archived'"));
        // Deleting a kept proof is found: by the chain check and by a receipt's whole-trace test.
        let kept = sealed.mark.kept[0];
        db.try_exec(&format!("DELETE FROM trace_events WHERE seq = {kept}")).unwrap();
        let v = other.verify_trace().unwrap();
        assert!(v.first_bad.unwrap().1.contains("proofs still needed were deleted"));
        assert_eq!(other.trace_missing_from(1).unwrap(), 1);
    }

    fn once_an_intent_closes_the_next_pass_lets_its_events_go(db, store) {
        let folder = tempfile::tempdir().unwrap();
        let archive = folder.path().join("archive");
        let created = NewEvent::new("intent-created", "call_1", json!({"intent": "int_1", "intent_state": "prepared"}));
        store.create_intent(&intent(1), vec![created]).unwrap();
        let first = store.archive_trace(&archive_request(&archive)).unwrap().sealed.unwrap();
        assert_eq!(first.mark.kept, vec![1]);
        let closed = NewEvent::new("call-outcome", "call_1", json!({"intent": "int_1", "intent_state": "completed"}));
        store.set_intent_state("int_1", IntentState::Completed, vec![closed]).unwrap();
        let second = store.archive_trace(&archive_request(&archive)).unwrap().sealed.unwrap();
        assert!(second.mark.kept.is_empty(), "{:?}", second.mark);
        assert_eq!(db.count("trace_events"), 1, "only the newest mark");
        assert_eq!(store.verify_trace().unwrap().first_bad, None);
        let mark = store.archive_mark().unwrap();
        let s = airlock::store::archive::verify_segments(&archive, store.trace_key(), mark.as_ref(), &[]).unwrap();
        assert_eq!((s.first_bad, s.segments, s.through_seq), (None, 2, 3));
    }
}
