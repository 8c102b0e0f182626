//! The hot path's own requests to a stdio upstream: `tools/call` and `resources/read`
//! written and answered without rmcp's service loop.
//!
//! Rule: **one byte stream, whole lines, in order.** rmcp's client (the handshake,
//! discovery, notifications, pings) and the hot path's requests write to the server's
//! stdin through one [`Outbound`]: each line is handed over whole, under one lock, and
//! written in the order handed over — directly with one non-blocking `write(2)` when
//! nothing is queued (the hot path pays one system call and no task hand-off), otherwise
//! queued for the connection's pump task, which writes as the pipe drains. A line is
//! never split by another.
//!
//! Every rule of the reader still holds for the answers (`Filtered`, `Tap`):
//! a direct request's id is registered as open *before* its bytes are written, its answer
//! is held to the output budget while it is read, checked to be JSON-RPC, and handed to
//! its waiter by the reader itself — parsed once, never shown to rmcp. Direct ids are
//! numbers from [`FIRST_ID`] up (rmcp's own ids count up from 0 as 32-bit numbers, so the
//! two never meet). A waiter whose connection ends, degrades or times out fails at once;
//! a request abandoned by its caller is cancelled toward the server
//! (`notifications/cancelled`) and its late answer dropped.
//!
//! Only stdio connections negotiated with `initialize` (2025-11-25) use it: such a session
//! needs no per-request `_meta`. HTTP and replayed connections keep rmcp's client.

use std::io;
use std::os::fd::{AsFd as _, AsRawFd as _, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Poll, Waker};

use tokio::io::{AsyncWrite, AsyncWriteExt as _};
use tokio::process::ChildStdin;

use super::Tap;

/// The first id of a direct request.
pub const FIRST_ID: u64 = 1 << 40;

/// What the reader hands a direct request's waiter.
#[derive(Debug)]
pub enum Answer {
    /// The answer's `result` member.
    Result(serde_json::Value),
    /// A JSON-RPC error answer: code and message.
    Error(i64, String),
    /// The answer was larger than the output budget and was discarded while read.
    TooLarge,
}

/// The client → server byte stream of one stdio connection (see the module rule).
pub struct Outbound {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// A duplicate of the pipe's write end, for the direct writes: owned here, so it is
    /// never written after it was closed; dropped (closed) once the stream is closing or
    /// failed.
    fd: Option<OwnedFd>,
    /// Whole lines not yet written, in order.
    queued: Vec<u8>,
    /// The pump holds bytes it is writing: nothing may be written around it.
    pumping: bool,
    /// The pump, parked until bytes are queued.
    pump: Option<Waker>,
    /// The stream failed: every later line is refused with this.
    failed: Option<String>,
    /// The connection is going away: the pump writes what is queued, then closes.
    closing: bool,
}

impl Outbound {
    /// The stream over `stdin`, with its pump task spawned on the current runtime.
    pub fn start(stdin: ChildStdin) -> Arc<Self> {
        // Without a duplicate every line goes through the pump (a task hand-off each).
        let fd = stdin.as_fd().try_clone_to_owned().ok();
        let out = Arc::new(Self {
            state: Mutex::new(State {
                fd,
                ..State::default()
            }),
        });
        tokio::spawn(pump(out.clone(), stdin));
        out
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Hands over one whole line (ending in `\n`). Written at once when nothing is
    /// queued, else queued behind what is.
    ///
    /// # Errors
    /// The stream failed or is closing; nothing of `line` was written.
    pub fn send(&self, line: &[u8]) -> io::Result<()> {
        let mut state = self.lock();
        if let Some(why) = &state.failed {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, why.clone()));
        }
        if state.closing {
            return Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "the connection is closing",
            ));
        }
        let mut rest = line;
        if let Some(fd) = state
            .fd
            .as_ref()
            .filter(|_| state.queued.is_empty() && !state.pumping)
        {
            // SAFETY: `fd` is an open descriptor this stream owns (a duplicate of the
            // pipe's non-blocking write end), held by the lock for the whole call; a write
            // of a valid buffer of `rest.len()` bytes.
            let n = unsafe { libc::write(fd.as_raw_fd(), rest.as_ptr().cast(), rest.len()) };
            if n >= 0 {
                rest = &rest[n as usize..];
            } else {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::WouldBlock && e.kind() != io::ErrorKind::Interrupted {
                    state.failed = Some(e.to_string());
                    state.fd = None;
                    return Err(e);
                }
            }
            if rest.is_empty() {
                return Ok(());
            }
        }
        state.queued.extend_from_slice(rest);
        if let Some(pump) = state.pump.take() {
            pump.wake();
        }
        Ok(())
    }

    /// Writes what is queued, then closes the server's stdin; later lines are refused.
    pub fn close(&self) {
        let mut state = self.lock();
        state.closing = true;
        state.fd = None;
        if let Some(pump) = state.pump.take() {
            pump.wake();
        }
    }
}

/// Writes queued lines as the pipe drains; closes the pipe once the stream is closing and
/// nothing is queued, or when a write fails.
async fn pump(out: Arc<Outbound>, mut stdin: ChildStdin) {
    loop {
        let chunk = std::future::poll_fn(|cx| {
            let mut state = out.lock();
            if !state.queued.is_empty() {
                state.pumping = true;
                return Poll::Ready(Some(std::mem::take(&mut state.queued)));
            }
            state.pumping = false;
            if state.closing || state.failed.is_some() {
                return Poll::Ready(None);
            }
            state.pump = Some(cx.waker().clone());
            Poll::Pending
        })
        .await;
        let Some(chunk) = chunk else {
            let _ = stdin.shutdown().await;
            return;
        };
        if let Err(e) = stdin.write_all(&chunk).await {
            let mut state = out.lock();
            state.failed = Some(e.to_string());
            state.fd = None;
            state.pumping = false;
            state.queued.clear();
            return;
        }
    }
}

