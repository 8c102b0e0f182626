//! Mapping loading: from a manifest and its component to a bound mapping with its
//! capabilities.
//!
//! Rules:
//! - **Verified before anything runs upstream**: a mapping is checked against its
//!   contract ([`check_contract`]), its env grants resolved against the serve
//!   configuration's secrets, and its component verified against its pin, compiled and
//!   linked (`prepare`) before any upstream process starts, so a refused component
//!   never causes upstream traffic.
//! - **A mapping serves only under its recorded revision and pins** (see
//!   [`crate::registry`]): binding registers the revision, proves a serving record by the
//!   trace, and judges it against its connection's snapshot (or, before the first one,
//!   when the connection becomes ready).
//! - **An unreviewed change never replaces a reviewed revision**: a changed manifest
//!   arriving while a reviewed revision serves is staged, not swapped in.
//! - **A refused mapping is refused alone** (`mapping-load-failed`): a component not
//!   matching its pin, a name another mapping already has, a capability name another
//!   mapping already offers, a connection that cannot be identified; on a reload the old
//!   revision keeps serving.
//! - A capability's input schema is derived from its contract function's single record
//!   parameter; the model never sees the upstream's schema.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context as _, Result, bail};
use arc_swap::ArcSwap;
use rmcp::model::JsonObject;
use serde_json::{Value, json};
use sha2::Digest as _;

use super::catalog::{ActiveMapping, Capability, LoadedMapping};
use super::connections::ConnectionState;
use super::live::Live;
use crate::config::ServeConfig;
use crate::contract::{self, ContractFunction, Shape};
use crate::registry::Verdict;
use crate::registry::manifest::MappingManifest;
use crate::runtime::{LoadedAdapter, Runtime, UpstreamGrant};
use crate::store::MappingRecord;

/// The outcome of binding a mapping.
pub(super) enum Bound {
    /// Bound to its recorded revision: swap it in.
    Loaded(Arc<ActiveMapping>, Vec<Capability>),
    /// An unreviewed change while a reviewed revision serves: keep it aside.
    Staged(Arc<ActiveMapping>, Vec<Capability>),
}

/// A mapping to load: its manifest and the component bytes it pins.
pub struct MappingSource {
    /// The parsed manifest.
    pub manifest: MappingManifest,
    /// sha256 (hex) of the manifest's text.
    pub manifest_digest: String,
    /// The manifest's text.
    pub text: String,
    /// Where it was read from, if from a file.
    pub path: Option<PathBuf>,
    /// The component bytes (verified against the pin when loaded).
    pub component: Vec<u8>,
}

impl MappingSource {
    /// Reads the manifest at `path` and the component file it names.
    ///
    /// # Errors
    /// Unreadable or invalid manifest or component file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading mapping manifest {}", path.display()))?;
        let manifest =
            MappingManifest::parse_in(&text, &path.display().to_string(), path.parent())?;
        let base = path.parent().unwrap_or(Path::new("."));
        let component = crate::runtime::read_component(&manifest.component_path(base))
            .with_context(|| format!("mapping `{}`", manifest.mapping.name))?;
        Ok(Self {
            manifest,
            manifest_digest: crate::registry::manifest_digest(&text),
            text,
            path: Some(path.to_path_buf()),
            component,
        })
    }

    /// A source from manifest text and component bytes held in memory.
    ///
    /// # Errors
    /// The manifest does not parse.
    pub fn from_memory(text: &str, source: &str, component: Vec<u8>) -> Result<Self> {
        Ok(Self {
            manifest: MappingManifest::parse(text, source)?,
            manifest_digest: crate::registry::manifest_digest(text),
            text: text.to_string(),
            path: None,
            component,
        })
    }
}

/// A loaded (verified, compiled, linked) mapping that is not yet bound to a connection.
pub(super) struct Prepared {
    pub(super) source: MappingSource,
    contract: Arc<crate::contract::Contract>,
    adapter: LoadedAdapter,
}

