//! Every media item's identity (mm_hash), in one place. The identity keys the encoder cache,
//! the routing prefix and the cached KV, so it covers everything that shapes the item's
//! embedding: an item's bytes (blake3 of them, [`content`]), folded with each option that
//! changes what the vision tower sees. Each fold hashes a tag of its own, then its words in
//! little-endian, so no two folds (nor a fold and plain bytes of the same length) meet:
//!
//! | fold | tag | words |
//! |---|---|---|
//! | [`with_pixel_bounds`] | `pixbnds1` | identity, min_pixels, max_pixels (u64 each) |
//! | [`crop`] | `pancrop1` | image (u64), crop (u32), min_crop_size, max_num_crops (u32), min_ratio_to_activate (f64 bits) |
//! | [`video`] | `vidsamp2` | content and the 11 sampling and sizing words of [`video`] (u64 each) |
//! | [`video_group`] | `vidgroup` | video (u64), group (u32) |
//! | [`audio`] | `audfeat1` | content and the 8 words of the extractor that featurizes it (u64 each) |
//! | [`embeddings`] | `image_embeds:` | a text header of dtype, shape and grid, then the raw values |
//!
//! A change to any fold changes every identity it makes: bump its tag, so old and new never
//! share a cache entry.

use crate::audio::features::{LogMelConfig, Padding};
use crate::common::hash::content_hash;
use crate::image::pan_and_scan::PanAndScan;
use crate::video::frames::VideoResize;
use crate::video::sampling::Sampling;
use crate::video::VideoFamily;

/// `[min_pixels, max_pixels]` an image is resized within.
pub type PixelBounds = [u64; 2];

/// A tagged fold of fixed-width words into one identity.
struct Fold(Vec<u8>);

impl Fold {
    fn new(tag: &[u8; 8]) -> Self {
        let mut bytes = Vec::with_capacity(tag.len() + 12 * 8);
        bytes.extend_from_slice(tag);
        Fold(bytes)
    }

    fn u64(mut self, word: u64) -> Self {
        self.0.extend_from_slice(&word.to_le_bytes());
        self
    }

    fn u32(mut self, word: u32) -> Self {
        self.0.extend_from_slice(&word.to_le_bytes());
        self
    }

    fn finish(self) -> u64 {
        content_hash(&self.0)
    }
}

/// The identity of an item's encoded bytes: an image's, a video's before its sampling.
pub fn content(bytes: &[u8]) -> u64 {
    content_hash(bytes)
}

/// `identity` resized within a request's pixel bounds, other than the model's own.
pub fn with_pixel_bounds(identity: u64, [min_pixels, max_pixels]: PixelBounds) -> u64 {
    Fold::new(b"pixbnds1")
        .u64(identity)
        .u64(min_pixels)
        .u64(max_pixels)
        .finish()
}

/// Pan-and-scan crop `crop` (1 for the first) of the image identified by `image`, folded with
/// every knob, so the crops of differently set requests never meet.
pub fn crop(image: u64, crop: u32, knobs: &PanAndScan) -> u64 {
    Fold::new(b"pancrop1")
        .u64(image)
        .u32(crop)
        .u32(knobs.min_crop_size)
        .u32(knobs.max_num_crops)
        .u64(knobs.min_ratio_to_activate.to_bits())
        .finish()
}

/// An image item: its content's identity; a pan-and-scan crop's (`Some((crop, knobs))`)
/// folded by [`crop`]; either folded by [`with_pixel_bounds`] under a request's own bounds.
pub fn image(
    content: u64,
    cropped: Option<(u32, &PanAndScan)>,
    bounds: Option<PixelBounds>,
) -> u64 {
    let identity = match cropped {
        Some((index, knobs)) => crop(content, index, knobs),
        None => content,
    };
    match bounds {
        Some(bounds) => with_pixel_bounds(identity, bounds),
        None => identity,
    }
}

