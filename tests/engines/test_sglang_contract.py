"""The sglang engine's contract with the real SGLang package, checked on the CPU.

SGLang's GPU kernels cannot run here; its Python modules can. `.ci/setup.sh` installs SGLang
without its CUDA dependencies into `.venv/sglang` (a virtual environment layered over
`.venv`), and the main run re-runs this file with that interpreter, where the tests below
the `else` use `sglang` itself: the request fields, the `processor_output` item, the encoder's
signatures, the pad values, the flag parser and the KV event encoding. The KV event bridge
tests at the top need no SGLang and run in both.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.util
import inspect
import json
import os
import subprocess
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from mmserve import _mm
from mmserve.cli import build_parser
from mmserve.engines.base import (
    GREEDY,
    EngineError,
    EngineOverloaded,
    EngineRequest,
    ItemEmbedding,
    MediaInput,
)
from mmserve.engines.logits import UNLIKELY
from mmserve.engines.sglang.args import GENERATE_FIELDS, RAW_LOGPROBS_ENV, sglang_argv
from mmserve.engines.sglang.checks import PAD_PROBE_HASH
from mmserve.engines.sglang.convert import (
    choice_seed,
    generate_calls,
    generate_kwargs,
    media_item,
    sampling_params,
)
from mmserve.engines.sglang.engine import SglangEngine
from mmserve.engines.sglang.kv_events import SglangKvEventBridge
from mmserve.engines.sglang.outputs import logprob_value, rank_in, top_list
from mmserve.kv.hashing import compute_seq_hashes
from mmserve.kv.pad import PadScheme, pad_values
from mmserve.kv.view import routing_view
from mmserve.models.family import ModelSpec, resolve_model_spec
from mmserve.models.family import model_class as transformers_class
from mmserve.protocol import (
    BootstrapInfo,
    FirstToken,
    Grammar,
    KvCleared,
    KvRemoved,
    KvStored,
    MRopePositions,
    PlannedMedia,
    PrefillDone,
    SamplingParams,
    StopConditions,
    Usage,
    mm_hash_hex,
)
from mmserve.tiny.checkpoints import build_tiny_model
from mmserve.worker.options import load_engine
from tests.engines.test_hf_video import SAMPLING, Item, driver_plan, png
from tests.support.engines import make_image
from tests.support.video import make_video

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = ROOT / ".venv" / "sglang" / "bin" / "python"
HAS_SGLANG = importlib.util.find_spec("sglang") is not None

MM_A = 0xFEDC_BA98_7654_3210
MM_B = 0x0000_0000_1234_5678


def _embeddings() -> list[ItemEmbedding]:
    return [
        ItemEmbedding(MM_A, (1, 4, 4), torch.randn(4, 8)),
        ItemEmbedding(MM_B, (1, 2, 4), torch.randn(2, 8)),
    ]


def _request() -> EngineRequest:
    """A planned prompt whose two runs take `_embeddings()` (4 and 2 rows) in order."""
    return EngineRequest(
        "req-1",
        (1, 2, 3, *([9] * 6), 4),
        SamplingParams(temperature=0.0, top_k=5, seed=7),
        StopConditions(max_tokens=8, stop=["\n"], stop_token_ids=[2]),
        media=(
            PlannedMedia(mm_hash=MM_A, offset=3, length=4, grid_thw=(1, 4, 4)),
            PlannedMedia(mm_hash=MM_B, offset=7, length=2, grid_thw=(1, 2, 4)),
        ),
    )


VIDEO_TOKEN = 151656
IMAGE_TOKEN = VIDEO_TOKEN - 1
VISION_START, VISION_END = 151652, 151653


def _video_request(num_images: int = 1) -> tuple[EngineRequest, list[ItemEmbedding]]:
    """A planned prompt with `num_images` images of grid (1, 4, 4) and, after the first, a
    video of grid (2, 4, 6) (4 and 12 rows), Qwen2.5-VL's positions (the video's temporal
    patches 0.8 s apart at 2 tokens per second), and embeddings for its items in order."""
    ids: list[int] = [1, 2]
    media, embeddings, blocks = [], [], []
    kinds = ["image"] * min(num_images, 1) + ["video"] + ["image"] * max(num_images - 1, 0)
    for index, kind in enumerate(kinds):
        grid = (1, 4, 4) if kind == "image" else (2, 4, 6)
        length = grid[0] * grid[1] * grid[2] // 4
        ids.append(VISION_START)
        mm_hash = MM_A + index if kind == "image" else MM_B
        planned = PlannedMedia(
            modality=kind, mm_hash=mm_hash, offset=len(ids), length=length, grid_thw=grid
        )
        media.append(planned)
        embeddings.append(ItemEmbedding(mm_hash, grid, torch.randn(length, 8)))
        blocks.append((planned.offset, planned.end, grid, 1.0 if kind == "image" else 1.6))
        ids += [IMAGE_TOKEN if kind == "image" else VIDEO_TOKEN] * length
        ids += [VISION_END, 3 + index]
    rows, delta = _mm.mrope_positions(len(ids), blocks, 2)
    positions = MRopePositions(rows=rows.reshape(-1).tolist(), delta=delta)
    request = EngineRequest(
        "req-v", tuple(ids), GREEDY, StopConditions(), media=tuple(media), positions=positions
    )
    return request, embeddings


def _stored_event(tokens: list[int], hashes: list[int], parent: int | None) -> dict[str, object]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 4,
        "lora_id": None,
    }


@pytest.mark.parametrize("scheme", list(PadScheme))
def test_bridge_hashes_blocks_as_the_router_does(scheme: PadScheme) -> None:
    """SGLang's token ids (media runs = its pad values) become the router's block hashes."""
    prompt = [5, 6, 7, *([9] * 6), 8, 11, 12]  # one image of 6 tokens at offset 3
    image = PlannedMedia(mm_hash=MM_A, offset=3, length=6, grid_thw=(1, 4, 6))
    view = routing_view(prompt, [image], scheme=scheme)
    engine_tokens = list(prompt)
    engine_tokens[3:9] = np.resize(np.array(pad_values(MM_A, scheme), dtype=object), 6).tolist()
    bridge = SglangKvEventBridge(4, scheme)
    bridge.remember([MM_A])
    first = bridge.translate(_stored_event(engine_tokens[:8], [101, 102], None))
    second = bridge.translate(_stored_event(engine_tokens[8:12], [103], 102))
    local = view.block_hashes(4)
    seq = compute_seq_hashes(local)
    assert isinstance(first, KvStored) and isinstance(second, KvStored)
    assert [b.tokens_hash for b in first.blocks + second.blocks] == local
    assert [b.block_hash for b in first.blocks + second.blocks] == seq
    assert first.parent_hash is None and second.parent_hash == seq[1]
    assert bridge.snapshot() == [
        (seq[0], None, local[0]),
        (seq[1], seq[0], local[1]),
        (seq[2], seq[1], local[2]),
    ]


def test_bridge_lora_and_tiers() -> None:
    """A LoRA adapter's name enters the hash as the router's does; host-tier copies are not
    the GPU cache the router counts."""
    tokens = list(range(8))
    bridge = SglangKvEventBridge(4, PadScheme.DYNAMO)
    stored = bridge.translate({**_stored_event(tokens, [1, 2], None), "lora_name": "ad"})
    assert isinstance(stored, KvStored)
    expected = routing_view(tokens, []).block_hashes(4, "ad")
    assert [b.tokens_hash for b in stored.blocks] == expected
    host = {**_stored_event(tokens, [3, 4], None), "medium": "CPU_PINNED"}
    assert bridge.translate(host) is None
    assert bridge.translate({"type": "BlockRemoved", "block_hashes": [1], "medium": "DISK"}) is None
    assert len(bridge.snapshot()) == 2


def test_bridge_without_the_item_misses_the_media_hash() -> None:
    """An item the engine never sent cannot be attached: the hash differs (so routing on it
    is a miss, never a false hit)."""
    tokens = [5, *pad_values(MM_A)] * 2
    known, unknown = (
        SglangKvEventBridge(4, PadScheme.DYNAMO),
        SglangKvEventBridge(4, PadScheme.DYNAMO),
    )
    known.remember([MM_A])
    a = known.translate(_stored_event(tokens, [1], None))
    b = unknown.translate(_stored_event(tokens, [1], None))
    assert isinstance(a, KvStored) and isinstance(b, KvStored)
    assert a.blocks[0].tokens_hash != b.blocks[0].tokens_hash


def test_bridge_removed_cleared_and_block_size() -> None:
    bridge = SglangKvEventBridge(4, PadScheme.DYNAMO)
    stored = bridge.translate(_stored_event([1, 2, 3, 4, 5, 6, 7, 8], [11, 12], None))
    assert isinstance(stored, KvStored)
    removed = bridge.translate({"type": "BlockRemoved", "block_hashes": [12, 99]})
    assert removed == KvRemoved(block_hashes=[stored.blocks[1].block_hash])
    assert bridge.translate({"type": "BlockRemoved", "block_hashes": [99]}) is None
    assert bridge.translate({"type": "AllBlocksCleared"}) == KvCleared()
    assert bridge.snapshot() == []
    with pytest.raises(ValueError, match="--block-size 16"):
        bridge.translate({**_stored_event([1] * 16, [5], None), "block_size": 16})


def test_request_the_adapter_builds() -> None:
    kwargs = generate_kwargs(
        _request(), _embeddings(), BootstrapInfo(host="10.0.0.1", port=8998, room=42)
    )
    logprob_fields = {
        "return_logprob",
        "top_logprobs_num",
        "logprob_start_len",
        "token_ids_logprob",
    }
    assert (
        set(kwargs)
        == set(GENERATE_FIELDS) - {"video_data", "audio_data", "require_reasoning"} - logprob_fields
    )
    scored = replace(
        _request(), sampling=msgspec.structs.replace(GREEDY, logprobs=1, prompt_logprobs=1)
    )
    assert set(generate_kwargs(scored, _embeddings(), None)) >= logprob_fields
    assert kwargs["mm_hashes"] == ["fedcba9876543210", "0000000012345678"]
    assert [int(h, 16) for h in kwargs["mm_hashes"]] == [MM_A, MM_B]
    (item,) = kwargs["image_data"]
    assert item["precomputed_embeddings"].shape == (6, 8)
    assert item["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 4]]
    assert kwargs["sampling_params"]["max_new_tokens"] == 8
    assert kwargs["sampling_params"]["stop"] == ["\n"]
    assert "image_data" not in generate_kwargs(replace(_request(), media=()), [], None)
    bundled = generate_kwargs(_request(), _embeddings(), None, splits_images=False)
    assert "mm_hashes" not in bundled and "image_data" in bundled
    one = replace(_request(), media=_request().media[:1])
    single = generate_kwargs(one, _embeddings()[:1], None, splits_images=False)
    assert single["mm_hashes"] == ["fedcba9876543210"]


AUDIO_BOS, AUDIO_TOKEN, AUDIO_EOS = 151647, 151646, 151648  # Qwen2-Audio's


def _audio_request(frames: tuple[int, ...]) -> tuple[EngineRequest, list[ItemEmbedding]]:
    """A planned Qwen2-Audio prompt with one clip per entry of `frames` (its valid log-mel
    frames; its run is the processor's token count for them), and the clips' embeddings."""
    ids: list[int] = [1, 2]
    media, embeddings = [], []
    for index, valid in enumerate(frames):
        length = (((valid - 1) // 2 + 1) - 2) // 2 + 1
        grid = (1, 1, valid)
        ids.append(AUDIO_BOS)
        planned = PlannedMedia(
            modality="audio", mm_hash=MM_A + index, offset=len(ids), length=length, grid_thw=grid
        )
        media.append(planned)
        embeddings.append(ItemEmbedding(planned.mm_hash, grid, torch.randn(length, 8)))
        ids += [AUDIO_TOKEN] * length + [AUDIO_EOS, 3 + index]
    request = EngineRequest("req-a", tuple(ids), GREEDY, StopConditions(), media=tuple(media))
    return request, embeddings


def test_clips_go_in_audio_data_with_their_frame_masks_and_the_plans_ids() -> None:
    request, embeddings = _audio_request((20, 12))
    kwargs = generate_kwargs(request, embeddings, None)
    (item,) = kwargs["audio_data"]
    assert "image_data" not in kwargs and "video_data" not in kwargs
    assert item["modality"] == "AUDIO" and item["format"] == "processor_output"
    assert torch.equal(
        item["precomputed_embeddings"], torch.cat([e.embeddings for e in embeddings])
    )
    assert item["feature_attention_mask"].sum(dim=1).tolist() == [20, 12]
    assert item["input_ids"].tolist() == list(request.token_ids)
    # One bundle of two clips is one SGLang item: per-clip hashes cannot apply.
    assert "mm_hashes" not in kwargs
    one, first = _audio_request((20,))
    assert generate_kwargs(one, first, None)["mm_hashes"] == [mm_hash_hex(MM_A)]


def test_a_video_goes_in_video_data_with_the_plans_positions() -> None:
    request, embeddings = _video_request()
    kwargs = generate_kwargs(request, embeddings, None, splits_images=False)
    (image,), (video,) = kwargs["image_data"], kwargs["video_data"]
    assert (image["modality"], video["modality"]) == ("IMAGE", "VIDEO")
    assert video["video_grid_thw"].tolist() == [[2, 4, 6]]
    assert torch.equal(video["precomputed_embeddings"], embeddings[1].embeddings)
    # The positions ride on the first item, the one SGLang reads them from.
    assert request.positions is not None
    assert image["mrope_positions"].reshape(-1).tolist() == request.positions.rows
    assert image["mrope_position_delta"].tolist() == [request.positions.delta]
    assert "mrope_positions" not in video
    # SGLang's order: the images' item, then the video's.
    assert kwargs["mm_hashes"] == [mm_hash_hex(MM_A), mm_hash_hex(MM_B)]
    alone, _ = _video_request(num_images=0)
    (only,) = generate_kwargs(alone, embeddings[1:], None)["video_data"]
    assert "image_data" not in generate_kwargs(alone, embeddings[1:], None)
    assert only["mrope_positions"].shape == (3, len(alone.token_ids))
    # Two images stay one bundled item where SGLang does not split them: no per-item hashes.
    two, two_embeddings = _video_request(num_images=2)
    assert "mm_hashes" not in generate_kwargs(two, two_embeddings, None, splits_images=False)
    split = generate_kwargs(two, two_embeddings, None, splits_images=True)
    assert split["mm_hashes"] == [mm_hash_hex(h) for h in (MM_A, MM_A + 2, MM_B)]
    # Images alone keep SGLang's own positions, as before.
    assert (
        "mrope_positions" not in generate_kwargs(_request(), _embeddings(), None)["image_data"][0]
    )


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe", "qwen3_5"])
def grouped_video(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ModelSpec, EngineRequest]:
    """The driver's plan of a prompt with an image, a Qwen3-VL video (one item per temporal
    group, its timestamp text between them) and another image, over a tiny checkpoint of a
    family that plans videos so."""
    spec = resolve_model_spec(build_tiny_model(request.param))
    video = make_video(tmp_path_factory.mktemp("video") / "v.mp4", size="100x60", seconds=1.6)
    images = [Item(png(make_image(56 + 32 * i, 96 - 32 * i, seed=i))) for i in range(2)]
    plan, _ = driver_plan(spec, [images[0], Item(video, SAMPLING), images[1]])
    return spec, EngineRequest.from_plan("req-groups", plan, stop=StopConditions())


def _deepstack_embeddings(spec: ModelSpec, request: EngineRequest) -> list[ItemEmbedding]:
    """Random rows for each planned item, with the family's deepstack features beside them."""
    hidden = 8
    return [
        ItemEmbedding(
            m.mm_hash,
            m.grid_thw,
            torch.randn(m.length, hidden),
            tuple(torch.randn(m.length, hidden) for _ in range(spec.deepstack_layers)),
        )
        for m in request.media
    ]


