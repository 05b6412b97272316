//! What every stage shares: the fan-out seam (`par`), the identity of a media item's bytes
//! (`hash`), large buffers backed by huge pages (`huge_pages`), the tokenizer's ids of texts
//! written into prompts (`text_pieces`) and, with the `video` or `audio` feature, FFmpeg's
//! input from memory (`ffmpeg`). Nothing here knows about a model family.

#[cfg(any(feature = "video", feature = "audio"))]
pub mod ffmpeg;
pub mod hash;
pub mod huge_pages;
pub mod par;
pub mod text_pieces;
