"""What the preprocessing benchmarks share: a path timed in CPU time (user + system, the
median of its runs after a warm-up) in a process of its own, so that its peak RSS is its own;
and a thread pool's throughput over a batch."""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# One thread in every library a path may use.
ONE_THREAD = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "RAYON_NUM_THREADS": "1",
    "NUMBA_NUM_THREADS": "1",
}


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def median_cpu(run: Callable[[bytes], Any], data: bytes, runs: int) -> dict[str, Any]:
    """`{"ms", "rss_mib"}`: the median CPU time of `run(data)` after a warm-up (imports,
    tables), and the process's peak RSS."""
    run(data)
    times = []
    for _ in range(runs):
        start = cpu_seconds()
        run(data)
        times.append(cpu_seconds() - start)
    return {"ms": statistics.median(times) * 1e3, "rss_mib": peak_rss_mib()}


def pool_rate(run: Callable[[bytes], Any], data: bytes, threads: int, batch: int) -> dict[str, Any]:
    """`{"per_s", "rss_mib"}`: wall-clock throughput of `batch` calls from a pool of `threads`."""
    run(data)
    with ThreadPoolExecutor(threads) as pool:
        start = time.perf_counter()
        list(pool.map(run, [data] * batch))
        wall = time.perf_counter() - start
    return {"per_s": batch / wall, "rss_mib": peak_rss_mib()}


def child(module: str, args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """The JSON a benchmark module prints last when run as `--child ARGS`, one thread in
    every library unless `env` says otherwise."""
    full = dict(os.environ) | ONE_THREAD | (env or {})
    command = [sys.executable, "-m", module, "--child", *args]
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=full)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def command_cpu_ms(command: list[str], runs: int) -> float:
    """The median CPU time, in ms, of running `command` (a program's own anchor)."""
    times = []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(command, check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        times.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return statistics.median(times) * 1e3


def serve_child(
    argv: list[str],
    ours: Callable[[], Callable[[bytes], Any]],
    theirs: Callable[[str], Callable[[bytes], Any]],
) -> None:
    """Runs one measurement in this process and prints its JSON: `single PATH FILE RUNS` (the
    path "mmserve", which imports no torch, or one of `theirs`, on one torch thread) or `pool
    THREADS FILE BATCH` (mmserve's)."""
    kind, path, file, n = argv
    data = Path(file).read_bytes()
    if kind == "single" and path == "mmserve":
        result = median_cpu(ours(), data, int(n))
    elif kind == "single":
        import torch

        torch.set_num_threads(1)
        result = median_cpu(theirs(path), data, int(n))
    else:
        result = pool_rate(ours(), data, int(path), int(n))
    print(json.dumps(result))
