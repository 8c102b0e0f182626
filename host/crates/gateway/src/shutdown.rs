//! Clean shutdown of a serving host.
//!
//! Rule: the host stops on `SIGTERM`, `SIGINT` or the end of its client's input (stdin
//! EOF on the stdio front), and in every case
//! 1. refuses new calls (`unavailable`: the host is shutting down);
//! 2. **drains** the calls in flight — waits until they finished, at most
//!    [`DRAIN_TIMEOUT`] — so that their answers are sent and their outcomes recorded;
//! 3. stops every upstream server **and its process group**: `SIGTERM`, then `SIGKILL`
//!    after [`STOP_GRACE`] (see [`crate::upstream::process`]);
//! 4. appends a checkpoint of the trace head to the checkpoint file
//!    ([`crate::registry::anchor`]).
//!
//! A second `SIGTERM`/`SIGINT` while draining exits at once (status 130); the upstream
//! servers then die with the host (`PR_SET_PDEATHSIG`).
//!
//! Signals are caught with `sigaction` and a self-pipe read by a dedicated thread (no
//! runtime feature needed, nothing blocks the async runtime's exit).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

use tokio::io::AsyncRead;

use crate::registry::live::Live;

/// Longest wait for the calls in flight when the host stops.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Time an upstream server has to exit after `SIGTERM` before its group is killed.
pub const STOP_GRACE: Duration = Duration::from_secs(2);

/// Write end of the self-pipe the signal handler writes to (-1: not installed).
static SIGNAL_PIPE: AtomicI32 = AtomicI32::new(-1);

/// Set to the first signal caught (its name).
static CAUGHT: OnceLock<tokio::sync::watch::Sender<Option<&'static str>>> = OnceLock::new();

extern "C" fn on_signal(signal: libc::c_int) {
    // Only async-signal-safe calls here: save errno, write one byte, restore errno.
    // SAFETY: __errno_location returns this thread's errno slot; write(2) is
    // async-signal-safe and the buffer lives for the call.
    unsafe {
        let errno = *libc::__errno_location();
        let fd = SIGNAL_PIPE.load(Ordering::Relaxed);
        if fd >= 0 {
            let byte = signal as u8;
            libc::write(fd, (&raw const byte).cast(), 1);
        }
        *libc::__errno_location() = errno;
    }
}

fn install() -> &'static tokio::sync::watch::Sender<Option<&'static str>> {
    CAUGHT.get_or_init(|| {
        let (tx, _) = tokio::sync::watch::channel(None);
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: pipe2 writes two descriptors into the array it is given.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            tracing::error!(
                "cannot catch SIGTERM/SIGINT (pipe2 failed: {}); they will stop the host without draining",
                std::io::Error::last_os_error()
            );
            return tx;
        }
        let [read, write] = fds;
        SIGNAL_PIPE.store(write, Ordering::Relaxed);
        for signal in [libc::SIGTERM, libc::SIGINT] {
            // SAFETY: a zeroed sigaction with a handler that is async-signal-safe.
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = on_signal as *const () as usize;
                action.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&raw mut action.sa_mask);
                libc::sigaction(signal, &raw const action, std::ptr::null_mut());
            }
        }
        let sender = tx.clone();
        std::thread::Builder::new()
            .name("airlock-signals".into())
            .spawn(move || {
                let mut first = true;
                loop {
                    let mut byte = 0u8;
                    // SAFETY: reads one byte into a local buffer.
                    let n = unsafe { libc::read(read, (&raw mut byte).cast(), 1) };
                    if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                        continue;
                    }
                    if n != 1 {
                        return;
                    }
                    let name = if libc::c_int::from(byte) == libc::SIGINT {
                        "SIGINT"
                    } else {
                        "SIGTERM"
                    };
                    if first {
                        first = false;
                        let _ = sender.send(Some(name));
                    } else {
                        eprintln!("airlock: {name} again while stopping; exiting now");
                        // SAFETY: ends the process at once, as the second signal asks.
                        unsafe { libc::_exit(130) };
                    }
                }
            })
            .expect("spawning the signal thread");
        tx
    })
}

