"""One parser of a checkpoint's config files: the Rust registry's checkpoint carries every fact
`ModelSpec` reads, and Python's media limits are the core's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmserve import _mm
from mmserve.media.policy import MediaPolicy
from mmserve.models.family import UnsupportedModel, model_class, resolve_model_spec
from mmserve.tiny.checkpoints import build_tiny_model


def _texts(checkpoint: Path) -> tuple[str, str, str]:
    return tuple(  # type: ignore[return-value]
        (checkpoint / name).read_text()
        for name in ("preprocessor_config.json", "config.json", "generation_config.json")
    )


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5"])
def test_model_spec_reads_the_core_checkpoint_through(family: str) -> None:
    checkpoint = build_tiny_model(family)
    core = _mm.Checkpoint.from_hf_configs(*_texts(checkpoint))
    spec = core.spec
    model = resolve_model_spec(checkpoint)
    assert model.family == spec.family == family and model.core == spec
    assert (model.patch_size, model.spatial_merge_size) == (spec.patch_size, spec.merge_size)
    assert (model.min_pixels, model.max_pixels) == (spec.min_pixels, spec.max_pixels)
    assert model.video_token_id == spec.video_token_id is not None and spec.takes_video
    assert model.eos_token_ids == tuple(core.eos_token_ids)
    assert model.checkpoint.spec_id == core.spec_id and len(core.spec_id) == 16
    config = json.loads((checkpoint / "config.json").read_text())
    text = config.get("text_config", config)
    assert (model.vocab_size, model.hidden_size, model.num_layers) == (
        text["vocab_size"],
        text["hidden_size"],
        text["num_hidden_layers"],
    )
    # The facts Python read from config.json itself before the core did.
    vision = config.get("vision_config") or {}
    deepstack = len(vision.get("deepstack_visual_indexes") or []) if "qwen3_vl" in family else 0
    assert model.deepstack_layers == deepstack
    kinds = text.get("layer_types") or []
    linear = tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention")
    assert model.linear_attention_layers == linear
    assert model.reuses_prefix_blocks == (not linear)
    assert (model.vision_input, spec.rope) == ("patches", "mrope")
    assert model_class(family).__name__ == config["architectures"][0]


def test_a_spec_carries_no_model_facts_and_round_trips_through_json() -> None:
    spec = _mm.Checkpoint.from_hf_configs(*_texts(build_tiny_model("qwen2_vl"))).spec
    bare = _mm.Spec.from_json(spec.to_json())
    assert bare == spec and bare.video_token_id == spec.video_token_id
    assert not hasattr(bare, "vocab_size")


def test_a_missing_fact_is_named(tmp_path: Path) -> None:
    checkpoint = build_tiny_model("qwen2_vl")
    config = json.loads((checkpoint / "config.json").read_text())
    config.pop("video_token_id")
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "preprocessor_config.json").write_text("{}")
    with pytest.raises(UnsupportedModel, match="names no video token, though qwen2_vl takes video"):
        resolve_model_spec(tmp_path)
    # The preprocessing spec alone may leave video out: it plans images only.
    assert not _mm.spec_from_hf_configs("{}", json.dumps(config)).takes_video
    config["video_token_id"] = 151656
    del config["text_config"]["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="config is missing hidden_size"):
        resolve_model_spec(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModel, match=r"config\.json"):
        resolve_model_spec(tmp_path)
    with pytest.raises(UnsupportedModel, match="has no model for llava_next_video_x"):
        model_class("llava_next_video_x")


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
    assert model.family == "gemma3" and model.video_token_id is None
    assert (model.vision_input, model.core.rope, model.core.takes_video) == ("image", "1d", False)
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
