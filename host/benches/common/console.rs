//! A real `airlock console` for the benches that measure it (`console`, and `floor` with
//! `AIRLOCK_BENCH_CONSOLE`): started on a state folder, logged in with its one-time link.
#![allow(dead_code)]

use std::io::{BufRead as _, Read as _, Write as _};
use std::path::Path;

/// `airlock console` on a loopback port, killed on drop.
pub struct Console {
    child: std::process::Child,
    /// `127.0.0.1:PORT`.
    pub addr: String,
    /// The session cookie (`name=value`).
    pub cookie: String,
}

impl Drop for Console {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Console {
    /// Starts `bin console` on `state` and logs in.
    ///
    /// # Panics
    /// The console does not start or the login gives no cookie.
    pub fn start(bin: &Path, state: &Path) -> Self {
        let mut child = std::process::Command::new(bin)
            .args(["console", "--addr", "127.0.0.1:0"])
            .env("AIRLOCK_STATE_DIR", state)
            .env("AIRLOCK_LOG", "warn")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
        let url = loop {
            let line = lines.next().expect("airlock console ended").unwrap();
            if let Some(url) = line.strip_prefix("airlock: console at http://") {
                break url.to_string();
            }
        };
        std::thread::spawn(move || for _ in lines {});
        let (addr, login) = url.split_once('/').unwrap();
        let answer = get(addr, &format!("/{login}"), "").unwrap();
        let cookie = answer
            .lines()
            .find_map(|l| l.strip_prefix("set-cookie: "))
            .expect("a console session cookie")
            .split(';')
            .next()
            .unwrap()
            .to_string();
        Self {
            child,
            addr: addr.to_string(),
            cookie,
        }
    }
}

/// One `GET path` to `addr` with `cookie` over a fresh connection: the whole answer.
///
/// # Errors
/// The connection fails.
pub fn get(addr: &str, path: &str, cookie: &str) -> std::io::Result<String> {
    let mut s = std::net::TcpStream::connect(addr)?;
    s.write_all(
        format!(
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nCookie: {cookie}\r\nConnection: close\r\n\r\n"
        )
        .as_bytes(),
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    Ok(text)
}
