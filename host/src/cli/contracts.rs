//! `airlock contracts`: the contract packages a configuration offers, what each function
//! does, what changed between two versions, and their review (`list`, `show`, `diff`,
//! `approve`, `mark-erroneous`).
//!
//! Rule: what these commands show is what a host of the same configuration and store
//! would serve ([`crate::registry::contracts::ContractSet::judge`]): a package is listed
//! as served only when the host would let a mapping bind it. Approval pins the package's
//! digest with its files, traced; it is refused for a package that does not load.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use anyhow::{Context as _, Result, bail};
use serde::Serialize;
use serde_json::Value;

use crate::config::ServeConfig;
use crate::contract::Contract;
use crate::contract::package::ContractPackage;
use crate::registry::contracts::ContractSet;
use crate::store::{ContractRecord, NewContractApproval, Store};

/// One package in `airlock contracts list`.
#[derive(Debug, Serialize)]
pub struct ListedPackage {
    /// `namespace:name@version`, or `None` for a folder that does not load.
    pub package: Option<String>,
    /// `built-in wit/v0.1.0` or the folder.
    pub origin: String,
    /// The package digest, when it loads.
    pub digest: Option<String>,
    /// `built-in`, `served` (approved, proven) or `withheld`.
    pub status: &'static str,
    /// Why it is withheld.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub withheld: Option<String>,
    /// Its review, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub review: Option<ContractRecord>,
    /// Its interfaces.
    pub interfaces: Vec<String>,
}

/// The packages a host of `config` (or one without a configuration) would know.
///
/// # Errors
/// The store fails.
pub fn list(set: &ContractSet, store: Option<&dyn Store>) -> Result<Vec<ListedPackage>> {
    let review = |name: &str| -> Result<Option<ContractRecord>> {
        match store {
            Some(s) => s.contract_review(name),
            None => Ok(None),
        }
    };
    let mut out = Vec::new();
    for p in crate::contract::Contracts::built_in().packages() {
        out.push(ListedPackage {
            package: Some(p.name.clone()),
            origin: p.origin.clone(),
            digest: Some(p.digest.clone()),
            status: "built-in",
            withheld: None,
            review: None,
            interfaces: p.interfaces.keys().cloned().collect(),
        });
    }
    for c in &set.configured {
        let (package, digest, interfaces) = match &c.loaded {
            Ok(p) => (
                Some(p.name.clone()),
                Some(p.digest.clone()),
                p.interfaces.keys().cloned().collect(),
            ),
            Err(_) => (None, None, Vec::new()),
        };
        out.push(ListedPackage {
            review: match &package {
                Some(name) => review(name)?,
                None => None,
            },
            package,
            origin: c.path.display().to_string(),
            digest,
            status: if c.withheld.is_some() {
                "withheld"
            } else {
                "served"
            },
            withheld: c.withheld.clone(),
            interfaces,
        });
    }
    Ok(out)
}

/// Text for `airlock contracts list`.
pub fn list_text(list: &[ListedPackage]) -> String {
    let mut o = String::new();
    for p in list {
        let _ = writeln!(
            o,
            "{}  {}  {}",
            p.package.as_deref().unwrap_or("(does not load)"),
            p.status,
            p.origin
        );
        if let Some(d) = &p.digest {
            let _ = writeln!(o, "  digest   {d}");
        }
        if let Some(r) = &p.review {
            let _ = writeln!(
                o,
                "  review   {} by {} at {}{}",
                r.state,
                crate::cli::operate::safe_lines(&r.reviewer),
                crate::cli::operate::time(r.state_changed_ms),
                if r.digest == p.digest.clone().unwrap_or_default() {
                    String::new()
                } else {
                    format!(" (approved digest {})", r.digest)
                }
            );
        }
        for i in &p.interfaces {
            let _ = writeln!(o, "  offers   {i}");
        }
        if let Some(w) = &p.withheld {
            // Reasons quote package files: escaped, so no control character reaches the
            // reviewer's terminal.
            for line in crate::cli::operate::safe_lines(w).lines() {
                let _ = writeln!(o, "  withheld {line}");
            }
        }
    }
    if list.iter().any(|p| p.status == "withheld") {
        o.push_str("\nA withheld package's mappings do not load. Approve a package with `airlock contracts approve NAME --config FILE --reviewer NAME` after reading `airlock contracts show NAME`.\n");
    }
    o
}

