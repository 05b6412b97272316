//! A model family from a spec of resolved parameters, and the spec from a model's
//! Hugging Face config files so nobody writes one by hand.
//!
//! Where `preprocessor_config.json` leaves a value out, the spec takes what the family's
//! transformers image processor would (its class attributes), after the model's
//! `vision_config`.
//!
//! This is the one parser of a checkpoint's config files: [`checkpoint_from_hf_configs`] also
//! reads the facts the language-model side needs ([`ModelFacts`]), which Python takes from here.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use thiserror::Error;

use crate::error::ErrorCode;
use crate::family::gemma3::Gemma3;
use crate::family::qwen_vl::QwenVl;
use crate::identity::PixelBounds;
use crate::image::pan_and_scan::PanAndScan;
use crate::image::resize::{Backend, Filter};
use crate::image::transforms::{Convention, NormalizeLut};
use crate::pipeline::Family;

/// The model families this crate preprocesses for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FamilyName {
    Qwen2Vl,
    #[serde(rename = "qwen2_5_vl")]
    Qwen25Vl,
    Qwen3Vl,
    /// Qwen3-VL's vision and preprocessing before a mixture-of-experts language model.
    Qwen3VlMoe,
    /// Qwen3-VL's vision without deepstack before a hybrid language model (Gated DeltaNet
    /// linear-attention layers beside full attention).
    #[serde(rename = "qwen3_5")]
    Qwen35,
    /// Qwen3.5 with a mixture-of-experts language model.
    #[serde(rename = "qwen3_5_moe")]
    Qwen35Moe,
    /// A fixed-size SigLIP image between begin/end-of-image tokens, 1-D rope.
    Gemma3,
}

impl FamilyName {
    /// Maps a `config.json` `model_type`.
    pub fn from_model_type(model_type: &str) -> Option<Self> {
        match model_type {
            "qwen2_vl" => Some(Self::Qwen2Vl),
            "qwen2_5_vl" => Some(Self::Qwen25Vl),
            "qwen3_vl" => Some(Self::Qwen3Vl),
            "qwen3_vl_moe" => Some(Self::Qwen3VlMoe),
            "qwen3_5" => Some(Self::Qwen35),
            "qwen3_5_moe" => Some(Self::Qwen35Moe),
            "gemma3" => Some(Self::Gemma3),
            _ => None,
        }
    }

    /// Families with Qwen3-VL's preprocessing, timestamped video groups and positions.
    pub fn is_qwen3_vision(self) -> bool {
        matches!(
            self,
            Self::Qwen3Vl | Self::Qwen3VlMoe | Self::Qwen35 | Self::Qwen35Moe
        )
    }
}

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
}

fn is_false(value: &bool) -> bool {
    !value
}

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SpecError {
    #[error("spec JSON is invalid: {0}")]
    Json(String),
    #[error(
        "model_type '{0}' is not supported (known: gemma3, qwen2_5_vl, qwen2_vl, qwen3_5, qwen3_5_moe, qwen3_vl, qwen3_vl_moe)"
    )]
    UnknownFamily(String),
    #[error("config is missing {0}")]
    Missing(&'static str),
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
            SpecError::Missing(_) => ErrorCode::SpecMissing,
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
                format!("{:?} does not pan and scan", self.family),
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

/// Builds the family a spec describes.
pub fn family_from_spec(spec: &Spec) -> Result<Arc<dyn Family>, SpecError> {
    spec.validate()?;
    Ok(match spec.family {
        FamilyName::Qwen2Vl
        | FamilyName::Qwen25Vl
        | FamilyName::Qwen3Vl
        | FamilyName::Qwen3VlMoe
        | FamilyName::Qwen35
        | FamilyName::Qwen35Moe => Arc::new(QwenVl::new(spec.clone())?),
        FamilyName::Gemma3 => Arc::new(Gemma3::new(spec.clone())?),
    })
}

/// Defaults of transformers' `Qwen2VLImageProcessor` (class attributes), used only for keys
/// that a `preprocessor_config.json` and the model's `vision_config` both leave out.
mod hf_defaults {
    pub const PATCH_SIZE: u64 = 14;
    pub const MERGE_SIZE: u64 = 2;
    pub const TEMPORAL_PATCH_SIZE: u64 = 2;
    pub const MIN_PIXELS: u64 = 56 * 56;
    pub const MAX_PIXELS: u64 = 28 * 28 * 1280;
    pub const IMAGE_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
    pub const IMAGE_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];
    pub const RESCALE_FACTOR: f64 = 1.0 / 255.0;
    pub const RESAMPLE_BICUBIC: i64 = 3;
}

