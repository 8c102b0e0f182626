//! The adapter runtime: wasmtime Engine, one `InstancePre` per loaded mapping, a fresh
//! Store and instance per call.
//!
//! Rules:
//! - Deny by default. Without grants an adapter's WASI context has no preopened
//!   directories, no environment variables, no arguments, no sockets (TCP, UDP and name
//!   lookup are all switched off and every address is refused), and closed stdin. Its
//!   stdout and stderr are captured into bounded buffers (`max_stdio_bytes` each) and
//!   never inherited. Grants ([`crate::grants`]) add exactly what they name: preopens
//!   with their access, environment variables, and socket uses checked address by
//!   address in `socket_addr_check`.
//! - Memory is limited across all of an instance's memories and tables together (one
//!   budget, [`CallLimiter`]); fuel, when the mapping sets it, bounds instructions; the
//!   adapter's return value is bounded by `max_result_bytes`.
//! - A component loads only when its sha256 equals the mapping's pin.
//! - Each call runs in a new Store with the mapping's memory limit (bytes over all
//!   memories and tables) and a deadline enforced by epoch interruption: past it the guest
//!   traps and the call fails as `interrupted`; the next call starts clean.
//! - An instance serves one call, never two. It may be made ahead of its call (a
//!   *spare*, [`LoadedAdapter::call`]): after a call's answer, off the response path, the
//!   host instantiates one more for the mapping's next call. No guest code runs at
//!   instantiation, and everything that belongs to the call (its upstream bridge and
//!   context, deadline, fuel) is bound when the call takes the spare; spares are made
//!   only for adapters without network or filesystem grants, whose WASI context holds
//!   nothing that may change between two calls. At most [`MAX_SPARES`] exist per
//!   runtime.
//! - The adapter's `airlock:host/upstream` import reaches only the tools and resource
//!   prefixes its mapping lists, on its mapping's connection. Anything else returns
//!   `not-permitted` to the adapter and is never sent.
//! - Every released `airlock:host` version is linked side by side (one implementation:
//!   0.2.0 adds `context` and imports 0.1.0's `upstream` and `log`); a component importing
//!   a host version this host does not provide is refused at load
//!   ([`crate::host_api`]).
//! - Every upstream answer is held to the mapping's output budgets ([`budgets`]: bytes,
//!   items, media types) before anything logs, observes, converts or hands it on. A
//!   refused answer reaches neither the adapter nor the trace; the call reports it in
//!   [`CallOutcome::refused`]. Each item of an accepted answer becomes an
//!   [`ObservedItem`] (digest, media type, size) of the request's [`Observation`].

//!
//! Also here, because the runtime is what reads them: [`contract`] (the WIT contracts a
//! component may implement, their model-facing schema and strict JSON ↔ value
//! conversion), [`manifest`] (a reviewed mapping's manifest: its pin, limits, grants and
//! capabilities), [`grants`] and [`budgets`].
//!
//! Crates: this one uses `airlock-upstream` (the connection an adapter's upstream bridge
//! reaches, recorded exchanges) and `airlock-core` among Airlock's crates; never the
//! store, the policy engine or anything above it. The registry, the pipeline and the
//! command line use it (as `airlock::runtime`, `airlock::contract` and
//! `airlock::registry::manifest`).

pub mod budgets;
pub mod contract;
pub mod grants;
pub mod host_api;
pub mod manifest;

/// Folder holding the adapters this build compiled and pinned (one folder per mapping,
/// each with its component and its pinned `mapping.toml`); written by this crate's build
/// script, which also hands it to the crates that depend on this one (the `links`
/// metadata `bundle`).
pub const ADAPTER_BUNDLE: &str = env!("AIRLOCK_ADAPTER_BUNDLE");

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context as _, Result, bail};
use serde_json::Value;
use sha2::Digest as _;
use wasmtime::component::{
    Component, ComponentExportIndex, HasSelf, InstancePre, Linker, ResourceTable, Val,
};
use wasmtime::{Config, Engine, Store};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamError};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use crate::grants::{Access, Grants, NetworkPolicy, SocketUse};
use crate::host_api::HostVersion;
use crate::manifest::{Limits, MappingManifest};
use airlock_upstream::{Connection, UpstreamFailure};

mod bindings {
    wasmtime::component::bindgen!({
        path: "../../../wit/v0.1.0",
        world: "airlock:host/adapter-host",
        imports: { default: async },
    });
}

use bindings::airlock::host::{log, upstream};

/// Bytes of each pooled linear memory kept resident between calls (see
/// `PoolingAllocationConfig::linear_memory_keep_resident`): enough for a Rust guest's
/// stack (1 MiB by default, at the bottom of memory), its data and a first heap.
pub const KEEP_RESIDENT_BYTES: usize = 4 << 20;

/// Length of one epoch tick. Deadlines are rounded up to whole ticks.
pub const EPOCH_TICK: Duration = Duration::from_millis(5);
/// Most adapter log messages kept per call.
pub const MAX_LOG_MESSAGES: usize = 64;

/// The shared wasmtime engine, its epoch ticker, and the optional compiled-component cache.
#[derive(Clone)]
pub struct Runtime {
    engine: Engine,
    cache: Option<CompiledCache>,
    _ticker: Arc<EpochTicker>,
    /// Spare instances alive now, over all of this runtime's adapters.
    spares: Arc<std::sync::atomic::AtomicUsize>,
}

/// Most spare instances (see the module's rules) one runtime keeps over all of its
/// adapters: each holds a pooled instance, of the pool's 256.
pub const MAX_SPARES: usize = 32;

/// How instance memories and tables are allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allocator {
    /// A pre-reserved pool with copy-on-write memory initialization (the default).
    Pooling,
    /// mmap per instance.
    OnDemand,
}

/// On-disk cache of compiled components, keyed by component sha256 and the engine's
/// compatibility hash.
///
/// Rule: only artifacts this host wrote are deserialized. The cache folder is created
/// with mode 0700 and refused when it is not owned by this user or is writable by group
/// or others; entries are written to a temporary file and renamed into place, so a
/// reader sees a whole artifact or none. A cache entry is used only for bytes whose
/// sha256 already matched the mapping's pin (the key is that digest).
#[derive(Clone)]
pub struct CompiledCache {
    dir: std::path::PathBuf,
    engine_key: String,
}

