"""What structured outputs cost on the hf engine, against anchors measured in the same run.

- decode under a JSON Schema: CPU time per decoded token against the same engine's free
  decode (goal: at most 1.10x), and the grammar's share of each step (the matcher's mask, the
  mask on the logits, the matcher's advance) measured over the same tokens;
- a cached grammar: what it adds to a request, the frontend's check and the engine's lookup
  with its choice's matcher (goal: under 1 ms);
- compiling a schema of 50 properties, cold (a new cache) and cached;
- against xgrammar's own transformers logits processor (`xgrammar.contrib.hf`) in
  transformers' `generate`, on the same model, schema and prompt: constrained tokens per CPU
  second (goal: at least equal).

Every case alternates with its anchor (drift charges both alike) and reports its median;
times are the process's CPU time with torch on one thread, steadier than wall time on a shared
machine. `--quick` runs fewer rounds; `--family` picks a tiny model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.sampling import alternate
from mmserve.engines.hf import HfEngine
from mmserve.grammar.cache import GrammarCache, check
from mmserve.grammar.constraint import Constraint
from mmserve.grammar.mask import apply_bitmask, new_bitmask
from mmserve.grammar.xgrammar_backend import XGrammarCompiled
from mmserve.protocol import Grammar, SamplingParams, StopConditions
from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.engines import expand_prompt, planned_request

PROMPT = "List the boats in the harbour as JSON: each one's name, length and whether it sails."
# Long enough an output to time the steps of: eight objects, each a bounded string and two
# numbers.
SCHEMA = {
    "type": "object",
    "properties": {
        "boats": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "length": {"type": "integer", "minimum": 1, "maximum": 400},
                    "sails": {"type": "boolean"},
                },
                "required": ["name", "length", "sails"],
            },
            "minItems": 8,
            "maxItems": 8,
        }
    },
    "required": ["boats"],
}
WIDE = {
    "type": "object",
    "properties": {
        f"field_{i}": [
            {"type": "integer", "minimum": 0, "maximum": 1000},
            {"type": "string", "maxLength": 16},
            {"type": "boolean"},
            {"enum": ["low", "mid", "high"]},
            {"type": "number", "minimum": -1, "maximum": 1},
        ][i % 5]
        for i in range(50)
    },
    "required": [f"field_{i}" for i in range(50)],
}
GOALS = {"decode": 1.10, "cached": 1.0, "vs xgrammar hf": 1.0}


def _median(samples: list[float]) -> float:
    return statistics.median(samples)


async def decode(engine: HfEngine, ids: list[int], sampling: SamplingParams, tokens: int):
    """CPU seconds per token of one greedy stream, its tokens and its text."""
    stop = StopConditions(max_tokens=tokens)
    request = planned_request("bench", ids, [], sampling, stop, model=engine.model)
    started = time.process_time()
    chunks = [chunk async for chunk in engine.generate(request, [])]
    made = [token for chunk in chunks for token in chunk.token_ids]
    return (time.process_time() - started) / len(made), made


def grammar_share(constraint_of: Callable[[], Constraint], tokens: list[int], vocab: int):
    """CPU ms per step of the grammar's parts over `tokens`: the matcher's mask, the mask on
    a row of logits, the matcher's advance."""
    constraint = constraint_of()
    logits = torch.randn(1, vocab)
    fill = apply = accept = 0.0
    for token in tokens:
        bitmask = new_bitmask(1, vocab)
        started = time.process_time()
        needed = constraint.fill(bitmask, 0)
        filled = time.process_time()
        if needed:
            apply_bitmask(logits, bitmask, [0])
        applied = time.process_time()
        if constraint.terminated:
            break
        constraint.observe(token)
        accepted = time.process_time()
        fill += filled - started
        apply += applied - filled
        accept += accepted - applied
    steps = len(tokens)
    return fill / steps * 1e3, apply / steps * 1e3, accept / steps * 1e3


async def cached_cost(cache: GrammarCache, grammar: Grammar, rounds: int) -> float:
    """CPU ms a request under an already compiled `grammar` spends on it: the frontend's check
    and the engine's lookup with one matcher."""
    await check(grammar)
    await cache.compiled(grammar)
    samples = []
    for _ in range(rounds * 20):
        started = time.process_time()
        await check(grammar)
        Constraint(await cache.compiled(grammar))
        samples.append(time.process_time() - started)
    return _median(samples) * 1e3


