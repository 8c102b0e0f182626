//! What the store costs (`cargo bench -p airlock --bench store`): the embedded SQLite store
//! against a PostgreSQL store in one run, interleaved, and one host against two on one
//! PostgreSQL database.
//!
//! The PostgreSQL server is started by the bench itself, as the tests start theirs
//! (`initdb` + `postgres` on a Unix socket in a temporary folder, see
//! `tests/integration/common/pg.rs`): a local server, no network in between.
//!
//! 1. **Store operations**, in process, `AIRLOCK_BENCH_ROUNDS` (default 4) interleaved
//!    rounds per store: consuming a receipt together with creating its intent (one
//!    transaction, two events); a whole effect call's intent bookkeeping (create, four
//!    attempt writes, completed: six commits); one read call's four trace events (one
//!    transaction). On PostgreSQL also 8 threads consuming receipts at once
//!    (consumptions/s) and 8 threads appending read calls' events at once (calls/s: the
//!    rate one serialized chain allows).
//! 2. **`tools/call` over the HTTP front**: `airlock serve --http` on SQLite and on
//!    PostgreSQL, the same notes fixture server and component, one keep-alive connection,
//!    stateless 2026-07-28 POSTs, interleaved rounds: `search_sources` (mints references:
//!    on PostgreSQL they are written to the store, so another host resolves them) and
//!    `retrieve_source` of a reference minted there. p50, p99 and the difference.
//! 3. **Throughput at 8 concurrent callers** (a keep-alive connection each,
//!    `retrieve_source`): the SQLite host; one PostgreSQL host; two PostgreSQL hosts on one
//!    database, four callers each (two interleaved rounds of `AIRLOCK_BENCH_CALLS`, default
//!    4000), and for PostgreSQL the transactions committed per call (`pg_stat_database`).
//!    Every call must succeed, and the shared trace must verify afterwards.
//!
//! `AIRLOCK_BENCH_ITERS` sets the samples per path and operation (default 2000). PostgreSQL
//! runs with its defaults (fsync on, `synchronous_commit` on: every commit waits for its
//! WAL flush); `AIRLOCK_BENCH_PG_COMMIT=off` sets `synchronous_commit` off, which is what
//! SQLite's WAL with `synchronous=NORMAL` (the SQLite store's setting) does.
//! `AIRLOCK_BENCH_HTTP_WORKERS=N` starts every `serve --http` with `--workers N` (else
//! serve's default: one worker on SQLite, one per core on PostgreSQL).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use airlock::store::{PostgresStore, SqliteStore, Store, Trace as _};
use rmcp::model::JsonObject;
use serde_json::json;

mod common;
use common::serve::{HttpCaller, args, mint_reference, review, serve_http};
use common::{Stats, env_count, load_average, stats, store_ops, us};

#[path = "../tests/integration/common/pg.rs"]
#[allow(dead_code)]
mod pg;

fn main() {
    let iters = env_count("AIRLOCK_BENCH_ITERS", 2000);
    let rounds = env_count("AIRLOCK_BENCH_ROUNDS", 4);
    let calls = env_count("AIRLOCK_BENCH_CALLS", 4000);
    println!(
        "airlock store benchmark ({} build, {iters} samples per path in {rounds} interleaved rounds)",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    );
    println!("load average at start: {}", load_average());
    // PostgreSQL's durable defaults (fsync on), not the tests' fsync=off. SAFETY: no
    // other thread runs yet.
    unsafe { std::env::set_var(pg::DURABLE_ENV, "1") };
    let started = Instant::now();
    let server = pg::server();
    println!(
        "PostgreSQL server started on {} ({:.1} s)",
        server.socket_dir.display(),
        started.elapsed().as_secs_f64()
    );
    let synchronous_commit =
        std::env::var("AIRLOCK_BENCH_PG_COMMIT").unwrap_or_else(|_| "on".into());
    pg::psql_ok(
        &server.socket_dir,
        "postgres",
        &format!("ALTER SYSTEM SET synchronous_commit = {synchronous_commit}"),
    )
    .unwrap();
    pg::psql_ok(&server.socket_dir, "postgres", "SELECT pg_reload_conf()").unwrap();
    std::thread::sleep(Duration::from_millis(200));
    println!(
        "PostgreSQL settings: {:?} (SQLite: WAL, synchronous=NORMAL)",
        pg::query(
            &pg::target("postgres"),
            "SELECT name || '=' || setting FROM pg_settings WHERE name IN ('fsync', 'synchronous_commit', 'shared_buffers', 'server_version') ORDER BY name"
        )
        .into_iter()
        .flatten()
        .flatten()
        .collect::<Vec<_>>()
    );
    store_operations(iters, rounds);
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(fronts(iters, rounds, calls));
    println!("\nload average at end: {}", load_average());
}

