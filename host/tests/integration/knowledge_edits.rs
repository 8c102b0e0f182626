//! A second operator-defined contract over a real published server:
//! `example:knowledge-edits@1.0.0` (`contracts/knowledge-edits/`, named by the serve
//! configuration, not built into Airlock) through the `knowledge-edits` adapter over
//! `@modelcontextprotocol/server-memory`, with a real MCP client, beside the read-only
//! `memory-graph` mapping on the same connection. Remembering is a `reversible-mutation`,
//! so the built-in policy asks a person first: an addition nobody approved never reaches
//! the server, one approval adds each observation exactly once, and the addition is
//! forgotten by its own reference (or out of band), never taking what was there before.
//!
//! The server keeps its graph in the JSONL file `MEMORY_FILE_PATH` names, reading it on
//! every call and writing it back through a temporary file beside it (so its folder, not
//! just the file, is granted read-write); each test has its own.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use sha2::Digest as _;

use airlock::pipeline::Category;

use crate::common::*;

const PACKAGE: &str = "example:knowledge-edits@1.0.0";

const ALGORITHM: &str = "Wrote the first published algorithm";
const BABBAGE: &str = "Worked with Charles Babbage";
const MENABREA: &str = "Translated Menabrea's paper on the Analytical Engine";

fn sha(text: &str) -> String {
    hex::encode(sha2::Sha256::digest(text.as_bytes()))
}

/// sha256 of a list of texts as compact JSON: what the approval summary shows for the
/// `observations` argument and what an addition reports as `added-sha256`.
fn sha_of(list: &[&str]) -> String {
    sha(&json!(list).to_string())
}

/// The graph each test starts with: one person with two observations.
fn seed() -> String {
    json!({"type": "entity", "name": "Ada Lovelace", "entityType": "person",
           "observations": [ALGORITHM, BABBAGE]})
    .to_string()
}

/// A folder holding `memory.jsonl` seeded with [`seed`].
fn graph_folder() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("memory.jsonl"), seed()).unwrap();
    dir
}

fn graph_file(dir: &Path) -> PathBuf {
    dir.join("memory.jsonl")
}

