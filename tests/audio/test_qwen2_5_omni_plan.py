"""Qwen2.5-Omni's thinker, planned by the frontend: the expanded ids equal
`Qwen2_5OmniProcessor`'s and the positions (TMRoPE) the thinker's own `get_rope_index`, for a
clip alone, an image alone, clips beside an image in one prompt, and a video; the registry
reads the checkpoint's composite config (the thinker's inside it)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from mmserve.frontend.chat import ChatOptions, ChatPreprocessor
from mmserve.frontend.errors import ApiError
from mmserve.media import MediaPolicy
from mmserve.models.family import resolve_model_spec
from mmserve.protocol import ChatCompletionRequest
from tests.support.audio import torchcodec_samples
from tests.support.engines import make_image
from tests.support.images import data_url, png_data_url
from tests.support.omni import (
    RATE,
    OmniCheckpoint,
    omni_checkpoint,
    processor_video_inputs,
    speech_clip,
)
from tests.support.video import FFMPEG, make_video, make_video_with_track


@pytest.fixture(scope="module")
def checkpoint() -> OmniCheckpoint:
    return omni_checkpoint("qwen2_5_omni", transformers.Qwen2_5OmniThinkerForConditionalGeneration)


def test_the_registry_reads_the_thinker_of_the_composite_config(checkpoint: OmniCheckpoint) -> None:
    spec = resolve_model_spec(checkpoint.path)
    assert spec.family == "qwen2_5_omni"
    assert (spec.image_token_id, spec.video_token_id) == (151655, 151656)
    assert spec.core.audio_extractor is not None
    assert spec.core.rope == "mrope"
    assert spec.vocab_size == checkpoint.thinker.config.text_config.vocab_size
    assert type(checkpoint.processor).__name__ == "Qwen2_5OmniProcessor"


# Each case: the user's parts in order, ("audio", seconds) or ("image", width, height).
CASES: dict[str, list[tuple[Any, ...]]] = {
    "clip": [("audio", 2.3)],
    "image": [("image", 90, 60)],
    "clips_beside_an_image": [("audio", 0.7), ("image", 130, 70), ("audio", 31.0)],
}


@pytest.mark.parametrize("case", CASES)
async def test_the_plan_equals_the_processor_and_get_rope_index(
    checkpoint: OmniCheckpoint, case: str
) -> None:
    served, processor = checkpoint.served, checkpoint.processor
    preprocessor = ChatPreprocessor(served, ChatOptions(policy=MediaPolicy()))
    parts: list[dict[str, Any]] = [{"type": "text", "text": "What is this?"}]
    template: list[dict[str, Any]] = [{"type": "text", "text": "What is this?"}]
    images: list[Image.Image] = []
    clips: list[np.ndarray] = []
    for seed, item in enumerate(CASES[case]):
        if item[0] == "audio":
            clip = speech_clip(float(item[1]), seed)
            data = base64.b64encode(clip).decode()
            parts.append({"type": "input_audio", "input_audio": {"data": data, "format": "wav"}})
            template.append({"type": "audio"})
            clips.append(torchcodec_samples(clip, RATE))
        else:
            image = make_image(int(item[1]), int(item[2]), seed=seed)
            parts.append({"type": "image_url", "image_url": {"url": png_data_url(image)}})
            template.append({"type": "image"})
            images.append(image)
    messages = [{"role": "user", "content": parts}]
    request = msgspec.convert({"model": served.name, "messages": messages}, ChatCompletionRequest)
    plan = (await preprocessor.preprocess(request, "r", 1e12)).plan

    text = processor.apply_chat_template(
        [{"role": "user", "content": template}], tokenize=False, add_generation_prompt=True
    )
    reference = processor(
        text=[text], images=images or None, audio=clips or None, return_tensors="pt"
    )
    ids = reference["input_ids"]
    assert list(plan.token_ids) == ids[0].tolist()
    lengths = reference.get("feature_attention_mask")
    positions, delta = checkpoint.thinker.get_rope_index(
        ids,
        image_grid_thw=reference.get("image_grid_thw"),
        attention_mask=torch.ones_like(ids),
        audio_seqlens=None if lengths is None else lengths.sum(-1),
    )
    assert plan.positions is not None
    assert torch.equal(torch.tensor(plan.positions.rows), positions.reshape(-1))
    assert plan.positions.delta == int(delta.flatten()[0])


@pytest.mark.skipif(FFMPEG is None, reason="needs the ffmpeg program")
@pytest.mark.parametrize("fps", [None, 3.0])
async def test_a_videos_plan_equals_the_processor_and_get_rope_index(
    checkpoint: OmniCheckpoint, tmp_path: Path, fps: float | None
) -> None:
    """A video between a clip and an image, sampled at the default rate and at 3 fps (a
    second per grid of 2/3, whose positions torch rounds in float32): the frames the core
    samples, given to the processor, make the plan's ids; its temporal patches sit
    `position_id_per_seconds x second_per_grid` apart, and the text after it resumes past
    its last one."""
    served, processor = checkpoint.served, checkpoint.processor
    preprocessor = ChatPreprocessor(served, ChatOptions(policy=MediaPolicy()))
    video = make_video(tmp_path / "v.mp4", size="96x64", rate="10", seconds=2.0)
    clip = speech_clip(1.3, 1)
    image = make_image(60, 60, seed=2)
    parts = [
        {
            "type": "input_audio",
            "input_audio": {"data": base64.b64encode(clip).decode(), "format": "wav"},
        },
        {"type": "video_url", "video_url": {"url": data_url(video, "video/mp4")}},
        {"type": "image_url", "image_url": {"url": png_data_url(image)}},
        {"type": "text", "text": "What happens?"},
    ]
    body: dict[str, Any] = {"model": served.name, "messages": [{"role": "user", "content": parts}]}
    if fps is not None:
        body["mm_processor_kwargs"] = {"fps": fps}
    request = msgspec.convert(body, ChatCompletionRequest)
    plan = (await preprocessor.preprocess(request, "r", 1e12)).plan

    assert preprocessor.video_range is not None
    settings = preprocessor.video_range.settings(request.mm_processor_kwargs, None)
    template = [{"type": "audio"}, {"type": "video"}, {"type": "image"}, parts[-1]]
    text = processor.apply_chat_template(
        [{"role": "user", "content": template}], tokenize=False, add_generation_prompt=True
    )
    reference = processor(
        text=[text],
        audio=[torchcodec_samples(clip, RATE)],
        images=[image],
        **processor_video_inputs(video, settings),
        return_tensors="pt",
    )
    ids = reference["input_ids"]
    assert list(plan.token_ids) == ids[0].tolist()
    assert reference["video_grid_thw"][0, 0] > 1  # temporal patches to space
    positions, delta = checkpoint.thinker.get_rope_index(
        ids,
        image_grid_thw=reference["image_grid_thw"],
        video_grid_thw=reference["video_grid_thw"],
        attention_mask=torch.ones_like(ids),
        audio_seqlens=reference["feature_attention_mask"].sum(-1),
        second_per_grids=reference["video_second_per_grid"],
    )
    assert plan.positions is not None
    assert torch.equal(torch.tensor(plan.positions.rows), positions.reshape(-1))
    assert plan.positions.delta == int(delta.flatten()[0])


# Each case: (video seconds, video frame rate, requested fps or None).
TRACKS: dict[str, tuple[float, str, float | None]] = {
    "short": (1.0, "10", None),
    "crossing_chunks": (5.0, "10", None),
    "odd_fps": (3.0, "9", 3.0),
}


@pytest.mark.skipif(FFMPEG is None, reason="needs the ffmpeg program")
@pytest.mark.parametrize("case", TRACKS)
async def test_a_video_with_its_track_equals_the_processor_and_get_rope_index(
    checkpoint: OmniCheckpoint, tmp_path: Path, case: str
) -> None:
    """`use_audio_in_video`: a video's track (decoded as transformers' `load_audio` decodes
    it) interleaved with its frames every 2 s of positions, after a clip: the ids equal the
    processor's (`use_audio_in_video=True`, the track given as the video's audio) and the
    positions `get_rope_index(..., use_audio_in_video=True)`'s."""
    served, processor = checkpoint.served, checkpoint.processor
    preprocessor = ChatPreprocessor(served, ChatOptions(policy=MediaPolicy()))
    seconds, rate, fps = TRACKS[case]
    video = make_video_with_track(tmp_path / "v.mp4", seconds=seconds, rate=rate)
    clip = speech_clip(0.6, 3)
    parts = [
        {
            "type": "input_audio",
            "input_audio": {"data": base64.b64encode(clip).decode(), "format": "wav"},
        },
        {"type": "video_url", "video_url": {"url": data_url(video, "video/mp4")}},
        {"type": "text", "text": "What happens?"},
    ]
    kwargs: dict[str, Any] = {"use_audio_in_video": True}
    if fps is not None:
        kwargs["fps"] = fps
    body = {
        "model": served.name,
        "messages": [{"role": "user", "content": parts}],
        "mm_processor_kwargs": kwargs,
    }
    request = msgspec.convert(body, ChatCompletionRequest)
    plan = (await preprocessor.preprocess(request, "r", 1e12)).plan

    assert preprocessor.video_range is not None
    settings = preprocessor.video_range.settings(request.mm_processor_kwargs, None)
    template = [{"type": "audio"}, {"type": "video"}, parts[-1]]
    text = processor.apply_chat_template(
        [{"role": "user", "content": template}], tokenize=False, add_generation_prompt=True
    )
    reference = processor(
        text=[text],
        audio=[torchcodec_samples(clip, RATE), torchcodec_samples(video, RATE)],
        audio_from_video_indices=[None, 0],
        use_audio_in_video=True,
        **processor_video_inputs(video, settings),
        return_tensors="pt",
    )
    ids = reference["input_ids"]
    assert list(plan.token_ids) == ids[0].tolist()
    (item,) = [m for m in plan.media if m.modality == "video"]
    assert item.video is not None and item.video.use_audio_in_video
    positions, delta = checkpoint.thinker.get_rope_index(
        ids,
        video_grid_thw=reference["video_grid_thw"],
        attention_mask=torch.ones_like(ids),
        use_audio_in_video=True,
        audio_seqlens=reference["feature_attention_mask"].sum(-1),
        second_per_grids=reference["video_second_per_grid"],
    )
    assert plan.positions is not None
    assert torch.equal(torch.tensor(plan.positions.rows), positions.reshape(-1))
    assert plan.positions.delta == int(delta.flatten()[0])


@pytest.mark.skipif(FFMPEG is None, reason="needs the ffmpeg program")
async def test_a_video_without_a_track_is_refused_by_name(
    checkpoint: OmniCheckpoint, tmp_path: Path
) -> None:
    """A silent video under `use_audio_in_video` is a 400 naming its part (transformers would
    serve its frames alone; the client asked for a track it does not have)."""
    preprocessor = ChatPreprocessor(checkpoint.served, ChatOptions(policy=MediaPolicy()))
    video = make_video(tmp_path / "v.mp4", seconds=1.0)
    parts = [{"type": "video_url", "video_url": {"url": data_url(video, "video/mp4")}}]
    body = {
        "model": checkpoint.served.name,
        "messages": [{"role": "user", "content": parts}],
        "mm_processor_kwargs": {"use_audio_in_video": True},
    }
    request = msgspec.convert(body, ChatCompletionRequest)
    with pytest.raises(ApiError) as caught:
        await preprocessor.preprocess(request, "r", 1e12)
    assert caught.value.status == 400
    assert caught.value.code == "audio.no_audio_stream"
    assert caught.value.param == "messages[0].content[0].video_url"
