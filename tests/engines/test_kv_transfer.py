"""A prefill's KV exported, imported by a fresh engine in another process, decoded there."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import msgspec
import torch

from mmserve.engines.hf import HfEngine
from mmserve.protocol import SamplingParams, StopConditions
from mmserve.tiny.checkpoints import TINY_FAMILIES, build_tiny_model
from tests.support.engines import expand_prompt, make_image, planned_request, preprocess

REPO_ROOT = Path(__file__).resolve().parents[2]


async def export_job(family: str, tmp_path: Path) -> tuple[dict, list[list[float]]]:
    """Prefill on a local engine: the exported KV as a job, and the uninterrupted tokens with
    their choices and logprobs."""
    model = build_tiny_model(family)
    engine = HfEngine(model)
    items = preprocess(model, [make_image(84, 56, seed=21), make_image(56, 56, seed=22)])
    ids = expand_prompt(engine.tokenizer, ["Compare them."], items)
    # Seeded sampling with penalties, two choices: decode draws what an aggregated engine draws
    # from the prefill's seed and each choice's first token, and counts that first token
    # against the choice's penalties; the prompt's KV crosses once for both.
    sampling = SamplingParams(
        temperature=0.9,
        top_k=40,
        seed=5,
        frequency_penalty=0.8,
        presence_penalty=0.3,
        repetition_penalty=1.2,
        logprobs=2,
        n=2,
    )
    stop = StopConditions(max_tokens=10, ignore_eos=True)
    request = planned_request("p", ids, items, sampling, stop, model=engine.model)
    embeddings = await engine.encode(items)
    uninterrupted = [
        [chunk.index, each.token_id, each.logprob]
        async for chunk in engine.generate(request, embeddings)
        for each in chunk.logprobs
    ]
    assert len(uninterrupted) == 2 * stop.max_tokens

    kv = await engine.prefill(request, embeddings)
    tensors = await engine.export_kv(kv)
    engine.release(kv)
    await engine.close()
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in tensors.values())
    kv_file = tmp_path / f"{family}.kv"
    torch.save(tensors, kv_file)
    job = {
        "model": str(model),
        "kv": str(kv_file),
        "done": msgspec.to_builtins(kv.prefill_done()),
        "token_ids": list(ids),
        "sampling": msgspec.to_builtins(sampling),
        "stop": msgspec.to_builtins(stop),
    }
    return job, uninterrupted


async def test_decode_continues_from_imported_kv_in_another_process(tmp_path: Path):
    # One child process for all families: its start (importing torch) is the slow part.
    exported = [await export_job(family, tmp_path) for family in TINY_FAMILIES]
    jobs_file = tmp_path / "jobs.json"
    jobs_file.write_text(json.dumps([job for job, _ in exported]))
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "tests.engines.kv_continue", str(jobs_file)),
        cwd=REPO_ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=180)
    assert process.returncode == 0, stderr.decode()
    continued = json.loads(stdout.decode().strip().splitlines()[-1])
    for got, (_, expected) in zip(continued, exported, strict=True):
        assert [(index, token) for index, token, _ in got] == [
            (index, token) for index, token, _ in expected
        ]
        for (_, _, logprob), (_, _, wanted) in zip(got, expected, strict=True):
            assert abs(logprob - wanted) < 1e-5
