//! The Streamable HTTP front: `airlock serve --http [ADDR]`.
//!
//! Rule: **every request is checked in this order, and one that fails a check reaches
//! nothing behind it** — no MCP handler, no pipeline, no upstream:
//!
//! 1. `Host` must be an allowed host (DNS-rebinding protection; 400 when missing or
//!    malformed, 403 when not allowed); a present `Origin` must be an allowed origin (403).
//!    The spec makes both checks a MUST ("Servers MUST validate the Origin header on all
//!    incoming connections", Streamable HTTP, 2025-11-25 and 2026-07-28); without
//!    `allowed_origins` the allowed origins are the loopback ones and the audience's.
//! 2. The path: `/mcp` (the MCP endpoint), `/.well-known/oauth-protected-resource` and
//!    `/.well-known/oauth-protected-resource/mcp` (RFC 9728 metadata, `GET` only, when
//!    `[http.auth]` is set), `/metrics` (Prometheus text, `GET`; [`crate::metrics`]),
//!    `/console/…` when `console = true` ([`crate::console`], which authenticates its
//!    people itself: a login session, or the same bearer tokens); anything else is 404.
//! 3. With `[http.auth]`: a verified bearer token ([`super::auth`]; 401 / 403 with
//!    `WWW-Authenticate`). Its principal (subject, roles, profile) must be allowed its
//!    profile by policy (`use-profile`, checked on every request; 403 with the reason).
//!    Without `[http.auth]` (loopback addresses only) the principal is `[requester]`.
//! 4. A legacy MCP session (`Mcp-Session-Id`) must belong to the request's principal
//!    (403), and be one this front opened (else 404, as for an expired session).
//! 5. A declared `Content-Length` over `max_body_bytes` is 413 before any body byte is
//!    read; rmcp enforces the same ceiling while streaming a body without one.
//!
//! **Legacy sessions end.** A 2025-11-25 MCP session unused for `session_idle` is closed;
//! a principal holds at most `max_sessions_per_principal` of them, and opening one more
//! closes its least recently used one that has no request in flight (a session whose
//! answer is still being written is never closed to make room; when every one has one,
//! the new session is refused with 429 and `Retry-After: 1`). Each opening and each end is traced
//! (`mcp-session-opened`, `mcp-session-ended` with why), and while any is open the count
//! is logged at INFO once a minute. A request for an ended session gets 404, so the
//! client initializes again (Streamable HTTP, "Session Management").
//!
//! Then rmcp's [`StreamableHttpService`] serves the request: 2026-07-28 requests
//! statelessly, 2025-11-25 clients in sessions (`legacy_session_mode`), and the status
//! codes of the Streamable HTTP transport (405 for `GET`/`DELETE` on the stateless
//! endpoint, 406/415 for wrong `Accept`/`Content-Type`, 400 for an `MCP-Protocol-Version`
//! that contradicts the body, 404 for an unknown session).
//!
//! **Sessions.** The Airlock [`Session`] (references, offered catalogue, approvals) is bound
//! per principal — (subject, roles, profile) — and cached here (at most
//! [`MAX_CACHED_PRINCIPALS`], least recently used evicted): a reference minted in one
//! stateless request resolves in the next request of the same principal, and never for
//! another. rmcp builds one handler per legacy session or per stateless request; the
//! verified principal reaches it through the request's extensions (rmcp copies the
//! `http::request::Parts`, extensions included, into the MCP request's extensions).
//!
//! The client's bearer token goes no further than this module: it is not in the
//! principal, the session, the trace, or anything an upstream receives.
//!
//! Accepted form (`[http]` in the serve configuration):
//!
//! ```toml
//! [http]
//! allowed_hosts = ["localhost", "127.0.0.1", "::1"]  # default: these, plus the host of
//!                                # [http.auth] audience; "host" = any port, "host:port"
//! allowed_origins = ["https://app.example.com"]      # default: http(s)://localhost,
//!                                # 127.0.0.1 and [::1] on any port, plus the origin of
//!                                # [http.auth] audience; "scheme://host[:port]" or
//!                                # "scheme://host:*"; [] = any request with an Origin is
//!                                # refused (no browser may call)
//! max_body_bytes = 4194304       # request body ceiling (default 4 MiB, at most 64 MiB)
//! session_idle = "5m"            # a legacy MCP session unused this long is closed
//!                                # (default 5 minutes; 1 s to 24 h)
//! max_sessions_per_principal = 16  # legacy sessions one principal holds; one more
//!                                # closes its least recently used (default 16; 1 to 1024)
//! console = true                 # serve the operator console under /console (default
//!                                # false); with [http.auth] people log in with their
//!                                # bearer tokens and policy decides what each may do,
//!                                # without it a one-time login link is printed at start
//!
//! [http.auth]                    # see crate::front::auth
//! ```
//!
//! hyper's HTTP/1.1 server is used directly (no axum): there are five fixed paths, and
//! rmcp's service takes a plain `http::Request`, so a router would add only dependencies.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt as _, Full, combinators::BoxBody};
use rmcp::ErrorData as McpError;
use rmcp::service::{RequestContext, RoleServer};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use serde::Deserialize;

use super::McpFront;
use super::auth::{AuthSettings, RawAuth, Rejection, Verifier};
use crate::config::ServeConfig;
use crate::host::Host;
use crate::pipeline::session::{Requester, Session};
use crate::policy::Verdict;

/// The address `--http` without a value binds.
pub const DEFAULT_ADDR: &str = "127.0.0.1:8787";

/// The MCP endpoint's path.
pub const MCP_PATH: &str = "/mcp";

/// The RFC 9728 well-known path (also served with [`MCP_PATH`] appended).
pub const METADATA_PATH: &str = "/.well-known/oauth-protected-resource";

/// Default request body ceiling (`max_body_bytes`).
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 * 1024 * 1024;

/// The largest `max_body_bytes` a configuration may set.
pub const MAX_MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

/// Most principals whose sessions are kept at once.
pub const MAX_CACHED_PRINCIPALS: usize = 1024;

/// Default `session_idle`.
pub const DEFAULT_SESSION_IDLE: Duration = Duration::from_secs(300);

/// Default `max_sessions_per_principal`.
pub const DEFAULT_MAX_SESSIONS_PER_PRINCIPAL: usize = 16;

/// The largest `max_sessions_per_principal` a configuration may set.
pub const MAX_MAX_SESSIONS_PER_PRINCIPAL: usize = 1024;

/// How often the count of open legacy sessions is logged while any is open.
const SESSION_COUNT_LOG_INTERVAL: Duration = Duration::from_secs(60);

