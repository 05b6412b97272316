//! Inline media sources: `data:` URLs (percent-encoded or base64), bare base64, and the lenient
//! base64 decoder on raw bytes. Sources that would touch the network or the file system are
//! never built, so a run does no I/O.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mmserve_mm::source::base64;
use mmserve_mm::source::fetch::{fetch_bytes, FetchPolicy};

const MAX_BYTES: u64 = 4096;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode % 4 == 3 {
        if let Ok(bytes) = base64::decode(rest) {
            assert!(bytes.len() <= rest.len() * 3 / 4);
        }
        return;
    }
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let source = match mode % 4 {
        0 => format!("data:{text}"),
        1 => format!("data:image/png;base64,{text}"),
        // Bare base64: no scheme and no absolute path, so never a URL or a file.
        _ if !text.contains(':') && !text.trim().starts_with('/') => text.to_string(),
        _ => return,
    };
    let policy = FetchPolicy {
        max_bytes: MAX_BYTES,
        ..FetchPolicy::default()
    };
    match fetch_bytes(&source, &policy) {
        Ok(bytes) => assert!(bytes.len() as u64 <= MAX_BYTES),
        Err(err) => assert!(err.code().starts_with("fetch."), "{}", err.code()),
    }
});
