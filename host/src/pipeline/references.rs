//! Source references: opaque handles the model receives in place of adapter locators.
//!
//! Rule: a reference is a random token (160 bits from the OS generator, `ref_` + 40 hex
//! digits) bound, on the server side only, to the session that received it, the mapping
//! and connection that produced it, the adapter's locator (the upstream resource
//! identity) and an expiry. Resolving a token checks all of it before any upstream
//! request: a forged token, a token from another session, a token minted by another
//! mapping, and an expired token all fail. The model is never told which of these it was
//! for tokens it does not own (no hint that a token exists elsewhere).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Default lifetime of a reference.
pub const DEFAULT_TTL: Duration = Duration::from_secs(30 * 60);
/// Most live references held at once; the oldest are dropped past it.
pub const MAX_LIVE_REFERENCES: usize = 100_000;

/// Identifies one model-facing session (one MCP client connection).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SessionId(pub u64);

/// What a token stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    pub session: SessionId,
    pub mapping: String,
    pub connection: String,
    /// The handle kind (the WIT alias name, e.g. `source-ref`).
    pub kind: String,
    /// The adapter's locator: the upstream identity of the source.
    pub locator: String,
    pub expires: Instant,
}

/// Why a token did not resolve. Shown to the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResolveError {
    /// Unknown, forged, from another session, or for another capability.
    NotValid,
    /// Was valid here but has expired.
    Expired,
}

impl std::fmt::Display for ResolveError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NotValid => f.write_str("this reference is not valid in this session; use a reference from one of your own search results"),
            Self::Expired => f.write_str("this reference has expired; search again for a fresh one"),
        }
    }
}

/// The host's reference table, shared by all sessions.
#[derive(Default)]
pub struct References {
    inner: Mutex<HashMap<String, Binding>>,
}

impl References {
    /// Mints a token for `binding`.
    ///
    /// # Panics
    /// When the OS random generator fails (there is no safe fallback).
    pub fn mint(&self, binding: Binding) -> String {
        let mut bytes = [0u8; 20];
        getrandom::fill(&mut bytes).expect("the OS random generator failed");
        let token = format!("ref_{}", hex::encode(bytes));
        let mut map = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if map.len() >= MAX_LIVE_REFERENCES {
            let now = Instant::now();
            map.retain(|_, b| b.expires > now);
            if map.len() >= MAX_LIVE_REFERENCES
                && let Some(oldest) = map
                    .iter()
                    .min_by_key(|(_, b)| b.expires)
                    .map(|(k, _)| k.clone())
            {
                map.remove(&oldest);
            }
        }
        map.insert(token.clone(), binding);
        token
    }

    /// Resolves `token` for `session` and `mapping`, returning the adapter's locator.
    ///
    /// # Errors
    /// [`ResolveError`]; nothing about other sessions' tokens is revealed.
    pub fn resolve(
        &self,
        token: &str,
        session: SessionId,
        mapping: &str,
        kind: &str,
    ) -> Result<String, ResolveError> {
        let mut map = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let Some(b) = map.get(token) else {
            return Err(ResolveError::NotValid);
        };
        if b.session != session || b.mapping != mapping || b.kind != kind {
            return Err(ResolveError::NotValid);
        }
        if b.expires <= Instant::now() {
            map.remove(token);
            return Err(ResolveError::Expired);
        }
        Ok(b.locator.clone())
    }

    /// Drops every reference minted for `mapping` (used when a mapping is unloaded).
    pub fn revoke_mapping(&self, mapping: &str) {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|_, b| b.mapping != mapping);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binding(session: u64, ttl: Duration) -> Binding {
        Binding {
            session: SessionId(session),
            mapping: "source-library".into(),
            connection: "notes".into(),
            kind: "source-ref".into(),
            locator: "wal-checkpoints".into(),
            expires: Instant::now() + ttl,
        }
    }

    #[test]
    fn tokens_are_long_random_and_distinct() {
        let refs = References::default();
        let a = refs.mint(binding(1, DEFAULT_TTL));
        let b = refs.mint(binding(1, DEFAULT_TTL));
        assert_ne!(a, b);
        assert_eq!(a.len(), 4 + 40);
        assert!(
            !a.contains("wal"),
            "the locator must not leak into the token"
        );
    }

    #[test]
    fn only_the_owning_session_and_mapping_resolve() {
        let refs = References::default();
        let t = refs.mint(binding(1, DEFAULT_TTL));
        assert_eq!(
            refs.resolve(&t, SessionId(1), "source-library", "source-ref")
                .unwrap(),
            "wal-checkpoints"
        );
        assert_eq!(
            refs.resolve(&t, SessionId(2), "source-library", "source-ref"),
            Err(ResolveError::NotValid)
        );
        assert_eq!(
            refs.resolve(&t, SessionId(1), "fs-documents", "source-ref"),
            Err(ResolveError::NotValid)
        );
        assert_eq!(
            refs.resolve(&t, SessionId(1), "source-library", "artifact-ref"),
            Err(ResolveError::NotValid)
        );
        let last = if t.ends_with('0') { "1" } else { "0" };
        let forged = format!("{}{last}", &t[..t.len() - 1]);
        assert_eq!(
            refs.resolve(&forged, SessionId(1), "source-library", "source-ref"),
            Err(ResolveError::NotValid)
        );
        assert_eq!(
            refs.resolve(
                "wal-checkpoints",
                SessionId(1),
                "source-library",
                "source-ref"
            ),
            Err(ResolveError::NotValid)
        );
    }

    #[test]
    fn expired_tokens_fail_and_revocation_closes_the_mapping() {
        let refs = References::default();
        let t = refs.mint(binding(1, Duration::ZERO));
        assert_eq!(
            refs.resolve(&t, SessionId(1), "source-library", "source-ref"),
            Err(ResolveError::Expired)
        );
        let t = refs.mint(binding(1, DEFAULT_TTL));
        refs.revoke_mapping("source-library");
        assert_eq!(
            refs.resolve(&t, SessionId(1), "source-library", "source-ref"),
            Err(ResolveError::NotValid)
        );
    }
}
