//! Whisper-style log-mel features, as transformers' `WhisperFeatureExtractor` computes them
//! on its torch path: the clip padded (or cut) to the chunk, `torch.stft` (periodic Hann
//! window, centred frames with reflected edges, the last frame dropped), the power through
//! the mel filters, `log10` clamped at 1e-10, floored at the clip's maximum less 8, then
//! `(x + 4) / 4`.
//!
//! The transform and the filters are computed in f64 (the reference's float32 rounding is its
//! own error, not matched), with the Fourier transform of real input and each filter over its
//! non-zero bins only; the log is taken in f32, the features' own type. Frames
//! that see nothing but padding all equal one another and are computed once. Frames fan out
//! in blocks through `common::par`; the result does not depend on the pool.

use std::sync::Arc;

use realfft::{RealFftPlanner, RealToComplex};
use serde::{Deserialize, Serialize};

use crate::audio::error::AudioError;
use crate::audio::mel::{hann_window, mel_filters, MelFilter};
use crate::common::par;

/// Frames per block handed to the pool.
const FRAMES_PER_BLOCK: usize = 256;
/// `torch.clamp(mel, min=1e-10)` before the log.
const LOG_FLOOR: f64 = 1e-10;
/// Its log10.
const LOG_FLOOR_LOG10: f32 = -10.0;
/// The log-mel values are floored at the clip's maximum less this (in log10 units).
const DYNAMIC_RANGE: f64 = 8.0;

/// How the clip is brought to the length the features are computed over (in the spec JSON,
/// the processor's name: `"max_length"` or `"longest"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Padding {
    /// Padded with the padding value to the chunk (`padding="max_length"`: Whisper,
    /// Qwen2-Audio, Qwen2.5-Omni).
    MaxLength,
    /// Left as long as it is (`padding=True`, i.e. `"longest"`, with one clip: Qwen3-Omni).
    Longest,
}

/// A `WhisperFeatureExtractor`'s parameters (`preprocessor_config.json`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogMelConfig {
    /// Mel bins (`feature_size`: 80 or 128).
    pub feature_size: usize,
    pub sampling_rate: u32,
    pub hop_length: usize,
    pub n_fft: usize,
    /// Seconds in the chunk the clip is padded and cut to (`chunk_length`: 30).
    pub chunk_length: u32,
    pub padding_value: f32,
    pub padding: Padding,
    /// Whether a clip longer than the chunk is cut to it (the extractor's default: yes).
    pub truncation: bool,
}

impl LogMelConfig {
    /// Whisper's and the Qwen audio families' extractor with `feature_size` mel bins, padded and
    /// cut to 30 s.
    pub fn whisper(feature_size: usize) -> LogMelConfig {
        LogMelConfig {
            feature_size,
            sampling_rate: 16000,
            hop_length: 160,
            n_fft: 400,
            chunk_length: 30,
            padding_value: 0.0,
            padding: Padding::MaxLength,
            truncation: true,
        }
    }

    /// Samples in the chunk (`n_samples`).
    pub fn chunk_samples(&self) -> usize {
        self.chunk_length as usize * self.sampling_rate as usize
    }

    /// The samples of a clip of `samples` the features see: cut to the chunk when truncating.
    pub fn kept_samples(&self, samples: usize) -> usize {
        if self.truncation {
            samples.min(self.chunk_samples())
        } else {
            samples
        }
    }

    /// The length of the signal after padding (or cutting).
    fn padded_len(&self, samples: usize) -> usize {
        let kept = self.kept_samples(samples);
        match self.padding {
            Padding::MaxLength => kept.max(self.chunk_samples()),
            Padding::Longest => kept,
        }
    }

    /// Whether a clip of `samples` can be featurized: torch's reflect padding needs more
    /// samples than the half window it reflects.
    pub fn extractable(&self, samples: usize) -> bool {
        self.padded_len(samples) > self.n_fft / 2
    }

