//! The hot path's floor (`cargo bench -p airlock --bench floor`): `tools/call` through
//! Airlock against everything a gateway could be compared with, in one run, interleaved.
//!
//! Paths, each a child process driven by a client in this process, all reading the same
//! note (`tcp-keepalive`, ~2 KiB) from the same notes fixture server binary:
//!
//! | path | what sits between the client and the notes server |
//! |---|---|
//! | direct | nothing: an rmcp client over the server's stdio (`read_note`) |
//! | bare relay | a process copying bytes both ways (this binary, `--relay bare`) |
//! | parsing relay | a process parsing every line with serde_json and writing it again (`--relay parse`) |
//! | airlock stdio | `airlock serve`: policy, pins, the `source-library` component, trace (`retrieve_source`) |
//! | airlock http | `airlock serve --http`, one keep-alive HTTP/1.1 connection, stateless 2026-07-28 POSTs |
//!
//! Latency: `AIRLOCK_BENCH_ROUNDS` (default 4) interleaved rounds of `AIRLOCK_BENCH_ITERS / rounds`
//! sequential calls per path (default 4000 samples per path in all), after a warm-up, the
//! odd rounds in reverse order and each path after `AIRLOCK_BENCH_SETTLE_MS` (default 300)
//! of quiet, so no path is always measured right after another airlock process; p50,
//! p99, mean per path, the added cost of each path against each of the others, and p50 per
//! round. Throughput: 1 and 8 concurrent callers (on one session; over HTTP, one
//! connection per caller), `AIRLOCK_BENCH_CALLS` calls per measurement (default 4000),
//! two interleaved rounds, calls/s and the ratio to direct; every call must succeed, and
//! the RSS of each airlock process is shown before and after. The load average is printed
//! at the start and the end. Per-stage timings come from the trace itself: each
//! `call-outcome` event carries `stages_us` and `elapsed_us`, read back from the state
//! database after the run (p50 and p99 per stage, of the calls of the latency rounds: a
//! whole-pipeline p99 well under the end-to-end p99 places the tail outside the pipeline).
//!
//! The notes server behind `airlock serve` is confined (the default);
//! `AIRLOCK_BENCH_UNCONFINED=1` adds the same host with it unconfined as one more
//! interleaved stdio path.
//!
//! `AIRLOCK_BENCH_TELEMETRY=1` adds the same host with `[telemetry]` on as one more stdio
//! path: spans exported to a local OTLP/HTTP receiver in this process (which reads and
//! discards them) and `/metrics` scraped every second.
//!
//! `AIRLOCK_BENCH_CONSOLE=1` adds the same host with an operator console open on its state
//! folder as one more stdio path: `airlock console` in its own process, logged in, its
//! inbox and connections pages fetched every second (five times the refresh of an empty
//! inbox page) for the whole run: whether a console reading the store slows `tools/call`.
//!
//! `AIRLOCK_BENCH_BASELINE=/path/to/an/older/airlock` adds that binary's `serve` (stdio and
//! HTTP) as two more interleaved paths: a before/after comparison in one run.
//! `AIRLOCK_BENCH_HTTP_WORKERS=N` starts every `serve --http` (both binaries) with
//! `--workers N`; `AIRLOCK_BENCH_STDIO_ONLY=1` leaves the HTTP paths out. With many rounds
//! (`AIRLOCK_BENCH_ROUNDS=20`), the median of the per-round p50 differences is the figure
//! least moved by this machine's slow spells; the CPU each path's own process spends per
//! call (`/proc/PID/task/*/schedstat`) is the least noisy of all.

