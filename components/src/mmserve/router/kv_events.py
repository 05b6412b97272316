"""The router's side of KV events (`mmserve.kv.events` has the topics and the workers' side):
follow every worker's events into an indexer, catching up from dumps.

A subscriber follows a worker only from an event it can place: id 0 (the worker's first) or a
cleared event. Until then, and after any gap, it drops that worker's events and asks for a
dump, again every `dump_retry_s` until it is back in step (a request, or the dump answering it,
can be lost). Discovery's removals (`follow_discovery`) drop a worker
and its blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from nats.aio.subscription import Subscription

from mmserve.kv.events import (
    kv_dump_topic,
    kv_events_topic,
    subscribe_flushed,
    unsubscribe_quietly,
)
from mmserve.protocol import KvCleared, KvDumpRequest, KvEvent
from mmserve.router.indexer import KvIndexer, UnknownParentError
from mmserve.runtime import InstanceWatcher, Runtime
from mmserve.runtime.errors import Disconnected

log = logging.getLogger(__name__)


class KvEventSubscriber:
    """A router's side: applies the workers' KV events to an indexer, in order."""

    def __init__(
        self,
        runtime: Runtime,
        indexer: KvIndexer,
        component: str,
        *,
        dump_retry_s: float = 1.0,
    ) -> None:
        self._runtime = runtime
        self._indexer = indexer
        self._component = component
        self._dump_retry_s = dump_retry_s
        # worker id -> id of the last applied event; absent while the worker is not followed
        self._last_event_id: dict[str, int] = {}
        self._removed: set[str] = set()
        self._subscription: Subscription | None = None
        # worker id -> the task asking it for dumps until its events are in step again
        self._catching_up: dict[str, asyncio.Task[None]] = {}

    async def start(self) -> KvEventSubscriber:
        self._subscription = await subscribe_flushed(
            self._runtime, kv_events_topic(self._component), KvEvent, self._on_event
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

    async def __aenter__(self) -> KvEventSubscriber:
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
        """The worker left: drop its blocks and ignore its late events."""
        self._removed.add(worker_id)
        self._last_event_id.pop(worker_id, None)
        task = self._catching_up.pop(worker_id, None)
        if task is not None:
            task.cancel()
        self._indexer.remove_worker(worker_id)

    async def _on_event(self, event: KvEvent) -> None:
        self.apply(event)

    def apply(self, event: KvEvent) -> None:
        """Apply one event if it is the next one of its worker; otherwise resynchronise."""
        worker_id = event.worker_id
        if worker_id in self._removed:
            return
        last = self._last_event_id.get(worker_id)
        if last is not None and event.event_id <= last:
            return  # a duplicate
        in_step = event.event_id == (0 if last is None else last + 1)
        if not in_step and not isinstance(event.data, KvCleared):
            self._lose_track(worker_id)
            return
        try:
            self._indexer.apply_event(worker_id, event.data)
        except UnknownParentError as exc:
            log.warning("KV index out of step with worker %s: %s", worker_id, exc)
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
                    kv_dump_topic(self._component), KvDumpRequest(worker_id=worker_id)
                )
            except Disconnected as exc:
                log.warning("cannot ask worker %s for a KV dump: %s", worker_id, exc)
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
