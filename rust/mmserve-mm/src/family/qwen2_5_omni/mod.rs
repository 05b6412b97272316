//! Qwen2.5-Omni's thinker: images and videos as Qwen2.5-VL takes them, clips as Qwen2-Audio
//! takes them (the `<|AUDIO|>` the chat template writes between `<|audio_bos|>` and
//! `<|audio_eos|>` becomes one token per row of the audio tower), all in one prompt under
//! TMRoPE: text and audio advance the three position rows together, an image or video fills
//! a block whose temporal row counts `position_id_per_seconds` per second of video, and what
//! follows a block resumes after its largest position. Mirrors transformers'
//! `Qwen2_5OmniProcessor` and the thinker's `get_rope_index`. A video served with its own
//! audio track (`use_audio_in_video`) is one item whose span alternates the frames' tokens
//! and the track's every `seconds_per_chunk` seconds of positions, between `<|audio_bos|>`
//! and `<|audio_eos|>` inside the vision bos and eos ([`interleave`]).

pub(crate) mod config;

use std::sync::Arc;

use crate::family::config::{ConfigFiles, FamilyFacts};
use crate::family::qwen2_audio::clip_update;
use crate::family::qwen_vl::{with_delta, QwenVl};
use crate::family::registry::{FamilyModule, FamilyName};
use crate::family::spec::{AudioSpec, Spec, SpecError};
use crate::pipeline::{
    Capabilities, DecodedImage, Embed, EmbedOf, Family, Geometry, ItemPrompt, Modality,
    Placeholder, Positions, ProcessError, ProcessedItem, PromptUpdate, TokenId, UpdatePart,
};
use crate::video::VideoFamily;

/// Qwen2.5-Omni as the registry sees it.
#[derive(Debug, Clone, Copy)]
pub struct Qwen25OmniModule;

/// The registry's module of `qwen2_5_omni`.
pub const QWEN2_5_OMNI: Qwen25OmniModule = Qwen25OmniModule;

impl FamilyModule for Qwen25OmniModule {
    fn read(
        &self,
        name: FamilyName,
        files: &ConfigFiles,
    ) -> Result<(Spec, FamilyFacts), SpecError> {
        config::read(name, files)
    }

    fn build(&self, spec: Spec) -> Result<Arc<dyn Family>, SpecError> {
        Ok(Arc::new(OmniThinker::new(spec)?))
    }

    fn modalities(&self) -> &'static [Modality] {
        &[Modality::Image, Modality::Video, Modality::Audio]
    }

    fn video_processor(&self) -> Option<VideoFamily> {
        Some(VideoFamily::Qwen2Vl)
    }

    /// Its processor's `videos_kwargs`: 128 to 768 merged patches of 28 pixels a frame.
    fn video_pixel_bounds(&self) -> Option<(u64, u64)> {
        Some((128 * 28 * 28, 768 * 28 * 28))
    }
}

/// An Omni thinker configured by its spec (which has an `audio` part and, as
/// `tokens_per_second`, the thinker's `position_id_per_seconds`): Qwen2.5-Omni's, and
/// Qwen3-Omni's ([`crate::family::qwen3_omni_moe`]), whose spec counts a clip's tokens by its
/// own rule, pads clips to their own length and serves no track in a video.
#[derive(Debug, Clone)]
pub struct OmniThinker {
    vision: QwenVl,
    audio: AudioSpec,
    position_id_per_seconds: f32,
}

impl OmniThinker {
    pub fn new(spec: Spec) -> Result<Self, SpecError> {
        let audio = spec.audio.ok_or(SpecError::Missing("audio"))?;
        let position_id_per_seconds =
            spec.tokens_per_second
                .ok_or(SpecError::Missing("position_id_per_seconds"))? as f32;
        Ok(Self {
            vision: QwenVl::new(spec)?,
            audio,
            position_id_per_seconds,
        })
    }
}