def test_a_video_planned_per_temporal_group_goes_as_its_groups_in_order(
    grouped_video: tuple[ModelSpec, EngineRequest],
) -> None:
    """Qwen3-VL's video goes as its groups' rows, in order and with their `(1, h, w)` grids,
    in the one video item; the positions ride on the images' item; no `mm_hashes`, since
    SGLang keeps the groups one item."""
    spec, request = grouped_video
    groups = [m for m in request.media if m.modality == "video"]
    assert len(groups) > 1 and all(g.temporal_group is not None for g in groups)
    embeddings = _deepstack_embeddings(spec, request)
    kwargs = generate_kwargs(request, embeddings, None, splits_images=True)
    (video,) = kwargs["video_data"]
    in_video = [e for m, e in zip(request.media, embeddings, strict=True) if m in groups]
    expected = torch.cat([torch.cat([e.embeddings, *e.deepstack], dim=1) for e in in_video])
    assert torch.equal(video["precomputed_embeddings"], expected)
    assert video["video_grid_thw"].tolist() == [list(g.grid_thw) for g in groups]
    assert request.positions is not None
    assert kwargs["image_data"][0]["mrope_positions"].reshape(-1).tolist() == (
        request.positions.rows
    )
    assert "mm_hashes" not in kwargs


def test_stop_rules_the_adapter_maps() -> None:
    """ignore_eos and min_tokens go to SGLang under its names (vLLM's min_tokens is SGLang's
    min_new_tokens: EOS and stop ids are masked until then)."""
    stop = StopConditions(
        max_tokens=8, stop=["\n"], stop_token_ids=[2], ignore_eos=True, min_tokens=3
    )
    params = sampling_params(GREEDY, stop)
    assert params["max_new_tokens"] == 8 and params["min_new_tokens"] == 3
    assert params["ignore_eos"] is True and params["stop_token_ids"] == [2]
    defaults = sampling_params(GREEDY, StopConditions(max_tokens=4))
    assert defaults["min_new_tokens"] == 0 and defaults["ignore_eos"] is False


STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}
STRUCTURED = [
    (Grammar(kind="json_schema", spec=json.dumps(STRUCTURED_SCHEMA)), '{"name": "ab", "n": 3}'),
    (Grammar(kind="json_object"), '{"a": [1, true]}'),
    (Grammar(kind="choice", spec='["yes", "no"]'), "no"),
    (Grammar(kind="ebnf", spec='root ::= "(" [0-9]+ ")"'), "(42)"),
    (Grammar(kind="ebnf", spec='start: "<" /[a-z]+/ ">"'), "<ok>"),
    (Grammar(kind="regex", spec=r"[a-z]+-\d{2}"), "abc-12"),
]


@pytest.mark.parametrize(("grammar", "text"), STRUCTURED)
def test_a_grammar_goes_as_sglangs_own_parameter(grammar: Grammar, text: str) -> None:
    """A regex as SGLang's `regex`; the rest as `ebnf`, the grammar mmserve compiles (JSON
    compact, as asked); a grammar after a reasoning section asks for `require_reasoning`."""
    params = sampling_params(SamplingParams(grammar=grammar), StopConditions(max_tokens=4))
    (key,) = {"regex", "ebnf", "json_schema"} & set(params)
    assert key == ("regex" if grammar.kind == "regex" else "ebnf")
    reasoning = msgspec.structs.replace(grammar, start_after=151668)
    request = replace(_request(), sampling=SamplingParams(grammar=reasoning))
    assert generate_kwargs(request, _embeddings(), None)["require_reasoning"] is True
    assert "require_reasoning" not in generate_kwargs(_request(), _embeddings(), None)


