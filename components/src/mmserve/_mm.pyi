"""Typed stubs for the Rust extension `mmserve._mm` (hand-written; checked by stubtest)."""

from typing import Final, Literal, TypedDict, final

import numpy
from typing_extensions import NotRequired

__version__: str

class MediaError(ValueError):
    """A media item was refused or could not be processed.

    args = (code, message, item_index): a stable code such as ``process.aspect_ratio``, a
    message that says what to change, and the request item at fault (None for the request).
    """

def error_catalogue() -> dict[str, tuple[int, str]]:
    """Every code the core can raise: ``{code: (http_status, meaning)}``."""

# media
# The core's request limits: media items per request, encoded bytes per item and per request.
MAX_ITEMS_PER_REQUEST: Final[int]
MAX_BYTES_PER_ITEM: Final[int]
MAX_BYTES_PER_REQUEST: Final[int]

def decode_image(
    data: bytes, max_pixels: int | None = None
) -> numpy.ndarray[tuple[int, int, int], numpy.dtype[numpy.uint8]]:
    """Decode JPEG/PNG/WebP/GIF/BMP bytes to uint8 RGB [h, w, 3], EXIF orientation applied."""

def probe_image(data: bytes, max_pixels: int | None = None) -> tuple[int, int]:
    """(width, height) as decode_image returns them, read from the headers only: refuses what
    the headers show (format, size, pixel limit, bit depth), not a corrupt body."""

def content_hash(data: bytes) -> int:
    """blake3 of the raw bytes, first 8 digest bytes as a little-endian u64."""

def embeddings_identity(
    dtype: str,
    shape: list[int],
    grid_thw: tuple[int, int, int],
    data: numpy.ndarray[tuple[int], numpy.dtype[numpy.uint8]],
) -> int:
    """The identity of a precomputed image embedding: its raw values (`data`, contiguous
    row-major bytes) under its dtype (float32, float16 or bfloat16; ValueError for another),
    shape and grid."""

def fetch_bytes(
    source: str,
    *,
    allowed_local_roots: list[str] = ...,
    allowed_domains: list[str] = ...,
    timeout_s: float | None = None,
    max_bytes: int | None = None,
) -> bytes:
    """Bytes of a data: URL, http(s) URL, file:// URL, absolute path or bare base64."""

# resize
def resize(
    image: numpy.ndarray[tuple[int, int, int], numpy.dtype[numpy.uint8]],
    width: int,
    height: int,
    filter: str = "bicubic",
    backend: str = "pil",
) -> numpy.ndarray[tuple[int, int, int], numpy.dtype[numpy.uint8]]:
    """Resize uint8 RGB [h, w, 3] to [height, width, 3], bit-exact with PIL's Image.resize
    (backend "pil") or torchvision's uint8 antialiased resize (backend "torch").
    filter: "bicubic", "lanczos" or "bilinear"."""

def normalize_patchify(
    image: numpy.ndarray[tuple[int, int, int], numpy.dtype[numpy.uint8]],
    mean: tuple[float, float, float] | list[float],
    std: tuple[float, float, float] | list[float],
    rescale: float,
    patch_size: int,
    merge_size: int,
    temporal_patch_size: int,
    convention: str,
) -> numpy.ndarray[tuple[int, int], numpy.dtype[numpy.float32]]:
    """Rescale + normalize + patchify a resized uint8 RGB image into HF's pixel_values rows
    [grid_h * grid_w, 3 * temporal_patch_size * patch_size**2]; convention "pil" (numpy
    arithmetic) or "torchvision" (torch's fused float32 arithmetic)."""

class _VideoInfo(TypedDict):
    width: int
    height: int
    rotation: int
    total_frames: int
    fps: float
    duration_s: float
    codec: str
    container: str
    pixel_format: str

