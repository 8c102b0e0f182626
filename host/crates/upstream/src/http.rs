//! HTTP upstream connections: an MCP server reached over Streamable HTTP.
//!
//! Rules:
//! - **Accepted URLs**: `https://HOST[:PORT]/PATH`, and `http://` only to a loopback host
//!   (`127.0.0.0/8`, `::1`, `localhost`) unless the connection says
//!   `allow_insecure_http = true`. No user-info (`user:pass@`), no fragment.
//! - **Credentials come from named secrets only.** A header is either `{ secret = "NAME" }`
//!   (optionally with a `prefix`, e.g. `"Bearer "`) naming an entry of `[secrets]`, or
//!   `{ value = "…" }` for a non-credential header. A literal value is refused for
//!   `Authorization`, `Proxy-Authorization`, `Cookie` and any header whose name contains
//!   `token`, `key`, `secret`, `auth`, `session`, `password` or `credential`: such a value
//!   belongs in a secret, not in the file. Headers the transport owns (`Accept`,
//!   `Content-Type`, `Host`, `Mcp-*`, `Last-Event-Id`, …) cannot be set.
//! - The secret headers go only on requests to this connection's URL: redirects are not
//!   followed (a `3xx` is a failure), no proxy is used (not even one from the environment),
//!   and header values are marked sensitive. Nothing of a value reaches an adapter, the
//!   trace, an error message or the log; the connection's identity covers the header names
//!   and the secret *names*, never their values. The model-facing client's own token is
//!   never forwarded (the front drops it before any of this runs).
//! - The client negotiates either protocol generation with rmcp's
//!   [`rmcp::service::ClientLifecycleMode::Auto`]: `server/discover` (2026-07-28) first, `initialize`
//!   (2025-11-25) when the server turns out to be older.
//! - The rest of the upstream layer treats the connection like a stdio one: messages cross
//!   a line bridge ([`bridge`]) into the same budget filter and JSON-RPC checks, so the
//!   output budget, the raw capture of discovery and `list_changed` counting work the
//!   same way. Raw answers are the bridge's serialization of what rmcp's HTTP client
//!   parsed, so a field rmcp's types drop is not in an HTTP snapshot's digests.
//! - A request whose POST fails (refused, `401`, `5xx`, a redirect) fails as unavailable
//!   at once, and the connection closes (as does any failed POST, or the HTTP client
//!   ending); the host then restarts it with backoff and re-snapshots it before it serves
//!   again. A quiet server is pinged every [`PING_INTERVAL`] so a server that went away
//!   is noticed without waiting for a call.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use anyhow::{Result, bail};
use futures_util::StreamExt as _;
use futures_util::stream::FuturesUnordered;
use rmcp::model::{ClientJsonRpcMessage, JsonRpcMessage};
use rmcp::transport::Transport as _;
use rmcp::transport::streamable_http_client::{
    StreamableHttpClientTransport, StreamableHttpClientTransportConfig,
};
use serde_json::{Value, json};
use sha2::Digest as _;
use tokio::io::{AsyncBufReadExt as _, AsyncRead, AsyncWrite, AsyncWriteExt as _, BufReader};

use airlock_core::Secret;

/// JSON-RPC error code the bridge answers a request with when its HTTP POST failed: no
/// answer came from the server (the outcome of a non-read is unknown).
pub const HTTP_TRANSPORT_ERROR_CODE: i32 = -32098;

/// One send of the bridge: resolves to (the request's id, its method, the error's text)
/// when it failed, all `None` when it went through.
type SendFuture = std::pin::Pin<
    Box<dyn std::future::Future<Output = (Option<Value>, Option<String>, Option<String>)> + Send>,
>;

/// How often the bridge pings a quiet server to learn that it went away.
pub const PING_INTERVAL: std::time::Duration = std::time::Duration::from_secs(3);

/// The ids of the bridge's own pings (never forwarded to rmcp's client).
const PING_ID_PREFIX: &str = "airlock-bridge-ping-";

fn is_ping_id(id: &rmcp::model::RequestId) -> bool {
    matches!(id, rmcp::model::NumberOrString::String(s) if s.starts_with(PING_ID_PREFIX))
}

