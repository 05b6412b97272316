"""What the Omni thinkers' plan tests share: a tiny checkpoint with its processor, its
thinker on the meta device (for `get_rope_index`) and the frontend's served model; speech-like
clips; and a video's inputs for the processor as the core samples it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from mmserve.frontend.chat import ServedModel
from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.audio import signal, wav_bytes
from tests.support.video import sampled_frames

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RATE = 16000  # the Omni extractors' sampling rate


@dataclass
class OmniCheckpoint:
    path: Path
    thinker: Any  # its get_rope_index, on the meta device (no weights)
    served: ServedModel
    processor: Any


def omni_checkpoint(family: str, thinker_class: type) -> OmniCheckpoint:
    """`family`'s tiny checkpoint, its thinker (of `thinker_class`) built on the meta device
    from the thinker's config inside the composite one."""
    path = build_tiny_model(family)
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        thinker = thinker_class(config.thinker_config)
    processor = transformers.AutoProcessor.from_pretrained(path)
    return OmniCheckpoint(path, thinker, ServedModel.load(path), processor)


def speech_clip(seconds: float, seed: int) -> bytes:
    """A 22.05 kHz WAV of speech-like noise (resampled to 16 kHz on the way)."""
    rng = np.random.default_rng(seed)
    return wav_bytes(signal("speech_like", 22050, seconds, 1, rng), 22050, "s16")


def processor_video_inputs(video: bytes, settings: Any) -> dict[str, Any]:
    """The processor's video inputs for `video`: the frames the core samples under
    `settings`, at their sampled rate (the processors take the rate they are told for the
    positions, whatever the frames), sized by the processor's own frame bounds (its
    `videos_kwargs`), which the plan's defaults must equal."""
    frames, metadata, sampled_fps = sampled_frames(video, settings)
    return {
        "videos": [frames],
        "video_metadata": [metadata],
        "do_sample_frames": False,
        "videos_kwargs": {"fps": sampled_fps},
        "input_data_format": "channels_last",
    }