/// The header-size ceiling of one request (hyper answers 431 above it).
const MAX_HEADER_BYTES: usize = 64 * 1024;

/// The response header naming a legacy MCP session.
const SESSION_HEADER: &str = "mcp-session-id";

/// `[http]` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHttp {
    allowed_hosts: Option<Vec<String>>,
    allowed_origins: Option<Vec<String>>,
    max_body_bytes: Option<u64>,
    session_idle: Option<String>,
    max_sessions_per_principal: Option<u64>,
    console: Option<bool>,
    auth: Option<RawAuth>,
}

/// `[http]`, checked (every field at its default when the table is absent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpSettings {
    /// `Host` values accepted; `None` = loopback names plus the audience's host.
    pub allowed_hosts: Option<Vec<String>>,
    /// `Origin` values accepted when present; `None` = the loopback origins plus the
    /// audience's (see [`Self::effective_allowed_origins`]); empty = none.
    pub allowed_origins: Option<Vec<String>>,
    /// Request body ceiling in bytes.
    pub max_body_bytes: usize,
    /// A legacy MCP session unused this long is closed.
    pub session_idle: Duration,
    /// Legacy MCP sessions one principal holds at once.
    pub max_sessions_per_principal: usize,
    /// Whether the operator console is served under `/console` ([`crate::console`]).
    pub console: bool,
    /// `[http.auth]`: bearer tokens required; `None` = loopback only, as `[requester]`.
    pub auth: Option<AuthSettings>,
}

impl Default for HttpSettings {
    fn default() -> Self {
        Self {
            allowed_hosts: None,
            allowed_origins: None,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            session_idle: DEFAULT_SESSION_IDLE,
            max_sessions_per_principal: DEFAULT_MAX_SESSIONS_PER_PRINCIPAL,
            console: false,
            auth: None,
        }
    }
}

impl HttpSettings {
    /// Checks `[http]` (absent: the defaults), resolving paths against `base`.
    ///
    /// # Errors
    /// A host or origin entry that does not parse, a body ceiling of 0 or above
    /// [`MAX_MAX_BODY_BYTES`], a bad `[http.auth]` (see [`AuthSettings::from_raw`]).
    pub fn from_raw(raw: Option<RawHttp>, base: &Path) -> Result<Self> {
        let Some(raw) = raw else {
            return Ok(Self::default());
        };
        if let Some(hosts) = &raw.allowed_hosts {
            for h in hosts {
                parse_authority(h).with_context(|| {
                    format!("[http] allowed_hosts entry `{h}`: expected `host` or `host:port`")
                })?;
            }
        }
        for o in raw.allowed_origins.iter().flatten() {
            parse_origin(o).with_context(|| {
                format!(
                    "[http] allowed_origins entry `{o}`: expected `scheme://host`, `scheme://host:port` or `scheme://host:*`"
                )
            })?;
        }
        let max_body_bytes = match raw.max_body_bytes {
            None => DEFAULT_MAX_BODY_BYTES,
            Some(n) if n == 0 || n > MAX_MAX_BODY_BYTES as u64 => {
                bail!("[http] max_body_bytes {n} must be between 1 and {MAX_MAX_BODY_BYTES}")
            }
            Some(n) => n as usize,
        };
        let session_idle = match &raw.session_idle {
            None => DEFAULT_SESSION_IDLE,
            Some(text) => {
                let d = humantime::parse_duration(text).with_context(|| {
                    format!("[http] session_idle `{text}`: expected a duration such as \"5m\" or \"90s\"")
                })?;
                if d < Duration::from_secs(1) || d > Duration::from_secs(24 * 3600) {
                    bail!("[http] session_idle `{text}` must be between 1s and 24h");
                }
                d
            }
        };
        let max_sessions_per_principal = match raw.max_sessions_per_principal {
            None => DEFAULT_MAX_SESSIONS_PER_PRINCIPAL,
            Some(n) if n == 0 || n > MAX_MAX_SESSIONS_PER_PRINCIPAL as u64 => bail!(
                "[http] max_sessions_per_principal {n} must be between 1 and {MAX_MAX_SESSIONS_PER_PRINCIPAL}"
            ),
            Some(n) => n as usize,
        };
        let auth = raw
            .auth
            .map(|a| AuthSettings::from_raw(a, base))
            .transpose()?;
        Ok(Self {
            allowed_hosts: raw.allowed_hosts,
            allowed_origins: raw.allowed_origins,
            max_body_bytes,
            session_idle,
            max_sessions_per_principal,
            console: raw.console.unwrap_or(false),
            auth,
        })
    }

    /// The `Origin` values accepted when a request carries one: as configured, else
    /// `http://` and `https://` for `localhost`, `127.0.0.1` and `[::1]` on any port,
    /// and the origin (`scheme://host[:port]`) of the audience. Each entry is lower-cased
    /// and its scheme's default port dropped, as `normalize_origin` does.
    pub fn effective_allowed_origins(&self) -> Vec<String> {
        if let Some(origins) = &self.allowed_origins {
            return origins.iter().map(|o| normalize_origin(o)).collect();
        }
        let mut origins = Vec::new();
        for scheme in ["http", "https"] {
            for host in ["localhost", "127.0.0.1", "[::1]"] {
                origins.push(format!("{scheme}://{host}:*"));
            }
        }
        if let Some(origin) = self
            .auth
            .as_ref()
            .and_then(|a| a.audience.parse::<http::Uri>().ok())
            .and_then(|u| Some(format!("{}://{}", u.scheme_str()?, u.authority()?)))
        {
            let origin = normalize_origin(&origin);
            if !origins.contains(&origin) {
                origins.push(origin);
            }
        }
        origins
    }

    /// The `Host` values accepted: as configured, else `localhost`, `127.0.0.1`, `::1`
    /// and the host of the audience.
    pub fn effective_allowed_hosts(&self) -> Vec<String> {
        if let Some(hosts) = &self.allowed_hosts {
            return hosts.clone();
        }
        let mut hosts: Vec<String> = ["localhost", "127.0.0.1", "::1"]
            .into_iter()
            .map(String::from)
            .collect();
        if let Some(host) = self
            .auth
            .as_ref()
            .and_then(|a| a.audience.parse::<http::Uri>().ok())
            .and_then(|u| {
                u.host()
                    .map(|h| h.trim_matches(['[', ']']).to_ascii_lowercase())
            })
            && !hosts.contains(&host)
        {
            hosts.push(host);
        }
        hosts
    }
}

/// The principal a request acts for, as the HTTP front bound it (in the request's
/// extensions, where the MCP handler finds it).
#[derive(Clone)]
pub struct BoundPrincipal {
    /// Identifies (subject, roles, profile).
    key: Arc<str>,
    session: Arc<Session>,
}

