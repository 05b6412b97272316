//! Decoded frames to mono f32 at the target rate, as torchcodec's CPU path converts them: a
//! frame already in that form is copied; any other goes through one libswresample context
//! made from the first frame that needs it (its layout, format and rate in; the default
//! mono layout, planar float and the target rate out), the first input sample it is fed
//! aligned to a sample that falls on both rates' grids; the context's delayed samples are
//! flushed at the end.

use std::ffi::{c_int, c_void};
use std::ptr;

use ff::ffi;
use ffmpeg_next as ff;

use crate::audio::error::AudioError;

/// The output's sample format: planar float, one plane for one channel.
const OUT_FORMAT: ffi::AVSampleFormat = ffi::AVSampleFormat::AV_SAMPLE_FMT_FLTP;

/// A resampler and the input it was made for.
struct Swr {
    ctx: *mut ffi::SwrContext,
    format: c_int,
    rate: c_int,
    layout: ffi::AVChannelLayout,
}

impl Drop for Swr {
    fn drop(&mut self) {
        // SAFETY: `ctx` came from swr_alloc_set_opts2 and `layout` from av_channel_layout_copy;
        // each is freed once here.
        unsafe {
            ffi::swr_free(&mut self.ctx);
            ffi::av_channel_layout_uninit(&mut self.layout);
        }
    }
}

/// Converts one stream's frames, in order.
pub(super) struct Converter {
    out_rate: c_int,
    /// The stream's first timestamp, in seconds (0 where it has none).
    start_seconds: f64,
    swr: Option<Swr>,
}

impl Converter {
    pub(super) fn new(out_rate: u32, start_seconds: f64) -> Converter {
        Converter {
            out_rate: c_int::try_from(out_rate).unwrap_or(c_int::MAX),
            start_seconds,
            swr: None,
        }
    }

    /// Appends the samples of `frame` (whose timestamp is `pts_seconds`, and whose decoder
    /// gives `channels` channels) to `out`; returns the timestamp of its first sample output
    /// (later than `pts_seconds` when the resampler starts after its first samples).
    /// `check_length` is asked about the length `out` would reach before any of it is made:
    /// a header that lies about the rate (1 Hz, resampled to 16 kHz) would otherwise turn one
    /// frame of a small file into hours of samples.
    pub(super) fn convert(
        &mut self,
        frame: &ffi::AVFrame,
        pts_seconds: f64,
        channels: c_int,
        out: &mut Vec<f32>,
        check_length: impl Fn(usize) -> Result<(), AudioError>,
    ) -> Result<f64, AudioError> {
        let frame_channels = frame.ch_layout.nb_channels;
        if frame_channels != channels {
            return Err(AudioError::Corrupt(format!(
                "a frame has {frame_channels} channels, the stream {channels}"
            )));
        }
        let samples = usize::try_from(frame.nb_samples)
            .map_err(|_| AudioError::Corrupt("a frame has a negative sample count".into()))?;
        if frame.extended_data.is_null() && samples > 0 {
            return Err(AudioError::Corrupt("a frame has no data".into()));
        }
        let must_convert = frame.format != OUT_FORMAT as c_int
            || frame.sample_rate != self.out_rate
            || channels != 1;
        if !must_convert {
            check_length(out.len() + samples)?;
            if samples > 0 {
                // SAFETY: a planar float mono frame holds `samples` floats in its first plane.
                let plane = unsafe {
                    std::slice::from_raw_parts(*frame.extended_data as *const f32, samples)
                };
                out.extend_from_slice(plane);
            }
            return Ok(pts_seconds);
        }
        let mut pts_seconds = pts_seconds;
        let mut skip = 0usize;
        match &self.swr {
            Some(swr) => swr.check(frame)?,
            None => {
                let (aligned_seconds, to_skip) =
                    self.alignment(pts_seconds, frame.sample_rate, samples)?;
                pts_seconds = aligned_seconds;
                if to_skip >= samples {
                    // The aligned sample is in a later frame, which will find it again.
                    return Ok(pts_seconds);
                }
                skip = to_skip;
                self.swr = Some(Swr::new(frame, self.out_rate)?);
            }
        }
        let Some(swr) = &self.swr else {
            return Ok(pts_seconds);
        };
        let inputs = samples - skip;
        check_length(out.len() + resampled_length(inputs, frame.sample_rate, self.out_rate))?;
        let capacity = if frame.sample_rate != self.out_rate {
            // SAFETY: the context is live. An upper bound: the resampler keeps what needs
            // future samples.
            unsafe {
                ffi::av_rescale_rnd(
                    ffi::swr_get_delay(swr.ctx, i64::from(frame.sample_rate)) + inputs as i64,
                    i64::from(self.out_rate),
                    i64::from(frame.sample_rate),
                    ffi::AVRounding::AV_ROUND_UP,
                )
            }
        } else {
            inputs as i64
        };
        let capacity = usize::try_from(capacity)
            .map_err(|_| AudioError::Corrupt("a frame resamples to no samples".into()))?;
        if capacity == 0 {
            return Ok(pts_seconds);
        }
        let mut planes = input_planes(frame, skip)?;
        swr.convert(out, capacity, planes.as_mut_ptr(), inputs)?;
        Ok(pts_seconds)
    }