/// One function in `airlock contracts show`.
#[derive(Debug, Serialize)]
pub struct ShownFunction {
    /// The WIT name.
    pub name: String,
    /// Its declared semantics.
    pub semantics: crate::contract::EffectSemantics,
    /// `queryable-by`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queryable_by: Option<String>,
    /// `compensable-by`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compensable_by: Option<String>,
    /// What the model would be asked for: the JSON Schema of its one record parameter
    /// (`None` for a host-only function or one that takes no single record).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input_schema: Option<Value>,
}

/// One interface in `airlock contracts show`.
#[derive(Debug, Serialize)]
pub struct ShownInterface {
    /// `namespace:name/interface@version`.
    pub interface: String,
    /// Its doc comment.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub docs: Option<String>,
    /// The most consequential class the model may reach through it.
    pub effect_class: crate::contract::EffectClass,
    /// Its functions, by name.
    pub functions: Vec<ShownFunction>,
    /// Its handle kinds.
    pub handles: BTreeMap<String, crate::contract::HandleKind>,
}

/// `airlock contracts show`.
#[derive(Debug, Serialize)]
pub struct ShownPackage {
    /// The package.
    pub package: String,
    /// Where it comes from.
    pub origin: String,
    /// Its digest.
    pub digest: String,
    /// `built-in`, `served` or `withheld`.
    pub status: String,
    /// Why it is withheld.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub withheld: Option<String>,
    /// Its interfaces.
    pub interfaces: Vec<ShownInterface>,
}

fn shown_interface(c: &Contract) -> ShownInterface {
    ShownInterface {
        interface: c.interface.clone(),
        docs: c.docs.as_deref().map(str::trim).map(str::to_string),
        effect_class: c.most_consequential(),
        functions: c
            .functions
            .values()
            .map(|f| ShownFunction {
                name: f.name.clone(),
                semantics: f.semantics,
                queryable_by: f.query.clone(),
                compensable_by: f.undo.clone(),
                input_schema: match f.params.as_slice() {
                    [(_, shape @ crate::contract::Shape::Record(_))] if !f.semantics.host_only => {
                        Some(crate::contract::json_schema(shape))
                    }
                    _ => None,
                },
            })
            .collect(),
        handles: c
            .handles
            .iter()
            .map(|(k, h)| (k.clone(), h.clone()))
            .collect(),
    }
}

/// The package named `name` (a package `namespace:name@version`, or one of its
/// interfaces), as a host of `set` sees it.
///
/// # Errors
/// No built-in or configured package has that name.
pub fn show(set: &ContractSet, name: &str) -> Result<ShownPackage> {
    let matches = |p: &ContractPackage| p.name == name || p.interfaces.contains_key(name);
    let shown = |p: &ContractPackage, status: &str, withheld: Option<String>| ShownPackage {
        package: p.name.clone(),
        origin: p.origin.clone(),
        digest: p.digest.clone(),
        status: status.to_string(),
        withheld,
        interfaces: p.interfaces.values().map(|c| shown_interface(c)).collect(),
    };
    for p in crate::contract::Contracts::built_in().packages() {
        if matches(p) {
            return Ok(shown(p, "built-in", None));
        }
    }
    for c in &set.configured {
        if let Ok(p) = &c.loaded
            && matches(p)
        {
            let status = if c.withheld.is_some() {
                "withheld"
            } else {
                "served"
            };
            return Ok(shown(p, status, c.withheld.clone()));
        }
    }
    bail!(
        "no contract package or interface named `{name}`; known: {}",
        known(set).join(", ")
    )
}

