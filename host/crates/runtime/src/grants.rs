//! Grants: what an adapter may touch beyond the host API. Deny by default.
//!
//! Rule: an adapter gets nothing it was not granted in its reviewed mapping. An empty or
//! absent `[grants]` table means no preopened folder, no socket, no name lookup and no
//! environment variable. Every grant is checked when the mapping loads (folders exist and
//! are canonicalized; addresses parse) and enforced by the runtime at the lowest layer
//! wasmtime offers: preopens (cap-std, so `..` and symlinks cannot escape), and
//! `socket_addr_check` for every socket use, after name resolution.
//!
//! Accepted forms:
//!
//! | key | form | meaning |
//! |---|---|---|
//! | `[[grants.filesystem]]` | `host = "data"`, `guest = "/data"`, `access = "read-only"` or `"read-write"` | preopen the host folder (relative to the manifest) at the guest path |
//! | `[grants.network] tcp_connect` | `"203.0.113.7:443"`, `"[2001:db8::1]:443"`, `"203.0.113.0/24:443"`, `"api.example.com:443"` | TCP connections to that address, network, or named host, on that port |
//! | `[grants.network] udp_send` | same forms | UDP datagrams to those destinations (and the implicit bind that sending needs) |
//! | `[grants.network] tcp_listen` | `"127.0.0.1:9000"` | bind and listen on exactly that local address |
//! | `[grants.env]` | `NAME = "value"` or `NAME = { secret = "secret-name" }` | one environment variable, given or read from the host's named secrets |
//!
//! An empty list denies everything of its kind. A named host is resolved when a call
//! starts; its addresses are allowed only when they are public: a name that resolves to a
//! loopback, private, link-local (including the 169.254.169.254 cloud metadata service),
//! unique-local, multicast or unspecified address is refused unless that address is also
//! granted explicitly, by IP or CIDR. Name lookup inside the adapter is switched on only
//! when at least one named host is granted, and then resolves only the granted names
//! (any other name fails with `access-denied` before a query is made; IP literals are
//! returned as given). Every address is checked again when a socket uses it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

pub use airlock_core::destination::{Destination, is_special};
use anyhow::{Context as _, Result, bail};
use serde::Deserialize;

/// The `[grants]` table of a mapping manifest, as written.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct GrantsSection {
    /// Preopened folders.
    #[serde(default)]
    pub filesystem: Vec<FilesystemGrant>,
    /// Socket destinations.
    #[serde(default)]
    pub network: NetworkSection,
    /// Environment variables.
    #[serde(default)]
    pub env: BTreeMap<String, EnvValue>,
}

/// One `[[grants.filesystem]]` entry.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct FilesystemGrant {
    /// Host folder, relative to the manifest's folder. Canonicalized at load.
    pub host: PathBuf,
    /// Absolute guest path at which it appears, e.g. `/data`.
    pub guest: String,
    /// What the adapter may do there.
    pub access: Access,
}

/// Filesystem access level.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Access {
    ReadOnly,
    ReadWrite,
}

/// `[grants.network]`.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NetworkSection {
    #[serde(default)]
    pub tcp_connect: Vec<String>,
    #[serde(default)]
    pub udp_send: Vec<String>,
    #[serde(default)]
    pub tcp_listen: Vec<String>,
}

/// One `[grants.env]` value.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(untagged, deny_unknown_fields)]
pub enum EnvValue {
    /// A literal value.
    Value(String),
    /// A named secret from the host's secret table.
    Secret { secret: String },
}

/// How a socket address is being used (mirrors `wasmtime_wasi::sockets::SocketAddrUse`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketUse {
    TcpBind,
    TcpListen,
    TcpAccept,
    TcpConnect,
    UdpBind,
    UdpSend,
    /// Receiving a datagram from a remote address: allowed only from send destinations.
    UdpReceive,
}

/// The network grants of one call, with named hosts already resolved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NetworkPolicy {
    /// TCP connect destinations (explicit networks).
    pub tcp_connect: Vec<Destination>,
    /// UDP send destinations (explicit networks).
    pub udp_send: Vec<Destination>,
    /// TCP listen addresses.
    pub tcp_listen: Vec<Destination>,
    /// Addresses named hosts resolved to, already filtered by [`is_special`].
    pub resolved_tcp: Vec<SocketAddr>,
    pub resolved_udp: Vec<SocketAddr>,
}

impl NetworkPolicy {
    /// Whether the adapter may use `addr` this way. An unlisted use is refused.
    pub fn permits(&self, addr: SocketAddr, use_: SocketUse) -> bool {
        let explicit = |list: &[Destination]| list.iter().any(|d| d.contains(addr));
        match use_ {
            SocketUse::TcpConnect => {
                explicit(&self.tcp_connect) || self.resolved_tcp.contains(&addr)
            }
            // Connecting binds implicitly to the wildcard address; allowed when the
            // adapter may connect anywhere (the destination is checked on connect).
            SocketUse::TcpBind => {
                (addr.ip().is_unspecified()
                    && addr.port() == 0
                    && !(self.tcp_connect.is_empty() && self.resolved_tcp.is_empty()))
                    || explicit(&self.tcp_listen)
            }
            SocketUse::TcpListen | SocketUse::TcpAccept => {
                explicit(&self.tcp_listen) && use_ == SocketUse::TcpListen
            }
            SocketUse::UdpBind => {
                addr.ip().is_unspecified()
                    && addr.port() == 0
                    && !(self.udp_send.is_empty() && self.resolved_udp.is_empty())
            }
            SocketUse::UdpSend | SocketUse::UdpReceive => {
                explicit(&self.udp_send) || self.resolved_udp.contains(&addr)
            }
        }
    }

