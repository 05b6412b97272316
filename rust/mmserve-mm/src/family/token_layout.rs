//! The one prompt layout every family shares: each placeholder of the caller's prompt
//! replaced by its item's [`PromptUpdate`], giving the expanded prompt and each planned
//! item's (start, end) offsets.

use crate::common::text_pieces::TextPieces;
use crate::pipeline::{Modality, Placeholder, ProcessError, PromptUpdate, TokenId, UpdatePart};

/// The prompt as the language model sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expanded {
    pub ids: Vec<TokenId>,
    /// `offsets[i] = (start, end)`: planned item `i`'s tokens are `ids[start..end]`.
    pub offsets: Vec<(usize, usize)>,
}

/// The caller's prompt, and what spells the texts prompt updates write.
#[derive(Debug, Clone, Copy, Default)]
pub struct Prompt<'a> {
    /// One placeholder per request item, in item order.
    pub ids: &'a [TokenId],
    /// The same prompt tokenized as if every item announced its crops, for updates that
    /// are [`PromptUpdate::announced`].
    pub announcing_ids: Option<&'a [TokenId]>,
    /// The tokenizer's ids of the texts updates write.
    pub pieces: Option<&'a TextPieces>,
}

/// The prompt positions of `placeholders` in `ids`, each with its modality; each must sit
/// between its context ids.
pub fn find_placeholders(
    ids: &[TokenId],
    placeholders: &[Placeholder],
) -> Result<Vec<(usize, Modality)>, ProcessError> {
    let mut found = Vec::new();
    for (index, &id) in ids.iter().enumerate() {
        let Some(placeholder) = placeholders.iter().find(|p| p.id == id) else {
            continue;
        };
        if let Some((start, end)) = placeholder.between {
            let before = index.checked_sub(1).and_then(|j| ids.get(j)).copied();
            let after = ids.get(index + 1).copied();
            if before != Some(start) || after != Some(end) {
                return Err(ProcessError::PlaceholderContext {
                    index,
                    start,
                    placeholder: id,
                    end,
                });
            }
        }
        found.push((index, placeholder.modality));
    }
    Ok(found)
}

/// Replaces the placeholder of each request item `k` by `items[k]`'s update (`items[k]`
/// also names the item's modality, which its placeholder must have). Planned items are
/// numbered by their [`UpdatePart::Embed`] runs, in prompt order.
pub fn apply(
    prompt: &Prompt<'_>,
    placeholders: &[Placeholder],
    items: &[(Modality, PromptUpdate)],
) -> Result<Expanded, ProcessError> {
    let plain = positions_for(prompt.ids, placeholders, items.len())?;
    for (item, (&(index, found), (given, _))) in plain.iter().zip(items).enumerate() {
        if found != *given {
            return Err(ProcessError::PlaceholderModality {
                index,
                item,
                placeholder: found.article_name(),
                given: given.article_name(),
            });
        }
    }
    let announcing = match prompt.announcing_ids {
        _ if !items.iter().any(|(_, update)| update.announced) => None,
        None => {
            return Err(ProcessError::PromptText(
                "the prompt announcing each image's crops was not given".to_string(),
            ))
        }
        Some(ids) => Some((ids, positions_for(ids, placeholders, items.len())?)),
    };
    let mut ids = Vec::with_capacity(prompt.ids.len() + expanded_len(items));
    let mut offsets = Vec::new();
    let (mut plain_from, mut announcing_from) = (0, 0);
    for (k, (_, update)) in items.iter().enumerate() {
        // Both spellings agree up to the text before an announced item.
        match &announcing {
            Some((announcing_ids, at)) if update.announced => {
                ids.extend_from_slice(&announcing_ids[announcing_from..at[k].0]);
            }
            _ => ids.extend_from_slice(&prompt.ids[plain_from..plain[k].0]),
        }
        for part in &update.parts {
            match part {
                UpdatePart::Ids(list) => ids.extend_from_slice(list),
                UpdatePart::Text(text) => ids.extend(spell(prompt.pieces, text)?),
                UpdatePart::Embed(embed) => {
                    let start = ids.len();
                    if embed.runs.is_empty() {
                        ids.resize(start + embed.n, embed.id);
                    } else {
                        for &(id, n) in &embed.runs {
                            ids.resize(ids.len() + n, id);
                        }
                    }
                    if ids.len() != start + embed.n {
                        return Err(ProcessError::Offsets(format!(
                            "an item of {} tokens laid out as {}",
                            embed.n,
                            ids.len() - start
                        )));
                    }
                    offsets.push((start, ids.len()));
                }
            }
        }
        plain_from = plain[k].0 + 1;
        if let Some((_, at)) = &announcing {
            announcing_from = at[k].0 + 1;
        }
    }
    ids.extend_from_slice(&prompt.ids[plain_from..]);
    Ok(Expanded { ids, offsets })
}

/// The placeholders of `ids`, which must be one per item.
fn positions_for(
    ids: &[TokenId],
    placeholders: &[Placeholder],
    items: usize,
) -> Result<Vec<(usize, Modality)>, ProcessError> {
    let found = find_placeholders(ids, placeholders)?;
    if found.len() != items {
        return Err(ProcessError::PlaceholderCount {
            placeholders: found.len(),
            items,
        });
    }
    Ok(found)
}

