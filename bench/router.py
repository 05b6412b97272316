"""The KV router: routing decision time, and a multimodal chat workload over mock workers.

Decision time: an 8k-token prompt with 4 images is routed over 16 workers that each hold 100k
cached blocks (16 tokens each). Every worker also holds the whole prompt, so the index walk
visits all its blocks with all 16 workers still matching: the worst case for `find_matches`.
Prints the time of each step of a decision (routing view, block hashes, index lookup, cost and
pick) and of the whole, p50 and p99 over repeated decisions.

Workload: multi-turn chat sessions that share a few system prompts and reuse a pool of images
(each turn resends the history, images included), run against N aggregated mock-engine workers
(real processes, a real frontend, real NATS) once per router mode (kv, round-robin, random).
Prints the prefix hit rate (cached / prompt tokens, as the workers report them) and the mean
and p99 time to first token per mode and worker count.

    .venv/bin/python bench/router.py [--quick] [--part decision|workload|all]
        [--workers 16] [--blocks-per-worker 100000] [--repeat 2000]
        [--workload-workers 4 16] [--sessions 48] [--turns 4]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

from mmserve.protocol import KvBlock, KvStored
from mmserve.router.hashing import DEFAULT_BLOCK_SIZE, compute_seq_hashes
from mmserve.router.indexer import KvIndexer
from mmserve.router.scheduler import Router, RouteRequest, RouterMode
from mmserve.router.view import RoutingMedia, RoutingView, routing_view

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.deployment import Deployment  # noqa: E402

from mmserve.models.tiny import build_tiny_model  # noqa: E402
from mmserve.runtime.nats_server import nats_url_from_env_or_private  # noqa: E402

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


def decision_benchmark(args: argparse.Namespace) -> None:
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


# -- the chat workload ---------------------------------------------------------------------------

MODES = ("kv", "round-robin", "random")
MOCK_FLAGS = ["--engine", "mock", "--mock-prefill-us-per-token", "200"]
MOCK_DECODE_MS = 5
MAX_TOKENS = 12
WORDS = "image scene colour light shape detail object person street sky water tree".split()


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--workload-workers", type=int, nargs="*", default=[4, 16])
    group.add_argument("--sessions", type=int, default=48, help="chat sessions per run")
    group.add_argument("--turns", type=int, default=4, help="user turns per session")
    group.add_argument("--system-prompts", type=int, default=4, help="shared system prompts")
    group.add_argument("--images", type=int, default=12, help="images the sessions draw from")
    group.add_argument(
        "--concurrency", type=int, default=0, help="sessions at once (default: 2 per worker)"
    )


def image_data_url(seed: int, width: int = 448, height: int = 448) -> str:
    """A photo-like JPEG (256 tokens at 448x448 for Qwen2-VL) as a data URL."""
    import base64

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // (width - 1), y * 255 // (height - 1), (x * seed + y) % 256], -1)
    pixels = np.clip(base + rng.integers(-20, 21, base.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()


@dataclass
class ChatWorkload:
    """Sessions of user turns: each session has one of a few system prompts (~500 tokens) and
    shows images from a shared pool, most on its first turn, some again later; each turn
    resends the whole history. `salt` makes every text and image of a run its own."""

    sessions: int
    turns: int
    system_prompts: int
    images: int
    salt: int
    seed: int = 0
    _image_urls: dict[int, str] = field(default_factory=dict)

    def system_prompt(self, index: int) -> str:
        rules = (
            f"Rule {index}.{i}: describe each {WORDS[i % len(WORDS)]} exactly." for i in range(45)
        )
        return f"[{self.salt}] You are assistant {index}. " + " ".join(rules)

    def image(self, index: int) -> str:
        if index not in self._image_urls:
            self._image_urls[index] = image_data_url(self.salt * 1000 + index)
        return self._image_urls[index]

    def session(self, number: int) -> tuple[str, list[list[dict[str, Any]]]]:
        """The system prompt and the user contents of one session's turns."""
        rng = random.Random(self.seed * 100_003 + number)
        turns = []
        for turn in range(self.turns):
            content: list[dict[str, Any]] = []
            if turn == 0 or rng.random() < 0.3:
                url = self.image(rng.randrange(self.images))
                content.append({"type": "image_url", "image_url": {"url": url}})
            topic = " ".join(rng.choice(WORDS) for _ in range(6))
            content.append({"type": "text", "text": f"Turn {turn}: what about the {topic}?"})
            turns.append(content)
        return self.system_prompt(rng.randrange(self.system_prompts)), turns