/// A video sampled and sized by `sampling` and `resize`: the same bytes sampled or sized
/// otherwise never meet.
pub fn video(content: u64, sampling: &Sampling, resize: &VideoResize) -> u64 {
    let words = [
        content,
        processor_word(sampling.family),
        processor_word(resize.family),
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
    words
        .into_iter()
        .fold(Fold::new(b"vidsamp2"), Fold::u64)
        .finish()
}

/// An audio clip featurized by `extractor`: the same bytes decoded at another rate, or padded,
/// cut or binned otherwise, never meet.
pub fn audio(content: u64, extractor: &LogMelConfig) -> u64 {
    let words = [
        content,
        extractor.feature_size as u64,
        u64::from(extractor.sampling_rate),
        extractor.hop_length as u64,
        extractor.n_fft as u64,
        u64::from(extractor.chunk_length),
        u64::from(extractor.padding_value.to_bits()),
        match extractor.padding {
            Padding::MaxLength => 0,
            Padding::Longest => 1,
        } | (u64::from(extractor.truncation) << 1),
    ];
    words
        .into_iter()
        .fold(Fold::new(b"audfeat1"), Fold::u64)
        .finish()
}

/// The word a video processor's rules enter [`video`] as (fixed: reordering the enum must not
/// change an identity).
fn processor_word(family: VideoFamily) -> u64 {
    match family {
        VideoFamily::Qwen2Vl => 0,
        VideoFamily::Qwen3Vl => 1,
    }
}

/// Temporal group `group` of the video identified by `video`, for a family that plans each
/// group as an item of its own (Qwen3-VL).
pub fn video_group(video: u64, group: u32) -> u64 {
    Fold::new(b"vidgroup").u64(video).u32(group).finish()
}

/// A video served with its own audio track interleaved (`use_audio_in_video`): its rows are
/// not the frames' alone, so it never meets the same video served without.
pub fn with_audio_track(video: u64) -> u64 {
    Fold::new(b"vidtrack").u64(video).finish()
}

/// Element types a precomputed embedding may have.
const EMBEDDING_DTYPES: [&str; 3] = ["float32", "float16", "bfloat16"];

/// A precomputed image embedding (`image_embeds`): its raw values (`data`, row-major) under a
/// header of its dtype (one of `float32`, `float16`, `bfloat16`; spelt `torch.<dtype>` in the
/// header), shape and grid, so equal values of another type or layout never meet. `None` for
/// another dtype.
pub fn embeddings(dtype: &str, shape: &[usize], grid_thw: [u32; 3], data: &[u8]) -> Option<u64> {
    if !EMBEDDING_DTYPES.contains(&dtype) {
        return None;
    }
    let list = |values: &mut dyn Iterator<Item = String>| values.collect::<Vec<_>>().join(", ");
    let header = format!(
        "image_embeds:torch.{dtype}:[{}]:[{}]:",
        list(&mut shape.iter().map(usize::to_string)),
        list(&mut grid_thw.iter().map(u32::to_string)),
    );
    let mut hasher = blake3::Hasher::new();
    hasher.update(header.as_bytes());
    hasher.update(data);
    let mut head = [0u8; 8];
    head.copy_from_slice(&hasher.finalize().as_bytes()[..8]);
    Some(u64::from_le_bytes(head))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A few thousand inputs from a fixed sequence (splitmix64).
    fn words(n: usize) -> impl Iterator<Item = u64> {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        (0..n).map(move |_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        })
    }

    // The folds as they were written before this module held them (`PanAndScan::crop_identity`,
    // `video::identity`, and Python's `struct.pack("<8sQQQ", b"pixbnds1", ...)`), kept to show
    // that the identities did not change.
    fn old_pixel_bounds(identity: u64, min: u64, max: u64) -> u64 {
        let mut bytes = b"pixbnds1".to_vec();
        for word in [identity, min, max] {
            bytes.extend_from_slice(&word.to_le_bytes());
        }
        content_hash(&bytes)
    }

    fn old_crop(knobs: &PanAndScan, image: u64, crop: u32) -> u64 {
        let mut bytes = Vec::with_capacity(8 + 28);
        bytes.extend_from_slice(b"pancrop1");
        bytes.extend_from_slice(&image.to_le_bytes());
        bytes.extend_from_slice(&crop.to_le_bytes());
        bytes.extend_from_slice(&knobs.min_crop_size.to_le_bytes());
        bytes.extend_from_slice(&knobs.max_num_crops.to_le_bytes());
        bytes.extend_from_slice(&knobs.min_ratio_to_activate.to_bits().to_le_bytes());
        content_hash(&bytes)
    }

    fn old_video(content: u64, sampling: &Sampling, resize: &VideoResize) -> u64 {
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
        let mut bytes = b"vidsamp2".to_vec();
        for word in words {
            bytes.extend_from_slice(&word.to_le_bytes());
        }
        content_hash(&bytes)
    }

    fn old_group(video: u64, group: u32) -> u64 {
        let mut bytes = b"vidgroup".to_vec();
        bytes.extend_from_slice(&video.to_le_bytes());
        bytes.extend_from_slice(&group.to_le_bytes());
        content_hash(&bytes)
    }

    #[test]
    fn the_folds_are_the_ones_identities_had_before() {
        let mut w = words(40_000);
        let mut next = || w.next().unwrap_or_default();
        for _ in 0..2_000 {
            let (identity, min, max) = (next(), next(), next());
            assert_eq!(
                with_pixel_bounds(identity, [min, max]),
                old_pixel_bounds(identity, min, max)
            );
            let knobs = PanAndScan {
                min_crop_size: next() as u32,
                max_num_crops: next() as u32,
                min_ratio_to_activate: f64::from(next() as u32) / 1024.0,
            };
            let (image, index) = (next(), next() as u32);
            assert_eq!(crop(image, index, &knobs), old_crop(&knobs, image, index));
            assert_eq!(video_group(image, index), old_group(image, index));
            let family = if next() % 2 == 0 {
                VideoFamily::Qwen2Vl
            } else {
                VideoFamily::Qwen3Vl
            };
            let sampling = Sampling {
                family,
                fps: (next() % 2 == 0).then(|| f64::from(next() as u32) / 7.0),
                num_frames: (next() % 2 == 0).then(|| next() % 1000),
                min_frames: next() % 100,
                max_frames: next() % 1000,
                temporal_patch_size: 1 + next() % 4,
            };
            let resize = VideoResize {
                min_pixels: next() % (1 << 20),
                max_pixels: next() % (1 << 30),
                cap_pixels_per_frame: next() % 2 == 0,
                max_video_tokens: next() % 200_000,
                ..VideoResize::defaults(family)
            };
            let content = next();
            assert_eq!(
                video(content, &sampling, &resize),
                old_video(content, &sampling, &resize)
            );
        }
    }

    #[test]
    fn pinned_identities() {
        // Computed from the folds' byte layouts with Python's `struct` and `blake3` packages,
        // and served as `mm_hash` before this module: a change here changes every cache key.
        let knobs = PanAndScan::DEFAULT;
        assert_eq!(with_pixel_bounds(7, [3136, 100_000]), 0xf748_f9ce_a7fa_358e);
        assert_eq!(crop(7, 1, &knobs), 0xf0f6_9844_b61d_290e);
        assert_eq!(video_group(7, 1), 0x3060_71eb_aff0_a6b5);
        assert_eq!(
            video_group(846_773_688_631_546_630, 0),
            0xb78e_8284_71bf_285e
        );
        assert_eq!(content(b""), 0xa6a1_f9f5_b949_13af);
        assert_eq!(image(7, None, None), 7);
        assert_eq!(image(7, Some((1, &knobs)), None), crop(7, 1, &knobs));
        assert_eq!(
            image(7, Some((2, &knobs)), Some([1, 2])),
            with_pixel_bounds(crop(7, 2, &knobs), [1, 2])
        );
    }

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
        let base = video(7, &sampling, &resize);
        let variants = [
            video(8, &sampling, &resize),
            video(
                7,
                &Sampling {
                    fps: Some(1.0),
                    ..sampling
                },
                &resize,
            ),
            video(
                7,
                &Sampling {
                    fps: None,
                    num_frames: Some(2),
                    ..sampling
                },
                &resize,
            ),
            video(
                7,
                &Sampling {
                    max_frames: 8,
                    ..sampling
                },
                &resize,
            ),
            video(
                7,
                &sampling,
                &VideoResize {
                    max_pixels: 1 << 20,
                    ..resize
                },
            ),
            video(
                7,
                &Sampling {
                    family: VideoFamily::Qwen3Vl,
                    ..sampling
                },
                &VideoResize::QWEN3_VL,
            ),
            video(
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
        let knobs = PanAndScan::DEFAULT;
        let base = crop(7, 1, &knobs);
        for other in [
            crop(8, 1, &knobs),
            crop(7, 2, &knobs),
            crop(
                7,
                1,
                &PanAndScan {
                    min_crop_size: 255,
                    ..knobs
                },
            ),
            crop(
                7,
                1,
                &PanAndScan {
                    max_num_crops: 3,
                    ..knobs
                },
            ),
            crop(
                7,
                1,
                &PanAndScan {
                    min_ratio_to_activate: 1.3,
                    ..knobs
                },
            ),
        ] {
            assert_ne!(other, base);
        }
        let groups: Vec<u64> = (0..3).map(|g| video_group(7, g)).collect();
        assert!(groups[0] != groups[1] && groups[1] != groups[2] && groups[0] != 7);
        assert_ne!(video_group(8, 0), groups[0]);
        assert_ne!(with_pixel_bounds(7, [1, 2]), with_pixel_bounds(7, [1, 3]));
    }

    #[test]
    fn an_embedding_identity_covers_its_type_and_layout() {
        let data = [1u8, 2, 3, 4, 5, 6, 7, 8];
        let one = embeddings("float32", &[1, 2], [1, 2, 2], &data);
        // The header as it was written in Python: f"image_embeds:{dtype}:{shape}:{grid}:".
        let mut reference = b"image_embeds:torch.float32:[1, 2]:[1, 2, 2]:".to_vec();
        reference.extend_from_slice(&data);
        assert_eq!(one, Some(content_hash(&reference)));
        assert_ne!(one, embeddings("float16", &[2, 2], [1, 2, 2], &data));
        assert_ne!(one, embeddings("float32", &[2, 1], [1, 2, 2], &data));
        assert_ne!(one, embeddings("float32", &[1, 2], [1, 1, 4], &data));
        assert_eq!(embeddings("int8", &[8], [1, 2, 4], &data), None);
    }
}
