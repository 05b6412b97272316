//! TODO(fetch)

use thiserror::Error;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum FetchError {
    #[error("placeholder")]
    Placeholder,
}

impl FetchError {
    pub fn code(&self) -> &'static str {
        match self {
            FetchError::Placeholder => "fetch.placeholder",
        }
    }
}
