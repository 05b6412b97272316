//! Audio: the formats a request may name, Whisper-style log-mel features and, with the
//! `audio` feature, demuxing, decoding and resampling with FFmpeg's libraries.

pub mod error;
pub mod features;
pub mod format;
pub mod mel;

#[cfg(feature = "audio")]
pub mod decode;

pub use error::AudioError;
pub use format::AudioFormat;
