//! `airlock test MANIFEST --fixtures DIR`: runs a mapping's real component against
//! recorded fixtures ([`crate::record`]), with no live connection and no credentials.
//!
//! Rules:
//! - The component is the manifest's, loaded as a host loads it (pin checked, imports
//!   linked, the contract and every capability function exported) and run in wasmtime
//!   under the manifest's limits (memory, deadline, fuel, upstream request budget, output
//!   budgets, result size). Its upstream is [`crate::upstream::replay`]: no process is
//!   started, nothing leaves the process; a granted environment variable that names a
//!   secret is given the value [`crate::record::REDACTED`].
//! - Each fixture file is one contract call, replayed in byte order of file name: its
//!   input converted to the contract's parameter type, the function called, its result
//!   converted back through the contract's result type and compared with the recorded
//!   one. A fixture **fails** when the adapter asks for an exchange the fixture does not
//!   hold (`missing fixture: …`), when the result differs from the recorded one, or when
//!   the call fails where the recording returned (or returns where it failed).
//! - A fixture recorded under another mapping revision (revision number or manifest
//!   sha256) or another snapshot digest than the mapping under test is **stale** and
//!   refused, naming both, unless `--allow-stale`. The mapping under test is the newest
//!   store revision whose manifest sha256 is MANIFEST's; its snapshot is the one it pins,
//!   else (a candidate pins none) its connection's latest. Without a store (none named,
//!   none in the default state folder) both are unknown and every fixture is stale.
//! - Passing moves that revision from `candidate` to `fixture-tested` when it is the
//!   mapping's latest revision, with a MACed `mapping-state-changed` event carrying the
//!   fixture digest ([`crate::record::fixtures_digest`]), the number of fixtures and
//!   whether stale ones were allowed; `airlock review show` prints it.
//! - Exit status: 0 every fixture passed; 1 a fixture failed or is stale; 2 the
//!   manifest, component, store or a fixture file cannot be used (usage or configuration).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Result, anyhow, bail};
use serde::Serialize;
use serde_json::{Value, json};

use crate::record::{Answer, CallRecord, FixtureFile};
use crate::registry::Registry;
use crate::registry::live::MappingSource;
use crate::runtime::{CallContext, LoadedAdapter, Runtime, UpstreamGrant};
use crate::store::{MappingRecord, MappingState};

/// What `airlock test` was asked.
pub struct TestOptions<'a> {
    /// The mapping manifest (its component beside it).
    pub manifest: &'a Path,
    /// The fixture folder.
    pub fixtures: &'a Path,
    /// Replay fixtures recorded under another revision or snapshot.
    pub allow_stale: bool,
    /// The store's folder (`--state-dir`), when given.
    pub state_dir: Option<PathBuf>,
    /// A serve configuration naming the store (and its trace key), when given.
    pub config: Option<&'a Path>,
}

/// Why `airlock test` did not pass.
#[derive(Debug)]
pub enum TestError {
    /// The inputs cannot be used (exit status 2).
    Usage(anyhow::Error),
}

/// The report of one `airlock test` run.
#[derive(Debug, Serialize)]
pub struct TestReport {
    /// The mapping's name.
    pub mapping: String,
    /// sha256 of the manifest under test.
    pub manifest_sha256: String,
    /// The store revision under test, when the store records this manifest.
    pub revision: Option<i64>,
    /// The snapshot the mapping under test is bound to, when known.
    pub snapshot_digest: Option<String>,
    /// The fixture folder's digest (see [`crate::record::fixtures_digest`]).
    pub fixtures_sha256: String,
    /// True when every fixture passed (and none was stale, or `--allow-stale`).
    pub passed: bool,
    /// One entry per fixture file, in the order replayed.
    pub fixtures: Vec<FixtureResult>,
    /// Calls per contract function exercised.
    pub functions: BTreeMap<String, u64>,
    /// The manifest's capability functions no fixture exercised.
    pub not_exercised: Vec<String>,
    /// The error paths the fixtures exercised, in words (`search → err(not-found)`,
    /// `search ← tools/call search_notes: upstream error`), each once.
    pub error_paths: Vec<String>,
    /// The error cases of the exercised functions' contract error types that no fixture
    /// returned (`search → err(not-found)`): what a recording could still cover.
    pub error_cases_not_exercised: Vec<String>,
    /// Why fixtures are stale, one line each (empty when none is).
    pub stale: Vec<String>,
    /// Whether stale fixtures were replayed anyway.
    pub allow_stale: bool,
    /// The lifecycle state before the test, when recorded.
    pub state_before: Option<MappingState>,
    /// The lifecycle state after the test, when recorded.
    pub state_after: Option<MappingState>,
    /// What happened to the state, in words.
    pub state_note: String,
}