    /// The samples the resampler still holds, appended to `out`.
    pub(super) fn flush(&mut self, out: &mut Vec<f32>) -> Result<(), AudioError> {
        let Some(swr) = &self.swr else {
            return Ok(());
        };
        // SAFETY: the context is live.
        let left = unsafe { ffi::swr_get_out_samples(swr.ctx, 0) };
        let left = usize::try_from(left).unwrap_or(0);
        if left > 0 {
            swr.convert(out, left, ptr::null_mut(), 0)?;
        }
        Ok(())
    }

    /// Where the resampler starts in a frame at `pts_seconds` (torchcodec's "audio resampling
    /// and frame alignment"): the first of its samples whose index from the stream's start is
    /// a multiple of `rate / gcd(rate, out_rate)`; its timestamp and how many samples come
    /// before it.
    fn alignment(
        &self,
        pts_seconds: f64,
        rate: c_int,
        samples: usize,
    ) -> Result<(f64, usize), AudioError> {
        if rate <= 0 {
            return Err(AudioError::Corrupt(format!(
                "a frame's sample rate is {rate}"
            )));
        }
        let index = ((pts_seconds - self.start_seconds) * f64::from(rate)).round() as i64;
        let step = i64::from(rate) / gcd(i64::from(rate), i64::from(self.out_rate));
        let remainder = index.rem_euclid(step);
        let aligned = index + if remainder == 0 { 0 } else { step - remainder };
        let skip = usize::try_from(aligned - index).unwrap_or(samples);
        Ok((self.start_seconds + aligned as f64 / f64::from(rate), skip))
    }
}

/// The sample format a frame's `format` field names, if it names one.
fn sample_format(format: c_int) -> Option<ffi::AVSampleFormat> {
    let known = 0..ffi::AVSampleFormat::AV_SAMPLE_FMT_NB as c_int;
    // SAFETY: the value is one of the enum's discriminants, which run contiguously from 0.
    known
        .contains(&format)
        .then(|| unsafe { std::mem::transmute::<c_int, ffi::AVSampleFormat>(format) })
}

/// How many samples `inputs` at `rate` make at `out_rate`, rounded down (the resampler's
/// delay aside).
fn resampled_length(inputs: usize, rate: c_int, out_rate: c_int) -> usize {
    let length = inputs as u128 * u128::from(out_rate.unsigned_abs())
        / u128::from(rate.unsigned_abs().max(1));
    usize::try_from(length).unwrap_or(usize::MAX)
}

pub(super) fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 {
        a.abs().max(1)
    } else {
        gcd(b, a % b)
    }
}

/// The frame's data planes from sample `skip` on: one per channel when planar, else one.
fn input_planes(frame: &ffi::AVFrame, skip: usize) -> Result<Vec<*const u8>, AudioError> {
    let format = sample_format(frame.format)
        .ok_or_else(|| AudioError::Corrupt("a frame has no sample format".into()))?;
    // SAFETY: the queries read static tables.
    let (planar, bytes) = unsafe {
        (
            ffi::av_sample_fmt_is_planar(format) != 0,
            ffi::av_get_bytes_per_sample(format),
        )
    };
    let channels = usize::try_from(frame.ch_layout.nb_channels).unwrap_or(0);
    let bytes = usize::try_from(bytes).unwrap_or(0);
    let planes = if planar { channels } else { 1 };
    let offset = skip * bytes * if planar { 1 } else { channels };
    (0..planes)
        .map(|p| {
            // SAFETY: a decoded frame has a data pointer per plane in `extended_data`, each
            // holding `nb_samples` samples (times the channels when packed); `skip` is below
            // `nb_samples`.
            let plane = unsafe { *frame.extended_data.add(p) };
            if plane.is_null() {
                return Err(AudioError::Corrupt("a frame lacks a channel's data".into()));
            }
            // SAFETY: as above, the offset stays inside the plane.
            Ok(unsafe { plane.add(offset) } as *const u8)
        })
        .collect()
}

