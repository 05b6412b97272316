"""A prefix cache of KV blocks keyed by Dynamo-compatible block hashes.

The key of a block is its chained sequence hash over the routing view of the prompt (media runs
replaced by their pad values, `mmserve.kv.view`), so the engine's blocks are exactly the ones
the router indexes. A block's KV depends on every token before it, hence the chained hash rather
than the block's local one. Payloads are opaque (the hf engine stores KV tensors, the mock
engine nothing); eviction is LRU under a byte and/or block budget, and every change is reported
as a KV event.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from mmserve.kv.events import KvEventData, KvEventSink
from mmserve.kv.hashing import DEFAULT_BLOCK_SIZE
from mmserve.kv.view import BlockKeys
from mmserve.protocol import KvBlock, KvCleared, KvRemoved, KvStored

Payload = TypeVar("Payload")


@dataclass
class _Entry(Generic[Payload]):
    payload: Payload
    num_bytes: int
    parent_hash: int | None
    tokens_hash: int


class PrefixCache(Generic[Payload]):
    """LRU map from sequence hash to block payload.

    One thread (the engine's) uses and changes it; `snapshot` may be called from any thread.
    """

    def __init__(
        self,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        max_bytes: int | None = None,
        max_blocks: int | None = None,
        payload_bytes: Callable[[Payload], int] = lambda _: 0,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.max_bytes = max_bytes
        self.max_blocks = max_blocks
        self._payload_bytes = payload_bytes
        self._entries: OrderedDict[int, _Entry[Payload]] = OrderedDict()
        self._num_bytes = 0
        self._sinks: list[KvEventSink] = []
        self._lock = threading.Lock()  # guards _entries against a concurrent snapshot

    def subscribe(self, sink: KvEventSink) -> None:
        self._sinks.append(sink)

    @property
    def num_blocks(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def match(self, seq_hashes: Sequence[int], max_blocks: int | None = None) -> list[Payload]:
        """Payloads of the longest cached prefix of `seq_hashes` (at most `max_blocks`)."""
        limit = len(seq_hashes) if max_blocks is None else min(max_blocks, len(seq_hashes))
        found: list[Payload] = []
        for seq_hash in seq_hashes[:limit]:
            entry = self._entries.get(seq_hash)
            if entry is None:
                break
            found.append(entry.payload)
        self._touch(seq_hashes[: len(found)])
        return found

    def held(self, seq_hashes: Sequence[int]) -> int:
        """How many leading blocks of `seq_hashes` are cached; nothing is touched."""
        with self._lock:
            for count, seq_hash in enumerate(seq_hashes):
                if seq_hash not in self._entries:
                    return count
        return len(seq_hashes)

    def store(self, keys: BlockKeys, start: int, payloads: Sequence[Payload]) -> None:
        """Store the payloads of blocks `start, start + 1, ...` of a prompt with `keys`."""
        end = start + len(payloads)
        if end > len(keys.seq_hashes):
            raise ValueError(f"{end} blocks stored for a prompt of {len(keys.seq_hashes)}")
        # One stored event per run of new blocks, each naming the block before it as parent.
        runs: list[tuple[int | None, list[KvBlock]]] = []
        previous_new = False
        for index, payload in zip(range(start, end), payloads, strict=True):
            seq_hash = keys.seq_hashes[index]
            if seq_hash in self._entries:
                previous_new = False
                continue
            parent_hash = keys.seq_hashes[index - 1] if index > 0 else None
            tokens_hash = keys.local_hashes[index]
            entry = _Entry(payload, self._payload_bytes(payload), parent_hash, tokens_hash)
            with self._lock:
                self._entries[seq_hash] = entry
            self._num_bytes += entry.num_bytes
            if not previous_new:
                runs.append((parent_hash, []))
            runs[-1][1].append(KvBlock(block_hash=seq_hash, tokens_hash=tokens_hash))
            previous_new = True
        self._touch(keys.seq_hashes[:end])
        for parent_hash, blocks in runs:
            self._emit(KvStored(parent_hash=parent_hash, blocks=blocks))
        self._evict()

    def snapshot(self) -> list[tuple[int, int | None, int]]:
        """Every cached block as `(block_hash, parent_hash, tokens_hash)`, for a KV dump."""
        with self._lock:
            return [
                (seq_hash, entry.parent_hash, entry.tokens_hash)
                for seq_hash, entry in self._entries.items()
            ]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
        self._num_bytes = 0
        self._emit(KvCleared())

    def _touch(self, seq_hashes: Sequence[int]) -> None:
        # Deepest block first, so a chain's parents are always more recent than its children:
        # eviction then trims chains from the tail and never strands a child without its parent.
        with self._lock:
            for seq_hash in reversed(seq_hashes):
                self._entries.move_to_end(seq_hash)

    def _over_budget(self) -> bool:
        return (self.max_blocks is not None and len(self._entries) > self.max_blocks) or (
            self.max_bytes is not None and self._num_bytes > self.max_bytes
        )

    def _evict(self) -> None:
        removed: list[int] = []
        while self._entries and self._over_budget():
            with self._lock:
                seq_hash, entry = self._entries.popitem(last=False)
            self._num_bytes -= entry.num_bytes
            removed.append(seq_hash)
        if removed:
            self._emit(KvRemoved(block_hashes=removed))

    def _emit(self, event: KvEventData) -> None:
        for sink in self._sinks:
            sink(event)
