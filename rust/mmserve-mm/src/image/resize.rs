//! Separable resampling of RGB8 images, bit-exact with the two references the Qwen-VL
//! processors use:
//!
//! - [`Backend::Pil`]: stock Pillow's `ImagingResample` (`libImaging/Resample.c`, Pillow 13):
//!   weights in f64, normalised per output pixel, quantised to 22 fractional bits; vertical
//!   pass first when the height shrinks by more than twice as many pixels as the width does,
//!   horizontal first otherwise.
//! - [`Backend::TorchU8`]: torch's CPU uint8 antialiased kernels (`UpSampleKernel.cpp`,
//!   `_compute_index_ranges_int16_weights`), what torchvision's `resize(uint8, antialias=True)`
//!   runs: the same f64 weights (torch's own cubic polynomial form), quantised to i16 with a
//!   precision chosen from the largest weight; always horizontal first.
//!
//! Both reduce to one integer kernel: `clamp((2^(s-1) + sum(w * p)) >> s, 0, 255)` per
//! channel, with a u8 image between the passes. The per-axis coefficients are computed once;
//! the only scratch beyond the intermediate image is one i32 row.

use thiserror::Error;

use crate::error::ErrorCode;
use crate::pipeline::DecodedImage;

mod kernels;
#[cfg(target_arch = "x86_64")]
mod x86;

/// Output sizes above this many pixels are refused before anything is allocated.
pub const MAX_OUTPUT_PIXELS: u64 = 1 << 28;

const CHANNELS: usize = 3;

/// Pillow's fixed-point precision for 8-bit images (`PRECISION_BITS`).
const PIL_PRECISION_BITS: u32 = 32 - 8 - 2;

/// torch caps its dynamic weight precision at this many bits.
const TORCH_MAX_PRECISION_BITS: u32 = 22;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ResizeError {
    #[error("resize target {width}x{height} has a zero side")]
    EmptyTarget { width: u32, height: u32 },
    #[error("resize target {width}x{height} is over the limit of {limit} pixels")]
    TargetTooLarge { width: u32, height: u32, limit: u64 },
    #[error("image of {width}x{height} has a zero side")]
    EmptyImage { width: u32, height: u32 },
    #[error("image of {width}x{height} RGB needs {expected} bytes, got {actual}")]
    BufferSize {
        width: u32,
        height: u32,
        expected: usize,
        actual: usize,
    },
    #[error("unsupported resampling filter {0} (supported: bicubic, lanczos, bilinear)")]
    UnknownFilter(String),
    #[error("unknown resize backend {0:?} (supported: pil, torch)")]
    UnknownBackend(String),
    #[error(transparent)]
    Transform(#[from] crate::image::transforms::TransformError),
}

impl ResizeError {
    /// This error's entry in the catalogue of codes.
    pub fn kind(&self) -> ErrorCode {
        match self {
            ResizeError::EmptyTarget { .. } => ErrorCode::ResizeEmptyTarget,
            ResizeError::TargetTooLarge { .. } => ErrorCode::ResizeTargetTooLarge,
            ResizeError::EmptyImage { .. } => ErrorCode::ResizeEmptyImage,
            ResizeError::BufferSize { .. } => ErrorCode::ResizeBufferSize,
            ResizeError::UnknownFilter(_) => ErrorCode::ResizeUnknownFilter,
            ResizeError::UnknownBackend(_) => ErrorCode::ResizeUnknownBackend,
            ResizeError::Transform(e) => e.kind(),
        }
    }

    /// Stable machine-readable code, e.g. `resize.empty_target`.
    pub fn code(&self) -> &'static str {
        self.kind().code()
    }
}

/// Resampling filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Filter {
    Bicubic,
    Lanczos,
    Bilinear,
}

impl Filter {
    /// From PIL's `Image.Resampling` value, as HF configs store it in `resample`.
    pub fn from_pil_code(code: i64) -> Result<Filter, ResizeError> {
        match code {
            3 => Ok(Filter::Bicubic),
            1 => Ok(Filter::Lanczos),
            2 => Ok(Filter::Bilinear),
            other => Err(ResizeError::UnknownFilter(format!("code {other}"))),
        }
    }

    /// From a lower-case name: `bicubic`, `lanczos` or `bilinear`.
    pub fn from_name(name: &str) -> Result<Filter, ResizeError> {
        match name {
            "bicubic" => Ok(Filter::Bicubic),
            "lanczos" => Ok(Filter::Lanczos),
            "bilinear" => Ok(Filter::Bilinear),
            other => Err(ResizeError::UnknownFilter(format!("{other:?}"))),
        }
    }

