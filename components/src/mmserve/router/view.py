"""The routing view of a prompt: the token ids an engine's prefix cache keys on.

Each media item's tokens become its pad values (see `pad.py`), so two prompts share a cached
prefix exactly when their text and their media contents agree. Each block also lists the
mm_hashes of the items it overlaps (`block_mm_infos`, built as Dynamo's frontend builds it), so
the full 64-bit hash enters the block hash even where the pad value keeps only 30 bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from mmserve.router.hashing import DEFAULT_BLOCK_SIZE, compute_block_hashes
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


class RoutingView(NamedTuple):
    ids: np.ndarray
    """u32 token ids, media runs replaced by their routing pad values."""
    block_mm_infos: list[tuple[int, ...]]
    """Per block (the partial tail included): mm_hashes of the items overlapping it."""


def routing_view(
    token_ids: Sequence[int] | np.ndarray,
    media: Sequence[RoutingMedia],
    *,
    placeholder_id: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    scheme: PadScheme = PadScheme.DYNAMO,
) -> RoutingView:
    """Build the routing view of a prompt.

    Either every item has an `offset` into already expanded ids, whose runs are overwritten in
    place, or none has, and each `placeholder_id` token in `token_ids` (one per item, in order)
    expands to `token_count` pad values.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    source = np.asarray(token_ids, dtype=np.int64)
    if source.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {source.shape}")
    with_offsets = [item.offset is not None for item in media]
    if all(with_offsets):
        ids, spans = _overwrite_expanded(source, media, scheme)
    elif not any(with_offsets):
        if placeholder_id is None:
            raise ValueError("media without offsets need the placeholder token id")
        ids, spans = _expand_placeholders(source, media, placeholder_id, scheme)
    else:
        raise ValueError("either every media item has an offset or none has")
    return RoutingView(ids, _block_mm_infos(len(ids), block_size, media, spans))


def routing_block_hashes(
    view: RoutingView, block_size: int = DEFAULT_BLOCK_SIZE, lora_name: str | None = None
) -> list[int]:
    """Local block hashes of a routing view (built with the same `block_size`)."""
    return compute_block_hashes(view.ids, block_size, view.block_mm_infos, lora_name)


def _overwrite_expanded(
    source: np.ndarray, media: Sequence[RoutingMedia], scheme: PadScheme
) -> tuple[np.ndarray, list[tuple[int, int]]]:
    _check_u32(source)
    ids = source.astype(np.uint32)
    spans = []
    for item in media:
        start = item.offset if item.offset is not None else 0
        end = start + item.token_count
        if item.token_count < 0 or start < 0 or end > len(ids):
            raise ValueError(f"media span [{start}, {end}) does not fit in {len(ids)} token ids")
        ids[start:end] = routing_pad_run(item.mm_hash, item.token_count, scheme)
        spans.append((start, end))
    return ids, spans


def _expand_placeholders(
    source: np.ndarray, media: Sequence[RoutingMedia], placeholder_id: int, scheme: PadScheme
) -> tuple[np.ndarray, list[tuple[int, int]]]:
    positions = np.flatnonzero(source == placeholder_id)
    if len(positions) != len(media):
        raise ValueError(
            f"{len(positions)} placeholder tokens ({placeholder_id}) for {len(media)} media items"
        )
    _check_u32(source)
    pieces = []
    spans = []
    previous = 0
    expanded_length = 0
    for position, item in zip(positions.tolist(), media, strict=True):
        if item.token_count < 0:
            raise ValueError(f"negative token count {item.token_count}")
        text = source[previous:position]
        pieces.append(text)
        expanded_length += len(text)
        pieces.append(routing_pad_run(item.mm_hash, item.token_count, scheme))
        spans.append((expanded_length, expanded_length + item.token_count))
        expanded_length += item.token_count
        previous = position + 1
    pieces.append(source[previous:])
    ids = np.concatenate([piece.astype(np.uint32, copy=False) for piece in pieces])
    return ids, spans


def _check_u32(ids: np.ndarray) -> None:
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) > 0xFFFF_FFFF):
        raise ValueError("token ids must lie in [0, 2**32)")


def _block_mm_infos(
    num_tokens: int,
    block_size: int,
    media: Sequence[RoutingMedia],
    spans: Sequence[tuple[int, int]],
) -> list[tuple[int, ...]]:
    num_blocks = -(-num_tokens // block_size)
    attached: list[list[int]] = [[] for _ in range(num_blocks)]
    for item, (start, end) in zip(media, spans, strict=True):
        if end <= start:
            continue
        for block in range(start // block_size, (end - 1) // block_size + 1):
            attached[block].append(item.mm_hash)
    return [tuple(hashes) for hashes in attached]
