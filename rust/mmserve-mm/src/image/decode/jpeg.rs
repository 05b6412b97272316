//! JPEG through the system libjpeg-turbo (TurboJPEG API), at PIL's settings: accurate integer
//! IDCT and fancy upsampling (the library defaults, which PIL keeps). PIL's bundled
//! libjpeg-turbo 3.x and Debian's 2.1 produce the same 8-bit output for these settings.
//!
//! CMYK and YCCK images come out of the library as stored (Adobe's inverted polarity), and go
//! through PIL's `CMYK;I` unpacking and `cmyk2rgb` conversion.

use std::ffi::CStr;
use std::os::raw::{c_char, c_int, c_uchar, c_ulong, c_void};

use super::exif::Orientation;
use super::{alloc_zeroed, buffer_len, check_dimensions, DecodeError, DecodeLimits, ImageFormat};
use crate::pipeline::DecodedImage;

const FORMAT: ImageFormat = ImageFormat::Jpeg;

// turbojpeg.h (stable across libjpeg-turbo 2.x and 3.x).
const TJPF_RGB: c_int = 0;
const TJPF_CMYK: c_int = 11;
const TJCS_CMYK: c_int = 3;
const TJCS_YCCK: c_int = 4;
const TJERR_WARNING: c_int = 0;
/// Refuses progressive images with an unreasonable number of scans (a CPU exhaustion vector).
const TJFLAG_LIMITSCANS: c_int = 32768;
/// libjpeg's JWRN_JPEG_EOF: the data ended early. PIL reports such files as truncated.
const TRUNCATED_WARNING: &str = "Premature end of JPEG file";

#[link(name = "turbojpeg")]
extern "C" {
    fn tjInitDecompress() -> *mut c_void;
    fn tjDestroy(handle: *mut c_void) -> c_int;
    fn tjDecompressHeader3(
        handle: *mut c_void,
        jpeg_buf: *const c_uchar,
        jpeg_size: c_ulong,
        width: *mut c_int,
        height: *mut c_int,
        jpeg_subsamp: *mut c_int,
        jpeg_colorspace: *mut c_int,
    ) -> c_int;
    fn tjDecompress2(
        handle: *mut c_void,
        jpeg_buf: *const c_uchar,
        jpeg_size: c_ulong,
        dst_buf: *mut c_uchar,
        width: c_int,
        pitch: c_int,
        height: c_int,
        pixel_format: c_int,
        flags: c_int,
    ) -> c_int;
    fn tjGetErrorStr2(handle: *mut c_void) -> *mut c_char;
    fn tjGetErrorCode(handle: *mut c_void) -> c_int;
}

/// One decompressor instance, destroyed on drop.
struct Decompressor(*mut c_void);

impl Decompressor {
    fn new() -> Result<Self, DecodeError> {
        // SAFETY: no arguments; a null return is handled.
        let handle = unsafe { tjInitDecompress() };
        if handle.is_null() {
            return Err(DecodeError::unsupported(
                FORMAT,
                "cannot initialise libjpeg-turbo",
            ));
        }
        Ok(Self(handle))
    }

    fn last_error(&self) -> (bool, String) {
        // SAFETY: the handle is valid; the library returns a NUL-terminated static or
        // handle-owned string that we copy before the next call.
        unsafe {
            let fatal = tjGetErrorCode(self.0) != TJERR_WARNING;
            let msg = tjGetErrorStr2(self.0);
            let text = if msg.is_null() {
                String::from("unknown error")
            } else {
                CStr::from_ptr(msg).to_string_lossy().into_owned()
            };
            (fatal, text)
        }
    }
}

impl Drop for Decompressor {
    fn drop(&mut self) {
        // SAFETY: the handle came from tjInitDecompress and is destroyed once.
        unsafe { tjDestroy(self.0) };
    }
}

/// The frame header's facts: size and colour space.
struct FrameHeader {
    width: u32,
    height: u32,
    colorspace: c_int,
}

/// Reads and checks the frame header (precision, size, pixel limit) without decoding.
fn read_header(
    tj: &Decompressor,
    bytes: &[u8],
    limits: &DecodeLimits,
) -> Result<FrameHeader, DecodeError> {
    let size = c_ulong::try_from(bytes.len())
        .map_err(|_| DecodeError::corrupt(FORMAT, "file too large"))?;
    if let Some(bits) = sample_precision(bytes).filter(|&bits| bits > 8) {
        return Err(DecodeError::UnsupportedBitDepth {
            format: FORMAT.name(),
            bits: u32::from(bits),
        });
    }
    let (mut width, mut height, mut subsamp, mut colorspace) = (0, 0, 0, 0);
    // SAFETY: `bytes` is valid for `size` bytes; the out-pointers point at live locals.
    let rc = unsafe {
        tjDecompressHeader3(
            tj.0,
            bytes.as_ptr(),
            size,
            &mut width,
            &mut height,
            &mut subsamp,
            &mut colorspace,
        )
    };
    if rc != 0 {
        return Err(DecodeError::corrupt(FORMAT, tj.last_error().1));
    }
    let (width, height) = match (u32::try_from(width), u32::try_from(height)) {
        (Ok(w), Ok(h)) if w > 0 && h > 0 => (w, h),
        _ => return Err(DecodeError::corrupt(FORMAT, "no frame header")),
    };
    check_dimensions(FORMAT, width, height, limits)?;
    Ok(FrameHeader {
        width,
        height,
        colorspace,
    })
}

