//! Contract packages: a WIT package and the host-side semantics of every function it
//! declares, read, checked and pinned as one unit.
//!
//! Rule: a contract is data the host reads, never code it runs. Everything the host does
//! differently per contract function (its effect class, whether a repeat changes nothing,
//! how an unknown outcome is reconciled and how a completed one is undone, which functions
//! the model may never call, which fields the host fills, which strings are handles and
//! what identifies the object a handle names) is declared in the package's sidecar file,
//! [`SIDECAR`], beside its WIT, and checked here against the WIT when the package loads.
//! One sha256 ([`PackageFiles::digest`]) covers the WIT and the sidecar together, so a
//! reviewed digest pins both. The built-in contracts are packages in this format under
//! `wit/`, loaded through [`load`] like any operator's.
//!
//! A package folder holds `contract.toml`, the root package's `*.wit` files, and the WIT
//! packages it uses under `deps/` (`deps/<name>/*.wit` or `deps/<name>.wit`, the layout
//! `wit-bindgen` and `wasm-tools` read). Other files are ignored and not digested.
//!
//! The sidecar's accepted form (`format = 1`; every key below is checked, an unknown one
//! is an error with its line):
//!
//! ```toml
//! format = 1
//! package = "example:workspace@1.0.0"      # the root WIT package, exactly
//!
//! [interfaces.workspace-edits.handles]      # every `type <x>-ref = string` of the interface
//! change-ref = { identity = [] }            # facts beside it that identify the object
//!
//! [interfaces.workspace-edits.host-supplied]
//! idempotency-key = "intent-idempotency-key"  # a string alias the host fills; never the model
//!
//! [interfaces.workspace-edits.functions]    # every function of the interface
//! write = { class = "reversible-mutation", idempotent = true,
//!           queryable-by = "written", compensable-by = "restore" }
//! written = { class = "read", idempotent = true, host-only = true }
//! restore = { class = "reversible-mutation", idempotent = true }
//! ```
//!
//! What a load refuses, each with the file, the line and what to do: a sidecar that is
//! not this form; a WIT that does not parse or resolve; an interface or function without
//! semantics, or semantics for one the WIT lacks; a type contracts forbid (resources,
//! futures, streams, maps, `error-context`) or nested deeper than [`MAX_TYPE_DEPTH`]; a
//! `-ref` string alias not declared a handle, a declared handle that is not one, an
//! identity fact that is never a scalar field beside its handle, a handle kind no
//! function's result carries (nothing mints it); a model-facing function that does not
//! take exactly one record; a query (`queryable-by`) or undo (`compensable-by`) whose
//! signature does not fit ([`check_query`], [`check_undo`]); a host-only function nothing
//! calls; more than [`MAX_FILES`] files or [`MAX_BYTES`] bytes.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context as _, Result, bail};
use serde::Deserialize;
use sha2::Digest as _;
use toml::Spanned;
use wit_parser::{Resolve, SourceMap, Type, TypeDefKind, TypeId};

use super::{
    Contract, ContractFunction, EffectClass, EffectSemantics, HandleKind, HandleRole, Shape,
};

/// The sidecar's file name in a package folder.
pub const SIDECAR: &str = "contract.toml";

/// The sidecar format this host reads (`format = 1`).
pub const FORMAT: u32 = 1;

/// Most files (WIT and sidecar) one package may have.
pub const MAX_FILES: usize = 256;

/// Most bytes of WIT and sidecar one package may have (8 MiB).
pub const MAX_BYTES: usize = 8 << 20;

/// Deepest nesting of types (a `list` in an `option` in a record is 3) a contract may use:
/// the model's JSON arguments are converted recursively along the type.
pub const MAX_TYPE_DEPTH: usize = 32;

/// The only value a host-supplied field may name today: the intent's idempotency key
/// (the same on every attempt of one approved call).
pub const INTENT_IDEMPOTENCY_KEY: &str = "intent-idempotency-key";

/// The files of one package: its sidecar and WIT, by path relative to the package folder
/// (`/`-separated), and where they came from (a folder, or `built-in wit/v0.1.0`).
#[derive(Debug, Clone)]
pub struct PackageFiles {
    origin: String,
    files: BTreeMap<String, String>,
}

impl PackageFiles {
    /// Files given in memory (the built-in packages, tests). `origin` prefixes every
    /// location an error names.
    ///
    /// # Errors
    /// More than [`MAX_FILES`] files or [`MAX_BYTES`] bytes; a path that is not a
    /// package file ([`SIDECAR`], `*.wit`, `deps/*.wit`, `deps/<name>/*.wit`).
    pub fn new<'a>(
        origin: impl Into<String>,
        files: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Self> {
        let origin = origin.into();
        let mut out = BTreeMap::new();
        let mut bytes = 0usize;
        for (path, text) in files {
            if !is_package_file(path) {
                bail!("{origin}/{path}: not a contract package file ({SIDECAR}, *.wit, deps/)");
            }
            bytes += text.len();
            out.insert(path.to_string(), text.to_string());
            check_size(&origin, out.len(), bytes)?;
        }
        Ok(Self { origin, files: out })
    }

