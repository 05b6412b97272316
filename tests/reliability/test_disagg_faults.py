"""SIGKILL of the prefill or the decode worker of an E/P/D deployment (mock engine) while a
request is inside it: the client gets an error (a 5xx before the first token, an error event
after it) well within the bound, never a hang."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from e2e.deployment import Deployment
from mmserve.models.tiny import build_tiny_model

from .conftest import Trial
from .streams import BOUND_S, chat_body, stream_chat

# Prefill takes 0.2 s per uncached prompt token (a few seconds per prompt), so a kill lands
# inside it; decode 10 ms per token.
SLOW_PREFILL = ["--engine", "mock", "--mock-prefill-us-per-token", "200000"]


@pytest.fixture
def e_p_d(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    deployment = Deployment(
        "e_p_d",
        build_tiny_model("qwen2_vl"),
        nats_url,
        tmp_path_factory.mktemp("epd-fault-logs"),
        worker_flags=SLOW_PREFILL,
    )
    try:
        deployment.start().wait_ready()
        yield deployment
    finally:
        deployment.stop()


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_sigkill_inside_a_request(e_p_d: Deployment, trial: Trial, victim: str) -> None:
    async def run() -> tuple[int, str | None, float]:
        async with httpx.AsyncClient(base_url=e_p_d.base_url, timeout=120) as client:
            first = asyncio.Event()
            stream = asyncio.ensure_future(
                stream_chat(client, chat_body(6000, "Once upon a time"), first)
            )
            if victim == "decode":
                await asyncio.wait_for(first.wait(), 120)
            else:
                await asyncio.sleep(1.5)  # inside the prefill of ~20 prompt tokens
                assert not first.is_set()
            e_p_d.kill(victim)
            killed_at = time.monotonic()
            outcome = await asyncio.wait_for(stream, BOUND_S)
            assert not outcome.finished and outcome.error, outcome
            return outcome.status, outcome.error, outcome.ended_at - killed_at

    status, code, ended = asyncio.run(run())
    assert (status >= 500) if victim == "prefill" else (status == 200), (status, code)
    for name, process in e_p_d.processes.items():
        if name != victim:
            assert process.poll() is None, f"{name} exited:\n{e_p_d.log(name)[-2000:]}"
    how = f"HTTP {status} {code}" if status != 200 else f"an error event ({code})"
    trial(f"E/P/D: SIGKILL {victim} inside a request", 1, f"{how} {ended:.1f} s after the kill")
