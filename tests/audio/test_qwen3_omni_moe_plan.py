"""Qwen3-Omni-MoE's thinker, planned by the frontend: the expanded ids equal
`Qwen3OmniMoeProcessor`'s and the positions the thinker's own `get_rope_index`, for clips
(about 13 tokens a second, never cut to 30 s), an image, both in one prompt, and a video; the
registry reads the thinker's config inside the composite one."""

from __future__ import annotations

import base64
import math
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    _get_feat_extract_output_lengths,
)

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
    return omni_checkpoint(
        "qwen3_omni_moe", transformers.Qwen3OmniMoeThinkerForConditionalGeneration
    )


def _audio_part(clip: bytes) -> dict[str, Any]:
    data = base64.b64encode(clip).decode()
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}


def test_the_registry_reads_the_thinker_of_the_composite_config(checkpoint: OmniCheckpoint) -> None:
    spec = resolve_model_spec(checkpoint.path)
    assert spec.family == "qwen3_omni_moe"
    assert (spec.image_token_id, spec.video_token_id) == (151655, 151656)
    assert spec.patch_size == 16
    assert spec.core.audio_extractor is not None
    assert spec.core.rope == "mrope"
    assert spec.deepstack_layers == 2
    assert spec.vocab_size == checkpoint.thinker.config.text_config.vocab_size
    assert type(checkpoint.processor).__name__ == "Qwen3OmniMoeProcessor"


# Each case: the user's parts in order, ("audio", seconds) or ("image", width, height).
CASES: dict[str, list[tuple[Any, ...]]] = {
    "clip": [("audio", 2.3)],
    # Past Whisper's 30 s chunk: the processor pads to the longest clip and cuts nothing.
    "long_clip": [("audio", 41.0)],
    "image": [("image", 90, 60)],
    "clips_beside_an_image": [("audio", 0.7), ("image", 130, 70), ("audio", 3.0)],
}


async def _plan(checkpoint: OmniCheckpoint, body: dict[str, Any]) -> Any:
    preprocessor = ChatPreprocessor(checkpoint.served, ChatOptions(policy=MediaPolicy()))
    request = msgspec.convert(body, ChatCompletionRequest)
    return preprocessor, request, (await preprocessor.preprocess(request, "r", 1e12)).plan


def _template_text(processor: Any, template: list[dict[str, Any]]) -> str:
    text: str = processor.apply_chat_template(
        [{"role": "user", "content": template}], tokenize=False, add_generation_prompt=True
    )
    return text


@pytest.mark.parametrize("case", CASES)
async def test_the_plan_equals_the_processor_and_get_rope_index(
    checkpoint: OmniCheckpoint, case: str
) -> None:
    served, processor = checkpoint.served, checkpoint.processor
    parts: list[dict[str, Any]] = [{"type": "text", "text": "What is this?"}]
    template: list[dict[str, Any]] = [{"type": "text", "text": "What is this?"}]
    images: list[Image.Image] = []
    clips: list[np.ndarray] = []
    for seed, item in enumerate(CASES[case]):
        if item[0] == "audio":
            clip = speech_clip(float(item[1]), seed)
            parts.append(_audio_part(clip))
            template.append({"type": "audio"})
            clips.append(torchcodec_samples(clip, RATE))
        else:
            image = make_image(int(item[1]), int(item[2]), seed=seed)
            parts.append({"type": "image_url", "image_url": {"url": png_data_url(image)}})
            template.append({"type": "image"})
            images.append(image)
    body = {"model": served.name, "messages": [{"role": "user", "content": parts}]}
    _, _, plan = await _plan(checkpoint, body)

    reference = processor(
        text=[_template_text(processor, template)],
        images=images or None,
        audio=clips or None,
        return_tensors="pt",
    )
    ids = reference["input_ids"]
    assert list(plan.token_ids) == ids[0].tolist()
    lengths = reference.get("feature_attention_mask")
    if lengths is not None:
        # About 13 tokens a second, from every second of each clip.
        heard = [m.length for m in plan.media if m.modality == "audio"]
        assert heard == _get_feat_extract_output_lengths(lengths.sum(-1)).tolist()
        assert all(n >= math.floor(len(c) / RATE) * 13 for n, c in zip(heard, clips, strict=True))
    positions, delta = checkpoint.thinker.get_rope_index(
        ids,
        image_grid_thw=reference.get("image_grid_thw"),
        attention_mask=torch.ones_like(ids),
        audio_seqlens=None if lengths is None else lengths.sum(-1),
    )
    assert plan.positions is not None
    assert torch.equal(torch.tensor(plan.positions.rows), positions.reshape(-1).long())
    assert plan.positions.delta == int(delta.flatten()[0])


