//! The upstream layer: one isolated rmcp client per configured connection.
//!
//! Rules:
//! - An upstream stdio server starts with a **cleared environment** (only the variables
//!   its connection declares) and a chosen working directory; its stdin/stdout carry the
//!   protocol and its stderr goes to Airlock's log (bounded lines, debug level).
//! - Every message the server sends is measured while it is read. A message larger than
//!   the connection's output budget is discarded before anything parses or logs it; the
//!   request it answered fails with [`UpstreamFailure::OutputTooLarge`].
//! - Every message that fits is checked to be JSON-RPC 2.0 before rmcp sees it: a JSON
//!   object with `"jsonrpc": "2.0"` that is a notification, a request (string or number
//!   id), or an answer (exactly one of `result` / `error`) whose id is a request this
//!   client sent and has not had answered. Anything else — a line that is not JSON, a
//!   JSON value that is not such a message, an answer to an id never sent or answered
//!   twice — **degrades the connection**: nothing more from the server is read, every
//!   waiting request fails at once as unavailable (none waits for its deadline), and no
//!   new request is sent ([`Connection::degraded`] says why). Blank lines are ignored.
//! - Each server runs in its own process group, dies with the host, and is reaped the
//!   moment it exits (see [`process`]); a connection whose server exited or closed its
//!   stdout [has exited](Connection::has_exited), and [`Connection::until_gone`] wakes at
//!   once. A start that fails or times out leaves no process behind.
//! - An upstream HTTP server ([`http`]) is reached with rmcp's Streamable HTTP client
//!   behind a line bridge, so every rule above about messages (budget, JSON-RPC checks,
//!   degrading, `list_changed`) holds for it too; it has no process, and "exited" means
//!   its HTTP client stopped.
//! - A server that leaves [`STALL_AFTER`] requests in a row unanswered until their
//!   callers stopped waiting (their deadline passed, or the caller went away) is
//!   **stalled** ([`Connection::is_stalled`], [`Connection::until_stalled`]); any answer
//!   it then gives — to a request or to [`Connection::ping`] — ends that. A cancellation
//!   the caller asked for does not count.
//! - Which tools and resources a particular adapter may reach is decided one layer up
//!   (the runtime's upstream bridge); this layer only transports.
//!
//! Also here: [`record`], the recorded-fixture format (what `airlock serve --record`
//! writes, redacted) and [`replay`], the in-process upstream that answers only from it.
//!
//! Crates: this one uses only `airlock-core` among Airlock's crates (no wasmtime, no
//! policy, no store); the runtime, the registry and everything above use it (as
//! `airlock::upstream` and `airlock::record`).

pub mod confine;
pub mod direct;
pub mod http;
pub mod process;
pub mod record;
pub mod replay;
pub mod spans;

/// Host-wide ceiling on one upstream message and on a mapping's
/// `limits.max_output_bytes`, in bytes (8 MiB): below rmcp's 16 MiB line limit, which
/// would otherwise drop an answer silently.
pub const MAX_OUTPUT_BYTES: u64 = 8 * 1024 * 1024;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context as _, Result};
use rmcp::ServiceExt as _;
use rmcp::model::{
    CallToolRequest, CallToolRequestParams, CancelledNotificationParam, ClientRequest, ErrorCode,
    GetMeta as _, JsonObject, ReadResourceRequest, ReadResourceRequestParams, ServerResult,
};
use rmcp::service::{PeerRequestOptions, RoleClient, RunningService, ServiceError};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt as _, AsyncRead, AsyncWrite, BufReader};
use tokio::process::Command;
use tokio_util::sync::CancellationToken;

use self::process::Process;
use airlock_core::jsonrpc::IdScanner;

/// Lines of a stdio server's stderr a connection keeps (the last ones; each cut at 400
/// characters): what `airlock discover --learn` reads.
pub const STDERR_KEPT: usize = 64;

/// Of those, the lines a failed start's error shows.
const STDERR_SHOWN: usize = 16;

/// How long an upstream server has to answer `initialize` when the caller sets no bound.
pub const INITIALIZE_TIMEOUT: Duration = Duration::from_secs(30);

/// Explains a server that failed its handshake: the error, whether it exited, and the last
/// lines it wrote to stderr.
async fn startup_failure(
    name: &str,
    server: &StdioServer,
    error: String,
    child: &Process,
    recent: &std::sync::Mutex<std::collections::VecDeque<String>>,
    mut stderr_ended: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Error {
    // Give the process a moment to exit and its last words a moment to be read.
    let _ = tokio::time::timeout(Duration::from_millis(200), child.exited()).await;
    let _ = tokio::time::timeout(
        Duration::from_millis(200),
        stderr_ended.wait_for(|ended| *ended),
    )
    .await;
    let status = match child.exit_status() {
        Some(status) => format!("the server exited ({status})"),
        None => "the server is still running (it is stopped now)".to_string(),
    };
    let last: Vec<String> = {
        let recent = recent.lock().unwrap_or_else(|e| e.into_inner());
        recent
            .iter()
            .skip(recent.len().saturating_sub(STDERR_SHOWN))
            .cloned()
            .collect()
    };
    let said = if last.is_empty() {
        "it wrote nothing to stderr".to_string()
    } else {
        format!("its last stderr lines:\n    {}", last.join("\n    "))
    };
    anyhow::anyhow!(
        "MCP initialize with connection `{name}` failed: {error}; {status}; {said}\n(command: {} {})",
        server.command.display(),
        server.args.join(" ")
    )
}

/// JSON-RPC error code Airlock writes in place of a discarded oversized answer.
pub const OUTPUT_BUDGET_ERROR_CODE: i32 = -32099;

/// How to start one upstream MCP server over stdio.
///
/// Defaults a reader should know: the environment is empty unless `env` says otherwise
/// (not even `PATH` or `HOME`); `command` must already be resolved to a path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StdioServer {
    /// Executable to run (absolute, or relative to the host's working directory).
    pub command: PathBuf,
    /// Arguments, passed as given.
    pub args: Vec<String>,
    /// Working directory of the server process.
    pub cwd: PathBuf,
    /// The complete environment of the server process.
    pub env: BTreeMap<String, String>,
    /// Who answers for this connection (free text, part of the configuration digest).
    pub owner: Option<String>,
    /// Name of the credential scope the connection runs under (a reference, never a
    /// secret; part of the configuration digest).
    pub credential_scope: Option<String>,
    /// More files whose contents are part of the connection's identity (the modules an
    /// interpreter loads besides its script, a configuration file the server reads).
    pub identity_files: Vec<PathBuf>,
    /// How the kernel confines the server ([`confine`]); `None` = unconfined (the host's
    /// filesystem, network and processes; flagged in review).
    pub confine: Option<confine::Confinement>,
}

/// How to reach one configured upstream server: a child process over stdio, or a URL
/// over Streamable HTTP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpstreamServer {
    /// A child process speaking MCP on stdin/stdout.
    Stdio(StdioServer),
    /// An MCP endpoint reached over Streamable HTTP.
    Http(http::HttpServer),
}

impl From<StdioServer> for UpstreamServer {
    fn from(server: StdioServer) -> Self {
        Self::Stdio(server)
    }
}

impl From<http::HttpServer> for UpstreamServer {
    fn from(server: http::HttpServer) -> Self {
        Self::Http(server)
    }
}

impl UpstreamServer {
    /// What the log may say of it: the command path, or the URL (never a header value).
    pub fn describe(&self) -> String {
        match self {
            Self::Stdio(s) => s.command.display().to_string(),
            Self::Http(h) => h.url.clone(),
        }
    }

    /// The stdio server, if it is one.
    pub fn as_stdio(&self) -> Option<&StdioServer> {
        match self {
            Self::Stdio(s) => Some(s),
            Self::Http(_) => None,
        }
    }

    /// The stdio server, mutably, if it is one (tests and the demo adjust arguments).
    pub fn as_stdio_mut(&mut self) -> Option<&mut StdioServer> {
        match self {
            Self::Stdio(s) => Some(s),
            Self::Http(_) => None,
        }
    }
}

/// Why an upstream request did not produce a result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpstreamFailure {
    /// The answer exceeded the budget (bytes) and was discarded while reading.
    OutputTooLarge(u64),
    /// The connection could not serve the request.
    Unavailable(String),
    /// The server answered with a JSON-RPC error; the message is untrusted text.
    Protocol(String),
    /// The caller cancelled the request; the server was sent `notifications/cancelled`.
    Cancelled,
}

impl UpstreamFailure {
    /// True when the server answered the request (a JSON-RPC error, or an answer
    /// discarded for its size); false when no answer came (closed, timed out, cancelled).
    pub fn answered(&self) -> bool {
        matches!(self, Self::OutputTooLarge(_) | Self::Protocol(_))
    }
}

impl std::fmt::Display for UpstreamFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::OutputTooLarge(n) => {
                write!(f, "upstream answer exceeded the output budget of {n} bytes")
            }
            Self::Unavailable(why) => write!(f, "upstream unavailable: {why}"),
            Self::Protocol(msg) => write!(f, "upstream error: {msg}"),
            Self::Cancelled => f.write_str("upstream request cancelled by the caller"),
        }
    }
}

/// One running upstream connection.
pub struct Connection {
    name: String,
    max_message_bytes: Arc<std::sync::atomic::AtomicUsize>,
    /// `None` for a connection that never started ([`Connection::unstarted`]).
    client: Option<RunningService<RoleClient, ()>>,
    /// The server process (`None` when it never started).
    process: Option<Arc<Process>>,
    /// A stdio server's last stderr lines ([`STDERR_KEPT`]), and whether its stderr ended.
    #[allow(clippy::type_complexity)]
    stderr: Option<(
        Arc<std::sync::Mutex<std::collections::VecDeque<String>>>,
        tokio::sync::watch::Receiver<bool>,
    )>,
    /// Why a connection that never started did not (the host's words).
    unstarted: Option<String>,
    /// Set when the server's stdout ended, the server exited, or a request found the
    /// transport closed.
    closed: Arc<std::sync::atomic::AtomicBool>,
    /// Woken when `closed` is set.
    gone: Arc<tokio::sync::Notify>,
    requests: AtomicU64,
    discarded: Arc<AtomicU64>,
    tap: Arc<Tap>,
    discovery: tokio::sync::Mutex<()>,
    first_initialize: std::sync::Mutex<Option<Value>>,
    /// For an HTTP connection: its bridge task and why the bridge closed; for a replayed
    /// one ([`Connection::start_replay`]): the task answering from fixtures.
    http: Option<HttpParts>,
    /// A stdio connection's stream to the server, shared with rmcp: the hot path's own
    /// requests go through it ([`direct`]); `None` for the other transports.
    outbound: Option<Arc<direct::Outbound>>,
    /// The next direct request's id ([`direct::FIRST_ID`] up).
    next_direct: AtomicU64,
    /// Requests in a row left unanswered until their callers stopped waiting.
    stall: Arc<Stall>,
}

/// Requests in a row a server leaves unanswered until their callers stop waiting before it
/// counts as stalled.
pub const STALL_AFTER: u32 = 3;

/// How many requests in a row a server left unanswered (module rules), and who waits for
/// that to reach [`STALL_AFTER`].
#[derive(Default)]
struct Stall {
    unanswered: std::sync::atomic::AtomicU32,
    changed: tokio::sync::Notify,
}

impl Stall {
    /// A request's caller stopped waiting before its answer came.
    fn missed(&self) {
        if self.unanswered.fetch_add(1, Ordering::AcqRel) + 1 == STALL_AFTER {
            self.changed.notify_waiters();
        }
    }

    /// The server answered a request.
    fn answered(&self) {
        if self.unanswered.swap(0, Ordering::AcqRel) >= STALL_AFTER {
            self.changed.notify_waiters();
        }
    }

    fn is_stalled(&self) -> bool {
        self.unanswered.load(Ordering::Acquire) >= STALL_AFTER
    }
}

impl Drop for Connection {
    /// Closes the stream to the server (its pump writes what is queued, then closes the
    /// pipe), as rmcp's transport did when it was dropped.
    fn drop(&mut self) {
        if let Some(out) = &self.outbound {
            out.close();
        }
    }
}

/// What an HTTP connection has instead of a process.
struct HttpParts {
    bridge: tokio::task::JoinHandle<()>,
    reason: http::CloseReason,
    /// An in-process replay ([`Connection::start_replay`]), not a network peer.
    replayed: bool,
}

/// The list requests whose raw answers discovery keeps, and `initialize`.
const CAPTURED_METHODS: [&str; 5] = [
    "initialize",
    "tools/list",
    "resources/list",
    "resources/templates/list",
    "prompts/list",
];

/// The notifications that mean the server's catalogue changed.
const LIST_CHANGED: [&str; 3] = [
    "notifications/tools/list_changed",
    "notifications/resources/list_changed",
    "notifications/prompts/list_changed",
];

