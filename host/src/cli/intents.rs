//! `airlock intents`: a person lists, inspects and resolves intents — the durable record of
//! each effect the host was asked to cause, with its attempts.
//!
//! Rule: only an intent whose outcome is `unknown` (or one a stopped host left `prepared`)
//! can be resolved, once, as `completed` or `failed`; the resolution records who decided,
//! the evidence they give, and is traced (`intent-resolved`). Nothing is retried here.

use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use serde_json::json;

use crate::registry::Registry;
use crate::store::{AttemptRecord, AttemptState, IntentFilter, IntentRecord, IntentState};

fn when(ms: u64) -> String {
    humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// Parses `--state` (`prepared`, `completed`, `failed`, `unknown`).
///
/// # Errors
/// Not a state name.
pub fn parse_state(s: &str) -> Result<IntentState> {
    [
        IntentState::Prepared,
        IntentState::Completed,
        IntentState::Failed,
        IntentState::Unknown,
    ]
    .into_iter()
    .find(|v| v.as_str() == s)
    .with_context(|| format!("unknown state `{s}`; states: prepared, completed, failed, unknown"))
}

/// Lists intents, newest first.
///
/// # Errors
/// The store failed.
pub fn list(
    registry: &Registry,
    state: Option<IntentState>,
    limit: usize,
) -> Result<Vec<IntentRecord>> {
    registry.store().intents(&IntentFilter {
        compensates: None,
        states: state.into_iter().collect(),
        mapping: None,
        created_before_ms: None,
        limit,
    })
}

/// The list as people read it: one line each. `tampered[i]`: why the trace does not
/// prove `list[i]` ([`tampered`]); such a row is marked `TAMPERED` at its line's end.
pub fn list_text(list: &[IntentRecord], tampered: &[Option<String>]) -> String {
    if list.is_empty() {
        return "no intents\n".to_string();
    }
    let mut out = String::new();
    for (i, r) in list.iter().enumerate() {
        let mark = match tampered.get(i) {
            Some(Some(_)) => "  TAMPERED (airlock intents show says why)",
            _ => "",
        };
        out.push_str(&format!(
            "{}  {:<9} {:<18} {:<20} {} rev {}  {}  requester {}{mark}\n",
            r.intent.id,
            r.state.as_str(),
            r.intent.effect_class,
            r.intent.capability,
            r.intent.mapping,
            r.intent.mapping_revision,
            when(r.created_ms),
            r.intent.requester,
        ));
    }
    out
}

/// One intent with its attempts, as people read it.
pub fn show_text(r: &IntentRecord, attempts: &[AttemptRecord]) -> String {
    let i = &r.intent;
    let mut out = format!(
        "intent {}\n  state      {}\n  capability {} (mapping {} revision {}, {})\n  requester  {} (session {})\n  call       {}\n  arguments  sha256 {}\n  created    {}\n",
        i.id,
        r.state.as_str(),
        i.capability,
        i.mapping,
        i.mapping_revision,
        i.effect_class,
        i.requester,
        i.session,
        i.call_id,
        i.args_digest,
        when(r.created_ms),
    );
    if let Some(a) = &r.approval_id {
        out.push_str(&format!("  approval   {a}\n"));
    }
    if let Some(original) = &i.compensates {
        out.push_str(&format!("  compensates {original}\n"));
    }
    for h in &r.handles {
        out.push_str(&format!(
            "  undo by    {}\n",
            crate::cli::operate::safe_lines(&handle_text(h))
        ));
    }
    for a in attempts {
        out.push_str(&format!(
            "  attempt {}  {}  ({} request(s) sent, {} answered{})\n",
            a.attempt,
            a.state,
            a.requests,
            a.answered,
            a.last_request_id
                .as_deref()
                .map(|id| format!(", last request id {id}"))
                .unwrap_or_default()
        ));
        for (state, at) in AttemptState::ALL.iter().zip(a.at_ms) {
            if let Some(at) = at {
                out.push_str(&format!("    {:<17} {}\n", state.as_str(), when(at)));
            }
        }
    }
    if let Some(res) = &r.resolution {
        out.push_str(&format!(
            "  resolved   {} by {} ({}), evidence {}\n",
            r.resolved_ms.map(when).unwrap_or_default(),
            res["by"].as_str().unwrap_or("?"),
            res["method"].as_str().unwrap_or("?"),
            crate::cli::operate::safe_lines(&res["evidence"].to_string()),
        ));
    }
    if r.state == IntentState::Unknown {
        out.push_str(&format!(
            "  This intent may or may not have acted upstream. Check the upstream, then:\n    airlock intents resolve {} --as completed|failed --evidence \"what you saw\"\n",
            i.id
        ));
    }
    out
}

/// A kept handle as people read it: `kind "locator" (fact value, ...)`.
fn handle_text(h: &crate::store::IntentHandle) -> String {
    let facts: Vec<String> = h
        .facts
        .iter()
        .map(|(k, v)| match v {
            serde_json::Value::String(t) => format!("{k} {t:?}"),
            other => format!("{k} {other}"),
        })
        .collect();
    if facts.is_empty() {
        format!("{} {:?}", h.kind, h.locator)
    } else {
        format!("{} {:?} ({})", h.kind, h.locator, facts.join(", "))
    }
}

/// How often a compensation waiting for a person looks at its approval request.
const DECISION_POLL: Duration = Duration::from_millis(200);

/// Compensates (undoes) the completed intent `id` on `host`, as its configured requester
/// under `profile` (see [`crate::pipeline::compensate`]): plans it, runs the undo's
/// capability through the pipeline and, when policy asks a person, prints the summary to
/// `progress` and waits up to `wait` for `airlock approvals approve|deny` on it, then runs
/// it again (once). Returns the new intent's record with the undo's result.
///
/// # Errors
/// What [`crate::pipeline::compensate::plan`] refuses; the request denied, revoked,
/// expired or not decided within `wait` (then it is revoked: only this run's session could
/// have used it); the undo refused or failed (its category and detail).
pub async fn compensate(
    host: &std::sync::Arc<crate::host::Host>,
    id: &str,
    profile: Option<&str>,
    wait: Duration,
    progress: &mut dyn std::io::Write,
) -> Result<serde_json::Value> {
    use crate::pipeline::{self, NoAsker, Outcome};
    let session = host.stdio_session(profile)?;
    let plan = pipeline::compensate::plan(host, &session, id)?;
    let o = &plan.original.intent;
    writeln!(
        progress,
        "compensating intent {id}: `{}` (mapping {} revision {}), completed {}",
        o.capability,
        o.mapping,
        o.mapping_revision,
        when(plan.original.updated_ms)
    )?;
    for (field, h) in &plan.undoes {
        writeln!(
            progress,
            "  undo `{}` ({}) on mapping revision {}, {field}: {}",
            plan.capability,
            plan.function,
            plan.revision,
            crate::cli::operate::safe_lines(&handle_text(h))
        )?;
    }
    let mut asked = None;
    let outcome = loop {
        let outcome = pipeline::run(host, plan.candidate(session.clone()), &NoAsker)
            .await
            .outcome()
            .await;
        let Outcome::ApprovalRequired { approval, summary } = &outcome else {
            break outcome;
        };
        if asked.as_ref() == Some(approval) {
            bail!("approval {approval} was approved, yet the undo asked again; nothing was undone");
        }
        writeln!(
            progress,
            "policy asks a person to approve:\n{}\nwaiting up to {} s for: airlock approvals approve {approval} (or deny)",
            crate::cli::operate::safe_lines(summary),
            wait.as_secs()
        )?;
        await_decision(host, approval, wait).await?;
        writeln!(progress, "approval {approval} approved; undoing")?;
        asked = Some(approval.clone());
    };
    let value = match outcome {
        Outcome::Completed(c) => c.value.unwrap_or(serde_json::Value::Null),
        Outcome::Refused { category, detail } => {
            bail!("the undo was refused ({}): {detail}", category.as_str())
        }
        Outcome::Invalid { message } => {
            bail!("the undo is not a call this session can make: {message}")
        }
        other => bail!("the undo did not complete: {:?}", other.trace_summary()),
    };
    let done = host
        .registry()
        .store()
        .intents(&IntentFilter {
            compensates: Some(id.to_string()),
            states: vec![IntentState::Completed],
            limit: 1,
            ..IntentFilter::default()
        })?
        .into_iter()
        .next()
        .context("the undo completed but its intent is not recorded as the compensation")?;
    Ok(json!({
        "compensated": id,
        "intent": done,
        "capability": plan.capability,
        "result": value,
    }))
}

/// Waits up to `wait` for a person's decision on approval `id`.
///
/// # Errors
/// Denied, revoked or expired; no decision within `wait` (the request is then revoked).
async fn await_decision(host: &crate::host::Host, id: &str, wait: Duration) -> Result<()> {
    use crate::store::{ApprovalDecision, ApprovalState};
    let store = host.registry().store();
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let record = store
            .approval(id)?
            .with_context(|| format!("approval {id} vanished from the store"))?;
        match record.state {
            ApprovalState::Approved => return Ok(()),
            ApprovalState::Pending => {}
            other => bail!("approval {id} is {}: nothing was undone", other.as_str()),
        }
        if tokio::time::Instant::now() >= deadline {
            // Only this run's session could use it: withdraw it from the inbox.
            let revoked = crate::cli::approvals::decide(
                host.registry(),
                id,
                ApprovalDecision::Revoke,
                "airlock",
                Some("the compensation waiting for it stopped"),
                host.config().approvals.ttl,
            );
            if let Err(e) = revoked {
                tracing::warn!("could not withdraw approval {id}: {e:#}");
            }
            bail!(
                "no decision on approval {id} within {} s: nothing was undone (the request is withdrawn; run the command again to ask again)",
                wait.as_secs()
            );
        }
        tokio::time::sleep(DECISION_POLL).await;
    }
}

