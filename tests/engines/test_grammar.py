"""Structured outputs on the engines themselves (tiny Qwen2-VL, in process): outputs of
generated schemas validate, sampled and greedy, each choice with its own matcher; a prefill's
KV exported and imported continues the grammar and gives what the aggregated engine gives for
the same seed (the P/D handover); the grammar starts after its `start_after` token; a compile past
the timeout is the client's error while the engine serves on; the mock engine's tokens follow
the grammar too."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import pytest

from mmserve.engines.hf import HfEngine
from mmserve.engines.mock import MockEngine
from mmserve.grammar.base import GrammarTimeout
from mmserve.protocol import Grammar, SamplingParams, StopConditions
from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.engines import planned_request
from tests.support.schemas import random_schema, validates

PROMPT = list(range(1000, 1040))
SCHEMAS = 4


def _request(sampling: SamplingParams, max_tokens: int = 300, request_id: str = "r"):
    return planned_request(request_id, PROMPT, [], sampling, StopConditions(max_tokens=max_tokens))


async def _texts(engine, sampling: SamplingParams, **kw) -> list[tuple[str, str | None]]:
    texts = [""] * sampling.n
    finishes: list[str | None] = [None] * sampling.n
    async for chunk in engine.generate(_request(sampling, **kw)):
        texts[chunk.index] += chunk.text
        finishes[chunk.index] = chunk.finish_reason or finishes[chunk.index]
    return list(zip(texts, finishes, strict=True))


async def _handed_over(engine, other, sampling: SamplingParams) -> list[tuple[str, str | None]]:
    """The completion with its prefill on `engine` and its decode on `other` (the KV
    exported and imported, as P/D moves it)."""
    request = _request(sampling)
    kv = await engine.prefill(request)
    tensors = await engine.export_kv(kv)
    done = kv.prefill_done()
    engine.release(kv)
    imported = await other.import_kv(request, done, tensors)
    texts = [""] * sampling.n
    finishes: list[str | None] = [None] * sampling.n
    async for chunk in other.decode(imported, request.sampling, request.stop):
        texts[chunk.index] += chunk.text
        finishes[chunk.index] = chunk.finish_reason or finishes[chunk.index]
    return list(zip(texts, finishes, strict=True))


@pytest.fixture(scope="module")
def model() -> Path:
    return build_tiny_model("qwen2_vl")


async def test_outputs_of_generated_schemas_validate_greedy_and_sampled(model: Path) -> None:
    engine = await HfEngine.load(model, prefix_cache_bytes=None)
    broken = []
    for seed in range(SCHEMAS):
        schema = random_schema(1000 + seed)
        grammar = Grammar(kind="json_schema", spec=json.dumps(schema))
        for sampling in (
            SamplingParams(temperature=0.0, grammar=grammar),
            SamplingParams(temperature=1.0, seed=seed, n=3, grammar=grammar),
        ):
            for text, finish in await _texts(engine, sampling):
                if finish != "stop" or not validates(schema, text):
                    broken.append(f"{finish}: {text!r} for {json.dumps(schema)}")
    await engine.close()
    assert not broken, "\n".join(broken[:5])


async def test_a_decode_elsewhere_continues_the_grammar_as_the_aggregated_engine(
    model: Path,
) -> None:
    """The KV exported and imported again (into the engine that made it: what decode holds is
    only the tensors, the plan and the `PrefillDone`; tests/e2e moves them across processes)."""
    prefill = decode = await HfEngine.load(model, prefix_cache_bytes=None)
    schema = random_schema(7)
    grammar = Grammar(kind="json_schema", spec=json.dumps(schema))
    sampling = SamplingParams(temperature=1.0, seed=11, n=2, grammar=grammar)
    aggregated = await _texts(prefill, sampling)
    assert all(finish == "stop" and validates(schema, text) for text, finish in aggregated)
    assert await _handed_over(prefill, decode, sampling) == aggregated
    regex = SamplingParams(temperature=0.0, grammar=Grammar(kind="regex", spec=r"[a-z]{3}\d{2}"))
    aggregated = await _texts(prefill, regex)
    assert re.fullmatch(r"[a-z]{3}\d{2}", aggregated[0][0])
    assert await _handed_over(prefill, decode, regex) == aggregated
    await prefill.close()


async def test_the_grammar_starts_after_its_start_token(model: Path) -> None:
    """Free text until `start_after` (here forced first by logit_bias, as a reasoning model
    writes its `</think>`), then the grammar."""
    engine = await HfEngine.load(model, prefix_cache_bytes=None)
    think_end = engine.spec.vision_end_token_id
    grammar = Grammar(kind="choice", spec='["yes", "no"]', start_after=think_end)
    sampling = SamplingParams(temperature=0.0, logit_bias={think_end: 100.0}, grammar=grammar)
    request = _request(sampling)
    tokens = [t async for chunk in engine.generate(request) for t in chunk.token_ids]
    assert tokens[0] == think_end
    assert engine.tokenizer.decode(tokens[1:], skip_special_tokens=True) in ("yes", "no")
    await engine.close()


async def test_a_compile_past_the_timeout_is_refused_while_the_engine_serves_on(
    model: Path,
) -> None:
    engine = await HfEngine.load(model, prefix_cache_bytes=None, grammar_compile_timeout_s=0.2)
    await engine.grammars.compiled(Grammar(kind="regex", spec="a"))  # the vocabulary, read
    # Strings of up to 100 characters: seconds to compile.
    hostile = Grammar(kind="json_schema", spec='{"type": "string", "maxLength": 100}')
    started = time.monotonic()
    refused, served = await asyncio.gather(
        _texts(engine, SamplingParams(temperature=0.0, grammar=hostile)),
        _texts(engine, SamplingParams(temperature=0.0), max_tokens=8),
        return_exceptions=True,
    )
    assert isinstance(refused, GrammarTimeout), refused
    assert time.monotonic() - started < 5
    assert not isinstance(served, BaseException) and served[0][1] == "length"
    await engine.close()


async def test_the_mock_engines_tokens_follow_the_grammar_in_agg_and_p_d(model: Path) -> None:
    engine = other = await MockEngine.load(model, decode_ms_per_token=0, prefill_us_per_token=0)
    for grammar, holds in [
        (Grammar(kind="regex", spec=r"\d{3}-[a-z]{2,4}"), r"\d{3}-[a-z]{2,4}"),
        (Grammar(kind="choice", spec='["left", "right"]'), r"left|right"),
    ]:
        sampling = SamplingParams(temperature=1.0, n=3, grammar=grammar)
        aggregated = await _texts(engine, sampling)
        assert all(finish == "stop" and re.fullmatch(holds, t) for t, finish in aggregated)
        assert await _handed_over(engine, other, sampling) == aggregated
    schema = random_schema(3)
    sampling = SamplingParams(
        temperature=1.0, n=2, grammar=Grammar(kind="json_schema", spec=json.dumps(schema))
    )
    assert all(validates(schema, text) for text, _ in await _texts(engine, sampling))
    await engine.close()
