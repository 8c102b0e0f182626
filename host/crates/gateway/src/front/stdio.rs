//! The front's stdio transport: newline-delimited JSON-RPC read in bounded lines, where
//! every request that carries an id gets an answer.
//!
//! Rule: rmcp's own stdio transport drops what it cannot parse, so a client whose line was
//! too deep, too long or not UTF-8 waits forever. This transport reads each line itself
//! (at most [`MAX_LINE_BYTES`]; a longer line is skipped to its newline while an
//! [`IdScanner`] looks for its id, never buffered whole), parses it once, strictly, and
//! answers what it cannot hand to rmcp:
//!
//! | the line | the answer |
//! |---|---|
//! | not JSON: a syntax error, nesting deeper than 128, a lone surrogate (`"\ud800"`), a number out of range (`1e400`), invalid UTF-8 | `-32700 Parse error`, with the id found in the raw bytes, else `id: null` |
//! | longer than [`MAX_LINE_BYTES`] | `-32600 Invalid Request`, with the id found while skipping, else `id: null` |
//! | a batch (a JSON array): MCP 2025-11-25 and 2026-07-28 have none | `-32600` for every request in it (`id: null` for an element that is not a message), one line each |
//! | JSON that is not a request: `jsonrpc` other than `"2.0"`, an id that is not a string or an integer, a `method` that is not a string, not an object | `-32600` (`id: null` when the id itself is the fault) |
//! | a duplicate object key: at the top level | `-32600` |
//! | a duplicate object key inside `params` (e.g. in `tools/call` `arguments`) | `-32602 Invalid params` |
//! | a duplicate object key, and the rest of the line is not JSON | `-32700`, as any line that is not JSON |
//! | a method Airlock serves with params of the wrong shape (`tools/call` without `name`, non-object `arguments`, `params` not an object) | `-32602` |
//!
//! Everything else goes to rmcp, which answers an unknown method with `-32601`.
//! Notifications (a `method` and no `id`) and responses (no `method`) are never answered:
//! a malformed one is logged and dropped.
//!
//! Duplicate keys are refused because JSON parsers disagree about them (RFC 8259 §4: the
//! behaviour is unpredictable): the value a reviewer, the policy or the trace sees must be
//! the one the client meant. Inside `params` this is `-32602`, not a tool result with
//! `isError`, because the fault is in the message's encoding, found before any tool is
//! resolved; no candidate exists to refuse, and a well-formed client never produces it.
//!
//! Cost: one parse per line (the strict parse builds the JSON tree rmcp's typed messages
//! are then read from); reads and writes are non-blocking pipe operations on the runtime's
//! IO driver ([`stdio_pipes`]), with no thread hand-off.
//! The reader is cancel safe (rmcp polls `receive` inside `select!`): a partial line stays
//! in the transport, and answers are queued in it before they are written.
//!
//! **`tools/call` without rmcp's service loop** ([`FastCalls`]): once the session is
//! established (rmcp did the handshake, in either generation), a `tools/call` request is
//! handed by this transport straight to the front's handler — rmcp's own request
//! dispatch (`Service::handle_request`: the protocol-version and per-request `_meta`
//! checks of 2026-07-28, then `call_tool`), with a request context built as rmcp builds
//! it (the session's peer, the request's `_meta`, a cancellation token) — in a task of its
//! own, and its answer is written by that task, whole, on the same stream. rmcp's loop
//! sees nothing of it: no channel to the loop, no task to send the answer. A
//! `notifications/cancelled` naming such a request cancels it, and its answer is then not
//! sent (as rmcp does); the notification still goes on to rmcp. Closing the transport
//! waits for these calls' answers. Everything else (the handshake, `tools/list`,
//! `subscriptions/listen`, server→client requests such as `elicitation/create`) stays
//! rmcp's.

use std::cell::Cell;
use std::collections::HashMap;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rmcp::model::{
    CallToolRequestParams, ClientRequest, DiscoverRequestParams, InitializeRequestParams,
    JsonRpcMessage, PaginatedRequestParams, SubscriptionsListenRequestParams,
};
use rmcp::model::{GetExtensions as _, GetMeta as _, RequestId};
use rmcp::service::{
    Peer, RequestContext, RoleServer, RxJsonRpcMessage, Service as _, TxJsonRpcMessage,
};
use rmcp::transport::Transport;
use serde::de::{self, DeserializeSeed, Visitor};
use serde_json::{Map, Value, json};
use tokio::io::{AsyncBufReadExt as _, AsyncRead, AsyncWrite, AsyncWriteExt as _, BufReader};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use crate::jsonrpc::IdScanner;

/// The longest line read (16 MiB, rmcp's own stdio limit), newline excluded.
pub const MAX_LINE_BYTES: usize = 16 * 1024 * 1024;

/// JSON-RPC `Parse error`.
pub const PARSE_ERROR: i32 = -32700;
/// JSON-RPC `Invalid Request`.
pub const INVALID_REQUEST: i32 = -32600;
/// JSON-RPC `Invalid params`.
pub const INVALID_PARAMS: i32 = -32602;

/// The process's stdin and stdout as non-blocking pipes driven by the runtime's IO driver
/// (rmcp's `stdio_pipes()`: on Linux each pipe is reopened through `/proc/self/fd` on its
/// own open file description, so `O_NONBLOCK` never leaks to inherited handles); a stream
/// that is not a pipe falls back to tokio's blocking-pool handles.
///
/// This keeps every read and write off tokio's blocking pool (one thread hand-off each way
/// per message). It relies on the runtime polling its IO driver while guests run: a guest
/// yields at each epoch tick through `tokio::task::yield_now`, which lets the worker poll
/// the driver before it resumes the guest (see [`crate::runtime`]), so a line from the
/// client is read while every worker runs a spinning adapter
/// (`hostile::neighbours_are_served_while_adapters_spin`).
pub fn stdio_pipes() -> (rmcp::transport::StdioReader, rmcp::transport::StdioWriter) {
    rmcp::transport::stdio_pipes()
}

/// The front's transport over the process's stdin and stdout ([`stdio_pipes`]).
pub fn transport() -> StdioFront<rmcp::transport::StdioReader, rmcp::transport::StdioWriter> {
    let (read, write) = stdio_pipes();
    StdioFront::new(read, write)
}

