//! References (handles): opaque tokens the model receives in place of adapter locators.
//!
//! Rules this module enforces (DESIGN.md §2 "handle"):
//! - **A token means something only in the table that minted it.** There is one table per
//!   session (over stdio the process is the session; for 2026-07-28 clients, which have no
//!   protocol session, a front binds the table to requester + profile instead). A token is
//!   160 random bits from the OS generator, `ref_` + 40 lowercase hex digits; a token from
//!   another table, a forged one, or a locator passed as a token is simply unknown here.
//! - **A reference is a capability, not a string.** Its binding holds the handle kind (the
//!   WIT alias, e.g. `source-ref` or `destination-ref`), the mapping, the mapping's load
//!   generation and the revision it was minted under, the adapter's locator, facts about the
//!   object (e.g. an artifact's sha256 and size), and an expiry. Resolving checks all of
//!   it: a reference of one kind is not accepted where another kind is expected, and a
//!   reference minted under a revision (or a load) that no longer serves is stale.
//! - **The same object gets the same token, whatever later results say of it.** Minting
//!   the same (mapping load, revision, kind, locator) again in one table returns the token
//!   already issued and renews its expiry, so a session that searches all day holds one
//!   token per source, not one per hit, and a token from a first search still resolves after
//!   a second search reported the same source with another snippet. Which facts identify
//!   the object is declared by its contract ([`crate::contract::Contract::identity_facts`]: a
//!   source's `version`, an artifact's `sha256`), never guessed from what differs: only
//!   when one of those differs from the value recorded (the note was edited, the artifact's
//!   content changed) is it another object, the old token dropped (what it named is gone
//!   upstream) and a new one minted. Facts that describe one result (`title`, `snippet`,
//!   `score`, a destination's `label`) never do; the facts first recorded stay with the
//!   token, so what a person approves about it cannot change under them.
//! - **Bounded per table, never across tables.** A table holds at most
//!   [`MAX_REFERENCES_PER_TABLE`] bindings; past it, the least recently used binding *of
//!   that table* is dropped (O(1), `lru`). Expiry is checked when a token is used, never by
//!   scanning. One session can never evict another session's references.
//! - **On a shared store, a reference minted on one host resolves on every host, in the
//!   same session only** ([`ReferenceTable::shared`]). Each new binding (and a renewal past
//!   half its lifetime) is written to the store, one batch per result
//!   ([`ReferenceTable::mint_all`]), before the result leaves the host; a token this table
//!   does not hold is looked up in the store under this session's id, and what is found is
//!   checked as a local binding is (kind, mapping, serving revision, expiry) and then kept
//!   here. Across hosts a binding names the mapping revision, not a host's load
//!   generation: a host's own unload still revokes what it holds.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lru::LruCache;
use serde_json::{Map, Value};

use crate::store::Hosts;
use crate::store::shared::{SharedReference, token_digest};

/// Default lifetime of a reference, renewed each time the same object is minted again.
pub const DEFAULT_TTL: Duration = Duration::from_secs(30 * 60);

/// Most references one table (one session) holds; the least recently used go first.
pub const MAX_REFERENCES_PER_TABLE: usize = 100_000;

/// Token prefix.
const PREFIX: &str = "ref_";

/// What a token was minted for, as the resolver must find it again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// The mapping's name.
    pub mapping: Arc<str>,
    /// The mapping's load generation (unique per loaded mapping in this process).
    pub generation: u64,
    /// The mapping revision serving when the token was minted.
    pub revision: i64,
}

/// A resolved reference: the adapter's locator and the facts recorded with it.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    /// The adapter's locator.
    pub locator: Arc<str>,
    /// Facts recorded when it was minted (scalar fields of the record it came in, e.g.
    /// `sha256`, `bytes`, `title`, `label`); upstream-reported, so untrusted text.
    pub facts: Arc<Map<String, Value>>,
}

/// Why a token did not resolve. Shown to the model (these are its own tokens or unknown).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResolveError {
    /// Unknown, forged, from another session, or of another kind.
    NotValid,
    /// Was valid here but has expired.
    Expired,
    /// Minted under a mapping revision that no longer serves.
    Stale,
}

impl std::fmt::Display for ResolveError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NotValid => f.write_str(
                "this reference is not valid in this session; use a reference that this capability's own results gave you",
            ),
            Self::Expired => f.write_str("this reference has expired; ask for a fresh one"),
            Self::Stale => f.write_str(
                "this reference was issued before the capability changed; ask for a fresh one",
            ),
        }
    }
}

