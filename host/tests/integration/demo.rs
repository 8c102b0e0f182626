//! README's main job, `airlock demo`, runs every step to the end: a change that breaks what
//! the demo shows (a refusal, a reconciliation, the trace) fails here, not first on a
//! newcomer's machine.

use crate::common::*;

#[test]
fn the_demo_runs_every_step_to_the_end() {
    let state = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(airlock_bin())
        .arg("demo")
        .arg("--state-dir")
        .arg(state.path())
        .env("AIRLOCK_CACHE_DIR", test_cache_dir())
        .output()
        .expect("airlock demo runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "airlock demo failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Refusals happen before anything reaches the upstream server, each as the model reads it.
    assert!(
        stdout.contains("refused (tool result, isError)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("unknown tool `export_workspace`"),
        "{stdout}"
    );
    assert!(stdout.contains("chain intact"), "{stdout}");
    assert!(stdout.contains("   done. "), "{stdout}");
}
