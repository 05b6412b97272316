"""Test images for the end-to-end suites."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
from PIL import Image


def photo_like(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256])
    noise = rng.integers(-20, 20, size=base.shape)
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8).transpose(1, 2, 0))


def data_url(path: Path) -> str:
    mime = "image/png" if path.suffix == ".png" else "image/jpeg"
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"
