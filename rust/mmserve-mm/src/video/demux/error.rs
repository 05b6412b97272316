//! FFmpeg's failures as [`VideoError`] values.

use ffmpeg_next as ff;

use crate::common::ffmpeg::{ff_failure, FfError, ProbeError};
use crate::video::error::VideoError;

impl From<FfError> for VideoError {
    fn from(e: FfError) -> VideoError {
        match e {
            FfError::Deadline => VideoError::Deadline,
            FfError::TooManyStreams { limit } => VideoError::TooManyStreams { limit },
            other => VideoError::Corrupt(other.describe()),
        }
    }
}

impl From<ProbeError> for VideoError {
    fn from(e: ProbeError) -> VideoError {
        match e {
            ProbeError::Unknown => VideoError::UnknownContainer,
            ProbeError::NotAllowed(name) => VideoError::UnsupportedContainer(name),
        }
    }
}

/// An FFmpeg error met while `doing` something, as a [`VideoError`].
pub(super) fn ff_error(doing: &'static str) -> impl Fn(ff::Error) -> VideoError {
    let failure = ff_failure(doing);
    move |e| VideoError::from(failure(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ffmpeg_errors_become_video_errors() {
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
