"""Per-item processing options (vLLM's `mm_processor_kwargs`): the pixel bounds an image is
resized under, and Gemma 3's pan-and-scan knobs. They travel in the plan
(`PlannedMedia.pixel_bounds`, `PlannedMedia.pan_and_scan`) so whoever preprocesses the item
uses the same options, and they enter the item's identity (a crop's, for pan-and-scan) so
differently processed copies of one image never share an encoder cache entry, a routing
prefix or cached KV."""

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


PanAndScanKnobs = tuple[int, int, float]
"""Gemma 3's `(pan_and_scan_min_crop_size, pan_and_scan_max_num_crops,
pan_and_scan_min_ratio_to_activate)`."""


@functools.lru_cache(maxsize=64)
def spec_with_pan_and_scan(spec: _mm.Spec, knobs: PanAndScanKnobs | None) -> _mm.Spec:
    """`spec` (a family that can pan and scan) cropping by `knobs`, or not cropping for None;
    `spec` itself where that is its own setting. A crop's identity folds in the knobs
    (`PanAndScan::crop_identity` in the core); the image itself keeps its own."""
    if (knobs is not None) == spec.do_pan_and_scan and knobs in (None, spec.pan_and_scan):
        return spec
    fields = json.loads(spec.to_json())
    fields["do_pan_and_scan"] = knobs is not None
    if knobs is not None:
        min_crop_size, max_num_crops, min_ratio = knobs
        fields["pan_and_scan"] = {
            "min_crop_size": min_crop_size,
            "max_num_crops": max_num_crops,
            "min_ratio_to_activate": min_ratio,
        }
    return _mm.Spec.from_json(json.dumps(fields))


def item_identity(content_hash: int, bounds: PixelBounds | None) -> int:
    """The identity (mm_hash) of an item: its content hash, folded with the pixel bounds it
    is processed under when those are not the model's own."""
    if bounds is None:
        return content_hash
    return _mm.content_hash(struct.pack("<8sQQQ", b"pixbnds1", content_hash, *bounds))
