//! Confined upstream servers: the hostile fixture server tries every reach the issue
//! names before it serves (`--reach`, fixtures/hostile-server/src/reach.rs), through a
//! real `airlock serve` whose configuration confines it. Each test asserts each reach
//! BLOCKED, with what the kernel said, and that the host still serves through that very
//! server. The unconfined control run makes the same reaches succeed, so a reach that
//! is blocked for another reason (a missing file, a closed port) fails the control.
//!
//! The machine must offer Landlock ABI 6 and (for the namespace tests) user namespaces;
//! a test that cannot run says so and fails, never passes quietly.

use std::collections::BTreeMap;
use std::os::linux::net::SocketAddrExt as _;
use std::path::Path;
use std::time::Duration;

use crate::common::*;
use airlock::upstream::confine;
use serde_json::json;

const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// What the test host offers the hostile server to reach.
struct Targets {
    /// A TCP port the test listens on (never granted).
    listener: std::net::TcpListener,
    /// A UDP socket of the test's.
    udp: std::net::UdpSocket,
    /// An abstract Unix socket the test listens on.
    abstract_name: String,
    _abstract: std::os::unix::net::UnixListener,
    /// A Unix socket by path, in a folder of the test's (never granted).
    unix: std::path::PathBuf,
    _unix: (tempfile::TempDir, std::os::unix::net::UnixListener),
}

impl Targets {
    fn new() -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let abstract_name = format!(
            "airlock-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let addr =
            std::os::unix::net::SocketAddr::from_abstract_name(abstract_name.as_bytes()).unwrap();
        let abstract_listener = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
        let folder = tempfile::tempdir().unwrap();
        let unix = folder.path().join("service.sock");
        let unix_listener = std::os::unix::net::UnixListener::bind(&unix).unwrap();
        Self {
            unix,
            _unix: (folder, unix_listener),
            listener,
            udp: std::net::UdpSocket::bind("127.0.0.1:0").unwrap(),
            abstract_name,
            _abstract: abstract_listener,
        }
    }
}

/// The reaches, by name, with their targets in deployment `d`. `fork` adds the fork
/// bomb; `host_network` (a server that shares the host's network namespace) adds a UDP
/// datagram to the test's socket, which only seccomp refuses there.
fn reaches(
    d: &Deployment,
    t: &Targets,
    fork: bool,
    host_network: bool,
) -> Vec<(&'static str, String)> {
    let state = d.state_dir();
    let out = d.dir.path().join("out");
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let mut reaches = vec![
        ("key", format!("read:{}", state.join("trace.key").display())),
        (
            "store",
            format!("read:{}", state.join("airlock.db").display()),
        ),
        (
            "write-state",
            format!("write:{}", state.join("planted").display()),
        ),
        (
            "write-outside",
            format!("write:{}", d.dir.path().join("planted").display()),
        ),
        ("home", format!("list:{home}")),
        ("environ", "read:/proc/{ppid}/environ".to_string()),
        ("mem", "open:/proc/{ppid}/mem".to_string()),
        (
            "symlink",
            format!(
                "symlink:{}={}",
                out.join("key-link").display(),
                state.join("trace.key").display()
            ),
        ),
        (
            "hardlink",
            format!(
                "hardlink:{}={}",
                out.join("key-hard").display(),
                state.join("trace.key").display()
            ),
        ),
        (
            "connect",
            format!("connect:{}", t.listener.local_addr().unwrap()),
        ),
        ("ptrace", "ptrace:{ppid}".to_string()),
        ("signal", "signal:{ppid}".to_string()),
        ("userns", "userns:-".to_string()),
        ("abstract", format!("abstract:{}", t.abstract_name)),
        // A service's Unix socket by path (a database's, a container runtime's).
        ("unix", format!("unix:{}", t.unix.display())),
        // Only Landlock's TCP rules refuse a bind in the server's own network namespace.
        ("bind", "bind:127.0.0.1:0".to_string()),
        // This test's own process: visible only through the host's /proc.
        (
            "test-environ",
            format!("read:/proc/{}/environ", std::process::id()),
        ),
    ];
    if host_network {
        reaches.push(("udp", format!("udp:{}", t.udp.local_addr().unwrap())));
    }
    if fork {
        reaches.push(("fork", "fork:400".to_string()));
    }
    reaches
}

