//! TODO(resize)

use thiserror::Error;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ResizeError {
    #[error("placeholder")]
    Placeholder,
}

impl ResizeError {
    pub fn code(&self) -> &'static str {
        match self {
            ResizeError::Placeholder => "resize.placeholder",
        }
    }
}
