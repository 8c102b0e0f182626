//! Network destinations as grants name them, and the address ranges a named host may not
//! resolve to without an explicit grant.
//!
//! Rule: one grammar for every network grant Airlock reads — a mapping's
//! `[grants.network]` (checked at the adapter's sockets) and a confined server's
//! `[connection.grants.network]` (checked by its egress proxy): `ADDRESS:PORT`,
//! `[IPV6]:PORT`, `NETWORK/PREFIX:PORT` or `NAME:PORT`, port 1-65535. A named host grants
//! its public addresses only: loopback, private, link-local (the 169.254.169.254 cloud
//! metadata service among them), unique-local, multicast and the other ranges of
//! [`is_special`] need an explicit grant by address or network.

use std::net::{IpAddr, SocketAddr};

use anyhow::{Context as _, Result, bail};

/// A network destination a grant names: an address or network and a port, or a DNS name
/// and a port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    /// A network (an address is a /32 or /128) and a port.
    Network {
        network: IpAddr,
        prefix: u8,
        port: u16,
    },
    /// A DNS name and a port; resolved when a call starts.
    Named { host: String, port: u16 },
}

impl std::fmt::Display for Destination {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Network {
                network: IpAddr::V4(a),
                prefix: 32,
                port,
            } => write!(f, "{a}:{port}"),
            Self::Network {
                network: IpAddr::V6(a),
                prefix: 128,
                port,
            } => write!(f, "[{a}]:{port}"),
            Self::Network {
                network,
                prefix,
                port,
            } => write!(f, "{network}/{prefix}:{port}"),
            Self::Named { host, port } => write!(f, "{host}:{port}"),
        }
    }
}

impl Destination {
    /// Parses one network grant entry (see the module table).
    ///
    /// # Errors
    /// Anything else: no port, port 0, a bad address or prefix, a malformed name.
    pub fn parse(entry: &str) -> Result<Self> {
        let (host, port) = entry
            .rsplit_once(':')
            .with_context(|| format!("`{entry}` has no port; write HOST:PORT"))?;
        let port: u16 = port
            .parse()
            .ok()
            .filter(|p| *p != 0)
            .with_context(|| format!("`{entry}`: the port must be 1-65535"))?;
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        if let Some((net, prefix)) = host.split_once('/') {
            let network: IpAddr = net
                .parse()
                .with_context(|| format!("`{entry}`: `{net}` is not an IP address"))?;
            let max = if network.is_ipv4() { 32 } else { 128 };
            let prefix: u8 = prefix
                .parse()
                .ok()
                .filter(|p| *p <= max)
                .with_context(|| format!("`{entry}`: the prefix length must be 0-{max}"))?;
            return Ok(Self::Network {
                network: mask(network, prefix),
                prefix,
                port,
            });
        }
        if let Ok(ip) = host.parse::<IpAddr>() {
            let prefix = if ip.is_ipv4() { 32 } else { 128 };
            return Ok(Self::Network {
                network: ip,
                prefix,
                port,
            });
        }
        let valid_name = !host.is_empty()
            && host.len() <= 253
            && host.split('.').all(|label| {
                !label.is_empty()
                    && label.len() <= 63
                    && label
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-')
                    && !label.starts_with('-')
                    && !label.ends_with('-')
            });
        if !valid_name {
            bail!("`{entry}`: `{host}` is not an IP address, CIDR network or DNS name");
        }
        Ok(Self::Named {
            host: host.to_ascii_lowercase(),
            port,
        })
    }

    /// Whether `addr` is inside this destination's network and port (named hosts never
    /// match directly: they are resolved first).
    pub fn contains(&self, addr: SocketAddr) -> bool {
        match self {
            Self::Network {
                network,
                prefix,
                port,
            } => {
                *port == addr.port()
                    && same_family(*network, addr.ip())
                    && mask(addr.ip(), *prefix) == *network
            }
            Self::Named { .. } => false,
        }
    }
}

fn same_family(a: IpAddr, b: IpAddr) -> bool {
    a.is_ipv4() == b.is_ipv4()
}

