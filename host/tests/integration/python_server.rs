//! A real Python MCP server, confined: `fixtures/python/notes_server.py` (the official
//! Python SDK, 2.x, from `fixtures/python/site`) serves a folder of notes with the tools
//! the `source-library` adapter calls, behind a real `airlock serve` that confines it
//! (the default) to a read-only grant of that folder, with the real interpreter (not a
//! pyenv shim) and `PYTHONPATH` as its whole environment. A search and a retrieval work
//! through the unchanged mapping; files beside the grant, which the same script reads
//! when it runs unconfined, are out of its reach — absent in its own mount namespace,
//! refused by Landlock without namespaces.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common::*;
use serde_json::json;

const CALL_TIMEOUT: Duration = Duration::from_secs(60);

const WAL: &str = "# WAL checkpoints under load\n\nA reader that holds its snapshot for minutes pins every frame written after it began, and PASSIVE checkpoints make no progress: checkpoint starvation.\n";
const KEEPALIVE: &str = "# TCP keepalive for idle upstreams\n\nSet TCP_KEEPIDLE below the NAT gateway's idle timeout.\n";
const SECRET: &str = "beside the notes folder, never granted\n";

/// The interpreter's real path, as `python3` on PATH reports it: a version manager's
/// shim (pyenv's is a shell script that runs pyenv from the home folder) cannot run
/// confined, and the real interpreter's install folder is granted read-only by default.
fn real_python() -> PathBuf {
    let out = std::process::Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
    assert!(path.is_absolute(), "sys.executable: {}", path.display());
    path
}

/// The server's arguments: the notes folder, a `--try-read` of each of `reads`, and the
/// report file they are written to.
fn server_args(notes: &Path, reads: &[&Path], report: &Path) -> Vec<String> {
    let script = workspace().join("fixtures/python/notes_server.py");
    let mut args = vec![script.display().to_string(), notes.display().to_string()];
    for path in reads {
        args.extend(["--try-read".to_string(), path.display().to_string()]);
    }
    args.extend(["--report".to_string(), report.display().to_string()]);
    args
}

/// The report's line for `path` (`PATH OK …` or `PATH BLOCKED …`).
fn outcome<'a>(report: &'a str, path: &Path) -> &'a str {
    let prefix = format!("{} ", path.display());
    report
        .lines()
        .find(|line| line.starts_with(&prefix))
        .unwrap_or_else(|| panic!("no outcome for {} in:\n{report}", path.display()))
}

/// What a test deploys: the notes, a secret beside them and the report folder in the
/// deployment's temporary folder; what the server tries to read.
struct Setup {
    d: Deployment,
    python: PathBuf,
    notes: PathBuf,
    out: PathBuf,
    /// A file beside the notes folder (never granted).
    secret: PathBuf,
    /// A file beside the script's package folder (`fixtures/python`, granted by default).
    beside_package: PathBuf,
    /// A note, inside the grant.
    inside: PathBuf,
    /// The server's environment (a confined server gets none by default).
    env: Vec<(&'static str, String)>,
}

impl Setup {
    fn new() -> Self {
        let d = Deployment::with_notes();
        let notes = d.dir.path().join("notes");
        std::fs::create_dir_all(&notes).unwrap();
        std::fs::write(notes.join("wal-checkpoints.md"), WAL).unwrap();
        std::fs::write(notes.join("tcp-keepalive.md"), KEEPALIVE).unwrap();
        let secret = d.dir.path().join("secret.txt");
        std::fs::write(&secret, SECRET).unwrap();
        let out = d.dir.path().join("out");
        std::fs::create_dir_all(&out).unwrap();
        let env = vec![
            ("PYTHONPATH", python_site().display().to_string()),
            // The script's folder is read-only to it: no `__pycache__` to write there.
            ("PYTHONDONTWRITEBYTECODE", "1".to_string()),
        ];
        Self {
            python: real_python(),
            inside: notes.join("wal-checkpoints.md"),
            beside_package: workspace().join("fixtures/outside-secret.txt"),
            d,
            notes,
            out,
            secret,
            env,
        }
    }

    fn reads(&self) -> [&Path; 3] {
        [&self.secret, &self.beside_package, &self.inside]
    }

    /// The control: unconfined (its stdin at its end, so it stops at once), the same
    /// script reads every one of [`Setup::reads`], so a BLOCKED confined is the
    /// confinement's.
    fn assert_unconfined_reads_everything(&self) {
        let report = self.out.join("unconfined.txt");
        let run = output_within(
            std::process::Command::new(&self.python)
                .args(server_args(&self.notes, &self.reads(), &report))
                .env_clear()
                .envs(self.env.iter().map(|(k, v)| (k, v)))
                .current_dir(self.d.dir.path()),
            Duration::from_secs(60),
        );
        let report = std::fs::read_to_string(&report).unwrap_or_else(|e| {
            panic!(
                "no report from the unconfined run ({e}): {}",
                String::from_utf8_lossy(&run.stderr)
            )
        });
        for path in self.reads() {
            assert!(outcome(&report, path).contains(" OK "), "{report}");
        }
    }