pub(crate) fn parse_object(
    json: &str,
    what: &'static str,
) -> Result<serde_json::Map<String, Value>, SpecError> {
    match serde_json::from_str::<Value>(json) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(SpecError::Json(format!("{what} is not a JSON object"))),
        Err(e) => Err(SpecError::Json(format!("{what}: {e}"))),
    }
}

pub(crate) fn as_u64(v: &Value, field: &'static str) -> Result<u64, SpecError> {
    v.as_u64()
        .ok_or_else(|| invalid(field, format!("expected a non-negative integer, got {v}")))
}

pub(crate) fn as_u32(v: &Value, field: &'static str) -> Result<u32, SpecError> {
    u32::try_from(as_u64(v, field)?).map_err(|_| invalid(field, format!("{v} is too large")))
}

pub(crate) fn as_triple(v: &Value, field: &'static str) -> Result<[f64; 3], SpecError> {
    let bad = || invalid(field, format!("expected a number or 3 numbers, got {v}"));
    if let Some(x) = v.as_f64() {
        return Ok([x; 3]);
    }
    let list = v.as_array().ok_or_else(bad)?;
    match list.as_slice() {
        [a, b, c] => Ok([
            a.as_f64().ok_or_else(bad)?,
            b.as_f64().ok_or_else(bad)?,
            c.as_f64().ok_or_else(bad)?,
        ]),
        _ => Err(bad()),
    }
}

/// A preprocessor value, checked against the model config's value for the same quantity.
fn size_param(
    preprocessor: &serde_json::Map<String, Value>,
    key: &'static str,
    vision: Option<&Value>,
    vision_key: &str,
    default: u64,
) -> Result<u32, SpecError> {
    let from_preprocessor = preprocessor.get(key).map(|v| as_u64(v, key)).transpose()?;
    let from_model = vision
        .and_then(|v| v.get(vision_key))
        .map(|v| as_u64(v, key))
        .transpose()?;
    let value = match (from_preprocessor, from_model) {
        (Some(p), Some(m)) if p != m => {
            return Err(SpecError::Inconsistent {
                field: key,
                preprocessor: p,
                model: m,
            })
        }
        (Some(p), _) => p,
        (None, Some(m)) => m,
        (None, None) => default,
    };
    u32::try_from(value).map_err(|_| invalid(key, format!("{value} is too large")))
}

/// The spec of a checkpoint, from the text of its `preprocessor_config.json` and
/// `config.json`. The backend follows `image_processor_type` (`...Pil` means PIL); other
/// processors are transformers 5's torchvision ones.
pub fn spec_from_hf_configs(preprocessor_config: &str, config: &str) -> Result<Spec, SpecError> {
    let pp = parse_object(preprocessor_config, "preprocessor_config.json")?;
    let cfg = parse_object(config, "config.json")?;
    spec_from_objects(&pp, &cfg)
}

/// What a checkpoint's config files say beyond the preprocessing spec: the facts the
/// language-model side needs (each `None` where the files leave it out) and a digest of the
/// files. Text settings are read from `text_config`, else from the top level (older
/// checkpoints keep them there).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelFacts {
    /// `config.json` `model_type`.
    pub model_type: String,
    pub video_token_id: Option<u32>,
    /// From `generation_config.json` where it names any, else from the text config.
    pub eos_token_ids: Vec<u32>,
    pub vocab_size: Option<u64>,
    pub hidden_size: Option<u64>,
    /// `num_hidden_layers`.
    pub num_layers: Option<u64>,
    pub max_position_embeddings: Option<u64>,
    /// 16 lowercase hex digits of blake3 over `config.json` and `preprocessor_config.json`
    /// (keys sorted, compact): two checkpoints with equal digests produce equal embeddings.
    pub config_digest: String,
}

/// A checkpoint as its config files describe it: the family spec and the model facts.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    pub spec: Spec,
    pub model: ModelFacts,
}

/// [`spec_from_hf_configs`] and the [`ModelFacts`] of the same files, plus the text of
/// `generation_config.json` when the checkpoint has one.
pub fn checkpoint_from_hf_configs(
    preprocessor_config: &str,
    config: &str,
    generation_config: Option<&str>,
) -> Result<Checkpoint, SpecError> {
    let pp = parse_object(preprocessor_config, "preprocessor_config.json")?;
    let cfg = parse_object(config, "config.json")?;
    let generation = generation_config
        .map(|text| parse_object(text, "generation_config.json"))
        .transpose()?;
    let spec = spec_from_objects(&pp, &cfg)?;
    let model = model_facts(&pp, &cfg, generation.as_ref())?;
    Ok(Checkpoint { spec, model })
}

