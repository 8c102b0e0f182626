//! The operator console (issue 31): web pages over the same store any process reads,
//! where a person decides what waits for a person. It serves the **approvals inbox**, the
//! **held intents**, **connections** (with mappings, what waits and the trace's head), the
//! **mappings** ([`mappings`]: the four questions, drift side by side, grants, approve and
//! retire) and the **trace** ([`trace`]: each call's life, verification; [`audit`]: a
//! run's audit package), from `airlock console` or under `/console` of `airlock serve --http` when `[http]
//! console = true`.
//!
//! Rules:
//! - **Who is acting.** Two ways in, fixed when the console starts:
//!   - *Loopback, one-time login* (`airlock console`; `serve --http` without
//!     `[http.auth]`): the console binds a loopback address and prints a login URL with a
//!     random one-time token (32 bytes, hex); following it once opens a console session
//!     and spends the token. The person is the operating-system user running the console,
//!     recorded as `USER (console)` — the same person who could run the CLI — and policy
//!     is not asked (the CLI does not ask it either).
//!   - *People by bearer token* (`serve --http` with `[http.auth]`): a person logs in by
//!     posting the same bearer token the MCP endpoint takes (checked by
//!     [`crate::front::auth::Verifier`]: issuer, audience, signature, expiry, scopes), or
//!     sends it as `Authorization: Bearer` on each request (a script). The person is the
//!     token's `sub` in the roles of its roles claim, recorded as `SUB (console)`, and
//!     **Cedar decides everything they do** with them as principal
//!     ([`crate::policy::PolicyEngine::may_act`]): `view` on every page (a person policy
//!     does not let view cannot log in: a valid MCP token alone is not enough),
//!     `approve`, `resolve-intent`, `review`, `retire`; a refusal is `403` naming the
//!     policies that decided, and changes nothing. A login session ends when the token
//!     expires, or after [`SESSION_MAX`]; one person holds at most
//!     [`MAX_SESSIONS_PER_PERSON`] (a login beyond ends their oldest), the console at most
//!     [`MAX_SESSIONS`]. A `401` carries `WWW-Authenticate: Bearer
//!     realm="airlock-console"`; the cookie is `Secure` when the audience is `https://`.
//! - **Sessions** are a random id in the cookie `airlock_console` (`HttpOnly;
//!   SameSite=Strict; Path=/console`). A page without a session is `401` with a page
//!   saying how to log in.
//! - **Every state change is a `POST`** carrying the session's CSRF token (a hidden form
//!   field, compared in constant time) from this origin: a request whose `Origin` is
//!   another origin, or whose `Sec-Fetch-Site` is `cross-site` or `same-site`, is refused
//!   before anything is read from the store (`403`). A request that carries its bearer
//!   token itself needs no CSRF token (a browser never attaches one to a cross-site
//!   request). Forms work without JavaScript; the pages load none.
//! - **Strict headers on every answer**: `Content-Security-Policy: default-src 'none';
//!   style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none';
//!   base-uri 'none'` (the grants page: its inline stylesheet's hash instead of `'self'`),
//!   `X-Content-Type-Options: nosniff`, `Referrer-Policy: same-origin`,
//!   `Cache-Control: no-store`, `X-Frame-Options: DENY`.
//! - **Everything shown is escaped** (maud escapes every interpolated string): approval
//!   summaries, capability and requester names are upstream- or client-derived and hostile.
//!   Nothing secret is rendered (approvals hold digests, not arguments; a login token is
//!   never shown or logged).
//! - **A decision is the CLI's decision** ([`crate::decisions::decide`]): a row the trace
//!   does not prove is neither offered nor decided; the decision is traced with the
//!   person's identity.

pub mod audit;
pub mod mappings;
mod pages;
pub mod trace;

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::Incoming;
use subtle::ConstantTimeEq as _;

use crate::front::auth::Verifier;
use crate::host::Host;
use crate::policy::{ConsoleSubject, Principal, Verdict};
use crate::registry::Registry;
use crate::store::{ApprovalDecision, ApprovalState};

/// Where the console's pages live (the same path under `serve --http`).
pub const PREFIX: &str = "/console";
/// The console session cookie's name.
pub const COOKIE: &str = "airlock_console";
/// The default listen address of `airlock console`.
pub const DEFAULT_ADDR: &str = "127.0.0.1:8788";
/// The largest form body read (16 KiB): a decision is a few short fields.
pub const MAX_FORM_BYTES: usize = 16 * 1024;
/// How long a receipt approved in the console lives (as `airlock approvals approve`'s
/// default).
pub const RECEIPT_TTL: Duration = Duration::from_secs(15 * 60);
/// The most pending approvals one page lists.
pub const PAGE: usize = 200;

/// The longest a console login session lasts (8 hours), however long its token is valid.
pub const SESSION_MAX: Duration = Duration::from_secs(8 * 3600);
/// Most console sessions open at once; a login beyond it is refused until one expires.
pub const MAX_SESSIONS: usize = 4096;
/// Most console sessions one person holds; a login beyond it ends their oldest, so no one
/// token holder can take every slot.
pub const MAX_SESSIONS_PER_PERSON: usize = 8;

/// The `Content-Security-Policy` of every answer (module rules).
pub const CSP: &str = "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// One console's state: the store, how people log in, open sessions.
pub struct Console {
    registry: Registry,
    access: Access,
    /// Open console sessions by id.
    sessions: Mutex<HashMap<String, Session>>,
    /// The checkpoint file whose newest line the connections page shows.
    checkpoints: Option<std::path::PathBuf>,
    /// The serving host this console runs in (`serve --http`): its policy, live catalogue
    /// and configuration.
    host: Option<Arc<Host>>,
    /// The serve configuration (`airlock console --config`), when not in a host.
    config: Option<Arc<crate::config::ServeConfig>>,
    /// Whether the session cookie carries `Secure` (people reach this Airlock over
    /// HTTPS: its audience is an `https://` URL).
    secure_cookie: bool,
}

/// How people log in (module rules).
enum Access {
    /// The one-time login token until it is spent; every session acts as `operator`.
    OneTime {
        login: Mutex<Option<String>>,
        operator: Arc<Person>,
    },
    /// Bearer tokens of `[http.auth]`; the host's policy decides each action.
    Bearer { verifier: Arc<Verifier> },
}

/// The person behind a console session.
struct Person {
    /// As decisions record it: `USER (console)` or `SUB (console)`.
    recorded: String,
    /// The Cedar principal (a token's subject and roles, transport `console`); `None` for
    /// the loopback operator, whom policy is not asked about.
    principal: Option<Principal>,
}

/// A console session (after the login).
#[derive(Clone)]
struct Session {
    csrf: String,
    person: Arc<Person>,
    /// When it ends (ms since the epoch); `u64::MAX`: with the process.
    expires_ms: u64,
    /// When it was opened (ms since the epoch).
    opened_ms: u64,
    /// The request carried its bearer token: no CSRF token is needed.
    bearer: bool,
}

/// 32 random bytes as 64 hex digits.
fn random_token() -> String {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).expect("the OS random generator failed");
    hex::encode(bytes)
}

