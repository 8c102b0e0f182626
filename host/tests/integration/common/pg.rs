//! A real PostgreSQL server for the tests, started by the tests themselves: `initdb` into a
//! temporary folder, then the server on a Unix socket in that folder only
//! (`listen_addresses=''`, no TCP), once per test binary; each test gets a database of its
//! own ([`database`]).
//!
//! No orphan server: `postgres` runs as a child of a thread that lives as long as the test
//! binary, with a parent-death signal (`PR_SET_PDEATHSIG`, SIGQUIT: immediate shutdown),
//! so it stops when the binary exits however it exits (a normal end, a panic, SIGKILL);
//! an `atexit` handler also asks it for a fast shutdown, waits for it and removes the
//! temporary folder on a normal exit (a killed binary's folder is removed by a later run
//! once it is an hour old).
//! `pg_ctl` is not used because it detaches the server from its parent.
//!
//! As root (here and in CI), `initdb` and `postgres` refuse to run, so both run as the
//! `postgres` user (else `nobody`), which owns the temporary folder.
//!
//! Binaries: `initdb` and `postgres` on `PATH`, else the newest `/usr/lib/postgresql/*/bin`.

use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The running server: its socket folder.
pub struct Server {
    /// Folder holding the socket `.s.PGSQL.5432` (the temporary folder).
    pub socket_dir: PathBuf,
}

static SERVER: OnceLock<Result<Server, String>> = OnceLock::new();
static CHILD: Mutex<Option<Child>> = Mutex::new(None);
/// The temporary folder (data and socket), removed at exit once the server stopped.
static ROOT: Mutex<Option<PathBuf>> = Mutex::new(None);
static NEXT_DB: AtomicU32 = AtomicU32::new(0);

/// Whether the server keeps PostgreSQL's durable defaults (`fsync=on`, 128 MB of shared
/// buffers): when [`DURABLE_ENV`] is `1` (the store bench sets it, to measure what a
/// deployment pays). The tests run with `fsync=off` and 16 MB: they test behaviour, and
/// a crash of the throw-away server loses nothing.
fn durable() -> bool {
    std::env::var(DURABLE_ENV).is_ok_and(|v| v == "1")
}

/// See [`durable`].
pub const DURABLE_ENV: &str = "AIRLOCK_TEST_PG_DURABLE";

/// The PostgreSQL role the tests connect as (the bootstrap superuser).
pub const ROLE: &str = "airlock";

fn find_bin(name: &str) -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    for dir in on_path {
        let candidate = dir.join(name);
        if candidate.is_file() {
            return Some(candidate);
        }
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin").join(name)))
        .filter(|p| p.is_file())
        .collect();
    versions.sort();
    versions.pop()
}

/// The uid and gid to run the server as: ours, unless we are root.
fn server_user() -> (u32, u32) {
    // SAFETY: getuid/getpwnam only read process and passwd data.
    unsafe {
        if libc::getuid() != 0 {
            return (libc::getuid(), libc::getgid());
        }
        for name in [c"postgres", c"nobody"] {
            let pw = libc::getpwnam(name.as_ptr());
            if !pw.is_null() {
                return ((*pw).pw_uid, (*pw).pw_gid);
            }
        }
    }
    panic!("running as root with neither a `postgres` nor a `nobody` user to run PostgreSQL as");
}

extern "C" fn stop_at_exit() {
    stop_server();
    if let Some(root) = ROOT.lock().ok().and_then(|mut r| r.take()) {
        let _ = std::fs::remove_dir_all(root);
    }
}

