//! Resize goldens from the pinned references (Pillow 13.0.0; torch 2.15 / torchvision 0.29),
//! made by `tests/mm/make_resize_goldens.py`: FNV-1a 64 of each output, for an xorshift32
//! image regenerated here. The Python tests compare against the live references; these keep
//! the Rust build honest on its own (no Python needed).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test fails loudly"
)]

use mmserve_mm::image::resize::{resize, Backend, Filter};
use mmserve_mm::pipeline::DecodedImage;

/// (in_w, in_h, out_w, out_h, filter, PIL golden, torch golden)
const GOLDENS: &[(u32, u32, u32, u32, Filter, u64, u64)] = &[
    (
        64,
        48,
        66,
        40,
        Filter::Bicubic,
        0x7607aaec6b86f9e1,
        0x783d21d64ceebbbc,
    ),
    (
        640,
        480,
        644,
        476,
        Filter::Bicubic,
        0x8fecbc2df90e5b71,
        0x731ceb381328d8ea,
    ),
    (
        50,
        37,
        17,
        90,
        Filter::Lanczos,
        0x4535d06497aefb2d,
        0x095d1b49df6c40b5,
    ),
    (
        31,
        29,
        62,
        58,
        Filter::Bilinear,
        0xc8222329dccc0a38,
        0xc8222329dccc0a38,
    ),
    (
        300,
        200,
        13,
        11,
        Filter::Lanczos,
        0x4ceafe77371a261b,
        0x4ceafe77371a261b,
    ),
    (
        97,
        61,
        301,
        17,
        Filter::Bicubic,
        0xe3f56458d92b6efb,
        0x872b031413d08343,
    ),
];

fn xorshift_image(width: u32, height: u32, seed: u32) -> DecodedImage {
    let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    let data = (0..width as usize * height as usize * 3)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state >> 24) as u8
        })
        .collect();
    DecodedImage {
        width,
        height,
        data,
    }
}

fn fnv1a(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf29ce484222325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100000001b3)
    })
}

#[test]
fn outputs_match_the_pinned_references() {
    for (seed, &(w, h, ow, oh, filter, pil, torch)) in GOLDENS.iter().enumerate() {
        let image = xorshift_image(w, h, seed as u32);
        for (backend, expected) in [(Backend::Pil, pil), (Backend::TorchU8, torch)] {
            let out = resize(&image, ow, oh, filter, backend).expect("valid sizes");
            assert_eq!(
                fnv1a(&out.data),
                expected,
                "{backend:?} {filter:?} {w}x{h} -> {ow}x{oh}"
            );
        }
    }
}
