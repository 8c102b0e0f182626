//! `memory-graph`: the `source-retrieval` contract over the knowledge graph of the published
//! memory server (`@modelcontextprotocol/server-memory`), written with the SDK's
//! search/read helpers (`airlock_sdk::source_retrieval::prelude`).
//!
//! Upstream tools (the mapping lists exactly these, both read-only), each answering
//! `structuredContent: {"entities": [{name, entityType, observations}], "relations": [..]}`:
//! - `search_nodes {query}`: the entities whose name, type or an observation contains the
//!   query (case-insensitive);
//! - `open_nodes {names}`: the named entities (none for an unknown name).
//!
//! A hit is an entity: its `reference` is the entity's name (the host shows the model an
//! opaque token instead), its title the name and type, its snippet the first observation.
//! A passage is the entity's name, type and observations as markdown; relations are left
//! out (this contract has no place for a link between sources).
//!
//! What the helpers do with the answers (the SDK's table): a host refusal converts as
//! everywhere; `isError` is `invalid-request` for a search, `not-found` for a read; an
//! answer of another shape is `upstream-failed` naming the tool; titles and snippets are
//! bounded. An entity `open_nodes` does not return is `not-found`.
//!
//! A search never shows an entity of type `airlock-record`: those are the records the
//! `knowledge-edits` adapter keeps in the same graph (one per change it made, holding its
//! idempotency key and the observations it added), bookkeeping for the host's
//! reconciliation and undo, not knowledge. A read takes only a reference a search
//! returned (the host resolves the token), so no record is read either.

use airlock_sdk::source_retrieval::prelude::*;
use serde::Deserialize;

/// The adapter; it keeps no state between calls.
struct MemoryGraph;

/// What both tools answer (the `relations` are not read).
#[derive(Deserialize)]
struct Graph {
    entities: Vec<Entity>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Entity {
    name: String,
    entity_type: String,
    observations: Vec<String>,
}

impl Guest for MemoryGraph {
    fn search(request: SearchRequest) -> Result<Vec<SourceHit>, ContractError> {
        // Sent upstream: `search_nodes {"query": <the request's query>}`.
        let graph: Graph = search_tool("search_nodes", &json!({ "query": request.query }))?;
        // Never the knowledge-edits adapter's records (its bookkeeping, not knowledge).
        let shown = |e: &Entity| e.entity_type != "airlock-record";
        let entities = graph.entities.into_iter().filter(shown);
        let entities = entities.take(request.limit_or(10, 50));
        let hit = |e: Entity| {
            let title = format!("{} ({})", e.name, e.entity_type);
            SourceHit::new(e.name, title).with_snippet(e.observations.first())
        };
        Ok(entities.map(hit).collect())
    }

    fn retrieve(request: RetrieveRequest) -> Result<SourcePassage, ContractError> {
        let name = request.reference;
        // Sent upstream: `open_nodes {"names": [<the reference>]}`.
        let graph: Graph = read_tool("open_nodes", &json!({ "names": [name] }))?;
        let entity = graph.entities.into_iter().find(|e| e.name == name);
        let entity = entity.ok_or(ContractError::NotFound)?;
        let mut text = format!("# {} ({})\n\n", entity.name, entity.entity_type);
        for observation in &entity.observations {
            text.push_str(&format!("- {observation}\n"));
        }
        Ok(SourcePassage::new(name, entity.name, text).with_media_type("text/markdown"))
    }
}

airlock_sdk::export_source_retrieval!(MemoryGraph);
