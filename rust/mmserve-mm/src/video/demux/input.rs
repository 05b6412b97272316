//! The video's open input: the bytes under the video demuxers' whitelist, and the packet
//! pass reading the headers needed.

use std::ops::{Deref, DerefMut};

use ffmpeg_next as ff;

use super::scan::Scan;
use super::VideoLimits;
use crate::common::ffmpeg::{probe_format, InputLimits, MemoryInput};
use crate::video::error::VideoError;

/// Demuxers that may open the data (libavformat's names).
const CONTAINERS: [&str; 2] = ["mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm"];

/// An open video input.
pub(super) struct Demuxer<'a> {
    source: MemoryInput<'a>,
    /// The packet pass, when reading the headers needed it (to count the frames).
    pub(super) scanned: Option<Scan>,
}

impl<'a> Deref for Demuxer<'a> {
    type Target = MemoryInput<'a>;

    fn deref(&self) -> &MemoryInput<'a> {
        &self.source
    }
}

impl<'a> DerefMut for Demuxer<'a> {
    fn deref_mut(&mut self) -> &mut MemoryInput<'a> {
        &mut self.source
    }
}

impl VideoLimits {
    fn input(&self) -> InputLimits {
        InputLimits {
            max_streams: self.max_streams,
            deadline: self.deadline,
            probe_bytes: None,
        }
    }
}

impl<'a> Demuxer<'a> {
    pub(super) fn open(data: &'a [u8], limits: &VideoLimits) -> Result<Demuxer<'a>, VideoError> {
        let format = probe_format(data, &CONTAINERS)?;
        Ok(Demuxer {
            source: MemoryInput::open(data, format, &limits.input())?,
            scanned: None,
        })
    }

    /// The same bytes from the top, without probing them again.
    pub(super) fn reopen(&self, limits: &VideoLimits) -> Result<Demuxer<'a>, VideoError> {
        Ok(Demuxer {
            source: self.source.reopen(&limits.input())?,
            scanned: None,
        })
    }

    pub(super) fn check_deadline(limits: &VideoLimits) -> Result<(), VideoError> {
        Ok(limits.input().check_deadline()?)
    }

    /// The next packet of stream `index`; `None` at the end of the data.
    pub(super) fn next_packet(
        &mut self,
        index: usize,
        limits: &VideoLimits,
    ) -> Result<Option<ff::Packet>, VideoError> {
        Ok(self.source.next_packet(index, &limits.input())?)
    }
}
