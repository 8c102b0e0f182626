//! Sessions: who is asking, under which profile, and what this session has been offered.
//!
//! Rule: a session's requester and profile come from the transport and the serve
//! configuration (stdio: `[requester]` and `--profile` / `default_profile`), never from
//! the model or from client-supplied fields; a profile is bound only when policy lets the
//! requester use it (`Airlock::Action::"use-profile"`). Each session owns its reference
//! table ([`ReferenceTable`]); its id is 128 random bits, so receipts bound to a session
//! cannot be used by a later process that happens to count sessions the same way.
//!
//! On a shared store (several hosts, [`crate::store::Hosts::is_shared`]) an HTTP
//! principal's session has the same id on every host: 128 bits of an HMAC, under the
//! trace key all those hosts hold, of (requester, roles, transport, profile)
//! ([`SessionId::of_principal`]). Its receipts and references are then the same on every
//! host behind a load balancer, and the id still cannot be guessed without the key.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use crate::config::Profile;
use crate::pipeline::references::ReferenceTable;
use crate::policy::Principal;

/// Identifies one model-facing session: `ses_` + 32 lowercase hex digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SessionId([u8; 16]);

impl SessionId {
    /// A new random id.
    ///
    /// # Panics
    /// When the OS random generator fails.
    pub fn random() -> Self {
        let mut bytes = [0u8; 16];
        crate::random::fill(&mut bytes);
        Self(bytes)
    }
}

impl SessionId {
    /// The id every host holding `key` gives the session of `requester` under `profile`
    /// (see the module doc).
    pub fn of_principal(
        key: &crate::store::key::TraceKey,
        requester: &Requester,
        profile: &str,
    ) -> Self {
        let roles = requester.roles.join("\u{1}");
        let d = key.derive(
            "principal-session",
            &[&requester.name, &roles, requester.transport, profile],
        );
        let mut bytes = [0u8; 16];
        bytes.copy_from_slice(&d[..16]);
        Self(bytes)
    }
}

impl std::fmt::Display for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ses_{}", hex::encode(self.0))
    }
}

/// The requester behind a session.
#[derive(Debug, Clone)]
pub struct Requester {
    /// Name (`[requester] name`, or the OS user for stdio).
    pub name: String,
    /// Roles (Cedar `Airlock::Role`).
    pub roles: Vec<String>,
    /// `stdio` (later `http`).
    pub transport: &'static str,
}

/// One model-facing session.
pub struct Session {
    id: SessionId,
    id_text: String,
    requester: Requester,
    principal: Principal,
    profile: Profile,
    references: ReferenceTable,
    /// Capability names this session has been offered (listed, or called while offered).
    known: Mutex<BTreeSet<String>>,
    /// Digest of the last catalogue this session was offered (RFC 8785, order included).
    offered: Mutex<Option<String>>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("id", &self.id_text)
            .field("requester", &self.requester.name)
            .field("profile", &self.profile.name)
            .finish_non_exhaustive()
    }
}

impl Session {
    /// A new session for `requester` bound to `profile` (already permitted by policy).
    ///
    /// # Errors
    /// The requester cannot be represented as a Cedar principal.
    pub fn new(requester: Requester, profile: Profile) -> anyhow::Result<Self> {
        Self::with_id(requester, profile, SessionId::random(), None)
    }

    /// A session with id `id`; its references are also kept in `shared` (a shared store)
    /// when given.
    ///
    /// # Errors
    /// As [`Session::new`].
    pub fn with_id(
        requester: Requester,
        profile: Profile,
        id: SessionId,
        shared: Option<std::sync::Arc<dyn crate::store::Store>>,
    ) -> anyhow::Result<Self> {
        let principal = Principal::new(&requester.name, &requester.roles, requester.transport)?;
        let id_text = id.to_string();
        let references = match shared {
            Some(store) => ReferenceTable::shared(store, &id_text),
            None => ReferenceTable::default(),
        };
        Ok(Self {
            id,
            id_text,
            requester,
            principal,
            profile,
            references,
            known: Mutex::default(),
            offered: Mutex::default(),
        })
    }

    /// The session id.
    pub fn id(&self) -> SessionId {
        self.id
    }

    /// The session id as text (`ses_…`).
    pub fn id_text(&self) -> &str {
        &self.id_text
    }

    /// The requester.
    pub fn requester(&self) -> &Requester {
        &self.requester
    }

    /// The requester as a Cedar principal.
    pub fn principal(&self) -> &Principal {
        &self.principal
    }

    /// The bound profile.
    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    /// The session's reference table.
    pub fn references(&self) -> &ReferenceTable {
        &self.references
    }

    /// Whether this session was ever offered capability `name`.
    pub fn knows(&self, name: &str) -> bool {
        self.known
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(name)
    }

    /// Remembers that capability names were offered to this session.
    pub fn remember<'a>(&self, names: impl IntoIterator<Item = &'a str>) {
        let mut known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        for n in names {
            if !known.contains(n) {
                known.insert(n.to_string());
            }
        }
    }

    /// True when `digest` differs from the latest offered catalogue recorded with
    /// [`Session::record_offer`].
    pub fn offer_differs(&self, digest: &str) -> bool {
        self.offered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_deref()
            != Some(digest)
    }

    /// Records `digest` as the latest offered catalogue (once its trace event is committed).
    pub fn record_offer(&self, digest: &str) {
        *self.offered.lock().unwrap_or_else(|e| e.into_inner()) = Some(digest.to_string());
    }

    /// The digest of the latest catalogue this session was offered, if any.
    pub fn offered_digest(&self) -> Option<String> {
        self.offered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// A shared session.
pub type SessionRef = Arc<Session>;
