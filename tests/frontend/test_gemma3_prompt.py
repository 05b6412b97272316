"""Gemma 3 prompts: the frontend's expanded ids (chat template, the processor's "\n\n" around
each image, the request plan's soft tokens) equal transformers' Gemma3Processor's, with
pan-and-scan too (its crops each an item after the image, the processor's texts between)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from PIL import Image
from transformers import AutoProcessor

from mmserve import _mm
from mmserve.frontend.chat import ChatOptions, ChatPreprocessor, ServedModel
from mmserve.frontend.errors import ApiError
from mmserve.media import MediaPolicy
from mmserve.protocol import ChatCompletionRequest, MMProcessorKwargs
from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.engines import make_image
from tests.support.images import png_bytes, png_data_url

from .conftest import InlineTensorSink

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


# Wide, tall and odd-width crops (2, 2, 3, 4 of them) and an image below the activation
# ratio (none), for Gemma3Processor's default knobs (crops of at least 256 pixels).
PANNED_SIZES = {(700, 350): 2, (300, 620): 2, (800, 260): 3, (1100, 270): 4, (300, 280): 0}


async def test_pan_and_scan_ids_equal_gemma3_processors() -> None:
    """Pan-and-scan asked per request and set by the operator: the ids equal the processor's
    with `do_pan_and_scan` (each image with crops announced, its crops after it, each crop
    an item of its own with its own identity); an image the knobs do not crop is written as
    without pan-and-scan."""
    path = build_tiny_model("gemma3")
    model = ServedModel.load(path)
    processor = AutoProcessor.from_pretrained(path)
    sizes = list(PANNED_SIZES)
    images = [make_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    asked = {"mm_processor_kwargs": {"do_pan_and_scan": True}}
    operator = ChatOptions(
        policy=MediaPolicy(), mm_processor_kwargs=MMProcessorKwargs(do_pan_and_scan=True)
    )
    preprocessors = [
        (ChatPreprocessor(model, ChatOptions(policy=MediaPolicy())), asked),
        (ChatPreprocessor(model, operator), {}),
    ]
    crops = list(PANNED_SIZES.values())
    for index, messages in enumerate(_conversations(images)):
        text = processor.tokenizer.apply_chat_template(
            _template_messages(messages), tokenize=False, add_generation_prompt=True
        )
        reference = processor(
            text=text, images=images, add_special_tokens=False, do_pan_and_scan=True
        )
        assert len(reference["pixel_values"]) == len(images) + sum(crops)
        for preprocessor, extra in preprocessors:
            request = msgspec.convert(
                {"model": model.name, "messages": messages, **extra}, ChatCompletionRequest
            )
            ours = await preprocessor.preprocess(request, f"r{index}", 1e12)
            assert list(ours.plan.token_ids) == reference["input_ids"][0], messages
            media = ours.plan.media
            assert [m.crop for m in media] == [c for n in crops for c in (None, *range(1, n + 1))]
            # A crop's identity is its image's folded with the crop and the knobs; its
            # bytes travel with the image.
            assert len({m.mm_hash for m in media}) == len(media)
            assert all(m.pan_and_scan == (256, 4, 1.2) for m in media)
            assert [p.data is None for p in ours.payloads] == [m.crop is not None for m in media]
    # Turned off per request, the images are written whole.
    off = msgspec.convert(
        {
            "model": model.name,
            "messages": _conversations(images)[0],
            "mm_processor_kwargs": {"do_pan_and_scan": False},
        },
        ChatCompletionRequest,
    )
    plain = await ChatPreprocessor(model, operator).preprocess(off, "off", 1e12)
    assert len(plain.plan.media) == len(images)
    assert all(m.pan_and_scan is None and m.crop is None for m in plain.plan.media)


async def test_the_checkpoints_preprocessor_config_turns_pan_and_scan_on(tmp_path: Path) -> None:
    """A checkpoint whose preprocessor config sets `do_pan_and_scan` and a knob pans and
    scans every request by them, unless the request turns it off."""
    source = build_tiny_model("gemma3")
    for file in source.iterdir():
        (tmp_path / file.name).symlink_to(file)
    config = json.loads((source / "preprocessor_config.json").read_text())
    config |= {"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 2}
    (tmp_path / "preprocessor_config.json").unlink()
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    model = ServedModel.load(tmp_path)
    preprocessor = ChatPreprocessor(model, ChatOptions(policy=MediaPolicy()))
    messages = [{"role": "user", "content": [_image_part(make_image(1100, 270, seed=3))]}]

    async def crops(**extra: Any) -> list[int | None]:
        request = msgspec.convert(
            {"model": model.name, "messages": messages, **extra}, ChatCompletionRequest
        )
        return [m.crop for m in (await preprocessor.preprocess(request, "r", 1e12)).plan.media]

    assert await crops() == [None, 1, 2]
    assert await crops(mm_processor_kwargs={"do_pan_and_scan": False}) == [None]


async def test_pan_and_scan_knobs_change_the_crops_and_their_identity() -> None:
    """Knobs asked per request reach the crops (fewer of them, other identities), and a
    request may not ask for more crops than the server makes."""
    path = build_tiny_model("gemma3")
    model = ServedModel.load(path)
    preprocessor = ChatPreprocessor(model, ChatOptions(policy=MediaPolicy()))
    image = make_image(1100, 270, seed=3)
    messages = [{"role": "user", "content": [_image_part(image)]}]

    async def plan(**kwargs: Any) -> list[Any]:
        request = msgspec.convert(
            {"model": model.name, "messages": messages, "mm_processor_kwargs": kwargs},
            ChatCompletionRequest,
        )
        return list((await preprocessor.preprocess(request, "r", 1e12)).plan.media)

    four = await plan(do_pan_and_scan=True)
    two = await plan(do_pan_and_scan=True, pan_and_scan_max_num_crops=2)
    assert [m.crop for m in four] == [None, 1, 2, 3, 4] and [m.crop for m in two] == [None, 1, 2]
    assert four[0].mm_hash == two[0].mm_hash  # the image itself is the same pixels
    assert four[1].mm_hash != two[1].mm_hash
    assert [m.crop for m in await plan(pan_and_scan_max_num_crops=2)] == [None]  # still off
    ratio = await plan(do_pan_and_scan=True, pan_and_scan_min_ratio_to_activate=5.0)
    assert [m.crop for m in ratio] == [None]
    with pytest.raises(ApiError) as refused:
        await plan(do_pan_and_scan=True, pan_and_scan_max_num_crops=5)
    assert refused.value.code == "invalid_value"
    assert refused.value.param == "mm_processor_kwargs.pan_and_scan_max_num_crops"


async def test_frontend_decoding_ships_each_crops_pixels() -> None:
    """With frontend decoding the image and each of its crops ship their own pixels (the
    core's, as the encode stage would cut them) and no bytes."""
    model = ServedModel.load(build_tiny_model("gemma3"))
    sink = InlineTensorSink()
    options = ChatOptions(policy=MediaPolicy(), frontend_decoding=True)
    preprocessor = ChatPreprocessor(model, options, sink)
    image = make_image(700, 350, seed=4)
    request = msgspec.convert(
        {
            "model": model.name,
            "messages": [{"role": "user", "content": [_image_part(image)]}],
            "mm_processor_kwargs": {"do_pan_and_scan": True},
        },
        ChatCompletionRequest,
    )
    sent = await preprocessor.preprocess(request, "r", 1e12)
    assert [m.crop for m in sent.plan.media] == [None, 1, 2]
    assert all(p.data is None and p.pixel_values is not None for p in sent.payloads)
    panning = model.spec.core.with_pan_and_scan((256, 4, 1.2))
    expected = _mm.preprocess_with_crops(panning, png_bytes(image))
    shipped = [array for _, array in sink.shipped]
    for (pixels, _, identity), array, item in zip(expected, shipped, sent.plan.media, strict=True):
        assert np.array_equal(np.asarray(array), pixels) and identity == item.mm_hash
