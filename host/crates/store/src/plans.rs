//! The store's write rules, each written once as a pure plan: given what a transaction
//! read, a plan says what to write or why to refuse. Both backends ([`SqliteStore`] and
//! [`PostgresStore`](crate::PostgresStore)) read the rows, call the plan and execute what
//! it says in their own SQL; neither decides a rule itself. No plan touches a database, a
//! clock or a random source: the caller passes the time.
//!
//! The rules:
//! - **Snapshots are immutable** ([`snapshot_write`]): a digest not stored yet is inserted;
//!   one stored with the same connection, configuration revision and canonical body is a
//!   new sighting only; the same digest with another connection, revision or body is
//!   refused, connection and revision checked before the body.
//! - **A new mapping revision supersedes the latest** ([`supersede`]): revision = latest +
//!   1 (1 for a new name), and the latest, unless already historical, becomes historical
//!   with "; superseded by revision N (was STATE)" added to its reason. Only the latest
//!   revision is ever superseded: an older one is historical already.
//! - **A mapping's state changes by compare-and-set** ([`check_transition`], then
//!   [`set_state`]): the transition must be allowed ([`MappingState::can_become`]) before
//!   anything is read; an unknown mapping is an error; a latest revision whose state is not
//!   the expected one is left alone (`None`, someone else changed it).
//! - **A receipt is consumed only when everything holds** ([`check_consumption`]), and
//!   the refusal names the first rule broken, in this order: expired (on the host clock;
//!   the caller marks it expired and commits that) → not in the state the consumption
//!   needs (approved out of band, pending in band) → the in-band answer's nonce differs →
//!   a bound field changed (all of them named).
//! - **Only an unknown intent, or one a stopped host left prepared, can be resolved**
//!   ([`check_resolution`] before the transaction, [`check_resolvable`] in it), and only as
//!   completed or failed.
//! - **An intent's handles are kept only when it completes** ([`handles_text`]), written
//!   once (a trigger refuses a second write in both backends), and proven by the digest
//!   its completing trace event carries ([`handles_sha256`]).
//! - **One compensation per intent at a time**: a unique index over `compensates` among
//!   intents not `failed` refuses a second one while the first is open or completed.
//!
//! [`SqliteStore`]: crate::SqliteStore

use anyhow::bail;

use crate::{
    ApprovalRecord, ApprovalState, ConsumeAs, IntentHandle, IntentState, MappingRecord,
    MappingState, NewMappingRevision, ReceiptBinding, ReceiptRefusal, Resolution,
};

/// The stored text of the handles an intent's outcome `state` keeps (`None`: nothing to
/// keep).
///
/// # Errors
/// Handles given with another outcome than `completed`: only a completed effect has
/// something to undo.
pub fn handles_text(
    state: IntentState,
    handles: &[IntentHandle],
) -> anyhow::Result<Option<String>> {
    if handles.is_empty() {
        return Ok(None);
    }
    if state != IntentState::Completed {
        bail!(
            "an intent keeps the handles of its result only when it completes, not when {}",
            state.as_str()
        );
    }
    Ok(Some(serde_json::to_string(handles)?))
}

/// sha256 (64 lowercase hex) of the stored text of `handles` ([`handles_text`]): what the
/// trace event that completes an intent records under its MAC, so that handles changed in
/// the database are found before anything is undone by them. `None` for no handles.
pub fn handles_sha256(handles: &[IntentHandle]) -> Option<String> {
    use sha2::Digest as _;
    if handles.is_empty() {
        return None;
    }
    let text = serde_json::to_string(handles).ok()?;
    Some(hex::encode(sha2::Sha256::digest(text.as_bytes())))
}

/// What a snapshot already stored under the offered digest holds, as read in the
/// transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredSnapshotKey {
    /// The connection it was stored for.
    pub connection_id: String,
    /// That connection's configuration revision.
    pub config_revision: i64,
    /// The stored body (canonical JSON text).
    pub body: String,
}

/// What [`snapshot_write`] says to do with an offered snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotWrite {
    /// Store the body (first sighting of the digest), then record the observation.
    Insert,
    /// The same snapshot is stored: record the observation only.
    Observe,
}

