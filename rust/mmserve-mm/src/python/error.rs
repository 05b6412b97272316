//! The one conversion from the core's errors to Python exceptions.

use std::collections::HashMap;

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::error::ErrorCode;

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

/// Every code the core can raise: `{code: (http_status, meaning)}`.
#[pyfunction]
fn error_catalogue() -> HashMap<&'static str, (u16, String)> {
    ErrorCode::ALL
        .iter()
        .map(|kind| (kind.code(), (kind.status(), kind.meaning())))
        .collect()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("MediaError", m.py().get_type::<MediaError>())?;
    m.add_function(wrap_pyfunction!(error_catalogue, m)?)
}
