"""KV events: the changes of a worker's prefix cache, as the router indexes them; and the call
that asks a worker to clear its caches."""

from __future__ import annotations

import msgspec

from mmserve.protocol.wire import WireMessage


class KvBlock(msgspec.Struct, frozen=True, kw_only=True):
    block_hash: int  # chained sequence hash (u64)
    tokens_hash: int  # local hash of the block's tokens (u64)


class KvStored(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="stored"):
    parent_hash: int | None
    blocks: list[KvBlock]


class KvRemoved(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="removed"):
    block_hashes: list[int]


class KvCleared(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="cleared"):
    pass


class KvEvent(WireMessage, frozen=True):
    """One change of a worker's prefix cache; `event_id` increases by one per worker."""

    worker_id: str
    event_id: int
    data: KvStored | KvRemoved | KvCleared


class KvDumpRequest(WireMessage, frozen=True):
    """A router asks `worker_id` to publish its whole cache as KV events (it lost track)."""

    worker_id: str


class ResetCachesRequest(WireMessage, frozen=True):
    """The frontend asks one instance to clear its prefix cache and its encoder cache
    (`POST /reset_prefix_cache`); it answers `CachesCleared` once they are empty."""


class CachesCleared(WireMessage, frozen=True):
    """An instance's caches are empty: what it dropped (0 where its engine cannot count)."""

    prefix_blocks: int = 0
    encoder_items: int = 0
