//! `version-control`: the operator contract `example:version-control@1.0.0`
//! (`contracts/version-control/`, not built into Airlock) over the published git MCP
//! server, `mcp-server-git` (PyPI; pinned in `fixtures/python/requirements.txt`).
//!
//! The repository is the mapping's operator setting `repository` (read through
//! `airlock:host/settings@0.3.0`, so this component targets `airlock:host@0.3.0`); every
//! upstream request carries it as `repo_path`, and the server, started with
//! `--repository` naming the same folder, refuses any other.
//!
//! Upstream tools (the mapping lists exactly these), each answering text (a refusal is a
//! tool result with `isError`, `Error executing tool NAME: ` and the message):
//! - `git_branch {branch_type: "local"}` → `git branch`: one name a line, `* ` before the
//!   checked-out one (`* (HEAD detached at …)` when none is);
//! - `git_create_branch {branch_name, base_branch}` → `Created branch 'N' from 'B'`;
//!   refused when `refs/heads/N` exists;
//! - `git_show {revision}` → `commit <sha>`, author, date, the message indented by four
//!   spaces, then the diff;
//! - `git_log {max_count}` → `Commit history:` and per commit of the checked-out branch
//!   `Commit: <sha>`, `Author: …`, `Date: …`, `Message: <the whole message>`;
//! - `git_checkout {branch_name}` → `Switched to branch 'N'`;
//! - `git_status` → `Repository status:` and git's long status (English: the server gets
//!   no locale), whose `Changes to be committed:` section lists what is staged;
//! - `git_add {files}` → `Files staged successfully` (or `No changes were staged…`);
//! - `git_commit {message}` → `Changes committed successfully with hash <sha>`; refused
//!   when nothing is staged. It commits the whole index onto the checked-out branch.
//!
//! The server has no idempotency keys, no history of its own calls, and no tool that
//! deletes a branch or takes a commit back (`git_reset` only unstages). So the adapter
//! keeps its keys in the repository, in what these tools can write and read back:
//! - a **branch** it creates is preceded by a record branch
//!   `airlock-changes/<idempotency key>/<name>`, created from the base; the branch itself
//!   is then created from the record, so both point at the same commit. `create-branch`
//!   with a key already recorded creates nothing new (it only finishes the branch when the
//!   record exists without it); `branch-created(key)` finds the record with `git_branch`:
//!   record and branch → the branch, created at the record's commit; record alone → none
//!   (the creation never landed). Records stay: the server cannot delete them (a person
//!   may, with `git branch -D`, once the intent is settled);
//! - a **commit** it makes ends with the trailer `Airlock-Idempotency-Key: <key>`
//!   (`git_log` can only read the checked-out branch, and `git_show` one commit). `commit`
//!   looks for its key in the checked-out branch's last `LOG_DEPTH` commits and at the
//!   tip of the branch it commits onto, and answers the commit it finds instead of
//!   committing again; `committed(key)` looks in the same history and at the tips of every
//!   other local branch (`git_show`, at most `MAX_TIPS` of them, else it cannot say
//!   "none" and answers `unavailable`). Two commits carrying one key are a `conflict`.
//!
//! Requests are checked before anything is sent: names and paths by the rules in the WIT;
//! paths carry no pathspec magic (`:`, `*`, `?`, `[`), so `git add` stages exactly them (a
//! folder stands for the files under it); a message never holds the trailer or a line git
//! log's answer would read as another commit; names under `airlock-changes/` are the
//! adapter's. A commit is refused, before anything is staged, when anything else is
//! staged or a merge is in progress, so it records exactly the named files. A commit that
//! fails after staging leaves those files staged (the server's only unstage, `git_reset`,
//! would unstage everything, not just them).

use airlock_sdk::serde_json::{Value, json};
use airlock_sdk::{log, settings, upstream};

#[allow(missing_docs, clippy::all)]
mod bindings {
    wit_bindgen::generate!({
        path: "../../contracts/version-control",
        world: "example:version-control/version-control-adapter@1.0.0",
        with: {
            "airlock:host/upstream@0.1.0": airlock_sdk::bindings::airlock::host::upstream,
            "airlock:host/log@0.1.0": airlock_sdk::bindings::airlock::host::log,
            "airlock:host/context@0.2.0": airlock_sdk::bindings_host::airlock::host0_2_0::context,
            "airlock:host/settings@0.3.0": airlock_sdk::bindings_host_0_3_0::airlock::host0_3_0::settings,
        },
    });
}

