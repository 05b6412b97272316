"""A NATS node of three killed under load: the frontend's own node, so its connection and every
call it has open go with it. In-flight requests finish or fail with a clear error within the
bound, new ones succeed within seconds (the runtime reconnects to another node), discovery
survives (its bucket has three replicas), and the node that comes back rejoins. Every request
sent gets exactly one answer, and the worker saw no more requests than were sent."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.deployment import Deployment, free_port
from tests.support.nats_cluster import NatsCluster
from tests.support.waiting import wait_until

from .conftest import Trial, metric
from .streams import BOUND_S, Outcome, chat_body, stream_chat, stream_until

MOCK = ["--engine", "mock"]  # 10 ms per decoded token
CLIENTS = 6
RECOVERY_S = 5.0  # new requests succeed this soon after the kill


def test_one_nats_node_of_three_killed_under_load(
    tmp_path_factory: pytest.TempPathFactory, trial: Trial
) -> None:
    metrics_port = free_port()
    with NatsCluster(3) as cluster:
        deployment = Deployment(
            "agg",
            build_tiny_model("qwen2_vl"),
            cluster.url,
            tmp_path_factory.mktemp("cluster-logs"),
            worker_flags=MOCK,
            components=[("worker", "worker", ["--encode", "--metrics-port", str(metrics_port)])],
        )
        with deployment.running():
            # Discovery's bucket lives on every node, so losing one loses no record.
            assert cluster.replicas("KV_mmserve_instances") == 3

            async def run() -> tuple[list[tuple[float, Outcome]], float, list[Outcome]]:
                async with httpx.AsyncClient(base_url=deployment.base_url, timeout=60) as client:
                    stop = asyncio.Event()
                    loads = [
                        asyncio.ensure_future(stream_until(client, stop, chat_body(40)))
                        for _ in range(CLIENTS)
                    ]
                    await asyncio.sleep(2.0)
                    victim = cluster.node_of(deployment.processes["frontend"].pid)
                    victim.kill()
                    killed_at = time.monotonic()
                    await asyncio.sleep(RECOVERY_S + 3.0)
                    stop.set()
                    sent = [item for load in await asyncio.gather(*loads) for item in load]
                    await asyncio.to_thread(victim.start)
                    await asyncio.to_thread(cluster.wait_healthy)
                    healed = [await stream_chat(client, chat_body(4)) for _ in range(4)]
                    return [(at - killed_at, o) for at, o in sent], killed_at, healed

            sent, killed_at, healed = asyncio.run(run())
            # Discovery survived, and the node that came back holds its copy again.
            healed_at = time.monotonic()
            wait_until(
                lambda: cluster.replicas("KV_mmserve_instances", current=True) == 3,
                timeout=30,
                what="the restarted node's copy of the discovery bucket",
            )
            caught_up = time.monotonic() - healed_at
            received = metric(metrics_port, "mmserve_requests_total", 'component="worker"')

    # In flight at the kill: finished, or failed with a typed error, within the bound.
    in_flight = [o for at, o in sent if at < 0 < o.ended_at - killed_at]
    assert in_flight, "no request was in flight at the kill"
    assert all(o.finished or o.error for o in in_flight), in_flight
    assert all(o.ended_at - killed_at < BOUND_S for o in in_flight)
    failed = [o.error for o in in_flight if not o.finished]
    # After the recovery window every request succeeds.
    late = [o for at, o in sent if at > RECOVERY_S]
    assert late and all(o.finished for o in late), [o for o in late if not o.finished]
    first_ok = min(at for at, o in sent if at > 0 and o.finished)
    assert all(o.finished for o in healed), healed
    # One answer per request; none served twice.
    # (A call that failed before it reached the worker makes the count smaller, never larger.)
    assert received <= len(sent) + len(healed), (received, len(sent), len(healed))
    trial(
        "SIGKILL the frontend's NATS node (1 of 3) under 6 clients' streams",
        1,
        f"{len(sent)} requests, one answer each; of {len(in_flight)} in flight "
        f"{len(failed)} failed ({', '.join(sorted(set(filter(None, failed)))) or 'none'}); "
        f"first new success {first_ok:.1f} s after the kill; the node rejoined and its "
        f"copy of the discovery bucket caught up {caught_up:.1f} s after the cluster healed",
    )