/// A deployment of `source-library` over the hostile server as `notes`, trying
/// `reaches` and reporting to `out/report.txt`, logging to `calls.jsonl`;
/// `confinement` is the connection's confinement keys (`{out}` and `{log}` stand for the
/// report folder and the call log, `{dir}` for the deployment's folder).
fn deployment(confinement: &str, reach: impl Fn(&Deployment) -> Vec<String>) -> Deployment {
    let d = Deployment::with_notes();
    let out = d.dir.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let log = d.dir.path().join("calls.jsonl");
    std::fs::write(&log, "").unwrap();
    let mut args = vec![
        "fixture".to_string(),
        "hostile-server".to_string(),
        "--call-log".to_string(),
        log.display().to_string(),
        "--report".to_string(),
        out.join("report.txt").display().to_string(),
    ];
    for r in reach(&d) {
        args.push("--reach".into());
        args.push(r);
    }
    let confinement = confinement
        .replace("{out}", &out.display().to_string())
        .replace("{log}", &log.display().to_string())
        .replace("{dir}", &d.dir.path().display().to_string());
    let connection = format!(
        "[[connection]]\nname = \"notes\"\ncommand = \"@airlock\"\nargs = {args:?}\n{confinement}"
    );
    d.replace_connections(&connection).mapping("source-library")
}

/// The grants every confined run here gives: the report folder and the call log.
const GRANTS: &str = "confine = true\n[[connection.grants.filesystem]]\npath = \"{out}\"\naccess = \"read-write\"\n[[connection.grants.filesystem]]\npath = \"{log}\"\naccess = \"read-write\"\n";

/// Serves `d`, checks that a search through the (hostile) notes server answers, and
/// returns the reach report by name.
async fn run(d: &Deployment, names: &[&str]) -> BTreeMap<String, String> {
    let client = d.serve().await;
    let result = tokio::time::timeout(
        CALL_TIMEOUT,
        call(&client, "search_sources", json!({"query": "checkpoint"})),
    )
    .await
    .expect("the host answers")
    .expect("no protocol error");
    assert_ne!(
        result.is_error,
        Some(true),
        "the host still serves: {}",
        text_of(&result)
    );
    client.cancel().await.unwrap();
    let report = std::fs::read_to_string(d.dir.path().join("out/report.txt"))
        .expect("the hostile server wrote its report");
    eprintln!("{report}");
    let lines: Vec<&str> = report.lines().collect();
    assert_eq!(lines.len(), names.len(), "{report}");
    names
        .iter()
        .zip(lines)
        .map(|(name, line)| ((*name).to_string(), line.to_string()))
        .collect()
}

/// Serves a deployment whose hostile server tries [`reaches`] (`fork`, `host_network`)
/// under `confinement`; returns it with the report by reach name.
async fn attempt(
    confinement: &str,
    t: &Targets,
    fork: bool,
    host_network: bool,
) -> (Deployment, BTreeMap<String, String>) {
    let d = deployment(confinement, |d| {
        reaches(d, t, fork, host_network)
            .into_iter()
            .map(|(_, r)| r)
            .collect()
    });
    let names: Vec<&str> = reaches(&d, t, fork, host_network)
        .iter()
        .map(|(n, _)| *n)
        .collect();
    let report = run(&d, &names).await;
    (d, report)
}

fn assert_machine_can_confine(namespaces: bool) {
    let support = confine::support();
    assert!(
        support.landlock_abi >= 6,
        "this machine offers Landlock ABI {} (6 is needed): confinement cannot be tested here",
        support.landlock_abi
    );
    assert!(
        !namespaces || support.namespaces,
        "this machine does not allow user namespaces: confinement with namespaces cannot be tested here"
    );
}