def test_role_flags_unless_given() -> None:
    assert sglang_argv(Path("/m"), "decode", ["--", "--tp", "2"]) == [
        "--model-path",
        "/m",
        "--disaggregation-mode",
        "decode",
        "--disaggregation-transfer-backend",
        "nixl",
        "--tp",
        "2",
    ]
    given = ["--disaggregation-transfer-backend=mooncake", "--disaggregation-mode", "decode"]
    assert sglang_argv(Path("/m"), "prefill", given)[2:] == given
    assert sglang_argv(Path("/m"), "encode", [])[2:] == ["--encoder-only"]
    assert sglang_argv(Path("/m"), "worker", []) == ["--model-path", "/m"]


class FakeTokenizerManager:
    """SGLang's tokenizer manager as far as `flush_cache` (it refuses while busy) and
    `abort_request` go."""

    def __init__(self) -> None:
        self.busy = False
        self.flushes = 0
        self.aborted: list[str] = []

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborted.append(rid)

    async def flush_cache(self) -> argparse.Namespace:
        if self.busy:
            return argparse.Namespace(success=False, message="")
        self.flushes += 1
        return argparse.Namespace(success=True, message="")


class FakeSglangEngine:
    """Stands in for the GPU-only `sglang.Engine`: records each `async_generate` call and
    streams cumulative outputs, as SGLang does by default."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.calls: list[dict[str, object]] = []
        self.shut_down = False
        self.tokenizer_manager = FakeTokenizerManager()

    def shutdown(self) -> None:
        self.shut_down = True

    async def async_generate(self, **kwargs: object) -> AsyncIterator[dict[str, object]]:
        self.calls.append(kwargs)
        return self._stream()

    async def _stream(self) -> AsyncIterator[dict[str, object]]:
        for n in range(1, len(self.tokens) + 1):
            done = n == len(self.tokens)
            yield {
                "output_ids": self.tokens[:n],
                "text": "".join(f"<{t}>" for t in self.tokens[:n]),
                "meta_info": {
                    "finish_reason": {"type": "length"} if done else None,
                    "prompt_tokens": 10,
                    "completion_tokens": n,
                    "cached_tokens": 3,
                },
            }


def _engine(mode: str, fake: FakeSglangEngine) -> SglangEngine:
    args = argparse.Namespace(
        disaggregation_mode=mode,
        incremental_streaming_output=False,
        host="10.0.0.1",
        disaggregation_bootstrap_port=8998,
        kv_events_config=None,
    )
    engine = SglangEngine(args, block_size=16, max_queue=4, pad_scheme=PadScheme.DYNAMO)
    engine._llm = fake
    return engine


async def test_a_stream_left_before_its_end_aborts_sglangs_request() -> None:
    """SGLang generates an engine request to its end unless asked to abort it; a stream
    read to its end aborts nothing."""
    fake = FakeSglangEngine([5, 6, 7])
    engine = _engine("null", fake)
    async with contextlib.aclosing(engine._stream(_request(), _embeddings(), None)) as chunks:
        assert (await anext(chunks)).token_ids == [5]
    assert fake.tokenizer_manager.aborted == [fake.calls[0]["rid"]]
    assert [c.token_ids async for c in engine.generate(_request(), _embeddings())][-1] == [7]
    assert len(fake.tokenizer_manager.aborted) == 1


async def test_stream_sends_each_token_once_and_the_usage_last() -> None:
    fake = FakeSglangEngine([5, 6, 7])
    chunks = [c async for c in _engine("null", fake).generate(_request(), _embeddings())]
    assert [c.token_ids for c in chunks] == [[5], [6], [7]]
    assert "".join(c.text for c in chunks) == "<5><6><7>"
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].usage == Usage(prompt_tokens=10, completion_tokens=3, cached_tokens=3)
    assert fake.calls[0]["mm_hashes"] == [mm_hash_hex(MM_A), mm_hash_hex(MM_B)]
    assert "bootstrap_room" not in fake.calls[0]


async def test_prefill_hands_decode_its_bootstrap_room() -> None:
    """P/D: prefill's bootstrap info names its room, and decode's request joins it with the
    same prompt, images and mm_hashes (those travel as transfer-layer tensors)."""
    prefill_fake, decode_fake = FakeSglangEngine([1]), FakeSglangEngine([8, 9])
    prefill, decode = _engine("prefill", prefill_fake), _engine("decode", decode_fake)
    assert decode.bootstrap_info() is None
    bootstrap = prefill.bootstrap_info()
    assert bootstrap is not None and (bootstrap.host, bootstrap.port) == ("10.0.0.1", 8998)
    embeddings = _embeddings()
    kv = await prefill.prefill(_request(), embeddings, bootstrap)
    tensors = await prefill.export_kv(kv)
    # The embeddings alone: decode's own request holds the prompt, its items and positions.
    assert set(tensors) == {"embeddings"}
    prefill.release(kv)
    with pytest.raises(EngineError, match="bootstrap room"):
        await decode.import_kv(_request(), kv.prefill_done(), tensors)
    with pytest.raises(EngineError, match="embedding rows"):
        await decode.import_kv(_request(), kv.prefill_done(), {}, bootstrap)
    imported = await decode.import_kv(_request(), kv.prefill_done(), tensors, bootstrap)
    chunks = [c async for c in decode.decode(imported, GREEDY, StopConditions(max_tokens=2))]
    assert [c.token_ids for c in chunks] == [[8], [9]]
    await asyncio.sleep(0)  # the prefill request drains in the background
    sent, joined = prefill_fake.calls[0], decode_fake.calls[0]
    assert sent["bootstrap_host"] == joined["bootstrap_host"] == "10.0.0.1"
    assert sent["bootstrap_port"] == joined["bootstrap_port"] == 8998
    assert sent["bootstrap_room"] == joined["bootstrap_room"] == bootstrap.room
    assert sent["input_ids"] == joined["input_ids"]
    assert sent["mm_hashes"] == joined["mm_hashes"] == [mm_hash_hex(MM_A), mm_hash_hex(MM_B)]
    for name in ("precomputed_embeddings", "image_grid_thw"):
        assert torch.equal(sent["image_data"][0][name], joined["image_data"][0][name])
    with pytest.raises(EngineError):
        await decode.export_kv(imported)
    await prefill.close()
    assert prefill_fake.shut_down


async def test_decode_joins_with_the_same_video_items_and_positions() -> None:
    """P/D with a video: decode's request carries the prefill request's video item and plan
    positions, from decode's own request beside the exported embeddings."""
    prefill_fake, decode_fake = FakeSglangEngine([1]), FakeSglangEngine([8])
    prefill, decode = _engine("prefill", prefill_fake), _engine("decode", decode_fake)
    request, embeddings = _video_request()
    bootstrap = prefill.bootstrap_info()
    kv = await prefill.prefill(request, embeddings, bootstrap)
    tensors = await prefill.export_kv(kv)
    imported = await decode.import_kv(request, kv.prefill_done(), tensors, bootstrap)
    chunks = [c async for c in decode.decode(imported, GREEDY, StopConditions(max_tokens=1))]
    assert [c.token_ids for c in chunks] == [[8]]
    await asyncio.sleep(0)
    sent, joined = prefill_fake.calls[0], decode_fake.calls[0]
    assert sent["mm_hashes"] == joined["mm_hashes"]
    for field in ("image_data", "video_data"):
        for name, value in sent[field][0].items():
            other = joined[field][0][name]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
    assert set(sent[field][0]) == set(joined[field][0])


async def test_decode_joins_with_a_grouped_videos_items_deepstack_included(
    grouped_video: tuple[ModelSpec, EngineRequest],
) -> None:
    """P/D with a Qwen3-VL video planned per temporal group: decode's request carries the
    same items as prefill's, each row's deepstack features included, so SGLang hashes and
    pads them alike on both sides."""
    spec, request = grouped_video
    embeddings = _deepstack_embeddings(spec, request)
    prefill_fake, decode_fake = FakeSglangEngine([1]), FakeSglangEngine([8])
    prefill, decode = _engine("prefill", prefill_fake), _engine("decode", decode_fake)
    bootstrap = prefill.bootstrap_info()
    kv = await prefill.prefill(request, embeddings, bootstrap)
    tensors = await prefill.export_kv(kv)
    imported = await decode.import_kv(request, kv.prefill_done(), tensors, bootstrap)
    assert [c async for c in decode.decode(imported, GREEDY, StopConditions(max_tokens=1))]
    sent, joined = prefill_fake.calls[0], decode_fake.calls[0]
    assert set(sent) == set(joined) and "mm_hashes" not in sent
    for field in ("image_data", "video_data"):
        assert set(sent[field][0]) == set(joined[field][0])
        for name, value in sent[field][0].items():
            other = joined[field][0][name]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other


async def test_clear_caches_flushes_sglang_and_refuses_while_busy() -> None:
    fake = FakeSglangEngine([1])
    engine = _engine("null", fake)
    assert engine.bridge.translate({**_stored_event(list(range(16)), [7], None), "block_size": 16})
    cleared = await engine.clear_caches()
    assert (cleared.prefix_blocks, fake.tokenizer_manager.flushes) == (1, 1)
    fake.tokenizer_manager.busy = True
    with pytest.raises(EngineOverloaded, match="requests are running or waiting"):
        await engine.clear_caches()
    encoder = _engine("null", fake)
    encoder._llm = None  # --encoder-only: nothing cached
    assert (await encoder.clear_caches()).prefix_blocks == 0


