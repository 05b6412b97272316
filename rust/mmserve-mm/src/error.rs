//! The crate-level error: one variant per stage, each carrying its stage's own
//! error with a stable `code()` that the wire protocol reuses.

use thiserror::Error;

use crate::driver::RequestError;
use crate::family::registry::SpecError;
use crate::image::{decode::DecodeError, resize::ResizeError};
use crate::pipeline::ProcessError;
use crate::source::fetch::FetchError;
use crate::video::VideoError;

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
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error(transparent)]
    Video(#[from] VideoError),
    /// A failure of one media item of a request; keeps the item's own code.
    #[error("item {index}: {source}")]
    Item { index: usize, source: Box<Error> },
}

impl Error {
    /// Stable machine-readable code, e.g. `fetch.too_large`.
    pub fn code(&self) -> &'static str {
        match self {
            Error::Fetch(e) => e.code(),
            Error::Decode(e) => e.code(),
            Error::Resize(e) => e.code(),
            Error::Process(e) => e.code(),
            Error::Spec(e) => e.code(),
            Error::Request(e) => e.code(),
            Error::Video(e) => e.code(),
            Error::Item { source, .. } => source.code(),
        }
    }

    /// The index of the request item that failed, when one did.
    pub fn item_index(&self) -> Option<usize> {
        match self {
            Error::Item { index, .. } => Some(*index),
            _ => None,
        }
    }

    /// Tags this error with the request item it came from.
    pub fn at_item(self, index: usize) -> Error {
        Error::Item {
            index,
            source: Box::new(self),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
