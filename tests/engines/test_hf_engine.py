"""The hf engine against transformers' own `generate`, on every tiny family."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest
import torch

from mmserve.engines import hf
from mmserve.engines.base import GREEDY, EngineError, EngineOverloaded, EngineRequest, MediaGone
from mmserve.engines.hf import HfEngine
from mmserve.protocol import (
    KvCleared,
    KvRemoved,
    KvStored,
    SamplingParams,
    StopConditions,
    TokenChunk,
)
from tests.support.engines import (
    expand_prompt,
    make_image,
    planned_request,
    preprocess,
    reference_generate,
)

EIGHT_TOKENS = StopConditions(max_tokens=8, ignore_eos=True)


def replace_rows(positions):
    """The plan's positions missing their last column."""
    return msgspec.structs.replace(positions, rows=positions.rows[:-3])


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> HfEngine:
    return HfEngine(tiny_model)


def prefix_reusing_engine(model: Path, **options) -> HfEngine:
    """A fresh engine for a prefix-cache test (a hybrid model reuses no prefix blocks:
    `test_a_hybrid_model_claims_no_prefix_hit_and_announces_no_block`)."""
    engine = HfEngine(model, **options)
    assert engine.spec.reuses_prefix_blocks, f"{model.name} is hybrid: list it in HYBRID_FAMILIES"
    return engine


async def collect(stream) -> list[TokenChunk]:
    return [chunk async for chunk in stream]


def tokens_of(chunks: list[TokenChunk]) -> list[int]:
    return [token for chunk in chunks for token in chunk.token_ids]


async def run(
    engine: HfEngine,
    ids: list[int],
    items=(),
    sampling: SamplingParams = GREEDY,
    stop: StopConditions = EIGHT_TOKENS,
    request_id: str = "r",
) -> list[TokenChunk]:
    embeddings = await engine.encode(items)
    request = planned_request(request_id, ids, items, sampling, stop, model=engine.model)
    return await collect(engine.generate(request, embeddings))


@pytest.mark.parametrize("num_images", [0, 1, 3])
async def test_greedy_tokens_match_transformers_generate(engine: HfEngine, num_images: int):
    # Different sizes and aspect ratios, so every item has its own grid.
    images = [make_image(56 + 28 * i, 84 - 14 * i, seed=i) for i in range(num_images)]
    items = preprocess(engine.spec.path, images)
    ids = expand_prompt(engine.tokenizer, [f"Describe {num_images} images."], items)
    expected, _ = reference_generate(engine.model, ids, items, max_new_tokens=8)

    chunks = await run(engine, ids, items, request_id=f"images-{num_images}")

    assert tokens_of(chunks) == expected
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == len(ids)
    assert chunks[-1].usage.completion_tokens == 8


async def test_repeated_image_skips_the_vision_tower(engine: HfEngine):
    items = preprocess(engine.spec.path, [make_image(84, 56, seed=11)])
    first = await engine.encode(items)
    hits = engine.encoder_cache.hits
    second = await engine.encode(items)
    assert engine.encoder_cache.hits == hits + 1
    assert second[0].embeddings is first[0].embeddings
    assert len(first[0].deepstack) == (2 if engine.spec.deepstack_layers else 0)


async def test_encoder_cache_key_separates_grids_under_one_hash(engine: HfEngine):
    # The same content hash preprocessed to another grid (other pixel bounds) is another entry.
    wide, tall = preprocess(engine.spec.path, [make_image(112, 56, 12), make_image(56, 112, 12)])
    tall = type(tall)(wide.mm_hash, tall.pixel_values, tall.grid_thw)
    first, second = await engine.encode([wide]), await engine.encode([tall])
    if engine.spec.vision_input == "image":
        # A fixed-size tower gives every image one grid: the hash alone is the key.
        assert wide.grid_thw == tall.grid_thw
        assert second[0].embeddings is first[0].embeddings
        return
    assert wide.grid_thw != tall.grid_thw
    assert second[0].grid_thw == tall.grid_thw
    assert not torch.equal(first[0].embeddings, second[0].embeddings)


