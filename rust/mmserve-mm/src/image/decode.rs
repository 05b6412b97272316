//! Encoded image bytes to interleaved RGB8, the way transformers' pipeline sees them:
//! `load_image` (`PIL.ImageOps.exif_transpose`, then `convert("RGB")`, which drops alpha), then
//! the image processors' `convert_to_rgb`, which paints white every pixel of the colour PIL
//! still keeps as the image's transparent colour (a PNG tRNS colour or single transparent
//! palette entry, a GIF's transparent index).
//!
//! The format is sniffed from magic bytes, never from a URL or content type. Dimensions are
//! checked against [`DecodeLimits::max_pixels`] from the header, before any pixel buffer is
//! allocated, and buffers are reserved fallibly, so a decompression bomb is an error value.

use thiserror::Error;

use crate::error::ErrorCode;
use crate::pipeline::DecodedImage;

mod bmp;
pub(crate) mod exif;
mod gif;
mod jpeg;
mod png;
mod webp;

/// PIL's `DecompressionBombError` threshold: twice `Image.MAX_IMAGE_PIXELS`.
pub const PIL_BOMB_PIXELS: u64 = 2 * 89_478_485;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Largest accepted width x height.
    pub max_pixels: u64,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        Self {
            max_pixels: PIL_BOMB_PIXELS,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageFormat {
    Jpeg,
    Png,
    Webp,
    Gif,
    Bmp,
}

impl ImageFormat {
    pub fn name(self) -> &'static str {
        match self {
            ImageFormat::Jpeg => "JPEG",
            ImageFormat::Png => "PNG",
            ImageFormat::Webp => "WebP",
            ImageFormat::Gif => "GIF",
            ImageFormat::Bmp => "BMP",
        }
    }
}

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum DecodeError {
    #[error("unrecognised image format (supported: JPEG, PNG, WebP, GIF, BMP)")]
    UnknownFormat,
    #[error("{format} image of {width}x{height} exceeds the limit of {limit} pixels")]
    TooManyPixels {
        format: &'static str,
        width: u32,
        height: u32,
        limit: u64,
    },
    #[error("{format} image has {width}x{height} pixels; both sides must be at least 1")]
    EmptyImage {
        format: &'static str,
        width: u32,
        height: u32,
    },
    #[error("{format} image has {bits}-bit samples; only 8 bits or fewer are supported")]
    UnsupportedBitDepth { format: &'static str, bits: u32 },
    #[error("unsupported {format} image: {reason}")]
    Unsupported {
        format: &'static str,
        reason: String,
    },
    #[error("corrupt or truncated {format} image: {reason}")]
    Corrupt {
        format: &'static str,
        reason: String,
    },
    #[error("cannot allocate {bytes} bytes for the decoded image")]
    OutOfMemory { bytes: usize },
}

impl DecodeError {
    /// This error's entry in the catalogue of codes.
    pub fn kind(&self) -> ErrorCode {
        match self {
            DecodeError::UnknownFormat => ErrorCode::DecodeUnknownFormat,
            DecodeError::TooManyPixels { .. } => ErrorCode::DecodeTooManyPixels,
            DecodeError::EmptyImage { .. } => ErrorCode::DecodeEmptyImage,
            DecodeError::UnsupportedBitDepth { .. } => ErrorCode::DecodeUnsupportedBitDepth,
            DecodeError::Unsupported { .. } => ErrorCode::DecodeUnsupported,
            DecodeError::Corrupt { .. } => ErrorCode::DecodeCorrupt,
            DecodeError::OutOfMemory { .. } => ErrorCode::DecodeOutOfMemory,
        }
    }

    /// Stable machine-readable code, e.g. `decode.unknown_format`.
    pub fn code(&self) -> &'static str {
        self.kind().code()
    }

    fn corrupt(format: ImageFormat, reason: impl ToString) -> Self {
        DecodeError::Corrupt {
            format: format.name(),
            reason: reason.to_string(),
        }
    }

    fn unsupported(format: ImageFormat, reason: impl ToString) -> Self {
        DecodeError::Unsupported {
            format: format.name(),
            reason: reason.to_string(),
        }
    }
}

