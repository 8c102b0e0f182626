//! Mapping manifests: the reviewed binding of one adapter component to one contract and
//! one connection.
//!
//! Rule: a manifest is read strictly. Unknown keys, a missing component pin, a capability
//! that names a function the contract lacks, two capabilities with one name, a limit of
//! zero (but the queue's, where zero turns queuing off) or above the host ceiling: each is
//! an error that names the file and the key.
//! Grants are deny by default: see [`crate::grants`] for their accepted forms.
//!
//! Effects are confirmed, never taken: each `[[capability]]` repeats the effect class its
//! contract package declares for the function ([`crate::contract::Contract::semantics`]),
//! so a reviewer signs off on what the call does; a missing, unknown or different class is
//! refused when the mapping is checked against its contract
//! ([`MappingManifest::check_semantics`]; parsing alone refuses only a word that is not a
//! class). The optional flags may only **narrow** the contract's declaration (a
//! mapping whose upstream has no lookup says `queryable = false`); `true` where the
//! contract says false is refused. The capability serves with the narrowed semantics.
//! Server annotations (`readOnlyHint`, ...) play no part: they are hints.
//!
//! Accepted form:
//!
//! ```toml
//! [mapping]
//! name = "source-library"                              # [a-z0-9-], unique per host
//! contract = "airlock:contracts/source-retrieval@0.1.0"
//! connection = "notes"                                 # a connection in the serve config
//! data_class = "internal"                              # optional; policy input; default internal
//!
//! [component]
//! file = "source_library.wasm"                         # relative to the manifest
//! sha256 = "<64 lowercase hex>"                        # the reviewed component's digest
//!
//! [upstream]
//! tools = ["search_notes", "read_note"]                # upstream names the adapter may call
//! resources = ["notes://"]                             # URI prefixes it may read; [] = none
//!
//! [[capability]]                                       # one per exported function offered
//! function = "search"
//! name = "search_sources"                              # the name the model sees
//! description = "..."                                  # the reviewed text the model sees
//! effect = "read"          # required: the contract's class, confirmed (read,
//!                          # local-transformation, reversible-mutation, external-effect)
//! # idempotent = false     # optional narrowing of the contract's flags: only true -> false
//! # queryable = false
//! # compensable = false
//!
//! [grants]                                             # empty: no filesystem, network, env
//!
//! [settings]                 # optional: the operator's values the adapter reads through
//! repository = "/srv/repo"   # airlock:host/settings@0.3.0 (never the model's): a string
//! max-results = 20           # (<= 4096 bytes), an integer or a boolean each; names
//! follow-links = false       # [a-z][a-z0-9-]*, at most 64 settings
//!
//! [limits]
//! memory_mib = 64            # all memories and tables together; default 64, ceiling 1024
//! deadline_ms = 5000         # wall clock per call; default 5000, ceiling 60000
//! max_output_bytes = 262144  # per upstream answer; default 256 KiB, ceiling 8 MiB
//! max_output_items = 64      # content items per upstream answer; default 64, ceiling 4096
//! allowed_media_types = ["text/*", "application/json"]  # the default; see runtime::budgets
//! max_result_bytes = 1048576 # the adapter's return value as JSON; default 1 MiB, ceiling 16 MiB
//! max_stdio_bytes = 65536    # captured stdout and stderr, each; default 64 KiB, ceiling 1 MiB
//! # fuel = 1000000000        # optional instruction budget per call; ceiling 10^12
//! max_concurrent_calls = 8   # instances of this adapter at once; ceiling 256
//! queue_timeout_ms = 250     # how long a call past them waits for one, in arrival order,
//!                            # before it is refused as rate limited; 0 refuses at once;
//!                            # ceiling 10000
//! max_queued_calls = 64      # calls waiting at once; one more is refused at once; ceiling 4096
//! max_upstream_requests = 32 # upstream requests one call may make; ceiling 1024
//! ```

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, bail};
use serde::Deserialize;

use crate::contract::{Contract, EffectClass, EffectSemantics, Narrowing};
use crate::grants::{Grants, GrantsSection};

/// Host-wide ceiling on `limits.memory_mib`.
pub const MAX_MEMORY_MIB: u64 = 1024;
/// Host-wide ceiling on `limits.deadline_ms`.
pub const MAX_DEADLINE_MS: u64 = 60_000;
/// Host-wide ceiling on `limits.max_output_bytes` ([`airlock_upstream::MAX_OUTPUT_BYTES`]).
pub const MAX_OUTPUT_BYTES: u64 = airlock_upstream::MAX_OUTPUT_BYTES;
/// Host-wide ceiling on `limits.max_result_bytes`.
pub const MAX_RESULT_BYTES: u64 = 16 * 1024 * 1024;
/// Host-wide ceiling on `limits.max_stdio_bytes`.
pub const MAX_STDIO_BYTES: u64 = 1024 * 1024;
/// Host-wide ceiling on `limits.max_concurrent_calls`.
pub const MAX_CONCURRENT_CALLS: u64 = 256;
/// Host-wide ceiling on `limits.queue_timeout_ms`.
pub const MAX_QUEUE_TIMEOUT_MS: u64 = 10_000;
/// Host-wide ceiling on `limits.max_queued_calls`.
pub const MAX_QUEUED_CALLS: u64 = 4096;
/// Host-wide ceiling on `limits.max_upstream_requests`.
pub const MAX_UPSTREAM_REQUESTS: u64 = 1024;
/// Host-wide ceiling on `limits.fuel`.
pub const MAX_FUEL: u64 = 1_000_000_000_000;

