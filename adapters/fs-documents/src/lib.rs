//! `fs-documents`: the `source-retrieval` contract over the reference filesystem MCP server
//! (`@modelcontextprotocol/server-filesystem`).
//!
//! Upstream tools (the mapping lists exactly these, all read-only):
//! - `list_allowed_directories` → text `"Allowed directories:\n/dir\n..."`: the served root is
//!   the first directory listed;
//! - `search_files {path, pattern, excludePatterns}` → text: absolute paths, one per line, or
//!   `"No matches found"`. The server matches `pattern` with minimatch (case-sensitive, `dot`
//!   on) against each entry's path relative to `path`, files and folders alike;
//! - `read_text_file {path}` → text: the file's contents; `isError` with the server's message
//!   (`ENOENT: ...`, `Access denied - ...`) on failure.
//!
//! Each of these also returns `structuredContent: {"content": <the same text>}`.
//!
//! A hit's `reference` is the file's path relative to the served root. No field the adapter
//! returns ever holds an absolute path: titles are bare file names. Search matches file
//! names case-insensitively (any query word), skips hidden entries, and drops entries that are
//! evidently folders (the parent of another hit); the server does not say which entries are
//! folders, so a matching folder can still be a hit, and retrieving it is `invalid-request`.

use airlock_sdk::source_retrieval::{
    ContractError, Guest, RetrieveRequest, SearchRequest, SourceHit, SourcePassage,
};
use airlock_sdk::upstream::{self, ToolOutput};
use serde::{Deserialize, Serialize};

/// Hits returned when the request names no limit.
const DEFAULT_LIMIT: u32 = 10;
/// Most hits returned, whatever the request asks.
const MAX_LIMIT: u32 = 20;
/// Most query words turned into the search pattern.
const MAX_WORDS: usize = 8;
/// Longest query word kept, in characters.
const MAX_WORD_CHARS: usize = 64;
/// Longest reference accepted, in bytes.
const MAX_REFERENCE_BYTES: usize = 4096;
/// What `search_files` answers when nothing matched.
const NO_MATCHES: &str = "No matches found";

/// The adapter; it keeps no state between calls.
struct FsDocuments;

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct SearchFilesArgs<'a> {
    path: &'a str,
    pattern: &'a str,
    exclude_patterns: &'a [&'a str],
}

#[derive(Serialize)]
struct PathArgs<'a> {
    path: &'a str,
}

/// The `structuredContent` shape of every tool this adapter calls.
#[derive(Deserialize)]
struct TextContent {
    content: String,
}

/// The text of a successful result: `structuredContent.content`, else the first text block.
fn result_text(output: &ToolOutput) -> Result<String, ContractError> {
    if output.structured_json.is_some() {
        return Ok(output.structured::<TextContent>()?.content);
    }
    output
        .first_text()
        .map(str::to_owned)
        .ok_or_else(|| ContractError::upstream_failed("the tool result carries no text"))
}

/// The served directories, from `list_allowed_directories`'s text, without trailing `/`
/// (the filesystem root stays `/`).
fn parse_allowed_directories(text: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|line| line.starts_with('/'))
        .map(|line| {
            let trimmed = line.trim_end_matches('/');
            if trimmed.is_empty() { "/" } else { trimmed }.to_owned()
        })
        .collect()
}

/// Asks the server which directories it serves. The first one is the root.
fn allowed_directories() -> Result<Vec<String>, ContractError> {
    let output = upstream::call_tool_json("list_allowed_directories", &serde_json::json!({}))?;
    if let Some(message) = output.error_message() {
        return Err(ContractError::Unavailable(message));
    }
    let roots = parse_allowed_directories(&result_text(&output)?);
    if roots.is_empty() {
        return Err(ContractError::Unavailable(
            "the server reports no allowed directory".to_owned(),
        ));
    }
    Ok(roots)
}

/// `root` joined with a relative path.
fn join(root: &str, relative: &str) -> String {
    if root.ends_with('/') {
        format!("{root}{relative}")
    } else {
        format!("{root}/{relative}")
    }
}

/// Splits a query into words to match file names against: runs of letters, digits, `-`,
/// `_` and `.`, none of which is special to minimatch.
fn query_words(query: &str) -> Vec<String> {
    let mut words: Vec<String> = Vec::new();
    for word in query.split(|c: char| !(c.is_alphanumeric() || matches!(c, '-' | '_' | '.'))) {
        let word = word.trim_matches('.');
        if word.is_empty() {
            continue;
        }
        let word: String = word.chars().take(MAX_WORD_CHARS).collect();
        if !words
            .iter()
            .any(|w| w.to_lowercase() == word.to_lowercase())
        {
            words.push(word);
        }
        if words.len() == MAX_WORDS {
            break;
        }
    }
    words
}