/// The per-request binding of an HTTP [`McpFront`]: the principal its first request named
/// (a legacy session keeps serving only that one).
#[derive(Clone, Default)]
pub(super) struct PerRequest {
    first: Arc<OnceLock<Arc<str>>>,
}

impl McpFront {
    /// A front whose session is the one the HTTP front bound to each request.
    fn http(host: Arc<Host>) -> Self {
        Self {
            host,
            session: super::Bound::Http(PerRequest::default()),
            ended: super::EndsWithFront::new(),
        }
    }
}

impl PerRequest {
    /// The session the HTTP front bound to the request of `context`.
    ///
    /// # Errors
    /// The request carries no bound principal (cannot happen behind [`serve`]), or a legacy
    /// session's request names another principal than its first.
    pub(super) fn session(
        &self,
        context: &RequestContext<RoleServer>,
    ) -> Result<Arc<Session>, McpError> {
        let bound = context
            .extensions
            .get::<http::request::Parts>()
            .and_then(|p| p.extensions.get::<BoundPrincipal>())
            .ok_or_else(|| McpError::internal_error("the request has no principal", None))?;
        let first = self.first.get_or_init(|| bound.key.clone());
        if *first != bound.key {
            return Err(McpError::invalid_request(
                "this MCP session belongs to another principal",
                None,
            ));
        }
        Ok(bound.session.clone())
    }
}

type Body = BoxBody<Bytes, Infallible>;

/// The answer to an `initialize` that would exceed `max` legacy sessions while each of
/// the principal's sessions has a request in flight: 429 with `Retry-After: 1` (RFC 6585
/// §4, RFC 9110 §10.2.3); nothing of the new session is kept.
fn too_many_sessions(max: usize) -> Response<Body> {
    let mut response = plain(
        StatusCode::TOO_MANY_REQUESTS,
        &format!(
            "Too Many Requests: this principal already holds {max} MCP sessions, each with a \
             request in flight (max_sessions_per_principal); retry when one has answered"
        ),
    );
    response.headers_mut().insert(
        header::RETRY_AFTER,
        hyper::header::HeaderValue::from_static("1"),
    );
    response
}

/// A response that ends a request before the MCP endpoint (boxed: it is the error side
/// of the checks).
type Refusal = Box<Response<Body>>;

/// The running HTTP front.
struct HttpFront {
    host: Arc<Host>,
    verifier: Option<Arc<Verifier>>,
    /// The operator console under `/console` (`[http] console = true`).
    console: Option<Arc<crate::console::Console>>,
    /// Without `[http.auth]`: the one session, of `[requester]` over `http`.
    fixed: Option<BoundPrincipal>,
    /// The profile of a token that names none.
    default_profile: Option<String>,
    allowed_hosts: Vec<(String, Option<u16>)>,
    allowed_origins: Vec<String>,
    max_body_bytes: usize,
    mcp: StreamableHttpService<McpFront, LocalSessionManager>,
    sessions_manager: Arc<LocalSessionManager>,
    principals: Mutex<lru::LruCache<Arc<str>, Arc<Session>>>,
    /// Legacy MCP session id → who opened it and when it was last used.
    legacy: Mutex<HashMap<String, LegacySession>>,
    /// `[http] session_idle`.
    session_idle: Duration,
    /// `[http] max_sessions_per_principal`.
    max_sessions_per_principal: usize,
}

/// A legacy MCP session this front opened.
struct LegacySession {
    /// The principal that opened it (only it may use it).
    owner: Arc<str>,
    /// Its requester's name, for the trace.
    requester: String,
    opened: std::time::Instant,
    last_used: std::time::Instant,
    /// Its `POST` requests whose answer is not yet written out (the body of each response
    /// holds an [`InFlight`]; a `GET` stream is not counted): a session with one is never
    /// closed to make room.
    in_flight: Arc<std::sync::atomic::AtomicUsize>,
}

/// One request of a legacy session whose response is still being written: counted in its
/// session's `in_flight` from before rmcp sees the request until the response body is
/// dropped (sent, or the client went away).
struct InFlight(Arc<std::sync::atomic::AtomicUsize>);

impl InFlight {
    fn start(count: &Arc<std::sync::atomic::AtomicUsize>) -> Self {
        count.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Self(count.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// Why a legacy MCP session ended (traced).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SessionEnd {
    /// The client sent `DELETE`.
    Deleted,
    /// Unused for `session_idle`.
    Idle,
    /// Its principal opened one more than `max_sessions_per_principal`; it was the least
    /// recently used.
    Evicted,
    /// rmcp no longer has it (its transport ended).
    Gone,
}

impl SessionEnd {
    fn as_str(self) -> &'static str {
        match self {
            Self::Deleted => "deleted",
            Self::Idle => "idle",
            Self::Evicted => "evicted",
            Self::Gone => "gone",
        }
    }
}

/// The trace's name for a legacy session: the sha256 of its id (the id is a credential).
fn session_digest(id: &str) -> String {
    use sha2::Digest as _;
    hex::encode(sha2::Sha256::digest(id.as_bytes()))
}

/// Loads `config`, starts the host, and serves MCP over HTTP on `addr` until the process
/// is stopped. Prints `airlock: serving MCP over HTTP at http://ADDR/mcp` to stderr once
/// listening. `profile` is the profile of a principal whose token names none (else
/// `default_profile`, else the only profile).
///
/// # Errors
/// `addr` does not parse or bind; a non-loopback `addr` without `[http.auth]`; the JWKS
/// does not load; the host does not start; without `[http.auth]`, policy does not let
/// `[requester]` use the profile.
pub async fn serve(config: ServeConfig, addr: &str, profile: Option<String>) -> Result<()> {
    // From here on SIGTERM/SIGINT stop the host cleanly (crate::shutdown).
    crate::shutdown::catch_signals();
    let addr: SocketAddr = addr.parse().with_context(|| {
        format!("--http `{addr}`: expected an address such as {DEFAULT_ADDR} or [::1]:8787")
    })?;
    let settings = config.http.clone();
    if settings.auth.is_none() && !addr.ip().is_loopback() {
        bail!(
            "refusing to serve HTTP on {addr} without [http.auth]: anyone who reaches that address would act as requester `{}`. Configure [http.auth] (bearer tokens) or bind a loopback address such as {DEFAULT_ADDR}",
            config.requester.name
        );
    }
    if let Some(p) = &profile {
        config.profile(Some(p))?;
    }
    let verifier = settings
        .auth
        .clone()
        .map(Verifier::load)
        .transpose()?
        .map(Arc::new);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let metrics = crate::metrics::bind(&config).await?;
    let host = Host::start(&config).await?;
    crate::registry::reload::spawn_background(&host)?;
    crate::metrics::spawn(metrics, host.live());
    let mut front = HttpFront::new(host, &settings, verifier, profile)?;
    let local = listener.local_addr()?;
    let mut console_login = None;
    if settings.console {
        let checkpoints = crate::registry::anchor::checkpoint_path(front.host.config());
        front.console = Some(match &front.verifier {
            Some(v) => crate::console::Console::for_people(front.host.clone(), v.clone())
                .with_checkpoints(checkpoints),
            None => {
                let operator = format!("{} (console)", crate::config::os_user_name());
                let (console, token) =
                    crate::console::Console::new(front.host.registry().clone(), operator);
                console_login = Some(token);
                console
                    .with_checkpoints(checkpoints)
                    .in_host(front.host.clone())
            }
        });
    }
    tracing::info!(
        %local,
        auth = front.verifier.is_some(),
        "serving MCP over HTTP"
    );
    eprintln!("airlock: serving MCP over HTTP at http://{local}{MCP_PATH}");
    if front.console.is_some() {
        match console_login {
            Some(token) => {
                eprintln!(
                    "airlock: console at http://{local}{}/login?token={token}",
                    crate::console::PREFIX
                );
                eprintln!("airlock: open that link once to log in; it is printed only here");
            }
            None => eprintln!(
                "airlock: console at http://{local}{}/ (log in with a bearer token)",
                crate::console::PREFIX
            ),
        }
    }
    let front = Arc::new(front);
    HttpFront::sweep_sessions(&front);
    let live = front.host.live().clone();
    let host = front.host.clone();
    // Serves until SIGTERM/SIGINT; then the calls in flight drain and every upstream
    // process group is stopped (crate::shutdown::run); the last spans are exported.
    let served = crate::shutdown::run(&live, accept(listener, front)).await;
    host.flush_spans().await;
    served
}

/// Accepts HTTP/1.1 connections on `listener` and serves each on its own task, forever.
async fn accept(listener: tokio::net::TcpListener, front: Arc<HttpFront>) -> Result<()> {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                // Out of descriptors and the like: wait instead of spinning.
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let front = front.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let front = front.clone();
                async move { Ok::<_, Infallible>(front.handle(req).await) }
            });
            let served = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(Duration::from_secs(30))
                .max_buf_size(MAX_HEADER_BYTES)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
            if let Err(e) = served {
                tracing::debug!(%peer, "HTTP connection ended: {e}");
            }
        });
    }
}

