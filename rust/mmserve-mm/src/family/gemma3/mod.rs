//! Gemma 3: every image resized to the SigLIP tower's fixed square input, normalised, as one
//! `[3, height, width]` tensor; in the prompt, the begin-of-image placeholder the chat
//! template writes is followed by the image's soft tokens and an end-of-image token. 1-D
//! rope. With `do_pan_and_scan`, an elongated image is followed by its crops
//! (`image::pan_and_scan`), each an item of its own, with the processor's texts between them.
//! Mirrors transformers' `Gemma3ImageProcessor(Pil)` and `Gemma3Processor`.

mod config;

use std::sync::Arc;

use crate::family::config::{ConfigFiles, FamilyFacts};
use crate::family::registry::{FamilyModule, FamilyName};
use crate::family::spec::{Spec, SpecError};
use crate::image::resize::resize;
use crate::image::transforms::NormalizeLut;
use crate::pipeline::{
    Capabilities, DecodedImage, Embed, EmbedOf, Family, Geometry, ItemPrompt, Modality,
    Placeholder, Positions, ProcessError, ProcessedItem, PromptUpdate, RopeKind, Tensor,
    TensorData, UpdatePart, VisionInput,
};

/// Gemma 3 as the registry sees it.
#[derive(Debug, Clone, Copy)]
pub struct Gemma3Module;

/// The registry's module of `gemma3`.
pub const GEMMA3: Gemma3Module = Gemma3Module;

impl FamilyModule for Gemma3Module {
    fn read(&self, _: FamilyName, files: &ConfigFiles) -> Result<(Spec, FamilyFacts), SpecError> {
        config::read(files)
    }

    fn build(&self, spec: Spec) -> Result<Arc<dyn Family>, SpecError> {
        Ok(Arc::new(Gemma3::new(spec)?))
    }

    fn modalities(&self) -> &'static [Modality] {
        &[Modality::Image]
    }
}

/// What `Gemma3Processor` writes on both sides of every image before tokenizing.
const IMAGE_PADDING: &str = "\n\n";
/// What `Gemma3Processor.replace_image_token` writes before an image with crops.
const ANNOUNCING_TEXT: &str = "Here is the original image ";
/// What `Gemma3Processor.replace_image_token` writes between an image and its first crop,
/// and between two crops: `" and here are some crops to help you see better "` and `" "`,
/// each with the [`IMAGE_PADDING`] of both images beside it. Both lie between special
/// tokens, so the driver spells them; the padding and the text before the image join the
/// prompt's words, so the caller writes them (`Capabilities::image_padding`).
pub const CROPS_INTRO: &str = "\n\n and here are some crops to help you see better \n\n";
pub const BETWEEN_CROPS: &str = "\n\n \n\n";

/// The Gemma 3 family configured by its spec (which has an `image_size`).
#[derive(Debug, Clone)]
pub struct Gemma3 {
    spec: Spec,
    lut: NormalizeLut,
    /// `[height, width]` of the tower's input.
    size: [u32; 2],
}

impl Gemma3 {
    pub fn new(spec: Spec) -> Result<Self, SpecError> {
        spec.validate()?;
        let size = spec.image_size.ok_or(SpecError::Missing("image_size"))?;
        let lut = spec.normalize_lut()?;
        Ok(Self { spec, lut, size })
    }

    /// The one geometry every image gets: the tower's input and its patch grid.
    fn geometry(&self) -> Geometry {
        let [height, width] = self.size;
        Geometry::Image {
            resized_width: width,
            resized_height: height,
            grid_thw: [
                1,
                height / self.spec.patch_size,
                width / self.spec.patch_size,
            ],
        }
    }
}

