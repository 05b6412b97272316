//! How a Qwen-VL checkpoint's config files read into the spec: the image processor's keys
//! (`Qwen2VLImageProcessor(Pil)`), checked against the model's `vision_config`, its class
//! defaults where both leave a key out; and the facts only Qwen-VL states (deepstack).

use serde_json::Value;

use crate::family::config::{as_u64, ConfigFiles, FamilyFacts, Normalize, Object};
use crate::family::qwen_vl::QwenVariant;
use crate::family::registry::FamilyName;
use crate::family::spec::{invalid, Spec, SpecError};

/// Defaults of transformers' `Qwen2VLImageProcessor` (class attributes), used only for keys
/// that a `preprocessor_config.json` and the model's `vision_config` both leave out.
mod hf_defaults {
    pub const PATCH_SIZE: u64 = 14;
    pub const MERGE_SIZE: u64 = 2;
    pub const TEMPORAL_PATCH_SIZE: u64 = 2;
    pub const MIN_PIXELS: u64 = 56 * 56;
    pub const MAX_PIXELS: u64 = 28 * 28 * 1280;
    pub const IMAGE_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
    pub const IMAGE_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];
    pub const RESAMPLE_BICUBIC: i64 = 3;
}

/// The spec of a Qwen-VL checkpoint (`variant`'s `name`), and its deepstack layers.
pub(crate) fn read(
    variant: &QwenVariant,
    name: FamilyName,
    files: &ConfigFiles,
) -> Result<(Spec, FamilyFacts), SpecError> {
    let pp = &files.preprocessor;
    let vision = files.vision_config();
    let size = |key, vision_key, default| size_param(pp, key, vision, vision_key, default);
    let patch_size = size("patch_size", "patch_size", hf_defaults::PATCH_SIZE)?;
    let merge_size = size("merge_size", "spatial_merge_size", hf_defaults::MERGE_SIZE)?;
    let temporal_patch_size = size(
        "temporal_patch_size",
        "temporal_patch_size",
        hf_defaults::TEMPORAL_PATCH_SIZE,
    )?;

    // As transformers' constructor: `min_pixels`/`max_pixels` override `size`.
    let size = pp.get("size");
    let pixels = |flat: &'static str, edge: &str, default: u64| -> Result<u64, SpecError> {
        match (pp.get(flat), size.and_then(|s| s.get(edge))) {
            (Some(v), _) => as_u64(v, flat),
            (None, Some(v)) => as_u64(v, flat),
            (None, None) => Ok(default),
        }
    };
    let min_pixels = pixels("min_pixels", "shortest_edge", hf_defaults::MIN_PIXELS)?;
    let max_pixels = pixels("max_pixels", "longest_edge", hf_defaults::MAX_PIXELS)?;

    let Normalize {
        image_mean,
        image_std,
        rescale_factor,
        backend,
    } = Normalize::read(pp, hf_defaults::IMAGE_MEAN, hf_defaults::IMAGE_STD)?;
    let resample = crate::family::config::resample(pp, hf_defaults::RESAMPLE_BICUBIC)?;
    let token = |key: &'static str| files.token(key, key);

    let spec = Spec {
        family: name,
        patch_size,
        merge_size,
        temporal_patch_size,
        min_pixels,
        max_pixels,
        image_mean,
        image_std,
        rescale_factor,
        resample,
        backend,
        image_token_id: token("image_token_id")?,
        vision_start_token_id: token("vision_start_token_id")?,
        vision_end_token_id: token("vision_end_token_id")?,
        image_size: None,
        video_token_id: files.video_token()?,
        tokens_per_second: if variant.tokens_per_second {
            Some(tokens_per_second(vision)?)
        } else {
            None
        },
        pan_and_scan: None,
        do_pan_and_scan: false,
        pixel_bounds: None,
        audio: None,
    };
    spec.validate()?;
    let facts = FamilyFacts {
        deepstack_layers: if variant.deepstack {
            deepstack_layers(vision)?
        } else {
            0
        },
    };
    Ok((spec, facts))
}

/// A preprocessor value, checked against the model config's value for the same quantity.
fn size_param(
    preprocessor: &Object,
    key: &'static str,
    vision: Option<&Value>,
    vision_key: &str,
    default: u64,
) -> Result<u32, SpecError> {
    let from_preprocessor = preprocessor.get(key).map(|v| as_u64(v, key)).transpose()?;
    let from_model = vision
        .and_then(|v| v.get(vision_key))
        .map(|v| as_u64(v, key))
        .transpose()?;
    let value = match (from_preprocessor, from_model) {
        (Some(p), Some(m)) if p != m => {
            return Err(SpecError::Inconsistent {
                field: key,
                preprocessor: p,
                model: m,
            })
        }
        (Some(p), _) => p,
        (None, Some(m)) => m,
        (None, None) => default,
    };
    u32::try_from(value).map_err(|_| invalid(key, format!("{value} is too large")))
}

