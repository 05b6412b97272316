//! How a Qwen3-Omni-MoE checkpoint's config files read into the spec. The composite config's
//! `thinker_config` is the model served: its tokens are `*_token_id`, its positions spaced by
//! `position_id_per_seconds`, its vision tower Qwen3-VL's (`vision_config`: patch 16,
//! deepstack) behind `Qwen2VLImageProcessor`'s keys, its audio tower windowed by
//! `audio_config.n_window`; `WhisperFeatureExtractor`'s keys share `preprocessor_config.json`
//! with the image processor's. `Qwen3OmniMoeProcessor` calls the extractor with `padding=True,
//! truncation=False`: a clip keeps its length (bounded only by the operator's longest clip).
//! The class defaults of `Qwen3OmniMoeThinkerConfig` and its sub-configs fill what the files
//! leave out.

use serde_json::Value;

use crate::audio::features::Padding;
use crate::family::config::{as_u32, ConfigFiles, FamilyFacts, Object};
use crate::family::qwen2_5_omni::config::{number, token, with_vision_ids};
use crate::family::qwen2_audio::config::audio_spec;
use crate::family::qwen_vl::{self, QwenVariant, QWEN2_VL};
use crate::family::registry::FamilyName;
use crate::family::spec::{AudioSpec, Spec, SpecError};

/// `Qwen3OmniMoeThinkerConfig`'s defaults, its tokenizer's vision bos and eos, and its audio
/// and vision sub-configs' defaults.
mod defaults {
    pub const IMAGE_TOKEN_ID: u32 = 151_655;
    pub const VIDEO_TOKEN_ID: u32 = 151_656;
    pub const AUDIO_TOKEN_ID: u32 = 151_646;
    pub const VISION_START_TOKEN_ID: u32 = 151_652;
    pub const VISION_END_TOKEN_ID: u32 = 151_653;
    pub const POSITION_ID_PER_SECONDS: f64 = 25.0;
    pub const N_WINDOW: u32 = 50;
    pub const PATCH_SIZE: u32 = 16;
    pub const SPATIAL_MERGE_SIZE: u32 = 2;
    pub const TEMPORAL_PATCH_SIZE: u32 = 2;
    pub const DEEPSTACK_VISUAL_INDEXES: [u32; 3] = [8, 16, 24];
}

/// Images and videos follow Qwen2-VL's processors; the tower adds deepstack features.
const VISION: QwenVariant = QwenVariant {
    deepstack: true,
    ..QWEN2_VL
};

/// `vision_config` with `Qwen3OmniMoeVisionEncoderConfig`'s defaults where it leaves a key
/// out (Qwen-VL's reader would take Qwen2-VL's: patch 14, no deepstack).
fn with_vision_defaults(mut files: ConfigFiles) -> ConfigFiles {
    use defaults as d;

    let vision = files.config.entry("vision_config").or_insert(Value::Null);
    if vision.is_null() {
        *vision = Value::Object(Object::new());
    }
    if let Some(vision) = vision.as_object_mut() {
        for (key, default) in [
            ("patch_size", Value::from(d::PATCH_SIZE)),
            ("spatial_merge_size", Value::from(d::SPATIAL_MERGE_SIZE)),
            ("temporal_patch_size", Value::from(d::TEMPORAL_PATCH_SIZE)),
            (
                "deepstack_visual_indexes",
                Value::from(d::DEEPSTACK_VISUAL_INDEXES.to_vec()),
            ),
        ] {
            if vision.get(key).is_none_or(Value::is_null) {
                vision.insert(key.to_owned(), default);
            }
        }
    }
    files
}

