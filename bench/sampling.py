"""What the sampling options cost on the hf engine, against the plain request in the same run.

- `top_logprobs=5`: the time per decoded token with the chosen token's and the five most
  likely log-probabilities, against none (goal: at most 5% more);
- `n=4`: the time of four completions of one prompt (one prefill, one batch), against one
  (goal: at most 1.6x) and against four separate requests (what fanning out would cost).

Every case runs on one engine, alternating with its anchor (so drift charges both alike), and
reports its median. Times are the process's CPU time (torch on one thread, the event loop
idle while the engine's thread works): on an idle machine the wall time, and on a shared one
far steadier than it. `--quick` runs fewer rounds; `--family` picks a tiny model.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

import msgspec
import torch

from mmserve.engines.hf import HfEngine
from mmserve.protocol import SamplingParams, StopConditions
from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.engines import expand_prompt, planned_request

PROMPT = "Describe a quiet harbour town at dawn, its boats, its streets and its people."
GOALS = {"top_logprobs=5": 1.05, "n=4": 1.6}


async def completion_s(engine: HfEngine, ids: list[int], sampling: SamplingParams, tokens: int):
    """CPU seconds for one request's whole stream, and the tokens it made."""
    stop = StopConditions(max_tokens=tokens, ignore_eos=True)
    request = planned_request("bench", ids, [], sampling, stop, model=engine.model)
    started = time.process_time()
    made = sum([len(chunk.token_ids) async for chunk in engine.generate(request, [])])
    return time.process_time() - started, made


async def alternate(
    rounds: int, anchor: Callable[[], Awaitable[float]], case: Callable[[], Awaitable[float]]
) -> tuple[float, float]:
    """Medians of `anchor` and `case`, run in turn."""
    anchors, cases = [], []
    for _ in range(rounds):
        anchors.append(await anchor())
        cases.append(await case())
    return statistics.median(anchors), statistics.median(cases)


async def run(family: str, rounds: int, tokens: int) -> None:
    torch.set_num_threads(1)
    engine = HfEngine(build_tiny_model(family), prefix_cache_bytes=None)
    ids = expand_prompt(engine.tokenizer, [PROMPT], [])
    plain = SamplingParams(temperature=1.0, seed=1)

    async def per_token(sampling: SamplingParams) -> float:
        seconds, made = await completion_s(engine, ids, sampling, tokens)
        return seconds / made

    async def whole(sampling: SamplingParams, requests: int = 1) -> float:
        return sum(
            [(await completion_s(engine, ids, sampling, tokens))[0] for _ in range(requests)]
        )

    with_logprobs = msgspec.structs.replace(plain, logprobs=5)
    four = msgspec.structs.replace(plain, n=4)
    await whole(plain)  # warm up
    rows = []
    one, top = await alternate(rounds, lambda: per_token(plain), lambda: per_token(with_logprobs))
    rows.append(("top_logprobs=5", "CPU ms/token", one * 1e3, top * 1e3))
    single, batch = await alternate(rounds, lambda: whole(plain), lambda: whole(four))
    rows.append(("n=4", "CPU s", single, batch))
    _, fanned = await alternate(rounds, lambda: whole(four), lambda: whole(plain, requests=4))
    rows.append(("4 requests (n=1)", "CPU s", single, fanned))
    await engine.close()

    print(f"hf engine, tiny {family}, {len(ids)} prompt tokens, {tokens} tokens per completion")
    print(f"{'case':18s} {'unit':12s} {'anchor':>9s} {'case':>9s} {'ratio':>7s} {'goal':>6s}")
    for name, unit, anchor, case in rows:
        goal = GOALS.get(name)
        mark = "" if goal is None else f"{goal:5.2f}x"
        print(f"{name:18s} {unit:12s} {anchor:9.4f} {case:9.4f} {case / anchor:6.2f}x {mark:>6s}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen2_vl", help="tiny model family")
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of 9")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per completion")
    args = parser.parse_args()
    asyncio.run(run(args.family, 3 if args.quick else 9, args.tokens))


if __name__ == "__main__":
    main()
