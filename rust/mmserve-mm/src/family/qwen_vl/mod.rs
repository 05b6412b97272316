//! The Qwen-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): one implementation, parameters
//! from the [`Spec`]. Mirrors transformers' `Qwen2VLImageProcessor(Pil)` and `get_rope_index`.

mod geometry;
mod positions;

pub use geometry::{smart_resize, MAX_ASPECT_RATIO};
pub use positions::{mrope_blocks, VisionBlock};

use crate::family::registry::{FamilyName, Spec, SpecError};
use crate::image::resize::{resize, ResizeError};
use crate::image::transforms::{patchify, NormalizeLut, PatchGeometry};
use crate::pipeline::{
    Capabilities, DecodedImage, Family, Geometry, MediaTokens, Positions, ProcessError,
    ProcessedItem, RopeKind, Segment, Tensor, TensorData, TokenId, TokenLayout,
};

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

    pub fn spec(&self) -> &Spec {
        &self.spec
    }

    /// The prompt positions of the media placeholders (image and video pads), each with
    /// whether it is a video's; checks that every one sits between vision start and end, the
    /// way the chat template writes it (engines that find items by the start token rely on
    /// that).
    fn placeholder_positions(
        &self,
        input_ids: &[TokenId],
    ) -> Result<Vec<(usize, bool)>, ProcessError> {
        let spec = &self.spec;
        let mut found = Vec::new();
        for (i, &id) in input_ids.iter().enumerate() {
            let video = Some(id) == spec.video_token_id;
            if id != spec.image_token_id && !video {
                continue;
            }
            let before = i.checked_sub(1).map(|j| input_ids[j]);
            let after = input_ids.get(i + 1).copied();
            if before != Some(spec.vision_start_token_id) || after != Some(spec.vision_end_token_id)
            {
                return Err(ProcessError::PlaceholderContext {
                    index: i,
                    start: spec.vision_start_token_id,
                    placeholder: id,
                    end: spec.vision_end_token_id,
                });
            }
            found.push((i, video));
        }
        Ok(found)
    }

    /// `(resized width, resized height, patch grid)` of a `width` x `height` image.
    fn image_size(&self, width: u32, height: u32) -> Result<(u32, u32, [u32; 3]), ProcessError> {
        let spec = &self.spec;
        let (resized_height, resized_width) = smart_resize(
            height,
            width,
            spec.factor(),
            spec.min_pixels,
            spec.max_pixels,
        )?;
        let grid_thw = [
            1,
            resized_height / spec.patch_size,
            resized_width / spec.patch_size,
        ];
        Ok((resized_width, resized_height, grid_thw))
    }

    /// Whether this family's videos are planned here: every Qwen-VL family with a video pad.
    fn takes_video(&self) -> bool {
        self.spec.video_token_id.is_some()
    }
}