    /// Reads the package in folder `dir`: its sidecar, its `*.wit` files and those of
    /// `deps/`. Symbolic links are followed; other files are ignored.
    ///
    /// # Errors
    /// The folder or a file cannot be read, a file is not UTF-8, or the package is too
    /// large ([`MAX_FILES`], [`MAX_BYTES`]). A missing sidecar is reported by [`load`].
    pub fn read_dir(dir: &Path) -> Result<Self> {
        let origin = dir.display().to_string();
        let mut files = BTreeMap::new();
        let mut bytes = 0usize;
        let mut read = |rel: String, path: &Path| -> Result<()> {
            if !is_package_file(&rel) {
                bail!(
                    "{}: not a name a contract package file may have (ASCII letters, digits, `-`, `_`, `.`; not starting with `.`)",
                    path.display()
                );
            }
            // More than the package may hold is refused before a byte is read.
            let len = std::fs::symlink_metadata(path)
                .with_context(|| format!("reading {}", path.display()))?
                .len();
            if bytes.saturating_add(usize::try_from(len).unwrap_or(usize::MAX)) > MAX_BYTES {
                check_size(&origin, files.len(), MAX_BYTES + 1)?;
            }
            let text =
                std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
            let text = String::from_utf8(text)
                .map_err(|_| anyhow::anyhow!("{}: not UTF-8 text", path.display()))?;
            bytes += text.len();
            files.insert(rel, text);
            check_size(&origin, files.len(), bytes)
        };
        let listing = |d: &Path| -> Result<Vec<std::path::PathBuf>> {
            let mut paths = std::fs::read_dir(d)
                .with_context(|| format!("reading the contract package folder {}", d.display()))?
                .map(|e| e.map(|e| e.path()))
                .collect::<std::io::Result<Vec<_>>>()
                .with_context(|| format!("reading {}", d.display()))?;
            paths.sort();
            Ok(paths)
        };
        let name_of = |p: &Path| p.file_name().and_then(|n| n.to_str()).map(str::to_string);
        // What an entry is, without following a link: a link inside a package could read
        // outside its folder (or `deps -> .` every file twice), so one is refused.
        let kind = |p: &Path| -> Result<(bool, bool)> {
            let t = std::fs::symlink_metadata(p)
                .with_context(|| format!("reading {}", p.display()))?
                .file_type();
            if t.is_symlink() {
                bail!(
                    "{}: a contract package may not hold a symbolic link",
                    p.display()
                );
            }
            Ok((t.is_file(), t.is_dir()))
        };
        for path in listing(dir)? {
            let Some(name) = name_of(&path) else { continue };
            let relevant = name == SIDECAR || name.ends_with(".wit") || name == "deps";
            if !relevant {
                continue;
            }
            let (is_file, is_dir) = kind(&path)?;
            if is_file && name != "deps" {
                read(name, &path)?;
            } else if is_dir && name == "deps" {
                for dep in listing(&path)? {
                    let Some(dep_name) = name_of(&dep) else {
                        continue;
                    };
                    let (dep_file, dep_dir) = kind(&dep)?;
                    if dep_file && dep_name.ends_with(".wit") {
                        read(format!("deps/{dep_name}"), &dep)?;
                    } else if dep_dir {
                        for file in listing(&dep)? {
                            let Some(file_name) = name_of(&file) else {
                                continue;
                            };
                            if file_name.ends_with(".wit") && kind(&file)?.0 {
                                read(format!("deps/{dep_name}/{file_name}"), &file)?;
                            }
                        }
                    }
                }
            }
        }
        Ok(Self { origin, files })
    }

    /// Where the files came from, as errors name it.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The files, by relative path.
    pub fn files(&self) -> &BTreeMap<String, String> {
        &self.files
    }

    /// The package digest: sha256 (lowercase hex) over every file's relative path, length
    /// and bytes in path order, after the line `airlock-contract-package/1`. It changes
    /// with any byte of the WIT or the sidecar, and with a file added, removed or renamed.
    pub fn digest(&self) -> String {
        let mut h = sha2::Sha256::new();
        h.update(b"airlock-contract-package/1\n");
        for (path, text) in &self.files {
            h.update(format!("{path}\n{}\n", text.len()).as_bytes());
            h.update(text.as_bytes());
        }
        hex::encode(h.finalize())
    }
}

/// Whether `path` is a package file: [`SIDECAR`], `NAME.wit`, `deps/NAME.wit` or
/// `deps/DIR/NAME.wit`, each name of ASCII letters, digits, `-`, `_` and `.`, not starting
/// with `.`, a `.wit` name with a stem. (So no two file lists can encode alike in the
/// digest: no name holds a newline.)
fn is_package_file(path: &str) -> bool {
    let parts: Vec<&str> = path.split('/').collect();
    let ok_name = |n: &str| {
        !n.is_empty()
            && !n.starts_with('.')
            && n.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    };
    let wit = |n: &str| ok_name(n) && n.len() > ".wit".len() && n.ends_with(".wit");
    match parts.as_slice() {
        [name] => *name == SIDECAR || wit(name),
        ["deps", name] => wit(name),
        ["deps", dir, name] => ok_name(dir) && wit(name),
        _ => false,
    }
}

fn check_size(origin: &str, files: usize, bytes: usize) -> Result<()> {
    if files > MAX_FILES {
        bail!(
            "{origin}: more than {MAX_FILES} files; a contract package is its WIT, its deps and {SIDECAR}"
        );
    }
    if bytes > MAX_BYTES {
        bail!(
            "{origin}: more than {} MiB of WIT and {SIDECAR}",
            MAX_BYTES >> 20
        );
    }
    Ok(())
}

/// One loaded, checked contract package.
#[derive(Debug, Clone)]
pub struct ContractPackage {
    /// The root WIT package, e.g. `airlock:contracts@0.2.0`.
    pub name: String,
    /// Where it was read from (a folder, or `built-in wit/v0.2.0`).
    pub origin: String,
    /// [`PackageFiles::digest`]: what a review pins.
    pub digest: String,
    /// Its interfaces, by fully qualified name (`airlock:contracts/artifact-delivery@0.2.0`).
    pub interfaces: BTreeMap<String, Arc<Contract>>,
    /// The files it was loaded from.
    pub files: PackageFiles,
}

