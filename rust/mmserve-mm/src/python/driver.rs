//! Bindings of the request driver and of one image's preprocessing, for every model family
//! (the spec is in `spec.rs`).
//! Arguments are turned into owned (or immutable, reference-counted) Rust values under the
//! GIL; all work runs with the GIL released; arrays are handed to numpy without a copy.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use numpy::ndarray::{ArrayD, IxDyn};
use numpy::{PyArray1, PyArrayDyn, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::pybacked::{PyBackedBytes, PyBackedStr};
use pyo3::types::PyByteArray;

use super::error::to_py;
use super::spec::PySpec;
use super::video::PyVideoOptions;
use crate::audio::AudioFormat;
use crate::common::par;
use crate::common::text_pieces::TextPieces;
use crate::driver::{self, DriverOptions, MediaInput, MediaItem, Modality, Mode};
use crate::identity;
use crate::pipeline::{Family, Positions, ProcessError, Tensor, TensorData, TokenId};

fn tensor_to_numpy(py: Python<'_>, tensor: Tensor) -> PyResult<Py<PyAny>> {
    let (shape, data) = tensor.into_parts();
    let elements = data.len();
    // `Tensor::new` checked the element count; this only guards the conversion.
    let bad_shape = |_| {
        to_py(ProcessError::TensorShape {
            shape: shape.clone(),
            elements,
        })
    };
    let dims = IxDyn(&shape);
    Ok(match data {
        TensorData::F32(v) => {
            let a = ArrayD::from_shape_vec(dims.clone(), v).map_err(bad_shape)?;
            PyArrayDyn::from_owned_array(py, a).into_any().unbind()
        }
        TensorData::I64(v) => {
            let a = ArrayD::from_shape_vec(dims.clone(), v).map_err(bad_shape)?;
            PyArrayDyn::from_owned_array(py, a).into_any().unbind()
        }
        // numpy has no bfloat16: the raw bits, as uint16.
        TensorData::Bf16(v) => {
            let a = ArrayD::from_shape_vec(dims.clone(), v).map_err(bad_shape)?;
            PyArrayDyn::from_owned_array(py, a).into_any().unbind()
        }
    })
}

fn grid_array(py: Python<'_>, grid: [u32; 3]) -> PyResult<Py<PyAny>> {
    let row: Vec<i64> = grid.iter().map(|&v| i64::from(v)).collect();
    Ok(PyArray1::from_vec(py, row)
        .reshape([1, 3])?
        .into_any()
        .unbind())
}

type Preprocessed = (Py<PyAny>, Py<PyAny>, u64);

fn preprocess_one(
    family: &dyn Family,
    bytes: &[u8],
) -> Result<(Tensor, [u32; 3], u64), crate::Error> {
    let identity = identity::image(identity::content(bytes), None, family.spec().pixel_bounds);
    let image = crate::image::decode::decode_image(bytes, &Default::default())?;
    let item = family.process_item(&image)?;
    Ok((item.feature, item.geometry.grid_thw(), identity))
}

fn to_preprocessed(
    py: Python<'_>,
    (feature, grid, hash): (Tensor, [u32; 3], u64),
) -> PyResult<Preprocessed> {
    Ok((tensor_to_numpy(py, feature)?, grid_array(py, grid)?, hash))
}

/// One encoded image to `(pixel_values, image_grid_thw, identity)` (its content hash, folded
/// with the spec's pixel bounds where a request set them).
#[pyfunction]
fn preprocess(py: Python<'_>, spec: &PySpec, data: PyBackedBytes) -> PyResult<Preprocessed> {
    let family = Arc::clone(&spec.family);
    let out = py
        .detach(move || preprocess_one(family.as_ref(), &data))
        .map_err(to_py)?;
    to_preprocessed(py, out)
}

/// Several encoded images, each as [`preprocess`], fanned out over the pool; fails on the
/// first bad item (by index).
#[pyfunction]
fn preprocess_batch(
    py: Python<'_>,
    spec: &PySpec,
    data: Vec<PyBackedBytes>,
) -> PyResult<Vec<Preprocessed>> {
    let family = Arc::clone(&spec.family);
    let out = py
        .detach(move || par::try_map(&data, |bytes| preprocess_one(family.as_ref(), bytes)))
        .map_err(|(index, e)| to_py(e.at_item(index)))?;
    out.into_iter().map(|o| to_preprocessed(py, o)).collect()
}

/// One encoded image, then each of its pan-and-scan crops where the spec pans and scans, to
/// `(pixel_values, image_grid_thw, identity)` (a crop's identity is its own, folded from the
/// image's).
#[pyfunction]
fn preprocess_with_crops(
    py: Python<'_>,
    spec: &PySpec,
    data: PyBackedBytes,
) -> PyResult<Vec<Preprocessed>> {
    let family = Arc::clone(&spec.family);
    let items = py
        .detach(move || {
            driver::image_and_crops(family.as_ref(), &data, 0, &Default::default(), Mode::Full)
        })
        .map_err(to_py)?;
    items
        .into_iter()
        .map(|item| {
            let feature = item
                .processed
                .map(|p| tensor_to_numpy(py, p.feature))
                .transpose()?
                .ok_or_else(|| to_py(ProcessError::PanAndScan("an item came without pixels")))?;
            Ok((
                feature,
                grid_array(py, item.geometry.grid_thw())?,
                item.hash,
            ))
        })
        .collect()
}

/// One media item of a [`PyProcessResult`].
#[pyclass(name = "ProcessedMedia", module = "mmserve._mm", frozen, get_all)]
pub struct PyProcessedMedia {
    hash: u64,
    width: u32,
    height: u32,
    image_grid_thw: Py<PyAny>,
    num_tokens: usize,
    pixel_values: Option<Py<PyAny>>,
    data: Option<Py<PyByteArray>>,
    source: usize,
    temporal_group: Option<u32>,
    crop: Option<u32>,
}

/// The driver's output for one request.
#[pyclass(name = "ProcessResult", module = "mmserve._mm", frozen, get_all)]
pub struct PyProcessResult {
    input_ids: Py<PyAny>,
    offsets: Vec<(usize, usize)>,
    items: Vec<Py<PyProcessedMedia>>,
    positions: Option<Py<PyAny>>,
    rope_delta: i64,
}

#[derive(FromPyObject)]
enum ImageArg {
    Bytes(PyBackedBytes),
    Source(PyBackedStr),
    /// `(hash, (t, h, w))`: an item whose features the caller holds.
    Planned((u64, (u32, u32, u32))),
}

impl ImageArg {
    fn as_input(&self) -> MediaInput<'_> {
        match self {
            ImageArg::Bytes(b) => MediaInput::Bytes(b),
            ImageArg::Source(s) => MediaInput::Source(s),
            ImageArg::Planned((hash, (t, h, w))) => MediaInput::Planned {
                hash: *hash,
                grid_thw: [*t, *h, *w],
            },
        }
    }
}

