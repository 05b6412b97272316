//! The request driver: the fixed per-request steps and their failure semantics.
//!
//! Per item: fetch (inline, in order) -> content hash of the raw bytes -> decode ->
//! `process_item` (fanned out through `common::par`); then each item's prompt update from its
//! family, applied by the one layout (`family::token_layout`) -> expanded ids + per-item
//! offsets -> positions. A video is planned from its container's headers alone (with the
//! `video` feature): its sampled frames, grid, token count and identity; its pixels are the
//! encoder's work. An update may write several items for one request item (Qwen3-VL's
//! temporal groups, each after its timestamp text; Gemma 3's pan-and-scan crops after their
//! image): each embedding run of the update is one planned item. Any failure rejects the
//! whole request; an item's failure carries its index.

use std::borrow::Cow;
use std::time::Duration;

use thiserror::Error;

use crate::audio::{AudioError, AudioFormat};
use crate::common::par;
use crate::common::text_pieces::TextPieces;
use crate::error::ErrorCode;
use crate::family::token_layout::{apply, Prompt};
use crate::identity;
use crate::image::decode::{decode_image, probe_image, DecodeLimits};
use crate::image::pan_and_scan::crop;
pub use crate::pipeline::Modality;
use crate::pipeline::{
    EmbedOf, Family, Geometry, ItemPrompt, Positions, ProcessError, ProcessedItem, PromptUpdate,
    TokenId,
};
use crate::source::fetch::{fetch_bytes, FetchError, FetchPolicy};
use crate::video::VideoError;
use crate::Error;

/// Most media items one request may carry.
pub const MAX_ITEMS_PER_REQUEST: usize = 64;
/// Most encoded bytes one request may bring in, all items together (256 MiB).
pub const MAX_BYTES_PER_REQUEST: u64 = 256 << 20;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RequestError {
    #[error("request has {count} media items; the limit is {limit} per request")]
    TooManyItems { count: usize, limit: usize },
    #[error(
        "request media add up to more than {} MiB ({limit} bytes, the per-request limit) \
         at item {index}; send fewer or smaller images",
        limit >> 20
    )]
    TooManyBytes { index: usize, limit: u64 },
}

impl RequestError {
    /// This error's entry in the catalogue of codes.
    pub fn kind(&self) -> ErrorCode {
        match self {
            RequestError::TooManyItems { .. } => ErrorCode::RequestTooManyItems,
            RequestError::TooManyBytes { .. } => ErrorCode::RequestTooManyBytes,
        }
    }

    /// Stable machine-readable code, e.g. `request.too_many_items`.
    pub fn code(&self) -> &'static str {
        self.kind().code()
    }
}

/// One media item as the request gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MediaInput<'a> {
    /// A reference to fetch: URL, `data:` URL, bare base64 or local path.
    Source(&'a str),
    /// Bytes someone already fetched (the frontend, for instance).
    Bytes(&'a [u8]),
    /// An item the caller holds the model features of (precomputed embeddings): its identity
    /// and patch grid are given, nothing is fetched or decoded.
    Planned { hash: u64, grid_thw: [u32; 3] },
}

/// One media item of a request: what it is and where it comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MediaItem<'a> {
    pub modality: Modality,
    pub input: MediaInput<'a>,
    /// The format an audio part names (`input_audio.format`): data of another is refused.
    pub format: Option<AudioFormat>,
}

impl<'a> MediaItem<'a> {
    pub fn image(input: MediaInput<'a>) -> Self {
        MediaItem {
            modality: Modality::Image,
            input,
            format: None,
        }
    }

    pub fn video(input: MediaInput<'a>) -> Self {
        MediaItem {
            modality: Modality::Video,
            input,
            format: None,
        }
    }

    pub fn audio(input: MediaInput<'a>, format: Option<AudioFormat>) -> Self {
        MediaItem {
            modality: Modality::Audio,
            input,
            format,
        }
    }
}

/// One item after fetching: its bytes, or the facts of a planned item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fetched<'a> {
    Bytes(Cow<'a, [u8]>),
    Planned { hash: u64, grid_thw: [u32; 3] },
}

impl Fetched<'_> {
    /// The item as driver input, borrowing the fetched bytes.
    pub fn as_input(&self) -> MediaInput<'_> {
        match self {
            Fetched::Bytes(bytes) => MediaInput::Bytes(bytes),
            Fetched::Planned { hash, grid_thw } => MediaInput::Planned {
                hash: *hash,
                grid_thw: *grid_thw,
            },
        }
    }

    /// The fetched bytes; `None` for a planned item.
    pub fn bytes(&self) -> Option<&[u8]> {
        match self {
            Fetched::Bytes(bytes) => Some(bytes),
            Fetched::Planned { .. } => None,
        }
    }
}

/// How much of each item to produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Model inputs (pixel values and aux tensors) too.
    Full,
    /// Token count, hash and geometry only, the size read from the headers: no decode, no
    /// resize, no pixel values.
    CountOnly,
}