impl HttpFront {
    fn new(
        host: Arc<Host>,
        settings: &HttpSettings,
        verifier: Option<Arc<Verifier>>,
        default_profile: Option<String>,
    ) -> Result<Self> {
        let fixed = if verifier.is_none() {
            let r = &host.config().requester;
            let requester = Requester {
                name: r.name.clone(),
                roles: r.roles.clone(),
                transport: "http",
            };
            let session = host.open_principal_session(requester, default_profile.as_deref())?;
            Some(BoundPrincipal {
                key: Arc::from(principal_key(
                    &session.requester().name,
                    &session.requester().roles,
                    &session.profile().name,
                )),
                session,
            })
        } else {
            None
        };
        let hosts = settings.effective_allowed_hosts();
        let allowed_hosts = hosts
            .iter()
            .map(|h| parse_authority(h))
            .collect::<Result<Vec<_>>>()?;
        // `json_response`: a 2026-07-28 (stateless) request answered by one message gets it
        // as an `application/json` body, not as a one-event `text/event-stream` (a client
        // must accept both, Streamable HTTP, "Sending Messages to the Server"); a handler
        // that sends a notification or request first still streams, so nothing is lost.
        // Sessions (2025-11-25) keep their streams.
        let mut rmcp_config = StreamableHttpServerConfig::default()
            .with_json_response(true)
            .with_legacy_session_mode(true)
            .with_allowed_hosts(hosts)
            .with_max_request_body_bytes(settings.max_body_bytes);
        let allowed_origins = settings.effective_allowed_origins();
        // rmcp checks the same list again, where a port-less entry would mean any port:
        // it gets the scheme's default port spelled out. An empty list would turn its
        // check off; ours refuses every Origin then.
        if !allowed_origins.is_empty() {
            rmcp_config = rmcp_config
                .with_allowed_origins(allowed_origins.iter().map(|o| with_default_port(o)));
        }
        // rmcp's own idle timer is a backstop behind ours (`sweep_sessions`), which traces.
        let mut sessions_manager = LocalSessionManager::default();
        sessions_manager.session_config.keep_alive =
            Some(settings.session_idle + Duration::from_secs(60));
        let sessions_manager = Arc::new(sessions_manager);
        let for_factory = host.clone();
        let mcp = StreamableHttpService::new(
            move || Ok(McpFront::http(for_factory.clone())),
            sessions_manager.clone(),
            rmcp_config,
        );
        Ok(Self {
            host,
            verifier,
            console: None,
            fixed,
            default_profile,
            allowed_hosts,
            allowed_origins,
            max_body_bytes: settings.max_body_bytes,
            mcp,
            sessions_manager,
            principals: Mutex::new(lru::LruCache::new(
                NonZeroUsize::new(MAX_CACHED_PRINCIPALS).expect("non-zero"),
            )),
            legacy: Mutex::default(),
            session_idle: settings.session_idle,
            max_sessions_per_principal: settings.max_sessions_per_principal,
        })
    }

