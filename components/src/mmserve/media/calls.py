"""Async calls into the Rust media core.

Each call runs in a worker thread: the core releases the GIL while it fetches, decodes and
preprocesses, so the event loop keeps serving other requests (`plan_request_here` is the one
for a caller already off the loop). Refusals and failures surface as
`mmserve._mm.MediaError(code, message)`.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Literal, ParamSpec, TypeVar

import numpy as np

from mmserve import _mm
from mmserve.media.policy import MediaPolicy
from mmserve.media.processing import PanAndScanKnobs, PixelBounds
from mmserve.media.video import video_options
from mmserve.protocol import MRopePositions, PlannedMedia, RequestPlan
from mmserve.protocol.pipeline import VideoSampling

P = ParamSpec("P")
R = TypeVar("R")

Precomputed = tuple[int, tuple[int, int, int]]
"""`(mm_hash, (t, h, w))` of an item whose embeddings the request carries."""

Modality = Literal["image", "video", "audio"]

# The longest audio clip a request may carry unless the operator says otherwise
# (--max-audio-duration), checked from its headers before it is decoded. A family whose
# processor cuts clips to a chunk (Qwen2-Audio: 30 s) decodes no further than the chunk.
DEFAULT_MAX_AUDIO_DURATION_S = 600.0


@dataclass(frozen=True)
class VideoSettings:
    """How a request's videos are planned: the checkpoint's options (with the caps their
    headers must meet) and the request's resolved sampling."""

    base: _mm.VideoOptions
    sampling: VideoSampling


@dataclass(frozen=True)
class PlannedRequest:
    """The driver's result for one request: the plan, and per planned item what the next
    stage reads (its encoded bytes when asked to keep them, its pixel values when
    preprocessed in full) and the request's media item it comes from (a video planned one
    item per temporal group is several, and so is an image with its pan-and-scan crops; the
    bytes go with the first)."""

    plan: RequestPlan
    data: list[bytearray | None]
    pixel_values: list[np.ndarray | None]
    sources: list[int]


@dataclass(frozen=True)
class ItemPixels:
    """One item preprocessed for the vision tower."""

    mm_hash: int
    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]


async def fetch(source: str, policy: MediaPolicy, max_bytes: int | None = None) -> bytes:
    """The encoded bytes of one media item (URL, `data:` URL, base64 or allowed local path),
    at most `max_bytes` (default: the core's per-item cap)."""
    return await asyncio.to_thread(
        _mm.fetch_bytes, source, max_bytes=max_bytes, **_fetch_options(policy)
    )


def _in_a_thread(blocking: Callable[P, R]) -> Callable[P, Coroutine[Any, Any, R]]:
    """`blocking` as a coroutine function that runs it in a worker thread."""

    @functools.wraps(blocking)
    async def call(*args: P.args, **kwargs: P.kwargs) -> R:
        return await asyncio.to_thread(blocking, *args, **kwargs)

    return call


