//! Contract packages: a good one loads with everything it declares; each hostile one is
//! refused with the file, the line and what to do.

use super::*;
use crate::contract::{Contracts, EffectClass, Shape};

/// A small operator package: a reversible workspace write, its reconciliation query and
/// its undo.
const WIT: &str = r#"package example:workspace@1.0.0;

/// Edits files in a workspace.
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
        path: string,
        after-sha256: string,
    }

    record written-request {
        idempotency-key: idempotency-key,
    }

    record restore-request {
        change: change-ref,
        idempotency-key: idempotency-key,
    }

    variant contract-error {
        invalid-request(string),
        not-found,
        unavailable(string),
    }

    write: func(request: write-request) -> result<change, contract-error>;
    written: func(request: written-request) -> result<option<change>, contract-error>;
    restore: func(request: restore-request) -> result<change, contract-error>;
}
"#;

const SIDECAR_TEXT: &str = r#"format = 1
package = "example:workspace@1.0.0"

[interfaces.workspace-edits.handles]
change-ref = { identity = ["after-sha256"] }

[interfaces.workspace-edits.host-supplied]
idempotency-key = "intent-idempotency-key"

[interfaces.workspace-edits.functions]
write = { class = "reversible-mutation", idempotent = true, queryable-by = "written", compensable-by = "restore" }
written = { class = "read", idempotent = true, host-only = true }
restore = { class = "reversible-mutation", idempotent = true }
"#;

const IFACE: &str = "example:workspace/workspace-edits@1.0.0";

fn files(sidecar: &str, wit: &str) -> PackageFiles {
    PackageFiles::new("pkg", [(SIDECAR, sidecar), ("edits.wit", wit)]).unwrap()
}

fn load_err(sidecar: &str, wit: &str) -> String {
    match load(&files(sidecar, wit)) {
        Ok(_) => panic!("loaded:\n{sidecar}\n{wit}"),
        Err(e) => format!("{e:#}"),
    }
}

/// `load_err` after replacing `from` with `to` in the sidecar (`in_wit` false) or the
/// WIT, asserting the replacement happened.
fn refused(in_wit: bool, from: &str, to: &str) -> String {
    let (mut sidecar, mut wit) = (SIDECAR_TEXT.to_string(), WIT.to_string());
    let target = if in_wit { &mut wit } else { &mut sidecar };
    assert!(target.contains(from), "`{from}` is not in the base package");
    *target = target.replacen(from, to, 1);
    load_err(&sidecar, &wit)
}

fn assert_has(err: &str, needles: &[&str]) {
    for n in needles {
        assert!(err.contains(n), "expected `{n}` in:\n{err}");
    }
}

#[test]
fn an_operator_package_loads_with_what_it_declares() {
    let p = load(&files(SIDECAR_TEXT, WIT)).unwrap();
    assert_eq!(p.name, "example:workspace@1.0.0");
    assert_eq!(p.digest.len(), 64);
    let c = &p.interfaces[IFACE];
    let write = &c.functions["write"];
    assert_eq!(write.semantics.class, EffectClass::ReversibleMutation);
    assert!(write.semantics.idempotent && write.semantics.queryable);
    assert!(write.semantics.compensable && !write.semantics.host_only);
    assert_eq!(write.query.as_deref(), Some("written"));
    assert_eq!(write.undo.as_deref(), Some("restore"));
    assert!(c.functions["written"].semantics.host_only);
    let h = &c.handles["change-ref"];
    assert_eq!(h.identity, ["after-sha256"]);
    assert_eq!(h.minted_by, ["restore", "write", "written"]);
    assert_eq!(h.consumed_by, ["restore"]);
    // The declared host-supplied alias is host-supplied, by declaration, in the request.
    let Shape::Record(fields) = &write.params[0].1 else {
        panic!("a record")
    };
    assert_eq!(
        fields[2].1,
        Shape::HostSupplied("idempotency-key".into()),
        "{fields:?}"
    );
    assert_eq!(c.most_consequential(), EffectClass::ReversibleMutation);
    assert_eq!(c.docs.as_deref(), Some("Edits files in a workspace."));
}

