//! Policy: Cedar decides which capabilities a session is offered, and whether each call
//! may run, needs a person's approval, or is denied.
//!
//! Rules this module enforces:
//! - **One language, validated.** Policies are Cedar (`cedar-policy` 4), validated in strict
//!   mode against [`SCHEMA_TEXT`] when they load. A file that does not parse or validate is
//!   refused as a whole, with its file name, line and column; a running host keeps the
//!   policy it had.
//! - **Three answers from two questions.** `allow | deny | require-approval` comes from
//!   asking Cedar `Airlock::Action::"call"` with `context.approved == false` and, when that
//!   is denied, again with `context.approved == true`: if a person's approval would permit
//!   the call, the decision is require-approval; otherwise deny. Require-approval is a
//!   context flag rather than an annotation or a second policy set because then Cedar
//!   itself (and its validator and analysis tools) reasons about it: a `forbid` still
//!   denies an approved call, and "needs approval" is ordinary Cedar a reviewer can read.
//!   At execution a call holding a receipt is decided again with `approved == true`.
//! - **Versioned.** Each loaded policy has a digest: sha256 of the RFC 8785 JSON list of
//!   its files' sha256 digests, in order. Decisions, approvals and the trace carry it.
//! - **Bounded denials.** A denial carries a category — `capability unavailable for this
//!   task` (nothing permits it, or a `forbid` without a category) or `outside approved
//!   scope` (a `forbid` annotated `@category("outside-scope")`) — never the policies,
//!   roles, capabilities or destinations behind it.
//! - **Errors deny.** A policy whose evaluation errors is skipped (Cedar semantics); the
//!   errors are logged, and a decision with nothing permitting it is a denial.
//!
//! Accepted forms: Cedar policy files listed by `policy = [...]` in the serve
//! configuration (none: [`DEFAULT_POLICY`]). Annotations: `@id("name")` names a policy
//! (unique across files; default `<file>#<n>`); `@category("outside-scope")` or
//! `@category("capability-unavailable")` on a `forbid` picks the denial category. Any other
//! `@category` value is refused at load.
//!
//! Crates: this one uses no other Airlock crate; the registry, the pipeline and the CLI
//! use it (as `airlock::policy`).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::str::FromStr as _;
use std::sync::{Arc, OnceLock};

use anyhow::{Context as _, Result, bail};
use arc_swap::ArcSwap;
use cedar_policy::{
    Authorizer, Context, Decision as CedarDecision, Entities, Entity, EntityId, EntityTypeName,
    EntityUid, PolicyId, PolicySet, Request, RestrictedExpression, Schema, ValidationMode,
    Validator,
};
use miette::Diagnostic;
use serde::Serialize;
use sha2::Digest as _;

/// The Cedar schema policies are validated against (`airlock policy schema` prints it).
pub const SCHEMA_TEXT: &str = include_str!("airlock.cedarschema");

/// The built-in policy, used when the configuration names no policy files: every profile
/// may be used; reads and local transformations run; anything with an effect needs a
/// person's approval of that exact call.
pub const DEFAULT_POLICY: &str = include_str!("default.cedar");

/// Label of the built-in policy in decisions and the trace.
pub const BUILTIN_LABEL: &str = "builtin";

/// The parsed schema (parsed once; it ships in this binary).
///
/// # Panics
/// The shipped schema does not parse (a build defect; a unit test guards it).
pub fn schema() -> &'static Schema {
    static SCHEMA: OnceLock<Schema> = OnceLock::new();
    SCHEMA.get_or_init(|| {
        Schema::from_cedarschema_str(SCHEMA_TEXT)
            .map(|(schema, _warnings)| schema)
            .expect("the shipped Cedar schema parses")
    })
}

/// An entity uid `Airlock::<kind>::"<id>"`.
/// The entity types of the schema's `Airlock` namespace, parsed once (parsing a type name
/// on every decision showed in the profile).
const ENTITY_TYPES: [&str; 9] = [
    "Action",
    "Requester",
    "Role",
    "Profile",
    "Capability",
    "Mapping",
    "Connection",
    "DataClass",
    "Scope",
];

fn type_name(kind: &str) -> EntityTypeName {
    static PARSED: std::sync::LazyLock<Vec<EntityTypeName>> = std::sync::LazyLock::new(|| {
        ENTITY_TYPES
            .iter()
            .map(|k| {
                EntityTypeName::from_str(&format!("Airlock::{k}"))
                    .expect("Airlock entity type names are valid")
            })
            .collect()
    });
    match ENTITY_TYPES.iter().position(|k| *k == kind) {
        Some(i) => PARSED[i].clone(),
        None => EntityTypeName::from_str(&format!("Airlock::{kind}"))
            .expect("Airlock entity type names are valid"),
    }
}

fn uid(kind: &str, id: &str) -> EntityUid {
    EntityUid::from_type_name_and_id(type_name(kind), EntityId::new(id))
}

fn action(name: &str) -> EntityUid {
    uid("Action", name)
}

fn string(s: &str) -> RestrictedExpression {
    RestrictedExpression::new_string(s.to_string())
}

/// One policy file as loaded.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyFile {
    /// The file's path as configured, or [`BUILTIN_LABEL`].
    pub label: String,
    /// sha256 (hex) of the file's bytes.
    pub sha256: String,
    /// Number of policies in it.
    pub policies: usize,
}

/// A validated, versioned set of policies.
pub struct Policy {
    set: PolicySet,
    digest: Arc<str>,
    /// Unique to this load in this process: the decision cache's key names the policy by
    /// it, not by the digest (which covers the files' bytes, not their labels, and so
    /// not the default policy ids a decision's `determining` lists).
    serial: u64,
    files: Vec<PolicyFile>,
    /// Which file each policy came from (index into `files`).
    origin: HashMap<PolicyId, usize>,
}

impl std::fmt::Debug for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Policy")
            .field("digest", &self.digest)
            .field("files", &self.files)
            .finish()
    }
}

impl Policy {
    /// The built-in policy ([`DEFAULT_POLICY`]).
    ///
    /// # Panics
    /// The built-in policy does not validate (a build defect; a unit test guards it).
    pub fn builtin() -> Self {
        Self::from_texts(&[(BUILTIN_LABEL.to_string(), DEFAULT_POLICY.to_string())])
            .expect("the built-in policy validates")
    }

    /// Loads the policy files `paths` in order; no files means [`Policy::builtin`].
    ///
    /// # Errors
    /// A file cannot be read, does not parse, does not validate against the schema, reuses
    /// a policy id, or uses an unknown `@category`; the message names the file and line.
    pub fn load(paths: &[PathBuf]) -> Result<Self> {
        if paths.is_empty() {
            return Ok(Self::builtin());
        }
        let mut texts = Vec::new();
        for path in paths {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading policy file {}", path.display()))?;
            texts.push((path.display().to_string(), text));
        }
        Self::from_texts(&texts)
    }