type Object = serde_json::Map<String, Value>;

/// A text setting: `text_config`'s value, else the top level's; `null` counts as absent.
fn text_value<'a>(cfg: &'a Object, key: &str) -> Option<&'a Value> {
    cfg.get("text_config")
        .and_then(|t| t.get(key))
        .filter(|v| !v.is_null())
        .or_else(|| cfg.get(key).filter(|v| !v.is_null()))
}

/// One token id or a list of them.
fn as_ids(v: &Value, field: &'static str) -> Result<Vec<u32>, SpecError> {
    match v {
        Value::Array(list) => list.iter().map(|id| as_u32(id, field)).collect(),
        one => Ok(vec![as_u32(one, field)?]),
    }
}

fn model_facts(
    pp: &Object,
    cfg: &Object,
    generation: Option<&Object>,
) -> Result<ModelFacts, SpecError> {
    let model_type = cfg
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or(SpecError::Missing("config.json model_type"))?
        .to_owned();
    let count = |key: &'static str| text_value(cfg, key).map(|v| as_u64(v, key)).transpose();
    let video_token_id = config_video_token(cfg)?;
    let from_generation = generation
        .and_then(|g| g.get("eos_token_id"))
        .filter(|v| !v.is_null())
        .map(|v| as_ids(v, "eos_token_id"))
        .transpose()?
        .unwrap_or_default();
    let eos_token_ids = if from_generation.is_empty() {
        text_value(cfg, "eos_token_id")
            .map(|v| as_ids(v, "eos_token_id"))
            .transpose()?
            .unwrap_or_default()
    } else {
        from_generation
    };
    let mut hasher = blake3::Hasher::new();
    hasher.update(Value::Object(cfg.clone()).to_string().as_bytes());
    hasher.update(b"\n");
    hasher.update(Value::Object(pp.clone()).to_string().as_bytes());
    let config_digest = hasher.finalize().to_hex()[..16].to_string();
    Ok(ModelFacts {
        model_type,
        video_token_id,
        eos_token_ids,
        vocab_size: count("vocab_size")?,
        hidden_size: count("hidden_size")?,
        num_layers: count("num_hidden_layers")?,
        max_position_embeddings: count("max_position_embeddings")?,
        config_digest,
    })
}

fn spec_from_objects(pp: &Object, cfg: &Object) -> Result<Spec, SpecError> {
    let model_type = cfg
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or(SpecError::Missing("config.json model_type"))?;
    let family = FamilyName::from_model_type(model_type)
        .ok_or_else(|| SpecError::UnknownFamily(model_type.to_owned()))?;

    // `do_convert_rgb` too: decoding paints the transparent colour white as its
    // `convert_to_rgb` does.
    for flag in ["do_resize", "do_rescale", "do_normalize", "do_convert_rgb"] {
        if pp.get(flag).and_then(Value::as_bool) == Some(false) {
            return Err(invalid(flag, "only true is supported"));
        }
    }
    if family == FamilyName::Gemma3 {
        return gemma3_spec(pp, cfg);
    }

    let vision = cfg.get("vision_config");
    let patch_size = size_param(
        pp,
        "patch_size",
        vision,
        "patch_size",
        hf_defaults::PATCH_SIZE,
    )?;
    let merge_size = size_param(
        pp,
        "merge_size",
        vision,
        "spatial_merge_size",
        hf_defaults::MERGE_SIZE,
    )?;
    let temporal_patch_size = size_param(
        pp,
        "temporal_patch_size",
        vision,
        "temporal_patch_size",
        hf_defaults::TEMPORAL_PATCH_SIZE,
    )?;

    // As transformers' constructor: `min_pixels`/`max_pixels` override `size`.
    let size = pp.get("size");
    let pixels = |flat: &'static str, edge: &str, default: u64| -> Result<u64, SpecError> {
        match (pp.get(flat), size.and_then(|s| s.get(edge))) {
            (Some(v), _) => as_u64(v, flat),
            (None, Some(v)) => as_u64(v, flat),
            (None, None) => Ok(default),
        }
    };
    let min_pixels = pixels("min_pixels", "shortest_edge", hf_defaults::MIN_PIXELS)?;
    let max_pixels = pixels("max_pixels", "longest_edge", hf_defaults::MAX_PIXELS)?;

    let Normalize {
        image_mean,
        image_std,
        rescale_factor,
        backend,
    } = normalize_params(pp, hf_defaults::IMAGE_MEAN, hf_defaults::IMAGE_STD)?;
    let resample = resample(pp, hf_defaults::RESAMPLE_BICUBIC)?;
    let token = |key: &'static str| config_token(cfg, key, key);

    let spec = Spec {
        family,
        patch_size,
        merge_size,
        temporal_patch_size,
        min_pixels,
        max_pixels,
        image_mean,
        image_std,
        rescale_factor,
        resample,
        backend,
        image_token_id: token("image_token_id")?,
        vision_start_token_id: token("vision_start_token_id")?,
        vision_end_token_id: token("vision_end_token_id")?,
        image_size: None,
        video_token_id: config_video_token(cfg)?,
        tokens_per_second: tokens_per_second(family, cfg)?,
        pan_and_scan: None,
        do_pan_and_scan: false,
        pixel_bounds: None,
    };
    spec.validate()?;
    Ok(spec)
}

