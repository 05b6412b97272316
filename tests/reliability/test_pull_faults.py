"""Peer-pull faults over real processes (E/PD, two encode workers on the mock engine with a
slow vision tower, `--encode-router-mode peer-pull`): the holder of an embedding another
encoder was told to pull from it dies while the pull is in flight, answers only after the
pull's timeout, or dropped the entry between routing and arrival. Every request still answers
with the tokens of the same request encoded afresh, within the pull's timeout and the encode.

Each fault stops the holder (SIGSTOP) before the request is routed, so the router still names
it as the peer (discovery drops a silent instance after about 3 s), and the pull is in flight
when the fault happens."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.encode_router import scrape_encoders
from mmserve.encode.peer_pull import PULL_TIMEOUT_S
from mmserve.protocol import CachesCleared, ResetCachesRequest
from mmserve.runtime import Runtime
from mmserve.tiny.checkpoints import build_tiny_model
from mmserve.topology import RESET_PREFIX_CACHE, Role
from tests.e2e.test_routing import (
    KV,
    MOCK,
    PEER_PULL,
    SLOW_TOWER,
    Client,
    both_images,
    encode_routed,
    instance_id,
    split_images,
)
from tests.support.deployment import Deployment, free_port

from .conftest import Trial
from .test_disagg_faults import images  # noqa: F401  (the fixture: photo.jpg and small.png)

# The pull's timeout, then the encode of the small image (6 tokens at 15 ms) and a request on a
# loaded 2-core machine.
BOUND_S = PULL_TIMEOUT_S + 8.0


class PullDeployment:
    def __init__(self, deployment: Deployment, ports: dict[str, int], url: str) -> None:
        self.deployment = deployment
        self.ports = ports
        self.images = url  # the image server's base URL
        self.client = Client(deployment)
        self.puller, self.holder = split_images(self.client, url, list(ports))

    def stop_holder(self) -> None:
        os.kill(self.deployment.processes[self.holder].pid, signal.SIGSTOP)

    def resume_holder(self) -> None:
        os.kill(self.deployment.processes[self.holder].pid, signal.SIGCONT)

    def wait_routed(self, before: float) -> None:
        """Until the frontend routed a request's image tokens (the pull follows at once)."""
        deadline = time.monotonic() + BOUND_S
        while sum(encode_routed(self.client).values()) == before:
            assert time.monotonic() < deadline, "the request was never routed"
            time.sleep(0.02)
        time.sleep(0.3)  # the puller has the request and sent the pull


@pytest.fixture
def pulling(
    nats_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[PullDeployment]:
    ports = {f"encode{i}": free_port() for i in range(2)}
    encoders = [(n, "encode", ["--metrics-port", str(p), *SLOW_TOWER]) for n, p in ports.items()]
    deployment = Deployment(
        "e_pd_pull_faults",
        build_tiny_model("qwen2_vl"),
        nats_url,
        tmp_path,
        frontend_flags=[*KV, *PEER_PULL],
        worker_flags=MOCK,
        components=[*encoders, ("worker", "worker", [])],
    )
    with deployment.running():
        holder = PullDeployment(deployment, ports, request.getfixturevalue("images"))
        try:
            yield holder
        finally:
            if deployment.processes[holder.holder].poll() is None:
                holder.resume_holder()


def timed_answer(client: Client, messages: list[dict[str, Any]]) -> tuple[dict[str, Any], float]:
    started = time.monotonic()
    answer = client.chat(messages)
    return answer, time.monotonic() - started


def run_with_fault(
    pulling: PullDeployment, images_url: str, fault: Callable[[], None]
) -> tuple[dict[str, Any], float]:
    """The request showing both images, `fault()` once it was routed (the holder stopped);
    its answer and latency."""
    before = sum(encode_routed(pulling.client).values())
    pulling.stop_holder()

    async def run() -> tuple[dict[str, Any], float]:
        answer = asyncio.create_task(
            asyncio.to_thread(timed_answer, Client(pulling.deployment), both_images(images_url))
        )
        await asyncio.to_thread(pulling.wait_routed, before)
        fault()
        return await answer

    return asyncio.run(run())


def assert_fell_back(pulling: PullDeployment, answer: dict[str, Any], images_url: str) -> None:
    """The puller encoded the image itself, and the answer is that of the request encoded
    afresh (asked again, the same request finds both images on the puller)."""
    assert pulling.client.served_by(answer, [pulling.puller]) == pulling.puller
    requester = scrape_encoders([pulling.ports[pulling.puller]])
    assert (requester.pulls, requester.failed_pulls) == (0, 1)
    assert requester.misses == 2  # the photo earlier, the small image now
    again = pulling.client.chat(both_images(images_url))
    assert again["choices"][0]["message"] == answer["choices"][0]["message"]


def test_a_holder_killed_while_its_embedding_is_pulled(
    pulling: PullDeployment, trial: Trial
) -> None:
    url = pulling.images
    answer, took = run_with_fault(pulling, url, lambda: pulling.deployment.kill(pulling.holder))
    assert took < BOUND_S, took
    assert_fell_back(pulling, answer, url)
    trial("peer pull: SIGKILL the holder while a pull waits on it", 1, f"answered in {took:.1f} s")


def test_a_holder_that_answers_after_the_pull_timed_out(
    pulling: PullDeployment, trial: Trial
) -> None:
    url = pulling.images
    answer, took = run_with_fault(pulling, url, lambda: None)  # stopped past the timeout
    assert PULL_TIMEOUT_S <= took < BOUND_S, took
    pulling.resume_holder()  # it answers the stale pull now: nobody reads that lease
    assert_fell_back(pulling, answer, url)
    assert pulling.deployment.processes[pulling.holder].poll() is None  # and serves on
    trial("peer pull: the holder answers after the pull's timeout", 1, f"answered in {took:.1f} s")


def test_a_holder_that_dropped_the_entry_between_routing_and_the_pull(
    pulling: PullDeployment, trial: Trial
) -> None:
    """The holder's cache is cleared while it is stopped (the clear is queued before the
    pull, and the router has not heard of it): it answers the pull with nothing, at once."""
    url = pulling.images
    deployment = pulling.deployment
    holder_id = instance_id(deployment, pulling.holder)

    async def run() -> tuple[dict[str, Any], float]:
        async with await Runtime.connect(deployment.nats_url, deployment.namespace) as runtime:
            reset = asyncio.create_task(
                runtime.client(Role.ENCODE.value, RESET_PREFIX_CACHE).call(
                    ResetCachesRequest(), CachesCleared, instance_id=holder_id, timeout=30
                )
            )
            await asyncio.sleep(0.3)
            await runtime.flush()  # queued at the stopped holder before the pull
            before = sum(encode_routed(pulling.client).values())
            answer = asyncio.create_task(
                asyncio.to_thread(timed_answer, Client(deployment), both_images(url))
            )
            await asyncio.to_thread(pulling.wait_routed, before)
            pulling.resume_holder()
            cleared = await reset
            assert cleared.encoder_items == 1
            return await answer

    pulling.stop_holder()
    answer, took = asyncio.run(run())
    assert took < BOUND_S, took
    assert_fell_back(pulling, answer, url)
    trial(
        "peer pull: the holder's cache cleared before the pull arrives",
        1,
        f"answered in {took:.1f} s",
    )
