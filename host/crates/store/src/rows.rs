//! Row ⇄ record conversion, written once for both backends. A backend's row type
//! implements [`Columns`] (read one column as text or a 64-bit integer, or say a value is
//! invalid in its own error type); each `*_from_row` function here turns the columns of
//! one `SELECT` (in the order of the column list it names) into a record.
//!
//! The rule: a row that does not make a valid record is an error, never a default. Times
//! are unix ms in signed 64-bit columns: a negative required time is an error, a negative
//! optional one (never written) reads as 0; states and modes must parse
//! ([`MappingState::parse`], [`ApprovalState::parse`], …); JSON columns must parse (the
//! stored resolution of an intent excepted: one that does not parse reads as none); a
//! count must fit in `u32`.

use crate::approvals::{ApprovalMode, ApprovalRecord, ApprovalState, IntentRecord, IntentState};
use crate::approvals::{NewIntent, ReceiptBinding, Waiting};
use crate::intents::{AttemptRecord, AttemptState};
use crate::{
    ConnectionRecord, MappingRecord, MappingState, SnapshotSummary, StoredEvent, StoredSnapshot,
    TraceEvent,
};

/// One result row of a backend, read by column index (0-based).
pub(crate) trait Columns {
    /// The backend's error.
    type Error;
    /// A `TEXT` column that is not `NULL`.
    fn text(&self, i: usize) -> Result<String, Self::Error>;
    /// A `TEXT` column that may be `NULL`.
    fn opt_text(&self, i: usize) -> Result<Option<String>, Self::Error>;
    /// An integer column (`INTEGER` in SQLite, `BIGINT` in PostgreSQL) that is not `NULL`.
    fn int(&self, i: usize) -> Result<i64, Self::Error>;
    /// An integer column that may be `NULL`.
    fn opt_int(&self, i: usize) -> Result<Option<i64>, Self::Error>;
    /// The error for column `i` holding a value no record accepts (`why`, in words).
    fn invalid(&self, i: usize, why: String) -> Self::Error;
}

impl Columns for rusqlite::Row<'_> {
    type Error = rusqlite::Error;
    fn text(&self, i: usize) -> rusqlite::Result<String> {
        self.get(i)
    }
    fn opt_text(&self, i: usize) -> rusqlite::Result<Option<String>> {
        self.get(i)
    }
    fn int(&self, i: usize) -> rusqlite::Result<i64> {
        self.get(i)
    }
    fn opt_int(&self, i: usize) -> rusqlite::Result<Option<i64>> {
        self.get(i)
    }
    fn invalid(&self, i: usize, why: String) -> rusqlite::Error {
        rusqlite::Error::FromSqlConversionFailure(i, rusqlite::types::Type::Text, why.into())
    }
}

impl Columns for tokio_postgres::Row {
    type Error = anyhow::Error;
    fn text(&self, i: usize) -> anyhow::Result<String> {
        self.try_get(i).map_err(crate::postgres::db)
    }
    fn opt_text(&self, i: usize) -> anyhow::Result<Option<String>> {
        self.try_get(i).map_err(crate::postgres::db)
    }
    fn int(&self, i: usize) -> anyhow::Result<i64> {
        self.try_get(i).map_err(crate::postgres::db)
    }
    fn opt_int(&self, i: usize) -> anyhow::Result<Option<i64>> {
        self.try_get(i).map_err(crate::postgres::db)
    }
    fn invalid(&self, i: usize, why: String) -> anyhow::Error {
        anyhow::anyhow!("column {i}: {why}")
    }
}

/// A required time (unix ms): negative is an error.
pub(crate) fn ms<C: Columns + ?Sized>(row: &C, i: usize) -> Result<u64, C::Error> {
    let v = row.int(i)?;
    u64::try_from(v).map_err(|_| row.invalid(i, format!("time {v} is negative")))
}

/// An optional time (unix ms): a negative one reads as 0.
fn opt_ms<C: Columns + ?Sized>(row: &C, i: usize) -> Result<Option<u64>, C::Error> {
    Ok(row.opt_int(i)?.map(|v| u64::try_from(v).unwrap_or(0)))
}

