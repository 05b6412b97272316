"""The tiny checkpoints: tokenizer ids, chat template, family facts, idempotent builds."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from mmserve.cli import main
from mmserve.models.family import UnsupportedModel, resolve_model_spec
from mmserve.models.tokenizer import shared_tokenizer
from mmserve.tiny.checkpoints import MARKER_FILE, TINY_FAMILIES, build_tiny_model, tiny_model_dir
from mmserve.tiny.tokenizer import QWEN2_VL_SPECIAL_TOKENS

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REAL_SPECIAL_IDS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
}


@pytest.fixture(scope="module")
def qwen2_vl() -> Path:
    return build_tiny_model("qwen2_vl")


def test_special_tokens_have_the_real_qwen2_vl_ids(qwen2_vl: Path):
    tokenizer = shared_tokenizer(qwen2_vl)  # AutoTokenizer's, read once per process
    for token, token_id in REAL_SPECIAL_IDS.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
    assert len(QWEN2_VL_SPECIAL_TOKENS) == 151656 - 151643 + 1
    # Ordinary text uses the real Qwen2 ranks (single digits, byte-level BPE).
    assert tokenizer("hello world 123")["input_ids"] == [14990, 1879, 220, 16, 17, 18]
    assert tokenizer.decode(tokenizer("héllo wörld")["input_ids"]) == "héllo wörld"


def test_chat_template_emits_one_vision_block_per_image(qwen2_vl: Path):
    tokenizer = shared_tokenizer(qwen2_vl)  # AutoTokenizer's, read once per process
    content = [
        {"type": "image"},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": "x"}},
    ]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>and"
        "<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer(text)["input_ids"]
    assert ids.count(151655) == 2


QWEN_FAMILIES = tuple(family for family in TINY_FAMILIES if family != "gemma3")


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_family_facts_come_from_the_config_files(family: str):
    spec = resolve_model_spec(build_tiny_model(family))
    assert spec.family == family
    qwen3_5 = family in ("qwen3_5", "qwen3_5_moe")
    qwen3_vision = qwen3_5 or family in ("qwen3_vl", "qwen3_vl_moe")
    assert bool(spec.deepstack_layers) == (qwen3_vision and not qwen3_5)
    # Qwen3.5 numbers the same special tokens from 248044 (tests/frontend/test_qwen3_5_prompt).
    shift = 248044 - 151643 if qwen3_5 else 0
    assert (spec.image_token_id, spec.video_token_id) == (151655 + shift, 151656 + shift)
    assert (spec.vision_start_token_id, spec.vision_end_token_id) == (
        151652 + shift,
        151653 + shift,
    )
    assert spec.eos_token_ids == (151645 + shift, 151643 + shift)
    assert spec.vocab_size > max(REAL_SPECIAL_IDS.values()) + shift
    assert bool(spec.linear_attention_layers) == qwen3_5
    assert spec.spatial_merge_size == 2
    assert spec.image_factor == (32 if qwen3_vision else 28)
    assert spec.min_pixels == (65536 if qwen3_vision else 3136)
    assert spec.image_token_count((1, 8, 12)) == 24


def test_flat_legacy_config_resolves_like_a_nested_one(tmp_path: Path, qwen2_vl: Path):
    # Released Qwen2-VL checkpoints keep the text settings at the top level of config.json.
    nested = json.loads((qwen2_vl / "config.json").read_text())
    flat = {k: v for k, v in nested.items() if k != "text_config"} | nested["text_config"]
    flat["model_type"] = "qwen2_vl"
    (tmp_path / "config.json").write_text(json.dumps(flat))
    for name in ("preprocessor_config.json", "generation_config.json"):
        (tmp_path / name).write_text((qwen2_vl / name).read_text())
    legacy, reference = resolve_model_spec(tmp_path), resolve_model_spec(qwen2_vl)
    assert (legacy.hidden_size, legacy.num_layers, legacy.vocab_size) == (
        reference.hidden_size,
        reference.num_layers,
        reference.vocab_size,
    )
    assert legacy.eos_token_ids == reference.eos_token_ids


def test_unknown_family_and_missing_files_are_explained(tmp_path: Path):
    with pytest.raises(UnsupportedModel, match=r"config\.json missing"):
        resolve_model_spec(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "preprocessor_config.json").write_text("{}")
    with pytest.raises(UnsupportedModel, match="'llama' is not supported"):
        resolve_model_spec(tmp_path)


def test_cli_build_is_deterministic_and_idempotent(
    tmp_path: Path, qwen2_vl: Path, capsys: pytest.CaptureFixture[str]
):
    assert main(["make-tiny-model", "--family", "qwen2_vl", "--out", str(tmp_path)]) == 0
    built = Path(capsys.readouterr().out.strip())
    assert built == tiny_model_dir("qwen2_vl", 0, tmp_path)
    # Same seed, same weights as the cached default build.
    weights = (built / "model.safetensors").read_bytes()
    assert weights == (qwen2_vl / "model.safetensors").read_bytes()
    stamp = (built / "model.safetensors").stat().st_mtime_ns
    assert main(["make-tiny-model", "--family", "qwen2_vl", "--out", str(tmp_path)]) == 0
    assert (built / "model.safetensors").stat().st_mtime_ns == stamp
    # A damaged checkpoint is rebuilt.
    (built / MARKER_FILE).unlink()
    assert build_tiny_model("qwen2_vl", out=tmp_path) == built
    assert (built / MARKER_FILE).is_file()


GEMMA3_SPECIAL_IDS = {
    "<pad>": 0,
    "<eos>": 1,
    "<bos>": 2,
    "<unk>": 3,
    "<start_of_turn>": 105,
    "<end_of_turn>": 106,
    "<start_of_image>": 255999,
    "<end_of_image>": 256000,
    "<image_soft_token>": 262144,
}


def test_gemma3_tokenizer_template_and_facts_are_gemmas():
    path = build_tiny_model("gemma3")
    tokenizer = AutoTokenizer.from_pretrained(path)
    for token, token_id in GEMMA3_SPECIAL_IDS.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (2, 1, 0)
    assert (tokenizer.boi_token, tokenizer.eoi_token, tokenizer.image_token) == (
        "<start_of_image>",
        "<end_of_image>",
        "<image_soft_token>",
    )
    assert tokenizer("\n\n", add_special_tokens=False)["input_ids"] == [108]
    assert tokenizer.decode(tokenizer("héllo wörld")["input_ids"]) == "<bos>héllo wörld"
    content = [{"type": "image"}, {"type": "text", "text": " Describe it. "}]
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\n<start_of_image>Describe it.<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    spec = resolve_model_spec(path)
    assert spec.family == "gemma3" and spec.video_token_id is None
    assert (spec.image_token_id, spec.vision_start_token_id, spec.vision_end_token_id) == (
        262144,
        255999,
        256000,
    )
    assert spec.eos_token_ids == (1, 106)
    assert spec.vocab_size == 262208 > max(GEMMA3_SPECIAL_IDS.values())
    assert spec.core.plan(300, 40) == ((1, 32, 32), 256)