use std::io::{BufRead as _, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rmcp::ServiceExt as _;
use rmcp::model::{CallToolRequestParams, JsonObject};
use rmcp::service::{Peer, RoleClient, RunningService};
use serde_json::{Value, json};

mod common;
use common::serve::{
    HttpCaller, args, cpu_ns, log_filter, mint_reference, review, rss_kib, serve_http,
};
use common::{Stats, env_count, load_average, stats, us};

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("--relay") {
        relay(&argv[2], &argv[3..]);
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(bench());
}

// ---------------------------------------------------------------------------------------
// The relays (this binary, re-executed).

/// Runs `command` with piped stdio and relays this process's stdin to it and its stdout
/// back, either byte for byte (`bare`) or parsing and re-serializing every line (`parse`).
/// One OS thread per direction, blocking reads, unbuffered writes.
fn relay(mode: &str, command: &[String]) -> ! {
    use std::os::fd::AsFd as _;
    let parse = match mode {
        "bare" => false,
        "parse" => true,
        other => panic!("unknown relay mode {other}"),
    };
    let mut child = std::process::Command::new(&command[0])
        .args(&command[1..])
        .env_clear()
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .expect("relay: start the server");
    let to_child = child.stdin.take().unwrap();
    let from_child = child.stdout.take().unwrap();
    let stdin = std::fs::File::from(std::io::stdin().as_fd().try_clone_to_owned().unwrap());
    let stdout = std::fs::File::from(std::io::stdout().as_fd().try_clone_to_owned().unwrap());
    std::thread::spawn(move || pump(stdin, to_child, parse));
    pump(from_child, stdout, parse);
    let _ = child.kill();
    std::process::exit(0);
}

fn pump(from: impl Read, mut to: impl Write, parse: bool) {
    if !parse {
        let mut from = from;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if to.write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
            }
        }
    }
    let mut from = std::io::BufReader::with_capacity(64 * 1024, from);
    let mut line = Vec::new();
    loop {
        line.clear();
        match from.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let Ok(value) = serde_json::from_slice::<Value>(&line) else {
            continue;
        };
        let mut out = serde_json::to_vec(&value).unwrap();
        out.push(b'\n');
        if to.write_all(&out).is_err() {
            return;
        }
    }
}

// ---------------------------------------------------------------------------------------
// Clients.

fn airlock_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_airlock"))
}

/// A path driven over stdio by an rmcp client: its process and what to call.
struct StdioPath {
    name: &'static str,
    child: tokio::process::Child,
    client: RunningService<RoleClient, ()>,
    tool: &'static str,
    arguments: JsonObject,
}

async fn start_stdio(
    name: &'static str,
    mut cmd: tokio::process::Command,
    tool: &'static str,
) -> StdioPath {
    cmd.stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .kill_on_drop(true);
    let mut child = cmd.spawn().unwrap();
    let (stdout, stdin) = (child.stdout.take().unwrap(), child.stdin.take().unwrap());
    let client = ().serve((stdout, stdin)).await.unwrap();
    StdioPath {
        name,
        child,
        client,
        tool,
        arguments: args(json!({"id": "tcp-keepalive"})),
    }
}

async fn call_stdio(peer: &Peer<RoleClient>, tool: &str, arguments: &JsonObject) {
    let mut params = CallToolRequestParams::new(tool.to_string());
    params.arguments = Some(arguments.clone());
    let result = peer.call_tool(params).await.expect("tools/call");
    assert_ne!(result.is_error, Some(true), "{tool} failed: {result:?}");
}

// ---------------------------------------------------------------------------------------
// Measurement.

/// What a measurement drives: an stdio path's peer, or an HTTP front's address (each
/// measurement opens its own keep-alive connections first, outside the clock: an idle
/// connection may have been closed by the server meanwhile).
enum Target<'a> {
    Stdio(&'a StdioPath),
    Http {
        addr: &'a str,
        arguments: &'a JsonObject,
    },
}

/// `n` sequential calls after `warmup` unmeasured ones, and the CPU time `pid` ran
/// meanwhile (ns).
async fn latency(
    target: &mut Target<'_>,
    pid: Option<u32>,
    warmup: usize,
    n: usize,
) -> (Vec<Duration>, u64) {
    let mut samples = Vec::with_capacity(n);
    let mut cpu_at_start = 0;
    let mut http = match target {
        Target::Http { addr, .. } => Some(HttpCaller::connect(addr).await),
        Target::Stdio(_) => None,
    };
    for i in 0..warmup + n {
        let start = Instant::now();
        match (&*target, http.as_mut()) {
            (Target::Stdio(p), _) => call_stdio(p.client.peer(), p.tool, &p.arguments).await,
            (Target::Http { arguments, .. }, Some(caller)) => {
                caller.call("retrieve_source", arguments).await;
            }
            (Target::Http { .. }, None) => unreachable!(),
        }
        if i >= warmup {
            samples.push(start.elapsed());
        } else if i + 1 == warmup {
            cpu_at_start = cpu_ns(pid);
        }
    }
    (samples, cpu_ns(pid).saturating_sub(cpu_at_start))
}

