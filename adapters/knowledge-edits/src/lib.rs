//! `knowledge-edits`: the operator contract `example:knowledge-edits@1.0.0`
//! (`contracts/knowledge-edits/`, not built into Airlock) over the knowledge graph of the
//! published memory server, `@modelcontextprotocol/server-memory`.
//!
//! Upstream tools (the mapping lists exactly these), each answering `structuredContent`:
//! - `open_nodes {names}` → `{entities: [{name, entityType, observations}], relations:
//!   [{from, to, relationType}]}`: the named entities and every relation touching one;
//! - `create_entities {entities}` → `{entities}`: only those it created (a name that
//!   exists is skipped silently);
//! - `add_observations {observations: [{entityName, contents}]}` → `{results: [{entityName,
//!   addedObservations}]}`: only the contents the entity did not have (a content repeated
//!   in one request is added twice, so the adapter never sends a repeat); an unknown
//!   entity is a tool error and nothing is added;
//! - `delete_observations {deletions: [{entityName, observations}]}` and `delete_entities
//!   {entityNames}` (which also drops every relation touching the entity) → `{success}`.
//!
//! Each call reads the server's whole file and writes it back (atomically, by rename),
//! without a lock; the mapping runs one call of this adapter at a time.
//!
//! The server has no idempotency keys and no history, so the adapter keeps both in the
//! graph, through the same tools: a **record** entity per call, named
//! `airlock-changes/<idempotency key>`, of type `airlock-record` (the `memory-graph`
//! adapter never shows that type), whose observations are JSON entries (`Entry`). Before
//! `remember` adds anything it records what it will newly add (the request's observations,
//! repeats dropped, less those the entity already has) and whether it creates the entity;
//! if the server then added less (something else added one meanwhile), the record is
//! corrected to what the server reports. Then:
//! - `remember` with a key already recorded adds nothing and answers the recorded addition
//!   when it is in the graph (refused as `conflict` when it is not);
//! - `remembered(key)` (reconciliation) reads the record and the entity: every observation
//!   recorded is on the entity → the addition; none is (or the entity is gone) → none (it
//!   never landed); some are, or the entity has another type → `conflict`;
//! - `forget(addition)` removes exactly the observations recorded as newly added, never
//!   ones the entity had before. The rule: it is refused as `conflict` when the entity is
//!   gone or has another type, or when any of those observations is no longer on it
//!   (what is there is no longer what the addition left; undoing part of it would leave a
//!   state nobody asked for), and when another forget already undid it. Observations and
//!   relations others added since never block it and always stay: the entity the addition
//!   created is deleted only when nothing else (no observation, no relation) is on it.
//!   A forget records itself (`airlock-changes/<its key>`) before it removes anything and
//!   marks the addition's record `forgotten-by` its key once done, so a repeat under its
//!   key (the host sends one after an unknown outcome) finishes what it started and
//!   removes nothing twice.
//!
//! The server cannot tell one copy of a text from another: an observation removed and
//! added back by someone else after the addition is indistinguishable from the one the
//! addition made, and `forget` removes it.
//!
//! Locators: an `addition-ref` is the key of the call that made the addition. Names under
//! `airlock-changes/` and the type `airlock-record` are refused in requests.

use airlock_sdk::{log, upstream};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::json;
use sha2::Digest as _;

#[allow(missing_docs, clippy::all)]
mod bindings {
    wit_bindgen::generate!({
        path: "../../contracts/knowledge-edits",
        world: "example:knowledge-edits/knowledge-edits-adapter@1.0.0",
        with: {
            "airlock:host/upstream@0.1.0": airlock_sdk::bindings::airlock::host::upstream,
            "airlock:host/log@0.1.0": airlock_sdk::bindings::airlock::host::log,
        },
    });
}

use bindings::exports::example::knowledge_edits::knowledge_edits::{
    Addition, ContractError, ForgetRequest, Guest, RememberRequest, RememberedRequest,
};

/// The name of the record of the call under key `k` is this prefix and `k`.
const RECORD_PREFIX: &str = "airlock-changes/";

/// The entity type of every record (adapters/memory-graph hides entities of this type).
const RECORD_TYPE: &str = "airlock-record";

/// Most observations one request may add.
const MAX_OBSERVATIONS: usize = 64;

/// Longest observation (bytes).
const MAX_OBSERVATION_BYTES: usize = 4096;

/// Longest entity name or type (bytes).
const MAX_NAME_BYTES: usize = 256;

/// The adapter; it keeps no state between calls (the graph holds the records).
struct KnowledgeEdits;

/// An entity as the server reports it.
#[derive(Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
struct Entity {
    name: String,
    entity_type: String,
    observations: Vec<String>,
}

/// A relation as the server reports it (its type is not read).
#[derive(Deserialize, Clone, Debug, PartialEq)]
struct Relation {
    from: String,
    to: String,
}

/// What `open_nodes` answers.
#[derive(Deserialize)]
struct Graph {
    entities: Vec<Entity>,
    #[serde(default)]
    relations: Vec<Relation>,
}