/// The graph file's lines, parsed.
fn lines(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(graph_file(dir))
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The entity named `name` in the graph file, if any.
fn entity(dir: &Path, name: &str) -> Option<Value> {
    lines(dir)
        .into_iter()
        .find(|l| l["type"] == "entity" && l["name"] == name)
}

/// The observations of entity `name` (panics when it does not exist).
fn observations(dir: &Path, name: &str) -> Vec<String> {
    let e = entity(dir, name).unwrap_or_else(|| panic!("no entity {name}"));
    serde_json::from_value(e["observations"].clone()).unwrap()
}

/// How many records the adapter keeps in the graph (one per remember or forget).
fn records(dir: &Path) -> usize {
    lines(dir)
        .iter()
        .filter(|l| l["entityType"] == "airlock-record")
        .count()
}

/// Rewrites entity `name` in the graph file (as another client of the server would).
fn edit_entity(dir: &Path, name: &str, edit: impl FnOnce(&mut Value)) {
    let mut all = lines(dir);
    let e = all
        .iter_mut()
        .find(|l| l["type"] == "entity" && l["name"] == name)
        .unwrap();
    edit(e);
    let text: Vec<String> = all.iter().map(Value::to_string).collect();
    std::fs::write(graph_file(dir), text.join("\n")).unwrap();
}

/// The `[[contract]]` table naming the repository's package.
fn contract_table() -> String {
    format!(
        "[[contract]]\npath = {:?}\n",
        workspace()
            .join("contracts/knowledge-edits")
            .display()
            .to_string()
    )
}

/// The memory server over `dir`'s graph (confined, its folder read-write) as connection
/// `memory`, the `knowledge-edits` and `memory-graph` mappings, the package approved by
/// `alice` and every mapping approved.
fn deployment(dir: &Path) -> Deployment {
    let server = node_modules().join("@modelcontextprotocol/server-memory/dist/index.js");
    let d = Deployment::with_notes()
        .connection(&format!(
            "[[connection]]\nname = \"memory\"\ncommand = \"node\"\nargs = [{:?}]\nenv = {{ MEMORY_FILE_PATH = {:?} }}\n{}",
            server.display().to_string(),
            graph_file(dir).display().to_string(),
            confined(&[(dir, "read-write")])
        ))
        .mapping("knowledge-edits")
        .mapping("memory-graph")
        .tables(&contract_table());
    approved(d)
}

/// Discovers the memory connection, approves the package and every mapping.
fn approved(d: Deployment) -> Deployment {
    let config = d.write_config();
    let config = config.to_str().unwrap();
    approve_operator(&d, "memory", config, PACKAGE);
    d
}

/// A deployment whose memory server loses the answer to the first `tool` call whose
/// arguments contain `contain` (the connection dies with that request unanswered, once);
/// `lost` exists once it did.
fn lossy(dir: &Path, tool: &str, contain: &str, lost: &Path) -> Deployment {
    let server = node_modules().join("@modelcontextprotocol/server-memory/dist/index.js");
    let d = Deployment::with_notes()
        .connection(&format!(
            "[[connection]]\nname = \"memory\"\ncommand = \"@airlock\"\nargs = {:?}\nenv = {{ MEMORY_FILE_PATH = {:?} }}\nconfine = false\n",
            lose_answer_args(tool, contain, lost, &[&node(), server.to_str().unwrap()]),
            graph_file(dir).display().to_string(),
        ))
        .mapping("knowledge-edits")
        .tables(&contract_table());
    approved(d)
}

/// The structured result of a successful call.
fn result(r: &rmcp::model::CallToolResult) -> Value {
    assert_ne!(r.is_error, Some(true), "{}", text_of(r));
    r.structured_content.clone().unwrap()["result"].clone()
}

fn remember(entity: &str, entity_type: &str, observations: &[&str]) -> Value {
    json!({"entity": entity, "entity-type": entity_type, "observations": observations})
}

/// Calls `tool` with `args`, approved by a person, expecting a refusal the adapter
/// reported as `conflict`: returns its text.
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
async fn an_approved_remember_adds_once_and_is_forgotten_by_its_reference() {
    let dir = graph_folder();
    let d = deployment(dir.path());
    let config = d.write_config();
    let config = config.to_str().unwrap();
    // The reviewer's view resolves the operator contract like the host does, and lists
    // the server's tools this mapping never reaches.
    let shown = d.airlock_json(&["review", "show", "knowledge-edits", "--config", config]);
    let caps = shown["capabilities"].as_array().unwrap();
    assert_eq!(caps.len(), 2, "{shown}");
    assert!(
        caps.iter()
            .all(|c| c["effect"]["class"] == "reversible-mutation" && c["problem"].is_null()),
        "{shown}"
    );
    let manifest = d.manifests()[0].to_str().unwrap().to_string();
    let grants = d.airlock_json(&["grants", &manifest, "--config", config]);
    assert_eq!(
        grants["connection"]["unreachable_tools"],
        json!([
            "create_relations",
            "delete_relations",
            "read_graph",
            "search_nodes"
        ]),
        "{grants}"
    );
    assert_eq!(grants["connection"]["missing_tools"], json!([]), "{grants}");
    let client = d.serve_unreviewed().await;

    // What the model is offered: local names and reviewed descriptions, no upstream tool,
    // no idempotency key.
    let tools = client.peer().list_all_tools().await.unwrap();
    let mut names: Vec<_> = tools.iter().map(|t| t.name.to_string()).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "forget_observations",
            "remember_observations",
            "retrieve_memory",
            "search_memory"
        ]
    );
    let listing = serde_json::to_string(&tools).unwrap();
    for upstream_only in [
        "add_observations",
        "create_entities",
        "delete_entities",
        "delete_observations",
        "open_nodes",
        "idempotency",
    ] {
        assert!(!listing.contains(upstream_only), "`{upstream_only}` leaked");
    }
    let schema = |name: &str| {
        tools
            .iter()
            .find(|t| t.name == name)
            .unwrap()
            .input_schema
            .clone()
    };
    let remember_schema = schema("remember_observations");
    assert_eq!(
        remember_schema["required"],
        json!(["entity", "entity-type", "observations"]),
        "the idempotency key is the host's"
    );
    assert_eq!(
        remember_schema["properties"]["observations"]["items"]["type"],
        "string"
    );
    assert_eq!(
        schema("forget_observations")["required"],
        json!(["addition"])
    );

    // Nobody approved yet: nothing reaches the server.
    let asked = [BABBAGE, MENABREA, MENABREA];
    let args = remember("Ada Lovelace", "person", &asked);
    let r = call(&client, "remember_observations", args.clone())
        .await
        .unwrap();
    let text = assert_refused(&r, Category::ApprovalRequired);
    // The person sees which entity and which observations, each quoted.
    let quoted: Vec<String> = asked.iter().map(|o| format!("{o:?}")).collect();
    assert!(
        text.contains(&format!(
            "Arguments: entity \"Ada Lovelace\", entity-type \"person\", observations [{}].",
            quoted.join(", ")
        )),
        "{text}"
    );
    assert_eq!(
        std::fs::read_to_string(graph_file(dir.path())).unwrap(),
        seed(),
        "nothing was recorded upstream"
    );
    approve_as_bob(&d, &text);

    // One approval, one addition: only what Ada did not have, once (the repeat in the
    // request too).
    let done = call(&client, "remember_observations", args.clone())
        .await
        .unwrap();
    let addition = result(&done);
    assert_eq!(addition["entity"], "Ada Lovelace");
    assert_eq!(addition["entity-type"], "person");
    assert_eq!(addition["added"], 1);
    assert_eq!(addition["created"], false);
    assert_eq!(addition["forgotten"], false);
    assert_eq!(addition["added-sha256"], sha_of(&[MENABREA]));
    assert_eq!(
        observations(dir.path(), "Ada Lovelace"),
        [ALGORITHM, BABBAGE, MENABREA]
    );
    assert_eq!(records(dir.path()), 1);

    // The receipt is spent: the same request again asks a person again, and once
    // approved adds nothing (Ada has all of it).
    let again = call(&client, "remember_observations", args.clone())
        .await
        .unwrap();
    assert_refused(&again, Category::ApprovalRequired);
    assert_eq!(records(dir.path()), 1, "nothing sent while unapproved");
    let repeat = approved_call(&d, &client, "remember_observations", args).await;
    let repeat = result(&repeat);
    assert_eq!(repeat["added"], 0);
    assert_eq!(repeat["added-sha256"], sha_of(&[]));
    assert_ne!(repeat["addition"], addition["addition"]);
    assert_eq!(
        observations(dir.path(), "Ada Lovelace"),
        [ALGORITHM, BABBAGE, MENABREA],
        "added exactly once"
    );
    assert_eq!(records(dir.path()), 2);

    // The records are bookkeeping: a search through the read-only mapping finds Ada by
    // the observation, never a record that quotes it.
    let found = call(&client, "search_memory", json!({"query": "menabrea"}))
        .await
        .unwrap();
    let titles: Vec<Value> = result(&found)
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["title"].clone())
        .collect();
    assert_eq!(titles, [json!("Ada Lovelace (person)")]);
    let none = call(&client, "search_memory", json!({"query": "airlock"}))
        .await
        .unwrap();
    assert_eq!(result(&none), json!([]));

    // Forgotten by the reference the addition returned, approved like any effect: the
    // observation it added goes, the one Ada already had stays.
    let reference = addition["addition"].as_str().unwrap().to_string();
    let r = call(
        &client,
        "forget_observations",
        json!({"addition": reference}),
    )
    .await
    .unwrap();
    let text = assert_refused(&r, Category::ApprovalRequired);
    // The person sees what the undo acts on: the addition and the facts it reported.
    assert!(
        text.contains("Addition \"")
            && text.contains("entity \"Ada Lovelace\"")
            && text.contains("added 1")
            && text.contains(&sha_of(&[MENABREA])),
        "{text}"
    );
    approve_as_bob(&d, &text);
    let forgot = call(
        &client,
        "forget_observations",
        json!({"addition": reference}),
    )
    .await
    .unwrap();
    let forgot = result(&forgot);
    assert_eq!(forgot["addition"], reference.as_str(), "the same reference");
    assert_eq!(forgot["forgotten"], true);
    assert_eq!(forgot["added"], 1);
    assert_eq!(
        observations(dir.path(), "Ada Lovelace"),
        [ALGORITHM, BABBAGE]
    );
    assert_eq!(records(dir.path()), 3);

    // Forgotten once: another forget of it is refused and removes nothing.
    let text = refused_conflict(
        &d,
        &client,
        "forget_observations",
        json!({"addition": reference}),
    )
    .await;
    assert!(text.contains("already forgotten"), "{text}");
    assert_eq!(
        observations(dir.path(), "Ada Lovelace"),
        [ALGORITHM, BABBAGE]
    );

    // An entity of another type is another thing: refused before anything is recorded.
    let text = refused_conflict(
        &d,
        &client,
        "remember_observations",
        remember("Ada Lovelace", "ship", &["Sank"]),
    )
    .await;
    assert!(text.contains("exists with type `person`"), "{text}");
    assert_eq!(records(dir.path()), 3);
    // The adapter's record names are its own.
    let r = approved_call_refused(
        &d,
        &client,
        remember("airlock-changes/idk_x", "note", &["x"]),
    )
    .await;
    assert!(r.contains("the adapter's records"), "{r}");
    assert_eq!(records(dir.path()), 3);
    client.cancel().await.unwrap();
    d.airlock_ok(&["trace", "verify"]);
}