/// `total` calls spread over `callers` concurrent callers; calls per second.
async fn throughput(target: &mut Target<'_>, callers: usize, total: usize) -> f64 {
    let each = total / callers;
    let mut pool = Vec::new();
    if let Target::Http { addr, .. } = target {
        for _ in 0..callers {
            pool.push(HttpCaller::connect(addr).await);
        }
    }
    let start = Instant::now();
    match target {
        Target::Stdio(p) => {
            let mut tasks = Vec::new();
            for _ in 0..callers {
                let (peer, tool, arguments) =
                    (p.client.peer().clone(), p.tool, p.arguments.clone());
                tasks.push(tokio::spawn(async move {
                    for _ in 0..each {
                        call_stdio(&peer, tool, &arguments).await;
                    }
                }));
            }
            for t in tasks {
                t.await.expect("a caller failed");
            }
        }
        Target::Http { arguments, .. } => {
            let mut tasks = Vec::new();
            for mut caller in pool {
                let arguments = (*arguments).clone();
                tasks.push(tokio::spawn(async move {
                    for _ in 0..each {
                        caller.call("retrieve_source", &arguments).await;
                    }
                    caller
                }));
            }
            for t in tasks {
                t.await.expect("a caller failed");
            }
        }
    }
    (each * callers) as f64 / start.elapsed().as_secs_f64()
}

fn print_row(name: &str, s: &Stats, direct: &Stats) {
    println!(
        "| {name:<34} | {:>8.1} | {:>8.1} | {:>8.1} | {:>+9.1} | {:>+9.1} | ×{:.2} |",
        us(s.p50),
        us(s.p99),
        us(s.mean),
        us(s.p50) - us(direct.p50),
        us(s.p99) - us(direct.p99),
        us(s.p50) / us(direct.p50),
    );
}

/// p50 and p99 of each stage in the `call-outcome` events of `state_dir`'s trace, and of
/// the whole call (`elapsed_us`), for completed calls recorded at or before `until_ms`
/// (milliseconds since the Unix epoch: the end of the latency rounds, so calls queued
/// behind eight callers do not make the tail).
fn stage_percentiles(state_dir: &Path, until_ms: u64) -> Vec<(String, u64, u64, usize)> {
    let db = rusqlite::Connection::open(state_dir.join("airlock.db")).unwrap();
    let mut stmt = db
        .prepare("SELECT payload FROM trace_events WHERE kind = 'call-outcome' AND at_ms <= ?1")
        .unwrap();
    let mut stages: std::collections::BTreeMap<String, Vec<u64>> = Default::default();
    let rows = stmt
        .query_map([until_ms as i64], |r| r.get::<_, String>(0))
        .unwrap()
        .filter_map(Result::ok);
    for payload in rows {
        let Ok(v) = serde_json::from_str::<Value>(&payload) else {
            continue;
        };
        if v["outcome"] != "completed" {
            continue;
        }
        if let Some(s) = v["stages_us"].as_object() {
            for (k, t) in s {
                stages
                    .entry(k.clone())
                    .or_default()
                    .push(t.as_u64().unwrap_or(0));
            }
        }
        if let Some(t) = v["elapsed_us"].as_u64() {
            stages.entry("(whole pipeline)".into()).or_default().push(t);
        }
    }
    stages
        .into_iter()
        .map(|(k, mut v)| {
            v.sort_unstable();
            (k, v[v.len() / 2], v[v.len() * 99 / 100], v.len())
        })
        .collect()
}

/// `airlock serve` (binary `bin`) on stdio with its own reviewed store, and a reference
/// minted in its session.
async fn airlock_stdio(
    name: &'static str,
    bin: &Path,
    config: &Path,
    state: &Path,
    cache_dir: &Path,
) -> StdioPath {
    review(bin, config, state);
    let mut cmd = tokio::process::Command::new(bin);
    cmd.arg("serve")
        .arg("--config")
        .arg(config)
        .env("AIRLOCK_STATE_DIR", state)
        .env("AIRLOCK_CACHE_DIR", cache_dir)
        .env("AIRLOCK_LOG", log_filter());
    let mut path = start_stdio(name, cmd, "retrieve_source").await;
    let mut params = CallToolRequestParams::new("search_sources");
    params.arguments = Some(args(json!({"query": "keepalive", "limit": 1})));
    let hits = path.client.peer().call_tool(params).await.unwrap();
    let reference = hits.structured_content.unwrap()["result"][0]["reference"]
        .as_str()
        .unwrap()
        .to_string();
    path.arguments = args(json!({"reference": reference}));
    path
}

