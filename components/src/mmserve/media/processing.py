"""Per-item processing options (vLLM's `mm_processor_kwargs`): the pixel bounds an image is
resized under, and Gemma 3's pan-and-scan knobs. They travel in the plan
(`PlannedMedia.pixel_bounds`, `PlannedMedia.pan_and_scan`) so whoever preprocesses the item
uses the same options. The core's spec takes them (`Spec.with_pixel_bounds`,
`Spec.with_pan_and_scan`) and folds them into each item's identity, so differently processed
copies of one image never share an encoder cache entry, a routing prefix or cached KV."""

from __future__ import annotations

PixelBounds = tuple[int, int]
"""`(min_pixels, max_pixels)` of the resized image."""

PanAndScanKnobs = tuple[int, int, float]
"""Gemma 3's `(pan_and_scan_min_crop_size, pan_and_scan_max_num_crops,
pan_and_scan_min_ratio_to_activate)`."""