    async fn handle(&self, mut req: Request<hyper::body::Incoming>) -> Response<Body> {
        if let Err(r) = self.check_host_and_origin(&req) {
            return *r;
        }
        let path = req.uri().path();
        if path == METADATA_PATH || path == format!("{METADATA_PATH}{MCP_PATH}") {
            return self.metadata(req.method());
        }
        if let Some(console) = &self.console
            && (path == crate::console::PREFIX
                || path.starts_with(&format!("{}/", crate::console::PREFIX)))
        {
            return console.handle(req).await.map(|b| b.boxed());
        }
        if path == crate::metrics::PATH {
            // The same bearer check as the MCP endpoint: metrics name no person, but
            // they say what the host serves and how busy it is.
            if let Err(r) = self.principal(&req) {
                return *r;
            }
            self.count_sessions();
            return crate::metrics::respond(self.host.live(), req.method(), path)
                .await
                .map(|b| b.boxed());
        }
        if path != MCP_PATH {
            return plain(StatusCode::NOT_FOUND, "Not Found");
        }
        let bound = match self.principal(&req) {
            Ok(b) => b,
            Err(r) => return *r,
        };
        let session_id = req
            .headers()
            .get(SESSION_HEADER)
            .map(|v| v.to_str().map(str::to_string));
        let mut in_flight: Option<InFlight> = None;
        match &session_id {
            None => {}
            Some(Err(_)) => {
                return plain(
                    StatusCode::BAD_REQUEST,
                    "Bad Request: invalid Mcp-Session-Id",
                );
            }
            Some(Ok(id)) => {
                let owner = self
                    .legacy
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_mut(id)
                    .map(|s| {
                        s.last_used = std::time::Instant::now();
                        // A POST carries a request whose answer follows (a GET is the
                        // session's standing stream, not an answer). Counted under the
                        // lock that eviction takes: a session is never chosen between
                        // this request's lookup and its start.
                        let started =
                            (req.method() == Method::POST).then(|| InFlight::start(&s.in_flight));
                        (s.owner.clone(), started)
                    });
                let owner = owner.map(|(owner, guard)| {
                    in_flight = guard;
                    owner
                });
                match owner {
                    None => return plain(StatusCode::NOT_FOUND, "Not Found: Session not found"),
                    Some(owner) if owner != bound.key => {
                        tracing::warn!(requester = %bound.session.requester().name, "refused a request for another principal's MCP session");
                        return plain(
                            StatusCode::FORBIDDEN,
                            "Forbidden: this MCP session belongs to another principal",
                        );
                    }
                    Some(_) => {}
                }
            }
        }
        if let Some(len) = req.headers().get(header::CONTENT_LENGTH) {
            match len.to_str().ok().and_then(|l| l.parse::<u64>().ok()) {
                Some(n) if n > self.max_body_bytes as u64 => {
                    return plain(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        &format!(
                            "Payload Too Large: request body exceeds {} bytes",
                            self.max_body_bytes
                        ),
                    );
                }
                Some(_) => {}
                None => {
                    return plain(
                        StatusCode::BAD_REQUEST,
                        "Bad Request: invalid Content-Length",
                    );
                }
            }
        }
        let key = bound.key.clone();
        let requester = bound.session.requester().name.clone();
        let deleting = req.method() == Method::DELETE;
        req.extensions_mut().insert(bound);
        let response = self.mcp.handle(req).await;
        // The session's request stays in flight until its response body is dropped.
        let response = match in_flight {
            None => response,
            Some(guard) => response.map(|body| {
                body.map_frame(move |frame| {
                    let _ = &guard;
                    frame
                })
                .boxed()
            }),
        };
        match session_id {
            None => {
                let opened = response
                    .headers()
                    .get(SESSION_HEADER)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned);
                if let Some(id) = opened
                    && !self.remember_session(&id, key, requester).await
                {
                    return too_many_sessions(self.max_sessions_per_principal);
                }
            }
            Some(Ok(id)) if deleting && response.status().is_success() => {
                let ended = self
                    .legacy
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&id);
                if let Some(s) = ended {
                    self.trace_end(&id, &s, SessionEnd::Deleted);
                }
            }
            Some(_) => {}
        }
        response
    }

    /// Records a new legacy session `id` of principal `key` (traced); when the principal
    /// then holds more than `max_sessions_per_principal`, closes its least recently used
    /// session that has no request in flight. When every other one has a request in
    /// flight, closes the new one instead and returns `false` (the caller answers 429):
    /// closing a session with a request in flight would leave that request unanswered.
    /// Past [`MAX_CACHED_PRINCIPALS`] records, forgets those rmcp no longer has.
    async fn remember_session(&self, id: &str, key: Arc<str>, requester: String) -> bool {
        let now = std::time::Instant::now();
        // `Err(n)`: the principal's `n` sessions all have a request in flight.
        let (evicted, crowded) = {
            let mut legacy = self.legacy.lock().unwrap_or_else(|e| e.into_inner());
            let own: Vec<(String, std::time::Instant, usize)> = legacy
                .iter()
                .filter(|(_, s)| s.owner == key)
                .map(|(id, s)| {
                    let busy = s.in_flight.load(std::sync::atomic::Ordering::Acquire);
                    (id.clone(), s.last_used, busy)
                })
                .collect();
            let evicted = if own.len() >= self.max_sessions_per_principal {
                match own
                    .iter()
                    .filter(|(_, _, busy)| *busy == 0)
                    .min_by_key(|(_, used, _)| *used)
                {
                    Some((oldest, _, _)) => Ok(legacy.remove(oldest).map(|s| (oldest.clone(), s))),
                    None => Err(own.len()),
                }
            } else {
                Ok(None)
            };
            if evicted.is_ok() {
                legacy.insert(
                    id.to_string(),
                    LegacySession {
                        owner: key.clone(),
                        requester: requester.clone(),
                        opened: now,
                        last_used: now,
                        in_flight: Arc::default(),
                    },
                );
            }
            (evicted, legacy.len() > MAX_CACHED_PRINCIPALS)
        };
        let evicted = match evicted {
            Ok(evicted) => evicted,
            Err(busy) => {
                self.close(id).await;
                tracing::warn!(
                    requester = %requester,
                    sessions = busy,
                    "refused a new legacy MCP session: every session of this principal has a request in flight (max_sessions_per_principal)"
                );
                return false;
            }
        };
        self.host.registry().trace(
            crate::registry::events::MCP_SESSION_OPENED,
            &session_digest(id),
            serde_json::json!({"requester": &requester}),
        );
        if let Some((old, s)) = evicted {
            self.close(&old).await;
            self.trace_end(&old, &s, SessionEnd::Evicted);
        }
        if crowded {
            self.forget_gone().await;
        }
        self.count_sessions();
        true
    }

    /// Sets the metrics' count of open legacy sessions (`airlock_mcp_sessions`).
    fn count_sessions(&self) {
        let open = self.legacy.lock().unwrap_or_else(|e| e.into_inner()).len();
        self.host.registry().metrics().set_sessions(open);
    }

    /// Closes legacy session `id` in rmcp (its worker stops; a later request is 404).
    async fn close(&self, id: &str) {
        use rmcp::transport::streamable_http_server::session::SessionManager as _;
        let id: rmcp::transport::streamable_http_server::session::SessionId = Arc::from(id);
        if let Err(e) = self.sessions_manager.close_session(&id).await {
            tracing::debug!("closing an MCP session rmcp no longer had: {e}");
        }
    }

    /// Traces the end of legacy session `id` (already removed from the front's map).
    fn trace_end(&self, id: &str, s: &LegacySession, why: SessionEnd) {
        tracing::debug!(requester = %s.requester, why = why.as_str(), "legacy MCP session ended");
        self.count_sessions();
        self.host.registry().trace(
            crate::registry::events::MCP_SESSION_ENDED,
            &session_digest(id),
            serde_json::json!({
                "requester": &s.requester,
                "why": why.as_str(),
                "open_ms": s.opened.elapsed().as_millis() as u64,
            }),
        );
    }

    /// Forgets (and traces) the legacy sessions rmcp no longer has.
    async fn forget_gone(&self) {
        let live: std::collections::HashSet<String> = self
            .sessions_manager
            .sessions
            .read()
            .await
            .keys()
            .map(|k| k.to_string())
            .collect();
        let gone: Vec<(String, LegacySession)> = {
            let mut legacy = self.legacy.lock().unwrap_or_else(|e| e.into_inner());
            let ids: Vec<String> = legacy
                .keys()
                .filter(|id| !live.contains(*id))
                .cloned()
                .collect();
            ids.into_iter()
                .filter_map(|id| legacy.remove(&id).map(|s| (id, s)))
                .collect()
        };
        for (id, s) in gone {
            self.trace_end(&id, &s, SessionEnd::Gone);
        }
    }

    /// Closes the legacy sessions unused for `session_idle`, forgets those rmcp lost, and
    /// logs how many are open once a minute while any is: every quarter of `session_idle`
    /// (at most every 15 s), until the front is dropped.
    fn sweep_sessions(front: &Arc<Self>) {
        let weak = Arc::downgrade(front);
        let every =
            (front.session_idle / 4).clamp(Duration::from_millis(250), Duration::from_secs(15));
        tokio::spawn(async move {
            let mut logged = std::time::Instant::now();
            loop {
                tokio::time::sleep(every).await;
                let Some(front) = weak.upgrade() else { return };
                let idle: Vec<(String, LegacySession)> = {
                    let mut legacy = front.legacy.lock().unwrap_or_else(|e| e.into_inner());
                    let ids: Vec<String> = legacy
                        .iter()
                        .filter(|(_, s)| s.last_used.elapsed() >= front.session_idle)
                        .map(|(id, _)| id.clone())
                        .collect();
                    ids.into_iter()
                        .filter_map(|id| legacy.remove(&id).map(|s| (id, s)))
                        .collect()
                };
                for (id, s) in idle {
                    front.close(&id).await;
                    front.trace_end(&id, &s, SessionEnd::Idle);
                }
                front.forget_gone().await;
                if logged.elapsed() >= SESSION_COUNT_LOG_INTERVAL {
                    logged = std::time::Instant::now();
                    let (open, principals) = {
                        let legacy = front.legacy.lock().unwrap_or_else(|e| e.into_inner());
                        let owners: std::collections::HashSet<&Arc<str>> =
                            legacy.values().map(|s| &s.owner).collect();
                        (legacy.len(), owners.len())
                    };
                    if open > 0 {
                        tracing::info!(open, principals, "legacy MCP sessions open");
                    }
                }
            }
        });
    }

    fn check_host_and_origin<B>(&self, req: &Request<B>) -> Result<(), Refusal> {
        let host = match req.headers().get(header::HOST) {
            Some(h) => h.to_str().ok().and_then(|h| parse_authority(h).ok()),
            None => req
                .uri()
                .authority()
                .and_then(|a| parse_authority(a.as_str()).ok()),
        };
        let Some((name, port)) = host else {
            return Err(Box::new(plain(
                StatusCode::BAD_REQUEST,
                "Bad Request: missing or invalid Host header",
            )));
        };
        let allowed = self
            .allowed_hosts
            .iter()
            .any(|(h, p)| *h == name && p.is_none_or(|p| Some(p) == port));
        if !allowed {
            tracing::warn!(host = %name, "refused a request whose Host is not allowed (DNS rebinding?)");
            return Err(Box::new(plain(
                StatusCode::FORBIDDEN,
                "Forbidden: Host header is not allowed",
            )));
        }
        if let Some(origin) = req.headers().get(header::ORIGIN) {
            let ok = origin
                .to_str()
                .ok()
                .map(normalize_origin)
                .is_some_and(|o| origin_allowed(&o, &self.allowed_origins));
            if !ok {
                tracing::warn!(origin = ?origin, "refused a request whose Origin is not allowed");
                return Err(Box::new(plain(
                    StatusCode::FORBIDDEN,
                    "Forbidden: Origin header is not allowed",
                )));
            }
        }
        Ok(())
    }

    fn metadata(&self, method: &Method) -> Response<Body> {
        let Some(v) = &self.verifier else {
            return plain(StatusCode::NOT_FOUND, "Not Found");
        };
        if method != Method::GET {
            let mut r = plain(StatusCode::METHOD_NOT_ALLOWED, "Method Not Allowed");
            r.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("GET"));
            return r;
        }
        let body = serde_json::to_vec(&v.metadata()).expect("metadata serializes");
        Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::CACHE_CONTROL, "max-age=300")
            .body(Full::new(Bytes::from(body)).boxed())
            .expect("valid response")
    }

    /// The principal of `req`, its session opened (or found) and allowed its profile.
    fn principal<B>(&self, req: &Request<B>) -> Result<BoundPrincipal, Refusal> {
        let Some(verifier) = &self.verifier else {
            let fixed = self
                .fixed
                .clone()
                .expect("a fixed principal without [http.auth]");
            // Policy may have changed since the session was opened.
            let profile = &fixed.session.profile().name;
            let d = self
                .host
                .policy()
                .may_use_profile(fixed.session.principal(), profile);
            if d.verdict != Verdict::Allow {
                return Err(Box::new(plain(
                    StatusCode::FORBIDDEN,
                    &format!(
                        "Forbidden: policy does not let requester `{}` use profile `{profile}`",
                        fixed.session.requester().name
                    ),
                )));
            }
            return Ok(fixed);
        };
        let verified = verifier
            .verify(req.headers().get(header::AUTHORIZATION))
            .map_err(|r| {
                tracing::info!(reason = %r.describe(), "refused a request's bearer token");
                Box::new(challenge(verifier, &r))
            })?;
        let config = self.host.config();
        let profile = match verified
            .profile
            .as_deref()
            .or(self.default_profile.as_deref())
        {
            Some(p) if config.profiles.contains_key(p) => p.to_string(),
            Some(p) => {
                return Err(Box::new(plain(
                    StatusCode::FORBIDDEN,
                    &format!("Forbidden: profile `{p}` is not offered here"),
                )));
            }
            None => match config.profile(None) {
                Ok(p) => p.name.clone(),
                Err(_) => {
                    return Err(Box::new(plain(
                        StatusCode::FORBIDDEN,
                        "Forbidden: the token names no profile and this Airlock has no default profile",
                    )));
                }
            },
        };
        let key: Arc<str> = Arc::from(principal_key(&verified.subject, &verified.roles, &profile));
        let forbidden = || {
            plain(
                StatusCode::FORBIDDEN,
                &format!(
                    "Forbidden: policy does not let requester `{}` use profile `{profile}`",
                    verified.subject
                ),
            )
        };
        let cached = self
            .principals
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
            .cloned();
        if let Some(session) = cached {
            // Policy may have changed since the session was opened.
            let d = self
                .host
                .policy()
                .may_use_profile(session.principal(), &profile);
            if d.verdict != Verdict::Allow {
                self.principals
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .pop(&key);
                return Err(Box::new(forbidden()));
            }
            return Ok(BoundPrincipal { key, session });
        }
        let requester = Requester {
            name: verified.subject.clone(),
            roles: verified.roles.clone(),
            transport: "http",
        };
        let session = self
            .host
            .open_principal_session(requester, Some(&profile))
            .map_err(|e| {
                tracing::info!(requester = %verified.subject, %profile, "refused a session: {e:#}");
                Box::new(forbidden())
            })?;
        // Two first requests of one principal may race; keep the session that won.
        let session = self
            .principals
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert(key.clone(), || session)
            .clone();
        Ok(BoundPrincipal { key, session })
    }
}

