//! A checkpoint's Hugging Face config files, parsed once, and what every family reads from
//! them the same way: the pixel arithmetic of `preprocessor_config.json`, token ids, and the
//! language model's facts ([`ModelFacts`]). What a family reads its own way is in its module
//! (`qwen_vl/config.rs`, `gemma3/config.rs`).

use serde_json::Value;

use crate::family::spec::{invalid, Spec, SpecError};
use crate::image::resize::{Backend, Filter};

/// A config file's top-level object.
pub type Object = serde_json::Map<String, Value>;

/// A checkpoint's config files, each parsed to its top-level object.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigFiles {
    /// `preprocessor_config.json`: the image processor's settings.
    pub preprocessor: Object,
    /// `config.json`: the model's.
    pub config: Object,
    /// `generation_config.json`, where the checkpoint has one.
    pub generation: Option<Object>,
}

impl ConfigFiles {
    /// Parses the text of each file.
    pub fn parse(
        preprocessor_config: &str,
        config: &str,
        generation_config: Option<&str>,
    ) -> Result<Self, SpecError> {
        Ok(ConfigFiles {
            preprocessor: parse_object(preprocessor_config, "preprocessor_config.json")?,
            config: thinker(parse_object(config, "config.json")?),
            generation: generation_config
                .map(|text| parse_object(text, "generation_config.json"))
                .transpose()?,
        })
    }

    /// `config.json`'s `model_type`.
    pub fn model_type(&self) -> Result<&str, SpecError> {
        self.config
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or(SpecError::Missing("config.json model_type"))
    }

    /// Refuses a preprocessor that turns off a step the core always takes (`do_convert_rgb`
    /// too: decoding paints the transparent colour white as its `convert_to_rgb` does).
    pub fn check_steps(&self) -> Result<(), SpecError> {
        for flag in ["do_resize", "do_rescale", "do_normalize", "do_convert_rgb"] {
            if self.preprocessor.get(flag).and_then(Value::as_bool) == Some(false) {
                return Err(invalid(flag, "only true is supported"));
            }
        }
        Ok(())
    }

    /// A token id from `config.json` under `key` (top level, else `text_config`).
    pub fn token(&self, key: &str, field: &'static str) -> Result<u32, SpecError> {
        let v = self
            .config
            .get(key)
            .or_else(|| self.text_config().and_then(|t| t.get(key)))
            .ok_or(SpecError::Missing(field))?;
        as_u32(v, field)
    }

    /// `video_token_id`, at the top level or in `text_config`; `None` where neither names one.
    pub fn video_token(&self) -> Result<Option<u32>, SpecError> {
        self.config
            .get("video_token_id")
            .or_else(|| self.text_config().and_then(|t| t.get("video_token_id")))
            .filter(|v| !v.is_null())
            .map(|v| as_u32(v, "video_token_id"))
            .transpose()
    }

    /// `config.json`'s `vision_config`, where it has one.
    pub fn vision_config(&self) -> Option<&Value> {
        self.config.get("vision_config")
    }

    fn text_config(&self) -> Option<&Value> {
        self.config.get("text_config")
    }

    /// A text setting: `text_config`'s value, else the top level's (older checkpoints keep
    /// them there); `null` counts as absent.
    fn text_value(&self, key: &str) -> Option<&Value> {
        self.text_config()
            .and_then(|t| t.get(key))
            .filter(|v| !v.is_null())
            .or_else(|| self.config.get(key).filter(|v| !v.is_null()))
    }
}

/// A composite checkpoint (Qwen-Omni's: a thinker that reads and writes text beside a talker
/// that speaks) is served by its thinker: its config reads as `thinker_config`, under the
/// checkpoint's own `model_type`.
fn thinker(mut config: Object) -> Object {
    match config.remove("thinker_config") {
        Some(Value::Object(mut thinker)) => {
            if let Some(model_type) = config.remove("model_type") {
                thinker.insert("model_type".to_owned(), model_type);
            }
            thinker
        }
        Some(other) => {
            config.insert("thinker_config".to_owned(), other);
            config
        }
        None => config,
    }
}

