//! mmserve media core: fetch, decode, resize and model-family preprocessing for
//! vision-language serving.
//!
//! Default features build a plain single-threaded rlib. `parallel` fans work out
//! through [`common::par`]; `python` adds the `mmserve._mm` extension module.

pub mod common;
pub mod driver;
pub mod error;
pub mod kv_index;
pub mod pipeline;
pub mod qwen_vl;
pub mod registry;

#[cfg(feature = "python")]
mod python;

pub use error::{Error, Result};
