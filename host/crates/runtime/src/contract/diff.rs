//! What changed between two versions of a contract package, in the terms a reviewer
//! re-reviews a mapping against: functions, their effect semantics, the arguments the
//! model is asked for, what they return, and handle kinds.
//!
//! Rule: a change is **breaking** when a mapping reviewed against the old version could
//! serve something else under the new one without a person looking again: a function
//! removed, a class or flag changed, a new required argument, an argument removed or of
//! another type, another result, a handle kind removed or identified by other facts. Only
//! additions the old mappings cannot reach (a new function, a new optional argument, a new
//! handle kind) are not. Interfaces are matched by name without their version
//! (`example:workspace/workspace-edits`), since a new version renames every interface.

use std::collections::BTreeSet;

use serde::Serialize;
use serde_json::Value;

use super::package::ContractPackage;
use super::{Contract, ContractFunction, Shape, json_schema};

/// One change between two package versions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Change {
    /// The interface, without its version (`example:workspace/workspace-edits`).
    pub interface: String,
    /// What changed: `function write`, `function write, argument path`, `handle change-ref`.
    pub item: String,
    /// The change, in words (`class read -> external-effect`).
    pub what: String,
    /// Whether a mapping reviewed against the old version must be reviewed again.
    pub breaking: bool,
}

/// The interface name without its `@version`.
fn unversioned(interface: &str) -> &str {
    interface.split('@').next().unwrap_or(interface)
}

/// Every change from `old` to `new`, interface by interface, in name order.
pub fn diff(old: &ContractPackage, new: &ContractPackage) -> Vec<Change> {
    let mut out = Vec::new();
    let names = |p: &ContractPackage| -> BTreeSet<String> {
        p.interfaces
            .keys()
            .map(|k| unversioned(k).to_string())
            .collect()
    };
    let find = |p: &ContractPackage, name: &str| -> Option<std::sync::Arc<Contract>> {
        p.interfaces
            .iter()
            .find(|(k, _)| unversioned(k) == name)
            .map(|(_, c)| c.clone())
    };
    for name in names(old).union(&names(new)) {
        let mut push = |item: String, what: String, breaking: bool| {
            out.push(Change {
                interface: name.clone(),
                item,
                what,
                breaking,
            });
        };
        match (find(old, name), find(new, name)) {
            (Some(_), None) => push("interface".into(), "removed".into(), true),
            (None, Some(_)) => push("interface".into(), "added".into(), false),
            (Some(o), Some(n)) => interface_changes(&o, &n, &mut push),
            (None, None) => {}
        }
    }
    out
}

fn interface_changes(old: &Contract, new: &Contract, push: &mut dyn FnMut(String, String, bool)) {
    if old.docs != new.docs {
        push("interface".into(), "documentation changed".into(), false);
    }
    let names: BTreeSet<&String> = old.functions.keys().chain(new.functions.keys()).collect();
    for name in names {
        let item = format!("function {name}");
        match (old.functions.get(name), new.functions.get(name)) {
            (Some(_), None) => push(item, "removed".into(), true),
            (None, Some(f)) => push(item, format!("added ({})", f.semantics.class), false),
            (Some(o), Some(n)) => function_changes(&item, o, n, push),
            (None, None) => {}
        }
    }
    let kinds: BTreeSet<&String> = old.handles.keys().chain(new.handles.keys()).collect();
    for kind in kinds {
        let item = format!("handle {kind}");
        match (old.handles.get(kind), new.handles.get(kind)) {
            (Some(_), None) => push(item, "removed".into(), true),
            (None, Some(_)) => push(item, "added".into(), false),
            (Some(o), Some(n)) if o.identity != n.identity => push(
                item,
                format!(
                    "identified by [{}] -> [{}]",
                    o.identity.join(", "),
                    n.identity.join(", ")
                ),
                true,
            ),
            _ => {}
        }
    }
}

