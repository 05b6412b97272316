//! The crate-level error and the catalogue of error codes.
//!
//! [`ErrorCode`] is the one list of every code the core can raise, each with its HTTP status
//! and meaning (Python reads it as `_mm.error_catalogue()`). Each stage's error enum maps its
//! variants to an [`ErrorCode`] in its `kind()`, so a code cannot be raised without a status.
//! [`Error`] has one variant per stage, each carrying its stage's own error.

use thiserror::Error;

use crate::audio::AudioError;
use crate::driver::{RequestError, MAX_BYTES_PER_REQUEST, MAX_ITEMS_PER_REQUEST};
use crate::family::qwen_vl::MAX_ASPECT_RATIO;
use crate::family::spec::SpecError;
use crate::image::{decode::DecodeError, resize::ResizeError};
use crate::pipeline::ProcessError;
use crate::source::fetch::{FetchError, MAX_BYTES_PER_SOURCE};
use crate::video::VideoError;

/// Builds [`ErrorCode`] from `Variant: "stage.kind", status, "meaning" [, format args];` rows.
macro_rules! error_codes {
    ($($(#[$doc:meta])* $variant:ident: $code:literal, $status:literal, $meaning:literal $(, $arg:expr)*;)*) => {
        /// A stable machine-readable error code, e.g. `fetch.too_large`: the wire protocol's
        /// `code`, with the HTTP status a client is answered with and what it means.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum ErrorCode {
            $($(#[$doc])* $variant,)*
        }

        impl ErrorCode {
            /// Every code, in catalogue order.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant,)*];

            /// The code as it goes on the wire, `<stage>.<kind>`.
            pub fn code(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $code,)*
                }
            }

            /// The HTTP status: 4xx for a client's mistake, 5xx for a fault of the deployment.
            pub fn status(self) -> u16 {
                match self {
                    $(ErrorCode::$variant => $status,)*
                }
            }

            /// What the code means, with the core's limits filled in.
            pub fn meaning(self) -> String {
                match self {
                    $(ErrorCode::$variant => format!($meaning $(, $arg)*),)*
                }
            }
        }
    };
}

error_codes! {
    // Fetching media (`FetchError`).
    FetchBadDataUrl: "fetch.bad_data_url", 400, "a data: URL is malformed";
    FetchBadBase64: "fetch.bad_base64", 400, "an item that is neither a URL nor a path is not valid base64";
    FetchBadUrl: "fetch.bad_url", 400, "the media URL cannot be parsed";
    FetchUnsupportedScheme: "fetch.unsupported_scheme", 400, "the media URL's scheme is not data, file or http(s)";
    FetchForbiddenAddress: "fetch.forbidden_address", 400, "the media host is private or loopback and not in --allowed-media-domains";
    FetchLocalPathNotAllowed: "fetch.local_path_not_allowed", 400, "the local path is outside --allowed-local-media-path";
    FetchLocalIo: "fetch.local_io", 400, "the local media file cannot be read";
    FetchResolve: "fetch.resolve", 400, "the media host name does not resolve";
    FetchHttp: "fetch.http", 400, "the media server cannot be reached";
    FetchHttpStatus: "fetch.http_status", 400, "the media server answered with an error status";
    FetchTimeout: "fetch.timeout", 400, "fetching the media took longer than --media-fetch-timeout";
    FetchTooLarge: "fetch.too_large", 413, "a media item is over {} MiB", MAX_BYTES_PER_SOURCE >> 20;
    FetchTooManyRedirects: "fetch.too_many_redirects", 400, "the media URL redirects too often";
    FetchBadRedirect: "fetch.bad_redirect", 400, "the media URL redirects somewhere unusable";
    FetchBadProxy: "fetch.bad_proxy", 500, "the operator's HTTP(S)_PROXY setting is unusable";
    // Base64 text (`Base64Error`).
    Base64Invalid: "base64.invalid", 400, "the base64 text has a character outside its alphabet";
    Base64MixedAlphabets: "base64.mixed_alphabets", 400, "the base64 text mixes the standard and URL-safe alphabets";
    // A request's media as a whole (`RequestError`).
    RequestTooManyItems: "request.too_many_items", 400, "the request has more media items than --max-media-items allows (at most {})", MAX_ITEMS_PER_REQUEST;
    RequestTooManyBytes: "request.too_many_bytes", 413, "the request's media add up to more than {} MiB", MAX_BYTES_PER_REQUEST >> 20;
    // Decoding an image (`DecodeError`).
    DecodeUnknownFormat: "decode.unknown_format", 400, "the item is not an image of a supported format";
    DecodeCorrupt: "decode.corrupt", 400, "the image data is corrupt or truncated";
    DecodeUnsupported: "decode.unsupported", 400, "the image uses a feature the decoder does not support";
    DecodeUnsupportedBitDepth: "decode.unsupported_bit_depth", 400, "the image has samples deeper than 8 bits";
    DecodeEmptyImage: "decode.empty_image", 400, "the image has no pixels";
    DecodeTooManyPixels: "decode.too_many_pixels", 413, "the image has more pixels than the decoder allows";
    DecodeOutOfMemory: "decode.out_of_memory", 413, "the image needs more memory than can be allocated";
    // Demuxing, decoding and sampling a video (`VideoError`, `SamplingError`).
    VideoUnknownContainer: "video.unknown_container", 400, "the item is not a video in a known container";
    VideoUnsupportedContainer: "video.unsupported_container", 400, "the video's container is not mp4, mov, webm or mkv";
    VideoNoVideoStream: "video.no_video_stream", 400, "the file has no video stream";
    VideoUnsupportedCodec: "video.unsupported_codec", 400, "the video's codec is not H.264, HEVC, VP8, VP9, AV1 or MPEG-4";
    VideoUnsupportedPixelFormat: "video.unsupported_pixel_format", 400, "the video is not 8-bit YUV (10-bit and other formats are refused)";
    VideoCorrupt: "video.corrupt", 400, "the video data is corrupt or truncated";
    VideoNoFrameRate: "video.no_frame_rate", 400, "the video's frame rate is unknown";
    VideoNoFrames: "video.no_frames", 400, "the video has no frames";
    VideoTooFewFrames: "video.too_few_frames", 400, "the video has fewer frames than the sampling asks for";
    VideoBadSampling: "video.bad_sampling", 400, "the video sampling options are invalid";
    VideoTooLong: "video.too_long", 413, "the video lasts longer than allowed";
    VideoTooManyFrames: "video.too_many_frames", 413, "the video has more frames than allowed";
    VideoTooManyPixels: "video.too_many_pixels", 413, "the video's frames have more pixels than allowed";
    VideoTooManyTokens: "video.too_many_tokens", 413, "the video would take more prompt tokens than allowed";
    VideoTooManyStreams: "video.too_many_streams", 400, "the file has more streams than allowed";
    VideoFrameSizeChanged: "video.frame_size_changed", 400, "the video's frame size changes mid-stream";
    VideoDeadline: "video.deadline", 400, "decoding the video took longer than allowed";
    VideoUnavailable: "video.unavailable", 500, "this deployment's core cannot read video (built without it, or called without the video options)";
    // Demuxing, decoding and featurizing audio (`AudioError`).
    AudioUnknownFormat: "audio.unknown_format", 400, "the item is not audio in a known format";
    AudioUnsupportedContainer: "audio.unsupported_container", 400, "the audio's container is not wav, flac, mp3, ogg, webm/mkv or m4a/mp4";
    AudioUnknownFormatName: "audio.unknown_format_name", 400, "the audio part names a format the server does not read";
    AudioFormatMismatch: "audio.format_mismatch", 400, "the audio data is of another format than the part names";
    AudioNoAudioStream: "audio.no_audio_stream", 400, "the file has no audio stream";
    AudioUnsupportedCodec: "audio.unsupported_codec", 400, "the audio's codec is not PCM, A-law, mu-law, FLAC, MP3, Vorbis, Opus or AAC";
    AudioBadStream: "audio.bad_stream", 400, "the audio's sample rate or channel count is outside the allowed range";
    AudioCorrupt: "audio.corrupt", 400, "the audio data is corrupt or truncated";
    AudioEmpty: "audio.empty", 400, "the audio has no samples";
    AudioTooShort: "audio.too_short", 400, "the audio is too short for the model's features";
    AudioTooLong: "audio.too_long", 413, "the audio lasts longer than allowed";
    AudioLengthMismatch: "audio.length_mismatch", 400, "the audio's header claims another duration than its data holds";
    AudioTooManyStreams: "audio.too_many_streams", 400, "the file has more streams than allowed";
    AudioDeadline: "audio.deadline", 400, "decoding the audio took longer than allowed";
    AudioUnavailable: "audio.unavailable", 500, "this deployment's core cannot read audio (built without it)";
    AudioBadFeatureConfig: "audio.bad_feature_config", 500, "the model's audio feature extractor config is invalid";
    // Resizing (`ResizeError`).
    ResizeEmptyImage: "resize.empty_image", 400, "the image has no pixels";
    ResizeEmptyTarget: "resize.empty_target", 500, "a resize was asked for an empty target";
    ResizeTargetTooLarge: "resize.target_too_large", 500, "a resize target is over the allowed size";
    ResizeBufferSize: "resize.buffer_size", 500, "a resize buffer has the wrong size";
    ResizeUnknownBackend: "resize.unknown_backend", 500, "the resize backend is not known";
    ResizeUnknownFilter: "resize.unknown_filter", 500, "the resize filter is not known";
    // Patchifying and normalizing (`TransformError`).
    TransformFrameCount: "transform.frame_count", 500, "a temporal patch got the wrong number of frames";
    TransformBadGeometry: "transform.bad_geometry", 500, "the patch geometry does not fit the image";
    TransformBadStd: "transform.bad_std", 500, "the normalization std has a zero";
    TransformImageBufferSize: "transform.image_buffer_size", 500, "an image buffer has the wrong size";
    TransformNotDivisible: "transform.not_divisible", 500, "the image does not divide into patches";
    TransformOutputSize: "transform.output_size", 500, "the output buffer has the wrong size";
    TransformUnknownConvention: "transform.unknown_convention", 500, "the normalization convention is not known";
    // Preprocessing and the prompt's layout (`ProcessError`).
    ProcessAspectRatio: "process.aspect_ratio", 400, "the image is more than {} times wider than tall, or taller than wide", MAX_ASPECT_RATIO;
    ProcessEmptyImage: "process.empty_image", 400, "the image has no pixels";
    ProcessPlaceholderContext: "process.placeholder_context", 400, "the prompt's text spells the model's media placeholder token";
    ProcessPlaceholderCount: "process.placeholder_count", 400, "the prompt holds another number of media placeholders than the request has items";
    ProcessPlaceholderModality: "process.placeholder_modality", 400, "the prompt's text spells a media placeholder of another modality than the item at its place";
    ProcessVideoUnsupported: "process.video_unsupported", 400, "the served model family does not take video (yet)";
    ProcessModalityUnsupported: "process.modality_unsupported", 400, "the served model family does not take this modality (images for an audio model, audio for a vision model)";
    ProcessGrid: "process.grid", 400, "a precomputed item's grid is not one the model's vision tower produces";
    ProcessOffsets: "process.offsets", 500, "the prompt layout and the items' grids disagree";
    ProcessTensorShape: "process.tensor_shape", 500, "a preprocessed tensor has the wrong shape";
    ProcessPixelBuffer: "process.pixel_buffer", 500, "a pixel buffer has the wrong size";
    ProcessPanAndScan: "process.pan_and_scan", 500, "pan-and-scan planned an image without its pixels";
    ProcessPromptText: "process.prompt_text", 500, "the prompt needs a text the caller gave no tokenizer ids for (a timestamp, the texts around crops, the prompt announcing crops)";
    // The model's spec (`SpecError`): the deployment's, never a request's.
    SpecInvalid: "spec.invalid", 500, "the model's preprocessing spec is invalid";
    SpecInconsistent: "spec.inconsistent", 500, "the model's config files disagree";
    SpecMissing: "spec.missing", 500, "the model's config files lack a needed value";
    SpecJson: "spec.json", 500, "a model config file is not valid JSON";
    SpecUnknownFamily: "spec.unknown_family", 500, "the model family is not supported";
    // The KV routing index (`KvIndexError`).
    KvIndexBadMediaSpan: "kv_index.bad_media_span", 500, "a media span does not fit its prompt";
    KvIndexUnknownParent: "kv_index.unknown_parent", 500, "a KV event names a parent block not indexed";
    KvIndexZeroBlockSize: "kv_index.zero_block_size", 500, "the KV block size is zero";
}

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    #[error(transparent)]
    Fetch(#[from] FetchError),
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error(transparent)]
    Resize(#[from] ResizeError),
    #[error(transparent)]
    Process(#[from] ProcessError),
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error(transparent)]
    Video(#[from] VideoError),
    #[error(transparent)]
    Audio(#[from] AudioError),
    /// A failure of one media item of a request; keeps the item's own code.
    #[error("item {index}: {source}")]
    Item { index: usize, source: Box<Error> },
}

impl Error {
    /// The catalogue entry of this error (an item's failure keeps the item's own).
    pub fn kind(&self) -> ErrorCode {
        match self {
            Error::Fetch(e) => e.kind(),
            Error::Decode(e) => e.kind(),
            Error::Resize(e) => e.kind(),
            Error::Process(e) => e.kind(),
            Error::Spec(e) => e.kind(),
            Error::Request(e) => e.kind(),
            Error::Video(e) => e.kind(),
            Error::Audio(e) => e.kind(),
            Error::Item { source, .. } => source.kind(),
        }
    }

    /// Stable machine-readable code, e.g. `fetch.too_large`.
    pub fn code(&self) -> &'static str {
        self.kind().code()
    }

    /// The index of the request item that failed, when one did.
    pub fn item_index(&self) -> Option<usize> {
        match self {
            Error::Item { index, .. } => Some(*index),
            _ => None,
        }
    }

    /// Tags this error with the request item it came from.
    pub fn at_item(self, index: usize) -> Error {
        Error::Item {
            index,
            source: Box::new(self),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn every_code_is_unique_dotted_and_has_an_error_status() {
        let mut seen = HashSet::new();
        for kind in ErrorCode::ALL {
            let code = kind.code();
            assert!(seen.insert(code), "{code} is listed twice");
            let (stage, name) = code.split_once('.').expect("a <stage>.<kind> code");
            let lower = |s: &str| {
                !s.is_empty()
                    && s.chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            };
            assert!(lower(stage) && lower(name), "{code}");
            assert!(
                (400..600).contains(&kind.status()),
                "{code}: {}",
                kind.status()
            );
            assert!(!kind.meaning().is_empty(), "{code}");
        }
    }

    #[test]
    fn meanings_state_the_core_limits() {
        assert_eq!(
            ErrorCode::FetchTooLarge.meaning(),
            "a media item is over 64 MiB"
        );
        assert!(ErrorCode::RequestTooManyBytes
            .meaning()
            .ends_with("more than 256 MiB"));
        assert!(ErrorCode::ProcessAspectRatio
            .meaning()
            .contains("200 times"));
    }

    #[test]
    fn an_item_error_keeps_its_code_and_status() {
        let err = Error::from(DecodeError::UnknownFormat).at_item(2);
        assert_eq!(
            (err.code(), err.kind().status()),
            ("decode.unknown_format", 400)
        );
        let err = Error::from(FetchError::TooLarge { limit: 1 });
        assert_eq!((err.code(), err.kind().status()), ("fetch.too_large", 413));
    }
}