/// An upper bound of the tokens updates write (texts counted by their bytes).
fn expanded_len(items: &[(Modality, PromptUpdate)]) -> usize {
    let part_len = |part: &UpdatePart| match part {
        UpdatePart::Ids(list) => list.len(),
        UpdatePart::Text(text) => text.len(),
        UpdatePart::Embed(embed) => embed.n,
    };
    items
        .iter()
        .flat_map(|(_, update)| &update.parts)
        .map(part_len)
        .sum()
}

fn spell(pieces: Option<&TextPieces>, text: &str) -> Result<Vec<TokenId>, ProcessError> {
    pieces.and_then(|p| p.ids(text)).ok_or_else(|| {
        ProcessError::PromptText(format!(
            "the tokenizer's ids of the text {text:?} were not given"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::{Embed, EmbedOf, Geometry};

    const PAD: TokenId = 99;
    const VID: TokenId = 98;
    const PLACEHOLDERS: [Placeholder; 2] = [
        Placeholder {
            id: PAD,
            modality: Modality::Image,
            between: None,
        },
        Placeholder {
            id: VID,
            modality: Modality::Video,
            between: Some((1, 2)),
        },
    ];

    fn embed(id: TokenId, n: usize) -> UpdatePart {
        UpdatePart::Embed(Embed {
            id,
            n,
            runs: Vec::new(),
            geometry: Geometry::Image {
                resized_width: 1,
                resized_height: 1,
                grid_thw: [1, 1, 1],
            },
            of: EmbedOf::Whole,
        })
    }

    fn update(parts: Vec<UpdatePart>) -> PromptUpdate {
        PromptUpdate {
            parts,
            announced: false,
        }
    }

    #[test]
    fn each_placeholder_becomes_its_update_and_each_embed_an_item() {
        let ids = [10, PAD, 11, 1, VID, 2, 12];
        let pieces = TextPieces::new(vec![("ab".to_string(), vec![7, 8])]);
        let prompt = Prompt {
            ids: &ids,
            pieces: Some(&pieces),
            ..Prompt::default()
        };
        let items = [
            (
                Modality::Image,
                update(vec![embed(PAD, 3), UpdatePart::Ids(vec![5])]),
            ),
            (
                Modality::Video,
                update(vec![
                    UpdatePart::Text("ab".into()),
                    embed(VID, 2),
                    UpdatePart::Text("ab".into()),
                    embed(VID, 1),
                ]),
            ),
        ];
        let out = apply(&prompt, &PLACEHOLDERS, &items).unwrap();
        let expected = [
            10, PAD, PAD, PAD, 5, 11, 1, 7, 8, VID, VID, 7, 8, VID, 2, 12,
        ];
        assert_eq!(out.ids, expected);
        // Inserted ids and texts are outside every item's span.
        assert_eq!(out.offsets, vec![(1, 4), (9, 11), (13, 14)]);
        let unspelled = Prompt {
            pieces: None,
            ..prompt
        };
        let err = apply(&unspelled, &PLACEHOLDERS, &items).unwrap_err();
        assert_eq!(err.code(), "process.prompt_text");
    }

    #[test]
    fn an_announced_update_takes_its_text_before_from_the_announcing_prompt() {
        let ids = [10, PAD, 20, PAD, 30];
        let announcing = [10, 11, PAD, 20, 21, PAD, 30];
        let items = [
            (Modality::Image, update(vec![embed(PAD, 1)])),
            (
                Modality::Image,
                PromptUpdate {
                    parts: vec![embed(PAD, 1)],
                    announced: true,
                },
            ),
        ];
        let prompt = Prompt {
            ids: &ids,
            announcing_ids: Some(&announcing),
            pieces: None,
        };
        let out = apply(&prompt, &PLACEHOLDERS, &items).unwrap();
        assert_eq!(out.ids, [10, PAD, 20, 21, PAD, 30]);
        let bare = Prompt {
            announcing_ids: None,
            ..prompt
        };
        let err = apply(&bare, &PLACEHOLDERS, &items).unwrap_err();
        assert_eq!(err.code(), "process.prompt_text");
        let short = Prompt {
            announcing_ids: Some(&announcing[..3]),
            ..prompt
        };
        let err = apply(&short, &PLACEHOLDERS, &items).unwrap_err();
        assert_eq!(err.code(), "process.placeholder_count");
    }

    #[test]
    fn refuses_wrong_counts_modalities_and_bare_placeholders() {
        let one = [(Modality::Image, update(vec![embed(PAD, 1)]))];
        let prompt = |ids| Prompt {
            ids,
            ..Prompt::default()
        };
        let err = apply(&prompt(&[PAD, PAD]), &PLACEHOLDERS, &one).unwrap_err();
        assert_eq!(err.code(), "process.placeholder_count");
        let err = apply(&prompt(&[1, VID, 2]), &PLACEHOLDERS, &one).unwrap_err();
        assert_eq!(err.code(), "process.placeholder_modality");
        let err = apply(&prompt(&[VID, 2]), &PLACEHOLDERS, &one).unwrap_err();
        assert_eq!(err.code(), "process.placeholder_context");
    }
}
