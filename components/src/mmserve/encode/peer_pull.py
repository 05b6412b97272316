"""Peer pull: an encoder reads an embedding another encoder's cache holds instead of running the
vision tower. The router names the holder per item (`PreprocessedRequest.peers`); the holder
offers its cached tensors by transfer (`encode.pull_embeddings`, leased like every transfer)
and the puller fetches them. Any failure (holder gone, entry evicted meanwhile, transfer error,
timeout) leaves the item to be encoded here.

A pull is taken when it is cheaper than encoding:

    PULL_FIXED_S + tokens * row_bytes / PULL_BYTES_PER_S  <  tokens * seconds_per_token

with the engine's vision cost (`Engine.vision_cost`; an engine that does not know it always
pulls). The constants are measured (docs/routing.md, "Peer pull").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mmserve.encode.embeddings import load_embeddings
from mmserve.engines.base import ItemEmbedding, VisionCost
from mmserve.observability import metrics
from mmserve.protocol import (
    EmbeddingPullReply,
    EmbeddingPullRequest,
    EncoderItem,
    MediaPayload,
    PlannedMedia,
)
from mmserve.topology import PULL_EMBEDDINGS, Role
from mmserve.transfer import TransferAgent

if TYPE_CHECKING:  # the worker passes its runtime in: importing the stage loads no NATS
    from mmserve.runtime import Runtime

log = logging.getLogger("mmserve.encode")

PULL_FIXED_S = 0.013  # one pull: request, lookup, offer and fetch, whatever its size
PULL_BYTES_PER_S = 1.3 * 2**30  # NIXL end-to-end read of 2.8 MiB (docs/transfer.md)
PULL_TIMEOUT_S = 2.0  # the holder's answer and the fetch; past it the item is encoded here


def worth_pulling(tokens: int, cost: VisionCost | None) -> bool:
    if cost is None:
        return True
    pull_s = PULL_FIXED_S + tokens * cost.row_bytes / PULL_BYTES_PER_S
    return pull_s < tokens * cost.seconds_per_token


class PeerPuller:
    """Pulls cached embeddings from the encode workers that hold them, counting each pull in
    `mmserve_encoder_peer_pulls_total` under this worker's instance id."""

    def __init__(
        self, runtime: Runtime, transfer: TransferAgent, *, timeout_s: float = PULL_TIMEOUT_S
    ) -> None:
        self.runtime = runtime
        self.transfer = transfer
        self.timeout_s = timeout_s
        self._client = runtime.client(Role.ENCODE.value, PULL_EMBEDDINGS)

    async def pull(
        self, request_id: str, holders: dict[int, str], planned: Sequence[PlannedMedia]
    ) -> dict[int, ItemEmbedding]:
        """The embeddings pulled for the items at `holders`' indices into `planned`, by index;
        an item whose pull failed is absent."""
        by_holder: dict[str, list[int]] = {}
        for index, holder in holders.items():
            by_holder.setdefault(holder, []).append(index)
        pulled = await asyncio.gather(
            *(
                self._pull_from(request_id, holder, indices, planned)
                for holder, indices in by_holder.items()
            )
        )
        found = {index: item for part in pulled for index, item in part.items()}
        counter = metrics.PEER_PULLS
        counter.labels(Role.ENCODE.value, self.runtime.instance_id, "ok").inc(len(found))
        failed = len(holders) - len(found)
        counter.labels(Role.ENCODE.value, self.runtime.instance_id, "failed").inc(failed)
        return found

    async def _pull_from(
        self, request_id: str, holder: str, indices: list[int], planned: Sequence[PlannedMedia]
    ) -> dict[int, ItemEmbedding]:
        items = [planned[i] for i in indices]
        try:
            with metrics.timed_stage(Role.ENCODE.value, "peer_pull"):
                loaded = await asyncio.wait_for(
                    self._fetch(request_id, holder, items), self.timeout_s
                )
        except Exception as error:
            log.info("request %s: pull from encode %s failed: %r", request_id, holder, error)
            return {}
        return {
            index: embedding
            for index, item, embedding in zip(indices, items, loaded, strict=True)
            if embedding is not None and embedding.num_tokens == item.length
        }

    async def _fetch(
        self, request_id: str, holder: str, items: list[PlannedMedia]
    ) -> list[ItemEmbedding | None]:
        message = EmbeddingPullRequest(
            request_id=request_id,
            items=[EncoderItem(mm_hash=i.mm_hash, grid_thw=i.grid_thw) for i in items],
        )
        reply: EmbeddingPullReply = await self._client.call(
            message,
            EmbeddingPullReply,
            instance_id=holder,
            request_id=request_id,
            timeout=self.timeout_s,
        )
        handles = reply.embeddings
        if len(handles) != len(items):
            raise ValueError(f"{len(handles)} embeddings for {len(items)} items")
        held = {i: handle for i, handle in enumerate(handles) if handle is not None}
        loaded = await load_embeddings(
            self.transfer,
            [items[i] for i in held],
            [MediaPayload.precomputed(handle) for handle in held.values()],
        )
        by_index = dict(zip(held, loaded, strict=True))
        return [by_index.get(i) for i in range(len(items))]