/// Catches `SIGTERM` and `SIGINT` from now on (idempotent). Call it early: until then
/// they end the process at once.
pub fn catch_signals() {
    install();
}

/// Resolves with the signal's name once `SIGTERM` or `SIGINT` arrived (installs the
/// handlers on first use).
pub async fn signalled() -> &'static str {
    let mut rx = install().subscribe();
    match rx.wait_for(Option::is_some).await {
        Ok(name) => name.unwrap_or("SIGTERM"),
        Err(_) => std::future::pending().await,
    }
}

/// Drains the calls in flight (at most [`DRAIN_TIMEOUT`]), then stops every upstream
/// connection and its process group. `why` is said in the log.
pub async fn stop(live: &Live, why: &str) {
    tracing::info!(
        in_flight = live.calls_in_flight(),
        "stopping ({why}): draining calls in flight (at most {} s)",
        DRAIN_TIMEOUT.as_secs()
    );
    live.begin_shutdown();
    if !live.drain(DRAIN_TIMEOUT).await {
        tracing::warn!(
            in_flight = live.calls_in_flight(),
            "calls still in flight after {} s; stopping anyway",
            DRAIN_TIMEOUT.as_secs()
        );
    }
    live.shutdown(STOP_GRACE).await;
    tracing::info!("stopped: every upstream server and its process group");
    crate::registry::anchor::at_shutdown(live.registry(), live.config());
}

/// Runs a front's `session` until it ends (the client's input ended, or it failed) or
/// `SIGTERM`/`SIGINT` arrives; then stops the host ([`stop`]). On a signal the session
/// keeps answering while the calls in flight drain, and is closed after. Returns the
/// session's result.
///
/// # Errors
/// The session's error.
pub async fn run(
    live: &Live,
    session: impl Future<Output = anyhow::Result<()>>,
) -> anyhow::Result<()> {
    let mut session = std::pin::pin!(session);
    let (result, why) = tokio::select! {
        result = &mut session => (result, "the session ended"),
        name = signalled() => {
            tracing::info!(in_flight = live.calls_in_flight(), "{name}: refusing new calls, draining calls in flight");
            live.begin_shutdown();
            tokio::select! {
                _ = live.drain(DRAIN_TIMEOUT) => {}
                _ = &mut session => {}
            }
            (Ok(()), name)
        }
    };
    stop(live, why).await;
    result
}

/// Wraps the client's input so that its end (EOF) is passed on only once the calls in
/// flight drained (at most [`DRAIN_TIMEOUT`]): the MCP service answers them before it
/// closes. New calls are refused from the moment the end is read.
pub fn drain_before_eof<R: AsyncRead + Unpin + Send + 'static>(
    input: R,
    live: std::sync::Arc<Live>,
) -> impl AsyncRead + Unpin + Send + 'static {
    DrainBeforeEof {
        input,
        live,
        waiting: None,
        done: false,
    }
}

struct DrainBeforeEof<R> {
    input: R,
    live: std::sync::Arc<Live>,
    waiting: Option<std::pin::Pin<Box<dyn Future<Output = ()> + Send>>>,
    done: bool,
}

impl<R: AsyncRead + Unpin> AsyncRead for DrainBeforeEof<R> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        let this = &mut *self;
        if this.done {
            return Poll::Ready(Ok(()));
        }
        if this.waiting.is_none() {
            let before = buf.filled().len();
            match std::pin::Pin::new(&mut this.input).poll_read(cx, buf) {
                Poll::Ready(Ok(())) if buf.filled().len() == before => {
                    tracing::info!(
                        in_flight = this.live.calls_in_flight(),
                        "the client's input ended; draining calls in flight before closing"
                    );
                    this.live.begin_shutdown();
                    let live = this.live.clone();
                    this.waiting = Some(Box::pin(async move {
                        live.drain(DRAIN_TIMEOUT).await;
                    }));
                }
                other => return other,
            }
        }
        match this.waiting.as_mut().map(|w| w.as_mut().poll(cx)) {
            Some(Poll::Ready(())) => {
                this.done = true;
                this.waiting = None;
                Poll::Ready(Ok(()))
            }
            _ => Poll::Pending,
        }
    }
}
