"""Run by the KV transfer test in a fresh process: import prefills' exported KV, decode them.

Usage: python -m tests.engines.kv_continue JOBS_JSON, where each job is
`{"model": dir, "kv": file, "sampling": {...}, "stop": {...}}`; prints one list of token ids per
job as JSON. Files stand in for the transfer layer, which is not under test here.
"""

from __future__ import annotations

import asyncio
import json
import sys

import torch

from mmserve.engines.hf import HfEngine
from mmserve.protocol import SamplingParams, StopConditions


async def continue_decode(job: dict) -> list[int]:
    engine = HfEngine(job["model"])
    kv = await engine.import_kv("imported", torch.load(job["kv"], weights_only=True))
    sampling = SamplingParams(**job["sampling"])
    stop = StopConditions(**job["stop"])
    tokens = [t async for chunk in engine.decode(kv, sampling, stop) for t in chunk.token_ids]
    await engine.close()
    return tokens


async def main(jobs: list[dict]) -> list[list[int]]:
    return [await continue_decode(job) for job in jobs]


if __name__ == "__main__":
    torch.set_num_threads(1)
    with open(sys.argv[1]) as jobs_file:
        print(json.dumps(asyncio.run(main(json.load(jobs_file)))))
