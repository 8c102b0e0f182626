//! Recorded fixtures: what `airlock serve --record DIR` writes and `airlock test` replays
//! (DESIGN.md §7, "Replay").
//!
//! Rules:
//! - One fixture file per adapter call: the contract-level call (function, its input as
//!   the adapter received it, its result or failure) and every upstream exchange the
//!   adapter made during it (method, params, the answer as the server sent it), bound to
//!   the mapping (name, revision, manifest sha256), the connection (name, local id) and
//!   the snapshot digest current when the call ran. Files are pretty-printed JSON named
//!   `NNNN-FUNCTION.json` (`NNNN` counts up from the highest number already in the
//!   folder), written whole (temporary file, then renamed) with mode 0600.
//! - **Redacted before anything is written**: every occurrence, in any string, of a value
//!   the serve configuration holds as a secret — each `[secrets]` value (so bearer tokens
//!   sent through `headers`), each header value, the query of an HTTP connection's URL
//!   and each of its values (transport errors name the URL), each `env` value of a stdio
//!   connection — becomes [`REDACTED`]; so does the whole value of every object member
//!   whose name is in the `--redact FIELD` list (compared case-insensitively). Values
//!   shorter than [`MIN_SECRET_CHARS`] characters are not searched for (they would mangle
//!   every fixture and are no secret); a test proves a real one is gone. Replay applies the same
//!   field redaction to a live request before it looks for its fixture.
//! - Reading fixtures is a boundary: at most [`MAX_FIXTURE_FILES`] files of at most
//!   [`MAX_FIXTURE_BYTES`] bytes each; JSON that does not parse or does not have the
//!   fixture shape (unknown fields included) is refused naming the file and what is wrong.
//! - The fixture digest ([`fixtures_digest`]) is what a passing `airlock test` records:
//!   sha256 over every fixture file of the folder, in byte order of file name.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Context as _, Result, bail};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::Digest as _;

/// The marker a redacted value is replaced by.
pub const REDACTED: &str = "[redacted]";
/// The fixture format this host writes and reads (`"airlock_fixture"`).
pub const FIXTURE_FORMAT: u32 = 1;
/// Largest fixture file read (bytes).
pub const MAX_FIXTURE_BYTES: u64 = 16 << 20;
/// Most fixture files read from one folder.
pub const MAX_FIXTURE_FILES: usize = 10_000;
/// Shortest secret value searched for in recorded text (characters).
pub const MIN_SECRET_CHARS: usize = 4;

/// One recorded adapter call (one fixture file).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fixture {
    /// Always [`FIXTURE_FORMAT`].
    pub airlock_fixture: u32,
    /// The mapping revision the call ran under.
    pub mapping: FixtureMapping,
    /// The mapping's connection.
    pub connection: FixtureConnection,
    /// The digest of the connection's snapshot current when the call ran.
    pub snapshot_digest: String,
    /// When the call was recorded (RFC 3339, UTC).
    pub recorded_at: String,
    /// Object member names whose values were redacted (the `--redact` list, lowercase).
    #[serde(default)]
    pub redacted_fields: Vec<String>,
    /// The contract-level call.
    pub call: ContractCall,
    /// The upstream exchanges the adapter made during the call, in order.
    pub exchanges: Vec<Exchange>,
}

/// Which mapping revision a fixture was recorded under.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FixtureMapping {
    /// The mapping's name.
    pub name: String,
    /// Its revision in the recording host's store (1-based).
    pub revision: i64,
    /// sha256 (hex) of the manifest text of that revision.
    pub manifest_sha256: String,
}

/// Which connection a fixture was recorded on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FixtureConnection {
    /// The configured name.
    pub name: String,
    /// The store's local id (`conn-…`).
    pub id: String,
}

/// The contract function called, with what it was given and what it returned.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContractCall {
    /// The contract function's WIT name (e.g. `search`).
    pub function: String,
    /// Its parameter as JSON, as the adapter received it (handles as the adapter's own
    /// locators; host-supplied fields left out).
    pub input: Value,
    /// The idempotency key the host gave the call (effect calls only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// What the function returned.
    pub outcome: CallRecord,
}

/// What a contract function returned.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub enum CallRecord {
    /// Its return value as JSON (`{"ok": …}` or `{"err": …}` for a WIT `result`).
    Result(Value),
    /// The call failed in the host (deadline, trap, memory…): the failure's kind.
    Failure(String),
}

