//! How a Qwen2-Audio checkpoint's config files read into the spec: `WhisperFeatureExtractor`'s
//! keys and `Qwen2AudioConfig`'s (the audio token, the encoder's mel bins), their class
//! defaults where the files leave a key out.

use serde_json::Value;

use crate::audio::features::Padding;
use crate::family::config::{as_u32, as_u64, ConfigFiles, FamilyFacts, Object};
use crate::family::registry::FamilyName;
use crate::family::spec::{invalid, AudioSpec, Spec, SpecError};
use crate::image::resize::{Backend, Filter};

/// Defaults of transformers' `WhisperFeatureExtractor` and `Qwen2AudioConfig`, used only where
/// the files leave a key out.
mod defaults {
    pub const FEATURE_SIZE: u64 = 80;
    pub const SAMPLING_RATE: u64 = 16000;
    pub const HOP_LENGTH: u64 = 160;
    pub const N_FFT: u64 = 400;
    pub const CHUNK_LENGTH: u64 = 30;
    pub const AUDIO_TOKEN_INDEX: u64 = 151_646;
}

/// A key of the preprocessor config as a count, its default where left out.
fn count(pp: &Object, key: &'static str, default: u64) -> Result<u64, SpecError> {
    match pp.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => as_u64(v, key),
    }
}

/// The spec of a Qwen2-Audio checkpoint. It takes no images: the image fields hold the
/// neutral values a spec validates with, and its capabilities say it takes none.
pub(super) fn read(files: &ConfigFiles) -> Result<(Spec, FamilyFacts), SpecError> {
    let audio_token_id = match files
        .config
        .get("audio_token_index")
        .filter(|v| !v.is_null())
    {
        Some(v) => as_u32(v, "audio_token_index")?,
        None => u32::try_from(defaults::AUDIO_TOKEN_INDEX)
            .map_err(|_| invalid("audio_token_index", "too large"))?,
    };
    let audio = audio_spec(files, audio_token_id)?;
    let spec = Spec {
        family: FamilyName::Qwen2Audio,
        patch_size: 1,
        merge_size: 1,
        temporal_patch_size: 1,
        min_pixels: 1,
        max_pixels: 1,
        image_mean: [0.0; 3],
        image_std: [1.0; 3],
        rescale_factor: 1.0,
        resample: Filter::Bicubic,
        backend: Backend::Pil,
        image_token_id: audio_token_id,
        vision_start_token_id: audio_token_id,
        vision_end_token_id: audio_token_id,
        image_size: None,
        video_token_id: None,
        tokens_per_second: None,
        pan_and_scan: None,
        do_pan_and_scan: false,
        pixel_bounds: None,
        audio: Some(audio),
    };
    spec.validate()?;
    Ok((spec, FamilyFacts::default()))
}

