//! Skeletons: the Rust an adapter of a contract package implements, as `wit-bindgen`
//! names it — for `airlock new` on any package, built in or an operator's.
//!
//! Rule: every name follows `wit-bindgen`'s Rust generator (0.61): a package
//! `ns:name@v` exports its interface `i` at `bindings::exports::ns::name::i` (each part in
//! snake case); a function is its snake-case name; a named type (record, variant, enum,
//! flags, and an alias such as `type change-ref = string`) is its upper camel case name in
//! that module, also when it is `use`d from another interface; a field or parameter that
//! is a Rust keyword gets `_` appended. Anonymous types are written out (`Option<T>`,
//! `Vec<T>`, `Result<T, E>`, tuples). Only worlds that export exactly one interface of the
//! package are offered (an adapter serves one contract interface).

use anyhow::{Result, bail};
use wit_parser::{Handle, Resolve, Type, TypeDefKind, TypeId, WorldItem, WorldKey};

use super::package::{ContractPackage, PackageFiles, resolve_wit};

/// One contract interface an adapter may implement, with the world that exports it.
#[derive(Debug, Clone, PartialEq)]
pub struct Skeleton {
    /// The world the adapter targets, as `wit_bindgen::generate!`'s `world` names it
    /// (`example:workspace-edits/workspace-edits-adapter@1.0.0`).
    pub world: String,
    /// The exported interface, fully qualified (the mapping's `contract`).
    pub interface: String,
    /// The module of its `Guest` trait and types (`exports::example::workspace_edits::
    /// workspace_edits`), under the adapter's `bindings` module.
    pub module: String,
    /// Every function, in WIT order.
    pub functions: Vec<FunctionSkeleton>,
    /// The named types the signatures use, sorted (for the `use` line).
    pub types: Vec<String>,
    /// The host interfaces the world imports, fully qualified
    /// (`airlock:host/upstream@0.1.0`).
    pub imports: Vec<String>,
}

/// One function, as the `Guest` trait declares it.
#[derive(Debug, Clone, PartialEq)]
pub struct FunctionSkeleton {
    /// The WIT name (`list-destinations`).
    pub wit_name: String,
    /// The Rust name (`list_destinations`).
    pub rust_name: String,
    /// Each parameter: Rust name, Rust type.
    pub params: Vec<(String, String)>,
    /// The Rust return type (`()` for none).
    pub result: String,
    /// A Rust expression of each parameter's type (empty strings, zeros, `None`, first
    /// cases), for a test that calls the function.
    pub example_args: Vec<String>,
    /// A Rust expression of the function's error that carries a message `MESSAGE`
    /// (replace it), when the function returns `result<_, E>` and `E` is a string or a
    /// variant with a string case (preferring `upstream-failed`, then `unavailable`).
    pub error_with_message: Option<String>,
}