/// A parsed, validated mapping manifest.
#[derive(Debug, Clone)]
pub struct MappingManifest {
    /// Where it was read from (for messages), or a label for in-memory manifests.
    pub source: String,
    pub mapping: MappingSection,
    pub component: ComponentSection,
    pub upstream: UpstreamSection,
    pub capabilities: Vec<CapabilitySection>,
    /// The grants as written (for review output).
    pub grants_section: GrantsSection,
    /// The grants, validated and resolved against the manifest's folder.
    pub grants: Grants,
    pub limits: Limits,
    /// `[settings]`: the operator's values for this mapping, by name (sorted), handed to
    /// the adapter through `airlock:host/settings@0.3.0`.
    pub settings: Settings,
}

/// Most settings one manifest may set.
pub const MAX_SETTINGS: usize = 64;
/// Longest text setting, in bytes.
pub const MAX_SETTING_TEXT: usize = 4096;

/// A mapping's settings by name ([`MappingManifest::settings`]).
pub type Settings = std::collections::BTreeMap<String, SettingValue>;

/// One setting's value, as the manifest writes it and the host API hands it over.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(untagged)]
pub enum SettingValue {
    /// A TOML string.
    Text(String),
    /// A TOML integer.
    Integer(i64),
    /// A TOML boolean.
    Boolean(bool),
}

impl std::fmt::Display for SettingValue {
    /// As TOML writes it: a quoted, escaped string, a number, `true`/`false`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Text(t) => write!(f, "{t:?}"),
            Self::Integer(i) => write!(f, "{i}"),
            Self::Boolean(b) => write!(f, "{b}"),
        }
    }
}

/// The settings of `raw` (the `[settings]` table), checked.
///
/// # Errors
/// More than [`MAX_SETTINGS`]; a name that is not `[a-z][a-z0-9-]*` of at most 64
/// characters; a value that is not a string, an integer or a boolean; a string longer than
/// [`MAX_SETTING_TEXT`] bytes or holding a NUL.
fn settings(raw: toml::Table, src: &str) -> Result<Settings> {
    if raw.len() > MAX_SETTINGS {
        bail!(
            "mapping manifest {src}: [settings] sets {} values, more than {MAX_SETTINGS}",
            raw.len()
        );
    }
    let mut out = Settings::new();
    for (name, value) in raw {
        let shown: String = name.chars().take(64).collect();
        let name_ok = name.len() <= 64
            && name.starts_with(|c: char| c.is_ascii_lowercase())
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !name_ok {
            bail!(
                "mapping manifest {src}: [settings] name {shown:?} must be 1-64 characters of a-z, 0-9, `-`, starting with a letter"
            );
        }
        let value = match value {
            toml::Value::String(s) if s.len() > MAX_SETTING_TEXT => bail!(
                "mapping manifest {src}: [settings] {name} is {} bytes, more than {MAX_SETTING_TEXT}",
                s.len()
            ),
            toml::Value::String(s) if s.contains('\0') => {
                bail!("mapping manifest {src}: [settings] {name} holds a NUL character")
            }
            toml::Value::String(s) => SettingValue::Text(s),
            toml::Value::Integer(i) => SettingValue::Integer(i),
            toml::Value::Boolean(b) => SettingValue::Boolean(b),
            other => bail!(
                "mapping manifest {src}: [settings] {name} is a {}: a setting is a string, an integer or a boolean",
                other.type_str()
            ),
        };
        out.insert(name, value);
    }
    Ok(out)
}

/// `[mapping]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MappingSection {
    pub name: String,
    pub contract: String,
    pub connection: String,
    /// The reviewed data class of what this mapping handles (`[a-z0-9-_]`, default
    /// [`DEFAULT_DATA_CLASS`]); policies see it as `resource.data_class`.
    #[serde(default = "default_data_class")]
    pub data_class: String,
}

/// The data class of a mapping whose manifest does not declare one.
pub const DEFAULT_DATA_CLASS: &str = "internal";

fn default_data_class() -> String {
    DEFAULT_DATA_CLASS.to_string()
}

/// `[component]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComponentSection {
    /// Component file, relative to the manifest's folder.
    pub file: PathBuf,
    /// Lowercase hex sha256 of the reviewed component.
    pub sha256: Option<String>,
}

/// `[upstream]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamSection {
    /// Upstream tool names the adapter may call. Empty = none.
    #[serde(default)]
    pub tools: Vec<String>,
    /// Resource URI prefixes the adapter may read. Empty = none.
    #[serde(default)]
    pub resources: Vec<String>,
}