/// One upstream request and its answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Exchange {
    /// `tools/call` or `resources/read`.
    pub method: String,
    /// The request's params: `{"name", "arguments"}` or `{"uri"}`.
    pub params: Value,
    /// What came back.
    pub answer: Answer,
}

/// An upstream answer as recorded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub enum Answer {
    /// The JSON-RPC `result` member, as the server sent it.
    Result(Value),
    /// A JSON-RPC error (its message: the server's untrusted words).
    Error {
        /// The error's message.
        message: String,
    },
    /// The answer was over the connection's output budget and discarded while read.
    OutputTooLarge,
    /// No answer: the connection closed, timed out or was cancelled.
    Unavailable {
        /// Why, in the host's words.
        message: String,
    },
}

impl Answer {
    /// `result`, `error`, `output-too-large` or `unavailable`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Result(_) => "result",
            Self::Error { .. } => "error",
            Self::OutputTooLarge => "output-too-large",
            Self::Unavailable { .. } => "unavailable",
        }
    }
}

/// The params of an upstream request, as fixtures record and match them.
pub fn request_params(method: &str, target: &str, arguments: Option<&Value>) -> Value {
    match method {
        "tools/call" => serde_json::json!({
            "name": target,
            "arguments": arguments.cloned().unwrap_or_else(|| Value::Object(Default::default())),
        }),
        _ => serde_json::json!({ "uri": target }),
    }
}

/// What to redact: secret values (searched for in every string) and member names.
#[derive(Debug, Clone, Default)]
pub struct Redaction {
    secrets: Vec<String>,
    fields: BTreeSet<String>,
}

impl Redaction {
    /// Redacts `secrets` (values shorter than [`MIN_SECRET_CHARS`] are dropped) and the
    /// values of members named in `fields` (case-insensitive).
    pub fn new(secrets: impl IntoIterator<Item = String>, fields: &[String]) -> Self {
        let mut secrets: Vec<String> = secrets
            .into_iter()
            .filter(|s| s.chars().count() >= MIN_SECRET_CHARS)
            .collect();
        // Longest first: a secret that contains another is replaced whole.
        secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
        secrets.dedup();
        Self {
            secrets,
            fields: fields.iter().map(|f| f.to_ascii_lowercase()).collect(),
        }
    }

    /// The member names redacted, lowercase, sorted.
    pub fn fields(&self) -> Vec<String> {
        self.fields.iter().cloned().collect()
    }

    /// Redacts `value` in place.
    pub fn apply(&self, value: &mut Value) {
        match value {
            Value::String(s) => {
                for secret in &self.secrets {
                    if s.contains(secret.as_str()) {
                        *s = s.replace(secret.as_str(), REDACTED);
                    }
                }
            }
            Value::Array(items) => items.iter_mut().for_each(|v| self.apply(v)),
            Value::Object(map) => {
                let keys: Vec<String> = map.keys().cloned().collect();
                for key in keys {
                    let mut v = map.remove(&key).unwrap_or(Value::Null);
                    if self.fields.contains(&key.to_ascii_lowercase()) {
                        v = Value::String(REDACTED.into());
                    } else {
                        self.apply(&mut v);
                    }
                    let mut k = Value::String(key);
                    self.apply(&mut k);
                    if let Value::String(k) = k {
                        map.insert(k, v);
                    }
                }
            }
            _ => {}
        }
    }

    /// Redacts the whole fixture: call input and outcome, every exchange's params and
    /// answer (messages included).
    pub fn apply_fixture(&self, fixture: &mut Fixture) {
        self.apply(&mut fixture.call.input);
        if let CallRecord::Result(v) = &mut fixture.call.outcome {
            self.apply(v);
        }
        for x in &mut fixture.exchanges {
            self.apply(&mut x.params);
            match &mut x.answer {
                Answer::Result(v) => self.apply(v),
                Answer::Error { message } | Answer::Unavailable { message } => {
                    let mut v = Value::String(std::mem::take(message));
                    self.apply(&mut v);
                    *message = v.as_str().unwrap_or_default().to_string();
                }
                Answer::OutputTooLarge => {}
            }
        }
        fixture.redacted_fields = self.fields();
    }
}

/// Writes fixture files into one folder (`airlock serve --record DIR`).
pub struct Recorder {
    dir: PathBuf,
    redaction: Redaction,
    next: Mutex<u64>,
}

