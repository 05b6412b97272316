"""Pixel parity of mmserve's decoder with the RGB transformers' image processors work on
(`load_image`, then their `convert_to_rgb`, which paints a transparent colour white) over generated
photo-like images: JPEG (qualities 10-100, 4:4:4 / 4:2:2 / 4:2:0, baseline and progressive,
restart intervals), PNG (PIL's modes) and WebP (lossy and lossless). Prints, per format, the
number of images, the share decoded bit-exactly and the largest absolute difference."""

from __future__ import annotations

import argparse
import base64
import io
import warnings
from collections.abc import Iterator

import numpy as np
from PIL import Image, ImageFile
from transformers.image_transforms import convert_to_rgb
from transformers.image_utils import load_image

from mmserve import _mm


def photo(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x * y) % 256], -1)
    noise = rng.normal(0, float(rng.uniform(2, 40)), (height, width, 3))
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def encoded(rng: np.random.Generator, count: int) -> Iterator[tuple[str, bytes]]:
    for i in range(count):
        width, height = (int(v) for v in rng.integers(1, 400, 2))
        image = Image.fromarray(photo(rng, width, height))
        out = io.BytesIO()
        kind = i % 3
        if kind == 0:
            options: dict[str, object] = {
                "quality": int(rng.integers(10, 101)),
                "subsampling": int(rng.integers(0, 3)),
            }
            if i % 2:
                options["progressive"] = True
            elif i % 5 == 0:
                options["restart_marker_blocks"] = int(rng.integers(1, 8))
            image.save(out, "JPEG", **options)
            yield "JPEG", out.getvalue()
        elif kind == 1:
            mode = ["L", "LA", "RGB", "RGBA", "P", "1"][i % 6]
            colors = int(rng.integers(2, 256))
            converted = image.quantize(colors) if mode == "P" else image.convert(mode)
            converted.save(out, "PNG")
            yield "PNG", out.getvalue()
        else:
            lossless = i % 2 == 0
            image.save(out, "WEBP", lossless=lossless, quality=int(rng.integers(1, 101)))
            yield "WebP lossless" if lossless else "WebP lossy", out.getvalue()


def pipeline_rgb(data: bytes) -> np.ndarray:
    with warnings.catch_warnings():
        # PIL warns when a palette with per-entry alpha is converted to RGB.
        warnings.simplefilter("ignore")
        image = load_image(base64.b64encode(data).decode())
    return np.asarray(convert_to_rgb(image, return_numpy=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    ImageFile.MAXBLOCK = 1 << 24  # PIL's progressive encoder needs room on noisy images
    stats: dict[str, list[int]] = {}
    for name, data in encoded(np.random.default_rng(args.seed), args.images):
        ours = _mm.decode_image(data).astype(np.int16)
        reference = pipeline_rgb(data).astype(np.int16)
        diff = int(np.abs(ours - reference).max()) if ours.shape == reference.shape else 255
        stats.setdefault(name, []).append(diff)
    print(f"{'format':14s} {'images':>6s} {'exact':>7s} {'max abs diff':>13s}")
    for name, diffs in sorted(stats.items()):
        exact = 100 * sum(d == 0 for d in diffs) / len(diffs)
        print(f"{name:14s} {len(diffs):6d} {exact:6.1f}% {max(diffs):13d}")


if __name__ == "__main__":
    main()
