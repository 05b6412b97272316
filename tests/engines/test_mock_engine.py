"""The mock engine: cache hits shorten prefill, its KV events key like the hf engine's, its
tokens depend on the prompt only (Gemma 3's pan-and-scan crops counted as items of their
own), and a prefill continues in another mock engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from pathlib import Path

import numpy as np
import pytest
import torch

from mmserve import _mm
from mmserve.engines.base import GREEDY, EngineError, EngineRequest, ItemEmbedding, MediaInput
from mmserve.engines.mock import MockEngine, simulated_prompt_logprobs
from mmserve.kv.pad import PadScheme
from mmserve.kv.view import prompt_block_keys
from mmserve.media.text_pieces import text_pieces
from mmserve.protocol import (
    KvCleared,
    KvRemoved,
    KvStored,
    PlannedMedia,
    SamplingParams,
    StopConditions,
    TokenChunk,
)
from mmserve.tiny.checkpoints import build_tiny_model
from tests.mm.qwen_refs import png_bytes
from tests.support.audio import wav_bytes
from tests.support.engines import IMAGE_TOKEN_ID, placements

BLOCK = 16


@pytest.fixture(scope="module")
def model_path() -> Path:
    return build_tiny_model("qwen2_vl")


async def engine_for(model_path: Path, **options: object) -> MockEngine:
    defaults: dict[str, object] = {"prefill_us_per_token": 0.0, "decode_ms_per_token": 0.0}
    return await MockEngine.load(model_path, **{**defaults, **options})


async def image(engine: MockEngine, mm_hash: int) -> ItemEmbedding:
    # A 112x84 image: grid (1, 6, 8), 12 tokens after the 2x2 merge.
    (embedding,) = await engine.encode([MediaInput(mm_hash, torch.zeros(48, 1176), (1, 6, 8))])
    return embedding


def prompt(text: list[int], images: int, tokens_per_image: int = 12) -> tuple[int, ...]:
    ids = list(text)
    for _ in range(images):
        ids += [151652, *[IMAGE_TOKEN_ID] * tokens_per_image, 151653, 200, 201]
    return tuple(ids)


def planned(
    request_id: str, ids: tuple[int, ...], embeddings: list[ItemEmbedding], **options: object
) -> EngineRequest:
    media = tuple(placements(ids, embeddings))
    return EngineRequest(request_id, ids, media=media, **options)  # type: ignore[arg-type]


async def collect(stream: object) -> list[TokenChunk]:
    return [chunk async for chunk in stream]  # type: ignore[attr-defined]


async def test_encode_gives_deterministic_rows_per_merged_patch(model_path: Path) -> None:
    engine = await engine_for(model_path)
    first, again, other = await image(engine, 5), await image(engine, 5), await image(engine, 6)
    assert first.num_tokens == 12
    assert torch.equal(first.embeddings, again.embeddings)
    assert not torch.equal(first.embeddings, other.embeddings)


async def test_encode_rows_are_the_plans_token_count_for_every_family(tiny_model: Path) -> None:
    engine = await engine_for(tiny_model)
    rng = np.random.default_rng(3)
    images = [png_bytes(rng, w, h) for w, h in [(64, 64), (300, 120), (90, 400)]]
    # The family's own placeholders, as its chat template writes them.
    tokenizer = engine.tokenizer  # the checkpoint's, as AutoTokenizer loads it
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}] * len(images)}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    plan = _mm.process(engine.spec.core, ids, images, count_only=True)
    inputs = [
        MediaInput(item.hash, torch.zeros(1, 1), tuple(int(v) for v in item.image_grid_thw[0]))
        for item in plan.items
    ]
    encoded = await engine.encode(inputs)
    assert [e.num_tokens for e in encoded] == [item.num_tokens for item in plan.items]
    image_token = engine.spec.image_token_id
    assert sum(e.num_tokens for e in encoded) == list(plan.input_ids).count(image_token)
    if engine.spec.core.pan_and_scan is not None:  # Gemma 3: each crop is an item too
        panning = engine.spec.core.with_pan_and_scan((32, 4, 1.2))
        pieces = text_pieces(tokenizer, engine.spec)
        panned = _mm.process(
            panning, ids, images, count_only=True, text_pieces=pieces, panned_input_ids=ids
        )
        assert [item.crop for item in panned.items] == [None, None, 1, 2, 3, None, 1, 2, 3, 4]
        inputs = [
            MediaInput(item.hash, torch.zeros(1, 1), tuple(int(v) for v in item.image_grid_thw[0]))
            for item in panned.items
        ]
        encoded = await engine.encode(inputs)
        assert sum(e.num_tokens for e in encoded) == list(panned.input_ids).count(image_token)


async def test_cached_prefix_skips_prefill_time_and_counts_in_usage(model_path: Path) -> None:
    engine = await engine_for(model_path, prefill_us_per_token=2000.0)
    ids = prompt(list(range(1000, 1090)), images=1)  # 106 tokens, 6 complete blocks
    emb = [await image(engine, 42)]
    request = planned("a", ids, emb, stop=StopConditions(max_tokens=4))
    started = time.perf_counter()
    cold = await engine.prefill(request, emb)
    cold_s = time.perf_counter() - started
    started = time.perf_counter()
    warm = await engine.prefill(planned("b", ids, emb, stop=request.stop), emb)
    warm_s = time.perf_counter() - started
    assert (cold.cached_tokens, warm.cached_tokens) == (0, 6 * BLOCK)
    assert cold_s >= len(ids) * 0.002  # slept for every token
    assert warm_s < cold_s
    cold_chunks = await collect(engine.decode(cold, request.sampling, request.stop))
    warm_chunks = await collect(engine.decode(warm, request.sampling, request.stop))
    assert [c.token_ids for c in cold_chunks] == [c.token_ids for c in warm_chunks]
    assert warm_chunks[-1].usage is not None
    assert warm_chunks[-1].usage.cached_tokens == 6 * BLOCK
    assert warm_chunks[-1].usage.completion_tokens == 4
    assert warm_chunks[-1].finish_reason == "length"


async def test_kv_events_carry_the_routing_views_hashes(tiny_model: Path) -> None:
    engine = await engine_for(tiny_model, pad_scheme=PadScheme.SGLANG_WIDE)
    events: list = []
    engine.subscribe_kv_events(events.append)
    ids = prompt(list(range(1000, 1040)), images=1)
    emb = [await image(engine, 99)]
    await engine.prefill(planned("a", ids, emb), emb)
    offset = ids.index(IMAGE_TOKEN_ID)
    media = [PlannedMedia(mm_hash=99, offset=offset, length=12, grid_thw=(1, 6, 8))]
    keys = prompt_block_keys(ids, media, BLOCK, PadScheme.SGLANG_WIDE)
    if not engine.spec.reuses_prefix_blocks:
        # A hybrid model (Qwen3.5) announces no block it could not resume from, and hits none.
        again = await engine.prefill(planned("b", ids, emb), emb)
        assert events == [] and engine.kv_cache_snapshot() == [] and again.cached_tokens == 0
        return
    (stored,) = events
    assert isinstance(stored, KvStored)
    assert [b.block_hash for b in stored.blocks] == list(keys.seq_hashes)
    assert [b.tokens_hash for b in stored.blocks] == list(keys.local_hashes)
    assert {block for block, _, _ in engine.kv_cache_snapshot()} == set(keys.seq_hashes)
    # A different image after the same text shares only the blocks before it.
    other_emb = [await image(engine, 100)]
    other = await engine.prefill(planned("b", ids, other_emb), other_emb)
    assert other.cached_tokens == offset // BLOCK * BLOCK


async def test_lru_eviction_under_the_block_budget(model_path: Path) -> None:
    engine = await engine_for(model_path, cache_blocks=4)
    events: list = []
    engine.subscribe_kv_events(events.append)
    first, second = tuple(range(1000, 1049)), tuple(range(2000, 2049))  # 3 blocks each
    await engine.prefill(EngineRequest("a", first))
    await engine.prefill(EngineRequest("b", second))
    assert engine.prefix_cache.num_blocks == 4
    assert isinstance(events[-1], KvRemoved) and len(events[-1].block_hashes) == 2
    assert (await engine.prefill(EngineRequest("c", second))).cached_tokens == 3 * BLOCK
    assert (await engine.prefill(EngineRequest("d", first))).cached_tokens == BLOCK


async def test_clear_caches_empties_the_prefix_cache_and_says_so(model_path: Path) -> None:
    engine = await engine_for(model_path)
    events: list = []
    engine.subscribe_kv_events(events.append)
    ids = tuple(range(1000, 1049))  # 3 blocks
    await engine.prefill(EngineRequest("a", ids))
    cleared = await engine.clear_caches()
    assert (cleared.prefix_blocks, cleared.encoder_items) == (3, 0)
    assert isinstance(events[-1], KvCleared)
    assert engine.kv_cache_snapshot() == []
    assert (await engine.prefill(EngineRequest("b", ids))).cached_tokens == 0


async def test_prefills_take_turns_and_decode_streams_run_together(model_path: Path) -> None:
    engine = await engine_for(model_path, prefill_us_per_token=1000.0, decode_ms_per_token=20.0)
    requests = [EngineRequest(str(i), tuple(range(i * 100, i * 100 + 50))) for i in range(3)]
    started = time.perf_counter()
    handles = await asyncio.gather(*(engine.prefill(r) for r in requests))
    assert time.perf_counter() - started >= 3 * 50 * 0.001
    stop = StopConditions(max_tokens=5)
    streams = await asyncio.gather(
        *(
            collect(engine.decode(kv, r.sampling, stop))
            for kv, r in zip(handles, requests, strict=True)
        )
    )
    assert all(len(chunks) == 5 for chunks in streams)
    assert len({tuple(c.token_ids[0] for c in chunks) for chunks in streams}) == 3


async def test_a_live_stream_holds_its_place_in_the_queue(model_path: Path) -> None:
    engine = await engine_for(model_path, max_queue=1)
    ids = prompt(list(range(1000, 1030)), images=0)
    kv = await engine.prefill(EngineRequest("a", ids))
    stream = engine.decode(kv, GREEDY, StopConditions(max_tokens=8))
    assert isinstance(stream, AsyncGenerator)  # so that closing it ends the stream now
    await anext(stream)
    with pytest.raises(EngineError, match="queue is full"):  # EngineOverloaded
        await engine.prefill(EngineRequest("b", ids))
    await stream.aclose()
    engine.release(await engine.prefill(EngineRequest("b", ids)))
    await engine.close()
    with pytest.raises(EngineError, match="closed"):
        await engine.prefill(EngineRequest("c", ids))


async def test_export_import_continues_the_stream(model_path: Path) -> None:
    prefill, decode = await engine_for(model_path), await engine_for(model_path)
    ids = prompt(list(range(1000, 1030)), images=1)
    emb = [await image(prefill, 1)]
    request = planned("a", ids, emb, stop=StopConditions(max_tokens=6))
    local = await prefill.prefill(request, emb)
    tensors = await prefill.export_kv(local)
    assert set(tensors) == {"seed"}  # the prompt, its plan and the first token stay with decode
    imported = await decode.import_kv(request, local.prefill_done(), tensors)
    expected = await collect(prefill.decode(local, request.sampling, request.stop))
    continued = await collect(decode.decode(imported, request.sampling, request.stop))
    assert [c.token_ids for c in continued] == [c.token_ids for c in expected]
    assert "".join(c.text for c in continued) == "".join(c.text for c in expected)
    with pytest.raises(EngineError, match="not live"):
        await prefill.export_kv(local)  # decode consumed the handle


async def test_the_plan_must_match_the_embeddings(model_path: Path) -> None:
    engine = await engine_for(model_path)
    ids = prompt([1, 2, 3], images=1)
    emb = [await image(engine, 1)]
    short = PlannedMedia(mm_hash=1, offset=4, length=10, grid_thw=(1, 6, 8))
    with pytest.raises(EngineError, match="fills 10 tokens but its embedding has 12 rows"):
        await engine.prefill(EngineRequest("a", ids, media=(short,)), emb)
    with pytest.raises(EngineError, match="1 embeddings for 0 media items"):
        await engine.prefill(EngineRequest("b", ids), emb)


async def test_min_tokens_keeps_stop_ids_from_ending_the_stream(model_path: Path) -> None:
    """A stop id ends the stream once min_tokens are out; before that it is not drawn (the
    next id is), and the rest of the stream stays the same."""
    engine = await engine_for(model_path)
    ids = prompt([1, 2, 3], images=0)

    async def tokens(request_id: str, stop: StopConditions) -> tuple[list[int], str | None]:
        chunks = await collect(engine.generate(EngineRequest(request_id, ids, stop=stop)))
        return [t for chunk in chunks for t in chunk.token_ids], chunks[-1].finish_reason

    free, _ = await tokens("free", StopConditions(max_tokens=8))
    stop_id = free[2]
    assert await tokens("stop", StopConditions(max_tokens=8, stop_token_ids=[stop_id])) == (
        free[:3],
        "stop",
    )
    held, finish = await tokens(
        "held", StopConditions(max_tokens=8, min_tokens=5, stop_token_ids=[stop_id, free[0]])
    )
    assert (held[0], held[1:2], held[2], held[3:]) == (
        free[0] + 1,
        free[1:2],
        stop_id + 1,
        free[3:],
    )
    assert finish == "length"
    with pytest.raises(EngineError, match="min_tokens"):
        await engine.prefill(
            EngineRequest("bad", ids, stop=StopConditions(max_tokens=2, min_tokens=3))
        )


async def test_prompt_logprobs_are_simulated_and_reuse_no_prefix(model_path: Path) -> None:
    engine = await engine_for(model_path)
    ids = (9707, *range(1_000, 1_040), 374)  # ids inside and outside the pseudo range
    plain = EngineRequest("a", ids, stop=StopConditions(max_tokens=1))
    engine.release(await engine.prefill(plain, []))
    scoring = EngineRequest(
        "b", ids, sampling=SamplingParams(prompt_logprobs=2), stop=StopConditions(max_tokens=0)
    )
    kv = await engine.prefill(scoring, [])
    assert kv.cached_tokens == 0
    assert kv.prompt_logprobs == simulated_prompt_logprobs(ids, 2)
    assert [each.token_id for each in kv.prompt_logprobs] == list(ids[1:])
    for each in kv.prompt_logprobs:
        assert each.rank == 1 and each.top[0] == (each.token_id, each.logprob)
        assert len(each.top) == 2 and each.top[1][1] < each.logprob
    (chunk,) = [chunk async for chunk in engine.decode(kv, scoring.sampling, scoring.stop)]
    assert chunk.token_ids == [] and chunk.finish_reason == "length"
    assert chunk.prompt_logprobs == kv.prompt_logprobs


# Each audio family's tokens for a 1 s clip and a 43.75 s one: Whisper-style extractors cut
# the second at 30 s (750); Qwen3-Omni's takes all of it, 13 tokens a 100 frames.
CLIP_TOKENS = {"qwen2_audio": [25, 750], "qwen2_5_omni": [25, 750], "qwen3_omni_moe": [13, 569]}


@pytest.mark.parametrize("family", list(CLIP_TOKENS))
async def test_encode_rows_of_a_clip_are_the_plans_token_count(family: str) -> None:
    engine = await engine_for(build_tiny_model(family))
    audio_token = engine.spec.core.audio_token_id
    ids = [151644, 151647, audio_token, 151648, 151647, audio_token, 151648, 151645]
    clips = [wav_bytes(np.zeros((n, 1), np.float32), 16000, "s16") for n in (16000, 700_000)]
    plan = _mm.process(engine.spec.core, ids, clips, count_only=True, modalities=["audio"] * 2)
    inputs = []
    for item in plan.items:
        frames = int(item.image_grid_thw[0][2])
        inputs.append(MediaInput(item.hash, torch.zeros(128, frames), (1, 1, frames), "audio"))
    encoded = await engine.encode(inputs)
    assert [e.num_tokens for e in encoded] == [item.num_tokens for item in plan.items]
    assert [item.num_tokens for item in plan.items] == CLIP_TOKENS[family]
