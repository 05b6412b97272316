"""Gemma 3 prompts: the frontend's expanded ids (chat template, the processor's "\n\n" around
each image, the request plan's soft tokens) equal transformers' Gemma3Processor's."""

from __future__ import annotations

import os
from typing import Any

import msgspec
import pytest
from PIL import Image
from transformers import AutoProcessor

from mmserve.frontend.chat import ChatOptions, ChatPreprocessor, ServedModel
from mmserve.media import MediaPolicy
from mmserve.models.tiny import build_tiny_model
from mmserve.protocol import ChatCompletionRequest
from tests.support.engines import make_image
from tests.support.images import png_data_url

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SOFT = 262_144


def _image_part(image: Image.Image) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": png_data_url(image)}}


def _conversations(images: list[Image.Image]) -> list[list[dict[str, Any]]]:
    """Images first, between and after text, with a system prompt, over two turns."""
    parts = [_image_part(image) for image in images]
    return [
        [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe."}]}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Look:"}, *parts]},
        ],
        [
            {"role": "user", "content": "Hello.\n\n"},
            {"role": "assistant", "content": "Hi.\n"},
            {
                "role": "user",
                "content": [
                    part
                    for part in parts
                    for part in (part, {"type": "text", "text": "\nand then\n\n"})
                ],
            },
        ],
    ]


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def part(p: dict[str, Any]) -> dict[str, Any]:
        return {"type": "image"} if p["type"] == "image_url" else p

    return [
        m if isinstance(m["content"], str) else {**m, "content": [part(p) for p in m["content"]]}
        for m in messages
    ]


@pytest.mark.parametrize("num_images", [0, 1, 3])
async def test_expanded_ids_equal_gemma3_processors(num_images: int) -> None:
    path = build_tiny_model("gemma3")
    model = ServedModel.load(path)
    preprocessor = ChatPreprocessor(model, ChatOptions(policy=MediaPolicy()))
    processor = AutoProcessor.from_pretrained(path)
    images = [make_image(40 + 30 * i, 70 - 20 * i, seed=i) for i in range(num_images)]
    for index, messages in enumerate(_conversations(images)):
        request = msgspec.convert(
            {"model": model.name, "messages": messages}, ChatCompletionRequest
        )
        ours = await preprocessor.preprocess(request, f"r{index}", 1e12)
        text = processor.tokenizer.apply_chat_template(
            _template_messages(messages), tokenize=False, add_generation_prompt=True
        )
        # As the processor's apply_chat_template: the template already wrote <bos>.
        reference = processor(text=text, images=images or None, add_special_tokens=False)
        assert list(ours.plan.token_ids) == reference["input_ids"][0], messages
        assert list(ours.plan.token_ids).count(SOFT) == 256 * num_images
        assert [(m.offset, m.length) for m in ours.plan.media] == [
            (i, 256)
            for i, token in enumerate(reference["input_ids"][0])
            if token == SOFT and reference["input_ids"][0][i - 1] != SOFT
        ]
