"""Typed stubs for the Rust extension `mmserve._mm` (hand-written; checked by stubtest)."""

import numpy

__version__: str

class MediaError(ValueError):
    """A media item was refused or could not be processed: args = (code, message)."""

# media
def decode_image(
    data: bytes, max_pixels: int | None = None
) -> numpy.ndarray[tuple[int, int, int], numpy.dtype[numpy.uint8]]:
    """Decode JPEG/PNG/WebP/GIF/BMP bytes to uint8 RGB [h, w, 3], EXIF orientation applied."""

def content_hash(data: bytes) -> int:
    """blake3 of the raw bytes, first 8 digest bytes as a little-endian u64."""

def fetch_bytes(
    source: str,
    *,
    allowed_local_roots: list[str] = ...,
    allowed_domains: list[str] = ...,
    timeout_s: float | None = None,
    max_bytes: int | None = None,
) -> bytes:
    """Bytes of a data: URL, http(s) URL, file:// URL, absolute path or bare base64."""
