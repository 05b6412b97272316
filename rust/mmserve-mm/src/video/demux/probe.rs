//! Naming the container from the data's first bytes, before any demuxer opens it.

use std::ffi::{c_int, CStr};
use std::ptr;

use ffmpeg_next::ffi;

use crate::video::error::VideoError;

/// Bytes the container is named from: the first 2 KiB, doubled up to 1 MiB while no demuxer
/// is sure (libavformat's `av_probe_input_buffer2` steps and scores).
const PROBE_MIN_BYTES: usize = 2048;
const PROBE_BYTES: usize = 1 << 20;
/// `AVPROBE_SCORE_RETRY`: below the full probe, a demuxer must score above it to be taken.
const PROBE_SCORE_RETRY: c_int = ffi::AVPROBE_SCORE_MAX / 4;
/// Demuxers that may open the data (libavformat's names).
const CONTAINERS: [&str; 2] = ["mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm"];

/// Names the container from the first bytes without opening a demuxer, as libavformat's
/// own probing does: every demuxer's probe runs over the head, so a short one that a demuxer
/// is sure of spares reading the rest of the first MiB.
pub(super) fn probe_container(data: &[u8]) -> Result<*const ffi::AVInputFormat, VideoError> {
    let mut size = PROBE_MIN_BYTES;
    let format = loop {
        let head = &data[..data.len().min(size)];
        let last = head.len() == data.len() || size >= PROBE_BYTES;
        let mut padded = Vec::with_capacity(head.len() + ffi::AVPROBE_PADDING_SIZE as usize);
        padded.extend_from_slice(head);
        padded.resize(head.len() + ffi::AVPROBE_PADDING_SIZE as usize, 0);
        let probe = ffi::AVProbeData {
            filename: c"".as_ptr(),
            buf: padded.as_mut_ptr(),
            buf_size: head.len() as c_int,
            mime_type: ptr::null(),
        };
        let mut score = if last { 0 } else { PROBE_SCORE_RETRY };
        // SAFETY: `probe` points at `head.len()` bytes plus the zero padding FFmpeg
        // requires; av_probe_input_format2 returns a demuxer scoring above `score` or null.
        let format = unsafe { ffi::av_probe_input_format2(&probe, 1, &mut score) };
        if !format.is_null() || last {
            break format;
        }
        size *= 2;
    };
    if format.is_null() {
        return Err(VideoError::UnknownContainer);
    }
    // SAFETY: a non-null AVInputFormat has a static NUL-terminated name.
    let name = unsafe { CStr::from_ptr((*format).name) }.to_string_lossy();
    if !CONTAINERS.contains(&name.as_ref()) {
        return Err(VideoError::UnsupportedContainer(name.into_owned()));
    }
    Ok(format)
}