struct EpochTicker {
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Runtime {
    /// Creates the engine (component model, epoch interruption) and starts a thread that
    /// advances the epoch every [`EPOCH_TICK`]. No compiled-component cache.
    ///
    /// # Errors
    /// wasmtime rejected the configuration.
    pub fn new() -> Result<Self> {
        Self::with_cache(None)
    }

    /// Like [`Runtime::new`], caching compiled components in `cache_dir` when given.
    ///
    /// # Errors
    /// wasmtime rejected the configuration, or the cache folder cannot be created or is
    /// not private to this user.
    pub fn with_cache(cache_dir: Option<&std::path::Path>) -> Result<Self> {
        Self::with_options(cache_dir, Allocator::Pooling)
    }

    /// Like [`Runtime::with_cache`], choosing the instance allocator. `Pooling` falls back
    /// to on-demand allocation (with a warning) where the machine cannot reserve the pool.
    ///
    /// # Errors
    /// As [`Runtime::with_cache`].
    pub fn with_options(cache_dir: Option<&std::path::Path>, allocator: Allocator) -> Result<Self> {
        let mut config = Config::new();
        config
            .wasm_component_model(true)
            .epoch_interruption(true)
            .consume_fuel(true);
        // For `perf record`: the compiled guest code's symbols in /tmp/perf-PID.map.
        if std::env::var_os("AIRLOCK_WASM_PERFMAP").is_some() {
            config.profiler(wasmtime::ProfilingStrategy::PerfMap);
        }
        let mut pooled = config.clone();
        let mut pool = wasmtime::PoolingAllocationConfig::new();
        pool.total_component_instances(256)
            .total_core_instances(1024)
            .total_memories(1024)
            .total_tables(1024)
            .max_memory_size(
                usize::try_from(crate::manifest::MAX_MEMORY_MIB << 20).unwrap_or(usize::MAX),
            )
            // A slot's first pages stay mapped between calls and are reset in place,
            // instead of madvise(DONTNEED) and a page fault per touched page at the next
            // call. With the PAGEMAP_SCAN ioctl (Linux ≥ 6.7) wasmtime resets only the
            // pages the call dirtied; without it, it memsets all of the first
            // KEEP_RESIDENT_BYTES. The reset happens when the Store drops, off the
            // response path (see `reap`).
            .linear_memory_keep_resident(KEEP_RESIDENT_BYTES)
            .table_keep_resident(64 * 1024)
            .pagemap_scan(wasmtime::Enabled::Auto);
        pooled.allocation_strategy(wasmtime::InstanceAllocationStrategy::Pooling(pool));
        let attempt = match allocator {
            Allocator::Pooling => Engine::new(&pooled),
            Allocator::OnDemand => Err(wasmtime::format_err!("on-demand allocation was requested")),
        };
        let engine = match attempt {
            Ok(engine) => {
                tracing::info!(
                    dirty_page_reset =
                        wasmtime::PoolingAllocationConfig::is_pagemap_scan_available(),
                    "instance allocator: pooling, copy-on-write memory initialization"
                );
                engine
            }
            Err(e) => {
                tracing::warn!(
                    "instance allocator: on-demand (the pooling allocator is unavailable here: {e})"
                );
                Engine::new(&config)
                    .map_err(anyhow::Error::from)
                    .context("creating the wasmtime engine")?
            }
        };
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (weak, flag) = (engine.weak(), stop.clone());
        std::thread::Builder::new()
            .name("airlock-epoch".into())
            .spawn(move || {
                while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                    std::thread::sleep(EPOCH_TICK);
                    match weak.upgrade() {
                        Some(engine) => engine.increment_epoch(),
                        None => break,
                    }
                }
            })
            .context("starting the epoch thread")?;
        let cache = cache_dir
            .map(|dir| CompiledCache::open(dir, &engine))
            .transpose()?;
        Ok(Self {
            engine,
            cache,
            _ticker: Arc::new(EpochTicker { stop }),
            spares: Arc::default(),
        })
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Verifies `bytes` against the manifest's pin, compiles the component, links it with
    /// the deny-by-default host, and prepares it for per-call instantiation.
    ///
    /// # Errors
    /// Pin mismatch (naming both digests), a component that does not compile, imports an
    /// `airlock:host` version this host does not provide (naming the import and version)
    /// or anything else the host does not provide, or does not export the mapping's
    /// contract and capability functions.
    pub fn load(
        &self,
        manifest: &MappingManifest,
        bytes: &[u8],
        contract: &crate::contract::Contract,
    ) -> Result<LoadedAdapter> {
        self.load_with_env(manifest, bytes, contract, Vec::new())
    }

    /// Like [`Runtime::load`], giving the adapter the environment `env` (its granted
    /// variables, with named secrets already resolved).
    ///
    /// # Errors
    /// As [`Runtime::load`].
    pub fn load_with_env(
        &self,
        manifest: &MappingManifest,
        bytes: &[u8],
        contract: &crate::contract::Contract,
        env: Vec<(String, String)>,
    ) -> Result<LoadedAdapter> {
        crate::manifest::verify_pin(manifest, bytes)?;
        let contract_interface = contract.interface.as_str();
        let name = &manifest.mapping.name;
        let started = Instant::now();
        let component = self
            .compile(bytes, manifest.pinned_sha256())
            .with_context(|| format!("compiling the component of mapping `{name}`"))?;
        let host_version = host_api::host_version(
            component
                .component_type()
                .imports(&self.engine)
                .map(|(import, _)| import),
        )
        .with_context(|| format!("mapping `{name}`: refusing its component"))?;
        let mut linker: Linker<CallState> = Linker::new(&self.engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker)
            .map_err(anyhow::Error::from)
            .context("linking WASI")?;
        restrict_name_lookup(&mut linker)?;
        bindings::AdapterHost::add_to_linker::<CallState, HasSelf<CallState>>(&mut linker, |s| s)
            .map_err(anyhow::Error::from)
            .context("linking airlock:host@0.1.0")?;
        host_api::add_to_linker(&mut linker).context("linking airlock:host@0.2.0 and 0.3.0")?;
        let pre = linker
            .instantiate_pre(&component)
            .map_err(anyhow::Error::from)
            .with_context(|| {
                format!(
                    "mapping `{name}`: the component imports something this host does not provide"
                )
            })?;
        let iface = component
            .get_export_index(None, contract_interface)
            .with_context(|| {
                format!("mapping `{name}`: the component does not export `{contract_interface}`")
            })?;
        let mut functions = Vec::new();
        for cap in &manifest.capabilities {
            let index = component
                .get_export_index(Some(&iface), &cap.function)
                .with_context(|| {
                    format!(
                        "mapping `{name}`: the component's `{contract_interface}` has no function `{}`",
                        cap.function
                    )
                })?;
            functions.push((cap.function.clone(), index));
        }
        // The host-only query functions reconciliation calls for queryable capabilities.
        for cap in &manifest.capabilities {
            let Some(query) = contract.query_function(&cap.function) else {
                continue;
            };
            if functions.iter().any(|(n, _)| n == query) {
                continue;
            }
            let index = component
                .get_export_index(Some(&iface), query)
                .with_context(|| {
                    format!(
                        "mapping `{name}`: the component's `{contract_interface}` has no function `{query}`, which reconciles `{}`",
                        cap.function
                    )
                })?;
            functions.push((query.to_string(), index));
        }
        tracing::info!(
            mapping = %name,
            bytes = bytes.len(),
            host_version = host_version.map_or("none", HostVersion::as_str),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "component verified, compiled and linked"
        );
        Ok(LoadedAdapter(Arc::new(Adapter {
            mapping: name.clone(),
            host_version,
            dns_names: Arc::new(manifest.grants.named_hosts()),
            component_sha256: manifest.pinned_sha256().to_string(),
            limits: manifest.limits.clone(),
            grants: manifest.grants.clone(),
            settings: Arc::new(manifest.settings.clone()),
            env,
            permits: Arc::new(tokio::sync::Semaphore::new(
                usize::try_from(manifest.limits.max_concurrent_calls).unwrap_or(1),
            )),
            queued: Arc::new(std::sync::atomic::AtomicU64::new(0)),
            pre,
            functions,
            spare: std::sync::Mutex::new(None),
            spares: self.spares.clone(),
        })))
    }
}

impl Runtime {
    /// Compiles `bytes` (whose sha256 is `sha256`, already verified), through the cache
    /// when one is configured. Cache failures are logged and fall back to compiling.
    fn compile(&self, bytes: &[u8], sha256: &str) -> Result<Component> {
        let Some(cache) = &self.cache else {
            return Component::new(&self.engine, bytes).map_err(anyhow::Error::from);
        };
        let path = cache
            .dir
            .join(format!("{sha256}-{}.cwasm", cache.engine_key));
        if path.is_file() {
            // SAFETY: the file is in a folder private to this user (checked at open) and
            // was written by `Component::serialize` of an engine with this compatibility
            // hash; wasmtime also checks version and configuration before loading it.
            match unsafe { Component::deserialize_file(&self.engine, &path) } {
                Ok(c) => return Ok(c),
                Err(e) => {
                    tracing::warn!(path = %path.display(), "ignoring unusable compiled cache entry: {e}")
                }
            }
        }
        let component = Component::new(&self.engine, bytes).map_err(anyhow::Error::from)?;
        let write = || -> Result<()> {
            let serialized = component.serialize().map_err(anyhow::Error::from)?;
            let mut tmp = tempfile::NamedTempFile::new_in(&cache.dir)?;
            std::io::Write::write_all(&mut tmp, &serialized)?;
            tmp.persist(&path)?;
            Ok(())
        };
        if let Err(e) = write() {
            tracing::warn!(dir = %cache.dir.display(), "could not write the compiled cache: {e:#}");
        }
        Ok(component)
    }
}

impl CompiledCache {
    fn open(dir: &std::path::Path, engine: &Engine) -> Result<Self> {
        use std::hash::{Hash as _, Hasher as _};
        airlock_core::private_fs::ensure_private_dir(
            dir,
            "compiled-component cache",
            "or choose another --cache-dir",
        )?;
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut hasher);
        Ok(Self {
            dir: dir.to_path_buf(),
            engine_key: format!("{:016x}", hasher.finish()),
        })
    }
}

/// A mapping's compiled, linked adapter, ready for per-call instantiation. Cloning it is
/// cheap and shares the adapter (and its spare instance).
#[derive(Clone)]
pub struct LoadedAdapter(Arc<Adapter>);

impl std::ops::Deref for LoadedAdapter {
    type Target = Adapter;
    fn deref(&self) -> &Adapter {
        &self.0
    }
}

/// What a [`LoadedAdapter`] shares with the tasks that make its spare instances.
pub struct Adapter {
    mapping: String,
    host_version: Option<HostVersion>,
    dns_names: Arc<BTreeSet<String>>,
    component_sha256: String,
    limits: Limits,
    grants: Grants,
    /// The manifest's `[settings]` (`airlock:host/settings@0.3.0`).
    settings: Arc<manifest::Settings>,
    env: Vec<(String, String)>,
    /// One per call that may run at once (`limits.max_concurrent_calls`); tokio's
    /// semaphore is fair, so queued calls get them in arrival order.
    permits: Arc<tokio::sync::Semaphore>,
    /// Calls waiting for a permit now (at most `limits.max_queued_calls`).
    queued: Arc<std::sync::atomic::AtomicU64>,
    pre: InstancePre<CallState>,
    functions: Vec<(String, ComponentExportIndex)>,
    /// An instance made after the previous call, for the next one (module rules).
    spare: std::sync::Mutex<Option<Spare>>,
    /// The runtime's count of spares ([`MAX_SPARES`]).
    spares: Arc<std::sync::atomic::AtomicUsize>,
}

/// A fresh instance in its own Store, made ahead of the call it will serve; no guest code
/// has run in it. Its captured stdout and stderr are empty.
struct Spare {
    store: Store<CallState>,
    instance: wasmtime::component::Instance,
    stdout: BoundedOutput,
    stderr: BoundedOutput,
    _counted: SpareCount,
}

/// The connection of a spare's bridge until a call takes it: one that never started, shared
/// by every spare of the process.
fn no_connection() -> Arc<Connection> {
    static NONE: std::sync::OnceLock<Arc<Connection>> = std::sync::OnceLock::new();
    NONE.get_or_init(|| {
        Arc::new(Connection::unstarted(
            "(spare instance)",
            "a spare instance serves no call yet".into(),
            0,
        ))
    })
    .clone()
}

