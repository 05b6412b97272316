//! WebP (lossy and lossless) through `image-webp`; for animations, the first frame. Alpha is
//! dropped as in PIL's `convert("RGB")`.

use std::io::Cursor;

use image_webp::WebPDecoder;

use super::exif::Orientation;
use super::{
    alloc_zeroed, buffer_len, check_dimensions, to_rgb_in_place, DecodeError, DecodeLimits,
    ImageFormat,
};
use crate::pipeline::DecodedImage;

const FORMAT: ImageFormat = ImageFormat::Webp;

fn corrupt(e: image_webp::DecodingError) -> DecodeError {
    DecodeError::corrupt(FORMAT, e)
}

/// A decoder past the container's chunk headers, whose size and pixel count are checked.
fn checked_header<'a>(
    bytes: &'a [u8],
    limits: &DecodeLimits,
) -> Result<WebPDecoder<Cursor<&'a [u8]>>, DecodeError> {
    let decoder = WebPDecoder::new(Cursor::new(bytes)).map_err(corrupt)?;
    let (width, height) = decoder.dimensions();
    check_dimensions(FORMAT, width, height, limits)?;
    Ok(decoder)
}

fn orientation(decoder: &mut WebPDecoder<Cursor<&[u8]>>) -> Orientation {
    let exif = decoder.exif_metadata().ok().flatten();
    let xmp = decoder.xmp_metadata().ok().flatten();
    Orientation::from_metadata(exif.as_deref(), xmp.as_deref())
}

/// Stored size and orientation from the container, without decoding the bitstream.
pub(super) fn probe(
    bytes: &[u8],
    limits: &DecodeLimits,
) -> Result<(u32, u32, Orientation), DecodeError> {
    let mut decoder = checked_header(bytes, limits)?;
    let (width, height) = decoder.dimensions();
    Ok((width, height, orientation(&mut decoder)))
}

pub(super) fn decode(
    bytes: &[u8],
    limits: &DecodeLimits,
) -> Result<(DecodedImage, Orientation), DecodeError> {
    let mut decoder = checked_header(bytes, limits)?;
    let (width, height) = decoder.dimensions();
    let channels = if decoder.has_alpha() { 4 } else { 3 };
    let len = buffer_len(width, height, channels)?;
    if decoder.output_buffer_size() != Some(len) {
        return Err(DecodeError::corrupt(FORMAT, "inconsistent image size"));
    }
    let mut data = alloc_zeroed(len)?;
    decoder.read_image(&mut data).map_err(corrupt)?;
    to_rgb_in_place(&mut data, buffer_len(width, height, 1)?, channels);
    let image = DecodedImage {
        width,
        height,
        data,
    };
    Ok((image, orientation(&mut decoder)))
}
