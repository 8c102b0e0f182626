//! Which contracts a host serves: the built-in packages (reviewed with Airlock itself),
//! and each operator package the serve configuration names (`[[contract]] path`) whose
//! digest a person approved (`airlock contracts approve`), the approval proven by the
//! trace.
//!
//! Rule: a mapping binds only a contract this set serves ([`ContractSet::get`]). A
//! configured package that is not approved, was approved with another digest (it changed
//! on disk after review: a changed package is a new version), was marked erroneous, whose
//! approval the trace does not prove, or that does not load at all, is withheld: its
//! mappings are refused with that reason and nothing else is affected. The set is
//! computed from the folders and the store each time mappings are loaded, so an approval,
//! a correction or an edited folder takes effect on the next load of the mappings that
//! use it.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Result, bail};

use crate::config::ServeConfig;
use crate::contract::{Contract, Contracts, package};
use crate::store::{ContractState, Store};

/// One configured operator package, as this host sees it now.
#[derive(Debug, Clone)]
pub struct ConfiguredPackage {
    /// The folder (`[[contract]] path`).
    pub path: PathBuf,
    /// The package as loaded from it, or why it does not load.
    pub loaded: std::result::Result<Arc<package::ContractPackage>, String>,
    /// Why it is withheld (`None`: it serves).
    pub withheld: Option<String>,
}

/// The contracts a host serves now, and what it withholds and why.
#[derive(Debug, Clone)]
pub struct ContractSet {
    /// The contracts mappings may bind: the built-ins and the approved packages.
    pub servable: Contracts,
    /// Every configured operator package, in configuration order.
    pub configured: Vec<ConfiguredPackage>,
}

impl ContractSet {
    /// The built-in contracts alone (no configuration).
    pub fn built_in() -> Self {
        Self {
            servable: Contracts::built_in().clone(),
            configured: Vec::new(),
        }
    }

    /// Loads `config`'s packages and judges each against its review in `store` (`None`:
    /// there is no store yet, so nothing is approved).
    ///
    /// # Errors
    /// The store fails (a package that does not load is withheld, not an error).
    pub fn judge(config: &ServeConfig, store: Option<&dyn Store>) -> Result<Self> {
        let mut servable = Contracts::built_in().clone();
        let mut configured = Vec::new();
        for path in &config.contract_packages {
            let loaded = package::PackageFiles::read_dir(path)
                .and_then(|files| package::load(&files))
                .map(Arc::new)
                .map_err(|e| format!("{e:#}"));
            let built_in = |name: &str| {
                Contracts::built_in()
                    .packages()
                    .iter()
                    .any(|b| b.name == name)
            };
            let withheld = match &loaded {
                Err(why) => Some(format!(
                    "the contract package in {} does not load: {why}",
                    path.display()
                )),
                Ok(p) if built_in(&p.name) => Some(format!(
                    "`{}` is built into this host and serves from there; remove this [[contract]] entry",
                    p.name
                )),
                Ok(p) => withheld(p, store)?,
            };
            if let (Ok(p), None) = (&loaded, &withheld)
                && let Err(e) = servable.add((**p).clone())
            {
                configured.push(ConfiguredPackage {
                    path: path.clone(),
                    withheld: Some(format!("{e:#}")),
                    loaded,
                });
                continue;
            }
            configured.push(ConfiguredPackage {
                path: path.clone(),
                loaded,
                withheld,
            });
        }
        Ok(Self {
            servable,
            configured,
        })
    }

    /// The contract named `interface` as a loaded package declares it, served or withheld:
    /// for checking what an author writes against a package not yet approved.
    pub fn declared(&self, interface: &str) -> Option<Arc<Contract>> {
        self.servable.get(interface).ok().or_else(|| {
            self.configured.iter().find_map(|p| {
                p.loaded
                    .as_ref()
                    .ok()
                    .and_then(|pkg| pkg.interfaces.get(interface).cloned())
            })
        })
    }

    /// The contract named `interface`, if this host serves it.
    ///
    /// # Errors
    /// It is withheld (the message says why and what to do), or no package declares it
    /// (the message lists what does).
    pub fn get(&self, interface: &str) -> Result<Arc<Contract>> {
        if let Ok(c) = self.servable.get(interface) {
            return Ok(c);
        }
        for p in &self.configured {
            let declares = p
                .loaded
                .as_ref()
                .is_ok_and(|pkg| pkg.interfaces.contains_key(interface));
            if let (true, Some(why)) = (declares, &p.withheld) {
                bail!("contract `{interface}` is not served: {why}");
            }
        }
        let broken: Vec<String> = self
            .configured
            .iter()
            .filter(|p| p.loaded.is_err())
            .map(|p| p.path.display().to_string())
            .collect();
        let mut text = format!(
            "unknown contract `{interface}`; this host serves: {}",
            self.servable.interfaces().join(", ")
        );
        if !broken.is_empty() {
            text += &format!(
                " (configured packages that do not load: {})",
                broken.join(", ")
            );
        }
        bail!(text)
    }
}

