"""Load with accounting: N concurrent streaming chat requests with images, for a fixed time,
against one deployment pattern on loopback.

It starts the pattern (one process per component, a private nats-server, the tiny model),
warms it up, reads each process's RSS, then keeps `--concurrency` streams in flight for
`--duration` seconds (at most `--max-requests` requests), reading RSS again after each of
`--parts` equal parts. Every request must end in exactly one complete answer (a finish
reason, then `[DONE]`) or exactly one error (an HTTP error status, or one error event then
`[DONE]`); anything else counts as lost or duplicated, and so do repeated response ids.
Transport errors the client sees are counted apart, before or after the response began, and
never retried (a retry could run a request twice). Streams share httpx clients of at most
`POOL_CONNECTIONS` connections each (one pool's bookkeeping grows with connections times
waiting requests). Prints TTFT p50/p99, requests/s, errors by code, RSS per process and the
CPU time each process spent over the measured load (in all, and per request) as markdown, and
how late this process's own event loop ran (that lag is in the TTFT too).

    .venv/bin/python -m bench.load --pattern agg --engine hf --concurrency 16 --duration 60
    .venv/bin/python -m bench.load --pattern e_p_d --engine mock --concurrency 200 --duration 60
    .venv/bin/python -m bench.load --pattern agg --engine mock --concurrency 1000 --max-queue 1024

Exit status 1 when a request was lost or duplicated.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import uvloop
from PIL import Image

from mmserve.frontend.cli import raise_open_file_limit
from mmserve.runtime.nats_server import NatsServer
from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.deployment import PATTERNS, Deployment, serve_directory

MAX_DURATION_S = 900.0
MAX_REQUESTS = 100_000
POOL_CONNECTIONS = 50  # per httpx client


@dataclass
class Tally:
    """Per-request outcomes of one phase."""

    complete: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    lost: int = 0
    duplicated: int = 0
    ttft: list[float] = field(default_factory=list)
    ids: collections.Counter[str] = field(default_factory=collections.Counter)
    loop_lag: list[float] = field(default_factory=list)  # this process's, see watch_loop_lag

    def merge(self, other: Tally) -> None:
        self.complete += other.complete
        self.errors.update(other.errors)
        self.lost += other.lost
        self.duplicated += other.duplicated
        self.ttft += other.ttft
        self.ids.update(other.ids)
        self.loop_lag += other.loop_lag

    @property
    def total(self) -> int:
        return self.complete + sum(self.errors.values()) + self.lost + self.duplicated


def write_images(root: Path, count: int) -> list[str]:
    names = []
    for seed in range(count):
        rng = np.random.default_rng(seed)
        pixels = rng.integers(0, 256, size=(240, 320, 3), dtype=np.uint8)
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, format="JPEG", quality=85)
        (root / f"{seed}.jpg").write_bytes(out.getvalue())
        names.append(f"{seed}.jpg")
    return names


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_s(pid: int) -> float:
    """User plus system CPU time the process has used, in seconds."""
    # After the parenthesised command name: state is field 3, utime 14, stime 15 (proc(5)).
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_request(
    client: httpx.AsyncClient, model: str, image_url: str, max_tokens: int, tally: Tally
) -> None:
    body = {
        "model": model,
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image_url}},
                    {"type": "text", "text": "Describe the picture."},
                ],
            }
        ],
    }
    started = time.perf_counter()
    response = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            tally.ids[response.headers.get("x-request-id", "")] += 1
            if response.status_code != 200:
                await response.aread()
                tally.errors[f"{response.status_code} {response.json()['error']['code']}"] += 1
                return
            end = await read_stream(response, started)
    except httpx.HTTPError as err:
        where = "before the response" if response is None else "mid-response"
        tally.errors[f"transport {type(err).__name__} {where}"] += 1
        return
    if end.complete:
        tally.complete += 1
        if end.first_s is not None:
            tally.ttft.append(end.first_s)
    elif end.done == 1 and end.errors == 1 and end.finishes == 0:
        tally.errors[f"200 then {end.error_code}"] += 1
    elif end.done == 0 and end.finishes == 0 and end.errors == 0:
        tally.lost += 1
    else:
        tally.duplicated += 1


@dataclass
class StreamEnd:
    """What one streamed chat response held: finish reasons, error events, `[DONE]` lines,
    and the seconds to its first token."""

    finishes: int = 0
    errors: int = 0
    done: int = 0
    first_s: float | None = None
    error_code: str = ""

    @property
    def complete(self) -> bool:
        """Exactly one answer: one finish reason, then `[DONE]`, no error."""
        return self.done == 1 and self.finishes == 1 and self.errors == 0


async def read_stream(response: httpx.Response, started: float) -> StreamEnd:
    """Reads a 200 SSE response to its end; the first token is the first choice that carries
    content or a finish reason, timed from `started` (`time.perf_counter()`)."""
    end = StreamEnd()
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            end.done += 1
            continue
        event = json.loads(line[6:])
        if "error" in event:
            end.errors += 1
            end.error_code = event["error"]["code"]
            continue
        for choice in event.get("choices", ()):
            finished = choice.get("finish_reason") is not None
            if end.first_s is None and (choice["delta"].get("content") or finished):
                end.first_s = time.perf_counter() - started
            end.finishes += finished
    return end


async def watch_loop_lag(samples: list[float], interval_s: float = 0.1) -> None:
    """How late this process's event loop wakes up: its lag adds to the measured TTFT."""
    while True:
        before = time.perf_counter()
        await asyncio.sleep(interval_s)
        samples.append(time.perf_counter() - before - interval_s)