    /// Serves `source-library` over the server, confined (with `extra` confinement keys)
    /// to a read-only grant of the notes and a read-write one of the report folder; runs
    /// a search and retrieves its hit; returns the confined server's report.
    async fn serve_confined(self, extra: &str) -> (Self, String) {
        let report = self.out.join("report.txt");
        let env: Vec<String> = self
            .env
            .iter()
            .map(|(k, v)| format!("{k} = {v:?}"))
            .collect();
        let connection = format!(
            "[[connection]]\nname = \"notes\"\ncommand = {:?}\nargs = {:?}\nenv = {{ {} }}\n{extra}{}",
            self.python.display().to_string(),
            server_args(&self.notes, &self.reads(), &report),
            env.join(", "),
            confined(&[(&self.notes, "read-only"), (&self.out, "read-write")]),
        );
        let Self { d, .. } = self;
        let d = d.replace_connections(&connection).mapping("source-library");
        let client = d.serve().await;
        let hits = tokio::time::timeout(
            CALL_TIMEOUT,
            call(&client, "search_sources", json!({"query": "checkpoint"})),
        )
        .await
        .expect("the host answers")
        .expect("no protocol error");
        assert_ne!(hits.is_error, Some(true), "{}", text_of(&hits));
        let found = &hits.structured_content.as_ref().unwrap()["result"];
        assert_eq!(found.as_array().unwrap().len(), 1, "{found}");
        assert_eq!(found[0]["title"], "WAL checkpoints under load", "{found}");
        assert!(
            found[0]["snippet"]
                .as_str()
                .unwrap()
                .contains("PASSIVE checkpoints make no progress"),
            "{found}"
        );
        let reference = references(&hits).remove(0);
        let passage = tokio::time::timeout(
            CALL_TIMEOUT,
            call(&client, "retrieve_source", json!({"reference": reference})),
        )
        .await
        .expect("the host answers")
        .expect("no protocol error");
        assert_ne!(passage.is_error, Some(true), "{}", text_of(&passage));
        let s = passage.structured_content.as_ref().unwrap();
        assert_eq!(s["result"]["text"], WAL, "{s}");
        assert_eq!(s["result"]["media-type"], "text/markdown", "{s}");
        assert_eq!(s["provenance"][0]["connection"], "notes", "{s}");
        assert_eq!(s["provenance"][0]["target"], "read_note", "{s}");
        client.cancel().await.unwrap();
        let report = std::fs::read_to_string(&report)
            .expect("the confined server wrote its report into its read-write grant");
        eprintln!("{report}");
        (Self { d, ..self }, report)
    }

    /// Confined, the server read its grant and nothing beside it: each read outside
    /// failed with `error`.
    fn assert_confined(&self, report: &str, error: &str) {
        assert!(outcome(report, &self.inside).contains(" OK "), "{report}");
        for path in [&self.secret, &self.beside_package] {
            let line = outcome(report, path);
            assert!(
                line.contains(" BLOCKED ") && line.contains(error),
                "{report}"
            );
        }
    }
}

fn assert_machine_can_confine(namespaces: bool) {
    let support = airlock::upstream::confine::support();
    assert!(
        support.landlock_abi >= 6,
        "this machine offers Landlock ABI {} (6 is needed): confinement cannot be tested here",
        support.landlock_abi
    );
    assert!(
        !namespaces || support.namespaces,
        "this machine does not allow user namespaces: confinement with namespaces cannot be tested here"
    );
}

#[tokio::test]
async fn a_confined_python_sdk_server_serves_its_notes_and_reads_nothing_else() {
    assert_machine_can_confine(true);
    let setup = Setup::new();
    setup.assert_unconfined_reads_everything();
    let (setup, report) = setup.serve_confined("").await;
    // In its own mount namespace, what is not granted is absent, not merely refused.
    setup.assert_confined(&report, "No such file or directory");
}

#[tokio::test]
async fn without_namespaces_landlock_alone_keeps_the_python_server_in_its_grants() {
    assert_machine_can_confine(false);
    let setup = Setup::new();
    let (setup, report) = setup.serve_confined("namespaces = false\n").await;
    // The host's filesystem is visible; Landlock refuses what is not granted.
    setup.assert_confined(&report, "Permission denied");
}
