//! Commands for adapter authors: `airlock new` (a ready crate for one contract) and
//! `airlock pack` (build, place and pin its component).
//!
//! Rule: what these commands write is what the host reads, checked the way the host
//! checks it. `new` writes a mapping that is deny by default (no grants, no upstream tool
//! listed, the default limits written out) and a `src/lib.rs` implementing every function
//! the contract's mapping may offer, each with a first step that compiles and answers a
//! clear error until the author writes it. `pack` builds with cargo for
//! [`GUEST_TARGET`], refuses anything that is not a component, writes the pin
//! (`[component] sha256`) into the manifest and re-reads the manifest with the host's
//! parser before it says the next command.
//!
//! Contracts `new` knows ([`TEMPLATES`]): every contract this host declares effect
//! semantics for and the SDK exports (`source-retrieval@0.1.0`, `artifact-delivery@0.2.0`);
//! a test keeps the list equal to [`crate::contract::known_contracts`]. Any other
//! contract is a **package folder** (an operator's, README "Defining a contract"): `new`
//! loads it as the host does, copies its files into the crate's `wit/` (the crate builds
//! alone), generates bindings for its world with `wit-bindgen` (the host interfaces the
//! SDK provides are taken from the SDK, so its helpers and test kit work) and writes every
//! function of its one exported interface with the names `wit-bindgen` gives them
//! ([`crate::contract::skeleton`]).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context as _, Result, bail};
use serde::Serialize;
use sha2::Digest as _;

use crate::registry::manifest::MappingManifest;

/// The target adapters are built for.
pub const GUEST_TARGET: &str = "wasm32-wasip2";

/// The toolchain a generated crate names (the SDK's minimum supported Rust version).
pub const TOOLCHAIN: &str = "1.95.0";

/// The first 8 bytes of a component binary: `\0asm`, version 0x0d, layer 1.
const COMPONENT_PREAMBLE: [u8; 8] = [0x00, 0x61, 0x73, 0x6d, 0x0d, 0x00, 0x01, 0x00];

/// The SDK of the checkout this binary was built from, if it is still there.
fn built_in_sdk() -> Option<PathBuf> {
    let sdk = Path::new(env!("CARGO_MANIFEST_DIR")).parent()?.join("sdk");
    sdk.join("Cargo.toml").is_file().then_some(sdk)
}

/// One function of a contract, as `airlock new` writes it.
#[derive(Debug)]
pub struct FunctionTemplate {
    /// The WIT name, e.g. `list-destinations`.
    pub function: &'static str,
    /// The capability name suffix the mapping stub gives it (`<name>_<suffix>`); `None`
    /// for a host-only function (never offered: no `[[capability]]`).
    pub capability: Option<&'static str>,
    /// The description stub the mapping gives it (the reviewer rewrites it).
    pub description: &'static str,
    /// The Rust implementation in `impl Guest`, indented by 4 spaces.
    pub body: &'static str,
}

/// One contract `airlock new` can write a crate for.
#[derive(Debug)]
pub struct ContractTemplate {
    /// The contract interface, e.g. `airlock:contracts/source-retrieval@0.1.0`.
    pub interface: &'static str,
    /// What the contract does, in one line.
    pub summary: &'static str,
    /// The `use` line of the SDK's contract module.
    pub uses: &'static str,
    /// The SDK's export macro.
    pub export_macro: &'static str,
    /// Every function of the contract, in WIT order.
    pub functions: &'static [FunctionTemplate],
    /// A test-kit test of the first function (`TYPE` stands for the adapter's type).
    pub test: &'static str,
}