/// The pixel arithmetic settings every family reads the same way.
struct Normalize {
    image_mean: [f64; 3],
    image_std: [f64; 3],
    rescale_factor: f64,
    backend: Backend,
}

fn normalize_params(
    pp: &Object,
    default_mean: [f64; 3],
    default_std: [f64; 3],
) -> Result<Normalize, SpecError> {
    let triple = |key: &'static str, default: [f64; 3]| {
        pp.get(key)
            .map(|v| as_triple(v, key))
            .transpose()
            .map(|v| v.unwrap_or(default))
    };
    let rescale_factor = match pp.get("rescale_factor") {
        Some(v) => v
            .as_f64()
            .ok_or_else(|| invalid("rescale_factor", format!("expected a number, got {v}")))?,
        None => hf_defaults::RESCALE_FACTOR,
    };
    let backend = match pp.get("image_processor_type").and_then(Value::as_str) {
        Some(t) if t.ends_with("Pil") => Backend::Pil,
        _ => Backend::TorchU8,
    };
    Ok(Normalize {
        image_mean: triple("image_mean", default_mean)?,
        image_std: triple("image_std", default_std)?,
        rescale_factor,
        backend,
    })
}

/// `resample` (a PIL filter code), or the processor's default.
fn resample(pp: &Object, default: i64) -> Result<Filter, SpecError> {
    let code = match pp.get("resample") {
        Some(v) => v
            .as_i64()
            .ok_or_else(|| invalid("resample", format!("expected an integer, got {v}")))?,
        None => default,
    };
    Filter::from_pil_code(code).map_err(|e| invalid("resample", e.to_string()))
}

/// A token id from `config.json` (top level, else `text_config`) under `key`.
/// `video_token_id`, at the top level or in `text_config`; `None` where neither names one.
fn config_video_token(cfg: &Object) -> Result<Option<u32>, SpecError> {
    cfg.get("video_token_id")
        .or_else(|| cfg.get("text_config").and_then(|t| t.get("video_token_id")))
        .filter(|v| !v.is_null())
        .map(|v| as_u32(v, "video_token_id"))
        .transpose()
}

/// Qwen2.5-VL's `vision_config.tokens_per_second` (transformers' default 4 where the config
/// leaves it out); `None` for the families whose video positions do not use it.
fn tokens_per_second(family: FamilyName, cfg: &Object) -> Result<Option<f64>, SpecError> {
    if family != FamilyName::Qwen25Vl {
        return Ok(None);
    }
    match cfg
        .get("vision_config")
        .and_then(|v| v.get("tokens_per_second"))
    {
        None | Some(Value::Null) => Ok(Some(4.0)),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| {
            invalid(
                "vision_config.tokens_per_second",
                format!("expected a number, got {v}"),
            )
        }),
    }
}

fn config_token(cfg: &Object, key: &str, field: &'static str) -> Result<u32, SpecError> {
    let v = cfg
        .get(key)
        .or_else(|| cfg.get("text_config").and_then(|t| t.get(key)))
        .ok_or(SpecError::Missing(field))?;
    as_u32(v, field)
}

/// Defaults of transformers' `Gemma3ImageProcessor` and `Gemma3Config` / SigLIP's vision
/// config, used only where the files leave a key out.
mod gemma3_defaults {
    pub const IMAGE_MEAN: [f64; 3] = [0.5; 3];
    pub const IMAGE_STD: [f64; 3] = [0.5; 3];
    pub const RESAMPLE_BILINEAR: i64 = 2;
    pub const IMAGE_SIZE: u64 = 224;
    pub const PATCH_SIZE: u64 = 16;
    pub const MM_TOKENS_PER_IMAGE: u64 = 256;
    pub const BOI_TOKEN_INDEX: u64 = 255_999;
    pub const EOI_TOKEN_INDEX: u64 = 256_000;
    pub const IMAGE_TOKEN_INDEX: u64 = 262_144;
}