/// How to reach one upstream MCP server over Streamable HTTP.
///
/// Defaults a reader should know: no headers but those listed; no redirects, no proxy;
/// `http://` only to loopback.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpServer {
    /// The MCP endpoint (validated by [`check_url`]).
    pub url: String,
    /// Headers sent with every request to `url`, in configuration order.
    pub headers: Vec<HttpHeader>,
    /// Whether the configuration allowed `http://` to a host that is not loopback.
    pub allow_insecure_http: bool,
    /// Who answers for this connection (free text, part of the configuration digest).
    pub owner: Option<String>,
    /// Name of the credential scope the connection runs under (a reference, never a
    /// secret; part of the configuration digest).
    pub credential_scope: Option<String>,
}

/// One configured request header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpHeader {
    /// Header name as configured (compared case-insensitively).
    pub name: String,
    /// Where its value comes from.
    pub value: HeaderValueSource,
}

/// Where a header's value comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderValueSource {
    /// A literal, non-credential value from the configuration file.
    Literal(String),
    /// A named secret, sent as `prefix + value`.
    Secret {
        /// The `[secrets]` entry.
        name: String,
        /// Text before the value (e.g. `"Bearer "`); not secret.
        prefix: String,
        /// The secret's value (redacted in `Debug`).
        value: Secret,
    },
}

/// Headers the Streamable HTTP transport sets itself; a connection cannot set them.
const TRANSPORT_HEADERS: [&str; 10] = [
    "accept",
    "content-type",
    "content-length",
    "host",
    "last-event-id",
    "transfer-encoding",
    "connection",
    "upgrade",
    "te",
    "expect",
];

/// Header-name words that mark a credential (a literal value is refused for these).
const CREDENTIAL_WORDS: [&str; 7] = [
    "token",
    "key",
    "secret",
    "auth",
    "session",
    "password",
    "credential",
];

/// Checks `url` against the accepted forms (module docs).
///
/// # Errors
/// A sentence naming what is wrong, for the connection named `name`.
pub fn check_url(name: &str, url: &str, allow_insecure_http: bool) -> Result<()> {
    let parsed: http::Uri = url
        .parse()
        .map_err(|e| anyhow::anyhow!("connection `{name}`: url is not a valid URL: {e}"))?;
    let scheme = parsed.scheme_str().unwrap_or("");
    if scheme != "http" && scheme != "https" {
        bail!(
            "connection `{name}`: url must start with https:// (or http:// to a loopback host), got scheme `{scheme}`"
        );
    }
    let Some(authority) = parsed.authority() else {
        bail!("connection `{name}`: url has no host");
    };
    if authority.as_str().contains('@') {
        bail!(
            "connection `{name}`: url must not carry user-info (`user:password@`); put credentials in a header from a named secret"
        );
    }
    if url.contains('#') {
        bail!("connection `{name}`: url must not have a fragment");
    }
    let host = authority.host();
    if host.is_empty() {
        bail!("connection `{name}`: url has no host");
    }
    if scheme == "http" && !allow_insecure_http && !is_loopback_host(host) {
        bail!(
            "connection `{name}`: http:// is accepted only to a loopback host (127.0.0.1, ::1, localhost), got `{host}`; use https://, or set allow_insecure_http = true to send requests (and any credential headers) unencrypted"
        );
    }
    Ok(())
}

/// True for `localhost`, `127.0.0.0/8` and `::1` (brackets allowed): the hosts `http://`
/// may reach without `allow_insecure_http` ([`check_url`]).
#[must_use]
pub fn is_loopback_host(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if bare.eq_ignore_ascii_case("localhost") {
        return true;
    }
    bare.parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback())
}

