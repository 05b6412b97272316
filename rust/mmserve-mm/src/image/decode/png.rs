//! PNG through the `png` crate with no transformations; the conversion to RGB is PIL's:
//! 1/2/4-bit gray scaled by bit replication, 16-bit color and gray + alpha cut to their high
//! byte and 16-bit gray clipped to 255 (PIL's `RGB;16B`, `LA;16B` and `I;16` readings), palettes
//! looked up (indices past the palette read black), alpha dropped, gAMA ignored. The tRNS chunk
//! names the colour that transformers' pipeline paints white ([`transparent_color`]).

use std::io::Cursor;

use png::{BitDepth, ColorType, Decoder, Transformations};

use super::exif::Orientation;
use super::{
    alloc_zeroed, buffer_len, check_dimensions, paint_white, pil_palette, rgb_entries,
    to_rgb_in_place, unpack_sample, DecodeError, DecodeLimits, ImageFormat,
};
use crate::pipeline::DecodedImage;

const FORMAT: ImageFormat = ImageFormat::Png;
const XMP_KEYWORD: &str = "XML:com.adobe.xmp";

fn corrupt(e: png::DecodingError) -> DecodeError {
    DecodeError::corrupt(FORMAT, e)
}

/// A decoder past the IHDR chunk, whose size and pixel count are checked.
fn checked_header<'a>(
    bytes: &'a [u8],
    limits: &DecodeLimits,
) -> Result<Decoder<Cursor<&'a [u8]>>, DecodeError> {
    let mut decoder = Decoder::new(Cursor::new(bytes));
    decoder.set_transformations(Transformations::IDENTITY);
    let header = decoder.read_header_info().map_err(corrupt)?;
    check_dimensions(FORMAT, header.width, header.height, limits)?;
    Ok(decoder)
}

/// Stored size and orientation from the chunks, without inflating the image data; `None`
/// where only decoding can tell the orientation (several eXIf chunks, compressed XMP).
pub(super) fn probe(
    bytes: &[u8],
    limits: &DecodeLimits,
) -> Result<Option<(u32, u32, Orientation)>, DecodeError> {
    let mut decoder = checked_header(bytes, limits)?;
    let header = decoder.read_header_info().map_err(corrupt)?;
    let (width, height) = (header.width, header.height);
    let (mut exif, mut xmp) = (None, None);
    for (kind, data) in chunks(bytes) {
        match kind {
            b"eXIf" if exif.is_some() => return Ok(None),
            b"eXIf" => exif = Some(data),
            b"iTXt" if xmp.is_none() && data.starts_with(XMP_KEYWORD.as_bytes()) => {
                match uncompressed_itxt_text(data) {
                    Some(text) => xmp = Some(text),
                    None => return Ok(None),
                }
            }
            _ => {}
        }
    }
    Ok(Some((width, height, Orientation::from_metadata(exif, xmp))))
}

/// `(type, data)` of each complete chunk after the signature, up to IEND.
fn chunks(bytes: &[u8]) -> impl Iterator<Item = (&[u8], &[u8])> {
    const SIGNATURE_LEN: usize = 8;
    let mut at = SIGNATURE_LEN;
    std::iter::from_fn(move || {
        let len = u32::from_be_bytes(bytes.get(at..at + 4)?.try_into().ok()?) as usize;
        let kind = bytes.get(at + 4..at + 8)?;
        let data = bytes.get(at + 8..(at + 8).checked_add(len)?)?;
        if kind == b"IEND" {
            return None;
        }
        at += 12 + len; // length, type, data, CRC
        Some((kind, data))
    })
}

/// The text of an iTXt chunk `keyword\0 flag method language\0 translated\0 text`, if stored
/// uncompressed.
fn uncompressed_itxt_text(data: &[u8]) -> Option<&[u8]> {
    let keyword_end = data.iter().position(|&b| b == 0)?;
    let (&flag, rest) = data.get(keyword_end + 1..)?.split_first()?;
    if flag != 0 {
        return None;
    }
    let rest = rest.get(1..)?; // compression method
    let language_end = rest.iter().position(|&b| b == 0)?;
    let rest = &rest[language_end + 1..];
    let translated_end = rest.iter().position(|&b| b == 0)?;
    Some(&rest[translated_end + 1..])
}

