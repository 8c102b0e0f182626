//! `workspace-edits`: the operator contract `example:workspace-edits@1.1.0`
//! (`contracts/workspace-edits-1.1/`, not built into Airlock) over the reference filesystem
//! MCP server, `@modelcontextprotocol/server-filesystem`. 1.1.0 only adds `edit` to 1.0.0,
//! so this component also serves a mapping bound to 1.0.0 (`contracts/workspace-edits/`).
//!
//! Upstream tools (the mapping lists exactly these): `list_allowed_directories` (the first
//! allowed directory is the workspace), `read_text_file {path}`, `write_file {path,
//! content}`, `edit_file {path, edits: [{oldText, newText}]}`, `create_directory {path}`.
//! The server answers in text; a refusal is a tool result with `isError` and Node's error
//! text (`ENOENT: …`).
//!
//! The server has no idempotency keys and no history, so the adapter keeps both in the
//! workspace, through the same tools: before it writes a file it records the change
//! under `.airlock-changes/<key>.json` (the path, the text before, the digests before and
//! after). Then:
//! - `write` with a key already recorded writes nothing and answers the recorded change
//!   (a repeat under the same key writes nothing twice);
//! - `written(key)` (reconciliation) reads the record and the file: the file has the
//!   written digest → the change; it still has the digest before → none (the write never
//!   landed); anything else → `conflict`;
//! - `edit` is a `write` whose text the adapter computes before it sends anything: the
//!   file's text with each `old-text` replaced, and the record carries that text's digest.
//!   `edit_file` replaces the *first* occurrence of an old text and, when there is none,
//!   falls back to a match that ignores each line's surrounding whitespace and re-indents
//!   the new text: what it writes is then not a function of the request a person approved.
//!   So the adapter sends only edits that match exactly once, where the server's first,
//!   exact path applies and its result is the adapter's; it normalizes `\r\n` to `\n` as
//!   the server does.
//! - `restore(change)` puts the text before back, refused as `conflict` when the file no
//!   longer has the written digest (restoring would lose what changed since), and as
//!   `invalid-request` when the file did not exist before (this server cannot delete).
//!
//! Locators: a `change-ref` is the key of the call that made the change. Paths are
//! relative to the workspace; `..`, absolute paths and the record folder are refused.

use airlock_sdk::{log, upstream};
use serde::{Deserialize, Serialize};
use sha2::Digest as _;

#[allow(missing_docs, clippy::all)]
mod bindings {
    wit_bindgen::generate!({
        path: "../../contracts/workspace-edits-1.1",
        world: "example:workspace-edits/workspace-edits-adapter@1.1.0",
        with: {
            "airlock:host/upstream@0.1.0": airlock_sdk::bindings::airlock::host::upstream,
            "airlock:host/log@0.1.0": airlock_sdk::bindings::airlock::host::log,
        },
    });
}

use bindings::exports::example::workspace_edits::workspace_edits::{
    Change, ContractError, EditRequest, Guest, RestoreRequest, TextEdit, WriteRequest,
    WrittenRequest,
};

/// The folder, inside the workspace, where the adapter records each change.
const RECORDS: &str = ".airlock-changes";

/// Longest file the adapter reads, writes or restores (bytes). The mapping's
/// `max_output_bytes` (8 MiB) holds a `read_text_file` answer of a file this long even when
/// every character needs a six-byte JSON escape, in both copies the server sends (text and
/// `structuredContent`); a longer file is refused before anything is recorded. (A file
/// whose answer exceeds the budget is discarded unread by the host, which then cannot know
/// that nothing was sent, and reports the effect's outcome as unknown.)
const MAX_FILE_BYTES: usize = 512 << 10;

/// `invalid-request` when `text` (the file before the change) is longer than
/// [`MAX_FILE_BYTES`].
fn small_enough(path: &str, text: Option<&str>) -> Result<(), ContractError> {
    match text {
        Some(t) if t.len() > MAX_FILE_BYTES => Err(ContractError::InvalidRequest(format!(
            "`{path}` is larger than {MAX_FILE_BYTES} bytes; this adapter changes smaller files only"
        ))),
        _ => Ok(()),
    }
}

/// The adapter; it keeps no state between calls (the workspace holds the records).
struct WorkspaceEdits;

/// What the adapter records before a write.
#[derive(Serialize, Deserialize, Clone)]
struct Record {
    path: String,
    before: Option<String>,
    before_sha256: Option<String>,
    after_sha256: String,
    bytes: u64,
}

impl Record {
    fn change(&self, key: &str) -> Change {
        Change {
            change: key.to_owned(),
            path: self.path.clone(),
            before_sha256: self.before_sha256.clone(),
            after_sha256: self.after_sha256.clone(),
            bytes: self.bytes,
        }
    }
}