    /// `(frames, valid_frames)` for a clip of `samples`: the feature frames, and the sum of the
    /// extractor's attention mask over them (frames that start on the clip's own samples).
    pub fn frames(&self, samples: usize) -> (usize, usize) {
        let padded = self.padded_len(samples);
        let hop = self.hop_length.max(1);
        let frames = padded / hop;
        let valid = self.kept_samples(samples).div_ceil(hop).min(frames);
        (frames, valid)
    }

    pub(crate) fn validate(&self) -> Result<(), AudioError> {
        let bad = |why: String| Err(AudioError::BadFeatureConfig(why));
        if self.n_fft < 2 || self.n_fft > 1 << 16 {
            return bad(format!("n_fft {} is outside 2..=65536", self.n_fft));
        }
        if self.hop_length == 0 {
            return bad("hop_length is 0".into());
        }
        if self.feature_size == 0 || self.feature_size > 1024 {
            return bad(format!(
                "feature_size {} is outside 1..=1024",
                self.feature_size
            ));
        }
        if self.sampling_rate == 0 {
            return bad("sampling_rate is 0".into());
        }
        if !self.padding_value.is_finite() {
            return bad("padding_value is not finite".into());
        }
        Ok(())
    }
}

/// The features of one clip: `data` is `[feature_size, frames]`, row-major (the extractor's
/// `input_features[i]`).
#[derive(Debug, Clone, PartialEq)]
pub struct LogMelFeatures {
    pub data: Vec<f32>,
    pub feature_size: usize,
    pub frames: usize,
    /// The extractor's `attention_mask.sum()`: the frames of the clip's own samples.
    pub valid_frames: usize,
}

/// A feature extractor: the config with its window, filters and transform planned once.
pub struct LogMel {
    config: LogMelConfig,
    window: Vec<f64>,
    filters: Vec<MelFilter>,
    fft: Arc<dyn RealToComplex<f64>>,
}

impl std::fmt::Debug for LogMel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogMel")
            .field("config", &self.config)
            .finish()
    }
}

/// The clip as the transform reads it: samples, then the padding value up to `len`, with the
/// edges reflected (`torch.stft(center=True, pad_mode="reflect")`).
struct Signal<'a> {
    samples: &'a [f32],
    len: usize,
    padding_value: f64,
}

impl Signal<'_> {
    /// The index into the padded signal of position `pos` (which may lie in the reflected
    /// margins), as `torch.nn.functional.pad(mode="reflect")` maps it.
    fn source_index(&self, pos: isize) -> usize {
        let last = self.len as isize - 1;
        let reflected = if pos < 0 {
            -pos
        } else if pos > last {
            2 * last - pos
        } else {
            pos
        };
        reflected.clamp(0, last) as usize
    }

    /// The frame starting at `first`, times the window, into `out`.
    fn windowed(&self, first: isize, window: &[f64], out: &mut [f64]) {
        let inside = usize::try_from(first)
            .ok()
            .filter(|&start| start + window.len() <= self.samples.len());
        match inside {
            // The frame lies on the clip's own samples: no reflection, no padding.
            Some(start) => {
                let frame = &self.samples[start..start + window.len()];
                for ((x, &s), &w) in out.iter_mut().zip(frame).zip(window) {
                    *x = f64::from(s) * w;
                }
            }
            None => {
                for (k, (x, &w)) in out.iter_mut().zip(window).enumerate() {
                    *x = self.at(first + k as isize) * w;
                }
            }
        }
    }

    fn at(&self, pos: isize) -> f64 {
        let i = self.source_index(pos);
        self.samples
            .get(i)
            .map_or(self.padding_value, |&s| f64::from(s))
    }

    /// Whether every position of `[start, start + width)` reads padding.
    fn all_padding(&self, start: isize, width: usize) -> bool {
        let end = start + width as isize - 1;
        let last = self.len as isize - 1;
        // The reflection is monotone on each side of the signal and inside it, so the lowest
        // index the window reads is at an end of one of those pieces.
        let mut lowest = isize::MAX;
        if start < 0 {
            lowest = lowest.min(-end.min(-1));
        }
        if start <= last && end >= 0 {
            lowest = lowest.min(start.max(0));
        }
        if end > last {
            lowest = lowest.min(2 * last - end);
        }
        lowest.max(0) as usize >= self.samples.len()
    }
}