async def test_sglang_flags_need_the_sglang_engine() -> None:
    args = build_parser().parse_args(["worker", "--engine", "hf", "--", "--tp", "2"])
    with pytest.raises(SystemExit, match="without --engine sglang"):
        await load_engine(args, Path("/m"))


if not HAS_SGLANG:

    async def test_worker_without_sglang_says_how_to_install_it() -> None:
        args = build_parser().parse_args(["prefill", "--engine", "sglang", "--", "--tp", "2"])
        with pytest.raises(SystemExit, match=r"pip install -e '\.\[sglang\]'"):
            await load_engine(args, Path("/m"))

    @pytest.mark.timeout(900)
    def test_contracts_in_the_sglang_environment() -> None:
        """Run this file where SGLang is installed (made by .ci/setup.sh)."""
        assert SGLANG_PYTHON.exists(), f"{SGLANG_PYTHON} is missing: run bash .ci/setup.sh"
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        result = subprocess.run(
            [
                str(SGLANG_PYTHON),
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-W",
                "ignore",
                "-o",
                "timeout=600",
                __file__,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
        )
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
        assert " passed" in result.stdout and "skipped" not in result.stdout

else:
    import dataclasses
    import types
    from array import array
    from typing import Any

    import msgspec
    import sglang
    from sglang.srt.disaggregation.kv_events import (
        BlockRemoved,
        BlockStored,
        EventPublisherFactory,
        KVEventBatch,
        KVEventsConfig,
        StorageMedium,
    )
    from sglang.srt.entrypoints.engine import Engine as SglEngine
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem
    from sglang.srt.multimodal.processors.base_processor import (
        BaseMultimodalProcessor,
        MultimodalInputFormat,
    )

    from mmserve.engines.sglang.args import kv_events_config, parse_sglang_args
    from mmserve.engines.sglang.checks import (
        SglangStartupError,
        check_sglang,
        check_sglang_padding,
        sglang_pad_values,
        sglang_padded_probe,
        sglang_splits_images,
    )
    from mmserve.engines.sglang.convert import encoder_item
    from mmserve.tiny.checkpoints import TINY_FAMILIES

    def installed_scheme() -> PadScheme:
        """The scheme of the installed release: 0.5.1x pads with one value, 0.5.2x with four."""
        minor = int(sglang.__version__.split(".")[2].split("post")[0].rstrip("."))
        return PadScheme.SGLANG_WIDE if minor >= 20 else PadScheme.DYNAMO

    def test_generate_req_input_takes_every_field_sent() -> None:
        fields = {f.name for f in dataclasses.fields(GenerateReqInput)}
        params = set(inspect.signature(SglEngine.async_generate).parameters)
        assert set(GENERATE_FIELDS) <= fields & params
        bootstrap = BootstrapInfo(host="10.0.0.1", port=8998, room=42)
        kwargs = generate_kwargs(_request(), _embeddings(), bootstrap)
        obj = GenerateReqInput(**kwargs)
        obj.normalize_batch_and_arguments()
        assert obj.mm_hashes == ["fedcba9876543210", "0000000012345678"]
        assert obj.bootstrap_room == 42 and obj.rid == "req-1"

    def test_sampling_params_read_as_sglang_takes_them() -> None:
        from sglang.srt.sampling.sampling_params import SamplingParams as SglSamplingParams

        stop = StopConditions(max_tokens=8, stop=["\n"], ignore_eos=True, min_tokens=3)
        sampling = SamplingParams(temperature=0.5, top_k=5, seed=7)
        params = SglSamplingParams(**sampling_params(sampling, stop))
        params.verify(vocab_size=1000)
        assert (params.max_new_tokens, params.min_new_tokens, params.ignore_eos) == (8, 3, True)
        over = StopConditions(max_tokens=2, min_tokens=3)
        with pytest.raises(ValueError, match="min_new_tokens"):
            SglSamplingParams(**sampling_params(sampling, over)).verify(vocab_size=1000)

    @functools.cache
    def sglang_grammar_backend() -> tuple[Any, Any, list[int]]:
        """SGLang's xgrammar backend over the tiny Qwen2-VL's tokenizer (read once)."""
        from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend
        from transformers import AutoTokenizer

        model = build_tiny_model("qwen2_vl")
        tokenizer = AutoTokenizer.from_pretrained(model)
        eos = list(resolve_model_spec(model).eos_token_ids)
        return XGrammarGrammarBackend(tokenizer, 151936, model_eos_token_ids=eos), tokenizer, eos

    @pytest.mark.parametrize(("grammar", "text"), STRUCTURED)
    def test_sglangs_grammar_backend_compiles_the_grammar_sent(grammar: Grammar, text: str) -> None:
        """SGLang's request checks take the parameter, and its own xgrammar backend compiles
        it into a grammar that accepts a text mmserve's accepts, to its end, and refuses
        another start."""
        from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject
        from sglang.srt.sampling.sampling_params import SamplingParams as SglSamplingParams

        params = sampling_params(SamplingParams(grammar=grammar), StopConditions(max_tokens=4))
        sgl = SglSamplingParams(**params)
        sgl.normalize(None)
        sgl.verify(vocab_size=151936)
        backend, tokenizer, eos = sglang_grammar_backend()
        key, value = ("regex", params["regex"]) if "regex" in params else ("ebnf", params["ebnf"])
        matcher = getattr(backend, f"dispatch_{key}")(value)
        assert not isinstance(matcher, InvalidGrammarObject), matcher
        other = matcher.copy()
        for token in tokenizer.encode(text):
            matcher.accept_token(token)
        matcher.accept_token(eos[0])
        assert matcher.is_terminated()
        with pytest.raises(Exception):  # noqa: B017 - SGLang's matcher raises its own
            other.accept_token(tokenizer.encode("~")[0])

    def test_processor_output_item_reads_as_one_image_item() -> None:
        """`collect_mm_items_from_processor_output` (SGLang's reader of processor_output
        dicts) makes one IMAGE item holding our embeddings and grids. The item names its
        modality, so the processor's attribute-to-modality table is not consulted."""
        item = media_item("image", _embeddings())
        fmt = BaseMultimodalProcessor._get_preprocessed_input_format(item)
        assert fmt is MultimodalInputFormat.PROCESSOR_OUTPUT
        BaseMultimodalProcessor.validate_mm_data(image_data=[item])
        with pytest.raises(ValueError, match="exactly one item"):
            BaseMultimodalProcessor.validate_mm_data(image_data=[item, item])
        tables = type("Tables", (), {"ATTR_NAME_TO_MODALITY": {}, "FEATURE_NAMES": []})()
        (collected,) = BaseMultimodalProcessor.collect_mm_items_from_processor_output(tables, item)
        assert collected.modality is Modality.IMAGE
        assert collected.precomputed_embeddings is item["precomputed_embeddings"]
        assert collected.image_grid_thw.tolist() == [[1, 4, 4], [1, 2, 4]]

    def test_multi_image_items_stay_bundled() -> None:
        """SGLang 0.5.23 splits a bundled image item by patch counts, which embeddings do not
        have: the engine must not count on per-image mm_hashes there (a release that splits
        fails this test, and the engine then sends them)."""
        assert sglang_splits_images() is False

    def test_mm_hashes_set_the_items_hash() -> None:
        """The tokenizer manager parses each mm_hashes entry with int(h, 16) into set_hash."""
        item = MultimodalDataItem(modality=Modality.IMAGE)
        item.set_hash(int(mm_hash_hex(MM_A), 16))
        assert item.hash == MM_A

    @pytest.mark.parametrize("mm_hash", [0, 1, MM_A, MM_B, PAD_PROBE_HASH, (1 << 64) - 1])
    def test_pad_values_agree_with_sglang(mm_hash: int) -> None:
        item = MultimodalDataItem(modality=Modality.IMAGE)
        ours = pad_values(mm_hash, installed_scheme())
        assert sglang_pad_values(item, mm_hash) == ours
        assert item.pad_value == ours[0]
        assert item.padding_sequence(10) == np.resize(np.array(ours, dtype=object), 10).tolist()

    def test_start_up_check_names_the_matching_scheme() -> None:
        assert check_sglang(installed_scheme()) == sglang.__version__
        (other,) = [s for s in PadScheme if s is not installed_scheme()]
        with pytest.raises(SglangStartupError, match=f"--pad-scheme {installed_scheme().value}"):
            check_sglang(other)

    def test_encoder_signatures_and_item() -> None:
        from sglang.srt.disaggregation.encoder.server import MMEncoder
        from sglang.srt.runtime_context import publish
        from sglang.srt.utils.network import get_local_ip_auto

        assert isinstance(get_local_ip_auto(), str)

        init = inspect.signature(MMEncoder.__init__).parameters
        assert list(init)[:2] == ["self", "server_args"] and "dist_init_method" in init
        assert {"server_args", "role"} <= set(inspect.signature(publish).parameters)
        pixels = torch.randn(16, 1176)
        mm_item = encoder_item(MediaInput(MM_A, pixels, (1, 4, 4)))
        assert mm_item.modality is Modality.IMAGE and mm_item.feature is pixels
        assert mm_item.image_grid_thw.tolist() == [[1, 4, 4]]

    def test_sglang_parses_the_passed_flags() -> None:
        argv = ["--tp", "2", "--mem-fraction-static", "0.4", "--page-size", "16"]
        argv += ["--disaggregation-transfer-backend", "nixl"]
        args = parse_sglang_args(sglang_argv(Path("/m"), "prefill", argv))
        assert (args.model_path, args.tp_size, args.page_size) == ("/m", 2, 16)
        assert args.mem_fraction_static == 0.4
        assert (args.disaggregation_mode, args.disaggregation_transfer_backend) == (
            "prefill",
            "nixl",
        )
        assert isinstance(args.disaggregation_bootstrap_port, int) and args.host
        assert args.kv_events_config is None and not args.encoder_only
        assert args.incremental_streaming_output is False
        assert parse_sglang_args(sglang_argv(Path("/m"), "encode", [])).encoder_only
        assert parse_sglang_args(sglang_argv(Path("/m"), "worker", [])).page_size is None

    async def test_a_page_size_other_than_the_block_size_stops_the_worker() -> None:
        with pytest.raises(SglangStartupError, match="--page-size 32 differs"):
            await SglangEngine.load(
                Path("/m"),
                role="worker",
                sglang_args=["--", "--page-size", "32"],
                block_size=16,
                pad_scheme=installed_scheme(),
            )

    def test_abort_request_takes_the_rid_and_is_called_without_awaiting() -> None:
        """What `SglangEngine._stream` calls on a stream its caller left."""
        from sglang.srt.managers.tokenizer_manager import TokenizerManager

        assert not inspect.iscoroutinefunction(TokenizerManager.abort_request)
        params = inspect.signature(TokenizerManager.abort_request).parameters
        assert "rid" in params and params["rid"].default == ""

    def test_flush_cache_is_the_tokenizer_managers_coroutine() -> None:
        """What `SglangEngine.clear_caches` awaits: `Engine.flush_cache` wraps it, it answers
        `FlushCacheReqOutput(success, message)` and takes no required argument."""
        from sglang.srt.managers.io_struct import FlushCacheReqOutput
        from sglang.srt.managers.tokenizer_manager import TokenizerManager

        assert callable(SglEngine.flush_cache)
        assert inspect.iscoroutinefunction(TokenizerManager.flush_cache)
        params = list(inspect.signature(TokenizerManager.flush_cache).parameters.values())[1:]
        assert all(param.default is not inspect.Parameter.empty for param in params)
        output = FlushCacheReqOutput(success=False)
        assert (output.success, output.message) == (False, "")

    def test_default_kv_events_config_is_a_zmq_publisher() -> None:
        config = KVEventsConfig.from_cli(kv_events_config(5999))
        assert config.publisher in EventPublisherFactory._registry
        assert (config.publisher, config.endpoint, config.bind) == (
            "zmq",
            "tcp://127.0.0.1:5999",
            True,
        )

    def test_bridge_reads_sglang_encoded_batches() -> None:
        batch = KVEventBatch(
            ts=1.0,
            events=[
                BlockStored(
                    block_hashes=[7, 8],
                    parent_block_hash=None,
                    token_ids=list(range(8)),
                    block_size=4,
                    lora_id=None,
                    medium=StorageMedium.GPU.value,
                ),
                BlockRemoved(block_hashes=[8]),
            ],
        )
        payload = msgspec.msgpack.Encoder().encode(batch)  # as ZmqEventPublisher packs it
        stored, removed = SglangKvEventBridge(4, PadScheme.DYNAMO).translate_payload(payload)
        assert isinstance(stored, KvStored) and len(stored.blocks) == 2
        assert removed == KvRemoved(block_hashes=[stored.blocks[1].block_hash])

    @functools.cache
    def sglang_processor(family: str) -> Any:
        """SGLang's own multimodal processor over a tiny checkpoint of `family` (Qwen-VL's, or
        Qwen2-Audio's), as its tokenizer manager makes it (on the CPU)."""
        from sglang.srt.multimodal.processors.qwen_audio import Qwen2AudioMultimodalProcessor
        from sglang.srt.multimodal.processors.qwen_vl import QwenVLImageProcessor
        from sglang.srt.runtime_context import publish
        from sglang.srt.server_args import ServerArgs
        from transformers import AutoConfig, AutoProcessor

        path = build_tiny_model(family)
        # No radix cache: on the CPU SGLang refuses the one that keeps Qwen3.5's states.
        server_args = ServerArgs(model_path=str(path), device="cpu", disable_radix_cache=True)
        publish(server_args, role="tokenizer")
        processor = (
            Qwen2AudioMultimodalProcessor if family == "qwen2_audio" else QwenVLImageProcessor
        )
        return processor(
            AutoConfig.from_pretrained(path),
            server_args,
            AutoProcessor.from_pretrained(path),
            transport_mode=None,
        )

    @pytest.fixture(scope="module")
    def qwen_vl_processor() -> Any:
        return sglang_processor("qwen2_5_vl")

    async def _sglang_items(processor: Any, kwargs: dict[str, Any]) -> Any:
        """What SGLang's processor makes of one generate call's arguments."""
        obj = GenerateReqInput(**kwargs)
        obj.normalize_batch_and_arguments()
        return await processor.process_mm_data_async(
            image_data=obj.image_data, input_text=obj.input_ids, request_obj=obj
        )

    @pytest.mark.parametrize("num_images", [0, 1, 2])
    async def test_sglang_reads_video_items_and_the_plans_positions(
        qwen_vl_processor: Any, num_images: int
    ) -> None:
        """SGLang's Qwen-VL processor turns the call into one item per bundle with the plan's
        runs and rows, and takes the plan's positions (Qwen2.5-VL's video spacing included);
        `mm_hashes` are sent exactly when they match its items one to one."""
        request, embeddings = _video_request(num_images)
        kwargs = generate_kwargs(request, embeddings, None, splits_images=sglang_splits_images())
        out = await _sglang_items(qwen_vl_processor, kwargs)
        assert out.input_ids == list(request.token_ids)
        images = [m for m in request.media if m.modality == "image"]
        (video,) = [m for m in request.media if m.modality == "video"]
        expected = ([(Modality.IMAGE, images)] if images else []) + [(Modality.VIDEO, [video])]
        assert [(item.modality, item.offsets) for item in out.mm_items] == [
            (modality, [(m.offset, m.end - 1) for m in media]) for modality, media in expected
        ]
        rows = {id(m): e.embeddings for m, e in zip(request.media, embeddings, strict=True)}
        for item, (_, media) in zip(out.mm_items, expected, strict=True):
            assert torch.equal(item.precomputed_embeddings, torch.cat([rows[id(m)] for m in media]))
        assert request.positions is not None
        assert out.mrope_positions.reshape(-1).tolist() == request.positions.rows
        assert out.mrope_position_delta.flatten().tolist() == [request.positions.delta]
        one_to_one = len(out.mm_items) == len(request.media)
        assert ("mm_hashes" in kwargs) == one_to_one

    async def test_sglang_fills_each_temporal_groups_run_with_its_rows(
        grouped_video: tuple[ModelSpec, EngineRequest],
    ) -> None:
        """A Qwen3-VL video planned per temporal group, through SGLang's Qwen-VL processor
        and the padding and embedding routine of the model class it loads for the checkpoint:
        one video item over the groups' runs, the plan's positions (which are also SGLang's own
        `get_rope_index` of the whole video), and each group's rows and deepstack features
        land on its own run, the timestamp text between runs embedded as text."""
        from sglang.srt.layers.rotary_embedding import MRotaryEmbedding
        from sglang.srt.managers.mm_utils import embed_mm_inputs
        from sglang.srt.managers.schedule_batch import MultimodalInputs
        from sglang.srt.models.registry import ModelRegistry

        spec, request = grouped_video
        model_class, _ = ModelRegistry.resolve_model_cls([transformers_class(spec.family).__name__])
        processor = sglang_processor(spec.family)
        embeddings = _deepstack_embeddings(spec, request)
        kwargs = generate_kwargs(request, embeddings, None, splits_images=sglang_splits_images())
        out = await _sglang_items(processor, kwargs)
        ids = list(request.token_ids)
        assert out.input_ids == ids
        groups = [m for m in request.media if m.modality == "video"]
        (video_item,) = [item for item in out.mm_items if item.modality is Modality.VIDEO]
        assert video_item.offsets == [(g.offset, g.end - 1) for g in groups]
        assert request.positions is not None
        assert out.mrope_positions.reshape(-1).tolist() == request.positions.rows
        t, h, w = len(groups), *groups[0].grid_thw[1:]
        images = [m for m in request.media if m.modality == "image"]
        theirs, delta = MRotaryEmbedding.get_rope_index(
            spatial_merge_size=spec.spatial_merge_size,
            image_token_id=spec.image_token_id,
            video_token_id=spec.video_token_id,
            vision_start_token_id=spec.vision_start_token_id,
            model_type=processor.model_type,
            input_ids=torch.tensor([ids]),
            image_grid_thw=torch.tensor([m.grid_thw for m in images]),
            video_grid_thw=torch.tensor([[t, h, w]]),
        )
        assert theirs.reshape(-1).tolist() == request.positions.rows
        assert delta.flatten().tolist() == [request.positions.delta]

        inputs = MultimodalInputs.from_processor_output(out)
        padded = model_class.pad_input_ids(types.SimpleNamespace(), array("q", ids), inputs)
        hidden, layers = 8, spec.deepstack_layers

        def not_again(items: list[Any]) -> torch.Tensor:
            raise AssertionError("precomputed rows are not encoded again")

        model = types.SimpleNamespace(
            config=types.SimpleNamespace(hidden_size=hidden),
            num_deepstack_embeddings=layers,
            deepstack_visual_indexes=list(range(layers)),
            get_image_feature=not_again,
            get_video_feature=not_again,
        )
        if layers:
            model.separate_deepstack_embeds = functools.partial(
                model_class.separate_deepstack_embeds, model
            )
        table = torch.nn.Embedding(max(ids) + 1, hidden)
        placed, other = embed_mm_inputs(
            [inputs],
            [0],
            [len(ids)],
            torch.tensor(list(padded)),
            table,
            multimodal_model=model,
            use_deepstack={Modality.IMAGE: True, Modality.VIDEO: True} if layers else {},
        )
        media_rows = torch.zeros(len(ids), dtype=torch.bool)
        for m, e in zip(request.media, embeddings, strict=True):
            assert torch.equal(placed[m.offset : m.end], e.embeddings)
            if layers:
                deepstack = other["input_deepstack_embeds"][m.offset : m.end]
                assert torch.equal(deepstack, torch.cat(e.deepstack, dim=1))
            media_rows[m.offset : m.end] = True
        with torch.no_grad():
            assert torch.equal(placed[~media_rows], table(torch.tensor(ids)[~media_rows]))

    @pytest.mark.parametrize("frames", [(20,), (3000, 12)])
    async def test_sglang_reads_clips_as_the_plan_has_them(frames: tuple[int, ...]) -> None:
        """SGLang's Qwen2-Audio processor keeps the plan's ids (not its decode and re-encode),
        makes one audio item over the clips' runs with their rows and token counts, the model
        class it loads pads those runs with the item's pad values, and its embedding routine
        puts each clip's rows on its run without running the tower again."""
        from sglang.srt.managers.mm_utils import embed_mm_inputs
        from sglang.srt.managers.schedule_batch import MultimodalInputs
        from sglang.srt.models.qwen2_audio import Qwen2AudioForConditionalGeneration

        processor = sglang_processor("qwen2_audio")
        request, embeddings = _audio_request(frames)
        kwargs = generate_kwargs(request, embeddings, None)
        obj = GenerateReqInput(**kwargs)
        obj.normalize_batch_and_arguments()
        out = await processor.process_mm_data_async(
            audio_data=obj.audio_data, input_text=obj.input_ids, request_obj=obj
        )
        ids = list(request.token_ids)
        assert out.input_ids == ids
        (item,) = out.mm_items
        assert item.modality is Modality.AUDIO
        assert item.offsets == [(m.offset, m.end - 1) for m in request.media]
        assert item.audio_feature_lens.tolist() == [m.length for m in request.media]
        assert ("mm_hashes" in kwargs) == (len(frames) == 1)

        inputs = MultimodalInputs.from_processor_output(out)
        item.set_hash(MM_A)
        padded = Qwen2AudioForConditionalGeneration.pad_input_ids(
            types.SimpleNamespace(), array("q", ids), inputs
        )
        runs = [slice(m.offset, m.end) for m in request.media]
        expected = list(ids)
        for run in runs:
            expected[run] = item.padding_sequence(run.stop - run.start)
        assert list(padded) == expected

        def not_again(items: list[Any]) -> torch.Tensor:
            raise AssertionError("precomputed rows are not encoded again")

        model = types.SimpleNamespace(
            config=types.SimpleNamespace(hidden_size=8), get_audio_feature=not_again
        )
        table = torch.nn.Embedding(max(ids) + 1, 8)
        placed, _ = embed_mm_inputs(
            [inputs], [0], [len(ids)], torch.tensor(list(padded)), table, multimodal_model=model
        )
        for run, embedding in zip(runs, embeddings, strict=True):
            assert torch.equal(placed[run], embedding.embeddings)

    def test_sglangs_audio_tower_is_transformers_own() -> None:
        """The encoder runs the tower and projector SGLang loads with the clip's frame mask
        (`audio_tower.audio_rows`, as the hf engine does): they are transformers' classes."""
        from sglang.srt.models import qwen2_audio
        from transformers.models.qwen2_audio import modeling_qwen2_audio as theirs

        assert qwen2_audio.Qwen2AudioEncoder is theirs.Qwen2AudioEncoder
        assert qwen2_audio.Qwen2AudioMultiModalProjector is theirs.Qwen2AudioMultiModalProjector

    def test_encoder_item_of_a_video() -> None:
        from sglang.srt.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
        from sglang.srt.models.qwen2_vl import Qwen2VLForConditionalGeneration

        pixels = torch.randn(48, 1176)
        mm_item = encoder_item(MediaInput(MM_B, pixels, (2, 4, 6), modality="video"))
        assert mm_item.modality is Modality.VIDEO and mm_item.feature is pixels
        assert mm_item.video_grid_thw.tolist() == [[2, 4, 6]]
        for model in (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration):
            assert list(inspect.signature(model.get_video_feature).parameters) == [
                "self",
                "items",
            ]

    def test_deepstack_features_follow_each_row_as_qwen3_vl_splits_them() -> None:
        """Qwen3-VL and Qwen3-VL-MoE on SGLang split a precomputed embedding's columns into
        the row's embedding and its deepstack features (`separate_deepstack_embeds`, the
        layout of their own tower's output): the item carries them so, image by image."""
        from sglang.srt.models.qwen3_vl import Qwen3VLForConditionalGeneration
        from sglang.srt.models.qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration

        hidden, layers = 8, 3

        def item(mm_hash: int, rows: int) -> ItemEmbedding:
            deepstack = tuple(torch.randn(rows, hidden) for _ in range(layers))
            return ItemEmbedding(mm_hash, (1, 2, 2 * rows), torch.randn(rows, hidden), deepstack)

        items = [item(MM_A, 4), item(MM_B, 2)]
        embedding = media_item("image", items)["precomputed_embeddings"]
        model = types.SimpleNamespace(
            config=types.SimpleNamespace(hidden_size=hidden), num_deepstack_embeddings=layers
        )
        split = Qwen3VLMoeForConditionalGeneration.separate_deepstack_embeds
        assert split is Qwen3VLForConditionalGeneration.separate_deepstack_embeds
        main, deepstack = split(model, embedding)
        assert torch.equal(main, torch.cat([i.embeddings for i in items]))
        assert torch.equal(deepstack, torch.cat([torch.cat(i.deepstack, dim=1) for i in items]))
        # Families without deepstack send the tower's rows alone.
        plain = _embeddings()
        embedding = media_item("image", plain)["precomputed_embeddings"]
        assert torch.equal(embedding, torch.cat([i.embeddings for i in plain]))

    @pytest.mark.parametrize("family", [*TINY_FAMILIES, "qwen2_audio"])
    def test_sglang_pads_exactly_the_plans_media_span(family: str) -> None:
        """The ids the model class SGLang loads for the checkpoint pads (what its radix cache
        and KV events hash) are the router's routing view: the item's pad values over the
        plan's span and nowhere else. Gemma 3 pads between its begin and end of image tokens
        (`pad_mm_token_pairs`), the Qwen-VL families the image token runs SGLang's processor
        finds (`pad_mm_tokens`), Qwen2-Audio its audio token runs."""
        from sglang.srt.models.registry import ModelRegistry

        model_path = build_tiny_model(family)
        check_sglang_padding(model_path)
        spec = resolve_model_spec(model_path)
        model_class, _ = ModelRegistry.resolve_model_cls([transformers_class(spec.family).__name__])
        padded, expected = sglang_padded_probe(model_class, spec, MM_A)
        assert padded == expected
        ours = np.resize(np.array(pad_values(MM_A, installed_scheme()), dtype=object), 6)
        assert padded[3:9] == ours.tolist() and padded[2] != padded[3]

    def test_a_model_that_pads_elsewhere_stops_the_worker(monkeypatch: pytest.MonkeyPatch):
        from sglang.srt.models.registry import ModelRegistry

        class NeverPads:
            def pad_input_ids(self, input_ids: array, mm_inputs: Any) -> array:
                return input_ids

        monkeypatch.setattr(
            ModelRegistry, "resolve_model_cls", lambda archs: (NeverPads, "NeverPads")
        )
        with pytest.raises(SglangStartupError, match="pads other tokens"):
            check_sglang_padding(build_tiny_model("gemma3"))

    def test_gemma3_encoder_item_reaches_the_tower_as_one_image() -> None:
        """Gemma 3's fixed-size tower takes the Rust core's `[3, size, size]` image: SGLang's
        `get_image_feature` runs its SigLIP tower on it as a batch of one and projects that,
        never mistaking it for precomputed features (a 3-D feature as wide as the hidden size)."""
        from sglang.srt.models.gemma3_mm import Gemma3ForConditionalGeneration

        hidden, size, tokens = 64, 28, 4
        seen: list[torch.Size] = []

        class Tower:
            device = torch.device("cpu")

            def __call__(self, pixel_values: torch.Tensor) -> torch.Tensor:
                seen.append(pixel_values.shape)
                return pixel_values.mean() + torch.zeros(1, 16, 8)

        model = types.SimpleNamespace(
            config=types.SimpleNamespace(text_config=types.SimpleNamespace(hidden_size=hidden)),
            language_model=types.SimpleNamespace(device="cpu", dtype=lambda: torch.float32),
            vision_tower=Tower(),
            multi_modal_projector=lambda out: out.mean() + torch.zeros(1, tokens, hidden),
        )
        pixels = torch.randn(3, size, size)
        mm_item = encoder_item(MediaInput(MM_A, pixels, (1, 2, 2)))
        features = Gemma3ForConditionalGeneration.get_image_feature(model, [mm_item])
        assert seen == [torch.Size([1, 3, size, size])]
        assert features.shape == (1, tokens, hidden)
        assert torch.allclose(features, pixels.mean().expand(1, tokens, hidden))


class LogprobFakeSglang(FakeSglangEngine):
    """`sglang.Engine` as far as log-probabilities and choices go: the outputs its tokenizer
    manager streams (`meta_info` as `add_logprob_to_meta_info` fills it: entries
    `(logprob, id, None)`, top lists of `top_logprobs_num`, the prompt's lists whole, from a
    `None` first position; with `--incremental-streaming-output` the output lists sliced as
    the ids), one stream per call, call c being choice c. Choice c makes `lengths[c]` tokens
    `10 * c + 5, ...` and ends with `finishes[c]`; top lists come least likely first, to show
    the adapter sorts them. Media positions score as SGLang scores them: id 0 (the clipped
    pad value), a meaningless value, the placeholder's own in `input_token_ids_logprobs`."""

    def __init__(
        self,
        lengths: list[int],
        finishes: list[str] | None = None,
        *,
        incremental: bool = False,
        media: tuple[PlannedMedia, ...] = (),
    ) -> None:
        super().__init__([])
        self.lengths = lengths
        self.finishes = finishes or ["length"] * len(lengths)
        self.incremental = incremental
        self.media = {p for m in media for p in range(m.offset, m.end)}

    async def async_generate(self, **kwargs: Any) -> AsyncIterator[dict[str, object]]:
        self.calls.append(kwargs)
        return self._streams(kwargs, len(self.calls) - 1)

    @staticmethod
    def output_logprob(choice: int, step: int) -> float:
        return -0.25 * (step + 1) - choice

    @staticmethod
    def prompt_logprob(position: int) -> float:
        return -0.01 * position

    def _top(self, best: list[tuple[float, int]], k: int) -> list[tuple[float, int, None]]:
        return [(value, token, None) for value, token in reversed(sorted(best)[::-1][:k])]

    def _prompt_meta(self, kwargs: dict[str, Any]) -> dict[str, object]:
        if kwargs.get("logprob_start_len") != 0:
            return {"input_token_logprobs": []}
        ids, k = kwargs["input_ids"], kwargs["top_logprobs_num"]
        tokens = [(None, ids[0], None)]
        tops: list[object] = [None]
        placeholders: list[object] = [None]
        for p in range(1, len(ids)):
            value = self.prompt_logprob(p)
            if p in self.media:
                tokens.append((-50.0, 0, None))
                tops.append(self._top([(-0.001, 42), (-0.002, 43), (-0.003, 44)], k))
            else:
                tokens.append((value, ids[p], None))
                tops.append(self._top([(-0.001, 42), (value - 1, 43), (value, ids[p])], k))
            wanted = kwargs.get("token_ids_logprob") or []
            placeholders.append([(-3.0, t, None) for t in wanted])
        meta: dict[str, object] = {"input_token_logprobs": tokens}
        if k:
            meta["input_top_logprobs"] = tops
        if "token_ids_logprob" in kwargs:
            meta["input_token_ids_logprobs"] = placeholders
        return meta

    async def _streams(self, kwargs: dict[str, Any], call: int) -> AsyncIterator[dict[str, object]]:
        params = kwargs["sampling_params"]
        assert "n" not in params  # one request per choice
        choices = [call]
        k = kwargs.get("top_logprobs_num", 0)
        prompt = self._prompt_meta(kwargs) if kwargs.get("return_logprob") else {}
        steps = max(min(self.lengths[c], params["max_new_tokens"]) for c in choices)
        for step in range(steps):
            for c in choices:
                length = min(self.lengths[c], params["max_new_tokens"])
                if step >= length:
                    continue
                tokens = [10 * c + 5 + t for t in range(step + 1)]
                logprobs = [(self.output_logprob(c, t), tokens[t], None) for t in range(step + 1)]
                tops = [
                    self._top([(lp, tok), (lp - 0.5, 100 + t), (lp - 1, 200)], k)
                    for t, (lp, tok, _) in enumerate(logprobs)
                ]
                start = step if self.incremental else 0
                done = step == length - 1
                meta: dict[str, object] = {
                    "id": kwargs["rid"],
                    "finish_reason": {"type": self.finishes[c]} if done else None,
                    "prompt_tokens": 10,
                    "completion_tokens": step + 1,
                    "cached_tokens": 3 if c == 0 else 9,
                }
                if kwargs.get("return_logprob"):
                    meta |= prompt
                    meta["output_token_logprobs"] = logprobs[start:]
                    if k:
                        meta["output_top_logprobs"] = tops[start:]
                yield {
                    "output_ids": tokens[start:],
                    "text": "".join(f"<{t}>" for t in tokens[start:]),
                    "meta_info": meta,
                }
        if params["max_new_tokens"] == 0:
            yield {
                "output_ids": [],
                "text": "",
                "meta_info": {
                    "finish_reason": {"type": "length"},
                    "prompt_tokens": 10,
                    "completion_tokens": 0,
                    "cached_tokens": 0,
                    **prompt,
                },
            }


def _params(call: dict[str, object]) -> dict[str, Any]:
    params = call["sampling_params"]
    assert isinstance(params, dict)
    return params


def _logprob_engine(fake: FakeSglangEngine, mode: str = "null") -> SglangEngine:
    engine = _engine(mode, fake)
    engine.incremental = getattr(fake, "incremental", False)
    return engine


def _sampled(**fields: Any) -> EngineRequest:
    request = _request()
    return replace(request, sampling=msgspec.structs.replace(request.sampling, **fields))


@pytest.mark.parametrize("incremental", [False, True])
async def test_logprobs_stream_with_their_tokens_most_likely_first(incremental: bool) -> None:
    """`logprobs` k: SGLang's `return_logprob` and `top_logprobs_num` k; every chunk carries
    one entry per token: its id, its logprob, the k most likely sorted (SGLang's order
    reversed by the fake), no rank (the hf engine gives ranks for prompt tokens only)."""
    fake = LogprobFakeSglang([3], incremental=incremental)
    request = _sampled(logprobs=2)
    chunks = [c async for c in _logprob_engine(fake).generate(request, _embeddings())]
    (call,) = fake.calls
    assert (call["return_logprob"], call["top_logprobs_num"]) == (True, 2)
    assert "logprob_start_len" not in call and "token_ids_logprob" not in call
    assert [c.token_ids for c in chunks] == [[5], [6], [7]]
    for step, chunk in enumerate(chunks):
        (entry,) = chunk.logprobs
        value = fake.output_logprob(0, step)
        assert (entry.token_id, entry.logprob, entry.rank) == (5 + step, value, None)
        assert entry.top == [(5 + step, value), (100 + step, value - 0.5)]
        assert chunk.prompt_logprobs == []
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage is not None


async def test_logprobs_zero_is_the_chosen_token_alone_and_none_is_nothing() -> None:
    fake = LogprobFakeSglang([2])
    chunks = [c async for c in _logprob_engine(fake).generate(_sampled(logprobs=0), _embeddings())]
    assert fake.calls[0]["top_logprobs_num"] == 0
    assert [[(e.token_id, e.top) for e in c.logprobs] for c in chunks] == [[(5, [])], [(6, [])]]
    plain = LogprobFakeSglang([2])
    chunks = [c async for c in _logprob_engine(plain).generate(_request(), _embeddings())]
    assert all(c.logprobs == [] for c in chunks)
    assert not {"return_logprob", "top_logprobs_num"} & set(plain.calls[0])


def test_log_probability_values_mmserve_sends() -> None:
    """SGLang's -inf, its clamp at float32's minimum and NaN go as the hf engine's -9999.0
    (JSON has no -inf); a top list is sorted most likely first, ties in SGLang's order."""
    assert [logprob_value(v) for v in (-0.5, float("-inf"), -3.4e38, float("nan"))] == [
        -0.5,
        UNLIKELY,
        UNLIKELY,
        UNLIKELY,
    ]
    entries = [(-2.0, 1, None), (-1.0, 2, None), (-1.0, 3, None), (float("-inf"), 4, None)]
    assert top_list(entries) == [(2, -1.0), (3, -1.0), (1, -2.0), (4, UNLIKELY)]
    assert rank_in(-1.0, top_list(entries)) == 1 and rank_in(-2.0, top_list(entries)) == 3
    assert rank_in(-20000.0, top_list(entries)) is None and rank_in(-1.0, []) is None


@pytest.mark.parametrize("incremental", [False, True])
async def test_prompt_logprobs_on_the_first_chunk_one_per_token_after_the_first(
    incremental: bool,
) -> None:
    """`prompt_logprobs` k: `logprob_start_len` 0 and the items' placeholder ids in
    `token_ids_logprob`; the first chunk carries one entry per prompt token after the first
    (the hf engine's shape), the request's ids (SGLang's say 0 at media positions), a media
    position's value its placeholder's, the k most likely sorted, and the rank where the top
    list decides it. Output logprobs stay off unless asked for."""
    fake = LogprobFakeSglang([2], incremental=incremental, media=_request().media)
    request = _sampled(prompt_logprobs=2)
    chunks = [c async for c in _logprob_engine(fake).generate(request, _embeddings())]
    (call,) = fake.calls
    assert (call["logprob_start_len"], call["token_ids_logprob"]) == (0, [9])
    assert call["top_logprobs_num"] == 2
    first, *rest = chunks
    assert all(c.logprobs == [] for c in chunks) and all(c.prompt_logprobs == [] for c in rest)
    ids = request.token_ids
    prompt = first.prompt_logprobs
    assert [e.token_id for e in prompt] == list(ids[1:])
    media = {p for m in request.media for p in range(m.offset, m.end)}
    for position, entry in enumerate(prompt, start=1):
        if position in media:
            assert (entry.logprob, entry.rank) == (-3.0, None)
            assert entry.top == [(42, -0.001), (43, -0.002)]
        else:
            value = fake.prompt_logprob(position)
            assert (entry.logprob, entry.rank) == (value, 2)
            assert entry.top == [(42, -0.001), (ids[position], value)]


async def test_prompt_logprobs_with_max_tokens_zero_score_the_prompt_once() -> None:
    """A prefill only (max_tokens 0): one call without `n`, one chunk, no token, the prompt's
    logprobs, finish "length"."""
    fake = LogprobFakeSglang([4, 4, 4])
    request = replace(
        _sampled(prompt_logprobs=0, n=3, seed=None), stop=StopConditions(max_tokens=0)
    )
    (chunk,) = [c async for c in _logprob_engine(fake).generate(request, _embeddings())]
    (call,) = fake.calls
    assert call["rid"] == "req-1" and call["token_ids_logprob"] == [9]
    assert chunk.token_ids == [] and chunk.finish_reason == "length"
    assert len(chunk.prompt_logprobs) == len(request.token_ids) - 1
    assert all(e.top == [] for e in chunk.prompt_logprobs)
    assert chunk.usage == Usage(prompt_tokens=10, completion_tokens=0, cached_tokens=0)


@pytest.mark.parametrize("incremental", [False, True])
async def test_n_choices_are_one_request_each_indexed_with_their_own_finish(
    incremental: bool,
) -> None:
    """`n` without a seed: one request per choice (rid `<id>.<i>`, no seed, the same prompt,
    items and `mm_hashes`); each choice's chunks by `index`, its own tokens and logprobs,
    its own finish reason on its last chunk; the usage once, on the stream's last chunk, the
    prompt counted once (choice 0's prompt and cached tokens) and every choice's tokens."""
    fake = LogprobFakeSglang([2, 4, 3], ["stop", "length", "stop"], incremental=incremental)
    request = _sampled(n=3, seed=None, temperature=1.0, logprobs=1)
    chunks = [c async for c in _logprob_engine(fake).generate(request, _embeddings())]
    assert [call["rid"] for call in fake.calls] == ["req-1.0", "req-1.1", "req-1.2"]
    assert all("sampling_seed" not in _params(call) for call in fake.calls)
    first = fake.calls[0]
    for call in fake.calls:
        assert call["input_ids"] == first["input_ids"]
        assert call["mm_hashes"] == [mm_hash_hex(MM_A), mm_hash_hex(MM_B)]
        assert call["image_data"][0]["precomputed_embeddings"] is not None
    by_choice = {i: [c for c in chunks if c.index == i] for i in range(3)}
    for i, length in enumerate(fake.lengths):
        mine = by_choice[i]
        assert [t for c in mine for t in c.token_ids] == [10 * i + 5 + t for t in range(length)]
        assert [e.logprob for c in mine for e in c.logprobs] == [
            fake.output_logprob(i, t) for t in range(length)
        ]
        assert [c.finish_reason for c in mine] == [None] * (length - 1) + [fake.finishes[i]]
    assert sorted({c.index for c in chunks[:3]}) == [0, 1, 2]  # the choices interleave
    assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].usage == Usage(prompt_tokens=10, completion_tokens=9, cached_tokens=3)


