//! The two 1-D convolution passes over interleaved RGB8.
//!
//! One generic body per pass is the reference ("native"). On x86-64 with AVX2 the vertical
//! pass is the same body compiled for AVX2, and the horizontal pass is `x86::horizontal`.
//! All are exact integer arithmetic, so they agree bit for bit; the tests check it.

use super::{AxisCoeffs, CHANNELS};
use crate::common::huge_pages;

#[derive(Debug, Clone, Copy)]
pub(crate) struct Kernels {
    avx2: bool,
}

impl Kernels {
    /// The fastest kernels this CPU runs.
    pub fn detect() -> Kernels {
        #[cfg(target_arch = "x86_64")]
        {
            Kernels {
                avx2: std::arch::is_x86_feature_detected!("avx2"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            Kernels { avx2: false }
        }
    }

    /// The portable reference kernels.
    #[cfg(test)]
    pub fn native() -> Kernels {
        Kernels { avx2: false }
    }

    #[cfg(test)]
    pub fn uses_avx2(&self) -> bool {
        self.avx2
    }

    /// Resamples rows `first_row..end_row` of `src` (width `src_width`) along x.
    pub fn horizontal(
        &self,
        src: &[u8],
        src_width: usize,
        first_row: usize,
        end_row: usize,
        coeffs: &AxisCoeffs,
    ) -> Vec<u8> {
        let out_width = coeffs.start.len();
        let mut out = huge_pages::zeroed_bytes((end_row - first_row) * out_width * CHANNELS);
        let rows = &src[first_row * src_width * CHANNELS..end_row * src_width * CHANNELS];
        #[cfg(target_arch = "x86_64")]
        if self.avx2 {
            let weights = super::x86::PairWeights::new(coeffs);
            // SAFETY: the CPU supports AVX2 (checked in `detect`).
            unsafe { super::x86::horizontal(rows, src_width, coeffs, &weights, &mut out) };
            return out;
        }
        horizontal_pass(rows, src_width, coeffs, &mut out);
        out
    }

    /// Resamples `src` (width `width`, first row being source row `row_offset`) along y.
    pub fn vertical(
        &self,
        src: &[u8],
        width: usize,
        coeffs: &AxisCoeffs,
        row_offset: usize,
    ) -> Vec<u8> {
        let mut out = huge_pages::zeroed_bytes(coeffs.start.len() * width * CHANNELS);
        #[cfg(target_arch = "x86_64")]
        if self.avx2 {
            // SAFETY: the CPU supports AVX2 (checked in `detect`).
            unsafe { vertical_avx2(src, width, coeffs, row_offset, &mut out) };
            return out;
        }
        vertical_pass(src, width, coeffs, row_offset, &mut out);
        out
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn vertical_avx2(
    src: &[u8],
    width: usize,
    coeffs: &AxisCoeffs,
    row_offset: usize,
    out: &mut [u8],
) {
    vertical_pass(src, width, coeffs, row_offset, out)
}

#[inline(always)]
fn to_u8(acc: i32, precision: u32) -> u8 {
    (acc >> precision).clamp(0, 255) as u8
}

#[inline(always)]
fn horizontal_pass(src: &[u8], src_width: usize, coeffs: &AxisCoeffs, out: &mut [u8]) {
    let out_width = coeffs.start.len();
    let half = (1i32 << coeffs.precision) >> 1;
    let precision = coeffs.precision;
    for (src_row, out_row) in src
        .chunks_exact(src_width * CHANNELS)
        .zip(out.chunks_exact_mut(out_width * CHANNELS))
    {
        for (x, px) in out_row.chunks_exact_mut(CHANNELS).enumerate() {
            let (start, len) = (coeffs.start[x], coeffs.len[x]);
            let weights = &coeffs.weights[x * coeffs.ksize..][..len];
            let window = &src_row[start * CHANNELS..][..len * CHANNELS];
            let (mut r, mut g, mut b) = (half, half, half);
            for (p, &w) in window.chunks_exact(CHANNELS).zip(weights) {
                r += i32::from(p[0]) * w;
                g += i32::from(p[1]) * w;
                b += i32::from(p[2]) * w;
            }
            px[0] = to_u8(r, precision);
            px[1] = to_u8(g, precision);
            px[2] = to_u8(b, precision);
        }
    }
}

#[inline(always)]
fn vertical_pass(src: &[u8], width: usize, coeffs: &AxisCoeffs, row_offset: usize, out: &mut [u8]) {
    let row_len = width * CHANNELS;
    let half = (1i32 << coeffs.precision) >> 1;
    let mut acc = vec![0i32; row_len];
    for (y, out_row) in out.chunks_exact_mut(row_len).enumerate() {
        acc.fill(half);
        let first = coeffs.start[y] - row_offset;
        let weights = &coeffs.weights[y * coeffs.ksize..][..coeffs.len[y]];
        let mut taps = weights.iter().enumerate();
        // Two source rows per sweep halves the traffic on the accumulator row.
        while let (Some((t0, &w0)), next) = (taps.next(), taps.next()) {
            let row0 = &src[(first + t0) * row_len..][..row_len];
            match next {
                Some((t1, &w1)) => {
                    let row1 = &src[(first + t1) * row_len..][..row_len];
                    for ((a, &p0), &p1) in acc.iter_mut().zip(row0).zip(row1) {
                        *a += i32::from(p0) * w0 + i32::from(p1) * w1;
                    }
                }
                None => {
                    for (a, &p0) in acc.iter_mut().zip(row0) {
                        *a += i32::from(p0) * w0;
                    }
                }
            }
        }
        for (o, &a) in out_row.iter_mut().zip(&acc) {
            *o = to_u8(a, coeffs.precision);
        }
    }
}