/// What `create_entities` answers: the entities it created.
#[derive(Deserialize)]
struct Created {
    entities: Vec<Entity>,
}

/// What `add_observations` answers.
#[derive(Deserialize)]
struct Added {
    results: Vec<AddedTo>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct AddedTo {
    entity_name: String,
    added_observations: Vec<String>,
}

/// An addition as recorded: the entity and what it newly added.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
struct Remembered {
    entity: String,
    entity_type: String,
    created: bool,
    added: Vec<String>,
}

impl Remembered {
    fn addition(&self, key: &str, forgotten: bool) -> Addition {
        Addition {
            addition: key.to_owned(),
            entity: self.entity.clone(),
            entity_type: self.entity_type.clone(),
            added: u32::try_from(self.added.len()).unwrap_or(u32::MAX),
            created: self.created,
            added_sha256: added_sha256(&self.added),
            forgotten,
        }
    }
}

/// One observation of a record entity (JSON).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(tag = "op", rename_all = "kebab-case", deny_unknown_fields)]
enum Entry {
    /// The addition made under the record's key (the last one is current: a correction
    /// is added after the entry it corrects).
    Remember(Remembered),
    /// The record's key undoes the addition made under `addition`.
    Forget { addition: String },
    /// On an addition's record: the forget under `key` undid it.
    ForgottenBy { key: String },
}

impl Entry {
    fn text(&self) -> String {
        serde_json::to_string(self).expect("an entry serializes")
    }
}

/// What a call did, read from its record.
#[derive(Debug, Clone, PartialEq)]
enum Op {
    Remember(Remembered),
    Forget { addition: String },
}

/// A record entity's observations, folded.
#[derive(Debug, Clone, PartialEq)]
struct Record {
    op: Op,
    forgotten_by: Option<String>,
}

/// Folds a record entity's observations; `Err` names what does not parse.
fn fold(observations: &[String]) -> Result<Option<Record>, String> {
    let mut current = None;
    let mut forgotten_by = None;
    for text in observations {
        let entry: Entry = serde_json::from_str(text)
            .map_err(|e| format!("a record entry does not parse: {e}"))?;
        match entry {
            Entry::Remember(r) => current = Some(Op::Remember(r)),
            Entry::Forget { addition } => current = Some(Op::Forget { addition }),
            Entry::ForgottenBy { key } => {
                forgotten_by.get_or_insert(key);
            }
        }
    }
    Ok(current.map(|op| Record { op, forgotten_by }))
}

/// sha256 of `added` as a compact JSON array of strings.
fn added_sha256(added: &[String]) -> String {
    let text = serde_json::to_string(added).expect("strings serialize");
    hex::encode(sha2::Sha256::digest(text.as_bytes()))
}

/// Refuses a key the host would not issue (it names a record entity).
fn check_key(key: &str) -> Result<(), ContractError> {
    let ok = !key.is_empty()
        && key.len() <= 128
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if ok {
        Ok(())
    } else {
        Err(ContractError::InvalidRequest(
            "the idempotency key is not one the host issues".into(),
        ))
    }
}

fn record_name(key: &str) -> String {
    format!("{RECORD_PREFIX}{key}")
}

/// `text` checked as an entity name or type (`what`).
fn check_name(what: &str, text: &str) -> Result<(), ContractError> {
    if text.trim().is_empty() || text.len() > MAX_NAME_BYTES || text.chars().any(char::is_control) {
        return Err(ContractError::InvalidRequest(format!(
            "the {what} must be one line of 1 to {MAX_NAME_BYTES} bytes"
        )));
    }
    Ok(())
}

/// The request's observations, checked, repeats dropped (first kept, order kept).
fn checked(request: &RememberRequest) -> Result<Vec<String>, ContractError> {
    check_name("entity name", &request.entity)?;
    check_name("entity type", &request.entity_type)?;
    if request.entity.starts_with(RECORD_PREFIX) || request.entity_type == RECORD_TYPE {
        return Err(ContractError::InvalidRequest(format!(
            "names under `{RECORD_PREFIX}` and the type `{RECORD_TYPE}` are the adapter's records"
        )));
    }
    let all = &request.observations;
    if all.is_empty() || all.len() > MAX_OBSERVATIONS {
        return Err(ContractError::InvalidRequest(format!(
            "give 1 to {MAX_OBSERVATIONS} observations"
        )));
    }
    let mut kept: Vec<String> = Vec::new();
    for o in all {
        if o.trim().is_empty() || o.len() > MAX_OBSERVATION_BYTES {
            return Err(ContractError::InvalidRequest(format!(
                "an observation must have text, at most {MAX_OBSERVATION_BYTES} bytes"
            )));
        }
        if !kept.contains(o) {
            kept.push(o.clone());
        }
    }
    Ok(kept)
}

/// What adding `observations` to `entity` (as it is now, `None` when absent) will newly
/// add; refused when the entity exists with another type.
fn plan(
    request: &RememberRequest,
    observations: &[String],
    existing: Option<&Entity>,
) -> Result<Remembered, ContractError> {
    let (created, had): (bool, &[String]) = match existing {
        None => (true, &[]),
        Some(e) if e.entity_type != request.entity_type => {
            return Err(ContractError::Conflict(format!(
                "`{}` exists with type `{}`, not `{}`",
                e.name, e.entity_type, request.entity_type
            )));
        }
        Some(e) => (false, &e.observations),
    };
    Ok(Remembered {
        entity: request.entity.clone(),
        entity_type: request.entity_type.clone(),
        created,
        added: observations
            .iter()
            .filter(|o| !had.contains(o))
            .cloned()
            .collect(),
    })
}

/// Where a recorded addition stands in the graph.
#[derive(Debug, Clone, PartialEq)]
enum Status {
    /// Everything it added is there (or it added nothing).
    Landed,
    /// None of it is there, or the entity is gone.
    Absent,
    /// Part of it is, or the entity has another type. Payload: why.
    Changed(String),
}

fn status(r: &Remembered, now: Option<&Entity>) -> Status {
    if r.added.is_empty() {
        return Status::Landed;
    }
    let Some(e) = now else {
        return Status::Absent;
    };
    if e.entity_type != r.entity_type {
        return Status::Changed(format!(
            "`{}` now has type `{}`, not `{}`: it was replaced since",
            e.name, e.entity_type, r.entity_type
        ));
    }
    let there = r
        .added
        .iter()
        .filter(|o| e.observations.contains(o))
        .count();
    if there == r.added.len() {
        Status::Landed
    } else if there == 0 {
        Status::Absent
    } else {
        Status::Changed(format!(
            "{} of the {} observations added to `{}` were removed since",
            r.added.len() - there,
            r.added.len(),
            e.name
        ))
    }
}

/// Whether the entity an addition created may go: nothing but `removed` was on it and no
/// relation touches it.
fn only_these(e: &Entity, relations: &[Relation], removed: &[String]) -> bool {
    e.observations.iter().all(|o| removed.contains(o))
        && !relations.iter().any(|r| r.from == e.name || r.to == e.name)
}

/// Calls `tool`; a tool-reported failure is `unavailable` with its message.
fn call<T: DeserializeOwned>(tool: &str, args: &serde_json::Value) -> Result<T, ContractError> {
    let output = upstream::call_tool_json(tool, args)
        .map_err(|e| ContractError::Unavailable(e.describe()))?;
    if let Some(message) = output.error_message() {
        return Err(ContractError::Unavailable(format!("{tool}: {message}")));
    }
    output
        .structured()
        .map_err(|e| ContractError::UpstreamFailed(format!("{tool}: {e}")))
}

/// Calls a tool whose answer the adapter does not read.
fn send(tool: &str, args: &serde_json::Value) -> Result<(), ContractError> {
    call::<serde_json::Value>(tool, args).map(|_| ())
}

/// The entity named `name` (if any) and the relations touching it.
fn open(name: &str) -> Result<(Option<Entity>, Vec<Relation>), ContractError> {
    let graph: Graph = call("open_nodes", &json!({ "names": [name] }))?;
    let entity = graph.entities.into_iter().find(|e| e.name == name);
    let relations = graph
        .relations
        .into_iter()
        .filter(|r| r.from == name || r.to == name)
        .collect();
    Ok((entity, relations))
}

/// The record of the call under `key`, if any.
fn record(key: &str) -> Result<Option<Record>, ContractError> {
    check_key(key)?;
    let name = record_name(key);
    let Some(e) = open(&name)?.0 else {
        return Ok(None);
    };
    if e.entity_type != RECORD_TYPE {
        return Err(ContractError::Conflict(format!(
            "`{name}` is an entity of type `{}`, not the adapter's record",
            e.entity_type
        )));
    }
    fold(&e.observations).map_err(|why| ContractError::UpstreamFailed(format!("`{name}`: {why}")))
}

/// Writes the record of the call under `key`; false when one existed already.
fn write_record(key: &str, entry: &Entry) -> Result<bool, ContractError> {
    let name = record_name(key);
    let made: Created = call(
        "create_entities",
        &json!({ "entities": [{ "name": name, "entityType": RECORD_TYPE, "observations": [entry.text()] }] }),
    )?;
    Ok(made.entities.iter().any(|e| e.name == name))
}

/// Adds `entry` to the record under `key`.
fn append(key: &str, entry: &Entry) -> Result<(), ContractError> {
    send(
        "add_observations",
        &json!({ "observations": [{ "entityName": record_name(key), "contents": [entry.text()] }] }),
    )
}

/// The observations `add_observations` newly added to `entity`.
fn add(entity: &str, contents: &[String]) -> Result<Vec<String>, ContractError> {
    let answer: Added = call(
        "add_observations",
        &json!({ "observations": [{ "entityName": entity, "contents": contents }] }),
    )?;
    Ok(answer
        .results
        .into_iter()
        .filter(|r| r.entity_name == entity)
        .flat_map(|r| r.added_observations)
        .collect())
}

/// Makes the recorded addition `p`; answers what the server reports it did.
fn apply(p: &Remembered) -> Result<Remembered, ContractError> {
    let mut done = p.clone();
    if p.created {
        let made: Created = call(
            "create_entities",
            &json!({ "entities": [{ "name": p.entity, "entityType": p.entity_type, "observations": p.added }] }),
        )?;
        if made.entities.iter().any(|e| e.name == p.entity) {
            return Ok(done);
        }
        // The entity appeared since it was read: add to it instead, if it is the same thing.
        done.created = false;
        if let (Some(e), _) = open(&p.entity)?
            && e.entity_type != p.entity_type
        {
            return Err(ContractError::Conflict(format!(
                "`{}` was just created by someone else with type `{}`; nothing was added",
                e.name, e.entity_type
            )));
        }
    }
    if !p.added.is_empty() {
        done.added = add(&p.entity, &p.added)?;
    }
    Ok(done)
}

/// The recorded addition under `key`: `Some` when it is in the graph (or was forgotten
/// since), `None` when it never landed.
fn answer(key: &str, rec: Record) -> Result<Option<Addition>, ContractError> {
    let Op::Remember(r) = rec.op else {
        return Err(ContractError::InvalidRequest(format!(
            "{key} is the key of a forget, not of an addition"
        )));
    };
    if rec.forgotten_by.is_some() {
        return Ok(Some(r.addition(key, true)));
    }
    let (now, _) = open(&r.entity)?;
    match status(&r, now.as_ref()) {
        Status::Landed => Ok(Some(r.addition(key, false))),
        Status::Absent => Ok(None),
        Status::Changed(why) => Err(ContractError::Conflict(why)),
    }
}

impl Guest for KnowledgeEdits {
    fn remember(request: RememberRequest) -> Result<Addition, ContractError> {
        let key = request.idempotency_key.clone();
        let observations = checked(&request)?;
        let recorded = |rec: Record| match answer(&key, rec)? {
            Some(done) if done.entity == request.entity => {
                log::info(&format!(
                    "remember {key}: already recorded, nothing added again"
                ));
                Ok(done)
            }
            Some(_) => Err(ContractError::InvalidRequest(format!(
                "{key} is the key of an addition to another entity"
            ))),
            None => Err(ContractError::Conflict(format!(
                "an addition is recorded under {key} but is not in the graph; nothing is added twice"
            ))),
        };
        if let Some(rec) = record(&key)? {
            return recorded(rec);
        }
        let (existing, _) = open(&request.entity)?;
        let planned = plan(&request, &observations, existing.as_ref())?;
        let entry = Entry::Remember(planned.clone());
        if !write_record(&key, &entry)? {
            let rec = record(&key)?.ok_or_else(|| {
                ContractError::UpstreamFailed(format!("the record of {key} vanished"))
            })?;
            return recorded(rec);
        }
        let done = apply(&planned)?;
        if done != planned {
            // Something else added part of it meanwhile: record what this call added, so
            // that `forget` never removes the rest.
            append(&key, &Entry::Remember(done.clone()))?;
            send(
                "delete_observations",
                &json!({ "deletions": [{ "entityName": record_name(&key), "observations": [entry.text()] }] }),
            )?;
        }
        Ok(done.addition(&key, false))
    }

