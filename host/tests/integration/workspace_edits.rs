//! An operator-defined contract over a real published server:
//! `example:workspace-edits@1.1.0` (`contracts/workspace-edits-1.1/`, named by the serve
//! configuration, not built into Airlock) through the `workspace-edits` adapter over
//! `@modelcontextprotocol/server-filesystem`, with a real MCP client. The write is a
//! `reversible-mutation`, so the built-in policy asks a person first: a write nobody
//! approved never reaches the server, one approval writes exactly once, and the change is
//! undone by its own reference.

use std::path::{Path, PathBuf};

use serde_json::json;
use sha2::Digest as _;

use airlock::pipeline::Category;

use crate::common::*;

const PACKAGE: &str = "example:workspace-edits@1.1.0";

fn sha(text: &str) -> String {
    hex::encode(sha2::Sha256::digest(text.as_bytes()))
}

/// The workspace server over `ws` (confined, read-write) as connection `workspace`, the
/// `workspace-edits` mapping, and `packages` as the configuration's `[[contract]]` folders
/// (none: the repository's `contracts/workspace-edits`).
fn deployment(ws: &Path, packages: &[&Path]) -> Deployment {
    deployment_edited(ws, packages, |t| t)
}

/// [`deployment`] with the `workspace-edits` mapping's text passed through `edit`.
fn deployment_edited(
    ws: &Path,
    packages: &[&Path],
    edit: impl FnOnce(String) -> String,
) -> Deployment {
    let server = node_modules().join("@modelcontextprotocol/server-filesystem/dist/index.js");
    let repository = workspace().join("contracts/workspace-edits-1.1");
    let packages = if packages.is_empty() {
        vec![repository.as_path()]
    } else {
        packages.to_vec()
    };
    let contracts: String = packages
        .iter()
        .map(|p| format!("[[contract]]\npath = {:?}\n", p.display().to_string()))
        .collect();
    Deployment::with_notes()
        .connection(&format!(
            "[[connection]]\nname = \"workspace\"\ncommand = \"node\"\nargs = [{:?}, {:?}]\n{}",
            server.display().to_string(),
            ws.display().to_string(),
            confined(&[(ws, "read-write")])
        ))
        .mapping_edited("workspace-edits", edit)
        .tables(&contracts)
}

/// `intents compensate` of the completed intent of `capability`, approved as `carol`, with
/// the deployment's configuration: (success, stderr).
fn compensate_completed(d: &Deployment, capability: &str) -> (bool, String) {
    let id = completed(d, capability)["id"].as_str().unwrap().to_string();
    let config = d.write_config();
    let (ok, _, err) = compensate(d, config.to_str().unwrap(), &id, "approve");
    (ok, err)
}

fn records(ws: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(ws.join(".airlock-changes"))
        .map(|d| d.map(|e| e.unwrap().path()).collect())
        .unwrap_or_default()
}

