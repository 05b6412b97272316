"""Several hosts against one: E/P/D spread over simulated hosts (network namespaces on a bridge,
`tests/support/hosts.py`; NIXL over tcp between them) next to E/P/D on one host, and a NATS node
of three killed under load.

- ttft: streamed requests with one 1280x960 JPEG each (a new image every time, so no cache
  helps), the tiny Qwen2-VL; time to the first content token at the client, which sits on the
  frontend's host.
- transfer: a probe on another host (or the same one: from shared memory, and through UCX)
  fetches a tensor this process offers: the
  image's JPEG bytes, and the embeddings a 7B Qwen2-VL makes of it (1564 tokens x 3584, bf16).
  Time = the probe's fetch until the data is in its buffer.
- nats kill: 6 clients stream 40-token answers from an aggregated mock worker; the frontend's
  own node of a 3-node cluster is SIGKILLed, then started again: requests, errors, time to the
  first success after the kill, time until the cluster is whole again.

    sudo .venv/bin/python -m bench.multihost [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Literal

import httpx
import torch

from mmserve.runtime.nats_server import NatsServer
from mmserve.tiny.checkpoints import build_tiny_model
from mmserve.transfer.nixl_backend import NixlTransferAgent
from mmserve.transfer.probe import ProbeProcess
from tests.reliability.streams import chat_body, stream_until
from tests.support import hosts as simulated
from tests.support.deployment import Deployment, spread
from tests.support.images import file_data_url, photo_like
from tests.support.nats_cluster import NatsCluster

EMBEDDING_SHAPE = (1564, 3584)  # Qwen2-VL-7B, one 1280x960 image (grid 68 x 92, merge 2)
ROLES = ("nats", "frontend", "encode", "prefill", "decode")


async def _ttfts(deployment: Deployment, images: list[Path]) -> list[float]:
    ttfts = []
    async with httpx.AsyncClient(base_url=deployment.base_url, timeout=120) as client:
        for image in images:
            content = [
                {"type": "image_url", "image_url": {"url": file_data_url(image)}},
                {"type": "text", "text": "What is in this picture?"},
            ]
            body = {
                "model": deployment.model_path.name,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 2,
                "stream": True,
            }
            started = time.perf_counter()
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if '"content":"' in line:
                        ttfts.append(time.perf_counter() - started)
                        break
    return ttfts


def bench_ttft(work: Path, repeats: int) -> dict[str, list[float]]:
    model = build_tiny_model("qwen2_vl")
    images = []
    for seed in range(repeats + 1):  # the first warms up
        images.append(work / f"image{seed}.jpg")
        photo_like(1280, 960, 100 + seed).save(images[-1], quality=90)
    results = {}
    with NatsServer() as nats:
        one = Deployment("e_p_d", model, nats.url, work, transfer="nixl")
        with one.running():
            results["one host"] = asyncio.run(_ttfts(one, images))[1:]
    with simulated.SimulatedHosts(len(ROLES)) as made:
        hosts = dict(zip(ROLES, made.hosts, strict=True))
        nats_process, url = simulated.start_nats(hosts["nats"], str(work / "nats.log"))
        try:
            spread_out = spread(Deployment("e_p_d", model, url, work), hosts)
            with spread_out.running():
                ttfts = spread_out.client_call(asyncio.run, _ttfts(spread_out, images))
                results["4 hosts"] = ttfts[1:]
        finally:
            nats_process.terminate()
            nats_process.wait()
    return results


async def _fetch_times(
    url: str, probe_host: simulated.SimulatedHost, repeats: int, same_host: Literal["shm", "nixl"]
) -> dict:
    jpeg = work_image_bytes()
    tensors = {
        f"image bytes ({len(jpeg) / 1024:.0f} KiB)": torch.frombuffer(jpeg, dtype=torch.uint8),
        "7B embeddings (10.7 MiB)": torch.ones(EMBEDDING_SHAPE, dtype=torch.bfloat16),
    }
    agent = NixlTransferAgent(inline_threshold=0, same_host=same_host)
    probe = await ProbeProcess.start(
        url, "bench.multihost", ["--transfer=nixl"], prefix=probe_host.command([])
    )
    times: dict[str, list[float]] = {}
    try:
        for name, tensor in tensors.items():
            for _ in range(repeats + 1):
                handle, lease = await agent.offer(tensor)
                reply = await probe.fetch([handle], check=False)
                await lease.wait()
                times.setdefault(name, []).append(reply.seconds[0])
            times[name] = times[name][1:]  # the first connects the two agents
    finally:
        await probe.stop()
        await agent.close()
    return times


def work_image_bytes() -> bytearray:
    with tempfile.NamedTemporaryFile(suffix=".jpg") as file:
        photo_like(1280, 960, 7).save(file.name, quality=90)
        return bytearray(Path(file.name).read_bytes())


def bench_transfer(work: Path, repeats: int) -> dict[str, dict[str, list[float]]]:
    results = {}
    with simulated.SimulatedHosts(3) as made:
        nats_host, here, there = made.hosts
        nats_process, url = simulated.start_nats(nats_host, str(work / "nats-transfer.log"))
        # This process's agent runs on `here`'s network from a thread that joined it. On one
        # host a peer copies from shared memory (mmserve's path per peer), or, told to use UCX
        # there too, goes by cross-memory attach; UCX sees one machine, so between "hosts" it
        # is told to leave shared memory aside (as `SimulatedHost.popen` does).
        layouts: list[tuple[str, simulated.SimulatedHost, Literal["shm", "nixl"]]] = [
            ("same host", here, "shm"),
            ("same host, UCX", here, "nixl"),
            ("other host", there, "shm"),
        ]
        try:
            for name, probe_host, same_host in layouts:
                if probe_host is there:
                    os.environ["UCX_TLS"] = "^sm"
                results[name] = here.call(
                    asyncio.run, _fetch_times(url, probe_host, repeats, same_host)
                )
        finally:
            os.environ.pop("UCX_TLS", None)
            nats_process.terminate()
            nats_process.wait()
    return results


def bench_nats_kill(work: Path) -> str:
    with NatsCluster(3) as cluster:
        deployment = Deployment(
            "agg",
            build_tiny_model("qwen2_vl"),
            cluster.url,
            work,
            worker_flags=["--engine", "mock"],
        )
        with deployment.running():

            async def run() -> str:
                async with httpx.AsyncClient(base_url=deployment.base_url, timeout=60) as client:
                    stop = asyncio.Event()
                    loads = [
                        asyncio.ensure_future(stream_until(client, stop, chat_body(40)))
                        for _ in range(6)
                    ]
                    await asyncio.sleep(3.0)
                    victim = cluster.node_of(deployment.processes["frontend"].pid)
                    victim.kill()
                    killed_at = time.monotonic()
                    await asyncio.sleep(8.0)
                    stop.set()
                    sent = [item for load in await asyncio.gather(*loads) for item in load]
                    restarted = time.monotonic()
                    await asyncio.to_thread(victim.start)
                    whole = await asyncio.to_thread(cluster.wait_healthy)
                    errors = [o.error for _, o in sent if not o.finished]
                    first_ok = min(o.ended_at for at, o in sent if at > killed_at and o.finished)
                    return (
                        f"{len(sent)} requests, {len(errors)} failed ({set(errors) or 'none'}), "
                        f"first success after the kill {first_ok - killed_at:.2f} s (ended), "
                        f"cluster whole {time.monotonic() - restarted:.1f} s after the restart "
                        f"(health {whole:.1f} s)"
                    )

            return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if reason := simulated.available():
        raise SystemExit(f"bench.multihost: {reason}")
    print(
        f"cores: {os.cpu_count()}, load average: {', '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    with tempfile.TemporaryDirectory(prefix="mmserve-multihost-") as tmp:
        work = Path(tmp)
        for layout, ttfts in bench_ttft(work, args.repeats).items():
            print(
                f"ttft   E/P/D {layout:>10}: median {statistics.median(ttfts) * 1e3:7.1f} ms, "
                f"min {min(ttfts) * 1e3:7.1f} ms ({len(ttfts)} requests, 1280x960 JPEG)"
            )
        for layout, by_tensor in bench_transfer(work, 4 * args.repeats).items():
            for name, seconds in by_tensor.items():
                median = statistics.median(seconds) * 1e3
                print(
                    f"fetch  {layout:>14} {name:>26}: median {median:6.2f} ms, "
                    f"min {min(seconds) * 1e3:6.2f} ms"
                )
        print(f"nats kill: {bench_nats_kill(work)}")


if __name__ == "__main__":
    main()