def sample_frame_indices(
    total_frames: int,
    video_fps: float,
    *,
    fps: float | None = None,
    num_frames: int | None = None,
    min_frames: int = 4,
    max_frames: int = 768,
    temporal_patch_size: int = 2,
    family: str = "qwen2_vl",
) -> list[int]:
    """The frame indices `family`'s video processor samples (`sample_frames` of transformers'
    Qwen2VLVideoProcessor for qwen2_vl / qwen2_5_vl, Qwen3VLVideoProcessor for qwen3_vl)."""

def video_timestamps(
    indices: list[int], video_fps: float, *, temporal_patch_size: int = 2
) -> list[tuple[float, str]]:
    """(seconds, text) of each temporal group of a video sampled at `indices`: the time
    Qwen3-VL's processor gives the group and the text it writes before the group's
    <|vision_start|> ("<{t:.1f} seconds>")."""

def preprocess_video(
    frames: numpy.ndarray[tuple[int, int, int, int], numpy.dtype[numpy.uint8]],
    *,
    min_pixels: int,
    max_pixels: int,
    mean: tuple[float, float, float] | list[float],
    std: tuple[float, float, float] | list[float],
    rescale: float = ...,
    patch_size: int = 14,
    merge_size: int = 2,
    temporal_patch_size: int = 2,
    cap_pixels_per_frame: bool = False,
    max_video_tokens: int = 128000,
    family: str = "qwen2_vl",
) -> tuple[numpy.ndarray[tuple[int, int], numpy.dtype[numpy.float32]], tuple[int, int, int]]:
    """Sampled RGB frames [n, h, w, 3] to (pixel_values_videos, (t, h, w)) as `family`'s video
    processor (torchvision backend) computes them; for qwen3_vl the pixel bounds and
    max_video_tokens (per frame) are Qwen3VLVideoProcessor's."""

# positions
def mrope_positions(
    length: int,
    blocks: list[tuple[int, int, tuple[int, int, int], float]],
    merge_size: int,
) -> tuple[numpy.ndarray[tuple[int, int], numpy.dtype[numpy.int64]], int]:
    """(positions [3, length], delta): M-RoPE for a prompt whose vision items (images and videos
    in prompt order) are (start, end, (t, h, w), time_interval); a Qwen3-VL video is one item
    per temporal group, at its pads, with grid (1, h, w) and interval 1 (as its
    get_rope_index splits it)."""

@final
class VideoOptions:
    """The options that decide a video's model inputs, as `family`'s video processor reads
    them (Qwen2VLVideoProcessor for qwen2_vl / qwen2_5_vl, Qwen3VLVideoProcessor for
    qwen3_vl; the family's class defaults where None); fps and num_frames as given (neither:
    every frame); the max_* limits are checked from the headers."""

    def __new__(
        cls,
        *,
        family: str = "qwen2_vl",
        fps: float | None = None,
        num_frames: int | None = None,
        min_frames: int = 4,
        max_frames: int = 768,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        cap_pixels_per_frame: bool = False,
        max_video_tokens: int | None = None,
        mean: tuple[float, float, float] | list[float] | None = None,
        std: tuple[float, float, float] | list[float] | None = None,
        rescale: float = ...,
        patch_size: int | None = None,
        merge_size: int = 2,
        temporal_patch_size: int = 2,
        max_duration_s: float | None = None,
        max_frames_decoded: int | None = None,
        max_pixels_per_frame: int | None = None,
        max_tokens: int | None = None,
    ) -> VideoOptions: ...
    @staticmethod
    def from_hf_config(
        json: str,
        *,
        family: str = "qwen2_vl",
        max_duration_s: float | None = None,
        max_frames_decoded: int | None = None,
        max_pixels_per_frame: int | None = None,
        max_tokens: int | None = None,
    ) -> VideoOptions:
        """The options a checkpoint's video_preprocessor_config.json (or, without one, its
        preprocessor_config.json) gives, as `family`'s transformers video processor reads them
        (Qwen3-VL's reads its pixel bounds from `size` alone, and samples at 2 fps unless the
        config says otherwise); a config naming the other family's processor is refused."""
    def with_sampling(
        self,
        *,
        fps: float | None,
        num_frames: int | None,
        min_frames: int,
        max_frames: int,
        min_pixels: int,
        max_pixels: int,
        use_audio_in_video: bool = False,
    ) -> VideoOptions:
        """These options with the sampling and per-frame pixel bounds replaced, and whether
        the video's own audio track is served with its frames (it enters the identity); the
        rest, the caps included, kept."""
    @property
    def use_audio_in_video(self) -> bool: ...
    @property
    def fps(self) -> float | None: ...
    @property
    def num_frames(self) -> int | None: ...
    @property
    def min_frames(self) -> int: ...
    @property
    def max_frames(self) -> int: ...
    @property
    def min_pixels(self) -> int: ...
    @property
    def max_pixels(self) -> int: ...
    @property
    def temporal_patch_size(self) -> int: ...