/// `do_pan_and_scan` and the `pan_and_scan_*` knobs (null or left out: the processor's
/// defaults, `Gemma3Processor.images_kwargs`).
fn gemma3_pan_and_scan(pp: &Object) -> Result<(PanAndScan, bool), SpecError> {
    let enabled = match pp.get("do_pan_and_scan") {
        None | Some(Value::Null) => false,
        Some(v) => v
            .as_bool()
            .ok_or_else(|| invalid("do_pan_and_scan", format!("expected a boolean, got {v}")))?,
    };
    let d = PanAndScan::DEFAULT;
    let count = |key: &'static str, default: u32| match pp.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => as_u32(v, key),
    };
    let ratio = match pp.get("pan_and_scan_min_ratio_to_activate") {
        None | Some(Value::Null) => d.min_ratio_to_activate,
        Some(v) => v.as_f64().ok_or_else(|| {
            invalid(
                "pan_and_scan_min_ratio_to_activate",
                format!("expected a number, got {v}"),
            )
        })?,
    };
    let knobs = PanAndScan::new(
        count("pan_and_scan_min_crop_size", d.min_crop_size)?,
        count("pan_and_scan_max_num_crops", d.max_num_crops)?,
        ratio,
    )?;
    Ok((knobs, enabled))
}

