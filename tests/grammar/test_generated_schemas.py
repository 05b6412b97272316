"""Several hundred JSON Schemas drawn at random (`tests.support.schemas`) through the engines'
own logits chain and stream (`engines.logits.next_tokens`, `engines.sampling.stream_completion`)
on the tiny Qwen tokenizer, with rows of random logits in place of a model (any token is as
likely as a random model makes it): every output of every choice is strict JSON that its
schema holds, complete ("stop") within the token budget. The engines' own runs, P/D included,
are in tests/engines/test_grammar.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from mmserve.engines.base import KvHandle
from mmserve.engines.logits import Sampler, next_tokens
from mmserve.engines.sampling import Step, StopRules, stream_completion
from mmserve.grammar.cache import GrammarCache
from mmserve.grammar.constraint import Constraint
from mmserve.models.family import resolve_model_spec
from mmserve.protocol import FirstToken, Grammar, SamplingParams, StopConditions, TokenLogprob
from mmserve.tiny.checkpoints import VOCAB_SIZE, build_tiny_model
from tests.support.schemas import random_schema, validates

SCHEMAS = 300
MAX_TOKENS = 400
PROMPT = (1, 2, 3)
BANK = 97  # rows of random logits, drawn from one after another (cheaper than drawing anew)

torch.set_num_threads(1)


class Chain:
    """One tokenizer's grammars, and completions drawn through the logits chain."""

    def __init__(self) -> None:
        path = build_tiny_model("qwen2_vl")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.eos = resolve_model_spec(path).eos_token_ids
        self.grammars = GrammarCache.for_tokenizer(self.tokenizer, VOCAB_SIZE, self.eos)
        self.bank = torch.randn(BANK, VOCAB_SIZE, generator=torch.Generator().manual_seed(0)) * 4

    async def complete(
        self, grammar: Grammar, seed: int, n: int = 2, temperature: float = 1.0, **stop: Any
    ) -> list[tuple[str, str | None]]:
        """`n` completions under `grammar`: each one's text and finish reason."""
        compiled = await self.grammars.compiled(grammar)
        params = SamplingParams(temperature=temperature, seed=seed, n=n, grammar=grammar)
        samplers = [
            Sampler(params, PROMPT, VOCAB_SIZE, torch.device("cpu"), seed, choice,
                    constraint=Constraint(compiled, grammar.start_after))
            for choice in range(n)
        ]  # fmt: skip
        conditions = StopConditions(max_tokens=MAX_TOKENS, **stop)
        rows = self._rows(seed, n)
        banned = StopRules(conditions, self.eos).banned(0)
        firsts = next_tokens(samplers, next(rows), banned)
        kv = KvHandle("r", len(PROMPT), [FirstToken(*each) for each in firsts], 0, None)

        async def step(steps: list[Step]) -> list[tuple[int, TokenLogprob | None]]:
            running = [samplers[choice] for choice, _, _ in steps]
            return next_tokens(running, next(rows)[: len(steps)], steps[0][2])

        texts = [""] * n
        finishes: list[str | None] = [None] * n
        stream = stream_completion(
            kv, conditions, self.eos, self.tokenizer.backend_tokenizer, step,
            lambda choice: samplers[choice].grammar_ended,
        )  # fmt: skip
        async for chunk in stream:
            texts[chunk.index] += chunk.text
            finishes[chunk.index] = chunk.finish_reason or finishes[chunk.index]
        return list(zip(texts, finishes, strict=True))

    def _rows(self, seed: int, n: int) -> Iterator[torch.Tensor]:
        """Rows of random logits for `n` choices, step after step, a stream of its own per
        seed."""
        step = seed
        while True:
            start = (step * 31) % (BANK - n)
            yield self.bank[start : start + n]  # a view: no copy
            step += 1


@pytest.fixture(scope="module")
def chain() -> Chain:
    return Chain()


def test_every_output_of_hundreds_of_schemas_validates(chain: Chain) -> None:
    async def run() -> list[str]:
        broken = []
        for seed in range(SCHEMAS):
            schema = random_schema(seed)
            grammar = Grammar(kind="json_schema", spec=json.dumps(schema))
            # Greedy choices, and two sampled ones, each with its own matcher.
            n, temperature = (2, 1.0) if seed % 3 == 0 else (1, 0.0)
            for text, finish in await chain.complete(grammar, seed, n, temperature):
                if finish != "stop" or not validates(schema, text):
                    broken.append(f"seed {seed} ({finish}): {text!r} for {json.dumps(schema)}")
        return broken

    broken = asyncio.run(run())
    assert not broken, "\n".join(broken[:5])


def test_any_whitespace_is_still_json(chain: Chain) -> None:
    """vLLM's default (whitespace wherever JSON allows it), for a schema of bounded size."""
    schema = {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}
    grammar = Grammar(kind="json_schema", spec=json.dumps(schema), any_whitespace=True)
    for text, _ in asyncio.run(chain.complete(grammar, seed=1, n=4)):
        # Random rows may spend the budget on whitespace: what came is a JSON prefix.
        assert text.lstrip().startswith("[")
        assert not text.strip() or validates(schema, text) or len(text) > 100


def test_a_bounded_string_holds_no_raw_control_character(chain: Chain) -> None:
    """xgrammar 0.2.8 lets raw control characters into a string with a length bound (not
    JSON); the repaired grammar does not."""
    schema = {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 8,
              "maxItems": 8}  # fmt: skip
    grammar = Grammar(kind="json_schema", spec=json.dumps(schema))
    outputs = asyncio.run(chain.complete(grammar, seed=5, n=8))
    for text, finish in outputs:
        assert finish == "stop" and validates(schema, text), text
        assert not any(ord(char) < 0x20 for char in text)


@pytest.mark.parametrize(
    ("grammar", "matches"),
    [
        (Grammar(kind="regex", spec=r"[a-c]{2,5}-\d{3}"), r"[a-c]{2,5}-\d{3}"),
        (Grammar(kind="choice", spec='["yes", "no", "per\\"haps"]'), r'yes|no|per"haps'),
        (Grammar(kind="ebnf", spec='root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'), r"\(\d+(\+\d+)*\)"),
        (Grammar(kind="ebnf", spec='start: "<" WORD ">"\nWORD: /[a-z]{1,6}/'), r"<[a-z]{1,6}>"),
    ],
)
def test_regex_choice_and_ebnf_outputs_match_whole(
    chain: Chain, grammar: Grammar, matches: str
) -> None:
    import re

    for seed in range(10):
        for text, finish in asyncio.run(chain.complete(grammar, seed, n=2)):
            assert finish == "stop" and re.fullmatch(matches, text), text


def test_a_complete_grammar_ends_its_choice_despite_min_tokens_and_ignore_eos(
    chain: Chain,
) -> None:
    grammar = Grammar(kind="choice", spec='["done"]')
    for stop in ({"min_tokens": 50}, {"ignore_eos": True}):
        assert asyncio.run(chain.complete(grammar, seed=2, n=1, **stop)) == [("done", "stop")]
