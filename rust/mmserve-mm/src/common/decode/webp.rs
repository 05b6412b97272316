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

pub(super) fn decode(
    bytes: &[u8],
    limits: &DecodeLimits,
) -> Result<(DecodedImage, Orientation), DecodeError> {
    let corrupt = |e: image_webp::DecodingError| DecodeError::corrupt(FORMAT, e);
    let mut decoder = WebPDecoder::new(Cursor::new(bytes)).map_err(corrupt)?;
    let (width, height) = decoder.dimensions();
    check_dimensions(FORMAT, width, height, limits)?;
    let channels = if decoder.has_alpha() { 4 } else { 3 };
    let len = buffer_len(width, height, channels)?;
    if decoder.output_buffer_size() != Some(len) {
        return Err(DecodeError::corrupt(FORMAT, "inconsistent image size"));
    }
    let mut data = alloc_zeroed(len)?;
    decoder.read_image(&mut data).map_err(corrupt)?;
    to_rgb_in_place(&mut data, buffer_len(width, height, 1)?, channels);
    let exif = decoder.exif_metadata().ok().flatten();
    let xmp = decoder.xmp_metadata().ok().flatten();
    let orientation = Orientation::from_metadata(exif.as_deref(), xmp.as_deref());
    let image = DecodedImage {
        width,
        height,
        data,
    };
    Ok((image, orientation))
}
