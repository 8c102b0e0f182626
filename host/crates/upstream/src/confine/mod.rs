//! Confinement of upstream stdio servers by the kernel.
//!
//! Rule: a confined server gets, from the kernel, only what its connection grants — the
//! same deny-by-default grammar as a mapping's grants (`../shared/DESIGN.md` §6, §8).
//! Nothing is inherited from the host but the protocol pipes:
//! - **filesystem** (Landlock, and with namespaces a view of its own, `view`): read-only
//!   the system folders a runtime needs ([`SYSTEM_READ_ONLY`], [`SYSTEM_DEVICES`]) and the
//!   command's own install folder, the script's package folder for an interpreter, a
//!   private writable temporary folder (`TMPDIR`), and the paths the connection grants;
//!   nothing else — no state folder, no key, no home folder, and with namespaces nothing
//!   else even exists for it (a Unix socket by path included);
//! - **processes** (new user, mount, PID, IPC and UTS namespaces): the server sees a fresh
//!   `/proc` with only its own processes; Landlock's ptrace rule keeps it out of every
//!   process outside its domain (`/proc/PID/environ`, `/proc/PID/mem`, `ptrace`) and its
//!   scopes out of the host's abstract Unix sockets and signals;
//! - **network** (a new network namespace, Landlock TCP rules, seccomp): no interface
//!   but its own loopback, no TCP bind, no other socket family but Unix, and TCP connect
//!   only to its egress proxy ([`proxy`]) when its connection grants `tcp_connect`
//!   destinations — the proxy, on the host, reaches those and nothing else;
//! - **system calls** (seccomp): a deny list of what a server never needs
//!   ([`seccomp::DENIED`]), new namespaces from inside, `clone3` (so that `clone`'s flags
//!   can be checked);
//! - **privileges**: `no_new_privs`, every capability dropped (also root's, also inside
//!   its user namespace), rlimits for processes, open files and address space
//!   ([`Limits`]).
//!
//! The kernel applies all of it in a helper process — this same binary, re-executed with
//! [`HELPER_ARG`] — that reads a [`Spec`] from [`SPEC_VAR`], confines itself and `exec`s
//! the server; a server never runs a single instruction unconfined. The helper is
//! single-threaded (a multi-threaded process cannot enter a new user namespace), which is
//! why the host does not confine in `pre_exec`. A kernel that lacks a feature the
//! confinement relies on is an error at start naming the feature and the setting that
//! lowers the requirement ([`namespaces`](Confinement::namespaces) `= false`, or
//! `confine = false` on the connection) — never a silent fallback.

pub mod helper;
mod landlock;
mod namespaces;
pub mod proxy;
pub mod seccomp;
mod view;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use airlock_core::destination::Destination;
use anyhow::{Context as _, Result, bail};
use serde::{Deserialize, Serialize};

/// The first argument that makes this binary the confinement helper
/// ([`helper::run`]) instead of the command line.
pub const HELPER_ARG: &str = "__airlock-confine";

/// The environment variable that carries the helper's [`Spec`] (JSON). The helper's own
/// environment holds nothing else; the server's is the spec's `env`.
pub const SPEC_VAR: &str = "AIRLOCK_CONFINE_SPEC";

/// Folders a runtime needs, granted read-only (and executable) to every confined server
/// when they exist.
pub const SYSTEM_READ_ONLY: &[&str] = &[
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/ssl",
    "/etc/ca-certificates",
    "/etc/pki",
    "/etc/localtime",
    "/etc/timezone",
    "/etc/nsswitch.conf",
    "/etc/passwd",
    "/etc/group",
    "/etc/hosts",
    "/etc/host.conf",
    "/etc/resolv.conf",
    "/etc/gai.conf",
    "/etc/mime.types",
    "/etc/os-release",
    "/etc/alternatives",
    "/proc",
    "/sys/devices/system/cpu",
    "/dev/random",
    "/dev/urandom",
    "/dev/zero",
];

/// Devices every confined server may write (and read).
pub const SYSTEM_DEVICES: &[&str] = &["/dev/null", "/dev/full"];

/// What a confined server may do with a granted path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Access {
    /// Read files, list folders, execute programs.
    ReadOnly,
    /// Also create, write, truncate, rename and remove.
    ReadWrite,
}

impl std::fmt::Display for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::ReadOnly => "read-only",
            Self::ReadWrite => "read-write",
        })
    }
}

