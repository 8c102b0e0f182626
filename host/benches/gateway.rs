//! Benchmarks, as a plain bench binary (`cargo bench -p airlock --bench gateway`).
//!
//! (`tools/call` latency and throughput against a direct call and two relays is the `floor`
//! bench: `cargo bench -p airlock --bench floor`.)
//!
//! 2. Per-call instantiation of the adapter from its cached `InstancePre`: hot (back to
//!    back), and with 4 MiB of other memory written between two instantiations, as a
//!    call's other work does (the figure a call in `airlock serve` meets when it has no
//!    spare instance).
//! 3. Component cold load: pin check, compile, link, `InstancePre`.
//! 4. Hot swap of a watched mapping under concurrent callers: from the rename of a changed
//!    manifest to the moment the host's catalog offers the new revision, and the calls that
//!    failed meanwhile.
//! 5. Snapshot and diff of a 500-tool server: discovery, catalogue + digests, drift diff,
//!    and the store write.
//! 6. Spawn to ready (initialize and `tools/list`) of an upstream stdio server, confined
//!    by the kernel and not, interleaved (`AIRLOCK_BENCH_SPAWNS`, default 20 each).
//!
//! Prints p50 / p99 / mean per measurement and the added latency and ratio.
//! `AIRLOCK_BENCH_ITERS` sets the sample count (default 2000); `AIRLOCK_BENCH_SWAPS` the
//! number of hot swaps per variant (default 20); `AIRLOCK_BENCH_SNAPSHOTS` the number of
//! discoveries of the 500-tool server (default 20). `AIRLOCK_BENCH_LOG` is the log filter
//! of the `airlock serve` child and, when set, of the in-process host (to stderr).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use airlock::host::Host;
use airlock::registry::Registry;
use airlock::registry::drift::{self, Catalogue};
use airlock::registry::live::{DISCOVERY_TIMEOUT, MappingSource};
use airlock::runtime::{Allocator, LoadedAdapter, Runtime, UpstreamGrant};
use airlock::store::SqliteStore;
use airlock::upstream::{Connection, StdioServer};
use serde_json::json;

mod common;
use common::serve::args;
use common::{Stats, env_count, stats, us};

fn print(name: &str, s: &Stats) {
    println!(
        "{name:<48} n={:<6} p50 {:>9.1} µs   p99 {:>9.1} µs   mean {:>9.1} µs",
        s.n,
        us(s.p50),
        us(s.p99),
        us(s.mean)
    );
}

fn airlock_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_airlock"))
}

/// What a call's other work touches between two instantiations, for the cold-cache
/// figure: twice these machines' L2 cache per core (2 MiB; L3 is shared).
const EVICT_BYTES: usize = 4 << 20;

/// `warmup + iters` instantiations of `adapter` in fresh Stores, timed one by one (the
/// last `iters`). They run on a runtime worker, as a call does, and yield after each one
/// (outside the timed part): `instantiate_once` hands its Store to a task of the current
/// runtime, and a loop that never yields would leave those tasks to the other worker,
/// where they fell behind and the instance pool ran out ("maximum concurrent limit of 256
/// for component instances reached") after some 10⁵ instantiations. Before each one,
/// outside the timed part, the loop writes one byte per cache line of an `evict`-byte
/// buffer, as a call's other work would between two instantiations (0: none).
async fn instantiations(
    adapter: LoadedAdapter,
    grant: Arc<UpstreamGrant>,
    warmup: usize,
    iters: usize,
    evict: usize,
) -> Vec<Duration> {
    tokio::spawn(async move {
        let mut samples = Vec::with_capacity(iters);
        let mut other = vec![0u8; evict];
        for i in 0..warmup + iters {
            for j in (0..evict).step_by(64) {
                other[j] = other[j].wrapping_add(1);
            }
            std::hint::black_box(&other);
            let start = Instant::now();
            adapter.instantiate_once(grant.clone()).await.unwrap();
            if i >= warmup {
                samples.push(start.elapsed());
            }
            tokio::task::yield_now().await;
        }
        samples
    })
    .await
    .unwrap()
}

