//! The egress proxy of a confined server.
//!
//! Rule: a confined server reaches the network only through this proxy, and the proxy
//! reaches only destinations its connection grants (`[connection.grants.network]
//! tcp_connect`), checked with the grammar and the ranges of the adapters' socket checks
//! ([`airlock_core::destination`]): a granted address or network is reached as granted; a
//! granted name is resolved here, on the host, and only its public addresses are reached
//! (loopback, private, link-local and metadata addresses need an explicit grant by
//! address); a name that is not granted is never resolved. It speaks HTTP/1.1 `CONNECT
//! host:port` (for TLS) and absolute-form requests (`GET http://host/…`, rewritten to
//! origin-form). Every refused destination is answered `403` with the reason, counted and
//! reported as a [`Refused`]; nothing is sent toward a refused destination.
//!
//! The server reaches the proxy at `127.0.0.1:PORT` of its own network namespace
//! (`HTTP_PROXY`/`HTTPS_PROXY`), where the confinement helper relays each connection to
//! this proxy's Unix socket ([`Egress::socket`]); Landlock lets the server connect to that
//! one TCP port and no other.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use airlock_core::destination::{Destination, is_special};
use anyhow::{Context as _, Result};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::mpsc;

/// Resolves and checks one destination: the addresses that may be connected to, or why
/// not. Blocking (name resolution); called on a blocking thread.
pub type EgressCheck = Arc<dyn Fn(&str, u16) -> Result<Vec<SocketAddr>, String> + Send + Sync>;

/// One refused destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// The host as the server asked for it.
    pub host: String,
    /// The port.
    pub port: u16,
    /// Why, in words.
    pub reason: String,
    /// How many destinations the proxy has refused since it started, this one included.
    pub count: u64,
}

/// Largest request head read (bytes).
const MAX_HEAD: usize = 16 * 1024;

/// Longest wait for a request head, once a connection is open.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);

/// Proxy connections served at once for one server; more are answered `503`.
pub const MAX_TUNNELS: usize = 64;

/// Distinct destinations reported per proxy (more are counted only): a server that asks
/// for destination after destination cannot grow the trace without bound.
pub const MAX_REPORTED: usize = 64;

/// Where refusals go: each counted; the first refusal of each destination (at most
/// [`MAX_REPORTED`] of them) sent to the receiver, which holds them all until read — so a
/// server that repeats one destination cannot crowd out another, whenever the receiver
/// starts reading.
#[derive(Clone)]
pub struct Reporter {
    held: mpsc::Sender<Refused>,
    count: Arc<AtomicU64>,
    seen: Arc<std::sync::Mutex<std::collections::BTreeSet<(String, u16)>>>,
}

impl Reporter {
    /// A reporter and the receiving end of its refusals.
    #[must_use]
    pub fn new() -> (Self, mpsc::Receiver<Refused>) {
        let (held, rx) = mpsc::channel(MAX_REPORTED);
        (
            Self {
                held,
                count: Arc::default(),
                seen: Arc::default(),
            },
            rx,
        )
    }

    /// How many destinations were refused so far.
    #[must_use]
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    fn refused(&self, host: String, port: u16, reason: String) {
        let count = self.count.fetch_add(1, Ordering::Relaxed) + 1;
        let first = {
            let mut seen = self
                .seen
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            seen.len() < MAX_REPORTED && seen.insert((host.clone(), port))
        };
        if first {
            // Never full: at most MAX_REPORTED are ever sent.
            let _ = self.held.try_send(Refused {
                host,
                port,
                reason,
                count,
            });
        }
    }
}

/// Serves proxy connections from `listener` until it fails, at most [`MAX_TUNNELS`] at
/// once.
///
/// Every connection is a task of this future's own set, so stopping the future (dropping
/// or aborting it) ends every tunnel too. An `accept` that fails (out of descriptors) is
/// logged and tried again after a pause, never the end of the proxy.
pub async fn serve(listener: tokio::net::UnixListener, check: EgressCheck, report: Reporter) {
    let permits = Arc::new(tokio::sync::Semaphore::new(MAX_TUNNELS));
    let mut tunnels = tokio::task::JoinSet::new();
    loop {
        while tunnels.try_join_next().is_some() {}
        let mut stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!("the egress proxy could not accept a connection: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tunnels.spawn(async move {
                let busy = format!("airlock: at most {MAX_TUNNELS} proxy connections at once");
                let _ = answer(&mut stream, "503 Service Unavailable", &busy).await;
            });
            continue;
        };
        let (check, report) = (check.clone(), report.clone());
        tunnels.spawn(async move {
            if let Err(e) = one(stream, check, report).await {
                tracing::debug!("egress proxy connection ended: {e}");
            }
            drop(permit);
        });
    }
}