fn row(name: &str, s: &Stats) {
    println!(
        "{name:<64} n={:<6} p50 {:>8.1} µs   p99 {:>8.1} µs",
        s.n,
        us(s.p50),
        us(s.p99)
    );
}

/// A state folder the hygiene rules accept (0700).
fn state_folder(path: &Path) -> PathBuf {
    std::fs::create_dir_all(path).unwrap();
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    path.to_path_buf()
}

// ---------------------------------------------------------------------------------------
// 1. Store operations, in process.

/// One store under measurement and the samples of each operation, all rounds.
struct Measured {
    name: &'static str,
    store: Arc<dyn Store>,
    receipts: Vec<String>,
    consume: Vec<Duration>,
    effect: Vec<Duration>,
    trace: Vec<Duration>,
}

fn store_operations(iters: usize, rounds: usize) {
    println!("\n## 1. Store operations (in process, {rounds} interleaved rounds)\n");
    let dir = tempfile::tempdir().unwrap();
    let sqlite_state = state_folder(&dir.path().join("sqlite"));
    let pg_state = state_folder(&dir.path().join("postgres"));
    let target = pg::database();
    let binding = store_ops::binding();
    let per_round = (iters / rounds).max(1);
    let warmup = (per_round / 10).max(10);
    let needed = rounds * (per_round + warmup);
    let stores: [(&'static str, Arc<dyn Store>); 2] = [
        (
            "sqlite",
            Arc::new(SqliteStore::open(&sqlite_state).unwrap()),
        ),
        (
            "postgres",
            Arc::new(PostgresStore::open(&target, Some(&pg_state), None).unwrap()),
        ),
    ];
    let mut measured: Vec<Measured> = stores
        .into_iter()
        .map(|(name, store)| Measured {
            name,
            receipts: store_ops::approved(store.as_ref(), &binding, needed),
            store,
            consume: Vec::new(),
            effect: Vec::new(),
            trace: Vec::new(),
        })
        .collect();
    let mut next = 0usize;
    for _ in 0..rounds {
        for m in &mut measured {
            let store = m.store.as_ref();
            for i in 0..warmup + per_round {
                let id = m.receipts.pop().unwrap();
                next += 1;
                let start = Instant::now();
                store_ops::consume(store, &binding, &id, next);
                let consumed = start.elapsed();
                next += 1;
                let start = Instant::now();
                store_ops::effect_call(store, next);
                let effect = start.elapsed();
                let start = Instant::now();
                store
                    .append_events(store_ops::call_events(&format!("call_{next}")))
                    .unwrap();
                let traced = start.elapsed();
                if i >= warmup {
                    m.consume.push(consumed);
                    m.effect.push(effect);
                    m.trace.push(traced);
                }
            }
        }
    }
    let mut p50s = Vec::new();
    for m in measured.iter_mut() {
        let rows = [
            (
                "receipt consumed + intent created (+2 events), one txn",
                &m.consume,
            ),
            (
                "effect call bookkeeping: create + 4 attempt writes + completed",
                &m.effect,
            ),
            ("one read call's 4 trace events, one txn", &m.trace),
        ];
        let mut mine = Vec::new();
        for (what, samples) in rows {
            let s = stats(samples.clone());
            row(&format!("{}: {what}", m.name), &s);
            mine.push(s.p50);
        }
        p50s.push(mine);
    }
    println!(
        "postgres / sqlite p50: receipt ×{:.2}, effect bookkeeping ×{:.2}, trace append ×{:.2}",
        p50s[1][0].as_secs_f64() / p50s[0][0].as_secs_f64(),
        p50s[1][1].as_secs_f64() / p50s[0][1].as_secs_f64(),
        p50s[1][2].as_secs_f64() / p50s[0][2].as_secs_f64(),
    );

    // 8 threads consuming receipts on PostgreSQL at once (each its own receipt).
    let pg = measured.pop().unwrap();
    let store = pg.store;
    let fresh = store_ops::approved(store.as_ref(), &binding, iters);
    let per = iters / 8;
    let started = Instant::now();
    std::thread::scope(|s| {
        for (t, chunk) in fresh.chunks(per).take(8).enumerate() {
            let store = store.clone();
            let binding = binding.clone();
            s.spawn(move || {
                for (i, id) in chunk.iter().enumerate() {
                    store_ops::consume(store.as_ref(), &binding, id, 10_000_000 + t * per + i);
                }
            });
        }
    });
    println!(
        "postgres: 8 threads consuming receipts at once: {:.0} consumptions/s",
        (per * 8) as f64 / started.elapsed().as_secs_f64()
    );
    // 8 threads appending read calls' events at once: the rate the one serialized chain
    // allows, whatever the number of hosts.
    let started = Instant::now();
    std::thread::scope(|s| {
        for t in 0..8 {
            let store = store.clone();
            s.spawn(move || {
                for i in 0..per {
                    store
                        .append_events(store_ops::call_events(&format!("call_{t}_{i}")))
                        .unwrap();
                }
            });
        }
    });
    println!(
        "postgres: 8 threads appending a read call's 4 events at once: {:.0} calls/s",
        (per * 8) as f64 / started.elapsed().as_secs_f64()
    );
    let v = store.verify_trace().unwrap();
    assert!(v.first_bad.is_none(), "{v:?}");
}

// ---------------------------------------------------------------------------------------
// 2 and 3. Through `airlock serve --http`.

/// A running `airlock serve --http` and a reference minted through it.
struct Front {
    name: &'static str,
    _child: tokio::process::Child,
    addr: String,
    reference: JsonObject,
}

async fn start_front(name: &'static str, config: &Path, state: &Path, cache_dir: &Path) -> Front {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_airlock"));
    let (child, addr) = serve_http(&bin, config, state, cache_dir).await;
    let reference = mint_reference(&addr).await;
    Front {
        name,
        _child: child,
        addr,
        reference,
    }
}

fn notes_config(dir: &Path, name: &str, top: &str) -> PathBuf {
    let manifest = Path::new(airlock::ADAPTER_BUNDLE).join("source-library/mapping.toml");
    let config = dir.join(name);
    std::fs::write(
        &config,
        format!(
            "{top}[[connection]]\nname = \"notes\"\ncommand = \"@airlock\"\nargs = [\"fixture\", \"notes-server\"]\n[[mapping]]\nmanifest = {:?}\n",
            manifest.display().to_string()
        ),
    )
    .unwrap();
    config
}

async fn fronts(iters: usize, rounds: usize, calls: usize) {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_airlock"));
    let dir = tempfile::tempdir().unwrap();
    let cache_dir = dir.path().join("compiled");
    let target = pg::database();
    let sqlite_config = notes_config(dir.path(), "sqlite.toml", "");
    let pg_config = notes_config(
        dir.path(),
        "postgres.toml",
        &format!("store = {target:?}\n"),
    );
    let sqlite_state = state_folder(&dir.path().join("state-sqlite"));
    let a_state = state_folder(&dir.path().join("state-a"));
    let b_state = state_folder(&dir.path().join("state-b"));
    review(&bin, &sqlite_config, &sqlite_state);
    review(&bin, &pg_config, &a_state);
    // Host B shares the database and the trace key, not the state folder.
    std::fs::copy(a_state.join("trace.key"), b_state.join("trace.key")).unwrap();
    std::fs::set_permissions(
        b_state.join("trace.key"),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let sqlite = start_front("sqlite", &sqlite_config, &sqlite_state, &cache_dir).await;
    let a = start_front("postgres host A", &pg_config, &a_state, &cache_dir).await;
    let b = start_front("postgres host B", &pg_config, &b_state, &cache_dir).await;

    println!("\n## 2. tools/call over the HTTP front (keep-alive, {rounds} interleaved rounds)\n");
    let per_round = (iters / rounds).max(1);
    let warmup = (per_round / 10).max(20);
    let search = args(json!({"query": "keepalive", "limit": 1}));
    let paths = [&sqlite, &a];
    let mut samples = vec![[Vec::new(), Vec::new()]; paths.len()];
    for _ in 0..rounds {
        for (p, front) in paths.iter().enumerate() {
            let mut caller = HttpCaller::connect(&front.addr).await;
            for (t, (tool, arguments)) in [
                ("search_sources", &search),
                ("retrieve_source", &front.reference),
            ]
            .into_iter()
            .enumerate()
            {
                for i in 0..warmup + per_round {
                    let start = Instant::now();
                    caller.call(tool, arguments).await;
                    if i >= warmup {
                        samples[p][t].push(start.elapsed());
                    }
                }
            }
        }
    }
    let mut p50 = vec![[Duration::ZERO; 2]; paths.len()];
    for (p, front) in paths.iter().enumerate() {
        for (t, tool) in ["search_sources", "retrieve_source"]
            .into_iter()
            .enumerate()
        {
            let s = stats(samples[p][t].clone());
            row(&format!("{}: tools/call {tool}", front.name), &s);
            p50[p][t] = s.p50;
        }
    }
    for (t, tool) in ["search_sources", "retrieve_source"]
        .into_iter()
        .enumerate()
    {
        println!(
            "postgres − sqlite p50, {tool}: {:+.1} µs",
            us(p50[1][t]) - us(p50[0][t])
        );
    }

    println!("\n## 3. Throughput, 8 concurrent callers, retrieve_source (2 interleaved rounds)\n");
    let layouts: [(&str, Vec<&Front>); 3] = [
        ("sqlite, one host", vec![&sqlite]),
        ("postgres, one host", vec![&a]),
        (
            "postgres, two hosts on one database (4 callers each)",
            vec![&a, &b],
        ),
    ];
    let mut rates = vec![Vec::new(); layouts.len()];
    let mut commits = vec![Vec::new(); layouts.len()];
    for _ in 0..2 {
        for (l, (name, hosts)) in layouts.iter().enumerate() {
            let postgres = name.starts_with("postgres");
            let before = postgres.then(|| committed(&target));
            rates[l].push(throughput(hosts, 8, calls).await);
            if let Some(before) = before {
                commits[l].push((committed(&target) - before) as f64 / calls as f64);
            }
        }
    }
    for (l, (name, _)) in layouts.iter().enumerate() {
        let best = rates[l].iter().cloned().fold(0.0, f64::max);
        let rounds: Vec<String> = rates[l].iter().map(|r| format!("{r:.0}")).collect();
        let per_call: Vec<String> = commits[l].iter().map(|c| format!("{c:.1}")).collect();
        println!(
            "{name:<64} {best:>7.0} calls/s (rounds: {}){}",
            rounds.join(", "),
            if per_call.is_empty() {
                String::new()
            } else {
                format!(
                    "; PostgreSQL transactions per call: {}",
                    per_call.join(", ")
                )
            }
        );
    }
    drop((sqlite, a, b));
    let store = PostgresStore::open(&target, Some(&a_state), None).unwrap();
    let v = store.verify_trace().unwrap();
    assert!(v.first_bad.is_none(), "{v:?}");
    println!(
        "the shared trace verifies: {} events from both hosts in one chain",
        v.events
    );
}

/// Transactions committed in `target`'s database so far (`pg_stat_database.xact_commit`,
/// reads included: every statement outside a transaction block is one), after waiting
/// out the backends' statistics flush (at most 1 s in PostgreSQL 15).
fn committed(target: &str) -> u64 {
    std::thread::sleep(Duration::from_millis(1200));
    pg::query(
        target,
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
    )[0][0]
        .as_deref()
        .unwrap()
        .parse()
        .unwrap()
}

/// `total` calls from `callers` concurrent callers, each on a keep-alive connection of
/// its own to one of `hosts` (round robin), each host's callers reading a reference
/// minted there; calls per second.
async fn throughput(hosts: &[&Front], callers: usize, total: usize) -> f64 {
    let each = total / callers;
    let mut pool = Vec::new();
    for c in 0..callers {
        let front = hosts[c % hosts.len()];
        pool.push((
            HttpCaller::connect(&front.addr).await,
            front.reference.clone(),
        ));
    }
    let start = Instant::now();
    let tasks: Vec<_> = pool
        .into_iter()
        .map(|(mut caller, arguments)| {
            tokio::spawn(async move {
                for _ in 0..each {
                    caller.call("retrieve_source", &arguments).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("a caller failed");
    }
    (each * callers) as f64 / start.elapsed().as_secs_f64()
}
