"""Several hosts: E/P/D with the frontend, encode, prefill and decode each on a simulated host of
its own (network namespaces, `tests/support/hosts.py`), NATS on a fifth, tensors between hosts
by NIXL over the network; the same greedy tokens as the aggregated worker on one host."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from mmserve.runtime import Runtime
from mmserve.tiny.checkpoints import build_tiny_model
from mmserve.transfer.probe import ProbeError, ProbeProcess
from mmserve.transfer.shm_backend import ShmTransferAgent
from tests.reliability.streams import BOUND_S, Outcome, chat_body, stream_chat
from tests.support import hosts as simulated
from tests.support.deployment import Deployment, spread
from tests.support.images import file_data_url, photo_like
from tests.support.transfer import NIXL_MISSING
from tests.support.waiting import wait_until, wait_until_async

pytestmark = [
    pytest.mark.skipif(bool(simulated.available()), reason=str(simulated.available())),
    pytest.mark.skipif(NIXL_MISSING, reason="nixl is not importable here"),
]
MAX_TOKENS = 10
ROLES = ("nats", "frontend", "encode", "prefill", "decode")


@pytest.fixture
def hosts() -> Iterator[dict[str, simulated.SimulatedHost]]:
    with simulated.SimulatedHosts(len(ROLES)) as made:
        yield dict(zip(ROLES, made.hosts, strict=True))


def _answers(deployment: Deployment, requests: list[list[dict[str, Any]]]) -> list[tuple]:
    def run() -> list[tuple]:
        client = openai.OpenAI(base_url=f"{deployment.base_url}/v1", api_key="unused")
        answers = []
        for messages in requests:
            response = client.chat.completions.create(
                model=deployment.model_path.name,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=MAX_TOKENS,
                temperature=0,
            )
            answers.append((response.choices[0].message.content, response.usage))
        return answers

    return deployment.client_call(run)


def test_e_p_d_on_four_hosts_gives_the_aggregated_tokens(
    hosts: dict[str, simulated.SimulatedHost], nats_url: str, tmp_path: Path
) -> None:
    model_path = build_tiny_model("qwen2_vl")
    image_path = tmp_path / "large.jpg"
    photo_like(1280, 960, 5).save(image_path, quality=90)
    image = {"type": "image_url", "image_url": {"url": file_data_url(image_path)}}
    requests: list[list[dict[str, Any]]] = [
        [{"role": "user", "content": "Say something about the weather."}],
        [{"role": "user", "content": [image, {"type": "text", "text": "What is in it?"}]}],
    ]
    with Deployment("agg", model_path, nats_url, tmp_path).running() as agg:
        expected = _answers(agg, requests)

    nats, url = simulated.start_nats(hosts["nats"], str(tmp_path / "nats.log"))
    try:
        deployment = Deployment("e_p_d", model_path, url, tmp_path)
        spread_out = spread(deployment, {role: hosts[role] for role in ROLES[1:]})
        with spread_out.running():
            encode_received = hosts["encode"].received_bytes()
            assert _answers(spread_out, requests) == expected
            # The image's bytes went from the frontend's host to the encoder's over the
            # network: NATS carries only the plan and the handles.
            received = hosts["encode"].received_bytes() - encode_received
            assert received > image_path.stat().st_size, received
    finally:
        nats.terminate()
        nats.wait(timeout=20)


def test_shared_memory_is_refused_across_hosts(
    hosts: dict[str, simulated.SimulatedHost], tmp_path: Path
) -> None:
    """Simulated hosts share /dev/shm, so a shm read would even work there: it is refused, with
    the way out in the error, so that what passes here cannot break on separate machines."""
    nats, url = simulated.start_nats(hosts["nats"], str(tmp_path / "nats.log"))

    async def scenario() -> None:
        agent = ShmTransferAgent(inline_threshold=0)
        probe = await ProbeProcess.start(
            url, "test.multihost.shm", ["--transfer=shm"], prefix=hosts["decode"].command([])
        )
        try:
            handle, _lease = await agent.offer(torch.arange(1024))
            with pytest.raises(ProbeError, match=r"another host.*use --transfer nixl"):
                await probe.fetch([handle])
        finally:
            await probe.stop()
            await agent.close()

    try:
        hosts["encode"].call(asyncio.run, scenario())
    finally:
        nats.terminate()
        nats.wait(timeout=20)


def test_nixl_picks_the_path_per_peer(
    hosts: dict[str, simulated.SimulatedHost], tmp_path: Path
) -> None:
    """One NIXL producer, a consumer on its host and one on another: the first copies from
    shared memory, the second reads through UCX over the network; both get the bytes. Each
    peer is a process on its host (UCX state made in one network namespace is not used from
    another)."""
    nats, url = simulated.start_nats(hosts["nats"], str(tmp_path / "nats.log"))

    async def scenario() -> dict[str, dict[str, int]]:
        peers = {
            where: await ProbeProcess.start(
                url,
                f"test.multihost.{where.replace(' ', '-')}",
                ["--transfer=nixl", "--transfer-inline-threshold=0"],
                prefix=host.command([]),
            )
            for where, host in (
                ("producer", hosts["encode"]),
                ("same host", hosts["encode"]),
                ("other host", hosts["decode"]),
            )
        }
        producer = peers.pop("producer")
        try:
            for seed, consumer in enumerate(peers.values()):
                handle, expected = await producer.offer((1 << 18,), torch.int32, seed)
                assert (await consumer.fetch([handle])).digests == [expected]

            async def buffers_back() -> bool:
                return (await producer.stats()).in_use == 0

            # The consumers' notifications complete the producer's leases.
            await wait_until_async(buffers_back, 10, "the producer's buffers back in its pool")
            return {where: await consumer.peer_paths() for where, consumer in peers.items()}
        finally:
            for peer in (producer, *peers.values()):
                await peer.stop()

    try:
        paths = hosts["encode"].call(asyncio.run, scenario())
    finally:
        nats.terminate()
        nats.wait(timeout=20)
    assert paths == {"same host": {"shm": 1}, "other host": {"nixl": 1}}


def _instance_ids(deployment: Deployment) -> set[str]:
    """The workers discovery lists, as seen from the frontend's host."""

    async def listed() -> set[str]:
        async with await Runtime.connect(deployment.nats_url, deployment.namespace) as runtime:
            return {r.instance_id for r in await runtime.list_instances("worker", "generate")}

    return deployment.client_call(asyncio.run, listed())


