//! `airlock status`: the store's state now ([`crate::status`]) as people read it.

pub use crate::status::*;

/// `ms` before `now` in words: `4s`, `12m`, `3h`, `2d` (the largest whole unit).
fn age(now: u64, ms: u64) -> String {
    let s = now.saturating_sub(ms) / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86_400 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

/// The text form: one section per part, ages relative to when it was read.
pub fn text(s: &Status) -> String {
    use std::fmt::Write as _;
    let now = s.at_ms;
    let mut out = String::new();
    let t = &s.trace;
    let _ = write!(out, "trace        head #{}", t.head_seq);
    if let Some(to) = t.archived_to {
        let _ = write!(out, ", archived up to #{to}");
    }
    let _ = write!(out, ", journal backlog {} B", t.journal_backlog_bytes);
    match &t.last_checkpoint {
        Some(c) => {
            let _ = writeln!(
                out,
                ", last checkpoint #{} {} ago ({})",
                c.seq,
                age(now, c.at_ms),
                c.file.display()
            );
        }
        None => out.push_str(", no checkpoint\n"),
    }
    let _ = writeln!(out, "connections  {}", s.connections.len());
    for c in &s.connections {
        let state = c.state.as_deref().unwrap_or("(no state traced)");
        let _ = write!(
            out,
            "  {:<20} {:<13}",
            airlock_core::text::safe(&c.name, 64),
            state
        );
        if let Some(since) = c.since_ms {
            let _ = write!(out, " for {}", age(now, since));
        }
        if let Some(why) = &c.reason {
            let _ = write!(out, "  {why}");
        }
        out.push('\n');
    }
    let _ = writeln!(out, "mappings     {}", s.mappings.len());
    for m in &s.mappings {
        let _ = writeln!(
            out,
            "  {:<20} {:<15} revision {}, for {}",
            airlock_core::text::safe(&m.name, 64),
            m.state,
            m.revision,
            age(now, m.since_ms)
        );
    }
    let w = &s.waiting;
    let _ = write!(out, "approvals    {} pending", w.approvals_pending);
    match w.oldest_pending_ms {
        Some(t) => {
            let _ = writeln!(out, " (oldest {} old)", age(now, t));
        }
        None => out.push('\n'),
    }
    for a in &s.approvals_pending {
        let _ = writeln!(
            out,
            "  {}  {}  by {}  {}, {} old, expires in {}",
            a.id,
            airlock_core::text::safe(&a.capability, 64),
            airlock_core::text::safe(&a.requester, 64),
            a.mode.as_str(),
            age(now, a.created_ms),
            age(a.expires_ms, now)
        );
    }
    let _ = writeln!(
        out,
        "intents      {} prepared, {} unknown (held)",
        w.intents_prepared, w.intents_unknown
    );
    for i in &s.intents_held {
        let _ = writeln!(
            out,
            "  {}  {}  {}  {} old",
            i.id,
            airlock_core::text::safe(&i.capability, 64),
            airlock_core::text::safe(&i.mapping, 64),
            age(now, i.created_ms)
        );
    }
    if w.approvals_pending > 0 || w.intents_unknown > 0 {
        out.push_str("\n`airlock approvals list` and `airlock intents list --state unknown` show them whole.\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_take_the_largest_whole_unit() {
        assert_eq!(age(10_000, 10_000), "0s");
        assert_eq!(age(70_000, 10_000), "1m");
        assert_eq!(age(3_600_000 * 5 + 1, 0), "5h");
        assert_eq!(age(86_400_000 * 3, 0), "3d");
        assert_eq!(age(0, 5_000), "0s", "a time in the future is no age");
    }
}
