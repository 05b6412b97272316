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
mod error;
mod probe;
mod rotation;

use std::ffi::{c_int, c_void, CStr};
use std::mem::ManuallyDrop;
use std::ptr;
use std::sync::Once;
use std::time::Instant;

use ff::ffi;
use ffmpeg_next as ff;

use crate::pipeline::DecodedImage;
use crate::video::error::VideoError;
use crate::video::sampling::VideoMeta;
use crate::video::timeline::{PacketTime, Timeline};
use convert::{check_pixel_format, pixel_format_name, to_rgb};
use error::ff_error;
use probe::probe_container;
use rotation::{display_rotation, rotate};

/// Bytes handed to FFmpeg per read.
const IO_BUFFER: usize = 64 * 1024;
/// Packets read for a frame size the headers leave to the bitstream: its VOL header comes
/// before the first picture.
const SIZE_PACKETS: usize = 4;

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

/// What one pass over the video stream's packets found.
struct Scan {
    /// Packets of the stream (past `max_frames`, the pass stops).
    count: u64,
    /// Their timing in decode order, leaving out those the container marks as discarded
    /// (the decoder drops their frames); `None` when one has no presentation timestamp.
    packets: Option<Vec<PacketTime>>,
}

/// The byte source FFmpeg reads through its custom IO callbacks.
struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

