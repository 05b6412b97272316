//! What the video and audio demuxers share of FFmpeg's libraries: bytes in memory opened
//! with one probed demuxer from the caller's whitelist ([`probe`], [`io`]), a deadline that
//! reaches FFmpeg through its interrupt callback, FFmpeg's errors in its own words
//! ([`error`]), and a stream's decoder context with FFmpeg's own threads off.

use ffmpeg_next as ff;

pub mod error;
pub mod io;
pub mod probe;

pub use error::{ff_failure, FfError};
pub use io::{InputLimits, MemoryInput};
pub use probe::{probe_format, Format, ProbeError};

/// A decoder context for `stream`, not yet opened, with FFmpeg's own frame and slice threads
/// off: fan-out belongs to `common::par`.
pub fn single_threaded_context(
    stream: &ff::format::stream::Stream,
) -> Result<ff::codec::context::Context, FfError> {
    let mut context = ff::codec::context::Context::from_parameters(stream.parameters())
        .map_err(ff_failure("reading the codec parameters"))?;
    context.set_threading(ff::codec::threading::Config {
        kind: ff::codec::threading::Type::None,
        count: 1,
        ..Default::default()
    });
    Ok(context)
}
