//! The errors of the video stages, each with a stable `video.*` code.

use thiserror::Error;

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
    pub fn code(&self) -> &'static str {
        match self {
            VideoError::Sampling(e) => e.code(),
            VideoError::UnknownContainer => "video.unknown_container",
            VideoError::UnsupportedContainer(_) => "video.unsupported_container",
            VideoError::NoVideoStream => "video.no_video_stream",
            VideoError::UnsupportedCodec(_) => "video.unsupported_codec",
            VideoError::UnsupportedPixelFormat(_) => "video.unsupported_pixel_format",
            VideoError::Corrupt(_) => "video.corrupt",
            VideoError::NoFrameRate => "video.no_frame_rate",
            VideoError::TooLong { .. } => "video.too_long",
            VideoError::TooManyFrames { .. } => "video.too_many_frames",
            VideoError::TooManyPixels { .. } => "video.too_many_pixels",
            VideoError::TooManyStreams { .. } => "video.too_many_streams",
            VideoError::TooManyTokens { .. } => "video.too_many_tokens",
            VideoError::FrameSizeChanged { .. } => "video.frame_size_changed",
            VideoError::Deadline => "video.deadline",
            VideoError::Unavailable(_) => "video.unavailable",
            VideoError::Resize(e) => e.code(),
            VideoError::Transform(e) => e.code(),
            VideoError::Process(e) => e.code(),
        }
    }
}
