//! Shared by the bench binaries: sample statistics.
#![allow(dead_code)]

use std::time::Duration;

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
