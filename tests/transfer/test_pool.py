"""BufferPool: size classes, reuse, the cap, eviction of idle buffers, waiting for a release."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from mmserve.transfer import TransferError
from mmserve.transfer.pool import MIN_BUFFER_BYTES, BufferPool, PooledBuffer, size_class

MIB = 1024 * 1024


class Registry:
    """Stands in for the backend's registration calls and counts them."""

    def __init__(self) -> None:
        self.live: set[int] = set()

    def allocate(self, buffer_id: int, capacity: int) -> PooledBuffer:
        self.live.add(buffer_id)
        return PooledBuffer(buffer_id, capacity, torch.empty(0, dtype=torch.uint8))

    def free(self, buffer: PooledBuffer) -> None:
        self.live.remove(buffer.buffer_id)


def make_pool(cap_bytes: int) -> tuple[BufferPool, Registry]:
    registry = Registry()
    pool = BufferPool(registry.allocate, registry.free, cap_bytes, buffer_ids=itertools.count(1))
    return pool, registry


def test_size_classes_are_powers_of_two_from_the_minimum() -> None:
    assert size_class(1) == size_class(MIN_BUFFER_BYTES) == MIN_BUFFER_BYTES
    assert size_class(MIN_BUFFER_BYTES + 1) == 2 * MIN_BUFFER_BYTES
    assert size_class(2_936_012) == 4 * MIB  # a 7B-model image embedding in bf16
    assert size_class(64 * MIB) == 64 * MIB


async def test_released_buffers_are_reused_without_registering_again() -> None:
    pool, registry = make_pool(16 * MIB)
    for _ in range(100):
        first = await pool.acquire(3 * MIB, timeout_s=1)
        second = await pool.acquire(100, timeout_s=1)
        pool.release(first)
        pool.release(second)
    assert pool.registrations == 2 and len(registry.live) == 2
    assert pool.registered_bytes == 4 * MIB + MIN_BUFFER_BYTES
    assert pool.in_use == 0


async def test_cap_evicts_idle_buffers_of_other_classes() -> None:
    pool, registry = make_pool(8 * MIB)
    small = [await pool.acquire(MIB, timeout_s=1) for _ in range(4)]
    for buffer in small:
        pool.release(buffer)
    big = await pool.acquire(8 * MIB, timeout_s=1)
    assert registry.live == {big.buffer_id}
    assert pool.registered_bytes == 8 * MIB


async def test_full_pool_waits_for_a_release_then_times_out() -> None:
    pool, _ = make_pool(2 * MIB)
    held = await pool.acquire(2 * MIB, timeout_s=1)
    waiting = asyncio.create_task(pool.acquire(MIB, timeout_s=5))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    pool.release(held)
    assert (await waiting).capacity == MIB

    with pytest.raises(TransferError, match="exhausted"):
        await pool.acquire(2 * MIB, timeout_s=0.1)


async def test_tensor_above_the_cap_is_refused_at_once() -> None:
    pool, _ = make_pool(MIB)
    with pytest.raises(TransferError, match="pool cap"):
        await pool.acquire(MIB + 1, timeout_s=10)