/// One replayed fixture.
#[derive(Debug, Serialize)]
pub struct FixtureResult {
    /// The file's name.
    pub file: String,
    /// The contract function.
    pub function: String,
    /// True when it passed.
    pub passed: bool,
    /// Why it did not, one line each.
    pub problems: Vec<String>,
    /// Recorded exchanges the adapter asked for.
    pub exchanges_used: usize,
    /// Recorded exchanges.
    pub exchanges_recorded: usize,
    /// `ok`, `err(CASE)`, or `failure(KIND)`: what the call returned in replay.
    pub outcome: String,
}

/// Runs `airlock test`. `Ok(report)`: the fixtures ran (or were refused as stale); the
/// report says whether they passed.
///
/// # Errors
/// [`TestError::Usage`]: the manifest, component, store or a fixture cannot be used.
pub async fn run(options: &TestOptions<'_>) -> Result<TestReport, TestError> {
    let usage = TestError::Usage;
    let source = MappingSource::from_file(options.manifest).map_err(usage)?;
    let manifest = &source.manifest;
    let name = manifest.mapping.name.clone();
    let files = crate::record::load_dir(options.fixtures).map_err(usage)?;
    for f in &files {
        if f.fixture.mapping.name != name {
            return Err(usage(anyhow!(
                "fixture {} was recorded for mapping `{}`, not `{name}` (the mapping {} declares)",
                f.name,
                crate::cli::operate::safe_lines(&f.fixture.mapping.name),
                options.manifest.display()
            )));
        }
    }
    let registry = open_store(options).map_err(usage)?;
    // The contracts a host of `--config` would serve (the built-ins without one).
    let contracts = match options.config {
        Some(path) => {
            let config = crate::config::ServeConfig::load(path).map_err(usage)?;
            crate::registry::contracts::ContractSet::judge(
                &config,
                registry.as_ref().map(|r| r.store()),
            )
            .map_err(usage)?
        }
        None => crate::registry::contracts::ContractSet::built_in(),
    };
    let revisions = match &registry {
        Some(r) => r.store().mapping_revisions(&name).map_err(usage)?,
        None => Vec::new(),
    };
    let under_test: Option<MappingRecord> = revisions
        .iter()
        .rev()
        .find(|r| r.manifest_digest == source.manifest_digest)
        .cloned();
    let snapshot = match (&under_test, &registry) {
        (Some(r), Some(registry)) => match &r.snapshot_digest {
            Some(d) => Some(d.clone()),
            None => registry
                .store()
                .latest_snapshot(&r.connection_id)
                .map_err(usage)?
                .map(|s| s.digest),
        },
        _ => None,
    };
    let mut report = TestReport {
        mapping: name.clone(),
        manifest_sha256: source.manifest_digest.clone(),
        revision: under_test.as_ref().map(|r| r.revision),
        snapshot_digest: snapshot.clone(),
        fixtures_sha256: crate::record::fixtures_digest(&files),
        passed: false,
        fixtures: Vec::new(),
        functions: BTreeMap::new(),
        not_exercised: Vec::new(),
        error_paths: Vec::new(),
        error_cases_not_exercised: Vec::new(),
        stale: if registry.is_some() {
            stale_reasons(&files, &source, under_test.as_ref(), snapshot.as_deref())
        } else {
            vec![format!(
                "no store to compare with (none in the default state folder): the revision and snapshot of the mapping under test are unknown; pass --state-dir or --config, or --allow-stale to replay {} fixture(s) anyway",
                files.len()
            )]
        },
        allow_stale: options.allow_stale,
        state_before: under_test.as_ref().map(|r| r.state),
        state_after: under_test.as_ref().map(|r| r.state),
        state_note: String::new(),
    };
    if !report.stale.is_empty() && !options.allow_stale {
        report.state_note = "not run: stale fixtures (record again with `airlock serve --record DIR`, or pass --allow-stale to replay them anyway)".into();
        return Ok(report);
    }
    replay_all(&source, &contracts, &files, &mut report)
        .await
        .map_err(usage)?;
    report.passed = report.fixtures.iter().all(|f| f.passed);
    report.state_note = match &registry {
        Some(registry) => {
            move_state(registry, &revisions, under_test.as_ref(), &mut report).map_err(usage)?
        }
        None => "state unchanged: no store".into(),
    };
    Ok(report)
}