#[tokio::test]
async fn an_approved_write_lands_once_and_is_undone_by_its_reference() {
    let ws = tempfile::tempdir().unwrap();
    std::fs::write(ws.path().join("notes.md"), "old text\n").unwrap();
    let d = deployment(ws.path(), &[]);
    let config = d.write_config();
    let config = config.to_str().unwrap();
    // The package is the operator's: served only once approved.
    approve_operator(&d, "workspace", config, PACKAGE);
    // The reviewer's view resolves the operator contract like the host does.
    let shown = d.airlock_json(&["review", "show", "workspace-edits", "--config", config]);
    let caps = shown["capabilities"].as_array().unwrap();
    assert!(
        caps.iter()
            .all(|c| c["effect"]["class"] == "reversible-mutation" && c["problem"].is_null()),
        "{shown}"
    );
    let client = d.serve_unreviewed().await;

    let tools = client.peer().list_all_tools().await.unwrap();
    let names: Vec<_> = tools.iter().map(|t| t.name.to_string()).collect();
    assert_eq!(
        names,
        [
            "edit_workspace_file",
            "restore_workspace_file",
            "write_workspace_file"
        ]
    );
    let write = tools
        .iter()
        .find(|t| t.name == "write_workspace_file")
        .unwrap();
    assert_eq!(
        write.input_schema["required"],
        json!(["path", "content"]),
        "the idempotency key is the host's"
    );

    // Nobody approved yet: nothing reaches the server.
    let args = json!({"path": "notes.md", "content": "new text\n"});
    let r = call(&client, "write_workspace_file", args.clone())
        .await
        .unwrap();
    let text = assert_refused(&r, Category::ApprovalRequired);
    // The person sees which file and which content (by the digest the write will report).
    assert!(
        text.contains(&format!(
            "Arguments: path \"notes.md\", content 9 bytes sha256 {}.",
            sha("new text\n")
        )),
        "{text}"
    );
    assert_eq!(
        std::fs::read_to_string(ws.path().join("notes.md")).unwrap(),
        "old text\n"
    );
    assert!(
        records(ws.path()).is_empty(),
        "nothing was recorded upstream"
    );
    let id = approval_in(&text);
    d.airlock_ok(&["approvals", "approve", &id, "--by", "bob", "--yes"]);

    // One approval, one write.
    let done = call(&client, "write_workspace_file", args.clone())
        .await
        .unwrap();
    assert_ne!(done.is_error, Some(true), "{}", text_of(&done));
    let change = done.structured_content.clone().unwrap()["result"].clone();
    assert_eq!(change["path"], "notes.md");
    assert_eq!(change["before-sha256"], sha("old text\n"));
    assert_eq!(change["after-sha256"], sha("new text\n"));
    assert_eq!(
        std::fs::read_to_string(ws.path().join("notes.md")).unwrap(),
        "new text\n"
    );
    assert_eq!(records(ws.path()).len(), 1);
    // The receipt is spent: the same request again asks a person again, and writes nothing.
    let again = call(&client, "write_workspace_file", args).await.unwrap();
    assert_refused(&again, Category::ApprovalRequired);
    assert_eq!(records(ws.path()).len(), 1, "written exactly once");

    // Undone by the reference the write returned, approved like any effect.
    let reference = change["change"].as_str().unwrap().to_string();
    let restored = approved_call(
        &d,
        &client,
        "restore_workspace_file",
        json!({"change": reference}),
    )
    .await;
    let r = restored.structured_content.unwrap()["result"].clone();
    assert_eq!(r["after-sha256"], sha("old text\n"));
    assert_eq!(
        std::fs::read_to_string(ws.path().join("notes.md")).unwrap(),
        "old text\n"
    );

    // A change whose file changed since is not restored over the newer text.
    std::fs::write(ws.path().join("notes.md"), "edited by a person\n").unwrap();
    let r = call(
        &client,
        "restore_workspace_file",
        json!({"change": reference}),
    )
    .await
    .unwrap();
    let text = assert_refused(&r, Category::ApprovalRequired);
    // The person sees what the undo acts on: the change, its file and both digests.
    assert!(
        text.contains("Change \"")
            && text.contains("path \"notes.md\"")
            && text.contains(&sha("old text\n")),
        "{text}"
    );
    // The change is named on its own line with its facts; neither its handle token nor
    // the host-supplied idempotency key is listed among the model's arguments.
    assert!(!text.contains("Arguments:"), "{text}");
    approve_as_bob(&d, &text);
    let r = call(
        &client,
        "restore_workspace_file",
        json!({"change": reference}),
    )
    .await
    .unwrap();
    assert_eq!(r.is_error, Some(true), "{}", text_of(&r));
    assert!(text_of(&r).contains("changed since"), "{}", text_of(&r));
    assert_eq!(
        std::fs::read_to_string(ws.path().join("notes.md")).unwrap(),
        "edited by a person\n"
    );
    client.cancel().await.unwrap();
    d.airlock_ok(&["trace", "verify"]);
}

/// A workspace whose `notes.md` said "old text", the package and mappings approved, and
/// one approved write of "new text" to it done through a served client (then closed);
/// with the configuration's path.
async fn written() -> (tempfile::TempDir, Deployment, PathBuf) {
    written_edited(|t| t).await
}

/// [`written`] with the mapping's text passed through `edit`.
async fn written_edited(
    edit: impl FnOnce(String) -> String,
) -> (tempfile::TempDir, Deployment, PathBuf) {
    let ws = tempfile::tempdir().unwrap();
    std::fs::write(ws.path().join("notes.md"), "old text\n").unwrap();
    let d = deployment_edited(ws.path(), &[], edit);
    let config = d.write_config();
    let path = config.to_str().unwrap();
    approve_operator(&d, "workspace", path, PACKAGE);
    let client = d.serve_unreviewed().await;
    let args = json!({"path": "notes.md", "content": "new text\n"});
    approved_call(&d, &client, "write_workspace_file", args).await;
    client.cancel().await.unwrap();
    (ws, d, config)
}

/// A completed write is undone out of band (`airlock intents compensate`): the undo is an
/// ordinary call of `restore` that policy sends to a person, whose summary names the
/// intent undone and the digest restored; denied, nothing changes; approved, the file is
/// back and the new intent records what it compensates; once compensated, never again.
#[tokio::test]
async fn a_completed_write_is_compensated_out_of_band_once_a_person_approves() {
    let (ws, d, config) = written().await;
    let config = config.to_str().unwrap();
    let write = completed(&d, "write_workspace_file");
    let id = write["id"].as_str().unwrap().to_string();
    // What the write's result carried is kept with its intent, to undo it by.
    assert_eq!(write["handles"][0]["kind"], "change-ref", "{write}");
    assert_eq!(write["handles"][0]["facts"]["path"], "notes.md");
    assert_eq!(
        write["handles"][0]["facts"]["before-sha256"],
        sha("old text\n")
    );
    let shown = d.airlock_ok(&["intents", "show", &id]);
    assert!(shown.contains("undo by    change-ref"), "{shown}");

    // Denied: nothing is undone.
    let (ok, _, err) = compensate(&d, config, &id, "deny");
    assert!(!ok, "{err}");
    assert!(
        err.contains(&format!("It compensates intent {id}"))
            && err.contains("path \"notes.md\"")
            && err.contains(&sha("old text\n")),
        "the person sees what is undone and the digest it restores: {err}"
    );
    assert!(err.contains("is denied: nothing was undone"), "{err}");
    assert_eq!(
        std::fs::read_to_string(ws.path().join("notes.md")).unwrap(),
        "new text\n"
    );

    // Approved: undone once, as an intent of its own that names the original.
    let (ok, out, err) = compensate(&d, config, &id, "approve");
    assert!(ok, "{err}");
    let done: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(done["compensated"], id.as_str());
    assert_eq!(done["intent"]["compensates"], id.as_str());
    assert_eq!(done["intent"]["capability"], "restore_workspace_file");
    assert_eq!(done["result"]["after-sha256"], sha("old text\n"));
    assert_eq!(
        std::fs::read_to_string(ws.path().join("notes.md")).unwrap(),
        "old text\n"
    );
    let undo = done["intent"]["id"].as_str().unwrap();
    let shown = d.airlock_json(&["intents", "show", undo]);
    assert!(shown["tampered"].is_null(), "the trace proves it: {shown}");
    assert_eq!(shown["intent"]["compensates"], id.as_str());

    // Once compensated, never again; an undo has no undo; an unknown intent is named.
    let (ok, _, err) = compensate(&d, config, &id, "approve");
    assert!(
        !ok && err.contains(&format!("already compensated by intent {undo}")),
        "{err}"
    );
    let (ok, _, err) = compensate(&d, config, undo, "approve");
    assert!(!ok && err.contains("declares no undo"), "{err}");
    let (ok, _, err) = compensate(&d, config, "int_nothing", "approve");
    assert!(!ok && err.contains("no intent `int_nothing`"), "{err}");
    assert_eq!(
        std::fs::read_to_string(ws.path().join("notes.md")).unwrap(),
        "old text\n"
    );
    d.airlock_ok(&["trace", "verify"]);
}