/// Request-level settings of the driver.
#[derive(Debug, Clone, Default)]
pub struct DriverOptions {
    pub fetch: FetchPolicy,
    pub decode: DecodeLimits,
    /// How the request's videos are sampled and sized, and the caps their headers must meet.
    #[cfg(feature = "video")]
    pub video: Option<crate::video::process::VideoOptions>,
    /// The caps an audio clip's headers must meet (its duration: `--max-audio-duration`).
    #[cfg(feature = "audio")]
    pub audio: crate::audio::decode::AudioLimits,
    /// Reading the request's videos' headers ends with `video.deadline` this long after
    /// they were fetched.
    pub video_timeout: Option<Duration>,
    /// The tokenizer's ids of the texts prompt updates write: timestamp texts, for families
    /// that write one before each temporal group of a video; the family's own texts
    /// ([`Capabilities::texts`](crate::pipeline::Capabilities::texts)).
    pub text_pieces: Option<TextPieces>,
    /// For a family that pans and scans: the prompt tokenized with each image's text
    /// announcing crops, as the processor writes an image that has them (an image that has
    /// none takes its text from the plain prompt).
    pub panned_input_ids: Option<Vec<TokenId>>,
}

/// What the driver produced for one item.
#[derive(Debug, Clone, PartialEq)]
pub struct ItemOutput {
    /// The item's identity (mm_hash, [`crate::identity`]): an image's content hash, folded with
    /// its crop and the request's pixel bounds where it has them; a video's folded with its
    /// sampling and sizing options; a precomputed item's as given.
    pub hash: u64,
    /// Size of the decoded image (after EXIF orientation), or of the video's frames.
    pub width: u32,
    pub height: u32,
    pub geometry: Geometry,
    pub num_tokens: usize,
    /// `None` in [`Mode::CountOnly`], for a planned item and for a video.
    pub processed: Option<ProcessedItem>,
    /// The index of the request's media item this one comes from.
    pub source: usize,
    /// Which temporal group of its video this item is, for a family that plans a video one
    /// group per item (its `hash` then [`identity::video_group`]); `None` otherwise.
    pub temporal_group: Option<u32>,
    /// Which pan-and-scan crop of its image this item is, 1 for the first (its `hash` then
    /// [`identity::crop`]'s); `None` for the image itself and everything else.
    pub crop: Option<u32>,
}

/// The whole request, ready for the model.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestOutput {
    pub input_ids: Vec<TokenId>,
    /// `offsets[i] = (start, end)` of item `i` in `input_ids`.
    pub offsets: Vec<(usize, usize)>,
    /// The planned items, in prompt order: one per media item of the request, or one per
    /// temporal group of a video (see [`ItemOutput::temporal_group`]); an image's crops
    /// after it (see [`ItemOutput::crop`]).
    pub items: Vec<ItemOutput>,
    pub positions: Positions,
}

