//! The confinement helper: the process between the host and a confined server.
//!
//! Rule: the helper applies every restriction of its [`Spec`] to itself, in an order
//! where each step still has what it needs and nothing after it can undo it, then
//! `exec`s the server — or, when any step fails, writes one line naming what failed on
//! stderr (which the host shows in the connection's start error) and exits with
//! [`FAILED`]. The server runs nothing unconfined.
//!
//! Order: namespaces (user, mount, PID, network, IPC, UTS; loopback up and, for egress, the
//! relay's listener on `127.0.0.1`; then a fork so that the server is the PID namespace's
//! first process, a fresh `/proc`, the PID namespace's `pid_max`) → the server's own
//! filesystem view (`view`: its grants only, by `pivot_root`) → rlimits → working
//! directory → capabilities dropped and locked (root's too: `SECBIT_NOROOT`) →
//! `no_new_privs` → Landlock (filesystem, TCP, scopes) → seccomp (last: the steps before
//! need the calls it refuses) → `execve`.

use std::os::unix::process::CommandExt as _;

use anyhow::{Context as _, Result};

use super::{SPEC_VAR, Spec};

/// Exit status of a helper that could not confine (the server never started).
pub const FAILED: i32 = 125;

/// Runs the helper: reads the spec from [`SPEC_VAR`], confines this process and `exec`s
/// the server. Never returns. Call it first thing in `main`, before any thread starts.
pub fn run() -> ! {
    let failure = match std::env::var(SPEC_VAR) {
        Ok(text) => match serde_json::from_str::<Spec>(&text) {
            Ok(spec) => confine_and_exec(&spec),
            Err(e) => anyhow::anyhow!("the confinement spec in {SPEC_VAR} is not valid: {e}"),
        },
        Err(_) => anyhow::anyhow!(
            "{SPEC_VAR} is not set: this mode of airlock is started by airlock itself, for a confined upstream server"
        ),
    };
    eprintln!("airlock-confine: {failure:#}");
    std::process::exit(FAILED);
}

/// Confines and `exec`s; returns only the error that stopped it.
fn confine_and_exec(spec: &Spec) -> anyhow::Error {
    match confine(spec) {
        Ok(proxy_port) => {
            let mut env = spec.env.clone();
            if let Some(port) = proxy_port {
                proxy_env(&mut env, port);
            }
            let error = std::process::Command::new(&spec.command)
                .args(&spec.args)
                .env_clear()
                .envs(&env)
                .exec();
            anyhow::anyhow!(
                "starting {} confined: {error} (a confined server can execute only what is beneath its read-only grants)",
                spec.command.display()
            )
        }
        Err(e) => e,
    }
}

/// The variables that send a server's HTTP clients through the egress relay at
/// `127.0.0.1:port`, each unless the connection's environment sets it:
/// `HTTP_PROXY`/`HTTPS_PROXY` (and their lower-case forms, which curl and Python read) and
/// `NODE_USE_ENV_PROXY=1` (Node's own `fetch` and `http` read the others only then).
pub fn proxy_env(env: &mut std::collections::BTreeMap<String, String>, port: u16) {
    let url = format!("http://127.0.0.1:{port}");
    for name in ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"] {
        env.entry(name.into()).or_insert_with(|| url.clone());
    }
    env.entry("NODE_USE_ENV_PROXY".into())
        .or_insert_with(|| "1".into());
}

/// Every restriction, in order; on return this process is the confined server-to-be.
/// Returns the port of the egress relay in its network namespace, when it has one.
fn confine(spec: &Spec) -> Result<Option<u16>> {
    let proxy_port = if spec.namespaces {
        // Returns in the namespaces' first process; the helper itself waits there (and
        // relays egress).
        let port = super::namespaces::enter(spec.limits.processes, spec.egress.as_deref())?;
        if let Some(scratch) = &spec.scratch {
            super::view::enter(&spec.paths, &spec.cwd, scratch)?;
        }
        port
    } else if spec.egress.is_some() {
        anyhow::bail!("egress through the host's proxy needs the server's own network namespace");
    } else {
        None
    };
    set_limits(spec)?;
    std::env::set_current_dir(&spec.cwd).with_context(|| {
        format!(
            "entering the working directory {} (a confined server's working directory must be beneath its grants)",
            spec.cwd.display()
        )
    })?;
    drop_capabilities()?;
    // SAFETY: prctl with integer arguments has no memory-safety preconditions.
    let (one, zero): (libc::c_ulong, libc::c_ulong) = (1, 0);
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, one, zero, zero, zero) } != 0 {
        return Err(std::io::Error::last_os_error()).context("setting no_new_privs");
    }
    super::landlock::restrict(&spec.paths, proxy_port)?;
    super::seccomp::apply(!spec.namespaces)?;
    Ok(proxy_port)
}