/// `airlock serve --http` (binary `bin`) and a reference minted over HTTP (its own process
/// and session).
struct HttpPath {
    name: &'static str,
    _child: tokio::process::Child,
    pid: Option<u32>,
    addr: String,
    arguments: JsonObject,
}

async fn airlock_http(
    name: &'static str,
    bin: &Path,
    config: &Path,
    state: &Path,
    cache_dir: &Path,
) -> HttpPath {
    review(bin, config, state);
    let (child, addr) = serve_http(bin, config, state, cache_dir).await;
    let arguments = mint_reference(&addr).await;
    HttpPath {
        name,
        pid: child.id(),
        _child: child,
        addr,
        arguments,
    }
}

async fn bench() {
    let iters = env_count("AIRLOCK_BENCH_ITERS", 4000);
    let rounds = env_count("AIRLOCK_BENCH_ROUNDS", 4);
    let calls = env_count("AIRLOCK_BENCH_CALLS", 4000);
    let per_round = (iters / rounds).max(1);
    let warmup = (per_round / 10).max(20);
    let baseline = std::env::var_os("AIRLOCK_BENCH_BASELINE").map(PathBuf::from);
    println!(
        "airlock floor benchmark ({} build, {} samples per path in {rounds} interleaved rounds)",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        per_round * rounds
    );
    if let Some(b) = &baseline {
        println!("baseline airlock binary: {}", b.display());
    }
    println!("load average at start: {}", load_average());

    let bundle = Path::new(airlock::ADAPTER_BUNDLE).join("source-library");
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
    let cache_dir = dir.path().join("compiled");
    let me = std::env::current_exe().unwrap();
    let bin = airlock_bin();

    // Stdio paths, cheapest first; each airlock process has its own store (so the trace
    // read back is its own), reviewed first: an unreviewed mapping is not offered.
    let mut stdio = Vec::new();
    let mut cmd = tokio::process::Command::new(&bin);
    cmd.args(["fixture", "notes-server"]).env_clear();
    stdio.push(start_stdio("direct rmcp → notes server", cmd, "read_note").await);
    for (name, mode) in [
        ("+ bare relay process", "bare"),
        ("+ parsing relay process (serde_json)", "parse"),
    ] {
        let mut cmd = tokio::process::Command::new(&me);
        cmd.args(["--relay", mode])
            .arg(&bin)
            .args(["fixture", "notes-server"])
            .env_clear();
        stdio.push(start_stdio(name, cmd, "read_note").await);
    }
    let stdio_state = dir.path().join("state-stdio");
    stdio.push(
        airlock_stdio(
            "airlock serve (stdio)",
            &bin,
            &config,
            &stdio_state,
            &cache_dir,
        )
        .await,
    );
    // AIRLOCK_BENCH_UNCONFINED=1: the same host with its notes server unconfined
    // (`confine = false`), interleaved with the confined one: what confinement costs a call.
    if std::env::var_os("AIRLOCK_BENCH_UNCONFINED").is_some() {
        let open_config = dir.path().join("airlock-unconfined.toml");
        std::fs::write(
            &open_config,
            std::fs::read_to_string(&config).unwrap().replacen(
                "[[mapping]]",
                "confine = false\n[[mapping]]",
                1,
            ),
        )
        .unwrap();
        stdio.push(
            airlock_stdio(
                "airlock serve (stdio), server unconfined",
                &bin,
                &open_config,
                &dir.path().join("state-unconfined"),
                &cache_dir,
            )
            .await,
        );
    }
    // AIRLOCK_BENCH_TELEMETRY=1: the same host with spans exported to a local OTLP
    // receiver (in this process, discarding what it gets) and its metrics scraped every
    // second, interleaved with the one without: what telemetry costs a call.
    let _telemetry = if std::env::var_os("AIRLOCK_BENCH_TELEMETRY").is_some() {
        let receiver = OtlpSink::start();
        let metrics_addr = format!("127.0.0.1:{}", free_port());
        let on_config = dir.path().join("airlock-telemetry.toml");
        std::fs::write(
            &on_config,
            format!(
                "{}[telemetry]\notlp = \"http://{}\"\nmetrics = \"{metrics_addr}\"\n",
                std::fs::read_to_string(&config).unwrap(),
                receiver.addr
            ),
        )
        .unwrap();
        stdio.push(
            airlock_stdio(
                "airlock serve (stdio), telemetry on",
                &bin,
                &on_config,
                &dir.path().join("state-telemetry"),
                &cache_dir,
            )
            .await,
        );
        Some((receiver, Scraper::start(metrics_addr)))
    } else {
        None
    };
    // AIRLOCK_BENCH_CONSOLE=1: the same host with a console polling its store, interleaved
    // with the one without.
    let _console = if std::env::var_os("AIRLOCK_BENCH_CONSOLE").is_some() {
        let state = dir.path().join("state-console");
        stdio.push(
            airlock_stdio(
                "airlock serve (stdio), console open",
                &bin,
                &config,
                &state,
                &cache_dir,
            )
            .await,
        );
        Some(ConsolePoller::start(&bin, &state))
    } else {
        None
    };
    // AIRLOCK_BENCH_STDIO_ONLY=1: no HTTP paths (a quicker before/after of the stdio path).
    let with_http = std::env::var_os("AIRLOCK_BENCH_STDIO_ONLY").is_none();
    let mut http = Vec::new();
    if with_http {
        http.push(
            airlock_http(
                "airlock serve --http (keep-alive)",
                &bin,
                &config,
                &dir.path().join("state-http"),
                &cache_dir,
            )
            .await,
        );
    }
    if let Some(old) = &baseline {
        let old_cache = dir.path().join("compiled-baseline");
        stdio.push(
            airlock_stdio(
                "baseline airlock serve (stdio)",
                old,
                &config,
                &dir.path().join("state-baseline-stdio"),
                &old_cache,
            )
            .await,
        );
        if with_http {
            http.push(
                airlock_http(
                    "baseline airlock serve --http",
                    old,
                    &config,
                    &dir.path().join("state-baseline-http"),
                    &old_cache,
                )
                .await,
            );
        }
    }
    let names: Vec<&'static str> = stdio
        .iter()
        .map(|p| p.name)
        .chain(http.iter().map(|p| p.name))
        .collect();
    let n_stdio = stdio.len();
    macro_rules! target {
        ($i:expr) => {
            if $i < n_stdio {
                Target::Stdio(&stdio[$i])
            } else {
                let h = &http[$i - n_stdio];
                Target::Http {
                    addr: &h.addr,
                    arguments: &h.arguments,
                }
            }
        };
    }

    // Latency: interleaved rounds, pooled.
    let mut samples: Vec<Vec<Duration>> = vec![Vec::new(); names.len()];
    let mut round_p50: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    let mut cpu: Vec<u64> = vec![0; names.len()];
    let pid_of = |i: usize| {
        if i < n_stdio {
            stdio[i].child.id()
        } else {
            http[i - n_stdio].pid
        }
    };
    let settle = Duration::from_millis(env_count("AIRLOCK_BENCH_SETTLE_MS", 300) as u64);
    for round in 0..rounds {
        // Odd rounds run the paths in reverse order, and each path waits `settle` first:
        // a path measured right after an airlock path otherwise shares the machine with
        // that process's deferred work (its WAL checkpoint, Store teardown), which made
        // the same binary measure ~58 µs slower at p50 in the second slot than in the first.
        let order: Vec<usize> = if round % 2 == 0 {
            (0..names.len()).collect()
        } else {
            (0..names.len()).rev().collect()
        };
        for i in order {
            tokio::time::sleep(settle).await;
            let mut target = target!(i);
            let (s, ns) = latency(&mut target, pid_of(i), warmup, per_round).await;
            round_p50[i].push(us(stats(s.clone()).p50));
            samples[i].extend(s);
            cpu[i] += ns;
        }
    }
    let latency_end_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let all: Vec<Stats> = samples.into_iter().map(stats).collect();
    println!("\n## tools/call latency (µs; added = against direct)\n");
    println!(
        "| {:<34} | {:>8} | {:>8} | {:>8} | {:>9} | {:>9} | ratio |",
        "path", "p50", "p99", "mean", "added p50", "added p99"
    );
    println!(
        "|{:-<36}|{:->10}|{:->10}|{:->10}|{:->11}|{:->11}|-------|",
        "", "", "", "", "", ""
    );
    for (name, s) in names.iter().zip(&all) {
        print_row(name, s, &all[0]);
    }
    println!("\np50 per interleaved round (µs):");
    for (name, p) in names.iter().zip(&round_p50) {
        let p: Vec<String> = p.iter().map(|v| format!("{v:.0}")).collect();
        println!("  {name:<36} {}", p.join(", "));
    }
    println!(
        "\nmedian over rounds of the per-round p50 difference (µs; paired, so slow rounds cancel):"
    );
    for (i, name) in names.iter().enumerate().skip(1) {
        let mut d: Vec<f64> = round_p50[i]
            .iter()
            .zip(&round_p50[0])
            .map(|(a, b)| a - b)
            .collect();
        d.sort_by(f64::total_cmp);
        println!("  {name:<36} {:>+7.1} vs direct", d[d.len() / 2]);
    }
    println!(
        "\nCPU per call of each path's own process (µs: the notes server for direct, the relay, airlock serve):"
    );
    for (i, name) in names.iter().enumerate() {
        let calls = (per_round * rounds).max(1) as f64;
        println!("  {name:<36} {:>7.1}", cpu[i] as f64 / 1000.0 / calls);
    }
    println!("\nadded p50 / p99 of each path against the ones above it (µs):");
    for (i, a) in all.iter().enumerate().skip(1) {
        let against: Vec<String> = all[..i]
            .iter()
            .zip(&names)
            .map(|(b, n)| {
                format!(
                    "vs {n}: {:+.0} / {:+.0}",
                    us(a.p50) - us(b.p50),
                    us(a.p99) - us(b.p99)
                )
            })
            .collect();
        println!("  {}\n    {}", names[i], against.join("\n    "));
    }

    // Throughput at 1 and 8 concurrent callers.
    let pids: Vec<(&str, Option<u32>)> = stdio[3..]
        .iter()
        .map(|p| (p.name, p.child.id()))
        .chain(http.iter().map(|p| (p.name, p.pid)))
        .collect();
    let rss_before: Vec<u64> = pids.iter().map(|(_, p)| rss_kib(*p)).collect();
    println!("\n## throughput (calls/s, {calls} calls per measurement, 2 interleaved rounds)\n");
    for callers in [1usize, 8] {
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
        let mut cpu_per_call: Vec<f64> = vec![0.0; names.len()];
        for _ in 0..2 {
            for (i, rate) in rates.iter_mut().enumerate() {
                let mut target = target!(i);
                let before = cpu_ns(pid_of(i));
                rate.push(throughput(&mut target, callers, calls).await);
                cpu_per_call[i] +=
                    cpu_ns(pid_of(i)).saturating_sub(before) as f64 / 1000.0 / (2 * calls) as f64;
            }
        }
        println!("{callers} concurrent caller(s):");
        let direct_rate = rates[0].iter().sum::<f64>() / rates[0].len() as f64;
        for (i, (name, r)) in names.iter().zip(&rates).enumerate() {
            let mean = r.iter().sum::<f64>() / r.len() as f64;
            let per: Vec<String> = r.iter().map(|v| format!("{v:.0}")).collect();
            println!(
                "  {name:<36} {mean:>8.0} calls/s  ×{:.2} of direct  (rounds: {}; CPU {:.0} µs/call)",
                mean / direct_rate,
                per.join(", "),
                cpu_per_call[i]
            );
        }
    }
    println!("RSS before → after the throughput runs:");
    for ((name, pid), before) in pids.iter().zip(&rss_before) {
        println!("  {name:<36} {before} → {} KiB", rss_kib(*pid));
    }

    // Per-stage timings of the stdio gateway's calls, from its trace.
    drop(http);
    for p in stdio {
        p.client.cancel().await.ok();
    }
    // Let the gateways finish their shutdown (the trace is committed per call anyway).
    tokio::time::sleep(Duration::from_millis(300)).await;
    for (name, state) in [
        ("airlock serve (stdio)", stdio_state),
        (
            "baseline airlock serve (stdio)",
            dir.path().join("state-baseline-stdio"),
        ),
    ] {
        if !state.exists() {
            continue;
        }
        println!(
            "\n## pipeline stages inside {name}, from its trace (latency rounds; p50 / p99, µs)\n"
        );
        for (stage, p50, p99, n) in stage_percentiles(&state, latency_end_ms) {
            println!("  {stage:<24} {p50:>6} / {p99:>6}   (n={n})");
        }
    }
    if let Some((receiver, scraper)) = &_telemetry {
        use std::sync::atomic::Ordering::Relaxed;
        println!(
            "\ntelemetry path: {} OTLP export requests, {} bytes of spans received; {} scrapes of /metrics ({} failed)",
            receiver.requests.load(Relaxed),
            receiver.bytes.load(Relaxed),
            scraper.ok.load(Relaxed),
            scraper.failed.load(Relaxed)
        );
    }
    if let Some(c) = &_console {
        use std::sync::atomic::Ordering::Relaxed;
        println!(
            "\nconsole path: {} console pages fetched ({} failed)",
            c.ok.load(Relaxed),
            c.failed.load(Relaxed)
        );
    }
    println!("\nload average at end: {}", load_average());
}

