//! Shared test kit: real `airlock serve` processes, real fixture servers, real components.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use rmcp::ServiceExt as _;
use rmcp::model::{CallToolRequestParams, CallToolResult, JsonObject};
use rmcp::service::{RoleClient, RunningService, ServiceError};
use rmcp::transport::TokioChildProcess;
use serde_json::Value;

/// The airlock binary under test.
pub fn airlock_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_airlock"))
}

/// The compiled-component cache shared by every `airlock serve` the tests start, so each
/// component compiles once per build rather than once per process.
pub fn test_cache_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("compiled-cache")
}

/// The folder of adapters this build compiled and pinned.
pub fn bundle() -> PathBuf {
    PathBuf::from(airlock::ADAPTER_BUNDLE)
}

/// The workspace root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// `fixtures/npm/node_modules`, which `npm ci --prefix fixtures/npm` installs.
pub fn node_modules() -> PathBuf {
    let dir = workspace().join("fixtures/npm/node_modules");
    assert!(
        dir.join("@modelcontextprotocol/server-filesystem").is_dir()
            && dir.join("@modelcontextprotocol/inspector-cli").is_dir(),
        "the published MCP peers are not installed: run `npm ci --prefix fixtures/npm` (README's test command does)"
    );
    dir
}

/// A temporary deployment: mappings copied out of the bundle (optionally edited), a
/// serve configuration, and the notes server's call log.
pub struct Deployment {
    pub dir: tempfile::TempDir,
    mappings: Vec<PathBuf>,
    connections: String,
}

impl Deployment {
    /// A deployment with the notes fixture server as connection `notes`, logging every
    /// request it receives to `calls.jsonl`.
    pub fn with_notes() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("calls.jsonl");
        std::fs::write(&log, "").unwrap();
        let connections = format!(
            "[[connection]]\nname = \"notes\"\ncommand = \"@airlock\"\nargs = [\"fixture\", \"notes-server\", \"--call-log\", {:?}]\n",
            log.display().to_string()
        );
        Self {
            dir,
            mappings: vec![],
            connections,
        }
    }

    /// Adds a raw connection block.
    pub fn connection(mut self, toml: &str) -> Self {
        self.connections.push_str(toml);
        self
    }

    /// Copies bundled mapping `name` into the deployment, passing its manifest text
    /// through `edit`; returns the folder it was copied to.
    pub fn mapping_edited(mut self, name: &str, edit: impl FnOnce(String) -> String) -> Self {
        let from = bundle().join(name);
        let to = self.dir.path().join("mappings").join(name);
        std::fs::create_dir_all(&to).unwrap();
        for entry in std::fs::read_dir(&from).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
        let manifest = to.join("mapping.toml");
        let text = std::fs::read_to_string(&manifest).unwrap();
        std::fs::write(&manifest, edit(text)).unwrap();
        self.mappings.push(manifest);
        self
    }

    /// Copies bundled mapping `name` unchanged.
    pub fn mapping(self, name: &str) -> Self {
        self.mapping_edited(name, |t| t)
    }

    /// The folder a mapping was copied to.
    pub fn mapping_dir(&self, name: &str) -> PathBuf {
        self.dir.path().join("mappings").join(name)
    }

    /// Writes the serve configuration and returns its path.
    pub fn write_config(&self) -> PathBuf {
        let mut text = self.connections.clone();
        for m in &self.mappings {
            text.push_str(&format!(
                "[[mapping]]\nmanifest = {:?}\n",
                m.display().to_string()
            ));
        }
        let path = self.dir.path().join("airlock.toml");
        std::fs::write(&path, text).unwrap();
        path
    }

    /// Every request the notes server received, as parsed JSON lines.
    pub fn upstream_calls(&self) -> Vec<Value> {
        std::fs::read_to_string(self.dir.path().join("calls.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// Names of the tools the notes server was asked to call.
    pub fn upstream_tool_calls(&self) -> Vec<String> {
        self.upstream_calls()
            .iter()
            .filter(|c| c["method"] == "tools/call")
            .map(|c| c["tool"].as_str().unwrap_or_default().to_string())
            .collect()
    }

    /// Starts `airlock serve` on this deployment and connects an rmcp client to it.
    pub async fn serve(&self) -> RunningService<RoleClient, ()> {
        let config = self.write_config();
        let mut cmd = tokio::process::Command::new(airlock_bin());
        cmd.arg("serve").arg("--config").arg(&config);
        cmd.env("AIRLOCK_LOG", "airlock=info");
        cmd.env("AIRLOCK_CACHE_DIR", test_cache_dir());
        let transport = TokioChildProcess::new(cmd).expect("spawn airlock serve");
        ().serve(transport)
            .await
            .expect("MCP initialize with airlock serve")
    }

    /// Runs `airlock serve` expecting it to fail at startup; returns (exit success, stderr).
    pub fn serve_expecting_failure(&self) -> (bool, String) {
        let config = self.write_config();
        let out = std::process::Command::new(airlock_bin())
            .env("AIRLOCK_CACHE_DIR", test_cache_dir())
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

/// Calls `name` with JSON object `args`.
pub async fn call(
    client: &RunningService<RoleClient, ()>,
    name: &str,
    args: Value,
) -> Result<CallToolResult, ServiceError> {
    let mut params = CallToolRequestParams::new(name.to_string());
    params.arguments = Some(match args {
        Value::Object(o) => o,
        _ => JsonObject::new(),
    });
    client.peer().call_tool(params).await
}

/// The text content of a result, joined.
pub fn text_of(result: &CallToolResult) -> String {
    result
        .content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The JSON-RPC error code of a failed call, if it was an MCP error.
pub fn error_code(err: &ServiceError) -> Option<i32> {
    match err {
        ServiceError::McpError(e) => Some(e.code.0),
        _ => None,
    }
}

/// References (`ref_...`) in a search result's structured content, in order.
pub fn references(result: &CallToolResult) -> Vec<String> {
    result.structured_content.as_ref().unwrap()["result"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["reference"].as_str().unwrap().to_string())
        .collect()
}
