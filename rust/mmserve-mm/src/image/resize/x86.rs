//! AVX2 horizontal pass for interleaved RGB8 (x86-64 only, picked at run time).
//!
//! For each output pixel, taps go two at a time through `pmaddwd`: one shuffle lays out
//! `[r0 r1 g0 g1 b0 b1 0 0]` as i16, one multiply-add against `[w0 w1]` gives the three
//! channel partial sums in i32. Weights must fit i16, which torch's do; Pillow's 22-bit
//! weights are split as `w = hi * 2^11 + lo` with `lo` in `0..2^11`, summed as two exact
//! integer dot products and recombined, so the result is the native kernel's bit for bit.

use std::arch::x86_64::*;

use super::{AxisCoeffs, CHANNELS};

/// Bits of the low half when a weight does not fit i16.
const SPLIT_BITS: u32 = 11;

/// Zero bytes after each staged source row, for pair loads past the last window.
const ROW_PADDING: usize = 32;

/// Tap-pair weights of one axis, packed for `pmaddwd`: per output pixel `pairs` i32 words
/// holding `(w[2j] as i16, w[2j + 1] as i16)`, zero-padded past the window.
pub(crate) struct PairWeights {
    pairs: usize,
    high: Vec<i32>,
    /// Low halves when the weights were split; `None` when they fit i16 as they are.
    low: Option<Vec<i32>>,
}

impl PairWeights {
    pub fn new(coeffs: &AxisCoeffs) -> PairWeights {
        let fits_i16 = coeffs.weights.iter().all(|&w| i32::from(w as i16) == w);
        let pairs = coeffs.ksize.div_ceil(2);
        let out = coeffs.start.len();
        let pack = |a: i32, b: i32| (a as u16 as u32 | ((b as u16 as u32) << 16)) as i32;
        let mut high = vec![0i32; out * pairs];
        let mut low = (!fits_i16).then(|| vec![0i32; out * pairs]);
        for x in 0..out {
            let weights = &coeffs.weights[x * coeffs.ksize..][..coeffs.len[x]];
            for j in 0..pairs {
                let w0 = weights.get(2 * j).copied().unwrap_or(0);
                let w1 = weights.get(2 * j + 1).copied().unwrap_or(0);
                match low.as_mut() {
                    None => high[x * pairs + j] = pack(w0, w1),
                    Some(low) => {
                        let lo_mask = (1 << SPLIT_BITS) - 1;
                        high[x * pairs + j] = pack(w0 >> SPLIT_BITS, w1 >> SPLIT_BITS);
                        low[x * pairs + j] = pack(w0 & lo_mask, w1 & lo_mask);
                    }
                }
            }
        }
        PairWeights { pairs, high, low }
    }
}

/// Spreads the 6 bytes of pixels `i, i + 1` at `ptr` to `[r0 r1 g0 g1 b0 b1 0 0]` as i16.
///
/// # Safety
/// `ptr .. ptr + 8` must be readable.
#[inline(always)]
unsafe fn load_pair(ptr: *const u8, spread: __m128i) -> __m128i {
    // SAFETY: the caller guarantees 8 readable bytes at `ptr` (and SSSE3, implied by AVX2).
    unsafe { _mm_shuffle_epi8(_mm_loadl_epi64(ptr as *const __m128i), spread) }
}

/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn horizontal(
    src: &[u8],
    src_width: usize,
    coeffs: &AxisCoeffs,
    weights: &PairWeights,
    out: &mut [u8],
) {
    // SAFETY: the caller guarantees AVX2.
    unsafe {
        match &weights.low {
            None => horizontal_rows::<false>(src, src_width, coeffs, weights, &[], out),
            Some(low) => horizontal_rows::<true>(src, src_width, coeffs, weights, low, out),
        }
    }
}

