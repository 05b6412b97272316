//! The spec a family is built from: every parameter its preprocessing and prompt updates need,
//! resolved (the checkpoint's config files read by the family's own module, `config.rs`), and
//! serialised as the spec JSON. A request's processing options are specs too: the builders
//! [`Spec::with_pixel_bounds`] and [`Spec::with_pan_and_scan`] make them.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::audio::features::{LogMelConfig, Padding};
use crate::error::ErrorCode;
use crate::family::registry::FamilyName;
use crate::family::{qwen2_audio, qwen3_omni_moe};
use crate::identity::PixelBounds;
use crate::image::pan_and_scan::PanAndScan;
use crate::image::resize::{Backend, Filter};
use crate::image::transforms::{Convention, NormalizeLut};

/// Spec JSON names of the resize settings (`"bicubic"`, `"pil"`, ...).
mod names {
    use serde::{de::Error as _, Deserialize, Deserializer, Serializer};

    use crate::image::resize::{Backend, Filter};

    pub mod filter {
        use super::*;

        pub fn serialize<S: Serializer>(filter: &Filter, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_str(match filter {
                Filter::Bicubic => "bicubic",
                Filter::Lanczos => "lanczos",
                Filter::Bilinear => "bilinear",
            })
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Filter, D::Error> {
            Filter::from_name(&String::deserialize(d)?).map_err(D::Error::custom)
        }
    }

    pub mod backend {
        use super::*;

        pub fn serialize<S: Serializer>(backend: &Backend, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_str(match backend {
                Backend::Pil => "pil",
                Backend::TorchU8 => "torch",
            })
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Backend, D::Error> {
            Backend::from_name(&String::deserialize(d)?).map_err(D::Error::custom)
        }
    }
}

/// All parameters a family needs, resolved. Serialised as the spec JSON.
///
/// The vision tower sees a grid of `patch_size` patches; `merge_size` x `merge_size` of them
/// make one language-model token (Qwen-VL's patch merger, Gemma 3's average pool).
/// `image_size` is set for families that resize every image to one size; the others resize
/// within `[min_pixels, max_pixels]`. `vision_start_token_id` / `vision_end_token_id` are the
/// tokens around an image (Gemma 3: begin/end of image).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Spec {
    pub family: FamilyName,
    pub patch_size: u32,
    pub merge_size: u32,
    pub temporal_patch_size: u32,
    pub min_pixels: u64,
    pub max_pixels: u64,
    pub image_mean: [f64; 3],
    pub image_std: [f64; 3],
    pub rescale_factor: f64,
    /// `bicubic`, `lanczos` or `bilinear`.
    #[serde(with = "names::filter")]
    pub resample: Filter,
    /// `pil` (PIL's resize, numpy's float arithmetic) or `torch` (torchvision's).
    #[serde(with = "names::backend")]
    pub backend: Backend,
    pub image_token_id: u32,
    pub vision_start_token_id: u32,
    pub vision_end_token_id: u32,
    /// `[height, width]` every image is resized to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_size: Option<[u32; 2]>,
    /// The placeholder a video's tokens expand from (families that take video).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub video_token_id: Option<u32>,
    /// Qwen2.5-VL's `vision_config.tokens_per_second`: a video's temporal patches sit
    /// `tokens_per_second * temporal_patch_size / sampled fps` positions apart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_second: Option<f64>,
    /// Gemma 3's pan-and-scan knobs (the preprocessor config's, else the processor's
    /// defaults), which a request turning `do_pan_and_scan` on crops by.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pan_and_scan: Option<PanAndScan>,
    /// Whether elongated images are cut into `pan_and_scan` crops.
    #[serde(default, skip_serializing_if = "is_false")]
    pub do_pan_and_scan: bool,
    /// `[min_pixels, max_pixels]` a request set (vLLM's `mm_processor_kwargs`), which images
    /// are resized within instead of the model's own; they enter each image's identity
    /// ([`crate::identity::image`]). `None`: the model's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pixel_bounds: Option<PixelBounds>,
    /// A family that takes audio: its extractor and audio placeholder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audio: Option<AudioSpec>,
}

/// A Whisper-style feature extractor's parameters (`preprocessor_config.json`), how the
/// family's processor calls it, the placeholder a clip's tokens expand from and the rule that
/// counts them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AudioSpec {
    pub audio_token_id: u32,
    pub feature_size: usize,
    pub sampling_rate: u32,
    pub hop_length: usize,
    pub n_fft: usize,
    pub chunk_length: u32,
    pub padding_value: f32,
    /// The processor's `padding`: `max_length`, to the chunk (Qwen2-Audio, Qwen2.5-Omni; the
    /// default), or `longest` (Qwen3-Omni's `padding=True`: one clip keeps its length).
    #[serde(default = "max_length", skip_serializing_if = "is_max_length")]
    pub padding: Padding,
    /// The processor's `truncation`: whether a clip past the chunk is cut to it (the
    /// default), or bounded only by the operator's longest clip (Qwen3-Omni).
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub truncation: bool,
    /// Qwen3-Omni's audio tower window (`audio_config.n_window`): a clip's tokens count per
    /// `2 * n_window` frames ([`crate::family::qwen3_omni_moe::audio_tokens`]). `None`:
    /// Qwen2-Audio's count over the whole clip ([`crate::family::qwen2_audio::audio_tokens`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_window: Option<u32>,
    /// How a video's own audio track interleaves with its frames, for a family that serves
    /// it (`use_audio_in_video`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_video: Option<TrackInVideo>,
}

