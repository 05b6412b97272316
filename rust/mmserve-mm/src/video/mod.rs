//! Video: frame sampling, per-frame preprocessing into temporal patches and, with the
//! `video` feature, demuxing and decoding with FFmpeg's libraries.

pub mod config;
pub mod error;
pub mod frames;
pub mod identity;
pub mod sampling;
pub mod timeline;

#[cfg(feature = "video")]
pub mod demux;
#[cfg(feature = "video")]
pub mod process;

pub use error::VideoError;
