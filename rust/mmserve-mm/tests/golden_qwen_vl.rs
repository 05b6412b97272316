//! The plain rlib (no pool, no Python) against the golden fixtures made from transformers by
//! `tests/make_mm_golden.py`; the Python suite checks the parallel extension against the same
//! file, so both builds produce identical bytes.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test fails loudly"
)]

use std::fs;
use std::path::PathBuf;

use mmserve_mm::driver::{self, DriverOptions, MediaInput, MediaItem, Mode};
use mmserve_mm::family::registry::{family_from_spec, spec_from_hf_configs};
use mmserve_mm::pipeline::{Positions, TensorData};
use serde_json::Value;

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/mm/golden")
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("integer") as u32)
        .collect()
}

fn i64s(v: &Value) -> Vec<i64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_i64().expect("integer"))
        .collect()
}

#[test]
fn rlib_reproduces_the_golden_fixtures() {
    let dir = golden_dir();
    let golden: Value =
        serde_json::from_str(&fs::read_to_string(dir.join("qwen_vl.json")).expect("golden json"))
            .expect("valid json");
    let images: Vec<Vec<u8>> = golden["images"]
        .as_array()
        .expect("images")
        .iter()
        .map(|name| fs::read(dir.join(name.as_str().expect("name"))).expect("image file"))
        .collect();
    let media: Vec<MediaItem<'_>> = images
        .iter()
        .map(|b| MediaItem::image(MediaInput::Bytes(b)))
        .collect();
    let cases = golden["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 6);
    for case in cases {
        let what = format!("{} {}", case["family"], case["backend"]);
        let spec = spec_from_hf_configs(
            &case["preprocessor_config"].to_string(),
            &case["config"].to_string(),
        )
        .expect("spec");
        let family = family_from_spec(&spec).expect("family");
        let out = driver::run(
            family.as_ref(),
            &u32s(&case["input_ids"]),
            &media,
            &DriverOptions::default(),
            Mode::Full,
        )
        .expect("driver");
        assert_eq!(out.input_ids, u32s(&case["expanded_ids"]), "{what}");
        let offsets: Vec<Vec<u32>> = case["offsets"]
            .as_array()
            .expect("offsets")
            .iter()
            .map(u32s)
            .collect();
        let ours: Vec<Vec<u32>> = out
            .offsets
            .iter()
            .map(|&(s, e)| vec![s as u32, e as u32])
            .collect();
        assert_eq!(ours, offsets, "{what}");
        let Positions::MRope { positions, delta } = &out.positions else {
            panic!("{what}: expected M-RoPE positions");
        };
        let rows: Vec<i64> = case["positions"]
            .as_array()
            .expect("rows")
            .iter()
            .flat_map(i64s)
            .collect();
        assert_eq!(positions, &rows, "{what}");
        assert_eq!(Some(*delta), case["rope_delta"].as_i64(), "{what}");
        for (item, expected) in out
            .items
            .iter()
            .zip(case["items"].as_array().expect("items"))
        {
            assert_eq!(
                format!("{:016x}", item.hash),
                expected["hash"].as_str().expect("hash")
            );
            assert_eq!(
                item.geometry.grid_thw().to_vec(),
                u32s(&expected["grid_thw"]),
                "{what}"
            );
            assert_eq!(
                Some(item.num_tokens as u64),
                expected["num_tokens"].as_u64()
            );
            let processed = item.processed.as_ref().expect("pixels in full mode");
            let TensorData::F32(values) = processed.feature.data() else {
                panic!("{what}: pixel values must be f32");
            };
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            assert_eq!(
                blake3::hash(&bytes).to_hex().as_str(),
                expected["pixel_values_blake3"].as_str().expect("digest"),
                "{what}"
            );
        }
    }
}