async def test_prefix_cache_reuses_blocks_with_identical_output(prefix_reusing_model: Path):
    engine = prefix_reusing_engine(prefix_reusing_model)
    events: list = []
    engine.subscribe_kv_events(events.append)
    items = preprocess(prefix_reusing_model, [make_image(84, 56, seed=3)])
    ids_a = expand_prompt(engine.tokenizer, ["First question about it."], items)
    ids_b = expand_prompt(engine.tokenizer, ["Another, different question."], items)

    first = await run(engine, ids_a, items)
    again = await run(engine, ids_a, items)
    assert first[-1].usage.cached_tokens == 0
    assert again[-1].usage.cached_tokens == (len(ids_a) - 1) // 16 * 16
    assert tokens_of(again) == tokens_of(first)
    stored = [event for event in events if isinstance(event, KvStored)]
    assert sum(len(event.blocks) for event in stored) == len(ids_a) // 16

    # A new question about the same image reuses the blocks holding the image tokens and still
    # gives transformers' tokens.
    other = await run(engine, ids_b, items)
    expected, _ = reference_generate(engine.model, ids_b, items, max_new_tokens=8)
    assert other[-1].usage.cached_tokens > 0
    assert tokens_of(other) == expected

    # A different image with the same token count must not hit the image blocks.
    other_items = preprocess(prefix_reusing_model, [make_image(84, 56, seed=4)])
    changed = await run(engine, ids_a, other_items)
    image_start = ids_a.index(engine.spec.image_token_id)
    assert changed[-1].usage.cached_tokens <= image_start // 16 * 16


async def test_a_hybrid_model_claims_no_prefix_hit_and_announces_no_block(hybrid_model: Path):
    """Qwen3.5's linear-attention states exist only at the end of the prompt that made them, so
    a repeat runs cold to the same tokens, no KV event announces a block, an item named by its
    id alone is refused, and a KV export without the states does not import."""
    engine = HfEngine(hybrid_model)
    assert not engine.spec.reuses_prefix_blocks
    events: list = []
    engine.subscribe_kv_events(events.append)
    items = preprocess(hybrid_model, [make_image(84, 56, seed=3)])
    ids = expand_prompt(engine.tokenizer, ["First question about it."], items)
    assert len(ids) > 2 * engine.prefix_cache.block_size

    first = await run(engine, ids, items)
    again = await run(engine, ids, items)
    assert first[-1].usage.cached_tokens == again[-1].usage.cached_tokens == 0
    assert tokens_of(again) == tokens_of(first)
    assert events == [] and engine.kv_cache_snapshot() == []
    request = planned_request("s", ids, items, GREEDY, EIGHT_TOKENS, model=engine.model)
    with pytest.raises(MediaGone, match="media item 0"):
        await engine.prefill(request, [None])

    kv = await engine.prefill(request, await engine.encode(items))
    tensors = await engine.export_kv(kv)
    engine.release(kv)
    assert tensors["conv_states"].shape[0] == tensors["recurrent_states"].shape[0] == 1
    stateless = {k: v for k, v in tensors.items() if k != "recurrent_states"}
    with pytest.raises(EngineError, match="linear-attention layers' states"):
        await engine.import_kv(request, kv.prefill_done(), stateless)


async def test_eviction_under_a_small_budget_emits_removed_events(prefix_reusing_model: Path):
    engine = prefix_reusing_engine(prefix_reusing_model, prefix_cache_blocks=2)
    events: list = []
    engine.subscribe_kv_events(events.append)
    ids = expand_prompt(engine.tokenizer, ["word " * 60], [])
    chunks = await run(engine, ids)
    removed = [hash_ for e in events if isinstance(e, KvRemoved) for hash_ in e.block_hashes]
    stored = [block.block_hash for e in events if isinstance(e, KvStored) for block in e.blocks]
    assert len(stored) == len(ids) // 16
    assert len(removed) == len(stored) - 2
    assert engine.prefix_cache.num_blocks == 2
    # The survivors are the chain's first blocks, so the repeat still hits them.
    again = await run(engine, ids)
    assert again[-1].usage.cached_tokens == 32
    assert tokens_of(again) == tokens_of(chunks)
    engine.prefix_cache.clear()
    assert isinstance(events[-1], KvCleared)