async def test_seeded_choices_each_have_their_own_seed() -> None:
    """`n` with a seed: choice 0 with the request's seed (so it draws as the request with `n`
    1), the others with seeds derived from (seed, choice), all different."""
    fake = LogprobFakeSglang([1, 3, 2], ["length", "stop", "length"])
    request = _sampled(n=3, seed=7, temperature=1.0)
    chunks = [c async for c in _logprob_engine(fake).generate(request, _embeddings())]
    seeds = [call["sampling_params"]["sampling_seed"] for call in fake.calls]
    assert seeds == [7, choice_seed(7, 1), choice_seed(7, 2)] and len(set(seeds)) == 3
    assert all(0 <= seed < 2**63 for seed in seeds[1:])
    for i, length in enumerate(fake.lengths):
        mine = [c for c in chunks if c.index == i]
        assert [t for c in mine for t in c.token_ids] == [10 * i + 5 + t for t in range(length)]
        assert mine[-1].finish_reason == fake.finishes[i]
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].usage == Usage(prompt_tokens=10, completion_tokens=6, cached_tokens=3)
    single = generate_calls(_sampled(seed=7, temperature=1.0), _embeddings(), None)
    assert [call["sampling_params"] for call in single] == [fake.calls[0]["sampling_params"]]
    assert single[0]["rid"] == "req-1"


