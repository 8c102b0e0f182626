//! What the store says now (`airlock status`, the console) about the hosts serving from it — connections
//! and the state each last entered, mappings and their lifecycle states, approvals
//! pending, intents open (prepared, and unknown ones held for reconciliation or a person),
//! the trace's head, archive and journal backlog, and the newest checkpoint.
//!
//! Rule: **status reads; it writes nothing but what every reader of the store does.** It
//! runs in any process, against the SQLite state folder or the shared PostgreSQL store,
//! while hosts serve. Like every reader of the embedded store, opening it moves the calls
//! waiting in the trace journals into the trace (`store::journal`); the journal backlog
//! shown is what opening found waiting. A connection's state is the newest
//! `connection-state` event whose MAC verifies (what the host that serves it last traced,
//! with its time: a host that stopped leaves its last state), never a value an unkeyed row
//! claims.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use serde::Serialize;

use crate::registry::Registry;
use crate::store::{ApprovalMode, ApprovalState, Checkpoint, IntentFilter, IntentState, Waiting};

/// The whole report (`--json` prints it as one object).
#[derive(Debug, Serialize)]
pub struct Status {
    /// When it was read, unix ms.
    pub at_ms: u64,
    /// The trace.
    pub trace: TraceStatus,
    /// Every connection the store knows, by name.
    pub connections: Vec<ConnectionLine>,
    /// Every mapping's current revision, by name.
    pub mappings: Vec<MappingLine>,
    /// The counts of what waits.
    pub waiting: Waiting,
    /// The oldest pending approvals (at most `--limit`).
    pub approvals_pending: Vec<ApprovalLine>,
    /// The oldest unknown intents (at most `--limit`): held until reconciled or resolved.
    pub intents_held: Vec<IntentLine>,
}

/// The trace's head, archive, journal backlog and newest checkpoint.
#[derive(Debug, Serialize)]
pub struct TraceStatus {
    /// The newest event's seq (0: empty).
    pub head_seq: i64,
    /// The newest archived event's seq, when events were archived.
    pub archived_to: Option<i64>,
    /// Bytes of calls durable in the trace journals and not yet moved into the trace when
    /// status opened the store (0 on PostgreSQL).
    pub journal_backlog_bytes: u64,
    /// The newest checkpoint in the checkpoint file, when there is one.
    pub last_checkpoint: Option<CheckpointLine>,
}

/// The newest line of a checkpoint file.
#[derive(Debug, Serialize)]
pub struct CheckpointLine {
    /// The file.
    pub file: PathBuf,
    /// The head it binds.
    pub seq: i64,
    /// When it was taken, unix ms.
    pub at_ms: u64,
}

/// One connection.
#[derive(Debug, Serialize)]
pub struct ConnectionLine {
    /// Its configured name.
    pub name: String,
    /// Its local id.
    pub connection_id: String,
    /// Its configuration revision.
    pub revision: i64,
    /// The state it last entered (`ready`, `stalled`, …); `None` when the store holds no
    /// such event (none traced yet, or archived).
    pub state: Option<String>,
    /// When it entered it, unix ms.
    pub since_ms: Option<u64>,
    /// Why, when it says (the host's words, bounded).
    pub reason: Option<String>,
}

/// One mapping.
#[derive(Debug, Serialize)]
pub struct MappingLine {
    /// Its name.
    pub name: String,
    /// Its current revision.
    pub revision: i64,
    /// Its lifecycle state.
    pub state: String,
    /// When it entered that state, unix ms.
    pub since_ms: u64,
}

/// One pending approval.
#[derive(Debug, Serialize)]
pub struct ApprovalLine {
    /// `apr_…`.
    pub id: String,
    /// The capability the call asked for.
    pub capability: String,
    /// Who asked.
    pub requester: String,
    /// How the person is asked.
    pub mode: ApprovalMode,
    /// Made, unix ms.
    pub created_ms: u64,
    /// Expires, unix ms.
    pub expires_ms: u64,
}

/// One held intent.
#[derive(Debug, Serialize)]
pub struct IntentLine {
    /// `int_…`.
    pub id: String,
    /// The capability of the call.
    pub capability: String,
    /// Its mapping.
    pub mapping: String,
    /// Made, unix ms.
    pub created_ms: u64,
}

/// Reads the status from `registry`'s store; `checkpoints`, the checkpoint file, when it
/// exists. At most `limit` approvals and intents are listed (the counts cover all).
///
/// # Errors
/// The store cannot be read; the checkpoint file exists but cannot be read or parsed.
pub fn read(registry: &Registry, checkpoints: Option<&Path>, limit: usize) -> Result<Status> {
    let store = registry.store();
    let journal_backlog_bytes = store.journal_backlog_at_open();
    let at_ms = crate::store::now_ms();
    let head_seq = store.trace_checkpoint()?.seq;
    let archived_to = store.archive_mark()?.map(|a| a.mark.to_seq);
    let last_checkpoint = match checkpoints {
        Some(file) if file.exists() => {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("reading checkpoints from {}", file.display()))?;
            Checkpoint::parse_lines(&text)
                .with_context(|| format!("checkpoint file {}", file.display()))?
                .into_iter()
                .map(|(_, c)| c)
                .next_back()
                .map(|c| CheckpointLine {
                    file: file.to_path_buf(),
                    seq: c.seq,
                    at_ms: c.at_ms,
                })
        }
        _ => None,
    };
    let mut connections = Vec::new();
    for c in store.connections()? {
        let event = store.connection_state(&c.name)?;
        connections.push(ConnectionLine {
            state: event
                .as_ref()
                .and_then(|e| e.payload["to"].as_str())
                .map(str::to_owned),
            since_ms: event.as_ref().map(|e| e.at_ms),
            reason: event
                .as_ref()
                .and_then(|e| e.payload["reason"].as_str())
                .map(|r| airlock_core::text::safe(r, 300)),
            name: c.name,
            connection_id: c.connection_id,
            revision: c.revision,
        });
    }
    let mappings = store
        .mappings()?
        .into_iter()
        .map(|m| MappingLine {
            name: m.name,
            revision: m.revision,
            state: m.state.as_str().to_owned(),
            since_ms: m.state_changed_ms,
        })
        .collect();
    let waiting = store.waiting(at_ms)?;
    let mut approvals_pending: Vec<ApprovalLine> = store
        .approvals(Some(ApprovalState::Pending), usize::MAX)?
        .into_iter()
        .filter(|a| a.expires_ms > at_ms)
        .map(|a| ApprovalLine {
            id: a.id,
            capability: a.binding.capability,
            requester: a.binding.requester,
            mode: a.mode,
            created_ms: a.created_ms,
            expires_ms: a.expires_ms,
        })
        .collect();
    approvals_pending.sort_by_key(|a| a.created_ms);
    approvals_pending.truncate(limit);
    let mut intents_held: Vec<IntentLine> = store
        .intents(&IntentFilter {
            states: vec![IntentState::Unknown],
            mapping: None,
            created_before_ms: None,
            compensates: None,
            limit: usize::MAX,
        })?
        .into_iter()
        .map(|r| IntentLine {
            id: r.intent.id,
            capability: r.intent.capability,
            mapping: r.intent.mapping,
            created_ms: r.created_ms,
        })
        .collect();
    intents_held.sort_by_key(|i| i.created_ms);
    intents_held.truncate(limit);
    Ok(Status {
        at_ms,
        trace: TraceStatus {
            head_seq,
            archived_to,
            journal_backlog_bytes,
            last_checkpoint,
        },
        connections,
        mappings,
        waiting,
        approvals_pending,
        intents_held,
    })
}
