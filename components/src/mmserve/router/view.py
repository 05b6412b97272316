"""The routing view of a prompt: the token ids an engine's prefix cache keys on.

Each media item's tokens become its pad values (see `pad.py`), so two prompts share a cached
prefix exactly when their text and their media contents agree. Each block also lists the
mm_hashes of the items it overlaps (`block_mm_infos`, built as Dynamo's frontend builds it), so
the full 64-bit hash enters the block hash even where the pad value keeps only 30 bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mmserve.router.hashing import (
    DEFAULT_BLOCK_SIZE,
    MediaSpan,
    compute_block_hashes_with_spans,
    tokens_as_u32,
)
from mmserve.router.pad import PadScheme, routing_pad_run


@dataclass(frozen=True, slots=True)
class RoutingMedia:
    """One media item of a prompt, as the router sees it.

    `offset` is the index of the item's first token in ids that are already expanded (the
    placeholder run is `token_count` long); None when the ids hold a single placeholder token
    for the item.
    """

    mm_hash: int
    token_count: int
    offset: int | None = None


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
    media: Sequence[RoutingMedia],
    *,
    placeholder_id: int | None = None,
    scheme: PadScheme = PadScheme.DYNAMO,
) -> RoutingView:
    """Build the routing view of a prompt.

    Either every item has an `offset` into already expanded ids, whose runs are overwritten in
    place, or none has, and each `placeholder_id` token in `token_ids` (one per item, in order)
    expands to `token_count` pad values. Items with no tokens are left out of the spans.
    """
    source = np.asarray(token_ids, dtype=np.int64)
    if source.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {source.shape}")
    if any(item.token_count < 0 for item in media):
        raise ValueError("media token counts must not be negative")
    with_offsets = [item.offset is not None for item in media]
    if all(with_offsets):
        ids, starts = _overwrite_expanded(source, media, scheme)
    elif not any(with_offsets):
        if placeholder_id is None:
            raise ValueError("media without offsets need the placeholder token id")
        ids, starts = _expand_placeholders(source, media, placeholder_id, scheme)
    else:
        raise ValueError("either every media item has an offset or none has")
    spans = tuple(
        (item.mm_hash, start, start + item.token_count)
        for item, start in zip(media, starts, strict=True)
        if item.token_count > 0
    )
    return RoutingView(ids, spans)


def _overwrite_expanded(
    source: np.ndarray, media: Sequence[RoutingMedia], scheme: PadScheme
) -> tuple[np.ndarray, list[int]]:
    ids = tokens_as_u32(source).copy()
    starts = []
    for item in media:
        start = item.offset or 0
        end = start + item.token_count
        if start < 0 or end > len(ids):
            raise ValueError(f"media span [{start}, {end}) does not fit in {len(ids)} token ids")
        ids[start:end] = routing_pad_run(item.mm_hash, item.token_count, scheme)
        starts.append(start)
    return ids, starts


def _expand_placeholders(
    source: np.ndarray, media: Sequence[RoutingMedia], placeholder_id: int, scheme: PadScheme
) -> tuple[np.ndarray, list[int]]:
    positions = np.flatnonzero(source == placeholder_id)
    if len(positions) != len(media):
        raise ValueError(
            f"{len(positions)} placeholder tokens ({placeholder_id}) for {len(media)} media items"
        )
    text = tokens_as_u32(source)
    pieces = []
    starts = []
    previous = 0
    expanded_length = 0
    for position, item in zip(positions.tolist(), media, strict=True):
        pieces.append(text[previous:position])
        expanded_length += position - previous
        pieces.append(routing_pad_run(item.mm_hash, item.token_count, scheme))
        starts.append(expanded_length)
        expanded_length += item.token_count
        previous = position + 1
    pieces.append(text[previous:])
    return np.concatenate(pieces), starts
