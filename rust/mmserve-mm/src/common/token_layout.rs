//! TODO(token_layout)
