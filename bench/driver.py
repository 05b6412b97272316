"""The request driver (`mmserve._mm.process`): full mode against count-only mode (what the
frontend runs per request), and a 16-image request with one thread against the pool. Each pool
size runs in its own process (the pool is sized once per process by MMSERVE_MM_THREADS).

    .venv/bin/python -m bench.driver [--repeat 5]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
from PIL import Image

IMAGE_TOKEN, VISION_START, VISION_END = 151655, 151652, 151653
CONFIG = {
    "model_type": "qwen2_vl",
    "image_token_id": IMAGE_TOKEN,
    "vision_start_token_id": VISION_START,
    "vision_end_token_id": VISION_END,
}
PREPROCESSOR = {"min_pixels": 3136, "max_pixels": 12845056}


def photo_jpeg(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([128 + 100 * np.sin(x / 97), 128 + 100 * np.cos(y / 71), (x + y) % 256], -1)
    noisy = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noisy).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def best_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1000


def measure(repeat: int) -> dict[str, float]:
    from mmserve import _mm

    spec = _mm.spec_from_hf_configs(json.dumps(PREPROCESSOR), json.dumps(CONFIG))
    one = [photo_jpeg(1280, 960, 0)]
    batch = [photo_jpeg(1280, 960, i) for i in range(16)]
    ids_one = [0, VISION_START, IMAGE_TOKEN, VISION_END, 1]
    ids_batch = [0] + [VISION_START, IMAGE_TOKEN, VISION_END, 1] * 16
    return {
        "threads": _mm.num_threads(),
        "full_ms": best_ms(lambda: _mm.process(spec, ids_one, one), repeat),
        "count_only_ms": best_ms(lambda: _mm.process(spec, ids_one, one, count_only=True), repeat),
        "batch16_ms": best_ms(lambda: _mm.process(spec, ids_batch, batch), max(1, repeat // 2)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.repeat)))
        return
    cores = os.cpu_count() or 1
    rows = {}
    for threads in sorted({1, min(8, cores)}):
        env = dict(os.environ, MMSERVE_MM_THREADS=str(threads))
        out = subprocess.run(
            [sys.executable, __file__, "--child", "--repeat", str(args.repeat)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        rows[threads] = json.loads(out.stdout)
    print(f"load average {os.getloadavg()[0]:.1f} on {cores} cores; 1280x960 JPEG, qwen2_vl")
    print(f"{'threads':>8} {'full ms':>9} {'count ms':>9} {'full/count':>11} {'16 imgs ms':>11}")
    for threads, r in rows.items():
        ratio = r["full_ms"] / r["count_only_ms"]
        print(
            f"{threads:>8} {r['full_ms']:>9.1f} {r['count_only_ms']:>9.1f} {ratio:>10.2f}x"
            f" {r['batch16_ms']:>11.1f}"
        )
    if len(rows) > 1:
        single, pooled = rows[1], rows[max(rows)]
        print(f"pool speed-up on 16 images: {single['batch16_ms'] / pooled['batch16_ms']:.2f}x")


if __name__ == "__main__":
    main()
