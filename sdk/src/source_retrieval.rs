//! The `source-retrieval` contract (`airlock:contracts/source-retrieval@0.1.0`): search a set
//! of sources, then retrieve one by reference. Effect class: read; idempotent.
//!
//! Implement [`Guest`] (also named [`SourceRetrieval`]) and export it with
//! [`crate::export_source_retrieval!`]. A [`SourceRef`] holds the adapter's own locator (a
//! note id, a relative path); the host swaps it for an opaque token before the model sees it,
//! and back before the adapter gets it.
//!
//! # Helpers for a search/read mapping
//!
//! Most source-retrieval adapters map `search` onto one upstream search tool and `retrieve`
//! onto one read tool. The helpers below make that mapping short without hiding anything
//! that is sent: the adapter still names each tool and builds its arguments itself (they
//! are sent exactly as they serialize); the helpers only interpret the answer, by one
//! table:
//!
//! | the answer | [`search_tool`] | [`read_tool`] |
//! |---|---|---|
//! | a result whose JSON (`structuredContent`, else the first text block) parses as `T` | `Ok(T)` | `Ok(T)` |
//! | the host refused or failed the call ([`UpstreamError`](crate::upstream::UpstreamError)) | the SDK's table (`not-permitted`, `unavailable` → `unavailable`; `invalid-arguments` → `invalid-request`; `output-too-large`, `protocol-error` → `upstream-failed`) | the same |
//! | a tool-level failure (`isError: true`) | `invalid-request` with the tool's message: the upstream refused this search | `not-found`; the message is logged (`info`) |
//! | no JSON, or JSON of another shape (a wrong type, a missing field) | `upstream-failed`: `` `tool`: the tool result has an unexpected shape: <parser message> `` | the same |
//!
//! Upstream messages are untrusted text, bounded to [`MAX_ERROR_DETAIL`] bytes. The
//! constructors ([`SourceHit::new`], [`SourceHit::with_snippet`], [`SourcePassage::new`]...)
//! spare the struct literals and bound display text: a title to [`MAX_TITLE_BYTES`], a
//! snippet to [`MAX_SNIPPET_BYTES`] (cut on a character boundary, marked `…`). A passage's
//! text is never cut: the mapping's output budget bounds the upstream answer it came from.
//! [`SearchRequest::limit_or`] turns the request's optional limit into a bounded count.
//! [`prelude`] imports all of it at once.
//!
//! ```ignore
//! fn search(request: SearchRequest) -> Result<Vec<SourceHit>, ContractError> {
//!     // Sent upstream: `search_nodes {"query": <the request's query>}`.
//!     let graph: Graph = search_tool("search_nodes", &json!({ "query": request.query }))?;
//!     let hits = graph.entities.into_iter().take(request.limit_or(10, 50));
//!     Ok(hits.map(|e| SourceHit::new(e.name.clone(), e.name)).collect())
//! }
//! ```
//!
//! `adapters/memory-graph` in the Airlock repository is a complete adapter written this way.

use serde::Serialize;
use serde::de::DeserializeOwned;

pub use crate::bindings::exports::airlock::contracts::source_retrieval::{
    ContractError, Guest, RetrieveRequest, SearchRequest, SourceHit, SourcePassage, SourceRef,
};

/// The contract's trait under a descriptive name; the same trait as [`Guest`].
pub use crate::bindings::exports::airlock::contracts::source_retrieval::Guest as SourceRetrieval;

use crate::upstream::{self, MAX_ERROR_DETAIL, ToolOutput};

/// Everything a search/read adapter names, in one import:
/// `use airlock_sdk::source_retrieval::prelude::*;`
///
/// The contract's [`Guest`], requests, results and [`ContractError`]; the helpers
/// [`search_tool`] and [`read_tool`]; and `serde_json`'s [`json!`](crate::serde_json::json)
/// for building the arguments that are sent upstream.
pub mod prelude {
    pub use super::{
        ContractError, Guest, RetrieveRequest, SearchRequest, SourceHit, SourcePassage, read_tool,
        read_tool_text, search_tool, search_tool_text,
    };
    pub use crate::serde_json::json;
}

/// Longest title, in bytes, that [`SourceHit::new`] and [`SourcePassage::new`] keep.
pub const MAX_TITLE_BYTES: usize = 512;

/// Longest snippet, in bytes, that [`SourceHit::with_snippet`] keeps.
pub const MAX_SNIPPET_BYTES: usize = 1024;