/// The format named by the leading magic bytes, if it is one we decode.
pub fn sniff_format(bytes: &[u8]) -> Option<ImageFormat> {
    if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
        Some(ImageFormat::Jpeg)
    } else if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        Some(ImageFormat::Png)
    } else if bytes.len() >= 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
        Some(ImageFormat::Webp)
    } else if bytes.starts_with(b"GIF87a") || bytes.starts_with(b"GIF89a") {
        Some(ImageFormat::Gif)
    } else if bytes.starts_with(b"BM") {
        Some(ImageFormat::Bmp)
    } else {
        None
    }
}

/// Decodes `bytes` to RGB8 (alpha dropped, the transparent colour painted white, palettes
/// looked up, gray replicated) and applies the EXIF orientation.
pub fn decode_image(bytes: &[u8], limits: &DecodeLimits) -> Result<DecodedImage, DecodeError> {
    let format = sniff_format(bytes).ok_or(DecodeError::UnknownFormat)?;
    let (image, orientation) = match format {
        ImageFormat::Jpeg => jpeg::decode(bytes, limits)?,
        ImageFormat::Png => png::decode(bytes, limits)?,
        ImageFormat::Webp => webp::decode(bytes, limits)?,
        ImageFormat::Gif => (gif::decode(bytes, limits)?, exif::Orientation::Normal),
        ImageFormat::Bmp => (bmp::decode(bytes, limits)?, exif::Orientation::Normal),
    };
    exif::apply(image, orientation)
}

/// What the headers say of an image: its format, and the size [`decode_image`] returns (the
/// EXIF orientation applied).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageInfo {
    pub format: ImageFormat,
    pub width: u32,
    pub height: u32,
}

/// The format and oriented size of an image, read from its headers and metadata without
/// decoding its pixels (BMP, and the rare PNG whose orientation only decoding can tell, are
/// decoded). Refuses what the headers show (unknown format, empty or too many pixels, deep
/// samples), not a corrupt or truncated body: [`decode_image`] does.
pub fn probe_image(bytes: &[u8], limits: &DecodeLimits) -> Result<ImageInfo, DecodeError> {
    let format = sniff_format(bytes).ok_or(DecodeError::UnknownFormat)?;
    let stored = match format {
        ImageFormat::Jpeg => Some(jpeg::probe(bytes, limits)?),
        ImageFormat::Png => png::probe(bytes, limits)?,
        ImageFormat::Webp => Some(webp::probe(bytes, limits)?),
        ImageFormat::Gif => {
            let (width, height) = gif::probe(bytes, limits)?;
            Some((width, height, exif::Orientation::Normal))
        }
        ImageFormat::Bmp => None,
    };
    let (width, height) = match stored {
        Some((w, h, orientation)) if orientation.swaps_axes() => (h, w),
        Some((w, h, _)) => (w, h),
        None => {
            let image = decode_image(bytes, limits)?;
            (image.width, image.height)
        }
    };
    Ok(ImageInfo {
        format,
        width,
        height,
    })
}

/// Refuses empty images and images over the pixel limit; called with header dimensions,
/// before anything the size of the image is allocated.
fn check_dimensions(
    format: ImageFormat,
    width: u32,
    height: u32,
    limits: &DecodeLimits,
) -> Result<(), DecodeError> {
    if width == 0 || height == 0 {
        return Err(DecodeError::EmptyImage {
            format: format.name(),
            width,
            height,
        });
    }
    if u64::from(width) * u64::from(height) > limits.max_pixels {
        return Err(DecodeError::TooManyPixels {
            format: format.name(),
            width,
            height,
            limit: limits.max_pixels,
        });
    }
    Ok(())
}

/// A zeroed buffer of `len` bytes, or an error instead of an abort when memory is short.
fn alloc_zeroed(len: usize) -> Result<Vec<u8>, DecodeError> {
    let mut buf = Vec::new();
    buf.try_reserve_exact(len)
        .map_err(|_| DecodeError::OutOfMemory { bytes: len })?;
    crate::common::huge_pages::advise(&buf);
    buf.resize(len, 0);
    Ok(buf)
}

/// `width * height * channels` as a buffer length.
fn buffer_len(width: u32, height: u32, channels: usize) -> Result<usize, DecodeError> {
    (width as usize)
        .checked_mul(height as usize)
        .and_then(|n| n.checked_mul(channels))
        .ok_or(DecodeError::OutOfMemory { bytes: usize::MAX })
}

