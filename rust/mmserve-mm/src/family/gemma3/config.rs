//! How a Gemma 3 checkpoint's config files read into the spec: `Gemma3ImageProcessor`'s keys
//! and `Gemma3Config`'s (SigLIP's tower size and patch, the tokens per image, the image
//! tokens), their class defaults where the files leave a key out.

use serde_json::Value;

use crate::family::config::{
    as_u32, as_u64, resample, ConfigFiles, FamilyFacts, Normalize, Object,
};
use crate::family::registry::FamilyName;
use crate::family::spec::{invalid, Spec, SpecError};
use crate::image::pan_and_scan::PanAndScan;

/// Defaults of transformers' `Gemma3ImageProcessor` and `Gemma3Config` / SigLIP's vision
/// config, used only where the files leave a key out.
mod gemma3_defaults {
    pub const IMAGE_MEAN: [f64; 3] = [0.5; 3];
    pub const IMAGE_STD: [f64; 3] = [0.5; 3];
    pub const RESAMPLE_BILINEAR: i64 = 2;
    pub const IMAGE_SIZE: u64 = 224;
    pub const PATCH_SIZE: u64 = 16;
    pub const MM_TOKENS_PER_IMAGE: u64 = 256;
    pub const BOI_TOKEN_INDEX: u64 = 255_999;
    pub const EOI_TOKEN_INDEX: u64 = 256_000;
    pub const IMAGE_TOKEN_INDEX: u64 = 262_144;
}

/// `do_pan_and_scan` and the `pan_and_scan_*` knobs (null or left out: the processor's
/// defaults, `Gemma3Processor.images_kwargs`).
fn gemma3_pan_and_scan(pp: &Object) -> Result<(PanAndScan, bool), SpecError> {
    let enabled = match pp.get("do_pan_and_scan") {
        None | Some(Value::Null) => false,
        Some(v) => v
            .as_bool()
            .ok_or_else(|| invalid("do_pan_and_scan", format!("expected a boolean, got {v}")))?,
    };
    let d = PanAndScan::DEFAULT;
    let count = |key: &'static str, default: u32| match pp.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => as_u32(v, key),
    };
    let ratio = match pp.get("pan_and_scan_min_ratio_to_activate") {
        None | Some(Value::Null) => d.min_ratio_to_activate,
        Some(v) => v.as_f64().ok_or_else(|| {
            invalid(
                "pan_and_scan_min_ratio_to_activate",
                format!("expected a number, got {v}"),
            )
        })?,
    };
    let knobs = PanAndScan::new(
        count("pan_and_scan_min_crop_size", d.min_crop_size)?,
        count("pan_and_scan_max_num_crops", d.max_num_crops)?,
        ratio,
    )?;
    Ok((knobs, enabled))
}