    fn remembered(request: RememberedRequest) -> Result<Option<Addition>, ContractError> {
        let key = request.idempotency_key;
        match record(&key)? {
            None => Ok(None),
            Some(rec) => answer(&key, rec),
        }
    }

    fn forget(request: ForgetRequest) -> Result<Addition, ContractError> {
        let (key, of) = (request.idempotency_key, request.addition);
        check_key(&key)?;
        if key == of {
            return Err(ContractError::InvalidRequest(
                "a forget cannot undo itself".into(),
            ));
        }
        // A repeat of this very forget (its answer was lost) finishes what it started.
        let repeat = match record(&key)? {
            None => false,
            Some(Record {
                op: Op::Forget { addition },
                ..
            }) if addition == of => true,
            Some(_) => {
                return Err(ContractError::InvalidRequest(format!(
                    "{key} is the key of another request"
                )));
            }
        };
        let rec = record(&of)?.ok_or(ContractError::NotFound)?;
        let Op::Remember(r) = rec.op else {
            return Err(ContractError::NotFound);
        };
        match rec.forgotten_by {
            Some(by) if by == key => return Ok(r.addition(&of, true)),
            Some(_) => {
                return Err(ContractError::Conflict(
                    "the addition was already forgotten by another request".into(),
                ));
            }
            None => {}
        }
        let (now, _) = open(&r.entity)?;
        let remove = match status(&r, now.as_ref()) {
            Status::Landed => !r.added.is_empty(),
            // This forget removed them before its answer was lost.
            Status::Absent if repeat => false,
            Status::Absent if now.is_none() => {
                return Err(ContractError::Conflict(format!(
                    "`{}` no longer exists",
                    r.entity
                )));
            }
            Status::Absent => {
                return Err(ContractError::Conflict(format!(
                    "none of the observations added to `{}` is on it any more",
                    r.entity
                )));
            }
            Status::Changed(why) => return Err(ContractError::Conflict(why)),
        };
        if !repeat {
            write_record(
                &key,
                &Entry::Forget {
                    addition: of.clone(),
                },
            )?;
        }
        if remove {
            send(
                "delete_observations",
                &json!({ "deletions": [{ "entityName": r.entity, "observations": r.added }] }),
            )?;
        }
        if r.created
            && let (Some(e), relations) = open(&r.entity)?
            && e.entity_type == r.entity_type
            && only_these(&e, &relations, &r.added)
        {
            send("delete_entities", &json!({ "entityNames": [r.entity] }))?;
        }
        append(&of, &Entry::ForgottenBy { key: key.clone() })?;
        log::info(&format!("forget {key}: undid {of}"));
        Ok(r.addition(&of, true))
    }
}

// The component's exports; a native build (`cargo test --workspace`) only checks the
// functions exist, as the SDK's export macros do (a native cdylib cannot carry WIT names).
#[cfg(target_arch = "wasm32")]
bindings::export!(KnowledgeEdits with_types_in bindings);

#[cfg(not(target_arch = "wasm32"))]
const _: () = {
    let _ = <KnowledgeEdits as Guest>::remember;
    let _ = <KnowledgeEdits as Guest>::remembered;
    let _ = <KnowledgeEdits as Guest>::forget;
};

#[cfg(test)]
mod tests {
    use super::*;

