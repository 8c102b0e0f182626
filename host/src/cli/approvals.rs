//! `airlock approvals`: a person at a terminal lists, inspects, approves, denies and
//! revokes approval requests (the out-of-band flow for clients that cannot elicit).
//!
//! Rule: approving records who approved and when, and gives the receipt its lifetime from
//! that moment; the receipt still authorizes only the exact call it describes, once, while
//! the mapping revision, snapshot and policy it is bound to are unchanged. Every decision is
//! traced (`approval-decided`).

use std::time::Duration;

use anyhow::{Context as _, Result};

use crate::store::{ApprovalRecord, ApprovalState};

pub use crate::decisions::{decide, refuse_tampered, tampered};

/// One approval as people read it; `tampered` (from [`tampered`]) is shown first.
pub fn show_text(r: &ApprovalRecord, now_ms: u64, tampered: Option<&str>) -> String {
    let b = &r.binding;
    let when = |ms: u64| {
        humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + Duration::from_millis(ms))
            .to_string()
    };
    let mut out = format!(
        "approval {}\n  state      {}\n  mode       {}\n  requester  {} (session {}, profile {})\n  capability {} (mapping {} revision {})\n  snapshot   {}\n  policy     {}\n  arguments  sha256 {}\n",
        r.id,
        r.state_at(now_ms),
        r.mode.as_str(),
        b.requester,
        b.session,
        r.profile,
        b.capability,
        b.mapping,
        b.mapping_revision,
        b.snapshot_digest,
        b.policy_digest,
        b.args_digest,
    );
    if let Some(why) = tampered {
        out.insert_str(
            0,
            &format!(
                "TAMPERED: the trace does not prove this row, so it authorizes nothing: {why}\n"
            ),
        );
    }
    if let Some(d) = &b.artifact_digest {
        out.push_str(&format!("  artifact   sha256 {d}\n"));
    }
    out.push_str(&format!(
        "  created    {}\n  expires    {}\n",
        when(r.created_ms),
        when(r.expires_ms)
    ));
    if let (Some(by), Some(at)) = (&r.decided_by, r.decided_ms) {
        out.push_str(&format!("  decided    {} by {by:?}", when(at)));
        if let Some(reason) = &r.reason {
            out.push_str(&format!(" ({reason:?})"));
        }
        out.push('\n');
    }
    if let Some(intent) = &r.intent_id {
        out.push_str(&format!("  used by    intent {intent}\n"));
    }
    out.push_str("  what it lets happen:\n");
    for line in r.summary.lines() {
        out.push_str(&format!("    {}\n", crate::cli::operate::safe_lines(line)));
    }
    out
}

/// The approvals list as people read it: one line each, newest first.
pub fn list_text(list: &[ApprovalRecord], now_ms: u64) -> String {
    if list.is_empty() {
        return "no approvals\n".to_string();
    }
    let mut out = String::new();
    for r in list {
        out.push_str(&format!(
            "{}  {:<9} {:<15} {:<20} {} rev {}  requester {}\n",
            r.id,
            r.state_at(now_ms).as_str(),
            r.mode.as_str(),
            r.binding.capability,
            r.binding.mapping,
            r.binding.mapping_revision,
            r.binding.requester
        ));
    }
    out
}

/// Shows what approving `r` lets happen on the controlling terminal and asks the person to
/// type `approve`. Reads the terminal itself (`/dev/tty`), not stdin, so a piped "yes"
/// does not count.
///
/// # Errors
/// No terminal (pass `--yes` for a decision a person made elsewhere), or any other answer.
pub fn confirm_on_terminal(r: &ApprovalRecord) -> Result<()> {
    use std::io::{BufRead as _, Write as _};
    let tty = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/tty")
        .context("no terminal to confirm the approval on; run it at a terminal, or pass --yes when a person has decided")?;
    let mut out = tty.try_clone()?;
    write!(
        out,
        "{}\nType `approve` to approve exactly this, once: ",
        show_text(r, crate::store::now_ms(), None)
    )?;
    out.flush()?;
    let mut answer = String::new();
    std::io::BufReader::new(tty).read_line(&mut answer)?;
    if answer.trim() != "approve" {
        anyhow::bail!("not approved (the answer was not `approve`); nothing was changed");
    }
    Ok(())
}

/// Parses `--state`.
///
/// # Errors
/// Not a state name.
pub fn parse_state(s: &str) -> Result<ApprovalState> {
    ApprovalState::parse(s).with_context(|| {
        format!(
            "unknown state `{s}`; states: pending, approved, denied, revoked, consumed, expired"
        )
    })
}
