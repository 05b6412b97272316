//! EXIF orientation, read and applied the way `PIL.ImageOps.exif_transpose` does: the
//! Orientation tag of IFD0, else `tiff:Orientation` in the XMP packet.

use super::{alloc_zeroed, DecodeError};
use crate::pipeline::DecodedImage;

const ORIENTATION_TAG: u16 = 0x0112;

/// The eight EXIF orientations, named by the transpose that undoes them (PIL's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Orientation {
    Normal,
    FlipLeftRight,
    Rotate180,
    FlipTopBottom,
    Transpose,
    Rotate270,
    Transverse,
    Rotate90,
}

impl Orientation {
    fn from_tag(value: u32) -> Self {
        match value {
            2 => Orientation::FlipLeftRight,
            3 => Orientation::Rotate180,
            4 => Orientation::FlipTopBottom,
            5 => Orientation::Transpose,
            6 => Orientation::Rotate270,
            7 => Orientation::Transverse,
            8 => Orientation::Rotate90,
            _ => Orientation::Normal,
        }
    }

    /// Whether undoing it exchanges width and height.
    pub fn swaps_axes(self) -> bool {
        matches!(
            self,
            Orientation::Transpose
                | Orientation::Rotate270
                | Orientation::Transverse
                | Orientation::Rotate90
        )
    }

    /// From the EXIF payload (TIFF data, optionally prefixed with `Exif\0\0`) and the XMP
    /// packet; the XMP value counts only when EXIF has no Orientation tag, as in PIL.
    pub fn from_metadata(exif: Option<&[u8]>, xmp: Option<&[u8]>) -> Self {
        let tag = exif
            .and_then(exif_orientation)
            .or_else(|| xmp.and_then(xmp_orientation));
        tag.map_or(Orientation::Normal, Self::from_tag)
    }
}

/// The IFD0 Orientation value of a TIFF-structured EXIF block; `None` when absent or malformed.
fn exif_orientation(data: &[u8]) -> Option<u32> {
    let tiff = data.strip_prefix(b"Exif\0\0").unwrap_or(data);
    let big_endian = match tiff.get(..4)? {
        b"II*\0" => false,
        b"MM\0*" => true,
        _ => return None,
    };
    let u16_at = |at: usize| -> Option<u16> {
        let b: [u8; 2] = tiff.get(at..at + 2)?.try_into().ok()?;
        Some(if big_endian {
            u16::from_be_bytes(b)
        } else {
            u16::from_le_bytes(b)
        })
    };
    let u32_at = |at: usize| -> Option<u32> {
        let b: [u8; 4] = tiff.get(at..at + 4)?.try_into().ok()?;
        Some(if big_endian {
            u32::from_be_bytes(b)
        } else {
            u32::from_le_bytes(b)
        })
    };
    let ifd = u32_at(4)? as usize;
    let count = u16_at(ifd)? as usize;
    (0..count).find_map(|i| {
        let entry = ifd + 2 + i * 12;
        if u16_at(entry)? != ORIENTATION_TAG {
            return None;
        }
        match u16_at(entry + 2)? {
            3 => u16_at(entry + 8).map(u32::from), // SHORT
            4 => u32_at(entry + 8),                // LONG
            _ => None,
        }
    })
}

/// PIL's `tiff:Orientation(="|>)([0-9])` search over the XMP packet.
fn xmp_orientation(xmp: &[u8]) -> Option<u32> {
    const KEY: &[u8] = b"tiff:Orientation";
    let mut rest = xmp;
    while let Some(pos) = rest.windows(KEY.len()).position(|w| w == KEY) {
        let after = &rest[pos + KEY.len()..];
        let digit = match after {
            [b'=', b'"', d, ..] | [b'>', d, ..] if d.is_ascii_digit() => Some(u32::from(d - b'0')),
            _ => None,
        };
        if digit.is_some() {
            return digit;
        }
        rest = after;
    }
    None
}