fn known(set: &ContractSet) -> Vec<String> {
    crate::contract::Contracts::built_in()
        .packages()
        .iter()
        .map(|p| p.name.clone())
        .chain(
            set.configured
                .iter()
                .filter_map(|c| c.loaded.as_ref().ok().map(|p| p.name.clone())),
        )
        .collect()
}

impl ShownPackage {
    /// Text for `airlock contracts show`.
    pub fn to_text(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "Contract package {}  ({})", self.package, self.status);
        let _ = writeln!(o, "  origin   {}", self.origin);
        let _ = writeln!(o, "  digest   {}", self.digest);
        if let Some(w) = &self.withheld {
            let _ = writeln!(o, "  withheld {}", crate::cli::operate::safe_lines(w));
        }
        for i in &self.interfaces {
            let _ = writeln!(
                o,
                "\ninterface {}  (at most: {})",
                i.interface, i.effect_class
            );
            if let Some(d) = &i.docs {
                for line in crate::cli::operate::safe_lines(d).lines() {
                    let _ = writeln!(o, "  {line}");
                }
            }
            for f in &i.functions {
                let s = &f.semantics;
                let mut flags = vec![s.class.as_str().to_string()];
                flags.push(
                    if s.idempotent {
                        "idempotent"
                    } else {
                        "not idempotent"
                    }
                    .into(),
                );
                if let Some(q) = &f.queryable_by {
                    flags.push(format!("queryable by {q}"));
                }
                if let Some(u) = &f.compensable_by {
                    flags.push(format!("compensable by {u}"));
                }
                if s.host_only {
                    flags.push("host only: never offered to the model".into());
                }
                let _ = writeln!(o, "\n  function {}  [{}]", f.name, flags.join("; "));
                if let Some(schema) = &f.input_schema {
                    let text = serde_json::to_string_pretty(schema).unwrap_or_default();
                    for line in text.lines() {
                        let _ = writeln!(o, "    {line}");
                    }
                }
            }
            for (kind, h) in &i.handles {
                let _ = writeln!(
                    o,
                    "\n  handle {kind}: identified by {}; minted by {}; consumed by {}",
                    if h.identity.is_empty() {
                        "its locator alone".to_string()
                    } else {
                        h.identity.join(", ")
                    },
                    h.minted_by.join(", "),
                    if h.consumed_by.is_empty() {
                        "nothing".to_string()
                    } else {
                        h.consumed_by.join(", ")
                    }
                );
            }
        }
        o
    }
}

/// `airlock contracts approve NAME`: pins the configured package named `name` (its digest
/// and files) as approved by `reviewer`, traced.
///
/// `digest`, when given, is the digest the reviewer read (`airlock contracts show`): the
/// package on disk must still have it.
///
/// # Errors
/// No configured package of that name loads; it is built in (nothing to approve); it no
/// longer has `digest`; the store refuses (another digest was approved under the name, or
/// it was marked erroneous).
pub fn approve(
    config: &ServeConfig,
    store: &dyn Store,
    name: &str,
    reviewer: &str,
    reason: &str,
    digest: Option<&str>,
) -> Result<ContractRecord> {
    if reviewer.trim().is_empty() {
        bail!("--reviewer must name who approves");
    }
    if crate::contract::Contracts::built_in()
        .packages()
        .iter()
        .any(|p| p.name == name)
    {
        bail!("`{name}` is built in: it ships reviewed with Airlock and needs no approval");
    }
    let set = ContractSet::judge(config, Some(store))?;
    let mut problems = Vec::new();
    for c in &set.configured {
        match &c.loaded {
            Ok(p) if p.name == name => {
                if let Some(read) = digest
                    && read != p.digest
                {
                    bail!(
                        "contract package `{name}` in {} has digest {} now, not {read} (the one you read): read it again with `airlock contracts show`",
                        p.origin,
                        p.digest
                    );
                }
                let files = serde_json::to_string(p.files.files())
                    .context("encoding the package's files")?;
                return store.approve_contract(&NewContractApproval {
                    package: p.name.clone(),
                    digest: p.digest.clone(),
                    reviewer: reviewer.to_string(),
                    reason: reason.to_string(),
                    files,
                });
            }
            Ok(_) => {}
            Err(why) => problems.push(format!("{}: {why}", c.path.display())),
        }
    }
    let mut text = format!(
        "the configuration names no contract package `{name}` that loads (it names: {})",
        known(&set).join(", ")
    );
    for p in problems {
        text += "\n";
        text += &p;
    }
    bail!(text)
}

