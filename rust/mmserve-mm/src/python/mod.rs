//! The `mmserve._mm` extension module. The only place that knows about Python:
//! owned inputs are taken under the GIL, then the GIL is released for the work.

use pyo3::prelude::*;

#[pymodule]
fn _mm(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
