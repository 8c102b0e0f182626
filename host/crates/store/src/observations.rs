//! Observations: the upstream content a call ingested, with its provenance (DESIGN.md §2).
//!
//! Rule: an observation is one content item of an accepted upstream answer — connection,
//! snapshot, tool or resource identity, request id, content sha256, media type, size,
//! retrieval time — written in the same transaction as the trace events of the call that
//! ingested it (one statement per item), never in one of its own. Its id is derived from
//! what it is (identity + digest), so:
//! - the **same content again** under the same identity is not a new observation: the
//!   existing row is referenced (its `last_seen_ms` and `seen` count move; its provenance
//!   never changes — a trigger refuses it);
//! - **different content** under the same identity is a new observation whose `previous`
//!   is the identity's most recently seen one (a changed resource links to what it was).
//!
//! The identity of an item is (connection id, method, target, arguments digest, item key):
//! a resource read by URI (`resources/read`, no arguments), or a tool called by name with
//! canonical-JSON arguments (`tools/call`, the same call), and where the item sits in the
//! answer (`content/N`, `structuredContent`, `contents/N`). A version that comes back
//! (A, then B, then A) references the first A again: observations are content-addressed
//! like snapshots, and `previous` records where each version was first seen from.

use rusqlite::Connection;
use sha2::{Digest as _, Sha256};

use super::ms_to_sql;

/// One content item to record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewObservation {
    /// See [`observation_id`].
    pub id: String,
    /// The connection's local id.
    pub connection_id: String,
    /// The connection's configured name.
    pub connection: String,
    /// The connection's snapshot current when the answer arrived.
    pub snapshot_digest: String,
    /// `tools/call` or `resources/read`.
    pub method: String,
    /// Tool name or resource URI.
    pub target: String,
    /// sha256 of the canonical arguments of a tool call; empty for a resource read.
    pub arguments_sha256: String,
    /// Where the item is in the answer: `content/N`, `structuredContent`, `contents/N`.
    pub item: String,
    /// What kind of item (`text`, `image`, `structured`, `blob`...).
    pub kind: String,
    /// Its media type's essence (empty for a resource link that declares none).
    pub media_type: String,
    /// sha256 (hex) of the item's RFC 8785 canonical JSON.
    pub sha256: String,
    /// Its size, bytes.
    pub bytes: u64,
    /// The upstream request's JSON-RPC id.
    pub request_id: String,
    /// The call that ingested it.
    pub call_id: String,
    /// When the answer arrived, unix ms.
    pub retrieved_ms: u64,
}

/// The id of an observation: `obs_` + the first 32 hex digits of sha256 over its identity
/// and content digest (fields separated by a zero byte).
pub fn observation_id(
    connection_id: &str,
    method: &str,
    target: &str,
    arguments_sha256: &str,
    item: &str,
    sha256: &str,
) -> String {
    let mut h = Sha256::new();
    for part in [
        connection_id,
        method,
        target,
        arguments_sha256,
        item,
        sha256,
    ] {
        h.update(part.as_bytes());
        h.update([0u8]);
    }
    let digest = hex::encode(h.finalize());
    format!("obs_{}", &digest[..32])
}

/// The first statement of [`write_in`]: content seen before under the same identity (the
/// same id) only moves `last_seen_ms` and `seen`. It is tried first because a re-read of
/// unchanged content is the common case, and it needs no look-up of the identity's latest
/// observation.
const SEEN_AGAIN: &str = "UPDATE observations SET last_seen_ms = max(last_seen_ms, ?2), \
     seen = seen + 1 WHERE id = ?1";

/// The second, when [`SEEN_AGAIN`] changed no row: a new observation, linked to the
/// identity's most recently seen one.
const INSERT: &str = "INSERT INTO observations (id, connection_id, connection, snapshot_digest, \
     method, target, arguments_sha256, item, kind, media_type, sha256, bytes, request_id, \
     call_id, retrieved_ms, last_seen_ms, seen, previous) \
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?15, 1, \
     (SELECT id FROM observations WHERE connection_id = ?2 AND method = ?5 AND target = ?6 \
      AND arguments_sha256 = ?7 AND item = ?8 \
      ORDER BY last_seen_ms DESC, seq DESC LIMIT 1))";