impl LogMel {
    pub fn new(config: LogMelConfig) -> Result<LogMel, AudioError> {
        config.validate()?;
        let fft = RealFftPlanner::<f64>::new().plan_fft_forward(config.n_fft);
        Ok(LogMel {
            window: hann_window(config.n_fft),
            filters: mel_filters(config.n_fft, config.feature_size, config.sampling_rate),
            fft,
            config,
        })
    }

    pub fn config(&self) -> &LogMelConfig {
        &self.config
    }

    /// The filters' weights as a dense `[1 + n_fft / 2, feature_size]` matrix (the extractor's
    /// `mel_filters`), for checking them.
    pub fn filter_matrix(&self) -> Vec<f64> {
        let bins = 1 + self.config.n_fft / 2;
        let mels = self.config.feature_size;
        let mut dense = vec![0.0; bins * mels];
        for (m, filter) in self.filters.iter().enumerate() {
            for (k, &w) in filter.weights.iter().enumerate() {
                dense[(filter.first + k) * mels + m] = w;
            }
        }
        dense
    }

    /// The features of a mono clip at the config's sampling rate.
    pub fn extract(&self, samples: &[f32]) -> Result<LogMelFeatures, AudioError> {
        let config = &self.config;
        let kept = &samples[..config.kept_samples(samples.len())];
        let len = config.padded_len(samples.len());
        if !config.extractable(samples.len()) {
            return Err(AudioError::TooShort {
                samples: samples.len(),
                min: config.n_fft / 2 + 1,
            });
        }
        let signal = Signal {
            samples: kept,
            len,
            padding_value: f64::from(config.padding_value),
        };
        let (frames, valid_frames) = config.frames(samples.len());
        let mels = config.feature_size;
        // The frames that read only padding at the end all equal the first of them.
        let padding_from = (0..frames)
            .rev()
            .take_while(|&t| signal.all_padding(self.frame_start(t), config.n_fft))
            .last()
            .unwrap_or(frames);
        let computed = (padding_from + 1).min(frames);
        let blocks: Vec<(usize, usize)> = (0..computed)
            .step_by(FRAMES_PER_BLOCK)
            .map(|start| (start, (start + FRAMES_PER_BLOCK).min(computed)))
            .collect();
        let logs: Vec<BlockLogs> = par::map(&blocks, |&(start, end)| {
            self.log_mel_block(&signal, start, end)
        });
        // The floor is the loudest value less 8 (log10 units), at least the clamp's log.
        let loudest = logs.iter().map(|b| b.loudest).fold(LOG_FLOOR, f64::max);
        // Float samples far past full scale (a float WAV's can reach 3e38) make powers that
        // float32 features cannot hold: the extractor's would be infinite, then NaN.
        if loudest > f64::from(f32::MAX) {
            return Err(AudioError::Corrupt(format!(
                "its samples reach {:.1e}, far past full scale (1.0)",
                kept.iter().fold(0f32, |peak, s| peak.max(s.abs()))
            )));
        }
        let floor = (loudest.log10() - DYNAMIC_RANGE) as f32;
        let scaled = |log: f32| (log.max(floor) + 4.0) * 0.25;
        // Transposed to `[mels, frames]`, a row at a time, each written once in order.
        let mut data = Vec::with_capacity(mels * frames);
        for m in 0..mels {
            let row = data.len();
            for block in &logs {
                data.extend(
                    block.values[m..]
                        .iter()
                        .step_by(mels)
                        .map(|&log| scaled(log)),
                );
            }
            // The frames past the last computed one are padding alone, as it is.
            let last = data.get(row + computed.max(1) - 1).copied().unwrap_or(0.0);
            data.resize(row + frames, last);
        }
        Ok(LogMelFeatures {
            data,
            feature_size: mels,
            frames,
            valid_frames,
        })
    }