class _VideoPlan(TypedDict):
    info: _VideoInfo
    indices: list[int]
    grid_thw: tuple[int, int, int]
    resized_size: tuple[int, int]
    tokens: int
    mm_hash: int
    timestamps: list[float]
    """Seconds of each temporal group (Qwen3-VL's `_calculate_timestamps`)."""
    timestamp_texts: list[str]
    """The text before each group's <|vision_start|> ("<t seconds>"): Qwen3-VL's; empty for
    the Qwen2-VL families, which write none."""
    group_mm_hashes: list[int]
    """The identity of each temporal group, for the families that plan one item per group
    (Qwen3-VL's); empty for the others."""

def plan_video(data: bytes, options: VideoOptions, *, timeout_s: float | None = None) -> _VideoPlan:
    """The count-only plan of a video (info, sampled indices, grid, tokens, mm_hash) from its
    headers; no frame is decoded."""

def process_video(
    data: bytes, options: VideoOptions, *, timeout_s: float | None = None
) -> tuple[_VideoPlan, numpy.ndarray[tuple[int, int], numpy.dtype[numpy.float32]]]:
    """(plan, pixel_values_videos) of a video; decoding stops after the last sampled frame."""

def probe_video(
    data: bytes,
    *,
    max_duration_s: float | None = None,
    max_frames: int | None = None,
    max_pixels: int | None = None,
    timeout_s: float | None = None,
) -> _VideoInfo:
    """A video's frame count, rate, size and codec from its container's headers, without
    decoding a frame (built with the `video` feature)."""

def decode_video(
    data: bytes,
    indices: list[int],
    *,
    max_duration_s: float | None = None,
    max_frames: int | None = None,
    max_pixels: int | None = None,
    timeout_s: float | None = None,
) -> tuple[_VideoInfo, numpy.ndarray[tuple[int, int, int, int], numpy.dtype[numpy.uint8]]]:
    """(info, frames): the frames at `indices` (ascending, repeats allowed) as [n, h, w, 3]
    uint8 RGB (built with the `video` feature)."""

# audio
class _AudioInfo(TypedDict):
    container: str
    """libavformat's demuxer, e.g. "matroska,webm"."""
    codec: str
    sample_rate: int
    channels: int
    duration_s: float | None
    """The duration the headers state (None where they state none, or libavformat estimated it
    from the bitrate); it may count a codec's priming and padding samples."""
    sample_bounds: NotRequired[tuple[int, int] | None]
    """With probe_audio's sample_rate: the least and most samples the clip decodes to."""

class _DecodedAudioInfo(_AudioInfo):
    complete: bool
    """Whether the samples are the whole clip (not cut at max_samples)."""