impl Live {
    /// Logs and traces a mapping refused at start (the others load); returns the reason.
    pub(super) fn refuse_mapping(
        &self,
        name: &str,
        path: Option<&Path>,
        e: &anyhow::Error,
    ) -> String {
        let why = format!("mapping `{name}` refused: {e:#}");
        tracing::error!(mapping = %name, "{why}; the other mappings load");
        self.registry.trace(
            crate::registry::events::MAPPING_LOAD_FAILED,
            &path.map_or_else(|| name.to_string(), |p| p.display().to_string()),
            json!({
                "mapping": name,
                "error": format!("{e:#}").chars().take(2000).collect::<String>(),
            }),
        );
        why
    }

    /// Binds a prepared mapping to its connection: registers the revision, evaluates its
    /// pins against the connection's snapshot, and builds its capabilities. With `stage`
    /// (a reviewed revision of this mapping serves here), an unreviewed manifest is bound
    /// but marked staged: the caller keeps it aside instead of swapping it in.
    pub(super) async fn bind(self: &Arc<Self>, p: Prepared, stage: bool) -> Result<Bound> {
        let m = &p.source.manifest;
        let name = m.mapping.name.clone();
        let state = self
            .connection(&m.mapping.connection, m.limits.max_output_bytes)
            .await?;
        let registration = self.registry.register_mapping(
            m,
            Some(&p.source.text),
            &p.source.manifest_digest,
            p.adapter.component_sha256(),
            &state.revision,
            stage,
        )?;
        let mut record = match registration {
            // A serving record must be proven by the trace before anything else.
            crate::registry::Registration::Recorded(record) => self.registry.proven(*record),
            crate::registry::Registration::Staged { reason } => {
                tracing::warn!(mapping = %name, "changed manifest staged; the reviewed revision keeps serving until this one is approved: {reason}");
                let staged = MappingRecord {
                    name: name.clone(),
                    revision: 0,
                    manifest_digest: p.source.manifest_digest.clone(),
                    component_sha256: p.adapter.component_sha256().to_string(),
                    connection_id: state.revision.connection_id.clone(),
                    config_revision: state.revision.revision,
                    snapshot_digest: None,
                    pins: Value::Null,
                    state: crate::store::MappingState::Candidate,
                    reviewer: None,
                    reason: format!("staged, not reviewed: {reason}"),
                    created_ms: 0,
                    state_changed_ms: 0,
                    manifest_text: None,
                };
                let (mapping, caps) = assemble(p, state, staged)?;
                return Ok(Bound::Staged(mapping, caps));
            }
        };
        if state.snapshot_digest().is_empty() {
            // The connection has not started yet: its mappings are judged against their
            // pins once it has (see `install`), before anything of theirs is offered.
            tracing::warn!(mapping = %name, connection = %m.mapping.connection, status = %state.status(), "mapping loaded; not offered until its connection starts and its pins are checked");
        } else {
            match self
                .registry
                .evaluate(&record, &m.upstream.tools, &state.catalogue())
            {
                Verdict::Serves => {
                    tracing::info!(mapping = %name, revision = record.revision, state = %record.state, "mapping serves");
                }
                Verdict::Blocked {
                    reason,
                    drift,
                    needs_review,
                } => {
                    if needs_review
                        && let Some(new) = self.registry.require_review(
                            &record,
                            &reason,
                            &drift,
                            &state.snapshot_digest(),
                        )?
                    {
                        record = new;
                    }
                    tracing::warn!(
                        mapping = %name,
                        revision = record.revision,
                        state = %record.state,
                        "mapping loaded but not offered: {reason}. Review it: `airlock discover {connection} --config FILE`, `airlock review show {name}`, then `airlock review approve {name} --config FILE --reviewer NAME`", connection = m.mapping.connection
                    );
                }
            }
        }
        self.registry.trace(
            crate::registry::events::MAPPING_LOADED,
            &name,
            json!({
                "revision": record.revision,
                "state": record.state,
                "component_sha256": p.adapter.component_sha256(),
                "manifest_digest": p.source.manifest_digest,
                "connection_id": state.revision.connection_id,
            }),
        );
        let (mapping, caps) = assemble(p, state, record)?;
        Ok(Bound::Loaded(mapping, caps))
    }

