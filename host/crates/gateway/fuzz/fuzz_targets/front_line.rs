//! One line on the stdio front, as its reader hands it over (up to and including the first
//! newline): the answer or the refusal, checked against the transport's rule that every
//! request carrying an id gets an answer.
//!
//! Asserted, beyond "no panic":
//! - an answer is one or more newline-terminated lines, each a JSON-RPC 2.0 error response
//!   (`jsonrpc`, `id` a string, an integer or null, `error` with an integer `code` among the
//!   front's own and a string `message`, nothing else);
//! - when the raw bytes hold a top-level id (found by the same `IdScanner` the front uses on
//!   lines it cannot parse, reading the whole line) that a request may carry, the line is
//!   either handed to rmcp as a message with that id, or answered with exactly one line
//!   carrying that id; the only exception is a response (no `method`, a `result` or
//!   `error`), which is never answered;
//! - when the raw bytes hold the top-level `id` key twice, the id is ambiguous: the line is
//!   never handed to rmcp, and is answered with exactly one line carrying `id: null` unless
//!   it is a response;
//! - a line handed to rmcp is a JSON-RPC 2.0 message of one shape (request, notification,
//!   response, or error — the one shape whose id may be absent).
#![no_main]

use airlock_gateway::fuzzing::{StdioVerdict, stdio_line};
use airlock_gateway::jsonrpc::IdScanner;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

/// Codes the front answers with itself (parse error, invalid request, invalid params).
const CODES: [i64; 3] = [-32700, -32600, -32602];

fn valid_id(id: &Value) -> bool {
    id.is_string() || id.is_i64()
}

/// Checks one answer line; returns its id.
fn check_answer(line: &[u8]) -> Value {
    let text = std::str::from_utf8(line).expect("an answer is UTF-8");
    assert!(!text.contains('\n'), "one answer per line: {text}");
    let v: Value = serde_json::from_str(text).expect("an answer is JSON");
    let obj = v.as_object().expect("an answer is an object");
    assert_eq!(obj.len(), 3, "jsonrpc, id, error and nothing else: {text}");
    assert_eq!(obj.get("jsonrpc"), Some(&Value::from("2.0")), "{text}");
    let id = obj.get("id").expect("an answer has an id").clone();
    assert!(id.is_null() || valid_id(&id), "answer id: {text}");
    let err = obj
        .get("error")
        .and_then(Value::as_object)
        .expect("an error object");
    let code = err.get("code").and_then(Value::as_i64).expect("a code");
    assert!(CODES.contains(&code), "code {code}: {text}");
    assert!(
        err.get("message").is_some_and(Value::is_string),
        "a message: {text}"
    );
    id
}

/// Whether the line, read leniently, is a response (never answered).
fn is_response(line: &[u8]) -> bool {
    let line = line.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(line);
    match serde_json::from_slice::<Value>(line) {
        Ok(Value::Object(m)) => {
            !m.contains_key("method") && (m.contains_key("result") || m.contains_key("error"))
        }
        _ => false,
    }
}

fuzz_target!(|data: &[u8]| {
    // What the reader hands over: one line, its newline included when there is one.
    let line = match data.iter().position(|&b| b == b'\n') {
        Some(i) => &data[..=i],
        None => data,
    };
    let body = line.strip_suffix(b"\n").unwrap_or(line);
    let body = body.strip_suffix(b"\r").unwrap_or(body);
    let body = body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(body);
    // The whole line is scanned: an id written twice at the top level is ambiguous.
    let mut scan = IdScanner::whole();
    scan.feed(body);
    let twice = scan.id_keys() > 1;
    let scanned = scan.id().filter(valid_id);

    match stdio_line(line) {
        StdioVerdict::Answer(bytes) => {
            assert!(bytes.ends_with(b"\n"), "answers end with a newline");
            let ids: Vec<Value> = bytes[..bytes.len() - 1]
                .split(|&b| b == b'\n')
                .map(check_answer)
                .collect();
            if twice {
                assert_eq!(ids, [Value::Null], "an id written twice is answered with null");
            } else if let Some(id) = &scanned {
                assert_eq!(ids.len(), 1, "one answer to one request");
                assert_eq!(&ids[0], id, "the answer carries the request's id");
            }
        }
        StdioVerdict::Deliver(message) => {
            let obj = message
                .as_object()
                .expect("a delivered message is an object");
            assert_eq!(obj.get("jsonrpc"), Some(&Value::from("2.0")));
            let shape = (
                obj.contains_key("method"),
                obj.contains_key("id"),
                obj.contains_key("result"),
                obj.contains_key("error"),
            );
            assert!(
                matches!(
                    shape,
                    // An error response may lack its id (rmcp reads it as unknown).
                    (true, _, false, false) | (false, true, true, false) | (false, _, false, true)
                ),
                "one message shape: {message}"
            );
            assert!(!twice, "a line with its id written twice is never delivered");
            if let Some(id) = &scanned {
                assert_eq!(obj.get("id"), Some(id), "delivered with the line's id");
            }
        }
        StdioVerdict::Skip => {
            if scanned.is_some() || twice {
                assert!(
                    is_response(body),
                    "a line with an id was neither answered nor delivered"
                );
            }
        }
    }
});
