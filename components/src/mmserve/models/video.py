"""A checkpoint's video processing: its video processor config, overridden per item by the
sampling the request plan holds (`protocol.VideoSampling`), as the Rust core's
`VideoOptions`. Whoever plans or decodes a video builds its options here, so every hop
samples the same frames and derives the same identity (mm_hash) from them."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from mmserve import _mm
from mmserve.models.family import ModelSpec
from mmserve.protocol.pipeline import VideoSampling

VIDEO_FAMILIES = frozenset({"qwen2_vl", "qwen2_5_vl"})
"""Families whose video processor is transformers' `Qwen2VLVideoProcessor`, the one the core
follows exactly (Qwen3-VL's has its own resize and timestamps)."""


class UnsupportedVideo(ValueError):
    """The checkpoint's family takes no video, or not one the core processes exactly."""


def video_processor_config(spec: ModelSpec) -> str:
    """The text of the checkpoint's `video_preprocessor_config.json`, or, without one, of its
    `preprocessor_config.json` (where transformers' video processor reads its settings then)."""
    if spec.family.name not in VIDEO_FAMILIES:
        raise UnsupportedVideo(f"{spec.family.name} checkpoints are not served with video")
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        path = Path(spec.path) / name
        if path.exists():
            return path.read_text()
    raise UnsupportedVideo(f"{spec.path} has no video processor config")


@functools.lru_cache(maxsize=256)
def video_options(config: str, sampling: VideoSampling) -> _mm.VideoOptions:
    """The options a video is processed under: the checkpoint's `config` with the plan's
    `sampling` in place of its own sampling and pixel budget."""
    fields = json.loads(config)
    fields.update(
        # Without fps or num_frames the processor keeps every frame (Qwen2-VL's default).
        do_sample_frames=sampling.fps is not None or sampling.num_frames is not None,
        fps=sampling.fps,
        num_frames=sampling.num_frames,
        min_frames=sampling.min_frames,
        max_frames=sampling.max_frames,
        min_pixels=sampling.min_pixels,
        max_pixels=sampling.max_pixels,
    )
    return _mm.VideoOptions.from_hf_config(json.dumps(fields))
