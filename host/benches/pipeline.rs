//! The cost of policy-approved calls (`cargo bench -p airlock --bench pipeline`).
//!
//! 1. Policy decisions (Cedar, the example policy): allow, require-approval (two
//!    evaluations), deny.
//! 2. The receipt path in the store: consuming a receipt together with creating its intent
//!    (one SQLite transaction), and the approval it needs.
//! 3. What tracing every call costs: in-process `tools/call search_sources` through the
//!    whole pipeline on two hosts in the same run, interleaved — one with the real store,
//!    one whose store drops per-call trace events (a bench-only wrapper) — plus the
//!    group-committed append of one call's events on its own, and under 8 concurrent
//!    callers.
//! 4. References: mint and resolve with 0, 10 000 and 100 000 live references in a table.
//! 5. 200 000 calls in one session and across 8 sessions (in process): failures.
//!
//! `AIRLOCK_BENCH_ITERS` sets the sample count (default 5000); `AIRLOCK_BENCH_LONG_CALLS`
//! the calls of section 5 (default 200000; 0 skips it); `AIRLOCK_BENCH_ONLY=policy|receipts|intents|
//! trace|references|calls` runs one section (to profile it).

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use airlock::cli::demo::{approve_all, notes_config};
use airlock::host::Host;
use airlock::pipeline::references::{Origin, ReferenceTable};
use airlock::policy::{CallFacts, CapabilityFacts, Policy, PolicyEngine, Principal};
use airlock::registry::Registry;
use airlock::registry::live::MappingSource;
use airlock::store::{
    ApprovalDecision, Approvals, Connections, ConsumeAs, Hosts, Intents, Mappings, NewApproval,
    NewEvent, NewIntent, ReceiptBinding, Snapshots, SqliteStore, Store, Trace,
};
use serde_json::{Map, Value, json};

