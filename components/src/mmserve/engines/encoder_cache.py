"""The encoder cache: item embeddings an engine keeps so a repeated image skips the vision
tower. It tells its sinks what it stores, evicts and clears (`protocol.EncoderStored`,
`EncoderEvicted`, `EncoderCleared`), which the worker publishes as embedding-cache events so
the routers send an image to the encoder that holds it (`mmserve.kv.encoder_events`)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from mmserve.engines.base import ItemEmbedding
from mmserve.kv.encoder_events import EncoderEventData, EncoderEventSink, EncoderKey, encoder_key
from mmserve.protocol import EncoderCleared, EncoderEntry, EncoderEvicted, EncoderStored


def _size(item: ItemEmbedding) -> int:
    return sum(t.numel() * t.element_size() for t in (item.embeddings, *item.deepstack))


def _entry(key: EncoderKey, item: ItemEmbedding) -> EncoderEntry:
    return EncoderEntry(mm_hash=key[0], grid_thw=key[1], num_tokens=item.num_tokens)


class EncoderCache:
    """LRU of item embeddings by `EncoderKey`, under a byte budget, counting hits and misses.

    Safe to use from several threads; sinks are called outside the cache's lock, so a dump
    taken meanwhile may already show a change whose event follows it (applying it again is
    harmless: the index keeps sets).
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[EncoderKey, ItemEmbedding] = OrderedDict()
        self._num_bytes = 0
        self._lock = threading.Lock()
        self._sinks: list[EncoderEventSink] = []
        self.hits = 0
        self.misses = 0

    def subscribe(self, sink: EncoderEventSink) -> None:
        self._sinks.append(sink)

    def _emit(self, data: EncoderEventData) -> None:
        for sink in self._sinks:
            sink(data)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, mm_hash: int, grid_thw: Sequence[int]) -> ItemEmbedding | None:
        key = encoder_key(mm_hash, grid_thw)
        with self._lock:
            item = self._entries.get(key)
            if item is None:
                self.misses += 1
                return None
            self.hits += 1
            self._entries.move_to_end(key)
            return item

    def put(self, item: ItemEmbedding) -> None:
        key = encoder_key(item.mm_hash, item.grid_thw)
        size = _size(item)
        evicted: list[EncoderEntry] = []
        with self._lock:
            if size > self.max_bytes or key in self._entries:
                return
            self._entries[key] = item
            self._num_bytes += size
            while self._num_bytes > self.max_bytes:
                old_key, old = self._entries.popitem(last=False)
                self._num_bytes -= _size(old)
                evicted.append(_entry(old_key, old))
        if evicted:
            self._emit(EncoderEvicted(entries=evicted))
        self._emit(EncoderStored(entries=[_entry(key, item)]))

    def clear(self) -> int:
        """Drop every entry; returns how many. The hit and miss counts (the metrics' totals)
        stay."""
        with self._lock:
            dropped = len(self._entries)
            self._entries.clear()
            self._num_bytes = 0
        self._emit(EncoderCleared())
        return dropped

    def snapshot(self) -> list[EncoderEntry]:
        """Every entry, least recently used first; callable from any thread."""
        with self._lock:
            return [_entry(key, item) for key, item in self._entries.items()]

    def stats(self) -> tuple[int, int]:
        return self.hits, self.misses
