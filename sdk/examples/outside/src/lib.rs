//! `my-notes`: the `source-retrieval` contract over the notes MCP server's
//! `search_notes` and `read_note` tools.

use airlock_sdk::source_retrieval::{
    ContractError, Guest, RetrieveRequest, SearchRequest, SourceHit, SourcePassage,
};
use airlock_sdk::{log, serde_json::json, upstream};
use serde::Deserialize;

struct MyNotes;

#[derive(Deserialize)]
struct Hits {
    hits: Vec<Hit>,
}

#[derive(Deserialize)]
struct Hit {
    id: String,
    title: String,
}

#[derive(Deserialize)]
struct Note {
    title: String,
    body: String,
}

impl Guest for MyNotes {
    fn search(request: SearchRequest) -> Result<Vec<SourceHit>, ContractError> {
        let limit = request.limit.unwrap_or(10).clamp(1, 20);
        // UpstreamError -> ContractError through `?`.
        let output = upstream::call_tool_json(
            "search_notes",
            &json!({ "query": request.query, "limit": limit }),
        )?;
        if let Some(message) = output.error_message() {
            return Err(ContractError::InvalidRequest(message));
        }
        // structuredContent (or a JSON text block) -> T; a wrong shape is upstream-failed.
        let found: Hits = output.structured()?;
        log::debug(&format!("{} hits", found.hits.len()));
        Ok(found
            .hits
            .into_iter()
            .map(|hit| SourceHit {
                reference: hit.id, // our own locator; the host hands the model a token
                title: hit.title,
                version: None,
                snippet: None,
            })
            .collect())
    }

    fn retrieve(request: RetrieveRequest) -> Result<SourcePassage, ContractError> {
        let output = upstream::call_tool_json("read_note", &json!({ "id": request.reference }))?;
        if output.is_error {
            return Err(ContractError::NotFound);
        }
        let note: Note = output.structured()?;
        Ok(SourcePassage {
            reference: request.reference,
            title: note.title,
            version: None,
            media_type: "text/markdown".to_owned(),
            text: note.body,
        })
    }
}

airlock_sdk::export_source_retrieval!(MyNotes);

#[cfg(test)]
mod tests {
    use super::*;
    use airlock_sdk::testing::{Reply, Upstream};

    #[test]
    fn search_maps_hits_and_retrieve_maps_a_tool_error_to_not_found() {
        let kit = Upstream::from_mapping("mapping.toml") // only the tools it lists
            .reply(
                "search_notes",
                Reply::structured(json!({ "hits": [{ "id": "wal", "title": "WAL mode" }] })),
            )
            .reply_to("read_note", json!({ "id": "gone" }), Reply::tool_error("no such note"))
            .install();
        let hits = MyNotes::search(SearchRequest { query: "wal".into(), limit: None }).unwrap();
        assert_eq!((hits[0].reference.as_str(), hits[0].title.as_str()), ("wal", "WAL mode"));
        assert_eq!(kit.calls()[0].arguments, json!({ "query": "wal", "limit": 10 }));
        let gone = MyNotes::retrieve(RetrieveRequest { reference: "gone".into() });
        assert!(matches!(gone, Err(ContractError::NotFound)));
    }
}