@final
class AudioFeatureExtractor:
    """transformers' WhisperFeatureExtractor (the audio families' extractor) on one clip: its
    preprocessor_config.json parameters, and the processor's padding ("max_length" pads to
    the chunk, "longest" leaves a clip as long as it is) and truncation (cut to the chunk)."""

    def __new__(
        cls,
        *,
        feature_size: int = 80,
        sampling_rate: int = 16000,
        hop_length: int = 160,
        n_fft: int = 400,
        chunk_length: int = 30,
        padding_value: float = 0.0,
        padding: str = "max_length",
        truncation: bool = True,
    ) -> AudioFeatureExtractor: ...
    @property
    def sampling_rate(self) -> int: ...
    def identity(self, data: bytes) -> int:
        """The identity (mm_hash) of the clip whose encoded bytes are `data`, featurized by
        this extractor: what the request plan gives it."""
    @property
    def feature_size(self) -> int: ...
    @property
    def max_samples(self) -> int | None:
        """The samples a clip keeps (the chunk, when truncating), or None."""
    def frames(self, samples: int) -> tuple[int, int]:
        """(frames, valid_frames) of a clip of `samples` samples."""
    def mel_filters(self) -> numpy.ndarray[tuple[int, int], numpy.dtype[numpy.float64]]:
        """The filter bank [1 + n_fft // 2, feature_size], weights rounded to float32."""
    def __call__(
        self, samples: numpy.ndarray[tuple[int], numpy.dtype[numpy.float32]]
    ) -> tuple[numpy.ndarray[tuple[int, int], numpy.dtype[numpy.float32]], int]:
        """(input_features [feature_size, frames], valid_frames) of a mono clip at the
        extractor's rate."""

def probe_audio(
    data: bytes,
    *,
    format: str | None = None,
    sample_rate: int | None = None,
    max_samples: int | None = None,
    max_duration_s: float | None = None,
    timeout_s: float | None = None,
) -> _AudioInfo:
    """What an audio file's headers say, its caps checked, nothing decoded past what
    libavformat needs to name the format; `format` (wav, mp3, ...) refuses data of another
    (built with the `audio` feature). With `sample_rate`, `sample_bounds` is `(min, max)`:
    the samples it decodes to at that rate (cut at `max_samples`) as its headers bound them,
    or None where only decoding tells."""

def decode_audio(
    data: bytes,
    *,
    sample_rate: int,
    format: str | None = None,
    max_samples: int | None = None,
    max_duration_s: float | None = None,
    timeout_s: float | None = None,
) -> tuple[_DecodedAudioInfo, numpy.ndarray[tuple[int], numpy.dtype[numpy.float32]]]:
    """(info, samples): mono float32 at `sample_rate`, torchcodec's AudioDecoder(data,
    sample_rate=..., num_channels=1) sample for sample; cut at max_samples (built with the
    `audio` feature)."""

def audio_features(
    clips: list[bytes],
    extractor: AudioFeatureExtractor,
    *,
    formats: list[str | None] | None = None,
    max_duration_s: float | None = None,
    timeout_s: float | None = None,
) -> list[tuple[_AudioInfo, numpy.ndarray[tuple[int, int], numpy.dtype[numpy.float32]], int, int]]:
    """(info, input_features, valid_frames, samples) of each encoded clip: decoded at the
    extractor's rate (stopping at its chunk when it truncates) and featurized, the clips fanned
    out over the core's pool (built with the `audio` feature)."""