/// (subject, roles, profile) as one cache key; NUL cannot occur in any of them.
fn principal_key(subject: &str, roles: &[String], profile: &str) -> String {
    format!("{subject}\u{0}{}\u{0}{profile}", roles.join("\u{1}"))
}

fn plain(status: StatusCode, text: &str) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "text/plain; charset=utf-8")
        .body(Full::new(Bytes::from(format!("{text}\n"))).boxed())
        .expect("valid response")
}

fn challenge(verifier: &Verifier, rejection: &Rejection) -> Response<Body> {
    let mut r = plain(rejection.status(), &rejection.describe());
    if let Ok(v) = HeaderValue::from_str(&verifier.challenge(rejection)) {
        r.headers_mut().insert(header::WWW_AUTHENTICATE, v);
    }
    r
}

/// `host` or `host:port` (IPv6 in brackets, or bare `::1`), lower-cased, brackets dropped.
pub(crate) fn parse_authority(text: &str) -> Result<(String, Option<u16>)> {
    if text.parse::<std::net::Ipv6Addr>().is_ok() {
        return Ok((text.to_ascii_lowercase(), None));
    }
    let a: http::uri::Authority = text.parse().context("not an authority")?;
    if a.as_str().contains('@') {
        bail!("user information is not allowed");
    }
    // `port_u16` alone would read `+80` as 80 (`u16::from_str`): only digits are a port.
    if a.as_str().len() > a.host().len()
        && (a.port_u16().is_none()
            || a.port()
                .is_some_and(|p| !p.as_str().bytes().all(|b| b.is_ascii_digit())))
    {
        bail!("the port is not a number");
    }
    let host = a.host().trim_matches(['[', ']']).to_ascii_lowercase();
    if host.is_empty() {
        bail!("empty host");
    }
    Ok((host, a.port_u16()))
}

