"""Qwen3-VL video in the Rust core against transformers' `Qwen3VLVideoProcessor` (sampling,
resize over the whole clip's pixel budget, normalisation, patches), `Qwen3VLProcessor`'s
timestamp text in the expanded ids, and the tiny model's `get_rope_index` over prompts laid
out that way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

from mmserve import _mm
from mmserve.tiny.checkpoints import build_tiny_model

from ..mm.qwen_refs import IMAGE_TOKEN, VISION_END, VISION_START
from ..mm.test_positions import tiny_model
from .test_video_core import make_video, media_code

pytestmark = pytest.mark.skipif(
    not hasattr(_mm, "process_video"), reason="needs the core built with the `video` feature"
)

FAMILY = "qwen3_vl"
VIDEO_TOKEN = IMAGE_TOKEN + 1
MERGE = 2
SAMPLER = Qwen3VLVideoProcessor(cap_pixels_per_frame=False)


@pytest.mark.parametrize("total", [1, 2, 3, 5, 7, 16, 29, 30, 31, 97, 300, 1001, 1799, 4000])
@pytest.mark.parametrize("video_fps", [1.0, 10.0, 24.0, 29.97002997002997, 60.0])
def test_sampling_equals_transformers(total: int, video_fps: float) -> None:
    metadata = VideoMetadata(total_num_frames=total, fps=video_fps)
    for kwargs in [
        {"fps": 2.0},
        {"fps": 0.5},
        {"fps": 7.3},
        {"fps": 60.0},
        {"num_frames": 3},
        {"num_frames": 8},
        {"num_frames": 64},
    ]:
        expected = SAMPLER.sample_frames(metadata, **kwargs).tolist()
        if len(expected) < SAMPLER.temporal_patch_size:
            # The processor's smart_resize refuses fewer frames than one temporal patch.
            with pytest.raises(_mm.MediaError) as err:
                _mm.sample_frame_indices(total, video_fps, family=FAMILY, **kwargs)
            assert err.value.args[0] == "video.too_few_frames"
            continue
        ours = _mm.sample_frame_indices(total, video_fps, family=FAMILY, **kwargs)
        assert ours == expected, kwargs


def processed_by_transformers(frames: np.ndarray, **kwargs: Any) -> tuple[np.ndarray, list]:
    processor = Qwen3VLVideoProcessor(**{"cap_pixels_per_frame": False, **kwargs})
    out = processor(
        videos=[torch.from_numpy(frames)],
        do_sample_frames=False,
        input_data_format="channels_last",
        return_tensors="pt",
    )
    return out["pixel_values_videos"].numpy(), out["video_grid_thw"].tolist()


def synthetic_frames(count: int, width: int, height: int, seed: int) -> np.ndarray:
    """Smooth gradients with noise: every interpolation tap matters."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = (x * 255 // max(width - 1, 1) + y * 127 // max(height - 1, 1))[None, :, :, None]
    shift = np.arange(count)[:, None, None, None] * 17 + np.array([0, 85, 170])
    noise = rng.integers(0, 40, (count, height, width, 3))
    return ((base + shift + noise) % 256).astype(np.uint8)


@pytest.mark.parametrize(
    "count, size, extra",
    [
        (4, (96, 64), {}),  # upscaled to the clip's least pixels
        (5, (640, 360), {}),  # an odd count: the last frame repeats
        (3, (131, 47), {}),  # an odd aspect ratio
        (2, (20, 12), {}),  # sides under one factor: scaled up first
        (2, (900, 30), {}),  # a long, thin frame
        (6, (1920, 1080), {}),  # over the clip's budget: scaled down
        (9, (320, 240), {"cap_pixels_per_frame": True}),
        (12, (1280, 720), {"cap_pixels_per_frame": True, "max_video_tokens": 60}),
        (4, (200, 120), {"size": {"shortest_edge": 4096, "longest_edge": 65536}}),
        (7, (200, 120), {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}),
    ],
)
def test_model_inputs_equal_transformers(
    count: int, size: tuple[int, int], extra: dict[str, Any]
) -> None:
    width, height = size
    frames = synthetic_frames(count, width, height, seed=count)
    expected, grid = processed_by_transformers(frames, **extra)
    processor = Qwen3VLVideoProcessor(**{"cap_pixels_per_frame": False, **extra})
    ours, our_grid = _mm.preprocess_video(
        frames,
        family=FAMILY,
        min_pixels=processor.size["shortest_edge"],
        max_pixels=processor.size["longest_edge"],
        mean=list(processor.image_mean),
        std=list(processor.image_std),
        patch_size=processor.patch_size,
        merge_size=processor.merge_size,
        temporal_patch_size=processor.temporal_patch_size,
        cap_pixels_per_frame=bool(processor.cap_pixels_per_frame),
        max_video_tokens=processor.max_video_tokens,
    )
    assert [list(our_grid)] == grid
    assert ours.shape == expected.shape
    assert np.array_equal(ours, expected)


