//! Qwen3-Omni-MoE's thinker: Qwen2.5-Omni's thinker ([`OmniThinker`]) with Qwen3-VL's vision
//! tower (patch 16, deepstack features) and its own audio tower, all as data in the spec.
//! Mirrors transformers' `Qwen3OmniMoeProcessor` and the thinker's `get_rope_index`:
//!
//! - Images and videos as Qwen2-VL's processors take them (`Qwen2VLImageProcessor`, its video
//!   processor), between the vision bos and eos.
//! - A clip's features are unpadded and uncut (`padding=True, truncation=False`: one clip is
//!   its own length), and its `<|audio_pad|>` becomes [`audio_tokens`] tokens: the tower
//!   convolves each window of `2 * n_window` frames on its own.
//! - Positions are TMRoPE ([`crate::family::qwen2_5_omni::tmrope`]): text, the bos and eos
//!   tokens and a clip count on; an image or video fills a block whose temporal row is
//!   `t * second_per_grid * position_id_per_seconds`, and what follows resumes after its
//!   largest position. transformers keeps that temporal row as a float, and the text after a
//!   video counts on from the float; here it is truncated to an integer, as vLLM and SGLang
//!   position it. The two agree wherever the product is integral (at the real checkpoint's
//!   13 positions a second: 2 fps, a second per grid of 1, gives 13 per temporal patch; 1 fps
//!   gives 26); at 3 fps (a second per grid of 2/3) transformers places patch 1 at 8.667
//!   past the block's start, and here it sits at 8.
//! - A video's own audio track (`use_audio_in_video`) is not served: the spec has no
//!   interleaving, and a request asking for it is refused by name.

pub(crate) mod config;

use std::sync::Arc;

use crate::family::config::{ConfigFiles, FamilyFacts};
use crate::family::qwen2_5_omni::OmniThinker;
use crate::family::registry::{FamilyModule, FamilyName};
use crate::family::spec::{Spec, SpecError};
use crate::pipeline::{Family, Modality};
use crate::video::VideoFamily;

/// Qwen3-Omni-MoE as the registry sees it.
#[derive(Debug, Clone, Copy)]
pub struct Qwen3OmniMoeModule;

/// The registry's module of `qwen3_omni_moe`.
pub const QWEN3_OMNI_MOE: Qwen3OmniMoeModule = Qwen3OmniMoeModule;

impl FamilyModule for Qwen3OmniMoeModule {
    fn read(
        &self,
        name: FamilyName,
        files: &ConfigFiles,
    ) -> Result<(Spec, FamilyFacts), SpecError> {
        config::read(name, files)
    }

    fn build(&self, spec: Spec) -> Result<Arc<dyn Family>, SpecError> {
        Ok(Arc::new(OmniThinker::new(spec)?))
    }

    fn modalities(&self) -> &'static [Modality] {
        &[Modality::Image, Modality::Video, Modality::Audio]
    }

    fn video_processor(&self) -> Option<VideoFamily> {
        Some(VideoFamily::Qwen2Vl)
    }

    /// Its processor's `videos_kwargs`: 128 to 768 merged patches of 32 pixels a frame.
    fn video_pixel_bounds(&self) -> Option<(u64, u64)> {
        Some((128 * 32 * 32, 768 * 32 * 32))
    }
}

/// Rows the audio tower leaves of a full window of `2 * n_window` frames: three stride-2
/// convolutions of 100 frames (transformers writes 13 whatever `n_window` is; the real
/// checkpoints' is 50).
const ROWS_PER_WINDOW: i64 = 13;