/// The immutability rule for a snapshot offered under `digest` (lowercase hex) for
/// `connection_id` revision `config_revision` with canonical body `body`, given what is
/// stored under that digest (`None`: nothing).
///
/// # Errors
/// The digest is stored for another connection or revision ("… is already stored for
/// connection C revision R, not …; snapshots are immutable"), or with another body
/// ("… is already stored with a different body; snapshots are immutable").
pub fn snapshot_write(
    digest: &str,
    connection_id: &str,
    config_revision: i64,
    body: &str,
    stored: Option<&StoredSnapshotKey>,
) -> anyhow::Result<SnapshotWrite> {
    let Some(stored) = stored else {
        return Ok(SnapshotWrite::Insert);
    };
    if stored.connection_id != connection_id || stored.config_revision != config_revision {
        bail!(
            "snapshot {digest} is already stored for connection {} revision {}, not \
             {connection_id} revision {config_revision}; snapshots are immutable",
            stored.connection_id,
            stored.config_revision
        );
    }
    if stored.body != body {
        bail!("snapshot {digest} is already stored with a different body; snapshots are immutable");
    }
    Ok(SnapshotWrite::Observe)
}

/// The previous revision's row after [`supersede`]: its new state is
/// [`MappingState::Historical`], changed at the new revision's creation time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retired {
    /// The revision to update (the latest before the new one).
    pub revision: i64,
    /// Its new reason: the old one + "; superseded by revision N (was STATE)".
    pub reason: String,
}

/// What [`supersede`] says to write.
#[derive(Debug, Clone, PartialEq)]
pub struct Supersession {
    /// The latest revision to make historical, when it is not already.
    pub retire: Option<Retired>,
    /// The new revision's record, as it is to be inserted and returned.
    pub record: MappingRecord,
}

/// Supersession of mapping revisions: `new` becomes revision `previous + 1` (1 when
/// `previous`, the latest revision, is `None`), created and state-changed at `now_ms`
/// (unix ms), with `pins` (the canonical pins parsed back) as its pins. The previous
/// revision, unless already historical, is retired (see [`Retired`]).
pub fn supersede(
    previous: Option<&MappingRecord>,
    new: &NewMappingRevision,
    pins: serde_json::Value,
    now_ms: u64,
) -> Supersession {
    let revision = previous.map_or(1, |p| p.revision + 1);
    let retire = previous
        .filter(|p| p.state != MappingState::Historical)
        .map(|p| Retired {
            revision: p.revision,
            reason: format!(
                "{}; superseded by revision {revision} (was {})",
                p.reason, p.state
            ),
        });
    Supersession {
        retire,
        record: MappingRecord {
            name: new.name.clone(),
            revision,
            manifest_digest: new.manifest_digest.clone(),
            component_sha256: new.component_sha256.clone(),
            connection_id: new.connection_id.clone(),
            config_revision: new.config_revision,
            snapshot_digest: new.snapshot_digest.clone(),
            pins,
            state: new.state,
            reviewer: new.reviewer.clone(),
            reason: new.reason.clone(),
            created_ms: now_ms,
            state_changed_ms: now_ms,
            manifest_text: new.manifest_text.clone(),
        },
    }
}

/// Whether mapping `name` may be moved `expected → to` at all; checked before the
/// transaction.
///
/// # Errors
/// "mapping NAME: EXPECTED cannot become TO" when [`MappingState::can_become`] says no.
pub fn check_transition(
    name: &str,
    expected: MappingState,
    to: MappingState,
) -> anyhow::Result<()> {
    if !expected.can_become(to) {
        bail!("mapping {name:?}: {expected} cannot become {to}");
    }
    Ok(())
}

/// Compare-and-set of mapping `name`'s state on its `latest` revision: `Ok(None)` when the
/// latest state is not `expected` (write nothing); otherwise the record to write (state
/// `to`, reason `reason`, changed at `now_ms`, unix ms) for the same revision.
///
/// # Errors
/// The mapping does not exist (`latest` is `None`).
pub fn set_state(
    name: &str,
    latest: Option<MappingRecord>,
    expected: MappingState,
    to: MappingState,
    reason: &str,
    now_ms: u64,
) -> anyhow::Result<Option<MappingRecord>> {
    let Some(latest) = latest else {
        bail!("mapping {name:?} does not exist");
    };
    if latest.state != expected {
        return Ok(None);
    }
    Ok(Some(MappingRecord {
        state: to,
        reason: reason.to_owned(),
        state_changed_ms: now_ms,
        ..latest
    }))
}

