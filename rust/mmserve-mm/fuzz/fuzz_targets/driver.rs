//! The request driver over fuzzed prompts and image bytes, in both modes: an error value, or
//! an output whose ids, offsets and items agree with each other.
#![no_main]

use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use mmserve_mm::driver::{run, DriverOptions, MediaInput, MediaItem, Mode};
use mmserve_mm::family::registry::{family_from_spec, spec_from_hf_configs};
use mmserve_mm::image::decode::DecodeLimits;
use mmserve_mm::pipeline::{Family, TokenId};

const IMAGE: TokenId = 151655;
const START: TokenId = 151652;
const END: TokenId = 151653;

fn family() -> &'static Arc<dyn Family> {
    static FAMILY: OnceLock<Arc<dyn Family>> = OnceLock::new();
    FAMILY.get_or_init(|| {
        let config = r#"{"model_type": "qwen2_vl", "image_token_id": 151655,
            "vision_start_token_id": 151652, "vision_end_token_id": 151653}"#;
        let spec = spec_from_hf_configs("{}", config).expect("spec");
        family_from_spec(&spec).expect("family")
    })
}

const SEPARATOR: &[u8] = b"#ITEM#";

/// `bytes` cut at each `SEPARATOR` (image files are unlikely to hold it).
fn split(mut bytes: &[u8]) -> impl Iterator<Item = &[u8]> {
    std::iter::from_fn(move || {
        if bytes.is_empty() {
            return None;
        }
        let cut = bytes.windows(SEPARATOR.len()).position(|w| w == SEPARATOR);
        let (item, rest) = match cut {
            Some(at) => (&bytes[..at], &bytes[at + SEPARATOR.len()..]),
            None => (bytes, &[][..]),
        };
        bytes = rest;
        Some(item)
    })
}

fuzz_target!(|data: &[u8]| {
    // [mode, n_items, n_prompt_tokens, prompt token selectors..., items separated by SEPARATOR]
    let [mode, n_items, n_tokens, rest @ ..] = data else {
        return;
    };
    let n_tokens = usize::from(*n_tokens % 32).min(rest.len());
    let (selectors, payload) = rest.split_at(n_tokens);
    let input_ids: Vec<TokenId> = selectors
        .iter()
        .map(|s| match s % 4 {
            0 => IMAGE,
            1 => START,
            2 => END,
            _ => TokenId::from(*s),
        })
        .collect();
    let items: Vec<MediaItem<'_>> = split(payload)
        .take(usize::from(n_items % 4))
        .map(|bytes| MediaItem::image(MediaInput::Bytes(bytes)))
        .collect();
    let options = DriverOptions {
        decode: DecodeLimits {
            max_pixels: 1 << 18,
        },
        ..DriverOptions::default()
    };
    let mode = if mode % 2 == 0 {
        Mode::Full
    } else {
        Mode::CountOnly
    };
    let Ok(out) = run(family().as_ref(), &input_ids, &items, &options, mode) else {
        return;
    };
    assert_eq!(out.items.len(), items.len());
    assert_eq!(out.offsets.len(), items.len());
    for (item, &(start, end)) in out.items.iter().zip(&out.offsets) {
        assert!(start <= end && end <= out.input_ids.len());
        assert_eq!(end - start, item.num_tokens);
        assert_eq!(item.processed.is_some(), mode == Mode::Full);
    }
});
