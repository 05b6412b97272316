//! Carriers that flow between the stages, and the model-family trait.
//! A family describes data; it never runs the request (that is `driver.rs`).

use std::borrow::Cow;

use thiserror::Error;

use crate::audio::features::LogMelConfig;
use crate::error::ErrorCode;
use crate::family::spec::Spec;
use crate::image::pan_and_scan::PanAndScan;

/// A decoded image: interleaved RGB8, row-major (HWC).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodedImage {
    pub width: u32,
    pub height: u32,
    pub data: Vec<u8>,
}

impl DecodedImage {
    /// Whether `data` holds exactly `width` x `height` RGB pixels.
    pub fn check_rgb(&self) -> Result<(), ProcessError> {
        let expected = self.width as usize * self.height as usize * 3;
        if self.data.len() != expected {
            return Err(ProcessError::PixelBuffer {
                width: self.width,
                height: self.height,
                len: self.data.len(),
            });
        }
        Ok(())
    }
}

/// A token id as the tokenizer emits it.
pub type TokenId = u32;

/// The element storage of a [`Tensor`]. bf16 is kept as its raw bits.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum TensorData {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
    I64(Vec<i64>),
}

impl TensorData {
    pub fn len(&self) -> usize {
        match self {
            TensorData::F32(v) => v.len(),
            TensorData::Bf16(v) => v.len(),
            TensorData::I64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn dtype(&self) -> &'static str {
        match self {
            TensorData::F32(_) => "float32",
            TensorData::Bf16(_) => "bfloat16",
            TensorData::I64(_) => "int64",
        }
    }
}

/// A dense row-major tensor: the element count always equals the product of `shape`.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    data: TensorData,
}

impl Tensor {
    /// Checks that `data` holds exactly `shape.product()` elements.
    pub fn new(shape: Vec<usize>, data: TensorData) -> Result<Self, ProcessError> {
        let expected = shape.iter().product::<usize>();
        if expected != data.len() {
            return Err(ProcessError::TensorShape {
                shape,
                elements: data.len(),
            });
        }
        Ok(Self { shape, data })
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn data(&self) -> &TensorData {
        &self.data
    }

    pub fn into_parts(self) -> (Vec<usize>, TensorData) {
        (self.shape, self.data)
    }
}

/// Where a media item sits in the model's feature grid.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum Geometry {
    /// A still image: the size it was resized to and its patch grid `[t, h, w]`.
    Image {
        resized_width: u32,
        resized_height: u32,
        grid_thw: [u32; 3],
    },
    /// A video: the size each sampled frame was resized to, its patch grid `[t, h, w]` and
    /// how many positions apart its temporal patches sit (M-RoPE's `time_interval`).
    Video {
        resized_width: u32,
        resized_height: u32,
        grid_thw: [u32; 3],
        time_interval: f32,
        /// The valid feature frames of the video's own audio track, where it is served
        /// interleaved with the frames (`use_audio_in_video`); `None` otherwise.
        track: Option<u32>,
    },
    /// An audio clip: the feature frames the audio tower attends to (the extractor's
    /// attention-mask sum, `valid_frames`), which fix its tokens.
    Audio { frames: u32 },
}

impl Geometry {
    pub fn grid_thw(&self) -> [u32; 3] {
        match self {
            Geometry::Image { grid_thw, .. } | Geometry::Video { grid_thw, .. } => *grid_thw,
            // The plan's grid of a clip: its valid feature frames, one row.
            Geometry::Audio { frames, .. } => [1, 1, *frames],
        }
    }

    pub fn is_video(&self) -> bool {
        matches!(self, Geometry::Video { .. })
    }
}

/// A preprocessed media item: the model input feature, named auxiliary tensors
/// (for example `image_grid_thw`) and its geometry.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessedItem {
    pub feature: Tensor,
    pub aux: Vec<(&'static str, Tensor)>,
    pub geometry: Geometry,
}

impl ProcessedItem {
    pub fn aux(&self, name: &str) -> Option<&Tensor> {
        self.aux.iter().find(|(n, _)| *n == name).map(|(_, t)| t)
    }
}