/// A newline-delimited JSON-RPC transport that answers what it cannot deliver (see the
/// module rules).
pub struct StdioFront<R, W> {
    read: BufReader<R>,
    line: Vec<u8>,
    max_line: usize,
    /// Set while an over-long line is skipped: what finds its id.
    skipping: Option<IdScanner>,
    /// The stream ended; a last line without a newline was handed out first.
    eof: bool,
    /// Answers not yet handed to the writer.
    pending: Vec<u8>,
    out: Arc<Mutex<Outbox<W>>>,
    /// `tools/call` handled without rmcp's loop, once the session is established.
    fast: Option<Arc<FastCalls>>,
}

/// The front's own handling of `tools/call` on this transport (see the module doc). Made
/// with the transport ([`StdioFront::with_fast_calls`]); [`FastCalls::ready`] starts it
/// once rmcp has established the session.
pub struct FastCalls {
    front: crate::front::McpFront,
    peer: std::sync::OnceLock<Peer<RoleServer>>,
    /// The calls in flight, by request id: their cancellation tokens.
    calls: std::sync::Mutex<HashMap<RequestId, CancellationToken>>,
    /// Calls whose answer is not written yet.
    running: AtomicUsize,
    idle: tokio::sync::Notify,
}

impl FastCalls {
    /// Hands `tools/call` to the front's handler from now on, with `peer` (the running
    /// service's) as the requests' peer.
    pub fn ready(&self, peer: Peer<RoleServer>) {
        let _ = self.peer.set(peer);
    }

    fn lock_calls(&self) -> std::sync::MutexGuard<'_, HashMap<RequestId, CancellationToken>> {
        self.calls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Runs one `tools/call` request in a task of its own and writes its answer to `out`.
    fn spawn<W: AsyncWrite + Unpin + Send + 'static>(
        self: &Arc<Self>,
        peer: Peer<RoleServer>,
        request: rmcp::model::JsonRpcRequest<ClientRequest>,
        out: Arc<Mutex<Outbox<W>>>,
    ) {
        let rmcp::model::JsonRpcRequest {
            id, mut request, ..
        } = request;
        // As rmcp's loop builds it: the request's `_meta` and extensions moved in.
        let mut context = RequestContext::new(id.clone(), peer);
        context.meta = std::mem::take(request.get_meta_mut());
        context.extensions = std::mem::take(request.extensions_mut());
        self.lock_calls().insert(id.clone(), context.ct.clone());
        self.running.fetch_add(1, Ordering::AcqRel);
        let fast = self.clone();
        tokio::spawn(async move {
            let result = fast.front.handle_request(request, context).await;
            // A request the client cancelled gets no answer (its entry is gone).
            if fast.lock_calls().remove(&id).is_some() {
                let message: TxJsonRpcMessage<RoleServer> = match result {
                    Ok(result) => JsonRpcMessage::response(result, id),
                    Err(error) => JsonRpcMessage::error(error, Some(id)),
                };
                if let Err(e) = write_message(&out, &message).await {
                    tracing::warn!("could not answer on stdout: {e}");
                }
            }
            if fast.running.fetch_sub(1, Ordering::AcqRel) == 1 {
                fast.idle.notify_waiters();
            }
        });
    }

    /// A `notifications/cancelled` for `id`: cancels that call when it is one of these.
    fn cancel(&self, id: &RequestId) {
        if let Some(ct) = self.lock_calls().remove(id) {
            ct.cancel();
        }
    }

    /// Waits until every call's answer is written.
    async fn drained(&self) {
        loop {
            let idle = self.idle.notified();
            if self.running.load(Ordering::Acquire) == 0 {
                return;
            }
            idle.await;
        }
    }
}

/// Serializes `message` as one line and writes it whole.
async fn write_message<W: AsyncWrite + Unpin>(
    out: &Mutex<Outbox<W>>,
    message: &TxJsonRpcMessage<RoleServer>,
) -> io::Result<()> {
    let mut line = serde_json::to_vec(message).map_err(io::Error::other)?;
    line.push(b'\n');
    let mut out = out.lock().await;
    out.buf.extend_from_slice(&line);
    out.flush().await
}

/// The writing half: whole lines are appended to `buf` at once and written out from
/// `start`, so a cancelled write never leaves half a line that another could interleave.
struct Outbox<W> {
    write: Option<W>,
    buf: Vec<u8>,
    start: usize,
}

impl<W: AsyncWrite + Unpin> Outbox<W> {
    async fn flush(&mut self) -> io::Result<()> {
        let Some(write) = self.write.as_mut() else {
            return Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "the transport is closed",
            ));
        };
        while self.start < self.buf.len() {
            let n = write.write(&self.buf[self.start..]).await?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            self.start += n;
        }
        self.buf.clear();
        self.start = 0;
        if self.buf.capacity() > 1024 * 1024 {
            self.buf.shrink_to(64 * 1024);
        }
        write.flush().await
    }
}

enum LineRead {
    Line,
    /// An over-long line was skipped; the id found in it, if any.
    Oversized(Option<Value>),
    Eof,
}

