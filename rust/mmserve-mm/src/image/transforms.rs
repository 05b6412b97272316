//! Rescale + normalise + patchify in one pass from the resized u8 image to the model input.
//!
//! Every u8 value maps to one f32 per channel, so a 3 x 256 table built with exactly the
//! float operations of the reference makes the output bit-identical by construction:
//!
//! - [`Convention::PilNumpy`] (`Qwen2VLImageProcessorPil`): `rescale` multiplies in float64
//!   and casts to float32, then `normalize` computes `(x - mean) / std` in float32.
//! - [`Convention::Torchvision`] (`Qwen2VLImageProcessor`): rescale is fused into normalize,
//!   `mean / rescale` and `std / rescale` as float32 (`mean_f32 * f32(1 / rescale)`), then
//!   `(f32(x) - mean') / std'` in float32.
//!
//! The patch order is HF's: rows are `(gh / m, gw / m, m, m)` over the patch grid, each row
//! is `(C, temporal, p, p)`, with a still image repeated over the temporal patch and a video's
//! consecutive frames filling it.

use std::mem::MaybeUninit;

use thiserror::Error;

use crate::error::ErrorCode;
use crate::image::resize::ImageView;
use crate::pipeline::DecodedImage;

const CHANNELS: usize = 3;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TransformError {
    #[error("unknown normalisation convention {0:?} (supported: pil, torchvision)")]
    UnknownConvention(String),
    #[error("std of channel {channel} is {value}; it must be finite and non-zero")]
    BadStd { channel: usize, value: f64 },
    #[error("patch geometry needs non-zero sizes, got patch {patch}, merge {merge}, temporal {temporal}")]
    BadGeometry {
        patch: u32,
        merge: u32,
        temporal: u32,
    },
    #[error("image of {width}x{height} is not a multiple of {factor} on both sides")]
    NotDivisible {
        width: u32,
        height: u32,
        factor: u32,
    },
    #[error("image of {width}x{height} RGB needs {expected} bytes, got {actual}")]
    ImageBufferSize {
        width: u32,
        height: u32,
        expected: usize,
        actual: usize,
    },
    #[error("output buffer holds {actual} values, the patches need {expected}")]
    OutputSize { expected: usize, actual: usize },
    #[error("a temporal patch takes {expected} frames, got {actual}")]
    FrameCount { expected: usize, actual: usize },
}

impl TransformError {
    /// This error's entry in the catalogue of codes.
    pub fn kind(&self) -> ErrorCode {
        match self {
            TransformError::UnknownConvention(_) => ErrorCode::TransformUnknownConvention,
            TransformError::BadStd { .. } => ErrorCode::TransformBadStd,
            TransformError::BadGeometry { .. } => ErrorCode::TransformBadGeometry,
            TransformError::NotDivisible { .. } => ErrorCode::TransformNotDivisible,
            TransformError::ImageBufferSize { .. } => ErrorCode::TransformImageBufferSize,
            TransformError::OutputSize { .. } => ErrorCode::TransformOutputSize,
            TransformError::FrameCount { .. } => ErrorCode::TransformFrameCount,
        }
    }

    /// Stable machine-readable code, e.g. `transform.unknown_convention`.
    pub fn code(&self) -> &'static str {
        self.kind().code()
    }
}

/// Whose float arithmetic the normalised values must reproduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Convention {
    /// numpy, as the PIL-backed HF processors run it.
    PilNumpy,
    /// torch, as the torchvision-backed HF processors run it.
    Torchvision,
}

impl Convention {
    /// From `pil` or `torchvision`.
    pub fn from_name(name: &str) -> Result<Convention, TransformError> {
        match name {
            "pil" => Ok(Convention::PilNumpy),
            "torchvision" => Ok(Convention::Torchvision),
            other => Err(TransformError::UnknownConvention(other.to_owned())),
        }
    }
}

/// The normalised value of every u8 per channel.
#[derive(Debug, Clone, PartialEq)]
pub struct NormalizeLut {
    table: [[f32; 256]; CHANNELS],
}

