"""The encode stage: each planned media item's pixels (preprocessed here in the Rust core from
the bytes the frontend fetched, or sent by the frontend with `--frontend-decoding`), then the
vision tower.

The plan already says what each item is and where its tokens go; the stage only checks that
what it decoded agrees with it. Items whose payload already carries embeddings (precomputed
by the client) are not encoded. Used by the encode worker and by a worker or prefill worker
started with `--encode`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from mmserve import media
from mmserve.encode.peer_pull import PeerPuller, worth_pulling
from mmserve.engines.base import Engine, EngineError, ItemEmbedding, MediaInput
from mmserve.media.processing import item_identity
from mmserve.models.family import resolve_model_spec
from mmserve.observability import metrics, nvtx
from mmserve.protocol import MediaPayload, PlannedMedia, PreprocessedRequest
from mmserve.transfer import TransferAgent


class EncodeStage:
    def __init__(
        self,
        engine: Engine,
        transfer: TransferAgent,
        model_path: Path,
        component: str,
        puller: PeerPuller | None = None,
    ) -> None:
        self.engine = engine
        self.transfer = transfer
        self.spec = resolve_model_spec(model_path).core
        self.component = component
        self.puller = puller

    async def run(self, request: PreprocessedRequest) -> dict[int, ItemEmbedding]:
        """An embedding for each planned item whose payload carries none yet, by item index:
        pulled from the peer encoder the router named for it (`request.peers`) when that is
        cheaper, else encoded here; read from the encoder cache for an item named by its media
        id (left out when the cache no longer holds it). Items the language worker's prefix
        cache holds (`request.skip_encode`) are left out."""
        if len(request.payloads) != len(request.plan.media):
            raise EngineError(
                f"{len(request.payloads)} media payloads for {len(request.plan.media)} planned "
                "items"
            )
        reused = await self._reused(request)
        todo = [
            i
            for i, payload in enumerate(request.payloads)
            if payload.embeddings is None and not payload.reuse and i not in request.skip_encode
        ]
        pulled = await self._pulled(request, todo)
        todo = [i for i in todo if i not in pulled]
        reused |= pulled
        if not todo:
            return reused
        planned = [request.plan.media[i] for i in todo]
        payloads = [request.payloads[i] for i in todo]
        if all(payload.pixel_values is not None for payload in payloads):
            with metrics.timed_stage(self.component, "transfer"):
                inputs = await self._inputs_from_pixels(planned, payloads)
        else:
            inputs = await self._preprocess(todo, planned, payloads)
        with nvtx.nvtx_range(nvtx.ENC_VISION_ENCODE), metrics.timed_stage(self.component, "encode"):
            embeddings = await self.engine.encode(inputs)
        for index, item, embedding in zip(todo, planned, embeddings, strict=True):
            if embedding.num_tokens != item.length:
                raise EngineError(
                    f"media item {index}: the vision tower gave {embedding.num_tokens} rows for "
                    f"the {item.length} tokens the plan holds"
                )
        return reused | dict(zip(todo, embeddings, strict=True))

    async def _pulled(
        self, request: PreprocessedRequest, todo: list[int]
    ) -> dict[int, ItemEmbedding]:
        """The items of `todo` pulled from a peer encoder, kept in this encoder's cache as if
        encoded here (so the routers learn it holds them)."""
        if self.puller is None or not request.peers:
            return {}
        cost = self.engine.vision_cost()
        holders = {
            i: holder
            for i, holder in request.peers.items()
            if i in todo and worth_pulling(request.plan.media[i].length, cost)
        }
        if not holders:
            return {}
        pulled = await self.puller.pull(request.request_id, holders, request.plan.media)
        self.engine.store_embeddings(list(pulled.values()))
        return pulled

    async def _reused(self, request: PreprocessedRequest) -> dict[int, ItemEmbedding]:
        """The embeddings the encoder cache holds for the items named by their media id
        alone; one it no longer holds stays without (the language hop's prefix cache may
        hold its tokens)."""
        indices = [
            i
            for i, payload in enumerate(request.payloads)
            if payload.reuse and i not in request.skip_encode
        ]
        if not indices:
            return {}
        items = [request.plan.media[i] for i in indices]
        cached = await self.engine.cached_embeddings([(i.mm_hash, i.grid_thw) for i in items])
        return {i: e for i, e in zip(indices, cached, strict=True) if e is not None}

    async def _preprocess(
        self, indices: list[int], planned: list[PlannedMedia], payloads: list[MediaPayload]
    ) -> list[MediaInput]:
        """Pixels for the `planned` items (at `indices` in the request) from their bytes."""
        with metrics.timed_stage(self.component, "transfer"):
            data = await asyncio.gather(*(self._encoded_bytes(p) for p in payloads))
        with metrics.timed_stage(self.component, "preprocess"):
            # One batch per pixel bounds (a request's images share them).
            processed: dict[int, media.ItemPixels] = {}
            for bounds in {item.pixel_bounds for item in planned}:
                group = [i for i, item in enumerate(planned) if item.pixel_bounds == bounds]
                done = await media.preprocess_items(self.spec, [data[i] for i in group], bounds)
                processed |= dict(zip(group, done, strict=True))
        inputs = []
        for position, (index, item) in enumerate(zip(indices, planned, strict=True)):
            pixels = processed[position]
            identity = item_identity(pixels.mm_hash, item.pixel_bounds)
            if (identity, pixels.grid_thw) != (item.mm_hash, item.grid_thw):
                # The frontend sized the item from its headers; the decoded image disagrees.
                raise EngineError(
                    f"media item {index} decodes to grid {pixels.grid_thw} (hash "
                    f"{identity:016x}); the plan says {item.grid_thw} ({item.mm_hash_hex})"
                )
            inputs.append(
                MediaInput(
                    mm_hash=item.mm_hash,
                    pixel_values=torch.from_numpy(pixels.pixel_values),
                    grid_thw=item.grid_thw,
                )
            )
        return inputs

    async def _encoded_bytes(self, payload: MediaPayload) -> bytes:
        if payload.data is not None:
            return payload.data
        if payload.encoded is not None:
            encoded = await self.transfer.fetch(payload.encoded)
            return encoded.numpy().tobytes()
        raise EngineError("a media payload carries neither bytes nor pixels")

    async def _inputs_from_pixels(
        self, planned: list[PlannedMedia], payloads: list[MediaPayload]
    ) -> list[MediaInput]:
        async def load(item: PlannedMedia, payload: MediaPayload) -> MediaInput:
            assert payload.pixel_values is not None
            pixels = await self.transfer.fetch(payload.pixel_values)
            return MediaInput(mm_hash=item.mm_hash, pixel_values=pixels, grid_thw=item.grid_thw)

        return list(
            await asyncio.gather(*(load(i, p) for i, p in zip(planned, payloads, strict=True)))
        )