pub use crate::decisions::{intent_tampered as tampered, resolve_intent as resolve};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_parse_strictly() {
        assert_eq!(parse_state("unknown").unwrap(), IntentState::Unknown);
        for bad in ["", "Unknown", "done", "unknown ", "committed"] {
            let e = parse_state(bad).unwrap_err().to_string();
            assert!(
                e.contains("states: prepared, completed, failed, unknown"),
                "{e}"
            );
        }
    }

    #[test]
    fn show_says_how_to_resolve_an_unknown_intent_and_escapes_evidence() {
        let r = IntentRecord {
            intent: crate::store::NewIntent {
                compensates: None,
                id: "int_1".into(),
                idempotency_key: "idk_1".into(),
                call_id: "call_1".into(),
                requester: "alice".into(),
                session: "ses_1".into(),
                capability: "deliver_artifact".into(),
                mapping: "outbox-delivery".into(),
                mapping_revision: 1,
                args_digest: "c".repeat(64),
                effect_class: "external-effect".into(),
            },
            approval_id: None,
            state: IntentState::Unknown,
            created_ms: 0,
            updated_ms: 0,
            resolution: None,
            resolved_ms: None,
            handles: Vec::new(),
        };
        let text = show_text(&r, &[]);
        assert!(text.contains("airlock intents resolve int_1"), "{text}");
        let mut done = r.clone();
        done.state = IntentState::Completed;
        done.resolution = Some(
            json!({"by": "bob", "method": "person", "evidence": {"statement": "line1\nline2\u{1b}[31m"}}),
        );
        done.resolved_ms = Some(0);
        let text = show_text(&done, &[]);
        assert!(
            !text.contains('\u{1b}'),
            "control characters are escaped: {text:?}"
        );
        assert!(!text.contains("airlock intents resolve"), "{text}");
    }
}
