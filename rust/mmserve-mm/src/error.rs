//! The crate-level error: one variant per stage, each carrying its stage's own
//! error with a stable `code()` that the wire protocol reuses.

use thiserror::Error;

use crate::common::{decode::DecodeError, fetch::FetchError, resize::ResizeError};
use crate::pipeline::ProcessError;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    #[error(transparent)]
    Fetch(#[from] FetchError),
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error(transparent)]
    Resize(#[from] ResizeError),
    #[error(transparent)]
    Process(#[from] ProcessError),
}

impl Error {
    /// Stable machine-readable code, e.g. `fetch.too_large`.
    pub fn code(&self) -> &'static str {
        match self {
            Error::Fetch(e) => e.code(),
            Error::Decode(e) => e.code(),
            Error::Resize(e) => e.code(),
            Error::Process(e) => e.code(),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