    /// Parses and validates `(label, text)` policy files in order. Each file must be at most
    /// [`MAX_POLICY_BYTES`] and nest brackets at most [`MAX_NESTING`] deep (Cedar's parser
    /// recurses per level); parsing runs on a thread with a large stack of its own.
    ///
    /// # Errors
    /// As [`Policy::load`].
    pub fn from_texts(texts: &[(String, String)]) -> Result<Self> {
        for (label, text) in texts {
            if text.len() > MAX_POLICY_BYTES {
                bail!(
                    "policy file {label} is {} bytes, more than the {MAX_POLICY_BYTES} accepted",
                    text.len()
                );
            }
            if let Some((line, depth)) = too_deep(text) {
                bail!(
                    "policy file {label}:{line}: brackets nest {depth} deep; at most {MAX_NESTING} are accepted"
                );
            }
        }
        let texts = texts.to_vec();
        std::thread::Builder::new()
            .name("airlock-policy".into())
            .stack_size(PARSER_STACK)
            .spawn(move || Self::parse_and_validate(&texts))
            .context("starting the policy parser thread")?
            .join()
            .map_err(|_| anyhow::anyhow!("the policy parser failed"))?
    }

    fn parse_and_validate(texts: &[(String, String)]) -> Result<Self> {
        let mut set = PolicySet::new();
        let mut files = Vec::new();
        let mut origin = HashMap::new();
        let mut sources: HashMap<PolicyId, (usize, &str)> = HashMap::new();
        for (index, (label, text)) in texts.iter().enumerate() {
            let parsed = PolicySet::from_str(text).map_err(|errors| {
                let mut lines = Vec::new();
                for e in errors.iter() {
                    lines.push(located(label, text, e));
                }
                anyhow::anyhow!(
                    "policy file {label} does not parse:\n  {}",
                    lines.join("\n  ")
                )
            })?;
            if parsed.templates().next().is_some() {
                bail!(
                    "policy file {label}: templates (policies with ?principal or ?resource slots) are not supported"
                );
            }
            let mut count = 0;
            for (n, policy) in parsed.policies().enumerate() {
                let id = match policy.annotation("id") {
                    Some(id) => id.to_string(),
                    None => format!("{}#{}", short_label(label), n + 1),
                };
                if let Some(category) = policy.annotation("category")
                    && DenyCategory::from_annotation(category).is_none()
                {
                    bail!(
                        "policy file {label}: policy `{id}` has @category({category:?}); accepted: \"outside-scope\", \"capability-unavailable\""
                    );
                }
                let id = PolicyId::new(id);
                let policy = policy.new_id(id.clone());
                set.add(policy).map_err(|e| {
                    anyhow::anyhow!("policy file {label}: policy id `{id}` is used twice ({e})")
                })?;
                origin.insert(id.clone(), index);
                sources.insert(id, (index, text.as_str()));
                count += 1;
            }
            files.push(PolicyFile {
                label: label.clone(),
                sha256: hex::encode(sha2::Sha256::digest(text.as_bytes())),
                policies: count,
            });
        }
        let validation = Validator::new(schema().clone()).validate(&set, ValidationMode::Strict);
        if !validation.validation_passed() {
            let mut lines = Vec::new();
            for e in validation.validation_errors() {
                let (label, text) = sources
                    .get(e.policy_id())
                    .map(|(i, text)| (texts[*i].0.as_str(), *text))
                    .unwrap_or(("?", ""));
                lines.push(format!(
                    "{} (policy `{}`)",
                    located(label, text, e),
                    e.policy_id()
                ));
            }
            bail!(
                "the policy does not validate against Airlock's Cedar schema (`airlock policy schema` prints it):\n  {}",
                lines.join("\n  ")
            );
        }
        let digests: Vec<&str> = files.iter().map(|f| f.sha256.as_str()).collect();
        let canonical = serde_json_canonicalizer::to_string(&digests)
            .context("canonicalizing the policy digest")?;
        let digest = hex::encode(sha2::Sha256::digest(canonical.as_bytes()));
        static SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Ok(Self {
            set,
            digest: Arc::from(digest),
            serial: SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            files,
            origin,
        })
    }

    /// The policy digest (64 hex digits).
    pub fn digest(&self) -> &Arc<str> {
        &self.digest
    }

    /// The files this policy was loaded from, in order.
    pub fn files(&self) -> &[PolicyFile] {
        &self.files
    }

    /// Where policy `id` came from: its file's label.
    pub fn origin(&self, id: &str) -> Option<&str> {
        self.origin
            .get(&PolicyId::new(id))
            .map(|i| self.files[*i].label.as_str())
    }
}

/// Largest policy file accepted, in bytes.
pub const MAX_POLICY_BYTES: usize = 1 << 20;

/// Deepest bracket nesting (`(`, `[`, `{`) accepted in a policy file.
pub const MAX_NESTING: usize = 64;

/// Stack of the thread that parses and validates policies.
const PARSER_STACK: usize = 64 << 20;

/// The first line where brackets nest deeper than [`MAX_NESTING`] (outside strings and
/// comments), and how deep.
fn too_deep(text: &str) -> Option<(usize, usize)> {
    let (mut depth, mut line) = (0usize, 1usize);
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\n' => line += 1,
            '"' => {
                while let Some(c) = chars.next() {
                    match c {
                        '\\' => {
                            chars.next();
                        }
                        '"' => break,
                        '\n' => line += 1,
                        _ => {}
                    }
                }
            }
            '/' if chars.peek() == Some(&'/') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        line += 1;
                        break;
                    }
                }
            }
            '(' | '[' | '{' => {
                depth += 1;
                if depth > MAX_NESTING {
                    return Some((line, depth));
                }
            }
            ')' | ']' | '}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    None
}

/// `file:line:column: message`, from a Cedar diagnostic's first label.
fn located(label: &str, text: &str, diagnostic: &dyn Diagnostic) -> String {
    let message = diagnostic.to_string();
    let help = diagnostic
        .help()
        .map(|h| format!(" (help: {h})"))
        .unwrap_or_default();
    let at = diagnostic
        .labels()
        .and_then(|mut labels| labels.next())
        .map(|l| l.offset())
        .filter(|offset| *offset <= text.len());
    match at {
        Some(offset) => {
            let before = &text[..offset];
            let line = before.matches('\n').count() + 1;
            let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
            format!("{label}:{line}:{column}: {message}{help}")
        }
        None => format!("{label}: {message}{help}"),
    }
}

fn short_label(label: &str) -> &str {
    Path::new(label)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or(label)
}

/// Why a call is denied, as the model may learn it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DenyCategory {
    /// Nothing permits it in this session (or a `forbid` without a category).
    CapabilityUnavailable,
    /// A `forbid` annotated `@category("outside-scope")`.
    OutsideScope,
}

