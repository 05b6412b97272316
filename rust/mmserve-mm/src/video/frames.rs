//! Sampled frames to `pixel_values_videos` + `video_grid_thw`, as transformers'
//! `Qwen2VLVideoProcessor` and `Qwen3VLVideoProcessor` (torchvision backend) compute them:
//! every frame resized to one `smart_resize` size under the video processor's pixel bounds
//! (per frame for Qwen2-VL, over all sampled frames for Qwen3-VL), normalised, and
//! consecutive frames paired into temporal patches (the last frame repeated when the count
//! is odd).

use crate::family::qwen_vl::{smart_resize, MAX_ASPECT_RATIO};
use crate::image::resize::{resize_view, Backend, Filter, ImageView};
use crate::image::transforms::{patchify_frames_into, NormalizeLut, PatchGeometry};
use crate::pipeline::{DecodedImage, ProcessError};
use crate::video::error::VideoError;
use crate::video::sampling::SamplingError;
use crate::video::VideoFamily;

/// The video processor's resize settings (`video_preprocessor_config.json`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VideoResize {
    pub family: VideoFamily,
    /// `size["shortest_edge"]`: the least pixels per frame (Qwen3-VL: of all sampled frames).
    pub min_pixels: u64,
    /// `size["longest_edge"]`: the most pixels per frame (Qwen3-VL: of all sampled frames).
    pub max_pixels: u64,
    /// Qwen2-VL: also bound each frame by an even share of `max_video_tokens`' pixels;
    /// Qwen3-VL: bound each frame by `max_video_tokens` and an even share of `max_pixels`.
    pub cap_pixels_per_frame: bool,
    /// Qwen2-VL: tokens of the whole video; Qwen3-VL: tokens of one frame.
    pub max_video_tokens: u64,
    pub filter: Filter,
    pub backend: Backend,
}

impl VideoResize {
    /// `Qwen2VLVideoProcessor`'s class defaults.
    pub const QWEN2_VL: VideoResize = VideoResize {
        family: VideoFamily::Qwen2Vl,
        min_pixels: 128 * 28 * 28,
        max_pixels: 28 * 28 * 768,
        cap_pixels_per_frame: false,
        max_video_tokens: 128_000,
        filter: Filter::Bicubic,
        backend: Backend::TorchU8,
    };

    /// `Qwen3VLVideoProcessor`'s class defaults.
    pub const QWEN3_VL: VideoResize = VideoResize {
        family: VideoFamily::Qwen3Vl,
        min_pixels: 128 * 32 * 32,
        max_pixels: 32 * 32 * 768,
        max_video_tokens: 768,
        ..VideoResize::QWEN2_VL
    };

    /// The family's defaults.
    pub fn defaults(family: VideoFamily) -> VideoResize {
        match family {
            VideoFamily::Qwen2Vl => VideoResize::QWEN2_VL,
            VideoFamily::Qwen3Vl => VideoResize::QWEN3_VL,
        }
    }

    /// Qwen2-VL: the per-frame pixel cap for a video of `frames` sampled frames.
    fn frame_max_pixels(&self, frames: usize, factor: u32, temporal: u32) -> u64 {
        if !self.cap_pixels_per_frame || frames == 0 {
            return self.max_pixels;
        }
        // Python: int(max_video_tokens * factor * factor * 0.9), then integer arithmetic.
        let total =
            (self.max_video_tokens as f64 * f64::from(factor) * f64::from(factor) * 0.9) as u64;
        let share = total * u64::from(temporal) / frames as u64;
        let floor = (self.min_pixels as f64 * 1.05) as u64;
        self.max_pixels.min(share).max(floor)
    }

    /// The `(height, width)` every frame of a `width` x `height` video is resized to.
    pub fn target(
        &self,
        frames: usize,
        width: u32,
        height: u32,
        geometry: PatchGeometry,
    ) -> Result<(u32, u32), VideoError> {
        let factor = geometry.patch * geometry.merge;
        if self.family == VideoFamily::Qwen3Vl {
            return self.qwen3_target(frames as u64, width, height, geometry);
        }
        let max_pixels = self.frame_max_pixels(frames, factor, geometry.temporal);
        Ok(smart_resize(
            height,
            width,
            factor,
            self.min_pixels,
            max_pixels,
        )?)
    }