impl Recorder {
    /// Opens (creating it, mode 0700, when missing) the folder `dir`; numbering continues
    /// after the highest `NNNN-` prefix already there.
    ///
    /// # Errors
    /// The folder cannot be created or read, or is not a folder.
    pub fn open(dir: &Path, redaction: Redaction) -> Result<Self> {
        if !dir.exists() {
            use std::os::unix::fs::DirBuilderExt as _;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .with_context(|| format!("creating the fixture folder {}", dir.display()))?;
        }
        if !dir.is_dir() {
            bail!("--record {}: not a folder", dir.display());
        }
        let mut highest = 0;
        for entry in std::fs::read_dir(dir)
            .with_context(|| format!("reading the fixture folder {}", dir.display()))?
        {
            let name = entry?.file_name();
            let name = name.to_string_lossy();
            if let Some(n) = name.split('-').next().and_then(|n| n.parse::<u64>().ok()) {
                highest = highest.max(n);
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            redaction,
            next: Mutex::new(highest + 1),
        })
    }

    /// The folder written to.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// What it redacts.
    pub fn redaction(&self) -> &Redaction {
        &self.redaction
    }

    /// Redacts `fixture` and writes it as the next file; returns its path.
    ///
    /// # Errors
    /// The file cannot be written.
    pub fn write(&self, mut fixture: Fixture) -> Result<PathBuf> {
        self.redaction.apply_fixture(&mut fixture);
        let text = serde_json::to_string_pretty(&fixture)? + "\n";
        let function: String = fixture
            .call
            .function
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
            .take(64)
            .collect();
        let n = {
            let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
            let n = *next;
            *next += 1;
            n
        };
        let path = self.dir.join(format!("{n:04}-{function}.json"));
        let mut tmp = tempfile::NamedTempFile::new_in(&self.dir)?;
        std::io::Write::write_all(&mut tmp, text.as_bytes())?;
        tmp.persist(&path)
            .with_context(|| format!("writing fixture {}", path.display()))?;
        Ok(path)
    }
}

/// One fixture file read from a folder.
#[derive(Debug, Clone)]
pub struct FixtureFile {
    /// The file's name (no folder).
    pub name: String,
    /// The file's bytes.
    pub bytes: Vec<u8>,
    /// What it says.
    pub fixture: Fixture,
}

/// Reads every `*.json` file of `dir` as a fixture, in byte order of file name.
///
/// # Errors
/// The folder cannot be read, holds no fixture or more than [`MAX_FIXTURE_FILES`], or a
/// file is over [`MAX_FIXTURE_BYTES`], not JSON, not of the fixture shape, or of another
/// format version; each error names the file and what is wrong.
pub fn load_dir(dir: &Path) -> Result<Vec<FixtureFile>> {
    let entries = std::fs::read_dir(dir)
        .with_context(|| format!("reading the fixture folder {}", dir.display()))?;
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".json") && entry.file_type()?.is_file() {
            names.push(name);
            if names.len() > MAX_FIXTURE_FILES {
                bail!(
                    "{} holds more than {MAX_FIXTURE_FILES} fixture files",
                    dir.display()
                );
            }
        }
    }
    names.sort();
    if names.is_empty() {
        bail!(
            "{} holds no fixture (*.json); record some with `airlock serve --config FILE --record {}`",
            dir.display(),
            dir.display()
        );
    }
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        let path = dir.join(&name);
        let size = std::fs::metadata(&path)?.len();
        if size > MAX_FIXTURE_BYTES {
            bail!(
                "fixture {name} is {size} bytes, over the {MAX_FIXTURE_BYTES} bytes a fixture may be"
            );
        }
        let bytes =
            std::fs::read(&path).with_context(|| format!("reading fixture {}", path.display()))?;
        let fixture = parse(&bytes).with_context(|| format!("fixture {name}"))?;
        out.push(FixtureFile {
            name,
            bytes,
            fixture,
        });
    }
    Ok(out)
}

