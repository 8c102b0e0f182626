//! Contract reviews: which operator contract packages a person approved, pinned by digest.
//!
//! Rule: a released `name@version` is one package forever. The store keeps at most one
//! review per package name; approving the same name with another digest is refused naming
//! both digests (a changed package is a new version, a migration). An approval is final
//! except for one move: a package found wrong is marked `erroneous` (its mappings stop
//! serving new calls; the review and its files stay, so history keeps what the model was
//! offered). Each change is written with the trace event that proves it, in one
//! transaction ([`ContractReviews::contract_proofs`] reads them back MAC-checked). The
//! rules are the pure functions [`plan_approval`] and [`plan_erroneous`], which both
//! backends run.

use serde::Serialize;

use crate::TraceEvent;
use crate::trace::NewEvent;

/// Trace event kind: a contract package was approved (payload: `package`, `digest`,
/// `reviewer`).
pub const CONTRACT_APPROVED: &str = "contract-approved";

/// Trace event kind: an approved contract package was marked erroneous (payload:
/// `package`, `digest`, `reviewer`, `reason`).
pub const CONTRACT_ERRONEOUS: &str = "contract-marked-erroneous";

/// The state of a contract review.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ContractState {
    /// Mappings may bind it.
    Approved,
    /// Found wrong: its mappings serve no new calls. Final.
    Erroneous,
}

impl ContractState {
    /// `approved` or `erroneous`, as stored and shown.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Approved => "approved",
            Self::Erroneous => "erroneous",
        }
    }

    /// The state named `text`, if any.
    pub fn parse(text: &str) -> Option<Self> {
        [Self::Approved, Self::Erroneous]
            .into_iter()
            .find(|s| s.as_str() == text)
    }
}

impl std::fmt::Display for ContractState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One contract package's review.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ContractRecord {
    /// The package, `namespace:name@version`.
    pub package: String,
    /// The approved package digest (sha256 over its WIT and sidecar).
    pub digest: String,
    /// Its state.
    pub state: ContractState,
    /// Who approved it, or who marked it erroneous.
    pub reviewer: String,
    /// Why it is in its state.
    pub reason: String,
    /// The package's files as approved: a JSON object of relative path to text.
    pub files: String,
    /// When it was approved (unix ms).
    pub created_ms: u64,
    /// When its state last changed (unix ms).
    pub state_changed_ms: u64,
}

/// An approval to record.
#[derive(Debug, Clone)]
pub struct NewContractApproval {
    /// The package, `namespace:name@version`.
    pub package: String,
    /// Its digest.
    pub digest: String,
    /// Who approves.
    pub reviewer: String,
    /// Why (free text; may be empty).
    pub reason: String,
    /// The package's files, a JSON object of relative path to text.
    pub files: String,
}

/// What recording an approval does, given the package's current review.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApprovalPlan {
    /// Insert the review (and its event).
    Insert(ContractRecord),
    /// Already approved with this digest: nothing changes.
    Unchanged(ContractRecord),
}

/// The rule of approval: a new name is inserted as approved; the same digest again changes
/// nothing.
///
/// # Errors
/// An empty package name or digest; the name approved with another digest (naming both);
/// the same digest already marked erroneous.
pub fn plan_approval(
    current: Option<ContractRecord>,
    new: &NewContractApproval,
    now_ms: u64,
) -> anyhow::Result<ApprovalPlan> {
    if new.package.is_empty() || new.digest.is_empty() {
        anyhow::bail!("a contract approval needs a package name and a digest");
    }
    match current {
        None => Ok(ApprovalPlan::Insert(ContractRecord {
            package: new.package.clone(),
            digest: new.digest.clone(),
            state: ContractState::Approved,
            reviewer: new.reviewer.clone(),
            reason: new.reason.clone(),
            files: new.files.clone(),
            created_ms: now_ms,
            state_changed_ms: now_ms,
        })),
        Some(old) if old.digest != new.digest => anyhow::bail!(
            "contract package `{}` was approved with digest {}; this one has digest {}: a released name@version never changes, so give the changed package a new version",
            new.package,
            old.digest,
            new.digest
        ),
        Some(old) if old.state == ContractState::Erroneous => anyhow::bail!(
            "contract package `{}` (digest {}) was marked erroneous ({}); publish a corrected package under a new version",
            old.package,
            old.digest,
            old.reason
        ),
        Some(old) => Ok(ApprovalPlan::Unchanged(old)),
    }
}

