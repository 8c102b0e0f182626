//! Calls to the upstream MCP server on the adapter's own connection (`airlock:host/upstream`).
//!
//! The host forwards a call only when the adapter's mapping lists the tool (`[upstream]
//! tools`) or the resource prefix (`[upstream] resources`); anything else comes back as
//! [`UpstreamError::NotPermitted`] and nothing is sent. Every result is measured against the
//! mapping's output budget before the adapter sees it. Everything a server returns is
//! untrusted data.
//!
//! These are the same functions and types for every contract world the SDK supports: the
//! host imports are generated once (in [`crate::bindings`]) and reused by the other worlds.
//! [`UpstreamError`] and [`StructuredError`] convert into each contract's `ContractError`
//! ([`crate::source_retrieval::ContractError`], [`crate::artifact_delivery::ContractError`])
//! by the same table, so `?` works in every adapter.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::artifact_delivery::ContractError as DeliveryError;
use crate::bindings::airlock::host::upstream as raw;
use crate::source_retrieval::ContractError as RetrievalError;

pub use raw::{
    ContentBlock, ResourceContents, ResourceLink, ResourceText, ToolOutput, UpstreamError,
};

/// Longest upstream message (in bytes) that the error conversions carry into a contract error.
pub const MAX_ERROR_DETAIL: usize = 1024;

/// Calls upstream tool `name` with `arguments_json`, a JSON object as text.
///
/// `name` is the tool's upstream name, exactly as the mapping lists it.
pub fn call_tool(name: &str, arguments_json: &str) -> Result<ToolOutput, UpstreamError> {
    #[cfg(target_arch = "wasm32")]
    return raw::call_tool(name, arguments_json);
    #[cfg(not(target_arch = "wasm32"))]
    return crate::native::call_tool(name, arguments_json);
}

/// Calls upstream tool `name` with `args` serialized as its JSON arguments.
///
/// `args` must serialize to a JSON object (a struct, a map, or `serde_json::json!({..})`);
/// anything else fails with [`UpstreamError::InvalidArguments`] before anything is sent.
///
/// ```ignore
/// let output = airlock_sdk::upstream::call_tool_json("read_note", &serde_json::json!({ "id": id }))?;
/// ```
pub fn call_tool_json<A: Serialize + ?Sized>(
    name: &str,
    args: &A,
) -> Result<ToolOutput, UpstreamError> {
    let value = serde_json::to_value(args).map_err(|e| {
        UpstreamError::InvalidArguments(format!("arguments for `{name}` do not serialize: {e}"))
    })?;
    if !value.is_object() {
        return Err(UpstreamError::InvalidArguments(format!(
            "arguments for `{name}` must be a JSON object"
        )));
    }
    call_tool(name, &value.to_string())
}

/// Reads upstream resource `uri`, which must start with one of the mapping's resource
/// prefixes.
pub fn read_resource(uri: &str) -> Result<Vec<ResourceContents>, UpstreamError> {
    #[cfg(target_arch = "wasm32")]
    return raw::read_resource(uri);
    #[cfg(not(target_arch = "wasm32"))]
    return crate::native::read_resource(uri);
}

/// Why [`ToolOutput::structured`] could not produce a value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StructuredError {
    /// The result had neither `structuredContent` nor a text block.
    Missing,
    /// The JSON did not parse into the requested type. Payload: the parser's message.
    Invalid(String),
}

impl core::fmt::Display for StructuredError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            StructuredError::Missing => {
                f.write_str("the tool result carries no structured content")
            }
            StructuredError::Invalid(e) => {
                write!(f, "the tool result has an unexpected shape: {e}")
            }
        }
    }
}

impl core::error::Error for StructuredError {}

impl From<StructuredError> for RetrievalError {
    /// An answer the adapter cannot interpret: [`RetrievalError::UpstreamFailed`].
    fn from(e: StructuredError) -> Self {
        RetrievalError::UpstreamFailed(e.to_string())
    }
}

