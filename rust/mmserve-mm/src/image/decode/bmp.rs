//! BMP: 1/4/8-bit palette, 16-bit (5-5-5, 5-6-5), 24-bit and 32-bit (plain or bit fields)
//! uncompressed images, bottom-up or top-down, with PIL's conversions (16-bit channels scale
//! as `v * 255 / max`, alpha is dropped), and RLE8 / RLE4 expanded exactly as PIL's
//! `BmpRleDecoder` does.

use std::borrow::Cow;

use super::{
    alloc_zeroed, buffer_len, check_dimensions, pil_palette_gray_ramp_as_l, unpack_sample,
    DecodeError, DecodeLimits, ImageFormat,
};
use crate::pipeline::DecodedImage;

const FORMAT: ImageFormat = ImageFormat::Bmp;
const FILE_HEADER_LEN: usize = 14;
const BI_RGB: u32 = 0;
const BI_RLE8: u32 = 1;
const BI_RLE4: u32 = 2;
const BI_BITFIELDS: u32 = 3;
const BI_ALPHABITFIELDS: u32 = 6;

fn corrupt(reason: &str) -> DecodeError {
    DecodeError::corrupt(FORMAT, reason)
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn u16(&self, at: usize) -> Result<u16, DecodeError> {
        let b = self
            .0
            .get(at..at + 2)
            .ok_or_else(|| corrupt("header is truncated"))?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&self, at: usize) -> Result<u32, DecodeError> {
        let b = self
            .0
            .get(at..at + 4)
            .ok_or_else(|| corrupt("header is truncated"))?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
}

/// How a pixel of a given depth becomes RGB.
enum Layout {
    Indexed { bits: u32, palette: Vec<u8> },
    Bgr24,
    Masked { bytes: usize, masks: [u32; 3] },
}

pub(super) fn decode(bytes: &[u8], limits: &DecodeLimits) -> Result<DecodedImage, DecodeError> {
    let r = Reader(bytes);
    let data_offset = r.u32(10)? as usize;
    let dib_len = r.u32(FILE_HEADER_LEN)? as usize;
    let core = dib_len == 12; // OS/2 BITMAPCOREHEADER: 16-bit sizes, 3-byte palette entries
    let (width, raw_height, bpp, compression, colors_used) = if core {
        let w = i32::from(r.u16(18)?);
        let h = i32::from(r.u16(20)? as i16);
        (w, h, r.u16(24)?, BI_RGB, 0)
    } else if dib_len >= 40 {
        let w = r.u32(18)? as i32;
        let h = r.u32(22)? as i32;
        (w, h, r.u16(28)?, r.u32(30)?, r.u32(46)?)
    } else {
        return Err(DecodeError::unsupported(
            FORMAT,
            format!("header size {dib_len}"),
        ));
    };
    let top_down = raw_height < 0;
    let width = u32::try_from(width).map_err(|_| corrupt("negative width"))?;
    let height = raw_height.unsigned_abs();
    check_dimensions(FORMAT, width, height, limits)?;
    let bpp = u32::from(bpp);

    let layout = match (bpp, compression) {
        (1 | 2 | 4 | 8, BI_RGB) | (8, BI_RLE8) | (4, BI_RLE4) => {
            let entry = if core { 3 } else { 4 };
            let count = if colors_used == 0 {
                1usize << bpp
            } else {
                colors_used as usize
            };
            let start = FILE_HEADER_LEN + dib_len;
            let table = bytes
                .get(start..start + count.min(256) * entry)
                .ok_or_else(|| corrupt("palette is truncated"))?;
            let entries = table.chunks_exact(entry).map(|c| [c[2], c[1], c[0]]);
            // Two-entry gray palettes read as PIL's `1` mode, which is the same lookup.
            let palette = pil_palette_gray_ramp_as_l(entries);
            Layout::Indexed { bits: bpp, palette }
        }
        (24, BI_RGB) => Layout::Bgr24,
        (16, BI_RGB) => Layout::Masked {
            bytes: 2,
            masks: [0x7C00, 0x03E0, 0x001F],
        },
        (32, BI_RGB) => Layout::Masked {
            bytes: 4,
            masks: [0xFF_0000, 0xFF00, 0xFF],
        },
        (16 | 24 | 32, BI_BITFIELDS | BI_ALPHABITFIELDS) => {
            // Masks follow a 40-byte header and are part of larger ones, at the same offset.
            let at = FILE_HEADER_LEN + 40;
            let mut masks = [r.u32(at)?, r.u32(at + 4)?, r.u32(at + 8)?];
            if bpp == 32 && masks == [0; 3] {
                masks = [0xFF_0000, 0xFF00, 0xFF]; // PIL reads all-zero masks as BGRA
            }
            if masks.iter().any(|&m| m == 0 || !is_contiguous(m)) {
                return Err(DecodeError::unsupported(
                    FORMAT,
                    format!("bit field masks {masks:#x?}"),
                ));
            }
            Layout::Masked {
                bytes: bpp as usize / 8,
                masks,
            }
        }
        (bits, BI_RLE8 | BI_RLE4) => {
            return Err(DecodeError::unsupported(
                FORMAT,
                format!("RLE with {bits}-bit pixels"),
            ))
        }
        (bits, BI_RGB | BI_BITFIELDS) if bits > 32 || bits == 0 => {
            return Err(DecodeError::UnsupportedBitDepth {
                format: FORMAT.name(),
                bits,
            })
        }
        (bits, c) => {
            return Err(DecodeError::unsupported(
                FORMAT,
                format!("{bits}-bit pixels with compression {c}"),
            ))
        }
    };

    let (pixels, stride, layout) = if compression == BI_RLE8 || compression == BI_RLE4 {
        let encoded = bytes
            .get(data_offset..)
            .ok_or_else(|| corrupt("pixel data is missing"))?;
        let indices = expand_rle(encoded, data_offset, width, height, compression == BI_RLE4)?;
        let layout = match layout {
            Layout::Indexed { palette, .. } => Layout::Indexed { bits: 8, palette },
            other => other,
        };
        (Cow::Owned(indices), width as usize, layout)
    } else {
        let stride = (width as usize * bpp as usize).div_ceil(32) * 4;
        let end = stride
            .checked_mul(height as usize)
            .and_then(|n| n.checked_add(data_offset))
            .filter(|&end| end <= bytes.len())
            .ok_or_else(|| corrupt("pixel data is truncated"))?;
        (Cow::Borrowed(&bytes[data_offset..end]), stride, layout)
    };
    let mut data = alloc_zeroed(buffer_len(width, height, 3)?)?;
    let row_len = width as usize * 3;
    for (y, dst) in data.chunks_exact_mut(row_len).enumerate() {
        let src_row = if top_down { y } else { height as usize - 1 - y };
        let src = &pixels[src_row * stride..(src_row + 1) * stride];
        convert_row(&layout, src, dst);
    }
    Ok(DecodedImage {
        width,
        height,
        data,
    })
}

fn convert_row(layout: &Layout, src: &[u8], dst: &mut [u8]) {
    match layout {
        Layout::Indexed { bits, palette } => {
            for (x, px) in dst.chunks_exact_mut(3).enumerate() {
                let index = usize::from(unpack_sample(src, x, *bits as usize)) * 3;
                px.copy_from_slice(&palette[index..index + 3]);
            }
        }
        Layout::Bgr24 => {
            for (px, bgr) in dst.chunks_exact_mut(3).zip(src.chunks_exact(3)) {
                px.copy_from_slice(&[bgr[2], bgr[1], bgr[0]]);
            }
        }
        Layout::Masked { bytes, masks } => {
            for (px, raw) in dst.chunks_exact_mut(3).zip(src.chunks_exact(*bytes)) {
                let value = raw
                    .iter()
                    .rev()
                    .fold(0u32, |acc, &b| (acc << 8) | u32::from(b));
                for (channel, &mask) in px.iter_mut().zip(masks) {
                    *channel = scale_field(value, mask);
                }
            }
        }
    }
}

/// PIL's `BmpRleDecoder`: one palette index per pixel, rows in file order. Runs are clipped
/// to the row, escapes are end of line (zero-fill to the row end), end of bitmap, delta
/// (zero-fill) and absolute runs (word-aligned in the file). Data that ends before every pixel
/// is set is an error, as in PIL.
fn expand_rle(
    encoded: &[u8],
    file_offset: usize,
    width: u32,
    height: u32,
    four_bit: bool,
) -> Result<Vec<u8>, DecodeError> {
    let xsize = width as usize;
    let total = buffer_len(width, height, 1)?;
    let mut out = Vec::new();
    out.try_reserve_exact(total)
        .map_err(|_| DecodeError::OutOfMemory { bytes: total })?;
    let (mut at, mut x) = (0usize, 0usize);
    while out.len() < total {
        let (Some(&count), Some(&value)) = (encoded.get(at), encoded.get(at + 1)) else {
            break;
        };
        at += 2;
        if count > 0 {
            let n = usize::from(count).min(xsize.saturating_sub(x));
            let (hi, lo) = if four_bit {
                (value >> 4, value & 0x0F)
            } else {
                (value, value)
            };
            out.extend((0..n).map(|i| if i % 2 == 0 { hi } else { lo }));
            x += n;
            continue;
        }
        match value {
            0 => {
                let pad = (xsize - out.len() % xsize) % xsize;
                out.resize(out.len() + pad, 0);
                x = 0;
            }
            1 => break,
            2 => {
                let (Some(&right), Some(&up)) = (encoded.get(at), encoded.get(at + 1)) else {
                    break;
                };
                at += 2;
                let skip = (usize::from(right) + usize::from(up) * xsize).min(total - out.len());
                out.resize(out.len() + skip, 0);
                x = out.len() % xsize;
            }
            n => {
                let wanted = usize::from(n).min(total - out.len());
                let byte_count = if four_bit { wanted.div_ceil(2) } else { wanted };
                let run = encoded
                    .get(at..(at + byte_count).min(encoded.len()))
                    .unwrap_or(&[]);
                at += run.len();
                if four_bit {
                    for (i, &b) in run.iter().enumerate() {
                        out.push(b >> 4);
                        if i * 2 + 1 < wanted {
                            out.push(b & 0x0F);
                        }
                    }
                } else {
                    out.extend_from_slice(run);
                }
                if run.len() < byte_count || out.len() == total {
                    break;
                }
                x += usize::from(n);
                if !(file_offset + at).is_multiple_of(2) {
                    at += 1;
                }
            }
        }
    }
    if out.len() < total {
        return Err(corrupt("RLE data ends before the last pixel"));
    }
    out.truncate(total);
    Ok(out)
}

fn is_contiguous(mask: u32) -> bool {
    let shifted = mask >> mask.trailing_zeros();
    shifted & (shifted + 1) == 0
}

/// A bit field scaled to 0..=255 with integer division, as PIL's unpackers do.
fn scale_field(value: u32, mask: u32) -> u8 {
    let shift = mask.trailing_zeros();
    let max = u64::from(mask >> shift);
    let field = u64::from((value & mask) >> shift);
    (field * 255 / max) as u8
}