pub(crate) fn parse_object(json: &str, what: &'static str) -> Result<Object, SpecError> {
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

/// One token id or a list of them.
fn as_ids(v: &Value, field: &'static str) -> Result<Vec<u32>, SpecError> {
    match v {
        Value::Array(list) => list.iter().map(|id| as_u32(id, field)).collect(),
        one => Ok(vec![as_u32(one, field)?]),
    }
}

/// The pixel arithmetic settings every family reads the same way.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Normalize {
    pub image_mean: [f64; 3],
    pub image_std: [f64; 3],
    pub rescale_factor: f64,
    /// `image_processor_type` ending in `Pil` means PIL's; other processors are
    /// transformers 5's torchvision ones.
    pub backend: Backend,
}

/// transformers' `rescale_factor` class default.
const RESCALE_FACTOR: f64 = 1.0 / 255.0;

impl Normalize {
    /// The preprocessor's settings, the processor's class defaults for mean and std where it
    /// leaves them out.
    pub fn read(
        pp: &Object,
        default_mean: [f64; 3],
        default_std: [f64; 3],
    ) -> Result<Self, SpecError> {
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
            None => RESCALE_FACTOR,
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
}

/// `resample` (a PIL filter code), or the processor's default.
pub fn resample(pp: &Object, default: i64) -> Result<Filter, SpecError> {
    let code = match pp.get("resample") {
        Some(v) => v
            .as_i64()
            .ok_or_else(|| invalid("resample", format!("expected an integer, got {v}")))?,
        None => default,
    };
    Filter::from_pil_code(code).map_err(|e| invalid("resample", e.to_string()))
}

/// The language-model facts a family's config files state in the family's own way (the
/// others are read the same for every family, [`ModelFacts`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FamilyFacts {
    /// Vision layers whose features are added to the first decoder layers (Qwen3-VL's
    /// deepstack); 0 for none.
    pub deepstack_layers: usize,
}

/// What a checkpoint's config files say beyond the preprocessing spec: the facts the
/// language-model side needs, and a digest of the files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelFacts {
    /// From `generation_config.json` where it names any, else from the text config.
    pub eos_token_ids: Vec<u32>,
    pub vocab_size: u64,
    pub hidden_size: u64,
    /// `num_hidden_layers`.
    pub num_layers: u64,
    /// The longest sequence the model was built for, where the config says.
    pub max_position_embeddings: Option<u64>,
    /// Indices of the language model's linear-attention layers (`layer_types`, Qwen3.5's
    /// Gated DeltaNet): each keeps a state of the whole prefix, not a per-token KV.
    pub linear_attention_layers: Vec<usize>,
    /// What the family reads its own way.
    pub family: FamilyFacts,
    /// 16 lowercase hex digits of blake3 over `config.json` and `preprocessor_config.json`
    /// (keys sorted, compact): two checkpoints with equal digests produce equal embeddings.
    pub config_digest: String,
}

impl ModelFacts {
    /// The facts of `files`; the counts a served model needs must be there.
    pub fn read(files: &ConfigFiles, family: FamilyFacts) -> Result<Self, SpecError> {
        let count = |key: &'static str| files.text_value(key).map(|v| as_u64(v, key)).transpose();
        let required = |key: &'static str| count(key)?.ok_or(SpecError::Missing(key));
        let ids = |v: Option<&Value>| {
            v.filter(|v| !v.is_null())
                .map(|v| as_ids(v, "eos_token_id"))
                .transpose()
                .map(Option::unwrap_or_default)
        };
        let from_generation = ids(files
            .generation
            .as_ref()
            .and_then(|g| g.get("eos_token_id")))?;
        let eos_token_ids = if from_generation.is_empty() {
            ids(files.text_value("eos_token_id"))?
        } else {
            from_generation
        };
        let linear_attention_layers = match files.text_value("layer_types") {
            Some(Value::Array(kinds)) => kinds
                .iter()
                .enumerate()
                .filter(|(_, kind)| kind.as_str() == Some("linear_attention"))
                .map(|(index, _)| index)
                .collect(),
            Some(other) => {
                return Err(invalid(
                    "layer_types",
                    format!("expected a list, got {other}"),
                ))
            }
            None => Vec::new(),
        };
        Ok(ModelFacts {
            eos_token_ids,
            vocab_size: required("vocab_size")?,
            hidden_size: required("hidden_size")?,
            num_layers: required("num_hidden_layers")?,
            max_position_embeddings: count("max_position_embeddings")?,
            linear_attention_layers,
            family,
            config_digest: digest(files),
        })
    }
}

