"""The Python side of the Rust media core: the fetch policy and async calls into the core."""

from mmserve.media.calls import MediaSpec, ProcessedItem, ProcessedRequest, fetch, process
from mmserve.media.policy import MediaPolicy

__all__ = ["MediaPolicy", "MediaSpec", "ProcessedItem", "ProcessedRequest", "fetch", "process"]