/// One `[[capability]]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CapabilitySection {
    /// The contract function it runs.
    pub function: String,
    /// The local name the model sees.
    pub name: String,
    /// The reviewed description the model sees.
    pub description: String,
    /// The effect class the reviewer confirms (`read`, `local-transformation`,
    /// `reversible-mutation`, `external-effect`). Required; it must equal the class the
    /// host declares for the function. (An `Option` only so that a missing one is refused
    /// with a message naming the capability.)
    #[serde(default)]
    pub effect: Option<String>,
    /// `false` narrows a contract that declares the function idempotent; `true` is only
    /// accepted where the contract says so too.
    #[serde(default)]
    pub idempotent: Option<bool>,
    /// `false` narrows a contract that declares the function queryable (the upstream has
    /// no lookup); `true` only where the contract says so too.
    #[serde(default)]
    pub queryable: Option<bool>,
    /// `false` narrows a contract that declares the function compensable; `true` only
    /// where the contract says so too.
    #[serde(default)]
    pub compensable: Option<bool>,
}

impl CapabilitySection {
    /// Checks what can be checked without the contract: an `effect` names an effect
    /// class. (A missing one is refused by [`CapabilitySection::semantics`], which can say
    /// which class the contract declares.)
    ///
    /// # Errors
    /// It is not a class; the message names the capability.
    pub fn check_form(&self) -> Result<()> {
        let name = &self.name;
        match &self.effect {
            Some(effect) if EffectClass::parse(effect).is_none() => bail!(
                "capability `{name}`: effect `{effect}` is not an effect class (one of {})",
                EffectClass::ALL.map(EffectClass::as_str).join(", ")
            ),
            _ => Ok(()),
        }
    }

    /// The effective semantics of this capability in contract `contract`: the host's
    /// declaration for the function, its class confirmed and its flags narrowed by this
    /// section. `Ok(None)` when the host declares nothing for the function (such a
    /// capability is refused when the mapping loads).
    ///
    /// # Errors
    /// `effect` is missing, is not a class, or differs from the declared class; a flag
    /// widens the declaration. The message names the capability.
    pub fn semantics(&self, contract: &Contract) -> Result<Option<EffectSemantics>> {
        let name = &self.name;
        let interface = &contract.interface;
        let declared = contract.semantics(&self.function);
        let classes = EffectClass::ALL.map(EffectClass::as_str).join(", ");
        let Some(effect) = &self.effect else {
            match declared {
                Some(d) => bail!(
                    "capability `{name}` has no `effect`; the contract declares {interface}#{} as `{}`: confirm it with effect = \"{}\"",
                    self.function,
                    d.class,
                    d.class
                ),
                None => bail!("capability `{name}` has no `effect` (one of {classes})"),
            }
        };
        let Some(class) = EffectClass::parse(effect) else {
            bail!(
                "capability `{name}`: effect `{effect}` is not an effect class (one of {classes})"
            );
        };
        let Some(declared) = declared else {
            return Ok(None);
        };
        if class != declared.class {
            bail!(
                "capability `{name}`: effect = \"{class}\", but the contract declares {interface}#{} as `{}`; a mapping confirms the contract's class and cannot change it",
                self.function,
                declared.class
            );
        }
        declared
            .narrowed(Narrowing {
                idempotent: self.idempotent,
                queryable: self.queryable,
                compensable: self.compensable,
            })
            .map(Some)
            .map_err(|why| anyhow::anyhow!("capability `{name}`: {why}"))
    }
}

/// `[limits]`, with defaults applied. Output budgets (`max_output_bytes`,
/// `max_output_items`, `allowed_media_types`) are explained, with what counts as an item
/// and how a block without a media type counts, in [`crate::budgets`].
#[derive(Debug, Clone, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Linear memory plus tables the instance may grow to, in MiB.
    pub memory_mib: u64,
    /// Wall-clock budget of one call, in milliseconds; past it the guest traps.
    pub deadline_ms: u64,
    /// Largest upstream answer the adapter may receive, in bytes of JSON-RPC message.
    pub max_output_bytes: u64,
    /// Most content items one upstream answer may carry (a tool result's content blocks
    /// plus its `structuredContent`; a resource read's contents entries).
    pub max_output_items: u64,
    /// Media types the items of an upstream answer may have: `type/subtype` or `type/*`.
    pub allowed_media_types: Vec<String>,
    /// Largest value the adapter may return, in bytes of JSON.
    pub max_result_bytes: u64,
    /// Capacity of each captured guest output stream (stdout, stderr), in bytes.
    pub max_stdio_bytes: u64,
    /// Instruction budget per call (wasmtime fuel); `None` = only the deadline bounds it.
    pub fuel: Option<u64>,
    /// Calls of this adapter running at once; one more waits in the adapter's queue.
    pub max_concurrent_calls: u64,
    /// How long a call waits for one of `max_concurrent_calls`, in milliseconds, before it
    /// is refused as rate limited; 0 refuses at once.
    pub queue_timeout_ms: u64,
    /// Calls waiting for one of `max_concurrent_calls` at once; one more is refused at
    /// once (0: none waits).
    pub max_queued_calls: u64,
    /// Upstream requests (tools/call, resources/read) one call may make.
    pub max_upstream_requests: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            memory_mib: 64,
            deadline_ms: 5_000,
            max_output_bytes: 256 * 1024,
            max_output_items: crate::budgets::DEFAULT_MAX_OUTPUT_ITEMS,
            allowed_media_types: crate::budgets::DEFAULT_MEDIA_TYPES
                .iter()
                .map(|t| (*t).to_string())
                .collect(),
            max_result_bytes: 1024 * 1024,
            max_stdio_bytes: 64 * 1024,
            fuel: None,
            max_concurrent_calls: 8,
            queue_timeout_ms: 250,
            max_queued_calls: 64,
            max_upstream_requests: 32,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawManifest {
    mapping: MappingSection,
    component: ComponentSection,
    #[serde(default = "empty_upstream")]
    upstream: UpstreamSection,
    #[serde(default)]
    capability: Vec<CapabilitySection>,
    #[serde(default)]
    grants: GrantsSection,
    #[serde(default)]
    limits: Limits,
    #[serde(default)]
    settings: toml::Table,
}