def plan_request_here(
    spec: _mm.Spec,
    input_ids: list[int],
    sources: list[str | bytes | Precomputed],
    policy: MediaPolicy,
    *,
    count_only: bool,
    keep_bytes: bool = False,
    pixel_bounds: PixelBounds | None = None,
    modalities: Sequence[Modality] | None = None,
    video: VideoSettings | None = None,
    text_pieces: dict[str, list[int]] | None = None,
    pan_and_scan: PanAndScanKnobs | None = None,
    panned_input_ids: list[int] | None = None,
    audio_formats: Sequence[str | None] | None = None,
    max_audio_duration_s: float = DEFAULT_MAX_AUDIO_DURATION_S,
) -> PlannedRequest:
    """Runs the request driver once: fetches every item (`sources` are references - URL,
    `data:` URL, base64, local path - or bytes already fetched; a precomputed item is planned
    from its grid), hashes it, sizes it, expands `input_ids` (one placeholder per item) and
    computes the positions. With `count_only` each image is sized from its headers (EXIF
    orientation applied) and never decoded: a corrupt body is found by whoever decodes it.
    With `keep_bytes` each item's fetched bytes come back too, so they travel on instead of
    being fetched again. `pixel_bounds` resize the images under other bounds than the
    model's, and enter their identity. `modalities` names each item's (all images when
    None); a video is always planned from its container's headers under `video`, its
    identity folded with that sampling, and its pixels are left to the encoder (keep its
    bytes); a family that writes each temporal group after its timestamp text (Qwen3-VL)
    gets one planned item per group. `text_pieces` are the tokenizer's ids of the texts the
    driver writes (`media.text_pieces`). For a family that can pan and scan, `pan_and_scan`
    are the knobs (None: off): an image they crop is followed by its crops, each its own
    planned item, the text before the image taken from `panned_input_ids` (the prompt
    tokenized with each image written as one with crops). An audio clip is planned from its
    headers (the caps, `max_audio_duration_s`) and its samples decoded up to the family's
    chunk (the count of its tokens), its identity folded with the family's extractor;
    `audio_formats` are the formats the request names per item (data of another is refused).
    On the calling thread:
    `plan_request` is the same in a worker thread."""
    kinds: Sequence[Modality] = modalities or ["image"] * len(sources)
    if spec.pan_and_scan is not None:
        spec = spec.with_pan_and_scan(pan_and_scan)
    output = _mm.process(
        spec.with_pixel_bounds(pixel_bounds),
        input_ids,
        sources,
        count_only=count_only,
        keep_bytes=keep_bytes,
        modalities=list(kinds),
        video=None if video is None else video_options(video.base, video.sampling),
        text_pieces=text_pieces,
        panned_input_ids=panned_input_ids,
        audio_formats=None if audio_formats is None else list(audio_formats),
        max_audio_duration_s=max_audio_duration_s,
        **_fetch_options(policy),
    )
    items = []
    first_of: dict[int, int] = {}  # source -> the index of its first planned item
    for index, (item, (start, end)) in enumerate(zip(output.items, output.offsets, strict=True)):
        source, kind = sources[item.source], kinds[item.source]
        carrier = first_of.setdefault(item.source, index)
        carried_by = None if carrier == index else carrier
        if kind == "video":  # the core refused it unless `video` is given
            planned = PlannedMedia(
                modality="video",
                mm_hash=int(item.hash),
                offset=start,
                length=end - start,
                grid_thw=_grid(item.image_grid_thw),
                video=None if video is None else video.sampling,
                temporal_group=item.temporal_group,
                source=carried_by,
            )
        elif kind == "audio":
            planned = PlannedMedia(
                modality="audio",
                mm_hash=int(item.hash),
                offset=start,
                length=end - start,
                grid_thw=_grid(item.image_grid_thw),
            )
        else:
            bounds = None if isinstance(source, tuple) else pixel_bounds
            planned = PlannedMedia(
                mm_hash=int(item.hash),
                offset=start,
                length=end - start,
                grid_thw=_grid(item.image_grid_thw),
                pixel_bounds=bounds,
                pan_and_scan=None if isinstance(source, tuple) else pan_and_scan,
                crop=item.crop,
                source=carried_by,
            )
        items.append(planned)
    return PlannedRequest(
        plan=_plan(output, items),
        data=[item.data for item in output.items],
        pixel_values=[item.pixel_values for item in output.items],
        sources=[item.source for item in output.items],
    )


plan_request = _in_a_thread(plan_request_here)


def _plan(output: _mm.ProcessResult, items: list[PlannedMedia]) -> RequestPlan:
    positions = None
    if output.positions is not None and items:  # without media they are plain 0..len
        positions = MRopePositions(
            rows=output.positions.reshape(-1).tolist(), delta=int(output.rope_delta)
        )
    return RequestPlan(token_ids=output.input_ids.tolist(), media=items, positions=positions)


async def preprocess_with_crops(spec: _mm.Spec, data: bytes) -> list[ItemPixels]:
    """Decodes and preprocesses an image, then each of its pan-and-scan crops where `spec`
    pans and scans (`Spec.with_pan_and_scan`); `mm_hash` is each one's identity."""
    processed = await asyncio.to_thread(_mm.preprocess_with_crops, spec, data)
    return [
        ItemPixels(mm_hash=int(mm_hash), pixel_values=pixel_values, grid_thw=_grid(grid))
        for pixel_values, grid, mm_hash in processed
    ]


async def preprocess_items(
    spec: _mm.Spec, data: list[bytes], pixel_bounds: PixelBounds | None = None
) -> list[ItemPixels]:
    """Decodes and preprocesses each item's encoded bytes for the vision tower (fanned out in
    the core), under `pixel_bounds` when given; the plan already says where each item goes.
    `mm_hash` is each item's identity (its pixel bounds folded in)."""
    processed = await asyncio.to_thread(
        _mm.preprocess_batch, spec.with_pixel_bounds(pixel_bounds), data
    )
    return [
        ItemPixels(mm_hash=int(mm_hash), pixel_values=pixel_values, grid_thw=_grid(grid))
        for pixel_values, grid, mm_hash in processed
    ]


def _grid(grid: np.ndarray) -> tuple[int, int, int]:
    t, h, w = (int(v) for v in grid.reshape(3).tolist())
    return t, h, w


def _fetch_options(policy: MediaPolicy) -> dict[str, Any]:
    return {
        "allowed_domains": sorted(policy.allowed_domains),
        "allowed_local_roots": [str(root) for root in policy.allowed_local_roots],
        "timeout_s": policy.fetch_timeout_s,
    }
