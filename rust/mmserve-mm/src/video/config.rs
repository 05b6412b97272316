//! A checkpoint's video processor settings, read as transformers 5.24's
//! `Qwen2VLVideoProcessor` or `Qwen3VLVideoProcessor` reads them:
//! `video_preprocessor_config.json`, or, for checkpoints without one,
//! `preprocessor_config.json`. Qwen2-VL's `min_pixels` / `max_pixels` override `size`, as its
//! `__init__` does; Qwen3-VL's processor reads `size` alone. Unset keys take the class
//! defaults.

use serde_json::Value;

use crate::family::config::{as_triple, as_u32, as_u64, parse_object};
use crate::family::spec::{invalid, SpecError};
use crate::image::resize::Filter;
use crate::image::transforms::PatchGeometry;
use crate::video::frames::VideoResize;
use crate::video::sampling::Sampling;
use crate::video::VideoFamily;

/// OpenAI CLIP's mean and std, the Qwen2-VL defaults.
pub const CLIP_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
pub const CLIP_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];
/// transformers' `IMAGENET_STANDARD_MEAN` / `_STD`, the Qwen3-VL defaults.
pub const HALF: [f64; 3] = [0.5; 3];

/// A family's class defaults that differ between the two processors.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FamilyDefaults {
    pub resize: VideoResize,
    pub patch_size: u32,
    pub mean: [f64; 3],
    pub std: [f64; 3],
    /// `fps` when sampling and the config names no rate.
    pub fps: Option<f64>,
    pub do_sample_frames: bool,
}

impl FamilyDefaults {
    pub fn of(family: VideoFamily) -> FamilyDefaults {
        match family {
            VideoFamily::Qwen2Vl => FamilyDefaults {
                resize: VideoResize::QWEN2_VL,
                patch_size: 14,
                mean: CLIP_MEAN,
                std: CLIP_STD,
                fps: None,
                do_sample_frames: false,
            },
            VideoFamily::Qwen3Vl => FamilyDefaults {
                resize: VideoResize::QWEN3_VL,
                patch_size: 16,
                mean: HALF,
                std: HALF,
                fps: Some(2.0),
                do_sample_frames: true,
            },
        }
    }
}

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

/// The settings in `json` for `family`'s processor; steps the core does not implement
/// exactly (no resize, no rescale or normalisation, another resampling filter) and a config
/// naming the other family's processor are refused.
pub fn video_config_from_hf(
    json: &str,
    family: VideoFamily,
) -> Result<VideoProcessorConfig, SpecError> {
    let map = parse_object(json, "video_preprocessor_config.json")?;
    let defaults = FamilyDefaults::of(family);
    if let Some(kind) = map.get("video_processor_type").and_then(Value::as_str) {
        if kind != family.processor_class() {
            return Err(invalid(
                "video_processor_type",
                format!("{kind} is not {}", family.processor_class()),
            ));
        }
    }
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
    let size = map.get("size");
    let edge = |key: &'static str| -> Result<Option<u64>, SpecError> {
        size.and_then(|s| s.get(key))
            .map(|v| as_u64(v, key))
            .transpose()
    };
    // Only Qwen2-VL's processor lets `min_pixels` / `max_pixels` stand for `size`.
    let pixels = |key: &'static str| match family {
        VideoFamily::Qwen2Vl => integer(&map, key),
        VideoFamily::Qwen3Vl => Ok(None),
    };
    let min_pixels = pixels("min_pixels")?
        .or(edge("shortest_edge")?)
        .unwrap_or(defaults.resize.min_pixels);
    let max_pixels = pixels("max_pixels")?
        .or(edge("longest_edge")?)
        .unwrap_or(defaults.resize.max_pixels);
    let get_u32 = |key: &'static str, default: u32| -> Result<u32, SpecError> {
        map.get(key).map_or(Ok(default), |v| as_u32(v, key))
    };
    let geometry = PatchGeometry {
        patch: get_u32("patch_size", defaults.patch_size)?,
        merge: get_u32("merge_size", 2)?,
        temporal: get_u32("temporal_patch_size", 2)?,
    };
    if geometry.patch == 0 || geometry.merge == 0 || geometry.temporal == 0 {
        return Err(invalid(
            "patch_size",
            "patch, merge and temporal sizes must be positive",
        ));
    }
    // Frames are sampled only when the config asks for it (Qwen2-VL's default is not to,
    // Qwen3-VL's is, at 2 fps unless the config sets `fps` to null).
    let sample = flag(&map, "do_sample_frames", defaults.do_sample_frames)?;
    let fps = match map.get("fps") {
        None => defaults.fps,
        Some(_) => number(&map, "fps")?,
    };
    let sampling = Sampling {
        family,
        fps: if sample { fps } else { None },
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
        max_video_tokens: integer(&map, "max_video_tokens")?
            .unwrap_or(defaults.resize.max_video_tokens),
        ..defaults.resize
    };
    let triple = |key: &'static str, default: [f64; 3]| -> Result<[f64; 3], SpecError> {
        map.get(key).map_or(Ok(default), |v| as_triple(v, key))
    };
    Ok(VideoProcessorConfig {
        sampling,
        resize,
        geometry,
        mean: triple("image_mean", defaults.mean)?,
        std: triple("image_std", defaults.std)?,
        rescale: number(&map, "rescale_factor")?.unwrap_or(1.0 / 255.0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_overrides() {
        let c = video_config_from_hf("{}", VideoFamily::Qwen2Vl).unwrap();
        assert_eq!(c.resize, VideoResize::QWEN2_VL);
        assert_eq!((c.sampling.fps, c.sampling.num_frames), (None, None));
        let c = video_config_from_hf(
            r#"{"do_sample_frames": true, "fps": 2.0, "size": {"shortest_edge": 3136,
                "longest_edge": 50176}, "max_pixels": 100352, "cap_pixels_per_frame": true}"#,
            VideoFamily::Qwen2Vl,
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
            assert!(
                video_config_from_hf(json, VideoFamily::Qwen2Vl).is_err(),
                "{json}"
            );
        }
        let qwen3 = r#"{"video_processor_type": "Qwen3VLVideoProcessor"}"#;
        assert!(video_config_from_hf(qwen3, VideoFamily::Qwen2Vl).is_err());
    }

    #[test]
    fn qwen3_defaults_and_size_alone() {
        let c = video_config_from_hf(
            r#"{"max_pixels": 1000, "size": {"longest_edge": 65536}}"#,
            VideoFamily::Qwen3Vl,
        )
        .unwrap();
        assert_eq!(c.sampling.fps, Some(2.0));
        assert_eq!(c.geometry.patch, 16);
        assert_eq!(c.mean, HALF);
        assert_eq!(
            (c.resize.min_pixels, c.resize.max_pixels),
            (VideoResize::QWEN3_VL.min_pixels, 65536)
        );
        let every = video_config_from_hf(r#"{"do_sample_frames": false}"#, VideoFamily::Qwen3Vl);
        assert_eq!(every.unwrap().sampling.fps, None);
    }
}
