//! Lenient base64 decoding for media payloads: the standard and the URL-safe alphabets,
//! padding optional, ASCII whitespace (line breaks from MIME encoders) ignored.

use base64::alphabet;
use base64::engine::{DecodePaddingMode, Engine, GeneralPurpose, GeneralPurposeConfig};
use thiserror::Error;

use crate::error::ErrorCode;

#[derive(Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum Base64Error {
    #[error("base64 mixes the standard ('+', '/') and URL-safe ('-', '_') alphabets")]
    MixedAlphabets,
    #[error("invalid base64: {0}")]
    Invalid(String),
}

impl Base64Error {
    /// This error's entry in the catalogue of codes.
    pub fn kind(&self) -> ErrorCode {
        match self {
            Base64Error::MixedAlphabets => ErrorCode::Base64MixedAlphabets,
            Base64Error::Invalid(_) => ErrorCode::Base64Invalid,
        }
    }

    /// Stable machine-readable code, e.g. `base64.mixed_alphabets`.
    pub fn code(&self) -> &'static str {
        self.kind().code()
    }
}

const LENIENT: GeneralPurposeConfig = GeneralPurposeConfig::new()
    .with_decode_padding_mode(DecodePaddingMode::Indifferent)
    .with_decode_allow_trailing_bits(true);
const STANDARD: GeneralPurpose = GeneralPurpose::new(&alphabet::STANDARD, LENIENT);
const URL_SAFE: GeneralPurpose = GeneralPurpose::new(&alphabet::URL_SAFE, LENIENT);

/// Decodes `text` in either alphabet (told apart by its characters), with or without padding.
pub fn decode(text: &[u8]) -> Result<Vec<u8>, Base64Error> {
    let compact: std::borrow::Cow<'_, [u8]> = if text.iter().any(u8::is_ascii_whitespace) {
        text.iter()
            .copied()
            .filter(|b| !b.is_ascii_whitespace())
            .collect::<Vec<u8>>()
            .into()
    } else {
        text.into()
    };
    let standard = compact.iter().any(|&b| b == b'+' || b == b'/');
    let url_safe = compact.iter().any(|&b| b == b'-' || b == b'_');
    let engine = match (standard, url_safe) {
        (true, true) => return Err(Base64Error::MixedAlphabets),
        (false, true) => &URL_SAFE,
        _ => &STANDARD,
    };
    engine
        .decode(&compact)
        .map_err(|e| Base64Error::Invalid(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_both_alphabets_with_and_without_padding() {
        let bytes: Vec<u8> = vec![0xfb, 0xff, 0xfe, 0x00, 0x10];
        assert_eq!(decode(b"+//+ABA=").unwrap(), bytes);
        assert_eq!(decode(b"+//+ABA").unwrap(), bytes);
        assert_eq!(decode(b"-__-ABA=").unwrap(), bytes);
        assert_eq!(decode(b"-__-ABA").unwrap(), bytes);
        assert_eq!(decode(b"aGVsbG8").unwrap(), b"hello");
        assert_eq!(decode(b"").unwrap(), b"");
    }

    #[test]
    fn ignores_ascii_whitespace() {
        assert_eq!(decode(b" aGVs\r\nbG8=\t\n").unwrap(), b"hello");
    }

    #[test]
    fn rejects_invalid_input_with_a_reason() {
        assert_eq!(decode(b"+/-_").unwrap_err(), Base64Error::MixedAlphabets);
        for bad in [&b"aGVsbG8*"[..], b"a", b"aGVsbG8==x", b"a=GV"] {
            let err = decode(bad).unwrap_err();
            assert_eq!(err.code(), "base64.invalid", "{bad:?}");
        }
    }
}
