//! TODO(transforms)
