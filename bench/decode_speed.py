"""Decode speed of mmserve's Rust decoder against PIL (decode + convert("RGB")) on one
photo-like 1280x960 image per format. Prints times and the PIL/mmserve ratio."""

from __future__ import annotations

import io
import time
from collections.abc import Callable

import numpy as np
from PIL import Image

from mmserve import _mm

WIDTH, HEIGHT = 1280, 960
REPEATS = 15


def photo() -> np.ndarray:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH]
    base = np.stack([x * 255 / WIDTH, y * 255 / HEIGHT, (x ^ y) % 256], -1)
    return np.clip(base + rng.normal(0, 12, (HEIGHT, WIDTH, 3)), 0, 255).astype(np.uint8)


def encode(pixels: np.ndarray, fmt: str, **options: object) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt, **options)
    return out.getvalue()


def best_ms(fn: Callable[[], object]) -> float:
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def main() -> None:
    pixels = photo()
    cases = {
        "JPEG q90 4:2:0": encode(pixels, "JPEG", quality=90),
        "PNG": encode(pixels, "PNG"),
        "WebP lossy q80": encode(pixels, "WEBP", quality=80),
        "WebP lossless": encode(pixels, "WEBP", lossless=True),
    }
    print(f"{'image':16s} {'MB':>5s} {'mmserve ms':>11s} {'PIL ms':>8s} {'PIL/mmserve':>12s}")
    for name, data in cases.items():
        ours = best_ms(lambda data=data: _mm.decode_image(data))
        pil = best_ms(lambda data=data: np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
        print(f"{name:16s} {len(data) / 1e6:5.2f} {ours:11.2f} {pil:8.2f} {pil / ours:11.2f}x")


if __name__ == "__main__":
    main()
