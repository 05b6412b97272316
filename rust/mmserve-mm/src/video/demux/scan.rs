//! One pass over the video stream's packets, read without decoding: the frame count, and
//! the packets' timing a [`Timeline`](crate::video::timeline::Timeline) is made from.

use std::ffi::c_int;

use ff::ffi;
use ffmpeg_next as ff;

use super::input::Demuxer;
use super::VideoLimits;
use crate::video::error::VideoError;
use crate::video::timeline::PacketTime;

/// What one pass over the video stream's packets found.
pub(super) struct Scan {
    /// Packets of the stream (past `max_frames`, the pass stops).
    pub(super) count: u64,
    /// Their timing in decode order, leaving out those the container marks as discarded
    /// (the decoder drops their frames); `None` when one has no presentation timestamp.
    pub(super) packets: Option<Vec<PacketTime>>,
}

impl Demuxer<'_> {
    /// One pass over the video stream's packets, read without decoding; stops past the cap.
    pub(super) fn scan_packets(&mut self, limits: &VideoLimits) -> Result<Scan, VideoError> {
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
}

/// Whether the container marks the packet's frame as one to drop (an mp4 edit list does).
pub(super) fn is_discarded(packet: &ff::Packet) -> bool {
    // SAFETY: the packet is live.
    unsafe { (*ff::packet::Ref::as_ptr(packet)).flags & ffi::AV_PKT_FLAG_DISCARD as c_int != 0 }
}