#[tokio::main]
async fn main() {
    let iters: usize = std::env::var("AIRLOCK_BENCH_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let warmup = (iters / 10).max(20);
    // In-process sections (4, 5) log to stderr under the same filter as `airlock serve`.
    if let Ok(filter) = std::env::var("AIRLOCK_BENCH_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .init();
    }
    let bundle = Path::new(airlock::ADAPTER_BUNDLE).join("source-library");
    println!(
        "airlock benchmarks ({} build, {iters} samples each)\n",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    );

    // 2. Instantiation from InstancePre (pooling vs on-demand), idle memory, 3. cold load.
    let state = tempfile::tempdir().unwrap();
    let mut config = airlock::cli::demo::notes_config(env!("CARGO_BIN_EXE_airlock").into());
    config.state_dir = Some(state.path().to_path_buf());
    let host = Host::start_with(
        &config,
        vec![MappingSource::from_file(&bundle.join("mapping.toml")).unwrap()],
    )
    .await
    .unwrap();
    let mapping = host.catalog().mappings["source-library"].clone();
    let grant: Arc<UpstreamGrant> = mapping.grant.clone();
    let pooled = mapping.adapter.clone();
    let samples = instantiations(pooled.clone(), grant.clone(), warmup, iters, 0).await;
    print("instantiate from InstancePre (pooling)", &stats(samples));
    let samples = instantiations(pooled, grant.clone(), warmup, iters, EVICT_BYTES).await;
    print(
        "instantiate (pooling), 4 MiB touched between",
        &stats(samples),
    );

    let source = MappingSource::from_file(&bundle.join("mapping.toml")).unwrap();
    let contract = airlock::contract::load_contract(&source.manifest.mapping.contract).unwrap();
    let on_demand = Runtime::with_options(None, Allocator::OnDemand).unwrap();
    let adapter = on_demand
        .load(&source.manifest, &source.component, &contract)
        .unwrap();
    let samples = instantiations(adapter, grant.clone(), warmup, iters, 0).await;
    print("instantiate from InstancePre (on-demand)", &stats(samples));

    // Memory per idle loaded adapter: RSS growth over N more loaded mappings.
    let idle = 20;
    let pooled = Runtime::new().unwrap();
    let _warm = pooled
        .load(&source.manifest, &source.component, &contract)
        .unwrap();
    let before = rss_kib();
    let loaded: Vec<_> = (0..idle)
        .map(|_| {
            pooled
                .load(&source.manifest, &source.component, &contract)
                .unwrap()
        })
        .collect();
    let after = rss_kib();
    println!(
        "{:<48} {idle} loaded: +{} KiB RSS, {:.0} KiB each (each load compiles its own code)",
        "idle loaded adapters",
        after.saturating_sub(before),
        after.saturating_sub(before) as f64 / f64::from(idle)
    );
    drop(loaded);

    let runtime = Runtime::new().unwrap();
    let cold_iters = 10;
    let mut samples = Vec::with_capacity(cold_iters);
    for _ in 0..cold_iters {
        let start = Instant::now();
        runtime
            .load(&source.manifest, &source.component, &contract)
            .unwrap();
        samples.push(start.elapsed());
    }
    print(
        &format!(
            "component cold load ({} KiB: pin, compile, link)",
            source.component.len() / 1024
        ),
        &stats(samples),
    );

    // 4. Hot swap under concurrent callers.
    let swaps: usize = env_count("AIRLOCK_BENCH_SWAPS", 20);
    let callers = 4;
    println!(
        "\nhot swap of a watched mapping ({swaps} swaps per variant, {callers} concurrent callers of search_sources)"
    );
    let cache = tempfile::tempdir().unwrap();
    let cached = Some(cache.path().join("compiled"));
    let variants: [(&str, Option<PathBuf>, bool, usize); 4] = [
        (
            "watched folder, compiled cache (as airlock serve)",
            cached.clone(),
            true,
            0,
        ),
        ("watched folder, no compiled cache", None, true, 0),
        (
            "Host::load_mapping_file called directly (no watcher), compiled cache",
            cached.clone(),
            false,
            0,
        ),
        (
            "same, the connection's server lists 500 tools (paged by 50)",
            cached.clone(),
            false,
            497,
        ),
    ];
    for (name, cache_dir, watched, extra_tools) in variants {
        let run = hot_swap(cache_dir, watched, extra_tools, swaps, callers).await;
        println!("{name}");
        print_ms("  rename → offered", &run.swaps);
        println!(
            "{:<48} {} ok, {} failed; mapping at revision {} ({})",
            "  calls during the swaps", run.ok, run.failed, run.revision, run.state
        );
        let (kib, cpu) = run.idle;
        println!(
            "{:<48} {kib:.0} KiB/s read, {cpu:.1} ms CPU per s (whole bench process)",
            "  then idle 2 s (no change, no calls)"
        );
    }
    // Two pieces of the reload work, measured alone.
    println!("pieces of the reload work, alone");
    let cached = Runtime::with_cache(Some(&cache.path().join("compiled"))).unwrap();
    let (mut read, mut load) = (Vec::new(), Vec::new());
    for _ in 0..swaps {
        let start = Instant::now();
        let s = MappingSource::from_file(&bundle.join("mapping.toml")).unwrap();
        read.push(start.elapsed());
        std::hint::black_box(s);
        let start = Instant::now();
        cached
            .load(&source.manifest, &source.component, &contract)
            .unwrap();
        load.push(start.elapsed());
    }
    print_ms("  read manifest + component (MappingSource)", &stats(read));
    print_ms("  Runtime::load from the compiled cache", &stats(load));

    // 5. Snapshot and diff of a 500-tool server.
    snapshot_and_diff(env_count("AIRLOCK_BENCH_SNAPSHOTS", 20)).await;

    // 6. Spawn to ready, confined against unconfined.
    spawn_to_ready(env_count("AIRLOCK_BENCH_SPAWNS", 20)).await;
}

/// Section 6: from spawn to an answered `initialize` and a `tools/list`, `n` times each,
/// confined and unconfined interleaved: the notes fixture server, and the reference
/// filesystem server under Node when `fixtures/npm` is installed.
async fn spawn_to_ready(n: usize) {
    use airlock::upstream::confine::{Access, Confinement, PathGrant};
    println!(
        "\nspawn to ready (initialize + tools/list), confined and not, interleaved ({n} each)"
    );
    airlock::upstream::confine::use_helper(airlock_bin());
    let notes = airlock::cli::demo::notes_config(airlock_bin()).connections["notes"]
        .as_stdio()
        .unwrap()
        .clone();
    let mut servers = vec![("notes fixture server", notes)];
    let npm = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/npm");
    let script = npm.join("node_modules/@modelcontextprotocol/server-filesystem/dist/index.js");
    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/documents");
    if script.is_file() && Path::new("/usr/bin/node").is_file() {
        servers.push((
            "reference filesystem server (node)",
            StdioServer {
                command: "/usr/bin/node".into(),
                args: vec![script.display().to_string(), docs.display().to_string()],
                cwd: npm.canonicalize().unwrap(),
                env: Default::default(),
                owner: None,
                credential_scope: None,
                identity_files: vec![],
                confine: None,
            },
        ));
    } else {
        println!("  (the filesystem server is not installed: npm ci --prefix fixtures/npm)");
    }
    for (name, plain) in servers {
        let mut confined = plain.clone();
        confined.confine = Some(Confinement {
            paths: vec![PathGrant {
                path: docs.canonicalize().unwrap(),
                access: Access::ReadOnly,
            }],
            ..Confinement::deny_by_default()
        });
        let (mut open, mut shut) = (Vec::new(), Vec::new());
        for i in 0..n * 2 {
            let server = if i % 2 == 0 { &confined } else { &plain };
            let start = Instant::now();
            let conn = Connection::start_stdio(
                "bench",
                server,
                8 << 20,
                airlock::upstream::INITIALIZE_TIMEOUT,
            )
            .await
            .unwrap();
            conn.discover(DISCOVERY_TIMEOUT).await.unwrap();
            let took = start.elapsed();
            let samples = if i % 2 == 0 { &mut shut } else { &mut open };
            samples.push(took);
            conn.terminate(Duration::from_secs(2)).await;
        }
        print_ms(&format!("  {name}, unconfined"), &stats(open));
        print_ms(&format!("  {name}, confined"), &stats(shut));
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn print_ms(name: &str, s: &Stats) {
    println!(
        "{name:<48} n={:<6} p50 {:>9.2} ms   p99 {:>9.2} ms   min {:>8.2} ms   max {:>8.2} ms",
        s.n,
        ms(s.p50),
        ms(s.p99),
        ms(s.min),
        ms(s.max)
    );
}

/// The description of `search_sources` in the bundled manifest, which each swap replaces.
const SEARCH_DESCRIPTION: &str = "Search the technical notes library.";

struct SwapRun {
    swaps: Stats,
    ok: usize,
    failed: usize,
    revision: i64,
    state: String,
    /// Bytes read (KiB/s) and CPU time (ms/s) of this process afterwards, while nothing
    /// changes and nobody calls.
    idle: (f64, f64),
}

/// Records an approval of `source-library` with manifest `text` against the connection's
/// current snapshot.
fn approve_text(host: &Host, text: &str) {
    let mapping = host.catalog().mappings["source-library"].clone();
    let state = &mapping.connection;
    let snapshot = host
        .registry()
        .store()
        .snapshot(&state.snapshot_digest())
        .unwrap()
        .unwrap();
    host.registry()
        .approve_tools(
            &airlock::registry::MappingIdentity {
                name: "source-library",
                tools: &mapping.tools,
                manifest_digest: &airlock::registry::manifest_digest(text),
                manifest_text: Some(text),
                component_sha256: mapping.adapter.component_sha256(),
            },
            &state.revision,
            &snapshot,
            "bench",
        )
        .unwrap();
}

/// Starts a host on a mappings folder holding a copy of the bundled `source-library`,
/// approves it, starts `callers` sessions calling `search_sources` in a loop, then `swaps`
/// times rewrites the manifest with a new capability description (write beside, rename
/// over) and measures from the rename until the host's catalog offers the new description
/// (polled every 1 ms). With `watched`, the folder watcher picks the change up; without,
/// the bench calls `Host::load_mapping_file` itself right after the rename. The notes
/// server lists `extra_tools` synthetic tools besides its own three.
async fn hot_swap(
    cache_dir: Option<PathBuf>,
    watched: bool,
    extra_tools: usize,
    swaps: usize,
    callers: usize,
) -> SwapRun {
    let dir = tempfile::tempdir().unwrap();
    let mappings = dir.path().join("mappings");
    let folder = mappings.join("source-library");
    std::fs::create_dir_all(&folder).unwrap();
    let bundle = Path::new(airlock::ADAPTER_BUNDLE).join("source-library");
    for entry in std::fs::read_dir(&bundle).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), folder.join(entry.file_name())).unwrap();
        }
    }
    let manifest = folder.join("mapping.toml");
    let original = std::fs::read_to_string(&manifest).unwrap();
    assert!(original.contains(SEARCH_DESCRIPTION));
    let mut config = airlock::cli::demo::notes_config(airlock_bin());
    config.mappings_dir = Some(mappings.clone());
    config.state_dir = Some(dir.path().join("state"));
    config.cache_dir = cache_dir;
    if extra_tools > 0 {
        let notes = config
            .connections
            .get_mut("notes")
            .and_then(|s| s.as_stdio_mut())
            .unwrap();
        // Paged by 50, as large servers commonly do (one 412 KiB page works too).
        let extra = extra_tools.to_string();
        notes
            .args
            .extend(["--extra-tools", &extra, "--page-size", "50"].map(String::from));
    }
    let host = Host::start(&config).await.unwrap();
    airlock::cli::demo::approve_all(&host, "bench")
        .await
        .unwrap();
    assert_eq!(
        host.catalog().offered().count(),
        2,
        "the mapping does not serve"
    );
    if watched {
        airlock::registry::reload::watch_mappings(&host, mappings.clone()).unwrap();
    }

    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let mut workers = Vec::new();
    for _ in 0..callers {
        let gateway = host.front(None).unwrap();
        let (stop, ok, failed) = (stop.clone(), ok.clone(), failed.clone());
        workers.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let arguments = args(json!({"query": "checkpoint", "limit": 3}));
                match gateway.call("search_sources", Some(arguments)).await {
                    Ok(r) if r.is_error != Some(true) => ok.fetch_add(1, Ordering::Relaxed),
                    _ => failed.fetch_add(1, Ordering::Relaxed),
                };
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (ok0, failed0) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));

    let incoming = manifest.with_extension("incoming");
    let mut samples = Vec::with_capacity(swaps);
    for k in 1..=swaps {
        let description = format!("Search the technical notes library (bench revision {k}).");
        let text = original.replace(SEARCH_DESCRIPTION, &description);
        std::fs::write(&incoming, &text).unwrap();
        // Reviewed ahead of deployment (as `airlock review approve --manifest` does): a
        // revision binds one exact manifest, so an unapproved one would only be staged.
        approve_text(&host, &text);
        let start = Instant::now();
        std::fs::rename(&incoming, &manifest).unwrap();
        if !watched {
            host.live().load_mapping_file(&manifest).await.unwrap();
        }
        loop {
            if host
                .catalog()
                .offered()
                .any(|c| c.description.starts_with(&description))
            {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "revision {k} was never offered"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        samples.push(start.elapsed());
        // Let the debouncer's trailing batch pass before the next change; the uneven gap
        // keeps the changes from falling into step with any periodic work of the host.
        let gap = 200 + (k as u64 * 37) % 53;
        tokio::time::sleep(Duration::from_millis(gap)).await;
    }

    let (ok1, failed1) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await.unwrap();
    }
    // Then idle: no change, no calls. What the process still reads and burns.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (read0, cpu0, t0) = (read_bytes(), cpu_time(), Instant::now());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let secs = t0.elapsed().as_secs_f64();
    let idle = (
        (read_bytes() - read0) as f64 / 1024.0 / secs,
        ms(cpu_time() - cpu0) / secs,
    );
    let record = host.catalog().mappings["source-library"].record();
    SwapRun {
        swaps: stats(samples),
        ok: ok1 - ok0,
        failed: failed1 - failed0,
        revision: record.revision,
        state: record.state.to_string(),
        idle,
    }
}

