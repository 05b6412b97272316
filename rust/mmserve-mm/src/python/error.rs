//! The one conversion from the core's errors to Python exceptions.

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

create_exception!(
    mmserve._mm,
    MediaError,
    PyValueError,
    "A media item was refused or could not be processed: `args = (code, message, item_index)`, \
     where `code` is stable, `message` says what to change and `item_index` is the request item \
     at fault, or None."
);

/// Turns a core error into `MediaError(code, message, item_index)`.
pub fn to_py(err: impl Into<crate::Error>) -> PyErr {
    let err: crate::Error = err.into();
    MediaError::new_err((err.code(), err.to_string(), err.item_index()))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("MediaError", m.py().get_type::<MediaError>())
}
