//! RFC 8785 (JSON Canonicalization Scheme) text of a JSON value, written directly for the
//! values Airlock digests on every call.
//!
//! Rule: the text is exactly what `serde_json_canonicalizer` writes. Values made of keys
//! without non-ASCII characters, strings, integers within ±2^53, booleans, null, arrays
//! and objects are written here in one pass into one buffer (keys sorted by byte, which
//! for ASCII is RFC 8785's UTF-16 order; integers as their digits; strings with RFC
//! 8785's escapes, copied in runs between the characters that need one). Any other value
//! (a float, a larger integer, a non-ASCII key) is handed to `serde_json_canonicalizer`.
//! Unit tests hold the two equal on hostile input.

use serde_json::{Map, Value};

/// The canonical text of `value` (RFC 8785).
///
/// # Errors
/// `serde_json_canonicalizer` refused a value outside the fast path (a number RFC 8785
/// cannot write).
pub fn to_string(value: &Value) -> Result<String, serde_json::Error> {
    let mut out = String::with_capacity(256);
    if write_simple(value, &mut out) {
        return Ok(out);
    }
    serde_json_canonicalizer::to_string(value)
}

/// The canonical text of the JSON object `map` (RFC 8785), as [`to_string`].
///
/// # Errors
/// As [`to_string`].
pub fn object_to_string(map: &Map<String, Value>) -> Result<String, serde_json::Error> {
    let mut out = String::with_capacity(256);
    if write_object(map, &mut out) {
        return Ok(out);
    }
    serde_json_canonicalizer::to_string(map)
}

/// Writes the canonical form of a value on the fast path; false (output unusable)
/// otherwise.
fn write_simple(value: &Value, out: &mut String) -> bool {
    const SAFE: u64 = 1 << 53;
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(true) => out.push_str("true"),
        Value::Bool(false) => out.push_str("false"),
        Value::Number(n) => {
            if let Some(u) = n.as_u64().filter(|u| *u <= SAFE) {
                out.push_str(itoa::Buffer::new().format(u));
            } else if let Some(i) = n.as_i64().filter(|i| i.unsigned_abs() <= SAFE) {
                out.push_str(itoa::Buffer::new().format(i));
            } else {
                return false;
            }
        }
        Value::String(s) => push_string(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                if !write_simple(item, out) {
                    return false;
                }
            }
            out.push(']');
        }
        Value::Object(map) => return write_object(map, out),
    }
    true
}

/// [`write_simple`] for an object.
fn write_object(map: &Map<String, Value>, out: &mut String) -> bool {
    let mut entries: Vec<(&String, &Value)> = map.iter().collect();
    if entries.iter().any(|(k, _)| !k.is_ascii()) {
        return false;
    }
    entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    out.push('{');
    for (i, (k, v)) in entries.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        push_string(k, out);
        out.push(':');
        if !write_simple(v, out) {
            return false;
        }
    }
    out.push('}');
    true
}

/// sha256 (64 lowercase hex digits) of the RFC 8785 canonical JSON of `value`, as
/// `serde_json_canonicalizer::to_vec` writes it: the digest of a discovered catalogue item
/// or summary (DESIGN.md §2 "schema digest"). Should a value ever not canonicalize, the
/// digest is of its plain serialization under a prefix no canonical text can have, so it
/// never equals a canonical digest.
pub fn canonical_digest(value: &Value) -> String {
    use sha2::Digest as _;
    let bytes = serde_json_canonicalizer::to_vec(value).unwrap_or_else(|_| {
        let mut bytes = b"\0non-canonical\0".to_vec();
        bytes.extend(serde_json::to_vec(value).unwrap_or_default());
        bytes
    });
    hex::encode(sha2::Sha256::digest(&bytes))
}

/// A JSON string as RFC 8785 writes it (§3.2.2.2): `"` and `\` escaped, the short escapes
/// `\b \f \n \r \t`, other control characters as `\u00xx` (lowercase hex), every other
/// character as itself. Runs of characters that need no escape are copied at once.
pub fn push_string(s: &str, out: &mut String) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.reserve(s.len() + 2);
    out.push('"');
    let bytes = s.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        // Every byte that needs an escape is ASCII, so `i` is a character boundary.
        let escape: &str = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            0x08 => "\\b",
            0x0c => "\\f",
            b'\n' => "\\n",
            b'\r' => "\\r",
            b'\t' => "\\t",
            0x00..=0x1f => "",
            _ => continue,
        };
        out.push_str(&s[start..i]);
        if escape.is_empty() {
            out.push_str("\\u00");
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0xf)]));
        } else {
            out.push_str(escape);
        }
        start = i + 1;
    }
    out.push_str(&s[start..]);
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Strings that exercise every escape, every control character, runs at the start
    /// and end, multi-byte characters next to escapes, and the line separators that
    /// RFC 8785 leaves as they are.
    fn hostile_strings() -> Vec<String> {
        let mut all: Vec<String> = [
            "",
            "plain",
            "quote\" backslash\\ slash/",
            "ctl \u{0} \u{1f} \u{7f} \n\r\t\u{8}\u{c}",
            "unicode é 🦀 \u{2028}\u{2029} \u{fffd}",
            "\"starts and ends\\",
            "é\né\u{1}🦀\"",
            "\u{1b}[31m",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        all.push((0u8..0x80).map(char::from).collect());
        all.push("x".repeat(5000) + "\n" + &"é".repeat(700));
        all
    }

    #[test]
    fn the_fast_path_writes_what_the_canonicalizer_writes() {
        for text in hostile_strings() {
            let values = [
                json!(text),
                json!({"z": text, "a": [1, -3, true, null], "m": {"b": null, "a": text}}),
                json!({"zz": 9007199254740992u64, "b": -9007199254740992i64, "a": {"y": [true, null, text], "x": 0}}),
                json!([[], {}, [{}], ""]),
                json!({"B": 1, "a": 2, "_": 3, "A": 4, "~": 5, "0": 6}),
            ];
            for value in values {
                let mut fast = String::new();
                assert!(write_simple(&value, &mut fast), "{value}");
                assert_eq!(
                    fast,
                    serde_json_canonicalizer::to_string(&value).unwrap(),
                    "{value}"
                );
                assert_eq!(to_string(&value).unwrap(), fast);
                if let Value::Object(map) = &value {
                    assert_eq!(object_to_string(map).unwrap(), fast);
                }
            }
        }
    }

    #[test]
    fn values_off_the_fast_path_are_canonicalized_by_the_library() {
        let values = [
            json!({"f": 0.1, "g": 1e21, "h": -0.0}),
            json!({"n": 9007199254740993u64}),
            json!({"n": -9007199254740993i64}),
            json!({"é": 1, "e": 2, "\u{10000}": 3, "\u{ffff}": 4}),
            json!([1.5, {"a": 2.5}]),
        ];
        for value in values {
            let mut fast = String::new();
            assert!(!write_simple(&value, &mut fast), "{value}");
            assert_eq!(
                to_string(&value).unwrap(),
                serde_json_canonicalizer::to_string(&value).unwrap(),
                "{value}"
            );
            if let Value::Object(map) = &value {
                assert_eq!(
                    object_to_string(map).unwrap(),
                    serde_json_canonicalizer::to_string(&value).unwrap()
                );
            }
        }
    }
}