/// One word as a case-insensitive minimatch fragment: `Beta` → `[bB][eE][tT][aA]`.
fn case_insensitive(word: &str) -> String {
    let mut out = String::new();
    for c in word.chars() {
        let mut lower = c.to_lowercase();
        let mut upper = c.to_uppercase();
        match (lower.next(), lower.next(), upper.next(), upper.next()) {
            (Some(l), None, Some(u), None) if l != u => {
                out.push('[');
                out.push(l);
                out.push(u);
                out.push(']');
            }
            _ => out.push(c),
        }
    }
    out
}

/// The `search_files` pattern: entries at any depth whose name contains any of `words`.
fn search_pattern(words: &[String]) -> String {
    let parts: Vec<String> = words.iter().map(|w| case_insensitive(w)).collect();
    if parts.len() == 1 {
        format!("**/*{}*", parts[0])
    } else {
        format!("**/*{{{}}}*", parts.join(","))
    }
}

/// The last component of a relative path.
fn file_name(relative: &str) -> &str {
    relative.rsplit('/').next().unwrap_or(relative)
}

/// Turns `search_files`'s text into relative paths, best match first.
///
/// Only lines under one of `roots` are kept, as paths relative to it; anything else is
/// dropped, so no absolute path can escape. Entries that are the parent folder of another
/// entry are dropped too (a folder is not a document). Ranking: more query words in the file
/// name first, then shallower, then by path.
fn parse_search_results(text: &str, roots: &[String], words: &[String]) -> Vec<String> {
    if text.trim() == NO_MATCHES {
        return Vec::new();
    }
    let mut found: Vec<String> = Vec::new();
    for line in text.lines() {
        let line = line.trim_end_matches('\r');
        let relative = roots.iter().find_map(|root| {
            let prefix = if root == "/" {
                "/".to_owned()
            } else {
                format!("{root}/")
            };
            line.strip_prefix(prefix.as_str())
        });
        if let Some(relative) = relative
            && validate_reference(relative).is_ok()
            && !found.iter().any(|f| f == relative)
        {
            found.push(relative.to_owned());
        }
    }
    let folders: Vec<String> = found
        .iter()
        .filter(|f| {
            found
                .iter()
                .any(|other| other.starts_with(&format!("{f}/")))
        })
        .cloned()
        .collect();
    found.retain(|f| !folders.contains(f));

    let lowered: Vec<String> = words.iter().map(|w| w.to_lowercase()).collect();
    let score = |relative: &str| {
        let name = file_name(relative).to_lowercase();
        lowered.iter().filter(|w| name.contains(w.as_str())).count()
    };
    found.sort_by(|a, b| {
        score(b)
            .cmp(&score(a))
            .then_with(|| a.matches('/').count().cmp(&b.matches('/').count()))
            .then_with(|| a.cmp(b))
    });
    found
}

/// Checks that `reference` is a plain relative path: not empty, no leading `/`, no `\`,
/// no NUL or other control character, no empty, `.` or `..` component.
fn validate_reference(reference: &str) -> Result<(), ContractError> {
    let invalid = |why: &str| {
        Err(ContractError::invalid_request(format!(
            "invalid reference: {why}"
        )))
    };
    if reference.is_empty() {
        return invalid("it is empty");
    }
    if reference.len() > MAX_REFERENCE_BYTES {
        return invalid("it is too long");
    }
    if reference.starts_with('/') {
        return invalid("it is not a relative path");
    }
    if reference.contains('\\') {
        return invalid("it contains a backslash");
    }
    if reference.chars().any(char::is_control) {
        return invalid("it contains a control character");
    }
    if reference
        .split('/')
        .any(|part| part.is_empty() || part == "." || part == "..")
    {
        return invalid("it has an empty, `.` or `..` component");
    }
    Ok(())
}

/// The media type of a document, from its file name's extension (`text/plain` by default).
fn media_type(name: &str) -> &'static str {
    let extension = match name.rsplit_once('.') {
        Some((stem, ext)) if !stem.is_empty() => ext.to_ascii_lowercase(),
        _ => String::new(),
    };
    match extension.as_str() {
        "md" | "markdown" => "text/markdown",
        "html" | "htm" => "text/html",
        "csv" => "text/csv",
        "json" => "application/json",
        "xml" => "application/xml",
        "yaml" | "yml" => "application/yaml",
        "toml" => "application/toml",
        _ => "text/plain",
    }
}

/// Maps `read_text_file`'s failure message (Node's error text) to a contract error.
fn read_failure(message: String) -> ContractError {
    if message.contains("ENOENT") || message.contains("ENOTDIR") {
        ContractError::NotFound
    } else if message.contains("EISDIR") {
        ContractError::invalid_request("the reference names a folder, not a document")
    } else {
        ContractError::Unavailable(message)
    }
}

