//! Native tests of the adapter's pure logic and of each function against canned answers
//! of the server (texts copied from `mcp-server-git` 2026.10.19), with the mapping's
//! `[settings]` answered by the SDK's test kit.

use super::*;
use airlock_sdk::testing::{Reply, Upstream};

const REPO: &str = "/srv/repositories/project";
const KEY: &str = "idk_0123456789abcdef";
const BASE: &str = "cdb2a50acbb3f4255a2eadf40f825c8fac898ce7";
const MADE: &str = "fd4411c0a6253afafc80392ad9c95690dd5fa2fd";

/// The kit with the mapping's tools and settings.
fn kit() -> Upstream {
    Upstream::from_mapping("mapping.toml")
}

fn args(mut a: Value) -> Value {
    a["repo_path"] = json!(REPO);
    a
}

fn local() -> Value {
    args(json!({"branch_type": "local"}))
}

/// `git_show` of a commit (the server's layout).
fn show(sha: &str, message: &str) -> String {
    let indented: String = message
        .trim_end_matches('\n')
        .split('\n')
        .map(|l| format!("    {l}\n"))
        .collect();
    format!(
        "commit {sha}\nAuthor: T <t@e>\nDate:   2026-12-07 11:40:37 +0000\n\n{indented}\n--- a/a.txt\n+++ b/a.txt\n@@ -1 +1,2 @@\n hi\n+x\n"
    )
}

/// `git_log` of commits (id, message), newest first.
fn log_of(commits: &[(&str, &str)]) -> String {
    let entries: Vec<String> = commits
        .iter()
        .map(|(sha, m)| {
            format!("Commit: {sha}\nAuthor: T\nDate: 2026-12-07 11:40:42+00:00\nMessage: {m}\n")
        })
        .collect();
    format!("Commit history:\n{}", entries.join("\n"))
}

fn tools(kit: &airlock_sdk::testing::Installed) -> Vec<String> {
    kit.calls().iter().map(|c| c.tool.clone()).collect()
}

fn create(name: &str, base: Option<&str>) -> CreateBranchRequest {
    CreateBranchRequest {
        name: name.into(),
        base: base.map(str::to_owned),
        idempotency_key: KEY.into(),
    }
}

fn commit_request(branch: &str, files: &[&str], message: &str) -> CommitRequest {
    CommitRequest {
        branch: branch.into(),
        files: files.iter().map(|f| f.to_string()).collect(),
        message: message.into(),
        idempotency_key: KEY.into(),
    }
}

#[test]
fn branch_names_are_a_strict_subset_of_gits_and_never_a_record() {
    for good in ["main", "fix/readme-typo", "release-1.2", "a_b/c.d"] {
        assert!(check_branch(good, "name").is_ok(), "{good}");
    }
    let long = "b".repeat(MAX_NAME_BYTES + 1);
    for bad in [
        "",
        "HEAD",
        "-f",
        "a/-b",
        ".hidden",
        "a/.b",
        "a..b",
        "a.",
        "x.lock",
        "a//b",
        "/a",
        "a/",
        "a b",
        "a~1",
        "a^",
        "a:b",
        "a@{0}",
        "a*",
        "a\\b",
        "é",
        "airlock-changes",
        "airlock-changes/idk_1/x",
        long.as_str(),
    ] {
        assert!(
            matches!(
                check_branch(bad, "name"),
                Err(ContractError::InvalidRequest(_))
            ),
            "{bad:?}"
        );
    }
}

#[test]
fn paths_stay_inside_the_repository_and_carry_no_pathspec_magic() {
    for good in ["a.txt", "src/lib.rs", "b c.txt", "docs"] {
        assert!(check_path(good).is_ok(), "{good}");
    }
    for bad in [
        "",
        "/etc/passwd",
        "../x",
        "a/../../x",
        "a//b",
        "./a",
        "a/",
        ".git/config",
        "x/.git/hooks",
        ":/",
        ":(exclude)a",
        "*.txt",
        "a?",
        "[ab]",
        "a\\b",
        "say\"hi\"",
        "tab\there",
        "café.md",
        " lead",
        "trail ",
        "a -> b",
    ] {
        assert!(
            matches!(check_path(bad), Err(ContractError::InvalidRequest(_))),
            "{bad:?}"
        );
    }
    assert_eq!(
        check_files(&["a".into(), "b".into(), "a".into()]).unwrap(),
        ["a", "b"]
    );
    assert!(check_files(&[]).is_err());
    let many: Vec<String> = (0..=MAX_FILES).map(|i| format!("f{i}")).collect();
    assert!(check_files(&many).is_err());
}