/// What a media item is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Modality {
    Image,
    Video,
    Audio,
}

impl Modality {
    /// Its name, as the API and the plan spell it.
    pub fn name(self) -> &'static str {
        match self {
            Modality::Image => "image",
            Modality::Video => "video",
            Modality::Audio => "audio",
        }
    }

    /// The item's kind as an error message names it.
    pub fn article_name(self) -> &'static str {
        match self {
            Modality::Image => "an image",
            Modality::Video => "a video",
            Modality::Audio => "an audio clip",
        }
    }
}

/// A token the chat template writes once per media item: where that item's
/// [`PromptUpdate`] goes in the caller's prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placeholder {
    pub id: TokenId,
    pub modality: Modality,
    /// The ids that must sit right before and after it, as the chat template writes them
    /// (engines that find items by the start token rely on that); `None` where any may.
    pub between: Option<(TokenId, TokenId)>,
}

/// Which planned item an [`Embed`] stands for: the request's item itself, one of its
/// pan-and-scan crops (1 for the first) or one temporal group of its video.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EmbedOf {
    Whole,
    Crop(u32),
    TemporalGroup(u32),
}

/// The embedding rows of one planned item: `n` copies of placeholder `id`, the item's span
/// in the expanded prompt (the run vLLM's `is_embed` selects); where the span mixes
/// placeholders (a video's frames interleaved with its audio track), `runs` spells it.
#[derive(Debug, Clone, PartialEq)]
pub struct Embed {
    pub id: TokenId,
    pub n: usize,
    /// The span as `(placeholder, count)` runs adding up to `n`; empty: `n` copies of `id`.
    pub runs: Vec<(TokenId, usize)>,
    pub geometry: Geometry,
    pub of: EmbedOf,
}

/// One run of a [`PromptUpdate`].
#[derive(Debug, Clone, PartialEq)]
pub enum UpdatePart {
    /// Token ids written as they are; text, outside every item's span.
    Ids(Vec<TokenId>),
    /// A text the caller's tokenizer spells (`TextPieces`): a timestamp, the words between
    /// an image and its crops; outside every item's span.
    Text(Cow<'static, str>),
    Embed(Embed),
}

/// What the placeholder of one request item becomes in the expanded prompt (vLLM's
/// `PromptReplacement` with its `PromptUpdateDetails`): the placeholder token is replaced by
/// `parts`, in order; each [`UpdatePart::Embed`] is one planned item.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptUpdate {
    pub parts: Vec<UpdatePart>,
    /// Whether the prompt's text before the placeholder is taken from the caller's
    /// announcing spelling of the prompt (Gemma 3's "Here is the original image " before an
    /// image with crops joins the words before it, so only the tokenizer can spell it).
    pub announced: bool,
}

impl PromptUpdate {
    /// The update's embedding runs, in prompt order.
    pub fn embeds(&self) -> impl Iterator<Item = &Embed> {
        self.parts.iter().filter_map(|part| match part {
            UpdatePart::Embed(embed) => Some(embed),
            _ => None,
        })
    }
}

/// What a family writes one request item's prompt update from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ItemPrompt<'a> {
    pub geometry: Geometry,
    /// The item's pan-and-scan crops, in order (see [`Capabilities::crops`]).
    pub crops: &'a [Geometry],
    /// A video's timestamp text per temporal group (see [`Capabilities::video_timestamps`]).
    pub timestamps: &'a [String],
    /// A video's sampled frames per second, in float64 as the processor spaces the temporal
    /// patches it interleaves an audio track with; `None` for other items.
    pub sampled_fps: Option<f64>,
}

/// Rotary position ids for the expanded prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Positions {
    /// Plain 1-D rope: position `i` for token `i`, nothing to ship.
    Rope1D { len: usize },
    /// Multimodal rope: rows `[t; h; w]` of `len` each, flattened row-major (3 x len),
    /// and `delta = max position + 1 - len` for the decode steps that follow.
    MRope { positions: Vec<i64>, delta: i64 },
}