    /// Position in the signal of frame `t`'s first sample (the frames are centred).
    fn frame_start(&self, t: usize) -> isize {
        (t * self.config.hop_length) as isize - (self.config.n_fft / 2) as isize
    }

    /// The clamped log10 mel powers of frames `start..end`, frame-major, and the block's
    /// loudest power.
    fn log_mel_block(&self, signal: &Signal<'_>, start: usize, end: usize) -> BlockLogs {
        let mut input = self.fft.make_input_vec();
        let mut spectrum = self.fft.make_output_vec();
        let mut scratch = self.fft.make_scratch_vec();
        let mut power = vec![0.0; spectrum.len()];
        let mut values = Vec::with_capacity((end - start) * self.filters.len());
        let mut loudest = 0f64;
        for t in start..end {
            signal.windowed(self.frame_start(t), &self.window, &mut input);
            // The lengths come from the plan itself, so the transform cannot fail.
            if self
                .fft
                .process_with_scratch(&mut input, &mut spectrum, &mut scratch)
                .is_err()
            {
                power.iter_mut().for_each(|p| *p = 0.0);
            } else {
                for (p, c) in power.iter_mut().zip(&spectrum) {
                    *p = c.re * c.re + c.im * c.im;
                }
            }
            for filter in &self.filters {
                let bins = &power[filter.first..filter.first + filter.weights.len()];
                let mel: f64 = bins.iter().zip(&filter.weights).map(|(p, w)| p * w).sum();
                loudest = loudest.max(mel);
                // The log in f32 (the features' type), as a natural log, which libm computes
                // several times faster than log10: its error, under 1e-6 in the result, is
                // far inside the extractor's own float32 rounding.
                values.push(if mel <= LOG_FLOOR {
                    LOG_FLOOR_LOG10
                } else {
                    (mel as f32).ln() * std::f32::consts::LOG10_E
                });
            }
        }
        BlockLogs { values, loudest }
    }
}

/// A block of frames' clamped log10 mel powers and its loudest power.
struct BlockLogs {
    values: Vec<f32>,
    loudest: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tone(n: usize, freq: f64, rate: f64) -> Vec<f32> {
        (0..n)
            .map(|i| (0.5 * (2.0 * std::f64::consts::PI * freq * i as f64 / rate).sin()) as f32)
            .collect()
    }

    #[test]
    fn frames_and_the_mask_follow_the_extractor() {
        let c = LogMelConfig::whisper(128);
        assert_eq!(c.frames(16000), (3000, 100));
        assert_eq!(c.frames(16001), (3000, 101));
        assert_eq!(c.frames(1), (3000, 1));
        assert_eq!(c.frames(10 * 480_000), (3000, 3000));
        let longest = LogMelConfig {
            padding: Padding::Longest,
            truncation: false,
            ..c
        };
        // `padding=True, truncation=False`: the frames and the mask's sum are both
        // `samples // hop` (the mask's ceil less the dropped last frame).
        for (samples, frames) in [
            (1600, 10),
            (1601, 10),
            (1759, 10),
            (16_000, 100),
            (16_001, 100),
            (48_007, 300),
            (560_000, 3500),
            (960_000, 6000),
        ] {
            assert_eq!(longest.frames(samples), (frames, frames), "{samples}");
        }
        assert!(!longest.extractable(200) && longest.extractable(201));
        assert!(c.extractable(1));
    }

