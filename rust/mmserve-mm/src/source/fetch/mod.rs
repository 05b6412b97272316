//! Bytes of one media item from wherever the request points: `data:` URLs, bare base64,
//! local files under an allowed root, and http(s).
//!
//! Security by default: local files are refused unless a root is allowed, and http(s) hosts
//! that resolve to loopback, private, link-local or other non-public addresses are refused
//! unless the host is listed in [`FetchPolicy::allowed_domains`]. Each hop of a redirect chain
//! is checked again, and the connection goes to the very address that was checked, so a DNS
//! answer that changes between check and connect cannot reach a forbidden address.
//!
//! One job per file: `inline` (`data:` URLs, bare base64), `local` (files under the
//! allowed roots), `http` (http(s) and redirects), `address` (which hosts and addresses
//! are refused, DNS pinning) and `proxy` (`HTTP(S)_PROXY` / `ALL_PROXY` / `NO_PROXY`).

mod address;
mod http;
mod inline;
mod local;
mod proxy;

use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use thiserror::Error;

use crate::error::ErrorCode;
use crate::source::base64::Base64Error;

pub use address::is_forbidden_ip;
pub use proxy::NoProxy;

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
    /// This error's entry in the catalogue of codes.
    pub fn kind(&self) -> ErrorCode {
        match self {
            FetchError::UnsupportedScheme { .. } => ErrorCode::FetchUnsupportedScheme,
            FetchError::BadDataUrl { .. } => ErrorCode::FetchBadDataUrl,
            FetchError::BadBase64(_) => ErrorCode::FetchBadBase64,
            FetchError::LocalPathNotAllowed { .. } => ErrorCode::FetchLocalPathNotAllowed,
            FetchError::LocalIo { .. } => ErrorCode::FetchLocalIo,
            FetchError::BadUrl { .. } => ErrorCode::FetchBadUrl,
            FetchError::ForbiddenAddress { .. } => ErrorCode::FetchForbiddenAddress,
            FetchError::Resolve { .. } => ErrorCode::FetchResolve,
            FetchError::TooLarge { .. } => ErrorCode::FetchTooLarge,
            FetchError::Timeout { .. } => ErrorCode::FetchTimeout,
            FetchError::HttpStatus { .. } => ErrorCode::FetchHttpStatus,
            FetchError::TooManyRedirects { .. } => ErrorCode::FetchTooManyRedirects,
            FetchError::BadRedirect { .. } => ErrorCode::FetchBadRedirect,
            FetchError::BadProxy { .. } => ErrorCode::FetchBadProxy,
            FetchError::Http { .. } => ErrorCode::FetchHttp,
        }
    }

    /// Stable machine-readable code, e.g. `fetch.unsupported_scheme`.
    pub fn code(&self) -> &'static str {
        self.kind().code()
    }
}

/// The raw bytes of `source`: a `data:` URL, `http(s)://` URL, `file://` URL, absolute path,
/// or bare base64 (anything else).
pub fn fetch_bytes(source: &str, policy: &FetchPolicy) -> Result<Vec<u8>, FetchError> {
    let source = source.trim();
    match url_scheme(source) {
        Some(scheme) if scheme.eq_ignore_ascii_case("data") => {
            inline::decode_data_url(source, policy)
        }
        Some(scheme)
            if scheme.eq_ignore_ascii_case("http") || scheme.eq_ignore_ascii_case("https") =>
        {
            http::fetch_http(source, policy)
        }
        Some(scheme) if scheme.eq_ignore_ascii_case("file") => {
            let path = local::file_url_path(source)?;
            local::read_local(Path::new(&path), policy)
        }
        Some(scheme) => Err(FetchError::UnsupportedScheme {
            scheme: scheme.to_string(),
        }),
        None if source.starts_with('/') => local::read_local(Path::new(source), policy),
        None => inline::decode_bare_base64(source, policy),
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

#[cfg(test)]
mod tests {
    use super::*;

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