/// Handles changed in the database (its write-once trigger dropped, the locator pointed
/// at another change) are not what the write's MACed completion recorded: nothing is
/// undone by them and no person is even asked.
#[tokio::test]
async fn handles_changed_in_the_database_undo_nothing() {
    let (ws, d, config) = written().await;
    let config = config.to_str().unwrap();
    let id = completed(&d, "write_workspace_file")["id"]
        .as_str()
        .unwrap()
        .to_string();
    let db = rusqlite::Connection::open(d.state_dir().join("airlock.db")).unwrap();
    let refused = db.execute("UPDATE intents SET handles = '[]' WHERE id = ?1", [&id]);
    assert!(
        refused.unwrap_err().to_string().contains("written once"),
        "the store keeps handles once"
    );
    db.execute_batch("DROP TRIGGER intents_handles_once")
        .unwrap();
    db.execute(
        "UPDATE intents SET handles = replace(handles, '\"locator\":\"', '\"locator\":\"x') WHERE id = ?1",
        [&id],
    )
    .unwrap();
    drop(db);
    let (ok, _, err) = compensate(&d, config, &id, "approve");
    assert!(!ok, "{err}");
    assert!(err.contains("not those its completion"), "{err}");
    assert!(!err.contains("apr_"), "no person was asked: {err}");
    assert_eq!(
        std::fs::read_to_string(ws.path().join("notes.md")).unwrap(),
        "new text\n"
    );
}

/// A deployment whose workspace server loses the answer to the first call of `tool` whose
/// arguments contain `contain` (the connection dies with that request unanswered, once),
/// the operator package approved and every mapping approved; `lost` exists once it did.
fn lossy(ws: &Path, tool: &str, contain: &str, lost: &Path) -> Deployment {
    let server = node_modules().join("@modelcontextprotocol/server-filesystem/dist/index.js");
    let d = Deployment::with_notes()
        .connection(&format!(
            "[[connection]]\nname = \"workspace\"\ncommand = \"@airlock\"\nargs = {:?}\nconfine = false\n",
            lose_answer_args(
                tool,
                contain,
                lost,
                &[&node(), server.to_str().unwrap(), ws.to_str().unwrap()]
            )
        ))
        .mapping("workspace-edits")
        .tables(&format!(
            "[[contract]]\npath = {:?}\n",
            workspace().join("contracts/workspace-edits-1.1").display().to_string()
        ));
    let config = d.write_config();
    let config = config.to_str().unwrap();
    approve_operator(&d, "workspace", config, PACKAGE);
    d
}

/// The write's answer is lost after the server wrote the file (the connection dies with
/// the request unanswered): the outcome is unknown, and the host asks the contract's
/// declared query (`written`, which reads the adapter's record and the file back and
/// compares digests) instead of writing again: completed, written once.
#[tokio::test]
async fn a_write_whose_answer_is_lost_is_reconciled_by_reading_the_file_back() {
    let ws = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    let lost = state.path().join("lost");
    std::fs::write(ws.path().join("notes.md"), "old text\n").unwrap();
    let d = lossy(ws.path(), "write_file", "new text", &lost);
    let client = d.serve_unreviewed().await;

    let args = json!({"path": "notes.md", "content": "new text\n"});
    let done = approved_call(&d, &client, "write_workspace_file", args).await;
    assert!(lost.exists(), "the answer was lost");
    let text = text_of(&done);
    assert!(text.starts_with("Reconciled (intent int_"), "{text}");
    let s = done.structured_content.clone().unwrap();
    assert_eq!(s["reconciled"]["method"], "query");
    assert_eq!(s["result"]["after-sha256"], sha("new text\n"));
    assert_eq!(
        std::fs::read_to_string(ws.path().join("notes.md")).unwrap(),
        "new text\n"
    );
    assert_eq!(records(ws.path()).len(), 1, "written once, never again");
    client.cancel().await.unwrap();
    // The reconciled write kept what its query found, so it can be undone like any other.
    let (ok, err) = compensate_completed(&d, "write_workspace_file");
    assert!(ok, "{err}");
    assert_eq!(
        std::fs::read_to_string(ws.path().join("notes.md")).unwrap(),
        "old text\n"
    );
    d.airlock_ok(&["trace", "verify"]);
}

