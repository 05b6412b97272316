//! Decoding the whole stream as torchcodec's `get_all_samples` does: which frames it keeps,
//! where it starts, and the samples it trims before time 0.

use std::ffi::c_int;

use ff::ffi;
use ffmpeg_next as ff;

use super::convert::{gcd, Converter};
use super::input::{ff_error, AudioInput};
use super::{AudioLimits, DecodeOptions, DecodedAudio};
use crate::audio::error::AudioError;
use crate::common::ffmpeg::single_threaded_context;

/// How far the decoded length may stray from the headers' duration before the headers are
/// taken to lie: more than a codec's priming and padding (an MP3's decoder delay and last
/// frame, an AAC's priming frame and last frame, an Opus pre-skip), at any rate.
const LENGTH_SLACK_S: f64 = 0.5;
const LENGTH_SLACK_FRACTION: f64 = 0.01;

/// The most samples reserved from a header's claim (a minute at 16 kHz), and the margin added
/// for a codec's priming and padding.
const MAX_RESERVED: usize = 960_000;
const RESERVE_MARGIN: usize = 4096;

/// The largest sample magnitude decoded audio may hold: a frame's mel power is at most about
/// 1e5 times its square, and float32 features overflow past 3.4e38. Real audio stays near 1.0
/// (a float file written at a 24-bit integer scale reaches 8.4e6).
const MAX_SAMPLE_MAGNITUDE: f32 = 1e15;

/// torchcodec's pre-roll: the frames a lossy codec needs decoded before the first sample
/// wanted, else this many seconds where the frame size is unknown.
const PREROLL_FRAMES: f64 = 4.0;
const FALLBACK_PREROLL_S: f64 = 1.0;
/// libswresample's default filter size and cutoff, which torchcodec's pre-roll is made of.
const SWR_FILTER_SIZE: f64 = 32.0;
const SWR_CUTOFF: f64 = 0.97;