/// The store named by `--config` or `--state-dir` (required to exist), else the default
/// state folder's when it has one (`None` when it has not: fixtures are then stale).
fn open_store(options: &TestOptions<'_>) -> Result<Option<Registry>> {
    if let Some(path) = options.config {
        let mut config = crate::config::ServeConfig::load(path)?;
        if options.state_dir.is_some() {
            config.state_dir = options.state_dir.clone();
        }
        return crate::registry::live::open_registry(&config).map(Some);
    }
    if crate::cli::shared_store().is_some() {
        // The shared store needs no folder when AIRLOCK_TRACE_KEY holds the key.
        let dir = options
            .state_dir
            .clone()
            .or_else(crate::config::default_state_dir);
        return crate::cli::operate::registry_at(dir.as_deref()).map(Some);
    }
    let Some(dir) = options.state_dir.clone() else {
        return match crate::config::default_state_dir() {
            Some(dir)
                if std::fs::symlink_metadata(dir.join(crate::store::DATABASE_FILE)).is_ok() =>
            {
                crate::cli::operate::registry_at(Some(&dir)).map(Some)
            }
            _ => Ok(None),
        };
    };
    if std::fs::symlink_metadata(dir.join(crate::store::DATABASE_FILE)).is_err() {
        bail!(
            "no Airlock state in {} (no {}): `airlock test` compares the fixtures with the store's record of the mapping; pass the --state-dir (or --config) of the host that loads it",
            dir.display(),
            crate::store::DATABASE_FILE
        );
    }
    crate::cli::operate::registry_at(Some(&dir)).map(Some)
}

/// Why each fixture is stale against the mapping under test (none: empty).
fn stale_reasons(
    files: &[FixtureFile],
    source: &MappingSource,
    under_test: Option<&MappingRecord>,
    snapshot: Option<&str>,
) -> Vec<String> {
    let short = crate::registry::short;
    let mut out = Vec::new();
    for f in files {
        let m = &f.fixture.mapping;
        match under_test {
            None => out.push(format!(
                "{}: recorded under mapping `{}` revision {} (manifest sha256 {}); the manifest under test (sha256 {}) is not recorded in this store (a host records it when it loads it)",
                f.name,
                m.name,
                m.revision,
                short(&m.manifest_sha256),
                short(&source.manifest_digest)
            )),
            Some(r) if r.revision != m.revision || r.manifest_digest != m.manifest_sha256 => {
                out.push(format!(
                    "{}: recorded under mapping `{}` revision {} (manifest sha256 {}); the mapping under test is revision {} (manifest sha256 {})",
                    f.name,
                    m.name,
                    m.revision,
                    short(&m.manifest_sha256),
                    r.revision,
                    short(&r.manifest_digest)
                ));
            }
            Some(_) => {}
        }
        if let Some(now) = snapshot
            && now != f.fixture.snapshot_digest
        {
            out.push(format!(
                "{}: recorded under snapshot {}; the mapping under test is bound to snapshot {}",
                f.name,
                short(&crate::cli::operate::safe_lines(&f.fixture.snapshot_digest)),
                short(now)
            ));
        }
    }
    out
}

