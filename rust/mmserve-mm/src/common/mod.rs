//! What every stage shares: the fan-out seam (`par`) and the identity of a media item's bytes
//! (`hash`). Nothing here knows about a model family.

pub mod hash;
pub mod par;
