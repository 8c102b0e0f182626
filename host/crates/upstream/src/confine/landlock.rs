//! Landlock rules of a confined server.
//!
//! Rule: every filesystem access right, TCP bind and connect, abstract Unix sockets and
//! signals are handled (denied unless a rule allows them); the rules allow exactly the
//! spec's paths — read-only as read, list and execute; read-write as every right — and no
//! TCP port but the egress relay's, for connect only. Landlock ABI 6 (Linux 6.12) is required, as a hard requirement: a
//! kernel that cannot enforce every one of these is an error, never a partial sandbox.
//! Landlock also keeps the server from `ptrace` and from the `/proc/PID/{environ,mem}` of
//! every process outside its domain (the host among them), whatever its uid.

use anyhow::{Context as _, Result, bail};
use landlock::{
    ABI, Access, AccessFs, AccessNet, BitFlags, CompatLevel, Compatible as _, NetPort, PathBeneath,
    PathFd, Ruleset, RulesetAttr as _, RulesetCreatedAttr as _, RulesetStatus, Scope,
};

use super::{Access as Grant, PathGrant};

/// The Landlock ABI whose rights are all required.
pub const REQUIRED_ABI: i64 = 6;

/// The Landlock ABI this kernel offers (0: none, or Landlock disabled).
#[must_use]
pub fn kernel_abi() -> i64 {
    const LANDLOCK_CREATE_RULESET_VERSION: libc::c_ulong = 1;
    // SAFETY: with a null attribute and size 0 this call only reports the ABI version.
    let abi = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    abi.max(0)
}

/// Restricts this process (and what it `exec`s) to `paths`, TCP connect to `proxy_port`
/// only (none without it), no TCP bind, scoped.
///
/// # Errors
/// The kernel's Landlock is absent or older than [`REQUIRED_ABI`], a path cannot be
/// opened, or the ruleset was not fully enforced.
pub fn restrict(paths: &[PathGrant], proxy_port: Option<u16>) -> Result<()> {
    let have = kernel_abi();
    if have < REQUIRED_ABI {
        bail!(
            "Landlock ABI {REQUIRED_ABI} (Linux 6.12) is required to confine a server; this kernel offers {} — set `confine = false` on the connection to run it unconfined (flagged in review)",
            if have == 0 {
                "none (Landlock is absent or not enabled: add `landlock` to the kernel's lsm= list)"
                    .to_string()
            } else {
                format!("ABI {have}")
            }
        );
    }
    let abi = ABI::V6;
    let read: BitFlags<AccessFs> = AccessFs::from_read(abi);
    let all: BitFlags<AccessFs> = AccessFs::from_all(abi);
    let mut ruleset = Ruleset::default()
        .set_compatibility(CompatLevel::HardRequirement)
        .handle_access(all)?
        .handle_access(AccessNet::from_all(abi))?
        .scope(Scope::from_all(abi))?
        .create()?;
    for grant in paths {
        if !grant.path.exists() {
            // Nothing there to grant (a default path this machine lacks, a symbolic link
            // whose target is outside the server's view).
            continue;
        }
        let fd = PathFd::new(&grant.path)
            .with_context(|| format!("opening granted path {}", grant.path.display()))?;
        let wanted = match grant.access {
            Grant::ReadOnly => read,
            Grant::ReadWrite => all,
        };
        // A file takes only the rights that apply to files.
        let access = if grant.path.is_dir() {
            wanted
        } else {
            wanted & AccessFs::from_file(abi)
        };
        ruleset = ruleset.add_rule(PathBeneath::new(fd, access))?;
    }
    if let Some(port) = proxy_port {
        ruleset = ruleset.add_rule(NetPort::new(port, AccessNet::ConnectTcp))?;
    }
    let status = ruleset.restrict_self()?;
    if status.ruleset != RulesetStatus::FullyEnforced {
        bail!("the Landlock ruleset was not fully enforced ({status:?})");
    }
    Ok(())
}