/// Loads the component and replays every fixture into `report`: the call counts per
/// function, one [`FixtureResult`] per file, the error paths exercised and the error cases
/// and capability functions no fixture reached.
///
/// # Errors
/// The contract, the component or its replay connection cannot be loaded; a contract
/// function takes no parameter.
async fn replay_all(
    source: &MappingSource,
    contracts: &crate::registry::contracts::ContractSet,
    files: &[FixtureFile],
    report: &mut TestReport,
) -> Result<()> {
    let replayer = Replayer::load(source, contracts, report.snapshot_digest.clone()).await?;
    let mut error_paths = BTreeSet::new();
    for f in files {
        let result = replayer.replay(f, report, &mut error_paths).await?;
        report.fixtures.push(result);
    }
    report.error_cases_not_exercised =
        error_cases_not_exercised(&replayer.contract, &report.functions, &error_paths);
    report.error_paths = error_paths.into_iter().collect();
    report.not_exercised = replayer
        .offered
        .iter()
        .filter(|f| !report.functions.contains_key(**f))
        .map(|f| f.to_string())
        .collect();
    Ok(())
}

/// The mapping's component loaded as a host loads it, its upstream a
/// [`crate::upstream::replay::Replay`] that answers from the fixture being replayed.
struct Replayer<'a> {
    /// The contract functions the manifest offers as capabilities.
    offered: Vec<&'a str>,
    /// What the adapter may reach: the replay connection, the manifest's tools and budget.
    grant: Arc<UpstreamGrant>,
    /// The recorded answers of the fixture being replayed.
    replay: Arc<crate::upstream::replay::Replay>,
    adapter: LoadedAdapter,
    /// Kept alive while the adapter runs: it ticks the epoch that bounds each call.
    _runtime: Runtime,
    contract: std::sync::Arc<crate::contract::Contract>,
}

impl<'a> Replayer<'a> {
    /// Loads `source`'s contract and component (a granted secret's value is
    /// [`crate::record::REDACTED`]) over a replay connection bound to `snapshot`.
    async fn load(
        source: &'a MappingSource,
        contracts: &crate::registry::contracts::ContractSet,
        snapshot: Option<String>,
    ) -> Result<Self> {
        let manifest = &source.manifest;
        let contract = contracts.get(&manifest.mapping.contract)?;
        let env = manifest
            .grants
            .env
            .iter()
            .map(|(k, v)| {
                let value = match v {
                    crate::runtime::grants::EnvValue::Value(v) => v.clone(),
                    crate::runtime::grants::EnvValue::Secret { .. } => {
                        crate::record::REDACTED.to_string()
                    }
                };
                (k.clone(), value)
            })
            .collect();
        let runtime = Runtime::new()?;
        let adapter = runtime.load_with_env(manifest, &source.component, &contract, env)?;
        let replay = Arc::new(crate::upstream::replay::Replay::default());
        let connection = crate::upstream::Connection::start_replay(
            &manifest.mapping.connection,
            replay.clone(),
            manifest.limits.max_output_bytes,
        )
        .await?;
        let budget = crate::runtime::budgets::OutputBudget::from_limits(&manifest.limits)
            .map_err(|why| anyhow!("[limits] allowed_media_types {why}"))?;
        let grant = Arc::new(UpstreamGrant {
            mapping: manifest.mapping.name.clone(),
            connection: Arc::new(arc_swap::ArcSwap::from_pointee(connection)),
            snapshot: Arc::new(arc_swap::ArcSwap::from_pointee(
                snapshot.unwrap_or_default(),
            )),
            tools: manifest.upstream.tools.iter().cloned().collect(),
            resource_prefixes: manifest.upstream.resources.clone(),
            budget,
        });
        let offered = manifest
            .capabilities
            .iter()
            .map(|c| c.function.as_str())
            .collect();
        Ok(Self {
            offered,
            grant,
            replay,
            adapter,
            _runtime: runtime,
            contract,
        })
    }