struct Binding {
    origin: Origin,
    kind: Arc<str>,
    locator: Arc<str>,
    facts: Arc<Map<String, Value>>,
    expires: Instant,
    /// Until when the shared store holds it (`None`: not written there).
    stored_until: Option<Instant>,
}

type Token = [u8; 20];

#[derive(Hash, PartialEq, Eq)]
struct LocatorKey {
    generation: u64,
    revision: i64,
    kind: Arc<str>,
    locator: Arc<str>,
}

struct Inner {
    by_token: LruCache<Token, Binding>,
    by_locator: HashMap<LocatorKey, Token>,
    /// Bindings to write to the shared store at the end of [`ReferenceTable::mint_all`].
    to_store: Vec<SharedReference>,
    /// Token digests to delete there (their object changed).
    to_drop: Vec<String>,
}

/// The shared store a table writes to (only its [`Hosts`] concern: shared references),
/// and the scope (session id) it writes under.
struct SharedScope {
    store: Arc<dyn Hosts>,
    scope: String,
}

/// One session's reference table.
pub struct ReferenceTable {
    inner: Mutex<Inner>,
    capacity: usize,
    ttl: Duration,
    shared: Option<SharedScope>,
}

impl Default for ReferenceTable {
    fn default() -> Self {
        Self::with_limits(MAX_REFERENCES_PER_TABLE, DEFAULT_TTL)
    }
}

impl ReferenceTable {
    /// A table holding at most `capacity` (≥ 1) references, each living `ttl` from its
    /// last mint.
    pub fn with_limits(capacity: usize, ttl: Duration) -> Self {
        Self {
            inner: Mutex::new(Inner {
                by_token: LruCache::unbounded(),
                by_locator: HashMap::new(),
                to_store: Vec::new(),
                to_drop: Vec::new(),
            }),
            capacity: capacity.max(1),
            ttl,
            shared: None,
        }
    }

    /// A table of session `scope` (its `ses_…` id) whose bindings are also kept in the
    /// shared `store`, so that every host sharing it resolves them (see the module's rule).
    pub fn shared(store: Arc<dyn Hosts>, scope: &str) -> Self {
        Self {
            shared: Some(SharedScope {
                store,
                scope: scope.to_owned(),
            }),
            ..Self::default()
        }
    }

    /// Runs `f` with a minting function (as [`ReferenceTable::mint`]) and then writes what
    /// it minted to the shared store in one batch, before returning: a reference in a
    /// result resolves on another host as soon as the result is out. A failed write is
    /// logged; the references still resolve on this host.
    pub fn mint_all<R>(
        &self,
        origin: &Origin,
        f: impl FnOnce(&mut dyn FnMut(&str, &str, Map<String, Value>, &[String]) -> String) -> R,
    ) -> R {
        let out = f(&mut |kind, locator, facts, identity| {
            self.mint(origin, kind, locator, facts, identity)
        });
        self.publish();
        out
    }

    /// Writes the bindings minted since the last call to the shared store (nothing
    /// without one).
    fn publish(&self) {
        let Some(shared) = &self.shared else { return };
        let (put, drop) = {
            let mut inner = self.lock();
            (
                std::mem::take(&mut inner.to_store),
                std::mem::take(&mut inner.to_drop),
            )
        };
        if put.is_empty() && drop.is_empty() {
            return;
        }
        if let Err(e) = shared.store.write_references(&shared.scope, &put, &drop) {
            tracing::warn!(session = %shared.scope, "references were not written to the shared store (they resolve on this host only): {e:#}");
        }
    }