/// Whether `a` and `b` are equal, in time independent of where they differ.
fn same_secret(a: &str, b: &str) -> bool {
    a.len() == b.len() && bool::from(a.as_bytes().ct_eq(b.as_bytes()))
}

type Body = Full<Bytes>;

impl Console {
    /// A loopback console over `registry`, deciding as `operator`; returns it with its
    /// one-time login token.
    pub fn new(registry: Registry, operator: impl Into<String>) -> (Arc<Self>, String) {
        let token = random_token();
        let console = Arc::new(Self {
            registry,
            access: Access::OneTime {
                login: Mutex::new(Some(token.clone())),
                operator: Arc::new(Person {
                    recorded: operator.into(),
                    principal: None,
                }),
            },
            sessions: Mutex::default(),
            checkpoints: None,
            host: None,
            config: None,
            secure_cookie: false,
        });
        (console, token)
    }

    /// A console of `host` where people log in with bearer tokens `verifier` accepts, and
    /// the host's policy decides what each may do (module rules).
    pub fn for_people(host: Arc<Host>, verifier: Arc<Verifier>) -> Arc<Self> {
        let secure_cookie = verifier.settings().audience.starts_with("https://");
        Arc::new(Self {
            secure_cookie,
            registry: host.registry().clone(),
            access: Access::Bearer { verifier },
            sessions: Mutex::default(),
            checkpoints: None,
            host: Some(host),
            config: None,
        })
    }

    /// The same console, in the serving host `host` (its policy, catalogue and
    /// configuration feed the mapping pages).
    ///
    /// # Panics
    /// When the console is shared already (call it right after [`Console::new`]).
    pub fn in_host(mut self: Arc<Self>, host: Arc<Host>) -> Arc<Self> {
        Arc::get_mut(&mut self)
            .expect("set before the console is shared")
            .host = Some(host);
        self
    }

    /// The same console, knowing the serve configuration `config` (the mapping pages'
    /// grants and approvals read it).
    ///
    /// # Panics
    /// When the console is shared already (call it right after [`Console::new`]).
    pub fn with_config(
        mut self: Arc<Self>,
        config: Option<crate::config::ServeConfig>,
    ) -> Arc<Self> {
        Arc::get_mut(&mut self)
            .expect("set before the console is shared")
            .config = config.map(Arc::new);
        self
    }

    /// The serve configuration: the host's, else the one given.
    fn config(&self) -> Option<&crate::config::ServeConfig> {
        self.host
            .as_ref()
            .map(|h| h.config())
            .or(self.config.as_deref())
    }

    /// The same console, showing the newest line of the checkpoint file `file`.
    ///
    /// # Panics
    /// When the console is shared already (call it right after [`Console::new`]).
    pub fn with_checkpoints(mut self: Arc<Self>, file: Option<std::path::PathBuf>) -> Arc<Self> {
        Arc::get_mut(&mut self)
            .expect("set before the console is shared")
            .checkpoints = file;
        self
    }