/// One place in the runtime's count of spares, given back when the spare is taken or
/// dropped.
struct SpareCount(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for SpareCount {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// What an adapter may reach upstream: its mapping's connection, tools and resource
/// prefixes, and its output budget.
pub struct UpstreamGrant {
    /// Mapping name (for messages).
    pub mapping: String,
    /// The mapping's connection: the client serving now (a call keeps the one it started
    /// with; a restarted connection serves the calls that start after it).
    pub connection: Arc<arc_swap::ArcSwap<Connection>>,
    /// The digest of the connection's current snapshot (swapped by re-discovery); each
    /// observation records the one current when its answer arrived.
    pub snapshot: Arc<arc_swap::ArcSwap<String>>,
    /// Upstream tool names the adapter may call.
    pub tools: BTreeSet<String>,
    /// Resource URI prefixes the adapter may read.
    pub resource_prefixes: Vec<String>,
    /// What one upstream answer may be: bytes, items, media types.
    pub budget: budgets::OutputBudget,
}

/// What the host tells one adapter call about the call it serves (DESIGN.md §4,
/// `airlock:host/context`), and where the call reports its upstream requests.
#[derive(Clone, Default)]
pub struct CallContext {
    /// The call's intent id (`int_…`), when it has one.
    pub intent_id: Option<String>,
    /// The intent's idempotency key (`idk_…`): the same on every attempt of one intent.
    pub idempotency_key: Option<String>,
    /// Which attempt of the intent this is, from 1.
    pub attempt: u32,
    /// Told of every upstream request of the call as it happens; `None` for calls that
    /// need no durable attempt record (reads).
    pub attempts: Option<Arc<dyn AttemptLog>>,
    /// Cancelled when the model-facing request is cancelled or the call is abandoned:
    /// the adapter's wait ends and the upstream request is cancelled.
    pub cancel: Option<tokio_util::sync::CancellationToken>,
    /// Keep every upstream exchange of the call (request params and the raw answer) in
    /// [`CallOutcome::exchanges`], for `airlock serve --record`. Off: nothing is kept.
    pub record: bool,
    /// The call's span context when the host exports spans: each upstream request of the
    /// call gets a client span under it and carries its context in `_meta`
    /// ([`airlock_upstream::spans`]). `None`: no span, nothing added to requests.
    pub trace: Option<airlock_upstream::spans::CallTrace>,
}

/// Receives an attempt's upstream transitions at the moment each becomes true (DESIGN.md
/// §5.8: prepared → **sent** → **acknowledged** → result observed → receipt verified →
/// committed). The host's implementation writes each durably before returning.
pub trait AttemptLog: Send + Sync {
    /// Called before upstream request `method` on `target` is written to the
    /// connection. An error refuses the request: nothing is sent, and the adapter gets
    /// `unavailable` with the message.
    ///
    /// # Errors
    /// The transition could not be recorded.
    fn sending(&self, method: &'static str, target: &str) -> Result<(), String>;

    /// Called when the upstream answered the request (`answered`: a JSON-RPC result or
    /// error arrived), or when it will not answer (`answered == false`: the connection
    /// closed, the request timed out or was cancelled).
    fn finished(&self, method: &'static str, target: &str, request_id: &str, answered: bool);
}

/// One upstream request made during a call whose answer was accepted, for provenance:
/// the request, and one [`ObservedItem`] per content item of its answer (DESIGN.md §2,
/// observation).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Observation {
    /// The connection's name.
    pub connection: String,
    /// The digest of the connection's snapshot current when the answer arrived.
    pub snapshot_digest: String,
    /// `tools/call` or `resources/read`.
    pub method: &'static str,
    /// The upstream tool name or resource URI.
    pub target: String,
    /// sha256 (hex) of the RFC 8785 canonical JSON of a `tools/call`'s arguments; `None`
    /// for `resources/read`.
    pub arguments_sha256: Option<String>,
    /// The request's JSON-RPC id on the connection.
    pub request_id: String,
    /// sha256 (hex) of the upstream result as JSON, as received.
    pub result_sha256: String,
    /// Size of that JSON, in bytes.
    pub result_bytes: u64,
    /// When the result arrived (RFC 3339, UTC).
    pub retrieved_at: String,
    /// The same time, in unix milliseconds.
    pub retrieved_ms: u64,
    /// The answer's content items, in order.
    pub items: Vec<ObservedItem>,
}

/// One content item of an accepted upstream answer.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ObservedItem {
    /// Where it is in the result: `content/N`, `structuredContent` or `contents/N`.
    pub key: String,
    /// What it is (see [`budgets::Item::kind`]).
    pub kind: &'static str,
    /// Its media type's essence; empty for a `resource_link` that declares none.
    pub media_type: String,
    /// sha256 (hex) of the item's RFC 8785 canonical JSON.
    pub sha256: String,
    /// Size of that JSON, in bytes.
    pub bytes: u64,
}

/// An upstream answer the host refused to hand to the adapter, or a request the
/// connection could not answer because it broke the protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusedAnswer {
    /// The connection's name.
    pub connection: String,
    /// `tools/call` or `resources/read`.
    pub method: &'static str,
    /// The upstream tool name or resource URI.
    pub target: String,
    /// The request's JSON-RPC id, when it was sent.
    pub request_id: Option<String>,
    /// Why.
    pub why: Refused,
}

/// Why an answer was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// It did not fit the mapping's output budget.
    Budget(budgets::Refusal),
    /// The connection is degraded: the server sent something that is not valid JSON-RPC
    /// (the host's own sentence saying what).
    Degraded(String),
}

/// Why a call into an adapter did not return a value.
#[derive(Debug)]
pub enum CallFailure {
    /// The deadline passed; the guest was interrupted.
    DeadlineExceeded(Duration),
    /// The instance asked for more memory than its limit (bytes) allows.
    MemoryLimit(u64),
    /// The instance used up its fuel.
    FuelExhausted,
    /// The adapter wrote more than its stdout/stderr budget (bytes).
    OutputFlood(u64),
    /// The adapter returned a value larger than its budget (bytes).
    ResultTooLarge(u64),
    /// The adapter already ran its maximum number of concurrent calls for as long as the
    /// call could wait for one of them (or its queue was full).
    Busy(Busy),
    /// The guest trapped (panic, stack overflow, unreachable...). Detail for the log.
    Trapped(String),
    /// The host failed to instantiate or call (a broken invariant). Detail for the log.
    Host(String),
    /// The call was cancelled ([`CallContext::cancel`]): the guest was interrupted at its
    /// next epoch tick, or its upstream wait ended.
    Cancelled,
}

impl CallFailure {
    /// A short stable name for the trace: `deadline`, `memory`, `fuel`, `output-flood`,
    /// `result-too-large`, `busy`, `trap`, `host`, `cancelled`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::DeadlineExceeded(_) => "deadline",
            Self::MemoryLimit(_) => "memory",
            Self::FuelExhausted => "fuel",
            Self::OutputFlood(_) => "output-flood",
            Self::ResultTooLarge(_) => "result-too-large",
            Self::Busy(_) => "busy",
            Self::Trapped(_) => "trap",
            Self::Cancelled => "cancelled",
            Self::Host(_) => "host",
        }
    }
}

/// Why a call found no free instance ([`CallFailure::Busy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Busy {
    /// The adapter's `limits.max_concurrent_calls`.
    pub max_concurrent_calls: u64,
    /// The adapter's `limits.queue_timeout_ms`: how long a call may wait for an instance.
    pub queue_timeout_ms: u64,
    /// How long this call waited (zero when it did not queue).
    pub waited: Duration,
    /// The queue already held `limits.max_queued_calls` calls (or queuing is off), so the
    /// call did not wait.
    pub queue_full: bool,
}

/// Leaves an adapter's queue when dropped (the wait ended, timed out, or was abandoned).
struct InQueue<'a>(&'a std::sync::atomic::AtomicU64);

impl Drop for InQueue<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// The WIT package version of `wasi:sockets` that wasmtime-wasi links (imports of any
/// 0.2.x resolve to it).
const WASI_SOCKETS_IP_NAME_LOOKUP: &str = "wasi:sockets/ip-name-lookup@0.2.12";

/// Replaces wasmtime-wasi's `resolve-addresses` with one that resolves only the names the
/// mapping grants (`tcp_connect` / `udp_send` named hosts). Any other name fails with
/// `access-denied` before a DNS query is made; IP literals are returned as given (no query),
/// and every address is still checked at connect time.
fn restrict_name_lookup(linker: &mut Linker<CallState>) -> Result<()> {
    use wasmtime::component::Resource;
    use wasmtime_wasi::p2::bindings::sockets::ip_name_lookup::{Host as _, ResolveAddressStream};
    use wasmtime_wasi::p2::bindings::sockets::network::{ErrorCode, Network};
    use wasmtime_wasi::sockets::WasiSocketsView as _;
    linker.allow_shadowing(true);
    linker
        .instance(WASI_SOCKETS_IP_NAME_LOOKUP)
        .map_err(anyhow::Error::from)?
        .func_wrap(
            "resolve-addresses",
            |mut store: wasmtime::StoreContextMut<'_, CallState>,
             (network, name): (Resource<Network>, String)|
             -> wasmtime::Result<(Result<Resource<ResolveAddressStream>, ErrorCode>,)> {
                if !name_lookup_permitted(&store.data().dns_names, &name) {
                    tracing::warn!(name = %name.chars().take(253).collect::<String>(), "name lookup refused: the name is not a granted host");
                    return Ok((Err(ErrorCode::AccessDenied),));
                }
                let mut view = store.data_mut().sockets();
                match view.resolve_addresses(network, name) {
                    Ok(stream) => Ok((Ok(stream),)),
                    Err(e) => Ok((Err(e.downcast()?),)),
                }
            },
        )
        .map_err(anyhow::Error::from)
        .context("linking the restricted wasi:sockets/ip-name-lookup")?;
    linker.allow_shadowing(false);
    Ok(())
}

/// Whether `name` may be looked up: an IP literal (no query is made), or a granted name
/// (ASCII case-insensitive, one trailing dot ignored).
pub fn name_lookup_permitted(granted: &BTreeSet<String>, name: &str) -> bool {
    if name.parse::<std::net::IpAddr>().is_ok()
        || name
            .strip_prefix('[')
            .and_then(|n| n.strip_suffix(']'))
            .is_some_and(|n| n.parse::<std::net::Ipv6Addr>().is_ok())
    {
        return true;
    }
    let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
    !name.is_empty() && granted.contains(&name)
}

/// The result of one adapter call.
#[derive(Debug)]
pub struct CallOutcome {
    /// The function's return value, or why there is none.
    pub result: Result<Val, CallFailure>,
    /// Upstream requests the adapter made whose answers it received, in order.
    pub observations: Vec<Observation>,
    /// Upstream answers refused (over budget, or a degraded connection), in order.
    pub refused: Vec<RefusedAnswer>,
    /// The adapter's log messages (bounded).
    pub logs: Vec<String>,
    /// The adapter's captured stdout and stderr (bounded).
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// Where the call's time went.
    pub timings: CallTimings,
    /// Every upstream exchange of the call, in order, when [`CallContext::record`] asked
    /// for them (empty otherwise): unredacted, for [`airlock_upstream::record`] to redact and write.
    pub exchanges: Vec<airlock_upstream::record::Exchange>,
}