/// One filesystem grant: an absolute, canonical path (a folder grants what is beneath it).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathGrant {
    /// Absolute, canonicalized at configuration load.
    pub path: PathBuf,
    /// What the server may do there.
    pub access: Access,
}

/// rlimits of a confined server (`[connection.limits]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Processes (and threads) at once in the server's PID namespace: the namespace's
    /// `pid_max` (Linux ≥ 6.14; the kernel's floor is 301 pids) and `RLIMIT_NPROC` (which
    /// the kernel does not apply to uid 0). Default [`Limits::DEFAULT.processes`](Limits::DEFAULT).
    pub processes: u64,
    /// `RLIMIT_NOFILE`: open file descriptors per process.
    pub open_files: u64,
    /// `RLIMIT_AS` in bytes, per process; `None` = unlimited (JavaScript engines reserve
    /// large address ranges they never touch).
    pub address_space: Option<u64>,
}

impl Limits {
    /// 256 processes, 1024 open files, unlimited address space.
    pub const DEFAULT: Self = Self {
        processes: 256,
        open_files: 1024,
        address_space: None,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// How a stdio connection's server is confined: what its configuration grants, beyond the
/// defaults every confined server gets ([`default_paths`]).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Confinement {
    /// Paths granted beyond the defaults.
    pub paths: Vec<PathGrant>,
    /// `tcp_connect` destinations (`host:port`, `address:port`, `network/prefix:port`;
    /// [`airlock_core::destination`]), reached through the host's egress proxy
    /// ([`proxy`]); none = no network. Needs [`namespaces`](Self::namespaces).
    pub tcp_connect: Vec<String>,
    /// rlimits.
    pub limits: Limits,
    /// New user, mount, PID, network, IPC and UTS namespaces (default true). `false`
    /// lowers the requirement for kernels or containers without unprivileged user
    /// namespaces: the server then shares the host's process and network namespaces
    /// (Landlock still keeps it out of other processes, TCP and the filesystem; seccomp
    /// out of other socket families).
    pub namespaces: bool,
    /// Start the egress proxy even without `tcp_connect` grants, so that every
    /// destination the server asks for is refused *and reported* (`airlock discover
    /// --learn`). Not configurable and not part of the summary: it grants nothing.
    #[serde(default, skip_serializing)]
    pub report_egress: bool,
}

impl Confinement {
    /// Deny by default: no grants beyond [`default_paths`], no network, default limits,
    /// namespaces on.
    #[must_use]
    pub fn deny_by_default() -> Self {
        Self {
            namespaces: true,
            ..Self::default()
        }
    }

    /// The canonical JSON summary that joins a connection's identity (widening it is
    /// drift): paths sorted, limits, namespaces.
    #[must_use]
    pub fn summary(&self) -> serde_json::Value {
        let mut paths = self.paths.clone();
        paths.sort();
        let mut tcp = self.tcp_connect.clone();
        tcp.sort();
        serde_json::json!({
            "filesystem": paths.iter().map(|p| serde_json::json!({
                "path": p.path.display().to_string(),
                "access": p.access.to_string(),
            })).collect::<Vec<_>>(),
            "tcp_connect": tcp,
            "limits": self.limits,
            "namespaces": self.namespaces,
        })
    }
}

/// What the helper receives: the server to `exec` and every path it may touch, resolved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Spec {
    /// Executable (absolute).
    pub command: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Its working directory.
    pub cwd: PathBuf,
    /// Its complete environment.
    pub env: BTreeMap<String, String>,
    /// Every path rule: defaults and grants (a path given twice keeps its widest access).
    pub paths: Vec<PathGrant>,
    /// rlimits.
    pub limits: Limits,
    /// Whether to enter new namespaces.
    pub namespaces: bool,
    /// The egress proxy's Unix socket, when the server may reach granted destinations:
    /// the helper relays `127.0.0.1:PORT` of the server's network namespace to it and
    /// names it in `HTTP_PROXY`/`HTTPS_PROXY`.
    #[serde(default)]
    pub egress: Option<PathBuf>,
    /// The server's private temporary folder: with namespaces, its filesystem view is
    /// built there (`view`).
    #[serde(default)]
    pub scratch: Option<PathBuf>,
}

/// What a confined server needs from the host while it runs: its private temporary
/// folder (removed when this is dropped) and its egress proxy (stopped when this is
/// dropped).
pub struct Confined {
    /// The private temporary folder (`TMPDIR`).
    pub scratch: tempfile::TempDir,
    /// The egress proxy, when the connection grants `tcp_connect` destinations.
    pub egress: Option<proxy::Egress>,
}

