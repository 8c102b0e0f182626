//! A third operator-defined contract over a real published server:
//! `example:version-control@1.0.0` (`contracts/version-control/`, named by the serve
//! configuration, not built into Airlock) through the `version-control` adapter over the
//! Python `mcp-server-git` (PyPI, pinned in `fixtures/python/requirements.txt`), with a real
//! MCP client. The server runs confined, with the real interpreter, its packages read-only
//! and read-write access to one temporary Git repository and nothing else; the adapter
//! reads that repository from its mapping's `[settings]`, rewritten here to the test's.
//!
//! Creating a branch is a `reversible-mutation` without an undo (the server cannot delete
//! a branch) and a commit an `external-effect`: the built-in policy asks a person first, so
//! a mutation nobody approved never reaches the server, and one approval makes one branch
//! or one commit, exactly once. Git's own plumbing (`for-each-ref`, `rev-parse`, `log`)
//! tells what happened to the repository, never the adapter's answers alone.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use sha2::Digest as _;

use airlock::pipeline::Category;

use crate::common::*;

const PACKAGE: &str = "example:version-control@1.0.0";

fn sha(text: &str) -> String {
    hex::encode(sha2::Sha256::digest(text.as_bytes()))
}

/// The interpreter's real path (a pyenv shim cannot run confined; the real interpreter's
/// install folder is granted read-only by default), as `python_server` finds it.
fn real_python() -> PathBuf {
    let out = std::process::Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .expect("python3 runs");
    assert!(out.status.success());
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// `fixtures/python/site`, holding `mcp-server-git` (README's test command installs it).
fn git_server_site() -> PathBuf {
    let site = python_site();
    assert!(
        site.join("mcp_server_git").is_dir(),
        "mcp-server-git is not installed: run README's test command (it installs fixtures/python/requirements.txt into fixtures/python/site)"
    );
    site
}

/// Runs `git ARGS` in `repo` (this machine's global and system configuration ignored),
/// asserting success; returns stdout, trimmed.
fn git(repo: &Path, args: &[&str]) -> String {
    let out = std::process::Command::new("git")
        .args(args)
        .current_dir(repo)
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .output()
        .expect("git runs");
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// A repository on `main` with one commit (`README.md`), its author configured in the
/// repository (the confined server reads no home folder).
fn repository() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path();
    git(repo, &["init", "-q", "-b", "main"]);
    git(repo, &["config", "user.name", "Repo Owner"]);
    git(repo, &["config", "user.email", "owner@example.com"]);
    std::fs::write(repo.join("README.md"), "# Project\n\nTeh first line.\n").unwrap();
    git(repo, &["add", "README.md"]);
    git(repo, &["commit", "-q", "-m", "Start the project"]);
    dir
}

/// Every ref with the object it names, one a line: what a denied call must leave alone.
fn refs(repo: &Path) -> String {
    git(repo, &["for-each-ref", "--format=%(refname) %(objectname)"])
}

/// The paths staged in the index (empty: nothing staged).
fn staged(repo: &Path) -> String {
    git(repo, &["diff", "--cached", "--name-only"])
}

/// The `[[contract]]` table naming the repository's package.
fn contract_table() -> String {
    format!(
        "[[contract]]\npath = {:?}\n",
        workspace()
            .join("contracts/version-control")
            .display()
            .to_string()
    )
}

/// The server's environment: its packages, no bytecode written beside them.
fn server_env() -> String {
    format!(
        "env = {{ PYTHONPATH = {:?}, PYTHONDONTWRITEBYTECODE = \"1\" }}\n",
        git_server_site().display().to_string()
    )
}

/// The mapping with its `repository` setting rewritten to `repo`.
fn mapping(d: Deployment, repo: &Path) -> Deployment {
    let repo = repo.display().to_string();
    d.mapping_edited("version-control", |t| {
        assert!(t.contains("repository = \"/srv/repositories/project\""));
        t.replace("/srv/repositories/project", &repo)
    })
    .tables(&contract_table())
}

/// The git server over `repo` (confined: the repository read-write, its packages
/// read-only) as connection `git`, the `version-control` mapping, the package approved by
/// `alice` and the mapping approved.
fn deployment(repo: &Path) -> Deployment {
    let site = git_server_site();
    let d = Deployment::with_notes().connection(&format!(
        "[[connection]]\nname = \"git\"\ncommand = {:?}\nargs = {:?}\n{}{}",
        real_python().display().to_string(),
        [
            "-m",
            "mcp_server_git",
            "--repository",
            repo.to_str().unwrap()
        ],
        server_env(),
        confined(&[(repo, "read-write"), (&site, "read-only")])
    ));
    approved(mapping(d, repo))
}

/// Discovers the git connection, approves the package and the mapping.
fn approved(d: Deployment) -> Deployment {
    let config = d.write_config();
    let config = config.to_str().unwrap();
    approve_operator(&d, "git", config, PACKAGE);
    d
}

/// A deployment whose git server loses the answer to the first `tool` call whose
/// arguments (as JSON text) contain `contain`: the server acts, then the connection dies
/// with the request unanswered, once; `lost` exists once it did.
fn lossy(repo: &Path, tool: &str, contain: &str, lost: &Path) -> Deployment {
    let python = real_python();
    let d = Deployment::with_notes().connection(&format!(
        "[[connection]]\nname = \"git\"\ncommand = \"@airlock\"\nargs = {:?}\n{}confine = false\n",
        lose_answer_args(
            tool,
            contain,
            lost,
            &[
                python.to_str().unwrap(),
                "-m",
                "mcp_server_git",
                "--repository",
                repo.to_str().unwrap(),
            ],
        ),
        server_env(),
    ));
    approved(mapping(d, repo))
}

/// The structured result of a successful call.
fn result(r: &rmcp::model::CallToolResult) -> Value {
    assert_ne!(r.is_error, Some(true), "{}", text_of(r));
    r.structured_content.clone().unwrap()["result"].clone()
}

/// The upstream tools the host sent to the git server, in order (from the trace).
fn sent(d: &Deployment) -> Vec<String> {
    d.trace()
        .iter()
        .filter(|e| e["kind"] == "upstream-request")
        .filter_map(|e| e["payload"]["target"].as_str().map(str::to_owned))
        .collect()
}

/// Calls `tool` with `args`, approved by a person, expecting the adapter's refusal as
/// `conflict`: returns its text.
async fn refused_conflict(
    d: &Deployment,
    client: &rmcp::service::RunningService<rmcp::RoleClient, ()>,
    tool: &str,
    args: Value,
) -> String {
    let r = call(client, tool, args.clone()).await.unwrap();
    let id = approval_in(&assert_refused(&r, Category::ApprovalRequired));
    d.airlock_ok(&["approvals", "approve", &id, "--by", "bob", "--yes"]);
    let r = call(client, tool, args).await.unwrap();
    let text = assert_refused(&r, Category::InvalidRequest);
    assert!(text.starts_with("invalid request: conflict; "), "{text}");
    text
}

#[tokio::test]
async fn an_approved_branch_and_commit_happen_once_and_nothing_unapproved_reaches_git() {
    let dir = repository();
    let repo = dir.path();
    let start = git(repo, &["rev-parse", "main"]);
    let d = deployment(repo);
    let config = d.write_config();
    let config = config.to_str().unwrap();
    // The reviewer's view: the operator contract's classes, no undo anywhere, the
    // repository setting, and the server's tools this mapping never reaches.
    let shown = d.airlock_json(&["review", "show", "version-control", "--config", config]);
    let caps = shown["capabilities"].as_array().unwrap();
    let class = |name: &str| {
        caps.iter()
            .find(|c| c["name"] == name)
            .unwrap_or_else(|| panic!("no {name} in {shown}"))["effect"]
            .clone()
    };
    assert_eq!(
        class("create_branch")["class"],
        "reversible-mutation",
        "{shown}"
    );
    assert_eq!(class("commit_files")["class"], "external-effect", "{shown}");
    // The mapping keeps one query (this host reconciles a mapping through one): a lost
    // commit is asked about, a lost branch creation sent again under its key.
    assert_eq!(class("commit_files")["queryable"], true, "{shown}");
    assert_eq!(class("create_branch")["queryable"], false, "{shown}");
    assert_eq!(class("create_branch")["idempotent"], true, "{shown}");
    assert!(caps.iter().all(|c| c["problem"].is_null()), "{shown}");
    assert!(
        !shown.to_string().contains("\"compensable\":true"),
        "nothing is compensable: {shown}"
    );
    let manifest = d.manifests()[0].to_str().unwrap().to_string();
    let grants = d.airlock_json(&["grants", &manifest, "--config", config]);
    assert_eq!(
        grants["connection"]["unreachable_tools"],
        json!([
            "git_diff_unstaged",
            "git_diff_staged",
            "git_diff",
            "git_reset"
        ]),
        "{grants}"
    );
    assert_eq!(grants["connection"]["missing_tools"], json!([]), "{grants}");
    assert!(
        grants.to_string().contains(&repo.display().to_string()),
        "the reviewer sees the repository setting: {grants}"
    );
    let client = d.serve_unreviewed().await;

    // What the model is offered: local names and reviewed descriptions, no upstream tool,
    // no repository, no idempotency key.
    let tools = client.peer().list_all_tools().await.unwrap();
    let mut names: Vec<_> = tools.iter().map(|t| t.name.to_string()).collect();
    names.sort();
    assert_eq!(names, ["commit_files", "create_branch"]);
    let listing = serde_json::to_string(&tools).unwrap();
    for hidden in [
        "git_",
        "repo_path",
        "idempotency",
        "branch-created",
        "committed",
        &repo.display().to_string(),
    ] {
        assert!(!listing.contains(hidden), "`{hidden}` leaked: {listing}");
    }
    let schema = |name: &str| {
        tools
            .iter()
            .find(|t| t.name == name)
            .unwrap()
            .input_schema
            .clone()
    };
    let create_schema = schema("create_branch");
    assert_eq!(create_schema["required"], json!(["name"]));
    let mut properties: Vec<_> = create_schema["properties"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    properties.sort();
    assert_eq!(
        properties,
        ["base", "name"],
        "the idempotency key is the host's"
    );
    assert_eq!(
        schema("commit_files")["required"],
        json!(["branch", "files", "message"])
    );

    // Nobody approved yet: nothing reaches the server, the repository is as it was.
    let before = refs(repo);
    let branch = json!({"name": "fix/readme-typo"});
    let r = call(&client, "create_branch", branch.clone())
        .await
        .unwrap();
    let text = assert_refused(&r, Category::ApprovalRequired);
    assert!(
        text.contains("fix/readme-typo"),
        "the person sees the name: {text}"
    );
    assert_eq!(refs(repo), before);
    assert!(sent(&d).is_empty(), "nothing was sent: {:?}", sent(&d));

    // A person denies it: still nothing, and the same call asks anew.
    let denied = approval_in(&text);
    d.airlock_ok(&[
        "approvals",
        "deny",
        &denied,
        "--by",
        "bob",
        "--reason",
        "not this one",
    ]);
    let r = call(&client, "create_branch", branch.clone())
        .await
        .unwrap();
    let text = assert_refused(&r, Category::ApprovalRequired);
    assert_ne!(
        approval_in(&text),
        denied,
        "a new request, not the denied one"
    );
    assert_eq!(refs(repo), before);
    assert!(sent(&d).is_empty(), "nothing was sent: {:?}", sent(&d));

    // One approval, one branch: created at main's commit, beside the adapter's record of it.
    let made = approved_call(&d, &client, "create_branch", branch.clone()).await;
    let made = result(&made);
    assert_eq!(made["name"], "fix/readme-typo");
    assert_eq!(made["created-at"], start.as_str());
    assert_eq!(
        git(repo, &["rev-parse", "refs/heads/fix/readme-typo"]),
        start
    );
    let key = completed(&d, "create_branch")["idempotency_key"]
        .as_str()
        .unwrap()
        .to_string();
    let record = format!("refs/heads/airlock-changes/{key}/fix/readme-typo");
    assert_eq!(
        refs(repo),
        [
            format!("{record} {start}"),
            format!("refs/heads/fix/readme-typo {start}"),
            format!("refs/heads/main {start}"),
        ]
        .join("\n"),
        "one branch and its record, nothing else"
    );
    assert_eq!(git(repo, &["symbolic-ref", "HEAD"]), "refs/heads/main");

    // The receipt is spent: the same request again asks a person again, and once approved
    // creates nothing (the branch exists).
    let after_branch = refs(repo);
    let again = call(&client, "create_branch", branch.clone())
        .await
        .unwrap();
    assert_refused(&again, Category::ApprovalRequired);
    assert_eq!(refs(repo), after_branch);
    let text = refused_conflict(&d, &client, "create_branch", branch).await;
    assert!(text.contains("exists already"), "{text}");
    assert_eq!(refs(repo), after_branch, "created exactly once");

    // A commit onto the new branch: the person's edits in the working tree, one file left
    // out of it.
    std::fs::write(repo.join("README.md"), "# Project\n\nThe first line.\n").unwrap();
    std::fs::create_dir_all(repo.join("docs")).unwrap();
    std::fs::write(repo.join("docs/guide.md"), "# Guide\n").unwrap();
    std::fs::write(repo.join("scratch.txt"), "not for the commit\n").unwrap();
    let commit = json!({
        "branch": "fix/readme-typo",
        "files": ["README.md", "docs"],
        "message": "Fix the typo in the README\n\nAnd start a guide.",
    });
    let r = call(&client, "commit_files", commit.clone()).await.unwrap();
    let text = assert_refused(&r, Category::ApprovalRequired);
    // The person sees the class, the branch, the files, and the message (of several lines)
    // by its digest.
    let message = commit["message"].as_str().unwrap();
    assert!(
        text.contains("external effect, which cannot be recalled once done")
            && text.contains(&format!(
                "Arguments: branch \"fix/readme-typo\", files [\"README.md\", \"docs\"], message {} bytes sha256 {}.",
                message.len(),
                sha(message)
            )),
        "{text}"
    );
    assert_eq!(
        refs(repo),
        after_branch,
        "nothing committed while unapproved"
    );
    assert_eq!(git(repo, &["symbolic-ref", "HEAD"]), "refs/heads/main");
    assert_eq!(staged(repo), "", "nothing staged while unapproved");
    approve_as_bob(&d, &text);
    let done = call(&client, "commit_files", commit.clone()).await.unwrap();
    let done = result(&done);
    let head = git(repo, &["rev-parse", "refs/heads/fix/readme-typo"]);
    assert_eq!(done["id"], head.as_str());
    assert_eq!(done["branch"], "fix/readme-typo");
    assert_eq!(
        git(repo, &["symbolic-ref", "HEAD"]),
        "refs/heads/fix/readme-typo"
    );
    assert_eq!(git(repo, &["rev-parse", &format!("{head}^")]), start);
    assert_eq!(
        git(repo, &["show", "--name-only", "--format=", &head]),
        "README.md\ndocs/guide.md",
        "exactly the named files"
    );
    let commit_key = completed(&d, "commit_files")["idempotency_key"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        git(repo, &["log", "-1", "--format=%B", &head]),
        format!(
            "Fix the typo in the README\n\nAnd start a guide.\n\nAirlock-Idempotency-Key: {commit_key}"
        )
    );
    assert_eq!(
        git(repo, &["rev-parse", "main"]),
        start,
        "main is untouched"
    );
    assert_eq!(staged(repo), "");
    assert_eq!(
        git(repo, &["status", "--porcelain"]),
        "?? scratch.txt",
        "the file left out stays untracked"
    );

    // The same commit again asks again, and once approved commits nothing (no changes).
    let after_commit = refs(repo);
    let again = call(&client, "commit_files", commit.clone()).await.unwrap();
    assert_refused(&again, Category::ApprovalRequired);
    let text = refused_conflict(&d, &client, "commit_files", commit).await;
    assert!(text.contains("nothing to commit"), "{text}");
    assert_eq!(refs(repo), after_commit, "committed exactly once");

    // Something a person staged is never swept into the model's commit: refused before
    // anything is staged.
    std::fs::write(repo.join("docs/guide.md"), "# Guide\n\nMore.\n").unwrap();
    git(repo, &["add", "scratch.txt"]);
    let text = refused_conflict(
        &d,
        &client,
        "commit_files",
        json!({"branch": "fix/readme-typo", "files": ["docs/guide.md"], "message": "More guide"}),
    )
    .await;
    assert!(
        text.contains("other changes are staged (scratch.txt)"),
        "{text}"
    );
    assert_eq!(
        staged(repo),
        "scratch.txt",
        "the index is as the person left it"
    );
    assert_eq!(refs(repo), after_commit);

    // Pathspec magic and the adapter's record names are refused before anything is sent.
    let before_sent = sent(&d).len();
    for (tool, args) in [
        (
            "commit_files",
            json!({"branch": "fix/readme-typo", "files": [":/"], "message": "All"}),
        ),
        (
            "commit_files",
            json!({"branch": "fix/readme-typo", "files": ["docs/*.md"], "message": "All"}),
        ),
        (
            "create_branch",
            json!({"name": format!("airlock-changes/{key}/other")}),
        ),
    ] {
        let r = call(&client, tool, args.clone()).await.unwrap();
        let id = approval_in(&assert_refused(&r, Category::ApprovalRequired));
        d.airlock_ok(&["approvals", "approve", &id, "--by", "bob", "--yes"]);
        let r = call(&client, tool, args).await.unwrap();
        let text = assert_refused(&r, Category::InvalidRequest);
        assert!(
            text.starts_with("invalid request: invalid-request; "),
            "{text}"
        );
    }
    assert_eq!(sent(&d).len(), before_sent, "nothing was sent");
    assert_eq!(refs(repo), after_commit);
    client.cancel().await.unwrap();

    // Neither effect declares an undo: there is nothing to compensate.
    let id = completed(&d, "create_branch")["id"]
        .as_str()
        .unwrap()
        .to_string();
    let (ok, _, err) = compensate(&d, config, &id, "approve");
    assert!(!ok, "{err}");
    assert!(err.contains("declares no undo"), "{err}");
    assert!(!err.contains("apr_"), "no person was asked: {err}");
    assert_eq!(refs(repo), after_commit);
    d.airlock_ok(&["trace", "verify"]);
}

/// The answer to `git_commit` is lost after the server committed (the connection dies
/// with the request unanswered): the outcome is unknown, and the host asks the contract's
/// query (`committed`, which finds the commit carrying the intent's key in `git_log`)
/// instead of committing again: completed, committed once.
#[tokio::test]
async fn a_commit_whose_answer_is_lost_is_reconciled_through_the_log() {
    let dir = repository();
    let repo = dir.path();
    let start = git(repo, &["rev-parse", "main"]);
    let state = tempfile::tempdir().unwrap();
    let lost = state.path().join("lost");
    let d = lossy(repo, "git_commit", "Airlock-Idempotency-Key", &lost);
    let client = d.serve_unreviewed().await;

    std::fs::write(repo.join("README.md"), "# Project\n\nThe first line.\n").unwrap();
    let commit = json!({"branch": "main", "files": ["README.md"], "message": "Fix the typo"});
    let done = approved_call(&d, &client, "commit_files", commit).await;
    assert!(lost.exists(), "the answer was lost");
    let text = text_of(&done);
    assert!(text.starts_with("Reconciled (intent int_"), "{text}");
    let s = done.structured_content.clone().unwrap();
    assert_eq!(s["reconciled"]["method"], "query", "{s}");
    let head = git(repo, &["rev-parse", "main"]);
    assert_eq!(s["result"]["id"], head.as_str());
    assert_eq!(s["result"]["branch"], "main");
    assert_eq!(
        git(repo, &["rev-list", "--count", &format!("{start}..main")]),
        "1",
        "committed once, never again"
    );
    client.cancel().await.unwrap();
    let intent = completed(&d, "commit_files");
    assert!(
        git(repo, &["log", "-1", "--format=%B"]).ends_with(&format!(
            "Airlock-Idempotency-Key: {}",
            intent["idempotency_key"].as_str().unwrap()
        )),
        "the reconciled commit is the intent's"
    );
    d.airlock_ok(&["trace", "verify"]);
}

/// The answer to the branch's own `git_create_branch` is lost after the server created it:
/// the mapping keeps `create_branch` idempotent and not queryable, so the host sends it
/// again under the same key (retry by semantics); the adapter finds its record and the
/// branch, creates nothing twice, and answers the branch.
#[tokio::test]
async fn a_branch_whose_answer_is_lost_is_sent_again_and_created_once() {
    let dir = repository();
    let repo = dir.path();
    let start = git(repo, &["rev-parse", "main"]);
    let state = tempfile::tempdir().unwrap();
    let lost = state.path().join("lost");
    // The branch is created from the record; the record from the base.
    let d = lossy(
        repo,
        "git_create_branch",
        "base_branch\":\"airlock-changes/",
        &lost,
    );
    let client = d.serve_unreviewed().await;

    let done = approved_call(&d, &client, "create_branch", json!({"name": "feature"})).await;
    assert!(lost.exists(), "the answer was lost");
    let s = done.structured_content.clone().unwrap();
    assert_eq!(s["reconciled"]["method"], "retry", "{s}");
    assert_eq!(s["result"]["name"], "feature");
    assert_eq!(s["result"]["created-at"], start.as_str());
    assert_eq!(git(repo, &["rev-parse", "refs/heads/feature"]), start);
    let key = completed(&d, "create_branch")["idempotency_key"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        git(
            repo,
            &["for-each-ref", "--format=%(refname)", "refs/heads/"]
        ),
        format!("refs/heads/airlock-changes/{key}/feature\nrefs/heads/feature\nrefs/heads/main"),
        "the record and the branch, once"
    );
    client.cancel().await.unwrap();
    d.airlock_ok(&["trace", "verify"]);
}

/// The answer lost is the adapter's record, before the branch was created: the retry under
/// the same key finds the record without the branch and finishes it, from the record (the
/// commit the record captured), once.
#[tokio::test]
async fn a_branch_lost_before_it_landed_is_finished_by_the_retry() {
    let dir = repository();
    let repo = dir.path();
    let start = git(repo, &["rev-parse", "main"]);
    let state = tempfile::tempdir().unwrap();
    let lost = state.path().join("lost");
    let d = lossy(
        repo,
        "git_create_branch",
        "branch_name\":\"airlock-changes/",
        &lost,
    );
    let client = d.serve_unreviewed().await;

    let done = approved_call(&d, &client, "create_branch", json!({"name": "feature"})).await;
    assert!(lost.exists(), "the answer was lost");
    let s = done.structured_content.clone().unwrap();
    assert_eq!(s["reconciled"]["method"], "retry", "{s}");
    assert_eq!(s["result"]["created-at"], start.as_str());
    assert_eq!(
        git(
            repo,
            &["for-each-ref", "--format=%(refname)", "refs/heads/"]
        )
        .lines()
        .count(),
        3,
        "main, the record and the branch"
    );
    assert_eq!(git(repo, &["rev-parse", "refs/heads/feature"]), start);
    client.cancel().await.unwrap();
    d.airlock_ok(&["trace", "verify"]);
}
