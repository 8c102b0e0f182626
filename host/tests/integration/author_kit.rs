//! Adapter authors' kit: the SDK used from a crate outside this workspace (the SDK
//! README's complete example, built as an outside author would build it).

use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::Digest as _;

use serde_json::json;

use crate::common::{Deployment, airlock_bin, call, text_of, workspace};

/// The outside example's files (`sdk/examples/outside/`), each shown verbatim in the SDK
/// README in a fence of this language.
const EXAMPLE_FILES: &[(&str, &str)] = &[
    ("Cargo.toml", "toml"),
    ("rust-toolchain.toml", "toml"),
    ("src/lib.rs", "rust,ignore"),
    ("mapping.toml", "toml"),
];

/// The example's SDK path (in `[dependencies]` and `[dev-dependencies]`), which the test
/// points at this checkout's `sdk/`.
const SDK_PATH: &str = r#"path = "../airlock/sdk""#;

/// The first 8 bytes of a component binary: `\0asm`, version 0x0d, layer 1.
const COMPONENT_PREAMBLE: [u8; 8] = [0x00, 0x61, 0x73, 0x6d, 0x0d, 0x00, 0x01, 0x00];

fn example_dir() -> PathBuf {
    workspace().join("sdk/examples/outside")
}

/// A target folder for builds of crates outside the workspace, kept between runs (under
/// this test binary's own target dir) so that the second run is warm.
fn outside_target_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("author-kit")
        .join(name)
}

/// Copies the outside example into `dest` (a folder outside the workspace), its SDK
/// dependency pointing at this checkout's `sdk/`, and the workspace's `Cargo.lock` beside
/// it so the build resolves the versions already fetched (no network).
pub fn write_outside_example(dest: &Path) {
    for (file, _) in EXAMPLE_FILES {
        let text = std::fs::read_to_string(example_dir().join(file)).unwrap();
        let text = if *file == "Cargo.toml" {
            assert_eq!(
                text.matches(SDK_PATH).count(),
                2,
                "the example's Cargo.toml must depend on the SDK with `{SDK_PATH}` (and again with the `testing` feature)"
            );
            let sdk = workspace().join("sdk");
            text.replace(SDK_PATH, &format!("path = {:?}", sdk.display().to_string()))
        } else {
            text
        };
        let path = dest.join(file);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
    std::fs::copy(workspace().join("Cargo.lock"), dest.join("Cargo.lock")).unwrap();
}

/// `program` in `dir`, as an author outside the workspace runs it: the outer test run's
/// cargo variables removed, `CARGO_TARGET_DIR` set to [`outside_target_dir`] (`CARGO`,
/// the cargo running this test, and `RUSTUP_TOOLCHAIN` are kept).
pub fn outside(program: impl AsRef<std::ffi::OsStr>, dir: &Path, target: &str) -> Command {
    let mut cmd = Command::new(program);
    for (key, _) in std::env::vars_os() {
        let Some(key) = key.to_str() else { continue };
        if (key.starts_with("CARGO_") && key != "CARGO_HOME")
            || key == "RUSTC_WRAPPER"
            || key.starts_with("AIRLOCK_")
        {
            cmd.env_remove(key);
        }
    }
    cmd.current_dir(dir)
        .env("CARGO_TARGET_DIR", outside_target_dir(target))
        .stdin(std::process::Stdio::null());
    cmd
}

/// `cargo` in `dir`, as an author outside the workspace runs it ([`outside`]).
pub fn outside_cargo(dir: &Path, target: &str) -> Command {
    outside(
        std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()),
        dir,
        target,
    )
}