/// Whether `record` may be consumed `how` for a call bound to `binding` at `now_ms`
/// (unix ms, host clock). The refusal order is the module's: expired, then state, then
/// nonce, then changed fields. On [`ReceiptRefusal::Expired`] the caller marks the
/// approval expired and commits; on any other refusal it writes nothing.
pub fn check_consumption(
    record: &ApprovalRecord,
    binding: &ReceiptBinding,
    how: ConsumeAs<'_>,
    now_ms: u64,
) -> Result<(), ReceiptRefusal> {
    let wanted = match how {
        ConsumeAs::Approved => ApprovalState::Approved,
        ConsumeAs::AnsweredInBand { .. } => ApprovalState::Pending,
    };
    let state = record.state_at(now_ms);
    if state == ApprovalState::Expired {
        return Err(ReceiptRefusal::Expired);
    }
    if state != wanted {
        return Err(ReceiptRefusal::State(state));
    }
    if let ConsumeAs::AnsweredInBand {
        nonce: Some(nonce), ..
    } = how
        && nonce != record.nonce
    {
        return Err(ReceiptRefusal::Nonce);
    }
    let changed = record.changed_fields(binding);
    if !changed.is_empty() {
        return Err(ReceiptRefusal::Changed(changed));
    }
    Ok(())
}

/// The refusal when the conditional update that consumes `record` matched no row (another
/// consumer won the race): its state as of `now_ms`.
pub fn lost_consumption(record: &ApprovalRecord, now_ms: u64) -> ReceiptRefusal {
    ReceiptRefusal::State(record.state_at(now_ms))
}

/// Checks a resolution before the transaction and gives the stored form of how it was
/// resolved: `{"method", "by", "evidence"}` as JSON text.
///
/// # Errors
/// The resolution's state is not completed or failed ("an intent is resolved as
/// completed or failed, not STATE"), or the evidence does not serialize.
pub fn check_resolution(how: &Resolution) -> anyhow::Result<String> {
    if !matches!(how.state, IntentState::Completed | IntentState::Failed) {
        bail!(
            "an intent is resolved as completed or failed, not {}",
            how.state.as_str()
        );
    }
    Ok(serde_json::to_string(&serde_json::json!({
        "method": how.method,
        "by": how.by,
        "evidence": how.evidence,
    }))?)
}

/// Whether intent `id`, whose stored state is `current` (`None`: no such intent), may be
/// resolved: only `unknown` or `prepared` (one a stopped host left).
///
/// # Errors
/// "no intent `ID`"; "intent `ID` is STATE: only an unknown intent (or one a stopped host
/// left prepared) can be resolved".
pub fn check_resolvable(id: &str, current: Option<&str>) -> anyhow::Result<()> {
    match current {
        None => bail!("no intent `{id}`"),
        Some("unknown" | "prepared") => Ok(()),
        Some(other) => bail!(
            "intent `{id}` is {other}: only an unknown intent (or one a stopped host left prepared) can be resolved"
        ),
    }
}