    /// Answers one request (see the module rules).
    pub async fn handle(self: &Arc<Self>, req: Request<Incoming>) -> Response<Body> {
        let (parts, body) = req.into_parts();
        let path = parts.uri.path().to_string();
        let Some(rest) = path.strip_prefix(PREFIX) else {
            return page(
                StatusCode::NOT_FOUND,
                pages::message("Not found", "Nothing here: the console is at /console/."),
            );
        };
        let rest = rest.trim_end_matches('/');
        match (&parts.method, rest) {
            (&Method::GET, "/login") => self.login(parts.uri.query()),
            (&Method::POST, "/login") => {
                if let Some(why) = cross_site(&parts.headers) {
                    return page(StatusCode::FORBIDDEN, pages::message("Refused", &why));
                }
                match read_form(body).await {
                    Ok(form) => self.login_with_token(form.get("token").map(String::as_str)),
                    Err(e) => page(
                        StatusCode::BAD_REQUEST,
                        pages::message("Bad form", &format!("{e:#}")),
                    ),
                }
            }
            (&Method::GET, "/console.css") => {
                let mut r = Response::new(Full::new(Bytes::from_static(pages::CSS.as_bytes())));
                r.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("text/css; charset=utf-8"),
                );
                secure(r)
            }
            (&Method::GET, "" | "/approvals") => match self.session(&parts.headers) {
                Some(Ok(s)) => self.inbox(&s, parts.uri.query()),
                Some(Err(r)) => *r,
                None => self.not_logged_in(),
            },
            (&Method::GET, "/connections") => match self.session(&parts.headers) {
                Some(Err(r)) => *r,
                Some(Ok(_)) => {
                    match crate::status::read(&self.registry, self.checkpoints.as_deref(), 0) {
                        Ok(mut s) => {
                            // The console lives on: the backlog now, not at its start.
                            if let Ok(now) = self.registry.store().journal_backlog_bytes() {
                                s.trace.journal_backlog_bytes = now;
                            }
                            let extra = self.connection_extras(&s);
                            page(StatusCode::OK, pages::connections(&s, &extra))
                        }
                        Err(e) => store_unavailable(&e),
                    }
                }
                None => self.not_logged_in(),
            },
            (&Method::GET, r) if r == "/trace" || r.starts_with("/trace/") => {
                match self.session(&parts.headers) {
                    Some(Ok(_)) => self.trace(r, parts.uri.query()),
                    Some(Err(r)) => *r,
                    None => self.not_logged_in(),
                }
            }
            (&Method::GET, r) if r == "/mappings" || r.starts_with("/mappings/") => {
                match self.session(&parts.headers) {
                    Some(Ok(s)) => self.mappings(&s, r, parts.uri.query()),
                    Some(Err(r)) => *r,
                    None => self.not_logged_in(),
                }
            }
            (&Method::GET, "/intents") => match self.session(&parts.headers) {
                Some(Ok(s)) => self.held(&s, parts.uri.query()),
                Some(Err(r)) => *r,
                None => self.not_logged_in(),
            },
            (&Method::POST, r)
                if r.starts_with("/approvals/")
                    || r.starts_with("/intents/")
                    || r.starts_with("/mappings/") =>
            {
                if let Some(why) = cross_site(&parts.headers) {
                    return page(StatusCode::FORBIDDEN, pages::message("Refused", &why));
                }
                let session = match self.session(&parts.headers) {
                    Some(Ok(s)) => s,
                    Some(Err(r)) => return *r,
                    None => return self.not_logged_in(),
                };
                let form = match read_form(body).await {
                    Ok(f) => f,
                    Err(e) => {
                        return page(
                            StatusCode::BAD_REQUEST,
                            pages::message("Bad form", &format!("{e:#}")),
                        );
                    }
                };
                if !session.bearer
                    && !form
                        .get("csrf")
                        .is_some_and(|t| same_secret(t, &session.csrf))
                {
                    return page(
                        StatusCode::FORBIDDEN,
                        pages::message(
                            "Refused",
                            "the form did not carry this console session's token; reload the page and decide again",
                        ),
                    );
                }
                if let Some(name) = r.strip_prefix("/mappings/") {
                    return self.review(&session, name, &form);
                }
                match r.strip_prefix("/approvals/") {
                    Some(id) => self.decide(&session, id, &form),
                    None => self.resolve(&session, &r["/intents/".len()..], &form),
                }
            }
            (&Method::GET | &Method::POST, _) => page(
                StatusCode::NOT_FOUND,
                pages::message("Not found", "No such console page."),
            ),
            _ => {
                let mut r = page(
                    StatusCode::METHOD_NOT_ALLOWED,
                    pages::message("Not allowed", "The console answers GET and POST only."),
                );
                r.headers_mut()
                    .insert(header::ALLOW, HeaderValue::from_static("GET, POST"));
                r
            }
        }
    }

    /// `GET /console/login[?token=…]`: with the one-time token, spends it for a session
    /// cookie; for a console of people, the form that takes a bearer token.
    fn login(&self, query: Option<&str>) -> Response<Body> {
        let (login, operator) = match &self.access {
            Access::OneTime { login, operator } => (login, operator),
            Access::Bearer { .. } => return page(StatusCode::OK, pages::token_login(None)),
        };
        let offered = query_value(query, "token");
        let mut login = login.lock().unwrap_or_else(|e| e.into_inner());
        let valid = match (&*login, &offered) {
            (Some(expected), Some(given)) => same_secret(expected, given),
            _ => false,
        };
        if !valid {
            return page(
                StatusCode::FORBIDDEN,
                pages::message(
                    "Login refused",
                    "This login link is wrong or was already used. A console (airlock console, airlock demo --console, or airlock serve --http with [http] console = true) prints one login link when it starts, usable once; start it again for a new one.",
                ),
            );
        }
        *login = None;
        drop(login);
        self.open_session(operator.clone(), u64::MAX)
    }

    /// `POST /console/login` with the form field `token`: a console of people opens a
    /// session for the person the bearer token names.
    fn login_with_token(&self, token: Option<&str>) -> Response<Body> {
        let Access::Bearer { verifier, .. } = &self.access else {
            return page(
                StatusCode::NOT_FOUND,
                pages::message(
                    "Not found",
                    "This console logs in with the link it printed when it started.",
                ),
            );
        };
        let token = token.map(str::trim).unwrap_or("");
        let verified = HeaderValue::from_str(&format!("Bearer {token}"))
            .map_err(|_| crate::front::auth::Rejection::Invalid("not a token".into()))
            .and_then(|h| verifier.verify(Some(&h)));
        match verified {
            Ok(v) => {
                let expires_ms = session_expiry(v.expires_s, crate::store::now_ms());
                match person_of(&v) {
                    Ok(person) => {
                        if let Some(why) = self.may_not_view(&person) {
                            tracing::info!(person = %v.subject, %why, "console login refused by policy");
                            return page(
                                StatusCode::FORBIDDEN,
                                pages::token_login(Some(&format!(
                                    "{} may not view the console: {why}",
                                    v.subject
                                ))),
                            );
                        }
                        tracing::info!(person = %v.subject, "console login");
                        self.open_session(Arc::new(person), expires_ms)
                    }
                    Err(e) => page(
                        StatusCode::FORBIDDEN,
                        pages::token_login(Some(&format!("{e:#}"))),
                    ),
                }
            }
            Err(r) => {
                tracing::info!(reason = %r.describe(), "refused a console login");
                challenged(page(r.status(), pages::token_login(Some(&r.describe()))))
            }
        }
    }

    /// Opens a session for `person` until `expires_ms` and answers with its cookie and
    /// the inbox.
    fn open_session(&self, person: Arc<Person>, expires_ms: u64) -> Response<Body> {
        let now = crate::store::now_ms();
        let id = random_token();
        {
            let mut sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
            sessions.retain(|_, s| s.expires_ms > now);
            let mine: Vec<(u64, String)> = sessions
                .iter()
                .filter(|(_, s)| s.person.recorded == person.recorded)
                .map(|(k, s)| (s.opened_ms, k.clone()))
                .collect();
            if mine.len() >= MAX_SESSIONS_PER_PERSON
                && let Some((_, oldest)) = mine.into_iter().min()
            {
                sessions.remove(&oldest);
            }
            if sessions.len() >= MAX_SESSIONS {
                return page(
                    StatusCode::SERVICE_UNAVAILABLE,
                    pages::message(
                        "Too many console sessions",
                        "Every console session slot is taken; try again when one has expired.",
                    ),
                );
            }
            sessions.insert(
                id.clone(),
                Session {
                    csrf: random_token(),
                    person,
                    expires_ms,
                    opened_ms: now,
                    bearer: false,
                },
            );
        }
        let mut r = redirect(&format!("{PREFIX}/approvals"));
        let secure = if self.secure_cookie { "; Secure" } else { "" };
        let cookie = format!("{COOKIE}={id}; Path={PREFIX}; HttpOnly; SameSite=Strict{secure}");
        if let Ok(v) = HeaderValue::from_str(&cookie) {
            r.headers_mut().insert(header::SET_COOKIE, v);
        }
        r
    }

    /// The console session of a request: its cookie's open session, or, in a console of
    /// people, the person its `Authorization: Bearer` token names (`Err`: the token's
    /// refusal page). `None`: neither.
    fn session(&self, headers: &http::HeaderMap) -> Option<Result<Session, Box<Response<Body>>>> {
        let found = self.session_of(headers)?;
        Some(found.and_then(|s| match self.may_not_view(&s.person) {
            None => Ok(s),
            Some(why) => Err(Box::new(page(
                StatusCode::FORBIDDEN,
                pages::message(
                    "Not allowed",
                    &format!("{} may not view the console: {why}", s.person.recorded),
                ),
            ))),
        }))
    }

    /// Why policy does not let `person` read the console's pages (`view`), if it does not.
    fn may_not_view(&self, person: &Person) -> Option<String> {
        let (Some(host), Some(principal)) = (&self.host, &person.principal) else {
            return None;
        };
        refusal(&host.policy().may_act(principal, &ConsoleSubject::Console))
    }

    /// The session a request names (before policy is asked whether its person may view).
    fn session_of(
        &self,
        headers: &http::HeaderMap,
    ) -> Option<Result<Session, Box<Response<Body>>>> {
        if let (Access::Bearer { verifier, .. }, Some(h)) =
            (&self.access, headers.get(header::AUTHORIZATION))
        {
            let verified = verifier.verify(Some(h)).map_err(|r| {
                Box::new(challenged(page(
                    r.status(),
                    pages::message("Token refused", &r.describe()),
                )))
            });
            return Some(verified.and_then(|v| {
                let person = person_of(&v).map_err(|e| {
                    Box::new(page(
                        StatusCode::FORBIDDEN,
                        pages::message("Token refused", &format!("{e:#}")),
                    ))
                })?;
                Ok(Session {
                    csrf: String::new(),
                    person: Arc::new(person),
                    expires_ms: v.expires_s.saturating_mul(1000),
                    opened_ms: crate::store::now_ms(),
                    bearer: true,
                })
            }));
        }
        let id = headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|c| c.trim().split_once('='))
            .find(|(k, _)| *k == COOKIE)
            .map(|(_, v)| v.to_string())?;
        let now = crate::store::now_ms();
        let sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        sessions
            .iter()
            .find(|(k, _)| same_secret(k, &id))
            .map(|(_, s)| s.clone())
            .filter(|s| s.expires_ms > now)
            .map(Ok)
    }

    /// Why policy does not let the session's person act on `subject` (`None`: it does, or
    /// the person is the loopback operator, whom policy is not asked about).
    fn refused(&self, session: &Session, subject: &ConsoleSubject<'_>) -> Option<String> {
        let (Some(host), Some(principal)) = (&self.host, &session.person.principal) else {
            return None;
        };
        refusal(&host.policy().may_act(principal, subject))
    }

    /// `401` with how to log in to this console.
    fn not_logged_in(&self) -> Response<Body> {
        match self.access {
            Access::OneTime { .. } => not_logged_in(),
            Access::Bearer { .. } => {
                challenged(page(StatusCode::UNAUTHORIZED, pages::token_login(None)))
            }
        }
    }

    /// `GET /console/approvals[?after=MS.ID]`: the pending approvals the trace proves,
    /// newest first, [`PAGE`] at a time; `after` (the page before's last `created_ms` and
    /// id) is the next page's start. An `after` that does not parse is the first page.
    fn inbox(&self, session: &Session, query: Option<&str>) -> Response<Body> {
        let now = crate::store::now_ms();
        let store = self.registry.store();
        let after = query_value(query, "after");
        let after = after.as_deref().and_then(|a| {
            let (ms, id) = a.split_once('.')?;
            Some((ms.parse::<u64>().ok()?, id))
        });
        let listed = match store.approvals_after(Some(ApprovalState::Pending), after, PAGE) {
            Ok(l) => l,
            Err(e) => {
                return store_unavailable(&e);
            }
        };
        // A full page may have a next one: it starts after the last approval read.
        let next = (listed.len() == PAGE)
            .then(|| listed.last().map(|r| format!("{}.{}", r.created_ms, r.id)))
            .flatten();
        let listed: Vec<_> = listed
            .into_iter()
            .filter(|r| r.state_at(now) == ApprovalState::Pending)
            .collect();
        let checked =
            crate::decisions::tampered_all(&self.registry, &listed, now).unwrap_or_else(|e| {
                vec![Some(format!("could not check against the trace: {e:#}")); listed.len()]
            });
        let mut rows = Vec::new();
        for (r, tampered) in listed.into_iter().zip(checked) {
            let refused = self.refused(session, &approval_subject(&r, "approve"));
            rows.push(pages::InboxRow {
                approval: r,
                tampered,
                refused,
            });
        }
        // Approved receipts not used yet: a person may still revoke them (first page only).
        let approved: Vec<(crate::store::ApprovalRecord, Option<String>)> = if after.is_none() {
            store
                .approvals_after(Some(ApprovalState::Approved), None, PAGE)
                .unwrap_or_default()
                .into_iter()
                .filter(|r| r.state_at(now) == ApprovalState::Approved)
                .map(|r| {
                    let refused = self.refused(session, &approval_subject(&r, "revoke"));
                    (r, refused)
                })
                .collect()
        } else {
            Vec::new()
        };
        let notice = query_value(query, "done");
        page(
            StatusCode::OK,
            pages::inbox(
                &rows,
                &approved,
                now,
                &session.csrf,
                &session.person.recorded,
                notice.as_deref(),
                next.as_deref(),
            ),
        )
    }

    /// `POST /console/approvals/{id}`: the decision in the form's `decision` field
    /// (`approve`, `deny`, `revoke`), with an optional `reason`.
    fn decide(
        &self,
        session: &Session,
        id: &str,
        form: &HashMap<String, String>,
    ) -> Response<Body> {
        let (decision, word) = match form.get("decision").map(String::as_str) {
            Some("approve") => (ApprovalDecision::Approve, "approve"),
            Some("deny") => (ApprovalDecision::Deny, "deny"),
            Some("revoke") => (ApprovalDecision::Revoke, "revoke"),
            _ => {
                return page(
                    StatusCode::BAD_REQUEST,
                    pages::message("Bad form", "decision must be approve, deny or revoke"),
                );
            }
        };
        if session.person.principal.is_some() {
            let record = match self.registry.store().approval(id) {
                Ok(Some(r)) => r,
                Ok(None) => return missing("Not decided", "approval", id),
                Err(e) => return store_unavailable(&e),
            };
            if let Some(why) = self.refused(session, &approval_subject(&record, word)) {
                tracing::info!(person = %session.person.recorded, approval = %record.id, decision = word, %why, "console decision refused by policy");
                return page(
                    StatusCode::FORBIDDEN,
                    pages::message(
                        "Not allowed",
                        &format!(
                            "{} may not {word} approval {}: {why}",
                            session.person.recorded, record.id
                        ),
                    ),
                );
            }
        }
        let reason = form
            .get("reason")
            .map(|r| r.trim())
            .filter(|r| !r.is_empty());
        let ttl = if decision == ApprovalDecision::Approve {
            RECEIPT_TTL
        } else {
            Duration::ZERO
        };
        match crate::decisions::decide(
            &self.registry,
            id,
            decision,
            &session.person.recorded,
            reason,
            ttl,
        ) {
            Ok(r) => done(
                "approvals",
                &format!("{} {}", r.id, r.state_at(crate::store::now_ms())),
            ),
            Err(e) => page(
                StatusCode::CONFLICT,
                pages::message("Not decided", &format!("{e:#}")),
            ),
        }
    }
}

