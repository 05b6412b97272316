"""The Python side of the Rust media core: the fetch policy and async calls into the core."""

from mmserve.media.calls import (
    ProcessedItem,
    ProcessedRequest,
    fetch,
    is_inline,
    load_spec,
    process,
)
from mmserve.media.policy import MediaPolicy

__all__ = [
    "MediaPolicy",
    "ProcessedItem",
    "ProcessedRequest",
    "fetch",
    "is_inline",
    "load_spec",
    "process",
]
