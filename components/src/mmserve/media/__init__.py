"""The Python side of the Rust media core: the fetch policy and async calls into the core."""

from mmserve.media.calls import (
    DEFAULT_MAX_AUDIO_DURATION_S,
    ItemPixels,
    Modality,
    PlannedRequest,
    Precomputed,
    VideoSettings,
    fetch,
    plan_request,
    plan_request_here,
    preprocess_items,
    preprocess_with_crops,
)
from mmserve.media.policy import MediaPolicy
from mmserve.media.processing import PixelBounds

__all__ = [
    "DEFAULT_MAX_AUDIO_DURATION_S",
    "ItemPixels",
    "MediaPolicy",
    "Modality",
    "PixelBounds",
    "PlannedRequest",
    "Precomputed",
    "VideoSettings",
    "fetch",
    "plan_request",
    "plan_request_here",
    "preprocess_items",
    "preprocess_with_crops",
]
