"""Faults under a live aggregated deployment with two workers on a nats-server of its own:
a worker killed mid-stream (its streams migrate to the other; with `--migration-limit 0` they
end with the error), a client that leaves mid-stream, a worker stopped with SIGTERM (drained,
and cut short by its --drain-timeout: what it cut migrates), a restarted nats-server, and last
the frontend stopped with SIGTERM. No request may hang; only the requests a fault touches may
fail."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from mmserve.runtime import Runtime
from mmserve.runtime.nats_server import NatsServer
from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.deployment import Deployment, free_port
from tests.support.waiting import wait_until_async

from .conftest import Trial, metric, restart_worker
from .streams import BOUND_S, Outcome, chat_body, started_streams, stream_chat

MOCK = ["--engine", "mock"]  # simulated timing: 10 ms per decoded token, no model compute


@dataclass
class Faulty:
    deployment: Deployment
    nats: NatsServer
    metrics_ports: dict[str, int]

    def metric(self, name: str, sample: str) -> float:
        return metric(self.metrics_ports[name], sample, 'component="worker"')

    def active(self) -> dict[str, float]:
        return {
            name: self.metric(name, "mmserve_active_requests")
            for name in self.metrics_ports
            if self.deployment.processes[name].poll() is None
        }

    async def unlisted(self, name: str) -> bool:
        """Whether worker `name` is gone from discovery."""
        async with await Runtime.connect(self.nats.url, self.deployment.namespace) as runtime:
            pids = {record.pid for record in await runtime.list_instances()}
        return self.deployment.processes[name].pid not in pids

    def active_since(self, before: dict[str, float]) -> dict[str, float]:
        """`active()` less the requests each worker had in flight at `before` (the workers
        serve every test of the module)."""
        return {name: value - before.get(name, 0.0) for name, value in self.active().items()}


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faulty]:
    ports = {"a": free_port(), "b": free_port()}
    with NatsServer() as nats:
        deployment = Deployment(
            "agg",
            build_tiny_model("qwen2_vl"),
            nats.url,
            tmp_path_factory.mktemp("fault-logs"),
            worker_flags=MOCK,
            components=[
                (name, "worker", ["--encode", "--metrics-port", str(port)])
                for name, port in ports.items()
            ],
        )
        with deployment.running():
            yield Faulty(deployment, nats, ports)


async def _served(client: httpx.AsyncClient, count: int) -> list[Outcome]:
    return list(await asyncio.gather(*(stream_chat(client, chat_body(4)) for _ in range(count))))


def migrations(faulty: Faulty, reason: str) -> float:
    """The frontend's `mmserve_migrations_total` of the workers lost for `reason`."""
    port = faulty.deployment.http_port
    return metric(port, "mmserve_migrations_total", f'reason="{reason}",role="worker"')


def test_sigkill_of_a_worker_mid_stream(faulty: Faulty, trial: Trial) -> None:
    async def run() -> tuple[list[Outcome], list[Outcome], float, float]:
        async with httpx.AsyncClient(base_url=faulty.deployment.base_url, timeout=120) as client:
            idle = faulty.active()
            before = migrations(faulty, "disconnected")
            streams = await started_streams(client, 4, 400, "story")
            on_survivor = faulty.active_since(idle)["b"]
            faulty.deployment.kill("a")
            killed_at = time.monotonic()
            # Each stream on it goes on on the other worker: all of them finish.
            outcomes = await asyncio.wait_for(asyncio.gather(*streams), BOUND_S)
            ended = max(o.ended_at for o in outcomes) - killed_at
            moved = migrations(faulty, "disconnected") - before
            assert moved == 4 - on_survivor, (moved, on_survivor)
            # New requests go to the survivor once discovery dropped the dead worker.
            later = await _served(client, 4)
            return outcomes, later, ended, on_survivor

    outcomes, later, ended, on_survivor = asyncio.run(run())
    assert all(o.finished and o.error is None for o in outcomes + later), outcomes + later
    trial(
        "SIGKILL an aggregated worker during 4 streams",
        1,
        f"the {4 - int(on_survivor)} streams on it migrated to the other worker and finished, "
        f"the last {ended:.1f} s after the kill; 4 new requests served",
    )

    restart_worker(faulty.deployment, "a")  # text only: no media policy
    before = faulty.metric("a", "mmserve_requests_total")

    async def after_restart() -> list[Outcome]:
        async with httpx.AsyncClient(base_url=faulty.deployment.base_url, timeout=120) as client:
            return await _served(client, 8)

    outcomes = asyncio.run(after_restart())
    assert all(o.finished for o in outcomes), outcomes
    rejoined = faulty.metric("a", "mmserve_requests_total") - before
    assert rejoined > 0
    trial("restart the killed worker", 1, f"it rejoined: served {int(rejoined)} of 8 requests")