    /// The store's copy of a binding that expires at `expires`, for the next publish.
    fn stored(
        &self,
        token: &Token,
        origin: &Origin,
        key: &LocatorKey,
        facts: &Map<String, Value>,
        expires: Instant,
    ) -> Option<SharedReference> {
        let shared = self.shared.as_ref()?;
        let left = expires.saturating_duration_since(Instant::now());
        Some(SharedReference {
            token_sha256: token_digest(&render(token)),
            scope: shared.scope.clone(),
            kind: key.kind.to_string(),
            mapping: origin.mapping.to_string(),
            revision: origin.revision,
            locator: key.locator.to_string(),
            facts: facts.clone(),
            expires_ms: crate::store::now_ms().saturating_add(left.as_millis() as u64),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Live bindings held (expired ones count until they are used or evicted).
    pub fn len(&self) -> usize {
        self.lock().by_token.len()
    }

    /// True when the table holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Returns the token for `locator` of handle `kind`, minted under `origin`, with
    /// `facts`: the token already issued for the same object (its expiry renewed), else a
    /// new one. `identity` names the facts that identify the object (the contract's
    /// declaration for `kind`, [`crate::contract::Contract::identity_facts`]): the token already
    /// issued stands for another object only when one of them differs from the value
    /// recorded with it; a fact that only one of the two mints reports never differs.
    ///
    /// # Panics
    /// When the OS random generator fails (there is no safe fallback).
    pub fn mint(
        &self,
        origin: &Origin,
        kind: &str,
        locator: &str,
        facts: Map<String, Value>,
        identity: &[String],
    ) -> String {
        let now = Instant::now();
        let mut inner = self.lock();
        let key = LocatorKey {
            generation: origin.generation,
            revision: origin.revision,
            kind: Arc::from(kind),
            locator: Arc::from(locator),
        };
        if let Some(token) = inner.by_locator.get(&key).copied() {
            match inner.by_token.get_mut(&token) {
                Some(b) if !another_object(&b.facts, &facts, identity) => {
                    b.expires = now + self.ttl;
                    // The store's copy is renewed once half its lifetime is gone.
                    let renew = b
                        .stored_until
                        .is_some_and(|until| until <= now + self.ttl / 2);
                    if renew {
                        b.stored_until = Some(b.expires);
                        let (facts, expires) = (b.facts.clone(), b.expires);
                        if let Some(r) = self.stored(&token, origin, &key, &facts, expires) {
                            inner.to_store.push(r);
                        }
                    }
                    return render(&token);
                }
                // The upstream reports another identity for the same locator (a new
                // version, other content): the old token no longer stands for anything.
                Some(_) => {
                    inner.by_token.pop(&token);
                    inner.by_locator.remove(&key);
                    if self.shared.is_some() {
                        inner.to_drop.push(token_digest(&render(&token)));
                    }
                }
                None => {
                    inner.by_locator.remove(&key);
                }
            }
        }
        let mut token = [0u8; 20];
        crate::random::fill(&mut token);
        make_room(&mut inner, self.capacity);
        let expires = now + self.ttl;
        let stored = self.stored(&token, origin, &key, &facts, expires);
        let binding = Binding {
            origin: origin.clone(),
            kind: key.kind.clone(),
            locator: key.locator.clone(),
            facts: Arc::new(facts),
            expires,
            stored_until: stored.as_ref().map(|_| expires),
        };
        if let Some(r) = stored {
            inner.to_store.push(r);
        }
        inner.by_locator.insert(key, token);
        inner.by_token.put(token, binding);
        render(&token)
    }

    /// Resolves `token` as a handle of `kind` for `mapping`, whose current load and
    /// serving revision are `current`.
    ///
    /// # Errors
    /// [`ResolveError`]; nothing about other tables' tokens is revealed.
    pub fn resolve(
        &self,
        token: &str,
        kind: &str,
        current: &Origin,
    ) -> Result<Resolved, ResolveError> {
        let text = token;
        let token = parse(token).ok_or(ResolveError::NotValid)?;
        let mut inner = self.lock();
        if !inner.by_token.contains(&token) {
            drop(inner);
            return self.resolve_shared(text, &token, kind, current);
        }
        let Some(b) = inner.by_token.get(&token) else {
            return Err(ResolveError::NotValid);
        };
        if &*b.kind != kind || b.origin.mapping != current.mapping {
            return Err(ResolveError::NotValid);
        }
        if b.origin.generation != current.generation || b.origin.revision != current.revision {
            return Err(ResolveError::Stale);
        }
        if b.expires <= Instant::now() {
            if let Some(old) = inner.by_token.pop(&token) {
                inner.by_locator.remove(&LocatorKey {
                    generation: old.origin.generation,
                    revision: old.origin.revision,
                    kind: old.kind,
                    locator: old.locator,
                });
            }
            return Err(ResolveError::Expired);
        }
        Ok(Resolved {
            locator: b.locator.clone(),
            facts: b.facts.clone(),
        })
    }
}

impl ReferenceTable {
    /// A token this table does not hold: the shared store's binding for it in this
    /// session, checked as a local one is, then kept here under the current load.
    fn resolve_shared(
        &self,
        text: &str,
        token: &Token,
        kind: &str,
        current: &Origin,
    ) -> Result<Resolved, ResolveError> {
        let Some(shared) = &self.shared else {
            return Err(ResolveError::NotValid);
        };
        let found = match shared
            .store
            .find_reference(&shared.scope, &token_digest(text))
        {
            Ok(Some(found)) => found,
            Ok(None) => return Err(ResolveError::NotValid),
            Err(e) => {
                tracing::warn!(session = %shared.scope, "a reference could not be read from the shared store: {e:#}");
                return Err(ResolveError::NotValid);
            }
        };
        if found.kind != kind || *found.mapping != *current.mapping {
            return Err(ResolveError::NotValid);
        }
        if found.revision != current.revision {
            return Err(ResolveError::Stale);
        }
        let now_ms = crate::store::now_ms();
        if found.expires_ms <= now_ms {
            return Err(ResolveError::Expired);
        }
        let expires = Instant::now() + Duration::from_millis(found.expires_ms - now_ms);
        let key = LocatorKey {
            generation: current.generation,
            revision: current.revision,
            kind: Arc::from(kind),
            locator: Arc::from(found.locator.as_str()),
        };
        let facts = Arc::new(found.facts);
        let mut inner = self.lock();
        make_room(&mut inner, self.capacity);
        inner.by_token.put(
            *token,
            Binding {
                origin: current.clone(),
                kind: key.kind.clone(),
                locator: key.locator.clone(),
                facts: facts.clone(),
                expires,
                stored_until: Some(expires),
            },
        );
        let locator = key.locator.clone();
        inner.by_locator.entry(key).or_insert(*token);
        Ok(Resolved { locator, facts })
    }
}

/// Drops the least recently used bindings until one more fits under `capacity`.
fn make_room(inner: &mut Inner, capacity: usize) {
    while inner.by_token.len() >= capacity {
        let Some((_, old)) = inner.by_token.pop_lru() else {
            break;
        };
        inner.by_locator.remove(&LocatorKey {
            generation: old.origin.generation,
            revision: old.origin.revision,
            kind: old.kind,
            locator: old.locator,
        });
    }
}

/// True when `old` and `new` report different values for one of the `identity` facts
/// both have (an artifact's sha256, a source's version): then the locator names another
/// object now. Every other fact (a search hit's snippet, title or score) describes one
/// result and never makes another object, and an identity fact only one of them reports
/// (a hit without a version, a passage with one) does not either.
fn another_object(old: &Map<String, Value>, new: &Map<String, Value>, identity: &[String]) -> bool {
    identity
        .iter()
        .any(|k| matches!((old.get(k), new.get(k)), (Some(o), Some(n)) if o != n))
}

fn render(token: &Token) -> String {
    let mut s = String::with_capacity(PREFIX.len() + 40);
    s.push_str(PREFIX);
    s.push_str(&hex::encode(token));
    s
}

fn parse(text: &str) -> Option<Token> {
    let hex_part = text.strip_prefix(PREFIX)?;
    if hex_part.len() != 40
        || !hex_part
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return None;
    }
    let mut token = [0u8; 20];
    hex::decode_to_slice(hex_part, &mut token).ok()?;
    Some(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What source-retrieval declares for `source-ref`.
    static VERSION: std::sync::LazyLock<Vec<String>> =
        std::sync::LazyLock::new(|| vec!["version".to_string()]);

    fn origin(generation: u64, revision: i64) -> Origin {
        Origin {
            mapping: Arc::from("source-library"),
            generation,
            revision,
        }
    }

    #[test]
    fn tokens_are_long_random_opaque_and_stable_per_object() {
        let t = ReferenceTable::default();
        let a = t.mint(
            &origin(1, 1),
            "source-ref",
            "wal-checkpoints",
            Map::new(),
            &VERSION,
        );
        let b = t.mint(
            &origin(1, 1),
            "source-ref",
            "other-note",
            Map::new(),
            &VERSION,
        );
        let again = t.mint(
            &origin(1, 1),
            "source-ref",
            "wal-checkpoints",
            Map::new(),
            &VERSION,
        );
        assert_ne!(a, b);
        assert_eq!(
            a, again,
            "the same object in one session gets the same token"
        );
        assert_eq!(t.len(), 2);
        assert_eq!(a.len(), 44);
        assert!(
            !a.contains("wal"),
            "the locator must not leak into the token"
        );
        let other = ReferenceTable::default();
        assert_ne!(
            other.mint(
                &origin(1, 1),
                "source-ref",
                "wal-checkpoints",
                Map::new(),
                &VERSION
            ),
            a,
            "tables never share tokens"
        );
    }

    #[test]
    fn only_the_same_kind_mapping_and_serving_revision_resolve() {
        let t = ReferenceTable::default();
        let mut facts = Map::new();
        facts.insert("bytes".into(), Value::from(12));
        let tok = t.mint(
            &origin(1, 3),
            "source-ref",
            "wal-checkpoints",
            facts,
            &VERSION,
        );
        let ok = t.resolve(&tok, "source-ref", &origin(1, 3)).unwrap();
        assert_eq!(&*ok.locator, "wal-checkpoints");
        assert_eq!(ok.facts["bytes"], 12);
        assert_eq!(
            t.resolve(&tok, "destination-ref", &origin(1, 3)),
            Err(ResolveError::NotValid),
            "a retrieval reference is not a delivery target"
        );
        let other_mapping = Origin {
            mapping: Arc::from("fs-documents"),
            ..origin(1, 3)
        };
        assert_eq!(
            t.resolve(&tok, "source-ref", &other_mapping),
            Err(ResolveError::NotValid)
        );
        assert_eq!(
            t.resolve(&tok, "source-ref", &origin(1, 4)),
            Err(ResolveError::Stale),
            "a new revision serves: the old reference is stale"
        );
        assert_eq!(
            t.resolve(&tok, "source-ref", &origin(2, 3)),
            Err(ResolveError::Stale),
            "unloaded and loaded again: the old reference is stale"
        );
        for forged in [
            "wal-checkpoints".to_string(),
            format!("{}0", &tok[..tok.len() - 1]),
            tok.to_uppercase(),
            format!("{tok} "),
            "ref_".to_string(),
            format!("ref_{}", "g".repeat(40)),
        ] {
            if forged != tok {
                assert_eq!(
                    t.resolve(&forged, "source-ref", &origin(1, 3)),
                    Err(ResolveError::NotValid),
                    "{forged}"
                );
            }
        }
    }

    #[test]
    fn other_record_kinds_of_the_same_object_keep_its_token() {
        let t = ReferenceTable::default();
        let f = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), Value::from(*v)))
                .collect::<Map<String, Value>>()
        };
        let hit = t.mint(
            &origin(1, 1),
            "source-ref",
            "wal",
            f(&[("title", "WAL"), ("version", "3"), ("snippet", "…")]),
            &VERSION,
        );
        let passage = t.mint(
            &origin(1, 1),
            "source-ref",
            "wal",
            f(&[
                ("title", "WAL"),
                ("version", "3"),
                ("media-type", "text/markdown"),
            ]),
            &VERSION,
        );
        assert_eq!(hit, passage, "a search hit and a passage of one note");
        let newer = t.mint(
            &origin(1, 1),
            "source-ref",
            "wal",
            f(&[("version", "4")]),
            &VERSION,
        );
        assert_ne!(newer, hit, "a new version is another object");
        assert_eq!(
            t.resolve(&hit, "source-ref", &origin(1, 1)),
            Err(ResolveError::NotValid)
        );
    }

    /// The research loop: search, search again, then read what the first search found.
    /// A second search reports the same notes with other, query-dependent snippets,
    /// titles and scores; none of that is the object's identity, so every token of the
    /// first search still resolves, with the facts first recorded.
    #[test]
    fn a_second_search_keeps_the_first_searchs_references() {
        let t = ReferenceTable::default();
        let hit = |query: &str, title: &str, version: Option<&str>| {
            let mut m = Map::new();
            m.insert("title".into(), Value::from(title));
            m.insert("snippet".into(), Value::from(format!("…{query}…")));
            m.insert("score".into(), Value::from(query.len()));
            if let Some(v) = version {
                m.insert("version".into(), Value::from(v));
            }
            m
        };
        let notes = ["wal-checkpoints", "compaction", "buffer-pool"];
        let first: Vec<String> = notes
            .iter()
            .map(|n| {
                t.mint(
                    &origin(1, 1),
                    "source-ref",
                    n,
                    hit("checkpoint", n, Some("3")),
                    &VERSION,
                )
            })
            .collect();
        for (n, token) in notes.iter().zip(&first) {
            let again = t.mint(
                &origin(1, 1),
                "source-ref",
                n,
                hit("wal", &n.to_uppercase(), Some("3")),
                &VERSION,
            );
            assert_eq!(&again, token, "the same note keeps its token");
            // A hit that does not report a version names no other version either.
            let unversioned = t.mint(
                &origin(1, 1),
                "source-ref",
                n,
                hit("log", n, None),
                &VERSION,
            );
            assert_eq!(&unversioned, token);
        }
        for (n, token) in notes.iter().zip(&first) {
            let r = t.resolve(token, "source-ref", &origin(1, 1)).unwrap();
            assert_eq!(&*r.locator, *n);
            assert_eq!(r.facts["snippet"], "…checkpoint…", "the first facts stay");
        }
        assert_eq!(t.len(), notes.len());
        // Without a declaration, nothing identifies a version: only the locator does.
        let dest = |label: &str| {
            let mut m = Map::new();
            m.insert("label".into(), Value::from(label));
            m
        };
        let a = t.mint(&origin(1, 1), "destination-ref", "team", dest("Team"), &[]);
        let b = t.mint(
            &origin(1, 1),
            "destination-ref",
            "team",
            dest("Team (renamed)"),
            &[],
        );
        assert_eq!(
            a, b,
            "a label describes a destination, it does not identify it"
        );
    }

    #[test]
    fn expiry_is_checked_on_use_and_a_new_mint_renews() {
        let t = ReferenceTable::with_limits(10, Duration::ZERO);
        let tok = t.mint(&origin(1, 1), "source-ref", "a", Map::new(), &VERSION);
        assert_eq!(
            t.resolve(&tok, "source-ref", &origin(1, 1)),
            Err(ResolveError::Expired)
        );
        assert!(t.is_empty(), "an expired reference is dropped when used");
        let t = ReferenceTable::with_limits(10, Duration::from_secs(60));
        let tok = t.mint(&origin(1, 1), "source-ref", "a", Map::new(), &VERSION);
        assert!(t.resolve(&tok, "source-ref", &origin(1, 1)).is_ok());
    }

    #[test]
    fn the_least_recently_used_reference_of_this_table_goes_first() {
        let t = ReferenceTable::with_limits(3, DEFAULT_TTL);
        let a = t.mint(&origin(1, 1), "source-ref", "a", Map::new(), &VERSION);
        let b = t.mint(&origin(1, 1), "source-ref", "b", Map::new(), &VERSION);
        let c = t.mint(&origin(1, 1), "source-ref", "c", Map::new(), &VERSION);
        // Using `a` makes `b` the least recently used.
        t.resolve(&a, "source-ref", &origin(1, 1)).unwrap();
        let d = t.mint(&origin(1, 1), "source-ref", "d", Map::new(), &VERSION);
        assert_eq!(t.len(), 3);
        assert!(t.resolve(&a, "source-ref", &origin(1, 1)).is_ok());
        assert_eq!(
            t.resolve(&b, "source-ref", &origin(1, 1)),
            Err(ResolveError::NotValid)
        );
        assert!(t.resolve(&c, "source-ref", &origin(1, 1)).is_ok());
        assert!(t.resolve(&d, "source-ref", &origin(1, 1)).is_ok());
        // Minting `b` again gives a new token; the old one stays unknown.
        let b2 = t.mint(&origin(1, 1), "source-ref", "b", Map::new(), &VERSION);
        assert_ne!(b, b2);
    }

    #[test]
    fn two_hundred_thousand_mints_in_one_table_and_eight_never_fail() {
        // The load that broke the shared table: every retrieval mints again, across
        // sessions. With per-session tables and one token per object nothing is evicted.
        let notes: Vec<String> = (0..40).map(|i| format!("note-{i}")).collect();
        let run = |table: &ReferenceTable, calls: usize| {
            let mut held: Vec<String> = Vec::new();
            for i in 0..calls {
                let tok = table.mint(
                    &origin(1, 1),
                    "source-ref",
                    &notes[i % notes.len()],
                    Map::new(),
                    &VERSION,
                );
                if held.len() < notes.len() {
                    held.push(tok.clone());
                }
                let first = &held[i % held.len()];
                assert!(table.resolve(first, "source-ref", &origin(1, 1)).is_ok());
            }
            assert_eq!(table.len(), notes.len());
        };
        run(&ReferenceTable::default(), 200_000);
        let tables: Vec<ReferenceTable> = (0..8).map(|_| ReferenceTable::default()).collect();
        std::thread::scope(|s| {
            for t in &tables {
                s.spawn(|| run(t, 25_000));
            }
        });
    }
}
