//! The one conversion from the core's errors to Python exceptions.

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

create_exception!(
    _mm,
    MediaError,
    PyValueError,
    "A media item was refused or could not be processed; `args[0]` is the stable code, `args[1]` the message."
);

/// Turns a core error into `MediaError(code, message)`.
pub fn to_py(err: impl Into<crate::Error>) -> PyErr {
    let err: crate::Error = err.into();
    MediaError::new_err((err.code(), err.to_string()))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("MediaError", m.py().get_type::<MediaError>())
}
