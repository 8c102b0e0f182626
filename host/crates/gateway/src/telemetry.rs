//! OpenTelemetry spans (issue 32), exported over OTLP/HTTP protobuf when `[telemetry]
//! otlp` (or `serve --otlp`) names a collector; off otherwise, and then nothing here runs.
//!
//! Rules:
//! - **A SERVER span per MCP request** the front serves (`tools/call`, `tools/list`,
//!   `server/discover`, `initialize`), named `{mcp.method.name} {target}` (OpenTelemetry
//!   MCP semantic conventions): the target is the capability's name only once the call
//!   found it offered to its session ([`crate::pipeline::normalize`]), so a name a client
//!   invents never becomes a span name.
//! - **Its parent is the client's trace context**: `params._meta.traceparent` /
//!   `tracestate` (SEP-414; on stdio the only carrier), else, on the HTTP front, the
//!   request's `traceparent` / `tracestate` headers — `_meta` wins, as SEP-414 says. A
//!   `traceparent` that does not parse (W3C Trace Context §3.2) is ignored, as if absent;
//!   without one the span starts a new trace. Sampling follows the parent's `sampled`
//!   flag (and samples a new trace).
//! - **A child span per pipeline stage** (`normalize`, `authorize`, `intent`, `recheck`,
//!   `execute`, `outcome`, and `commit`: the trace write the answer waits for), made from
//!   the times the call measured anyway; `execute` is live, and the **client span of
//!   each upstream request** is its child ([`airlock_upstream::spans`], which writes the
//!   context into the request's `_meta`).
//! - The call-outcome trace event records `otel_trace_id` and `otel_span_id` (the
//!   server span), so an auditor can go from the tamper-evident trace to the spans and
//!   back; the server span records `airlock.call.id`.
//! - Spans carry names the reviewed catalogue bounds, bounded categories, ids and
//!   durations — never argument values, payloads or the requester's identity. The HTTP
//!   `Mcp-Session-Id` is recorded as `mcp.session.id` only as the first 16 hex digits of
//!   its SHA-256 (the id is a session's bearer value).
//!
//! Export: the SDK's batch processor on its own thread (queue [`QUEUE_SPANS`] spans,
//! exported every [`EXPORT_EVERY`]; a full queue drops spans rather than slow a call),
//! reqwest's blocking client, [`EXPORT_TIMEOUT`] per export. `OTEL_EXPORTER_OTLP_HEADERS`
//! (e.g. a collector's token) applies as the exporter reads it.

use std::time::{Duration, SystemTime};

use anyhow::{Context as _, Result};
use opentelemetry::propagation::{Extractor, TextMapPropagator as _};
use opentelemetry::trace::{Span as _, SpanKind, Status, TraceContextExt as _, Tracer as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SdkTracer, SdkTracerProvider,
};
use rmcp::model::MetaObject;
use sha2::Digest as _;

/// The most spans queued for export; more are dropped until the exporter catches up.
pub const QUEUE_SPANS: usize = 16_384;
/// How often queued spans are exported (also whenever [`EXPORT_BATCH`] are queued).
pub const EXPORT_EVERY: Duration = Duration::from_secs(1);
/// The most spans in one export request.
pub const EXPORT_BATCH: usize = 1_024;
/// The most characters of a client's JSON-RPC request id a server span records (the id
/// is the client's choice: a string of any length).
pub const REQUEST_ID_CHARS: usize = 64;
/// How long one export request may take.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(3);