/// Watches the raw message stream of one connection, both ways.
///
/// - While armed (during discovery), it records the ids of outgoing `initialize` and list
///   requests and keeps the raw `result` object of their answers: typed structs drop
///   unknown fields, and digests must cover what the server actually sent.
/// - Always, it counts `notifications/*/list_changed` as they are read, before rmcp sees
///   them, so a call that follows the notification on the wire already sees the change.
#[derive(Default)]
struct Tap {
    armed: std::sync::atomic::AtomicBool,
    pending: std::sync::Mutex<BTreeMap<String, &'static str>>,
    captured: std::sync::Mutex<Vec<(&'static str, Value)>>,
    list_changed: AtomicU64,
    changed: tokio::sync::Notify,
    /// Requests written to the server and not yet answered.
    open: std::sync::Mutex<OpenRequests>,
    /// The connection's name (for the log).
    label: String,
    /// Set once, when the server broke the protocol: what it sent (the host's words).
    degraded: std::sync::OnceLock<String>,
    degraded_now: tokio::sync::Notify,
    /// Answers to `tools/call` and `resources/read`, kept as JSON (see [`RawAnswers`]).
    raw: std::sync::Mutex<RawAnswers>,
    /// The waiters of the hot path's own requests ([`direct`]), by id (JSON text). Emptied
    /// (every waiter failing at once) when the stream ends or degrades.
    direct: std::sync::Mutex<
        std::collections::HashMap<String, tokio::sync::oneshot::Sender<direct::Answer>>,
    >,
    /// Set once the stream ended or degraded: no direct waiter is registered after it.
    direct_closed: std::sync::atomic::AtomicBool,
}

/// What the reader does with one incoming message that fits ([`Tap::incoming`]).
#[derive(Debug, PartialEq, Eq)]
enum Incoming {
    /// Hand it to rmcp as it is.
    Pass,
    /// A `result` answer rmcp's caller takes raw ([`RawAnswers`]): keep it, stub for rmcp.
    Keep(String),
    /// The answer to one of the hot path's own requests ([`direct`]): to its waiter only.
    Direct(String),
}

/// The longest request line the host writes (bytes): discovery's and the adapters'
/// requests are small; a longer partial line is no request we track.
const MAX_REQUEST_LINE: usize = 1 << 20;

/// The hot path's answers, parsed once.
///
/// Rule: the answer to a `tools/call` or `resources/read` this client sent is parsed once,
/// into JSON, by the reader ([`Filtered`]); rmcp is handed a stub answer with the same id
/// (an error, [`kept_stub`]), so it still settles the request (its waiter, timeout and
/// cancellation) without its typed parse of the whole result, and the request's caller
/// takes the JSON from here ([`Connection::call_tool`] checks it against the MCP result
/// type by reference). An id is `wanted` from the moment its request is written until
/// its caller stops waiting; an answer to an id no longer wanted passes to rmcp
/// unchanged (which drops it). At most [`MAX_OPEN_REQUESTS`] of each are kept.
#[derive(Default)]
struct RawAnswers {
    /// Ids (JSON text) of the requests whose answers are kept.
    wanted: std::collections::HashSet<String>,
    /// Kept answers (the `result` member) by id.
    kept: std::collections::HashMap<String, Value>,
}

/// The ids (as JSON text) of requests sent and not yet answered. Past
/// [`MAX_OPEN_REQUESTS`] (requests the server never answered pile up) the set is
/// forgotten, and from then on an answer to an unknown id is let through: rmcp drops it.
#[derive(Default)]
struct OpenRequests {
    ids: std::collections::HashSet<String>,
    forgot: bool,
}

/// Most unanswered requests tracked per connection (see [`OpenRequests`]).
const MAX_OPEN_REQUESTS: usize = 65_536;

/// The envelope of a JSON-RPC message; payloads are skipped, not built.
#[derive(serde::Deserialize)]
struct Envelope<'a> {
    #[serde(borrow, default)]
    jsonrpc: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    method: Option<std::borrow::Cow<'a, str>>,
    #[serde(default)]
    id: Option<Value>,
    #[serde(default)]
    result: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    error: Option<serde::de::IgnoredAny>,
}

impl Tap {
    fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An outgoing line (client → server): a request's id becomes open.
    fn outgoing(&self, line: &[u8]) {
        let Ok(head) = serde_json::from_slice::<Envelope<'_>>(line) else {
            return;
        };
        let (Some(method), Some(id)) = (head.method.as_deref(), head.id.as_ref()) else {
            return;
        };
        let id = id.to_string();
        if self.armed.load(Ordering::Acquire)
            && let Some(m) = CAPTURED_METHODS.iter().find(|m| **m == method)
        {
            Self::lock(&self.pending).insert(id.clone(), m);
        }
        if matches!(method, "tools/call" | "resources/read") {
            let mut raw = Self::lock(&self.raw);
            if raw.wanted.len() >= MAX_OPEN_REQUESTS {
                raw.wanted.clear();
            }
            raw.wanted.insert(id.clone());
        }
        let mut open = Self::lock(&self.open);
        if open.ids.len() >= MAX_OPEN_REQUESTS {
            open.ids.clear();
            open.forgot = true;
        }
        open.ids.insert(id);
    }

    /// An answer with id `id` (JSON text) arrived: it must answer an open request.
    fn answered(&self, id: &str) -> Result<(), String> {
        let mut open = Self::lock(&self.open);
        if open.ids.remove(id) || open.forgot {
            return Ok(());
        }
        // The id itself is the server's text: not repeated.
        Err("an answer to no request this client sent (or a second answer to one)".into())
    }

    /// Marks the connection degraded (once) and wakes every request waiting on it.
    fn degrade(&self, why: String) {
        if self.degraded.set(why).is_ok() {
            self.degraded_now.notify_waiters();
        }
    }

    /// Resolves once the connection is degraded.
    async fn until_degraded(&self) {
        let notified = self.degraded_now.notified();
        if self.degraded.get().is_some() {
            return;
        }
        notified.await;
    }

    /// An incoming line (server → client) that fits the budget: what the reader does with
    /// it. An error says how the line breaks JSON-RPC (the host's words; nothing of the
    /// line itself).
    fn incoming(&self, line: &[u8]) -> Result<Incoming, String> {
        let watching = self.armed.load(Ordering::Acquire);
        let body = line.trim_ascii();
        if body.is_empty() {
            return Ok(Incoming::Pass);
        }
        // Decode the envelope of EVERY message the way rmcp will (JSON escapes and any
        // size included): a byte search for `list_changed` misses `list\u005fchanged` and
        // padded notifications, which rmcp still accepts. `IgnoredAny` skips the payload
        // without building it.
        let body = body.strip_prefix(b"\xef\xbb\xbf").unwrap_or(body);
        if body.first() != Some(&b'{') {
            return Err(
                if serde_json::from_slice::<serde::de::IgnoredAny>(body).is_ok() {
                    "a JSON value that is not a JSON-RPC message object".into()
                } else {
                    "a line that is not JSON".into()
                },
            );
        }
        let head = match serde_json::from_slice::<Envelope<'_>>(body) {
            Ok(head) => head,
            Err(e) if e.is_data() => {
                return Err("a JSON object that is not a JSON-RPC message".into());
            }
            Err(_) => return Err("a line that is not JSON".into()),
        };
        if head.jsonrpc.as_deref() != Some("2.0") {
            return Err("a message without \"jsonrpc\": \"2.0\"".into());
        }
        match (head.method.as_deref(), &head.id) {
            (Some(method), None) => {
                if LIST_CHANGED.contains(&method) {
                    self.list_changed.fetch_add(1, Ordering::AcqRel);
                    self.changed.notify_waiters();
                }
                return Ok(Incoming::Pass);
            }
            (Some(_), Some(id)) if id.is_string() || id.is_number() => return Ok(Incoming::Pass),
            (Some(_), Some(_)) => {
                return Err("a request whose id is neither a string nor a number".into());
            }
            (None, Some(id)) if head.result.is_some() != head.error.is_some() => {
                let id = id.to_string();
                self.answered(&id)?;
                if self.is_direct(&id) {
                    return Ok(Incoming::Direct(id));
                }
                if head.result.is_some() && Self::lock(&self.raw).wanted.contains(&id) {
                    return Ok(Incoming::Keep(id));
                }
            }
            (None, Some(_)) => {
                return Err("an answer with neither or both of `result` and `error`".into());
            }
            (None, None) => {
                return Err(
                    "a message that is neither a request, a notification nor an answer with an id"
                        .into(),
                );
            }
        }
        if !watching {
            return Ok(Incoming::Pass);
        }
        let Ok(mut msg) = serde_json::from_slice::<Value>(body) else {
            return Ok(Incoming::Pass);
        };
        let Some(id) = msg.get("id").map(Value::to_string) else {
            return Ok(Incoming::Pass);
        };
        let Some(method) = Self::lock(&self.pending).remove(&id) else {
            return Ok(Incoming::Pass);
        };
        let result = msg
            .get_mut("result")
            .map(Value::take)
            .unwrap_or(Value::Null);
        Self::lock(&self.captured).push((method, result));
        Ok(Incoming::Pass)
    }

    /// Keeps the `result` of `line` (an answer with id `id`, JSON text) if its request
    /// still wants it; returns the stub rmcp is handed instead, or `None` to hand it the
    /// line itself.
    fn keep_raw(&self, id: &str, line: &[u8]) -> Option<Vec<u8>> {
        let mut raw = Self::lock(&self.raw);
        if !raw.wanted.remove(id) {
            return None;
        }
        let Ok(Value::Object(mut message)) = serde_json::from_slice::<Value>(line.trim_ascii())
        else {
            return None;
        };
        let result = message.remove("result")?;
        if raw.kept.len() >= MAX_OPEN_REQUESTS {
            raw.kept.clear();
        }
        raw.kept.insert(id.to_string(), result);
        Some(kept_stub(id))
    }

    /// Takes the kept answer to the request with id `id` (JSON text); either way its
    /// answer is no longer wanted.
    fn take_raw(&self, id: &str) -> Option<Value> {
        let mut raw = Self::lock(&self.raw);
        raw.wanted.remove(id);
        raw.kept.remove(id)
    }

    /// Takes the raw answer captured for `method` (the most recent one).
    fn take(&self, method: &str) -> Option<Value> {
        let mut captured = Self::lock(&self.captured);
        let i = captured.iter().rposition(|(m, _)| *m == method)?;
        Some(captured.remove(i).1)
    }

    /// Registers a direct request `id` (JSON text) as open, with its waiter; call before
    /// its bytes are written. `None` once the stream ended or degraded.
    fn expect_direct(&self, id: &str) -> Option<tokio::sync::oneshot::Receiver<direct::Answer>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        {
            let mut waiting = Self::lock(&self.direct);
            if self.direct_closed.load(Ordering::Acquire) {
                return None;
            }
            waiting.insert(id.to_string(), tx);
        }
        let mut open = Self::lock(&self.open);
        if open.ids.len() >= MAX_OPEN_REQUESTS {
            open.ids.clear();
            open.forgot = true;
        }
        open.ids.insert(id.to_string());
        Some(rx)
    }

    /// The direct request `id` is no longer waited for: a late answer is dropped.
    fn forget_direct(&self, id: &str) {
        Self::lock(&self.direct).remove(id);
    }

    /// Whether `id` (JSON text) is a direct request still waited for.
    fn is_direct(&self, id: &str) -> bool {
        Self::lock(&self.direct).contains_key(id)
    }

    /// Hands `answer` to the waiter of direct request `id`, if it still waits.
    fn answer_direct(&self, id: &str, answer: direct::Answer) {
        if let Some(tx) = Self::lock(&self.direct).remove(id) {
            let _ = tx.send(answer);
        }
    }

    /// The stream ended or degraded: every direct waiter fails now, and none is taken
    /// after.
    fn close_direct(&self) {
        let mut waiting = Self::lock(&self.direct);
        self.direct_closed.store(true, Ordering::Release);
        waiting.clear();
    }
}

/// The answer a direct request's waiter gets from the JSON-RPC message `line` (one
/// parse): its `result`, or its error's code and message.
fn direct_answer(line: &[u8]) -> direct::Answer {
    let Ok(Value::Object(mut message)) = serde_json::from_slice::<Value>(line.trim_ascii()) else {
        // The tap read its envelope already: unreachable in practice.
        return direct::Answer::Error(-32700, "the answer is not a JSON object".into());
    };
    if let Some(result) = message.remove("result") {
        return direct::Answer::Result(result);
    }
    let error = message.remove("error").unwrap_or(Value::Null);
    let code = error.get("code").and_then(Value::as_i64).unwrap_or(-32603);
    let text = error
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or("an error without a message")
        .to_string();
    direct::Answer::Error(code, text)
}

/// JSON-RPC error code of the stub rmcp is handed for an answer the reader kept
/// ([`RawAnswers`]); never sent anywhere, and never taken for the server's own error: the
/// request's caller finds the kept answer first.
const KEPT_ANSWER_CODE: i32 = -32097;