/// Each item's modality from its name ("image", "video" or "audio"); all images when none are
/// given.
fn modalities(names: Option<Vec<PyBackedStr>>, items: usize) -> PyResult<Vec<Modality>> {
    let Some(names) = names else {
        return Ok(vec![Modality::Image; items]);
    };
    if names.len() != items {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "{} modalities for {items} items",
            names.len()
        )));
    }
    names
        .iter()
        .map(|name| match &**name {
            "image" => Ok(Modality::Image),
            "video" => Ok(Modality::Video),
            "audio" => Ok(Modality::Audio),
            other => Err(pyo3::exceptions::PyValueError::new_err(format!(
                "unknown modality {other:?} (known: image, video, audio)"
            ))),
        })
        .collect()
}

/// Each item's declared audio format (`input_audio.format`), parsed; none when none are given.
fn audio_formats(
    names: Option<Vec<Option<PyBackedStr>>>,
    items: usize,
) -> Result<Vec<Option<AudioFormat>>, crate::Error> {
    let Some(names) = names else {
        return Ok(vec![None; items]);
    };
    names
        .iter()
        .enumerate()
        .map(|(index, name)| {
            name.as_deref()
                .map(AudioFormat::from_name)
                .transpose()
                .map_err(|e| crate::Error::from(e).at_item(index))
        })
        .collect()
}

fn with_modalities<'a>(
    inputs: Vec<MediaInput<'a>>,
    kinds: &[Modality],
    formats: &[Option<AudioFormat>],
) -> Vec<MediaItem<'a>> {
    inputs
        .into_iter()
        .zip(kinds)
        .zip(formats.iter().chain(std::iter::repeat(&None)))
        .map(|((input, &modality), &format)| MediaItem {
            modality,
            input,
            format,
        })
        .collect()
}

/// The whole request driver: fetch, hash, decode, preprocess, expand and position.
#[pyfunction]
#[pyo3(signature = (spec, input_ids, images, *, allowed_local_roots = Vec::new(),
                    allowed_domains = Vec::new(), timeout_s = None, count_only = false,
                    keep_bytes = false, modalities = None, video = None,
                    text_pieces = None, panned_input_ids = None, audio_formats = None,
                    max_audio_duration_s = None))]
