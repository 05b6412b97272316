//! What the headers say about the video stream, as a [`VideoInfo`] with every cap checked
//! before anything is decoded.

use std::ffi::c_int;
use std::ptr;

use ff::ffi;
use ffmpeg_next as ff;

use super::convert::{check_pixel_format, pixel_format_name};
use super::error::ff_error;
use super::input::Demuxer;
use super::rotation::display_rotation;
use super::{VideoInfo, VideoLimits};
use crate::video::error::VideoError;

/// Packets read for a frame size the headers leave to the bitstream: its VOL header comes
/// before the first picture.
const SIZE_PACKETS: usize = 4;

impl Demuxer<'_> {
    /// The video stream's index and its header values, with every cap checked.
    pub(super) fn info(&mut self, limits: &VideoLimits) -> Result<VideoInfo, VideoError> {
        // Streams added after the headers (matroska may) are caught here.
        if self.input.nb_streams() as usize > limits.max_streams {
            return Err(VideoError::TooManyStreams {
                limit: limits.max_streams,
            });
        }
        let stream = self
            .input
            .streams()
            .best(ff::media::Type::Video)
            .ok_or(VideoError::NoVideoStream)?;
        let parameters = stream.parameters();
        let codec = parameters.id();
        use ff::codec::Id;
        if !matches!(
            codec,
            Id::H264 | Id::HEVC | Id::VP8 | Id::VP9 | Id::AV1 | Id::MPEG4
        ) {
            return Err(VideoError::UnsupportedCodec(codec.name().to_owned()));
        }
        // SAFETY: the parameters pointer is valid while the stream is.
        let (mut width, mut height, format) = unsafe {
            let p = parameters.as_ptr();
            ((*p).width, (*p).height, (*p).format)
        };
        if (width <= 0 || height <= 0) && codec == Id::MPEG4 {
            // mov clears the sample entry's size for MPEG-4 Part 2 ("let decoder init
            // width/height"); the bitstream's VOL header holds it.
            (width, height) = self.bitstream_size(stream.index(), limits)?;
        }
        let (width, height) = match (u32::try_from(width), u32::try_from(height)) {
            (Ok(w), Ok(h)) if w > 0 && h > 0 => (w, h),
            _ => {
                return Err(VideoError::Corrupt(
                    "the video stream has no frame size".into(),
                ))
            }
        };
        let rotation = display_rotation(&stream);
        let (width, height) = if rotation % 180 == 90 {
            (height, width)
        } else {
            (width, height)
        };
        if u64::from(width) * u64::from(height) > limits.max_pixels {
            return Err(VideoError::TooManyPixels {
                width,
                height,
                limit: limits.max_pixels,
            });
        }
        // mp4 leaves the format to the bitstream (no decoder ran yet): then it is checked
        // on the first decoded frame instead.
        let pixel_format = if format == ffi::AVPixelFormat::AV_PIX_FMT_NONE as c_int {
            "unknown".to_owned()
        } else {
            let name = pixel_format_name(format);
            check_pixel_format(format, &name)?;
            name
        };
        let rate = [stream.avg_frame_rate(), stream.rate()]
            .into_iter()
            .find(|r| r.numerator() > 0 && r.denominator() > 0)
            .map(f64::from);
        let time_base = f64::from(stream.time_base());
        let stream_duration = stream.duration();
        let header_frames = header_frame_count(&stream);
        let total_frames = if header_frames > 0 {
            header_frames
        } else {
            let scan = self.scan_packets(limits)?;
            let count = scan.count;
            self.scanned = Some(scan);
            count
        };
        if total_frames == 0 {
            return Err(VideoError::Corrupt("the video stream has no frames".into()));
        }
        if total_frames > limits.max_frames {
            return Err(VideoError::TooManyFrames {
                frames: total_frames,
                limit: limits.max_frames,
            });
        }
        let (fps, duration_s) = rate_and_duration(
            rate,
            stream_duration,
            time_base,
            self.input.duration(),
            total_frames,
        )?;
        if duration_s > limits.max_duration_s {
            return Err(VideoError::TooLong {
                seconds: duration_s,
                limit: limits.max_duration_s,
            });
        }
        Ok(VideoInfo {
            width,
            height,
            rotation,
            total_frames,
            fps,
            duration_s,
            codec: codec.name().to_owned(),
            container: self.container.clone(),
            pixel_format,
        })
    }

    /// The frame size as libavcodec's parser reads it from the stream's VOL header (in the
    /// extradata, else in-band before the first picture): a fresh pass over the first
    /// [`SIZE_PACKETS`] packets, parsed, not decoded; `(0, 0)` when none holds it.
    fn bitstream_size(
        &self,
        index: usize,
        limits: &VideoLimits,
    ) -> Result<(c_int, c_int), VideoError> {
        let mut fresh = self.reopen(limits)?;
        let stream = fresh.input.stream(index).ok_or(VideoError::NoVideoStream)?;
        let mut context = ff::codec::context::Context::from_parameters(stream.parameters())
            .map_err(ff_error("reading the codec parameters"))?;
        let parser = Parser::new(context.id())?;
        for _ in 0..SIZE_PACKETS {
            let Some(packet) = fresh.next_packet(index, limits)? else {
                break;
            };
            let Some(bytes) = packet.data().filter(|b| !b.is_empty()) else {
                continue;
            };
            let Ok(len) = c_int::try_from(bytes.len()) else {
                continue;
            };
            // SAFETY: the parser and the context are live; the packet's buffer holds `len`
            // bytes and FFmpeg's padding; the parser's output points into that buffer (a
            // whole frame per call) and is not kept.
            let (width, height) = unsafe {
                let ctx = context.as_mut_ptr();
                let mut out: *mut u8 = ptr::null_mut();
                let mut out_len: c_int = 0;
                ffi::av_parser_parse2(
                    parser.0,
                    ctx,
                    &mut out,
                    &mut out_len,
                    bytes.as_ptr(),
                    len,
                    ffi::AV_NOPTS_VALUE,
                    ffi::AV_NOPTS_VALUE,
                    0,
                );
                ((*ctx).width, (*ctx).height)
            };
            if width > 0 && height > 0 {
                return Ok((width, height));
            }
        }
        Ok((0, 0))
    }
}

