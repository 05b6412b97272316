//! The request driver: the fixed per-request steps and their failure semantics.
//!
//! Per item: fetch (inline, in order) -> content hash of the raw bytes -> decode ->
//! `process_item` (fanned out through `common::par`); then the family's layout ->
//! expanded ids + per-item offsets -> positions. Any failure rejects the whole request;
//! an item's failure carries its index.

use std::borrow::Cow;

use thiserror::Error;

use crate::common::hash::content_hash;
use crate::common::par;
use crate::family::token_layout::expand;
use crate::image::decode::{decode_image, probe_image, DecodeLimits};
use crate::pipeline::{Family, Geometry, Positions, ProcessedItem, TokenId};
use crate::source::fetch::{fetch_bytes, FetchError, FetchPolicy};
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
    pub fn code(&self) -> &'static str {
        match self {
            RequestError::TooManyItems { .. } => "request.too_many_items",
            RequestError::TooManyBytes { .. } => "request.too_many_bytes",
        }
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
}

/// What the driver produced for one item.
#[derive(Debug, Clone, PartialEq)]
pub struct ItemOutput {
    /// blake3 of the raw encoded bytes, truncated to u64.
    pub hash: u64,
    /// Size of the decoded image (after EXIF orientation).
    pub width: u32,
    pub height: u32,
    pub geometry: Geometry,
    pub num_tokens: usize,
    /// `None` in [`Mode::CountOnly`] and for a planned item.
    pub processed: Option<ProcessedItem>,
}

/// The whole request, ready for the model.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestOutput {
    pub input_ids: Vec<TokenId>,
    /// `offsets[i] = (start, end)` of item `i` in `input_ids`.
    pub offsets: Vec<(usize, usize)>,
    pub items: Vec<ItemOutput>,
    pub positions: Positions,
}

/// Runs one request: `input_ids` has one placeholder per item, in item order.
pub fn run(
    family: &dyn Family,
    input_ids: &[TokenId],
    media: &[MediaInput<'_>],
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
    let fetched = fetch_all(media, &options.fetch)?;
    let items = par::try_map(&fetched, |item| prepare_item(family, item, options, mode))
        .map_err(|(index, e)| e.at_item(index))?;

    let geometries: Vec<Geometry> = items.iter().map(|item| item.geometry).collect();
    let layout = family.layout(input_ids, &geometries)?;
    let expanded = expand(&layout, input_ids, items.len())?;
    let positions = family.positions(expanded.ids.len(), &expanded.offsets, &geometries)?;
    Ok(RequestOutput {
        input_ids: expanded.ids,
        offsets: expanded.offsets,
        items,
        positions,
    })
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

fn prepare_item(
    family: &dyn Family,
    item: &Fetched<'_>,
    options: &DriverOptions,
    mode: Mode,
) -> Result<ItemOutput, Error> {
    let bytes = match item {
        Fetched::Bytes(bytes) => bytes,
        Fetched::Planned { hash, grid_thw } => {
            let geometry = family.geometry_from_grid(*grid_thw)?;
            let Geometry::Image {
                resized_width,
                resized_height,
                ..
            } = geometry;
            return Ok(ItemOutput {
                hash: *hash,
                width: resized_width,
                height: resized_height,
                geometry,
                num_tokens: family.num_tokens(&geometry),
                processed: None,
            });
        }
    };
    let hash = content_hash(bytes);
    let (width, height, geometry, processed) = match mode {
        Mode::CountOnly => {
            let info = probe_image(bytes, &options.decode)?;
            let geometry = family.plan(info.width, info.height)?;
            (info.width, info.height, geometry, None)
        }
        Mode::Full => {
            let image = decode_image(bytes, &options.decode)?;
            let item = family.process_item(&image)?;
            (image.width, image.height, item.geometry, Some(item))
        }
    };
    Ok(ItemOutput {
        hash,
        width,
        height,
        geometry,
        num_tokens: family.num_tokens(&geometry),
        processed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::registry::{family_from_spec, spec_from_hf_configs};

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
        let media: Vec<MediaInput<'_>> = items.iter().map(|b| MediaInput::Bytes(b)).collect();
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
        let media: Vec<MediaInput<'_>> = paths.iter().map(|p| MediaInput::Source(p)).collect();
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
            MediaInput::Bytes(&image),
            MediaInput::Planned { hash: 7, grid_thw },
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

        let bad = [MediaInput::Planned {
            hash: 7,
            grid_thw: [1, 3, 4],
        }];
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
    fn the_failing_item_is_named() {
        let good = png(20, 20);
        let err = run_bytes(&prompt(3), &[&good, &good, b"junk"], Mode::Full).unwrap_err();
        assert_eq!(err.item_index(), Some(2));
        assert_eq!(err.code(), "decode.unknown_format");
        assert!(err.to_string().starts_with("image 2: "));
        let err = run_bytes(&prompt(2), &[&good], Mode::Full).unwrap_err();
        assert_eq!(
            (err.code(), err.item_index()),
            ("process.placeholder_count", None)
        );
    }
}
