//! FFmpeg's error codes as [`VideoError`] values that say what was being done.

use std::ffi::{c_int, CStr};

use ff::ffi;
use ffmpeg_next as ff;

use crate::video::error::VideoError;

/// An FFmpeg error met while `doing` something: the deadline's own, or FFmpeg's words.
pub(super) fn ff_error(doing: &'static str) -> impl Fn(ff::Error) -> VideoError {
    move |e| match e {
        ff::Error::Exit => VideoError::Deadline,
        other => VideoError::Corrupt(format!("{doing}: {}", error_text(c_int::from(other)))),
    }
}

/// FFmpeg's own words for an error code. ffmpeg-next's `Display` reads a table that only
/// `ffmpeg_next::init` fills (empty strings otherwise), so av_strerror is asked directly.
fn error_text(code: c_int) -> String {
    let mut buf = [0 as std::ffi::c_char; ffi::AV_ERROR_MAX_STRING_SIZE];
    // SAFETY: av_strerror writes at most `buf.len()` bytes, NUL-terminated.
    let known = unsafe { ffi::av_strerror(code, buf.as_mut_ptr(), buf.len()) } >= 0;
    // SAFETY: `buf` is NUL-terminated (zeroed, and av_strerror terminates what it writes).
    let text = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy();
    if known && !text.is_empty() {
        text.into_owned()
    } else {
        format!("FFmpeg error {code}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ffmpeg_errors_keep_their_words() {
        assert_eq!(
            error_text(ffi::AVERROR_INVALIDDATA),
            "Invalid data found when processing input"
        );
        let VideoError::Corrupt(why) = ff_error("reading a packet")(ff::Error::Eof) else {
            panic!("not corrupt");
        };
        assert_eq!(why, "reading a packet: End of file");
        assert!(matches!(
            ff_error("decoding")(ff::Error::Exit),
            VideoError::Deadline
        ));
    }
}
