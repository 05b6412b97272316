"""The engine's prefix-cache changes as Dynamo's KV events, so Dynamo's KV router
(`--router-mode kv`) routes a prompt to the worker that holds its prefix.

Dynamo's publisher (`dynamo.llm.KvEventPublisher`) takes each stored block's tokens and
recomputes the block's local hash from them (mmserve's block hashes are the same function), while
mmserve's engine reports blocks by hash alone. So the handler `remember`s each planned prompt's
blocks (the routing view the engine's cache keys on: each image's run of tokens in its pad
value) by chained hash before the engine runs, and a stored event is published with those
tokens. The entries live as long as the engine holds the blocks (a removed event drops them).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import msgspec
from prometheus_client import Counter

from mmserve.kv.events import KvEventData
from mmserve.kv.hashing import compute_seq_hashes
from mmserve.kv.pad import PadScheme
from mmserve.kv.view import routing_view
from mmserve.protocol import KvCleared, KvRemoved, KvStored, RequestPlan

log = logging.getLogger("mmserve.dynamo")

_U64 = 1 << 64

# What this worker handed Dynamo's publisher, by Dynamo's event type: a router has seen every
# change once its own `kv_cache_events_applied` count reaches this.
PUBLISHED = Counter(
    "mmserve_dynamo_kv_events_published",
    "KV events published to Dynamo's event plane",
    ["event_type"],
)


def signed(value: int) -> int:
    """A u64 hash as the i64 Dynamo's publisher takes (the same 64 bits)."""
    return value - _U64 if value >= _U64 >> 1 else value


class DynamoKvEvents:
    """Publishes one worker's KV events through Dynamo's event plane."""

    def __init__(self, publisher: Any, block_size: int, scheme: PadScheme) -> None:
        self._publisher = publisher
        self._block_size = block_size
        self._scheme = scheme
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        # chained block hash -> (the block's routing tokens, its media as Dynamo's mm info)
        self._blocks: dict[int, tuple[list[int], dict[str, Any] | None]] = {}

    def remember(self, plan: RequestPlan, routing_hashes: list[int] | None = None) -> None:
        """Record the tokens of the plan's complete blocks under the keys the engine's cache
        gives them. With `routing_hashes` (Dynamo's hash of each image) the tokens are the
        view Dynamo's router hashes: each image's run in the pad value of Dynamo's hash, and no
        media folded into the block hash (its frontend sends none for the router)."""
        size = self._block_size
        view = routing_view(plan.token_ids, plan.media, scheme=self._scheme)
        seq = compute_seq_hashes(view.block_hashes(size))
        spans = view.media_spans
        if routing_hashes is not None:
            media = [
                msgspec.structs.replace(item, mm_hash=mm_hash)
                for item, mm_hash in zip(plan.media, routing_hashes, strict=True)
            ]
            view = routing_view(plan.token_ids, media, scheme=self._scheme)
            spans = ()
        ids = view.ids.tolist()
        with self._lock:
            for index, block_hash in enumerate(seq):
                if block_hash in self._blocks:
                    continue
                start, end = index * size, (index + 1) * size
                objects = [
                    {"mm_hash": mm_hash, "offsets": [[max(s, start) - start, min(e, end) - start]]}
                    for mm_hash, s, e in spans
                    if s < end and e > start
                ]
                info = {"mm_objects": objects} if objects else None
                self._blocks[block_hash] = (ids[start:end], info)

    def sink(self, event: KvEventData) -> None:
        """The engine's KV event sink (called from its thread): publish on the event loop."""
        self._loop.call_soon_threadsafe(self._publish, event)

    def _publish(self, event: KvEventData) -> None:
        if isinstance(event, KvStored):
            with self._lock:
                known = [self._blocks.get(block.block_hash) for block in event.blocks]
            if not event.blocks or any(entry is None for entry in known):
                # Every prompt the engine runs was remembered first; say so if one was not.
                log.warning("KV event for blocks planned elsewhere: %s", event.blocks[:2])
                return
            tokens = [token for entry in known if entry for token in entry[0]]
            infos = [entry[1] if entry else None for entry in known]
            self._publisher.publish_stored(
                tokens,
                [self._block_size] * len(known),
                [signed(block.block_hash) for block in event.blocks],
                parent_hash=None if event.parent_hash is None else signed(event.parent_hash),
                block_mm_infos=infos if any(infos) else None,
            )
            PUBLISHED.labels("stored").inc()
        elif isinstance(event, KvRemoved):
            with self._lock:
                for block_hash in event.block_hashes:
                    self._blocks.pop(block_hash, None)
            self._publisher.publish_removed([signed(h) for h in event.block_hashes])
            PUBLISHED.labels("removed").inc()
        elif isinstance(event, KvCleared):
            with self._lock:
                dropped = list(self._blocks)
                self._blocks.clear()
            if dropped:
                self._publisher.publish_removed([signed(h) for h in dropped])
                PUBLISHED.labels("removed").inc()