/// The stub for the kept answer to request `id` (JSON text): an error, because rmcp reads
/// an error message in one pass, while a `"result": {}` goes through every kind of result
/// its untagged `ServerResult` knows before it matches the empty one (~12 µs a call, 2.5 %
/// of the gateway's CPU in the floor bench's profile).
fn kept_stub(id: &str) -> Vec<u8> {
    let mut stub = Vec::with_capacity(80 + id.len());
    stub.extend_from_slice(br#"{"jsonrpc":"2.0","id":"#);
    stub.extend_from_slice(id.as_bytes());
    stub.extend_from_slice(br#","error":{"code":"#);
    stub.extend_from_slice(KEPT_ANSWER_CODE.to_string().as_bytes());
    stub.extend_from_slice(b",\"message\":\"answer kept by the reader\"}}\n");
    stub
}

/// Passes client → server bytes through unchanged; while the tap is armed, also hands
/// each complete line to it.
struct TapWriter<W> {
    inner: W,
    tap: Arc<Tap>,
    partial: Vec<u8>,
}

impl<W: AsyncWrite + Unpin> AsyncWrite for TapWriter<W> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = &mut *self;
        {
            // Register request ids BEFORE the bytes reach the server: its answer can be read
            // on another thread before this write returns. A line seen twice (a retried or
            // partial write) registers the same id again, which is harmless: it cannot have
            // been answered before all of it was written.
            // A line that began in an earlier write is joined with its start (a copy, only
            // then); every other line is handed over in place.
            let mut start = 0;
            for (i, &b) in buf.iter().enumerate() {
                if b == b'\n' {
                    if start == 0 && !this.partial.is_empty() {
                        let mut joined = this.partial.clone();
                        joined.extend_from_slice(&buf[..=i]);
                        this.tap.outgoing(&joined);
                    } else {
                        this.tap.outgoing(&buf[start..=i]);
                    }
                    start = i + 1;
                }
            }
        }
        let poll = std::pin::Pin::new(&mut this.inner).poll_write(cx, buf);
        if let std::task::Poll::Ready(Ok(n)) = &poll {
            let written = &buf[..*n];
            match written.iter().rposition(|&b| b == b'\n') {
                // What follows the last newline written starts the next line.
                Some(end) => {
                    this.partial.clear();
                    this.partial.extend_from_slice(&written[end + 1..]);
                }
                None => this.partial.extend_from_slice(written),
            }
            // Requests are small; a runaway partial line is not a request we track.
            if this.partial.len() > 1 << 20 {
                this.partial.clear();
            }
        }
        poll
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// What one discovery received, as raw JSON: the initialize result and every page of
/// each list the server advertises.
#[derive(Debug, Clone, PartialEq)]
pub struct RawDiscovery {
    /// The raw `initialize` result (`serverInfo`, `protocolVersion`, `capabilities`,
    /// `instructions`).
    pub initialize: Value,
    /// Raw tool objects, all pages in order.
    pub tools: Vec<Value>,
    /// Raw resource objects.
    pub resources: Vec<Value>,
    /// Raw resource template objects.
    pub resource_templates: Vec<Value>,
    /// Raw prompt objects.
    pub prompts: Vec<Value>,
}

/// Largest message accepted while discovery runs (bytes): a whole page of tools/list.
pub const DISCOVERY_MESSAGE_BYTES: usize = crate::MAX_OUTPUT_BYTES as usize;

/// Most pages one list may span, and most items one discovery keeps per list.
pub const MAX_DISCOVERY_PAGES: usize = 1000;
/// See [`MAX_DISCOVERY_PAGES`].
pub const MAX_DISCOVERY_ITEMS: usize = 20_000;

/// What a connection shares with its transport's tasks, made before the transport starts
/// (the budget filter and the tap need it first): the message budget, the count of
/// discarded messages, the tap, and the closed flag with its wake-up. Fresh: budget
/// `max_message_bytes`, nothing discarded, tap unarmed, not closed.
struct Shared {
    limit: Arc<std::sync::atomic::AtomicUsize>,
    discarded: Arc<AtomicU64>,
    tap: Arc<Tap>,
    closed: Arc<std::sync::atomic::AtomicBool>,
    gone: Arc<tokio::sync::Notify>,
}

impl Shared {
    /// Fresh parts for connection `name` with a message budget of `max_message_bytes`
    /// (saturating at `usize::MAX`).
    fn new(name: &str, max_message_bytes: u64) -> Self {
        Self {
            limit: Arc::new(std::sync::atomic::AtomicUsize::new(
                usize::try_from(max_message_bytes).unwrap_or(usize::MAX),
            )),
            discarded: Arc::default(),
            tap: Arc::new(Tap {
                label: name.to_string(),
                ..Tap::default()
            }),
            closed: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            gone: Arc::new(tokio::sync::Notify::new()),
        }
    }

    /// The budget filter in front of `reader` (the server's output): over-budget
    /// messages are discarded and counted, every message passes the tap, and the end of
    /// the stream marks the connection closed.
    fn filter<R>(&self, reader: R) -> Filtered<R> {
        Filtered::new(
            reader,
            &self.limit,
            &self.discarded,
            Some(&self.tap),
            Some((&self.closed, &self.gone)),
        )
    }
}

/// How a connection reaches its server, or why it never did.
enum Link {
    /// A child process over stdio; the hot path writes to it directly ([`direct`]).
    Stdio {
        client: RunningService<RoleClient, ()>,
        process: Arc<Process>,
        outbound: Arc<direct::Outbound>,
    },
    /// A task in between: the HTTP bridge, or the replay server.
    Bridged {
        client: RunningService<RoleClient, ()>,
        parts: HttpParts,
    },
    /// The server could not be started (the host's words): the connection is closed
    /// from the start.
    Unstarted(String),
}

impl Connection {
    /// The one constructor: connection `name` over `link`, with the parts its transport
    /// already shares. No request sent yet, direct ids from [`direct::FIRST_ID`], no
    /// initialize answer recorded; an unstarted link is closed.
    fn new(name: &str, shared: Shared, link: Link) -> Self {
        let (client, process, outbound, http, unstarted) = match link {
            Link::Stdio {
                client,
                process,
                outbound,
            } => (Some(client), Some(process), Some(outbound), None, None),
            Link::Bridged { client, parts } => (Some(client), None, None, Some(parts), None),
            Link::Unstarted(why) => {
                shared.closed.store(true, Ordering::Release);
                (None, None, None, None, Some(why))
            }
        };
        Self {
            name: name.to_string(),
            max_message_bytes: shared.limit,
            client,
            process,
            stderr: None,
            unstarted,
            closed: shared.closed,
            gone: shared.gone,
            requests: AtomicU64::new(0),
            discarded: shared.discarded,
            tap: shared.tap,
            discovery: tokio::sync::Mutex::new(()),
            first_initialize: std::sync::Mutex::new(None),
            http,
            outbound,
            next_direct: AtomicU64::new(direct::FIRST_ID),
            stall: Arc::default(),
        }
    }
}

impl Connection {
    /// Starts `server`, performs the MCP initialize handshake (waiting at most
    /// `initialize_timeout` for its answer), and returns the connection. Messages from the
    /// server longer than `max_message_bytes` are discarded. On any failure the server's
    /// process group is killed.
    ///
    /// # Errors
    /// The process could not start, or the handshake failed or timed out.
    pub async fn start_stdio(
        name: &str,
        server: &StdioServer,
        max_message_bytes: u64,
        initialize_timeout: Duration,
    ) -> Result<Self> {
        Self::start_stdio_reporting(name, server, max_message_bytes, initialize_timeout, None).await
    }

    async fn start_stdio_reporting(
        name: &str,
        server: &StdioServer,
        max_message_bytes: u64,
        initialize_timeout: Duration,
        report: Option<confine::proxy::Reporter>,
    ) -> Result<Self> {
        let (cmd, confined) = match &server.confine {
            Some(confinement) => {
                let (cmd, confined) = confine::command(
                    &server.command,
                    &server.args,
                    &server.cwd,
                    &server.env,
                    confinement,
                    report,
                )
                .with_context(|| format!("confining the server of connection `{name}`"))?;
                (cmd, Some(confined))
            }
            None => {
                let mut cmd = Command::new(&server.command);
                // Cleared environment: only what the connection declares.
                cmd.args(&server.args)
                    .env_clear()
                    .envs(&server.env)
                    .current_dir(&server.cwd);
                (cmd, None)
            }
        };
        let (mut child, pipes) = Process::spawn(cmd).with_context(|| {
            format!(
                "starting upstream server for connection `{name}`: {} (cwd {})",
                server.command.display(),
                server.cwd.display()
            )
        })?;
        if let Some(confined) = confined {
            child.keep(confined);
        }
        let child = Arc::new(child);
        let (stdout, stdin) = (pipes.stdout, pipes.stdin);
        // The last stderr lines are kept to explain a server that dies at start (and for
        // `discover --learn`).
        let recent: Arc<std::sync::Mutex<std::collections::VecDeque<String>>> = Arc::default();
        // True once the server's stderr ended (everything that held it exited).
        let (ended, stderr_ended) = tokio::sync::watch::channel(false);
        if let Some(stderr) = pipes.stderr {
            let (conn, recent) = (name.to_string(), recent.clone());
            tokio::spawn(async move {
                let mut lines = BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    let shown: String = line.chars().take(400).collect();
                    tracing::debug!(connection = %conn, "upstream stderr: {shown}");
                    let mut recent = recent.lock().unwrap_or_else(|e| e.into_inner());
                    if recent.len() == STDERR_KEPT {
                        recent.pop_front();
                    }
                    recent.push_back(shown);
                }
                let _ = ended.send(true);
            });
        } else {
            let _ = ended.send(true);
        }
        let shared = Shared::new(name, max_message_bytes);
        // Armed from the start: the initialize answer is part of the first snapshot.
        shared.tap.armed.store(true, Ordering::Release);
        // When the server closes its stdout (it exited), nothing more will be answered.
        let filtered = shared.filter(stdout);
        {
            // The server exited (reaped): even if a descendant still holds its stdout open,
            // nothing more will be answered.
            let (mut exit, closed, gone) = (
                child.exit_watch(),
                shared.closed.clone(),
                shared.gone.clone(),
            );
            tokio::spawn(async move {
                let _ = exit.wait_for(Option::is_some).await;
                closed.store(true, Ordering::Release);
                gone.notify_waiters();
            });
        }
        let outbound = direct::Outbound::start(stdin);
        let stdin = direct::RmcpLines::new(outbound.clone(), shared.tap.clone());
        let handshake = tokio::time::timeout(initialize_timeout, ().serve((filtered, stdin))).await;
        let client = match handshake.map_err(|_| {
            format!(
                "no answer to initialize within {} ms",
                initialize_timeout.as_millis()
            )
        }) {
            Ok(Ok(client)) => client,
            Ok(Err(e)) => {
                outbound.close();
                return Err(startup_failure(
                    name,
                    server,
                    e.to_string(),
                    &child,
                    &recent,
                    stderr_ended.clone(),
                )
                .await);
            }
            Err(e) => {
                outbound.close();
                return Err(startup_failure(
                    name,
                    server,
                    e,
                    &child,
                    &recent,
                    stderr_ended.clone(),
                )
                .await);
            }
        };
        // Never answer from a cache: a stale tools/list or resources/read would hide drift
        // and serve content the server no longer stands behind.
        client
            .peer()
            .set_response_cache_config(rmcp::service::ClientCacheConfig::disabled())
            .await;
        let mut connection = Self::new(
            name,
            shared,
            Link::Stdio {
                client,
                process: child,
                outbound,
            },
        );
        connection.stderr = Some((recent, stderr_ended));
        Ok(connection)
    }

    /// Starts `server` (either transport; see [`Connection::start_stdio`] and
    /// [`Connection::start_http`]).
    ///
    /// # Errors
    /// As the transport's own start.
    pub async fn start(
        name: &str,
        server: &UpstreamServer,
        max_message_bytes: u64,
        initialize_timeout: Duration,
    ) -> Result<Self> {
        Self::start_reporting(name, server, max_message_bytes, initialize_timeout, None).await
    }

    /// [`Connection::start`], a confined server's egress refusals going to `report`
    /// (made by the caller, which then hears them even when the start fails).
    ///
    /// # Errors
    /// As [`Connection::start`].
    pub async fn start_reporting(
        name: &str,
        server: &UpstreamServer,
        max_message_bytes: u64,
        initialize_timeout: Duration,
        report: Option<confine::proxy::Reporter>,
    ) -> Result<Self> {
        match server {
            UpstreamServer::Stdio(s) => {
                Self::start_stdio_reporting(name, s, max_message_bytes, initialize_timeout, report)
                    .await
            }
            UpstreamServer::Http(h) => {
                Self::start_http(name, h, max_message_bytes, initialize_timeout).await
            }
        }
    }

    /// Connects to `server` over Streamable HTTP and runs the MCP lifecycle with rmcp's
    /// [`ClientLifecycleMode::Auto`](rmcp::ClientLifecycleMode::Auto): `server/discover`
    /// (2026-07-28) first, `initialize` (2025-11-25) when the server is older, waiting at
    /// most `initialize_timeout`. Messages longer than `max_message_bytes` are discarded
    /// as for stdio.
    ///
    /// # Errors
    /// The HTTP client cannot be built; the server refused or did not answer the
    /// handshake in time (the error names the URL and the HTTP failure, never a header
    /// value).
    ///
    /// A server that answers the `server/discover` probe over HTTP with something rmcp
    /// cannot take as either generation (some 2025-11-25 servers answer an unknown
    /// method with an empty result) is asked again, once, on a fresh HTTP client with
    /// `initialize` alone.
    pub async fn start_http(
        name: &str,
        server: &http::HttpServer,
        max_message_bytes: u64,
        initialize_timeout: Duration,
    ) -> Result<Self> {
        let auto = rmcp::ClientLifecycleMode::Auto {
            preferred_versions: vec![rmcp::model::ProtocolVersion::V_2026_07_28],
            legacy_version: Some(rmcp::model::ProtocolVersion::V_2025_11_25),
        };
        let started = std::time::Instant::now();
        match Self::start_http_with(name, server, max_message_bytes, initialize_timeout, auto).await
        {
            Ok(connection) => Ok(connection),
            Err((probe, true)) => {
                tracing::info!(connection = %name, "the server/discover probe failed ({probe:#}); trying initialize alone");
                let left = initialize_timeout.saturating_sub(started.elapsed());
                Self::start_http_with(
                    name,
                    server,
                    max_message_bytes,
                    left.max(Duration::from_millis(100)),
                    rmcp::ClientLifecycleMode::Initialize,
                )
                .await
                .map_err(|(e, _)| {
                    e.context(format!("after the server/discover probe failed: {probe:#}"))
                })
            }
            Err((e, false)) => Err(e),
        }
    }

    /// [`Connection::start_http`] with one lifecycle. The error's flag is true when the
    /// HTTP exchange worked but the lifecycle failed (the server answered something).
    async fn start_http_with(
        name: &str,
        server: &http::HttpServer,
        max_message_bytes: u64,
        initialize_timeout: Duration,
        lifecycle: rmcp::ClientLifecycleMode,
    ) -> Result<Self, (anyhow::Error, bool)> {
        let shared = Shared::new(name, max_message_bytes);
        shared.tap.armed.store(true, Ordering::Release);
        // rmcp's client writes lines into `to_bridge`; the bridge writes the server's
        // messages into `from_bridge`, which the budget filter reads like a stdout.
        let (to_bridge, bridge_in) = tokio::io::duplex(64 * 1024);
        let (bridge_out, from_bridge) = tokio::io::duplex(64 * 1024);
        let reason: http::CloseReason = Arc::default();
        // rmcp's own limit sits above every budget a mapping can have; the filter below
        // enforces the connection's budget.
        let rmcp_limit = usize::try_from(crate::MAX_OUTPUT_BYTES)
            .unwrap_or(usize::MAX)
            .saturating_add(64 * 1024);
        let bridge = http::bridge(
            name,
            server,
            rmcp_limit,
            bridge_in,
            bridge_out,
            reason.clone(),
        )
        .map_err(|e| (e, false))?;
        let filtered = shared.filter(from_bridge);
        let writer = TapWriter {
            inner: to_bridge,
            tap: shared.tap.clone(),
            partial: Vec::new(),
        };
        let handshake = tokio::time::timeout(
            initialize_timeout,
            rmcp::ClientServiceExt::serve_with_lifecycle((), (filtered, writer), lifecycle),
        )
        .await;
        let failed = |error: String, answered: bool| {
            bridge.abort();
            let why = reason
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
                .filter(|w| w != http::CLIENT_CLOSED);
            let answered = answered && why.is_none();
            let why = why.map(|w| format!("; {w}")).unwrap_or_default();
            (
                anyhow::anyhow!(
                    "MCP startup with connection `{name}` ({}) failed: {error}{why}",
                    server.url
                ),
                answered,
            )
        };
        let client = match handshake {
            Ok(Ok(client)) => client,
            Ok(Err(e)) => return Err(failed(e.to_string(), true)),
            Err(_) => {
                return Err(failed(
                    format!(
                        "no answer to server/discover or initialize within {} ms",
                        initialize_timeout.as_millis()
                    ),
                    false,
                ));
            }
        };
        client
            .peer()
            .set_response_cache_config(rmcp::service::ClientCacheConfig::disabled())
            .await;
        Ok(Self::new(
            name,
            shared,
            Link::Bridged {
                client,
                parts: HttpParts {
                    bridge,
                    reason,
                    replayed: false,
                },
            },
        ))
    }

    /// A connection whose server is [`replay::serve`] answering from `replay`, in this
    /// process: no process, no network, no credentials. Messages pass the same budget
    /// filter (`max_message_bytes`) and JSON-RPC checks as a live connection's.
    ///
    /// # Errors
    /// The rmcp client's handshake with the replayed upstream failed (a broken invariant).
    pub async fn start_replay(
        name: &str,
        replay: Arc<replay::Replay>,
        max_message_bytes: u64,
    ) -> Result<Self> {
        let shared = Shared::new(name, max_message_bytes);
        let (to_server, server_in) = tokio::io::duplex(64 * 1024);
        let (server_out, from_server) = tokio::io::duplex(64 * 1024);
        let server = tokio::spawn(replay::serve(replay, server_in, server_out));
        let filtered = shared.filter(from_server);
        let writer = TapWriter {
            inner: to_server,
            tap: shared.tap.clone(),
            partial: Vec::new(),
        };
        let client =
            match tokio::time::timeout(INITIALIZE_TIMEOUT, ().serve((filtered, writer))).await {
                Ok(Ok(client)) => client,
                Ok(Err(e)) => {
                    server.abort();
                    anyhow::bail!("the replayed upstream `{name}` did not initialize: {e}");
                }
                Err(_) => {
                    server.abort();
                    anyhow::bail!("the replayed upstream `{name}` did not answer initialize");
                }
            };
        client
            .peer()
            .set_response_cache_config(rmcp::service::ClientCacheConfig::disabled())
            .await;
        Ok(Self::new(
            name,
            shared,
            Link::Bridged {
                client,
                parts: HttpParts {
                    bridge: server,
                    reason: http::CloseReason::default(),
                    replayed: true,
                },
            },
        ))
    }

    /// The protocol version negotiated with the server (`None` before a handshake).
    pub fn protocol_version(&self) -> Option<String> {
        self.client
            .as_ref()?
            .peer_info()
            .map(|i| i.protocol_version.to_string())
    }

    /// A connection whose server could not be started (`why`, the host's words): it has
    /// [exited](Connection::has_exited), so the host's watcher starts it again; every
    /// request fails at once as unavailable.
    pub fn unstarted(name: &str, why: String, max_message_bytes: u64) -> Self {
        Self::new(
            name,
            Shared::new(name, max_message_bytes),
            Link::Unstarted(why),
        )
    }

    /// How many destinations the egress proxy of this connection's server refused since
    /// it started (0 without a proxy).
    pub fn egress_refused(&self) -> u64 {
        self.process
            .as_ref()
            .and_then(|p| p.egress())
            .map_or(0, confine::proxy::Egress::refused)
    }

    /// The last lines the stdio server wrote to stderr (at most [`STDERR_KEPT`], oldest
    /// first); empty for an HTTP or replayed connection.
    pub fn stderr_tail(&self) -> Vec<String> {
        self.stderr.as_ref().map_or_else(Vec::new, |(lines, _)| {
            lines
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .iter()
                .cloned()
                .collect()
        })
    }

    /// [`Connection::stderr_tail`] once the server's stderr has ended — everything that
    /// held it exited, and every line was read — waiting at most `within`. Call it after
    /// [`Connection::terminate`]: until then, lines written a moment ago may not be read
    /// yet.
    pub async fn stderr_tail_at_end(&self, within: Duration) -> Vec<String> {
        if let Some((_, ended)) = &self.stderr {
            let mut ended = ended.clone();
            let _ = tokio::time::timeout(within, ended.wait_for(|ended| *ended)).await;
        }
        self.stderr_tail()
    }

    /// The server's process id (its process group id too); `None` if it never started.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(|p| p.pid())
    }

    /// Why the connection is not serving, in the host's words: it never started (and
    /// why), the server exited (and how), or it closed its stdout. `None` while open.
    pub fn down_reason(&self) -> Option<String> {
        if let Some(why) = &self.unstarted {
            return Some(why.clone());
        }
        if let Some(d) = self.degraded() {
            return Some(d);
        }
        if self.is_open() {
            return None;
        }
        if let Some(h) = &self.http {
            let why = h.reason.lock().unwrap_or_else(|e| e.into_inner()).clone();
            return Some(why.unwrap_or_else(|| "the HTTP connection closed".to_string()));
        }
        Some(match self.process.as_ref().and_then(|p| p.exit_status()) {
            Some(status) => format!("the server exited ({status})"),
            None => "the server closed the connection".to_string(),
        })
    }

    /// Resolves once the connection [has exited](Connection::has_exited) (never for a
    /// degraded one, which is not restarted by itself).
    pub async fn until_gone(&self) {
        loop {
            let notified = self.gone.notified();
            if self.has_exited() {
                return;
            }
            if self.tap.degraded.get().is_some() {
                return std::future::pending().await;
            }
            // Polled too, in case the transport closed under rmcp without our reader ending.
            let _ = tokio::time::timeout(Duration::from_millis(500), notified).await;
        }
    }

    /// Resolves once the connection is degraded (see the module rules).
    pub async fn until_degraded(&self) {
        self.tap.until_degraded().await;
    }

    /// Stops the server and every process of its group: `SIGTERM`, up to `grace`, then
    /// `SIGKILL` (see [`process`]). Returns how it ended (`None`: it never started).
    pub async fn terminate(&self, grace: Duration) -> Option<String> {
        if let Some(h) = &self.http {
            if let Some(c) = &self.client {
                c.cancellation_token().cancel();
            }
            h.bridge.abort();
            self.closed.store(true, Ordering::Release);
            self.gone.notify_waiters();
            return Some("the HTTP connection was closed".to_string());
        }
        let process = self.process.as_ref()?;
        let how = process.terminate(grace).await;
        self.closed.store(true, Ordering::Release);
        self.gone.notify_waiters();
        how
    }

    /// How many `notifications/*/list_changed` the server has sent so far. Counted as the
    /// message is read, so it is current before any later answer is handed to a caller.
    pub fn list_changed_count(&self) -> u64 {
        self.tap.list_changed.load(Ordering::Acquire)
    }

    /// Waits until the server sends a `list_changed` notification after `seen` (a value of
    /// [`Connection::list_changed_count`]).
    pub async fn list_changed_after(&self, seen: u64) {
        loop {
            let notified = self.tap.changed.notified();
            if self.list_changed_count() > seen {
                return;
            }
            notified.await;
        }
    }

    /// True once the server closed the connection (its stdout ended, or a request found
    /// the transport closed). A degraded connection has not exited: it is refused, not
    /// restarted (a server that broke the protocol is not started again by itself).
    pub fn has_exited(&self) -> bool {
        // Degrading stops the reader too; that is not the server going away.
        (self.closed.load(Ordering::Acquire) || self.client.as_ref().is_none_or(|c| c.is_closed()))
            && self.tap.degraded.get().is_none()
    }

    /// True while the server has left [`STALL_AFTER`] or more requests in a row unanswered
    /// until their callers stopped waiting (module rules), and answered nothing since.
    pub fn is_stalled(&self) -> bool {
        self.stall.is_stalled()
    }

    /// Requests in a row the server left unanswered (0 once it answers one).
    pub fn unanswered_in_a_row(&self) -> u32 {
        self.stall.unanswered.load(Ordering::Acquire)
    }

    /// Returns once the connection [is stalled](Self::is_stalled) (at once if it is).
    pub async fn until_stalled(&self) {
        loop {
            let changed = self.stall.changed.notified();
            if self.is_stalled() {
                return;
            }
            changed.await;
        }
    }

    /// Sends MCP `ping` and waits at most `timeout` for its answer (which, like any
    /// answer, ends a stall). A ping whose timeout passes does not count as a missed
    /// request.
    ///
    /// # Errors
    /// As [`Connection::call_tool`]: unavailable (closed, degraded, no answer in time) or
    /// a protocol error.
    pub async fn ping(&self, timeout: Duration) -> Result<(), UpstreamFailure> {
        let request = ClientRequest::PingRequest(rmcp::model::PingRequest::default());
        self.request_counted(request, timeout, None, false)
            .await
            .map(|_| ())
            .map_err(|(failure, _)| failure)
    }

    /// True while the rmcp client is running (the server has not closed the connection)
    /// and the connection is not degraded.
    pub fn is_open(&self) -> bool {
        !self.closed.load(Ordering::Acquire)
            && self.client.as_ref().is_some_and(|c| !c.is_closed())
            && self.tap.degraded.get().is_none()
    }

    /// Why the connection is degraded (the server broke JSON-RPC; see the module rules),
    /// as a sentence naming the connection; `None` while it is not.
    pub fn degraded(&self) -> Option<String> {
        self.tap.degraded.get().map(|why| {
            format!(
                "connection `{}` is degraded: the server sent {why}; it serves no requests until the host restarts it",
                self.name
            )
        })
    }

    /// `work`, unless the connection degrades first.
    async fn unless_degraded<T>(
        &self,
        work: impl Future<Output = T>,
    ) -> Result<T, UpstreamFailure> {
        tokio::select! {
            done = work => Ok(done),
            () = self.tap.until_degraded() => Err(self.degraded_failure()),
        }
    }

    fn degraded_failure(&self) -> UpstreamFailure {
        UpstreamFailure::Unavailable(self.degraded().unwrap_or_default())
    }

    /// Discovery: the raw initialize result and the full paginated lists of tools,
    /// resources, resource templates and prompts, as the server sent them. Lists the
    /// server does not advertise in its capabilities are empty. One discovery runs at a
    /// time per connection.
    ///
    /// # Errors
    /// A list request failed or timed out (`timeout` per page), a server repeated a cursor,
    /// or a list exceeded [`MAX_DISCOVERY_PAGES`] / [`MAX_DISCOVERY_ITEMS`].
    pub async fn discover(&self, timeout: Duration) -> Result<RawDiscovery, UpstreamFailure> {
        let _one_at_a_time = self.discovery.lock().await;
        self.tap.armed.store(true, Ordering::Release);
        let result = self.discover_armed(timeout).await;
        self.tap.armed.store(false, Ordering::Release);
        Tap::lock(&self.tap.pending).clear();
        Tap::lock(&self.tap.captured).clear();
        result
    }

    async fn discover_armed(&self, timeout: Duration) -> Result<RawDiscovery, UpstreamFailure> {
        // The initialize answer was captured at the handshake; keep it for every discovery.
        let initialize = {
            let mut first = self
                .first_initialize
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if first.is_none() {
                *first = self.tap.take("initialize");
            }
            if first.is_none() && self.http.is_some() {
                // A 2026-07-28 server answered `server/discover`: what rmcp read of it has
                // the same keys as an initialize result.
                *first = self
                    .client
                    .as_ref()
                    .and_then(|c| c.peer_info())
                    .and_then(|i| serde_json::to_value(i).ok());
            }
            first.clone().ok_or_else(|| {
                UpstreamFailure::Protocol("the raw initialize answer was not captured".into())
            })?
        };
        let caps = initialize
            .get("capabilities")
            .cloned()
            .unwrap_or(Value::Null);
        let has = |key: &str| caps.get(key).is_some_and(|v| !v.is_null());
        let mut out = RawDiscovery {
            initialize,
            tools: vec![],
            resources: vec![],
            resource_templates: vec![],
            prompts: vec![],
        };
        if has("tools") {
            out.tools = self.list_all("tools/list", "tools", timeout).await?;
        }
        if has("resources") {
            out.resources = self
                .list_all("resources/list", "resources", timeout)
                .await?;
            out.resource_templates = self
                .list_all("resources/templates/list", "resourceTemplates", timeout)
                .await?;
        }
        if has("prompts") {
            out.prompts = self.list_all("prompts/list", "prompts", timeout).await?;
        }
        Ok(out)
    }

    /// Walks every page of one list; returns the raw items.
    async fn list_all(
        &self,
        method: &'static str,
        key: &str,
        timeout: Duration,
    ) -> Result<Vec<Value>, UpstreamFailure> {
        let peer = self.peer().map_err(|e| e.0)?;
        let mut items = Vec::new();
        let mut cursor: Option<String> = None;
        let mut seen_cursors = std::collections::BTreeSet::new();
        for _ in 0..MAX_DISCOVERY_PAGES {
            let params = cursor
                .clone()
                .map(|c| rmcp::model::PaginatedRequestParams::default().with_cursor(Some(c)));
            self.requests.fetch_add(1, Ordering::Relaxed);
            let call = async {
                match method {
                    "tools/list" => peer.list_tools(params).await.map(|_| ()),
                    "resources/list" => peer.list_resources(params).await.map(|_| ()),
                    "resources/templates/list" => {
                        peer.list_resource_templates(params).await.map(|_| ())
                    }
                    _ => peer.list_prompts(params).await.map(|_| ()),
                }
            };
            self.unless_degraded(tokio::time::timeout(timeout, call))
                .await?
                .map_err(|_| self.timed_out(timeout))?
                .map_err(|e| self.failure(e))?;
            let raw = self.tap.take(method).ok_or_else(|| {
                UpstreamFailure::Protocol(format!("the raw {method} answer was not captured"))
            })?;
            match raw.get(key) {
                Some(Value::Array(page)) => items.extend(page.iter().cloned()),
                _ => {
                    return Err(UpstreamFailure::Protocol(format!(
                        "{method} answer has no `{key}` array"
                    )));
                }
            }
            if items.len() > MAX_DISCOVERY_ITEMS {
                return Err(UpstreamFailure::Protocol(format!(
                    "{method} returned more than {MAX_DISCOVERY_ITEMS} items"
                )));
            }
            match raw.get("nextCursor") {
                None | Some(Value::Null) => return Ok(items),
                Some(Value::String(next)) => {
                    if !seen_cursors.insert(next.clone()) {
                        return Err(UpstreamFailure::Protocol(format!(
                            "{method} repeated a cursor; the server's pagination loops"
                        )));
                    }
                    cursor = Some(next.clone());
                }
                Some(_) => {
                    return Err(UpstreamFailure::Protocol(format!(
                        "{method} answer has a nextCursor that is not a string"
                    )));
                }
            }
        }
        Err(UpstreamFailure::Protocol(format!(
            "{method} spans more than {MAX_DISCOVERY_PAGES} pages"
        )))
    }

    /// Raises the per-message budget to at least `bytes` (a mapping loaded later may
    /// need more than the ones loaded at start; each mapping still checks its own).
    /// The largest message accepted now, in bytes (see [`Connection::raise_message_budget`]).
    pub fn message_budget(&self) -> u64 {
        self.max_message_bytes.load(Ordering::Acquire) as u64
    }

    /// Raises the largest accepted message to `bytes` (never lowers it).
    pub fn raise_message_budget(&self, bytes: u64) {
        let bytes = usize::try_from(bytes).unwrap_or(usize::MAX);
        self.max_message_bytes.fetch_max(bytes, Ordering::AcqRel);
    }

    /// The connection's configured name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Requests sent on this connection so far.
    pub fn requests_sent(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Messages discarded for exceeding the output budget so far.
    pub fn messages_discarded(&self) -> u64 {
        self.discarded.load(Ordering::Relaxed)
    }

    /// The server's reported implementation name and version (an observation, not a key).
    pub fn server_info(&self) -> Option<(String, String)> {
        self.client.as_ref()?.peer_info().and_then(|i| {
            i.server_info
                .as_ref()
                .map(|s| (s.name.clone(), s.version.clone()))
        })
    }

    /// Sends `tools/call` and returns the result as JSON with the request's JSON-RPC id.
    /// With `trace` (telemetry on), the request has its own client span and carries its
    /// context in `params._meta` ([`spans`]).
    ///
    /// # Errors
    /// See [`UpstreamFailure`], with the request's id when it was sent; `timeout` elapsing
    /// is `Unavailable` and `cancel` firing is `Cancelled` (in both cases the server is
    /// sent `notifications/cancelled`).
    pub async fn call_tool(
        &self,
        tool: &str,
        arguments: JsonObject,
        timeout: Duration,
        cancel: Option<&CancellationToken>,
        trace: Option<&spans::CallTrace>,
    ) -> Result<(Value, String), (UpstreamFailure, Option<String>)> {
        let (span, meta) = match trace {
            Some(t) => {
                let (span, meta) = t.start(CALL_TOOL.0, Some(tool), &self.name, self.transport());
                (Some(span), Some(meta))
            }
            None => (None, None),
        };
        let answer = if let Some(out) = &self.outbound {
            #[derive(serde::Serialize)]
            struct Params<'a> {
                #[serde(rename = "_meta", skip_serializing_if = "Option::is_none")]
                meta: Option<&'a JsonObject>,
                name: &'a str,
                arguments: &'a JsonObject,
            }
            let params = Params {
                meta: meta.as_ref(),
                name: tool,
                arguments: &arguments,
            };
            self.request_direct::<rmcp::model::CallToolResult>(
                out, CALL_TOOL, &params, timeout, cancel,
            )
            .await
        } else {
            let mut params = CallToolRequestParams::new(tool.to_string());
            params.arguments = Some(arguments);
            let mut request = ClientRequest::CallToolRequest(CallToolRequest::new(params));
            if let Some(meta) = meta {
                request
                    .get_meta_mut()
                    .extend(rmcp::model::MetaObject(meta).into());
            }
            self.request_checked(request, CALL_TOOL, timeout, cancel, |r| match r {
                ServerResult::CallToolResult(result) => Some(result),
                _ => None,
            })
            .await
        };
        if let Some(span) = span {
            span.end(&answer);
        }
        answer
    }

    /// Sends `resources/read` and returns the result as JSON with the request's id.
    ///
    /// # Errors
    /// As [`Connection::call_tool`].
    pub async fn read_resource(
        &self,
        uri: &str,
        timeout: Duration,
        cancel: Option<&CancellationToken>,
        trace: Option<&spans::CallTrace>,
    ) -> Result<(Value, String), (UpstreamFailure, Option<String>)> {
        let (span, meta) = match trace {
            Some(t) => {
                let (span, meta) = t.start(READ_RESOURCE.0, None, &self.name, self.transport());
                (Some(span), Some(meta))
            }
            None => (None, None),
        };
        let mut params = serde_json::json!({"uri": uri});
        if let Some(meta) = meta {
            params["_meta"] = Value::Object(meta);
        }
        let answer = if let Some(out) = &self.outbound {
            self.request_direct::<rmcp::model::ReadResourceResult>(
                out,
                READ_RESOURCE,
                &params,
                timeout,
                cancel,
            )
            .await
        } else {
            match serde_json::from_value::<ReadResourceRequestParams>(params) {
                Ok(params) => {
                    let request =
                        ClientRequest::ReadResourceRequest(ReadResourceRequest::new(params));
                    self.request_checked(request, READ_RESOURCE, timeout, cancel, |r| match r {
                        ServerResult::ReadResourceResult(result) => Some(result),
                        _ => None,
                    })
                    .await
                }
                Err(e) => Err((UpstreamFailure::Protocol(e.to_string()), None)),
            }
        };
        if let Some(span) = span {
            span.end(&answer);
        }
        answer
    }

    /// The OpenTelemetry `network.transport` of this connection: `pipe` for a stdio
    /// server, `tcp` for Streamable HTTP, `None` for a replayed one.
    fn transport(&self) -> Option<&'static str> {
        if self.process.is_some() {
            Some("pipe")
        } else if self.http.as_ref().is_some_and(|h| !h.replayed) {
            Some("tcp")
        } else {
            None
        }
    }

    /// Sends `request` (`(method, kind)`: its method and the result type's name, e.g.
    /// [`CALL_TOOL`]) and returns its answer's `result` as JSON with
    /// the request's id: the JSON the reader kept ([`RawAnswers`]), checked against `T`
    /// by reference (the check's value is dropped), or else rmcp's typed result as
    /// `typed` picks it out, converted to JSON.
    ///
    /// # Errors
    /// As [`Connection::request`]; an answer that is not a `T` (or another kind of result)
    /// is `Protocol`, naming `method` and `T`.
    async fn request_checked<T>(
        &self,
        request: ClientRequest,
        (method, kind): (&str, &str),
        timeout: Duration,
        cancel: Option<&CancellationToken>,
        typed: fn(ServerResult) -> Option<T>,
    ) -> Result<(Value, String), (UpstreamFailure, Option<String>)>
    where
        T: serde::de::DeserializeOwned + serde::Serialize,
    {
        let protocol = |why: String, id: String| (UpstreamFailure::Protocol(why), Some(id));
        match self.request(request, timeout, cancel).await? {
            (_, Some(raw), id) => match T::deserialize(&raw) {
                Ok(_) => Ok((raw, id)),
                Err(e) => Err(protocol(
                    format!("the server's answer to {method} is not a {kind}: {e}"),
                    id,
                )),
            },
            (result, None, id) => match typed(result).map(serde_json::to_value) {
                Some(Ok(v)) => Ok((v, id)),
                Some(Err(e)) => Err(protocol(e.to_string(), id)),
                None => Err(protocol(
                    format!("the server answered {method} with another kind of result"),
                    id,
                )),
            },
        }
    }

    /// Sends one request and waits at most `timeout` (or until `cancel` fires); either
    /// way the server is then told the request is cancelled. Returns the result, the
    /// answer's `result` as JSON when the reader kept it ([`RawAnswers`]; rmcp's result is
    /// then a stub), and the request's JSON-RPC id.
    async fn request(
        &self,
        request: ClientRequest,
        timeout: Duration,
        cancel: Option<&CancellationToken>,
    ) -> Result<(ServerResult, Option<Value>, String), (UpstreamFailure, Option<String>)> {
        self.request_counted(request, timeout, cancel, true).await
    }

    /// [`Connection::request`]; when `counts`, a request left unanswered until its caller
    /// stopped waiting counts toward a stall (module rules), and any answer ends one.
    async fn request_counted(
        &self,
        request: ClientRequest,
        timeout: Duration,
        cancel: Option<&CancellationToken>,
        counts: bool,
    ) -> Result<(ServerResult, Option<Value>, String), (UpstreamFailure, Option<String>)> {
        if self.tap.degraded.get().is_some() {
            return Err((self.degraded_failure(), None));
        }
        let peer = self.peer()?;
        self.requests.fetch_add(1, Ordering::Relaxed);
        let handle = peer
            .send_request_with_option(request, PeerRequestOptions::no_options())
            .await
            .map_err(|e| (self.failure(e), None))?;
        let id = handle.id.clone();
        // The id as the reader's tap spells it (JSON text).
        let key = serde_json::to_string(&id).unwrap_or_default();
        let mut unsettled = Unsettled {
            peer,
            tap: &self.tap,
            stall: counts.then_some(&*self.stall),
            id: Some(id.clone()),
            key: key.clone(),
        };
        let cancelled = async {
            match cancel {
                Some(c) => c.cancelled().await,
                None => std::future::pending().await,
            }
        };
        let answered = tokio::select! {
            answer = tokio::time::timeout(timeout, handle.await_response()) => match answer {
                Ok(Ok(result)) => Ok(result),
                Ok(Err(e)) => Err(Ok(self.failure(e))),
                Err(_) => Err(Err((self.timed_out(timeout), "the caller's deadline passed"))),
            },
            () = cancelled => Err(Err((UpstreamFailure::Cancelled, "the caller cancelled the request"))),
            () = self.tap.until_degraded() => Err(Ok(self.degraded_failure())),
        };
        // Settled either way: a kept answer is taken, and a late one is no longer kept.
        let raw = self.tap.take_raw(&key);
        // rmcp settled a kept answer with the stub's error (`kept_stub`): the server answered.
        let answered = match answered {
            Err(Ok(_)) if raw.is_some() => Ok(ServerResult::empty(())),
            other => other,
        };
        let (failure, reason) = match answered {
            Ok(result) => {
                unsettled.id = None;
                self.stall.answered();
                return Ok((result, raw, id.to_string()));
            }
            Err(Ok(failure)) => {
                unsettled.id = None;
                if failure.answered() {
                    self.stall.answered();
                }
                return Err((failure, Some(id.to_string())));
            }
            Err(Err(cancelled)) => cancelled,
        };
        if counts && !matches!(failure, UpstreamFailure::Cancelled) {
            self.stall.missed();
        }
        let _ = peer
            .notify_cancelled(CancelledNotificationParam::new(
                Some(id.clone()),
                Some(reason.into()),
            ))
            .await;
        unsettled.id = None;
        Err((failure, Some(id.to_string())))
    }

    /// Sends one request `(method, kind)` (its method and the result type's name) with
    /// `params` on the connection's own stream ([`direct`]), without rmcp, and waits at
    /// most `timeout` (or until `cancel` fires) for its answer, which the reader hands over
    /// parsed once; returns its `result` checked against `T` by reference, with the
    /// request's JSON-RPC id. A request that ends without its answer (timeout,
    /// cancellation, or its caller going away) is cancelled toward the server, and its
    /// late answer dropped.
    ///
    /// # Errors
    /// As [`Connection::request_checked`]: unavailable (degraded, closed, not sent,
    /// timed out), cancelled, too large, or a protocol error (an error answer, or a result
    /// that is not a `T`).
    async fn request_direct<T>(
        &self,
        out: &direct::Outbound,
        (method, kind): (&str, &str),
        params: &impl serde::Serialize,
        timeout: Duration,
        cancel: Option<&CancellationToken>,
    ) -> Result<(Value, String), (UpstreamFailure, Option<String>)>
    where
        T: serde::de::DeserializeOwned,
    {
        if self.tap.degraded.get().is_some() {
            return Err((self.degraded_failure(), None));
        }
        let id = self.next_direct.fetch_add(1, Ordering::Relaxed);
        let key = id.to_string();
        let line = direct::request_line(id, method, params)
            .map_err(|e| (UpstreamFailure::Protocol(e.to_string()), None))?;
        let Some(answer) = self.tap.expect_direct(&key) else {
            return Err((self.output_ended("; nothing was sent"), None));
        };
        if let Err(e) = out.send(&line) {
            self.tap.forget_direct(&key);
            self.closed.store(true, Ordering::Release);
            return Err((
                UpstreamFailure::Unavailable(format!(
                    "connection `{}`: the request could not be written ({e}); nothing was sent",
                    self.name
                )),
                None,
            ));
        }
        self.requests.fetch_add(1, Ordering::Relaxed);
        let mut unsettled = DirectUnsettled {
            out,
            tap: &self.tap,
            stall: &self.stall,
            id: Some(id),
        };
        let cancelled = async {
            match cancel {
                Some(c) => c.cancelled().await,
                None => std::future::pending().await,
            }
        };
        let answered = tokio::select! {
            answer = tokio::time::timeout(timeout, answer) => match answer {
                Ok(Ok(answer)) => Ok(answer),
                // The waiter was dropped: the stream ended or degraded.
                Ok(Err(_)) => Err(Ok(self.output_ended(" before it answered"))),
                Err(_) => Err(Err((self.timed_out(timeout), "the caller's deadline passed"))),
            },
            () = cancelled => Err(Err((UpstreamFailure::Cancelled, "the caller cancelled the request"))),
            () = self.tap.until_degraded() => Err(Ok(self.degraded_failure())),
        };
        let protocol = |why: String| (UpstreamFailure::Protocol(why), Some(key.clone()));
        let answer = match answered {
            Ok(answer) => {
                unsettled.id = None;
                self.stall.answered();
                answer
            }
            Err(Ok(failure)) => {
                unsettled.id = None;
                return Err((failure, Some(key.clone())));
            }
            Err(Err((failure, reason))) => {
                if !matches!(failure, UpstreamFailure::Cancelled) {
                    self.stall.missed();
                }
                unsettled.cancel(reason);
                return Err((failure, Some(key.clone())));
            }
        };
        match answer {
            direct::Answer::Result(raw) => match T::deserialize(&raw) {
                Ok(_) => Ok((raw, key)),
                Err(e) => Err(protocol(format!(
                    "the server's answer to {method} is not a {kind}: {e}"
                ))),
            },
            direct::Answer::Error(_, message) => Err(protocol(message)),
            direct::Answer::TooLarge => Err((
                UpstreamFailure::OutputTooLarge(
                    self.max_message_bytes.load(Ordering::Acquire) as u64
                ),
                Some(key.clone()),
            )),
        }
    }

    /// Why a direct request failed with the server's output gone: the stream degraded
    /// (why), or it ended (then the connection is closed) — `when` follows the words "the
    /// server's output ended", e.g. " before it answered".
    fn output_ended(&self, when: &str) -> UpstreamFailure {
        if self.tap.degraded.get().is_some() {
            return self.degraded_failure();
        }
        self.closed.store(true, Ordering::Release);
        UpstreamFailure::Unavailable(format!(
            "connection `{}`: the server's output ended{when}",
            self.name
        ))
    }

    /// The rmcp peer, or why there is none (the server never started).
    fn peer(&self) -> Result<&rmcp::service::Peer<RoleClient>, (UpstreamFailure, Option<String>)> {
        match &self.client {
            Some(c) => Ok(c.peer()),
            None => Err((
                UpstreamFailure::Unavailable(format!(
                    "connection `{}` is not connected: {}",
                    self.name,
                    self.unstarted.as_deref().unwrap_or("it never started")
                )),
                None,
            )),
        }
    }

    fn timed_out(&self, timeout: Duration) -> UpstreamFailure {
        UpstreamFailure::Unavailable(format!(
            "connection `{}` did not answer within {} ms",
            self.name,
            timeout.as_millis()
        ))
    }

    fn failure(&self, error: ServiceError) -> UpstreamFailure {
        match error {
            ServiceError::McpError(e) if e.code == ErrorCode(http::HTTP_TRANSPORT_ERROR_CODE) => {
                UpstreamFailure::Unavailable(format!("connection `{}`: {}", self.name, e.message))
            }
            ServiceError::McpError(e) if e.code == ErrorCode(OUTPUT_BUDGET_ERROR_CODE) => {
                UpstreamFailure::OutputTooLarge(
                    self.max_message_bytes.load(Ordering::Acquire) as u64
                )
            }
            ServiceError::McpError(e) => UpstreamFailure::Protocol(e.message.into_owned()),
            _ if self.tap.degraded.get().is_some() => self.degraded_failure(),
            other => {
                if matches!(
                    other,
                    ServiceError::TransportClosed | ServiceError::TransportSend(_)
                ) {
                    self.closed.store(true, Ordering::Release);
                }
                UpstreamFailure::Unavailable(format!("connection `{}`: {other}", self.name))
            }
        }
    }
}