pub(super) fn decode(
    bytes: &[u8],
    limits: &DecodeLimits,
) -> Result<(DecodedImage, Orientation), DecodeError> {
    let mut decoder = checked_header(bytes, limits)?;
    let header = decoder.read_header_info().map_err(corrupt)?;
    let (width, height) = (header.width, header.height);
    let (color, depth) = (header.color_type, header.bit_depth);
    let mut reader = decoder.read_info().map_err(corrupt)?;
    let raw_len = reader
        .output_buffer_size()
        .ok_or(DecodeError::OutOfMemory { bytes: usize::MAX })?;
    let pixels = buffer_len(width, height, 1)?;
    let rgb_len = buffer_len(width, height, 3)?;
    let palette = (color == ColorType::Indexed)
        .then(|| pil_palette(rgb_entries(reader.info().palette.as_deref().unwrap_or(&[]))));
    let mut data = if depth == BitDepth::Eight && color != ColorType::Indexed {
        // Decode straight into the output buffer and convert in place.
        let mut buf = alloc_zeroed(raw_len.max(rgb_len))?;
        reader.next_frame(&mut buf[..raw_len]).map_err(corrupt)?;
        to_rgb_in_place(&mut buf, pixels, color.samples());
        buf
    } else if depth == BitDepth::Sixteen {
        let mut raw = alloc_zeroed(raw_len)?;
        reader.next_frame(&mut raw).map_err(corrupt)?;
        let mut rgb = alloc_zeroed(rgb_len)?;
        let channels = color.samples();
        for (src, px) in raw.chunks_exact(2 * channels).zip(rgb.chunks_exact_mut(3)) {
            match color {
                // `I;16` to RGB clips; `LA;16B` and `RGB(A);16B` keep the high byte.
                ColorType::Grayscale => {
                    px.fill(u16::from_be_bytes([src[0], src[1]]).min(255) as u8)
                }
                ColorType::GrayscaleAlpha => px.fill(src[0]),
                _ => {
                    for (c, v) in px.iter_mut().enumerate() {
                        *v = src[2 * c];
                    }
                }
            }
        }
        rgb
    } else {
        let mut raw = alloc_zeroed(raw_len)?;
        reader.next_frame(&mut raw).map_err(corrupt)?;
        let stride = raw_len / height as usize;
        let bits = depth as u8 as usize;
        let mut rgb = alloc_zeroed(rgb_len)?;
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
    if let Some(color) = transparent_color(bytes, color, depth, palette.as_deref()) {
        paint_white(&mut data, color);
    }
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

/// The colour transformers' `convert_to_rgb` treats as transparent in the RGB image
/// `load_image` returns, from the raw tRNS chunk (the `png` crate keeps only the low byte of
/// 1..8-bit values). `load_image` turns an `L` image's level into a gray triple (clipped to
/// 255) and a palette's one fully transparent entry into its colour, when every other entry is
/// opaque (PIL's `_simple_palette` pattern, whose `$` also matches before a final newline
/// byte; other palette tRNS is dropped with the alpha). A `1` (0 or 255) or `I;16` level stays
/// an integer, which PIL's `convert_transparent` reads as the colour (level, 0, 0); every value
/// is then cut to its low byte.
fn transparent_color(
    bytes: &[u8],
    color: ColorType,
    depth: BitDepth,
    palette: Option<&[u8]>,
) -> Option<[u8; 3]> {
    let (_, trns) = chunks(bytes)
        .take_while(|(kind, _)| *kind != b"IDAT")
        .find(|(kind, _)| *kind == b"tRNS")?;
    let sample = |i: usize| -> Option<u16> {
        Some(u16::from_be_bytes([
            *trns.get(2 * i)?,
            *trns.get(2 * i + 1)?,
        ]))
    };
    let low_byte = |v: u16| v.to_le_bytes()[0];
    match (color, depth) {
        (ColorType::Grayscale, BitDepth::One) => {
            Some([if sample(0)? == 0 { 0 } else { 255 }, 0, 0])
        }
        (ColorType::Grayscale, BitDepth::Sixteen) => Some([low_byte(sample(0)?), 0, 0]),
        (ColorType::Grayscale, _) => Some([sample(0)?.min(255) as u8; 3]),
        (ColorType::Rgb, _) => Some([
            low_byte(sample(0)?),
            low_byte(sample(1)?),
            low_byte(sample(2)?),
        ]),
        (ColorType::Indexed, _) => {
            let alphas = trns.strip_suffix(b"\n").unwrap_or(trns);
            let mut translucent = alphas.iter().enumerate().filter(|(_, &a)| a != 0xFF);
            match (translucent.next(), translucent.next()) {
                (Some((index, 0)), None) => {
                    let at = index * 3;
                    palette?.get(at..at + 3)?.try_into().ok()
                }
                _ => None,
            }
        }
        _ => None,
    }
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
