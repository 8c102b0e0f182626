//! Entry points for the fuzz targets in `host/crates/gateway/fuzz/` (hidden; not an API,
//! and nothing in Airlock calls them). Each one hands its input, unchanged, to a private
//! function of a front, so the fuzzers drive the code that serves requests rather than a
//! copy of it.

use serde_json::Value;

use crate::front::{http, stdio};

/// What the stdio front does with one line (see [`crate::front::stdio`]'s rules).
#[derive(Debug)]
pub enum StdioVerdict {
    /// Handed to rmcp: the typed message as rmcp would serialize it again.
    Deliver(Value),
    /// Answered with these bytes (newline-terminated JSON-RPC lines).
    Answer(Vec<u8>),
    /// Neither (an empty line, a malformed notification or response).
    Skip,
}

/// Judges one line read by the stdio front (`line` as read: its newline included).
pub fn stdio_line(line: &[u8]) -> StdioVerdict {
    match stdio::judge(line) {
        stdio::Verdict::Deliver(message) => StdioVerdict::Deliver(
            serde_json::to_value(&*message).expect("a typed JSON-RPC message serializes"),
        ),
        stdio::Verdict::Answer(bytes) => StdioVerdict::Answer(bytes),
        stdio::Verdict::Skip => StdioVerdict::Skip,
    }
}

/// The HTTP front's reading of a `Host` value: (lower-cased host, port).
///
/// # Errors
/// Why the value is not an authority the front accepts.
pub fn http_authority(text: &str) -> Result<(String, Option<u16>), String> {
    http::parse_authority(text).map_err(|e| format!("{e:#}"))
}

/// The HTTP front's check of an `allowed_origins` entry.
///
/// # Errors
/// Why the entry is refused.
pub fn http_origin_entry(text: &str) -> Result<(), String> {
    http::parse_origin(text).map_err(|e| format!("{e:#}"))
}

/// Whether the HTTP front lets a request with `Origin: origin` through, given `allowed`
/// entries as configured: both normalized as the front does (lower-cased, the scheme's
/// default port dropped), then compared.
pub fn http_origin_allowed(origin: &str, allowed: &[String]) -> bool {
    let allowed: Vec<String> = allowed.iter().map(|a| http::normalize_origin(a)).collect();
    http::origin_allowed(&http::normalize_origin(origin), &allowed)
}