/// The answer lost is the adapter's own record of the change, before the file was
/// written: the query finds the record but the file as it was, so the host reports that
/// nothing happened, and the file is untouched.
#[tokio::test]
async fn a_write_lost_before_the_file_changed_is_reconciled_as_nothing_happened() {
    let ws = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    let lost = state.path().join("lost");
    std::fs::write(ws.path().join("notes.md"), "old text\n").unwrap();
    let d = lossy(ws.path(), "write_file", ".airlock-changes", &lost);
    let client = d.serve_unreviewed().await;

    let args = json!({"path": "notes.md", "content": "new text\n"});
    let r = call(&client, "write_workspace_file", args.clone())
        .await
        .unwrap();
    let id = approval_in(&assert_refused(&r, Category::ApprovalRequired));
    d.airlock_ok(&["approvals", "approve", &id, "--by", "bob", "--yes"]);
    let r = call(&client, "write_workspace_file", args).await.unwrap();
    assert!(lost.exists(), "the answer was lost");
    assert_eq!(r.is_error, Some(true));
    let text = text_of(&r);
    assert!(text.contains("nothing happened"), "{text}");
    assert_eq!(
        std::fs::read_to_string(ws.path().join("notes.md")).unwrap(),
        "old text\n"
    );
    let failed = d.airlock_json(&["intents", "list", "--state", "failed"]);
    assert_eq!(failed.as_array().unwrap().len(), 1, "{failed}");
    assert_eq!(failed[0]["resolution"]["method"], "query");
    client.cancel().await.unwrap();
    d.airlock_ok(&["trace", "verify"]);
}