/// Bytes this process has read through read(2) and friends (Linux /proc).
fn read_bytes() -> u64 {
    let io = std::fs::read_to_string("/proc/self/io").unwrap_or_default();
    io.lines()
        .find_map(|l| l.strip_prefix("rchar:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// User + system CPU time of this process, all threads.
fn cpu_time() -> Duration {
    // SAFETY: getrusage writes one rusage into the zeroed value we pass.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// Discovery, catalogue digests, drift diff and the store write for the notes fixture
/// server with 497 synthetic tools (500 in all), `n` samples each.
async fn snapshot_and_diff(n: usize) {
    println!("\nsnapshot and diff of a 500-tool server ({n} samples each)");
    let base = airlock::cli::demo::notes_config(airlock_bin()).connections["notes"]
        .as_stdio()
        .unwrap()
        .clone();
    let server = |extra: &[&str]| -> StdioServer {
        let mut s = base.clone();
        s.args.extend(
            ["--extra-tools", "497"]
                .iter()
                .chain(extra)
                .map(|a| a.to_string()),
        );
        s
    };
    let (plain, drifted, paged) = (
        server(&[]),
        server(&["--drift", "schema"]),
        server(&["--page-size", "50"]),
    );
    let budget = 64 << 20;
    let state = tempfile::tempdir().unwrap();
    let registry = Registry::new(Arc::new(SqliteStore::open(state.path()).unwrap()));

    let rev_d = registry.identify("notes", &drifted.clone().into()).unwrap();
    let conn_d = Connection::start_stdio(
        "notes",
        &drifted,
        budget,
        airlock::upstream::INITIALIZE_TIMEOUT,
    )
    .await
    .unwrap();
    let drifted_catalogue =
        Registry::catalogue(&rev_d, conn_d.discover(DISCOVERY_TIMEOUT).await.unwrap());

    let rev = registry.identify("notes", &plain.clone().into()).unwrap();
    let conn = Connection::start_stdio(
        "notes",
        &plain,
        budget,
        airlock::upstream::INITIALIZE_TIMEOUT,
    )
    .await
    .unwrap();
    let first = Registry::catalogue(&rev, conn.discover(DISCOVERY_TIMEOUT).await.unwrap());
    assert_eq!(first.tools.len(), 500);
    let tools_bytes = serde_json::to_vec(&first.tools).unwrap().len();

    let (mut discover, mut digests, mut diffs) = (Vec::new(), Vec::new(), Vec::new());
    let (mut whole, mut items_only) = (Vec::new(), Vec::new());
    let mut drifts = Vec::new();
    for _ in 0..n {
        let start = Instant::now();
        let raw = conn.discover(DISCOVERY_TIMEOUT).await.unwrap();
        discover.push(start.elapsed());
        let start = Instant::now();
        let catalogue = Registry::catalogue(&rev, raw);
        let digest = catalogue.digest();
        let built = start.elapsed();
        let items: Vec<_> = catalogue.tools.iter().map(drift::item_digests).collect();
        let total = start.elapsed();
        digests.push(total);
        whole.push(built);
        items_only.push(total - built);
        assert_eq!(digest, first.digest(), "the fixture's catalogue is stable");
        std::hint::black_box(items);
        let start = Instant::now();
        drifts = drift::diff(&catalogue, &drifted_catalogue);
        diffs.push(start.elapsed());
    }
    drop(conn);

    let rev_p = registry.identify("notes", &paged.clone().into()).unwrap();
    let conn_p = Connection::start_stdio(
        "notes",
        &paged,
        budget,
        airlock::upstream::INITIALIZE_TIMEOUT,
    )
    .await
    .unwrap();
    let mut paged_discover = Vec::new();
    for i in 0..=n {
        let start = Instant::now();
        let raw = conn_p.discover(DISCOVERY_TIMEOUT).await.unwrap();
        if i > 0 {
            paged_discover.push(start.elapsed());
        }
        assert_eq!(raw.tools.len(), 500);
    }
    std::hint::black_box(rev_p);

    // Store writes: a new snapshot into a fresh store, then the same snapshot again
    // (already stored: one more observation).
    let (mut new_write, mut repeat_write) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let dir = tempfile::tempdir().unwrap();
        let registry = Registry::new(Arc::new(SqliteStore::open(dir.path()).unwrap()));
        let rev = registry.identify("notes", &plain.clone().into()).unwrap();
        let catalogue = Catalogue {
            connection_id: rev.connection_id.clone(),
            config_digest: rev.config_digest.clone(),
            ..first.clone()
        };
        let start = Instant::now();
        let observed = registry
            .record_snapshot("notes", &rev, &catalogue, None)
            .unwrap();
        new_write.push(start.elapsed());
        assert!(observed.new);
        let start = Instant::now();
        let again = registry
            .record_snapshot("notes", &rev, &catalogue, None)
            .unwrap();
        repeat_write.push(start.elapsed());
        assert!(!again.new);
    }

    print_ms(
        &format!(
            "discover() 500 tools, one page ({} KiB)",
            tools_bytes / 1024
        ),
        &stats(discover),
    );
    print_ms(
        "discover() 500 tools, --page-size 50 (10 pages)",
        &stats(paged_discover),
    );
    print_ms("Catalogue + digest() + 500 item_digests", &stats(digests));
    print_ms("  of which Catalogue + digest()", &stats(whole));
    print_ms("  of which 500 item_digests", &stats(items_only));
    print_ms("drift::diff(plain, --drift schema)", &stats(diffs));
    print_ms(
        "record_snapshot, new (fresh SqliteStore)",
        &stats(new_write),
    );
    print_ms("record_snapshot, already stored", &stats(repeat_write));
    println!("  {} drift entries:", drifts.len());
    for d in &drifts {
        println!("    {d}");
    }
}

/// Resident set size of this process, in KiB (Linux /proc).
fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}