/// A count that fits in `u32`.
fn count<C: Columns + ?Sized>(row: &C, i: usize) -> Result<u32, C::Error> {
    let v = row.int(i)?;
    u32::try_from(v).map_err(|_| row.invalid(i, format!("count {v} is out of range")))
}

/// A JSON text column, parsed.
pub(crate) fn json<C: Columns + ?Sized>(row: &C, i: usize) -> Result<serde_json::Value, C::Error> {
    let text = row.text(i)?;
    serde_json::from_str(&text).map_err(|e| row.invalid(i, format!("not JSON: {e}")))
}

/// A text column naming one value of a closed set (`what` in the error).
fn named<C: Columns + ?Sized, T>(
    row: &C,
    i: usize,
    what: &str,
    parse: impl FnOnce(&str) -> Option<T>,
) -> Result<T, C::Error> {
    let text = row.text(i)?;
    parse(&text).ok_or_else(|| row.invalid(i, format!("unknown {what} {text:?}")))
}

/// [`ConnectionRecord`] from the columns of [`crate::CONNECTION_SELECT`].
pub(crate) fn connection<C: Columns + ?Sized>(row: &C) -> Result<ConnectionRecord, C::Error> {
    Ok(ConnectionRecord {
        connection_id: row.text(0)?,
        name: row.text(1)?,
        revision: row.int(2)?,
        config_digest: row.text(3)?,
        config: json(row, 4)?,
        first_seen_ms: ms(row, 5)?,
    })
}

/// [`SnapshotSummary`] from the columns of [`crate::SNAPSHOT_SUMMARY_SELECT`].
pub(crate) fn snapshot_summary<C: Columns + ?Sized>(row: &C) -> Result<SnapshotSummary, C::Error> {
    Ok(SnapshotSummary {
        digest: row.text(0)?,
        connection_id: row.text(1)?,
        config_revision: row.int(2)?,
        first_seen_ms: ms(row, 3)?,
        last_seen_ms: ms(row, 4)?,
        observations: ms(row, 5)?,
    })
}

/// The columns [`stored_snapshot`] reads, for a `WHERE s.digest = …` and its parameter.
pub(crate) const SNAPSHOT_SELECT: &str = "SELECT s.digest, s.connection_id, s.config_revision, \
     s.body, s.first_seen_ms, max(o.observed_at_ms), count(o.id) \
     FROM snapshots s JOIN snapshot_observations o ON o.digest = s.digest";

/// [`StoredSnapshot`] from the columns of [`SNAPSHOT_SELECT`].
pub(crate) fn stored_snapshot<C: Columns + ?Sized>(row: &C) -> Result<StoredSnapshot, C::Error> {
    Ok(StoredSnapshot {
        digest: row.text(0)?,
        connection_id: row.text(1)?,
        config_revision: row.int(2)?,
        body: json(row, 3)?,
        first_seen_ms: ms(row, 4)?,
        last_seen_ms: ms(row, 5)?,
        observations: ms(row, 6)?,
    })
}

/// [`MappingRecord`] from the columns of [`crate::MAPPING_COLUMNS`].
pub(crate) fn mapping<C: Columns + ?Sized>(row: &C) -> Result<MappingRecord, C::Error> {
    Ok(MappingRecord {
        name: row.text(0)?,
        revision: row.int(1)?,
        manifest_digest: row.text(2)?,
        component_sha256: row.text(3)?,
        connection_id: row.text(4)?,
        config_revision: row.int(5)?,
        snapshot_digest: row.opt_text(6)?,
        pins: json(row, 7)?,
        state: named(row, 8, "mapping state", MappingState::parse)?,
        reviewer: row.opt_text(9)?,
        reason: row.text(10)?,
        created_ms: ms(row, 11)?,
        state_changed_ms: ms(row, 12)?,
        manifest_text: row.opt_text(13)?,
    })
}

