"""The Python side of the Rust media core: the fetch policy and async calls into the core."""

from mmserve.media.calls import (
    ItemPixels,
    PlannedRequest,
    fetch,
    plan_request,
    preprocess_items,
)
from mmserve.media.policy import MediaPolicy

__all__ = [
    "ItemPixels",
    "MediaPolicy",
    "PlannedRequest",
    "fetch",
    "plan_request",
    "preprocess_items",
]
