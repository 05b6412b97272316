//! Carriers that flow between the stages, and the model-family trait.
//! A family describes data; it never runs the request (that is `driver.rs`).

use thiserror::Error;

/// A decoded image: interleaved RGB8, row-major (HWC).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodedImage {
    pub width: u32,
    pub height: u32,
    pub data: Vec<u8>,
}

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ProcessError {
    #[error("placeholder")]
    Placeholder,
}

impl ProcessError {
    pub fn code(&self) -> &'static str {
        match self {
            ProcessError::Placeholder => "process.placeholder",
        }
    }
}
