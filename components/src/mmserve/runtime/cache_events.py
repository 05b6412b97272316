"""Cache events: how a worker tells the routers what its cache holds, whatever the cache
(the prefix cache's KV events, the encoder cache's embedding events).

They travel as runtime events (`Runtime.publish` / `Runtime.subscribe`, msgpack), two topics
per cache and component (a `CacheEventTopics`):

- the event topic: every worker of the component publishes its events here, `worker_id` being
  its runtime's `instance_id`; `event_id` counts from 0 per worker, one by one.
- the dump topic: a router that lost track of a worker (it started late, or saw a gap in the
  ids) asks it for a dump. The worker answers on its event topic with a cleared event, then its
  whole cache as stored events, with the next ids. Every router applies them; a router that was
  in step rebuilds the same state.

`CacheEventPublisher` is the workers' side, `CacheEventSubscriber` the routers'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import nats.errors
from nats.aio.subscription import Subscription

from mmserve.protocol import CacheEventTopics, WireMessage
from mmserve.runtime.connection import Runtime
from mmserve.runtime.discovery import InstanceWatcher
from mmserve.runtime.errors import Disconnected

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11+; annotations are not evaluated

log = logging.getLogger(__name__)

M = TypeVar("M")
D = TypeVar("D")
D_co = TypeVar("D_co", covariant=True)
D_contra = TypeVar("D_contra", contravariant=True)


class CacheEvent(Protocol[D_co]):
    """What every cache event message has (`protocol.KvEvent`, `protocol.EncoderEvent`)."""

    @property
    def worker_id(self) -> str: ...
    @property
    def event_id(self) -> int: ...
    @property
    def data(self) -> D_co: ...


class CacheIndex(Protocol[D_contra]):
    """A router's index of the workers' caches."""

    def apply_event(self, worker_id: str, event: D_contra) -> None: ...
    def remove_worker(self, worker_id: str) -> None: ...


class CacheEventPublisher(Generic[D]):
    """A worker's side: numbers and publishes its cache events, answers dump requests.

    `publish` may be called from any thread: it numbers the event at once and hands it to one
    sender task on the event loop, so events leave in the order of their ids, dumps included.
    `dump` lists the cache as event data (a cleared event first) when a router asks; it runs on
    the event loop's thread under the publisher's lock, so it must not wait for a thread that
    is inside `publish` (a cache that emits events outside its own lock is fine).
    """

    def __init__(
        self, runtime: Runtime, topics: CacheEventTopics, dump: Callable[[], Sequence[D]]
    ) -> None:
        self._runtime = runtime
        self._topics = topics
        self.worker_id = runtime.instance_id
        self._dump = dump
        self._next_event_id = 0
        # Numbering and queueing happen together under this lock, so queue order is id order.
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: asyncio.Queue[WireMessage | None] = asyncio.Queue()
        self._sender: asyncio.Task[None] | None = None
        self._subscription: Subscription | None = None

    async def start(self) -> Self:
        self._loop = asyncio.get_running_loop()
        self._sender = asyncio.create_task(
            self._send(), name=f"mmserve-{self._topics.name.lower()}-events"
        )
        self._subscription = await subscribe_flushed(
            self._runtime,
            self._topics.dump_topic,
            self._topics.dump_request_type,
            self._on_dump_request,
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
                log.warning(
                    "%s events of %s left unsent at shutdown", self._topics.name, self.worker_id
                )
            self._sender = None

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def _event(self, event_id: int, data: D) -> WireMessage:
        event: WireMessage = self._topics.event_type(
            worker_id=self.worker_id, event_id=event_id, data=data
        )
        return event

    def publish(self, data: D) -> None:
        """Queue one change of the cache for publishing; thread-safe, never blocks."""
        loop = self._loop
        if loop is None:
            raise RuntimeError(f"{type(self).__name__}.publish before start()")
        with self._lock:
            event = self._event(self._next_event_id, data)
            self._next_event_id += 1
            loop.call_soon_threadsafe(self._outbox.put_nowait, event)

    async def _on_dump_request(self, request: Any) -> None:
        if request.worker_id != self.worker_id:
            return
        # The dump is taken under the lock so that no event numbered before it describes a
        # change the dump misses.
        with self._lock:
            data = self._dump()
            events = [self._event(self._next_event_id + i, item) for i, item in enumerate(data)]
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
                await self._runtime.publish(self._topics.events_topic, event)
            except Disconnected as exc:
                # Routers see the gap in the ids and ask for a dump once NATS is back.
                log.warning("%s event of %s lost: %s", self._topics.name, self.worker_id, exc)


class CacheEventSubscriber(Generic[D]):
    """A router's side: applies the workers' cache events to an index, in order, catching up
    from dumps.

    A subscriber follows a worker only from an event it can place: id 0 (the worker's first) or
    a cleared event. Until then, and after any gap, it drops that worker's events and asks for a
    dump, again every `dump_retry_s` until it is back in step (a request, or the dump answering
    it, can be lost). `on_instance_removed` (from `follow_discovery`) drops a worker and its
    entries. An `out_of_step` error raised by the index means an event was missed: the worker is
    resynchronised.
    """

    def __init__(
        self,
        runtime: Runtime,
        index: CacheIndex[D],
        topics: CacheEventTopics,
        *,
        out_of_step: tuple[type[Exception], ...] = (),
        dump_retry_s: float = 1.0,
    ) -> None:
        self._runtime = runtime
        self._index = index
        self._topics = topics
        self._out_of_step = out_of_step
        self._dump_retry_s = dump_retry_s
        # worker id -> id of the last applied event; absent while the worker is not followed
        self._last_event_id: dict[str, int] = {}
        self._removed: set[str] = set()
        self._subscription: Subscription | None = None
        # worker id -> the task asking it for dumps until its events are in step again
        self._catching_up: dict[str, asyncio.Task[None]] = {}

    async def start(self) -> Self:
        self._subscription = await subscribe_flushed(
            self._runtime, self._topics.events_topic, self._topics.event_type, self._on_event
        )
        return self

    async def stop(self) -> None:
        if self._subscription is not None:
            await unsubscribe_quietly(self._subscription)
            self._subscription = None
        tasks = list(self._catching_up.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def following(self, worker_id: str) -> bool:
        """Whether the index is in step with the worker's events."""
        return worker_id in self._last_event_id

    def catch_up(self, worker_ids: Iterable[str]) -> None:
        """Ask each of `worker_ids` not followed yet for a dump (a router that starts late
        would otherwise learn an idle worker's cache only at its next event)."""
        for worker_id in worker_ids:
            if worker_id not in self._removed and not self.following(worker_id):
                self._lose_track(worker_id)

    def on_instance_removed(self, worker_id: str) -> None:
        """The worker left: drop its entries and ignore its late events."""
        self._removed.add(worker_id)
        self._last_event_id.pop(worker_id, None)
        task = self._catching_up.pop(worker_id, None)
        if task is not None:
            task.cancel()
        self._index.remove_worker(worker_id)

    async def _on_event(self, event: CacheEvent[D]) -> None:
        self.apply(event)

    def apply(self, event: CacheEvent[D]) -> None:
        """Apply one event if it is the next one of its worker; otherwise resynchronise."""
        worker_id = event.worker_id
        if worker_id in self._removed:
            return
        last = self._last_event_id.get(worker_id)
        if last is not None and event.event_id <= last:
            return  # a duplicate
        in_step = event.event_id == (0 if last is None else last + 1)
        if not in_step and not isinstance(event.data, self._topics.cleared_type):
            self._lose_track(worker_id)
            return
        try:
            self._index.apply_event(worker_id, event.data)
        except self._out_of_step as exc:
            log.warning(
                "%s index out of step with worker %s: %s", self._topics.name, worker_id, exc
            )
            self._lose_track(worker_id)
            return
        self._last_event_id[worker_id] = event.event_id

    def _lose_track(self, worker_id: str) -> None:
        self._last_event_id.pop(worker_id, None)
        running = self._catching_up.get(worker_id)
        if running is not None and not running.done():
            return  # it asks again: its loop sees the worker out of step
        # A catch-up that just ended (in step) may not be forgotten yet: start another.
        task = asyncio.create_task(self._catch_up(worker_id))
        self._catching_up[worker_id] = task

        def forget(ended: asyncio.Task[None]) -> None:
            if self._catching_up.get(worker_id) is ended:
                del self._catching_up[worker_id]

        task.add_done_callback(forget)

    async def _catch_up(self, worker_id: str) -> None:
        """Ask the worker for a dump, again every `dump_retry_s` while its events are not in
        step (the request or the dump can be lost, and an idle worker sends nothing else)."""
        while worker_id not in self._removed and not self.following(worker_id):
            try:
                await self._runtime.publish(
                    self._topics.dump_topic, self._topics.dump_request_type(worker_id=worker_id)
                )
            except Disconnected as exc:
                log.warning(
                    "cannot ask worker %s for a %s dump: %s", worker_id, self._topics.name, exc
                )
            await asyncio.sleep(self._dump_retry_s)


async def follow_discovery(
    watcher: InstanceWatcher, *on_instance_removed: Callable[[str], None]
) -> None:
    """Call each `on_instance_removed(instance_id)` when discovery drops an instance (a worker
    that stopped, or stopped heartbeating). Runs until cancelled."""
    async for event in watcher.events():
        if event.kind == "removed":
            for callback in on_instance_removed:
                callback(event.record.instance_id)


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