/// Calls `remember_observations` with `args`, approved by a person, expecting the
/// adapter to refuse it as an invalid request: returns the text.
async fn approved_call_refused(
    d: &Deployment,
    client: &rmcp::service::RunningService<rmcp::RoleClient, ()>,
    args: Value,
) -> String {
    let tool = "remember_observations";
    let r = call(client, tool, args.clone()).await.unwrap();
    let id = approval_in(&assert_refused(&r, Category::ApprovalRequired));
    d.airlock_ok(&["approvals", "approve", &id, "--by", "bob", "--yes"]);
    let r = call(client, tool, args).await.unwrap();
    let text = assert_refused(&r, Category::InvalidRequest);
    assert!(
        text.starts_with("invalid request: invalid-request; "),
        "{text}"
    );
    text
}

/// An addition that created its entity takes the entity with it when it is forgotten,
/// unless something else was put on it since (then only what it added goes); one whose
/// observations someone removed since is not forgotten at all.
#[tokio::test]
async fn a_created_entity_goes_with_its_addition_unless_something_else_is_on_it() {
    let dir = graph_folder();
    let d = deployment(dir.path());
    let client = d.serve_unreviewed().await;
    let forget = |r: &Value| json!({"addition": r["addition"]});

    // Created, then forgotten whole.
    let engine = remember("Difference Engine", "machine", &["Designed by Babbage"]);
    let made = approved_call(&d, &client, "remember_observations", engine).await;
    let made = result(&made);
    assert_eq!(
        (made["created"].clone(), made["added"].clone()),
        (json!(true), json!(1))
    );
    // All of it new: the digest the person approving it was shown.
    assert_eq!(made["added-sha256"], sha_of(&["Designed by Babbage"]));
    assert_eq!(
        observations(dir.path(), "Difference Engine"),
        ["Designed by Babbage"]
    );
    approved_call(&d, &client, "forget_observations", forget(&made)).await;
    assert_eq!(entity(dir.path(), "Difference Engine"), None);

    // Created, then given another observation by someone else: only what the addition
    // added goes.
    let loom = remember("Jacquard loom", "machine", &["Used punched cards"]);
    let made = approved_call(&d, &client, "remember_observations", loom).await;
    let made = result(&made);
    edit_entity(dir.path(), "Jacquard loom", |e| {
        e["observations"]
            .as_array_mut()
            .unwrap()
            .push(json!("Wove portraits in silk"));
    });
    approved_call(&d, &client, "forget_observations", forget(&made)).await;
    assert_eq!(
        observations(dir.path(), "Jacquard loom"),
        ["Wove portraits in silk"]
    );

    // Created, then related to another entity by someone else: the entity stays, with
    // nothing but the relation.
    let analyser = remember("Harmonic analyser", "machine", &["Predicted tides"]);
    let made = approved_call(&d, &client, "remember_observations", analyser).await;
    let made = result(&made);
    let mut text = std::fs::read_to_string(graph_file(dir.path())).unwrap();
    let relation = json!({"type": "relation", "from": "Ada Lovelace",
                          "to": "Harmonic analyser", "relationType": "inspired"});
    text.push_str(&format!("\n{relation}"));
    std::fs::write(graph_file(dir.path()), text).unwrap();
    approved_call(&d, &client, "forget_observations", forget(&made)).await;
    assert_eq!(
        observations(dir.path(), "Harmonic analyser"),
        Vec::<String>::new()
    );
    assert!(lines(dir.path()).contains(&relation), "the relation stays");

    // Added, then partly removed by someone else: the graph is not what the addition
    // left, so nothing is undone.
    let two = remember("Ada Lovelace", "person", &["Born in 1815", "Died in 1852"]);
    let made = approved_call(&d, &client, "remember_observations", two).await;
    let made = result(&made);
    edit_entity(dir.path(), "Ada Lovelace", |e| {
        e["observations"] = json!([ALGORITHM, BABBAGE, "Died in 1852"]);
    });
    let text = refused_conflict(&d, &client, "forget_observations", forget(&made)).await;
    assert!(text.contains("1 of the 2 observations"), "{text}");
    assert_eq!(
        observations(dir.path(), "Ada Lovelace"),
        [ALGORITHM, BABBAGE, "Died in 1852"]
    );
    client.cancel().await.unwrap();
    d.airlock_ok(&["trace", "verify"]);
}

