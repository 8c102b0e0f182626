//! The process of one upstream stdio server, and everything it starts.
//!
//! Rules:
//! - Each server is the leader of **its own process group** (`setpgid(0, 0)` before
//!   `exec`), so the host can signal the server and every descendant that stayed in the
//!   group at once, and a terminal's Ctrl-C reaches the host, not the servers.
//! - Each server gets `PR_SET_PDEATHSIG = SIGKILL`: if the host dies without stopping it
//!   (`kill -9`), the kernel kills the server. (Linux ties this to the thread that forked;
//!   servers are spawned from runtime worker threads, which live as long as the host.)
//!   Descendants the server forks do not inherit it; stopping the group covers those.
//! - The server is **reaped as soon as it exits** (a task waits on it), so it never stays
//!   a zombie; at that moment whatever is left of its group is killed (`SIGKILL`) — a dead
//!   server's helpers serve no one — while the group id is still held by those members.
//! - Stopping ([`Process::terminate`]) sends `SIGTERM` to the group, waits up to a grace
//!   period for the server to exit, then sends `SIGKILL`. Dropping a [`Process`] whose
//!   server still runs kills its group (`SIGKILL`): a failed or abandoned start leaves
//!   nothing behind.

use std::time::Duration;

use anyhow::{Context as _, Result};
use tokio::process::{ChildStderr, ChildStdin, ChildStdout, Command};

/// A running (or exited) upstream server process and its process group.
pub struct Process {
    pid: u32,
    /// `None` while the server runs; then how it ended, in words ("exit status: 1",
    /// "signal: 9 (SIGKILL)").
    exit: tokio::sync::watch::Receiver<Option<String>>,
    /// What a confined server needs from the host while it runs (its private temporary
    /// folder, its egress proxy), released when this is dropped.
    confined: Option<crate::confine::Confined>,
}

/// The pipes of a freshly started server.
pub struct Pipes {
    /// The server's stdin (the host writes requests).
    pub stdin: ChildStdin,
    /// The server's stdout (the host reads answers).
    pub stdout: ChildStdout,
    /// The server's stderr (logged).
    pub stderr: Option<ChildStderr>,
}

fn killpg(pgid: u32, signal: libc::c_int) {
    let Ok(pgid) = libc::pid_t::try_from(pgid) else {
        return;
    };
    if pgid > 1 {
        // SAFETY: killpg has no memory-safety preconditions; a group that is gone is ESRCH.
        unsafe {
            libc::killpg(pgid, signal);
        }
    }
}

impl Process {
    /// Spawns `cmd` (stdin, stdout and stderr piped) as the leader of a new process group
    /// that dies with the host; starts the task that reaps it.
    ///
    /// # Errors
    /// The process could not be started.
    pub fn spawn(mut cmd: Command) -> Result<(Self, Pipes)> {
        let parent = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
        cmd.stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(false)
            .process_group(0);
        // SAFETY: the closure runs in the forked child before exec and calls only
        // async-signal-safe functions (prctl, getppid, _exit).
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(
                    libc::PR_SET_PDEATHSIG,
                    libc::SIGKILL as libc::c_ulong,
                    0,
                    0,
                    0,
                ) == -1
                {
                    return Err(std::io::Error::last_os_error());
                }
                // The host died between fork and prctl: do not outlive it.
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn()?;
        let pid = child.id().context("the started server has no process id")?;
        let stdin = child.stdin.take().context("child stdin")?;
        let stdout = child.stdout.take().context("child stdout")?;
        let stderr = child.stderr.take();
        let (tx, exit) = tokio::sync::watch::channel(None);
        tokio::spawn(async move {
            let how = match child.wait().await {
                Ok(status) => status.to_string(),
                Err(e) => format!("could not be waited for: {e}"),
            };
            // Reaped; its leftovers still hold the group id, so this reaches only them.
            killpg(pid, libc::SIGKILL);
            let _ = tx.send(Some(how));
        });
        Ok((
            Self {
                pid,
                exit,
                confined: None,
            },
            Pipes {
                stdin,
                stdout,
                stderr,
            },
        ))
    }

    /// Keeps what a confined server needs from the host (its private temporary folder,
    /// its egress proxy) until this process is dropped.
    pub fn keep(&mut self, confined: crate::confine::Confined) {
        self.confined = Some(confined);
    }

    /// A confined server's egress proxy, when its connection grants destinations.
    #[must_use]
    pub fn egress(&self) -> Option<&crate::confine::proxy::Egress> {
        self.confined.as_ref()?.egress.as_ref()
    }

    /// The server's process id (also its process group id).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// How the server ended, once it was reaped; `None` while it runs.
    pub fn exit_status(&self) -> Option<String> {
        self.exit.borrow().clone()
    }

    /// A receiver of how the server ended (`None` while it runs).
    pub fn exit_watch(&self) -> tokio::sync::watch::Receiver<Option<String>> {
        self.exit.clone()
    }

    /// Resolves once the server exited and was reaped.
    pub async fn exited(&self) {
        let mut exit = self.exit.clone();
        // An error means the reaper is gone (the runtime is shutting down): nothing to wait.
        let _ = exit.wait_for(Option::is_some).await;
    }

    /// Stops the server and its process group: `SIGTERM`, up to `grace` for the server to
    /// exit, then `SIGKILL`. Returns how it ended.
    pub async fn terminate(&self, grace: Duration) -> Option<String> {
        if self.exit_status().is_none() {
            killpg(self.pid, libc::SIGTERM);
            if tokio::time::timeout(grace, self.exited()).await.is_err() {
                tracing::warn!(
                    pid = self.pid,
                    "upstream server did not exit within {} ms of SIGTERM; killing its process group",
                    grace.as_millis()
                );
                killpg(self.pid, libc::SIGKILL);
                let _ = tokio::time::timeout(Duration::from_secs(2), self.exited()).await;
            }
        }
        self.exit_status()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        if self.exit_status().is_none() {
            killpg(self.pid, libc::SIGKILL);
        }
    }
}