#[test]
fn a_message_never_forges_the_trailer_or_a_log_entry() {
    assert!(check_message("Fix the typo\n\nIn the README.\n").is_ok());
    for bad in [
        "",
        "  \n ",
        "Fix\n\nAirlock-Idempotency-Key: idk_x",
        "Fix\n  airlock-idempotency-key: idk_x",
        &format!("Fix\nCommit: {BASE}\nAuthor: x"),
        "Fix\r\nmore",
        "bell\u{7}",
        &"m".repeat(MAX_MESSAGE_BYTES + 1),
    ] {
        assert!(
            matches!(check_message(bad), Err(ContractError::InvalidRequest(_))),
            "{bad:?}"
        );
    }
    let sent = with_trailer("Fix the typo\n\n", KEY);
    assert_eq!(
        sent,
        format!("Fix the typo\n\nAirlock-Idempotency-Key: {KEY}\n")
    );
    assert!(carries_key(sent.lines(), KEY));
    assert!(!carries_key(sent.lines(), "idk_0123"), "the whole key");
    assert!(check_key("idk_0123456789abcdef").is_ok());
    for bad in ["", "../x", "a/b", "a b", &"k".repeat(MAX_KEY_BYTES + 1)] {
        assert!(check_key(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn the_servers_texts_parse() {
    let b = Branches::parse("  airlock-changes/idk_1/feature/x\n  feature/x\n* main\n+ other");
    assert_eq!(b.current.as_deref(), Some("main"));
    assert_eq!(
        b.names,
        [
            "airlock-changes/idk_1/feature/x",
            "feature/x",
            "main",
            "other"
        ]
    );
    assert_eq!(
        b.records_of("idk_1"),
        [(
            "airlock-changes/idk_1/feature/x".to_string(),
            "feature/x".to_string()
        )]
    );
    assert!(b.records_of("idk_").is_empty(), "a key is matched whole");
    assert_eq!(
        b.ordinary().collect::<Vec<_>>(),
        ["feature/x", "main", "other"]
    );
    assert_eq!(b.clash("feature"), Some("feature/x"));
    assert_eq!(b.clash("main/x"), Some("main"));
    assert_eq!(b.clash("feature/y"), None);
    assert_eq!(b.clash("mainline"), None);
    let detached = Branches::parse("* (HEAD detached at fd4411c)\n  main");
    assert_eq!(detached.current, None);
    assert_eq!(detached.names, ["main"]);

    let (sha, message) = parse_show(&show(MADE, "Fix a\n\nbody\n")).unwrap();
    assert_eq!(sha, MADE);
    assert_eq!(message, ["Fix a", "", "body"]);
    assert_eq!(parse_show("not a commit"), None);

    let log = log_of(&[
        (MADE, "Fix a\n\nAirlock-Idempotency-Key: idk_abc\n\n"),
        (BASE, "add a\n"),
    ]);
    let entries = parse_log(&log);
    assert_eq!(entries.len(), 2);
    assert_eq!(entries[0].0, MADE);
    assert!(carries_key(entries[0].1.lines(), "idk_abc"));
    assert_eq!(entries[1].0, BASE);
    assert!(!carries_key(entries[1].1.lines(), "idk_abc"));

    let status = Status::parse("Repository status:\nOn branch feature/x\nChanges to be committed:\n  (use \"git restore --staged <file>...\" to unstage)\n\tmodified:   a.txt\n\tnew file:   b c.txt\n\trenamed:    old.md -> new.md\n\nChanges not staged for commit:\n\tmodified:   c.txt\n\nUntracked files:\n\td.txt\n").unwrap();
    assert_eq!(status.branch.as_deref(), Some("feature/x"));
    assert_eq!(status.staged, ["a.txt", "b c.txt", "old.md", "new.md"]);
    assert!(!status.merging);
    let merging = Status::parse("Repository status:\nOn branch main\nAll conflicts fixed but you are still merging.\n  (use \"git commit\" to conclude merge)\n").unwrap();
    assert!(merging.merging);
    let detached =
        Status::parse("Repository status:\nHEAD detached at fd4411c\nnothing to commit").unwrap();
    assert_eq!(detached.branch, None);
    assert!(matches!(
        Status::parse("Repository status:\nAuf Branch main\n"),
        Err(ContractError::UpstreamFailed(_))
    ));
    assert!(covered("docs/a.md", &["docs".into()]));
    assert!(!covered("docsx/a.md", &["docs".into()]));
    assert_eq!(
        refusal(
            "Error executing tool git_create_branch: Cannot create branch 'x': refs/heads/x already exists"
        ),
        "Cannot create branch 'x': refs/heads/x already exists"
    );
}

#[test]
fn a_branch_is_recorded_then_created_from_its_record() {
    let record = format!("airlock-changes/{KEY}/fix/typo");
    let kit = kit()
        .reply_to("git_branch", local(), Reply::text("  feature\n* main"))
        .reply_to(
            "git_create_branch",
            args(json!({"branch_name": record, "base_branch": "main"})),
            Reply::text(format!("Created branch '{record}' from 'main'")),
        )
        .reply_to(
            "git_show",
            args(json!({"revision": record})),
            Reply::text(show(BASE, "add a")),
        )
        .reply_to(
            "git_create_branch",
            args(json!({"branch_name": "fix/typo", "base_branch": record})),
            Reply::text(format!("Created branch 'fix/typo' from '{record}'")),
        )
        .install();
    let made = VersionControl::create_branch(create("fix/typo", None)).unwrap();
    assert_eq!(made.name, "fix/typo");
    assert_eq!(made.created_at, BASE);
    assert_eq!(
        tools(&kit),
        [
            "git_branch",
            "git_create_branch",
            "git_show",
            "git_create_branch"
        ]
    );
    assert!(
        kit.calls().iter().all(|c| c.arguments["repo_path"] == REPO),
        "the repository is the operator's setting"
    );
}

#[test]
fn a_branch_already_made_under_the_key_is_not_made_again() {
    let record = format!("airlock-changes/{KEY}/fix/typo");
    let kit = kit()
        .reply_to(
            "git_branch",
            local(),
            Reply::text(format!("  {record}\n  fix/typo\n* main")),
        )
        .reply_to(
            "git_show",
            args(json!({"revision": record})),
            Reply::text(show(BASE, "add a")),
        )
        .install();
    let again = VersionControl::create_branch(create("fix/typo", None)).unwrap();
    assert_eq!(again.created_at, BASE);
    assert_eq!(tools(&kit), ["git_branch", "git_show"], "nothing created");
    let found = VersionControl::branch_created(BranchCreatedRequest {
        idempotency_key: KEY.into(),
    })
    .unwrap()
    .unwrap();
    assert_eq!(
        (found.name.as_str(), found.created_at.as_str()),
        ("fix/typo", BASE)
    );
    // Another name under the same key is not this call's.
    assert!(matches!(
        VersionControl::create_branch(create("other", None)),
        Err(ContractError::Conflict(_))
    ));
}

#[test]
fn a_record_without_its_branch_is_nothing_done_and_a_repeat_finishes_it() {
    let record = format!("airlock-changes/{KEY}/fix/typo");
    let kit = kit()
        .reply_to(
            "git_branch",
            local(),
            Reply::text(format!("  {record}\n* main")),
        )
        .reply_to(
            "git_show",
            args(json!({"revision": record})),
            Reply::text(show(BASE, "add a")),
        )
        .reply_to(
            "git_create_branch",
            args(json!({"branch_name": "fix/typo", "base_branch": record})),
            Reply::text(format!("Created branch 'fix/typo' from '{record}'")),
        )
        .install();
    let none = VersionControl::branch_created(BranchCreatedRequest {
        idempotency_key: KEY.into(),
    })
    .unwrap();
    assert!(none.is_none());
    let made = VersionControl::create_branch(create("fix/typo", None)).unwrap();
    assert_eq!(made.created_at, BASE);
    assert_eq!(
        tools(&kit),
        ["git_branch", "git_branch", "git_show", "git_create_branch"]
    );
}

#[test]
fn an_existing_or_clashing_branch_or_unknown_base_is_refused_before_anything_is_created() {
    let kit = kit()
        .reply_to("git_branch", local(), Reply::text("  fix/typo\n* main"))
        .install();
    assert!(matches!(
        VersionControl::create_branch(create("fix/typo", None)),
        Err(ContractError::Conflict(m)) if m.contains("exists already")
    ));
    assert!(matches!(
        VersionControl::create_branch(create("fix", None)),
        Err(ContractError::Conflict(_))
    ));
    assert!(matches!(
        VersionControl::create_branch(create("new", Some("nope"))),
        Err(ContractError::NotFound)
    ));
    assert!(matches!(
        VersionControl::create_branch(create("airlock-changes/x", None)),
        Err(ContractError::InvalidRequest(_))
    ));
    assert!(
        tools(&kit).iter().all(|t| t == "git_branch"),
        "only reads: {:?}",
        tools(&kit)
    );
}

#[test]
fn a_missing_repository_setting_is_the_operators_to_fix() {
    let _kit = Upstream::new().install();
    match VersionControl::create_branch(create("x", None)) {
        Err(ContractError::Unavailable(m)) => assert!(m.contains("repository"), "{m}"),
        other => panic!("{other:?}"),
    }
}

fn status(branch: &str, staged: &[&str]) -> Reply {
    let lines: String = staged
        .iter()
        .map(|p| format!("\tmodified:   {p}\n"))
        .collect();
    Reply::text(format!(
        "Repository status:\nOn branch {branch}\nChanges to be committed:\n  (use \"git restore --staged <file>...\" to unstage)\n{lines}\nUntracked files:\n\tnotes.txt\n"
    ))
}

#[test]
fn a_commit_checks_out_its_branch_stages_the_files_and_carries_the_key() {
    let message = with_trailer("Fix the typo", KEY);
    let kit = kit()
        .reply_to("git_branch", local(), Reply::text("  fix/typo\n* main"))
        .reply_to(
            "git_log",
            args(json!({"max_count": LOG_DEPTH})),
            Reply::text(log_of(&[(BASE, "add a\n")])),
        )
        .reply_to(
            "git_show",
            args(json!({"revision": "fix/typo"})),
            Reply::text(show(BASE, "add a")),
        )
        .reply_to(
            "git_checkout",
            args(json!({"branch_name": "fix/typo"})),
            Reply::text("Switched to branch 'fix/typo'"),
        )
        .reply("git_status", status("fix/typo", &["docs/a.md"]))
        .reply_to(
            "git_add",
            args(json!({"files": ["docs", "README.md"]})),
            Reply::text("Files staged successfully"),
        )
        .reply_to(
            "git_commit",
            args(json!({"message": message})),
            Reply::text(format!("Changes committed successfully with hash {MADE}")),
        )
        .install();
    let done = VersionControl::commit(commit_request(
        "fix/typo",
        &["docs", "README.md", "docs"],
        "Fix the typo",
    ))
    .unwrap();
    assert_eq!((done.id.as_str(), done.branch.as_str()), (MADE, "fix/typo"));
    assert_eq!(
        tools(&kit),
        [
            "git_branch",
            "git_log",
            "git_show",
            "git_checkout",
            "git_status",
            "git_add",
            "git_status",
            "git_commit"
        ]
    );
}

#[test]
fn other_staged_changes_refuse_a_commit_before_anything_is_staged() {
    let kit = kit()
        .reply_to("git_branch", local(), Reply::text("* main"))
        .reply("git_log", Reply::text(log_of(&[(BASE, "add a\n")])))
        .reply("git_status", status("main", &["a.txt", "secret.env"]))
        .install();
    match VersionControl::commit(commit_request("main", &["a.txt"], "Fix")) {
        Err(ContractError::Conflict(m)) => assert!(m.contains("secret.env"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(tools(&kit), ["git_branch", "git_log", "git_status"]);
    assert!(matches!(
        VersionControl::commit(commit_request("nope", &["a.txt"], "Fix")),
        Err(ContractError::NotFound)
    ));
}

#[test]
fn a_commit_made_under_the_key_is_found_and_not_made_again() {
    let carried = format!("Fix the typo\n\nAirlock-Idempotency-Key: {KEY}\n\n");
    let kit = kit()
        .reply_to("git_branch", local(), Reply::text("  other\n* fix/typo"))
        .reply(
            "git_log",
            Reply::text(log_of(&[(MADE, &carried), (BASE, "add a\n")])),
        )
        .install();
    let again =
        VersionControl::commit(commit_request("fix/typo", &["a.txt"], "Fix the typo")).unwrap();
    assert_eq!(
        (again.id.as_str(), again.branch.as_str()),
        (MADE, "fix/typo")
    );
    let found = VersionControl::committed(CommittedRequest {
        idempotency_key: KEY.into(),
    })
    .unwrap()
    .unwrap();
    assert_eq!(found.id, MADE);
    assert_eq!(
        tools(&kit),
        ["git_branch", "git_log", "git_branch", "git_log"],
        "reads only"
    );
}

#[test]
fn the_query_reads_other_branch_tips_before_it_says_none() {
    let carried = format!("Fix\n\nAirlock-Idempotency-Key: {KEY}\n");
    let kit = kit()
        .reply_to(
            "git_branch",
            local(),
            Reply::text(format!("  airlock-changes/{KEY}/x\n  fix/typo\n* main")),
        )
        .reply("git_log", Reply::text(log_of(&[(BASE, "add a\n")])))
        .reply_to(
            "git_show",
            args(json!({"revision": "fix/typo"})),
            Reply::text(show(MADE, &carried)),
        )
        .install();
    let found = VersionControl::committed(CommittedRequest {
        idempotency_key: KEY.into(),
    })
    .unwrap()
    .unwrap();
    assert_eq!(
        (found.id.as_str(), found.branch.as_str()),
        (MADE, "fix/typo")
    );
    assert_eq!(
        tools(&kit),
        ["git_branch", "git_log", "git_show"],
        "records are not read"
    );
    let none = VersionControl::committed(CommittedRequest {
        idempotency_key: "idk_other".into(),
    })
    .unwrap();
    assert!(none.is_none());
}
