//! One video from bytes to what the plan and the model need: the count-only plan (headers,
//! sampling, the resize target: no frame decoded) and the full preprocessing.

use crate::identity;
use crate::image::transforms::{NormalizeLut, PatchGeometry};
use crate::video::demux::{decode_frames_with, probe_video, VideoInfo, VideoLimits};
use crate::video::error::VideoError;
use crate::video::frames::{patchify_resized, resize_frame, ProcessedVideo, VideoResize};
use crate::video::sampling::{sample_indices, Sampling};

/// Everything that decides a video's model inputs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VideoOptions {
    pub sampling: Sampling,
    pub resize: VideoResize,
    pub geometry: PatchGeometry,
    pub limits: VideoLimits,
    /// Most prompt tokens one video may take; `None`: no limit beyond the frame caps.
    pub max_tokens: Option<usize>,
    /// Whether the video's own audio track is served with its frames (`use_audio_in_video`):
    /// it enters the identity ([`identity::with_audio_track`]).
    pub audio_track: bool,
}

/// A video as the request plan holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct VideoPlan {
    pub info: VideoInfo,
    /// The sampled frame indices.
    pub indices: Vec<u64>,
    pub grid_thw: [u32; 3],
    pub resized_width: u32,
    pub resized_height: u32,
    /// Placeholder tokens: `t * h * w / merge^2`.
    pub tokens: usize,
    pub mm_hash: u64,
}

fn plan_from_info(
    data: &[u8],
    info: VideoInfo,
    options: &VideoOptions,
) -> Result<VideoPlan, VideoError> {
    let indices = sample_indices(info.meta(), options.sampling)?;
    let g = options.geometry;
    let (height, width) = options
        .resize
        .target(indices.len(), info.width, info.height, g)?;
    let temporal = g.temporal.max(1) as usize;
    let grid_t = u32::try_from(indices.len().div_ceil(temporal))
        .map_err(|_| VideoError::Corrupt("too many sampled frames".into()))?;
    let grid_thw = [grid_t, height / g.patch.max(1), width / g.patch.max(1)];
    let merge = g.merge.max(1) as usize;
    let tokens = grid_thw.iter().map(|&v| v as usize).product::<usize>() / (merge * merge);
    if let Some(limit) = options.max_tokens.filter(|&limit| tokens > limit) {
        return Err(VideoError::TooManyTokens { tokens, limit });
    }
    let mm_hash = identity::video(identity::content(data), &options.sampling, &options.resize);
    let mm_hash = if options.audio_track {
        identity::with_audio_track(mm_hash)
    } else {
        mm_hash
    };
    Ok(VideoPlan {
        info,
        indices,
        grid_thw,
        resized_width: width,
        resized_height: height,
        tokens,
        mm_hash,
    })
}

/// The plan of a video from its headers alone.
pub fn plan_video(data: &[u8], options: &VideoOptions) -> Result<VideoPlan, VideoError> {
    let info = probe_video(data, &options.limits)?;
    plan_from_info(data, info, options)
}

/// The plan and the model inputs; decoding stops after the last sampled frame, and each frame
/// is resized as soon as it is decoded (only resized frames are kept).
pub fn process_video(
    data: &[u8],
    options: &VideoOptions,
    lut: &NormalizeLut,
) -> Result<(VideoPlan, ProcessedVideo), VideoError> {
    let plan = plan_video(data, options)?;
    let (width, height) = (plan.resized_width, plan.resized_height);
    let mut resized = Vec::with_capacity(plan.indices.len());
    decode_frames_with(data, &plan.indices, &options.limits, |frame| {
        resized.push(resize_frame(frame, width, height, &options.resize)?);
        Ok(())
    })?;
    let processed = patchify_resized(&resized, lut, options.geometry)?;
    if processed.grid_thw != plan.grid_thw {
        return Err(VideoError::Corrupt(format!(
            "decoded frames give grid {:?}, the headers {:?}",
            processed.grid_thw, plan.grid_thw
        )));
    }
    Ok((plan, processed))
}
