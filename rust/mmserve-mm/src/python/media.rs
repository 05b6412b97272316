//! Bindings for the input side: fetch, decode. Arguments are borrowed or
//! copied into owned Rust values under the GIL; the work runs with the GIL released.

use std::path::PathBuf;
use std::time::Duration;

use numpy::ndarray::Array3;
use numpy::{IntoPyArray, PyArray3};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::error::to_py;
use crate::driver;
use crate::image::decode::{self, DecodeLimits};
use crate::pipeline::DecodedImage;
use crate::source::fetch::{self, FetchPolicy};

/// Decodes an encoded image (JPEG, PNG, WebP, GIF, BMP) to a uint8 array of shape [h, w, 3].
#[pyfunction]
#[pyo3(signature = (data, max_pixels = None))]
fn decode_image<'py>(
    py: Python<'py>,
    data: &[u8],
    max_pixels: Option<u64>,
) -> PyResult<Bound<'py, PyArray3<u8>>> {
    let limits = DecodeLimits {
        max_pixels: max_pixels.unwrap_or(DecodeLimits::default().max_pixels),
    };
    let image = py
        .detach(|| decode::decode_image(data, &limits))
        .map_err(to_py)?;
    rgb_array(py, image)
}

/// `(width, height)` of an encoded image as `decode_image` would return it, from its headers.
#[pyfunction]
#[pyo3(signature = (data, max_pixels = None))]
fn probe_image(py: Python<'_>, data: &[u8], max_pixels: Option<u64>) -> PyResult<(u32, u32)> {
    let limits = DecodeLimits {
        max_pixels: max_pixels.unwrap_or(DecodeLimits::default().max_pixels),
    };
    let info = py
        .detach(|| decode::probe_image(data, &limits))
        .map_err(to_py)?;
    Ok((info.width, info.height))
}

/// A decoded image as a numpy uint8 array [h, w, 3] that takes over its buffer (no copy).
pub(super) fn rgb_array(py: Python<'_>, image: DecodedImage) -> PyResult<Bound<'_, PyArray3<u8>>> {
    let shape = (image.height as usize, image.width as usize, 3);
    let array = Array3::from_shape_vec(shape, image.data)
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(array.into_pyarray(py))
}

/// The bytes of a media source: data: URL, http(s) URL, file:// URL, absolute path or base64.
#[pyfunction]
#[pyo3(signature = (
    source,
    *,
    allowed_local_roots = Vec::new(),
    allowed_domains = Vec::new(),
    timeout_s = None,
    max_bytes = None,
))]
fn fetch_bytes<'py>(
    py: Python<'py>,
    source: String,
    allowed_local_roots: Vec<PathBuf>,
    allowed_domains: Vec<String>,
    timeout_s: Option<f64>,
    max_bytes: Option<u64>,
) -> PyResult<Bound<'py, PyBytes>> {
    let defaults = FetchPolicy::default();
    let timeout = match timeout_s {
        Some(s) => Duration::try_from_secs_f64(s)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| PyValueError::new_err(format!("timeout_s must be positive, got {s}")))?,
        None => defaults.timeout,
    };
    let policy = FetchPolicy {
        allowed_local_roots,
        allowed_domains,
        timeout,
        max_bytes: max_bytes.unwrap_or(defaults.max_bytes),
        ..defaults
    };
    let bytes = py
        .detach(|| fetch::fetch_bytes(&source, &policy))
        .map_err(to_py)?;
    Ok(PyBytes::new(py, &bytes))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // The core's request limits, so Python's defaults read them instead of repeating them.
    m.add("MAX_ITEMS_PER_REQUEST", driver::MAX_ITEMS_PER_REQUEST)?;
    m.add("MAX_BYTES_PER_ITEM", fetch::MAX_BYTES_PER_SOURCE)?;
    m.add("MAX_BYTES_PER_REQUEST", driver::MAX_BYTES_PER_REQUEST)?;
    m.add_function(wrap_pyfunction!(decode_image, m)?)?;
    m.add_function(wrap_pyfunction!(probe_image, m)?)?;
    m.add_function(wrap_pyfunction!(fetch_bytes, m)?)?;
    Ok(())
}