/// Qwen2.5-VL's `vision_config.tokens_per_second` (transformers' default 4 where the config
/// leaves it out).
fn tokens_per_second(vision: Option<&Value>) -> Result<f64, SpecError> {
    match vision.and_then(|v| v.get("tokens_per_second")) {
        None | Some(Value::Null) => Ok(4.0),
        Some(v) => v.as_f64().ok_or_else(|| {
            invalid(
                "vision_config.tokens_per_second",
                format!("expected a number, got {v}"),
            )
        }),
    }
}

/// Qwen3-VL's `vision_config.deepstack_visual_indexes`: how many vision layers' features are
/// added to the first decoder layers.
fn deepstack_layers(vision: Option<&Value>) -> Result<usize, SpecError> {
    match vision.and_then(|v| v.get("deepstack_visual_indexes")) {
        None | Some(Value::Null) => Ok(0),
        Some(Value::Array(layers)) => Ok(layers.len()),
        Some(v) => Err(invalid(
            "vision_config.deepstack_visual_indexes",
            format!("expected a list, got {v}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::registry::{checkpoint_from_hf_configs, spec_from_hf_configs};
    use crate::image::resize::{Backend, Filter};
    use crate::video::VideoFamily;

    const QWEN2_PREPROCESSOR: &str = r#"{
        "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14,
        "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor"}"#;
    const QWEN3_PREPROCESSOR: &str = r#"{
        "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
        "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "image_processor_type": "Qwen2VLImageProcessorPil"}"#;

    fn config(model_type: &str, patch: u32) -> String {
        format!(
            r#"{{"model_type": "{model_type}", "image_token_id": 151655,
                "vision_start_token_id": 151652, "vision_end_token_id": 151653,
                "vision_config": {{"patch_size": {patch}, "spatial_merge_size": 2}}}}"#
        )
    }

    #[test]
    fn qwen2_vl_spec_reads_flat_pixel_keys() {
        let spec = spec_from_hf_configs(QWEN2_PREPROCESSOR, &config("qwen2_vl", 14)).unwrap();
        assert_eq!(spec.family, FamilyName::Qwen2Vl);
        assert_eq!((spec.min_pixels, spec.max_pixels), (3136, 12845056));
        assert_eq!(spec.factor(), 28);
        assert_eq!(spec.backend, Backend::TorchU8);
        assert_eq!(spec.resample, Filter::Bicubic);
        assert_eq!(spec.image_token_id, 151655);
        assert_eq!(Spec::from_json(&spec.to_json()).unwrap(), spec);
    }

    #[test]
    fn qwen3_vl_spec_reads_size_dict() {
        let spec = spec_from_hf_configs(QWEN3_PREPROCESSOR, &config("qwen3_vl", 16)).unwrap();
        assert_eq!(spec.family, FamilyName::Qwen3Vl);
        assert_eq!((spec.min_pixels, spec.max_pixels), (65536, 16777216));
        assert_eq!(spec.image_mean, [0.5; 3]);
        assert_eq!(spec.factor(), 32);
        assert_eq!(spec.backend, Backend::Pil);
    }

    #[test]
    fn qwen3_vl_moe_spec_is_qwen3_vl_preprocessing() {
        let dense = spec_from_hf_configs(QWEN3_PREPROCESSOR, &config("qwen3_vl", 16)).unwrap();
        let moe = spec_from_hf_configs(QWEN3_PREPROCESSOR, &config("qwen3_vl_moe", 16)).unwrap();
        assert_eq!(moe.family, FamilyName::Qwen3VlMoe);
        assert_eq!(
            Spec {
                family: FamilyName::Qwen3Vl,
                ..moe.clone()
            },
            dense
        );
        assert_eq!(Spec::from_json(&moe.to_json()).unwrap(), moe);
        assert!(moe.to_json().contains("\"qwen3_vl_moe\""));
    }

    #[test]
    fn qwen3_5_specs_read_their_own_token_ids() {
        for (model_type, family) in [
            ("qwen3_5", FamilyName::Qwen35),
            ("qwen3_5_moe", FamilyName::Qwen35Moe),
        ] {
            let cfg = format!(
                r#"{{"model_type": "{model_type}", "image_token_id": 248056,
                    "video_token_id": 248057, "vision_start_token_id": 248053,
                    "vision_end_token_id": 248054,
                    "vision_config": {{"patch_size": 16, "spatial_merge_size": 2}}}}"#
            );
            let spec = spec_from_hf_configs(QWEN3_PREPROCESSOR, &cfg).unwrap();
            assert_eq!(spec.family, family);
            assert_eq!(family.video_processor(), Some(VideoFamily::Qwen3Vl));
            assert_eq!((spec.patch_size, spec.merge_size), (16, 2));
            assert_eq!(
                (
                    spec.image_token_id,
                    spec.video_token_id,
                    spec.vision_start_token_id,
                    spec.vision_end_token_id
                ),
                (248056, Some(248057), 248053, 248054)
            );
            assert_eq!(Spec::from_json(&spec.to_json()).unwrap(), spec);
            assert!(spec.to_json().contains(&format!("\"{model_type}\"")));
        }
    }

    #[test]
    fn flat_pixel_keys_override_the_size_dict() {
        let pp = r#"{"min_pixels": 1000, "size": {"shortest_edge": 5, "longest_edge": 9000}}"#;
        let spec = spec_from_hf_configs(pp, &config("qwen2_vl", 14)).unwrap();
        assert_eq!((spec.min_pixels, spec.max_pixels), (1000, 9000));
    }

    #[test]
    fn missing_preprocessor_keys_fall_back_to_the_vision_config() {
        let spec = spec_from_hf_configs("{}", &config("qwen3_vl", 16)).unwrap();
        assert_eq!(spec.patch_size, 16);
        assert_eq!(spec.min_pixels, 3136);
    }

    #[test]
    fn only_qwen3_vl_reads_deepstack_and_only_qwen2_5_vl_tokens_per_second() {
        let config = |model_type: &str| {
            format!(
                r#"{{"model_type": "{model_type}", "image_token_id": 1, "video_token_id": 2,
                    "vision_start_token_id": 3, "vision_end_token_id": 4, "vocab_size": 10,
                    "hidden_size": 8, "num_hidden_layers": 2,
                    "vision_config": {{"patch_size": 16, "deepstack_visual_indexes": [1, 2, 3],
                                       "tokens_per_second": 2}}}}"#
            )
        };
        let read =
            |model_type| checkpoint_from_hf_configs("{}", &config(model_type), None).unwrap();
        for (model_type, deepstack, tps, video) in [
            ("qwen2_vl", 0, None, VideoFamily::Qwen2Vl),
            ("qwen2_5_vl", 0, Some(2.0), VideoFamily::Qwen2Vl),
            ("qwen3_vl", 3, None, VideoFamily::Qwen3Vl),
            ("qwen3_vl_moe", 3, None, VideoFamily::Qwen3Vl),
            ("qwen3_5", 0, None, VideoFamily::Qwen3Vl),
            ("qwen3_5_moe", 0, None, VideoFamily::Qwen3Vl),
        ] {
            let checkpoint = read(model_type);
            assert_eq!(
                checkpoint.model.family.deepstack_layers, deepstack,
                "{model_type}"
            );
            assert_eq!(checkpoint.spec.tokens_per_second, tps, "{model_type}");
            assert_eq!(checkpoint.spec.family.video_processor(), Some(video));
        }
        let bare = config("qwen2_5_vl")
            .replace(r#""tokens_per_second": 2"#, r#""tokens_per_second": null"#);
        let spec = spec_from_hf_configs("{}", &bare).unwrap();
        assert_eq!(spec.tokens_per_second, Some(4.0));
    }

    #[test]
    fn refusals_name_their_cause() {
        let err = spec_from_hf_configs(QWEN2_PREPROCESSOR, &config("qwen2_vl", 16)).unwrap_err();
        assert_eq!(err.code(), "spec.inconsistent");
        let err = spec_from_hf_configs(r#"{"resample": 0}"#, &config("qwen2_vl", 14)).unwrap_err();
        assert_eq!(err.code(), "spec.invalid");
        let mut spec = spec_from_hf_configs("{}", &config("qwen2_vl", 14)).unwrap();
        spec.min_pixels = spec.max_pixels + 1;
        assert_eq!(
            Spec::from_json(&spec.to_json()).unwrap_err().code(),
            "spec.invalid"
        );
    }
}