#[test]
fn the_digest_covers_the_wit_and_the_sidecar_together() {
    let base = files(SIDECAR_TEXT, WIT).digest();
    assert_eq!(base, files(SIDECAR_TEXT, WIT).digest(), "deterministic");
    let sidecar = SIDECAR_TEXT.replace(
        "idempotent = true, host-only",
        "idempotent = true,  host-only",
    );
    assert_ne!(base, files(&sidecar, WIT).digest(), "a sidecar byte");
    assert_ne!(
        base,
        files(SIDECAR_TEXT, &WIT.replace("Edits", "edits")).digest(),
        "a WIT byte"
    );
    let renamed = PackageFiles::new("pkg", [(SIDECAR, SIDECAR_TEXT), ("other.wit", WIT)]).unwrap();
    assert_ne!(base, renamed.digest(), "a file renamed");
}

/// Each file's length is in the digest: without it, one file whose text holds the next
/// file's header would hash like the two files.
#[test]
fn the_digest_tells_one_file_from_two_that_concatenate_alike() {
    let two = PackageFiles::new("pkg", [("a.wit", "P"), ("b.wit", "Q")]).unwrap();
    let one = PackageFiles::new("pkg", [("a.wit", "Pb.wit\nQ")]).unwrap();
    assert_ne!(two.digest(), one.digest());
    let one = PackageFiles::new("pkg", [("a.wit", "P\nb.wit\n1\nQ")]).unwrap();
    assert_ne!(two.digest(), one.digest());
}

#[test]
fn the_built_in_packages_load_through_the_same_path() {
    let c = Contracts::built_in();
    let names: Vec<&str> = c.packages().iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
        ["airlock:contracts@0.1.0", "airlock:contracts@0.2.0"]
    );
    let delivery = c.get("airlock:contracts/artifact-delivery@0.2.0").unwrap();
    assert_eq!(delivery.query_function("deliver"), Some("query"));
    assert_eq!(delivery.most_consequential(), EffectClass::ExternalEffect);
    assert_eq!(
        delivery.handles["destination-ref"].minted_by,
        ["deliver", "list-destinations", "query"]
    );
    let retrieval = c.get("airlock:contracts/source-retrieval@0.1.0").unwrap();
    assert_eq!(retrieval.identity_facts("source-ref"), ["version"]);
    assert_eq!(retrieval.most_consequential(), EffectClass::Read);
    let err = c.get("example:nothing/here@1.0.0").unwrap_err().to_string();
    assert_has(
        &err,
        &[
            "unknown contract",
            "airlock:contracts/source-retrieval@0.1.0",
        ],
    );
}

#[test]
fn a_released_name_with_another_digest_is_refused_naming_both() {
    let mut c = Contracts::default();
    c.add(load(&files(SIDECAR_TEXT, WIT)).unwrap()).unwrap();
    let first = files(SIDECAR_TEXT, WIT).digest();
    let changed = load(&files(SIDECAR_TEXT, &WIT.replace("Edits", "Changes"))).unwrap();
    let second = changed.digest.clone();
    let err = c.add(changed).unwrap_err().to_string();
    assert_has(
        &err,
        &[&first, &second, "example:workspace@1.0.0", "new version"],
    );
    let err = c
        .add(load(&files(SIDECAR_TEXT, WIT)).unwrap())
        .unwrap_err()
        .to_string();
    assert_has(&err, &["loaded twice"]);
    assert_eq!(c.interfaces(), [IFACE]);
}