# spec and driver
@final
class Spec:
    """A resolved, validated model-family spec (immutable); see docs/preprocessing.md."""

    @staticmethod
    def from_json(json: str) -> Spec: ...
    @staticmethod
    def from_hf_configs(preprocessor_config: str, config: str) -> Spec: ...
    def to_json(self) -> str: ...
    def with_pixel_bounds(self, bounds: tuple[int, int] | None) -> Spec:
        """This spec resizing images within a request's (min_pixels, max_pixels) (None, or
        the model's own: as the model does); the images' identities fold the bounds."""
    def with_pan_and_scan(self, knobs: tuple[int, int, float] | None) -> Spec:
        """This spec cutting elongated images into pan-and-scan crops by (min_crop_size,
        max_num_crops, min_ratio_to_activate) (None: not cutting them), for a family that
        can pan and scan; each crop's identity folds the knobs."""
    @property
    def pixel_bounds(self) -> tuple[int, int] | None:
        """The (min_pixels, max_pixels) a request set (None: the model's own)."""
    @property
    def family(self) -> str:
        """The family name, which is also its model_type."""
    @property
    def takes_video(self) -> bool:
        """Whether the request driver plans this family's videos."""
    @property
    def audio_extractor(self) -> AudioFeatureExtractor | None:
        """The feature extractor of a family that takes audio; None for one that takes none."""
    def audio_tokens(self, frames: int) -> int:
        """The tokens a clip of `frames` valid feature frames expands to (0 for a family that
        takes no audio)."""
    @property
    def audio_token_id(self) -> int | None:
        """The audio placeholder the chat template writes once per clip (`<|AUDIO|>`)."""
    @property
    def audio_in_video(self) -> bool:
        """Whether the family serves a video's own audio track interleaved with its frames
        (`use_audio_in_video`: Qwen2.5-Omni)."""
    @property
    def video_per_group(self) -> bool:
        """Whether it plans a video one item per temporal group, each after its timestamp
        text (Qwen3-VL)."""
    @property
    def vision_input(self) -> Literal["patches", "image"]:
        """What the vision tower takes per item: rows of flattened patches and the grid
        (Qwen-VL), or one [3, height, width] image of its fixed size (SigLIP)."""
    @property
    def rope(self) -> Literal["mrope", "1d"]:
        """The positions the plan gives the language model: M-RoPE rows, or 1-D."""
    @property
    def pan_and_scan(self) -> tuple[int, int, float] | None:
        """(min_crop_size, max_num_crops, min_ratio_to_activate): the pan-and-scan knobs of
        a family that can pan and scan (Gemma 3), whether or not do_pan_and_scan is set."""
    @property
    def do_pan_and_scan(self) -> bool: ...
    @property
    def text_pieces(self) -> list[str]:
        """The texts the driver writes into this family's prompts (between an image and its
        crops), for which `process` takes the tokenizer's ids as `text_pieces`."""
    @property
    def image_text_padding(self) -> str:
        """The text the caller writes on both sides of each image placeholder before
        tokenizing (Gemma 3's "\\n\\n"; "" where none)."""
    @property
    def panned_image_text(self) -> str:
        """The text the caller writes before that padding for an image with pan-and-scan
        crops, in the prompt it gives as `panned_input_ids`."""
    @property
    def patch_size(self) -> int: ...
    @property
    def merge_size(self) -> int: ...
    @property
    def temporal_patch_size(self) -> int: ...
    @property
    def min_pixels(self) -> int: ...
    @property
    def max_pixels(self) -> int: ...
    @property
    def image_mean(self) -> tuple[float, float, float]: ...
    @property
    def image_std(self) -> tuple[float, float, float]: ...
    @property
    def image_token_id(self) -> int: ...
    @property
    def vision_start_token_id(self) -> int: ...
    @property
    def vision_end_token_id(self) -> int: ...
    @property
    def video_token_id(self) -> int | None:
        """The placeholder a video's tokens expand from (None: the spec plans images only)."""
    def plan(self, width: int, height: int) -> tuple[tuple[int, int, int], int]:
        """((t, h, w) patch grid, token count) of a width x height image, without pixels."""
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

def spec_from_hf_configs(preprocessor_config: str, config: str) -> Spec:
    """The spec of a checkpoint from the text of its preprocessor_config.json and config.json
    (a spec from bare preprocessing configs may name no video token: it plans images only)."""

