//! TODO(hash)