#[test]
fn a_sidecar_that_is_not_the_form_is_refused_with_its_line() {
    assert_has(
        &load_err("", WIT),
        &["pkg/contract.toml", "missing field `format`"],
    );
    assert_has(
        &refused(false, "format = 1", "format = 1\ncolour = \"red\""),
        &["pkg/contract.toml", "line 2", "unknown field `colour`"],
    );
    assert_has(
        &refused(
            false,
            "idempotent = true, host-only",
            "idempotent = true, hostonly",
        ),
        &["pkg/contract.toml", "line 12", "unknown field `hostonly`"],
    );
    assert_has(
        &refused(false, "format = 1", "format = 2"),
        &["pkg/contract.toml:1", "format 2", "format = 1"],
    );
    assert_has(
        &refused(
            false,
            "package = \"example:workspace@1.0.0\"",
            "package = \"example:workspace@1.0.1\"",
        ),
        &[
            "pkg/contract.toml:2",
            "example:workspace@1.0.1",
            "package `example:workspace@1.0.0`",
        ],
    );
    assert_has(
        &refused(false, "class = \"read\"", "class = \"harmless\""),
        &[
            "pkg/contract.toml:12",
            "\"harmless\" is not an effect class",
            "external-effect",
        ],
    );
    assert_has(
        &refused(
            false,
            "restore = {",
            "undo = { class = \"read\", idempotent = true }\nrestore = {",
        ),
        &[
            "pkg/contract.toml:13",
            "function `undo` is not in interface `workspace-edits`",
        ],
    );
    assert_has(
        &refused(
            false,
            "[interfaces.workspace-edits.handles]",
            "[interfaces.elsewhere.functions]\n[interfaces.workspace-edits.handles]",
        ),
        &[
            "pkg/contract.toml:4",
            "interface `elsewhere` is not in package",
        ],
    );
    assert_has(
        &load_err(
            "format = 1\npackage = \"example:workspace@1.0.0\"\ninterfaces = {}\n",
            WIT,
        ),
        &[
            "pkg/edits.wit:4",
            "interface `workspace-edits` has no semantics",
        ],
    );
    let no_sidecar = PackageFiles::new("pkg", [("edits.wit", WIT)]).unwrap();
    assert_has(
        &format!("{:#}", load(&no_sidecar).unwrap_err()),
        &["pkg: no contract.toml", "Defining a contract"],
    );
}

#[test]
fn wit_that_does_not_parse_or_resolve_is_refused_with_its_location() {
    assert_has(
        &refused(true, "write: func", "write func"),
        &["pkg/edits.wit:35:11", "expected ':'"],
    );
    assert_has(
        &refused(
            true,
            "path: string,\n        content",
            "path: strin,\n        content",
        ),
        &["pkg/edits.wit", "strin"],
    );
    assert_has(
        &load_err(
            SIDECAR_TEXT,
            "package example:workspace@1.0.0;\ninterface x { use wasi:io/streams@0.2.0.{input-stream}; }",
        ),
        &["pkg/edits.wit:2", "wasi:io"],
    );
    let none = PackageFiles::new("pkg", [(SIDECAR, SIDECAR_TEXT)]).unwrap();
    assert_has(
        &format!("{:#}", load(&none).unwrap_err()),
        &["no *.wit file"],
    );
}

#[test]
fn a_function_without_semantics_is_refused_at_its_wit_line() {
    let err = refused(
        false,
        "restore = { class = \"reversible-mutation\", idempotent = true }\n",
        "",
    );
    assert_has(
        &err,
        &[
            "pkg/edits.wit:37:5",
            "function `restore` has no semantics",
            "[interfaces.workspace-edits.functions]",
        ],
    );
}

#[test]
fn types_contracts_forbid_are_refused() {
    for (ty, word) in [
        ("resource blob;\n    record write-request {", "resource"),
        ("record write-request {\n        s: stream<u8>,", "stream"),
        ("record write-request {\n        s: future<u8>,", "future"),
    ] {
        if word == "resource" {
            // An unused resource is a type of the interface; nothing refers to it, and a
            // resource-typed field would be: test that one.
            let wit = WIT.replace(
                "record write-request {",
                "resource blob;\n    record write-request {\n        b: borrow<blob>,",
            );
            let err = load_err(SIDECAR_TEXT, &wit);
            assert_has(&err, &["pkg/edits.wit", "may not use WIT", "write"]);
            continue;
        }
        let err = refused(true, "record write-request {", ty);
        assert_has(&err, &["pkg/edits.wit", "may not use WIT", word]);
    }
}

#[test]
fn types_nested_too_deep_are_refused_not_overflowed() {
    // Deeper than a contract may nest: refused by this host, naming the function.
    let deep = format!("{}u8{}", "list<".repeat(40), ">".repeat(40));
    let err = refused(true, "content: string,", &format!("content: {deep},"));
    assert_has(
        &err,
        &[
            "pkg/edits.wit:35:5",
            "function `write`",
            "nest deeper than 32",
        ],
    );
    // Far deeper: wit-parser itself stops, with the location.
    let deep = format!("{}u8{}", "list<".repeat(1000), ">".repeat(1000));
    let err = refused(true, "content: string,", &format!("content: {deep},"));
    assert_has(&err, &["pkg/edits.wit:10", "nesting too deep"]);
}