/// Asserts that the reach `name` of `report` says `text`.
fn says(report: &BTreeMap<String, String>, name: &str, text: &str) {
    assert!(
        report[name].contains(text),
        "reach `{name}` should say {text:?}: {}",
        report[name]
    );
}

fn assert_all_blocked(report: &BTreeMap<String, String>) {
    for (name, line) in report {
        assert!(
            line.contains(" BLOCKED "),
            "reach `{name}` was not blocked: {line}\nwhole report: {report:#?}"
        );
    }
}

#[tokio::test]
async fn unconfined_the_hostile_server_reaches_everything() {
    // The control: every reach of the confined tests succeeds without confinement (as
    // main did before confinement existed), so a blocked reach below is the sandbox's.
    let t = Targets::new();
    let (_d, report) = attempt("confine = false\n", &t, true, true).await;
    // A user namespace and ptrace need privileges an ordinary user may lack; the others
    // are open to any process of the host's user.
    let root = unsafe { libc::geteuid() } == 0;
    for (name, line) in &report {
        if !root && ["userns", "ptrace", "mem"].contains(&name.as_str()) {
            continue;
        }
        assert!(
            line.contains(" OK "),
            "unconfined, `{name}` should succeed: {line}"
        );
    }
    drop(t);
}

#[tokio::test]
async fn confined_in_namespaces_every_reach_is_blocked_and_the_host_serves() {
    assert_machine_can_confine(true);
    let t = Targets::new();
    let (d, report) = attempt(
        &format!("{GRANTS}[connection.limits]\nprocesses = 64\n"),
        &t,
        true,
        false,
    )
    .await;
    assert_all_blocked(&report);
    // The fork bomb was stopped by the bound, not by a refusal to fork at all.
    says(&report, "fork", "fork failed after");
    // Its /proc is its own namespace's: the test's process is not there at all (not
    // merely refused, as without the namespaces).
    says(&report, "test-environ", "No such file or directory");
    // Absent from its filesystem view, not merely refused.
    says(&report, "unix", "No such file or directory");
    // Bound by Landlock's TCP rules, even in its own network namespace.
    says(&report, "bind", "Permission denied");
    // The planted symbolic link exists in the granted folder, and led nowhere.
    assert!(d.dir.path().join("out/key-link").is_symlink());
    assert!(!d.state_dir().join("planted").exists());
    assert!(!d.dir.path().join("planted").exists());
}

#[tokio::test]
async fn confined_without_namespaces_landlock_and_seccomp_still_block() {
    assert_machine_can_confine(false);
    let t = Targets::new();
    // Without a PID namespace the host is the server's visible parent: /proc/PPID,
    // ptrace and signals are Landlock's to refuse. (No fork bound for uid 0 here: the
    // kernel exempts root from RLIMIT_NPROC, and only the PID namespace bounds it.)
    let (_d, mut report) = attempt(&format!("namespaces = false\n{GRANTS}"), &t, false, true).await;
    // Not covered without namespaces (README): Landlock ABI 6 does not mediate a Unix
    // socket reached by its path; only the server's own filesystem view hides it.
    let unix = report.remove("unix").unwrap();
    assert!(unix.contains(" OK "), "{unix}");
    assert_all_blocked(&report);
    // UDP is refused by seccomp alone here (Landlock's rules are TCP only).
    says(&report, "udp", "Operation not permitted");
    // The host was visible, and still refused.
    assert!(
        !report["environ"].contains("/proc/0/"),
        "{}",
        report["environ"]
    );
}