impl Family for QwenVl {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            images: true,
            video: self.takes_video(),
            rope: RopeKind::MRope,
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
        })
    }

    /// `Qwen3VLProcessor` (Qwen3-VL-MoE's too): the video's `<|video_pad|>` becomes, per temporal group,
    /// `<{t:.1f} seconds>`, `<|vision_start|>`, the group's pads and `<|vision_end|>`, all
    /// inside the prompt's own vision start and end.
    fn video_per_group(&self) -> bool {
        matches!(
            self.spec.family,
            FamilyName::Qwen3Vl | FamilyName::Qwen3VlMoe
        ) && self.takes_video()
    }

    fn video_group_prompt(
        &self,
        input_ids: &[TokenId],
        groups: &[Option<Vec<Vec<TokenId>>>],
    ) -> Result<Vec<TokenId>, ProcessError> {
        let placeholders = self.placeholder_positions(input_ids)?;
        if placeholders.len() != groups.len() {
            return Err(ProcessError::PlaceholderCount {
                placeholders: placeholders.len(),
                items: groups.len(),
            });
        }
        let spec = &self.spec;
        let extra: usize = groups.iter().flatten().flatten().map(|t| t.len() + 2).sum();
        let mut out = Vec::with_capacity(input_ids.len() + extra);
        let mut cursor = 0;
        for (&(at, video), texts) in placeholders.iter().zip(groups) {
            let Some(texts) = texts else { continue };
            if !video {
                return Err(ProcessError::Offsets(format!(
                    "the image placeholder at prompt position {at} cannot take a video's groups"
                )));
            }
            out.extend_from_slice(&input_ids[cursor..at]);
            for text in texts {
                out.extend_from_slice(text);
                out.extend([
                    spec.vision_start_token_id,
                    input_ids[at],
                    spec.vision_end_token_id,
                ]);
            }
            cursor = at + 1;
        }
        out.extend_from_slice(&input_ids[cursor..]);
        Ok(out)
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

    fn layout(
        &self,
        input_ids: &[TokenId],
        geometries: &[Geometry],
    ) -> Result<TokenLayout, ProcessError> {
        let placeholders = self.placeholder_positions(input_ids)?;
        if placeholders.len() != geometries.len() {
            return Err(ProcessError::PlaceholderCount {
                placeholders: placeholders.len(),
                items: geometries.len(),
            });
        }
        let mut segments = Vec::with_capacity(2 * placeholders.len() + 1);
        let mut cursor = 0;
        let kind = |video: bool| if video { "a video" } else { "an image" };
        for (item, (&(at, video), geometry)) in placeholders.iter().zip(geometries).enumerate() {
            if video != geometry.is_video() {
                return Err(ProcessError::PlaceholderModality {
                    index: at,
                    item,
                    placeholder: kind(video),
                    given: kind(geometry.is_video()),
                });
            }
            if at > cursor {
                segments.push(Segment::Text(cursor..at));
            }
            segments.push(Segment::Media {
                item,
                tokens: MediaTokens::Repeat {
                    id: input_ids[at],
                    n: self.num_tokens(geometry),
                },
            });
            cursor = at + 1;
        }
        if cursor < input_ids.len() {
            segments.push(Segment::Text(cursor..input_ids.len()));
        }
        Ok(TokenLayout { segments })
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
                    Geometry::Image { .. } => 1.0,
                },
            })
            .collect();
        mrope_blocks(len, &blocks, self.spec.merge_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::registry::{spec_from_hf_configs, Spec};
    use crate::family::token_layout::expand;

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
        let layout = family.layout(&ids, &[g0, g1]).unwrap();
        let out = expand(&layout, &ids, 2).unwrap();
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
        let layout = family.layout(&ids, &[video, image]).unwrap();
        let out = expand(&layout, &ids, 2).unwrap();
        assert_eq!(out.offsets, vec![(2, 20), (23, 27)]);
        assert!(out.ids[2..20].iter().all(|&t| t == VID));
        assert!(out.ids[23..27].iter().all(|&t| t == IMG));
        // An item in the other modality's place is refused.
        let err = family.layout(&ids, &[image, video]).unwrap_err();
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
    fn qwen3_families_plan_video_per_group_and_a_checkpoint_without_a_video_pad_refuses_it() {
        assert!(qwen2().capabilities().video && !qwen2().video_per_group());
        for model_type in ["qwen3_vl", "qwen3_vl_moe"] {
            let qwen3 = qwen_vl(model_type, "{}");
            assert!(
                qwen3.capabilities().video && qwen3.video_per_group(),
                "{model_type}"
            );
        }
        let config = r#"{"model_type": "qwen3_vl_moe", "image_token_id": 151655,
            "vision_start_token_id": 151652, "vision_end_token_id": 151653}"#;
        let padless = QwenVl::new(spec_from_hf_configs("{}", config).unwrap()).unwrap();
        assert!(!padless.capabilities().video && !padless.video_per_group());
        let err = padless
            .video_geometry([2, 4, 4], (56, 56), 2.0)
            .unwrap_err();
        assert_eq!(err.code(), "process.video_unsupported");
    }

    #[test]
    fn qwen3_writes_each_temporal_group_after_its_text() {
        let qwen3 = qwen_vl("qwen3_vl", "{}");
        let ids = [1, START, VID, END, START, IMG, END, 2];
        let groups = [Some(vec![vec![7, 8], vec![9]]), None];
        let out = qwen3.video_group_prompt(&ids, &groups).unwrap();
        let expected = [
            1, START, 7, 8, START, VID, END, 9, START, VID, END, END, START, IMG, END, 2,
        ];
        assert_eq!(out, expected);
        // Each group is now an item of its own, in its own vision start and end.
        assert_eq!(qwen3.placeholder_positions(&out).unwrap().len(), 3);
        let err = qwen3.video_group_prompt(&ids, &[None, Some(vec![vec![7]])]);
        assert_eq!(err.unwrap_err().code(), "process.offsets");
        let err = qwen3.video_group_prompt(&ids, &groups[..1]);
        assert_eq!(err.unwrap_err().code(), "process.placeholder_count");
    }

    #[test]
    fn layout_refuses_count_mismatch_and_bare_placeholders() {
        let family = qwen2();
        let g = family.plan(56, 56).unwrap();
        let err = family.layout(&[START, IMG, END], &[g, g]).unwrap_err();
        assert_eq!(err.code(), "process.placeholder_count");
        let err = family.layout(&[1, IMG, END], &[g]).unwrap_err();
        assert_eq!(err.code(), "process.placeholder_context");
        let err = family.layout(&[START, IMG], &[g]).unwrap_err();
        assert_eq!(err.code(), "process.placeholder_context");
    }
}