/// The names `client` is offered once they equal `want`, within 10 s.
async fn offered_becomes(
    client: &rmcp::service::RunningService<rmcp::RoleClient, ()>,
    want: &[&str],
) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let names: Vec<String> = client
            .peer()
            .list_all_tools()
            .await
            .unwrap()
            .into_iter()
            .map(|t| t.name.to_string())
            .collect();
        if names == want {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "offered {names:?}, waited for {want:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Contracts hot-load like mappings: a package edited on disk after its review stops its
/// mapping serving within moments (withheld: changed after review), the approved text back
/// serves it again, and a package marked erroneous stops it for good — on a host that
/// keeps running.
#[tokio::test]
async fn a_serving_host_follows_its_contract_packages_and_their_reviews() {
    let ws = tempfile::tempdir().unwrap();
    let pkg = tempfile::tempdir().unwrap();
    for file in ["contract.toml", "workspace.wit", "deps/host/host.wit"] {
        let to = pkg.path().join(file);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(
            workspace().join("contracts/workspace-edits-1.1").join(file),
            &to,
        )
        .unwrap();
    }
    // A second package, 1.2.0, configured from the start but written only later.
    let next = tempfile::tempdir().unwrap();
    let d = deployment(ws.path(), &[pkg.path(), next.path()]);
    let config = d.write_config();
    let config = config.to_str().unwrap();
    approve_operator(&d, "workspace", config, PACKAGE);
    let client = d.serve_unreviewed().await;
    let both = [
        "edit_workspace_file",
        "restore_workspace_file",
        "write_workspace_file",
    ];
    offered_becomes(&client, &both).await;

    // A new version with a new required argument, approved while serving: a migration.
    // The mapping bound to 1.1.0 keeps serving 1.1.0's schema until it is reviewed again.
    for file in ["contract.toml", "workspace.wit", "deps/host/host.wit"] {
        let text = std::fs::read_to_string(pkg.path().join(file)).unwrap();
        let text = text
            .replace("workspace-edits@1.1.0", "workspace-edits@1.2.0")
            .replace(
                "        content: string,\n",
                "        content: string,\n        mode: string,\n",
            );
        let to = next.path().join(file);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::write(to, text).unwrap();
    }
    let newer = "example:workspace-edits@1.2.0";
    d.airlock_ok(&[
        "contracts",
        "approve",
        newer,
        "--config",
        config,
        "--reviewer",
        "alice",
    ]);
    let diff = d.airlock_ok(&["contracts", "diff", PACKAGE, newer, "--config", config]);
    assert!(diff.contains("! example:workspace-edits/workspace-edits: function write, argument mode: added, required"), "{diff}");
    tokio::time::sleep(std::time::Duration::from_millis(800)).await;
    let tools = client.peer().list_all_tools().await.unwrap();
    let write = tools
        .iter()
        .find(|t| t.name == "write_workspace_file")
        .unwrap();
    assert_eq!(
        write.input_schema["required"],
        json!(["path", "content"]),
        "still 1.1.0's schema"
    );

    let wit = pkg.path().join("workspace.wit");
    let approved = std::fs::read_to_string(&wit).unwrap();
    std::fs::write(
        &wit,
        approved.replace("Edits of text files", "Edits of files"),
    )
    .unwrap();
    offered_becomes(&client, &[]).await;
    std::fs::write(&wit, &approved).unwrap();
    offered_becomes(&client, &both).await;

    d.airlock_ok(&[
        "contracts",
        "mark-erroneous",
        PACKAGE,
        "--config",
        config,
        "--reviewer",
        "bob",
        "--reason",
        "restore cannot delete what write created",
    ]);
    offered_becomes(&client, &[]).await;
    let r = call(
        &client,
        "write_workspace_file",
        json!({"path": "n.md", "content": "x"}),
    )
    .await
    .unwrap_err();
    assert_eq!(error_code(&r), Some(-32602), "an unknown tool now: {r:?}");
    client.cancel().await.unwrap();
    let unloaded = d
        .trace()
        .into_iter()
        .filter(|e| e["kind"] == "mapping-unloaded" && e["subject"] == "workspace-edits")
        .count();
    assert_eq!(
        unloaded, 2,
        "unloaded when changed, and when marked erroneous"
    );
}

/// What a person approving a write sees of the model's arguments: a short one-line
/// string quoted with every control and direction character escaped, a longer one by
/// its size and sha256 only.
#[tokio::test]
async fn the_summary_shows_hostile_arguments_escaped_and_long_ones_by_digest() {
    let (_ws, d, _config) = written().await;
    let client = d.serve_unreviewed().await;
    let hostile = "a\u{1b}[2J\u{202e}dm.b";
    let r = call(
        &client,
        "write_workspace_file",
        json!({"path": hostile, "content": "x"}),
    )
    .await
    .unwrap();
    let text = assert_refused(&r, Category::ApprovalRequired);
    assert!(
        text.contains(r#"Arguments: path "a\u{1b}[2J\u{202e}dm.b", content "x"."#),
        "{text}"
    );
    assert!(
        !text.contains('\u{1b}') && !text.contains('\u{202e}'),
        "{text}"
    );
    // 81 characters on one line: by size and digest, not cut to a look-alike prefix.
    let long = "b".repeat(81);
    let r = call(
        &client,
        "write_workspace_file",
        json!({"path": long, "content": "x"}),
    )
    .await
    .unwrap();
    let text = assert_refused(&r, Category::ApprovalRequired);
    assert!(
        text.contains(&format!("path 81 bytes sha256 {}", sha(&long))),
        "{text}"
    );
    client.cancel().await.unwrap();
}

/// A compensation whose undo fails (the file changed since) is an intent of its own,
/// failed: it may be tried again, and it is no completed effect to compensate itself;
/// a row the trace does not prove (its requester edited) undoes nothing, asking no one.
#[tokio::test]
async fn a_failed_compensation_is_tried_again_and_a_row_the_trace_does_not_prove_undoes_nothing() {
    let (ws, d, config) = written().await;
    let config = config.to_str().unwrap();
    let id = completed(&d, "write_workspace_file")["id"]
        .as_str()
        .unwrap()
        .to_string();
    let notes = ws.path().join("notes.md");
    std::fs::write(&notes, "edited by a person\n").unwrap();
    let (ok, _, err) = compensate(&d, config, &id, "approve");
    assert!(!ok, "{err}");
    assert_eq!(
        std::fs::read_to_string(&notes).unwrap(),
        "edited by a person\n"
    );
    let failed = d.airlock_json(&["intents", "list", "--state", "failed"]);
    let undo = failed
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["compensates"] == id.as_str())
        .unwrap_or_else(|| panic!("the failed compensation is recorded: {failed}"))["id"]
        .as_str()
        .unwrap()
        .to_string();
    // Only a completed effect is compensated.
    let (ok, _, err) = compensate(&d, config, &undo, "approve");
    assert!(
        !ok && err.contains("only a completed effect can be compensated"),
        "{err}"
    );
    // The file back as the write left it: tried again, undone.
    std::fs::write(&notes, "new text\n").unwrap();
    let (ok, out, err) = compensate(&d, config, &id, "approve");
    assert!(ok, "a failed compensation may be tried again: {err}");
    let done: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(done["intent"]["compensates"], id.as_str());
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), "old text\n");
    // The undo has no undo of its own: its intent keeps no handle, though its result
    // carried one.
    assert!(done["intent"].get("handles").is_none(), "{done}");
    assert!(done["result"]["change"].is_string(), "{done}");
    // A row edited in the database is not what the trace recorded: refused before
    // anything else is looked at, and no person is asked.
    let db = rusqlite::Connection::open(d.state_dir().join("airlock.db")).unwrap();
    db.execute(
        "UPDATE intents SET requester = 'mallory' WHERE id = ?1",
        [&id],
    )
    .unwrap();
    drop(db);
    let (ok, _, err) = compensate(&d, config, &id, "approve");
    assert!(!ok, "{err}");
    assert!(err.contains("is not what the trace recorded"), "{err}");
    assert!(!err.contains("apr_"), "no person was asked: {err}");
}

/// Nobody decides within `--wait`: nothing is undone and the request is withdrawn
/// (revoked), so no one approves a compensation nobody waits for any more.
#[tokio::test]
async fn a_compensation_nobody_decides_in_time_is_withdrawn() {
    let (ws, d, config) = written().await;
    let config = config.to_str().unwrap();
    let id = completed(&d, "write_workspace_file")["id"]
        .as_str()
        .unwrap()
        .to_string();
    let out = std::process::Command::new(airlock_bin())
        .env("AIRLOCK_CACHE_DIR", test_cache_dir())
        .env("AIRLOCK_STATE_DIR", d.state_dir())
        .args([
            "intents",
            "compensate",
            &id,
            "--config",
            config,
            "--wait",
            "1",
        ])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("within 1 s: nothing was undone"), "{err}");
    let approval = approval_in(&err);
    assert_eq!(
        d.airlock_json(&["approvals", "show", &approval])["state"],
        "revoked"
    );
    assert_eq!(
        std::fs::read_to_string(ws.path().join("notes.md")).unwrap(),
        "new text\n"
    );
}