impl DenyCategory {
    fn from_annotation(value: &str) -> Option<Self> {
        match value {
            "outside-scope" => Some(Self::OutsideScope),
            "capability-unavailable" => Some(Self::CapabilityUnavailable),
            _ => None,
        }
    }

    /// The bounded text the model sees.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::CapabilityUnavailable => "capability unavailable for this task",
            Self::OutsideScope => "outside approved scope",
        }
    }
}

/// The answer for one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "verdict", content = "category", rename_all = "kebab-case")]
pub enum Verdict {
    /// Run it.
    Allow,
    /// Run it once a person approved this exact call.
    RequireApproval,
    /// Do not run it.
    Deny(DenyCategory),
}

/// A decision and what it rests on.
#[derive(Debug, Clone, Serialize)]
pub struct Decision {
    /// The answer.
    #[serde(flatten)]
    pub verdict: Verdict,
    /// Digest of the policy that decided.
    pub policy_digest: Arc<str>,
    /// Ids of the policies that determined the answer (permits for allow and
    /// require-approval, forbids for a deny they caused; empty for a default deny). For
    /// operators and the trace, never for the model.
    pub determining: Vec<String>,
    /// Evaluation errors (policies skipped), for the log and the trace.
    pub errors: Vec<String>,
}

impl Decision {
    /// The deny given when the entities of a request cannot be built (fail closed).
    fn unbuildable(policy_digest: &Arc<str>, why: &dyn std::fmt::Display) -> Self {
        Self {
            verdict: Verdict::Deny(DenyCategory::CapabilityUnavailable),
            policy_digest: policy_digest.clone(),
            determining: Vec::new(),
            errors: vec![format!("entities: {why}")],
        }
    }
}

/// The requester as Cedar sees it: `Airlock::Requester::"<name>"` with its roles.
#[derive(Clone)]
pub struct Principal {
    /// The requester's name.
    name: Arc<str>,
    uid: EntityUid,
    entities: Arc<Vec<Entity>>,
    /// Identifies this principal (name, roles, transport) in the entity cache.
    key: Arc<str>,
}

impl Principal {
    /// The requester's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The requester `name` with `roles`, reached over `transport` (`stdio`).
    ///
    /// # Errors
    /// An attribute does not evaluate (cannot happen for strings; kept for Cedar's API).
    pub fn new(name: &str, roles: &[String], transport: &str) -> Result<Self> {
        let uid = uid("Requester", name);
        let parents: HashSet<EntityUid> = roles.iter().map(|r| self::uid("Role", r)).collect();
        let mut entities = vec![
            Entity::new(
                uid.clone(),
                HashMap::from([("transport".to_string(), string(transport))]),
                parents.clone(),
            )
            .context("building the requester entity")?,
        ];
        for role in parents {
            entities.push(Entity::new_no_attrs(role, HashSet::new()));
        }
        Ok(Self {
            name: Arc::from(name),
            uid,
            entities: Arc::new(entities),
            key: {
                let mut key = String::new();
                push_fields(&mut key, &[name, transport, &roles.len().to_string()]);
                let roles: Vec<&str> = roles.iter().map(String::as_str).collect();
                push_fields(&mut key, &roles);
                Arc::from(key)
            },
        })
    }
}

/// Most entity sets kept (by principal and capability facts: building them and their
/// transitive closure is most of an evaluation's cost, and they change only with the
/// mapping's revision or state).
const ENTITY_CACHE: usize = 4096;

/// Most decisions kept (see [`PolicyEngine`]).
const DECISION_CACHE: usize = 4096;

/// Appends each of `fields` to `key` as its byte length, `:` and its text, so two
/// different lists of fields never give the same key (a name may hold any character).
fn push_fields(key: &mut String, fields: &[&str]) {
    use std::fmt::Write as _;
    for field in fields {
        let _ = write!(key, "{}:{field}", field.len());
    }
}

/// What policy knows about a capability at decision time.
#[derive(Debug, Clone)]
pub struct CapabilityFacts<'a> {
    /// Local (model-facing) name.
    pub name: &'a str,
    /// Contract interface, e.g. `airlock:contracts/artifact-delivery@0.2.0`.
    pub contract: &'a str,
    /// Contract function, e.g. `deliver`.
    pub function: &'a str,
    /// Effect class (`read`, `local-transformation`, `reversible-mutation`,
    /// `external-effect`).
    pub effect_class: &'a str,
    /// Whether repeating the call is harmless.
    pub idempotent: bool,
    /// Whether the contract can be asked afterwards what happened.
    pub queryable: bool,
    /// Whether the contract has a compensating action.
    pub compensable: bool,
    /// The serving mapping's name, revision and lifecycle state.
    pub mapping: &'a str,
    pub mapping_revision: i64,
    pub mapping_state: &'a str,
    /// The mapping's connection (configured name).
    pub connection: &'a str,
    /// The mapping's declared data class.
    pub data_class: &'a str,
}

/// What policy knows about one call besides the capability.
#[derive(Debug, Clone, Default)]
pub struct CallFacts<'a> {
    /// The session's profile.
    pub profile: &'a str,
    /// The transport (`stdio`).
    pub transport: &'a str,
    /// The negotiated protocol version.
    pub protocol: &'a str,
    /// The destination a handle argument resolved to (its locator), if any.
    pub destination: Option<&'a str>,
    /// The size of a prepared artifact an argument names, if any.
    pub artifact_bytes: Option<u64>,
}

/// What a person acts on in the console ([`PolicyEngine::may_act`]): each variant is one
/// Cedar action on one resource of the schema.
#[derive(Debug, Clone, Copy)]
pub enum ConsoleSubject<'a> {
    /// `approve` on `Approval::"id"`; `decision` is `approve`, `deny` or `revoke`.
    Approval {
        id: &'a str,
        /// The requester of the call waiting for the approval.
        requester: &'a str,
        capability: &'a str,
        mapping: &'a str,
        profile: &'a str,
        decision: &'a str,
    },
    /// `resolve-intent` on `Intent::"id"`; `outcome` is `completed` or `failed`.
    Intent {
        id: &'a str,
        requester: &'a str,
        capability: &'a str,
        mapping: &'a str,
        effect_class: &'a str,
        outcome: &'a str,
    },
    /// `view` on `Console::"console"`: reading the console's pages.
    Console,
    /// `review` (approve the revision to serve) or, with `retire`, `retire` on
    /// `Mapping::"name"` at `revision`.
    Mapping {
        name: &'a str,
        contract: &'a str,
        revision: i64,
        state: &'a str,
        retire: bool,
    },
}

