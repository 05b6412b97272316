//! Local files: `file://` URLs and absolute paths, served only from under an allowed root.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use super::inline::percent_decode;
use super::{check_size, FetchError, FetchPolicy};

/// The local path a `file:` URL names.
pub(super) fn file_url_path(source: &str) -> Result<String, FetchError> {
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
pub(super) fn read_local(path: &Path, policy: &FetchPolicy) -> Result<Vec<u8>, FetchError> {
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
