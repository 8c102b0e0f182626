//! `airlock grants MANIFEST`: the reviewer's view of one adapter, run as the real binary
//! on the bundled mappings and on copies pointed at components written here.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use sha2::Digest as _;

/// The checked-in expectation for the bundled `source-library` mapping.
const EXPECTED: &str = "tests/expected/grants-source-library.txt";

/// A component that imports `wasi:filesystem/preopens` and exports nothing.
const FS_IMPORTER: &str = r#"
(component
  (import "wasi:filesystem/preopens@0.2.6" (instance
    (export "get-directories" (func (result (list string))))
  ))
)
"#;

fn bundled(mapping: &str) -> PathBuf {
    Path::new(airlock::ADAPTER_BUNDLE)
        .join(mapping)
        .join("mapping.toml")
}

fn grants(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_airlock"))
        .arg("grants")
        .args(args)
        .env_remove("AIRLOCK_LOG")
        .env_remove("AIRLOCK_STATE_DIR")
        .output()
        .expect("running airlock grants")
}

fn stdout(out: &Output) -> String {
    String::from_utf8(out.stdout.clone()).unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8(out.stderr.clone()).unwrap()
}

/// Replaces what changes with the component bytes or the checkout: the bundle folder,
/// the component digest, and its size.
fn normalise(text: &str) -> String {
    text.replace(airlock::ADAPTER_BUNDLE, "<bundle>")
        .lines()
        .map(|line| {
            let key = line.split_whitespace().next().unwrap_or_default();
            match key {
                "sha256" => "  sha256                 <sha256> (matches the pin)".to_string(),
                "size" => "  size                   <size> bytes".to_string(),
                _ => line.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

/// A copy of the bundled `source-library` mapping in a temporary folder, pointed at the
/// component `wat` (component text) and pinned to it; `edit` changes the manifest text.
fn copied_mapping(wat: &str, edit: impl Fn(String) -> String) -> (tempfile::TempDir, PathBuf) {
    let bytes = wat::parse_str(wat).expect("component text");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("component.wasm"), &bytes).unwrap();
    let digest = hex::encode(sha2::Sha256::digest(&bytes));
    let original = std::fs::read_to_string(bundled("source-library")).unwrap();
    let text: String = original
        .lines()
        .map(|line| {
            if line.starts_with("file = ") {
                "file = \"component.wasm\"".to_string()
            } else if line.starts_with("sha256 = ") {
                format!("sha256 = \"{digest}\"")
            } else {
                line.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    let path = dir.path().join("mapping.toml");
    std::fs::write(&path, edit(text)).unwrap();
    (dir, path)
}

const FLAGGED_FS: &str =
    "imports wasi:filesystem/preopens@0.2.6 but the mapping grants no filesystem access";

#[test]
fn the_source_library_review_matches_the_checked_in_expectation() {
    let manifest = bundled("source-library");
    let out = grants(&[manifest.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let got = normalise(&stdout(&out));
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(EXPECTED);
    if std::env::var_os("AIRLOCK_BLESS").is_some() {
        std::fs::write(&path, &got).unwrap();
    }
    let expected = std::fs::read_to_string(&path).unwrap();
    assert_eq!(
        got, expected,
        "review output changed; if intended, rerun with AIRLOCK_BLESS=1 to update {EXPECTED}"
    );
}

#[test]
fn json_output_parses_and_lists_the_decoded_imports() {
    for mapping in ["source-library", "fs-documents"] {
        let manifest = bundled(mapping);
        let out = grants(&[manifest.to_str().unwrap(), "--json"]);
        assert!(out.status.success(), "{}", stderr(&out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["mapping"]["name"], mapping);
        assert_eq!(v["flagged"], 0);
        let imports = v["imports"].as_array().unwrap();
        assert!(!imports.is_empty());
        let upstream = imports
            .iter()
            .find(|i| i["name"] == "airlock:host/upstream@0.1.0")
            .unwrap_or_else(|| panic!("no airlock:host/upstream import: {imports:?}"));
        assert_eq!(upstream["status"], "host-api");
        assert_eq!(upstream["kind"], "instance");
        assert!(
            imports
                .iter()
                .all(|i| i["status"] != "flagged" && i["reason"].is_string())
        );
        let contract = v["exports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == "airlock:contracts/source-retrieval@0.1.0")
            .expect("the contract export");
        assert_eq!(contract["note"], "the mapping's contract");
        assert!(
            v["capabilities"]
                .as_array()
                .unwrap()
                .iter()
                .all(|c| c["exported"] == true)
        );
        assert!(v["upstream"]["tools"][0]["digest"].is_null());
        assert_eq!(v["limits"]["memory_mib"], 64);
    }
}

#[test]
fn an_import_no_grant_justifies_is_flagged_and_fails_the_command() {
    let (_dir, manifest) = copied_mapping(FS_IMPORTER, |t| t);
    let manifest = manifest.to_str().unwrap();
    let out = grants(&[manifest]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(2), "{text}\n{}", stderr(&out));
    assert!(
        text.lines()
            .any(|l| l.contains("FLAGGED") && l.contains(FLAGGED_FS)),
        "{text}"
    );
    assert!(text.contains("4. Verdict: 1 import FLAGGED"), "{text}");
    assert!(stderr(&out).contains("flagged"), "{}", stderr(&out));

    let allowed = grants(&[manifest, "--allow-flagged"]);
    assert_eq!(allowed.status.code(), Some(0), "{}", stderr(&allowed));
    assert!(stdout(&allowed).contains(FLAGGED_FS));

    let json = grants(&[manifest, "--json"]);
    assert_eq!(json.status.code(), Some(2));
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v["flagged"], 1);
    assert_eq!(v["imports"][0]["status"], "flagged");
    assert_eq!(v["imports"][0]["reason"], FLAGGED_FS);
}

#[test]
fn a_filesystem_grant_justifies_the_filesystem_import() {
    let (dir, manifest) = copied_mapping(FS_IMPORTER, |t| {
        t.replace(
            "[grants]",
            "[[grants.filesystem]]\nhost = \"data\"\nguest = \"/data\"\naccess = \"read-only\"",
        )
    });
    std::fs::create_dir(dir.path().join("data")).unwrap();
    let out = grants(&[manifest.to_str().unwrap()]);
    let text = stdout(&out);
    assert!(
        text.contains(
            "granted   wasi:filesystem/preopens@0.2.6  1 filesystem grant: /data (read-only)"
        ),
        "{text}"
    );
    assert!(text.contains("filesystem             data -> /data (read-only"));
    assert!(text.contains("NOT EXPORTED"), "{text}");
    // The import is justified, but the component exports no contract: the host would
    // refuse the mapping, so the review fails.
    assert_eq!(out.status.code(), Some(2), "{text}\n{}", stderr(&out));
    assert!(
        text.contains("FLAGGED   the host would refuse to load it: mapping `source-library`: the component does not export `airlock:contracts/source-retrieval@0.1.0`"),
        "{text}"
    );
}

/// A component exporting the source-retrieval interface with `search` only (its type is
/// not the contract's: the load check is by name, as the host's).
const SEARCH_ONLY: &str = r#"
(component
  (core module $m (func (export "f")))
  (core instance $i (instantiate $m))
  (func $search (canon lift (core func $i "f")))
  (instance $iface (export "search" (func $search)))
  (export "airlock:contracts/source-retrieval@0.1.0" (instance $iface))
)
"#;

#[test]
fn a_capability_naming_a_function_the_component_does_not_export_is_flagged_as_the_host_refuses_it()
{
    let (dir, manifest) = copied_mapping(SEARCH_ONLY, |t| t);
    let expected = "mapping `source-library`: the component's `airlock:contracts/source-retrieval@0.1.0` has no function `retrieve`";
    let out = grants(&[manifest.to_str().unwrap(), "--json"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}\n{}",
        stdout(&out),
        stderr(&out)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v["flagged"], 0,
        "no import is flagged: the refusal alone fails it"
    );
    assert_eq!(v["refusals"], serde_json::json!([expected]));
    assert!(
        stderr(&out).contains("1 reason(s) the host would refuse"),
        "{}",
        stderr(&out)
    );

    // The host refuses it when it loads, in the same words.
    let m = airlock::registry::manifest::MappingManifest::load(&manifest).unwrap();
    let bytes = std::fs::read(dir.path().join("component.wasm")).unwrap();
    let runtime = airlock::runtime::Runtime::with_cache(None).unwrap();
    let contract =
        airlock::contract::load_contract("airlock:contracts/source-retrieval@0.1.0").unwrap();
    match runtime.load(&m, &bytes, &contract) {
        Ok(_) => panic!("the host loaded a mapping whose component lacks `retrieve`"),
        Err(e) => assert_eq!(format!("{e:#}"), expected),
    }

    let text = stdout(&grants(&[manifest.to_str().unwrap()]));
    assert!(
        text.contains(&format!(
            "FLAGGED   the host would refuse to load it: {expected}"
        )),
        "{text}"
    );
    assert!(
        text.contains("the host would refuse to load this mapping (1 reason)"),
        "{text}"
    );
    let allowed = grants(&[manifest.to_str().unwrap(), "--allow-flagged"]);
    assert_eq!(allowed.status.code(), Some(0));

    // Exporting both functions clears it (the check is not always on).
    let both = SEARCH_ONLY.replace(
        r#"(export "search" (func $search)))"#,
        r#"(export "search" (func $search)) (export "retrieve" (func $search)))"#,
    );
    let (_dir, manifest) = copied_mapping(&both, |t| t);
    let out = grants(&[manifest.to_str().unwrap(), "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
}

#[test]
fn environment_and_secret_values_are_never_shown() {
    let (_dir, manifest) = copied_mapping(FS_IMPORTER, |t| {
        t.replace(
            "[grants]",
            "[grants]\nenv = { REGION = \"hunter2-literal\", API_TOKEN = { secret = \"notes-api-token\" } }",
        )
    });
    let manifest = manifest.to_str().unwrap();
    for format in [None, Some("--json"), Some("--html")] {
        let mut args = vec![manifest, "--allow-flagged"];
        args.extend(format);
        let out = grants(&args);
        assert!(out.status.success(), "{}", stderr(&out));
        let text = stdout(&out);
        assert!(
            !text.contains("hunter2"),
            "{format:?}: a value leaked\n{text}"
        );
        assert!(text.contains("REGION"), "{format:?}");
        assert!(text.contains("API_TOKEN"), "{format:?}");
        assert!(text.contains("notes-api-token"), "{format:?}");
    }
}

#[test]
fn a_wrong_pin_is_refused_naming_both_digests() {
    let bad = "0".repeat(64);
    let (dir, manifest) = copied_mapping(FS_IMPORTER, |t| {
        t.lines()
            .map(|l| {
                if l.starts_with("sha256 = ") {
                    format!("sha256 = \"{bad}\"")
                } else {
                    l.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join("\n")
    });
    let bytes = std::fs::read(dir.path().join("component.wasm")).unwrap();
    let actual = hex::encode(sha2::Sha256::digest(&bytes));
    let out = grants(&[manifest.to_str().unwrap(), "--allow-flagged"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        out.stdout.is_empty(),
        "no review of an unverified component"
    );
    let err = stderr(&out);
    assert!(err.contains("component pin mismatch"), "{err}");
    assert!(err.contains(&bad), "{err}");
    assert!(err.contains(&actual), "{err}");
}

#[test]
fn html_output_is_one_self_contained_escaped_page() {
    let hostile = "Find <script>alert(\"x\")</script> & 'more'";
    let (_dir, manifest) = copied_mapping(FS_IMPORTER, |t| {
        t.replacen(
            "description = \"Search the technical notes library.",
            &format!("description = \"{}", hostile.replace('"', "\\\"")),
            1,
        )
    });
    let out = grants(&[manifest.to_str().unwrap(), "--html"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let html = stdout(&out);
    assert!(html.starts_with("<!DOCTYPE html>\n<html"), "{html}");
    assert!(html.trim_end().ends_with("</html>"));
    assert_eq!(html.matches("<html").count(), 1);
    assert_eq!(html.matches("</html>").count(), 1);
    assert!(html.contains(&format!("FLAGGED: {FLAGGED_FS}")), "{html}");
    assert!(html.contains("<tr class=\"flagged\">"));
    assert!(!html.contains("<script"), "unescaped markup:\n{html}");
    assert!(
        html.contains(
            "Find &lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &#39;more&#39;"
        ),
        "{html}"
    );
    for external in ["http://", "https://", "<link", "src=", "@import", "url("] {
        assert!(!html.contains(external), "external asset `{external}`");
    }
}

#[test]
fn a_missing_manifest_is_an_error() {
    let out = grants(&["/nonexistent/mapping.toml"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("/nonexistent/mapping.toml"));
}

/// A component that imports `airlock:host/context` at a version no host provides.
const FUTURE_HOST: &str = r#"
(component
  (import "airlock:host/context@0.3.0" (instance
    (export "remaining-ms" (func (result u64)))
  ))
)
"#;

#[test]
fn the_review_names_the_host_version_each_component_targets() {
    for (mapping, version, imports) in [
        (
            "source-library",
            "0.1.0",
            &["airlock:host/upstream@0.1.0"][..],
        ),
        (
            "outbox-delivery",
            "0.2.0",
            &[
                "airlock:host/context@0.2.0",
                "airlock:host/log@0.1.0",
                "airlock:host/upstream@0.1.0",
            ][..],
        ),
    ] {
        let manifest = bundled(mapping);
        let out = grants(&[manifest.to_str().unwrap(), "--json"]);
        assert!(out.status.success(), "{}", stderr(&out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["host_version"], version, "{mapping}");
        let host: Vec<&str> = v["imports"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|i| i["name"].as_str().unwrap().starts_with("airlock:host/"))
            .map(|i| {
                assert_eq!(i["status"], "host-api", "{i}");
                i["name"].as_str().unwrap()
            })
            .collect();
        assert_eq!(host, imports, "{mapping}");
        let text = stdout(&grants(&[manifest.to_str().unwrap()]));
        assert!(
            text.contains(&format!(
                "host version           airlock:host {version} (the highest version among its imports)"
            )),
            "{text}"
        );
    }
}

#[test]
fn an_import_of_a_host_version_that_does_not_exist_is_flagged_by_version() {
    let (_dir, manifest) = copied_mapping(FUTURE_HOST, |t| t);
    let out = grants(&[manifest.to_str().unwrap(), "--json"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["host_version"].is_null());
    assert_eq!(v["imports"][0]["status"], "flagged");
    let reason = v["imports"][0]["reason"].as_str().unwrap();
    assert!(
        reason.contains("airlock:host/context@0.3.0") && reason.contains("airlock:host 0.3.0"),
        "{reason}"
    );
    let text = stdout(&grants(&[manifest.to_str().unwrap()]));
    assert!(
        text.contains("host version           none this host provides (see the flagged import)"),
        "{text}"
    );
}

#[test]
fn the_review_shows_each_capabilitys_effective_semantics() {
    let manifest = bundled("outbox-delivery");
    let out = grants(&[manifest.to_str().unwrap(), "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let deliver = v["capabilities"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["function"] == "deliver")
        .unwrap();
    assert_eq!(
        deliver["effect"],
        serde_json::json!({"class": "external-effect", "idempotent": true, "queryable": true, "compensable": false, "host_only": false})
    );
    assert_eq!(deliver["contract_effect"], deliver["effect"]);
    let text = stdout(&grants(&[manifest.to_str().unwrap()]));
    assert!(
        text.contains(
            "capability deliver_artifact -> deliver [external-effect, idempotent, queryable]"
        ),
        "{text}"
    );
    assert!(
        text.contains("capability prepare_artifact -> prepare [local-transformation]"),
        "{text}"
    );

    // A mapping may narrow a flag; the review shows what it serves with and what it
    // narrowed away.
    let (_dir, narrowed) = copied_mapping(FS_IMPORTER, |t| {
        t.replacen(
            "effect = \"read\"",
            "effect = \"read\"\nidempotent = false",
            1,
        )
    });
    let out = grants(&[narrowed.to_str().unwrap(), "--json", "--allow-flagged"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["capabilities"][0]["effect"]["idempotent"], false);
    assert_eq!(v["capabilities"][0]["contract_effect"]["idempotent"], true);
    let text = stdout(&grants(&[narrowed.to_str().unwrap(), "--allow-flagged"]));
    assert!(
        text.contains(
            "capability search_sources -> search [read; narrowed by the mapping: not idempotent]"
        ),
        "{text}"
    );
    assert!(
        text.contains("capability retrieve_source -> retrieve [read, idempotent]"),
        "{text}"
    );
}

#[test]
fn a_manifest_that_does_not_confirm_the_contracts_effect_is_refused() {
    for (edit, needle) in [
        (
            ("effect = \"read\"\n", ""),
            "capability `search_sources` has no `effect`",
        ),
        (
            ("effect = \"read\"", "effect = \"external-effect\""),
            "capability `search_sources`: effect = \"external-effect\"",
        ),
        (
            ("effect = \"read\"", "effect = \"read-only\""),
            "effect `read-only` is not an effect class",
        ),
        (
            ("effect = \"read\"", "effect = \"read\"\nqueryable = true"),
            "`queryable = true` widens the contract",
        ),
    ] {
        let (_dir, manifest) = copied_mapping(FS_IMPORTER, |t| t.replacen(edit.0, edit.1, 1));
        let out = grants(&[manifest.to_str().unwrap(), "--allow-flagged"]);
        assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
        assert!(out.stdout.is_empty(), "no review of an unconfirmed mapping");
        let err = stderr(&out);
        assert!(err.contains(needle), "expected `{needle}` in: {err}");
    }
}