use bindings::exports::example::version_control::version_control::{
    BranchCreatedRequest, BranchInfo, CommitInfo, CommitRequest, CommittedRequest, ContractError,
    CreateBranchRequest, Guest,
};

/// The record of the branch created under key `k` is named this prefix, `k`, `/` and the
/// branch's name.
const RECORD_PREFIX: &str = "airlock-changes/";

/// The trailer that carries a commit's idempotency key.
const TRAILER: &str = "Airlock-Idempotency-Key";

/// How many commits of the checked-out branch `git_log` is asked for.
const LOG_DEPTH: u32 = 100;

/// Most branch tips a lookup reads with `git_show`.
const MAX_TIPS: usize = 16;

/// Longest branch name (bytes).
const MAX_NAME_BYTES: usize = 128;

/// Longest idempotency key (bytes).
const MAX_KEY_BYTES: usize = 64;

/// Most files one commit names.
const MAX_FILES: usize = 256;

/// Longest path (bytes).
const MAX_PATH_BYTES: usize = 1024;

/// Longest commit message (bytes).
const MAX_MESSAGE_BYTES: usize = 16 * 1024;

/// The adapter; it keeps no state between calls (the repository holds the records).
struct VersionControl;

// ----- requests, checked before anything is sent -----

fn invalid(why: impl Into<String>) -> ContractError {
    ContractError::InvalidRequest(why.into())
}

/// `key`, when it is one the host issues (it names a record branch).
fn check_key(key: &str) -> Result<&str, ContractError> {
    let ok = !key.is_empty()
        && key.len() <= MAX_KEY_BYTES
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if ok {
        Ok(key)
    } else {
        Err(invalid("the idempotency key is not one the host issues"))
    }
}

/// Whether `name` is a branch name the adapter sends (a strict subset of git's).
fn is_branch_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_BYTES
        && name != "HEAD"
        && !name.contains("..")
        && !name.ends_with('.')
        && name.split('/').all(|part| {
            !part.is_empty()
                && !part.starts_with('.')
                && !part.starts_with('-')
                && !part.ends_with(".lock")
                && part
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        })
}

/// `name` (the request's field `what`), checked: a branch name the adapter sends that is
/// not one of its records.
fn check_branch(name: &str, what: &str) -> Result<(), ContractError> {
    if !is_branch_name(name) {
        return Err(invalid(format!(
            "{what} `{name}` is not a branch name this adapter accepts (ASCII letters, digits, `-`, `_`, `.` in `/`-separated parts; no part starting with `.` or `-` or ending with `.lock`; no `..`; at most {MAX_NAME_BYTES} bytes)"
        )));
    }
    if is_record(name) || name == RECORD_PREFIX.trim_end_matches('/') {
        return Err(invalid(format!(
            "{what} `{name}`: names under {RECORD_PREFIX} are the adapter's records"
        )));
    }
    Ok(())
}

fn is_record(name: &str) -> bool {
    name.starts_with(RECORD_PREFIX)
}

/// `path`, checked: relative to the repository, inside it, not under `.git`, printable
/// ASCII without quotes, backslashes or pathspec magic (so git neither quotes it in its
/// status nor reads it as a pattern).
fn check_path(path: &str) -> Result<(), ContractError> {
    let bad = path.is_empty()
        || path.len() > MAX_PATH_BYTES
        || path.starts_with('/')
        || path.starts_with(':')
        || path.starts_with(' ')
        || path.ends_with(' ')
        || path.contains(" -> ")
        || path
            .chars()
            .any(|c| !(' '..='~').contains(&c) || matches!(c, '"' | '\\' | '*' | '?' | '['))
        || path
            .split('/')
            .any(|part| part.is_empty() || part == "." || part == ".." || part == ".git");
    if bad {
        return Err(invalid(format!(
            "`{path}` is not a path this adapter accepts (relative to the repository, no `..` or `.git`, printable ASCII without `\"`, `\\`, `*`, `?`, `[`, not starting with `:`)"
        )));
    }
    Ok(())
}