/// The tokens a clip of `frames` valid feature frames expands to: transformers'
/// `_get_feat_extract_output_lengths(frames, n_window)`, 13 per full window of `2 * n_window`
/// frames and three stride-2 convolutions of what is left, in floor division (what is left of
/// a clip of whole windows, 0 frames, makes 0).
pub fn audio_tokens(frames: u32, n_window: u32) -> usize {
    // A spec refuses a window of 0; `max` keeps the division defined for a caller's.
    let window = 2 * i64::from(n_window.max(1));
    let frames = i64::from(frames);
    let conv = |l: i64| (l - 1).div_euclid(2) + 1;
    let leave = conv(frames.rem_euclid(window));
    let tail = conv(conv(leave));
    (tail + frames.div_euclid(window) * ROWS_PER_WINDOW) as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audio::features::Padding;
    use crate::family::registry::{family_from_spec, spec_from_hf_configs};
    use crate::family::token_layout::{apply, Prompt};
    use crate::pipeline::{Geometry, ItemPrompt, Positions};

    const AUDIO: u32 = 151_675;
    const AUDIO_START: u32 = 151_669;
    const AUDIO_END: u32 = 151_670;
    const IMAGE: u32 = 151_655;
    const VIDEO: u32 = 151_656;
    const VISION_START: u32 = 151_652;
    const VISION_END: u32 = 151_653;

    fn thinker() -> Arc<dyn Family> {
        let spec = spec_from_hf_configs(config::tests::PREPROCESSOR, config::tests::CONFIG);
        family_from_spec(&spec.unwrap()).unwrap()
    }

    #[test]
    fn tokens_follow_get_feat_extract_output_lengths() {
        // transformers' `_get_feat_extract_output_lengths(torch.tensor(l), 50)`.
        let python = [
            (0, 0),
            (1, 1),
            (2, 1),
            (3, 1),
            (40, 5),
            (99, 13),
            (100, 13),
            (101, 14),
            (199, 26),
            (200, 26),
            (250, 33),
            (3000, 390),
            (30_001, 3901),
        ];
        for (frames, tokens) in python {
            assert_eq!(audio_tokens(frames, 50), tokens, "{frames}");
        }
        // With another window transformers still counts 13 a full window.
        for (frames, tokens) in [(1, 1), (49, 7), (50, 13), (51, 14), (100, 26)] {
            assert_eq!(audio_tokens(frames, 25), tokens, "{frames}");
        }
        let family = thinker();
        let clip = |frames| Geometry::Audio { frames };
        assert_eq!(family.num_tokens(&clip(3000)), 390);
        assert_eq!(family.num_tokens(&clip(1)), 1);
        assert_eq!(family.num_tokens(&clip(0)), 0);
    }

    #[test]
    fn the_thinker_takes_every_modality_and_unpadded_clips() {
        let family = thinker();
        let caps = family.capabilities();
        assert!(caps.images && caps.video && !caps.video_timestamps);
        let extractor = caps.audio.unwrap();
        assert_eq!(
            (extractor.padding, extractor.truncation),
            (Padding::Longest, false)
        );
        let placeholders: Vec<(u32, Modality)> = family
            .placeholders()
            .iter()
            .map(|p| (p.id, p.modality))
            .collect();
        assert_eq!(
            placeholders,
            [
                (IMAGE, Modality::Image),
                (VIDEO, Modality::Video),
                (AUDIO, Modality::Audio)
            ]
        );
        // Patch 16 merged 2x2: a 64x64 image is 4 tokens.
        let image = family.plan(64, 64).unwrap();
        assert_eq!(image.grid_thw(), [1, 4, 4]);
        assert_eq!(family.num_tokens(&image), 4);
    }

    fn rows(p: Positions) -> (Vec<i64>, i64) {
        match p {
            Positions::MRope { positions, delta } => (positions, delta),
            Positions::Rope1D { .. } => panic!("expected mrope"),
        }
    }

    #[test]
    fn text_a_clip_an_image_and_a_video_lay_out_as_get_rope_index() {
        let family = thinker();
        // 5 tokens.
        let clip = Geometry::Audio { frames: 40 };
        // A 2x2 block.
        let image = family.plan(64, 64).unwrap();
        // Two temporal patches a second apart (2 fps): 13 positions apart at 13 a second.
        let video = family.video_geometry([2, 4, 4], (64, 64), 2.0).unwrap();
        let prompt_ids = [
            1,
            AUDIO_START,
            AUDIO,
            AUDIO_END,
            VISION_START,
            IMAGE,
            VISION_END,
            VISION_START,
            VIDEO,
            VISION_END,
            2,
        ];
        let items = [
            (Modality::Audio, clip, None),
            (Modality::Image, image, None),
            (Modality::Video, video, Some(2.0)),
        ];
        let updates: Vec<_> = items
            .iter()
            .map(|&(modality, geometry, sampled_fps)| {
                let item = ItemPrompt {
                    geometry,
                    crops: &[],
                    timestamps: &[],
                    sampled_fps,
                };
                (modality, family.prompt_update(&item).unwrap())
            })
            .collect();
        let prompt = Prompt {
            ids: &prompt_ids,
            ..Prompt::default()
        };
        let out = apply(&prompt, &family.placeholders(), &updates).unwrap();
        assert_eq!(out.offsets, [(2, 7), (9, 13), (15, 23)]);
        assert_eq!(out.ids[2..7], [AUDIO; 5]);
        assert_eq!(out.ids[15..23], [VIDEO; 8]);
        let len = out.ids.len();
        assert_eq!(len, 25);
        let geometries = [clip, image, video];
        let (p, delta) = rows(family.positions(len, &out.offsets, &geometries).unwrap());
        let (t, h, w) = (&p[..len], &p[len..2 * len], &p[2 * len..]);
        // Text 0, audio bos 1, the clip 2..7, audio eos 7, vision bos 8.
        let counted: Vec<i64> = (0..9).collect();
        for row in [t, h, w] {
            assert_eq!(row[..9], counted[..]);
        }
        // The image's block from 9, its eos and the video's bos after its largest (10).
        assert_eq!(t[9..15], [9, 9, 9, 9, 11, 12]);
        assert_eq!(h[9..15], [9, 9, 10, 10, 11, 12]);
        assert_eq!(w[9..15], [9, 10, 9, 10, 11, 12]);
        // The video's block from 13, its second temporal patch 13 later; then 27 and 28.
        assert_eq!(t[15..], [13, 13, 13, 13, 26, 26, 26, 26, 27, 28]);
        assert_eq!(h[15..], [13, 13, 14, 14, 13, 13, 14, 14, 27, 28]);
        assert_eq!(w[15..], [13, 14, 13, 14, 13, 14, 13, 14, 27, 28]);
        assert_eq!(delta, 28 + 1 - len as i64);
    }

    #[test]
    fn a_non_integral_temporal_spacing_is_truncated() {
        // At 3 fps a temporal patch spans 2/3 s: 8.667 positions at 13 a second, laid at 8
        // (transformers keeps 8.667), then 17.333 at 17; the text after resumes at 18.
        let family = thinker();
        let video = family.video_geometry([3, 2, 2], (32, 32), 3.0).unwrap();
        let (p, _) = rows(family.positions(4, &[(0, 3)], &[video]).unwrap());
        assert_eq!(p[..4], [0, 8, 17, 18]);
    }
}