/// Gemma 3: every image resized to the tower's square input; the projector average-pools the
/// patch grid to `mm_tokens_per_image` tokens, so the pool's kernel is the merge size.
fn gemma3_spec(pp: &Object, cfg: &Object) -> Result<Spec, SpecError> {
    use gemma3_defaults as d;

    let (pan_and_scan, do_pan_and_scan) = gemma3_pan_and_scan(pp)?;
    let vision = cfg.get("vision_config");
    let vision_u64 = |key: &'static str, default: u64| {
        vision
            .and_then(|v| v.get(key))
            .map(|v| as_u64(v, key))
            .transpose()
            .map(|v| v.unwrap_or(default))
    };
    let tower_side = vision_u64("image_size", d::IMAGE_SIZE)?;
    let patch = vision_u64("patch_size", d::PATCH_SIZE)?;
    let size = pp.get("size");
    for edge in ["height", "width"] {
        if let Some(v) = size.and_then(|s| s.get(edge)) {
            let side = as_u64(v, "size")?;
            if side != tower_side {
                return Err(SpecError::Inconsistent {
                    field: "size",
                    preprocessor: side,
                    model: tower_side,
                });
            }
        }
    }
    let tokens = match cfg.get("mm_tokens_per_image").filter(|v| !v.is_null()) {
        Some(v) => as_u64(v, "mm_tokens_per_image")?,
        None => d::MM_TOKENS_PER_IMAGE,
    };
    // As `Gemma3MultiModalProjector`: a square token grid, a whole pool kernel.
    const MAX_TOKENS: u64 = 1 << 20;
    let tokens_per_side = (1..=MAX_TOKENS.min(tokens))
        .find(|s| s * s >= tokens)
        .unwrap_or(0);
    if patch == 0 || tokens == 0 || tokens_per_side * tokens_per_side != tokens {
        return Err(invalid(
            "mm_tokens_per_image",
            format!("{tokens} is not a square number of tokens"),
        ));
    }
    let patches_per_side = tower_side / patch;
    if !tower_side.is_multiple_of(patch) || !patches_per_side.is_multiple_of(tokens_per_side) {
        return Err(invalid(
            "vision_config.image_size",
            format!("{tower_side} / patch {patch} does not pool to {tokens_per_side} per side"),
        ));
    }
    let to_u32 = |v: u64, field: &'static str| {
        u32::try_from(v).map_err(|_| invalid(field, format!("{v} is too large")))
    };
    let side = to_u32(tower_side, "vision_config.image_size")?;
    let token_id = |key: &str, field: &'static str, default: u64| {
        if cfg.contains_key(key) {
            config_token(cfg, key, field)
        } else {
            to_u32(default, field)
        }
    };
    let normalize = normalize_params(pp, d::IMAGE_MEAN, d::IMAGE_STD)?;
    let spec = Spec {
        family: FamilyName::Gemma3,
        patch_size: to_u32(patch, "vision_config.patch_size")?,
        merge_size: to_u32(patches_per_side / tokens_per_side, "mm_tokens_per_image")?,
        temporal_patch_size: 1,
        min_pixels: tower_side * tower_side,
        max_pixels: tower_side * tower_side,
        image_mean: normalize.image_mean,
        image_std: normalize.image_std,
        rescale_factor: normalize.rescale_factor,
        resample: resample(pp, d::RESAMPLE_BILINEAR)?,
        backend: normalize.backend,
        image_token_id: token_id(
            "image_token_index",
            "image_token_index",
            d::IMAGE_TOKEN_INDEX,
        )?,
        vision_start_token_id: token_id("boi_token_index", "boi_token_index", d::BOI_TOKEN_INDEX)?,
        vision_end_token_id: token_id("eoi_token_index", "eoi_token_index", d::EOI_TOKEN_INDEX)?,
        image_size: Some([side, side]),
        video_token_id: None,
        tokens_per_second: None,
        pan_and_scan: Some(pan_and_scan),
        do_pan_and_scan,
        pixel_bounds: None,
    };
    spec.validate()?;
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN2_PREPROCESSOR: &str = r#"{
        "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14,
        "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor"}"#;
    const QWEN3_PREPROCESSOR: &str = r#"{
        "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
        "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "image_processor_type": "Qwen2VLImageProcessorPil"}"#;

    fn config(model_type: &str, patch: u32) -> String {
        format!(
            r#"{{"model_type": "{model_type}", "image_token_id": 151655,
                "vision_start_token_id": 151652, "vision_end_token_id": 151653,
                "vision_config": {{"patch_size": {patch}, "spatial_merge_size": 2}}}}"#
        )
    }

    #[test]
    fn qwen2_vl_spec_reads_flat_pixel_keys() {
        let spec = spec_from_hf_configs(QWEN2_PREPROCESSOR, &config("qwen2_vl", 14)).unwrap();
        assert_eq!(spec.family, FamilyName::Qwen2Vl);
        assert_eq!((spec.min_pixels, spec.max_pixels), (3136, 12845056));
        assert_eq!(spec.factor(), 28);
        assert_eq!(spec.backend, Backend::TorchU8);
        assert_eq!(spec.resample, Filter::Bicubic);
        assert_eq!(spec.image_token_id, 151655);
        assert_eq!(Spec::from_json(&spec.to_json()).unwrap(), spec);
    }

    #[test]
    fn qwen3_vl_spec_reads_size_dict() {
        let spec = spec_from_hf_configs(QWEN3_PREPROCESSOR, &config("qwen3_vl", 16)).unwrap();
        assert_eq!(spec.family, FamilyName::Qwen3Vl);
        assert_eq!((spec.min_pixels, spec.max_pixels), (65536, 16777216));
        assert_eq!(spec.image_mean, [0.5; 3]);
        assert_eq!(spec.factor(), 32);
        assert_eq!(spec.backend, Backend::Pil);
    }

    #[test]
    fn qwen3_vl_moe_spec_is_qwen3_vl_preprocessing() {
        let dense = spec_from_hf_configs(QWEN3_PREPROCESSOR, &config("qwen3_vl", 16)).unwrap();
        let moe = spec_from_hf_configs(QWEN3_PREPROCESSOR, &config("qwen3_vl_moe", 16)).unwrap();
        assert_eq!(moe.family, FamilyName::Qwen3VlMoe);
        assert_eq!(
            Spec {
                family: FamilyName::Qwen3Vl,
                ..moe.clone()
            },
            dense
        );
        assert_eq!(Spec::from_json(&moe.to_json()).unwrap(), moe);
        assert!(moe.to_json().contains("\"qwen3_vl_moe\""));
    }

    #[test]
    fn qwen3_5_specs_read_their_own_token_ids() {
        for (model_type, family) in [
            ("qwen3_5", FamilyName::Qwen35),
            ("qwen3_5_moe", FamilyName::Qwen35Moe),
        ] {
            let cfg = format!(
                r#"{{"model_type": "{model_type}", "image_token_id": 248056,
                    "video_token_id": 248057, "vision_start_token_id": 248053,
                    "vision_end_token_id": 248054,
                    "vision_config": {{"patch_size": 16, "spatial_merge_size": 2}}}}"#
            );
            let spec = spec_from_hf_configs(QWEN3_PREPROCESSOR, &cfg).unwrap();
            assert_eq!(spec.family, family);
            assert!(family.is_qwen3_vision());
            assert_eq!((spec.patch_size, spec.merge_size), (16, 2));
            assert_eq!(
                (
                    spec.image_token_id,
                    spec.video_token_id,
                    spec.vision_start_token_id,
                    spec.vision_end_token_id
                ),
                (248056, Some(248057), 248053, 248054)
            );
            assert_eq!(Spec::from_json(&spec.to_json()).unwrap(), spec);
            assert!(spec.to_json().contains(&format!("\"{model_type}\"")));
        }
    }

    const GEMMA3_PREPROCESSOR: &str = r#"{
        "image_processor_type": "Gemma3ImageProcessor", "do_pan_and_scan": null,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2,
        "rescale_factor": 0.00392156862745098, "size": {"height": 896, "width": 896}}"#;
    const GEMMA3_CONFIG: &str = r#"{"model_type": "gemma3", "mm_tokens_per_image": 256,
        "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
        "vision_config": {"image_size": 896, "patch_size": 14}}"#;

    #[test]
    fn gemma3_spec_is_a_fixed_size_pooled_grid() {
        let spec = spec_from_hf_configs(GEMMA3_PREPROCESSOR, GEMMA3_CONFIG).unwrap();
        assert_eq!(spec.family, FamilyName::Gemma3);
        assert_eq!(spec.image_size, Some([896, 896]));
        assert_eq!((spec.patch_size, spec.merge_size), (14, 4));
        assert_eq!((spec.min_pixels, spec.max_pixels), (896 * 896, 896 * 896));
        assert_eq!(spec.resample, Filter::Bilinear);
        assert_eq!(spec.backend, Backend::TorchU8);
        assert_eq!(
            (
                spec.image_token_id,
                spec.vision_start_token_id,
                spec.vision_end_token_id
            ),
            (262144, 255999, 256000)
        );
        assert_eq!(Spec::from_json(&spec.to_json()).unwrap(), spec);
        // Left out, the keys take the processor's and Gemma3Config's defaults.
        let config = r#"{"model_type": "gemma3", "vision_config": {"image_size": 896,
            "patch_size": 14}}"#;
        let bare = spec_from_hf_configs("{}", config).unwrap();
        assert_eq!(
            bare,
            Spec {
                backend: Backend::TorchU8,
                ..spec
            }
        );
        // SigLIP's own defaults (224 / 16) do not pool to 16 x 16 tokens.
        let err = spec_from_hf_configs("{}", r#"{"model_type": "gemma3"}"#).unwrap_err();
        assert_eq!(err.code(), "spec.invalid");
    }

    #[test]
    fn gemma3_spec_reads_pan_and_scan_and_its_knobs() {
        let spec = spec_from_hf_configs(GEMMA3_PREPROCESSOR, GEMMA3_CONFIG).unwrap();
        assert_eq!(
            (spec.pan_and_scan, spec.do_pan_and_scan),
            (Some(PanAndScan::DEFAULT), false)
        );
        let pp = r#"{"do_pan_and_scan": true, "pan_and_scan_min_crop_size": 32,
            "pan_and_scan_max_num_crops": 2, "pan_and_scan_min_ratio_to_activate": 1.5}"#;
        let spec = spec_from_hf_configs(pp, GEMMA3_CONFIG).unwrap();
        assert!(spec.do_pan_and_scan);
        assert_eq!(
            spec.pan_and_scan,
            Some(PanAndScan::new(32, 2, 1.5).unwrap())
        );
        assert_eq!(Spec::from_json(&spec.to_json()).unwrap(), spec);
        let knobless = Spec {
            pan_and_scan: None,
            ..spec
        };
        let err = Spec::from_json(&knobless.to_json()).unwrap_err();
        assert_eq!(err.code(), "spec.invalid");
    }

    #[test]
    fn gemma3_refusals_name_their_cause() {
        for (pp, field) in [
            (r#"{"do_pan_and_scan": "yes"}"#, "do_pan_and_scan"),
            (
                r#"{"pan_and_scan_max_num_crops": 0}"#,
                "pan_and_scan_max_num_crops",
            ),
            (
                r#"{"pan_and_scan_min_crop_size": -1}"#,
                "pan_and_scan_min_crop_size",
            ),
            (
                r#"{"pan_and_scan_min_ratio_to_activate": "1"}"#,
                "pan_and_scan_min_ratio",
            ),
        ] {
            let err = spec_from_hf_configs(pp, GEMMA3_CONFIG).unwrap_err();
            assert_eq!(err.code(), "spec.invalid");
            assert!(err.to_string().contains(field), "{err}");
        }
        let other_size = r#"{"size": {"height": 448, "width": 448}}"#;
        let err = spec_from_hf_configs(other_size, GEMMA3_CONFIG).unwrap_err();
        assert_eq!(err.code(), "spec.inconsistent");
        for tokens in ["0", "200", "18446744073709551615"] {
            let config = GEMMA3_CONFIG.replace("256,", &format!("{tokens},"));
            let err = spec_from_hf_configs("{}", &config).unwrap_err();
            assert_eq!(err.code(), "spec.invalid", "{tokens}");
        }
        let mut spec = spec_from_hf_configs("{}", GEMMA3_CONFIG).unwrap();
        spec.min_pixels = 1;
        assert_eq!(
            Spec::from_json(&spec.to_json()).unwrap_err().code(),
            "spec.invalid"
        );
    }

    #[test]
    fn flat_pixel_keys_override_the_size_dict() {
        let pp = r#"{"min_pixels": 1000, "size": {"shortest_edge": 5, "longest_edge": 9000}}"#;
        let spec = spec_from_hf_configs(pp, &config("qwen2_vl", 14)).unwrap();
        assert_eq!((spec.min_pixels, spec.max_pixels), (1000, 9000));
    }

    #[test]
    fn missing_preprocessor_keys_fall_back_to_the_vision_config() {
        let spec = spec_from_hf_configs("{}", &config("qwen3_vl", 16)).unwrap();
        assert_eq!(spec.patch_size, 16);
        assert_eq!(spec.min_pixels, 3136);
    }

    #[test]
    fn model_facts_prefer_text_config_and_generation_config() {
        let cfg = r#"{"model_type": "qwen2_vl", "image_token_id": 151655,
            "video_token_id": 151656, "vision_start_token_id": 151652,
            "vision_end_token_id": 151653, "eos_token_id": 1, "vocab_size": 10,
            "text_config": {"vocab_size": 151936, "hidden_size": 64, "num_hidden_layers": 2,
                            "eos_token_id": [151645], "max_position_embeddings": null}}"#;
        let facts = checkpoint_from_hf_configs("{}", cfg, None).unwrap().model;
        assert_eq!(facts.model_type, "qwen2_vl");
        assert_eq!(facts.video_token_id, Some(151656));
        assert_eq!(facts.eos_token_ids, vec![151645]);
        assert_eq!(facts.vocab_size, Some(151936));
        assert_eq!((facts.hidden_size, facts.num_layers), (Some(64), Some(2)));
        assert_eq!(facts.max_position_embeddings, None);
        assert_eq!(facts.config_digest.len(), 16);
        let generation = r#"{"eos_token_id": [151645, 151643]}"#;
        let with_generation = checkpoint_from_hf_configs("{}", cfg, Some(generation)).unwrap();
        assert_eq!(with_generation.model.eos_token_ids, vec![151645, 151643]);
        // An empty list in generation_config.json falls back to the text config.
        let empty = checkpoint_from_hf_configs("{}", cfg, Some(r#"{"eos_token_id": []}"#));
        assert_eq!(empty.unwrap().model.eos_token_ids, vec![151645]);
        // Key order does not change the digest; a changed value does.
        let reordered = r#"{"vocab_size": 10, "eos_token_id": 1, "model_type": "qwen2_vl",
            "image_token_id": 151655, "video_token_id": 151656,
            "vision_start_token_id": 151652, "vision_end_token_id": 151653,
            "text_config": {"num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 151936,
                            "eos_token_id": [151645], "max_position_embeddings": null}}"#;
        let again = checkpoint_from_hf_configs("{}", reordered, None)
            .unwrap()
            .model;
        assert_eq!(again.config_digest, facts.config_digest);
        let other = checkpoint_from_hf_configs(r#"{"min_pixels": 6272}"#, cfg, None).unwrap();
        assert_ne!(other.model.config_digest, facts.config_digest);
        let err = checkpoint_from_hf_configs("{}", cfg, Some("[]")).unwrap_err();
        assert_eq!(err.code(), "spec.json");
    }

    #[test]
    fn refusals_name_their_cause() {
        let err = spec_from_hf_configs("{}", &config("llava", 14)).unwrap_err();
        assert_eq!(err.code(), "spec.unknown_family");
        let err = spec_from_hf_configs(QWEN2_PREPROCESSOR, &config("qwen2_vl", 16)).unwrap_err();
        assert_eq!(err.code(), "spec.inconsistent");
        let err = spec_from_hf_configs(r#"{"resample": 0}"#, &config("qwen2_vl", 14)).unwrap_err();
        assert_eq!(err.code(), "spec.invalid");
        let err = spec_from_hf_configs("[]", "{}").unwrap_err();
        assert_eq!(err.code(), "spec.json");
        let err = spec_from_hf_configs("{}", r#"{"model_type": "qwen2_vl"}"#).unwrap_err();
        assert_eq!(err.code(), "spec.missing");
        let mut spec = spec_from_hf_configs("{}", &config("qwen2_vl", 14)).unwrap();
        spec.min_pixels = spec.max_pixels + 1;
        assert_eq!(
            Spec::from_json(&spec.to_json()).unwrap_err().code(),
            "spec.invalid"
        );
        assert_eq!(
            Spec::from_json("{\"family\": 1}").unwrap_err().code(),
            "spec.json"
        );
    }
}