/// The media type [`SourcePassage::new`] gives a passage until
/// [`SourcePassage::with_media_type`] says otherwise.
pub const DEFAULT_MEDIA_TYPE: &str = "text/plain";

impl ContractError {
    /// A [`ContractError::InvalidRequest`] with `why`.
    pub fn invalid_request(why: impl Into<String>) -> Self {
        ContractError::InvalidRequest(why.into())
    }

    /// A [`ContractError::UpstreamFailed`] with `why`.
    pub fn upstream_failed(why: impl Into<String>) -> Self {
        ContractError::UpstreamFailed(why.into())
    }
}

/// Calls the upstream search tool `tool` with `args` and reads its JSON result as `T`.
///
/// `args` is sent exactly as it serializes (it must serialize to a JSON object, as for
/// [`upstream::call_tool_json`]); `tool` must be listed in the mapping's `[upstream]
/// tools`. A tool-level failure (`isError`) means the upstream refused this search:
/// `invalid-request` carrying its message (see the [module table](self)).
///
/// # Errors
/// As the module table says: an [`UpstreamError`](crate::upstream::UpstreamError) by the SDK's conversion,
/// `invalid-request` for `isError`, `upstream-failed` for an answer of another shape.
pub fn search_tool<T: DeserializeOwned>(
    tool: &str,
    args: &(impl Serialize + ?Sized),
) -> Result<T, ContractError> {
    let output = upstream::call_tool_json(tool, args)?;
    if let Some(message) = output.error_message() {
        return Err(ContractError::InvalidRequest(message));
    }
    parse(tool, &output)
}

/// Calls the upstream read tool `tool` with `args` and reads its JSON result as `T`.
///
/// `args` is sent exactly as it serializes (a JSON object); `tool` must be listed in the
/// mapping's `[upstream] tools`. A tool-level failure (`isError`) means no source matches:
/// `not-found`, the tool's message logged at `info` for the operator (the contract's
/// `not-found` carries none). Where a read tool also fails for other reasons, call
/// [`upstream::call_tool_json`] and map its answer yourself.
///
/// # Errors
/// As the module table says: an [`UpstreamError`](crate::upstream::UpstreamError) by the SDK's conversion, `not-found`
/// for `isError`, `upstream-failed` for an answer of another shape.
pub fn read_tool<T: DeserializeOwned>(
    tool: &str,
    args: &(impl Serialize + ?Sized),
) -> Result<T, ContractError> {
    let output = upstream::call_tool_json(tool, args)?;
    if let Some(message) = output.error_message() {
        crate::log::info(&format!(
            "upstream tool `{tool}` reported an error; answering not-found: {message}"
        ));
        return Err(ContractError::NotFound);
    }
    parse(tool, &output)
}

/// Calls the upstream search tool `tool` with `args` and returns its answer's text: every
/// `text` content block, joined with newlines — for a server that answers in text rather
/// than JSON (the adapter parses the lines it knows). Failures map as for [`search_tool`].
///
/// # Errors
/// As [`search_tool`]; `upstream-failed` when the answer carries no text.
pub fn search_tool_text(
    tool: &str,
    args: &(impl Serialize + ?Sized),
) -> Result<String, ContractError> {
    let output = upstream::call_tool_json(tool, args)?;
    if let Some(message) = output.error_message() {
        return Err(ContractError::InvalidRequest(message));
    }
    text_of(tool, &output)
}

/// Calls the upstream read tool `tool` with `args` and returns its answer's text (every
/// `text` block, joined with newlines). Failures map as for [`read_tool`].
///
/// # Errors
/// As [`read_tool`]; `upstream-failed` when the answer carries no text.
pub fn read_tool_text(
    tool: &str,
    args: &(impl Serialize + ?Sized),
) -> Result<String, ContractError> {
    let output = upstream::call_tool_json(tool, args)?;
    if let Some(message) = output.error_message() {
        crate::log::info(&format!(
            "upstream tool `{tool}` reported an error; answering not-found: {message}"
        ));
        return Err(ContractError::NotFound);
    }
    text_of(tool, &output)
}

/// The result's text, or `upstream-failed` naming the tool when it has none.
fn text_of(tool: &str, output: &ToolOutput) -> Result<String, ContractError> {
    let text = output.text();
    if output
        .content
        .iter()
        .any(|b| matches!(b, upstream::ContentBlock::Text(_)))
    {
        Ok(text)
    } else {
        Err(ContractError::UpstreamFailed(format!(
            "`{tool}`: the tool result carries no text"
        )))
    }
}

