//! Bindings of the family spec and of a checkpoint: its config files parsed once, here, into
//! the preprocessing spec the driver takes (`Spec`) and the facts the workers need
//! (`Checkpoint`), which Python reads through (`models/family.py`).

use std::sync::Arc;

use pyo3::prelude::*;

use super::audio::PyAudioFeatureExtractor;
use super::error::to_py;
use crate::common::hash::content_hash;
use crate::family::config::ModelFacts;
use crate::family::registry::{checkpoint_from_hf_configs, family_from_spec, spec_from_hf_configs};
use crate::family::spec::{Spec, SpecError};
use crate::image::pan_and_scan::PanAndScan;
use crate::pipeline::{Family, RopeKind, TokenId, VisionInput};

/// A resolved, validated family spec (immutable) and the family it builds.
#[pyclass(name = "Spec", module = "mmserve._mm", frozen)]
pub struct PySpec {
    pub(super) spec: Spec,
    pub(super) family: Arc<dyn Family>,
}

impl std::fmt::Debug for PySpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PySpec")
            .field("spec", &self.spec)
            .finish_non_exhaustive()
    }
}

impl PySpec {
    fn new(spec: Spec) -> PyResult<Self> {
        let family = family_from_spec(&spec).map_err(to_py)?;
        Ok(Self { spec, family })
    }

    /// `slf` where `spec` is its own, else the spec `spec` describes.
    fn derived(slf: &Bound<'_, Self>, spec: Result<Spec, SpecError>) -> PyResult<Py<Self>> {
        let spec = spec.map_err(to_py)?;
        if spec == slf.get().spec {
            return Ok(slf.clone().unbind());
        }
        Py::new(slf.py(), Self::new(spec)?)
    }
}

#[pymethods]
impl PySpec {
    #[staticmethod]
    fn from_json(json: &str) -> PyResult<Self> {
        Self::new(Spec::from_json(json).map_err(to_py)?)
    }

    #[staticmethod]
    fn from_hf_configs(preprocessor_config: &str, config: &str) -> PyResult<Self> {
        Self::new(spec_from_hf_configs(preprocessor_config, config).map_err(to_py)?)
    }

    fn to_json(&self) -> String {
        self.spec.to_json()
    }

    /// This spec resizing images within a request's `(min_pixels, max_pixels)` (None, or the
    /// model's own bounds: as the model does); the images' identities fold the bounds.
    #[pyo3(signature = (bounds))]
    fn with_pixel_bounds(slf: &Bound<'_, Self>, bounds: Option<(u64, u64)>) -> PyResult<Py<Self>> {
        let spec = slf
            .get()
            .spec
            .with_pixel_bounds(bounds.map(|(low, high)| [low, high]));
        Self::derived(slf, spec)
    }

    /// This spec cutting elongated images into pan-and-scan crops by `knobs`,
    /// `(min_crop_size, max_num_crops, min_ratio_to_activate)` (None: not cutting them), for a
    /// family that can pan and scan; each crop's identity folds the knobs.
    #[pyo3(signature = (knobs))]
    fn with_pan_and_scan(
        slf: &Bound<'_, Self>,
        knobs: Option<(u32, u32, f64)>,
    ) -> PyResult<Py<Self>> {
        let knobs = knobs
            .map(|(size, crops, ratio)| PanAndScan::new(size, crops, ratio))
            .transpose()
            .map_err(to_py)?;
        let spec = slf.get().spec.with_pan_and_scan(knobs);
        Self::derived(slf, spec)
    }

    /// The `(min_pixels, max_pixels)` a request set, which images are resized within (None:
    /// the model's own).
    #[getter]
    fn pixel_bounds(&self) -> Option<(u64, u64)> {
        self.spec.pixel_bounds.map(|[low, high]| (low, high))
    }

