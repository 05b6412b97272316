//! TODO(registry)