/// Checks `tcp_connect` grants: each parses ([`Destination::parse`]), and egress needs
/// the server's own network namespace (the proxy is reached from inside it).
///
/// # Errors
/// Names the entry that does not parse, or the setting that conflicts.
pub fn check_network(confinement: &Confinement) -> Result<Vec<Destination>> {
    let grants = confinement
        .tcp_connect
        .iter()
        .map(|entry| Destination::parse(entry).context("`grants.network.tcp_connect`"))
        .collect::<Result<Vec<_>>>()?;
    if !grants.is_empty() && !confinement.namespaces {
        bail!(
            "`grants.network.tcp_connect` needs `namespaces = true`: a confined server reaches granted destinations through the host's egress proxy from its own network namespace (without one it would share the host's network)"
        );
    }
    Ok(grants)
}

static HELPER: OnceLock<PathBuf> = OnceLock::new();

/// Names the executable that acts as the confinement helper: an `airlock` binary (its
/// `main` hands [`HELPER_ARG`] to [`helper::run`]). The `airlock` command line sets its
/// own; a process that embeds the host (a test, a benchmark) names one. The first call
/// wins.
pub fn use_helper(path: impl Into<PathBuf>) {
    let _ = HELPER.set(path.into());
}

/// The helper executable: the one named by [`use_helper`], else this process's own.
fn helper_path() -> Result<PathBuf> {
    if let Some(path) = HELPER.get() {
        return Ok(path.clone());
    }
    std::env::current_exe().context("locating the airlock executable (the confinement helper)")
}

/// The read-only paths every confined server gets besides the system folders: the
/// command's install folder (its folder, or the folder above a `bin` folder) and, for an
/// interpreter, the package folder of its script: for a script inside `node_modules`, the
/// folder that holds the outermost `node_modules` (its dependencies are its siblings);
/// else the nearest folder above the script holding `package.json`, `pyproject.toml`,
/// `setup.py` or `setup.cfg`, else the script's own folder. The script is the first argument not starting with `-` that names a file
/// against `cwd`.
#[must_use]
pub fn default_paths(command: &Path, args: &[String], cwd: &Path) -> Vec<PathGrant> {
    let existing = |list: &'static [&'static str], access: Access| {
        list.iter()
            .map(Path::new)
            .filter(|p| p.exists())
            .map(move |p| PathGrant {
                path: p.to_path_buf(),
                access,
            })
    };
    let mut paths: Vec<PathGrant> = existing(SYSTEM_READ_ONLY, Access::ReadOnly).collect();
    paths.extend(existing(SYSTEM_DEVICES, Access::ReadWrite));
    let command = command
        .canonicalize()
        .unwrap_or_else(|_| command.to_path_buf());
    if let Some(folder) = command.parent() {
        let install = match folder.file_name() {
            Some(name) if name == "bin" => folder.parent().unwrap_or(folder),
            _ => folder,
        };
        paths.push(PathGrant {
            path: install.to_path_buf(),
            access: Access::ReadOnly,
        });
    }
    let script = args
        .iter()
        .find(|a| !a.starts_with('-'))
        .map(|a| cwd.join(a))
        .filter(|p| p.is_file())
        .and_then(|p| p.canonicalize().ok());
    if let Some(script) = script {
        let own = script.parent().unwrap_or(Path::new("/")).to_path_buf();
        // A script inside `node_modules` needs its package's dependencies, which are its
        // siblings: the project that holds the outermost `node_modules`.
        let project = own
            .ancestors()
            .filter(|dir| dir.file_name().is_some_and(|n| n == "node_modules"))
            .last()
            .and_then(Path::parent)
            .map(Path::to_path_buf);
        let package = project.unwrap_or_else(|| {
            own.ancestors()
                .find(|dir| {
                    ["package.json", "pyproject.toml", "setup.py", "setup.cfg"]
                        .iter()
                        .any(|marker| dir.join(marker).is_file())
                })
                .map_or(own.clone(), Path::to_path_buf)
        });
        paths.push(PathGrant {
            path: package,
            access: Access::ReadOnly,
        });
    }
    paths
}

/// Merges path rules: one per path, with the widest access given for it.
fn merged(rules: impl IntoIterator<Item = PathGrant>) -> Vec<PathGrant> {
    let mut by_path: BTreeMap<PathBuf, Access> = BTreeMap::new();
    for rule in rules {
        let access = by_path.entry(rule.path).or_insert(rule.access);
        *access = (*access).max(rule.access);
    }
    by_path
        .into_iter()
        .map(|(path, access)| PathGrant { path, access })
        .collect()
}

