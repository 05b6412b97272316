//! The stream's display matrix as quarter turns, and each decoded frame turned by it.

use ff::ffi;
use ffmpeg_next as ff;

use crate::image::decode::exif::{self, Orientation};
use crate::pipeline::DecodedImage;
use crate::video::error::VideoError;

/// The stream's display matrix as quarter turns counter-clockwise, in degrees: what
/// torchcodec reads (`av_display_rotation_get`, rounded to the nearest multiple of 90) and
/// turns each frame by; 0 without one.
pub(super) fn display_rotation(stream: &ff::format::stream::Stream<'_>) -> u32 {
    let mut size = 0usize;
    // SAFETY: the stream is live; the side data, when present, is `size` bytes it owns.
    let degrees = unsafe {
        let matrix = ffi::av_stream_get_side_data(
            stream.as_ptr(),
            ffi::AVPacketSideDataType::AV_PKT_DATA_DISPLAYMATRIX,
            &mut size,
        );
        if matrix.is_null() || size < 9 * std::mem::size_of::<i32>() {
            return 0;
        }
        ffi::av_display_rotation_get(matrix as *const i32)
    };
    if !degrees.is_finite() {
        return 0;
    }
    ((degrees / 90.0).round() as i64).rem_euclid(4) as u32 * 90
}

/// A decoded frame turned by the stream's rotation (exact: pixels are only moved).
pub(super) fn rotate(frame: DecodedImage, rotation: u32) -> Result<DecodedImage, VideoError> {
    let orientation = match rotation {
        90 => Orientation::Rotate90,
        180 => Orientation::Rotate180,
        270 => Orientation::Rotate270,
        _ => return Ok(frame),
    };
    exif::apply(frame, orientation).map_err(|e| VideoError::Corrupt(e.to_string()))
}
