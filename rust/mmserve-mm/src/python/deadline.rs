//! A call's `timeout_s` as the core's deadline.

use std::time::{Duration, Instant};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// The instant `timeout_s` seconds from now (`None`: no deadline).
pub(super) fn deadline(timeout_s: Option<f64>) -> PyResult<Option<Instant>> {
    timeout_s
        .map(|s| {
            Duration::try_from_secs_f64(s)
                .ok()
                .and_then(|d| Instant::now().checked_add(d))
                .ok_or_else(|| PyValueError::new_err(format!("bad timeout_s {s}")))
        })
        .transpose()
}
