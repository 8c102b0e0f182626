//! What the operator console costs (`cargo bench -p airlock --bench console`; issue 31):
//! the real `airlock console` over a state folder holding `AIRLOCK_BENCH_APPROVALS`
//! (default 10 000) pending approvals, each with its MACed `approval-requested` event, and
//! a trace of `AIRLOCK_BENCH_EVENTS` (default 1 000 000) events — read calls of four events
//! each, as the pipeline writes them.
//!
//! Each page is fetched `AIRLOCK_BENCH_ITERS` times (default 20) over a fresh loopback
//! connection with the session cookie: time to the first byte of the answer and to its
//! last (the body is read whole), p50 and p90, and the body's size. Pages: the inbox's
//! first and last page (200 approvals each, every row checked against the trace), the
//! trace's first page (50 calls), a trace filter that matches nothing (the page's bounded
//! search: 200 000 events), one call's life, connections, and the audit package of the
//! whole trace (a full scan of the range, the one page that reads every event).
//!
//! `AIRLOCK_BENCH_KEEP=1` leaves the state folder behind (its path is printed).
//!
//! Whether a console polling the store slows `tools/call` is the floor bench's
//! `AIRLOCK_BENCH_CONSOLE=1`.

use std::io::{Read as _, Write as _};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use airlock::store::{
    ApprovalMode, Approvals as _, NewApproval, NewEvent, SqliteStore, Trace as _,
};
use serde_json::json;

mod common;
use common::{env_count, load_average, store_ops};

fn airlock_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_airlock"))
}

/// Fills `store` with `approvals` pending approvals and `events` trace events.
fn fill(store: &SqliteStore, approvals: usize, events: usize) {
    let started = Instant::now();
    let mut batch = Vec::with_capacity(10_000);
    let calls = events / 4;
    for i in 0..calls {
        batch.extend(store_ops::call_events(&format!("call_{i:024x}")));
        if batch.len() >= 10_000 {
            store.append_events(std::mem::take(&mut batch)).unwrap();
        }
        if i % 50_000 == 0 && i > 0 {
            eprintln!(
                "  {} events written ({:.0} s)",
                i * 4,
                started.elapsed().as_secs_f64()
            );
        }
    }
    store.append_events(batch).unwrap();
    for i in 0..approvals {
        let mut binding = store_ops::binding();
        binding.args_digest = format!("{i:064x}");
        let new = NewApproval {
            binding: binding.clone(),
            profile: "publisher".into(),
            mode: ApprovalMode::OutOfBand,
            summary: format!(
                "Deliver artifact file-{i:04} (12 KiB, sha256 {}) to outbox team-reports. Cannot be recalled once sent.",
                "d".repeat(64)
            ),
            ttl_ms: 24 * 3600 * 1000,
        };
        let event = NewEvent::new(
            "approval-requested",
            format!("call_a{i:023x}"),
            json!({
                "mode": "out-of-band",
                "capability": "deliver_artifact",
                "args_digest": binding.args_digest,
                "summary_sha256": "e".repeat(64),
                "ttl_s": 86_400,
                "binding": binding,
                "ttl_ms": new.ttl_ms,
            }),
        );
        store.create_approval(&new, vec![event]).unwrap();
    }
    eprintln!(
        "  filled: {} events, {approvals} pending approvals in {:.0} s",
        store.trace_checkpoint().unwrap().seq,
        started.elapsed().as_secs_f64()
    );
}

/// One GET of `path` with `cookie`: (time to the first byte, time to the last, bytes,
/// status).
fn fetch(addr: &str, path: &str, cookie: &str) -> (Duration, Duration, usize, u16) {
    let started = Instant::now();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(
        format!(
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nCookie: {cookie}\r\nConnection: close\r\n\r\n"
        )
        .as_bytes(),
    )
    .unwrap();
    let mut first = [0u8; 1];
    s.read_exact(&mut first).unwrap();
    let ttfb = started.elapsed();
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    let total = started.elapsed();
    let text = String::from_utf8_lossy(&rest);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text.find("\r\n\r\n").map_or(0, |at| rest.len() - at - 4);
    (ttfb, total, body, status)
}

fn pct(samples: &mut [Duration], p: usize) -> Duration {
    samples.sort();
    samples[(samples.len() * p / 100).min(samples.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() {
    let approvals = env_count("AIRLOCK_BENCH_APPROVALS", 10_000);
    let events = env_count("AIRLOCK_BENCH_EVENTS", 1_000_000);
    let iters = env_count("AIRLOCK_BENCH_ITERS", 20);
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    eprintln!("console bench: filling the store ({events} events, {approvals} approvals)");
    {
        let store = SqliteStore::open(&state).unwrap();
        fill(&store, approvals, events);
    }
    let console = common::console::Console::start(&airlock_bin(), &state);
    let (addr, cookie) = (console.addr.as_str(), console.cookie.as_str());

    // The inbox's last page, and one call to show.
    let store = SqliteStore::open(&state).unwrap();
    let oldest = store
        .approvals_after(
            Some(airlock::store::ApprovalState::Pending),
            None,
            approvals,
        )
        .unwrap();
    let last_page_after = oldest
        .get(oldest.len().saturating_sub(201))
        .map(|r| format!("{}.{}", r.created_ms, r.id))
        .unwrap_or_default();
    let head = store.trace_checkpoint().unwrap().seq;
    drop(store);
    let call = format!("call_{:024x}", events / 8);
    let pages: Vec<(&str, String)> = vec![
        ("inbox, first page", "/console/approvals".into()),
        (
            "inbox, last page",
            format!("/console/approvals?after={last_page_after}"),
        ),
        ("trace, first page", "/console/trace".into()),
        (
            "trace, filter matching nothing",
            "/console/trace?requester=nobody".into(),
        ),
        (
            "one call's life",
            format!(
                "/console/trace/calls/{call}?from={}&to={}",
                events / 2 - 10,
                events / 2 + 10
            ),
        ),
        ("connections", "/console/connections".into()),
        (
            "audit package, whole trace",
            format!("/console/trace/audit.json?from=1&to={head}"),
        ),
    ];
    println!(
        "console bench: {approvals} pending approvals, {head} trace events, {iters} fetches per page; load {}",
        load_average()
    );
    println!(
        "{:<32} {:>10} {:>12} {:>12} {:>12} {:>12}",
        "page", "bytes", "TTFB p50 ms", "TTFB p90 ms", "full p50 ms", "full p90 ms"
    );
    for (name, path) in &pages {
        let iters = if name.starts_with("audit") {
            iters.min(5)
        } else {
            iters
        };
        let mut first = Vec::new();
        let mut full = Vec::new();
        let mut bytes = 0;
        for _ in 0..iters {
            let (f, t, b, status) = fetch(addr, path, cookie);
            assert_eq!(status, 200, "{path}");
            first.push(f);
            full.push(t);
            bytes = b;
        }
        println!(
            "{:<32} {:>10} {:>12.1} {:>12.1} {:>12.1} {:>12.1}",
            name,
            bytes,
            ms(pct(&mut first, 50)),
            ms(pct(&mut first, 90)),
            ms(pct(&mut full, 50)),
            ms(pct(&mut full, 90)),
        );
    }
    drop(console);
    // AIRLOCK_BENCH_KEEP=1: leave the state folder for a profile of the console over it.
    if std::env::var_os("AIRLOCK_BENCH_KEEP").is_some() {
        println!("state folder kept: {}", dir.keep().join("state").display());
    }
}