    /// Whether any TCP use is granted.
    pub fn permits_any_tcp(&self) -> bool {
        !(self.tcp_connect.is_empty() && self.resolved_tcp.is_empty() && self.tcp_listen.is_empty())
    }

    /// Whether any UDP use is granted.
    pub fn permits_any_udp(&self) -> bool {
        !(self.udp_send.is_empty() && self.resolved_udp.is_empty())
    }

    /// Whether any socket use at all is granted.
    pub fn any(&self) -> bool {
        !(self.tcp_connect.is_empty()
            && self.udp_send.is_empty()
            && self.tcp_listen.is_empty()
            && self.resolved_tcp.is_empty()
            && self.resolved_udp.is_empty())
    }
}

/// A mapping's grants, validated and resolved against the manifest's folder.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Grants {
    /// (canonical host folder, guest path, access).
    pub filesystem: Vec<(PathBuf, String, Access)>,
    pub tcp_connect: Vec<Destination>,
    pub udp_send: Vec<Destination>,
    pub tcp_listen: Vec<Destination>,
    /// Environment: literal values and secret names (resolved per host).
    pub env: BTreeMap<String, EnvValue>,
}

impl Grants {
    /// Validates `section`; relative host folders resolve against `base`.
    ///
    /// # Errors
    /// A missing or non-folder host path, a guest path that is not absolute or repeats,
    /// a bad network entry, a listen grant that is not an exact address, a bad variable
    /// name.
    pub fn resolve(section: &GrantsSection, base: Option<&Path>) -> Result<Self> {
        let mut filesystem = Vec::new();
        for g in &section.filesystem {
            let host = match base {
                Some(b) => b.join(&g.host),
                None => g.host.clone(),
            };
            let canonical = host.canonicalize().with_context(|| {
                format!(
                    "filesystem grant: host folder {} does not exist",
                    host.display()
                )
            })?;
            if !canonical.is_dir() {
                bail!("filesystem grant: {} is not a folder", canonical.display());
            }
            if !g.guest.starts_with('/') || g.guest.split('/').any(|c| c == ".." || c == ".") {
                bail!(
                    "filesystem grant: guest path `{}` must be absolute, without `.` or `..`",
                    g.guest
                );
            }
            if filesystem.iter().any(|(_, guest, _)| guest == &g.guest) {
                bail!(
                    "filesystem grant: guest path `{}` is granted twice",
                    g.guest
                );
            }
            filesystem.push((canonical, g.guest.clone(), g.access));
        }
        let parse = |list: &[String], what: &str| -> Result<Vec<Destination>> {
            list.iter()
                .map(|e| Destination::parse(e).with_context(|| format!("network grant {what}")))
                .collect()
        };
        let tcp_listen = parse(&section.network.tcp_listen, "tcp_listen")?;
        for d in &tcp_listen {
            if !matches!(
                d,
                Destination::Network {
                    prefix: 32 | 128,
                    ..
                }
            ) {
                bail!("network grant tcp_listen: `{d}` must be one exact IP address and port");
            }
        }
        for name in section.env.keys() {
            if name.is_empty() || name.contains('=') || name.contains('\0') {
                bail!("env grant: `{name}` is not a valid variable name");
            }
        }
        Ok(Self {
            filesystem,
            tcp_connect: parse(&section.network.tcp_connect, "tcp_connect")?,
            udp_send: parse(&section.network.udp_send, "udp_send")?,
            tcp_listen,
            env: section.env.clone(),
        })
    }

    /// The granted host names (lowercase, no trailing dot): the only names an adapter may
    /// resolve.
    pub fn named_hosts(&self) -> BTreeSet<String> {
        self.tcp_connect
            .iter()
            .chain(&self.udp_send)
            .filter_map(|d| match d {
                Destination::Named { host, .. } => {
                    Some(host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase())
                }
                Destination::Network { .. } => None,
            })
            .collect()
    }

    /// Whether any named host is granted (name lookup is enabled only then).
    pub fn has_named_hosts(&self) -> bool {
        self.tcp_connect
            .iter()
            .chain(&self.udp_send)
            .any(|d| matches!(d, Destination::Named { .. }))
    }

