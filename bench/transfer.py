"""Throughput and latency of tensor transfer between two processes, next to memcpy.

For each backend a probe process (`python -m mmserve.transfer.probe`) is the peer of this one,
over NATS on loopback. Sizes: 64 KiB, 2.8 MiB (one Qwen2.5-VL-7B image embedding: 410 tokens x
3584 hidden in bf16) and 64 MiB. Rows:

- read: this process offers (copies into its pool), the probe fetches; time = the probe's fetch
  until the data is in its pooled buffer (zero-copy `fetch_view`; `fetch()` adds one copy out).
- write: this process offers a destination, the probe writes; time = the probe's `write()`
  (copy into its pool + WRITE).
- e2e: offer here + handle over NATS + fetch there + reply + the lease's completion here.
- memcpy: `torch.Tensor.copy_` of the same size in this process, measured in the same run.

Medians over the repeats; ratio = transfer time / memcpy time. Goals: NIXL read at 64 MiB within
2x of memcpy, and the 2.8 MiB end to end under 5 ms.

    .venv/bin/python bench/transfer.py [--backends nixl,shm,inline] [--repeat-scale 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from dataclasses import dataclass

import torch

from mmserve.runtime.nats_server import nats_url_from_env_or_private
from mmserve.transfer import MAX_INLINE_BYTES, TransferAgent
from mmserve.transfer.probe import ProbeProcess

EMBEDDING_SHAPE = (410, 3584)  # 2.8 MiB in bf16
SIZES = {  # name -> (shape, repeats)
    "64KiB": ((32, 1024), 200),
    "2.8MiB": (EMBEDDING_SHAPE, 100),
    "64MiB": ((32 * 1024, 1024), 10),
}
WARMUP = 3
E2E_GOAL_S = 5e-3
NIXL_MEMCPY_RATIO_GOAL = 2.0


@dataclass
class Row:
    backend: str
    mode: str
    size: str
    nbytes: int
    seconds: float
    memcpy_seconds: float

    def cells(self) -> list[str]:
        gib_s = self.nbytes / self.seconds / 2**30
        return [
            self.backend,
            self.mode,
            self.size,
            f"{self.seconds * 1e3:.3f}",
            f"{gib_s:.2f}",
            f"{self.memcpy_seconds * 1e3:.3f}",
            f"{self.seconds / self.memcpy_seconds:.2f}x",
        ]


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(WARMUP + repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP:])


def make_agent(backend: str) -> TransferAgent:
    if backend == "nixl":
        from mmserve.transfer.nixl_backend import NixlTransferAgent

        return NixlTransferAgent(inline_threshold=0)
    if backend == "shm":
        from mmserve.transfer.shm_backend import ShmTransferAgent

        return ShmTransferAgent(inline_threshold=0)
    from mmserve.transfer.inline import InlineTransferAgent

    return InlineTransferAgent()


async def measure_read(
    agent: TransferAgent, probe: ProbeProcess, tensor: torch.Tensor, repeats: int
) -> tuple[float, float]:
    """(median fetch time at the probe, median end-to-end time here)."""
    fetch_times, e2e_times = [], []
    for _ in range(WARMUP + repeats):
        start = time.perf_counter()
        handle, lease = await agent.offer(tensor)
        reply = await probe.fetch([handle], check=False)
        await lease.wait()
        e2e_times.append(time.perf_counter() - start)
        fetch_times.extend(reply.seconds)
    return statistics.median(fetch_times[WARMUP:]), statistics.median(e2e_times[WARMUP:])


async def measure_write(
    agent: TransferAgent, probe: ProbeProcess, tensor: torch.Tensor, repeats: int
) -> float:
    """Median `write()` time at the probe."""
    write_times = []
    for seed in range(WARMUP + repeats):
        landing = await agent.offer_destination(tensor.shape, tensor.dtype)
        reply = await probe.write([landing.handle], seed)
        await landing.receive()
        write_times.extend(reply.seconds)
    return statistics.median(write_times[WARMUP:])


async def bench_backend(
    backend: str, nats_url: str, scale: float, memcpy: dict[str, float]
) -> list[Row]:
    rows = []
    probe = await ProbeProcess.start(
        nats_url,
        f"bench.transfer.{os.getpid()}.{backend}",
        [f"--transfer={backend}", "--transfer-inline-threshold=0"]
        if backend != "inline"
        else ["--transfer=inline"],
    )
    try:
        async with make_agent(backend) as agent:
            for size, (shape, repeats) in SIZES.items():
                tensor = torch.randn(shape).to(torch.bfloat16)
                nbytes = tensor.numel() * tensor.element_size()
                if backend == "inline" and nbytes > MAX_INLINE_BYTES:
                    continue
                count = max(3, int(repeats * scale))
                fetch_s, e2e_s = await measure_read(agent, probe, tensor, count)
                rows.append(Row(backend, "read", size, nbytes, fetch_s, memcpy[size]))
                if backend != "inline":
                    write_s = await measure_write(agent, probe, tensor, count)
                    rows.append(Row(backend, "write", size, nbytes, write_s, memcpy[size]))
                rows.append(Row(backend, "e2e read", size, nbytes, e2e_s, memcpy[size]))
    finally:
        await probe.stop()
    return rows


def print_table(rows: list[Row]) -> None:
    header = ["backend", "mode", "size", "median ms", "GiB/s", "memcpy ms", "vs memcpy"]
    table = [header, *(row.cells() for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for index, line in enumerate(table):
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)))
        if index == 0:
            print("  ".join("-" * width for width in widths))


def print_goals(rows: list[Row]) -> None:
    found = {(row.backend, row.mode, row.size): row for row in rows}
    read_64 = found.get(("nixl", "read", "64MiB"))
    e2e = found.get(("nixl", "e2e read", "2.8MiB"))
    if read_64 is not None:
        ratio = read_64.seconds / read_64.memcpy_seconds
        verdict = "met" if ratio <= NIXL_MEMCPY_RATIO_GOAL else "MISSED"
        print(
            f"goal NIXL read 64 MiB within {NIXL_MEMCPY_RATIO_GOAL}x memcpy: {ratio:.2f}x {verdict}"
        )
    if e2e is not None:
        verdict = "met" if e2e.seconds < E2E_GOAL_S else "MISSED"
        print(f"goal NIXL 2.8 MiB end to end under 5 ms: {e2e.seconds * 1e3:.2f} ms {verdict}")


async def run(backends: list[str], scale: float) -> None:
    memcpy = {
        size: memcpy_seconds(2 * shape[0] * shape[1], max(3, int(repeats * scale)))
        for size, (shape, repeats) in SIZES.items()
    }
    rows = []
    with nats_url_from_env_or_private() as url:
        for backend in backends:
            rows.extend(await bench_backend(backend, url, scale, memcpy))
    print(f"cores: {os.cpu_count()}, torch threads: {torch.get_num_threads()}")
    print_table(rows)
    print_goals(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="nixl,shm,inline")
    parser.add_argument(
        "--repeat-scale", type=float, default=1.0, help="multiply every repeat count"
    )
    args = parser.parse_args()
    asyncio.run(run(args.backends.split(","), args.repeat_scale))


if __name__ == "__main__":
    main()