/// Runs one request: `input_ids` has one placeholder per item, in item order.
pub fn run(
    family: &dyn Family,
    input_ids: &[TokenId],
    media: &[MediaItem<'_>],
    options: &DriverOptions,
    mode: Mode,
) -> Result<RequestOutput, Error> {
    if media.len() > MAX_ITEMS_PER_REQUEST {
        return Err(RequestError::TooManyItems {
            count: media.len(),
            limit: MAX_ITEMS_PER_REQUEST,
        }
        .into());
    }
    let capabilities = family.capabilities();
    for (index, m) in media.iter().enumerate() {
        let taken = match m.modality {
            Modality::Video if !capabilities.video => {
                return Err(ProcessError::VideoUnsupported.into())
            }
            Modality::Video => true,
            Modality::Image => capabilities.images,
            Modality::Audio => capabilities.audio.is_some(),
        };
        if !taken {
            return Err(Error::from(ProcessError::ModalityUnsupported(m.modality)).at_item(index));
        }
    }
    let inputs: Vec<MediaInput<'_>> = media.iter().map(|m| m.input).collect();
    let fetched = fetch_all(&inputs, &options.fetch)?;
    let options = &with_video_deadline(options);
    let work: Vec<(usize, &MediaItem<'_>, &Fetched<'_>)> = media
        .iter()
        .zip(&fetched)
        .enumerate()
        .map(|(index, (m, item))| (index, m, item))
        .collect();
    let prepared = par::try_map(&work, |&(index, m, item)| {
        prepare_item(family, index, m, item, options, mode)
    })
    .map_err(|(index, e)| e.at_item(index))?;
    let updates = media
        .iter()
        .zip(&prepared)
        .map(|(m, p)| Ok((m.modality, p.prompt_update(family)?)))
        .collect::<Result<Vec<_>, ProcessError>>()?;
    let prompt = Prompt {
        ids: input_ids,
        announcing_ids: options.panned_input_ids.as_deref(),
        pieces: options.text_pieces.as_ref(),
    };
    let expanded = apply(&prompt, &family.placeholders(), &updates)?;
    let mut items = Vec::with_capacity(expanded.offsets.len());
    for (p, (_, update)) in prepared.into_iter().zip(&updates) {
        items.extend(p.planned_items(update)?);
    }
    let geometries: Vec<Geometry> = items.iter().map(|item| item.geometry).collect();
    let positions = family.positions(expanded.ids.len(), &expanded.offsets, &geometries)?;
    Ok(RequestOutput {
        input_ids: expanded.ids,
        offsets: expanded.offsets,
        items,
        positions,
    })
}

/// One request item as prepared: its plan, for a video whose family writes timestamps each
/// temporal group's text, and for an image that the family pans and scans its crops' plans.
struct Prepared {
    item: ItemOutput,
    timestamps: Vec<String>,
    crops: Vec<ItemOutput>,
    /// A video's sampled frames per second ([`ItemPrompt::sampled_fps`]).
    sampled_fps: Option<f64>,
}

impl Prepared {
    fn whole(item: ItemOutput) -> Self {
        Prepared {
            item,
            timestamps: Vec::new(),
            crops: Vec::new(),
            sampled_fps: None,
        }
    }

    /// What `family` writes this item's placeholder as.
    fn prompt_update(&self, family: &dyn Family) -> Result<PromptUpdate, ProcessError> {
        let crops: Vec<Geometry> = self.crops.iter().map(|c| c.geometry).collect();
        family.prompt_update(&ItemPrompt {
            geometry: self.item.geometry,
            crops: &crops,
            timestamps: &self.timestamps,
            sampled_fps: self.sampled_fps,
        })
    }

    /// The planned items of `update`'s embedding runs, in prompt order: the item itself, one
    /// of its crops, or one temporal group of its video (identity [`identity::video_group`]).
    fn planned_items(self, update: &PromptUpdate) -> Result<Vec<ItemOutput>, ProcessError> {
        let mut crops = self.crops.into_iter().map(Some).collect::<Vec<_>>();
        let items = update
            .embeds()
            .map(|embed| {
                let item = match embed.of {
                    EmbedOf::Whole => self.item.clone(),
                    EmbedOf::Crop(crop) => crop
                        .checked_sub(1)
                        .and_then(|k| crops.get_mut(k as usize))
                        .and_then(Option::take)
                        .ok_or_else(|| {
                            ProcessError::Offsets(format!("crop {crop} laid out but not planned"))
                        })?,
                    EmbedOf::TemporalGroup(group) => ItemOutput {
                        hash: identity::video_group(self.item.hash, group),
                        temporal_group: Some(group),
                        ..self.item.clone()
                    },
                };
                Ok(ItemOutput {
                    geometry: embed.geometry,
                    num_tokens: embed.n,
                    ..item
                })
            })
            .collect::<Result<Vec<_>, ProcessError>>()?;
        if crops.iter().any(Option::is_some) {
            return Err(ProcessError::Offsets(
                "a planned crop was not laid out".to_string(),
            ));
        }
        Ok(items)
    }
}

/// Fetches in order, refusing as soon as the running total passes the request cap. Each
/// source may bring at most what the request has left, so the one that would cross the cap
/// is refused from its announced size (Content-Length, file size) before it is read.
/// Planned items pass through.
pub fn fetch_all<'a>(
    media: &[MediaInput<'a>],
    policy: &FetchPolicy,
) -> Result<Vec<Fetched<'a>>, Error> {
    let mut total: u64 = 0;
    let mut out = Vec::with_capacity(media.len());
    for (index, input) in media.iter().enumerate() {
        let too_many_bytes = || -> Error {
            RequestError::TooManyBytes {
                index,
                limit: MAX_BYTES_PER_REQUEST,
            }
            .into()
        };
        let left = MAX_BYTES_PER_REQUEST.saturating_sub(total);
        let bytes = match input {
            MediaInput::Source(source) if left < policy.max_bytes => {
                let budget = FetchPolicy {
                    max_bytes: left,
                    ..policy.clone()
                };
                match fetch_bytes(source, &budget) {
                    Err(FetchError::TooLarge { .. }) => return Err(too_many_bytes()),
                    fetched => Cow::Owned(fetched.map_err(|e| Error::from(e).at_item(index))?),
                }
            }
            MediaInput::Source(source) => {
                Cow::Owned(fetch_bytes(source, policy).map_err(|e| Error::from(e).at_item(index))?)
            }
            MediaInput::Bytes(bytes) => Cow::Borrowed(*bytes),
            MediaInput::Planned { hash, grid_thw } => {
                out.push(Fetched::Planned {
                    hash: *hash,
                    grid_thw: *grid_thw,
                });
                continue;
            }
        };
        total += bytes.len() as u64;
        if total > MAX_BYTES_PER_REQUEST {
            return Err(too_many_bytes());
        }
        out.push(Fetched::Bytes(bytes));
    }
    Ok(out)
}

/// `options` with the video deadline starting now (the request's media are fetched).
fn with_video_deadline(options: &DriverOptions) -> Cow<'_, DriverOptions> {
    #[cfg(feature = "video")]
    if let (Some(video), Some(timeout)) = (options.video, options.video_timeout) {
        let mut options = options.clone();
        let deadline = std::time::Instant::now().checked_add(timeout);
        options.video = Some(crate::video::process::VideoOptions {
            limits: crate::video::demux::VideoLimits {
                deadline,
                ..video.limits
            },
            ..video
        });
        return Cow::Owned(options);
    }
    Cow::Borrowed(options)
}