impl NormalizeLut {
    /// `mean`, `std` and `rescale` as the processor config holds them (Python floats).
    pub fn new(
        mean: [f64; CHANNELS],
        std: [f64; CHANNELS],
        rescale: f64,
        convention: Convention,
    ) -> Result<NormalizeLut, TransformError> {
        for (channel, &value) in std.iter().enumerate() {
            if value == 0.0 || !value.is_finite() {
                return Err(TransformError::BadStd { channel, value });
            }
        }
        let mut table = [[0.0f32; 256]; CHANNELS];
        for (c, row) in table.iter_mut().enumerate() {
            match convention {
                Convention::PilNumpy => {
                    let (mean, std) = (mean[c] as f32, std[c] as f32);
                    for (v, out) in row.iter_mut().enumerate() {
                        let rescaled = (v as f64 * rescale) as f32;
                        *out = (rescaled - mean) / std;
                    }
                }
                Convention::Torchvision => {
                    let inverse = (1.0 / rescale) as f32;
                    let (mean, std) = (mean[c] as f32 * inverse, std[c] as f32 * inverse);
                    for (v, out) in row.iter_mut().enumerate() {
                        *out = (v as f32 - mean) / std;
                    }
                }
            }
        }
        Ok(NormalizeLut { table })
    }

    /// The normalised value of `value` in `channel` (0 = R, 1 = G, 2 = B).
    pub fn value(&self, channel: usize, value: u8) -> f32 {
        self.table[channel][usize::from(value)]
    }
}

/// Vision-encoder patch sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PatchGeometry {
    pub patch: u32,
    pub merge: u32,
    pub temporal: u32,
}

/// Shape of the patch matrix for one image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PatchGrid {
    pub grid_h: u32,
    pub grid_w: u32,
    /// `grid_h * grid_w` (one frame).
    pub rows: usize,
    /// `3 * temporal * patch * patch`.
    pub cols: usize,
}