impl Family for OmniThinker {
    fn spec(&self) -> &Spec {
        self.vision.spec()
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            audio: Some(self.audio.log_mel()),
            ..self.vision.capabilities()
        }
    }

    fn plan(&self, width: u32, height: u32) -> Result<Geometry, ProcessError> {
        self.vision.plan(width, height)
    }

    fn num_tokens(&self, geometry: &Geometry) -> usize {
        match geometry {
            Geometry::Audio { frames, .. } => self.audio.tokens(*frames),
            Geometry::Video {
                track: Some(frames),
                ..
            } => self.vision.num_tokens(geometry) + self.audio.tokens(*frames),
            _ => self.vision.num_tokens(geometry),
        }
    }

    fn geometry_from_grid(&self, grid_thw: [u32; 3]) -> Result<Geometry, ProcessError> {
        self.vision.geometry_from_grid(grid_thw)
    }

    /// A video's temporal patches sit `second_per_grid = temporal_patch_size / sampled_fps`
    /// seconds apart (float32, as the processor's `video_second_per_grid`); the positions
    /// scale that by `position_id_per_seconds` in torch's order.
    fn video_geometry(
        &self,
        grid_thw: [u32; 3],
        (resized_width, resized_height): (u32, u32),
        sampled_fps: f64,
    ) -> Result<Geometry, ProcessError> {
        let time_interval = (f64::from(self.spec().temporal_patch_size) / sampled_fps) as f32;
        if !(time_interval.is_finite() && time_interval >= 0.0) {
            return Err(ProcessError::Grid {
                grid_thw,
                reason: format!("a video sampled at {sampled_fps} fps has no temporal spacing"),
            });
        }
        Ok(Geometry::Video {
            resized_width,
            resized_height,
            grid_thw,
            time_interval,
            track: None,
        })
    }

    fn process_item(&self, image: &DecodedImage) -> Result<ProcessedItem, crate::Error> {
        self.vision.process_item(image)
    }

    /// The image and video pads inside the vision bos and eos; `<|AUDIO|>`.
    fn placeholders(&self) -> Vec<Placeholder> {
        let mut placeholders = self.vision.placeholders();
        placeholders.push(Placeholder {
            id: self.audio.audio_token_id,
            modality: Modality::Audio,
            between: None,
        });
        placeholders
    }

    fn prompt_update(&self, item: &ItemPrompt<'_>) -> Result<PromptUpdate, ProcessError> {
        match item.geometry {
            Geometry::Audio { frames, .. } => Ok(clip_update(&self.audio, item.geometry, frames)),
            Geometry::Video {
                track: Some(frames),
                grid_thw,
                ..
            } => self.video_with_track(item, grid_thw, frames),
            _ => self.vision.prompt_update(item),
        }
    }

    fn positions(
        &self,
        len: usize,
        offsets: &[(usize, usize)],
        geometries: &[Geometry],
    ) -> Result<Positions, ProcessError> {
        tmrope(
            len,
            offsets,
            geometries,
            self.spec().merge_size,
            self.position_id_per_seconds,
            &self.audio,
            self.tokens_per_chunk(),
        )
    }
}

impl OmniThinker {
    /// The interleaving's chunk in positions: `int(position_id_per_seconds *
    /// seconds_per_chunk)`, as both the processor and `get_rope_index` take it.
    fn tokens_per_chunk(&self) -> i64 {
        let seconds = self.audio.in_video.map_or(0.0, |v| v.seconds_per_chunk);
        (f64::from(self.position_id_per_seconds) * seconds) as i64
    }

    /// `Qwen2_5OmniProcessor.replace_video_with_audio_token`: the video's placeholder becomes
    /// `<|audio_bos|>`, the frames' and the track's tokens chunk by chunk, `<|audio_eos|>`.
    /// The frames are chunked by their temporal patches' times in float64 (`t *
    /// second_per_grid * position_id_per_seconds`, the processor's arithmetic), the track's
    /// tokens by their index.
    fn video_with_track(
        &self,
        item: &ItemPrompt<'_>,
        [t, h, w]: [u32; 3],
        frames: u32,
    ) -> Result<PromptUpdate, ProcessError> {
        let spec = self.spec();
        let (Some(in_video), Some(video_token), Some(sampled_fps)) =
            (self.audio.in_video, spec.video_token_id, item.sampled_fps)
        else {
            return Err(ProcessError::VideoUnsupported);
        };
        let merge = spec.merge_size.max(1);
        let per_patch = ((h / merge) * (w / merge)) as usize;
        let second_per_grid = f64::from(spec.temporal_patch_size) / sampled_fps;
        let pips = f64::from(self.position_id_per_seconds);
        let video: Vec<f64> = (0..t)
            .flat_map(|ti| std::iter::repeat_n(f64::from(ti) * second_per_grid * pips, per_patch))
            .collect();
        let audio: Vec<f64> = (0..self.audio.tokens(frames)).map(|k| k as f64).collect();
        let chunk = self.tokens_per_chunk() as f64;
        let runs = interleave(
            (video_token, &chunked(&video, chunk)),
            (self.audio.audio_token_id, &chunked(&audio, chunk)),
        );
        Ok(PromptUpdate {
            parts: vec![
                UpdatePart::Ids(vec![in_video.audio_start_token_id]),
                UpdatePart::Embed(Embed {
                    id: video_token,
                    n: video.len() + audio.len(),
                    runs,
                    geometry: item.geometry,
                    of: EmbedOf::Whole,
                }),
                UpdatePart::Ids(vec![in_video.audio_end_token_id]),
            ],
            announced: false,
        })
    }
}

