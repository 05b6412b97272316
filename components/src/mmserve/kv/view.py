"""The routing view of a request plan: the token ids an engine's prefix cache keys on.

Each media item's tokens become its pad values (see `pad.py`), so two prompts share a cached
prefix exactly when their text and their media contents agree. Each block also lists the
mm_hashes of the items it overlaps (`block_mm_infos`, built as Dynamo's frontend builds it), so
the full 64-bit hash enters the block hash even where the pad value keeps only 30 bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mmserve.kv.hashing import (
    DEFAULT_BLOCK_SIZE,
    MediaSpan,
    compute_block_hashes_with_spans,
    compute_seq_hashes,
    tokens_as_u32,
)
from mmserve.kv.pad import PadScheme, routing_pad_run
from mmserve.protocol import PlannedMedia


@dataclass(frozen=True, slots=True)
class RoutingView:
    ids: np.ndarray
    """uint32 token ids, media runs replaced by their routing pad values."""
    media_spans: tuple[MediaSpan, ...]
    """`(mm_hash, start, end)` of each media item in `ids`, in prompt order."""

    def block_mm_infos(self, block_size: int = DEFAULT_BLOCK_SIZE) -> list[tuple[int, ...]]:
        """Per block (a partial tail included): the mm_hashes of the items overlapping it, the
        `block_mm_infos` of Dynamo's frontend."""
        attached: list[list[int]] = [[] for _ in range(-(-len(self.ids) // block_size))]
        for mm_hash, start, end in self.media_spans:
            for block in range(start // block_size, (end - 1) // block_size + 1):
                attached[block].append(mm_hash)
        return [tuple(hashes) for hashes in attached]

    def block_hashes(
        self, block_size: int = DEFAULT_BLOCK_SIZE, lora_name: str | None = None
    ) -> list[int]:
        """Local hashes of the view's complete blocks."""
        return compute_block_hashes_with_spans(self.ids, block_size, self.media_spans, lora_name)


def routing_view(
    token_ids: Sequence[int] | np.ndarray,
    media: Sequence[PlannedMedia] = (),
    *,
    scheme: PadScheme = PadScheme.DYNAMO,
) -> RoutingView:
    """The routing view of a planned prompt: `token_ids` as the plan expanded them, each item's
    run (`offset`, `length`) overwritten with its pad values. Items with no tokens are left out
    of the spans."""
    # A plan's ids are a list, which `tokens_as_u32` packs without numpy's type discovery.
    ids = tokens_as_u32(token_ids).copy()
    if ids.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {ids.shape}")
    for item in media:
        if item.offset < 0 or item.length < 0 or item.end > len(ids):
            raise ValueError(
                f"media span [{item.offset}, {item.end}) does not fit in {len(ids)} token ids"
            )
        ids[item.offset : item.end] = routing_pad_run(item.mm_hash, item.length, scheme)
    spans = tuple((item.mm_hash, item.offset, item.end) for item in media if item.length > 0)
    return RoutingView(ids, spans)


@dataclass(frozen=True)
class BlockKeys:
    """Hashes of a prompt's complete blocks: local (per block) and chained (the cache keys)."""

    local_hashes: tuple[int, ...]
    seq_hashes: tuple[int, ...]


def prompt_block_keys(
    token_ids: Sequence[int],
    media: Sequence[PlannedMedia] = (),
    block_size: int = DEFAULT_BLOCK_SIZE,
    scheme: PadScheme = PadScheme.DYNAMO,
) -> BlockKeys:
    """Block keys of a planned prompt, as an engine's prefix cache stores them."""
    local = routing_view(token_ids, media, scheme=scheme).block_hashes(block_size)
    return BlockKeys(tuple(local), tuple(compute_seq_hashes(local)))


def reusable_blocks(num_tokens: int, block_size: int) -> int:
    """The most leading blocks of a prompt of `num_tokens` a prefix cache serves: at least one
    token runs, to give the first token's logits."""
    return max(0, (num_tokens - 1) // block_size)


def items_in_cached_prefix(
    plan_tokens: int, media: Sequence[PlannedMedia], cached_blocks: int, block_size: int
) -> list[int]:
    """The media items every token of which lies in the first `cached_blocks` blocks a prefix
    cache holds (as far as it serves them, `reusable_blocks`): their embeddings go unread."""
    cached = min(cached_blocks, reusable_blocks(plan_tokens, block_size)) * block_size
    return [index for index, item in enumerate(media) if item.length > 0 and item.end <= cached]