    fn request(entity: &str, entity_type: &str, observations: &[&str]) -> RememberRequest {
        RememberRequest {
            entity: entity.into(),
            entity_type: entity_type.into(),
            observations: observations.iter().map(|o| o.to_string()).collect(),
            idempotency_key: "idk_0".into(),
        }
    }

    fn entity(name: &str, entity_type: &str, observations: &[&str]) -> Entity {
        Entity {
            name: name.into(),
            entity_type: entity_type.into(),
            observations: observations.iter().map(|o| o.to_string()).collect(),
        }
    }

    fn strings(all: &[&str]) -> Vec<String> {
        all.iter().map(|o| o.to_string()).collect()
    }

    #[test]
    fn a_request_keeps_each_observation_once_and_never_names_a_record() {
        let kept = checked(&request("Ada", "person", &["a", "b", "a"])).unwrap();
        assert_eq!(
            kept,
            strings(&["a", "b"]),
            "the server would add a repeat twice"
        );
        for bad in [
            request("", "person", &["a"]),
            request("  ", "person", &["a"]),
            request("Ada\nLovelace", "person", &["a"]),
            request("Ada", "", &["a"]),
            request("Ada", "person", &[]),
            request("Ada", "person", &[""]),
            request("Ada", "person", &[&"x".repeat(MAX_OBSERVATION_BYTES + 1)]),
            request(&"n".repeat(MAX_NAME_BYTES + 1), "person", &["a"]),
            request("airlock-changes/idk_1", "note", &["a"]),
            request("Ada", "airlock-record", &["a"]),
        ] {
            assert!(
                matches!(checked(&bad), Err(ContractError::InvalidRequest(_))),
                "{:?} {:?}",
                bad.entity,
                bad.entity_type
            );
        }
        let many: Vec<String> = (0..=MAX_OBSERVATIONS).map(|i| i.to_string()).collect();
        let mut r = request("Ada", "person", &[]);
        r.observations = many;
        assert!(matches!(checked(&r), Err(ContractError::InvalidRequest(_))));
    }

