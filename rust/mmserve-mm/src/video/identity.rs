//! A video's identity (mm_hash): its content hash folded with every option that changes the
//! frames the model sees, so the same bytes sampled or sized differently never share an
//! encoder-cache entry or a routing prefix.

use crate::common::hash::content_hash;
use crate::video::frames::VideoResize;
use crate::video::sampling::Sampling;

/// Distinguishes these folds from every other use of the hash.
const TAG: &[u8; 8] = b"vidsamp2";
const GROUP_TAG: &[u8; 8] = b"vidgroup";

pub fn video_identity(content: u64, sampling: &Sampling, resize: &VideoResize) -> u64 {
    let words = [
        content,
        sampling.family as u64,
        resize.family as u64,
        sampling.fps.map_or(u64::MAX, f64::to_bits),
        sampling.num_frames.unwrap_or(u64::MAX),
        sampling.min_frames,
        sampling.max_frames,
        sampling.temporal_patch_size,
        resize.min_pixels,
        resize.max_pixels,
        u64::from(resize.cap_pixels_per_frame),
        resize.max_video_tokens,
    ];
    let mut bytes = Vec::with_capacity(TAG.len() + 8 * words.len());
    bytes.extend_from_slice(TAG);
    for word in words {
        bytes.extend_from_slice(&word.to_le_bytes());
    }
    content_hash(&bytes)
}

/// The identity of temporal group `group` of the video identified by `video` (Qwen3-VL plans
/// each group as its own item).
pub fn group_identity(video: u64, group: u32) -> u64 {
    let mut bytes = Vec::with_capacity(GROUP_TAG.len() + 12);
    bytes.extend_from_slice(GROUP_TAG);
    bytes.extend_from_slice(&video.to_le_bytes());
    bytes.extend_from_slice(&group.to_le_bytes());
    content_hash(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::video::VideoFamily;

    #[test]
    fn every_option_changes_the_identity() {
        let sampling = Sampling {
            family: VideoFamily::Qwen2Vl,
            fps: Some(2.0),
            num_frames: None,
            min_frames: 4,
            max_frames: 768,
            temporal_patch_size: 2,
        };
        let resize = VideoResize::QWEN2_VL;
        let base = video_identity(7, &sampling, &resize);
        assert_eq!(base, video_identity(7, &sampling, &resize));
        let variants = [
            video_identity(8, &sampling, &resize),
            video_identity(
                7,
                &Sampling {
                    fps: Some(1.0),
                    ..sampling
                },
                &resize,
            ),
            video_identity(
                7,
                &Sampling {
                    fps: None,
                    num_frames: Some(2),
                    ..sampling
                },
                &resize,
            ),
            video_identity(
                7,
                &Sampling {
                    max_frames: 8,
                    ..sampling
                },
                &resize,
            ),
            video_identity(
                7,
                &sampling,
                &VideoResize {
                    max_pixels: 1 << 20,
                    ..resize
                },
            ),
            video_identity(
                7,
                &Sampling {
                    family: VideoFamily::Qwen3Vl,
                    ..sampling
                },
                &VideoResize::QWEN3_VL,
            ),
            video_identity(
                7,
                &sampling,
                &VideoResize {
                    cap_pixels_per_frame: true,
                    ..resize
                },
            ),
        ];
        for (i, v) in variants.iter().enumerate() {
            assert_ne!(*v, base, "variant {i}");
        }
    }

    #[test]
    fn each_group_has_its_own_identity() {
        let groups: Vec<u64> = (0..3).map(|g| group_identity(7, g)).collect();
        assert_eq!(groups[1], group_identity(7, 1));
        assert!(groups[0] != groups[1] && groups[1] != groups[2] && groups[0] != 7);
        assert_ne!(group_identity(8, 0), groups[0]);
    }
}