    /// Replays one fixture file: counts its function in `report`, calls it with the
    /// recorded input and compares what it returns with the recording. The error paths
    /// the call went through are added to `error_paths`.
    ///
    /// # Errors
    /// The contract function takes no parameter (the contract cannot be used at all).
    async fn replay(
        &self,
        f: &FixtureFile,
        report: &mut TestReport,
        error_paths: &mut BTreeSet<String>,
    ) -> Result<FixtureResult> {
        let call = &f.fixture.call;
        let mut result = FixtureResult {
            file: f.name.clone(),
            function: call.function.clone(),
            passed: false,
            problems: Vec::new(),
            exchanges_used: 0,
            exchanges_recorded: f.fixture.exchanges.len(),
            outcome: String::new(),
        };
        let function = self
            .contract
            .functions
            .get(&call.function)
            .filter(|_| self.offered.contains(&call.function.as_str()));
        let Some(function) = function else {
            result.problems.push(format!(
                "the manifest offers no capability for contract function `{}` (it offers: {})",
                crate::cli::operate::safe_lines(&call.function),
                self.offered.join(", ")
            ));
            return Ok(result);
        };
        *report.functions.entry(function.name.clone()).or_default() += 1;
        let Some((_, shape)) = function.params.first() else {
            bail!("contract function `{}` takes no parameter", function.name);
        };
        let mut locator = |_: &str, l: &str| -> Result<String, String> { Ok(l.to_string()) };
        let mut param = match crate::contract::json_to_val(shape, &call.input, &mut locator) {
            Ok(p) => p,
            Err(e) => {
                result.problems.push(format!(
                    "the recorded input does not have the contract's type for `{}`: {e}",
                    function.name
                ));
                return Ok(result);
            }
        };
        if let Some(key) = &call.idempotency_key {
            crate::contract::fill_host_supplied(shape, &mut param, key);
        }
        self.replay
            .load(&f.name, &f.fixture.exchanges, &f.fixture.redacted_fields);
        let context = CallContext {
            intent_id: call
                .idempotency_key
                .as_ref()
                .map(|_| "int_replay".to_string()),
            idempotency_key: call.idempotency_key.clone(),
            attempt: u32::from(call.idempotency_key.is_some()),
            ..CallContext::default()
        };
        let outcome = self
            .adapter
            .call(
                &function.name,
                std::slice::from_ref(&param),
                self.grant.clone(),
                context,
            )
            .await;
        result.problems.extend(self.replay.misses());
        (result.exchanges_used, _) = self.replay.used();
        upstream_error_paths(&function.name, f, &outcome.refused, error_paths);
        compare_outcome(function, &outcome, &call.outcome, &mut result, error_paths);
        result.passed = result.problems.is_empty();
        Ok(result)
    }
}

/// Adds the upstream error paths of one replayed call to `error_paths`: each recorded
/// exchange that did not answer with a result (`search ← tools/call search_notes: upstream
/// error`), and each answer the host refused (`… refused (WHY)`).
fn upstream_error_paths(
    function: &str,
    f: &FixtureFile,
    refused: &[crate::runtime::RefusedAnswer],
    error_paths: &mut BTreeSet<String>,
) {
    for x in &f.fixture.exchanges {
        if !matches!(x.answer, Answer::Result(_)) {
            let target = x
                .params
                .get("name")
                .or_else(|| x.params.get("uri"))
                .and_then(Value::as_str)
                .unwrap_or("?");
            error_paths.insert(format!(
                "{} ← {} {}: {}",
                function,
                x.method,
                crate::cli::operate::safe_lines(target),
                x.answer.kind()
            ));
        }
    }
    for r in refused {
        error_paths.insert(format!(
            "{} ← {} {}: refused ({})",
            function,
            r.method,
            r.target,
            match &r.why {
                crate::runtime::Refused::Budget(b) => b.to_string(),
                crate::runtime::Refused::Degraded(d) => d.clone(),
            }
        ));
    }
}