/// Parses one fixture file.
///
/// # Errors
/// Not JSON (with line and column), not of the fixture shape (naming the field), or
/// another format version.
pub fn parse(bytes: &[u8]) -> Result<Fixture> {
    let value: Value = serde_json::from_slice(bytes).context("is not JSON")?;
    let version = value.get("airlock_fixture").and_then(Value::as_u64);
    if version != Some(u64::from(FIXTURE_FORMAT)) {
        bail!(
            "is not an Airlock fixture of format {FIXTURE_FORMAT} (\"airlock_fixture\": {})",
            value
                .get("airlock_fixture")
                .map_or("missing".to_string(), |v| airlock_core::text::safe_lines(
                    &v.to_string().chars().take(40).collect::<String>()
                ))
        );
    }
    Fixture::deserialize(value).map_err(|e| anyhow::anyhow!("does not have the fixture shape: {e}"))
}

/// The digest of a fixture folder: lowercase hex sha256 over, for each file in byte order
/// of its name, the line `NAME SHA256\n` (`SHA256`: lowercase hex sha256 of the file's
/// bytes). Renaming, editing, adding or removing a file changes it.
pub fn fixtures_digest(files: &[FixtureFile]) -> String {
    let mut sorted: Vec<&FixtureFile> = files.iter().collect();
    sorted.sort_by(|a, b| a.name.as_bytes().cmp(b.name.as_bytes()));
    let mut h = sha2::Sha256::new();
    for f in sorted {
        h.update(f.name.as_bytes());
        h.update(b" ");
        h.update(hex::encode(sha2::Sha256::digest(&f.bytes)).as_bytes());
        h.update(b"\n");
    }
    hex::encode(h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn secrets_and_named_fields_are_redacted_everywhere() {
        let r = Redaction::new(
            ["s3cr3t-token".to_string(), "ab".to_string()],
            &["Password".to_string()],
        );
        let mut v = json!({
            "q": "Bearer s3cr3t-token here",
            "nested": [{"password": 42, "x": "ab"}],
            "s3cr3t-token": 1,
        });
        r.apply(&mut v);
        assert_eq!(
            v,
            json!({
                "q": "Bearer [redacted] here",
                "nested": [{"password": "[redacted]", "x": "ab"}],
                "[redacted]": 1,
            })
        );
    }

    #[test]
    fn hostile_fixture_text_is_refused_with_what_is_wrong() {
        for (bytes, needle) in [
            (&b"{not json"[..], "is not JSON"),
            (b"[]", "is not an Airlock fixture"),
            (b"{\"airlock_fixture\": 7}", "format 1"),
            (
                b"{\"airlock_fixture\": 1, \"mapping\": 3}",
                "does not have the fixture shape",
            ),
        ] {
            let err = format!("{:#}", parse(bytes).unwrap_err());
            assert!(err.contains(needle), "{err}");
        }
    }

    #[test]
    fn the_digest_covers_names_and_bytes() {
        let f = |name: &str, bytes: &[u8]| FixtureFile {
            name: name.into(),
            bytes: bytes.to_vec(),
            fixture: parse(&serde_json::to_vec(&sample()).unwrap()).unwrap(),
        };
        let a = fixtures_digest(&[f("0001-a.json", b"x"), f("0002-b.json", b"y")]);
        assert_eq!(
            a,
            fixtures_digest(&[f("0002-b.json", b"y"), f("0001-a.json", b"x")])
        );
        assert_ne!(
            a,
            fixtures_digest(&[f("0001-a.json", b"x"), f("0002-b.json", b"z")])
        );
        assert_ne!(a, fixtures_digest(&[f("0001-a.json", b"x")]));
    }

    fn sample() -> Fixture {
        Fixture {
            airlock_fixture: FIXTURE_FORMAT,
            mapping: FixtureMapping {
                name: "m".into(),
                revision: 1,
                manifest_sha256: "00".into(),
            },
            connection: FixtureConnection {
                name: "c".into(),
                id: "conn-000000000000".into(),
            },
            snapshot_digest: "11".into(),
            recorded_at: "2026-12-02T00:00:00Z".into(),
            redacted_fields: vec![],
            call: ContractCall {
                function: "search".into(),
                input: json!({"query": "x"}),
                idempotency_key: None,
                outcome: CallRecord::Result(json!({"ok": []})),
            },
            exchanges: vec![Exchange {
                method: "tools/call".into(),
                params: json!({"name": "t", "arguments": {}}),
                answer: Answer::OutputTooLarge,
            }],
        }
    }

    #[test]
    fn a_fixture_round_trips() {
        let text = serde_json::to_vec_pretty(&sample()).unwrap();
        assert_eq!(parse(&text).unwrap(), sample());
    }
}
