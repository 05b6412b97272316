//! Qwen-VL's `smart_resize`, with transformers' exact float arithmetic
//! (`transformers.models.qwen2_vl.image_processing_qwen2_vl.smart_resize`).

use crate::pipeline::ProcessError;

/// transformers refuses images whose long side is more than this many times the short one.
pub const MAX_ASPECT_RATIO: u32 = 200;

/// The size `(height, width)` an image is resized to: each side a multiple of `factor`,
/// the area brought into `[min_pixels, max_pixels]` keeping the aspect ratio.
///
/// Python's `round` rounds half to even, its int/int division is the correctly rounded
/// quotient, which f64 division gives too while the operands stay below 2^53.
pub fn smart_resize(
    height: u32,
    width: u32,
    factor: u32,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(u32, u32), ProcessError> {
    if height == 0 || width == 0 {
        return Err(ProcessError::EmptyImage { width, height });
    }
    let (h, w, f) = (f64::from(height), f64::from(width), f64::from(factor));
    if h.max(w) / h.min(w) > f64::from(MAX_ASPECT_RATIO) {
        return Err(ProcessError::AspectRatio {
            width,
            height,
            limit: MAX_ASPECT_RATIO,
        });
    }
    let area = u64::from(height) * u64::from(width);
    let to_side = |multiples: f64| -> u32 { (multiples as u32).saturating_mul(factor) };
    let mut h_bar = to_side((h / f).round_ties_even());
    let mut w_bar = to_side((w / f).round_ties_even());
    let bar_area = u64::from(h_bar) * u64::from(w_bar);
    if bar_area > max_pixels {
        let beta = (area as f64 / max_pixels as f64).sqrt();
        h_bar = factor.max(to_side((h / beta / f).floor()));
        w_bar = factor.max(to_side((w / beta / f).floor()));
    } else if bar_area < min_pixels {
        let beta = (min_pixels as f64 / area as f64).sqrt();
        h_bar = to_side((h * beta / f).ceil());
        w_bar = to_side((w * beta / f).ceil());
    }
    Ok((h_bar, w_bar))
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN2: (u32, u64, u64) = (28, 3136, 12845056);

    fn qwen2(h: u32, w: u32) -> Result<(u32, u32), ProcessError> {
        smart_resize(h, w, QWEN2.0, QWEN2.1, QWEN2.2)
    }

    #[test]
    fn matches_values_computed_by_transformers() {
        // (h, w) -> transformers' smart_resize with factor 28, 3136, 12845056.
        assert_eq!(qwen2(480, 640).unwrap(), (476, 644));
        assert_eq!(qwen2(1, 1).unwrap(), (56, 56));
        assert_eq!(qwen2(200, 1).unwrap(), (812, 28));
        assert_eq!(qwen2(3000, 4000).unwrap(), (2996, 4004));
        // Ties round to even: 42 / 28 = 1.5 -> 2, 70 / 28 = 2.5 -> 2.
        assert_eq!(qwen2(42, 70).unwrap(), (56, 56));
    }

    #[test]
    fn rejects_aspect_ratio_over_200_and_empty_images() {
        assert!(qwen2(1, 200).is_ok());
        assert_eq!(qwen2(1, 201).unwrap_err().code(), "process.aspect_ratio");
        assert_eq!(qwen2(0, 5).unwrap_err().code(), "process.empty_image");
    }

    #[test]
    fn result_is_a_multiple_of_the_factor_within_bounds() {
        for (h, w) in [(7, 1000), (4000, 3000), (123, 4567), (29, 29), (1, 150)] {
            let (rh, rw) = qwen2(h, w).unwrap();
            assert_eq!((rh % 28, rw % 28), (0, 0), "{h}x{w}");
            assert!(u64::from(rh) * u64::from(rw) <= QWEN2.2, "{h}x{w}");
        }
    }
}
