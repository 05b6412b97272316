"""The encode stage: preprocess each media item in the Rust core, run the vision tower.

Used by the encode worker and by a worker or prefill worker started with `--encode`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mmserve import media
from mmserve.engines.base import Engine, ItemEmbedding, MediaInput
from mmserve.media import MediaPolicy
from mmserve.observability import metrics, nvtx
from mmserve.protocol import MediaItem, PreprocessedRequest
from mmserve.transfer import TransferAgent


def expand_placeholders(token_ids: list[int], placeholder_id: int, counts: list[int]) -> list[int]:
    """Each `placeholder_id` token (one per item, in order) repeated its item's token count."""
    expanded: list[int] = []
    items = iter(counts)
    for token in token_ids:
        if token == placeholder_id:
            count = next(items, None)
            if count is None:
                raise ValueError("the prompt holds more image placeholders than media items")
            expanded.extend([placeholder_id] * count)
        else:
            expanded.append(token)
    if next(items, None) is not None:
        raise ValueError("the prompt holds fewer image placeholders than media items")
    return expanded


@dataclass
class Encoded:
    """A request after encode: expanded prompt ids, one embedding per media item (in prompt
    order), and the media items with their token counts and grids filled in."""

    token_ids: list[int]
    embeddings: list[ItemEmbedding] = field(default_factory=list)
    media: list[MediaItem] = field(default_factory=list)


class EncodeStage:
    def __init__(
        self,
        engine: Engine,
        transfer: TransferAgent,
        model_path: Path,
        policy: MediaPolicy,
        component: str,
    ) -> None:
        self.engine = engine
        self.transfer = transfer
        self.spec = media.load_spec(model_path)
        self.policy = policy
        self.component = component

    async def run(self, request: PreprocessedRequest) -> Encoded:
        if not request.media:
            return Encoded(token_ids=list(request.token_ids))
        if all(item.pixel_values is not None for item in request.media):
            # Frontend decoding: the frontend preprocessed the items and sent pixel_values.
            with metrics.timed_stage(self.component, "transfer"):
                inputs = await self._inputs_from_pixels(request)
            token_ids = list(request.token_ids)
            if not request.expanded:
                counts = [item.token_count for item in request.media]
                token_ids = expand_placeholders(token_ids, self.spec.image_token_id, counts)
        else:
            token_ids, inputs = await self._preprocess(request)
        with nvtx.nvtx_range(nvtx.ENC_VISION_ENCODE), metrics.timed_stage(self.component, "encode"):
            embeddings = await self.engine.encode(inputs)
        items = [
            MediaItem(
                url=item.url,
                mm_hash=emb.mm_hash,
                token_count=emb.num_tokens,
                image_grid_thw=emb.grid_thw,
            )
            for item, emb in zip(request.media, embeddings, strict=True)
        ]
        return Encoded(token_ids=token_ids, embeddings=embeddings, media=items)

    async def _preprocess(self, request: PreprocessedRequest) -> tuple[list[int], list[MediaInput]]:
        sources: list[str | bytes] = []
        for index, item in enumerate(request.media):
            if item.encoded is not None:
                with metrics.timed_stage(self.component, "transfer"):
                    encoded = await self.transfer.fetch(item.encoded)
                sources.append(encoded.numpy().tobytes())
            elif item.data is not None or item.url is not None:
                sources.append(item.data if item.data is not None else item.url)  # type: ignore[arg-type]
            else:
                raise ValueError(f"media item {index} has neither a URL nor data")
        with metrics.timed_stage(self.component, "preprocess"):
            processed = await media.process(
                self.spec, list(request.token_ids), sources, self.policy, count_only=False
            )
        inputs = [
            MediaInput(
                mm_hash=item.mm_hash,
                pixel_values=torch.from_numpy(item.pixel_values),
                grid_thw=item.grid_thw,
            )
            for item in processed.items
            if item.pixel_values is not None
        ]
        return processed.input_ids, inputs

    async def _inputs_from_pixels(self, request: PreprocessedRequest) -> list[MediaInput]:
        async def load(index: int, item: MediaItem) -> MediaInput:
            assert item.pixel_values is not None
            if item.image_grid_thw is None:
                raise ValueError(f"media item {index} has pixel_values but no image_grid_thw")
            pixels = await self.transfer.fetch(item.pixel_values)
            return MediaInput(
                mm_hash=item.mm_hash, pixel_values=pixels, grid_thw=item.image_grid_thw
            )

        return list(await asyncio.gather(*(load(i, item) for i, item in enumerate(request.media))))