/// The request's files, checked, each once (in the order asked).
fn check_files(files: &[String]) -> Result<Vec<String>, ContractError> {
    if files.is_empty() {
        return Err(invalid("name at least one file to commit"));
    }
    if files.len() > MAX_FILES {
        return Err(invalid(format!("at most {MAX_FILES} files per commit")));
    }
    let mut kept: Vec<String> = Vec::new();
    for f in files {
        check_path(f)?;
        if !kept.contains(f) {
            kept.push(f.clone());
        }
    }
    Ok(kept)
}

/// The trailer line that carries `key`.
fn trailer(key: &str) -> String {
    format!("{TRAILER}: {key}")
}

/// `message`, checked: some text, no control characters but newline and tab, no
/// trailer of the adapter's, no line `git_log`'s answer would read as another commit.
fn check_message(message: &str) -> Result<(), ContractError> {
    if message.trim().is_empty() {
        return Err(invalid("the commit message is empty"));
    }
    if message.len() > MAX_MESSAGE_BYTES {
        return Err(invalid(format!(
            "the commit message is longer than {MAX_MESSAGE_BYTES} bytes"
        )));
    }
    if message
        .chars()
        .any(|c| c.is_control() && c != '\n' && c != '\t')
    {
        return Err(invalid(
            "the commit message holds a control character (only newlines and tabs are kept)",
        ));
    }
    for line in message.lines() {
        let lower = line.trim_start().to_ascii_lowercase();
        if lower.starts_with(&TRAILER.to_ascii_lowercase()) {
            return Err(invalid(format!(
                "the commit message holds a `{TRAILER}` line: that trailer is the adapter's"
            )));
        }
        if log_header_sha(line).is_some() {
            return Err(invalid(
                "the commit message holds a line `Commit: <id>`, which the server's log would read as another commit",
            ));
        }
    }
    Ok(())
}

/// What the adapter sends as the commit's message: the request's, then the trailer.
fn with_trailer(message: &str, key: &str) -> String {
    format!("{}\n\n{}\n", message.trim_end(), trailer(key))
}

/// Whether a commit message ends a line with exactly the trailer of `key`.
fn carries_key<'a>(mut lines: impl Iterator<Item = &'a str>, key: &str) -> bool {
    let wanted = trailer(key);
    lines.any(|l| l.trim_end() == wanted)
}

// ----- the server's answers -----

fn is_sha(s: &str) -> bool {
    s.len() == 40
        && s.chars()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
}

/// The local branches `git_branch` listed.
#[derive(Debug, Default, PartialEq)]
struct Branches {
    /// The checked-out branch; `None` on a detached HEAD.
    current: Option<String>,
    /// Every local branch, records included, in the order listed.
    names: Vec<String>,
}

impl Branches {
    fn parse(text: &str) -> Self {
        let mut out = Branches::default();
        for line in text.lines() {
            let (mark, name) = match line.get(..2) {
                Some(m @ ("* " | "+ " | "  ")) => (m, line[2..].trim()),
                _ => (" ", line.trim()),
            };
            if name.is_empty() || name.starts_with('(') {
                continue;
            }
            // `name -> target` is a symbolic ref; its name alone is a branch.
            let name = name.split(" -> ").next().unwrap_or(name).to_owned();
            if mark == "* " {
                out.current = Some(name.clone());
            }
            out.names.push(name);
        }
        out
    }

    fn has(&self, name: &str) -> bool {
        self.names.iter().any(|n| n == name)
    }

    /// A branch that `name` cannot exist beside (one is a folder of the other).
    fn clash(&self, name: &str) -> Option<&str> {
        self.names
            .iter()
            .find(|n| {
                n.strip_prefix(name).is_some_and(|r| r.starts_with('/'))
                    || name
                        .strip_prefix(n.as_str())
                        .is_some_and(|r| r.starts_with('/'))
            })
            .map(String::as_str)
    }

    /// The records of key `key`: (record, branch name).
    fn records_of(&self, key: &str) -> Vec<(String, String)> {
        let prefix = format!("{RECORD_PREFIX}{key}/");
        self.names
            .iter()
            .filter_map(|n| Some((n.clone(), n.strip_prefix(&prefix)?.to_owned())))
            .collect()
    }

