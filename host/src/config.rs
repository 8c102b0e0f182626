//! The serve configuration: which upstream connections exist and which reviewed mappings
//! to load.
//!
//! Rule: read strictly (unknown keys fail), resolve every relative path against the
//! configuration file's folder, and resolve each connection's command to one executable
//! path at load time. Connections get no environment but what `env` lists.
//!
//! Accepted form:
//!
//! ```toml
//! [[connection]]
//! name = "notes"                 # [a-z0-9-_], unique
//! command = "@airlock"           # a path, a name looked up on the host's PATH, or
//!                                # "@airlock" = this airlock binary (for its fixtures)
//! args = ["fixture", "notes-server"]
//! cwd = "."                      # default: the configuration file's folder
//! env = { LANG = "C.UTF-8" }     # the complete environment; default: empty
//! owner = "platform-team"        # optional; part of the connection's configuration digest
//! credential_scope = "notes-ro"  # optional reference (never a secret); part of the digest
//! identity_files = ["lib/server-helpers.js"]  # optional: more files whose contents are
//!                                # part of the connection's identity (see registry)
//!
//! [[mapping]]
//! manifest = "adapters/source-library/mapping.toml"
//!
//! mappings_dir = "mappings"      # optional: a watched folder of mappings, one sub-folder
//!                                # each holding mapping.toml + its component; hot-reloaded
//! state_dir = "state"            # optional: the store's folder (default: see default_state_dir)
//! snapshot_interval = "10m"      # re-discover every connection this often (default 10m;
//!                                # "off" = only on start and list_changed)
//!
//! [secrets]                      # named secrets that mappings' env grants may use
//! notes-token = { env = "NOTES_TOKEN" }   # read from airlock's own environment at start
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, bail};
use serde::Deserialize;

use crate::upstream::StdioServer;

/// How often a serving host re-discovers each connection when the configuration does not
/// say (`snapshot_interval`): servers that change without announcing `list_changed` are
/// caught within this time.
pub const DEFAULT_SNAPSHOT_INTERVAL: std::time::Duration = std::time::Duration::from_secs(600);

/// The command value that means "this airlock executable".
pub const SELF_COMMAND: &str = "@airlock";

/// A loaded serve configuration with every path resolved.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Connections by name.
    pub connections: BTreeMap<String, StdioServer>,
    /// Mapping manifest paths, in file order.
    pub mappings: Vec<PathBuf>,
    /// A watched folder of mappings (`<dir>/<mapping>/mapping.toml`), hot-reloaded.
    pub mappings_dir: Option<PathBuf>,
    /// The store's folder, from the file (`state_dir`); the command line may override it.
    pub state_dir: Option<PathBuf>,
    /// Re-discover every connection this often (besides start and `list_changed`);
    /// default [`DEFAULT_SNAPSHOT_INTERVAL`], `None` = off.
    pub snapshot_interval: Option<std::time::Duration>,
    /// Where compiled components are cached; `None` compiles on every start. Set by the
    /// command line (`--cache-dir`), not by the file.
    pub cache_dir: Option<PathBuf>,
    /// Named secrets, already read.
    pub secrets: BTreeMap<String, Secret>,
}

/// A secret value. Its `Debug` output is redacted.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    connection: Vec<RawConnection>,
    #[serde(default)]
    mapping: Vec<RawMapping>,
    #[serde(default)]
    secrets: BTreeMap<String, RawSecret>,
    mappings_dir: Option<PathBuf>,
    state_dir: Option<PathBuf>,
    snapshot_interval: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSecret {
    env: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConnection {
    name: String,
    command: String,
    #[serde(default)]
    args: Vec<String>,
    cwd: Option<PathBuf>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    owner: Option<String>,
    credential_scope: Option<String>,
    #[serde(default)]
    identity_files: Vec<PathBuf>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMapping {
    manifest: PathBuf,
}

impl ServeConfig {
    /// Reads the configuration at `path`.
    ///
    /// # Errors
    /// Unreadable file, TOML errors, unknown keys, duplicate connection names, a command
    /// that cannot be found, a working directory that does not exist.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading serve configuration {}", path.display()))?;
        let path = &std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
        let base = path
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        let base = if base.as_os_str().is_empty() {
            PathBuf::from(".")
        } else {
            base
        };
        Self::parse(&text, &base).with_context(|| format!("serve configuration {}", path.display()))
    }

    /// Parses configuration `text`, resolving relative paths against `base`.
    ///
    /// # Errors
    /// As [`ServeConfig::load`].
    pub fn parse(text: &str, base: &Path) -> Result<Self> {
        let raw: RawConfig = toml::from_str(text)?;
        let mut connections = BTreeMap::new();
        for c in raw.connection {
            if c.name.is_empty()
                || !c
                    .name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
            {
                bail!("connection name `{}` must be a-z, 0-9, `-`, `_`", c.name);
            }
            let cwd = base.join(c.cwd.unwrap_or_else(|| PathBuf::from(".")));
            let cwd = cwd.canonicalize().with_context(|| {
                format!(
                    "connection `{}`: working directory {} does not exist",
                    c.name,
                    cwd.display()
                )
            })?;
            let command = resolve_command(&c.command, base)
                .with_context(|| format!("connection `{}`", c.name))?;
            for key in c.env.keys() {
                if key.is_empty() || key.contains('=') || key.contains('\0') {
                    bail!(
                        "connection `{}`: invalid environment variable name `{key}`",
                        c.name
                    );
                }
            }
            let server = StdioServer {
                command,
                args: c.args,
                cwd,
                env: c.env,
                owner: c.owner,
                credential_scope: c.credential_scope,
                identity_files: c.identity_files.iter().map(|f| base.join(f)).collect(),
            };
            if connections.insert(c.name.clone(), server).is_some() {
                bail!("connection `{}` is defined twice", c.name);
            }
        }
        let mut secrets = BTreeMap::new();
        for (name, source) in raw.secrets {
            let value = std::env::var(&source.env).with_context(|| {
                format!(
                    "secret `{name}`: environment variable {} is not set (or not UTF-8)",
                    source.env
                )
            })?;
            secrets.insert(name, Secret(value));
        }
        let mappings_dir = raw.mappings_dir.map(|d| base.join(d));
        if raw.mapping.is_empty() && mappings_dir.is_none() {
            bail!(
                "the configuration defines no [[mapping]] and no mappings_dir: there would be nothing to serve"
            );
        }
        let snapshot_interval = match raw.snapshot_interval {
            None => Some(DEFAULT_SNAPSHOT_INTERVAL),
            Some(text) if text == "off" => None,
            Some(text) => {
                let d = humantime::parse_duration(&text).with_context(|| {
                    format!(
                        "snapshot_interval `{text}`: expected a duration such as \"10m\", or \"off\""
                    )
                })?;
                if d < std::time::Duration::from_secs(1) {
                    bail!("snapshot_interval `{text}` is shorter than the minimum of 1s");
                }
                Some(d)
            }
        };
        let mut seen = BTreeSet::new();
        let mut mappings = Vec::new();
        for m in raw.mapping {
            let path = base.join(&m.manifest);
            if !seen.insert(path.clone()) {
                bail!("mapping manifest {} is listed twice", path.display());
            }
            mappings.push(path);
        }
        Ok(Self {
            connections,
            mappings,
            mappings_dir,
            state_dir: raw.state_dir.map(|d| base.join(d)),
            snapshot_interval,
            cache_dir: None,
            secrets,
        })
    }
}

/// The default compiled-component cache: `$XDG_CACHE_HOME/airlock/compiled`, else
/// `$HOME/.cache/airlock/compiled`, else none.
pub fn default_cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|h| PathBuf::from(h).join(".cache"))
        })?;
    Some(base.join("airlock").join("compiled"))
}

