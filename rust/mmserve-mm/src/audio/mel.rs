//! The mel filter bank and the window of Whisper-style features, as transformers computes them
//! (`audio_utils.mel_filter_bank` with Slaney's scale and norm, `torch.hann_window`).

/// Whisper's filters span 0 Hz to this, whatever the sampling rate.
pub const MAX_FREQUENCY_HZ: f64 = 8000.0;

/// One triangular filter: its weights over the frequency bins `first..first + weights.len()`,
/// zero elsewhere.
#[derive(Debug, Clone, PartialEq)]
pub struct MelFilter {
    pub first: usize,
    pub weights: Vec<f64>,
}

/// Slaney's mel scale: linear below 1 kHz, logarithmic above.
fn hertz_to_mel(freq: f64) -> f64 {
    const MIN_LOG_HERTZ: f64 = 1000.0;
    const MIN_LOG_MEL: f64 = 15.0;
    if freq >= MIN_LOG_HERTZ {
        MIN_LOG_MEL + (freq / MIN_LOG_HERTZ).ln() * (27.0 / 6.4f64.ln())
    } else {
        3.0 * freq / 200.0
    }
}

fn mel_to_hertz(mels: f64) -> f64 {
    const MIN_LOG_HERTZ: f64 = 1000.0;
    const MIN_LOG_MEL: f64 = 15.0;
    if mels >= MIN_LOG_MEL {
        MIN_LOG_HERTZ * ((6.4f64.ln() / 27.0) * (mels - MIN_LOG_MEL)).exp()
    } else {
        200.0 * mels / 3.0
    }
}

/// numpy's `linspace(start, stop, num)`: `i * step + start`, the last point exactly `stop`.
fn linspace(start: f64, stop: f64, num: usize) -> Vec<f64> {
    let step = (stop - start) / (num.saturating_sub(1).max(1)) as f64;
    (0..num)
        .map(|i| {
            if i + 1 == num && num > 1 {
                stop
            } else {
                i as f64 * step + start
            }
        })
        .collect()
}

/// The `num_mel_filters` Slaney-normalized triangular filters over `1 + n_fft / 2` bins from
/// 0 Hz to [`MAX_FREQUENCY_HZ`], each weight rounded to f32 as the torch path multiplies
/// with them (`WhisperFeatureExtractor.mel_filters` cast to float32).
pub fn mel_filters(n_fft: usize, num_mel_filters: usize, sampling_rate: u32) -> Vec<MelFilter> {
    let bins = 1 + n_fft / 2;
    let mel_freqs = linspace(
        hertz_to_mel(0.0),
        hertz_to_mel(MAX_FREQUENCY_HZ),
        num_mel_filters + 2,
    );
    let filter_freqs: Vec<f64> = mel_freqs.iter().map(|&m| mel_to_hertz(m)).collect();
    let fft_freqs = linspace(0.0, f64::from(sampling_rate / 2), bins);
    (0..num_mel_filters)
        .map(|m| {
            let (lower, center, upper) =
                (filter_freqs[m], filter_freqs[m + 1], filter_freqs[m + 2]);
            let enorm = 2.0 / (upper - lower);
            let weight = |f: f64| {
                let down = -(lower - f) / (center - lower);
                let up = (upper - f) / (upper - center);
                let w = down.min(up).max(0.0);
                f64::from((w * enorm) as f32)
            };
            let all: Vec<f64> = fft_freqs.iter().map(|&f| weight(f)).collect();
            let first = all.iter().position(|&w| w != 0.0).unwrap_or(0);
            let last = all.iter().rposition(|&w| w != 0.0).map_or(first, |l| l + 1);
            MelFilter {
                first,
                weights: all[first..last].to_vec(),
            }
        })
        .collect()
}

/// `torch.hann_window(n)` (periodic): `0.5 - 0.5 cos(2 pi i / n)`.
pub fn hann_window(n: usize) -> Vec<f64> {
    (0..n)
        .map(|i| 0.5 - 0.5 * (2.0 * std::f64::consts::PI * i as f64 / n as f64).cos())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scale_is_linear_to_1khz_then_logarithmic_and_inverts() {
        assert_eq!(hertz_to_mel(600.0), 9.0);
        assert!((hertz_to_mel(6400.0) - 42.0).abs() < 1e-12);
        for f in [0.0, 100.0, 999.0, 1000.0, 4321.0, 8000.0] {
            assert!((mel_to_hertz(hertz_to_mel(f)) - f).abs() < 1e-9);
        }
    }

    #[test]
    fn linspace_ends_on_stop() {
        assert_eq!(
            linspace(0.0, 8000.0, 5),
            vec![0.0, 2000.0, 4000.0, 6000.0, 8000.0]
        );
        assert_eq!(linspace(1.0, 1.0, 1), vec![1.0]);
    }

    #[test]
    fn filters_are_triangles_that_tile_the_band() {
        let filters = mel_filters(400, 80, 16000);
        assert_eq!(filters.len(), 80);
        for pair in filters.windows(2) {
            // Each triangle starts after the previous one's start.
            assert!(pair[1].first >= pair[0].first);
        }
        // The last one reaches no higher than 8 kHz, bin 200 of 201.
        let last = filters.last().unwrap();
        assert!(last.first + last.weights.len() <= 201);
        assert!(filters.iter().all(|f| f.weights.iter().all(|&w| w >= 0.0)));
    }

    #[test]
    fn the_window_is_periodic() {
        let w = hann_window(400);
        assert_eq!(w[0], 0.0);
        assert!((w[200] - 1.0).abs() < 1e-15);
        assert!((w[100] - w[300]).abs() < 1e-15);
    }
}