fn empty_upstream() -> UpstreamSection {
    UpstreamSection {
        tools: vec![],
        resources: vec![],
    }
}

impl MappingManifest {
    /// Reads and validates the manifest at `path`.
    ///
    /// # Errors
    /// Unreadable file, TOML syntax, unknown keys, or any rule in the module doc.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading mapping manifest {}", path.display()))?;
        Self::parse_in(&text, &path.display().to_string(), path.parent())
    }

    /// Parses and validates manifest `text` that has no folder (relative filesystem
    /// grants are refused); `source` names it in errors.
    ///
    /// # Errors
    /// TOML syntax, unknown keys, or any rule in the module doc.
    pub fn parse(text: &str, source: &str) -> Result<Self> {
        Self::parse_in(text, source, None)
    }

    /// Parses and validates manifest `text` whose relative paths resolve against `base`.
    ///
    /// # Errors
    /// TOML syntax, unknown keys, grants that do not resolve, or any rule in the module doc.
    pub fn parse_in(text: &str, source: &str, base: Option<&Path>) -> Result<Self> {
        let raw: RawManifest =
            toml::from_str(text).with_context(|| format!("mapping manifest {source}"))?;
        let grants = Grants::resolve(&raw.grants, base)
            .with_context(|| format!("mapping manifest {source}: [grants]"))?;
        let settings = settings(raw.settings, source)?;
        let m = MappingManifest {
            source: source.to_string(),
            mapping: raw.mapping,
            component: raw.component,
            upstream: raw.upstream,
            capabilities: raw.capability,
            grants_section: raw.grants,
            grants,
            limits: raw.limits,
            settings,
        };
        m.validate()?;
        Ok(m)
    }

    fn validate(&self) -> Result<()> {
        let src = &self.source;
        let name_ok = |n: &str| {
            !n.is_empty()
                && n.len() <= 64
                && n.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        };
        if !name_ok(&self.mapping.name) {
            bail!(
                "mapping manifest {src}: [mapping] name `{}` must be 1-64 characters of a-z, 0-9, `-`, `_`",
                self.mapping.name
            );
        }
        if !name_ok(&self.mapping.data_class) {
            bail!(
                "mapping manifest {src}: [mapping] data_class `{}` must be 1-64 characters of a-z, 0-9, `-`, `_`",
                self.mapping.data_class
            );
        }
        if !name_ok(&self.mapping.connection) {
            bail!(
                "mapping manifest {src}: [mapping] connection `{}` must be 1-64 characters of a-z, 0-9, `-`, `_`",
                self.mapping.connection
            );
        }
        match &self.component.sha256 {
            None => bail!(
                "mapping manifest {src}: [component] has no sha256 pin; a reviewer must pin the component (sha256sum of {})",
                self.component.file.display()
            ),
            Some(d)
                if d.len() != 64 || !d.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) =>
            {
                bail!(
                    "mapping manifest {src}: [component] sha256 must be 64 lowercase hex digits, got `{d}`"
                )
            }
            Some(_) => {}
        }
        if self.capabilities.is_empty() {
            bail!("mapping manifest {src}: no [[capability]]; a mapping must offer at least one");
        }
        let mut names = BTreeSet::new();
        for cap in &self.capabilities {
            if !cap
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
                || cap.name.is_empty()
                || cap.name.len() > 64
            {
                bail!(
                    "mapping manifest {src}: capability name `{}` must be 1-64 characters of A-Z, a-z, 0-9, `_`, `-`",
                    cap.name
                );
            }
            if !names.insert(cap.name.as_str()) {
                bail!(
                    "mapping manifest {src}: capability name `{}` appears twice",
                    cap.name
                );
            }
            if cap.description.trim().is_empty() {
                bail!(
                    "mapping manifest {src}: capability `{}` has no description",
                    cap.name
                );
            }
            cap.check_form()
                .map_err(|e| anyhow::anyhow!("mapping manifest {src}: {e}"))?;
        }
        for tool in &self.upstream.tools {
            if tool.is_empty() {
                bail!("mapping manifest {src}: [upstream] tools has an empty name");
            }
        }
        for prefix in &self.upstream.resources {
            if !prefix.contains("://") || !prefix.ends_with('/') {
                bail!(
                    "mapping manifest {src}: [upstream] resources prefix `{prefix}` must include a scheme and end in `/`, like `notes://` or `file:///srv/docs/`"
                );
            }
        }
        let l = &self.limits;
        for (key, value, ceiling) in [
            ("memory_mib", l.memory_mib, MAX_MEMORY_MIB),
            ("deadline_ms", l.deadline_ms, MAX_DEADLINE_MS),
            ("max_output_bytes", l.max_output_bytes, MAX_OUTPUT_BYTES),
            (
                "max_output_items",
                l.max_output_items,
                crate::budgets::MAX_OUTPUT_ITEMS,
            ),
            ("max_result_bytes", l.max_result_bytes, MAX_RESULT_BYTES),
            ("max_stdio_bytes", l.max_stdio_bytes, MAX_STDIO_BYTES),
            ("fuel", l.fuel.unwrap_or(1), MAX_FUEL),
            (
                "max_concurrent_calls",
                l.max_concurrent_calls,
                MAX_CONCURRENT_CALLS,
            ),
            (
                "max_upstream_requests",
                l.max_upstream_requests,
                MAX_UPSTREAM_REQUESTS,
            ),
        ] {
            if value == 0 || value > ceiling {
                bail!(
                    "mapping manifest {src}: [limits] {key} = {value} is outside 1..={ceiling} (the host ceiling)"
                );
            }
        }
        for (key, value, ceiling) in [
            ("queue_timeout_ms", l.queue_timeout_ms, MAX_QUEUE_TIMEOUT_MS),
            ("max_queued_calls", l.max_queued_calls, MAX_QUEUED_CALLS),
        ] {
            if value > ceiling {
                bail!(
                    "mapping manifest {src}: [limits] {key} = {value} is outside 0..={ceiling} (the host ceiling)"
                );
            }
        }
        self.validate_media_types()
    }

    fn validate_media_types(&self) -> Result<()> {
        use crate::budgets::{MAX_MEDIA_TYPES, MediaRange};
        let src = &self.source;
        let types = &self.limits.allowed_media_types;
        if types.is_empty() {
            bail!(
                "mapping manifest {src}: [limits] allowed_media_types is empty; an adapter that may receive no media type receives nothing (list the types, e.g. [\"text/*\", \"application/json\"])"
            );
        }
        if types.len() > MAX_MEDIA_TYPES {
            bail!(
                "mapping manifest {src}: [limits] allowed_media_types lists {} entries; at most {MAX_MEDIA_TYPES}",
                types.len()
            );
        }
        let mut seen = BTreeSet::new();
        for t in types {
            let shown: String = t.chars().take(80).collect();
            if let Err(why) = MediaRange::parse(t) {
                bail!(
                    "mapping manifest {src}: [limits] allowed_media_types entry {:?} {why}",
                    shown
                );
            }
            if !seen.insert(t.as_str()) {
                bail!("mapping manifest {src}: [limits] allowed_media_types lists {shown:?} twice");
            }
        }
        Ok(())
    }

    /// The effective semantics of `cap` (one of this manifest's capabilities): see
    /// [`CapabilitySection::semantics`]; `None` when the host declares none for it.
    pub fn semantics(
        &self,
        cap: &CapabilitySection,
        contract: &Contract,
    ) -> Option<EffectSemantics> {
        cap.semantics(contract).ok().flatten()
    }

    /// Checks every capability against `contract` (this manifest's contract): each
    /// confirms the declared class and only narrows its flags
    /// ([`CapabilitySection::semantics`]).
    ///
    /// # Errors
    /// The first capability that does not; the message names the manifest.
    pub fn check_semantics(&self, contract: &Contract) -> Result<()> {
        for cap in &self.capabilities {
            cap.semantics(contract)
                .map_err(|e| anyhow::anyhow!("mapping manifest {}: {e}", self.source))?;
        }
        Ok(())
    }

    /// The pinned component digest (validated present by `parse`).
    pub fn pinned_sha256(&self) -> &str {
        self.component.sha256.as_deref().unwrap_or_default()
    }

    /// The component path, resolved against the manifest's folder `base`.
    pub fn component_path(&self, base: &Path) -> PathBuf {
        base.join(&self.component.file)
    }
}

