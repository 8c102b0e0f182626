//! Shared test kit: real `airlock serve` processes, real fixture servers, real components.
#![allow(dead_code)]

pub mod operator;
pub mod otlp;
pub mod pg;

pub use operator::*;

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

/// Runs `cmd` to its end like `Command::output`, but kills it and fails the test when it
/// has not exited within `limit`: a command that should refuse to start (and would serve
/// forever if a guard broke) then fails its test instead of hanging the suite. Its stdin
/// is null; stdout and stderr are captured.
pub fn output_within(
    cmd: &mut std::process::Command,
    limit: std::time::Duration,
) -> std::process::Output {
    use std::io::Read;
    let mut child = cmd
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the command");
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut bytes);
            }
            bytes
        })
    };
    let stdout = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let stderr = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let deadline = std::time::Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the command") {
            break status;
        }
        if std::time::Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            let err = stderr.join().unwrap_or_default();
            panic!(
                "{cmd:?} still ran after {limit:?} (killed); its stderr:\n{}",
                String::from_utf8_lossy(&err)
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    std::process::Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    }
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

/// `fixtures/python/site`, where README's test command installs the Python MCP SDK (the
/// real client the Python tests drive).
pub fn python_site() -> PathBuf {
    let site = workspace().join("fixtures/python/site");
    assert!(
        site.join("mcp").is_dir(),
        "the Python MCP SDK is not installed: run README's test command (it installs fixtures/python/requirements.txt into fixtures/python/site)"
    );
    site
}

/// The keys that confine a connection's server (crate docs: airlock::upstream::confine)
/// with `grants` (path, access) beyond the defaults: appended to a `[[connection]]` block
/// (its sub-tables must come last).
pub fn confined(grants: &[(&Path, &str)]) -> String {
    let mut toml = "confine = true\n".to_string();
    for (path, access) in grants {
        toml.push_str(&format!(
            "[[connection.grants.filesystem]]\npath = {:?}\naccess = {access:?}\n",
            path.display().to_string()
        ));
    }
    toml
}

/// A temporary deployment: mappings copied out of the bundle (optionally edited), a
/// serve configuration, and the notes server's call log.
pub struct Deployment {
    pub dir: tempfile::TempDir,
    mappings: Vec<PathBuf>,
    connections: String,
    top: String,
    tables: String,
    watched: bool,
}