impl PatchGrid {
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl PatchGeometry {
    /// The patch grid of a `width` x `height` image; both sides must be multiples of
    /// `patch * merge` (what `smart_resize` produces).
    pub fn grid(&self, width: u32, height: u32) -> Result<PatchGrid, TransformError> {
        if self.patch == 0 || self.merge == 0 || self.temporal == 0 {
            return Err(TransformError::BadGeometry {
                patch: self.patch,
                merge: self.merge,
                temporal: self.temporal,
            });
        }
        let factor = self.patch * self.merge;
        if width == 0
            || height == 0
            || !width.is_multiple_of(factor)
            || !height.is_multiple_of(factor)
        {
            return Err(TransformError::NotDivisible {
                width,
                height,
                factor,
            });
        }
        let (grid_h, grid_w) = (height / self.patch, width / self.patch);
        let p = self.patch as usize;
        Ok(PatchGrid {
            grid_h,
            grid_w,
            rows: grid_h as usize * grid_w as usize,
            cols: CHANNELS * self.temporal as usize * p * p,
        })
    }
}

/// Writes `image`'s normalised patches into `out` (length `grid.len()`), in HF's order.
pub fn patchify_into(
    image: &DecodedImage,
    lut: &NormalizeLut,
    geometry: PatchGeometry,
    out: &mut [f32],
) -> Result<PatchGrid, TransformError> {
    write_patches(image.into(), lut, geometry, out, |v| v, copy_row)
}

/// Writes the patches of one temporal group of video frames (`geometry.temporal` frames of
/// one size, in order) into `out` (length `grid.len()`).
pub fn patchify_frames_into(
    frames: &[ImageView<'_>],
    lut: &NormalizeLut,
    geometry: PatchGeometry,
    out: &mut [f32],
) -> Result<PatchGrid, TransformError> {
    let Some(first) = frames.first() else {
        return Err(TransformError::FrameCount {
            expected: geometry.temporal as usize,
            actual: 0,
        });
    };
    if frames.len() != geometry.temporal as usize {
        return Err(TransformError::FrameCount {
            expected: geometry.temporal as usize,
            actual: frames.len(),
        });
    }
    for frame in frames {
        if (frame.width, frame.height) != (first.width, first.height) {
            return Err(TransformError::ImageBufferSize {
                width: first.width,
                height: first.height,
                expected: first.width as usize * first.height as usize * CHANNELS,
                actual: frame.data.len(),
            });
        }
    }
    let planes: Vec<&[u8]> = frames.iter().map(|f| f.data).collect();
    write_group(
        first.width,
        first.height,
        &planes,
        lut,
        geometry,
        out,
        |v| v,
        copy_row,
    )
}

/// Allocates and fills the `[rows, cols]` f32 patch matrix.
pub fn patchify(
    image: &DecodedImage,
    lut: &NormalizeLut,
    geometry: PatchGeometry,
) -> Result<(Vec<f32>, PatchGrid), TransformError> {
    patchify_view(image.into(), lut, geometry)
}

/// [`patchify`] of a borrowed image.
pub fn patchify_view(
    image: ImageView<'_>,
    lut: &NormalizeLut,
    geometry: PatchGeometry,
) -> Result<(Vec<f32>, PatchGrid), TransformError> {
    let grid = geometry.grid(image.width, image.height)?;
    let mut out = crate::common::huge_pages::with_capacity(grid.len());
    // Every element is written exactly once, so the buffer is never zero-filled first:
    // that fill was as much memory traffic as the patches themselves.
    let spare = out.spare_capacity_mut();
    write_patches(image, lut, geometry, spare, MaybeUninit::new, stream_row)?;
    // SAFETY: `write_patches` succeeded, so it wrote all `grid.len()` elements.
    unsafe { out.set_len(grid.len()) };
    Ok((out, grid))
}

fn copy_row<T: Copy>(row: &[T], destination: &mut [T]) {
    destination.copy_from_slice(row);
}

/// Copies a finished row with non-temporal stores where the alignment allows: the output
/// is far larger than the caches and is not read back here, so this skips reading every
/// destination line before writing it.
fn stream_row(row: &[MaybeUninit<f32>], destination: &mut [MaybeUninit<f32>]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_loadu_ps, _mm_sfence, _mm_stream_ps};
        let aligned =
            (destination.as_ptr() as usize).is_multiple_of(16) && row.len().is_multiple_of(4);
        if aligned && destination.len() == row.len() {
            // SAFETY: SSE is part of x86-64; both slices hold `row.len()` f32 (every
            // element of `row` was written), the destination is 16-byte aligned and the
            // length a multiple of 4; the fence orders the streamed stores before later ones.
            unsafe {
                let src = row.as_ptr() as *const f32;
                let dst = destination.as_mut_ptr() as *mut f32;
                for i in (0..row.len()).step_by(4) {
                    _mm_stream_ps(dst.add(i), _mm_loadu_ps(src.add(i)));
                }
                _mm_sfence();
            }
            return;
        }
    }
    destination.copy_from_slice(row);
}

/// Round-to-nearest-even truncation of an f32 to its top 16 bits (NaN kept quiet).
pub fn f32_to_bf16_bits(value: f32) -> u16 {
    let bits = value.to_bits();
    if value.is_nan() {
        return ((bits >> 16) | 0x0040) as u16;
    }
    let rounding = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(rounding) >> 16) as u16
}

fn write_patches<T: Copy>(
    image: ImageView<'_>,
    lut: &NormalizeLut,
    geometry: PatchGeometry,
    out: &mut [T],
    convert: impl Fn(f32) -> T,
    emit: impl Fn(&[T], &mut [T]),
) -> Result<PatchGrid, TransformError> {
    // The one frame over the whole temporal patch.
    let planes = vec![image.data; geometry.temporal.max(1) as usize];
    write_group(
        image.width,
        image.height,
        &planes,
        lut,
        geometry,
        out,
        convert,
        emit,
    )
}