fn sha256(text: &str) -> String {
    hex::encode(sha2::Sha256::digest(text.as_bytes()))
}

fn unavailable(e: upstream::UpstreamError) -> ContractError {
    ContractError::Unavailable(e.describe())
}

/// Calls `tool` with `args`; a tool-reported failure is `Err(Some(message))`.
fn call(tool: &str, args: &serde_json::Value) -> Result<String, Result<String, ContractError>> {
    let output = upstream::call_tool_json(tool, args).map_err(|e| Err(unavailable(e)))?;
    match output.error_message() {
        Some(message) => Err(Ok(message)),
        None => Ok(output.text()),
    }
}

/// The workspace: the first directory the server allows.
fn workspace() -> Result<String, ContractError> {
    let text = call("list_allowed_directories", &serde_json::json!({})).map_err(|e| match e {
        Ok(message) => ContractError::Unavailable(message),
        Err(e) => e,
    })?;
    text.lines()
        .map(str::trim)
        .find(|l| l.starts_with('/'))
        .map(|l| l.trim_end_matches('/').to_owned())
        .filter(|l| !l.is_empty())
        .ok_or_else(|| {
            ContractError::UpstreamFailed("the server reports no allowed directory".into())
        })
}

/// `path` checked to stay inside the workspace, joined to it.
fn inside(root: &str, path: &str) -> Result<String, ContractError> {
    let bad = path.is_empty()
        || path.starts_with('/')
        || path.contains('\\')
        || path.contains('\0')
        || path
            .split('/')
            .any(|part| part.is_empty() || part == "." || part == "..")
        || path.split('/').next() == Some(RECORDS);
    if bad {
        return Err(ContractError::InvalidRequest(format!(
            "`{path}` is not a path inside the workspace (relative, no `..`, not under {RECORDS}/)"
        )));
    }
    Ok(format!("{root}/{path}"))
}

/// The file's text, or `None` when it does not exist.
fn read(full: &str) -> Result<Option<String>, ContractError> {
    match call("read_text_file", &serde_json::json!({"path": full})) {
        Ok(text) => Ok(Some(text)),
        Err(Ok(message)) if message.contains("ENOENT") => Ok(None),
        Err(Ok(message)) => Err(ContractError::Unavailable(message)),
        Err(Err(e)) => Err(e),
    }
}

fn write_file(full: &str, content: &str) -> Result<(), ContractError> {
    call(
        "write_file",
        &serde_json::json!({"path": full, "content": content}),
    )
    .map(|_| ())
    .map_err(|e| match e {
        Ok(message) => ContractError::Unavailable(message),
        Err(e) => e,
    })
}

/// The upstream's line-ending normalization: every `\r\n` read as `\n`.
fn normalized(text: &str) -> String {
    text.replace("\r\n", "\n")
}

/// `text` (already [`normalized`]) with `edits` applied in order, each `old-text` required
/// to occur exactly once in the text as the edits before it left it.
///
/// # Errors
///
/// `invalid-request` naming the edit (1-based) whose old text is empty, missing or not
/// unique.
fn edited(text: &str, edits: &[TextEdit]) -> Result<String, ContractError> {
    if edits.is_empty() {
        return Err(ContractError::InvalidRequest(
            "no edits: give at least one {old-text, new-text}".into(),
        ));
    }
    let mut text = text.to_owned();
    for (n, edit) in edits.iter().enumerate() {
        let old = normalized(&edit.old_text);
        let n = n + 1;
        if old.is_empty() {
            return Err(ContractError::InvalidRequest(format!(
                "edit {n}: the old text is empty; give text the file holds exactly once"
            )));
        }
        // Occurrences may overlap (`aa` in `aaa`): look again one character further on.
        let step = old.chars().next().map_or(1, char::len_utf8);
        let at = text.find(old.as_str());
        let again = at.and_then(|at| text[at + step..].find(old.as_str()));
        let (Some(at), None) = (at, again) else {
            let why = if at.is_some() {
                "occurs more than once; include more of its surroundings"
            } else {
                "is not in the file (it must match exactly, whitespace and all)"
            };
            return Err(ContractError::InvalidRequest(format!(
                "edit {n}: the old text {why}"
            )));
        };
        text.replace_range(at..at + old.len(), &normalized(&edit.new_text));
    }
    Ok(text)
}

/// The record of the change made under `key`, if any.
fn record(root: &str, key: &str) -> Result<Option<Record>, ContractError> {
    if key.is_empty()
        || !key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        return Err(ContractError::InvalidRequest(
            "the idempotency key is not one the host issues".into(),
        ));
    }
    match read(&format!("{root}/{RECORDS}/{key}.json"))? {
        None => Ok(None),
        Some(text) => serde_json::from_str(&text).map(Some).map_err(|e| {
            ContractError::UpstreamFailed(format!("the record of {key} does not parse: {e}"))
        }),
    }
}

