"""`CachingEngine`: the part of an engine that keeps mmserve's own caches (hf, mock).

Such an engine holds a `PrefixCache` of KV blocks and an `EncoderCache` of embeddings; this
base answers the interface's cache calls from them (events, snapshots, lookups, stores,
statistics and clearing), so the engine itself only fills them. An engine whose caches have one
owner thread (hf: its model thread) runs lookups and clearing there through `_on_cache_owner`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from mmserve.engines.base import Engine, EngineRequest, ItemEmbedding, StateT
from mmserve.engines.encoder_cache import EncoderCache
from mmserve.engines.prefix_cache import PrefixCache
from mmserve.kv.encoder_events import EncoderEventSink
from mmserve.kv.events import KvEventSink
from mmserve.kv.pad import PadScheme
from mmserve.kv.view import items_in_cached_prefix, prompt_block_keys
from mmserve.models.family import ModelSpec
from mmserve.protocol import CachesCleared, EncoderEntry

Payload = TypeVar("Payload")
Result = TypeVar("Result")


class CachingEngine(Engine[StateT], Generic[StateT, Payload]):
    """An engine over its own prefix cache (blocks of `Payload`) and encoder cache."""

    prefix_cache: PrefixCache[Payload]
    encoder_cache: EncoderCache
    spec: ModelSpec
    pad_scheme: PadScheme

    async def _on_cache_owner(self, fn: Callable[[], Result]) -> Result:
        """`fn()` where the caches' owner runs it: by default the caller (the event loop)."""
        return fn()

    def subscribe_kv_events(self, sink: KvEventSink) -> None:
        self.prefix_cache.subscribe(sink)

    def kv_cache_snapshot(self) -> list[tuple[int, int | None, int]]:
        return self.prefix_cache.snapshot()

    def subscribe_encoder_events(self, sink: EncoderEventSink) -> None:
        self.encoder_cache.subscribe(sink)

    def encoder_cache_snapshot(self) -> list[EncoderEntry]:
        return self.encoder_cache.snapshot()

    def encoder_cache_stats(self) -> tuple[int, int]:
        return self.encoder_cache.stats()

    async def cached_embeddings(
        self, items: Sequence[tuple[int, tuple[int, int, int]]]
    ) -> list[ItemEmbedding | None]:
        wanted = list(items)
        return await self._on_cache_owner(
            lambda: [self.encoder_cache.get(mm_hash, grid) for mm_hash, grid in wanted]
        )

    async def media_in_cached_prefix(self, request: EngineRequest) -> list[int]:
        # As a prefill: a hybrid model reuses no block, and a prompt scored reuses none.
        if not self.spec.reuses_prefix_blocks or request.sampling.prompt_logprobs is not None:
            return []
        block_size = self.prefix_cache.block_size
        keys = prompt_block_keys(request.token_ids, request.media, block_size, self.pad_scheme)
        # Read here, not on the cache's owner thread: its lock guards the entries.
        held = self.prefix_cache.held(keys.seq_hashes)
        return items_in_cached_prefix(len(request.token_ids), request.media, held, block_size)

    def store_embeddings(self, items: Sequence[ItemEmbedding]) -> None:
        for item in items:
            self.encoder_cache.put(item)

    async def clear_caches(self) -> CachesCleared:
        """Empty both caches where their owner runs, between two of its calls."""
        return await self._on_cache_owner(self._clear_now)

    def _clear_now(self) -> CachesCleared:
        blocks = self.prefix_cache.num_blocks
        self.prefix_cache.clear()
        return CachesCleared(prefix_blocks=blocks, encoder_items=self.encoder_cache.clear())