/// Checks an `allowed_origins` entry.
pub(crate) fn parse_origin(text: &str) -> Result<()> {
    if text.chars().any(|c| c.is_whitespace() || c.is_control()) {
        bail!("an origin has no spaces or control characters");
    }
    let (scheme, rest) = text.split_once("://").context("no scheme")?;
    if scheme.is_empty() || rest.contains('/') {
        bail!("not an origin");
    }
    let rest = rest.strip_suffix(":*").unwrap_or(rest);
    // `http://::1:80` could be the host `::1` on port 80 or the host `::1:80`: an IPv6
    // host is written in brackets (RFC 6454 §6.2 serializes it so).
    if rest.contains(':') && !rest.starts_with('[') && rest.matches(':').count() > 1 {
        bail!("an IPv6 host must be written in brackets, e.g. `http://[::1]:*`");
    }
    parse_authority(rest).map(|_| ())
}

/// An origin as compared: lower-cased (scheme and host are case-insensitive, RFC 6454
/// §4), with the scheme's default port (`:80` for `http`, `:443` for `https`) dropped,
/// so `https://app.test:443` and `https://app.test` are one origin. Nothing is trimmed:
/// the HTTP parser already dropped the header value's surrounding spaces, and an origin
/// with a control character in it is no origin an entry names (found by the jwt fuzz
/// target: `"\rhttp://localhost:5173"`, trimmed, passed `http://localhost:*`).
pub(crate) fn normalize_origin(origin: &str) -> String {
    let o = origin.to_ascii_lowercase();
    let default_port = if o.starts_with("http://") {
        ":80"
    } else if o.starts_with("https://") {
        ":443"
    } else {
        return o;
    };
    // Only a port that is the authority's one: `http://localhost:5:80` keeps its `:80`
    // (found by the jwt fuzz target: dropped, it read as `http://localhost:5`).
    match o.strip_suffix(default_port) {
        Some(rest) if rest.split_once("://").is_some_and(|(_, a)| !has_port(a)) => rest.to_string(),
        _ => o,
    }
}

/// Whether an authority (`host`, `host:port`, `[v6]`, `[v6]:port`) writes a port, or
/// anything after a colon.
fn has_port(authority: &str) -> bool {
    match authority.rsplit_once(']') {
        Some((_, after)) => after.contains(':'),
        None => authority.contains(':'),
    }
}

/// A normalized origin entry with its scheme's default port written out (`:*` entries
/// and entries with a port are unchanged): the form rmcp reads as that one port.
fn with_default_port(entry: &str) -> String {
    let Some((scheme, authority)) = entry.split_once("://") else {
        return entry.to_string();
    };
    let has_port = has_port(authority);
    match scheme {
        "http" if !has_port => format!("{entry}:80"),
        "https" if !has_port => format!("{entry}:443"),
        _ => entry.to_string(),
    }
}

