"""A completion resumed on another engine (`EngineRequest.resumed`, what a migration sends)
goes on exactly as the fault-free one: the same tokens after the cut (greedy, and seeded with
the penalties and `min_tokens` in play), the same log-probabilities, the same text however the
cut falls (a stop string across it, held-back text), the usage of the whole completion; the
same through a prefill/decode handover; and a resumed choice of `n` > 1 continues its own
stream; a completion under a grammar goes on inside it."""

from __future__ import annotations

import dataclasses
import json

import msgspec
import pytest

from mmserve.engines.base import Engine, EngineError, EngineRequest
from mmserve.engines.hf import HfEngine
from mmserve.engines.mock import MockEngine
from mmserve.protocol import (
    Grammar,
    RequestPlan,
    Resumption,
    SamplingParams,
    StopConditions,
    TokenChunk,
)
from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.engines import expand_prompt, make_image, planned_request, preprocess

MAX_TOKENS = 20
LONG = StopConditions(max_tokens=MAX_TOKENS, ignore_eos=True)
# A tiny model's distribution over its vocabulary is nearly flat: at higher temperatures a
# draw may fall within float32 rounding of the boundary between two ids, where the prefill of
# the prompt and the tokens so far and the decode steps that made them differ (seen on Gemma
# 3's 262k ids at 0.5: 147609 for 147610).
SEEDED = SamplingParams(
    temperature=0.3,
    seed=5,
    frequency_penalty=0.6,
    presence_penalty=0.4,
    repetition_penalty=1.3,
    logprobs=2,
)


# The fast tier keeps one family (`tests/conftest.py`); Gemma 3 brings 1-D positions.
@pytest.fixture(scope="module", params=["qwen2_vl", pytest.param("gemma3", marks=pytest.mark.slow)])
def hf_engine(request: pytest.FixtureRequest) -> HfEngine:
    return HfEngine(build_tiny_model(request.param))


@pytest.fixture(scope="module")
def mock_engine() -> MockEngine:
    return MockEngine(build_tiny_model("qwen2_vl"), decode_ms_per_token=0, prefill_us_per_token=0)


async def prompt(engine: HfEngine | MockEngine, sampling: SamplingParams, stop: StopConditions):
    """A prompt with an image: the request and its embeddings."""
    items = preprocess(engine.spec.path, [make_image(84, 56, seed=4)])
    ids = expand_prompt(engine.tokenizer, ["Tell a long story about it."], items)
    model = engine.model if isinstance(engine, HfEngine) else None
    request = planned_request("r", ids, items, sampling, stop, model=model)
    return request, await engine.encode(items)


def resumed(request: EngineRequest, choice: int, tokens: list[int]) -> EngineRequest:
    """`request` as a migration sends it: the plan, one choice and its tokens so far."""
    plan = RequestPlan(
        token_ids=list(request.token_ids), media=list(request.media), positions=request.positions
    )
    return EngineRequest.from_plan(
        "r2",
        plan,
        msgspec.structs.replace(request.sampling, n=1, prompt_logprobs=None),
        request.stop,
        Resumption(choice=choice, token_ids=tokens),
    )


async def collect(engine: Engine, request: EngineRequest, embeddings) -> list[TokenChunk]:
    return [chunk async for chunk in engine.generate(request, embeddings)]


def of_choice(chunks: list[TokenChunk], choice: int) -> list[TokenChunk]:
    return [chunk for chunk in chunks if chunk.index == choice]


def tokens(chunks: list[TokenChunk]) -> list[int]:
    return [token for chunk in chunks for token in chunk.token_ids]


async def check_resumes(
    engine: Engine, request: EngineRequest, embeddings, choice: int, cuts: list[int]
) -> None:
    """At each cut the resumed completion gives the rest of choice `choice`'s fault-free
    chunks: tokens, text, log-probabilities and finish; its usage counts the prompt alone as
    prompt and every token as completion."""
    free = of_choice(await collect(engine, request, embeddings), choice)
    for cut in cuts:
        sent = free[:cut]
        rest = await collect(engine, resumed(request, choice, tokens(sent)), embeddings)
        assert {chunk.index for chunk in rest} == {choice}
        assert tokens(rest) == tokens(free[cut:]), cut
        assert "".join(c.text for c in sent + rest) == "".join(c.text for c in free), cut
        assert [c.finish_reason for c in rest] == [c.finish_reason for c in free[cut:]]
        for ours, theirs in zip(rest, free[cut:], strict=True):
            assert [lp.token_id for lp in ours.logprobs] == [lp.token_id for lp in theirs.logprobs]
            assert [lp.logprob for lp in ours.logprobs] == pytest.approx(
                [lp.logprob for lp in theirs.logprobs], abs=1e-4
            )
        usage = rest[-1].usage
        assert usage is not None
        assert usage.prompt_tokens == len(request.token_ids)
        assert usage.completion_tokens == len(tokens(free))


