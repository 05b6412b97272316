//! A clip's length at the family's rate without decoding it, where that is exact: bounds that
//! every decode [`decode_audio`](super::decode_audio) accepts falls within.
//!
//! - A clip whose headers state a duration past the cut by more than the slack the decoder
//!   allows them: any decode it accepts reaches the cut (one that ends sooner is refused as a
//!   header that lies), so the clip is the cut, whatever its codec.
//! - Integer PCM (and A-law, mu-law) in WAV starting at 0: each packet decodes to its bytes'
//!   samples, so the packets' sizes count the samples without decoding them; at the family's
//!   rate that is the count, at another the resampler's output of a clip of at least
//!   [`MIN_RESAMPLED_S`] is `floor` or `ceil` of `samples * out_rate / in_rate` (it emits the
//!   output samples whose input position lies before the end, and a shorter clip loses some
//!   to the filter's length), taken with a sample's margin below.
//!
//! Elsewhere (compressed audio shorter than the cut, float PCM, which may hold samples that
//! are not numbers, a stream that starts later than 0) only decoding tells the count: a
//! compressed stream's headers may claim a length its data does not hold, within the slack,
//! and one sample can change a clip's feature frames.

use ffmpeg_next as ff;

use super::input::AudioInput;
use super::stream::LengthCheck;
use super::{AudioLimits, DecodeOptions, SampleBounds};
use crate::audio::error::AudioError;
use crate::audio::format::AudioFormat;

/// The shortest clip counted through the resampler, in seconds.
const MIN_RESAMPLED_S: f64 = 0.1;

/// The PCM codecs whose samples are always numbers, with their bytes per sample.
const COUNTED_CODECS: [(ff::codec::Id, u64); 10] = {
    use ff::codec::Id;
    [
        (Id::PCM_U8, 1),
        (Id::PCM_S8, 1),
        (Id::PCM_ALAW, 1),
        (Id::PCM_MULAW, 1),
        (Id::PCM_S16LE, 2),
        (Id::PCM_S16BE, 2),
        (Id::PCM_S24LE, 3),
        (Id::PCM_S24BE, 3),
        (Id::PCM_S32LE, 4),
        (Id::PCM_S32BE, 4),
    ]
};

impl AudioInput<'_> {
    /// The bounds of the clip's samples at `options.sample_rate`, cut at
    /// `options.max_samples`, where the headers (or PCM's packet sizes) fix them; `None`
    /// where only decoding tells.
    pub(super) fn sample_bounds(
        &mut self,
        options: &DecodeOptions,
        limits: &AudioLimits,
    ) -> Result<Option<SampleBounds>, AudioError> {
        let rate = f64::from(options.sample_rate);
        let check = LengthCheck {
            claimed: self.info.duration_s,
            rate,
            max_s: limits.max_duration_s,
        };
        if let (Some(cut), Some(claimed)) = (options.max_samples, self.info.duration_s) {
            // The least a decode may give without being refused, past the cut by a sample.
            let least = (claimed - LengthCheck::slack(claimed)) * rate;
            if least >= cut as f64 + 1.0 {
                let cut = cut as u64;
                return Ok(Some(SampleBounds { min: cut, max: cut }));
            }
        }
        let Some(input) = self.pcm_samples(options, limits)? else {
            return Ok(None);
        };
        let in_rate = u64::from(self.info.sample_rate);
        let out_rate = u64::from(options.sample_rate);
        let (min, max) = if in_rate == out_rate {
            (input, input)
        } else if (input as f64) < MIN_RESAMPLED_S * in_rate as f64 {
            return Ok(None);
        } else {
            let scaled = u128::from(input) * u128::from(out_rate);
            let floor = u64::try_from(scaled / u128::from(in_rate)).unwrap_or(u64::MAX);
            let ceil = u64::try_from(scaled.div_ceil(u128::from(in_rate))).unwrap_or(u64::MAX);
            (floor.saturating_sub(1), ceil)
        };
        // Where a count in the bounds could be refused, decoding decides (and names why).
        let within = |n: u64| {
            let n = usize::try_from(n).unwrap_or(usize::MAX);
            check.check_decoding(n).is_ok() && check.check_complete(n).is_ok()
        };
        if min == 0 || !within(min) || !within(max) {
            return Ok(None);
        }
        let cut = options.max_samples.map_or(u64::MAX, |m| m as u64);
        Ok(Some(SampleBounds {
            min: min.min(cut),
            max: max.min(cut),
        }))
    }

    /// The samples (per channel, at the stream's rate) of integer PCM in WAV starting at 0,
    /// from its packets' sizes; `None` for anything else, or where a packet holds a partial
    /// sample (the decoder, not the count, decides what that is). Counting stops once past
    /// what `options` keeps.
    fn pcm_samples(
        &mut self,
        options: &DecodeOptions,
        limits: &AudioLimits,
    ) -> Result<Option<u64>, AudioError> {
        if AudioFormat::from_demuxer(&self.source.container) != Some(AudioFormat::Wav)
            || self.start_time.is_some_and(|t| t != 0)
        {
            return Ok(None);
        }
        let Some(stream) = self.source.input.stream(self.index) else {
            return Ok(None);
        };
        let codec = stream.parameters().id();
        let Some(&(_, width)) = COUNTED_CODECS.iter().find(|(id, _)| *id == codec) else {
            return Ok(None);
        };
        let block = width * u64::from(self.info.channels);
        // Past the cut's worth of input (and the resampler's margin) the count no longer
        // matters.
        let enough = options.max_samples.map(|cut| {
            let scaled = (cut as u64 + 2) * u64::from(self.info.sample_rate);
            scaled.div_ceil(u64::from(options.sample_rate)) + 1
        });
        let input_limits = limits.input(None);
        self.read_packets = true;
        let mut samples = 0u64;
        while let Some(packet) = self.source.next_packet(self.index, &input_limits)? {
            let size = packet.size() as u64;
            if !size.is_multiple_of(block) {
                return Ok(None);
            }
            samples += size / block;
            if enough.is_some_and(|e| samples >= e) {
                break;
            }
        }
        Ok(Some(samples))
    }
}
