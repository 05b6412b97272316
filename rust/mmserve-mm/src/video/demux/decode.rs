//! Decoding the sampled frames: by the timeline where it holds, else every frame from the
//! top.

use ffmpeg_next as ff;

use super::convert::to_rgb;
use super::error::ff_error;
use super::input::Demuxer;
use super::rotation::rotate;
use super::scan::is_discarded;
use super::{VideoInfo, VideoLimits};
use crate::common::ffmpeg::single_threaded_context;
use crate::pipeline::DecodedImage;
use crate::video::error::VideoError;
use crate::video::timeline::Timeline;

impl Demuxer<'_> {
    /// The video stream: its index and a decoder for it, FFmpeg's own threads off.
    fn video_decoder(&self) -> Result<(usize, ff::decoder::Video), VideoError> {
        let stream = self
            .input
            .streams()
            .best(ff::media::Type::Video)
            .ok_or(VideoError::NoVideoStream)?;
        let decoder = single_threaded_context(&stream)?
            .decoder()
            .video()
            .map_err(ff_error("opening the decoder"))?;
        Ok((stream.index(), decoder))
    }

    /// Decodes the frames at `indices` by the timeline: reading past the packets no sampled
    /// frame needs without decoding them, and dropping unsampled non-reference frames.
    /// Returns how many entries of `indices` were handed to `on_frame`; fewer than all means
    /// the decoder did not show the frames the timeline expected, and the rest must be
    /// decoded from the top.
    pub(super) fn decode_sampled(
        &mut self,
        info: &VideoInfo,
        indices: &[u64],
        timeline: &Timeline,
        limits: &VideoLimits,
        on_frame: &mut impl FnMut(&DecodedImage) -> Result<(), VideoError>,
    ) -> Result<usize, VideoError> {
        let (index, mut decoder) = self.video_decoder()?;
        let mut done = 0;
        // Decode-order position of the next packet.
        let mut position = 0usize;
        // Packets before this clean start are read but not decoded. Reading is cheap next to
        // decoding, and unlike a seek it cannot land elsewhere than asked (mov's index, for
        // one, is keyed by timestamps its edit list has shifted).
        let mut decode_from = 0usize;
        let mut frame = ff::frame::Video::empty();
        let mut scaler: Option<ff::software::scaling::Context> = None;
        let mut flushed = false;
        while done < indices.len() {
            Self::check_deadline(limits)?;
            let target = usize::try_from(indices[done]).unwrap_or(usize::MAX);
            if target >= timeline.frames() {
                return Err(ends_early(timeline.frames() as u64, info));
            }
            if let Some(start) = timeline.start_for(target) {
                if start > position && start > decode_from {
                    // Whatever the decoder still holds shows before the start: not sampled.
                    decoder.flush();
                    decode_from = start;
                }
            }
            if !flushed {
                match self.next_packet(index, limits)? {
                    Some(packet) => {
                        // Its decode-order position; a discarded packet (the timeline leaves
                        // it out) goes with the next one counted.
                        let at = position;
                        if !is_discarded(&packet) {
                            if packet.pts().and_then(|pts| timeline.packet_of(pts)) != Some(at) {
                                return Ok(done);
                            }
                            position += 1;
                        }
                        if at >= decode_from {
                            let sampled = packet
                                .pts()
                                .and_then(|pts| timeline.frame_of(pts))
                                .is_some_and(|f| {
                                    indices[done..].binary_search(&(f as u64)).is_ok()
                                });
                            decoder.skip_frame(if sampled {
                                ff::Discard::Default
                            } else {
                                ff::Discard::NonReference
                            });
                            decoder.send_packet(&packet).map_err(ff_error("decoding"))?;
                        }
                    }
                    None => {
                        decoder.send_eof().map_err(ff_error("decoding"))?;
                        flushed = true;
                    }
                }
            }
            let mut got_any = false;
            while done < indices.len() && decoder.receive_frame(&mut frame).is_ok() {
                got_any = true;
                let Some(shown) = frame.pts().and_then(|pts| timeline.frame_of(pts)) else {
                    return Ok(done);
                };
                let shown = shown as u64;
                if shown > indices[done] {
                    // A sampled frame was never shown.
                    return Ok(done);
                }
                if shown == indices[done] {
                    check_frame_size(&frame, shown, info)?;
                    let rgb = rotate(to_rgb(&frame, &mut scaler)?, info.rotation)?;
                    while indices.get(done) == Some(&shown) {
                        done += 1;
                        on_frame(&rgb)?;
                    }
                }
            }
            if flushed && !got_any {
                return Ok(done);
            }
        }
        Ok(done)
    }

    /// Decodes every frame from the top up to the last of `indices`, counting frames in the
    /// order the decoder shows them.
    pub(super) fn decode_all(
        &mut self,
        info: &VideoInfo,
        indices: &[u64],
        limits: &VideoLimits,
        on_frame: &mut impl FnMut(&DecodedImage) -> Result<(), VideoError>,
    ) -> Result<(), VideoError> {
        let Some(&last) = indices.last() else {
            return Ok(());
        };
        let (index, mut decoder) = self.video_decoder()?;
        let mut wanted = indices.iter().peekable();
        let mut frame_index = 0u64;
        let mut frame = ff::frame::Video::empty();
        let mut scaler: Option<ff::software::scaling::Context> = None;
        let mut flushed = false;
        while frame_index <= last {
            Self::check_deadline(limits)?;
            if !flushed {
                match self.next_packet(index, limits)? {
                    Some(packet) => decoder.send_packet(&packet).map_err(ff_error("decoding"))?,
                    None => {
                        decoder.send_eof().map_err(ff_error("decoding"))?;
                        flushed = true;
                    }
                }
            }
            let mut got_any = false;
            while frame_index <= last && decoder.receive_frame(&mut frame).is_ok() {
                got_any = true;
                check_frame_size(&frame, frame_index, info)?;
                if wanted.peek() == Some(&&frame_index) {
                    let rgb = rotate(to_rgb(&frame, &mut scaler)?, info.rotation)?;
                    while wanted.peek() == Some(&&frame_index) {
                        wanted.next();
                        on_frame(&rgb)?;
                    }
                }
                frame_index += 1;
            }
            if flushed && !got_any {
                break;
            }
        }
        if wanted.peek().is_some() {
            return Err(ends_early(frame_index, info));
        }
        Ok(())
    }
}

fn ends_early(frames: u64, info: &VideoInfo) -> VideoError {
    VideoError::Corrupt(format!(
        "the video ends after {frames} frames, its header claims {}",
        info.total_frames
    ))
}

fn check_frame_size(
    frame: &ff::frame::Video,
    index: u64,
    info: &VideoInfo,
) -> Result<(), VideoError> {
    if (frame.width(), frame.height()) == info.decoded_size() {
        return Ok(());
    }
    Err(VideoError::FrameSizeChanged {
        index,
        width: frame.width(),
        height: frame.height(),
    })
}