/// The skeletons of `package` (loaded from `files`): one per world exporting exactly one
/// of its interfaces, worlds in name order.
///
/// # Errors
/// The WIT does not parse (it loaded before, so only if `files` changed), or no world
/// of the package exports one of its interfaces.
pub fn skeletons(files: &PackageFiles, package: &ContractPackage) -> Result<Vec<Skeleton>> {
    let (resolve, root) = resolve_wit(files)?;
    let pkg = &resolve.packages[root];
    let mut out = Vec::new();
    for (_, &world_id) in &pkg.worlds {
        let world = &resolve.worlds[world_id];
        let exported: Vec<_> = world
            .exports
            .iter()
            .filter_map(|(_, item)| match item {
                WorldItem::Interface { id, .. } => Some(*id),
                _ => None,
            })
            .collect();
        let [iface] = exported.as_slice() else {
            continue;
        };
        let Some(qualified) = resolve.id_of(*iface) else {
            continue;
        };
        if !package.interfaces.contains_key(&qualified) {
            continue;
        }
        let interface = &resolve.interfaces[*iface];
        let name = &pkg.name;
        let module = format!(
            "exports::{}::{}::{}",
            snake(&name.namespace),
            snake(&name.name),
            snake(interface.name.as_deref().unwrap_or_default())
        );
        let mut types = std::collections::BTreeSet::new();
        let functions = interface
            .functions
            .values()
            .map(|f| {
                let params: Vec<(String, String)> = f
                    .params
                    .iter()
                    .map(|p| (field(&p.name), rust_type(&resolve, &p.ty, &mut types)))
                    .collect();
                let result = f
                    .result
                    .as_ref()
                    .map_or("()".to_string(), |t| rust_type(&resolve, t, &mut types));
                FunctionSkeleton {
                    wit_name: f.name.clone(),
                    // wit-bindgen escapes a keyword function name as it does a field.
                    rust_name: field(&f.name),
                    example_args: f
                        .params
                        .iter()
                        .map(|p| example(&resolve, &p.ty, 0, &mut types))
                        .collect(),
                    error_with_message: f.result.as_ref().and_then(|t| error_of(&resolve, t)),
                    params,
                    result,
                }
            })
            .collect();
        let imports = world
            .imports
            .iter()
            .filter_map(|(key, item)| match (key, item) {
                (WorldKey::Interface(id), WorldItem::Interface { .. }) => resolve.id_of(*id),
                _ => None,
            })
            .collect();
        out.push(Skeleton {
            world: format!(
                "{}:{}/{}{}",
                name.namespace,
                name.name,
                world.name,
                name.version
                    .as_ref()
                    .map(|v| format!("@{v}"))
                    .unwrap_or_default()
            ),
            interface: qualified,
            module,
            functions,
            types: types.into_iter().collect(),
            imports,
        });
    }
    if out.is_empty() {
        bail!(
            "{}: no world of package {} exports exactly one of its contract interfaces; add one (e.g. `world x-adapter {{ include airlock:host/adapter-host@0.1.0; export x; }}`)",
            files.origin(),
            package.name
        );
    }
    out.sort_by(|a, b| a.world.cmp(&b.world));
    Ok(out)
}

/// `list-destinations` → `list_destinations`.
fn snake(name: &str) -> String {
    name.replace('-', "_")
}

/// `write-request` → `WriteRequest`.
pub fn upper_camel(name: &str) -> String {
    name.split('-')
        .map(|part| {
            let mut c = part.chars();
            c.next()
                .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                .unwrap_or_default()
        })
        .collect()
}

/// A field or parameter name as `wit-bindgen` writes it: snake case, a Rust keyword with
/// `_` appended.
fn field(name: &str) -> String {
    const KEYWORDS: &[&str] = &[
        "as", "async", "await", "break", "const", "continue", "crate", "dyn", "else", "enum",
        "extern", "false", "fn", "for", "if", "impl", "in", "let", "loop", "match", "mod", "move",
        "mut", "pub", "ref", "return", "self", "static", "struct", "super", "trait", "true",
        "type", "unsafe", "use", "where", "while", "abstract", "become", "box", "do", "final",
        "macro", "override", "priv", "typeof", "unsized", "virtual", "yield", "try", "gen",
    ];
    let s = snake(name);
    if KEYWORDS.contains(&s.as_str()) {
        format!("{s}_")
    } else {
        s
    }
}

/// The Rust type of `ty`, recording the named types it uses in `named`.
fn rust_type(
    resolve: &Resolve,
    ty: &Type,
    named: &mut std::collections::BTreeSet<String>,
) -> String {
    match ty {
        Type::Bool => "bool".into(),
        Type::U8 => "u8".into(),
        Type::U16 => "u16".into(),
        Type::U32 => "u32".into(),
        Type::U64 => "u64".into(),
        Type::S8 => "i8".into(),
        Type::S16 => "i16".into(),
        Type::S32 => "i32".into(),
        Type::S64 => "i64".into(),
        Type::F32 => "f32".into(),
        Type::F64 => "f64".into(),
        Type::Char => "char".into(),
        Type::String => "String".into(),
        Type::ErrorContext => "ErrorContext".into(),
        Type::Id(id) => typedef(resolve, *id, named),
    }
}

