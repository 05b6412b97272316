"""normalize_patchify (and resize + normalize_patchify) against the pixel_values of the
installed transformers' Qwen2-VL image processors: the PIL one and the torchvision one."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
    Qwen2VLImageProcessor,
    smart_resize,
)

from mmserve import _mm

from .test_resize import photo_like

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# (patch, merge, mean, std, min_pixels, max_pixels): Qwen2/2.5-VL and Qwen3-VL settings.
FAMILIES = {
    "qwen2": (14, 2, CLIP_MEAN, CLIP_STD, 3136, 12845056),
    "qwen3": (16, 2, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), 65536, 16777216),
}

PROCESSORS = {"pil": Qwen2VLImageProcessorPil, "torchvision": Qwen2VLImageProcessor}
RESIZE_BACKEND = {"pil": "pil", "torchvision": "torch"}


def hf_pixel_values(
    convention: str, family: str, image: np.ndarray, max_pixels: int | None = None
) -> tuple[np.ndarray, list[int]]:
    patch, merge, mean, std, min_pixels, default_max = FAMILIES[family]
    processor = PROCESSORS[convention](
        patch_size=patch,
        merge_size=merge,
        temporal_patch_size=2,
        image_mean=list(mean),
        image_std=list(std),
        min_pixels=min_pixels,
        max_pixels=max_pixels or default_max,
    )
    out = processor(images=[Image.fromarray(image)], return_tensors="np")
    return np.asarray(out["pixel_values"]), [int(v) for v in out["image_grid_thw"][0]]


def ours(convention: str, family: str, image: np.ndarray) -> np.ndarray:
    patch, merge, mean, std, _, _ = FAMILIES[family]
    return _mm.normalize_patchify(image, mean, std, 1 / 255, patch, merge, 2, convention)


@pytest.mark.parametrize("convention", list(PROCESSORS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_patchify_of_a_resized_image_equals_the_processor(convention: str, family: str) -> None:
    patch, merge = FAMILIES[family][:2]
    factor = patch * merge
    # Sides already multiples of the factor and inside the pixel bounds: the processor does
    # not resize, so this compares rescale + normalize + patch order alone.
    for i, (blocks_h, blocks_w) in enumerate([(8, 12), (13, 9), (16, 16), (9, 30)]):
        image = photo_like(blocks_w * factor, blocks_h * factor, 50 + i)
        expected, grid = hf_pixel_values(convention, family, image)
        got = ours(convention, family, image)
        assert grid == [1, blocks_h * merge, blocks_w * merge]
        assert got.dtype == np.float32 and got.shape == expected.shape
        assert np.array_equal(got, expected), f"{convention} {family} {image.shape}"


@pytest.mark.parametrize("convention", list(PROCESSORS))
def test_resize_then_patchify_equals_the_processor_end_to_end(convention: str) -> None:
    family = "qwen2"
    patch, merge, _, _, min_pixels, max_pixels = FAMILIES[family]
    rng = np.random.default_rng(11)
    sizes = [(640, 480), (1280, 960), (333, 1201), (50, 37), (3000, 200)]
    sizes += [tuple(int(v) for v in rng.integers(28, 1600, 2)) for _ in range(4)]
    for i, (w, h) in enumerate(sizes):
        image = photo_like(w, h, 90 + i)
        height, width = smart_resize(h, w, patch * merge, min_pixels, max_pixels)
        resized = _mm.resize(image, width, height, "bicubic", RESIZE_BACKEND[convention])
        got = ours(convention, family, resized)
        expected, grid = hf_pixel_values(convention, family, image)
        assert grid == [1, height // patch, width // patch]
        assert np.array_equal(got, expected), f"{convention} {w}x{h} -> {width}x{height}"


def test_conventions_differ_in_the_last_bit() -> None:
    # The two processors' float arithmetic disagrees for some values; a test that compared
    # with one convention only could not tell them apart.
    image = np.arange(256 * 28 * 3, dtype=np.int64).reshape(256 * 28 // 28, 28, 3) % 256
    image = np.ascontiguousarray(image[:252].astype(np.uint8))
    pil = ours("pil", "qwen2", image)
    tv = ours("torchvision", "qwen2", image)
    assert not np.array_equal(pil, tv)
    assert np.abs(pil - tv).max() < 1e-5


def test_errors_carry_stable_codes() -> None:
    image = photo_like(30, 28, 0)
    with pytest.raises(_mm.MediaError) as err:
        _mm.normalize_patchify(image, CLIP_MEAN, CLIP_STD, 1 / 255, 14, 2, 2, "pil")
    assert err.value.args[0] == "transform.not_divisible"
    with pytest.raises(_mm.MediaError) as err:
        _mm.normalize_patchify(image[:, :28].copy(), CLIP_MEAN, CLIP_STD, 1 / 255, 14, 2, 2, "cv2")
    assert err.value.args[0] == "transform.unknown_convention"
