//! The host key that MACs the trace, and the checkpoints that anchor its head.
//!
//! Rule: every trace event written by this build carries an HMAC-SHA256, under the host
//! key, of **the exact bytes stored** for it — never of a re-parse — chained through the
//! previous event's MAC; and the head (sequence number + head MAC) is anchored outside the
//! database by checkpoints MACed with the same key. Whoever can write the database but does
//! not hold the key can then neither edit, insert, reorder nor recompute an event without
//! `airlock trace verify` noticing, and cannot shorten or delete the trace without
//! `trace verify --checkpoint FILE` noticing.
//!
//! Accepted key sources, first match wins:
//! 1. a named secret: `trace_key = "NAME"` in the serve configuration, naming a
//!    `[secrets]` entry (at least 32 bytes, e.g. `openssl rand -hex 32`);
//! 2. the environment variable [`KEY_ENV`] (the same form), for commands run without
//!    `--config`;
//! 3. the key file [`KEY_FILE`] in the state folder, created at first start (mode 0600,
//!    32 bytes from the OS random source) and refused unless it is a regular file owned by
//!    this user that no one else can read or write ([`airlock_core::private_fs`]).
//!
//! Key file format: one line, `airlock-trace-key v1 hmac-sha256 <64 lowercase hex>\n`;
//! anything else is refused.
//!
//! What the MAC covers, in this order (integers big-endian; each text as a u64 big-endian
//! byte length then its bytes, so no two events encode alike): the domain
//! `airlock-trace-event-v1\0`, `seq` (i64), `at_ms` (i64), `kind`, `subject`, `payload` (the
//! stored text, byte for byte), `prev_hash` (the stored text). A checkpoint's MAC covers
//! `airlock-trace-checkpoint-v1\0`, `seq`, `at_ms`, `head`, `key_id`. A record of the
//! trace journal ([`super::journal`]) is MACed over `airlock-trace-journal-v1\0`, the
//! journal's file name (as text), the record's byte offset in that file (u64) and its body
//! (as text, byte for byte).
//!
//! The key id (16 hex) is the first 8 bytes of HMAC(key, `airlock-trace-key-id-v1`): it
//! tells which key wrote an event or a checkpoint and reveals nothing about the key.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use hmac::{KeyInit as _, Mac as _};

/// File name of the key file inside the state folder.
pub const KEY_FILE: &str = "trace.key";

/// Environment variable holding the key for commands run without a configuration.
pub const KEY_ENV: &str = "AIRLOCK_TRACE_KEY";

/// Shortest accepted key, in bytes.
pub const MIN_KEY_BYTES: usize = 32;

const FILE_HEADER: &str = "airlock-trace-key v1 hmac-sha256 ";

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// Where a [`TraceKey`] came from.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case", tag = "kind", content = "name")]
pub enum KeySource {
    /// The key file at this path.
    File(PathBuf),
    /// The named `[secrets]` entry.
    Secret(String),
    /// The environment variable [`KEY_ENV`].
    Environment,
}

impl std::fmt::Display for KeySource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::File(path) => write!(f, "key file {}", path.display()),
            Self::Secret(name) => write!(f, "secret `{name}`"),
            Self::Environment => write!(f, "environment variable {KEY_ENV}"),
        }
    }
}

/// The host key, held in memory with its HMAC state precomputed (one HMAC per event costs
/// two SHA-256 compressions beyond the message's own). `Debug` shows only the id and source.
#[derive(Clone)]
pub struct TraceKey {
    mac: HmacSha256,
    id: String,
    source: KeySource,
}

impl std::fmt::Debug for TraceKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceKey")
            .field("id", &self.id)
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

