//! The live registry's unit tests' kit: real parts, no mocks. The notes fixture server
//! runs in this process over Streamable HTTP on `127.0.0.1:0`; the store is SQLite in a
//! temporary folder; mappings are the adapters this build compiled and pinned
//! ([`crate::runtime::ADAPTER_BUNDLE`]), their manifests optionally edited.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use airlock_fixture_notes::ServeOptions;

use super::live::{Live, MappingSource};
use crate::config::ServeConfig;
use crate::registry::MappingIdentity;

/// The notes fixture server, served by this process until dropped.
pub struct Notes {
    /// Its MCP endpoint.
    pub url: String,
    task: tokio::task::JoinHandle<()>,
}

impl Notes {
    /// Serves the notes fixture with `options` on a free loopback port.
    pub async fn serve(options: ServeOptions) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/mcp", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            airlock_fixture_notes::serve_http_on(options, listener)
                .await
                .expect("the notes fixture serves");
        });
        Self { url, task }
    }
}

impl Drop for Notes {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A serve configuration whose connection `notes` is the HTTP endpoint `url`, with its
/// store in `state`, no mapping of its own, its compiled components cached where every
/// test of this crate finds them, and `more` (TOML, top level) added.
pub fn config(url: &str, state: &Path, more: &str) -> ServeConfig {
    let text = format!(
        "state_dir = {state:?}\nmappings_dir = {state:?}\n{more}\n[[connection]]\nname = \"notes\"\nurl = {url:?}\n"
    );
    let mut config = ServeConfig::parse(&text, state).expect("the test configuration parses");
    // The mappings are handed to `Live::start_with`, not read from a folder; the parser
    // wants one of the two.
    config.mappings_dir = None;
    config.cache_dir = Some(cache_dir());
    config
}

/// Where this crate's tests cache compiled components (one compile per build).
fn cache_dir() -> PathBuf {
    std::env::temp_dir().join(format!("airlock-gateway-tests-{}", users_uid()))
}

fn users_uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

/// The pinned manifest of bundled adapter `name` (e.g. `source-library`).
pub fn bundled_manifest(name: &str) -> PathBuf {
    Path::new(crate::runtime::ADAPTER_BUNDLE)
        .join(name)
        .join("mapping.toml")
}

/// The bundled `source-library` mapping with its manifest text passed through `edit`.
pub fn source_library(edit: impl FnOnce(String) -> String) -> MappingSource {
    let path = bundled_manifest("source-library");
    let original = MappingSource::from_file(&path).unwrap();
    let text = edit(original.text);
    MappingSource::from_memory(&text, "<test source-library>", original.component).unwrap()
}

/// Writes the bundled `source-library` mapping, its manifest passed through `edit`, into
/// `dir/<folder>/` (manifest and component) and returns the manifest's path.
pub fn write_source_library(
    dir: &Path,
    folder: &str,
    edit: impl FnOnce(String) -> String,
) -> PathBuf {
    let bundled = bundled_manifest("source-library");
    let target = dir.join(folder);
    std::fs::create_dir_all(&target).unwrap();
    let text = edit(std::fs::read_to_string(&bundled).unwrap());
    let manifest = MappingSource::from_memory(&text, "<test>", vec![]).unwrap();
    let file = manifest.manifest.component.file.clone();
    std::fs::copy(bundled.parent().unwrap().join(&file), target.join(&file)).unwrap();
    let path = target.join("mapping.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// A running host over the notes fixture with `sources` loaded, its store in a fresh
/// temporary folder (returned: the store lives as long as it).
pub async fn start(
    notes: &Notes,
    more: &str,
    sources: Vec<MappingSource>,
) -> (Arc<Live>, tempfile::TempDir) {
    let state = tempfile::tempdir().unwrap();
    let config = config(&notes.url, state.path(), more);
    let live = Live::start_with(&config, sources).await.unwrap();
    (live, state)
}

/// Waits until `ready` holds, failing with `what` after a minute (a deadline a loaded
/// machine does not miss; the event itself is what the test waits on).
pub async fn until(what: &str, ready: impl FnMut() -> bool) {
    until_within(what, std::time::Duration::from_secs(60), ready).await;
}

/// Like [`until`], failing after `limit`.
pub async fn until_within(what: &str, limit: std::time::Duration, mut ready: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + limit;
    while !ready() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "waited {limit:?} for: {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// Approves mapping `name` as loaded in `live` against its connection's current
/// snapshot (what `airlock review approve` records), without telling `live`.
pub fn approve(live: &Live, name: &str) {
    let catalog = live.catalog();
    let mapping = &catalog.mappings[name];
    approve_manifest(live, mapping, &mapping.record().manifest_digest, None);
}

/// Approves, for the mapping loaded as `mapping`, the manifest of digest
/// `manifest_digest` (with `manifest_text` when known) against its connection's current
/// snapshot.
pub fn approve_manifest(
    live: &Live,
    mapping: &super::live::ActiveMapping,
    manifest_digest: &str,
    manifest_text: Option<&str>,
) {
    let state = &mapping.connection;
    let snapshot = live
        .registry()
        .store()
        .snapshot(&state.snapshot_digest())
        .unwrap()
        .expect("the connection's snapshot is stored");
    live.registry()
        .approve_tools(
            &MappingIdentity {
                name: &mapping.name,
                tools: &mapping.tools,
                manifest_digest,
                manifest_text,
                component_sha256: mapping.adapter.component_sha256(),
            },
            &state.revision,
            &snapshot,
            "tests",
        )
        .unwrap();
}

/// The kinds of every trace event recorded so far, in order, with their subjects.
pub fn trace_kinds(live: &Live) -> Vec<(String, String)> {
    live.registry()
        .store()
        .trace(0, 100_000)
        .unwrap()
        .into_iter()
        .map(|e| (e.kind, e.subject))
        .collect()
}