/// `tools/call` and the type its result must be ([`Connection::call_tool`]).
const CALL_TOOL: (&str, &str) = ("tools/call", "CallToolResult");
/// `resources/read` and the type its result must be ([`Connection::read_resource`]).
const READ_RESOURCE: (&str, &str) = ("resources/read", "ReadResourceResult");

/// A request sent and not yet settled. Dropped unsettled — its caller stopped waiting
/// while it was in flight, e.g. the adapter call's own deadline fired around it, or the
/// call was dropped — the server is still told the request is cancelled (on a task of its
/// own) and a late answer is not kept.
struct Unsettled<'a> {
    peer: &'a rmcp::service::Peer<RoleClient>,
    tap: &'a Tap,
    /// Where a request dropped unsettled counts as missed (`None`: it does not).
    stall: Option<&'a Stall>,
    /// `None` once settled.
    id: Option<rmcp::model::RequestId>,
    key: String,
}

impl Drop for Unsettled<'_> {
    fn drop(&mut self) {
        let Some(id) = self.id.take() else {
            return;
        };
        if let Some(stall) = self.stall {
            stall.missed();
        }
        self.tap.take_raw(&self.key);
        let peer = self.peer.clone();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = peer
                    .notify_cancelled(CancelledNotificationParam::new(
                        Some(id),
                        Some("the caller stopped waiting".into()),
                    ))
                    .await;
            });
        }
    }
}