impl TraceKey {
    /// A key from raw bytes (at least [`MIN_KEY_BYTES`]).
    ///
    /// # Errors
    /// The key is shorter than [`MIN_KEY_BYTES`].
    pub fn from_bytes(bytes: &[u8], source: KeySource) -> anyhow::Result<Self> {
        if bytes.len() < MIN_KEY_BYTES {
            bail!(
                "the trace key from {source} is {} bytes; it needs at least {MIN_KEY_BYTES} \
                 (e.g. `openssl rand -hex 32`)",
                bytes.len()
            );
        }
        let mac = HmacSha256::new_from_slice(bytes).expect("HMAC takes keys of any length");
        let mut id_mac = mac.clone();
        id_mac.update(b"airlock-trace-key-id-v1");
        let id = hex::encode(&id_mac.finalize().into_bytes()[..8]);
        Ok(Self { mac, id, source })
    }

    /// The key named by a `[secrets]` entry.
    ///
    /// # Errors
    /// The secret is too short.
    pub fn from_secret(name: &str, value: &str) -> anyhow::Result<Self> {
        Self::from_bytes(value.as_bytes(), KeySource::Secret(name.to_owned()))
    }

    /// The key in [`KEY_ENV`], when it is set.
    ///
    /// # Errors
    /// It is set but not UTF-8, or too short.
    pub fn from_env() -> anyhow::Result<Option<Self>> {
        match std::env::var(KEY_ENV) {
            Ok(value) => Self::from_bytes(value.as_bytes(), KeySource::Environment).map(Some),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => {
                bail!("{KEY_ENV} is set but is not UTF-8")
            }
        }
    }

    /// Reads the key file in `state_dir` when it exists (`Ok(None)` when it does not),
    /// after checking it is private.
    ///
    /// # Errors
    /// The file is a link, not a regular file, not this user's, readable or writable by
    /// anyone else, or not in the key file format.
    pub fn read_file(state_dir: &Path) -> anyhow::Result<Option<Self>> {
        let path = state_dir.join(KEY_FILE);
        if !airlock_core::private_fs::check_private_file(
            &path,
            "trace key file",
            "or set the key with trace_key / AIRLOCK_TRACE_KEY",
            airlock_core::private_fs::Access::Secret,
        )? {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading the trace key file {}", path.display()))?;
        let bytes = text
            .strip_prefix(FILE_HEADER)
            .and_then(|rest| rest.strip_suffix('\n'))
            .filter(|hex| {
                hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
            })
            .and_then(|hex| hex::decode(hex).ok())
            .with_context(|| {
                format!(
                    "the trace key file {} is not in the key file format (one line: \
                     `{FILE_HEADER}<64 lowercase hex>`); restore it from a copy — a new key \
                     would not verify the events already written",
                    path.display()
                )
            })?;
        Self::from_bytes(&bytes, KeySource::File(path)).map(Some)
    }

    /// Creates a new key file in `state_dir` (mode 0600, 32 random bytes) and returns its
    /// key. Fails if anything is already at the path.
    ///
    /// # Errors
    /// The OS random source or the file system fails.
    pub fn create_file(state_dir: &Path) -> anyhow::Result<Self> {
        use std::io::Write as _;
        let path = state_dir.join(KEY_FILE);
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes)
            .map_err(|e| anyhow::anyhow!("reading the OS random source: {e}"))?;
        let mut file = airlock_core::private_fs::create_new_private(&path)
            .with_context(|| format!("creating the trace key file {}", path.display()))?;
        file.write_all(format!("{FILE_HEADER}{}\n", hex::encode(bytes)).as_bytes())
            .and_then(|()| file.sync_all())
            .with_context(|| format!("writing the trace key file {}", path.display()))?;
        Self::from_bytes(&bytes, KeySource::File(path))
    }

    /// The key id: 16 lowercase hex, the same for the same key.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Where the key came from.
    pub fn source(&self) -> &KeySource {
        &self.source
    }

