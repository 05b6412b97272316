"""The resumed stream's gap: how long a client waits for its next token when the worker serving
its stream is lost, beside the fault-free inter-token latency.

It starts a pattern with two instances of each language role (one process per component, a
private nats-server, the tiny Qwen2-VL), sends `--streams` concurrent streamed chat requests
with an image (`--tokens` each), and once most have `--cut` tokens deals `--fault` to the worker
serving most of them:

- `drain`: SIGTERM to workers started with `--drain-timeout 0`: the stream is cut at once, so
  its gap is the migration itself (the cut reaching the frontend, one routing decision, the
  prefill of the prompt and the tokens so far, the first new token);
- `kill`: SIGKILL: the gap also holds the time the frontend takes to learn of the loss (the
  worker's heartbeats stop, NATS says its connection is gone: about 2.5 s).

Each round starts the worker again. It prints, per fault, the gap of every stream that
migrated (the frontend's log names them) and the inter-token latency of every other pair of
tokens: p50 and max, and the gap's p50 over the latency's p50.

    .venv/bin/python -m bench.migration --pattern agg --fault drain --rounds 3
    .venv/bin/python -m bench.migration --pattern e_p_d --engine mock --fault kill
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from mmserve.runtime.nats_server import NatsServer
from mmserve.tiny.checkpoints import build_tiny_model
from tests.reliability.conftest import metric, restart_worker
from tests.reliability.migration import MODEL, PATTERNS, image_server, messages
from tests.support.deployment import Deployment, free_port
from tests.support.waiting import wait_until_async


async def stream(
    client: httpx.AsyncClient, images: str, i: int, tokens: int, arrivals: list[float]
) -> str:
    """Stream `i` read to its end, each token's arrival time in `arrivals`: its id."""
    body = {
        "model": MODEL,
        "messages": messages(images, i),
        "max_tokens": tokens,
        "min_tokens": tokens,
        "temperature": 0,
        "stream": True,
    }
    request_id = ""
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            request_id = event["id"]
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                arrivals.append(time.perf_counter())
    return request_id


def busiest(deployment: Deployment, ports: dict[str, int], names: tuple[str, ...]) -> str:
    def active(name: str) -> float:
        role = next(role for n, role, _ in deployment.workers if n == name)
        return metric(ports[name], "mmserve_active_requests", f'component="{role}"')

    return max(names, key=active)


async def one_round(
    deployment: Deployment,
    ports: dict[str, int],
    args: argparse.Namespace,
    images: str,
) -> tuple[list[float], list[float], str]:
    """The gaps of the streams that migrated, the other inter-token latencies, the worker."""
    arrivals: list[list[float]] = [[] for _ in range(args.streams)]
    async with httpx.AsyncClient(base_url=deployment.base_url, timeout=300) as client:
        tasks = [
            asyncio.ensure_future(stream(client, images, i, args.tokens, arrivals[i]))
            for i in range(args.streams)
        ]
        await wait_until_async(lambda: min(map(len, arrivals)) > 0, 300, "first tokens", 0.005)
        victim = await asyncio.to_thread(
            busiest, deployment, ports, PATTERNS[args.pattern].streaming
        )
        await wait_until_async(
            lambda: sorted(map(len, arrivals))[args.streams // 2] >= args.cut, 300, "the cut", 0.005
        )
        fault = signal.SIGKILL if args.fault == "kill" else signal.SIGTERM
        deployment.processes[victim].send_signal(fault)
        hit = time.perf_counter()
        ids = await asyncio.gather(*tasks)
    migrated = set(re.findall(r"request (\S+): \S+ \S+ lost", deployment.log("frontend")))
    gaps, latencies = [], []
    for request_id, times in zip(ids, arrivals, strict=True):
        pairs = list(itertools.pairwise(times))
        across = [(a, b) for a, b in pairs if a <= hit < b]
        if request_id in migrated and across:
            gaps.append(across[0][1] - across[0][0])
            pairs.remove(across[0])
        latencies += [b - a for a, b in pairs]
    await asyncio.to_thread(deployment.processes[victim].wait, 60)
    await asyncio.to_thread(restart_worker, deployment, victim)
    return gaps, latencies, victim


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pattern", choices=sorted(PATTERNS), default="agg")
    parser.add_argument("--engine", choices=("hf", "mock"), default="hf")
    parser.add_argument("--fault", choices=("drain", "kill"), default="drain")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--cut", type=int, default=16, help="tokens most streams have first")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engine = ["--engine", args.engine] + (["--drain-timeout", "0"] if args.fault == "drain" else [])
    spec = PATTERNS[args.pattern]
    ports = {name: free_port() for name, _, _ in spec.components}
    gaps: list[float] = []
    latencies: list[float] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        NatsServer() as nats,
        image_server(Path(tmp)) as images,
    ):
        deployment = Deployment(
            args.pattern,
            build_tiny_model("qwen2_vl"),
            nats.url,
            Path(tmp),
            worker_flags=engine,
            components=[
                (name, role, [*flags, "--metrics-port", str(ports[name])])
                for name, role, flags in spec.components
            ],
        )
        with deployment.running():
            for index in range(args.rounds):
                found, other, victim = asyncio.run(one_round(deployment, ports, args, images))
                gaps += found
                latencies += other
                print(f"round {index + 1}: {args.fault} {victim}: {len(found)} streams migrated")
    if not gaps:
        raise SystemExit("no stream migrated")
    gap, itl = statistics.median(gaps), statistics.median(latencies)
    print(f"\n`python -m bench.migration {' '.join(sys.argv[1:])}`\n")
    print("| fault | streams migrated | gap p50 | gap max | ITL p50 | ITL max | gap / ITL |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(
        f"| {args.fault} | {len(gaps)} | {gap * 1e3:.0f} ms | {max(gaps) * 1e3:.0f} ms "
        f"| {itl * 1e3:.1f} ms | {max(latencies) * 1e3:.0f} ms | {gap / itl:.1f}x |"
    )


if __name__ == "__main__":
    main()