fn prepare_item(
    family: &dyn Family,
    source: usize,
    media: &MediaItem<'_>,
    item: &Fetched<'_>,
    options: &DriverOptions,
    mode: Mode,
) -> Result<Prepared, Error> {
    let whole = Prepared::whole;
    let bytes = match (item, media.modality) {
        (Fetched::Bytes(bytes), Modality::Image) => bytes,
        (Fetched::Bytes(bytes), Modality::Audio) => {
            return prepare_audio(family, source, bytes, media.format, options).map(whole)
        }
        (Fetched::Planned { hash, grid_thw }, Modality::Audio) => {
            return planned_audio(family, source, *hash, *grid_thw).map(whole)
        }
        (Fetched::Bytes(bytes), Modality::Video) => {
            return prepare_video(family, source, bytes, options)
        }
        (Fetched::Planned { grid_thw, .. }, Modality::Video) => {
            return Err(ProcessError::Grid {
                grid_thw: *grid_thw,
                reason: "a video is planned from its bytes, not from a grid".to_string(),
            }
            .into())
        }
        (Fetched::Planned { hash, grid_thw }, Modality::Image) => {
            let geometry = family.geometry_from_grid(*grid_thw)?;
            let (width, height) = match geometry {
                Geometry::Image {
                    resized_width,
                    resized_height,
                    ..
                }
                | Geometry::Video {
                    resized_width,
                    resized_height,
                    ..
                } => (resized_width, resized_height),
                Geometry::Audio { .. } => (0, 0),
            };
            return Ok(whole(ItemOutput {
                hash: *hash,
                width,
                height,
                geometry,
                num_tokens: family.num_tokens(&geometry),
                processed: None,
                source,
                temporal_group: None,
                crop: None,
            }));
        }
    };
    let mut items = image_and_crops(family, bytes, source, &options.decode, mode)?.into_iter();
    let mut prepared = items
        .next()
        .map(whole)
        .ok_or(ProcessError::PanAndScan("an image planned to nothing"))?;
    prepared.crops = items.collect();
    Ok(prepared)
}

/// An audio clip's plan: the caps checked from its headers, then its samples at the family's
/// rate, the frames and tokens they make, and its identity ([`identity::audio`]). Its
/// features are the encoder's work, so the samples are counted without decoding wherever the
/// headers fix the frames ([`probe_samples`]: a clip past the extractor's chunk, integer PCM
/// in WAV); elsewhere (compressed audio shorter than the chunk, float PCM) the clip is decoded
/// up to the chunk (what the processor cuts it to, so a longer clip is never decoded whole).
#[cfg(feature = "audio")]
fn prepare_audio(
    family: &dyn Family,
    source: usize,
    bytes: &[u8],
    format: Option<AudioFormat>,
    options: &DriverOptions,
) -> Result<ItemOutput, Error> {
    let (extractor, geometry) = clip_geometry(family, bytes, format, options)?;
    let num_tokens = family.num_tokens(&geometry);
    let hash = identity::audio(identity::content(bytes), &extractor);
    Ok(clip_output(hash, geometry, num_tokens, source))
}

/// The geometry of the clip `bytes` hold (a video's own audio track too, its best audio
/// stream), with the family's extractor: the caps checked from its headers, then its samples
/// at the family's rate and the frames they make. A clip too short to make a token is
/// refused.
#[cfg(feature = "audio")]
fn clip_geometry(
    family: &dyn Family,
    bytes: &[u8],
    format: Option<AudioFormat>,
    options: &DriverOptions,
) -> Result<(crate::audio::features::LogMelConfig, Geometry), Error> {
    use crate::audio::decode::{count_samples, DecodeOptions, SampleBounds, SampleCount};

    let extractor = family
        .capabilities()
        .audio
        .ok_or(ProcessError::ModalityUnsupported(Modality::Audio))?;
    let decode = DecodeOptions {
        sample_rate: extractor.sampling_rate,
        max_samples: extractor.truncation.then(|| extractor.chunk_samples()),
    };
    let kept = |n: u64| extractor.kept_samples(usize::try_from(n).unwrap_or(usize::MAX));
    let plan = |n: usize| (extractor.frames(n), extractor.extractable(n));
    // Settled where every count the bounds allow makes the same frames, featurized alike.
    let settled = |b: &SampleBounds| plan(kept(b.min)) == plan(kept(b.max));
    let samples = match count_samples(bytes, format, &decode, &options.audio, settled)? {
        SampleCount::Bounded(bounds) => kept(bounds.min),
        SampleCount::Decoded(decoded) => extractor.kept_samples(decoded.samples.len()),
    };
    let (_, valid) = extractor.frames(samples);
    let frames = u32::try_from(valid).map_err(|_| ProcessError::Offsets("frames".into()))?;
    let geometry = Geometry::Audio { frames };
    // A clip must make a token, and (unpadded) more samples than the half window the
    // extractor reflects.
    let takes = |n: usize| {
        let (_, valid) = extractor.frames(n);
        let frames = u32::try_from(valid).unwrap_or(u32::MAX);
        extractor.extractable(n) && family.num_tokens(&Geometry::Audio { frames }) > 0
    };
    if !takes(samples) {
        // The shortest clip taken lies within a few hops and a window.
        let bound = 16 * extractor.hop_length + extractor.n_fft;
        let min = (samples + 1..=bound).find(|&n| takes(n)).unwrap_or(bound);
        return Err(AudioError::TooShort { samples, min }.into());
    }
    Ok((extractor, geometry))
}

/// A clip's plan: its run, no pixels (its features are the encoder's work).
fn clip_output(hash: u64, geometry: Geometry, num_tokens: usize, source: usize) -> ItemOutput {
    ItemOutput {
        hash,
        width: 0,
        height: 0,
        geometry,
        num_tokens,
        processed: None,
        source,
        temporal_group: None,
        crop: None,
    }
}

