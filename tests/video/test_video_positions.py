"""M-RoPE over prompts with images and videos mixed equals transformers' `get_rope_index` of
Qwen2-VL and Qwen2.5-VL (tiny configs, random weights: the real method), Qwen2.5-VL's video
temporal spacing (`tokens_per_second * second_per_grid_ts`) included."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from mmserve import _mm

from ..mm.qwen_refs import IMAGE_TOKEN, VISION_END, VISION_START
from ..mm.test_positions import tiny_model

VIDEO_TOKEN = IMAGE_TOKEN + 1
MERGE = 2


def random_prompt(rng: np.random.Generator, items: int) -> tuple[list[int], list[tuple]]:
    """Token ids with each item's placeholder run, and the items as (kind, grid, offset)."""
    ids = [int(t) for t in rng.integers(0, 60, rng.integers(1, 6))]
    planned = []
    for _ in range(items):
        video = bool(rng.integers(0, 2))
        t = int(rng.integers(1, 7)) if video else 1
        h, w = (int(v) * MERGE for v in rng.integers(1, 5, 2))
        ids.append(VISION_START)
        planned.append(("video" if video else "image", (t, h, w), len(ids)))
        ids += [VIDEO_TOKEN if video else IMAGE_TOKEN] * (t * h * w // MERGE**2)
        ids.append(VISION_END)
        ids += [int(t) for t in rng.integers(0, 60, rng.integers(0, 5))]
    return ids, planned


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_positions_with_videos_match_get_rope_index(family: str) -> None:
    model: Any = tiny_model(family)
    tokens_per_second = getattr(model.config.vision_config, "tokens_per_second", 1)
    rng = np.random.default_rng(13)
    for trial in range(12):
        ids, planned = random_prompt(rng, items=1 + trial % 4)
        videos = [p for p in planned if p[0] == "video"]
        images = [p for p in planned if p[0] == "image"]
        seconds = rng.choice(np.array([0.5, 1.0, 2 / 3, 1.5], np.float32), len(videos))
        kwargs: dict[str, Any] = {}
        if family == "qwen2_5_vl" and videos:
            kwargs["second_per_grid_ts"] = torch.from_numpy(seconds)
        input_ids = torch.tensor([ids])
        token_type = (input_ids == IMAGE_TOKEN).int() + 2 * (input_ids == VIDEO_TOKEN).int()
        with torch.no_grad():
            expected, delta = model.get_rope_index(
                input_ids,
                mm_token_type_ids=token_type,
                image_grid_thw=torch.tensor([p[1] for p in images]) if images else None,
                video_grid_thw=torch.tensor([p[1] for p in videos]) if videos else None,
                **kwargs,
            )
        blocks = []
        video_index = 0
        for kind, (t, h, w), offset in planned:
            interval = 1.0
            if kind == "video" and family == "qwen2_5_vl":
                # torch multiplies in float32: an int times a float32 second count.
                interval = float(np.float32(tokens_per_second) * seconds[video_index])
            video_index += kind == "video"
            blocks.append((offset, offset + t * h * w // MERGE**2, (t, h, w), interval))
        positions, our_delta = _mm.mrope_positions(len(ids), blocks, MERGE)
        assert np.array_equal(positions, expected[:, 0].numpy()), (trial, planned)
        assert our_delta == int(delta.item())