/// transformers' `get_chunked_index`: the `(start, end)` runs of monotone `values` that cross
/// one more multiple of `chunk` each (a value past several multiples still opens one run).
fn chunked(values: &[f64], chunk: f64) -> Vec<(usize, usize)> {
    let mut runs = Vec::new();
    let (mut start, mut current) = (0usize, 1.0f64);
    for (i, &value) in values.iter().enumerate() {
        if value >= current * chunk {
            runs.push((start, i));
            start = i;
            current += 1.0;
        }
    }
    runs.push((start, values.len()));
    runs
}

/// The frames' runs and the track's, alternating chunk by chunk (frames first), as
/// `(placeholder, tokens)`.
fn interleave(
    (video_token, video): (TokenId, &[(usize, usize)]),
    (audio_token, audio): (TokenId, &[(usize, usize)]),
) -> Vec<(TokenId, usize)> {
    let mut runs = Vec::new();
    for j in 0..video.len().max(audio.len()) {
        if let Some(&(a, b)) = video.get(j) {
            runs.push((video_token, b - a));
        }
        if let Some(&(a, b)) = audio.get(j) {
            runs.push((audio_token, b - a));
        }
    }
    runs
}

/// The thinker's `get_rope_index`: every run of text or audio counts on from the largest
/// position before it, all three rows alike; an image or video of LLM grid `(t, h, w)` fills a
/// block from the next position `base`, temporal patch `ti` at `base + trunc(ti *
/// second_per_grid * position_id_per_seconds)` (float32, in that order; an image's one patch
/// at `base`), and what follows resumes after the block's largest position. A video with its
/// audio track ([`Geometry::Video::track`]) takes its two bos tokens at one position, its
/// frames and its track both from the next (the track's tokens counting on by one), laid out
/// chunk by chunk as `get_rope_index` chunks them (`tokens_per_chunk` positions), and its two
/// eos tokens one past the largest position of the last chunk laid (`audio` counts the
/// track's tokens).
pub fn tmrope(
    len: usize,
    offsets: &[(usize, usize)],
    geometries: &[Geometry],
    merge: u32,
    position_id_per_seconds: f32,
    audio: &AudioSpec,
    tokens_per_chunk: i64,
) -> Result<Positions, ProcessError> {
    if offsets.len() != geometries.len() {
        return Err(ProcessError::Offsets(format!(
            "{} offsets for {} items",
            offsets.len(),
            geometries.len()
        )));
    }
    if merge == 0 {
        return Err(ProcessError::Offsets("merge size 0".into()));
    }
    let mut rows = Rows {
        positions: vec![0i64; 3 * len],
        len,
    };
    let mut next: i64 = 0;
    let mut cursor = 0usize;
    for (item, (&(start, end), geometry)) in offsets.iter().zip(geometries).enumerate() {
        let out_of_place = || {
            ProcessError::Offsets(format!(
                "item {item} at {start}..{end} does not follow token {cursor} in a prompt of \
                 {len} tokens"
            ))
        };
        if start < cursor || end < start || end > len {
            return Err(out_of_place());
        }
        let track = match *geometry {
            Geometry::Video {
                track: Some(frames),
                ..
            } => Some(audio.tokens(frames)),
            _ => None,
        };
        // The text before the item; a video with its track shares one position between its
        // two bos tokens.
        let bos = if track.is_some() { 2 } else { 0 };
        if start < cursor + bos || end + bos > len {
            return Err(out_of_place());
        }
        for i in cursor..start - bos {
            rows.put(i, [next; 3]);
            next += 1;
        }
        if bos > 0 {
            rows.put(start - 2, [next; 3]);
            rows.put(start - 1, [next; 3]);
            next += 1;
        }
        match *geometry {
            Geometry::Audio { .. } => {
                for i in start..end {
                    rows.put(i, [next; 3]);
                    next += 1;
                }
                cursor = end;
            }
            Geometry::Image { grid_thw, .. } | Geometry::Video { grid_thw, .. } => {
                let [t, h, w] =
                    [grid_thw[0], grid_thw[1] / merge, grid_thw[2] / merge].map(|v| v as usize);
                let frames = t.checked_mul(h).and_then(|th| th.checked_mul(w));
                if frames.map(|f| f + track.unwrap_or(0)) != Some(end - start) {
                    return Err(ProcessError::Offsets(format!(
                        "item {item} at {start}..{end} does not fit a {t}x{h}x{w} block{}",
                        track.map_or(String::new(), |n| format!(" and {n} audio tokens"))
                    )));
                }
                let temporal = |ti: usize| -> i64 {
                    match *geometry {
                        Geometry::Video { time_interval, .. } => {
                            (ti as f32 * time_interval * position_id_per_seconds) as i64
                        }
                        // An image's temporal patches (its one) count whole seconds.
                        _ => ti as i64 * position_id_per_seconds as i64,
                    }
                };
                let base = next;
                let block: Vec<[i64; 3]> = (0..t)
                    .flat_map(|ti| {
                        let row_t = base + temporal(ti);
                        (0..h).flat_map(move |hi| {
                            (0..w).map(move |wi| [row_t, base + hi as i64, base + wi as i64])
                        })
                    })
                    .collect();
                let laid = match track {
                    None => block,
                    Some(n) => {
                        let audio: Vec<[i64; 3]> = (0..n as i64).map(|k| [base + k; 3]).collect();
                        let chunk = tokens_per_chunk as f64;
                        let offsets_of = |rows: &[[i64; 3]]| -> Vec<f64> {
                            rows.iter().map(|r| (r[0] - base) as f64).collect()
                        };
                        let video_runs = chunked(&offsets_of(&block), chunk);
                        let audio_runs = chunked(&offsets_of(&audio), chunk);
                        let mut laid = Vec::with_capacity(block.len() + audio.len());
                        let mut last = &[][..];
                        for j in 0..video_runs.len().max(audio_runs.len()) {
                            for (runs, source) in [(&video_runs, &block), (&audio_runs, &audio)] {
                                if let Some(&(a, b)) = runs.get(j) {
                                    laid.extend_from_slice(&source[a..b]);
                                    last = &source[a..b];
                                }
                            }
                        }
                        // The eos tokens sit past the last chunk laid, not the block.
                        let after = last.iter().flatten().copied().max().unwrap_or(base - 1) + 1;
                        laid.push([after; 3]);
                        laid.push([after; 3]);
                        laid
                    }
                };
                let mut largest = base;
                for (i, row) in (start..).zip(&laid) {
                    largest = largest.max(row[0]).max(row[1]).max(row[2]);
                    rows.put(i, *row);
                }
                // After a track's eos tokens, the text counts on from them.
                next = match (track, laid.last()) {
                    (Some(_), Some(eos)) => eos[0] + 1,
                    _ => largest + 1,
                };
                cursor = end + bos;
            }
        }
    }
    for i in cursor..len {
        rows.put(i, [next; 3]);
        next += 1;
    }
    Ok(with_delta(rows.positions, len))
}

