"""Persistent pools of registered buffers, so a transfer never pays registration.

Buffers come in power-of-two size classes (at least `MIN_BUFFER_BYTES`). A pool grows on demand
up to `cap_bytes`; past the cap it first frees idle buffers of other classes, then waits for a
release. Registration and deregistration are the backend's `allocate` / `free`; a registration
runs in a thread and always finishes, so a caller cancelled meanwhile leaves its buffer idle in
the pool instead of registered and unknown.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .base import TransferError

MIN_BUFFER_BYTES = 64 * 1024


@dataclass(eq=False)
class PooledBuffer:
    """One registered allocation. `tensor` is its uint8 data; `backend_state` is whatever the
    backend needs to use and free it (registration descriptors, metadata, a file path)."""

    buffer_id: int
    capacity: int
    tensor: torch.Tensor
    backend_state: Any = None
    last_used: float = field(default=0.0)


def size_class(nbytes: int) -> int:
    return max(MIN_BUFFER_BYTES, 1 << max(nbytes - 1, 0).bit_length())


class BufferPool:
    """Buffers of one device. Used from the event loop only."""

    def __init__(
        self,
        allocate: Callable[[int, int], PooledBuffer],
        free: Callable[[PooledBuffer], None],
        cap_bytes: int,
        *,
        buffer_ids: itertools.count[int],
    ) -> None:
        self._allocate = allocate
        self._free = free
        self.cap_bytes = cap_bytes
        self._buffer_ids = buffer_ids
        self._idle: dict[int, list[PooledBuffer]] = {}
        self._in_use: set[PooledBuffer] = set()
        self._waiters: list[asyncio.Future[None]] = []
        self._closed = False
        self.registered_bytes = 0  # including registrations under way
        self.registrations = 0

    @property
    def buffers(self) -> int:
        return len(self._in_use) + sum(len(idle) for idle in self._idle.values())

    @property
    def in_use(self) -> int:
        return len(self._in_use)

    async def acquire(self, nbytes: int, timeout_s: float) -> PooledBuffer:
        """A buffer of at least `nbytes`; waits up to `timeout_s` when the pool is at its cap."""
        capacity = size_class(nbytes)
        if capacity > self.cap_bytes:
            raise TransferError(
                f"a {nbytes}-byte tensor needs a {capacity}-byte buffer, above the transfer "
                f"pool cap of {self.cap_bytes} bytes (raise --transfer-pool-mib)"
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            idle = self._idle.get(capacity)
            if idle:
                return self._take(idle.pop())
            if self._make_room(capacity):
                return self._take(await self._register(capacity))
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TransferError(
                    f"transfer pool exhausted: {self.in_use} buffers ({self.registered_bytes} "
                    f"bytes) in use for {timeout_s}s"
                )
            released = loop.create_future()
            self._waiters.append(released)
            try:
                await asyncio.wait_for(released, remaining)
            except TimeoutError:
                pass
            finally:
                if released in self._waiters:
                    self._waiters.remove(released)

    def release(self, buffer: PooledBuffer) -> None:
        if buffer not in self._in_use:
            return
        self._in_use.discard(buffer)
        self._keep_idle(buffer)

    def discard(self, buffer: PooledBuffer) -> None:
        """Forget a buffer that must not be reused (a transfer into it could not be cancelled)."""
        self._in_use.discard(buffer)
        self.registered_bytes -= buffer.capacity
        self._wake_waiters()

    def close(self) -> None:
        """Free every buffer, in use or not (the agent is shutting down)."""
        buffers = [*self._in_use, *itertools.chain.from_iterable(self._idle.values())]
        for buffer in buffers:
            self._free(buffer)
        self._in_use.clear()
        self._idle.clear()
        self._closed = True
        self.registered_bytes -= sum(buffer.capacity for buffer in buffers)

    async def _register(self, capacity: int) -> PooledBuffer:
        self.registered_bytes += capacity  # now, so that concurrent acquires respect the cap
        registering = asyncio.ensure_future(
            asyncio.to_thread(self._allocate, next(self._buffer_ids), capacity)
        )
        try:
            buffer = await asyncio.shield(registering)
        except asyncio.CancelledError:
            registering.add_done_callback(functools.partial(self._adopt, capacity))
            raise
        except BaseException:
            self.registered_bytes -= capacity
            raise
        self.registrations += 1
        return buffer

    def _adopt(self, capacity: int, registering: asyncio.Future[PooledBuffer]) -> None:
        """The end of a registration whose caller was cancelled: its buffer joins the idle
        ones (or is freed if the pool closed meanwhile)."""
        if registering.cancelled() or registering.exception() is not None:
            self.registered_bytes -= capacity
        elif self._closed:
            self._free(registering.result())
            self.registered_bytes -= capacity
        else:
            self.registrations += 1
            self._keep_idle(registering.result())

    def _keep_idle(self, buffer: PooledBuffer) -> None:
        buffer.last_used = time.monotonic()
        self._idle.setdefault(buffer.capacity, []).append(buffer)
        self._wake_waiters()

    def _take(self, buffer: PooledBuffer) -> PooledBuffer:
        self._in_use.add(buffer)
        return buffer

    def _make_room(self, capacity: int) -> bool:
        """Whether `capacity` more bytes fit under the cap, freeing idle buffers of other size
        classes (least recently used first) when that is what it takes."""
        if self.registered_bytes + capacity <= self.cap_bytes:
            return True
        idle = sorted(itertools.chain.from_iterable(self._idle.values()), key=lambda b: b.last_used)
        reclaimable = sum(buffer.capacity for buffer in idle)
        if self.registered_bytes - reclaimable + capacity > self.cap_bytes:
            return False
        for buffer in idle:
            if self.registered_bytes + capacity <= self.cap_bytes:
                break
            self._idle[buffer.capacity].remove(buffer)
            self._free(buffer)
            self.registered_bytes -= buffer.capacity
        return True

    def _wake_waiters(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