impl AudioInput<'_> {
    /// Decodes the audio stream to mono f32 samples at `options.sample_rate`.
    pub(super) fn decode(
        &mut self,
        options: &DecodeOptions,
        limits: &AudioLimits,
    ) -> Result<DecodedAudio, AudioError> {
        let input_limits = limits.input(None);
        let stream = self
            .source
            .input
            .stream(self.index)
            .ok_or(AudioError::NoAudioStream)?;
        let mut context = single_threaded_context(&stream)?;
        // SAFETY: the context is live and not yet opened.
        unsafe { (*context.as_mut_ptr()).pkt_timebase = self.time_base.into() };
        let mut decoder = context
            .decoder()
            .audio()
            .map_err(ff_error("opening the decoder"))?;
        // SAFETY: the opened context is live; its fields are only read.
        let (codec_rate, frame_size, channels, codec_id) = unsafe {
            let c = decoder.as_ptr();
            (
                (*c).sample_rate,
                (*c).frame_size,
                (*c).ch_layout.nb_channels,
                (*c).codec_id,
            )
        };
        if codec_rate <= 0 {
            return Err(AudioError::BadStream(format!(
                "its decoder runs at {codec_rate} Hz"
            )));
        }
        let out_rate = c_int::try_from(options.sample_rate).unwrap_or(c_int::MAX);
        let preroll = preroll_seconds(codec_id, codec_rate, frame_size, out_rate);
        let seek_pts = seconds_to_pts(-preroll, self.time_base);
        if seek_pts > self.start_time.unwrap_or(0) {
            // torchcodec seeks back by its pre-roll where the stream starts before that.
            // SAFETY: the format context is live.
            let ret = unsafe {
                ffi::avformat_seek_file(
                    self.source.input.as_mut_ptr(),
                    self.index as c_int,
                    i64::MIN,
                    seek_pts,
                    seek_pts,
                    0,
                )
            };
            if ret < 0 {
                return Err(ff_error("seeking to the start")(ff::Error::from(ret)));
            }
        }
        // Frames that end before this are not decoded into the output.
        let output_start = if codec_rate != out_rate {
            seek_pts.min(0)
        } else {
            0
        };
        let start_seconds = self
            .start_time
            .map_or(0.0, |t| pts_to_seconds(t, self.time_base));
        let mut converter = Converter::new(options.sample_rate, start_seconds);
        let length = LengthCheck {
            claimed: self.info.duration_s,
            rate: f64::from(options.sample_rate),
            max_s: limits.max_duration_s,
        };
        // Room for what the headers claim, up to the cut: growing a large buffer by doubling
        // copies it and touches its memory again each time.
        let expected = self
            .info
            .duration_s
            .map_or(0.0, |s| s * f64::from(options.sample_rate));
        let room = (expected.max(0.0) as usize).min(options.max_samples.unwrap_or(MAX_RESERVED));
        let mut out: Vec<f32> = Vec::with_capacity(room.min(MAX_RESERVED) + RESERVE_MARGIN);
        let mut first_seconds: Option<f64> = None;
        let mut frame = ff::frame::Audio::empty();
        let mut flushed = false;
        let mut complete = true;
        'decoding: loop {
            input_limits.check_deadline()?;
            loop {
                match decoder.receive_frame(&mut frame) {
                    Ok(()) => {}
                    Err(ff::Error::Other { errno }) if errno == ffi::EAGAIN => break,
                    // Past the end of the data any failure ends the stream, as torchcodec
                    // takes it.
                    Err(_) if flushed => break 'decoding,
                    Err(ff::Error::Eof) => break 'decoding,
                    Err(e) => return Err(ff_error("decoding")(e)),
                }
                // SAFETY: the frame was just filled by the decoder.
                let f = unsafe { &*frame.as_ptr() };
                let pts = if f.pts != ffi::AV_NOPTS_VALUE {
                    f.pts
                } else {
                    f.pkt_dts
                };
                if i128::from(output_start) >= i128::from(pts) + i128::from(f.pkt_duration) {
                    continue;
                }
                let seconds = pts_to_seconds(pts, self.time_base);
                let shown = converter.convert(f, seconds, channels, &mut out, |samples| {
                    length.check_decoding(samples)
                })?;
                let first = *first_seconds.get_or_insert(shown);
                length.check_decoding(out.len())?;
                if let Some(max) = options.max_samples {
                    if out.len() >= leading_samples(first, options.sample_rate) + max {
                        complete = false;
                        break 'decoding;
                    }
                }
            }
            if flushed {
                break;
            }
            match self.source.next_packet(self.index, &input_limits)? {
                Some(packet) => decoder.send_packet(&packet).map_err(ff_error("decoding"))?,
                None => {
                    decoder.send_eof().map_err(ff_error("decoding"))?;
                    flushed = true;
                }
            }
        }
        let Some(first) = first_seconds else {
            return Err(AudioError::Empty);
        };
        if complete {
            converter.flush(&mut out)?;
            length.check_decoding(out.len())?;
        }
        // What plays before time 0 is left out (torchcodec's `get_samples_played_in_range`).
        let lead = leading_samples(first, options.sample_rate).min(out.len());
        out.drain(..lead);
        if let Some(max) = options.max_samples {
            out.truncate(max);
        }
        if out.is_empty() {
            return Err(AudioError::Empty);
        }
        if complete {
            length.check_complete(out.len())?;
        }
        // A float file may hold NaN or infinities, which no model input should carry, or
        // values so far past full scale that their features overflow float32. One pass: a NaN
        // or an infinity makes the peak infinite.
        let peak = out.iter().fold(0f32, |peak, s| {
            if s.is_finite() {
                peak.max(s.abs())
            } else {
                f32::INFINITY
            }
        });
        if !peak.is_finite() {
            return Err(AudioError::Corrupt(
                "it holds samples that are not finite numbers".into(),
            ));
        }
        if peak > MAX_SAMPLE_MAGNITUDE {
            return Err(AudioError::Corrupt(format!(
                "its samples reach {peak:.1e}, past the {MAX_SAMPLE_MAGNITUDE:.0e} whose \
                 features float32 holds (full scale is 1.0)"
            )));
        }
        Ok(DecodedAudio {
            samples: out,
            complete,
        })
    }
}

/// The decoded length against the headers' claim and the cap.
pub(super) struct LengthCheck {
    pub(super) claimed: Option<f64>,
    pub(super) rate: f64,
    pub(super) max_s: f64,
}

impl LengthCheck {
    /// How far a decoded length may lie from a claim of `claimed` seconds.
    pub(super) fn slack(claimed: f64) -> f64 {
        LENGTH_SLACK_S + LENGTH_SLACK_FRACTION * claimed
    }

    /// While decoding: the samples so far are within the cap and the claim.
    pub(super) fn check_decoding(&self, samples: usize) -> Result<(), AudioError> {
        let seconds = samples as f64 / self.rate;
        if seconds > self.max_s {
            return Err(AudioError::TooLong {
                seconds,
                limit: self.max_s,
            });
        }
        match self.claimed {
            Some(claimed) if seconds > claimed + Self::slack(claimed) => {
                Err(AudioError::LengthMismatch {
                    claimed,
                    decoded: seconds,
                    complete: false,
                })
            }
            _ => Ok(()),
        }
    }

    /// At the end of the data: the whole clip is not much shorter than claimed.
    pub(super) fn check_complete(&self, samples: usize) -> Result<(), AudioError> {
        let seconds = samples as f64 / self.rate;
        match self.claimed {
            Some(claimed) if seconds < claimed - Self::slack(claimed) => {
                Err(AudioError::LengthMismatch {
                    claimed,
                    decoded: seconds,
                    complete: true,
                })
            }
            _ => Ok(()),
        }
    }
}