/// Qwen2.5-Omni's interleaving of a video's frames with its audio track: the track's tokens
/// between `audio_start_token_id` and `audio_end_token_id` inside the video's vision bos and
/// eos, frames and audio alternating every `seconds_per_chunk` seconds of positions.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrackInVideo {
    pub audio_start_token_id: u32,
    pub audio_end_token_id: u32,
    pub seconds_per_chunk: f64,
}

impl AudioSpec {
    /// The extractor these parameters make.
    pub fn log_mel(&self) -> LogMelConfig {
        LogMelConfig {
            feature_size: self.feature_size,
            sampling_rate: self.sampling_rate,
            hop_length: self.hop_length,
            n_fft: self.n_fft,
            chunk_length: self.chunk_length,
            padding_value: self.padding_value,
            padding: self.padding,
            truncation: self.truncation,
        }
    }

    /// The tokens a clip of `frames` valid feature frames expands to.
    pub fn tokens(&self, frames: u32) -> usize {
        match self.n_window {
            None => qwen2_audio::audio_tokens(frames),
            Some(n_window) => qwen3_omni_moe::audio_tokens(frames, n_window),
        }
    }
}

fn is_false(value: &bool) -> bool {
    !value
}

fn is_true(value: &bool) -> bool {
    *value
}

fn yes() -> bool {
    true
}

fn max_length() -> Padding {
    Padding::MaxLength
}

fn is_max_length(padding: &Padding) -> bool {
    *padding == Padding::MaxLength
}

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SpecError {
    #[error("spec JSON is invalid: {0}")]
    Json(String),
    #[error("model_type '{0}' is not supported (known: {known})", known = FamilyName::known())]
    UnknownFamily(String),
    #[error("config is missing {0}")]
    Missing(&'static str),
    /// A checkpoint of a family that takes a modality must name the token its items of that
    /// modality expand from.
    #[error("config.json names no {modality} token, though {family} takes {modality}")]
    NoPlaceholder {
        family: &'static str,
        modality: &'static str,
    },
    #[error("{field} has an unusable value: {reason}")]
    Invalid { field: &'static str, reason: String },
    #[error(
        "preprocessor_config.json and config.json disagree on {field}: {preprocessor} vs {model}"
    )]
    Inconsistent {
        field: &'static str,
        preprocessor: u64,
        model: u64,
    },
}

impl SpecError {
    /// This error's entry in the catalogue of codes.
    pub fn kind(&self) -> ErrorCode {
        match self {
            SpecError::Json(_) => ErrorCode::SpecJson,
            SpecError::UnknownFamily(_) => ErrorCode::SpecUnknownFamily,
            SpecError::Missing(_) | SpecError::NoPlaceholder { .. } => ErrorCode::SpecMissing,
            SpecError::Invalid { .. } => ErrorCode::SpecInvalid,
            SpecError::Inconsistent { .. } => ErrorCode::SpecInconsistent,
        }
    }

    /// Stable machine-readable code, e.g. `spec.json`.
    pub fn code(&self) -> &'static str {
        self.kind().code()
    }
}

pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> SpecError {
    SpecError::Invalid {
        field,
        reason: reason.into(),
    }
}

impl Spec {
    /// Parses and validates a spec JSON.
    pub fn from_json(json: &str) -> Result<Self, SpecError> {
        let spec: Spec = serde_json::from_str(json).map_err(|e| SpecError::Json(e.to_string()))?;
        spec.validate()?;
        Ok(spec)
    }

    pub fn to_json(&self) -> String {
        // A struct of plain numbers, strings and arrays always serialises.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Side length every resized image is a multiple of.
    pub fn factor(&self) -> u32 {
        self.patch_size * self.merge_size
    }

    /// The pixel bounds images are resized within: a request's, else the model's own.
    pub fn resize_bounds(&self) -> PixelBounds {
        self.pixel_bounds
            .unwrap_or([self.min_pixels, self.max_pixels])
    }

    /// This spec resizing images within a request's `bounds` (`None`, or the model's own: as
    /// the model does, the images keeping their plain identity).
    pub fn with_pixel_bounds(&self, bounds: Option<PixelBounds>) -> Result<Spec, SpecError> {
        let own = [self.min_pixels, self.max_pixels];
        let spec = Spec {
            pixel_bounds: bounds.filter(|&b| b != own),
            ..self.clone()
        };
        spec.validate()?;
        Ok(spec)
    }

    /// This spec cutting elongated images into crops by `knobs` (`None`: not cutting them),
    /// for a family that can pan and scan (one whose config gives the knobs).
    pub fn with_pan_and_scan(&self, knobs: Option<PanAndScan>) -> Result<Spec, SpecError> {
        if knobs.is_some() && self.pan_and_scan.is_none() {
            return Err(invalid(
                "do_pan_and_scan",
                format!("{} does not pan and scan", self.family.model_type()),
            ));
        }
        let spec = Spec {
            do_pan_and_scan: knobs.is_some(),
            pan_and_scan: knobs.or(self.pan_and_scan),
            ..self.clone()
        };
        spec.validate()?;
        Ok(spec)
    }

    /// The rescale-and-normalise table of this spec, in its backend's arithmetic.
    pub fn normalize_lut(&self) -> Result<NormalizeLut, SpecError> {
        let convention = match self.backend {
            Backend::Pil => Convention::PilNumpy,
            Backend::TorchU8 => Convention::Torchvision,
        };
        NormalizeLut::new(
            self.image_mean,
            self.image_std,
            self.rescale_factor,
            convention,
        )
        .map_err(|e| SpecError::Invalid {
            field: "image_std",
            reason: e.to_string(),
        })
    }

    /// Tokens an item with this patch grid takes in the prompt, after the spatial merge.
    pub fn merged_tokens(&self, grid_thw: [u32; 3]) -> usize {
        let [t, h, w] = grid_thw.map(|v| v as usize);
        let merge = self.merge_size as usize;
        t * h * w / (merge * merge)
    }

    pub fn validate(&self) -> Result<(), SpecError> {
        if let Some(audio) = &self.audio {
            audio
                .log_mel()
                .validate()
                .map_err(|e| invalid("audio", e.to_string()))?;
            if audio.n_window == Some(0) {
                return Err(invalid("audio_config.n_window", "0 frames"));
            }
        }
        for (field, v) in [
            ("patch_size", self.patch_size),
            ("merge_size", self.merge_size),
            ("temporal_patch_size", self.temporal_patch_size),
        ] {
            if v == 0 || v > 1024 {
                return Err(invalid(field, format!("{v} is not in 1..=1024")));
            }
        }
        if self.min_pixels == 0 || self.min_pixels > self.max_pixels {
            return Err(invalid(
                "min_pixels",
                format!(
                    "need 0 < min_pixels <= max_pixels, got {} and {}",
                    self.min_pixels, self.max_pixels
                ),
            ));
        }
        // Keeps every pixel index and element count well inside u32/usize arithmetic.
        const MAX_PIXELS_LIMIT: u64 = 1 << 30;
        if self.max_pixels > MAX_PIXELS_LIMIT {
            return Err(invalid(
                "max_pixels",
                format!("{} is over {MAX_PIXELS_LIMIT}", self.max_pixels),
            ));
        }
        if let Some([low, high]) = self.pixel_bounds {
            if low == 0 || low > high || high > MAX_PIXELS_LIMIT {
                return Err(invalid(
                    "pixel_bounds",
                    format!("need 0 < min_pixels <= max_pixels <= {MAX_PIXELS_LIMIT}, got {low} and {high}"),
                ));
            }
            if self.image_size.is_some() {
                return Err(invalid(
                    "pixel_bounds",
                    "a family with a fixed image size resizes every image to it",
                ));
            }
        }
        if self.image_std.iter().any(|s| !s.is_finite() || *s == 0.0)
            || self.image_mean.iter().any(|m| !m.is_finite())
        {
            return Err(invalid(
                "image_std",
                "mean and std must be finite, std non-zero",
            ));
        }
        if !self.rescale_factor.is_finite() || self.rescale_factor == 0.0 {
            return Err(invalid("rescale_factor", "must be finite and non-zero"));
        }
        if let Some(tps) = self.tokens_per_second {
            if !(tps.is_finite() && tps > 0.0) {
                return Err(invalid(
                    "tokens_per_second",
                    format!("{tps} is not positive"),
                ));
            }
        }
        match (self.pan_and_scan, self.do_pan_and_scan) {
            (Some(knobs), _) => knobs.validate()?,
            (None, true) => {
                return Err(invalid(
                    "do_pan_and_scan",
                    "pan-and-scan needs its knobs (pan_and_scan)",
                ))
            }
            (None, false) => {}
        }
        if let Some([height, width]) = self.image_size {
            let fits = |side: u32| side > 0 && side.is_multiple_of(self.factor());
            if !fits(height) || !fits(width) {
                return Err(invalid(
                    "image_size",
                    format!(
                        "{height}x{width} is not a positive multiple of patch x merge ({})",
                        self.factor()
                    ),
                ));
            }
            let area = u64::from(height) * u64::from(width);
            if (self.min_pixels, self.max_pixels) != (area, area) {
                return Err(invalid(
                    "min_pixels",
                    "a fixed image size needs min_pixels = max_pixels = its area",
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::family::registry::spec_from_hf_configs;
    use crate::image::pan_and_scan::PanAndScan;

    const QWEN: &str = r#"{"model_type": "qwen2_vl", "image_token_id": 1,
        "vision_start_token_id": 2, "vision_end_token_id": 3}"#;
    const GEMMA: &str = r#"{"model_type": "gemma3", "vision_config": {"image_size": 896,
        "patch_size": 14}}"#;

    #[test]
    fn a_request_s_options_are_specs_of_their_own() {
        let qwen = spec_from_hf_configs("{}", QWEN).unwrap();
        let bounded = qwen.with_pixel_bounds(Some([3136, 50_000])).unwrap();
        assert_eq!(bounded.resize_bounds(), [3136, 50_000]);
        assert_eq!(bounded.with_pixel_bounds(None).unwrap(), qwen);
        for bad in [[0, 10], [20, 10], [1, 1 << 31]] {
            let err = qwen.with_pixel_bounds(Some(bad)).unwrap_err();
            assert_eq!(err.code(), "spec.invalid", "{bad:?}");
        }
        let err = qwen
            .with_pan_and_scan(Some(PanAndScan::DEFAULT))
            .unwrap_err();
        assert!(
            err.to_string().contains("qwen2_vl does not pan and scan"),
            "{err}"
        );
        assert_eq!(qwen.with_pan_and_scan(None).unwrap(), qwen);

        let gemma = spec_from_hf_configs("{}", GEMMA).unwrap();
        let knobs = PanAndScan::new(32, 2, 1.5).unwrap();
        let panning = gemma.with_pan_and_scan(Some(knobs)).unwrap();
        assert!(panning.do_pan_and_scan && panning.pan_and_scan == Some(knobs));
        let off = panning.with_pan_and_scan(None).unwrap();
        assert!(!off.do_pan_and_scan && off.pan_and_scan == Some(knobs));
        // A fixed-size tower resizes every image to its size: the model's own bounds only.
        let own = [gemma.min_pixels, gemma.max_pixels];
        assert_eq!(gemma.with_pixel_bounds(Some(own)).unwrap(), gemma);
        let err = gemma.with_pixel_bounds(Some([1, own[1]])).unwrap_err();
        assert_eq!(err.code(), "spec.invalid");
    }
}