/// Where one adapter call's time went (wall clock; zero for a part that never ran). The
/// pipeline records them in the call's trace event (`stages_us`: `execute.instantiate`
/// and `execute.store`, or `execute.spare` for a call that ran in a spare instance;
/// `execute.upstream`, `execute.guest`); measuring costs two clock reads per part.
#[derive(Debug, Default, Clone, Copy)]
pub struct CallTimings {
    /// A fresh Store and the instance from the `InstancePre`.
    pub instantiate: Duration,
    /// Of `instantiate`, the fresh Store alone (WASI context, limiter, deadline, fuel).
    pub store: Duration,
    /// The call ran in the spare instance made after the previous call; `instantiate`
    /// is then the time to take it and bind it to this call.
    pub spare: bool,
    /// Waiting for upstream answers (every `call-tool` and `read-resource` import).
    pub upstream: Duration,
    /// From the instance's start to its return, upstream waits included.
    pub run: Duration,
    /// Waiting for one of the adapter's `max_concurrent_calls` (zero when one was free).
    pub queue: Duration,
}

/// Drops a call's Store off the response path with no thread hand-off: in a task of the
/// current runtime (dropped in place outside one). The instance's teardown (its pooled
/// memory reset to the pages the call dirtied, tables and stack returned, the WASI
/// context dropped) then runs on the same worker once the call's task yields, after the
/// task the call's answer woke (tokio polls a task woken by a running one from the
/// worker's LIFO slot, before spawned ones), so the answer is written first. Before
/// 2026-12-03 a dedicated `airlock-reaper` thread did this; waking it cost a futex
/// system call and a context switch per call (BENCHMARKS.md §1).
fn reap(store: Store<CallState>) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            // If the runtime is shutting down the task is dropped at once, and the Store
            // with it.
            drop(runtime.spawn(async move { drop(store) }));
        }
        Err(_) => drop(store),
    }
}

impl Adapter {
    /// A fresh Store for one call: deny-by-default WASI with captured output, the
    /// mapping's memory limit, and an epoch deadline that traps.
    fn new_store(
        &self,
        grant: Arc<UpstreamGrant>,
        network: NetworkPolicy,
        context: CallContext,
    ) -> Result<(Store<CallState>, BoundedOutput, BoundedOutput), CallFailure> {
        let stdio = usize::try_from(self.limits.max_stdio_bytes).unwrap_or(usize::MAX);
        let flooded = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stdout = BoundedOutput::new(stdio, flooded.clone());
        let stderr = BoundedOutput::new(stdio, flooded.clone());
        let mut wasi = WasiCtx::builder();
        wasi.stdout(stdout.clone())
            .stderr(stderr.clone())
            .envs(&self.env);
        for (host, guest, access) in &self.grants.filesystem {
            let perms = match access {
                Access::ReadOnly => wasmtime_wasi::filesystem::FsPerms::ReadOnly,
                Access::ReadWrite => wasmtime_wasi::filesystem::FsPerms::ReadWrite,
            };
            wasi.preopened_dir(host, guest, perms).map_err(|e| {
                CallFailure::Host(format!("preopening {} at {guest}: {e}", host.display()))
            })?;
        }
        let tcp = network.permits_any_tcp();
        let udp = network.permits_any_udp();
        wasi.allow_tcp(tcp)
            .allow_udp(udp)
            .allow_ip_name_lookup(self.grants.has_named_hosts());
        if tcp || udp {
            let policy = Arc::new(network);
            let mapping = self.mapping.clone();
            wasi.socket_addr_check(move |addr, use_| {
                let use_ = socket_use(use_);
                let allowed = policy.permits(addr, use_);
                if !allowed {
                    tracing::warn!(mapping = %mapping, %addr, ?use_, "socket use refused: not granted");
                }
                Box::pin(async move { allowed })
            });
        }
        let state = CallState {
            wasi: wasi.build(),
            table: ResourceTable::new(),
            dns_names: self.dns_names.clone(),
            limiter: CallLimiter {
                budget: self.limits.memory_mib * 1024 * 1024,
                used: 0,
                exceeded: false,
            },
            flooded,
            bridge: self.bridge(grant, context),
            settings: self.settings.clone(),
        };
        let mut store = Store::new(self.pre.engine(), state);
        store.limiter(|s| &mut s.limiter);
        self.arm(&mut store)?;
        Ok((store, stdout, stderr))
    }

    /// The upstream side of one call: its grant, the connection serving now (and its
    /// count of list changes, to tell a change during the call), its deadline and budget
    /// of upstream requests, and the call's context.
    fn bridge(&self, grant: Arc<UpstreamGrant>, context: CallContext) -> UpstreamBridge {
        let connection = grant.connection.load_full();
        UpstreamBridge {
            changes_at_start: connection.list_changed_count(),
            connection,
            grant,
            deadline: Instant::now() + Duration::from_millis(self.limits.deadline_ms),
            observations: Vec::new(),
            refused: Vec::new(),
            logs: Vec::new(),
            requests_left: self.limits.max_upstream_requests,
            exchanges: context.record.then(Vec::new),
            context,
            upstream_wait: Duration::ZERO,
        }
    }

    /// Starts the call's clocks in `store`: the epoch deadline (from now) with the
    /// callback that yields each tick and traps past the deadline or on cancellation
    /// (the cancellation token of the Store's bridge), and the mapping's fuel.
    fn arm(&self, store: &mut Store<CallState>) -> Result<(), CallFailure> {
        let deadline = Duration::from_millis(self.limits.deadline_ms);
        // Every tick the guest yields to the async executor, so a spinning adapter never
        // holds a worker thread; past the deadline the next tick traps it.
        let until = Instant::now() + deadline;
        let cancel = store.data().bridge.context.cancel.clone();
        store.set_epoch_deadline(1);
        store.epoch_deadline_callback(move |_| {
            let cancelled = cancel.as_ref().is_some_and(|c| c.is_cancelled());
            Ok(if cancelled || Instant::now() >= until {
                wasmtime::UpdateDeadline::Interrupt
            } else {
                // tokio's `yield_now` (not wasmtime's plain `Yield`, a self-wake that tokio
                // runs again from its LIFO slot at once): the worker polls its IO driver and
                // other tasks before it resumes the guest, so stdin and sockets are read
                // while every worker runs a spinning adapter.
                wasmtime::UpdateDeadline::YieldCustom(1, Box::pin(tokio::task::yield_now()))
            })
        });
        store
            .set_fuel(self.limits.fuel.unwrap_or(u64::MAX))
            .map_err(|e| CallFailure::Host(format!("setting fuel: {e}")))
    }

    /// Whether the adapter's WASI context holds nothing that may change between two
    /// calls, so that it can be made before its call: no network grant (its policy, with
    /// named hosts resolved, is made per call) and no filesystem grant (a preopen holds
    /// the folder its path named when it was opened; an operator may have replaced it
    /// since).
    fn fixed_context(&self) -> bool {
        let g = &self.grants;
        g.filesystem.is_empty() && !self.network_granted()
    }

    /// Whether the adapter has any network grant.
    fn network_granted(&self) -> bool {
        let g = &self.grants;
        !(g.tcp_connect.is_empty() && g.udp_send.is_empty() && g.tcp_listen.is_empty())
    }

    /// Takes the spare instance, when there is one, and binds it to the call of `grant`
    /// and `context`: its upstream bridge, deadline and fuel start now.
    fn take_spare(
        &self,
        grant: &Arc<UpstreamGrant>,
        context: &CallContext,
    ) -> Option<Result<Spare, CallFailure>> {
        let mut spare = self
            .spare
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()?;
        spare.store.data_mut().bridge = self.bridge(grant.clone(), context.clone());
        Some(self.arm(&mut spare.store).map(|()| spare))
    }

    /// Makes the spare instance for the next call (module rules) unless there is one or
    /// the runtime has [`MAX_SPARES`]. A failure leaves no spare (the next call
    /// instantiates as usual) and is logged at debug level.
    async fn refill(&self, grant: Arc<UpstreamGrant>) {
        use std::sync::atomic::Ordering::Relaxed;
        let has_one = |adapter: &Self| {
            adapter
                .spare
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .is_some()
        };
        if has_one(self) {
            return;
        }
        if self.spares.fetch_add(1, Relaxed) >= MAX_SPARES {
            self.spares.fetch_sub(1, Relaxed);
            return;
        }
        let counted = SpareCount(self.spares.clone());
        let made = match self.new_store(grant, NetworkPolicy::default(), CallContext::default()) {
            Ok((mut store, stdout, stderr)) => {
                // A spare holds no connection: the one serving now may be replaced (and
                // its client and process records dropped) before the next call comes.
                store.data_mut().bridge.connection = no_connection();
                match self.pre.instantiate_async(&mut store).await {
                    Ok(instance) => Ok(Spare {
                        store,
                        instance,
                        stdout,
                        stderr,
                        _counted: counted,
                    }),
                    Err(e) => Err(format!("{e:#}")),
                }
            }
            Err(e) => Err(format!("{e:?}")),
        };
        match made {
            Ok(spare) => {
                let mut slot = self
                    .spare
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if slot.is_none() {
                    *slot = Some(spare);
                }
            }
            Err(e) => tracing::debug!(mapping = %self.mapping, "no spare instance: {e}"),
        }
    }
}