    /// The family name, which is also its `model_type`.
    #[getter]
    fn family(&self) -> &'static str {
        self.spec.family.model_type()
    }

    /// Whether the request driver plans this family's videos.
    #[getter]
    fn takes_video(&self) -> bool {
        self.family.capabilities().video
    }

    /// The feature extractor of a family that takes audio (its clips' rate, chunk and mel
    /// bins, padded and cut as its processor asks); `None` for one that takes none.
    #[getter]
    fn audio_extractor(&self) -> PyResult<Option<PyAudioFeatureExtractor>> {
        self.family
            .capabilities()
            .audio
            .map(PyAudioFeatureExtractor::of)
            .transpose()
    }

    /// The tokens a clip of `frames` valid feature frames expands to (0 for a family that
    /// takes no audio): the plan's count, for an engine that stands in for the tower.
    fn audio_tokens(&self, frames: u32) -> usize {
        self.family
            .num_tokens(&crate::pipeline::Geometry::Audio { frames })
    }

    /// The audio placeholder the chat template writes once per clip (`<|AUDIO|>`); `None`
    /// for a family that takes no audio.
    #[getter]
    fn audio_token_id(&self) -> Option<TokenId> {
        self.spec.audio.map(|audio| audio.audio_token_id)
    }

    /// Whether the family serves a video's own audio track interleaved with its frames
    /// (`use_audio_in_video`: Qwen2.5-Omni).
    #[getter]
    fn audio_in_video(&self) -> bool {
        self.spec
            .audio
            .is_some_and(|audio| audio.in_video.is_some())
    }

    /// Whether the request driver plans a video one item per temporal group, each after its
    /// timestamp text (Qwen3-VL; `process` then needs the tokenizer's `timestamp_tokens`).
    #[getter]
    fn video_per_group(&self) -> bool {
        self.family.capabilities().video_timestamps
    }

    /// What the vision tower takes per item: `"patches"` (rows of flattened patches and the
    /// grid, Qwen-VL) or `"image"` (one `[3, height, width]` image of its fixed size, SigLIP).
    #[getter]
    fn vision_input(&self) -> &'static str {
        match self.family.capabilities().vision_input {
            VisionInput::Patches => "patches",
            VisionInput::Image => "image",
        }
    }

    /// The positions the plan gives the language model: `"mrope"` (M-RoPE rows) or `"1d"`.
    #[getter]
    fn rope(&self) -> &'static str {
        match self.family.capabilities().rope {
            RopeKind::MRope => "mrope",
            RopeKind::Rope1D => "1d",
        }
    }

    /// `(min_crop_size, max_num_crops, min_ratio_to_activate)`: the pan-and-scan knobs of a
    /// family that can pan and scan (Gemma 3), whether or not `do_pan_and_scan` is set.
    #[getter]
    fn pan_and_scan(&self) -> Option<(u32, u32, f64)> {
        self.spec
            .pan_and_scan
            .map(|k| (k.min_crop_size, k.max_num_crops, k.min_ratio_to_activate))
    }

    #[getter]
    fn do_pan_and_scan(&self) -> bool {
        self.spec.do_pan_and_scan
    }

    /// The texts the driver writes into this family's prompts (between an image and its
    /// crops), for which `process` takes the tokenizer's ids as `text_pieces`.
    #[getter]
    fn text_pieces(&self) -> Vec<&'static str> {
        self.family.capabilities().texts.to_vec()
    }

    /// The text the caller writes on both sides of each image placeholder before tokenizing
    /// (Gemma 3's "\n\n"; "" where none).
    #[getter]
    fn image_text_padding(&self) -> &'static str {
        self.family.capabilities().image_padding
    }

    /// The text the caller writes before that padding for an image with pan-and-scan crops,
    /// in the prompt it gives as `panned_input_ids` (Gemma 3's "Here is the original image ").
    #[getter]
    fn panned_image_text(&self) -> &'static str {
        self.family.capabilities().announcing_text
    }

    #[getter]
    fn patch_size(&self) -> u32 {
        self.spec.patch_size
    }

    #[getter]
    fn merge_size(&self) -> u32 {
        self.spec.merge_size
    }

    #[getter]
    fn temporal_patch_size(&self) -> u32 {
        self.spec.temporal_patch_size
    }

    #[getter]
    fn min_pixels(&self) -> u64 {
        self.spec.min_pixels
    }

    #[getter]
    fn max_pixels(&self) -> u64 {
        self.spec.max_pixels
    }

    #[getter]
    fn image_mean(&self) -> (f64, f64, f64) {
        let [r, g, b] = self.spec.image_mean;
        (r, g, b)
    }

    #[getter]
    fn image_std(&self) -> (f64, f64, f64) {
        let [r, g, b] = self.spec.image_std;
        (r, g, b)
    }

    #[getter]
    fn image_token_id(&self) -> TokenId {
        self.spec.image_token_id
    }

    #[getter]
    fn vision_start_token_id(&self) -> TokenId {
        self.spec.vision_start_token_id
    }

    #[getter]
    fn vision_end_token_id(&self) -> TokenId {
        self.spec.vision_end_token_id
    }

    /// The placeholder a video's tokens expand from (None: the spec plans images only).
    #[getter]
    fn video_token_id(&self) -> Option<TokenId> {
        self.spec.video_token_id
    }

    /// `(grid_thw, num_tokens)` for an image of this size, without any pixels.
    fn plan(&self, width: u32, height: u32) -> PyResult<((u32, u32, u32), usize)> {
        let geometry = self.family.plan(width, height).map_err(to_py)?;
        let [t, h, w] = geometry.grid_thw();
        Ok(((t, h, w), self.family.num_tokens(&geometry)))
    }

    fn __eq__(&self, other: &Self) -> bool {
        self.spec == other.spec
    }

    fn __hash__(&self) -> u64 {
        content_hash(self.spec.to_json().as_bytes())
    }

    fn __repr__(&self) -> String {
        format!("Spec({})", self.spec.to_json())
    }
}

