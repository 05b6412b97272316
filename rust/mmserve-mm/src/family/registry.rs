//! The registry of model families: one line per family, naming its `model_type` and the
//! module that reads its config files and builds it ([`FamilyModule`]). Everything else a
//! family is, its module says as data: the spec it reads, its `Family` implementation's
//! capabilities, placeholders and prompt updates.
//!
//! This is the one parser of a checkpoint's config files: [`checkpoint_from_hf_configs`] reads
//! the spec and the facts the language-model side needs ([`ModelFacts`]), which Python takes
//! from here; [`spec_from_hf_configs`] reads the spec alone.

use std::sync::Arc;

use serde::{de::Error as _, Deserialize, Deserializer, Serialize, Serializer};

use crate::family::config::{Checkpoint, ConfigFiles, FamilyFacts, ModelFacts};
use crate::family::spec::{Spec, SpecError};
use crate::family::{gemma3, qwen2_5_omni, qwen2_audio, qwen3_omni_moe, qwen_vl};
use crate::pipeline::{Family, Modality};
use crate::video::VideoFamily;

/// What the registry needs of a family module: how it reads a checkpoint's config files, and
/// how it builds the family from the spec they give.
pub trait FamilyModule: Sync {
    /// The spec of the checkpoint whose config files are `files` (`name`: which of the
    /// module's model types they are), and the language-model facts the family reads its own
    /// way. Where `preprocessor_config.json` leaves a value out, the spec takes what the
    /// family's transformers processor would (its class attributes), after the model's config.
    fn read(&self, name: FamilyName, files: &ConfigFiles)
        -> Result<(Spec, FamilyFacts), SpecError>;

    /// The family a spec (validated) describes.
    fn build(&self, spec: Spec) -> Result<Arc<dyn Family>, SpecError>;

    /// The modalities the family takes: a checkpoint must name the placeholder token of each
    /// (a spec read from bare preprocessing configs may lack video's, and plans images only).
    fn modalities(&self) -> &'static [Modality];

    /// Whose video processor's rules its videos follow (sampling, sizing, the text written
    /// around them); `None` for a family without video.
    fn video_processor(&self) -> Option<VideoFamily> {
        None
    }

    /// The per-frame `(min_pixels, max_pixels)` the family's processor passes its video
    /// processor by default (its `videos_kwargs` size), which override the video processor's
    /// own config; `None` where the processor passes none.
    fn video_pixel_bounds(&self) -> Option<(u64, u64)> {
        None
    }
}