impl<R: AsyncRead + Unpin + Send, W: AsyncWrite + Unpin + Send + 'static> StdioFront<R, W> {
    /// A transport reading `read` and writing `write`.
    pub fn new(read: R, write: W) -> Self {
        Self {
            read: BufReader::with_capacity(64 * 1024, read),
            line: Vec::new(),
            max_line: MAX_LINE_BYTES,
            skipping: None,
            eof: false,
            pending: Vec::new(),
            out: Arc::new(Mutex::new(Outbox {
                write: Some(write),
                buf: Vec::new(),
                start: 0,
            })),
            fast: None,
        }
    }

    /// Hands `tools/call` to `front`'s handler without rmcp's loop once
    /// [`FastCalls::ready`] is called (see the module doc); returns the handle to call it
    /// on.
    pub fn with_fast_calls(mut self, front: crate::front::McpFront) -> (Self, Arc<FastCalls>) {
        let fast = Arc::new(FastCalls {
            front,
            peer: std::sync::OnceLock::new(),
            calls: std::sync::Mutex::new(HashMap::new()),
            running: AtomicUsize::new(0),
            idle: tokio::sync::Notify::new(),
        });
        self.fast = Some(fast.clone());
        (self, fast)
    }

    /// Sets the longest line read (bytes, newline excluded); the default is
    /// [`MAX_LINE_BYTES`].
    pub fn with_max_line(mut self, bytes: usize) -> Self {
        self.max_line = bytes;
        self
    }

    /// Reads one line into `self.line`, bounded; cancel safe (state lives in `self`, and
    /// each chunk is taken and consumed with no await in between).
    async fn read_line(&mut self) -> io::Result<LineRead> {
        loop {
            if self.eof {
                return Ok(LineRead::Eof);
            }
            let (used, ended) = {
                let available = self.read.fill_buf().await?;
                if available.is_empty() {
                    self.eof = true;
                    if let Some(scan) = self.skipping.take() {
                        return Ok(LineRead::Oversized(scan.id()));
                    }
                    // A last line without its newline is still a message.
                    return Ok(if self.line.is_empty() {
                        LineRead::Eof
                    } else {
                        LineRead::Line
                    });
                }
                let newline = available.iter().position(|&b| b == b'\n');
                let take = newline.map_or(available.len(), |i| i + 1);
                let chunk = &available[..take];
                if let Some(scan) = self.skipping.as_mut() {
                    scan.feed(chunk);
                } else if self.line.len() + take > self.max_line + usize::from(newline.is_some()) {
                    let mut scan = IdScanner::default();
                    scan.feed(&self.line);
                    scan.feed(chunk);
                    self.line.clear();
                    self.line.shrink_to(64 * 1024);
                    self.skipping = Some(scan);
                } else {
                    self.line.extend_from_slice(chunk);
                }
                (take, newline.is_some())
            };
            self.read.consume(used);
            if ended {
                return Ok(match self.skipping.take() {
                    Some(scan) => LineRead::Oversized(scan.id()),
                    None => LineRead::Line,
                });
            }
        }
    }

    /// Writes the queued answers.
    async fn flush_pending(&mut self) -> io::Result<()> {
        let mut out = self.out.lock().await;
        out.buf.append(&mut self.pending);
        out.flush().await
    }
}

impl<R, W> Transport<RoleServer> for StdioFront<R, W>
where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send + 'static,
{
    type Error = io::Error;

    fn send(
        &mut self,
        item: TxJsonRpcMessage<RoleServer>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        let out = self.out.clone();
        async move { write_message(&out, &item).await }
    }

    async fn receive(&mut self) -> Option<RxJsonRpcMessage<RoleServer>> {
        loop {
            if !self.pending.is_empty()
                && let Err(e) = self.flush_pending().await
            {
                tracing::warn!("could not answer on stdout: {e}");
                return None;
            }
            let verdict = match self.read_line().await {
                Ok(LineRead::Line) => {
                    let verdict = judge(&self.line);
                    self.line.clear();
                    if self.line.capacity() > 1024 * 1024 {
                        self.line.shrink_to(64 * 1024);
                    }
                    verdict
                }
                Ok(LineRead::Oversized(id)) => {
                    tracing::warn!(
                        limit = self.max_line,
                        "refused a message longer than the line limit"
                    );
                    Verdict::Answer(error_line(
                        id.as_ref(),
                        INVALID_REQUEST,
                        &format!(
                            "Invalid Request: the message is longer than {} bytes and was not read",
                            self.max_line
                        ),
                    ))
                }
                Ok(LineRead::Eof) => return None,
                Err(e) => {
                    tracing::warn!("could not read stdin: {e}");
                    return None;
                }
            };
            match verdict {
                Verdict::Deliver(message) => {
                    let message = *message;
                    let Some((fast, peer)) = self
                        .fast
                        .as_ref()
                        .and_then(|f| Some((f.clone(), f.peer.get()?.clone())))
                    else {
                        return Some(message);
                    };
                    match message {
                        JsonRpcMessage::Request(request)
                            if matches!(request.request, ClientRequest::CallToolRequest(_)) =>
                        {
                            fast.spawn(peer, request, self.out.clone());
                        }
                        JsonRpcMessage::Notification(notification) => {
                            if let rmcp::model::ClientNotification::CancelledNotification(c) =
                                &notification.notification
                                && let Some(id) = &c.params.request_id
                            {
                                fast.cancel(id);
                            }
                            return Some(JsonRpcMessage::Notification(notification));
                        }
                        other => return Some(other),
                    }
                }
                Verdict::Answer(lines) => self.pending.extend_from_slice(&lines),
                Verdict::Skip => {}
            }
        }
    }

    async fn close(&mut self) -> Result<(), Self::Error> {
        // The calls handled here write their answers first.
        if let Some(fast) = &self.fast {
            fast.drained().await;
        }
        let mut out = self.out.lock().await;
        let _ = out.flush().await;
        if let Some(mut write) = out.write.take() {
            let _ = write.shutdown().await;
        }
        Ok(())
    }
}

/// What to do with one line.
pub(crate) enum Verdict {
    /// Hand it to rmcp.
    Deliver(Box<RxJsonRpcMessage<RoleServer>>),
    /// Answer it with these bytes (one or more newline-terminated lines).
    Answer(Vec<u8>),
    /// Nothing (an empty line, a notification or response that is malformed).
    Skip,
}

/// Judges one line (see the module rules).
pub(crate) fn judge(line: &[u8]) -> Verdict {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let line = line.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(line);
    if line.iter().all(u8::is_ascii_whitespace) {
        return Verdict::Skip;
    }
    let duplicate = Cell::new(None);
    let mut de = serde_json::Deserializer::from_slice(line);
    let parsed = Strict {
        place: Place::Top,
        top: true,
        duplicate: &duplicate,
    }
    .deserialize(&mut de)
    .and_then(|v| de.end().map(|()| v));
    match parsed {
        Ok(value) => judge_value(value),
        Err(e) => match duplicate.take() {
            Some(dup) => judge_duplicate(line, dup),
            None => parse_error(line, &e),
        },
    }
}

/// The answer to a line that is not JSON: `-32700`, with the id found in its raw bytes
/// (`null` when none is, or when the top-level `id` key is written more than once: which
/// was meant is ambiguous, as for a line that parses).
fn parse_error(line: &[u8], e: &serde_json::Error) -> Verdict {
    let mut scan = IdScanner::whole();
    scan.feed(line);
    let id = scan.id();
    let message = if std::str::from_utf8(line).is_err() {
        "Parse error: the message is not valid UTF-8".to_string()
    } else {
        format!("Parse error: {e}")
    };
    tracing::info!(id = ?id, "refused a line that is not JSON: {e}");
    Verdict::Answer(error_line(id.as_ref(), PARSE_ERROR, &message))
}

