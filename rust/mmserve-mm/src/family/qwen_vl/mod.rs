//! The Qwen-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): one implementation, parameters
//! from the [`Spec`]. Mirrors transformers' `Qwen2VLImageProcessor(Pil)` and `get_rope_index`.

mod geometry;
mod positions;

pub use geometry::{smart_resize, MAX_ASPECT_RATIO};
pub use positions::{mrope, mrope_blocks, VisionBlock};

use crate::family::registry::{Spec, SpecError};
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

    /// Checks that every placeholder sits between vision start and end, the way the chat
    /// template writes it; engines that find images by the start token rely on that.
    fn placeholder_positions(&self, input_ids: &[TokenId]) -> Result<Vec<usize>, ProcessError> {
        let spec = &self.spec;
        let mut found = Vec::new();
        for (i, &id) in input_ids.iter().enumerate() {
            if id != spec.image_token_id {
                continue;
            }
            let before = i.checked_sub(1).map(|j| input_ids[j]);
            let after = input_ids.get(i + 1).copied();
            if before != Some(spec.vision_start_token_id) || after != Some(spec.vision_end_token_id)
            {
                return Err(ProcessError::PlaceholderContext {
                    index: i,
                    start: spec.vision_start_token_id,
                    placeholder: spec.image_token_id,
                    end: spec.vision_end_token_id,
                });
            }
            found.push(i);
        }
        Ok(found)
    }
}

impl Family for QwenVl {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            images: true,
            video: false,
            rope: RopeKind::MRope,
        }
    }

    fn plan(&self, width: u32, height: u32) -> Result<Geometry, ProcessError> {
        let spec = &self.spec;
        let (resized_height, resized_width) = smart_resize(
            height,
            width,
            spec.factor(),
            spec.min_pixels,
            spec.max_pixels,
        )?;
        Ok(Geometry::Image {
            resized_width,
            resized_height,
            grid_thw: [
                1,
                resized_height / spec.patch_size,
                resized_width / spec.patch_size,
            ],
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

    fn process_item(&self, image: &DecodedImage) -> Result<ProcessedItem, crate::Error> {
        image.check_rgb()?;
        let geometry = self.plan(image.width, image.height)?;
        let Geometry::Image {
            resized_width,
            resized_height,
            grid_thw,
        } = geometry;
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
        for (item, (&at, geometry)) in placeholders.iter().zip(geometries).enumerate() {
            if at > cursor {
                segments.push(Segment::Text(cursor..at));
            }
            segments.push(Segment::Media {
                item,
                tokens: MediaTokens::Repeat {
                    id: self.spec.image_token_id,
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
        let grids: Vec<[u32; 3]> = geometries.iter().map(Geometry::grid_thw).collect();
        mrope(len, offsets, &grids, self.spec.merge_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::registry::{spec_from_hf_configs, Spec};
    use crate::family::token_layout::expand;

    const IMG: TokenId = 151655;
    const START: TokenId = 151652;
    const END: TokenId = 151653;

    fn qwen2() -> QwenVl {
        let config = r#"{"model_type": "qwen2_vl", "image_token_id": 151655,
            "vision_start_token_id": 151652, "vision_end_token_id": 151653}"#;
        let pp = r#"{"min_pixels": 3136, "max_pixels": 12845056}"#;
        let spec: Spec = spec_from_hf_configs(pp, config).unwrap();
        QwenVl::new(spec).unwrap()
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
