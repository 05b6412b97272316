"""The request driver (`_mm.process`): expanded ids, offsets and pixel values equal to what a
transformers processor makes of the same prompt; request caps; errors tagged with the item;
sources and bytes alike; output identical whatever the pool size."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2VLProcessor, Qwen3VLProcessor
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from mmserve import _mm

from .pool_digest import digest_of_a_request
from .qwen_refs import IMAGE_TOKEN, VISION_END, VISION_START, hf_processor, mm_spec, png_bytes

WORDS = ["describe", "this", "and", "that", "compare", "the", "two", "pictures", "please", "."]
SPECIAL = {
    "<|vision_start|>": VISION_START,
    "<|vision_end|>": VISION_END,
    "<|image_pad|>": IMAGE_TOKEN,
    "<|video_pad|>": 151656,
}
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer with the Qwen-VL special tokens at their real ids."""
    vocab = {w: i for i, w in enumerate(WORDS)} | {"[UNK]": len(WORDS)} | SPECIAL
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(SPECIAL))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")


def hf_full_processor(family: str, backend: str) -> Any:
    tokenizer = word_tokenizer()
    image_processor = hf_processor(family, backend)
    if family == "qwen3_vl":
        return Qwen3VLProcessor(image_processor, tokenizer, Qwen3VLVideoProcessor())
    return Qwen2VLProcessor(image_processor, tokenizer, Qwen2VLVideoProcessor())


def ids_of(text: str) -> list[int]:
    return word_tokenizer()(text)["input_ids"]


TEXTS = [
    f"describe this {PLACEHOLDER} please .",
    f"compare {PLACEHOLDER} and {PLACEHOLDER} and {PLACEHOLDER} .",
    f"{PLACEHOLDER}",
]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
@pytest.mark.parametrize("backend", ["pil", "torch"])
def test_matches_the_transformers_processor(family: str, backend: str) -> None:
    processor = hf_full_processor(family, backend)
    spec = mm_spec(family, backend)
    rng = np.random.default_rng(3)
    for text in TEXTS:
        count = text.count(PLACEHOLDER)
        images = [png_bytes(rng, *rng.integers(20, 400, 2)) for _ in range(count)]
        ref = processor(
            text=[text], images=[Image.open(io.BytesIO(b)) for b in images], return_tensors="np"
        )
        ours = _mm.process(spec, ids_of(text), images)
        np.testing.assert_array_equal(ours.input_ids, ref["input_ids"][0])
        ref_ids = np.asarray(ref["input_ids"][0])
        runs = np.flatnonzero(np.diff(np.concatenate([[0], ref_ids == IMAGE_TOKEN, [0]])))
        assert ours.offsets == [(int(s), int(e)) for s, e in runs.reshape(-1, 2)]
        grids = np.concatenate([item.image_grid_thw for item in ours.items])
        np.testing.assert_array_equal(grids, ref["image_grid_thw"])
        pixels = np.concatenate([item.pixel_values for item in ours.items])
        assert np.array_equal(pixels, ref["pixel_values"])
        assert [item.num_tokens for item in ours.items] == [e - s for s, e in ours.offsets]
        assert [item.hash for item in ours.items] == [_mm.content_hash(b) for b in images]


def one_image_prompt(n: int = 1) -> list[int]:
    return [0] + [VISION_START, IMAGE_TOKEN, VISION_END, 1] * n


