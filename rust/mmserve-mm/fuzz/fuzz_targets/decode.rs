//! Any bytes through `decode_image`: an error value or an image whose buffer matches its size.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mmserve_mm::common::decode::{decode_image, DecodeLimits};

/// Small enough that a header claiming a large image is refused before a slow allocation.
const LIMITS: DecodeLimits = DecodeLimits {
    max_pixels: 1 << 22,
};

fuzz_target!(|data: &[u8]| {
    if let Ok(image) = decode_image(data, &LIMITS) {
        let pixels = u64::from(image.width) * u64::from(image.height);
        assert!(pixels > 0 && pixels <= LIMITS.max_pixels);
        assert_eq!(image.data.len() as u64, pixels * 3);
    }
});
