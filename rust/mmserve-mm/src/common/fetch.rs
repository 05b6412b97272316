//! Bytes of one media item from wherever the request points: `data:` URLs, bare base64,
//! local files under an allowed root, and http(s).
//!
//! Security by default: local files are refused unless a root is allowed, and http(s) hosts
//! that resolve to loopback, private, link-local or other non-public addresses are refused
//! unless the host is listed in [`FetchPolicy::allowed_domains`]. Each hop of a redirect chain
//! is checked again, and the connection goes to the very address that was checked, so a DNS
//! answer that changes between check and connect cannot reach a forbidden address.

use std::fs::File;
use std::io::{self, Read};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use thiserror::Error;
use ureq::http::Uri;
use ureq::unversioned::resolver::{ResolvedSocketAddrs, Resolver};
use ureq::unversioned::transport::{DefaultConnector, NextTimeout};
use ureq::{Agent, Proxy};

use crate::common::base64::{self, Base64Error};

/// Per-source size cap (64 MiB): an item larger than this is refused while it streams in.
pub const MAX_BYTES_PER_SOURCE: u64 = 64 << 20;
/// Used when `REQUEST_TIMEOUT` is unset or invalid.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
pub const DEFAULT_MAX_REDIRECTS: u32 = 10;

/// What a fetch may touch and how long it may take. `Default` refuses local files and
/// non-public addresses, caps a source at 64 MiB and takes its timeout from `REQUEST_TIMEOUT`.
#[derive(Debug, Clone)]
pub struct FetchPolicy {
    /// Local files are served only from under these directories (none by default).
    pub allowed_local_roots: Vec<PathBuf>,
    /// Host names or IP literals allowed even when they resolve to non-public addresses.
    pub allowed_domains: Vec<String>,
    /// Overall deadline for one http(s) source, redirects and body included.
    pub timeout: Duration,
    pub max_bytes: u64,
    pub max_redirects: u32,
}

impl Default for FetchPolicy {
    fn default() -> Self {
        Self {
            allowed_local_roots: Vec::new(),
            allowed_domains: Vec::new(),
            timeout: timeout_from_env(),
            max_bytes: MAX_BYTES_PER_SOURCE,
            max_redirects: DEFAULT_MAX_REDIRECTS,
        }
    }
}

/// `REQUEST_TIMEOUT` in (possibly fractional) seconds, else [`DEFAULT_TIMEOUT`].
pub fn timeout_from_env() -> Duration {
    std::env::var("REQUEST_TIMEOUT")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .filter(|d| !d.is_zero())
        .unwrap_or(DEFAULT_TIMEOUT)
}

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum FetchError {
    #[error(
        "unsupported media source scheme '{scheme}' (use data:, file://, http:// or https://)"
    )]
    UnsupportedScheme { scheme: String },
    #[error("malformed data: URL: {reason}")]
    BadDataUrl { reason: String },
    #[error("media source is neither a URL, an absolute path nor base64: {0}")]
    BadBase64(#[from] Base64Error),
    #[error("local media path '{path}' is not under an allowed local root")]
    LocalPathNotAllowed { path: String },
    #[error("cannot read local media '{path}': {source}")]
    LocalIo { path: String, source: io::Error },
    #[error("invalid media URL '{url}': {reason}")]
    BadUrl { url: String, reason: String },
    #[error(
        "media host '{host}' resolves to {addr}, a non-public address; \
         list the host in the allowed media domains to permit it"
    )]
    ForbiddenAddress { host: String, addr: IpAddr },
    #[error("cannot resolve media host '{host}': {reason}")]
    Resolve { host: String, reason: String },
    #[error("media source exceeds the size limit of {limit} bytes")]
    TooLarge { limit: u64 },
    #[error("fetching media took longer than the timeout of {:.3} s", timeout.as_secs_f64())]
    Timeout { timeout: Duration },
    #[error("media URL '{url}' answered HTTP status {status}")]
    HttpStatus { url: String, status: u16 },
    #[error("media URL followed more than {limit} redirects")]
    TooManyRedirects { limit: u32 },
    #[error("media URL '{url}' redirected without a usable Location header")]
    BadRedirect { url: String },
    #[error("invalid proxy setting '{value}': {reason}")]
    BadProxy { value: String, reason: String },
    #[error("fetching media from '{url}' failed: {reason}")]
    Http { url: String, reason: String },
}