/// `airlock contracts diff`: what changed from `old` to `new`.
#[derive(Debug, Serialize)]
pub struct PackageDiff {
    /// The old package and digest.
    pub old: String,
    /// The new package and digest.
    pub new: String,
    /// Each change, breaking ones marked.
    pub changes: Vec<crate::contract::diff::Change>,
}

/// Finds the package a `diff` argument names: a folder (a path that is a directory),
/// `approved:NAME` (the files the store's review of NAME pinned), or the name of a
/// built-in or configured package.
///
/// # Errors
/// Nothing of that name; a folder or stored files that do not load.
pub fn resolve(
    set: &ContractSet,
    store: Option<&dyn Store>,
    arg: &str,
) -> Result<std::sync::Arc<ContractPackage>> {
    use crate::contract::package::{PackageFiles, load};
    let path = std::path::Path::new(arg);
    if path.is_dir() {
        return Ok(std::sync::Arc::new(load(&PackageFiles::read_dir(path)?)?));
    }
    if let Some(name) = arg.strip_prefix("approved:") {
        let review = match store {
            Some(s) => s.contract_review(name)?,
            None => None,
        }
        .with_context(|| format!("the store has no review of contract package `{name}`"))?;
        let files: BTreeMap<String, String> = serde_json::from_str(&review.files)
            .context("the stored files of the review do not parse")?;
        let files = PackageFiles::new(
            format!("approved {name}"),
            files.iter().map(|(p, t)| (p.as_str(), t.as_str())),
        )?;
        return Ok(std::sync::Arc::new(load(&files)?));
    }
    let built_in = crate::contract::Contracts::built_in().packages().iter();
    let configured = set.configured.iter().filter_map(|c| c.loaded.as_ref().ok());
    built_in
        .chain(configured)
        .find(|p| p.name == arg)
        .cloned()
        .with_context(|| {
            format!(
                "`{arg}` is not a folder, `approved:NAME`, or a known package ({})",
                known(set).join(", ")
            )
        })
}

/// `airlock contracts diff OLD NEW`.
///
/// # Errors
/// As [`resolve`].
pub fn diff(
    set: &ContractSet,
    store: Option<&dyn Store>,
    old: &str,
    new: &str,
) -> Result<PackageDiff> {
    let (o, n) = (resolve(set, store, old)?, resolve(set, store, new)?);
    Ok(PackageDiff {
        old: format!("{} ({})", o.name, o.digest),
        new: format!("{} ({})", n.name, n.digest),
        changes: crate::contract::diff::diff(&o, &n),
    })
}

impl PackageDiff {
    /// Text for `airlock contracts diff`.
    pub fn to_text(&self) -> String {
        let mut o = format!(
            "from {}
  to {}
",
            self.old, self.new
        );
        if self.changes.is_empty() {
            o.push_str(
                "
no change in functions, semantics, arguments, results or handles
",
            );
            return o;
        }
        for c in &self.changes {
            let _ = writeln!(
                o,
                "{} {}: {}: {}",
                if c.breaking { "!" } else { "+" },
                c.interface,
                c.item,
                c.what
            );
        }
        let breaking = self.changes.iter().filter(|c| c.breaking).count();
        let _ = writeln!(
            o,
            "
{breaking} breaking change(s) (!): a mapping bound to the old version keeps serving it until it is reviewed again against the new one"
        );
        o
    }
}
