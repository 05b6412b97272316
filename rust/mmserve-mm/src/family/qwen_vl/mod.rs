//! The Qwen-VL families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5, dense and MoE): one
//! implementation, parameters from the [`Spec`], each model type a [`QwenVariant`]. Mirrors
//! transformers' `Qwen2VLImageProcessor(Pil)` and `get_rope_index`.

pub(crate) mod config;
mod geometry;
mod positions;

use std::sync::Arc;

pub use geometry::{smart_resize, MAX_ASPECT_RATIO};
pub use positions::{mrope_blocks, with_delta, VisionBlock};

use crate::family::config::{ConfigFiles, FamilyFacts};
use crate::family::registry::{FamilyModule, FamilyName};
use crate::family::spec::{Spec, SpecError};
use crate::image::resize::{resize, ResizeError};
use crate::image::transforms::{patchify, NormalizeLut, PatchGeometry};
use crate::pipeline::{
    Capabilities, DecodedImage, Embed, EmbedOf, Family, Geometry, ItemPrompt, Modality,
    Placeholder, Positions, ProcessError, ProcessedItem, PromptUpdate, RopeKind, Tensor,
    TensorData, UpdatePart, VisionInput,
};
use crate::video::VideoFamily;

/// What sets one Qwen-VL model type apart; the registry's module of each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QwenVariant {
    /// Whose video processor its videos follow (Qwen3-VL's writes each temporal group after
    /// its timestamp, an item of its own).
    pub video: VideoFamily,
    /// Its video's temporal patches sit `vision_config.tokens_per_second`-scaled positions
    /// apart (Qwen2.5-VL).
    pub tokens_per_second: bool,
    /// It adds the features of `vision_config.deepstack_visual_indexes` to the first decoder
    /// layers (Qwen3-VL).
    pub deepstack: bool,
}

pub const QWEN2_VL: QwenVariant = QwenVariant {
    video: VideoFamily::Qwen2Vl,
    tokens_per_second: false,
    deepstack: false,
};
pub const QWEN2_5_VL: QwenVariant = QwenVariant {
    tokens_per_second: true,
    ..QWEN2_VL
};
pub const QWEN3_VL: QwenVariant = QwenVariant {
    video: VideoFamily::Qwen3Vl,
    tokens_per_second: false,
    deepstack: true,
};
pub const QWEN3_VL_MOE: QwenVariant = QWEN3_VL;
/// Qwen3-VL's vision without deepstack.
pub const QWEN3_5: QwenVariant = QwenVariant {
    deepstack: false,
    ..QWEN3_VL
};
pub const QWEN3_5_MOE: QwenVariant = QWEN3_5;

impl FamilyModule for QwenVariant {
    fn read(
        &self,
        name: FamilyName,
        files: &ConfigFiles,
    ) -> Result<(Spec, FamilyFacts), SpecError> {
        config::read(self, name, files)
    }

    fn build(&self, spec: Spec) -> Result<Arc<dyn Family>, SpecError> {
        Ok(Arc::new(QwenVl::new(spec)?))
    }

    fn modalities(&self) -> &'static [Modality] {
        &[Modality::Image, Modality::Video]
    }

    fn video_processor(&self) -> Option<VideoFamily> {
        Some(self.video)
    }
}

/// A Qwen-VL family configured by its spec.
#[derive(Debug, Clone)]
pub struct QwenVl {
    spec: Spec,
    lut: NormalizeLut,
}

impl QwenVl {
    pub fn new(spec: Spec) -> Result<Self, SpecError> {
        spec.validate()?;
        let lut = spec.normalize_lut()?;
        Ok(Self { spec, lut })
    }

    fn patch_geometry(&self) -> PatchGeometry {
        PatchGeometry {
            patch: self.spec.patch_size,
            merge: self.spec.merge_size,
            temporal: self.spec.temporal_patch_size,
        }
    }

    /// `(resized width, resized height, patch grid)` of a `width` x `height` image.
    fn image_size(&self, width: u32, height: u32) -> Result<(u32, u32, [u32; 3]), ProcessError> {
        let spec = &self.spec;
        let [min_pixels, max_pixels] = spec.resize_bounds();
        let (resized_height, resized_width) =
            smart_resize(height, width, spec.factor(), min_pixels, max_pixels)?;
        let grid_thw = [
            1,
            resized_height / spec.patch_size,
            resized_width / spec.patch_size,
        ];
        Ok((resized_width, resized_height, grid_thw))
    }