/// The error when an intent's outcome is recorded but the conditional update matched no
/// prepared row: "intent `ID` is not prepared (its outcome was already recorded)".
pub fn not_prepared(id: &str) -> anyhow::Error {
    anyhow::anyhow!("intent `{id}` is not prepared (its outcome was already recorded)")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ApprovalMode, IntentState, ResolutionMethod};

    fn binding() -> ReceiptBinding {
        ReceiptBinding {
            requester: "alice".into(),
            session: "s1".into(),
            capability: "deliver".into(),
            mapping: "m".into(),
            mapping_revision: 1,
            snapshot_digest: "aa".into(),
            policy_digest: "bb".into(),
            args_digest: "cc".into(),
            artifact_digest: Some("dd".into()),
        }
    }

    fn approval(state: ApprovalState, expires_ms: u64) -> ApprovalRecord {
        ApprovalRecord {
            id: "apr_1".into(),
            state,
            mode: ApprovalMode::InputRequired,
            binding: binding(),
            profile: "p".into(),
            summary: "s".into(),
            nonce: "n1".into(),
            created_ms: 0,
            expires_ms,
            decided_by: None,
            decided_ms: None,
            reason: None,
            consumed_ms: None,
            intent_id: None,
        }
    }

    fn mapping(revision: i64, state: MappingState, reason: &str) -> MappingRecord {
        MappingRecord {
            name: "m".into(),
            revision,
            manifest_digest: "m1".into(),
            component_sha256: "c1".into(),
            connection_id: "conn-1".into(),
            config_revision: 1,
            snapshot_digest: None,
            pins: serde_json::json!({}),
            state,
            reviewer: None,
            reason: reason.into(),
            created_ms: 1,
            state_changed_ms: 1,
            manifest_text: None,
        }
    }

    fn new_revision(state: MappingState) -> NewMappingRevision {
        NewMappingRevision {
            name: "m".into(),
            manifest_digest: "m2".into(),
            component_sha256: "c2".into(),
            connection_id: "conn-1".into(),
            config_revision: 2,
            snapshot_digest: Some("ab".into()),
            pins: serde_json::json!({"t": 1}),
            state,
            reviewer: Some("bob".into()),
            reason: "reviewed".into(),
            manifest_text: Some("x".into()),
        }
    }

    fn in_band(nonce: Option<&str>) -> ConsumeAs<'_> {
        ConsumeAs::AnsweredInBand { by: "bob", nonce }
    }

    #[test]
    fn expired_wins_over_state_nonce_and_changed_fields() {
        let mut other = binding();
        other.args_digest = "ff".into();
        // Denied and past its expiry reads as denied (only pending/approved expire) …
        let denied = approval(ApprovalState::Denied, 10);
        assert_eq!(
            check_consumption(&denied, &other, in_band(Some("forged")), 20),
            Err(ReceiptRefusal::State(ApprovalState::Denied))
        );
        // … a pending one past its expiry is expired, whatever else is wrong.
        let pending = approval(ApprovalState::Pending, 10);
        assert_eq!(
            check_consumption(&pending, &other, in_band(Some("forged")), 10),
            Err(ReceiptRefusal::Expired)
        );
        // Consumed out of band while only pending: state before nonce and fields.
        assert_eq!(
            check_consumption(&pending, &other, ConsumeAs::Approved, 9),
            Err(ReceiptRefusal::State(ApprovalState::Pending))
        );
    }

    #[test]
    fn nonce_wins_over_changed_fields_and_all_changed_fields_are_named() {
        let pending = approval(ApprovalState::Pending, 100);
        let mut other = binding();
        other.requester = "mallory".into();
        other.artifact_digest = None;
        assert_eq!(
            check_consumption(&pending, &other, in_band(Some("forged")), 1),
            Err(ReceiptRefusal::Nonce)
        );
        assert_eq!(
            check_consumption(&pending, &other, in_band(Some("n1")), 1),
            Err(ReceiptRefusal::Changed(vec!["requester", "artifact"]))
        );
        // No nonce given (elicitation): the nonce is not the check.
        assert_eq!(
            check_consumption(&pending, &other, in_band(None), 1),
            Err(ReceiptRefusal::Changed(vec!["requester", "artifact"]))
        );
        assert_eq!(
            check_consumption(&pending, &binding(), in_band(Some("n1")), 1),
            Ok(())
        );
        let approved = approval(ApprovalState::Approved, 100);
        assert_eq!(
            check_consumption(&approved, &binding(), ConsumeAs::Approved, 99),
            Ok(())
        );
        assert_eq!(
            check_consumption(&approved, &binding(), in_band(Some("n1")), 99),
            Err(ReceiptRefusal::State(ApprovalState::Approved))
        );
    }

    #[test]
    fn a_consumed_receipt_is_refused_by_state_and_a_lost_race_names_the_state_seen() {
        let consumed = approval(ApprovalState::Consumed, 100);
        assert_eq!(
            check_consumption(&consumed, &binding(), ConsumeAs::Approved, 1),
            Err(ReceiptRefusal::State(ApprovalState::Consumed))
        );
        let approved = approval(ApprovalState::Approved, 100);
        assert_eq!(
            lost_consumption(&approved, 1),
            ReceiptRefusal::State(ApprovalState::Approved)
        );
    }

    #[test]
    fn an_immutable_snapshot_rewritten_with_other_bytes_is_refused() {
        let stored = StoredSnapshotKey {
            connection_id: "conn-1".into(),
            config_revision: 1,
            body: r#"{"a":1}"#.into(),
        };
        assert_eq!(
            snapshot_write("ab", "conn-1", 1, r#"{"a":1}"#, None).unwrap(),
            SnapshotWrite::Insert
        );
        assert_eq!(
            snapshot_write("ab", "conn-1", 1, r#"{"a":1}"#, Some(&stored)).unwrap(),
            SnapshotWrite::Observe
        );
        let body = snapshot_write("ab", "conn-1", 1, r#"{"a":2}"#, Some(&stored))
            .unwrap_err()
            .to_string();
        assert_eq!(
            body,
            "snapshot ab is already stored with a different body; snapshots are immutable"
        );
        // Another revision and another body: the binding is named, not the body.
        let moved = snapshot_write("ab", "conn-1", 2, r#"{"a":2}"#, Some(&stored))
            .unwrap_err()
            .to_string();
        assert_eq!(
            moved,
            "snapshot ab is already stored for connection conn-1 revision 1, not conn-1 \
             revision 2; snapshots are immutable"
        );
        assert!(snapshot_write("ab", "conn-2", 1, r#"{"a":1}"#, Some(&stored)).is_err());
    }

    #[test]
    fn supersession_retires_only_a_latest_that_is_not_historical() {
        let first = supersede(
            None,
            &new_revision(MappingState::Candidate),
            serde_json::json!({}),
            5,
        );
        assert_eq!(first.retire, None);
        assert_eq!(first.record.revision, 1);
        assert_eq!(
            (first.record.created_ms, first.record.state_changed_ms),
            (5, 5)
        );

        let active = mapping(3, MappingState::Active, "approved");
        let next = supersede(
            Some(&active),
            &new_revision(MappingState::Active),
            serde_json::json!({"t": 1}),
            9,
        );
        assert_eq!(
            next.retire,
            Some(Retired {
                revision: 3,
                reason: "approved; superseded by revision 4 (was active)".into()
            })
        );
        assert_eq!(next.record.revision, 4);
        assert_eq!(next.record.reviewer.as_deref(), Some("bob"));
        // The reason written is the one superseded_while_serving reads back.
        let retired = MappingRecord {
            state: MappingState::Historical,
            reason: next.retire.unwrap().reason,
            ..active
        };
        assert_eq!(
            retired.superseded_while_serving(),
            Some(MappingState::Active)
        );

        // A latest that is historical already (withdrawn) is left as it is.
        let historical = mapping(7, MappingState::Historical, "retired");
        let after = supersede(
            Some(&historical),
            &new_revision(MappingState::Candidate),
            serde_json::json!({}),
            9,
        );
        assert_eq!(after.retire, None);
        assert_eq!(after.record.revision, 8);
    }

    #[test]
    fn state_changes_are_compare_and_set_on_the_latest_revision() {
        assert!(check_transition("m", MappingState::Historical, MappingState::Active).is_err());
        assert_eq!(
            check_transition("m", MappingState::Active, MappingState::Active)
                .unwrap_err()
                .to_string(),
            "mapping \"m\": active cannot become active"
        );
        assert!(check_transition("m", MappingState::Active, MappingState::Degraded).is_ok());
        assert_eq!(
            set_state(
                "m",
                None,
                MappingState::Active,
                MappingState::Degraded,
                "r",
                1
            )
            .unwrap_err()
            .to_string(),
            "mapping \"m\" does not exist"
        );
        let latest = mapping(2, MappingState::Limited, "old");
        assert_eq!(
            set_state(
                "m",
                Some(latest.clone()),
                MappingState::Active,
                MappingState::Degraded,
                "r",
                1
            )
            .unwrap(),
            None
        );
        let changed = set_state(
            "m",
            Some(latest),
            MappingState::Limited,
            MappingState::Active,
            "up",
            7,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            (
                changed.revision,
                changed.state,
                changed.reason.as_str(),
                changed.state_changed_ms,
                changed.created_ms
            ),
            (2, MappingState::Active, "up", 7, 1)
        );
    }

    #[test]
    fn only_an_unknown_or_prepared_intent_is_resolved_as_completed_or_failed() {
        let person = |state| Resolution {
            handles: Vec::new(),
            state,
            method: ResolutionMethod::Person,
            by: "bob".into(),
            evidence: serde_json::json!({"note": "checked \"by hand\""}),
        };
        assert_eq!(
            check_resolution(&person(IntentState::Unknown))
                .unwrap_err()
                .to_string(),
            "an intent is resolved as completed or failed, not unknown"
        );
        assert!(check_resolution(&person(IntentState::Prepared)).is_err());
        let text = check_resolution(&person(IntentState::Completed)).unwrap();
        let back: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back["method"], "person");
        assert_eq!(back["evidence"]["note"], "checked \"by hand\"");

        assert_eq!(
            check_resolvable("int_1", None).unwrap_err().to_string(),
            "no intent `int_1`"
        );
        assert_eq!(
            check_resolvable("int_1", Some("completed"))
                .unwrap_err()
                .to_string(),
            "intent `int_1` is completed: only an unknown intent (or one a stopped host left prepared) can be resolved"
        );
        assert!(check_resolvable("int_1", Some("failed")).is_err());
        assert!(check_resolvable("int_1", Some("")).is_err());
        assert!(check_resolvable("int_1", Some("unknown")).is_ok());
        assert!(check_resolvable("int_1", Some("prepared")).is_ok());
    }
}
