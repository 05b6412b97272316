//! The address policy: which hosts and addresses a fetch may reach, and DNS pinning.
//!
//! Hosts that resolve to loopback, private, link-local or other non-public addresses are
//! refused unless listed in [`FetchPolicy::allowed_domains`]. The connection then goes to the
//! very addresses that were checked ([`PinnedResolver`]), so a DNS answer that changes between
//! check and connect cannot reach a forbidden address.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};

use ureq::http::Uri;
use ureq::unversioned::resolver::{ResolvedSocketAddrs, Resolver};
use ureq::unversioned::transport::NextTimeout;

use super::{FetchError, FetchPolicy};

/// A host name or IP literal as the checks compare it: trimmed, lower-case, without IPv6
/// brackets or a trailing dot.
pub(super) fn normalize_host(host: &str) -> String {
    host.trim()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .trim_end_matches('.')
        .to_ascii_lowercase()
}

/// The addresses the connection to `host:port` must use. Hosts not in the allowed domains
/// are refused when any address is non-public. Through a proxy nothing is pinned (the proxy
/// connects), but a name that resolves locally to a forbidden address is still refused.
pub(super) fn addresses_to_pin(
    host: &str,
    port: u16,
    policy: &FetchPolicy,
    proxied: bool,
) -> Result<Vec<SocketAddr>, FetchError> {
    let allowed = policy
        .allowed_domains
        .iter()
        .any(|d| normalize_host(d) == host);
    if proxied {
        if !allowed {
            if let Ok(addrs) = resolve(host, port) {
                check_public(host, &addrs)?;
            }
        }
        return Ok(Vec::new());
    }
    let addrs = resolve(host, port)?;
    if !allowed {
        check_public(host, &addrs)?;
    }
    Ok(addrs)
}

fn resolve(host: &str, port: u16) -> Result<Vec<SocketAddr>, FetchError> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let err = |reason: String| FetchError::Resolve {
        host: host.to_string(),
        reason,
    };
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| err(e.to_string()))?
        .collect();
    if addrs.is_empty() {
        return Err(err("no addresses".to_string()));
    }
    Ok(addrs)
}

/// Refuses the host when any of its addresses is non-public: a name that answers with both
/// kinds must not be a way in.
fn check_public(host: &str, addrs: &[SocketAddr]) -> Result<(), FetchError> {
    match addrs.iter().find(|a| is_forbidden_ip(a.ip())) {
        Some(bad) => Err(FetchError::ForbiddenAddress {
            host: host.to_string(),
            addr: bad.ip(),
        }),
        None => Ok(()),
    }
}

/// Loopback, private, carrier-grade NAT, link-local, unique-local, unspecified, multicast,
/// broadcast and reserved ranges, including IPv4 addresses embedded in IPv6 (mapped,
/// compatible, NAT64 `64:ff9b::/96`, 6to4 `2002::/16`).
pub fn is_forbidden_ip(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_forbidden_v4(v4),
        IpAddr::V6(v6) => match embedded_ipv4(v6) {
            Some(v4) => is_forbidden_v4(v4),
            None => is_forbidden_v6(v6),
        },
    }
}

fn embedded_ipv4(ip: Ipv6Addr) -> Option<Ipv4Addr> {
    let o = ip.octets();
    if let Some(v4) = ip.to_ipv4() {
        Some(v4) // ::a.b.c.d and ::ffff:a.b.c.d
    } else if ip.segments()[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        Some(Ipv4Addr::new(o[12], o[13], o[14], o[15])) // NAT64: the last 32 bits
    } else if ip.segments()[0] == 0x2002 {
        Some(Ipv4Addr::new(o[2], o[3], o[4], o[5])) // 6to4: bits 16..48
    } else {
        None
    }
}

fn is_forbidden_v4(ip: Ipv4Addr) -> bool {
    let [a, b, ..] = ip.octets();
    a == 0
        || a == 10
        || a == 127
        || (a == 100 && (64..128).contains(&b))
        || (a == 169 && b == 254)
        || (a == 172 && (16..32).contains(&b))
        || (a == 192 && b == 168)
        || a >= 224 // multicast, reserved and broadcast
}

fn is_forbidden_v6(ip: Ipv6Addr) -> bool {
    let first = ip.segments()[0];
    ip.is_loopback()
        || ip.is_unspecified()
        || ip.is_multicast()
        || (first & 0xfe00) == 0xfc00 // unique local fc00::/7
        || (first & 0xffc0) == 0xfe80 // link local fe80::/10
}

/// ureq keeps at most this many addresses per name.
const MAX_RESOLVED: usize = 16;

/// Hands ureq the addresses already checked for the target; other names (the proxy) resolve
/// normally.
#[derive(Debug)]
pub(super) struct PinnedResolver {
    host: String,
    addrs: Vec<SocketAddr>,
}

impl PinnedResolver {
    /// `host` as [`normalize_host`] gives it; no addresses: `host` resolves normally too.
    pub(super) fn new(host: String, addrs: Vec<SocketAddr>) -> Self {
        Self { host, addrs }
    }
}

impl Resolver for PinnedResolver {
    fn resolve(
        &self,
        uri: &Uri,
        _config: &ureq::config::Config,
        _timeout: NextTimeout,
    ) -> Result<ResolvedSocketAddrs, ureq::Error> {
        let host = uri.host().map(normalize_host).unwrap_or_default();
        let mut out = self.empty();
        if host == self.host && !self.addrs.is_empty() {
            self.addrs
                .iter()
                .take(MAX_RESOLVED)
                .for_each(|a| out.push(*a));
        } else {
            let port = uri
                .port_u16()
                .unwrap_or(if uri.scheme_str() == Some("https") {
                    443
                } else {
                    80
                });
            (host.as_str(), port)
                .to_socket_addrs()?
                .take(MAX_RESOLVED)
                .for_each(|a| out.push(a));
        }
        if out.is_empty() {
            return Err(ureq::Error::HostNotFound);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forbidden_ranges() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "224.0.0.1",
            "255.255.255.255",
            "::1",
            "::",
            "fc00::1",
            "fd12::1",
            "fe80::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            "::ffff:169.254.169.254",
            "::127.0.0.1",
            "64:ff9b::a00:1",
            "2002:c0a8:101::1",
        ] {
            assert!(is_forbidden_ip(ip.parse().unwrap()), "{ip}");
        }
        for ip in [
            "8.8.8.8",
            "172.15.0.1",
            "172.32.0.1",
            "100.128.0.1",
            "2606:4700::1111",
            "::ffff:8.8.8.8",
            "64:ff9b::808:808",
            "2002:808:808::1",
        ] {
            assert!(!is_forbidden_ip(ip.parse().unwrap()), "{ip}");
        }
    }
}
