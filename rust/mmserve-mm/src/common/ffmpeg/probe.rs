//! Naming the container from the data's first bytes, before any demuxer opens it.

use std::ffi::{c_int, CStr};
use std::ptr;

use ffmpeg_next::ffi;

/// Bytes the container is named from: the first 2 KiB, doubled up to 1 MiB while no demuxer
/// is sure (libavformat's `av_probe_input_buffer2` steps and scores).
const PROBE_MIN_BYTES: usize = 2048;
const PROBE_BYTES: usize = 1 << 20;
/// `AVPROBE_SCORE_RETRY`: below the full probe, a demuxer must score above it to be taken.
const PROBE_SCORE_RETRY: c_int = ffi::AVPROBE_SCORE_MAX / 4;

/// Why the data names no demuxer the caller takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeError {
    /// No demuxer recognises the data.
    Unknown,
    /// libavformat's demuxer for the data, which is not one of the caller's.
    NotAllowed(String),
}

/// A demuxer libavformat named from the data's first bytes (static, never freed).
#[derive(Debug, Clone, Copy)]
pub struct Format(pub(super) *const ffi::AVInputFormat);

// SAFETY: an AVInputFormat is a static, immutable table entry.
unsafe impl Send for Format {}
// SAFETY: as above.
unsafe impl Sync for Format {}

impl Format {
    /// libavformat's name of the demuxer, e.g. `matroska,webm`.
    pub fn name(&self) -> String {
        // SAFETY: a non-null AVInputFormat has a static NUL-terminated name.
        unsafe { CStr::from_ptr((*self.0).name) }
            .to_string_lossy()
            .into_owned()
    }
}

/// Names the container from the first bytes without opening a demuxer, as libavformat's
/// own probing does (`avformat_open_input` without a format): every demuxer's probe runs over
/// the head, so a short one that a demuxer is sure of spares reading the rest of the first
/// MiB. Only a demuxer named in `allowed` (libavformat's names) is returned.
pub fn probe_format(data: &[u8], allowed: &[&str]) -> Result<Format, ProbeError> {
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
        return Err(ProbeError::Unknown);
    }
    let format = Format(format);
    let name = format.name();
    if !allowed.contains(&name.as_str()) {
        return Err(ProbeError::NotAllowed(name));
    }
    Ok(format)
}
