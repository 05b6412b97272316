//! The `mmserve._mm` extension module: the only place that knows about Python.
//! Owned inputs are taken under the GIL, then the GIL is released for the work.

use pyo3::prelude::*;

mod audio;
#[cfg(any(feature = "video", feature = "audio"))]
mod deadline;
mod driver;
mod error;
mod identity;
mod kv;
mod media;
mod positions;
mod resize;
mod spec;
mod video;

#[pymodule]
fn _mm(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    error::register(m)?;
    media::register(m)?;
    identity::register(m)?;
    resize::register(m)?;
    spec::register(m)?;
    driver::register(m)?;
    kv::register(m)?;
    video::register(m)?;
    positions::register(m)?;
    audio::register(m)?;
    Ok(())
}
