//! Private folders and files: where Airlock keeps what an attacker must not swap, widen or
//! redirect (the state folder and its database, the trace key, trace checkpoints, the
//! compiled-component cache).
//!
//! Rule: a private path is used only when it is **what it says it is, owned by this user
//! and writable by no one else**. Each check looks at the path itself, never through a
//! symbolic link (`lstat`), and refuses before anything is created or written:
//!
//! | the path is | folder | file | secret file ([`Access::Secret`]) |
//! |---|---|---|---|
//! | missing | created, mode 0700 (missing parents too) | created by the caller with [`create_new_private`], mode 0600 | same |
//! | a symbolic link (even a dangling one) | refused | refused | refused |
//! | another kind (a file where a folder belongs, a folder, a socket…) | refused | refused | refused |
//! | owned by another uid than the effective one | refused | refused | refused |
//! | writable by group or others (`mode & 0o022`) | refused | refused | refused |
//! | readable by group or others (`mode & 0o044`) | accepted | accepted | refused |
//!
//! Each refusal names the path, what is wrong and the command that fixes it (`chmod 700
//! PATH`, `chown UID PATH`, replace the link…), and says that nothing was written. Only
//! the last component is checked: the folders above it are the operator's choice
//! (`/tmp` itself is writable by everyone, and a temp folder inside it is still private).

use std::fs::Metadata;
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _};
use std::path::Path;

use anyhow::{Context as _, bail};

/// How private a file must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Others may read it, no one else may write it (the database: its readers are the
    /// operator's business; its writers are not).
    NotWritableByOthers,
    /// No one else may read or write it (a key).
    Secret,
}

/// The effective user id of this process.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Checks `path` as a private folder, creating it (mode 0700, with any missing parents)
/// when it does not exist. `what` names it in errors ("state folder"); `elsewhere` is the
/// alternative offered after the fix ("or choose another --state-dir").
///
/// # Errors
/// The folder is a symbolic link, not a folder, owned by another user, or writable by
/// group or others; or it could not be created.
pub fn ensure_private_dir(path: &Path, what: &str, elsewhere: &str) -> anyhow::Result<()> {
    if check_private_dir(path, what, elsewhere)? {
        return Ok(());
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
        .with_context(|| format!("creating the {what} {}", path.display()))?;
    // Someone may have put something else there in between.
    if !check_private_dir(path, what, elsewhere)? {
        bail!(
            "the {what} {} vanished while it was created",
            path.display()
        );
    }
    Ok(())
}

/// Checks `path` as a private folder without creating anything: `Ok(false)` when it does
/// not exist, `Ok(true)` when it exists and passes (see the module's table).
///
/// # Errors
/// As [`ensure_private_dir`], and when the folder cannot be inspected.
pub fn check_private_dir(path: &Path, what: &str, elsewhere: &str) -> anyhow::Result<bool> {
    let Some(meta) = lstat(path, what)? else {
        return Ok(false);
    };
    let shown = path.display();
    if meta.file_type().is_symlink() {
        bail!(
            "the {what} {shown} is a symbolic link (to {}); Airlock does not follow links for \
             its private folders: use the real folder instead of the link{}; nothing was \
             written",
            link_target(path),
            comma(elsewhere)
        );
    }
    if !meta.is_dir() {
        bail!(
            "the {what} {shown} is not a folder; move it aside{}; nothing was written",
            comma(elsewhere)
        );
    }
    check_owner_and_mode(
        path,
        &meta,
        what,
        elsewhere,
        "700",
        Access::NotWritableByOthers,
    )?;
    Ok(true)
}

/// Checks `path` as a private file without creating anything: `Ok(false)` when it does not
/// exist (not even as a dangling link), `Ok(true)` when it exists and passes.
///
/// # Errors
/// The file is a symbolic link (dangling or not), not a regular file, owned by another
/// user, or too open for `access` (see the module's table).
pub fn check_private_file(
    path: &Path,
    what: &str,
    elsewhere: &str,
    access: Access,
) -> anyhow::Result<bool> {
    let Some(meta) = lstat(path, what)? else {
        return Ok(false);
    };
    let shown = path.display();
    if meta.file_type().is_symlink() {
        bail!(
            "the {what} {shown} is a symbolic link (to {}); Airlock does not follow links for \
             its private files: replace the link with the file itself (or remove it){}; \
             nothing was written",
            link_target(path),
            comma(elsewhere)
        );
    }
    if !meta.is_file() {
        bail!(
            "the {what} {shown} is not a regular file; move it aside{}; nothing was written",
            comma(elsewhere)
        );
    }
    check_owner_and_mode(path, &meta, what, elsewhere, "600", access)?;
    Ok(true)
}

/// Creates `path` as a new file, mode 0600, failing if anything (a file, a link, a
/// dangling link) is already there; never follows a link.
///
/// # Errors
/// Something exists at `path`, or the file cannot be created.
pub fn create_new_private(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

/// Opens `path` for appending, creating it with mode 0600 when missing; never follows a
/// link. Check it first with [`check_private_file`].
///
/// # Errors
/// `path` is a link, or the file cannot be opened.
pub fn open_append_private(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

fn lstat(path: &Path, what: &str) -> anyhow::Result<Option<Metadata>> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) => Ok(Some(meta)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("inspecting the {what} {}", path.display())),
    }
}

