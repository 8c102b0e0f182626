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
