//! JSON-RPC framing helpers shared by the model-facing front and the upstream transport.
//!
//! Rule: a message that cannot be parsed (too deep, too large, not UTF-8, a lone
//! surrogate, a number out of range) still has its top-level `id` found in the raw bytes,
//! without buffering the message, so the request it stood for can be answered.

use serde_json::Value;

/// Finds the top-level `"id"` member of a JSON object streamed through [`IdScanner::feed`],
/// without buffering the object. Nested `id` keys and `id` text inside strings are ignored.
/// By default the scan stops at the first id; [`IdScanner::whole`] reads on to the end and
/// counts the top-level `id` keys, so an id written twice (ambiguous) is found as none.
#[derive(Default)]
pub struct IdScanner {
    whole: bool,
    id_keys: u32,
    depth: u32,
    in_string: bool,
    escape: bool,
    expect_key: bool,
    in_key: bool,
    key: Vec<u8>,
    key_is_id: bool,
    capturing: bool,
    value: Vec<u8>,
    found: Option<Vec<u8>>,
}

impl IdScanner {
    const MAX_ID_BYTES: usize = 128;
    /// The longest key kept to compare with `id`: enough for every escaped spelling of it
    /// (`"\u0069\u0064"` is 12 bytes).
    const MAX_KEY_BYTES: usize = 32;

    /// A scanner that reads the whole message, counting its top-level `id` keys
    /// ([`IdScanner::id_keys`]); its [`IdScanner::id`] is `None` when there is more than
    /// one, since which was meant is ambiguous. For a message held whole (a line being
    /// answered); a message streamed past unbuffered uses the default, which stops early.
    pub fn whole() -> Self {
        Self {
            whole: true,
            ..Self::default()
        }
    }

    /// How many top-level `id` keys were seen (with [`IdScanner::whole`]; otherwise at most
    /// the first).
    pub fn id_keys(&self) -> u32 {
        self.id_keys
    }

    /// Scans `bytes`, the next part of the message.
    pub fn feed(&mut self, bytes: &[u8]) {
        if self.found.is_some() && !self.whole {
            // Nothing after the id matters: the rest is skipped, not scanned.
            return;
        }
        for &b in bytes {
            if self.capturing {
                if !self.in_string && self.depth == 1 && (b == b',' || b == b'}') {
                    self.capturing = false;
                    self.found = Some(std::mem::take(&mut self.value));
                } else if self.value.len() < Self::MAX_ID_BYTES {
                    self.value.push(b);
                } else {
                    self.capturing = false;
                    self.value.clear();
                }
            }
            if self.in_string {
                if self.in_key && self.key.len() <= Self::MAX_KEY_BYTES {
                    self.key.push(b);
                }
                if self.escape {
                    self.escape = false;
                } else if b == b'\\' {
                    self.escape = true;
                } else if b == b'"' {
                    self.in_string = false;
                    if self.in_key {
                        self.in_key = false;
                        self.key_is_id = is_id_key(&self.key);
                        self.id_keys += u32::from(self.key_is_id);
                    }
                }
                continue;
            }
            match b {
                b'"' => {
                    self.in_string = true;
                    if self.depth == 1 && self.expect_key {
                        self.in_key = true;
                        self.expect_key = false;
                        self.key.clear();
                    }
                }
                b'{' | b'[' => {
                    self.depth += 1;
                    if self.depth == 1 {
                        self.expect_key = b == b'{';
                    }
                }
                b'}' | b']' => self.depth = self.depth.saturating_sub(1),
                b',' if self.depth == 1 => self.expect_key = true,
                b':' if self.depth == 1 => {
                    if self.key_is_id && self.found.is_none() {
                        self.capturing = true;
                        self.value.clear();
                    }
                    self.key_is_id = false;
                }
                _ => {}
            }
        }
    }

    /// The id, when it was a JSON number or string (and, with [`IdScanner::whole`], the
    /// only top-level `id`).
    pub fn id(&self) -> Option<Value> {
        if self.whole && self.id_keys > 1 {
            return None;
        }
        let v: Value = serde_json::from_slice(self.found.as_deref()?).ok()?;
        (v.is_number() || v.is_string()).then_some(v)
    }
}

/// Whether a key's raw bytes (up to and including its closing quote) spell `id`, escapes
/// decoded as JSON decodes them (`"i\u0064"` is the key `id` too).
fn is_id_key(raw: &[u8]) -> bool {
    if raw == b"id\"" {
        return true;
    }
    if !raw.contains(&b'\\') || !raw.ends_with(b"\"") {
        return false;
    }
    let mut quoted = Vec::with_capacity(raw.len() + 1);
    quoted.push(b'"');
    quoted.extend_from_slice(raw);
    serde_json::from_slice::<String>(&quoted).is_ok_and(|key| key == "id")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn scan(text: &str) -> Option<Value> {
        let mut s = IdScanner::default();
        for chunk in text.as_bytes().chunks(3) {
            s.feed(chunk);
        }
        s.id()
    }

    #[test]
    fn scanner_finds_only_the_top_level_id() {
        assert_eq!(
            scan(r#"{"jsonrpc":"2.0","id":7,"result":{}}"#),
            Some(json!(7))
        );
        assert_eq!(
            scan(r#"{"result":{"id":"inner","x":[{"id":1}]},"id": "a,}b" }"#),
            Some(json!("a,}b"))
        );
        assert_eq!(
            scan(r#"{"result":{"text":"\"id\":9"},"id":3}"#),
            Some(json!(3))
        );
        assert_eq!(
            scan(r#"{"method":"notifications/x","params":{"id":5}}"#),
            None
        );
        // An escaped spelling is the same key (found by the front_line fuzz target).
        assert_eq!(scan(r#"{"i\u0064":4}"#), Some(json!(4)));
        assert_eq!(scan(r#"{"\u0069\u0064":5}"#), Some(json!(5)));
        assert_eq!(scan(r#"{"i\u0064x":4}"#), None);
        assert_eq!(scan(r#"{"i\u00":4}"#), None);
        assert_eq!(scan(r#"{"id":{"nested":1}}"#), None);
        assert_eq!(scan(r#"[{"id":1}]"#), None);
    }

    #[test]
    fn a_whole_scan_finds_an_id_written_twice_ambiguous() {
        let whole = |text: &[u8]| {
            let mut s = IdScanner::whole();
            for chunk in text.chunks(3) {
                s.feed(chunk);
            }
            (s.id(), s.id_keys())
        };
        // The default scan stops at the first id; the whole scan sees both.
        assert_eq!(scan(r#"{"id":4,"x":1,"id":5}"#), Some(json!(4)));
        assert_eq!(whole(br#"{"id":4,"x":1,"id":5}"#), (None, 2));
        // Found by the front_line fuzz target: the same id twice, and bytes that are not
        // UTF-8 further on (a line no parser reads).
        assert_eq!(
            whole(b"{\"jsonrpc\":\"2.0\",\"id\":4,\"e\":1,\"id\":4,\"error\":{\"m\":\"\xc8\xbf\xff\"}}"),
            (None, 2)
        );
        // One id, nested ids and id text in strings do not count.
        assert_eq!(
            whole(br#"{"id":7,"p":{"id":1},"s":"\"id\":2"}"#),
            (Some(json!(7)), 1)
        );
        assert_eq!(whole(br#"[{"id":1},{"id":2}]"#), (None, 0));
        assert_eq!(whole(br#"{"id":1,"i\u0064":2}"#), (None, 2));
    }
}