    #[test]
    fn only_keys_the_host_issues_name_a_record() {
        assert!(check_key("idk_0123456789abcdef").is_ok());
        for bad in ["", "a/b", "..", "k y", "x\u{0}", &"k".repeat(129)] {
            assert!(check_key(bad).is_err(), "{bad:?}");
        }
        assert_eq!(record_name("idk_1"), "airlock-changes/idk_1");
    }

    #[test]
    fn a_plan_adds_only_what_the_entity_lacks_and_creates_only_what_is_absent() {
        let r = request("Ada", "person", &["known", "new"]);
        let obs = checked(&r).unwrap();
        let had = entity("Ada", "person", &["known"]);
        let p = plan(&r, &obs, Some(&had)).unwrap();
        assert_eq!((p.created, p.added), (false, strings(&["new"])));
        let p = plan(&r, &obs, None).unwrap();
        assert_eq!((p.created, p.added), (true, strings(&["known", "new"])));
        let other = entity("Ada", "ship", &[]);
        assert!(matches!(
            plan(&r, &obs, Some(&other)),
            Err(ContractError::Conflict(m)) if m.contains("`ship`")
        ));
    }

    fn remembered(created: bool, added: &[&str]) -> Remembered {
        Remembered {
            entity: "Ada".into(),
            entity_type: "person".into(),
            created,
            added: strings(added),
        }
    }