    /// HMAC of `parts` under this key for purpose `label`, each part length-prefixed: a
    /// value every host holding the key derives alike and no one without it can predict
    /// (e.g. the session id of an HTTP principal on a shared store).
    pub fn derive(&self, label: &str, parts: &[&str]) -> [u8; 32] {
        let mut m = self.mac.clone();
        m.update(b"airlock-derive-v1\0");
        for text in std::iter::once(label).chain(parts.iter().copied()) {
            m.update(&(text.len() as u64).to_be_bytes());
            m.update(text.as_bytes());
        }
        m.finalize().into_bytes().into()
    }

    /// Hex HMAC of one event's stored fields (see the module doc for the encoding).
    pub(crate) fn event_mac(
        &self,
        seq: i64,
        at_ms: i64,
        kind: &str,
        subject: &str,
        payload: &str,
        prev_hash: &str,
    ) -> String {
        hex::encode(
            self.event_state(seq, at_ms, kind, subject, payload, prev_hash)
                .finalize()
                .into_bytes(),
        )
    }

    /// Whether `mac_hex` is the HMAC of the event's stored fields (constant time).
    #[allow(clippy::too_many_arguments)] // reason: one stored column each
    pub(crate) fn verify_event(
        &self,
        seq: i64,
        at_ms: i64,
        kind: &str,
        subject: &str,
        payload: &str,
        prev_hash: &str,
        mac_hex: &str,
    ) -> bool {
        let Ok(mac) = hex::decode(mac_hex) else {
            return false;
        };
        self.event_state(seq, at_ms, kind, subject, payload, prev_hash)
            .verify_slice(&mac)
            .is_ok()
    }

    fn event_state(
        &self,
        seq: i64,
        at_ms: i64,
        kind: &str,
        subject: &str,
        payload: &str,
        prev_hash: &str,
    ) -> HmacSha256 {
        let mut m = self.mac.clone();
        m.update(b"airlock-trace-event-v1\0");
        m.update(&seq.to_be_bytes());
        m.update(&at_ms.to_be_bytes());
        for text in [kind, subject, payload, prev_hash] {
            m.update(&(text.len() as u64).to_be_bytes());
            m.update(text.as_bytes());
        }
        m
    }

    /// The HMAC of one trace-journal record: the journal's file name, the record's byte
    /// offset in it, and its body (see the module doc for the encoding).
    pub(crate) fn journal_mac(&self, journal: &str, offset: u64, body: &[u8]) -> [u8; 32] {
        self.journal_state(journal, offset, body)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Whether `mac` is the HMAC of a trace-journal record (constant time).
    pub(crate) fn verify_journal(
        &self,
        journal: &str,
        offset: u64,
        body: &[u8],
        mac: &[u8],
    ) -> bool {
        self.journal_state(journal, offset, body)
            .verify_slice(mac)
            .is_ok()
    }

    fn journal_state(&self, journal: &str, offset: u64, body: &[u8]) -> HmacSha256 {
        let mut m = self.mac.clone();
        m.update(b"airlock-trace-journal-v1\0");
        m.update(&(journal.len() as u64).to_be_bytes());
        m.update(journal.as_bytes());
        m.update(&offset.to_be_bytes());
        m.update(&(body.len() as u64).to_be_bytes());
        m.update(body);
        m
    }

    fn checkpoint_state(&self, seq: i64, at_ms: u64, head: &str, key_id: &str) -> HmacSha256 {
        let mut m = self.mac.clone();
        m.update(b"airlock-trace-checkpoint-v1\0");
        m.update(&seq.to_be_bytes());
        m.update(&at_ms.to_be_bytes());
        for text in [head, key_id] {
            m.update(&(text.len() as u64).to_be_bytes());
            m.update(text.as_bytes());
        }
        m
    }

    /// A checkpoint of the head `(seq, head)` at `at_ms`, MACed with this key.
    pub fn checkpoint(&self, seq: i64, head: &str, at_ms: u64) -> Checkpoint {
        let mac = hex::encode(
            self.checkpoint_state(seq, at_ms, head, &self.id)
                .finalize()
                .into_bytes(),
        );
        Checkpoint {
            format: CHECKPOINT_FORMAT.to_owned(),
            seq,
            head: head.to_owned(),
            key_id: self.id.clone(),
            at_ms,
            mac,
        }
    }

    /// Whether `checkpoint` was MACed with this key (and is in the format this build
    /// writes).
    pub fn verifies(&self, checkpoint: &Checkpoint) -> bool {
        let Ok(mac) = hex::decode(&checkpoint.mac) else {
            return false;
        };
        checkpoint.format == CHECKPOINT_FORMAT
            && checkpoint.key_id == self.id
            && self
                .checkpoint_state(
                    checkpoint.seq,
                    checkpoint.at_ms,
                    &checkpoint.head,
                    &checkpoint.key_id,
                )
                .verify_slice(&mac)
                .is_ok()
    }
}

/// The `format` of a checkpoint this build writes.
pub const CHECKPOINT_FORMAT: &str = "airlock-trace-checkpoint-v1";

/// File name of the default checkpoint file inside the state folder.
pub const CHECKPOINT_FILE: &str = "trace-checkpoints.jsonl";

/// A signed statement of the trace head: "at `at_ms`, the trace ended at event `seq`, whose
/// MAC was `head`". One JSON object per line in a checkpoint file:
/// `{"format":"airlock-trace-checkpoint-v1","seq":N,"head":"<64 hex>","key_id":"<16 hex>","at_ms":T,"mac":"<64 hex>"}`.
/// An empty trace is `seq` 0 with a head of 64 zeros.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Checkpoint {
    /// Always [`CHECKPOINT_FORMAT`].
    pub format: String,
    /// Sequence number of the head event (0: the trace was empty).
    pub seq: i64,
    /// The head event's MAC (hex), or 64 zeros for an empty trace.
    pub head: String,
    /// Id of the key that MACed it.
    pub key_id: String,
    /// When it was taken, unix ms.
    pub at_ms: u64,
    /// HMAC-SHA256 (hex) of the fields above with the host key.
    pub mac: String,
}