/// Records `rec` under `key` (before anything changes, so that `written` can tell later).
fn record_change(root: &str, key: &str, rec: &Record) -> Result<(), ContractError> {
    call(
        "create_directory",
        &serde_json::json!({"path": format!("{root}/{RECORDS}")}),
    )
    .map_err(|e| match e {
        Ok(message) => ContractError::Unavailable(message),
        Err(e) => e,
    })?;
    let text =
        serde_json::to_string(rec).map_err(|e| ContractError::UpstreamFailed(e.to_string()))?;
    write_file(&format!("{root}/{RECORDS}/{key}.json"), &text)
}

/// Records `rec` under `key`, then writes `content` to `full`.
fn apply(
    root: &str,
    key: &str,
    rec: &Record,
    full: &str,
    content: &str,
) -> Result<(), ContractError> {
    record_change(root, key, rec)?;
    write_file(full, content)
}

impl Guest for WorkspaceEdits {
    fn write(request: WriteRequest) -> Result<Change, ContractError> {
        let key = request.idempotency_key;
        if request.content.len() > MAX_FILE_BYTES {
            return Err(ContractError::InvalidRequest(format!(
                "the content is larger than {MAX_FILE_BYTES} bytes"
            )));
        }
        let root = workspace()?;
        let full = inside(&root, &request.path)?;
        if let Some(done) = record(&root, &key)? {
            log::info(&format!(
                "write {key}: already recorded, nothing written again"
            ));
            return Ok(done.change(&key));
        }
        let before = read(&full)?;
        small_enough(&request.path, before.as_deref())?;
        let rec = Record {
            path: request.path.clone(),
            before_sha256: before.as_deref().map(sha256),
            before,
            after_sha256: sha256(&request.content),
            bytes: request.content.len() as u64,
        };
        apply(&root, &key, &rec, &full, &request.content)?;
        Ok(rec.change(&key))
    }

    fn edit(request: EditRequest) -> Result<Change, ContractError> {
        let key = request.idempotency_key;
        let root = workspace()?;
        let full = inside(&root, &request.path)?;
        if let Some(done) = record(&root, &key)? {
            log::info(&format!(
                "edit {key}: already recorded, nothing edited again"
            ));
            return Ok(done.change(&key));
        }
        let before = read(&full)?.ok_or(ContractError::NotFound)?;
        small_enough(&request.path, Some(&before))?;
        let after = edited(&normalized(&before), &request.edits)?;
        if after.len() > MAX_FILE_BYTES {
            return Err(ContractError::InvalidRequest(format!(
                "the edited file would be larger than {MAX_FILE_BYTES} bytes"
            )));
        }
        let rec = Record {
            path: request.path.clone(),
            before_sha256: Some(sha256(&before)),
            before: Some(before),
            after_sha256: sha256(&after),
            bytes: after.len() as u64,
        };
        record_change(&root, &key, &rec)?;
        let edits: Vec<serde_json::Value> = request
            .edits
            .iter()
            .map(|e| serde_json::json!({"oldText": e.old_text, "newText": e.new_text}))
            .collect();
        call(
            "edit_file",
            &serde_json::json!({"path": full, "edits": edits, "dryRun": false}),
        )
        .map_err(|e| match e {
            Ok(message) => ContractError::Unavailable(message),
            Err(e) => e,
        })?;
        Ok(rec.change(&key))
    }

    fn written(request: WrittenRequest) -> Result<Option<Change>, ContractError> {
        let key = request.idempotency_key;
        let root = workspace()?;
        let Some(rec) = record(&root, &key)? else {
            return Ok(None);
        };
        let now = read(&inside(&root, &rec.path)?)?.as_deref().map(sha256);
        if now.as_deref() == Some(rec.after_sha256.as_str()) {
            Ok(Some(rec.change(&key)))
        } else if now == rec.before_sha256 {
            Ok(None)
        } else {
            Err(ContractError::Conflict(format!(
                "`{}` has neither the text before nor the text written under {key}",
                rec.path
            )))
        }
    }

