//! `airlock discover CONNECTION --learn`: what a confined server was denied while it
//! started and answered discovery, and the grants that would allow it.
//!
//! Rules:
//! - A suggestion is printed, never applied: widening a connection's grants is a change to
//!   its identity that needs review (README "Confining upstream servers").
//! - Egress is exact: each destination the egress proxy refused, as the `tcp_connect`
//!   entry that grants it.
//! - The filesystem is read from the server's own words: a stderr line that reports a
//!   refusal (`Permission denied`, `EACCES`, `No such file or directory`, `Read-only file
//!   system`, …) and names an absolute path that exists on the host — a path the server's
//!   view leaves out shows to it as missing. Read-write is suggested when the line speaks
//!   of writing (for a file that does not exist yet, its folder), else read-only. A server that swallows its errors teaches nothing here.
//! - What must never be granted is reported as such, never suggested: a path that would
//!   expose the state folder or the checkpoint file, `/`, and any `/proc` entry.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::upstream::confine::{Access, PathGrant, check_protected, proxy::Refused};

/// The connection's network side, as a learning run sees it.
#[derive(Debug, Clone, Default)]
pub struct Network {
    /// Its `tcp_connect` grants as configured (suggestions add to them).
    pub granted: Vec<String>,
    /// Whether its egress went through a proxy that reports (namespaces on): without
    /// one, nothing about egress can be learned.
    pub observed: bool,
}

/// What a learning run found.
#[derive(Debug, Default, Serialize)]
pub struct Learned {
    /// Whether egress was observed (the server ran in its own network namespace, behind
    /// the egress proxy); when false, `egress` is empty for want of a way to see it.
    pub egress_observed: bool,
    /// Destinations the egress proxy refused.
    pub egress: Vec<EgressDenial>,
    /// Paths the server reported it was refused.
    pub paths: Vec<PathDenial>,
    /// The grants to add, as TOML for the connection's `[[connection]]` block (empty
    /// when there is nothing to add).
    pub toml: String,
}

/// One refused destination.
#[derive(Debug, Serialize)]
pub struct EgressDenial {
    /// `HOST:PORT` as the server asked for it: the `tcp_connect` entry that grants it.
    pub grant: String,
    /// Why the proxy refused it.
    pub reason: String,
    /// Why it cannot be granted, when it cannot (not a destination a grant can name).
    pub never: Option<String>,
}

/// One refused path.
#[derive(Debug, Serialize)]
pub struct PathDenial {
    /// The absolute path the server named.
    pub path: PathBuf,
    /// The access that would allow what it tried.
    pub access: Access,
    /// The stderr line it was named in (clipped, as logged).
    pub evidence: String,
    /// Why it must not be granted, when it must not.
    pub never: Option<String>,
}

/// Markers of a refusal in a server's error line (compared in lower case).
const REFUSED: &[&str] = &[
    "permission denied",
    "eacces",
    "operation not permitted",
    "eperm",
    "no such file or directory",
    "enoent",
    "read-only file system",
    "erofs",
];

/// Markers of a write in the same line (then read-write is suggested).
const WRITING: &[&str] = &[
    "read-only file system",
    "erofs",
    "write",
    "mkdir",
    "creat",
    "unlink",
    "rename",
    "rmdir",
    "open for writing",
];

/// Learns from one run: the refused destinations, the server's stderr lines, the grants
/// it already has and the paths no server may be granted ([`check_protected`]).
#[must_use]
pub fn learn(
    refused: &[Refused],
    stderr: &[String],
    granted: &[PathGrant],
    network: &Network,
    protected: &[PathBuf],
) -> Learned {
    let mut egress: BTreeMap<String, String> = BTreeMap::new();
    for r in refused {
        let host = if r.host.contains(':') {
            format!("[{}]", r.host)
        } else {
            r.host.clone()
        };
        egress
            .entry(format!("{host}:{}", r.port))
            .or_insert_with(|| r.reason.clone());
    }
    let mut paths: BTreeMap<PathBuf, PathDenial> = BTreeMap::new();
    for line in stderr {
        let lower = line.to_lowercase();
        if !REFUSED.iter().any(|m| lower.contains(m)) {
            continue;
        }
        let access = if WRITING.iter().any(|m| lower.contains(m)) {
            Access::ReadWrite
        } else {
            Access::ReadOnly
        };
        for path in absolute_paths(line) {
            // A file it meant to make: its folder, when that exists.
            let path = match (std::fs::symlink_metadata(&path).is_ok(), access) {
                (true, _) => path,
                (false, Access::ReadWrite) => match path.parent() {
                    Some(folder) if folder != Path::new("/") && folder.is_dir() => {
                        folder.to_path_buf()
                    }
                    _ => continue,
                },
                (false, Access::ReadOnly) => continue,
            };
            if covered(granted, &path, access) {
                continue;
            }
            let never = never(&path, access, protected);
            let entry = paths.entry(path.clone()).or_insert_with(|| PathDenial {
                path,
                access,
                evidence: line.clone(),
                never,
            });
            entry.access = entry.access.max(access);
        }
    }
    let egress: Vec<EgressDenial> = egress
        .into_iter()
        .map(|(grant, reason)| {
            let never = airlock_core::destination::Destination::parse(&grant)
                .err()
                .map(|e| format!("not a destination a grant can name: {e:#}"));
            EgressDenial {
                grant,
                reason,
                never,
            }
        })
        .collect();
    let paths: Vec<PathDenial> = paths.into_values().collect();
    let toml = toml(&network.granted, &egress, &paths);
    Learned {
        egress_observed: network.observed,
        egress,
        paths,
        toml,
    }
}