/// The default state folder: `$XDG_STATE_HOME/airlock`, else `$HOME/.local/state/airlock`,
/// else none.
pub fn default_state_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_STATE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|h| PathBuf::from(h).join(".local").join("state"))
        })?;
    Some(base.join("airlock"))
}

/// Resolves a configured command to an executable path.
fn resolve_command(command: &str, base: &Path) -> Result<PathBuf> {
    if command == SELF_COMMAND {
        return std::env::current_exe().context("locating the airlock executable");
    }
    if command.is_empty() {
        bail!("command is empty");
    }
    let candidate = Path::new(command);
    if candidate.components().count() > 1 || candidate.is_absolute() {
        let path = base.join(candidate);
        if !path.is_file() {
            bail!("command {} does not exist", path.display());
        }
        return Ok(path.canonicalize()?);
    }
    let search = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&search)
        .map(|dir| dir.join(command))
        .find(|p| p.is_file())
        .with_context(|| format!("command `{command}` was not found on PATH"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_resolve_against_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = ServeConfig::parse(
            "[[connection]]\nname = \"notes\"\ncommand = \"@airlock\"\nargs = [\"fixture\"]\n[[mapping]]\nmanifest = \"m/mapping.toml\"\n",
            dir.path(),
        )
        .unwrap();
        assert_eq!(cfg.mappings, vec![dir.path().join("m/mapping.toml")]);
        let notes = &cfg.connections["notes"];
        assert!(notes.env.is_empty(), "no environment unless declared");
        assert_eq!(notes.cwd, dir.path().canonicalize().unwrap());
    }

    #[test]
    fn hostile_configs_fail_clearly() {
        let dir = tempfile::tempdir().unwrap();
        let cases = [
            (
                "[[connection]]\nname = \"a\"\ncommand = \"@airlock\"\n[[connection]]\nname = \"a\"\ncommand = \"@airlock\"\n",
                "twice",
            ),
            (
                "[[connection]]\nname = \"a\"\ncommand = \"no-such-binary-xyz\"\n",
                "not found on PATH",
            ),
            (
                "[[connection]]\nname = \"a\"\ncommand = \"./missing\"\n",
                "does not exist",
            ),
            (
                "[[connection]]\nname = \"a\"\ncommand = \"@airlock\"\ncwd = \"nowhere\"\n",
                "working directory",
            ),
            (
                "[[connection]]\nname = \"A B\"\ncommand = \"@airlock\"\n",
                "must be",
            ),
            (
                "[[connection]]\nname = \"a\"\ncommand = \"@airlock\"\nenv = { \"X=Y\" = \"1\" }\n",
                "environment variable",
            ),
            (
                "[[connection]]\nname = \"a\"\ncommand = \"@airlock\"\ninherit_env = true\n",
                "unknown field",
            ),
            (
                "[[mapping]]\nmanifest = \"m.toml\"\n[[mapping]]\nmanifest = \"m.toml\"\n",
                "twice",
            ),
            ("", "no [[mapping]]"),
            (
                "mappings_dir = \"m\"\nsnapshot_interval = \"soon\"\n",
                "snapshot_interval",
            ),
            (
                "mappings_dir = \"m\"\nsnapshot_interval = \"10ms\"\n",
                "minimum",
            ),
            (
                "[[connection]]\nname = \"a\"\ncommand = \"@airlock\"\n",
                "no [[mapping]]",
            ),
        ];
        for (text, needle) in cases {
            let err = format!("{:#}", ServeConfig::parse(text, dir.path()).unwrap_err());
            assert!(err.contains(needle), "expected `{needle}` in: {err}");
        }
    }
}