#[test]
fn handles_must_be_declared_minted_and_identified_by_facts_beside_them() {
    assert_has(
        &refused(false, "change-ref = { identity = [\"after-sha256\"] }", ""),
        &[
            "pkg/edits.wit:5",
            "`type change-ref = string` looks like a handle",
            "identity = []",
        ],
    );
    assert_has(
        &refused(
            false,
            "change-ref = { identity = [\"after-sha256\"] }",
            "change-ref = { identity = [\"after-sha256\"] }\npath-ref = { identity = [] }",
        ),
        &[
            "pkg/contract.toml:6",
            "handle `path-ref` is not a `type path-ref = string`",
        ],
    );
    assert_has(
        &refused(
            false,
            "identity = [\"after-sha256\"]",
            "identity = [\"colour\"]",
        ),
        &[
            "pkg/contract.toml:5",
            "identity fact `colour`",
            "beside it: after-sha256, path",
        ],
    );
    assert_has(
        &refused(
            false,
            "identity = [\"after-sha256\"] }",
            "identity = [] }\nidempotency-key = { identity = [] }",
        ),
        &["handle `idempotency-key` is not a `type idempotency-key = string`"],
    );
    // A kind no result carries is never minted.
    let wit = WIT.replace("type change-ref = string;", "type change-ref = string;\n    type orphan-ref = string;\n    record orphan { o: orphan-ref }")
        .replace("record restore-request {", "record restore-request {\n        o: orphan,");
    let sidecar = SIDECAR_TEXT.replace(
        "change-ref = {",
        "orphan-ref = { identity = [] }\nchange-ref = {",
    );
    assert_has(
        &load_err(&sidecar, &wit),
        &[
            "pkg/contract.toml:5",
            "handle `orphan-ref`: no function's result carries it",
        ],
    );
}

#[test]
fn host_supplied_fields_are_declared_and_supply_only_the_intent_key() {
    assert_has(
        &refused(
            false,
            "idempotency-key = \"intent-idempotency-key\"",
            "idempotency-key = \"the-time\"",
        ),
        &[
            "pkg/contract.toml:8",
            "can supply only \"intent-idempotency-key\"",
        ],
    );
    assert_has(
        &refused(false, "idempotency-key = \"intent-idempotency-key\"", ""),
        &["pkg/edits.wit:6", "would be sent by the model"],
    );
}

#[test]
fn queries_undos_and_host_only_functions_must_fit() {
    let cases: &[(&str, &str, &[&str])] = &[
        (
            "queryable-by = \"written\"",
            "queryable-by = \"nowhere\"",
            &["pkg/contract.toml:11", "`nowhere`, which is not a function"],
        ),
        (
            "written = { class = \"read\", idempotent = true, host-only = true }",
            "written = { class = \"read\", idempotent = true }",
            &["`written` reconciles `write`, so it must be host-only"],
        ),
        (
            "compensable-by = \"restore\"",
            "compensable-by = \"written\"",
            &["`written` undoes `write`, so it changes something"],
        ),
        (
            "write = { class = \"reversible-mutation\"",
            "write = { class = \"external-effect\"",
            &["`write` is external-effect: only a reversible-mutation can be compensable"],
        ),
        (
            "queryable-by = \"written\", compensable-by = \"restore\"",
            "compensable-by = \"restore\"",
            &["function `written` is host-only, but no function names it"],
        ),
        (
            "restore = { class = \"reversible-mutation\", idempotent = true }",
            "restore = { class = \"reversible-mutation\", idempotent = true, host-only = true, queryable-by = \"written\" }",
            &[],
        ),
    ];
    for (from, to, needles) in cases {
        if needles.is_empty() {
            // Declaring a host-only undo with its own query is allowed: it loads.
            let sidecar = SIDECAR_TEXT.replace(from, to);
            load(&files(&sidecar, WIT)).unwrap();
            continue;
        }
        assert_has(&refused(false, from, to), needles);
    }
    let wit_cases: &[(&str, &str, &[&str])] = &[
        (
            "-> result<option<change>, contract-error>",
            "-> result<change, contract-error>",
            &["`written` must return `result<option<T>, E>`"],
        ),
        (
            "record written-request {\n        idempotency-key: idempotency-key,",
            "record written-request {\n        idempotency-key: idempotency-key,\n        path: string,",
            &["`written` must take one record whose fields are all host-supplied"],
        ),
        (
            "record restore-request {\n        change: change-ref,",
            "record restore-request {\n        change: change-ref,\n        path: string,",
            &["`restore` must take one record whose fields are handles `write` returns"],
        ),
        (
            "restore: func(request: restore-request) -> result<change, contract-error>;",
            "restore: func(request: restore-request) -> result<change, string>;",
            &["`restore` must return `result<_, E>` with the error type `write` returns"],
        ),
        (
            "        idempotency-key: idempotency-key,\n    }\n\n    record change",
            "    }\n\n    record change",
            &["its request has no host-supplied field"],
        ),
        (
            "write: func(request: write-request)",
            "write: func(request: write-request, again: write-request)",
            &["function `write` is offered to the model, so it must take exactly one record"],
        ),
    ];
    for (from, to, needles) in wit_cases {
        assert_has(&refused(true, from, to), needles);
    }
}

