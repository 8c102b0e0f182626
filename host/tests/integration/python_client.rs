//! The official Python MCP SDK (2.x, `fixtures/python/requirements.txt`) against `airlock
//! serve`, in both protocol generations: a delivery that needs a person's approval is
//! approved through `input_required` (2026-07-28, stateless) and through
//! `elicitation/create` (2025-11-25), and is delivered exactly once each time.

use crate::common::*;
use serde_json::{Value, json};

fn run_python_client(d: &Deployment, mode: &str) -> Value {
    let config = d.write_config();
    let spec = json!({
        "command": airlock_bin(),
        "args": ["serve", "--config", config, "--profile", "publisher"],
        "env": {
            "AIRLOCK_STATE_DIR": d.state_dir(),
            "AIRLOCK_CACHE_DIR": test_cache_dir(),
            "AIRLOCK_LOG": "warn",
        },
    });
    let out = std::process::Command::new("python3")
        .arg(workspace().join("fixtures/python/mrtr_client.py"))
        .arg(spec.to_string())
        .arg(mode)
        .env("PYTHONPATH", python_site())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "the Python client failed ({mode}): {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

#[test]
fn the_python_sdk_approves_in_both_generations_and_delivers_once() {
    for (mode, approval_mode, protocol) in [
        ("2026-07-28", "input-required", "2026-07-28"),
        ("legacy", "elicitation", "2025-11-25"),
    ] {
        let d = approvals_deployment();
        d.approve_all();
        let out = run_python_client(&d, mode);
        assert_eq!(out["protocol"], protocol, "{out}");
        assert_eq!(
            out["tools"],
            json!([
                "deliver_artifact",
                "list_destinations",
                "prepare_artifact",
                "retrieve_source",
                "search_sources"
            ])
        );
        assert_eq!(out["delivered"], true, "{out}");
        let asked = out["asked"].as_array().unwrap();
        assert_eq!(asked.len(), 1, "one question to the person: {out}");
        assert!(
            asked[0].as_str().unwrap().contains("Python report"),
            "{out}"
        );
        assert_eq!(d.sends(), 1, "{mode}");
        assert_eq!(d.delivered("team-reports").len(), 1);
        let approvals = d.airlock_json(&["approvals", "list"]);
        assert_eq!(approvals[0]["mode"], approval_mode);
        assert_eq!(approvals[0]["state"], "consumed");
    }
}