    /// Local branches that are not the adapter's records.
    fn ordinary(&self) -> impl Iterator<Item = &str> {
        self.names
            .iter()
            .map(String::as_str)
            .filter(|n| !is_record(n))
    }
}

/// The commit `git_show` showed: its id and its message's lines.
fn parse_show(text: &str) -> Option<(String, Vec<String>)> {
    let mut lines = text.lines();
    let sha = lines.next()?.strip_prefix("commit ")?.trim();
    if !is_sha(sha) {
        return None;
    }
    // Header lines up to the blank line, then the message, every line indented by four
    // spaces; the diff follows.
    let mut message = Vec::new();
    let mut in_message = false;
    for line in lines {
        if !in_message {
            in_message = line.is_empty();
            continue;
        }
        match line.strip_prefix("    ") {
            Some(l) => message.push(l.to_owned()),
            None => break,
        }
    }
    Some((sha.to_owned(), message))
}

/// The id in a `git_log` entry's first line, `Commit: <sha>`.
fn log_header_sha(line: &str) -> Option<&str> {
    line.trim_end()
        .strip_prefix("Commit: ")
        .filter(|sha| is_sha(sha))
}

/// The commits `git_log` listed: (id, message).
fn parse_log(text: &str) -> Vec<(String, String)> {
    let lines: Vec<&str> = text.lines().collect();
    let header = |i: usize| {
        let sha = log_header_sha(lines[i])?;
        let next = |k: usize, p: &str| lines.get(i + k).is_some_and(|l| l.starts_with(p));
        (next(1, "Author: ") && next(2, "Date: ") && next(3, "Message: ")).then_some(sha)
    };
    let starts: Vec<(usize, &str)> = (0..lines.len())
        .filter_map(|i| header(i).map(|sha| (i, sha)))
        .collect();
    starts
        .iter()
        .enumerate()
        .map(|(n, &(i, sha))| {
            let end = starts.get(n + 1).map_or(lines.len(), |&(j, _)| j);
            let mut message = vec![&lines[i + 3]["Message: ".len()..]];
            message.extend(&lines[i + 4..end]);
            (sha.to_owned(), message.join("\n"))
        })
        .collect()
}

/// What `git_status` says.
#[derive(Debug, Default, PartialEq)]
struct Status {
    /// `On branch <name>`; `None` otherwise (detached, mid-rebase).
    branch: Option<String>,
    /// The paths under `Changes to be committed:` (both sides of a rename).
    staged: Vec<String>,
    /// A merge is in progress or paths are unmerged.
    merging: bool,
}

impl Status {
    fn parse(text: &str) -> Result<Self, ContractError> {
        let body = text.strip_prefix("Repository status:\n").unwrap_or(text);
        let first = body.lines().next().unwrap_or_default();
        let known = [
            "On branch ",
            "HEAD detached ",
            "Not currently on any branch",
        ];
        if !known.iter().any(|k| first.starts_with(k)) && !first.contains("rebase in progress") {
            return Err(ContractError::UpstreamFailed(
                "git_status did not answer git's English status (the server must run without a locale)".into(),
            ));
        }
        let mut out = Status {
            branch: first
                .strip_prefix("On branch ")
                .map(|b| b.trim().to_owned()),
            ..Status::default()
        };
        let mut in_staged = false;
        for line in body.lines() {
            if line.starts_with("Unmerged paths:")
                || line.contains("still merging")
                || line.contains("You have unmerged paths")
            {
                out.merging = true;
            }
            if line == "Changes to be committed:" {
                in_staged = true;
                continue;
            }
            if !in_staged {
                continue;
            }
            if line.is_empty() {
                in_staged = false;
                continue;
            }
            let Some(entry) = line.strip_prefix('\t') else {
                continue; // "(use ... to unstage)"
            };
            let Some((_, path)) = entry.split_once(':') else {
                continue;
            };
            for p in path.trim().split(" -> ") {
                out.staged.push(p.to_owned());
            }
        }
        Ok(out)
    }
}