    /// Qwen3-VL's `resize` and `smart_resize`: the pixel bounds count every sampled frame
    /// (rounded to the temporal patch), small sides are first scaled up to one factor.
    fn qwen3_target(
        &self,
        frames: u64,
        width: u32,
        height: u32,
        geometry: PatchGeometry,
    ) -> Result<(u32, u32), VideoError> {
        let factor = u64::from(geometry.patch * geometry.merge);
        let temporal = u64::from(geometry.temporal);
        if frames < temporal || frames == 0 {
            return Err(SamplingError::TooFewFrames {
                wanted: temporal,
                total: frames,
            }
            .into());
        }
        if width == 0 || height == 0 {
            return Err(ProcessError::EmptyImage { width, height }.into());
        }
        let mut max_pixels = self.max_pixels;
        if self.cap_pixels_per_frame {
            let frame_cap = self.max_video_tokens * factor * factor;
            let floor = (self.min_pixels as f64 * 1.05) as u64;
            max_pixels = frame_cap.min(self.max_pixels / frames).max(floor) * frames;
        }
        let f = factor as f64;
        let (mut h, mut w) = (f64::from(height), f64::from(width));
        if h < f || w < f {
            let scale = (f / h).max(f / w);
            h = (h * scale).trunc();
            w = (w * scale).trunc();
        }
        if h.max(w) / h.min(w) > f64::from(MAX_ASPECT_RATIO) {
            return Err(ProcessError::AspectRatio {
                width,
                height,
                limit: MAX_ASPECT_RATIO,
            }
            .into());
        }
        let multiple = |x: f64| x * f;
        let mut h_bar = multiple((h / f).round_ties_even());
        let mut w_bar = multiple((w / f).round_ties_even());
        let t_bar = (frames as f64 / temporal as f64).round_ties_even() * temporal as f64;
        let volume = frames as f64 * h * w;
        if t_bar * h_bar * w_bar > max_pixels as f64 {
            let beta = (volume / max_pixels as f64).sqrt();
            h_bar = f.max(multiple((h / beta / f).floor()));
            w_bar = f.max(multiple((w / beta / f).floor()));
        } else if t_bar * h_bar * w_bar < self.min_pixels as f64 {
            let beta = (self.min_pixels as f64 / volume).sqrt();
            h_bar = multiple((h * beta / f).ceil());
            w_bar = multiple((w * beta / f).ceil());
        }
        // Both sides are at most the frame's (scaled to the pixel bounds): they fit.
        Ok((h_bar as u32, w_bar as u32))
    }
}

/// The model inputs of one video.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessedVideo {
    /// `[grid_t * grid_h * grid_w, 3 * temporal * patch * patch]`, row-major.
    pub pixel_values: Vec<f32>,
    pub cols: usize,
    pub grid_thw: [u32; 3],
    pub resized_width: u32,
    pub resized_height: u32,
}

/// Resizes, normalises and patchifies `frames` (all of one size, in sampled order).
pub fn preprocess_frames(
    frames: &[DecodedImage],
    resize: &VideoResize,
    lut: &NormalizeLut,
    geometry: PatchGeometry,
) -> Result<ProcessedVideo, VideoError> {
    let Some(first) = frames.first() else {
        return Err(VideoError::Sampling(
            crate::video::sampling::SamplingError::NoFrames,
        ));
    };
    let (height, width) = resize.target(frames.len(), first.width, first.height, geometry)?;
    let resized: Vec<DecodedImage> = frames
        .iter()
        .enumerate()
        .map(|(index, frame)| {
            if (frame.width, frame.height) != (first.width, first.height) {
                return Err(VideoError::FrameSizeChanged {
                    index: index as u64,
                    width: frame.width,
                    height: frame.height,
                });
            }
            resize_frame(frame, width, height, resize)
        })
        .collect::<Result<_, _>>()?;
    patchify_resized(&resized, lut, geometry)
}

/// One frame at the target size (as is when it already has it, as torchvision does).
pub fn resize_frame(
    frame: &DecodedImage,
    width: u32,
    height: u32,
    resize: &VideoResize,
) -> Result<DecodedImage, VideoError> {
    if (frame.width, frame.height) == (width, height) {
        return Ok(frame.clone());
    }
    Ok(resize_view(
        frame.into(),
        width,
        height,
        resize.filter,
        resize.backend,
    )?)
}

