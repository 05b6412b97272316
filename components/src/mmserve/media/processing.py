"""Per-item processing options (vLLM's `mm_processor_kwargs`): the pixel bounds an image is
resized under. They travel in the plan (`PlannedMedia.pixel_bounds`) so whoever preprocesses
the item uses the same bounds, and they enter the item's identity so differently processed
copies of one image never share an encoder cache entry, a routing prefix or cached KV."""

from __future__ import annotations

import functools
import json
import struct

from mmserve import _mm

PixelBounds = tuple[int, int]
"""`(min_pixels, max_pixels)` of the resized image."""


@functools.lru_cache(maxsize=64)
def spec_with_bounds(spec: _mm.Spec, bounds: PixelBounds | None) -> _mm.Spec:
    """`spec` preprocessing under other pixel bounds (`spec` itself for None)."""
    if bounds is None:
        return spec
    fields = json.loads(spec.to_json())
    fields["min_pixels"], fields["max_pixels"] = bounds
    return _mm.Spec.from_json(json.dumps(fields))


def item_identity(content_hash: int, bounds: PixelBounds | None) -> int:
    """The identity (mm_hash) of an item: its content hash, folded with the pixel bounds it
    is processed under when those are not the model's own."""
    if bounds is None:
        return content_hash
    return _mm.content_hash(struct.pack("<8sQQQ", b"pixbnds1", content_hash, *bounds))
