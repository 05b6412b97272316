"""End-to-end serving benchmark on the tiny model, per deployment pattern.

For each pattern (agg, EP/D, E/PD, E/P/D) it starts a real deployment (one process per
component, a private nats-server), then sends streaming chat requests with one 1280x960 JPEG,
and with one 5 s 640x360 H.264 video (sampled at 2 fps: 10 frames): at concurrency 1 and 8,
with a new item per request (cold: fetch, preprocess and vision tower every time) and with the
same item repeated (encoder and prefix caches warm). It prints TTFT
p50/p99 and requests/s, and the frontend's own added latency (HTTP arrival to first-hop
dispatch, from its Prometheus histogram). The aggregated pattern is the anchor: ratios are
against it.

    .venv/bin/python -m bench.e2e [--patterns agg e_p_d] [--requests 16] [--media image video]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from mmserve.runtime.nats_server import NatsServer
from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.deployment import PATTERNS, Deployment, serve_directory

MAX_TOKENS = 8


def photo_jpeg(seed: int, width: int = 1280, height: int = 960) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // (width - 1), y * 255 // (height - 1), (x * 3 + y) % 256], -1)
    pixels = np.clip(base + rng.integers(-25, 26, base.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def video_mp4(path: Path, seed: int) -> None:
    """A 5 s 640x360 H.264 clip; the seed goes into the container's metadata, so each clip's
    bytes (and so its identity) differ while decoding costs the same."""
    source = "testsrc2=size=640x360:rate=30"
    command = ["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i", source, "-t", "5"]
    command += ["-c:v", "libx264", "-pix_fmt", "yuv420p", "-metadata", f"comment={seed}"]
    subprocess.run([*command, str(path)], check=True)


# Per medium: the content part's type, the file suffix, the file maker.
MEDIA = {
    "image": ("image_url", "jpg", lambda path, seed: path.write_bytes(photo_jpeg(seed))),
    "video": ("video_url", "mp4", video_mp4),
}


async def one_request(client: httpx.AsyncClient, url: str, model: str, item: str) -> float:
    part = "video_url" if item.endswith(".mp4") else "image_url"
    body = {
        "model": model,
        "stream": True,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": part, part: {"url": item}},
                    {"type": "text", "text": "Describe it."},
                ],
            }
        ],
    }
    started = time.perf_counter()
    ttft = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if ttft is None and line.startswith("data: ") and '"content"' in line:
                ttft = time.perf_counter() - started
    assert ttft is not None, "no content streamed"
    return ttft


async def run_load(url: str, model: str, images: list[str], concurrency: int) -> dict[str, float]:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for image in images:
        queue.put_nowait(image)
    ttfts: list[float] = []

    async def user(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            ttfts.append(await one_request(client, url, model, queue.get_nowait()))

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(user(client) for _ in range(concurrency)))
    wall = time.perf_counter() - started
    ttfts.sort()
    return {
        "p50": statistics.median(ttfts) * 1000,
        "p99": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))] * 1000,
        "rps": len(ttfts) / wall,
    }


def frontend_dispatch_ms(url: str) -> float:
    """Mean of the frontend's preprocess histogram (HTTP arrival to first-hop dispatch)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    sums = re.findall(
        r'mmserve_stage_seconds_(sum|count)\{component="frontend",stage="preprocess"\} (\S+)', text
    )
    values = dict(sums)
    if "count" not in values or float(values["count"]) == 0:
        return float("nan")
    return float(values["sum"]) / float(values["count"]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--patterns", nargs="*", default=list(PATTERNS))
    parser.add_argument("--requests", type=int, default=16, help="requests per measurement")
    parser.add_argument("--transfer", default="shm", choices=["shm", "nixl"])
    parser.add_argument("--media", nargs="+", default=list(MEDIA), choices=list(MEDIA))
    args = parser.parse_args()

    model_path = build_tiny_model("qwen2_vl")
    work = Path(tempfile.mkdtemp(prefix="mmserve-bench-e2e-"))
    items = work / "media"
    items.mkdir()
    count = 2 * args.requests * len(args.patterns) + 1  # fresh items, then item 0 repeated
    for medium in args.media:
        _, suffix, make = MEDIA[medium]
        for seed in range(count):
            make(items / f"{seed}.{suffix}", seed)
    rows = []
    with serve_directory(items) as (base, _server), NatsServer() as nats:
        cold = {
            medium: iter(f"{base}/{seed}.{MEDIA[medium][1]}" for seed in range(1, count))
            for medium in args.media
        }
        for pattern in args.patterns:
            deployment = Deployment(
                pattern, model_path, nats.url, work, transfer=args.transfer
            ).start()
            try:
                deployment.wait_ready()
                url, model = deployment.base_url, model_path.name
                for medium in args.media:
                    first = f"{base}/0.{MEDIA[medium][1]}"
                    asyncio.run(run_load(url, model, [first], 1))  # warm-up
                    for concurrency in (1, 8):
                        fresh = [next(cold[medium]) for _ in range(args.requests)]
                        for kind, load in (("cold", fresh), ("repeat", [first] * args.requests)):
                            result = asyncio.run(run_load(url, model, load, concurrency))
                            rows.append((pattern, concurrency, f"{medium} {kind}", result))
                rows.append((pattern, 0, "frontend", {"dispatch_ms": frontend_dispatch_ms(url)}))
            finally:
                deployment.stop()

    anchors = {(c, kind): r for p, c, kind, r in rows if p == "agg" and kind != "frontend"}
    print(
        f"\ntiny Qwen2-VL, 1280x960 JPEG / 5 s 640x360 H.264, {MAX_TOKENS} tokens, "
        f"{args.requests} requests each"
    )
    print(f"{'pattern':8} {'conc':>4} {'item':12} {'TTFT p50 ms':>12} {'p99 ms':>9} {'req/s':>7} "
          f"{'p50 vs agg':>11}")  # fmt: skip
    for pattern, concurrency, kind, result in rows:
        if kind == "frontend":
            print(f"{pattern:8} frontend added latency (arrival -> dispatch), mean "
                  f"{result['dispatch_ms']:.2f} ms")  # fmt: skip
            continue
        anchor = anchors.get((concurrency, kind))
        ratio = result["p50"] / anchor["p50"] if anchor else float("nan")
        print(f"{pattern:8} {concurrency:4} {kind:12} {result['p50']:12.1f} {result['p99']:9.1f} "
              f"{result['rps']:7.2f} {ratio:10.2f}x")  # fmt: skip
    print(json.dumps({"rows": [[p, c, k, r] for p, c, k, r in rows]}))


if __name__ == "__main__":
    main()
