"""KV events: what the engines and the router share about a worker's prefix cache.

They are cache events (numbered per worker, dumps for a router that lost track; the machinery is
`mmserve.runtime.cache_events`) on two topics per component:

- `kv_events-<component>` (`protocol.KvEvent`): every worker of the component publishes its
  events here;
- `kv_dump-<component>` (`protocol.KvDumpRequest`): a router asks a worker for a dump, which
  `dump_events` builds: a cleared event, then its whole cache as stored events.

This module holds what both sides agree on, and imports no transport: engines see only the
event data and the sink they call. The workers publish with
`mmserve.worker.publishers.KvEventPublisher`; the router follows the topics with
`mmserve.router.kv_events.KvEventSubscriber`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from mmserve.protocol import KvBlock, KvCleared, KvDumpRequest, KvEvent, KvRemoved, KvStored
from mmserve.protocol.runtime import CacheEventTopics

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


def kv_topics(component: str) -> CacheEventTopics:
    return CacheEventTopics(
        events_topic=kv_events_topic(component),
        dump_topic=kv_dump_topic(component),
        event_type=KvEvent,
        dump_request_type=KvDumpRequest,
        cleared_type=KvCleared,
        name="KV",
    )


def dump_data(blocks: Iterable[tuple[int, int | None, int]]) -> list[KvEventData]:
    """A worker's whole cache as KV event data, for a router that lost track of it.

    `blocks` are `(block_hash, parent_hash, tokens_hash)` in any order; a block whose parent is
    not cached is left out (it cannot count towards an overlap). The data are a cleared event,
    then stored runs, parents first.
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
    return data


def dump_events(
    worker_id: str,
    first_event_id: int,
    blocks: Iterable[tuple[int, int | None, int]],
) -> list[KvEvent]:
    """`dump_data` as KV events with consecutive ids from `first_event_id`."""
    return [
        KvEvent(worker_id=worker_id, event_id=first_event_id + offset, data=item)
        for offset, item in enumerate(dump_data(blocks))
    ]