/// A mapping that narrows `write` to not compensable: its completed writes keep nothing
/// to undo by, and `intents compensate` refuses them without asking anyone.
#[tokio::test]
async fn a_write_the_mapping_declares_not_compensable_is_not_compensated() {
    let (ws, d, config) = written_edited(|t| {
        t.replacen(
            "effect = \"reversible-mutation\"",
            "effect = \"reversible-mutation\"\ncompensable = false",
            1,
        )
    })
    .await;
    let config = config.to_str().unwrap();
    let write = completed(&d, "write_workspace_file");
    assert!(write.get("handles").is_none(), "nothing kept: {write}");
    let id = write["id"].as_str().unwrap().to_string();
    let (ok, _, err) = compensate(&d, config, &id, "approve");
    assert!(!ok, "{err}");
    assert!(
        err.contains("its mapping declares it not compensable"),
        "{err}"
    );
    assert!(!err.contains("apr_"), "no person was asked: {err}");
    assert_eq!(
        std::fs::read_to_string(ws.path().join("notes.md")).unwrap(),
        "new text\n"
    );
}

/// A file with Windows line endings, and what `edit_workspace_file` with [`beta_edit`]
/// makes of it: the server reads `\r\n` as `\n` in the whole file.
const CRLF_FILE: &str = "alpha\r\nbeta\r\ngamma\r\n";
/// See [`CRLF_FILE`].
const EDITED_FILE: &str = "alpha\nBETA\ngamma\n";

/// Arguments of an edit of `notes.md` replacing `beta` with `BETA` (fields not in the
/// record's order: the summary shows them in that order whatever the model sent).
fn beta_edit() -> serde_json::Value {
    json!({"edits": [{"new-text": "BETA", "old-text": "beta"}], "path": "notes.md"})
}

/// `edit` (1.1.0) over the server's `edit_file`: the person approves exact replacements,
/// the adapter computes the text they make before anything is sent (and refuses an old
/// text that is missing or not unique, where the server would guess), one approval edits
/// once, and the change is undone byte for byte, line endings included.
#[tokio::test]
async fn an_approved_edit_replaces_exactly_the_approved_text_once_and_is_undone() {
    let ws = tempfile::tempdir().unwrap();
    let notes = ws.path().join("notes.md");
    std::fs::write(&notes, CRLF_FILE).unwrap();
    let d = deployment(ws.path(), &[]);
    let config = d.write_config();
    approve_operator(&d, "workspace", config.to_str().unwrap(), PACKAGE);
    let client = d.serve_unreviewed().await;
    let tools = client.peer().list_all_tools().await.unwrap();
    let edit = tools
        .iter()
        .find(|t| t.name == "edit_workspace_file")
        .unwrap();
    assert_eq!(edit.input_schema["required"], json!(["path", "edits"]));
    assert_eq!(
        edit.input_schema["properties"]["edits"]["items"]["required"],
        json!(["old-text", "new-text"]),
        "{:?}",
        edit.input_schema
    );

    // Nobody approved yet: nothing reaches the server, and the person sees the edits.
    let r = call(&client, "edit_workspace_file", beta_edit())
        .await
        .unwrap();
    let text = assert_refused(&r, Category::ApprovalRequired);
    assert!(
        text.contains(r#"Arguments: path "notes.md", edits [{old-text "beta", new-text "BETA"}]."#),
        "{text}"
    );
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), CRLF_FILE);
    assert!(records(ws.path()).is_empty());
    approve_as_bob(&d, &text);
    let done = call(&client, "edit_workspace_file", beta_edit())
        .await
        .unwrap();
    assert_ne!(done.is_error, Some(true), "{}", text_of(&done));
    let change = done.structured_content.clone().unwrap()["result"].clone();
    assert_eq!(change["before-sha256"], sha(CRLF_FILE));
    assert_eq!(
        change["after-sha256"],
        sha(EDITED_FILE),
        "the digest the adapter computed is what the server wrote"
    );
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), EDITED_FILE);
    assert_eq!(records(ws.path()).len(), 1);
    // The receipt is spent: the same edit asks again.
    let again = call(&client, "edit_workspace_file", beta_edit())
        .await
        .unwrap();
    assert_refused(&again, Category::ApprovalRequired);

    // Approved but not exact: refused by the adapter before anything is recorded or sent
    // (the server would have matched `  gamma` by its trimmed line and re-indented).
    for (old, why) in [
        ("  gamma", "is not in the file"),
        ("a", "occurs more than once"),
    ] {
        let args = json!({"path": "notes.md", "edits": [{"old-text": old, "new-text": "x"}]});
        let r = call(&client, "edit_workspace_file", args.clone())
            .await
            .unwrap();
        approve_as_bob(&d, &assert_refused(&r, Category::ApprovalRequired));
        let r = call(&client, "edit_workspace_file", args).await.unwrap();
        assert_eq!(r.is_error, Some(true), "{}", text_of(&r));
        assert!(text_of(&r).contains(why), "{}", text_of(&r));
        assert_eq!(std::fs::read_to_string(&notes).unwrap(), EDITED_FILE);
        assert_eq!(records(ws.path()).len(), 1, "nothing recorded for {old:?}");
    }

    // Undone by its reference: the text before, `\r\n` and all.
    let args = json!({"change": change["change"]});
    approved_call(&d, &client, "restore_workspace_file", args).await;
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), CRLF_FILE);
    client.cancel().await.unwrap();
    d.airlock_ok(&["trace", "verify"]);
}