    /// Loads (or reloads) the mapping at `path` and swaps it into the catalog atomically.
    /// Calls already running finish on the revision they started with. On failure the old
    /// revision, if any, keeps serving, and the failure is traced.
    ///
    /// # Errors
    /// The manifest or component is invalid or unverifiable; compiling failed.
    pub async fn load_mapping_file(self: &Arc<Self>, path: &Path) -> Result<String> {
        let _one = self.reload.lock().await;
        let result = async {
            let source = MappingSource::from_file(path)?;
            let name = source.manifest.mapping.name.clone();
            let current = self.catalog.load_full();
            if let Some(old) = current.mappings.get(&name) {
                let bytes_sha256 = hex::encode(sha2::Sha256::digest(&source.component));
                if old.manifest_digest == source.manifest_digest
                    && old.adapter.component_sha256() == bytes_sha256
                {
                    return Ok((name, false));
                }
                if old.manifest_path.as_deref() != Some(path) {
                    bail!(
                        "mapping `{name}` is already loaded from {}",
                        old.manifest_path
                            .as_deref()
                            .map(|p| p.display().to_string())
                            .unwrap_or_else(|| "memory".into())
                    );
                }
            }
            // Verify and compile off the request path.
            let host = self.clone();
            let prepared = tokio::task::spawn_blocking(move || {
                let contracts = super::contracts::ContractSet::judge(
                    &host.config,
                    Some(host.registry.store()),
                )?;
                prepare(&host.runtime, &host.config, &contracts, source)
            })
            .await
            .context("the compile task failed")??;
            let serving = current.mappings.get(&name).is_some_and(|m| m.serves());
            match self.bind(prepared, serving).await? {
                Bound::Loaded(mapping, caps) => {
                    self.staged
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&name);
                    let next = self.catalog.load_full().with((mapping, caps))?;
                    self.catalog.store(Arc::new(next));
                    Ok((name, true))
                }
                Bound::Staged(mapping, caps) => {
                    self.staged
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(name.clone(), (mapping, caps));
                    Ok((name, false))
                }
            }
        }
        .await;
        match result {
            Ok((name, swapped)) => {
                if swapped {
                    tracing::info!(mapping = %name, manifest = %path.display(), "mapping revision swapped in");
                    self.notify_changed();
                }
                Ok(name)
            }
            Err(e) => {
                tracing::error!(manifest = %path.display(), "mapping not loaded; any previous revision keeps serving: {e:#}");
                self.registry.trace(
                    crate::registry::events::MAPPING_LOAD_FAILED,
                    &path.display().to_string(),
                    json!({"error": format!("{e:#}").chars().take(2000).collect::<String>()}),
                );
                Err(e)
            }
        }
    }

    /// Unloads mapping `name`: its capabilities leave the catalog and no reference minted
    /// for it resolves again (its load generation is gone). Calls already running finish.
    pub async fn unload_mapping(&self, name: &str) -> bool {
        let _one = self.reload.lock().await;
        self.staged
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
        let current = self.catalog.load_full();
        let Some(old) = current.mappings.get(name).cloned() else {
            return false;
        };
        let next = current.without(name);
        // References minted under it carry its load generation: they no longer resolve.
        self.catalog.store(Arc::new(next));
        self.registry.trace(
            crate::registry::events::MAPPING_UNLOADED,
            name,
            json!({"revision": old.record().revision}),
        );
        tracing::info!(mapping = %name, "mapping unloaded; its references are revoked");
        self.notify_changed();
        true
    }
}