/// Runs `cmd`, asserting success with its output in the message.
pub fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_sdk_readme_shows_the_outside_example_verbatim() {
    let readme = std::fs::read_to_string(workspace().join("sdk/README.md")).unwrap();
    for (file, lang) in EXAMPLE_FILES {
        let text = std::fs::read_to_string(example_dir().join(file)).unwrap();
        let block = format!("```{lang}\n{}\n```", text.trim_end());
        assert!(
            readme.contains(&block),
            "sdk/README.md does not show sdk/examples/outside/{file} verbatim (in a ```{lang} fence); copy the file into the README"
        );
    }
    // The SDK is its own crate's docs (rustdoc shows the same text).
    let lib = std::fs::read_to_string(workspace().join("sdk/src/lib.rs")).unwrap();
    assert!(lib.contains(r#"#![doc = include_str!("../README.md")]"#));
}

#[test]
fn the_sdk_manifest_inherits_nothing_from_the_workspace() {
    let text = std::fs::read_to_string(workspace().join("sdk/Cargo.toml")).unwrap();
    let manifest: toml::Table = toml::from_str(&text).unwrap();
    let package = manifest["package"].as_table().unwrap();
    for key in ["version", "edition", "rust-version", "license"] {
        assert!(
            package.get(key).is_some_and(toml::Value::is_str),
            "sdk/Cargo.toml: package.{key} must be written out (an outside crate cannot inherit it)"
        );
    }
    assert!(
        !text.contains("workspace = true") && !text.contains(".workspace"),
        "sdk/Cargo.toml inherits from the workspace:\n{text}"
    );
}

#[test]
fn outside_example_builds_for_wasm32_wasip2_and_its_kit_tests_pass() {
    let temp = tempfile::tempdir().unwrap();
    assert!(
        !temp.path().starts_with(workspace()),
        "the temporary folder must lie outside the workspace"
    );
    let dir = temp.path().join("my-notes");
    write_outside_example(&dir);
    run_ok(outside_cargo(&dir, "outside-example").args(["build", "--target", "wasm32-wasip2"]));

    let built = outside_target_dir("outside-example").join("wasm32-wasip2/debug/my_notes.wasm");
    let wasm = std::fs::read(&built).unwrap();
    assert!(
        wasm.starts_with(&COMPONENT_PREAMBLE),
        "{} is not a component",
        built.display()
    );

    // The host accepts it as an adapter of the contract: place it, pin it, review it.
    std::fs::write(dir.join("my_notes.wasm"), &wasm).unwrap();
    let manifest = dir.join("mapping.toml");
    let text = std::fs::read_to_string(&manifest).unwrap();
    let sha256 = hex::encode(sha2::Sha256::digest(&wasm));
    let pinned = text.replace(
        "file = \"my_notes.wasm\"\n",
        &format!("file = \"my_notes.wasm\"\nsha256 = \"{sha256}\"\n"),
    );
    assert_ne!(pinned, text, "the example's mapping names my_notes.wasm");
    std::fs::write(&manifest, pinned).unwrap();
    let out = Command::new(crate::common::airlock_bin())
        .args(["grants", "--json"])
        .arg(&manifest)
        .env_remove("AIRLOCK_STATE_DIR")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "airlock grants on the outside example: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    let review: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(review["flagged"], 0, "{review:#}");
    for cap in review["capabilities"].as_array().unwrap() {
        assert_eq!(cap["exported"], true, "{cap}");
    }

    // Its test-kit test passes in a plain native `cargo test`.
    let out = outside_cargo(&dir, "outside-example")
        .arg("test")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "cargo test of the outside example:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(
            "test tests::search_maps_hits_and_retrieve_maps_a_tool_error_to_not_found ... ok"
        ) && stdout.contains("1 passed"),
        "{stdout}"
    );
}

#[test]
fn snapshots_show_tool_prints_one_tools_input_and_output_schema() {
    let d = Deployment::with_notes().mapping("source-library");
    let config = d.write_config();
    let found = d.airlock_json(&["discover", "notes", "--config", config.to_str().unwrap()]);
    let digest = found["snapshot"].as_str().unwrap();
    let short = &digest[..12];

    let text = d.airlock_ok(&["snapshots", "show", short, "--tool", "search_notes"]);
    assert!(
        text.starts_with(&format!("tool search_notes in snapshot {digest}\n")),
        "{text}"
    );
    let line = |pointer: &str| {
        text.lines()
            .find(|l| l.trim_start().starts_with(&format!("{pointer} ")))
            .unwrap_or_else(|| panic!("no outline line for {pointer} in:\n{text}"))
            .to_string()
    };
    let query = line("/query");
    assert!(
        query.contains("string") && query.contains("required"),
        "{query}"
    );
    assert!(query.contains("\"Words to look for"), "{query}");
    let limit = line("/limit");
    assert!(
        limit.contains("integer") && limit.contains("optional"),
        "{limit}"
    );
    assert!(
        limit.contains("minimum=1") && limit.contains("maximum=20"),
        "{limit}"
    );
    // The output schema: what the adapter gets back, down to each hit's fields.
    let output = text
        .split("output schema (")
        .nth(1)
        .expect("an output schema section");
    assert!(output.contains("/hits/[]/id"), "{output}");
    assert!(line("/hits/[]/snippet").contains("maxLength="), "{text}");
    assert!(!text.contains("Read note"), "only the asked tool: {text}");

    let raw = d.airlock_json(&["snapshots", "show", short, "--tool", "search_notes"]);
    assert_eq!(raw["name"], "search_notes");
    assert_eq!(raw["inputSchema"]["required"], serde_json::json!(["query"]));

    let out = d.airlock(&["snapshots", "show", short, "--tool", "search_note"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("has no tool `search_note`; its tools: search_notes, read_note"),
        "{err}"
    );
}

/// Runs the airlock binary as an author would (see [`outside`]), in `dir`.
fn author_airlock(dir: &Path, args: &[&str]) -> std::process::Output {
    outside(airlock_bin(), dir, "new-pack")
        .args(args)
        .output()
        .unwrap()
}

#[tokio::test]
async fn new_then_pack_then_review_approve_then_serve_answers_a_search() {
    let temp = tempfile::tempdir().unwrap();
    assert!(!temp.path().starts_with(workspace()));
    let dir = temp.path().join("my-notes");
    let dir_arg = dir.to_str().unwrap();

    // `airlock new`: a ready crate, the SDK by path (this checkout's).
    let out = author_airlock(
        temp.path(),
        &[
            "new",
            "source-retrieval",
            "my-notes",
            "--connection",
            "notes",
            "--dir",
            dir_arg,
            "--json",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        report["contract"],
        "airlock:contracts/source-retrieval@0.1.0"
    );
    let sdk = std::fs::canonicalize(workspace().join("sdk")).unwrap();
    assert_eq!(report["sdk"], sdk.display().to_string());
    for file in [
        "Cargo.toml",
        "rust-toolchain.toml",
        "src/lib.rs",
        "mapping.toml",
        "airlock.toml",
    ] {
        assert!(dir.join(file).is_file(), "{file}");
    }
    // A second `new` into the same folder refuses to overwrite it.
    let again = author_airlock(
        temp.path(),
        &["new", "source-retrieval", "my-notes", "--dir", dir_arg],
    );
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("exists and is not empty"));

    // `airlock pack` of the crate as generated: it builds to a component the host would
    // load (every contract function exported, every import justified). The workspace's
    // Cargo.lock pins the versions already fetched (no network).
    std::fs::copy(workspace().join("Cargo.lock"), dir.join("Cargo.lock")).unwrap();
    let manifest = dir.join("mapping.toml");
    let manifest_arg = manifest.to_str().unwrap();
    let out = author_airlock(&dir, &["pack", manifest_arg, "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let packed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let wasm = std::fs::read(dir.join("my_notes.wasm")).unwrap();
    assert_eq!(packed["sha256"], hex::encode(sha2::Sha256::digest(&wasm)));
    let pinned = std::fs::read_to_string(&manifest).unwrap();
    assert!(pinned.contains(&format!(
        "sha256 = \"{}\"",
        packed["sha256"].as_str().unwrap()
    )));
    let out = author_airlock(&dir, &["grants", manifest_arg, "--json"]);
    assert!(
        out.status.success(),
        "grants on the generated crate: {}",
        String::from_utf8_lossy(&out.stdout)
    );

    // The author writes the adapter (the SDK README's example) and lists its tools.
    std::fs::copy(example_dir().join("src/lib.rs"), dir.join("src/lib.rs")).unwrap();
    std::fs::write(
        &manifest,
        pinned.replace("tools = []", r#"tools = ["search_notes", "read_note"]"#),
    )
    .unwrap();
    // From the crate's parent folder, with a relative path (cargo runs in the crate).
    let out = author_airlock(temp.path(), &["pack", "my-notes/mapping.toml"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("airlock review approve my-notes --config "),
        "pack names the next command: {text}"
    );
    let repinned = std::fs::read_to_string(&manifest).unwrap();
    assert_eq!(repinned.matches("sha256 = ").count(), 1, "{repinned}");
    assert_ne!(repinned, pinned, "a new component, a new pin");

    // `review approve`, then `serve` answers a search through the new adapter.
    let d = Deployment::with_notes().manifest(manifest.clone());
    let client = d.serve().await;
    let tools = client.peer().list_all_tools().await.unwrap();
    let mut names: Vec<_> = tools.iter().map(|t| t.name.to_string()).collect();
    names.sort();
    assert_eq!(names, ["my_notes_retrieve", "my_notes_search"]);
    let hits = call(&client, "my_notes_search", json!({"query": "checkpoint"}))
        .await
        .unwrap();
    assert_ne!(hits.is_error, Some(true), "{}", text_of(&hits));
    let found = hits.structured_content.as_ref().unwrap()["result"]
        .as_array()
        .unwrap()
        .clone();
    assert!(!found.is_empty(), "{}", text_of(&hits));
    assert!(
        found.iter().any(|h| h["title"]
            .as_str()
            .unwrap()
            .to_lowercase()
            .contains("checkpoint")),
        "{found:?}"
    );
    assert_eq!(d.upstream_tool_calls(), ["search_notes"]);
    client.cancel().await.unwrap();
}

#[test]
fn new_list_names_the_contracts_this_host_supports() {
    let temp = tempfile::tempdir().unwrap();
    let out = author_airlock(temp.path(), &["new", "--list", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let contracts: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["contract"].as_str().unwrap())
        .collect();
    assert_eq!(
        contracts,
        [
            "airlock:contracts/source-retrieval@0.1.0",
            "airlock:contracts/artifact-delivery@0.2.0"
        ]
    );
    let text = String::from_utf8_lossy(&author_airlock(temp.path(), &["new", "--list"]).stdout)
        .into_owned();
    assert!(text.contains("query (read, host only)"), "{text}");
    let out = author_airlock(temp.path(), &["new", "link-check", "x"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("unknown contract `link-check`; this host supports")
    );
    // A folder here named like a built-in: which one is meant is not knowable.
    std::fs::create_dir(temp.path().join("source-retrieval")).unwrap();
    let out = author_airlock(temp.path(), &["new", "source-retrieval", "x"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("write `./source-retrieval`"), "{err}");
    assert!(!temp.path().join("x").exists(), "nothing written");
    // A folder without a separator that names no built-in is the package folder.
    let out = author_airlock(temp.path(), &["new", "source-retrieval-kit", "y"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("unknown contract"),
        "no such folder: the built-ins are named"
    );
    std::fs::create_dir(temp.path().join("my-package")).unwrap();
    let out = author_airlock(temp.path(), &["new", "my-package", "z"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no contract.toml"), "read as a folder: {err}");
}

#[test]
fn the_crate_new_writes_builds_to_a_component_for_every_contract() {
    let temp = tempfile::tempdir().unwrap();
    let package = workspace().join("contracts/workspace-edits");
    let vcs = workspace().join("contracts/version-control");
    for (contract, name) in [
        ("airlock:contracts/source-retrieval@0.1.0", "gen-retrieval"),
        ("artifact-delivery", "gen-delivery"),
        // An operator's package folder: bindings from its own WIT.
        (package.to_str().unwrap(), "gen-edits"),
        // One whose world targets airlock:host@0.3.0 (context and settings from the SDK).
        (vcs.to_str().unwrap(), "gen-vcs"),
    ] {
        let dir = temp.path().join(name);
        let out = author_airlock(
            temp.path(),
            &["new", contract, name, "--dir", dir.to_str().unwrap()],
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("airlock-sdk by path: "),
            "new says where the SDK is: {text}"
        );
        assert!(
            text.contains(&format!("airlock pack {}/mapping.toml", dir.display())),
            "{text}"
        );
        // The versions already fetched (no network), as in write_outside_example.
        std::fs::copy(workspace().join("Cargo.lock"), dir.join("Cargo.lock")).unwrap();
        // For the guest target, with no warning (its own target folder: other flags).
        run_ok(
            outside_cargo(&dir, "generated")
                .args(["build", "--target", "wasm32-wasip2"])
                .env("RUSTFLAGS", "-D warnings"),
        );
        let wasm = std::fs::read(
            outside_target_dir("generated")
                .join("wasm32-wasip2/debug")
                .join(format!("{}.wasm", name.replace('-', "_"))),
        )
        .unwrap();
        assert!(wasm.starts_with(&COMPONENT_PREAMBLE), "{name}");
        // Its test-kit test passes natively.
        let out = outside_cargo(&dir, "generated")
            .arg("test")
            .env("RUSTFLAGS", "-D warnings")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "cargo test of {name}:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("1 passed"), "{stdout}");
    }
}

/// The SDK's own test-kit tests need its `testing` feature, which no workspace member
/// enables: run them here so the workspace's `cargo test` covers them.
#[test]
fn the_sdk_test_kit_passes_its_own_tests() {
    let out = outside_cargo(&workspace(), "sdk-testing")
        .args([
            "test",
            "-p",
            "airlock-sdk",
            "--features",
            "testing",
            "--lib",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "cargo test -p airlock-sdk --features testing:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(
            "testing::tests::an_unexpected_call_fails_the_test_naming_tool_and_arguments - should panic ... ok"
        ),
        "{stdout}"
    );
}

/// `airlock grants MANIFEST ARGS`, with no state folder from the environment.
fn grants(args: &[&str]) -> std::process::Output {
    Command::new(airlock_bin())
        .arg("grants")
        .args(args)
        .env_remove("AIRLOCK_STATE_DIR")
        .env_remove("AIRLOCK_LOG")
        .output()
        .unwrap()
}

#[test]
fn grants_with_config_before_the_first_approval_reviews_the_manifest() {
    // README's order: discover (the store exists, the connection is recorded), then
    // `grants --config`, then `review approve`. The mapping is not recorded yet.
    let d = Deployment::with_notes().mapping("source-library");
    let config = d.write_config();
    let config = config.to_str().unwrap();
    let manifest = d.manifests()[0].to_str().unwrap().to_string();
    d.airlock_ok(&["discover", "notes", "--config", config]);
    let out = d.airlock(&["grants", &manifest, "--config", config]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("connection             notes (stdio"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    // Asked for a diff against a revision that cannot exist, it says why.
    let out = d.airlock(&["grants", &manifest, "--diff", "1"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no record of mapping"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn serve_with_no_client_records_the_candidate_and_exits_cleanly() {
    // README: `airlock serve --config F </dev/null` records the candidate revision.
    let d = Deployment::with_notes().mapping("source-library");
    let config = d.write_config();
    let config = config.to_str().unwrap();
    d.airlock_ok(&["discover", "notes", "--config", config]);
    let out = d.airlock(&["serve", "--config", config]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let list = d.airlock_ok(&["review", "list"]);
    assert!(
        list.lines()
            .any(|l| l.contains("source-library") && l.contains("candidate")),
        "{list}"
    );
}

#[test]
fn grants_with_config_shows_the_launch_and_the_tools_the_mapping_leaves_unreachable() {
    let d = Deployment::with_notes().mapping("source-library").replace_connections(
        "[[connection]]\nname = \"notes\"\ncommand = \"@airlock\"\nargs = [\"fixture\", \"notes-server\"]\nenv = { NOTES_TOKEN = \"hunter2-value\" }\n",
    );
    let config = d.write_config();
    let config = config.to_str().unwrap();
    let manifest = d.manifests()[0].to_str().unwrap().to_string();

    // Before any discovery: the launch, and no snapshot to compare with.
    let out = grants(&[&manifest, "--config", config]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("connection             notes (stdio, from "),
        "{text}"
    );
    assert!(
        text.contains(r#"args                 ["fixture", "notes-server"]"#),
        "{text}"
    );
    assert!(text.contains("env (names)          NOTES_TOKEN"), "{text}");
    assert!(
        text.contains("unreachable tools    unknown: no snapshot"),
        "{text}"
    );
    assert!(
        !text.contains("hunter2"),
        "an environment value leaked: {text}"
    );

    d.airlock_ok(&["discover", "notes", "--config", config]);
    let out = grants(&[&manifest, "--config", config, "--json"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(!String::from_utf8_lossy(&out.stdout).contains("hunter2"));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let c = &v["connection"];
    assert_eq!(c["transport"], "stdio");
    assert_eq!(c["env"], json!(["NOTES_TOKEN"]));
    assert!(c["command"].as_str().unwrap().ends_with("airlock"), "{c}");
    assert_eq!(c["unreachable_tools"], json!(["export_workspace"]), "{c}");
    assert_eq!(c["missing_tools"], json!([]));
    assert_eq!(c["snapshot"].as_str().unwrap().len(), 64);

    // A configuration without the mapping's connection: the host would refuse it.
    let other = d.dir.path().join("other.toml");
    std::fs::write(
        &other,
        std::fs::read_to_string(config)
            .unwrap()
            .replace("name = \"notes\"", "name = \"elsewhere\""),
    )
    .unwrap();
    let out = grants(&[&manifest, "--config", other.to_str().unwrap(), "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        v["refusals"],
        json!([
            "mapping `source-library` uses connection `notes`, which the serve configuration does not define"
        ])
    );
}
