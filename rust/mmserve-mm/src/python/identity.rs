//! Bindings of the identities Python needs to name an item itself: an item's bytes, and a
//! precomputed embedding. Every other identity comes back final from the driver and the
//! preprocessing calls (`crate::identity`).

use numpy::{PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::identity;

/// blake3 of the raw bytes, first 8 digest bytes as a little-endian unsigned integer.
#[pyfunction]
fn content_hash(py: Python<'_>, data: &[u8]) -> u64 {
    py.detach(|| identity::content(data))
}

/// The identity of a precomputed image embedding: `data` its raw values (row-major bytes) of
/// element type `dtype` (`float32`, `float16` or `bfloat16`) and `shape`, for an image of
/// patch grid `grid_thw`.
#[pyfunction]
fn embeddings_identity(
    py: Python<'_>,
    dtype: &str,
    shape: Vec<usize>,
    grid_thw: (u32, u32, u32),
    data: PyReadonlyArray1<'_, u8>,
) -> PyResult<u64> {
    let bytes = data
        .as_slice()
        .map_err(|_| PyValueError::new_err("the embedding's bytes must be contiguous"))?;
    let size = element_size(dtype)
        .ok_or_else(|| PyValueError::new_err(format!("unknown embedding dtype {dtype:?}")))?;
    if bytes.len() != shape.iter().product::<usize>() * size {
        return Err(PyValueError::new_err(format!(
            "{} bytes are not a {dtype} tensor of shape {shape:?}",
            data.len()
        )));
    }
    let (t, h, w) = grid_thw;
    py.detach(|| identity::embeddings(dtype, &shape, [t, h, w], bytes))
        .ok_or_else(|| PyValueError::new_err(format!("unknown embedding dtype {dtype:?}")))
}

/// Bytes per element of an embedding dtype the identity takes.
fn element_size(dtype: &str) -> Option<usize> {
    match dtype {
        "float32" => Some(4),
        "float16" | "bfloat16" => Some(2),
        _ => None,
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(content_hash, m)?)?;
    m.add_function(wrap_pyfunction!(embeddings_identity, m)?)?;
    Ok(())
}
