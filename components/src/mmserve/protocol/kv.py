"""KV events: the changes of a worker's prefix cache, as the router indexes them."""

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
