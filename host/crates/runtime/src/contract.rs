//! Capability contracts: WIT types → model-facing JSON Schema, and strict JSON ↔ component
//! values.
//!
//! Rule: one source of truth. A capability's input schema, the conversion of the model's
//! JSON arguments into contract values, and the conversion of the adapter's result back
//! into JSON are all derived from the same WIT function signature; what the host does
//! differently per function (effect class, reconciliation, undo, handles, host-supplied
//! fields) is what the function's contract package declares ([`package`]). No code path
//! names a particular contract: the built-in ones are packages under `wit/` read like
//! any operator's ([`Contracts`]). Nothing is hand-written twice.
//!
//! Accepted forms (JSON ⇄ WIT):
//!
//! | WIT                       | JSON                                                    |
//! |---------------------------|---------------------------------------------------------|
//! | `record`                  | object; every field named, no others (`additionalProperties: false`) |
//! | `option<T>` (record field)| the property may be absent; `null` means absent         |
//! | `option<T>` (elsewhere)   | `T` or `null`                                           |
//! | `enum`                    | one of its case names, as a string                      |
//! | `variant`                 | a case name (no payload) or `{"<case>": payload}`       |
//! | `result<T, E>`            | `{"ok": T}` or `{"err": E}`                             |
//! | `list<T>` / `tuple<..>`   | array                                                   |
//! | `flags`                   | array of distinct flag names                            |
//! | integers                  | JSON integers within the type's range (no fractions)    |
//! | `string`, `char`          | string (`char`: exactly one Unicode scalar)             |
//! | handle (`type x-ref = string`, declared in `contract.toml`) | opaque string; the host swaps it for a token |
//! | host-supplied alias (declared in `contract.toml`; a record field) | absent: never in the schema |
//!
//! Anything else fails: an unknown property, a missing required property, a wrong type, an
//! out-of-range integer. Resources, futures, streams and maps are not allowed in contracts.

use std::collections::BTreeMap;
use std::sync::{Arc, LazyLock};

use anyhow::{Context as _, Result, bail};
use serde_json::{Map, Value, json};
use wasmtime::component::Val;

pub mod diff;
pub mod package;
pub mod skeleton;

/// The WIT of `airlock:host@0.1.0`, as shipped in `wit/v0.1.0/deps/host/host.wit`.
pub const HOST_WIT_0_1_0: &str = include_str!("../../../../wit/v0.1.0/deps/host/host.wit");
/// The WIT of `airlock:contracts@0.1.0`, as shipped in `wit/v0.1.0/contracts.wit`.
pub const CONTRACTS_WIT_0_1_0: &str = include_str!("../../../../wit/v0.1.0/contracts.wit");
/// The WIT of `airlock:contracts@0.2.0`, as shipped in `wit/v0.2.0/contracts.wit`.
pub const CONTRACTS_WIT_0_2_0: &str = include_str!("../../../../wit/v0.2.0/contracts.wit");

/// Name of the `string` alias whose record fields the host fills (the intent's idempotency
/// key): such a field is absent from the model-facing schema, refused when the model sends
/// it, and never shown in a result.
pub const HOST_SUPPLIED_KEY: &str = "idempotency-key";

/// Longest string the model may pass in any argument, in characters (Unicode scalar
/// values, as JSON Schema `maxLength` counts them).
pub const MAX_STRING_CHARS: usize = 64 * 1024;

/// Suffix that marks a `string` alias as a handle: an opaque reference the host mints.
pub const HANDLE_SUFFIX: &str = "-ref";

/// The shape of one WIT type, resolved through aliases (except handle aliases).
#[derive(Debug, Clone, PartialEq)]
pub enum Shape {
    Bool,
    U8,
    U16,
    U32,
    U64,
    S8,
    S16,
    S32,
    S64,
    F32,
    F64,
    Char,
    String,
    /// A handle alias: `type <kind> = string` with a name ending in [`HANDLE_SUFFIX`].
    Handle(String),
    /// A host-supplied string ([`HOST_SUPPLIED_KEY`]).
    HostSupplied(String),
    List(Box<Shape>),
    Option(Box<Shape>),
    Tuple(Vec<Shape>),
    Flags(Vec<String>),
    Enum(Vec<String>),
    /// Fields in declaration order: (name, shape, doc).
    Record(Vec<(String, Shape, Option<String>)>),
    /// Cases in declaration order: (name, payload).
    Variant(Vec<(String, Option<Shape>)>),
    Result {
        ok: Option<Box<Shape>>,
        err: Option<Box<Shape>>,
    },
}

/// One function of a contract interface, with the semantics its package declares.
#[derive(Debug, Clone)]
pub struct ContractFunction {
    /// The WIT function name, e.g. `search`.
    pub name: String,
    /// Parameters in order: (name, shape).
    pub params: Vec<(String, Shape)>,
    /// The result type, if any.
    pub result: Option<Shape>,
    /// What the package declares the function does ([`EffectSemantics`]).
    pub semantics: EffectSemantics,
    /// The host-only function that reports what a call of this one did, asked with the
    /// call's host-supplied key (`queryable-by`; DESIGN.md §5.8: reconciliation of an
    /// unknown outcome). See [`package::check_query`] for the signature it has.
    pub query: Option<String>,
    /// The function that undoes a completed call of this one (`compensable-by`). See
    /// [`package::check_undo`] for the signature it has.
    pub undo: Option<String>,
    /// The string field of this function's result that must equal the `sha256` of the
    /// [`HandleRole::Content`] handle its request names (`confirms`): the host checks the
    /// upstream's receipt against what was approved, and a mismatch is an unknown outcome.
    pub confirms: Option<String>,
}

/// What a handle kind means to the host beyond naming an object (`role` in the package's
/// sidecar), so that policy and receipts need no contract's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum HandleRole {
    /// Where an effect goes: the locator of a request's handle of this kind is the call's
    /// scope for policy (`context.destination`, a `Scope` entity).
    Scope,
    /// Content the effect acts on, identified by its `sha256` fact: a receipt binds that
    /// digest, and policy sees its `bytes` fact (`context.artifact_bytes`).
    Content,
}

impl HandleRole {
    /// The sidecar's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Scope => "scope",
            Self::Content => "content",
        }
    }
}

/// One handle kind of a contract interface (`type <kind> = string`, `<kind>` ending in
/// [`HANDLE_SUFFIX`], declared in the package's sidecar).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct HandleKind {
    /// The facts that identify the object a handle of this kind names: the names of the
    /// scalar fields, beside the handle in the record it comes in, that change only when
    /// the object itself changes (a source's `version`, an artifact's `sha256`).
    /// DESIGN.md §2 "handle": only a change of one of these makes the same locator
    /// another object (and drops its old reference); every other field of the record (a
    /// search hit's `title`, `snippet` or `score`, a destination's `label`) describes one
    /// result, never the object's identity. Empty: the locator alone identifies it.
    pub identity: Vec<String>,
    /// The functions whose result carries one (the host mints a token for it there).
    pub minted_by: Vec<String>,
    /// The functions whose arguments carry one (the host resolves a token there).
    pub consumed_by: Vec<String>,
    /// What it means to the host beyond naming an object, if anything.
    pub role: Option<HandleRole>,
}

