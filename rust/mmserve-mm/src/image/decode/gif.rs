//! GIF, first frame only, as PIL composes it: the canvas is the logical screen (grown to hold
//! the frame if the frame overhangs it), filled with the transparent index when the frame has
//! one and with index 0 otherwise, then looked up in the frame's palette (else the global one;
//! a file with no color table at all is grayscale, index = level, as PIL's `L` mode reads it).
//! The transparent index's colour is PIL's `info["transparency"]`, which transformers' pipeline
//! paints white wherever it appears.

use std::io::Cursor;

use gif::{ColorOutput, DecodeOptions, MemoryLimit};

use super::{
    alloc_zeroed, buffer_len, check_dimensions, paint_white, pil_palette_gray_ramp_as_l,
    rgb_entries, DecodeError, DecodeLimits, ImageFormat,
};
use crate::pipeline::DecodedImage;

const FORMAT: ImageFormat = ImageFormat::Gif;

/// Logical screen descriptor: flags byte, and its "global color table present" bit.
const SCREEN_FLAGS_AT: usize = 10;
const HEADER_LEN: usize = 13;
const HAS_GLOBAL_TABLE: u8 = 0x80;
/// Global table present, 256 entries.
const FULL_GLOBAL_TABLE: u8 = 0x87;

pub(super) fn decode(bytes: &[u8], limits: &DecodeLimits) -> Result<DecodedImage, DecodeError> {
    with_global_table(bytes, |bytes| decode_with_table(bytes, limits))
}

/// The canvas size, from the screen descriptor and the first frame's descriptor.
pub(super) fn probe(bytes: &[u8], limits: &DecodeLimits) -> Result<(u32, u32), DecodeError> {
    with_global_table(bytes, |bytes| {
        let mut decoder = reader(bytes)?;
        let screen = (decoder.width(), decoder.height());
        let frame = first_frame(&mut decoder)?;
        let (width, height) = canvas_size(screen, frame);
        check_dimensions(FORMAT, width, height, limits)?;
        Ok((width, height))
    })
}

/// Runs `read` over the file, given the gray global table PIL assumes where it has none (the
/// decoder refuses a frame without any table).
fn with_global_table<T>(bytes: &[u8], read: impl FnOnce(&[u8]) -> T) -> T {
    match bytes.get(SCREEN_FLAGS_AT) {
        Some(&flags) if flags & HAS_GLOBAL_TABLE == 0 => {
            read(&with_gray_global_table(bytes, flags))
        }
        _ => read(bytes),
    }
}

/// A copy of `bytes` with a gray-ramp global color table (a frame's local table still wins),
/// so that a file without any table decodes as PIL's grayscale reading of it.
fn with_gray_global_table(bytes: &[u8], flags: u8) -> Vec<u8> {
    let mut patched = Vec::with_capacity(bytes.len() + 768);
    patched.extend_from_slice(&bytes[..SCREEN_FLAGS_AT]);
    patched.push(flags | FULL_GLOBAL_TABLE);
    patched.extend_from_slice(&bytes[SCREEN_FLAGS_AT + 1..HEADER_LEN.min(bytes.len())]);
    patched.extend((0..=255u8).flat_map(|i| [i, i, i]));
    patched.extend_from_slice(bytes.get(HEADER_LEN..).unwrap_or(&[]));
    patched
}

fn corrupt(e: gif::DecodingError) -> DecodeError {
    DecodeError::corrupt(FORMAT, e)
}

fn reader(bytes: &[u8]) -> Result<gif::Decoder<Cursor<&[u8]>>, DecodeError> {
    let mut options = DecodeOptions::new();
    options.set_color_output(ColorOutput::Indexed);
    // Frame sizes are checked against the limits before any frame buffer exists.
    options.set_memory_limit(MemoryLimit::Unlimited);
    options.read_info(Cursor::new(bytes)).map_err(corrupt)
}

/// The canvas PIL shows for the first frame: the logical screen, grown to hold the frame.
fn canvas_size(screen: (u16, u16), frame: &gif::Frame<'_>) -> (u32, u32) {
    let width = u32::from(screen.0).max(u32::from(frame.left) + u32::from(frame.width));
    let height = u32::from(screen.1).max(u32::from(frame.top) + u32::from(frame.height));
    (width, height)
}

fn first_frame<'d>(
    decoder: &'d mut gif::Decoder<Cursor<&[u8]>>,
) -> Result<&'d gif::Frame<'static>, DecodeError> {
    decoder
        .next_frame_info()
        .map_err(corrupt)?
        .ok_or_else(|| DecodeError::corrupt(FORMAT, "no image frame"))
}

fn decode_with_table(bytes: &[u8], limits: &DecodeLimits) -> Result<DecodedImage, DecodeError> {
    let mut decoder = reader(bytes)?;
    let screen = (decoder.width(), decoder.height());
    let global = decoder.global_palette().map(<[u8]>::to_vec);
    let frame = first_frame(&mut decoder)?;
    let (left, top) = (u32::from(frame.left), u32::from(frame.top));
    let (frame_w, frame_h) = (u32::from(frame.width), u32::from(frame.height));
    let (width, height) = canvas_size(screen, frame);
    check_dimensions(FORMAT, width, height, limits)?;
    let transparent = frame.transparent;
    let palette = pil_palette_gray_ramp_as_l(rgb_entries(
        frame
            .palette
            .as_deref()
            .or(global.as_deref())
            .unwrap_or(&[]),
    ));
    let mut indices = alloc_zeroed(buffer_len(frame_w, frame_h, 1)?)?;
    decoder.read_into_buffer(&mut indices).map_err(corrupt)?;

    let mut canvas = alloc_zeroed(buffer_len(width, height, 3)?)?;
    let fill = usize::from(transparent.unwrap_or(0)) * 3;
    for px in canvas.chunks_exact_mut(3) {
        px.copy_from_slice(&palette[fill..fill + 3]);
    }
    let (fw, stride) = (frame_w as usize, width as usize * 3);
    if fw > 0 {
        for (y, row) in indices.chunks_exact(fw).enumerate() {
            let start = (top as usize + y) * stride + left as usize * 3;
            let dst = &mut canvas[start..start + fw * 3];
            for (px, &index) in dst.chunks_exact_mut(3).zip(row) {
                let at = usize::from(index) * 3;
                px.copy_from_slice(&palette[at..at + 3]);
            }
        }
    }
    if let Some(index) = transparent {
        let at = usize::from(index) * 3;
        let color = [palette[at], palette[at + 1], palette[at + 2]];
        paint_white(&mut canvas, color);
    }
    Ok(DecodedImage {
        width,
        height,
        data: canvas,
    })
}