/// Whether staged path `staged` is one of `files` or under one of them.
fn covered(staged: &str, files: &[String]) -> bool {
    files.iter().any(|f| {
        staged == f
            || staged
                .strip_prefix(f.as_str())
                .is_some_and(|r| r.starts_with('/'))
    })
}

/// A tool's refusal without the SDK's `Error executing tool NAME: ` prefix.
fn refusal(message: &str) -> &str {
    match message.strip_prefix("Error executing tool ") {
        Some(rest) => rest.split_once(": ").map_or(rest, |(_, m)| m),
        None => message,
    }
}

// ----- the upstream -----

/// The repository: the mapping's `repository` setting.
struct Git {
    repo: String,
}

impl Git {
    fn open() -> Result<Self, ContractError> {
        let repo = settings::text("repository").map_err(ContractError::Unavailable)?;
        if !repo.starts_with('/') {
            return Err(ContractError::Unavailable(format!(
                "setting `repository` is `{repo}`, not an absolute path; fix the mapping's [settings]"
            )));
        }
        Ok(Git { repo })
    }

    /// Calls `tool` with `args` and the repository; a tool-reported failure is
    /// `Ok(Err(message))`.
    fn call(&self, tool: &str, mut args: Value) -> Result<Result<String, String>, ContractError> {
        args["repo_path"] = json!(self.repo);
        let output = upstream::call_tool_json(tool, &args)
            .map_err(|e| ContractError::Unavailable(e.describe()))?;
        Ok(match output.error_message() {
            Some(message) => Err(refusal(&message).to_owned()),
            None => Ok(output.text()),
        })
    }

    /// Like [`Git::call`], a refusal being `unavailable`.
    fn read(&self, tool: &str, args: Value) -> Result<String, ContractError> {
        self.call(tool, args)?.map_err(ContractError::Unavailable)
    }

    fn branches(&self) -> Result<Branches, ContractError> {
        Ok(Branches::parse(
            &self.read("git_branch", json!({"branch_type": "local"}))?,
        ))
    }

    /// The tip commit of branch `name`: its id and message lines.
    fn tip(&self, name: &str) -> Result<(String, Vec<String>), ContractError> {
        let text = self.read("git_show", json!({"revision": name}))?;
        parse_show(&text).ok_or_else(|| {
            ContractError::UpstreamFailed(format!("git_show of `{name}` shows no commit"))
        })
    }

    fn status(&self) -> Result<Status, ContractError> {
        Status::parse(&self.read("git_status", json!({}))?)
    }

    fn create_branch(&self, name: &str, base: &str) -> Result<(), ContractError> {
        let args = json!({"branch_name": name, "base_branch": base});
        match self.call("git_create_branch", args)? {
            Ok(text) if text.starts_with(&format!("Created branch '{name}'")) => Ok(()),
            Ok(text) => Err(ContractError::UpstreamFailed(format!(
                "git_create_branch answered `{text}`"
            ))),
            Err(m) if m.contains("already exists") => Err(ContractError::Conflict(m)),
            Err(m) if m.contains("No item found") => Err(ContractError::NotFound),
            Err(m) => Err(ContractError::Unavailable(m)),
        }
    }

    /// The commit carrying `key` among the checked-out branch's last `LOG_DEPTH`
    /// commits and the tips of `tips`; a conflict when two commits carry it.
    fn find_commit(
        &self,
        key: &str,
        branches: &Branches,
        tips: &[&str],
    ) -> Result<Option<CommitInfo>, ContractError> {
        let mut found: Vec<CommitInfo> = Vec::new();
        let add = |found: &mut Vec<CommitInfo>, id: String, branch: String| {
            if !found.iter().any(|f| f.id == id) {
                found.push(CommitInfo { id, branch });
            }
        };
        let history = self.read("git_log", json!({"max_count": LOG_DEPTH}))?;
        for (id, message) in parse_log(&history) {
            if carries_key(message.lines(), key) {
                let branch = match &branches.current {
                    Some(b) => b.clone(),
                    None => self.holder(&id)?,
                };
                add(&mut found, id, branch);
            }
        }
        if found.is_empty() {
            for &branch in tips {
                let (id, message) = self.tip(branch)?;
                if carries_key(message.iter().map(String::as_str), key) {
                    add(&mut found, id, branch.to_owned());
                }
            }
        }
        match found.len() {
            0 | 1 => Ok(found.pop()),
            _ => Err(ContractError::Conflict(format!(
                "{} commits carry the trailer of key {key}",
                found.len()
            ))),
        }
    }

