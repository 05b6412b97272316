//! Image operations, model-independent: decode encoded bytes to RGB (`decode`), resize
//! bit-exact with the reference in use (`resize`), then rescale, normalise and patchify
//! (`transforms`).

pub mod decode;
pub mod resize;
pub mod transforms;
