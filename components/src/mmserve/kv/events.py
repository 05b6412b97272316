"""KV events: what the engines and the router share about a worker's prefix cache.

They travel as runtime events (`Runtime.publish` / `Runtime.subscribe`, msgpack):

- topic `kv_events-<component>` (`protocol.KvEvent`): every worker of the component publishes
  its events here, `worker_id` being its runtime's `instance_id`; `event_id` counts from 0 per
  worker, one by one.
- topic `kv_dump-<component>` (`protocol.KvDumpRequest`): a router that lost track of a worker
  (it started late, or saw a gap in the ids) asks it for a dump. The worker answers on its event
  topic with `dump_events`: a cleared event, then its whole cache as stored events, with the next
  ids. Every router applies them; a router that was in step rebuilds the same state.

This module is the workers' side (`KvEventPublisher`); the router follows the topics with
`mmserve.router.kv_events.KvEventSubscriber`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import nats.errors
from nats.aio.subscription import Subscription

from mmserve.protocol import KvBlock, KvCleared, KvDumpRequest, KvEvent, KvRemoved, KvStored
from mmserve.runtime import Runtime
from mmserve.runtime.errors import Disconnected

log = logging.getLogger(__name__)

M = TypeVar("M")

KvEventData = KvStored | KvRemoved | KvCleared
KvEventSink = Callable[[KvEventData], None]
"""Called for every change of an engine's prefix cache; must not block."""

MAX_DUMP_RUN_BLOCKS = 256
"""Longest run of blocks in one dumped stored event (keeps each message a few KiB)."""

CacheSnapshot = Callable[[], Iterable[tuple[int, int | None, int]]]
"""A worker's cached blocks as `(block_hash, parent_hash, tokens_hash)`, in any order."""


def kv_events_topic(component: str) -> str:
    return f"kv_events-{component}"


def kv_dump_topic(component: str) -> str:
    return f"kv_dump-{component}"


def dump_events(
    worker_id: str,
    first_event_id: int,
    blocks: Iterable[tuple[int, int | None, int]],
) -> list[KvEvent]:
    """A worker's whole cache as KV events, for a router that lost track of it.

    `blocks` are `(block_hash, parent_hash, tokens_hash)` in any order; a block whose parent is
    not cached is left out (it cannot count towards an overlap). The events are a cleared event,
    then stored runs, parents first, with consecutive ids from `first_event_id`.
    """
    children: dict[int | None, list[tuple[int, int]]] = {}
    for block_hash, parent_hash, tokens_hash in blocks:
        children.setdefault(parent_hash, []).append((block_hash, tokens_hash))
    data: list[KvEventData] = [KvCleared()]
    pending: list[int | None] = [None]
    visited: set[int] = set()  # a block listed twice under two parents must not loop
    while pending:
        parent = pending.pop()
        for block_hash, tokens_hash in children.get(parent, ()):
            if block_hash in visited:
                continue
            visited.add(block_hash)
            run = [KvBlock(block_hash=block_hash, tokens_hash=tokens_hash)]
            # Extend the run down a chain of only children.
            while len(run) < MAX_DUMP_RUN_BLOCKS:
                below = children.get(run[-1].block_hash, ())
                if len(below) != 1 or below[0][0] in visited:
                    break
                visited.add(below[0][0])
                run.append(KvBlock(block_hash=below[0][0], tokens_hash=below[0][1]))
            data.append(KvStored(parent_hash=parent, blocks=run))
            pending.append(run[-1].block_hash)
    return [
        KvEvent(worker_id=worker_id, event_id=first_event_id + offset, data=item)
        for offset, item in enumerate(data)
    ]


class KvEventPublisher:
    """A worker's side: numbers and publishes its KV events, answers dump requests.

    `publish` may be called from any thread (pass it to `Engine.subscribe_kv_events` as is):
    it numbers the event at once and hands it to one sender task on the event loop, so events
    leave in the order of their ids, dumps included. `snapshot` lists the cache's blocks when
    a router asks; it runs on the event loop's thread under the publisher's lock, so it must not
    wait for a thread that is inside `publish` (a cache that emits events outside its own lock,
    as `engines.prefix_cache.PrefixCache` does, is fine).
    """

    def __init__(self, runtime: Runtime, component: str, snapshot: CacheSnapshot) -> None:
        self._runtime = runtime
        self._topic = kv_events_topic(component)
        self._dump_topic = kv_dump_topic(component)
        self.worker_id = runtime.instance_id
        self._snapshot = snapshot
        self._next_event_id = 0
        # Numbering and queueing happen together under this lock, so queue order is id order.
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: asyncio.Queue[KvEvent | None] = asyncio.Queue()
        self._sender: asyncio.Task[None] | None = None
        self._subscription: Subscription | None = None

    async def start(self) -> KvEventPublisher:
        self._loop = asyncio.get_running_loop()
        self._sender = asyncio.create_task(self._send(), name="mmserve-kv-events")
        self._subscription = await subscribe_flushed(
            self._runtime, self._dump_topic, KvDumpRequest, self._on_dump_request
        )
        return self

    async def stop(self, drain_timeout: float = 2.0) -> None:
        """Stop answering dumps, send what is queued (up to `drain_timeout`), stop sending."""
        if self._subscription is not None:
            await unsubscribe_quietly(self._subscription)
            self._subscription = None
        if self._sender is not None:
            self._outbox.put_nowait(None)
            try:
                await asyncio.wait_for(self._sender, drain_timeout)
            except asyncio.TimeoutError:
                log.warning("KV events of %s left unsent at shutdown", self.worker_id)
            self._sender = None

    async def __aenter__(self) -> KvEventPublisher:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def publish(self, data: KvEventData) -> None:
        """Queue one change of the cache for publishing; thread-safe, never blocks."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("KvEventPublisher.publish before start()")
        with self._lock:
            event = KvEvent(worker_id=self.worker_id, event_id=self._next_event_id, data=data)
            self._next_event_id += 1
            loop.call_soon_threadsafe(self._outbox.put_nowait, event)

    async def _on_dump_request(self, request: KvDumpRequest) -> None:
        if request.worker_id != self.worker_id:
            return
        # The snapshot is taken under the lock so that no event numbered before the dump
        # describes a change the snapshot misses.
        with self._lock:
            events = dump_events(self.worker_id, self._next_event_id, self._snapshot())
            self._next_event_id += len(events)
            # Queued behind the events `publish` numbered before the dump: their
            # call_soon_threadsafe callbacks were scheduled earlier, and the loop runs callbacks
            # in order, so events leave in id order.
            loop = asyncio.get_running_loop()
            for event in events:
                loop.call_soon(self._outbox.put_nowait, event)

    async def _send(self) -> None:
        while (event := await self._outbox.get()) is not None:
            try:
                await self._runtime.publish(self._topic, event)
            except Disconnected as exc:
                # Routers see the gap in the ids and ask for a dump once NATS is back.
                log.warning("KV event %d of %s lost: %s", event.event_id, self.worker_id, exc)


async def subscribe_flushed(
    runtime: Runtime, topic: str, message_type: type[M], callback: Callable[[M], Awaitable[None]]
) -> Subscription:
    """Subscribe, and return once the server has the subscription."""
    subscription = await runtime.subscribe(topic, message_type, callback)
    await runtime.flush()  # subscribed at the server before the caller goes on
    return subscription


async def unsubscribe_quietly(subscription: Subscription) -> None:
    # Already gone when the connection closed first.
    with contextlib.suppress(nats.errors.Error):
        await subscription.unsubscribe()