/// A capability contract: one WIT interface of a loaded, checked contract package.
#[derive(Debug, Clone)]
pub struct Contract {
    /// Fully qualified interface name, e.g. `airlock:contracts/source-retrieval@0.1.0`:
    /// the name under which adapters export it.
    pub interface: String,
    /// The WIT package it belongs to, e.g. `airlock:contracts@0.1.0`.
    pub package: String,
    /// The package's digest ([`package::PackageFiles::digest`]).
    pub digest: String,
    /// The interface's doc comment.
    pub docs: Option<String>,
    /// Functions by WIT name.
    pub functions: BTreeMap<String, ContractFunction>,
    /// Handle kinds by name.
    pub handles: BTreeMap<String, HandleKind>,
}

impl Contract {
    /// The declared semantics of `function`, or `None` when the contract has no such
    /// function.
    pub fn semantics(&self, function: &str) -> Option<EffectSemantics> {
        self.functions.get(function).map(|f| f.semantics)
    }

    /// The identity facts of handle `kind` ([`HandleKind::identity`]); empty for a kind
    /// this contract does not declare.
    pub fn identity_facts(&self, kind: &str) -> &[String] {
        self.handles
            .get(kind)
            .map_or(&[], |h| h.identity.as_slice())
    }

    /// The role the contract gives handle `kind` ([`HandleKind::role`]).
    pub fn handle_role(&self, kind: &str) -> Option<HandleRole> {
        self.handles.get(kind).and_then(|h| h.role)
    }

    /// The host-only function that reconciles an unknown outcome of `function`, if the
    /// contract declares one.
    pub fn query_function(&self, function: &str) -> Option<&str> {
        self.functions.get(function)?.query.as_deref()
    }

    /// The most consequential effect class among the functions the model may call.
    pub fn most_consequential(&self) -> EffectClass {
        self.functions
            .values()
            .filter(|f| !f.semantics.host_only)
            .map(|f| f.semantics.class)
            .max_by_key(|c| EffectClass::ALL.iter().position(|x| x == c))
            .unwrap_or(EffectClass::Read)
    }
}

/// Why model-supplied JSON could not become a contract value. `path` is a JSON pointer
/// into the arguments (`""` for the whole object).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvertError {
    pub path: String,
    pub message: String,
}

impl std::fmt::Display for ConvertError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.path.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

impl std::error::Error for ConvertError {}

/// The effect class of a contract function, declared by the host (DESIGN.md §2), never
/// taken from a server's annotations (which are hints).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum EffectClass {
    /// Reads; changes nothing anywhere.
    Read,
    /// Computes or stages something that leaves no one else's system changed.
    LocalTransformation,
    /// Changes something that can be undone.
    ReversibleMutation,
    /// Changes something outside Airlock's reach that cannot be recalled.
    ExternalEffect,
}

impl EffectClass {
    /// The kebab-case name (`read`, `local-transformation`, `reversible-mutation`,
    /// `external-effect`): what policies compare `resource.effect_class` with.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Read => "read",
            Self::LocalTransformation => "local-transformation",
            Self::ReversibleMutation => "reversible-mutation",
            Self::ExternalEffect => "external-effect",
        }
    }

    /// True for classes whose call changes something (everything but `read`).
    pub fn has_effect(self) -> bool {
        self != Self::Read
    }

    /// Every class, least consequential first.
    pub const ALL: [Self; 4] = [
        Self::Read,
        Self::LocalTransformation,
        Self::ReversibleMutation,
        Self::ExternalEffect,
    ];

    /// The class named `name` (the kebab-case form of [`EffectClass::as_str`]), if any.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.as_str() == name)
    }
}

impl std::fmt::Display for EffectClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Host-side semantics of one contract function, as the host declares it for the
/// contract; a reviewed mapping confirms the class and may only narrow the flags
/// ([`EffectSemantics::narrowed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct EffectSemantics {
    /// The effect class.
    pub class: EffectClass,
    /// Whether repeating the call (with the same host-supplied key, where it has one)
    /// changes nothing more.
    pub idempotent: bool,
    /// Whether the contract can be asked afterwards what happened (a reconciliation query).
    pub queryable: bool,
    /// Whether the contract has a compensating action: a function that undoes the
    /// effect's consequences after the fact (a cancel, a refund, a retraction), so that
    /// a completed effect can be answered by another call rather than only by a person.
    /// No bundled contract has one.
    pub compensable: bool,
    /// Called by the host only (reconciliation); a mapping may not offer it to the model.
    pub host_only: bool,
}

/// A mapping's narrowing of the flags the contract declares for one function:
/// `Some(false)` turns a flag off, `None` keeps the contract's value, and `Some(true)` is
/// accepted only where the contract declares it true. (The class is confirmed, not
/// narrowed: see [`crate::manifest::CapabilitySection::semantics`].)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Narrowing {
    /// `idempotent = false`: the upstream does not honour the key, say.
    pub idempotent: Option<bool>,
    /// `queryable = false`: the upstream has no lookup, say.
    pub queryable: Option<bool>,
    /// `compensable = false`.
    pub compensable: Option<bool>,
}

impl EffectSemantics {
    /// These semantics narrowed by `narrowing`: a flag may go from true to false, never
    /// from false to true.
    ///
    /// # Errors
    /// A flag set to true that these semantics declare false; the message names it.
    pub fn narrowed(self, narrowing: Narrowing) -> std::result::Result<Self, String> {
        let mut out = self;
        for (key, declared, asked, slot) in [
            (
                "idempotent",
                self.idempotent,
                narrowing.idempotent,
                &mut out.idempotent,
            ),
            (
                "queryable",
                self.queryable,
                narrowing.queryable,
                &mut out.queryable,
            ),
            (
                "compensable",
                self.compensable,
                narrowing.compensable,
                &mut out.compensable,
            ),
        ] {
            match asked {
                Some(true) if !declared => {
                    return Err(format!(
                        "`{key} = true` widens the contract, which declares it not {key}; a mapping may only narrow (true -> false)"
                    ));
                }
                Some(value) => *slot = value,
                None => {}
            }
        }
        Ok(out)
    }
}

/// The built-in contract packages: `wit/v0.1.0` and `wit/v0.2.0` as shipped, each read
/// through [`package::load`] like an operator's package.
pub const BUILT_IN_PACKAGES: &[(&str, &[(&str, &str)])] = &[
    (
        "built-in wit/v0.1.0",
        &[
            (
                package::SIDECAR,
                include_str!("../../../../wit/v0.1.0/contract.toml"),
            ),
            ("contracts.wit", CONTRACTS_WIT_0_1_0),
            ("deps/host/host.wit", HOST_WIT_0_1_0),
        ],
    ),
    (
        "built-in wit/v0.2.0",
        &[
            (
                package::SIDECAR,
                include_str!("../../../../wit/v0.2.0/contract.toml"),
            ),
            ("contracts.wit", CONTRACTS_WIT_0_2_0),
            (
                "deps/host/host.wit",
                include_str!("../../../../wit/v0.2.0/deps/host/host.wit"),
            ),
        ],
    ),
];

/// A set of loaded contract packages, looked up by interface: what one host serves.
#[derive(Debug, Clone, Default)]
pub struct Contracts {
    packages: Vec<Arc<package::ContractPackage>>,
    by_interface: BTreeMap<String, Arc<Contract>>,
}

