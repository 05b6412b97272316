//! Model families: the spec a family is built from and its parser of a checkpoint's config
//! files (`registry`), each family's code (`qwen_vl`, `gemma3`), and the expansion of the token layout a
//! family gives (`token_layout`). The trait and the carriers are in [`crate::pipeline`].

pub mod gemma3;
pub mod qwen_vl;
pub mod registry;
pub mod token_layout;