def test_a_client_that_leaves_stops_generation(faulty: Faulty, trial: Trial) -> None:
    async def run() -> float:
        async with httpx.AsyncClient(base_url=faulty.deployment.base_url, timeout=120) as client:
            first = asyncio.Event()
            idle = faulty.active()
            stream = asyncio.ensure_future(stream_chat(client, chat_body(30000), first))
            await asyncio.wait_for(first.wait(), 120)
            assert sum(faulty.active_since(idle).values()) == 1
            stream.cancel()  # closes the connection mid-stream
            left_at = time.monotonic()
            await wait_until_async(
                lambda: sum(faulty.active_since(idle).values()) == 0,
                BOUND_S,
                "active back to 0",
                0.1,
            )
            return time.monotonic() - left_at

    dropped = asyncio.run(run())
    trial(
        "client disconnects mid-stream (30000 tokens asked)",
        1,
        f"the worker's active requests dropped to 0 in {dropped:.1f} s",
    )


def test_sigterm_finishes_in_flight_streams_then_exits(faulty: Faulty, trial: Trial) -> None:
    async def run() -> list[Outcome]:
        async with httpx.AsyncClient(base_url=faulty.deployment.base_url, timeout=120) as client:
            idle = faulty.active()
            streams = await started_streams(client, 2, 150, "tale")
            assert faulty.active_since(idle)["b"] >= 1
            faulty.deployment.processes["b"].send_signal(signal.SIGTERM)
            # It leaves discovery at once, while its streams still run.
            await wait_until_async(lambda: faulty.unlisted("b"), 10.0, "b to leave discovery")
            assert not all(stream.done() for stream in streams)
            outcomes = list(await asyncio.wait_for(asyncio.gather(*streams), BOUND_S))
            # Stopped taking requests: new ones go to the other worker.
            outcomes += await _served(client, 2)
            return outcomes

    outcomes = asyncio.run(run())
    assert all(o.finished and o.error is None for o in outcomes), outcomes
    code = faulty.deployment.processes["b"].wait(timeout=BOUND_S)
    assert code == 0, faulty.deployment.log("b")[-2000:]
    trial(
        "SIGTERM a worker with streams in flight",
        1,
        "it left discovery before its streams ended; they finished, later requests went to "
        "the other worker, it exited 0",
    )


def test_drain_timeout_cuts_what_is_left_and_exits(faulty: Faulty, trial: Trial) -> None:
    restart_worker(faulty.deployment, "b", ["--drain-timeout", "1"])

    async def run() -> tuple[float, float]:
        async with httpx.AsyncClient(base_url=faulty.deployment.base_url, timeout=120) as client:
            # 6000 tokens take a minute: far past the drain's second.
            idle = faulty.active()
            before = migrations(faulty, "unavailable")
            streams = await started_streams(client, 4, 6000, "epic")
            on_b = faulty.active_since(idle)["b"]
            assert on_b >= 1
            faulty.deployment.processes["b"].send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            code = await asyncio.to_thread(faulty.deployment.processes["b"].wait, BOUND_S)
            exited = time.monotonic() - signalled
            assert code == 0, faulty.deployment.log("b")[-2000:]
            # What it cut goes on on the other worker: its streams migrate, none ends.
            await wait_until_async(
                lambda: migrations(faulty, "unavailable") - before >= on_b,
                BOUND_S,
                "b's streams migrated",
            )
            assert not any(stream.done() for stream in streams)
            for stream in streams:  # a minute each: not to be read to their end
                stream.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            return exited, on_b

    exited, on_b = asyncio.run(run())
    trial(
        "SIGTERM a worker started with --drain-timeout 1 during 6000-token streams",
        1,
        f"it exited 0 after {exited:.1f} s; what it cut ({int(on_b)} of 4 streams) migrated "
        "to the other worker and went on",
    )