impl From<StructuredError> for DeliveryError {
    /// An answer the adapter cannot interpret: [`DeliveryError::UpstreamFailed`].
    fn from(e: StructuredError) -> Self {
        DeliveryError::UpstreamFailed(e.to_string())
    }
}

impl ToolOutput {
    /// Deserializes the result's JSON into `T`.
    ///
    /// Uses `structuredContent` when the server sent one; otherwise the first text block,
    /// parsed as JSON (servers that predate structured output put their JSON there).
    /// Does not look at [`is_error`](ToolOutput::is_error): check that first.
    pub fn structured<T: DeserializeOwned>(&self) -> Result<T, StructuredError> {
        let json = match (&self.structured_json, self.first_text()) {
            (Some(json), _) => json.as_str(),
            (None, Some(text)) => text,
            (None, None) => return Err(StructuredError::Missing),
        };
        serde_json::from_str(json).map_err(|e| StructuredError::Invalid(e.to_string()))
    }

    /// The first `text` content block, if any.
    pub fn first_text(&self) -> Option<&str> {
        self.content.iter().find_map(|block| match block {
            ContentBlock::Text(text) => Some(text.as_str()),
            _ => None,
        })
    }

    /// All `text` content blocks, joined with newlines (empty when there are none).
    pub fn text(&self) -> String {
        let texts: Vec<&str> = self
            .content
            .iter()
            .filter_map(|block| match block {
                ContentBlock::Text(text) => Some(text.as_str()),
                _ => None,
            })
            .collect();
        texts.join("\n")
    }

    /// When the tool reported a failure (`isError`), its message (untrusted text, bounded
    /// to [`MAX_ERROR_DETAIL`] bytes); `None` for a successful result.
    pub fn error_message(&self) -> Option<String> {
        if !self.is_error {
            return None;
        }
        let text = self.text();
        Some(if text.is_empty() {
            "the tool reported an error without a message".to_owned()
        } else {
            crate::bounded(&text, MAX_ERROR_DETAIL)
        })
    }
}

impl UpstreamError {
    /// A one-line description: the kebab-case WIT case name, then its payload, e.g.
    /// `not-permitted: tool "x" is not in this mapping`. Payloads are bounded to
    /// [`MAX_ERROR_DETAIL`] bytes.
    pub fn describe(&self) -> String {
        let (case, detail) = match self {
            UpstreamError::NotPermitted(s) => ("not-permitted", s.as_str()),
            UpstreamError::InvalidArguments(s) => ("invalid-arguments", s.as_str()),
            UpstreamError::OutputTooLarge(budget) => {
                return format!("output-too-large: the answer exceeded the {budget}-byte budget");
            }
            UpstreamError::Unavailable(s) => ("unavailable", s.as_str()),
            UpstreamError::ProtocolError(s) => ("protocol-error", s.as_str()),
        };
        format!("{case}: {}", crate::bounded(detail, MAX_ERROR_DETAIL))
    }
}

/// The contract-error case an [`UpstreamError`] maps to, the same for every contract.
enum Category {
    Unavailable,
    InvalidRequest,
    UpstreamFailed,
}

impl UpstreamError {
    fn category(&self) -> Category {
        match self {
            UpstreamError::NotPermitted(_) | UpstreamError::Unavailable(_) => Category::Unavailable,
            UpstreamError::InvalidArguments(_) => Category::InvalidRequest,
            UpstreamError::OutputTooLarge(_) | UpstreamError::ProtocolError(_) => {
                Category::UpstreamFailed
            }
        }
    }
}

impl From<UpstreamError> for RetrievalError {
    /// The default error mapping, carrying [`UpstreamError::describe`] as the payload:
    ///
    /// | upstream error        | contract error      |
    /// |-----------------------|---------------------|
    /// | `not-permitted`       | `unavailable`       |
    /// | `unavailable`         | `unavailable`       |
    /// | `invalid-arguments`   | `invalid-request`   |
    /// | `output-too-large`    | `upstream-failed`   |
    /// | `protocol-error`      | `upstream-failed`   |
    ///
    /// A refusal by the host (`not-permitted`) means the mapping does not allow the request:
    /// to the caller the source is unavailable. Arguments the host rejected came from the
    /// request. An oversized or erroneous answer is an upstream failure.
    fn from(e: UpstreamError) -> Self {
        let detail = e.describe();
        match e.category() {
            Category::Unavailable => RetrievalError::Unavailable(detail),
            Category::InvalidRequest => RetrievalError::InvalidRequest(detail),
            Category::UpstreamFailed => RetrievalError::UpstreamFailed(detail),
        }
    }
}

