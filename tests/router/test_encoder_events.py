"""Embedding-cache events over a real nats-server: an engine's encoder cache publishes what it
stores, evicts and clears; a router follows, catches up from a dump and drops the gone."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import torch

from mmserve.engines.base import ItemEmbedding
from mmserve.engines.encoder_cache import EncoderCache
from mmserve.kv.encoder_events import encoder_key
from mmserve.protocol import EncoderCleared, EncoderDumpRequest, EncoderEvicted, EncoderStored
from mmserve.router.encoder_index import EncoderEventSubscriber, EncoderIndex
from mmserve.runtime import Runtime
from mmserve.runtime.cache_events import follow_discovery
from mmserve.worker.publishers import EncoderEventPublisher
from tests.router.test_kv_events import eventually

COMPONENT = "encode"
ROW_BYTES = 8 * 4  # a row of 8 float32 columns


def embedding(mm_hash: int, rows: int) -> ItemEmbedding:
    return ItemEmbedding(mm_hash, (1, 2, 2 * rows), torch.zeros(rows, 8))


def key(item: ItemEmbedding) -> tuple[tuple[int, tuple[int, int, int]], int]:
    return encoder_key(item.mm_hash, item.grid_thw), item.num_tokens


@pytest.fixture
async def runtimes(nats_url: str) -> AsyncIterator[tuple[Runtime, Runtime]]:
    namespace = f"encoder-{uuid.uuid4().hex[:8]}"
    worker = await Runtime.connect(nats_url, namespace)
    router = await Runtime.connect(nats_url, namespace)
    yield worker, router
    await router.shutdown()
    await worker.shutdown()


def test_the_cache_says_what_it_stores_evicts_and_clears() -> None:
    cache = EncoderCache(max_bytes=10 * ROW_BYTES)
    events: list = []
    cache.subscribe(events.append)
    a, b, c = embedding(1, 4), embedding(2, 4), embedding(3, 4)
    cache.put(a)
    cache.put(b)
    assert cache.get(a.mm_hash, [1, 2, 8]) is a  # a grid from the wire; a is now the newest
    cache.put(c)  # over budget: b, the least recently used, goes
    assert [type(e) for e in events] == [
        EncoderStored,
        EncoderStored,
        EncoderEvicted,
        EncoderStored,
    ]
    assert [(e.mm_hash, e.num_tokens) for e in events[2].entries] == [(2, 4)]
    assert (cache.hits, cache.misses) == (1, 0)
    assert cache.get(b.mm_hash, b.grid_thw) is None
    assert {e.mm_hash for e in cache.snapshot()} == {1, 3}
    assert cache.clear() == 2
    assert isinstance(events[-1], EncoderCleared) and cache.snapshot() == []


async def test_router_follows_an_encoder_and_a_late_one_catches_up(
    runtimes: tuple[Runtime, Runtime],
) -> None:
    worker_rt, router_rt = runtimes
    cache = EncoderCache(max_bytes=10 * ROW_BYTES)
    a, b, c = embedding(1, 4), embedding(2, 4), embedding(3, 3)
    async with EncoderEventPublisher(worker_rt, COMPONENT, cache.snapshot) as publisher:
        cache.subscribe(publisher.publish)
        worker = publisher.worker_id
        cache.put(a)  # nobody hears it: the router is not there yet
        index = EncoderIndex()
        async with EncoderEventSubscriber(router_rt, index, COMPONENT) as subscriber:
            subscriber.catch_up([worker])  # as the frontend does with discovery's instances
            await eventually(lambda: index.held_tokens([key(a)]) == {worker: 4})
            cache.put(b)
            cache.put(c)  # evicts a
            await eventually(lambda: index.held_tokens([key(a), key(b), key(c)]) == {worker: 7})
            assert index.held_tokens([key(a)]) == {}
            cache.clear()
            await eventually(lambda: index.num_entries(worker) == 0)
            assert subscriber.following(worker)


async def test_an_encoder_leaving_discovery_leaves_the_index(
    runtimes: tuple[Runtime, Runtime],
) -> None:
    worker_rt, router_rt = runtimes

    async def ping(request: EncoderDumpRequest, _ctx: object) -> EncoderDumpRequest:
        return request

    await worker_rt.serve(COMPONENT, "generate", ping, EncoderDumpRequest)
    cache, index = EncoderCache(max_bytes=1 << 20), EncoderIndex()
    watcher = await router_rt.watch(COMPONENT)
    async with (
        EncoderEventSubscriber(router_rt, index, COMPONENT) as subscriber,
        EncoderEventPublisher(worker_rt, COMPONENT, cache.snapshot) as publisher,
    ):
        cache.subscribe(publisher.publish)
        follower = asyncio.create_task(follow_discovery(watcher, subscriber.on_instance_removed))
        await watcher.wait_until(lambda records: len(records) == 1, timeout=5)
        item = embedding(7, 3)
        cache.put(item)
        await eventually(lambda: index.held_tokens([key(item)]) == {publisher.worker_id: 3})
        await worker_rt.shutdown()  # deregisters: discovery drops the instance at once
        await eventually(lambda: index.workers() == [])
        follower.cancel()