/// The contracts `airlock new` supports.
pub const TEMPLATES: &[ContractTemplate] = &[
    ContractTemplate {
        interface: "airlock:contracts/source-retrieval@0.1.0",
        summary: "search a set of sources, then retrieve one by reference (read)",
        uses: "use airlock_sdk::source_retrieval::{\n    ContractError, Guest, RetrieveRequest, SearchRequest, SourceHit, SourcePassage,\n};",
        export_macro: "export_source_retrieval",
        test: r#"    #[test]
    fn search_calls_the_upstream_search_tool() {
        let kit = Upstream::new()
            .reply(SEARCH_TOOL, Reply::structured(json!({ "hits": [] })))
            .install();
        let _hits = TYPE::search(SearchRequest { query: "wal".into(), limit: None });
        assert_eq!(kit.calls()[0].tool, SEARCH_TOOL);
        assert_eq!(kit.calls()[0].arguments["query"], "wal");
        // Then: assert on `_hits` once search maps the upstream's answer.
    }
"#,
        functions: &[
            FunctionTemplate {
                function: "search",
                capability: Some("search"),
                description: "Search NAME. Returns a title and an opaque reference for each hit. (Describe what the model finds here before review.)",
                body: r#"    fn search(request: SearchRequest) -> Result<Vec<SourceHit>, ContractError> {
        // First step: call the upstream search tool (list it in mapping.toml
        // [upstream] tools; `airlock snapshots show DIGEST --tool NAME` shows its schemas).
        let output = upstream::call_tool_json(
            SEARCH_TOOL,
            &json!({ "query": request.query, "limit": request.limit.unwrap_or(10) }),
        )?;
        if let Some(message) = output.error_message() {
            return Err(ContractError::invalid_request(message));
        }
        // Then: read the hits (`output.structured::<T>()`) into SourceHit values, whose
        // `reference` is your own locator for `retrieve`.
        log::debug(&format!("{SEARCH_TOOL} answered: {:?}", output.first_text()));
        Err(ContractError::upstream_failed(
            "search is not written yet: map the upstream result to SourceHit in src/lib.rs",
        ))
    }
"#,
            },
            FunctionTemplate {
                function: "retrieve",
                capability: Some("retrieve"),
                description: "Retrieve one item of NAME by the reference a search returned. (Describe it before review.)",
                body: r#"    fn retrieve(request: RetrieveRequest) -> Result<SourcePassage, ContractError> {
        // First step: call the upstream read tool with your locator.
        let output = upstream::call_tool_json(RETRIEVE_TOOL, &json!({ "id": request.reference }))?;
        if output.is_error {
            return Err(ContractError::NotFound);
        }
        // Then: build the SourcePassage (title, media type, text) from the result.
        log::debug(&format!("{RETRIEVE_TOOL} answered: {:?}", output.first_text()));
        Err(ContractError::upstream_failed(
            "retrieve is not written yet: map the upstream result to SourcePassage in src/lib.rs",
        ))
    }
"#,
            },
        ],
    },
    ContractTemplate {
        interface: "airlock:contracts/artifact-delivery@0.2.0",
        summary: "prepare an artifact, list destinations, deliver it at most once, query a delivery (external effect)",
        uses: "use airlock_sdk::artifact_delivery::{\n    ContractError, DeliverRequest, Delivery, Destination, DestinationsRequest, Guest,\n    PrepareRequest, PreparedArtifact, QueryRequest,\n};",
        export_macro: "export_artifact_delivery",
        test: r#"    #[test]
    fn prepare_stages_the_content_upstream() {
        let kit = Upstream::new()
            .reply(PREPARE_TOOL, Reply::structured(json!({})))
            .install();
        let _prepared = TYPE::prepare(PrepareRequest {
            title: "notes".into(),
            media_type: "text/plain".into(),
            content: "hello".into(),
        });
        assert_eq!(kit.calls()[0].tool, PREPARE_TOOL);
        assert_eq!(kit.calls()[0].arguments["content"], "hello");
        // Then: assert on `_prepared` once prepare maps the upstream's answer.
    }
"#,
        functions: &[
            FunctionTemplate {
                function: "prepare",
                capability: Some("prepare"),
                description: "Prepare an artifact (title, media type, content) for delivery with NAME. Nothing is sent yet. (Describe it before review.)",
                body: r#"    fn prepare(request: PrepareRequest) -> Result<PreparedArtifact, ContractError> {
        // First step: stage the content upstream (list the tool in mapping.toml).
        let output = upstream::call_tool_json(
            PREPARE_TOOL,
            &json!({ "title": request.title, "media_type": request.media_type, "content": request.content }),
        )?;
        if let Some(message) = output.error_message() {
            return Err(ContractError::invalid_request(message));
        }
        // Then: read the upstream's artifact id, sha256 and size into PreparedArtifact.
        log::debug(&format!("{PREPARE_TOOL} answered: {:?}", output.first_text()));
        Err(ContractError::upstream_failed(
            "prepare is not written yet: map the upstream result to PreparedArtifact in src/lib.rs",
        ))
    }
"#,
            },
            FunctionTemplate {
                function: "list-destinations",
                capability: Some("list_destinations"),
                description: "List the destinations NAME can deliver to, each with an opaque reference and a label. (Describe it before review.)",
                body: r#"    fn list_destinations(request: DestinationsRequest) -> Result<Vec<Destination>, ContractError> {
        // First step: ask the upstream for its destinations.
        let output = upstream::call_tool_json(
            DESTINATIONS_TOOL,
            &json!({ "limit": request.limit.unwrap_or(20) }),
        )?;
        // Then: map each to a Destination (your locator, a label).
        log::debug(&format!("{DESTINATIONS_TOOL} answered: {:?}", output.first_text()));
        Err(ContractError::upstream_failed(
            "list-destinations is not written yet: map the upstream result to Destination in src/lib.rs",
        ))
    }
"#,
            },
            FunctionTemplate {
                function: "deliver",
                capability: Some("deliver"),
                description: "Deliver a prepared artifact to one destination with NAME. It leaves the workspace and cannot be recalled. (Describe it before review.)",
                body: r#"    fn deliver(request: DeliverRequest) -> Result<Delivery, ContractError> {
        // First step: one upstream request, never retried; pass the host's key unchanged.
        let output = upstream::call_tool_json(
            DELIVER_TOOL,
            &json!({
                "artifact": request.artifact,
                "destination": request.destination,
                "idempotency_key": request.idempotency_key,
            }),
        )?;
        // Then: map the upstream's refusals (a reused key is `conflict`, an unknown
        // artifact `NotFound`) and read the Delivery.
        log::debug(&format!("{DELIVER_TOOL} answered: {:?}", output.first_text()));
        Err(ContractError::upstream_failed(
            "deliver is not written yet: map the upstream result to Delivery in src/lib.rs",
        ))
    }
"#,
            },
            FunctionTemplate {
                function: "query",
                capability: None,
                description: "",
                body: r#"    fn query(request: QueryRequest) -> Result<Option<Delivery>, ContractError> {
        // Called by the host only, to learn whether a delivery whose outcome is unknown
        // happened. First step: look it up upstream by the idempotency key.
        let output = upstream::call_tool_json(
            QUERY_TOOL,
            &json!({ "idempotency_key": request.idempotency_key }),
        )?;
        // Then: Ok(None) when nothing was delivered under the key, Ok(Some(..)) when it was.
        log::debug(&format!("{QUERY_TOOL} answered: {:?}", output.first_text()));
        Err(ContractError::upstream_failed(
            "query is not written yet: look the delivery up in src/lib.rs",
        ))
    }
"#,
            },
        ],
    },
];

/// The upstream tool constants each contract's `src/lib.rs` starts with: (constant,
/// placeholder tool name, which function calls it).
fn tool_constants(interface: &str) -> &'static [(&'static str, &'static str, &'static str)] {
    match interface {
        "airlock:contracts/source-retrieval@0.1.0" => &[
            ("SEARCH_TOOL", "search", "search"),
            ("RETRIEVE_TOOL", "read", "retrieve"),
        ],
        "airlock:contracts/artifact-delivery@0.2.0" => &[
            ("PREPARE_TOOL", "stage", "prepare"),
            (
                "DESTINATIONS_TOOL",
                "list_destinations",
                "list-destinations",
            ),
            ("DELIVER_TOOL", "send", "deliver"),
            ("QUERY_TOOL", "lookup", "query"),
        ],
        _ => &[],
    }
}

/// One contract in `airlock new --list`.
#[derive(Debug, Serialize)]
pub struct ListedContract {
    /// The contract interface.
    pub contract: String,
    /// What it does.
    pub summary: String,
    /// Its functions: `name (effect class)`, host-only ones marked.
    pub functions: Vec<String>,
}

/// The contracts this host supports and `airlock new` writes crates for.
pub fn list() -> Vec<ListedContract> {
    TEMPLATES
        .iter()
        .map(|t| ListedContract {
            contract: t.interface.to_string(),
            summary: t.summary.to_string(),
            functions: t
                .functions
                .iter()
                .map(|f| {
                    let effect = crate::contract::load_contract(t.interface)
                        .ok()
                        .and_then(|c| c.semantics(f.function));
                    match effect {
                        Some(e) if e.host_only => {
                            format!("{} ({}, host only)", f.function, e.class.as_str())
                        }
                        Some(e) => format!("{} ({})", f.function, e.class.as_str()),
                        None => format!("{} (no effect semantics)", f.function),
                    }
                })
                .collect(),
        })
        .collect()
}