impl LoadedAdapter {
    /// Hands a finished call's Store to `reap` and, for an adapter whose context is the
    /// same for every call, makes the spare for the next call in the same task: off the
    /// response path, with no thread hand-off. The spare first (the next call may come at
    /// once); the old instance's teardown then lets the worker's other tasks run twice
    /// (`yield_now`: a request that arrived meanwhile is read, and its call runs to its
    /// first wait, before the teardown), since no call waits for it.
    fn reap_and_refill(&self, store: Store<CallState>, grant: Arc<UpstreamGrant>) {
        if !self.fixed_context() {
            return reap(store);
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let adapter = self.0.clone();
                drop(runtime.spawn(async move {
                    adapter.refill(grant).await;
                    tokio::task::yield_now().await;
                    tokio::task::yield_now().await;
                    drop(store);
                }));
            }
            Err(_) => drop(store),
        }
    }

    /// Instantiates the adapter in a fresh Store and hands the Store to `reap`,
    /// calling nothing: the per-call setup cost a call waits for; benchmarks measure it.
    ///
    /// # Errors
    /// Instantiation failed.
    pub async fn instantiate_once(&self, grant: Arc<UpstreamGrant>) -> Result<()> {
        let network = self.network_policy().await;
        let (mut store, _, _) = self
            .new_store(grant, network, CallContext::default())
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let instantiated = self.pre.instantiate_async(&mut store).await;
        reap(store);
        instantiated?;
        Ok(())
    }

    async fn network_policy(&self) -> NetworkPolicy {
        if !self.network_granted() {
            NetworkPolicy::default()
        } else {
            self.grants.network_policy().await
        }
    }

    /// The mapping's name.
    pub fn mapping(&self) -> &str {
        &self.mapping
    }

    /// The mapping's limits.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// The sha256 of the loaded component.
    pub fn component_sha256(&self) -> &str {
        &self.component_sha256
    }

    /// The `airlock:host` version the component targets, derived from its imports (the
    /// highest version among them); `None` when it imports nothing from `airlock:host`.
    pub fn host_version(&self) -> Option<HostVersion> {
        self.host_version
    }

    /// A permit to run one call: at once when fewer than `max_concurrent_calls` run;
    /// otherwise after waiting in the adapter's queue, in arrival order, at most
    /// `queue_timeout_ms`, with at most `max_queued_calls` waiting (README "Adapter
    /// budgets"). Returns the permit and how long the call waited.
    ///
    /// # Errors
    /// [`Busy`] when the queue is full or off (`queue_timeout_ms = 0`), when the wait
    /// timed out, or when `cancel` fired while waiting (`waited` then says how long).
    async fn admit(
        &self,
        cancel: Option<&tokio_util::sync::CancellationToken>,
    ) -> Result<(tokio::sync::OwnedSemaphorePermit, Duration), Busy> {
        use std::sync::atomic::Ordering;
        if let Ok(permit) = self.permits.clone().try_acquire_owned() {
            return Ok((permit, Duration::ZERO));
        }
        let l = &self.limits;
        let busy = |waited: Duration, queue_full: bool| Busy {
            max_concurrent_calls: l.max_concurrent_calls,
            queue_timeout_ms: l.queue_timeout_ms,
            waited,
            queue_full,
        };
        let place = self.queued.fetch_add(1, Ordering::AcqRel);
        let _in_queue = InQueue(&self.queued);
        if l.queue_timeout_ms == 0 || place >= l.max_queued_calls {
            return Err(busy(Duration::ZERO, true));
        }
        let started = Instant::now();
        let wait = tokio::time::timeout(
            Duration::from_millis(l.queue_timeout_ms),
            self.permits.clone().acquire_owned(),
        );
        let permit = match cancel {
            Some(cancel) => tokio::select! {
                permit = wait => permit,
                () = cancel.cancelled() => return Err(busy(started.elapsed(), false)),
            },
            None => wait.await,
        };
        match permit {
            Ok(Ok(permit)) => Ok((permit, started.elapsed())),
            // Timed out (the semaphore is never closed).
            _ => Err(busy(started.elapsed(), false)),
        }
    }

    /// Instantiates the adapter in a fresh Store and calls its contract function
    /// `function` with `params`, under the mapping's limits and `grant`, serving the call
    /// described by `context`.
    pub async fn call(
        &self,
        function: &str,
        params: &[Val],
        grant: Arc<UpstreamGrant>,
        context: CallContext,
    ) -> CallOutcome {
        let deadline = Duration::from_millis(self.limits.deadline_ms);
        let failed = |failure| CallOutcome {
            result: Err(failure),
            observations: Vec::new(),
            refused: Vec::new(),
            logs: Vec::new(),
            stdout: Vec::new(),
            stderr: Vec::new(),
            timings: CallTimings::default(),
            exchanges: Vec::new(),
        };
        let (_permit, queued_for) = match self.admit(context.cancel.as_ref()).await {
            Ok(admitted) => admitted,
            Err(busy) => {
                let mut refused = failed(CallFailure::Busy(busy));
                refused.timings.queue = busy.waited;
                return refused;
            }
        };
        let store_cancel = context.cancel.clone();
        let refill = grant.clone();
        let started = Instant::now();
        // The spare made after the previous call, bound to this one; else a fresh Store.
        let made = match self
            .fixed_context()
            .then(|| self.take_spare(&grant, &context))
        {
            Some(Some(taken)) => taken.map(|s| (s.store, s.stdout, s.stderr, Some(s.instance))),
            _ => {
                let network = self.network_policy().await;
                self.new_store(grant, network, context)
                    .map(|(store, stdout, stderr)| (store, stdout, stderr, None))
            }
        };
        let (mut store, stdout, stderr, mut spare) = match made {
            Ok(parts) => parts,
            Err(failure) => return failed(failure),
        };
        let mut timings = CallTimings {
            store: started.elapsed(),
            spare: spare.is_some(),
            queue: queued_for,
            ..CallTimings::default()
        };
        let run = async {
            let index = self
                .functions
                .iter()
                .find(|(n, _)| n == function)
                .map(|(_, i)| *i)
                .ok_or_else(|| CallFailure::Host(format!("no capability function `{function}`")))?;
            let instance = match spare.take() {
                Some(instance) => instance,
                None => self
                    .pre
                    .instantiate_async(&mut store)
                    .await
                    .map_err(|e| self.classify(e, deadline))?,
            };
            let instantiated = Instant::now();
            timings.instantiate = instantiated - started;
            let func = instance.get_func(&mut store, index).ok_or_else(|| {
                CallFailure::Host(format!("export `{function}` is not a function"))
            })?;
            let mut results = vec![Val::Bool(false)];
            func.call_async(&mut store, params, &mut results)
                .await
                .map_err(|e| self.classify(e, deadline))?;
            timings.run = instantiated.elapsed();
            let result = results.pop().unwrap_or(Val::Bool(false));
            if val_size(&result) > self.limits.max_result_bytes {
                return Err(CallFailure::ResultTooLarge(self.limits.max_result_bytes));
            }
            Ok(result)
        };
        // Host calls (upstream requests) are not interruptible by epochs; bound the whole
        // call by the same deadline plus one tick of grace.
        let cancel = store_cancel.clone();
        let result = match tokio::time::timeout(deadline + EPOCH_TICK * 2, run).await {
            Ok(r) => r,
            Err(_) => Err(CallFailure::DeadlineExceeded(deadline)),
        };
        let result = match result {
            Err(CallFailure::DeadlineExceeded(_)) | Err(CallFailure::Trapped(_))
                if cancel.as_ref().is_some_and(|c| c.is_cancelled()) =>
            {
                Err(CallFailure::Cancelled)
            }
            other => other,
        };
        let result = match result {
            Err(CallFailure::Trapped(_)) if store.data().limiter.exceeded => Err(
                CallFailure::MemoryLimit(self.limits.memory_mib * 1024 * 1024),
            ),
            Err(CallFailure::Trapped(_) | CallFailure::DeadlineExceeded(_))
                if store
                    .data()
                    .flooded
                    .load(std::sync::atomic::Ordering::Relaxed) =>
            {
                Err(CallFailure::OutputFlood(self.limits.max_stdio_bytes))
            }
            other => other,
        };
        let observations = std::mem::take(&mut store.data_mut().bridge.observations);
        let refused = std::mem::take(&mut store.data_mut().bridge.refused);
        let logs = std::mem::take(&mut store.data_mut().bridge.logs);
        let exchanges = store.data_mut().bridge.exchanges.take().unwrap_or_default();
        timings.upstream = store.data().bridge.upstream_wait;
        // Tearing the instance down (its pooled memory reset, the Store's tables) and
        // making the next call's spare are nobody's wait: they happen after the answer.
        self.reap_and_refill(store, refill);
        CallOutcome {
            result,
            observations,
            refused,
            logs,
            stdout: stdout.contents().to_vec(),
            stderr: stderr.contents().to_vec(),
            timings,
            exchanges,
        }
    }
}

impl LoadedAdapter {
    fn classify(&self, error: wasmtime::Error, deadline: Duration) -> CallFailure {
        match error.downcast_ref::<wasmtime::Trap>() {
            Some(wasmtime::Trap::Interrupt) => CallFailure::DeadlineExceeded(deadline),
            Some(wasmtime::Trap::OutOfFuel) => CallFailure::FuelExhausted,
            Some(trap) => CallFailure::Trapped(format!("{trap}: {error:?}")),
            None => CallFailure::Trapped(format!("{error:?}")),
        }
    }
}

fn socket_use(use_: wasmtime_wasi::sockets::SocketAddrUse) -> SocketUse {
    use wasmtime_wasi::sockets::SocketAddrUse as U;
    match use_ {
        U::TcpBind => SocketUse::TcpBind,
        U::TcpListen => SocketUse::TcpListen,
        U::TcpAccept => SocketUse::TcpAccept,
        U::TcpConnect => SocketUse::TcpConnect,
        U::UdpBind => SocketUse::UdpBind,
        U::UdpSend => SocketUse::UdpSend,
        U::UdpReceive => SocketUse::UdpReceive,
    }
}