async def test_greedy_completion_goes_on_with_the_same_tokens(hf_engine: HfEngine):
    request, embeddings = await prompt(hf_engine, SamplingParams(temperature=0), LONG)
    await check_resumes(hf_engine, request, embeddings, 0, [1, 6, MAX_TOKENS - 1])


async def test_seeded_penalised_completion_goes_on_with_the_same_draws(hf_engine: HfEngine):
    stop = StopConditions(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS - 2)
    request, embeddings = await prompt(hf_engine, SEEDED, stop)
    await check_resumes(hf_engine, request, embeddings, 0, [3, 11])


async def test_a_resumed_choice_of_several_continues_its_own_stream(hf_engine: HfEngine):
    sampling = msgspec.structs.replace(SEEDED, n=3)
    request, embeddings = await prompt(hf_engine, sampling, LONG)
    await check_resumes(hf_engine, request, embeddings, 2, [7])


async def test_a_stop_string_across_the_cut_still_ends_the_text(hf_engine: HfEngine):
    request, embeddings = await prompt(hf_engine, SEEDED, LONG)  # varied text
    free = await collect(hf_engine, request, embeddings)
    pieces = [str(hf_engine.tokenizer.decode([token])) for token in tokens(free)]
    full = "".join(pieces)
    # A stop string made of the end of token `cut - 1`'s text and the start of token `cut`'s,
    # found nowhere before: the text held back at the cut is the stop string's start.
    boundaries = [(cut, width) for cut in range(2, len(pieces)) for width in (1, 2, 4, 8)]
    for cut, width in boundaries:
        left, right = pieces[cut - 1][-width:], pieces[cut][:width]
        stop_string = left + right
        if left and right and full.find(stop_string) == len("".join(pieces[:cut])) - len(left):
            break
    else:
        pytest.fail("no token boundary with visible text in the generated text")
    stopped = dataclasses.replace(request, stop=msgspec.structs.replace(LONG, stop=[stop_string]))
    await check_resumes(hf_engine, stopped, embeddings, 0, [cut])


async def test_a_resumed_completion_through_a_prefill_decode_handover(hf_engine: HfEngine):
    request, embeddings = await prompt(hf_engine, SEEDED, LONG)
    free = await collect(hf_engine, request, embeddings)
    again = resumed(request, 0, tokens(free[:5]))
    kv = await hf_engine.prefill(again, embeddings)
    tensors = await hf_engine.export_kv(kv)
    done = kv.prefill_done()
    hf_engine.release(kv)
    imported = await hf_engine.import_kv(again, done, tensors)
    rest = [chunk async for chunk in hf_engine.decode(imported, again.sampling, again.stop)]
    assert tokens(rest) == tokens(free[5:])
    assert "".join(c.text for c in free[:5] + rest) == "".join(c.text for c in free)


async def test_mock_completions_go_on_where_they_were_cut(mock_engine: MockEngine):
    request, embeddings = await prompt(mock_engine, SamplingParams(temperature=1.0, n=2), LONG)
    for choice in (0, 1):
        await check_resumes(mock_engine, request, embeddings, choice, [1, 9])


# Long enough an output to cut it at its 12th token: four names, four numbers.
GRAMMAR = Grammar(
    kind="json_schema",
    spec=json.dumps(
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 4},
                    "n": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["name", "n"],
            },
            "minItems": 4,
            "maxItems": 4,
        }
    ),
)


async def test_a_resumed_completion_goes_on_inside_its_grammar(
    hf_engine: HfEngine, mock_engine: MockEngine
):
    """The resumed choice's matcher is rebuilt past its tokens so far: the rest follows the
    grammar, ends where it ends ("stop"), and is what the fault-free completion had."""
    stop = StopConditions(max_tokens=200)
    sampling = msgspec.structs.replace(SEEDED, n=2, grammar=GRAMMAR)
    for engine in (hf_engine, mock_engine):
        request, embeddings = await prompt(engine, sampling, stop)
        await check_resumes(engine, request, embeddings, 1, [1, 12])


@pytest.mark.parametrize("hf_engine", ["qwen2_vl"], indirect=True)  # Gemma 3's are 1-D
def test_resumed_positions_are_the_models_own(hf_engine: HfEngine):
    """The plan's M-RoPE positions carried over the completion's tokens are those the model's
    own `get_rope_index` gives the prompt and those tokens."""
    items = preprocess(hf_engine.spec.path, [make_image(84, 56, seed=4)])
    ids = expand_prompt(hf_engine.tokenizer, ["Tell a long story about it."], items)
    generated = [1000, 2000, 3000]
    request = planned_request("r", ids, items, model=hf_engine.model)
    extended = planned_request("r", [*ids, *generated], items, model=hf_engine.model)
    assert resumed(request, 0, generated).positions == extended.positions


def test_a_resumed_request_has_one_choice() -> None:
    with pytest.raises(EngineError, match="one choice"):
        EngineRequest.from_plan(
            "r",
            RequestPlan(token_ids=[1, 2, 3]),
            SamplingParams(n=2),
            resumed=Resumption(choice=0, token_ids=[4]),
        )