    /// A local branch holding commit `id` (found on a detached HEAD).
    fn holder(&self, id: &str) -> Result<String, ContractError> {
        let text = self.read(
            "git_branch",
            json!({"branch_type": "local", "contains": id}),
        )?;
        Branches::parse(&text)
            .ordinary()
            .next()
            .map(str::to_owned)
            .ok_or_else(|| ContractError::Conflict(format!("commit {id} is on no local branch")))
    }
}

// ----- the contract -----

impl Guest for VersionControl {
    fn create_branch(request: CreateBranchRequest) -> Result<BranchInfo, ContractError> {
        let key = check_key(&request.idempotency_key)?;
        let name = request.name;
        check_branch(&name, "name")?;
        if let Some(base) = &request.base {
            check_branch(base, "base")?;
        }
        let git = Git::open()?;
        let branches = git.branches()?;
        if let Some((record, recorded)) = one_record(&branches, key)? {
            if recorded != name {
                return Err(ContractError::Conflict(format!(
                    "key {key} already created branch `{recorded}`"
                )));
            }
            let (created_at, _) = git.tip(&record)?;
            if branches.has(&name) {
                log::info(&format!(
                    "create-branch {key}: `{name}` already created, nothing created again"
                ));
            } else {
                // The record landed and the branch did not: finish what was started.
                git.create_branch(&name, &record)?;
            }
            return Ok(BranchInfo { name, created_at });
        }
        if branches.has(&name) {
            return Err(ContractError::Conflict(format!(
                "a branch named `{name}` exists already"
            )));
        }
        if let Some(other) = branches.clash(&name) {
            return Err(ContractError::Conflict(format!(
                "`{name}` cannot exist beside branch `{other}` (one would be a folder of the other)"
            )));
        }
        let base = match request.base {
            Some(base) if branches.has(&base) => base,
            Some(_) => return Err(ContractError::NotFound),
            None => branches.current.clone().ok_or_else(|| {
                ContractError::Conflict("HEAD is detached: name the base branch".into())
            })?,
        };
        let record = format!("{RECORD_PREFIX}{key}/{name}");
        git.create_branch(&record, &base)?;
        let (created_at, _) = git.tip(&record)?;
        git.create_branch(&name, &record)?;
        Ok(BranchInfo { name, created_at })
    }

    fn branch_created(request: BranchCreatedRequest) -> Result<Option<BranchInfo>, ContractError> {
        let key = check_key(&request.idempotency_key)?;
        let git = Git::open()?;
        let branches = git.branches()?;
        let Some((record, name)) = one_record(&branches, key)? else {
            return Ok(None);
        };
        if !branches.has(&name) {
            return Ok(None);
        }
        let (created_at, _) = git.tip(&record)?;
        Ok(Some(BranchInfo { name, created_at }))
    }

