//! How every command prints its answer: one value, as JSON with `--json`, else as text.
//!
//! Rule: a command builds one value and hands it here with the text rendering of it; the
//! choice between text and JSON is made in this module only. Accepted forms:
//!
//! | form | what is written to stdout |
//! |---|---|
//! | [`emit`] with `json` | the value as pretty-printed JSON and one newline |
//! | [`emit`] without `json` | the text the command renders, as it renders it |
//! | [`emit_lines`] with `json` | one compact JSON line per item (a stream a reader can tail) |
//! | [`emit_text`] | text only (commands that have no JSON form) |
//! | [`WithMember`] | a record's JSON object with one member the command adds (`tampered`) |
//!
//! Output goes to stdout and is flushed before the command returns; errors and warnings go
//! to stderr, never here. A value that does not serialize is an error, never half a line.

use std::io::Write;

use anyhow::Result;
use serde::Serialize;

/// The command's answer rendered: `value` as pretty JSON and a newline when `json`, else
/// `text(value)`. Pure: writes nothing.
///
/// # Errors
/// `value` does not serialize (a map with non-string keys, a failing `Serialize` impl).
pub fn render<T: Serialize + ?Sized>(
    json: bool,
    value: &T,
    text: impl FnOnce(&T) -> String,
) -> Result<String> {
    Ok(if json {
        serde_json::to_string_pretty(value)? + "\n"
    } else {
        text(value)
    })
}

/// `items` as JSON lines (one compact JSON object and a newline each) when `json`, else
/// `text(items)`. An item that does not serialize is an empty line, as `airlock trace list
/// --json` has always printed it (a reader of a stream skips it, the rest stays readable).
pub fn render_lines<T: Serialize>(
    json: bool,
    items: &[T],
    text: impl FnOnce(&[T]) -> String,
) -> String {
    if json {
        items
            .iter()
            .map(|item| serde_json::to_string(item).unwrap_or_default() + "\n")
            .collect()
    } else {
        text(items)
    }
}

/// A record shown with one more member than it stores: `value`'s JSON object, then
/// `name: extra` (in place of a member of that name, if it has one). Serialized only when
/// printed as JSON, so the text form never pays for it.
pub struct WithMember<'a, T, U> {
    /// The record; it must serialize as a JSON object.
    pub value: &'a T,
    /// The added member's name.
    pub name: &'static str,
    /// The added member's value.
    pub extra: &'a U,
}

impl<T: Serialize, U: Serialize> Serialize for WithMember<'_, T, U> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::Error as _;
        let mut object = serde_json::to_value(self.value).map_err(S::Error::custom)?;
        let extra = serde_json::to_value(self.extra).map_err(S::Error::custom)?;
        let Some(members) = object.as_object_mut() else {
            return Err(S::Error::custom(format!(
                "cannot add `{}` to a record that is not a JSON object",
                self.name
            )));
        };
        members.insert(self.name.to_owned(), extra);
        object.serialize(serializer)
    }
}

/// Prints the command's answer on stdout ([`render`]) and flushes it.
///
/// # Errors
/// `value` does not serialize; stdout cannot be written.
pub fn emit<T: Serialize + ?Sized>(
    json: bool,
    value: &T,
    text: impl FnOnce(&T) -> String,
) -> Result<()> {
    emit_text(&render(json, value, text)?)
}

/// Prints a list on stdout as JSON lines or text ([`render_lines`]) and flushes it.
///
/// # Errors
/// Stdout cannot be written.
pub fn emit_lines<T: Serialize>(
    json: bool,
    items: &[T],
    text: impl FnOnce(&[T]) -> String,
) -> Result<()> {
    emit_text(&render_lines(json, items, text))
}

/// Prints `text` on stdout as it is and flushes it.
///
/// # Errors
/// Stdout cannot be written.
pub fn emit_text(text: &str) -> Result<()> {
    write_to(&mut std::io::stdout().lock(), text)
}