/// An edit whose answer is lost after the server edited the file is reconciled through
/// the same query as a write (the record names the digest the edit makes), kept once,
/// and compensated out of band back to the text before.
#[tokio::test]
async fn an_edit_whose_answer_is_lost_is_reconciled_and_then_compensated() {
    let ws = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    let lost = state.path().join("lost");
    let notes = ws.path().join("notes.md");
    std::fs::write(&notes, CRLF_FILE).unwrap();
    let d = lossy(ws.path(), "edit_file", "BETA", &lost);
    let client = d.serve_unreviewed().await;
    let done = approved_call(&d, &client, "edit_workspace_file", beta_edit()).await;
    assert!(lost.exists(), "the answer was lost");
    let s = done.structured_content.clone().unwrap();
    assert_eq!(s["reconciled"]["method"], "query", "{s}");
    assert_eq!(s["result"]["after-sha256"], sha(EDITED_FILE));
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), EDITED_FILE);
    assert_eq!(records(ws.path()).len(), 1, "edited once, never again");
    client.cancel().await.unwrap();
    let (ok, err) = compensate_completed(&d, "edit_workspace_file");
    assert!(ok, "{err}");
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), CRLF_FILE);
    d.airlock_ok(&["trace", "verify"]);
}

/// A migration with the real packages: the mapping's reviewed revision is bound to
/// `example:workspace-edits@1.0.0` (write and restore); the adapter's next revision, bound
/// to 1.1.0, adds `edit_workspace_file`. With the manifest changed on disk, the 1.0.0
/// revision keeps serving (1.1.0 is approved as a contract, but the mapping is not yet
/// reviewed against it); once a reviewer approves the new revision, `edit` is offered.
/// The same component serves both: its 1.1.0 export satisfies 1.0.0 (component-model
/// semver).
#[tokio::test]
async fn a_revision_bound_to_1_0_0_serves_until_its_1_1_0_revision_is_approved() {
    let ws = tempfile::tempdir().unwrap();
    std::fs::write(ws.path().join("notes.md"), "old text\n").unwrap();
    let old = workspace().join("contracts/workspace-edits");
    let new = workspace().join("contracts/workspace-edits-1.1");
    let d = deployment_edited(ws.path(), &[&old, &new], |t| {
        let t = t
            .replace("workspace-edits@1.1.0", "workspace-edits@1.0.0")
            .replace("\"edit_file\", ", "");
        let at = t.find("[[capability]]\nfunction = \"edit\"").unwrap();
        let end = at + t[at..].find("\n\n").unwrap() + 2;
        format!("{}{}", &t[..at], &t[end..])
    })
    .watched();
    let config = d.write_config();
    let config = config.to_str().unwrap();
    approve_operator(&d, "workspace", config, "example:workspace-edits@1.0.0");
    let client = d.serve_unreviewed().await;
    let old_names = ["restore_workspace_file", "write_workspace_file"];
    offered_becomes(&client, &old_names).await;
    approved_call(
        &d,
        &client,
        "write_workspace_file",
        json!({"path": "notes.md", "content": "one\n"}),
    )
    .await;

    // The new version: an addition, nothing breaking, approved as a contract.
    let diff = d.airlock_ok(&[
        "contracts",
        "diff",
        "example:workspace-edits@1.0.0",
        PACKAGE,
        "--config",
        config,
    ]);
    assert!(diff.contains("function edit"), "{diff}");
    assert!(diff.contains("\n0 breaking"), "{diff}");
    d.airlock_ok(&[
        "contracts",
        "approve",
        PACKAGE,
        "--config",
        config,
        "--reviewer",
        "alice",
    ]);
    // The adapter's next revision arrives: staged, the reviewed 1.0.0 revision serves on.
    let manifest = d.mapping_dir("workspace-edits").join("mapping.toml");
    let next = std::fs::read_to_string(bundle().join("workspace-edits/mapping.toml")).unwrap();
    std::fs::write(&manifest, next).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !d.trace().iter().any(|e| e["kind"] == "mapping-staged") {
        assert!(std::time::Instant::now() < deadline, "never staged");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    offered_becomes(&client, &old_names).await;
    let r = call(&client, "edit_workspace_file", beta_edit()).await;
    assert_eq!(r.as_ref().err().and_then(error_code), Some(-32602), "{r:?}");

    // Reviewed against 1.1.0: swapped in, and the edit is offered.
    d.approve("workspace-edits", "alice", &[]);
    offered_becomes(
        &client,
        &[
            "edit_workspace_file",
            "restore_workspace_file",
            "write_workspace_file",
        ],
    )
    .await;
    std::fs::write(ws.path().join("notes.md"), "alpha\nbeta\n").unwrap();
    approved_call(&d, &client, "edit_workspace_file", beta_edit()).await;
    assert_eq!(
        std::fs::read_to_string(ws.path().join("notes.md")).unwrap(),
        "alpha\nBETA\n"
    );
    client.cancel().await.unwrap();
    let shown = d.airlock_json(&["review", "show", "workspace-edits", "--config", config]);
    assert_eq!(shown["current"]["revision"], 2, "{shown}");
    d.airlock_ok(&["trace", "verify"]);
}

/// What `intents compensate` refuses before any person is asked, with the reason and
/// what to do: a profile the undo is not offered to, a revision that maps no undo, and a
/// mapping whose contract stopped serving. Nothing is undone by any of them.
#[tokio::test]
async fn a_compensation_the_host_cannot_offer_is_refused_before_anyone_is_asked() {
    let (ws, d, config) = written().await;
    let config_path = config.to_str().unwrap().to_string();
    let id = completed(&d, "write_workspace_file")["id"]
        .as_str()
        .unwrap()
        .to_string();
    let refused = |config: &str, profile: Option<&str>, want: &str| {
        let mut args = vec![
            "intents",
            "compensate",
            &id,
            "--config",
            config,
            "--wait",
            "5",
        ];
        if let Some(p) = profile {
            args.extend(["--profile", p]);
        }
        let out = d.airlock(&args);
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success(), "{err}");
        assert!(err.contains(want), "{want}: {err}");
        assert!(!err.contains("apr_"), "no person was asked: {err}");
        assert_eq!(
            std::fs::read_to_string(ws.path().join("notes.md")).unwrap(),
            "new text\n"
        );
    };
    // A profile that offers the write but not its undo.
    let text = std::fs::read_to_string(&config).unwrap();
    let narrow = d.dir.path().join("narrow.toml");
    std::fs::write(
        &narrow,
        format!(
            "{text}\n[[profile]]\nname = \"writer\"\ncapabilities = [\"write_workspace_file\"]\n"
        ),
    )
    .unwrap();
    refused(
        narrow.to_str().unwrap(),
        Some("writer"),
        "is not offered `restore_workspace_file`: choose a profile that is (--profile)",
    );
    // A contract marked erroneous: its mappings no longer serve.
    d.airlock_ok(&[
        "contracts",
        "mark-erroneous",
        PACKAGE,
        "--config",
        &config_path,
        "--reviewer",
        "bob",
        "--reason",
        "found wrong",
    ]);
    refused(
        &config_path,
        None,
        "was marked erroneous by bob: found wrong",
    );
}