/// The OTLP/HTTP traces URL for `[telemetry] otlp`: a URL without a path (or `/`) is a
/// collector's base (`http://127.0.0.1:4318`) and gains `/v1/traces` (before its query,
/// if it has one), as `OTEL_EXPORTER_OTLP_ENDPOINT` does; any other path is the traces
/// URL itself. Credentials in the URL (`user:password@`) are refused: the endpoint is
/// logged when the host starts, and a collector's token belongs in
/// `OTEL_EXPORTER_OTLP_HEADERS`.
///
/// # Errors
/// Not an `http://` or `https://` URL with a host, or a URL with credentials.
pub fn traces_url(text: &str) -> Result<String> {
    let bad = || {
        // A value with an `@` may hold credentials: it is not quoted back.
        let shown = if text.contains('@') {
            "(not shown: it contains an @)".to_string()
        } else {
            format!("`{}`", airlock_core::text::safe(text, 200))
        };
        anyhow::anyhow!(
            "OTLP endpoint {shown}: expected an http:// or https:// URL such as http://127.0.0.1:4318 (a collector's OTLP/HTTP port; /v1/traces is added) or http://collector:4318/v1/traces"
        )
    };
    let uri: http::Uri = text.parse().map_err(|_| bad())?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        _ => return Err(bad()),
    }
    let (Some(scheme), Some(authority)) = (uri.scheme_str(), uri.authority()) else {
        return Err(bad());
    };
    if uri.host().is_none_or(str::is_empty) {
        return Err(bad());
    }
    // Never quoted back: the URL's credentials would be in the message.
    if authority.as_str().contains('@') {
        anyhow::bail!(
            "OTLP endpoint: a URL with credentials (user:password@host) is refused, as the endpoint is logged; give a collector's token in OTEL_EXPORTER_OTLP_HEADERS"
        );
    }
    Ok(match (uri.path(), uri.query()) {
        ("" | "/", None) => format!("{scheme}://{authority}/v1/traces"),
        ("" | "/", Some(query)) => format!("{scheme}://{authority}/v1/traces?{query}"),
        _ => text.to_string(),
    })
}

/// The host's span exporter and tracer (see the module rules).
pub struct Spans {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

/// One MCP request the front serves, as its server span records it.
pub struct ServerRequest<'a> {
    /// `tools/call`, `tools/list`, …
    pub method: &'static str,
    /// The request's `_meta`.
    pub meta: &'a MetaObject,
    /// The HTTP request's headers (the HTTP front), else `None`.
    pub headers: Option<&'a http::HeaderMap>,
    /// The JSON-RPC id, as text.
    pub request_id: String,
    /// `pipe` (stdio) or `tcp` (HTTP).
    pub transport: &'static str,
    /// The protocol version the request is served in, when known.
    pub protocol: Option<&'a str>,
}

impl Spans {
    /// Starts exporting to the OTLP/HTTP traces URL `url` ([`traces_url`]), as service
    /// `airlock` (its version, and `service.instance.id` = `instance`, the host's id).
    ///
    /// # Errors
    /// The exporter could not be built (an invalid URL).
    pub fn start(url: &str, instance: &str) -> Result<Self> {
        // The exporter's reqwest client, like the upstream connections', uses rustls.
        crate::upstream::http::ensure_crypto_provider();
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_endpoint(url)
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .with_context(|| format!("the OTLP span exporter for {url}"))?;
        let batch = BatchConfigBuilder::default()
            .with_max_queue_size(QUEUE_SPANS)
            .with_max_export_batch_size(EXPORT_BATCH)
            .with_scheduled_delay(EXPORT_EVERY)
            .build();
        let processor = BatchSpanProcessor::builder(exporter)
            .with_batch_config(batch)
            .build();
        let resource = opentelemetry_sdk::Resource::builder_empty()
            .with_service_name("airlock")
            .with_attributes([
                KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
                KeyValue::new("service.instance.id", instance.to_string()),
            ])
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_resource(resource)
            .build();
        use opentelemetry::trace::TracerProvider as _;
        let tracer = provider.tracer("airlock");
        Ok(Self { provider, tracer })
    }

    /// The tracer (the upstream client spans are made with it).
    pub fn tracer(&self) -> &SdkTracer {
        &self.tracer
    }

    /// Starts the server span of `request` (see the module rules); the returned context
    /// holds it. End it with [`end_server`].
    pub fn server(&self, request: ServerRequest<'_>) -> Context {
        let parent = parent(request.meta, request.headers);
        let mut attributes = Vec::with_capacity(6);
        attributes.push(KeyValue::new("mcp.method.name", request.method));
        // The client chooses the id: at most REQUEST_ID_CHARS of it, escaped.
        attributes.push(KeyValue::new(
            "jsonrpc.request.id",
            airlock_core::text::safe(&request.request_id, REQUEST_ID_CHARS),
        ));
        attributes.push(KeyValue::new("network.transport", request.transport));
        if let Some(p) = request.protocol {
            attributes.push(KeyValue::new("mcp.protocol.version", p.to_string()));
        }
        if let Some(id) = request
            .headers
            .and_then(|h| h.get("mcp-session-id"))
            .map(|v| v.as_bytes())
        {
            let digest = hex::encode(sha2::Sha256::digest(id));
            attributes.push(KeyValue::new("mcp.session.id", digest[..16].to_string()));
        }
        let span = self
            .tracer
            .span_builder(request.method)
            .with_kind(SpanKind::Server)
            .with_attributes(attributes)
            .start_with_context(&self.tracer, &parent);
        parent.with_span(span)
    }