/// Writes `text` to `out` and flushes it.
///
/// # Errors
/// `out` cannot be written or flushed.
pub fn write_to(out: &mut impl Write, text: &str) -> Result<()> {
    out.write_all(text.as_bytes())?;
    out.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde_json::json;

    use super::*;

    #[derive(Serialize)]
    struct Row {
        name: &'static str,
        n: u32,
    }

    #[test]
    fn json_is_the_value_pretty_with_one_newline_and_text_is_the_renderer_s() {
        let row = Row { name: "a", n: 1 };
        let json_out = render(true, &row, |_| panic!("text rendered for --json")).unwrap();
        assert_eq!(json_out, "{\n  \"name\": \"a\",\n  \"n\": 1\n}\n");
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&json_out).unwrap(),
            json!({"name": "a", "n": 1})
        );
        let text = render(false, &row, |r| format!("{} {}\n", r.name, r.n)).unwrap();
        assert_eq!(text, "a 1\n");
        // The renderer's text is printed as it is: no newline added, none removed.
        assert_eq!(render(false, &row, |_| "x".into()).unwrap(), "x");
        assert_eq!(render(false, &row, |_| String::new()).unwrap(), "");
    }

    #[test]
    fn hostile_strings_stay_quoted_json_and_the_text_is_untouched() {
        // Terminal escapes, quotes, newlines and a NUL: JSON escapes them all, so a line of
        // the output never carries a raw control character.
        let hostile = "\u{1b}[2J\"}\n{\"admin\":true}\0\u{202e}";
        let out = render(true, &json!({ "name": hostile }), |_| unreachable!()).unwrap();
        assert!(!out.contains('\u{1b}') && !out.contains('\0'));
        assert_eq!(out.matches('\n').count(), 3, "{out:?}");
        let back: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(back["name"], hostile);
        // Text rendering is the command's own job (it quotes untrusted words itself).
        assert_eq!(render(false, &hostile, |s| s.to_string()).unwrap(), hostile);
    }

    #[test]
    fn a_value_that_does_not_serialize_is_an_error_not_half_an_answer() {
        let bad: BTreeMap<(u8, u8), u8> = [((1, 2), 3)].into_iter().collect();
        assert!(render(true, &bad, |_| String::new()).is_err());
        // Without --json the value is never serialized.
        assert_eq!(render(false, &bad, |_| "ok".into()).unwrap(), "ok");
    }

    #[test]
    fn lines_are_one_compact_object_each_and_an_empty_list_prints_nothing() {
        let rows = [Row { name: "a", n: 1 }, Row { name: "b\nc", n: 2 }];
        let out = render_lines(true, &rows, |_| unreachable!());
        assert_eq!(
            out,
            "{\"name\":\"a\",\"n\":1}\n{\"name\":\"b\\nc\",\"n\":2}\n"
        );
        assert_eq!(render_lines::<Row>(true, &[], |_| unreachable!()), "");
        assert_eq!(
            render_lines(false, &rows, |r| format!("{}\n", r.len())),
            "2\n"
        );
        // An item that does not serialize is an empty line; the others still print.
        let bad: BTreeMap<(u8, u8), u8> = [((1, 2), 3)].into_iter().collect();
        let out = render_lines(true, &[BTreeMap::new(), bad], |_| unreachable!());
        assert_eq!(out, "{}\n\n");
    }

    #[test]
    fn an_added_member_comes_last_or_replaces_its_namesake_in_place() {
        let row = Row { name: "a", n: 1 };
        let why = Some("altered".to_string());
        let shown = WithMember {
            value: &row,
            name: "tampered",
            extra: &why,
        };
        let out = render(true, &shown, |_| unreachable!()).unwrap();
        assert_eq!(
            out,
            "{\n  \"name\": \"a\",\n  \"n\": 1,\n  \"tampered\": \"altered\"\n}\n"
        );
        let none: Option<String> = None;
        let shown = WithMember {
            value: &row,
            name: "tampered",
            extra: &none,
        };
        assert_eq!(
            serde_json::to_value(&shown).unwrap(),
            json!({"name": "a", "n": 1, "tampered": null})
        );
        // A record that already has the member (a hostile or future field) keeps one,
        // the command's, in its place: the record cannot speak for the host.
        let forged = json!({"tampered": null, "id": "apr_1"});
        let shown = WithMember {
            value: &forged,
            name: "tampered",
            extra: &why,
        };
        let out = serde_json::to_string(&shown).unwrap();
        assert_eq!(out, r#"{"tampered":"altered","id":"apr_1"}"#);
        // Only an object can take a member: anything else is an error, never a panic.
        for value in [json!(null), json!([1]), json!("s"), json!(1)] {
            let shown = WithMember {
                value: &value,
                name: "tampered",
                extra: &why,
            };
            assert!(render(true, &shown, |_| unreachable!()).is_err(), "{value}");
            // The text form never serializes it.
            assert_eq!(render(false, &shown, |_| "t".into()).unwrap(), "t");
        }
    }

    #[test]
    fn written_text_is_flushed_whole() {
        let mut out = Vec::new();
        write_to(&mut out, "one\ntwo").unwrap();
        assert_eq!(out, b"one\ntwo");
        // A writer that refuses is an error.
        struct Refuses;
        impl Write for Refuses {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                Err(std::io::Error::other("closed"))
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        assert!(write_to(&mut Refuses, "x").is_err());
    }
}
