//! The official MCP conformance suite (`@modelcontextprotocol/conformance`, pinned in
//! fixtures/npm) against `airlock serve --http`, for both protocol generations: 0.1.16 for
//! 2025-11-25 (sessions) and 0.2.0-alpha.12 for 2026-07-28 (stateless), every scenario
//! (`--suite all`, pending ones included). Each run is checked
//! against a baseline in fixtures/conformance/: a scenario failing that the baseline does
//! not list fails the test, and so does a listed scenario that now passes (a stale entry).
//! Every baseline entry says why it fails.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::common::*;

/// Node 22 and the suite, installed by README's test command (`npm ci --prefix fixtures/npm`).
fn suite(package: &str) -> (PathBuf, PathBuf) {
    let modules = node_modules();
    let node = modules.join("node/bin/node");
    let entry = modules.join(package).join("dist/index.js");
    assert!(
        node.is_file() && entry.is_file(),
        "the conformance suite or Node 22 is not installed ({} / {}): run `npm ci --prefix fixtures/npm` (README's test command does)",
        node.display(),
        entry.display()
    );
    (node, entry)
}

/// Starts `airlock serve --http` on a free loopback port; returns the child and the MCP URL.
async fn serve_http(d: &Deployment) -> (tokio::process::Child, String) {
    d.approve_all();
    let port = free_port();
    let mut cmd = d.serve_command();
    cmd.arg("--http")
        .arg(format!("127.0.0.1:{port}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    let child = cmd.spawn().expect("start airlock serve --http");
    let started = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "airlock serve --http did not listen on {port} within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (child, format!("http://127.0.0.1:{port}/mcp"))
}

/// Runs the server suite of `package` for `version` against `url` with `baseline`; returns
/// (exit success, the run's printed output).
fn run_suite(
    package: &str,
    version: &str,
    url: &str,
    baseline: &Path,
    out: &Path,
) -> (bool, String) {
    let (node, entry) = suite(package);
    let output = std::process::Command::new(node)
        .arg(entry)
        .args([
            "server",
            "--suite",
            "all",
            "--url",
            url,
            "--spec-version",
            version,
        ])
        .arg("--expected-failures")
        .arg(baseline)
        .arg("-o")
        .arg(out)
        .env("NO_COLOR", "1")
        .output()
        .expect("run the conformance suite");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

async fn conformance(package: &str, version: &str) {
    let d = Deployment::with_notes().mapping("source-library");
    let (mut child, url) = serve_http(&d).await;
    let baseline = workspace().join(format!(
        "fixtures/conformance/expected-failures-{version}.yml"
    ));
    let out = d.dir.path().join("conformance");
    let (ok, text) = tokio::task::spawn_blocking({
        let (package, version, url, baseline, out) = (
            package.to_string(),
            version.to_string(),
            url.clone(),
            baseline.clone(),
            out.clone(),
        );
        move || run_suite(&package, &version, &url, &baseline, &out)
    })
    .await
    .unwrap();
    let summary: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with('✓') || l.starts_with('✗') || l.starts_with("Total:"))
        .collect();
    eprintln!("conformance {package} {version}:\n{}", summary.join("\n"));
    let _ = child.kill().await;
    assert!(
        ok,
        "conformance {version} against airlock serve --http failed the baseline:\n{text}"
    );
}

#[tokio::test]
async fn server_suite_2025_11_25_meets_its_baseline() {
    conformance("@modelcontextprotocol/conformance", "2025-11-25").await;
}

#[tokio::test]
async fn server_suite_2026_07_28_meets_its_baseline() {
    conformance("conformance-next", "2026-07-28").await;
}
