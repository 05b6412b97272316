"""The KV router: routing decision time, and a multimodal chat workload over mock workers.

Decision time: an 8k-token prompt with 4 images is routed over 16 workers that each hold 100k
cached blocks (16 tokens each). Every worker also holds the whole prompt, so the index walk
visits all its blocks with all 16 workers still matching: the worst case for `find_matches`.
Prints the time of each step of a decision (routing view, block hashes, index lookup, cost and
pick) and of the whole, p50 and p99 over repeated decisions.

Workload: multi-turn chat sessions that share a few system prompts and reuse a pool of images
(each turn resends the history, images included), run against N aggregated mock-engine workers
(real processes, a real frontend, real NATS) once per router mode (kv, round-robin, random).
Prints the prefix hit rate (cached / prompt tokens, as the responses report them) and the mean
and p99 time to first token per mode and worker count.

`--text-only` runs the same sessions without images. `--dynamo-python PYTHON` (with
`--text-only`) also runs Dynamo's own frontend (`python -m dynamo.frontend`, file discovery) and
mocker (`python -m dynamo.mocker`, its workers in one process) under that interpreter, per mode,
with the same block size, cache budget and simulated times (a mocker profile whose prefill time
is linear in the uncached tokens), and prints its rows in the same table. Dynamo's frontend
hands its mocker each image as one token, so only the text-only workload compares.

    .venv/bin/python -m bench.router [--quick] [--part decision|workload|all]
        [--workers 16] [--blocks-per-worker 100000] [--repeat 2000]
        [--workload-workers 4 16] [--sessions 48] [--turns 4]
        [--text-only [--dynamo-python /path/to/python]]
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
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from mmserve.engines.defaults import DEFAULT_CACHE_BLOCKS
from mmserve.kv.hashing import DEFAULT_BLOCK_SIZE, compute_seq_hashes
from mmserve.kv.view import RoutingView, routing_view
from mmserve.protocol import KvBlock, KvStored, PlannedMedia
from mmserve.router.indexer import KvIndexer
from mmserve.router.scheduler import Router, RouteRequest, RouterMode
from mmserve.runtime.nats_server import nats_url_from_env_or_private
from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.deployment import Deployment
from tests.support.images import photo_like

IMAGE_PAD = 151655
VOCAB = 151643
BLOCKS_PER_EVENT = 64  # an engine stores a prompt in a few events, not one


def build_prompt(rng: np.random.Generator) -> tuple[list[int], list[PlannedMedia]]:
    """~8k tokens, as planned: five text segments around 4 images of 1,900 tokens each."""
    ids: list[int] = []
    media = []
    for _ in range(4):
        ids.extend(rng.integers(0, VOCAB, size=100).tolist())
        mm_hash = int(rng.integers(0, 2**63))
        media.append(
            PlannedMedia(mm_hash=mm_hash, offset=len(ids), length=1900, grid_thw=(1, 38, 200))
        )
        ids.extend([IMAGE_PAD] * 1900)
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
    view = routing_view(ids, media)
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
        request = RouteRequest.from_view(request_id, routing_view(ids, media))
        router.select(request, workers)
        router.on_finish(request_id)

    steps: list[tuple[str, Callable[[], object]]] = [
        ("routing view", lambda: built.append(routing_view(ids, media))),
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
MAX_TOKENS = 12
WORDS = "image scene colour light shape detail object person street sky water tree".split()


@dataclass(frozen=True)
class MockCosts:
    """The mock engine's simulated times per uncached prompt token, per output token and per
    image token its vision tower computes (a cached embedding costs nothing)."""

    prefill_us_per_token: float = 200.0
    decode_ms_per_token: float = 5.0
    encode_us_per_token: float = 0.0

    def worker_flags(self) -> list[str]:
        return [
            "--engine",
            "mock",
            "--mock-prefill-us-per-token",
            f"{self.prefill_us_per_token:g}",
            "--mock-decode-ms-per-token",
            f"{self.decode_ms_per_token:g}",
            "--mock-encode-us-per-token",
            f"{self.encode_us_per_token:g}",
        ]


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
    group.add_argument("--text-only", action="store_true", help="the same sessions, no images")
    group.add_argument(
        "--dynamo-python",
        metavar="PYTHON",
        help="also run Dynamo's frontend and mocker under this interpreter (needs --text-only)",
    )


def image_data_url(seed: int, width: int = 448, height: int = 448) -> str:
    """A photo-like JPEG (256 tokens at 448x448 for Qwen2-VL) as a data URL."""
    import base64

    out = io.BytesIO()
    photo_like(width, height, seed).save(out, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()


@dataclass
class ChatWorkload:
    """Sessions of user turns: each session has one of a few system prompts (~500 tokens) and
    shows images from a shared pool, most on its first turn, some again later; each turn
    resends the whole history. `salt` makes every text and image of a run its own;
    `text_only` drops the images and keeps everything else."""

    sessions: int
    turns: int
    system_prompts: int
    images: int
    salt: int
    seed: int = 0
    text_only: bool = False
    new_image_rate: float = 0.3  # chance that a later turn shows another image
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
            # The draws do not depend on text_only, so both variants have the same sessions.
            if turn == 0 or rng.random() < self.new_image_rate:
                image = rng.randrange(self.images)
                if not self.text_only:
                    url = self.image(image)
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

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens over prompt tokens, as the responses report them."""
        return self.cached_tokens / max(self.prompt_tokens, 1)

    @property
    def ttft_mean_s(self) -> float:
        return statistics.mean(self.ttfts)

    @property
    def ttft_p99_s(self) -> float:
        ttfts = sorted(self.ttfts)
        return ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]


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


