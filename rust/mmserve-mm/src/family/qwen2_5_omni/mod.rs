//! Qwen2.5-Omni's thinker: images and videos as Qwen2.5-VL takes them, clips as Qwen2-Audio
//! takes them (the `<|AUDIO|>` the chat template writes between `<|audio_bos|>` and
//! `<|audio_eos|>` becomes one token per row of the audio tower), all in one prompt under
//! TMRoPE: text and audio advance the three position rows together, an image or video fills
//! a block whose temporal row counts `position_id_per_seconds` per second of video, and what
//! follows a block resumes after its largest position. Mirrors transformers'
//! `Qwen2_5OmniProcessor` and the thinker's `get_rope_index`; a video's own audio track
//! (`use_audio_in_video`) is not planned here.

pub(crate) mod config;

use std::sync::Arc;

use crate::family::config::{ConfigFiles, FamilyFacts};
use crate::family::qwen2_audio::{audio_tokens, clip_update};
use crate::family::qwen_vl::{with_delta, QwenVl};
use crate::family::registry::{FamilyModule, FamilyName};
use crate::family::spec::{AudioSpec, Spec, SpecError};
use crate::pipeline::{
    Capabilities, DecodedImage, Family, Geometry, ItemPrompt, Modality, Placeholder, Positions,
    ProcessError, ProcessedItem, PromptUpdate,
};
use crate::video::VideoFamily;

/// Qwen2.5-Omni as the registry sees it.
#[derive(Debug, Clone, Copy)]
pub struct Qwen25OmniModule;

/// The registry's module of `qwen2_5_omni`.
pub const QWEN2_5_OMNI: Qwen25OmniModule = Qwen25OmniModule;

impl FamilyModule for Qwen25OmniModule {
    fn read(
        &self,
        name: FamilyName,
        files: &ConfigFiles,
    ) -> Result<(Spec, FamilyFacts), SpecError> {
        config::read(name, files)
    }

    fn build(&self, spec: Spec) -> Result<Arc<dyn Family>, SpecError> {
        Ok(Arc::new(Qwen25Omni::new(spec)?))
    }

    fn modalities(&self) -> &'static [Modality] {
        &[Modality::Image, Modality::Video, Modality::Audio]
    }

    fn video_processor(&self) -> Option<VideoFamily> {
        Some(VideoFamily::Qwen2Vl)
    }
}

/// The thinker configured by its spec (which has an `audio` part and, as
/// `tokens_per_second`, the thinker's `position_id_per_seconds`).
#[derive(Debug, Clone)]
pub struct Qwen25Omni {
    vision: QwenVl,
    audio: AudioSpec,
    position_id_per_seconds: f32,
}

impl Qwen25Omni {
    pub fn new(spec: Spec) -> Result<Self, SpecError> {
        let audio = spec.audio.ok_or(SpecError::Missing("audio"))?;
        let position_id_per_seconds =
            spec.tokens_per_second
                .ok_or(SpecError::Missing("position_id_per_seconds"))? as f32;
        Ok(Self {
            vision: QwenVl::new(spec)?,
            audio,
            position_id_per_seconds,
        })
    }
}

