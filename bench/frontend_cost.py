"""The frontend's cost per request on the benchmark clients' workloads, against one deployment
pattern with the mock engine and no simulated compute, on loopback.

Workloads, each bounded by `--max-requests` (or `--image-requests`) and `--duration`:

- `text`: N unique prompts of about `--prompt-tokens` tokens, 1 output token (`max_tokens` 1,
  `ignore_eos`), `--concurrency` streams;
- `text-repeat`: the same prompts sent a second time, in the same order;
- `chat-turns`: conversations of 4 turns, N/4 of them, each opening with one such prompt, then
  three short follow-up questions, every turn resending the whole history with a short answer
  per turn (as a chat client does); all first turns, then all second turns, and so on;
- `image-512-data`, `image-512-http`: one 512x512 JPEG per request, as a data URL and as an
  http URL on a loopback file server, `--image-concurrency` streams;
- `image-1280x960-data`, `image-1280x960-http`: the same with a 1280x960 JPEG;
- `aiperf-text`: `text`'s shape (`--max-requests` synthetic prompts of `--prompt-tokens`
  tokens, 1 output token, `--concurrency` streams) sent by aiperf, NVIDIA's benchmark client
  (`.venv/aiperf`), as Dynamo's frontend is measured; its own report gives the rate and TTFT.

Every image is distinct (one per request). A request fails when its status is not 200 or its
stream does not end in one finish reason then `[DONE]`. TTFT is taken at the first event that
carries a choice (a 1-token completion may have empty content). Prints, per workload, the
requests, failures, TTFT p50/p99, and the CPU time per request of the frontend and of all
server processes (frontend, workers, nats-server), as markdown. `--dynamo-python PYTHON` also
runs every workload against Dynamo's frontend and mocker (`bench.router.DynamoDeployment`: file
discovery, one mocker worker with zero simulated time) under that interpreter, one row each.
Each `--variant "NAME=VALUE ... --flag value"` adds one more mmserve deployment whose frontend
has those variables set and flags added (e.g. `MMSERVE_FRONTEND_MALLOC=system`, or
`--router-mode round-robin` beside the kv default), one row each. mmserve's frontends start as
the `mmserve frontend` command starts (their own interpreter, which preloads the allocator),
not forked from the tests' preloaded interpreter. `--router-mode` sets both servers' mode;
`default` leaves each its own (mmserve kv, Dynamo round-robin).

    .venv/bin/python -m bench.frontend_cost
    .venv/bin/python -m bench.frontend_cost --workloads text,image-1280x960-data \\
        --py-spy /tmp/profiles --py-spy-seconds 20

With `--py-spy DIR` each workload also runs `py-spy record` on the frontend (speedscope JSON in
DIR, one file per workload); the sampler takes CPU of its own, so take the CPU figures from a run
without it. Each workload also prints the CPU of each frontend thread (from /proc): py-spy
counts some waiting threads as busy. `--summarize FILE [--thread NAME]` prints a speedscope
profile's top functions by self and total time; `--micro` times the text path's pieces in this
process.

Exit status 1 when a request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextlib
import io
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import uvloop
from PIL import Image

from bench.load import cpu_s, percentile, read_stream, run_streams
from bench.router import DynamoDeployment, MockCosts, dynamo_unavailable
from mmserve.frontend.cli import raise_open_file_limit
from mmserve.runtime.nats_server import NatsServer
from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.aiperf import offline_hub, run_aiperf
from tests.support.deployment import PATTERNS, Deployment, serve_directory

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
MAX_DURATION_S = 300.0  # per workload
ZERO_COMPUTE = [
    "--mock-prefill-us-per-token", "0",
    "--mock-decode-ms-per-token", "0",
    "--mock-encode-us-per-token", "0",
]  # fmt: skip
CHAT_TURNS = 4  # per conversation of the chat-turns workload
IMAGE_SIZES = {"512": (512, 512), "1280x960": (1280, 960)}
WORKLOADS = [
    "text",
    "text-repeat",
    "chat-turns",
    "image-512-data",
    "image-512-http",
    "image-1280x960-data",
    "image-1280x960-http",
    "aiperf-text",
]
WORDS = (
    "the of and to in is was that for it with as his on be at by had not are but from or have "
    "an they which one you were her all she there would their we him been has when who will more "
    "no if out so said what up its about into than them can only other new some could time these "
    "two may then do first any my now such like our over man me even most made after also did "
    "many before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old year"
).split()


@dataclass
class Outcome:
    """Per-request outcomes of one workload."""

    complete: int = 0
    failed: collections.Counter[str] = field(default_factory=collections.Counter)
    ttft: list[float] = field(default_factory=list)
    loop_lag: list[float] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.complete + sum(self.failed.values())


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each of a process's threads, by "tid name" (the name Linux knows, which
    py-spy's thread ids match)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            # utime and stime, as in bench.load.cpu_s, but of the thread (/proc/TID/stat is the
            # whole process's).
            fields = (task / "stat").read_text().rpartition(")")[2].split()
            out[f"{task.name} {name}"] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
        except (FileNotFoundError, ProcessLookupError):
            pass  # the thread ended
    return out


def make_prompts(tokenizer_path: Path, count: int, tokens: int) -> list[str]:
    """`count` distinct prompts of about `tokens` tokens each (their first words differ)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    rng = np.random.default_rng(0)
    # English words here are about one token each; calibrate on one prompt.
    sample = " ".join(rng.choice(WORDS, size=tokens))
    per_word = len(tokenizer.encode(sample, add_special_tokens=False).ids) / tokens
    words = max(1, round(tokens / per_word))
    return [
        f"Request {i}: " + " ".join(rng.choice(WORDS, size=words)) + "\nSummarize."
        for i in range(count)
    ]


