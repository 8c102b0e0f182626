//! Benchmarks, as a plain bench binary (`cargo bench -p airlock --bench gateway`).
//!
//! 1. `tools/call` latency over stdio: the direct rmcp path (client → notes fixture server,
//!    `read_note`) against the same read through `airlock serve` (client → gateway →
//!    source-library component → the same server, `retrieve_source`), in one run.
//! 2. Per-call instantiation of the adapter from its cached `InstancePre`.
//! 3. Component cold load: pin check, compile, link, `InstancePre`.
//!
//! Prints p50 / p99 / mean per measurement and the added latency and ratio.
//! `AIRLOCK_BENCH_ITERS` sets the sample count (default 2000).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use airlock::gateway::{Host, MappingSource};
use airlock::runtime::{Allocator, Runtime, UpstreamGrant};
use rmcp::ServiceExt as _;
use rmcp::model::{CallToolRequestParams, JsonObject};
use rmcp::service::{RoleClient, RunningService};
use rmcp::transport::TokioChildProcess;
use serde_json::{Value, json};

struct Stats {
    p50: Duration,
    p99: Duration,
    mean: Duration,
    n: usize,
}

fn stats(mut samples: Vec<Duration>) -> Stats {
    samples.sort();
    let n = samples.len();
    Stats {
        p50: samples[n / 2],
        p99: samples[(n * 99 / 100).min(n - 1)],
        mean: samples.iter().sum::<Duration>() / n as u32,
        n,
    }
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn print(name: &str, s: &Stats) {
    println!(
        "{name:<48} n={:<6} p50 {:>9.1} µs   p99 {:>9.1} µs   mean {:>9.1} µs",
        s.n,
        us(s.p50),
        us(s.p99),
        us(s.mean)
    );
}

fn args(v: Value) -> JsonObject {
    match v {
        Value::Object(o) => o,
        _ => JsonObject::new(),
    }
}

async fn time_calls(
    client: &RunningService<RoleClient, ()>,
    tool: &str,
    arguments: JsonObject,
    warmup: usize,
    iters: usize,
) -> Stats {
    let mut samples = Vec::with_capacity(iters);
    for i in 0..warmup + iters {
        let mut params = CallToolRequestParams::new(tool.to_string());
        params.arguments = Some(arguments.clone());
        let start = Instant::now();
        let result = client.peer().call_tool(params).await.expect("tools/call");
        let elapsed = start.elapsed();
        assert_ne!(result.is_error, Some(true), "{tool} failed: {result:?}");
        if i >= warmup {
            samples.push(elapsed);
        }
    }
    stats(samples)
}

fn airlock_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_airlock"))
}

#[tokio::main]
async fn main() {
    let iters: usize = std::env::var("AIRLOCK_BENCH_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let warmup = (iters / 10).max(20);
    let bundle = Path::new(airlock::ADAPTER_BUNDLE).join("source-library");
    println!(
        "airlock benchmarks ({} build, {iters} samples each)\n",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    );

    // 1. Direct rmcp vs through airlock serve, same note, same server binary.
    let mut cmd = tokio::process::Command::new(airlock_bin());
    cmd.args(["fixture", "notes-server"]).env_clear();
    let direct = ().serve(TokioChildProcess::new(cmd).unwrap()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("airlock.toml");
    std::fs::write(
        &config,
        format!(
            "[[connection]]\nname = \"notes\"\ncommand = \"@airlock\"\nargs = [\"fixture\", \"notes-server\"]\n[[mapping]]\nmanifest = {:?}\n",
            bundle.join("mapping.toml").display().to_string()
        ),
    )
    .unwrap();
    let mut cmd = tokio::process::Command::new(airlock_bin());
    cmd.arg("serve").arg("--config").arg(&config).env(
        "AIRLOCK_LOG",
        std::env::var("AIRLOCK_BENCH_LOG").unwrap_or_else(|_| "warn".into()),
    );
    let gateway = ().serve(TokioChildProcess::new(cmd).unwrap()).await.unwrap();
    let mut params = CallToolRequestParams::new("search_sources");
    params.arguments = Some(args(json!({"query": "keepalive", "limit": 1})));
    let hits = gateway.peer().call_tool(params).await.unwrap();
    let reference = hits.structured_content.unwrap()["result"][0]["reference"]
        .as_str()
        .unwrap()
        .to_string();

    // Interleave rounds so machine noise hits both paths alike.
    let rounds = 4;
    let (mut d_all, mut g_all) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let d = time_calls(
            &direct,
            "read_note",
            args(json!({"id": "tcp-keepalive"})),
            warmup / rounds,
            iters / rounds,
        )
        .await;
        let g = time_calls(
            &gateway,
            "retrieve_source",
            args(json!({"reference": reference})),
            warmup / rounds,
            iters / rounds,
        )
        .await;
        d_all.push(d);
        g_all.push(g);
    }
    // Re-measure as one pooled sample set per path.
    let d = time_calls(
        &direct,
        "read_note",
        args(json!({"id": "tcp-keepalive"})),
        warmup,
        iters,
    )
    .await;
    let g = time_calls(
        &gateway,
        "retrieve_source",
        args(json!({"reference": reference})),
        warmup,
        iters,
    )
    .await;
    print("direct rmcp tools/call read_note", &d);
    print("through airlock serve: retrieve_source", &g);
    println!(
        "{:<48} p50 +{:.1} µs (x{:.2})   p99 +{:.1} µs (x{:.2})",
        "added by airlock",
        us(g.p50) - us(d.p50),
        us(g.p50) / us(d.p50),
        us(g.p99) - us(d.p99),
        us(g.p99) / us(d.p99)
    );
    let spread = |v: &[Stats]| {
        let p: Vec<String> = v.iter().map(|s| format!("{:.0}", us(s.p50))).collect();
        p.join(", ")
    };
    println!(
        "  p50 per interleaved round (µs): direct [{}], airlock [{}]",
        spread(&d_all),
        spread(&g_all)
    );
    direct.cancel().await.ok();
    gateway.cancel().await.ok();

    // 2. Instantiation from InstancePre (pooling vs on-demand), idle memory, 3. cold load.
    let state = tempfile::tempdir().unwrap();
    let mut config = airlock::demo::notes_config(env!("CARGO_BIN_EXE_airlock").into());
    config.state_dir = Some(state.path().to_path_buf());
    let host = Host::start_with(
        &config,
        vec![MappingSource::from_file(&bundle.join("mapping.toml")).unwrap()],
    )
    .await
    .unwrap();
    let mapping = host.catalog().mappings["source-library"].clone();
    let grant: Arc<UpstreamGrant> = mapping.grant.clone();
    let mut samples = Vec::with_capacity(iters);
    for i in 0..warmup + iters {
        let start = Instant::now();
        mapping
            .adapter
            .instantiate_once(grant.clone())
            .await
            .unwrap();
        if i >= warmup {
            samples.push(start.elapsed());
        }
    }
    print("instantiate from InstancePre (pooling)", &stats(samples));

    let source = MappingSource::from_file(&bundle.join("mapping.toml")).unwrap();
    let contract = source.manifest.mapping.contract.clone();
    let on_demand = Runtime::with_options(None, Allocator::OnDemand).unwrap();
    let adapter = on_demand
        .load(&source.manifest, &source.component, &contract)
        .unwrap();
    let mut samples = Vec::with_capacity(iters);
    for i in 0..warmup + iters {
        let start = Instant::now();
        adapter.instantiate_once(grant.clone()).await.unwrap();
        if i >= warmup {
            samples.push(start.elapsed());
        }
    }
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