fn mask(ip: IpAddr, prefix: u8) -> IpAddr {
    match ip {
        IpAddr::V4(a) => {
            let bits = u32::from(a);
            let m = if prefix == 0 {
                0
            } else {
                u32::MAX << (32 - u32::from(prefix))
            };
            IpAddr::V4((bits & m).into())
        }
        IpAddr::V6(a) => {
            let bits = u128::from(a);
            let m = if prefix == 0 {
                0
            } else {
                u128::MAX << (128 - u32::from(prefix))
            };
            IpAddr::V6((bits & m).into())
        }
    }
}

/// Whether `ip` is an address a named host may not resolve to without an explicit grant:
/// loopback, unspecified, private (RFC 1918), carrier-grade NAT (RFC 6598), link-local
/// (RFC 3927, which holds the 169.254.169.254 metadata service), unique-local (RFC 4193),
/// IPv6 link-local and site-local, multicast, broadcast, documentation and benchmarking
/// ranges, IPv4-mapped and NAT64 (`64:ff9b::/96`) forms of all of these, and the local-use
/// NAT64 prefix `64:ff9b:1::/48`.
pub fn is_special(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(a) => {
            let o = a.octets();
            a.is_loopback()
                || a.is_unspecified()
                || a.is_private()
                || a.is_link_local()
                || a.is_multicast()
                || a.is_broadcast()
                || a.is_documentation()
                || (o[0] == 100 && (o[1] & 0xc0) == 64)
                || (o[0] == 198 && (o[1] & 0xfe) == 18)
                || o[0] == 0
                || o[0] >= 240
        }
        IpAddr::V6(a) => {
            if let Some(v4) = a.to_ipv4_mapped() {
                return is_special(IpAddr::V4(v4));
            }
            let s = a.segments();
            // NAT64 (RFC 6052 well-known 64:ff9b::/96; RFC 8215 local-use 64:ff9b:1::/48):
            // a translator would reach the IPv4 address inside; the local-use prefix is
            // special whatever it embeds.
            if s[0] == 0x64 && s[1] == 0xff9b {
                if s[2..6] == [0, 0, 0, 0] {
                    let o = a.octets();
                    return is_special(IpAddr::V4([o[12], o[13], o[14], o[15]].into()));
                }
                if s[2] == 1 {
                    return true;
                }
            }
            a.is_loopback()
                || a.is_unspecified()
                || a.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00
                || (s[0] & 0xffc0) == 0xfe80
                || (s[0] & 0xffc0) == 0xfec0
                || (s[0] == 0x2001 && s[1] == 0x0db8)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destinations_parse_in_the_documented_forms() {
        assert_eq!(
            Destination::parse("203.0.113.7:443").unwrap().to_string(),
            "203.0.113.7:443"
        );
        assert_eq!(
            Destination::parse("[2001:db8::1]:443").unwrap().to_string(),
            "[2001:db8::1]:443"
        );
        assert_eq!(
            Destination::parse("10.1.2.3/8:80").unwrap().to_string(),
            "10.0.0.0/8:80"
        );
        assert_eq!(
            Destination::parse("API.Example.com:443")
                .unwrap()
                .to_string(),
            "api.example.com:443"
        );
        for bad in [
            "example.com",
            "1.2.3.4:0",
            "1.2.3.4:70000",
            "1.2.3.4/33:1",
            "bad host:1",
            "-x.com:1",
            ":80",
            "a..b:1",
            "[::1:80",
        ] {
            assert!(Destination::parse(bad).is_err(), "{bad} must be refused");
        }
    }

    #[test]
    fn special_ranges_are_recognised() {
        for ip in [
            "127.0.0.1",
            "10.0.0.1",
            "172.16.5.4",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "::1",
            "fe80::1",
            "fd00::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "224.0.0.1",
            "64:ff9b::7f00:1",
            "64:ff9b::a9fe:a9fe",
            "64:ff9b:1::808:808",
            "fec0::1",
        ] {
            assert!(is_special(ip.parse().unwrap()), "{ip}");
        }
        for ip in [
            "93.184.216.34",
            "2606:4700::1111",
            "8.8.8.8",
            "64:ff9b::808:808",
        ] {
            assert!(!is_special(ip.parse().unwrap()), "{ip}");
        }
    }
}
