//! A checkpoint's video processor settings, read as transformers 5.24's
//! `Qwen2VLVideoProcessor` reads them: `video_preprocessor_config.json`, or, for checkpoints
//! without one, `preprocessor_config.json` (whose `min_pixels` / `max_pixels` then override
//! `size`, as the processor's `__init__` does). Unset keys take the class defaults.

use serde_json::Value;

use crate::family::registry::{as_triple, as_u32, as_u64, invalid, parse_object, SpecError};
use crate::image::resize::Filter;
use crate::image::transforms::PatchGeometry;
use crate::video::frames::VideoResize;
use crate::video::sampling::Sampling;

/// OpenAI CLIP's mean and std, the Qwen-VL defaults.
pub const CLIP_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
pub const CLIP_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];

/// Everything the processor's config decides.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VideoProcessorConfig {
    pub sampling: Sampling,
    pub resize: VideoResize,
    pub geometry: PatchGeometry,
    pub mean: [f64; 3],
    pub std: [f64; 3],
    pub rescale: f64,
}

fn flag(
    map: &serde_json::Map<String, Value>,
    key: &'static str,
    default: bool,
) -> Result<bool, SpecError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(invalid(key, format!("expected true or false, got {v}"))),
    }
}

fn number(
    map: &serde_json::Map<String, Value>,
    key: &'static str,
) -> Result<Option<f64>, SpecError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| invalid(key, format!("expected a number, got {v}"))),
    }
}

fn integer(
    map: &serde_json::Map<String, Value>,
    key: &'static str,
) -> Result<Option<u64>, SpecError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => as_u64(v, key).map(Some),
    }
}

/// The settings in `json`; steps the core does not implement exactly (no resize, no
/// rescale or normalisation, another resampling filter) are refused.
pub fn video_config_from_hf(json: &str) -> Result<VideoProcessorConfig, SpecError> {
    let map = parse_object(json, "video_preprocessor_config.json")?;
    for key in ["do_resize", "do_rescale", "do_normalize", "do_convert_rgb"] {
        if !flag(&map, key, true)? {
            return Err(invalid(key, "only true is supported"));
        }
    }
    if let Some(code) = integer(&map, "resample")? {
        let filter =
            Filter::from_pil_code(code as i64).map_err(|e| invalid("resample", e.to_string()))?;
        if filter != Filter::Bicubic {
            return Err(invalid(
                "resample",
                "only bicubic (3) is supported for video",
            ));
        }
    }
    let defaults = VideoResize::QWEN2_VL;
    let size = map.get("size");
    let edge = |key: &'static str| -> Result<Option<u64>, SpecError> {
        size.and_then(|s| s.get(key))
            .map(|v| as_u64(v, key))
            .transpose()
    };
    let min_pixels = integer(&map, "min_pixels")?
        .or(edge("shortest_edge")?)
        .unwrap_or(defaults.min_pixels);
    let max_pixels = integer(&map, "max_pixels")?
        .or(edge("longest_edge")?)
        .unwrap_or(defaults.max_pixels);
    let get_u32 = |key: &'static str, default: u32| -> Result<u32, SpecError> {
        map.get(key).map_or(Ok(default), |v| as_u32(v, key))
    };
    let geometry = PatchGeometry {
        patch: get_u32("patch_size", 14)?,
        merge: get_u32("merge_size", 2)?,
        temporal: get_u32("temporal_patch_size", 2)?,
    };
    if geometry.patch == 0 || geometry.merge == 0 || geometry.temporal == 0 {
        return Err(invalid(
            "patch_size",
            "patch, merge and temporal sizes must be positive",
        ));
    }
    // Frames are sampled only when the config asks for it (Qwen2-VL's default is not to).
    let sample = flag(&map, "do_sample_frames", false)?;
    let sampling = Sampling {
        fps: if sample { number(&map, "fps")? } else { None },
        num_frames: if sample {
            integer(&map, "num_frames")?
        } else {
            None
        },
        min_frames: integer(&map, "min_frames")?.unwrap_or(4),
        max_frames: integer(&map, "max_frames")?.unwrap_or(768),
        temporal_patch_size: u64::from(geometry.temporal),
    };
    let resize = VideoResize {
        min_pixels,
        max_pixels,
        cap_pixels_per_frame: flag(&map, "cap_pixels_per_frame", false)?,
        max_video_tokens: integer(&map, "max_video_tokens")?.unwrap_or(defaults.max_video_tokens),
        ..defaults
    };
    let triple = |key: &'static str, default: [f64; 3]| -> Result<[f64; 3], SpecError> {
        map.get(key).map_or(Ok(default), |v| as_triple(v, key))
    };
    Ok(VideoProcessorConfig {
        sampling,
        resize,
        geometry,
        mean: triple("image_mean", CLIP_MEAN)?,
        std: triple("image_std", CLIP_STD)?,
        rescale: number(&map, "rescale_factor")?.unwrap_or(1.0 / 255.0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_overrides() {
        let c = video_config_from_hf("{}").unwrap();
        assert_eq!(c.resize, VideoResize::QWEN2_VL);
        assert_eq!((c.sampling.fps, c.sampling.num_frames), (None, None));
        let c = video_config_from_hf(
            r#"{"do_sample_frames": true, "fps": 2.0, "size": {"shortest_edge": 3136,
                "longest_edge": 50176}, "max_pixels": 100352, "cap_pixels_per_frame": true}"#,
        )
        .unwrap();
        assert_eq!(c.sampling.fps, Some(2.0));
        assert_eq!((c.resize.min_pixels, c.resize.max_pixels), (3136, 100352));
        assert!(c.resize.cap_pixels_per_frame);
    }

    #[test]
    fn refuses_what_is_not_implemented() {
        for json in [
            r#"{"do_normalize": false}"#,
            r#"{"resample": 2}"#,
            r#"{"patch_size": 0}"#,
            r#"{"fps": "two", "do_sample_frames": true}"#,
            "[]",
        ] {
            assert!(video_config_from_hf(json).is_err(), "{json}");
        }
    }
}
