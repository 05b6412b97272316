"""The workers' side of the cache events: number and publish an engine's prefix-cache (KV) and
encoder-cache changes for the routers, and answer a router's dump request.

What the events are, their topics and their dumps are the engine-neutral contract in `kv/`
(`kv.events`, `kv.encoder_events`); the numbering, the sender and the dump subscription are the
runtime's (`runtime.cache_events.CacheEventPublisher`). Engines only ever see the sinks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmserve.kv import encoder_events, events
from mmserve.kv.encoder_events import EncoderEventData, EncoderSnapshot, encoder_topics
from mmserve.kv.events import CacheSnapshot, KvEventData, kv_topics
from mmserve.runtime import Runtime
from mmserve.runtime.cache_events import CacheEventPublisher

if TYPE_CHECKING:
    from mmserve.engines.base import Engine


class KvEventPublisher(CacheEventPublisher[KvEventData]):
    """A worker's side: numbers and publishes its KV events, answers dump requests.

    `publish` may be called from any thread (pass it to `Engine.subscribe_kv_events` as is).
    `snapshot` lists the cache's blocks when a router asks; it runs on the event loop's thread
    under the publisher's lock, so it must not wait for a thread that is inside `publish` (a
    cache that emits events outside its own lock, as `engines.prefix_cache.PrefixCache` does,
    is fine).
    """

    def __init__(self, runtime: Runtime, component: str, snapshot: CacheSnapshot) -> None:
        super().__init__(runtime, kv_topics(component), lambda: events.dump_data(snapshot()))


class EncoderEventPublisher(CacheEventPublisher[EncoderEventData]):
    """A worker's side: numbers and publishes its encoder-cache events (thread-safe
    `publish`), answers dump requests with `snapshot`."""

    def __init__(self, runtime: Runtime, component: str, snapshot: EncoderSnapshot) -> None:
        super().__init__(
            runtime, encoder_topics(component), lambda: encoder_events.dump_data(snapshot())
        )


async def publish_encoder_events(
    runtime: Runtime, engine: Engine, component: str
) -> EncoderEventPublisher:
    """Publish the engine's encoder-cache changes for the routers of `component`; a router
    that lost track gets a dump of `encoder_cache_snapshot`."""
    publisher = await EncoderEventPublisher(
        runtime, component, engine.encoder_cache_snapshot
    ).start()
    engine.subscribe_encoder_events(publisher.publish)  # thread-safe, keeps the events' order
    return publisher


async def publish_kv_events(runtime: Runtime, engine: Engine, component: str) -> KvEventPublisher:
    """Publish the engine's prefix-cache changes for the routers of `component`, as the
    runtime's instance; a router that lost track gets a dump of `kv_cache_snapshot`."""
    publisher = await KvEventPublisher(runtime, component, engine.kv_cache_snapshot).start()
    engine.subscribe_kv_events(publisher.publish)  # thread-safe, keeps the events' order
    return publisher
