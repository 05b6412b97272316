//! TODO(qwen_vl)