    #[test]
    fn silence_is_the_floor_everywhere_and_padding_frames_repeat() {
        let mel = LogMel::new(LogMelConfig::whisper(80)).unwrap();
        let out = mel.extract(&vec![0.0; 16000]).unwrap();
        assert_eq!(
            (out.feature_size, out.frames, out.valid_frames),
            (80, 3000, 100)
        );
        // log10(1e-10) = -10 everywhere: (-10 + 4) / 4.
        assert!(out.data.iter().all(|&v| v == -1.5));

        let out = mel.extract(&tone(8000, 440.0, 16000.0)).unwrap();
        let column = |t: usize| (0..80).map(|m| out.data[m * 3000 + t]).collect::<Vec<_>>();
        assert_eq!(column(100), column(2999));
        assert_ne!(column(10), column(100));
        let max = out.data.iter().copied().fold(f32::MIN, f32::max);
        let min = out.data.iter().copied().fold(f32::MAX, f32::min);
        assert!(
            (max - min - 2.0).abs() < 1e-6,
            "the floor is 8 log units under the max"
        );
    }

    #[test]
    fn a_tone_peaks_in_its_own_band() {
        let mel = LogMel::new(LogMelConfig::whisper(80)).unwrap();
        let out = mel.extract(&tone(16000, 1000.0, 16000.0)).unwrap();
        let t = 50;
        let loudest = (0..80)
            .max_by(|&a, &b| out.data[a * 3000 + t].total_cmp(&out.data[b * 3000 + t]))
            .unwrap();
        let filter = &mel.filters[loudest];
        let bin = 1000.0 / (16000.0 / 400.0);
        assert!(
            (filter.first as f64) <= bin && bin <= (filter.first + filter.weights.len()) as f64
        );
    }

    #[test]
    fn the_pool_does_not_change_the_result_and_truncation_cuts() {
        let mel = LogMel::new(LogMelConfig::whisper(128)).unwrap();
        let long = tone(500_000, 300.0, 16000.0);
        let cut = mel.extract(&long).unwrap();
        let exact = mel.extract(&long[..480_000]).unwrap();
        assert_eq!(cut, exact);
        assert_eq!(cut.valid_frames, 3000);
    }

    #[test]
    fn a_clip_too_short_to_reflect_is_refused_unpadded() {
        let mel = LogMel::new(LogMelConfig {
            padding: Padding::Longest,
            truncation: false,
            ..LogMelConfig::whisper(80)
        })
        .unwrap();
        assert!(matches!(
            mel.extract(&[0.1; 200]),
            Err(AudioError::TooShort {
                samples: 200,
                min: 201
            })
        ));
        assert_eq!(mel.extract(&[0.1; 320]).unwrap().frames, 2);
    }

    #[test]
    fn reflection_maps_the_margins_back_inside() {
        let samples = [1.0f32, 2.0, 3.0];
        let s = Signal {
            samples: &samples,
            len: 5,
            padding_value: 0.0,
        };
        let read: Vec<f64> = (-3..8).map(|p| s.at(p)).collect();
        // x = [1, 2, 3, 0, 0]; reflect pads 3 each side without repeating the edge.
        assert_eq!(
            read,
            vec![0.0, 3.0, 2.0, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 3.0, 2.0]
        );
        assert!(s.all_padding(3, 3));
        assert!(!s.all_padding(2, 3));
    }

    #[test]
    fn samples_whose_power_overflows_float32_are_refused() {
        let mel = LogMel::new(LogMelConfig::whisper(80)).unwrap();
        let mut loud = tone(8000, 440.0, 16000.0);
        assert!(mel.extract(&loud).is_ok());
        loud[4000] = 1e30;
        let err = mel.extract(&loud).unwrap_err();
        assert_eq!(err.code(), "audio.corrupt");
        assert!(err.to_string().contains("1.0e30"), "{err}");
    }

    #[test]
    fn bad_configs_are_refused() {
        let bad = LogMelConfig {
            hop_length: 0,
            ..LogMelConfig::whisper(80)
        };
        assert!(matches!(
            LogMel::new(bad),
            Err(AudioError::BadFeatureConfig(_))
        ));
    }
}
