//! M-RoPE position ids for prompts with images (the image-only fast path of transformers'
//! `get_rope_index` for Qwen2-VL, Qwen2.5-VL and Qwen3-VL).

use crate::pipeline::{Positions, ProcessError};

/// Text tokens advance the three rows together; an image of LLM grid `(t, h, w)` (patch grid
/// divided by `merge`) fills a `t x h x w` block starting at the next position, and the text
/// after it resumes at `start + max(t, h, w)`.
pub fn mrope(
    len: usize,
    offsets: &[(usize, usize)],
    grids: &[[u32; 3]],
    merge: u32,
) -> Result<Positions, ProcessError> {
    if offsets.len() != grids.len() {
        return Err(ProcessError::Offsets(format!(
            "{} offsets for {} items",
            offsets.len(),
            grids.len()
        )));
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
    let mut blocks = Vec::with_capacity(grids.len());
    for (item, (&(start, end), grid)) in offsets.iter().zip(grids).enumerate() {
        let [t, h, w] = [grid[0], grid[1] / merge, grid[2] / merge].map(|v| v as usize);
        if start < cursor || end < start || end > len || end - start != t * h * w {
            return Err(ProcessError::Offsets(format!(
                "item {item} at {start}..{end} does not fit a {t}x{h}x{w} block after token {cursor} \
                 in a prompt of {len} tokens"
            )));
        }
        text_run(cursor, start, next_position);
        next_position += (start - cursor) as i64;
        blocks.push((start, [t, h, w], next_position));
        next_position += t.max(h).max(w) as i64;
        cursor = end;
    }
    text_run(cursor, len, next_position);
    for (start, [t, h, w], base) in blocks {
        let mut i = start;
        for ti in 0..t {
            for hi in 0..h {
                for wi in 0..w {
                    rows_t[i] = base + ti as i64;
                    rows_h[i] = base + hi as i64;
                    rows_w[i] = base + wi as i64;
                    i += 1;
                }
            }
        }
    }
    let max_position = positions.iter().copied().max().unwrap_or(-1);
    let delta = if len == 0 {
        0
    } else {
        max_position + 1 - len as i64
    };
    Ok(Positions::MRope { positions, delta })
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn rejects_offsets_that_do_not_match_the_grid() {
        let err = mrope(9, &[(2, 7)], &[[1, 4, 6]], 2).unwrap_err();
        assert_eq!(err.code(), "process.offsets");
        let err = mrope(5, &[(2, 8)], &[[1, 4, 6]], 2).unwrap_err();
        assert_eq!(err.code(), "process.offsets");
    }
}