@final
class Checkpoint:
    """A checkpoint as its config files describe it (immutable): the family's spec and the
    language model's facts. A family that takes video must name its video token here."""

    @staticmethod
    def from_hf_configs(
        preprocessor_config: str, config: str, generation_config: str | None = None
    ) -> Checkpoint:
        """From the text of its preprocessor_config.json, config.json and, where it has one,
        generation_config.json (for the end-of-sequence ids)."""
    @property
    def spec(self) -> Spec:
        """The preprocessing spec the driver and the preprocessing calls take."""
    @property
    def eos_token_ids(self) -> list[int]:
        """From generation_config.json where it names any, else from the text config."""
    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def max_position_embeddings(self) -> int | None: ...
    @property
    def linear_attention_layers(self) -> list[int]:
        """Indices of the language model's linear-attention layers (`layer_types`)."""
    @property
    def deepstack_layers(self) -> int:
        """Vision layers whose features Qwen3-VL adds to the first decoder layers (0: none)."""
    @property
    def spec_id(self) -> str:
        """16 hex digits of blake3 over config.json and preprocessor_config.json: equal ids,
        equal embeddings."""
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

def preprocess(
    spec: Spec, data: bytes
) -> tuple[
    numpy.ndarray[tuple[int, int], numpy.dtype[numpy.float32]],
    numpy.ndarray[tuple[int, int], numpy.dtype[numpy.int64]],
    int,
]:
    """Encoded image -> (pixel_values [patches, dim], image_grid_thw [1, 3], identity): its
    content hash, folded with the spec's pixel bounds where a request set them."""

def preprocess_batch(
    spec: Spec, data: list[bytes]
) -> list[
    tuple[
        numpy.ndarray[tuple[int, int], numpy.dtype[numpy.float32]],
        numpy.ndarray[tuple[int, int], numpy.dtype[numpy.int64]],
        int,
    ]
]:
    """preprocess of each image, fanned out over the pool, in input order."""

# The 0.1 names of `preprocess` and `preprocess_batch` (they serve every family, not only
# Qwen-VL); kept for one release, removed in 0.2.
qwen_vl_preprocess = preprocess
qwen_vl_preprocess_batch = preprocess_batch

def preprocess_with_crops(
    spec: Spec, data: bytes
) -> list[
    tuple[
        numpy.ndarray[tuple[int, int, int], numpy.dtype[numpy.float32]],
        numpy.ndarray[tuple[int, int], numpy.dtype[numpy.int64]],
        int,
    ]
]:
    """An encoded image, then each of its pan-and-scan crops where the spec pans and scans,
    to (pixel_values, image_grid_thw [1, 3], identity): the image's, each crop's folded
    from it."""

@final
class ProcessedMedia:
    """One item of a request: hash, decoded size, grid, token count and pixel values."""

    @property
    def hash(self) -> int: ...
    @property
    def width(self) -> int: ...
    @property
    def height(self) -> int: ...
    @property
    def image_grid_thw(self) -> numpy.ndarray[tuple[int, int], numpy.dtype[numpy.int64]]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def source(self) -> int:
        """The index of the request's media item this one comes from."""
    @property
    def temporal_group(self) -> int | None:
        """Which temporal group of its video this item is, for a family that plans a video
        one item per group (Qwen3-VL; the hash is then the group's own)."""
    @property
    def crop(self) -> int | None:
        """Which pan-and-scan crop of its image this item is, 1 for the first (the hash is
        then the crop's identity); None for the image itself and everything else."""
    @property
    def pixel_values(
        self,
    ) -> numpy.ndarray[tuple[int, int], numpy.dtype[numpy.float32]] | None:
        """None when the request ran with count_only=True."""
    @property
    def data(self) -> bytearray | None:
        """The item's encoded bytes as fetched (writable, so they can back a tensor without a
        copy); None unless the request ran with keep_bytes."""

@final
class ProcessResult:
    """The prompt expanded for the model, its images and their M-RoPE positions."""

    @property
    def input_ids(self) -> numpy.ndarray[tuple[int], numpy.dtype[numpy.int64]]: ...
    @property
    def offsets(self) -> list[tuple[int, int]]:
        """(start, end) of each item's tokens in input_ids."""
    @property
    def items(self) -> list[ProcessedMedia]: ...
    @property
    def positions(self) -> numpy.ndarray[tuple[int, int], numpy.dtype[numpy.int64]] | None:
        """[3, len] M-RoPE position ids (None for 1-D rope families)."""
    @property
    def rope_delta(self) -> int: ...