/// A checkpoint as its config files describe it: the family's spec and the language model's
/// facts (immutable).
#[pyclass(name = "Checkpoint", module = "mmserve._mm", frozen)]
#[derive(Debug)]
pub struct PyCheckpoint {
    spec: Py<PySpec>,
    model: ModelFacts,
}

#[pymethods]
impl PyCheckpoint {
    /// The checkpoint whose `preprocessor_config.json`, `config.json` and, where it has one,
    /// `generation_config.json` have this text.
    #[staticmethod]
    #[pyo3(signature = (preprocessor_config, config, generation_config = None))]
    fn from_hf_configs(
        py: Python<'_>,
        preprocessor_config: &str,
        config: &str,
        generation_config: Option<&str>,
    ) -> PyResult<Self> {
        let checkpoint = checkpoint_from_hf_configs(preprocessor_config, config, generation_config)
            .map_err(to_py)?;
        Ok(Self {
            spec: Py::new(py, PySpec::new(checkpoint.spec)?)?,
            model: checkpoint.model,
        })
    }

    /// The preprocessing spec, which the driver and the preprocessing calls take.
    #[getter]
    fn spec(&self, py: Python<'_>) -> Py<PySpec> {
        self.spec.clone_ref(py)
    }

    #[getter]
    fn eos_token_ids(&self) -> Vec<u32> {
        self.model.eos_token_ids.clone()
    }

    #[getter]
    fn vocab_size(&self) -> u64 {
        self.model.vocab_size
    }

    #[getter]
    fn hidden_size(&self) -> u64 {
        self.model.hidden_size
    }

    #[getter]
    fn num_layers(&self) -> u64 {
        self.model.num_layers
    }

    #[getter]
    fn max_position_embeddings(&self) -> Option<u64> {
        self.model.max_position_embeddings
    }

    #[getter]
    fn linear_attention_layers(&self) -> Vec<usize> {
        self.model.linear_attention_layers.clone()
    }

    #[getter]
    fn deepstack_layers(&self) -> usize {
        self.model.family.deepstack_layers
    }

    /// Digest of the config files: two checkpoints with equal ids produce equal embeddings.
    #[getter]
    fn spec_id(&self) -> &str {
        &self.model.config_digest
    }

    fn __eq__(&self, other: &Self) -> bool {
        self.spec.get().spec == other.spec.get().spec && self.model == other.model
    }

    fn __hash__(&self) -> u64 {
        content_hash(self.model.config_digest.as_bytes()) ^ self.spec.get().__hash__()
    }

    fn __repr__(&self) -> String {
        format!(
            "Checkpoint({}, {:?})",
            self.spec.get().__repr__(),
            self.model
        )
    }
}

/// The spec of a checkpoint from its `preprocessor_config.json` and `config.json` text.
#[pyfunction]
#[pyo3(name = "spec_from_hf_configs")]
fn spec_from_hf_configs_py(preprocessor_config: &str, config: &str) -> PyResult<PySpec> {
    PySpec::from_hf_configs(preprocessor_config, config)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySpec>()?;
    m.add_class::<PyCheckpoint>()?;
    m.add_function(wrap_pyfunction!(spec_from_hf_configs_py, m)?)?;
    Ok(())
}