/// The sidecar, as written (see the module doc).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Sidecar {
    format: Spanned<u32>,
    package: Spanned<String>,
    interfaces: BTreeMap<Spanned<String>, InterfaceDecl>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct InterfaceDecl {
    #[serde(default)]
    handles: BTreeMap<Spanned<String>, HandleDecl>,
    #[serde(default, rename = "host-supplied")]
    host_supplied: BTreeMap<Spanned<String>, Spanned<String>>,
    functions: BTreeMap<Spanned<String>, FunctionDecl>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HandleDecl {
    identity: Vec<Spanned<String>>,
    #[serde(default)]
    role: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct FunctionDecl {
    class: Spanned<String>,
    idempotent: bool,
    #[serde(default)]
    queryable_by: Option<Spanned<String>>,
    #[serde(default)]
    compensable_by: Option<Spanned<String>>,
    #[serde(default)]
    host_only: bool,
    #[serde(default)]
    confirms: Option<Spanned<String>>,
}

/// Errors found while loading, each already located (`file:line[:col]: what; what to do`).
struct Problems {
    /// The first [`MAX_PROBLEMS`], formatted.
    list: Vec<String>,
    /// How many were found (only the first ones are formatted: a hostile package may have
    /// many thousands).
    count: usize,
}

/// Most problems one failed load reports.
pub const MAX_PROBLEMS: usize = 20;

impl Problems {
    /// Counts a problem, formatting it (`problem()`) only while fewer than
    /// [`MAX_PROBLEMS`] are kept.
    fn push_with(&mut self, problem: impl FnOnce() -> String) {
        self.count += 1;
        if self.list.len() < MAX_PROBLEMS {
            self.list.push(problem());
        }
    }

    fn finish(self, origin: &str) -> Result<()> {
        match self.count {
            0 => Ok(()),
            n => {
                let mut text = format!("contract package {origin}: {n} problem(s):");
                for p in self.list.iter().take(MAX_PROBLEMS) {
                    text += "\n  ";
                    text += p;
                }
                if n > MAX_PROBLEMS {
                    text += &format!("\n  ... and {} more", n - MAX_PROBLEMS);
                }
                bail!(text)
            }
        }
    }
}

/// Where a sidecar span is: `origin/contract.toml:LINE`.
fn sidecar_at(origin: &str, text: &str, span: std::ops::Range<usize>) -> String {
    let line = text.as_bytes()[..span.start.min(text.len())]
        .iter()
        .filter(|b| **b == b'\n')
        .count()
        + 1;
    format!("{origin}/{SIDECAR}:{line}")
}

/// Parses the WIT of `files` (root package and `deps/`) into one resolve.
pub(super) fn resolve_wit(files: &PackageFiles) -> Result<(Resolve, wit_parser::PackageId)> {
    let origin = &files.origin;
    let mut main = SourceMap::default();
    let mut deps: BTreeMap<String, SourceMap> = BTreeMap::new();
    let mut roots = 0;
    for (path, text) in &files.files {
        let shown = format!("{origin}/{path}");
        match path.split('/').collect::<Vec<_>>().as_slice() {
            [name] if name.ends_with(".wit") => {
                main.push_str(&shown, text.as_str());
                roots += 1;
            }
            ["deps", name] => deps
                .entry(name.to_string())
                .or_default()
                .push_str(&shown, text.as_str()),
            ["deps", dir, _] => deps
                .entry(dir.to_string())
                .or_default()
                .push_str(&shown, text.as_str()),
            _ => {}
        }
    }
    if roots == 0 {
        bail!("{origin}: no *.wit file: a contract package's WIT package lies beside {SIDECAR}");
    }
    let parse = |map: SourceMap| {
        map.parse()
            .map_err(|(map, e)| anyhow::anyhow!("{}", e.render(&map)))
    };
    let main = parse(main)?;
    let deps = deps.into_values().map(parse).collect::<Result<Vec<_>>>()?;
    let mut resolve = Resolve::new();
    match resolve.push_groups(main, deps) {
        Ok(id) => Ok((resolve, id)),
        Err(e) => {
            let e = anyhow::Error::from(e);
            bail!("{}", resolve.render_error(&e))
        }
    }
}

/// Loads and checks one package (see the module doc for every rule).
///
/// # Errors
/// Every problem found (up to [`MAX_PROBLEMS`]), each with its file and line and what to
/// do; or the first that stops the load (no sidecar, WIT that does not parse).
pub fn load(files: &PackageFiles) -> Result<ContractPackage> {
    let origin = files.origin.clone();
    let Some(sidecar_text) = files.files.get(SIDECAR) else {
        bail!(
            "{origin}: no {SIDECAR}: a contract package is a WIT package with the host-side semantics of each function beside it (README: \"Defining a contract\")"
        );
    };
    let sidecar: Sidecar = toml::from_str(sidecar_text)
        .map_err(|e| anyhow::anyhow!("{origin}/{SIDECAR}: {}", e.to_string().trim_end()))?;
    let at = |span: std::ops::Range<usize>| sidecar_at(&origin, sidecar_text, span);
    if *sidecar.format.get_ref() != FORMAT {
        bail!(
            "{}: format {} is not one this host reads (format = {FORMAT})",
            at(sidecar.format.span()),
            sidecar.format.get_ref()
        );
    }
    let (resolve, root) = resolve_wit(files)?;
    let package = &resolve.packages[root];
    let name = package.name.to_string();
    let mut problems = Problems {
        list: Vec::new(),
        count: 0,
    };
    if *sidecar.package.get_ref() != name {
        problems.push_with(|| {
            format!(
                "{}: package = \"{}\", but the WIT beside it is package `{name}`",
                at(sidecar.package.span()),
                sidecar.package.get_ref()
            )
        });
    }
    for declared in sidecar.interfaces.keys() {
        if !package.interfaces.contains_key(declared.get_ref()) {
            problems.push_with(|| {
                format!(
                    "{}: interface `{}` is not in package `{name}` (it has: {})",
                    at(declared.span()),
                    declared.get_ref(),
                    some_of(package.interfaces.keys())
                )
            });
        }
    }
    let digest = files.digest();
    let mut interfaces = BTreeMap::new();
    for (iname, iid) in &package.interfaces {
        let iface = &resolve.interfaces[*iid];
        let Some((_, decl)) = sidecar
            .interfaces
            .iter()
            .find(|(k, _)| k.get_ref() == iname)
        else {
            problems.push_with(|| format!(
                "{}: interface `{iname}` has no semantics: add [interfaces.{iname}.functions] to {SIDECAR}",
                resolve.render_location(iface.span)
            ));
            continue;
        };
        let full = resolve.id_of(*iid).unwrap_or_else(|| iname.clone());
        let mut cx = InterfaceLoad {
            resolve: &resolve,
            origin: &origin,
            at: &at,
            iname,
            handles: HashMap::new(),
            host_supplied: HashMap::new(),
            problems: &mut problems,
        };
        if let Some(contract) = cx.load(*iid, decl, &full, &name, &digest) {
            interfaces.insert(full, Arc::new(contract));
        }
    }
    problems.finish(&origin)?;
    Ok(ContractPackage {
        name,
        origin,
        digest,
        interfaces,
        files: files.clone(),
    })
}

/// The load of one interface: its declarations, resolved against its WIT.
struct InterfaceLoad<'a> {
    resolve: &'a Resolve,
    origin: &'a str,
    at: &'a dyn Fn(std::ops::Range<usize>) -> String,
    iname: &'a str,
    /// Declared handle aliases: type → kind name.
    handles: HashMap<TypeId, String>,
    /// Declared host-supplied aliases: type → alias name.
    host_supplied: HashMap<TypeId, String>,
    problems: &'a mut Problems,
}

impl InterfaceLoad<'_> {
    fn load(
        &mut self,
        iid: wit_parser::InterfaceId,
        decl: &InterfaceDecl,
        full: &str,
        package: &str,
        digest: &str,
    ) -> Option<Contract> {
        let resolve = self.resolve;
        let iface = &resolve.interfaces[iid];
        let iname = self.iname;
        let before = self.problems.count;
        // Handles and host-supplied aliases: declared ones must be string aliases here.
        for kind in decl.handles.keys() {
            match iface.types.get(kind.get_ref()) {
                Some(id) if is_string_alias(resolve, *id) && kind.get_ref().ends_with(super::HANDLE_SUFFIX) => {
                    self.handles.insert(*id, kind.get_ref().clone());
                }
                _ => self.problems.push_with(|| format!(
                    "{}: handle `{}` is not a `type {} = string` of interface `{iname}`; a handle is a string alias whose name ends in `{}`",
                    (self.at)(kind.span()),
                    kind.get_ref(),
                    kind.get_ref(),
                    super::HANDLE_SUFFIX
                )),
            }
        }
        for (alias, value) in &decl.host_supplied {
            if value.get_ref() != INTENT_IDEMPOTENCY_KEY {
                self.problems.push_with(|| format!(
                    "{}: host-supplied `{}` = \"{}\": the host can supply only \"{INTENT_IDEMPOTENCY_KEY}\"",
                    (self.at)(value.span()),
                    alias.get_ref(),
                    value.get_ref()
                ));
            }
            match iface.types.get(alias.get_ref()) {
                Some(id) if is_string_alias(resolve, *id) && !alias.get_ref().ends_with(super::HANDLE_SUFFIX) => {
                    self.host_supplied.insert(*id, alias.get_ref().clone());
                }
                _ => self.problems.push_with(|| format!(
                    "{}: host-supplied `{}` is not a `type {} = string` of interface `{iname}` (nor may it be a handle)",
                    (self.at)(alias.span()),
                    alias.get_ref(),
                    alias.get_ref()
                )),
            }
        }
        for (tname, id) in &iface.types {
            if !is_string_alias(resolve, *id) {
                continue;
            }
            let declared = self.handles.contains_key(id) || self.host_supplied.contains_key(id);
            if !declared && tname.ends_with(super::HANDLE_SUFFIX) {
                self.problems.push_with(|| format!(
                    "{}: `type {tname} = string` looks like a handle but {SIDECAR} does not declare it: add `{tname} = {{ identity = [] }}` to [interfaces.{iname}.handles], or rename the type",
                    resolve.render_location(resolve.types[*id].span)
                ));
            }
            if !declared && tname == super::HOST_SUPPLIED_KEY {
                self.problems.push_with(|| format!(
                    "{}: `type {tname} = string` would be sent by the model: declare it in [interfaces.{iname}.host-supplied] (`{tname} = \"{INTENT_IDEMPOTENCY_KEY}\"`), or rename the type",
                    resolve.render_location(resolve.types[*id].span)
                ));
            }
        }
        // Every function has semantics, and every declaration a function.
        for fname in decl.functions.keys() {
            if !iface.functions.contains_key(fname.get_ref()) {
                self.problems.push_with(|| {
                    format!(
                        "{}: function `{}` is not in interface `{iname}` (it has: {})",
                        (self.at)(fname.span()),
                        fname.get_ref(),
                        some_of(iface.functions.keys())
                    )
                });
            }
        }
        let by_name: HashMap<&str, &FunctionDecl> = decl
            .functions
            .iter()
            .map(|(k, v)| (k.get_ref().as_str(), v))
            .collect();
        let mut functions = BTreeMap::new();
        for (fname, func) in &iface.functions {
            let Some(fdecl) = by_name.get(fname.as_str()) else {
                self.problems.push_with(|| format!(
                    "{}: function `{fname}` has no semantics: add `{fname} = {{ class = \"read\", idempotent = true }}` (with its real class) to [interfaces.{iname}.functions] in {SIDECAR}",
                    resolve.render_location(func.span)
                ));
                continue;
            };
            if !matches!(func.kind, wit_parser::FunctionKind::Freestanding) {
                self.problems.push_with(|| format!(
                    "{}: function `{fname}` is not a plain (synchronous, freestanding) function; contracts have no async functions or resources",
                    resolve.render_location(func.span)
                ));
                continue;
            }
            let shape = |ty: &Type, what: &str, this: &mut Self| -> Option<Shape> {
                match this.shape_of(ty, 0) {
                    Ok(s) => Some(s),
                    Err(e) => {
                        this.problems.push_with(|| {
                            format!(
                                "{}: function `{fname}`, {what}: {e}",
                                resolve.render_location(func.span)
                            )
                        });
                        None
                    }
                }
            };
            let mut params = Vec::new();
            let mut ok = true;
            for p in &func.params {
                match shape(&p.ty, &format!("parameter `{}`", p.name), self) {
                    Some(s) => params.push((p.name.clone(), s)),
                    None => ok = false,
                }
            }
            let result = match &func.result {
                Some(t) => match shape(t, "result", self) {
                    Some(s) => Some(s),
                    None => {
                        ok = false;
                        None
                    }
                },
                None => None,
            };
            let Some(class) = EffectClass::parse(fdecl.class.get_ref()) else {
                self.problems.push_with(|| {
                    format!(
                        "{}: function `{fname}`: class \"{}\" is not an effect class (one of {})",
                        (self.at)(fdecl.class.span()),
                        fdecl.class.get_ref(),
                        EffectClass::ALL.map(EffectClass::as_str).join(", ")
                    )
                });
                continue;
            };
            if !ok {
                continue;
            }
            functions.insert(
                fname.clone(),
                ContractFunction {
                    name: fname.clone(),
                    params,
                    result,
                    semantics: EffectSemantics {
                        class,
                        idempotent: fdecl.idempotent,
                        queryable: fdecl.queryable_by.is_some(),
                        compensable: fdecl.compensable_by.is_some(),
                        host_only: fdecl.host_only,
                    },
                    query: fdecl.queryable_by.as_ref().map(|q| q.get_ref().clone()),
                    undo: fdecl.compensable_by.as_ref().map(|u| u.get_ref().clone()),
                    confirms: fdecl.confirms.as_ref().map(|c| c.get_ref().clone()),
                },
            );
        }
        if self.problems.count > before {
            return None;
        }
        // Relations between functions: queries, undos, host-only reach, offered forms.
        let mut called_by_host = BTreeSet::new();
        for (fname, fdecl) in &decl.functions {
            let Some(f) = functions.get(fname.get_ref()) else {
                continue;
            };
            for by in [&fdecl.queryable_by, &fdecl.compensable_by]
                .into_iter()
                .flatten()
            {
                if by.get_ref() == &f.name {
                    self.problems.push_with(|| {
                        format!(
                            "{}: `{}` names itself: a function neither reconciles nor undoes its own calls",
                            (self.at)(by.span()),
                            f.name
                        )
                    });
                }
            }
            // A host-supplied value is filled by the host only as a field of the request
            // record; anywhere else the model would be asked for it, or shown it.
            let misplaced = match f.params.as_slice() {
                [(_, Shape::Record(fields))] => fields.iter().any(|(_, s, _)| {
                    !matches!(s, Shape::HostSupplied(_)) && holds_host_supplied_deep(s)
                }),
                params => params.iter().any(|(_, s)| holds_host_supplied_deep(s)),
            } || f.result.as_ref().is_some_and(holds_host_supplied_deep);
            if misplaced {
                self.problems.push_with(|| {
                    format!(
                        "{}: function `{}` uses a host-supplied type other than as a field of its request record (in an option, a list, a nested record or its result): the host fills only a request field, and never shows the value",
                        (self.at)(fname.span()),
                        f.name
                    )
                });
            }
            if let Some(q) = &fdecl.queryable_by {
                called_by_host.insert(q.get_ref().clone());
                if let Err(why) = check_query(&functions, f, q.get_ref()) {
                    self.problems
                        .push_with(|| format!("{}: {why}", (self.at)(q.span())));
                }
            }
            if let Some(u) = &fdecl.compensable_by {
                called_by_host.insert(u.get_ref().clone());
                if let Err(why) = check_undo(&functions, f, u.get_ref()) {
                    self.problems
                        .push_with(|| format!("{}: {why}", (self.at)(u.span())));
                }
            }
        }
        for fname in decl.functions.keys() {
            let Some(f) = functions.get(fname.get_ref()) else {
                continue;
            };
            if f.semantics.host_only && !called_by_host.contains(&f.name) {
                self.problems.push_with(|| format!(
                    "{}: function `{}` is host-only, but no function names it as `queryable-by` or `compensable-by`, so nothing would ever call it",
                    (self.at)(fname.span()),
                    f.name
                ));
            }
            if !f.semantics.host_only && !matches!(f.params.as_slice(), [(_, Shape::Record(_))]) {
                self.problems.push_with(|| format!(
                    "{}: function `{}` is offered to the model, so it must take exactly one record (its fields are the tool's arguments); declare it host-only or change its WIT",
                    (self.at)(fname.span()),
                    f.name
                ));
            }
        }
        // Handle kinds: identity facts beside them, minted by some function.
        let mut handles = BTreeMap::new();
        for (kind, hdecl) in &decl.handles {
            let kind_name = kind.get_ref();
            let mut beside = BTreeSet::new();
            let mut minted_by = Vec::new();
            let mut consumed_by = Vec::new();
            for f in functions.values() {
                if f.result.as_ref().is_some_and(|r| carries(r, kind_name)) {
                    minted_by.push(f.name.clone());
                }
                if f.params.iter().any(|(_, s)| carries(s, kind_name)) {
                    consumed_by.push(f.name.clone());
                }
                for s in f.params.iter().map(|(_, s)| s).chain(&f.result) {
                    facts_beside(s, kind_name, &mut beside);
                }
            }
            if minted_by.is_empty() {
                self.problems.push_with(|| format!(
                    "{}: handle `{kind_name}`: no function's result carries it, so the host would never mint one and no call could pass one",
                    (self.at)(kind.span())
                ));
            }
            let mut identity: Vec<String> = Vec::new();
            for fact in &hdecl.identity {
                if identity.contains(fact.get_ref()) {
                    self.problems.push_with(|| {
                        format!(
                            "{}: handle `{kind_name}`: identity fact `{}` is listed twice",
                            (self.at)(fact.span()),
                            fact.get_ref()
                        )
                    });
                }
                if !beside.contains(fact.get_ref()) {
                    self.problems.push_with(|| format!(
                        "{}: handle `{kind_name}`: identity fact `{}` is never a scalar field of a record that has a `{kind_name}` field (beside it: {})",
                        (self.at)(fact.span()),
                        fact.get_ref(),
                        beside.iter().cloned().collect::<Vec<_>>().join(", ")
                    ));
                }
                identity.push(fact.get_ref().clone());
            }
            let role =
                match hdecl.role.as_ref().map(|r| (r, r.get_ref().as_str())) {
                    None => None,
                    Some((_, "scope")) => Some(HandleRole::Scope),
                    Some((_, "content")) => Some(HandleRole::Content),
                    Some((r, other)) => {
                        self.problems.push_with(|| format!(
                        "{}: handle `{kind_name}`: role `{other}` is not one of scope, content",
                        (self.at)(r.span())
                    ));
                        None
                    }
                };
            // Content is identified by its digest: a `sha256` string beside the handle in
            // every record that mints one (else the approval would bind no digest).
            let digest_beside = functions
                .values()
                .filter_map(|f| f.result.as_ref())
                .all(|r| string_beside(r, kind_name, "sha256"));
            if role == Some(HandleRole::Content)
                && (!identity.iter().any(|f| f == "sha256") || !digest_beside)
            {
                self.problems.push_with(|| format!(
                    "{}: handle `{kind_name}`: a content handle is identified by its digest: list `sha256` in its identity, a string field beside it in every record that returns one",
                    (self.at)(kind.span())
                ));
            }
            handles.insert(
                kind_name.clone(),
                HandleKind {
                    identity,
                    minted_by,
                    consumed_by,
                    role,
                },
            );
        }
        // Roles a request may hold once, and what `confirms` names.
        for (fname, fdecl) in &decl.functions {
            let Some(f) = functions.get(fname.get_ref()) else {
                continue;
            };
            for role in [HandleRole::Scope, HandleRole::Content] {
                let held: usize = handles
                    .iter()
                    .filter(|(_, h)| h.role == Some(role))
                    .map(|(k, _)| {
                        f.params
                            .iter()
                            .map(|(_, s)| occurrences(s, k))
                            .sum::<usize>()
                    })
                    .sum();
                if held > 1 {
                    self.problems.push_with(|| format!(
                        "{}: function `{}` takes {} handles of role {} (counting lists as many): a call has one {}, so take one",
                        (self.at)(fname.span()),
                        f.name,
                        if held == usize::MAX { "any number of".to_string() } else { held.to_string() },
                        role.as_str(),
                        role.as_str()
                    ));
                }
            }
            let Some(confirms) = &fdecl.confirms else {
                continue;
            };
            let content = handles.iter().any(|(k, h)| {
                h.role == Some(HandleRole::Content) && f.params.iter().any(|(_, s)| carries(s, k))
            });
            let field = confirms.get_ref();
            let has_field = match &f.result {
                Some(Shape::Result { ok: Some(ok), .. }) => {
                    matches!(&**ok, Shape::Record(fields) if fields.iter().any(|(n, s, _)| n == field && matches!(s, Shape::String)))
                }
                _ => false,
            };
            if !content || !has_field {
                self.problems.push_with(|| format!(
                    "{}: function `{}` confirms `{field}`, so it must take a handle of role content and return `result<R, E>` whose record R has the string field `{field}`",
                    (self.at)(confirms.span()),
                    f.name
                ));
            }
        }
        if self.problems.count > before {
            return None;
        }
        let _ = self.origin;
        Some(Contract {
            interface: full.to_string(),
            package: package.to_string(),
            digest: digest.to_string(),
            docs: iface.docs.contents.clone(),
            functions,
            handles,
        })
    }

    /// The shape of `ty`, `depth` types deep.
    fn shape_of(&self, ty: &Type, depth: usize) -> Result<Shape> {
        if depth > MAX_TYPE_DEPTH {
            bail!("types nest deeper than {MAX_TYPE_DEPTH}; flatten the type");
        }
        Ok(match ty {
            Type::Bool => Shape::Bool,
            Type::U8 => Shape::U8,
            Type::U16 => Shape::U16,
            Type::U32 => Shape::U32,
            Type::U64 => Shape::U64,
            Type::S8 => Shape::S8,
            Type::S16 => Shape::S16,
            Type::S32 => Shape::S32,
            Type::S64 => Shape::S64,
            Type::F32 => Shape::F32,
            Type::F64 => Shape::F64,
            Type::Char => Shape::Char,
            Type::String => Shape::String,
            Type::ErrorContext => bail!("error-context is not allowed in a contract"),
            Type::Id(id) => self.shape_of_def(*id, depth)?,
        })
    }

    fn shape_of_def(&self, id: TypeId, depth: usize) -> Result<Shape> {
        if let Some(kind) = self.handles.get(&id) {
            return Ok(Shape::Handle(kind.clone()));
        }
        if let Some(alias) = self.host_supplied.get(&id) {
            return Ok(Shape::HostSupplied(alias.clone()));
        }
        let def = &self.resolve.types[id];
        let next = depth + 1;
        let opt = |t: &Option<Type>| -> Result<Option<Box<Shape>>> {
            t.as_ref()
                .map(|t| self.shape_of(t, next).map(Box::new))
                .transpose()
        };
        Ok(match &def.kind {
            // An alias (or a `use` of a type) is its target. Each hop counts toward the
            // depth: a chain of thousands of aliases is refused, not recursed through.
            TypeDefKind::Type(inner) => self.shape_of(inner, next)?,
            TypeDefKind::Record(r) => Shape::Record(
                r.fields
                    .iter()
                    .map(|f| {
                        Ok((
                            f.name.clone(),
                            self.shape_of(&f.ty, next)?,
                            f.docs.contents.clone(),
                        ))
                    })
                    .collect::<Result<_>>()?,
            ),
            TypeDefKind::Variant(v) => Shape::Variant(
                v.cases
                    .iter()
                    .map(|c| Ok((c.name.clone(), opt(&c.ty)?.map(|b| *b))))
                    .collect::<Result<_>>()?,
            ),
            TypeDefKind::Enum(e) => Shape::Enum(e.cases.iter().map(|c| c.name.clone()).collect()),
            TypeDefKind::Flags(f) => Shape::Flags(f.flags.iter().map(|c| c.name.clone()).collect()),
            TypeDefKind::Tuple(t) => Shape::Tuple(
                t.types
                    .iter()
                    .map(|t| self.shape_of(t, next))
                    .collect::<Result<_>>()?,
            ),
            TypeDefKind::Option(t) => Shape::Option(Box::new(self.shape_of(t, next)?)),
            TypeDefKind::Result(r) => Shape::Result {
                ok: opt(&r.ok)?,
                err: opt(&r.err)?,
            },
            TypeDefKind::List(t) => Shape::List(Box::new(self.shape_of(t, next)?)),
            other => bail!(
                "a contract may not use WIT {} types (type {}, {})",
                other.as_str(),
                def.name.as_deref().unwrap_or("<anonymous>"),
                self.resolve.render_location(def.span)
            ),
        })
    }
}