#[allow(clippy::too_many_arguments)] // the private core of the two public entry points
fn write_group<T: Copy>(
    width: u32,
    height: u32,
    planes: &[&[u8]],
    lut: &NormalizeLut,
    geometry: PatchGeometry,
    out: &mut [T],
    convert: impl Fn(f32) -> T,
    emit: impl Fn(&[T], &mut [T]),
) -> Result<PatchGrid, TransformError> {
    let grid = geometry.grid(width, height)?;
    let expected_bytes = width as usize * height as usize * CHANNELS;
    if let Some(bad) = planes.iter().find(|p| p.len() != expected_bytes) {
        return Err(TransformError::ImageBufferSize {
            width,
            height,
            expected: expected_bytes,
            actual: bad.len(),
        });
    }
    if out.len() != grid.len() {
        return Err(TransformError::OutputSize {
            expected: grid.len(),
            actual: out.len(),
        });
    }
    // Each channel's value for every u8, converted once.
    let table: Vec<[T; 256]> = lut
        .table
        .iter()
        .map(|row| std::array::from_fn(|v| convert(row[v])))
        .collect();

    let rows = PatchRows {
        planes,
        row_bytes: width as usize * CHANNELS,
        merge: geometry.merge as usize,
        temporal: geometry.temporal as usize,
        blocks_w: grid.grid_w as usize / geometry.merge as usize,
        cols: grid.cols,
    };
    // The usual patch sizes as constants, so the per-row loops unroll.
    match geometry.patch {
        14 => rows.fill(14, &table, out, &emit),
        16 => rows.fill(16, &table, out, &emit),
        p => rows.fill(p as usize, &table, out, &emit),
    }
    Ok(grid)
}

/// What [`write_patches`] needs to fill the patch rows of one image.
struct PatchRows<'a> {
    /// One frame per temporal slot; a still image is the same slice in each.
    planes: &'a [&'a [u8]],
    row_bytes: usize,
    merge: usize,
    temporal: usize,
    blocks_w: usize,
    cols: usize,
}

