//! Turns a [`TokenLayout`] into the expanded prompt and each item's (start, end) offsets.

use crate::pipeline::{MediaTokens, ProcessError, Segment, TokenId, TokenLayout};

/// The prompt as the language model sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expanded {
    pub ids: Vec<TokenId>,
    /// `offsets[i] = (start, end)`: item `i`'s tokens are `ids[start..end]`.
    pub offsets: Vec<(usize, usize)>,
}

/// Expands `layout` over `input_ids`. Items must appear in order 0, 1, 2, ... exactly once.
pub fn expand(
    layout: &TokenLayout,
    input_ids: &[TokenId],
    num_items: usize,
) -> Result<Expanded, ProcessError> {
    let total = layout
        .segments
        .iter()
        .map(|s| match s {
            Segment::Text(r) => r.len(),
            Segment::Inserted(list) => list.len(),
            Segment::Media { tokens, .. } => tokens.len(),
        })
        .sum();
    let mut ids = Vec::with_capacity(total);
    let mut offsets = Vec::with_capacity(num_items);
    for segment in &layout.segments {
        match segment {
            Segment::Text(range) => {
                let text = input_ids.get(range.clone()).ok_or_else(|| {
                    ProcessError::Offsets(format!(
                        "text range {range:?} is outside a prompt of {} tokens",
                        input_ids.len()
                    ))
                })?;
                ids.extend_from_slice(text);
            }
            Segment::Inserted(list) => ids.extend_from_slice(list),
            Segment::Media { item, tokens } => {
                if *item != offsets.len() {
                    return Err(ProcessError::Offsets(format!(
                        "item {item} laid out where item {} was expected",
                        offsets.len()
                    )));
                }
                let start = ids.len();
                match tokens {
                    MediaTokens::Repeat { id, n } => ids.resize(start + n, *id),
                    MediaTokens::Ids(list) => ids.extend_from_slice(list),
                }
                offsets.push((start, ids.len()));
            }
        }
    }
    if offsets.len() != num_items {
        return Err(ProcessError::PlaceholderCount {
            placeholders: offsets.len(),
            items: num_items,
        });
    }
    Ok(Expanded { ids, offsets })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expands_text_and_items_in_order() {
        let input = [10, 11, 99, 12, 99, 13];
        let layout = TokenLayout {
            segments: vec![
                Segment::Text(0..2),
                Segment::Media {
                    item: 0,
                    tokens: MediaTokens::Repeat { id: 99, n: 3 },
                },
                Segment::Text(3..4),
                Segment::Media {
                    item: 1,
                    tokens: MediaTokens::Ids(vec![7, 8]),
                },
                Segment::Inserted(vec![5]),
                Segment::Text(5..6),
            ],
        };
        let out = expand(&layout, &input, 2).unwrap();
        assert_eq!(out.ids, vec![10, 11, 99, 99, 99, 12, 7, 8, 5, 13]);
        // Inserted tokens are text: outside every item's span.
        assert_eq!(out.offsets, vec![(2, 5), (6, 8)]);
    }

    #[test]
    fn rejects_out_of_range_text_and_wrong_item_order() {
        let bad_range = TokenLayout {
            segments: vec![Segment::Text(0..9)],
        };
        assert_eq!(
            expand(&bad_range, &[1, 2], 0).unwrap_err().code(),
            "process.offsets"
        );
        let out_of_order = TokenLayout {
            segments: vec![Segment::Media {
                item: 1,
                tokens: MediaTokens::Repeat { id: 1, n: 1 },
            }],
        };
        assert_eq!(
            expand(&out_of_order, &[], 2).unwrap_err().code(),
            "process.offsets"
        );
        let missing = TokenLayout::default();
        assert_eq!(
            expand(&missing, &[], 1).unwrap_err().code(),
            "process.placeholder_count"
        );
    }
}