pub(super) fn read(
    name: FamilyName,
    files: &ConfigFiles,
) -> Result<(Spec, FamilyFacts), SpecError> {
    use defaults as d;

    let ids = [
        (
            "image_token_id",
            token(files, &["image_token_id"], d::IMAGE_TOKEN_ID)?,
        ),
        (
            "video_token_id",
            token(files, &["video_token_id"], d::VIDEO_TOKEN_ID)?,
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
    let vision_files = with_vision_defaults(with_vision_ids(files, ids));
    let (mut spec, facts) = qwen_vl::config::read(&VISION, name, &vision_files)?;
    let audio_token_id = token(files, &["audio_token_id"], d::AUDIO_TOKEN_ID)?;
    let n_window = match files
        .config
        .get("audio_config")
        .and_then(|a| a.get("n_window"))
    {
        None | Some(Value::Null) => d::N_WINDOW,
        Some(v) => as_u32(v, "audio_config.n_window")?,
    };
    spec.audio = Some(AudioSpec {
        padding: Padding::Longest,
        truncation: false,
        n_window: Some(n_window),
        ..audio_spec(files, audio_token_id)?
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

    /// Qwen3-Omni-30B-A3B-Instruct's preprocessor: the image processor's and the extractor's
    /// keys in one file.
    pub(crate) const PREPROCESSOR: &str = r#"{"feature_extractor_type": "WhisperFeatureExtractor",
        "image_processor_type": "Qwen2VLImageProcessor", "feature_size": 128,
        "sampling_rate": 16000, "hop_length": 160, "n_fft": 400, "chunk_length": 300,
        "n_samples": 4800000, "padding_value": 0.0, "padding_side": "right",
        "return_attention_mask": true, "dither": 0.0, "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 16, "merge_size": 2,
        "temporal_patch_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": true, "do_rescale": true, "do_resize": true, "do_normalize": true,
        "rescale_factor": 0.00392156862745098, "resample": 3}"#;
    /// As the real checkpoint's (its ids and sub-configs' keys, tiny sizes): the thinker
    /// inside the composite config, beside a talker and a code-to-wave model.
    pub(crate) const CONFIG: &str = r#"{"model_type": "qwen3_omni_moe",
        "architectures": ["Qwen3OmniMoeForConditionalGeneration"], "enable_audio_output": true,
        "thinker_config": {"model_type": "qwen3_omni_moe_thinker", "audio_token_id": 151675,
            "image_token_id": 151655, "video_token_id": 151656, "audio_start_token_id": 151669,
            "audio_end_token_id": 151670, "vision_start_token_id": 151652,
            "vision_end_token_id": 151653, "position_id_per_seconds": 13,
            "seconds_per_chunk": 2, "user_token_id": 872,
            "audio_config": {"model_type": "qwen3_omni_moe_audio_encoder", "num_mel_bins": 128,
                "n_window": 50, "n_window_infer": 800},
            "vision_config": {"model_type": "qwen3_omni_moe_vision_encoder", "patch_size": 16,
                "spatial_merge_size": 2, "temporal_patch_size": 2,
                "deepstack_visual_indexes": [8, 16, 24]},
            "text_config": {"model_type": "qwen3_omni_moe_text", "vocab_size": 152064,
                "hidden_size": 64, "num_hidden_layers": 2, "max_position_embeddings": 65536}},
        "talker_config": {"model_type": "qwen3_omni_moe_talker", "audio_token_id": 151646,
            "audio_start_token_id": 151669, "text_config": {"vocab_size": 3072,
            "hidden_size": 32, "num_hidden_layers": 1}},
        "code2wav_config": {"codebook_size": 2048}}"#;

    #[test]
    fn the_thinker_reads_images_and_unpadded_clips_from_one_preprocessor() {
        let spec = spec_from_hf_configs(PREPROCESSOR, CONFIG).unwrap();
        assert_eq!(spec.family, FamilyName::Qwen3OmniMoe);
        assert_eq!(
            (spec.image_token_id, spec.video_token_id),
            (151_655, Some(151_656))
        );
        assert_eq!(
            (spec.vision_start_token_id, spec.vision_end_token_id),
            (151_652, 151_653)
        );
        assert_eq!((spec.patch_size, spec.merge_size), (16, 2));
        assert_eq!((spec.image_mean, spec.image_std), ([0.5; 3], [0.5; 3]));
        assert_eq!(spec.tokens_per_second, Some(13.0));
        let audio = spec.audio.unwrap();
        assert_eq!(audio.audio_token_id, 151_675);
        assert_eq!(audio.n_window, Some(50));
        // No use_audio_in_video: the request's option is refused by name.
        assert_eq!(audio.in_video, None);
        let extractor = audio.log_mel();
        assert_eq!(
            (extractor.padding, extractor.truncation),
            (Padding::Longest, false)
        );
        // A 35 s clip is neither padded nor cut: 3500 frames, all valid.
        assert_eq!(extractor.frames(35 * 16_000), (3500, 3500));
        let json = spec.to_json();
        assert!(json.contains(r#""padding":"longest""#), "{json}");
        assert_eq!(Spec::from_json(&json).unwrap(), spec);
        // The text model's facts are the thinker's, not the talker's; deepstack is Qwen3-VL's.
        let checkpoint = checkpoint_from_hf_configs(PREPROCESSOR, CONFIG, None).unwrap();
        assert_eq!(checkpoint.spec, spec);
        assert_eq!(checkpoint.model.vocab_size, 152_064);
        assert_eq!(
            (checkpoint.model.hidden_size, checkpoint.model.num_layers),
            (64, 2)
        );
        assert_eq!(checkpoint.model.max_position_embeddings, Some(65_536));
        assert_eq!(checkpoint.model.family.deepstack_layers, 3);
    }

    #[test]
    fn the_sub_configs_defaults_fill_what_the_files_leave_out() {
        // The class defaults: ids, 25 positions a second, a window of 50, patch 16 and three
        // deepstack layers.
        let bare = r#"{"model_type": "qwen3_omni_moe", "thinker_config": {
            "text_config": {"vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1}}}"#;
        let pp = r#"{"feature_size": 128}"#;
        let checkpoint = checkpoint_from_hf_configs(pp, bare, None).unwrap();
        let spec = checkpoint.spec;
        assert_eq!(
            (spec.image_token_id, spec.video_token_id),
            (151_655, Some(151_656))
        );
        assert_eq!((spec.patch_size, spec.temporal_patch_size), (16, 2));
        assert_eq!(spec.tokens_per_second, Some(25.0));
        let audio = spec.audio.unwrap();
        assert_eq!((audio.audio_token_id, audio.n_window), (151_646, Some(50)));
        assert_eq!(checkpoint.model.family.deepstack_layers, 3);
        // The preprocessor's patch against the tower's, and its mel bins against the encoder's.
        let err = spec_from_hf_configs(r#"{"feature_size": 128, "patch_size": 14}"#, bare);
        assert_eq!(err.unwrap_err().code(), "spec.inconsistent");
        let err = spec_from_hf_configs(r#"{"feature_size": 80}"#, CONFIG).unwrap_err();
        assert_eq!(err.code(), "spec.inconsistent");
        let zero = CONFIG.replace(r#""n_window": 50"#, r#""n_window": 0"#);
        let err = spec_from_hf_configs(PREPROCESSOR, &zero).unwrap_err();
        assert_eq!(err.code(), "spec.invalid");
    }
}