impl PatchRows<'_> {
    /// Builds each row in a small staging buffer (it stays in L1) and hands it to `emit`,
    /// which writes it to its place in `out`.
    #[inline(always)]
    fn fill<T: Copy>(
        &self,
        p: usize,
        table: &[[T; 256]],
        out: &mut [T],
        emit: &impl Fn(&[T], &mut [T]),
    ) {
        let m = self.merge;
        let plane = p * p;
        let channel_stride = self.temporal * plane;
        let mut row = vec![table[0][0]; self.cols];
        for (index, destination) in out.chunks_exact_mut(self.cols).enumerate() {
            // Row index -> (block_y, block_x, within-block y, within-block x).
            let (block, within) = (index / (m * m), index % (m * m));
            let patch_y = (block / self.blocks_w) * m + within / m;
            let patch_x = (block % self.blocks_w) * m + within % m;
            for (t, data) in self.planes.iter().enumerate().take(self.temporal) {
                if t > 0 && std::ptr::eq(*data, self.planes[0]) {
                    // A repeated frame: copy the values instead of looking them up again.
                    for c in 0..CHANNELS {
                        let base = c * channel_stride;
                        row.copy_within(base..base + plane, base + t * plane);
                    }
                    continue;
                }
                for py in 0..p {
                    let y = patch_y * p + py;
                    let src = &data[y * self.row_bytes + patch_x * p * CHANNELS..][..p * CHANNELS];
                    for (c, lut) in table.iter().enumerate() {
                        let dst = &mut row[c * channel_stride + t * plane + py * p..][..p];
                        for (d, rgb) in dst.iter_mut().zip(src.chunks_exact(CHANNELS)) {
                            *d = lut[usize::from(rgb[c])];
                        }
                    }
                }
            }
            emit(&row, destination);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLIP_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
    const CLIP_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];

    #[test]
    fn lut_matches_the_float_formulas() {
        let pil =
            NormalizeLut::new(CLIP_MEAN, CLIP_STD, 1.0 / 255.0, Convention::PilNumpy).unwrap();
        let tv =
            NormalizeLut::new(CLIP_MEAN, CLIP_STD, 1.0 / 255.0, Convention::Torchvision).unwrap();
        let expected = ((128.0f64 / 255.0) as f32 - CLIP_MEAN[1] as f32) / CLIP_STD[1] as f32;
        assert_eq!(pil.value(1, 128), expected);
        // The two conventions round differently somewhere in the range.
        let differ = (0..=255u8).any(|v| (0..3).any(|c| pil.value(c, v) != tv.value(c, v)));
        assert!(differ);
        assert!((pil.value(0, 255) - tv.value(0, 255)).abs() < 1e-5);
    }

    #[test]
    fn patch_order_matches_hf_reshape() {
        // 2x2 patches of 2 pixels, merge 2: a 4x4 image has exactly one merge block; an 8x4
        // image has two blocks side by side.
        let geometry = PatchGeometry {
            patch: 2,
            merge: 2,
            temporal: 2,
        };
        let (w, h) = (8u32, 4u32);
        let data: Vec<u8> = (0..(w * h * 3) as usize).map(|i| i as u8).collect();
        let image = DecodedImage {
            width: w,
            height: h,
            data,
        };
        let identity = NormalizeLut::new([0.0; 3], [1.0; 3], 1.0, Convention::PilNumpy).unwrap();
        let (out, grid) = patchify(&image, &identity, geometry).unwrap();
        assert_eq!(
            (grid.grid_h, grid.grid_w, grid.rows, grid.cols),
            (2, 4, 8, 24)
        );
        let pixel = |y: usize, x: usize, c: usize| ((y * w as usize + x) * 3 + c) as f32;
        for row in 0..grid.rows {
            // Rows: (block_y, block_x, my, mx) with one block row and two block columns.
            let (block_x, my, mx) = (row / 4, (row % 4) / 2, row % 2);
            let (gy, gx) = (my, block_x * 2 + mx);
            for c in 0..3 {
                for t in 0..2 {
                    for py in 0..2 {
                        for px in 0..2 {
                            let col = ((c * 2 + t) * 2 + py) * 2 + px;
                            let expected = pixel(gy * 2 + py, gx * 2 + px, c);
                            assert_eq!(out[row * grid.cols + col], expected, "{row} {col}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(f32_to_bf16_bits(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between two bf16 values: ties go to even.
        assert_eq!(f32_to_bf16_bits(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(f32_to_bf16_bits(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(f32_to_bf16_bits(-2.5), 0xc020);
    }

    #[test]
    fn refuses_bad_geometry_and_buffers() {
        let image = DecodedImage {
            width: 28,
            height: 30,
            data: vec![0; 28 * 30 * 3],
        };
        let lut =
            NormalizeLut::new(CLIP_MEAN, CLIP_STD, 1.0 / 255.0, Convention::PilNumpy).unwrap();
        let geometry = PatchGeometry {
            patch: 14,
            merge: 2,
            temporal: 2,
        };
        let err = patchify(&image, &lut, geometry).unwrap_err();
        assert_eq!(err.code(), "transform.not_divisible");
        let ok = DecodedImage {
            width: 28,
            height: 28,
            data: vec![0; 28 * 28 * 3],
        };
        let mut small = vec![0.0; 10];
        let err = patchify_into(&ok, &lut, geometry, &mut small).unwrap_err();
        assert_eq!(err.code(), "transform.output_size");
        let err = NormalizeLut::new(CLIP_MEAN, [1.0, 0.0, 1.0], 1.0, Convention::PilNumpy);
        assert_eq!(err.unwrap_err().code(), "transform.bad_std");
        let zero = PatchGeometry {
            patch: 0,
            merge: 2,
            temporal: 2,
        };
        assert_eq!(
            zero.grid(28, 28).unwrap_err().code(),
            "transform.bad_geometry"
        );
    }
}