impl Family for Qwen25Omni {
    fn spec(&self) -> &Spec {
        self.vision.spec()
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            audio: Some(self.audio.log_mel()),
            ..self.vision.capabilities()
        }
    }

    fn plan(&self, width: u32, height: u32) -> Result<Geometry, ProcessError> {
        self.vision.plan(width, height)
    }

    fn num_tokens(&self, geometry: &Geometry) -> usize {
        match geometry {
            Geometry::Audio { frames, .. } => audio_tokens(*frames),
            _ => self.vision.num_tokens(geometry),
        }
    }

    fn geometry_from_grid(&self, grid_thw: [u32; 3]) -> Result<Geometry, ProcessError> {
        self.vision.geometry_from_grid(grid_thw)
    }

    /// A video's temporal patches sit `second_per_grid = temporal_patch_size / sampled_fps`
    /// seconds apart (float32, as the processor's `video_second_per_grid`); the positions
    /// scale that by `position_id_per_seconds` in torch's order.
    fn video_geometry(
        &self,
        grid_thw: [u32; 3],
        (resized_width, resized_height): (u32, u32),
        sampled_fps: f64,
    ) -> Result<Geometry, ProcessError> {
        let time_interval = (f64::from(self.spec().temporal_patch_size) / sampled_fps) as f32;
        if !(time_interval.is_finite() && time_interval >= 0.0) {
            return Err(ProcessError::Grid {
                grid_thw,
                reason: format!("a video sampled at {sampled_fps} fps has no temporal spacing"),
            });
        }
        Ok(Geometry::Video {
            resized_width,
            resized_height,
            grid_thw,
            time_interval,
        })
    }

    fn process_item(&self, image: &DecodedImage) -> Result<ProcessedItem, crate::Error> {
        self.vision.process_item(image)
    }

    /// The image and video pads inside the vision bos and eos; `<|AUDIO|>`.
    fn placeholders(&self) -> Vec<Placeholder> {
        let mut placeholders = self.vision.placeholders();
        placeholders.push(Placeholder {
            id: self.audio.audio_token_id,
            modality: Modality::Audio,
            between: None,
        });
        placeholders
    }

    fn prompt_update(&self, item: &ItemPrompt<'_>) -> Result<PromptUpdate, ProcessError> {
        match item.geometry {
            Geometry::Audio { frames, .. } => Ok(clip_update(&self.audio, item.geometry, frames)),
            _ => self.vision.prompt_update(item),
        }
    }

    fn positions(
        &self,
        len: usize,
        offsets: &[(usize, usize)],
        geometries: &[Geometry],
    ) -> Result<Positions, ProcessError> {
        tmrope(
            len,
            offsets,
            geometries,
            self.spec().merge_size,
            self.position_id_per_seconds,
        )
    }
}