/// Whether `origin` (normalized) is an entry of `allowed` (normalized): equal, or equal
/// up to the port for a `:*` entry.
pub(crate) fn origin_allowed(origin: &str, allowed: &[String]) -> bool {
    allowed.iter().any(|a| match a.strip_suffix(":*") {
        Some(prefix) => {
            origin == prefix
                || origin
                    .strip_prefix(prefix)
                    .and_then(|p| p.strip_prefix(':'))
                    .is_some_and(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        }
        None => origin == a,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authorities_and_origins_parse_strictly() {
        assert_eq!(
            parse_authority("LocalHost:8787").unwrap(),
            ("localhost".into(), Some(8787))
        );
        assert_eq!(
            parse_authority("[::1]:80").unwrap(),
            ("::1".into(), Some(80))
        );
        assert_eq!(parse_authority("::1").unwrap(), ("::1".into(), None));
        for bad in ["", "a b", "user@host", "host:port", "http://x"] {
            assert!(parse_authority(bad).is_err(), "{bad}");
        }
        assert!(parse_origin("https://app.example.com").is_ok());
        assert!(parse_origin("http://localhost:*").is_ok());
        for bad in [
            "app.example.com",
            "https://a/b",
            "://a",
            "http://::1:*",
            "http://::1",
        ] {
            assert!(parse_origin(bad).is_err(), "{bad}");
        }
        let allowed = vec![
            "https://app.test".to_string(),
            "http://localhost:*".to_string(),
        ];
        assert!(origin_allowed("https://app.test", &allowed));
        assert!(origin_allowed("http://localhost:3000", &allowed));
        assert!(origin_allowed("http://localhost", &allowed));
        let allowed: Vec<String> = ["https://App.Test:443", "http://[::1]:*"]
            .iter()
            .map(|o| normalize_origin(o))
            .collect();
        assert_eq!(allowed[0], "https://app.test");
        for good in [
            "https://app.test",
            "HTTPS://APP.TEST:443",
            "http://[::1]:5173",
        ] {
            assert!(origin_allowed(&normalize_origin(good), &allowed), "{good}");
        }
        // Found by the jwt fuzz target: a default port after another one is not dropped.
        assert_eq!(
            normalize_origin("http://localhost:5:80"),
            "http://localhost:5:80"
        );
        assert!(!origin_allowed(
            &normalize_origin("http://localhost:5:80"),
            &["http://localhost:*".to_string()]
        ));
        assert_eq!(normalize_origin("http://[::1]:80"), "http://[::1]");
        // Found by the jwt fuzz target: surrounding control characters are not trimmed
        // into a passing origin, and an entry cannot hold them.
        for bad in [
            "\rhttp://localhost:5173",
            "http://localhost:5173\n",
            " http://localhost",
        ] {
            assert!(
                !origin_allowed(&normalize_origin(bad), &["http://localhost:*".to_string()]),
                "{bad:?}"
            );
        }
        assert!(parse_origin(" http://localhost:*").is_err());
        assert!(parse_origin("http://localhost:*\t").is_err());
        for bad in [
            "https://app.test:8443",
            "http://app.test",
            "http://[::1]:",
            "http://[::1]:5173:80",
            "https://app.test:1:443",
        ] {
            assert!(!origin_allowed(&normalize_origin(bad), &allowed), "{bad}");
        }
        assert_eq!(
            with_default_port("https://app.test"),
            "https://app.test:443"
        );
        assert_eq!(with_default_port("http://[::1]"), "http://[::1]:80");
        assert_eq!(with_default_port("http://[::1]:*"), "http://[::1]:*");
        assert_eq!(
            with_default_port("http://a.test:8080"),
            "http://a.test:8080"
        );
        for bad in [
            "https://app.test.evil",
            "http://localhost.evil:3000",
            "http://localhost:",
            "null",
        ] {
            assert!(!origin_allowed(bad, &allowed), "{bad}");
        }
    }

    /// The rule the `jwt` fuzz target's Host mode asserts (the port is the one written):
    /// `u16::from_str` alone reads `+80` as 80.
    #[test]
    fn a_port_is_digits_only() {
        for bad in ["localhost:+80", "[::1]:+8787", "a:+0"] {
            assert!(parse_authority(bad).is_err(), "{bad}");
        }
        assert_eq!(
            parse_authority("localhost:0080").unwrap(),
            ("localhost".into(), Some(80))
        );
    }

    #[test]
    fn settings_default_and_refuse() {
        let base = Path::new("/etc/airlock");
        let s = HttpSettings::from_raw(None, base).unwrap();
        assert_eq!(s.max_body_bytes, DEFAULT_MAX_BODY_BYTES);
        assert_eq!(
            s.effective_allowed_hosts(),
            ["localhost", "127.0.0.1", "::1"]
        );
        let parse = |t: &str| {
            let raw: RawHttp = toml::from_str(t).unwrap();
            HttpSettings::from_raw(Some(raw), base)
        };
        assert!(parse("max_body_bytes = 0").is_err());
        assert!(parse("max_body_bytes = 1000000000").is_err());
        assert_eq!(
            (s.session_idle, s.max_sessions_per_principal),
            (DEFAULT_SESSION_IDLE, DEFAULT_MAX_SESSIONS_PER_PRINCIPAL)
        );
        for bad in [
            "session_idle = \"0s\"",
            "session_idle = \"25h\"",
            "session_idle = \"soon\"",
            "session_idle = 5",
            "max_sessions_per_principal = 0",
            "max_sessions_per_principal = 1025",
            "max_sessions_per_principal = -1",
        ] {
            let refused = toml::from_str::<RawHttp>(bad)
                .map_err(anyhow::Error::from)
                .and_then(|raw| HttpSettings::from_raw(Some(raw), base));
            assert!(refused.is_err(), "{bad}");
        }
        let s = parse("session_idle = \"24h\"\nmax_sessions_per_principal = 1024").unwrap();
        assert_eq!(
            (s.session_idle, s.max_sessions_per_principal),
            (Duration::from_secs(24 * 3600), 1024),
            "the ceilings themselves are accepted"
        );
        let s = parse("session_idle = \"1s\"").unwrap();
        assert_eq!(s.session_idle, Duration::from_secs(1));
        assert!(parse("allowed_hosts = [\"a b\"]").is_err());
        assert!(parse("allowed_origins = [\"example.com\"]").is_err());
        let s = parse(
            "[auth]\nissuer = \"https://i.test\"\naudience = \"https://Airlock.Test/mcp\"\njwks_file = \"k.json\"\n",
        )
        .unwrap();
        assert_eq!(
            s.effective_allowed_hosts(),
            ["localhost", "127.0.0.1", "::1", "airlock.test"]
        );
        let origins = s.effective_allowed_origins();
        assert!(
            origins.contains(&"https://airlock.test".to_string()),
            "{origins:?}"
        );
        assert!(
            origins.contains(&"http://localhost:*".to_string()),
            "{origins:?}"
        );
        assert!(
            origins.contains(&"https://[::1]:*".to_string()),
            "{origins:?}"
        );
        assert_eq!(origins.len(), 7, "{origins:?}");
        assert_eq!(
            parse("allowed_origins = []")
                .unwrap()
                .effective_allowed_origins(),
            Vec::<String>::new(),
            "an empty list stays empty: every Origin is refused"
        );
        assert!(toml::from_str::<RawHttp>("unknown = 1").is_err());
    }
}
