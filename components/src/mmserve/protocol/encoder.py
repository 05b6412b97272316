"""Embedding-cache events: the changes of an encoder's cache of vision-tower outputs, as the
router indexes them to send each image to the encoder that already holds it; and the peer pull,
by which an encoder reads an embedding another encoder's cache holds."""

from __future__ import annotations

import msgspec

from mmserve.protocol.pipeline import EmbeddingsHandle, PreprocessedRequest
from mmserve.protocol.wire import WireMessage


class EncoderEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One cached embedding. `mm_hash` is the item's identity (the content hash folded with the
    pixel bounds it was processed under, `PlannedMedia.mm_hash`); with `grid_thw` it is the
    encoder cache's key. `num_tokens` is its row count: the vision-tower work a hit saves."""

    mm_hash: int
    grid_thw: tuple[int, int, int]
    num_tokens: int


class EncoderStored(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="stored"):
    entries: list[EncoderEntry]


class EncoderEvicted(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="evicted"):
    entries: list[EncoderEntry]


class EncoderCleared(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="cleared"):
    pass


class EncoderEvent(WireMessage, frozen=True):
    """One change of a worker's encoder cache; `event_id` increases by one per worker."""

    worker_id: str
    event_id: int
    data: EncoderStored | EncoderEvicted | EncoderCleared


class EncoderDumpRequest(WireMessage, frozen=True):
    """A router asks `worker_id` to publish its whole encoder cache as events (it lost track)."""

    worker_id: str


class EncoderItem(msgspec.Struct, frozen=True, kw_only=True):
    """An encoder-cache key: the item's identity and grid."""

    mm_hash: int
    grid_thw: tuple[int, int, int]


class EmbeddingPullRequest(WireMessage, frozen=True):
    """An encoder asks a peer (`encode.pull_embeddings`) for the embeddings its cache holds."""

    request_id: str
    items: list[EncoderItem]


class EncodeItemsRequest(WireMessage, frozen=True):
    """A language worker asks an encode worker (`encode.encode_items`) to encode the items of
    `request` it skipped for its prefix cache, which no longer holds them (those items in state
    `ENCODE` or `REUSE`, `PreprocessedRequest.encoding_skipped`); the reply has one entry per
    planned item."""

    request: PreprocessedRequest


class EmbeddingPullReply(WireMessage, frozen=True):
    """One entry per requested item: the offered embeddings (leased like every transfer), or
    None where the cache no longer holds it (or, for `EncodeItemsRequest`, where nothing was
    encoded)."""

    embeddings: list[EmbeddingsHandle | None]