/// Normalises and patchifies frames already resized to one size.
pub fn patchify_resized(
    resized: &[DecodedImage],
    lut: &NormalizeLut,
    geometry: PatchGeometry,
) -> Result<ProcessedVideo, VideoError> {
    let Some(first) = resized.first() else {
        return Err(VideoError::Sampling(
            crate::video::sampling::SamplingError::NoFrames,
        ));
    };
    let (width, height) = (first.width, first.height);
    let temporal = geometry.temporal as usize;
    let groups = resized.len().div_ceil(temporal.max(1));
    let grid = geometry.grid(width, height)?;
    let mut pixel_values = vec![0.0f32; groups * grid.len()];
    for (g, out) in pixel_values.chunks_exact_mut(grid.len()).enumerate() {
        // Past the end, the last frame stands in (transformers' padding).
        let views: Vec<ImageView<'_>> = (0..temporal)
            .map(|t| (&resized[(g * temporal + t).min(resized.len() - 1)]).into())
            .collect();
        patchify_frames_into(&views, lut, geometry, out)?;
    }
    Ok(ProcessedVideo {
        pixel_values,
        cols: grid.cols,
        grid_thw: [groups as u32, grid.grid_h, grid.grid_w],
        resized_width: width,
        resized_height: height,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::transforms::Convention;

    const GEOMETRY: PatchGeometry = PatchGeometry {
        patch: 14,
        merge: 2,
        temporal: 2,
    };

    fn frame(width: u32, height: u32, value: u8) -> DecodedImage {
        DecodedImage {
            width,
            height,
            data: vec![value; (width * height * 3) as usize],
        }
    }

    fn identity() -> NormalizeLut {
        NormalizeLut::new([0.0; 3], [1.0; 3], 1.0, Convention::Torchvision).unwrap()
    }

    #[test]
    fn pairs_consecutive_frames_and_pads_with_the_last() {
        let frames: Vec<_> = (0..3).map(|v| frame(56, 56, v * 10)).collect();
        let resize = VideoResize {
            min_pixels: 56 * 56,
            ..VideoResize::QWEN2_VL
        };
        let out = preprocess_frames(&frames, &resize, &identity(), GEOMETRY).unwrap();
        assert_eq!(out.grid_thw, [2, 4, 4]);
        let plane = 14 * 14;
        let row = |r: usize| &out.pixel_values[r * out.cols..][..out.cols];
        // Group 0 holds frames 0 and 1; group 1 holds frame 2 twice.
        assert_eq!(row(0)[0], 0.0);
        assert_eq!(row(0)[plane], 10.0);
        assert_eq!(row(16)[0], 20.0);
        assert_eq!(row(16)[plane], 20.0);
    }

    #[test]
    fn caps_pixels_per_frame_by_the_video_budget() {
        let capped = VideoResize {
            cap_pixels_per_frame: true,
            max_video_tokens: 1000,
            ..VideoResize::QWEN2_VL
        };
        // 1000 tokens * 784 * 0.9 * 2 / 64 frames = 22050 pixels, under the 1.05 floor.
        let floor = (VideoResize::QWEN2_VL.min_pixels as f64 * 1.05) as u64;
        assert_eq!(capped.frame_max_pixels(64, 28, 2), floor);
        assert_eq!(capped.frame_max_pixels(4, 28, 2), 352_800);
        assert_eq!(
            VideoResize::QWEN2_VL.frame_max_pixels(64, 28, 2),
            28 * 28 * 768
        );
    }

    #[test]
    fn qwen3_budgets_the_whole_clip() {
        let geometry = PatchGeometry {
            patch: 16,
            ..GEOMETRY
        };
        let target = |frames, width, height| {
            VideoResize::QWEN3_VL
                .target(frames, width, height, geometry)
                .unwrap()
        };
        // transformers' `smart_resize` of Qwen3-VL's video processor gives these.
        assert_eq!(target(4, 96, 64), (160, 224));
        assert_eq!(target(6, 1920, 1080), (256, 480));
        // Sides under one factor are scaled up to it first.
        assert_eq!(target(2, 20, 12), (224, 352));
        let one = VideoResize::QWEN3_VL.target(1, 96, 64, geometry);
        assert_eq!(one.unwrap_err().code(), "video.too_few_frames");
    }

    #[test]
    fn refuses_frames_of_mixed_sizes() {
        let frames = vec![frame(56, 56, 0), frame(28, 56, 0)];
        let err = preprocess_frames(&frames, &VideoResize::QWEN2_VL, &identity(), GEOMETRY);
        assert_eq!(err.unwrap_err().code(), "video.frame_size_changed");
        let none = preprocess_frames(&[], &VideoResize::QWEN2_VL, &identity(), GEOMETRY);
        assert_eq!(none.unwrap_err().code(), "video.no_frames");
    }
}