def process(
    spec: Spec,
    input_ids: list[int],
    images: list[str | bytes | tuple[int, tuple[int, int, int]]],
    *,
    allowed_local_roots: list[str] = ...,
    allowed_domains: list[str] = ...,
    timeout_s: float | None = None,
    count_only: bool = False,
    keep_bytes: bool = False,
    modalities: list[str] | None = None,
    video: VideoOptions | None = None,
    text_pieces: dict[str, list[int]] | None = None,
    panned_input_ids: list[int] | None = None,
    audio_formats: list[str | None] | None = None,
    max_audio_duration_s: float | None = None,
) -> ProcessResult:
    """The request driver: one placeholder per item in input_ids, items as references
    (URL, data: URL, base64, local path), already-fetched bytes, or (hash, (t, h, w)) for an
    image whose features the caller holds (nothing fetched; its grid is checked). With
    count_only each image is fetched, hashed and sized from its headers (probe_image), never
    decoded. With keep_bytes each item's fetched bytes come back in ProcessedMedia.data.
    `modalities` names each item "image" or "video" (all images when None); a video is
    planned from its headers under `video` (plan_video; its hash is its identity, its
    pixel_values None), its placeholder the video pad; for a family that writes each temporal
    group after its timestamp text (Spec.video_per_group) one item per group, the text spelled
    with `text_pieces` (each piece's ids) and the bytes with the group 0 item. For a spec
    that pans and scans (Spec.do_pan_and_scan) an image it crops is followed by one item per
    crop, the text before the image taken from `panned_input_ids` (the prompt with every
    image written as one with crops) and the texts between them from `text_pieces`, the
    bytes with the image. timeout_s bounds each http(s) fetch, and reading the videos'
    headers once fetched. An "audio" item is checked from its headers (max_audio_duration_s;
    `audio_formats` names each item's declared format, data of another refused) and decoded
    up to its family's chunk to count its samples; its image_grid_thw is (1, 1, valid feature
    frames), its hash folds the family's extractor in."""

def num_threads() -> int:
    """Size of the pool the extension fans work out to (1 without the parallel build)."""

# kv_index
class UnknownParentError(KeyError):
    """A stored KV event names a parent block the index does not hold for that worker."""

def compute_block_hashes(
    tokens: numpy.ndarray[tuple[int], numpy.dtype[numpy.uint32]],
    block_size: int,
    media_spans: list[tuple[int, int, int]] = ...,
    lora_name: str | None = None,
) -> list[int]:
    """Dynamo-compatible local hashes of the complete blocks; `media_spans` lists
    (mm_hash, start, end) token ranges, attached to every block they overlap."""

def compute_seq_hashes(local_hashes: list[int], parent: int | None = None) -> list[int]:
    """Chained sequence hashes of consecutive local hashes, continuing after `parent`."""

@final
class KvIndex:
    """Radix index of the KV blocks each worker holds."""

    def __init__(self) -> None: ...
    def apply_stored(
        self, worker_id: str, parent_hash: int | None, blocks: list[tuple[int, int]]
    ) -> None:
        """Store (block_hash, tokens_hash) blocks in order after `parent_hash`."""
    def apply_removed(self, worker_id: str, block_hashes: list[int]) -> None: ...
    def clear_worker(self, worker_id: str) -> None: ...
    def remove_worker(self, worker_id: str) -> None: ...
    def find_matches(self, local_hashes: list[int]) -> dict[str, int]:
        """{worker_id: overlap_blocks} for the workers holding a prefix of local_hashes."""
    def dump(self, worker_id: str) -> list[tuple[int | None, list[tuple[int, int]]]]:
        """The worker's blocks as (parent_hash, [(block_hash, tokens_hash), ...]) runs."""
    def workers(self) -> list[str]: ...
    def num_blocks(self, worker_id: str) -> int: ...
    def num_nodes(self) -> int: ...
