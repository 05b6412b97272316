"""Prints the golden table of `rust/mmserve-mm/tests/resize_goldens.rs` from the installed
Pillow and torchvision: FNV-1a 64 of each resized image, for an xorshift32 image that the Rust
test regenerates. Run it after upgrading Pillow or torch, and paste the output there:

    .venv/bin/python tests/mm/make_resize_goldens.py
"""

from __future__ import annotations

import numpy as np
import PIL
import torch
import torchvision
from PIL import Image
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as tvF

# (in_w, in_h, out_w, out_h, filter): mixed directions (vertical pass first in Pillow 13),
# both axes down, both up, heavy downscale.
CASES = [
    (64, 48, 66, 40, "bicubic"),
    (640, 480, 644, 476, "bicubic"),
    (50, 37, 17, 90, "lanczos"),
    (31, 29, 62, 58, "bilinear"),
    (300, 200, 13, 11, "lanczos"),
    (97, 61, 301, 17, "bicubic"),
]
PIL_FILTERS = {"bicubic": Image.Resampling.BICUBIC, "lanczos": Image.Resampling.LANCZOS}
PIL_FILTERS["bilinear"] = Image.Resampling.BILINEAR
TORCH_FILTERS = {"bicubic": InterpolationMode.BICUBIC, "lanczos": InterpolationMode.LANCZOS}
TORCH_FILTERS["bilinear"] = InterpolationMode.BILINEAR


def xorshift_image(width: int, height: int, seed: int) -> np.ndarray:
    state = (seed * 2654435761 + 1) & 0xFFFFFFFF
    out = bytearray(width * height * 3)
    for i in range(len(out)):
        state ^= (state << 13) & 0xFFFFFFFF
        state ^= state >> 17
        state ^= (state << 5) & 0xFFFFFFFF
        out[i] = state >> 24
    return np.frombuffer(bytes(out), np.uint8).reshape(height, width, 3).copy()


def fnv1a(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def main() -> None:
    versions = f"torch {torch.__version__}, torchvision {torchvision.__version__}"
    print(f"// Pillow {PIL.__version__}, {versions}")
    for seed, (w, h, ow, oh, name) in enumerate(CASES):
        image = xorshift_image(w, h, seed)
        pil = np.asarray(Image.fromarray(image).resize((ow, oh), PIL_FILTERS[name]))
        chw = torch.from_numpy(image).permute(2, 0, 1).contiguous()
        tv = tvF.resize(chw, [oh, ow], interpolation=TORCH_FILTERS[name], antialias=True)
        tv = tv.permute(1, 2, 0).contiguous().numpy()
        print(
            f"    ({w}, {h}, {ow}, {oh}, Filter::{name.capitalize()}, "
            f"{fnv1a(pil.tobytes()):#018x}, {fnv1a(tv.tobytes()):#018x}),"
        )


if __name__ == "__main__":
    main()