/// Checks one configured header name and, for a literal, that it is no credential.
///
/// # Errors
/// A sentence naming the connection and the header.
pub fn check_header(name: &str, header: &str, literal: bool) -> Result<()> {
    if http::HeaderName::from_bytes(header.as_bytes()).is_err() {
        bail!("connection `{name}`: `{header}` is not a valid HTTP header name");
    }
    let lower = header.to_ascii_lowercase();
    if TRANSPORT_HEADERS.contains(&lower.as_str()) || lower.starts_with("mcp-") {
        bail!(
            "connection `{name}`: header `{header}` is set by the MCP transport and cannot be configured"
        );
    }
    if literal
        && (lower == "authorization"
            || lower == "proxy-authorization"
            || lower == "cookie"
            || CREDENTIAL_WORDS.iter().any(|w| lower.contains(w)))
    {
        bail!(
            "connection `{name}`: header `{header}` looks like a credential; its value must come from a named secret (`{{ secret = \"NAME\" }}` with the secret under [secrets]), not a literal in the configuration file"
        );
    }
    Ok(())
}

/// The configuration revision of an HTTP connection: `(digest, summary)`. Covers the URL,
/// each header's name with the secret it comes from (name and prefix) or its literal
/// value, `allow_insecure_http`, the credential scope and the owner. Never a secret's
/// value: rotating a secret is not a new revision.
pub fn http_identity(server: &HttpServer) -> (String, Value) {
    let headers: Vec<Value> = server
        .headers
        .iter()
        .map(|h| match &h.value {
            HeaderValueSource::Literal(v) => {
                json!({"name": h.name.to_ascii_lowercase(), "value": v})
            }
            HeaderValueSource::Secret { name, prefix, .. } => {
                json!({"name": h.name.to_ascii_lowercase(), "secret": name, "prefix": prefix})
            }
        })
        .collect();
    let summary = json!({
        "transport": "streamable-http",
        "url": server.url,
        "headers": headers,
        "allow_insecure_http": server.allow_insecure_http,
        "credential_scope": server.credential_scope,
        "owner": server.owner,
    });
    (airlock_core::canonical::canonical_digest(&summary), summary)
}