impl Contracts {
    /// The built-in packages ([`BUILT_IN_PACKAGES`]), loaded once per process.
    ///
    /// # Panics
    /// A built-in package fails to load (a test keeps them loading).
    pub fn built_in() -> &'static Contracts {
        static BUILT_IN: LazyLock<Contracts> = LazyLock::new(|| {
            let mut c = Contracts::default();
            for (origin, files) in BUILT_IN_PACKAGES {
                let files = package::PackageFiles::new(*origin, files.iter().copied())
                    .expect("a built-in package's files");
                let p = package::load(&files).expect("a built-in contract package loads");
                c.add(p).expect("built-in packages do not overlap");
            }
            c
        });
        &BUILT_IN
    }

    /// Adds a loaded package.
    ///
    /// # Errors
    /// A package of the same name is already here (with the same or another digest: a
    /// released `name@version` is one package), or one of its interfaces is.
    pub fn add(&mut self, p: package::ContractPackage) -> Result<()> {
        if let Some(old) = self.packages.iter().find(|o| o.name == p.name) {
            if old.digest == p.digest {
                bail!(
                    "contract package `{}` is loaded twice ({} and {})",
                    p.name,
                    old.origin,
                    p.origin
                );
            }
            bail!(
                "contract package `{}` from {} has digest {}, but `{}` from {} has digest {}: a released name@version never changes; give the changed package a new version",
                p.name,
                p.origin,
                p.digest,
                old.name,
                old.origin,
                old.digest
            );
        }
        for interface in p.interfaces.keys() {
            if self.by_interface.contains_key(interface) {
                bail!(
                    "contract package `{}` from {} declares interface `{interface}`, which another loaded package declares",
                    p.name,
                    p.origin
                );
            }
        }
        for (name, c) in &p.interfaces {
            self.by_interface.insert(name.clone(), c.clone());
        }
        self.packages.push(Arc::new(p));
        Ok(())
    }

    /// The contract named `interface` (`<namespace>:<package>/<interface>@<version>`).
    ///
    /// # Errors
    /// No loaded package declares it; the message lists those that are.
    pub fn get(&self, interface: &str) -> Result<Arc<Contract>> {
        self.by_interface.get(interface).cloned().with_context(|| {
            format!(
                "unknown contract `{interface}`; this host knows: {}",
                self.interfaces().join(", ")
            )
        })
    }

    /// Every contract interface here, in name order.
    pub fn interfaces(&self) -> Vec<String> {
        self.by_interface.keys().cloned().collect()
    }

    /// The loaded packages, in the order they were added.
    pub fn packages(&self) -> &[Arc<package::ContractPackage>] {
        &self.packages
    }
}

/// The built-in contract interfaces, e.g. `airlock:contracts/source-retrieval@0.1.0`.
pub fn known_contracts() -> Vec<String> {
    Contracts::built_in().interfaces()
}

/// The built-in contract named `interface`.
///
/// # Errors
/// No built-in package declares it.
pub fn load_contract(interface: &str) -> Result<Arc<Contract>> {
    Contracts::built_in().get(interface)
}

/// Whether a value of `shape` is a fact the host keeps beside a handle in its record: a
/// scalar (string, boolean, integer, enum case), or an `option` of one.
pub fn is_fact(shape: &Shape) -> bool {
    match shape {
        Shape::Option(inner) => is_fact(inner),
        Shape::String
        | Shape::Bool
        | Shape::U8
        | Shape::U16
        | Shape::U32
        | Shape::U64
        | Shape::S8
        | Shape::S16
        | Shape::S32
        | Shape::S64
        | Shape::Enum(_) => true,
        _ => false,
    }
}

/// Returns the JSON Schema (draft 2020-12) for values of `shape`.
pub fn json_schema(shape: &Shape) -> Value {
    fn int(min: i128, max: i128) -> Value {
        json!({"type": "integer", "minimum": min, "maximum": max})
    }
    match shape {
        Shape::Bool => json!({"type": "boolean"}),
        Shape::U8 => int(0, u8::MAX.into()),
        Shape::U16 => int(0, u16::MAX.into()),
        Shape::U32 => int(0, u32::MAX.into()),
        Shape::U64 => int(0, u64::MAX.into()),
        Shape::S8 => int(i8::MIN.into(), i8::MAX.into()),
        Shape::S16 => int(i16::MIN.into(), i16::MAX.into()),
        Shape::S32 => int(i32::MIN.into(), i32::MAX.into()),
        Shape::S64 => int(i64::MIN.into(), i64::MAX.into()),
        Shape::F32 | Shape::F64 => json!({"type": "number"}),
        Shape::Char => json!({"type": "string", "minLength": 1, "maxLength": 1}),
        Shape::String => json!({"type": "string", "maxLength": MAX_STRING_CHARS}),
        Shape::Handle(kind) => json!({
            "type": "string",
            "description": format!("An opaque {kind} handle issued by this server. Pass it back unchanged."),
        }),
        // Never in a record's schema (see the record arm); standing alone it is a string.
        Shape::HostSupplied(_) => json!({"type": "string"}),
        Shape::List(item) => json!({"type": "array", "items": json_schema(item)}),
        Shape::Option(inner) => json!({"anyOf": [json_schema(inner), {"type": "null"}]}),
        Shape::Tuple(items) => json!({
            "type": "array",
            "prefixItems": items.iter().map(json_schema).collect::<Vec<_>>(),
            "items": false,
            "minItems": items.len(),
        }),
        Shape::Flags(names) => json!({
            "type": "array",
            "items": {"type": "string", "enum": names},
            "uniqueItems": true,
        }),
        Shape::Enum(names) => json!({"type": "string", "enum": names}),
        Shape::Record(fields) => {
            let mut properties = Map::new();
            let mut required = Vec::new();
            for (name, shape, doc) in fields {
                if matches!(shape, Shape::HostSupplied(_)) {
                    continue;
                }
                let mut schema = match shape {
                    Shape::Option(inner) => json_schema(inner),
                    _ => {
                        required.push(Value::String(name.clone()));
                        json_schema(shape)
                    }
                };
                if let (Some(doc), Some(obj)) = (doc, schema.as_object_mut()) {
                    obj.entry("description")
                        .or_insert_with(|| Value::String(doc.trim().to_string()));
                }
                properties.insert(name.clone(), schema);
            }
            json!({
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": false,
            })
        }
        Shape::Variant(cases) => json!({
            "oneOf": cases.iter().map(|(name, payload)| match payload {
                None => json!({"const": name}),
                Some(p) => json!({
                    "type": "object",
                    "properties": {name.clone(): json_schema(p)},
                    "required": [name],
                    "additionalProperties": false,
                }),
            }).collect::<Vec<_>>(),
        }),
        Shape::Result { ok, err } => {
            let arm = |key: &str, s: &Option<Box<Shape>>| {
                json!({
                    "type": "object",
                    "properties": {key: s.as_deref().map(json_schema).unwrap_or(json!({"type": "null"}))},
                    "required": [key],
                    "additionalProperties": false,
                })
            };
            json!({"oneOf": [arm("ok", ok), arm("err", err)]})
        }
    }
}

