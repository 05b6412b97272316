"""Typed stubs for the Rust extension `mmserve._mm` (hand-written; checked by stubtest)."""

__version__: str

class MediaError(ValueError):
    """A media item was refused or could not be processed: args = (code, message)."""
