"""Run by the KV transfer test in a fresh process: import prefills' exported KV, decode them.

Usage: python -m tests.engines.kv_continue JOBS_JSON, where each job is
`{"model": dir, "kv": file, "done": {...}, "token_ids": [...], "sampling": {...},
"stop": {...}}` (`done`: the prefill's `PrefillDone`, `token_ids`: its prompt); prints one list
of (choice, token id, logprob) triples per job as JSON. Files stand in for the transfer layer,
which is not under test here.
"""

from __future__ import annotations

import asyncio
import json
import sys

import msgspec
import torch

from mmserve.engines.base import EngineRequest
from mmserve.engines.hf import HfEngine
from mmserve.protocol import PrefillDone, SamplingParams, StopConditions


async def continue_decode(job: dict) -> list[list[float]]:
    engine = HfEngine(job["model"])
    sampling = SamplingParams(**job["sampling"])
    stop = StopConditions(**job["stop"])
    request = EngineRequest("imported", tuple(job["token_ids"]), sampling, stop)
    done = msgspec.convert(job["done"], PrefillDone)
    kv = await engine.import_kv(request, done, torch.load(job["kv"], weights_only=True))
    chosen = [
        [chunk.index, each.token_id, each.logprob]
        async for chunk in engine.decode(kv, sampling, stop)
        for each in chunk.logprobs
    ]
    await engine.close()
    return chosen


async def main(jobs: list[dict]) -> list[list[list[float]]]:
    return [await continue_decode(job) for job in jobs]


if __name__ == "__main__":
    torch.set_num_threads(1)
    with open(sys.argv[1]) as jobs_file:
        print(json.dumps(asyncio.run(main(json.load(jobs_file)))))
