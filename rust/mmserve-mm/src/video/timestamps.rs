//! The time of each temporal group, as Qwen3-VL's processor writes it into the prompt
//! (`Qwen3VLProcessor._calculate_timestamps` and `replace_video_token`, transformers 5.24):
//! before each group's `<|vision_start|>`, `<{t:.1f} seconds>`, `t` the mean time of the
//! group's first and last sampled frames.

use crate::pipeline::TokenId;

/// A tokenizer's ids for the pieces timestamp texts are made of (`<`, each digit, `.`,
/// ` seconds>`). Qwen2's pre-tokenizer splits a text there (a digit is a word of its own, and
/// the special tokens around the text cut it off from its neighbours), so a text's ids are its
/// pieces' ids in order; the caller, who holds the tokenizer, checks that before handing them
/// over.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TimestampTokens {
    /// Longest piece first, so a text is cut greedily into the longest pieces.
    pieces: Vec<(String, Vec<TokenId>)>,
}

impl TimestampTokens {
    pub fn new(mut pieces: Vec<(String, Vec<TokenId>)>) -> Self {
        pieces.retain(|(piece, _)| !piece.is_empty());
        pieces.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
        TimestampTokens { pieces }
    }

    /// The ids of `text`, piece by piece; `None` where no piece fits.
    pub fn ids(&self, text: &str) -> Option<Vec<TokenId>> {
        let mut ids = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let (piece, piece_ids) = self.pieces.iter().find(|(p, _)| rest.starts_with(p))?;
            ids.extend_from_slice(piece_ids);
            rest = &rest[piece.len()..];
        }
        Some(ids)
    }
}

/// Seconds of each temporal group: the indices padded with the last one to a whole number of
/// groups, each index over `video_fps`, then the mean of each group's first and last.
pub fn group_timestamps(indices: &[u64], video_fps: f64, temporal_patch_size: usize) -> Vec<f64> {
    let size = temporal_patch_size.max(1);
    let Some(&last) = indices.last() else {
        return Vec::new();
    };
    let seconds = |k: usize| indices.get(k).copied().unwrap_or(last) as f64 / video_fps;
    (0..indices.len().div_ceil(size))
        .map(|g| (seconds(g * size) + seconds(g * size + size - 1)) / 2.0)
        .collect()
}

/// The text before a group: Python's `f"<{t:.1f} seconds>"` (both round the exact binary
/// value half to even).
pub fn timestamp_text(seconds: f64) -> String {
    format!("<{seconds:.1} seconds>")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pads_with_the_last_index_and_averages_each_group() {
        // 2 fps: frames 0, 1 -> 0.25 s; frame 2 (padded with itself) -> 1.0 s.
        assert_eq!(group_timestamps(&[0, 1, 2], 2.0, 2), vec![0.25, 1.0]);
        assert_eq!(group_timestamps(&[], 2.0, 2), Vec::<f64>::new());
        assert_eq!(timestamp_text(0.25), "<0.2 seconds>");
        assert_eq!(timestamp_text(0.75), "<0.8 seconds>");
        assert_eq!(timestamp_text(12.0), "<12.0 seconds>");
    }

    #[test]
    fn a_text_is_its_pieces_ids_in_order() {
        let mut pieces: Vec<(String, Vec<TokenId>)> =
            (0..10).map(|d| (d.to_string(), vec![15 + d])).collect();
        pieces.extend([
            ("<".to_string(), vec![27]),
            (".".to_string(), vec![13]),
            (" seconds>".to_string(), vec![6486, 29]),
        ]);
        let tokens = TimestampTokens::new(pieces);
        assert_eq!(
            tokens.ids("<12.5 seconds>"),
            Some(vec![27, 16, 17, 13, 20, 6486, 29])
        );
        assert_eq!(tokens.ids("<1.0 minutes>"), None);
        assert_eq!(TimestampTokens::default().ids("<0.2 seconds>"), None);
    }
}