/// Up to 10 of `names`, joined, with how many there are in all when there are more.
fn some_of<'a>(names: impl ExactSizeIterator<Item = &'a String>) -> String {
    let all = names.len();
    let mut text = names.take(10).cloned().collect::<Vec<_>>().join(", ");
    if all > 10 {
        text += &format!(", ... ({all} in all)");
    }
    text
}

/// Whether type `id` is a `string` through any chain of aliases (`type a = b; type b =
/// string`, or a type `use`d from another interface or package), at most
/// [`MAX_TYPE_DEPTH`] hops.
fn is_string_alias(resolve: &Resolve, id: TypeId) -> bool {
    let mut id = id;
    for _ in 0..=MAX_TYPE_DEPTH {
        match &resolve.types[id].kind {
            TypeDefKind::Type(Type::String) => return true,
            TypeDefKind::Type(Type::Id(next)) => id = *next,
            _ => return false,
        }
    }
    false
}

/// Whether a value of `shape` may hold a handle of `kind`.
/// Whether every record in `shape` that has a field holding a handle of `kind` directly
/// also has a string field `fact` (true when no record has one).
fn string_beside(shape: &Shape, kind: &str, fact: &str) -> bool {
    match shape {
        Shape::Record(fields) => {
            let holds = fields
                .iter()
                .any(|(_, s, _)| matches!(s, Shape::Handle(k) if k == kind));
            let has = fields
                .iter()
                .any(|(n, s, _)| n == fact && matches!(s, Shape::String));
            (!holds || has) && fields.iter().all(|(_, s, _)| string_beside(s, kind, fact))
        }
        Shape::List(s) | Shape::Option(s) => string_beside(s, kind, fact),
        Shape::Tuple(items) => items.iter().all(|s| string_beside(s, kind, fact)),
        Shape::Variant(cases) => cases
            .iter()
            .flat_map(|(_, s)| s)
            .all(|s| string_beside(s, kind, fact)),
        Shape::Result { ok, err } => ok.iter().chain(err).all(|s| string_beside(s, kind, fact)),
        _ => true,
    }
}

