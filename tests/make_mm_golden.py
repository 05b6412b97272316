"""Writes tests/mm/golden/: three small PNGs and, for each Qwen-VL family and resize backend,
what transformers makes of a prompt holding them (expanded ids, offsets, M-RoPE positions,
grids, token counts and a blake3 digest of pixel_values). The Python and Rust golden tests
check the extension and the plain rlib against this file.

Run from the repository root: .venv/bin/python -m tests.make_mm_golden
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch
from PIL import Image

from tests.mm.images import encode_png
from tests.mm.qwen_refs import (
    IMAGE_TOKEN,
    PREPROCESSOR_CONFIGS,
    PROCESSOR_TYPES,
    VISION_END,
    VISION_START,
    hf_pixels,
    hf_processor,
    model_config,
)
from tests.mm.test_positions import tiny_model

GOLDEN = Path(__file__).resolve().parent / "mm" / "golden"
CASES = [(f, b) for f in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl") for b in ("pil", "torch")]


def images() -> dict[str, bytes]:
    rng = np.random.default_rng(2024)
    rgb = rng.integers(0, 256, (30, 40, 3))
    gray = rng.integers(0, 256, (90, 17, 1))
    palette_index = rng.integers(0, 16, (64, 64, 1))
    palette = bytes(rng.integers(0, 256, 48, dtype=np.uint8))
    return {
        "rgb_40x30.png": encode_png(rgb, 2),
        "gray_17x90.png": encode_png(gray, 0),
        "palette_64x64.png": encode_png(palette_index, 3, palette=palette),
    }


def prompt(n: int) -> list[int]:
    ids = [9, 8]
    for i in range(n):
        ids += [VISION_START, IMAGE_TOKEN, VISION_END, 7 + i]
    return ids


def case(family: str, backend: str, files: dict[str, bytes]) -> dict:
    processor = hf_processor(family, backend)
    merge = processor.merge_size
    items: list[dict[str, Any]] = []
    expanded: list[int] = []
    ids = prompt(len(files))
    for data in files.values():
        pixels, grid = hf_pixels(processor, data)
        count = int(np.prod(grid[0])) // merge**2
        items.append(
            {
                "hash": blake3.blake3(data).digest()[:8][::-1].hex(),
                "grid_thw": grid[0].tolist(),
                "num_tokens": count,
                "pixel_values_shape": list(pixels.shape),
                "pixel_values_blake3": blake3.blake3(pixels.astype("<f4").tobytes()).hexdigest(),
            }
        )
    counts = iter(item["num_tokens"] for item in items)
    offsets = []
    for token in ids:
        if token == IMAGE_TOKEN:
            n = next(counts)
            offsets.append([len(expanded), len(expanded) + n])
            expanded += [IMAGE_TOKEN] * n
        else:
            expanded.append(token)
    model = tiny_model(family)
    expanded_tensor = torch.tensor([expanded])
    grids = torch.tensor([item["grid_thw"] for item in items])
    with torch.no_grad():
        positions, delta = model.get_rope_index(
            expanded_tensor,
            mm_token_type_ids=(expanded_tensor == IMAGE_TOKEN).int(),
            image_grid_thw=grids,
        )
    return {
        "family": family,
        "backend": backend,
        "preprocessor_config": dict(
            PREPROCESSOR_CONFIGS[family], image_processor_type=PROCESSOR_TYPES[backend]
        ),
        "config": model_config(family),
        "input_ids": ids,
        "expanded_ids": expanded,
        "offsets": offsets,
        "positions": positions[:, 0].tolist(),
        "rope_delta": int(delta.item()),
        "items": items,
    }


def main() -> None:
    GOLDEN.mkdir(parents=True, exist_ok=True)
    files = images()
    for name, data in files.items():
        (GOLDEN / name).write_bytes(data)
        assert Image.open(io.BytesIO(data)).size  # readable by PIL
    golden = {"images": list(files), "cases": [case(f, b, files) for f, b in CASES]}
    (GOLDEN / "qwen_vl.json").write_text(json.dumps(golden, separators=(",", ":")) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