/// The output samples before time 0 when the first one is at `first_seconds`.
fn leading_samples(first_seconds: f64, rate: u32) -> usize {
    if first_seconds >= 0.0 {
        return 0;
    }
    let n = (-first_seconds * f64::from(rate) + 0.5).floor();
    if n >= usize::MAX as f64 {
        usize::MAX
    } else {
        n as usize
    }
}

/// torchcodec's pre-roll in seconds: the codec's (none for a lossless one) or, when
/// resampling, the resampler's filter and alignment if longer.
fn preroll_seconds(codec: ffi::AVCodecID, rate: c_int, frame_size: c_int, out_rate: c_int) -> f64 {
    // SAFETY: avcodec_descriptor_get takes any id and returns a static descriptor or null.
    let lossless = unsafe {
        let desc = ffi::avcodec_descriptor_get(codec);
        !desc.is_null() && (*desc).props & ffi::AV_CODEC_PROP_LOSSLESS as c_int != 0
    };
    let rate_f = f64::from(rate);
    let mut preroll = if lossless {
        0.0
    } else if frame_size > 0 {
        PREROLL_FRAMES * f64::from(frame_size) / rate_f
    } else {
        FALLBACK_PREROLL_S
    };
    if out_rate != rate {
        let factor = (f64::from(out_rate) * SWR_CUTOFF / rate_f).min(1.0);
        let filter_length = (SWR_FILTER_SIZE / factor).ceil();
        let alignment = i64::from(rate) / gcd(i64::from(rate), i64::from(out_rate));
        preroll = preroll.max(((alignment - 1) as f64 + 2.0 * filter_length) / rate_f);
    }
    preroll
}

/// torchcodec's `pts_to_seconds`: the multiplication before the division.
fn pts_to_seconds(pts: i64, time_base: ff::Rational) -> f64 {
    pts as f64 * f64::from(time_base.numerator()) / f64::from(time_base.denominator())
}

/// torchcodec's `seconds_to_closest_pts`.
fn seconds_to_pts(seconds: f64, time_base: ff::Rational) -> i64 {
    let num = f64::from(time_base.numerator());
    if num == 0.0 {
        return 0;
    }
    (seconds * f64::from(time_base.denominator()) / num).round() as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_before_zero_round_half_up() {
        assert_eq!(leading_samples(0.0, 16000), 0);
        assert_eq!(leading_samples(0.25, 16000), 0);
        assert_eq!(leading_samples(-0.001, 16000), 16);
        assert_eq!(leading_samples(-1.5 / 16000.0, 16000), 2);
    }

    #[test]
    fn preroll_is_the_codecs_or_the_resamplers() {
        // FLAC is lossless: no codec pre-roll; resampling 48 kHz to 16 kHz needs
        // (3 - 1 + 2 * ceil(32 / 0.3233)) / 48000.
        let flac = preroll_seconds(ffi::AVCodecID::AV_CODEC_ID_FLAC, 48000, 4096, 16000);
        assert!((flac - (2.0 + 2.0 * 99.0) / 48000.0).abs() < 1e-12);
        assert_eq!(
            preroll_seconds(ffi::AVCodecID::AV_CODEC_ID_FLAC, 16000, 4096, 16000),
            0.0
        );
        // MP3's four frames outlast the resampler's needs at 44.1 kHz.
        let mp3 = preroll_seconds(ffi::AVCodecID::AV_CODEC_ID_MP3, 44100, 1152, 16000);
        assert!((mp3 - 4.0 * 1152.0 / 44100.0).abs() < 1e-12);
        // No frame size: a second.
        assert_eq!(
            preroll_seconds(ffi::AVCodecID::AV_CODEC_ID_OPUS, 48000, 0, 48000),
            1.0
        );
    }

    #[test]
    fn the_claim_has_slack_both_ways() {
        let check = LengthCheck {
            claimed: Some(10.0),
            rate: 16000.0,
            max_s: 60.0,
        };
        assert!(check.check_decoding(16000 * 10 + 8000).is_ok());
        assert!(matches!(
            check.check_decoding(16000 * 11),
            Err(AudioError::LengthMismatch {
                complete: false,
                ..
            })
        ));
        assert!(check.check_complete(16000 * 10 - 8000).is_ok());
        assert!(matches!(
            check.check_complete(16000 * 9),
            Err(AudioError::LengthMismatch { complete: true, .. })
        ));
        let uncapped = LengthCheck {
            claimed: None,
            rate: 16000.0,
            max_s: 60.0,
        };
        assert!(matches!(
            uncapped.check_decoding(16000 * 61),
            Err(AudioError::TooLong { .. })
        ));
    }
}