/// Applies `orientation` to `image` (PIL's `Image.transpose` with the matching method).
pub fn apply(image: DecodedImage, orientation: Orientation) -> Result<DecodedImage, DecodeError> {
    if orientation == Orientation::Normal {
        return Ok(image);
    }
    let (w, h) = (image.width as usize, image.height as usize);
    let (out_w, out_h) = if orientation.swaps_axes() {
        (h, w)
    } else {
        (w, h)
    };
    let mut out = alloc_zeroed(image.data.len())?;
    let src = &image.data;
    for (y, row) in out.chunks_exact_mut(out_w * 3).enumerate() {
        for (x, px) in row.chunks_exact_mut(3).enumerate() {
            let (sx, sy) = match orientation {
                Orientation::Normal => (x, y),
                Orientation::FlipLeftRight => (w - 1 - x, y),
                Orientation::Rotate180 => (w - 1 - x, h - 1 - y),
                Orientation::FlipTopBottom => (x, h - 1 - y),
                Orientation::Transpose => (y, x),
                Orientation::Rotate270 => (y, h - 1 - x),
                Orientation::Transverse => (w - 1 - y, h - 1 - x),
                Orientation::Rotate90 => (w - 1 - y, x),
            };
            let at = (sy * w + sx) * 3;
            px.copy_from_slice(&src[at..at + 3]);
        }
    }
    Ok(DecodedImage {
        width: out_w as u32,
        height: out_h as u32,
        data: out,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiff_with_orientation(big_endian: bool, value: u16) -> Vec<u8> {
        let mut t = Vec::new();
        let w16 = |t: &mut Vec<u8>, v: u16| {
            t.extend(if big_endian {
                v.to_be_bytes()
            } else {
                v.to_le_bytes()
            })
        };
        let w32 = |t: &mut Vec<u8>, v: u32| {
            t.extend(if big_endian {
                v.to_be_bytes()
            } else {
                v.to_le_bytes()
            })
        };
        t.extend(if big_endian { b"MM\0*" } else { b"II*\0" });
        w32(&mut t, 8);
        w16(&mut t, 1);
        w16(&mut t, ORIENTATION_TAG);
        w16(&mut t, 3);
        w32(&mut t, 1);
        w16(&mut t, value);
        w16(&mut t, 0);
        w32(&mut t, 0);
        t
    }

    #[test]
    fn reads_orientation_from_both_byte_orders_and_xmp() {
        for big_endian in [false, true] {
            let tiff = tiff_with_orientation(big_endian, 6);
            assert_eq!(
                Orientation::from_metadata(Some(&tiff), None),
                Orientation::Rotate270
            );
        }
        let xmp = br#"<x:xmpmeta><rdf:Description tiff:Orientation="8"/></x:xmpmeta>"#;
        assert_eq!(
            Orientation::from_metadata(None, Some(xmp)),
            Orientation::Rotate90
        );
        let xmp = b"<tiff:Orientation>3</tiff:Orientation>";
        assert_eq!(
            Orientation::from_metadata(None, Some(xmp)),
            Orientation::Rotate180
        );
        // EXIF wins over XMP; garbage is ignored.
        let tiff = tiff_with_orientation(false, 1);
        assert_eq!(
            Orientation::from_metadata(Some(&tiff), Some(xmp)),
            Orientation::Normal
        );
        assert_eq!(
            Orientation::from_metadata(Some(b"II*\0\xff\xff"), None),
            Orientation::Normal
        );
    }

    #[test]
    fn rotate_and_flip_2x1() {
        let img = DecodedImage {
            width: 2,
            height: 1,
            data: vec![1, 1, 1, 2, 2, 2],
        };
        let r = apply(img.clone(), Orientation::Rotate90).unwrap();
        assert_eq!((r.width, r.height, r.data), (1, 2, vec![2, 2, 2, 1, 1, 1]));
        let r = apply(img.clone(), Orientation::Rotate270).unwrap();
        assert_eq!((r.width, r.height, r.data), (1, 2, vec![1, 1, 1, 2, 2, 2]));
        let r = apply(img, Orientation::FlipLeftRight).unwrap();
        assert_eq!(r.data, vec![2, 2, 2, 1, 1, 1]);
    }
}