    /// Starts the live `execute` stage span under `server` (its upstream requests' client
    /// spans are its children).
    pub fn execute(&self, server: &Context) -> Context {
        let span = self
            .tracer
            .span_builder("execute")
            .with_kind(SpanKind::Internal)
            .start_with_context(&self.tracer, server);
        server.with_span(span)
    }

    /// Records the finished stages of a call under `server`: `stages` as the call measured
    /// them (`(name, µs)` in order, the first starting at `started`); a `stage.part` entry
    /// is part of the stage before it and becomes its `airlock.{stage}.{part}_us`
    /// attribute. `execute` was live ([`Spans::execute`], [`end_execute`]): it only
    /// advances the clock here.
    pub fn stages(&self, server: &Context, started: SystemTime, stages: &[(&'static str, u64)]) {
        let mut at = started;
        let mut current: Option<(opentelemetry_sdk::trace::Span, SystemTime)> = None;
        for (name, us) in stages {
            if let Some((stage, part)) = name.split_once('.') {
                if let Some((span, _)) = current.as_mut().filter(|_| stage != "execute") {
                    span.set_attribute(KeyValue::new(
                        format!("airlock.{stage}.{part}_us"),
                        *us as i64,
                    ));
                }
                continue;
            }
            if let Some((mut span, end)) = current.take() {
                span.end_with_timestamp(end);
            }
            let end = at + Duration::from_micros(*us);
            if *name != "execute" {
                let span = self
                    .tracer
                    .span_builder(*name)
                    .with_kind(SpanKind::Internal)
                    .with_start_time(at)
                    .start_with_context(&self.tracer, server);
                current = Some((span, end));
            }
            at = end;
        }
        if let Some((mut span, end)) = current {
            span.end_with_timestamp(end);
        }
    }

    /// Records the `commit` stage (the trace write the answer waits for) under `server`,
    /// from `(start, end)`.
    pub fn commit(&self, server: &Context, (start, end): (SystemTime, SystemTime), failed: bool) {
        let mut span = self
            .tracer
            .span_builder("commit")
            .with_kind(SpanKind::Internal)
            .with_start_time(start)
            .start_with_context(&self.tracer, server);
        if failed {
            span.set_status(Status::error("the call's trace could not be committed"));
        }
        span.end_with_timestamp(end);
    }

    /// Exports what is queued and stops the exporter (blocks up to [`EXPORT_TIMEOUT`]
    /// per pending export: call it off the runtime's workers).
    pub fn shutdown(&self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!("could not export the last spans: {e}");
        }
    }
}

/// Ends the live `execute` span of `context` with the parts of the stage the call
/// measured (`execute.queue`, `execute.instantiate`, `execute.upstream`, `execute.guest`…
/// in `stages`) as its `airlock.execute.{part}_us` attributes.
pub fn end_execute(context: &Context, stages: &[(&'static str, u64)]) {
    let span = context.span();
    for (name, us) in stages {
        if let Some(part) = name.strip_prefix("execute.") {
            span.set_attribute(KeyValue::new(
                format!("airlock.execute.{part}_us"),
                *us as i64,
            ));
        }
    }
    span.end();
}

/// Ends the server span of `context`, recording `error` (a bounded category such as
/// `invalid request` or a JSON-RPC error code) as `error.type` and the span's status.
pub fn end_server(context: &Context, error: Option<&str>) {
    let span = context.span();
    if let Some(kind) = error {
        span.set_attribute(KeyValue::new("error.type", kind.to_string()));
        span.set_status(Status::error(kind.to_string()));
    }
    span.end();
}

/// The W3C trace id and span id of `context`'s span, as lowercase hex (32 and 16
/// digits), when its span context is valid.
pub fn ids(context: &Context) -> Option<(String, String)> {
    let span = context.span();
    let sc = span.span_context();
    sc.is_valid()
        .then(|| (sc.trace_id().to_string(), sc.span_id().to_string()))
}

/// The parent context of a request: `_meta`'s `traceparent`/`tracestate` when its
/// `traceparent` is valid, else the HTTP headers' when theirs is, else none (a new
/// trace). Invalid values are ignored (module rules).
pub fn parent(meta: &MetaObject, headers: Option<&http::HeaderMap>) -> Context {
    let propagator = TraceContextPropagator::new();
    let from_meta = propagator.extract(&MetaCarrier(meta));
    if from_meta.span().span_context().is_valid() {
        return from_meta;
    }
    if let Some(h) = headers {
        let from_headers = propagator.extract(&HeaderCarrier(h));
        if from_headers.span().span_context().is_valid() {
            return from_headers;
        }
    }
    Context::new()
}

/// `_meta` as a trace context carrier (string members only).
struct MetaCarrier<'a>(&'a MetaObject);

impl Extractor for MetaCarrier<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.0.get(key).and_then(|v| v.as_str())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.0.keys().map(String::as_str).collect()
    }
}