    fn restore(request: RestoreRequest) -> Result<Change, ContractError> {
        let key = request.idempotency_key;
        let root = workspace()?;
        if let Some(done) = record(&root, &key)? {
            return Ok(done.change(&key));
        }
        let original = record(&root, &request.change)?.ok_or(ContractError::NotFound)?;
        let full = inside(&root, &original.path)?;
        let Some(before) = original.before.clone() else {
            return Err(ContractError::InvalidRequest(format!(
                "`{}` did not exist before the change, and this server cannot delete a file",
                original.path
            )));
        };
        let now = read(&full)?;
        if now.as_deref().map(sha256).as_deref() != Some(original.after_sha256.as_str()) {
            return Err(ContractError::Conflict(format!(
                "`{}` changed since the change being undone; restoring would lose that",
                original.path
            )));
        }
        let rec = Record {
            path: original.path.clone(),
            before_sha256: Some(original.after_sha256.clone()),
            before: now,
            after_sha256: sha256(&before),
            bytes: before.len() as u64,
        };
        apply(&root, &key, &rec, &full, &before)?;
        Ok(rec.change(&key))
    }
}

// The component's exports; a native build (`cargo test --workspace`) only checks the
// functions exist, as the SDK's export macros do (a native cdylib cannot carry WIT names).
#[cfg(target_arch = "wasm32")]
bindings::export!(WorkspaceEdits with_types_in bindings);

#[cfg(not(target_arch = "wasm32"))]
const _: () = {
    let _ = <WorkspaceEdits as Guest>::write;
    let _ = <WorkspaceEdits as Guest>::edit;
    let _ = <WorkspaceEdits as Guest>::written;
    let _ = <WorkspaceEdits as Guest>::restore;
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_relative_paths_inside_the_workspace_are_accepted() {
        assert_eq!(inside("/ws", "notes.md").unwrap(), "/ws/notes.md");
        assert_eq!(inside("/ws", "a/b.md").unwrap(), "/ws/a/b.md");
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../../x",
            "a//b",
            "./a",
            "a\\b",
            "a/",
            ".airlock-changes/k.json",
            "x\0y",
        ] {
            assert!(
                matches!(inside("/ws", bad), Err(ContractError::InvalidRequest(_))),
                "{bad:?}"
            );
        }
    }

    fn edit(old: &str, new: &str) -> TextEdit {
        TextEdit {
            old_text: old.into(),
            new_text: new.into(),
        }
    }

    #[test]
    fn edits_apply_in_order_each_matching_exactly_once() {
        let text = "alpha\nbeta\ngamma\n";
        assert_eq!(
            edited(text, &[edit("beta", "BETA"), edit("BETA\ngamma", "delta")]).unwrap(),
            "alpha\ndelta\n"
        );
        // CRLF in the request reads as LF, as the server reads it.
        assert_eq!(
            edited(text, &[edit("alpha\r\nbeta", "x\r\ny")]).unwrap(),
            "x\ny\ngamma\n"
        );
        assert_eq!(normalized("a\r\nb\r\n"), "a\nb\n");
        // A new text containing its old text is applied once.
        assert_eq!(edited("ab", &[edit("a", "aa")]).unwrap(), "aab");
        for (edits, why) in [
            (vec![], "no edits"),
            (vec![edit("", "x")], "edit 1: the old text is empty"),
            (
                vec![edit("delta", "x")],
                "edit 1: the old text is not in the file",
            ),
            (
                vec![edit("a", "x")],
                "edit 1: the old text occurs more than once",
            ),
            // After the first edit, `beta` is gone.
            (
                vec![edit("beta", "b"), edit("beta", "x")],
                "edit 2: the old text is not",
            ),
        ] {
            match edited(text, &edits) {
                Err(ContractError::InvalidRequest(m)) => assert!(m.starts_with(why), "{m}"),
                other => panic!("{why}: {other:?}"),
            }
        }
    }

    #[test]
    fn overlapping_and_whitespace_flexible_matches_are_refused() {
        let refused = |text: &str, old: &str| {
            matches!(
                edited(text, &[edit(old, "x")]),
                Err(ContractError::InvalidRequest(_))
            )
        };
        assert!(refused("aaa", "aa"), "two overlapping occurrences");
        assert!(refused("ééé", "éé"), "overlapping, multi-byte");
        assert!(refused("éaé", "é"), "two occurrences, multi-byte");
        // The server would find `indented` by its trimmed line and re-indent the new text;
        // what it wrote would not be what was approved, so the adapter refuses.
        assert!(refused("    indented\n", "indented \n"));
        assert_eq!(edited("xaay", &[edit("aa", "b")]).unwrap(), "xby");
    }

    #[test]
    fn a_record_answers_the_change_it_recorded() {
        let rec = Record {
            path: "n.md".into(),
            before: Some("a".into()),
            before_sha256: Some(sha256("a")),
            after_sha256: sha256("b"),
            bytes: 1,
        };
        let text = serde_json::to_string(&rec).unwrap();
        let back: Record = serde_json::from_str(&text).unwrap();
        let change = back.change("int_key");
        assert_eq!(change.change, "int_key");
        assert_eq!(change.after_sha256, sha256("b"));
        assert_eq!(
            sha256(""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
