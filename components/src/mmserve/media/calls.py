"""Async calls into the Rust media core.

Each call runs in a worker thread: the core releases the GIL while it fetches, decodes and
preprocesses, so the event loop keeps serving other requests. Refusals and failures surface as
`mmserve._mm.MediaError(code, message)`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmserve import _mm
from mmserve.media.policy import MediaPolicy


def load_spec(model_dir: str | Path) -> _mm.Spec:
    """The core's preprocessing spec of a checkpoint, from its `preprocessor_config.json` and
    `config.json`."""
    model_dir = Path(model_dir)
    return _mm.spec_from_hf_configs(
        (model_dir / "preprocessor_config.json").read_text(),
        (model_dir / "config.json").read_text(),
    )


@dataclass(frozen=True)
class ProcessedItem:
    mm_hash: int  # blake3 of the raw encoded bytes, truncated to u64
    token_count: int  # tokens the item's placeholder expands to
    grid_thw: tuple[int, int, int]
    pixel_values: np.ndarray | None  # only when preprocessed in full


@dataclass(frozen=True)
class ProcessedRequest:
    input_ids: list[int]  # each placeholder expanded to its item's token count
    items: list[ProcessedItem]


_REFERENCE_PREFIXES = ("http://", "https://", "file://", "/")


def is_inline(source: str) -> bool:
    """Whether the source carries the media itself (a `data:` URL or bare base64) rather than
    pointing at it (http(s), `file://`, an absolute path), as the core classifies sources."""
    return not source.lower().startswith(_REFERENCE_PREFIXES)


async def fetch(source: str, policy: MediaPolicy) -> bytes:
    """The encoded bytes of one media item (URL, `data:` URL, base64 or allowed local path)."""
    return await asyncio.to_thread(_mm.fetch_bytes, source, **_fetch_options(policy))


async def process(
    spec: _mm.Spec,
    input_ids: list[int],
    sources: list[str | bytes],
    policy: MediaPolicy,
    *,
    count_only: bool,
) -> ProcessedRequest:
    """Fetches and describes every item of a request: `sources` are references (URL, `data:`
    URL, base64, local path) or bytes already fetched. `input_ids` holds one placeholder per
    item. With `count_only` the core fetches and hashes each item and plans its grid from the
    size its headers give (EXIF orientation applied), without decoding it: a corrupt body is
    found by whoever decodes the item."""
    output = await asyncio.to_thread(
        _mm.process, spec, input_ids, sources, count_only=count_only, **_fetch_options(policy)
    )
    return ProcessedRequest(
        input_ids=output.input_ids.tolist(),
        items=[_item(item) for item in output.items],
    )


def _item(item: Any) -> ProcessedItem:
    return ProcessedItem(
        mm_hash=int(item.hash),
        token_count=int(item.num_tokens),
        grid_thw=tuple(item.image_grid_thw.reshape(3).tolist()),
        pixel_values=item.pixel_values,
    )


def _fetch_options(policy: MediaPolicy) -> dict[str, Any]:
    return {
        "allowed_domains": sorted(policy.allowed_domains),
        "allowed_local_roots": [str(root) for root in policy.allowed_local_roots],
        "timeout_s": policy.fetch_timeout_s,
    }
