//! Demux, decode and resample audio with FFmpeg's libraries (libavformat, libavcodec,
//! libswresample), from bytes in memory, to mono f32 samples at the family's rate, equal
//! sample for sample to torchcodec's `AudioDecoder(data, sample_rate=rate,
//! num_channels=1).get_all_samples()` (the reference transformers loads audio with, on the
//! same FFmpeg).
//!
//! Only the wav, flac, mp3, ogg, matroska/webm and mov/mp4 demuxers ever see the data (the
//! container is named by probing the first bytes, then opened with that demuxer alone), and
//! only PCM (integer, float, A-law, mu-law), FLAC, MP3, Vorbis, Opus and AAC streams are
//! decoded. The headers are read as torchcodec reads them (`avformat_find_stream_info`,
//! which decodes the first frame where the headers leave the format to the bitstream), and
//! every cap is checked from them before the rest is decoded: the stream count, the rate and
//! channels, the duration. Decoding checks the headers' claim: data that decodes to more or
//! less than the duration the headers give (beyond a codec's priming and padding) is refused.
//! Decoders run single-threaded; a deadline reaches FFmpeg through its interrupt callback.
//!
//! A caller that keeps only the first samples (a feature extractor that cuts the clip to its
//! chunk) stops decoding once it has them: the resampler's output up to there does not
//! depend on what follows.

mod convert;
mod input;
mod length;
mod stream;

use std::time::Instant;

use crate::audio::error::AudioError;
use crate::audio::format::AudioFormat;
use input::AudioInput;

/// Limits checked from the headers, and while decoding.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AudioLimits {
    pub max_duration_s: f64,
    pub max_streams: usize,
    pub max_channels: u32,
    pub max_sample_rate: u32,
    /// Opening and decoding stop with [`AudioError::Deadline`] after this.
    pub deadline: Option<Instant>,
}

impl Default for AudioLimits {
    fn default() -> Self {
        AudioLimits {
            max_duration_s: 3600.0,
            max_streams: 16,
            max_channels: 64,
            max_sample_rate: 768_000,
            deadline: None,
        }
    }
}

/// What the headers say about the audio stream.
#[derive(Debug, Clone, PartialEq)]
pub struct AudioInfo {
    /// libavformat's demuxer name, e.g. `matroska,webm`.
    pub container: String,
    /// libavcodec's codec name, e.g. `opus`.
    pub codec: String,
    pub sample_rate: u32,
    pub channels: u32,
    /// The duration the headers state, when they state one (not when libavformat estimated
    /// it from the bitrate). It may include a codec's priming and padding samples.
    pub duration_s: Option<f64>,
}

/// What to decode the audio to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeOptions {
    /// The rate the samples are resampled to.
    pub sample_rate: u32,
    /// Stop once this many samples are decoded (the rest would be cut anyway).
    pub max_samples: Option<usize>,
}

/// Mono samples at [`DecodeOptions::sample_rate`].
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedAudio {
    pub samples: Vec<f32>,
    /// Whether the samples are the whole clip (not cut at `max_samples`).
    pub complete: bool,
}

/// The samples a clip decodes to, as its headers bound them without decoding it (see
/// [`probe_samples`]): at least `min` and at most `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleBounds {
    pub min: u64,
    pub max: u64,
}

/// The samples `data` decodes to at `options.sample_rate`, cut at `options.max_samples`, as
/// its headers bound them (or, for integer PCM in WAV, its packets' sizes), checking the caps
/// as [`probe_audio`] does; `None` where only decoding tells. Every decode
/// [`decode_audio`] accepts gives a count within the bounds.
pub fn probe_samples(
    data: &[u8],
    declared: Option<AudioFormat>,
    options: &DecodeOptions,
    limits: &AudioLimits,
) -> Result<(AudioInfo, Option<SampleBounds>), AudioError> {
    check_rate(options, limits)?;
    let mut input = AudioInput::open(data, declared, limits)?;
    let bounds = input.sample_bounds(options, limits)?;
    Ok((input.info.clone(), bounds))
}

/// A clip's length as [`count_samples`] found it.
#[derive(Debug, Clone, PartialEq)]
pub enum SampleCount {
    /// From the headers, without decoding.
    Bounded(SampleBounds),
    /// Decoded, where the bounds did not settle what the caller needs.
    Decoded(DecodedAudio),
}

/// The clip's bounds ([`probe_samples`]) where `settled` takes them (a family whose frames are
/// the same over them: the count needs nothing more), else its samples decoded, from one
/// opening of the data wherever the bounds read no packets.
pub fn count_samples(
    data: &[u8],
    declared: Option<AudioFormat>,
    options: &DecodeOptions,
    limits: &AudioLimits,
    settled: impl Fn(&SampleBounds) -> bool,
) -> Result<SampleCount, AudioError> {
    check_rate(options, limits)?;
    let mut input = AudioInput::open(data, declared, limits)?;
    match input.sample_bounds(options, limits)? {
        Some(bounds) if settled(&bounds) => Ok(SampleCount::Bounded(bounds)),
        _ => {
            if input.read_packets {
                input = AudioInput::open(data, declared, limits)?;
            }
            Ok(SampleCount::Decoded(input.decode(options, limits)?))
        }
    }
}

/// Reads the headers of `data` and checks the caps; decodes nothing beyond what libavformat
/// needs to name the stream's format. `declared` is the format the request names, if any:
/// data of another format is refused.
pub fn probe_audio(
    data: &[u8],
    declared: Option<AudioFormat>,
    limits: &AudioLimits,
) -> Result<AudioInfo, AudioError> {
    let input = AudioInput::open(data, declared, limits)?;
    Ok(input.info.clone())
}

/// Decodes `data` to mono f32 samples at `options.sample_rate`, as torchcodec does.
pub fn decode_audio(
    data: &[u8],
    declared: Option<AudioFormat>,
    options: &DecodeOptions,
    limits: &AudioLimits,
) -> Result<(AudioInfo, DecodedAudio), AudioError> {
    check_rate(options, limits)?;
    let mut input = AudioInput::open(data, declared, limits)?;
    let decoded = input.decode(options, limits)?;
    Ok((input.info.clone(), decoded))
}

fn check_rate(options: &DecodeOptions, limits: &AudioLimits) -> Result<(), AudioError> {
    if options.sample_rate == 0 || options.sample_rate > limits.max_sample_rate {
        return Err(AudioError::BadStream(format!(
            "cannot resample to {} Hz",
            options.sample_rate
        )));
    }
    Ok(())
}
