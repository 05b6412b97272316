"""Qwen-VL specs as the checkpoints ship them, the matching transformers processors, and
generated test images, shared by the Qwen-VL parity tests and the golden-fixture script."""

from __future__ import annotations

import io
import json
import os
from typing import Any

import numpy as np
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

from mmserve import _mm

from .images import pipeline_image

IMAGE_TOKEN, VISION_START, VISION_END = 151655, 151652, 151653

# preprocessor_config.json of each family as published (Qwen3-VL uses the `size` dict form),
# plus `default`: keys left out, so transformers' class defaults apply.
PREPROCESSOR_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2_vl": {
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    },
    "qwen2_5_vl": {
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    },
    "qwen3_vl": {
        "size": {"longest_edge": 16777216, "shortest_edge": 65536},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    },
    "default": {},
}
# Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE ship Qwen3-VL's preprocessor_config.json.
QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
for _family in ("qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"):
    PREPROCESSOR_CONFIGS[_family] = PREPROCESSOR_CONFIGS["qwen3_vl"]
MODEL_TYPE = {f: f for f in QWEN_FAMILIES}
PROCESSOR_TYPES = {"pil": "Qwen2VLImageProcessorPil", "torch": "Qwen2VLImageProcessor"}
BACKENDS = ("pil", "torch")


def model_config(family: str) -> dict[str, Any]:
    return {
        "model_type": MODEL_TYPE.get(family, "qwen2_vl"),
        "image_token_id": IMAGE_TOKEN,
        "vision_start_token_id": VISION_START,
        "vision_end_token_id": VISION_END,
        "vision_config": {"patch_size": 16 if family.startswith("qwen3") else 14},
    }


def mm_spec(family: str, backend: str) -> _mm.Spec:
    preprocessor = dict(PREPROCESSOR_CONFIGS[family], image_processor_type=PROCESSOR_TYPES[backend])
    return _mm.spec_from_hf_configs(json.dumps(preprocessor), json.dumps(model_config(family)))


def hf_processor(family: str, backend: str) -> Qwen2VLImageProcessorPil | Qwen2VLImageProcessor:
    cls = Qwen2VLImageProcessorPil if backend == "pil" else Qwen2VLImageProcessor
    return cls(**PREPROCESSOR_CONFIGS[family])


def hf_pixels(processor: Any, data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """What transformers' pipeline produces for the image: `load_image`, then the processor."""
    out = processor(images=[pipeline_image(data)], return_tensors="np")
    return np.asarray(out["pixel_values"]), np.asarray(out["image_grid_thw"])


def parity_scale() -> int:
    """`MMSERVE_PARITY_N` multiplies the random cases (for manual and bench runs)."""
    return max(1, int(os.environ.get("MMSERVE_PARITY_N", "1")))


def photo(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """Smooth gradients plus noise: flat and busy regions, like a photo."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack(
        [
            128 + 100 * np.sin(x / max(width, 1) * 5.0 + rng.uniform(0, 6)),
            128 + 100 * np.cos(y / max(height, 1) * 4.0),
            (x + y) / max(width + height, 1) * 255,
        ],
        axis=-1,
    )
    noisy = base + rng.normal(0, 20, size=base.shape)
    return np.clip(noisy, 0, 255).astype(np.uint8)


def encode(image: Image.Image, fmt: str, **options: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **options)
    return buf.getvalue()


def png_bytes(rng: np.random.Generator, width: int, height: int) -> bytes:
    return encode(Image.fromarray(photo(rng, width, height)), "PNG")