/// Records `observations` inside the open write transaction on `tx` (the caller's
/// transaction makes the two statements of each item one change).
pub(super) fn write_in(tx: &Connection, observations: &[NewObservation]) -> anyhow::Result<()> {
    if observations.is_empty() {
        return Ok(());
    }
    let mut seen_again = tx.prepare_cached(SEEN_AGAIN)?;
    let mut insert = tx.prepare_cached(INSERT)?;
    for o in observations {
        let bytes = i64::try_from(o.bytes)?;
        let retrieved_ms = ms_to_sql(o.retrieved_ms)?;
        if seen_again.execute(rusqlite::params![o.id, retrieved_ms])? == 1 {
            continue;
        }
        insert.execute(rusqlite::params![
            o.id,
            o.connection_id,
            o.connection,
            o.snapshot_digest,
            o.method,
            o.target,
            o.arguments_sha256,
            o.item,
            o.kind,
            o.media_type,
            o.sha256,
            bytes,
            o.request_id,
            o.call_id,
            retrieved_ms,
        ])?;
    }
    Ok(())
}

#[cfg(test)]
pub(super) mod tests {
    use super::super::{SqliteStore, Trace as _};
    use super::*;

    /// An observation of a resource read of `uri` with content digest `sha` at `ms`.
    pub(crate) fn item(uri: &str, sha: &str, ms: u64) -> NewObservation {
        NewObservation {
            id: observation_id("conn-1", "resources/read", uri, "", "contents/0", sha),
            connection_id: "conn-1".into(),
            connection: "notes".into(),
            snapshot_digest: "snap".into(),
            method: "resources/read".into(),
            target: uri.into(),
            arguments_sha256: String::new(),
            item: "contents/0".into(),
            kind: "text".into(),
            media_type: "text/markdown".into(),
            sha256: sha.into(),
            bytes: 10,
            request_id: "7".into(),
            call_id: "call_1".into(),
            retrieved_ms: ms,
        }
    }

    fn rows(store: &SqliteStore) -> Vec<(String, String, Option<String>, i64, i64)> {
        let conn = store.lock_all_moved().unwrap();
        let mut stmt = conn
            .prepare(
                "SELECT id, sha256, previous, seen, last_seen_ms FROM observations ORDER BY seq",
            )
            .unwrap();
        stmt.query_map([], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
        })
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
    }

    #[test]
    fn same_content_is_referenced_changed_content_links_to_what_it_was() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).unwrap();
        let a = item("notes://x", "aaaa", 1);
        store.append_call(vec![], vec![a.clone()]).unwrap();
        // The same digest again: not a new observation.
        store
            .append_call(vec![], vec![item("notes://x", "aaaa", 2)])
            .unwrap();
        // Another URI with the same content is another identity.
        let other = item("notes://y", "aaaa", 3);
        store.append_call(vec![], vec![other.clone()]).unwrap();
        // Changed content: new, linked to the earlier one.
        let b = item("notes://x", "bbbb", 4);
        store.append_call(vec![], vec![b.clone()]).unwrap();
        // Back to the first version: the first row again.
        store
            .append_call(vec![], vec![item("notes://x", "aaaa", 5)])
            .unwrap();
        let c = item("notes://x", "cccc", 6);
        store.append_call(vec![], vec![c.clone()]).unwrap();
        assert_eq!(
            rows(&store),
            vec![
                (a.id.clone(), "aaaa".into(), None, 3, 5),
                (other.id.clone(), "aaaa".into(), None, 1, 3),
                (b.id.clone(), "bbbb".into(), Some(a.id.clone()), 1, 4),
                (c.id.clone(), "cccc".into(), Some(a.id.clone()), 1, 6),
            ]
        );
        assert_ne!(a.id, other.id);
    }

    #[test]
    fn provenance_is_immutable_and_observations_commit_with_the_trace() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).unwrap();
        let a = item("notes://x", "aaaa", 1);
        let event = super::super::NewEvent::new("test", "call_1", serde_json::json!({}));
        store.append_call(vec![event], vec![a.clone()]).unwrap();
        assert_eq!(store.trace(0, 10).unwrap().len(), 1);
        let conn = store.lock_all_moved().unwrap();
        for change in [
            "UPDATE observations SET sha256 = 'x'",
            "UPDATE observations SET previous = 'obs_x'",
            "UPDATE observations SET snapshot_digest = 'x'",
        ] {
            let err = conn.execute(change, []).unwrap_err().to_string();
            assert!(err.contains("immutable"), "{change}: {err}");
        }
        drop(conn);
        // A call whose observation the table would refuse is refused before it is
        // recorded: none of its events is written (a record that could not be moved would
        // stop every record after it).
        let mut broken = item("notes://z", "zzzz", u64::MAX);
        broken.bytes = 1;
        let event = super::super::NewEvent::new("test", "call_2", serde_json::json!({}));
        assert!(store.append_call(vec![event], vec![broken]).is_err());
        assert_eq!(store.trace(0, 10).unwrap().len(), 1);
        assert_eq!(rows(&store).len(), 1);
    }
}
