//! How a Qwen2.5-Omni checkpoint's config files read into the spec. Its thinker takes images
//! and videos as Qwen2.5-VL does (`Qwen2VLImageProcessor`'s keys against `vision_config`) and
//! clips as Qwen2-Audio does (`WhisperFeatureExtractor`'s keys, in the same
//! `preprocessor_config.json`); the thinker's config names its tokens `*_token_index` and
//! spaces positions by `position_id_per_seconds`. The class defaults of
//! `Qwen2_5OmniThinkerConfig` fill what the files leave out.

use serde_json::Value;

use crate::family::config::{as_u32, ConfigFiles, FamilyFacts};
use crate::family::qwen_vl::{self, QWEN2_VL};
use crate::family::registry::FamilyName;
use crate::family::spec::{invalid, AudioSpec, Spec, SpecError, TrackInVideo};
use crate::family::{qwen2_audio, qwen_vl::QwenVariant};

/// `Qwen2_5OmniThinkerConfig`'s defaults (and its tokenizer's vision bos and eos).
mod defaults {
    pub const IMAGE_TOKEN_INDEX: u32 = 151_655;
    pub const VIDEO_TOKEN_INDEX: u32 = 151_656;
    pub const AUDIO_TOKEN_INDEX: u32 = 151_646;
    pub const AUDIO_START_TOKEN_ID: u32 = 151_647;
    pub const AUDIO_END_TOKEN_ID: u32 = 151_648;
    pub const SECONDS_PER_CHUNK: f64 = 2.0;
    pub const VISION_START_TOKEN_ID: u32 = 151_652;
    pub const VISION_END_TOKEN_ID: u32 = 151_653;
    pub const POSITION_ID_PER_SECONDS: f64 = 25.0;
}

/// The thinker's images and videos follow Qwen2-VL's processors; its positions are its own.
const VISION: QwenVariant = QWEN2_VL;

/// A token id under the first of `keys` the config names (the thinker's, then Qwen-VL's), else
/// the class default.
pub(crate) fn token(
    files: &ConfigFiles,
    keys: &[&'static str],
    default: u32,
) -> Result<u32, SpecError> {
    keys.iter()
        .find_map(|&key| {
            files
                .config
                .get(key)
                .filter(|v| !v.is_null())
                .map(|v| as_u32(v, key))
        })
        .unwrap_or(Ok(default))
}

/// The number the config names `key`, else the class default.
pub(crate) fn number(
    files: &ConfigFiles,
    key: &'static str,
    default: f64,
) -> Result<f64, SpecError> {
    match files.config.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v
            .as_f64()
            .ok_or_else(|| invalid(key, format!("expected a number, got {v}"))),
    }
}

/// The files as Qwen-VL's reader takes them: the thinker's `ids` under Qwen-VL's names.
pub(crate) fn with_vision_ids(files: &ConfigFiles, ids: [(&str, u32); 4]) -> ConfigFiles {
    let mut vision_files = files.clone();
    for (key, id) in ids {
        vision_files.config.insert(key.to_owned(), id.into());
    }
    vision_files
}

