//! Live changes to a running host: hot reload of a watched mappings folder, and approvals
//! or retirements recorded in the store by `airlock review` while the host runs.
//!
//! Rules:
//! - A new or changed `mapping.toml` or component is verified (sha256 pin), compiled off
//!   the request path and swapped in atomically; calls already running finish on the
//!   revision they started with.
//! - A failed verification leaves the old revision serving and is recorded in the trace
//!   (`mapping-load-failed`) and the log.
//! - A removed mapping folder unloads the mapping: its capabilities leave the catalog and
//!   every reference minted for it is revoked.
//! - Events are debounced ([`DEBOUNCE`]) so a copy in progress is read once it settles; a
//!   manifest that lands before its component fails verification and loads when the
//!   component arrives.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};

use crate::gateway::{Host, mapping_dir_manifests};

/// How long the mappings folder must be quiet before a reload reads it.
pub const DEBOUNCE: Duration = Duration::from_millis(50);
/// How often the host re-reads mapping records from the store.
pub const STORE_POLL: Duration = Duration::from_millis(200);

/// Starts the background work of a serving host: the store poll and, when the
/// configuration names a mappings folder, its watcher.
///
/// # Errors
/// The mappings folder cannot be watched.
pub fn spawn_background(host: &Arc<Host>) -> Result<()> {
    let weak = Arc::downgrade(host);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(STORE_POLL).await;
            let Some(host) = weak.upgrade() else { return };
            if let Err(e) = host.sync_with_store().await {
                tracing::warn!("reading mapping records from the store failed: {e:#}");
            }
        }
    });
    if let Some(dir) = host.config().mappings_dir.clone() {
        watch_mappings(host, dir)?;
    }
    Ok(())
}

/// Watches `dir` and reconciles the host with it after every settled change.
///
/// # Errors
/// The folder cannot be watched.
pub fn watch_mappings(host: &Arc<Host>, dir: PathBuf) -> Result<()> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut debouncer = notify_debouncer_mini::new_debouncer(DEBOUNCE, move |events| {
        let _ = tx.send(events);
    })
    .context("starting the mappings folder watcher")?;
    debouncer
        .watcher()
        .watch(&dir, notify::RecursiveMode::Recursive)
        .with_context(|| format!("watching the mappings folder {}", dir.display()))?;
    tracing::info!(folder = %dir.display(), "watching the mappings folder for reviewed mappings");
    let weak = Arc::downgrade(host);
    tokio::spawn(async move {
        // The debouncer stops when dropped; it lives as long as this task.
        let _debouncer = debouncer;
        while let Some(events) = rx.recv().await {
            if let Err(errors) = events {
                tracing::warn!("mappings folder watcher: {errors:?}");
            }
            // Coalesce whatever else already arrived.
            while rx.try_recv().is_ok() {}
            let Some(host) = weak.upgrade() else { return };
            reconcile(&host, &dir).await;
        }
    });
    Ok(())
}

/// Makes the host's mappings from `dir` match the folder: loads new and changed ones,
/// unloads removed ones. Failures are logged and traced; they never unload what serves.
pub async fn reconcile(host: &Arc<Host>, dir: &Path) {
    let manifests = match mapping_dir_manifests(dir) {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!("reading the mappings folder: {e:#}");
            return;
        }
    };
    let mut present = BTreeSet::new();
    for path in &manifests {
        if let Ok(name) = host.load_mapping_file(path).await {
            present.insert(name);
        }
    }
    // Unload mappings whose manifest was in this folder and is gone.
    let catalog = host.catalog();
    for (name, mapping) in &catalog.mappings {
        let Some(path) = &mapping.manifest_path else {
            continue;
        };
        if path.starts_with(dir) && !path.exists() && !present.contains(name) {
            host.unload_mapping(name).await;
        }
    }
}
