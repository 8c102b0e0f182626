//! Live changes to a running host: hot reload of a watched mappings folder and of the
//! policy files, and approvals or retirements recorded in the store by `airlock review`
//! while the host runs.
//!
//! Rules:
//! - A new or changed `mapping.toml` or component is verified (sha256 pin), compiled off
//!   the request path and swapped in atomically; calls already running finish on the
//!   revision they started with.
//! - A failed verification leaves the old revision serving and is recorded in the trace
//!   (`mapping-load-failed`) and the log.
//! - A removed mapping folder unloads the mapping: its capabilities leave the catalog and
//!   no reference minted for it resolves again.
//! - A changed policy file is validated and swapped in for the next decision; one that
//!   does not validate leaves the previous policy deciding (traced as
//!   `policy-load-failed`).
//! - A store that signals changes made by other hosts ([`crate::store::Hosts::changes`],
//!   PostgreSQL's `LISTEN/NOTIFY`) is re-read on each signal, not only every
//!   [`STORE_POLL`].
//! - Operator contract packages ([`crate::registry::contracts`]) are re-judged when a
//!   package folder or a contract review changes (checked with the store poll): a mapping
//!   whose contract stops being served (marked erroneous, changed on disk) is unloaded, and
//!   a configured mapping whose contract is served now (approved) is loaded.
//! - Events are debounced ([`DEBOUNCE`]) so a copy in progress is read once it settles; a
//!   manifest that lands before its component fails verification and loads when the
//!   component arrives.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};

use crate::host::Host;
use crate::registry::live::mapping_dir_manifests;

/// How long the mappings folder must be quiet before a reload reads it (own debounce over
/// notify's raw events, which lets reads be told apart from changes).
pub const DEBOUNCE: Duration = Duration::from_millis(50);
/// How often the host re-reads mapping records from the store.
pub const STORE_POLL: Duration = Duration::from_millis(200);