def test_one_frame_is_refused_as_the_processor_refuses_it() -> None:
    frames = synthetic_frames(1, 64, 64, seed=0)
    with pytest.raises(ValueError):
        processed_by_transformers(frames)
    code = media_code(
        lambda: _mm.preprocess_video(
            frames, family=FAMILY, min_pixels=1, max_pixels=1 << 30, mean=[0.5] * 3, std=[0.5] * 3
        )
    )
    assert code == "video.too_few_frames"


def transformers_on_every_frame(
    data: bytes, processor: Qwen3VLVideoProcessor, **kwargs: Any
) -> tuple[dict, Any]:
    info = _mm.probe_video(data)
    _, every = _mm.decode_video(data, list(range(info["total_frames"])))
    out = processor(
        videos=[torch.from_numpy(every)],
        video_metadata=[VideoMetadata(total_num_frames=info["total_frames"], fps=info["fps"])],
        input_data_format="channels_last",
        return_tensors="pt",
        return_metadata=True,
        **kwargs,
    )
    return info, out


@pytest.mark.parametrize(
    "rate, seconds, size, settings",
    [
        ("1", 6.0, "96x64", {}),
        ("10", 1.0, "16x16", {}),
        ("10", 0.5, "1920x1080", {}),
        ("10", 1.3, "131x47", {}),
        ("24", 2.0, "200x120", {"fps": 3.0}),
        ("30000/1001", 2.0, "160x90", {}),
        ("60", 1.5, "64x300", {"fps": 4.0, "cap_pixels_per_frame": True}),
        ("24", 1.0, "320x180", {"fps": None, "num_frames": 5}),
        ("10", 1.0, "96x64", {"do_sample_frames": False}),
        ("25", 2.0, "160x90", {"size": {"shortest_edge": 2048, "longest_edge": 40000}}),
    ],
)
def test_bytes_to_model_inputs_equal_transformers(
    tmp_path: Path, rate: str, seconds: float, size: str, settings: dict[str, Any]
) -> None:
    data = make_video(tmp_path / "v.mp4", size=size, rate=rate, seconds=seconds)
    processor = Qwen3VLVideoProcessor(**{"cap_pixels_per_frame": False, **settings})
    options = _mm.VideoOptions.from_hf_config(processor.to_json_string(), family=FAMILY)
    plan, ours = _mm.process_video(data, options)
    info, expected = transformers_on_every_frame(data, processor)
    sampled = expected["video_metadata"][0].frames_indices
    every = list(range(info["total_frames"]))
    assert plan["indices"] == (every if sampled is None else sampled.tolist())
    assert [list(plan["grid_thw"])] == expected["video_grid_thw"].tolist()
    assert np.array_equal(ours, expected["pixel_values_videos"].numpy())
    assert plan["tokens"] == len(ours) // MERGE**2
    # The count-only plan agrees, without decoding.
    assert _mm.plan_video(data, options) == plan


def test_options_name_the_family_and_identity_covers_it(tmp_path: Path) -> None:
    data = make_video(tmp_path / "v.mp4", size="96x64", rate="10", seconds=1.0)
    qwen3 = _mm.plan_video(data, _mm.VideoOptions(family=FAMILY, fps=2.0))
    qwen2 = _mm.plan_video(data, _mm.VideoOptions(fps=2.0))
    assert qwen3["mm_hash"] != qwen2["mm_hash"]
    assert qwen3["indices"] != qwen2["indices"]
    assert qwen2["timestamp_texts"] == []
    assert len(qwen3["timestamp_texts"]) == qwen3["grid_thw"][0]
    # The constructor's defaults are the processor's class defaults.
    json = SAMPLER.to_json_string()
    assert _mm.plan_video(data, _mm.VideoOptions.from_hf_config(json, family=FAMILY)) == qwen3
    with pytest.raises(_mm.MediaError):
        _mm.VideoOptions.from_hf_config(json)  # a Qwen3-VL config read as Qwen2-VL's
    with pytest.raises(ValueError):
        _mm.VideoOptions(family="gemma3")


@pytest.fixture(scope="module")
def processor() -> Qwen3VLProcessor:
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(FAMILY))
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=16, merge_size=2),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(cap_pixels_per_frame=False),
        chat_template="",
    )


