//! Store sync: a running host follows what `airlock review` (or another host) recorded
//! in the store while it runs.
//!
//! Rule: **the store's latest revision of a loaded mapping decides whether it serves
//! here**, and only ever through a manifest this host loaded:
//!
//! | latest revision binds | and it | then |
//! |---|---|---|
//! | the loaded manifest | — | its state and pins decide (proven by the trace, judged against the snapshot) |
//! | a staged manifest | serves | the staged mapping is swapped in |
//! | another manifest | serves (approved ahead of deployment) | the loaded revision serves on until that manifest arrives |
//! | another manifest | does not serve (retired, review-required...) | the loaded revision stops serving too |

use std::sync::Arc;

use anyhow::Result;
use serde_json::json;

use super::catalog::Catalog;
use super::connections::ConnectionState;
use super::live::Live;
use crate::store::MappingRecord;

impl Live {
    /// Re-reads every loaded mapping's record from the store (an approval or retirement
    /// made by `airlock review` while this host runs) and applies it. Returns true when the
    /// offered catalog changed. Rules:
    /// - the latest revision binds the loaded manifest: its state and pins decide;
    /// - it binds a staged manifest and serves: the staged mapping is swapped in;
    /// - it binds another manifest and serves (approved ahead of deployment): the loaded
    ///   revision keeps serving until that manifest arrives;
    /// - it binds another manifest and does not serve (retired, review-required...): the
    ///   loaded revision stops serving too.
    ///
    /// # Errors
    /// The store fails.
    pub async fn sync_with_store(&self) -> Result<bool> {
        let _one = self.reload.lock().await;
        let catalog = self.catalog.load_full();
        let mut changed = false;
        let mut next: Option<Catalog> = None;
        for mapping in catalog.mappings.values() {
            let Some(latest) = self.registry.store().mapping(&mapping.name)? else {
                continue;
            };
            let current = mapping.record();
            if latest.revision == current.revision && latest.state == current.state {
                continue;
            }
            let was = mapping.serves();
            if latest.manifest_digest != mapping.manifest_digest {
                let staged = {
                    let mut staged = self.staged.lock().unwrap_or_else(|e| e.into_inner());
                    match staged.get(&mapping.name) {
                        Some((m, _))
                            if m.manifest_digest == latest.manifest_digest
                                && latest.state.serves() =>
                        {
                            staged.remove(&mapping.name)
                        }
                        _ => None,
                    }
                };
                if let Some((staged, caps)) = staged {
                    let record = self.judge(latest, &staged.tools, &staged.connection)?;
                    tracing::info!(mapping = %mapping.name, revision = record.revision, state = %record.state, "approved staged manifest swapped in");
                    self.registry.trace(
                        crate::registry::events::MAPPING_LOADED,
                        &mapping.name,
                        json!({
                            "revision": record.revision,
                            "state": record.state,
                            "component_sha256": staged.adapter.component_sha256(),
                            "manifest_digest": staged.manifest_digest,
                            "connection_id": staged.connection.revision.connection_id,
                        }),
                    );
                    staged.set_record(record);
                    let built = next.as_ref().unwrap_or(&catalog).with((staged, caps))?;
                    next = Some(built);
                    changed = true;
                    continue;
                }
                if latest.state.serves() {
                    // Approved ahead of deployment: serve on until the manifest arrives.
                    continue;
                }
                let mut local = (*current).clone();
                local.state = latest.state;
                local.reason = format!(
                    "revision {} ({}) superseded this one: {}",
                    latest.revision, latest.state, latest.reason
                );
                tracing::info!(mapping = %mapping.name, revision = latest.revision, state = %latest.state, "a later revision stops this one");
                mapping.set_record(local);
                changed |= was != mapping.serves();
                continue;
            }
            let record = self.judge(latest, &mapping.tools, &mapping.connection)?;
            if record.revision == current.revision
                && record.state == current.state
                && record.reason == current.reason
            {
                // Judged as before (a refused record re-read every poll).
                continue;
            }
            tracing::info!(mapping = %mapping.name, revision = record.revision, state = %record.state, "mapping record changed in the store");
            mapping.set_record(record);
            changed |= was != mapping.serves();
        }
        if let Some(next) = next {
            self.catalog.store(Arc::new(next));
        }
        if changed {
            self.notify_changed();
        }
        Ok(changed)
    }