impl Deployment {
    /// A deployment with the notes fixture server as connection `notes`, logging every
    /// request it receives to `calls.jsonl`.
    pub fn with_notes() -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("calls.jsonl"), "").unwrap();
        Self {
            dir,
            mappings: vec![],
            connections: String::new(),
            top: String::new(),
            tables: String::new(),
            watched: false,
        }
        .notes_args(&[])
    }

    /// Adds the delivery fixture server as connection `outbox` (delivering into
    /// `outbox/`, logging every request to `outbox-calls.jsonl`, with `extra` server
    /// arguments) and the `outbox-delivery` mapping.
    pub fn with_outbox(self, extra: &[&str]) -> Self {
        self.with_outbox_edited(extra, |t| t)
    }

    /// Like [`Deployment::with_outbox`], passing the mapping's manifest through `edit`.
    pub fn with_outbox_edited(self, extra: &[&str], edit: impl FnOnce(String) -> String) -> Self {
        self.with_outbox_granted(extra, &[], edit)
    }

    /// Like [`Deployment::with_outbox_edited`], the server granted `grants` (path,
    /// access) besides its outbox and call log: a confined server sees nothing else.
    pub fn with_outbox_granted(
        self,
        extra: &[&str],
        grants: &[(&Path, &str)],
        edit: impl FnOnce(String) -> String,
    ) -> Self {
        let outbox = self.dir.path().join("outbox");
        let log = self.dir.path().join("outbox-calls.jsonl");
        std::fs::write(&log, "").unwrap();
        let mut args = vec![
            "fixture".to_string(),
            "delivery-server".to_string(),
            "--outbox".to_string(),
            outbox.display().to_string(),
            "--call-log".to_string(),
            log.display().to_string(),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        std::fs::create_dir_all(&outbox).unwrap();
        self.connection(&format!(
            "[[connection]]\nname = \"outbox\"\ncommand = \"@airlock\"\nargs = {args:?}\n{}",
            confined(
                &[
                    (outbox.as_path(), "read-write"),
                    (log.as_path(), "read-write")
                ]
                .into_iter()
                .chain(grants.iter().copied())
                .collect::<Vec<_>>()
            )
        ))
        .mapping_edited("outbox-delivery", edit)
    }

    /// Writes `policy` as `airlock.cedar` and lists it in the configuration.
    pub fn policy(self, policy: &str) -> Self {
        std::fs::write(self.dir.path().join("airlock.cedar"), policy).unwrap();
        self.top("policy = [\"airlock.cedar\"]\n")
    }

    /// Replaces the policy file's text (a running host reloads it).
    pub fn rewrite_policy(&self, policy: &str) {
        let path = self.dir.path().join("airlock.cedar");
        let tmp = self.dir.path().join("airlock.cedar.new");
        std::fs::write(&tmp, policy).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
    }

    /// Adds tables written after everything else (`[[profile]]`, `[requester]`...).
    pub fn tables(mut self, toml: &str) -> Self {
        self.tables.push_str(toml);
        self
    }

    /// Every request the delivery server received, as parsed JSON lines.
    pub fn outbox_calls(&self) -> Vec<Value> {
        std::fs::read_to_string(self.dir.path().join("outbox-calls.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// Names of the tools the delivery server was asked to call.
    pub fn outbox_tool_calls(&self) -> Vec<String> {
        self.outbox_calls()
            .iter()
            .filter(|c| c["method"] == "tools/call")
            .map(|c| c["tool"].as_str().unwrap_or_default().to_string())
            .collect()
    }

    /// How many `send_file` requests reached the delivery server.
    pub fn sends(&self) -> usize {
        self.outbox_tool_calls()
            .iter()
            .filter(|t| *t == "send_file")
            .count()
    }

    /// Files delivered into destination `dest` of the outbox.
    pub fn delivered(&self, dest: &str) -> Vec<PathBuf> {
        let dir = self.dir.path().join("outbox").join(dest);
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default();
        files.sort();
        files
    }

    /// Starts `airlock serve --profile PROFILE` with client handler `handler`.
    pub async fn serve_profile<H: rmcp::ClientHandler>(
        &self,
        profile: &str,
        handler: H,
    ) -> RunningService<RoleClient, H> {
        let mut cmd = self.serve_command();
        cmd.arg("--profile").arg(profile);
        handler
            .serve(TokioChildProcess::new(cmd).expect("spawn airlock serve"))
            .await
            .expect("MCP initialize with airlock serve")
    }

    /// `airlock serve --config ...` for this deployment, not yet started.
    pub fn serve_command(&self) -> tokio::process::Command {
        let config = self.write_config();
        let mut cmd = tokio::process::Command::new(airlock_bin());
        cmd.arg("serve").arg("--config").arg(&config);
        cmd.env("AIRLOCK_LOG", "airlock=info");
        cmd.env("AIRLOCK_CACHE_DIR", test_cache_dir());
        cmd.env("AIRLOCK_STATE_DIR", self.state_dir());
        cmd
    }

    /// Replaces every connection with the notes fixture server as `notes`, logging to
    /// `calls.jsonl`, with `extra` server arguments (e.g. `["--drift-on-call", "schema"]`).
    pub fn notes_args(self, extra: &[&str]) -> Self {
        let log = self.dir.path().join("calls.jsonl");
        let mut args = vec![
            "fixture".to_string(),
            "notes-server".to_string(),
            "--call-log".to_string(),
            log.display().to_string(),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        let connection = format!(
            "[[connection]]\nname = \"notes\"\ncommand = \"@airlock\"\nargs = {args:?}\n{}",
            confined(&[(&log, "read-write")])
        );
        self.replace_connections(&connection)
    }

    /// Serves the mappings from the watched folder `mappings/` (hot reload) instead of
    /// listing them as `[[mapping]]` entries.
    pub fn watched(mut self) -> Self {
        self.watched = true;
        self
    }

    /// Adds top-level configuration keys (written before any table).
    pub fn top(mut self, toml: &str) -> Self {
        self.top.push_str(toml);
        self
    }

    /// The deployment's state folder (the store).
    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// Runs the airlock binary with this deployment's state folder and compiled cache.
    pub fn airlock(&self, args: &[&str]) -> std::process::Output {
        std::process::Command::new(airlock_bin())
            .env("AIRLOCK_CACHE_DIR", test_cache_dir())
            .env("AIRLOCK_STATE_DIR", self.state_dir())
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap()
    }

    /// Like [`Deployment::airlock`], asserting success; returns stdout.
    pub fn airlock_ok(&self, args: &[&str]) -> String {
        let out = self.airlock(args);
        assert!(
            out.status.success(),
            "airlock {args:?} failed: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Like [`Deployment::airlock_ok`] with `--json`, parsed.
    pub fn airlock_json(&self, args: &[&str]) -> Value {
        let mut args = args.to_vec();
        args.push("--json");
        serde_json::from_str(&self.airlock_ok(&args)).unwrap()
    }

    /// The mapping manifests of this deployment.
    pub fn manifests(&self) -> &[PathBuf] {
        &self.mappings
    }

    /// Discovers every connection the mappings use and approves every mapping, as a
    /// reviewer would (`airlock discover`, `airlock review approve`).
    pub fn approve_all(&self) {
        let config = self.write_config();
        let config = config.to_str().unwrap();
        let mut connections = std::collections::BTreeSet::new();
        let mut names = Vec::new();
        for m in &self.mappings {
            let text = std::fs::read_to_string(m).unwrap();
            let v: toml::Value = toml::from_str(&text).unwrap();
            connections.insert(v["mapping"]["connection"].as_str().unwrap().to_string());
            names.push(v["mapping"]["name"].as_str().unwrap().to_string());
        }
        for c in &connections {
            self.airlock_ok(&["discover", c, "--config", config]);
        }
        for n in &names {
            self.airlock_ok(&[
                "review",
                "approve",
                n,
                "--config",
                config,
                "--reviewer",
                "tests",
            ]);
        }
    }

    /// `airlock review approve MAPPING --reviewer REVIEWER` on this deployment's
    /// configuration, with `extra` arguments; asserts success.
    pub fn approve(&self, mapping: &str, reviewer: &str, extra: &[&str]) -> String {
        let config = self.write_config();
        let mut args = vec![
            "review",
            "approve",
            mapping,
            "--config",
            config.to_str().unwrap(),
            "--reviewer",
            reviewer,
        ];
        args.extend_from_slice(extra);
        self.airlock_ok(&args)
    }

    /// The trace events (all of them), parsed.
    pub fn trace(&self) -> Vec<Value> {
        self.airlock_ok(&["trace", "list", "--limit", "100000", "--json"])
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// Replaces every connection block with `toml`.
    pub fn replace_connections(mut self, toml: &str) -> Self {
        self.connections = toml.to_string();
        self
    }

    /// Copies bundled mapping `name` into the deployment under folder `as_name`, passing
    /// its manifest text through `edit`.
    pub fn mapping_edited_as(
        mut self,
        name: &str,
        as_name: &str,
        edit: impl FnOnce(String) -> String,
    ) -> Self {
        let from = bundle().join(name);
        let to = self.dir.path().join("mappings").join(as_name);
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

    /// Adds a raw connection block.
    pub fn connection(mut self, toml: &str) -> Self {
        self.connections.push_str(toml);
        self
    }

    /// Copies bundled mapping `name` into the deployment, passing its manifest text
    /// through `edit`; returns the folder it was copied to.
    pub fn mapping_edited(self, name: &str, edit: impl FnOnce(String) -> String) -> Self {
        self.mapping_edited_as(name, name, edit)
    }

    /// Serves the manifest at `path` as it is (e.g. an adapter built outside the bundle).
    pub fn manifest(mut self, path: PathBuf) -> Self {
        self.mappings.push(path);
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
        let mut text = format!(
            "state_dir = {:?}\n{}",
            self.state_dir().display().to_string(),
            self.top
        );
        if self.watched {
            std::fs::create_dir_all(self.dir.path().join("mappings")).unwrap();
            text.insert_str(
                0,
                &format!(
                    "mappings_dir = {:?}\n",
                    self.dir.path().join("mappings").display().to_string()
                ),
            );
        }
        text.push_str(&self.connections);
        for m in self.mappings.iter().filter(|_| !self.watched) {
            text.push_str(&format!(
                "[[mapping]]\nmanifest = {:?}\n",
                m.display().to_string()
            ));
        }
        text.push_str(&self.tables);
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

    /// Approves every mapping (see [`Deployment::approve_all`]), then starts `airlock
    /// serve` on this deployment and connects an rmcp client to it.
    pub async fn serve(&self) -> RunningService<RoleClient, ()> {
        self.approve_all();
        self.serve_unreviewed().await
    }

    /// A `[[connection]]` named `name` running the hostile fixture server (`airlock
    /// fixture hostile-server`) with `extra` arguments, logging every request to `log`
    /// (a file name in the deployment's folder).
    pub fn hostile_connection(&self, name: &str, log: &str, extra: &[&str]) -> String {
        let log = self.dir.path().join(log);
        std::fs::write(&log, "").unwrap();
        let mut args = vec![
            "fixture".to_string(),
            "hostile-server".to_string(),
            "--call-log".to_string(),
            log.display().to_string(),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        format!(
            "[[connection]]\nname = \"{name}\"\ncommand = \"@airlock\"\nargs = {args:?}\n{}",
            confined(&[(&log, "read-write")])
        )
    }

    /// Every request logged to `log` (a file name in the deployment's folder).
    pub fn logged_calls(&self, log: &str) -> Vec<Value> {
        std::fs::read_to_string(self.dir.path().join(log))
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// Approves every mapping, starts `airlock serve`, and returns the client with the
    /// process id of `airlock serve`.
    pub async fn serve_with_pid(&self) -> (RunningService<RoleClient, ()>, u32) {
        self.serve_with_pid_env(&[]).await
    }

    /// [`Deployment::serve_with_pid`] with `env` set for `airlock serve`.
    pub async fn serve_with_pid_env(
        &self,
        env: &[(&str, &str)],
    ) -> (RunningService<RoleClient, ()>, u32) {
        self.approve_all();
        let mut command = self.serve_command();
        command.envs(env.iter().copied());
        let transport = TokioChildProcess::new(command).expect("spawn airlock serve");
        let pid = transport.id().expect("airlock serve has a pid");
        let client = ().serve(transport).await.expect("MCP initialize with airlock serve");
        (client, pid)
    }

    /// The deployment's store, opened directly (as an attacker with the file, or a test).
    pub fn database(&self) -> rusqlite::Connection {
        rusqlite::Connection::open(self.state_dir().join("airlock.db")).unwrap()
    }

    /// Starts `airlock serve` without approving anything first.
    pub async fn serve_unreviewed(&self) -> RunningService<RoleClient, ()> {
        self.serve_with(()).await
    }

    /// Starts `airlock serve` with client handler `handler` (e.g. a [`Notices`] counter).
    pub async fn serve_with<H: rmcp::ClientHandler>(
        &self,
        handler: H,
    ) -> RunningService<RoleClient, H> {
        // The variable overrides the configuration's state_dir: never inherit the caller's.
        let transport = TokioChildProcess::new(self.serve_command()).expect("spawn airlock serve");
        handler
            .serve(transport)
            .await
            .expect("MCP initialize with airlock serve")
    }

    /// Runs `airlock serve` expecting it to fail at startup; returns (exit success, stderr).
    pub fn serve_expecting_failure(&self) -> (bool, String) {
        let config = self.write_config();
        let out = std::process::Command::new(airlock_bin())
            .env("AIRLOCK_CACHE_DIR", test_cache_dir())
            .env("AIRLOCK_STATE_DIR", self.state_dir())
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

/// A `/proc/PID/status` figure in KiB (`VmHWM`: peak resident set; `VmRSS`: now).
pub fn proc_status_kib(pid: u32, key: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"))
}

/// A client handler that counts `notifications/tools/list_changed` from the gateway.
#[derive(Clone, Default)]
pub struct Notices(
    pub std::sync::Arc<std::sync::atomic::AtomicUsize>,
    pub std::sync::Arc<tokio::sync::Notify>,
);

impl Notices {
    /// How many list_changed notifications arrived.
    pub fn count(&self) -> usize {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits (up to `secs`) until more than `seen` notifications arrived.
    pub async fn wait_beyond(&self, seen: usize, secs: u64) -> bool {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(secs);
        loop {
            let notified = self.1.notified();
            if self.count() > seen {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.count() > seen;
            }
        }
    }
}

impl rmcp::ClientHandler for Notices {
    async fn on_tool_list_changed(&self, _context: rmcp::service::NotificationContext<RoleClient>) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.1.notify_waiters();
    }
}

/// `n` calls of `search_sources` (queries `"{query} 0"`, `"{query} 1"`…) through
/// `client`, each answered without an error.
pub async fn searched<H: rmcp::ClientHandler>(
    client: &RunningService<RoleClient, H>,
    query: &str,
    n: usize,
) {
    for i in 0..n {
        let r = call(
            client,
            "search_sources",
            serde_json::json!({"query": format!("{query} {i}")}),
        )
        .await
        .unwrap();
        assert_ne!(r.is_error, Some(true), "{r:?}");
    }
}

/// Calls `name` with JSON object `args`.
pub async fn call<H: rmcp::ClientHandler>(
    client: &RunningService<RoleClient, H>,
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

/// Asserts that `result` is a refusal of `category` as the model sees it: a tool error
/// (`isError: true`) whose text starts with the category's name and `": "` (the shape
/// every refusal renders in, `airlock::pipeline::Outcome`). Returns the text, for what
/// the test checks next; panics at the caller's line with the text otherwise.
#[track_caller]
pub fn assert_refused(result: &CallToolResult, category: airlock::pipeline::Category) -> String {
    let text = text_of(result);
    let name = category.as_str();
    assert_eq!(
        result.is_error,
        Some(true),
        "expected a `{name}` refusal (a tool error), got: {text}"
    );
    assert!(
        text.starts_with(&format!("{name}: ")),
        "expected a `{name}` refusal, got: {text}"
    );
    text
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

/// Calls `name` with `args` as a model told "try again shortly" does: a call refused
/// as `rate limited` (more callers than the adapter's concurrency cap) is made again
/// after a short wait, up to 200 times; any other answer is returned.
pub async fn call_patiently<H: rmcp::ClientHandler>(
    client: &RunningService<RoleClient, H>,
    name: &str,
    args: Value,
) -> CallToolResult {
    for _ in 0..200 {
        let r = call(client, name, args.clone()).await.unwrap();
        if !(r.is_error == Some(true) && text_of(&r).starts_with("rate limited:")) {
            return r;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    panic!("{name} was rate limited 200 times in a row");
}

/// The research loop a model runs: `search_sources(first)`, `search_sources(second)`,
/// then `retrieve_source` of every hit of the *first* search (each call made again when
/// refused as rate limited: [`call_patiently`]). Returns how many hits the first search
/// had and the refusal text of every retrieval that failed (a reference that a second
/// search invalidated shows up here).
pub async fn research_loop<H: rmcp::ClientHandler>(
    client: &RunningService<RoleClient, H>,
    first: &str,
    second: &str,
) -> (usize, Vec<String>) {
    let search = |query: &str| serde_json::json!({ "query": query });
    let hits = call_patiently(client, "search_sources", search(first)).await;
    assert_ne!(hits.is_error, Some(true), "{}", text_of(&hits));
    let found = references(&hits);
    let again = call_patiently(client, "search_sources", search(second)).await;
    assert_ne!(again.is_error, Some(true), "{}", text_of(&again));
    let mut failed = Vec::new();
    for r in &found {
        let args = serde_json::json!({ "reference": r });
        let got = call_patiently(client, "retrieve_source", args).await;
        if got.is_error == Some(true) {
            failed.push(text_of(&got));
        }
    }
    (found.len(), failed)
}

/// Reads run everywhere; the publisher profile prepares, and delivers once a person
/// approved; never to the partner drop.
pub const POLICY: &str = r#"
@id("any-profile")
permit (principal, action == Airlock::Action::"use-profile", resource);

@id("reads")
permit (principal, action == Airlock::Action::"call", resource)
when { resource.effect_class == "read" };

@id("publisher-prepares")
permit (principal, action == Airlock::Action::"call", resource)
when { context.profile == Airlock::Profile::"publisher" && resource.effect_class == "local-transformation" };

@id("publisher-delivers-with-approval")
permit (principal in Airlock::Role::"operator", action == Airlock::Action::"call", resource)
when {
    context.profile == Airlock::Profile::"publisher" &&
    resource.effect_class == "external-effect" &&
    context.approved
};

@id("no-partner-drop")
@category("outside-scope")
forbid (principal, action == Airlock::Action::"call", resource)
when { context has destination && context.destination == Airlock::Scope::"partner-drop" };
"#;

pub const PROFILES: &str = r#"
[requester]
name = "alice"
roles = ["operator"]

[[profile]]
name = "reader"
capabilities = ["search_sources", "retrieve_source"]

[[profile]]
name = "publisher"
capabilities = ["*"]
"#;

/// The notes server with `source-library`, the delivery server with `outbox-delivery`,
/// [`POLICY`] and [`PROFILES`].
pub fn approvals_deployment() -> Deployment {
    Deployment::with_notes()
        .mapping("source-library")
        .with_outbox(&[])
        .policy(POLICY)
        .tables(PROFILES)
}

/// Asserts that a call was refused before anything ran for arguments or references the
/// model must correct: a tool result with `isError: true` (SEP-1303) in the `invalid
/// request` category, not a protocol error. Returns its text.
pub fn refused_arguments(r: Result<CallToolResult, ServiceError>) -> String {
    let r = match r {
        Ok(r) => r,
        Err(e) => panic!("a protocol error instead of a tool result with isError: {e}"),
    };
    let text = text_of(&r);
    assert_eq!(r.is_error, Some(true), "{text}");
    assert!(text.starts_with("invalid request: "), "{text}");
    text
}

/// A loopback port nothing listens on now (bound, read, released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
