//! New namespaces for a confined server: user, mount, PID, network, IPC, UTS.
//!
//! Rule: the server is the first process of a PID namespace of its own, with a `/proc`
//! that shows only that namespace, no network interface but its own loopback, and the
//! same uid and gid it would have had (mapped one to one, `setgroups` denied). A kernel
//! or container that refuses any of it is an error naming the setting that lowers the
//! requirement (`namespaces = false`).

use std::path::Path;

use super::view::mount;

use anyhow::{Context as _, Result, bail};

/// The namespaces entered, as `unshare(2)` flags.
const FLAGS: libc::c_int = libc::CLONE_NEWUSER
    | libc::CLONE_NEWNS
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUTS;

/// The lowest `pid_max` the kernel accepts.
const PID_MAX_FLOOR: u64 = 301;

/// What to do when the kernel refuses: the setting that lowers the requirement.
const LOWER: &str = "set `namespaces = false` on the connection to confine it with Landlock, seccomp and rlimits alone (it then shares the host's process and network namespaces), or `confine = false` to run it unconfined (flagged in review)";

/// Enters the namespaces and returns in their first process (a child of the helper; the
/// helper waits for it and exits with its status, never returning). Loopback is brought
/// up first; with `egress` (the host's egress proxy socket), the helper listens on
/// `127.0.0.1:PORT` of the new network namespace and relays each connection to it
/// ([`relay_until_exit`]), and the port is returned. Then the first process mounts a fresh `/proc`
/// and bounds the PID namespace to `processes` (`pid_max`, where the kernel keeps one per
/// namespace: Linux ≥ 6.14).
///
/// # Errors
/// The kernel refused a namespace, the uid/gid map, the listener, the fork or a mount.
pub fn enter(processes: u64, egress: Option<&Path>) -> Result<Option<u16>> {
    // SAFETY: getuid/getgid cannot fail.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    // SAFETY: unshare with flags only; this process is single-threaded (the helper).
    if unsafe { libc::unshare(FLAGS) } != 0 {
        let e = std::io::Error::last_os_error();
        bail!(
            "entering new user, mount, PID and network namespaces failed ({e}): this kernel or container does not allow them to this user; {LOWER}"
        );
    }
    match std::fs::write("/proc/self/setgroups", "deny") {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).context("denying setgroups in the new user namespace");
        }
        _ => {}
    }
    std::fs::write("/proc/self/uid_map", format!("{uid} {uid} 1\n"))
        .context("mapping the uid into the new user namespace")?;
    std::fs::write("/proc/self/gid_map", format!("{gid} {gid} 1\n"))
        .context("mapping the gid into the new user namespace")?;
    loopback_up()?;
    let listener = egress
        .map(|_| {
            std::net::TcpListener::bind(("127.0.0.1", 0))
                .context("listening for the server's egress in its network namespace")
        })
        .transpose()?;
    let port = listener
        .as_ref()
        .map(|l| l.local_addr().map(|a| a.port()))
        .transpose()?;
    // SAFETY: single-threaded process; the child continues with a copy of it.
    match unsafe { libc::fork() } {
        -1 => {
            return Err(std::io::Error::last_os_error())
                .context("starting the PID namespace's first process");
        }
        0 => drop(listener),
        child => {
            forward_sigterm(child)?;
            match (listener, egress) {
                (Some(listener), Some(socket)) => relay_until_exit(listener, socket, child),
                _ => wait_and_exit(child),
            }
        }
    }
    // SAFETY: prctl with integer arguments. The helper is this process's parent; if it
    // is killed (the host died, or killed the group), so is the server.
    unsafe {
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        );
    }
    super::view::make_private().context("making the mounts private to the new mount namespace")?;
    mount(
        Some(Path::new("proc")),
        Path::new("/proc"),
        Some("proc"),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        None,
    )
    .with_context(|| {
        format!("mounting a /proc of the new PID namespace (the container may mask /proc); {LOWER}")
    })?;
    let pid_max = processes.saturating_add(1).max(PID_MAX_FLOOR);
    if let Err(e) = std::fs::write("/proc/sys/kernel/pid_max", pid_max.to_string()) {
        // Kernels before 6.14 have one pid_max for the machine: RLIMIT_NPROC still bounds
        // the server's processes (but not for uid 0).
        eprintln!(
            "airlock-confine: the PID namespace cannot be bounded by pid_max ({e}); processes are bounded by RLIMIT_NPROC only"
        );
    }
    Ok(port)
}