/// The kind of position ids a family produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeKind {
    Rope1D,
    MRope,
}

/// What a family's vision tower takes per item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VisionInput {
    /// Rows of flattened patches, `[patches, channels x patch area]`, and the patch grid
    /// (Qwen-VL's `pixel_values` with `image_grid_thw`).
    Patches,
    /// One `[3, height, width]` image of the tower's fixed size (SigLIP's).
    Image,
}

/// What a family can take, what it produces, and what its prompt updates need.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Capabilities {
    pub images: bool,
    pub video: bool,
    /// The Whisper-style extractor its audio clips go through (`None`: it takes no audio):
    /// the rate clips are decoded at, and where they are padded and cut.
    pub audio: Option<LogMelConfig>,
    pub rope: RopeKind,
    pub vision_input: VisionInput,
    /// The pan-and-scan knobs images are cropped by, each crop then an item after its image
    /// (Gemma 3 with `do_pan_and_scan`); `None` where images are not cropped.
    pub crops: Option<PanAndScan>,
    /// Whether a video's prompt update writes a timestamp text before each temporal group
    /// (Qwen3-VL): the driver then computes the texts, and the caller's pieces spell them.
    pub video_timestamps: bool,
    /// The fixed texts the prompt updates write (Gemma 3's between an image and its
    /// crops), which the caller gives the tokenizer's ids of.
    pub texts: &'static [&'static str],
    /// The text the caller writes on both sides of each image placeholder before tokenizing
    /// (Gemma 3's "\n\n"): it joins the words beside it, so only the tokenizer can spell it.
    pub image_padding: &'static str,
    /// The text the caller writes before that padding in the announcing prompt (Gemma 3's
    /// "Here is the original image ", before an image with crops).
    pub announcing_text: &'static str,
}

/// A model family's preprocessing, as pure functions over owned data.
pub trait Family: Send + Sync {
    /// The spec the family was built from (the request's processing options included).
    fn spec(&self) -> &Spec;

    fn capabilities(&self) -> Capabilities;

    /// The geometry an image of this size will get, without touching pixels
    /// (the cheap path for token counting).
    fn plan(&self, width: u32, height: u32) -> Result<Geometry, ProcessError>;

    /// Number of prompt tokens the item expands to.
    fn num_tokens(&self, geometry: &Geometry) -> usize;

    /// The geometry of an item whose features the caller already holds (precomputed
    /// embeddings): its patch grid `[t, h, w]` as the vision tower produced it, checked
    /// against what this family's tower can produce for an image.
    fn geometry_from_grid(&self, grid_thw: [u32; 3]) -> Result<Geometry, ProcessError>;

    /// The geometry of a video planned to patch grid `grid_thw` from frames resized to
    /// `resized` (width, height) and sampled at `sampled_fps` frames per second of video;
    /// a family without video refuses.
    fn video_geometry(
        &self,
        grid_thw: [u32; 3],
        resized: (u32, u32),
        sampled_fps: f64,
    ) -> Result<Geometry, ProcessError> {
        let _ = (grid_thw, resized, sampled_fps);
        Err(ProcessError::VideoUnsupported)
    }

    /// Resize, normalise and lay out one image as the model's input feature.
    fn process_item(&self, image: &DecodedImage) -> Result<ProcessedItem, crate::Error>;

    /// The placeholder tokens the chat template writes, one per request item.
    fn placeholders(&self) -> Vec<Placeholder>;

