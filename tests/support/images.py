"""Test images for the end-to-end suites."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
from PIL import Image


def photo_like(width: int, height: int, seed: int, noise: int = 20) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256])
    jitter = rng.integers(-noise, noise + 1, size=base.shape)
    return Image.fromarray(np.clip(base + jitter, 0, 255).astype(np.uint8).transpose(1, 2, 0))


def data_url(path: Path) -> str:
    mime = {".png": "image/png", ".mp4": "video/mp4", ".webm": "video/webm"}.get(
        path.suffix, "image/jpeg"
    )
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"


def png_bytes(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def png_data_url(image: Image.Image) -> str:
    return f"data:image/png;base64,{base64.b64encode(png_bytes(image)).decode()}"
