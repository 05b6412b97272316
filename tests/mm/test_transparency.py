"""Transparency for every family and both processor backends: pixel values equal, bit for bit,
to transformers' pipeline (`load_image`, then the family's image processor) over images with
every kind of transparency (alpha partial, full and none; tRNS colours; palettes with one
transparent entry or per-entry alpha; 16-bit samples; GIF and WebP alpha; EXIF-rotated)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from mmserve import _mm

from . import test_gemma3 as gemma3
from .images import pipeline_image, transparent_images
from .qwen_refs import (
    BACKENDS,
    IMAGE_TOKEN,
    PREPROCESSOR_CONFIGS,
    QWEN_FAMILIES,
    VISION_END,
    VISION_START,
    hf_processor,
    mm_spec,
    model_config,
)

SIZES = [(1, 1), (23, 14)]


def family_parts(family: str, backend: str) -> tuple[_mm.Spec, Any, list[int]]:
    """The family's spec, its transformers image processor, and a prompt with one image."""
    if family == "gemma3":
        return gemma3.spec(backend), gemma3.processor(backend), [2, gemma3.BOI]
    prompt = [VISION_START, IMAGE_TOKEN, VISION_END]
    return mm_spec(family, backend), hf_processor(family, backend), prompt


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", [*QWEN_FAMILIES, "gemma3"])
def test_transparent_images_match_the_pipeline(family: str, backend: str) -> None:
    spec, reference, prompt = family_parts(family, backend)
    compared = 0
    for seed, (width, height) in enumerate(SIZES):
        for name, data in transparent_images(np.random.default_rng(seed), width, height).items():
            expected = reference(images=[pipeline_image(data)], return_tensors="np")
            ref = np.asarray(expected["pixel_values"])
            (item,) = _mm.process(spec, prompt, [data]).items
            pixels = np.asarray(item.pixel_values)
            assert pixels.dtype == np.float32 and pixels.size == ref.size, name
            diff = float(np.abs(pixels - ref.reshape(pixels.shape)).max())
            assert diff == 0.0, f"{family} {backend} {name} {width}x{height}: max difference {diff}"
            compared += 1
    assert compared >= 60


@pytest.mark.parametrize("family", [*QWEN_FAMILIES, "gemma3"])
def test_a_processor_without_convert_rgb_is_refused(family: str) -> None:
    """Decoding paints transparent colours white as `convert_to_rgb` does: a checkpoint that
    turns it off would see other pixels."""
    preprocessor = (
        dict(gemma3.PREPROCESSOR) if family == "gemma3" else dict(PREPROCESSOR_CONFIGS[family])
    )
    config = gemma3.CONFIG if family == "gemma3" else model_config(family)
    preprocessor["do_convert_rgb"] = False
    with pytest.raises(_mm.MediaError) as refused:
        _mm.spec_from_hf_configs(json.dumps(preprocessor), json.dumps(config))
    assert refused.value.args[0] == "spec.invalid" and "do_convert_rgb" in refused.value.args[1]
