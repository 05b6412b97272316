"""Transfers whose consumer process is SIGKILLed mid-fetch, 1,000 times per backend: the
producer's buffers must all come back to its pool, and its registered memory must grow no
further than the leases alive at once need; its RSS is printed along the way.

This process is the producer. Each consumer is a process of its own, forked from a small
spawner (`--spawner`, started by this script, which imports torch and the transfer layer once
and never touches NIXL itself, so its children start their agents cleanly): the child starts
its transfer agent and says so; the producer then offers a tensor (64 KiB, 256 KiB or 1 MiB,
in turn) and hands over the handle; the child starts fetching and the spawner SIGKILLs it
0-3 ms later. Then the lease either completed (the data got there first) or times out
(`--lease-timeout`). The first `--warmup` kills fill the pool; RSS and pool figures are read
after them and every `--report-every` kills after that. Prints markdown.

    .venv/bin/python -m bench.transfer_faults [--backends nixl,shm] [--faults 1000]
        [--spawners 4] [--lease-timeout 1.0]

Exit status 1 when a buffer did not come back, or the pool holds more buffers than the leases
alive at once ever needed (a new buffer is registered only when every one of its size class is
in use: at most the peak in use, per size class).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from load import rss_mib

from mmserve.protocol import TensorHandle, TransferPoolStats, decode, encode
from mmserve.transfer import (
    TransferAgent,
    TransferTimeout,
    add_transfer_arguments,
    create_transfer_agent,
)
from mmserve.transfer.probe import seeded_pattern

SIZES = (64 << 10, 256 << 10, 1 << 20)
KILL_DELAYS_S = (0.0, 0.001, 0.002, 0.003)
READY, COMPLETED, KILLED = b"ready", b"completed", b"killed"


def make_agent(backend: str, lease_timeout_s: float) -> TransferAgent:
    """The agent a worker would build from `--transfer` flags; every tensor goes by buffer."""
    parser = argparse.ArgumentParser()
    add_transfer_arguments(parser)
    flags = [f"--transfer={backend}", "--transfer-inline-threshold=0"]
    return create_transfer_agent(
        parser.parse_args([*flags, f"--transfer-timeout={lease_timeout_s}"])
    )


# -- the spawner and its children ---------------------------------------------------------


def consumer_child(backend: str, handles: int, status: int) -> None:
    """Start an agent, say ready, read one handle, fetch it, say completed (if still alive)."""

    async def run() -> None:
        agent = make_agent(backend, 30.0)
        os.write(status, READY)
        with os.fdopen(handles, "rb") as stream:
            handle = decode(stream.read(), TensorHandle)
        await agent.fetch(handle)
        os.write(status, COMPLETED)

    asyncio.run(run())


def spawner(backend: str) -> None:
    """One consumer at a time: fork it, forward it the producer's handle (one hex line on
    stdin), SIGKILL it the given delay after it started fetching, answer how it ended."""
    for line in sys.stdin:
        delay_s = float(line)
        from_parent, to_child = os.pipe()
        from_child, to_parent = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(to_child)
            os.close(from_child)
            consumer_child(backend, from_parent, to_parent)
            os._exit(0)
        os.close(from_parent)
        os.close(to_parent)
        if os.read(from_child, len(READY)) != READY:
            raise SystemExit(f"consumer {pid} died before it was ready")
        print(READY.decode(), flush=True)
        handle = bytes.fromhex(sys.stdin.readline())
        os.write(to_child, handle)
        os.close(to_child)  # the child reads to the end: it starts fetching now
        time.sleep(delay_s)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        said = os.read(from_child, 64)
        os.close(from_child)
        print((COMPLETED if COMPLETED in said else KILLED).decode(), flush=True)


# -- the producer ---------------------------------------------------------------------------


@dataclass
class Tally:
    endings: Counter[str] = field(default_factory=Counter)
    said: Counter[str] = field(default_factory=Counter)
    kills: int = 0
    peak_in_use: int = 0


async def one_fault(
    agent: TransferAgent, process: asyncio.subprocess.Process, index: int, tally: Tally
) -> asyncio.Task[None]:
    """One consumer killed mid-fetch; returns the task that waits for the lease's end."""
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(f"{KILL_DELAYS_S[index % len(KILL_DELAYS_S)]}\n".encode())
    await process.stdin.drain()
    if (await process.stdout.readline()).strip() != READY:
        raise RuntimeError("the spawner stopped")
    tensor = seeded_pattern((SIZES[index % len(SIZES)],), torch.uint8, index)
    handle, lease = await agent.offer(tensor)
    tally.peak_in_use = max(tally.peak_in_use, agent.stats().in_use)
    process.stdin.write(encode(handle).hex().encode() + b"\n")
    await process.stdin.drain()
    tally.said[(await process.stdout.readline()).strip().decode()] += 1
    tally.kills += 1

    async def ending() -> None:
        try:
            await lease.wait()
            tally.endings["completed"] += 1
        except TransferTimeout:
            tally.endings["timed out"] += 1

    return asyncio.create_task(ending())


async def run_backend(backend: str, args: argparse.Namespace) -> bool:
    agent = make_agent(backend, args.lease_timeout)
    spawners = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--spawner",
            backend,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        for _ in range(args.spawners)
    ]
    tally = Tally()
    indices = iter(range(args.warmup + args.faults))
    endings: list[asyncio.Task[None]] = []
    rows: list[tuple[str, TransferPoolStats, float]] = []

    async def drive(process: asyncio.subprocess.Process) -> None:
        for index in indices:
            endings.append(await one_fault(agent, process, index, tally))
            done = tally.kills - args.warmup
            if done >= 0 and done % args.report_every == 0:
                rows.append((str(done), agent.stats(), rss_mib(os.getpid())))

    started = time.monotonic()
    try:
        await asyncio.gather(*(drive(process) for process in spawners))
        await asyncio.gather(*endings)
    finally:
        for process in spawners:
            process.stdin.close()  # type: ignore[union-attr]
            await process.wait()
    elapsed = time.monotonic() - started
    stats = agent.stats()
    rows.append(("every lease ended", stats, rss_mib(os.getpid())))
    await agent.close()

    print(f"\n### {backend}: {args.faults} consumers killed after a warm-up of {args.warmup}\n")
    print("| kills after warm-up | buffers | registered | registrations | in use | RSS |")
    print("| --- | --- | --- | --- | --- | --- |")
    for done, pool, rss in rows:
        print(
            f"| {done} | {pool.buffers} | {pool.registered_bytes / 2**20:.2f} MiB | "
            f"{pool.registrations} | {pool.in_use} | {rss:.0f} MiB |"
        )
    print(
        f"\nleases: {dict(tally.endings)}; consumers: {dict(tally.said)}; "
        f"{elapsed:.0f} s ({tally.kills / elapsed:.1f} kills/s); at most "
        f"{tally.peak_in_use} buffers in use at once"
    )
    return stats.in_use == 0 and stats.buffers <= tally.peak_in_use * len(SIZES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="nixl,shm")
    parser.add_argument("--faults", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=60)
    parser.add_argument("--spawners", type=int, default=4, help="consumers alive at once")
    parser.add_argument("--lease-timeout", type=float, default=1.0, metavar="S")
    parser.add_argument("--report-every", type=int, default=250)
    parser.add_argument("--spawner", metavar="BACKEND", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.spawner:
        spawner(args.spawner)
        return
    ok = [asyncio.run(run_backend(backend, args)) for backend in args.backends.split(",")]
    sys.exit(0 if all(ok) else 1)


if __name__ == "__main__":
    main()