impl Family for Gemma3 {
    fn spec(&self) -> &Spec {
        &self.spec
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            images: true,
            video: false,
            audio: None,
            rope: RopeKind::Rope1D,
            vision_input: VisionInput::Image,
            crops: self.spec.pan_and_scan.filter(|_| self.spec.do_pan_and_scan),
            video_timestamps: false,
            texts: &[CROPS_INTRO, BETWEEN_CROPS],
            image_padding: IMAGE_PADDING,
            announcing_text: ANNOUNCING_TEXT,
        }
    }

    fn plan(&self, width: u32, height: u32) -> Result<Geometry, ProcessError> {
        if width == 0 || height == 0 {
            return Err(ProcessError::EmptyImage { width, height });
        }
        Ok(self.geometry())
    }

    fn num_tokens(&self, geometry: &Geometry) -> usize {
        self.spec.merged_tokens(geometry.grid_thw())
    }

    fn geometry_from_grid(&self, grid_thw: [u32; 3]) -> Result<Geometry, ProcessError> {
        let geometry = self.geometry();
        if grid_thw != geometry.grid_thw() {
            return Err(ProcessError::Grid {
                grid_thw,
                reason: format!(
                    "this model's images all have grid {:?}",
                    geometry.grid_thw()
                ),
            });
        }
        Ok(geometry)
    }

    fn process_item(&self, image: &DecodedImage) -> Result<ProcessedItem, crate::Error> {
        image.check_rgb()?;
        let geometry = self.plan(image.width, image.height)?;
        let [height, width] = self.size;
        let resized;
        let source = if (image.width, image.height) == (width, height) {
            image
        } else {
            resized = resize(image, width, height, self.spec.resample, self.spec.backend)?;
            &resized
        };
        // HWC u8 to normalised CHW, as the processors' `pixel_values[i]`.
        let plane = width as usize * height as usize;
        let mut values = vec![0.0f32; 3 * plane];
        for (pixel, rgb) in source.data.chunks_exact(3).enumerate() {
            for (channel, &value) in rgb.iter().enumerate() {
                values[channel * plane + pixel] = self.lut.value(channel, value);
            }
        }
        let feature = Tensor::new(
            vec![3, height as usize, width as usize],
            TensorData::F32(values),
        )?;
        Ok(ProcessedItem {
            feature,
            aux: Vec::new(),
            geometry,
        })
    }

    /// The begin-of-image id the chat template writes, one per image.
    fn placeholders(&self) -> Vec<Placeholder> {
        vec![Placeholder {
            id: self.spec.vision_start_token_id,
            modality: Modality::Image,
            between: None,
        }]
    }

    /// The begin-of-image id kept, then the image's soft tokens and an end-of-image id; each
    /// crop the same after its text, the text before an image with crops announcing them.
    fn prompt_update(&self, item: &ItemPrompt<'_>) -> Result<PromptUpdate, ProcessError> {
        let spec = &self.spec;
        let image = |geometry, of| {
            [
                UpdatePart::Ids(vec![spec.vision_start_token_id]),
                UpdatePart::Embed(Embed {
                    id: spec.image_token_id,
                    n: self.num_tokens(&geometry),
                    runs: Vec::new(),
                    geometry,
                    of,
                }),
                UpdatePart::Ids(vec![spec.vision_end_token_id]),
            ]
        };
        let mut parts = Vec::with_capacity(4 * (item.crops.len() + 1));
        parts.extend(image(item.geometry, EmbedOf::Whole));
        for (crop, &geometry) in (1..).zip(item.crops) {
            let text = if crop == 1 {
                CROPS_INTRO
            } else {
                BETWEEN_CROPS
            };
            parts.push(UpdatePart::Text(text.into()));
            parts.extend(image(geometry, EmbedOf::Crop(crop)));
        }
        Ok(PromptUpdate {
            parts,
            announced: !item.crops.is_empty(),
        })
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
    use crate::common::text_pieces::TextPieces;
    use crate::family::registry::spec_from_hf_configs;
    use crate::family::token_layout::{apply, Expanded, Prompt};
    use crate::image::pan_and_scan::PanAndScan;
    use crate::pipeline::TokenId;

    const BOI: TokenId = 255_999;
    const EOI: TokenId = 256_000;
    const SOFT: TokenId = 262_144;

    fn gemma3() -> Gemma3 {
        let config = r#"{"model_type": "gemma3", "mm_tokens_per_image": 256,
            "vision_config": {"image_size": 896, "patch_size": 14}}"#;
        let pp = r#"{"size": {"height": 896, "width": 896}, "resample": 2}"#;
        Gemma3::new(spec_from_hf_configs(pp, config).unwrap()).unwrap()
    }

    /// `prompt` with image `k` followed by `crops[k]` crops.
    fn expand(
        family: &Gemma3,
        prompt: &Prompt<'_>,
        crops: &[usize],
    ) -> Result<Expanded, ProcessError> {
        let g = family.geometry();
        let grids = [g; 4];
        let items = crops
            .iter()
            .map(|&n| {
                let item = ItemPrompt {
                    geometry: g,
                    crops: &grids[..n],
                    timestamps: &[],
                    sampled_fps: None,
                };
                Ok((Modality::Image, family.prompt_update(&item)?))
            })
            .collect::<Result<Vec<_>, ProcessError>>()?;
        apply(prompt, &family.placeholders(), &items)
    }

    #[test]
    fn every_image_is_256_tokens_of_one_grid() {
        let family = gemma3();
        for (w, h) in [(1, 1), (640, 480), (30, 4000), (896, 896)] {
            let g = family.plan(w, h).unwrap();
            assert_eq!(g.grid_thw(), [1, 64, 64]);
            assert_eq!(family.num_tokens(&g), 256);
        }
        assert_eq!(family.plan(0, 5).unwrap_err().code(), "process.empty_image");
        assert!(family.geometry_from_grid([1, 64, 64]).is_ok());
        let err = family.geometry_from_grid([1, 32, 64]).unwrap_err();
        assert_eq!(err.code(), "process.grid");
    }

    #[test]
    fn layout_wraps_the_soft_tokens_in_begin_and_end_of_image() {
        let family = gemma3();
        let g = family.plan(10, 10).unwrap();
        let ids = [2, 7, BOI, 8, BOI];
        let prompt = |ids| Prompt {
            ids,
            ..Prompt::default()
        };
        let out = expand(&family, &prompt(&ids), &[0, 0]).unwrap();
        assert_eq!(out.offsets, vec![(3, 259), (262, 518)]);
        assert_eq!(out.ids[..3], [2, 7, BOI]);
        assert!(out.ids[3..259].iter().all(|&t| t == SOFT));
        assert_eq!(out.ids[259..262], [EOI, 8, BOI]);
        assert_eq!(out.ids[518..], [EOI]);
        let err = expand(&family, &prompt(&[2, BOI]), &[0, 0]).unwrap_err();
        assert_eq!(err.code(), "process.placeholder_count");
        let positions = family.positions(out.ids.len(), &out.offsets, &[g, g]);
        assert_eq!(positions.unwrap(), Positions::Rope1D { len: 519 });
    }

    #[test]
    fn an_image_with_crops_takes_its_text_from_the_panned_prompt() {
        let family = gemma3();
        // "\n\n" between specials is 108; the crops' texts are spelled whole.
        let pieces = TextPieces::new(vec![
            (CROPS_INTRO.to_string(), vec![108, 40, 108]),
            (BETWEEN_CROPS.to_string(), vec![108, 41, 108]),
        ]);
        // Text 10 before the first image, 20 before the second, 30 after; the panned
        // spelling announces crops before each image (11, 21).
        let plain = [10, BOI, 20, BOI, 30];
        let panned = [10, 11, BOI, 20, 21, BOI, 30];
        let prompt = Prompt {
            ids: &plain,
            announcing_ids: Some(&panned),
            pieces: Some(&pieces),
        };
        let image = |after: &[TokenId]| {
            let mut run = vec![BOI];
            run.extend([SOFT; 256]);
            run.push(EOI);
            run.extend_from_slice(after);
            run
        };
        let out = expand(&family, &prompt, &[0, 2]).unwrap();
        let mut expected = vec![10];
        expected.extend(image(&[20, 21]));
        expected.extend(image(&[108, 40, 108]));
        expected.extend(image(&[108, 41, 108]));
        expected.extend(image(&[30]));
        assert_eq!(out.ids, expected);
        assert_eq!(out.offsets.len(), 4);
        let out = expand(&family, &prompt, &[1, 0]).unwrap();
        let mut expected = vec![10, 11];
        expected.extend(image(&[108, 40, 108]));
        expected.extend(image(&[20]));
        expected.extend(image(&[30]));
        assert_eq!(out.ids, expected);
        let short = Prompt {
            announcing_ids: Some(&panned[..3]),
            ..prompt
        };
        let err = expand(&family, &short, &[0, 1]).unwrap_err();
        assert_eq!(err.code(), "process.placeholder_count");
        let unspelled = Prompt {
            pieces: None,
            ..prompt
        };
        let err = expand(&family, &unspelled, &[1, 0]).unwrap_err();
        assert_eq!(err.code(), "process.prompt_text");
        assert_eq!(family.capabilities().crops, None);
        let panning = Gemma3::new(Spec {
            do_pan_and_scan: true,
            ..family.spec.clone()
        })
        .unwrap();
        assert_eq!(panning.capabilities().crops, Some(PanAndScan::DEFAULT));
    }

    #[test]
    fn pixels_are_channel_planes_of_the_fixed_size() {
        let family = gemma3();
        let image = DecodedImage {
            width: 3,
            height: 2,
            data: vec![255; 18],
        };
        let item = family.process_item(&image).unwrap();
        assert_eq!(item.feature.shape(), [3, 896, 896]);
        let TensorData::F32(values) = item.feature.data() else {
            panic!("expected f32 pixels");
        };
        assert!(values.iter().all(|&v| v == 1.0));
    }
}