/// Converts model-supplied JSON into a component value of `shape`, strictly.
///
/// `on_handle(kind, token)` resolves each handle the model passed (an opaque token) into
/// the adapter's locator; its error is reported at the handle's path. A host-supplied
/// record field is not read from `value` (the model may not send it) and becomes an empty
/// string; [`fill_host_supplied`] sets it once the intent exists.
///
/// # Errors
/// The first mismatch found, with its JSON pointer.
pub fn json_to_val(
    shape: &Shape,
    value: &Value,
    on_handle: &mut dyn FnMut(&str, &str) -> Result<String, String>,
) -> Result<Val, ConvertError> {
    to_val(shape, value, "", on_handle)
}

fn fail<T>(path: &str, message: impl Into<String>) -> Result<T, ConvertError> {
    Err(ConvertError {
        path: path.to_string(),
        message: message.into(),
    })
}

/// What a value of `shape` is, in words, for a refusal.
fn expected_kind(shape: &Shape) -> &'static str {
    match shape {
        Shape::Bool => "a boolean",
        Shape::U8
        | Shape::U16
        | Shape::U32
        | Shape::U64
        | Shape::S8
        | Shape::S16
        | Shape::S32
        | Shape::S64 => "an integer",
        Shape::F32 | Shape::F64 => "a number",
        Shape::Char
        | Shape::String
        | Shape::Handle(_)
        | Shape::HostSupplied(_)
        | Shape::Enum(_) => "a string",
        Shape::List(_) | Shape::Tuple(_) | Shape::Flags(_) => "an array",
        Shape::Record(_) | Shape::Result { .. } => "an object",
        Shape::Option(_) | Shape::Variant(_) => "an allowed value",
    }
}

fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// What a WIT value of `shape` is for the JSON `value` at JSON Pointer `path`. The
/// dispatcher: each compound shape has its own function below; a scalar is converted here.
fn to_val(
    shape: &Shape,
    value: &Value,
    path: &str,
    on_handle: &mut dyn FnMut(&str, &str) -> Result<String, String>,
) -> Result<Val, ConvertError> {
    let expect_str = |what: &str| -> Result<&str, ConvertError> {
        value.as_str().ok_or_else(|| ConvertError {
            path: path.to_string(),
            message: format!("expected {what}, got {}", kind_of(value)),
        })
    };
    match shape {
        Shape::Bool => value
            .as_bool()
            .map(Val::Bool)
            .ok_or(())
            .or_else(|_| fail(path, format!("expected a boolean, got {}", kind_of(value)))),
        Shape::U8 => int_val(value, path, Val::U8),
        Shape::U16 => int_val(value, path, Val::U16),
        Shape::U32 => int_val(value, path, Val::U32),
        Shape::U64 => int_val(value, path, Val::U64),
        Shape::S8 => int_val(value, path, Val::S8),
        Shape::S16 => int_val(value, path, Val::S16),
        Shape::S32 => int_val(value, path, Val::S32),
        Shape::S64 => int_val(value, path, Val::S64),
        Shape::F32 | Shape::F64 => match value.as_f64() {
            Some(f) if matches!(shape, Shape::F32) => Ok(Val::Float32(f as f32)),
            Some(f) => Ok(Val::Float64(f)),
            None => fail(path, format!("expected a number, got {}", kind_of(value))),
        },
        Shape::Char => {
            let s = expect_str("a one-character string")?;
            let mut chars = s.chars();
            match (chars.next(), chars.next()) {
                (Some(c), None) => Ok(Val::Char(c)),
                _ => fail(path, "expected exactly one character"),
            }
        }
        Shape::String => {
            let text = expect_str("a string")?;
            // `maxLength` counts characters (Unicode scalar values), as JSON Schema does;
            // counting only when the bytes could exceed it.
            if text.len() > MAX_STRING_CHARS && text.chars().count() > MAX_STRING_CHARS {
                return fail(
                    path,
                    format!("string is longer than {MAX_STRING_CHARS} characters"),
                );
            }
            Ok(Val::String(text.to_string()))
        }
        Shape::Handle(kind) => {
            let token = expect_str("a reference string")?;
            on_handle(kind, token)
                .map(Val::String)
                .or_else(|message| fail(path, message))
        }
        Shape::HostSupplied(_) => fail(path, "this value is supplied by the host, not the caller"),
        Shape::List(item) => {
            let Some(items) = value.as_array() else {
                return fail(path, format!("expected an array, got {}", kind_of(value)));
            };
            items
                .iter()
                .enumerate()
                .map(|(i, v)| to_val(item, v, &format!("{path}/{i}"), on_handle))
                .collect::<Result<_, _>>()
                .map(Val::List)
        }
        Shape::Option(inner) => match value {
            Value::Null => Ok(Val::Option(None)),
            v => Ok(Val::Option(Some(Box::new(to_val(
                inner, v, path, on_handle,
            )?)))),
        },
        Shape::Tuple(items) => {
            let Some(values) = value.as_array().filter(|a| a.len() == items.len()) else {
                return fail(path, format!("expected an array of {} items", items.len()));
            };
            items
                .iter()
                .zip(values)
                .enumerate()
                .map(|(i, (s, v))| to_val(s, v, &format!("{path}/{i}"), on_handle))
                .collect::<Result<_, _>>()
                .map(Val::Tuple)
        }
        Shape::Flags(names) => flags_val(names, value, path),
        Shape::Enum(names) => {
            let s = expect_str("a string")?;
            if names.iter().any(|n| n == s) {
                Ok(Val::Enum(s.to_string()))
            } else {
                fail(path, format!("expected one of {}", names.join(", ")))
            }
        }
        Shape::Record(fields) => record_val(fields, value, path, on_handle),
        Shape::Variant(cases) => variant_val(cases, value, path, on_handle),
        Shape::Result { ok, err } => result_val(ok, err, value, path, on_handle),
    }
}

/// An integer of type `T` (made into a `Val` by `make`). JSON Schema's `integer` is any
/// number with a zero fractional part, so `2.0` is one; `2.5` and values outside `T`'s
/// range are not.
fn int_val<T>(value: &Value, path: &str, make: fn(T) -> Val) -> Result<Val, ConvertError>
where
    T: TryFrom<i128> + Bounded,
{
    let n = match value {
        Value::Number(n) => n
            .as_i64()
            .map(i128::from)
            .or_else(|| n.as_u64().map(i128::from))
            .or_else(|| {
                n.as_f64()
                    .filter(|f| f.fract() == 0.0 && f.abs() < 1e38)
                    .map(|f| f as i128)
            }),
        _ => None,
    };
    match n.and_then(|n| T::try_from(n).ok()) {
        Some(v) => Ok(make(v)),
        None => fail(
            path,
            format!(
                "expected an integer from {} to {}, got {}",
                T::MIN,
                T::MAX,
                if value.is_number() {
                    value.to_string()
                } else {
                    kind_of(value).to_string()
                }
            ),
        ),
    }
}

/// The range of a WIT integer type, for [`int_val`]'s refusal.
trait Bounded {
    const MIN: i128;
    const MAX: i128;
}

macro_rules! bounded {
    ($($t:ty),*) => {$(
        impl Bounded for $t {
            const MIN: i128 = <$t>::MIN as i128;
            const MAX: i128 = <$t>::MAX as i128;
        }
    )*};
}
bounded!(u8, u16, u32, u64, i8, i16, i32, i64);