#[allow(clippy::too_many_arguments)]
fn process(
    py: Python<'_>,
    spec: &PySpec,
    input_ids: Vec<TokenId>,
    images: Vec<ImageArg>,
    allowed_local_roots: Vec<PathBuf>,
    allowed_domains: Vec<String>,
    timeout_s: Option<f64>,
    count_only: bool,
    keep_bytes: bool,
    modalities: Option<Vec<PyBackedStr>>,
    video: Option<PyRef<'_, PyVideoOptions>>,
    text_pieces: Option<HashMap<String, Vec<TokenId>>>,
    panned_input_ids: Option<Vec<TokenId>>,
    audio_formats: Option<Vec<Option<PyBackedStr>>>,
    max_audio_duration_s: Option<f64>,
) -> PyResult<PyProcessResult> {
    let mut options = DriverOptions::default();
    options.fetch.allowed_local_roots = allowed_local_roots;
    options.fetch.allowed_domains = allowed_domains;
    if let Some(t) = timeout_s {
        options.fetch.timeout = Duration::try_from_secs_f64(t).map_err(|_| {
            pyo3::exceptions::PyValueError::new_err(format!("timeout_s must be >= 0, got {t}"))
        })?;
        options.video_timeout = Some(options.fetch.timeout);
    }
    options.text_pieces = text_pieces.map(|pieces| TextPieces::new(pieces.into_iter().collect()));
    options.panned_input_ids = panned_input_ids;
    let kinds = self::modalities(modalities, images.len())?;
    let formats = self::audio_formats(audio_formats, images.len()).map_err(to_py)?;
    #[cfg(feature = "audio")]
    if let Some(seconds) = max_audio_duration_s {
        options.audio.max_duration_s = seconds;
    }
    #[cfg(not(feature = "audio"))]
    let _ = max_audio_duration_s;
    #[cfg(feature = "video")]
    {
        options.video = video.map(|v| v.video_options(None)).transpose()?;
    }
    #[cfg(not(feature = "video"))]
    drop(video);
    let mode = if count_only {
        Mode::CountOnly
    } else {
        Mode::Full
    };
    let family = Arc::clone(&spec.family);
    let (out, fetched) = py
        .detach(move || {
            let media: Vec<MediaInput<'_>> = images.iter().map(ImageArg::as_input).collect();
            if !keep_bytes {
                return driver::run(
                    family.as_ref(),
                    &input_ids,
                    &with_modalities(media, &kinds, &formats),
                    &options,
                    mode,
                )
                .map(|out| (out, Vec::new()));
            }
            // The caller ships each item's encoded bytes on, so it keeps what was fetched.
            let fetched: Vec<driver::Fetched<'static>> = driver::fetch_all(&media, &options.fetch)?
                .into_iter()
                .map(|item| match item {
                    driver::Fetched::Bytes(bytes) => {
                        driver::Fetched::Bytes(Cow::Owned(bytes.into_owned()))
                    }
                    driver::Fetched::Planned { hash, grid_thw } => {
                        driver::Fetched::Planned { hash, grid_thw }
                    }
                })
                .collect();
            let inputs: Vec<MediaInput<'_>> =
                fetched.iter().map(driver::Fetched::as_input).collect();
            driver::run(
                family.as_ref(),
                &input_ids,
                &with_modalities(inputs, &kinds, &formats),
                &options,
                mode,
            )
            .map(|out| (out, fetched))
        })
        .map_err(to_py)?;
    // Each fetched item's bytes go with the first planned item it became.
    let mut fetched: Vec<Option<driver::Fetched<'static>>> =
        fetched.into_iter().map(Some).collect();

    let ids: Vec<i64> = out.input_ids.iter().map(|&t| i64::from(t)).collect();
    let len = ids.len();
    let (positions, rope_delta) = match out.positions {
        Positions::MRope { positions, delta } => {
            let rows = PyArray1::from_vec(py, positions).reshape([3, len])?;
            (Some(rows.into_any().unbind()), delta)
        }
        Positions::Rope1D { .. } => (None, 0),
    };
    let items = out
        .items
        .into_iter()
        .map(|item| {
            let pixel_values = item
                .processed
                .map(|p| tensor_to_numpy(py, p.feature))
                .transpose()?;
            Py::new(
                py,
                PyProcessedMedia {
                    hash: item.hash,
                    width: item.width,
                    height: item.height,
                    image_grid_thw: grid_array(py, item.geometry.grid_thw())?,
                    num_tokens: item.num_tokens,
                    pixel_values,
                    data: fetched
                        .get_mut(item.source)
                        .and_then(Option::take)
                        .and_then(|item| item.bytes().map(|b| PyByteArray::new(py, b).unbind())),
                    source: item.source,
                    temporal_group: item.temporal_group,
                    crop: item.crop,
                },
            )
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok(PyProcessResult {
        input_ids: PyArray1::from_vec(py, ids).into_any().unbind(),
        offsets: out.offsets,
        items,
        positions,
        rope_delta,
    })
}

/// Pool size the extension fans out to.
#[pyfunction]
fn num_threads() -> usize {
    par::num_threads()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyProcessedMedia>()?;
    m.add_class::<PyProcessResult>()?;
    m.add_function(wrap_pyfunction!(preprocess, m)?)?;
    m.add_function(wrap_pyfunction!(preprocess_batch, m)?)?;
    // The 0.1 names, from when only Qwen-VL was served; kept for one release.
    m.add("qwen_vl_preprocess", m.getattr("preprocess")?)?;
    m.add("qwen_vl_preprocess_batch", m.getattr("preprocess_batch")?)?;
    m.add_function(wrap_pyfunction!(preprocess_with_crops, m)?)?;
    m.add_function(wrap_pyfunction!(process, m)?)?;
    m.add_function(wrap_pyfunction!(num_threads, m)?)?;
    Ok(())
}
