"""Test images, the one home for them: synthetic pictures, their encodings, data URLs, and the PNG
bomb (a header announcing more pixels than any limit allows). The hand-made encoders for the
decoder's edge cases (`tests/mm/images.py`) build on `png_chunk`."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

MIME_BY_SUFFIX = {".png": "image/png", ".mp4": "video/mp4", ".webm": "video/webm"}


def photo_like(width: int, height: int, seed: int, noise: int = 20) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256])
    jitter = rng.integers(-noise, noise + 1, size=base.shape)
    return Image.fromarray(np.clip(base + jitter, 0, 255).astype(np.uint8).transpose(1, 2, 0))


def encode_image(width: int, height: int, fmt: str = "PNG") -> bytes:
    """A gradient image, so that different sizes give different bytes."""
    return encoded(Image.linear_gradient("L").resize((width, height)).convert("RGB"), fmt)


def encoded(image: Image.Image, fmt: str, **options: object) -> bytes:
    """`image` as PIL writes it in `fmt` with `options`."""
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


def png_bytes(image: Image.Image) -> bytes:
    return encoded(image, "PNG")


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def file_data_url(path: Path) -> str:
    """A file as a data URL, its MIME type from its suffix (JPEG when unknown)."""
    return data_url(path.read_bytes(), MIME_BY_SUFFIX.get(path.suffix, "image/jpeg"))


def png_data_url(image: Image.Image) -> str:
    return data_url(png_bytes(image))


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(width: int = 100_000, height: int = 100_000) -> bytes:
    """Signature + IHDR + IEND: a ~45-byte PNG announcing `width` x `height` RGB pixels, with no
    pixel data; a decoder must refuse it from the header, without allocating."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IEND", b"")
