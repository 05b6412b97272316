//! mmserve media core: fetch, decode, resize and model-family preprocessing for
//! vision-language serving.
//!
//! The modules read as the pipeline: [`source`] (the media sources: fetch, base64) ->
//! [`image`] (decode, resize, transforms) -> [`family`] (the registry and each family's code,
//! over the trait and carriers in [`pipeline`]) -> [`driver`] (one request, end to end). [`kv`]
//! is the KV-aware routing index; [`video`] samples, decodes and patchifies videos; [`audio`]
//! decodes clips and computes their log-mel features; [`common`] holds what they all share
//! (hash, par, FFmpeg's input from memory); [`identity`] names every media item (its mm_hash).
//!
//! Default features build a plain single-threaded rlib. `parallel` fans work out
//! through [`common::par`]; `python` adds the `mmserve._mm` extension module; `video` and
//! `audio` link FFmpeg's libraries for demuxing and decoding (`audio` adds libswresample).

pub mod audio;
pub mod common;
pub mod driver;
pub mod error;
pub mod family;
pub mod identity;
pub mod image;
pub mod kv;
pub mod pipeline;
pub mod source;
pub mod video;

#[cfg(feature = "python")]
mod python;

pub use error::{Error, Result};
