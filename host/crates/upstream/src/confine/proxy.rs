//! The egress proxy of a confined server (not wired yet: issue 36, item 3).
//!
//! Rule: a confined server reaches the network only through this proxy, and the proxy
//! reaches only destinations its check allows — the same check as an adapter's sockets
//! (a named host resolved, each address checked again; loopback, link-local, metadata and
//! private ranges refused unless granted explicitly). It speaks HTTP/1.1 `CONNECT
//! host:port` (for TLS) and absolute-form requests (`GET http://host/…`, rewritten to
//! origin-form). Every refused destination is answered `403` with the reason and reported
//! as a [`Refused`]; nothing is sent toward a refused destination.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

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
}

/// Largest request head read (bytes).
const MAX_HEAD: usize = 16 * 1024;

/// Serves proxy connections from `listener` until it fails.
pub async fn serve(
    listener: tokio::net::UnixListener,
    check: EgressCheck,
    refusals: tokio::sync::mpsc::UnboundedSender<Refused>,
) {
    while let Ok((stream, _)) = listener.accept().await {
        let (check, refusals) = (check.clone(), refusals.clone());
        tokio::spawn(async move {
            if let Err(e) = one(stream, check, refusals).await {
                tracing::debug!("egress proxy connection ended: {e}");
            }
        });
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
    refusals: tokio::sync::mpsc::UnboundedSender<Refused>,
) -> std::io::Result<()> {
    let mut head = Vec::new();
    let mut buf = [0u8; 2048];
    let end = loop {
        let n = stream.read(&mut buf).await?;
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
            let _ = refusals.send(Refused {
                host: host.clone(),
                port,
                reason: reason.clone(),
            });
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
        let (tx, mut refusals) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(serve(listener, check, tx));
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
                reason: "not granted".into()
            }
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