/// The check of a confined server's `tcp_connect` grants (see the module's rule):
/// an IP literal is allowed when a granted address or network holds it; a name when it is
/// granted with that port, and then only its addresses that are public or granted by
/// address. Resolution runs on the calling (blocking) thread.
#[must_use]
pub fn check_for(grants: Vec<Destination>) -> EgressCheck {
    Arc::new(move |host: &str, port: u16| {
        let by_address = |addr: SocketAddr| grants.iter().any(|d| d.contains(addr));
        if let Ok(ip) = host.parse::<IpAddr>() {
            let addr = SocketAddr::new(ip, port);
            return if by_address(addr) {
                Ok(vec![addr])
            } else {
                Err(format!("{host}:{port} is not granted (tcp_connect)"))
            };
        }
        let named = grants.iter().any(
            |d| matches!(d, Destination::Named { host: h, port: p } if h == host && *p == port),
        );
        if !named {
            return Err(format!(
                "{host}:{port} is not granted (tcp_connect); the name was not resolved"
            ));
        }
        let all: Vec<SocketAddr> = (host, port)
            .to_socket_addrs()
            .map_err(|e| format!("{host} does not resolve: {e}"))?
            .collect();
        let allowed: Vec<SocketAddr> = all
            .iter()
            .copied()
            .filter(|a| !is_special(a.ip()) || by_address(*a))
            .collect();
        if allowed.is_empty() {
            let shown: Vec<String> = all.iter().map(|a| a.ip().to_string()).collect();
            return Err(format!(
                "{host} resolves only to addresses a name does not grant ({}): loopback, private, link-local and metadata addresses need a grant by address",
                shown.join(", ")
            ));
        }
        Ok(allowed)
    })
}

/// A running egress proxy of one confined server: a Unix socket in a folder only the
/// host's user can enter, the task serving it (stopped, with every tunnel, when this is
/// dropped), and its [`Reporter`].
pub struct Egress {
    socket: PathBuf,
    _folder: tempfile::TempDir,
    task: tokio::task::AbortHandle,
    report: Reporter,
}

impl Egress {
    /// Starts a proxy for `grants` on the current tokio runtime, reporting to `report`.
    ///
    /// # Errors
    /// The folder or the socket cannot be made.
    pub fn start(grants: Vec<Destination>, report: Reporter) -> Result<Self> {
        let folder = tempfile::Builder::new()
            .prefix("airlock-egress-")
            .tempdir()
            .context("making the egress proxy's folder")?;
        let socket = folder.path().join("proxy.sock");
        let listener = tokio::net::UnixListener::bind(&socket)
            .with_context(|| format!("listening on {}", socket.display()))?;
        let task = tokio::spawn(serve(listener, check_for(grants), report.clone())).abort_handle();
        Ok(Self {
            socket,
            _folder: folder,
            task,
            report,
        })
    }

    /// The proxy's Unix socket (the helper relays the server's connections to it).
    #[must_use]
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// How many destinations were refused since the proxy started.
    #[must_use]
    pub fn refused(&self) -> u64 {
        self.report.count()
    }
}

impl Drop for Egress {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What a request head asks for.
#[derive(Debug, PartialEq, Eq)]
enum Ask {
    /// `CONNECT host:port`.
    Tunnel { host: String, port: u16 },
    /// An absolute-form request: the head to send, rewritten to origin-form.
    Forward {
        host: String,
        port: u16,
        head: Vec<u8>,
    },
}

/// Parses a request head (through its blank line).
fn parse(head: &[u8]) -> Result<Ask, String> {
    let text = std::str::from_utf8(head).map_err(|_| "the request head is not UTF-8")?;
    let (line, rest) = text.split_once("\r\n").ok_or("no request line")?;
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(format!("not a request line: {line:?}"));
    };
    if !version.starts_with("HTTP/1.") {
        return Err(format!("not HTTP/1.x: {version:?}"));
    }
    if method == "CONNECT" {
        let (host, port) = authority(target, None)?;
        return Ok(Ask::Tunnel { host, port });
    }
    let after = target.strip_prefix("http://").ok_or_else(|| {
        format!("a proxy request names an http:// URL (use CONNECT for https): {target:?}")
    })?;
    let (auth, path) = match after.find('/') {
        Some(i) => (&after[..i], &after[i..]),
        None => (after, "/"),
    };
    let (host, port) = authority(auth, Some(80))?;
    let mut out = format!("{method} {path} {version}\r\n");
    for header in rest.split("\r\n") {
        let name = header.split(':').next().unwrap_or("").to_ascii_lowercase();
        if !header.is_empty() && !name.starts_with("proxy-") {
            out.push_str(header);
            out.push_str("\r\n");
        }
    }
    out.push_str("\r\n");
    Ok(Ask::Forward {
        host,
        port,
        head: out.into_bytes(),
    })
}