/// `RLIMIT_NOFILE`, `RLIMIT_AS` from the spec, `RLIMIT_CORE` 0 (a core file would hold
/// whatever the server had in memory), and `RLIMIT_NPROC` inside namespaces only: there
/// the kernel counts the server's own processes (those of its user namespace); outside
/// it would count every process of the host's user.
fn set_limits(spec: &Spec) -> Result<()> {
    let limits = spec.limits;
    let mut set = vec![
        (libc::RLIMIT_NOFILE, limits.open_files, "open_files"),
        (libc::RLIMIT_CORE, 0, "core"),
    ];
    if spec.namespaces {
        set.push((libc::RLIMIT_NPROC, limits.processes, "processes"));
    }
    if let Some(bytes) = limits.address_space {
        set.push((libc::RLIMIT_AS, bytes, "address_space"));
    }
    for (resource, value, name) in set {
        let limit = libc::rlimit {
            rlim_cur: value,
            rlim_max: value,
        };
        // SAFETY: `limit` is a valid rlimit for the duration of the call.
        if unsafe { libc::setrlimit(resource, &limit) } != 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("setting the `{name}` limit to {value}"));
        }
    }
    Ok(())
}

/// Drops every capability for good: the bounding set emptied, ambient cleared,
/// `SECBIT_NOROOT` (uid 0 gains nothing at `exec`) and its lock, then the permitted,
/// effective and inheritable sets emptied. A process that has no `CAP_SETPCAP` (an
/// ordinary user outside a user namespace) has nothing to drop and gains nothing at
/// `exec` (`no_new_privs` ignores file capabilities), so EPERM there is not an error.
fn drop_capabilities() -> Result<()> {
    const SECBIT_NOROOT: libc::c_ulong = 1 << 0;
    const SECBIT_NOROOT_LOCKED: libc::c_ulong = 1 << 1;
    const SECBIT_NO_SETUID_FIXUP: libc::c_ulong = 1 << 2;
    const SECBIT_NO_SETUID_FIXUP_LOCKED: libc::c_ulong = 1 << 3;
    const SECBIT_NO_CAP_AMBIENT_RAISE: libc::c_ulong = 1 << 6;
    const SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED: libc::c_ulong = 1 << 7;
    /// `CAP_SETPCAP` (linux/capability.h): needed to change securebits and the bounding set.
    const CAP_SETPCAP: libc::c_int = 8;
    let has_setpcap = capability_effective(CAP_SETPCAP)?;
    if has_setpcap {
        let bits = SECBIT_NOROOT
            | SECBIT_NOROOT_LOCKED
            | SECBIT_NO_SETUID_FIXUP
            | SECBIT_NO_SETUID_FIXUP_LOCKED
            | SECBIT_NO_CAP_AMBIENT_RAISE
            | SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED;
        // SAFETY: prctl with integer arguments.
        let zero: libc::c_ulong = 0;
        if unsafe { libc::prctl(libc::PR_SET_SECUREBITS, bits, zero, zero, zero) } != 0 {
            return Err(std::io::Error::last_os_error()).context("locking the securebits");
        }
        for cap in 0..64 as libc::c_ulong {
            // SAFETY: prctl with integer arguments; EINVAL past the last capability.
            if unsafe {
                libc::prctl(
                    libc::PR_CAPBSET_DROP,
                    cap,
                    0 as libc::c_ulong,
                    0 as libc::c_ulong,
                    0 as libc::c_ulong,
                )
            } != 0
            {
                break;
            }
        }
    }
    // SAFETY: prctl with integer arguments.
    unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        );
    }
    let header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let data = [CapData::default(); 2];
    // SAFETY: header and data are valid for the call; version 3 reads two data structs.
    if unsafe { libc::syscall(libc::SYS_capset, &header, data.as_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error()).context("dropping capabilities");
    }
    Ok(())
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Whether `cap` is in this process's effective set.
fn capability_effective(cap: libc::c_int) -> Result<bool> {
    let header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: header and data are valid for the call; version 3 writes two data structs.
    if unsafe { libc::syscall(libc::SYS_capget, &header, data.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error()).context("reading capabilities");
    }
    let cap = usize::try_from(cap).unwrap_or(0);
    Ok(data[cap / 32].effective & (1 << (cap % 32)) != 0)
}