def mmserve_deployment(
    model_path: Path, nats_url: str, log_dir: Path, mode: str, workers: int, costs: MockCosts
) -> Deployment:
    """`workers` aggregated mock workers behind a frontend with `--router-mode mode`."""
    return Deployment(
        f"router-{workers}-{mode}",
        model_path,
        nats_url,
        log_dir,
        frontend_flags=["--router-mode", mode],
        worker_flags=costs.worker_flags(),
        components=[(f"worker{i}", "worker", ["--encode"]) for i in range(workers)],
    )


def measure(deployment: Deployment, workload: ChatWorkload, concurrency: int) -> Measured:
    """Starts `deployment` (fresh processes: every run starts from cold caches), runs
    `workload` against it and stops it."""
    with deployment.running():
        model = deployment.model_path.name
        return asyncio.run(run_workload(deployment.base_url, model, workload, concurrency))


# -- Dynamo's frontend and mocker on the same workload ---------------------------------------------

DYNAMO_READY_TIMEOUT_S = 120.0


def dynamo_unavailable(python: str) -> str | None:
    """Why `python` cannot run Dynamo's frontend and mocker; None when it can."""
    try:
        probe = subprocess.run(
            [python, "-c", "import dynamo.frontend, dynamo.mocker"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if probe.returncode != 0:
        lines = probe.stderr.strip().splitlines()
        return lines[-1] if lines else f"exit status {probe.returncode}"
    return None


def write_mocker_profile(path: Path, costs: MockCosts) -> None:
    """A mocker performance profile with the mock engine's times: prefill linear in the tokens
    it computes, a fixed time per decoded token whatever the batch."""
    tokens = np.arange(0, 65_537, DEFAULT_BLOCK_SIZE, dtype=np.float64)
    np.savez(
        path,
        prefill_isl=tokens,
        prefill_ttft_ms=tokens * costs.prefill_us_per_token / 1000,
        decode_active_kv_tokens=np.array([0.0, 1e7]),
        decode_context_length=np.array([1.0, 1e6]),
        decode_itl=np.full((2, 2), costs.decode_ms_per_token),
    )


@dataclass(kw_only=True)
class DynamoDeployment(Deployment):
    """Dynamo's frontend (`--router-mode mode`) and one mocker process running `num_workers`
    workers, under another interpreter, discovering each other through files in `log_dir` (no
    etcd, no NATS). Ports, logs and stopping are the mmserve deployment's."""

    python: str
    mode: str
    num_workers: int
    costs: MockCosts

    def _spawn_module(self, name: str, module: str, args: list[str]) -> None:
        env = {
            **os.environ,
            "DYN_FILE_KV": str(self.log_dir / f"{self.namespace}-discovery"),
            "HF_HUB_OFFLINE": "1",
        }
        log = open(self.log_dir / f"{self.pattern}-{name}.log", "wb")
        self.processes[name] = subprocess.Popen(
            [self.python, "-m", module, "--discovery-backend", "file", *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def start(self) -> DynamoDeployment:
        block_size = str(DEFAULT_BLOCK_SIZE)
        profile = self.log_dir / f"{self.pattern}-profile.npz"
        write_mocker_profile(profile, self.costs)
        self._spawn_module(
            "mocker",
            "dynamo.mocker",
            [
                "--model-path",
                str(self.model_path),
                "--model-name",
                self.model_path.name,
                "--endpoint",
                f"dyn://{self.namespace}.backend.generate",
                "--num-workers",
                str(self.num_workers),
                "--block-size",
                block_size,
                "--num-gpu-blocks-override",
                str(DEFAULT_CACHE_BLOCKS),
                "--planner-profile-data",
                str(profile),
            ],
        )
        self._spawn_module(
            "frontend",
            "dynamo.frontend",
            [
                "--namespace",
                self.namespace,
                "--http-host",
                "127.0.0.1",
                "--http-port",
                str(self.http_port),
                "--router-mode",
                self.mode,
                "--kv-cache-block-size",
                block_size,
            ],
        )
        return self

    def wait_ready(self) -> None:
        """Until a request comes back: the model is served, and its workers, which register
        together, are known."""
        deadline = time.monotonic() + DYNAMO_READY_TIMEOUT_S
        body = {
            "model": self.model_path.name,
            "messages": [{"role": "user", "content": "ready?"}],
            "max_tokens": 1,
        }
        while time.monotonic() < deadline:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"Dynamo's {name} exited early:\n{self.log(name)[-3000:]}")
            try:
                answer = httpx.post(f"{self.base_url}/v1/chat/completions", json=body, timeout=10)
                if answer.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.pattern} not ready after {DYNAMO_READY_TIMEOUT_S}s")


def workload_benchmark(args: argparse.Namespace) -> None:
    if args.quick:
        args.workload_workers = [4]
        args.sessions = min(args.sessions, 16)
        args.turns = min(args.turns, 3)
    costs = MockCosts()
    model_path = build_tiny_model("qwen2_vl")
    log_dir = Path(tempfile.mkdtemp(prefix="mmserve-bench-router-"))
    media = "no images" if args.text_only else f"{args.images} images (448x448, 256 tokens)"
    print(
        f"\nworkload: {args.sessions} sessions x {args.turns} turns, {args.system_prompts} "
        f"system prompts, {media}, {MAX_TOKENS} tokens out; mock engine "
        f"{costs.prefill_us_per_token:g} us/uncached prompt token, "
        f"{costs.decode_ms_per_token:g} ms/token, {DEFAULT_BLOCK_SIZE}-token blocks; logs {log_dir}"
    )
    dynamo_python = args.dynamo_python
    if dynamo_python and (reason := dynamo_unavailable(dynamo_python)):
        print(f"Dynamo skipped: {dynamo_python} cannot import its frontend and mocker ({reason})")
        dynamo_python = None
    print(
        f"{'server':>7} {'workers':>7} {'mode':>12} {'hit rate':>9} {'TTFT mean':>10} "
        f"{'TTFT p99':>9}"
    )
    with nats_url_from_env_or_private() as nats_url:
        servers: dict[str, Callable[[str, int], Deployment]] = {
            "mmserve": lambda mode, workers: mmserve_deployment(
                model_path, nats_url, log_dir, mode, workers, costs
            )
        }
        if dynamo_python:
            servers["dynamo"] = lambda mode, workers: DynamoDeployment(
                f"dynamo-{workers}-{mode}",
                model_path,
                nats_url="",  # no NATS: Dynamo's processes discover each other through files
                log_dir=log_dir,
                python=dynamo_python,
                mode=mode,
                num_workers=workers,
                costs=costs,
            )
        for workers in args.workload_workers:
            concurrency = args.concurrency or 2 * workers
            for server, deployment_for in servers.items():
                for salt, mode in enumerate(MODES):
                    workload = ChatWorkload(
                        args.sessions,
                        args.turns,
                        args.system_prompts,
                        args.images,
                        salt,
                        text_only=args.text_only,
                    )
                    measured = measure(deployment_for(mode, workers), workload, concurrency)
                    print(
                        f"{server:>7} {workers:>7} {mode:>12} {measured.hit_rate:>8.1%} "
                        f"{measured.ttft_mean_s * 1000:>8.1f}ms "
                        f"{measured.ttft_p99_s * 1000:>7.1f}ms",
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
    if args.dynamo_python and not args.text_only:
        parser.error(
            "--dynamo-python needs --text-only: Dynamo's frontend sends its mocker each "
            "image as one token, so the multimodal workload does not compare"
        )
    if args.quick:
        args.blocks_per_worker = min(args.blocks_per_worker, 20_000)
        args.repeat = min(args.repeat, 300)
    if args.part in ("decision", "all"):
        decision_benchmark(args)
    if args.part in ("workload", "all"):
        workload_benchmark(args)


if __name__ == "__main__":
    main()