def test_nats_restart_under_light_load(faulty: Faulty, trial: Trial) -> None:
    async def run() -> tuple[list[Outcome], float]:
        async with httpx.AsyncClient(base_url=faulty.deployment.base_url, timeout=120) as client:
            streams = await started_streams(client, 2, 6000, "saga")
            await asyncio.to_thread(faulty.nats.restart)
            restarted_at = time.monotonic()
            in_flight = list(await asyncio.wait_for(asyncio.gather(*streams), BOUND_S))
            # Service resumes by itself: retry until one request succeeds, then all do.
            while not (await stream_chat(client, chat_body(4))).finished:
                assert time.monotonic() - restarted_at < 60, "service did not resume"
                await asyncio.sleep(0.5)
            resumed = time.monotonic() - restarted_at
            after = await _served(client, 4)
            assert all(o.finished for o in after), after
            return in_flight, resumed

    in_flight, resumed = asyncio.run(run())
    # 6000 tokens take a minute: within the bound only the failure can end them.
    assert all(o.error and not o.finished for o in in_flight), in_flight
    trial(
        "restart nats-server with 2 streams in flight",
        1,
        "both in-flight streams ended with an error event; "
        f"service resumed by itself after {resumed:.1f} s",
    )


def test_without_migration_a_killed_workers_streams_end_with_the_error(
    faulty: Faulty, trial: Trial
) -> None:
    """The frontend started again with `--migration-limit 0`: a worker killed mid-stream ends
    its streams with an error event (the other worker's finish)."""
    deployment = faulty.deployment
    frontend = deployment.processes["frontend"]
    frontend.send_signal(signal.SIGTERM)
    assert frontend.wait(timeout=BOUND_S) == 0
    deployment.start_frontend(["--migration-limit", "0"])
    restart_worker(deployment, "b")
    deployment.wait_ready()

    async def run() -> tuple[list[Outcome], float, float]:
        async with httpx.AsyncClient(base_url=deployment.base_url, timeout=120) as client:
            idle = faulty.active()
            streams = await started_streams(client, 4, 400, "legend")
            on_b = faulty.active_since(idle)["b"]
            assert on_b >= 1
            deployment.kill("b")
            killed_at = time.monotonic()
            outcomes = await asyncio.wait_for(asyncio.gather(*streams), BOUND_S)
            failed = [o for o in outcomes if not o.finished]
            ended = max((o.ended_at - killed_at for o in failed), default=0.0)
            return outcomes, on_b, ended

    outcomes, on_b, ended = asyncio.run(run())
    failed = [o for o in outcomes if not o.finished]
    assert len(failed) == on_b and all(o.status == 200 and o.error for o in failed), outcomes
    trial(
        "SIGKILL an aggregated worker during 4 streams, the frontend with --migration-limit 0",
        1,
        f"the {int(on_b)} streams on it ended with an error event within {ended:.1f} s; "
        f"the {4 - int(on_b)} on the other worker finished",
    )


def test_every_process_but_the_stopped_one_is_still_up(faulty: Faulty) -> None:
    for name in ("frontend", "a"):
        assert faulty.deployment.processes[name].poll() is None, faulty.deployment.log(name)[-2000:]


def test_sigterm_of_the_frontend_drains_its_streams_then_exits(
    faulty: Faulty, trial: Trial
) -> None:
    """Last: the deployment has no frontend after it."""
    frontend = faulty.deployment.processes["frontend"]

    async def run() -> tuple[list[Outcome], httpx.Response]:
        async with httpx.AsyncClient(base_url=faulty.deployment.base_url, timeout=120) as client:
            streams = await started_streams(client, 2, 150, "fable")
            frontend.send_signal(signal.SIGTERM)
            # Draining: a load balancer's probe hears 503 while the streams go on.

            async def draining() -> bool:
                return (await client.get("/health")).status_code == 503

            await wait_until_async(draining, 10.0, "/health to answer 503")
            health = await client.get("/health")
            assert not all(stream.done() for stream in streams)
            return list(await asyncio.wait_for(asyncio.gather(*streams), BOUND_S)), health

    outcomes, health = asyncio.run(run())
    assert all(o.finished and o.error is None for o in outcomes), outcomes
    assert health.json()["status"] == "draining"
    assert frontend.wait(timeout=BOUND_S) == 0, faulty.deployment.log("frontend")[-2000:]
    trial(
        "SIGTERM the frontend with 2 streams in flight",
        1,
        "/health answered 503 draining; both streams finished; it exited 0",
    )
