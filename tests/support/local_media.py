"""Test media: small encoded images on disk and a real HTTP server on 127.0.0.1 serving them."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from tests.support.deployment import serve_directory


def encode_image(width: int, height: int, fmt: str = "PNG") -> bytes:
    """A gradient image, so that different sizes give different bytes."""
    image = Image.linear_gradient("L").resize((width, height)).convert("RGB")
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


def png_bomb(width: int, height: int) -> bytes:
    """A valid PNG header announcing `width` x `height` pixels, with almost no data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@dataclass(frozen=True)
class MediaServer:
    root: Path
    url: str  # http://127.0.0.1:PORT

    def write(self, name: str, data: bytes) -> str:
        """Stores `data` under `name` and returns its URL."""
        (self.root / name).write_bytes(data)
        return f"{self.url}/{name}"


@contextmanager
def media_server_over(root: Path) -> Iterator[MediaServer]:
    """A loopback HTTP server over `root` (`deployment.serve_directory`'s), for one block."""
    url, server = serve_directory(root)
    try:
        yield MediaServer(root, url)
    finally:
        server.shutdown()
        server.server_close()