/// The contract and the `[[capability]]` tables of manifest text, read leniently (every
/// other key ignored, nothing resolved): for showing what a recorded revision confirmed.
///
/// # Errors
/// The text is not TOML, or those parts do not have their accepted form.
pub fn recorded_capabilities(text: &str) -> Result<(String, Vec<CapabilitySection>)> {
    #[derive(Deserialize)]
    struct Contract {
        contract: String,
    }
    #[derive(Deserialize)]
    struct Parts {
        mapping: Contract,
        #[serde(default)]
        capability: Vec<CapabilitySection>,
    }
    let parts: Parts = toml::from_str(text).context("reading the recorded manifest")?;
    Ok((parts.mapping.contract, parts.capability))
}

/// Checks `bytes` against the manifest pin.
///
/// # Errors
/// The digests differ; the message names both.
pub fn verify_pin(manifest: &MappingManifest, bytes: &[u8]) -> Result<()> {
    use sha2::Digest as _;
    let actual = hex::encode(sha2::Sha256::digest(bytes));
    let pinned = manifest.pinned_sha256();
    if actual != pinned {
        bail!(
            "component pin mismatch for mapping `{}`: manifest {} pins sha256 {pinned}, but {} has sha256 {actual}; refusing to load it (re-review the component and update the pin)",
            manifest.mapping.name,
            manifest.source,
            manifest.component.file.display(),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[mapping]
name = "source-library"
contract = "airlock:contracts/source-retrieval@0.1.0"
connection = "notes"
[component]
file = "c.wasm"
sha256 = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
[upstream]
tools = ["search_notes"]
resources = ["notes://"]
[[capability]]
function = "search"
name = "search_sources"
description = "Search."
effect = "read"
[grants]
[limits]
deadline_ms = 100
"#;

    #[test]
    fn settings_are_strings_integers_or_booleans_under_plain_names() {
        let with = |table: &str| format!("{GOOD}[settings]\n{table}\n");
        let m = MappingManifest::parse(
            &with("repository = \"/srv/repo\"\nmax-results = 20\nfollow = false"),
            "t",
        )
        .unwrap();
        assert_eq!(
            m.settings.iter().collect::<Vec<_>>(),
            [
                (&"follow".to_string(), &SettingValue::Boolean(false)),
                (&"max-results".to_string(), &SettingValue::Integer(20)),
                (
                    &"repository".to_string(),
                    &SettingValue::Text("/srv/repo".into())
                ),
            ]
        );
        assert!(
            MappingManifest::parse(GOOD, "t")
                .unwrap()
                .settings
                .is_empty()
        );
        let refused = |table: &str| {
            format!(
                "{:#}",
                MappingManifest::parse(&with(table), "t").unwrap_err()
            )
        };
        for (table, needle) in [
            ("ratio = 0.5", "ratio is a float"),
            ("paths = [\"a\"]", "paths is a array"),
            ("nested = { a = 1 }", "nested is a table"),
            ("when = 1979-05-27", "when is a datetime"),
            ("Upper = 1", "must be 1-64 characters"),
            ("\"with space\" = 1", "must be 1-64 characters"),
            ("\"1st\" = 1", "must be 1-64 characters"),
            ("under_score = 1", "must be 1-64 characters"),
            ("nul = \"a\\u0000b\"", "holds a NUL"),
        ] {
            let e = refused(table);
            assert!(e.contains(needle), "{table}: {e}");
        }
        let long = format!("big = \"{}\"", "x".repeat(MAX_SETTING_TEXT + 1));
        assert!(refused(&long).contains("more than 4096"));
        let many: String = (0..=MAX_SETTINGS)
            .map(|i| format!("s{i} = {i}\n"))
            .collect();
        assert!(refused(&many).contains("more than 64"));
        let name = format!("{} = 1", "a".repeat(65));
        assert!(refused(&name).contains("must be 1-64 characters"));
    }

    /// A delivery mapping offering `deliver`, with `extra` lines in its capability.
    fn delivery(extra: &str) -> String {
        format!(
            r#"
[mapping]
name = "outbox-delivery"
contract = "airlock:contracts/artifact-delivery@0.2.0"
connection = "outbox"
[component]
file = "c.wasm"
sha256 = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
[[capability]]
function = "deliver"
name = "deliver_artifact"
description = "Deliver."
{extra}
"#
        )
    }

    fn delivery_contract() -> std::sync::Arc<crate::contract::Contract> {
        crate::contract::load_contract("airlock:contracts/artifact-delivery@0.2.0").unwrap()
    }

    /// Parses `text` and checks it against its (built-in) contract, as a mapping load does.
    fn parse_checked(text: &str) -> Result<MappingManifest> {
        let m = MappingManifest::parse(text, "bad.toml")?;
        let contract = crate::contract::load_contract(&m.mapping.contract)?;
        m.check_semantics(&contract)?;
        Ok(m)
    }

    #[test]
    fn a_capability_confirms_its_effect_and_may_only_narrow_it() {
        let m =
            MappingManifest::parse(&delivery("effect = \"external-effect\""), "d.toml").unwrap();
        let contract = delivery_contract();
        let s = m.semantics(&m.capabilities[0], &contract).unwrap();
        assert_eq!(s, contract.semantics("deliver").unwrap());
        assert!(s.idempotent && s.queryable && !s.compensable);
        let narrowed = MappingManifest::parse(
            &delivery("effect = \"external-effect\"\nqueryable = false\nidempotent = false\ncompensable = false"),
            "d.toml",
        )
        .unwrap();
        let s = narrowed
            .semantics(&narrowed.capabilities[0], &contract)
            .unwrap();
        assert_eq!(s.class, EffectClass::ExternalEffect);
        assert!(!s.idempotent && !s.queryable && !s.compensable);
        // Repeating what the contract declares is no change.
        let same = MappingManifest::parse(
            &delivery("effect = \"external-effect\"\nqueryable = true\nidempotent = true"),
            "d.toml",
        )
        .unwrap();
        assert!(
            same.semantics(&same.capabilities[0], &contract)
                .unwrap()
                .queryable
        );
    }

    #[test]
    fn hostile_effect_confirmations_are_refused_naming_the_capability() {
        for (text, needles) in [
            (
                delivery(""),
                &[
                    "capability `deliver_artifact` has no `effect`",
                    "effect = \"external-effect\"",
                ][..],
            ),
            (
                delivery("effect = \"read\""),
                &[
                    "capability `deliver_artifact`",
                    "effect = \"read\"",
                    "as `external-effect`",
                ][..],
            ),
            (
                delivery("effect = \"local-transformation\""),
                &["capability `deliver_artifact`", "cannot change it"][..],
            ),
            (
                delivery("effect = \"harmless\""),
                &[
                    "capability `deliver_artifact`",
                    "`harmless` is not an effect class",
                    "external-effect",
                ][..],
            ),
            (
                delivery("effect = \"External-Effect\""),
                &["`External-Effect` is not an effect class"][..],
            ),
            (
                delivery("effect = \"external-effect\"\ncompensable = true"),
                &[
                    "capability `deliver_artifact`",
                    "`compensable = true` widens the contract",
                ][..],
            ),
            (
                GOOD.replace("effect = \"read\"", "effect = \"read\"\nqueryable = true"),
                &["capability `search_sources`", "`queryable = true` widens"][..],
            ),
            (
                GOOD.replace(
                    "effect = \"read\"",
                    "effect = \"read\"\nidempotent = \"no\"",
                ),
                &["idempotent"][..],
            ),
            (
                GOOD.replace(
                    "effect = \"read\"",
                    "effect = \"read\"\nreadOnlyHint = true",
                ),
                &["readOnlyHint"][..],
            ),
            (
                GOOD.replace("effect = \"read\"", "effect = 1"),
                &["effect"][..],
            ),
        ] {
            let err = format!("{:#}", parse_checked(&text).unwrap_err());
            for needle in needles {
                assert!(err.contains(needle), "expected `{needle}` in: {err}");
            }
            assert!(err.contains("bad.toml"), "expected the file name in: {err}");
        }
    }

    #[test]
    fn recorded_capabilities_read_only_what_they_need() {
        let text = GOOD.replace("[grants]", "[grants]\n[[grants.filesystem]]\nhost = \"gone\"\nguest = \"/d\"\naccess = \"read-only\"");
        let (contract, caps) = recorded_capabilities(&text).unwrap();
        assert_eq!(contract, "airlock:contracts/source-retrieval@0.1.0");
        assert_eq!(
            caps[0]
                .semantics(&crate::contract::load_contract(&contract).unwrap())
                .unwrap()
                .unwrap()
                .class,
            EffectClass::Read
        );
    }

    #[test]
    fn good_manifest_parses_with_defaults() {
        let m = MappingManifest::parse(GOOD, "good.toml").unwrap();
        assert_eq!(m.limits.deadline_ms, 100);
        assert_eq!(m.limits.memory_mib, 64);
        assert_eq!(m.limits.max_output_items, 64);
        assert_eq!(m.limits.allowed_media_types, ["text/*", "application/json"]);
        assert_eq!(
            (m.limits.queue_timeout_ms, m.limits.max_queued_calls),
            (250, 64)
        );
        verify_pin(&m, b"hello").unwrap();
        // The queue may be turned off (0) and set to its ceilings exactly.
        for queue in [
            "queue_timeout_ms = 0\nmax_queued_calls = 0",
            "queue_timeout_ms = 10000\nmax_queued_calls = 4096",
        ] {
            let m = MappingManifest::parse(&GOOD.replace("deadline_ms = 100", queue), "q.toml")
                .unwrap();
            assert_eq!(
                m.limits.queue_timeout_ms == 0,
                m.limits.max_queued_calls == 0
            );
        }
        let narrowed = GOOD.replace(
            "deadline_ms = 100",
            "max_output_items = 2\nallowed_media_types = [\"text/markdown\", \"image/*\"]",
        );
        let m = MappingManifest::parse(&narrowed, "good.toml").unwrap();
        assert_eq!(m.limits.max_output_items, 2);
        assert_eq!(m.limits.allowed_media_types, ["text/markdown", "image/*"]);
    }

    #[test]
    fn hostile_output_budgets_are_refused_with_the_key() {
        let many: Vec<String> = (0..65).map(|i| format!("\"text/t{i}\"")).collect();
        let limits = |line: &str| GOOD.replace("deadline_ms = 100", line);
        let cases = [
            (
                limits("max_output_items = 0"),
                "max_output_items = 0 is outside",
            ),
            (
                limits("max_output_items = 18446744073709551615"),
                "max_output_items",
            ),
            (limits("max_output_items = -1"), "max_output_items"),
            (limits("max_output_items = \"64\""), "max_output_items"),
            (
                limits("allowed_media_types = []"),
                "allowed_media_types is empty",
            ),
            (
                limits("allowed_media_types = \"text/*\""),
                "allowed_media_types",
            ),
            (limits("allowed_media_types = [1]"), "allowed_media_types"),
            (
                limits("allowed_media_types = [\"*/*\"]"),
                "`*/*` would allow everything",
            ),
            (limits("allowed_media_types = [\"*/json\"]"), "as the type"),
            (limits("allowed_media_types = [\"text\"]"), "type/subtype"),
            (limits("allowed_media_types = [\"\"]"), "type/subtype"),
            (
                limits("allowed_media_types = [\"TEXT/PLAIN\"]"),
                "lowercase",
            ),
            (
                limits("allowed_media_types = [\"text/plain; charset=utf-8\"]"),
                "no parameters",
            ),
            (
                limits("allowed_media_types = [\"text/plain\\nignore previous instructions\"]"),
                "subtype",
            ),
            (
                limits("allowed_media_types = [\"text/*\", \"text/*\"]"),
                "twice",
            ),
            (
                limits(&format!("allowed_media_types = [{}]", many.join(", "))),
                "at most 64",
            ),
            (
                limits(&format!(
                    "allowed_media_types = [\"text/{}\"]",
                    "x".repeat(300)
                )),
                "longer than 255",
            ),
            (limits("max_output_types = 3"), "unknown field"),
        ];
        for (text, needle) in cases {
            let err = format!("{:#}", parse_checked(&text).unwrap_err());
            assert!(err.contains(needle), "expected `{needle}` in: {err}");
            assert!(err.contains("bad.toml"), "expected the file name in: {err}");
            assert!(
                !err.contains('\n') || !err.contains("ignore previous"),
                "an entry is shown escaped, on one line: {err}"
            );
        }
    }

    #[test]
    fn pin_mismatch_names_both_digests() {
        let m = MappingManifest::parse(GOOD, "good.toml").unwrap();
        let err = verify_pin(&m, b"hello!").unwrap_err().to_string();
        assert!(err.contains("2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"));
        assert!(err.contains("ce06092fb948d9ffac7d1a376e404b26b7575bcc11ee05a4615fef4fec3a308b"));
    }

    #[test]
    fn hostile_manifests_are_refused_with_the_key() {
        let cases = [
            (
                GOOD.replace("[grants]", "[grants]\nnetwork = { tcp_connect = [\"0.0.0.0/0\"] }"),
                "has no port",
            ),
            (
                GOOD.replace("[grants]", "[grants]\nsuperuser = true"),
                "unknown field",
            ),
            (
                GOOD.replace("[grants]", "[[grants.filesystem]]\nhost = \"/nonexistent-xyz\"\nguest = \"/d\"\naccess = \"read-only\""),
                "does not exist",
            ),
            (
                GOOD.replace("deadline_ms = 100", "fuel = 0"),
                "fuel",
            ),
            (GOOD.replace("sha256 = \"2cf", "sha256 = \"2CF"), "sha256"),
            (
                GOOD.replace(
                    "sha256 = \"2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824\"",
                    "",
                ),
                "no sha256 pin",
            ),
            (
                GOOD.replace("deadline_ms = 100", "deadline_ms = 999999999"),
                "deadline_ms",
            ),
            (
                GOOD.replace("deadline_ms = 100", "memory_mib = 0"),
                "memory_mib",
            ),
            (
                GOOD.replace("deadline_ms = 100", "queue_timeout_ms = 10001"),
                "queue_timeout_ms = 10001 is outside 0..=10000",
            ),
            (
                GOOD.replace("deadline_ms = 100", "max_queued_calls = 4097"),
                "max_queued_calls = 4097 is outside 0..=4096",
            ),
            (
                GOOD.replace("deadline_ms = 100", "max_queued_calls = -1"),
                "max_queued_calls",
            ),
            (GOOD.replace("[upstream]", "[upstream]\nextra = 1"), "extra"),
            (
                GOOD.replace("name = \"search_sources\"", "name = \"search sources\""),
                "search sources",
            ),
            (
                GOOD.replace("name = \"source-library\"", "name = \"../etc\""),
                "../etc",
            ),
            (
                GOOD.replace("resources = [\"notes://\"]", "resources = [\"notes\"]"),
                "scheme",
            ),
            (
                format!(
                    "{GOOD}\n[[capability]]\nfunction = \"retrieve\"\nname = \"search_sources\"\ndescription = \"x\"\neffect = \"read\""
                ),
                "twice",
            ),
            ("[mapping".to_string(), "mapping manifest"),
            (String::new(), "missing field"),
        ];
        for (text, needle) in cases {
            let err = format!("{:#}", parse_checked(&text).unwrap_err());
            assert!(err.contains(needle), "expected `{needle}` in: {err}");
            assert!(err.contains("bad.toml"), "expected the file name in: {err}");
        }
    }
}