impl Console {
    /// `GET /console/intents`: the intents held for a person (state `unknown`), oldest
    /// first, with their attempts.
    fn held(&self, session: &Session, query: Option<&str>) -> Response<Body> {
        let store = self.registry.store();
        let listed = store.intents(&crate::store::IntentFilter {
            compensates: None,
            states: vec![crate::store::IntentState::Unknown],
            mapping: None,
            created_before_ms: None,
            limit: PAGE,
        });
        let listed = match listed {
            Ok(l) => l,
            Err(e) => {
                return store_unavailable(&e);
            }
        };
        let mut rows = Vec::new();
        for r in listed {
            let attempts = store.attempts(&r.intent.id).unwrap_or_default();
            let tampered = crate::decisions::intent_tampered(&self.registry, &r)
                .unwrap_or_else(|e| Some(format!("could not check against the trace: {e:#}")));
            rows.push((r, attempts, tampered));
        }
        page(
            StatusCode::OK,
            pages::intents(
                &rows,
                &session.csrf,
                &session.person.recorded,
                query_value(query, "done").as_deref(),
            ),
        )
    }

    /// `POST /console/intents/{id}`: resolves the intent `as` `completed` or `failed`,
    /// with the form's `evidence`.
    fn resolve(
        &self,
        session: &Session,
        id: &str,
        form: &HashMap<String, String>,
    ) -> Response<Body> {
        let (state, outcome) = match form.get("as").map(String::as_str) {
            Some("completed") => (crate::store::IntentState::Completed, "completed"),
            Some("failed") => (crate::store::IntentState::Failed, "failed"),
            _ => {
                return page(
                    StatusCode::BAD_REQUEST,
                    pages::message("Bad form", "as must be completed or failed"),
                );
            }
        };
        if session.person.principal.is_some() {
            let record = match self.registry.store().intent(id) {
                Ok(Some(r)) => r,
                Ok(None) => return missing("Not resolved", "intent", id),
                Err(e) => return store_unavailable(&e),
            };
            let i = &record.intent;
            let subject = ConsoleSubject::Intent {
                id: &i.id,
                requester: &i.requester,
                capability: &i.capability,
                mapping: &i.mapping,
                effect_class: &i.effect_class,
                outcome,
            };
            if let Some(why) = self.refused(session, &subject) {
                tracing::info!(person = %session.person.recorded, intent = %i.id, %why, "console resolution refused by policy");
                return page(
                    StatusCode::FORBIDDEN,
                    pages::message(
                        "Not allowed",
                        &format!(
                            "{} may not resolve intent {}: {why}",
                            session.person.recorded, i.id
                        ),
                    ),
                );
            }
        }
        let evidence = form.get("evidence").map(String::as_str).unwrap_or("");
        match crate::decisions::resolve_intent(
            &self.registry,
            id,
            state,
            &session.person.recorded,
            evidence,
        ) {
            Ok(r) => done("intents", &format!("{} {}", r.intent.id, r.state.as_str())),
            Err(e) => page(
                StatusCode::CONFLICT,
                pages::message("Not resolved", &format!("{e:#}")),
            ),
        }
    }
}