fn stop_server() {
    let Ok(mut guard) = CHILD.lock() else { return };
    if let Some(child) = guard.as_mut() {
        // SIGINT: fast shutdown (ends sessions, checkpoints, removes the socket).
        // SAFETY: signalling our own child by pid.
        unsafe {
            libc::kill(child.id() as i32, libc::SIGINT);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Removes the folders of earlier test binaries that were killed (their server died with
/// them, see the module docs): older than an hour, with no live postmaster.
fn remove_stale_folders() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name();
        if !name.to_string_lossy().starts_with("airlock-pg-") {
            continue;
        }
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > Duration::from_secs(3600));
        let live = std::fs::read_to_string(path.join("data/postmaster.pid"))
            .ok()
            .and_then(|t| t.lines().next().and_then(|l| l.trim().parse::<i32>().ok()))
            // SAFETY: signal 0 only asks whether the process exists.
            .is_some_and(|pid| unsafe { libc::kill(pid, 0) } == 0);
        if old && !live {
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

fn start() -> Result<Server, String> {
    remove_stale_folders();
    let initdb =
        find_bin("initdb").ok_or("no `initdb`: install PostgreSQL (apt-get install postgresql)")?;
    let postgres = find_bin("postgres").ok_or("no `postgres` server binary next to initdb")?;
    let (uid, gid) = server_user();
    // Kept for the binary's lifetime (the server's data and socket live here); the
    // operating system's temp cleaning removes it after a crash.
    let root = tempfile::Builder::new()
        .prefix("airlock-pg-")
        .tempdir()
        .map_err(|e| e.to_string())?
        .keep();
    *ROOT.lock().unwrap() = Some(root.clone());
    let data = root.join("data");
    std::fs::create_dir(&data).map_err(|e| e.to_string())?;
    for p in [&root, &data] {
        std::os::unix::fs::chown(p, Some(uid), Some(gid))
            .map_err(|e| format!("chown {}: {e}", p.display()))?;
    }
    std::fs::set_permissions(&data, std::os::unix::fs::PermissionsExt::from_mode(0o700))
        .map_err(|e| e.to_string())?;
    let out = Command::new(&initdb)
        .args(["-D"])
        .arg(&data)
        .args([
            "-U",
            ROLE,
            "--auth=trust",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
        ])
        .uid(uid)
        .gid(gid)
        .current_dir(&root)
        .output()
        .map_err(|e| format!("running {}: {e}", initdb.display()))?;
    if !out.status.success() {
        return Err(format!(
            "initdb failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let log = std::fs::File::create(root.join("server.log")).map_err(|e| e.to_string())?;
    let socket_dir = root.clone();
    let (tx, rx) = std::sync::mpsc::channel::<Result<u32, String>>();
    // The server is the child of this thread, which never ends: PR_SET_PDEATHSIG fires
    // when the thread that forked the child exits, so it must outlive every test.
    let (pg, d, s) = (postgres.clone(), data.clone(), socket_dir.clone());
    std::thread::Builder::new()
        .name("postgres-parent".into())
        .spawn(move || {
            let mut cmd = Command::new(&pg);
            cmd.arg("-D")
                .arg(&d)
                .args(["-c", "listen_addresses=", "-c"])
                .arg(format!("unix_socket_directories={}", s.display()))
                .args([
                    "-c",
                    if durable() { "fsync=on" } else { "fsync=off" },
                    "-c",
                    "max_connections=300",
                    "-c",
                    if durable() {
                        "shared_buffers=128MB"
                    } else {
                        "shared_buffers=16MB"
                    },
                ])
                .uid(uid)
                .gid(gid)
                .current_dir(&s)
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("log file"))
                .stderr(log);
            // SAFETY: prctl is async-signal-safe; it runs in the child before exec.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGQUIT) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            match cmd.spawn() {
                Ok(child) => {
                    let pid = child.id();
                    *CHILD.lock().unwrap() = Some(child);
                    let _ = tx.send(Ok(pid));
                }
                Err(e) => {
                    let _ = tx.send(Err(format!("starting {}: {e}", pg.display())));
                    return;
                }
            }
            loop {
                std::thread::park();
            }
        })
        .map_err(|e| e.to_string())?;
    rx.recv().map_err(|e| e.to_string())??;
    // SAFETY: registering a plain extern "C" function.
    unsafe {
        libc::atexit(stop_at_exit);
    }
    let socket = socket_dir.join(".s.PGSQL.5432");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if socket.exists() && psql_ok(&socket_dir, "postgres", "SELECT 1").is_ok() {
            break;
        }
        if let Some(Ok(Some(status))) = CHILD.lock().unwrap().as_mut().map(|c| c.try_wait()) {
            return Err(format!(
                "postgres exited ({status}): {}",
                std::fs::read_to_string(root.join("server.log")).unwrap_or_default()
            ));
        }
        if Instant::now() > deadline {
            return Err(format!(
                "postgres did not accept connections within 30 s: {}",
                std::fs::read_to_string(root.join("server.log")).unwrap_or_default()
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(Server { socket_dir })
}

/// Runs `sql` (simple query protocol) in database `db` through the socket.
pub fn psql_ok(socket_dir: &Path, db: &str, sql: &str) -> Result<(), String> {
    let target = format!("host={} user={ROLE} dbname={db}", socket_dir.display());
    let sql = sql.to_owned();
    run_blocking(async move {
        let (client, conn) = tokio_postgres::connect(&target, tokio_postgres::NoTls)
            .await
            .map_err(|e| e.to_string())?;
        let task = tokio::spawn(conn);
        let r = client
            .batch_execute(&sql)
            .await
            .map_err(|e| format!("{e:?}"));
        drop(client);
        let _ = task.await;
        r
    })
}

/// Runs a future on a runtime of its own in a thread of its own (callable from sync tests
/// and from inside a tokio test alike).
fn run_blocking<T: Send + 'static>(f: impl std::future::Future<Output = T> + Send + 'static) -> T {
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f)
    })
    .join()
    .unwrap()
}

/// The shared server, started on first use.
///
/// # Panics
/// When the server cannot be started (the message says why).
pub fn server() -> &'static Server {
    match SERVER.get_or_init(start) {
        Ok(s) => s,
        Err(e) => panic!("the test PostgreSQL server: {e}"),
    }
}

/// A new, empty database on the shared server; returns its `store` target
/// (`host=<socket folder> user=airlock dbname=<name>`).
pub fn database() -> String {
    let s = server();
    let name = format!(
        "t{}_{}",
        std::process::id(),
        NEXT_DB.fetch_add(1, Ordering::SeqCst)
    );
    psql_ok(
        &s.socket_dir,
        "postgres",
        &format!("CREATE DATABASE {name}"),
    )
    .unwrap_or_else(|e| panic!("CREATE DATABASE {name}: {e}"));
    target(&name)
}

/// The `store` target of database `name` on the shared server.
pub fn target(name: &str) -> String {
    format!(
        "host={} user={ROLE} dbname={name}",
        server().socket_dir.display()
    )
}

/// Runs `sql` in the database of `target` (as the superuser, like an attacker holding
/// the database's credentials).
pub fn exec(target: &str, sql: &str) -> Result<(), String> {
    let dbname = target
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("dbname="))
        .expect("a dbname= in the target");
    psql_ok(&server().socket_dir, dbname, sql)
}

/// The rows of `sql` as text, for assertions.
pub fn query(target: &str, sql: &str) -> Vec<Vec<Option<String>>> {
    let target = target.to_owned();
    let sql = sql.to_owned();
    run_blocking(async move {
        let (client, conn) = tokio_postgres::connect(&target, tokio_postgres::NoTls)
            .await
            .unwrap();
        let task = tokio::spawn(conn);
        let mut rows = Vec::new();
        for m in client.simple_query(&sql).await.unwrap() {
            if let tokio_postgres::SimpleQueryMessage::Row(r) = m {
                rows.push((0..r.len()).map(|i| r.get(i).map(str::to_owned)).collect());
            }
        }
        drop(client);
        let _ = task.await;
        rows
    })
}
