//! Capability contracts as the model meets them: what `tools/list` offers for the
//! built-in contracts is fixed byte for byte by a checked-in expectation, so moving
//! where the host reads a contract from (compiled-in code, a contract package) cannot
//! change a tool's name, description, schema or annotations unnoticed.

use std::path::Path;

use crate::common::Deployment;

/// The checked-in `tools/list` of the bundled `source-library` and `outbox-delivery`
/// mappings (both built-in contracts), as one JSON document.
const EXPECTED_TOOLS: &str = "tests/expected/tools-list-builtins.json";

#[tokio::test]
async fn the_built_in_contracts_offer_exactly_the_recorded_tools() {
    let d = Deployment::with_notes()
        .mapping("source-library")
        .with_outbox(&[]);
    d.approve_all();
    let client = d.serve().await;
    let mut tools = client.peer().list_all_tools().await.unwrap();
    tools.sort_by(|a, b| a.name.cmp(&b.name));
    let got = serde_json::to_string_pretty(&tools).unwrap() + "\n";
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(EXPECTED_TOOLS);
    if std::env::var_os("AIRLOCK_UPDATE_EXPECTED").is_some() {
        std::fs::write(&path, &got).unwrap();
    }
    let expected = std::fs::read_to_string(&path).unwrap();
    assert!(
        got == expected,
        "tools/list differs from {EXPECTED_TOOLS} (set AIRLOCK_UPDATE_EXPECTED=1 only for an intended change):\n{got}"
    );
    client.cancel().await.unwrap();
}

/// The files of the repository's operator package, `contracts/workspace-edits/`.
const OPERATOR_FILES: [&str; 3] = ["contract.toml", "workspace.wit", "deps/host/host.wit"];

/// Writes the repository's operator package into `dir`, each file's text through
/// `edit(file, text)`.
fn write_package(dir: &Path, edit: impl Fn(&str, String) -> String) {
    let from = Path::new(env!("CARGO_MANIFEST_DIR")).join("../contracts/workspace-edits");
    for file in OPERATOR_FILES {
        let text = std::fs::read_to_string(from.join(file)).unwrap();
        let to = dir.join(file);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::write(to, edit(file, text)).unwrap();
    }
}

const PACKAGE: &str = "example:workspace-edits@1.0.0";
const INTERFACE: &str = "example:workspace-edits/workspace-edits@1.0.0";

/// A deployment whose configuration names the operator package (in `pkg`) and whose
/// `source-library` mapping is bound to it instead of its own contract.
fn operator_deployment(pkg: &Path) -> Deployment {
    write_package(pkg, |_, text| text);
    Deployment::with_notes()
        .mapping_edited("source-library", |t| {
            t.replace("airlock:contracts/source-retrieval@0.1.0", INTERFACE)
        })
        .tables(&format!(
            "[[contract]]\npath = {:?}\n",
            pkg.display().to_string()
        ))
}