/// A message with a duplicate key: parsed again leniently (only on this error path) to
/// see whether it is a request at all. The strict parse stops at the duplicate, so the
/// rest of the line may still not be JSON: then it is a parse error like any other.
/// Only a notification or a response goes unanswered, as in [`judge_object`].
fn judge_duplicate(line: &[u8], dup: Duplicate) -> Verdict {
    let shown: String = dup.key.chars().take(64).collect();
    tracing::info!(key = %shown.escape_debug(), "refused a message with a duplicate key");
    let value = match serde_json::from_slice::<Value>(line) {
        Ok(value) => value,
        Err(e) => return parse_error(line, &e),
    };
    let Value::Object(map) = value else {
        // A batch: refused as one, whatever is inside.
        return judge_value(value);
    };
    let is_notification = map.contains_key("method") && !map.contains_key("id");
    let is_response =
        !map.contains_key("method") && (map.contains_key("result") || map.contains_key("error"));
    if is_notification || is_response {
        return Verdict::Skip;
    }
    // The lenient parse keeps the last of repeated keys; an id said twice (whichever key
    // was found repeated first) is ambiguous, so the answer carries `null`.
    let id = (dup.place != Place::Top || dup.key != "id")
        .then(|| map.get("id"))
        .flatten()
        .filter(|_| top_level_id_count(line) == 1);
    let (code, message) = match dup.place {
        Place::Params => (
            INVALID_PARAMS,
            format!(
                "Invalid params: the key `{}` appears twice in one object of params; JSON object keys must be unique, so which value was meant is ambiguous",
                shown.escape_debug()
            ),
        ),
        Place::Top | Place::Elsewhere => (
            INVALID_REQUEST,
            format!(
                "Invalid Request: the key `{}` appears twice in one object; JSON object keys must be unique",
                shown.escape_debug()
            ),
        ),
    };
    Verdict::Answer(error_line(id, code, &message))
}

/// How many times the top-level object of `line` has the key `id` (0 when `line` is not a
/// JSON object). Values are skipped unread.
fn top_level_id_count(line: &[u8]) -> usize {
    struct IdCount(usize);
    impl<'de> serde::Deserialize<'de> for IdCount {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct Keys;
            impl<'de> serde::de::Visitor<'de> for Keys {
                type Value = IdCount;
                fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                    f.write_str("a JSON object")
                }
                fn visit_map<A: serde::de::MapAccess<'de>>(
                    self,
                    mut map: A,
                ) -> Result<IdCount, A::Error> {
                    let mut n = 0;
                    while let Some(key) = map.next_key::<String>()? {
                        n += usize::from(key == "id");
                        map.next_value::<serde::de::IgnoredAny>()?;
                    }
                    Ok(IdCount(n))
                }
            }
            d.deserialize_map(Keys)
        }
    }
    serde_json::from_slice::<IdCount>(line).map_or(0, |c| c.0)
}

/// The methods Airlock serves whose params rmcp reads into types: a request for one of
/// them that rmcp could only read as a custom request had params of the wrong shape.
fn params_error(method: &str, params: Option<&Value>) -> Option<String> {
    fn check<T: serde::de::DeserializeOwned>(params: Option<&Value>) -> String {
        match params.map(T::deserialize) {
            None => "params are missing".to_string(),
            Some(Err(e)) => e.to_string(),
            Some(Ok(_)) => "params do not match this method".to_string(),
        }
    }
    let why = match method {
        "tools/call" => check::<CallToolRequestParams>(params),
        "tools/list" => check::<PaginatedRequestParams>(params),
        "initialize" => check::<InitializeRequestParams>(params),
        "subscriptions/listen" => check::<SubscriptionsListenRequestParams>(params),
        "server/discover" => check::<DiscoverRequestParams>(params),
        "ping" => "params do not match this method".to_string(),
        _ => return None,
    };
    Some(format!("Invalid params for `{method}`: {why}"))
}

/// Judges a parsed line.
fn judge_value(value: Value) -> Verdict {
    match value {
        Value::Array(items) => {
            tracing::info!(items = items.len(), "refused a JSON-RPC batch");
            let message = "Invalid Request: JSON-RPC batches are not part of MCP 2025-11-25 or 2026-07-28; send each message on its own line";
            let mut lines = Vec::new();
            for item in &items {
                let answered = match item {
                    Value::Object(m) if m.contains_key("method") => m.get("id").map(Some),
                    // A response inside a batch is not answered.
                    Value::Object(m) if m.contains_key("result") || m.contains_key("error") => None,
                    _ => Some(None),
                };
                if let Some(id) = answered {
                    lines.extend(error_line(id, INVALID_REQUEST, message));
                }
            }
            if items.is_empty() {
                lines = error_line(None, INVALID_REQUEST, message);
            }
            if lines.is_empty() {
                Verdict::Skip
            } else {
                Verdict::Answer(lines)
            }
        }
        Value::Object(map) => judge_object(map),
        _ => Verdict::Answer(error_line(
            None,
            INVALID_REQUEST,
            "Invalid Request: a message is a JSON object",
        )),
    }
}