/// The registry: `Name = "model_type" => module,` makes [`FamilyName`] and its lookups.
macro_rules! families {
    ($($(#[$doc:meta])* $name:ident = $model_type:literal => $module:expr,)*) => {
        /// The model families this crate preprocesses for, one per `config.json` `model_type`.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum FamilyName {
            $($(#[$doc])* $name,)*
        }

        impl FamilyName {
            /// Every family, in registry order.
            pub const ALL: &'static [FamilyName] = &[$(FamilyName::$name,)*];

            /// Its `config.json` `model_type`, which is also its name in the spec JSON.
            pub fn model_type(self) -> &'static str {
                match self {
                    $(FamilyName::$name => $model_type,)*
                }
            }

            /// The module that reads its config files and builds it.
            pub fn module(self) -> &'static dyn FamilyModule {
                match self {
                    $(FamilyName::$name => $module,)*
                }
            }
        }
    };
}

families! {
    Qwen2Vl = "qwen2_vl" => &qwen_vl::QWEN2_VL,
    Qwen25Vl = "qwen2_5_vl" => &qwen_vl::QWEN2_5_VL,
    Qwen3Vl = "qwen3_vl" => &qwen_vl::QWEN3_VL,
    /// Qwen3-VL's vision and preprocessing before a mixture-of-experts language model.
    Qwen3VlMoe = "qwen3_vl_moe" => &qwen_vl::QWEN3_VL_MOE,
    /// Qwen3-VL's vision without deepstack before a hybrid language model (Gated DeltaNet
    /// linear-attention layers beside full attention).
    Qwen35 = "qwen3_5" => &qwen_vl::QWEN3_5,
    /// Qwen3.5 with a mixture-of-experts language model.
    Qwen35Moe = "qwen3_5_moe" => &qwen_vl::QWEN3_5_MOE,
    /// A fixed-size SigLIP image between begin/end-of-image tokens, 1-D rope.
    Gemma3 = "gemma3" => &gemma3::GEMMA3,
    /// A Whisper-style audio encoder before a Qwen2 language model, 1-D rope; no images.
    Qwen2Audio = "qwen2_audio" => &qwen2_audio::QWEN2_AUDIO,
    /// Qwen2.5-Omni's thinker: Qwen2.5-VL's vision and Qwen2-Audio's clips in one prompt,
    /// TMRoPE positions.
    Qwen25Omni = "qwen2_5_omni" => &qwen2_5_omni::QWEN2_5_OMNI,
    /// Qwen3-Omni-MoE's thinker: Qwen2.5-Omni's with Qwen3-VL's vision tower (deepstack), its
    /// own audio tower over unpadded clips, and no audio track in a video.
    Qwen3OmniMoe = "qwen3_omni_moe" => &qwen3_omni_moe::QWEN3_OMNI_MOE,
}

impl FamilyName {
    /// The family of a `config.json` `model_type`.
    pub fn from_model_type(model_type: &str) -> Option<Self> {
        Self::ALL
            .iter()
            .copied()
            .find(|family| family.model_type() == model_type)
    }

    /// Every `model_type` the registry knows, sorted, as an error message lists them.
    pub fn known() -> String {
        let mut names: Vec<&str> = Self::ALL.iter().map(|f| f.model_type()).collect();
        names.sort_unstable();
        names.join(", ")
    }

    /// Whose video processor's rules its videos follow; `None` for a family without video.
    pub fn video_processor(self) -> Option<VideoFamily> {
        self.module().video_processor()
    }

    /// The per-frame pixel bounds its processor imposes on videos, if any.
    pub fn video_pixel_bounds(self) -> Option<(u64, u64)> {
        self.module().video_pixel_bounds()
    }
}

impl Serialize for FamilyName {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.model_type())
    }
}

impl<'de> Deserialize<'de> for FamilyName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        FamilyName::from_model_type(&name).ok_or_else(|| {
            D::Error::custom(format!(
                "unknown family {name:?} (known: {})",
                FamilyName::known()
            ))
        })
    }
}

/// Builds the family a spec describes.
pub fn family_from_spec(spec: &Spec) -> Result<Arc<dyn Family>, SpecError> {
    spec.validate()?;
    spec.family.module().build(spec.clone())
}

/// The family and its module of a checkpoint's config files.
fn family_of(files: &ConfigFiles) -> Result<FamilyName, SpecError> {
    let model_type = files.model_type()?;
    let family = FamilyName::from_model_type(model_type)
        .ok_or_else(|| SpecError::UnknownFamily(model_type.to_owned()))?;
    files.check_steps()?;
    Ok(family)
}

/// The spec of a checkpoint, from the text of its `preprocessor_config.json` and
/// `config.json`.
pub fn spec_from_hf_configs(preprocessor_config: &str, config: &str) -> Result<Spec, SpecError> {
    let files = ConfigFiles::parse(preprocessor_config, config, None)?;
    let family = family_of(&files)?;
    Ok(family.module().read(family, &files)?.0)
}

