"""Discovery: which instances serve which endpoints, with liveness.

Each served endpoint puts its `InstanceRecord` into the JetStream KV bucket `mmserve_instances`
under `<namespace>.<component>.<endpoint>.<instance_id>` every `HEARTBEAT_INTERVAL` seconds. The
bucket's max age is `LEASE_TTL`, so a snapshot only holds instances heard from recently.
Watchers read one snapshot, then follow the puts and deletes live on a core NATS subscription
(which survives reconnects) and drop an instance not heard from for `LEASE_TTL`: a crashed
instance disappears within `LEASE_TTL + SWEEP_INTERVAL` seconds, a stopped one at once. Time
the watching process itself did not run (a stalled event loop) is not counted as silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Literal

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from mmserve import protocol
from mmserve.runtime.errors import Unavailable

log = logging.getLogger(__name__)

BUCKET = "mmserve_instances"
LEASE_TTL = 3.0
HEARTBEAT_INTERVAL = 0.75
SWEEP_INTERVAL = 0.25
# How long a caller waits for an instance it needs before calling it unavailable: a record the
# bucket expired while its owner's event loop stalled comes back with the next heartbeat.
DISCOVERY_GRACE = 2 * HEARTBEAT_INTERVAL
_KV_OPERATION = "KV-Operation"
_MARKER_REASON = "Nats-Marker-Reason"
REPLICAS = 3  # copies of the bucket on a cluster (a majority of 3 survives one server)
_REPLICAS_NOT_SUPPORTED = 10074  # JetStream: "replicas > 1 not supported in non-clustered mode"


def instance_key(record: protocol.InstanceRecord) -> str:
    return f"{record.namespace}.{record.component}.{record.endpoint}.{record.instance_id}"


def _key_filter(namespace: str, component: str | None, endpoint: str | None) -> str:
    return f"{namespace}.{component or '*'}.{endpoint or '*'}.*"


async def open_bucket(nc: NatsClient, timeout: float = 5.0) -> KeyValue:
    """The instances bucket, created on first use (memory storage: it is rebuilt by heartbeats
    after a nats-server restart). On a cluster it is replicated on `REPLICAS` servers, so
    discovery outlives any one of them; a single server holds the one copy."""
    js = nc.jetstream(timeout=timeout)
    for replicas in (REPLICAS, 1):
        config = KeyValueConfig(
            bucket=BUCKET,
            history=1,
            ttl=LEASE_TTL,
            storage=StorageType.MEMORY,
            replicas=replicas,
        )
        try:
            return await js.create_key_value(config)
        except nats.js.errors.APIError as exc:
            if exc.err_code == _REPLICAS_NOT_SUPPORTED:  # not a cluster
                continue
            if not isinstance(exc, nats.js.errors.BadRequestError):
                raise
            # Created meanwhile with another configuration: use it as it is.
            return await js.key_value(BUCKET)
    raise AssertionError("unreachable: one replica is always supported")


class Registrar:
    """Keeps the records of one runtime's endpoints alive in the bucket."""

    def __init__(self, nc: NatsClient) -> None:
        self._nc = nc
        self._records: dict[str, protocol.InstanceRecord] = {}
        self._heartbeat: asyncio.Task[None] | None = None

    async def register(self, record: protocol.InstanceRecord) -> None:
        """Put the record now (raising `Unavailable` if discovery does not work at all, e.g.
        nats-server runs without JetStream), then keep it alive."""
        key = instance_key(record)
        error = await self._put(key, record)
        if error is not None:
            raise Unavailable(
                None, f"cannot register {key} (does nats-server run with JetStream, -js?): {error}"
            )
        self._records[key] = record
        if self._heartbeat is None:
            self._heartbeat = asyncio.create_task(self._beat(), name="mmserve-heartbeat")

    async def deregister_all(self) -> None:
        """Stop heartbeats and delete every record, so watchers drop them at once."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None
        keys, self._records = list(self._records), {}
        if not keys or not self._nc.is_connected:
            return
        try:
            bucket = await self._nc.jetstream().key_value(BUCKET)
            for key in keys:
                await bucket.delete(key)
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            log.warning("could not deregister %s (they expire by themselves): %s", keys, exc)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL)
            if not self._nc.is_connected:
                continue
            records = list(self._records.items())
            # Each beat waits for JetStream's acknowledgements less than until the next one: a
            # cluster electing a new leader for the bucket (seconds, after a node is lost) must
            # not stop the beats, which watchers hear on core NATS all the same.
            puts = (self._put(key, record, HEARTBEAT_INTERVAL / 2) for key, record in records)
            errors = await asyncio.gather(*puts)
            for (key, _), error in zip(records, errors, strict=True):
                if error is not None:
                    log.warning("heartbeat for %s failed: %r", key, error)

    async def _put(
        self, key: str, record: protocol.InstanceRecord, timeout: float = 5.0
    ) -> Exception | None:
        """Put `record` (a publish on the bucket's subject, acknowledged by its stream);
        returns the error of the last of two attempts, None on success. Each attempt publishes
        first: watchers hear the record on core NATS even while no stream acknowledges it (a
        cluster electing the bucket's leader takes seconds), so a heartbeat never waits on the
        bucket's creation."""
        value = protocol.encode(record)
        js = self._nc.jetstream(timeout=timeout)
        error: Exception | None = None
        for attempt in range(2):
            try:
                await js.publish(f"$KV.{BUCKET}.{key}", value)
                return None
            except nats.js.errors.NoStreamResponseError as exc:
                # No stream answered: after a nats-server restart the memory bucket is gone
                # (create it again), or a cluster has no leader for it yet.
                error = exc
                if attempt == 0:
                    with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                        await open_bucket(self._nc, timeout)
            except (nats.errors.Error, asyncio.TimeoutError) as exc:
                error = exc
        return error


async def list_instances(
    nc: NatsClient, namespace: str, component: str | None = None, endpoint: str | None = None
) -> list[protocol.InstanceRecord]:
    """One snapshot of the live instances (optionally of one component / endpoint)."""
    js = nc.jetstream()
    try:
        bucket = await js.key_value(BUCKET)
    except nats.js.errors.BucketNotFoundError:
        return []
    watcher = await bucket.watch(_key_filter(namespace, component, endpoint), ignore_deletes=True)
    records = []
    try:
        while (entry := await watcher.updates(timeout=5.0)) is not None:
            if not entry.value:
                continue
            try:
                records.append(protocol.decode(entry.value, protocol.InstanceRecord))
            except protocol.ProtocolError as exc:
                log.warning("ignoring instance record %s: %s", entry.key, exc)
    finally:
        await watcher.stop()
    return records


class InstanceEvent(msgspec.Struct, frozen=True):
    kind: Literal["added", "removed"]
    record: protocol.InstanceRecord
    expired: bool = False  # removed because its heartbeats stopped (a crash), not deregistered


class InstanceWatcher:
    """A live view of the instances matching one filter; start with `Runtime.watch(...)`."""

    def __init__(
        self, nc: NatsClient, namespace: str, component: str | None, endpoint: str | None
    ) -> None:
        self._nc = nc
        self._namespace = namespace
        self._component = component
        self._endpoint = endpoint
        self._live: dict[str, tuple[protocol.InstanceRecord, float]] = {}
        self._listeners: set[asyncio.Queue[InstanceEvent]] = set()
        self._changed = asyncio.Event()
        self._subscription: Subscription | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> InstanceWatcher:
        subject = f"$KV.{BUCKET}.{_key_filter(self._namespace, self._component, self._endpoint)}"
        self._subscription = await self._nc.subscribe(subject, cb=self._on_message)
        for record in await list_instances(
            self._nc, self._namespace, self._component, self._endpoint
        ):
            self._upsert(record)
        self._sweeper = asyncio.create_task(self._sweep(), name="mmserve-discovery-sweep")
        return self

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        if self._subscription is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._subscription.unsubscribe()
            self._subscription = None

    def instances(self) -> list[protocol.InstanceRecord]:
        return [record for record, _ in self._live.values()]

    def instance_ids(self) -> set[str]:
        return {record.instance_id for record, _ in self._live.values()}

    async def wait_until(
        self, predicate: Callable[[list[protocol.InstanceRecord]], bool], timeout: float
    ) -> list[protocol.InstanceRecord]:
        """Wait until `predicate(instances)` holds; `TimeoutError` after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not predicate(instances := self.instances()):
            changed = self._changed
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"instances did not reach the expected state: {instances}")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), left)
        return instances

    async def events(self) -> AsyncIterator[InstanceEvent]:
        """Added / removed events from now on (the current set is in `instances()`)."""
        queue: asyncio.Queue[InstanceEvent] = asyncio.Queue()
        self._listeners.add(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self._listeners.discard(queue)

    async def __aenter__(self) -> InstanceWatcher:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def _on_message(self, msg: Msg) -> None:
        headers = msg.headers or {}
        key = msg.subject.removeprefix(f"$KV.{BUCKET}.")
        if _KV_OPERATION in headers or _MARKER_REASON in headers or not msg.data:
            self._remove(key)
            return
        try:
            record = protocol.decode(msg.data, protocol.InstanceRecord)
        except protocol.ProtocolError as exc:
            log.warning("ignoring instance record %s: %s", key, exc)
            return
        self._upsert(record)

    def _upsert(self, record: protocol.InstanceRecord) -> None:
        key = instance_key(record)
        known = key in self._live
        self._live[key] = (record, time.monotonic())
        if not known:
            self._notify(InstanceEvent("added", record))

    def _remove(self, key: str, expired: bool = False) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._notify(InstanceEvent("removed", entry[0], expired))

    def _notify(self, event: InstanceEvent) -> None:
        for queue in self._listeners:
            queue.put_nowait(event)
        self._changed.set()
        self._changed = asyncio.Event()

    async def _sweep(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(SWEEP_INTERVAL)
            now = time.monotonic()
            stalled = now - before - SWEEP_INTERVAL
            if stalled > SWEEP_INTERVAL:
                # This process did not run (a busy or starved event loop): heartbeats may wait
                # unread on the socket, so the stall does not count as the instances' silence.
                self._live = {k: (r, seen + stalled) for k, (r, seen) in self._live.items()}
                continue
            expired_before = now - LEASE_TTL
            for key in [k for k, (_, seen) in self._live.items() if seen < expired_before]:
                self._remove(key, expired=True)


async def wait_for_change(watchers: Iterable[InstanceWatcher], timeout: float) -> None:
    """Return once any of `watchers` gains or loses an instance, or after `timeout` seconds."""
    waits = [asyncio.ensure_future(watcher._changed.wait()) for watcher in watchers]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