/// A revision that maps the write but not its undo: the completed write is kept, but
/// compensating it is refused, saying which function a revision must map.
#[tokio::test]
async fn a_write_whose_mapping_offers_no_undo_is_not_compensated() {
    let (ws, d, config) = written_edited(|t| {
        let at = t.find("[[capability]]\nfunction = \"restore\"").unwrap();
        let end = at + t[at..].find("\n\n").unwrap() + 2;
        format!("{}{}", &t[..at], &t[end..])
    })
    .await;
    let id = completed(&d, "write_workspace_file")["id"]
        .as_str()
        .unwrap()
        .to_string();
    let (ok, _, err) = compensate(&d, config.to_str().unwrap(), &id, "approve");
    assert!(!ok, "{err}");
    assert!(
        err.contains("offers no capability for `restore`, the undo of `write`"),
        "{err}"
    );
    assert!(!err.contains("apr_"), "no person was asked: {err}");
    assert_eq!(
        std::fs::read_to_string(ws.path().join("notes.md")).unwrap(),
        "new text\n"
    );
}

/// An edit of a file that does not exist is `not-found`, and one of a file larger than the
/// adapter changes is refused as such (not reported as an unknown outcome): in both cases
/// nothing is recorded, sent or created, and a person's approval is spent on a refusal.
#[tokio::test]
async fn an_edit_of_a_missing_or_too_large_file_is_refused_and_records_nothing() {
    let ws = tempfile::tempdir().unwrap();
    let big = format!("alpha\nbeta\n{}", "y".repeat(600 << 10));
    std::fs::write(ws.path().join("big.md"), &big).unwrap();
    let d = deployment(ws.path(), &[]);
    let config = d.write_config();
    approve_operator(&d, "workspace", config.to_str().unwrap(), PACKAGE);
    let client = d.serve_unreviewed().await;
    for (path, want) in [
        ("missing.md", "not-found"),
        ("big.md", "is larger than 524288 bytes"),
    ] {
        let args = json!({"path": path, "edits": [{"old-text": "beta", "new-text": "BETA"}]});
        let r = call(&client, "edit_workspace_file", args.clone())
            .await
            .unwrap();
        approve_as_bob(&d, &assert_refused(&r, Category::ApprovalRequired));
        let r = call(&client, "edit_workspace_file", args).await.unwrap();
        let text = assert_refused(&r, Category::InvalidRequest);
        assert!(text.contains(want), "{path}: {text}");
        assert!(records(ws.path()).is_empty(), "{path}");
    }
    assert!(!ws.path().join("missing.md").exists());
    assert_eq!(
        std::fs::read_to_string(ws.path().join("big.md")).unwrap(),
        big
    );
    let unknown = d.airlock_json(&["intents", "list", "--state", "unknown"]);
    assert_eq!(unknown.as_array().unwrap().len(), 0, "{unknown}");
    client.cancel().await.unwrap();
}