/// An upper estimate of a value's size as JSON, in bytes.
fn val_size(val: &Val) -> u64 {
    match val {
        Val::String(s) => s.len() as u64 * 2 + 2,
        Val::List(items) | Val::Tuple(items) | Val::FixedLengthList(items) => {
            2 + items.iter().map(|v| val_size(v) + 1).sum::<u64>()
        }
        Val::Record(fields) => {
            2 + fields
                .iter()
                .map(|(k, v)| k.len() as u64 + 4 + val_size(v))
                .sum::<u64>()
        }
        Val::Variant(name, payload) => {
            name.len() as u64 + 6 + payload.as_deref().map_or(0, val_size)
        }
        Val::Enum(name) => name.len() as u64 + 2,
        Val::Option(v) => v.as_deref().map_or(4, val_size),
        Val::Result(Ok(v) | Err(v)) => 8 + v.as_deref().map_or(4, val_size),
        Val::Flags(names) => 2 + names.iter().map(|n| n.len() as u64 + 3).sum::<u64>(),
        Val::Map(entries) => {
            2 + entries
                .iter()
                .map(|(k, v)| val_size(k) + val_size(v) + 2)
                .sum::<u64>()
        }
        _ => 24,
    }
}

/// The Store's resource limiter: one memory budget for all of an instance's memories and
/// tables together (a table element counts 8 bytes), at most 16 memories, 64 tables and
/// 64 instances. wasmtime's `StoreLimits` counts each memory on its own, so a component
/// with several memories could use its limit once per memory.
pub struct CallLimiter {
    budget: u64,
    used: u64,
    exceeded: bool,
}

impl CallLimiter {
    fn grow(&mut self, current: u64, desired: u64) -> bool {
        let added = desired.saturating_sub(current);
        if self.used.saturating_add(added) > self.budget {
            self.exceeded = true;
            return false;
        }
        self.used += added;
        true
    }
}

impl wasmtime::ResourceLimiter for CallLimiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(self.grow(current as u64, desired as u64))
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(self.grow(current as u64 * 8, desired as u64 * 8))
    }

    fn instances(&self) -> usize {
        64
    }

    fn tables(&self) -> usize {
        64
    }

    fn memories(&self) -> usize {
        16
    }
}

/// A captured guest output stream (stdout or stderr) with a byte budget. Writing past the
/// budget traps the guest and marks the call as an output flood, instead of the stream
/// quietly closing (which a guest may ignore and spin on).
#[derive(Clone)]
pub struct BoundedOutput {
    pipe: MemoryOutputPipe,
    capacity: usize,
    flooded: Arc<std::sync::atomic::AtomicBool>,
}

impl BoundedOutput {
    fn new(capacity: usize, flooded: Arc<std::sync::atomic::AtomicBool>) -> Self {
        Self {
            pipe: MemoryOutputPipe::new(capacity),
            capacity,
            flooded,
        }
    }

    /// What the guest wrote, up to the budget.
    pub fn contents(&self) -> bytes::Bytes {
        self.pipe.contents()
    }

    fn remaining(&self) -> usize {
        self.capacity.saturating_sub(self.pipe.contents().len())
    }

    fn flood(&self) -> StreamError {
        self.flooded
            .store(true, std::sync::atomic::Ordering::Relaxed);
        StreamError::trap("the adapter exceeded its stdout/stderr budget")
    }
}

impl wasmtime_wasi::cli::IsTerminal for BoundedOutput {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl wasmtime_wasi::cli::StdoutStream for BoundedOutput {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.pipe.clone())
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for BoundedOutput {
    async fn ready(&mut self) {}
}

impl OutputStream for BoundedOutput {
    fn write(&mut self, bytes: bytes::Bytes) -> Result<(), StreamError> {
        if bytes.len() > self.remaining() {
            return Err(self.flood());
        }
        self.pipe.write(bytes)
    }

    fn flush(&mut self) -> Result<(), StreamError> {
        Ok(())
    }

    fn check_write(&mut self) -> Result<usize, StreamError> {
        match self.remaining() {
            0 => Err(self.flood()),
            n => Ok(n),
        }
    }
}

/// Per-call Store data.
pub struct CallState {
    wasi: WasiCtx,
    table: ResourceTable,
    /// Names the adapter may resolve (its granted named hosts, lowercase, no trailing dot).
    dns_names: Arc<BTreeSet<String>>,
    limiter: CallLimiter,
    /// Set when the guest tried to write past its stdout/stderr budget.
    flooded: Arc<std::sync::atomic::AtomicBool>,
    bridge: UpstreamBridge,
    /// The mapping's settings, the same for every call of one loaded revision.
    settings: Arc<manifest::Settings>,
}

impl WasiView for CallState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

struct UpstreamBridge {
    grant: Arc<UpstreamGrant>,
    /// The connection this call uses from start to end.
    connection: Arc<Connection>,
    deadline: Instant,
    observations: Vec<Observation>,
    refused: Vec<RefusedAnswer>,
    logs: Vec<String>,
    /// Upstream requests this call may still make.
    requests_left: u64,
    /// The connection's list_changed count when the call started (after the re-check).
    changes_at_start: u64,
    /// The call this instance serves.
    context: CallContext,
    /// Time spent waiting for upstream answers.
    upstream_wait: Duration,
    /// `Some` when the call records its exchanges ([`CallContext::record`]).
    exchanges: Option<Vec<airlock_upstream::record::Exchange>>,
}

impl UpstreamBridge {
    /// Keeps one exchange when the call records them (one `Option` check otherwise).
    fn keep(
        &mut self,
        method: &str,
        target: &str,
        arguments: Option<&Value>,
        answer: &Result<(Value, String), (UpstreamFailure, Option<String>)>,
    ) {
        let Some(kept) = &mut self.exchanges else {
            return;
        };
        use airlock_upstream::record::Answer;
        let answer = match answer {
            Ok((result, _)) => Answer::Result(result.clone()),
            Err((UpstreamFailure::Protocol(message), _)) => Answer::Error {
                message: message.clone(),
            },
            Err((UpstreamFailure::OutputTooLarge(_), _)) => Answer::OutputTooLarge,
            Err((UpstreamFailure::Unavailable(message), _)) => Answer::Unavailable {
                message: message.clone(),
            },
            Err((UpstreamFailure::Cancelled, _)) => Answer::Unavailable {
                message: "cancelled".into(),
            },
        };
        kept.push(airlock_upstream::record::Exchange {
            method: method.to_string(),
            params: airlock_upstream::record::request_params(method, target, arguments),
            answer,
        });
    }
}

impl UpstreamBridge {
    /// Takes one upstream request from the call's budget.
    fn take_request(&mut self) -> Result<(), upstream::UpstreamError> {
        // The re-check covered the catalogue as it was when the call started. If the
        // server announced a change since, nothing more goes out on the old verdict.
        if self.connection.list_changed_count() != self.changes_at_start {
            return Err(upstream::UpstreamError::Unavailable(
                "the upstream catalogue changed during this call; nothing was sent".into(),
            ));
        }
        if self.requests_left == 0 {
            return Err(upstream::UpstreamError::NotPermitted(
                "this call has used up its budget of upstream requests (limits.max_upstream_requests); nothing was sent".into(),
            ));
        }
        self.requests_left -= 1;
        Ok(())
    }

    /// Records that a request is about to be written (see [`AttemptLog::sending`]).
    fn sending(&self, method: &'static str, target: &str) -> Result<(), upstream::UpstreamError> {
        match &self.context.attempts {
            Some(log) => log.sending(method, target).map_err(|why| {
                upstream::UpstreamError::Unavailable(format!(
                    "the host could not record the request before sending it ({why}); nothing was sent"
                ))
            }),
            None => Ok(()),
        }
    }

    /// Records how a request ended (see [`AttemptLog::finished`]) and passes its result on.
    fn finished(
        &mut self,
        method: &'static str,
        target: &str,
        answer: Result<(Value, String), (UpstreamFailure, Option<String>)>,
    ) -> Result<(Value, String), upstream::UpstreamError> {
        if let Some(log) = &self.context.attempts {
            let (id, answered) = match &answer {
                Ok((_, id)) => (id.as_str(), true),
                Err((failure, id)) => (id.as_deref().unwrap_or(""), failure.answered()),
            };
            log.finished(method, target, id, answered);
        }
        answer.map_err(|(failure, id)| {
            let why = match &failure {
                // The transport discarded it while reading; the mapping's own budget is
                // the one to name (the connection reads up to the largest of its mappings').
                UpstreamFailure::OutputTooLarge(_) => {
                    Some(Refused::Budget(budgets::Refusal::Bytes {
                        limit: self.grant.budget.max_bytes,
                    }))
                }
                UpstreamFailure::Unavailable(_) => {
                    self.connection.degraded().map(Refused::Degraded)
                }
                _ => None,
            };
            match why {
                Some(why) => {
                    let error = match &why {
                        Refused::Budget(r) => budget_error(r),
                        Refused::Degraded(_) => to_guest_error(failure),
                    };
                    self.refuse(method, target, id, why);
                    error
                }
                None => to_guest_error(failure),
            }
        })
    }

    /// Records a refused answer.
    fn refuse(
        &mut self,
        method: &'static str,
        target: &str,
        request_id: Option<String>,
        why: Refused,
    ) {
        tracing::warn!(mapping = %self.grant.mapping, method, request_id = request_id.as_deref().unwrap_or(""), "upstream answer refused: {}", match &why {
            Refused::Budget(r) => r.to_string(),
            Refused::Degraded(d) => d.clone(),
        });
        self.refused.push(RefusedAnswer {
            connection: self.connection.name().to_string(),
            method,
            target: target.to_string(),
            request_id,
            why,
        });
    }

    fn remaining(&self) -> Result<Duration, upstream::UpstreamError> {
        self.deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(|| {
                upstream::UpstreamError::Unavailable("the call's deadline has passed".into())
            })
    }