/// Refuses grants that would reach what a server must never reach: a granted path that
/// is, holds, or lies inside one of `protected` (the state folder, the trace key file, the
/// checkpoint file). `/` itself is never granted.
///
/// # Errors
/// Names the grant and what it would expose.
pub fn check_protected(grants: &[PathGrant], protected: &[PathBuf]) -> Result<()> {
    for grant in grants {
        if grant.path == Path::new("/") {
            bail!("the whole filesystem (`/`) cannot be granted to a confined server");
        }
        let path = resolved(&grant.path);
        for p in protected {
            let p = resolved(p);
            if p.starts_with(&path) || path.starts_with(&p) {
                bail!(
                    "the grant of {} ({}) would expose {}, which a server must never reach; grant a path that neither holds it nor lies inside it",
                    grant.path.display(),
                    grant.access,
                    p.display()
                );
            }
        }
    }
    Ok(())
}

/// `path` with its deepest existing ancestor canonicalized (symbolic links resolved) and
/// the rest appended: a folder not made yet compares as where it will be.
#[must_use]
pub fn resolved(path: &Path) -> PathBuf {
    for ancestor in path.ancestors() {
        if let Ok(real) = ancestor.canonicalize() {
            let rest = path.strip_prefix(ancestor).unwrap_or(Path::new(""));
            return real.join(rest);
        }
    }
    path.to_path_buf()
}

/// A confined server's command: the helper with its [`Spec`], and what the host keeps
/// while the server runs ([`Confined`]: the private temporary folder, the egress proxy,
/// which reports its refusals to `report` — made by the caller so that it hears them even
/// when the server fails to start — or to a reporter nobody reads).
/// `TMPDIR` names that folder unless the connection's environment sets it. Call it on a
/// tokio runtime (the egress proxy is started on it).
///
/// A read-write grant that does not exist yet is made as a folder (owner-only).
///
/// # Errors
/// The helper cannot be located, a `tcp_connect` grant is malformed or lacks namespaces,
/// the egress proxy cannot start, or a granted folder or the temporary folder cannot be
/// made.
pub fn command(
    command: &Path,
    args: &[String],
    cwd: &Path,
    env: &BTreeMap<String, String>,
    confinement: &Confinement,
    report: Option<proxy::Reporter>,
) -> Result<(tokio::process::Command, Confined)> {
    let network = check_network(confinement)?;
    for grant in &confinement.paths {
        if grant.access == Access::ReadWrite && !grant.path.exists() {
            // A server's own data folder, named in its grants: made, owner-only.
            use std::os::unix::fs::DirBuilderExt as _;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&grant.path)
                .with_context(|| {
                    format!(
                        "making the granted read-write folder {}",
                        grant.path.display()
                    )
                })?;
        }
    }
    for grant in &confinement.paths {
        // Canonical when the configuration was loaded: a symbolic link that stands in the
        // path now (planted since, by a server that may write beside it) would be followed
        // by the mount and the folder making alike.
        let now = grant
            .path
            .canonicalize()
            .with_context(|| format!("granted path {} is gone", grant.path.display()))?;
        if now != grant.path {
            bail!(
                "granted path {} now leads to {} (a symbolic link stands in it): the server is not started; remove the link",
                grant.path.display(),
                now.display()
            );
        }
    }
    let tmp = tempfile::Builder::new()
        .prefix("airlock-upstream-")
        .tempdir()
        .context("making the server's private temporary folder")?;
    let mut env = env.clone();
    env.entry("TMPDIR".into())
        .or_insert_with(|| tmp.path().display().to_string());
    let mut paths = default_paths(command, args, cwd);
    paths.extend(confinement.paths.iter().cloned());
    paths.push(PathGrant {
        path: tmp.path().to_path_buf(),
        access: Access::ReadWrite,
    });
    let spec = Spec {
        command: command.to_path_buf(),
        args: args.to_vec(),
        cwd: cwd.to_path_buf(),
        env,
        paths: merged(paths),
        limits: confinement.limits,
        namespaces: confinement.namespaces,
        egress: None,
        scratch: Some(tmp.path().to_path_buf()),
    };
    let egress = if network.is_empty() && !(confinement.report_egress && confinement.namespaces) {
        None
    } else {
        let report = report.unwrap_or_else(|| proxy::Reporter::new().0);
        Some(proxy::Egress::start(network, report)?)
    };
    let spec = Spec {
        egress: egress.as_ref().map(|e| e.socket().to_path_buf()),
        ..spec
    };
    let mut cmd = tokio::process::Command::new(helper_path()?);
    cmd.arg(HELPER_ARG)
        .env_clear()
        .env(SPEC_VAR, serde_json::to_string(&spec)?)
        .current_dir(cwd);
    Ok((
        cmd,
        Confined {
            scratch: tmp,
            egress,
        },
    ))
}