/// `host:port` (or `[v6]:port`); `default` when no port is written.
fn authority(text: &str, default: Option<u16>) -> Result<(String, u16), String> {
    let bad = || format!("not a host and port: {text:?}");
    if text.is_empty() || text.contains('@') {
        return Err(bad());
    }
    let (host, port) = match text.strip_prefix('[') {
        Some(rest) => {
            let (host, after) = rest.split_once(']').ok_or_else(bad)?;
            let port = match after {
                "" => None,
                p => Some(p.strip_prefix(':').ok_or_else(bad)?),
            };
            (host, port)
        }
        None => match text.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (text, None),
        },
    };
    let port = match (port, default) {
        (Some(p), _) => {
            if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!("not a port: {p:?}"));
            }
            match p.parse::<u16>() {
                Ok(n) if n != 0 => n,
                _ => return Err(format!("not a port: {p:?}")),
            }
        }
        (None, Some(d)) => d,
        (None, None) => return Err(format!("no port in {text:?}")),
    };
    if host.is_empty() || host.contains(|c: char| c.is_whitespace() || c.is_control() || c == '/') {
        return Err(format!("not a host: {host:?}"));
    }
    Ok((host.to_ascii_lowercase(), port))
}

async fn one(
    mut stream: tokio::net::UnixStream,
    check: EgressCheck,
    report: Reporter,
) -> std::io::Result<()> {
    let mut head = Vec::new();
    let mut buf = [0u8; 2048];
    let end = loop {
        let Ok(n) = tokio::time::timeout(HEAD_TIMEOUT, stream.read(&mut buf)).await else {
            return answer(&mut stream, "408 Request Timeout", "").await;
        };
        let n = n?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
        if let Some(i) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if head.len() > MAX_HEAD {
            return answer(&mut stream, "431 Request Header Fields Too Large", "").await;
        }
    };
    let early = head.split_off(end);
    let ask = match parse(&head) {
        Ok(ask) => ask,
        Err(why) => return answer(&mut stream, "400 Bad Request", &why).await,
    };
    let (host, port) = match &ask {
        Ask::Tunnel { host, port } | Ask::Forward { host, port, .. } => (host.clone(), *port),
    };
    let addrs = {
        let (check, host) = (check.clone(), host.clone());
        tokio::task::spawn_blocking(move || check(&host, port))
            .await
            .unwrap_or_else(|e| Err(format!("the check failed: {e}")))
    };
    let addrs = match addrs {
        Ok(addrs) if !addrs.is_empty() => addrs,
        Ok(_) | Err(_) => {
            let reason = addrs.err().unwrap_or_else(|| "no address".into());
            report.refused(host.clone(), port, reason.clone());
            return answer(
                &mut stream,
                "403 Forbidden",
                &format!("airlock: egress to {host}:{port} refused: {reason}"),
            )
            .await;
        }
    };
    let mut upstream = match tokio::net::TcpStream::connect(&addrs[..]).await {
        Ok(s) => s,
        Err(e) => return answer(&mut stream, "502 Bad Gateway", &e.to_string()).await,
    };
    match ask {
        Ask::Tunnel { .. } => {
            stream
                .write_all(b"HTTP/1.1 200 Connection Established\r\n\r\n")
                .await?;
        }
        Ask::Forward { head, .. } => upstream.write_all(&head).await?,
    }
    upstream.write_all(&early).await?;
    tokio::io::copy_bidirectional(&mut stream, &mut upstream).await?;
    Ok(())
}

