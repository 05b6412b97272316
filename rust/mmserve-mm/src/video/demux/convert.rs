//! Decoded frames as packed RGB8: the pixel formats taken, and swscale's conversion with
//! the frame's own matrix and range.

use std::ffi::{c_int, CStr};
use std::ptr;

use ff::ffi;
use ffmpeg_next as ff;

use super::error::ff_error;
use crate::pipeline::DecodedImage;
use crate::video::error::VideoError;

pub(super) fn pixel_format_name(format: c_int) -> String {
    // Walks libavutil's descriptor table: a header's raw value is never cast to the enum.
    let mut desc: *const ffi::AVPixFmtDescriptor = ptr::null();
    loop {
        // SAFETY: av_pix_fmt_desc_next takes null or a previous result; descriptors and
        // their names are static.
        unsafe {
            desc = ffi::av_pix_fmt_desc_next(desc);
            if desc.is_null() {
                return format!("pixel format {format}");
            }
            if ffi::av_pix_fmt_desc_get_id(desc) as c_int == format {
                return CStr::from_ptr((*desc).name).to_string_lossy().into_owned();
            }
        }
    }
}

/// 8-bit YUV only: deeper samples would be rounded to 8 bits, which no reference pins down.
pub(super) fn check_pixel_format(format: c_int, name: &str) -> Result<(), VideoError> {
    use ffi::AVPixelFormat::*;
    let allowed = [
        AV_PIX_FMT_YUV420P,
        AV_PIX_FMT_YUVJ420P,
        AV_PIX_FMT_YUV422P,
        AV_PIX_FMT_YUVJ422P,
        AV_PIX_FMT_YUV444P,
        AV_PIX_FMT_YUVJ444P,
        AV_PIX_FMT_NV12,
    ];
    if allowed.iter().any(|&f| f as c_int == format) {
        Ok(())
    } else {
        Err(VideoError::UnsupportedPixelFormat(name.to_owned()))
    }
}

/// One decoded frame as packed RGB8, through a scaler kept for the stream.
pub(super) fn to_rgb(
    frame: &ff::frame::Video,
    scaler: &mut Option<ff::software::scaling::Context>,
) -> Result<DecodedImage, VideoError> {
    let format = frame.format();
    let raw = ffi::AVPixelFormat::from(format) as c_int;
    check_pixel_format(raw, &pixel_format_name(raw))?;
    let (width, height) = (frame.width(), frame.height());
    let stale = scaler.as_ref().is_none_or(|s| {
        let input = s.input();
        (input.format, input.width, input.height) != (format, width, height)
    });
    if stale {
        let mut context = ff::software::scaling::Context::get(
            format,
            width,
            height,
            ff::format::Pixel::RGB24,
            width,
            height,
            ff::software::scaling::Flags::BILINEAR,
        )
        .map_err(ff_error("setting up the RGB conversion"))?;
        set_colorspace(&mut context, frame);
        *scaler = Some(context);
    }
    let Some(context) = scaler.as_mut() else {
        return Err(VideoError::Corrupt("no scaler".into()));
    };
    let mut rgb = ff::frame::Video::empty();
    context
        .run(frame, &mut rgb)
        .map_err(ff_error("converting to RGB"))?;
    let row = width as usize * 3;
    let stride = rgb.stride(0);
    let plane = rgb.data(0);
    let mut data = Vec::with_capacity(row * height as usize);
    for y in 0..height as usize {
        let Some(line) = plane.get(y * stride..y * stride + row) else {
            return Err(VideoError::Corrupt("short RGB plane".into()));
        };
        data.extend_from_slice(line);
    }
    Ok(DecodedImage {
        width,
        height,
        data,
    })
}

/// The frame's YUV matrix and range for the conversion (BT.601 when unspecified).
fn set_colorspace(context: &mut ff::software::scaling::Context, frame: &ff::frame::Video) {
    use ff::format::Pixel;
    let full = frame.color_range() == ff::util::color::Range::JPEG
        || matches!(
            frame.format(),
            Pixel::YUVJ420P | Pixel::YUVJ422P | Pixel::YUVJ444P
        );
    // SAFETY: the scaler is live; sws_getCoefficients takes any colorspace value and
    // returns a static table.
    unsafe {
        let space = (*frame.as_ptr()).colorspace as c_int;
        let src = ffi::sws_getCoefficients(space);
        let dst = ffi::sws_getCoefficients(ffi::SWS_CS_DEFAULT as c_int);
        ffi::sws_setColorspaceDetails(
            context.as_mut_ptr(),
            src,
            c_int::from(full),
            dst,
            0,
            0,
            1 << 16,
            1 << 16,
        );
    }
}
