//! Bindings of the pixel side: resize and normalise + patchify. The input array is
//! borrowed when it is C-contiguous (copied once otherwise); the work runs with the GIL
//! released; results move into numpy without a copy.

use numpy::ndarray::{Array2, Array3};
use numpy::{IntoPyArray, PyArray2, PyArray3, PyReadonlyArray3, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::error::to_py;
use crate::image::resize::{resize_view, Backend, Filter, ImageView, ResizeError};
use crate::image::transforms::{self, Convention, NormalizeLut, PatchGeometry};

/// Runs `f` on the pixels of an `[h, w, 3]` uint8 array, borrowing them when contiguous.
fn with_view<'py, R>(
    image: &PyReadonlyArray3<'py, u8>,
    f: impl FnOnce(ImageView<'_>) -> R,
) -> PyResult<R> {
    let shape = image.shape();
    if shape[2] != 3 {
        return Err(PyValueError::new_err(format!(
            "image must have shape [height, width, 3] (RGB), got {shape:?}"
        )));
    }
    let (height, width) = (dimension(shape[0])?, dimension(shape[1])?);
    let owned;
    let data = match image.as_slice() {
        Ok(data) => data,
        Err(_) => {
            owned = image.as_array().iter().copied().collect::<Vec<u8>>();
            &owned
        }
    };
    Ok(f(ImageView {
        width,
        height,
        data,
    }))
}

fn dimension(n: usize) -> PyResult<u32> {
    u32::try_from(n).map_err(|_| PyValueError::new_err(format!("image side {n} is too large")))
}

/// Resizes an RGB uint8 image ([h, w, 3]) to `width` x `height`, bit-exact with PIL's
/// `Image.resize` (`backend="pil"`) or torchvision's uint8 antialiased resize
/// (`backend="torch"`).
#[pyfunction]
#[pyo3(signature = (image, width, height, filter = "bicubic", backend = "pil"))]
fn resize<'py>(
    py: Python<'py>,
    image: PyReadonlyArray3<'py, u8>,
    width: u32,
    height: u32,
    filter: &str,
    backend: &str,
) -> PyResult<Bound<'py, PyArray3<u8>>> {
    let filter = Filter::from_name(filter).map_err(to_py)?;
    let backend = Backend::from_name(backend).map_err(to_py)?;
    let resized = with_view(&image, |view| {
        py.detach(|| resize_view(view, width, height, filter, backend))
    })?
    .map_err(to_py)?;
    let shape = (resized.height as usize, resized.width as usize, 3);
    let array = Array3::from_shape_vec(shape, resized.data)
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(array.into_pyarray(py))
}

/// Rescale + normalise + patchify an RGB uint8 image ([h, w, 3], sides multiples of
/// `patch_size * merge_size`) into HF's `pixel_values` rows: float32
/// `[grid_h * grid_w, 3 * temporal_patch_size * patch_size**2]`. `convention` is `"pil"`
/// (numpy float arithmetic) or `"torchvision"` (torch's fused float32 arithmetic).
#[pyfunction]
#[pyo3(signature = (image, mean, std, rescale, patch_size, merge_size, temporal_patch_size, convention))]
#[allow(clippy::too_many_arguments)]
fn normalize_patchify<'py>(
    py: Python<'py>,
    image: PyReadonlyArray3<'py, u8>,
    mean: [f64; 3],
    std: [f64; 3],
    rescale: f64,
    patch_size: u32,
    merge_size: u32,
    temporal_patch_size: u32,
    convention: &str,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let convention = Convention::from_name(convention).map_err(|e| to_py(ResizeError::from(e)))?;
    let lut = NormalizeLut::new(mean, std, rescale, convention)
        .map_err(|e| to_py(ResizeError::from(e)))?;
    let geometry = PatchGeometry {
        patch: patch_size,
        merge: merge_size,
        temporal: temporal_patch_size,
    };
    let (values, grid) = with_view(&image, |view| {
        py.detach(|| transforms::patchify_view(view, &lut, geometry))
    })?
    .map_err(|e| to_py(ResizeError::from(e)))?;
    let array = Array2::from_shape_vec((grid.rows, grid.cols), values)
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(array.into_pyarray(py))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(resize, m)?)?;
    m.add_function(wrap_pyfunction!(normalize_patchify, m)?)?;
    Ok(())
}