fn function_changes(
    item: &str,
    old: &ContractFunction,
    new: &ContractFunction,
    push: &mut dyn FnMut(String, String, bool),
) {
    let (o, n) = (old.semantics, new.semantics);
    if o.class != n.class {
        let rank = |c| super::EffectClass::ALL.iter().position(|x| *x == c);
        let how = if rank(n.class) > rank(o.class) {
            "more consequential"
        } else {
            "narrowed"
        };
        push(
            item.to_string(),
            format!("class {} -> {} ({how})", o.class, n.class),
            true,
        );
    }
    for (flag, was, is) in [
        ("idempotent", o.idempotent, n.idempotent),
        ("host-only", o.host_only, n.host_only),
    ] {
        if was != is {
            push(item.to_string(), format!("{flag} {was} -> {is}"), true);
        }
    }
    for (key, was, is) in [
        ("queryable-by", &old.query, &new.query),
        ("compensable-by", &old.undo, &new.undo),
    ] {
        if was != is {
            let show = |v: &Option<String>| v.clone().unwrap_or_else(|| "none".into());
            push(
                item.to_string(),
                format!("{key} {} -> {}", show(was), show(is)),
                true,
            );
        }
    }
    argument_changes(item, old, new, push);
    let result = |f: &ContractFunction| f.result.as_ref().map(without_docs);
    if result(old) != result(new) {
        let schema = |f: &ContractFunction| f.result.as_ref().map(json_schema);
        push(
            item.to_string(),
            format!(
                "result {} -> {}",
                compact(schema(old)),
                compact(schema(new))
            ),
            true,
        );
    }
}

/// Changes to what the model is asked for: the fields of the one record parameter
/// (host-supplied fields are the host's and listed as such), or the parameters as a
/// whole when the function does not take one record.
fn argument_changes(
    item: &str,
    old: &ContractFunction,
    new: &ContractFunction,
    push: &mut dyn FnMut(String, String, bool),
) {
    let fields = |f: &ContractFunction| match f.params.as_slice() {
        [(_, Shape::Record(fields))] => Some(fields.clone()),
        _ => None,
    };
    let (Some(of), Some(nf)) = (fields(old), fields(new)) else {
        if old.params != new.params {
            push(item.to_string(), "parameters changed".into(), true);
        }
        return;
    };
    let names: BTreeSet<&String> = of.iter().chain(&nf).map(|(n, _, _)| n).collect();
    for name in names {
        let get = |fs: &[(String, Shape, Option<String>)]| {
            fs.iter()
                .find(|(n, _, _)| n == name)
                .map(|(_, s, doc)| Shape::Record(vec![(String::new(), s.clone(), doc.clone())]))
        };
        let here = format!("{item}, argument {name}");
        // Each field as a one-field record, so its doc is compared with its shape.
        let inner = |s: &Shape| match s {
            Shape::Record(f) => f[0].1.clone(),
            other => other.clone(),
        };
        match (get(&of), get(&nf)) {
            (Some(_), None) => push(here, "removed".into(), true),
            (None, Some(s)) if matches!(inner(&s), Shape::HostSupplied(_)) => {
                push(here, "added, host-supplied".into(), true);
            }
            (None, Some(s)) if !matches!(inner(&s), Shape::Option(_)) => {
                push(here, "added, required".into(), true);
            }
            (None, Some(_)) => push(here, "added, optional".into(), false),
            (Some(a), Some(b)) if without_docs(&a) != without_docs(&b) => push(
                here,
                format!(
                    "{} -> {}",
                    compact(Some(json_schema(&inner(&a)))),
                    compact(Some(json_schema(&inner(&b))))
                ),
                true,
            ),
            (Some(a), Some(b)) if a != b => push(
                here,
                "description changed (what the model reads about it)".into(),
                false,
            ),
            _ => {}
        }
    }
}

/// `shape` with every record field's doc removed: what a value is, not what it says.
fn without_docs(shape: &Shape) -> Shape {
    let boxed = |s: &Shape| Box::new(without_docs(s));
    match shape {
        Shape::Record(fields) => Shape::Record(
            fields
                .iter()
                .map(|(n, s, _)| (n.clone(), without_docs(s), None))
                .collect(),
        ),
        Shape::List(s) => Shape::List(boxed(s)),
        Shape::Option(s) => Shape::Option(boxed(s)),
        Shape::Tuple(items) => Shape::Tuple(items.iter().map(without_docs).collect()),
        Shape::Variant(cases) => Shape::Variant(
            cases
                .iter()
                .map(|(n, s)| (n.clone(), s.as_ref().map(without_docs)))
                .collect(),
        ),
        Shape::Result { ok, err } => Shape::Result {
            ok: ok.as_deref().map(boxed),
            err: err.as_deref().map(boxed),
        },
        other => other.clone(),
    }
}

