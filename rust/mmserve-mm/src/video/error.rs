//! The errors of the video stages, each with a stable `video.*` code.

use thiserror::Error;

use crate::error::ErrorCode;
use crate::image::resize::ResizeError;
use crate::image::transforms::TransformError;
use crate::pipeline::ProcessError;
use crate::video::sampling::SamplingError;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum VideoError {
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error("the data is not a video in a supported container (mp4, mov, webm, mkv)")]
    UnknownContainer,
    #[error("the container {0:?} is not supported (supported: mp4, mov, webm, mkv)")]
    UnsupportedContainer(String),
    #[error("the file has no video stream")]
    NoVideoStream,
    #[error(
        "the video codec {0:?} is not supported (supported: h264, hevc, vp8, vp9, av1, mpeg4)"
    )]
    UnsupportedCodec(String),
    #[error("the pixel format {0:?} is not supported (supported: 8-bit YUV 4:2:0, 4:2:2, 4:4:4)")]
    UnsupportedPixelFormat(String),
    #[error("the video is corrupt or truncated: {0}")]
    Corrupt(String),
    #[error("the video's frame rate is unknown or invalid")]
    NoFrameRate,
    #[error("the video lasts {seconds:.1} s, over the limit of {limit:.1} s")]
    TooLong { seconds: f64, limit: f64 },
    #[error("the video has {frames} frames, over the limit of {limit}")]
    TooManyFrames { frames: u64, limit: u64 },
    #[error("the video's frames are {width}x{height}, over the limit of {limit} pixels")]
    TooManyPixels { width: u32, height: u32, limit: u64 },
    #[error("the video would take {tokens} prompt tokens, over the limit of {limit}")]
    TooManyTokens { tokens: usize, limit: usize },
    #[error("the file has more than {limit} streams")]
    TooManyStreams { limit: usize },
    #[error("frame {index} is {width}x{height}, the video's first frame is not")]
    FrameSizeChanged { index: u64, width: u32, height: u32 },
    #[error("decoding the video took longer than its deadline")]
    Deadline,
    #[error("video cannot be processed here: {0}")]
    Unavailable(&'static str),
    #[error(transparent)]
    Resize(#[from] ResizeError),
    #[error(transparent)]
    Transform(#[from] TransformError),
    #[error(transparent)]
    Process(#[from] ProcessError),
}

impl VideoError {
    /// This error's entry in the catalogue of codes.
    pub fn kind(&self) -> ErrorCode {
        match self {
            VideoError::Sampling(e) => e.kind(),
            VideoError::UnknownContainer => ErrorCode::VideoUnknownContainer,
            VideoError::UnsupportedContainer(_) => ErrorCode::VideoUnsupportedContainer,
            VideoError::NoVideoStream => ErrorCode::VideoNoVideoStream,
            VideoError::UnsupportedCodec(_) => ErrorCode::VideoUnsupportedCodec,
            VideoError::UnsupportedPixelFormat(_) => ErrorCode::VideoUnsupportedPixelFormat,
            VideoError::Corrupt(_) => ErrorCode::VideoCorrupt,
            VideoError::NoFrameRate => ErrorCode::VideoNoFrameRate,
            VideoError::TooLong { .. } => ErrorCode::VideoTooLong,
            VideoError::TooManyFrames { .. } => ErrorCode::VideoTooManyFrames,
            VideoError::TooManyPixels { .. } => ErrorCode::VideoTooManyPixels,
            VideoError::TooManyStreams { .. } => ErrorCode::VideoTooManyStreams,
            VideoError::TooManyTokens { .. } => ErrorCode::VideoTooManyTokens,
            VideoError::FrameSizeChanged { .. } => ErrorCode::VideoFrameSizeChanged,
            VideoError::Deadline => ErrorCode::VideoDeadline,
            VideoError::Unavailable(_) => ErrorCode::VideoUnavailable,
            VideoError::Resize(e) => e.kind(),
            VideoError::Transform(e) => e.kind(),
            VideoError::Process(e) => e.kind(),
        }
    }

    /// Stable machine-readable code, e.g. `video.unknown_container`.
    pub fn code(&self) -> &'static str {
        self.kind().code()
    }
}
