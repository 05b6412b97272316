//! Sources that carry their bytes inline: `data:` URLs and bare base64.

use super::{check_size, FetchError, FetchPolicy};
use crate::source::base64;

/// The payload of a `data:` URL, percent-decoded, then base64-decoded when the media type
/// ends in `;base64`.
pub(super) fn decode_data_url(source: &str, policy: &FetchPolicy) -> Result<Vec<u8>, FetchError> {
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

/// A source that is neither a URL nor an absolute path: bare base64.
pub(super) fn decode_bare_base64(
    source: &str,
    policy: &FetchPolicy,
) -> Result<Vec<u8>, FetchError> {
    let bytes = base64::decode(source.as_bytes())?;
    check_size(bytes.len() as u64, policy.max_bytes)?;
    Ok(bytes)
}

/// `%XX` escapes decoded; anything else is copied as is.
pub(super) fn percent_decode(input: &[u8]) -> Result<Vec<u8>, String> {
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
