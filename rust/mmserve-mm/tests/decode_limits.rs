//! decode_image refusals that must hold without the Python layer: pixel limits from the header,
//! damaged files; and the low- and 16-bit-depth conversions.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test fails loudly"
)]

use mmserve_mm::image::decode::{decode_image, DecodeLimits};

fn encode_png(
    width: u32,
    height: u32,
    color: png::ColorType,
    depth: png::BitDepth,
    data: &[u8],
) -> Vec<u8> {
    let mut out = Vec::new();
    {
        let mut encoder = png::Encoder::new(&mut out, width, height);
        encoder.set_color(color);
        encoder.set_depth(depth);
        let mut writer = encoder.write_header().expect("header");
        writer.write_image_data(data).expect("data");
    }
    out
}

/// The PNG chunk CRC (CRC-32, reflected, polynomial 0xEDB88320).
fn crc32(bytes: &[u8]) -> u32 {
    !bytes.iter().fold(!0u32, |crc, &b| {
        (0..8).fold(crc ^ u32::from(b), |c, _| {
            if c & 1 == 1 {
                (c >> 1) ^ 0xEDB8_8320
            } else {
                c >> 1
            }
        })
    })
}

#[test]
fn pixel_limit_is_checked_from_the_header() {
    let mut png = encode_png(4, 4, png::ColorType::Rgb, png::BitDepth::Eight, &[0; 48]);
    // IHDR claims 100000 x 100000 (30 GB of RGB) over 48 bytes of pixel data.
    png[16..20].copy_from_slice(&100_000u32.to_be_bytes());
    png[20..24].copy_from_slice(&100_000u32.to_be_bytes());
    let crc = crc32(&png[12..29]);
    png[29..33].copy_from_slice(&crc.to_be_bytes());
    let err = decode_image(&png, &DecodeLimits::default()).unwrap_err();
    assert_eq!(err.code(), "decode.too_many_pixels", "{err}");

    let small = encode_png(
        40,
        25,
        png::ColorType::Rgb,
        png::BitDepth::Eight,
        &[9; 3000],
    );
    assert!(decode_image(&small, &DecodeLimits { max_pixels: 1000 }).is_ok());
    let err = decode_image(&small, &DecodeLimits { max_pixels: 999 }).unwrap_err();
    assert_eq!(err.code(), "decode.too_many_pixels");
}

#[test]
fn sixteen_bit_gray_is_clipped_and_color_keeps_its_high_byte_like_pil() {
    // Big-endian samples 1, 256, 255, 65535.
    let samples = [0, 1, 1, 0, 0, 255, 255, 255];
    let gray = encode_png(
        4,
        1,
        png::ColorType::Grayscale,
        png::BitDepth::Sixteen,
        &samples,
    );
    let image = decode_image(&gray, &DecodeLimits::default()).unwrap();
    let expected: Vec<u8> = [1u8, 255, 255, 255].iter().flat_map(|&v| [v; 3]).collect();
    assert_eq!(image.data, expected);
    let mut rgba = samples.to_vec();
    rgba.extend([0; 8]);
    let color = encode_png(1, 2, png::ColorType::Rgba, png::BitDepth::Sixteen, &rgba);
    let image = decode_image(&color, &DecodeLimits::default()).unwrap();
    assert_eq!(image.data, [0, 1, 0, 0, 0, 0]);
}

#[test]
fn two_bit_gray_is_stretched_like_pil() {
    // One row of four 2-bit samples 0, 1, 2, 3 packed in one byte.
    let png = encode_png(
        4,
        1,
        png::ColorType::Grayscale,
        png::BitDepth::Two,
        &[0b00_01_10_11],
    );
    let image = decode_image(&png, &DecodeLimits::default()).unwrap();
    let expected: Vec<u8> = [0u8, 85, 170, 255]
        .iter()
        .flat_map(|&v| [v, v, v])
        .collect();
    assert_eq!(image.data, expected);
}

#[test]
fn truncated_files_are_errors() {
    let png = encode_png(
        16,
        16,
        png::ColorType::Rgba,
        png::BitDepth::Eight,
        &[200; 1024],
    );
    for cut in [8, 20, 33, png.len() / 2, png.len() - 13] {
        let err = decode_image(&png[..cut], &DecodeLimits::default()).unwrap_err();
        assert_eq!(err.code(), "decode.corrupt", "cut at {cut}");
    }
}