/// Why `path` must never be granted, if it must not.
fn never(path: &Path, access: Access, protected: &[PathBuf]) -> Option<String> {
    use std::os::unix::fs::FileTypeExt as _;
    if path.starts_with("/proc") {
        return Some("a /proc entry is never granted (the server has its own /proc)".into());
    }
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
        return Some(
            "a Unix socket: a grant would let the server talk to whatever listens there (a container runtime, a database); not suggested — grant it by hand only after checking what it is".into(),
        );
    }
    let grant = PathGrant {
        path: path.to_path_buf(),
        access,
    };
    check_protected(&[grant], protected)
        .err()
        .map(|e| format!("{e:#}"))
}

/// Whether a grant already allows `access` at `path`.
fn covered(granted: &[PathGrant], path: &Path, access: Access) -> bool {
    granted
        .iter()
        .any(|g| path.starts_with(&g.path) && g.access >= access)
}

/// The absolute paths a line names: each run of characters that starts with `/` after the
/// line's start or one of `` '"`:(=[``, up to whitespace, a quote or a closing bracket,
/// with trailing punctuation dropped.
fn absolute_paths(line: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let chars: Vec<(usize, char)> = line.char_indices().collect();
    for (i, &(at, c)) in chars.iter().enumerate() {
        let after_delimiter = i == 0
            || matches!(
                chars[i - 1].1,
                ' ' | '\'' | '"' | '`' | ':' | '(' | '=' | '['
            );
        if c != '/' || !after_delimiter {
            continue;
        }
        let rest = &line[at..];
        let end = rest
            .find(|c: char| c.is_whitespace() || matches!(c, '\'' | '"' | '`' | ')' | ']' | ','))
            .unwrap_or(rest.len());
        let path = rest[..end].trim_end_matches(['.', ':', ';']);
        if path.len() > 1 && !path.contains("//") {
            found.push(PathBuf::from(path));
        }
    }
    found
}

/// The grants to add, as TOML (empty when none): the connection's `tcp_connect` with the
/// new destinations added (the whole list: it replaces the configured one), then one
/// filesystem grant per path. Strings are written by the `toml` crate (escaped as TOML
/// requires).
fn toml(configured: &[String], egress: &[EgressDenial], paths: &[PathDenial]) -> String {
    let string = |s: &str| toml::Value::String(s.to_string()).to_string();
    let mut out = String::new();
    let added: Vec<&str> = egress
        .iter()
        .filter(|e| e.never.is_none() && !configured.contains(&e.grant))
        .map(|e| e.grant.as_str())
        .collect();
    if !added.is_empty() {
        let list: Vec<String> = configured
            .iter()
            .map(String::as_str)
            .chain(added)
            .map(string)
            .collect();
        out.push_str(&format!(
            "[connection.grants.network]\ntcp_connect = [{}]\n",
            list.join(", ")
        ));
    }
    for p in paths.iter().filter(|p| p.never.is_none()) {
        out.push_str(&format!(
            "[[connection.grants.filesystem]]\npath = {}\naccess = \"{}\"\n",
            string(&p.path.display().to_string()),
            p.access
        ));
    }
    out
}