/// Why decision `d` refuses, in words (`None`: it allows).
fn refusal(d: &crate::policy::Decision) -> Option<String> {
    if d.verdict == Verdict::Allow {
        return None;
    }
    Some(if d.determining.is_empty() {
        "no policy permits it".to_string()
    } else {
        format!("forbidden by policy {}", d.determining.join(", "))
    })
}

/// When a login session of a token expiring at `exp_s` (seconds since the epoch) ends,
/// opened at `now_ms`: at the token's expiry, at most [`SESSION_MAX`] from now.
fn session_expiry(exp_s: u64, now_ms: u64) -> u64 {
    exp_s
        .saturating_mul(1000)
        .min(now_ms.saturating_add(SESSION_MAX.as_millis() as u64))
}

/// The person a verified token names, as the console records and asks policy about.
fn person_of(v: &crate::front::auth::Verified) -> Result<Person> {
    Ok(Person {
        recorded: format!("{} (console)", v.subject),
        principal: Some(Principal::new(&v.subject, &v.roles, "console")?),
    })
}

/// `approve` of approval `r` with `decision`, as policy is asked it.
fn approval_subject<'a>(
    r: &'a crate::store::ApprovalRecord,
    decision: &'a str,
) -> ConsoleSubject<'a> {
    ConsoleSubject::Approval {
        id: &r.id,
        requester: &r.binding.requester,
        capability: &r.binding.capability,
        mapping: &r.binding.mapping,
        profile: &r.profile,
        decision,
    }
}

impl Console {
    /// Per connection: the protocol version its latest snapshot negotiated and, in a
    /// serving host, how many times this host restarted it.
    fn connection_extras(&self, s: &crate::status::Status) -> Vec<pages::ConnectionExtra> {
        let store = self.registry.store();
        s.connections
            .iter()
            .map(|c| pages::ConnectionExtra {
                protocol: store
                    .latest_snapshot(&c.connection_id)
                    .ok()
                    .flatten()
                    .and_then(|snap| {
                        snap.body
                            .get("protocol_version")
                            .and_then(|v| v.as_str())
                            .map(str::to_string)
                    }),
                restarts: self
                    .host
                    .as_ref()
                    .map(|_| self.registry.metrics().restarts(&c.name)),
            })
            .collect()
    }

    /// `GET /console/trace[?before=SEQ&capability=&requester=&outcome=]`, `GET
    /// /console/trace/calls/{id}?from=SEQ&to=SEQ`, `GET /console/trace/verify`
    /// ([`trace`]).
    fn trace(&self, rest: &str, query: Option<&str>) -> Response<Body> {
        let store = self.registry.store();
        let head = match store.trace_checkpoint() {
            Ok(c) => c.seq,
            Err(e) => return store_unavailable(&e),
        };
        let number = |key: &str| query_value(query, key).and_then(|v| v.parse::<i64>().ok());
        if rest == "/trace/verify" {
            let checkpoints = match self.checkpoints.as_deref().map(std::fs::read_to_string) {
                None => Ok(Vec::new()),
                Some(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
                Some(Err(e)) => Err(anyhow::anyhow!("reading the checkpoint file: {e}")),
                Some(Ok(text)) => crate::store::Checkpoint::parse_lines(&text),
            };
            let checkpoints = match checkpoints {
                Ok(c) => c,
                Err(e) => return store_unavailable(&e),
            };
            return match store.verify_trace_against(&checkpoints) {
                Ok(v) => page(StatusCode::OK, trace::verify_page(&v, checkpoints.len())),
                Err(e) => store_unavailable(&e),
            };
        }
        if rest == "/trace/audit.json" {
            let from = number("from").unwrap_or(1);
            let to = number("to").unwrap_or(head);
            return match audit::package(store, from, to) {
                Ok(p) => {
                    let body = serde_json::to_vec_pretty(&p).unwrap_or_default();
                    let mut r = Response::new(Full::new(Bytes::from(body)));
                    let h = r.headers_mut();
                    h.insert(
                        header::CONTENT_TYPE,
                        HeaderValue::from_static("application/json"),
                    );
                    if let Ok(v) = HeaderValue::from_str(&format!(
                        "attachment; filename=\"airlock-audit-{from}-{}.json\"",
                        to.min(head)
                    )) {
                        h.insert(header::CONTENT_DISPOSITION, v);
                    }
                    secure(r)
                }
                Err(e) => store_unavailable(&e),
            };
        }
        if let Some(call) = rest.strip_prefix("/trace/calls/") {
            let to = number("to").unwrap_or(head).min(head);
            let from = number("from").unwrap_or(to.saturating_sub(trace::WINDOW));
            let life = match trace::life(store, call, from, to) {
                Ok(l) => l,
                Err(e) => return store_unavailable(&e),
            };
            let named = |key: &str| {
                life.iter()
                    .rev()
                    .find_map(|e| e.payload.get(key).and_then(|v| v.as_str()))
                    .map(str::to_string)
            };
            let approval = named("approval").and_then(|id| store.approval(&id).ok().flatten());
            let intent = named("intent").and_then(|id| store.intent(&id).ok().flatten());
            return page(
                StatusCode::OK,
                trace::call_page(call, &life, approval.as_ref(), intent.as_ref()),
            );
        }
        if rest != "/trace" {
            return page(
                StatusCode::NOT_FOUND,
                pages::message("Not found", "No such console page."),
            );
        }
        let before = number("before").unwrap_or(head + 1).clamp(1, head + 1);
        let filter = trace::Filter {
            capability: query_value(query, "capability").unwrap_or_default(),
            requester: query_value(query, "requester").unwrap_or_default(),
            outcome: query_value(query, "outcome").unwrap_or_default(),
            since: query_value(query, "since").unwrap_or_default(),
            until: query_value(query, "until").unwrap_or_default(),
            ..trace::Filter::default()
        };
        let filter = match filter.resolve(crate::store::now_ms()) {
            Ok(f) => f,
            Err(e) => {
                return page(
                    StatusCode::BAD_REQUEST,
                    pages::message("Bad filter", &format!("{e:#}")),
                );
            }
        };
        match trace::list(store, before, &filter) {
            Ok(listed) => page(
                StatusCode::OK,
                trace::list_page(&listed, &filter, head, before),
            ),
            Err(e) => store_unavailable(&e),
        }
    }
}

impl Console {
    /// `GET /console/mappings`, `/console/mappings/{name}[?requester=&roles=]`,
    /// `/console/mappings/{name}/drift[?from=DIGEST&to=DIGEST]`,
    /// `/console/mappings/{name}/grants` ([`mappings`]).
    fn mappings(&self, session: &Session, rest: &str, query: Option<&str>) -> Response<Body> {
        let store = self.registry.store();
        let Some(tail) = rest.strip_prefix("/mappings/") else {
            return match store.mappings() {
                Ok(list) => page(StatusCode::OK, mappings::list_page(&list)),
                Err(e) => store_unavailable(&e),
            };
        };
        let (name, sub) = tail.split_once('/').unwrap_or((tail, ""));
        let show = match crate::review::review_show(&self.registry, name, self.config()) {
            Ok(s) => s,
            Err(e) => {
                return page(
                    StatusCode::NOT_FOUND,
                    pages::message("No such mapping", &format!("{e:#}")),
                );
            }
        };
        match sub {
            "" => self.mapping(session, &show, query),
            "drift" => self.drift(&show, query),
            "grants" => self.grants(name),
            _ => page(
                StatusCode::NOT_FOUND,
                pages::message("Not found", "No such console page."),
            ),
        }
    }