/// A completed addition is forgotten out of band (`airlock intents compensate`): the undo
/// is an ordinary call of `forget` that policy sends to a person, whose summary names the
/// intent undone and the addition's facts; denied, nothing changes; approved, what it
/// added is gone and the new intent records what it compensates; once, never again.
#[tokio::test]
async fn a_completed_addition_is_compensated_out_of_band_once_a_person_approves() {
    let dir = graph_folder();
    let d = deployment(dir.path());
    let config = d.write_config();
    let config = config.to_str().unwrap();
    let client = d.serve_unreviewed().await;
    let args = remember("Ada Lovelace", "person", &[BABBAGE, MENABREA]);
    approved_call(&d, &client, "remember_observations", args).await;
    client.cancel().await.unwrap();
    let addition = completed(&d, "remember_observations");
    let id = addition["id"].as_str().unwrap().to_string();
    // What the addition's result carried is kept with its intent, to undo it by.
    let kept = &addition["handles"][0];
    assert_eq!(kept["kind"], "addition-ref", "{addition}");
    assert_eq!(kept["facts"]["entity"], "Ada Lovelace");
    assert_eq!(kept["facts"]["added"], 1);
    assert_eq!(kept["facts"]["added-sha256"], sha_of(&[MENABREA]));
    let shown = d.airlock_ok(&["intents", "show", &id]);
    assert!(shown.contains("undo by    addition-ref"), "{shown}");

    // Denied: nothing is undone.
    let (ok, _, err) = compensate(&d, config, &id, "deny");
    assert!(!ok, "{err}");
    assert!(
        err.contains(&format!("It compensates intent {id}"))
            && err.contains("entity \"Ada Lovelace\"")
            && err.contains(&sha_of(&[MENABREA])),
        "the person sees what is undone: {err}"
    );
    assert!(err.contains("is denied: nothing was undone"), "{err}");
    assert_eq!(
        observations(dir.path(), "Ada Lovelace"),
        [ALGORITHM, BABBAGE, MENABREA]
    );

    // Approved: undone once, as an intent of its own that names the original.
    let (ok, out, err) = compensate(&d, config, &id, "approve");
    assert!(ok, "{err}");
    let done: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(done["compensated"], id.as_str());
    assert_eq!(done["intent"]["compensates"], id.as_str());
    assert_eq!(done["intent"]["capability"], "forget_observations");
    assert_eq!(done["result"]["forgotten"], true);
    assert_eq!(
        observations(dir.path(), "Ada Lovelace"),
        [ALGORITHM, BABBAGE]
    );
    let undo = done["intent"]["id"].as_str().unwrap();
    let shown = d.airlock_json(&["intents", "show", undo]);
    assert!(shown["tampered"].is_null(), "the trace proves it: {shown}");

    // Once compensated, never again; a forget has no undo.
    let (ok, _, err) = compensate(&d, config, &id, "approve");
    assert!(
        !ok && err.contains(&format!("already compensated by intent {undo}")),
        "{err}"
    );
    let (ok, _, err) = compensate(&d, config, undo, "approve");
    assert!(!ok && err.contains("declares no undo"), "{err}");
    assert_eq!(
        observations(dir.path(), "Ada Lovelace"),
        [ALGORITHM, BABBAGE]
    );
    d.airlock_ok(&["trace", "verify"]);
}