/// Turns a buffer of `channels`-byte pixels into RGB in place: 1 = gray (replicated),
/// 2 = gray + alpha, 3 = RGB, 4 = RGBA (alpha dropped). `buf` must hold `pixels * 3` bytes
/// when expanding gray.
fn to_rgb_in_place(buf: &mut Vec<u8>, pixels: usize, channels: usize) {
    match channels {
        1 | 2 => {
            buf.resize(pixels * 3, 0);
            // Backwards, so that no source byte is overwritten before it is read.
            for i in (0..pixels).rev() {
                let v = buf[i * channels];
                buf[i * 3..i * 3 + 3].fill(v);
            }
        }
        4 => {
            for i in 0..pixels {
                buf.copy_within(i * 4..i * 4 + 3, i * 3);
            }
            buf.truncate(pixels * 3);
            // The array handed to Python keeps the allocation; give the alpha quarter back.
            buf.shrink_to_fit();
        }
        _ => {}
    }
}

/// Paints every pixel of `color` white: `convert_to_rgb` promotes the colour PIL keeps as
/// transparent to alpha 0 and composites the image onto white.
fn paint_white(rgb: &mut [u8], color: [u8; 3]) {
    for px in rgb.chunks_exact_mut(3) {
        if px == color {
            px.fill(255);
        }
    }
}

/// The `x`-th sample of a packed row of `bits`-bit samples (most significant bits first).
fn unpack_sample(row: &[u8], x: usize, bits: usize) -> u8 {
    match bits {
        8 => row[x],
        _ => {
            let per_byte = 8 / bits;
            let shift = 8 - bits * (x % per_byte + 1);
            (row[x / per_byte] >> shift) & ((1u8 << bits) - 1)
        }
    }
}

/// A 256-entry RGB lookup table as PIL builds it: the given entries, then black, so that
/// indices past a short palette read (0, 0, 0) rather than fail.
fn pil_palette(entries: impl Iterator<Item = [u8; 3]>) -> Vec<u8> {
    let mut table = vec![0u8; 256 * 3];
    for (slot, rgb) in table.chunks_exact_mut(3).zip(entries) {
        slot.copy_from_slice(&rgb);
    }
    table
}

/// The table for a palette that PIL reads as an `L` image when it is exactly the gray ramp
/// (entry i = (i, i, i)): then every index, also past the palette, is its own gray level.
fn pil_palette_gray_ramp_as_l(entries: impl Iterator<Item = [u8; 3]> + Clone) -> Vec<u8> {
    let mut gray_ramp = entries
        .clone()
        .enumerate()
        .all(|(i, rgb)| rgb == [i as u8; 3]);
    gray_ramp &= entries.clone().next().is_some();
    if gray_ramp {
        pil_palette((0..=255u8).map(|i| [i; 3]))
    } else {
        pil_palette(entries)
    }
}

/// Palette entries stored as packed RGB triples (PNG, GIF).
fn rgb_entries(packed: &[u8]) -> impl Iterator<Item = [u8; 3]> + Clone + '_ {
    packed.chunks_exact(3).map(|c| [c[0], c[1], c[2]])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sniffs_magic_bytes() {
        assert_eq!(sniff_format(b"\xFF\xD8\xFF\xE0"), Some(ImageFormat::Jpeg));
        assert_eq!(sniff_format(b"\x89PNG\r\n\x1a\nxx"), Some(ImageFormat::Png));
        assert_eq!(
            sniff_format(b"RIFF\0\0\0\0WEBPVP8 "),
            Some(ImageFormat::Webp)
        );
        assert_eq!(sniff_format(b"GIF89a"), Some(ImageFormat::Gif));
        assert_eq!(sniff_format(b"BM"), Some(ImageFormat::Bmp));
        assert_eq!(sniff_format(b"<svg"), None);
        assert_eq!(
            decode_image(b"", &DecodeLimits::default())
                .unwrap_err()
                .code(),
            "decode.unknown_format"
        );
    }

    #[test]
    fn in_place_conversions() {
        let mut gray = vec![1, 2, 0, 0, 0, 0];
        to_rgb_in_place(&mut gray, 2, 1);
        assert_eq!(gray, [1, 1, 1, 2, 2, 2]);
        let mut la = vec![1, 9, 2, 9];
        to_rgb_in_place(&mut la, 2, 2);
        assert_eq!(la, [1, 1, 1, 2, 2, 2]);
        let mut rgba = vec![1, 2, 3, 9, 4, 5, 6, 9];
        to_rgb_in_place(&mut rgba, 2, 4);
        assert_eq!(rgba, [1, 2, 3, 4, 5, 6]);
    }
}
