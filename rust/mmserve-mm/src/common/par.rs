//! TODO(par)
