"""Gemma 3 preprocessing against transformers: pixel_values equal, bit for bit, to
`Gemma3ImageProcessorPil` (PIL backend) and `Gemma3ImageProcessor` (torchvision backend) for
generated images of many sizes, aspect ratios and formats; the request plan's ids (begin of
image, 256 soft tokens, end of image) and 1-D positions; the spec read from the config files
as Gemma 3 checkpoints ship them; pan-and-scan's crops, resized as the main image is (also
as `preprocess_with_crops` cuts them)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from PIL import Image
from transformers.models.gemma3.image_processing_gemma3 import Gemma3ImageProcessor
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from mmserve import _mm

from .images import pipeline_image
from .qwen_refs import encode, photo

BOI, EOI, SOFT = 255_999, 256_000, 262_144
# preprocessor_config.json and the image part of config.json as Gemma 3 checkpoints ship them.
PREPROCESSOR: dict[str, Any] = {
    "do_convert_rgb": None,
    "do_normalize": True,
    "do_pan_and_scan": None,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_seq_length": 256,
    "image_std": [0.5, 0.5, 0.5],
    "pan_and_scan_max_num_crops": None,
    "pan_and_scan_min_crop_size": None,
    "pan_and_scan_min_ratio_to_activate": None,
    "resample": 2,
    "rescale_factor": 1 / 255,
    "size": {"height": 896, "width": 896},
}
CONFIG = {
    "model_type": "gemma3",
    "mm_tokens_per_image": 256,
    "boi_token_index": BOI,
    "eoi_token_index": EOI,
    "image_token_index": SOFT,
    "vision_config": {"image_size": 896, "patch_size": 14, "model_type": "siglip_vision_model"},
}
PROCESSORS = {"pil": Gemma3ImageProcessorPil, "torch": Gemma3ImageProcessor}
PROCESSOR_TYPES = {"pil": "Gemma3ImageProcessorPil", "torch": "Gemma3ImageProcessor"}
# Shrinking, growing, one side each way, extreme aspect ratios (no limit: every image is
# squashed to the square), tiny, and the tower's own size (no resize at all).
SIZES = [
    (1, 1),
    (2, 3),
    (17, 31),
    (224, 224),
    (640, 480),
    (480, 640),
    (1200, 600),
    (600, 1200),
    (895, 897),
    (896, 896),
    (897, 896),
    (1024, 768),
    (1920, 1080),
    (3000, 20),
    (20, 3000),
    (1, 900),
]
FORMAT_SIZE = (333, 500)


def spec(backend: str) -> _mm.Spec:
    preprocessor = dict(PREPROCESSOR, image_processor_type=PROCESSOR_TYPES[backend])
    return _mm.spec_from_hf_configs(json.dumps(preprocessor), json.dumps(CONFIG))


def processor(backend: str) -> Any:
    kwargs = {k: v for k, v in PREPROCESSOR.items() if k != "image_seq_length" and v is not None}
    return PROCESSORS[backend](**kwargs)


@pytest.fixture(scope="module")
def references() -> dict[str, Any]:
    return {backend: processor(backend) for backend in PROCESSORS}


def assert_pixels_match(data: bytes, references: dict[str, Any], what: str) -> int:
    """Both backends equal; returns the number of comparisons."""
    for backend, reference in references.items():
        expected = reference(images=[pipeline_image(data)], return_tensors="np")
        ref = np.asarray(expected["pixel_values"])
        result = _mm.process(spec(backend), [2, BOI], [data])
        (item,) = result.items
        pixels = np.asarray(item.pixel_values)
        assert pixels.dtype == np.float32 and pixels.shape == ref.shape[1:], (what, backend)
        diff = float(np.abs(pixels - ref[0]).max())
        assert diff == 0.0, f"{what} {backend}: max difference {diff}"
    return len(references)


def test_sizes_and_aspect_ratios(references: dict[str, Any]) -> None:
    rng = np.random.default_rng(40)
    compared = sum(
        assert_pixels_match(
            encode(Image.fromarray(photo(rng, w, h)), "PNG"), references, f"{w}x{h}"
        )
        for w, h in SIZES
    )
    assert compared == 2 * len(SIZES)


def test_random_sizes(references: dict[str, Any]) -> None:
    rng = np.random.default_rng(41)
    for _ in range(12):
        w, h = (int(v) for v in np.exp(rng.uniform(0, np.log(2500), 2)))
        data = encode(Image.fromarray(photo(rng, w, h)), "PNG")
        assert_pixels_match(data, references, f"random {w}x{h}")


def test_formats_and_color_modes(references: dict[str, Any]) -> None:
    rng = np.random.default_rng(42)
    image = Image.fromarray(photo(rng, *FORMAT_SIZE))
    opaque = image.copy()
    opaque.putalpha(255)
    encoded = {
        "jpeg": encode(image, "JPEG", quality=90),
        "jpeg_gray": encode(image.convert("L"), "JPEG", quality=85),
        "webp_lossless": encode(image, "WEBP", lossless=True),
        "gif": encode(image.quantize(colors=128), "GIF"),
        "bmp": encode(image, "BMP"),
        "gray_png": encode(image.convert("L"), "PNG"),
        "palette_png": encode(image.quantize(colors=64), "PNG"),
        "rgba_png": encode(opaque, "PNG"),
    }
    for name, data in encoded.items():
        assert_pixels_match(data, references, name)


def test_plan_wraps_256_soft_tokens_and_has_1d_positions() -> None:
    rng = np.random.default_rng(43)
    images = [encode(Image.fromarray(photo(rng, w, h)), "PNG") for w, h in [(64, 48), (30, 900)]]
    ids = [2, 105, 7, BOI, 8, 9, BOI, 106]
    result = _mm.process(spec("torch"), ids, images, count_only=True)
    expanded = list(result.input_ids)
    expected = [2, 105, 7, BOI, *[SOFT] * 256, EOI, 8, 9, BOI, *[SOFT] * 256, EOI, 106]
    assert expanded == expected
    assert [tuple(o) for o in result.offsets] == [(4, 260), (264, 520)]
    assert [item.num_tokens for item in result.items] == [256, 256]
    assert [item.image_grid_thw.tolist() for item in result.items] == [[[1, 64, 64]]] * 2
    assert result.positions is None and result.rope_delta == 0
    with pytest.raises(_mm.MediaError) as count:
        _mm.process(spec("torch"), [2, BOI], images, count_only=True)
    assert count.value.args[0] == "process.placeholder_count"


# Gemma3Processor's pan-and-scan knobs; wide, tall, odd-width crops, below the activation
# ratio, and elongated but too small to crop.
PAN_AND_SCAN = {
    "pan_and_scan_min_crop_size": 256,
    "pan_and_scan_max_num_crops": 4,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}
PAN_AND_SCAN_SIZES = {(1200, 600): 2, (600, 1200): 2, (3000, 300): 4, (1023, 257): 3}
PAN_AND_SCAN_SIZES |= {(1000, 900): 0, (30, 10): 0}


def test_pan_and_scan_crops_resize_as_the_main_image(references: dict[str, Any]) -> None:
    """Each crop the processors make (transformers' own slices) goes through the same
    resize and normalisation as a whole image: mmserve's pixels for the crop as an image
    equal the processor's crop pixel_values, bit for bit, in both backends."""
    rng = np.random.default_rng(44)
    slicer = references["pil"]
    for (w, h), num_crops in PAN_AND_SCAN_SIZES.items():
        data = encode(Image.fromarray(photo(rng, w, h)), "PNG")
        chw = np.asarray(pipeline_image(data)).transpose(2, 0, 1)
        crops = slicer.pan_and_scan(image=chw, **PAN_AND_SCAN)
        assert len(crops) == num_crops, (w, h)
        for backend, reference in references.items():
            panned = reference(
                images=[pipeline_image(data)],
                do_pan_and_scan=True,
                return_tensors="np",
                **PAN_AND_SCAN,
            )
            assert panned["num_crops"].tolist() == [num_crops]
            ref = np.asarray(panned["pixel_values"])
            items = [data] + [encode(Image.fromarray(c.transpose(1, 2, 0)), "PNG") for c in crops]
            for index, item_data in enumerate(items):
                (item,) = _mm.process(spec(backend), [2, BOI], [item_data]).items
                diff = float(np.abs(np.asarray(item.pixel_values) - ref[index]).max())
                assert diff == 0.0, f"{w}x{h} {backend} crop {index}: max difference {diff}"
            # The core's own crops of the image, as the encode stage cuts them.
            panning = spec(backend).with_pan_and_scan((256, 4, 1.2))
            cut = _mm.preprocess_with_crops(panning, data)
            assert len(cut) == 1 + num_crops
            for index, (pixels, _, _) in enumerate(cut):
                assert np.array_equal(pixels, ref[index]), f"{w}x{h} {backend} cut {index}"


def test_spec_reads_every_value_and_pan_and_scan() -> None:
    for backend, reference in (("pil", processor("pil")), ("torch", processor("torch"))):
        values = json.loads(spec(backend).to_json())
        assert values["family"] == "gemma3" and values["backend"] == backend
        assert values["image_size"] == [reference.size.height, reference.size.width]
        assert values["image_mean"] == list(reference.image_mean)
        assert values["image_std"] == list(reference.image_std)
        assert values["rescale_factor"] == reference.rescale_factor
        assert values["resample"] == "bilinear"
        assert (values["patch_size"], values["merge_size"]) == (14, 4)
        assert spec(backend).plan(123, 4567) == ((1, 64, 64), 256)
        assert not values.get("do_pan_and_scan") and spec(backend).pan_and_scan == (256, 4, 1.2)
    panned = dict(PREPROCESSOR, do_pan_and_scan=True, pan_and_scan_max_num_crops=2)
    knobs = _mm.spec_from_hf_configs(json.dumps(panned), json.dumps(CONFIG))
    assert knobs.do_pan_and_scan and knobs.pan_and_scan == (256, 2, 1.2)
    bad = dict(PREPROCESSOR, pan_and_scan_min_crop_size=0)
    with pytest.raises(_mm.MediaError) as refused:
        _mm.spec_from_hf_configs(json.dumps(bad), json.dumps(CONFIG))
    assert refused.value.args[0] == "spec.invalid"
    assert "pan_and_scan_min_crop_size" in refused.value.args[1]
