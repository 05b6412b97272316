//! Where each frame of a video stream lies, from one demux pass that reads the packets
//! without decoding them: which presentation timestamp is frame `i`, and the packets that
//! decoding may start from so that every later frame comes out exactly as when decoding
//! from the top.
//!
//! Frame `i` is the `i`-th smallest presentation timestamp, the order a decoder shows the
//! frames in. A packet is a clean start when it is a keyframe, every packet before it (in
//! decode order) shows earlier and every packet after it shows later: then no later frame
//! leans on data before it (open-GOP leading pictures, which do, break the second rule).

/// One packet of the video stream, as demuxing reads it (decode order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PacketTime {
    pub pts: i64,
    pub key: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Timeline {
    /// Frame index -> presentation timestamp (ascending).
    frame_pts: Vec<i64>,
    /// Presentation timestamp -> decode-order position, sorted by timestamp.
    packet_by_pts: Vec<(i64, usize)>,
    /// Decode-order positions of the clean starts, ascending. A clean start's position is
    /// also its frame index (everything before it shows earlier, everything after it later).
    starts: Vec<usize>,
}

impl Timeline {
    /// The timeline of `packets` (decode order); `None` when frames cannot be told apart by
    /// their timestamps (none given, or one shown twice).
    pub fn new(packets: &[PacketTime]) -> Option<Timeline> {
        let mut packet_by_pts: Vec<(i64, usize)> = packets
            .iter()
            .enumerate()
            .map(|(position, p)| (p.pts, position))
            .collect();
        packet_by_pts.sort_unstable();
        if packet_by_pts.windows(2).any(|w| w[0].0 == w[1].0) {
            return None;
        }
        let frame_pts = packet_by_pts.iter().map(|&(pts, _)| pts).collect();
        let mut later_min = vec![i64::MAX; packets.len() + 1];
        for (position, packet) in packets.iter().enumerate().rev() {
            later_min[position] = later_min[position + 1].min(packet.pts);
        }
        let mut earlier_max = i64::MIN;
        let mut starts = Vec::new();
        for (position, packet) in packets.iter().enumerate() {
            if packet.key && earlier_max < packet.pts && later_min[position] == packet.pts {
                starts.push(position);
            }
            earlier_max = earlier_max.max(packet.pts);
        }
        Some(Timeline {
            frame_pts,
            packet_by_pts,
            starts,
        })
    }

    pub fn frames(&self) -> usize {
        self.frame_pts.len()
    }

    /// The frame shown at `pts`.
    pub fn frame_of(&self, pts: i64) -> Option<usize> {
        self.frame_pts.binary_search(&pts).ok()
    }

    /// The decode-order position of the packet shown at `pts`.
    pub fn packet_of(&self, pts: i64) -> Option<usize> {
        let found = self.packet_by_pts.binary_search_by_key(&pts, |&(p, _)| p);
        found.ok().map(|i| self.packet_by_pts[i].1)
    }

    /// The decode-order position of the last clean start at or before frame `frame`.
    pub fn start_for(&self, frame: usize) -> Option<usize> {
        let after = self.starts.partition_point(|&packet| packet <= frame);
        after.checked_sub(1).map(|i| self.starts[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packets(list: &[(i64, bool)]) -> Vec<PacketTime> {
        list.iter()
            .map(|&(pts, key)| PacketTime { pts, key })
            .collect()
    }

    #[test]
    fn frames_are_in_presentation_order() {
        // I P B B: decode order 0 3 1 2.
        let t = Timeline::new(&packets(&[(0, true), (3, false), (1, false), (2, false)]));
        let t = t.expect("distinct timestamps");
        assert_eq!(t.frames(), 4);
        assert_eq!(t.frame_of(3), Some(3));
        assert_eq!(t.frame_of(1), Some(1));
        assert_eq!(t.packet_of(3), Some(1));
        assert_eq!(t.frame_of(7), None);
    }

    #[test]
    fn clean_starts_exclude_open_gop_keyframes() {
        // Closed GOP at 4: nothing after it shows earlier. Open GOP at 9: leading pictures
        // 7 and 8 come after it in decode order.
        let list = [
            (0, true),
            (3, false),
            (1, false),
            (2, false),
            (4, true),
            (6, false),
            (5, false),
            (9, true),
            (7, false),
            (8, false),
            (10, false),
        ];
        let t = Timeline::new(&packets(&list)).expect("distinct timestamps");
        assert_eq!(t.start_for(0), Some(0));
        assert_eq!(t.start_for(3), Some(0));
        assert_eq!(t.start_for(4), Some(4));
        // Frames 9 and 10 must decode from the closed GOP at 4, not from the open one at 9.
        assert_eq!(t.start_for(9), Some(4));
        assert_eq!(t.start_for(10), Some(4));
    }

    #[test]
    fn repeated_timestamps_give_no_timeline() {
        assert!(Timeline::new(&packets(&[(0, true), (0, false)])).is_none());
        let t = Timeline::new(&[]).expect("an empty stream has an empty timeline");
        assert_eq!((t.frames(), t.start_for(0)), (0, None));
    }
}
