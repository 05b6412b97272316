"""The hf engine on the tiny models, on CPU: encode, prefill, decode, and the caches' effect.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.engine [--threads 1] [--repeats 5]

Per family: vision-tower ms per image (640x480 and 1280x960, cold and from the encoder cache),
prefill ms for a one-image prompt (cold and with a warm prefix cache), decode ms per token at 1
and 8 concurrent streams. Medians over `--repeats` runs; the warm rows are the anchors the cold
rows are compared with.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from mmserve.engines.base import EngineRequest, MediaInput
from mmserve.engines.hf import HfEngine
from mmserve.protocol import SamplingParams, StopConditions
from mmserve.tiny.checkpoints import TINY_FAMILIES, build_tiny_model
from tests.support.engines import expand_prompt, make_image, planned_request, preprocess

GREEDY = SamplingParams(temperature=0.0)
DECODE_TOKENS = 32


async def median_ms(run: Callable[[int], Awaitable[object]], repeats: int) -> float:
    times = []
    for attempt in range(repeats):
        start = time.perf_counter()
        await run(attempt)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def fresh(item: MediaInput, salt: int) -> MediaInput:
    """The same pixels under a new content hash, so the encoder cache misses."""
    return MediaInput(item.mm_hash ^ (salt + 1) << 40, item.pixel_values, item.grid_thw)


async def bench_family(family: str, repeats: int) -> dict[str, float]:
    path = build_tiny_model(family)
    engine = await HfEngine.load(path)
    row: dict[str, float] = {}
    small, large = preprocess(path, [make_image(640, 480, 1), make_image(1280, 960, 2)])
    for name, item in (("640x480", small), ("1280x960", large)):
        row[f"encode {name}"] = await median_ms(
            lambda i, item=item: engine.encode([fresh(item, i)]), repeats
        )
        await engine.encode([item])
        row[f"encode {name} cached"] = await median_ms(
            lambda _, item=item: engine.encode([item]), repeats
        )

    ids = expand_prompt(engine.tokenizer, ["Describe the picture in detail."], [small])
    row["prompt tokens"] = len(ids)
    embeddings = await engine.encode([small])
    no_cache_engine = await HfEngine.load(path, prefix_cache_blocks=0)

    request = planned_request("b", ids, [small], model=engine.model)

    async def prefill(target: HfEngine) -> None:
        target.release(await target.prefill(request, embeddings))

    row["prefill"] = await median_ms(lambda _: prefill(no_cache_engine), repeats)
    await prefill(engine)
    row["prefill prefix-cached"] = await median_ms(lambda _: prefill(engine), repeats)

    async def cold_request(attempt: int) -> None:
        item = fresh(small, 100 + attempt)
        target_embeddings = await no_cache_engine.encode([item])
        cold = planned_request("c", ids, [item], model=engine.model)
        no_cache_engine.release(await no_cache_engine.prefill(cold, target_embeddings))

    async def warm_request(_: int) -> None:
        engine.release(await engine.prefill(request, await engine.encode([small])))

    row["encode+prefill"] = await median_ms(cold_request, repeats)
    row["encode+prefill warm"] = await median_ms(warm_request, repeats)

    stop = StopConditions(max_tokens=DECODE_TOKENS, ignore_eos=True)

    async def stream(index: int) -> None:
        text_ids = expand_prompt(engine.tokenizer, [f"Stream {index} says"], [])
        request = EngineRequest(f"s{index}", tuple(text_ids), GREEDY, stop)
        kv = await no_cache_engine.prefill(request)
        async for _ in no_cache_engine.decode(kv, GREEDY, stop):
            pass

    for streams in (1, 8):
        total = await median_ms(
            lambda _, n=streams: asyncio.gather(*(stream(i) for i in range(n))), repeats
        )
        # Wall time per generated token of one stream while `streams` run together.
        row[f"decode/token x{streams}"] = total / DECODE_TOKENS
    await engine.close()
    await no_cache_engine.close()
    return row


def print_table(rows: dict[str, dict[str, float]]) -> None:
    families = list(rows)
    metrics = list(rows[families[0]])
    width = max(len(m) for m in metrics) + 2
    cell = max(12, *(len(f) + 2 for f in families))
    print(f"{'ms (median)':<{width}}" + "".join(f"{f:>{cell}}" for f in families))
    for metric in metrics:
        cells = "".join(
            f"{rows[f][metric]:>{cell}.0f}"
            if metric == "prompt tokens"
            else f"{rows[f][metric]:>{cell}.2f}"
            for f in families
        )
        print(f"{metric:<{width}}" + cells)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--family", choices=(*TINY_FAMILIES, "all"), default="all")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    families = TINY_FAMILIES if args.family == "all" else (args.family,)
    rows = {family: await bench_family(family, args.repeats) for family in families}
    print(f"hf engine, tiny models, CPU, {args.threads} thread(s), torch {torch.__version__}")
    print_table(rows)


if __name__ == "__main__":
    asyncio.run(main())