async def compile_times(engine: HfEngine, rounds: int) -> tuple[float, float]:
    """CPU seconds to compile `WIDE` in a new cache (the vocabulary read aside), and cached."""
    grammar = Grammar(kind="json_schema", spec=json.dumps(WIDE))
    colds, hits = [], []
    for _ in range(rounds):
        cache = GrammarCache.for_tokenizer(
            engine.tokenizer, engine.vocab_size, engine.spec.eos_token_ids
        )
        await cache.compiled(Grammar(kind="regex", spec="a"))  # reads the vocabulary
        started = time.process_time()
        await cache.compiled(grammar)
        colds.append(time.process_time() - started)
        started = time.process_time()
        await cache.compiled(grammar)
        hits.append(time.process_time() - started)
        cache.close()
    return _median(colds), _median(hits)


def hf_generate(engine: HfEngine, ids: list[int], grammar: Any, tokens: int) -> tuple[float, int]:
    """CPU seconds per token of transformers' greedy `generate` with xgrammar's logits
    processor (a new one per call, as it asks), and the tokens it made."""
    from transformers import LogitsProcessorList
    from xgrammar.contrib.hf import LogitsProcessor

    prompt = torch.tensor([ids])
    processor = LogitsProcessorList([LogitsProcessor(grammar)])
    started = time.process_time()
    with torch.inference_mode():
        out = engine.model.generate(
            prompt, logits_processor=processor, max_new_tokens=tokens, do_sample=False
        )
    made = out.shape[1] - prompt.shape[1]
    return (time.process_time() - started) / made, made


async def run(family: str, rounds: int, tokens: int) -> None:
    torch.set_num_threads(1)
    engine = HfEngine(build_tiny_model(family), prefix_cache_bytes=None)
    ids = expand_prompt(engine.tokenizer, [PROMPT], [])
    grammar = Grammar(kind="json_schema", spec=json.dumps(SCHEMA))
    free = SamplingParams(temperature=0.0)
    constrained = SamplingParams(temperature=0.0, grammar=grammar)
    _, made = await decode(engine, ids, constrained, tokens)  # compiles, warms up
    _, free_made = await decode(engine, ids, free, len(made))
    rows = []

    async def per_token(sampling: SamplingParams) -> float:
        return (await decode(engine, ids, sampling, len(made)))[0]

    plain, masked = await alternate(rounds, lambda: per_token(free), lambda: per_token(constrained))
    rows.append(("decode", "CPU ms/token", plain * 1e3, masked * 1e3))
    compiled = await engine.grammars.compiled(grammar)
    fill, apply, accept = grammar_share(lambda: Constraint(compiled), made, engine.vocab_size)
    cached = await cached_cost(engine.grammars, grammar, rounds)
    rows.append(("cached", "CPU ms/request", 1.0, cached))
    cold, hit = await compile_times(engine, rounds)

    assert isinstance(compiled, XGrammarCompiled)  # its processor takes xgrammar's own
    xgr_compiled = compiled.native
    samples = []
    for _ in range(rounds):
        theirs, their_made = hf_generate(engine, ids, xgr_compiled, tokens)
        ours = (await decode(engine, ids, constrained, tokens))[0]
        samples.append((theirs, ours))
    theirs = _median([t for t, _ in samples])
    ours = _median([o for _, o in samples])
    rows.append(("vs xgrammar hf", "tokens/CPU s", 1 / theirs, 1 / ours))
    await engine.close()

    print(f"hf engine, tiny {family}, {len(ids)} prompt tokens; {len(made)} constrained tokens "
          f"(free: {len(free_made)}), transformers' generate: {their_made}")  # fmt: skip
    print(f"{'case':16s} {'unit':15s} {'anchor':>9s} {'case':>9s} {'ratio':>7s} {'goal':>6s}")
    for name, unit, anchor, case in rows:
        goal = GOALS.get(name)
        mark = "" if goal is None else f"{goal:5.2f}x"
        print(f"{name:16s} {unit:15s} {anchor:9.4f} {case:9.4f} {case / anchor:6.2f}x {mark:>6s}")
    print(f"grammar per step: mask {fill:.3f} ms, on the logits {apply:.3f} ms, advance "
          f"{accept:.3f} ms (of {masked * 1e3:.2f} ms)")  # fmt: skip
    print(f"50-property schema: compile {cold * 1e3:.1f} ms cold, {hit * 1e3:.3f} ms cached")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen2_vl", help="tiny model family")
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of 9")
    parser.add_argument("--tokens", type=int, default=256, help="most tokens per completion")
    args = parser.parse_args()
    asyncio.run(run(args.family, 3 if args.quick else 9, args.tokens))


if __name__ == "__main__":
    main()