async def test_closing_the_stream_closes_every_choices_request() -> None:
    """A client that goes away mid-stream: every choice's SGLang stream is closed and no read
    is left pending."""
    closed: list[int] = []

    class Endless(FakeSglangEngine):
        async def async_generate(self, **kwargs: object) -> AsyncIterator[dict[str, object]]:
            self.calls.append(kwargs)
            return self._forever(len(self.calls) - 1)

        async def _forever(self, call: int) -> AsyncIterator[dict[str, object]]:
            try:
                for n in range(1, 10**6):
                    yield {"output_ids": [1] * n, "text": "", "meta_info": {}}
                    await asyncio.sleep(0)
            finally:
                closed.append(call)

    stream = _engine("null", Endless([])).generate(
        _sampled(n=2, seed=3, temperature=1.0), _embeddings()
    )
    assert isinstance(stream, AsyncGenerator)
    async for _ in stream:
        break
    await stream.aclose()
    assert sorted(closed) == [0, 1]


async def test_pd_refuses_n_and_prompt_logprobs_by_name_and_serves_logprobs() -> None:
    """P/D through SGLang's bootstrap room: `n` > 1 and `prompt_logprobs` are refused by name
    on both sides before anything is sent; output `logprobs` go with both sides' requests
    (SGLang moves the first token's logprobs from prefill to decode)."""
    prefill_fake, decode_fake = LogprobFakeSglang([1]), LogprobFakeSglang([2])
    prefill = _logprob_engine(prefill_fake, "prefill")
    decode = _logprob_engine(decode_fake, "decode")
    bootstrap = prefill.bootstrap_info()
    for fields, name in (({"n": 2, "seed": None}, "n > 1"), ({"prompt_logprobs": 1}, "prompt")):
        refused = _sampled(**fields)
        with pytest.raises(EngineError, match=name):
            await prefill.prefill(refused, _embeddings(), bootstrap)
        with pytest.raises(EngineError, match=name):
            await decode.import_kv(refused, _done(), {"embeddings": torch.zeros(6, 8)}, bootstrap)
    assert prefill_fake.calls == [] and decode_fake.calls == []
    request = _sampled(logprobs=1)
    kv = await prefill.prefill(request, _embeddings(), bootstrap)
    imported = await decode.import_kv(
        request, kv.prefill_done(), await prefill.export_kv(kv), bootstrap
    )
    chunks = [c async for c in decode.decode(imported, request.sampling, request.stop)]
    assert [e.token_id for c in chunks for e in c.logprobs] == [5, 6]
    for call in (prefill_fake.calls[0], decode_fake.calls[0]):
        assert (call["return_logprob"], call["top_logprobs_num"]) == (True, 1)
    # A decode stream asked for more choices than its prefill made is refused as well.
    more = decode.decode(imported, msgspec.structs.replace(request.sampling, n=2), request.stop)
    with pytest.raises(EngineError, match="n > 1"):
        await anext(more)