/// The spec of a Gemma 3 checkpoint: every image resized to the tower's square input; the
/// projector average-pools the patch grid to `mm_tokens_per_image` tokens, so the pool's kernel
/// is the merge size.
pub(super) fn read(files: &ConfigFiles) -> Result<(Spec, FamilyFacts), SpecError> {
    use gemma3_defaults as d;

    let (pp, cfg) = (&files.preprocessor, &files.config);

    let (pan_and_scan, do_pan_and_scan) = gemma3_pan_and_scan(pp)?;
    let vision = files.vision_config();
    let vision_u64 = |key: &'static str, default: u64| {
        vision
            .and_then(|v| v.get(key))
            .map(|v| as_u64(v, key))
            .transpose()
            .map(|v| v.unwrap_or(default))
    };
    let tower_side = vision_u64("image_size", d::IMAGE_SIZE)?;
    let patch = vision_u64("patch_size", d::PATCH_SIZE)?;
    let size = pp.get("size");
    for edge in ["height", "width"] {
        if let Some(v) = size.and_then(|s| s.get(edge)) {
            let side = as_u64(v, "size")?;
            if side != tower_side {
                return Err(SpecError::Inconsistent {
                    field: "size",
                    preprocessor: side,
                    model: tower_side,
                });
            }
        }
    }
    let tokens = match cfg.get("mm_tokens_per_image").filter(|v| !v.is_null()) {
        Some(v) => as_u64(v, "mm_tokens_per_image")?,
        None => d::MM_TOKENS_PER_IMAGE,
    };
    // As `Gemma3MultiModalProjector`: a square token grid, a whole pool kernel.
    const MAX_TOKENS: u64 = 1 << 20;
    let tokens_per_side = (1..=MAX_TOKENS.min(tokens))
        .find(|s| s * s >= tokens)
        .unwrap_or(0);
    if patch == 0 || tokens == 0 || tokens_per_side * tokens_per_side != tokens {
        return Err(invalid(
            "mm_tokens_per_image",
            format!("{tokens} is not a square number of tokens"),
        ));
    }
    let patches_per_side = tower_side / patch;
    if !tower_side.is_multiple_of(patch) || !patches_per_side.is_multiple_of(tokens_per_side) {
        return Err(invalid(
            "vision_config.image_size",
            format!("{tower_side} / patch {patch} does not pool to {tokens_per_side} per side"),
        ));
    }
    let to_u32 = |v: u64, field: &'static str| {
        u32::try_from(v).map_err(|_| invalid(field, format!("{v} is too large")))
    };
    let side = to_u32(tower_side, "vision_config.image_size")?;
    let token_id = |key: &str, field: &'static str, default: u64| {
        if cfg.contains_key(key) {
            files.token(key, field)
        } else {
            to_u32(default, field)
        }
    };
    let normalize = Normalize::read(pp, d::IMAGE_MEAN, d::IMAGE_STD)?;
    let spec = Spec {
        family: FamilyName::Gemma3,
        patch_size: to_u32(patch, "vision_config.patch_size")?,
        merge_size: to_u32(patches_per_side / tokens_per_side, "mm_tokens_per_image")?,
        temporal_patch_size: 1,
        min_pixels: tower_side * tower_side,
        max_pixels: tower_side * tower_side,
        image_mean: normalize.image_mean,
        image_std: normalize.image_std,
        rescale_factor: normalize.rescale_factor,
        resample: resample(pp, d::RESAMPLE_BILINEAR)?,
        backend: normalize.backend,
        image_token_id: token_id(
            "image_token_index",
            "image_token_index",
            d::IMAGE_TOKEN_INDEX,
        )?,
        vision_start_token_id: token_id("boi_token_index", "boi_token_index", d::BOI_TOKEN_INDEX)?,
        vision_end_token_id: token_id("eoi_token_index", "eoi_token_index", d::EOI_TOKEN_INDEX)?,
        image_size: Some([side, side]),
        video_token_id: None,
        tokens_per_second: None,
        pan_and_scan: Some(pan_and_scan),
        do_pan_and_scan,
        pixel_bounds: None,
        audio: None,
    };
    spec.validate()?;
    Ok((spec, FamilyFacts::default()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::registry::spec_from_hf_configs;
    use crate::image::resize::{Backend, Filter};

    const GEMMA3_PREPROCESSOR: &str = r#"{
        "image_processor_type": "Gemma3ImageProcessor", "do_pan_and_scan": null,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2,
        "rescale_factor": 0.00392156862745098, "size": {"height": 896, "width": 896}}"#;
    const GEMMA3_CONFIG: &str = r#"{"model_type": "gemma3", "mm_tokens_per_image": 256,
        "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
        "vision_config": {"image_size": 896, "patch_size": 14}}"#;

    #[test]
    fn gemma3_spec_is_a_fixed_size_pooled_grid() {
        let spec = spec_from_hf_configs(GEMMA3_PREPROCESSOR, GEMMA3_CONFIG).unwrap();
        assert_eq!(spec.family, FamilyName::Gemma3);
        assert_eq!(spec.image_size, Some([896, 896]));
        assert_eq!((spec.patch_size, spec.merge_size), (14, 4));
        assert_eq!((spec.min_pixels, spec.max_pixels), (896 * 896, 896 * 896));
        assert_eq!(spec.resample, Filter::Bilinear);
        assert_eq!(spec.backend, Backend::TorchU8);
        assert_eq!(
            (
                spec.image_token_id,
                spec.vision_start_token_id,
                spec.vision_end_token_id
            ),
            (262144, 255999, 256000)
        );
        assert_eq!(Spec::from_json(&spec.to_json()).unwrap(), spec);
        // Left out, the keys take the processor's and Gemma3Config's defaults.
        let config = r#"{"model_type": "gemma3", "vision_config": {"image_size": 896,
            "patch_size": 14}}"#;
        let bare = spec_from_hf_configs("{}", config).unwrap();
        assert_eq!(
            bare,
            Spec {
                backend: Backend::TorchU8,
                ..spec
            }
        );
        // SigLIP's own defaults (224 / 16) do not pool to 16 x 16 tokens.
        let err = spec_from_hf_configs("{}", r#"{"model_type": "gemma3"}"#).unwrap_err();
        assert_eq!(err.code(), "spec.invalid");
    }

    #[test]
    fn gemma3_spec_reads_pan_and_scan_and_its_knobs() {
        let spec = spec_from_hf_configs(GEMMA3_PREPROCESSOR, GEMMA3_CONFIG).unwrap();
        assert_eq!(
            (spec.pan_and_scan, spec.do_pan_and_scan),
            (Some(PanAndScan::DEFAULT), false)
        );
        let pp = r#"{"do_pan_and_scan": true, "pan_and_scan_min_crop_size": 32,
            "pan_and_scan_max_num_crops": 2, "pan_and_scan_min_ratio_to_activate": 1.5}"#;
        let spec = spec_from_hf_configs(pp, GEMMA3_CONFIG).unwrap();
        assert!(spec.do_pan_and_scan);
        assert_eq!(
            spec.pan_and_scan,
            Some(PanAndScan::new(32, 2, 1.5).unwrap())
        );
        assert_eq!(Spec::from_json(&spec.to_json()).unwrap(), spec);
        let knobless = Spec {
            pan_and_scan: None,
            ..spec
        };
        let err = Spec::from_json(&knobless.to_json()).unwrap_err();
        assert_eq!(err.code(), "spec.invalid");
    }

    #[test]
    fn gemma3_refusals_name_their_cause() {
        for (pp, field) in [
            (r#"{"do_pan_and_scan": "yes"}"#, "do_pan_and_scan"),
            (
                r#"{"pan_and_scan_max_num_crops": 0}"#,
                "pan_and_scan_max_num_crops",
            ),
            (
                r#"{"pan_and_scan_min_crop_size": -1}"#,
                "pan_and_scan_min_crop_size",
            ),
            (
                r#"{"pan_and_scan_min_ratio_to_activate": "1"}"#,
                "pan_and_scan_min_ratio",
            ),
        ] {
            let err = spec_from_hf_configs(pp, GEMMA3_CONFIG).unwrap_err();
            assert_eq!(err.code(), "spec.invalid");
            assert!(err.to_string().contains(field), "{err}");
        }
        let other_size = r#"{"size": {"height": 448, "width": 448}}"#;
        let err = spec_from_hf_configs(other_size, GEMMA3_CONFIG).unwrap_err();
        assert_eq!(err.code(), "spec.inconsistent");
        for tokens in ["0", "200", "18446744073709551615"] {
            let config = GEMMA3_CONFIG.replace("256,", &format!("{tokens},"));
            let err = spec_from_hf_configs("{}", &config).unwrap_err();
            assert_eq!(err.code(), "spec.invalid", "{tokens}");
        }
        let mut spec = spec_from_hf_configs("{}", GEMMA3_CONFIG).unwrap();
        spec.min_pixels = 1;
        assert_eq!(
            Spec::from_json(&spec.to_json()).unwrap_err().code(),
            "spec.invalid"
        );
    }
}