    /// Half-width of the kernel in source pixels at scale 1 (Pillow's `support`,
    /// torch's `interp_size / 2`).
    fn support(self) -> f64 {
        match self {
            Filter::Bicubic => 2.0,
            Filter::Lanczos => 3.0,
            Filter::Bilinear => 1.0,
        }
    }
}

/// Which reference implementation the output must equal bit for bit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Pillow's `Image.resize` (what `Qwen2VLImageProcessorPil` calls).
    Pil,
    /// torchvision's `resize` on a uint8 tensor with `antialias=True` (what the
    /// torchvision-based `Qwen2VLImageProcessor` calls).
    TorchU8,
}

impl Backend {
    /// From `pil` or `torch`.
    pub fn from_name(name: &str) -> Result<Backend, ResizeError> {
        match name {
            "pil" => Ok(Backend::Pil),
            "torch" => Ok(Backend::TorchU8),
            other => Err(ResizeError::UnknownBackend(other.to_owned())),
        }
    }
}

/// A borrowed interleaved RGB8 image (HWC), e.g. a numpy array's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageView<'a> {
    pub width: u32,
    pub height: u32,
    pub data: &'a [u8],
}

impl<'a> From<&'a DecodedImage> for ImageView<'a> {
    fn from(image: &'a DecodedImage) -> Self {
        ImageView {
            width: image.width,
            height: image.height,
            data: &image.data,
        }
    }
}

impl ImageView<'_> {
    /// Checks that the buffer holds exactly `width * height` RGB pixels.
    pub fn check(&self) -> Result<(), ResizeError> {
        if self.width == 0 || self.height == 0 {
            return Err(ResizeError::EmptyImage {
                width: self.width,
                height: self.height,
            });
        }
        let expected = self.width as usize * self.height as usize * CHANNELS;
        if self.data.len() != expected {
            return Err(ResizeError::BufferSize {
                width: self.width,
                height: self.height,
                expected,
                actual: self.data.len(),
            });
        }
        Ok(())
    }
}

/// Resizes `image` to `out_width` x `out_height` exactly as `backend` does.
pub fn resize(
    image: &DecodedImage,
    out_width: u32,
    out_height: u32,
    filter: Filter,
    backend: Backend,
) -> Result<DecodedImage, ResizeError> {
    resize_view(image.into(), out_width, out_height, filter, backend)
}

/// [`resize`] of a borrowed image.
pub fn resize_view(
    image: ImageView<'_>,
    out_width: u32,
    out_height: u32,
    filter: Filter,
    backend: Backend,
) -> Result<DecodedImage, ResizeError> {
    image.check()?;
    if out_width == 0 || out_height == 0 {
        return Err(ResizeError::EmptyTarget {
            width: out_width,
            height: out_height,
        });
    }
    if u64::from(out_width) * u64::from(out_height) > MAX_OUTPUT_PIXELS {
        return Err(ResizeError::TargetTooLarge {
            width: out_width,
            height: out_height,
            limit: MAX_OUTPUT_PIXELS,
        });
    }
    let (in_w, in_h) = (image.width, image.height);
    let coeffs = |in_size, out_size| match backend {
        Backend::Pil => AxisCoeffs::pil(in_size, out_size, filter),
        Backend::TorchU8 => AxisCoeffs::torch(in_size, out_size, filter),
    };
    let horizontal_first = match backend {
        Backend::Pil => pil_horizontal_first(in_w, in_h, out_width, out_height),
        Backend::TorchU8 => true,
    };
    let kernels = kernels::Kernels::detect();
    let (w, h) = (in_w as usize, in_h as usize);
    let out = match (out_width != in_w, out_height != in_h) {
        (false, false) => image.data.to_vec(),
        (true, false) => kernels.horizontal(image.data, w, 0, h, &coeffs(in_w, out_width)),
        (false, true) => kernels.vertical(image.data, w, &coeffs(in_h, out_height), 0),
        (true, true) if horizontal_first => {
            let vertical = coeffs(in_h, out_height);
            // Only the source rows the vertical pass reads are resampled, as Pillow does.
            let (first_row, end_row) = vertical.used_range();
            let horizontal = coeffs(in_w, out_width);
            let temp = kernels.horizontal(image.data, w, first_row, end_row, &horizontal);
            kernels.vertical(&temp, out_width as usize, &vertical, first_row)
        }
        (true, true) => {
            let temp = kernels.vertical(image.data, w, &coeffs(in_h, out_height), 0);
            kernels.horizontal(&temp, w, 0, out_height as usize, &coeffs(in_w, out_width))
        }
    };
    Ok(DecodedImage {
        width: out_width,
        height: out_height,
        data: out,
    })
}

