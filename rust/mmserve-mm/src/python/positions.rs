//! Bindings of a prompt's positions: M-RoPE over its images and videos. The work runs with the
//! GIL released.

use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray2};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::error::to_py;
use crate::family::qwen_vl::{mrope_blocks, VisionBlock};
use crate::pipeline::Positions;

/// `(start, end, (t, h, w), time_interval)` of one vision item.
type Block = (usize, usize, (u32, u32, u32), f64);

/// `(positions [3, length] int64, delta)`: M-RoPE for a prompt whose vision items (images and
/// videos, in prompt order) are `(start, end, (t, h, w), time_interval)`.
#[pyfunction]
fn mrope_positions<'py>(
    py: Python<'py>,
    length: usize,
    blocks: Vec<Block>,
    merge_size: u32,
) -> PyResult<(Bound<'py, PyArray2<i64>>, i64)> {
    let blocks: Vec<VisionBlock> = blocks
        .into_iter()
        .map(|(start, end, (t, h, w), time_interval)| VisionBlock {
            start,
            end,
            grid_thw: [t, h, w],
            time_interval,
        })
        .collect();
    let positions = py
        .detach(|| mrope_blocks(length, &blocks, merge_size))
        .map_err(to_py)?;
    let Positions::MRope { positions, delta } = positions else {
        return Err(PyValueError::new_err("M-RoPE gave 1-D positions"));
    };
    let array = Array2::from_shape_vec((3, length), positions)
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok((array.into_pyarray(py), delta))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(mrope_positions, m)?)
}