async def test_clear_caches_empties_both_caches_and_says_so(prefix_reusing_model: Path):
    engine = prefix_reusing_engine(prefix_reusing_model)
    events: list = []
    engine.subscribe_kv_events(events.append)
    items = preprocess(prefix_reusing_model, [make_image(84, 56, seed=5)])
    ids = expand_prompt(engine.tokenizer, ["What is it?"], items)
    first = await run(engine, ids, items)
    blocks = engine.prefix_cache.num_blocks
    assert blocks > 0

    cleared = await engine.clear_caches()

    assert (cleared.prefix_blocks, cleared.encoder_items) == (blocks, 1)
    assert engine.prefix_cache.num_blocks == 0 and engine.prefix_cache.num_bytes == 0
    assert isinstance(events[-1], KvCleared)
    assert engine.kv_cache_snapshot() == []
    # The repeat runs cold (the vision tower and every block again) to the same tokens.
    misses = engine.encoder_cache.misses
    again = await run(engine, ids, items)
    assert engine.encoder_cache.misses == misses + 1
    assert again[-1].usage.cached_tokens == 0
    assert tokens_of(again) == tokens_of(first)


async def test_an_item_without_its_embedding_is_served_from_the_prefix_cache(
    prefix_reusing_model: Path,
):
    """Items named by their media id alone whose embeddings no encoder cache holds (None) need
    none while the prefix cache holds all their tokens: the same tokens as with them. Once the
    prefix cache dropped them the engine refuses them (MediaGone)."""
    engine = prefix_reusing_engine(prefix_reusing_model)
    items = preprocess(
        prefix_reusing_model, [make_image(84, 56, seed=6), make_image(56, 56, seed=7)]
    )
    ids = expand_prompt(engine.tokenizer, ["Compare these two."], items)
    embeddings = await engine.encode(items)
    request = planned_request("r", ids, items, GREEDY, EIGHT_TOKENS, model=engine.model)
    first = await collect(engine.generate(request, embeddings))
    cached = (len(ids) - 1) // 16 * 16
    assert request.media[-1].end <= cached  # both images lie in the cached prefix

    again = await collect(engine.generate(replace(request, request_id="s"), [None, None]))
    assert tokens_of(again) == tokens_of(first)
    assert again[-1].usage.cached_tokens == cached

    await engine.clear_caches()
    with pytest.raises(MediaGone, match="media item 0"):
        await engine.prefill(replace(request, request_id="t"), [None, embeddings[1]])


async def test_seeded_sampling_is_reproducible(engine: HfEngine):
    ids = expand_prompt(engine.tokenizer, ["Tell a story."], [])
    sampling = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7)
    first = await run(engine, ids, sampling=sampling)
    second = await run(engine, ids, sampling=sampling)
    other = await run(engine, ids, sampling=SamplingParams(temperature=0.8, seed=8))
    assert tokens_of(first) == tokens_of(second)
    assert tokens_of(first) != tokens_of(other)


def choice_tokens(chunks: list[TokenChunk], n: int) -> list[list[int]]:
    return [[t for chunk in chunks if chunk.index == i for t in chunk.token_ids] for i in range(n)]


async def test_n_choices_from_one_prefill_sample_their_own_streams(engine: HfEngine):
    """Every choice draws from its own seeded stream over one batch: choice 0 is the n=1
    completion; choices that stop early leave the batch, and those left keep their tokens.

    A row's logits move with its batch's size at float32 rounding (the text model's and the
    head's matmuls), so a draw within that rounding of the boundary between two ids may flip
    (seen: 184476 for 184475 on Gemma 3 at temperature 1.5, where a tiny model's 262k ids are
    nearly uniform, and 42308 for 42309 on Qwen3-VL at 0.5); at 0.2 the mass sits on a few
    ids, so the boundaries between them are wide. A MoE's experts run as
    grouped matmuls whose rounding follows how many rows each expert gets (`torch._grouped_mm`,
    float32 only), larger moves (seen: the n=1 completion's tenth token 119140 for 119137,
    after other tests had run on the same engine): there choice 0 and the n=1 completion share
    their prefill-drawn first token, and each choice keeps its own first token and ends where
    its own stream stops."""
    batch_invariant = "moe" not in engine.spec.family
    ids = expand_prompt(engine.tokenizer, ["Tell a story."], [])
    sampling = SamplingParams(temperature=0.2, seed=3, n=4)
    long = StopConditions(max_tokens=12, ignore_eos=True)
    free = await run(engine, ids, sampling=sampling, stop=long)
    streams = choice_tokens(free, 4)
    assert all(len(tokens) == 12 for tokens in streams)
    assert len({tuple(tokens) for tokens in streams}) == 4  # four draws, not one
    alone = await run(engine, ids, sampling=msgspec.structs.replace(sampling, n=1), stop=long)
    assert (
        tokens_of(alone) == streams[0] if batch_invariant else tokens_of(alone)[0] == streams[0][0]
    )
    assert free[-1].usage is not None and free[-1].usage.completion_tokens == 48
    assert sum(chunk.finish_reason is not None for chunk in free) == 4

    # A token of choice 1's stream that choice 0's lacks: choice 1 stops there (leaving the
    # batch), choice 0 runs to its end with the same tokens; each stops where its own stops.
    stop_id = next(t for t in streams[1][1:] if t not in streams[0])
    stopped = await run(
        engine, ids, sampling=sampling, stop=msgspec.structs.replace(long, stop_token_ids=[stop_id])
    )
    for free_tokens, tokens in zip(streams, choice_tokens(stopped, 4), strict=True):
        end = free_tokens.index(stop_id) + 1 if stop_id in free_tokens else len(free_tokens)
        if batch_invariant:
            assert tokens == free_tokens[:end]
        else:
            assert tokens[0] == free_tokens[0]
            assert tokens[-1] == stop_id or len(tokens) == len(free_tokens)
    assert choice_tokens(stopped, 4)[1][-1] == stop_id
    assert stopped[-1].usage is not None