    fn commit(request: CommitRequest) -> Result<CommitInfo, ContractError> {
        let key = check_key(&request.idempotency_key)?;
        let branch = request.branch;
        check_branch(&branch, "branch")?;
        let files = check_files(&request.files)?;
        check_message(&request.message)?;
        let git = Git::open()?;
        let branches = git.branches()?;
        if !branches.has(&branch) {
            return Err(ContractError::NotFound);
        }
        let elsewhere = branches.current.as_deref() != Some(branch.as_str());
        let tips: &[&str] = if elsewhere { &[branch.as_str()] } else { &[] };
        if let Some(done) = git.find_commit(key, &branches, tips)? {
            log::info(&format!(
                "commit {key}: already committed as {}, nothing committed again",
                done.id
            ));
            return Ok(done);
        }
        if elsewhere {
            match git.call("git_checkout", json!({"branch_name": branch}))? {
                Ok(_) => {}
                Err(m) if m.contains("would be overwritten") => {
                    return Err(ContractError::Conflict(m));
                }
                Err(m) => return Err(ContractError::Unavailable(m)),
            }
        }
        let before = git.status()?;
        check_state(&before, &branch)?;
        let others: Vec<&str> = before
            .staged
            .iter()
            .filter(|p| !covered(p, &files))
            .map(String::as_str)
            .collect();
        if !others.is_empty() {
            return Err(ContractError::Conflict(format!(
                "other changes are staged ({}); this commit would record them too",
                others.join(", ")
            )));
        }
        match git.call("git_add", json!({"files": files}))? {
            Ok(_) => {}
            Err(m) if m.contains("did not match any files") => return Err(ContractError::NotFound),
            Err(m) if m.contains("outside the repository") || m.contains("ignored") => {
                return Err(invalid(m));
            }
            Err(m) => return Err(ContractError::Unavailable(m)),
        }
        let after = git.status()?;
        check_state(&after, &branch)?;
        if after.staged.is_empty() {
            return Err(ContractError::Conflict(
                "nothing to commit: none of the files has changes".into(),
            ));
        }
        if let Some(other) = after.staged.iter().find(|p| !covered(p, &files)) {
            return Err(ContractError::Conflict(format!(
                "`{other}` was staged meanwhile; this commit would record it too"
            )));
        }
        let message = with_trailer(&request.message, key);
        match git.call("git_commit", json!({"message": message}))? {
            Ok(text) => {
                let id = text
                    .lines()
                    .next()
                    .and_then(|l| l.strip_prefix("Changes committed successfully with hash "))
                    .map(str::trim)
                    .filter(|id| is_sha(id))
                    .ok_or_else(|| {
                        ContractError::UpstreamFailed(format!("git_commit answered `{text}`"))
                    })?;
                Ok(CommitInfo {
                    id: id.to_owned(),
                    branch,
                })
            }
            Err(m) if m.contains("No changes staged") => Err(ContractError::Conflict(
                "nothing to commit: none of the files has changes".into(),
            )),
            Err(m) => Err(ContractError::Unavailable(m)),
        }
    }

    fn committed(request: CommittedRequest) -> Result<Option<CommitInfo>, ContractError> {
        let key = check_key(&request.idempotency_key)?;
        let git = Git::open()?;
        let branches = git.branches()?;
        let tips: Vec<&str> = branches
            .ordinary()
            .filter(|b| Some(*b) != branches.current.as_deref())
            .collect();
        if tips.len() > MAX_TIPS {
            // Only the checked-out branch's history can be read in full; without every
            // tip, "none" would be a guess.
            return match git.find_commit(key, &branches, &[])? {
                Some(found) => Ok(Some(found)),
                None => Err(ContractError::Unavailable(format!(
                    "no commit of the checked-out branch carries key {key}, and the {} other branches are more than the {MAX_TIPS} this adapter reads",
                    tips.len()
                ))),
            };
        }
        git.find_commit(key, &branches, &tips)
    }
}

/// The record of `key`, if any: (record, branch name); a conflict when there are several.
fn one_record(branches: &Branches, key: &str) -> Result<Option<(String, String)>, ContractError> {
    let mut records = branches.records_of(key);
    if records.len() > 1 {
        return Err(ContractError::Conflict(format!(
            "{} records of key {key}",
            records.len()
        )));
    }
    Ok(records.pop())
}

/// The repository is on `branch`, with no merge in progress.
fn check_state(status: &Status, branch: &str) -> Result<(), ContractError> {
    if status.merging {
        return Err(ContractError::Conflict(
            "a merge is in progress; a commit would conclude it".into(),
        ));
    }
    if status.branch.as_deref() != Some(branch) {
        return Err(ContractError::Conflict(format!(
            "`{branch}` is not checked out (git status: {})",
            status.branch.as_deref().unwrap_or("no branch")
        )));
    }
    Ok(())
}

// The component's exports; a native build (`cargo test --workspace`) only checks the
// functions exist, as the SDK's export macros do (a native cdylib cannot carry WIT names).
#[cfg(target_arch = "wasm32")]
bindings::export!(VersionControl with_types_in bindings);

#[cfg(not(target_arch = "wasm32"))]
const _: () = {
    let _ = <VersionControl as Guest>::create_branch;
    let _ = <VersionControl as Guest>::branch_created;
    let _ = <VersionControl as Guest>::commit;
    let _ = <VersionControl as Guest>::committed;
};

#[cfg(test)]
mod tests;
