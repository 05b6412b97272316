//! FFmpeg's failures as one value that says what was being done, for each stage to turn into
//! its own error.

use std::ffi::{c_int, CStr};

use ff::ffi;
use ffmpeg_next as ff;

/// What went wrong inside FFmpeg.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FfError {
    /// The caller's deadline passed (FFmpeg's interrupt callback, or a check between reads).
    Deadline,
    /// The file has more streams than the caller allows.
    TooManyStreams { limit: usize },
    /// An allocation failed.
    OutOfMemory,
    /// FFmpeg refused the data while `doing` something, in its own words.
    Failed { doing: &'static str, text: String },
}

impl FfError {
    /// The words a client reads: what was being done and FFmpeg's reason.
    pub fn describe(&self) -> String {
        match self {
            FfError::Deadline => "the deadline passed".into(),
            FfError::TooManyStreams { limit } => format!("more than {limit} streams"),
            FfError::OutOfMemory => "out of memory".into(),
            FfError::Failed { doing, text } => format!("{doing}: {text}"),
        }
    }
}

/// An FFmpeg error met while `doing` something: the deadline's own (FFmpeg reports an
/// interrupted call as `Exit`), or FFmpeg's words.
pub fn ff_failure(doing: &'static str) -> impl Fn(ff::Error) -> FfError {
    move |e| match e {
        ff::Error::Exit => FfError::Deadline,
        other => FfError::Failed {
            doing,
            text: error_text(c_int::from(other)),
        },
    }
}

/// FFmpeg's own words for an error code. ffmpeg-next's `Display` reads a table that only
/// `ffmpeg_next::init` fills (empty strings otherwise), so av_strerror is asked directly.
pub fn error_text(code: c_int) -> String {
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
        let failure = ff_failure("reading a packet")(ff::Error::Eof);
        assert_eq!(failure.describe(), "reading a packet: End of file");
        assert_eq!(ff_failure("decoding")(ff::Error::Exit), FfError::Deadline);
    }
}
