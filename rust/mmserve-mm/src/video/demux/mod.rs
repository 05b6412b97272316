//! Demux and decode with FFmpeg's libraries (libavformat, libavcodec, libswscale), from
//! bytes in memory.
//!
//! Only the mov/mp4 and matroska/webm demuxers ever see the data (the container is named by
//! probing the first bytes first, then opened with that demuxer alone), and only H.264,
//! HEVC, VP8, VP9, AV1 and MPEG-4 streams in 8-bit YUV are decoded (the pixel format is
//! checked from the headers where the container names it, else on the first decoded
//! frame, before any conversion). Frame count, rate and size come from the headers (a
//! stream without a frame count has its packets counted, which reads but does not decode
//! them; MPEG-4 Part 2 in mp4, whose size mov leaves to the decoder, has its VOL header
//! parsed by libavcodec's parser), and every cap is checked before the first frame is
//! decoded. Decoders run single-threaded; a deadline reaches FFmpeg through its interrupt
//! callback.
//!
//! Decoding does only what the sampled frames need: one pass over the packets (no
//! decoding) gives the stream's [`Timeline`]; decoding reads past the packets before the
//! last clean start of each sampled frame without decoding them, and asks the decoder to
//! drop non-reference frames that are not sampled. Frames are told apart by presentation
//! timestamp. Where the timestamps cannot tell them apart, or the decoder shows a frame the
//! timeline did not expect, it decodes every frame from the top instead, counting them in
//! output order.
//!
//! Frames are converted to RGB24 by swscale with bilinear flags and the frame's own matrix
//! and range (BT.601 when unspecified), then turned by the stream's display matrix in
//! quarter turns, as torchcodec's CPU path does.

mod convert;
mod decode;
mod error;
mod info;
mod input;
mod rotation;
mod scan;

use std::time::Instant;

use crate::pipeline::DecodedImage;
use crate::video::error::VideoError;
use crate::video::sampling::VideoMeta;
use crate::video::timeline::Timeline;
use input::Demuxer;

/// Limits checked from the headers before anything is decoded.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VideoLimits {
    pub max_duration_s: f64,
    pub max_frames: u64,
    pub max_pixels: u64,
    pub max_streams: usize,
    /// Opening, counting and decoding stop with [`VideoError::Deadline`] after this.
    pub deadline: Option<Instant>,
}

impl Default for VideoLimits {
    fn default() -> Self {
        VideoLimits {
            max_duration_s: 3600.0,
            max_frames: 216_000,
            max_pixels: 8192 * 8192,
            max_streams: 16,
            deadline: None,
        }
    }
}

/// What the headers say about the video stream.
#[derive(Debug, Clone, PartialEq)]
pub struct VideoInfo {
    /// The frames' size as returned: after `rotation`.
    pub width: u32,
    pub height: u32,
    /// Degrees counter-clockwise (0, 90, 180 or 270) each decoded frame is turned by: the
    /// stream's display matrix, rounded to quarter turns as torchcodec applies it.
    pub rotation: u32,
    pub total_frames: u64,
    pub fps: f64,
    pub duration_s: f64,
    /// libavcodec's codec name, e.g. `h264`.
    pub codec: String,
    /// libavformat's demuxer name, e.g. `matroska,webm`.
    pub container: String,
    pub pixel_format: String,
}

impl VideoInfo {
    /// The decoder's frame size, before the rotation.
    fn decoded_size(&self) -> (u32, u32) {
        if self.rotation % 180 == 90 {
            (self.height, self.width)
        } else {
            (self.width, self.height)
        }
    }

    pub fn meta(&self) -> VideoMeta {
        VideoMeta {
            total_frames: self.total_frames,
            fps: self.fps,
        }
    }
}

/// Reads the headers (and, without a frame count in them, the packets) of `data`.
pub fn probe_video(data: &[u8], limits: &VideoLimits) -> Result<VideoInfo, VideoError> {
    let mut demuxer = Demuxer::open(data, limits)?;
    demuxer.info(limits)
}

/// Decodes the frames at `indices` (ascending, repeats allowed) as RGB8 images.
pub fn decode_frames(
    data: &[u8],
    indices: &[u64],
    limits: &VideoLimits,
) -> Result<(VideoInfo, Vec<DecodedImage>), VideoError> {
    let mut frames = Vec::with_capacity(indices.len());
    let info = decode_frames_with(data, indices, limits, |frame| {
        frames.push(frame.clone());
        Ok(())
    })?;
    Ok((info, frames))
}

/// [`decode_frames`] handing each frame to `on_frame` (once per occurrence in `indices`) as
/// it is decoded, so no more than one full-size frame need be held at a time.
pub fn decode_frames_with(
    data: &[u8],
    indices: &[u64],
    limits: &VideoLimits,
    on_frame: impl FnMut(&DecodedImage) -> Result<(), VideoError>,
) -> Result<VideoInfo, VideoError> {
    let mut on_frame = on_frame;
    if indices.windows(2).any(|w| w[0] > w[1]) {
        return Err(VideoError::Corrupt(
            "frame indices are not ascending".into(),
        ));
    }
    let mut demuxer = Demuxer::open(data, limits)?;
    let info = demuxer.info(limits)?;
    if indices.is_empty() {
        return Ok(info);
    }
    let scan = match demuxer.scanned.take() {
        Some(scan) => scan,
        None => demuxer.scan_packets(limits)?,
    };
    // The scan read the packets; start again from the top.
    demuxer = demuxer.reopen(limits)?;
    let mut done = 0;
    if let Some(timeline) = scan.packets.as_deref().and_then(Timeline::new) {
        done = demuxer.decode_sampled(&info, indices, &timeline, limits, &mut on_frame)?;
        if done < indices.len() {
            demuxer = demuxer.reopen(limits)?;
        }
    }
    if done < indices.len() {
        demuxer.decode_all(&info, &indices[done..], limits, &mut on_frame)?;
    }
    Ok(info)
}
