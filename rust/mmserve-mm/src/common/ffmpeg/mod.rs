//! What the video and audio demuxers share of FFmpeg's libraries: bytes in memory opened
//! with one probed demuxer from the caller's whitelist ([`probe`], [`io`]), a deadline that
//! reaches FFmpeg through its interrupt callback, and FFmpeg's errors in its own words
//! ([`error`]).

pub mod error;
pub mod io;
pub mod probe;

pub use error::{ff_failure, FfError};
pub use io::{InputLimits, MemoryInput};
pub use probe::{probe_format, Format, ProbeError};
