"""M-RoPE positions and delta from the driver equal transformers' `get_rope_index` of
Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE (tiny configs, random weights: the real
method) for prompts with no image, one, and several of different grids."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig, Qwen3VLMoeConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeModel

from mmserve import _mm

from .qwen_refs import IMAGE_TOKEN, VISION_END, VISION_START, mm_spec, png_bytes

TEXT = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 64,
}
VISION = {"depth": 1, "hidden_size": 16, "out_hidden_size": 16, "intermediate_size": 16}


def tiny_model(family: str) -> Any:
    if family == "qwen2_vl":
        vision = {"depth": 1, "embed_dim": 16, "hidden_size": 16, "num_heads": 2, "mlp_ratio": 1}
        return Qwen2VLModel(Qwen2VLConfig(text_config=TEXT, vision_config=vision)).eval()
    if family == "qwen2_5_vl":
        config = Qwen2_5_VLConfig(text_config=TEXT, vision_config=dict(VISION, num_heads=2))
        return Qwen2_5_VLModel(config).eval()
    text = dict(TEXT, head_dim=8, rope_scaling={"rope_type": "default", "mrope_section": [2, 1, 1]})
    vision = dict(VISION, num_heads=2, deepstack_visual_indexes=[0])
    if family == "qwen3_vl_moe":
        text = dict(text, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8)
        config = Qwen3VLMoeConfig(text_config=text, vision_config=vision)
        return Qwen3VLMoeModel(config).eval()
    return Qwen3VLModel(Qwen3VLConfig(text_config=text, vision_config=vision)).eval()


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def family_model(request: pytest.FixtureRequest) -> tuple[str, Any]:
    return request.param, tiny_model(request.param)


def prompt(n_images: int, rng: np.random.Generator) -> list[int]:
    """Text runs of random length around `<|vision_start|><|image_pad|><|vision_end|>`."""
    ids = [int(t) for t in rng.integers(0, 60, rng.integers(1, 6))]
    for _ in range(n_images):
        ids += [VISION_START, IMAGE_TOKEN, VISION_END]
        ids += [int(t) for t in rng.integers(0, 60, rng.integers(0, 5))]
    return ids


def reference(model: Any, result: _mm.ProcessResult) -> tuple[np.ndarray, int]:
    ids = torch.from_numpy(result.input_ids)[None]
    grids = [item.image_grid_thw for item in result.items]
    with torch.no_grad():
        positions, delta = model.get_rope_index(
            ids,
            mm_token_type_ids=(ids == IMAGE_TOKEN).int(),
            image_grid_thw=torch.from_numpy(np.concatenate(grids)) if grids else None,
        )
    return positions[:, 0].numpy(), int(delta.item())


# (width, height) per image; grids differ in both directions and in aspect.
PROMPTS = [[], [(64, 64)], [(300, 120), (90, 400), (56, 56)], [(900, 30), (33, 33), (500, 500)]]


@pytest.mark.parametrize("sizes", PROMPTS, ids=lambda s: f"{len(s)}_images")
def test_positions_match_get_rope_index(family_model: tuple[str, Any], sizes: list) -> None:
    family, model = family_model
    rng = np.random.default_rng(len(sizes))
    images = [png_bytes(rng, w, h) for w, h in sizes]
    spec = mm_spec(family, "torch")
    for trial in range(3):
        ids = prompt(len(images), np.random.default_rng(100 * trial + len(sizes)))
        result = _mm.process(spec, ids, images, count_only=True)
        ref_positions, ref_delta = reference(model, result)
        assert result.positions is not None
        assert result.positions.shape == (3, len(result.input_ids))
        np.testing.assert_array_equal(result.positions, ref_positions)
        assert result.rope_delta == ref_delta


def test_full_and_count_only_give_the_same_layout() -> None:
    rng = np.random.default_rng(5)
    images = [png_bytes(rng, w, h) for w, h in [(120, 45), (45, 120)]]
    spec = mm_spec("qwen2_vl", "pil")
    ids = [1, VISION_START, IMAGE_TOKEN, VISION_END, 2, VISION_START, IMAGE_TOKEN, VISION_END]
    full = _mm.process(spec, ids, images)
    cheap = _mm.process(spec, ids, images, count_only=True)
    np.testing.assert_array_equal(full.input_ids, cheap.input_ids)
    np.testing.assert_array_equal(full.positions, cheap.positions)
    assert full.offsets == cheap.offsets and full.rope_delta == cheap.rope_delta
    for a, b in zip(full.items, cheap.items, strict=True):
        assert (a.hash, a.num_tokens) == (b.hash, b.num_tokens)
        assert (a.width, a.height) == (b.width, b.height)
        np.testing.assert_array_equal(a.image_grid_thw, b.image_grid_thw)
        assert a.pixel_values is not None and b.pixel_values is None