    /// Why policy does not let the person review (approve) or retire `show`'s mapping.
    /// The contract policy sees is the one the decision acts on: for an approval, the
    /// manifest the configuration names (what the new revision will be); for a
    /// retirement, the serving revision's recorded manifest. When it cannot be told, the
    /// action is refused rather than asked about with no contract.
    fn mapping_refused(
        &self,
        session: &Session,
        show: &crate::review::ReviewShow,
        retire: bool,
    ) -> Option<String> {
        let c = &show.current;
        session.person.principal.as_ref()?;
        let contract = if retire {
            c.manifest_text
                .as_deref()
                .and_then(|t| crate::registry::manifest::MappingManifest::parse(t, &c.name).ok())
                .map(|m| m.mapping.contract)
        } else {
            self.config()
                .and_then(|config| crate::review::find_mapping(config, &c.name).ok())
                .map(|s| s.manifest.mapping.contract)
        };
        let Some(contract) = contract else {
            return Some(
                "the contract it implements cannot be read, so policy cannot be asked".into(),
            );
        };
        self.refused(
            session,
            &ConsoleSubject::Mapping {
                name: &c.name,
                contract: &contract,
                revision: c.revision,
                state: c.state.as_str(),
                retire,
            },
        )
    }

    fn mapping(
        &self,
        session: &Session,
        show: &crate::review::ReviewShow,
        query: Option<&str>,
    ) -> Response<Body> {
        let store = self.registry.store();
        let c = &show.current;
        let pins = crate::registry::Pins::from_value(&c.pins);
        let pinned: Option<crate::registry::drift::Catalogue> = c
            .snapshot_digest
            .as_deref()
            .and_then(|d| store.snapshot(d).ok().flatten())
            .and_then(|s| serde_json::from_value(s.body).ok());
        let pinned_tools = pins
            .tools
            .keys()
            .map(|t| (t.clone(), pinned.as_ref().and_then(|p| p.tool(t).cloned())))
            .collect();
        let catalog = self.host.as_ref().map(|h| h.catalog());
        let derived = catalog.as_ref().map(|cat| {
            cat.capabilities
                .iter()
                .filter(|cap| cap.mapping.name == c.name)
                .map(|cap| mappings::Derived {
                    name: cap.name.clone(),
                    description: cap.description.clone(),
                    schema: serde_json::Value::Object((*cap.input_schema).clone()),
                })
                .collect()
        });
        let requester = query_value(query, "requester").filter(|r| !r.trim().is_empty());
        let policy = match (&self.host, &catalog, requester) {
            (Some(host), Some(cat), Some(requester)) => {
                let roles: Vec<String> = query_value(query, "roles")
                    .unwrap_or_default()
                    .split(',')
                    .map(|r| r.trim().to_string())
                    .filter(|r| !r.is_empty())
                    .collect();
                match Principal::new(&requester, &roles, "http") {
                    Ok(principal) => Some((
                        requester.clone(),
                        policy_rows(host, cat, &c.name, &principal),
                    )),
                    Err(e) => {
                        return page(
                            StatusCode::BAD_REQUEST,
                            pages::message("Bad requester", &format!("{e:#}")),
                        );
                    }
                }
            }
            _ => None,
        };
        let notice = query_value(query, "done");
        let view = mappings::MappingView {
            show,
            pinned_tools,
            derived,
            policy,
            can_check_policy: self.host.is_some(),
            can_approve: self.config().is_some(),
            csrf: &session.csrf,
            person: &session.person.recorded,
            notice: notice.as_deref(),
            review_refused: self.mapping_refused(session, show, false),
            retire_refused: self.mapping_refused(session, show, true),
        };
        page(StatusCode::OK, mappings::mapping_page(&view))
    }

    /// Drift between two snapshots of the mapping's connection, side by side: `from`
    /// defaults to the pinned snapshot, `to` to the latest.
    fn drift(&self, show: &crate::review::ReviewShow, query: Option<&str>) -> Response<Body> {
        let store = self.registry.store();
        let c = &show.current;
        let from = query_value(query, "from").or_else(|| c.snapshot_digest.clone());
        let to = query_value(query, "to").or_else(|| show.latest_snapshot.clone());
        let (Some(from), Some(to)) = (from, to) else {
            return page(
                StatusCode::NOT_FOUND,
                pages::message(
                    "No drift to show",
                    "The mapping has no pinned snapshot, or its connection none stored.",
                ),
            );
        };
        let load = |d: &str| -> Result<(
            crate::store::StoredSnapshot,
            crate::registry::drift::Catalogue,
        )> {
            let snap = store.snapshot(d)?.with_context(|| {
                format!("no snapshot matches `{}`", airlock_core::text::safe(d, 80))
            })?;
            let catalogue = serde_json::from_value(snap.body.clone())
                .context("the stored snapshot does not parse")?;
            Ok((snap, catalogue))
        };
        let (old, new) = match (load(&from), load(&to)) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => {
                return page(
                    StatusCode::NOT_FOUND,
                    pages::message("No such snapshot", &format!("{e:#}")),
                );
            }
        };
        if old.0.connection_id != c.connection_id || new.0.connection_id != c.connection_id {
            return page(
                StatusCode::BAD_REQUEST,
                pages::message(
                    "Not this mapping's connection",
                    "Both snapshots must be of the mapping's connection.",
                ),
            );
        }
        let drift = crate::registry::drift::diff(&old.1, &new.1);
        let pinned = crate::registry::Pins::from_value(&c.pins)
            .tools
            .keys()
            .cloned()
            .collect();
        page(
            StatusCode::OK,
            mappings::drift_page(&c.name, &old.0, &new.0, &old.1, &new.1, &drift, &pinned),
        )
    }

