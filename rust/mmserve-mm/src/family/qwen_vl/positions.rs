//! M-RoPE position ids for prompts with images and videos (transformers' `get_rope_index` for
//! Qwen2-VL, Qwen2.5-VL and Qwen3-VL).

use crate::pipeline::{Positions, ProcessError};

/// One vision item of the prompt: its token run, its patch grid and how far apart its
/// temporal patches sit (`time_interval`: 1 for images and Qwen2-VL video; Qwen2.5-VL's
/// `tokens_per_second * second_per_grid_t` for its video).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VisionBlock {
    pub start: usize,
    pub end: usize,
    pub grid_thw: [u32; 3],
    pub time_interval: f64,
}

/// Text tokens advance the three rows together; a vision item of LLM grid `(t, h, w)` (patch
/// grid divided by `merge` spatially) fills a `t x h x w` block starting at the next position
/// `base`: temporal patch `ti` sits at `base + trunc(ti * time_interval)` (float32 arithmetic,
/// as torch computes it), and the text after a block resumes at `base + max(h, w)` (the
/// temporal extent does not count).
pub fn mrope_blocks(
    len: usize,
    blocks: &[VisionBlock],
    merge: u32,
) -> Result<Positions, ProcessError> {
    if merge == 0 {
        return Err(ProcessError::Offsets("merge size 0".into()));
    }
    let mut positions = vec![0i64; 3 * len];
    let (rows_t, rest) = positions.split_at_mut(len);
    let (rows_h, rows_w) = rest.split_at_mut(len);
    let mut next_position: i64 = 0;
    let mut cursor = 0usize;
    let mut text_run = |from: usize, to: usize, start: i64| {
        for (k, i) in (from..to).enumerate() {
            let p = start + k as i64;
            rows_t[i] = p;
            rows_h[i] = p;
            rows_w[i] = p;
        }
    };
    let mut placed = Vec::with_capacity(blocks.len());
    for (item, block) in blocks.iter().enumerate() {
        let (start, end, grid) = (block.start, block.end, block.grid_thw);
        let [t, h, w] = [grid[0], grid[1] / merge, grid[2] / merge].map(|v| v as usize);
        let fits = t.checked_mul(h).and_then(|th| th.checked_mul(w)) == end.checked_sub(start);
        if start < cursor || end < start || end > len || !fits {
            return Err(ProcessError::Offsets(format!(
                "item {item} at {start}..{end} does not fit a {t}x{h}x{w} block after token {cursor} \
                 in a prompt of {len} tokens"
            )));
        }
        if !(block.time_interval.is_finite() && block.time_interval >= 0.0) {
            return Err(ProcessError::Offsets(format!(
                "item {item} has time interval {}",
                block.time_interval
            )));
        }
        text_run(cursor, start, next_position);
        next_position += (start - cursor) as i64;
        placed.push((start, [t, h, w], next_position, block.time_interval as f32));
        next_position += h.max(w) as i64;
        cursor = end;
    }
    text_run(cursor, len, next_position);
    for (start, [t, h, w], base, interval) in placed {
        let mut i = start;
        for ti in 0..t {
            let temporal = base + (ti as f32 * interval) as i64;
            for hi in 0..h {
                for wi in 0..w {
                    rows_t[i] = temporal;
                    rows_h[i] = base + hi as i64;
                    rows_w[i] = base + wi as i64;
                    i += 1;
                }
            }
        }
    }
    Ok(with_delta(positions, len))
}

/// M-RoPE's `[3 x len]` rows with their delta: the largest position + 1 - `len`, what a
/// decode step adds to its index (`get_rope_index`'s `mrope_position_deltas`).
pub fn with_delta(positions: Vec<i64>, len: usize) -> Positions {
    let max_position = positions.iter().copied().max().unwrap_or(-1);
    let delta = if len == 0 {
        0
    } else {
        max_position + 1 - len as i64
    };
    Positions::MRope { positions, delta }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Images only: every block one temporal position apart.
    fn mrope(
        len: usize,
        offsets: &[(usize, usize)],
        grids: &[[u32; 3]],
        merge: u32,
    ) -> Result<Positions, ProcessError> {
        let blocks: Vec<VisionBlock> = offsets
            .iter()
            .zip(grids)
            .map(|(&(start, end), &grid_thw)| VisionBlock {
                start,
                end,
                grid_thw,
                time_interval: 1.0,
            })
            .collect();
        mrope_blocks(len, &blocks, merge)
    }

    fn rows(p: &Positions) -> (Vec<i64>, i64) {
        match p {
            Positions::MRope { positions, delta } => (positions.clone(), *delta),
            Positions::Rope1D { .. } => panic!("expected mrope"),
        }
    }

    #[test]
    fn text_only_is_arange_with_zero_delta() {
        let (p, d) = rows(&mrope(4, &[], &[], 2).unwrap());
        assert_eq!(p, vec![0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]);
        assert_eq!(d, 0);
    }

    #[test]
    fn one_image_block_then_text() {
        // 2 text tokens, a 1x4x6 patch grid (2x3 LLM grid = 6 tokens), 1 text token.
        let (p, d) = rows(&mrope(9, &[(2, 8)], &[[1, 4, 6]], 2).unwrap());
        assert_eq!(&p[0..9], &[0, 1, 2, 2, 2, 2, 2, 2, 5]);
        assert_eq!(&p[9..18], &[0, 1, 2, 2, 2, 3, 3, 3, 5]);
        assert_eq!(&p[18..27], &[0, 1, 2, 3, 4, 2, 3, 4, 5]);
        assert_eq!(d, 5 + 1 - 9);
    }

    #[test]
    fn a_video_block_resumes_after_its_spatial_extent() {
        // 1 text token, a 3x2x2 patch grid (3x1x1 LLM grid = 3 tokens), 1 text token: the
        // temporal rows climb, and the text resumes at 1 + max(1, 1), not 1 + 3.
        let block = VisionBlock {
            start: 1,
            end: 4,
            grid_thw: [3, 2, 2],
            time_interval: 1.0,
        };
        let (p, d) = rows(&mrope_blocks(5, &[block], 2).unwrap());
        assert_eq!(&p[0..5], &[0, 1, 2, 3, 2]);
        assert_eq!(&p[5..10], &[0, 1, 1, 1, 2]);
        assert_eq!(&p[10..15], &[0, 1, 1, 1, 2]);
        assert_eq!(d, 3 + 1 - 5);
        let spaced = VisionBlock {
            time_interval: 2.5,
            ..block
        };
        let (p, _) = rows(&mrope_blocks(5, &[spaced], 2).unwrap());
        assert_eq!(&p[0..5], &[0, 1, 3, 6, 2]);
    }

    #[test]
    fn rejects_offsets_that_do_not_match_the_grid() {
        let err = mrope(9, &[(2, 7)], &[[1, 4, 6]], 2).unwrap_err();
        assert_eq!(err.code(), "process.offsets");
        let err = mrope(5, &[(2, 8)], &[[1, 4, 6]], 2).unwrap_err();
        assert_eq!(err.code(), "process.offsets");
    }
}
