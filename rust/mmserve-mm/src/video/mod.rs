//! Video: frame sampling, per-frame preprocessing into temporal patches and, with the
//! `video` feature, demuxing and decoding with FFmpeg's libraries.

pub mod error;
pub mod frames;
pub mod sampling;

#[cfg(feature = "video")]
pub mod demux;

pub use error::VideoError;