/// A schema as one short line (at most 160 characters).
fn compact(schema: Option<Value>) -> String {
    let text = schema.map_or_else(|| "nothing".to_string(), |s| s.to_string());
    if text.chars().count() > 160 {
        text.chars().take(157).collect::<String>() + "..."
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::package::{PackageFiles, SIDECAR, load};

    const WIT: &str = r#"package example:workspace@VERSION;

interface workspace-edits {
    type change-ref = string;
    type idempotency-key = string;
    record write-request {
        path: string,
        content: string,
        idempotency-key: idempotency-key,
    }
    record change {
        change: change-ref,
        after-sha256: string,
    }
    record written-request {
        idempotency-key: idempotency-key,
    }
    variant contract-error {
        invalid-request(string),
        unavailable(string),
    }
    write: func(request: write-request) -> result<change, contract-error>;
    written: func(request: written-request) -> result<option<change>, contract-error>;
}
"#;

    const SIDECAR_TEXT: &str = r#"format = 1
package = "example:workspace@VERSION"

[interfaces.workspace-edits.handles]
change-ref = { identity = ["after-sha256"] }

[interfaces.workspace-edits.host-supplied]
idempotency-key = "intent-idempotency-key"

[interfaces.workspace-edits.functions]
write = { class = "reversible-mutation", idempotent = true, queryable-by = "written" }
written = { class = "read", idempotent = true, host-only = true }
"#;

    fn package(version: &str, wit: &str, sidecar: &str) -> ContractPackage {
        let wit = wit.replace("VERSION", version);
        let sidecar = sidecar.replace("VERSION", version);
        load(
            &PackageFiles::new(
                "pkg",
                [(SIDECAR, sidecar.as_str()), ("w.wit", wit.as_str())],
            )
            .unwrap(),
        )
        .unwrap()
    }

    fn changes(wit: &str, sidecar: &str) -> Vec<(String, String, bool)> {
        diff(
            &package("1.0.0", WIT, SIDECAR_TEXT),
            &package("1.1.0", wit, sidecar),
        )
        .into_iter()
        .map(|c| (c.item, c.what, c.breaking))
        .collect()
    }

    #[test]
    fn the_same_package_under_a_new_version_has_no_changes() {
        assert_eq!(changes(WIT, SIDECAR_TEXT), []);
    }

    #[test]
    fn a_changed_description_is_shown_and_not_breaking() {
        let c = changes(
            &WIT.replace(
                "interface workspace-edits {",
                "/// Edits.\ninterface workspace-edits {",
            )
            .replace("path: string,", "/// The file.\n        path: string,"),
            SIDECAR_TEXT,
        );
        assert_eq!(
            c,
            [
                ("interface".into(), "documentation changed".into(), false),
                (
                    "function write, argument path".into(),
                    "description changed (what the model reads about it)".into(),
                    false
                ),
            ]
        );
    }

    #[test]
    fn each_kind_of_change_is_named_and_judged() {
        let c = changes(
            WIT,
            &SIDECAR_TEXT.replace(
                "write = { class = \"reversible-mutation\"",
                "write = { class = \"external-effect\"",
            ),
        );
        assert_eq!(
            c,
            [(
                "function write".to_string(),
                "class reversible-mutation -> external-effect (more consequential)".to_string(),
                true
            )]
        );
        let c = changes(
            &WIT.replace(
                "content: string,",
                "content: string,\n        mode: u32,\n        note: option<string>,",
            ),
            SIDECAR_TEXT,
        );
        assert_eq!(
            c,
            [
                (
                    "function write, argument mode".into(),
                    "added, required".into(),
                    true
                ),
                (
                    "function write, argument note".into(),
                    "added, optional".into(),
                    false
                ),
            ]
        );
        let c = changes(
            &WIT.replace("path: string,", "path: list<string>,"),
            SIDECAR_TEXT,
        );
        assert_eq!(c.len(), 1);
        assert!(c[0].0 == "function write, argument path" && c[0].2, "{c:?}");
        let c = changes(
            WIT,
            &SIDECAR_TEXT.replace("identity = [\"after-sha256\"]", "identity = []"),
        );
        assert_eq!(
            c,
            [(
                "handle change-ref".into(),
                "identified by [after-sha256] -> []".into(),
                true
            )]
        );
        let c = changes(
            WIT,
            &SIDECAR_TEXT.replace(
                "idempotent = true, queryable-by",
                "idempotent = false, queryable-by",
            ),
        );
        assert_eq!(
            c,
            [(
                "function write".into(),
                "idempotent true -> false".into(),
                true
            )]
        );
        let c = changes(
            &WIT.replace(
                "after-sha256: string,",
                "after-sha256: string,\n        bytes: u64,",
            ),
            SIDECAR_TEXT,
        );
        assert!(
            c.iter()
                .any(|(i, w, b)| i == "function write" && w.starts_with("result") && *b),
            "{c:?}"
        );
    }
}
