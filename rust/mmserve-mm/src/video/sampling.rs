//! Which frames of a video the model sees: transformers' `Qwen2VLVideoProcessor.sample_frames`
//! and `Qwen3VLVideoProcessor.sample_frames` (5.24), index for index.

use thiserror::Error;

use crate::error::ErrorCode;
use crate::video::VideoFamily;

/// A video's frame count and rate, as its container's headers give them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VideoMeta {
    pub total_frames: u64,
    /// Average frames per second.
    pub fps: f64,
}

/// How to sample: at most one of `fps` and `num_frames`; neither keeps every frame.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    pub family: VideoFamily,
    pub fps: Option<f64>,
    pub num_frames: Option<u64>,
    pub min_frames: u64,
    pub max_frames: u64,
    pub temporal_patch_size: u64,
}

#[derive(Debug, Error, PartialEq)]
#[non_exhaustive]
pub enum SamplingError {
    #[error("fps and num_frames are mutually exclusive")]
    BothRates,
    #[error("sampling option {name} must be positive and finite, got {value}")]
    BadOption { name: &'static str, value: f64 },
    #[error("{wanted} frames cannot be sampled from a video of {total} frames")]
    TooFewFrames { wanted: u64, total: u64 },
    #[error("the video has no frames")]
    NoFrames,
}

impl SamplingError {
    /// This error's entry in the catalogue of codes.
    pub fn kind(&self) -> ErrorCode {
        match self {
            SamplingError::BothRates => ErrorCode::VideoBadSampling,
            SamplingError::BadOption { .. } => ErrorCode::VideoBadSampling,
            SamplingError::TooFewFrames { .. } => ErrorCode::VideoTooFewFrames,
            SamplingError::NoFrames => ErrorCode::VideoNoFrames,
        }
    }

    /// Stable machine-readable code, e.g. `video.bad_sampling`.
    pub fn code(&self) -> &'static str {
        self.kind().code()
    }
}

/// Python's `round` (half to even) of a finite, non-negative float.
fn round_half_even(x: f64) -> f64 {
    let floor = x.floor();
    let diff = x - floor;
    if diff > 0.5 || (diff == 0.5 && floor % 2.0 != 0.0) {
        floor + 1.0
    } else {
        floor
    }
}

/// Qwen2-VL: the number of frames sampling keeps, before the indices are spread.
fn frame_count(meta: VideoMeta, s: Sampling) -> Result<Option<u64>, SamplingError> {
    let t = s.temporal_patch_size as f64;
    let total = meta.total_frames;
    if let Some(n) = s.num_frames {
        return Ok(Some(
            round_half_even(n as f64 / t) as u64 * s.temporal_patch_size,
        ));
    }
    let Some(fps) = s.fps else { return Ok(None) };
    let max_frames = (s.max_frames.min(total) as f64 / t).floor() * t;
    let wanted = total as f64 / meta.fps * fps;
    let clamped = wanted
        .max(s.min_frames as f64)
        .min(max_frames)
        .min(total as f64);
    Ok(Some(((clamped / t).floor() * t) as u64))
}

/// The indices of the frames to keep, in order (possibly repeated for very short videos).
pub fn sample_indices(meta: VideoMeta, s: Sampling) -> Result<Vec<u64>, SamplingError> {
    if s.fps.is_some() && s.num_frames.is_some() {
        return Err(SamplingError::BothRates);
    }
    for (name, value) in [
        ("fps", s.fps),
        ("num_frames", s.num_frames.map(|n| n as f64)),
        ("temporal_patch_size", Some(s.temporal_patch_size as f64)),
        ("video fps", Some(meta.fps)),
    ] {
        if let Some(value) = value {
            if !(value.is_finite() && value > 0.0) {
                return Err(SamplingError::BadOption { name, value });
            }
        }
    }
    let total = meta.total_frames;
    if total == 0 {
        return Err(SamplingError::NoFrames);
    }
    match s.family {
        VideoFamily::Qwen2Vl => qwen2_indices(meta, s),
        VideoFamily::Qwen3Vl => qwen3_indices(meta, s),
    }
}

fn qwen2_indices(meta: VideoMeta, s: Sampling) -> Result<Vec<u64>, SamplingError> {
    let total = meta.total_frames;
    let Some(n) = frame_count(meta, s)? else {
        return Ok((0..total).collect());
    };
    // transformers fails on zero too (a division by zero), for a video shorter than a
    // temporal patch.
    if n > total || n == 0 {
        return Err(SamplingError::TooFewFrames {
            wanted: n.max(s.temporal_patch_size),
            total,
        });
    }
    // `torch.arange(0, total, total / n).int()`: the length from doubles, each value computed
    // in double, stored as float32, then truncated.
    let step = total as f64 / n as f64;
    let len = (total as f64 / step).ceil() as u64;
    Ok((0..len)
        .map(|i| ((i as f64 * step) as f32) as u64)
        .collect())
}

