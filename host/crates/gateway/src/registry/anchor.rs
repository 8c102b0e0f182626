//! Anchoring the trace head outside the database: a serving host appends a checkpoint
//! ([`crate::store::Checkpoint`], sequence number + head MAC, MACed with the host key) to
//! its checkpoint file every `[trace] checkpoint_interval` (default 5 min, only when the
//! head moved) and once more when it stops.
//!
//! Rule: the checkpoint file is append-only for Airlock (opened `O_APPEND`, never
//! truncated or rewritten) and private ([`crate::private_fs`]); it is meant to be shipped
//! elsewhere (a log collector, another machine): kept beside the database only, it is
//! deleted as easily as the database. A failure to write a checkpoint is logged at ERROR
//! and never stops the host.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context as _, Result};

use crate::config::ServeConfig;
use crate::host::Host;
use crate::registry::Registry;
use crate::store::Checkpoint;

/// The checkpoint file of `config`: `[trace] checkpoint_file`, else
/// `trace-checkpoints.jsonl` in the state folder (`state_dir`, else the default one);
/// `None` when neither can be determined.
pub fn checkpoint_path(config: &ServeConfig) -> Option<PathBuf> {
    if let Some(file) = &config.trace.checkpoint_file {
        return Some(file.clone());
    }
    let dir = config
        .state_dir
        .clone()
        .or_else(crate::config::default_state_dir)?;
    Some(config.trace.checkpoint_path(&dir))
}

/// Takes a checkpoint of the trace head now and appends it to `path`.
///
/// # Errors
/// The store fails, or the file is not private or cannot be written.
pub fn write(registry: &Registry, path: &std::path::Path) -> Result<Checkpoint> {
    let checkpoint = registry.store().trace_checkpoint()?;
    crate::store::key::append_checkpoint(path, &checkpoint)
        .with_context(|| format!("writing a trace checkpoint to {}", path.display()))?;
    Ok(checkpoint)
}

/// Writes checkpoints every `[trace] checkpoint_interval` while `host` lives, skipping
/// an interval in which the head did not move.
pub fn spawn_interval(host: &Arc<Host>) {
    let (Some(interval), Some(path)) = (
        host.config().trace.checkpoint_interval,
        checkpoint_path(host.config()),
    ) else {
        return;
    };
    let weak = Arc::downgrade(host);
    tokio::spawn(async move {
        let mut last: Option<(i64, String)> = None;
        loop {
            tokio::time::sleep(interval).await;
            let Some(host) = weak.upgrade() else { return };
            let registry = host.registry().clone();
            let path = path.clone();
            let previous = last.clone();
            let written = tokio::task::spawn_blocking(move || -> Result<Option<Checkpoint>> {
                let head = registry.store().trace_checkpoint()?;
                if previous == Some((head.seq, head.head.clone())) {
                    return Ok(None);
                }
                crate::store::key::append_checkpoint(&path, &head)?;
                Ok(Some(head))
            })
            .await;
            match written {
                Ok(Ok(Some(c))) => {
                    tracing::debug!(seq = c.seq, "trace checkpoint written");
                    last = Some((c.seq, c.head));
                }
                Ok(Ok(None)) => {}
                Ok(Err(e)) => tracing::error!("could not write a trace checkpoint: {e:#}"),
                Err(e) => tracing::error!("the trace checkpoint task failed: {e}"),
            }
        }
    });
}

/// Writes the checkpoint of a stopping host (logged; a failure is logged at ERROR).
pub fn at_shutdown(registry: &Registry, config: &ServeConfig) {
    let Some(path) = checkpoint_path(config) else {
        return;
    };
    match write(registry, &path) {
        Ok(c) => tracing::info!(
            seq = c.seq,
            file = %path.display(),
            "trace checkpoint written at shutdown"
        ),
        Err(e) => tracing::error!("could not write the shutdown trace checkpoint: {e:#}"),
    }
}