/// A direct request written and not yet settled: dropped unsettled (its caller stopped
/// waiting, e.g. the adapter call's own deadline fired around it) or cancelled, the
/// server is told (`notifications/cancelled`, on the same stream, in order) and a late
/// answer is dropped.
struct DirectUnsettled<'a> {
    out: &'a direct::Outbound,
    tap: &'a Tap,
    stall: &'a Stall,
    /// `None` once settled.
    id: Option<u64>,
}

impl DirectUnsettled<'_> {
    fn cancel(&mut self, reason: &str) {
        let Some(id) = self.id.take() else {
            return;
        };
        self.tap.forget_direct(&id.to_string());
        // A stream that failed or is closing takes nothing more; the server is gone then.
        let _ = self.out.send(&direct::cancelled_line(id, reason));
    }
}

impl Drop for DirectUnsettled<'_> {
    fn drop(&mut self) {
        if self.id.is_some() {
            self.stall.missed();
        }
        self.cancel("the caller stopped waiting");
    }
}

/// The server's messages as rmcp reads them: newline-delimited JSON-RPC from `inner` (a
/// server's stdout, or the HTTP bridge's output), filtered in place while rmcp reads, with
/// no task or pipe of its own.
///
/// - A message longer than the budget (`limit` bytes; while discovery runs,
///   [`DISCOVERY_MESSAGE_BYTES`] at least) is discarded while it streams, never buffered
///   whole. When its top-level `id` could be read, an error answer with
///   [`OUTPUT_BUDGET_ERROR_CODE`] takes its place, so the waiting request fails at once.
/// - Every message that fits is checked by the [`Tap`]; one that breaks JSON-RPC degrades
///   the connection and ends the stream there (what came before it is still delivered).
/// - When the stream ends (the server's end, a read error, degrading, or rmcp dropping
///   the reader), `closed` is set and `gone` woken, once.
struct Filtered<R> {
    inner: R,
    /// One read from `inner`.
    chunk: Box<[u8]>,
    /// The message being read (newline included once it ends).
    line: Vec<u8>,
    /// Set while an over-budget message is skipped: what finds its id.
    scanner: Option<IdScanner>,
    /// Filtered bytes not yet handed to rmcp, from `out_at`.
    out: Vec<u8>,
    out_at: usize,
    /// No more input is read: what is in `out` is delivered, then the end.
    ended: bool,
    limit: Arc<std::sync::atomic::AtomicUsize>,
    discarded: Arc<AtomicU64>,
    tap: Option<Arc<Tap>>,
    on_end: Option<(Arc<std::sync::atomic::AtomicBool>, Arc<tokio::sync::Notify>)>,
}