fn digest(files: &ConfigFiles) -> String {
    let mut hasher = blake3::Hasher::new();
    hasher.update(Value::Object(files.config.clone()).to_string().as_bytes());
    hasher.update(b"\n");
    hasher.update(
        Value::Object(files.preprocessor.clone())
            .to_string()
            .as_bytes(),
    );
    hasher.finalize().to_hex()[..16].to_string()
}

/// A checkpoint as its config files describe it: the family's spec and the model's facts.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    pub spec: Spec,
    pub model: ModelFacts,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_facts(
        pp: &str,
        config: &str,
        generation: Option<&str>,
    ) -> Result<ModelFacts, SpecError> {
        ModelFacts::read(
            &ConfigFiles::parse(pp, config, generation)?,
            FamilyFacts::default(),
        )
    }

    #[test]
    fn model_facts_prefer_text_config_and_generation_config() {
        let cfg = r#"{"model_type": "qwen2_vl", "eos_token_id": 1, "vocab_size": 10,
            "text_config": {"vocab_size": 151936, "hidden_size": 64, "num_hidden_layers": 2,
                            "eos_token_id": [151645], "max_position_embeddings": null}}"#;
        let facts = read_facts("{}", cfg, None).unwrap();
        assert_eq!(facts.eos_token_ids, vec![151645]);
        assert_eq!(facts.vocab_size, 151936);
        assert_eq!((facts.hidden_size, facts.num_layers), (64, 2));
        assert_eq!(facts.max_position_embeddings, None);
        assert_eq!(facts.linear_attention_layers, Vec::<usize>::new());
        assert_eq!(facts.config_digest.len(), 16);
        let generation = r#"{"eos_token_id": [151645, 151643]}"#;
        let with_generation = read_facts("{}", cfg, Some(generation)).unwrap();
        assert_eq!(with_generation.eos_token_ids, vec![151645, 151643]);
        // An empty list in generation_config.json falls back to the text config.
        let empty = read_facts("{}", cfg, Some(r#"{"eos_token_id": []}"#));
        assert_eq!(empty.unwrap().eos_token_ids, vec![151645]);
        // Key order does not change the digest; a changed value does.
        let reordered = r#"{"vocab_size": 10, "eos_token_id": 1, "model_type": "qwen2_vl",
            "text_config": {"num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 151936,
                            "eos_token_id": [151645], "max_position_embeddings": null}}"#;
        let again = read_facts("{}", reordered, None).unwrap();
        assert_eq!(again.config_digest, facts.config_digest);
        let other = read_facts(r#"{"min_pixels": 6272}"#, cfg, None).unwrap();
        assert_ne!(other.config_digest, facts.config_digest);
    }

    #[test]
    fn linear_attention_layers_are_read_from_the_layer_types() {
        let cfg = r#"{"model_type": "qwen3_5", "text_config": {"vocab_size": 10,
            "hidden_size": 8, "num_hidden_layers": 4, "layer_types": ["linear_attention",
            "full_attention", "linear_attention", "sliding_attention"]}}"#;
        let facts = read_facts("{}", cfg, None).unwrap();
        assert_eq!(facts.linear_attention_layers, vec![0, 2]);
        let scalar = r#"{"model_type": "qwen3_5", "layer_types": "linear_attention",
            "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 4}"#;
        let err = read_facts("{}", scalar, None).unwrap_err();
        assert_eq!(err.code(), "spec.invalid");
    }
}