@pytest.mark.parametrize(
    "rate, seconds, fps, num_frames",
    [
        ("10", 1.0, 2.0, None),
        ("24", 3.0, 2.0, None),
        ("30000/1001", 2.5, 1.5, None),
        ("60", 1.0, None, 7),
        ("1", 9.0, 2.0, None),
        ("25", 4.0, 0.7, None),
    ],
)
def test_timestamps_give_the_processors_expanded_ids(
    tmp_path: Path,
    processor: Qwen3VLProcessor,
    rate: str,
    seconds: float,
    fps: float | None,
    num_frames: int | None,
) -> None:
    data = make_video(tmp_path / "v.mp4", size="64x64", rate=rate, seconds=seconds)
    options = _mm.VideoOptions(family=FAMILY, fps=fps, num_frames=num_frames)
    plan = _mm.plan_video(data, options)
    info = plan["info"]
    _, every = _mm.decode_video(data, list(range(info["total_frames"])))
    before, after = "Look: <|vision_start|>", "<|vision_end|> what happens?"
    expected = processor(
        text=[before + "<|video_pad|>" + after],
        videos=[torch.from_numpy(every)],
        video_metadata=[VideoMetadata(total_num_frames=info["total_frames"], fps=info["fps"])],
        videos_kwargs={"fps": fps, "num_frames": num_frames, "input_data_format": "channels_last"},
        return_tensors="pt",
    )["input_ids"][0].tolist()
    tokenizer = processor.tokenizer
    ids = tokenizer(before)["input_ids"]
    per_group = plan["tokens"] // plan["grid_thw"][0]
    pad, start, end = (
        tokenizer.convert_tokens_to_ids(t)
        for t in ("<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    )
    for text in plan["timestamp_texts"]:
        ids += tokenizer(text)["input_ids"] + [start] + [pad] * per_group + [end]
    ids += tokenizer(after)["input_ids"]
    assert ids == expected
    # The standalone function gives the same groups.
    pairs = _mm.video_timestamps(plan["indices"], info["fps"])
    assert [text for _, text in pairs] == plan["timestamp_texts"]
    assert [seconds for seconds, _ in pairs] == plan["timestamps"]
    reference = processor._calculate_timestamps(list(plan["indices"]), info["fps"], 2)
    assert plan["timestamps"] == reference


def qwen3_prompt(rng: np.random.Generator, items: int) -> tuple[list[int], list, list]:
    """Ids laid out as Qwen3VLProcessor lays them out (a video: per temporal group its
    timestamp text, then vision_start, the group's pads, vision_end), the per-group blocks and
    the (kind, grid) items in prompt order."""
    ids = [int(t) for t in rng.integers(0, 60, rng.integers(1, 6))]
    blocks: list[tuple[int, int, tuple[int, int, int], float]] = []
    items_planned = []
    for _ in range(items):
        video = bool(rng.integers(0, 2))
        t = int(rng.integers(1, 6)) if video else 1
        h, w = (int(v) * MERGE for v in rng.integers(1, 5, 2))
        per_group = h * w // MERGE**2
        items_planned.append(("video" if video else "image", (t, h, w)))
        ids.append(VISION_START)
        for _group in range(t):
            if video:
                ids += [int(v) for v in rng.integers(0, 60, rng.integers(4, 7))]  # "<t seconds>"
                ids.append(VISION_START)
            blocks.append((len(ids), len(ids) + per_group, (1, h, w), 1.0))
            ids += [VIDEO_TOKEN if video else IMAGE_TOKEN] * per_group
            if video:
                ids.append(VISION_END)
        ids.append(VISION_END)
        ids += [int(v) for v in rng.integers(0, 60, rng.integers(0, 5))]
    return ids, blocks, items_planned


def test_positions_of_videos_with_timestamps_match_get_rope_index() -> None:
    model: Any = tiny_model(FAMILY)
    rng = np.random.default_rng(31)
    for trial in range(12):
        ids, blocks, planned = qwen3_prompt(rng, items=1 + trial % 4)
        videos = [grid for kind, grid in planned if kind == "video"]
        images = [grid for kind, grid in planned if kind == "image"]
        input_ids = torch.tensor([ids])
        token_type = (input_ids == IMAGE_TOKEN).int() + 2 * (input_ids == VIDEO_TOKEN).int()
        with torch.no_grad():
            expected, delta = model.get_rope_index(
                input_ids,
                mm_token_type_ids=token_type,
                image_grid_thw=torch.tensor(images) if images else None,
                video_grid_thw=torch.tensor(videos) if videos else None,
            )
        positions, our_delta = _mm.mrope_positions(len(ids), blocks, MERGE)
        assert np.array_equal(positions, expected[:, 0].numpy()), (trial, planned)
        assert our_delta == int(delta.item())