async fn answer(
    stream: &mut tokio::net::UnixStream,
    status: &str,
    body: &str,
) -> std::io::Result<()> {
    let text = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(text.as_bytes()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_granted_destination_is_tunnelled_and_a_refused_one_never_reached() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("proxy.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let target = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let granted = target.local_addr().unwrap();
        let check: EgressCheck = Arc::new(move |host: &str, port: u16| {
            if host == "granted.test" && port == granted.port() {
                Ok(vec![granted])
            } else {
                Err("not granted".to_string())
            }
        });
        let (report, mut refusals) = Reporter::new();
        let count = report.count.clone();
        tokio::spawn(serve(listener, check, report));
        tokio::spawn(async move {
            let (mut s, _) = target.accept().await.unwrap();
            let mut buf = [0u8; 5];
            s.read_exact(&mut buf).await.unwrap();
            s.write_all(&buf).await.unwrap();
        });
        let mut c = tokio::net::UnixStream::connect(&path).await.unwrap();
        c.write_all(
            format!(
                "CONNECT granted.test:{} HTTP/1.1\r\n\r\nhello",
                granted.port()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        let mut got = vec![0u8; 39 + 5];
        c.read_exact(&mut got).await.unwrap();
        assert_eq!(
            String::from_utf8_lossy(&got),
            "HTTP/1.1 200 Connection Established\r\n\r\nhello"
        );
        let mut c = tokio::net::UnixStream::connect(&path).await.unwrap();
        c.write_all(b"CONNECT other.test:443 HTTP/1.1\r\n\r\n")
            .await
            .unwrap();
        let mut answer = String::new();
        c.read_to_string(&mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 403 Forbidden"), "{answer}");
        assert!(
            answer.contains("egress to other.test:443 refused: not granted"),
            "{answer}"
        );
        assert_eq!(
            refusals.recv().await.unwrap(),
            Refused {
                host: "other.test".into(),
                port: 443,
                reason: "not granted".into(),
                count: 1,
            }
        );
        assert_eq!(count.load(Ordering::Relaxed), 1);
    }

    /// What the proxy answers on `c` within 5 s (a proxy that keeps waiting fails here),
    /// and how the reading ended when not at end of stream.
    async fn answer_within(c: &mut tokio::net::UnixStream) -> String {
        let mut got = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut got))
            .await
            .expect("the proxy answers within 5 s instead of waiting for more");
        let mut answer = String::from_utf8_lossy(&got).into_owned();
        if let Err(e) = read {
            answer.push_str(&format!(" (then: {e})"));
        }
        answer
    }

    #[tokio::test]
    async fn a_head_without_end_and_one_connection_too_many_are_answered_not_held() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("proxy.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let check: EgressCheck = Arc::new(|_: &str, _: u16| Err("not granted".to_string()));
        let (report, _refusals) = Reporter::new();
        tokio::spawn(serve(listener, check, report));
        // A head that never ends is cut at MAX_HEAD: the host's memory is not the server's.
        let mut c = tokio::net::UnixStream::connect(&path).await.unwrap();
        let mut endless = b"CONNECT api.example.com:443 HTTP/1.1\r\nX-Pad: ".to_vec();
        // One byte more than MAX_HEAD: all of it is read before the answer (unread bytes
        // would turn the close into a reset).
        endless.resize(MAX_HEAD + 1, b'a');
        c.write_all(&endless).await.unwrap();
        let answer = answer_within(&mut c).await;
        assert!(
            answer.starts_with("HTTP/1.1 431 Request Header Fields Too Large"),
            "{answer:?}"
        );
        // MAX_TUNNELS connections held open (no head yet): one more is turned away at once.
        let mut held = Vec::new();
        for _ in 0..MAX_TUNNELS {
            held.push(tokio::net::UnixStream::connect(&path).await.unwrap());
        }
        let mut extra = tokio::net::UnixStream::connect(&path).await.unwrap();
        let answer = answer_within(&mut extra).await;
        assert!(
            answer.starts_with("HTTP/1.1 503 Service Unavailable")
                && answer.contains(&format!("at most {MAX_TUNNELS} proxy connections")),
            "{answer:?}"
        );
        // A connection that ends frees its place (once the proxy has seen it end).
        drop(held.pop());
        let mut answer = String::new();
        for _ in 0..50 {
            let mut next = tokio::net::UnixStream::connect(&path).await.unwrap();
            // A connection turned away may be closed before its head is written.
            let _ = next
                .write_all(b"CONNECT other.test:443 HTTP/1.1\r\n\r\n")
                .await;
            answer = answer_within(&mut next).await;
            if !answer.starts_with("HTTP/1.1 503") && !answer.contains("(then: ") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(answer.starts_with("HTTP/1.1 403 Forbidden"), "{answer:?}");
    }

    #[test]
    fn a_repeated_destination_cannot_crowd_out_another() {
        let (report, mut refusals) = Reporter::new();
        for _ in 0..1000 {
            report.refused("decoy.example".into(), 1, "not granted".into());
        }
        report.refused("hidden.example".into(), 443, "not granted".into());
        for i in 0..100 {
            report.refused(format!("n{i}.example"), 443, "not granted".into());
        }
        let mut got = Vec::new();
        while let Ok(r) = refusals.try_recv() {
            got.push((r.host, r.count));
        }
        assert_eq!(got.len(), MAX_REPORTED);
        assert_eq!(got[0], ("decoy.example".to_string(), 1));
        assert_eq!(got[1], ("hidden.example".to_string(), 1001));
        assert_eq!(report.count(), 1101);
    }

    #[test]
    fn the_check_honours_addresses_names_and_the_special_ranges() {
        let grants = |list: &[&str]| {
            check_for(
                list.iter()
                    .map(|g| Destination::parse(g).unwrap())
                    .collect(),
            )
        };
        let check = grants(&["127.0.0.1:8080", "10.0.0.0/8:443", "localhost:9000"]);
        assert_eq!(
            check("127.0.0.1", 8080).unwrap(),
            vec!["127.0.0.1:8080".parse().unwrap()]
        );
        assert_eq!(check("10.1.2.3", 443).unwrap().len(), 1);
        assert!(
            check("127.0.0.1", 8081)
                .unwrap_err()
                .contains("not granted")
        );
        assert!(check("::1", 8080).unwrap_err().contains("not granted"));
        // A name not granted is not even resolved.
        let e = check("localhost", 8080).unwrap_err();
        assert!(e.contains("not resolved"), "{e}");
        // A granted name that resolves to loopback only grants nothing...
        let e = check("localhost", 9000).unwrap_err();
        assert!(e.contains("need a grant by address"), "{e}");
        // ...unless the address is granted too.
        let check = grants(&["localhost:9000", "127.0.0.1:9000"]);
        assert!(
            check("localhost", 9000)
                .unwrap()
                .contains(&"127.0.0.1:9000".parse().unwrap())
        );
    }

    #[test]
    fn heads_parse_into_a_tunnel_or_a_forward_and_hostile_ones_fail() {
        assert_eq!(
            parse(b"CONNECT api.example.com:443 HTTP/1.1\r\nHost: x\r\n\r\n").unwrap(),
            Ask::Tunnel {
                host: "api.example.com".into(),
                port: 443
            }
        );
        let Ask::Forward { host, port, head } =
            parse(b"GET http://Example.com/a?b HTTP/1.1\r\nHost: example.com\r\nProxy-Authorization: x\r\n\r\n")
                .unwrap()
        else {
            panic!("not a forward");
        };
        assert_eq!((host.as_str(), port), ("example.com", 80));
        assert_eq!(
            String::from_utf8(head).unwrap(),
            "GET /a?b HTTP/1.1\r\nHost: example.com\r\n\r\n"
        );
        for bad in [
            &b"CONNECT api.example.com HTTP/1.1\r\n\r\n"[..],
            b"CONNECT user@host:443 HTTP/1.1\r\n\r\n",
            b"CONNECT host:0 HTTP/1.1\r\n\r\n",
            b"CONNECT host:+443 HTTP/1.1\r\n\r\n",
            b"CONNECT host:99999 HTTP/1.1\r\n\r\n",
            b"GET https://example.com/ HTTP/1.1\r\n\r\n",
            b"GET /relative HTTP/1.1\r\n\r\n",
            b"GET  http://x/ HTTP/1.1\r\n\r\n",
            b"GET http://x/ SPDY/3\r\n\r\n",
            b"\xff\xfe\r\n\r\n",
        ] {
            assert!(parse(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        assert_eq!(
            parse(b"CONNECT [::1]:8443 HTTP/1.1\r\n\r\n").unwrap(),
            Ask::Tunnel {
                host: "::1".into(),
                port: 8443
            }
        );
    }
}