pub(super) fn read(
    name: FamilyName,
    files: &ConfigFiles,
) -> Result<(Spec, FamilyFacts), SpecError> {
    use defaults as d;

    let ids = [
        (
            "image_token_id",
            token(
                files,
                &["image_token_index", "image_token_id"],
                d::IMAGE_TOKEN_INDEX,
            )?,
        ),
        (
            "video_token_id",
            token(
                files,
                &["video_token_index", "video_token_id"],
                d::VIDEO_TOKEN_INDEX,
            )?,
        ),
        (
            "vision_start_token_id",
            token(files, &["vision_start_token_id"], d::VISION_START_TOKEN_ID)?,
        ),
        (
            "vision_end_token_id",
            token(files, &["vision_end_token_id"], d::VISION_END_TOKEN_ID)?,
        ),
    ];
    let (mut spec, facts) = qwen_vl::config::read(&VISION, name, &with_vision_ids(files, ids))?;
    let audio_token_id = token(
        files,
        &["audio_token_index", "audio_token_id"],
        d::AUDIO_TOKEN_INDEX,
    )?;
    let in_video = TrackInVideo {
        audio_start_token_id: token(files, &["audio_start_token_id"], d::AUDIO_START_TOKEN_ID)?,
        audio_end_token_id: token(files, &["audio_end_token_id"], d::AUDIO_END_TOKEN_ID)?,
        seconds_per_chunk: number(files, "seconds_per_chunk", d::SECONDS_PER_CHUNK)?,
    };
    spec.audio = Some(AudioSpec {
        in_video: Some(in_video),
        ..qwen2_audio::config::audio_spec(files, audio_token_id)?
    });
    spec.tokens_per_second = Some(number(
        files,
        "position_id_per_seconds",
        d::POSITION_ID_PER_SECONDS,
    )?);
    spec.validate()?;
    Ok((spec, facts))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::family::registry::{checkpoint_from_hf_configs, spec_from_hf_configs};

    /// A Qwen2.5-Omni checkpoint's preprocessor: the image processor's and the extractor's
    /// keys in one file.
    pub(crate) const PREPROCESSOR: &str = r#"{"feature_extractor_type": "WhisperFeatureExtractor",
        "image_processor_type": "Qwen2VLImageProcessor", "feature_size": 128,
        "sampling_rate": 16000, "hop_length": 160, "n_fft": 400, "chunk_length": 300,
        "n_samples": 4800000, "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14,
        "merge_size": 2, "temporal_patch_size": 2}"#;
    /// As the real checkpoints: the thinker's config inside the composite model's.
    pub(crate) const CONFIG: &str = r#"{"model_type": "qwen2_5_omni", "enable_audio_output": true,
        "thinker_config": {"model_type": "qwen2_5_omni_thinker", "audio_token_index": 151646,
            "image_token_index": 151655, "video_token_index": 151656,
            "position_id_per_seconds": 25, "seconds_per_chunk": 2,
            "audio_config": {"num_mel_bins": 128},
            "vision_config": {"patch_size": 14, "spatial_merge_size": 2},
            "text_config": {"vocab_size": 152064, "hidden_size": 64, "num_hidden_layers": 2}},
        "talker_config": {"vocab_size": 8448}}"#;

    #[test]
    fn the_thinker_reads_images_and_clips_from_one_preprocessor() {
        let spec = spec_from_hf_configs(PREPROCESSOR, CONFIG).unwrap();
        assert_eq!(spec.family, FamilyName::Qwen25Omni);
        assert_eq!(
            (spec.image_token_id, spec.video_token_id),
            (151_655, Some(151_656))
        );
        assert_eq!(
            (spec.vision_start_token_id, spec.vision_end_token_id),
            (151_652, 151_653)
        );
        assert_eq!(spec.tokens_per_second, Some(25.0));
        let audio = spec.audio.unwrap();
        assert_eq!(audio.audio_token_id, 151_646);
        let in_video = audio.in_video.unwrap();
        assert_eq!(
            (in_video.audio_start_token_id, in_video.audio_end_token_id),
            (151_647, 151_648)
        );
        assert_eq!(in_video.seconds_per_chunk, 2.0);
        assert_eq!(audio.log_mel().chunk_samples(), 4_800_000);
        assert_eq!(Spec::from_json(&spec.to_json()).unwrap(), spec);
        // The text model's facts are the thinker's, not the talker's.
        let checkpoint = checkpoint_from_hf_configs(PREPROCESSOR, CONFIG, None).unwrap();
        assert_eq!(checkpoint.model.vocab_size, 152_064);
        let err = spec_from_hf_configs(r#"{"feature_size": 80}"#, CONFIG).unwrap_err();
        assert_eq!(err.code(), "spec.inconsistent");
    }
}
