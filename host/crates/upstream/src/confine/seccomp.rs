//! The seccomp filter of a confined server: a deny list.
//!
//! Rule: the calls in [`DENIED`] fail with `EPERM` — what an MCP server never needs and
//! what would reach beyond its sandbox (other processes' memory, the kernel's keyrings,
//! modules, mounts, BPF, performance counters, `io_uring`, which bypasses this filter's
//! view of the calls it carries) — and so do `clone` with any namespace flag and
//! `socket` for raw packets; `clone3` fails with `ENOSYS` (its flags sit in memory a
//! filter cannot read; the C library then falls back to `clone`). A server that shares
//! the host's network namespace also gets no IPv4 or IPv6 socket at all (Landlock's TCP
//! rules do not cover UDP). Everything else is allowed: the filesystem, processes and
//! TCP are Landlock's and the namespaces' to restrict.

use std::collections::BTreeMap;

use anyhow::{Context as _, Result};
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// System calls refused with `EPERM`, by name and number.
pub const DENIED: &[(&str, libc::c_long)] = &[
    ("ptrace", libc::SYS_ptrace),
    ("process_vm_readv", libc::SYS_process_vm_readv),
    ("process_vm_writev", libc::SYS_process_vm_writev),
    ("pidfd_getfd", libc::SYS_pidfd_getfd),
    ("mount", libc::SYS_mount),
    ("umount2", libc::SYS_umount2),
    ("pivot_root", libc::SYS_pivot_root),
    ("chroot", libc::SYS_chroot),
    ("fsopen", libc::SYS_fsopen),
    ("fsconfig", libc::SYS_fsconfig),
    ("fsmount", libc::SYS_fsmount),
    ("fspick", libc::SYS_fspick),
    ("move_mount", libc::SYS_move_mount),
    ("open_tree", libc::SYS_open_tree),
    ("mount_setattr", libc::SYS_mount_setattr),
    ("unshare", libc::SYS_unshare),
    ("setns", libc::SYS_setns),
    ("bpf", libc::SYS_bpf),
    ("perf_event_open", libc::SYS_perf_event_open),
    ("keyctl", libc::SYS_keyctl),
    ("add_key", libc::SYS_add_key),
    ("request_key", libc::SYS_request_key),
    ("kexec_load", libc::SYS_kexec_load),
    ("kexec_file_load", libc::SYS_kexec_file_load),
    ("init_module", libc::SYS_init_module),
    ("finit_module", libc::SYS_finit_module),
    ("delete_module", libc::SYS_delete_module),
    ("swapon", libc::SYS_swapon),
    ("swapoff", libc::SYS_swapoff),
    ("reboot", libc::SYS_reboot),
    ("acct", libc::SYS_acct),
    ("syslog", libc::SYS_syslog),
    ("quotactl", libc::SYS_quotactl),
    ("open_by_handle_at", libc::SYS_open_by_handle_at),
    ("name_to_handle_at", libc::SYS_name_to_handle_at),
    ("userfaultfd", libc::SYS_userfaultfd),
    ("io_uring_setup", libc::SYS_io_uring_setup),
    ("io_uring_enter", libc::SYS_io_uring_enter),
    ("io_uring_register", libc::SYS_io_uring_register),
    ("settimeofday", libc::SYS_settimeofday),
    ("clock_settime", libc::SYS_clock_settime),
    ("clock_adjtime", libc::SYS_clock_adjtime),
    ("adjtimex", libc::SYS_adjtimex),
    ("vhangup", libc::SYS_vhangup),
];

/// `clone` flags that make a namespace.
const NAMESPACE_FLAGS: &[libc::c_int] = &[
    libc::CLONE_NEWUSER,
    libc::CLONE_NEWNS,
    libc::CLONE_NEWPID,
    libc::CLONE_NEWNET,
    libc::CLONE_NEWIPC,
    libc::CLONE_NEWUTS,
    libc::CLONE_NEWCGROUP,
];

/// Socket families refused (first argument of `socket`): raw packets always; IPv4 and
/// IPv6 too when the server shares the host's network namespace.
fn denied_families(shares_host_network: bool) -> Vec<libc::c_int> {
    let mut families = vec![libc::AF_PACKET];
    if shares_host_network {
        families.extend([libc::AF_INET, libc::AF_INET6]);
    }
    families
}

/// The two programs: `(EPERM deny list, clone3 → ENOSYS)`.
///
/// # Errors
/// This architecture is not one seccompiler knows (x86_64, aarch64, riscv64).
pub fn programs(shares_host_network: bool) -> Result<(BpfProgram, BpfProgram)> {
    let arch = TargetArch::try_from(std::env::consts::ARCH).with_context(|| {
        format!(
            "no seccomp filter for this architecture ({}); set `confine = false` on the connection",
            std::env::consts::ARCH
        )
    })?;
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = DENIED
        .iter()
        .map(|&(_, number)| (number, Vec::new()))
        .collect();
    let flag_rule = |flag: libc::c_int| -> Result<SeccompRule> {
        let flag = u64::from(flag.unsigned_abs());
        Ok(SeccompRule::new(vec![SeccompCondition::new(
            0,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(flag),
            flag,
        )?])?)
    };
    rules.insert(
        libc::SYS_clone,
        NAMESPACE_FLAGS
            .iter()
            .map(|&f| flag_rule(f))
            .collect::<Result<_>>()?,
    );
    let family_rule = |family: libc::c_int| -> Result<SeccompRule> {
        Ok(SeccompRule::new(vec![SeccompCondition::new(
            0,
            SeccompCmpArgLen::Dword,
            SeccompCmpOp::Eq,
            u64::from(family.unsigned_abs()),
        )?])?)
    };
    rules.insert(
        libc::SYS_socket,
        denied_families(shares_host_network)
            .into_iter()
            .map(family_rule)
            .collect::<Result<_>>()?,
    );
    let eperm = u32::try_from(libc::EPERM).unwrap_or(1);
    let deny = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(eperm),
        arch,
    )?;
    let enosys = u32::try_from(libc::ENOSYS).unwrap_or(38);
    let clone3 = SeccompFilter::new(
        BTreeMap::from([(libc::SYS_clone3, Vec::new())]),
        SeccompAction::Allow,
        SeccompAction::Errno(enosys),
        arch,
    )?;
    Ok((deny.try_into()?, clone3.try_into()?))
}

/// Installs both filters on this process (inherited by what it `exec`s and forks).
/// Needs `no_new_privs` first.
///
/// # Errors
/// The filters cannot be built or the kernel refused them.
pub fn apply(shares_host_network: bool) -> Result<()> {
    let (deny, clone3) = programs(shares_host_network)?;
    seccompiler::apply_filter(&deny).context("installing the seccomp filter")?;
    seccompiler::apply_filter(&clone3).context("installing the seccomp filter for clone3")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_programs_build_for_this_architecture() {
        for shares in [false, true] {
            let (deny, clone3) = programs(shares).unwrap();
            assert!(deny.len() > DENIED.len(), "{}", deny.len());
            assert!(!clone3.is_empty());
        }
    }

    #[test]
    fn the_deny_list_names_each_call_once() {
        let mut numbers: Vec<_> = DENIED.iter().map(|(_, n)| *n).collect();
        numbers.sort_unstable();
        numbers.dedup();
        assert_eq!(numbers.len(), DENIED.len());
    }
}