    /// Holds `result` to the mapping's output budget (see [`budgets`]) and, when it fits,
    /// records it as observed, one [`ObservedItem`] per content item. Nothing of a refused
    /// answer is kept: the refusal names only the budget.
    fn observe(
        &mut self,
        method: &'static str,
        target: &str,
        arguments_sha256: Option<String>,
        request_id: String,
        result: &Value,
    ) -> Result<(), upstream::UpstreamError> {
        let budget = &self.grant.budget;
        let (result_sha256, result_bytes) = digest_json(result);
        let checked = if result_bytes > budget.max_bytes {
            Err(budgets::Refusal::Bytes {
                limit: budget.max_bytes,
            })
        } else if method == "resources/read" {
            budget.resource_contents(result)
        } else {
            budget.tool_result(result)
        };
        let items = match checked {
            Ok(items) => items,
            Err(refusal) => {
                let error = budget_error(&refusal);
                self.refuse(method, target, Some(request_id), Refused::Budget(refusal));
                return Err(error);
            }
        };
        let items = items
            .into_iter()
            .map(|item| {
                let (sha256, bytes) = digest_canonical(item.value);
                ObservedItem {
                    key: item.key,
                    kind: item.kind,
                    media_type: item.media_type,
                    sha256,
                    bytes,
                }
            })
            .collect();
        let now = SystemTime::now();
        self.observations.push(Observation {
            connection: self.connection.name().to_string(),
            snapshot_digest: self.grant.snapshot.load().to_string(),
            method,
            target: target.to_string(),
            arguments_sha256,
            request_id,
            result_sha256,
            result_bytes,
            retrieved_at: humantime::format_rfc3339_millis(now).to_string(),
            retrieved_ms: now
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            items,
        });
        Ok(())
    }
}

/// sha256 (hex) and size of `value` as compact JSON: serialized into one buffer, then
/// hashed at once (a hashing writer is handed each token separately).
fn digest_json(value: &Value) -> (String, u64) {
    // Serializing a `Value` into a `Vec` cannot fail.
    let text = serde_json::to_vec(value).unwrap_or_default();
    (hex::encode(sha2::Sha256::digest(&text)), text.len() as u64)
}

/// sha256 (hex) and size of `value` as RFC 8785 canonical JSON ([`airlock_core::canonical`]):
/// the same content has the same digest whatever order the server (or rmcp) wrote its
/// keys in.
fn digest_canonical(value: &Value) -> (String, u64) {
    match airlock_core::canonical::to_string(value) {
        Ok(text) => (
            hex::encode(sha2::Sha256::digest(text.as_bytes())),
            text.len() as u64,
        ),
        // Not canonicalizable (a number outside IEEE 754): the compact form instead.
        Err(_) => digest_json(value),
    }
}

/// The error the adapter gets for an answer refused by its budget (the 0.1.0 WIT has no
/// case of its own for items or media types: see [`budgets`]).
fn budget_error(refusal: &budgets::Refusal) -> upstream::UpstreamError {
    match refusal {
        budgets::Refusal::Bytes { limit } => upstream::UpstreamError::OutputTooLarge(*limit),
        other => upstream::UpstreamError::ProtocolError(other.to_string()),
    }
}

fn to_guest_error(failure: UpstreamFailure) -> upstream::UpstreamError {
    match failure {
        UpstreamFailure::OutputTooLarge(n) => upstream::UpstreamError::OutputTooLarge(n),
        UpstreamFailure::Unavailable(why) => upstream::UpstreamError::Unavailable(why),
        UpstreamFailure::Protocol(msg) => upstream::UpstreamError::ProtocolError(msg),
        UpstreamFailure::Cancelled => upstream::UpstreamError::Unavailable(
            "the call was cancelled; the upstream request was cancelled too".into(),
        ),
    }
}

impl upstream::Host for CallState {
    async fn call_tool(
        &mut self,
        name: String,
        arguments_json: String,
    ) -> Result<upstream::ToolOutput, upstream::UpstreamError> {
        let bridge = &mut self.bridge;
        if !bridge.grant.tools.contains(&name) {
            tracing::warn!(mapping = %bridge.grant.mapping, tool = %name, "refused an upstream tool outside the mapping");
            return Err(upstream::UpstreamError::NotPermitted(format!(
                "upstream tool `{name}` is not listed in mapping `{}`; nothing was sent",
                bridge.grant.mapping
            )));
        }
        let arguments = match serde_json::from_str::<Value>(&arguments_json) {
            Ok(Value::Object(map)) => map,
            Ok(_) => {
                return Err(upstream::UpstreamError::InvalidArguments(
                    "arguments must be a JSON object".into(),
                ));
            }
            Err(e) => {
                return Err(upstream::UpstreamError::InvalidArguments(format!(
                    "arguments are not JSON: {e}"
                )));
            }
        };
        let arguments_sha256 = airlock_core::canonical::object_to_string(&arguments)
            .map(|c| hex::encode(sha2::Sha256::digest(c.as_bytes())))
            .ok();
        let timeout = bridge.remaining()?;
        bridge.take_request()?;
        bridge.sending("tools/call", &name)?;
        let recorded = bridge
            .exchanges
            .is_some()
            .then(|| Value::Object(arguments.clone()));
        let asked = Instant::now();
        let answer = bridge
            .connection
            .call_tool(
                &name,
                arguments,
                timeout,
                bridge.context.cancel.as_ref(),
                bridge.context.trace.as_ref(),
            )
            .await;
        bridge.upstream_wait += asked.elapsed();
        bridge.keep("tools/call", &name, recorded.as_ref(), &answer);
        let (result, request_id) = bridge.finished("tools/call", &name, answer)?;
        bridge.observe("tools/call", &name, arguments_sha256, request_id, &result)?;
        Ok(tool_output(result))
    }