/// Verifies, compiles and links one mapping (no upstream traffic).
///
/// # Errors
/// The mapping names a connection `config` does not define, or a secret its `[secrets]`
/// do not; its contract check fails ([`check_contract`]); the component does not match
/// its pin, or does not compile or link.
pub(super) fn prepare(
    runtime: &Runtime,
    config: &ServeConfig,
    contracts: &super::contracts::ContractSet,
    source: MappingSource,
) -> Result<Prepared> {
    let m = &source.manifest;
    if !config.connections.contains_key(&m.mapping.connection) {
        bail!(
            "mapping `{}` uses connection `{}`, which the serve configuration does not define",
            m.mapping.name,
            m.mapping.connection
        );
    }
    let contract = check_contract(m, contracts)?;
    let mut env = Vec::new();
    for (key, value) in &m.grants.env {
        let value = match value {
            crate::runtime::grants::EnvValue::Value(v) => v.clone(),
            crate::runtime::grants::EnvValue::Secret { secret } => config
                .secrets
                .get(secret)
                .map(|s| s.0.clone())
                .with_context(|| {
                    format!(
                        "mapping `{}`: env grant {key} names secret `{secret}`, which the serve configuration's [secrets] does not define",
                        m.mapping.name
                    )
                })?,
        };
        env.push((key.clone(), value));
    }
    let adapter = runtime.load_with_env(m, &source.component, &contract, env)?;
    tracing::info!(mapping = %m.mapping.name, sha256 = %adapter.component_sha256(), "mapping verified");
    Ok(Prepared {
        source,
        contract,
        adapter,
    })
}

/// Builds the loaded mapping and its capabilities.
///
/// # Errors
/// The manifest's `allowed_media_types` do not parse; a capability's function does not
/// take exactly one record, or has no effect semantics the manifest can confirm.
pub(super) fn assemble(
    p: Prepared,
    state: Arc<ConnectionState>,
    record: MappingRecord,
) -> Result<LoadedMapping> {
    let m = &p.source.manifest;
    let name = m.mapping.name.clone();
    let budget = crate::runtime::budgets::OutputBudget::from_limits(&m.limits)
        .map_err(|why| anyhow::anyhow!("mapping `{name}`: [limits] allowed_media_types {why}"))?;
    let grant = Arc::new(UpstreamGrant {
        mapping: name.clone(),
        connection: state.connection_cell(),
        snapshot: state.snapshot.clone(),
        tools: m.upstream.tools.iter().cloned().collect(),
        resource_prefixes: m.upstream.resources.clone(),
        budget,
    });
    let mapping = Arc::new(ActiveMapping {
        name: name.clone(),
        adapter: p.adapter,
        grant,
        tools: m.upstream.tools.clone(),
        connection: state,
        manifest_digest: p.source.manifest_digest.clone(),
        manifest_path: p.source.path.clone(),
        generation: super::catalog::next_generation(),
        contract: p.contract.clone(),
        data_class: m.mapping.data_class.clone(),
        queries: m
            .capabilities
            .iter()
            .filter_map(|c| {
                // As the capability serves: the contract's declaration, narrowed.
                let queryable = m.semantics(c, &p.contract).is_some_and(|s| s.queryable);
                let q = p
                    .contract
                    .query_function(&c.function)
                    .filter(|_| queryable)?;
                Some((c.name.clone(), p.contract.functions.get(q)?.clone()))
            })
            .collect(),
        reconciled: tokio::sync::OnceCell::new(),
        swept: std::sync::Mutex::new(None),
        record: ArcSwap::from_pointee(record),
    });
    let mut capabilities = Vec::new();
    for cap in &m.capabilities {
        let function = p.contract.functions[&cap.function].clone();
        let input_schema = capability_input_schema(&function)
            .with_context(|| format!("mapping `{name}`, capability `{}`", cap.name))?;
        // The contract's declaration as the reviewed manifest confirmed and narrowed it.
        let semantics = m.semantics(cap, &p.contract).with_context(|| {
            format!(
                "mapping `{name}`, capability `{}`: no effect semantics",
                cap.name
            )
        })?;
        capabilities.push(Capability {
            name: cap.name.clone(),
            description: cap.description.clone(),
            function,
            input_schema: Arc::new(input_schema),
            semantics,
            mapping: mapping.clone(),
        });
    }
    Ok((mapping, capabilities))
}