/// A clip named by its identity and grid `[1, 1, valid frames]` (a media id, precomputed
/// rows): its tokens are those the frames make, which a clip of the family gives only between
/// one token and the extractor's chunk.
fn planned_audio(
    family: &dyn Family,
    source: usize,
    hash: u64,
    grid_thw: [u32; 3],
) -> Result<ItemOutput, Error> {
    let extractor = family
        .capabilities()
        .audio
        .ok_or(ProcessError::ModalityUnsupported(Modality::Audio))?;
    let grid = |reason: String| ProcessError::Grid { grid_thw, reason };
    let [1, 1, frames] = grid_thw else {
        return Err(grid("an audio clip's grid is [1, 1, valid frames]".to_string()).into());
    };
    let (_, most) = extractor.frames(extractor.chunk_samples());
    let geometry = Geometry::Audio { frames };
    let num_tokens = family.num_tokens(&geometry);
    if frames as usize > most || num_tokens == 0 {
        let reason =
            format!("an audio clip of this model makes a token and has {most} frames at most");
        return Err(grid(reason).into());
    }
    Ok(clip_output(hash, geometry, num_tokens, source))
}

#[cfg(all(feature = "video", not(feature = "audio")))]
fn clip_geometry(
    _family: &dyn Family,
    _bytes: &[u8],
    _format: Option<AudioFormat>,
    _options: &DriverOptions,
) -> Result<((), Geometry), Error> {
    Err(AudioError::Unavailable("the core was built without the audio feature").into())
}

#[cfg(not(feature = "audio"))]
fn prepare_audio(
    _family: &dyn Family,
    _source: usize,
    _bytes: &[u8],
    _format: Option<AudioFormat>,
    _options: &DriverOptions,
) -> Result<ItemOutput, Error> {
    Err(AudioError::Unavailable("the core was built without the audio feature").into())
}

/// An image's plan (its pixels too in [`Mode::Full`]), then its crops' where the family
/// pans and scans, each with its identity ([`identity::image`]).
pub fn image_and_crops(
    family: &dyn Family,
    bytes: &[u8],
    source: usize,
    limits: &DecodeLimits,
    mode: Mode,
) -> Result<Vec<ItemOutput>, Error> {
    let content = identity::content(bytes);
    let knobs = family.capabilities().crops;
    let bounds = family.spec().pixel_bounds;
    let crops_of = |width, height| {
        let crops = knobs.map(|k| k.crops(width, height)).unwrap_or_default();
        // The processor cannot resize an empty crop either.
        match crops.iter().find(|c| c.width == 0 || c.height == 0) {
            Some(c) => Err(ProcessError::EmptyImage {
                width: c.width,
                height: c.height,
            }),
            None => Ok(crops),
        }
    };
    // The image, then each of its crops: (size, geometry, pixels).
    let mut parts = Vec::new();
    match mode {
        Mode::CountOnly => {
            let info = probe_image(bytes, limits)?;
            let geometry = family.plan(info.width, info.height)?;
            parts.push((info.width, info.height, geometry, None));
            for c in crops_of(info.width, info.height)? {
                parts.push((c.width, c.height, family.plan(c.width, c.height)?, None));
            }
        }
        Mode::Full => {
            let image = decode_image(bytes, limits)?;
            let crops = crops_of(image.width, image.height)?;
            let item = family.process_item(&image)?;
            parts.push((image.width, image.height, item.geometry, Some(item)));
            for c in crops {
                let item = family.process_item(&crop(&image, c)?)?;
                parts.push((c.width, c.height, item.geometry, Some(item)));
            }
        }
    }
    Ok(parts
        .into_iter()
        .zip(0u32..)
        .map(|((width, height, geometry, processed), index)| ItemOutput {
            hash: match (index, &knobs) {
                (1.., Some(knobs)) => identity::image(content, Some((index, knobs)), bounds),
                _ => identity::image(content, None, bounds),
            },
            width,
            height,
            geometry,
            num_tokens: family.num_tokens(&geometry),
            processed,
            source,
            temporal_group: None,
            crop: (index > 0).then_some(index),
        })
        .collect())
}

/// A video's plan from its headers: sampled frames, grid, token count and identity, and
/// each temporal group's timestamp text where the family writes them.
#[cfg(feature = "video")]
fn prepare_video(
    family: &dyn Family,
    source: usize,
    bytes: &[u8],
    options: &DriverOptions,
) -> Result<Prepared, Error> {
    use crate::video::timestamps::{group_timestamps, timestamp_text};

    let video = options.video.as_ref().ok_or(VideoError::Unavailable(
        "the request's video options were not given",
    ))?;
    let plan = crate::video::process::plan_video(bytes, video)?;
    // transformers' `VideoMetadata.sampled_fps`: the frames kept per second of video.
    let sampled_fps = plan.indices.len() as f64 / plan.info.total_frames as f64 * plan.info.fps;
    let geometry = family.video_geometry(
        plan.grid_thw,
        (plan.resized_width, plan.resized_height),
        sampled_fps,
    )?;
    let geometry = if video.audio_track {
        with_audio_track(family, bytes, options, geometry)?
    } else {
        geometry
    };
    let timestamps = if family.capabilities().video_timestamps {
        group_timestamps(
            &plan.indices,
            plan.info.fps,
            video.geometry.temporal as usize,
        )
        .into_iter()
        .map(timestamp_text)
        .collect()
    } else {
        Vec::new()
    };
    Ok(Prepared {
        item: ItemOutput {
            hash: plan.mm_hash,
            width: plan.info.width,
            height: plan.info.height,
            geometry,
            num_tokens: family.num_tokens(&geometry),
            processed: None,
            source,
            temporal_group: None,
            crop: None,
        },
        timestamps,
        crops: Vec::new(),
        sampled_fps: Some(sampled_fps),
    })
}