impl Swr {
    /// A resampler from the frame's layout, format and rate to mono planar float at
    /// `out_rate` (the frame's own layout when it is already mono).
    fn new(frame: &ffi::AVFrame, out_rate: c_int) -> Result<Swr, AudioError> {
        let format = sample_format(frame.format).ok_or_else(|| {
            AudioError::Corrupt(format!(
                "a frame has the unknown sample format {}",
                frame.format
            ))
        })?;
        // SAFETY: the layouts are initialised before use and freed on every path (the copy by
        // `Swr`'s drop, the default one holds no allocation); the context is freed on failure.
        unsafe {
            let mut layout: ffi::AVChannelLayout = std::mem::zeroed();
            if ffi::av_channel_layout_copy(&mut layout, &frame.ch_layout) < 0 {
                return Err(AudioError::Corrupt(
                    "a frame's channel layout is invalid".into(),
                ));
            }
            let mut out_layout: ffi::AVChannelLayout = std::mem::zeroed();
            if frame.ch_layout.nb_channels == 1 {
                if ffi::av_channel_layout_copy(&mut out_layout, &frame.ch_layout) < 0 {
                    ffi::av_channel_layout_uninit(&mut layout);
                    return Err(AudioError::Corrupt(
                        "a frame's channel layout is invalid".into(),
                    ));
                }
            } else {
                ffi::av_channel_layout_default(&mut out_layout, 1);
            }
            let mut swr = Swr {
                ctx: ptr::null_mut(),
                format: frame.format,
                rate: frame.sample_rate,
                layout,
            };
            let ret = ffi::swr_alloc_set_opts2(
                &mut swr.ctx,
                &mut out_layout,
                OUT_FORMAT,
                out_rate,
                &mut swr.layout,
                format,
                frame.sample_rate,
                0,
                ptr::null_mut::<c_void>(),
            );
            ffi::av_channel_layout_uninit(&mut out_layout);
            if ret < 0 || swr.ctx.is_null() {
                return Err(AudioError::BadStream(
                    "the resampler cannot take its format".into(),
                ));
            }
            if ffi::swr_init(swr.ctx) < 0 {
                return Err(AudioError::BadStream(
                    "the resampler cannot take its format".into(),
                ));
            }
            Ok(swr)
        }
    }

    /// Refuses a frame the resampler was not made for (its planes would be misread).
    fn check(&self, frame: &ffi::AVFrame) -> Result<(), AudioError> {
        // SAFETY: both layouts are initialised.
        let same_layout =
            unsafe { ffi::av_channel_layout_compare(&self.layout, &frame.ch_layout) } == 0;
        if frame.format != self.format || frame.sample_rate != self.rate || !same_layout {
            return Err(AudioError::Corrupt(
                "the audio's sample format, rate or channels change mid-stream".into(),
            ));
        }
        Ok(())
    }

    /// Resamples `inputs` samples from `planes` (none: flush) into at most `capacity` more
    /// samples of `out`.
    fn convert(
        &self,
        out: &mut Vec<f32>,
        capacity: usize,
        planes: *mut *const u8,
        inputs: usize,
    ) -> Result<(), AudioError> {
        let capacity_c = c_int::try_from(capacity)
            .map_err(|_| AudioError::Corrupt("a frame is too large".into()))?;
        let inputs_c = c_int::try_from(inputs)
            .map_err(|_| AudioError::Corrupt("a frame is too large".into()))?;
        out.reserve(capacity);
        let len = out.len();
        // SAFETY: `out` has room for `capacity` more floats, the one plane of mono planar
        // float output; `planes` holds the input's planes with `inputs` samples each (or is
        // null to flush).
        let written = unsafe {
            let mut dst = out.as_mut_ptr().add(len) as *mut u8;
            ffi::swr_convert(self.ctx, &mut dst, capacity_c, planes, inputs_c)
        };
        let written = usize::try_from(written).map_err(|_| {
            AudioError::Corrupt(format!(
                "resampling: {}",
                crate::common::ffmpeg::error::error_text(written)
            ))
        })?;
        // SAFETY: swr_convert wrote `written <= capacity` floats past `len`.
        unsafe { out.set_len(len + written.min(capacity)) };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_lands_on_both_grids() {
        let c = Converter::new(16000, 0.0);
        // 44.1 kHz to 16 kHz meet every 441 input samples.
        assert_eq!(c.alignment(0.0, 44100, 1152).unwrap(), (0.0, 0));
        let (seconds, skip) = c.alignment(1105.0 / 44100.0, 44100, 1152).unwrap();
        assert_eq!(skip, 1323 - 1105);
        assert!((seconds - 1323.0 / 44100.0).abs() < 1e-12);
        // 48 kHz to 16 kHz: every third sample.
        assert_eq!(c.alignment(-1.0 / 48000.0, 48000, 960).unwrap().1, 1);
        assert_eq!(gcd(44100, 16000), 100);
    }
}
