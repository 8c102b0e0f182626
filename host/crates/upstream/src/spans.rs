//! Client spans of upstream requests (OpenTelemetry, issue 32).
//!
//! Rules:
//! - **One CLIENT span per upstream request a call sends** (`tools/call`,
//!   `resources/read`), a child of the call's span ([`CallTrace`]), started before the
//!   request is written and ended when its answer, failure or cancellation is known.
//! - **Its W3C trace context is written into the request's `params._meta`**
//!   (`traceparent`, and `tracestate` when the call's context carries one; SEP-414, the
//!   only carrier on stdio), on every transport: the direct stdio path, rmcp's client
//!   over stdio and Streamable HTTP. The upstream server continues the trace with
//!   Airlock's client span as its parent.
//! - Span name `{mcp.method.name} {target}` with the upstream tool's name as target (a
//!   name the reviewed mapping lists); `resources/read` has no target (a URI is an
//!   argument). Attributes follow the OpenTelemetry MCP semantic conventions
//!   (`mcp.method.name`, `gen_ai.tool.name`, `gen_ai.operation.name`,
//!   `jsonrpc.request.id`, `network.transport`, `error.type`) plus `airlock.connection`;
//!   never argument values or payloads.
//! - Nothing here runs when the call has no trace context (telemetry off): no span, no
//!   `_meta` written.

use opentelemetry::trace::{SpanKind, Status, TraceContextExt as _, Tracer as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::SdkTracer;
use serde_json::Value;

use crate::UpstreamFailure;

/// The trace context of the call an upstream request belongs to, with the tracer that
/// makes its client spans.
#[derive(Clone)]
pub struct CallTrace {
    /// The parent of the call's upstream client spans (the call's `execute` stage span).
    pub context: Context,
    /// The host's tracer.
    pub tracer: SdkTracer,
}

/// The W3C `traceparent` of `context`'s span (`00-{trace id}-{span id}-{flags}`, W3C
/// Trace Context §3.2), or `None` when its span context is not valid.
pub fn traceparent(context: &Context) -> Option<String> {
    let span = context.span();
    let sc = span.span_context();
    sc.is_valid().then(|| {
        format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        )
    })
}

/// One upstream request's client span (see the module rules).
pub(crate) struct ClientSpan {
    context: Context,
}

impl CallTrace {
    /// Starts the client span of request `method` (with `tool` for `tools/call`) on
    /// connection `connection` over `transport` (`pipe` or `tcp`, `None` when neither),
    /// and returns it with the `_meta` members that carry its context.
    pub(crate) fn start(
        &self,
        method: &'static str,
        tool: Option<&str>,
        connection: &str,
        transport: Option<&'static str>,
    ) -> (ClientSpan, serde_json::Map<String, Value>) {
        let name = match tool {
            Some(t) => format!("{method} {t}"),
            None => method.to_string(),
        };
        let mut attributes = Vec::with_capacity(6);
        attributes.push(KeyValue::new("mcp.method.name", method));
        if let Some(t) = tool {
            attributes.push(KeyValue::new("gen_ai.tool.name", t.to_string()));
            attributes.push(KeyValue::new("gen_ai.operation.name", "execute_tool"));
        }
        if let Some(t) = transport {
            attributes.push(KeyValue::new("network.transport", t));
        }
        attributes.push(KeyValue::new("airlock.connection", connection.to_string()));
        let span = self
            .tracer
            .span_builder(name)
            .with_kind(SpanKind::Client)
            .with_attributes(attributes)
            .start_with_context(&self.tracer, &self.context);
        let context = self.context.with_span(span);
        let mut meta = serde_json::Map::new();
        if let Some(parent) = traceparent(&context) {
            meta.insert("traceparent".into(), Value::String(parent));
            let state = context.span().span_context().trace_state().header();
            if !state.is_empty() {
                meta.insert("tracestate".into(), Value::String(state));
            }
        }
        (ClientSpan { context }, meta)
    }
}

impl ClientSpan {
    /// Ends the span with the request's result: its JSON-RPC id when it was sent, and
    /// `error.type` for a failure (the [`UpstreamFailure`] kind) or a tool result with
    /// `isError: true` (`tool_error`, as the MCP conventions name it).
    pub(crate) fn end(self, answer: &Result<(Value, String), (UpstreamFailure, Option<String>)>) {
        let span = self.context.span();
        let (id, error) = match answer {
            Ok((result, id)) => (
                Some(id.as_str()),
                (result.get("isError") == Some(&Value::Bool(true))).then_some("tool_error"),
            ),
            Err((failure, id)) => (id.as_deref(), Some(failure_kind(failure))),
        };
        if let Some(id) = id {
            span.set_attribute(KeyValue::new("jsonrpc.request.id", id.to_string()));
        }
        if let Some(kind) = error {
            span.set_attribute(KeyValue::new("error.type", kind));
            span.set_status(Status::error(kind));
        }
        span.end();
    }
}

/// A bounded name for `failure` (`error.type`).
fn failure_kind(failure: &UpstreamFailure) -> &'static str {
    match failure {
        UpstreamFailure::OutputTooLarge(_) => "output_too_large",
        UpstreamFailure::Unavailable(_) => "unavailable",
        UpstreamFailure::Protocol(_) => "protocol_error",
        UpstreamFailure::Cancelled => "cancelled",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::TracerProvider as _;

    #[test]
    fn a_client_span_is_the_child_of_the_calls_and_its_context_rides_in_meta() {
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
        let tracer = provider.tracer("test");
        let parent = tracer.start("call");
        let parent_cx = Context::new().with_span(parent);
        let trace = CallTrace {
            context: parent_cx.clone(),
            tracer,
        };
        let (span, meta) = trace.start("tools/call", Some("read_note"), "notes", Some("pipe"));
        let sent = meta["traceparent"].as_str().unwrap();
        let parent_sc = parent_cx.span().span_context().clone();
        let own = span.context.span().span_context().clone();
        assert_eq!(own.trace_id(), parent_sc.trace_id());
        assert_ne!(own.span_id(), parent_sc.span_id());
        assert_eq!(
            sent,
            format!("00-{}-{}-01", own.trace_id(), own.span_id()),
            "the upstream's parent is the client span, not the call's"
        );
        assert!(!meta.contains_key("tracestate"), "no state, no member");
        span.end(&Ok((serde_json::json!({"isError": true}), "7".into())));
    }

    #[test]
    fn no_valid_context_no_traceparent() {
        assert_eq!(traceparent(&Context::new()), None);
    }
}