/// HTTP headers as a trace context carrier.
struct HeaderCarrier<'a>(&'a http::HeaderMap);

impl Extractor for HeaderCarrier<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const PARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    fn meta(value: serde_json::Value) -> MetaObject {
        MetaObject(value.as_object().unwrap().clone())
    }

    fn trace_of(cx: &Context) -> String {
        cx.span().span_context().trace_id().to_string()
    }

    #[test]
    fn meta_wins_over_the_header_and_a_malformed_value_is_ignored() {
        let mut headers = http::HeaderMap::new();
        headers.insert(
            "traceparent",
            "00-11111111111111111111111111111111-2222222222222222-01"
                .parse()
                .unwrap(),
        );
        let from_meta = parent(&meta(json!({"traceparent": PARENT})), Some(&headers));
        assert_eq!(trace_of(&from_meta), "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(
            from_meta.span().span_context().span_id().to_string(),
            "b7ad6b7169203331"
        );
        // A malformed `_meta` value: the header's context instead.
        for bad in [
            json!("not a traceparent"),
            json!("00-00000000000000000000000000000000-b7ad6b7169203331-01"),
            json!("00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01"),
            json!("ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
            json!("00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01x"),
            json!(42),
            json!({"nested": PARENT}),
        ] {
            let cx = parent(&meta(json!({ "traceparent": bad })), Some(&headers));
            assert_eq!(trace_of(&cx), "11111111111111111111111111111111", "{bad}");
            let none = parent(&meta(json!({ "traceparent": bad })), None);
            assert!(!none.span().span_context().is_valid(), "{bad}");
        }
        assert!(
            !parent(&MetaObject::default(), None)
                .span()
                .span_context()
                .is_valid()
        );
    }

    #[test]
    fn tracestate_rides_with_its_traceparent() {
        let cx = parent(
            &meta(json!({"traceparent": PARENT, "tracestate": "vendor=abc"})),
            None,
        );
        assert_eq!(
            cx.span().span_context().trace_state().header(),
            "vendor=abc"
        );
    }

    #[test]
    fn the_traces_url_takes_a_base_or_a_full_url() {
        assert_eq!(
            traces_url("http://127.0.0.1:4318").unwrap(),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(
            traces_url("http://127.0.0.1:4318/").unwrap(),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(
            traces_url("https://collector.example/otlp/v1/traces").unwrap(),
            "https://collector.example/otlp/v1/traces"
        );
        // A base's query stays a query: the path goes before it.
        assert_eq!(
            traces_url("http://127.0.0.1:4318?tenant=a").unwrap(),
            "http://127.0.0.1:4318/v1/traces?tenant=a"
        );
        assert_eq!(
            traces_url("http://[::1]:4318/?tenant=a").unwrap(),
            "http://[::1]:4318/v1/traces?tenant=a"
        );
        // Credentials are refused, and never quoted back.
        for with_credentials in [
            "http://user:s3cret@collector:4318",
            "https://user:s3cret@collector.example/v1/traces",
        ] {
            let e = traces_url(with_credentials).unwrap_err().to_string();
            assert!(e.contains("OTEL_EXPORTER_OTLP_HEADERS"), "{e}");
            assert!(!e.contains("s3cret"), "{e}");
        }
        // Refused for another reason, still not quoted back.
        for malformed in [
            "ftp://user:s3cret@collector:4318",
            "user:s3cret@collector:4318",
        ] {
            let e = traces_url(malformed).unwrap_err().to_string();
            assert!(e.contains("expected an http"), "{e}");
            assert!(!e.contains("s3cret"), "{e}");
        }
        for bad in [
            "127.0.0.1:4318",
            "ftp://x/",
            "http://",
            "",
            "not a url",
            "http:///v1/traces",
        ] {
            let e = traces_url(bad).unwrap_err().to_string();
            assert!(
                e.contains("expected an http:// or https:// URL"),
                "{bad}: {e}"
            );
        }
    }
}