def test_sources_and_bytes_give_the_same_result(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    data = png_bytes(rng, 70, 50)
    path = tmp_path / "image.png"
    path.write_bytes(data)
    sources: list[str | bytes] = [
        data,
        "data:image/png;base64," + base64.b64encode(data).decode(),
        base64.b64encode(data).decode(),
        str(path),
        path.as_uri(),
    ]
    spec = mm_spec("qwen2_vl", "pil")
    result = _mm.process(spec, one_image_prompt(5), sources, allowed_local_roots=[str(tmp_path)])
    first = result.items[0]
    for item in result.items[1:]:
        assert item.hash == first.hash
        assert np.array_equal(item.pixel_values, first.pixel_values)


def test_local_file_outside_the_allowed_roots_is_refused_with_its_index(tmp_path: Path) -> None:
    data = png_bytes(np.random.default_rng(5), 30, 30)
    path = tmp_path / "image.png"
    path.write_bytes(data)
    with pytest.raises(_mm.MediaError) as err:
        _mm.process(mm_spec("qwen2_vl", "pil"), one_image_prompt(2), [data, str(path)])
    code, message, index = err.value.args
    assert code.startswith("fetch.") and index == 1 and message.startswith("item 1:")


def test_bad_item_rejects_the_request_and_names_it() -> None:
    good = png_bytes(np.random.default_rng(6), 40, 40)
    thin = png_bytes(np.random.default_rng(6), 1, 300)
    spec = mm_spec("qwen2_vl", "torch")
    with pytest.raises(_mm.MediaError) as err:
        _mm.process(spec, one_image_prompt(3), [good, good, b"\x89PNG garbage"])
    assert err.value.args[0].startswith("decode.") and err.value.args[2] == 2
    with pytest.raises(_mm.MediaError) as err:
        _mm.process(spec, one_image_prompt(2), [good, thin])
    assert err.value.args[:1] == ("process.aspect_ratio",) and err.value.args[2] == 1
    assert "200" in err.value.args[1]


def test_placeholder_mismatch_is_a_request_error() -> None:
    good = png_bytes(np.random.default_rng(7), 40, 40)
    spec = mm_spec("qwen2_vl", "pil")
    with pytest.raises(_mm.MediaError) as err:
        _mm.process(spec, one_image_prompt(2), [good])
    assert err.value.args[0] == "process.placeholder_count" and err.value.args[2] is None
    with pytest.raises(_mm.MediaError) as err:
        _mm.process(spec, [5, IMAGE_TOKEN, 6], [good])
    assert err.value.args[0] == "process.placeholder_context"


def test_request_caps_name_the_limit() -> None:
    good = png_bytes(np.random.default_rng(8), 20, 20)
    spec = mm_spec("qwen2_vl", "pil")
    with pytest.raises(_mm.MediaError) as err:
        _mm.process(spec, one_image_prompt(65), [good] * 65, count_only=True)
    assert err.value.args[0] == "request.too_many_items" and "64" in err.value.args[1]
    big = bytes(60 << 20)
    with pytest.raises(_mm.MediaError) as err:
        _mm.process(spec, one_image_prompt(5), [big] * 5, count_only=True)
    assert err.value.args[0] == "request.too_many_bytes"
    assert str(256 << 20) in err.value.args[1] and "item 4" in err.value.args[1]


def test_text_only_prompt() -> None:
    result = _mm.process(mm_spec("qwen3_vl", "pil"), [3, 4, 5], [])
    assert result.input_ids.tolist() == [3, 4, 5] and result.offsets == [] and result.items == []
    assert result.positions is not None and result.positions.tolist() == [[0, 1, 2]] * 3
    assert result.rope_delta == 0


def test_output_is_identical_for_any_pool_size() -> None:
    script = Path(__file__).with_name("pool_digest.py")
    digests = {}
    for threads in ("1", "3"):
        env = dict(os.environ, MMSERVE_MM_THREADS=threads)
        out = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, check=True
        )
        pool, digest = out.stdout.split()
        assert pool == threads
        digests[threads] = digest
    assert digests["1"] == digests["3"] == digest_of_a_request()


GOLDEN = Path(__file__).with_name("golden")


@pytest.mark.parametrize("index", range(6))
def test_golden_fixtures(index: int) -> None:
    """Regression against tests/mm/golden (made from transformers by tests/make_mm_golden.py)."""
    golden = json.loads((GOLDEN / "qwen_vl.json").read_text())
    case = golden["cases"][index]
    images = [(GOLDEN / name).read_bytes() for name in golden["images"]]
    spec = _mm.spec_from_hf_configs(
        json.dumps(case["preprocessor_config"]), json.dumps(case["config"])
    )
    result = _mm.process(spec, case["input_ids"], images)
    assert result.input_ids.tolist() == case["expanded_ids"]
    assert [list(o) for o in result.offsets] == case["offsets"]
    assert result.positions is not None and result.positions.tolist() == case["positions"]
    assert result.rope_delta == case["rope_delta"]
    for item, expected in zip(result.items, case["items"], strict=True):
        assert f"{item.hash:016x}" == expected["hash"]
        assert item.image_grid_thw[0].tolist() == expected["grid_thw"]
        assert item.num_tokens == expected["num_tokens"]
        assert item.pixel_values is not None
        assert list(item.pixel_values.shape) == expected["pixel_values_shape"]
        digest = blake3.blake3(item.pixel_values.astype("<f4").tobytes()).hexdigest()
        assert digest == expected["pixel_values_blake3"]
