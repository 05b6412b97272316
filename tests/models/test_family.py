"""One parser of a checkpoint's config files: the Rust registry's spec carries every fact
`ModelSpec` holds, and Python's media limits are the core's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmserve import _mm
from mmserve.media.policy import MediaPolicy
from mmserve.models.family import UnsupportedModel, resolve_model_spec
from mmserve.tiny.checkpoints import build_tiny_model


def _texts(checkpoint: Path) -> tuple[str, str, str]:
    return tuple(  # type: ignore[return-value]
        (checkpoint / name).read_text()
        for name in ("preprocessor_config.json", "config.json", "generation_config.json")
    )


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5"])
def test_model_spec_is_the_core_spec(family: str) -> None:
    checkpoint = build_tiny_model(family)
    spec = _mm.spec_from_hf_configs(*_texts(checkpoint))
    model = resolve_model_spec(checkpoint)
    assert model.family.name == spec.family == family
    assert (model.patch_size, model.spatial_merge_size) == (spec.patch_size, spec.merge_size)
    assert (model.min_pixels, model.max_pixels) == (spec.min_pixels, spec.max_pixels)
    assert (model.image_mean, model.image_std) == (spec.image_mean, spec.image_std)
    assert model.eos_token_ids == tuple(spec.eos_token_ids)
    assert model.spec_id == spec.spec_id and len(model.spec_id) == 16
    config = json.loads((checkpoint / "config.json").read_text())
    text = config.get("text_config", config)
    assert (model.vocab_size, model.hidden_size, model.num_layers) == (
        text["vocab_size"],
        text["hidden_size"],
        text["num_hidden_layers"],
    )


def test_a_spec_from_json_has_no_model_facts() -> None:
    checkpoint = build_tiny_model("qwen2_vl")
    spec = _mm.spec_from_hf_configs(*_texts(checkpoint))
    bare = _mm.Spec.from_json(spec.to_json())
    assert bare == spec
    assert (bare.spec_id, bare.vocab_size, bare.video_token_id, bare.eos_token_ids) == (
        None,
        None,
        None,
        [],
    )


def test_a_missing_fact_is_named(tmp_path: Path) -> None:
    checkpoint = build_tiny_model("qwen2_vl")
    config = json.loads((checkpoint / "config.json").read_text())
    config.pop("video_token_id")
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "preprocessor_config.json").write_text("{}")
    with pytest.raises(UnsupportedModel, match=r"config\.json gives no video_token_id"):
        resolve_model_spec(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModel, match=r"config\.json"):
        resolve_model_spec(tmp_path)


def test_media_limits_are_the_cores() -> None:
    assert _mm.MAX_ITEMS_PER_REQUEST == 64
    assert (_mm.MAX_BYTES_PER_ITEM, _mm.MAX_BYTES_PER_REQUEST) == (64 << 20, 256 << 20)
    assert MediaPolicy().max_items == _mm.MAX_ITEMS_PER_REQUEST


def test_a_gemma3_checkpoint_resolves_from_its_config_files(tmp_path: Path) -> None:
    from transformers import Gemma3Config

    config = Gemma3Config(
        text_config={"vocab_size": 262208, "hidden_size": 64, "num_hidden_layers": 2},
        vision_config={"image_size": 896, "patch_size": 14},
    )
    config.to_json_file(tmp_path / "config.json")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106]}))
    preprocessor = {
        "image_processor_type": "Gemma3ImageProcessor",
        "size": {"height": 896, "width": 896},
        "do_pan_and_scan": None,
    }
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    model = resolve_model_spec(tmp_path)
    assert model.family.name == "gemma3" and model.video_token_id is None
    assert (model.image_token_id, model.vision_start_token_id, model.vision_end_token_id) == (
        262144,
        255999,
        256000,
    )
    assert (model.patch_size, model.spatial_merge_size, model.image_factor) == (14, 4, 56)
    assert model.image_token_count((1, 64, 64)) == config.mm_tokens_per_image == 256
    assert (model.vocab_size, model.hidden_size, model.num_layers) == (262208, 64, 2)
    assert model.eos_token_ids == (1, 106)
    assert model.core.plan(300, 40) == ((1, 64, 64), 256)
