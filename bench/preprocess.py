"""Qwen2-VL image preprocessing, from raw encoded bytes to pixel_values + grid + hash.

Compares, in one run and on the same images (photo-like content, JPEG and PNG, 640x480 to
3840x2160, the Qwen2-VL checkpoint's max_pixels 12845056):

- mmserve: `mmserve._mm.preprocess` (Rust: decode, hash, resize, one-pass
  normalise + patchify), in its torchvision-exact mode and its PIL-exact mode;
- transformers' `Qwen2VLImageProcessor` (torchvision) and `Qwen2VLImageProcessorPil`, each
  with PIL's decode and a blake3 hash of the bytes;
- SGLang 0.5.23's Rust extension (`sglang.srt.rust_extensions._multimodal`,
  `qwen_vl.preprocess` + `common.content_hash`), loaded standalone from the SGLang side
  environment `.ci/setup.sh` builds (`.venv/sglang`), else from `--sglang-so`; when it cannot
  be loaded its column is left out and the first line printed says so and why.

It prints median times and the ratios against each anchor, single-thread and with the pool,
a batch of 16, the minor page faults per call of each path, and the peak RSS of mmserve's
batch of 16 at 3840x2160. Each configuration runs in its own subprocess so that thread
settings and peak RSS are its own.

Every timed call follows an untimed call of the same path on the same image, so a path's
time does not depend on which path ran before it (the allocator state a call leaves, such as
glibc's raised mmap threshold or a heap top not yet trimmed, is its own). Page faults are
counted per timed call and printed apart: they are the cost of fresh output memory, not of
the work.

Single-thread times are process CPU time (user + system, page faults included), so that
other load on a shared machine does not inflate them; pool times are wall-clock, as they
must be, and are only as steady as the machine is idle (the load average is printed).

    .venv/bin/python -m bench.preprocess            # full table
    .venv/bin/python -m bench.preprocess --quick    # fewer runs, smaller batch sizes
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

SIZES = [(640, 480), (1280, 960), (1920, 1080), (3840, 2160)]
FORMATS = ["JPEG", "PNG"]
PATCH, MERGE, TEMPORAL = 14, 2, 2
MIN_PIXELS, MAX_PIXELS = 3136, 12845056
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
IMAGE_TOKEN_ID, VISION_START_ID, VISION_END_ID = 151655, 151652, 151653
SGLANG_SO = "sglang/srt/rust_extensions/_multimodal.*.so"
SGLANG_HINT = "make setup builds .venv/sglang; or pass --sglang-so PATH"

Path_ = Callable[[bytes], Any]


def photo(width: int, height: int, seed: int) -> np.ndarray:
    """Deterministic photo-like RGB: a sky-to-ground gradient, blurred multi-scale texture,
    a few hard-edged objects and sensor noise (so JPEG and PNG sizes are realistic)."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None]
    x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :]
    sky = np.stack([90 + 80 * y, 140 + 60 * y, 220 - 120 * y], axis=-1) + 0 * x[..., None]
    texture = np.zeros((height, width), np.float32)
    for cells, amplitude in ((4, 40.0), (16, 20.0), (64, 10.0)):
        coarse = rng.normal(0.0, amplitude, (cells, cells * width // max(height, 1) + 1))
        rows = np.linspace(0, coarse.shape[0] - 1, height).astype(np.int64)
        cols = np.linspace(0, coarse.shape[1] - 1, width).astype(np.int64)
        texture += coarse[rows][:, cols]
    image = sky + texture[..., None] * (y[..., None] > 0.4)
    for _ in range(6):
        cx, cy, r = rng.uniform(0, 1), rng.uniform(0.3, 1), rng.uniform(0.05, 0.2)
        mask = (x - cx) ** 2 + ((y - cy) * height / width) ** 2 < r * r
        image[mask] = rng.uniform(0, 255, 3)
    image += rng.normal(0.0, 4.0, image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


def encode(image: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    options = {"quality": 90} if fmt == "JPEG" else {"compress_level": 6}
    Image.fromarray(image).save(buffer, fmt, **options)
    return buffer.getvalue()


def default_sglang_so() -> str:
    """SGLang's extension in the SGLang side environment (`.venv/sglang`, layered over the
    environment running this), or "" when it is not there."""
    roots = [Path(sys.prefix) / "sglang", Path(__file__).resolve().parents[1] / ".venv/sglang"]
    for root in roots:
        found = sorted(root.glob(f"lib/python*/site-packages/{SGLANG_SO}"))
        if found:
            return str(found[0])
    return ""


def load_sglang(path: str) -> tuple[ModuleType | None, str]:
    """The extension module, or None and why it could not be loaded."""
    if not path:
        return None, f"not found in {sys.prefix}/sglang ({SGLANG_HINT})"
    if not Path(path).exists():
        return None, f"{path} does not exist"
    spec = importlib.util.spec_from_file_location("_multimodal", path)
    if spec is None or spec.loader is None:
        return None, f"{path} is not a loadable extension"
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as error:
        return None, f"{path} failed to load: {error}"
    return module, ""


def make_paths(
    sglang_so: str,
) -> tuple[dict[str, Path_], dict[str, Callable[[list[bytes]], Any]], str]:
    """Single-item and batch callables, each from bytes to (pixel_values, grid, hash), and
    why SGLang's column is absent ("" when it is there)."""
    import blake3
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    from mmserve import _mm

    spec_torch, spec_pil = mmserve_spec("torch"), mmserve_spec("pil")
    kwargs = {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS}
    hf_tv = Qwen2VLImageProcessor(**kwargs)
    hf_pil = Qwen2VLImageProcessorPil(**kwargs)

    def hf(processor: Any, tensors: str) -> Callable[[list[bytes]], Any]:
        def run(items: list[bytes]) -> Any:
            images = [Image.open(io.BytesIO(b)) for b in items]
            out = processor(images=images, return_tensors=tensors)
            hashes = [int.from_bytes(blake3.blake3(b).digest()[:8], "little") for b in items]
            return out["pixel_values"], out["image_grid_thw"], hashes

        return run

    single: dict[str, Path_] = {
        "mmserve[torch]": lambda b: _mm.preprocess(spec_torch, b),
        "mmserve[pil]": lambda b: _mm.preprocess(spec_pil, b),
        "hf-torchvision": lambda b: hf(hf_tv, "pt")([b]),
        "hf-pil": lambda b: hf(hf_pil, "np")([b]),
    }
    batch: dict[str, Callable[[list[bytes]], Any]] = {
        "mmserve[torch]": lambda items: _mm.preprocess_batch(spec_torch, items),
        "mmserve[pil]": lambda items: _mm.preprocess_batch(spec_pil, items),
        "hf-torchvision": hf(hf_tv, "pt"),
        "hf-pil": hf(hf_pil, "np"),
    }
    sglang, absent = load_sglang(sglang_so)
    if sglang is not None:
        sgl_spec = json.dumps(
            {
                "image_token_id": IMAGE_TOKEN_ID,
                "patch_size": PATCH,
                "merge_size": MERGE,
                "temporal_patch_size": TEMPORAL,
                "min_pixels": MIN_PIXELS,
                "max_pixels": MAX_PIXELS,
                "image_mean": CLIP_MEAN,
                "image_std": CLIP_STD,
                "resample": "aten_u8",
            }
        )

        def sgl(b: bytes) -> Any:
            pixels, grid = sglang.qwen_vl.preprocess(b, sgl_spec)
            return pixels, grid, sglang.common.content_hash(b)

        single["sglang-rs"] = sgl
        batch["sglang-rs"] = lambda items: [sgl(b) for b in items]
    return single, batch, absent


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_paths(
    paths: Mapping[str, Callable[[Any], Any]], arg: Any, runs: int, clock: Callable[[], float]
) -> dict[str, tuple[float, float]]:
    """Median ms and mean minor page faults per call of each path on `arg`. Rounds are
    interleaved, so that load from other processes hits every path alike, and each timed call
    follows an untimed one of the same path, so that no path inherits the allocator state (and
    the faults) another one left."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    faults: dict[str, int] = dict.fromkeys(paths, 0)
    for _ in range(runs):
        for name, fn in paths.items():
            fn(arg)
            first, start = minor_faults(), clock()
            fn(arg)
            times[name].append((clock() - start) * 1e3)
            faults[name] += minor_faults() - first
    return {name: (statistics.median(times[name]), faults[name] / runs) for name in paths}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Runs inside a child process: times every path on every image, returns the table."""
    import torch

    clock = time.perf_counter
    if args.threads == 1:
        torch.set_num_threads(1)
        clock = time.process_time
    single, batch, absent = make_paths(args.sglang_so)
    results: dict[str, Any] = {
        "single": {},
        "faults": {},
        "batch": {},
        "paths": list(single),
        "absent": absent,
        "clock": "CPU" if args.threads == 1 else "wall",
    }
    for w, h in SIZES:
        image = photo(w, h, w + h)
        for fmt in FORMATS:
            data = encode(image, fmt)
            key = f"{w}x{h} {fmt}"
            row = time_paths(single, data, args.runs, clock)
            results["single"][key] = {name: ms for name, (ms, _) in row.items()}
            results["faults"][key] = {name: faults for name, (_, faults) in row.items()}
            print(f"  measured {key}", file=sys.stderr, flush=True)
    w, h = args.batch_size_image
    data = encode(photo(w, h, 7), "JPEG")
    items = [data] * 16
    timed = time_paths(batch, items, max(1, args.runs // 3), clock)
    results["batch"] = {name: ms for name, (ms, _) in timed.items()}
    results["batch_faults"] = {name: faults for name, (_, faults) in timed.items()}
    return results


def current_rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def mmserve_spec(backend: str) -> Any:
    from mmserve import _mm

    preprocessor = {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS}
    config = {
        "model_type": "qwen2_vl",
        "image_token_id": IMAGE_TOKEN_ID,
        "vision_start_token_id": VISION_START_ID,
        "vision_end_token_id": VISION_END_ID,
    }
    spec = _mm.spec_from_hf_configs(json.dumps(preprocessor), json.dumps(config))
    fields = json.loads(spec.to_json())
    fields["backend"] = backend
    return _mm.Spec.from_json(json.dumps(fields))


def peak_rss() -> dict[str, Any]:
    """Runs inside a child process that loads only mmserve: its batch of 16 at 3840x2160."""
    from mmserve import _mm

    spec = mmserve_spec("torch")
    data = encode(photo(3840, 2160, 1), "JPEG")
    before = current_rss_mib()
    out = _mm.preprocess_batch(spec, [data] * 16)
    output_mib = sum(np.asarray(item[0]).nbytes for item in out) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"before": before, "peak": peak, "output": output_mib}


def child(mode: str, extra: list[str], env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", mode, *extra]
    done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{mode} child failed:\n{done.stderr}")
    sys.stderr.write(done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_table(title: str, results: dict[str, Any]) -> None:
    paths = results["paths"]
    what = "ms per image (bytes -> pixel_values + grid + hash)"
    print(f"\n## {title}: median {results['clock']} {what}\n")
    ratios = [
        ("hf-torchvision", "mmserve[torch]"),
        ("sglang-rs", "mmserve[torch]"),
        ("hf-pil", "mmserve[pil]"),
    ]
    ratios = [(a, b) for a, b in ratios if a in paths]
    head = ["image", *paths, *(f"{a}/{b}" for a, b in ratios)]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for key, row in results["single"].items():
        cells = [key, *(f"{row[p]:.1f}" for p in paths)]
        cells += [f"{row[a] / row[b]:.2f}x" for a, b in ratios]
        print("| " + " | ".join(cells) + " |")
    batch = results["batch"]
    cells = ["batch of 16", *(f"{batch[p]:.0f}" for p in paths)]
    cells += [f"{batch[a] / batch[b]:.2f}x" for a, b in ratios]
    print("| " + " | ".join(cells) + " |")
    print(f"\n{title}: minor page faults per call (4 KiB, or 2 MiB where huge pages back it)\n")
    print("| " + " | ".join(["image", *paths]) + " |")
    print("|" + "---|" * (len(paths) + 1))
    rows = [*results["faults"].items(), ("batch of 16", results["batch_faults"])]
    for key, row in rows:
        print("| " + " | ".join([key, *(f"{row[p]:.0f}" for p in paths)]) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=7, help="timed runs per path and image")
    parser.add_argument("--quick", action="store_true", help="3 runs")
    parser.add_argument(
        "--sglang-so",
        default=default_sglang_so(),
        help="SGLang's _multimodal extension (default: the one in .venv/sglang)",
    )
    parser.add_argument("--child", choices=["measure", "rss"], help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.batch_size_image = (1280, 960)
    if args.quick:
        args.runs = 3
    if args.child == "measure":
        print(json.dumps(measure(args)))
        return
    if args.child == "rss":
        print(json.dumps(peak_rss()))
        return

    load = os.getloadavg()[0]
    print(f"# preprocess benchmark ({os.cpu_count()} cores, load average {load:.1f})")
    common = ["--runs", str(args.runs), "--sglang-so", args.sglang_so]
    one = {"MMSERVE_MM_THREADS": "1", "SGL_MM_RS_THREADS": "1", "OMP_NUM_THREADS": "1"}
    single = child("measure", [*common, "--threads", "1"], one)
    if single["absent"]:
        print(f"note: no sglang-rs column: SGLang's extension {single['absent']}")
    print_table("single thread", single)
    pooled = child("measure", common, {})
    print_table("with the pool (default threads)", pooled)
    for label, results in (("single thread", single), ("pool", pooled)):
        b = results["batch"]["mmserve[torch]"]
        print(f"\nmmserve[torch] batch of 16 x 1280x960 JPEG, {label}: {b:.0f} ms")
    rss = child("rss", [], {})
    extra = rss["peak"] - rss["before"] - rss["output"]
    print(
        f"\nmmserve[torch] batch of 16 x 3840x2160 JPEG: peak RSS {rss['peak']:.0f} MiB = "
        f"{rss['before']:.0f} before + {rss['output']:.0f} pixel_values + {extra:.0f} other "
        f"({extra / 16:.0f} MiB per item: decoded image, resize buffers, pool scratch)"
    )


if __name__ == "__main__":
    main()