/// Relays each connection the server opens to `listener` (in its network namespace) to
/// the host's egress proxy at `socket` (a Unix socket reached by path, which crosses
/// network namespaces), byte for byte in both directions, at most
/// [`MAX_TUNNELS`](super::proxy::MAX_TUNNELS) at once (more are closed at once); when the
/// namespaces' first process exits, exits as it did. Runs in the helper, outside the
/// server's PID namespace and Landlock domain, on a single thread: a process that
/// entered a new PID namespace by `unshare` may not start threads (`clone(2)`,
/// `CLONE_THREAD`). Never returns.
fn relay_until_exit(listener: std::net::TcpListener, socket: &Path, child: libc::pid_t) -> ! {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build();
    let relayed = runtime.map_err(anyhow::Error::from).and_then(|runtime| {
        runtime.block_on(async {
            listener.set_nonblocking(true)?;
            let listener = tokio::net::TcpListener::from_std(listener)?;
            // SAFETY: pidfd_open with a pid and no flags; the fd is owned below.
            let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, child, 0) };
            let fd = i32::try_from(fd).unwrap_or(-1);
            if fd < 0 {
                return Err(std::io::Error::last_os_error())
                    .context("watching the server (pidfd_open)");
            }
            // SAFETY: `fd` is a new descriptor nothing else owns; the OwnedFd keeps it
            // open, and refers to it, for as long as the AsyncFd holds it.
            let exited = unsafe {
                tokio::io::unix::AsyncFd::register_with_interest(
                    <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd),
                    tokio::io::Interest::READABLE,
                )
            }
            .map_err(|e| anyhow::anyhow!("watching the server: {e}"))?;
            let permits =
                std::sync::Arc::new(tokio::sync::Semaphore::new(super::proxy::MAX_TUNNELS));
            let accept = async {
                loop {
                    let Ok((mut tcp, _)) = listener.accept().await else {
                        // Out of descriptors, most likely: wait for tunnels to close.
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    };
                    let Ok(permit) = permits.clone().try_acquire_owned() else {
                        continue;
                    };
                    let socket = socket.to_path_buf();
                    tokio::spawn(async move {
                        if let Ok(mut unix) = tokio::net::UnixStream::connect(&socket).await {
                            let _ = tokio::io::copy_bidirectional(&mut tcp, &mut unix).await;
                        }
                        drop(permit);
                    });
                }
            };
            tokio::select! {
                _ = exited.readable() => {}
                () = accept => {}
            }
            anyhow::Ok(())
        })
    });
    if let Err(e) = relayed {
        eprintln!("airlock-confine: the egress relay stopped: {e:#}");
    }
    wait_and_exit(child)
}

/// The namespaces' first process, for [`on_sigterm`].
static FIRST: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// Makes a `SIGTERM` to the helper (the host stops a server by `SIGTERM` to its process
/// group, then `SIGKILL` after a grace period) mean for the server what it would mean
/// outside a PID namespace: the server is the namespace's first process, which the kernel
/// gives only the signals it installed a handler for, so the helper — instead of dying,
/// which would `SIGKILL` the server at once (`PR_SET_PDEATHSIG`) — stays, and kills the
/// server only when it has no `SIGTERM` handler (the default action); a server that has
/// one got the group's `SIGTERM` itself and may finish its work, within the host's grace
/// period.
fn forward_sigterm(child: libc::pid_t) -> Result<()> {
    FIRST.store(child, std::sync::atomic::Ordering::SeqCst);
    // SAFETY: an all-zero sigaction is valid; the handler is async-signal-safe (it calls
    // open, read, close and kill only, on stack buffers).
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigterm as *const () as libc::sighandler_t;
        action.sa_flags = libc::SA_RESTART;
        if libc::sigaction(libc::SIGTERM, &raw const action, std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error()).context("handling SIGTERM in the helper");
        }
    }
    Ok(())
}

/// `SIGTERM` in the helper: `SIGKILL` to the server unless it catches `SIGTERM`.
extern "C" fn on_sigterm(_: libc::c_int) {
    let child = FIRST.load(std::sync::atomic::Ordering::SeqCst);
    if child > 0 && !catches_sigterm() {
        // SAFETY: kill is async-signal-safe.
        unsafe {
            libc::kill(child, libc::SIGKILL);
        }
    }
}

