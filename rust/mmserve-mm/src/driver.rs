//! TODO(driver)