def test_a_partitioned_worker_host_leaves_and_rejoins(tmp_path: Path) -> None:
    """One of two workers' hosts is cut off: its streams move to the other worker within the
    bound (`--migration-limit`, default 3) and finish there, it leaves discovery, requests go to
    the other; after the partition heals it comes back. Every request gets exactly one answer."""
    with simulated.SimulatedHosts(4) as made:
        nats_host, frontend_host, a_host, b_host = made.hosts
        nats, url = simulated.start_nats(nats_host, str(tmp_path / "nats.log"))
        deployment = Deployment(
            "agg",
            build_tiny_model("qwen2_vl"),
            url,
            tmp_path,
            worker_flags=["--engine", "mock"],  # 10 ms per decoded token
            components=[("a", "worker", ["--encode"]), ("b", "worker", ["--encode"])],
            hosts={"frontend": frontend_host, "a": a_host, "b": b_host},
        )
        try:
            with deployment.running():
                a_id = deployment.log("a").split(" ready: instance ")[1].split(",")[0]

                async def during() -> list[Outcome]:
                    async with httpx.AsyncClient(base_url=deployment.base_url, timeout=60) as c:
                        firsts = [asyncio.Event() for _ in range(4)]
                        streams = [
                            asyncio.ensure_future(stream_chat(c, chat_body(500, f"{i}"), first))
                            for i, first in enumerate(firsts)
                        ]
                        await asyncio.gather(*(first.wait() for first in firsts))
                        made.partition(a_host)
                        return list(await asyncio.wait_for(asyncio.gather(*streams), BOUND_S))

                cut = deployment.client_call(asyncio.run, during())
                wait_until(lambda: a_id not in _instance_ids(deployment), 10, "a leaves")
                served = deployment.client_call(asyncio.run, _chats(deployment, 4))
                made.heal(a_host)
                wait_until(lambda: a_id in _instance_ids(deployment), 20, "a rejoins")
                after = deployment.client_call(asyncio.run, _chats(deployment, 4))
                frontend_log = deployment.log("frontend")
        finally:
            nats.terminate()
            nats.wait(timeout=20)
    # The streams on the cut-off host migrated: every stream finished, none with an error.
    assert all(o.finished and o.error is None for o in cut), cut
    assert f"worker {a_id} lost after" in frontend_log, frontend_log[-3000:]
    assert all(o.finished for o in served + after), served + after


async def _chats(deployment: Deployment, count: int) -> list[Outcome]:
    async with httpx.AsyncClient(base_url=deployment.base_url, timeout=60) as client:
        chats = (stream_chat(client, chat_body(4)) for _ in range(count))
        return list(await asyncio.gather(*chats))
