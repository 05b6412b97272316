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
/// differ between transformers' `Qwen2VLVideoProcessor` (Qwen2-VL, Qwen2.5-VL) and
/// `Qwen3VLVideoProcessor` (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VideoFamily {
    Qwen2Vl,
    Qwen3Vl,
}

impl VideoFamily {
    /// The family of a model type (`qwen2_vl`, `qwen2_5_vl`, `qwen3_vl`, `qwen3_vl_moe`,
    /// `qwen3_5`, `qwen3_5_moe`).
    pub fn from_model_type(name: &str) -> Option<VideoFamily> {
        match name {
            "qwen2_vl" | "qwen2_5_vl" => Some(VideoFamily::Qwen2Vl),
            "qwen3_vl" | "qwen3_vl_moe" | "qwen3_5" | "qwen3_5_moe" => Some(VideoFamily::Qwen3Vl),
            _ => None,
        }
    }

    /// The transformers class whose rules these are.
    pub fn processor_class(self) -> &'static str {
        match self {
            VideoFamily::Qwen2Vl => "Qwen2VLVideoProcessor",
            VideoFamily::Qwen3Vl => "Qwen3VLVideoProcessor",
        }
    }
}