fn check_owner_and_mode(
    path: &Path,
    meta: &Metadata,
    what: &str,
    elsewhere: &str,
    private_mode: &str,
    access: Access,
) -> anyhow::Result<()> {
    let shown = path.display();
    let me = effective_uid();
    if meta.uid() != me {
        bail!(
            "the {what} {shown} is owned by uid {}, not by this user (uid {me}): it must be \
             yours — `chown {me} {shown}` as its owner or root{}; nothing was written",
            meta.uid(),
            comma(elsewhere)
        );
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        bail!(
            "the {what} {shown} is writable by group or others (mode {mode:04o}): \
             `chmod {private_mode} {shown}`{}; nothing was written",
            comma(elsewhere)
        );
    }
    if access == Access::Secret && mode & 0o044 != 0 {
        bail!(
            "the {what} {shown} is readable by group or others (mode {mode:04o}): \
             `chmod {private_mode} {shown}`{}; nothing was written",
            comma(elsewhere)
        );
    }
    Ok(())
}

fn link_target(path: &Path) -> String {
    std::fs::read_link(path)
        .map(|t| t.display().to_string())
        .unwrap_or_else(|_| "an unreadable target".into())
}

fn comma(elsewhere: &str) -> String {
    if elsewhere.is_empty() {
        String::new()
    } else {
        format!(", {elsewhere}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    #[test]
    fn a_missing_folder_is_created_private_and_an_open_one_refused() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("a/b");
        ensure_private_dir(&dir, "state folder", "").unwrap();
        let mode = std::fs::metadata(&dir).unwrap().mode() & 0o777;
        assert_eq!(mode & 0o077, 0, "{mode:o}");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o770)).unwrap();
        let err = ensure_private_dir(&dir, "state folder", "").unwrap_err();
        assert!(err.to_string().contains("chmod 700"), "{err}");
        // Group-readable is fine for a folder; group-writable is not.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o750)).unwrap();
        ensure_private_dir(&dir, "state folder", "").unwrap();
    }

    #[test]
    fn a_secret_must_not_be_readable_by_others() {
        let root = tempfile::tempdir().unwrap();
        let key = root.path().join("k");
        create_new_private(&key).unwrap();
        assert!(check_private_file(&key, "key", "", Access::Secret).unwrap());
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o640)).unwrap();
        let err = check_private_file(&key, "key", "", Access::Secret).unwrap_err();
        assert!(err.to_string().contains("readable by group"), "{err}");
        assert!(check_private_file(&key, "db", "", Access::NotWritableByOthers).unwrap());
    }

    #[test]
    fn a_dangling_link_is_refused_and_never_created_through() {
        let root = tempfile::tempdir().unwrap();
        let target = root.path().join("elsewhere");
        let link = root.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let err = check_private_file(&link, "file", "", Access::Secret).unwrap_err();
        assert!(err.to_string().contains("symbolic link"), "{err}");
        assert!(create_new_private(&link).is_err());
        assert!(open_append_private(&link).is_err());
        assert!(!target.exists());
    }
}