/// The result's JSON as `T`, or `upstream-failed` naming the tool.
fn parse<T: DeserializeOwned>(tool: &str, output: &ToolOutput) -> Result<T, ContractError> {
    output.structured().map_err(|e| {
        ContractError::UpstreamFailed(crate::bounded(&format!("`{tool}`: {e}"), MAX_ERROR_DETAIL))
    })
}

/// `text` as an owned string of at most `max` bytes (cut on a character boundary, `…`).
fn bounded_owned(text: impl Into<String>, max: usize) -> String {
    let text = text.into();
    if text.len() <= max {
        text
    } else {
        crate::bounded(&text, max)
    }
}

impl SearchRequest {
    /// How many hits to return: the request's `limit`, or `default` when it names none,
    /// clamped to `1..=max`.
    ///
    /// ```ignore
    /// let wanted = request.limit_or(10, 50); // absent → 10; 0 → 1; 500 → 50
    /// ```
    pub fn limit_or(&self, default: u32, max: u32) -> usize {
        let max = max.max(1);
        self.limit.unwrap_or(default).clamp(1, max) as usize
    }
}

impl SourceHit {
    /// A hit with `reference` (the adapter's own locator, which the host swaps for an
    /// opaque token) and `title` (bounded to [`MAX_TITLE_BYTES`]); no version, no snippet.
    pub fn new(reference: impl Into<String>, title: impl Into<String>) -> Self {
        SourceHit {
            reference: reference.into(),
            title: bounded_owned(title, MAX_TITLE_BYTES),
            version: None,
            snippet: None,
        }
    }

    /// This hit with `snippet` (bounded to [`MAX_SNIPPET_BYTES`]); `None` leaves it absent.
    pub fn with_snippet(mut self, snippet: Option<impl AsRef<str>>) -> Self {
        self.snippet = snippet.map(|s| bounded_owned(s.as_ref(), MAX_SNIPPET_BYTES));
        self
    }

    /// This hit with `version` (bounded to [`MAX_TITLE_BYTES`]); `None` leaves it absent.
    pub fn with_version(mut self, version: Option<impl AsRef<str>>) -> Self {
        self.version = version.map(|v| bounded_owned(v.as_ref(), MAX_TITLE_BYTES));
        self
    }
}

impl SourcePassage {
    /// A passage of `reference` (the locator the adapter received) with `title` (bounded to
    /// [`MAX_TITLE_BYTES`]) and `text` (whole), of media type [`DEFAULT_MEDIA_TYPE`]; no
    /// version.
    pub fn new(
        reference: impl Into<String>,
        title: impl Into<String>,
        text: impl Into<String>,
    ) -> Self {
        SourcePassage {
            reference: reference.into(),
            title: bounded_owned(title, MAX_TITLE_BYTES),
            version: None,
            media_type: DEFAULT_MEDIA_TYPE.to_owned(),
            text: text.into(),
        }
    }

    /// This passage with media type `media_type` (e.g. `text/markdown`).
    pub fn with_media_type(mut self, media_type: impl Into<String>) -> Self {
        self.media_type = media_type.into();
        self
    }

    /// This passage with `version` (bounded to [`MAX_TITLE_BYTES`]); `None` leaves it absent.
    pub fn with_version(mut self, version: Option<impl AsRef<str>>) -> Self {
        self.version = version.map(|v| bounded_owned(v.as_ref(), MAX_TITLE_BYTES));
        self
    }
}

#[cfg(all(test, feature = "testing"))]
mod tests {
    //! The helpers against the test kit, with the answers a hostile or broken upstream
    //! gives: each must produce the error the module table names, with the same payload
    //! as the SDK's own conversions where there is one.

    use super::*;
    use crate::serde_json::json;
    use crate::testing::{Reply, Upstream};
    use crate::upstream::UpstreamError;
    use serde::Deserialize;

    const MAPPING: &str = r#"
[mapping]
name = "memory-graph"
[upstream]
tools = ["search_nodes", "open_nodes"]
"#;

    #[derive(Debug, Deserialize)]
    struct Graph {
        entities: Vec<Entity>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(rename_all = "camelCase")]
    #[allow(dead_code)]
    struct Entity {
        name: String,
        entity_type: String,
        observations: Vec<String>,
    }

    fn kit() -> Upstream {
        Upstream::from_mapping_text(MAPPING).unwrap()
    }

    fn search(query: &str) -> Result<Graph, ContractError> {
        search_tool("search_nodes", &json!({ "query": query }))
    }