    async fn read_resource(
        &mut self,
        uri: String,
    ) -> Result<Vec<upstream::ResourceContents>, upstream::UpstreamError> {
        let bridge = &mut self.bridge;
        if !resource_permitted(&uri, &bridge.grant.resource_prefixes) {
            return Err(upstream::UpstreamError::NotPermitted(format!(
                "resource {uri:?} is outside the prefixes of mapping `{}`; nothing was sent",
                bridge.grant.mapping
            )));
        }
        let timeout = bridge.remaining()?;
        bridge.take_request()?;
        bridge.sending("resources/read", &uri)?;
        let asked = Instant::now();
        let answer = bridge
            .connection
            .read_resource(
                &uri,
                timeout,
                bridge.context.cancel.as_ref(),
                bridge.context.trace.as_ref(),
            )
            .await;
        bridge.upstream_wait += asked.elapsed();
        bridge.keep("resources/read", &uri, None, &answer);
        let (result, request_id) = bridge.finished("resources/read", &uri, answer)?;
        bridge.observe("resources/read", &uri, None, request_id, &result)?;
        let contents = result["contents"].as_array().cloned().unwrap_or_default();
        Ok(contents
            .iter()
            .map(|c| upstream::ResourceContents {
                uri: str_field(c, "uri").unwrap_or_default(),
                mime_type: str_field(c, "mimeType"),
                text: str_field(c, "text"),
                blob_bytes: c["blob"].as_str().map(|b| (b.len() as u64 / 4) * 3),
            })
            .collect())
    }
}

impl log::Host for CallState {
    async fn log(&mut self, level: log::Level, message: String) {
        let logs = &mut self.bridge.logs;
        if logs.len() < MAX_LOG_MESSAGES {
            let shown: String = message.chars().take(1000).collect();
            logs.push(format!("{level:?}: {shown}"));
        }
    }
}

/// Whether `uri` may be read under `prefixes`. Each prefix ends in `/` (the manifest
/// checks), so a match is at a segment boundary. Refused whatever the prefix: control
/// characters, backslashes, `.` or `..` segments, and percent-encoded `/`, `\` or `.`
/// (which a server may decode into a traversal).
pub fn resource_permitted(uri: &str, prefixes: &[String]) -> bool {
    let lowered = uri.to_ascii_lowercase();
    let tricky = uri.chars().any(|c| c.is_control() || c == '\\')
        || ["%2f", "%5c", "%2e"].iter().any(|e| lowered.contains(e))
        || uri
            .split_once("://")
            .map_or(uri, |(_, rest)| rest)
            .split(['/', '?', '#'])
            .any(|seg| seg == "." || seg == "..");
    !tricky && prefixes.iter().any(|p| uri.starts_with(p.as_str()))
}

fn str_field(v: &Value, key: &str) -> Option<String> {
    v.get(key).and_then(Value::as_str).map(str::to_string)
}

/// Converts a `CallToolResult` (as JSON) into the WIT `tool-output`, moving its texts.
fn tool_output(mut result: Value) -> upstream::ToolOutput {
    let content = match result.get_mut("content").map(Value::take) {
        Some(Value::Array(blocks)) => blocks.into_iter().map(content_block).collect(),
        _ => Vec::new(),
    };
    upstream::ToolOutput {
        content,
        structured_json: result.get("structuredContent").map(|v| v.to_string()),
        is_error: result["isError"].as_bool().unwrap_or(false),
    }
}

fn content_block(mut block: Value) -> upstream::ContentBlock {
    let kind = block["type"].as_str().unwrap_or("unknown");
    match kind {
        "text" => upstream::ContentBlock::Text(match block.get_mut("text").map(Value::take) {
            Some(Value::String(text)) => text,
            _ => String::new(),
        }),
        "resource" if block["resource"]["text"].is_string() => {
            let r = &block["resource"];
            upstream::ContentBlock::ResourceText(upstream::ResourceText {
                uri: str_field(r, "uri").unwrap_or_default(),
                mime_type: str_field(r, "mimeType"),
                text: str_field(r, "text").unwrap_or_default(),
            })
        }
        "resource_link" => upstream::ContentBlock::ResourceLink(upstream::ResourceLink {
            uri: str_field(&block, "uri").unwrap_or_default(),
            name: str_field(&block, "name").unwrap_or_default(),
            mime_type: str_field(&block, "mimeType"),
        }),
        other => upstream::ContentBlock::Other(other.chars().take(64).collect()),
    }
}

/// Reads a component file and checks that it is a component.
///
/// # Errors
/// Unreadable file or not a WebAssembly component.
pub fn read_component(path: &std::path::Path) -> Result<Vec<u8>> {
    let bytes =
        std::fs::read(path).with_context(|| format!("reading component {}", path.display()))?;
    if !bytes.starts_with(b"\0asm") {
        bail!("{} is not a WebAssembly file", path.display());
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An item's digest is the sha256 of its RFC 8785 text and its size is that text's
    /// length in bytes, whatever order its keys came in; the compact digest is of the
    /// text as serialized, in the order given.
    #[test]
    fn an_items_digest_and_size_are_of_its_canonical_text() {
        let value = serde_json::json!({"type": "text", "text": "é\n", "n": 1});
        let text = r#"{"n":1,"text":"é\n","type":"text"}"#;
        let expected = (
            hex::encode(sha2::Sha256::digest(text.as_bytes())),
            text.len() as u64,
        );
        assert_eq!(digest_canonical(&value), expected);
        let reordered = serde_json::json!({"n": 1, "text": "é\n", "type": "text"});
        assert_eq!(digest_canonical(&reordered), expected);
        let compact = r#"{"type":"text","text":"é\n","n":1}"#;
        assert_eq!(
            digest_json(&value),
            (
                hex::encode(sha2::Sha256::digest(compact.as_bytes())),
                compact.len() as u64
            )
        );
    }

    #[test]
    fn only_granted_names_and_ip_literals_may_be_looked_up() {
        let granted: BTreeSet<String> = ["api.example.com".to_string()].into();
        for ok in [
            "api.example.com",
            "API.Example.COM",
            "api.example.com.",
            "127.0.0.1",
            "::1",
            "[::1]",
        ] {
            assert!(name_lookup_permitted(&granted, ok), "{ok}");
        }
        for refused in [
            "",
            ".",
            "example.com",
            "x.api.example.com",
            "api.example.com..",
            "api.example.com\0",
            "api.example.com evil.com",
            "аpi.example.com",
            "169.254.169.254.nip.io",
        ] {
            assert!(!name_lookup_permitted(&granted, refused), "{refused:?}");
        }
        assert!(!name_lookup_permitted(&BTreeSet::new(), "localhost"));
    }
    use std::os::unix::fs::PermissionsExt as _;

    fn bundled() -> (MappingManifest, Vec<u8>) {
        let dir = std::path::Path::new(crate::ADAPTER_BUNDLE).join("source-library");
        let manifest = MappingManifest::load(&dir.join("mapping.toml")).unwrap();
        let bytes = read_component(&manifest.component_path(&dir)).unwrap();
        (manifest, bytes)
    }

    /// Two core instances, each with a 20 MiB memory: each fits a 32 MiB budget alone,
    /// together they do not. A per-memory limit would let both through.
    const TWO_MEMORIES: &str = r#"(component
        (core module $a (memory 320))
        (core module $b (memory 320))
        (core instance (instantiate $a))
        (core instance (instantiate $b)))"#;

    async fn instantiate_with_budget(mib: u64) -> (bool, bool) {
        let runtime = Runtime::new().unwrap();
        let bytes = wat::parse_str(TWO_MEMORIES).unwrap();
        let component = Component::new(runtime.engine(), &bytes).unwrap();
        let linker: Linker<CallLimiter> = Linker::new(runtime.engine());
        let mut store = Store::new(
            runtime.engine(),
            CallLimiter {
                budget: mib << 20,
                used: 0,
                exceeded: false,
            },
        );
        store.limiter(|l| l);
        store.set_fuel(u64::MAX).unwrap();
        let ok = linker
            .instantiate_async(&mut store, &component)
            .await
            .is_ok();
        (ok, store.data().exceeded)
    }

    #[tokio::test]
    async fn the_memory_budget_is_shared_by_all_memories_of_an_instance() {
        assert_eq!(instantiate_with_budget(32).await, (false, true));
        assert_eq!(instantiate_with_budget(48).await, (true, false));
    }

    #[test]
    fn resource_prefixes_match_whole_segments_and_refuse_traversal() {
        let p = vec!["notes://wal/".to_string(), "file:///srv/docs/".to_string()];
        assert!(resource_permitted("notes://wal/checkpoints", &p));
        assert!(resource_permitted("file:///srv/docs/a.txt", &p));
        for bad in [
            "notes://walrus",
            "notes://wal/../tcp-keepalive",
            "notes://wal/./x",
            "file:///srv/docs-private/x",
            "file:///srv/docs/../../etc/passwd",
            "file:///srv/docs/%2e%2e/%2E%2E/etc/passwd",
            "file:///srv/docs/a%2Fb",
            "file:///srv/docs/a\\..\\b",
            "notes://wal/x\n----- END",
            "file:///etc/passwd",
        ] {
            assert!(!resource_permitted(bad, &p), "{bad} must be refused");
        }
        assert!(
            !resource_permitted("notes://wal/x", &[]),
            "no prefixes: nothing"
        );
    }

    #[test]
    fn a_cache_folder_others_can_write_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = Runtime::with_cache(Some(dir.path()))
            .err()
            .expect("must refuse");
        assert!(
            err.to_string()
                .contains("writable by group or others (mode 0777)"),
            "{err}"
        );
    }

    #[test]
    fn the_cache_serves_the_second_load_and_survives_a_corrupt_entry() {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("compiled");
        let (manifest, bytes) = bundled();
        let iface = &manifest.mapping.contract;
        let runtime = Runtime::with_cache(Some(&cache)).unwrap();
        runtime
            .load(&manifest, &bytes, &contract::load_contract(iface).unwrap())
            .unwrap();
        let entries: Vec<_> = std::fs::read_dir(&cache)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(entries.len(), 1);
        assert!(
            entries[0]
                .file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with(manifest.pinned_sha256())
        );
        assert_eq!(
            std::fs::metadata(&cache).unwrap().permissions().mode() & 0o777,
            0o700
        );
        Runtime::with_cache(Some(&cache))
            .unwrap()
            .load(&manifest, &bytes, &contract::load_contract(iface).unwrap())
            .unwrap();
        std::fs::write(&entries[0], b"not a compiled component").unwrap();
        Runtime::with_cache(Some(&cache))
            .unwrap()
            .load(&manifest, &bytes, &contract::load_contract(iface).unwrap())
            .unwrap();
    }

    fn bundled_named(name: &str) -> (MappingManifest, Vec<u8>) {
        let dir = std::path::Path::new(crate::ADAPTER_BUNDLE).join(name);
        let manifest = MappingManifest::load(&dir.join("mapping.toml")).unwrap();
        let bytes = read_component(&manifest.component_path(&dir)).unwrap();
        (manifest, bytes)
    }

    #[test]
    fn the_host_version_a_component_targets_comes_from_its_imports() {
        let runtime = Runtime::new().unwrap();
        for (name, version) in [
            ("source-library", HostVersion::V0_1_0),
            ("fs-documents", HostVersion::V0_1_0),
            ("memory-graph", HostVersion::V0_1_0),
            ("outbox-delivery", HostVersion::V0_2_0),
        ] {
            let (manifest, bytes) = bundled_named(name);
            let loaded = runtime
                .load(
                    &manifest,
                    &bytes,
                    &contract::load_contract(&manifest.mapping.contract).unwrap(),
                )
                .unwrap();
            assert_eq!(loaded.host_version(), Some(version), "{name}");
        }
    }

    /// A manifest for `bytes` (pinned), offering source-retrieval's `search`.
    fn manifest_for(bytes: &[u8]) -> MappingManifest {
        let pin = hex::encode(sha2::Sha256::digest(bytes));
        MappingManifest::parse(
            &format!(
                r#"
[mapping]
name = "made-up"
contract = "airlock:contracts/source-retrieval@0.1.0"
connection = "notes"
[component]
file = "c.wasm"
sha256 = "{pin}"
[[capability]]
function = "search"
name = "search_sources"
description = "Search."
effect = "read"
"#
            ),
            "made-up.toml",
        )
        .unwrap()
    }

    #[test]
    fn a_component_built_against_a_host_version_that_does_not_exist_is_refused() {
        let runtime = Runtime::new().unwrap();
        for (import, needle) in [
            ("airlock:host/context@0.3.0", "airlock:host 0.3.0"),
            ("airlock:host/upstream@0.1.1", "airlock:host 0.1.1"),
            (
                "airlock:host/upstream@0.2.0",
                "airlock:host 0.2.0 has no interface `upstream`",
            ),
        ] {
            let bytes = wat::parse_str(format!(
                r#"(component (import "{import}" (instance (export "remaining-ms" (func (result u64))))))"#
            ))
            .unwrap();
            let manifest = manifest_for(&bytes);
            let err = runtime
                .load(
                    &manifest,
                    &bytes,
                    &contract::load_contract("airlock:contracts/source-retrieval@0.1.0").unwrap(),
                )
                .err()
                .expect("must refuse");
            let err = format!("{err:#}");
            assert!(err.contains(needle), "{err}");
            assert!(err.contains(import), "{err}");
            assert!(err.contains("made-up"), "names the mapping: {err}");
        }
    }

    #[test]
    fn a_component_without_the_contract_export_is_refused() {
        let (manifest, bytes) = bundled();
        let err = Runtime::new()
            .unwrap()
            .load(&manifest, &bytes, &{
                // A contract the component does not export: the retrieval contract under
                // another name.
                let mut c = (*contract::load_contract("airlock:contracts/source-retrieval@0.1.0")
                    .unwrap())
                .clone();
                c.interface = "airlock:contracts/artifact-delivery@0.1.0".into();
                c
            })
            .err()
            .expect("must refuse");
        assert!(err.to_string().contains("does not export"), "{err}");
    }
}