def make_jpegs(size: tuple[int, int], count: int) -> list[bytes]:
    """`count` distinct JPEGs of `size` (width, height): a smooth picture with some noise, so
    the files are about a photo's size rather than pure noise's."""
    width, height = size
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack(
        [(x * 255 // width), (y * 255 // height), ((x + y) * 127 // (width + height))], -1
    )
    images = []
    for seed in range(count):
        rng = np.random.default_rng(seed)
        noise = rng.integers(-24, 25, size=base.shape)
        pixels = np.clip(base + noise + seed % 64, 0, 255).astype(np.uint8)
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, format="JPEG", quality=85)
        images.append(out.getvalue())
    return images


def text_body(model: str, prompt: str | list[dict]) -> dict:
    """A streamed 1-token request of one user message, or of a whole conversation."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return {
        "model": model,
        "stream": True,
        "max_tokens": 1,
        "ignore_eos": True,
        "messages": messages,
    }


def conversations(prompts: list[str], turns: int, follow_up: list[str]) -> list[list[dict]]:
    """Each of `len(prompts) // turns` conversations opens with one of `prompts`, then asks
    `turns - 1` short follow-ups, resending its history (with a short answer per turn) each
    time, as a chat client does. Ordered turn by turn: every first turn, then every second."""
    sessions = prompts[: max(1, len(prompts) // turns)]
    out: list[list[dict]] = []
    for turn in range(turns):
        for opening in sessions:
            history: list[dict] = [{"role": "user", "content": opening}]
            for k in range(turn):
                history.append({"role": "assistant", "content": f"Answer {k}: {follow_up[k]}"})
                history.append({"role": "user", "content": f"Question {k + 1}: {follow_up[k]}?"})
            out.append(history)
    return out


def image_body(model: str, url: str) -> dict:
    return {
        "model": model,
        "stream": True,
        "max_tokens": 1,
        "ignore_eos": True,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Describe the picture."},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
    }


async def one_request(client: httpx.AsyncClient, body: dict, outcome: Outcome) -> None:
    started = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                outcome.failed[f"status {response.status_code}"] += 1
                return
            end = await read_stream(response, started)
    except httpx.HTTPError as err:
        outcome.failed[f"transport {type(err).__name__}"] += 1
        return
    if end.complete:
        outcome.complete += 1
        if end.first_s is not None:
            outcome.ttft.append(end.first_s)
    elif end.errors:
        outcome.failed["error event"] += 1
    else:
        outcome.failed["incomplete stream"] += 1


async def run_workload(
    base_url: str, bodies: list[dict], concurrency: int, duration_s: float
) -> tuple[Outcome, float]:
    """Sends `bodies` in order, `concurrency` at a time, until they run out or time is up."""
    outcome = Outcome()
    issued = 0
    stop_at = time.monotonic() + duration_s
    timeout = httpx.Timeout(120.0, connect=30.0)

    async def loop(client: httpx.AsyncClient) -> None:
        nonlocal issued
        while time.monotonic() < stop_at and issued < len(bodies):
            body = bodies[issued]
            issued += 1
            await one_request(client, body, outcome)

    elapsed = await run_streams(base_url, concurrency, timeout, loop, outcome.loop_lag)
    return outcome, elapsed


def run_aiperf_workload(
    base_url: str, model_path: Path, requests: int, tokens: int, concurrency: int, out: Path
) -> tuple[Outcome, float]:
    """`aiperf-text`: aiperf streams `requests` synthetic prompts of `tokens` tokens with one
    output token, `concurrency` at a time. The outcome's TTFT holds aiperf's p50 and p99."""
    report = run_aiperf(
        base_url,
        model_path.name,
        offline_hub(model_path, out / "hub"),
        out / "aiperf",
        [
            "--streaming", "--concurrency", str(concurrency), "--request-count", str(requests),
            "--synthetic-input-tokens-mean", str(tokens), "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", "1", "--output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--random-seed", "0",
        ],
    )  # fmt: skip
    count = int(report["request_count"]["avg"])
    errors = sum(int(error.get("count", 1)) for error in report["error_summary"])
    outcome = Outcome(complete=count - errors)
    if errors:
        outcome.failed["aiperf errors"] = errors
    ttft = report["time_to_first_token"]
    outcome.ttft = [ttft["p50"] / 1e3, ttft["p99"] / 1e3]  # its milliseconds, as seconds
    return outcome, count / report["request_throughput"]["avg"]


def summarize(path: Path, top: int, thread_filter: str = "") -> None:
    """A speedscope profile's (py-spy's) top functions by self and by total time, over the
    threads whose name contains `thread_filter` (all by default), as shares of their samples."""
    profile = json.loads(path.read_text())
    frames = profile["shared"]["frames"]
    self_w: collections.Counter[str] = collections.Counter()
    total_w: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    all_w = 0.0
    for thread in profile["profiles"]:
        if thread_filter not in thread["name"]:
            continue
        for stack, weight in zip(thread["samples"], thread["weights"], strict=True):
            all_w += weight
            threads[thread["name"].split(" ")[0] + " " + thread["name"].split(" ")[-1]] += weight
            names = [
                f"{frames[i]['name']} ({Path(frames[i].get('file', '?')).name}"
                f":{frames[i].get('line', '?')})"
                for i in stack
            ]
            if names:
                self_w[names[-1]] += weight
            for name in set(names):
                total_w[name] += weight
    print(f"{path.name}: {all_w:.0f} samples")
    for name, weight in threads.most_common(6):
        print(f"  thread {name}: {weight / all_w:.0%}")
    print("| self | function |\n| --- | --- |")
    for name, weight in self_w.most_common(top):
        print(f"| {weight / all_w:.1%} | `{name}` |")
    print("| total | function |\n| --- | --- |")
    for name, weight in total_w.most_common(top):
        print(f"| {weight / all_w:.1%} | `{name}` |")


def micro(model_path: Path, count: int, tokens: int) -> None:
    """CPU per call of the text path's pieces in this process, on the workload's prompts: the
    chat template, tokenization, the request plan (with and without its thread hop)."""
    import msgspec

    from mmserve import _mm, media
    from mmserve.frontend.chat import ServedModel
    from mmserve.media.calls import _fetch_options, _plan
    from mmserve.protocol import ChatCompletionRequest

    served = ServedModel.load(model_path)
    tokenizer = served.tokenizer
    prompts = make_prompts(model_path / "tokenizer.json", count, tokens)
    messages = [[{"role": "user", "content": p}] for p in prompts]
    texts = [
        tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
        for m in messages
    ]
    ids = [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    bodies = [msgspec.json.encode(text_body(served.name, p)) for p in prompts]
    policy = media.MediaPolicy(allowed_domains=frozenset({"127.0.0.1"}))
    options = _fetch_options(policy)
    core = served.spec.core
    output = _mm.process(core, ids[0], [], count_only=True, keep_bytes=True, **options)

    def per_call(label: str, call: object) -> None:
        started = time.process_time()
        for i in range(count):
            call(i)  # type: ignore[operator]
        print(f"| {label} | {(time.process_time() - started) / count * 1e3:.3f} ms |")

    print(f"| piece ({count} prompts of about {tokens} tokens) | CPU per call |\n| --- | --- |")
    per_call(
        "msgspec decode of the body",
        lambda i: msgspec.json.decode(bodies[i], type=ChatCompletionRequest),
    )
    per_call(
        "apply_chat_template",
        lambda i: tokenizer.apply_chat_template(
            messages[i], tokenize=False, add_generation_prompt=True
        ),
    )
    per_call(
        "tokenizer.encode (transformers)",
        lambda i: list(tokenizer.encode(texts[i], add_special_tokens=False)),
    )
    backend = tokenizer.backend_tokenizer
    per_call(
        "Tokenizer.encode (tokenizers, no wrapper; holds the GIL)",
        lambda i: backend.encode(texts[i], add_special_tokens=False).ids,
    )
    per_call(
        "Tokenizer.encode_batch_fast (what the frontend calls)",
        lambda i: backend.encode_batch_fast([texts[i]], add_special_tokens=False)[0].ids,
    )
    per_call(
        "_mm.process, text only, no thread",
        lambda i: _mm.process(core, ids[i], [], count_only=True, keep_bytes=True, **options),
    )
    per_call("media.calls._plan of its output", lambda i: _plan(output, []))

    async def hops() -> None:
        started = time.process_time()
        for _ in range(count):
            await asyncio.to_thread(int, 1)
        hop = (time.process_time() - started) / count * 1e3
        print(f"| asyncio.to_thread round trip | {hop:.3f} ms |")
        started = time.process_time()
        for i in range(count):
            await media.plan_request(core, ids[i], [], policy, count_only=True, keep_bytes=True)
        print(
            "| media.plan_request, text only (hop, process, _plan) "
            f"| {(time.process_time() - started) / count * 1e3:.3f} ms |"
        )

    uvloop.run(hops())


@dataclass
class Server:
    """A deployment under measurement and the processes whose CPU counts."""

    name: str
    deployment: Deployment
    pids: dict[str, int]


def start_server(
    name: str, deployment: Deployment, nats_pid: int | None, warm_bodies: list[dict]
) -> Server:
    deployment.start().wait_ready()
    warm, _ = uvloop.run(run_workload(deployment.base_url, warm_bodies, 16, 60.0))
    print(f"{name} warm-up: {warm.complete}/{warm.total} complete")
    # Each component, and the nats-server (which Dynamo's file discovery does not use).
    pids = {process: p.pid for process, p in deployment.processes.items()}
    if nats_pid is not None and name.startswith("mmserve"):
        pids["nats-server"] = nats_pid
    return Server(name, deployment, pids)


def measure(server: Server, workload: str, bodies: list[dict], args: argparse.Namespace) -> tuple:
    """One workload against one server: its table row."""
    pids = server.pids
    concurrency = args.image_concurrency if workload.startswith("image") else args.concurrency
    spy = None
    if args.py_spy is not None:
        args.py_spy.mkdir(parents=True, exist_ok=True)
        slug = re.sub(r"[^\w.=-]+", "_", server.name)  # a variant's name holds paths
        spy = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "py-spy"), "record",
                "-p", str(pids["frontend"]), "-d", str(int(args.py_spy_seconds)),
                *args.py_spy_flags, "-r", "100", "--threads", "--format", "speedscope",
                "-o", str(args.py_spy / f"{slug}-{workload}.json"),
            ],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
    before = {name: cpu_s(pid) for name, pid in pids.items()}
    threads_before = thread_cpu_s(pids["frontend"])
    duration = min(args.duration, MAX_DURATION_S)
    if workload == "aiperf-text":
        outcome, elapsed = run_aiperf_workload(
            server.deployment.base_url,
            server.deployment.model_path,
            args.max_requests,
            args.prompt_tokens,
            concurrency,
            Path(tempfile.mkdtemp(prefix="aiperf-")),
        )
    else:
        outcome, elapsed = uvloop.run(
            run_workload(server.deployment.base_url, bodies, concurrency, duration)
        )
    cpu = {name: cpu_s(pid) - before[name] for name, pid in pids.items()}
    threads = thread_cpu_s(pids["frontend"])
    threads = {t: v - threads_before.get(t, 0.0) for t, v in threads.items()}
    if spy is not None:
        spy.wait(timeout=args.py_spy_seconds + 60)
    n = max(outcome.total, 1)
    print(f"{server.name} {workload}: {outcome.total} requests in {elapsed:.1f} s", flush=True)
    busiest = sorted(threads.items(), key=lambda item: -item[1])[:12]
    print(
        "  frontend threads, CPU ms/request: "
        + "; ".join(f"{t} {v / n * 1e3:.2f}" for t, v in busiest if v > 0),
        flush=True,
    )
    return (
        server.name,
        workload,
        concurrency,
        outcome.total,
        ", ".join(f"{k}: {v}" for k, v in outcome.failed.items()) or "0",
        outcome.total / elapsed,
        cpu["frontend"] / n * 1e3,
        sum(cpu.values()) / n * 1e3,
        "; ".join(f"{k} {v / n * 1e3:.2f}" for k, v in cpu.items()),
        percentile(outcome.ttft, 0.5) * 1e3,
        percentile(outcome.ttft, 0.99) * 1e3,
        max(outcome.loop_lag, default=0.0) * 1e3,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pattern", choices=sorted(PATTERNS), default="agg")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    parser.add_argument("--max-requests", type=int, default=2000, help="unique text prompts")
    parser.add_argument("--image-requests", type=int, default=300, help="per image workload")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--concurrency", type=int, default=64, help="text workloads")
    parser.add_argument("--image-concurrency", type=int, default=16)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds, per workload")
    parser.add_argument("--warmup", type=int, default=64, help="warm-up requests, text and image")
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--py-spy", type=Path, default=None, help="profile the frontend into DIR")
    parser.add_argument("--py-spy-seconds", type=float, default=20.0)
    parser.add_argument(
        "--py-spy-flags",
        type=lambda text: text.split(),
        default=[],
        help='more py-spy record flags, e.g. "--gil" (only the thread holding the GIL)',
    )
    parser.add_argument("--summarize", type=Path, default=None, help="summarize a profile, exit")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument(
        "--micro", action="store_true", help="time the text path's pieces in-process, exit"
    )
    parser.add_argument(
        "--dynamo-python",
        default=None,
        metavar="PYTHON",
        help="also run the workloads against Dynamo's frontend and mocker under this interpreter",
    )
    parser.add_argument(
        "--router-mode",
        choices=["round-robin", "kv", "default"],
        default="round-robin",
        help="both frontends' router mode, so that both do the same routing work (kv: each "
        "also indexes the workers' KV events), or `default`: each its own default, kv for "
        "mmserve and round-robin for Dynamo (default: round-robin)",
    )
    parser.add_argument("--thread", default="", help="with --summarize: only these threads")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar='"NAME=VALUE ... --flag value ..."',
        help="also run each workload against another mmserve deployment whose frontend has "
        "these variables set and these flags added (repeatable: one more deployment each), e.g. "
        '"MMSERVE_FRONTEND_MALLOC=system" or "--router-mode round-robin"',
    )
    args = parser.parse_args()
    if args.micro:
        micro(build_tiny_model("qwen2_vl"), 300, args.prompt_tokens)
        return 0
    if args.summarize is not None:
        summarize(args.summarize, args.top, args.thread)
        return 0
    workloads = args.workloads.split(",")
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}; known: {WORKLOADS}")
    dynamo_python = args.dynamo_python
    if dynamo_python and (reason := dynamo_unavailable(dynamo_python)):
        print(f"Dynamo skipped: {dynamo_python} cannot import its frontend and mocker ({reason})")
        dynamo_python = None

    modes = dict.fromkeys(("mmserve", "dynamo"), args.router_mode)
    if args.router_mode == "default":
        modes = {"mmserve": "kv", "dynamo": "round-robin"}
    raise_open_file_limit()
    model_path = build_tiny_model("qwen2_vl")
    model = model_path.name
    tokenizer = model_path / "tokenizer.json"
    prompts = make_prompts(tokenizer, args.max_requests, args.prompt_tokens)
    warm_prompts = make_prompts(tokenizer, args.warmup, args.prompt_tokens)
    warm_prompts = [f"Warm-up {p}" for p in warm_prompts]
    rows: list[tuple] = []
    with contextlib.ExitStack() as stack:
        tmp_path = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        nats = stack.enter_context(NatsServer())
        image_root = tmp_path / "images"
        image_root.mkdir()
        base, _file_server = stack.enter_context(serve_directory(image_root))
        bodies: dict[str, list[dict]] = {
            "text": [text_body(model, p) for p in prompts],
            "text-repeat": [text_body(model, p) for p in prompts],
            "aiperf-text": [],  # aiperf makes its own
            "chat-turns": [
                text_body(model, c)
                for c in conversations(
                    [f"Chat {p}" for p in prompts], CHAT_TURNS, make_prompts(tokenizer, 8, 100)
                )
            ],
        }
        for label, size in IMAGE_SIZES.items():
            if not any(w.startswith(f"image-{label}-") for w in workloads):
                continue
            jpegs = make_jpegs(size, args.image_requests)
            names = []
            for i, data in enumerate(jpegs):
                (image_root / f"{label}-{i}.jpg").write_bytes(data)
                names.append(f"{label}-{i}.jpg")
            bodies[f"image-{label}-http"] = [image_body(model, f"{base}/{n}") for n in names]
            bodies[f"image-{label}-data"] = [
                image_body(model, "data:image/jpeg;base64," + base64.b64encode(d).decode())
                for d in jpegs
            ]
            print(
                f"{label}: {len(jpegs)} JPEGs, mean {np.mean([len(d) for d in jpegs]) / 1e3:.0f} kB"
            )
        warm_jpegs = make_jpegs((320, 240), 8)
        (image_root / "warm.jpg").write_bytes(warm_jpegs[0])
        warm_bodies = [text_body(model, p) for p in warm_prompts] + [
            image_body(model, "data:image/jpeg;base64," + base64.b64encode(d).decode())
            for d in warm_jpegs
        ]
        log_dir = args.log_dir or tmp_path
        log_dir.mkdir(parents=True, exist_ok=True)

        def mmserve(variant: str, logs: Path) -> Callable[[], Deployment]:
            words = variant.split()
            # NAME=VALUE words before the first flag are the environment, the rest flags.
            env_words = list(itertools.takewhile(lambda word: not word.startswith("-"), words))
            frontend_env = dict(word.split("=", 1) for word in env_words)
            flags = words[len(env_words) :]
            logs.mkdir(exist_ok=True)
            return lambda: Deployment(
                args.pattern,
                model_path,
                nats.url,
                logs,
                worker_flags=["--engine", "mock", *ZERO_COMPUTE],
                frontend_flags=["--router-mode", modes["mmserve"], *flags],
                process_env={"frontend": frontend_env},
                unforked=frozenset({"frontend"}),
            )

        servers: dict[str, Callable[[], Deployment]] = {"mmserve": mmserve("", log_dir)}
        for i, variant in enumerate(args.variant):
            servers[f"mmserve {variant}"] = mmserve(variant, log_dir / f"variant-{i}")
        if dynamo_python:
            servers["dynamo"] = lambda: DynamoDeployment(
                "dynamo",
                model_path,
                nats.url,
                log_dir,
                python=dynamo_python,
                mode=modes["dynamo"],
                num_workers=1,
                costs=MockCosts(prefill_us_per_token=0.0, decode_ms_per_token=0.0),
            )
        launched: list[Deployment] = []
        started: list[Server] = []
        try:
            for name, make in servers.items():
                launched.append(make())
                started.append(start_server(name, launched[-1], nats.pid, warm_bodies))
            # Every server takes each workload in turn, first one then the other, so that the
            # machine's other load weighs on both alike.
            for i, workload in enumerate(workloads):
                for server in started if i % 2 == 0 else started[::-1]:
                    rows.append(measure(server, workload, bodies[workload], args))
        finally:
            for deployment in launched:
                deployment.stop()
        rows.sort(key=lambda row: (list(servers).index(row[0]), workloads.index(row[1])))
        failed_any = any(row[4] != "0" for row in rows)
    print(
        f"pattern {args.pattern}, engine mock with zero compute, router mode "
        f"{', '.join(f'{k} {v}' for k, v in modes.items())}, prompts of about "
        f"{args.prompt_tokens} tokens"
    )
    print(
        "| server | workload | c | requests | failed | req/s | frontend CPU/req "
        "| all servers CPU/req | per process (ms/req) | TTFT p50 | TTFT p99 | client loop lag max |"
    )
    print("| --- " * 12 + "|")
    for server, w, c, total, failed, rate, fe, allp, per, p50, p99, lag in rows:
        print(
            f"| {server} | {w} | {c} | {total} | {failed} | {rate:.0f} | {fe:.2f} ms "
            f"| {allp:.2f} ms | {per} | {p50:.0f} ms | {p99:.0f} ms | {lag:.0f} ms |"
        )
    return 1 if failed_any else 0


if __name__ == "__main__":
    sys.exit(main())
