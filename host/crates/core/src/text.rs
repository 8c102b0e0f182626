//! Untrusted text shown to people: what an upstream server, a fixture file or a client
//! wrote, escaped so that it cannot pass for something else on a terminal or in a message.
//!
//! Rule: every control character, and every invisible, format or bidi-control character
//! ([`is_invisible`]), is written as an escape (`\u{202e}`), never as itself; [`safe`]
//! clips to a number of characters (Unicode scalar values) and marks the cut with `…`;
//! [`safe_lines`] keeps newlines and escapes the rest line by line.

use std::fmt::Write as _;

/// Invisible, format and bidi-control characters that can make untrusted text look like
/// something else on a terminal (soft hyphen, zero-width and joiner characters, line and
/// paragraph separators, bidi embeddings, overrides and isolates, BOM).
pub fn is_invisible(c: char) -> bool {
    matches!(
        c,
        '\u{00AD}'
            | '\u{061C}'
            | '\u{180E}'
            | '\u{200B}'..='\u{200F}'
            | '\u{2028}'..='\u{202E}'
            | '\u{2060}'..='\u{2069}'
            | '\u{FEFF}'
    )
}

/// Escapes and clips untrusted text for a terminal.
pub fn safe(text: &str, max: usize) -> String {
    let mut out = String::new();
    for (i, c) in text.chars().enumerate() {
        if i == max {
            out.push('…');
            break;
        }
        if c.is_control() || is_invisible(c) {
            let _ = write!(out, "\\u{{{:x}}}", c as u32);
        } else {
            out.push(c);
        }
    }
    out
}

/// Escapes untrusted text that may span lines (error chains quoting a server's stderr):
/// keeps newlines, escapes every other control, bidi and invisible format character.
pub fn safe_lines(text: &str) -> String {
    text.split('\n')
        .map(|line| safe(line, usize::MAX))
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_bidi_and_invisible_characters_are_escaped_and_text_is_clipped() {
        assert_eq!(
            safe("a\u{202e}b\u{1b}[2Jc\u{200b}", 100),
            "a\\u{202e}b\\u{1b}[2Jc\\u{200b}"
        );
        assert_eq!(safe("ünïcode", 3), "ünï…");
        assert_eq!(safe("", 0), "");
        assert_eq!(safe_lines("one\ntwo\r\u{feff}"), "one\ntwo\\u{d}\\u{feff}");
    }
}