async def test_greedy_choices_are_one_text(engine: HfEngine):
    ids = expand_prompt(engine.tokenizer, ["Tell a story."], [])
    chunks = await run(engine, ids, sampling=msgspec.structs.replace(GREEDY, n=3))
    assert choice_tokens(chunks, 3) == [tokens_of(await run(engine, ids))] * 3


async def test_stop_string_across_a_token_boundary(engine: HfEngine):
    ids = expand_prompt(engine.tokenizer, ["Say something."], [])
    stop = StopConditions(max_tokens=24, ignore_eos=True)
    free = await run(engine, ids, stop=stop)
    pieces = [engine.tokenizer.decode([token]) for token in tokens_of(free)]
    full = "".join(chunk.text for chunk in free)
    # Find two neighbouring tokens with visible text; the stop string spans their boundary.
    for index in range(len(pieces) - 1):
        before = "".join(pieces[: index + 1])
        left, right = pieces[index], pieces[index + 1]
        if left and right and full.startswith(before):
            stop_string = left[-1] + right[0]
            if full.find(stop_string) == len(before) - 1:
                break
    else:
        pytest.fail("no token boundary with visible text in the generated text")

    cut = await run(
        engine, ids, stop=StopConditions(max_tokens=24, ignore_eos=True, stop=[stop_string])
    )
    text = "".join(chunk.text for chunk in cut)
    assert text == full[: len(before) - 1]
    assert stop_string not in text
    assert cut[-1].finish_reason == "stop"
    assert tokens_of(cut) == tokens_of(free)[: index + 2]
    assert cut[-1].usage.completion_tokens == index + 2
    included = await run(
        engine,
        ids,
        stop=StopConditions(
            max_tokens=24, ignore_eos=True, stop=[stop_string], include_stop_str_in_output=True
        ),
    )
    assert "".join(chunk.text for chunk in included) == full[: len(before) + 1]
    assert tokens_of(included) == tokens_of(cut)


async def test_stop_token_ids_end_the_stream(engine: HfEngine):
    ids = expand_prompt(engine.tokenizer, ["Count."], [])
    free = await run(engine, ids)
    stop_id = tokens_of(free)[2]
    stopped = await run(
        engine, ids, stop=StopConditions(max_tokens=8, ignore_eos=True, stop_token_ids=[stop_id])
    )
    expected = tokens_of(free)[: tokens_of(free).index(stop_id) + 1]
    assert tokens_of(stopped) == expected
    assert stopped[-1].finish_reason == "stop"
    assert stopped[-1].text == ""  # the stop id's text is left out...
    included = await run(
        engine,
        ids,
        stop=StopConditions(
            max_tokens=8, ignore_eos=True, stop_token_ids=[stop_id], include_stop_str_in_output=True
        ),
    )
    text = "".join(chunk.text for chunk in included)  # ...unless included
    assert text == engine.tokenizer.decode(expected, skip_special_tokens=True)