/// Whether the server has a `SIGTERM` handler: signal 15's bit (`0x4000`) of `SigCgt` in
/// `/proc/1/status` —
/// the helper's `/proc` is the one its first process mounted for the new PID namespace,
/// where the server is process 1. Async-signal-safe: no allocation, raw system calls.
fn catches_sigterm() -> bool {
    let mut buf = [0u8; 4096];
    // SAFETY: a NUL-terminated path; `buf` is valid for `len` bytes; the fd is closed.
    let n = unsafe {
        let fd = libc::open(c"/proc/1/status".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return false;
        }
        let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
        libc::close(fd);
        n
    };
    let Ok(n) = usize::try_from(n) else {
        return false;
    };
    sigcgt_has(&buf[..n], libc::SIGTERM)
}

/// Whether the `SigCgt:` line of a `/proc/PID/status` text has `signal`'s bit.
fn sigcgt_has(status: &[u8], signal: libc::c_int) -> bool {
    const KEY: &[u8] = b"SigCgt:";
    let Some(at) = status.windows(KEY.len()).position(|w| w == KEY) else {
        return false;
    };
    let mut mask: u64 = 0;
    for &b in status[at + KEY.len()..]
        .iter()
        .skip_while(|b| b.is_ascii_whitespace())
    {
        let digit = match b {
            b'0'..=b'9' => b - b'0',
            b'a'..=b'f' => b - b'a' + 10,
            _ => break,
        };
        mask = (mask << 4) | u64::from(digit);
    }
    u32::try_from(signal - 1).is_ok_and(|bit| mask & (1 << bit) != 0)
}

/// Waits for the namespaces' first process and exits as it did (a signal as 128 + its
/// number). Never returns.
fn wait_and_exit(child: libc::pid_t) -> ! {
    let mut status = 0;
    loop {
        // SAFETY: `status` is valid for the call.
        let got = unsafe { libc::waitpid(child, &mut status, 0) };
        if got == child {
            break;
        }
        if got == -1 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            std::process::exit(super::helper::FAILED);
        }
    }
    let code = if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        128 + libc::WTERMSIG(status)
    };
    std::process::exit(code);
}

/// Brings `lo` of the new network namespace up (a server may talk to itself).
fn loopback_up() -> Result<()> {
    // SAFETY: socket with constant arguments.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("bringing loopback up");
    }
    // SAFETY: an all-zero ifreq is valid; the name is copied within its bounds.
    let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
    for (slot, byte) in request.ifr_name.iter_mut().zip(b"lo\0") {
        *slot = *byte as libc::c_char;
    }
    // SAFETY: fd is an open socket and `request` a valid ifreq for both calls.
    let result = unsafe {
        if libc::ioctl(fd, libc::SIOCGIFFLAGS, &raw mut request) == 0 {
            request.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
            libc::ioctl(fd, libc::SIOCSIFFLAGS, &raw const request)
        } else {
            -1
        }
    };
    let error = std::io::Error::last_os_error();
    // SAFETY: fd is ours.
    unsafe { libc::close(fd) };
    if result != 0 {
        return Err(error).context("bringing loopback up in the new network namespace");
    }
    Ok(())
}

/// Whether a child of this process can enter the namespaces (forks a child that tries
/// and exits).
#[must_use]
pub fn probe() -> bool {
    // SAFETY: the child calls only unshare and _exit (async-signal-safe) before exiting.
    unsafe {
        match libc::fork() {
            -1 => false,
            0 => libc::_exit(i32::from(libc::unshare(FLAGS) != 0)),
            child => {
                let mut status = 0;
                while libc::waitpid(child, &mut status, 0) == -1 {
                    if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                        return false;
                    }
                }
                libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sigcgt_is_read_from_a_status_text() {
        let status = b"Name:\tnode\nSigBlk:\t0000000000000000\nSigIgn:\t0000000001001000\nSigCgt:\t0000000180004002\nCapInh:\t0\n";
        assert!(
            sigcgt_has(status, libc::SIGTERM),
            "signal 15's bit (0x4000)"
        );
        assert!(sigcgt_has(status, libc::SIGINT), "bit 2 (0x2)");
        assert!(!sigcgt_has(status, libc::SIGHUP));
        assert!(!sigcgt_has(b"SigCgt:\t0000000000000000\n", libc::SIGTERM));
        assert!(!sigcgt_has(b"no such line", libc::SIGTERM));
    }

    #[test]
    fn this_process_reads_its_own_handlers() {
        // This test process has no SIGTERM handler of its own.
        let status = std::fs::read("/proc/self/status").unwrap();
        assert!(!sigcgt_has(&status, libc::SIGTERM));
    }
}