fn typedef(
    resolve: &Resolve,
    id: TypeId,
    named: &mut std::collections::BTreeSet<String>,
) -> String {
    let def = &resolve.types[id];
    if let Some(name) = &def.name {
        let n = upper_camel(name);
        named.insert(n.clone());
        return n;
    }
    match &def.kind {
        TypeDefKind::Option(t) => format!("Option<{}>", rust_type(resolve, t, named)),
        TypeDefKind::List(t) => format!("Vec<{}>", rust_type(resolve, t, named)),
        TypeDefKind::Result(r) => format!(
            "Result<{}, {}>",
            r.ok.as_ref()
                .map_or("()".into(), |t| rust_type(resolve, t, named)),
            r.err
                .as_ref()
                .map_or("()".into(), |t| rust_type(resolve, t, named))
        ),
        TypeDefKind::Tuple(t) => {
            let items: Vec<String> = t
                .types
                .iter()
                .map(|t| rust_type(resolve, t, named))
                .collect();
            if items.len() == 1 {
                format!("({},)", items[0])
            } else {
                format!("({})", items.join(", "))
            }
        }
        TypeDefKind::Type(t) => rust_type(resolve, t, named),
        // The contract loader refuses the rest (resources, futures, streams, maps).
        _ => "()".into(),
    }
}

/// Deepest nesting [`example`] writes out before it stops (contracts allow 32).
const EXAMPLE_DEPTH: usize = 40;