/// The frame rate and the duration in seconds, from the header values: the stream's rate,
/// else the frames over the duration; the stream's duration (in `time_base` units), else the
/// container's (in `AV_TIME_BASE` units), else the frames at the rate; never shorter than
/// the frames last at that rate.
fn rate_and_duration(
    rate: Option<f64>,
    stream_duration: i64,
    time_base: f64,
    container_duration: i64,
    total_frames: u64,
) -> Result<(f64, f64), VideoError> {
    let duration_s = if stream_duration > 0 && time_base > 0.0 {
        stream_duration as f64 * time_base
    } else if container_duration > 0 {
        container_duration as f64 / f64::from(ffi::AV_TIME_BASE)
    } else {
        rate.map_or(0.0, |r| total_frames as f64 / r)
    };
    let fps = match rate {
        Some(r) => r,
        None if duration_s > 0.0 => total_frames as f64 / duration_s,
        None => return Err(VideoError::NoFrameRate),
    };
    if !(fps.is_finite() && fps > 0.0) {
        return Err(VideoError::NoFrameRate);
    }
    Ok((fps, duration_s.max(total_frames as f64 / fps)))
}

/// A libavcodec parser, told that each packet is one whole frame.
struct Parser(*mut ffi::AVCodecParserContext);

impl Parser {
    fn new(codec: ff::codec::Id) -> Result<Parser, VideoError> {
        let id: ffi::AVCodecID = codec.into();
        // SAFETY: av_parser_init takes any codec id and returns null when it has no parser.
        let parser = unsafe { ffi::av_parser_init(id as c_int) };
        if parser.is_null() {
            return Err(VideoError::Unavailable(
                "libavcodec has no parser to read the frame size with",
            ));
        }
        // SAFETY: `parser` is live; the flag only skips the frame-boundary search.
        unsafe { (*parser).flags |= ffi::PARSER_FLAG_COMPLETE_FRAMES };
        Ok(Parser(parser))
    }
}

impl Drop for Parser {
    fn drop(&mut self) {
        // SAFETY: the parser is live and closed exactly once.
        unsafe { ffi::av_parser_close(self.0) };
    }
}

/// The frame count the container's headers give: mp4's sample count less the samples its
/// edit list discards (a file cut with `-c copy` keeps the packets from the keyframe before
/// the cut, marked discarded in the index), which is what torchcodec's exact mode counts.
/// 0 where the headers give none (matroska).
fn header_frame_count(stream: &ff::format::stream::Stream) -> u64 {
    let samples = u64::try_from(stream.frames()).unwrap_or(0);
    // SAFETY: the stream is live while the format context is; the index is only read.
    let discarded = unsafe {
        let st = stream.as_ptr().cast_mut();
        let entries = ffi::avformat_index_get_entries_count(st);
        (0..entries)
            .filter(|&i| {
                let entry = ffi::avformat_index_get_entry(st, i);
                !entry.is_null() && (*entry).flags() & ffi::AVINDEX_DISCARD_FRAME != 0
            })
            .count()
    };
    samples.saturating_sub(discarded as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_and_duration_prefer_the_stream_then_the_container_then_the_frames() {
        // The stream's duration, in its time base.
        assert_eq!(
            rate_and_duration(Some(25.0), 1000, 0.01, 0, 100).ok(),
            Some((25.0, 10.0))
        );
        // The container's, in AV_TIME_BASE units, when the stream gives none.
        assert_eq!(
            rate_and_duration(Some(25.0), 0, 0.01, 8_000_000, 100).ok(),
            Some((25.0, 8.0))
        );
        // Neither: the frames at the rate.
        assert_eq!(
            rate_and_duration(Some(20.0), 0, 0.0, 0, 100).ok(),
            Some((20.0, 5.0))
        );
        // No rate: the frames over the duration.
        assert_eq!(
            rate_and_duration(None, 400, 0.01, 0, 100).ok(),
            Some((25.0, 4.0))
        );
    }

    #[test]
    fn rate_and_duration_never_end_before_the_frames() {
        // 100 frames at 25 fps last 4 s, longer than the 2 s the stream claims.
        assert_eq!(
            rate_and_duration(Some(25.0), 200, 0.01, 0, 100).ok(),
            Some((25.0, 4.0))
        );
    }

    #[test]
    fn rate_and_duration_need_a_rate_or_a_duration() {
        assert!(matches!(
            rate_and_duration(None, 0, 0.0, 0, 100),
            Err(VideoError::NoFrameRate)
        ));
        assert!(matches!(
            rate_and_duration(Some(f64::INFINITY), 0, 0.0, 0, 100),
            Err(VideoError::NoFrameRate)
        ));
    }
}