/// The audio part of a spec: `WhisperFeatureExtractor`'s keys in `preprocessor_config.json`
/// (its class defaults where left out), checked against the encoder's `audio_config.num_mel_bins`.
/// Padded to the chunk and cut to it, each clip's tokens counted by Qwen2-Audio's rule;
/// the Omni thinkers read their clips the same way and set their own processor's call.
pub(crate) fn audio_spec(files: &ConfigFiles, audio_token_id: u32) -> Result<AudioSpec, SpecError> {
    use defaults as d;

    let pp = &files.preprocessor;
    if let Some(kind) = pp.get("feature_extractor_type").and_then(Value::as_str) {
        if kind != "WhisperFeatureExtractor" {
            return Err(invalid(
                "feature_extractor_type",
                format!("{kind} is not WhisperFeatureExtractor"),
            ));
        }
    }
    let to_u32 = |v: u64, field: &'static str| {
        u32::try_from(v).map_err(|_| invalid(field, format!("{v} is too large")))
    };
    let feature_size = count(pp, "feature_size", d::FEATURE_SIZE)?;
    let sampling_rate = to_u32(
        count(pp, "sampling_rate", d::SAMPLING_RATE)?,
        "sampling_rate",
    )?;
    let chunk_length = to_u32(count(pp, "chunk_length", d::CHUNK_LENGTH)?, "chunk_length")?;
    let chunk_samples = u64::from(chunk_length) * u64::from(sampling_rate);
    let n_samples = count(pp, "n_samples", chunk_samples)?;
    if n_samples != chunk_samples {
        return Err(invalid(
            "n_samples",
            format!("{n_samples} is not chunk_length x sampling_rate ({chunk_samples})"),
        ));
    }
    if let Some(bins) = files
        .config
        .get("audio_config")
        .and_then(|a| a.get("num_mel_bins"))
    {
        let bins = as_u64(bins, "audio_config.num_mel_bins")?;
        if bins != feature_size {
            return Err(SpecError::Inconsistent {
                field: "feature_size",
                preprocessor: feature_size,
                model: bins,
            });
        }
    }
    let padding_value = match pp.get("padding_value") {
        None | Some(Value::Null) => 0.0,
        Some(v) => v
            .as_f64()
            .ok_or_else(|| invalid("padding_value", format!("expected a number, got {v}")))?
            as f32,
    };
    Ok(AudioSpec {
        audio_token_id,
        feature_size: usize::try_from(feature_size)
            .map_err(|_| invalid("feature_size", "too large"))?,
        sampling_rate,
        hop_length: usize::try_from(count(pp, "hop_length", d::HOP_LENGTH)?)
            .map_err(|_| invalid("hop_length", "too large"))?,
        n_fft: usize::try_from(count(pp, "n_fft", d::N_FFT)?)
            .map_err(|_| invalid("n_fft", "too large"))?,
        chunk_length,
        padding_value,
        padding: Padding::MaxLength,
        truncation: true,
        n_window: None,
        in_video: None,
    })
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::family::registry::{checkpoint_from_hf_configs, spec_from_hf_configs};

    pub(crate) const PREPROCESSOR: &str = r#"{"feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": 128, "sampling_rate": 16000, "hop_length": 160, "n_fft": 400,
        "chunk_length": 30, "n_samples": 480000, "padding_value": 0.0}"#;
    pub(crate) const CONFIG: &str = r#"{"model_type": "qwen2_audio", "audio_token_index": 151646,
        "audio_config": {"num_mel_bins": 128},
        "text_config": {"vocab_size": 151936, "hidden_size": 64, "num_hidden_layers": 2}}"#;

    #[test]
    fn qwen2_audio_spec_is_its_extractor_and_audio_token() {
        let spec = spec_from_hf_configs(PREPROCESSOR, CONFIG).unwrap();
        let audio = spec.audio.unwrap();
        assert_eq!(audio.audio_token_id, 151646);
        assert_eq!(
            (audio.feature_size, audio.hop_length, audio.n_fft),
            (128, 160, 400)
        );
        assert_eq!(audio.log_mel().chunk_samples(), 480_000);
        assert_eq!(Spec::from_json(&spec.to_json()).unwrap(), spec);
        let checkpoint = checkpoint_from_hf_configs(PREPROCESSOR, CONFIG, None).unwrap();
        assert_eq!(checkpoint.spec, spec);
        // Left out, the extractor's keys take WhisperFeatureExtractor's defaults (80 bins),
        // which the encoder's 128 contradict.
        let err = spec_from_hf_configs("{}", CONFIG).unwrap_err();
        assert_eq!(err.code(), "spec.inconsistent");
    }

    #[test]
    fn qwen2_audio_refusals_name_their_cause() {
        for (pp, field) in [
            (
                r#"{"feature_extractor_type": "Other"}"#,
                "feature_extractor_type",
            ),
            (r#"{"feature_size": 128, "n_samples": 1}"#, "n_samples"),
            (r#"{"feature_size": 128, "hop_length": 0}"#, "hop_length"),
        ] {
            let err = spec_from_hf_configs(pp, CONFIG).unwrap_err();
            assert_eq!(err.code(), "spec.invalid", "{pp}");
            assert!(err.to_string().contains(field), "{err}");
        }
    }
}