    /// What the placeholder of one request item becomes in the prompt.
    fn prompt_update(&self, item: &ItemPrompt<'_>) -> Result<PromptUpdate, ProcessError>;

    /// Position ids for an expanded prompt of `len` tokens whose item `i` occupies
    /// `offsets[i] = (start, end)`.
    fn positions(
        &self,
        len: usize,
        offsets: &[(usize, usize)],
        geometries: &[Geometry],
    ) -> Result<Positions, ProcessError>;
}

/// Errors of the family-level steps: geometry, layout, positions and tensor shapes.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ProcessError {
    #[error(
        "image of {width}x{height} has an aspect ratio over the limit of {limit}; crop or pad it"
    )]
    AspectRatio { width: u32, height: u32, limit: u32 },
    #[error("image has a zero dimension ({width}x{height})")]
    EmptyImage { width: u32, height: u32 },
    #[error(
        "image placeholder at prompt position {index} must sit between vision start and end \
         tokens ({start}, {placeholder}, {end}), as the chat template writes it"
    )]
    PlaceholderContext {
        index: usize,
        start: TokenId,
        placeholder: TokenId,
        end: TokenId,
    },
    #[error(
        "the prompt has {placeholders} media placeholder(s) but {items} media item(s) were \
         given; put exactly one placeholder per item"
    )]
    PlaceholderCount { placeholders: usize, items: usize },
    #[error(
        "the media placeholder at prompt position {index} is for {placeholder}, but item {item} \
         is {given}; the prompt's text must not spell media placeholder tokens"
    )]
    PlaceholderModality {
        index: usize,
        item: usize,
        placeholder: &'static str,
        given: &'static str,
    },
    #[error("{} input is not supported for this model family", .0.name())]
    ModalityUnsupported(Modality),
    #[error(
        "video input is not supported for this model family (supported: Qwen2-VL, \
         Qwen2.5-VL, Qwen3-VL)"
    )]
    VideoUnsupported,
    #[error("image grid {grid_thw:?} is not one this model's vision tower produces: {reason}")]
    Grid { grid_thw: [u32; 3], reason: String },
    #[error("item offsets do not fit the prompt: {0}")]
    Offsets(String),
    #[error("tensor of shape {shape:?} cannot hold {elements} elements")]
    TensorShape { shape: Vec<usize>, elements: usize },
    #[error("pixel buffer of {len} bytes does not match a {width}x{height} RGB image")]
    PixelBuffer { width: u32, height: u32, len: usize },
    #[error("pan-and-scan cannot be planned: {0}")]
    PanAndScan(&'static str),
    #[error("the prompt cannot be written: {0}")]
    PromptText(String),
}

impl ProcessError {
    /// This error's entry in the catalogue of codes.
    pub fn kind(&self) -> ErrorCode {
        match self {
            ProcessError::AspectRatio { .. } => ErrorCode::ProcessAspectRatio,
            ProcessError::EmptyImage { .. } => ErrorCode::ProcessEmptyImage,
            ProcessError::PlaceholderContext { .. } => ErrorCode::ProcessPlaceholderContext,
            ProcessError::PlaceholderCount { .. } => ErrorCode::ProcessPlaceholderCount,
            ProcessError::PlaceholderModality { .. } => ErrorCode::ProcessPlaceholderModality,
            ProcessError::VideoUnsupported => ErrorCode::ProcessVideoUnsupported,
            ProcessError::ModalityUnsupported(_) => ErrorCode::ProcessModalityUnsupported,
            ProcessError::Grid { .. } => ErrorCode::ProcessGrid,
            ProcessError::Offsets(_) => ErrorCode::ProcessOffsets,
            ProcessError::TensorShape { .. } => ErrorCode::ProcessTensorShape,
            ProcessError::PixelBuffer { .. } => ErrorCode::ProcessPixelBuffer,
            ProcessError::PanAndScan(_) => ErrorCode::ProcessPanAndScan,
            ProcessError::PromptText(_) => ErrorCode::ProcessPromptText,
        }
    }

    /// Stable machine-readable code, e.g. `process.aspect_ratio`.
    pub fn code(&self) -> &'static str {
        self.kind().code()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_rejects_a_shape_that_does_not_match_its_data() {
        let err = Tensor::new(vec![2, 3], TensorData::F32(vec![0.0; 5])).unwrap_err();
        assert_eq!(err.code(), "process.tensor_shape");
        let ok = Tensor::new(vec![2, 3], TensorData::I64(vec![0; 6])).unwrap();
        assert_eq!(ok.shape(), &[2, 3]);
        assert_eq!(ok.data().dtype(), "int64");
    }
}