impl FetchError {
    pub fn code(&self) -> &'static str {
        match self {
            FetchError::UnsupportedScheme { .. } => "fetch.unsupported_scheme",
            FetchError::BadDataUrl { .. } => "fetch.bad_data_url",
            FetchError::BadBase64(_) => "fetch.bad_base64",
            FetchError::LocalPathNotAllowed { .. } => "fetch.local_path_not_allowed",
            FetchError::LocalIo { .. } => "fetch.local_io",
            FetchError::BadUrl { .. } => "fetch.bad_url",
            FetchError::ForbiddenAddress { .. } => "fetch.forbidden_address",
            FetchError::Resolve { .. } => "fetch.resolve",
            FetchError::TooLarge { .. } => "fetch.too_large",
            FetchError::Timeout { .. } => "fetch.timeout",
            FetchError::HttpStatus { .. } => "fetch.http_status",
            FetchError::TooManyRedirects { .. } => "fetch.too_many_redirects",
            FetchError::BadRedirect { .. } => "fetch.bad_redirect",
            FetchError::BadProxy { .. } => "fetch.bad_proxy",
            FetchError::Http { .. } => "fetch.http",
        }
    }
}

/// The raw bytes of `source`: a `data:` URL, `http(s)://` URL, `file://` URL, absolute path,
/// or bare base64 (anything else).
pub fn fetch_bytes(source: &str, policy: &FetchPolicy) -> Result<Vec<u8>, FetchError> {
    let source = source.trim();
    match url_scheme(source) {
        Some(scheme) if scheme.eq_ignore_ascii_case("data") => decode_data_url(source, policy),
        Some(scheme)
            if scheme.eq_ignore_ascii_case("http") || scheme.eq_ignore_ascii_case("https") =>
        {
            fetch_http(source, policy)
        }
        Some(scheme) if scheme.eq_ignore_ascii_case("file") => {
            let path = file_url_path(source)?;
            read_local(Path::new(&path), policy)
        }
        Some(scheme) => Err(FetchError::UnsupportedScheme {
            scheme: scheme.to_string(),
        }),
        None if source.starts_with('/') => read_local(Path::new(source), policy),
        None => {
            let bytes = base64::decode(source.as_bytes())?;
            check_size(bytes.len() as u64, policy.max_bytes)?;
            Ok(bytes)
        }
    }
}

/// The scheme of `source` when it starts like a URL (`letter *(letter / digit / + - .) ":"`).
/// Base64 never contains ':', so it never looks like a URL.
fn url_scheme(source: &str) -> Option<&str> {
    let (scheme, _) = source.split_once(':')?;
    let mut chars = scheme.chars();
    let first = chars.next()?;
    let valid = first.is_ascii_alphabetic()
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    valid.then_some(scheme)
}