#[test]
fn hostile_paths_and_sizes_are_refused() {
    for path in [
        "../edits.wit",
        "deps/../../x.wit",
        "/abs.wit",
        "notes.txt",
        "deps/a/b/c.wit",
        "deps/./x.wit",
    ] {
        let err = PackageFiles::new("pkg", [(path, "")])
            .unwrap_err()
            .to_string();
        assert_has(&err, &["not a contract package file"]);
    }
    let many: Vec<(String, &str)> = (0..=MAX_FILES).map(|i| (format!("f{i}.wit"), "")).collect();
    let err = PackageFiles::new("pkg", many.iter().map(|(p, t)| (p.as_str(), *t)))
        .unwrap_err()
        .to_string();
    assert_has(&err, &["more than 256 files"]);
    let big = "/".repeat(MAX_BYTES + 1);
    let err = PackageFiles::new("pkg", [("big.wit", big.as_str())])
        .unwrap_err()
        .to_string();
    assert_has(&err, &["more than 8 MiB"]);
}

#[test]
fn a_folder_reads_the_layout_wit_tools_read_and_ignores_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(SIDECAR), SIDECAR_TEXT).unwrap();
    std::fs::write(dir.path().join("edits.wit"), WIT).unwrap();
    std::fs::write(dir.path().join("README.md"), "not read").unwrap();
    std::fs::create_dir_all(dir.path().join("deps/host")).unwrap();
    std::fs::write(
        dir.path().join("deps/host/host.wit"),
        crate::contract::HOST_WIT_0_1_0,
    )
    .unwrap();
    let files = PackageFiles::read_dir(dir.path()).unwrap();
    assert_eq!(
        files.files().keys().collect::<Vec<_>>(),
        [SIDECAR, "deps/host/host.wit", "edits.wit"]
    );
    let p = load(&files).unwrap();
    assert!(
        p.origin
            .ends_with(dir.path().file_name().unwrap().to_str().unwrap())
    );
    std::fs::write(dir.path().join("edits.wit"), [0xff, 0xfe]).unwrap();
    let err = PackageFiles::read_dir(dir.path()).unwrap_err().to_string();
    assert_has(&err, &["edits.wit: not UTF-8"]);
}

#[test]
fn ten_thousand_functions_load() {
    let mut wit =
        String::from("package example:big@1.0.0;\n\ninterface big {\n    record req { n: u32 }\n");
    let mut sidecar =
        String::from("format = 1\npackage = \"example:big@1.0.0\"\n\n[interfaces.big.functions]\n");
    for i in 0..10_000 {
        wit += &format!("    get{i}: func(request: req) -> result<u32, string>;\n");
        sidecar += &format!("get{i} = {{ class = \"read\", idempotent = true }}\n");
    }
    wit += "}\n";
    let started = std::time::Instant::now();
    let p = load(&files(&sidecar, &wit)).unwrap();
    assert_eq!(
        p.interfaces["example:big/big@1.0.0"].functions.len(),
        10_000
    );
    eprintln!("10 000 functions loaded in {:?}", started.elapsed());
}