/// How many handles of `kind` a value of `shape` holds at most (a list: any number,
/// counted as `usize::MAX`).
fn occurrences(shape: &Shape, kind: &str) -> usize {
    match shape {
        Shape::Handle(k) => usize::from(k == kind),
        Shape::List(s) if carries(s, kind) => usize::MAX,
        Shape::Option(s) => occurrences(s, kind),
        Shape::Tuple(items) => items
            .iter()
            .fold(0, |n, s| n.saturating_add(occurrences(s, kind))),
        Shape::Record(fields) => fields
            .iter()
            .fold(0, |n, (_, s, _)| n.saturating_add(occurrences(s, kind))),
        Shape::Variant(cases) => cases
            .iter()
            .flat_map(|(_, s)| s)
            .map(|s| occurrences(s, kind))
            .max()
            .unwrap_or(0),
        Shape::Result { ok, err } => ok
            .iter()
            .chain(err)
            .map(|s| occurrences(s, kind))
            .max()
            .unwrap_or(0),
        _ => 0,
    }
}

fn carries(shape: &Shape, kind: &str) -> bool {
    match shape {
        Shape::Handle(k) => k == kind,
        Shape::List(s) | Shape::Option(s) => carries(s, kind),
        Shape::Tuple(items) => items.iter().any(|s| carries(s, kind)),
        Shape::Record(fields) => fields.iter().any(|(_, s, _)| carries(s, kind)),
        Shape::Variant(cases) => cases.iter().flat_map(|(_, s)| s).any(|s| carries(s, kind)),
        Shape::Result { ok, err } => ok.iter().chain(err).any(|s| carries(s, kind)),
        _ => false,
    }
}

