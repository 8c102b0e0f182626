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
    /// The contract it implements; its interface names it, e.g.
    /// `airlock:contracts/source-retrieval@0.1.0`.
    pub contract: Arc<crate::contract::Contract>,
    /// The reviewed data class (`[mapping] data_class`).
    pub data_class: String,
    /// The contract's host-only query function of each capability reconciled through one
    /// ([`crate::contract::Contract::query_function`]), by capability name: only those
    /// the mapping keeps `queryable`. Each intent is asked with its own capability's query
    /// (two capabilities of one mapping may have different ones).
    pub queries: std::collections::BTreeMap<String, ContractFunction>,
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use airlock_fixture_notes::ServeOptions;

    use super::*;
    use crate::registry::connections::ConnectionStatus;
    use crate::registry::live::Live;
    use crate::registry::testkit::{self, Notes};

    /// `source-library` under another mapping name with its capabilities renamed by
    /// `rename` (`search_sources`, `retrieve_source` → new names).
    fn another(name: &str, search: &str, retrieve: &str) -> crate::registry::live::MappingSource {
        testkit::source_library(|t| {
            t.replace("name = \"source-library\"", &format!("name = \"{name}\""))
                .replace("name = \"search_sources\"", &format!("name = \"{search}\""))
                .replace(
                    "name = \"retrieve_source\"",
                    &format!("name = \"{retrieve}\""),
                )
        })
    }

    /// Two mappings on the notes fixture (`source-library`, `library-two`), and a third
    /// whose capability names clash with the first, which is refused at start.
    async fn two_mappings(notes: &Notes) -> (Arc<Live>, tempfile::TempDir) {
        let sources = vec![
            testkit::source_library(|t| t),
            another("library-two", "search_two", "retrieve_two"),
            another("clash", "search_sources", "retrieve_other"),
        ];
        testkit::start(notes, "", sources).await
    }

    fn shallow(catalog: &Catalog, mapping: &str) -> LoadedMapping {
        (
            catalog.mappings[mapping].clone(),
            catalog
                .capabilities
                .iter()
                .filter(|c| c.mapping.name == mapping)
                .map(Capability::clone_shallow)
                .collect(),
        )
    }

    /// `with` and `without` build a new catalog and leave the one a call holds as it
    /// was; putting a mapping back in place of itself is no clash.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_catalog_is_replaced_never_changed() {
        let notes = Notes::serve(ServeOptions::default()).await;
        let (live, _state) = two_mappings(&notes).await;
        let held = live.catalog();
        assert_eq!(held.mappings.len(), 2);
        assert_eq!(held.capabilities.len(), 4);

        let without = held.without("library-two");
        assert_eq!(
            without.mappings.keys().collect::<Vec<_>>(),
            ["source-library"]
        );
        assert_eq!(without.capabilities.len(), 2);
        assert!(without.capability("search_two").is_none());
        assert_eq!(held.capabilities.len(), 4, "the held catalog is unchanged");

        let again = without.with(shallow(&held, "library-two")).unwrap();
        assert_eq!(again.mappings.len(), 2);
        assert_eq!(again.capabilities.len(), 4);
        let replaced = held.with(shallow(&held, "source-library")).unwrap();
        assert_eq!(replaced.capabilities.len(), 4, "replaced, not doubled");
        assert!(Arc::ptr_eq(
            &replaced.capability("search_sources").unwrap().mapping,
            &held.mappings["source-library"]
        ));
        live.shutdown(Duration::from_secs(1)).await;
    }

    /// A capability name already offered by another mapping is refused, naming both
    /// mappings; at start such a mapping is refused alone (traced), the others load.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_capability_name_one_mapping() {
        let notes = Notes::serve(ServeOptions::default()).await;
        let (live, _state) = two_mappings(&notes).await;
        let catalog = live.catalog();
        assert!(!catalog.mappings.contains_key("clash"));
        let kinds = testkit::trace_kinds(&live);
        assert!(
            kinds.contains(&(
                crate::registry::events::MAPPING_LOAD_FAILED.to_string(),
                "clash".to_string()
            )),
            "{kinds:?}"
        );

        let (two, mut caps) = shallow(&catalog, "library-two");
        caps[0].name = "retrieve_source".into();
        let Err(e) = catalog.without("library-two").with((two, caps)) else {
            panic!("two mappings offer `retrieve_source`: refused")
        };
        assert_eq!(
            e.to_string(),
            "capability name `retrieve_source` is offered by two mappings (`source-library` and `library-two`)"
        );
        live.shutdown(Duration::from_secs(1)).await;
    }

    /// Every loaded capability stays in the catalog; only those of a serving mapping are
    /// offered, and that follows the mapping's record without a new catalog.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn only_serving_mappings_are_offered() {
        let notes = Notes::serve(ServeOptions::default()).await;
        let (live, _state) = two_mappings(&notes).await;
        let connection = live.catalog().mappings["source-library"].connection.clone();
        testkit::until("the connection is ready", || {
            *connection.status() == ConnectionStatus::Ready
        })
        .await;
        let held = live.catalog();
        assert_eq!(held.offered().count(), 0, "nothing is approved");
        testkit::approve(&live, "source-library");
        live.sync_with_store().await.unwrap();
        let offered: Vec<&str> = held.offered().map(|c| c.name.as_str()).collect();
        assert_eq!(offered, ["search_sources", "retrieve_source"]);
        assert_eq!(held.capabilities.len(), 4, "the others stay loaded");
        assert!(held.capability("search_two").is_some());
        live.shutdown(Duration::from_secs(1)).await;
    }

    /// Every load gets a generation no other load in this process had.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_load_is_its_own_generation() {
        let first = next_generation();
        assert!(next_generation() > first);
        let notes = Notes::serve(ServeOptions::default()).await;
        let (live, _state) = two_mappings(&notes).await;
        let (other, _other_state) = two_mappings(&notes).await;
        let mut seen = std::collections::BTreeSet::new();
        for host in [&live, &other] {
            for mapping in host.catalog().mappings.values() {
                assert!(mapping.generation > first);
                assert!(
                    seen.insert(mapping.generation),
                    "generation {} twice",
                    mapping.generation
                );
            }
        }
        assert_eq!(seen.len(), 4);
        live.shutdown(Duration::from_secs(1)).await;
        other.shutdown(Duration::from_secs(1)).await;
    }
}