/// A Rust expression of type `ty`: empty, zero, `None`, the first case; the named types
/// it writes out are added to `named` (the `use` line imports them).
fn example(
    resolve: &Resolve,
    ty: &Type,
    depth: usize,
    named: &mut std::collections::BTreeSet<String>,
) -> String {
    match ty {
        Type::Bool => "false".into(),
        Type::U8
        | Type::U16
        | Type::U32
        | Type::U64
        | Type::S8
        | Type::S16
        | Type::S32
        | Type::S64 => "0".into(),
        Type::F32 | Type::F64 => "0.0".into(),
        Type::Char => "'a'".into(),
        Type::String => "String::new()".into(),
        Type::ErrorContext => "unreachable!()".into(),
        Type::Id(id) if depth < EXAMPLE_DEPTH => {
            let def = &resolve.types[*id];
            let name = def.name.as_deref().map(upper_camel);
            if let Some(n) = &name
                && matches!(
                    def.kind,
                    TypeDefKind::Record(_)
                        | TypeDefKind::Variant(_)
                        | TypeDefKind::Enum(_)
                        | TypeDefKind::Flags(_)
                )
            {
                named.insert(n.clone());
            }
            match &def.kind {
                TypeDefKind::Record(r) => format!(
                    "{} {{ {} }}",
                    name.unwrap_or_default(),
                    r.fields
                        .iter()
                        .map(|f| format!(
                            "{}: {}",
                            field(&f.name),
                            example(resolve, &f.ty, depth + 1, named)
                        ))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                TypeDefKind::Variant(v) => match v.cases.first() {
                    Some(c) => match &c.ty {
                        Some(t) => format!(
                            "{}::{}({})",
                            name.unwrap_or_default(),
                            upper_camel(&c.name),
                            example(resolve, t, depth + 1, named)
                        ),
                        None => format!("{}::{}", name.unwrap_or_default(), upper_camel(&c.name)),
                    },
                    None => "unreachable!()".into(),
                },
                TypeDefKind::Enum(e) => match e.cases.first() {
                    Some(c) => format!("{}::{}", name.unwrap_or_default(), upper_camel(&c.name)),
                    None => "unreachable!()".into(),
                },
                TypeDefKind::Flags(_) => format!("{}::empty()", name.unwrap_or_default()),
                TypeDefKind::Option(_) => "None".into(),
                TypeDefKind::List(_) => "Vec::new()".into(),
                TypeDefKind::Tuple(t) => format!(
                    "({}{})",
                    t.types
                        .iter()
                        .map(|t| example(resolve, t, depth + 1, named))
                        .collect::<Vec<_>>()
                        .join(", "),
                    if t.types.len() == 1 { "," } else { "" }
                ),
                TypeDefKind::Result(r) => format!(
                    "Ok({})",
                    r.ok.as_ref()
                        .map_or("()".into(), |t| example(resolve, t, depth + 1, named))
                ),
                TypeDefKind::Type(t) => example(resolve, t, depth + 1, named),
                TypeDefKind::Handle(Handle::Own(_) | Handle::Borrow(_)) => "unreachable!()".into(),
                _ => "unreachable!()".into(),
            }
        }
        Type::Id(_) => "unreachable!()".into(),
    }
}

/// The error expression of a `result<_, E>` type: see
/// [`FunctionSkeleton::error_with_message`].
fn error_of(resolve: &Resolve, ty: &Type) -> Option<String> {
    let Type::Id(id) = ty else { return None };
    let TypeDefKind::Result(r) = &resolve.types[*id].kind else {
        return None;
    };
    let mut err = r.err?;
    // Follow aliases to the definition, keeping the first name met (the one in scope).
    let mut name: Option<String> = None;
    loop {
        match err {
            Type::String => return Some("MESSAGE.into()".into()),
            Type::Id(id) => {
                let def = &resolve.types[id];
                if name.is_none() {
                    name = def.name.as_deref().map(upper_camel);
                }
                match &def.kind {
                    TypeDefKind::Type(t) => err = *t,
                    TypeDefKind::Variant(v) => {
                        let takes_text = |c: &&wit_parser::Case| matches!(c.ty, Some(t) if is_string(resolve, t));
                        let case = ["upstream-failed", "unavailable"]
                            .iter()
                            .find_map(|n| v.cases.iter().filter(takes_text).find(|c| c.name == *n))
                            .or_else(|| v.cases.iter().find(takes_text))?;
                        return Some(format!(
                            "{}::{}(MESSAGE.into())",
                            name?,
                            upper_camel(&case.name)
                        ));
                    }
                    _ => return None,
                }
            }
            _ => return None,
        }
    }
}

/// Whether `ty` is `string`, through aliases.
fn is_string(resolve: &Resolve, ty: Type) -> bool {
    match ty {
        Type::String => true,
        Type::Id(id) => match &resolve.types[id].kind {
            TypeDefKind::Type(t) => is_string(resolve, *t),
            _ => false,
        },
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::package::{self, PackageFiles};

    fn workspace_edits() -> (PackageFiles, ContractPackage) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../contracts/workspace-edits");
        let files = PackageFiles::read_dir(&dir).unwrap();
        let loaded = package::load(&files).unwrap();
        (files, loaded)
    }

    #[test]
    fn an_operator_package_gets_the_names_wit_bindgen_gives_it() {
        let (files, loaded) = workspace_edits();
        let s = skeletons(&files, &loaded).unwrap();
        assert_eq!(s.len(), 1);
        let s = &s[0];
        assert_eq!(
            s.world,
            "example:workspace-edits/workspace-edits-adapter@1.0.0"
        );
        assert_eq!(s.interface, "example:workspace-edits/workspace-edits@1.0.0");
        assert_eq!(
            s.module,
            "exports::example::workspace_edits::workspace_edits"
        );
        assert_eq!(
            s.imports,
            ["airlock:host/upstream@0.1.0", "airlock:host/log@0.1.0"]
        );
        let write = &s.functions[0];
        assert_eq!(write.rust_name, "write");
        assert_eq!(write.params, [("request".into(), "WriteRequest".into())]);
        assert_eq!(write.result, "Result<Change, ContractError>");
        assert_eq!(
            write.example_args,
            [
                "WriteRequest { path: String::new(), content: String::new(), idempotency_key: String::new() }"
            ]
        );
        assert_eq!(
            write.error_with_message.as_deref(),
            Some("ContractError::UpstreamFailed(MESSAGE.into())")
        );
        let written = &s.functions[1];
        assert_eq!(written.result, "Result<Option<Change>, ContractError>");
        assert_eq!(
            s.types,
            [
                "Change",
                "ContractError",
                "RestoreRequest",
                "WriteRequest",
                "WrittenRequest"
            ]
        );
    }

    #[test]
    fn the_built_in_packages_have_skeletons_too() {
        for p in crate::contract::Contracts::built_in().packages() {
            let s = skeletons(&p.files, p).unwrap();
            assert!(!s.is_empty(), "{}", p.name);
            for f in s.iter().flat_map(|s| &s.functions) {
                assert!(f.error_with_message.is_some(), "{}: {}", p.name, f.wit_name);
            }
        }
    }

    #[test]
    fn keywords_names_and_nesting_are_written_as_rust() {
        assert_eq!(field("type"), "type_");
        assert_eq!(field("media-type"), "media_type");
        assert_eq!(upper_camel("contract-error"), "ContractError");
        assert_eq!(upper_camel("a"), "A");
    }

    /// A package with a function named by a Rust keyword (`match`), `type` fields, a
    /// record inside an option inside a list, a record directly in a request, and a
    /// variant error with no string case: the skeleton names what wit-bindgen 0.61
    /// generates (`match_`), and imports every named type its example arguments write,
    /// so the generated crate and its test compile.
    #[test]
    fn keyword_functions_and_nested_records_are_named_and_imported_as_wit_bindgen_does() {
        let wit = r#"package example:odd@1.0.0;

interface odd {
    record item {
        %type: string,
        tag: option<string>,
    }

    record match-request {
        items: list<option<item>>,
        inner: item,
        %type: u32,
    }

    record found {
        count: u32,
    }

    variant odd-error {
        not-found,
        busy(u32),
    }

    %match: func(request: match-request) -> result<found, string>;

    other: func(request: match-request) -> result<found, odd-error>;
}

world odd-adapter {
    export odd;
}
"#;
        let sidecar = "format = 1\npackage = \"example:odd@1.0.0\"\n\n[interfaces.odd.functions]\nmatch = { class = \"read\", idempotent = true }\nother = { class = \"read\", idempotent = true }\n";
        let files =
            PackageFiles::new("pkg", [(package::SIDECAR, sidecar), ("odd.wit", wit)]).unwrap();
        let loaded = package::load(&files).unwrap();
        let s = &skeletons(&files, &loaded).unwrap()[0];
        let [find, other] = s.functions.as_slice() else {
            panic!("{:?}", s.functions)
        };
        assert_eq!(find.wit_name, "match");
        assert_eq!(
            find.rust_name, "match_",
            "wit-bindgen escapes a keyword function"
        );
        assert_eq!(
            find.params,
            [("request".to_string(), "MatchRequest".to_string())]
        );
        assert_eq!(
            find.example_args,
            [
                "MatchRequest { items: Vec::new(), inner: Item { type_: String::new(), tag: None }, type_: 0 }"
            ]
        );
        assert!(
            s.types.contains(&"Item".to_string()),
            "the test writes `Item {{ .. }}`, so it is imported: {:?}",
            s.types
        );
        assert_eq!(find.error_with_message.as_deref(), Some("MESSAGE.into()"));
        // No string case: no error with a message (the generated function panics, saying so).
        assert_eq!(other.error_with_message, None);
    }
}
