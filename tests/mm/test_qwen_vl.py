"""Qwen-VL preprocessing against transformers: pixel_values and image_grid_thw equal, bit for
bit, to `Qwen2VLImageProcessorPil` (PIL backend) and `Qwen2VLImageProcessor` (torchvision
backend) on the image as `load_image` returns it, for generated images of every category;
smart_resize equal to transformers' on thousands of sizes; the spec read from HF config files."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from mmserve import _mm

from .images import encode_png
from .qwen_refs import (
    BACKENDS,
    PREPROCESSOR_CONFIGS,
    PROCESSOR_TYPES,
    encode,
    hf_pixels,
    hf_processor,
    mm_spec,
    model_config,
    parity_scale,
    photo,
)

RANDOM_PER_FAMILY = 55
TINY_SIZES = [(1, 1), (1, 2), (2, 1), (3, 3), (13, 27), (27, 28), (28, 28), (29, 56)]
NEAR_LIMIT = [(1, 200), (200, 1), (2, 400), (400, 2), (3, 599), (7, 1400), (1400, 7), (5, 999)]
OVER_LIMIT = [(1, 201), (201, 1), (2, 401), (3, 601), (7, 1401), (1401, 7)]
COLOR_MODES = ("gray", "palette", "rgba", "gray_alpha")
COLOR_ROUNDS = 6
FORMAT_SIZES = [(97, 61), (640, 480), (333, 500)]
# Qwen2-VL resizes these with one side growing and the other shrinking (640x480 -> 644x476),
# where the order of the two resize passes shows.
MIXED_DIRECTION = [(640, 480), (480, 640), (1280, 960), (1920, 1080)]
FORMATS = ("jpeg_420", "jpeg_444", "jpeg_gray", "webp_lossless", "gif", "bmp")
SIXTEEN_BIT = [(0, 1), (2, 3), (4, 2), (6, 4)]

# Images per run (scaled by MMSERVE_PARITY_N), each compared with both backends.
CASE_COUNTS = {
    "random_rgb": 3 * RANDOM_PER_FAMILY * parity_scale(),
    "tiny": 2 * len(TINY_SIZES),
    "aspect_ratio": 2 * (len(NEAR_LIMIT) + len(OVER_LIMIT)),
    "color_modes": len(COLOR_MODES) * COLOR_ROUNDS * parity_scale(),
    "formats": len(FORMATS) * len(FORMAT_SIZES),
    "mixed_direction": len(MIXED_DIRECTION),
    "large": parity_scale(),
    "16bit": len(SIXTEEN_BIT),
}


def assert_matches_reference(data: bytes, family: str, what: str) -> None:
    """mmserve equals transformers on both backends, or both refuse the image."""
    for backend in BACKENDS:
        processor = hf_processor(family, backend)
        spec = mm_spec(family, backend)
        try:
            ref_pixels, ref_grid = hf_pixels(processor, data)
        except ValueError as ref_error:
            with pytest.raises(_mm.MediaError) as ours:
                _mm.preprocess(spec, data)
            assert ours.value.args[0] == "process.aspect_ratio", (what, ref_error)
            continue
        pixels, grid, _ = _mm.preprocess(spec, data)
        assert grid.tolist() == ref_grid.tolist(), f"{what} {backend}"
        assert pixels.dtype == np.float32 and pixels.shape == ref_pixels.shape, f"{what} {backend}"
        diff = float(np.abs(pixels - ref_pixels).max(initial=0.0))
        assert diff == 0.0, f"{what} {backend}: max difference {diff}"


def compare(category: str, data: bytes, family: str, what: str) -> None:
    assert_matches_reference(data, family, f"{category} {what}")


def random_size(rng: np.random.Generator, largest: int) -> tuple[int, int]:
    w, h = (int(v) for v in np.exp(rng.uniform(0, math.log(largest), 2)))
    while max(w, h) / min(w, h) > 150:
        w, h = (int(v) for v in np.exp(rng.uniform(0, math.log(largest), 2)))
    return w, h


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5"])
def test_random_rgb_png_sizes(family: str) -> None:
    seeds = {"qwen2_vl": 11, "qwen3_vl": 12, "qwen3_vl_moe": 24, "qwen3_5": 25}
    rng = np.random.default_rng(seeds[family])
    for _ in range(RANDOM_PER_FAMILY * parity_scale()):
        w, h = random_size(rng, 700)
        data = encode(Image.fromarray(photo(rng, w, h)), "PNG")
        compare("random_rgb", data, family, f"{family} {w}x{h}")


def test_tiny_images() -> None:
    rng = np.random.default_rng(13)
    for w, h in TINY_SIZES:
        data = encode(Image.fromarray(photo(rng, w, h)), "PNG")
        compare("tiny", data, "qwen2_vl", f"{w}x{h}")
        compare("tiny", data, "qwen3_vl", f"{w}x{h}")


def test_aspect_ratio_near_and_over_the_limit() -> None:
    rng = np.random.default_rng(14)
    for w, h in NEAR_LIMIT + OVER_LIMIT:
        data = encode(Image.fromarray(photo(rng, w, h)), "PNG")
        compare("aspect_ratio", data, "qwen2_vl", f"{w}x{h}")
        compare("aspect_ratio", data, "qwen3_vl", f"{w}x{h}")


def test_color_modes() -> None:
    """Gray, gray + opaque alpha, palette and RGBA with opaque alpha."""
    rng = np.random.default_rng(15)
    for i in range(COLOR_ROUNDS * parity_scale()):
        w, h = random_size(rng, 400)
        rgb = Image.fromarray(photo(rng, w, h))
        family = ("qwen2_vl", "qwen3_vl")[i % 2]
        rgba = rgb.copy()
        rgba.putalpha(255)
        gray_alpha = rgb.convert("L")
        gray_alpha.putalpha(255)
        images = [rgb.convert("L"), rgb.quantize(colors=64), rgba, gray_alpha]
        for mode, image in zip(COLOR_MODES, images, strict=True):
            compare(mode, encode(image, "PNG"), family, f"{w}x{h}")


def test_formats() -> None:
    rng = np.random.default_rng(16)
    for i, (w, h) in enumerate(FORMAT_SIZES):
        image = Image.fromarray(photo(rng, w, h))
        family = ("qwen2_vl", "qwen3_vl")[i % 2]
        encoded = [
            encode(image, "JPEG", quality=90),
            encode(image, "JPEG", quality=95, subsampling=0),
            encode(image.convert("L"), "JPEG", quality=85),
            encode(image, "WEBP", lossless=True),
            encode(image.quantize(colors=128), "GIF"),
            encode(image, "BMP"),
        ]
        for name, data in zip(FORMATS, encoded, strict=True):
            compare(name, data, family, f"{w}x{h}")


def test_mixed_direction_resizes() -> None:
    rng = np.random.default_rng(22)
    for w, h in MIXED_DIRECTION:
        data = encode(Image.fromarray(photo(rng, w, h)), "PNG")
        compare("mixed_direction", data, "qwen2_vl", f"{w}x{h}")


def test_large_images() -> None:
    """The largest sizes, with transformers' default max_pixels to bound the suite's time."""
    rng = np.random.default_rng(17)
    sizes = [(4000, 3000)] + [random_size(rng, 4000) for _ in range(parity_scale() - 1)]
    for w, h in sizes:
        data = encode(Image.fromarray(photo(rng, w, h)), "PNG")
        compare("large", data, "default", f"{w}x{h}")


@pytest.mark.parametrize(("color_type", "channels"), SIXTEEN_BIT)
def test_sixteen_bit_images(color_type: int, channels: int) -> None:
    samples = np.random.default_rng(18).integers(0, 65536, (97, 61, channels))
    compare("16bit", encode_png(samples, color_type, 16), "qwen2_vl", f"color type {color_type}")


def test_parity_covers_at_least_200_images() -> None:
    assert sum(CASE_COUNTS.values()) >= 200, CASE_COUNTS


# smart_resize ---------------------------------------------------------------------------------


def smart_resize_sizes(rng: np.random.Generator, count: int) -> list[tuple[int, int]]:
    extremes = [(1, 1), (1, 200), (200, 1), (1, 201), (27, 5400), (5400, 27), (20000, 100)]
    extremes += [(28, 28), (42, 70), (70, 42), (3584, 3584), (4000, 3000), (65535, 400)]
    log_side = np.exp(rng.uniform(0, math.log(30000), (count, 2))).astype(int)
    return extremes + [(int(w), int(h)) for w, h in log_side]


@pytest.mark.parametrize(
    "family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "default"]
)
def test_smart_resize_matches_transformers(family: str) -> None:
    spec = mm_spec(family, "torch")
    processor = hf_processor(family, "torch")
    factor = processor.patch_size * processor.merge_size
    min_pixels, max_pixels = processor.size.shortest_edge, processor.size.longest_edge
    rng = np.random.default_rng(19)
    for w, h in smart_resize_sizes(rng, 3000 * parity_scale()):
        try:
            rh, rw = smart_resize(h, w, factor, min_pixels, max_pixels)
        except ValueError:
            with pytest.raises(_mm.MediaError, match="aspect ratio"):
                spec.plan(w, h)
            continue
        grid, tokens = spec.plan(w, h)
        patch = processor.patch_size
        assert grid == (1, rh // patch, rw // patch), (family, w, h)
        assert tokens == rh * rw // (patch * patch * processor.merge_size**2)


# spec from HF config files ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5"]
)
def test_spec_from_hf_configs_reads_every_value(family: str) -> None:
    spec = json.loads(mm_spec(family, "pil").to_json())
    processor = hf_processor(family, "pil")
    assert spec["family"] == family
    assert spec["patch_size"] == processor.patch_size
    assert spec["merge_size"] == processor.merge_size
    assert spec["temporal_patch_size"] == processor.temporal_patch_size
    assert spec["min_pixels"] == processor.size.shortest_edge
    assert spec["max_pixels"] == processor.size.longest_edge
    assert spec["image_mean"] == list(processor.image_mean)
    assert spec["image_std"] == list(processor.image_std)
    assert spec["rescale_factor"] == processor.rescale_factor
    assert spec["resample"] == "bicubic"
    assert spec["backend"] == "pil"
    assert spec["image_token_id"] == model_config(family)["image_token_id"]
    assert _mm.Spec.from_json(json.dumps(spec)) == mm_spec(family, "pil")


def test_spec_backend_follows_the_processor_type() -> None:
    assert json.loads(mm_spec("qwen2_vl", "torch").to_json())["backend"] == "torch"
    config = json.dumps(model_config("qwen2_vl"))
    bare = _mm.spec_from_hf_configs(json.dumps(PREPROCESSOR_CONFIGS["qwen2_vl"]), config)
    assert json.loads(bare.to_json())["backend"] == "torch"


def test_spec_errors_carry_codes() -> None:
    with pytest.raises(_mm.MediaError) as err:
        _mm.spec_from_hf_configs("{}", json.dumps({"model_type": "llava"}))
    assert err.value.args[0] == "spec.unknown_family"
    with pytest.raises(_mm.MediaError) as err:
        _mm.Spec.from_json("{}")
    assert err.value.args[0] == "spec.json"
    assert err.value.args[2] is None
    assert type(err.value).__module__ == "mmserve._mm"


def test_batch_equals_one_by_one_and_names_the_failing_item() -> None:
    rng = np.random.default_rng(20)
    spec = mm_spec("qwen2_vl", "pil")
    images = [encode(Image.fromarray(photo(rng, 50 + 37 * i, 90 - 9 * i)), "PNG") for i in range(5)]
    batch = _mm.preprocess_batch(spec, images)
    for data, (pixels, grid, digest) in zip(images, batch, strict=True):
        one_pixels, one_grid, one_digest = _mm.preprocess(spec, data)
        assert np.array_equal(pixels, one_pixels) and np.array_equal(grid, one_grid)
        assert digest == one_digest == _mm.content_hash(data)
    with pytest.raises(_mm.MediaError) as err:
        _mm.preprocess_batch(spec, [images[0], b"not an image", images[1]])
    assert err.value.args[2] == 1 and "item 1" in err.value.args[1]


def test_the_0_1_names_are_aliases_for_one_release() -> None:
    assert _mm.qwen_vl_preprocess is _mm.preprocess
    assert _mm.qwen_vl_preprocess_batch is _mm.preprocess_batch


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("resample", [1, 2, 3], ids=["lanczos", "bilinear", "bicubic"])
def test_resample_filter_from_the_config(backend: str, resample: int) -> None:
    preprocessor = dict(PREPROCESSOR_CONFIGS["qwen2_vl"], resample=resample)
    processor = hf_processor("qwen2_vl", backend).__class__(**preprocessor)
    preprocessor["image_processor_type"] = PROCESSOR_TYPES[backend]
    config = json.dumps(model_config("qwen2_vl"))
    spec = _mm.spec_from_hf_configs(json.dumps(preprocessor), config)
    rng = np.random.default_rng(21 + resample)
    for w, h in [(300, 200), (57, 430)]:
        data = encode(Image.fromarray(photo(rng, w, h)), "PNG")
        ref_pixels, ref_grid = hf_pixels(processor, data)
        pixels, grid, _ = _mm.preprocess(spec, data)
        assert grid.tolist() == ref_grid.tolist()
        assert np.array_equal(pixels, ref_pixels), f"{backend} resample={resample} {w}x{h}"