impl<R> Filtered<R> {
    fn new(
        inner: R,
        limit: &Arc<std::sync::atomic::AtomicUsize>,
        discarded: &Arc<AtomicU64>,
        tap: Option<&Arc<Tap>>,
        on_end: Option<(
            &Arc<std::sync::atomic::AtomicBool>,
            &Arc<tokio::sync::Notify>,
        )>,
    ) -> Self {
        Self {
            inner,
            chunk: vec![0; 64 * 1024].into_boxed_slice(),
            line: Vec::new(),
            scanner: None,
            out: Vec::new(),
            out_at: 0,
            ended: false,
            limit: limit.clone(),
            discarded: discarded.clone(),
            tap: tap.cloned(),
            on_end: on_end.map(|(c, g)| (c.clone(), g.clone())),
        }
    }

    /// The stream ended: mark the connection closed and wake its waiters (once).
    fn end(&mut self) {
        self.ended = true;
        if let Some(tap) = &self.tap {
            tap.close_direct();
        }
        if let Some((closed, gone)) = self.on_end.take() {
            closed.store(true, Ordering::Release);
            gone.notify_waiters();
        }
    }

    /// Filters `data`, one read's bytes, into `out`.
    fn process(&mut self, data: &[u8]) {
        let mut rest = data;
        while !rest.is_empty() && !self.ended {
            let (piece, ends_line) = match rest.iter().position(|&b| b == b'\n') {
                Some(i) => (&rest[..=i], true),
                None => (rest, false),
            };
            rest = &rest[piece.len()..];
            let limit = self.limit.load(Ordering::Acquire);
            // Discovery answers (a full tools/list page) may be larger than any tool result
            // a mapping accepts; while discovery runs, the ceiling applies instead.
            let limit = match &self.tap {
                Some(tap) if tap.armed.load(Ordering::Acquire) => {
                    limit.max(DISCOVERY_MESSAGE_BYTES)
                }
                _ => limit,
            };
            match self.scanner.as_mut() {
                Some(scan) => scan.feed(piece),
                None if self.line.len() + piece.len() > limit.saturating_add(1) => {
                    let mut scan = IdScanner::default();
                    scan.feed(&self.line);
                    scan.feed(piece);
                    self.line.clear();
                    self.line.shrink_to(64 * 1024);
                    self.scanner = Some(scan);
                }
                None => self.line.extend_from_slice(piece),
            }
            if ends_line {
                self.end_line(limit);
            }
        }
    }

