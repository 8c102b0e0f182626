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
            let withheld = match &loaded {
                Err(why) => Some(format!(
                    "the contract package in {} does not load: {why}",
                    path.display()
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