impl From<UpstreamError> for DeliveryError {
    /// The same table as for source retrieval, carrying [`UpstreamError::describe`]:
    /// `not-permitted` and `unavailable` → `unavailable`; `invalid-arguments` →
    /// `invalid-request`; `output-too-large` and `protocol-error` → `upstream-failed`.
    ///
    /// Never `conflict` or `not-found`: those come from the upstream's own answer (a tool
    /// result with `isError`), which the adapter interprets. For `deliver`, an
    /// `unavailable` or `upstream-failed` error does not prove that nothing was delivered
    /// (a connection can drop after the upstream acted): such outcomes are reconciled
    /// through `query`, never by retrying.
    fn from(e: UpstreamError) -> Self {
        let detail = e.describe();
        match e.category() {
            Category::Unavailable => DeliveryError::Unavailable(detail),
            Category::InvalidRequest => DeliveryError::InvalidRequest(detail),
            Category::UpstreamFailed => DeliveryError::UpstreamFailed(detail),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every upstream error, with the contract-error case both contracts map it to.
    fn cases() -> Vec<(UpstreamError, &'static str)> {
        vec![
            (
                UpstreamError::NotPermitted("tool `x`".into()),
                "unavailable",
            ),
            (UpstreamError::Unavailable("closed".into()), "unavailable"),
            (
                UpstreamError::InvalidArguments("not an object".into()),
                "invalid-request",
            ),
            (UpstreamError::OutputTooLarge(1024), "upstream-failed"),
            (
                UpstreamError::ProtocolError("-32602".into()),
                "upstream-failed",
            ),
        ]
    }

    #[test]
    fn source_retrieval_errors_follow_the_table() {
        for (error, case) in cases() {
            let detail = error.describe();
            let (got, payload) = match RetrievalError::from(error) {
                RetrievalError::Unavailable(p) => ("unavailable", p),
                RetrievalError::InvalidRequest(p) => ("invalid-request", p),
                RetrievalError::UpstreamFailed(p) => ("upstream-failed", p),
                other => panic!("unexpected {other:?}"),
            };
            assert_eq!((got, payload), (case, detail));
        }
    }

    #[test]
    fn artifact_delivery_errors_follow_the_same_table() {
        for (error, case) in cases() {
            let detail = error.describe();
            let (got, payload) = match DeliveryError::from(error) {
                DeliveryError::Unavailable(p) => ("unavailable", p),
                DeliveryError::InvalidRequest(p) => ("invalid-request", p),
                DeliveryError::UpstreamFailed(p) => ("upstream-failed", p),
                // Never produced from an upstream error: only the adapter decides these.
                DeliveryError::NotFound | DeliveryError::Conflict(_) => {
                    panic!("{detail}: conflict and not-found come from the upstream's answer")
                }
            };
            assert_eq!((got, payload), (case, detail));
        }
        let shape = DeliveryError::from(StructuredError::Missing);
        assert!(
            matches!(&shape, DeliveryError::UpstreamFailed(p) if p.contains("no structured content")),
            "{shape:?}"
        );
    }

    #[test]
    fn payloads_are_bounded() {
        let long = UpstreamError::ProtocolError("x".repeat(10 * MAX_ERROR_DETAIL));
        let DeliveryError::UpstreamFailed(payload) = DeliveryError::from(long) else {
            panic!("protocol errors are upstream failures");
        };
        assert!(payload.len() <= MAX_ERROR_DETAIL + 32, "{}", payload.len());
    }
}