/// Why `p` is withheld given its review in `store`, or `None` when it serves.
fn withheld(p: &package::ContractPackage, store: Option<&dyn Store>) -> Result<Option<String>> {
    let name = &p.name;
    let review = match store {
        Some(s) => s.contract_review(name)?,
        None => None,
    };
    let Some(review) = review else {
        return Ok(Some(format!(
            "contract package `{name}` (digest {}) is not approved: a reviewer runs `airlock contracts approve {name} --config FILE --reviewer NAME`",
            p.digest
        )));
    };
    if review.digest != p.digest {
        return Ok(Some(format!(
            "contract package `{name}` in {} has digest {}, but the approved `{name}` has digest {}: the package changed after review; a changed package is a new version",
            p.origin, p.digest, review.digest
        )));
    }
    if review.state == ContractState::Erroneous {
        return Ok(Some(format!(
            "contract package `{name}` was marked erroneous by {}: {}",
            review.reviewer, review.reason
        )));
    }
    let proofs = match store {
        Some(s) => s.contract_proofs(name)?,
        None => Vec::new(),
    };
    if let Some(why) = crate::store::contracts::disproof(&review, &proofs) {
        return Ok(Some(format!(
            "the approval of contract package `{name}` is not proven by the trace: {why}"
        )));
    }
    Ok(None)
}

/// What the serving state of a configuration's contracts depends on, cheaply: each
/// package folder's files (path, size, modification time; no parsing) and each review in
/// the store (package, digest, state). A host re-judges its contracts when it changes
/// ([`sync_contracts`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Fingerprint {
    files: Vec<(PathBuf, u64, Option<std::time::SystemTime>)>,
    reviews: Vec<(String, String, &'static str)>,
}

impl Fingerprint {
    /// Reads it for `config`'s packages and `store`'s reviews.
    ///
    /// # Errors
    /// The store fails.
    pub fn read(config: &ServeConfig, store: &dyn Store) -> Result<Self> {
        let mut files = Vec::new();
        for dir in &config.contract_packages {
            let mut push = |p: &std::path::Path| {
                let meta = std::fs::metadata(p).ok();
                files.push((
                    p.to_path_buf(),
                    meta.as_ref().map_or(0, |m| m.len()),
                    meta.and_then(|m| m.modified().ok()),
                ));
            };
            push(dir);
            for sub in [dir.clone(), dir.join("deps")] {
                let Ok(entries) = std::fs::read_dir(&sub) else {
                    continue;
                };
                let mut paths: Vec<PathBuf> =
                    entries.filter_map(|e| Some(e.ok()?.path())).collect();
                paths.sort();
                for p in paths {
                    push(&p);
                    if p.is_dir()
                        && sub.ends_with("deps")
                        && let Ok(inner) = std::fs::read_dir(&p)
                    {
                        let mut inner: Vec<PathBuf> =
                            inner.filter_map(|e| Some(e.ok()?.path())).collect();
                        inner.sort();
                        inner.iter().for_each(|q| push(q));
                    }
                }
            }
        }
        let reviews = if config.contract_packages.is_empty() {
            Vec::new()
        } else {
            store
                .contract_reviews()?
                .into_iter()
                .map(|r| (r.package, r.digest, r.state.as_str()))
                .collect()
        };
        Ok(Self { files, reviews })
    }
}

/// The interfaces `set` serves, each with its package digest.
pub fn served(set: &ContractSet) -> std::collections::BTreeMap<String, String> {
    set.servable
        .interfaces()
        .into_iter()
        .filter_map(|i| {
            let digest = set.servable.get(&i).ok()?.digest.clone();
            Some((i, digest))
        })
        .collect()
}

/// Brings a serving host in line with its contracts after `before` (the interfaces it
/// served, [`served`]): every loaded mapping whose contract is no longer served, or is
/// served from another package digest, is unloaded (it serves no new call); every
/// configured mapping not loaded whose contract is served now is loaded. Returns the
/// interfaces served now.
pub async fn sync_contracts(
    host: &std::sync::Arc<crate::host::Host>,
    before: &std::collections::BTreeMap<String, String>,
) -> Result<std::collections::BTreeMap<String, String>> {
    let set = ContractSet::judge(host.config(), Some(host.registry().store()))?;
    let now = served(&set);
    if &now == before {
        return Ok(now);
    }
    let live = host.live();
    let catalog = live.catalog.load_full();
    for (name, m) in &catalog.mappings {
        if now.get(&m.contract.interface) != Some(&m.contract.digest) {
            let why = set.get(&m.contract.interface).err().map_or_else(
                || "its contract package changed".to_string(),
                |e| format!("{e:#}"),
            );
            tracing::warn!(mapping = %name, contract = %m.contract.interface, "mapping unloaded: {why}");
            live.unload_mapping(name).await;
        }
    }
    let mut paths = host.config().mappings.clone();
    if let Some(dir) = &host.config().mappings_dir {
        paths.extend(crate::registry::live::mapping_dir_manifests(dir).unwrap_or_default());
    }
    for path in paths {
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        let Ok(m) =
            crate::registry::manifest::MappingManifest::parse(&text, &path.display().to_string())
        else {
            continue;
        };
        let loaded = live
            .catalog
            .load_full()
            .mappings
            .contains_key(&m.mapping.name);
        if !loaded
            && now.contains_key(&m.mapping.contract)
            && before.get(&m.mapping.contract) != now.get(&m.mapping.contract)
        {
            match live.load_mapping_file(&path).await {
                Ok(name) => {
                    tracing::info!(mapping = %name, contract = %m.mapping.contract, "mapping loaded: its contract is served now")
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), "loading a mapping whose contract is served now failed: {e:#}")
                }
            }
        }
    }
    Ok(now)
}