unsafe extern "C" fn read_packet(opaque: *mut c_void, buf: *mut u8, size: c_int) -> c_int {
    // SAFETY: `opaque` is the boxed `Reader` that outlives the IO context (see `Demuxer`).
    let reader = unsafe { &mut *(opaque as *mut Reader<'_>) };
    let left = reader.data.len().saturating_sub(reader.pos);
    let n = left.min(usize::try_from(size).unwrap_or(0));
    if n == 0 {
        return ffi::AVERROR_EOF;
    }
    // SAFETY: FFmpeg hands a buffer of `size` bytes; `n <= size` and `n <= left`.
    unsafe { ptr::copy_nonoverlapping(reader.data.as_ptr().add(reader.pos), buf, n) };
    reader.pos += n;
    n as c_int
}

unsafe extern "C" fn seek(opaque: *mut c_void, offset: i64, whence: c_int) -> i64 {
    // SAFETY: as in `read_packet`.
    let reader = unsafe { &mut *(opaque as *mut Reader<'_>) };
    let len = reader.data.len() as i64;
    if whence & ffi::AVSEEK_SIZE as c_int != 0 {
        return len;
    }
    let base = match whence & !(ffi::AVSEEK_FORCE as c_int) {
        0 => 0,
        1 => reader.pos as i64,
        2 => len,
        _ => return i64::from(ffi::AVERROR(ffi::EINVAL)),
    };
    match base.checked_add(offset) {
        Some(target) if (0..=len).contains(&target) => {
            reader.pos = target as usize;
            target
        }
        _ => i64::from(ffi::AVERROR(ffi::EINVAL)),
    }
}

unsafe extern "C" fn interrupted(opaque: *mut c_void) -> c_int {
    // SAFETY: `opaque` is the boxed deadline that outlives the format context.
    let deadline = unsafe { &*(opaque as *const Option<Instant>) };
    c_int::from(deadline.is_some_and(|d| Instant::now() >= d))
}

/// An open input over borrowed bytes. Field order is drop order: the format context
/// first, then the IO context, then what their callbacks point into.
struct Demuxer<'a> {
    input: ManuallyDrop<ff::format::context::Input>,
    avio: *mut ffi::AVIOContext,
    _reader: Box<Reader<'a>>,
    _deadline: Box<Option<Instant>>,
    /// The bytes `_reader` reads from and their probed demuxer (static), for opening them
    /// again without probing again.
    data: &'a [u8],
    format: *const ffi::AVInputFormat,
    container: String,
    /// The packet pass, when reading the headers needed it (to count the frames).
    scanned: Option<Scan>,
}

impl Drop for Demuxer<'_> {
    fn drop(&mut self) {
        // SAFETY: the input is dropped exactly once here; with custom IO it leaves `avio`
        // alone, which is then freed with the buffer FFmpeg may have replaced.
        unsafe {
            ManuallyDrop::drop(&mut self.input);
            free_avio(&mut self.avio);
        }
    }
}

/// Frees an IO context made by `avio_alloc_context` and its current buffer.
unsafe fn free_avio(avio: &mut *mut ffi::AVIOContext) {
    if avio.is_null() {
        return;
    }
    // SAFETY: `avio` is a live IO context whose buffer FFmpeg allocated with av_malloc.
    unsafe {
        ffi::av_freep(ptr::addr_of_mut!((**avio).buffer) as *mut c_void);
        ffi::avio_context_free(avio);
    }
}

fn quiet_logs() {
    static QUIET: Once = Once::new();
    // FFmpeg would print every complaint about a hostile file to stderr.
    QUIET.call_once(|| ff::util::log::set_level(ff::util::log::Level::Quiet));
}

impl<'a> Demuxer<'a> {
    fn open(data: &'a [u8], limits: &VideoLimits) -> Result<Demuxer<'a>, VideoError> {
        quiet_logs();
        Self::open_as(data, probe_container(data)?, limits)
    }

    /// The same bytes from the top, with the demuxer already probed (probing every demuxer
    /// over the first MiB is most of an open's cost).
    fn reopen(&self, limits: &VideoLimits) -> Result<Demuxer<'a>, VideoError> {
        Self::open_as(self.data, self.format, limits)
    }

    fn open_as(
        data: &'a [u8],
        format: *const ffi::AVInputFormat,
        limits: &VideoLimits,
    ) -> Result<Demuxer<'a>, VideoError> {
        let mut reader = Box::new(Reader { data, pos: 0 });
        let deadline = Box::new(limits.deadline);
        let oom = || VideoError::Corrupt("out of memory".into());
        // SAFETY: every pointer below is checked before use; on each failure path what was
        // allocated so far is freed, and on success `Demuxer` owns it all.
        unsafe {
            let buffer = ffi::av_malloc(IO_BUFFER) as *mut u8;
            if buffer.is_null() {
                return Err(oom());
            }
            let mut avio = ffi::avio_alloc_context(
                buffer,
                IO_BUFFER as c_int,
                0,
                ptr::addr_of_mut!(*reader) as *mut c_void,
                Some(read_packet),
                None,
                Some(seek),
            );
            if avio.is_null() {
                ffi::av_free(buffer as *mut c_void);
                return Err(oom());
            }
            let mut ctx = ffi::avformat_alloc_context();
            if ctx.is_null() {
                free_avio(&mut avio);
                return Err(oom());
            }
            (*ctx).pb = avio;
            (*ctx).flags |= ffi::AVFMT_FLAG_CUSTOM_IO as c_int;
            (*ctx).max_streams = c_int::try_from(limits.max_streams).unwrap_or(c_int::MAX);
            (*ctx).interrupt_callback = ffi::AVIOInterruptCB {
                callback: Some(interrupted),
                opaque: ptr::addr_of!(*deadline) as *mut c_void,
            };
            // The probed demuxer alone, so no other one reads the data.
            let ret = ffi::avformat_open_input(&mut ctx, ptr::null(), format, ptr::null_mut());
            if ret < 0 {
                // avformat_open_input freed the context; the IO context is still ours.
                free_avio(&mut avio);
                // A demuxer that meets one stream past `max_streams` fails with ENOMEM.
                if ret == ffi::AVERROR(ffi::ENOMEM) {
                    return Err(VideoError::TooManyStreams {
                        limit: limits.max_streams,
                    });
                }
                return Err(ff_error("reading the headers")(ff::Error::from(ret)));
            }
            let container = CStr::from_ptr((*format).name)
                .to_string_lossy()
                .into_owned();
            Ok(Demuxer {
                input: ManuallyDrop::new(ff::format::context::Input::wrap(ctx)),
                avio,
                _reader: reader,
                _deadline: deadline,
                data,
                format,
                container,
                scanned: None,
            })
        }
    }

    fn check_deadline(limits: &VideoLimits) -> Result<(), VideoError> {
        match limits.deadline {
            Some(d) if Instant::now() >= d => Err(VideoError::Deadline),
            _ => Ok(()),
        }
    }

    /// The video stream's index and its header values, with every cap checked.
    fn info(&mut self, limits: &VideoLimits) -> Result<VideoInfo, VideoError> {
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
        let duration_s = if stream_duration > 0 && time_base > 0.0 {
            stream_duration as f64 * time_base
        } else {
            let container = self.input.duration();
            if container > 0 {
                container as f64 / f64::from(ffi::AV_TIME_BASE)
            } else {
                rate.map_or(0.0, |r| total_frames as f64 / r)
            }
        };
        let fps = match rate {
            Some(r) => r,
            None if duration_s > 0.0 => total_frames as f64 / duration_s,
            None => return Err(VideoError::NoFrameRate),
        };
        if !(fps.is_finite() && fps > 0.0) {
            return Err(VideoError::NoFrameRate);
        }
        let duration_s = duration_s.max(total_frames as f64 / fps);
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

    /// The video stream: its index and a decoder for it, FFmpeg's own threads off.
    fn video_decoder(&self) -> Result<(usize, ff::decoder::Video), VideoError> {
        let stream = self
            .input
            .streams()
            .best(ff::media::Type::Video)
            .ok_or(VideoError::NoVideoStream)?;
        let mut context = ff::codec::context::Context::from_parameters(stream.parameters())
            .map_err(ff_error("reading the codec parameters"))?;
        // FFmpeg's own frame and slice threads stay off: fan-out belongs to common::par.
        context.set_threading(ff::codec::threading::Config {
            kind: ff::codec::threading::Type::None,
            count: 1,
            ..Default::default()
        });
        let decoder = context
            .decoder()
            .video()
            .map_err(ff_error("opening the decoder"))?;
        Ok((stream.index(), decoder))
    }

    /// One pass over the video stream's packets, read without decoding; stops past the cap.
    fn scan_packets(&mut self, limits: &VideoLimits) -> Result<Scan, VideoError> {
        let index = self
            .input
            .streams()
            .best(ff::media::Type::Video)
            .ok_or(VideoError::NoVideoStream)?
            .index();
        let mut count = 0u64;
        let mut packets = Some(Vec::new());
        while let Some(packet) = self.next_packet(index, limits)? {
            Self::check_deadline(limits)?;
            // The decoder drops a discarded packet's frame: it is not one of the video's.
            if is_discarded(&packet) {
                continue;
            }
            count += 1;
            if count > limits.max_frames {
                break;
            }
            match (packet.pts(), packets.as_mut()) {
                (Some(pts), Some(list)) => list.push(PacketTime {
                    pts,
                    key: packet.is_key(),
                }),
                _ => packets = None,
            }
        }
        Ok(Scan { count, packets })
    }

    /// Decodes the frames at `indices` by the timeline: reading past the packets no sampled
    /// frame needs without decoding them, and dropping unsampled non-reference frames.
    /// Returns how many entries of `indices` were handed to `on_frame`; fewer than all means
    /// the decoder did not show the frames the timeline expected, and the rest must be
    /// decoded from the top.
    fn decode_sampled(
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

    /// The next packet of stream `index`; `None` at the end of the data.
    fn next_packet(
        &mut self,
        index: usize,
        limits: &VideoLimits,
    ) -> Result<Option<ff::Packet>, VideoError> {
        loop {
            // A fresh packet per read: av_read_frame may overwrite one that still holds a
            // buffer, which would leak it.
            let mut packet = ff::Packet::empty();
            match packet.read(&mut self.input) {
                Ok(()) if packet.stream() == index => return Ok(Some(packet)),
                Ok(()) => Self::check_deadline(limits)?,
                Err(ff::Error::Eof) => return Ok(None),
                Err(e) => return Err(ff_error("reading a packet")(e)),
            }
        }
    }

    /// Decodes every frame from the top up to the last of `indices`, counting frames in the
    /// order the decoder shows them.
    fn decode_all(
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

/// Whether the container marks the packet's frame as one to drop (an mp4 edit list does).
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

fn is_discarded(packet: &ff::Packet) -> bool {
    // SAFETY: the packet is live.
    unsafe { (*ff::packet::Ref::as_ptr(packet)).flags & ffi::AV_PKT_FLAG_DISCARD as c_int != 0 }
}
