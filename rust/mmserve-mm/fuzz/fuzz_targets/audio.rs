//! Any bytes through `probe_audio`, then `decode_audio` (whole, and cut short) and the
//! features of the first half second of what decodes: an error value, or finite samples no
//! more than asked for, the probed header, and features of the extractor's shape.
#![no_main]

use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use mmserve_mm::audio::decode::{decode_audio, probe_audio, AudioLimits, DecodeOptions};
use mmserve_mm::audio::features::{LogMel, LogMelConfig, Padding};

fuzz_target!(|data: &[u8]| {
    // Small caps and a deadline, so a header claiming a long clip costs nothing.
    let limits = AudioLimits {
        max_duration_s: 20.0,
        max_streams: 4,
        max_channels: 8,
        deadline: Instant::now().checked_add(Duration::from_secs(2)),
        ..AudioLimits::default()
    };
    let Ok(info) = probe_audio(data, None, &limits) else {
        return;
    };
    for max_samples in [None, Some(4000)] {
        let options = DecodeOptions {
            sample_rate: 16000,
            max_samples,
        };
        let Ok((decoded_info, decoded)) = decode_audio(data, None, &options, &limits) else {
            continue;
        };
        assert_eq!(decoded_info, info);
        let samples = &decoded.samples;
        assert!(!samples.is_empty());
        assert!(samples.iter().all(|s| s.is_finite()));
        assert!(max_samples.is_none_or(|max| samples.len() <= max));
        // Unpadded, so the features' length follows the clip's; half a second of it, as the
        // transform's arithmetic is slow under the sanitizer and is the same on every frame.
        let mel = LogMel::new(LogMelConfig {
            padding: Padding::Longest,
            truncation: false,
            ..LogMelConfig::whisper(80)
        })
        .expect("a valid config");
        let head = &samples[..samples.len().min(8000)];
        if let Ok(features) = mel.extract(head) {
            assert_eq!(features.frames, head.len() / 160);
            assert_eq!(features.data.len(), 80 * features.frames);
            assert!(features.data.iter().all(|v| v.is_finite()));
        }
    }
});
