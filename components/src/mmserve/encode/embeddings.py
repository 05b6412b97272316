"""Image embeddings on the wire: offered by whoever ran the vision tower, loaded by the stage
that runs the prompt. The tensors travel by transfer; only their handles ride in messages."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from mmserve.engines.base import ItemEmbedding
from mmserve.observability import nvtx
from mmserve.protocol import EmbeddingsHandle, MediaItem
from mmserve.transfer import Lease, TransferAgent

DEEPSTACK = "deepstack"


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
    transfer: TransferAgent, media: Sequence[MediaItem], *, device: str = "cpu"
) -> list[ItemEmbedding]:
    """Fetch the embeddings an upstream encoder attached to each item."""
    missing = [i for i, item in enumerate(media) if item.embeddings is None]
    if missing:
        raise ValueError(f"media items {missing} carry no embeddings: nothing encoded them")

    async def load(item: MediaItem) -> ItemEmbedding:
        assert item.embeddings is not None and item.image_grid_thw is not None
        embeddings = await transfer.fetch(item.embeddings.embeddings, device=device)
        deepstack: tuple[torch.Tensor, ...] = ()
        if DEEPSTACK in item.embeddings.aux:
            stacked = await transfer.fetch(item.embeddings.aux[DEEPSTACK], device=device)
            deepstack = tuple(stacked.unbind(0))
        return ItemEmbedding(
            mm_hash=item.mm_hash,
            grid_thw=item.image_grid_thw,
            embeddings=embeddings,
            deepstack=deepstack,
        )

    with nvtx.nvtx_range(nvtx.NIXL_BEGIN_READ):
        return list(await asyncio.gather(*(load(item) for item in media)))