/// WIT `flags`: an array of distinct flag names, each one of `names`.
fn flags_val(names: &[String], value: &Value, path: &str) -> Result<Val, ConvertError> {
    let Some(values) = value.as_array() else {
        return fail(path, format!("expected an array, got {}", kind_of(value)));
    };
    let mut out: Vec<String> = Vec::new();
    for (i, v) in values.iter().enumerate() {
        let p = format!("{path}/{i}");
        match v.as_str() {
            Some(s) if names.iter().any(|n| n == s) && !out.iter().any(|o| o == s) => {
                out.push(s.to_string())
            }
            Some(s) if out.iter().any(|o| o == s) => return fail(&p, "repeated flag"),
            _ => return fail(&p, format!("expected one of {}", names.join(", "))),
        }
    }
    Ok(Val::Flags(out))
}

/// A WIT `record`: an object with exactly the caller-visible fields. A host-supplied
/// field is refused when the caller sends it and left empty here (the host fills it,
/// [`fill_host_supplied`]); an `option` field is left out to omit it (`null` is refused,
/// since the property's schema is its inner type); any other missing field is refused.
fn record_val(
    fields: &[(String, Shape, Option<String>)],
    value: &Value,
    path: &str,
    on_handle: &mut dyn FnMut(&str, &str) -> Result<String, String>,
) -> Result<Val, ConvertError> {
    let Some(obj) = value.as_object() else {
        return fail(path, format!("expected an object, got {}", kind_of(value)));
    };
    let visible = |name: &str| {
        fields
            .iter()
            .any(|(n, s, _)| n == name && !matches!(s, Shape::HostSupplied(_)))
    };
    if let Some(unknown) = obj.keys().find(|k| !visible(k)) {
        return fail(
            &format!("{path}/{}", escape_pointer(unknown)),
            format!(
                "unknown property; allowed: {}",
                fields
                    .iter()
                    .filter(|(_, s, _)| !matches!(s, Shape::HostSupplied(_)))
                    .map(|(n, _, _)| n.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        );
    }
    let mut out = Vec::with_capacity(fields.len());
    for (name, field_shape, _) in fields {
        let p = format!("{path}/{}", escape_pointer(name));
        let v = match (obj.get(name), field_shape) {
            (_, Shape::HostSupplied(_)) => Val::String(String::new()),
            (None, Shape::Option(_)) => Val::Option(None),
            // The schema of an optional property is its inner type, which `null`
            // is not: leaving it out is how it is omitted.
            (Some(Value::Null), Shape::Option(inner)) => {
                return fail(
                    &p,
                    format!(
                        "null is not {}; leave the property out instead",
                        expected_kind(inner)
                    ),
                );
            }
            (None, _) => return fail(&p, "required property is missing"),
            (Some(v), s) => to_val(s, v, &p, on_handle)?,
        };
        out.push((name.clone(), v));
    }
    Ok(Val::Record(out))
}

/// A WIT `variant`: a case name (a case without payload) or a one-property object
/// `{"case": payload}`.
fn variant_val(
    cases: &[(String, Option<Shape>)],
    value: &Value,
    path: &str,
    on_handle: &mut dyn FnMut(&str, &str) -> Result<String, String>,
) -> Result<Val, ConvertError> {
    let (case, payload) = match value {
        Value::String(s) => (s.as_str(), None),
        Value::Object(o) if o.len() == 1 => {
            let (k, v) = o.iter().next().expect("one entry");
            (k.as_str(), Some(v))
        }
        _ => return fail(path, "expected a case name or a one-property object"),
    };
    let Some((name, shape)) = cases.iter().find(|(n, _)| n == case) else {
        return fail(path, format!("unknown case `{case}`"));
    };
    let p = format!("{path}/{}", escape_pointer(name));
    let payload = match (shape, payload) {
        (None, None) => None,
        (Some(s), Some(v)) => Some(Box::new(to_val(s, v, &p, on_handle)?)),
        (Some(_), None) => return fail(&p, "this case needs a value"),
        (None, Some(_)) => return fail(&p, "this case takes no value"),
    };
    Ok(Val::Variant(name.clone(), payload))
}

/// A WIT `result`: `{"ok": value}` or `{"err": value}` (`null` for an arm without type).
fn result_val(
    ok: &Option<Box<Shape>>,
    err: &Option<Box<Shape>>,
    value: &Value,
    path: &str,
    on_handle: &mut dyn FnMut(&str, &str) -> Result<String, String>,
) -> Result<Val, ConvertError> {
    let Some(obj) = value.as_object().filter(|o| o.len() == 1) else {
        return fail(path, "expected {\"ok\": ...} or {\"err\": ...}");
    };
    let (key, v) = obj.iter().next().expect("one entry");
    let arm = |s: &Option<Box<Shape>>,
               on_handle: &mut dyn FnMut(&str, &str) -> Result<String, String>| {
        match s {
            Some(s) => to_val(s, v, &format!("{path}/{key}"), on_handle).map(|v| Some(Box::new(v))),
            None if v.is_null() => Ok(None),
            None => fail(&format!("{path}/{key}"), "expected null"),
        }
    };
    match key.as_str() {
        "ok" => Ok(Val::Result(Ok(arm(ok, on_handle)?))),
        "err" => Ok(Val::Result(Err(arm(err, on_handle)?))),
        _ => fail(path, "expected {\"ok\": ...} or {\"err\": ...}"),
    }
}

/// Sets every host-supplied field in `val` (of `shape`) to `key`. Returns how many were set.
pub fn fill_host_supplied(shape: &Shape, val: &mut Val, key: &str) -> usize {
    match (shape, val) {
        (Shape::HostSupplied(_), Val::String(s)) => {
            *s = key.to_string();
            1
        }
        (Shape::Record(fields), Val::Record(vals)) => fields
            .iter()
            .map(|(name, s, _)| {
                vals.iter_mut()
                    .find(|(n, _)| n == name)
                    .map_or(0, |(_, v)| fill_host_supplied(s, v, key))
            })
            .sum(),
        (Shape::Option(inner), Val::Option(Some(v))) => fill_host_supplied(inner, v, key),
        (Shape::List(item), Val::List(items)) => items
            .iter_mut()
            .map(|v| fill_host_supplied(item, v, key))
            .sum(),
        (Shape::Tuple(shapes), Val::Tuple(vals)) => shapes
            .iter()
            .zip(vals.iter_mut())
            .map(|(s, v)| fill_host_supplied(s, v, key))
            .sum(),
        _ => 0,
    }
}

fn escape_pointer(segment: &str) -> String {
    segment.replace('~', "~0").replace('/', "~1")
}

/// Converts a component value of `shape` (returned by an adapter) into JSON.
///
/// `on_handle(kind, locator)` turns each handle the adapter returned (its own locator) into
/// what the model may see (an opaque token).
///
/// # Errors
/// The value does not have the declared shape (a broken invariant: wasmtime type-checks
/// results), or `on_handle` failed.
pub fn val_to_json(
    shape: &Shape,
    val: &Val,
    on_handle: &mut dyn FnMut(&str, &str) -> Result<String>,
) -> Result<Value> {
    Ok(match (shape, val) {
        (Shape::Bool, Val::Bool(b)) => json!(b),
        (Shape::U8, Val::U8(n)) => json!(n),
        (Shape::U16, Val::U16(n)) => json!(n),
        (Shape::U32, Val::U32(n)) => json!(n),
        (Shape::U64, Val::U64(n)) => json!(n),
        (Shape::S8, Val::S8(n)) => json!(n),
        (Shape::S16, Val::S16(n)) => json!(n),
        (Shape::S32, Val::S32(n)) => json!(n),
        (Shape::S64, Val::S64(n)) => json!(n),
        (Shape::F32, Val::Float32(f)) => json!(f),
        (Shape::F64, Val::Float64(f)) => json!(f),
        (Shape::Char, Val::Char(c)) => json!(c.to_string()),
        (Shape::String, Val::String(s)) => json!(s),
        (Shape::Handle(kind), Val::String(s)) => Value::String(on_handle(kind, s)?),
        (Shape::HostSupplied(_), Val::String(s)) => json!(s),
        (Shape::List(item), Val::List(items)) => Value::Array(
            items
                .iter()
                .map(|v| val_to_json(item, v, on_handle))
                .collect::<Result<_>>()?,
        ),
        (Shape::Option(_), Val::Option(None)) => Value::Null,
        (Shape::Option(inner), Val::Option(Some(v))) => val_to_json(inner, v, on_handle)?,
        (Shape::Tuple(shapes), Val::Tuple(vals)) if shapes.len() == vals.len() => Value::Array(
            shapes
                .iter()
                .zip(vals)
                .map(|(s, v)| val_to_json(s, v, on_handle))
                .collect::<Result<_>>()?,
        ),
        (Shape::Flags(_), Val::Flags(names)) => json!(names),
        (Shape::Enum(_), Val::Enum(name)) => json!(name),
        (Shape::Record(fields), Val::Record(vals)) => {
            let mut obj = Map::new();
            for (name, field_shape, _) in fields {
                // Host-supplied values (idempotency keys) are never shown.
                if matches!(field_shape, Shape::HostSupplied(_)) {
                    continue;
                }
                let v = vals
                    .iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, v)| v)
                    .with_context(|| format!("record value lacks field `{name}`"))?;
                let json = val_to_json(field_shape, v, on_handle)?;
                if !(matches!(field_shape, Shape::Option(_)) && json.is_null()) {
                    obj.insert(name.clone(), json);
                }
            }
            Value::Object(obj)
        }
        (Shape::Variant(cases), Val::Variant(case, payload)) => {
            let shape = cases
                .iter()
                .find(|(n, _)| n == case)
                .map(|(_, s)| s)
                .with_context(|| format!("unknown variant case `{case}`"))?;
            match (shape, payload) {
                (Some(s), Some(p)) => json!({case.clone(): val_to_json(s, p, on_handle)?}),
                _ => json!(case),
            }
        }
        (Shape::Result { ok, err }, Val::Result(r)) => {
            let (key, shape, payload) = match r {
                Ok(p) => ("ok", ok, p),
                Err(p) => ("err", err, p),
            };
            let v = match (shape, payload) {
                (Some(s), Some(p)) => val_to_json(s, p, on_handle)?,
                _ => Value::Null,
            };
            json!({key: v})
        }
        (shape, val) => bail!("value {val:?} does not have the contract's shape {shape:?}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCE_RETRIEVAL: &str = "airlock:contracts/source-retrieval@0.1.0";

    fn no_handles(_: &str, _: &str) -> Result<String, String> {
        Err("no handles expected".into())
    }

    fn search_shape() -> Shape {
        let c = load_contract(SOURCE_RETRIEVAL).unwrap();
        c.functions["search"].params[0].1.clone()
    }

    #[test]
    fn search_request_schema_is_derived_and_closed() {
        let schema = json_schema(&search_shape());
        assert_eq!(schema["type"], "object");
        assert_eq!(schema["additionalProperties"], false);
        assert_eq!(schema["required"], json!(["query"]));
        assert_eq!(schema["properties"]["query"]["type"], "string");
        assert_eq!(schema["properties"]["limit"]["type"], "integer");
        assert_eq!(schema["properties"]["limit"]["maximum"], u32::MAX);
        assert!(
            schema["properties"]["query"]["description"]
                .as_str()
                .unwrap()
                .contains("Words")
        );
    }

    #[test]
    fn handles_are_opaque_strings_in_schema() {
        let c = load_contract(SOURCE_RETRIEVAL).unwrap();
        let shape = &c.functions["retrieve"].params[0].1;
        let schema = json_schema(shape);
        assert_eq!(schema["properties"]["reference"]["type"], "string");
        assert!(matches!(shape, Shape::Record(f) if f[0].1 == Shape::Handle("source-ref".into())));
    }

    /// Every WIT file the repository ships, with the sha256 it was released with. A
    /// released file never changes (STYLE.md §6): a new version goes beside it.
    const RELEASED_WIT: &[(&str, &str, &str)] = &[
        (
            "v0.1.0/deps/host/host.wit",
            include_str!("../../../../wit/v0.1.0/deps/host/host.wit"),
            "dcd7c77aa186036c56a48dbdb822578ff3386d167f9114d60629a89c8a7ca650",
        ),
        (
            "v0.1.0/contracts.wit",
            include_str!("../../../../wit/v0.1.0/contracts.wit"),
            "15afc9b25185d85e9fd172e12a78cd44b442a160572db4002348da0a5496621c",
        ),
        (
            "v0.2.0/contracts.wit",
            include_str!("../../../../wit/v0.2.0/contracts.wit"),
            "b957cc9a24d2dc2e09f8dba9a1b83c7457f4b158e61bad1f5cbbe0a660d5fa5f",
        ),
        (
            "worlds-v0.2.0/deps/host-0.2.0/host.wit",
            include_str!("../../../../wit/worlds-v0.2.0/deps/host-0.2.0/host.wit"),
            "bfc9d022ff9c093aeb171273fd5ff111242a7a690a1366abbe43fb98e4a37ab2",
        ),
        (
            "worlds-v0.2.0/worlds.wit",
            include_str!("../../../../wit/worlds-v0.2.0/worlds.wit"),
            "d0b1b1c2b6758d3ee4f2ba2e2f26602cbba2fef251c11bcc13b1e9c0445814d8",
        ),
        (
            "worlds-v0.3.0/deps/host-0.3.0/host.wit",
            include_str!("../../../../wit/worlds-v0.3.0/deps/host-0.3.0/host.wit"),
            "05ae94735c5048648c768c39f61b2b5c875782eabf6e746fbb6b4d47b33a7daf",
        ),
        (
            "worlds-v0.3.0/worlds.wit",
            include_str!("../../../../wit/worlds-v0.3.0/worlds.wit"),
            "cf97e98080ad37f6c1c92fecce3c5749f38d1544924a181173a68cc4be86a778",
        ),
    ];

    /// Copies of released packages that other releases carry in their `deps/`.
    const WIT_COPIES: &[(&str, &str, &str)] = &[
        (
            "v0.2.0/deps/host/host.wit",
            include_str!("../../../../wit/v0.2.0/deps/host/host.wit"),
            "v0.1.0/deps/host/host.wit",
        ),
        (
            "worlds-v0.2.0/deps/host-0.1.0/host.wit",
            include_str!("../../../../wit/worlds-v0.2.0/deps/host-0.1.0/host.wit"),
            "v0.1.0/deps/host/host.wit",
        ),
        (
            "worlds-v0.2.0/deps/contracts-0.1.0/contracts.wit",
            include_str!("../../../../wit/worlds-v0.2.0/deps/contracts-0.1.0/contracts.wit"),
            "v0.1.0/contracts.wit",
        ),
        (
            "worlds-v0.2.0/deps/contracts-0.2.0/contracts.wit",
            include_str!("../../../../wit/worlds-v0.2.0/deps/contracts-0.2.0/contracts.wit"),
            "v0.2.0/contracts.wit",
        ),
        (
            "worlds-v0.3.0/deps/host-0.1.0/host.wit",
            include_str!("../../../../wit/worlds-v0.3.0/deps/host-0.1.0/host.wit"),
            "v0.1.0/deps/host/host.wit",
        ),
        (
            "worlds-v0.3.0/deps/host-0.2.0/host.wit",
            include_str!("../../../../wit/worlds-v0.3.0/deps/host-0.2.0/host.wit"),
            "worlds-v0.2.0/deps/host-0.2.0/host.wit",
        ),
        (
            "worlds-v0.3.0/deps/contracts-0.1.0/contracts.wit",
            include_str!("../../../../wit/worlds-v0.3.0/deps/contracts-0.1.0/contracts.wit"),
            "v0.1.0/contracts.wit",
        ),
        (
            "worlds-v0.3.0/deps/contracts-0.2.0/contracts.wit",
            include_str!("../../../../wit/worlds-v0.3.0/deps/contracts-0.2.0/contracts.wit"),
            "v0.2.0/contracts.wit",
        ),
    ];

    /// Every identity fact a contract declares is a scalar field beside a handle of that
    /// kind in one of the contract's records (a misspelt name would silently make every
    /// version the same object), and the kinds whose objects have versions declare them.
    #[test]
    fn declared_identity_facts_are_fields_beside_their_handles() {
        fn siblings(shape: &Shape, out: &mut BTreeMap<String, Vec<String>>) {
            match shape {
                Shape::Record(fields) => {
                    for (_, s, _) in fields {
                        if let Shape::Handle(kind) = s {
                            let scalars = fields.iter().filter(|(_, f, _)| {
                                let f = match f {
                                    Shape::Option(inner) => inner,
                                    f => f,
                                };
                                matches!(
                                    f,
                                    Shape::String | Shape::U64 | Shape::U32 | Shape::Enum(_)
                                )
                            });
                            out.entry(kind.clone())
                                .or_default()
                                .extend(scalars.map(|(n, _, _)| n.clone()));
                        }
                        siblings(s, out);
                    }
                }
                Shape::List(s) | Shape::Option(s) => siblings(s, out),
                Shape::Tuple(items) => items.iter().for_each(|s| siblings(s, out)),
                Shape::Variant(cases) => cases
                    .iter()
                    .flat_map(|(_, s)| s)
                    .for_each(|s| siblings(s, out)),
                Shape::Result { ok, err } => ok.iter().chain(err).for_each(|s| siblings(s, out)),
                _ => {}
            }
        }
        let mut declared = 0;
        for interface in known_contracts() {
            let c = load_contract(&interface).unwrap();
            let mut beside = BTreeMap::new();
            for f in c.functions.values() {
                f.params.iter().for_each(|(_, s)| siblings(s, &mut beside));
                f.result.iter().for_each(|s| siblings(s, &mut beside));
            }
            for (kind, fields) in &beside {
                for fact in c.identity_facts(kind) {
                    assert!(
                        fields.iter().any(|f| f == fact),
                        "{interface} {kind}: {fact} is not a field beside it: {fields:?}"
                    );
                    declared += 1;
                }
            }
        }
        assert_eq!(declared, 2, "source-ref: version; artifact-ref: sha256");
        let delivery = load_contract("airlock:contracts/artifact-delivery@0.2.0").unwrap();
        assert!(delivery.identity_facts("destination-ref").is_empty());
        assert!(delivery.identity_facts("source-ref").is_empty());
    }

    /// The checked-in shapes and derived schemas of every built-in contract function:
    /// conversion and rendering follow the shapes, so equal shapes mean equal results.
    const EXPECTED_SHAPES: &str = "../../tests/expected/builtin-contract-shapes.txt";

    #[test]
    fn built_in_contract_shapes_are_as_recorded() {
        let mut got = String::new();
        let mut interfaces = known_contracts();
        interfaces.sort();
        for interface in interfaces {
            let c = load_contract(&interface).unwrap();
            for f in c.functions.values() {
                got += &format!("{interface}#{}\n", f.name);
                for (name, shape) in &f.params {
                    got += &format!("  param {name}: {shape:?}\n");
                    got += &format!("  schema {}\n", json_schema(shape));
                }
                if let Some(result) = &f.result {
                    got += &format!("  result: {result:?}\n");
                    got += &format!("  schema {}\n", json_schema(result));
                }
            }
        }
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(EXPECTED_SHAPES);
        if std::env::var_os("AIRLOCK_UPDATE_EXPECTED").is_some() {
            std::fs::write(&path, &got).unwrap();
        }
        let expected = std::fs::read_to_string(&path).unwrap();
        assert!(
            got == expected,
            "built-in contract shapes differ from {EXPECTED_SHAPES}:\n{got}"
        );
    }

    #[test]
    fn released_wit_is_frozen_and_its_copies_are_identical() {
        use sha2::Digest as _;
        for (path, text, released) in RELEASED_WIT {
            assert_eq!(
                hex::encode(sha2::Sha256::digest(text.as_bytes())),
                *released,
                "wit/{path} changed after its release: add a new version beside it instead"
            );
        }
        for (path, text, original) in WIT_COPIES {
            let (_, original_text, _) = RELEASED_WIT.iter().find(|(p, ..)| p == original).unwrap();
            assert_eq!(
                text, original_text,
                "wit/{path} must be a byte-identical copy of wit/{original}"
            );
        }
    }

    /// Resolves the released `files` (dependencies first) and checks that each world of
    /// `worlds` exports exactly its contract and imports exactly `imports`.
    fn check_worlds(files: &[&str], worlds: [(&str, &str); 2], imports: &[&str]) {
        let file = |path: &str| RELEASED_WIT.iter().find(|(p, ..)| *p == path).unwrap().1;
        let mut resolve = wit_parser::Resolve::new();
        let mut last = None;
        for path in files {
            last = Some(resolve.push_str(path, file(path)).unwrap());
        }
        let packages = [last.unwrap()];
        for (world, export) in worlds {
            let id = resolve.select_world(&packages, Some(world)).unwrap();
            let w = &resolve.worlds[id];
            let names = |keys: &mut dyn Iterator<Item = &wit_parser::WorldKey>| {
                let mut names: Vec<String> = keys.map(|k| resolve.name_world_key(k)).collect();
                names.sort();
                names
            };
            assert_eq!(names(&mut w.exports.keys()), [export], "{world}");
            assert_eq!(names(&mut w.imports.keys()), imports, "{world}");
        }
    }

    #[test]
    fn the_host_0_3_0_worlds_export_the_released_contracts_unchanged() {
        check_worlds(
            &[
                "v0.1.0/deps/host/host.wit",
                "v0.1.0/contracts.wit",
                "v0.2.0/contracts.wit",
                "worlds-v0.2.0/deps/host-0.2.0/host.wit",
                "worlds-v0.3.0/deps/host-0.3.0/host.wit",
                "worlds-v0.3.0/worlds.wit",
            ],
            [
                (
                    "airlock:worlds/artifact-delivery-adapter@0.3.0",
                    "airlock:contracts/artifact-delivery@0.2.0",
                ),
                (
                    "airlock:worlds/source-retrieval-adapter@0.3.0",
                    "airlock:contracts/source-retrieval@0.1.0",
                ),
            ],
            &[
                "airlock:host/context@0.2.0",
                "airlock:host/log@0.1.0",
                "airlock:host/settings@0.3.0",
                "airlock:host/upstream@0.1.0",
            ],
        );
    }

    #[test]
    fn the_host_0_2_0_worlds_export_the_released_contracts_unchanged() {
        check_worlds(
            &[
                "v0.1.0/deps/host/host.wit",
                "v0.1.0/contracts.wit",
                "v0.2.0/contracts.wit",
                "worlds-v0.2.0/deps/host-0.2.0/host.wit",
                "worlds-v0.2.0/worlds.wit",
            ],
            [
                (
                    "airlock:worlds/artifact-delivery-adapter@0.2.0",
                    "airlock:contracts/artifact-delivery@0.2.0",
                ),
                (
                    "airlock:worlds/source-retrieval-adapter@0.2.0",
                    "airlock:contracts/source-retrieval@0.1.0",
                ),
            ],
            &[
                "airlock:host/context@0.2.0",
                "airlock:host/log@0.1.0",
                "airlock:host/upstream@0.1.0",
            ],
        );
    }

    #[test]
    fn unknown_contract_names_the_known_ones() {
        let err = load_contract("airlock:contracts/export-everything@0.1.0").unwrap_err();
        assert!(err.to_string().contains(SOURCE_RETRIEVAL), "{err}");
    }

    #[test]
    fn strict_conversion_accepts_the_documented_forms() {
        let shape = search_shape();
        let v = json_to_val(&shape, &json!({"query": "wal"}), &mut no_handles).unwrap();
        assert_eq!(
            v,
            Val::Record(vec![
                ("query".into(), Val::String("wal".into())),
                ("limit".into(), Val::Option(None)),
            ])
        );
        // `2.0` is an integer (JSON Schema: a number with a zero fractional part).
        let v = json_to_val(
            &shape,
            &json!({"query": "wal", "limit": 2.0}),
            &mut no_handles,
        )
        .unwrap();
        assert!(matches!(v, Val::Record(f) if f[1].1 == Val::Option(Some(Box::new(Val::U32(2))))));
        // maxLength counts characters, not bytes: MAX_STRING_CHARS four-byte characters fit.
        let wide = "\u{1F600}".repeat(MAX_STRING_CHARS);
        assert_eq!(wide.len(), 4 * MAX_STRING_CHARS);
        assert!(json_to_val(&shape, &json!({"query": wide}), &mut no_handles).is_ok());
        let v = json_to_val(
            &shape,
            &json!({"query": "wal", "limit": 3}),
            &mut no_handles,
        )
        .unwrap();
        assert!(matches!(v, Val::Record(f) if f[1].1 == Val::Option(Some(Box::new(Val::U32(3))))));
    }

    #[test]
    fn hostile_arguments_are_rejected_with_a_path() {
        let shape = search_shape();
        let cases = [
            (json!({"query": "x", "path": "/etc/passwd"}), "/path"),
            (json!({}), "/query"),
            (json!({"query": 7}), "/query"),
            (json!({"query": "x", "limit": -1}), "/limit"),
            (json!({"query": "x", "limit": 1.5}), "/limit"),
            (json!({"query": "x", "limit": 4294967296u64}), "/limit"),
            (json!({"query": "x", "limit": "3"}), "/limit"),
            (json!(["query"]), ""),
            (json!(null), ""),
            (json!({"query": "x", "a/b~c": 1}), "/a~1b~0c"),
            (json!({"query": "x".repeat(MAX_STRING_CHARS + 1)}), "/query"),
            (json!({"query": "é".repeat(MAX_STRING_CHARS + 1)}), "/query"),
            // null is not a string or an integer: the schema says so, and so does this.
            (json!({"query": null}), "/query"),
            (json!({"query": "x", "limit": null}), "/limit"),
            (json!({"query": "x", "limit": 2.5}), "/limit"),
        ];
        for (args, path) in cases {
            let err = json_to_val(&shape, &args, &mut no_handles).unwrap_err();
            assert_eq!(err.path, path, "{args}: {err}");
        }
    }

    #[test]
    fn handles_go_through_the_resolver_both_ways() {
        let c = load_contract(SOURCE_RETRIEVAL).unwrap();
        let shape = &c.functions["retrieve"].params[0].1;
        let mut seen = Vec::new();
        let v = json_to_val(shape, &json!({"reference": "tok"}), &mut |kind, t| {
            seen.push((kind.to_string(), t.to_string()));
            Ok("locator-1".into())
        })
        .unwrap();
        assert_eq!(seen, [("source-ref".to_string(), "tok".to_string())]);
        assert_eq!(
            v,
            Val::Record(vec![("reference".into(), Val::String("locator-1".into()))])
        );
        let err = json_to_val(shape, &json!({"reference": "forged"}), &mut |_, _| {
            Err("reference is not valid in this session".into())
        })
        .unwrap_err();
        assert_eq!(err.path, "/reference");

        let out_shape = c.functions["search"].result.clone().unwrap();
        let val = Val::Result(Ok(Some(Box::new(Val::List(vec![Val::Record(vec![
            ("reference".into(), Val::String("wal-checkpoints".into())),
            ("title".into(), Val::String("WAL".into())),
            ("version".into(), Val::Option(None)),
            (
                "snippet".into(),
                Val::Option(Some(Box::new(Val::String("s".into())))),
            ),
        ])])))));
        let json =
            val_to_json(&out_shape, &val, &mut |_, loc| Ok(format!("tok-for-{loc}"))).unwrap();
        assert_eq!(
            json,
            json!({"ok": [{"reference": "tok-for-wal-checkpoints", "title": "WAL", "snippet": "s"}]})
        );
    }

    #[test]
    fn variants_and_results_round_trip() {
        let c = load_contract(SOURCE_RETRIEVAL).unwrap();
        let Some(Shape::Result { err: Some(err), .. }) = c.functions["search"].result.clone()
        else {
            panic!("search returns a result with an error type");
        };
        let v = json_to_val(&err, &json!("not-found"), &mut no_handles).unwrap();
        assert_eq!(v, Val::Variant("not-found".into(), None));
        let v = json_to_val(&err, &json!({"unavailable": "down"}), &mut no_handles).unwrap();
        let back = val_to_json(&err, &v, &mut |_, l| Ok(l.to_string())).unwrap();
        assert_eq!(back, json!({"unavailable": "down"}));
        assert!(json_to_val(&err, &json!({"unavailable": 1}), &mut no_handles).is_err());
        assert!(json_to_val(&err, &json!("exploded"), &mut no_handles).is_err());
        assert!(json_to_val(&err, &json!({"not-found": "x"}), &mut no_handles).is_err());
    }
}
