//! TODO(decode)

use thiserror::Error;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum DecodeError {
    #[error("placeholder")]
    Placeholder,
}

impl DecodeError {
    pub fn code(&self) -> &'static str {
        match self {
            DecodeError::Placeholder => "decode.placeholder",
        }
    }
}
