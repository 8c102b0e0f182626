//! The live catalogue: the loaded mappings and the capabilities they offer, at one
//! moment.
//!
//! Rules:
//! - **A catalog is never changed, only replaced**: [`Catalog::with`] and
//!   [`Catalog::without`] build the next one, which the host swaps in atomically; a call
//!   keeps the catalog (and so the mapping revision) it started with.
//! - **One capability name, one mapping**: a catalog in which two mappings offer the same
//!   name is refused ([`Catalog::with`]).
//! - **Only serving mappings are offered**: every loaded capability stays in the catalog,
//!   but [`Catalog::offered`] yields only those whose mapping's record is `limited` or
//!   `active` now.
//! - **Every load is its own generation**: each [`ActiveMapping`] carries a load
//!   generation unique in this process, so a reference minted under one load never
//!   resolves under another.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Result, bail};
use arc_swap::ArcSwap;
use rmcp::model::JsonObject;

use super::connections::ConnectionState;
use crate::contract::{ContractFunction, EffectSemantics};
use crate::runtime::{LoadedAdapter, UpstreamGrant};
use crate::store::MappingRecord;

/// One loaded mapping revision: its adapter, what it may reach upstream, the connection it
/// is bound to, and its current record (revision, lifecycle state, pins).
pub struct ActiveMapping {
    /// The mapping's name.
    pub name: String,
    /// The compiled adapter.
    pub adapter: LoadedAdapter,
    /// What the adapter may reach upstream.
    pub grant: Arc<UpstreamGrant>,
    /// The upstream tools the manifest lists (each must stay pinned to serve).
    pub tools: Vec<String>,
    /// The connection this mapping is bound to.
    pub connection: Arc<ConnectionState>,
    /// sha256 of the manifest text this revision was loaded from.
    pub manifest_digest: String,
    /// Where the manifest came from (`None` for in-memory sources).
    pub manifest_path: Option<PathBuf>,
    /// This load's generation: unique per loaded mapping in this process.
    pub generation: u64,
    /// The contract interface it implements, e.g. `airlock:contracts/source-retrieval@0.1.0`.
    pub contract: String,
    /// The reviewed data class (`[mapping] data_class`).
    pub data_class: String,
    /// The contract's host-only query function, when a capability of this mapping is
    /// reconciled through one ([`contract::query_function`]).
    pub query: Option<ContractFunction>,
    /// Set once the intents this mapping's calls left open (unknown, or prepared by a
    /// host that stopped) were reconciled: no call of the mapping runs before.
    pub reconciled: tokio::sync::OnceCell<()>,
    /// On a shared store, when intents that other, stopped hosts left open were last
    /// looked for (see [`crate::pipeline::reconcile::before_calls`]).
    pub swept: std::sync::Mutex<Option<std::time::Instant>>,
    pub(super) record: ArcSwap<MappingRecord>,
}

impl ActiveMapping {
    /// The mapping's current record as this host knows it.
    pub fn record(&self) -> Arc<MappingRecord> {
        self.record.load_full()
    }

    /// True when the mapping may serve new calls (`limited` or `active`).
    pub fn serves(&self) -> bool {
        self.record.load().state.serves()
    }

    /// Replaces the mapping's record as this host knows it.
    pub fn set_record(&self, record: MappingRecord) {
        self.record.store(Arc::new(record));
    }
}

/// Source of load generations.
static NEXT_GENERATION: AtomicU64 = AtomicU64::new(1);

/// A load generation no other load in this process had or will have.
pub(super) fn next_generation() -> u64 {
    NEXT_GENERATION.fetch_add(1, Ordering::Relaxed)
}

/// One model-facing capability.
pub struct Capability {
    /// Local name (what the model calls).
    pub name: String,
    /// Reviewed description.
    pub description: String,
    /// The contract function it runs.
    pub function: ContractFunction,
    /// The derived input schema (a closed JSON object schema).
    pub input_schema: Arc<JsonObject>,
    /// Its effective semantics: the host's declaration for the function, confirmed by the
    /// reviewed mapping and narrowed where it says so (never widened; never from server
    /// annotations).
    pub semantics: EffectSemantics,
    /// The mapping that serves it.
    pub mapping: Arc<ActiveMapping>,
}

/// The loaded mappings and their capabilities at one moment. Swapped atomically on
/// reload; a call keeps the catalog (and mapping revision) it started with.
#[derive(Default)]
pub struct Catalog {
    /// Every loaded capability, serving or not (see [`Catalog::offered`]).
    pub capabilities: Vec<Capability>,
    /// Loaded mappings by name.
    pub mappings: BTreeMap<String, Arc<ActiveMapping>>,
}

impl Catalog {
    /// The capabilities offered to the model now: those whose mapping serves.
    pub fn offered(&self) -> impl Iterator<Item = &Capability> {
        self.capabilities.iter().filter(|c| c.mapping.serves())
    }

    /// Looks a capability up by its local name.
    pub fn capability(&self, name: &str) -> Option<&Capability> {
        self.capabilities.iter().find(|c| c.name == name)
    }
}

/// A bound mapping and its capabilities.
pub type LoadedMapping = (Arc<ActiveMapping>, Vec<Capability>);

impl Capability {
    fn clone_shallow(&self) -> Self {
        Self {
            name: self.name.clone(),
            description: self.description.clone(),
            function: self.function.clone(),
            input_schema: self.input_schema.clone(),
            semantics: self.semantics,
            mapping: self.mapping.clone(),
        }
    }
}

impl Catalog {
    /// This catalog with `added` in place of any loaded mapping of the same name (and of
    /// that mapping's capabilities).
    ///
    /// # Errors
    /// A capability name `added` offers is already offered by another mapping.
    pub fn with(&self, added: LoadedMapping) -> Result<Catalog> {
        let (mapping, caps) = added;
        let mut capabilities: Vec<Capability> = self
            .capabilities
            .iter()
            .filter(|c| c.mapping.name != mapping.name)
            .map(Capability::clone_shallow)
            .collect();
        for cap in caps {
            if let Some(other) = capabilities.iter().find(|c| c.name == cap.name) {
                bail!(
                    "capability name `{}` is offered by two mappings (`{}` and `{}`)",
                    cap.name,
                    other.mapping.name,
                    mapping.name
                );
            }
            capabilities.push(cap);
        }
        let mut mappings = self.mappings.clone();
        mappings.insert(mapping.name.clone(), mapping);
        Ok(Catalog {
            capabilities,
            mappings,
        })
    }

    /// This catalog without mapping `name` and its capabilities.
    pub fn without(&self, name: &str) -> Catalog {
        Catalog {
            capabilities: self
                .capabilities
                .iter()
                .filter(|c| c.mapping.name != name)
                .map(Capability::clone_shallow)
                .collect(),
            mappings: self
                .mappings
                .iter()
                .filter(|(n, _)| *n != name)
                .map(|(n, m)| (n.clone(), m.clone()))
                .collect(),
        }
    }
}