async def test_concurrent_streams_interleave_and_match_sequential(engine: HfEngine):
    prompts = [expand_prompt(engine.tokenizer, [f"Prompt number {i}."], []) for i in range(4)]
    sequential = [tokens_of(await run(engine, ids)) for ids in prompts]
    arrivals: list[int] = []

    async def stream(index: int) -> list[int]:
        request = EngineRequest(f"c{index}", tuple(prompts[index]), GREEDY, EIGHT_TOKENS)
        tokens = []
        async for chunk in engine.generate(request):
            arrivals.append(index)
            tokens += chunk.token_ids
        return tokens

    concurrent = await asyncio.gather(*(stream(i) for i in range(4)))
    assert list(concurrent) == sequential
    # Round-robin stepping: no stream runs to completion before the others start.
    assert arrivals[:4] != [arrivals[0]] * 4
    assert set(arrivals[:8]) == {0, 1, 2, 3}


async def test_queue_limit_raises_overloaded(tiny_model: Path):
    engine = HfEngine(tiny_model, max_queue=1)
    ids = expand_prompt(engine.tokenizer, ["Hello."], [])
    kv = await engine.prefill(EngineRequest("a", tuple(ids)))
    stream = engine.decode(kv, GREEDY, EIGHT_TOKENS)
    await anext(stream)
    with pytest.raises(EngineOverloaded, match="queue is full"):
        await engine.prefill(EngineRequest("b", tuple(ids)))
    await stream.aclose()
    kv = await engine.prefill(EngineRequest("b", tuple(ids)))
    engine.release(kv)
    await engine.close()


async def test_mismatched_embeddings_are_rejected(engine: HfEngine):
    items = preprocess(engine.spec.path, [make_image(56, 56, seed=5)])
    ids = expand_prompt(engine.tokenizer, ["Too few rows."], items)
    embeddings = await engine.encode(items)
    request = planned_request("bad", ids, items, model=engine.model)
    with pytest.raises(EngineError, match="embeddings for 1 media items"):
        await engine.prefill(request, [*embeddings, *embeddings])
    (item,) = request.media
    longer = replace(request, media=(msgspec.structs.replace(item, length=item.length + 1),))
    with pytest.raises(EngineError, match="rows"):
        await engine.prefill(longer, embeddings)
    if request.positions is not None:  # None: 1-D positions, nothing to mismatch
        short = replace(request, positions=replace_rows(request.positions))
        with pytest.raises(EngineError, match="positions"):
            await engine.prefill(short, embeddings)


async def test_positions_and_pixels_change_the_logits(engine: HfEngine):
    # Guards the tiny models' init scale: a model deaf to its inputs would pass every
    # equality test trivially.
    items = preprocess(engine.spec.path, [make_image(56, 56, seed=1)])
    darker = [type(items[0])(items[0].mm_hash + 1, items[0].pixel_values * 0.5, items[0].grid_thw)]
    ids = expand_prompt(engine.tokenizer, ["What is this?"], items)
    _, logits = reference_generate(engine.model, ids, items, max_new_tokens=1)
    _, logits_darker = reference_generate(engine.model, ids, darker, max_new_tokens=1)
    swapped = list(ids)
    swapped[-8], swapped[-9] = swapped[-9], swapped[-8]
    _, logits_swapped = reference_generate(engine.model, swapped, items, max_new_tokens=1)
    # Float noise between such runs is below 1e-4; these are changes in what the model says
    # (Qwen3.5's smallest: its 56x56 image is two tokens, its prompt ends in `<think>`, 0.26).
    assert (logits - logits_darker).abs().max() > 0.1
    assert (logits - logits_swapped).abs().max() > 0.05
    assert torch.isfinite(logits).all()


async def test_first_token_logits_are_bit_identical_to_generate(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
):
    # A fresh engine: no prefix-cache hit, all items through the vision tower together, so the
    # arithmetic is generate's own, operation for operation.
    seen: list[torch.Tensor] = []
    choose = hf.next_tokens

    def keep_logits(samplers, logits, banned=()):
        seen.append(logits[0].clone())
        return choose(samplers, logits, banned)

    monkeypatch.setattr(hf, "next_tokens", keep_logits)
    engine = HfEngine(tiny_model)
    images = [make_image(56 + 28 * i, 84 - 14 * i, seed=30 + i) for i in range(3)]
    items = preprocess(tiny_model, images)
    ids = expand_prompt(engine.tokenizer, ["Three pictures."], items)
    _, expected = reference_generate(engine.model, ids, items, max_new_tokens=1)
    request = planned_request("x", ids, items, model=engine.model)
    engine.release(await engine.prefill(request, await engine.encode(items)))
    assert torch.equal(seen[0], expected)


