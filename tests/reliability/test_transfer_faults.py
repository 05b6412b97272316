"""Transfers whose consumer dies, per backend (NIXL when importable, shm): the producer's buffer
returns to its pool every time, and over 1,000 such faults its registered memory, its number
of registrations and its RSS do not grow.

The 1,000 faults here are in-process consumers (a second agent in this process, over the real
transport) that take the handle and vanish, or give up at varying points inside the fetch; then
a consumer process is SIGKILLed in the middle of its fetches. `bench/transfer_faults.py` kills
1,000 consumer processes, one per transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
from collections import Counter
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
import pytest_asyncio
import torch

from mmserve.transfer import Lease, TransferAgent, TransferError, TransferFailed, TransferTimeout
from mmserve.transfer.probe import ProbeError, seeded_pattern
from tests.support.transfer import AGENT_TIMEOUT_S, BACKENDS, make_agent, start_probe

from .conftest import Trial, rss_mib

pytestmark = pytest.mark.asyncio(loop_scope="module")

KIB = 1024
SIZES = [64 * KIB, 256 * KIB, 1024 * KIB]  # three size classes
ROUND = 100  # transfers offered together; their consumers all die
FAULTS = 1000
REGISTERING = 20  # offers cancelled while their buffers register
KILLED_TRANSFERS = 50  # fetched one by one by a consumer process that is killed
LEASE_S = 0.5  # the producer's lease timeout under faults: a silent consumer costs this long
KILLED_LEASE_S = 2.0  # long enough for a new consumer process to connect
# The RSS wanders within about 15 MiB as the allocators settle; a leak of even 64 KiB per
# fault (the smallest buffer) would add 56 MiB over 900 faults.
RSS_SLACK_MIB = 32.0


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def producer(backend: str) -> AsyncIterator[TransferAgent]:
    async with make_agent(backend) as agent:
        yield agent


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def consumer(backend: str) -> AsyncIterator[TransferAgent]:
    async with make_agent(backend) as agent:
        yield agent


@contextlib.contextmanager
def short_leases(producer: TransferAgent, timeout_s: float = LEASE_S) -> Iterator[None]:
    producer.lease_timeout_s = timeout_s
    try:
        yield
    finally:
        producer.lease_timeout_s = AGENT_TIMEOUT_S


TENSORS = {size: seeded_pattern((size,), torch.uint8, size) for size in SIZES}


def tensor(position: int) -> torch.Tensor:
    """The tensor at `position` of a round: every round needs the same buffers."""
    return TENSORS[SIZES[position % len(SIZES)]]


async def ending(lease: Lease) -> str:
    """How a lease ended: its consumer completed, reported a failure, or went silent."""
    try:
        await asyncio.wait_for(lease.wait(), LEASE_S + 10)
    except TransferTimeout:
        return "timed out"
    except TransferFailed:
        return "failed"
    return "completed"


async def abandoned(consumer: TransferAgent, handle: object, index: int) -> None:
    """Half the consumers vanish with the handle; the others are cancelled after 0-7 turns of
    the event loop, which lands anywhere from before the buffer is reserved to after the data
    arrived."""
    if index % 2 == 0:
        return
    fetching = asyncio.ensure_future(consumer.fetch(handle))  # type: ignore[arg-type]
    for _ in range(index // 2 % 8):
        await asyncio.sleep(0)
    fetching.cancel()
    with contextlib.suppress(asyncio.CancelledError, TransferError):
        await fetching


async def fault_round(producer: TransferAgent, consumer: TransferAgent, first: int) -> Counter[str]:
    with short_leases(producer):
        offers = [await producer.offer(tensor(i)) for i in range(ROUND)]  # as in the warm-up
    await asyncio.gather(
        *(abandoned(consumer, handle, first + i) for i, (handle, _) in enumerate(offers))
    )
    return Counter(await asyncio.gather(*(ending(lease) for _, lease in offers)))


async def warm_up(producer: TransferAgent, consumer: TransferAgent) -> None:
    """Both pools at their working size (a round held by the consumer all at once), every
    buffer read (shm pages count in the RSS once touched through the consumer's mapping)."""
    offers = [await producer.offer(tensor(i)) for i in range(ROUND)]
    async with contextlib.AsyncExitStack() as stack:
        views = await asyncio.gather(
            *(stack.enter_async_context(consumer.fetch_view(handle)) for handle, _ in offers)
        )
        for view in views:
            view.clone()
    await asyncio.gather(*(lease.wait() for _, lease in offers))


def shm_files(agent: TransferAgent) -> int:
    """Buffers the agent keeps as shared-memory files (a registration the pool lost would stay
    there): the shm backend's, and NIXL's CPU pool unless its same-host path is UCX."""
    files = getattr(agent, "shm_files", None)
    return len(glob.glob(f"{files.directory}/{files.prefix}*")) if files else 0


async def test_thousand_consumer_deaths_do_not_grow_registered_memory(
    producer: TransferAgent, consumer: TransferAgent, backend: str, trial: Trial
) -> None:
    await warm_up(producer, consumer)
    before = producer.stats(), consumer.stats(), shm_files(producer), shm_files(consumer)
    endings = await fault_round(producer, consumer, 0)
    rss_before = rss_mib(os.getpid())  # after the first round: the allocator has warmed up
    for first in range(ROUND, FAULTS, ROUND):
        endings += await fault_round(producer, consumer, first)
    after = producer.stats(), consumer.stats(), shm_files(producer), shm_files(consumer)
    grown = rss_mib(os.getpid()) - rss_before

    assert sum(endings.values()) == FAULTS
    assert endings["timed out"] >= FAULTS // 2  # the silent half at least
    assert after[0].in_use == 0 and after[1].in_use == 0
    assert after == before, (before, after)  # same buffers, bytes, registrations, files
    assert grown < RSS_SLACK_MIB, grown
    stats = after[0]
    trial(
        f"{backend}: 1,000 transfers whose consumer vanished or gave up mid-fetch (in-process)",
        FAULTS,
        f"every buffer back in its pool ({endings['timed out']} leases timed out, "
        f"{endings['failed']} failed, {endings['completed']} completed first); registered "
        f"{stats.registered_bytes >> 20} MiB in {stats.buffers} buffers before and after, no "
        f"new registration; RSS {grown:+.0f} MiB over the last 900",
    )


async def test_consumer_process_killed_mid_sequence_returns_every_buffer(
    producer: TransferAgent, consumer: TransferAgent, backend: str, nats_url: str, trial: Trial
) -> None:
    probe = await start_probe(nats_url, backend)
    try:
        await warm_up(producer, consumer)
        before = producer.stats()
        with short_leases(producer, KILLED_LEASE_S):
            offers = [await producer.offer(tensor(i)) for i in range(KILLED_TRANSFERS)]
        handles = [handle for handle, _ in offers]
        fetching = asyncio.ensure_future(probe.fetch(handles))
        await offers[0][1].wait()  # it fetches them one by one: this one is done
        probe.kill()
        endings = Counter(await asyncio.gather(*(ending(lease) for _, lease in offers)))
        fetching.cancel()  # it never answers
        with contextlib.suppress(asyncio.CancelledError, ProbeError, nats.errors.Error):
            await fetching
    finally:
        await probe.stop()
    after = producer.stats()

    assert after.in_use == 0
    assert (after.buffers, after.registered_bytes, after.registrations) == (
        before.buffers,
        before.registered_bytes,
        before.registrations,
    )
    assert endings["timed out"] > 0, endings
    trial(
        f"{backend}: SIGKILL a consumer process in the middle of fetching {KILLED_TRANSFERS} "
        "transfers",
        KILLED_TRANSFERS,
        f"{endings['completed']} completed before the kill, {endings['timed out']} timed out; "
        "every buffer back in its pool, no new registration",
    )


async def test_transfers_cancelled_while_their_buffer_registers(backend: str, trial: Trial) -> None:
    """A consumer or producer cancelled while the pool registers a new buffer for it (in a
    thread, which runs to the end): the buffer joins the pool instead of staying registered
    and unknown to it, and the next transfers reuse it."""
    async with make_agent(backend) as agent:
        offering = [asyncio.ensure_future(agent.offer(tensor(0))) for _ in range(REGISTERING)]
        await asyncio.sleep(0)  # each is inside its registration now
        for task in offering:
            task.cancel()
        results = await asyncio.gather(*offering, return_exceptions=True)
        cancelled = sum(isinstance(result, asyncio.CancelledError) for result in results)
        for result in results:
            if isinstance(result, tuple):
                result[1].close()
        for _ in range(1000):  # the registration threads finish by themselves
            if agent.stats().registrations == REGISTERING:
                break
            await asyncio.sleep(0.01)
        after_cancel = agent.stats()
        files = shm_files(agent)
        offers = [await agent.offer(tensor(0)) for _ in range(REGISTERING)]
        for _, lease in offers:
            lease.close()
        reused = agent.stats()

    assert cancelled > 0
    assert after_cancel.buffers == after_cancel.registrations == REGISTERING
    assert after_cancel.in_use == 0
    assert files == (0 if backend == "nixl-ucx" else REGISTERING)
    assert reused.registrations == REGISTERING  # no new registration
    trial(
        f"{backend}: offers cancelled while their buffer was being registered",
        REGISTERING,
        f"{cancelled} cancelled mid-registration: every buffer joined the pool and was reused",
    )
