//! What an operator does out of band while a host serves effects: approving a call a
//! person must approve (`airlock approvals approve`), finding a completed intent, and
//! compensating one (`airlock intents compensate`); shared by the tests of the operator
//! contracts (`workspace_edits`, `knowledge_edits`).

use rmcp::model::CallToolResult;
use rmcp::service::{RoleClient, RunningService};

use airlock::pipeline::Category;

use super::{Deployment, airlock_bin, assert_refused, call, test_cache_dir, text_of};

/// The approval id (`apr_` and 24 more characters) in a refusal's or a prompt's text.
pub fn approval_in(text: &str) -> String {
    let at = text
        .find("apr_")
        .unwrap_or_else(|| panic!("no approval id in {text}"));
    text[at..at + 28].to_string()
}

/// Calls `tool`, which needs a person's approval: asserts the refusal, approves it out of
/// band as `bob`, calls again and returns that answer (asserted not to be an error).
pub async fn approved_call(
    d: &Deployment,
    client: &RunningService<RoleClient, ()>,
    tool: &str,
    args: serde_json::Value,
) -> CallToolResult {
    let r = call(client, tool, args.clone()).await.unwrap();
    let text = assert_refused(&r, Category::ApprovalRequired);
    let id = approval_in(&text);
    d.airlock_ok(&["approvals", "approve", &id, "--by", "bob", "--yes"]);
    let done = call(client, tool, args).await.unwrap();
    assert_ne!(done.is_error, Some(true), "{}", text_of(&done));
    done
}

/// `airlock intents compensate INTENT --config CONFIG --json`, answering the approval it
/// asks for with `approvals DECISION` (`approve` or `deny`) as `carol` from another
/// process, as a person at another terminal would. Returns (success, stdout, stderr).
pub fn compensate(
    d: &Deployment,
    config: &str,
    intent: &str,
    decision: &str,
) -> (bool, String, String) {
    use std::io::BufRead as _;
    let mut child = std::process::Command::new(airlock_bin())
        .env("AIRLOCK_CACHE_DIR", test_cache_dir())
        .env("AIRLOCK_STATE_DIR", d.state_dir())
        .args([
            "intents",
            "compensate",
            intent,
            "--config",
            config,
            "--json",
            "--wait",
            "120",
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut seen = String::new();
    for line in std::io::BufReader::new(child.stderr.take().unwrap()).lines() {
        let line = line.unwrap();
        seen.push_str(&line);
        seen.push('\n');
        if let Some(at) = line.find("airlock approvals approve apr_") {
            let id = approval_in(&line[at..]);
            let mut args = vec!["approvals", decision, &id, "--by", "carol"];
            if decision == "approve" {
                args.push("--yes");
            }
            d.airlock_ok(&args);
        }
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        seen,
    )
}

/// The completed intent of `capability` (the newest).
pub fn completed(d: &Deployment, capability: &str) -> serde_json::Value {
    let list = d.airlock_json(&["intents", "list", "--state", "completed"]);
    list.as_array()
        .unwrap()
        .iter()
        .find(|i| i["capability"] == capability)
        .unwrap_or_else(|| panic!("no completed {capability} in {list}"))
        .clone()
}

/// `node` on this machine's PATH, by its full path (a connection gets no environment, so
/// a command it runs is named in full).
pub fn node() -> String {
    std::env::split_paths(&std::env::var_os("PATH").unwrap())
        .map(|d| d.join("node"))
        .find(|p| p.is_file())
        .expect("node on PATH")
        .display()
        .to_string()
}

/// As a reviewer would for an operator contract: discovers `connection` with the
/// configuration at `config`, approves contract package `package` (as `alice`), then
/// approves every mapping.
pub fn approve_operator(d: &Deployment, connection: &str, config: &str, package: &str) {
    d.airlock_ok(&["discover", connection, "--config", config]);
    let approved = d.airlock_json(&[
        "contracts",
        "approve",
        package,
        "--config",
        config,
        "--reviewer",
        "alice",
    ]);
    assert_eq!(approved["state"], "approved", "{approved}");
    d.approve_all();
}

/// Approves, out of band as `bob`, the approval request `text` (a refusal's words) names.
pub fn approve_as_bob(d: &Deployment, text: &str) {
    d.airlock_ok(&[
        "approvals",
        "approve",
        &approval_in(text),
        "--by",
        "bob",
        "--yes",
    ]);
}

/// The `args` of a connection that runs `server` (a command and its arguments) through
/// `airlock fixture lose-answer`: the first `tool` call whose arguments (as JSON text)
/// contain `contain` reaches the server, then the connection dies with it unanswered,
/// once; `lost` exists once it did.
pub fn lose_answer_args(
    tool: &str,
    contain: &str,
    lost: &std::path::Path,
    server: &[&str],
) -> Vec<String> {
    let lost = lost.to_str().unwrap();
    [
        "fixture",
        "lose-answer",
        "--tool",
        tool,
        "--arguments-contain",
        contain,
        "--once",
        lost,
        "--",
    ]
    .iter()
    .chain(server)
    .map(|s| (*s).to_string())
    .collect()
}