/// Starts the background work of a serving host: the store poll, the trace checkpoints
/// ([`crate::registry::anchor`]) and, when the configuration names a mappings folder,
/// its watcher.
///
/// # Errors
/// The mappings folder cannot be watched.
pub fn spawn_background(host: &Arc<Host>) -> Result<()> {
    let weak = Arc::downgrade(host);
    // A store that signals changes (PostgreSQL's LISTEN/NOTIFY) is re-read at once on
    // each signal; the poll stays as the fallback (and is all SQLite has).
    let mut changes = host.registry().store().changes();
    // Operator contract packages: re-judged when a folder or a review changes.
    let mut contracts = (!host.config().contract_packages.is_empty()).then(|| {
        let fingerprint =
            crate::registry::contracts::Fingerprint::read(host.config(), host.registry().store())
                .unwrap_or_default();
        let served = crate::registry::contracts::ContractSet::judge(
            host.config(),
            Some(host.registry().store()),
        )
        .map(|set| crate::registry::contracts::served(&set))
        .unwrap_or_default();
        (fingerprint, served)
    });
    tokio::spawn(async move {
        loop {
            match &mut changes {
                Some(signal) => {
                    tokio::select! {
                        () = tokio::time::sleep(STORE_POLL) => {}
                        heard = signal.changed() => {
                            if heard.is_err() {
                                changes = None;
                            }
                        }
                    }
                }
                None => tokio::time::sleep(STORE_POLL).await,
            }
            let Some(host) = weak.upgrade() else { return };
            if let Err(e) = host.sync_with_store().await {
                tracing::warn!("reading mapping records from the store failed: {e:#}");
            }
            if let Some((fingerprint, served)) = &mut contracts {
                match crate::registry::contracts::Fingerprint::read(
                    host.config(),
                    host.registry().store(),
                ) {
                    Ok(now) if now != *fingerprint => {
                        *fingerprint = now;
                        match crate::registry::contracts::sync_contracts(&host, served).await {
                            Ok(next) => *served = next,
                            Err(e) => {
                                tracing::warn!("re-judging the contract packages failed: {e:#}")
                            }
                        }
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!("reading the contract reviews failed: {e:#}"),
                }
            }
        }
    });
    crate::registry::anchor::spawn_interval(host);
    crate::registry::retention::spawn(host);
    if let Some(dir) = host.config().mappings_dir.clone() {
        watch_mappings(host, dir)?;
    }
    if !host.config().policy_files.is_empty() {
        watch_policy(host)?;
    }
    Ok(())
}

/// Watches the folders of the policy files and reloads the policy after every settled
/// change.
///
/// # Errors
/// A folder cannot be watched.
pub fn watch_policy(host: &Arc<Host>) -> Result<()> {
    use notify::Watcher as _;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let mut watcher =
        notify::recommended_watcher(move |event: notify::Result<notify::Event>| match event {
            Ok(e) if !changes_content(&e.kind) => {}
            Ok(_) => {
                let _ = tx.send(());
            }
            Err(e) => tracing::warn!("policy folder watcher: {e}"),
        })
        .context("starting the policy watcher")?;
    for dir in host.policy_folders() {
        watcher
            .watch(&dir, notify::RecursiveMode::NonRecursive)
            .with_context(|| format!("watching the policy folder {}", dir.display()))?;
    }
    let weak = Arc::downgrade(host);
    tokio::spawn(async move {
        let _watcher = watcher;
        while rx.recv().await.is_some() {
            while let Ok(Some(())) = tokio::time::timeout(DEBOUNCE, rx.recv()).await {}
            let Some(host) = weak.upgrade() else { return };
            // Errors are logged and traced by reload_policy.
            let _ = host.reload_policy();
        }
    });
    Ok(())
}

/// Watches `dir` and reconciles the host with it after every settled change.
///
/// # Errors
/// The folder cannot be watched.
pub fn watch_mappings(host: &Arc<Host>, dir: PathBuf) -> Result<()> {
    use notify::Watcher as _;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        match event {
            // Reads are not changes: the reload's own reads of the folder must not start
            // another reload.
            Ok(e) if !changes_content(&e.kind) => {}
            Ok(_) => {
                let _ = tx.send(());
            }
            Err(e) => tracing::warn!("mappings folder watcher: {e}"),
        }
    })
    .context("starting the mappings folder watcher")?;
    watcher
        .watch(&dir, notify::RecursiveMode::Recursive)
        .with_context(|| format!("watching the mappings folder {}", dir.display()))?;
    tracing::info!(folder = %dir.display(), "watching the mappings folder for reviewed mappings");
    let weak = Arc::downgrade(host);
    tokio::spawn(async move {
        // The watcher stops when dropped; it lives as long as this task.
        let _watcher = watcher;
        while rx.recv().await.is_some() {
            // Debounce: wait until the folder has been quiet for DEBOUNCE.
            while let Ok(Some(())) = tokio::time::timeout(DEBOUNCE, rx.recv()).await {}
            let Some(host) = weak.upgrade() else { return };
            reconcile(&host, &dir).await;
        }
    });
    Ok(())
}

/// Whether a filesystem event can change what a mapping folder holds (creations, writes,
/// renames, removals, permission changes), as opposed to reads and access-time updates.
fn changes_content(kind: &notify::EventKind) -> bool {
    use notify::EventKind;
    use notify::event::{MetadataKind, ModifyKind};
    !matches!(
        kind,
        EventKind::Access(_) | EventKind::Modify(ModifyKind::Metadata(MetadataKind::AccessTime))
    )
}

/// Makes the host's mappings from `dir` match the folder: loads new and changed ones,
/// unloads removed ones. Failures are logged and traced; they never unload what serves.
pub async fn reconcile(host: &Arc<Host>, dir: &Path) {
    tracing::debug!(folder = %dir.display(), "reconciling the mappings folder");
    let manifests = match mapping_dir_manifests(dir) {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!("reading the mappings folder: {e:#}");
            return;
        }
    };
    let mut present = BTreeSet::new();
    for path in &manifests {
        if let Ok(name) = host.live().load_mapping_file(path).await {
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
            host.live().unload_mapping(name).await;
        }
    }
}
