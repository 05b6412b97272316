//! The errors of the audio stages, each with a stable `audio.*` code.

use thiserror::Error;

use crate::error::ErrorCode;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum AudioError {
    #[error("the data is not audio in a supported format (wav, flac, mp3, ogg, webm, m4a, mp4)")]
    UnknownFormat,
    #[error(
        "the container {0:?} is not supported (supported: wav, flac, mp3, ogg, webm/mkv, m4a/mp4)"
    )]
    UnsupportedContainer(String),
    #[error("the audio format {0:?} is not one the server reads (wav, mp3, flac, ogg, opus, webm, m4a, mp4)")]
    UnknownFormatName(String),
    #[error("the data is {found}, not {declared} as its format says")]
    FormatMismatch { declared: String, found: String },
    #[error("the file has no audio stream")]
    NoAudioStream,
    #[error(
        "the audio codec {0:?} is not supported (supported: PCM, A-law, mu-law, FLAC, MP3, Vorbis, Opus, AAC)"
    )]
    UnsupportedCodec(String),
    #[error("the audio stream is unusable: {0}")]
    BadStream(String),
    #[error("the audio is corrupt or truncated: {0}")]
    Corrupt(String),
    #[error("the audio has no samples")]
    Empty,
    #[error("the audio has {samples} samples, fewer than the {min} its features need")]
    TooShort { samples: usize, min: usize },
    #[error("the audio lasts {seconds:.1} s, over the limit of {limit:.1} s")]
    TooLong { seconds: f64, limit: f64 },
    #[error(
        "the audio's header claims {claimed:.2} s, its data decodes to {} {decoded:.2} s",
        if *.complete { "only" } else { "more than" }
    )]
    LengthMismatch {
        claimed: f64,
        decoded: f64,
        /// Whether the data ended (it holds less than claimed) or not (it holds more).
        complete: bool,
    },
    #[error("the file has more than {limit} streams")]
    TooManyStreams { limit: usize },
    #[error("decoding the audio took longer than its deadline")]
    Deadline,
    #[error("audio cannot be processed here: {0}")]
    Unavailable(&'static str),
    #[error("the audio feature extractor's config is invalid: {0}")]
    BadFeatureConfig(String),
}

impl AudioError {
    /// This error's entry in the catalogue of codes.
    pub fn kind(&self) -> ErrorCode {
        match self {
            AudioError::UnknownFormat => ErrorCode::AudioUnknownFormat,
            AudioError::UnsupportedContainer(_) => ErrorCode::AudioUnsupportedContainer,
            AudioError::UnknownFormatName(_) => ErrorCode::AudioUnknownFormatName,
            AudioError::FormatMismatch { .. } => ErrorCode::AudioFormatMismatch,
            AudioError::NoAudioStream => ErrorCode::AudioNoAudioStream,
            AudioError::UnsupportedCodec(_) => ErrorCode::AudioUnsupportedCodec,
            AudioError::BadStream(_) => ErrorCode::AudioBadStream,
            AudioError::Corrupt(_) => ErrorCode::AudioCorrupt,
            AudioError::Empty => ErrorCode::AudioEmpty,
            AudioError::TooShort { .. } => ErrorCode::AudioTooShort,
            AudioError::TooLong { .. } => ErrorCode::AudioTooLong,
            AudioError::LengthMismatch { .. } => ErrorCode::AudioLengthMismatch,
            AudioError::TooManyStreams { .. } => ErrorCode::AudioTooManyStreams,
            AudioError::Deadline => ErrorCode::AudioDeadline,
            AudioError::Unavailable(_) => ErrorCode::AudioUnavailable,
            AudioError::BadFeatureConfig(_) => ErrorCode::AudioBadFeatureConfig,
        }
    }

    /// Stable machine-readable code, e.g. `audio.unknown_format`.
    pub fn code(&self) -> &'static str {
        self.kind().code()
    }
}