/// A video's geometry with its own audio track (`use_audio_in_video`), for a family that
/// interleaves one: the track is the best audio stream of the same bytes, counted as a clip
/// is ([`clip_geometry`]); a video without one is refused (`audio.no_audio_stream`).
#[cfg(feature = "video")]
fn with_audio_track(
    family: &dyn Family,
    bytes: &[u8],
    options: &DriverOptions,
    geometry: Geometry,
) -> Result<Geometry, Error> {
    let interleaves = family.spec().audio.is_some_and(|a| a.in_video.is_some());
    let Geometry::Video {
        resized_width,
        resized_height,
        grid_thw,
        time_interval,
        ..
    } = geometry
    else {
        return Err(ProcessError::VideoUnsupported.into());
    };
    if !interleaves {
        return Err(ProcessError::ModalityUnsupported(Modality::Audio).into());
    }
    let (_, track) = clip_geometry(family, bytes, None, options)?;
    let Geometry::Audio { frames, .. } = track else {
        return Err(ProcessError::Offsets("a track planned as no clip".into()).into());
    };
    Ok(Geometry::Video {
        resized_width,
        resized_height,
        grid_thw,
        time_interval,
        track: Some(frames),
    })
}

#[cfg(not(feature = "video"))]
fn prepare_video(
    _family: &dyn Family,
    _source: usize,
    _bytes: &[u8],
    _options: &DriverOptions,
) -> Result<Prepared, Error> {
    Err(VideoError::Unavailable("this build has no video support").into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::registry::{family_from_spec, spec_from_hf_configs};
    use crate::family::token_layout::{apply, Prompt};

    const IMG: TokenId = 151655;
    const START: TokenId = 151652;
    const END: TokenId = 151653;

    fn family() -> std::sync::Arc<dyn Family> {
        let config = r#"{"model_type": "qwen2_vl", "image_token_id": 151655,
            "vision_start_token_id": 151652, "vision_end_token_id": 151653}"#;
        family_from_spec(&spec_from_hf_configs("{}", config).unwrap()).unwrap()
    }

    fn png(width: u32, height: u32) -> Vec<u8> {
        let mut out = Vec::new();
        let mut encoder = png::Encoder::new(&mut out, width, height);
        encoder.set_color(png::ColorType::Rgb);
        let mut writer = encoder.write_header().unwrap();
        let data: Vec<u8> = (0..width * height * 3).map(|i| (i % 251) as u8).collect();
        writer.write_image_data(&data).unwrap();
        writer.finish().unwrap();
        out
    }

    fn prompt(n: usize) -> Vec<TokenId> {
        let mut ids = vec![1];
        for _ in 0..n {
            ids.extend([START, IMG, END, 2]);
        }
        ids
    }

    fn run_bytes(ids: &[TokenId], items: &[&[u8]], mode: Mode) -> Result<RequestOutput, Error> {
        let media: Vec<MediaItem<'_>> = items
            .iter()
            .map(|b| MediaItem::image(MediaInput::Bytes(b)))
            .collect();
        run(
            family().as_ref(),
            ids,
            &media,
            &DriverOptions::default(),
            mode,
        )
    }

    #[test]
    fn count_only_matches_full_without_pixels() {
        let (a, b) = (png(90, 40), png(33, 70));
        let full = run_bytes(&prompt(2), &[&a, &b], Mode::Full).unwrap();
        let cheap = run_bytes(&prompt(2), &[&a, &b], Mode::CountOnly).unwrap();
        assert_eq!(full.input_ids, cheap.input_ids);
        assert_eq!(full.offsets, cheap.offsets);
        assert_eq!(full.positions, cheap.positions);
        for (f, c) in full.items.iter().zip(&cheap.items) {
            assert_eq!(
                (f.hash, f.geometry, f.num_tokens),
                (c.hash, c.geometry, c.num_tokens)
            );
            assert!(f.processed.is_some() && c.processed.is_none());
        }
    }

    #[test]
    fn a_request_s_pixel_bounds_resize_the_image_and_enter_its_identity() {
        let image = png(300, 200);
        let media = [MediaItem::image(MediaInput::Bytes(&image))];
        let plain = family();
        let spec = plain.spec();
        let bounded = spec.with_pixel_bounds(Some([3136, 20_000])).unwrap();
        let own = spec.with_pixel_bounds(Some([spec.min_pixels, spec.max_pixels]));
        assert_eq!(own.unwrap(), *spec);
        let bounded = family_from_spec(&bounded).unwrap();
        let options = DriverOptions::default();
        for mode in [Mode::Full, Mode::CountOnly] {
            let a = run(plain.as_ref(), &prompt(1), &media, &options, mode).unwrap();
            let b = run(bounded.as_ref(), &prompt(1), &media, &options, mode).unwrap();
            let content = identity::content(&image);
            assert_eq!(a.items[0].hash, content);
            assert_eq!(
                b.items[0].hash,
                identity::with_pixel_bounds(content, [3136, 20_000])
            );
            assert!(b.items[0].num_tokens < a.items[0].num_tokens);
        }
    }

    #[test]
    fn caps_name_their_limit() {
        let small = png(8, 8);
        let many: Vec<&[u8]> = vec![&small; MAX_ITEMS_PER_REQUEST + 1];
        let err = run_bytes(&prompt(many.len()), &many, Mode::CountOnly).unwrap_err();
        assert_eq!(err.code(), "request.too_many_items");
        assert!(err.to_string().contains("64"));

        let big = vec![0u8; (MAX_BYTES_PER_REQUEST / 4 + 1) as usize];
        let err = run_bytes(&prompt(4), &[&big, &big, &big, &big], Mode::CountOnly).unwrap_err();
        assert_eq!(err.code(), "request.too_many_bytes");
        assert!(err.to_string().contains("item 3"));
    }

    #[test]
    fn the_source_that_crosses_the_byte_cap_is_refused_before_it_is_read() {
        let dir = std::env::temp_dir().join(format!("mmserve-driver-cap-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // Sparse files: four that fit the request's cap together, and one claiming 1 TiB,
        // refused from its size by the bytes the request has left rather than read to the
        // per-source cap.
        let sizes = [60 << 20, 60 << 20, 60 << 20, 60 << 20, 1 << 40];
        let paths: Vec<String> = sizes
            .iter()
            .enumerate()
            .map(|(i, &len)| {
                let path = dir.join(format!("{i}.png"));
                std::fs::File::create(&path).unwrap().set_len(len).unwrap();
                path.to_string_lossy().into_owned()
            })
            .collect();
        let media: Vec<MediaItem<'_>> = paths
            .iter()
            .map(|p| MediaItem::image(MediaInput::Source(p)))
            .collect();
        let mut options = DriverOptions::default();
        options.fetch.allowed_local_roots = vec![dir.clone()];
        let result = run(
            family().as_ref(),
            &prompt(media.len()),
            &media,
            &options,
            Mode::CountOnly,
        );
        std::fs::remove_dir_all(&dir).unwrap();
        let err = result.unwrap_err();
        assert_eq!(err.code(), "request.too_many_bytes");
        assert!(err.to_string().contains("item 4"), "{err}");
    }

    #[test]
    fn a_planned_item_expands_like_the_image_it_stands_for() {
        let image = png(90, 40);
        let full = run_bytes(&prompt(2), &[&image, &image], Mode::Full).unwrap();
        let grid_thw = full.items[1].geometry.grid_thw();
        let media = [
            MediaItem::image(MediaInput::Bytes(&image)),
            MediaItem::image(MediaInput::Planned { hash: 7, grid_thw }),
        ];
        let out = run(
            family().as_ref(),
            &prompt(2),
            &media,
            &DriverOptions::default(),
            Mode::Full,
        )
        .unwrap();
        assert_eq!(out.input_ids, full.input_ids);
        assert_eq!(out.offsets, full.offsets);
        assert_eq!(out.positions, full.positions);
        assert_eq!(
            (out.items[1].hash, out.items[1].num_tokens),
            (7, full.items[1].num_tokens)
        );
        assert!(out.items[1].processed.is_none());

        let bad = [MediaItem::image(MediaInput::Planned {
            hash: 7,
            grid_thw: [1, 3, 4],
        })];
        let err = run(
            family().as_ref(),
            &prompt(1),
            &bad,
            &DriverOptions::default(),
            Mode::CountOnly,
        )
        .unwrap_err();
        assert_eq!((err.code(), err.item_index()), ("process.grid", Some(0)));
    }

    #[test]
    fn a_video_for_a_family_without_video_is_refused_before_any_fetch() {
        let config = r#"{"model_type": "gemma3", "mm_tokens_per_image": 256,
            "vision_config": {"image_size": 896, "patch_size": 14}}"#;
        let pp = r#"{"size": {"height": 896, "width": 896}, "resample": 2}"#;
        let family = family_from_spec(&spec_from_hf_configs(pp, config).unwrap()).unwrap();
        // The source would be refused by the fetch policy: the family check comes first.
        let media = [MediaItem::video(MediaInput::Source("/nowhere/v.mp4"))];
        let err = run(
            family.as_ref(),
            &[START, 151656, END],
            &media,
            &DriverOptions::default(),
            Mode::CountOnly,
        )
        .unwrap_err();
        assert_eq!(err.code(), "process.video_unsupported");
    }

    #[test]
    fn a_qwen3_video_becomes_one_item_per_temporal_group_after_its_text() {
        let config = r#"{"model_type": "qwen3_vl", "image_token_id": 151655,
            "video_token_id": 151656, "vision_start_token_id": 151652,
            "vision_end_token_id": 151653}"#;
        let family = family_from_spec(&spec_from_hf_configs("{}", config).unwrap()).unwrap();
        const VID: TokenId = 151656;
        let geometry = family.video_geometry([2, 4, 6], (96, 64), 2.0).unwrap();
        let video = Prepared {
            item: ItemOutput {
                hash: 7,
                width: 100,
                height: 60,
                geometry,
                num_tokens: family.num_tokens(&geometry),
                processed: None,
                source: 0,
                temporal_group: None,
                crop: None,
            },
            timestamps: vec!["<0.2 seconds>".into(), "<1.0 seconds>".into()],
            crops: Vec::new(),
            sampled_fps: Some(2.0),
        };
        let update = video.prompt_update(family.as_ref()).unwrap();
        let ids = [1, START, VID, END, 2];
        let items = [(Modality::Video, update.clone())];
        let mut prompt = Prompt {
            ids: &ids,
            ..Prompt::default()
        };
        let err = apply(&prompt, &family.placeholders(), &items).unwrap_err();
        assert_eq!(err.code(), "process.prompt_text");

        let mut pieces: Vec<(String, Vec<TokenId>)> =
            (0..10).map(|d| (d.to_string(), vec![15 + d])).collect();
        pieces.extend([("<".into(), vec![27]), (".".into(), vec![13])]);
        pieces.push((" seconds>".into(), vec![6486, 29]));
        let pieces = TextPieces::new(pieces);
        prompt.pieces = Some(&pieces);
        let out = apply(&prompt, &family.placeholders(), &items).unwrap();
        let text = |digits: [TokenId; 2]| [27, digits[0], 13, digits[1], 6486, 29];
        let mut expected = vec![1, START];
        for digits in [[15, 17], [16, 15]] {
            expected.extend(text(digits));
            expected.push(START);
            expected.extend([VID; 6]);
            expected.push(END);
        }
        expected.extend([END, 2]);
        assert_eq!(out.ids, expected);
        // Each group's pads follow its text.
        assert_eq!(out.offsets, vec![(9, 15), (23, 29)]);
        let groups: Vec<_> = video
            .planned_items(&update)
            .unwrap()
            .iter()
            .map(|i| {
                (
                    i.hash,
                    i.geometry.grid_thw(),
                    i.num_tokens,
                    i.source,
                    i.temporal_group,
                )
            })
            .collect();
        assert_eq!(
            groups,
            [0, 1].map(|g| (identity::video_group(7, g), [1, 4, 6], 6, 0, Some(g)))
        );
    }

    #[test]
    fn a_panned_image_is_followed_by_its_crops_each_an_item() {
        use crate::family::gemma3::{BETWEEN_CROPS, CROPS_INTRO};
        use crate::image::pan_and_scan::PanAndScan;
        const BOI: TokenId = 255_999;
        let config = r#"{"model_type": "gemma3", "mm_tokens_per_image": 4,
            "vision_config": {"image_size": 28, "patch_size": 7}}"#;
        let pp = r#"{"do_pan_and_scan": true, "pan_and_scan_min_crop_size": 8}"#;
        let family = family_from_spec(&spec_from_hf_configs(pp, config).unwrap()).unwrap();
        // 60x20: three 20x20 crops; 20x20: none.
        let (wide, square) = (png(60, 20), png(20, 20));
        let media = [
            MediaItem::image(MediaInput::Bytes(&wide)),
            MediaItem::image(MediaInput::Bytes(&square)),
        ];
        let pieces = vec![
            (CROPS_INTRO.to_string(), vec![108, 40, 108]),
            (BETWEEN_CROPS.to_string(), vec![108, 41, 108]),
        ];
        let options = DriverOptions {
            text_pieces: Some(TextPieces::new(pieces)),
            panned_input_ids: Some(vec![1, 11, BOI, 2, 21, BOI, 3]),
            ..DriverOptions::default()
        };
        let ids = [1, BOI, 2, BOI, 3];
        let full = run(family.as_ref(), &ids, &media, &options, Mode::Full).unwrap();
        let cheap = run(family.as_ref(), &ids, &media, &options, Mode::CountOnly).unwrap();
        assert_eq!(
            (&full.input_ids, &full.offsets),
            (&cheap.input_ids, &cheap.offsets)
        );
        let image = identity::content(&wide);
        let knobs = PanAndScan::new(8, 4, 1.2).unwrap();
        let items: Vec<_> = full
            .items
            .iter()
            .map(|i| (i.hash, i.source, i.crop, (i.width, i.height)))
            .collect();
        assert_eq!(
            items,
            [
                (image, 0, None, (60, 20)),
                (identity::crop(image, 1, &knobs), 0, Some(1), (20, 20)),
                (identity::crop(image, 2, &knobs), 0, Some(2), (20, 20)),
                (identity::crop(image, 3, &knobs), 0, Some(3), (20, 20)),
                (identity::content(&square), 1, None, (20, 20)),
            ]
        );
        assert!(full.items.iter().all(|i| i.processed.is_some()));
        let image_tokens = |after: &[TokenId]| {
            let mut run = vec![BOI];
            run.extend([262_144; 4]);
            run.push(256_000);
            run.extend_from_slice(after);
            run
        };
        let mut expected = vec![1, 11];
        expected.extend(image_tokens(&[108, 40, 108]));
        expected.extend(image_tokens(&[108, 41, 108]));
        expected.extend(image_tokens(&[108, 41, 108]));
        expected.extend(image_tokens(&[2]));
        expected.extend(image_tokens(&[3]));
        assert_eq!(full.input_ids, expected);
        // Without the panned prompt the plan cannot be written.
        let bare = DriverOptions {
            panned_input_ids: None,
            ..options
        };
        let err = run(family.as_ref(), &ids, &media, &bare, Mode::CountOnly).unwrap_err();
        assert_eq!(err.code(), "process.prompt_text");
    }

    #[test]
    fn the_failing_item_is_named() {
        let good = png(20, 20);
        let err = run_bytes(&prompt(3), &[&good, &good, b"junk"], Mode::Full).unwrap_err();
        assert_eq!(err.item_index(), Some(2));
        assert_eq!(err.code(), "decode.unknown_format");
        assert!(err.to_string().starts_with("item 2: "));
        let err = run_bytes(&prompt(2), &[&good], Mode::Full).unwrap_err();
        assert_eq!(
            (err.code(), err.item_index()),
            ("process.placeholder_count", None)
        );
    }
}