#[tokio::test]
async fn egress_reaches_granted_destinations_through_the_proxy_and_nothing_else() {
    assert_machine_can_confine(true);
    // The granted destination echoes what it gets: bytes cross the relay and the proxy.
    // (The server starts more than once: discovery, then serving.)
    let echo = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let granted = echo.local_addr().unwrap().port();
    std::thread::spawn(move || {
        use std::io::{Read as _, Write as _};
        for mut s in echo.incoming().flatten() {
            let mut buf = [0u8; 5];
            if s.read_exact(&mut buf).is_ok() {
                let _ = s.write_all(&buf);
            }
        }
    });
    let ungranted = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let ungranted = ungranted.local_addr().unwrap().port();
    // `localhost` is granted by name: it resolves to loopback, which a name never grants.
    let names = [
        "granted",
        "ungranted-port",
        "ungranted-name",
        "loopback-name",
        "direct",
    ];
    let d = deployment(
        &format!(
            "{GRANTS}[connection.grants.network]\ntcp_connect = [\"127.0.0.1:{granted}\", \"localhost:{ungranted}\"]\n"
        ),
        |_| {
            vec![
                format!("proxy:127.0.0.1:{granted}"),
                format!("proxy:127.0.0.1:{ungranted}"),
                "proxy:exfiltrate.example:443".into(),
                format!("proxy:localhost:{ungranted}"),
                // Around the proxy: Landlock allows the relay's port only.
                format!("connect:127.0.0.1:{granted}"),
            ]
        },
    );
    let report = run(&d, &names).await;
    assert!(
        report["granted"].contains(" OK ") && report["granted"].contains("got back \"hello\""),
        "{}",
        report["granted"]
    );
    for name in &names[1..] {
        assert!(report[*name].contains(" BLOCKED "), "{}", report[*name]);
    }
    says(&report, "ungranted-port", "403 Forbidden");
    says(&report, "ungranted-name", "the name was not resolved");
    says(&report, "loopback-name", "need a grant by address");
    says(&report, "direct", "Permission denied");
    // Each refusal is in the trace with what was refused; the granted one is not.
    let refused: Vec<(String, u64)> = d
        .trace()
        .into_iter()
        .filter(|e| e["kind"] == "upstream-egress-refused")
        .map(|e| {
            assert_eq!(e["subject"], "notes", "{e}");
            (
                e["payload"]["host"].as_str().unwrap().to_string(),
                e["payload"]["port"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        refused,
        vec![
            ("127.0.0.1".to_string(), u64::from(ungranted)),
            ("exfiltrate.example".to_string(), 443),
            ("localhost".to_string(), u64::from(ungranted)),
        ]
    );
    // The review shows the egress grant beside the mapping's grants.
    let config = d.write_config();
    let manifest = d.manifests()[0].display().to_string();
    let out = d.airlock(&["grants", &manifest, "--config", config.to_str().unwrap()]);
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains(&format!(
            "network: tcp_connect 127.0.0.1:{granted}, localhost:{ungranted} (through the host's egress proxy"
        )),
        "{text}"
    );
}

#[tokio::test]
async fn read_only_grants_and_the_root_are_read_only_mounts_not_only_landlock_rules() {
    assert_machine_can_confine(true);
    // Landlock ABI 6 does not mediate a change of metadata (chmod, chown, utime, xattrs):
    // only a read-only mount keeps a server from changing its read-only grants, and its
    // root. Each `chmod` sets the mode it found (the unconfined control changes nothing).
    let reaches = |d: &Deployment, root: bool| {
        let docs = d.dir.path().join("docs");
        std::fs::create_dir_all(&docs).unwrap();
        std::fs::write(docs.join("guide.md"), "# guide\n").unwrap();
        let mut r = vec![
            format!("read:{}", docs.join("guide.md").display()),
            format!("chmod:{}", docs.join("guide.md").display()),
            format!("chmod:{}", docs.display()),
        ];
        if root {
            r.push("chmod:/".to_string());
            // A device every server may write: the host's own inode, on a read-only mount.
            r.push("chmod:/dev/null".to_string());
        }
        r
    };
    let control = deployment("confine = false\n", |d| reaches(d, false));
    let report = run(&control, &["read", "chmod-file", "chmod-folder"]).await;
    for (name, line) in &report {
        assert!(
            line.contains(" OK "),
            "unconfined, `{name}` should succeed: {line}"
        );
    }
    let d = deployment(
        &format!(
            "{GRANTS}[[connection.grants.filesystem]]\npath = \"{{dir}}/docs\"\naccess = \"read-only\"\n"
        ),
        |d| reaches(d, true),
    );
    let report = run(
        &d,
        &[
            "read",
            "chmod-file",
            "chmod-folder",
            "chmod-root",
            "chmod-null",
        ],
    )
    .await;
    assert!(report["read"].contains(" OK "), "{}", report["read"]);
    for name in ["chmod-file", "chmod-folder", "chmod-root", "chmod-null"] {
        assert!(
            report[name].contains(" BLOCKED ") && report[name].contains("Read-only file system"),
            "`{name}` must meet a read-only mount: {}",
            report[name]
        );
    }
}

#[tokio::test]
async fn egress_refusals_are_traced_once_per_destination_and_at_most_64_per_start() {
    use airlock::upstream::confine::proxy::MAX_REPORTED as EGRESS_TRACED;
    assert_machine_can_confine(true);
    // A server that asks for one destination again and again, then for destination after
    // destination, cannot grow the trace without bound.
    let mut asks = vec!["proxy:again.example:443".to_string(); 3];
    asks.extend((0..EGRESS_TRACED + 6).map(|i| format!("proxy:n{i}.example:443")));
    let names: Vec<String> = (0..asks.len()).map(|i| format!("ask-{i}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let d = deployment(
        &format!("{GRANTS}[connection.grants.network]\ntcp_connect = [\"203.0.113.7:443\"]\n"),
        |_| asks.clone(),
    );
    let report = run(&d, &names).await;
    for line in report.values() {
        assert!(line.contains(" BLOCKED HTTP/1.1 403 Forbidden"), "{line}");
    }
    let traced: Vec<(String, u64)> = d
        .trace()
        .into_iter()
        .filter(|e| e["kind"] == "upstream-egress-refused")
        .map(|e| {
            (
                e["payload"]["host"].as_str().unwrap().to_string(),
                e["payload"]["count"].as_u64().unwrap(),
            )
        })
        .collect();
    let mut want = vec![("again.example".to_string(), 1)];
    // The three asks for `again.example` are counted, not traced again.
    want.extend((0..EGRESS_TRACED - 1).map(|i| (format!("n{i}.example"), i as u64 + 4)));
    assert_eq!(
        traced, want,
        "one event per destination, the first {EGRESS_TRACED}"
    );
}

/// `airlock discover notes --learn` on `d`'s configuration.
fn learn(d: &Deployment) -> std::process::Output {
    let config = d.write_config();
    d.airlock(&[
        "discover",
        "notes",
        "--config",
        config.to_str().unwrap(),
        "--learn",
    ])
}

#[test]
fn discover_learn_reports_each_refusal_with_the_grant_that_allows_it() {
    assert_machine_can_confine(true);
    let d = deployment(GRANTS, |d| {
        let docs = d.dir.path().join("docs");
        let logs = d.dir.path().join("logs");
        std::fs::create_dir_all(&docs).unwrap();
        std::fs::create_dir_all(&logs).unwrap();
        std::fs::write(docs.join("guide.md"), "# guide\n").unwrap();
        vec![
            format!("read:{}", docs.join("guide.md").display()),
            format!("write:{}", logs.join("server.log").display()),
            format!("read:{}", d.state_dir().join("trace.key").display()),
            "proxy:api.example.test:443".into(),
        ]
    });
    let config = d.write_config();
    // The store (and its key) exists before the run, as on a host that served already.
    d.airlock_ok(&["discover", "notes", "--config", config.to_str().unwrap()]);
    let v = d.airlock_json(&[
        "discover",
        "notes",
        "--config",
        config.to_str().unwrap(),
        "--learn",
    ]);
    let learned = &v["learned"];
    let root = d.dir.path().canonicalize().unwrap();
    let docs = root.join("docs/guide.md").display().to_string();
    let logs = root.join("logs").display().to_string();
    let paths: BTreeMap<String, serde_json::Value> = learned["paths"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["path"].as_str().unwrap().to_string(), p.clone()))
        .collect();
    assert_eq!(paths[&docs]["access"], "read-only", "{learned:#}");
    assert_eq!(paths[&logs]["access"], "read-write", "{learned:#}");
    let key = d
        .state_dir()
        .join("trace.key")
        .canonicalize()
        .unwrap()
        .display()
        .to_string();
    assert!(
        paths[&key]["never"]
            .as_str()
            .unwrap()
            .contains("must never reach"),
        "{learned:#}"
    );
    assert_eq!(learned["egress"][0]["grant"], "api.example.test:443");
    let toml = learned["toml"].as_str().unwrap();
    assert!(
        toml.contains("tcp_connect = [\"api.example.test:443\"]"),
        "{toml}"
    );
    assert!(toml.contains(&format!("path = {docs:?}")), "{toml}");
    assert!(!toml.contains("trace.key"), "{toml}");
    // The text form says the same for a person.
    let out = learn(&d);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("learned: the confined server was refused"),
        "{text}"
    );
    assert!(text.contains("NEVER GRANTED"), "{text}");
    // A server that fails its start still teaches what its proxy refused.
    let d = deployment(GRANTS, |_| {
        vec!["proxy:api.example.test:443".into(), "exit:3".into()]
    });
    let out = learn(&d);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("exit status: 3"), "{stderr}");
    assert!(
        stderr.contains("egress api.example.test:443: api.example.test:443 is not granted"),
        "{stderr}"
    );
    assert!(
        stderr.contains("tcp_connect = [\"api.example.test:443\"]"),
        "{stderr}"
    );
    // An unconfined connection has nothing to learn.
    let d = d.replace_connections(
        "[[connection]]\nname = \"notes\"\ncommand = \"@airlock\"\nargs = [\"fixture\", \"notes-server\"]\nconfine = false\n",
    );
    let out = learn(&d);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("is unconfined"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn a_confined_server_that_handles_sigterm_finishes_its_work_when_the_host_stops() {
    assert_machine_can_confine(true);
    let d = Deployment::with_notes();
    let out = d.dir.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let bin = airlock_bin().canonicalize().unwrap();
    // A shell is the server's first process (PID 1 of its namespace) with a SIGTERM trap
    // that takes a moment, then writes a file: what a server that flushes on SIGTERM does.
    let script = format!(
        "trap 'sleep 0.5; echo flushed > {out}/term.txt; exit 0' TERM; exec 3<&0; {bin} fixture notes-server <&3 & wait $!",
        out = out.display(),
        bin = bin.display()
    );
    let connection = format!(
        "[[connection]]\nname = \"notes\"\ncommand = \"sh\"\nargs = [\"-c\", {script:?}]\nenv = {{ PATH = \"/usr/bin:/bin\" }}\n{}",
        confined(&[(bin.as_path(), "read-only"), (out.as_path(), "read-write")])
    );
    let d = d.replace_connections(&connection).mapping("source-library");
    let client = d.serve().await;
    let r = call(&client, "search_sources", json!({"query": "checkpoint"}))
        .await
        .unwrap();
    assert_ne!(r.is_error, Some(true), "{}", text_of(&r));
    client.cancel().await.unwrap();
    // The host stops its servers with SIGTERM and a grace period (2 s) before SIGKILL.
    let file = out.join("term.txt");
    for _ in 0..100 {
        if file.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        std::fs::read_to_string(&file).ok().as_deref(),
        Some("flushed\n"),
        "the server's SIGTERM handler ran before it was killed"
    );
}

#[test]
fn a_grant_that_holds_the_state_folder_is_refused_at_start() {
    let d = Deployment::with_notes();
    let connection = format!(
        "[[connection]]\nname = \"notes\"\ncommand = \"@airlock\"\nargs = [\"fixture\", \"notes-server\"]\nconfine = true\n[[connection.grants.filesystem]]\npath = {:?}\naccess = \"read-only\"\n",
        d.dir.path().display().to_string()
    );
    let d = d.replace_connections(&connection).mapping("source-library");
    let config = d.write_config();
    let out = d.airlock(&["serve", "--config", config.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("must never reach"), "{stderr}");
}

#[test]
fn grants_with_config_shows_the_confinement_beside_the_mapping_and_drift_follows_it() {
    let d = Deployment::with_notes().mapping("source-library");
    let docs = d.dir.path().join("docs");
    std::fs::create_dir_all(&docs).unwrap();
    let confined = |extra: &str| {
        format!(
            "[[connection]]\nname = \"notes\"\ncommand = \"@airlock\"\nargs = [\"fixture\", \"notes-server\"]\nconfine = true\n{extra}"
        )
    };
    let d = d.replace_connections(&confined(""));
    let config = d.write_config();
    let manifest = d.manifests()[0].display().to_string();
    let args = |json: bool| {
        let mut a = vec![
            "grants",
            manifest.as_str(),
            "--config",
            config.to_str().unwrap(),
        ];
        if json {
            a.push("--json");
        }
        a.into_iter().map(String::from).collect::<Vec<_>>()
    };
    // `grants --config` without a state folder: the review of a configuration.
    let review = |args: &[&str]| {
        std::process::Command::new(airlock_bin())
            .args(args)
            .env_remove("AIRLOCK_STATE_DIR")
            .env_remove("AIRLOCK_LOG")
            .output()
            .unwrap()
    };
    let run = |args: Vec<String>| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        review(&args)
    };
    // The connection's first revision (and the store the review reads).
    let before = d.airlock_json(&["discover", "notes", "--config", config.to_str().unwrap()]);
    let out = run(args(false));
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains("confinement          filesystem: system folders"),
        "{text}"
    );
    assert!(text.contains("granted: none (deny by default)"), "{text}");
    assert!(text.contains("network: none (deny by default)"), "{text}");
    assert!(
        text.contains("limits: processes 256, open files 1024"),
        "{text}"
    );
    // The configuration digest covers the confinement: widening it is drift.
    let d = d.replace_connections(&confined(&format!(
        "[[connection.grants.filesystem]]\npath = {:?}\naccess = \"read-write\"\n",
        docs.display().to_string()
    )));
    let config = d.write_config();
    let out = review(&[
        "grants",
        &manifest,
        "--config",
        config.to_str().unwrap(),
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    let lines = v["connection"]["confinement"].to_string();
    assert!(lines.contains("(read-write)"), "{lines}");
    let after = d.airlock_json(&["discover", "notes", "--config", config.to_str().unwrap()]);
    assert_eq!(
        after["new_revision"], true,
        "a widened grant must change the connection's identity: {before} {after}"
    );
    assert_ne!(before["config_revision"], after["config_revision"]);
    // Unconfined: said so.
    let d = d.replace_connections(
        "[[connection]]\nname = \"notes\"\ncommand = \"@airlock\"\nargs = [\"fixture\", \"notes-server\"]\nconfine = false\n",
    );
    let config = d.write_config();
    let out = review(&["grants", &manifest, "--config", config.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("UNCONFINED"), "{text}");
    assert!(
        text.contains("FLAGGED   the connection's server runs UNCONFINED"),
        "{text}"
    );
    assert_eq!(
        out.status.code(),
        Some(2),
        "an unconfined server is FLAGGED"
    );
    let out = review(&[
        "grants",
        &manifest,
        "--config",
        config.to_str().unwrap(),
        "--allow-flagged",
    ]);
    assert_eq!(out.status.code(), Some(0));
}

/// The helper and the kernel as an ordinary user (`nobody`, by `setpriv`), when the tests
/// run as root (CI): the hostile server, confined and not, tries what `nobody` may
/// otherwise do — read and list a world-readable folder, write a world-writable one,
/// connect to a listening port and an abstract socket, enter a user namespace, fork 400
/// processes — and stops at end of input.
#[test]
fn as_an_ordinary_user_the_same_reaches_are_blocked() {
    use std::os::unix::fs::PermissionsExt as _;
    if unsafe { libc::geteuid() } != 0 {
        // An ordinary user already runs every other test here.
        eprintln!("not root: the other tests of this module ran as an ordinary user");
        return;
    }
    assert_machine_can_confine(true);
    let t = Targets::new();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let open = |p: &Path, mode: u32| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    open(root, 0o755);
    std::fs::create_dir(root.join("public")).unwrap();
    std::fs::write(root.join("public/secret.txt"), "s3cret").unwrap();
    open(&root.join("public/secret.txt"), 0o644);
    std::fs::create_dir(root.join("drop")).unwrap();
    open(&root.join("drop"), 0o777);
    std::fs::create_dir(root.join("out")).unwrap();
    open(&root.join("out"), 0o777);
    // A copy of the binary nobody can reach (the checkout may sit in a folder only root
    // may enter, such as /root): the fixture server and the helper need nothing beside it.
    // In its own folder: a confined server reads its install folder.
    std::fs::create_dir(root.join("app")).unwrap();
    open(&root.join("app"), 0o755);
    let bin = root.join("app/airlock");
    std::fs::copy(airlock_bin(), &bin).unwrap();
    open(&bin, 0o755);
    // Retried: a process another test thread forks while the copy is being written holds
    // its write descriptor until it execs, and exec then fails with ETXTBSY (seen once
    // under the whole suite's load).
    let reachable = (0..20).any(|attempt| {
        if attempt > 0 {
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        std::process::Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(&bin)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    });
    assert!(
        reachable,
        "nobody cannot execute {} (a folder above it is not searchable by others): this machine cannot run this test",
        bin.display()
    );
    let reaches = vec![
        format!("read:{}", root.join("public/secret.txt").display()),
        format!("list:{}", root.join("public").display()),
        format!("write:{}", root.join("drop/planted").display()),
        format!("connect:{}", t.listener.local_addr().unwrap()),
        format!("abstract:{}", t.abstract_name),
        "userns:-".to_string(),
        "fork:400".to_string(),
    ];
    let run = |confined: bool| -> Vec<String> {
        let report = root
            .join("out")
            .join(if confined { "confined.txt" } else { "open.txt" });
        let mut args = vec![
            "fixture".to_string(),
            "hostile-server".to_string(),
            "--report".to_string(),
            report.display().to_string(),
        ];
        for r in &reaches {
            args.extend(["--reach".to_string(), r.clone()]);
        }
        let mut cmd = std::process::Command::new("setpriv");
        cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"]);
        let _scratch;
        if confined {
            let confinement = confine::Confinement {
                paths: vec![confine::PathGrant {
                    path: root.join("out"),
                    access: confine::Access::ReadWrite,
                }],
                limits: confine::Limits {
                    processes: 64,
                    ..confine::Limits::DEFAULT
                },
                ..confine::Confinement::deny_by_default()
            };
            let (helper, confined) =
                confine::command(&bin, &args, root, &BTreeMap::new(), &confinement, None).unwrap();
            open(confined.scratch.path(), 0o777);
            let helper = helper.as_std();
            // The helper is the copy nobody can execute, whatever this process named.
            cmd.arg(&bin).args(helper.get_args()).env_clear();
            for (k, v) in helper.get_envs() {
                if let Some(v) = v {
                    cmd.env(k, v);
                }
            }
            _scratch = confined;
        } else {
            cmd.arg(&bin).args(&args).env_clear();
        }
        let out = cmd
            .current_dir(root)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let text = std::fs::read_to_string(&report).unwrap_or_else(|e| {
            panic!(
                "no report ({e}); stderr: {}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
        text.lines().map(String::from).collect()
    };
    let open_report = run(false);
    assert_eq!(open_report.len(), reaches.len(), "{open_report:?}");
    for line in &open_report {
        // nobody may create a user namespace where the kernel lets unprivileged users.
        if line.contains("userns:") && !confine::support().namespaces {
            continue;
        }
        assert!(
            line.contains(" OK "),
            "unconfined nobody should reach: {line}"
        );
    }
    eprintln!("{}", open_report.join("\n"));
    let confined_report = run(true);
    eprintln!("{}", confined_report.join("\n"));
    assert_eq!(confined_report.len(), reaches.len(), "{confined_report:?}");
    for line in &confined_report {
        assert!(
            line.contains(" BLOCKED "),
            "confined nobody reached: {line}"
        );
    }
}