    /// Resolves named hosts and builds the policy for one call. A name that resolves to a
    /// special address (see [`is_special`]) keeps that address out unless it is granted
    /// explicitly; a name that does not resolve grants nothing.
    pub async fn network_policy(&self) -> NetworkPolicy {
        async fn resolve(list: &[Destination]) -> Vec<SocketAddr> {
            let mut out = Vec::new();
            for d in list {
                if let Destination::Named { host, port } = d {
                    match tokio::net::lookup_host((host.as_str(), *port)).await {
                        Ok(addrs) => out.extend(addrs.filter(|a| !is_special(a.ip()))),
                        Err(e) => tracing::warn!(host = %host, "granted host did not resolve: {e}"),
                    }
                }
            }
            out
        }
        let explicit = |list: &[Destination]| -> Vec<Destination> {
            list.iter()
                .filter(|d| matches!(d, Destination::Network { .. }))
                .cloned()
                .collect()
        };
        NetworkPolicy {
            tcp_connect: explicit(&self.tcp_connect),
            udp_send: explicit(&self.udp_send),
            tcp_listen: self.tcp_listen.clone(),
            resolved_tcp: resolve(&self.tcp_connect).await,
            resolved_udp: resolve(&self.udp_send).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn an_empty_policy_denies_every_socket_use() {
        let p = NetworkPolicy::default();
        for use_ in [
            SocketUse::TcpConnect,
            SocketUse::TcpBind,
            SocketUse::TcpListen,
            SocketUse::UdpBind,
            SocketUse::UdpSend,
        ] {
            assert!(!p.permits(addr("127.0.0.1:80"), use_));
            assert!(!p.permits(addr("0.0.0.0:0"), use_));
        }
        assert!(!p.any());
    }

    #[test]
    fn a_granted_port_is_reachable_and_its_neighbour_is_not() {
        let p = NetworkPolicy {
            tcp_connect: vec![Destination::parse("127.0.0.1:8080").unwrap()],
            ..Default::default()
        };
        assert!(p.permits(addr("127.0.0.1:8080"), SocketUse::TcpConnect));
        assert!(!p.permits(addr("127.0.0.1:8081"), SocketUse::TcpConnect));
        assert!(!p.permits(addr("127.0.0.2:8080"), SocketUse::TcpConnect));
        assert!(!p.permits(addr("[::1]:8080"), SocketUse::TcpConnect));
        assert!(
            p.permits(addr("0.0.0.0:0"), SocketUse::TcpBind),
            "implicit bind before connect"
        );
        assert!(
            !p.permits(addr("0.0.0.0:8080"), SocketUse::TcpBind),
            "no explicit bind"
        );
        assert!(!p.permits(addr("127.0.0.1:8080"), SocketUse::TcpListen));
        assert!(
            !p.permits(addr("127.0.0.1:8080"), SocketUse::UdpSend),
            "TCP grant is not a UDP grant"
        );
        assert!(!p.permits(addr("0.0.0.0:0"), SocketUse::UdpBind));
    }

    #[test]
    fn cidr_grants_cover_their_network_only() {
        let p = NetworkPolicy {
            udp_send: vec![Destination::parse("192.0.2.0/24:53").unwrap()],
            ..Default::default()
        };
        assert!(p.permits(addr("192.0.2.77:53"), SocketUse::UdpSend));
        assert!(!p.permits(addr("192.0.3.1:53"), SocketUse::UdpSend));
        assert!(p.permits(addr("0.0.0.0:0"), SocketUse::UdpBind));
    }

    #[tokio::test]
    async fn a_named_host_resolving_to_loopback_grants_nothing() {
        let grants = Grants {
            tcp_connect: vec![Destination::parse("localhost:8080").unwrap()],
            ..Default::default()
        };
        assert!(grants.has_named_hosts());
        let p = grants.network_policy().await;
        assert!(p.resolved_tcp.is_empty(), "{p:?}");
        assert!(!p.permits(addr("127.0.0.1:8080"), SocketUse::TcpConnect));
        let explicit = Grants {
            tcp_connect: vec![
                Destination::parse("localhost:8080").unwrap(),
                Destination::parse("127.0.0.1:8080").unwrap(),
            ],
            ..Default::default()
        };
        assert!(
            explicit
                .network_policy()
                .await
                .permits(addr("127.0.0.1:8080"), SocketUse::TcpConnect)
        );
    }

    #[test]
    fn filesystem_grants_are_canonicalized_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("data")).unwrap();
        let ok = GrantsSection {
            filesystem: vec![FilesystemGrant {
                host: "data".into(),
                guest: "/data".into(),
                access: Access::ReadOnly,
            }],
            ..Default::default()
        };
        let g = Grants::resolve(&ok, Some(dir.path())).unwrap();
        assert_eq!(
            g.filesystem[0].0,
            dir.path().join("data").canonicalize().unwrap()
        );
        for (host, guest, needle) in [
            ("missing", "/data", "does not exist"),
            ("data", "data", "absolute"),
            ("data", "/a/../b", "absolute"),
        ] {
            let bad = GrantsSection {
                filesystem: vec![FilesystemGrant {
                    host: host.into(),
                    guest: guest.into(),
                    access: Access::ReadWrite,
                }],
                ..Default::default()
            };
            let err = format!("{:#}", Grants::resolve(&bad, Some(dir.path())).unwrap_err());
            assert!(err.contains(needle), "{err}");
        }
    }
}
