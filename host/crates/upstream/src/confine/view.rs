//! The filesystem a confined server sees: its grants, and nothing else.
//!
//! Rule: in its own mount namespace, the server's root is a fresh `tmpfs` (read-only once
//! built) holding a bind mount of each path of its spec — read-only grants mounted
//! read-only — a fresh `/proc`, and an empty folder at its working directory when that is
//! not granted. Everything else is not there at all: not merely refused, absent — which
//! also keeps the server from what Landlock ABI 6 does not mediate, such as connecting to
//! a Unix socket by its path (a database's, a container runtime's, a desktop bus's).
//! Landlock's rules still apply on top. A symbolic link among the paths (`/bin` → `usr/bin`)
//! is made again as the same link. Bind mounts are not recursive: a filesystem mounted
//! beneath a granted folder shows as its empty mount point.
//!
//! Built in the namespaces' first process, in a mount namespace of its own (so the helper,
//! which relays egress to a Unix socket by path, keeps the host's view), on a `tmpfs`
//! mounted at `.root` in the server's private temporary folder, then made the root by
//! `pivot_root(2)` with the old root detached.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, bail};

use super::{Access, PathGrant};

/// Makes the view and enters it. `staging_parent` is a folder this process may write
/// (the server's private temporary folder).
///
/// # Errors
/// A mount, the folder for a mount point or the `pivot_root` failed.
pub fn enter(paths: &[PathGrant], cwd: &Path, staging_parent: &Path) -> Result<()> {
    // SAFETY: unshare with a flag only; this process is single-threaded.
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
        return Err(std::io::Error::last_os_error())
            .context("entering the server's own mount namespace");
    }
    make_private().context("making the server's mounts private")?;
    let root = staging_parent.join(".root");
    std::fs::create_dir_all(&root).with_context(|| format!("making {}", root.display()))?;
    mount(
        Some(Path::new("tmpfs")),
        &root,
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NODEV,
        Some("mode=0755"),
    )
    .context("mounting the server's root (tmpfs)")?;
    let mut sorted: Vec<&PathGrant> = paths.iter().collect();
    sorted.sort_by(|a, b| a.path.cmp(&b.path));
    for grant in sorted {
        place(&root, grant).with_context(|| {
            format!(
                "placing {} ({}) in the server's filesystem",
                grant.path.display(),
                grant.access
            )
        })?;
    }
    let inner = beneath(&root, cwd);
    if std::fs::symlink_metadata(&inner).is_err() {
        std::fs::create_dir_all(&inner)
            .with_context(|| format!("making the working directory {} (empty)", cwd.display()))?;
    }
    std::env::set_current_dir(&root).context("entering the server's root")?;
    let dot = CString::new(".")?;
    // SAFETY: both arguments are valid NUL-terminated strings. pivot_root(".", ".") stacks
    // the old root beneath the new one, then it is detached.
    if unsafe { libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error()).context("pivot_root to the server's root");
    }
    // SAFETY: a valid NUL-terminated path.
    if unsafe { libc::umount2(dot.as_ptr(), libc::MNT_DETACH) } != 0 {
        return Err(std::io::Error::last_os_error()).context("detaching the host's root");
    }
    std::env::set_current_dir("/").context("entering /")?;
    mount(
        None,
        Path::new("/"),
        None,
        libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
        None,
    )
    .context("making the server's root read-only")
}

/// Makes every mount of this mount namespace private (nothing propagates to or from the
/// namespace it was copied from).
pub(super) fn make_private() -> Result<()> {
    mount(
        None,
        Path::new("/"),
        None,
        libc::MS_REC | libc::MS_PRIVATE,
        None,
    )
}

/// `path` (absolute) beneath `root`.
fn beneath(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

/// Places one path of the spec beneath `root`: a fresh `/proc`, a symbolic link made
/// again, or a bind mount (read-only for a read-only grant). A path that does not exist
/// is left out (Landlock would refuse it anyway).
fn place(root: &Path, grant: &PathGrant) -> Result<()> {
    let Ok(meta) = std::fs::symlink_metadata(&grant.path) else {
        return Ok(());
    };
    let target = beneath(root, &grant.path);
    if let Some(parent) = target.parent() {
        std::fs::create_dir_all(parent).with_context(|| format!("making {}", parent.display()))?;
    }
    if grant.path == Path::new("/proc") {
        std::fs::create_dir_all(&target)?;
        return mount(
            Some(Path::new("proc")),
            &target,
            Some("proc"),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            None,
        );
    }
    if meta.is_symlink() {
        if std::fs::symlink_metadata(&target).is_err() {
            std::os::unix::fs::symlink(std::fs::read_link(&grant.path)?, &target)?;
        }
        return Ok(());
    }
    // Beneath a folder mounted already, the mount point is that folder's own entry.
    if std::fs::symlink_metadata(&target).is_err() {
        if meta.is_dir() {
            std::fs::create_dir(&target)?;
        } else {
            std::fs::File::create(&target)?;
        }
    }
    mount(
        Some(grant.path.as_path()),
        &target,
        None,
        libc::MS_BIND,
        None,
    )?;
    // A device node works on a read-only mount (writing to /dev/null still does), and
    // there its mode, owner and times — the host's own inode — cannot be changed.
    let device = {
        use std::os::unix::fs::FileTypeExt as _;
        meta.file_type().is_char_device() || meta.file_type().is_block_device()
    };
    if grant.access == Access::ReadOnly || device {
        // A remount in a user namespace must keep the flags the mount came with.
        let kept = kept_flags(&target)?;
        mount(
            None,
            &target,
            None,
            libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | kept,
            None,
        )
        .context("making it read-only")?;
    }
    Ok(())
}

/// The flags of the mount at `path` a remount must keep (`statvfs(3)`'s `f_flag`).
fn kept_flags(path: &Path) -> Result<libc::c_ulong> {
    let c = CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: an all-zero statvfs is valid; `c` is a valid path for the call.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &raw mut st) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    let mut flags = 0;
    for (st_flag, ms_flag) in [
        (libc::ST_NOSUID, libc::MS_NOSUID),
        (libc::ST_NODEV, libc::MS_NODEV),
        (libc::ST_NOEXEC, libc::MS_NOEXEC),
        (libc::ST_NOATIME, libc::MS_NOATIME),
        (libc::ST_NODIRATIME, libc::MS_NODIRATIME),
        (libc::ST_RELATIME, libc::MS_RELATIME),
    ] {
        if st.f_flag & st_flag != 0 {
            flags |= ms_flag;
        }
    }
    Ok(flags)
}

/// `mount(2)`; the error names the target.
pub(super) fn mount(
    source: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> Result<()> {
    let cstr = |p: &Path| CString::new(p.as_os_str().as_bytes());
    let source = source.map(cstr).transpose()?;
    let target_c = cstr(target)?;
    let fstype = fstype.map(CString::new).transpose()?;
    let data = data.map(CString::new).transpose()?;
    // SAFETY: every pointer is a valid NUL-terminated string or null for the call.
    let done = unsafe {
        libc::mount(
            source.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
            target_c.as_ptr(),
            fstype.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
            flags,
            data.as_ref()
                .map_or(std::ptr::null(), |s| s.as_ptr().cast()),
        )
    };
    if done != 0 {
        let e = std::io::Error::last_os_error();
        bail!("mount on {}: {e}", target.display());
    }
    Ok(())
}