/// Pillow 13's pass order (`ImagingResampleInner`): vertical first when the height is
/// reduced by more than twice as many pixels as the width.
fn pil_horizontal_first(in_w: u32, in_h: u32, out_w: u32, out_h: u32) -> bool {
    let dy = i64::from(in_h) - i64::from(out_h);
    let dx = i64::from(in_w) - i64::from(out_w);
    !(dy > 0 && dy > dx * 2)
}

/// Quantised weights of one axis: output index `i` reads source pixels
/// `start[i] .. start[i] + len[i]` with weights `weights[i * ksize ..][.. len[i]]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AxisCoeffs {
    pub start: Vec<usize>,
    pub len: Vec<usize>,
    pub ksize: usize,
    pub weights: Vec<i32>,
    /// Fractional bits of the weights.
    pub precision: u32,
}

impl AxisCoeffs {
    fn pil(in_size: u32, out_size: u32, filter: Filter) -> AxisCoeffs {
        let kernel: fn(f64) -> f64 = match filter {
            Filter::Bicubic => pil_bicubic,
            Filter::Lanczos => pil_lanczos,
            Filter::Bilinear => bilinear,
        };
        // Pillow computes the scale from the float box `(0, in_size)`.
        let scale = f64::from(in_size as f32) / f64::from(out_size);
        let float = FloatCoeffs::new(in_size, out_size, scale, filter.support(), kernel);
        let one = f64::from(1u32 << PIL_PRECISION_BITS);
        float.quantise(one, PIL_PRECISION_BITS)
    }

    fn torch(in_size: u32, out_size: u32, filter: Filter) -> AxisCoeffs {
        let kernel: fn(f64) -> f64 = match filter {
            Filter::Bicubic => torch_bicubic,
            Filter::Lanczos => torch_lanczos,
            Filter::Bilinear => bilinear,
        };
        let scale = f64::from(in_size) / f64::from(out_size);
        let float = FloatCoeffs::new(in_size, out_size, scale, filter.support(), kernel);
        // The most bits that keep the largest weight below 2^15 (int16), at most 22.
        let mut precision = 0;
        while precision < TORCH_MAX_PRECISION_BITS {
            let next = (0.5 + float.max_weight * f64::from(1u32 << (precision + 1))) as i32;
            if next >= 1 << 15 {
                break;
            }
            precision += 1;
        }
        let quantised = float.quantise(f64::from(1u32 << precision), precision);
        // torch stores the weights as int16: keep that truncation.
        AxisCoeffs {
            weights: quantised
                .weights
                .iter()
                .map(|&w| i32::from(w as i16))
                .collect(),
            ..quantised
        }
    }

    /// Source rows `[first, end)` that any output index reads.
    fn used_range(&self) -> (usize, usize) {
        let first = self.start.first().copied().unwrap_or(0);
        let end = match (self.start.last(), self.len.last()) {
            (Some(s), Some(l)) => s + l,
            _ => first,
        };
        (first, end.max(first))
    }
}

/// Normalised f64 weights, before quantisation.
struct FloatCoeffs {
    start: Vec<usize>,
    len: Vec<usize>,
    ksize: usize,
    weights: Vec<f64>,
    max_weight: f64,
}

impl FloatCoeffs {
    /// Pillow's `precompute_coeffs`, which torch's `_compute_indices_min_size_weights_aa`
    /// repeats operation for operation.
    fn new(
        in_size: u32,
        out_size: u32,
        scale: f64,
        filter_support: f64,
        kernel: fn(f64) -> f64,
    ) -> FloatCoeffs {
        let filter_scale = scale.max(1.0);
        let support = filter_support * filter_scale;
        let ksize = support.ceil() as usize * 2 + 1;
        let inv_filter_scale = 1.0 / filter_scale;
        let out = out_size as usize;
        let mut start = Vec::with_capacity(out);
        let mut len = Vec::with_capacity(out);
        let mut weights = vec![0.0f64; out * ksize];
        let mut max_weight = 0.0f64;
        for (i, row) in weights.chunks_exact_mut(ksize).enumerate() {
            let center = (i as f64 + 0.5) * scale;
            let xmin = ((center - support + 0.5) as i64).max(0);
            let xmax = ((center + support + 0.5) as i64).min(i64::from(in_size));
            // Rounding can make the window one wider than ksize; torch clips it there.
            let n = (xmax - xmin).clamp(0, ksize as i64) as usize;
            let mut total = 0.0;
            for (j, w) in row[..n].iter_mut().enumerate() {
                *w = kernel(((j as i64 + xmin) as f64 - center + 0.5) * inv_filter_scale);
                total += *w;
            }
            if total != 0.0 {
                for w in &mut row[..n] {
                    *w /= total;
                    max_weight = max_weight.max(*w);
                }
            }
            start.push(xmin as usize);
            len.push(n);
        }
        FloatCoeffs {
            start,
            len,
            ksize,
            weights,
            max_weight,
        }
    }

