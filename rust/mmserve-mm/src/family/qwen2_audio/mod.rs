//! Qwen2-Audio: each clip decoded at the extractor's rate, padded or cut to its 30 s chunk and
//! turned into Whisper-style log-mel features; in the prompt, the `<|AUDIO|>` placeholder the
//! chat template writes between `<|audio_bos|>` and `<|audio_eos|>` becomes one token per
//! row the audio tower and its average pool leave of the clip's valid frames. 1-D rope.
//! Mirrors transformers' `Qwen2AudioProcessor` and `Qwen2AudioEncoder`'s output lengths.

pub(crate) mod config;

use std::sync::Arc;

use crate::family::config::{ConfigFiles, FamilyFacts};
use crate::family::registry::{FamilyModule, FamilyName};
use crate::family::spec::{AudioSpec, Spec, SpecError};
use crate::pipeline::{
    Capabilities, DecodedImage, Embed, EmbedOf, Family, Geometry, ItemPrompt, Modality,
    Placeholder, Positions, ProcessError, ProcessedItem, PromptUpdate, RopeKind, UpdatePart,
    VisionInput,
};

/// Qwen2-Audio as the registry sees it.
#[derive(Debug, Clone, Copy)]
pub struct Qwen2AudioModule;

/// The registry's module of `qwen2_audio`.
pub const QWEN2_AUDIO: Qwen2AudioModule = Qwen2AudioModule;

impl FamilyModule for Qwen2AudioModule {
    fn read(&self, _: FamilyName, files: &ConfigFiles) -> Result<(Spec, FamilyFacts), SpecError> {
        config::read(files)
    }

    fn build(&self, spec: Spec) -> Result<Arc<dyn Family>, SpecError> {
        Ok(Arc::new(Qwen2Audio::new(spec)?))
    }

    fn modalities(&self) -> &'static [Modality] {
        &[Modality::Audio]
    }
}

/// The Qwen2-Audio family configured by its spec (which has an `audio` part).
#[derive(Debug, Clone)]
pub struct Qwen2Audio {
    spec: Spec,
    audio: AudioSpec,
}

impl Qwen2Audio {
    pub fn new(spec: Spec) -> Result<Self, SpecError> {
        spec.validate()?;
        let audio = spec.audio.ok_or(SpecError::Missing("audio"))?;
        Ok(Self { spec, audio })
    }
}

/// The rows the encoder leaves of `frames` valid feature frames: its stride-2 convolution,
/// then its stride-2 average pool (`Qwen2AudioProcessor`'s `num_audio_tokens`:
/// `(((l - 1) // 2 + 1) - 2) // 2 + 1`, floor division).
pub fn audio_tokens(frames: u32) -> usize {
    let after_conv = (i64::from(frames) - 1).div_euclid(2) + 1;
    ((after_conv - 2).div_euclid(2) + 1).max(0) as usize
}

/// A clip's `<|AUDIO|>` repeated once per audio token of its `frames` valid frames, as
/// `audio` counts them (the ids around it stay).
pub fn clip_update(audio: &AudioSpec, geometry: Geometry, frames: u32) -> PromptUpdate {
    PromptUpdate {
        parts: vec![UpdatePart::Embed(Embed {
            id: audio.audio_token_id,
            n: audio.tokens(frames),
            runs: Vec::new(),
            geometry,
            of: EmbedOf::Whole,
        })],
        announced: false,
    }
}

impl Family for Qwen2Audio {
    fn spec(&self) -> &Spec {
        &self.spec
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            images: false,
            video: false,
            audio: Some(self.audio.log_mel()),
            rope: RopeKind::Rope1D,
            vision_input: VisionInput::Patches,
            crops: None,
            video_timestamps: false,
            texts: &[],
            image_padding: "",
            announcing_text: "",
        }
    }

    fn plan(&self, _width: u32, _height: u32) -> Result<Geometry, ProcessError> {
        Err(ProcessError::ModalityUnsupported(Modality::Image))
    }

    fn num_tokens(&self, geometry: &Geometry) -> usize {
        match geometry {
            Geometry::Audio { frames, .. } => self.audio.tokens(*frames),
            _ => 0,
        }
    }

    fn geometry_from_grid(&self, _grid_thw: [u32; 3]) -> Result<Geometry, ProcessError> {
        Err(ProcessError::ModalityUnsupported(Modality::Image))
    }

    fn process_item(&self, _image: &DecodedImage) -> Result<ProcessedItem, crate::Error> {
        Err(ProcessError::ModalityUnsupported(Modality::Image).into())
    }

    /// The `<|AUDIO|>` id the chat template writes, one per clip.
    fn placeholders(&self) -> Vec<Placeholder> {
        vec![Placeholder {
            id: self.audio.audio_token_id,
            modality: Modality::Audio,
            between: None,
        }]
    }

    fn prompt_update(&self, item: &ItemPrompt<'_>) -> Result<PromptUpdate, ProcessError> {
        match item.geometry {
            Geometry::Audio { frames, .. } => Ok(clip_update(&self.audio, item.geometry, frames)),
            _ => Err(ProcessError::ModalityUnsupported(Modality::Image)),
        }
    }

    fn positions(
        &self,
        len: usize,
        _offsets: &[(usize, usize)],
        _geometries: &[Geometry],
    ) -> Result<Positions, ProcessError> {
        Ok(Positions::Rope1D { len })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::registry::spec_from_hf_configs;
    use crate::family::token_layout::{apply, Prompt};

    const AUDIO: u32 = 151_646;

    #[test]
    fn tokens_follow_the_processor_s_formula() {
        // `(((l - 1) // 2 + 1) - 2) // 2 + 1` in Python, floor division.
        let python = |l: i64| ((((l - 1).div_euclid(2) + 1) - 2).div_euclid(2) + 1).max(0);
        for frames in 0..4000u32 {
            assert_eq!(audio_tokens(frames) as i64, python(i64::from(frames)));
        }
        assert_eq!(audio_tokens(3000), 750);
        assert_eq!(audio_tokens(300), 75);
        assert_eq!(audio_tokens(2), 0);
    }

    #[test]
    fn the_placeholder_becomes_one_token_per_row() {
        let spec = spec_from_hf_configs(config::tests::PREPROCESSOR, config::tests::CONFIG);
        let family = Qwen2Audio::new(spec.unwrap()).unwrap();
        let geometry = Geometry::Audio { frames: 300 };
        let update = family
            .prompt_update(&ItemPrompt {
                geometry,
                crops: &[],
                timestamps: &[],
                sampled_fps: None,
            })
            .unwrap();
        let ids = [1, 151_647, AUDIO, 151_648, 2];
        let prompt = Prompt {
            ids: &ids,
            ..Prompt::default()
        };
        let out = apply(
            &prompt,
            &family.placeholders(),
            &[(Modality::Audio, update)],
        )
        .unwrap();
        assert_eq!(out.offsets, vec![(2, 77)]);
        assert_eq!(out.ids.len(), 4 + 75);
        assert_eq!(out.ids[77..], [151_648, 2]);
        assert!(!family.capabilities().images);
        let err = family.plan(10, 10).unwrap_err();
        assert_eq!(err.code(), "process.modality_unsupported");
    }
}