/// Decides with the current policy; the policy can be replaced while the host runs.
///
/// Rule: a decision is a function of what Cedar is given — the policy, the principal, the
/// action, the capability's facts (its entities) and the call's facts (its context) —
/// because Cedar's evaluation reads nothing else (no clock, no randomness, no I/O). So
/// decisions are kept by all of those (at most `DECISION_CACHE`, least recently used
/// first out) and an equal question is answered without asking Cedar again. The policy
/// is named by its load (`Policy::serial`), so a replaced policy, a new mapping revision
/// or state, another destination or artifact size is a new question; evaluation errors
/// are logged again on every answer that carries them.
pub struct PolicyEngine {
    authorizer: Authorizer,
    current: ArcSwap<Policy>,
    entities: std::sync::Mutex<lru::LruCache<String, Arc<Entities>>>,
    decisions: std::sync::Mutex<lru::LruCache<String, Decision>>,
    /// Questions put to Cedar (each decision asks one or two).
    evaluations: std::sync::atomic::AtomicU64,
}

impl PolicyEngine {
    /// An engine deciding with `policy`.
    pub fn new(policy: Policy) -> Self {
        let size = |n| std::num::NonZeroUsize::new(n).expect("non-zero");
        Self {
            authorizer: Authorizer::new(),
            current: ArcSwap::from_pointee(policy),
            entities: std::sync::Mutex::new(lru::LruCache::new(size(ENTITY_CACHE))),
            decisions: std::sync::Mutex::new(lru::LruCache::new(size(DECISION_CACHE))),
            evaluations: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// How many questions this engine has put to Cedar so far (a decision not found among
    /// the kept ones asks one, or two for require-approval and deny).
    pub fn evaluations(&self) -> u64 {
        self.evaluations.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The kept decision for `key`, its evaluation errors logged again.
    fn kept(&self, key: &str) -> Option<Decision> {
        let mut kept = self.decisions.lock().unwrap_or_else(|e| e.into_inner());
        let decision = kept.get(key)?.clone();
        drop(kept);
        for e in &decision.errors {
            tracing::warn!("policy evaluation error (the policy was skipped): {e}");
        }
        Some(decision)
    }

    fn keep(&self, key: String, decision: &Decision) {
        let mut kept = self.decisions.lock().unwrap_or_else(|e| e.into_inner());
        kept.put(key, decision.clone());
    }

    /// The current policy.
    pub fn current(&self) -> Arc<Policy> {
        self.current.load_full()
    }

    /// Replaces the policy: the next decision uses `policy`.
    pub fn replace(&self, policy: Policy) {
        self.current.store(Arc::new(policy));
        // Kept decisions name the old policy's serial and cannot be asked for again.
        self.decisions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// May `principal` use `profile`?
    pub fn may_use_profile(&self, principal: &Principal, profile: &str) -> Decision {
        let policy = self.current();
        let mut key = format!("{}/use-profile/", policy.serial);
        push_fields(&mut key, &[&principal.key, profile]);
        if let Some(decision) = self.kept(&key) {
            return decision;
        }
        let decision = self.ask_use_profile(&policy, principal, profile);
        self.keep(key, &decision);
        decision
    }

    fn ask_use_profile(&self, policy: &Policy, principal: &Principal, profile: &str) -> Decision {
        let resource = uid("Profile", profile);
        let entities = match Entities::from_entities(principal.entities.as_ref().clone(), None) {
            Ok(e) => e,
            Err(e) => return Decision::unbuildable(&policy.digest, &e),
        };
        let (allowed, determining, errors) = self.ask(
            policy,
            principal,
            action("use-profile"),
            resource,
            Context::empty(),
            &entities,
        );
        Decision {
            verdict: if allowed {
                Verdict::Allow
            } else {
                Verdict::Deny(DenyCategory::CapabilityUnavailable)
            },
            policy_digest: policy.digest.clone(),
            determining,
            errors,
        }
    }

    /// Decides one call of `capability` with the current policy (see the module rules).
    pub fn decide_call(
        &self,
        principal: &Principal,
        capability: &CapabilityFacts<'_>,
        call: &CallFacts<'_>,
    ) -> Decision {
        self.decide_call_with(&self.current(), principal, capability, call, false)
    }

    /// Decides one call with `policy`. With `approved`, asks only the approved question
    /// (a call that holds a receipt): allow or deny.
    pub fn decide_call_with(
        &self,
        policy: &Policy,
        principal: &Principal,
        capability: &CapabilityFacts<'_>,
        call: &CallFacts<'_>,
        approved: bool,
    ) -> Decision {
        let facts = capability_key(principal, capability);
        let mut key = format!("{}/call/{}/", policy.serial, u8::from(approved));
        key.push_str(&facts);
        let bytes = call.artifact_bytes.map(|b| b.to_string());
        push_fields(
            &mut key,
            &[
                call.profile,
                call.transport,
                call.protocol,
                if call.destination.is_some() { "1" } else { "0" },
                call.destination.unwrap_or(""),
                bytes.as_deref().unwrap_or("-"),
            ],
        );
        if let Some(decision) = self.kept(&key) {
            return decision;
        }
        let decision = self.ask_call(policy, principal, capability, facts, call, approved);
        self.keep(key, &decision);
        decision
    }

    /// May `person` (a Requester with transport `console`) take the console action
    /// `subject` names? Asks Cedar once (`approve`, `resolve-intent`, `review` or
    /// `retire`; see the schema); not kept, as a person acts seldom. Allow or deny (the
    /// deny's category is never shown to a model: the console names the policies).
    pub fn may_act(&self, person: &Principal, subject: &ConsoleSubject<'_>) -> Decision {
        let policy = self.current();
        let requester = |name: &str| RestrictedExpression::new_entity_uid(uid("Requester", name));
        // The action, the resource and its attributes (`None`: the resource needs no
        // entity), and the context.
        let (act, resource, attrs, context) = match *subject {
            ConsoleSubject::Approval {
                id,
                requester: who,
                capability,
                mapping,
                profile,
                decision,
            } => (
                "approve",
                uid("Approval", id),
                Some(vec![
                    ("requester", requester(who)),
                    ("capability", string(capability)),
                    ("mapping", string(mapping)),
                    (
                        "profile",
                        RestrictedExpression::new_entity_uid(uid("Profile", profile)),
                    ),
                ]),
                vec![("decision", decision)],
            ),
            ConsoleSubject::Intent {
                id,
                requester: who,
                capability,
                mapping,
                effect_class,
                outcome,
            } => (
                "resolve-intent",
                uid("Intent", id),
                Some(vec![
                    ("requester", requester(who)),
                    ("capability", string(capability)),
                    ("mapping", string(mapping)),
                    ("effect_class", string(effect_class)),
                ]),
                vec![("outcome", outcome)],
            ),
            ConsoleSubject::Console => ("view", uid("Console", "console"), None, vec![]),
            ConsoleSubject::Mapping {
                name,
                contract,
                revision,
                state,
                retire,
            } => (
                if retire { "retire" } else { "review" },
                uid("Mapping", name),
                Some(vec![
                    ("contract", string(contract)),
                    ("revision", RestrictedExpression::new_long(revision)),
                    ("state", string(state)),
                ]),
                vec![],
            ),
        };
        let mut entities: Vec<Entity> = person.entities.as_ref().clone();
        if let Some(attrs) = attrs {
            let attrs = attrs.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
            match Entity::new(resource.clone(), attrs, HashSet::new()) {
                Ok(e) => entities.push(e),
                Err(e) => return Decision::unbuildable(&policy.digest, &e),
            }
        }
        let context =
            match Context::from_pairs(context.into_iter().map(|(k, v)| (k.to_string(), string(v))))
            {
                Ok(c) => c,
                Err(e) => return Decision::unbuildable(&policy.digest, &e),
            };
        let entities = match Entities::from_entities(entities, None) {
            Ok(e) => e,
            Err(e) => return Decision::unbuildable(&policy.digest, &e),
        };
        let (allowed, determining, errors) =
            self.ask(&policy, person, action(act), resource, context, &entities);
        Decision {
            verdict: if allowed {
                Verdict::Allow
            } else {
                Verdict::Deny(deny_category(&policy, &determining))
            },
            policy_digest: policy.digest.clone(),
            determining,
            errors,
        }
    }

    fn ask_call(
        &self,
        policy: &Policy,
        principal: &Principal,
        capability: &CapabilityFacts<'_>,
        facts: String,
        call: &CallFacts<'_>,
        approved: bool,
    ) -> Decision {
        let resource = uid("Capability", capability.name);
        let entities = match self.entities_for(principal, capability, facts) {
            Ok(e) => e,
            Err(e) => return Decision::unbuildable(&policy.digest, &e),
        };
        let ask = |approved: bool| {
            self.ask(
                policy,
                principal,
                action("call"),
                resource.clone(),
                call_context(call, approved),
                &entities,
            )
        };
        let (allowed, determining, mut errors) = ask(approved);
        let verdict = if allowed {
            Verdict::Allow
        } else if approved {
            Verdict::Deny(deny_category(policy, &determining))
        } else {
            let (with_approval, approving, more) = ask(true);
            errors.extend(more);
            if with_approval {
                return Decision {
                    verdict: Verdict::RequireApproval,
                    policy_digest: policy.digest.clone(),
                    determining: approving,
                    errors,
                };
            }
            Verdict::Deny(deny_category(policy, &approving))
        };
        Decision {
            verdict,
            policy_digest: policy.digest.clone(),
            determining,
            errors,
        }
    }

    /// The entity set for `principal` and `capability`, kept by `key`
    /// ([`capability_key`]).
    fn entities_for(
        &self,
        principal: &Principal,
        capability: &CapabilityFacts<'_>,
        key: String,
    ) -> Result<Arc<Entities>> {
        let mut cache = self.entities.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = cache.get(&key) {
            return Ok(e.clone());
        }
        let built = Arc::new(
            Entities::from_entities(capability_entities(principal, capability), None)
                .map_err(|e| anyhow::anyhow!("{e}"))?,
        );
        cache.put(key, built.clone());
        Ok(built)
    }

    fn ask(
        &self,
        policy: &Policy,
        principal: &Principal,
        action: EntityUid,
        resource: EntityUid,
        context: Context,
        entities: &Entities,
    ) -> (bool, Vec<String>, Vec<String>) {
        let request = match Request::new(principal.uid.clone(), action, resource, context, None) {
            Ok(r) => r,
            Err(e) => return (false, Vec::new(), vec![format!("request: {e}")]),
        };
        self.evaluations
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let response = self
            .authorizer
            .is_authorized(&request, &policy.set, entities);
        let determining = response
            .diagnostics()
            .reason()
            .map(|id| id.to_string())
            .collect();
        let errors: Vec<String> = response
            .diagnostics()
            .errors()
            .map(|e| e.to_string())
            .collect();
        for e in &errors {
            tracing::warn!("policy evaluation error (the policy was skipped): {e}");
        }
        (
            response.decision() == CedarDecision::Allow,
            determining,
            errors,
        )
    }
}

/// Everything the entities of a decision are built from: the principal (name, roles,
/// transport) and every capability fact, each field length-prefixed ([`push_fields`]).
fn capability_key(principal: &Principal, c: &CapabilityFacts<'_>) -> String {
    let mut key = String::with_capacity(256);
    key.push_str(&principal.key);
    let revision = c.mapping_revision.to_string();
    let flags = format!(
        "{}{}{}",
        u8::from(c.idempotent),
        u8::from(c.queryable),
        u8::from(c.compensable)
    );
    push_fields(
        &mut key,
        &[
            c.name,
            c.mapping,
            c.contract,
            c.function,
            c.effect_class,
            &flags,
            c.connection,
            c.data_class,
            &revision,
            c.mapping_state,
        ],
    );
    key
}

/// The category of a denial: the first determining forbid's `@category`, else
/// capability-unavailable.
fn deny_category(policy: &Policy, determining: &[String]) -> DenyCategory {
    determining
        .iter()
        .filter_map(|id| policy.set.annotation(&PolicyId::new(id), "category"))
        .find_map(DenyCategory::from_annotation)
        .unwrap_or(DenyCategory::CapabilityUnavailable)
}

/// The requester, its roles, and the capability with its mapping, connection and data
/// class. Profiles and scopes carry no attributes or parents, so they need no entity: they
/// appear only in the context and compare by identity.
fn capability_entities(principal: &Principal, c: &CapabilityFacts<'_>) -> Vec<Entity> {
    let mapping = uid("Mapping", c.mapping);
    let connection = uid("Connection", c.connection);
    let data_class = uid("DataClass", c.data_class);
    let mut entities: Vec<Entity> = principal.entities.as_ref().clone();
    let capability = Entity::new(
        uid("Capability", c.name),
        HashMap::from([
            ("effect_class".to_string(), string(c.effect_class)),
            (
                "idempotent".to_string(),
                RestrictedExpression::new_bool(c.idempotent),
            ),
            (
                "queryable".to_string(),
                RestrictedExpression::new_bool(c.queryable),
            ),
            (
                "compensable".to_string(),
                RestrictedExpression::new_bool(c.compensable),
            ),
            ("contract".to_string(), string(c.contract)),
            ("function".to_string(), string(c.function)),
            (
                "mapping".to_string(),
                RestrictedExpression::new_entity_uid(mapping.clone()),
            ),
            (
                "connection".to_string(),
                RestrictedExpression::new_entity_uid(connection.clone()),
            ),
            (
                "data_class".to_string(),
                RestrictedExpression::new_entity_uid(data_class.clone()),
            ),
        ]),
        HashSet::from([mapping.clone(), connection.clone()]),
    );
    let mapping_entity = Entity::new(
        mapping,
        HashMap::from([
            ("contract".to_string(), string(c.contract)),
            (
                "revision".to_string(),
                RestrictedExpression::new_long(c.mapping_revision),
            ),
            ("state".to_string(), string(c.mapping_state)),
        ]),
        HashSet::new(),
    );
    for e in [capability, mapping_entity].into_iter().flatten() {
        entities.push(e);
    }
    entities.push(Entity::new_no_attrs(connection, HashSet::new()));
    entities.push(Entity::new_no_attrs(data_class, HashSet::new()));
    entities
}

fn call_context(call: &CallFacts<'_>, approved: bool) -> Context {
    let mut pairs = vec![
        (
            "profile".to_string(),
            RestrictedExpression::new_entity_uid(uid("Profile", call.profile)),
        ),
        (
            "approved".to_string(),
            RestrictedExpression::new_bool(approved),
        ),
        ("transport".to_string(), string(call.transport)),
        ("protocol".to_string(), string(call.protocol)),
    ];
    if let Some(d) = call.destination {
        pairs.push((
            "destination".to_string(),
            RestrictedExpression::new_entity_uid(uid("Scope", d)),
        ));
    }
    if let Some(bytes) = call.artifact_bytes {
        pairs.push((
            "artifact_bytes".to_string(),
            RestrictedExpression::new_long(i64::try_from(bytes).unwrap_or(i64::MAX)),
        ));
    }
    Context::from_pairs(pairs).unwrap_or_else(|_| Context::empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn principal() -> Principal {
        Principal::new("alice", &["operator".to_string()], "stdio").unwrap()
    }

    fn capability<'a>(effect: &'a str, name: &'a str) -> CapabilityFacts<'a> {
        CapabilityFacts {
            name,
            contract: "airlock:contracts/artifact-delivery@0.2.0",
            function: "deliver",
            effect_class: effect,
            idempotent: true,
            queryable: true,
            compensable: false,
            mapping: "outbox-delivery",
            mapping_revision: 2,
            mapping_state: "active",
            connection: "outbox",
            data_class: "internal",
        }
    }

    fn call<'a>(profile: &'a str, destination: Option<&'a str>) -> CallFacts<'a> {
        CallFacts {
            profile,
            transport: "stdio",
            protocol: "2025-11-25",
            destination,
            artifact_bytes: Some(12_288),
        }
    }

    #[test]
    fn console_actions_follow_roles_and_nobody_approves_their_own_call() {
        let engine = PolicyEngine::new(Policy::builtin());
        let approval = |requester, decision| ConsoleSubject::Approval {
            id: "apr_1",
            requester,
            capability: "deliver_artifact",
            mapping: "outbox-delivery",
            profile: "publisher",
            decision,
        };
        let person = |name, roles: &[&str]| {
            let roles: Vec<String> = roles.iter().map(|r| r.to_string()).collect();
            Principal::new(name, &roles, "console").unwrap()
        };
        let carol = person("carol", &["approver"]);
        let verdict = |p: &Principal, s| engine.may_act(p, &s).verdict;
        assert_eq!(
            verdict(&carol, approval("alice", "approve")),
            Verdict::Allow
        );
        assert_eq!(verdict(&carol, approval("alice", "deny")), Verdict::Allow);
        // Separation of duties: carol asked for this call, so she may not approve it (she
        // may still deny it).
        let own = engine.may_act(&carol, &approval("carol", "approve"));
        assert!(matches!(own.verdict, Verdict::Deny(_)));
        assert_eq!(own.determining, ["builtin-no-self-approval"]);
        assert_eq!(verdict(&carol, approval("carol", "deny")), Verdict::Allow);
        // Without the role, nothing.
        let dave = person("dave", &["operator"]);
        assert!(matches!(
            verdict(&dave, approval("alice", "approve")),
            Verdict::Deny(_)
        ));
        let intent = ConsoleSubject::Intent {
            id: "int_1",
            requester: "alice",
            capability: "deliver_artifact",
            mapping: "outbox-delivery",
            effect_class: "external-effect",
            outcome: "completed",
        };
        assert_eq!(verdict(&carol, intent), Verdict::Allow);
        assert!(matches!(verdict(&dave, intent), Verdict::Deny(_)));
        let mapping = |retire| ConsoleSubject::Mapping {
            name: "outbox-delivery",
            contract: "airlock:contracts/artifact-delivery@0.2.0",
            revision: 3,
            state: "pending-review",
            retire,
        };
        let rita = person("rita", &["reviewer"]);
        assert_eq!(verdict(&rita, mapping(false)), Verdict::Allow);
        assert_eq!(verdict(&rita, mapping(true)), Verdict::Allow);
        assert!(matches!(verdict(&carol, mapping(false)), Verdict::Deny(_)));
        assert!(matches!(
            verdict(&rita, approval("alice", "approve")),
            Verdict::Deny(_)
        ));
        // Both roles may view the console; a token without either may not.
        assert_eq!(verdict(&carol, ConsoleSubject::Console), Verdict::Allow);
        assert_eq!(verdict(&rita, ConsoleSubject::Console), Verdict::Allow);
        assert!(matches!(
            verdict(&dave, ConsoleSubject::Console),
            Verdict::Deny(_)
        ));
        // Nobody settles the outcome of an effect they asked for.
        let own_intent = ConsoleSubject::Intent {
            id: "int_2",
            requester: "carol",
            capability: "deliver_artifact",
            mapping: "outbox-delivery",
            effect_class: "external-effect",
            outcome: "failed",
        };
        let d = engine.may_act(&carol, &own_intent);
        assert!(matches!(d.verdict, Verdict::Deny(_)));
        assert_eq!(d.determining, ["builtin-no-self-resolution"]);
    }

    #[test]
    fn the_shipped_schema_and_builtin_policy_validate() {
        let _ = schema();
        let p = Policy::builtin();
        assert_eq!(p.digest().len(), 64);
        assert_eq!(p.files()[0].label, BUILTIN_LABEL);
        assert_eq!(p.files()[0].policies, 7);
    }

    #[test]
    fn builtin_reads_run_and_effects_need_approval() {
        let engine = PolicyEngine::new(Policy::builtin());
        let read = engine.decide_call(
            &principal(),
            &capability("read", "search"),
            &call("p", None),
        );
        assert_eq!(read.verdict, Verdict::Allow);
        assert_eq!(read.determining, ["builtin-reads"]);
        let effect = engine.decide_call(
            &principal(),
            &capability("external-effect", "deliver_artifact"),
            &call("p", Some("team-reports")),
        );
        assert_eq!(effect.verdict, Verdict::RequireApproval);
        assert_eq!(effect.determining, ["builtin-effects-with-approval"]);
        let held = engine.decide_call_with(
            &engine.current(),
            &principal(),
            &capability("external-effect", "deliver_artifact"),
            &call("p", Some("team-reports")),
            true,
        );
        assert_eq!(held.verdict, Verdict::Allow);
        assert_eq!(
            engine.may_use_profile(&principal(), "any").verdict,
            Verdict::Allow
        );
    }

    const POLICY: &str = r#"
@id("reader-reads")
permit (principal, action == Airlock::Action::"call", resource)
when { context.profile == Airlock::Profile::"reader" && resource.effect_class == "read" };

@id("publisher-delivers-with-approval")
permit (principal in Airlock::Role::"operator", action == Airlock::Action::"call", resource)
when { context.profile == Airlock::Profile::"publisher" && context.approved };

@id("no-partners")
@category("outside-scope")
forbid (principal, action == Airlock::Action::"call", resource)
when { context has destination && context.destination == Airlock::Scope::"partner-drop" };

@id("no-big")
forbid (principal, action, resource)
when { context has artifact_bytes && context.artifact_bytes > 1000000 };
"#;

    #[test]
    fn the_narrowed_flags_reach_cedar() {
        // Only outcomes that can be looked up afterwards run, and nothing compensable is
        // treated differently: policies see each flag as the reviewed mapping left it.
        let text = r#"
@id("queryable-effects")
permit (principal, action == Airlock::Action::"call", resource)
when { resource.queryable && resource.idempotent && !resource.compensable };
"#;
        let policy = Policy::from_texts(&[("flags.cedar".into(), text.into())]).unwrap();
        let engine = PolicyEngine::new(policy);
        let p = principal();
        let queryable = capability("external-effect", "deliver_artifact");
        let d = engine.decide_call(&p, &queryable, &call("p", None));
        assert_eq!(d.verdict, Verdict::Allow);
        for narrowed in [
            CapabilityFacts {
                queryable: false,
                ..queryable.clone()
            },
            CapabilityFacts {
                idempotent: false,
                ..queryable.clone()
            },
            CapabilityFacts {
                compensable: true,
                ..queryable.clone()
            },
        ] {
            // The same capability name with other flags is a fresh entity set, not a
            // cached one.
            let d = engine.decide_call(&p, &narrowed, &call("p", None));
            assert_eq!(
                d.verdict,
                Verdict::Deny(DenyCategory::CapabilityUnavailable),
                "{narrowed:?}"
            );
        }
    }

    #[test]
    fn denials_carry_a_bounded_category() {
        let policy = Policy::from_texts(&[("airlock.cedar".into(), POLICY.into())]).unwrap();
        let engine = PolicyEngine::new(policy);
        let p = principal();
        let deliver = capability("external-effect", "deliver_artifact");
        let d = engine.decide_call(&p, &deliver, &call("reader", Some("team-reports")));
        assert_eq!(
            d.verdict,
            Verdict::Deny(DenyCategory::CapabilityUnavailable)
        );
        assert!(
            d.determining.is_empty(),
            "default deny: {:?}",
            d.determining
        );
        let d = engine.decide_call(&p, &deliver, &call("publisher", Some("team-reports")));
        assert_eq!(d.verdict, Verdict::RequireApproval);
        let d = engine.decide_call(&p, &deliver, &call("publisher", Some("partner-drop")));
        assert_eq!(d.verdict, Verdict::Deny(DenyCategory::OutsideScope));
        assert_eq!(d.determining, ["no-partners"]);
        let mut big = call("publisher", Some("team-reports"));
        big.artifact_bytes = Some(2_000_000);
        let d = engine.decide_call(&p, &deliver, &big);
        assert_eq!(
            d.verdict,
            Verdict::Deny(DenyCategory::CapabilityUnavailable)
        );
        // A requester without the role is not offered the approval.
        let bob = Principal::new("bob", &[], "stdio").unwrap();
        let d = engine.decide_call(&bob, &deliver, &call("publisher", Some("team-reports")));
        assert_eq!(
            d.verdict,
            Verdict::Deny(DenyCategory::CapabilityUnavailable)
        );
        let read = engine.decide_call(&bob, &capability("read", "search"), &call("reader", None));
        assert_eq!(read.verdict, Verdict::Allow);
        // Nothing permits use-profile in this policy.
        assert_eq!(
            engine.may_use_profile(&p, "reader").verdict,
            Verdict::Deny(DenyCategory::CapabilityUnavailable)
        );
    }

    #[test]
    fn a_policy_that_does_not_validate_names_its_file_and_line() {
        let cases = [
            (
                "permit (principal, action, resource)\nwhen { resource.effect_clas == \"read\" };",
                "bad.cedar:2:",
            ),
            (
                "permit (principal, action == Airlock::Action::\"call\", resource)\nwhen { context.destination == Airlock::Scope::\"x\" };",
                "bad.cedar:2:",
            ),
            (
                "permit (principal, action, resource)\n  when { true ",
                "bad.cedar:",
            ),
            (
                "permit (principal == Airlock::User::\"x\", action, resource);",
                "bad.cedar:1:",
            ),
            (
                "@category(\"secret\")\nforbid (principal, action, resource);",
                "@category",
            ),
            (
                "@id(\"a\")\npermit (principal, action, resource);\n@id(\"a\")\npermit (principal, action, resource);",
                "used twice",
            ),
            (
                "permit (principal, action, resource == ?resource);",
                "templates",
            ),
            (
                &format!(
                    "permit (principal, action, resource)\nwhen {{ {}true{} }};",
                    "(".repeat(200),
                    ")".repeat(200)
                ),
                "bad.cedar:2: brackets nest 65 deep",
            ),
        ];
        for (text, needle) in cases {
            let err = format!(
                "{:#}",
                Policy::from_texts(&[("policies/bad.cedar".into(), text.into())]).unwrap_err()
            );
            assert!(err.contains(needle), "expected `{needle}` in: {err}");
        }
    }

    #[test]
    fn the_digest_follows_the_text() {
        let a = Policy::from_texts(&[("a.cedar".into(), POLICY.into())]).unwrap();
        let b = Policy::from_texts(&[("elsewhere/a.cedar".into(), POLICY.into())]).unwrap();
        let c =
            Policy::from_texts(&[("a.cedar".into(), format!("{POLICY}\n// a comment\n"))]).unwrap();
        assert_eq!(
            a.digest(),
            b.digest(),
            "the digest is over contents, not paths"
        );
        assert_ne!(a.digest(), c.digest());
        assert_eq!(a.origin("no-big"), Some("a.cedar"));
    }

    #[test]
    fn an_equal_question_is_answered_from_the_kept_decisions_and_any_change_is_asked_again() {
        let policy = Policy::from_texts(&[("airlock.cedar".into(), POLICY.into())]).unwrap();
        let engine = PolicyEngine::new(policy);
        let p = principal();
        let deliver = capability("external-effect", "deliver_artifact");
        let asked = |engine: &PolicyEngine, facts: &CapabilityFacts<'_>, call: &CallFacts<'_>| {
            let before = engine.evaluations();
            let d = engine.decide_call(&p, facts, call);
            (d.verdict, engine.evaluations() - before)
        };
        let team = call("publisher", Some("team-reports"));
        // Require-approval asks Cedar twice; the same question again asks nothing.
        assert_eq!(
            asked(&engine, &deliver, &team),
            (Verdict::RequireApproval, 2)
        );
        assert_eq!(
            asked(&engine, &deliver, &team),
            (Verdict::RequireApproval, 0)
        );
        // Another destination, artifact size, profile, protocol, mapping state or revision
        // is another question, with its own answer.
        let partner = call("publisher", Some("partner-drop"));
        assert_eq!(
            asked(&engine, &deliver, &partner).0,
            Verdict::Deny(DenyCategory::OutsideScope)
        );
        let mut big = call("publisher", Some("team-reports"));
        big.artifact_bytes = Some(2_000_000);
        assert_eq!(
            asked(&engine, &deliver, &big).0,
            Verdict::Deny(DenyCategory::CapabilityUnavailable)
        );
        let mut unsized_call = team.clone();
        unsized_call.artifact_bytes = None;
        assert_eq!(asked(&engine, &deliver, &unsized_call).1, 2);
        let mut other_protocol = team.clone();
        other_protocol.protocol = "2026-07-28";
        assert_eq!(asked(&engine, &deliver, &other_protocol).1, 2);
        assert_eq!(
            asked(&engine, &deliver, &call("reader", Some("team-reports"))).0,
            Verdict::Deny(DenyCategory::CapabilityUnavailable)
        );
        let read = capability("read", "search");
        assert_eq!(
            asked(&engine, &read, &call("reader", None)),
            (Verdict::Allow, 1)
        );
        let stopped = CapabilityFacts {
            mapping_state: "review-required",
            ..read.clone()
        };
        assert_eq!(asked(&engine, &stopped, &call("reader", None)).1, 1);
        let newer = CapabilityFacts {
            mapping_revision: 3,
            ..read.clone()
        };
        assert_eq!(asked(&engine, &newer, &call("reader", None)).1, 1);
        // Another requester, or the same name with other roles.
        let bob = Principal::new("bob", &[], "stdio").unwrap();
        let before = engine.evaluations();
        assert_eq!(
            engine.decide_call(&bob, &deliver, &team).verdict,
            Verdict::Deny(DenyCategory::CapabilityUnavailable)
        );
        assert_eq!(engine.evaluations() - before, 2);
        // The receipt-holding question is its own (approved): allow, asked once.
        let before = engine.evaluations();
        let held = engine.decide_call_with(&engine.current(), &p, &deliver, &team, true);
        assert_eq!(
            (held.verdict, engine.evaluations() - before),
            (Verdict::Allow, 1)
        );
        // A replaced policy is asked again, even for a question asked before: the call
        // that was allowed is now denied.
        let forbid_reads = format!(
            "{POLICY}\n@id(\"no-reads\")\nforbid (principal, action == Airlock::Action::\"call\", resource) when {{ resource.effect_class == \"read\" }};"
        );
        engine.replace(Policy::from_texts(&[("airlock.cedar".into(), forbid_reads)]).unwrap());
        let (verdict, evaluations) = asked(&engine, &read, &call("reader", None));
        assert_eq!(verdict, Verdict::Deny(DenyCategory::CapabilityUnavailable));
        assert!(evaluations >= 1);
        // The same text loaded again is another load: asked again, and its answer names
        // its own file's policy ids.
        engine.replace(Policy::from_texts(&[("airlock.cedar".into(), POLICY.into())]).unwrap());
        assert_eq!(
            asked(&engine, &read, &call("reader", None)),
            (Verdict::Allow, 1)
        );
        let text = POLICY.replace("@id(\"reader-reads\")\n", "");
        engine.replace(Policy::from_texts(&[("first.cedar".into(), text.clone())]).unwrap());
        let first = engine.decide_call(&p, &read, &call("reader", None));
        engine.replace(Policy::from_texts(&[("second.cedar".into(), text)]).unwrap());
        let second = engine.decide_call(&p, &read, &call("reader", None));
        assert_eq!(first.policy_digest, second.policy_digest);
        assert_eq!(first.determining, ["first.cedar#1"]);
        assert_eq!(second.determining, ["second.cedar#1"]);
    }

    #[test]
    fn profile_use_is_kept_per_policy_principal_and_profile() {
        let engine = PolicyEngine::new(Policy::builtin());
        let p = principal();
        let before = engine.evaluations();
        assert_eq!(engine.may_use_profile(&p, "any").verdict, Verdict::Allow);
        assert_eq!(engine.may_use_profile(&p, "any").verdict, Verdict::Allow);
        assert_eq!(engine.evaluations() - before, 1);
        engine.replace(Policy::from_texts(&[("airlock.cedar".into(), POLICY.into())]).unwrap());
        assert_eq!(
            engine.may_use_profile(&p, "any").verdict,
            Verdict::Deny(DenyCategory::CapabilityUnavailable)
        );
        assert_eq!(engine.evaluations() - before, 2);
        // One profile allowed, another not, for the same requester: each its own answer.
        let text = format!(
            "{POLICY}\n@id(\"readers\")\npermit (principal, action == Airlock::Action::\"use-profile\", resource == Airlock::Profile::\"reader\");"
        );
        engine.replace(Policy::from_texts(&[("airlock.cedar".into(), text)]).unwrap());
        assert_eq!(engine.may_use_profile(&p, "reader").verdict, Verdict::Allow);
        assert_eq!(
            engine.may_use_profile(&p, "writer").verdict,
            Verdict::Deny(DenyCategory::CapabilityUnavailable)
        );
        assert_eq!(engine.may_use_profile(&p, "reader").verdict, Verdict::Allow);
        let bob = Principal::new("bob", &[], "stdio").unwrap();
        let before = engine.evaluations();
        assert_eq!(
            engine.may_use_profile(&bob, "reader").verdict,
            Verdict::Allow
        );
        assert_eq!(
            engine.evaluations() - before,
            1,
            "another requester is asked"
        );
    }

    #[test]
    fn keys_do_not_run_fields_together() {
        // "ab" + "c" and "a" + "bc" are different requesters, roles and capabilities.
        let a = Principal::new("ab", &["c".to_string()], "stdio").unwrap();
        let b = Principal::new("a", &["bc".to_string()], "stdio").unwrap();
        let c = Principal::new("a", &["b".to_string(), "c".to_string()], "stdio").unwrap();
        assert_ne!(a.key, b.key);
        assert_ne!(b.key, c.key);
        let x = capability("read", "ab");
        let y = CapabilityFacts {
            name: "a",
            mapping: "boutbox-delivery",
            ..x.clone()
        };
        let z = CapabilityFacts {
            mapping: "boutbox-delivery",
            ..x.clone()
        };
        assert_ne!(capability_key(&a, &x), capability_key(&a, &y));
        assert_ne!(capability_key(&a, &z), capability_key(&a, &y));
    }
}