/// The checkpoint whose config files these are (`generation_config.json` where it has one):
/// the spec, which must name a placeholder token for every modality the family takes, and
/// the model's facts.
pub fn checkpoint_from_hf_configs(
    preprocessor_config: &str,
    config: &str,
    generation_config: Option<&str>,
) -> Result<Checkpoint, SpecError> {
    let files = ConfigFiles::parse(preprocessor_config, config, generation_config)?;
    let family = family_of(&files)?;
    let module = family.module();
    let (spec, facts) = module.read(family, &files)?;
    let placeholders = module.build(spec.clone())?.placeholders();
    if let Some(&missing) = module
        .modalities()
        .iter()
        .find(|&&m| !placeholders.iter().any(|p| p.modality == m))
    {
        return Err(SpecError::NoPlaceholder {
            family: family.model_type(),
            modality: missing.name(),
        });
    }
    let model = ModelFacts::read(&files, facts)?;
    Ok(Checkpoint { spec, model })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen2_config(video: &str) -> String {
        format!(
            r#"{{"model_type": "qwen2_vl", "image_token_id": 151655, {video}
                "vision_start_token_id": 151652, "vision_end_token_id": 151653,
                "text_config": {{"vocab_size": 151936, "hidden_size": 64,
                                 "num_hidden_layers": 2}}}}"#
        )
    }

    #[test]
    fn each_family_is_its_model_type_and_says_what_it_takes() {
        for &family in FamilyName::ALL {
            assert_eq!(
                FamilyName::from_model_type(family.model_type()),
                Some(family)
            );
            let json = serde_json::to_string(&family).unwrap();
            assert_eq!(json, format!("\"{}\"", family.model_type()));
            assert_eq!(serde_json::from_str::<FamilyName>(&json).unwrap(), family);
            let module = family.module();
            assert!(!module.modalities().is_empty());
            // A video processor exactly where the family takes video.
            assert_eq!(
                module.modalities().contains(&Modality::Video),
                module.video_processor().is_some(),
                "{family:?}"
            );
        }
        assert_eq!(
            FamilyName::known(),
            "gemma3, qwen2_5_omni, qwen2_5_vl, qwen2_audio, qwen2_vl, qwen3_5, qwen3_5_moe, \
             qwen3_omni_moe, qwen3_vl, qwen3_vl_moe"
        );
    }

    #[test]
    fn a_checkpoint_of_a_family_that_takes_video_must_name_its_video_token() {
        let with = qwen2_config(r#""video_token_id": 151656,"#);
        let checkpoint = checkpoint_from_hf_configs("{}", &with, None).unwrap();
        assert_eq!(checkpoint.spec.video_token_id, Some(151656));
        let without = qwen2_config("");
        let err = checkpoint_from_hf_configs("{}", &without, None).unwrap_err();
        assert_eq!(err.code(), "spec.missing");
        assert!(err.to_string().contains("no video token"), "{err}");
        // The preprocessing spec alone plans images.
        let spec = spec_from_hf_configs("{}", &without).unwrap();
        assert!(!family_from_spec(&spec).unwrap().capabilities().video);
    }

    #[test]
    fn refusals_name_their_cause() {
        let llava = r#"{"model_type": "llava"}"#;
        let err = spec_from_hf_configs("{}", llava).unwrap_err();
        assert_eq!(err.code(), "spec.unknown_family");
        assert!(
            err.to_string().contains("known: gemma3, qwen2_5_omni"),
            "{err}"
        );
        let err = spec_from_hf_configs("[]", "{}").unwrap_err();
        assert_eq!(err.code(), "spec.json");
        let err = spec_from_hf_configs("{}", r#"{"model_type": "qwen2_vl"}"#).unwrap_err();
        assert_eq!(err.code(), "spec.missing");
        let config = qwen2_config("");
        let err = spec_from_hf_configs(r#"{"do_normalize": false}"#, &config).unwrap_err();
        assert_eq!(err.code(), "spec.invalid");
        let err = checkpoint_from_hf_configs("{}", &config, Some("[]")).unwrap_err();
        assert_eq!(err.code(), "spec.json");
        for count in ["vocab_size", "hidden_size", "num_hidden_layers"] {
            let config = config.replace(&format!("\"{count}\""), "\"other\"");
            let video = config.replace(
                "\"image_token_id\"",
                "\"video_token_id\": 1, \"image_token_id\"",
            );
            let err = checkpoint_from_hf_configs("{}", &video, None).unwrap_err();
            assert_eq!(err.code(), "spec.missing", "{count}");
            assert!(err.to_string().contains(count), "{err}");
        }
        assert_eq!(
            Spec::from_json("{\"family\": 1}").unwrap_err().code(),
            "spec.json"
        );
    }
}
