//! What every stage shares: the fan-out seam (`par`), the identity of a media item's bytes
//! (`hash`), large buffers backed by huge pages (`huge_pages`) and the tokenizer's ids of texts written into prompts (`text_pieces`). Nothing
//! here knows about a model family.

pub mod hash;
pub mod huge_pages;
pub mod par;
pub mod text_pieces;