/// The mapping manifests in a watched mappings folder: `<dir>/<name>/mapping.toml`, sorted.
///
/// # Errors
/// The folder cannot be read.
pub fn mapping_dir_manifests(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let entries = std::fs::read_dir(dir)
        .with_context(|| format!("reading the mappings folder {}", dir.display()))?;
    for entry in entries {
        let path = entry?.path().join("mapping.toml");
        if path.is_file() {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}

/// A capability's input schema: the schema of its contract function's single record
/// parameter.
fn capability_input_schema(function: &ContractFunction) -> Result<JsonObject> {
    match function.params.as_slice() {
        [(_, shape @ Shape::Record(_))] => match contract::json_schema(shape) {
            Value::Object(o) => Ok(o),
            _ => bail!("derived schema is not an object"),
        },
        _ => bail!(
            "contract function `{}` must take exactly one record parameter to be offered as a capability",
            function.name
        ),
    }
}

/// The load-time check of a mapping against its contract, without a component or a
/// serve configuration: the contract is one this host knows, every capability names one
/// of its functions, the host declares effect semantics for that function, and it is not
/// a host-only function (reconciliation's `query`). `airlock grants` runs the same check.
///
/// # Errors
/// The first rule broken, naming the mapping, the capability and the function.
pub fn check_contract(
    m: &MappingManifest,
    contracts: &super::contracts::ContractSet,
) -> Result<Arc<contract::Contract>> {
    let contract = contracts
        .get(&m.mapping.contract)
        .with_context(|| format!("mapping `{}`", m.mapping.name))?;
    for cap in &m.capabilities {
        if !contract.functions.contains_key(&cap.function) {
            bail!(
                "mapping `{}`: capability `{}` names function `{}`, which contract {} does not have",
                m.mapping.name,
                cap.name,
                cap.function,
                contract.interface
            );
        }
        match contract.semantics(&cap.function) {
            None => bail!(
                "mapping `{}`: capability `{}`: this host declares no effect semantics for {}#{}, so it cannot be offered",
                m.mapping.name,
                cap.name,
                contract.interface,
                cap.function
            ),
            Some(s) if s.host_only => bail!(
                "mapping `{}`: capability `{}`: {}#{} is called by the host only (reconciliation) and may not be offered to the model",
                m.mapping.name,
                cap.name,
                contract.interface,
                cap.function
            ),
            Some(_) => {}
        }
    }
    m.check_semantics(&contract)?;
    Ok(contract)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use crate::registry::testkit::{self, Notes};
    use airlock_fixture_notes::ServeOptions;

    fn bundled(name: &str) -> MappingManifest {
        let path = testkit::bundled_manifest(name);
        MappingSource::from_file(&path).unwrap().manifest
    }

    fn with_text(text: &str) -> MappingManifest {
        MappingManifest::parse(text, "<test>").unwrap()
    }

    /// Every bundled mapping passes the contract check; a capability naming a function
    /// the contract lacks, or a host-only one, is refused with the mapping, capability
    /// and function named.
    #[test]
    fn the_contract_check_refuses_unknown_and_host_only_functions() {
        for name in ["source-library", "outbox-delivery"] {
            check_contract(
                &bundled(name),
                &super::super::contracts::ContractSet::built_in(),
            )
            .unwrap();
        }
        let source = std::fs::read_to_string(testkit::bundled_manifest("source-library")).unwrap();
        let unknown = with_text(&source.replace("function = \"retrieve\"", "function = \"fetch\""));
        let e = check_contract(&unknown, &super::super::contracts::ContractSet::built_in())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`retrieve_source` names function `fetch`, which contract"),
            "{e}"
        );
        let outbox = std::fs::read_to_string(testkit::bundled_manifest("outbox-delivery")).unwrap();
        let host_only = with_text(
            &outbox
                .replace("function = \"deliver\"", "function = \"query\"")
                .replace("effect = \"external-effect\"", "effect = \"read\""),
        );
        let e = check_contract(
            &host_only,
            &super::super::contracts::ContractSet::built_in(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("#query is called by the host only (reconciliation)"),
            "{e}"
        );
    }

    /// A watched folder lists `<dir>/<name>/mapping.toml`, sorted; a folder without a
    /// manifest and a loose file are not mappings.
    #[test]
    fn a_mappings_folder_lists_each_sub_folder_with_a_manifest_in_order() {
        let dir = tempfile::tempdir().unwrap();
        for folder in ["zeta", "alpha", "empty"] {
            std::fs::create_dir(dir.path().join(folder)).unwrap();
        }
        std::fs::write(dir.path().join("zeta/mapping.toml"), "").unwrap();
        std::fs::write(dir.path().join("alpha/mapping.toml"), "").unwrap();
        std::fs::write(dir.path().join("mapping.toml"), "").unwrap();
        assert_eq!(
            mapping_dir_manifests(dir.path()).unwrap(),
            vec![
                dir.path().join("alpha/mapping.toml"),
                dir.path().join("zeta/mapping.toml")
            ]
        );
        let e = mapping_dir_manifests(&dir.path().join("absent")).unwrap_err();
        assert!(
            format!("{e:#}").contains("reading the mappings folder"),
            "{e:#}"
        );
    }

    /// A component that does not match its pin, a connection the configuration does not
    /// define and a secret it does not hold are each refused before any upstream
    /// process starts: with every mapping refused the host does not start, and the
    /// upstream server received nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_refused_mapping_causes_no_upstream_traffic() {
        let calls = tempfile::tempdir().unwrap();
        let log = calls.path().join("calls.jsonl");
        let notes = Notes::serve(ServeOptions {
            call_log: Some(log.clone()),
            ..ServeOptions::default()
        })
        .await;
        let mut tampered = testkit::source_library(|t| t);
        let last = tampered.component.len() - 1;
        tampered.component[last] ^= 0xff;
        let elsewhere = testkit::source_library(|t| {
            t.replace("name = \"source-library\"", "name = \"elsewhere\"")
                .replace("connection = \"notes\"", "connection = \"absent\"")
        });
        let secret = testkit::source_library(|t| {
            t.replace("name = \"source-library\"", "name = \"secretive\"")
                .replace(
                    "[grants]",
                    "[grants]\nenv = { TOKEN = { secret = \"missing\" } }",
                )
        });
        let state = tempfile::tempdir().unwrap();
        let config = testkit::config(&notes.url, state.path(), "");
        let e = match Live::start_with(&config, vec![tampered, elsewhere, secret]).await {
            Ok(_) => panic!("every mapping is refused: the host must not start"),
            Err(e) => format!("{e:#}"),
        };
        assert!(e.contains("no mapping could be loaded"), "{e}");
        assert!(e.contains("mapping `source-library` refused"), "{e}");
        assert!(
            e.contains("uses connection `absent`, which the serve configuration does not define"),
            "{e}"
        );
        assert!(e.contains("names secret `missing`"), "{e}");
        assert_eq!(
            std::fs::read_to_string(&log).unwrap_or_default(),
            "",
            "nothing reached the upstream server"
        );
    }

    /// One refused mapping (here: a second mapping of the same name) is refused alone and
    /// traced; the others load.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_refused_mapping_is_refused_alone() {
        let notes = Notes::serve(ServeOptions::default()).await;
        let first = testkit::source_library(|t| t);
        let second = testkit::source_library(|t| t.replace("Search the technical", "Search the"));
        let (live, _state) = testkit::start(&notes, "", vec![first, second]).await;
        let catalog = live.catalog();
        assert_eq!(catalog.mappings.len(), 1);
        let loaded = &catalog.mappings["source-library"];
        assert!(
            catalog.capabilities[0]
                .description
                .starts_with("Search the technical"),
            "the first of the two loads"
        );
        assert_eq!(
            loaded.contract.interface,
            "airlock:contracts/source-retrieval@0.1.0"
        );
        let kinds = testkit::trace_kinds(&live);
        assert!(
            kinds.contains(&(
                crate::registry::events::MAPPING_LOAD_FAILED.to_string(),
                "source-library".to_string()
            )),
            "{kinds:?}"
        );
        live.shutdown(Duration::from_secs(1)).await;
    }

    /// A capability's input schema is derived from its contract function's record
    /// parameter (closed: no field beyond the contract's), never taken from upstream.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_capability_schema_is_the_contract_functions_record() {
        let notes = Notes::serve(ServeOptions::default()).await;
        let (live, _state) = testkit::start(&notes, "", vec![testkit::source_library(|t| t)]).await;
        let catalog = live.catalog();
        let search = catalog.capability("search_sources").unwrap();
        assert_eq!(search.function.name, "search");
        let [(_, shape)] = search.function.params.as_slice() else {
            panic!("one parameter")
        };
        let derived = contract::json_schema(shape);
        assert_eq!(Value::Object((*search.input_schema).clone()), derived);
        assert_eq!(derived["additionalProperties"], json!(false));
        assert!(
            catalog.capability("search_notes").is_none(),
            "the upstream name is never offered"
        );
        live.shutdown(Duration::from_secs(1)).await;
    }

    /// While a reviewed revision serves, a changed manifest is staged (the reviewed one
    /// keeps serving); a manifest that does not load leaves the serving revision alone
    /// and is traced; an unchanged file is not reloaded; unloading takes the capabilities
    /// out.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reload_never_replaces_a_reviewed_revision_with_an_unreviewed_one() {
        let notes = Notes::serve(ServeOptions::default()).await;
        let dir = tempfile::tempdir().unwrap();
        let path = testkit::write_source_library(dir.path(), "source-library", |t| t);
        let (live, _state) =
            testkit::start(&notes, "", vec![MappingSource::from_file(&path).unwrap()]).await;
        testkit::until("the connection is ready", || {
            live.catalog().mappings["source-library"]
                .connection
                .status()
                .as_ref()
                == &super::super::connections::ConnectionStatus::Ready
        })
        .await;
        testkit::approve(&live, "source-library");
        assert!(live.sync_with_store().await.unwrap());
        let serving = live.catalog().mappings["source-library"].clone();
        assert!(serving.serves());

        // Unchanged: nothing happens.
        assert_eq!(
            live.load_mapping_file(&path).await.unwrap(),
            "source-library"
        );
        assert!(Arc::ptr_eq(
            &live.catalog().mappings["source-library"],
            &serving
        ));

        // Changed: staged, not swapped in.
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, text.replace("Search the technical", "Search the")).unwrap();
        live.load_mapping_file(&path).await.unwrap();
        let now = live.catalog();
        assert!(
            Arc::ptr_eq(&now.mappings["source-library"], &serving),
            "the reviewed revision serves on"
        );
        assert!(
            now.capability("search_sources")
                .unwrap()
                .description
                .starts_with("Search the technical")
        );
        {
            let staged = live.staged.lock().unwrap();
            let (staged, _) = staged.get("source-library").expect("staged");
            assert!(!staged.serves());
            let reason = staged.record().reason.clone();
            assert!(reason.starts_with("staged, not reviewed"), "{reason}");
        }

        // Broken: refused, traced, the reviewed revision serves on.
        std::fs::write(&path, "[mapping]\nname = ").unwrap();
        assert!(live.load_mapping_file(&path).await.is_err());
        assert!(live.catalog().mappings["source-library"].serves());
        let kinds = testkit::trace_kinds(&live);
        assert!(
            kinds.contains(&(
                crate::registry::events::MAPPING_LOAD_FAILED.to_string(),
                path.display().to_string()
            )),
            "{kinds:?}"
        );

        assert!(live.unload_mapping("source-library").await);
        assert!(live.catalog().mappings.is_empty());
        assert_eq!(live.catalog().offered().count(), 0);
        assert!(
            live.staged.lock().unwrap().is_empty(),
            "its staged change goes too"
        );
        assert!(!live.unload_mapping("source-library").await);
        live.shutdown(Duration::from_secs(1)).await;
    }
}
