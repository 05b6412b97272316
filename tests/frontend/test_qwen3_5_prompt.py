"""Qwen3.5 and Qwen3.5-MoE prompts: the tiny checkpoints' tokenizer at Qwen3.5's own ids, and
the frontend's request plan (expanded ids, placements, M-RoPE positions) equal to transformers'
Qwen3VLProcessor and the model's own `get_rope_index`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from mmserve.frontend.chat import ChatOptions, ChatPreprocessor, ServedModel
from mmserve.media import MediaPolicy
from mmserve.models.family import model_class
from mmserve.protocol import ChatCompletionRequest
from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.engines import make_image
from tests.support.images import png_data_url

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Qwen3.5's special tokens, as its checkpoints and `Qwen3_5Config` number them.
REAL_IDS = {
    "<|endoftext|>": 248044,
    "<|im_start|>": 248045,
    "<|im_end|>": 248046,
    "<|vision_start|>": 248053,
    "<|vision_end|>": 248054,
    "<|image_pad|>": 248056,
    "<|video_pad|>": 248057,
}
IMAGE_PAD = REAL_IDS["<|image_pad|>"]
QWEN3_5_FAMILIES = ["qwen3_5", "qwen3_5_moe"]


@dataclass
class Checkpoint:
    path: Path
    model: Any  # the family's transformers model
    served: ServedModel
    processor: Any  # Qwen3VLProcessor


@pytest.fixture(scope="module", params=QWEN3_5_FAMILIES)
def checkpoint(request: pytest.FixtureRequest) -> Checkpoint:
    path = build_tiny_model(request.param)
    model = model_class(request.param).from_pretrained(path).eval()
    return Checkpoint(path, model, ServedModel.load(path), AutoProcessor.from_pretrained(path))


def test_the_tokenizer_and_config_hold_qwen3_5s_ids(checkpoint: Checkpoint) -> None:
    path, model, tokenizer = checkpoint.path, checkpoint.model, checkpoint.processor.tokenizer
    for token, token_id in REAL_IDS.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
    assert tokenizer.decode(tokenizer("héllo wörld")["input_ids"]) == "héllo wörld"
    config = model.config
    assert (config.image_token_id, config.video_token_id) == (248056, 248057)
    assert config.vision_start_token_id == 248053
    assert "deepstack_visual_indexes" not in json.loads((path / "config.json").read_text())
    # Both kinds of layer, so every test crosses a linear and a full-attention layer.
    assert set(config.text_config.layer_types) == {"linear_attention", "full_attention"}
    assert config.text_config.vocab_size > max(REAL_IDS.values())


def _messages(images: list[Image.Image]) -> list[dict[str, Any]]:
    parts = [{"type": "image_url", "image_url": {"url": png_data_url(image)}} for image in images]
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, *parts]},
    ]


@pytest.mark.parametrize("num_images", [0, 1, 3])
async def test_the_plan_equals_the_processor_and_get_rope_index(
    checkpoint: Checkpoint, num_images: int
) -> None:
    model, served, processor = checkpoint.model, checkpoint.served, checkpoint.processor
    preprocessor = ChatPreprocessor(served, ChatOptions(policy=MediaPolicy()))
    assert type(processor).__name__ == "Qwen3VLProcessor"
    # Sizes and aspect ratios of their own, so every image has its own grid.
    images = [make_image(40 + 70 * i, 90 - 25 * i, seed=i) for i in range(num_images)]
    messages = _messages(images)
    request = msgspec.convert({"model": served.name, "messages": messages}, ChatCompletionRequest)
    plan = (await preprocessor.preprocess(request, "r", 1e12)).plan

    template = [
        m
        if isinstance(m["content"], str)
        else {
            **m,
            "content": [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]],
        }
        for m in messages
    ]
    text = processor.tokenizer.apply_chat_template(
        template, tokenize=False, add_generation_prompt=True
    )
    reference = processor(text=[text], images=images or None, return_tensors="pt")
    ids = reference["input_ids"][0].tolist()
    assert list(plan.token_ids) == ids
    runs = [(i, t) for i, t in enumerate(ids) if t == IMAGE_PAD and ids[i - 1] != IMAGE_PAD]
    assert [m.offset for m in plan.media] == [i for i, _ in runs]
    assert sum(m.length for m in plan.media) == ids.count(IMAGE_PAD)
    if not images:
        assert plan.positions is None  # 1-D positions, which M-RoPE reads as such
        return
    positions, delta = model.model.get_rope_index(
        reference["input_ids"],
        reference["mm_token_type_ids"],
        image_grid_thw=reference["image_grid_thw"],
    )
    assert plan.positions is not None
    assert torch.equal(torch.tensor(plan.positions.rows), positions.reshape(-1))
    assert plan.positions.delta == int(delta.flatten()[0])