/// The scalar fields (a fact the host keeps with a reference) of every record in `shape`
/// that has a field holding a handle of `kind` directly.
fn facts_beside(shape: &Shape, kind: &str, out: &mut BTreeSet<String>) {
    match shape {
        Shape::Record(fields) => {
            if fields
                .iter()
                .any(|(_, s, _)| matches!(s, Shape::Handle(k) if k == kind))
            {
                for (name, s, _) in fields {
                    if super::is_fact(s) {
                        out.insert(name.clone());
                    }
                }
            }
            fields
                .iter()
                .for_each(|(_, s, _)| facts_beside(s, kind, out));
        }
        Shape::List(s) | Shape::Option(s) => facts_beside(s, kind, out),
        Shape::Tuple(items) => items.iter().for_each(|s| facts_beside(s, kind, out)),
        Shape::Variant(cases) => cases
            .iter()
            .flat_map(|(_, s)| s)
            .for_each(|s| facts_beside(s, kind, out)),
        Shape::Result { ok, err } => ok
            .iter()
            .chain(err)
            .for_each(|s| facts_beside(s, kind, out)),
        _ => {}
    }
}

/// The ok and err types of `f`'s `result<T, E>`, when it returns one.
type Arms<'a> = (Option<&'a Shape>, Option<&'a Shape>);

