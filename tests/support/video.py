"""Small videos made for a test by the ffmpeg program (FFmpeg's encoders, from the same
libraries the core decodes with), and transformers' view of a prompt with videos and images
(the reference the plan must equal)."""

from __future__ import annotations

import functools
import io
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import AutoConfig, AutoProcessor
from transformers.video_utils import VideoMetadata

from mmserve import _mm
from mmserve.media import VideoSettings
from mmserve.media.video import video_options
from mmserve.models.family import ModelSpec, resolve_model_spec
from mmserve.tiny.checkpoints import build_tiny_model

FFMPEG = shutil.which("ffmpeg")

# A video's and an image's placeholder, as the chat template writes them.
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def make_video(
    path: Path,
    *,
    size: str = "96x64",
    rate: str = "10",
    seconds: float = 1.0,
    codec: str = "libx264",
    pix_fmt: str = "yuv420p",
    extra: tuple[str, ...] = (),
) -> bytes:
    if codec == "libx265":
        extra = ("-x265-params", "log-level=none", *extra)
    if codec == "libaom-av1":
        extra = ("-cpu-used", "8", *extra)
    source = f"testsrc2=size={size}:rate={rate}"
    command = [FFMPEG or "ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i", source]
    command += ["-t", str(seconds), "-c:v", codec, "-pix_fmt", pix_fmt, *extra, str(path)]
    subprocess.run(command, check=True)
    return path.read_bytes()


def make_video_with_track(
    path: Path, *, seconds: float, rate: str = "10", sample_rate: int = 44100
) -> bytes:
    """An H.264 video with a stereo AAC track (a tone), both `seconds` long."""
    tone = f"sine=frequency=440:sample_rate={sample_rate}"
    command = [FFMPEG or "ffmpeg", "-v", "error", "-y", "-f", "lavfi"]
    command += ["-i", f"testsrc2=size=96x64:rate={rate}", "-f", "lavfi", "-i", tone]
    command += ["-t", str(seconds), "-c:v", "libx264", "-pix_fmt", "yuv420p"]
    command += ["-c:a", "aac", "-ac", "2", str(path)]
    subprocess.run(command, check=True)
    return path.read_bytes()


@functools.lru_cache(maxsize=2)
def hf_processor(path: Path) -> Any:
    """transformers' processor of the tiny checkpoint at `path`, loaded once while it is one
    of the last two asked for (its tokenizer takes seconds and 120 MB; a test process steps
    through the families). The tiny Qwen3-VL(-MoE) and Qwen3.5 checkpoints have no
    video_preprocessor_config.json, where transformers finds Qwen2-VL's video processor: they
    get Qwen3-VL's own (class defaults, as the core reads the checkpoint)."""
    processor = AutoProcessor.from_pretrained(path)
    if AutoConfig.from_pretrained(path).model_type in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5"):
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        processor.video_processor = Qwen3VLVideoProcessor(cap_pixels_per_frame=False)
    return processor


@functools.lru_cache(maxsize=2)
def checkpoint(family: str) -> tuple[ModelSpec, Any, Any]:
    """The tiny checkpoint's spec, its transformers processor and a model (random weights)
    for `get_rope_index`."""
    from transformers import (
        Qwen2_5_VLModel,
        Qwen2VLModel,
        Qwen3_5Model,
        Qwen3VLModel,
        Qwen3VLMoeModel,
    )

    path = build_tiny_model(family)
    model_class = {
        "qwen2_vl": Qwen2VLModel,
        "qwen2_5_vl": Qwen2_5_VLModel,
        "qwen3_vl": Qwen3VLModel,
        "qwen3_vl_moe": Qwen3VLMoeModel,
        "qwen3_5": Qwen3_5Model,
    }[family]
    model = model_class(AutoConfig.from_pretrained(path)).eval()
    return resolve_model_spec(path), hf_processor(path), model


def sampled_frames(data: bytes, settings: VideoSettings) -> tuple[torch.Tensor, Any, float]:
    """The frames the core samples of a video under `settings`, as transformers' processors
    take them (`[frames, height, width, 3]`), their `VideoMetadata`, and the rate they sample
    the video at."""
    indices = _mm.plan_video(data, video_options(settings.base, settings.sampling))["indices"]
    info, frames = _mm.decode_video(data, indices)
    metadata = VideoMetadata(
        total_num_frames=info["total_frames"], fps=info["fps"], frames_indices=indices
    )
    return torch.from_numpy(frames), metadata, info["fps"] * len(indices) / info["total_frames"]


def hf_reference(
    family: str, text: str, media: list[tuple[str, bytes]], settings: VideoSettings
) -> tuple[list[int], np.ndarray, int]:
    """(ids, positions [3, len], delta) as transformers computes them: the processor given
    the frames the core samples for each video, then `get_rope_index`."""
    _, processor, model = checkpoint(family)
    images, videos, metadata = [], [], []
    for kind, data in media:
        if kind == "image":
            images.append(Image.open(io.BytesIO(data)))
            continue
        frames, meta, _ = sampled_frames(data, settings)
        videos.append(frames)
        metadata.append(meta)
    sampling = settings.sampling
    out = processor(
        text=[text],
        images=images or None,
        videos=videos or None,
        video_metadata=metadata or None,
        do_sample_frames=False,
        videos_kwargs={
            "size": {"shortest_edge": sampling.min_pixels, "longest_edge": sampling.max_pixels}
        },
        input_data_format="channels_last",
        return_tensors="pt",
    )
    ids = out["input_ids"]
    spec = checkpoint(family)[0]
    token_type = (ids == spec.image_token_id).int() + 2 * (ids == spec.video_token_id).int()
    extra = {}
    if "second_per_grid_ts" in out:
        extra["second_per_grid_ts"] = out["second_per_grid_ts"]
    with torch.no_grad():
        positions, delta = model.get_rope_index(
            ids,
            mm_token_type_ids=token_type,
            image_grid_thw=out.get("image_grid_thw"),
            video_grid_thw=out.get("video_grid_thw"),
            **extra,
        )
    return ids[0].tolist(), positions[:, 0].numpy(), int(delta.item())
