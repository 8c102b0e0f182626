//! `source-library`: the `source-retrieval` contract over the notes fixture MCP server.
//!
//! Upstream tools (the mapping lists exactly these):
//! - `search_notes {query, limit?}` → structured `{"hits":[{"id","title","version","snippet"}]}`;
//! - `read_note {id}` → structured `{"id","title","version","media_type","body"}`, or
//!   `isError` for an unknown id.
//!
//! A hit's `reference` is the note id; the host turns it into an opaque token for the model.

use airlock_sdk::source_retrieval::{
    ContractError, Guest, RetrieveRequest, SearchRequest, SourceHit, SourcePassage,
};
use airlock_sdk::upstream;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Fewest and most hits `search_notes` accepts.
const LIMIT_RANGE: (u32, u32) = (1, 20);

/// The adapter; it keeps no state between calls.
struct SourceLibrary;

#[derive(Serialize)]
struct SearchArgs<'a> {
    query: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    limit: Option<u32>,
}

#[derive(Serialize)]
struct ReadArgs<'a> {
    id: &'a str,
}

#[derive(Deserialize)]
struct SearchResult {
    hits: Vec<NoteHit>,
}

#[derive(Deserialize)]
struct NoteHit {
    id: String,
    title: String,
    #[serde(default)]
    version: Value,
    #[serde(default)]
    snippet: Option<String>,
}

#[derive(Deserialize)]
struct Note {
    title: String,
    #[serde(default)]
    version: Value,
    #[serde(default)]
    media_type: Option<String>,
    body: String,
}

/// A version as text: strings as they are, numbers printed, anything else absent.
fn version_text(version: Value) -> Option<String> {
    match version {
        Value::String(s) => Some(s),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

impl Guest for SourceLibrary {
    fn search(request: SearchRequest) -> Result<Vec<SourceHit>, ContractError> {
        let args = SearchArgs {
            query: &request.query,
            limit: request.limit.map(|l| l.clamp(LIMIT_RANGE.0, LIMIT_RANGE.1)),
        };
        let output = upstream::call_tool_json("search_notes", &args)?;
        if let Some(message) = output.error_message() {
            return Err(ContractError::InvalidRequest(message));
        }
        let result: SearchResult = output.structured()?;
        Ok(result
            .hits
            .into_iter()
            .map(|hit| SourceHit {
                reference: hit.id,
                title: hit.title,
                version: version_text(hit.version),
                snippet: hit.snippet,
            })
            .collect())
    }

    fn retrieve(request: RetrieveRequest) -> Result<SourcePassage, ContractError> {
        let id = request.reference;
        if id.is_empty() {
            return Err(ContractError::invalid_request("the reference is empty"));
        }
        let output = upstream::call_tool_json("read_note", &ReadArgs { id: &id })?;
        if output.is_error {
            // The server's only tool-level failure for read_note is an unknown id.
            return Err(ContractError::NotFound);
        }
        let note: Note = output.structured()?;
        Ok(SourcePassage {
            reference: id,
            title: note.title,
            version: version_text(note.version),
            media_type: note
                .media_type
                .filter(|m| !m.is_empty())
                .unwrap_or_else(|| "text/plain".to_owned()),
            text: note.body,
        })
    }
}

airlock_sdk::export_source_retrieval!(SourceLibrary);