    fn read(name: &str) -> Result<Graph, ContractError> {
        read_tool("open_nodes", &json!({ "names": [name] }))
    }

    /// The case name and payload of a contract error.
    fn case(e: ContractError) -> (&'static str, String) {
        match e {
            ContractError::InvalidRequest(p) => ("invalid-request", p),
            ContractError::NotFound => ("not-found", String::new()),
            ContractError::Unavailable(p) => ("unavailable", p),
            ContractError::UpstreamFailed(p) => ("upstream-failed", p),
        }
    }

    #[test]
    fn the_arguments_are_sent_exactly_and_the_answer_is_parsed() {
        let kit = kit()
            .reply(
                "search_nodes",
                Reply::structured(json!({
                    "entities": [{"name": "Ada", "entityType": "person", "observations": ["wrote notes"]}],
                    "relations": []
                })),
            )
            .install();
        let graph = search("ada").unwrap();
        assert_eq!(graph.entities[0].name, "Ada");
        assert_eq!(kit.calls()[0].tool, "search_nodes");
        assert_eq!(kit.calls()[0].arguments, json!({ "query": "ada" }));
    }

    #[test]
    fn an_answer_of_another_shape_is_upstream_failed_naming_the_tool() {
        for (answer, expect) in [
            (
                Reply::structured(json!({"entities": "nope"})),
                "invalid type: string \"nope\", expected a sequence",
            ),
            (
                Reply::structured(json!({"entities": [{"name": "Ada"}]})),
                "missing field `entityType`",
            ),
            (Reply::structured(json!({})), "missing field `entities`"),
            (
                Reply::structured(json!("a graph")),
                "invalid type: string \"a graph\", expected struct Graph",
            ),
            (
                Reply::text("Error: the graph file is corrupt"),
                "expected value",
            ),
            (
                Reply::mcp(json!({"content": [{"type": "image", "data": "AA=="}]})),
                "no structured content",
            ),
        ] {
            let _kit = kit().reply("search_nodes", answer).install();
            let (got, payload) = case(search("ada").unwrap_err());
            assert_eq!(got, "upstream-failed", "{payload}");
            assert!(
                payload.starts_with("`search_nodes`: the tool result "),
                "{payload}"
            );
            assert!(payload.contains(expect), "{expect}: {payload}");
        }
        // The whole payload, as the SDK README shows it.
        let _kit = kit()
            .reply(
                "search_nodes",
                Reply::structured(json!({"entities": [{"name": "Ada"}]})),
            )
            .install();
        assert_eq!(
            case(search("ada").unwrap_err()).1,
            "`search_nodes`: the tool result has an unexpected shape: missing field `entityType` at line 1 column 27"
        );
    }

    #[test]
    fn huge_text_is_bounded_in_errors_titles_and_snippets() {
        let huge = "é".repeat(1 << 20);
        // A wrong type whose value is a huge string: serde quotes it whole.
        let _kit = kit()
            .reply("search_nodes", Reply::structured(json!({"entities": huge})))
            .reply("open_nodes", Reply::tool_error(huge.clone()))
            .install();
        let (got, payload) = case(search("ada").unwrap_err());
        assert_eq!(got, "upstream-failed");
        assert!(payload.len() <= MAX_ERROR_DETAIL + 4, "{}", payload.len());
        assert!(payload.ends_with('…'), "marked as cut");
        // A huge isError message: bounded by the same rule as `error_message()`.
        assert!(matches!(read("ada"), Err(ContractError::NotFound)));
        drop(_kit);
        let _kit = kit()
            .reply("search_nodes", Reply::tool_error(huge.clone()))
            .install();
        let (got, payload) = case(search("ada").unwrap_err());
        assert_eq!(got, "invalid-request");
        assert!(payload.len() <= MAX_ERROR_DETAIL + 4, "{}", payload.len());

        let hit = SourceHit::new("ada", huge.as_str()).with_snippet(Some(&huge));
        assert!(hit.title.len() <= MAX_TITLE_BYTES + 4 && hit.title.ends_with('…'));
        let snippet = hit.snippet.unwrap();
        assert!(snippet.len() <= MAX_SNIPPET_BYTES + 4 && snippet.starts_with("éé"));
        // The passage's text is the content: never cut (the output budget bounds it).
        let passage = SourcePassage::new("ada", "Ada", huge.as_str());
        assert_eq!(passage.text.len(), huge.len());
        assert_eq!(passage.media_type, DEFAULT_MEDIA_TYPE);
    }