    #[test]
    fn the_status_of_an_addition_is_read_from_the_entity() {
        let r = remembered(false, &["a", "b"]);
        let with = |obs: &[&str]| entity("Ada", "person", obs);
        assert_eq!(status(&r, Some(&with(&["x", "a", "b"]))), Status::Landed);
        assert_eq!(status(&r, Some(&with(&["x"]))), Status::Absent);
        assert_eq!(status(&r, None), Status::Absent);
        assert!(
            matches!(status(&r, Some(&with(&["a"]))), Status::Changed(m) if m.contains("1 of the 2"))
        );
        let replaced = entity("Ada", "ship", &["a", "b"]);
        assert!(
            matches!(status(&r, Some(&replaced)), Status::Changed(m) if m.contains("replaced"))
        );
        // An addition that added nothing is there whatever the entity holds.
        assert_eq!(status(&remembered(false, &[]), None), Status::Landed);
    }

    #[test]
    fn a_record_folds_to_its_last_entry_and_its_forget() {
        let first = Entry::Remember(remembered(true, &["a", "b"]));
        let corrected = Entry::Remember(remembered(false, &["b"]));
        let marker = Entry::ForgottenBy {
            key: "idk_2".into(),
        };
        let rec = fold(&[first.text(), corrected.text(), marker.text()])
            .unwrap()
            .unwrap();
        assert_eq!(rec.op, Op::Remember(remembered(false, &["b"])));
        assert_eq!(rec.forgotten_by.as_deref(), Some("idk_2"));
        let forget = Entry::Forget {
            addition: "idk_1".into(),
        };
        assert_eq!(
            fold(&[forget.text()]).unwrap().unwrap().op,
            Op::Forget {
                addition: "idk_1".into()
            }
        );
        assert_eq!(fold(&[]).unwrap(), None);
        assert!(fold(&["not json".into()]).is_err());
        assert!(fold(&[r#"{"op":"remember","entity":"A","entity_type":"t","created":true,"added":[],"extra":1}"#.into()]).is_err());
        assert!(
            first.text().starts_with(r#"{"op":"remember","#),
            "{}",
            first.text()
        );
    }

    #[test]
    fn an_addition_reports_the_digest_of_what_it_added() {
        let a = remembered(true, &["a", "b \"c\""]).addition("idk_1", false);
        assert_eq!(a.addition, "idk_1");
        assert_eq!(a.added, 2);
        assert!(a.created && !a.forgotten);
        // The compact JSON text of the list, as a person approving it is shown its digest.
        let text = serde_json::json!(["a", "b \"c\""]).to_string();
        assert_eq!(
            a.added_sha256,
            hex::encode(sha2::Sha256::digest(text.as_bytes()))
        );
        assert_eq!(added_sha256(&[]), hex::encode(sha2::Sha256::digest(b"[]")));
    }

    /// The flows, against the SDK's test kit answering as the memory server would (each
    /// `open_nodes` answer is canned for the names asked).
    mod flows {
        use super::*;
        use airlock_sdk::testing::{Reply, Upstream};
        use serde_json::Value;

        fn graph(entities: Value) -> Reply {
            Reply::structured(json!({ "entities": entities, "relations": [] }))
        }

        fn record_entity(key: &str, entries: &[Entry]) -> Value {
            let texts: Vec<String> = entries.iter().map(Entry::text).collect();
            json!([{ "name": record_name(key), "entityType": RECORD_TYPE, "observations": texts }])
        }

        fn open(name: &str) -> Value {
            json!({ "names": [name] })
        }

        fn ada(observations: &[&str]) -> Value {
            json!([{ "name": "Ada", "entityType": "person", "observations": observations }])
        }

        fn ok() -> Reply {
            Reply::structured(json!({ "success": true, "message": "done" }))
        }

        fn tools(kit: &airlock_sdk::testing::Installed) -> Vec<String> {
            kit.calls().into_iter().map(|c| c.tool).collect()
        }

        #[test]
        fn a_remember_records_first_and_then_what_the_server_really_added() {
            let planned = Entry::Remember(remembered(false, &["b", "c"]));
            let done = Entry::Remember(remembered(false, &["c"]));
            let kit = Upstream::from_mapping("mapping.toml")
                .reply_to(
                    "open_nodes",
                    open("airlock-changes/idk_1"),
                    graph(json!([])),
                )
                .reply_to("open_nodes", open("Ada"), graph(ada(&["a"])))
                .reply(
                    "create_entities",
                    Reply::structured(
                        json!({ "entities": record_entity("idk_1", std::slice::from_ref(&planned)) }),
                    ),
                )
                // Something else added "b" between the read and the addition.
                .reply_to(
                    "add_observations",
                    json!({ "observations": [{ "entityName": "Ada", "contents": ["b", "c"] }] }),
                    Reply::structured(
                        json!({ "results": [{ "entityName": "Ada", "addedObservations": ["c"] }] }),
                    ),
                )
                .reply(
                    "add_observations",
                    Reply::structured(json!({ "results": [] })),
                )
                .reply("delete_observations", ok())
                .install();
            let mut r = request("Ada", "person", &["a", "b", "c", "b"]);
            r.idempotency_key = "idk_1".into();
            let a = KnowledgeEdits::remember(r).unwrap();
            assert_eq!((a.added, a.created), (1, false));
            assert_eq!(a.added_sha256, added_sha256(&strings(&["c"])));
            assert_eq!(
                tools(&kit),
                [
                    "open_nodes",
                    "open_nodes",
                    "create_entities",
                    "add_observations",
                    "add_observations",
                    "delete_observations"
                ],
                "the record is written before the addition"
            );
            let calls = kit.calls();
            assert_eq!(
                calls[2].arguments["entities"][0]["observations"],
                json!([planned.text()])
            );
            // The correction goes in first, then the planned entry goes: a record never
            // claims "b", which this call did not add (forget would remove it).
            assert_eq!(
                calls[4].arguments,
                json!({ "observations": [{ "entityName": "airlock-changes/idk_1", "contents": [done.text()] }] })
            );
            assert_eq!(
                calls[5].arguments,
                json!({ "deletions": [{ "entityName": "airlock-changes/idk_1", "observations": [planned.text()] }] })
            );
        }

        #[test]
        fn a_key_already_recorded_adds_nothing_and_answers_by_the_graph() {
            let rec = record_entity("idk_1", &[Entry::Remember(remembered(false, &["b"]))]);
            let mut r = request("Ada", "person", &["b"]);
            r.idempotency_key = "idk_1".into();
            let kit = Upstream::from_mapping("mapping.toml")
                .reply_to(
                    "open_nodes",
                    open("airlock-changes/idk_1"),
                    graph(rec.clone()),
                )
                .reply_to("open_nodes", open("Ada"), graph(ada(&["a", "b"])))
                .install();
            assert_eq!(KnowledgeEdits::remember(r.clone()).unwrap().added, 1);
            assert_eq!(tools(&kit), ["open_nodes", "open_nodes"], "nothing written");
            drop(kit);
            // Recorded but not in the graph: neither added now nor claimed.
            let _kit = Upstream::from_mapping("mapping.toml")
                .reply_to("open_nodes", open("airlock-changes/idk_1"), graph(rec))
                .reply_to("open_nodes", open("Ada"), graph(ada(&["a"])))
                .install();
            assert!(matches!(
                KnowledgeEdits::remember(r),
                Err(ContractError::Conflict(m)) if m.contains("nothing is added twice")
            ));
            let found = KnowledgeEdits::remembered(RememberedRequest {
                idempotency_key: "idk_1".into(),
            });
            assert!(found.unwrap().is_none(), "it never landed");
        }

        #[test]
        fn a_forget_records_itself_removes_what_was_added_and_a_repeat_removes_nothing_twice() {
            let addition = record_entity("idk_1", &[Entry::Remember(remembered(false, &["b"]))]);
            let forget = Entry::Forget {
                addition: "idk_1".into(),
            };
            let request = || ForgetRequest {
                addition: "idk_1".into(),
                idempotency_key: "idk_2".into(),
            };
            let kit = Upstream::from_mapping("mapping.toml")
                .reply_to(
                    "open_nodes",
                    open("airlock-changes/idk_2"),
                    graph(json!([])),
                )
                .reply_to(
                    "open_nodes",
                    open("airlock-changes/idk_1"),
                    graph(addition.clone()),
                )
                .reply_to("open_nodes", open("Ada"), graph(ada(&["a", "b"])))
                .reply(
                    "create_entities",
                    Reply::structured(
                        json!({ "entities": record_entity("idk_2", std::slice::from_ref(&forget)) }),
                    ),
                )
                .reply("delete_observations", ok())
                .reply(
                    "add_observations",
                    Reply::structured(json!({ "results": [] })),
                )
                .install();
            let a = KnowledgeEdits::forget(request()).unwrap();
            assert_eq!((a.addition.as_str(), a.forgotten), ("idk_1", true));
            assert_eq!(
                tools(&kit),
                [
                    "open_nodes",
                    "open_nodes",
                    "open_nodes",
                    "create_entities",
                    "delete_observations",
                    "add_observations"
                ],
                "recorded before anything is removed; the addition marked once done"
            );
            let calls = kit.calls();
            assert_eq!(
                calls[4].arguments,
                json!({ "deletions": [{ "entityName": "Ada", "observations": ["b"] }] }),
                "only what the addition added"
            );
            assert_eq!(
                calls[5].arguments["observations"][0]["contents"],
                json!([Entry::ForgottenBy {
                    key: "idk_2".into()
                }
                .text()])
            );
            drop(kit);

            // The same forget again after its answer was lost, "b" already gone: it
            // removes nothing and marks the addition.
            let kit = Upstream::from_mapping("mapping.toml")
                .reply_to(
                    "open_nodes",
                    open("airlock-changes/idk_2"),
                    graph(record_entity("idk_2", std::slice::from_ref(&forget))),
                )
                .reply_to(
                    "open_nodes",
                    open("airlock-changes/idk_1"),
                    graph(addition.clone()),
                )
                .reply_to("open_nodes", open("Ada"), graph(ada(&["a"])))
                .reply(
                    "add_observations",
                    Reply::structured(json!({ "results": [] })),
                )
                .install();
            assert!(KnowledgeEdits::forget(request()).unwrap().forgotten);
            assert_eq!(
                tools(&kit),
                ["open_nodes", "open_nodes", "open_nodes", "add_observations"]
            );
            drop(kit);

            // Once marked, a repeat only reads; another forget of it is refused.
            let marked = record_entity(
                "idk_1",
                &[
                    Entry::Remember(remembered(false, &["b"])),
                    Entry::ForgottenBy {
                        key: "idk_2".into(),
                    },
                ],
            );
            let kit = Upstream::from_mapping("mapping.toml")
                .reply_to(
                    "open_nodes",
                    open("airlock-changes/idk_2"),
                    graph(record_entity("idk_2", &[forget])),
                )
                .reply_to(
                    "open_nodes",
                    open("airlock-changes/idk_3"),
                    graph(json!([])),
                )
                .reply_to("open_nodes", open("airlock-changes/idk_1"), graph(marked))
                .install();
            assert!(KnowledgeEdits::forget(request()).unwrap().forgotten);
            let other = ForgetRequest {
                addition: "idk_1".into(),
                idempotency_key: "idk_3".into(),
            };
            assert!(matches!(
                KnowledgeEdits::forget(other),
                Err(ContractError::Conflict(m)) if m.contains("already forgotten")
            ));
            assert!(tools(&kit).iter().all(|t| t == "open_nodes"), "only reads");
            drop(kit);

            // A first forget whose observation someone removed: refused, nothing written.
            let kit = Upstream::from_mapping("mapping.toml")
                .reply_to(
                    "open_nodes",
                    open("airlock-changes/idk_2"),
                    graph(json!([])),
                )
                .reply_to("open_nodes", open("airlock-changes/idk_1"), graph(addition))
                .reply_to("open_nodes", open("Ada"), graph(ada(&["a"])))
                .install();
            assert!(matches!(
                KnowledgeEdits::forget(request()),
                Err(ContractError::Conflict(m)) if m.contains("any more")
            ));
            assert!(tools(&kit).iter().all(|t| t == "open_nodes"), "only reads");
        }

        #[test]
        fn a_forget_deletes_the_entity_it_created_only_when_nothing_else_is_on_it() {
            let rec = |added: &[&str]| {
                record_entity("idk_1", &[Entry::Remember(remembered(true, added))])
            };
            let run = |after: Reply| {
                let kit = Upstream::from_mapping("mapping.toml")
                    .reply_to(
                        "open_nodes",
                        open("airlock-changes/idk_2"),
                        graph(json!([])),
                    )
                    .reply_to(
                        "open_nodes",
                        open("airlock-changes/idk_1"),
                        graph(rec(&["b"])),
                    )
                    .reply_to("open_nodes", open("Ada"), after)
                    .reply(
                        "create_entities",
                        Reply::structured(json!({ "entities": [] })),
                    )
                    .reply("delete_observations", ok())
                    .reply("delete_entities", ok())
                    .reply(
                        "add_observations",
                        Reply::structured(json!({ "results": [] })),
                    )
                    .install();
                KnowledgeEdits::forget(ForgetRequest {
                    addition: "idk_1".into(),
                    idempotency_key: "idk_2".into(),
                })
                .unwrap();
                tools(&kit)
            };
            // The kit answers every read of Ada alike: "b" still there reads as nothing
            // else on it once "b" is removed.
            assert!(run(graph(ada(&["b"]))).contains(&"delete_entities".to_string()));
            assert!(!run(graph(ada(&["b", "other"]))).contains(&"delete_entities".to_string()));
            let related = Reply::structured(json!({
                "entities": ada(&["b"]),
                "relations": [{ "from": "Babbage", "to": "Ada", "relationType": "knew" }],
            }));
            assert!(!run(related).contains(&"delete_entities".to_string()));
        }
    }

    #[test]
    fn a_created_entity_goes_only_when_nothing_else_is_on_it() {
        let added = strings(&["a"]);
        let e = entity("Ada", "person", &["a"]);
        assert!(only_these(&e, &[], &added));
        assert!(only_these(&entity("Ada", "person", &[]), &[], &added));
        assert!(!only_these(
            &entity("Ada", "person", &["a", "other"]),
            &[],
            &added
        ));
        let rel = Relation {
            from: "Babbage".into(),
            to: "Ada".into(),
        };
        assert!(!only_these(&e, &[rel], &added));
    }
}