/// Qwen3-VL: `int(total / video_fps * fps)` frames clamped to `[min_frames, max_frames]` and
/// the video's length (`num_frames` as given), spread by
/// `np.linspace(0, total - 1, n).round()`; repeats where `n` exceeds the frames.
fn qwen3_indices(meta: VideoMeta, s: Sampling) -> Result<Vec<u64>, SamplingError> {
    let total = meta.total_frames;
    let n = match (s.num_frames, s.fps) {
        (Some(n), _) => n,
        (None, Some(fps)) => {
            let wanted = (total as f64 / meta.fps * fps) as u64;
            wanted.max(s.min_frames).min(s.max_frames).min(total)
        }
        (None, None) => return Ok((0..total).collect()),
    };
    // The processor's smart_resize refuses fewer frames than one temporal patch.
    if n < s.temporal_patch_size {
        return Err(SamplingError::TooFewFrames {
            wanted: s.temporal_patch_size,
            total,
        });
    }
    Ok(linspace_rounded(total - 1, n))
}

/// `np.linspace(0, stop, n).round().astype(int)`: `i * (stop / (n - 1))`, the last exactly
/// `stop`, rounded half to even.
fn linspace_rounded(stop: u64, n: u64) -> Vec<u64> {
    if n == 1 {
        return vec![0];
    }
    let step = stop as f64 / (n - 1) as f64;
    (0..n)
        .map(|i| {
            if i == n - 1 {
                stop
            } else {
                round_half_even(i as f64 * step) as u64
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen2(fps: Option<f64>, num_frames: Option<u64>) -> Sampling {
        Sampling {
            family: VideoFamily::Qwen2Vl,
            fps,
            num_frames,
            min_frames: 4,
            max_frames: 768,
            temporal_patch_size: 2,
        }
    }

    #[test]
    fn fps_sampling_spreads_over_the_video() {
        // 10 s at 30 fps sampled at 2 fps: 20 frames, every 15th.
        let meta = VideoMeta {
            total_frames: 300,
            fps: 30.0,
        };
        let idx = sample_indices(meta, qwen2(Some(2.0), None)).unwrap();
        assert_eq!(idx.len(), 20);
        assert_eq!(&idx[..3], &[0, 15, 30]);
        assert_eq!(idx[19], 285);
    }

    #[test]
    fn short_videos_keep_min_frames_and_round_to_the_patch() {
        let meta = VideoMeta {
            total_frames: 5,
            fps: 25.0,
        };
        // 5 frames at 2 fps wants 0.4 frames: min 4, a multiple of 2.
        assert_eq!(
            sample_indices(meta, qwen2(Some(2.0), None)).unwrap(),
            vec![0, 1, 2, 3]
        );
        assert_eq!(
            sample_indices(meta, qwen2(None, Some(2))).unwrap(),
            vec![0, 2]
        );
        // round(3 / 2) is 2 in Python (half to even): 4 frames.
        assert_eq!(
            sample_indices(meta, qwen2(None, Some(3))).unwrap(),
            vec![0, 1, 2, 3]
        );
        assert_eq!(sample_indices(meta, qwen2(None, None)).unwrap().len(), 5);
        let one = VideoMeta {
            total_frames: 1,
            fps: 25.0,
        };
        let err = sample_indices(one, qwen2(Some(2.0), None)).unwrap_err();
        assert_eq!(err.code(), "video.too_few_frames");
    }

    #[test]
    fn refuses_what_transformers_refuses() {
        let meta = VideoMeta {
            total_frames: 5,
            fps: 25.0,
        };
        let both = sample_indices(meta, qwen2(Some(2.0), Some(4)));
        assert_eq!(both.unwrap_err().code(), "video.bad_sampling");
        let many = sample_indices(meta, qwen2(None, Some(8)));
        assert_eq!(many.unwrap_err().code(), "video.too_few_frames");
        let bad = sample_indices(meta, qwen2(Some(f64::NAN), None));
        assert_eq!(bad.unwrap_err().code(), "video.bad_sampling");
        let empty = VideoMeta {
            total_frames: 0,
            fps: 25.0,
        };
        let none = sample_indices(empty, qwen2(Some(2.0), None));
        assert_eq!(none.unwrap_err().code(), "video.no_frames");
    }

    #[test]
    fn qwen3_spreads_with_linspace_and_clamps() {
        let s = |fps, num_frames| Sampling {
            family: VideoFamily::Qwen3Vl,
            ..qwen2(fps, num_frames)
        };
        let meta = VideoMeta {
            total_frames: 30,
            fps: 10.0,
        };
        // 3 s at 2 fps: 6 frames over 0..=29.
        assert_eq!(
            sample_indices(meta, s(Some(2.0), None)).unwrap(),
            vec![0, 6, 12, 17, 23, 29]
        );
        // num_frames is taken as given (odd counts too), repeats past the video's length.
        assert_eq!(
            sample_indices(meta, s(None, Some(3))).unwrap(),
            vec![0, 14, 29]
        );
        let short = VideoMeta {
            total_frames: 2,
            fps: 10.0,
        };
        assert_eq!(
            sample_indices(short, s(None, Some(4))).unwrap(),
            vec![0, 0, 1, 1]
        );
        let one = VideoMeta {
            total_frames: 1,
            fps: 10.0,
        };
        let err = sample_indices(one, s(Some(2.0), None)).unwrap_err();
        assert_eq!(err.code(), "video.too_few_frames");
    }
}