fn judge_object(map: Map<String, Value>) -> Verdict {
    let is_request = map.contains_key("method") && map.contains_key("id");
    let is_notification = map.contains_key("method") && !map.contains_key("id");
    let is_response =
        !map.contains_key("method") && (map.contains_key("result") || map.contains_key("error"));
    let refuse = |id: Option<&Value>, code: i32, message: &str| {
        if is_notification || is_response {
            tracing::info!("dropped a malformed notification or response: {message}");
            Verdict::Skip
        } else {
            Verdict::Answer(error_line(id, code, message))
        }
    };
    let id = map.get("id");
    if map.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return refuse(
            id,
            INVALID_REQUEST,
            "Invalid Request: `jsonrpc` must be \"2.0\"",
        );
    }
    if let Some(found) = id
        && !valid_id(found)
    {
        return refuse(
            None,
            INVALID_REQUEST,
            "Invalid Request: `id` must be a string or an integer",
        );
    }
    if let Some(method) = map.get("method") {
        if !method.is_string() {
            return refuse(
                id,
                INVALID_REQUEST,
                "Invalid Request: `method` must be a string",
            );
        }
        if let Some(params) = map.get("params")
            && !params.is_object()
        {
            return refuse(
                id,
                INVALID_PARAMS,
                "Invalid params: `params` must be an object",
            );
        }
    } else if !is_response {
        return refuse(
            id,
            INVALID_REQUEST,
            "Invalid Request: a message has a `method` (a request or notification), or a `result` or `error` (a response)",
        );
    }
    let id = id.cloned();
    // A request is read straight into rmcp's request type: the message enum rmcp reads
    // otherwise buffers the whole message and tries each kind of message in turn. Only a
    // request that is one (no `result` or `error` beside its `method`) and reads cleanly
    // takes this way; anything else is read as before, so it is refused in rmcp's words.
    let map = if is_request && !map.contains_key("result") && !map.contains_key("error") {
        let message = Value::Object(map);
        if let Some(request) = call_tool_request(&message) {
            return deliver_request(request, id.as_ref());
        }
        match <rmcp::model::JsonRpcRequest<ClientRequest> as serde::Deserialize>::deserialize(
            &message,
        ) {
            Ok(request) => return deliver_request(request, id.as_ref()),
            Err(_) => match message {
                Value::Object(map) => map,
                _ => unreachable!("built from a map"),
            },
        }
    } else {
        map
    };
    match serde_json::from_value::<RxJsonRpcMessage<RoleServer>>(Value::Object(map)) {
        Ok(JsonRpcMessage::Request(request)) => deliver_request(request, id.as_ref()),
        Ok(message) => Verdict::Deliver(Box::new(message)),
        Err(e) if is_request => Verdict::Answer(error_line(
            id.as_ref(),
            INVALID_REQUEST,
            &format!("Invalid Request: {e}"),
        )),
        Err(e) => {
            tracing::info!("dropped a malformed notification or response: {e}");
            Verdict::Skip
        }
    }
}

/// A `tools/call` request read straight into rmcp's [`CallToolRequest`] (its method, its
/// params and their `_meta`, read as rmcp reads them), or `None` for any other message or
/// params that do not read (which then go the general way, and are answered as there).
///
/// [`ClientRequest`] is an untagged union: read as one, a `tools/call` is first tried as
/// each of the 13 kinds of request listed before it, over a buffered copy of the message.
/// The method names exactly one kind, so this reads that kind alone; the value is the one
/// the union yields (`a_tools_call_reads_as_the_union_reads_it`).
///
/// [`CallToolRequest`]: rmcp::model::CallToolRequest
fn call_tool_request(message: &Value) -> Option<rmcp::model::JsonRpcRequest<ClientRequest>> {
    use serde::Deserialize as _;
    if message.get("method").and_then(Value::as_str) != Some("tools/call") {
        return None;
    }
    let id = rmcp::model::RequestId::deserialize(message.get("id")?).ok()?;
    let request = rmcp::model::CallToolRequest::deserialize(message).ok()?;
    Some(rmcp::model::JsonRpcRequest::new(
        id,
        ClientRequest::CallToolRequest(request),
    ))
}

/// Hands `request` to rmcp, unless it is a method Airlock serves that rmcp could read only
/// as a custom request (its params have the wrong shape): that is answered `-32602`.
fn deliver_request(
    request: rmcp::model::JsonRpcRequest<ClientRequest>,
    id: Option<&Value>,
) -> Verdict {
    if let ClientRequest::CustomRequest(custom) = &request.request
        && let Some(why) = params_error(&custom.method, custom.params.as_ref())
    {
        tracing::info!("refused a request: {why}");
        return Verdict::Answer(error_line(id, INVALID_PARAMS, &why));
    }
    Verdict::Deliver(Box::new(JsonRpcMessage::Request(request)))
}

/// Whether `id` is one MCP allows in a request: a string or an integer rmcp can carry.
fn valid_id(id: &Value) -> bool {
    id.is_string() || id.is_i64()
}

/// One error response line. An id that is absent or not one a request may carry is `null`
/// (JSON-RPC 2.0 §5.1).
fn error_line(id: Option<&Value>, code: i32, message: &str) -> Vec<u8> {
    let id = id.filter(|v| valid_id(v)).cloned().unwrap_or(Value::Null);
    let mut line = serde_json::to_vec(&json!({
        "jsonrpc": "2.0",
        "id": id,
        "error": {"code": code, "message": message},
    }))
    .unwrap_or_default();
    line.push(b'\n');
    line
}

/// Where a duplicate key was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// The message object itself.
    Top,
    /// Inside `params`.
    Params,
    /// Inside another member (`result`, `error`, an unknown one).
    Elsewhere,
}

struct Duplicate {
    place: Place,
    key: String,
}

/// Builds a JSON value like `serde_json::Value`'s own visitor, but stops at the first
/// duplicate object key and records where it was.
#[derive(Clone, Copy)]
struct Strict<'a> {
    place: Place,
    top: bool,
    duplicate: &'a Cell<Option<Duplicate>>,
}