    fn quantise(self, one: f64, precision: u32) -> AxisCoeffs {
        let weights = self
            .weights
            .iter()
            .map(|&w| {
                let v = w * one;
                // C's (int) cast truncates toward zero, as `as` does.
                if v < 0.0 {
                    (-0.5 + v) as i32
                } else {
                    (0.5 + v) as i32
                }
            })
            .collect();
        AxisCoeffs {
            start: self.start,
            len: self.len,
            ksize: self.ksize,
            weights,
            precision,
        }
    }
}

fn bilinear(x: f64) -> f64 {
    let x = x.abs();
    if x < 1.0 {
        1.0 - x
    } else {
        0.0
    }
}

/// Pillow's `bicubic_filter` (a = -0.5), in its operation order.
fn pil_bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// torch's `HelperInterpCubic::aa_filter` (a = -0.5): `cubic_convolution1/2`, whose outer
/// branch rounds differently from Pillow's.
fn torch_bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A
    } else {
        0.0
    }
}

fn sinc(x: f64) -> f64 {
    if x == 0.0 {
        return 1.0;
    }
    let x = x * std::f64::consts::PI;
    x.sin() / x
}

/// Pillow's `lanczos_filter`: the window is `[-3, 3)`.
fn pil_lanczos(x: f64) -> f64 {
    if (-3.0..3.0).contains(&x) {
        sinc(x) * sinc(x / 3.0)
    } else {
        0.0
    }
}

