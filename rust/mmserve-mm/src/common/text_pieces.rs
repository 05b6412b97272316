//! The tokenizer's ids of the texts the driver writes into a prompt (the caller tokenizes
//! them once; the driver spells each text from them).

use crate::pipeline::TokenId;

/// A tokenizer's ids for the pieces of the texts a family's processor writes into the prompt
/// around media items: Qwen3-VL's timestamp texts (`<`, each digit, `.`, ` seconds>`; Qwen2's
/// pre-tokenizer splits a text there, a digit being a word of its own), Gemma 3's texts
/// between an image and its pan-and-scan crops (whole, each between special tokens). A text's
/// ids are its pieces' ids in order; the caller, who holds the tokenizer, checks that before
/// handing them over (the frontend, at start-up).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TextPieces {
    /// Longest piece first, so a text is cut greedily into the longest pieces.
    pieces: Vec<(String, Vec<TokenId>)>,
}

impl TextPieces {
    pub fn new(mut pieces: Vec<(String, Vec<TokenId>)>) -> Self {
        pieces.retain(|(piece, _)| !piece.is_empty());
        pieces.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
        TextPieces { pieces }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_is_its_pieces_ids_in_order() {
        let mut pieces: Vec<(String, Vec<TokenId>)> =
            (0..10).map(|d| (d.to_string(), vec![15 + d])).collect();
        pieces.extend([
            ("<".to_string(), vec![27]),
            (".".to_string(), vec![13]),
            (" seconds>".to_string(), vec![6486, 29]),
        ]);
        let tokens = TextPieces::new(pieces);
        assert_eq!(
            tokens.ids("<12.5 seconds>"),
            Some(vec![27, 16, 17, 13, 20, 6486, 29])
        );
        assert_eq!(tokens.ids("<1.0 minutes>"), None);
        assert_eq!(TextPieces::default().ids("<0.2 seconds>"), None);
    }
}
