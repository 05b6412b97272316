"""Embedding-cache events: what the encoders and the router share about each encoder's cache
of vision-tower outputs (`engines.encoder_cache.EncoderCache`).

They are cache events (numbered per worker, dumps for a router that lost track; the machinery is
`mmserve.runtime.cache_events`), as KV events are, on two topics per component:

- `encoder_events-<component>` (`protocol.EncoderEvent`): every worker of the component that
  encodes (`encode`, `worker --encode`, `prefill --encode`) publishes its events here;
- `encoder_dump-<component>` (`protocol.EncoderDumpRequest`): a router asks a worker for a
  dump: a cleared event, then every entry in one stored event.

This module holds what both sides agree on, and imports no transport. The workers publish with
`mmserve.worker.publishers.EncoderEventPublisher`; the router follows the topics with
`mmserve.router.encoder_index.EncoderEventSubscriber`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mmserve.protocol import (
    CacheEventTopics,
    EncoderCleared,
    EncoderDumpRequest,
    EncoderEntry,
    EncoderEvent,
    EncoderEvicted,
    EncoderStored,
)

EncoderEventData = EncoderStored | EncoderEvicted | EncoderCleared
EncoderEventSink = Callable[[EncoderEventData], None]
"""Called for every change of an engine's encoder cache; must not block."""

EncoderKey = tuple[int, tuple[int, int, int]]
"""(item identity, grid): the item's content hash folded with its pixel bounds
(`PlannedMedia.mm_hash`), and the grid it was processed to; equal keys mean equal embeddings
for one model. The encoder cache's key, and the encoder index's."""


def encoder_key(mm_hash: int, grid_thw: Sequence[int]) -> EncoderKey:
    t, h, w = grid_thw  # a list when it came over the wire: keys must be hashable
    return (mm_hash, (t, h, w))


EncoderSnapshot = Callable[[], Sequence[EncoderEntry]]
"""A worker's cached embeddings, in any order."""


def encoder_topics(component: str) -> CacheEventTopics:
    return CacheEventTopics(
        events_topic=f"encoder_events-{component}",
        dump_topic=f"encoder_dump-{component}",
        event_type=EncoderEvent,
        dump_request_type=EncoderDumpRequest,
        cleared_type=EncoderCleared,
        name="encoder",
    )


def dump_data(entries: Sequence[EncoderEntry]) -> list[EncoderEventData]:
    """An encoder cache's entries as event data: cleared, then stored."""
    data: list[EncoderEventData] = [EncoderCleared()]
    if entries:
        data.append(EncoderStored(entries=list(entries)))
    return data