#[inline(always)]
unsafe fn horizontal_rows<const SPLIT: bool>(
    src: &[u8],
    src_width: usize,
    coeffs: &AxisCoeffs,
    weights: &PairWeights,
    low: &[i32],
    out: &mut [u8],
) {
    // SAFETY: only reached from `horizontal` (AVX2 present). Every pair load reads within
    // `padded`: a window ends inside the row and ROW_PADDING covers the 8-byte overread; weight
    // reads stay below `x * pairs + pairs` of vectors sized `out_width * pairs`; stores stay
    // inside `out_row` (four bytes only where a next pixel follows).
    unsafe {
        let out_width = coeffs.start.len();
        let precision = _mm_cvtsi32_si128(coeffs.precision as i32);
        let half = _mm_set1_epi32((1i32 << coeffs.precision) >> 1);
        let spread = _mm_setr_epi8(0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1);
        let row_bytes = src_width * CHANNELS;
        let spread2 = _mm256_broadcastsi128_si256(spread);
        let half2 = _mm256_broadcastsi128_si256(half);
        // Pair loads read 8 bytes from up to two pixels past a window; a copy of the row with
        // zero bytes after it keeps the last pixels of the last row in bounds without checks.
        let mut padded = vec![0u8; row_bytes + ROW_PADDING];
        for (y, out_row) in out.chunks_exact_mut(out_width * CHANNELS).enumerate() {
            let row = &src[y * row_bytes..][..row_bytes];
            padded[..row_bytes].copy_from_slice(row);
            let row_ptr = padded.as_ptr();
            let out_ptr = out_row.as_mut_ptr();
            let mut x = 0;
            // Two output pixels per 256-bit register, one per 128-bit lane. Weights past a
            // pixel's own window are zero, so both run the longer window's pair count.
            while x + 1 < out_width {
                let pairs = coeffs.len[x].max(coeffs.len[x + 1]).div_ceil(2);
                let pixel0 = row_ptr.add(coeffs.start[x] * CHANNELS);
                let pixel1 = row_ptr.add(coeffs.start[x + 1] * CHANNELS);
                let high0 = weights.high.as_ptr().add(x * weights.pairs);
                let high1 = high0.add(weights.pairs);
                let low0 = low.as_ptr().wrapping_add(x * weights.pairs);
                let low1 = low0.wrapping_add(weights.pairs);
                let mut acc = _mm256_setzero_si256();
                let mut acc_low = _mm256_setzero_si256();
                for j in 0..pairs {
                    let bytes = _mm256_inserti128_si256::<1>(
                        _mm256_castsi128_si256(
                            _mm_loadl_epi64(pixel0.add(6 * j) as *const __m128i),
                        ),
                        _mm_loadl_epi64(pixel1.add(6 * j) as *const __m128i),
                    );
                    let pix = _mm256_shuffle_epi8(bytes, spread2);
                    let w = _mm256_setr_epi32(
                        *high0.add(j),
                        *high0.add(j),
                        *high0.add(j),
                        *high0.add(j),
                        *high1.add(j),
                        *high1.add(j),
                        *high1.add(j),
                        *high1.add(j),
                    );
                    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pix, w));
                    if SPLIT {
                        let wl = _mm256_setr_epi32(
                            *low0.add(j),
                            *low0.add(j),
                            *low0.add(j),
                            *low0.add(j),
                            *low1.add(j),
                            *low1.add(j),
                            *low1.add(j),
                            *low1.add(j),
                        );
                        acc_low = _mm256_add_epi32(acc_low, _mm256_madd_epi16(pix, wl));
                    }
                }
                if SPLIT {
                    acc =
                        _mm256_add_epi32(_mm256_slli_epi32::<{ SPLIT_BITS as i32 }>(acc), acc_low);
                }
                let shifted = _mm256_sra_epi32(_mm256_add_epi32(acc, half2), precision);
                let packed = _mm256_packus_epi16(_mm256_packs_epi32(shifted, shifted), shifted);
                let rgb0 = _mm_cvtsi128_si32(_mm256_castsi256_si128(packed));
                let rgb1 = _mm_cvtsi128_si32(_mm256_extracti128_si256::<1>(packed));
                // Four bytes per pixel; each fourth byte is overwritten by the next pixel.
                std::ptr::write_unaligned(out_ptr.add(x * CHANNELS) as *mut i32, rgb0);
                store_rgb(out_ptr.add((x + 1) * CHANNELS), rgb1, x + 2 < out_width);
                x += 2;
            }
            if x < out_width {
                let pairs = coeffs.len[x].div_ceil(2);
                let pixel = row_ptr.add(coeffs.start[x] * CHANNELS);
                let high = weights.high.as_ptr().add(x * weights.pairs);
                let low = low.as_ptr().wrapping_add(x * weights.pairs);
                let mut acc = _mm_setzero_si128();
                let mut acc_low = _mm_setzero_si128();
                for j in 0..pairs {
                    let pix = load_pair(pixel.add(6 * j), spread);
                    acc = _mm_add_epi32(acc, _mm_madd_epi16(pix, _mm_set1_epi32(*high.add(j))));
                    if SPLIT {
                        let wl = _mm_set1_epi32(*low.add(j));
                        acc_low = _mm_add_epi32(acc_low, _mm_madd_epi16(pix, wl));
                    }
                }
                if SPLIT {
                    acc = _mm_add_epi32(_mm_slli_epi32(acc, SPLIT_BITS as i32), acc_low);
                }
                let shifted = _mm_sra_epi32(_mm_add_epi32(acc, half), precision);
                let packed = _mm_packus_epi16(_mm_packs_epi32(shifted, shifted), shifted);
                store_rgb(out_ptr.add(x * CHANNELS), _mm_cvtsi128_si32(packed), false);
            }
        }
    }
}

/// Writes one pixel: four bytes when `room_for_four` (the fourth belongs to the next
/// pixel, written after), else exactly three.
#[inline(always)]
unsafe fn store_rgb(at: *mut u8, rgb: i32, room_for_four: bool) {
    // SAFETY: the caller guarantees `at` is writable for 3 bytes, 4 when `room_for_four`.
    unsafe {
        if room_for_four {
            std::ptr::write_unaligned(at as *mut i32, rgb);
        } else {
            std::ptr::copy_nonoverlapping(rgb.to_le_bytes().as_ptr(), at, CHANNELS);
        }
    }
}
