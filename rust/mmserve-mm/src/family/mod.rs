//! Model families: the registry, one line per family (`registry`); the spec a family is
//! built from (`spec`); what every family reads the same way from a checkpoint's config files
//! (`config`); each family's module, its config reading and its `Family` implementation
//! (`qwen_vl`, `gemma3`, `qwen2_audio`, `qwen2_5_omni`, `qwen3_omni_moe`); and the one layout
//! that applies every family's prompt updates (`token_layout`). The trait and the carriers are in [`crate::pipeline`].

pub mod config;
pub mod gemma3;
pub mod qwen2_5_omni;
pub mod qwen2_audio;
pub mod qwen3_omni_moe;
pub mod qwen_vl;
pub mod registry;
pub mod spec;
pub mod token_layout;