/// The rule of marking erroneous: only an approved package moves, once.
///
/// Returns the record after the change, or `None` when it was erroneous already.
///
/// # Errors
/// No review of `package`; an empty reviewer or reason (the state is final: who and why
/// are what history keeps).
pub fn plan_erroneous(
    package: &str,
    current: Option<ContractRecord>,
    reviewer: &str,
    reason: &str,
    now_ms: u64,
) -> anyhow::Result<Option<ContractRecord>> {
    if reviewer.trim().is_empty() || reason.trim().is_empty() {
        anyhow::bail!(
            "marking contract package `{package}` erroneous needs who (--reviewer) and why (--reason)"
        );
    }
    let Some(old) = current else {
        anyhow::bail!("contract package `{package}` was never approved; there is nothing to mark");
    };
    if old.state == ContractState::Erroneous {
        return Ok(None);
    }
    Ok(Some(ContractRecord {
        state: ContractState::Erroneous,
        reviewer: reviewer.to_string(),
        reason: reason.to_string(),
        state_changed_ms: now_ms,
        ..old
    }))
}

/// The trace event that proves `record`'s current state.
pub fn event_for(record: &ContractRecord) -> NewEvent {
    let kind = match record.state {
        ContractState::Approved => CONTRACT_APPROVED,
        ContractState::Erroneous => CONTRACT_ERRONEOUS,
    };
    NewEvent::new(
        kind,
        record.package.clone(),
        serde_json::json!({
            "package": record.package,
            "digest": record.digest,
            "reviewer": record.reviewer,
            "reason": record.reason,
        }),
    )
}

/// Contract reviews in the store.
pub trait ContractReviews: Send + Sync {
    /// The review of `package` (`namespace:name@version`), if any.
    fn contract_review(&self, package: &str) -> anyhow::Result<Option<ContractRecord>>;

    /// Every review, by package name.
    fn contract_reviews(&self) -> anyhow::Result<Vec<ContractRecord>>;

    /// Records an approval ([`plan_approval`]) with its `contract-approved` event in one
    /// transaction; an unchanged approval writes nothing.
    ///
    /// # Errors
    /// As [`plan_approval`]; a database failure.
    fn approve_contract(&self, new: &NewContractApproval) -> anyhow::Result<ContractRecord>;

    /// Marks an approved package erroneous ([`plan_erroneous`]) with its event, in one
    /// transaction; `Ok(None)` when it was erroneous already (nothing is written).
    ///
    /// # Errors
    /// As [`plan_erroneous`]; a database failure.
    fn mark_contract_erroneous(
        &self,
        package: &str,
        reviewer: &str,
        reason: &str,
    ) -> anyhow::Result<Option<ContractRecord>>;

    /// The events that can prove `package`'s review, in seq order: its
    /// `contract-approved` and `contract-marked-erroneous` events, **only those whose MAC
    /// verifies with the host key**.
    fn contract_proofs(&self, package: &str) -> anyhow::Result<Vec<TraceEvent>>;
}

