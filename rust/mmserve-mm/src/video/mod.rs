//! Video: frame sampling, per-frame preprocessing into temporal patches and, with the
//! `video` feature, demuxing and decoding with FFmpeg's libraries.

pub mod config;
pub mod error;
pub mod frames;
pub mod sampling;
pub mod timeline;
pub mod timestamps;

#[cfg(feature = "video")]
pub mod demux;
#[cfg(feature = "video")]
pub mod process;

pub use error::VideoError;

/// Whose video processor the rules follow: sampling, the resize budget and the prompt text
/// differ between transformers' `Qwen2VLVideoProcessor` and `Qwen3VLVideoProcessor`. Each
/// family's module says whose rules its videos follow (`FamilyName::video_processor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VideoFamily {
    Qwen2Vl,
    Qwen3Vl,
}

impl VideoFamily {
    /// The transformers class whose rules these are.
    pub fn processor_class(self) -> &'static str {
        match self {
            VideoFamily::Qwen2Vl => "Qwen2VLVideoProcessor",
            VideoFamily::Qwen3Vl => "Qwen3VLVideoProcessor",
        }
    }
}
