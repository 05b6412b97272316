//! Any bytes through `probe_video` and then `decode_frames` of frames spread over the video
//! (so decoding reads past packets and skips frames): an error value, or frames of the
//! probed size, each buffer matching it.
#![no_main]

use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use mmserve_mm::video::demux::{decode_frames, probe_video, VideoLimits};

fuzz_target!(|data: &[u8]| {
    // Small caps and a deadline, so a header claiming a long or large video costs nothing.
    let limits = VideoLimits {
        max_duration_s: 60.0,
        max_frames: 600,
        max_pixels: 1 << 20,
        max_streams: 4,
        deadline: Instant::now().checked_add(Duration::from_secs(2)),
    };
    let Ok(info) = probe_video(data, &limits) else {
        return;
    };
    let last = info.total_frames.saturating_sub(1);
    let mut indices = vec![0, 1.min(last), last / 3, last / 2, last];
    indices.sort_unstable();
    indices.dedup();
    if let Ok((decoded, frames)) = decode_frames(data, &indices, &limits) {
        assert_eq!(decoded, info);
        assert_eq!(frames.len(), indices.len());
        for frame in frames {
            assert_eq!((frame.width, frame.height), (info.width, info.height));
            assert_eq!(
                frame.data.len(),
                info.width as usize * info.height as usize * 3
            );
        }
    }
});
