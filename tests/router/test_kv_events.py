"""KV events over a real nats-server: a router follows workers, catches up, drops the gone."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest

from mmserve.kv.events import dump_events, kv_dump_topic, kv_events_topic
from mmserve.kv.hashing import compute_seq_hashes
from mmserve.protocol import KvBlock, KvCleared, KvDumpRequest, KvEvent, KvRemoved, KvStored
from mmserve.router.indexer import KvIndexer
from mmserve.router.kv_events import KvEventSubscriber, follow_discovery
from mmserve.runtime import Runtime
from mmserve.worker.publishers import KvEventPublisher

COMPONENT = "worker"


class FakeCacheOwner:
    """Stands in for an engine's block cache: blocks it holds and the events it emits."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, int]] = {}

    def store(self, local: list[int], parent_local: list[int] | None = None) -> KvStored:
        prefix = parent_local or []
        seq = compute_seq_hashes(prefix + local)
        parent = seq[len(prefix) - 1] if prefix else None
        blocks = []
        for block_hash, tokens_hash in zip(seq[len(prefix) :], local, strict=True):
            self.blocks[block_hash] = (parent, tokens_hash)
            blocks.append(KvBlock(block_hash=block_hash, tokens_hash=tokens_hash))
            parent = block_hash
        return KvStored(parent_hash=seq[len(prefix) - 1] if prefix else None, blocks=blocks)

    def remove(self, block_hashes: list[int]) -> KvRemoved:
        for block_hash in block_hashes:
            self.blocks.pop(block_hash)
        return KvRemoved(block_hashes=block_hashes)

    def snapshot(self) -> list[tuple[int, int | None, int]]:
        return [(b, parent, tokens) for b, (parent, tokens) in self.blocks.items()]