/// Found by attacking the loader (each once loaded, crashed or blew up): alias chains are
/// followed for the handle and host-supplied rules and counted for the depth, on a small
/// stack too.
#[test]
fn alias_chains_neither_hide_a_handle_or_the_key_nor_overflow_the_stack() {
    let chained = WIT
        .replace(
            "type change-ref = string;",
            "type text = string;\n    type change-ref = text;",
        )
        .replace(
            "type idempotency-key = string;",
            "type idempotency-key = text;",
        );
    // Declared through the chain: it loads, with the handle a handle.
    let p = load(&files(SIDECAR_TEXT, &chained)).unwrap();
    assert!(p.interfaces[IFACE].handles.contains_key("change-ref"));
    // Undeclared through the chain: refused, not a plain string the model could fill.
    let err = load_err(
        &SIDECAR_TEXT.replace("idempotency-key = \"intent-idempotency-key\"", ""),
        &chained,
    );
    assert_has(
        &err,
        &["`type idempotency-key = string` would be sent by the model"],
    );
    // Ten thousand aliases, on a 2 MiB thread (a host's blocking pool): refused, no abort.
    let mut wit = String::from("package example:a@1.0.0;\ninterface a {\n    type t0 = u32;\n");
    for i in 1..=10_000 {
        wit += &format!("    type t{i} = t{};\n", i - 1);
    }
    wit += "    record req { v: t10000 }\n    get: func(request: req) -> u32;\n}\n";
    let sidecar = "format = 1\npackage = \"example:a@1.0.0\"\n[interfaces.a.functions]\nget = { class = \"read\", idempotent = true }\n";
    let err = std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(move || load_err(sidecar, &wit))
        .unwrap()
        .join()
        .expect("no stack overflow");
    assert_has(&err, &["nest deeper than 32"]);
}

#[test]
fn a_handle_or_key_used_from_another_interface_or_package_must_be_declared_there() {
    let reader = WIT.to_string()
        + "\ninterface reader {\n    use workspace-edits.{change-ref, contract-error};\n    record peek-request { change: change-ref }\n    peek: func(request: peek-request) -> result<string, contract-error>;\n}\n";
    let sidecar = SIDECAR_TEXT.to_string()
        + "\n[interfaces.reader.functions]\npeek = { class = \"read\", idempotent = true }\n";
    assert_has(
        &load_err(&sidecar, &reader),
        &["`type change-ref = string` looks like a handle"],
    );
    let dep = "package example:other@1.0.0;\ninterface types { type thing-ref = string; type idempotency-key = string; }\n";
    let root = "package example:root@1.0.0;\ninterface send {\n    use example:other/types@1.0.0.{idempotency-key};\n    record req { to: string, idempotency-key: idempotency-key }\n    go: func(request: req) -> result<string, string>;\n}\n";
    let sidecar = "format = 1\npackage = \"example:root@1.0.0\"\n[interfaces.send.functions]\ngo = { class = \"external-effect\", idempotent = true }\n";
    let files = PackageFiles::new(
        "pkg",
        [(SIDECAR, sidecar), ("r.wit", root), ("deps/other.wit", dep)],
    )
    .unwrap();
    assert_has(
        &format!("{:#}", load(&files).unwrap_err()),
        &["would be sent by the model"],
    );
}

#[test]
fn a_host_supplied_type_is_only_ever_a_request_field() {
    for (from, to) in [
        (
            "        idempotency-key: idempotency-key,\n    }\n\n    record change",
            "        idempotency-key: idempotency-key,\n        maybe: option<idempotency-key>,\n    }\n\n    record change",
        ),
        (
            "        after-sha256: string,\n    }",
            "        after-sha256: string,\n        key: option<idempotency-key>,\n    }",
        ),
    ] {
        assert_has(
            &refused(true, from, to),
            &["uses a host-supplied type other than as a field of its request record"],
        );
    }
}

#[test]
fn self_naming_relations_and_duplicate_facts_are_refused() {
    assert_has(
        &refused(
            false,
            "restore = { class = \"reversible-mutation\", idempotent = true }",
            "restore = { class = \"reversible-mutation\", idempotent = true, compensable-by = \"restore\" }",
        ),
        &["`restore` names itself"],
    );
    assert_has(
        &refused(
            false,
            "identity = [\"after-sha256\"]",
            "identity = [\"after-sha256\", \"after-sha256\"]",
        ),
        &["identity fact `after-sha256` is listed twice"],
    );
}

