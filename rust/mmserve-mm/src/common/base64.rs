//! TODO(base64)