def _done() -> PrefillDone:
    return PrefillDone(request_id="req-1", first_tokens=[FirstToken(-1)], prompt_tokens=10)


if HAS_SGLANG:

    def test_sglang_takes_the_logprob_arguments_and_each_choices_request() -> None:
        """Each choice's call normalizes as one single request with its `mm_hashes` and the
        log-probability arguments; SGLang's own `n` would turn it into a batch that refuses
        the engine's `mm_hashes` (one list per request, one hash per `image_data` entry)."""
        from sglang.srt.sampling.sampling_params import SamplingParams as SglSamplingParams

        request = _sampled(logprobs=3, prompt_logprobs=5, n=2, seed=-5, temperature=1.0)
        calls = generate_calls(request, _embeddings(), None, splits_images=True)
        assert len(calls) == 2
        for call in calls:
            SglSamplingParams(**call["sampling_params"]).verify(vocab_size=1000)
            obj = GenerateReqInput(**call)
            obj.normalize_batch_and_arguments()
            assert obj.is_single and obj.parallel_sample_num == 1
            assert obj.mm_hashes == [mm_hash_hex(MM_A), mm_hash_hex(MM_B)]
            assert (obj.return_logprob, obj.top_logprobs_num) == (True, 5)
            assert (obj.logprob_start_len, obj.token_ids_logprob) == (0, [9])
        parallel = {**calls[0], "sampling_params": {**calls[0]["sampling_params"], "n": 2}}
        with pytest.raises(ValueError, match="mm_hashes"):
            GenerateReqInput(**parallel).normalize_batch_and_arguments()

    def test_sglang_streams_logprobs_as_the_adapter_reads_them() -> None:
        """The entry format (`detokenize_logprob_tokens`: `(logprob, id, None)` without
        `return_text_in_logprobs`; a top row None where empty), which lists an incremental
        stream slices (the output ones, not the prompt's), and SGLang's name of the
        raw-logprobs switch the engine sets."""
        from sglang.srt.environ import envs
        from sglang.srt.managers import tokenizer_manager
        from sglang.srt.managers.tokenizer_manager import TokenizerManager

        entries = TokenizerManager.detokenize_logprob_tokens(None, [-0.5, -1.0], [7, 8], False)
        assert entries == [(-0.5, 7, None), (-1.0, 8, None)]
        rows = TokenizerManager.detokenize_top_logprobs_tokens(
            types.SimpleNamespace(
                detokenize_logprob_tokens=functools.partial(
                    TokenizerManager.detokenize_logprob_tokens, None
                )
            ),
            [[], [-0.1, -0.2]],
            [[], [3, 4]],
            False,
        )
        assert rows == [None, [(-0.1, 3, None), (-0.2, 4, None)]]
        assert top_list(rows[1]) == [(3, -0.1), (4, -0.2)]
        sliced = set(tokenizer_manager._INCREMENTAL_STREAMING_META_INFO_KEYS)
        assert {"output_token_logprobs", "output_top_logprobs"} <= sliced
        assert not {"input_token_logprobs", "input_top_logprobs"} & sliced
        assert hasattr(envs, RAW_LOGPROBS_ENV[0])