    #[test]
    fn host_refusals_convert_by_the_sdks_table() {
        for error in [
            UpstreamError::OutputTooLarge(262_144),
            UpstreamError::Unavailable("the connection closed".into()),
            UpstreamError::ProtocolError("-32602: invalid params".into()),
        ] {
            let _kit = kit()
                .reply("search_nodes", Reply::error(error.clone()))
                .reply("open_nodes", Reply::error(error.clone()))
                .install();
            let expected = case(ContractError::from(error));
            assert_eq!(case(search("ada").unwrap_err()), expected);
            assert_eq!(case(read("ada").unwrap_err()), expected);
        }
        // A tool the mapping does not list is refused by the host, never sent.
        let kit = kit().install();
        let err = search_tool::<Graph>("read_graph", &json!({})).unwrap_err();
        let (got, payload) = case(err);
        assert_eq!(got, "unavailable");
        assert!(
            payload.contains("`read_graph` is not listed in mapping `memory-graph`"),
            "{payload}"
        );
        // Arguments that are not an object are refused before anything is sent.
        let (got, _) = case(search_tool::<Graph>("search_nodes", &json!(["ada"])).unwrap_err());
        assert_eq!(got, "invalid-request");
        assert_eq!(kit.calls().len(), 1, "only the refused read_graph call");
    }

    /// A server that answers in text: the helpers hand over the text, with the same
    /// failures as the JSON helpers.
    #[test]
    fn the_text_helpers_hand_over_the_answer_and_map_failures_alike() {
        let first = kit()
            .reply(
                "search_nodes",
                Reply::text("commit abc123 Fix WAL\ncommit def456 Docs"),
            )
            .reply("open_nodes", Reply::tool_error("no such commit"))
            .install();
        let text = search_tool_text("search_nodes", &json!({ "query": "wal" })).unwrap();
        assert_eq!(text.lines().count(), 2);
        assert!(text.starts_with("commit abc123"));
        assert!(matches!(
            read_tool_text("open_nodes", &json!({ "names": ["x"] })),
            Err(ContractError::NotFound)
        ));
        drop(first);
        let _kit = kit()
            .reply(
                "search_nodes",
                Reply::mcp(
                    json!({"content": [{"type": "image", "data": "", "mimeType": "image/png"}]}),
                ),
            )
            .install();
        let (got, payload) =
            case(search_tool_text("search_nodes", &json!({ "query": "x" })).unwrap_err());
        assert_eq!(got, "upstream-failed");
        assert!(payload.contains("carries no text"), "{payload}");
    }

    #[test]
    fn a_tool_error_is_invalid_request_for_a_search_and_not_found_for_a_read() {
        let kit = kit()
            .reply("search_nodes", Reply::tool_error("query too long"))
            .reply(
                "open_nodes",
                Reply::tool_error("Entity with name x not found"),
            )
            .install();
        assert_eq!(
            case(search("x").unwrap_err()),
            ("invalid-request", "query too long".to_owned())
        );
        assert!(matches!(read("x"), Err(ContractError::NotFound)));
        // The read's message is not lost: the operator finds it in the log.
        let logs = kit.logs();
        assert_eq!(logs.len(), 1, "{logs:?}");
        assert!(
            logs[0].1.contains("`open_nodes` reported an error")
                && logs[0].1.contains("Entity with name x not found"),
            "{logs:?}"
        );
    }

    #[test]
    fn limits_and_builders() {
        let request = |limit| SearchRequest {
            query: "q".into(),
            limit,
        };
        assert_eq!(request(None).limit_or(10, 50), 10);
        assert_eq!(request(Some(0)).limit_or(10, 50), 1);
        assert_eq!(request(Some(7)).limit_or(10, 50), 7);
        assert_eq!(request(Some(u32::MAX)).limit_or(10, 50), 50);
        assert_eq!(
            request(None).limit_or(10, 0),
            1,
            "a zero max still allows one"
        );
        let hit = SourceHit::new("r", "t")
            .with_snippet(None::<&str>)
            .with_version(Some("3"));
        assert_eq!((hit.snippet, hit.version.as_deref()), (None, Some("3")));
        let passage = SourcePassage::new("r", "t", "body")
            .with_media_type("text/markdown")
            .with_version(Some(String::from("v2")));
        assert_eq!(
            (passage.media_type.as_str(), passage.version.as_deref()),
            ("text/markdown", Some("v2"))
        );
    }
}