    /// One message ended: pass it, replace it with a budget error, or degrade.
    fn end_line(&mut self, limit: usize) {
        match self.scanner.take() {
            Some(scan) => {
                self.discarded.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    limit,
                    "discarded an upstream message larger than the output budget"
                );
                let id = scan.id();
                if let (Some(tap), Some(id)) = (&self.tap, &id)
                    && let Err(why) = tap.answered(&id.to_string())
                {
                    degrade(tap, why);
                    self.end();
                    return;
                }
                if let (Some(tap), Some(id)) = (&self.tap, &id)
                    && tap.is_direct(&id.to_string())
                {
                    tap.answer_direct(&id.to_string(), direct::Answer::TooLarge);
                } else if let Some(id) = id {
                    let reply = serde_json::json!({
                        "jsonrpc": "2.0",
                        "id": id,
                        "error": {
                            "code": OUTPUT_BUDGET_ERROR_CODE,
                            "message": format!("airlock: upstream answer exceeded the output budget of {limit} bytes and was discarded"),
                        },
                    });
                    if serde_json::to_writer(&mut self.out, &reply).is_ok() {
                        self.out.push(b'\n');
                    }
                }
            }
            None => {
                let stub = match &self.tap {
                    Some(tap) => match tap.incoming(&self.line) {
                        Err(why) => {
                            degrade(tap, why);
                            self.line.clear();
                            self.end();
                            return;
                        }
                        Ok(Incoming::Direct(id)) => {
                            // Its waiter's, not rmcp's: nothing of it goes on.
                            tap.answer_direct(&id, direct_answer(&self.line));
                            self.line.clear();
                            return;
                        }
                        Ok(Incoming::Keep(id)) => tap.keep_raw(&id, &self.line),
                        Ok(Incoming::Pass) => None,
                    },
                    None => None,
                };
                self.out
                    .extend_from_slice(stub.as_deref().unwrap_or(&self.line));
            }
        }
        self.line.clear();
        if self.line.capacity() > 1024 * 1024 {
            self.line.shrink_to(64 * 1024);
        }
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for Filtered<R> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        let this = &mut *self;
        loop {
            if this.out_at < this.out.len() {
                let n = (this.out.len() - this.out_at).min(buf.remaining());
                buf.put_slice(&this.out[this.out_at..this.out_at + n]);
                this.out_at += n;
                if this.out_at == this.out.len() {
                    this.out.clear();
                    this.out_at = 0;
                    if this.out.capacity() > 1024 * 1024 {
                        this.out.shrink_to(64 * 1024);
                    }
                }
                return Poll::Ready(Ok(()));
            }
            if this.ended {
                this.end();
                return Poll::Ready(Ok(()));
            }
            let mut chunk = std::mem::take(&mut this.chunk);
            let mut read = tokio::io::ReadBuf::new(&mut chunk);
            let polled = std::pin::Pin::new(&mut this.inner).poll_read(cx, &mut read);
            let n = read.filled().len();
            match polled {
                Poll::Pending => {
                    this.chunk = chunk;
                    return Poll::Pending;
                }
                Poll::Ready(Ok(())) if n > 0 => this.process(&chunk[..n]),
                // The server's end, or a read error: nothing more will be answered.
                Poll::Ready(_) => this.end(),
            }
            this.chunk = chunk;
        }
    }
}

impl<R> Drop for Filtered<R> {
    fn drop(&mut self) {
        // rmcp stopped reading: nothing more will be answered either.
        self.end();
    }
}

/// Copies `from` to `to` through [`Filtered`] with no tap, then shuts `to` down (the
/// filter's unit tests).
#[cfg(test)]
async fn filter_messages(
    from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    limit: Arc<std::sync::atomic::AtomicUsize>,
    discarded: Arc<AtomicU64>,
    tap: Option<Arc<Tap>>,
) {
    use tokio::io::AsyncWriteExt as _;
    let mut filtered = Filtered::new(from, &limit, &discarded, tap.as_ref(), None);
    let _ = tokio::io::copy(&mut filtered, &mut to).await;
    let _ = to.shutdown().await;
}

