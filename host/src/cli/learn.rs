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

/// What a learning run found.
#[derive(Debug, Default, Serialize)]
pub struct Learned {
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
        .map(|(grant, reason)| EgressDenial { grant, reason })
        .collect();
    let paths: Vec<PathDenial> = paths.into_values().collect();
    let toml = toml(&egress, &paths);
    Learned {
        egress,
        paths,
        toml,
    }
}

/// Why `path` must never be granted, if it must not.
fn never(path: &Path, access: Access, protected: &[PathBuf]) -> Option<String> {
    if path.starts_with("/proc") {
        return Some("a /proc entry is never granted (the server has its own /proc)".into());
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

/// The grants to add, as TOML (empty when none).
fn toml(egress: &[EgressDenial], paths: &[PathDenial]) -> String {
    let mut out = String::new();
    if !egress.is_empty() {
        let list: Vec<String> = egress.iter().map(|e| format!("{:?}", e.grant)).collect();
        out.push_str(&format!(
            "[connection.grants.network]\ntcp_connect = [{}]\n",
            list.join(", ")
        ));
    }
    for p in paths.iter().filter(|p| p.never.is_none()) {
        out.push_str(&format!(
            "[[connection.grants.filesystem]]\npath = {:?}\naccess = \"{}\"\n",
            p.path.display().to_string(),
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
        if self.egress.is_empty() && self.paths.is_empty() {
            o.push_str(
                "learned: nothing was refused that the server reported (egress is exact; files only as far as the server's stderr names them)\n",
            );
            return o;
        }
        o.push_str("learned: the confined server was refused\n");
        for e in &self.egress {
            let _ = writeln!(o, "  egress {}: {}", e.grant, e.reason);
        }
        for p in &self.paths {
            let _ = writeln!(
                o,
                "  {} ({}){}\n      said: {}",
                p.path.display(),
                p.access,
                p.never
                    .as_ref()
                    .map(|why| format!(" — NEVER GRANTED: {why}"))
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
        let refused = [Refused {
            host: "api.example.com".into(),
            port: 443,
            reason: "not granted".into(),
        }];
        let learned = learn(&refused, &lines, &[], std::slice::from_ref(&state));
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
        assert!(
            learned
                .toml
                .contains("tcp_connect = [\"api.example.com:443\"]")
        );
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
        let again = learn(&[], &lines, &granted, &[]);
        assert!(again.paths.iter().all(|p| p.path != data));
    }
}