    /// Judges `record` against its connection's current snapshot; before the connection's
    /// first snapshot there is nothing to judge against, and the judgement happens when
    /// it is ready (see `install`).
    fn judge(
        &self,
        record: MappingRecord,
        tools: &[String],
        state: &ConnectionState,
    ) -> Result<MappingRecord> {
        // A serving record the trace does not prove is refused (crate::registry::Registry::prove).
        let record = self.registry.proven(record);
        let snapshot = state.snapshot_digest();
        if snapshot.is_empty() {
            return Ok(record);
        }
        self.registry
            .judge(record, tools, &state.catalogue(), &snapshot)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use airlock_fixture_notes::ServeOptions;

    use super::*;
    use crate::registry::connections::ConnectionStatus;
    use crate::registry::live::MappingSource;
    use crate::registry::testkit::{self, Notes};
    use crate::store::MappingState;

    /// A host over the notes fixture with `source-library` loaded from a file in `dir`,
    /// its connection ready (nothing approved yet).
    async fn started(notes: &Notes, dir: &std::path::Path) -> (Arc<Live>, tempfile::TempDir) {
        let path = testkit::write_source_library(dir, "source-library", |t| t);
        let (live, state) =
            testkit::start(notes, "", vec![MappingSource::from_file(&path).unwrap()]).await;
        let connection = live.catalog().mappings["source-library"].connection.clone();
        testkit::until("the connection is ready", || {
            *connection.status() == ConnectionStatus::Ready
        })
        .await;
        (live, state)
    }

    /// An approval recorded in the store by someone else makes the loaded revision serve
    /// once the host syncs; a second sync changes nothing; a retirement stops it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_stores_latest_revision_decides_whether_the_loaded_manifest_serves() {
        let notes = Notes::serve(ServeOptions::default()).await;
        let dir = tempfile::tempdir().unwrap();
        let (live, _state) = started(&notes, dir.path()).await;
        let mut changes = live.changes();
        assert_eq!(live.catalog().offered().count(), 0, "nothing is approved");
        assert!(
            !live.sync_with_store().await.unwrap(),
            "nothing changed yet"
        );

        testkit::approve(&live, "source-library");
        assert_eq!(live.catalog().offered().count(), 0, "not before the sync");
        changes.borrow_and_update();
        assert!(live.sync_with_store().await.unwrap());
        assert!(changes.has_changed().unwrap(), "the fronts are told");
        let record = live.catalog().mappings["source-library"].record();
        assert_eq!(record.state, MappingState::Active);
        assert_eq!(live.catalog().offered().count(), 2);
        assert!(!live.sync_with_store().await.unwrap(), "judged as before");

        live.registry().retire("source-library", "tests").unwrap();
        assert!(live.sync_with_store().await.unwrap());
        assert_eq!(live.catalog().offered().count(), 0);
        assert_eq!(
            live.catalog().mappings["source-library"].record().state,
            MappingState::Retiring
        );
        live.shutdown(Duration::from_secs(1)).await;
    }

    /// An approval of the staged manifest swaps the staged mapping in (a new load, with
    /// its own generation), and it serves.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_approved_staged_manifest_is_swapped_in() {
        let notes = Notes::serve(ServeOptions::default()).await;
        let dir = tempfile::tempdir().unwrap();
        let (live, _state) = started(&notes, dir.path()).await;
        testkit::approve(&live, "source-library");
        live.sync_with_store().await.unwrap();
        let reviewed = live.catalog().mappings["source-library"].clone();
        let path = reviewed.manifest_path.clone().unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let changed = text.replace("Search the technical", "Search the");
        std::fs::write(&path, &changed).unwrap();
        live.load_mapping_file(&path).await.unwrap();
        let digest = crate::registry::manifest_digest(&changed);
        assert_ne!(digest, reviewed.manifest_digest);

        testkit::approve_manifest(&live, &reviewed, &digest, Some(&changed));
        assert!(live.sync_with_store().await.unwrap());
        let catalog = live.catalog();
        let now = &catalog.mappings["source-library"];
        assert_eq!(now.manifest_digest, digest);
        assert!(now.serves());
        assert_ne!(now.generation, reviewed.generation);
        assert!(!Arc::ptr_eq(now, &reviewed));
        let description = &catalog.capability("search_sources").unwrap().description;
        assert!(
            description.starts_with("Search the notes library"),
            "{description}"
        );
        assert!(live.staged.lock().unwrap().is_empty(), "no longer staged");
        live.shutdown(Duration::from_secs(1)).await;
    }

    /// A revision approved for a manifest this host has not loaded (approved ahead of
    /// deployment) leaves the loaded revision serving; once that later revision stops
    /// serving, the loaded one stops too, saying which revision superseded it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_approval_ahead_of_deployment_waits_for_its_manifest() {
        let notes = Notes::serve(ServeOptions::default()).await;
        let dir = tempfile::tempdir().unwrap();
        let (live, _state) = started(&notes, dir.path()).await;
        testkit::approve(&live, "source-library");
        live.sync_with_store().await.unwrap();
        let loaded = live.catalog().mappings["source-library"].clone();
        let ahead = "a".repeat(64);
        testkit::approve_manifest(&live, &loaded, &ahead, None);
        assert!(!live.sync_with_store().await.unwrap());
        assert!(
            loaded.serves(),
            "serves on until the approved manifest arrives"
        );

        let retired = live.registry().retire("source-library", "tests").unwrap();
        assert_eq!(retired.manifest_digest, ahead);
        assert!(live.sync_with_store().await.unwrap());
        assert!(!loaded.serves());
        let reason = loaded.record().reason.clone();
        assert!(
            reason.starts_with(&format!(
                "revision {} (retiring) superseded this one",
                retired.revision
            )),
            "{reason}"
        );
        live.shutdown(Duration::from_secs(1)).await;
    }
}