/// Stored size and orientation, from the marker segments before the first scan.
pub(super) fn probe(
    bytes: &[u8],
    limits: &DecodeLimits,
) -> Result<(u32, u32, Orientation), DecodeError> {
    let header = read_header(&Decompressor::new()?, bytes, limits)?;
    Ok((header.width, header.height, orientation(bytes)))
}

pub(super) fn decode(
    bytes: &[u8],
    limits: &DecodeLimits,
) -> Result<(DecodedImage, Orientation), DecodeError> {
    let tj = Decompressor::new()?;
    let FrameHeader {
        width,
        height,
        colorspace,
    } = read_header(&tj, bytes, limits)?;
    // Checked by `read_header`.
    let size = bytes.len() as c_ulong;
    let cmyk = colorspace == TJCS_CMYK || colorspace == TJCS_YCCK;
    let channels = if cmyk { 4 } else { 3 };
    let mut data = alloc_zeroed(buffer_len(width, height, channels)?)?;
    // SAFETY: `data` holds width * height * channels bytes, which is what a pitch of 0
    // (tightly packed) and this pixel format require.
    let rc = unsafe {
        tjDecompress2(
            tj.0,
            bytes.as_ptr(),
            size,
            data.as_mut_ptr(),
            width as c_int,
            0,
            height as c_int,
            if cmyk { TJPF_CMYK } else { TJPF_RGB },
            TJFLAG_LIMITSCANS,
        )
    };
    if rc != 0 {
        let (fatal, message) = tj.last_error();
        // Other warnings (e.g. extraneous bytes before a marker) leave a complete image, which
        // PIL accepts too.
        if fatal || message.contains(TRUNCATED_WARNING) {
            return Err(DecodeError::corrupt(FORMAT, message));
        }
    }
    if cmyk {
        inverted_cmyk_to_rgb_in_place(&mut data);
    }
    let image = DecodedImage {
        width,
        height,
        data,
    };
    Ok((image, orientation(bytes)))
}

fn orientation(bytes: &[u8]) -> Orientation {
    let (exif, xmp) = app1_metadata(bytes);
    Orientation::from_metadata(exif, xmp)
}

/// PIL: `CMYK;I` unpacking (255 - stored), then `cmyk2rgb`:
/// channel = clip(nk - nk * c / 255) with nk = 255 - k, in PIL's MULDIV255 rounding.
fn inverted_cmyk_to_rgb_in_place(data: &mut Vec<u8>) {
    let pixels = data.len() / 4;
    for i in 0..pixels {
        let px = &data[i * 4..i * 4 + 4];
        let nk = i32::from(px[3]); // 255 - (255 - stored k)
        let rgb = [px[0], px[1], px[2]].map(|stored| {
            let c = 255 - i32::from(stored);
            let t = c * nk + 128;
            (nk - (((t >> 8) + t) >> 8)).clamp(0, 255) as u8
        });
        data[i * 3..i * 3 + 3].copy_from_slice(&rgb);
    }
    data.truncate(pixels * 3);
    data.shrink_to_fit();
}

/// The marker segments before the first scan: `(marker, payload)`.
fn header_segments(bytes: &[u8]) -> impl Iterator<Item = (u8, &[u8])> {
    let mut at = 2; // after SOI
    std::iter::from_fn(move || loop {
        if at + 4 > bytes.len() || bytes[at] != 0xFF {
            return None;
        }
        let marker = bytes[at + 1];
        if marker == 0xFF {
            at += 1; // fill byte
            continue;
        }
        if marker == 0xDA || marker == 0xD9 {
            return None; // start of scan / end of image
        }
        let len = usize::from(u16::from_be_bytes([bytes[at + 2], bytes[at + 3]]));
        let payload = bytes.get(at + 4..at + 2 + len).filter(|_| len >= 2)?;
        at += 2 + len;
        return Some((marker, payload));
    })
}

/// The sample precision of the frame header (SOF0..SOF15, except DHT, JPG and DAC).
fn sample_precision(bytes: &[u8]) -> Option<u8> {
    header_segments(bytes)
        .find(|&(marker, _)| {
            (0xC0..=0xCF).contains(&marker) && ![0xC4, 0xC8, 0xCC].contains(&marker)
        })
        .and_then(|(_, payload)| payload.first().copied())
}

/// The first APP1 `Exif` payload and the first APP1 XMP packet, as PIL keeps them.
fn app1_metadata(bytes: &[u8]) -> (Option<&[u8]>, Option<&[u8]>) {
    const XMP_ID: &[u8] = b"http://ns.adobe.com/xap/1.0/\0";
    let (mut exif, mut xmp) = (None, None);
    for (_, payload) in header_segments(bytes).filter(|&(marker, _)| marker == 0xE1) {
        if exif.is_none() && payload.starts_with(b"Exif\0\0") {
            exif = Some(payload);
        } else if xmp.is_none() && payload.starts_with(XMP_ID) {
            xmp = Some(&payload[XMP_ID.len()..]);
        }
    }
    (exif, xmp)
}