/// Installs rustls' `ring` provider as the process default, once (reqwest's rustls
/// backend is built without a provider of its own): before any reqwest client of the
/// process is built (the OTLP span exporter's too).
pub fn ensure_crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Another part of the process may have installed one already: that one stays.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// Builds rmcp's Streamable HTTP client transport for `server`: our own reqwest client
/// (no redirects, no proxy) and the configured headers, values marked sensitive.
/// `max_response_bytes` bounds one JSON response body or SSE event inside rmcp.
///
/// # Errors
/// The HTTP client cannot be built, or a header value is not a valid header value (the
/// error names the header, never its value).
fn transport(
    name: &str,
    server: &HttpServer,
    max_response_bytes: usize,
) -> Result<StreamableHttpClientTransport<reqwest::Client>> {
    ensure_crypto_provider();
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .connect_timeout(std::time::Duration::from_secs(10))
        .user_agent(concat!("airlock/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| anyhow::anyhow!("connection `{name}`: building the HTTP client: {e}"))?;
    let mut headers = HashMap::new();
    for h in &server.headers {
        let header = http::HeaderName::from_bytes(h.name.as_bytes())
            .map_err(|_| anyhow::anyhow!("connection `{name}`: invalid header `{}`", h.name))?;
        let mut value = match &h.value {
            HeaderValueSource::Literal(v) => http::HeaderValue::from_str(v),
            HeaderValueSource::Secret { prefix, value, .. } => {
                http::HeaderValue::from_str(&format!("{prefix}{}", value.0))
            }
        }
        .map_err(|_| {
            anyhow::anyhow!(
                "connection `{name}`: the value of header `{}` is not a valid header value (control characters or non-ASCII)",
                h.name
            )
        })?;
        value.set_sensitive(true);
        headers.insert(header, value);
    }
    let config = StreamableHttpClientTransportConfig::with_uri(server.url.clone())
        .custom_headers(headers)
        .max_json_response_size(max_response_bytes)
        .max_sse_event_size(max_response_bytes)
        .reinit_on_expired_session(false);
    Ok(StreamableHttpClientTransport::with_client(client, config))
}

/// The bridge's close reason when rmcp's client side ended first (not a server failure).
pub const CLIENT_CLOSED: &str = "the client closed the connection";

/// Why the bridge closed the connection, in the host's words (no header values).
pub type CloseReason = Arc<Mutex<Option<String>>>;

/// Runs rmcp's HTTP client transport for `server` behind a pair of byte streams carrying
/// newline-delimited JSON-RPC: `from_client` are the lines rmcp's client writes,
/// `to_client` receives the server's messages, one line each. Returns when either side
/// ends; `to_client` is then shut down (the connection reads as closed) and `reason`
/// says why.
///
/// # Errors
/// The transport cannot be built (see `transport`); nothing was started.
pub fn bridge(
    name: &str,
    server: &HttpServer,
    max_response_bytes: usize,
    from_client: impl AsyncRead + Unpin + Send + 'static,
    mut to_client: impl AsyncWrite + Unpin + Send + 'static,
    reason: CloseReason,
) -> Result<tokio::task::JoinHandle<()>> {
    let mut transport = transport(name, server, max_response_bytes)?;
    let (name, url) = (name.to_string(), server.url.clone());
    Ok(tokio::spawn(async move {
        let mut lines = BufReader::new(from_client).lines();
        // Sends run concurrently (a slow POST holds up no other), but they are polled by
        // this loop in one `FuturesUnordered`, whose first polls run in the order the
        // futures were pushed: each message enters rmcp's worker queue in the order its
        // line came, so `notifications/initialized` is never overtaken by the request
        // after it (one spawned task per send let the runtime reorder them: rmcp's worker
        // then posted `tools/list` where it waited for `initialized` and quit). A failed
        // send hands back the id of the request it carried and its method.
        let mut sends: FuturesUnordered<SendFuture> = FuturesUnordered::new();
        let mut ping =
            tokio::time::interval_at(tokio::time::Instant::now() + PING_INTERVAL, PING_INTERVAL);
        let mut pings: u64 = 0;
        let mut answered_once = false;
        let why = loop {
            tokio::select! {
                _ = ping.tick(), if answered_once => {
                    // Liveness: an HTTP server that went away says nothing until a request
                    // fails, so the bridge asks on its own. Its answers are not forwarded.
                    pings += 1;
                    let id = format!("{PING_ID_PREFIX}{pings}");
                    let request: ClientJsonRpcMessage = match serde_json::from_value(
                        json!({"jsonrpc": "2.0", "id": id, "method": "ping"}),
                    ) {
                        Ok(r) => r,
                        Err(_) => continue,
                    };
                    let send = transport.send(request);
                    sends.push(Box::pin(async move {
                        match send.await {
                            Ok(()) => (None, None, None),
                            Err(e) => (None, Some("ping".to_string()), Some(e.to_string())),
                        }
                    }));
                }
                line = lines.next_line() => {
                    let line = match line {
                        Ok(Some(line)) => line,
                        Ok(None) | Err(_) => break CLIENT_CLOSED.to_string(),
                    };
                    if line.trim().is_empty() {
                        continue;
                    }
                    let Some((message, id, method)) = outgoing(&name, &line) else {
                        continue;
                    };
                    let send = transport.send(message);
                    sends.push(Box::pin(async move {
                        match send.await {
                            Ok(()) => (None, None, None),
                            // Only the error's own text: rmcp's errors name the status and
                            // the URL, never a request header.
                            Err(e) => (id, method, Some(e.to_string())),
                        }
                    }));
                }
                message = transport.receive() => {
                    let Some(message) = message else {
                        // The POST that made the client stop usually says why: wait a
                        // moment for its answer.
                        let mut why = "the HTTP client stopped (the server went away or refused the session)".to_string();
                        let deadline = tokio::time::Instant::now() + std::time::Duration::from_millis(300);
                        while let Ok(Some(done)) = tokio::time::timeout_at(deadline, sends.next()).await {
                            if let (_, method, Some(error)) = done {
                                why = format!("{} to {url} failed: {}", method.as_deref().unwrap_or("a message"), bounded(&error));
                                break;
                            }
                        }
                        break why;
                    };
                    answered_once = true;
                    if let JsonRpcMessage::Response(r) = &message
                        && is_ping_id(&r.id)
                    {
                        continue;
                    }
                    if let JsonRpcMessage::Error(e) = &message
                        && e.id.as_ref().is_some_and(is_ping_id)
                    {
                        continue;
                    }
                    let Ok(mut text) = serde_json::to_vec(&message) else { continue };
                    text.push(b'\n');
                    if to_client.write_all(&text).await.is_err() {
                        break CLIENT_CLOSED.to_string();
                    }
                }
                Some(done) = sends.next(), if !sends.is_empty() => {
                    let (id, method, Some(error)) = done else { continue };
                    let error = bounded(&error);
                    let why = format!("{} to {url} failed: {error}", method.as_deref().unwrap_or("a message"));
                    match (id, method.as_deref()) {
                        (_, Some("server/discover" | "initialize")) | (None, _) => break why,
                        (Some(id), _) => {
                            // Answered at once (unavailable), then the connection closes:
                            // the host restarts it with backoff and re-snapshots it.
                            let text = unavailable(id, &url, &error);
                            let _ = to_client.write_all(&text).await;
                            break why;
                        }
                    }
                }
            }
        };
        tracing::debug!(connection = %name, "HTTP upstream bridge closed: {why}");
        *reason.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
        let _ = to_client.shutdown().await;
        let _ = transport.close().await;
    }))
}

/// One line rmcp's client wrote, read for sending: the message, and the id and method of
/// a request (to answer it if its send fails). `initialize` exists up to 2025-11-25 only,
/// and rmcp's default client info names the newest version, which has none (seen with
/// `initialize` alone, after a failed probe): such an `initialize` names the newest
/// version that has it. `None` for a line rmcp's types do not read (logged).
fn outgoing(
    name: &str,
    line: &str,
) -> Option<(ClientJsonRpcMessage, Option<Value>, Option<String>)> {
    let mut message: ClientJsonRpcMessage = match serde_json::from_str(line) {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(connection = %name, "HTTP bridge: an outgoing message rmcp's types do not read: {e}");
            return None;
        }
    };
    if let JsonRpcMessage::Request(r) = &mut message
        && let rmcp::model::ClientRequest::InitializeRequest(init) = &mut r.request
        && !init.params.protocol_version.has_initialize()
    {
        init.params.protocol_version = rmcp::model::ProtocolVersion::LATEST_WITH_INITIALIZE;
    }
    let (id, method) = match &message {
        JsonRpcMessage::Request(r) => (
            serde_json::to_value(&r.id).ok(),
            serde_json::to_value(&r.request)
                .ok()
                .and_then(|v| v.get("method").and_then(Value::as_str).map(str::to_string)),
        ),
        _ => (None, None),
    };
    Some((message, id, method))
}

/// The line answering request `id` whose send to `url` failed with `error`: a JSON-RPC
/// error ([`HTTP_TRANSPORT_ERROR_CODE`]) naming the failure, newline-terminated.
fn unavailable(id: Value, url: &str, error: &str) -> Vec<u8> {
    let answer = json!({
        "jsonrpc": "2.0",
        "id": id,
        "error": {
            "code": HTTP_TRANSPORT_ERROR_CODE,
            "message": format!("the HTTP request to {url} failed: {error}"),
        },
    });
    let mut text = answer.to_string().into_bytes();
    text.push(b'\n');
    text
}

/// An error's text, bounded. Errors from rmcp and reqwest name the status and the URL
/// (which is in the configuration anyway), never a request header.
fn bounded(error: &str) -> String {
    error.chars().take(400).collect()
}

/// The sha256 (hex) of `value`: what tests and logs may show of a header value.
pub fn value_digest(value: &str) -> String {
    hex::encode(sha2::Sha256::digest(value.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        check_url("a", "https://mcp.example.com/mcp", false).unwrap();
        check_url("a", "http://127.0.0.1:8080/mcp", false).unwrap();
        check_url("a", "http://127.9.9.9/mcp", false).unwrap();
        check_url("a", "http://[::1]:9/mcp", false).unwrap();
        check_url("a", "http://localhost:9/mcp", false).unwrap();
        check_url("a", "http://10.0.0.5/mcp", true).unwrap();
        let refused = |url: &str, needle: &str| {
            let e = check_url("a", url, false).unwrap_err().to_string();
            assert!(e.contains("connection `a`"), "{url}: {e}");
            assert!(e.contains(needle), "{url}: {e}");
        };
        refused("http://10.0.0.5/mcp", "allow_insecure_http = true");
        refused("http://example.com/mcp", "loopback");
        // A loopback-looking name that is not loopback.
        refused("http://127.0.0.1.example.com/mcp", "loopback");
        refused("http://localhost.evil.example/mcp", "loopback");
        refused("ftp://example.com/", "scheme `ftp`");
        refused("file:///etc/passwd", "");
        refused("ws://127.0.0.1/mcp", "scheme `ws`");
        refused("https://user:pw@example.com/mcp", "user-info");
        refused("https://example.com/mcp#frag", "fragment");
        refused("not a url", "not a valid URL");
        refused("/relative/path", "");
        refused("", "");
    }

    #[test]
    fn headers() {
        check_header("a", "X-Tenant", true).unwrap();
        check_header("a", "Authorization", false).unwrap();
        check_header("a", "X-Api-Key", false).unwrap();
        for literal in [
            "Authorization",
            "authorization",
            "Proxy-Authorization",
            "Cookie",
            "X-Api-Key",
            "X-Auth-Token",
            "X-Session",
            "X-Client-Secret",
        ] {
            let e = check_header("a", literal, true).unwrap_err().to_string();
            assert!(e.contains("named secret"), "{literal}: {e}");
        }
        for reserved in [
            "Accept",
            "content-type",
            "Host",
            "Mcp-Session-Id",
            "MCP-Protocol-Version",
            "mcp-method",
            "Last-Event-ID",
            "Transfer-Encoding",
        ] {
            let e = check_header("a", reserved, false).unwrap_err().to_string();
            assert!(e.contains("set by the MCP transport"), "{reserved}: {e}");
        }
        for bad in ["", "X Bad", "X:Y", "é"] {
            let e = check_header("a", bad, false).unwrap_err().to_string();
            assert!(e.contains("not a valid HTTP header name"), "{bad:?}: {e}");
        }
    }

    fn server(url: &str, scope: Option<&str>, secret: &str) -> HttpServer {
        HttpServer {
            url: url.into(),
            headers: vec![HttpHeader {
                name: "Authorization".into(),
                value: HeaderValueSource::Secret {
                    name: "notes-token".into(),
                    prefix: "Bearer ".into(),
                    value: Secret(secret.into()),
                },
            }],
            allow_insecure_http: false,
            owner: None,
            credential_scope: scope.map(str::to_string),
        }
    }

    #[test]
    fn identity_covers_url_and_scope_never_the_secret_value() {
        let base = http_identity(&server("https://a.example/mcp", Some("ro"), "s3cret-1"));
        let rotated = http_identity(&server("https://a.example/mcp", Some("ro"), "other-2"));
        assert_eq!(base.0, rotated.0, "a rotated secret is the same revision");
        assert!(!base.1.to_string().contains("s3cret-1"));
        let moved = http_identity(&server("https://b.example/mcp", Some("ro"), "s3cret-1"));
        assert_ne!(base.0, moved.0);
        let rescoped = http_identity(&server("https://a.example/mcp", Some("rw"), "s3cret-1"));
        assert_ne!(base.0, rescoped.0);
        let mut renamed = server("https://a.example/mcp", Some("ro"), "s3cret-1");
        if let HeaderValueSource::Secret { name, .. } = &mut renamed.headers[0].value {
            *name = "other-token".into();
        }
        assert_ne!(base.0, http_identity(&renamed).0);
    }

    #[test]
    fn debug_redacts_the_secret() {
        let shown = format!("{:?}", server("https://a.example/mcp", None, "s3cret-1"));
        assert!(!shown.contains("s3cret-1"), "{shown}");
        assert!(shown.contains("notes-token"), "{shown}");
    }

    #[test]
    fn an_invalid_secret_value_is_refused_without_showing_it() {
        let s = server("https://a.example/mcp", None, "line\nbreak-s3cret");
        let e = transport("a", &s, 1024).err().unwrap().to_string();
        assert!(e.contains("header `Authorization`"), "{e}");
        assert!(!e.contains("s3cret"), "{e}");
    }
}
