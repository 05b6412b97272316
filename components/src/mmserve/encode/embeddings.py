"""Media embeddings (images and videos) on the wire: offered by whoever ran the vision tower, loaded
by the stage that runs the prompt. The tensors travel by transfer; only their handles ride in
messages."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from mmserve.engines.base import EngineError, ItemEmbedding
from mmserve.observability import nvtx
from mmserve.protocol import DEEPSTACK, EmbeddingsHandle, MediaPayload, PlannedMedia
from mmserve.transfer import Lease, TransferAgent


async def offer_embeddings(
    transfer: TransferAgent, embeddings: Sequence[ItemEmbedding]
) -> tuple[list[EmbeddingsHandle], list[Lease]]:
    """Handles for each item's embeddings (and deepstack features), and the leases that keep
    their buffers until the consumer has read them."""
    handles: list[EmbeddingsHandle] = []
    leases: list[Lease] = []
    with nvtx.nvtx_range(nvtx.ENC_EMBEDDING_TRANSFER):
        for item in embeddings:
            handle, lease = await transfer.offer(item.embeddings)
            leases.append(lease)
            aux = {}
            if item.deepstack:
                aux_handle, aux_lease = await transfer.offer(torch.stack(item.deepstack))
                aux[DEEPSTACK] = aux_handle
                leases.append(aux_lease)
            handles.append(EmbeddingsHandle(embeddings=handle, aux=aux))
    return handles, leases


async def load_embeddings(
    transfer: TransferAgent,
    planned: Sequence[PlannedMedia],
    payloads: Sequence[MediaPayload],
    *,
    device: str = "cpu",
) -> list[ItemEmbedding]:
    """Fetch the embeddings an upstream encoder attached to each planned item."""
    missing = [i for i, payload in enumerate(payloads) if payload.embeddings is None]
    if missing or len(payloads) != len(planned):
        raise EngineError(f"media items {missing} carry no embeddings: nothing encoded them")

    async def load(item: PlannedMedia, handle: EmbeddingsHandle) -> ItemEmbedding:
        embeddings = await transfer.fetch(handle.embeddings, device=device)
        deepstack: tuple[torch.Tensor, ...] = ()
        if DEEPSTACK in handle.aux:
            stacked = await transfer.fetch(handle.aux[DEEPSTACK], device=device)
            deepstack = tuple(stacked.unbind(0))
        return ItemEmbedding(
            mm_hash=item.mm_hash,
            grid_thw=item.grid_thw,
            embeddings=embeddings,
            deepstack=deepstack,
        )

    handles = [payload.embeddings for payload in payloads if payload.embeddings is not None]
    with nvtx.nvtx_range(nvtx.NIXL_BEGIN_READ):
        return list(
            await asyncio.gather(*(load(i, h) for i, h in zip(planned, handles, strict=True)))
        )