impl Learned {
    /// For a person: what was refused, why not where it must not be granted, and the TOML.
    #[must_use]
    pub fn to_text(&self) -> String {
        use std::fmt::Write as _;
        let mut o = String::new();
        let safe = |s: &str| crate::cli::operate::safe(s, 400);
        let egress_note = if self.egress_observed {
            "egress is exact"
        } else {
            "egress was not observed: without namespaces there is no proxy to report it"
        };
        if self.egress.is_empty() && self.paths.is_empty() {
            let _ = writeln!(
                o,
                "learned: nothing was refused that the server reported ({egress_note}; files only as far as the server's stderr names them)"
            );
            return o;
        }
        let _ = writeln!(
            o,
            "learned: the confined server was refused ({egress_note})"
        );
        for e in &self.egress {
            let _ = writeln!(
                o,
                "  egress {}: {}{}",
                safe(&e.grant),
                safe(&e.reason),
                e.never
                    .as_ref()
                    .map(|why| format!(" — NEVER GRANTED: {}", safe(why)))
                    .unwrap_or_default()
            );
        }
        for p in &self.paths {
            let _ = writeln!(
                o,
                "  {} ({}){}\n      said: {}",
                safe(&p.path.display().to_string()),
                p.access,
                p.never
                    .as_ref()
                    .map(|why| format!(" — NEVER GRANTED: {}", safe(why)))
                    .unwrap_or_default(),
                crate::cli::operate::safe(&p.evidence, 400)
            );
        }
        if !self.toml.is_empty() {
            o.push_str(
                "grants that would allow it (add to the connection's [[connection]] block, then review):\n",
            );
            for line in self.toml.lines() {
                let _ = writeln!(o, "  {line}");
            }
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_found_after_delimiters_and_trimmed() {
        let got = absolute_paths(
            "Error: EACCES: permission denied, open '/srv/data/a.json' (from /opt/x:12) path=/var/y. REACH read:/etc/z BLOCKED",
        );
        let want: Vec<PathBuf> = ["/srv/data/a.json", "/opt/x:12", "/var/y", "/etc/z"]
            .iter()
            .map(PathBuf::from)
            .collect();
        // `/opt/x:12` keeps its colon inside: only trailing punctuation is dropped.
        assert_eq!(got, want);
        assert!(absolute_paths("a/b c https://x.example/y").is_empty());
    }

    #[test]
    fn suggestions_follow_the_words_and_never_the_state() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let (data, logs, state) = (root.join("data"), root.join("logs"), root.join("state"));
        for d in [&data, &logs, &state] {
            std::fs::create_dir(d).unwrap();
        }
        std::fs::write(state.join("airlock.db"), "").unwrap();
        let lines = vec![
            format!(
                "PermissionError: [Errno 13] Permission denied: '{}'",
                data.display()
            ),
            format!(
                "Error: EROFS: read-only file system, mkdir '{}'",
                logs.display()
            ),
            format!("open {}/airlock.db: permission denied", state.display()),
            "read /proc/1/environ: No such file or directory".to_string(),
            format!("just mentioning {} without a refusal", root.display()),
            "ENOENT: no such file or directory, open '/no/such/path'".to_string(),
            format!(
                "cannot write {}/new.txt: No such file or directory",
                logs.display()
            ),
        ];
        let refused = [
            Refused {
                host: "api.example.com".into(),
                port: 443,
                reason: "not granted".into(),
                count: 1,
            },
            Refused {
                host: "zero\u{200b}width.example".into(),
                port: 443,
                reason: "not granted".into(),
                count: 2,
            },
        ];
        let network = Network {
            granted: vec!["db.example.com:5432".into()],
            observed: true,
        };
        let learned = learn(
            &refused,
            &lines,
            &[],
            &network,
            std::slice::from_ref(&state),
        );
        let by_path: BTreeMap<&Path, &PathDenial> = learned
            .paths
            .iter()
            .map(|p| (p.path.as_path(), p))
            .collect();
        assert_eq!(by_path[data.as_path()].access, Access::ReadOnly);
        assert_eq!(by_path[logs.as_path()].access, Access::ReadWrite);
        let store = by_path[state.join("airlock.db").as_path()];
        assert!(
            store.never.as_ref().unwrap().contains("must never reach"),
            "{store:?}"
        );
        assert!(by_path[Path::new("/proc/1/environ")].never.is_some());
        assert!(
            !by_path.contains_key(root.as_path()),
            "no refusal in that line"
        );
        assert!(
            !by_path.contains_key(Path::new("/no/such/path")),
            "not on the host"
        );
        assert_eq!(learned.egress[0].grant, "api.example.com:443");
        // The configured list with the new destination; a host no grant can name is
        // reported, never suggested.
        assert!(
            learned
                .toml
                .contains("tcp_connect = [\"db.example.com:5432\", \"api.example.com:443\"]"),
            "{}",
            learned.toml
        );
        assert!(learned.egress[1].never.is_some(), "{:?}", learned.egress);
        // What it suggests parses as TOML.
        let parsed: toml::Table = toml::from_str(&learned.toml).unwrap();
        assert!(parsed.contains_key("connection"));
        assert!(
            learned
                .toml
                .contains(&format!("path = {:?}", data.display().to_string()))
        );
        assert!(!learned.toml.contains("/proc"), "{}", learned.toml);
        assert!(!learned.toml.contains("airlock.db"), "{}", learned.toml);
        // Already granted: nothing to learn about it.
        let granted = [PathGrant {
            path: data.clone(),
            access: Access::ReadWrite,
        }];
        let again = learn(&[], &lines, &granted, &Network::default(), &[]);
        assert!(again.paths.iter().all(|p| p.path != data));
    }
}