/// The thinker's `get_rope_index` (without `use_audio_in_video`): every run of text or audio
/// counts on from the largest position before it, all three rows alike; an image or video of
/// LLM grid `(t, h, w)` fills a block from the next position `base`, temporal patch `ti` at
/// `base + trunc(ti * second_per_grid * position_id_per_seconds)` (float32, in that order; an
/// image's one patch at `base`), and what follows resumes after the block's largest position.
pub fn tmrope(
    len: usize,
    offsets: &[(usize, usize)],
    geometries: &[Geometry],
    merge: u32,
    position_id_per_seconds: f32,
) -> Result<Positions, ProcessError> {
    if offsets.len() != geometries.len() {
        return Err(ProcessError::Offsets(format!(
            "{} offsets for {} items",
            offsets.len(),
            geometries.len()
        )));
    }
    if merge == 0 {
        return Err(ProcessError::Offsets("merge size 0".into()));
    }
    let mut positions = vec![0i64; 3 * len];
    let mut next: i64 = 0;
    let mut cursor = 0usize;
    let mut put = |i: usize, [t, h, w]: [i64; 3]| {
        positions[i] = t;
        positions[len + i] = h;
        positions[2 * len + i] = w;
    };
    for (item, (&(start, end), geometry)) in offsets.iter().zip(geometries).enumerate() {
        if start < cursor || end < start || end > len {
            return Err(ProcessError::Offsets(format!(
                "item {item} at {start}..{end} does not follow token {cursor} in a prompt of \
                 {len} tokens"
            )));
        }
        for i in cursor..start {
            put(i, [next; 3]);
            next += 1;
        }
        match *geometry {
            Geometry::Audio { .. } => {
                for i in start..end {
                    put(i, [next; 3]);
                    next += 1;
                }
            }
            Geometry::Image { grid_thw, .. } | Geometry::Video { grid_thw, .. } => {
                let [t, h, w] =
                    [grid_thw[0], grid_thw[1] / merge, grid_thw[2] / merge].map(|v| v as usize);
                if t.checked_mul(h).and_then(|th| th.checked_mul(w)) != Some(end - start) {
                    return Err(ProcessError::Offsets(format!(
                        "item {item} at {start}..{end} does not fit a {t}x{h}x{w} block"
                    )));
                }
                let temporal = |ti: usize| -> i64 {
                    match *geometry {
                        Geometry::Video { time_interval, .. } => {
                            (ti as f32 * time_interval * position_id_per_seconds) as i64
                        }
                        // An image's temporal patches (its one) count whole seconds.
                        _ => ti as i64 * position_id_per_seconds as i64,
                    }
                };
                let base = next;
                let mut largest = base;
                let mut i = start;
                for ti in 0..t {
                    let row_t = base + temporal(ti);
                    for hi in 0..h {
                        for wi in 0..w {
                            let row = [row_t, base + hi as i64, base + wi as i64];
                            largest = largest.max(row[0]).max(row[1]).max(row[2]);
                            put(i, row);
                            i += 1;
                        }
                    }
                }
                next = largest + 1;
            }
        }
        cursor = end;
    }
    for i in cursor..len {
        put(i, [next; 3]);
        next += 1;
    }
    Ok(with_delta(positions, len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::registry::spec_from_hf_configs;

    fn omni() -> Qwen25Omni {
        let spec = spec_from_hf_configs(config::tests::PREPROCESSOR, config::tests::CONFIG);
        Qwen25Omni::new(spec.unwrap()).unwrap()
    }

    fn rows(p: Positions) -> (Vec<i64>, i64) {
        match p {
            Positions::MRope { positions, delta } => (positions, delta),
            Positions::Rope1D { .. } => panic!("expected mrope"),
        }
    }

    #[test]
    fn the_thinker_takes_every_modality() {
        let family = omni();
        let caps = family.capabilities();
        assert!(caps.images && caps.video && caps.audio.is_some());
        assert!(!caps.video_timestamps);
        let modalities: Vec<Modality> = family.placeholders().iter().map(|p| p.modality).collect();
        assert_eq!(
            modalities,
            [Modality::Image, Modality::Video, Modality::Audio]
        );
        let clip = Geometry::Audio {
            samples: 48_000,
            frames: 300,
        };
        assert_eq!(family.num_tokens(&clip), 75);
        assert_eq!(family.num_tokens(&family.plan(56, 56).unwrap()), 4);
    }

    #[test]
    fn audio_counts_on_like_text_and_a_video_resumes_after_its_largest_position() {
        let family = omni();
        let clip = Geometry::Audio {
            samples: 3200,
            frames: 20,
        }; // 5 tokens
        let image = family.plan(56, 56).unwrap(); // a 2x2 block
                                                  // Text, clip, text, image, text.
        let (p, delta) = rows(
            family
                .positions(11, &[(1, 6), (7, 11)], &[clip, image])
                .unwrap(),
        );
        assert_eq!(p[..11], [0, 1, 2, 3, 4, 5, 6, 7, 7, 7, 7]);
        assert_eq!(p[11..22], [0, 1, 2, 3, 4, 5, 6, 7, 7, 8, 8]);
        assert_eq!(p[22..], [0, 1, 2, 3, 4, 5, 6, 7, 8, 7, 8]);
        assert_eq!(delta, 8 + 1 - 11);
        // A video of 3 temporal patches one second apart: 0, 25, 50, then text at 51.
        let video = family.video_geometry([3, 2, 2], (28, 28), 2.0).unwrap();
        let (p, delta) = rows(family.positions(5, &[(0, 3)], &[video]).unwrap());
        assert_eq!(p[..5], [0, 25, 50, 51, 52]);
        assert_eq!(delta, 52 + 1 - 5);
        let err = family.positions(5, &[(0, 4)], &[video]).unwrap_err();
        assert_eq!(err.code(), "process.offsets");
    }
}