/// Converts what the call returned back through the contract's result type into
/// `result.outcome`, adds its error path (`search → err(not-found)`, `… → failure(KIND)`)
/// to `error_paths`, and a problem to `result` when it differs from `recorded`.
fn compare_outcome(
    function: &crate::contract::ContractFunction,
    outcome: &crate::runtime::CallOutcome,
    recorded: &CallRecord,
    result: &mut FixtureResult,
    error_paths: &mut BTreeSet<String>,
) {
    let mut handles = |_: &str, l: &str| -> Result<String> { Ok(l.to_string()) };
    let got = match (&outcome.result, &function.result) {
        (Ok(val), Some(shape)) => crate::contract::val_to_json(shape, val, &mut handles)
            .map(CallRecord::Result)
            .map_err(|e| format!("the result does not have the contract's type: {e:#}")),
        (Ok(_), None) => Ok(CallRecord::Result(Value::Null)),
        (Err(failure), _) => Ok(CallRecord::Failure(failure.kind().to_string())),
    };
    match got {
        Err(why) => result.problems.push(why),
        Ok(got) => {
            result.outcome = outcome_name(&got);
            if let CallRecord::Result(Value::Object(o)) = &got
                && o.contains_key("err")
            {
                error_paths.insert(format!("{} → {}", function.name, result.outcome));
            }
            if let CallRecord::Failure(kind) = &got {
                error_paths.insert(format!("{} → failure({kind})", function.name));
            }
            if got != *recorded {
                result.problems.push(format!(
                    "returned {}, recorded {}",
                    clip(&record_text(&got)),
                    clip(&record_text(recorded))
                ));
            }
        }
    }
}

/// The error cases (`search → err(not-found)`) of the exercised `functions`' contract
/// error types (a variant's or an enum's cases) that are not among `error_paths`, in
/// function then case order.
fn error_cases_not_exercised(
    contract: &crate::contract::Contract,
    functions: &BTreeMap<String, u64>,
    error_paths: &BTreeSet<String>,
) -> Vec<String> {
    let mut out = Vec::new();
    for name in functions.keys() {
        let Some(crate::contract::Shape::Result { err: Some(err), .. }) =
            contract.functions.get(name).and_then(|f| f.result.as_ref())
        else {
            continue;
        };
        let cases: Vec<String> = match err.as_ref() {
            crate::contract::Shape::Variant(cases) => {
                cases.iter().map(|(c, _)| c.clone()).collect()
            }
            crate::contract::Shape::Enum(cases) => cases.clone(),
            _ => continue,
        };
        for case in cases {
            let path = format!("{name} → err({case})");
            if !error_paths.contains(&path) {
                out.push(path);
            }
        }
    }
    out
}

fn record_text(r: &CallRecord) -> String {
    match r {
        CallRecord::Result(v) => v.to_string(),
        CallRecord::Failure(kind) => format!("failure({kind})"),
    }
}

fn outcome_name(r: &CallRecord) -> String {
    match r {
        CallRecord::Failure(kind) => format!("failure({kind})"),
        CallRecord::Result(Value::Object(o)) if o.contains_key("err") => match &o["err"] {
            Value::String(case) => format!("err({case})"),
            Value::Object(e) if e.len() == 1 => {
                format!("err({})", e.keys().next().map_or("?", String::as_str))
            }
            _ => "err".into(),
        },
        CallRecord::Result(_) => "ok".into(),
    }
}

fn clip(text: &str) -> String {
    let shown = crate::cli::operate::safe_lines(text);
    if shown.chars().count() > 400 {
        shown.chars().take(400).collect::<String>() + "…"
    } else {
        shown
    }
}