impl Checkpoint {
    /// The checkpoint as one JSON line (with its newline).
    pub fn to_line(&self) -> String {
        serde_json::to_string(self).expect("a checkpoint serializes") + "\n"
    }

    /// Reads every checkpoint in `text` (JSON lines; blank lines skipped).
    ///
    /// # Errors
    /// A line is not a checkpoint; the error names the line number.
    pub fn parse_lines(text: &str) -> anyhow::Result<Vec<(usize, Checkpoint)>> {
        let mut out = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let checkpoint: Checkpoint = serde_json::from_str(line).with_context(|| {
                format!(
                    "line {} is not a trace checkpoint (one JSON object per line, as \
                     `airlock trace checkpoint` prints)",
                    i + 1
                )
            })?;
            out.push((i + 1, checkpoint));
        }
        Ok(out)
    }
}

/// Appends `checkpoint` to the file at `path` (created mode 0600; the file and, when it is
/// created, its folder must pass [`airlock_core::private_fs`]'s rules), then syncs it.
///
/// # Errors
/// The file or its folder is not private, or writing fails.
pub fn append_checkpoint(path: &Path, checkpoint: &Checkpoint) -> anyhow::Result<()> {
    use std::io::Write as _;
    let elsewhere = "or set checkpoint_file to a private place";
    if let Some(folder) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        airlock_core::private_fs::ensure_private_dir(folder, "checkpoint folder", elsewhere)?;
    }
    airlock_core::private_fs::check_private_file(
        path,
        "trace checkpoint file",
        elsewhere,
        airlock_core::private_fs::Access::NotWritableByOthers,
    )?;
    let mut file = airlock_core::private_fs::open_append_private(path)
        .with_context(|| format!("opening the trace checkpoint file {}", path.display()))?;
    file.write_all(checkpoint.to_line().as_bytes())
        .and_then(|()| file.sync_data())
        .with_context(|| format!("appending to the trace checkpoint file {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> TraceKey {
        TraceKey::from_bytes(&[7u8; 32], KeySource::Environment).unwrap()
    }

    #[test]
    fn a_short_key_is_refused() {
        let err = TraceKey::from_secret("trace", "short").unwrap_err();
        assert!(err.to_string().contains("at least 32"), "{err}");
    }

    #[test]
    fn the_event_mac_covers_every_field_and_their_boundaries() {
        let k = key();
        let base = k.event_mac(1, 2, "kind", "subject", "{\"a\":1}", "00");
        assert!(k.verify_event(1, 2, "kind", "subject", "{\"a\":1}", "00", &base));
        let variants = [
            k.event_mac(2, 2, "kind", "subject", "{\"a\":1}", "00"),
            k.event_mac(1, 3, "kind", "subject", "{\"a\":1}", "00"),
            k.event_mac(1, 2, "kin", "dsubject", "{\"a\":1}", "00"),
            k.event_mac(1, 2, "kind", "subject", "{\"a\":1,\"a\":1}", "00"),
            k.event_mac(1, 2, "kind", "subject", "{\"a\":1}", "01"),
        ];
        for v in variants {
            assert_ne!(v, base);
        }
        let other = TraceKey::from_bytes(&[8u8; 32], KeySource::Environment).unwrap();
        assert!(!other.verify_event(1, 2, "kind", "subject", "{\"a\":1}", "00", &base));
        assert_ne!(other.id(), k.id());
    }

    #[test]
    fn the_journal_mac_covers_name_offset_and_body() {
        let k = key();
        let mac = k.journal_mac("j1.log", 40, b"{\"at\":1}");
        assert!(k.verify_journal("j1.log", 40, b"{\"at\":1}", &mac));
        assert!(!k.verify_journal("j2.log", 40, b"{\"at\":1}", &mac));
        assert!(!k.verify_journal("j1.log", 0, b"{\"at\":1}", &mac));
        assert!(!k.verify_journal("j1.log", 40, b"{\"at\":2}", &mac));
        assert!(!k.verify_journal("j1.log", 40, b"{\"at\":1}", &mac[..31]));
        // The boundary between name and offset is length-prefixed.
        assert_ne!(
            k.journal_mac("j1.lo", 40, b"g"),
            k.journal_mac("j1.log", 40, b"")
        );
        let other = TraceKey::from_bytes(&[8u8; 32], KeySource::Environment).unwrap();
        assert!(!other.verify_journal("j1.log", 40, b"{\"at\":1}", &mac));
    }

    #[test]
    fn a_checkpoint_round_trips_and_an_edit_fails() {
        let k = key();
        let c = k.checkpoint(12, &"ab".repeat(32), 1_700_000_000_000);
        let parsed = Checkpoint::parse_lines(&c.to_line()).unwrap();
        assert_eq!(parsed, vec![(1, c.clone())]);
        assert!(k.verifies(&c));
        let edited = Checkpoint {
            seq: 11,
            ..c.clone()
        };
        assert!(!k.verifies(&edited));
        let other = TraceKey::from_bytes(&[8u8; 32], KeySource::Environment).unwrap();
        assert!(!other.verifies(&c));
    }

    #[test]
    fn the_key_file_is_created_private_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        assert!(TraceKey::read_file(dir.path()).unwrap().is_none());
        let created = TraceKey::create_file(dir.path()).unwrap();
        let read = TraceKey::read_file(dir.path()).unwrap().unwrap();
        assert_eq!(created.id(), read.id());
        use std::os::unix::fs::MetadataExt as _;
        let meta = std::fs::metadata(dir.path().join(KEY_FILE)).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        // An edited file is refused, never replaced.
        std::fs::write(dir.path().join(KEY_FILE), "not a key\n").unwrap();
        let err = TraceKey::read_file(dir.path()).unwrap_err();
        assert!(err.to_string().contains("key file format"), "{err}");
        assert!(TraceKey::create_file(dir.path()).is_err());
    }
}
