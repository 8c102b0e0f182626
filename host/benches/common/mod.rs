//! Shared by the bench binaries: sample statistics.
#![allow(dead_code)]

use std::time::Duration;

pub mod console;
pub mod serve;
pub mod store_ops;

/// Order statistics of one sample set.
pub struct Stats {
    pub p50: Duration,
    pub p99: Duration,
    pub mean: Duration,
    pub min: Duration,
    pub max: Duration,
    pub n: usize,
}

/// The statistics of `samples` (at least one).
pub fn stats(mut samples: Vec<Duration>) -> Stats {
    samples.sort();
    let n = samples.len();
    Stats {
        p50: samples[n / 2],
        p99: samples[(n * 99 / 100).min(n - 1)],
        mean: samples.iter().sum::<Duration>() / n as u32,
        min: samples[0],
        max: samples[n - 1],
        n,
    }
}

/// Microseconds.
pub fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The positive count in environment variable `name`, else `default`.
pub fn env_count(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(default)
}

/// The 1, 5 and 15 minute load averages (`/proc/loadavg`), or `?`.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}