    /// `airlock grants --html` of the mapping, as the serve configuration names it.
    fn grants(&self, name: &str) -> Response<Body> {
        let Some(config) = self.config() else {
            return page(
                StatusCode::NOT_FOUND,
                pages::message(
                    "No configuration",
                    "The grants review reads the adapter's component from the serve configuration: start the console with --config FILE, or open it in the console of airlock serve --http.",
                ),
            );
        };
        let review = (|| -> Result<crate::review::grants::Review> {
            let source = crate::review::find_mapping(config, name)?;
            let path = source
                .path
                .context("the mapping's manifest was not read from a file")?;
            let contracts = crate::registry::contracts::ContractSet::judge(
                config,
                Some(self.registry.store()),
            )?;
            let mut review = crate::review::grants::review(&path, &contracts)?;
            crate::review::grants::add_registry(&mut review, &path, &self.registry, None)?;
            Ok(review)
        })();
        match review {
            Ok(r) => {
                let mut resp = page_html(StatusCode::OK, r.to_html());
                // The review is one self-contained page with its own stylesheet inline:
                // allowed by its hash, nothing else.
                if let Ok(v) = HeaderValue::from_str(&format!(
                    "default-src 'none'; style-src '{}'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
                    crate::review::grants::style_hash()
                )) {
                    resp.headers_mut()
                        .insert(header::CONTENT_SECURITY_POLICY, v);
                }
                resp
            }
            Err(e) => page(
                StatusCode::NOT_FOUND,
                pages::message("No grants review", &format!("{e:#}")),
            ),
        }
    }

    /// `POST /console/mappings/{name}` with `action` `approve` (pin the latest snapshot
    /// as a new `active` revision) or `retire`.
    fn review(
        &self,
        session: &Session,
        name: &str,
        form: &HashMap<String, String>,
    ) -> Response<Body> {
        let retire = match form.get("action").map(String::as_str) {
            Some("approve") => false,
            Some("retire") => true,
            _ => {
                return page(
                    StatusCode::BAD_REQUEST,
                    pages::message("Bad form", "action must be approve or retire"),
                );
            }
        };
        let show = match crate::review::review_show(&self.registry, name, self.config()) {
            Ok(s) => s,
            Err(e) => {
                return page(
                    StatusCode::NOT_FOUND,
                    pages::message("No such mapping", &format!("{e:#}")),
                );
            }
        };
        if let Some(why) = self.mapping_refused(session, &show, retire) {
            tracing::info!(person = %session.person.recorded, mapping = %name, retire, %why, "console review refused by policy");
            return page(
                StatusCode::FORBIDDEN,
                pages::message(
                    "Not allowed",
                    &format!(
                        "{} may not {} mapping {}: {why}",
                        session.person.recorded,
                        if retire { "retire" } else { "approve" },
                        show.current.name
                    ),
                ),
            );
        }
        // An approval pins exactly the snapshot the person was shown, of the revision they
        // saw: a server that changes its tools after the page loaded is not approved by it.
        let shown_snapshot = form.get("snapshot").map(String::as_str).unwrap_or("");
        let shown_revision = form.get("revision").and_then(|r| r.parse::<i64>().ok());
        if shown_revision != Some(show.current.revision) {
            return page(
                StatusCode::CONFLICT,
                pages::message(
                    "Changed since you looked",
                    &format!(
                        "mapping {} is at revision {} now; reload its page and decide again",
                        show.current.name, show.current.revision
                    ),
                ),
            );
        }
        if !retire && show.latest_snapshot.as_deref() != Some(shown_snapshot) {
            return page(
                StatusCode::CONFLICT,
                pages::message(
                    "Changed since you looked",
                    "the server's latest snapshot is not the one this page showed; reload the page and review it again",
                ),
            );
        }
        let who = &session.person.recorded;
        let done_page = format!("mappings/{}", show.current.name);
        let result = if retire {
            self.registry.retire(&show.current.name, who)
        } else {
            match self.config() {
                Some(config) => crate::review::approve(
                    config,
                    &show.current.name,
                    who,
                    Some(shown_snapshot),
                    None,
                    &[],
                    false,
                ),
                None => {
                    return page(
                        StatusCode::CONFLICT,
                        pages::message(
                            "Not approved",
                            "Approving reads the adapter from the serve configuration: start the console with --config FILE, or use the console of airlock serve --http.",
                        ),
                    );
                }
            }
        };
        match result {
            Ok(r) => done(
                &done_page,
                &format!("{} revision {} is {}", r.name, r.revision, r.state.as_str()),
            ),
            Err(e) => page(
                StatusCode::CONFLICT,
                pages::message("Not done", &format!("{e:#}")),
            ),
        }
    }
}

/// What policy answers `principal` for each capability of mapping `name` in each profile
/// of `host`'s configuration (as `tools/list` asks: no argument facts).
fn policy_rows(
    host: &Host,
    catalog: &crate::registry::catalog::Catalog,
    name: &str,
    principal: &Principal,
) -> Vec<mappings::PolicyRow> {
    let mut rows = Vec::new();
    for cap in catalog
        .capabilities
        .iter()
        .filter(|c| c.mapping.name == name)
    {
        let record = cap.mapping.record();
        for (profile_name, profile) in &host.config().profiles {
            let mut row = mappings::PolicyRow {
                capability: cap.name.clone(),
                profile: profile_name.clone(),
                answer: String::new(),
                determining: Vec::new(),
            };
            if !profile.includes(&cap.name, &cap.mapping.connection.name) {
                row.answer = "not in this profile".into();
                rows.push(row);
                continue;
            }
            let may = host.policy().may_use_profile(principal, profile_name);
            if may.verdict != Verdict::Allow {
                row.answer = "may not use this profile".into();
                row.determining = may.determining;
                rows.push(row);
                continue;
            }
            let d = host.policy().decide_call(
                principal,
                &crate::pipeline::offer::capability_facts(
                    cap,
                    record.revision,
                    record.state.as_str(),
                ),
                &crate::policy::CallFacts {
                    profile: profile_name,
                    transport: "http",
                    protocol: "2026-07-28",
                    destination: None,
                    artifact_bytes: None,
                },
            );
            row.answer = match d.verdict {
                Verdict::Allow => "allow".into(),
                Verdict::RequireApproval => "require-approval".into(),
                Verdict::Deny(c) => format!("deny ({})", c.as_str()),
            };
            row.determining = d.determining;
            rows.push(row);
        }
    }
    rows
}

/// The value of `key` in a query string.
fn query_value(query: Option<&str>, key: &str) -> Option<String> {
    query
        .into_iter()
        .flat_map(|q| form_urlencoded::parse(q.as_bytes()))
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.into_owned())
}

