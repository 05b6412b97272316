"""Routing decision time of the KV router.

An 8k-token prompt with 4 images is routed over 16 workers that each hold 100k cached blocks
(16 tokens each). Every worker also holds the whole prompt, so the index walk visits all its
blocks with all 16 workers still matching: the worst case for `find_matches`. Prints the time of
each step of a decision (routing view, block hashes, index lookup, cost and pick) and of the
whole, p50 and p99 over repeated decisions.

    .venv/bin/python bench/router.py [--workers 16] [--blocks-per-worker 100000] [--repeat 2000]
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import time
from collections.abc import Callable

import numpy as np

from mmserve.protocol import KvBlock, KvStored
from mmserve.router.hashing import DEFAULT_BLOCK_SIZE, compute_seq_hashes
from mmserve.router.indexer import KvIndexer
from mmserve.router.scheduler import Router, RouteRequest, RouterMode
from mmserve.router.view import RoutingMedia, RoutingView, routing_view

IMAGE_PAD = 151655
VOCAB = 151643
BLOCKS_PER_EVENT = 64  # an engine stores a prompt in a few events, not one


def build_prompt(rng: np.random.Generator) -> tuple[list[int], list[RoutingMedia]]:
    """~8k tokens: five text segments around 4 images of 1,900 tokens each."""
    ids: list[int] = []
    media = []
    for _ in range(4):
        ids.extend(rng.integers(0, VOCAB, size=100).tolist())
        ids.append(IMAGE_PAD)
        media.append(RoutingMedia(mm_hash=int(rng.integers(0, 2**63)), token_count=1900))
    ids.extend(rng.integers(0, VOCAB, size=100).tolist())
    return ids, media


def store_sequence(indexer: KvIndexer, worker_id: str, local_hashes: list[int]) -> None:
    seq_hashes = compute_seq_hashes(local_hashes)
    parent = None
    for start in range(0, len(local_hashes), BLOCKS_PER_EVENT):
        blocks = [
            KvBlock(block_hash=s, tokens_hash=t)
            for s, t in zip(
                seq_hashes[start : start + BLOCKS_PER_EVENT],
                local_hashes[start : start + BLOCKS_PER_EVENT],
                strict=True,
            )
        ]
        indexer.apply_event(worker_id, KvStored(parent_hash=parent, blocks=blocks))
        parent = blocks[-1].block_hash


def fill_index(
    indexer: KvIndexer, workers: list[str], blocks_per_worker: int, prompt_hashes: list[int]
) -> float:
    """Every worker: the prompt, then private 512-block sequences up to its block budget.
    Returns the events applied per second."""
    rng = random.Random(1)
    events = 0
    started = time.perf_counter()
    for worker_id in workers:
        store_sequence(indexer, worker_id, prompt_hashes)
        events += -(-len(prompt_hashes) // BLOCKS_PER_EVENT)
        held = len(prompt_hashes)
        while held < blocks_per_worker:
            length = min(512, blocks_per_worker - held)
            store_sequence(indexer, worker_id, [rng.getrandbits(64) for _ in range(length)])
            events += -(-length // BLOCKS_PER_EVENT)
            held += length
    return events / (time.perf_counter() - started)


def percentiles(samples_s: list[float]) -> str:
    us = np.array(samples_s) * 1e6
    return f"p50 {np.percentile(us, 50):8.1f} us   p99 {np.percentile(us, 99):8.1f} us"


def timed(repeat: int, step: Callable[[], object]) -> list[float]:
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        step()
        samples.append(time.perf_counter() - started)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--blocks-per-worker", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    ids, media = build_prompt(rng)
    view = routing_view(ids, media, placeholder_id=IMAGE_PAD)
    prompt_hashes = view.block_hashes(DEFAULT_BLOCK_SIZE)
    workers = [f"worker-{i}" for i in range(args.workers)]

    indexer = KvIndexer()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    events_per_s = fill_index(indexer, workers, args.blocks_per_worker, prompt_hashes)
    rss_growth_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    router = Router(RouterMode.KV, indexer)
    print(
        f"index: {args.workers} workers x {indexer.num_blocks(workers[0])} blocks, "
        f"{indexer.num_nodes()} tree nodes, filled at {events_per_s:,.0f} stored events/s, "
        f"peak memory +{rss_growth_mib:,.0f} MiB"
    )
    print(f"prompt: {len(view.ids)} tokens, {len(media)} images, {len(prompt_hashes)} full blocks")

    built: list[RoutingView] = []
    hashes: list[list[int]] = []
    counter = iter(range(10**9))

    def decide() -> None:
        # One whole decision, as the frontend makes it; each is released at once so the load
        # does not grow over the run.
        request_id = f"r{next(counter)}"
        request = RouteRequest.from_view(
            request_id, routing_view(ids, media, placeholder_id=IMAGE_PAD)
        )
        router.select(request, workers)
        router.on_finish(request_id)

    steps: list[tuple[str, Callable[[], object]]] = [
        ("routing view", lambda: built.append(routing_view(ids, media, placeholder_id=IMAGE_PAD))),
        ("block hashes", lambda: hashes.append(view.block_hashes(DEFAULT_BLOCK_SIZE))),
        ("find_matches", lambda: indexer.find_matches(prompt_hashes)),
        ("whole decision", decide),
    ]
    for name, step in steps:
        timed(min(100, args.repeat), step)  # warm up
        print(f"{name:>15}: {percentiles(timed(args.repeat, step))}")
        built.clear()
        hashes.clear()
    load_1min = os.getloadavg()[0]
    print(f"machine: load average {load_1min:.1f} on {os.cpu_count()} cores (p99 counts it)")
    overlaps = indexer.find_matches(prompt_hashes)
    print(f"overlap per worker: {sorted(set(overlaps.values()))} blocks (all hold the prompt)")


if __name__ == "__main__":
    main()