/// Text for `airlock new --list`.
pub fn list_text(list: &[ListedContract]) -> String {
    let mut o = String::from("contracts this host supports (`airlock new CONTRACT NAME`):\n");
    for c in list {
        let short = short_name(&c.contract);
        let _ = writeln!(o, "  {}  ({short})", c.contract);
        let _ = writeln!(o, "    {}", c.summary);
        let _ = writeln!(o, "    functions: {}", c.functions.join(", "));
    }
    o
}

/// `airlock:contracts/source-retrieval@0.1.0` → `source-retrieval`.
fn short_name(interface: &str) -> &str {
    let name = interface.rsplit('/').next().unwrap_or(interface);
    name.split('@').next().unwrap_or(name)
}

/// The template for `contract`: a full interface name, or its short name
/// (`source-retrieval`).
///
/// # Errors
/// No supported contract matches; the error lists them.
pub fn template(contract: &str) -> Result<&'static ContractTemplate> {
    TEMPLATES
        .iter()
        .find(|t| t.interface == contract || short_name(t.interface) == contract)
        .with_context(|| {
            format!(
                "unknown contract `{contract}`; this host supports: {} (`airlock new --list`)",
                TEMPLATES
                    .iter()
                    .map(|t| t.interface)
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
}

/// What `airlock new` was asked for.
#[derive(Debug)]
pub struct NewOptions<'a> {
    /// The contract (full or short name).
    pub contract: &'a str,
    /// The adapter's name: crate, mapping and component (`-` → `_` in the file name).
    pub name: &'a str,
    /// The connection the mapping names (default: the adapter's name).
    pub connection: Option<&'a str>,
    /// The folder to create (default: `./NAME`); must not exist or be empty.
    pub dir: Option<&'a Path>,
    /// The SDK checkout to depend on (default: the one this binary was built from).
    pub sdk: Option<&'a Path>,
}

/// What `airlock new` wrote.
#[derive(Debug, Serialize)]
pub struct NewReport {
    /// The crate's folder.
    pub dir: PathBuf,
    /// The contract interface.
    pub contract: String,
    /// The mapping and crate name.
    pub name: String,
    /// The connection the mapping names.
    pub connection: String,
    /// The SDK folder the crate depends on (by path), and where that choice came from.
    pub sdk: PathBuf,
    /// `--sdk` or `the checkout this airlock was built from`.
    pub sdk_source: String,
    /// The files written, relative to `dir`.
    pub files: Vec<String>,
}

/// A name fit for a crate, a mapping and a file: 1-64 of `a-z 0-9 - _`, starting with a
/// letter.
fn check_name(what: &str, name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if !ok {
        bail!(
            "{what} `{name}` must be 1-64 characters of a-z, 0-9, `-`, `_`, starting with a letter"
        );
    }
    Ok(())
}

/// The `wit-bindgen` a crate generated for a contract package depends on: the SDK's own
/// (a test keeps them equal).
pub const WIT_BINDGEN: &str = "0.61";

/// What `new` writes a crate for: a built-in contract's template, or a package folder.
enum Source {
    Template(&'static ContractTemplate),
    Package {
        folder: PathBuf,
        package: Box<crate::contract::package::ContractPackage>,
        skeleton: Box<crate::contract::skeleton::Skeleton>,
    },
}

/// Whether `contract` names a package folder rather than a built-in contract, given
/// whether a folder of that name exists here (`folder_here`): a path with a separator is a
/// folder; a built-in contract's name is the built-in.
///
/// # Errors
/// A built-in contract's name when a folder of that name exists here too (which one was
/// meant is not knowable: the error says how to name each).
fn names_folder(contract: &str, folder_here: bool) -> Result<bool> {
    if contract.contains('/') && !contract.contains(':') {
        return Ok(true);
    }
    match (template(contract).is_ok(), folder_here) {
        (true, true) => bail!(
            "`{contract}` names both a built-in contract and a folder here: write `./{contract}` for the folder's package, or run `airlock new` from another folder for the built-in"
        ),
        (built_in, here) => Ok(!built_in && here),
    }
}

/// The source `contract` names.
///
/// # Errors
/// Not a built-in contract, or a folder that does not load as a package (the loader's
/// problems, each with its file and line), or one whose worlds export none of its
/// interfaces alone.
fn source(contract: &str) -> Result<Source> {
    if !names_folder(contract, Path::new(contract).is_dir())? {
        return template(contract).map(Source::Template);
    }
    use crate::contract::{package, skeleton};
    let folder = std::fs::canonicalize(contract)
        .with_context(|| format!("no contract package folder {contract}"))?;
    let files = package::PackageFiles::read_dir(&folder)?;
    let loaded = package::load(&files)?;
    let mut all = skeleton::skeletons(&files, &loaded)?;
    if all.len() > 1 {
        bail!(
            "{}: package {} has {} adapter worlds ({}); `airlock new` writes a crate for a package with one",
            folder.display(),
            loaded.name,
            all.len(),
            all.iter()
                .map(|s| s.world.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(Source::Package {
        folder,
        skeleton: Box::new(all.remove(0)),
        package: Box::new(loaded),
    })
}

/// `airlock new`: writes a ready crate for one contract.
///
/// # Errors
/// Unknown contract, a package folder that does not load, a bad name, a folder that
/// exists and is not empty, no SDK found (then `--sdk PATH` is needed), or a write
/// failing.
pub fn new_crate(options: &NewOptions<'_>) -> Result<NewReport> {
    let source = source(options.contract)?;
    check_name("the adapter name", options.name)?;
    let connection = options.connection.unwrap_or(options.name);
    check_name("the connection name", connection)?;
    let (sdk, sdk_source) = match options.sdk {
        Some(p) => (p.to_path_buf(), "--sdk".to_string()),
        None => (
            built_in_sdk().context(
                "no SDK checkout found beside this airlock's sources; pass --sdk PATH (the `sdk` folder of an Airlock checkout)",
            )?,
            "the checkout this airlock was built from".to_string(),
        ),
    };
    if !sdk.join("Cargo.toml").is_file() {
        bail!(
            "--sdk {}: no Cargo.toml there; pass the `sdk` folder of an Airlock checkout",
            sdk.display()
        );
    }
    let sdk = std::fs::canonicalize(&sdk)
        .with_context(|| format!("resolving the SDK folder {}", sdk.display()))?;
    let dir = options
        .dir
        .map_or_else(|| PathBuf::from(options.name), Path::to_path_buf);
    if dir.exists()
        && std::fs::read_dir(&dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .next()
            .is_some()
    {
        bail!(
            "{} exists and is not empty; choose another --dir or remove it",
            dir.display()
        );
    }

    let (files, interface) = match &source {
        Source::Template(t) => (
            vec![
                (
                    "Cargo.toml".to_string(),
                    cargo_toml(options.name, &sdk, false),
                ),
                ("rust-toolchain.toml".into(), toolchain_toml()),
                (".gitignore".into(), "/target\n".to_string()),
                ("src/lib.rs".into(), lib_rs(t, options.name, connection)),
                (
                    "mapping.toml".into(),
                    mapping_toml(t, options.name, connection),
                ),
                (
                    "airlock.toml".into(),
                    serve_config(options.name, connection, None),
                ),
            ],
            t.interface.to_string(),
        ),
        Source::Package {
            folder,
            package,
            skeleton,
        } => {
            let mut files = vec![
                (
                    "Cargo.toml".to_string(),
                    cargo_toml(options.name, &sdk, true),
                ),
                ("rust-toolchain.toml".into(), toolchain_toml()),
                (".gitignore".into(), "/target\n".to_string()),
                (
                    "src/lib.rs".into(),
                    package_lib_rs(package, skeleton, options.name, connection),
                ),
                (
                    "mapping.toml".into(),
                    package_mapping_toml(package, skeleton, options.name, connection),
                ),
                (
                    "airlock.toml".into(),
                    serve_config(options.name, connection, Some((folder, &package.name))),
                ),
            ];
            // The package's own files: the crate's bindings are generated from them.
            for (path, text) in package.files.files() {
                files.push((format!("wit/{path}"), text.clone()));
            }
            (files, skeleton.interface.clone())
        }
    };
    for (file, text) in &files {
        let path = dir.join(file);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(NewReport {
        dir,
        contract: interface,
        name: options.name.to_string(),
        connection: connection.to_string(),
        sdk,
        sdk_source,
        files: files.iter().map(|(f, _)| f.clone()).collect(),
    })
}

impl NewReport {
    /// What was written and what to do next.
    pub fn to_text(&self) -> String {
        let mut o = String::new();
        let dir = self.dir.display();
        let _ = writeln!(
            o,
            "created {dir}/: adapter `{}` for {} (connection `{}`)",
            self.name, self.contract, self.connection
        );
        let _ = writeln!(
            o,
            "  airlock-sdk by path: {} ({})",
            self.sdk.display(),
            self.sdk_source
        );
        for f in &self.files {
            let _ = writeln!(o, "  {f}");
        }
        let _ = writeln!(o, "next:");
        let _ = writeln!(
            o,
            "  1. point the connection in {dir}/airlock.toml at your MCP server, then\n     airlock discover {} --config {dir}/airlock.toml",
            self.connection
        );
        let _ = writeln!(
            o,
            "  2. airlock snapshots show DIGEST --tool NAME  (the shapes of the tools to call)"
        );
        let _ = writeln!(
            o,
            "  3. write src/lib.rs and list the tools it calls in mapping.toml [upstream] tools"
        );
        let _ = writeln!(
            o,
            "  4. airlock pack {dir}/mapping.toml  (build, place and pin the component)"
        );
        o
    }
}

fn cargo_toml(name: &str, sdk: &Path, bindings: bool) -> String {
    let bindgen = if bindings {
        format!(
            "# The bindings of the contract package in wit/ (the SDK's own wit-bindgen).\nwit-bindgen = {{ version = \"{WIT_BINDGEN}\", default-features = false, features = [\"macros\", \"realloc\", \"std\"] }}\n"
        )
    } else {
        String::new()
    };
    format!(
        r#"[package]
name = "{name}"
version = "0.1.0"
edition = "2024"
rust-version = "1.95"
publish = false

# An adapter is a component: a `cdylib` built for {GUEST_TARGET} (`airlock pack`).
[lib]
crate-type = ["cdylib"]

[dependencies]
airlock-sdk = {{ path = {sdk:?} }}
serde = {{ version = "1", features = ["derive"] }}
{bindgen}
# `cargo test` runs the contract functions natively against canned upstream replies.
[dev-dependencies]
airlock-sdk = {{ path = {sdk:?}, features = ["testing"] }}

# Its own workspace root: the crate builds wherever it sits.
[workspace]
"#,
        sdk = sdk.display().to_string()
    )
}

fn toolchain_toml() -> String {
    format!(
        "# The SDK needs Rust 1.95 or later and the {GUEST_TARGET} target.\n[toolchain]\nchannel = \"{TOOLCHAIN}\"\ntargets = [\"{GUEST_TARGET}\"]\n"
    )
}

/// The component's file name for adapter `name`, as cargo writes it.
fn component_file(name: &str) -> String {
    format!("{}.wasm", name.replace('-', "_"))
}

/// The Rust type name for adapter `name`: `my-notes` → `MyNotes`.
fn type_name(name: &str) -> String {
    crate::contract::skeleton::upper_camel(&name.replace('_', "-"))
}

fn lib_rs(t: &ContractTemplate, name: &str, connection: &str) -> String {
    let ty = type_name(name);
    let mut o = String::new();
    let _ = writeln!(
        o,
        "//! `{name}`: an Airlock adapter implementing `{}` over connection `{connection}`.",
        t.interface
    );
    let _ = writeln!(o, "//!");
    let _ = writeln!(
        o,
        "//! Every function below makes its first upstream call and then answers an error that"
    );
    let _ = writeln!(
        o,
        "//! says what is left to write. Upstream errors convert to the contract's error with `?`."
    );
    let _ = writeln!(
        o,
        "//! The SDK's README (`airlock-sdk`) shows a complete adapter.\n"
    );
    let _ = writeln!(o, "{}", t.uses);
    let _ = writeln!(o, "use airlock_sdk::{{log, serde_json::json, upstream}};\n");
    for (constant, tool, function) in tool_constants(t.interface) {
        let _ = writeln!(
            o,
            "/// The upstream tool `{function}` calls: rename it to your server's tool and list it in\n/// mapping.toml `[upstream] tools` (any tool not listed there is refused)."
        );
        let _ = writeln!(o, "const {constant}: &str = \"{tool}\";\n");
    }
    let _ = writeln!(o, "/// The adapter; it keeps no state between calls.");
    let _ = writeln!(o, "struct {ty};\n");
    let _ = writeln!(o, "impl Guest for {ty} {{");
    let bodies: Vec<&str> = t.functions.iter().map(|f| f.body).collect();
    o.push_str(&bodies.join("\n"));
    let _ = writeln!(o, "}}\n");
    let _ = writeln!(o, "airlock_sdk::{}!({ty});", t.export_macro);
    let _ = writeln!(
        o,
        "\n// A native `cargo test`: the SDK's test kit answers the upstream calls from canned\n\
         // replies, and an unexpected call fails the test naming the tool and its arguments.\n\
         // Once mapping.toml lists the tools, `Upstream::from_mapping(\"mapping.toml\")` also\n\
         // refuses any other tool, as the host does.\n\
         #[cfg(test)]\nmod tests {{\n    use super::*;\n    use airlock_sdk::testing::{{Reply, Upstream}};\n"
    );
    o.push_str(&t.test.replace("TYPE", &ty));
    o.push_str("}\n");
    o
}

/// The start of every generated mapping: what it is (`note`: more comment lines), then
/// `[mapping]`, `[component]` (not pinned yet) and an empty `[upstream]`.
fn mapping_head(name: &str, contract: &str, connection: &str, note: &str) -> String {
    format!(
        r#"# The mapping of `{name}`: what a reviewer approves and the host enforces.
# Deny by default: no upstream tool, no filesystem, network or environment.
{note}
[mapping]
name = "{name}"
contract = "{contract}"
connection = "{connection}"

[component]
file = "{file}"
# sha256 = "<hex>"  written by `airlock pack mapping.toml`

[upstream]
# The only upstream tools the adapter may call (the names src/lib.rs uses); any other
# name is refused and never sent. `airlock snapshots show DIGEST --tool NAME` shows one.
tools = []
# URI prefixes the adapter may read with upstream::read_resource; [] = none.
resources = []
"#,
        file = component_file(name),
    )
}

/// The end of every generated mapping: no grants, the host's default limits written out.
const GRANTS_AND_LIMITS: &str = r#"
# No grants: the adapter reaches nothing but its upstream tools.
[grants]

# The host's defaults, written out; a value above the host's ceiling is refused at load.
[limits]
memory_mib = 64
deadline_ms = 5000
max_output_bytes = 262144
max_output_items = 64
max_result_bytes = 1048576
max_concurrent_calls = 8
queue_timeout_ms = 250
max_queued_calls = 64
max_upstream_requests = 32
"#;

fn mapping_toml(t: &ContractTemplate, name: &str, connection: &str) -> String {
    let mut o = mapping_head(name, t.interface, connection, "");
    for f in t.functions {
        let Some(suffix) = f.capability else {
            let _ = write!(
                o,
                "\n# `{}` is called by the host only (reconciliation): it is never a capability.\n",
                f.function
            );
            continue;
        };
        let effect = crate::contract::load_contract(t.interface)
            .ok()
            .and_then(|c| c.semantics(f.function))
            .map_or("read", |e| e.class.as_str());
        let _ = write!(
            o,
            "\n# What the model sees: a local name and a reviewed description.\n[[capability]]\nfunction = \"{}\"\nname = \"{}_{suffix}\"\ndescription = \"{}\"\neffect = \"{effect}\"\n",
            f.function,
            name.replace('-', "_"),
            f.description.replace("NAME", name),
        );
    }
    o.push_str(GRANTS_AND_LIMITS);
    o
}

fn serve_config(name: &str, connection: &str, package: Option<(&Path, &str)>) -> String {
    let contract = match package {
        Some((folder, package)) => format!(
            r#"
# The operator contract package the mapping binds (the folder `airlock new` read; the
# crate's wit/ is a copy of it). A reviewer approves its digest first:
#   airlock contracts approve {package} --config airlock.toml --reviewer YOU
[[contract]]
path = {path:?}
"#,
            path = folder.display().to_string()
        ),
        None => String::new(),
    };
    format!(
        r#"# A serve configuration for trying `{name}` on this machine:
#   airlock discover {connection} --config airlock.toml
#   airlock review approve {name} --config airlock.toml --reviewer YOU
#   airlock serve --config airlock.toml
state_dir = "state"

# Point this at your MCP server: a command (stdio) or a url (Streamable HTTP).
[[connection]]
name = "{connection}"
command = "your-mcp-server"   # a path or a name on PATH; "@airlock" runs this airlock
args = []
# env = {{ KEY = "value" }}   # the server's whole environment (default: empty)
# url = "https://mcp.example.com/mcp"   # instead of command/args
# The server runs confined by the kernel: it reads the system folders and its own install
# folder, writes a private TMPDIR, has no network. Grant what else it needs:
# [[connection.grants.filesystem]]
# path = "/path/to/its/data"
# access = "read-only"          # or "read-write"
# [connection.grants.network]
# tcp_connect = ["api.example.com:443"]   # through the host's egress proxy (HTTPS_PROXY)

[[mapping]]
manifest = "mapping.toml"
{contract}"#
    )
}

/// `src/lib.rs` of an adapter for a contract package: bindings for its world from `wit/`,
/// every function of its interface answering "not written yet" (its error with a message,
/// else a panic saying so) and a native test of the first function the model may call.
fn package_lib_rs(
    package: &crate::contract::package::ContractPackage,
    s: &crate::contract::skeleton::Skeleton,
    name: &str,
    connection: &str,
) -> String {
    let ty = type_name(name);
    let contract = package.interfaces.get(&s.interface);
    let semantics = |f: &str| contract.and_then(|c| c.functions.get(f));
    let mut o = String::new();
    let _ = writeln!(
        o,
        "//! `{name}`: an Airlock adapter over connection `{connection}`, implementing\n//! `{}` (package {}).\n//!\n//! Every function answers an error saying it is not written yet. `airlock contracts show\n//! {} --config airlock.toml` prints what each one means to the model and to the\n//! host; the SDK's README shows its upstream helpers (text and JSON answers).\n",
        s.interface, package.name, package.name
    );
    let _ = writeln!(
        o,
        "#[allow(unused_imports)]\nuse airlock_sdk::{{log, upstream}};\n"
    );
    let with: Vec<String> = s
        .imports
        .iter()
        .filter_map(|i| {
            // The SDK's module of each host interface it provides.
            let module = match i.as_str() {
                "airlock:host/upstream@0.1.0" => "bindings::airlock::host::upstream",
                "airlock:host/log@0.1.0" => "bindings::airlock::host::log",
                "airlock:host/context@0.2.0" => "bindings_host::airlock::host0_2_0::context",
                "airlock:host/settings@0.3.0" => {
                    "bindings_host_0_3_0::airlock::host0_3_0::settings"
                }
                _ => return None,
            };
            Some(format!("            \"{i}\": airlock_sdk::{module},\n"))
        })
        .collect();
    let _ = writeln!(
        o,
        "/// The contract's bindings, generated from `wit/` (the host interfaces from the SDK).\n#[allow(missing_docs, clippy::all)]\nmod bindings {{\n    wit_bindgen::generate!({{\n        path: \"wit\",\n        world: \"{}\",\n        with: {{\n{}        }},\n    }});\n}}\n",
        s.world,
        with.concat()
    );
    let mut uses = vec!["Guest".to_string()];
    uses.extend(s.types.iter().cloned());
    let _ = writeln!(
        o,
        "#[allow(unused_imports)]\nuse bindings::{}::{{{}}};\n",
        s.module,
        uses.join(", ")
    );
    let _ = writeln!(
        o,
        "/// The adapter; it keeps no state between calls.\nstruct {ty};\n"
    );
    let _ = writeln!(o, "impl Guest for {ty} {{");
    for (i, f) in s.functions.iter().enumerate() {
        if i > 0 {
            o.push('\n');
        }
        if let Some(c) = semantics(&f.wit_name) {
            let sem = &c.semantics;
            let mut flags = vec![sem.class.as_str().to_string()];
            if sem.idempotent {
                flags.push("idempotent".into());
            }
            if let Some(q) = &c.query {
                flags.push(format!("queryable-by {q}"));
            }
            if let Some(u) = &c.undo {
                flags.push(format!("compensable-by {u}"));
            }
            if sem.host_only {
                flags.push("host-only: called by the host, never offered".into());
            }
            let _ = writeln!(o, "    /// `{}`: {}.", f.wit_name, flags.join(", "));
        }
        let params: Vec<String> = f.params.iter().map(|(n, t)| format!("{n}: {t}")).collect();
        let _ = writeln!(
            o,
            "    fn {}({}) -> {} {{",
            f.rust_name,
            params.join(", "),
            f.result
        );
        for (n, _) in &f.params {
            let _ = writeln!(o, "        let _ = &{n};");
        }
        let _ = writeln!(
            o,
            "        // First step: call your server's tool with upstream::call_tool_json(TOOL, &args)\n        // and list TOOL in mapping.toml [upstream] tools (any other name is refused)."
        );
        let message = format!(
            "\"{} is not written yet: implement it in src/lib.rs\"",
            f.wit_name
        );
        match &f.error_with_message {
            Some(e) => {
                let _ = writeln!(o, "        log::debug({message});");
                let _ = writeln!(o, "        Err({})", e.replace("MESSAGE", &message));
            }
            None => {
                // No error case carries a message: stop the call with a panic that says
                // what to write (the host reports a trapped adapter, and nothing is sent).
                let _ = writeln!(o, "        panic!({message})");
            }
        }
        let _ = writeln!(o, "    }}");
    }
    let _ = writeln!(o, "}}\n");
    let _ = writeln!(o, "bindings::export!({ty} with_types_in bindings);");
    // A native test of the first function the model may call that answers an error.
    let tested = s.functions.iter().find(|f| {
        f.error_with_message.is_some()
            && semantics(&f.wit_name).is_some_and(|c| !c.semantics.host_only)
    });
    if let Some(f) = tested {
        let _ = writeln!(
            o,
            "\n// A native `cargo test`: the SDK's test kit answers the upstream calls from canned\n// replies, and an unexpected call fails the test naming the tool and its arguments.\n#[cfg(test)]\nmod tests {{\n    use super::*;\n    use airlock_sdk::testing::Upstream;\n\n    #[test]\n    fn {}_is_not_written_yet_and_calls_nothing_upstream() {{\n        let kit = Upstream::new().install();\n        let answer = {ty}::{}({});\n        assert!(answer.is_err());\n        assert!(kit.calls().is_empty());\n        // Then: reply with `.reply(TOOL, Reply::text(..))` and assert on the answer.\n    }}\n}}",
            f.rust_name,
            f.rust_name,
            f.example_args.join(", ")
        );
    }
    o
}

/// `mapping.toml` of an adapter for a contract package: a `[[capability]]` for every
/// function the model may call, its effect class confirmed from the package.
fn package_mapping_toml(
    package: &crate::contract::package::ContractPackage,
    s: &crate::contract::skeleton::Skeleton,
    name: &str,
    connection: &str,
) -> String {
    let mut o = mapping_head(
        name,
        &s.interface,
        connection,
        &format!(
            "# It binds the operator contract package {} (wit/): a reviewer approves\n# the package (`airlock contracts approve`) before this mapping.\n",
            package.name
        ),
    );
    let contract = package.interfaces.get(&s.interface);
    for f in &s.functions {
        let Some(c) = contract.and_then(|c| c.functions.get(&f.wit_name)) else {
            continue;
        };
        if c.semantics.host_only {
            let _ = write!(
                o,
                "\n# `{}` is called by the host only: it is never a capability.\n",
                f.wit_name
            );
            continue;
        }
        let _ = write!(
            o,
            "\n# What the model sees: a local name and a reviewed description.\n[[capability]]\nfunction = \"{}\"\nname = \"{}_{}\"\ndescription = \"{} with {name}. (Describe what it does for the model before review.)\"\neffect = \"{}\"\n",
            f.wit_name,
            name.replace('-', "_"),
            f.rust_name,
            f.wit_name,
            c.semantics.class.as_str(),
        );
    }
    o.push_str(GRANTS_AND_LIMITS);
    o
}

/// What `airlock pack` did.
#[derive(Debug, Serialize)]
pub struct PackReport {
    /// The manifest, as given.
    pub manifest: PathBuf,
    /// The mapping name.
    pub mapping: String,
    /// Where cargo wrote the component.
    pub built: PathBuf,
    /// Where it was placed (beside the manifest, as `[component] file`).
    pub component: PathBuf,
    /// Its sha256 (lowercase hex), now the manifest's pin.
    pub sha256: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// Whether `rustup target add` ran first.
    pub target_added: bool,
    /// A serve configuration beside the manifest (`airlock.toml`), if there is one.
    pub config: Option<PathBuf>,
}

impl PackReport {
    /// What was done, and the commands that come next.
    pub fn to_text(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "packed mapping `{}`: {} ({} bytes)",
            self.mapping,
            self.component.display(),
            self.bytes
        );
        let _ = writeln!(o, "  built    {}", self.built.display());
        let _ = writeln!(
            o,
            "  pinned   sha256 = \"{}\" in {}",
            self.sha256,
            self.manifest.display()
        );
        let config = self.config.as_ref().map_or_else(
            || "YOUR-SERVE-CONFIG".to_string(),
            |c| c.display().to_string(),
        );
        let _ = writeln!(o, "next:");
        let _ = writeln!(o, "  airlock grants {}", self.manifest.display());
        let _ = writeln!(
            o,
            "  airlock review approve {} --config {config} --reviewer YOU",
            self.mapping
        );
        o
    }
}

/// `airlock pack`: builds the crate beside `manifest` for [`GUEST_TARGET`] (release),
/// adding the target to the toolchain when it is missing (saying so on stderr), places
/// the component beside the manifest under its `[component] file` name, writes its sha256
/// as the pin, and checks the pinned manifest with the host's parser.
///
/// # Errors
/// No `Cargo.toml` beside the manifest, a manifest without `[component] file`, rustup or
/// cargo failing (their messages are on stderr), a build without a `.wasm` artifact or one
/// that is not a component, or the pinned manifest failing the host's check.
pub fn pack(manifest: &Path) -> Result<PackReport> {
    let text = std::fs::read_to_string(manifest)
        .with_context(|| format!("reading {}", manifest.display()))?;
    let table: toml::Table =
        toml::from_str(&text).with_context(|| format!("{} is not TOML", manifest.display()))?;
    let get = |section: &str, key: &str| {
        table
            .get(section)
            .and_then(|s| s.get(key))
            .and_then(toml::Value::as_str)
            .map(str::to_string)
    };
    let name = get("mapping", "name")
        .with_context(|| format!("{}: no [mapping] name", manifest.display()))?;
    let file = get("component", "file")
        .with_context(|| format!("{}: no [component] file", manifest.display()))?;
    if file.contains(['/', '\\']) || file == ".." || file.is_empty() {
        bail!(
            "{}: [component] file `{file}` must be a plain file name beside the manifest",
            manifest.display()
        );
    }
    let dir = manifest
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    // Absolute: cargo runs in the manifest's folder, where a relative path would not hold.
    let dir = &dir
        .canonicalize()
        .with_context(|| format!("locating the folder of {}", manifest.display()))?;
    let cargo_toml = dir.join("Cargo.toml");
    if !cargo_toml.is_file() {
        bail!(
            "no Cargo.toml beside {}: `airlock pack` builds the adapter crate in the manifest's folder",
            manifest.display()
        );
    }

    let target_added = ensure_target(dir)?;
    let built = build(&cargo_toml)?;
    let wasm = std::fs::read(&built).with_context(|| format!("reading {}", built.display()))?;
    if !wasm.starts_with(&COMPONENT_PREAMBLE) {
        bail!(
            "{} is not a WebAssembly component (is the crate a `cdylib` built for {GUEST_TARGET}?)",
            built.display()
        );
    }
    let sha256 = hex::encode(sha2::Sha256::digest(&wasm));
    let component = dir.join(&file);
    std::fs::write(&component, &wasm)
        .with_context(|| format!("writing {}", component.display()))?;
    let pinned = pin(&text, &sha256).with_context(|| {
        format!(
            "{}: no `file = ...` line in [component] to pin beside",
            manifest.display()
        )
    })?;
    let config = Some(dir.join("airlock.toml")).filter(|c| c.is_file());
    // The contracts the author's configuration names (approved or not yet), besides the
    // built-in ones: what the manifest's capabilities are checked against.
    let contracts = match &config {
        Some(path) => crate::config::ServeConfig::load(path)
            .and_then(|c| crate::registry::contracts::ContractSet::judge(&c, None))
            .unwrap_or_else(|_| crate::registry::contracts::ContractSet::built_in()),
        None => crate::registry::contracts::ContractSet::built_in(),
    };
    MappingManifest::parse_in(&pinned, &manifest.display().to_string(), Some(dir))
        .and_then(|m| {
            let contract = contracts.declared(&m.mapping.contract).with_context(|| {
                format!(
                    "contract `{}` is neither built in nor a package {} names",
                    m.mapping.contract,
                    config
                        .as_ref()
                        .map_or("airlock.toml beside the manifest".to_string(), |c| c
                            .display()
                            .to_string())
                )
            })?;
            m.check_semantics(&contract)
        })
        .context("the pinned manifest does not pass the host's check; it was not written")?;
    std::fs::write(manifest, &pinned).with_context(|| format!("writing {}", manifest.display()))?;
    Ok(PackReport {
        manifest: manifest.to_path_buf(),
        mapping: name,
        built,
        component,
        sha256,
        bytes: wasm.len() as u64,
        target_added,
        config,
    })
}

/// Adds [`GUEST_TARGET`] to the toolchain `dir` uses when its standard library is
/// missing; returns whether it did.
fn ensure_target(dir: &Path) -> Result<bool> {
    let probe = Command::new("rustc")
        .args(["--print", "target-libdir", "--target", GUEST_TARGET])
        .current_dir(dir)
        .output()
        .context("running `rustc` (is Rust installed? https://rustup.rs)")?;
    let libdir = String::from_utf8_lossy(&probe.stdout).trim().to_string();
    if probe.status.success() && !libdir.is_empty() && Path::new(&libdir).is_dir() {
        return Ok(false);
    }
    eprintln!(
        "airlock: the {GUEST_TARGET} target is not installed for this toolchain; running `rustup target add {GUEST_TARGET}`"
    );
    let status = Command::new("rustup")
        .args(["target", "add", GUEST_TARGET])
        .current_dir(dir)
        .stdout(Stdio::from(std::io::stderr()))
        .status()
        .context(
            "running `rustup` (install the target yourself: rustup target add wasm32-wasip2)",
        )?;
    if !status.success() {
        bail!(
            "`rustup target add {GUEST_TARGET}` failed ({status}); install the target for this toolchain"
        );
    }
    Ok(true)
}

/// `cargo build --release --target wasm32-wasip2` of `cargo_toml`; returns the `.wasm`
/// artifact cargo reports (wherever its target folder is).
fn build(cargo_toml: &Path) -> Result<PathBuf> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let dir = cargo_toml.parent().unwrap_or(Path::new("."));
    let output = Command::new(&cargo)
        .args(["build", "--release", "--target", GUEST_TARGET])
        .arg("--manifest-path")
        .arg(cargo_toml)
        .args(["--message-format", "json-render-diagnostics"])
        .current_dir(dir)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .context("running `cargo`")?;
    if !output.status.success() {
        bail!(
            "`cargo build --release --target {GUEST_TARGET} --manifest-path {}` failed ({}); its messages are above",
            cargo_toml.display(),
            output.status
        );
    }
    let mut wasm = None;
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if message["reason"] != "compiler-artifact" {
            continue;
        }
        let cdylib = message["target"]["kind"]
            .as_array()
            .is_some_and(|k| k.iter().any(|k| k == "cdylib"));
        let file = message["filenames"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(serde_json::Value::as_str)
            .find(|f| f.ends_with(".wasm"));
        if let (true, Some(file)) = (cdylib, file) {
            wasm = Some(PathBuf::from(file));
        }
    }
    wasm.with_context(|| {
        format!(
            "cargo built no .wasm for {} (its [lib] must say crate-type = [\"cdylib\"])",
            cargo_toml.display()
        )
    })
}

/// `mapping` with `sha256 = "<hex>"` right after the `[component]` table's `file` line,
/// any earlier `sha256` line of that table (and the stub comment `new` writes) dropped.
/// `None` when that table has no `file` line. Line-based, so comments and layout stay.
fn pin(mapping: &str, sha256: &str) -> Option<String> {
    let mut out = String::with_capacity(mapping.len() + 80);
    let mut table = String::new();
    let mut pinned = false;
    for line in mapping.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('[') {
            table = trimmed.trim_matches(['[', ']']).trim().to_string();
        }
        let key = trimmed
            .trim_start_matches('#')
            .split('=')
            .next()
            .unwrap_or("")
            .trim();
        let in_component = table == "component";
        if in_component && key == "sha256" {
            continue;
        }
        out.push_str(line);
        out.push('\n');
        if in_component && !pinned && !trimmed.starts_with('#') && key == "file" {
            let _ = writeln!(out, "sha256 = \"{sha256}\"");
            pinned = true;
        }
    }
    pinned.then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_package_crate_depends_on_the_sdks_own_wit_bindgen() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
        let text = std::fs::read_to_string(root).unwrap();
        assert!(
            text.contains(&format!("wit-bindgen = {{ version = \"{WIT_BINDGEN}\"")),
            "WIT_BINDGEN must equal the workspace's wit-bindgen"
        );
    }

    #[test]
    fn a_folder_that_is_not_a_good_package_is_refused_with_the_loaders_words() {
        let dir = tempfile::tempdir().unwrap();
        fn options(contract: &str) -> NewOptions<'_> {
            NewOptions {
                contract,
                name: "x",
                connection: None,
                dir: None,
                sdk: None,
            }
        }
        // Nothing there.
        let path = dir.path().display().to_string();
        let path = path.as_str();
        let e = format!("{:#}", new_crate(&options(path)).unwrap_err());
        assert!(e.contains("no contract.toml"), "{e}");
        // WIT with semantics, but two adapter worlds: which one is the author's?
        let ws = Path::new(env!("CARGO_MANIFEST_DIR")).join("../contracts/workspace-edits");
        for f in ["contract.toml", "deps/host/host.wit"] {
            let to = dir.path().join(f);
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            std::fs::copy(ws.join(f), to).unwrap();
        }
        let wit = std::fs::read_to_string(ws.join("workspace.wit")).unwrap();
        std::fs::write(
            dir.path().join("workspace.wit"),
            format!(
                "{wit}\nworld second-adapter {{\n    include airlock:host/adapter-host@0.1.0;\n    export workspace-edits;\n}}\n"
            ),
        )
        .unwrap();
        let e = format!("{:#}", new_crate(&options(path)).unwrap_err());
        assert!(e.contains("has 2 adapter worlds"), "{e}");
        // A name that is neither a built-in contract nor a folder.
        let e = format!("{:#}", new_crate(&options("no-such-contract")).unwrap_err());
        assert!(e.contains("unknown contract"), "{e}");
    }

    #[test]
    fn a_built_in_name_that_is_also_a_folder_here_is_refused_as_ambiguous() {
        assert!(!names_folder("source-retrieval", false).unwrap());
        assert!(
            !names_folder("airlock:contracts/source-retrieval@0.1.0", false).unwrap(),
            "a full interface name is never a path"
        );
        let e = format!("{:#}", names_folder("source-retrieval", true).unwrap_err());
        assert!(e.contains("write `./source-retrieval`"), "{e}");
        assert!(names_folder("./source-retrieval", true).unwrap());
        assert!(names_folder("contracts/workspace-edits", false).unwrap());
        assert!(names_folder("my-package", true).unwrap());
        assert!(
            !names_folder("my-package", false).unwrap(),
            "neither: `new` then names the built-ins"
        );
    }

    #[test]
    fn every_contract_the_host_knows_has_a_template_with_every_function() {
        let known = crate::contract::known_contracts();
        let templated: Vec<&str> = TEMPLATES.iter().map(|t| t.interface).collect();
        for k in &known {
            assert!(
                templated.contains(&k.as_str()),
                "`airlock new` has no template for {k}"
            );
        }
        for t in TEMPLATES {
            let contract = crate::contract::load_contract(t.interface).unwrap();
            let functions: Vec<&str> = t.functions.iter().map(|f| f.function).collect();
            let wit: Vec<&str> = contract.functions.keys().map(String::as_str).collect();
            let mut sorted = functions.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, wit, "{}: the template's functions", t.interface);
            for f in t.functions {
                let e = contract.semantics(f.function).unwrap();
                assert_eq!(f.capability.is_none(), e.host_only, "{}", f.function);
            }
        }
    }

    #[test]
    fn the_generated_mapping_passes_the_hosts_check_once_pinned() {
        for t in TEMPLATES {
            let text = mapping_toml(t, "my-adapter", "up");
            // Unpinned, the host refuses it (a reviewer pins the component).
            let err = MappingManifest::parse(&text, "new").unwrap_err();
            assert!(format!("{err:#}").contains("no sha256 pin"), "{err:#}");
            let pinned = pin(&text, &"a".repeat(64)).unwrap();
            let m = MappingManifest::parse(&pinned, "new").unwrap();
            assert!(m.upstream.tools.is_empty(), "deny by default");
            assert!(m.grants.named_hosts().is_empty());
            crate::registry::live::check_contract(
                &m,
                &crate::registry::contracts::ContractSet::built_in(),
            )
            .unwrap();
            let offered = t
                .functions
                .iter()
                .filter(|f| f.capability.is_some())
                .count();
            assert_eq!(m.capabilities.len(), offered);
            // Pinning again replaces the pin.
            let again = pin(&pinned, &"b".repeat(64)).unwrap();
            assert_eq!(again.matches("sha256 = ").count(), 1, "{again}");
            assert!(again.contains(&"b".repeat(64)));
        }
    }

    #[test]
    fn names_and_contracts_are_checked() {
        assert!(template("source-retrieval").is_ok());
        assert!(template("airlock:contracts/artifact-delivery@0.2.0").is_ok());
        let err = template("link-check").unwrap_err().to_string();
        assert!(
            err.contains("airlock:contracts/source-retrieval@0.1.0"),
            "{err}"
        );
        for bad in ["", "My-Notes", "1notes", "a/b", "../x", &"a".repeat(65)] {
            assert!(check_name("name", bad).is_err(), "{bad}");
        }
        check_name("name", "my-notes_2").unwrap();
        assert_eq!(type_name("my-notes_2"), "MyNotes2");
        assert_eq!(component_file("my-notes"), "my_notes.wasm");
    }
}