/// rmcp's side of the stream: whole lines go to the [`Outbound`], each request line's id
/// registered with the tap first (as [`super::TapWriter`] does for the other transports).
pub(super) struct RmcpLines {
    out: Arc<Outbound>,
    tap: Arc<Tap>,
    partial: Vec<u8>,
}

impl RmcpLines {
    /// rmcp's writer over `out`, registering with `tap`.
    pub(super) fn new(out: Arc<Outbound>, tap: Arc<Tap>) -> Self {
        Self {
            out,
            tap,
            partial: Vec::new(),
        }
    }
}

impl AsyncWrite for RmcpLines {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let mut start = 0;
        for (i, &b) in buf.iter().enumerate() {
            if b != b'\n' {
                continue;
            }
            let line: std::borrow::Cow<'_, [u8]> = if this.partial.is_empty() {
                std::borrow::Cow::Borrowed(&buf[start..=i])
            } else {
                let mut joined = std::mem::take(&mut this.partial);
                joined.extend_from_slice(&buf[start..=i]);
                std::borrow::Cow::Owned(joined)
            };
            // Registered before the bytes can reach the server (and its answer the reader).
            this.tap.outgoing(&line);
            this.out.send(&line)?;
            start = i + 1;
        }
        this.partial.extend_from_slice(&buf[start..]);
        if this.partial.len() > super::MAX_REQUEST_LINE {
            this.partial.clear();
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "a request line longer than the host sends",
            )));
        }
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> Poll<io::Result<()>> {
        self.out.close();
        Poll::Ready(Ok(()))
    }
}

/// The request line `{"jsonrpc":"2.0","id":ID,"method":METHOD,"params":PARAMS}\n`.
///
/// # Errors
/// `params` does not serialize.
pub fn request_line(
    id: u64,
    method: &str,
    params: &impl serde::Serialize,
) -> serde_json::Result<Vec<u8>> {
    let mut line = Vec::with_capacity(256);
    line.extend_from_slice(b"{\"jsonrpc\":\"2.0\",\"id\":");
    line.extend_from_slice(itoa::Buffer::new().format(id).as_bytes());
    line.extend_from_slice(b",\"method\":");
    serde_json::to_writer(&mut line, method)?;
    line.extend_from_slice(b",\"params\":");
    serde_json::to_writer(&mut line, params)?;
    line.extend_from_slice(b"}\n");
    Ok(line)
}

/// The `notifications/cancelled` line for request `id`.
pub fn cancelled_line(id: u64, reason: &str) -> Vec<u8> {
    let params = serde_json::json!({"requestId": id, "reason": reason});
    let mut line = Vec::with_capacity(128);
    line.extend_from_slice(
        b"{\"jsonrpc\":\"2.0\",\"method\":\"notifications/cancelled\",\"params\":",
    );
    // A `Value` always serializes.
    let _ = serde_json::to_writer(&mut line, &params);
    line.extend_from_slice(b"}\n");
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_lines_are_json_rpc_with_a_number_id() {
        let line = request_line(
            FIRST_ID + 7,
            "tools/call",
            &serde_json::json!({"name": "read_note", "arguments": {"id": "x\"\n"}}),
        )
        .unwrap();
        assert_eq!(line.last(), Some(&b'\n'));
        assert_eq!(line.iter().filter(|&&b| b == b'\n').count(), 1, "one line");
        let v: serde_json::Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(v["jsonrpc"], "2.0");
        assert_eq!(v["id"], FIRST_ID + 7);
        assert_eq!(v["method"], "tools/call");
        assert_eq!(v["params"]["arguments"]["id"], "x\"\n");
        let c: serde_json::Value =
            serde_json::from_slice(&cancelled_line(FIRST_ID, "late")).unwrap();
        assert_eq!(c["method"], "notifications/cancelled");
        assert_eq!(c["params"]["requestId"], FIRST_ID);
        assert!(c.get("id").is_none(), "a notification");
    }

    /// Lines handed over while the pipe is full are queued whole and written in order by
    /// the pump as the reader drains it; none is split by another.
    #[tokio::test]
    async fn lines_stay_whole_and_in_order_when_the_pipe_is_full() {
        let mut child = tokio::process::Command::new("sh")
            .args(["-c", "sleep 0.3; cat"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let out = Outbound::start(child.stdin.take().unwrap());
        let mut stdout = child.stdout.take().unwrap();
        let reading = tokio::spawn(async move {
            let mut all = Vec::new();
            tokio::io::AsyncReadExt::read_to_end(&mut stdout, &mut all)
                .await
                .unwrap();
            all
        });
        // Far more than a pipe holds (64 KiB), from two writers taking turns.
        let mut expected = Vec::new();
        for i in 0..4000 {
            let line = format!("{{\"n\":{i},\"pad\":\"{}\"}}\n", "x".repeat(i % 97));
            out.send(line.as_bytes()).unwrap();
            expected.extend_from_slice(line.as_bytes());
        }
        out.close();
        assert!(out.send(b"{}\n").is_err(), "refused once closing");
        let written = reading.await.unwrap();
        assert_eq!(written.len(), expected.len());
        assert!(written == expected, "every line whole, in order");
    }
}