#[test]
fn an_operator_contract_serves_only_once_approved_and_only_with_its_approved_digest() {
    let pkg = tempfile::tempdir().unwrap();
    let d = operator_deployment(pkg.path());
    let config = d.write_config();
    let config = config.to_str().unwrap();
    let manifest = d.manifests()[0].to_str().unwrap().to_string();
    d.airlock_ok(&["discover", "notes", "--config", config]);

    // Listed beside the built-ins, withheld until approved.
    let list = d.airlock_json(&["contracts", "list", "--config", config]);
    let ours = |list: &serde_json::Value| {
        list.as_array()
            .unwrap()
            .iter()
            .find(|p| p["package"] == PACKAGE)
            .cloned()
            .unwrap()
    };
    let p = ours(&list);
    assert_eq!(p["status"], "withheld", "{p}");
    assert!(
        p["withheld"].as_str().unwrap().contains("is not approved"),
        "{p}"
    );
    assert_eq!(p["interfaces"], serde_json::json!([INTERFACE]));
    let built_in: Vec<_> = list
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["status"] == "built-in")
        .map(|p| p["package"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        built_in,
        ["airlock:contracts@0.1.0", "airlock:contracts@0.2.0"]
    );

    // What a reviewer reads: semantics, and the schema without the host-supplied key.
    let shown = d.airlock_json(&["contracts", "show", INTERFACE, "--config", config]);
    let write = &shown["interfaces"][0]["functions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["name"] == "write")
        .unwrap()
        .clone();
    assert_eq!(write["semantics"]["class"], "reversible-mutation");
    assert_eq!(write["queryable_by"], "written");
    assert_eq!(write["compensable_by"], "restore");
    assert_eq!(
        write["input_schema"]["required"],
        serde_json::json!(["path", "content"]),
        "the idempotency key is the host's: {write}"
    );
    let text = d.airlock_ok(&["contracts", "show", PACKAGE, "--config", config]);
    assert!(
        text.contains("function written  [read; idempotent; host only"),
        "{text}"
    );
    assert!(text.contains("handle change-ref: identified by its locator alone; minted by restore, write, written; consumed by restore"), "{text}");

    // A mapping bound to it is refused while it is withheld, saying what to do.
    let grants = |d: &Deployment| {
        let out = d.airlock(&[
            "grants",
            &manifest,
            "--config",
            config,
            "--json",
            "--allow-flagged",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["refusals"].to_string()
    };
    let refusals = grants(&d);
    assert!(
        refusals.contains("is not approved") && refusals.contains("airlock contracts approve"),
        "{refusals}"
    );

    // Built-ins need no approval; a folder's package is approved once, traced.
    let out = d.airlock(&[
        "contracts",
        "approve",
        "airlock:contracts@0.1.0",
        "--config",
        config,
        "--reviewer",
        "alice",
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("is built in"));
    // The digest the reviewer read must still be the one on disk.
    let read = p["digest"].as_str().unwrap().to_string();
    let out = d.airlock(&[
        "contracts",
        "approve",
        PACKAGE,
        "--config",
        config,
        "--reviewer",
        "alice",
        "--digest",
        &"0".repeat(64),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains(&read) && err.contains("read it again"),
        "{err}"
    );
    let approved = d.airlock_json(&[
        "contracts",
        "approve",
        PACKAGE,
        "--config",
        config,
        "--reviewer",
        "alice",
        "--digest",
        &read,
        "--reason",
        "read it",
    ]);
    assert_eq!(approved["state"], "approved");
    let digest = approved["digest"].as_str().unwrap().to_string();
    assert_eq!(
        ours(&d.airlock_json(&["contracts", "list", "--config", config]))["status"],
        "served"
    );
    // The contract check passes now; the component (built for another contract) is what
    // the host refuses next.
    let refusals = grants(&d);
    assert!(!refusals.contains("is not approved"), "{refusals}");
    assert!(
        refusals.contains(&format!("does not export `{INTERFACE}`")),
        "{refusals}"
    );
    let events: Vec<_> = d
        .trace()
        .into_iter()
        .filter(|e| e["kind"] == "contract-approved")
        .collect();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["payload"]["digest"], digest.as_str());
    d.airlock_ok(&["trace", "verify"]);

    // The folder changes after review: withheld, naming both digests; approving the change
    // under the same name is refused.
    write_package(pkg.path(), |file, text| match file {
        "workspace.wit" => text.replace("Edits of text files", "Changes of text files"),
        _ => text,
    });
    let p = ours(&d.airlock_json(&["contracts", "list", "--config", config]));
    assert_eq!(p["status"], "withheld");
    let why = p["withheld"].as_str().unwrap();
    assert!(
        why.contains("changed after review") && why.contains(&digest),
        "{why}"
    );
    let out = d.airlock(&[
        "contracts",
        "approve",
        PACKAGE,
        "--config",
        config,
        "--reviewer",
        "alice",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&digest) && err.contains("new version"),
        "{err}"
    );
    // What changed since the review: the approved files against the folder.
    let approved_files = format!("approved:{PACKAGE}");
    let folder = pkg.path().to_str().unwrap();
    let diff = d.airlock_json(&[
        "contracts",
        "diff",
        &approved_files,
        folder,
        "--config",
        config,
    ]);
    assert_eq!(
        diff["changes"],
        serde_json::json!([{"interface": "example:workspace-edits/workspace-edits", "item": "interface",
            "what": "documentation changed", "breaking": false}])
    );
    // A new version whose write became an external effect: a breaking change, marked.
    let next = tempfile::tempdir().unwrap();
    write_package(next.path(), |file, text| {
        let text = text.replace("workspace-edits@1.0.0", "workspace-edits@1.1.0");
        match file {
            "contract.toml" => text
                .replace(
                    "write = { class = \"reversible-mutation\"",
                    "write = { class = \"external-effect\"",
                )
                .replace(", compensable-by = \"restore\"", ""),
            _ => text,
        }
    });
    let text = d.airlock_ok(&[
        "contracts",
        "diff",
        &approved_files,
        next.path().to_str().unwrap(),
        "--config",
        config,
    ]);
    assert!(text.contains("! example:workspace-edits/workspace-edits: function write: class reversible-mutation -> external-effect (more consequential)"), "{text}");
    assert!(text.contains("compensable-by restore -> none"), "{text}");
    write_package(pkg.path(), |_, text| text);
    assert_eq!(
        ours(&d.airlock_json(&["contracts", "list", "--config", config]))["status"],
        "served"
    );

    // Found wrong: withheld for good, its mappings refused with the reason; who and why
    // are required (the state is final).
    let out = d.airlock(&[
        "contracts",
        "mark-erroneous",
        PACKAGE,
        "--config",
        config,
        "--reviewer",
        "bob",
        "--reason",
        "",
    ]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("needs who (--reviewer) and why (--reason)")
    );
    d.airlock_ok(&[
        "contracts",
        "mark-erroneous",
        PACKAGE,
        "--config",
        config,
        "--reviewer",
        "bob",
        "--reason",
        "write is not reversible upstream",
    ]);
    let p = ours(&d.airlock_json(&["contracts", "list", "--config", config]));
    assert!(
        p["withheld"]
            .as_str()
            .unwrap()
            .contains("write is not reversible upstream"),
        "{p}"
    );
    assert!(grants(&d).contains("marked erroneous"));
    d.airlock_ok(&["trace", "verify"]);
}

#[test]
fn a_configured_package_that_does_not_load_is_withheld_alone_with_its_problems() {
    let pkg = tempfile::tempdir().unwrap();
    let d = operator_deployment(pkg.path());
    write_package(pkg.path(), |file, text| match file {
        "contract.toml" => text.replace("class = \"read\"", "class = \"harmless\""),
        _ => text,
    });
    let config = d.write_config();
    let list = d.airlock_json(&["contracts", "list", "--config", config.to_str().unwrap()]);
    let broken = list
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["package"].is_null())
        .unwrap();
    let why = broken["withheld"].as_str().unwrap();
    assert!(
        why.contains("contract.toml:19") && why.contains("\"harmless\" is not an effect class"),
        "{why}"
    );
    // The built-ins still serve.
    assert_eq!(
        list.as_array()
            .unwrap()
            .iter()
            .filter(|p| p["status"] == "built-in")
            .count(),
        2
    );
}

#[test]
fn a_configured_copy_of_a_built_in_package_is_withheld_saying_so() {
    let copy = tempfile::tempdir().unwrap();
    let wit = Path::new(env!("CARGO_MANIFEST_DIR")).join("../wit/v0.1.0");
    for file in ["contract.toml", "contracts.wit", "deps/host/host.wit"] {
        let to = copy.path().join(file);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(wit.join(file), &to).unwrap();
    }
    let d = Deployment::with_notes()
        .mapping("source-library")
        .tables(&format!(
            "[[contract]]\npath = {:?}\n",
            copy.path().display().to_string()
        ));
    let config = d.write_config();
    let list = d.airlock_json(&["contracts", "list", "--config", config.to_str().unwrap()]);
    let copied = list
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["status"] == "withheld")
        .unwrap();
    assert!(
        copied["withheld"]
            .as_str()
            .unwrap()
            .contains("is built into this host"),
        "{copied}"
    );
}