impl<'de> DeserializeSeed<'de> for Strict<'_> {
    type Value = Value;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Strict<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
        let child = Strict { top: false, ..self };
        while let Some(item) = seq.next_element_seed(child)? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let place = match (self.top, key.as_str()) {
                (true, "params") => Place::Params,
                (true, _) => Place::Elsewhere,
                (false, _) => self.place,
            };
            let value = map.next_value_seed(Strict {
                place,
                top: false,
                duplicate: self.duplicate,
            })?;
            if out.contains_key(&key) {
                self.duplicate.set(Some(Duplicate {
                    place: if self.top { Place::Top } else { self.place },
                    key,
                }));
                return Err(de::Error::custom("duplicate key"));
            }
            out.insert(key, value);
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(line: &str) -> Vec<Value> {
        answer_bytes(line.as_bytes())
    }

    fn answer_bytes(line: &[u8]) -> Vec<Value> {
        match judge(line) {
            Verdict::Answer(bytes) => bytes
                .split(|&b| b == b'\n')
                .filter(|l| !l.is_empty())
                .map(|l| serde_json::from_slice(l).unwrap())
                .collect(),
            Verdict::Deliver(_) => panic!("delivered: {line:?}"),
            Verdict::Skip => vec![],
        }
    }

    fn one(line: &str) -> (Value, i64) {
        let a = answer(line);
        assert_eq!(a.len(), 1, "{line}: {a:?}");
        (a[0]["id"].clone(), a[0]["error"]["code"].as_i64().unwrap())
    }

    fn delivered(line: &str) -> RxJsonRpcMessage<RoleServer> {
        match judge(line.as_bytes()) {
            Verdict::Deliver(m) => *m,
            Verdict::Answer(a) => panic!("answered {line}: {}", String::from_utf8_lossy(&a)),
            Verdict::Skip => panic!("skipped {line}"),
        }
    }

    #[test]
    fn unparsable_lines_are_answered_with_the_id_found_in_them() {
        let deep = format!(
            r#"{{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{{"name":"x","arguments":{{"a":{}1{}}}}}}}"#,
            "[".repeat(200),
            "]".repeat(200)
        );
        assert_eq!(one(&deep), (json!(7), -32700));
        let surrogate =
            r#"{"jsonrpc":"2.0","id":"s","method":"tools/call","params":{"name":"\ud800"}}"#;
        assert_eq!(one(surrogate), (json!("s"), -32700));
        let big = r#"{"jsonrpc":"2.0","id":8,"method":"tools/call","params":{"name":"x","arguments":{"n":1e400}}}"#;
        assert_eq!(one(big), (json!(8), -32700));
        let mut utf8 =
            br#"{"jsonrpc":"2.0","id":9,"method":"tools/call","params":{"name":""#.to_vec();
        utf8.extend_from_slice(b"\xff\xfe\"}}");
        let a = answer_bytes(&utf8);
        assert_eq!(
            (a[0]["id"].clone(), a[0]["error"]["code"].clone()),
            (json!(9), json!(-32700))
        );
        assert!(a[0]["error"]["message"].as_str().unwrap().contains("UTF-8"));
        assert_eq!(one("{not json"), (Value::Null, -32700));
        // The id is found wherever it stands, never inside params.
        assert_eq!(
            one(
                r#"{"params":{"id":1,"x":1e400},"id":"last","method":"tools/call","jsonrpc":"2.0"}"#
            ),
            (json!("last"), -32700)
        );
    }

    #[test]
    fn batches_are_refused_for_every_request_in_them() {
        let a = answer(
            r#"[{"jsonrpc":"2.0","id":1,"method":"tools/list"},{"jsonrpc":"2.0","method":"notifications/initialized"},{"jsonrpc":"2.0","id":"b","method":"ping"},3]"#,
        );
        let ids: Vec<Value> = a.iter().map(|m| m["id"].clone()).collect();
        assert_eq!(ids, vec![json!(1), json!("b"), Value::Null]);
        assert!(a.iter().all(|m| m["error"]["code"] == -32600));
        assert_eq!(one("[]"), (Value::Null, -32600));
        assert!(answer(r#"[{"jsonrpc":"2.0","method":"notifications/initialized"}]"#).is_empty());
    }

    #[test]
    fn json_that_is_not_a_request_is_invalid_request() {
        assert_eq!(
            one(r#"{"jsonrpc":"1.0","id":1,"method":"ping"}"#),
            (json!(1), -32600)
        );
        assert_eq!(one(r#"{"id":2,"method":"ping"}"#), (json!(2), -32600));
        assert_eq!(
            one(r#"{"jsonrpc":"2.0","id":{"a":1},"method":"ping"}"#),
            (Value::Null, -32600)
        );
        assert_eq!(
            one(r#"{"jsonrpc":"2.0","id":1.5,"method":"ping"}"#),
            (Value::Null, -32600)
        );
        assert_eq!(
            one(r#"{"jsonrpc":"2.0","id":null,"method":"ping"}"#),
            (Value::Null, -32600)
        );
        assert_eq!(
            one(r#"{"jsonrpc":"2.0","id":true,"method":"ping"}"#),
            (Value::Null, -32600)
        );
        assert_eq!(
            one(r#"{"jsonrpc":"2.0","id":3,"method":7}"#),
            (json!(3), -32600)
        );
        assert_eq!(one(r#"{"jsonrpc":"2.0","id":4}"#), (json!(4), -32600));
        assert_eq!(one(r#""text""#), (Value::Null, -32600));
        // Notifications and responses are never answered, however malformed.
        assert!(answer(r#"{"jsonrpc":"1.0","method":"notifications/initialized"}"#).is_empty());
        assert!(
            answer(r#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":[1]}"#)
                .is_empty()
        );
        assert!(answer(r#"{"jsonrpc":"2.0","id":{"x":1},"result":{}}"#).is_empty());
    }

    #[test]
    fn malformed_params_of_a_served_method_are_invalid_params() {
        for line in [
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"arguments":{}}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","arguments":"text"}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","arguments":[1]}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call"}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":"x"}"#,
        ] {
            assert_eq!(one(line), (json!(1), -32602), "{line}");
        }
        let a =
            answer(r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"arguments":{}}}"#);
        assert!(
            a[0]["error"]["message"].as_str().unwrap().contains("name"),
            "{a:?}"
        );
        // An unknown method goes to rmcp (which answers -32601).
        assert!(matches!(
            delivered(r#"{"jsonrpc":"2.0","id":1,"method":"tools/unknown","params":{}}"#),
            JsonRpcMessage::Request(_)
        ));
        assert!(matches!(
            delivered(
                r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","arguments":{"a":1}}}"#
            ),
            JsonRpcMessage::Request(rmcp::model::JsonRpcRequest {
                request: ClientRequest::CallToolRequest(_),
                ..
            })
        ));
    }

    #[test]
    fn duplicate_keys_are_refused() {
        assert_eq!(
            one(
                r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","arguments":{"q":"a","q":"b"}}}"#
            ),
            (json!(1), -32602)
        );
        assert_eq!(
            one(
                r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","name":"y"}}"#
            ),
            (json!(1), -32602)
        );
        assert_eq!(
            one(r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","method":"tools/list"}"#),
            (json!(1), -32600)
        );
        // Which id was meant is unknown: null.
        assert_eq!(
            one(r#"{"jsonrpc":"2.0","id":1,"id":2,"method":"tools/list"}"#),
            (Value::Null, -32600)
        );
        assert!(
            answer(r#"{"jsonrpc":"2.0","method":"notifications/x","params":{"a":1,"a":2}}"#)
                .is_empty()
        );
    }

    /// The rule the `front_line` fuzz target asserts (a request's id gets an answer): the
    /// strict parse stops at a duplicate key, and such a request went unanswered when the
    /// rest of its line was not JSON, or when it had an id but no method.
    #[test]
    fn a_request_with_a_duplicate_key_is_answered_whatever_follows() {
        assert_eq!(
            one(r#"{"jsonrpc":"2.0","id":1,"method":"ping","a":1,"a":2,"#),
            (json!(1), -32700)
        );
        assert_eq!(
            one(r#"{"jsonrpc":"2.0","id":"s","method":"ping","params":{"a":1,"a":2},"x":1e400}"#),
            (json!("s"), -32700)
        );
        assert_eq!(
            one(r#"{"jsonrpc":"2.0","id":3,"a":1,"a":2}"#),
            (json!(3), -32600)
        );
        // Found by the front_line fuzz target: another key repeated first, and the id said twice too.
        // Which id was meant is ambiguous (the lenient parse would keep the last), so the
        // answer carries null.
        assert_eq!(
            one(r#"{"jsonrpc":"2.0","rpc":1,"id":13,"rpc":2,"id":4,"method":"ping"}"#),
            (Value::Null, -32600)
        );
        assert_eq!(
            one(r#"{"jsonrpc":"2.0","id":13,"method":"ping","p":{"id":1,"id":2}}"#),
            (json!(13), -32600),
            "a nested id is not the request's"
        );
        // Found by the front_line fuzz target: the id said twice in a line that is not
        // JSON further on (bytes that are not UTF-8, a lone surrogate). Ambiguous in the
        // raw bytes as in a line that parses: null, whichever id came first.
        assert_eq!(
            answer_bytes(
                b"{\"jsonrpc\":\"2.0\",\"id\":4,\"erpc\":\"2.0\",\"id\":4,\"error\":{\"m\":\"\xc8\xbf\xff\"}}"
            )
            .iter()
            .map(|a| (a["id"].clone(), a["error"]["code"].as_i64().unwrap()))
            .collect::<Vec<_>>(),
            vec![(Value::Null, -32700)]
        );
        assert_eq!(
            one(r#"{"jsonrpc":"2.0","id":4,"method":"x","id":5,"p":"\ud800"}"#),
            (Value::Null, -32700)
        );
        // Found by the front_line fuzz target: the second id spelled with an escape.
        assert_eq!(
            one(r#"{"jsonrpc":"2.0","id":"a","i\u0064":2,"method":"x","p":{}}"#),
            (Value::Null, -32600)
        );
        assert_eq!(
            one(r#"{"jsonrpc":"2.0","id":1,"i\u0064":2,"method":"x","p":"\ud800"}"#),
            (Value::Null, -32700)
        );
        // One id in a line that is not JSON is still answered with it.
        assert_eq!(
            one(r#"{"jsonrpc":"2.0","id":4,"method":"x","p":"\ud800"}"#),
            (json!(4), -32700)
        );
        // A response or notification with a duplicate key is still dropped.
        assert!(answer(r#"{"jsonrpc":"2.0","id":4,"result":{"a":1,"a":2}}"#).is_empty());
        // Cut short, it is not JSON: whether it was a notification is unknown.
        assert_eq!(
            one(r#"{"jsonrpc":"2.0","method":"x","params":{"a":1,"a":2},"#),
            (Value::Null, -32700)
        );
    }

    #[test]
    fn ordinary_messages_pass_through() {
        delivered(r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#);
        delivered("\u{feff}{\"jsonrpc\":\"2.0\",\"method\":\"notifications/initialized\"}\r\n");
        delivered(r#"{"jsonrpc":"2.0","id":5,"result":{"action":"accept","content":{}}}"#);
        assert!(matches!(judge(b"  \r\n"), Verdict::Skip));
    }

    #[tokio::test]
    async fn an_over_long_line_is_skipped_and_answered_and_the_next_is_read() {
        let long = format!(
            "{{\"jsonrpc\":\"2.0\",\"id\":41,\"method\":\"tools/call\",\"params\":{{\"name\":\"{}\"}}}}\n",
            "x".repeat(300)
        );
        let input = format!("{long}{{\"jsonrpc\":\"2.0\",\"id\":42,\"method\":\"tools/list\"}}\n");
        let (client, server_out) = tokio::io::duplex(1 << 16);
        let mut t = StdioFront::new(input.as_bytes(), server_out).with_max_line(100);
        let next = Transport::<RoleServer>::receive(&mut t).await;
        assert!(
            matches!(next, Some(JsonRpcMessage::Request(ref r)) if r.id == rmcp::model::RequestId::Number(42)),
            "{next:?}"
        );
        assert!(t.line.capacity() <= 64 * 1024 + 200);
        drop(t);
        let mut written = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut { client }, &mut written)
            .await
            .unwrap();
        let answer: Value = serde_json::from_str(written.trim()).unwrap();
        assert_eq!(answer["id"], 41);
        assert_eq!(answer["error"]["code"], -32600);
    }

    /// Feeds `input` to a transport with `max_line` through a pipe of `pipe` bytes (so
    /// the reader sees it in pieces), and returns what `receive` delivered and what was
    /// written back.
    async fn run(input: &[u8], max_line: usize, pipe: usize) -> (Vec<Value>, Vec<Value>) {
        let (mut tx, rx) = tokio::io::duplex(pipe);
        let input = input.to_vec();
        let feeder = tokio::spawn(async move {
            tokio::io::AsyncWriteExt::write_all(&mut tx, &input)
                .await
                .unwrap();
        });
        let (client, server_out) = tokio::io::duplex(1 << 16);
        let mut t = StdioFront::new(rx, server_out).with_max_line(max_line);
        let mut delivered = Vec::new();
        while let Some(m) = Transport::<RoleServer>::receive(&mut t).await {
            delivered.push(serde_json::to_value(&m).unwrap());
        }
        feeder.await.unwrap();
        drop(t);
        let mut written = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut { client }, &mut written)
            .await
            .unwrap();
        let answers = written
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        (delivered, answers)
    }

    /// `{"jsonrpc":"2.0","id":ID,"method":"tools/list"}` padded with spaces to `len` bytes.
    fn padded(id: i64, len: usize) -> String {
        let mut l = format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/list"}}"#);
        assert!(l.len() <= len);
        l.push_str(&" ".repeat(len - l.len()));
        l
    }

    #[tokio::test]
    async fn the_line_limit_is_exact() {
        let input = format!("{}\n{}\n{}", padded(1, 100), padded(2, 101), padded(3, 100));
        let (delivered, answers) = run(input.as_bytes(), 100, 7).await;
        let ids: Vec<&Value> = delivered.iter().map(|m| &m["id"]).collect();
        // The last line, without its newline, is still read.
        assert_eq!(ids, [&json!(1), &json!(3)], "{delivered:?}");
        assert_eq!(answers.len(), 1, "{answers:?}");
        assert_eq!(answers[0]["id"], 2);
        assert_eq!(answers[0]["error"]["code"], INVALID_REQUEST);
    }

    #[tokio::test]
    async fn an_over_long_line_read_in_pieces_keeps_its_id() {
        // The id is in the first pieces, read before the line is known to be too long.
        let long = format!(
            "{{\"jsonrpc\":\"2.0\",\"id\":\"early\",\"method\":\"tools/call\",\"params\":{{\"name\":\"{}\"}}}}",
            "x".repeat(300)
        );
        let input = format!("{long}\n{long}");
        let (delivered, answers) = run(input.as_bytes(), 100, 8).await;
        assert!(delivered.is_empty(), "{delivered:?}");
        // Both are answered: the second one ends at end of input, without a newline.
        assert_eq!(answers.len(), 2, "{answers:?}");
        for a in &answers {
            assert_eq!(a["id"], "early", "{a}");
            assert_eq!(a["error"]["code"], INVALID_REQUEST);
        }
    }

    #[test]
    fn the_jsonrpc_version_is_checked_by_name() {
        for line in [
            r#"{"jsonrpc":"1.0","id":1,"method":"ping"}"#,
            r#"{"id":1,"method":"ping"}"#,
            r#"{"jsonrpc":2,"id":1,"method":"ping"}"#,
        ] {
            let a = answer(line);
            assert_eq!(a.len(), 1, "{line}: {a:?}");
            assert_eq!(a[0]["error"]["code"], INVALID_REQUEST, "{line}");
            assert!(
                a[0]["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("`jsonrpc` must be \"2.0\""),
                "{line}: {a:?}"
            );
        }
    }

    #[test]
    fn params_of_the_wrong_shape_are_invalid_params_for_every_method() {
        for line in [
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/unknown","params":[1]}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/unknown","params":"x"}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}"#,
        ] {
            assert_eq!(one(line), (json!(1), -32602), "{line}");
        }
    }

    /// The `tools/call` shortcut yields what reading the line as rmcp's union of requests
    /// yields (serialized back, `_meta` and all), and takes only what it reads alike.
    #[test]
    fn a_tools_call_reads_as_the_union_reads_it() {
        for line in [
            r#"{"jsonrpc":"2.0","id":12,"method":"tools/call","params":{"name":"search_sources","arguments":{"query":"q","limit":5,"deep":{"a":[1,"b",null]}},"_meta":{"progressToken":3,"io.example/x":{"y":true}}}}"#,
            r#"{"id":"s-1","method":"tools/call","jsonrpc":"2.0","params":{"name":"t"}}"#,
            r#"{"jsonrpc":"2.0","id":0,"method":"tools/call","params":{"arguments":{},"name":"t"},"extra":1}"#,
            // A retry after `input_required` (MRTR): its answers and state ride along.
            r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"t","arguments":{"a":1},"inputResponses":{"apr_1":{"action":"accept","content":{"ok":true}}},"requestState":"st_9"}}"#,
        ] {
            let value: Value = serde_json::from_str(line).unwrap();
            assert!(call_tool_request(&value).is_some(), "{line}");
            let JsonRpcMessage::Request(got) = delivered(line) else {
                panic!("not a request: {line}")
            };
            assert!(
                matches!(got.request, ClientRequest::CallToolRequest(_)),
                "{line}"
            );
            if line.contains("requestState") {
                let ClientRequest::CallToolRequest(call) = &got.request else {
                    unreachable!("matched above")
                };
                assert_eq!(call.params.request_state.as_deref(), Some("st_9"));
                assert_eq!(
                    call.params.input_responses.as_ref().map(|r| r.len()),
                    Some(1)
                );
            }
            let union: RxJsonRpcMessage<RoleServer> = serde_json::from_str(line).unwrap();
            assert_eq!(
                serde_json::to_value(RxJsonRpcMessage::<RoleServer>::Request(got)).unwrap(),
                serde_json::to_value(union).unwrap(),
                "{line}"
            );
        }
        for line in [
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"arguments":{}}}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call"}"#,
            r#"{"jsonrpc":"2.0","id":1.5,"method":"tools/call","params":{"name":"t"}}"#,
        ] {
            let value: Value = serde_json::from_str(line).unwrap();
            assert!(call_tool_request(&value).is_none(), "{line}");
        }
    }

    /// What the strict judgement costs against rmcp's own typed parse of the same line
    /// (`cargo test -p airlock --release --lib -- --ignored judging_costs --nocapture`).
    #[test]
    #[ignore = "a measurement, not a check"]
    fn judging_costs() {
        let line = br#"{"jsonrpc":"2.0","id":12,"method":"tools/call","params":{"name":"search_sources","arguments":{"query":"checkpoint starvation","limit":5},"_meta":{"progressToken":3}}}"#;
        let n = 100_000;
        let t = std::time::Instant::now();
        for _ in 0..n {
            std::hint::black_box(
                serde_json::from_slice::<RxJsonRpcMessage<RoleServer>>(line).unwrap(),
            );
        }
        let typed = t.elapsed() / n;
        let t = std::time::Instant::now();
        for _ in 0..n {
            assert!(matches!(
                std::hint::black_box(judge(line)),
                Verdict::Deliver(_)
            ));
        }
        let judged = t.elapsed() / n;
        // The typed step alone, from the parsed tree: rmcp's union of requests against the
        // `tools/call` shortcut.
        let value: Value = serde_json::from_slice(line).unwrap();
        let t = std::time::Instant::now();
        for _ in 0..n {
            std::hint::black_box(
                <rmcp::model::JsonRpcRequest<ClientRequest> as serde::Deserialize>::deserialize(
                    std::hint::black_box(&value),
                )
                .unwrap(),
            );
        }
        let union = t.elapsed() / n;
        let t = std::time::Instant::now();
        for _ in 0..n {
            std::hint::black_box(call_tool_request(std::hint::black_box(&value)).unwrap());
        }
        let shortcut = t.elapsed() / n;
        eprintln!(
            "rmcp typed parse {typed:?} per line; strict judge {judged:?} per line; from the tree: the union of requests {union:?}, the tools/call shortcut {shortcut:?}"
        );
    }
}
