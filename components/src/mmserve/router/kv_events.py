"""The router's side of KV events (`mmserve.kv.events` has the topics and the workers' side):
follow every worker's events into an indexer, catching up from dumps
(`mmserve.runtime.cache_events.CacheEventSubscriber`); a stored event after a parent the index
does not know puts the worker out of step."""

from __future__ import annotations

from mmserve.kv.events import KvEventData, kv_topics
from mmserve.router.indexer import KvIndexer, UnknownParentError
from mmserve.runtime import Runtime
from mmserve.runtime.cache_events import CacheEventSubscriber, follow_discovery

__all__ = ["KvEventSubscriber", "follow_discovery"]


class KvEventSubscriber(CacheEventSubscriber[KvEventData]):
    """A router's side: applies the workers' KV events to an indexer, in order."""

    def __init__(
        self,
        runtime: Runtime,
        indexer: KvIndexer,
        component: str,
        *,
        dump_retry_s: float = 1.0,
    ) -> None:
        super().__init__(
            runtime,
            indexer,
            kv_topics(component),
            out_of_step=(UnknownParentError,),
            dump_retry_s=dump_retry_s,
        )