/// The three position rows of a prompt of `len` tokens, flattened row by row.
struct Rows {
    positions: Vec<i64>,
    len: usize,
}

impl Rows {
    fn put(&mut self, i: usize, [t, h, w]: [i64; 3]) {
        self.positions[i] = t;
        self.positions[self.len + i] = h;
        self.positions[2 * self.len + i] = w;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::family::registry::spec_from_hf_configs;

    fn omni() -> OmniThinker {
        let spec = spec_from_hf_configs(config::tests::PREPROCESSOR, config::tests::CONFIG);
        OmniThinker::new(spec.unwrap()).unwrap()
    }

    fn rows(p: Positions) -> (Vec<i64>, i64) {
        match p {
            Positions::MRope { positions, delta } => (positions, delta),
            Positions::Rope1D { .. } => panic!("expected mrope"),
        }
    }

    #[test]
    fn the_thinker_takes_every_modality() {
        let family = omni();
        let caps = family.capabilities();
        assert!(caps.images && caps.video && caps.audio.is_some());
        assert!(!caps.video_timestamps);
        let modalities: Vec<Modality> = family.placeholders().iter().map(|p| p.modality).collect();
        assert_eq!(
            modalities,
            [Modality::Image, Modality::Video, Modality::Audio]
        );
        let clip = Geometry::Audio { frames: 300 };
        assert_eq!(family.num_tokens(&clip), 75);
        assert_eq!(family.num_tokens(&family.plan(56, 56).unwrap()), 4);
    }

    #[test]
    fn audio_counts_on_like_text_and_a_video_resumes_after_its_largest_position() {
        let family = omni();
        let clip = Geometry::Audio { frames: 20 }; // 5 tokens
        let image = family.plan(56, 56).unwrap(); // a 2x2 block
                                                  // Text, clip, text, image, text.
        let (p, delta) = rows(
            family
                .positions(11, &[(1, 6), (7, 11)], &[clip, image])
                .unwrap(),
        );
        assert_eq!(p[..11], [0, 1, 2, 3, 4, 5, 6, 7, 7, 7, 7]);
        assert_eq!(p[11..22], [0, 1, 2, 3, 4, 5, 6, 7, 7, 8, 8]);
        assert_eq!(p[22..], [0, 1, 2, 3, 4, 5, 6, 7, 8, 7, 8]);
        assert_eq!(delta, 8 + 1 - 11);
        // A video of 3 temporal patches one second apart: 0, 25, 50, then text at 51.
        let video = family.video_geometry([3, 2, 2], (28, 28), 2.0).unwrap();
        let (p, delta) = rows(family.positions(5, &[(0, 3)], &[video]).unwrap());
        assert_eq!(p[..5], [0, 25, 50, 51, 52]);
        assert_eq!(delta, 52 + 1 - 5);
        let err = family.positions(5, &[(0, 4)], &[video]).unwrap_err();
        assert_eq!(err.code(), "process.offsets");
    }

    #[test]
    fn a_videos_track_alternates_with_its_frames_every_chunk() {
        let family = omni();
        let spec = family.audio.in_video.unwrap();
        // Three temporal patches one second apart (0, 25, 50) of one token each, and a track
        // of 60 tokens: frames 0 and 25, audio 0..50, frame 50, audio 50..60.
        let video = family.video_geometry([3, 2, 2], (28, 28), 2.0).unwrap();
        let Geometry::Video {
            resized_width,
            resized_height,
            grid_thw,
            time_interval,
            ..
        } = video
        else {
            unreachable!()
        };
        let tracked = Geometry::Video {
            resized_width,
            resized_height,
            grid_thw,
            time_interval,
            track: Some(240),
        };
        assert_eq!(family.num_tokens(&tracked), 63);
        let update = family
            .prompt_update(&ItemPrompt {
                geometry: tracked,
                crops: &[],
                timestamps: &[],
                sampled_fps: Some(2.0),
            })
            .unwrap();
        let UpdatePart::Embed(embed) = &update.parts[1] else {
            panic!("expected the span")
        };
        let (v, a) = (151_656, 151_646);
        assert_eq!(embed.runs, [(v, 2), (a, 50), (v, 1), (a, 10)]);
        assert_eq!(
            update.parts[0],
            UpdatePart::Ids(vec![spec.audio_start_token_id])
        );
        // Text, vision bos, audio bos, the span, audio eos, vision eos, text.
        let len = 1 + 2 + 63 + 2 + 1;
        let (p, delta) = rows(family.positions(len, &[(3, 66)], &[tracked]).unwrap());
        let t = &p[..len];
        assert_eq!(t[..5], [0, 1, 1, 2, 27]);
        assert_eq!(t[5..55], (2..52).collect::<Vec<i64>>()[..]);
        assert_eq!(t[55], 52);
        assert_eq!(t[56..66], (52..62).collect::<Vec<i64>>()[..]);
        // Both eos past the last chunk laid (audio, up to 61), then the text.
        assert_eq!(t[66..], [62, 62, 63]);
        assert_eq!(delta, 63 + 1 - len as i64);
    }
}