async def _video_case(
    checkpoint: OmniCheckpoint, tmp_path: Path, fps: float | None
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """A clip, a video and an image: the plan, and the reference's positions and delta."""
    processor = checkpoint.processor
    video = make_video(tmp_path / "v.mp4", size="96x64", rate="10", seconds=2.0)
    clip = speech_clip(1.3, 1)
    image = make_image(60, 60, seed=2)
    parts = [
        _audio_part(clip),
        {"type": "video_url", "video_url": {"url": data_url(video, "video/mp4")}},
        {"type": "image_url", "image_url": {"url": png_data_url(image)}},
        {"type": "text", "text": "What happens?"},
    ]
    body: dict[str, Any] = {
        "model": checkpoint.served.name,
        "messages": [{"role": "user", "content": parts}],
    }
    if fps is not None:
        body["mm_processor_kwargs"] = {"fps": fps}
    preprocessor, request, plan = await _plan(checkpoint, body)

    assert preprocessor.video_range is not None
    settings = preprocessor.video_range.settings(request.mm_processor_kwargs, None)
    template = [{"type": "audio"}, {"type": "video"}, {"type": "image"}, parts[-1]]
    reference = processor(
        text=[_template_text(processor, template)],
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
    return plan, positions.reshape(-1), delta.flatten()


@pytest.mark.skipif(FFMPEG is None, reason="needs the ffmpeg program")
@pytest.mark.parametrize("fps", [None, 1.0])
async def test_a_videos_plan_equals_the_processor_and_get_rope_index(
    checkpoint: OmniCheckpoint, tmp_path: Path, fps: float | None
) -> None:
    """A video between a clip and an image, sampled at the default 2 fps and at 1 fps: its
    temporal patches sit `position_id_per_seconds x second_per_grid` (13 and 26) apart, and the
    text after it resumes past its last one."""
    plan, positions, delta = await _video_case(checkpoint, tmp_path, fps)
    assert plan.positions is not None
    assert torch.equal(torch.tensor(plan.positions.rows), positions.long())
    assert torch.equal(positions, positions.round())
    assert plan.positions.delta == int(delta[0])


@pytest.mark.skipif(FFMPEG is None, reason="needs the ffmpeg program")
async def test_a_fractional_video_spacing_is_truncated_as_the_serving_engines_do(
    checkpoint: OmniCheckpoint, tmp_path: Path
) -> None:
    """At 3 fps a temporal patch is 2/3 s, 8.67 positions: transformers keeps the fractions
    (and every position after them); the plan keeps integers, the reference's floor, as vLLM
    and SGLang do (docs/media.md)."""
    plan, positions, delta = await _video_case(checkpoint, tmp_path, 3.0)
    assert plan.positions is not None
    assert not torch.equal(positions, positions.round())
    assert torch.equal(torch.tensor(plan.positions.rows), positions.floor().long())
    assert plan.positions.delta == math.floor(float(delta[0]))


@pytest.mark.skipif(FFMPEG is None, reason="needs the ffmpeg program")
async def test_a_videos_own_track_is_refused_by_name(
    checkpoint: OmniCheckpoint, tmp_path: Path
) -> None:
    """`use_audio_in_video` is Qwen2.5-Omni's alone here: on Qwen3-Omni it is a 400 naming
    the option, before anything is fetched."""
    video = make_video_with_track(tmp_path / "v.mp4", seconds=1.0, rate="10")
    parts = [{"type": "video_url", "video_url": {"url": data_url(video, "video/mp4")}}]
    body = {
        "model": checkpoint.served.name,
        "messages": [{"role": "user", "content": parts}],
        "mm_processor_kwargs": {"use_audio_in_video": True},
    }
    with pytest.raises(ApiError) as caught:
        await _plan(checkpoint, body)
    assert caught.value.status == 400
    assert "use_audio_in_video" in caught.value.message