    /// Whether this family's videos are planned here: every Qwen-VL family takes video, and a
    /// checkpoint names its pad; a spec read from bare preprocessing configs may not.
    fn takes_video(&self) -> bool {
        self.spec.video_token_id.is_some()
    }
}

impl Family for QwenVl {
    fn spec(&self) -> &Spec {
        &self.spec
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            images: true,
            video: self.takes_video(),
            audio: None,
            rope: RopeKind::MRope,
            vision_input: VisionInput::Patches,
            crops: None,
            // `Qwen3VLProcessor` (Qwen3-VL-MoE's and Qwen3.5's too).
            video_timestamps: self.takes_video()
                && self.spec.family.video_processor() == Some(VideoFamily::Qwen3Vl),
            texts: &[],
            image_padding: "",
            announcing_text: "",
        }
    }

    fn plan(&self, width: u32, height: u32) -> Result<Geometry, ProcessError> {
        let (resized_width, resized_height, grid_thw) = self.image_size(width, height)?;
        Ok(Geometry::Image {
            resized_width,
            resized_height,
            grid_thw,
        })
    }

    fn num_tokens(&self, geometry: &Geometry) -> usize {
        self.spec.merged_tokens(geometry.grid_thw())
    }

    fn geometry_from_grid(&self, grid_thw: [u32; 3]) -> Result<Geometry, ProcessError> {
        let spec = &self.spec;
        let [t, h, w] = grid_thw;
        let reason = if t != 1 {
            Some(format!("an image has t = 1, not {t}"))
        } else if h == 0 || w == 0 {
            Some("h and w must be at least 1".to_string())
        } else if h % spec.merge_size != 0 || w % spec.merge_size != 0 {
            Some(format!(
                "h and w must be multiples of merge_size {}",
                spec.merge_size
            ))
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(ProcessError::Grid { grid_thw, reason });
        }
        let side = |v: u32| {
            v.checked_mul(spec.patch_size)
                .ok_or_else(|| ProcessError::Grid {
                    grid_thw,
                    reason: "the grid is too large".to_string(),
                })
        };
        Ok(Geometry::Image {
            resized_width: side(w)?,
            resized_height: side(h)?,
            grid_thw,
        })
    }

    /// Qwen2-VL's temporal patches sit one position apart; Qwen2.5-VL's
    /// `tokens_per_second * second_per_grid_t` apart, `second_per_grid_t = temporal_patch_size
    /// / sampled_fps` (float32, as its processor and `get_rope_index` compute them).
    fn video_geometry(
        &self,
        grid_thw: [u32; 3],
        (resized_width, resized_height): (u32, u32),
        sampled_fps: f64,
    ) -> Result<Geometry, ProcessError> {
        if !self.takes_video() {
            return Err(ProcessError::VideoUnsupported);
        }
        let time_interval = match self.spec.tokens_per_second {
            None => 1.0,
            Some(tps) => {
                let second_per_grid_t = f64::from(self.spec.temporal_patch_size) / sampled_fps;
                tps as f32 * second_per_grid_t as f32
            }
        };
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
            track: None,
        })
    }

    fn process_item(&self, image: &DecodedImage) -> Result<ProcessedItem, crate::Error> {
        image.check_rgb()?;
        let (resized_width, resized_height, grid_thw) =
            self.image_size(image.width, image.height)?;
        let geometry = Geometry::Image {
            resized_width,
            resized_height,
            grid_thw,
        };
        let patches = if (resized_width, resized_height) == (image.width, image.height) {
            patchify(image, &self.lut, self.patch_geometry())
        } else {
            let resized = resize(
                image,
                resized_width,
                resized_height,
                self.spec.resample,
                self.spec.backend,
            )?;
            patchify(&resized, &self.lut, self.patch_geometry())
        };
        let (values, grid) = patches.map_err(ResizeError::from)?;
        let feature = Tensor::new(vec![grid.rows, grid.cols], TensorData::F32(values))?;
        let grid_tensor = Tensor::new(
            vec![1, 3],
            TensorData::I64(grid_thw.iter().map(|&v| i64::from(v)).collect()),
        )?;
        Ok(ProcessedItem {
            feature,
            aux: vec![("image_grid_thw", grid_tensor)],
            geometry,
        })
    }

    /// Each pad sits in the vision start and end the chat template writes around it.
    fn placeholders(&self) -> Vec<Placeholder> {
        let spec = &self.spec;
        let between = Some((spec.vision_start_token_id, spec.vision_end_token_id));
        let image = Placeholder {
            id: spec.image_token_id,
            modality: Modality::Image,
            between,
        };
        let video = spec.video_token_id.map(|id| Placeholder {
            id,
            modality: Modality::Video,
            between,
        });
        std::iter::once(image).chain(video).collect()
    }

    /// The pad repeated once per token; with timestamps (Qwen3-VL), a video's pad becomes,
    /// per temporal group, its `<{t:.1f} seconds>` text, vision start, the group's pads and
    /// vision end, each group an item of its own, all inside the prompt's vision start and end.
    fn prompt_update(&self, item: &ItemPrompt<'_>) -> Result<PromptUpdate, ProcessError> {
        let spec = &self.spec;
        let embed = |id, geometry, of| {
            UpdatePart::Embed(Embed {
                id,
                n: self.num_tokens(&geometry),
                runs: Vec::new(),
                geometry,
                of,
            })
        };
        let parts = match item.geometry {
            Geometry::Audio { .. } => {
                return Err(ProcessError::ModalityUnsupported(Modality::Audio))
            }
            Geometry::Image { .. } => {
                vec![embed(spec.image_token_id, item.geometry, EmbedOf::Whole)]
            }
            Geometry::Video {
                resized_width,
                resized_height,
                grid_thw: [t, h, w],
                time_interval,
                ..
            } => {
                let pad = spec.video_token_id.ok_or(ProcessError::VideoUnsupported)?;
                if item.timestamps.is_empty() {
                    vec![embed(pad, item.geometry, EmbedOf::Whole)]
                } else {
                    if item.timestamps.len() != t as usize {
                        return Err(ProcessError::Offsets(format!(
                            "{} timestamp texts for a video of {t} temporal groups",
                            item.timestamps.len()
                        )));
                    }
                    let group = Geometry::Video {
                        resized_width,
                        resized_height,
                        grid_thw: [1, h, w],
                        time_interval,
                        track: None,
                    };
                    let mut parts = Vec::with_capacity(4 * item.timestamps.len());
                    for (g, text) in (0..).zip(item.timestamps) {
                        parts.push(UpdatePart::Text(text.clone().into()));
                        parts.push(UpdatePart::Ids(vec![spec.vision_start_token_id]));
                        parts.push(embed(pad, group, EmbedOf::TemporalGroup(g)));
                        parts.push(UpdatePart::Ids(vec![spec.vision_end_token_id]));
                    }
                    parts
                }
            }
        };
        Ok(PromptUpdate {
            parts,
            announced: false,
        })
    }

    fn positions(
        &self,
        len: usize,
        offsets: &[(usize, usize)],
        geometries: &[Geometry],
    ) -> Result<Positions, ProcessError> {
        if offsets.len() != geometries.len() {
            return Err(ProcessError::Offsets(format!(
                "{} offsets for {} items",
                offsets.len(),
                geometries.len()
            )));
        }
        let blocks: Vec<VisionBlock> = offsets
            .iter()
            .zip(geometries)
            .map(|(&(start, end), geometry)| VisionBlock {
                start,
                end,
                grid_thw: geometry.grid_thw(),
                time_interval: match geometry {
                    Geometry::Video { time_interval, .. } => f64::from(*time_interval),
                    Geometry::Image { .. } | Geometry::Audio { .. } => 1.0,
                },
            })
            .collect();
        mrope_blocks(len, &blocks, self.spec.merge_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::text_pieces::TextPieces;
    use crate::family::registry::spec_from_hf_configs;
    use crate::family::spec::Spec;
    use crate::family::token_layout::{apply, Expanded, Prompt};
    use crate::pipeline::TokenId;

    const IMG: TokenId = 151655;
    const VID: TokenId = 151656;
    const START: TokenId = 151652;
    const END: TokenId = 151653;

    fn qwen_vl(model_type: &str, vision: &str) -> QwenVl {
        let config = format!(
            r#"{{"model_type": "{model_type}", "image_token_id": 151655, "video_token_id": 151656,
            "vision_start_token_id": 151652, "vision_end_token_id": 151653,
            "vision_config": {vision}}}"#
        );
        let pp = r#"{"min_pixels": 3136, "max_pixels": 12845056}"#;
        let spec: Spec = spec_from_hf_configs(pp, &config).unwrap();
        QwenVl::new(spec).unwrap()
    }

    fn qwen2() -> QwenVl {
        qwen_vl("qwen2_vl", "{}")
    }

    /// `ids` with each item's placeholder replaced by its update, videos without timestamps.
    fn expand(
        family: &QwenVl,
        ids: &[TokenId],
        geometries: &[Geometry],
    ) -> Result<Expanded, ProcessError> {
        let items = geometries
            .iter()
            .map(|&geometry| {
                let modality = match geometry {
                    Geometry::Video { .. } => Modality::Video,
                    _ => Modality::Image,
                };
                let item = ItemPrompt {
                    geometry,
                    crops: &[],
                    timestamps: &[],
                    sampled_fps: None,
                };
                Ok((modality, family.prompt_update(&item)?))
            })
            .collect::<Result<Vec<_>, ProcessError>>()?;
        let prompt = Prompt {
            ids,
            ..Prompt::default()
        };
        apply(&prompt, &family.placeholders(), &items)
    }

    #[test]
    fn plan_gives_grid_and_token_count() {
        let family = qwen2();
        let g = family.plan(640, 480).unwrap();
        assert_eq!(g.grid_thw(), [1, 34, 46]);
        assert_eq!(family.num_tokens(&g), 34 * 46 / 4);
    }

    #[test]
    fn a_grid_from_the_tower_plans_as_the_image_it_came_from() {
        let family = qwen2();
        let g = family.plan(640, 480).unwrap();
        assert_eq!(family.geometry_from_grid(g.grid_thw()).unwrap(), g);
        for bad in [[2, 34, 46], [1, 0, 46], [1, 33, 46], [1, 34, u32::MAX - 1]] {
            let err = family.geometry_from_grid(bad).unwrap_err();
            assert_eq!(err.code(), "process.grid", "{bad:?}");
        }
    }

    #[test]
    fn layout_expands_each_placeholder_to_its_token_count() {
        let family = qwen2();
        let g0 = family.plan(56, 56).unwrap(); // 4 tokens
        let g1 = family.plan(112, 56).unwrap(); // 8 tokens
        let ids = [1, START, IMG, END, 2, START, IMG, END, 3];
        let out = expand(&family, &ids, &[g0, g1]).unwrap();
        assert_eq!(out.offsets, vec![(2, 6), (9, 17)]);
        assert_eq!(out.ids.len(), ids.len() - 2 + 12);
        assert!(out.ids[2..6].iter().all(|&t| t == IMG));
        assert_eq!(out.ids[17..], [END, 3]);
    }

    #[test]
    fn videos_expand_their_own_pad_and_space_their_temporal_patches() {
        let family = qwen2();
        let image = family.plan(56, 56).unwrap(); // 4 tokens
        let video = family.video_geometry([3, 4, 6], (84, 56), 2.0).unwrap(); // 18 tokens
        let ids = [1, START, VID, END, 2, START, IMG, END];
        let out = expand(&family, &ids, &[video, image]).unwrap();
        assert_eq!(out.offsets, vec![(2, 20), (23, 27)]);
        assert!(out.ids[2..20].iter().all(|&t| t == VID));
        assert!(out.ids[23..27].iter().all(|&t| t == IMG));
        // An item in the other modality's place is refused.
        let err = expand(&family, &ids, &[image, video]).unwrap_err();
        assert_eq!(err.code(), "process.placeholder_modality");

        // Qwen2-VL: one position per temporal patch; Qwen2.5-VL: tokens_per_second x
        // temporal_patch_size / sampled fps (2 x 2 / 2 = 2 here).
        let rows = |family: &QwenVl, geometry: Geometry| -> Vec<i64> {
            let Positions::MRope { positions, .. } =
                family.positions(19, &[(1, 19)], &[geometry]).unwrap()
            else {
                panic!("mrope")
            };
            positions[1..19].iter().step_by(6).copied().collect()
        };
        assert_eq!(rows(&family, video), vec![1, 2, 3]);
        let qwen25 = qwen_vl("qwen2_5_vl", r#"{"tokens_per_second": 2}"#);
        let spaced = qwen25.video_geometry([3, 4, 6], (84, 56), 2.0).unwrap();
        assert_eq!(rows(&qwen25, spaced), vec![1, 3, 5]);
    }

    #[test]
    fn qwen3_families_write_video_timestamps_and_a_checkpoint_without_a_video_pad_refuses_video() {
        let caps = qwen2().capabilities();
        assert!(caps.video && !caps.video_timestamps);
        for model_type in ["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"] {
            let caps = qwen_vl(model_type, "{}").capabilities();
            assert!(caps.video && caps.video_timestamps, "{model_type}");
        }
        let config = r#"{"model_type": "qwen3_vl_moe", "image_token_id": 151655,
            "vision_start_token_id": 151652, "vision_end_token_id": 151653}"#;
        let padless = QwenVl::new(spec_from_hf_configs("{}", config).unwrap()).unwrap();
        let caps = padless.capabilities();
        assert!(!caps.video && !caps.video_timestamps);
        let err = padless
            .video_geometry([2, 4, 4], (56, 56), 2.0)
            .unwrap_err();
        assert_eq!(err.code(), "process.video_unsupported");
    }

    #[test]
    fn qwen3_writes_each_temporal_group_after_its_text() {
        let qwen3 = qwen_vl("qwen3_vl", "{}");
        let video = qwen3.video_geometry([2, 4, 6], (96, 64), 2.0).unwrap();
        let image = qwen3.plan(64, 64).unwrap(); // 4 tokens
        let timestamps = ["a".to_string(), "b".to_string()];
        let update = |geometry, timestamps| {
            let item = ItemPrompt {
                geometry,
                crops: &[],
                timestamps,
                sampled_fps: None,
            };
            qwen3.prompt_update(&item)
        };
        let items = [
            (Modality::Video, update(video, &timestamps[..]).unwrap()),
            (Modality::Image, update(image, &[]).unwrap()),
        ];
        let groups: Vec<_> = items[0].1.embeds().map(|e| (e.n, e.of)).collect();
        assert_eq!(
            groups,
            [
                (6, EmbedOf::TemporalGroup(0)),
                (6, EmbedOf::TemporalGroup(1))
            ]
        );
        let pieces = TextPieces::new(vec![("a".into(), vec![7, 8]), ("b".into(), vec![9])]);
        let ids = [1, START, VID, END, START, IMG, END, 2];
        let prompt = Prompt {
            ids: &ids,
            pieces: Some(&pieces),
            ..Prompt::default()
        };
        let out = apply(&prompt, &qwen3.placeholders(), &items).unwrap();
        let mut expected = vec![1, START, 7, 8, START];
        expected.extend([VID; 6]);
        expected.extend([END, 9, START]);
        expected.extend([VID; 6]);
        expected.extend([END, END, START]);
        expected.extend([IMG; 4]);
        expected.extend([END, 2]);
        assert_eq!(out.ids, expected);
        assert_eq!(out.offsets, vec![(5, 11), (14, 20), (23, 27)]);
        let err = update(video, &timestamps[..1]).unwrap_err();
        assert_eq!(err.code(), "process.offsets");
    }

    #[test]
    fn layout_refuses_count_mismatch_and_bare_placeholders() {
        let family = qwen2();
        let g = family.plan(56, 56).unwrap();
        let err = expand(&family, &[START, IMG, END], &[g, g]).unwrap_err();
        assert_eq!(err.code(), "process.placeholder_count");
        let err = expand(&family, &[1, IMG, END], &[g]).unwrap_err();
        assert_eq!(err.code(), "process.placeholder_context");
        let err = expand(&family, &[START, IMG], &[g]).unwrap_err();
        assert_eq!(err.code(), "process.placeholder_context");
    }
}