async def test_ignore_eos_and_min_tokens_move_where_generation_stops(
    engine: HfEngine, monkeypatch: pytest.MonkeyPatch
):
    """With the third greedy token as the checkpoint's EOS: the completion stops on it, runs
    on to max_tokens with ignore_eos, and with min_tokens it is masked until then (greedy takes
    the next best token) and may end the completion only after."""
    # The first prompt whose third greedy token is unlike the first two (random weights).
    for prompt in ("Count to ten.", "Name a colour.", "Say hello."):
        ids = expand_prompt(engine.tokenizer, [prompt], [])
        free = tokens_of(await run(engine, ids, request_id="free"))
        if free[2] not in free[:2]:
            break
    assert free[2] not in free[:2], "the test needs a third token unlike the first two"
    eos = free[2]
    monkeypatch.setattr(type(engine.spec), "eos_token_ids", property(lambda _: (eos,)))

    stopped = await run(engine, ids, stop=StopConditions(max_tokens=8), request_id="eos")
    assert tokens_of(stopped) == free[:3] and stopped[-1].finish_reason == "stop"
    assert stopped[-1].usage.completion_tokens == 3
    ignoring = await run(engine, ids, stop=EIGHT_TOKENS, request_id="ignore")
    assert tokens_of(ignoring) == free and ignoring[-1].finish_reason == "length"

    held = await run(engine, ids, stop=StopConditions(max_tokens=8, min_tokens=4), request_id="m")
    tokens = tokens_of(held)
    assert tokens[:2] == free[:2] and eos not in tokens[:4]
    assert len(tokens) > 4
    if eos in tokens:  # it may end the completion, only after min_tokens
        assert tokens.index(eos) == len(tokens) - 1 and held[-1].finish_reason == "stop"
    else:
        assert len(tokens) == 8 and held[-1].finish_reason == "length"
    # min_tokens = max_tokens: EOS never ends it.
    full = await run(engine, ids, stop=StopConditions(max_tokens=6, min_tokens=6), request_id="x")
    assert len(tokens_of(full)) == 6 and eos not in tokens_of(full)
    assert full[-1].finish_reason == "length"


async def test_prompt_logprobs_are_the_models_own_even_after_a_prefix_hit(
    prefix_reusing_model: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(hf, "_PROMPT_ROWS", 16)  # the prompt's logits in several slices
    engine = prefix_reusing_engine(prefix_reusing_model)
    ids = engine.tokenizer.encode("A prompt long enough to fill a few blocks of the cache. " * 3)
    with torch.inference_mode():
        logits = engine.model(input_ids=torch.tensor([ids])).logits[0]
    expected = torch.log_softmax(logits.float(), dim=-1)
    scoring = SamplingParams(temperature=0.0, prompt_logprobs=2)
    warm = await run(engine, ids, stop=StopConditions(max_tokens=1))  # fills the prefix cache
    assert warm[-1].usage.cached_tokens == 0
    for _ in range(2):
        chunks = await run(engine, ids, sampling=scoring, stop=StopConditions(max_tokens=1))
        assert chunks[-1].usage.cached_tokens == 0  # the whole prompt ran again
        prompt = chunks[0].prompt_logprobs
        assert [each.token_id for each in prompt] == ids[1:]
        got = torch.tensor([each.logprob for each in prompt])
        want = expected[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        for position, each in enumerate(prompt):
            best = torch.topk(expected[position], 2)
            assert [token for token, _ in each.top] == best.indices.tolist()
            assert (
                each.rank
                == int((expected[position] > expected[position, ids[position + 1]]).sum()) + 1
            )
        # The greedy completion token is the most likely one after the prompt.
        assert tokens_of(chunks) == [int(expected[-1].argmax())]


async def test_max_tokens_zero_scores_the_prompt_and_emits_no_token(engine: HfEngine):
    ids = engine.tokenizer.encode("Only the prompt is scored.")
    scoring = SamplingParams(temperature=0.0, prompt_logprobs=0)
    (chunk,) = await run(engine, ids, sampling=scoring, stop=StopConditions(max_tokens=0))
    assert chunk.token_ids == [] and chunk.finish_reason == "length"
    assert chunk.usage.completion_tokens == 0 and chunk.usage.prompt_tokens == len(ids)
    assert [each.token_id for each in chunk.prompt_logprobs] == ids[1:]
    assert all(each.top == [] for each in chunk.prompt_logprobs)
