//! The default build runs everything on the caller's thread: the process's set of threads
//! (`/proc/self/task`) is the same before and after the driver processes several images, and
//! no pool thread exists. Built with `parallel`, the same run must show the pool instead.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test fails loudly"
)]

use std::collections::BTreeSet;
use std::fs;

use mmserve_mm::common::par;
use mmserve_mm::driver::{self, DriverOptions, MediaInput, MediaItem, Mode};
use mmserve_mm::family::registry::{family_from_spec, spec_from_hf_configs};
use mmserve_mm::pipeline::Positions;

const CONFIG: &str = r#"{"model_type": "qwen2_vl", "image_token_id": 151655,
    "vision_start_token_id": 151652, "vision_end_token_id": 151653}"#;
const PREPROCESSOR: &str = r#"{"min_pixels": 3136, "max_pixels": 200704}"#;
const IMG: u32 = 151655;
const START: u32 = 151652;
const END: u32 = 151653;

fn threads() -> BTreeSet<(String, String)> {
    fs::read_dir("/proc/self/task")
        .expect("procfs")
        .map(|entry| {
            let entry = entry.expect("task entry");
            let comm = fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
            (
                entry.file_name().to_string_lossy().into_owned(),
                comm.trim().to_owned(),
            )
        })
        .collect()
}

fn png(width: u32, height: u32, seed: u32) -> Vec<u8> {
    let data: Vec<u8> = (0..width * height * 3)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8)
        .collect();
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().expect("png header");
    writer.write_image_data(&data).expect("png data");
    writer.finish().expect("png end");
    out
}

#[test]
fn driver_spawns_no_thread_without_parallel() {
    let spec = spec_from_hf_configs(PREPROCESSOR, CONFIG).expect("spec");
    let family = family_from_spec(&spec).expect("family");
    let images: Vec<Vec<u8>> = (0..6).map(|i| png(97 + 31 * i, 83 + 17 * i, i)).collect();
    let media: Vec<MediaItem<'_>> = images
        .iter()
        .map(|b| MediaItem::image(MediaInput::Bytes(b)))
        .collect();
    let mut ids = vec![1, 2];
    for _ in &images {
        ids.extend([START, IMG, END, 3]);
    }

    let before = threads();
    let out = driver::run(
        family.as_ref(),
        &ids,
        &media,
        &DriverOptions::default(),
        Mode::Full,
    )
    .expect("driver");
    let after = threads();

    assert_eq!(out.items.len(), images.len());
    assert!(out.items.iter().all(|item| item.processed.is_some()));
    assert!(matches!(out.positions, Positions::MRope { .. }));
    let pool: Vec<_> = after
        .iter()
        .filter(|(_, comm)| comm.starts_with("mmserve-mm"))
        .collect();
    if cfg!(feature = "parallel") {
        assert!(!pool.is_empty() || par::num_threads() == 1);
    } else {
        assert_eq!(before, after, "threads appeared or vanished during the run");
        assert!(pool.is_empty());
        assert_eq!(par::num_threads(), 1);
    }
}