#[test]
fn a_package_with_thousands_of_problems_is_refused_quickly_and_briefly() {
    let mut wit =
        String::from("package example:big@1.0.0;\ninterface big {\n    record req { n: u32 }\n");
    let mut sidecar =
        String::from("format = 1\npackage = \"example:big@1.0.0\"\n[interfaces.big.functions]\n");
    for i in 0..2_000 {
        wit += &format!("    get{i}: func(request: req) -> result<u32, string>;\n");
    }
    for i in 0..10_000 {
        sidecar += &format!("missing{i} = {{ class = \"read\", idempotent = true }}\n");
    }
    wit += "}\n";
    let started = std::time::Instant::now();
    let err = load_err(&sidecar, &wit);
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert!(err.len() < 20_000, "{} bytes of error", err.len());
    assert_has(
        &err,
        &["12000 problem(s)", "... and 11980 more", "(2000 in all)"],
    );
}

#[test]
fn names_that_could_alias_in_the_digest_and_links_are_refused() {
    for path in [
        "x.wit\n0\ny.wit",
        ".wit",
        "deps/.wit",
        " .wit",
        ".hidden.wit",
        "a b.wit",
    ] {
        let err = PackageFiles::new("pkg", [(path, "")])
            .unwrap_err()
            .to_string();
        assert_has(&err, &["not a contract package file"]);
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(SIDECAR), SIDECAR_TEXT).unwrap();
    std::os::unix::fs::symlink("/etc/hostname", dir.path().join("z.wit")).unwrap();
    let err = format!("{:#}", PackageFiles::read_dir(dir.path()).unwrap_err());
    assert_has(
        &err,
        &["z.wit: a contract package may not hold a symbolic link"],
    );
    std::fs::remove_file(dir.path().join("z.wit")).unwrap();
    // A file larger than a package may be is refused before it is read.
    let big = std::fs::File::create(dir.path().join("big.wit")).unwrap();
    big.set_len(256 << 20).unwrap();
    let err = format!("{:#}", PackageFiles::read_dir(dir.path()).unwrap_err());
    assert_has(&err, &["more than 8 MiB"]);
}

/// A package whose handles carry roles: content a call acts on, the scope it goes to.
const ROLES_WIT: &str = r#"package example:ship@1.0.0;

interface ship {
    type box-ref = string;
    type dock-ref = string;
    type idempotency-key = string;

    record pack-request { content: string }
    record box { box: box-ref, sha256: string, bytes: u64 }
    record docks-request { limit: option<u32> }
    record dock { dock: dock-ref, label: string }
    record send-request { box: box-ref, dock: dock-ref, idempotency-key: idempotency-key }
    record sent { id: string, box-sha256: string }

    variant contract-error { unavailable(string) }

    pack: func(request: pack-request) -> result<box, contract-error>;
    docks: func(request: docks-request) -> result<list<dock>, contract-error>;
    send: func(request: send-request) -> result<sent, contract-error>;
}
"#;

const ROLES_SIDECAR: &str = r#"format = 1
package = "example:ship@1.0.0"

[interfaces.ship.handles]
box-ref = { identity = ["sha256"], role = "content" }
dock-ref = { identity = [], role = "scope" }

[interfaces.ship.host-supplied]
idempotency-key = "intent-idempotency-key"

[interfaces.ship.functions]
pack = { class = "local-transformation", idempotent = false }
docks = { class = "read", idempotent = true }
send = { class = "external-effect", idempotent = true, confirms = "box-sha256" }
"#;

/// `load_err` of the roles package after replacing `from` with `to` in the sidecar
/// (`in_wit` false) or the WIT.
fn roles_refused(in_wit: bool, from: &str, to: &str) -> String {
    let (mut sidecar, mut wit) = (ROLES_SIDECAR.to_string(), ROLES_WIT.to_string());
    let target = if in_wit { &mut wit } else { &mut sidecar };
    assert!(target.contains(from), "{from}");
    *target = target.replacen(from, to, 1);
    load_err(&sidecar, &wit)
}