/// torch's `HelperInterpLanczos::aa_filter`: the window is `|x| < 3`.
fn torch_lanczos(x: f64) -> f64 {
    let x = x.abs();
    if x < 3.0 {
        sinc(x) * sinc(x / 3.0)
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(width: u32, height: u32, seed: u32) -> DecodedImage {
        let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        let data = (0..width as usize * height as usize * CHANNELS)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                (state >> 24) as u8
            })
            .collect();
        DecodedImage {
            width,
            height,
            data,
        }
    }

    #[test]
    fn pil_pass_order_follows_pillow_13() {
        // Width grows while height shrinks: vertical first.
        assert!(!pil_horizontal_first(640, 480, 644, 476));
        // Both shrink by the same amount: horizontal first.
        assert!(pil_horizontal_first(640, 480, 600, 440));
        // Height shrinks by more than twice the width: vertical first.
        assert!(!pil_horizontal_first(640, 480, 620, 400));
        // Height grows: horizontal first.
        assert!(pil_horizontal_first(640, 480, 600, 500));
    }

    #[test]
    fn weights_sum_to_one_in_fixed_point() {
        for (backend, filter) in [
            (Backend::Pil, Filter::Bicubic),
            (Backend::Pil, Filter::Lanczos),
            (Backend::TorchU8, Filter::Bicubic),
            (Backend::TorchU8, Filter::Bilinear),
        ] {
            for (n_in, n_out) in [(640, 644), (1000, 37), (3, 1000), (1, 5)] {
                let c = match backend {
                    Backend::Pil => AxisCoeffs::pil(n_in, n_out, filter),
                    Backend::TorchU8 => AxisCoeffs::torch(n_in, n_out, filter),
                };
                let one = 1i64 << c.precision;
                for i in 0..n_out as usize {
                    let sum: i64 = c.weights[i * c.ksize..][..c.len[i]]
                        .iter()
                        .map(|&w| i64::from(w))
                        .sum();
                    // Rounding each weight may move the sum by a few units.
                    assert!(
                        (sum - one).abs() <= c.ksize as i64,
                        "{backend:?} {sum} {one}"
                    );
                    assert!(c.start[i] + c.len[i] <= n_in as usize);
                }
            }
        }
    }

    #[test]
    fn torch_precision_keeps_weights_in_int16() {
        let c = AxisCoeffs::torch(1, 100, Filter::Bicubic);
        assert!(c.precision <= TORCH_MAX_PRECISION_BITS);
        assert!(c.weights.iter().all(|&w| w.abs() < 1 << 15));
        // A one-pixel source upscaled: every weight is exactly one.
        assert!(c
            .weights
            .iter()
            .step_by(c.ksize)
            .all(|&w| w == 1 << c.precision));
    }

    #[test]
    fn constant_image_stays_constant() {
        let img = DecodedImage {
            width: 37,
            height: 23,
            data: vec![200; 37 * 23 * 3],
        };
        for backend in [Backend::Pil, Backend::TorchU8] {
            for filter in [Filter::Bicubic, Filter::Lanczos, Filter::Bilinear] {
                for (w, h) in [(50, 10), (10, 50), (37, 5), (3, 23), (111, 77)] {
                    let out = resize(&img, w, h, filter, backend).unwrap();
                    assert_eq!(out.data.len(), (w * h * 3) as usize);
                    assert!(out.data.iter().all(|&v| v == 200), "{backend:?} {filter:?}");
                }
            }
        }
    }

    #[test]
    fn same_size_is_a_copy() {
        let img = image(13, 7, 3);
        let out = resize(&img, 13, 7, Filter::Bicubic, Backend::Pil).unwrap();
        assert_eq!(out, img);
    }

    #[test]
    fn pass_order_changes_pil_output() {
        // The reason the order matters: the intermediate is clamped and rounded to u8.
        let img = image(640, 480, 9);
        let out = resize(&img, 644, 476, Filter::Bicubic, Backend::Pil).unwrap();
        let h = AxisCoeffs::pil(640, 644, Filter::Bicubic);
        let v = AxisCoeffs::pil(480, 476, Filter::Bicubic);
        let k = kernels::Kernels::native();
        let temp = k.horizontal(&img.data, 640, 0, 480, &h);
        let horizontal_first = k.vertical(&temp, 644, &v, 0);
        assert_ne!(out.data, horizontal_first);
    }

    #[test]
    fn simd_kernels_equal_native() {
        let detected = kernels::Kernels::detect();
        if !detected.uses_avx2() {
            eprintln!("no AVX2 on this CPU: only the native kernels exist here");
        }
        let native = kernels::Kernels::native();
        for (i, &(w, h, ow, oh)) in [
            (97, 61, 301, 17),
            (640, 480, 644, 476),
            (5, 300, 1, 299),
            (1000, 7, 13, 9),
            (3, 3, 700, 5),
            (2, 1, 1, 1),
        ]
        .iter()
        .enumerate()
        {
            let img = image(w, h, i as u32);
            for backend in [Backend::Pil, Backend::TorchU8] {
                for filter in [Filter::Bicubic, Filter::Lanczos, Filter::Bilinear] {
                    let (hc, vc) = match backend {
                        Backend::Pil => (
                            AxisCoeffs::pil(w, ow, filter),
                            AxisCoeffs::pil(h, oh, filter),
                        ),
                        Backend::TorchU8 => (
                            AxisCoeffs::torch(w, ow, filter),
                            AxisCoeffs::torch(h, oh, filter),
                        ),
                    };
                    let a = detected.horizontal(&img.data, w as usize, 0, h as usize, &hc);
                    let b = native.horizontal(&img.data, w as usize, 0, h as usize, &hc);
                    assert_eq!(a, b);
                    assert_eq!(
                        detected.vertical(&a, ow as usize, &vc, 0),
                        native.vertical(&b, ow as usize, &vc, 0)
                    );
                }
            }
        }
    }

    #[test]
    fn refuses_bad_input() {
        let img = image(4, 4, 1);
        let err = resize(&img, 0, 3, Filter::Bicubic, Backend::Pil).unwrap_err();
        assert_eq!(err.code(), "resize.empty_target");
        let err = resize(&img, 1 << 15, 1 << 15, Filter::Bicubic, Backend::Pil).unwrap_err();
        assert_eq!(err.code(), "resize.target_too_large");
        let short = DecodedImage {
            width: 4,
            height: 4,
            data: vec![0; 47],
        };
        let err = resize(&short, 2, 2, Filter::Bicubic, Backend::Pil).unwrap_err();
        assert_eq!(err.code(), "resize.buffer_size");
        assert_eq!(
            Filter::from_pil_code(0).unwrap_err().code(),
            "resize.unknown_filter"
        );
        assert_eq!(Filter::from_pil_code(1).unwrap(), Filter::Lanczos);
        assert_eq!(
            Backend::from_name("cv2").unwrap_err().code(),
            "resize.unknown_backend"
        );
    }
}