impl Guest for FsDocuments {
    fn search(request: SearchRequest) -> Result<Vec<SourceHit>, ContractError> {
        let words = query_words(&request.query);
        if words.is_empty() {
            return Err(ContractError::invalid_request(
                "the query has no letters or digits to match file names against",
            ));
        }
        let limit = request.limit.unwrap_or(DEFAULT_LIMIT).clamp(1, MAX_LIMIT) as usize;
        let roots = allowed_directories()?;
        let pattern = search_pattern(&words);
        let args = SearchFilesArgs {
            path: &roots[0],
            pattern: &pattern,
            // Hidden files and folders (and everything under them) are not documents.
            exclude_patterns: &["**/.*"],
        };
        let output = upstream::call_tool_json("search_files", &args)?;
        if let Some(message) = output.error_message() {
            return Err(ContractError::Unavailable(message));
        }
        let mut found = parse_search_results(&result_text(&output)?, &roots, &words);
        found.truncate(limit);
        Ok(found
            .into_iter()
            .map(|relative| SourceHit {
                title: file_name(&relative).to_owned(),
                reference: relative,
                version: None,
                snippet: None,
            })
            .collect())
    }

    fn retrieve(request: RetrieveRequest) -> Result<SourcePassage, ContractError> {
        let relative = request.reference;
        validate_reference(&relative)?;
        let roots = allowed_directories()?;
        let path = join(&roots[0], &relative);
        let output = upstream::call_tool_json("read_text_file", &PathArgs { path: &path })?;
        if let Some(message) = output.error_message() {
            return Err(read_failure(message));
        }
        let text = result_text(&output)?;
        let title = file_name(&relative).to_owned();
        Ok(SourcePassage {
            media_type: media_type(&title).to_owned(),
            title,
            reference: relative,
            version: None,
            text,
        })
    }
}

airlock_sdk::export_source_retrieval!(FsDocuments);

#[cfg(test)]
mod tests {
    use super::*;

    fn words(q: &str) -> Vec<String> {
        query_words(q)
    }

    #[test]
    fn pattern_is_case_insensitive_and_escapes_nothing_special() {
        assert_eq!(search_pattern(&words("Beta")), "**/*[bB][eE][tT][aA]*");
        assert_eq!(search_pattern(&words("a1 x")), "**/*{[aA]1,[xX]}*");
        assert_eq!(words("*{evil},[x]/../y?"), vec!["evil", "x", "y"]);
        assert_eq!(words("report.v2 Report"), vec!["report.v2", "Report"]);
        assert!(words(" ** / ?? ").is_empty());
    }

    #[test]
    fn allowed_directories_parse() {
        let roots =
            parse_allowed_directories("Allowed directories:\n/tmp/docs\n/private/tmp/docs/\n");
        assert_eq!(roots, vec!["/tmp/docs", "/private/tmp/docs"]);
        assert_eq!(
            parse_allowed_directories("Allowed directories:\n/"),
            vec!["/"]
        );
        assert_eq!(join("/", "a.md"), "/a.md");
        assert_eq!(join("/srv", "a.md"), "/srv/a.md");
    }

    #[test]
    fn search_results_stay_relative_and_rank() {
        let roots = vec!["/docs".to_owned(), "/real/docs".to_owned()];
        let text = "/docs/beta\n/docs/beta/notes.md\n/real/docs/alpha-beta.md\n/etc/passwd\n/docsx/a.md\n/docs/sub/Beta.txt";
        let found = parse_search_results(text, &roots, &words("alpha beta"));
        assert_eq!(
            found,
            vec!["alpha-beta.md", "sub/Beta.txt", "beta/notes.md"]
        );
        assert!(parse_search_results(NO_MATCHES, &roots, &words("x")).is_empty());
    }

    #[test]
    fn references_are_validated() {
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../b",
            "a//b",
            "./a",
            "a/.",
            "a\\b",
            "a\0b",
            "a/",
        ] {
            assert!(validate_reference(bad).is_err(), "{bad:?} accepted");
        }
        for good in ["a.md", "sub/Beta_Report.txt", "..a/b..", ".hidden"] {
            assert!(validate_reference(good).is_ok(), "{good:?} refused");
        }
    }

    #[test]
    fn media_types() {
        assert_eq!(media_type("a.MD"), "text/markdown");
        assert_eq!(media_type("data.json"), "application/json");
        assert_eq!(media_type(".md"), "text/plain");
        assert_eq!(media_type("README"), "text/plain");
    }

    #[test]
    fn read_failures() {
        assert!(matches!(
            read_failure("ENOENT: no such file or directory, open '/x'".into()),
            ContractError::NotFound
        ));
        assert!(matches!(
            read_failure("EISDIR: illegal operation".into()),
            ContractError::InvalidRequest(_)
        ));
        assert!(matches!(
            read_failure("Access denied - x".into()),
            ContractError::Unavailable(_)
        ));
    }
}
