//! Image operations, model-independent: decode encoded bytes to RGB (`decode`), resize
//! bit-exact with the reference in use (`resize`), then rescale, normalise and patchify
//! (`transforms`); pan-and-scan's crops (`pan_and_scan`).

pub mod decode;
pub mod pan_and_scan;
pub mod resize;
pub mod transforms;