/// Why a state-changing request comes from another site, if it does: `Sec-Fetch-Site`
/// other than `same-origin`/`none`, or an `Origin` that is not this request's `Host` — an
/// opaque `Origin: null` passes only when the browser says `Sec-Fetch-Site: same-origin`
/// (browsers send `null` for a same-origin form post under some referrer policies).
fn cross_site(headers: &http::HeaderMap) -> Option<String> {
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
    let fetch_site = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok());
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("");
        let same = host
            .is_some_and(|h| origin == format!("http://{h}") || origin == format!("https://{h}"))
            || (origin == "null" && fetch_site == Some("same-origin"));
        if !same {
            return Some(format!(
                "a form from another origin ({}) cannot change anything here",
                airlock_core::text::safe(origin, 100)
            ));
        }
    }
    match fetch_site {
        None | Some("same-origin") | Some("none") => None,
        Some(other) => Some(format!(
            "a {} request cannot change anything here",
            airlock_core::text::safe(other, 40)
        )),
    }
}

/// The `application/x-www-form-urlencoded` fields of `body` (at most
/// [`MAX_FORM_BYTES`]; a repeated field keeps its first value).
async fn read_form(body: Incoming) -> Result<HashMap<String, String>> {
    let bytes = Limited::new(body, MAX_FORM_BYTES)
        .collect()
        .await
        .map_err(|e| {
            anyhow::anyhow!("the form could not be read (at most {MAX_FORM_BYTES} bytes): {e}")
        })?
        .to_bytes();
    let mut fields = HashMap::new();
    for (k, v) in form_urlencoded::parse(&bytes) {
        fields
            .entry(k.into_owned())
            .or_insert_with(|| v.into_owned());
    }
    Ok(fields)
}

/// The module's headers on `r`.
fn secure(mut r: Response<Body>) -> Response<Body> {
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    // `same-origin`: the console's own form posts carry its origin; no other site learns
    // a console URL from a referrer.
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    r
}

/// An HTML page with `status`.
fn page(status: StatusCode, html: maud::Markup) -> Response<Body> {
    page_html(status, html.into_string())
}

/// An HTML page (already rendered, escaped by its renderer) with `status`.
fn page_html(status: StatusCode, html: String) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(html)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    secure(r)
}

/// Back to the console page `page` after a decision, which shows `what` was done.
fn done(page: &str, what: &str) -> Response<Body> {
    redirect(&format!(
        "{PREFIX}/{page}?done={}",
        form_urlencoded::byte_serialize(what.as_bytes()).collect::<String>()
    ))
}

/// `303 See Other` to `to` (after a form post, a reload does not post again).
fn redirect(to: &str) -> Response<Body> {
    let mut r = page(StatusCode::SEE_OTHER, pages::message("Moved", "Continue."));
    if let Ok(v) = HeaderValue::from_str(to) {
        r.headers_mut().insert(header::LOCATION, v);
    }
    r
}

/// `r` with the challenge of a console that takes bearer tokens (a `401` names its
/// scheme: RFC 9110 §11.6.1, RFC 6750 §3).
fn challenged(mut r: Response<Body>) -> Response<Body> {
    if r.status() == StatusCode::UNAUTHORIZED {
        r.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"airlock-console\""),
        );
    }
    r
}

/// `404` titled `title`: no `what` has id `id` (shown clipped and escaped).
fn missing(title: &str, what: &str, id: &str) -> Response<Body> {
    page(
        StatusCode::NOT_FOUND,
        pages::message(
            title,
            &format!("no {what} `{}`", airlock_core::text::safe(id, 80)),
        ),
    )
}

/// `500` with what the store said.
fn store_unavailable(e: &anyhow::Error) -> Response<Body> {
    page(
        StatusCode::INTERNAL_SERVER_ERROR,
        pages::message("Store unavailable", &format!("{e:#}")),
    )
}

fn not_logged_in() -> Response<Body> {
    page(
        StatusCode::UNAUTHORIZED,
        pages::message(
            "Log in first",
            "Open the login link the console printed when it started (airlock console, or airlock demo --console; it works once).",
        ),
    )
}

/// Serves the console on `addr` (loopback only) until the process stops; prints the
/// login URL to stderr once listening.
///
/// # Errors
/// `addr` is not a loopback address, or does not bind.
pub async fn serve(
    registry: Registry,
    addr: &str,
    checkpoints: Option<std::path::PathBuf>,
    config: Option<crate::config::ServeConfig>,
) -> Result<()> {
    let addr: SocketAddr = addr.parse().with_context(|| {
        format!("--addr `{addr}`: expected an address such as {DEFAULT_ADDR} or [::1]:8788")
    })?;
    if !addr.ip().is_loopback() {
        bail!(
            "refusing to serve the console on {addr}: without [http.auth] it binds a loopback address only (anyone who reaches it could approve calls); use {DEFAULT_ADDR}"
        );
    }
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let local = listener.local_addr()?;
    let operator = format!("{} (console)", crate::config::os_user_name());
    let (console, token) = Console::new(registry, operator);
    let console = console.with_checkpoints(checkpoints).with_config(config);
    eprintln!("airlock: console at http://{local}{PREFIX}/login?token={token}");
    eprintln!("airlock: open that link once to log in; it is printed only here");
    accept(listener, console).await
}

/// Serves `console` on each connection `listener` accepts, forever.
async fn accept(listener: tokio::net::TcpListener, console: Arc<Console>) -> Result<()> {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("console: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let console = console.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let console = console.clone();
                async move { Ok::<_, Infallible>(console.handle(req).await) }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await
            {
                tracing::debug!("console connection: {e}");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cross_site_requests_are_named() {
        let mut h = http::HeaderMap::new();
        h.insert(header::HOST, "127.0.0.1:8788".parse().unwrap());
        assert_eq!(cross_site(&h), None);
        h.insert(header::ORIGIN, "http://127.0.0.1:8788".parse().unwrap());
        assert_eq!(cross_site(&h), None);
        h.insert("sec-fetch-site", "same-origin".parse().unwrap());
        assert_eq!(cross_site(&h), None);
        h.insert("sec-fetch-site", "cross-site".parse().unwrap());
        assert!(cross_site(&h).unwrap().contains("cross-site"));
        h.insert("sec-fetch-site", "same-origin".parse().unwrap());
        h.insert(header::ORIGIN, "http://evil.example".parse().unwrap());
        assert!(cross_site(&h).unwrap().contains("evil.example"));
        // An opaque origin passes only with the browser's word that it is same-origin.
        h.insert(header::ORIGIN, "null".parse().unwrap());
        assert_eq!(cross_site(&h), None);
        h.remove("sec-fetch-site");
        assert!(cross_site(&h).unwrap().contains("null"));
        h.insert("sec-fetch-site", "same-site".parse().unwrap());
        assert!(cross_site(&h).is_some());
    }

    #[test]
    fn a_login_session_lasts_at_most_session_max() {
        let now = 1_000_000_000_000;
        let max = now + SESSION_MAX.as_millis() as u64;
        assert_eq!(session_expiry(now / 1000 + 7 * 24 * 3600, now), max);
        assert_eq!(session_expiry(now / 1000 + 60, now), now + 60_000);
        assert_eq!(session_expiry(u64::MAX, now), max);
        assert_eq!(session_expiry(0, now), 0);
    }

    #[test]
    fn secrets_compare_whole() {
        assert!(same_secret("abc", "abc"));
        assert!(!same_secret("abc", "abd"));
        assert!(!same_secret("abc", "ab"));
        assert!(!same_secret("", "a"));
    }
}