async def eventually(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


@pytest.fixture
async def runtimes(nats_url: str) -> AsyncIterator[tuple[Runtime, Runtime]]:
    """A worker's runtime and a router's runtime in a namespace of this test alone."""
    namespace = f"router-{uuid.uuid4().hex[:8]}"
    worker = await Runtime.connect(nats_url, namespace)
    router = await Runtime.connect(nats_url, namespace)
    yield worker, router
    await router.shutdown()
    await worker.shutdown()


@dataclass
class Link:
    """A worker publishing its cache's events and a router following them, both started."""

    worker_rt: Runtime
    cache: FakeCacheOwner
    indexer: KvIndexer
    subscriber: KvEventSubscriber
    publisher: KvEventPublisher


@pytest.fixture
async def link(runtimes: tuple[Runtime, Runtime]) -> AsyncIterator[Link]:
    worker_rt, router_rt = runtimes
    cache, indexer = FakeCacheOwner(), KvIndexer()
    async with (
        KvEventSubscriber(router_rt, indexer, COMPONENT) as subscriber,
        KvEventPublisher(worker_rt, COMPONENT, cache.snapshot) as publisher,
    ):
        yield Link(worker_rt, cache, indexer, subscriber, publisher)


async def test_router_follows_a_worker(link: Link) -> None:
    cache, indexer, publisher = link.cache, link.indexer, link.publisher
    worker = publisher.worker_id
    first = cache.store([1, 2])
    publisher.publish(first)
    publisher.publish(cache.store([3, 4], parent_local=[1, 2]))
    await eventually(lambda: indexer.find_matches([1, 2, 3, 4]) == {worker: 4})
    publisher.publish(cache.remove([first.blocks[1].block_hash]))
    await eventually(lambda: indexer.find_matches([1, 2, 3, 4]) == {worker: 1})
    assert link.subscriber.following(worker)


async def test_events_from_an_engine_thread_arrive_in_order(
    link: Link, runtimes: tuple[Runtime, Runtime]
) -> None:
    _, router_rt = runtimes
    dump_requests: list[KvDumpRequest] = []

    async def record(request: KvDumpRequest) -> None:
        dump_requests.append(request)

    await router_rt.subscribe(kv_dump_topic(COMPONENT), KvDumpRequest, record)
    cache, indexer, publisher = link.cache, link.indexer, link.publisher
    chain = list(range(1, 301))

    def engine_thread() -> None:
        # Each block's parent is the one before: any reordering would break the chain.
        for depth in range(len(chain)):
            publisher.publish(cache.store([chain[depth]], parent_local=chain[:depth]))

    await asyncio.to_thread(engine_thread)
    worker = publisher.worker_id
    await eventually(lambda: indexer.find_matches(chain) == {worker: len(chain)})
    assert dump_requests == []


async def test_a_dump_leaves_after_the_events_numbered_before_it(
    runtimes: tuple[Runtime, Runtime],
) -> None:
    worker_rt, router_rt = runtimes
    seen: list[KvEvent] = []

    async def record(event: KvEvent) -> None:
        seen.append(event)

    await router_rt.subscribe(kv_events_topic(COMPONENT), KvEvent, record)
    await router_rt.flush()
    cache = FakeCacheOwner()
    async with KvEventPublisher(worker_rt, COMPONENT, cache.snapshot) as publisher:
        # An engine thread numbers an event; before the loop queues it, a dump is answered.
        thread = threading.Thread(target=publisher.publish, args=(cache.store([1]),))
        thread.start()
        thread.join()
        await publisher._on_dump_request(KvDumpRequest(worker_id=publisher.worker_id))
        await eventually(lambda: len(seen) == 3)  # the event, then cleared + one stored run
    assert [event.event_id for event in seen] == [0, 1, 2]
    assert isinstance(seen[1].data, KvCleared)


async def test_late_router_catches_up_from_a_dump(runtimes: tuple[Runtime, Runtime]) -> None:
    worker_rt, router_rt = runtimes
    cache = FakeCacheOwner()
    async with KvEventPublisher(worker_rt, COMPONENT, cache.snapshot) as publisher:
        worker = publisher.worker_id
        # Events nobody hears: the router is not there yet.
        publisher.publish(cache.store([1, 2, 3]))
        publisher.publish(cache.store([7, 8], parent_local=[1]))
        publisher.publish(cache.store([5]))
        indexer = KvIndexer()
        async with KvEventSubscriber(router_rt, indexer, COMPONENT) as subscriber:
            # The next event cannot be placed: the router asks for a dump and catches up.
            publisher.publish(cache.store([4], parent_local=[1, 2, 3]))
            await eventually(lambda: subscriber.following(worker))
            await eventually(lambda: indexer.num_blocks(worker) == len(cache.blocks))
            assert indexer.find_matches([1, 2, 3, 4]) == {worker: 4}
            assert indexer.find_matches([1, 7, 8]) == {worker: 3}
            assert indexer.find_matches([5]) == {worker: 1}
            # And keeps following afterwards.
            publisher.publish(cache.store([6], parent_local=[5]))
            await eventually(lambda: indexer.find_matches([5, 6]) == {worker: 2})


async def test_late_router_catches_up_with_an_idle_worker(
    runtimes: tuple[Runtime, Runtime],
) -> None:
    worker_rt, router_rt = runtimes
    cache = FakeCacheOwner()
    async with KvEventPublisher(worker_rt, COMPONENT, cache.snapshot) as publisher:
        worker = publisher.worker_id
        publisher.publish(cache.store([1, 2, 3]))
        indexer = KvIndexer()
        async with KvEventSubscriber(router_rt, indexer, COMPONENT) as subscriber:
            # No event follows; the router asks the workers discovery lists.
            subscriber.catch_up([worker])
            await eventually(lambda: indexer.find_matches([1, 2, 3]) == {worker: 3})
            assert subscriber.following(worker)


async def test_a_worker_lost_again_as_its_catch_up_ends_is_asked_again(
    runtimes: tuple[Runtime, Runtime],
) -> None:
    _, router_rt = runtimes
    asked: list[KvDumpRequest] = []

    async def record(request: KvDumpRequest) -> None:
        asked.append(request)

    await router_rt.subscribe(kv_dump_topic(COMPONENT), KvDumpRequest, record)
    await router_rt.flush()
    retry_s = 0.2
    async with KvEventSubscriber(router_rt, KvIndexer(), COMPONENT, dump_retry_s=retry_s) as sub:
        idle = "idle-worker"
        sub.apply(KvEvent(worker_id=idle, event_id=3, data=KvRemoved(block_hashes=[])))
        await eventually(lambda: len(asked) == 1)  # its catch-up now sleeps until the retry
        sub.apply(KvEvent(worker_id=idle, event_id=4, data=KvCleared()))
        assert sub.following(idle)
        # A gap lands right after the catch-up's last step (woken by its retry timer, it sees
        # the worker in step and ends) and before its end is recorded (its done callback).
        # Blocking the loop past the retry makes both timers due in one turn; this one, due
        # first, reaches `apply` through two more callbacks, after the catch-up's wake-up.
        # (Whatever the order, a fixed subscriber asks again; only the window shows the bug.)
        loop = asyncio.get_running_loop()
        gap = KvEvent(worker_id=idle, event_id=9, data=KvRemoved(block_hashes=[]))
        loop.call_later(0, lambda: loop.call_soon(lambda: loop.call_soon(sub.apply, gap)))
        time.sleep(2 * retry_s)  # noqa: ASYNC251 (blocking the loop is the point)
        # The worker is idle: only a new dump request can bring it back in step.
        await eventually(lambda: len(asked) >= 2, timeout=1.0)
        assert not sub.following(idle)


async def test_a_gap_in_event_ids_resynchronises(link: Link) -> None:
    cache, indexer, publisher = link.cache, link.indexer, link.publisher
    worker = publisher.worker_id
    publisher.publish(cache.store([1]))
    await eventually(lambda: indexer.find_matches([1]) == {worker: 1})
    # A stored event the router never sees, and one after it that names it as parent.
    cache.store([2], parent_local=[1])
    await link.worker_rt.publish(
        kv_events_topic(COMPONENT),
        KvEvent(worker_id=worker, event_id=5, data=cache.store([3], parent_local=[1, 2])),
    )
    await eventually(lambda: indexer.find_matches([1, 2, 3]) == {worker: 3})
    assert link.subscriber.following(worker)


async def test_worker_leaving_discovery_leaves_the_index(
    runtimes: tuple[Runtime, Runtime],
) -> None:
    worker_rt, router_rt = runtimes

    async def ping(request: KvDumpRequest, _ctx: object) -> KvDumpRequest:
        return request

    await worker_rt.serve(COMPONENT, "generate", ping, KvDumpRequest)
    cache, indexer = FakeCacheOwner(), KvIndexer()
    watcher = await router_rt.watch(COMPONENT)
    async with (
        KvEventSubscriber(router_rt, indexer, COMPONENT) as subscriber,
        KvEventPublisher(worker_rt, COMPONENT, cache.snapshot) as publisher,
    ):
        follower = asyncio.create_task(follow_discovery(watcher, subscriber.on_instance_removed))
        worker = publisher.worker_id
        await watcher.wait_until(lambda records: len(records) == 1, timeout=5)
        publisher.publish(cache.store([1, 2]))
        await eventually(lambda: indexer.find_matches([1, 2]) == {worker: 2})
        await worker_rt.shutdown()  # deregisters: discovery drops the instance at once
        await eventually(lambda: indexer.find_matches([1, 2]) == {})
        assert indexer.workers() == []
        follower.cancel()


def test_dump_events_order_parents_first_and_skip_orphans() -> None:
    cache = FakeCacheOwner()
    cache.store([1, 2, 3])
    cache.store([7], parent_local=[1])
    blocks = cache.snapshot()
    orphan = (999, 12345, 9)  # its parent is not cached
    events = dump_events("w", 10, [*reversed(blocks), orphan])
    assert [e.event_id for e in events] == list(range(10, 10 + len(events)))
    indexer = KvIndexer()
    for event in events:
        indexer.apply_event("w", event.data)  # raises on a parent that comes too late
    assert indexer.num_blocks("w") == 4
    assert indexer.find_matches([1, 2, 3]) == {"w": 3}