/// [`crate::contracts::ContractRecord`] from the columns of [`crate::CONTRACT_COLUMNS`].
pub(crate) fn contract<C: Columns + ?Sized>(
    row: &C,
) -> Result<crate::contracts::ContractRecord, C::Error> {
    Ok(crate::contracts::ContractRecord {
        package: row.text(0)?,
        digest: row.text(1)?,
        state: named(
            row,
            2,
            "contract state",
            crate::contracts::ContractState::parse,
        )?,
        reviewer: row.text(3)?,
        reason: row.text(4)?,
        files: row.text(5)?,
        created_ms: ms(row, 6)?,
        state_changed_ms: ms(row, 7)?,
    })
}

/// [`TraceEvent`] from the columns of [`crate::TRACE_COLUMNS`].
pub(crate) fn trace_event<C: Columns + ?Sized>(row: &C) -> Result<TraceEvent, C::Error> {
    Ok(TraceEvent {
        seq: row.int(0)?,
        at_ms: ms(row, 1)?,
        kind: row.text(2)?,
        subject: row.text(3)?,
        payload: json(row, 4)?,
        prev_hash: row.text(5)?,
        hash: row.text(6)?,
        key_id: row.opt_text(7)?,
    })
}

/// An event exactly as stored (nothing parsed, for the chain check) from the columns of
/// [`crate::TRACE_COLUMNS`].
pub(crate) fn stored_event<C: Columns + ?Sized>(row: &C) -> Result<StoredEvent, C::Error> {
    Ok(StoredEvent {
        seq: row.int(0)?,
        at: row.int(1)?,
        kind: row.text(2)?,
        subject: row.text(3)?,
        payload: row.text(4)?,
        prev_hash: row.text(5)?,
        hash: row.text(6)?,
        key_id: row.opt_text(7)?,
    })
}

/// [`ApprovalRecord`] from the columns of [`crate::approvals::APPROVAL_COLUMNS`].
pub(crate) fn approval<C: Columns + ?Sized>(row: &C) -> Result<ApprovalRecord, C::Error> {
    Ok(ApprovalRecord {
        id: row.text(0)?,
        state: named(row, 1, "approval state", ApprovalState::parse)?,
        mode: named(row, 2, "approval mode", ApprovalMode::parse)?,
        binding: ReceiptBinding {
            requester: row.text(3)?,
            session: row.text(4)?,
            capability: row.text(6)?,
            mapping: row.text(7)?,
            mapping_revision: row.int(8)?,
            snapshot_digest: row.text(9)?,
            policy_digest: row.text(10)?,
            args_digest: row.text(11)?,
            artifact_digest: row.opt_text(12)?,
        },
        profile: row.text(5)?,
        summary: row.text(13)?,
        nonce: row.text(14)?,
        created_ms: ms(row, 15)?,
        expires_ms: ms(row, 16)?,
        decided_by: row.opt_text(17)?,
        decided_ms: opt_ms(row, 18)?,
        reason: row.opt_text(19)?,
        consumed_ms: opt_ms(row, 20)?,
        intent_id: row.opt_text(21)?,
    })
}

/// [`IntentRecord`] from the columns of [`crate::approvals::INTENT_COLUMNS`].
pub(crate) fn intent<C: Columns + ?Sized>(row: &C) -> Result<IntentRecord, C::Error> {
    Ok(IntentRecord {
        intent: NewIntent {
            id: row.text(0)?,
            idempotency_key: row.text(1)?,
            call_id: row.text(2)?,
            requester: row.text(4)?,
            session: row.text(5)?,
            capability: row.text(6)?,
            mapping: row.text(7)?,
            mapping_revision: row.int(8)?,
            args_digest: row.text(9)?,
            effect_class: row.text(10)?,
            compensates: row.opt_text(16)?,
        },
        approval_id: row.opt_text(3)?,
        state: named(row, 11, "intent state", IntentState::parse)?,
        created_ms: ms(row, 12)?,
        updated_ms: ms(row, 13)?,
        resolution: row
            .opt_text(14)?
            .and_then(|t| serde_json::from_str(&t).ok()),
        resolved_ms: opt_ms(row, 15)?,
        handles: row
            .opt_text(17)?
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_default(),
    })
}