/// `airlock console` on a host's state folder, logged in, its inbox and connections pages
/// fetched every second by a thread of this process (`AIRLOCK_BENCH_CONSOLE`).
struct ConsolePoller {
    _console: common::console::Console,
    ok: std::sync::Arc<std::sync::atomic::AtomicU64>,
    failed: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl ConsolePoller {
    fn start(bin: &Path, state: &Path) -> Self {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
        let console = common::console::Console::start(bin, state);
        let ok = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let (o, f) = (ok.clone(), failed.clone());
        let (addr, cookie) = (console.addr.clone(), console.cookie.clone());
        std::thread::spawn(move || {
            loop {
                std::thread::sleep(Duration::from_secs(1));
                for path in ["/console/approvals", "/console/connections"] {
                    match common::console::get(&addr, path, &cookie) {
                        Ok(t) if t.starts_with("HTTP/1.1 200") => o.fetch_add(1, Relaxed),
                        _ => f.fetch_add(1, Relaxed),
                    };
                }
            }
        });
        Self {
            _console: console,
            ok,
            failed,
        }
    }
}

/// A free loopback port.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A local OTLP/HTTP receiver that reads each export request whole, answers `200`, and
/// keeps only counts (`AIRLOCK_BENCH_TELEMETRY`).
struct OtlpSink {
    addr: String,
    requests: std::sync::Arc<std::sync::atomic::AtomicU64>,
    bytes: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl OtlpSink {
    fn start() -> Self {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let requests = Arc::new(AtomicU64::new(0));
        let bytes = Arc::new(AtomicU64::new(0));
        let (r, b) = (requests.clone(), bytes.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let (r, b) = (r.clone(), b.clone());
                std::thread::spawn(move || {
                    let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
                    let mut out = stream;
                    loop {
                        let mut length = 0usize;
                        let mut first = true;
                        loop {
                            let mut line = String::new();
                            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                                return;
                            }
                            let line = line.trim_end();
                            if line.is_empty() && !first {
                                break;
                            }
                            first = false;
                            if let Some(v) =
                                line.to_ascii_lowercase().strip_prefix("content-length:")
                            {
                                length = v.trim().parse().unwrap_or(0);
                            }
                        }
                        let mut body = vec![0u8; length];
                        if reader.read_exact(&mut body).is_err() {
                            return;
                        }
                        r.fetch_add(1, Relaxed);
                        b.fetch_add(length as u64, Relaxed);
                        let answer = "HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n";
                        if out.write_all(answer.as_bytes()).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Self {
            addr,
            requests,
            bytes,
        }
    }
}

/// GETs `/metrics` at an address every second, as a Prometheus scraper would.
struct Scraper {
    ok: std::sync::Arc<std::sync::atomic::AtomicU64>,
    failed: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Scraper {
    fn start(addr: String) -> Self {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
        let ok = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let (o, f) = (ok.clone(), failed.clone());
        std::thread::spawn(move || {
            loop {
                std::thread::sleep(Duration::from_secs(1));
                let scraped = std::net::TcpStream::connect(&addr).and_then(|mut s| {
                    s.write_all(
                        format!(
                            "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
                        )
                        .as_bytes(),
                    )?;
                    let mut text = String::new();
                    s.read_to_string(&mut text)?;
                    Ok(text.starts_with("HTTP/1.1 200"))
                });
                match scraped {
                    Ok(true) => o.fetch_add(1, Relaxed),
                    _ => f.fetch_add(1, Relaxed),
                };
            }
        });
        Self { ok, failed }
    }
}