fn iters() -> usize {
    std::env::var("AIRLOCK_BENCH_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5000)
}

mod common;
use common::{Stats, load_average, stats, store_ops, us};

fn print(name: &str, s: &Stats) {
    println!(
        "{name:<58} n={:<7} p50 {:>8.2} µs   p99 {:>8.2} µs",
        s.n,
        us(s.p50),
        us(s.p99)
    );
}

fn time(n: usize, mut f: impl FnMut(usize)) -> Stats {
    for i in 0..(n / 10).max(10) {
        f(i);
    }
    let mut samples = Vec::with_capacity(n);
    for i in 0..n {
        let start = Instant::now();
        f(i);
        samples.push(start.elapsed());
    }
    stats(samples)
}

/// A store that drops per-call trace events and observations (`append_events`,
/// `append_call`) and delegates everything else: the "without" side of the tracing
/// measurement. Bench only.
struct NoCallTrace(SqliteStore);

impl Connections for NoCallTrace {
    fn connection_revision(
        &self,
        name: &str,
        config_digest: &str,
        config: &Value,
    ) -> anyhow::Result<airlock::store::ConnectionRevision> {
        self.0.connection_revision(name, config_digest, config)
    }
    fn connection(&self, name: &str) -> anyhow::Result<Option<airlock::store::ConnectionRecord>> {
        self.0.connection(name)
    }
    fn connections(&self) -> anyhow::Result<Vec<airlock::store::ConnectionRecord>> {
        self.0.connections()
    }
}

impl Snapshots for NoCallTrace {
    fn put_snapshot(
        &self,
        digest: &str,
        connection_id: &str,
        config_revision: i64,
        body: &Value,
    ) -> anyhow::Result<airlock::store::SnapshotObservation> {
        self.0
            .put_snapshot(digest, connection_id, config_revision, body)
    }
    fn snapshot(&self, d: &str) -> anyhow::Result<Option<airlock::store::StoredSnapshot>> {
        self.0.snapshot(d)
    }
    fn latest_snapshot(&self, c: &str) -> anyhow::Result<Option<airlock::store::StoredSnapshot>> {
        self.0.latest_snapshot(c)
    }
    fn snapshots(&self, c: Option<&str>) -> anyhow::Result<Vec<airlock::store::SnapshotSummary>> {
        self.0.snapshots(c)
    }
}

impl airlock::store::ContractReviews for NoCallTrace {
    fn contract_review(
        &self,
        package: &str,
    ) -> anyhow::Result<Option<airlock::store::ContractRecord>> {
        self.0.contract_review(package)
    }
    fn contract_reviews(&self) -> anyhow::Result<Vec<airlock::store::ContractRecord>> {
        self.0.contract_reviews()
    }
    fn approve_contract(
        &self,
        new: &airlock::store::NewContractApproval,
    ) -> anyhow::Result<airlock::store::ContractRecord> {
        self.0.approve_contract(new)
    }
    fn mark_contract_erroneous(
        &self,
        package: &str,
        reviewer: &str,
        reason: &str,
    ) -> anyhow::Result<Option<airlock::store::ContractRecord>> {
        self.0.mark_contract_erroneous(package, reviewer, reason)
    }
    fn contract_proofs(&self, package: &str) -> anyhow::Result<Vec<airlock::store::TraceEvent>> {
        self.0.contract_proofs(package)
    }
}

impl Mappings for NoCallTrace {
    fn mapping(&self, name: &str) -> anyhow::Result<Option<airlock::store::MappingRecord>> {
        self.0.mapping(name)
    }
    fn mapping_revisions(&self, name: &str) -> anyhow::Result<Vec<airlock::store::MappingRecord>> {
        self.0.mapping_revisions(name)
    }
    fn mappings(&self) -> anyhow::Result<Vec<airlock::store::MappingRecord>> {
        self.0.mappings()
    }
    fn add_mapping_revision(
        &self,
        new: &airlock::store::NewMappingRevision,
    ) -> anyhow::Result<airlock::store::MappingRecord> {
        self.0.add_mapping_revision(new)
    }
    fn add_mapping_revision_traced(
        &self,
        new: &airlock::store::NewMappingRevision,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<airlock::store::MappingRecord> {
        self.0.add_mapping_revision_traced(new, events)
    }
    fn set_mapping_state(
        &self,
        name: &str,
        expected: airlock::store::MappingState,
        to: airlock::store::MappingState,
        reason: &str,
    ) -> anyhow::Result<Option<airlock::store::MappingRecord>> {
        self.0.set_mapping_state(name, expected, to, reason)
    }
    fn set_mapping_state_traced(
        &self,
        name: &str,
        expected: airlock::store::MappingState,
        to: airlock::store::MappingState,
        reason: &str,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<Option<airlock::store::MappingRecord>> {
        self.0
            .set_mapping_state_traced(name, expected, to, reason, events)
    }
}

impl Trace for NoCallTrace {
    fn trace_key(&self) -> &airlock::store::TraceKey {
        self.0.trace_key()
    }
    fn append_trace(
        &self,
        kind: &str,
        subject: &str,
        payload: &Value,
    ) -> anyhow::Result<airlock::store::TraceEvent> {
        self.0.append_trace(kind, subject, payload)
    }
    fn append_events(&self, _events: Vec<NewEvent>) -> anyhow::Result<()> {
        Ok(())
    }
    fn append_call(
        &self,
        _events: Vec<NewEvent>,
        _observations: Vec<airlock::store::NewObservation>,
    ) -> anyhow::Result<()> {
        Ok(())
    }
    fn trace(&self, after: i64, limit: usize) -> anyhow::Result<Vec<airlock::store::TraceEvent>> {
        self.0.trace(after, limit)
    }
    fn trace_window(
        &self,
        before: i64,
        from: i64,
        kinds: &[&str],
    ) -> anyhow::Result<Vec<airlock::store::TraceEvent>> {
        self.0.trace_window(before, from, kinds)
    }
    fn verify_trace_against(
        &self,
        checkpoints: &[(usize, airlock::store::Checkpoint)],
    ) -> anyhow::Result<airlock::store::TraceVerification> {
        self.0.verify_trace_against(checkpoints)
    }
    fn trace_checkpoint(&self) -> anyhow::Result<airlock::store::Checkpoint> {
        self.0.trace_checkpoint()
    }
    fn mapping_proofs(&self, name: &str) -> anyhow::Result<Vec<airlock::store::TraceEvent>> {
        self.0.mapping_proofs(name)
    }
    fn connection_state(&self, name: &str) -> anyhow::Result<Option<airlock::store::TraceEvent>> {
        self.0.connection_state(name)
    }
    fn approval_proofs(&self, id: &str) -> anyhow::Result<Vec<airlock::store::TraceEvent>> {
        self.0.approval_proofs(id)
    }
    fn trace_missing_from(&self, seq: i64) -> anyhow::Result<u64> {
        self.0.trace_missing_from(seq)
    }
    fn intent_proofs(&self, id: &str) -> anyhow::Result<Vec<airlock::store::TraceEvent>> {
        self.0.intent_proofs(id)
    }
    fn intents_open_in_trace_only(
        &self,
        mapping: &str,
        limit: usize,
    ) -> anyhow::Result<Vec<String>> {
        self.0.intents_open_in_trace_only(mapping, limit)
    }
    fn archive_mark(&self) -> anyhow::Result<Option<airlock::store::archive::Archived>> {
        self.0.archive_mark()
    }
    fn archive_trace(
        &self,
        request: &airlock::store::archive::ArchiveRequest,
    ) -> anyhow::Result<airlock::store::archive::ArchiveReport> {
        self.0.archive_trace(request)
    }
    fn export_trace(
        &self,
        dir: &std::path::Path,
    ) -> anyhow::Result<airlock::store::archive::Exported> {
        self.0.export_trace(dir)
    }
}

impl Approvals for NoCallTrace {
    fn create_approval(
        &self,
        new: &NewApproval,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<airlock::store::ApprovalRecord> {
        self.0.create_approval(new, events)
    }
    fn approval(&self, id: &str) -> anyhow::Result<Option<airlock::store::ApprovalRecord>> {
        self.0.approval(id)
    }
    fn approvals(
        &self,
        state: Option<airlock::store::ApprovalState>,
        limit: usize,
    ) -> anyhow::Result<Vec<airlock::store::ApprovalRecord>> {
        self.0.approvals(state, limit)
    }
    fn approvals_after(
        &self,
        state: Option<airlock::store::ApprovalState>,
        after: Option<(u64, &str)>,
        limit: usize,
    ) -> anyhow::Result<Vec<airlock::store::ApprovalRecord>> {
        self.0.approvals_after(state, after, limit)
    }
    fn find_approval(
        &self,
        b: &ReceiptBinding,
    ) -> anyhow::Result<Option<airlock::store::ApprovalRecord>> {
        self.0.find_approval(b)
    }
    fn decide_approval(
        &self,
        id: &str,
        d: ApprovalDecision,
        by: &str,
        reason: Option<&str>,
        ttl_ms: u64,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<airlock::store::ApprovalRecord> {
        self.0.decide_approval(id, d, by, reason, ttl_ms, events)
    }
    fn consume_receipt(
        &self,
        id: &str,
        b: &ReceiptBinding,
        how: ConsumeAs<'_>,
        intent: &NewIntent,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<airlock::store::Consumption> {
        self.0.consume_receipt(id, b, how, intent, events)
    }
    fn waiting(&self, now_ms: u64) -> anyhow::Result<airlock::store::Waiting> {
        self.0.waiting(now_ms)
    }
}

impl Intents for NoCallTrace {
    fn create_intent(&self, intent: &NewIntent, events: Vec<NewEvent>) -> anyhow::Result<()> {
        self.0.create_intent(intent, events)
    }
    fn set_intent_state(
        &self,
        id: &str,
        state: airlock::store::IntentState,
        events: Vec<NewEvent>,
    ) -> anyhow::Result<()> {
        self.0.set_intent_state(id, state, events)
    }
    fn finish_intent(
        &self,
        id: &str,
        state: airlock::store::IntentState,
        events: Vec<NewEvent>,
        observations: Vec<airlock::store::NewObservation>,
        handles: Vec<airlock::store::IntentHandle>,
    ) -> anyhow::Result<()> {
        self.0
            .finish_intent(id, state, events, observations, handles)
    }
    fn intent(&self, id: &str) -> anyhow::Result<Option<airlock::store::IntentRecord>> {
        self.0.intent(id)
    }

    fn attempt_sending(&self, intent: &str, attempt: u32) -> anyhow::Result<()> {
        self.0.attempt_sending(intent, attempt)
    }

    fn attempt_answered(
        &self,
        intent: &str,
        attempt: u32,
        request_id: &str,
        answered: bool,
    ) -> anyhow::Result<()> {
        self.0
            .attempt_answered(intent, attempt, request_id, answered)
    }

    fn advance_attempt(
        &self,
        intent: &str,
        attempt: u32,
        to: airlock::store::AttemptState,
    ) -> anyhow::Result<()> {
        self.0.advance_attempt(intent, attempt, to)
    }

    fn new_attempt(&self, intent: &str) -> anyhow::Result<u32> {
        self.0.new_attempt(intent)
    }

    fn attempts(&self, intent: &str) -> anyhow::Result<Vec<airlock::store::AttemptRecord>> {
        self.0.attempts(intent)
    }

    fn intents(
        &self,
        filter: &airlock::store::IntentFilter,
    ) -> anyhow::Result<Vec<airlock::store::IntentRecord>> {
        self.0.intents(filter)
    }

    fn resolve_intent(
        &self,
        id: &str,
        resolution: &airlock::store::Resolution,
        events: Vec<airlock::store::NewEvent>,
    ) -> anyhow::Result<airlock::store::IntentRecord> {
        self.0.resolve_intent(id, resolution, events)
    }
}

impl Hosts for NoCallTrace {}

const EXAMPLE_POLICY: &str = include_str!("../../airlock.example.cedar");

fn policy_decisions(n: usize) {
    let policy = Policy::from_texts(&[("airlock.example.cedar".into(), EXAMPLE_POLICY.into())])
        .expect("the example policy validates");
    let engine = PolicyEngine::new(policy);
    let principal = Principal::new("alice", &["operator".into()], "stdio").unwrap();
    let cap = |name, class| CapabilityFacts {
        name,
        contract: "airlock:contracts/artifact-delivery@0.2.0",
        function: "deliver",
        effect_class: class,
        idempotent: true,
        queryable: true,
        compensable: false,
        mapping: "outbox-delivery",
        mapping_revision: 3,
        mapping_state: "active",
        connection: "outbox",
        data_class: "internal",
    };
    let call = |profile, destination| CallFacts {
        profile,
        transport: "stdio",
        protocol: "2025-11-25",
        destination,
        artifact_bytes: Some(12_288),
    };
    let read = cap("search_sources", "read");
    let deliver = cap("deliver_artifact", "external-effect");
    let research = call("research", None);
    let team = call("publisher", Some("team-reports"));
    let partner = call("publisher", Some("partner-drop"));
    // Each row but the last asks a question not asked before (the artifact size moves by a
    // byte per question, warm-up included, which no policy here reads), so Cedar evaluates every sample; the
    // engine keeps decisions (PolicyEngine), and the last row is an equal question again.
    let asked = std::cell::Cell::new(0u64);
    let fresh = |base: &CallFacts<'static>, _: usize| {
        asked.set(asked.get() + 1);
        CallFacts {
            artifact_bytes: Some(12_288 + asked.get()),
            ..base.clone()
        }
    };
    print(
        "policy: allow (read)",
        &time(n, |i| {
            std::hint::black_box(engine.decide_call(&principal, &read, &fresh(&research, i)));
        }),
    );
    print(
        "policy: require-approval (two evaluations)",
        &time(n, |i| {
            std::hint::black_box(engine.decide_call(&principal, &deliver, &fresh(&team, i)));
        }),
    );
    print(
        "policy: deny (forbid, outside scope)",
        &time(n, |i| {
            std::hint::black_box(engine.decide_call(&principal, &deliver, &fresh(&partner, i)));
        }),
    );
    let current = engine.current();
    print(
        "policy: re-check with a receipt (approved = true)",
        &time(n, |i| {
            std::hint::black_box(engine.decide_call_with(
                &current,
                &principal,
                &deliver,
                &fresh(&team, i),
                true,
            ));
        }),
    );
    print(
        "policy: allow (read), the same question again (kept)",
        &time(n, |_| {
            std::hint::black_box(engine.decide_call(&principal, &read, &research));
        }),
    );
}

fn receipts(n: usize) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    let binding = store_ops::binding();
    // A fresh approval for every consumption, warm-up included.
    let ids = store_ops::approved(&store, &binding, n + n / 10 + 10);
    let mut next = 0usize;
    print(
        "receipt: consume + create intent (+2 events), one txn",
        &time(n, |_| {
            store_ops::consume(&store, &binding, &ids[next], next);
            next += 1;
        }),
    );
    print(
        "receipt: find the approval for a call (indexed lookup)",
        &time(n, |_| {
            std::hint::black_box(store.find_approval(&binding).unwrap());
        }),
    );
}

/// Intent bookkeeping of one external-effect call: its durable writes, each a store
/// write at the moment it becomes true (DESIGN.md §5.8).
fn intent_bookkeeping(n: usize) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path()).unwrap();
    let ids: Vec<String> = (0..3 * (n + n / 10 + 10))
        .map(|i| {
            let record = store_ops::intent(i);
            store.create_intent(&record, vec![]).unwrap();
            record.id
        })
        .collect();
    let mut at = 0usize;
    print(
        "intent: attempt sent (one UPDATE, autocommit)",
        &time(n, |_| {
            store.attempt_sending(&ids[at], 1).unwrap();
            at += 1;
        }),
    );
    let mut at = n + n / 10 + 10;
    print(
        "intent: the 4 attempt writes of a call (sent, acknowledged, observed, verified)",
        &time(n, |_| {
            store_ops::attempt_writes(&store, &ids[at]);
            at += 1;
        }),
    );
    // The floor: the same one-row UPDATE with rusqlite directly, same database file and
    // settings, no store mutex, no statement lookup by text.
    drop(store);
    let conn = rusqlite::Connection::open(dir.path().join("airlock.db")).unwrap();
    conn.pragma_update(None, "synchronous", "NORMAL").unwrap();
    let mut stmt = conn
        .prepare(
            "UPDATE intent_attempts SET requests = requests + 1 WHERE intent_id = ?1 AND attempt = 1",
        )
        .unwrap();
    let mut at = 0usize;
    print(
        "sqlite: one-row UPDATE, autocommit (the floor)",
        &time(n, |_| {
            stmt.execute(rusqlite::params![ids[at % ids.len()]])
                .unwrap();
            at += 1;
        }),
    );
    drop(stmt);
    drop(conn);
    let store = SqliteStore::open(dir.path()).unwrap();
    let mut i = 10 * n + 1000;
    print(
        "intent: a whole effect call's bookkeeping (create + 4 attempt writes + commit)",
        &time(n, |_| {
            store_ops::effect_call(&store, i);
            i += 1;
        }),
    );
}

fn trace_append(n: usize) {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = Arc::new(SqliteStore::open(dir.path()).unwrap());
    print(
        "trace: one read call's 4 events, one txn, 1 caller",
        &time(n, |i| {
            store
                .append_events(store_ops::call_events(&format!("call_{i}")))
                .unwrap()
        }),
    );
    // 8 concurrent callers: their events share transactions (group commit).
    let per = n / 8;
    let samples = Arc::new(std::sync::Mutex::new(Vec::with_capacity(n)));
    let started = Instant::now();
    std::thread::scope(|s| {
        for t in 0..8 {
            let (store, samples) = (store.clone(), samples.clone());
            s.spawn(move || {
                let mut mine = Vec::with_capacity(per);
                for i in 0..per {
                    let start = Instant::now();
                    store
                        .append_events(store_ops::call_events(&format!("call_{t}_{i}")))
                        .unwrap();
                    mine.push(start.elapsed());
                }
                samples.lock().unwrap().extend(mine);
            });
        }
    });
    let elapsed = started.elapsed();
    let all = std::mem::take(&mut *samples.lock().unwrap());
    let calls = all.len();
    print(
        "trace: one read call's 4 events, 8 callers (group commit)",
        &stats(all),
    );
    println!(
        "{:<58} {:.0} calls/s traced",
        "  throughput with 8 callers",
        calls as f64 / elapsed.as_secs_f64()
    );
    // The floor: SQLite itself, same database, same settings.
    let raw = tempfile::tempdir().unwrap();
    let raw_store = SqliteStore::open(raw.path()).unwrap();
    drop(raw_store);
    let conn = rusqlite::Connection::open(raw.path().join("airlock.db")).unwrap();
    conn.pragma_update(None, "synchronous", "NORMAL").unwrap();
    print(
        "sqlite: empty BEGIN IMMEDIATE + COMMIT (the floor)",
        &time(n, |_| {
            conn.execute_batch("BEGIN IMMEDIATE; COMMIT;").unwrap();
        }),
    );
    let payload = "x".repeat(400);
    let mut next = 1_000_000_000i64;
    print(
        "sqlite: 4 rows of 400 bytes, one INSERT, one txn",
        &time(n, |_| {
            next += 4;
            conn.execute_batch("BEGIN IMMEDIATE").unwrap();
            conn.execute(
                "INSERT INTO trace_events (seq, at_ms, kind, subject, payload, prev_hash, hash) VALUES (?1, 0, 'k', 's', ?2, 'p', 'h'), (?1 + 1, 0, 'k', 's', ?2, 'p', 'h'), (?1 + 2, 0, 'k', 's', ?2, 'p', 'h'), (?1 + 3, 0, 'k', 's', ?2, 'p', 'h')",
                // Far above anything the store itself wrote when it opened.
                rusqlite::params![next, payload],
            )
            .unwrap();
            conn.execute_batch("COMMIT").unwrap();
        }),
    );
    assert!(store.verify_trace().unwrap().first_bad.is_none());
}

async fn host(state: &Path, no_call_trace: bool) -> Arc<Host> {
    let mut config = notes_config(env!("CARGO_BIN_EXE_airlock").into());
    config.state_dir = Some(state.to_path_buf());
    let manifest = Path::new(airlock::ADAPTER_BUNDLE).join("source-library/mapping.toml");
    let sqlite = SqliteStore::open(state).unwrap();
    let store: Arc<dyn Store> = if no_call_trace {
        Arc::new(NoCallTrace(sqlite))
    } else {
        Arc::new(sqlite)
    };
    let host = Host::start_with_registry(
        &config,
        vec![MappingSource::from_file(&manifest).unwrap()],
        Registry::new(store),
    )
    .await
    .unwrap();
    approve_all(&host, "bench").await.unwrap();
    host
}

fn obj(v: Value) -> Option<Map<String, Value>> {
    v.as_object().cloned()
}

async fn traced_calls(n: usize) {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let traced_host = host(a.path(), false).await;
    let with = traced_host.front(None).unwrap();
    let without = host(b.path(), true).await.front(None).unwrap();
    let once = |front: airlock::front::McpFront| async move {
        let start = Instant::now();
        let r = front
            .call(
                "search_sources",
                obj(json!({"query": "checkpoint", "limit": 1})),
            )
            .await
            .unwrap();
        assert_ne!(r.is_error, Some(true));
        start.elapsed()
    };
    let rounds = 10;
    let (mut w, mut wo) = (Vec::new(), Vec::new());
    for _ in 0..n / 10 {
        once(with.clone()).await;
        once(without.clone()).await;
    }
    for _ in 0..rounds {
        for _ in 0..n / rounds {
            w.push(once(with.clone()).await);
        }
        for _ in 0..n / rounds {
            wo.push(once(without.clone()).await);
        }
    }
    let (w, wo) = (stats(w), stats(wo));
    print("in-process tools/call search_sources, traced", &w);
    print(
        "in-process tools/call search_sources, call trace dropped",
        &wo,
    );
    println!(
        "{:<58} p50 +{:.1} µs   p99 +{:.1} µs",
        "  added by tracing every call",
        us(w.p50) - us(wo.p50),
        us(w.p99) - us(wo.p99)
    );
    // Per-stage p50 of the traced calls, from their own call-outcome events.
    let events = traced_host.registry().store().trace(0, usize::MAX).unwrap();
    let mut per: std::collections::BTreeMap<String, Vec<u64>> = Default::default();
    for e in events.iter().filter(|e| e.kind == "call-outcome") {
        if let Some(stages) = e.payload["stages_us"].as_object() {
            for (k, v) in stages {
                per.entry(k.clone())
                    .or_default()
                    .push(v.as_u64().unwrap_or(0));
            }
        }
        per.entry("total (elapsed_us)".into())
            .or_default()
            .push(e.payload["elapsed_us"].as_u64().unwrap_or(0));
    }
    let mut line = String::new();
    for (k, mut v) in per {
        v.sort_unstable();
        line.push_str(&format!("{k} {} µs; ", v[v.len() / 2]));
    }
    println!("  per-stage p50 inside the pipeline: {line}");
}

fn references(n: usize) {
    let version = ["version".to_string()];
    let origin = Origin {
        mapping: Arc::from("source-library"),
        generation: 1,
        revision: 1,
    };
    for live in [0usize, 10_000, 100_000] {
        let table = ReferenceTable::default();
        for i in 0..live {
            table.mint(
                &origin,
                "source-ref",
                &format!("held-{i}"),
                Map::new(),
                &version,
            );
        }
        let tokens: Vec<String> = (0..n)
            .map(|i| {
                table.mint(
                    &origin,
                    "source-ref",
                    &format!("note-{}", i % 64),
                    Map::new(),
                    &version,
                )
            })
            .collect();
        let mint = time(n, |i| {
            std::hint::black_box(table.mint(
                &origin,
                "source-ref",
                &format!("note-{}", i % 64),
                Map::new(),
                &version,
            ));
        });
        let resolve = time(n, |i| {
            std::hint::black_box(table.resolve(&tokens[i], "source-ref", &origin).unwrap());
        });
        print(&format!("references: mint, {live} live"), &mint);
        print(&format!("references: resolve, {live} live"), &resolve);
    }
}

async fn long_run(calls: usize) {
    let state = tempfile::tempdir().unwrap();
    let host = host(state.path(), false).await;
    for sessions in [1usize, 8] {
        let failed = Arc::new(AtomicUsize::new(0));
        let started = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..sessions {
            let front = host.front(None).unwrap();
            let failed = failed.clone();
            let per = calls / sessions;
            tasks.push(tokio::spawn(async move {
                for i in 0..per {
                    let hits = front
                        .call(
                            "search_sources",
                            obj(json!({"query": "checkpoint", "limit": 3})),
                        )
                        .await;
                    let reference = match hits {
                        Ok(r) if r.is_error != Some(true) => {
                            r.structured_content.unwrap()["result"][i % 3]["reference"]
                                .as_str()
                                .map(str::to_string)
                        }
                        _ => None,
                    };
                    let Some(reference) = reference else {
                        failed.fetch_add(1, Ordering::Relaxed);
                        continue;
                    };
                    match front
                        .call("retrieve_source", obj(json!({"reference": reference})))
                        .await
                    {
                        Ok(r) if r.is_error != Some(true) => {}
                        _ => {
                            failed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        println!(
            "{:<58} {} calls in {:.1} s: {} failed",
            format!("long run, {sessions} session(s), search + retrieve"),
            calls * 2,
            started.elapsed().as_secs_f64(),
            failed.load(Ordering::Relaxed)
        );
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n = iters();
    println!(
        "airlock pipeline benchmarks ({} build, {n} samples each, load average {})\n",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        load_average()
    );
    // AIRLOCK_BENCH_ONLY=policy|receipts|intents|trace|references|calls runs one section (for
    // profiling it with perf).
    let only = std::env::var("AIRLOCK_BENCH_ONLY").ok();
    let run = |name: &str| only.as_deref().is_none_or(|o| o == name);
    if run("policy") {
        policy_decisions(n);
    }
    if run("receipts") {
        receipts(n.min(5000));
    }
    if run("intents") {
        intent_bookkeeping(n.min(5000));
    }
    if run("trace") {
        trace_append(n);
    }
    if run("references") {
        references(n);
    }
    if run("calls") {
        traced_calls(n).await;
    }
    let long: usize = std::env::var("AIRLOCK_BENCH_LONG_CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    if long > 0 && only.is_none() {
        long_run(long / 2).await;
    }
    println!("\nload average at the end: {}", load_average());
}
