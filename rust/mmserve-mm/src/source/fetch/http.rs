//! http(s) sources: one GET per hop with an overall deadline, redirects followed by hand so
//! that every hop passes the address policy again, and the body capped while it streams.

use std::io::{self, Read};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ureq::http::Uri;
use ureq::unversioned::transport::DefaultConnector;
use ureq::{Agent, Proxy};

use super::address::{addresses_to_pin, normalize_host, PinnedResolver};
use super::proxy::ProxyEnv;
use super::{check_size, url_scheme, FetchError, FetchPolicy};

/// GET `source`, following redirects up to the policy's limit, each hop checked again.
pub(super) fn fetch_http(source: &str, policy: &FetchPolicy) -> Result<Vec<u8>, FetchError> {
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
        let pinned = addresses_to_pin(&target.host, target.port, policy, proxy.is_some())?;
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
pub(super) struct Target {
    pub(super) https: bool,
    /// Lower-case, without IPv6 brackets.
    pub(super) host: String,
    pub(super) port: u16,
    authority: String,
    path: String,
}

impl Target {
    pub(super) fn parse(url: &str) -> Result<Self, FetchError> {
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
    let resolver = PinnedResolver::new(target.host.clone(), pinned);
    Agent::with_parts(config, DefaultConnector::new(), resolver)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirect_locations_resolve_against_the_current_url() {
        let base = Target::parse("http://h:8080/a/b/c.png?x=1").unwrap();
        assert_eq!(join_url(&base, "https://o/x"), "https://o/x");
        assert_eq!(join_url(&base, "//o/x"), "http://o/x");
        assert_eq!(join_url(&base, "/x"), "http://h:8080/x");
        assert_eq!(join_url(&base, "d.png"), "http://h:8080/a/b/d.png");
        assert_eq!(join_url(&base, "?y=2"), "http://h:8080/a/b/c.png?y=2");
    }
}