/// Whether the MAC-checked `proofs` (from [`ContractReviews::contract_proofs`]) prove
/// `record`: the last event names its digest and state. `None` when they do; else why
/// not, in words.
pub fn disproof(record: &ContractRecord, proofs: &[TraceEvent]) -> Option<String> {
    let Some(last) = proofs.last() else {
        return Some(format!(
            "no MACed contract event records the review of `{}`",
            record.package
        ));
    };
    let state = match last.kind.as_str() {
        CONTRACT_APPROVED => ContractState::Approved,
        _ => ContractState::Erroneous,
    };
    if last.payload["digest"] != record.digest.as_str() || state != record.state {
        return Some(format!(
            "the store says `{}` is {} with digest {}, but its last MACed event says {} with digest {}",
            record.package,
            record.state,
            record.digest,
            state,
            last.payload["digest"].as_str().unwrap_or("?")
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn new(digest: &str) -> NewContractApproval {
        NewContractApproval {
            package: "example:workspace@1.0.0".into(),
            digest: digest.into(),
            reviewer: "alice".into(),
            reason: String::new(),
            files: "{}".into(),
        }
    }

    fn event(kind: &str, digest: &str) -> TraceEvent {
        TraceEvent {
            seq: 1,
            at_ms: 1,
            kind: kind.into(),
            subject: "example:workspace@1.0.0".into(),
            payload: serde_json::json!({"package": "example:workspace@1.0.0", "digest": digest}),
            prev_hash: String::new(),
            hash: String::new(),
            key_id: None,
        }
    }

    /// A review is proven only by a MACed event of its digest and state, the last one
    /// counting; an event of another kind never proves an approval.
    #[test]
    fn only_the_last_event_of_the_same_digest_and_state_proves_a_review() {
        let ApprovalPlan::Insert(approved) = plan_approval(None, &new("aa"), 1).unwrap() else {
            panic!()
        };
        assert!(
            disproof(&approved, &[])
                .unwrap()
                .contains("no MACed contract event")
        );
        assert_eq!(disproof(&approved, &[event(CONTRACT_APPROVED, "aa")]), None);
        assert!(
            disproof(&approved, &[event(CONTRACT_APPROVED, "bb")]).is_some(),
            "another digest"
        );
        assert!(
            disproof(
                &approved,
                &[
                    event(CONTRACT_APPROVED, "aa"),
                    event(CONTRACT_ERRONEOUS, "aa")
                ]
            )
            .is_some(),
            "marked erroneous later"
        );
        assert!(
            disproof(&approved, &[event("mapping-revision", "aa")]).is_some(),
            "another kind"
        );
    }

    #[test]
    fn a_name_is_approved_once_with_one_digest_and_marked_erroneous_once() {
        let ApprovalPlan::Insert(first) = plan_approval(None, &new("aa"), 1).unwrap() else {
            panic!("a new name is inserted")
        };
        assert_eq!(first.state, ContractState::Approved);
        assert_eq!(
            plan_approval(Some(first.clone()), &new("aa"), 2).unwrap(),
            ApprovalPlan::Unchanged(first.clone())
        );
        let err = plan_approval(Some(first.clone()), &new("bb"), 2)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("aa") && err.contains("bb") && err.contains("new version"),
            "{err}"
        );
        let marked = plan_erroneous("p", Some(first.clone()), "bob", "wrong class", 3)
            .unwrap()
            .unwrap();
        assert_eq!(marked.state, ContractState::Erroneous);
        assert_eq!((marked.created_ms, marked.state_changed_ms), (1, 3));
        assert_eq!(
            plan_erroneous("p", Some(marked.clone()), "bob", "again", 4).unwrap(),
            None
        );
        let err = plan_approval(Some(marked), &new("aa"), 5)
            .unwrap_err()
            .to_string();
        assert!(err.contains("marked erroneous"), "{err}");
        assert!(plan_erroneous("p", None, "bob", "x", 1).is_err());
        assert!(plan_erroneous("p", Some(first.clone()), "", "x", 1).is_err());
        assert!(plan_erroneous("p", Some(first.clone()), "bob", " ", 1).is_err());
        assert!(plan_approval(None, &new(""), 1).is_err());
    }
}
