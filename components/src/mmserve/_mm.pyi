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

# resize
def resize(
    image: numpy.ndarray[tuple[int, int, int], numpy.dtype[numpy.uint8]],
    width: int,
    height: int,
    filter: str = "bicubic",
    backend: str = "pil",
) -> numpy.ndarray[tuple[int, int, int], numpy.dtype[numpy.uint8]]:
    """Resize uint8 RGB [h, w, 3] to [height, width, 3], bit-exact with PIL's Image.resize
    (backend "pil") or torchvision's uint8 antialiased resize (backend "torch").
    filter: "bicubic", "lanczos" or "bilinear"."""

def normalize_patchify(
    image: numpy.ndarray[tuple[int, int, int], numpy.dtype[numpy.uint8]],
    mean: tuple[float, float, float] | list[float],
    std: tuple[float, float, float] | list[float],
    rescale: float,
    patch_size: int,
    merge_size: int,
    temporal_patch_size: int,
    convention: str,
) -> numpy.ndarray[tuple[int, int], numpy.dtype[numpy.float32]]:
    """Rescale + normalize + patchify a resized uint8 RGB image into HF's pixel_values rows
    [grid_h * grid_w, 3 * temporal_patch_size * patch_size**2]; convention "pil" (numpy
    arithmetic) or "torchvision" (torch's fused float32 arithmetic)."""