async def run_phase(
    base_url: str,
    model: str,
    images: list[str],
    concurrency: int,
    duration_s: float,
    max_requests: int,
    max_tokens: int,
) -> tuple[Tally, float]:
    tally = Tally()
    issued = 0
    stop_at = time.monotonic() + duration_s
    timeout = httpx.Timeout(600.0, connect=30.0)

    async def loop(client: httpx.AsyncClient) -> None:
        nonlocal issued
        while time.monotonic() < stop_at and issued < max_requests:
            image = images[issued % len(images)]
            issued += 1
            await one_request(client, model, image, max_tokens, tally)

    elapsed = await run_streams(base_url, concurrency, timeout, loop, tally.loop_lag)
    assert tally.total == issued, (tally.total, issued)
    return tally, elapsed


async def run_streams(
    base_url: str,
    concurrency: int,
    timeout: httpx.Timeout,
    stream: Callable[[httpx.AsyncClient], Awaitable[None]],
    loop_lag: list[float],
) -> float:
    """`concurrency` copies of `stream` at once, each given a client of `base_url`, while the
    client's own event-loop lag is recorded into `loop_lag`; returns the seconds they took."""

    async def streams(count: int) -> None:
        limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
        async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
            await asyncio.gather(*(stream(client) for _ in range(count)))

    # Several small pools: one pool's bookkeeping grows with connections times waiting requests.
    pools = [
        min(POOL_CONNECTIONS, concurrency - first)
        for first in range(0, concurrency, POOL_CONNECTIONS)
    ]
    lag = asyncio.ensure_future(watch_loop_lag(loop_lag))
    started = time.monotonic()
    await asyncio.gather(*(streams(count) for count in pools))
    elapsed = time.monotonic() - started
    lag.cancel()
    return elapsed


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pattern", choices=sorted(PATTERNS), default="agg")
    parser.add_argument("--engine", choices=("hf", "mock"), default="hf")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of measured load")
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds of warm-up load")
    parser.add_argument("--parts", type=int, default=2, help="RSS is read after each part")
    parser.add_argument(
        "--log-dir", type=Path, default=None, help="keep each process's log here (default: none)"
    )
    parser.add_argument("--max-requests", type=int, default=20_000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--images", type=int, default=32, help="distinct images, cycled")
    parser.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="requests each worker admits at once (default: the worker's own)",
    )
    args = parser.parse_args()
    duration = min(args.duration, MAX_DURATION_S)
    max_requests = min(args.max_requests, MAX_REQUESTS)

    # The pattern with the chosen engine (and queue) on every worker.
    pattern = f"{args.pattern}-{args.engine}"
    worker_flags = ["--engine", args.engine]
    if args.max_queue is not None:
        worker_flags += ["--max-queue", str(args.max_queue)]
    PATTERNS[pattern] = [
        (name, role, [*flags, *worker_flags]) for name, role, flags in PATTERNS[args.pattern]
    ]
    # One connection (a file) per stream, and as many on the frontend's side.
    raise_open_file_limit()
    model_path = build_tiny_model("qwen2_vl")
    with contextlib.ExitStack() as stack:
        tmp_path = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        nats = stack.enter_context(NatsServer())
        image_root = tmp_path / "images"
        image_root.mkdir()
        base, _file_server = stack.enter_context(serve_directory(image_root))
        images = [f"{base}/{name}" for name in write_images(image_root, args.images)]
        log_dir = args.log_dir or tmp_path
        log_dir.mkdir(parents=True, exist_ok=True)
        deployment = Deployment(pattern, model_path, nats.url, log_dir)
        try:
            deployment.start().wait_ready()
            model = model_path.name
            warm, _ = uvloop.run(
                run_phase(deployment.base_url, model, images, args.concurrency, args.warmup,
                          max_requests, args.max_tokens)
            )  # fmt: skip
            # Measured in parts: memory that keeps growing in the later parts is a leak,
            # growth in the first only may be caches and pools still filling.
            rss = [{name: rss_mib(p.pid) for name, p in deployment.processes.items()}]
            cpu = {name: cpu_s(p.pid) for name, p in deployment.processes.items()}
            tally, elapsed = Tally(), 0.0
            for _ in range(args.parts):
                part, seconds = uvloop.run(
                    run_phase(deployment.base_url, model, images, args.concurrency,
                              duration / args.parts, max_requests // args.parts, args.max_tokens)
                )  # fmt: skip
                tally.merge(part)
                elapsed += seconds
                rss.append({name: rss_mib(p.pid) for name, p in deployment.processes.items()})
            cpu = {name: cpu_s(p.pid) - cpu[name] for name, p in deployment.processes.items()}
        finally:
            deployment.stop()
    repeated_ids = sum(count - 1 for count in tally.ids.values() if count > 1)
    lag_p99, lag_max = percentile(tally.loop_lag, 0.99), max(tally.loop_lag, default=0.0)
    print(
        f"pattern {args.pattern}, engine {args.engine}, concurrency {args.concurrency}, "
        f"{elapsed:.0f} s after {warm.total} warm-up requests; the load generator's event loop "
        f"lagged p99 {lag_p99 * 1e3:.0f} ms, max {lag_max * 1e3:.0f} ms"
    )
    print("| requests | complete | errors | lost | duplicated | req/s | TTFT p50 | TTFT p99 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    errors = ", ".join(f"{code}: {n}" for code, n in tally.errors.most_common()) or "0"
    p50, p99 = (percentile(tally.ttft, q) * 1e3 for q in (0.5, 0.99))
    print(
        f"| {tally.total} | {tally.complete} | {errors} | {tally.lost} | "
        f"{tally.duplicated + repeated_ids} | {tally.total / elapsed:.1f} | "
        f"{p50:.0f} ms | {p99:.0f} ms |"
    )
    parts = [f"after part {i + 1}" for i in range(args.parts)]
    print(
        "\n| process | RSS after warm-up | " + " | ".join(parts) + " | last part "
        "| CPU in load | CPU per request |"
    )
    print("| --- " * (args.parts + 5) + "|")
    for name, start in rss[0].items():
        cells = " | ".join(f"{point[name]:.0f} MiB" for point in rss[1:])
        last = rss[-1][name] - rss[-2][name]
        per_request = cpu[name] / max(tally.total, 1) * 1e3
        print(
            f"| {name} | {start:.0f} MiB | {cells} | {last:+.0f} MiB | {cpu[name]:.1f} s "
            f"| {per_request:.2f} ms |"
        )
    return 1 if tally.lost or tally.duplicated or repeated_ids else 0


if __name__ == "__main__":
    sys.exit(main())