/// The answer to `add_observations` is lost after the server added the observation (the
/// connection dies with the request unanswered): the outcome is unknown, and the host asks
/// the contract's declared query (`remembered`, which reads the adapter's record and the
/// entity) instead of adding again: completed, added once, and undone like any other.
#[tokio::test]
async fn an_addition_whose_answer_is_lost_is_reconciled_by_reading_the_entity() {
    let dir = graph_folder();
    let state = tempfile::tempdir().unwrap();
    let lost = state.path().join("lost");
    let d = lossy(dir.path(), "add_observations", "Menabrea", &lost);
    let client = d.serve_unreviewed().await;

    let args = remember("Ada Lovelace", "person", &[MENABREA]);
    let done = approved_call(&d, &client, "remember_observations", args).await;
    assert!(lost.exists(), "the answer was lost");
    let text = text_of(&done);
    assert!(text.starts_with("Reconciled (intent int_"), "{text}");
    let s = done.structured_content.clone().unwrap();
    assert_eq!(s["reconciled"]["method"], "query");
    assert_eq!(s["result"]["added"], 1);
    assert_eq!(s["result"]["added-sha256"], sha_of(&[MENABREA]));
    assert_eq!(
        observations(dir.path(), "Ada Lovelace"),
        [ALGORITHM, BABBAGE, MENABREA],
        "added once, never again"
    );
    assert_eq!(records(dir.path()), 1);
    client.cancel().await.unwrap();
    // The reconciled addition kept what its query found, so it can be undone like any other.
    let id = completed(&d, "remember_observations")["id"]
        .as_str()
        .unwrap()
        .to_string();
    let config = d.write_config();
    let (ok, _, err) = compensate(&d, config.to_str().unwrap(), &id, "approve");
    assert!(ok, "{err}");
    assert_eq!(
        observations(dir.path(), "Ada Lovelace"),
        [ALGORITHM, BABBAGE]
    );
    d.airlock_ok(&["trace", "verify"]);
}

