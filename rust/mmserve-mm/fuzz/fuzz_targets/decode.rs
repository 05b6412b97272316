//! Any bytes through `decode_image`: an error value or an image whose buffer matches its size;
//! and through `probe_image`, which must give the decoded size of every image that decodes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mmserve_mm::image::decode::{decode_image, probe_image, DecodeLimits};

/// Small enough that a header claiming a large image is refused before a slow allocation.
const LIMITS: DecodeLimits = DecodeLimits {
    max_pixels: 1 << 22,
};

fuzz_target!(|data: &[u8]| {
    let probed = probe_image(data, &LIMITS);
    if let Ok(image) = decode_image(data, &LIMITS) {
        let pixels = u64::from(image.width) * u64::from(image.height);
        assert!(pixels > 0 && pixels <= LIMITS.max_pixels);
        assert_eq!(image.data.len() as u64, pixels * 3);
        let info = probed.expect("an image that decodes probes");
        assert_eq!((info.width, info.height), (image.width, image.height));
    }
});