fn result_arms(f: &ContractFunction) -> Option<Arms<'_>> {
    match &f.result {
        Some(Shape::Result { ok, err }) => Some((ok.as_deref(), err.as_deref())),
        _ => None,
    }
}

/// Checks that `query` can reconcile an unknown outcome of `f` (DESIGN.md §5.8): `f`
/// changes something and its request carries a host-supplied key; `query` is host-only,
/// takes one record whose fields are all host-supplied, and returns
/// `result<option<T>, E>` where `result<T, E>` is what `f` returns.
///
/// # Errors
/// What does not fit, as a sentence.
pub fn check_query(
    functions: &BTreeMap<String, ContractFunction>,
    f: &ContractFunction,
    query: &str,
) -> std::result::Result<(), String> {
    let name = &f.name;
    let Some(q) = functions.get(query) else {
        return Err(format!(
            "`{name}` is queryable-by `{query}`, which is not a function of this interface"
        ));
    };
    if !f.semantics.class.has_effect() {
        return Err(format!(
            "`{name}` is a read: it has no outcome to reconcile, so it takes no queryable-by"
        ));
    }
    if !f.params.iter().any(|(_, s)| holds_host_supplied(s)) {
        return Err(format!(
            "`{name}` is queryable-by `{query}`, but its request has no host-supplied field (an idempotency key) to look the call up by"
        ));
    }
    if !q.semantics.host_only {
        return Err(format!(
            "`{query}` reconciles `{name}`, so it must be host-only (`host-only = true`)"
        ));
    }
    let only_keys = matches!(q.params.as_slice(), [(_, Shape::Record(fields))]
        if !fields.is_empty() && fields.iter().all(|(_, s, _)| matches!(s, Shape::HostSupplied(_))));
    if !only_keys {
        return Err(format!(
            "`{query}` must take one record whose fields are all host-supplied (the key of the call it looks up)"
        ));
    }
    let (Some((ok, err)), Some((qok, qerr))) = (result_arms(f), result_arms(q)) else {
        return Err(format!(
            "`{name}` and `{query}` must both return `result<_, _>`"
        ));
    };
    let fits = match (ok, qok) {
        (Some(t), Some(Shape::Option(inner))) => *t == **inner,
        _ => false,
    } && err == qerr;
    if !fits {
        return Err(format!(
            "`{query}` must return `result<option<T>, E>` where `{name}` returns `result<T, E>`"
        ));
    }
    Ok(())
}

