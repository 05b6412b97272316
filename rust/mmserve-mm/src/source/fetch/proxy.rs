//! Proxies from the environment: `HTTP_PROXY`, `HTTPS_PROXY`, `ALL_PROXY` and `NO_PROXY`
//! (host names, IP literals, CIDR blocks, each with an optional port).

use std::net::IpAddr;

use ureq::Proxy;

use super::address::normalize_host;
use super::http::Target;
use super::FetchError;

/// Proxy settings from the environment (lower-case names win, as in curl).
#[derive(Debug, Default)]
pub(super) struct ProxyEnv {
    http: Option<String>,
    https: Option<String>,
    all: Option<String>,
    no_proxy: NoProxy,
}

impl ProxyEnv {
    pub(super) fn from_env() -> Self {
        let var = |name: &str| {
            [name.to_ascii_lowercase(), name.to_string()]
                .iter()
                .filter_map(|n| std::env::var(n).ok())
                .map(|v| v.trim().to_string())
                .find(|v| !v.is_empty())
        };
        Self {
            http: var("HTTP_PROXY"),
            https: var("HTTPS_PROXY"),
            all: var("ALL_PROXY"),
            no_proxy: NoProxy::parse(var("NO_PROXY").as_deref().unwrap_or("")),
        }
    }

    pub(super) fn proxy_for(&self, target: &Target) -> Result<Option<Proxy>, FetchError> {
        let chosen = if target.https {
            &self.https
        } else {
            &self.http
        };
        let Some(value) = chosen.as_ref().or(self.all.as_ref()) else {
            return Ok(None);
        };
        if self.no_proxy.matches(&target.host, target.port) {
            return Ok(None);
        }
        let with_scheme = if value.contains("://") {
            value.clone()
        } else {
            format!("http://{value}")
        };
        Proxy::new(&with_scheme)
            .map(Some)
            .map_err(|e| FetchError::BadProxy {
                value: value.clone(),
                reason: e.to_string(),
            })
    }
}

/// `NO_PROXY` entries: `*`, host names (matching the name and its subdomains; a leading `.`
/// or `*.` is ignored), IP literals, CIDR blocks, and any of those with `:port`.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct NoProxy {
    entries: Vec<NoProxyEntry>,
}

#[derive(Debug, Clone, PartialEq)]
enum NoProxyEntry {
    Everything,
    Host { name: String, port: Option<u16> },
    Cidr { net: IpAddr, prefix: u8 },
}

impl NoProxy {
    pub fn parse(value: &str) -> Self {
        let entries = value
            .split([',', ' '])
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .filter_map(NoProxyEntry::parse)
            .collect();
        Self { entries }
    }

    /// Whether a request to `host:port` bypasses the proxy.
    pub fn matches(&self, host: &str, port: u16) -> bool {
        let host = normalize_host(host);
        let ip = host.parse::<IpAddr>().ok();
        self.entries.iter().any(|entry| match entry {
            NoProxyEntry::Everything => true,
            NoProxyEntry::Host { name, port: p } => {
                p.is_none_or(|p| p == port)
                    && (host == *name
                        || (host.ends_with(name.as_str())
                            && host.as_bytes()[host.len() - name.len() - 1] == b'.'))
            }
            NoProxyEntry::Cidr { net, prefix } => ip.is_some_and(|ip| in_cidr(ip, *net, *prefix)),
        })
    }
}

impl NoProxyEntry {
    fn parse(entry: &str) -> Option<Self> {
        if entry == "*" {
            return Some(Self::Everything);
        }
        if let Some((net, prefix)) = entry.split_once('/') {
            let net = normalize_host(net).parse::<IpAddr>().ok()?;
            let prefix = prefix.parse::<u8>().ok()?;
            let max = if net.is_ipv4() { 32 } else { 128 };
            return (prefix <= max).then_some(Self::Cidr { net, prefix });
        }
        let (name, port) = split_host_port(entry);
        let name = normalize_host(name.trim_start_matches("*.").trim_start_matches('.'));
        (!name.is_empty()).then_some(Self::Host { name, port })
    }
}

/// `host:port`, `[v6]:port`, or a bare host / IPv6 literal (no port).
fn split_host_port(entry: &str) -> (&str, Option<u16>) {
    if let Some(rest) = entry.strip_prefix('[') {
        if let Some((host, after)) = rest.split_once(']') {
            let port = after.strip_prefix(':').and_then(|p| p.parse().ok());
            return (host, port);
        }
    }
    match entry.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') => match port.parse() {
            Ok(port) => (host, Some(port)),
            Err(_) => (entry, None),
        },
        _ => (entry, None),
    }
}

fn in_cidr(ip: IpAddr, net: IpAddr, prefix: u8) -> bool {
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    match (ip, net) {
        (IpAddr::V4(ip), IpAddr::V4(net)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            u32::from(ip) & mask == u32::from(net) & mask
        }
        (IpAddr::V6(ip), IpAddr::V6(net)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            u128::from(ip) & mask == u128::from(net) & mask
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_proxy_entries() {
        let np = NoProxy::parse("example.com, .corp.net,10.0.0.0/8, 192.168.1.5:8080,[::1],*.svc");
        assert!(np.matches("example.com", 80));
        assert!(np.matches("img.example.com", 443));
        assert!(!np.matches("badexample.com", 80));
        assert!(np.matches("a.corp.net", 80));
        assert!(np.matches("corp.net", 80));
        assert!(np.matches("10.20.30.40", 80));
        assert!(!np.matches("11.0.0.1", 80));
        assert!(np.matches("192.168.1.5", 8080));
        assert!(!np.matches("192.168.1.5", 80));
        assert!(np.matches("[::1]", 80));
        assert!(np.matches("db.svc", 80));
        assert!(NoProxy::parse("*").matches("anything", 1));
        assert!(!NoProxy::parse("").matches("anything", 1));
    }
}
