//! Model-independent building blocks. Nothing here knows about a model family.

pub mod base64;
pub mod decode;
pub mod fetch;
pub mod hash;
pub mod par;
pub mod resize;
pub mod token_layout;
pub mod transforms;