/// Checks that `undo` can compensate a completed call of `f`: `f` is a
/// `reversible-mutation`; `undo` changes something, takes one record whose fields are
/// each a handle of a kind `f`'s result carries or host-supplied (at least one handle:
/// what to undo, as the original call reported it), and returns `result<_, E>` with
/// `f`'s error type.
///
/// # Errors
/// What does not fit, as a sentence.
pub fn check_undo(
    functions: &BTreeMap<String, ContractFunction>,
    f: &ContractFunction,
    undo: &str,
) -> std::result::Result<(), String> {
    let name = &f.name;
    let Some(u) = functions.get(undo) else {
        return Err(format!(
            "`{name}` is compensable-by `{undo}`, which is not a function of this interface"
        ));
    };
    if f.semantics.class != EffectClass::ReversibleMutation {
        return Err(format!(
            "`{name}` is {}: only a reversible-mutation can be compensable",
            f.semantics.class
        ));
    }
    if !u.semantics.class.has_effect() {
        return Err(format!(
            "`{undo}` undoes `{name}`, so it changes something: its class may not be read"
        ));
    }
    let Some(minted) = f.result.as_ref() else {
        return Err(format!("`{name}` returns nothing `{undo}` could undo by"));
    };
    let fits = match u.params.as_slice() {
        [(_, Shape::Record(fields))] => {
            fields
                .iter()
                .any(|(_, s, _)| matches!(s, Shape::Handle(k) if carries(minted, k)))
                && fields.iter().all(|(_, s, _)| match s {
                    Shape::Handle(k) => carries(minted, k),
                    Shape::HostSupplied(_) => true,
                    _ => false,
                })
        }
        _ => false,
    };
    if !fits {
        return Err(format!(
            "`{undo}` must take one record whose fields are handles `{name}` returns (what to undo) or host-supplied"
        ));
    }
    match (result_arms(f), result_arms(u)) {
        (Some((_, err)), Some((_, uerr))) if err == uerr => Ok(()),
        _ => Err(format!(
            "`{undo}` must return `result<_, E>` with the error type `{name}` returns"
        )),
    }
}

/// Whether a host-supplied value occurs anywhere in `shape`.
fn holds_host_supplied_deep(shape: &Shape) -> bool {
    match shape {
        Shape::HostSupplied(_) => true,
        Shape::List(s) | Shape::Option(s) => holds_host_supplied_deep(s),
        Shape::Tuple(items) => items.iter().any(holds_host_supplied_deep),
        Shape::Record(fields) => fields.iter().any(|(_, s, _)| holds_host_supplied_deep(s)),
        Shape::Variant(cases) => cases
            .iter()
            .flat_map(|(_, s)| s)
            .any(holds_host_supplied_deep),
        Shape::Result { ok, err } => ok.iter().chain(err).any(|s| holds_host_supplied_deep(s)),
        _ => false,
    }
}

fn holds_host_supplied(shape: &Shape) -> bool {
    match shape {
        Shape::HostSupplied(_) => true,
        Shape::Record(fields) => fields.iter().any(|(_, s, _)| holds_host_supplied(s)),
        _ => false,
    }
}

#[cfg(test)]
mod tests;