/// What this kernel offers for confinement, for `airlock` to report (and tests to skip
/// what a machine cannot do): the Landlock ABI version (0 = none) and whether an
/// unprivileged process may create a user namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Support {
    /// Landlock ABI version, 0 when Landlock is absent or disabled.
    pub landlock_abi: i64,
    /// Whether this process could enter new user, mount, PID and network namespaces.
    pub namespaces: bool,
}

/// Probes the kernel (forks a short-lived child to try the namespaces).
#[must_use]
pub fn support() -> Support {
    Support {
        landlock_abi: landlock::kernel_abi(),
        namespaces: namespaces::probe(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merged_keeps_the_widest_access_per_path() {
        let rule = |p: &str, access| PathGrant {
            path: p.into(),
            access,
        };
        let got = merged([
            rule("/a", Access::ReadOnly),
            rule("/a", Access::ReadWrite),
            rule("/b", Access::ReadWrite),
            rule("/b", Access::ReadOnly),
            rule("/c", Access::ReadOnly),
        ]);
        assert_eq!(
            got,
            vec![
                rule("/a", Access::ReadWrite),
                rule("/b", Access::ReadWrite),
                rule("/c", Access::ReadOnly)
            ]
        );
    }

    #[test]
    fn a_grant_holding_the_state_folder_or_the_root_is_refused() {
        let grant = |p: &str| PathGrant {
            path: p.into(),
            access: Access::ReadOnly,
        };
        let protected = [
            PathBuf::from("/srv/airlock/state"),
            "/keys/trace.key".into(),
        ];
        assert!(check_protected(&[grant("/srv/docs")], &protected).is_ok());
        assert!(check_protected(&[grant("/srv/airlock/statefile")], &protected).is_ok());
        let e = check_protected(&[grant("/srv")], &protected).unwrap_err();
        assert!(e.to_string().contains("/srv/airlock/state"), "{e}");
        let e = check_protected(&[grant("/srv/airlock/state")], &protected).unwrap_err();
        assert!(e.to_string().contains("must never reach"), "{e}");
        let e = check_protected(&[grant("/keys/trace.key")], &protected).unwrap_err();
        assert!(e.to_string().contains("trace.key"), "{e}");
        // Inside the state folder: the store itself, or the key file in it.
        let e = check_protected(&[grant("/srv/airlock/state/airlock.db")], &protected).unwrap_err();
        assert!(e.to_string().contains("must never reach"), "{e}");
        // A folder that does not exist yet, reached through a symbolic link, compares
        // as where it will be.
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().canonicalize().unwrap().join("real");
        std::fs::create_dir(&real).unwrap();
        std::os::unix::fs::symlink(&real, dir.path().join("link")).unwrap();
        let state = real.join("data/state");
        let e = check_protected(
            &[PathGrant {
                path: dir.path().join("link/data"),
                access: Access::ReadWrite,
            }],
            std::slice::from_ref(&state),
        )
        .unwrap_err();
        assert!(e.to_string().contains("must never reach"), "{e}");
        assert!(check_protected(&[grant("/")], &[]).is_err());
    }

    #[test]
    fn default_paths_hold_the_install_folder_and_the_script_package_not_the_cwd() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        std::fs::create_dir_all(root.join("pkg/src")).unwrap();
        std::fs::create_dir_all(root.join("node/bin")).unwrap();
        std::fs::write(root.join("pkg/package.json"), "{}").unwrap();
        std::fs::write(root.join("pkg/src/server.js"), "").unwrap();
        std::fs::write(root.join("node/bin/node"), "").unwrap();
        let paths = default_paths(
            &root.join("node/bin/node"),
            &["--flag".into(), "pkg/src/server.js".into()],
            &root,
        );
        let has = |p: PathBuf| paths.iter().any(|g| g.path == p);
        assert!(has(root.join("node")), "{paths:?}");
        std::fs::create_dir_all(root.join("app/node_modules/@scope/server/dist")).unwrap();
        std::fs::write(
            root.join("app/node_modules/@scope/server/package.json"),
            "{}",
        )
        .unwrap();
        std::fs::write(
            root.join("app/node_modules/@scope/server/dist/index.js"),
            "",
        )
        .unwrap();
        let npm = default_paths(
            &root.join("node/bin/node"),
            &["app/node_modules/@scope/server/dist/index.js".into()],
            &root,
        );
        assert!(npm.iter().any(|g| g.path == root.join("app")), "{npm:?}");
        assert!(has(root.join("pkg")), "{paths:?}");
        assert!(!has(root.clone()), "{paths:?}");
        assert!(paths.iter().any(|g| g.path == Path::new("/usr")));
        assert!(
            paths
                .iter()
                .filter(|g| g.access == Access::ReadWrite)
                .all(|g| g.path.starts_with("/dev")),
            "{paths:?}"
        );
    }

    #[test]
    fn a_missing_read_write_folder_is_made_owner_only_at_start() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data/new");
        let c = Confinement {
            paths: vec![PathGrant {
                path: data.clone(),
                access: Access::ReadWrite,
            }],
            ..Confinement::deny_by_default()
        };
        use_helper("/bin/true");
        let (cmd, confined) = command(
            Path::new("/bin/true"),
            &[],
            Path::new("/"),
            &BTreeMap::new(),
            &c,
            None,
        )
        .unwrap();
        assert!(data.is_dir());
        assert_eq!(data.metadata().unwrap().permissions().mode() & 0o777, 0o700);
        // The spec the helper gets holds the folder read-write and the private TMPDIR.
        let spec = cmd
            .as_std()
            .get_envs()
            .find(|(k, _)| *k == SPEC_VAR)
            .and_then(|(_, v)| v)
            .unwrap()
            .to_str()
            .unwrap()
            .to_string();
        let spec: Spec = serde_json::from_str(&spec).unwrap();
        assert!(
            spec.paths
                .iter()
                .any(|g| g.path == data && g.access == Access::ReadWrite)
        );
        assert_eq!(
            spec.env["TMPDIR"],
            confined.scratch.path().display().to_string()
        );
        assert!(spec.egress.is_none() && confined.egress.is_none());
    }

    #[test]
    fn a_symbolic_link_planted_in_a_granted_path_stops_the_start() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let (shared, elsewhere) = (root.join("shared"), root.join("elsewhere"));
        std::fs::create_dir_all(&shared).unwrap();
        std::fs::create_dir_all(&elsewhere).unwrap();
        // Granted (not yet made) beneath a folder a server may write, where a link is
        // then planted in its way.
        let grant = shared.join("link/data");
        std::os::unix::fs::symlink(&elsewhere, shared.join("link")).unwrap();
        let c = Confinement {
            paths: vec![PathGrant {
                path: grant,
                access: Access::ReadWrite,
            }],
            ..Confinement::deny_by_default()
        };
        use_helper("/bin/true");
        let e = command(
            Path::new("/bin/true"),
            &[],
            Path::new("/"),
            &BTreeMap::new(),
            &c,
            None,
        )
        .err()
        .unwrap();
        assert!(
            e.to_string().contains("a symbolic link stands in it"),
            "{e}"
        );
    }

    #[tokio::test]
    async fn egress_grants_start_a_proxy_and_need_namespaces() {
        let granted = Confinement {
            tcp_connect: vec!["api.example.com:443".into()],
            ..Confinement::deny_by_default()
        };
        use_helper("/bin/true");
        let start = |c: &Confinement| {
            command(
                Path::new("/bin/true"),
                &[],
                Path::new("/"),
                &BTreeMap::new(),
                c,
                None,
            )
        };
        let (cmd, confined) = start(&granted).unwrap();
        let egress = confined.egress.as_ref().expect("a proxy runs");
        let spec: Spec = serde_json::from_str(
            cmd.as_std()
                .get_envs()
                .find(|(k, _)| *k == SPEC_VAR)
                .and_then(|(_, v)| v)
                .unwrap()
                .to_str()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(spec.egress.as_deref(), Some(egress.socket()));
        assert!(std::os::unix::net::UnixStream::connect(egress.socket()).is_ok());
        let e = start(&Confinement {
            namespaces: false,
            ..granted.clone()
        })
        .err()
        .unwrap();
        assert!(e.to_string().contains("needs `namespaces = true`"), "{e}");
        let e = start(&Confinement {
            tcp_connect: vec!["api.example.com".into()],
            ..granted
        })
        .err()
        .unwrap();
        assert!(format!("{e:#}").contains("has no port"), "{e:#}");
    }
}
