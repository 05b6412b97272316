//! The time of each temporal group, as Qwen3-VL's processor writes it into the prompt
//! (`Qwen3VLProcessor._calculate_timestamps` and `replace_video_token`, transformers 5.24):
//! before each group's `<|vision_start|>`, `<{t:.1f} seconds>`, `t` the mean time of the
//! group's first and last sampled frames.

/// Seconds of each temporal group: the indices padded with the last one to a whole number of
/// groups, each index over `video_fps`, then the mean of each group's first and last.
pub fn group_timestamps(indices: &[u64], video_fps: f64, temporal_patch_size: usize) -> Vec<f64> {
    let size = temporal_patch_size.max(1);
    let Some(&last) = indices.last() else {
        return Vec::new();
    };
    let seconds = |k: usize| indices.get(k).copied().unwrap_or(last) as f64 / video_fps;
    (0..indices.len().div_ceil(size))
        .map(|g| (seconds(g * size) + seconds(g * size + size - 1)) / 2.0)
        .collect()
}

/// The text before a group: Python's `f"<{t:.1f} seconds>"` (both round the exact binary
/// value half to even).
pub fn timestamp_text(seconds: f64) -> String {
    format!("<{seconds:.1} seconds>")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pads_with_the_last_index_and_averages_each_group() {
        // 2 fps: frames 0, 1 -> 0.25 s; frame 2 (padded with itself) -> 1.0 s.
        assert_eq!(group_timestamps(&[0, 1, 2], 2.0, 2), vec![0.25, 1.0]);
        assert_eq!(group_timestamps(&[], 2.0, 2), Vec::<f64>::new());
        assert_eq!(timestamp_text(0.25), "<0.2 seconds>");
        assert_eq!(timestamp_text(0.75), "<0.8 seconds>");
        assert_eq!(timestamp_text(12.0), "<12.0 seconds>");
    }
}
