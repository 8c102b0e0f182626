//! What several hosts on one shared store (PostgreSQL) must agree on beyond the rows every
//! store holds: references minted by one host and resolved by another, and which hosts are
//! still alive (so that one host never reconciles an intent another host is still
//! delivering).
//!
//! Rules:
//! - **A shared reference is found only by its token and its scope.** The store keeps the
//!   sha256 of the token (never the token: a reader of the database cannot present it) and
//!   the scope it was minted in (the session id, the same on every host for one principal,
//!   see `airlock::pipeline::session`); a token looked up in another scope is unknown.
//! - **A host is alive while it holds its liveness lock.** On PostgreSQL each serving host
//!   holds a session-level advisory lock named by its instance id for as long as its
//!   process (and that connection) lives; another host that can take the lock knows the
//!   first is gone. An embedded store serves one host at a time: any other instance that
//!   wrote to it has stopped.

use serde_json::{Map, Value};

/// One reference binding as the shared store holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct SharedReference {
    /// sha256 (hex) of the token text (`ref_…`).
    pub token_sha256: String,
    /// The session id (`ses_…`) it was minted in.
    pub scope: String,
    /// The handle kind (the WIT alias, e.g. `source-ref`).
    pub kind: String,
    /// The mapping's name.
    pub mapping: String,
    /// The mapping revision it was minted under.
    pub revision: i64,
    /// The adapter's locator.
    pub locator: String,
    /// Facts recorded with it (upstream-reported, untrusted text).
    pub facts: Map<String, Value>,
    /// When it expires, unix ms.
    pub expires_ms: u64,
}

/// The sha256 (hex) under which the store keeps a token.
pub fn token_digest(token: &str) -> String {
    use sha2::Digest as _;
    hex::encode(sha2::Sha256::digest(token.as_bytes()))
}

/// The two 32-bit keys of host `instance`'s liveness lock (`pg_advisory_lock(int4, int4)`,
/// a key space apart from the one-`bigint` write lock): "Arlh" and the first four bytes of
/// sha256("airlock-host-v1\0" + instance). Two instances sharing a key only make a stopped
/// host look alive: its intents wait for a person, never the reverse.
pub fn liveness_keys(instance: &str) -> (i32, i32) {
    use sha2::Digest as _;
    let mut h = sha2::Sha256::new();
    h.update(b"airlock-host-v1\0");
    h.update(instance.as_bytes());
    let d = h.finalize();
    (0x4172_6c68, i32::from_be_bytes([d[0], d[1], d[2], d[3]]))
}