/// Moves a candidate that passed to `fixture-tested`; returns what happened, in words.
fn move_state(
    registry: &Registry,
    revisions: &[MappingRecord],
    under_test: Option<&MappingRecord>,
    report: &mut TestReport,
) -> Result<String> {
    let Some(rec) = under_test else {
        return Ok("state unchanged: the store records no revision of this manifest".into());
    };
    if !report.passed {
        return Ok(format!(
            "state unchanged: revision {} stays {}",
            rec.revision, rec.state
        ));
    }
    let latest = revisions.last().map_or(0, |r| r.revision);
    if rec.revision != latest {
        return Ok(format!(
            "state unchanged: revision {} is not the mapping's latest (revision {latest} is)",
            rec.revision
        ));
    }
    if rec.state != MappingState::Candidate {
        return Ok(format!(
            "state unchanged: revision {} is {} (only a candidate becomes fixture-tested)",
            rec.revision, rec.state
        ));
    }
    let reason = format!(
        "passed {} fixture(s) sha256 {}{}",
        report.fixtures.len(),
        report.fixtures_sha256,
        if report.stale.is_empty() {
            ""
        } else {
            " (stale fixtures allowed)"
        }
    );
    let event = crate::store::NewEvent::new(
        crate::registry::events::MAPPING_STATE,
        rec.name.clone(),
        json!({
            "from": MappingState::Candidate,
            "to": MappingState::FixtureTested,
            "reason": reason,
            "fixtures_sha256": report.fixtures_sha256,
            "fixtures": report.fixtures.len(),
            "stale_allowed": !report.stale.is_empty(),
        }),
    );
    match registry.store().set_mapping_state_traced(
        &rec.name,
        MappingState::Candidate,
        MappingState::FixtureTested,
        &reason,
        vec![event],
    )? {
        Some(after) => {
            report.state_after = Some(after.state);
            Ok(format!(
                "revision {}: candidate → fixture-tested (traced); `airlock review approve {}` next",
                after.revision, after.name
            ))
        }
        None => Ok("state unchanged: the revision's state changed meanwhile".into()),
    }
}

impl TestReport {
    /// For a person.
    pub fn to_text(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "airlock test: mapping `{}` (manifest sha256 {}), {}, fixtures sha256 {}",
            self.mapping,
            crate::registry::short(&self.manifest_sha256),
            match self.revision {
                Some(r) => format!("revision {r}"),
                None => "not recorded in the store".into(),
            },
            self.fixtures_sha256
        );
        if !self.stale.is_empty() {
            let _ = writeln!(
                o,
                "{} stale:",
                if self.allow_stale {
                    "replayed anyway (--allow-stale)"
                } else {
                    "REFUSED"
                }
            );
            for s in &self.stale {
                let _ = writeln!(o, "  {s}");
            }
        }
        for f in &self.fixtures {
            let _ = writeln!(
                o,
                "  {} {:<28} {:<10} {} ({} of {} exchanges)",
                if f.passed { "pass" } else { "FAIL" },
                f.file,
                f.function,
                f.outcome,
                f.exchanges_used,
                f.exchanges_recorded
            );
            for p in &f.problems {
                let _ = writeln!(o, "       {p}");
            }
        }
        let functions: Vec<String> = self
            .functions
            .iter()
            .map(|(f, n)| format!("{f} ×{n}"))
            .collect();
        let _ = writeln!(
            o,
            "functions exercised: {}",
            if functions.is_empty() {
                "none".into()
            } else {
                functions.join(", ")
            }
        );
        if !self.not_exercised.is_empty() {
            let _ = writeln!(o, "not exercised: {}", self.not_exercised.join(", "));
        }
        let _ = writeln!(
            o,
            "error paths exercised: {}",
            if self.error_paths.is_empty() {
                "none".into()
            } else {
                self.error_paths.join("; ")
            }
        );
        if !self.error_cases_not_exercised.is_empty() {
            let _ = writeln!(
                o,
                "error cases no fixture returned: {}",
                self.error_cases_not_exercised.join("; ")
            );
        }
        let _ = writeln!(
            o,
            "{}: {}",
            if self.passed { "PASSED" } else { "FAILED" },
            self.state_note
        );
        o
    }
}