/// [`AttemptRecord`] from the columns of [`crate::intents::ATTEMPT_COLUMNS`].
pub(crate) fn attempt<C: Columns + ?Sized>(row: &C) -> Result<AttemptRecord, C::Error> {
    let mut at_ms = [None; 6];
    for (i, slot) in at_ms.iter_mut().enumerate() {
        *slot = opt_ms(row, 6 + i)?;
    }
    Ok(AttemptRecord {
        intent_id: row.text(0)?,
        attempt: count(row, 1)?,
        state: named(row, 2, "attempt state", AttemptState::parse)?,
        requests: count(row, 3)?,
        answered: count(row, 4)?,
        last_request_id: row.opt_text(5)?,
        at_ms,
    })
}

/// [`crate::approvals::WAITING_SQL`]'s row: three counts and an optional time.
pub(crate) fn waiting<R: Columns>(r: &R) -> Result<Waiting, R::Error> {
    let count = |i: usize| -> Result<u64, R::Error> {
        let n = r.int(i)?;
        u64::try_from(n).map_err(|_| r.invalid(i, format!("a negative count ({n})")))
    };
    Ok(Waiting {
        approvals_pending: count(0)?,
        oldest_pending_ms: r.opt_int(1)?.map(|t| t.max(0) as u64),
        intents_prepared: count(2)?,
        intents_unknown: count(3)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Columns given as values, to test the conversions without a database.
    struct Values(Vec<Option<&'static str>>);

    impl Columns for Values {
        type Error = String;
        fn text(&self, i: usize) -> Result<String, String> {
            self.opt_text(i)?
                .ok_or_else(|| format!("column {i} is NULL"))
        }
        fn opt_text(&self, i: usize) -> Result<Option<String>, String> {
            Ok(self.0[i].map(str::to_owned))
        }
        fn int(&self, i: usize) -> Result<i64, String> {
            self.opt_int(i)?
                .ok_or_else(|| format!("column {i} is NULL"))
        }
        fn opt_int(&self, i: usize) -> Result<Option<i64>, String> {
            self.0[i]
                .map(|t| {
                    t.parse()
                        .map_err(|_| format!("column {i} is not an integer"))
                })
                .transpose()
        }
        fn invalid(&self, i: usize, why: String) -> String {
            format!("column {i}: {why}")
        }
    }

    fn mapping_row(state: &'static str, created: &'static str, pins: &'static str) -> Values {
        Values(vec![
            Some("m"),
            Some("2"),
            Some("md"),
            Some("cs"),
            Some("conn-1"),
            Some("1"),
            None,
            Some(pins),
            Some(state),
            None,
            Some("why"),
            Some(created),
            Some("5"),
            Some("text"),
        ])
    }

    #[test]
    fn a_mapping_row_becomes_its_record_and_a_bad_one_is_refused() {
        let record = mapping(&mapping_row("fixture-tested", "4", r#"{"a":[1]}"#)).unwrap();
        assert_eq!(record.state, MappingState::FixtureTested);
        assert_eq!((record.revision, record.created_ms), (2, 4));
        assert_eq!(record.pins, serde_json::json!({"a": [1]}));
        assert_eq!(record.snapshot_digest, None);
        assert_eq!(
            mapping(&mapping_row("serving", "4", "{}")).unwrap_err(),
            "column 8: unknown mapping state \"serving\""
        );
        assert_eq!(
            mapping(&mapping_row("active", "-1", "{}")).unwrap_err(),
            "column 11: time -1 is negative"
        );
        assert!(
            mapping(&mapping_row("active", "1", "{not json"))
                .unwrap_err()
                .starts_with("column 7: not JSON")
        );
    }

    #[test]
    fn an_attempt_count_out_of_range_and_a_negative_optional_time_are_handled() {
        let row = |attempt: &'static str, sent: &'static str| {
            Values(vec![
                Some("int_1"),
                Some(attempt),
                Some("sent"),
                Some("1"),
                Some("0"),
                None,
                Some("1"),
                Some(sent),
                None,
                None,
                None,
                None,
            ])
        };
        let a = attempt(&row("1", "-5")).unwrap();
        assert_eq!(a.state, AttemptState::Sent);
        assert_eq!(a.at_ms, [Some(1), Some(0), None, None, None, None]);
        assert_eq!(
            attempt(&row("4294967296", "2")).unwrap_err(),
            "column 1: count 4294967296 is out of range"
        );
    }
}