/// The answer lost is the adapter's own record of the addition, before anything was
/// added: the query finds the record but none of its observations on the entity, so the
/// host reports that nothing happened, and the entity is untouched.
#[tokio::test]
async fn an_addition_lost_before_it_landed_is_reconciled_as_nothing_happened() {
    let dir = graph_folder();
    let state = tempfile::tempdir().unwrap();
    let lost = state.path().join("lost");
    let d = lossy(dir.path(), "create_entities", "airlock-record", &lost);
    let client = d.serve_unreviewed().await;

    let args = remember("Ada Lovelace", "person", &[MENABREA]);
    let r = call(&client, "remember_observations", args.clone())
        .await
        .unwrap();
    let id = approval_in(&assert_refused(&r, Category::ApprovalRequired));
    d.airlock_ok(&["approvals", "approve", &id, "--by", "bob", "--yes"]);
    let r = call(&client, "remember_observations", args).await.unwrap();
    assert!(lost.exists(), "the answer was lost");
    assert_eq!(r.is_error, Some(true));
    let text = text_of(&r);
    assert!(text.contains("nothing happened"), "{text}");
    assert_eq!(
        observations(dir.path(), "Ada Lovelace"),
        [ALGORITHM, BABBAGE]
    );
    assert_eq!(records(dir.path()), 1, "the record the server wrote");
    let failed = d.airlock_json(&["intents", "list", "--state", "failed"]);
    assert_eq!(failed.as_array().unwrap().len(), 1, "{failed}");
    assert_eq!(failed[0]["resolution"]["method"], "query");
    client.cancel().await.unwrap();
    d.airlock_ok(&["trace", "verify"]);
}

/// The answer to the forget's `delete_observations` is lost after the server removed the
/// observation: `forget` is idempotent and declares no query, so the host sends it again
/// under the same key (retry by semantics); the repeat finds its own record and the
/// observation gone, removes nothing twice, and completes.
#[tokio::test]
async fn a_forget_whose_answer_is_lost_is_sent_again_and_removes_nothing_twice() {
    let dir = graph_folder();
    let state = tempfile::tempdir().unwrap();
    let lost = state.path().join("lost");
    let d = lossy(dir.path(), "delete_observations", "Menabrea", &lost);
    let client = d.serve_unreviewed().await;

    let args = remember("Ada Lovelace", "person", &[MENABREA]);
    let made = approved_call(&d, &client, "remember_observations", args).await;
    let made = result(&made);
    assert!(!lost.exists());
    let forget = json!({"addition": made["addition"]});
    let done = approved_call(&d, &client, "forget_observations", forget).await;
    assert!(lost.exists(), "the answer was lost");
    let s = done.structured_content.clone().unwrap();
    assert_eq!(s["reconciled"]["method"], "retry", "{s}");
    assert_eq!(s["result"]["forgotten"], true);
    assert_eq!(
        observations(dir.path(), "Ada Lovelace"),
        [ALGORITHM, BABBAGE]
    );
    assert_eq!(records(dir.path()), 2, "one remember, one forget");
    let marked = lines(dir.path()).iter().any(|l| {
        l["entityType"] == "airlock-record"
            && l["observations"].to_string().contains("forgotten-by")
    });
    assert!(marked, "the addition's record says which forget undid it");
    client.cancel().await.unwrap();
    d.airlock_ok(&["trace", "verify"]);
}
