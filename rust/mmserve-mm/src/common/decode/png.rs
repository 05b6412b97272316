//! PNG through the `png` crate with no transformations; the conversion to RGB is PIL's:
//! 1/2/4-bit gray scaled by bit replication, palettes looked up (indices past the palette
//! read black), alpha and tRNS dropped, gAMA ignored.

use std::io::Cursor;

use png::{BitDepth, ColorType, Decoder, Transformations};

use super::exif::Orientation;
use super::{
    alloc_zeroed, buffer_len, check_dimensions, pil_palette, rgb_entries, to_rgb_in_place,
    unpack_sample, DecodeError, DecodeLimits, ImageFormat,
};
use crate::pipeline::DecodedImage;

const FORMAT: ImageFormat = ImageFormat::Png;
const XMP_KEYWORD: &str = "XML:com.adobe.xmp";

pub(super) fn decode(
    bytes: &[u8],
    limits: &DecodeLimits,
) -> Result<(DecodedImage, Orientation), DecodeError> {
    let corrupt = |e: png::DecodingError| DecodeError::corrupt(FORMAT, e);
    let mut decoder = Decoder::new(Cursor::new(bytes));
    decoder.set_transformations(Transformations::IDENTITY);
    let header = decoder.read_header_info().map_err(corrupt)?;
    let (width, height) = (header.width, header.height);
    let (color, depth) = (header.color_type, header.bit_depth);
    check_dimensions(FORMAT, width, height, limits)?;
    if depth == BitDepth::Sixteen {
        return Err(DecodeError::UnsupportedBitDepth {
            format: FORMAT.name(),
            bits: 16,
        });
    }
    let mut reader = decoder.read_info().map_err(corrupt)?;
    let raw_len = reader
        .output_buffer_size()
        .ok_or(DecodeError::OutOfMemory { bytes: usize::MAX })?;
    let pixels = buffer_len(width, height, 1)?;
    let rgb_len = buffer_len(width, height, 3)?;
    let data = if depth == BitDepth::Eight && color != ColorType::Indexed {
        // Decode straight into the output buffer and convert in place.
        let mut buf = alloc_zeroed(raw_len.max(rgb_len))?;
        reader.next_frame(&mut buf[..raw_len]).map_err(corrupt)?;
        to_rgb_in_place(&mut buf, pixels, color.samples());
        buf
    } else {
        let mut raw = alloc_zeroed(raw_len)?;
        reader.next_frame(&mut raw).map_err(corrupt)?;
        let stride = raw_len / height as usize;
        let bits = depth as u8 as usize;
        let mut rgb = alloc_zeroed(rgb_len)?;
        let palette = if color == ColorType::Indexed {
            Some(pil_palette(rgb_entries(
                reader.info().palette.as_deref().unwrap_or(&[]),
            )))
        } else {
            None
        };
        for (src, dst) in raw
            .chunks_exact(stride)
            .zip(rgb.chunks_exact_mut(width as usize * 3))
        {
            for (x, px) in dst.chunks_exact_mut(3).enumerate() {
                let sample = unpack_sample(src, x, bits);
                match &palette {
                    Some(pal) => {
                        px.copy_from_slice(&pal[sample as usize * 3..sample as usize * 3 + 3])
                    }
                    None => px.fill(scale_to_8_bits(sample, bits)),
                }
            }
        }
        rgb
    };
    // Trailing chunks may hold eXIf; PIL reads them too and tolerates a damaged tail.
    let _ = reader.finish();
    let info = reader.info();
    let xmp = info
        .utf8_text
        .iter()
        .find(|t| t.keyword == XMP_KEYWORD)
        .and_then(|t| t.get_text().ok());
    let orientation = Orientation::from_metadata(
        info.exif_metadata.as_deref(),
        xmp.as_deref().map(str::as_bytes),
    );
    let image = DecodedImage {
        width,
        height,
        data,
    };
    Ok((image, orientation))
}

/// Gray samples of 1, 2 or 4 bits stretched to 0..=255 (0xFF, 0x55, 0x11 multipliers).
fn scale_to_8_bits(sample: u8, bits: usize) -> u8 {
    match bits {
        1 => sample * 0xFF,
        2 => sample * 0x55,
        4 => sample * 0x11,
        _ => sample,
    }
}