fn check_size(len: u64, limit: u64) -> Result<(), FetchError> {
    if len > limit {
        Err(FetchError::TooLarge { limit })
    } else {
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// data: URLs

fn decode_data_url(source: &str, policy: &FetchPolicy) -> Result<Vec<u8>, FetchError> {
    let bad = |reason: &str| FetchError::BadDataUrl {
        reason: reason.to_string(),
    };
    let rest = &source["data:".len()..];
    let (header, payload) = rest
        .split_once(',')
        .ok_or_else(|| bad("missing ',' between the media type and the data"))?;
    let is_base64 = header
        .rsplit(';')
        .next()
        .is_some_and(|last| last.trim().eq_ignore_ascii_case("base64"));
    let raw = percent_decode(payload.as_bytes()).map_err(|e| bad(&e))?;
    let bytes = if is_base64 {
        base64::decode(&raw).map_err(|e| FetchError::BadDataUrl {
            reason: e.to_string(),
        })?
    } else {
        raw
    };
    check_size(bytes.len() as u64, policy.max_bytes)?;
    Ok(bytes)
}

fn percent_decode(input: &[u8]) -> Result<Vec<u8>, String> {
    if !input.contains(&b'%') {
        return Ok(input.to_vec());
    }
    let mut out = Vec::with_capacity(input.len());
    let mut i = 0;
    while i < input.len() {
        if input[i] == b'%' {
            // Exactly two hex digits: `from_str_radix` alone would also take a sign ("%+1").
            let hex = input
                .get(i + 1..i + 3)
                .filter(|h| h.iter().all(u8::is_ascii_hexdigit))
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("invalid percent escape at byte {i}"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(input[i]);
            i += 1;
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Local files

fn file_url_path(source: &str) -> Result<String, FetchError> {
    let rest = &source["file:".len()..];
    // file:///abs/path and file://localhost/abs/path name a local file; file:/abs/path too.
    let path = if let Some(after) = rest.strip_prefix("//") {
        let slash = after.find('/').unwrap_or(after.len());
        let host = &after[..slash];
        if !(host.is_empty() || host.eq_ignore_ascii_case("localhost")) {
            return Err(FetchError::BadUrl {
                url: source.to_string(),
                reason: format!("file URL names a remote host '{host}'"),
            });
        }
        &after[slash..]
    } else {
        rest
    };
    if !path.starts_with('/') {
        return Err(FetchError::BadUrl {
            url: source.to_string(),
            reason: "file URL path must be absolute".to_string(),
        });
    }
    let decoded = percent_decode(path.as_bytes()).map_err(|reason| FetchError::BadUrl {
        url: source.to_string(),
        reason,
    })?;
    String::from_utf8(decoded).map_err(|_| FetchError::BadUrl {
        url: source.to_string(),
        reason: "file URL path is not UTF-8".to_string(),
    })
}

/// Reads `path` if, after resolving `..` and symlinks, it lies under an allowed root.
fn read_local(path: &Path, policy: &FetchPolicy) -> Result<Vec<u8>, FetchError> {
    let shown = path.display().to_string();
    let not_allowed = || FetchError::LocalPathNotAllowed {
        path: shown.clone(),
    };
    if policy.allowed_local_roots.is_empty() {
        return Err(not_allowed());
    }
    // A path that cannot be resolved is reported as not allowed rather than as missing, so
    // that a refused request cannot probe which files exist outside the roots.
    let real = path.canonicalize().map_err(|_| not_allowed())?;
    let inside = policy
        .allowed_local_roots
        .iter()
        .filter_map(|root| root.canonicalize().ok())
        .any(|root| real.starts_with(root));
    if !inside {
        return Err(not_allowed());
    }
    let io_err = |source| FetchError::LocalIo {
        path: shown.clone(),
        source,
    };
    let file = File::open(&real).map_err(io_err)?;
    // Refused from its size where the file says it; the read below caps it either way.
    if let Ok(meta) = file.metadata() {
        check_size(meta.len(), policy.max_bytes)?;
    }
    let mut bytes = Vec::new();
    file.take(policy.max_bytes.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(io_err)?;
    check_size(bytes.len() as u64, policy.max_bytes)?;
    Ok(bytes)
}

// ---------------------------------------------------------------------------------------------
// http(s)

fn fetch_http(source: &str, policy: &FetchPolicy) -> Result<Vec<u8>, FetchError> {
    let deadline = Instant::now() + policy.timeout;
    let timed_out = || FetchError::Timeout {
        timeout: policy.timeout,
    };
    let proxies = ProxyEnv::from_env();
    let mut url = source.to_string();
    for _hop in 0..=policy.max_redirects {
        // A fragment names a part of the resource and is never sent to the server.
        if let Some(hash) = url.find('#') {
            url.truncate(hash);
        }
        let target = Target::parse(&url)?;
        let proxy = proxies.proxy_for(&target)?;
        let allowed = policy
            .allowed_domains
            .iter()
            .any(|d| normalize_host(d) == target.host);
        let pinned = if proxy.is_some() {
            // The proxy connects; still refuse names that resolve locally to forbidden addresses.
            if !allowed {
                if let Ok(addrs) = resolve(&target) {
                    check_public(&target.host, &addrs)?;
                }
            }
            Vec::new()
        } else {
            let addrs = resolve(&target)?;
            if !allowed {
                check_public(&target.host, &addrs)?;
            }
            addrs
        };
        let remaining = deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(timed_out)?;
        let agent = build_agent(&target, pinned, proxy, remaining);
        let http_err = |e: ureq::Error| map_ureq_error(e, &url, policy.timeout);
        let response = agent.get(&url).call().map_err(http_err)?;
        let status = response.status().as_u16();
        if (300..400).contains(&status) && status != 304 {
            let location = response
                .headers()
                .get("location")
                .and_then(|v| v.to_str().ok())
                .ok_or_else(|| FetchError::BadRedirect { url: url.clone() })?;
            url = join_url(&target, location);
            continue;
        }
        if !(200..300).contains(&status) {
            return Err(FetchError::HttpStatus { url, status });
        }
        if let Some(len) = response
            .headers()
            .get("content-length")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
        {
            check_size(len, policy.max_bytes)?;
        }
        let mut bytes = Vec::new();
        // The cap holds while streaming, whatever Content-Length claimed.
        response
            .into_body()
            .into_with_config()
            .limit(u64::MAX)
            .reader()
            .take(policy.max_bytes.saturating_add(1))
            .read_to_end(&mut bytes)
            .map_err(|e| http_err(ureq::Error::from(e)))?;
        check_size(bytes.len() as u64, policy.max_bytes)?;
        return Ok(bytes);
    }
    Err(FetchError::TooManyRedirects {
        limit: policy.max_redirects,
    })
}

fn map_ureq_error(err: ureq::Error, url: &str, timeout: Duration) -> FetchError {
    match err {
        ureq::Error::Timeout(_) => FetchError::Timeout { timeout },
        ureq::Error::Io(e) if e.kind() == io::ErrorKind::TimedOut => {
            FetchError::Timeout { timeout }
        }
        other => FetchError::Http {
            url: url.to_string(),
            reason: other.to_string(),
        },
    }
}

/// One hop's URL, split into the parts the checks need.
#[derive(Debug)]
struct Target {
    https: bool,
    /// Lower-case, without IPv6 brackets.
    host: String,
    port: u16,
    authority: String,
    path: String,
}

impl Target {
    fn parse(url: &str) -> Result<Self, FetchError> {
        let bad = |reason: &str| FetchError::BadUrl {
            url: url.to_string(),
            reason: reason.to_string(),
        };
        let uri: Uri = url
            .parse()
            .map_err(|e: ureq::http::uri::InvalidUri| bad(&e.to_string()))?;
        let https = match uri.scheme_str().map(str::to_ascii_lowercase).as_deref() {
            Some("https") => true,
            Some("http") => false,
            Some(other) => {
                return Err(FetchError::UnsupportedScheme {
                    scheme: other.to_string(),
                })
            }
            None => return Err(bad("missing scheme")),
        };
        let authority = uri.authority().ok_or_else(|| bad("missing host"))?;
        if authority.as_str().contains('@') {
            return Err(bad("credentials in media URLs are not supported"));
        }
        let host = normalize_host(authority.host());
        if host.is_empty() {
            return Err(bad("missing host"));
        }
        Ok(Self {
            https,
            host,
            port: authority.port_u16().unwrap_or(if https { 443 } else { 80 }),
            authority: authority.as_str().to_string(),
            path: uri.path().to_string(),
        })
    }
}

fn normalize_host(host: &str) -> String {
    host.trim()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .trim_end_matches('.')
        .to_ascii_lowercase()
}

/// Resolves a redirect's Location against the URL that answered it.
fn join_url(base: &Target, location: &str) -> String {
    let scheme = if base.https { "https" } else { "http" };
    let location = location.trim();
    if url_scheme(location).is_some() {
        location.to_string()
    } else if let Some(rest) = location.strip_prefix("//") {
        format!("{scheme}://{rest}")
    } else if location.starts_with('/') {
        format!("{scheme}://{}{location}", base.authority)
    } else if location.starts_with('?') {
        format!("{scheme}://{}{}{location}", base.authority, base.path)
    } else {
        let dir = base.path.rfind('/').map_or("/", |i| &base.path[..=i]);
        format!("{scheme}://{}{dir}{location}", base.authority)
    }
}

fn resolve(target: &Target) -> Result<Vec<SocketAddr>, FetchError> {
    if let Ok(ip) = target.host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, target.port)]);
    }
    let err = |reason: String| FetchError::Resolve {
        host: target.host.clone(),
        reason,
    };
    let addrs: Vec<SocketAddr> = (target.host.as_str(), target.port)
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
struct PinnedResolver {
    host: String,
    addrs: Vec<SocketAddr>,
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

fn build_agent(
    target: &Target,
    pinned: Vec<SocketAddr>,
    proxy: Option<Proxy>,
    remaining: Duration,
) -> Agent {
    let config = Agent::config_builder()
        .http_status_as_error(false)
        .max_redirects(0)
        .proxy(proxy)
        .timeout_global(Some(remaining))
        .max_idle_connections(0)
        .build();
    let resolver = PinnedResolver {
        host: target.host.clone(),
        addrs: pinned,
    };
    Agent::with_parts(config, DefaultConnector::new(), resolver)
}

// ---------------------------------------------------------------------------------------------
// Proxies

/// Proxy settings from the environment (lower-case names win, as in curl).
#[derive(Debug, Default)]
struct ProxyEnv {
    http: Option<String>,
    https: Option<String>,
    all: Option<String>,
    no_proxy: NoProxy,
}

impl ProxyEnv {
    fn from_env() -> Self {
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

    fn proxy_for(&self, target: &Target) -> Result<Option<Proxy>, FetchError> {
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

    #[test]
    fn redirect_locations_resolve_against_the_current_url() {
        let base = Target::parse("http://h:8080/a/b/c.png?x=1").unwrap();
        assert_eq!(join_url(&base, "https://o/x"), "https://o/x");
        assert_eq!(join_url(&base, "//o/x"), "http://o/x");
        assert_eq!(join_url(&base, "/x"), "http://h:8080/x");
        assert_eq!(join_url(&base, "d.png"), "http://h:8080/a/b/d.png");
        assert_eq!(join_url(&base, "?y=2"), "http://h:8080/a/b/c.png?y=2");
    }

    #[test]
    fn data_urls_and_bare_base64() {
        let policy = FetchPolicy::default();
        let cases: [(&str, &[u8]); 5] = [
            ("data:image/png;base64,aGVsbG8=", b"hello"),
            ("data:;base64,aGVsbG8", b"hello"),
            ("data:text/plain,hi%20there%00", b"hi there\0"),
            (
                "data:application/octet-stream;charset=x;base64,aGVs%0AbG8=",
                b"hello",
            ),
            ("aGVsbG8=", b"hello"),
        ];
        for (source, expected) in cases {
            assert_eq!(fetch_bytes(source, &policy).unwrap(), expected, "{source}");
        }
        let err = fetch_bytes("data:image/png;base64", &policy).unwrap_err();
        assert_eq!(err.code(), "fetch.bad_data_url");
        let err = fetch_bytes("data:image/png;base64,!!!", &policy).unwrap_err();
        assert_eq!(err.code(), "fetch.bad_data_url");
        let err = fetch_bytes("data:,%zz", &policy).unwrap_err();
        assert_eq!(err.code(), "fetch.bad_data_url");
        let err = fetch_bytes("not base64 at all!", &policy).unwrap_err();
        assert_eq!(err.code(), "fetch.bad_base64");
        let err = fetch_bytes("ftp://x/y", &policy).unwrap_err();
        assert_eq!(err.code(), "fetch.unsupported_scheme");
        let small = FetchPolicy {
            max_bytes: 4,
            ..FetchPolicy::default()
        };
        let err = fetch_bytes("data:;base64,aGVsbG8=", &small).unwrap_err();
        assert_eq!(err.code(), "fetch.too_large");
    }
}