/// Degrades the connection: the reader stops here, so rmcp sees the stream end (and every
/// direct waiter fails now).
fn degrade(tap: &Tap, why: String) {
    tracing::warn!(
        connection = %tap.label,
        "upstream broke JSON-RPC: it sent {why}; the connection is degraded and reads nothing more"
    );
    tap.degrade(why);
    tap.close_direct();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kept answer's stub is one rmcp reads as an error answering the same id (number or
    /// string), and the kept result is what the caller takes, once.
    #[test]
    fn a_kept_answer_reaches_rmcp_as_an_error_stub_with_its_id() {
        use rmcp::service::RxJsonRpcMessage;
        for (id, expected) in [
            ("7", rmcp::model::RequestId::Number(7)),
            (
                r#""req-\"x\"""#,
                rmcp::model::RequestId::String("req-\"x\"".into()),
            ),
        ] {
            let tap = Tap::default();
            tap.outgoing(
                format!(
                    r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"t"}}}}"#
                )
                .as_bytes(),
            );
            let line = format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{{"content":[],"n":1}}}}"#);
            let Incoming::Keep(kept) = tap.incoming(line.as_bytes()).unwrap() else {
                panic!("a kept answer");
            };
            let stub = tap.keep_raw(&kept, line.as_bytes()).expect("a stub");
            match serde_json::from_slice::<RxJsonRpcMessage<RoleClient>>(&stub).unwrap() {
                rmcp::model::JsonRpcMessage::Error(e) => {
                    assert_eq!(e.id, Some(expected));
                    assert_eq!(e.error.code.0, KEPT_ANSWER_CODE);
                }
                other => panic!("the stub is not an error: {other:?}"),
            }
            assert_eq!(
                tap.take_raw(&kept),
                Some(serde_json::json!({"content": [], "n": 1}))
            );
            assert_eq!(tap.take_raw(&kept), None);
        }
    }

    /// What rmcp's reader pays for the stub, against the `"result": {}` stub it replaced.
    /// A measurement, not a check: `cargo test --release -p airlock --lib -- --ignored
    /// --nocapture stub_parsing_cost`.
    #[test]
    #[ignore = "a measurement; run it by name"]
    fn stub_parsing_cost() {
        use rmcp::service::RxJsonRpcMessage;
        let n = 100_000;
        let time = |line: &[u8]| {
            let t = std::time::Instant::now();
            for _ in 0..n {
                std::hint::black_box(
                    serde_json::from_slice::<RxJsonRpcMessage<RoleClient>>(line).unwrap(),
                );
            }
            t.elapsed() / n
        };
        let empty = time(br#"{"jsonrpc":"2.0","id":12345,"result":{}}"#);
        let error = time(&kept_stub("12345"));
        eprintln!("rmcp reads a result:{{}} stub in {empty:?}, the error stub in {error:?}");
    }

    #[test]
    fn list_changed_is_counted_however_it_is_spelled_or_padded() {
        let tap = Tap::default();
        let padding = "x".repeat(10_000);
        for line in [
            r#"{"jsonrpc":"2.0","method":"notifications/tools/list_changed"}"#.to_string(),
            r#"{"jsonrpc":"2.0","method":"notifications/tools/list\u005fchanged"}"#.to_string(),
            format!(
                r#"{{"jsonrpc":"2.0","params":{{"_meta":{{"pad":"{padding}"}}}},"method":"notifications/prompts/list_changed"}}"#
            ),
            r#"{"method":"notifications/resources/list_changed","jsonrpc":"2.0"}"#.to_string(),
        ] {
            let before = tap.list_changed.load(Ordering::Acquire);
            tap.incoming(line.as_bytes()).unwrap();
            assert_eq!(
                tap.list_changed.load(Ordering::Acquire),
                before + 1,
                "{line:.120}"
            );
        }
        // Not notifications of a change: a request, an answer, another method, garbage.
        tap.outgoing(br#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{}}"#);
        for line in [
            r#"{"jsonrpc":"2.0","id":1,"method":"notifications/tools/list_changed"}"#,
            r#"{"jsonrpc":"2.0","id":2,"result":{"method":"notifications/tools/list_changed"}}"#,
            r#"{"jsonrpc":"2.0","method":"notifications/message","params":{"data":"list_changed"}}"#,
        ] {
            tap.incoming(line.as_bytes()).unwrap();
        }
        tap.incoming(br#"{"jsonrpc":"2.0","method":"notifications/tools/list_changed""#)
            .unwrap_err();
        assert_eq!(tap.list_changed.load(Ordering::Acquire), 4);
    }

    /// Accepts at most 7 bytes per write: every line spans several writes.
    struct Trickle(Vec<u8>);

    impl AsyncWrite for Trickle {
        fn poll_write(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            let n = buf.len().min(7);
            self.0.extend_from_slice(&buf[..n]);
            std::task::Poll::Ready(Ok(n))
        }
        fn poll_flush(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
        fn poll_shutdown(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn the_tap_writer_registers_requests_split_across_writes() {
        use tokio::io::AsyncWriteExt as _;
        let tap = Arc::new(Tap::default());
        let mut writer = TapWriter {
            inner: Trickle(Vec::new()),
            tap: tap.clone(),
            partial: Vec::new(),
        };
        let lines = concat!(
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{}}"#,
            "\n",
            r#"{"jsonrpc":"2.0","id":"two","method":"ping"}"#,
            "\n",
            r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
            "\n",
            r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"arguments":{"q":"x\ny"}}}"#,
            "\n",
        );
        // Whole, in one buffer (written 7 bytes at a time), then in uneven pieces.
        writer.write_all(lines.as_bytes()).await.unwrap();
        assert_eq!(writer.inner.0, lines.as_bytes(), "bytes pass unchanged");
        for id in ["1", r#""two""#, "3"] {
            tap.answered(id).unwrap_or_else(|e| panic!("{id}: {e}"));
        }
        let more = r#"{"jsonrpc":"2.0","id":4,"method":"ping"}"#.to_string() + "\n";
        let (a, b) = more.as_bytes().split_at(10);
        writer.write_all(a).await.unwrap();
        assert!(tap.answered("4").is_err(), "not open before its line ends");
        writer.write_all(b).await.unwrap();
        tap.answered("4").unwrap();
        assert!(tap.answered("1").is_err(), "answered once");
        assert!(tap.answered("5").is_err(), "never sent");
    }

    #[test]
    fn only_json_rpc_that_answers_an_open_request_passes() {
        let tap = Tap::default();
        tap.outgoing(br#"{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{}}"#);
        tap.outgoing(br#"{"jsonrpc":"2.0","id":"s-1","method":"ping"}"#);
        // Our answer to a server request is not a request of ours.
        tap.outgoing(br#"{"jsonrpc":"2.0","id":9,"result":{}}"#);
        for ok in [
            &br#"{"jsonrpc":"2.0","id":5,"result":{"content":[]}}"#[..],
            br#"{"jsonrpc":"2.0","id":"s-1","error":{"code":-1,"message":"x"}}"#,
            b"   \r\n",
            b"\xef\xbb\xbf{\"jsonrpc\":\"2.0\",\"method\":\"notifications/message\"}",
            br#"{"jsonrpc":"2.0","id":77,"method":"roots/list"}"#,
        ] {
            tap.incoming(ok)
                .unwrap_or_else(|e| panic!("{}: {e}", String::from_utf8_lossy(ok)));
        }
        for (bad, why) in [
            (
                &br#"{"jsonrpc":"2.0","id":5,"result":{}}"#[..],
                "no request",
            ),
            (br#"{"jsonrpc":"2.0","id":9,"result":{}}"#, "no request"),
            (br#"{"jsonrpc":"2.0","id":"5","result":{}}"#, "no request"),
            (b"this is not JSON", "not JSON"),
            (b"\xff\xfe\x00garbage", "not JSON"),
            (b"[1, 2, 3]", "not a JSON-RPC message object"),
            (b"\"text\"", "not a JSON-RPC message object"),
            (br#"{"hello":"world"}"#, "jsonrpc"),
            (br#"{"jsonrpc":"1.0","id":5,"result":{}}"#, "jsonrpc"),
            (
                br#"{"jsonrpc":2,"id":5,"result":{}}"#,
                "not a JSON-RPC message",
            ),
            (br#"{"jsonrpc":"2.0","id":5}"#, "neither or both"),
            (
                br#"{"jsonrpc":"2.0","id":5,"result":{},"error":{"code":1,"message":""}}"#,
                "neither or both",
            ),
            (
                br#"{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"parse error"}}"#,
                "neither a request",
            ),
            (
                br#"{"jsonrpc":"2.0","id":{"a":1},"method":"ping"}"#,
                "neither a string",
            ),
            (br#"{"jsonrpc":"2.0","method":"x""#, "not JSON"),
        ] {
            let err = tap.incoming(bad).unwrap_err();
            assert!(
                err.contains(why),
                "{}: expected `{why}` in {err}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[tokio::test]
    async fn a_malformed_line_degrades_and_nothing_after_it_passes() {
        let tap = Arc::new(Tap::default());
        tap.outgoing(br#"{"jsonrpc":"2.0","id":1,"method":"tools/call"}"#);
        tap.outgoing(br#"{"jsonrpc":"2.0","id":2,"method":"tools/call"}"#);
        let input = "{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}\nnot json at all\n{\"jsonrpc\":\"2.0\",\"id\":2,\"result\":{}}\n";
        let mut out = Vec::new();
        filter_messages(
            input.as_bytes(),
            &mut out,
            Arc::new(std::sync::atomic::AtomicUsize::new(1 << 20)),
            Arc::new(AtomicU64::new(0)),
            Some(tap.clone()),
        )
        .await;
        // The answer before the bad line passed (as the stub of its kept result).
        assert_eq!(out, kept_stub("1"));
        assert_eq!(tap.take_raw("1"), Some(serde_json::json!({})));
        assert_eq!(
            tap.degraded.get().map(String::as_str),
            Some("a line that is not JSON")
        );
        tokio::time::timeout(Duration::from_secs(1), tap.until_degraded())
            .await
            .expect("a waiter learns it at once");
    }

    #[tokio::test]
    async fn an_oversized_answer_to_no_request_degrades() {
        let tap = Arc::new(Tap::default());
        let big = "x".repeat(10_000);
        let input = format!("{{\"jsonrpc\":\"2.0\",\"id\":42,\"result\":{{\"t\":\"{big}\"}}}}\n");
        let mut out = Vec::new();
        filter_messages(
            input.as_bytes(),
            &mut out,
            Arc::new(std::sync::atomic::AtomicUsize::new(1000)),
            Arc::new(AtomicU64::new(0)),
            Some(tap.clone()),
        )
        .await;
        assert!(out.is_empty());
        assert!(tap.degraded.get().unwrap().contains("no request"));
    }

    async fn run_filter(input: &str, limit: usize) -> (String, u64) {
        let discarded = Arc::new(AtomicU64::new(0));
        let mut out = Vec::new();
        filter_messages(
            input.as_bytes(),
            &mut out,
            Arc::new(std::sync::atomic::AtomicUsize::new(limit)),
            discarded.clone(),
            None,
        )
        .await;
        (
            String::from_utf8(out).unwrap(),
            discarded.load(Ordering::Relaxed),
        )
    }

    #[tokio::test]
    async fn small_messages_pass_unchanged() {
        let input = "{\"id\":1,\"result\":{}}\n{\"id\":2,\"result\":{}}\n";
        assert_eq!(run_filter(input, 100).await, (input.to_string(), 0));
    }

    #[tokio::test]
    async fn an_oversized_answer_is_replaced_by_a_budget_error() {
        let big = "x".repeat(10_000);
        let input = format!(
            "{{\"jsonrpc\":\"2.0\",\"result\":{{\"text\":\"{big}\"}},\"id\":42}}\n{{\"id\":43,\"result\":{{}}}}\n"
        );
        let (out, discarded) = run_filter(&input, 1000).await;
        assert_eq!(discarded, 1);
        assert!(!out.contains("xxxx"), "the payload must not pass");
        let mut lines = out.lines();
        let first: Value = serde_json::from_str(lines.next().unwrap()).unwrap();
        assert_eq!(first["id"], 42);
        assert_eq!(first["error"]["code"], OUTPUT_BUDGET_ERROR_CODE);
        assert_eq!(lines.next().unwrap(), "{\"id\":43,\"result\":{}}");
    }

    /// The answers to the hot path's own requests go to their waiters, parsed once, and
    /// nothing of them reaches rmcp; every other message passes as before; the stream's
    /// end fails the waiters left, and no request is registered after it.
    #[tokio::test]
    async fn direct_answers_go_to_their_waiters_and_never_to_rmcp() {
        let tap = Arc::new(Tap::default());
        let ok = tap.expect_direct("1099511627776").unwrap();
        let refused = tap.expect_direct("1099511627777").unwrap();
        let big = tap.expect_direct("1099511627778").unwrap();
        let never = tap.expect_direct("1099511627779").unwrap();
        let huge = "x".repeat(5000);
        let input = format!(
            "{{\"jsonrpc\":\"2.0\",\"id\":1099511627776,\"result\":{{\"content\":[{{\"type\":\"text\",\"text\":\"hi\"}}]}}}}\n\
             {{\"jsonrpc\":\"2.0\",\"method\":\"notifications/message\",\"params\":{{}}}}\n\
             {{\"jsonrpc\":\"2.0\",\"id\":1099511627777,\"error\":{{\"code\":-32602,\"message\":\"no such note\"}}}}\n\
             {{\"jsonrpc\":\"2.0\",\"id\":1099511627778,\"result\":{{\"text\":\"{huge}\"}}}}\n"
        );
        let discarded = Arc::new(AtomicU64::new(0));
        let mut out = Vec::new();
        filter_messages(
            input.as_bytes(),
            &mut out,
            Arc::new(std::sync::atomic::AtomicUsize::new(1000)),
            discarded.clone(),
            Some(tap.clone()),
        )
        .await;
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "{\"jsonrpc\":\"2.0\",\"method\":\"notifications/message\",\"params\":{}}\n",
            "only the notification reaches rmcp"
        );
        match ok.await.unwrap() {
            direct::Answer::Result(r) => assert_eq!(r["content"][0]["text"], "hi"),
            other => panic!("{other:?}"),
        }
        match refused.await.unwrap() {
            direct::Answer::Error(code, message) => {
                assert_eq!((code, message.as_str()), (-32602, "no such note"))
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(big.await.unwrap(), direct::Answer::TooLarge));
        assert_eq!(discarded.load(Ordering::Relaxed), 1);
        assert!(
            tokio::time::timeout(std::time::Duration::from_secs(5), never)
                .await
                .expect("the stream ended: its waiter is woken at once")
                .is_err(),
            "the stream ended: its waiter fails"
        );
        assert!(tap.expect_direct("1099511627780").is_none());
    }

    /// A second answer to a direct request degrades the connection, as for rmcp's.
    #[tokio::test]
    async fn a_second_answer_to_a_direct_request_degrades() {
        let tap = Arc::new(Tap::default());
        let first = tap.expect_direct("1099511627776").unwrap();
        let line = "{\"jsonrpc\":\"2.0\",\"id\":1099511627776,\"result\":{}}\n";
        let mut out = Vec::new();
        filter_messages(
            format!("{line}{line}").as_bytes(),
            &mut out,
            Arc::new(std::sync::atomic::AtomicUsize::new(1000)),
            Arc::default(),
            Some(tap.clone()),
        )
        .await;
        assert!(matches!(first.await.unwrap(), direct::Answer::Result(_)));
        assert!(out.is_empty());
        assert!(tap.degraded.get().unwrap().contains("second answer"));
    }

    /// An answer too large for the budget still answers its request: a second answer to
    /// the same id after it degrades the connection and reaches nobody.
    #[tokio::test]
    async fn a_second_answer_after_an_oversized_direct_answer_degrades() {
        let tap = Arc::new(Tap::default());
        let first = tap.expect_direct("1099511627776").unwrap();
        let huge = "x".repeat(5000);
        let input = format!(
            "{{\"jsonrpc\":\"2.0\",\"id\":1099511627776,\"result\":{{\"text\":\"{huge}\"}}}}\n\
             {{\"jsonrpc\":\"2.0\",\"id\":1099511627776,\"result\":{{}}}}\n"
        );
        let mut out = Vec::new();
        filter_messages(
            input.as_bytes(),
            &mut out,
            Arc::new(std::sync::atomic::AtomicUsize::new(1000)),
            Arc::default(),
            Some(tap.clone()),
        )
        .await;
        assert!(matches!(first.await.unwrap(), direct::Answer::TooLarge));
        assert!(out.is_empty(), "{}", String::from_utf8_lossy(&out));
        assert!(
            tap.degraded
                .get()
                .is_some_and(|why| why.contains("second answer")),
            "{:?}",
            tap.degraded.get()
        );
    }

    /// The connection-closed signal of a [`Filtered`] reader: its flag and its waiter.
    fn end_signal() -> (Arc<std::sync::atomic::AtomicBool>, Arc<tokio::sync::Notify>) {
        (
            Arc::new(std::sync::atomic::AtomicBool::new(false)),
            Arc::new(tokio::sync::Notify::new()),
        )
    }

    #[tokio::test]
    async fn the_end_of_the_server_stream_marks_the_connection_closed_and_wakes_its_waiters() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let (closed, gone) = end_signal();
        let (mut server, stdout) = tokio::io::duplex(1024);
        let mut filtered = Filtered::new(
            stdout,
            &Arc::new(std::sync::atomic::AtomicUsize::new(1 << 20)),
            &Arc::new(AtomicU64::new(0)),
            None,
            Some((&closed, &gone)),
        );
        let woken = gone.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        let line = b"{\"id\":1,\"result\":{}}\n";
        server.write_all(line).await.unwrap();
        let mut got = vec![0; line.len()];
        filtered.read_exact(&mut got).await.unwrap();
        assert_eq!(got, line);
        assert!(
            !closed.load(Ordering::Acquire),
            "open while the server writes"
        );
        // The server closes its stdout (an unfinished line is not a message).
        server.write_all(b"{\"id\":2,").await.unwrap();
        drop(server);
        let mut rest = Vec::new();
        filtered.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "{}", String::from_utf8_lossy(&rest));
        assert!(closed.load(Ordering::Acquire), "closed at the stream's end");
        tokio::time::timeout(Duration::from_secs(1), woken)
            .await
            .expect("a waiter learns it at once");
    }

    #[tokio::test]
    async fn rmcp_dropping_the_reader_marks_the_connection_closed_and_wakes_its_waiters() {
        let (closed, gone) = end_signal();
        let (_server, stdout) = tokio::io::duplex(1024);
        let filtered = Filtered::new(
            stdout,
            &Arc::new(std::sync::atomic::AtomicUsize::new(1 << 20)),
            &Arc::new(AtomicU64::new(0)),
            None,
            Some((&closed, &gone)),
        );
        let woken = gone.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        assert!(!closed.load(Ordering::Acquire));
        // The server's stdout is still open: only the reader goes.
        drop(filtered);
        assert!(
            closed.load(Ordering::Acquire),
            "closed when rmcp stops reading"
        );
        tokio::time::timeout(Duration::from_secs(1), woken)
            .await
            .expect("a waiter learns it at once");
    }

    /// The one constructor: an unstarted link is closed from the start (so the host's
    /// watcher restarts it) and says why in the host's words; a bridged one (here a
    /// replay) is open, keeps the budget it was given, and its budget only rises.
    #[tokio::test]
    async fn every_link_is_built_by_the_one_constructor() {
        let down = Connection::unstarted("c", "it is starting".into(), 1024);
        assert!(down.has_exited() && !down.is_open());
        assert_eq!(down.down_reason().as_deref(), Some("it is starting"));
        assert_eq!((down.name(), down.message_budget()), ("c", 1024));
        assert_eq!(down.pid(), None);

        let up = Connection::start_replay("r", Arc::new(replay::Replay::default()), 2048)
            .await
            .expect("the replayed upstream initializes");
        assert!(up.is_open() && !up.has_exited());
        assert_eq!(up.down_reason(), None);
        assert_eq!(up.message_budget(), 2048);
        up.raise_message_budget(1);
        assert_eq!(up.message_budget(), 2048, "never lowered");
        up.raise_message_budget(4096);
        assert_eq!(up.message_budget(), 4096);
        assert_eq!(
            up.terminate(Duration::from_secs(1)).await.as_deref(),
            Some("the HTTP connection was closed")
        );
        assert!(up.has_exited());
    }
}