@dataclass
class Measured:
    ttfts: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0


async def chat_turn(
    client: httpx.AsyncClient, model: str, messages: list[dict[str, Any]], measured: Measured
) -> str:
    body = {
        "model": model,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    started = time.perf_counter()
    ttft = None
    text = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - started
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
                measured.prompt_tokens += usage["prompt_tokens"]
                measured.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
            for choice in chunk["choices"]:
                text.append(choice["delta"].get("content") or "")
    assert ttft is not None, "nothing streamed"
    measured.ttfts.append(ttft)
    return "".join(text)


async def run_workload(url: str, model: str, workload: ChatWorkload, concurrency: int) -> Measured:
    measured = Measured()
    pending = list(range(workload.sessions))

    async def user(client: httpx.AsyncClient) -> None:
        while pending:
            system, turns = workload.session(pending.pop(0))
            messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
            for content in turns:
                messages.append({"role": "user", "content": content})
                answer = await chat_turn(client, model, messages, measured)
                messages.append({"role": "assistant", "content": answer})

    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        await asyncio.gather(*(user(client) for _ in range(concurrency)))
    return measured


def workload_benchmark(args: argparse.Namespace) -> None:
    if args.quick:
        args.workload_workers = [4]
        args.sessions = min(args.sessions, 16)
        args.turns = min(args.turns, 3)
    model_path = build_tiny_model("qwen2_vl")
    log_dir = Path(tempfile.mkdtemp(prefix="mmserve-bench-router-"))
    print(
        f"\nworkload: {args.sessions} sessions x {args.turns} turns, {args.system_prompts} "
        f"system prompts, {args.images} images (448x448, 256 tokens), {MAX_TOKENS} tokens out; "
        f"mock engine {MOCK_FLAGS[-1]} us/prompt token, {MOCK_DECODE_MS} ms/token; logs {log_dir}"
    )
    print(f"{'workers':>7} {'mode':>12} {'hit rate':>9} {'TTFT mean':>10} {'TTFT p99':>9}")
    with nats_url_from_env_or_private() as nats_url:
        for workers in args.workload_workers:
            concurrency = args.concurrency or 2 * workers
            for salt, mode in enumerate(MODES):
                # Fresh workers per mode: every mode starts from cold caches.
                deployment = Deployment(
                    f"router-{workers}-{mode}",
                    model_path,
                    nats_url,
                    log_dir,
                    frontend_flags=["--router-mode", mode],
                    worker_flags=[
                        *MOCK_FLAGS,
                        "--mock-decode-ms-per-token",
                        str(MOCK_DECODE_MS),
                    ],
                    components=[(f"worker{i}", "worker", ["--encode"]) for i in range(workers)],
                )
                try:
                    deployment.start().wait_ready()
                    workload = ChatWorkload(
                        args.sessions, args.turns, args.system_prompts, args.images, salt
                    )
                    measured = asyncio.run(
                        run_workload(deployment.base_url, model_path.name, workload, concurrency)
                    )
                finally:
                    deployment.stop()
                ttfts = sorted(measured.ttfts)
                p99 = ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]
                hit_rate = measured.cached_tokens / max(measured.prompt_tokens, 1)
                print(
                    f"{workers:>7} {mode:>12} {hit_rate:>8.1%} "
                    f"{statistics.mean(ttfts) * 1000:>8.1f}ms {p99 * 1000:>7.1f}ms",
                    flush=True,
                )
    load_1min = os.getloadavg()[0]
    print(f"machine: load average {load_1min:.1f} on {os.cpu_count()} cores")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["decision", "workload", "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="a smaller run of each part")
    parser.add_argument("--workers", type=int, default=16, help="decision: workers indexed")
    parser.add_argument("--blocks-per-worker", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=2000)
    add_workload_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.blocks_per_worker = min(args.blocks_per_worker, 20_000)
        args.repeat = min(args.repeat, 300)
    if args.part in ("decision", "all"):
        decision_benchmark(args)
    if args.part in ("workload", "all"):
        workload_benchmark(args)


if __name__ == "__main__":
    main()
