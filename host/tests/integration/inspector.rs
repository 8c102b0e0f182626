//! A client no one here wrote: the official MCP Inspector CLI drives `airlock serve`.

use crate::common::*;
use serde_json::Value;

/// Runs the Inspector CLI against `airlock serve --config CONFIG` with `extra` arguments.
fn inspector(config: &std::path::Path, extra: &[&str]) -> Value {
    let modules = node_modules();
    let cli = modules.join("@modelcontextprotocol/inspector-cli/build/index.js");
    let airlock = airlock_bin();
    let mut cmd = std::process::Command::new("node");
    // The CLI reads its own package.json relative to the working directory.
    cmd.current_dir(&modules)
        .env("AIRLOCK_CACHE_DIR", test_cache_dir())
        .env_remove("AIRLOCK_STATE_DIR")
        .arg(&cli)
        .arg(&airlock)
        .args(["serve", "--config"])
        .arg(config)
        .args(extra)
        .stdin(std::process::Stdio::null());
    let out = output_within(&mut cmd, std::time::Duration::from_secs(180));
    assert!(
        out.status.success(),
        "inspector failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "inspector printed non-JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

#[test]
fn the_inspector_cli_lists_and_calls_through_airlock() {
    let d = Deployment::with_notes().mapping("source-library");
    d.approve_all();
    let config = d.write_config();
    let listed = inspector(&config, &["--method", "tools/list"]);
    let names: Vec<&str> = listed["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["retrieve_source", "search_sources"]);

    let called = inspector(
        &config,
        &[
            "--method",
            "tools/call",
            "--tool-name",
            "search_sources",
            "--tool-arg",
            "query=checkpoint",
        ],
    );
    assert_ne!(called["isError"], Value::Bool(true), "{called}");
    let reference = called["structuredContent"]["result"][0]["reference"]
        .as_str()
        .unwrap();
    assert!(reference.starts_with("ref_"), "{called}");
    assert_eq!(d.upstream_tool_calls(), ["search_notes"]);
}
