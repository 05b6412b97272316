"""The encoder index: which encoder holds which embeddings, fed by the workers' embedding-cache
events (`mmserve.kv.encoder_events`), and the subscriber that follows those events into it
(`runtime.cache_events`: in order, dumps for a late router, gone workers dropped)."""

from __future__ import annotations

from collections.abc import Iterable

from mmserve.kv.encoder_events import EncoderEventData, EncoderKey, encoder_key, encoder_topics
from mmserve.protocol import EncoderEvicted, EncoderStored
from mmserve.runtime import Runtime
from mmserve.runtime.cache_events import CacheEventSubscriber


class EncoderIndex:
    """Per worker, the embeddings its encoder cache holds and their token counts."""

    def __init__(self) -> None:
        self._held: dict[str, dict[EncoderKey, int]] = {}

    def apply_event(self, worker_id: str, event: EncoderEventData) -> None:
        """Apply one change of `worker_id`'s cache (idempotent: a set of entries)."""
        held = self._held.setdefault(worker_id, {})
        if isinstance(event, EncoderStored):
            for entry in event.entries:
                held[encoder_key(entry.mm_hash, entry.grid_thw)] = entry.num_tokens
        elif isinstance(event, EncoderEvicted):
            for entry in event.entries:
                held.pop(encoder_key(entry.mm_hash, entry.grid_thw), None)
        else:
            held.clear()

    def remove_worker(self, worker_id: str) -> None:
        """Forget `worker_id` and its entries (it left the deployment)."""
        self._held.pop(worker_id, None)

    def held_tokens(self, items: Iterable[tuple[EncoderKey, int]]) -> dict[str, int]:
        """Tokens of `items` (key, tokens) each worker holds; workers holding none are
        absent."""
        items = list(items)
        held = {}
        for worker_id, entries in self._held.items():
            tokens = sum(count for key, count in items if key in entries)
            if tokens:
                held[worker_id] = tokens
        return held

    def held_keys(self, worker_id: str, keys: Iterable[EncoderKey]) -> set[EncoderKey]:
        """Those of `keys` the worker holds."""
        entries = self._held.get(worker_id, {})
        return {key for key in keys if key in entries}

    def workers(self) -> list[str]:
        return list(self._held)

    def num_entries(self, worker_id: str) -> int:
        return len(self._held.get(worker_id, {}))


class EncoderEventSubscriber(CacheEventSubscriber[EncoderEventData]):
    """A router's side: applies the encoders' embedding-cache events to an index, in order."""

    def __init__(
        self, runtime: Runtime, index: EncoderIndex, component: str, *, dump_retry_s: float = 1.0
    ) -> None:
        super().__init__(runtime, index, encoder_topics(component), dump_retry_s=dump_retry_s)