#[test]
fn handle_roles_tell_policy_and_receipts_what_a_handle_means() {
    let p = load(&files(ROLES_SIDECAR, ROLES_WIT)).unwrap();
    let c = &p.interfaces["example:ship/ship@1.0.0"];
    assert_eq!(c.handle_role("box-ref"), Some(HandleRole::Content));
    assert_eq!(c.handle_role("dock-ref"), Some(HandleRole::Scope));
    assert_eq!(c.handle_role("nothing-ref"), None);
    assert_eq!(c.functions["send"].confirms.as_deref(), Some("box-sha256"));
    assert_eq!(c.functions["pack"].confirms, None);
    // The built-in delivery contract says the same in its own words.
    let d = crate::contract::load_contract("airlock:contracts/artifact-delivery@0.2.0").unwrap();
    assert_eq!(d.handle_role("artifact-ref"), Some(HandleRole::Content));
    assert_eq!(d.handle_role("destination-ref"), Some(HandleRole::Scope));
    assert_eq!(
        d.functions["deliver"].confirms.as_deref(),
        Some("artifact-sha256")
    );
}

#[test]
fn roles_and_receipts_that_do_not_fit_are_refused_with_their_line() {
    let e = roles_refused(false, r#"role = "scope""#, r#"role = "target""#);
    assert_has(
        &e,
        &[
            "pkg/contract.toml:6",
            "role `target` is not one of scope, content",
        ],
    );
    let e = roles_refused(
        false,
        r#"identity = ["sha256"], role"#,
        r#"identity = [], role"#,
    );
    assert_has(&e, &["handle `box-ref`", "list `sha256` in its identity"]);
    // One scope and one content per call: two, or a list of them, is ambiguous.
    let e = roles_refused(
        true,
        "record send-request { box: box-ref, dock: dock-ref,",
        "record send-request { box: box-ref, dock: dock-ref, also: dock-ref,",
    );
    assert_has(&e, &["function `send` takes 2 handles of role scope"]);
    let e = roles_refused(
        true,
        "record docks-request { limit: option<u32> }",
        "record docks-request { limit: option<u32>, near: list<dock-ref> }",
    );
    assert_has(
        &e,
        &["function `docks` takes any number of handles of role scope"],
    );
    // What a receipt confirms is a string field of the result, of a call naming content.
    let e = roles_refused(false, r#"confirms = "box-sha256""#, r#"confirms = "nope""#);
    assert_has(
        &e,
        &[
            "pkg/contract.toml:14",
            "confirms `nope`",
            "string field `nope`",
        ],
    );
    let e = roles_refused(
        false,
        r#"docks = { class = "read", idempotent = true }"#,
        r#"docks = { class = "read", idempotent = true, confirms = "label" }"#,
    );
    assert_has(
        &e,
        &[
            "function `docks` confirms `label`",
            "a handle of role content",
        ],
    );
    let e = roles_refused(false, r#"confirms = "box-sha256""#, r#"confirms = 3"#);
    assert_has(&e, &["pkg/contract.toml"]);
}

/// A content handle is identified by its digest: `sha256` must be a string field beside
/// it in the records that mint it. A number, or a `sha256` only beside it in a request,
/// would leave the approval binding no digest and `confirms` checking nothing.
#[test]
fn a_content_handle_minted_without_a_string_sha256_beside_it_is_refused() {
    let e = roles_refused(
        true,
        "record box { box: box-ref, sha256: string, bytes: u64 }",
        "record box { box: box-ref, sha256: u64, bytes: u64 }",
    );
    assert_has(&e, &["handle `box-ref`", "sha256"]);
}

/// The same, when `sha256` is beside the content handle only in a request record, never
/// in the record that mints it.
#[test]
fn a_content_handle_whose_sha256_is_only_beside_it_in_a_request_is_refused() {
    let wit = ROLES_WIT
        .replacen(
            "record box { box: box-ref, sha256: string, bytes: u64 }",
            "record box { box: box-ref, bytes: u64 }",
            1,
        )
        .replacen(
            "record send-request { box: box-ref,",
            "record send-request { box: box-ref, sha256: string,",
            1,
        );
    let e = load_err(ROLES_SIDECAR, &wit);
    assert_has(&e, &["handle `box-ref`", "sha256"]);
}

/// `confirms` checks a result against the content the call named: a function whose
/// result has the string field but whose request names no content handle is refused.
#[test]
fn confirms_without_a_content_handle_in_the_request_is_refused() {
    let e = roles_refused(
        false,
        r#"pack = { class = "local-transformation", idempotent = false }"#,
        r#"pack = { class = "local-transformation", idempotent = false, confirms = "sha256" }"#,
    );
    assert_has(
        &e,
        &[
            "function `pack` confirms `sha256`",
            "a handle of role content",
        ],
    );
}
