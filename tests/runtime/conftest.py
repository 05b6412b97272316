"""Service processes for the runtime tests (see service.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from mmserve import protocol as p
from mmserve.runtime import Runtime
from tests.support.waiting import wait_until_async

SERVICE = str(Path(__file__).with_name("service.py"))
READY_TIMEOUT = 30.0

StartService = Callable[..., subprocess.Popen[bytes]]


def start_service_process(
    url: str, namespace: str, component: str, keepalive_interval: float = 0.25
) -> subprocess.Popen[bytes]:
    argv = [sys.executable, SERVICE, url, namespace, component, str(keepalive_interval)]
    return subprocess.Popen(argv, env=os.environ)


def stop_process(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.fixture
def start_service() -> Iterator[StartService]:
    """Starts service processes; whatever is still running at the end is killed."""
    started: list[subprocess.Popen[bytes]] = []

    def start(
        url: str, namespace: str, component: str, keepalive_interval: float = 0.25
    ) -> subprocess.Popen[bytes]:
        started.append(start_service_process(url, namespace, component, keepalive_interval))
        return started[-1]

    yield start
    for process in started:
        stop_process(process)


@pytest.fixture(scope="module")
def service_pool(nats_url: str) -> Iterator[tuple[str, list[subprocess.Popen[bytes]]]]:
    """Three instances of component `svc` in a namespace of their own."""
    namespace = f"test-{uuid.uuid4().hex[:8]}"
    processes = [start_service_process(nats_url, namespace, "svc") for _ in range(3)]
    yield namespace, processes
    for process in processes:
        stop_process(process)


async def wait_for_pids(runtime: Runtime, component: str, pids: set[int]) -> list[p.InstanceRecord]:
    """Records of the instances of `component` run by `pids`, once all are ready."""
    # `cancelled` is the last endpoint a service registers: seeing it means all are served.
    async with await runtime.watch(component, "cancelled") as watcher:
        records = await watcher.wait_until(
            lambda found: pids <= {r.pid for r in found}, timeout=READY_TIMEOUT
        )
    return [r for r in records if r.pid in pids]


async def wait_started(
    runtime: Runtime, component: str, request_id: str, instance_id: str | None = None
) -> None:
    """Until the `sleep` or `count` handler of call `request_id` runs on the service (the one
    of `instance_id`, else the only instance of `component`)."""

    async def started() -> bool:
        reply = await runtime.client(component, "started").call(
            p.TokenChunk(request_id=""), p.TokenChunk, instance_id=instance_id
        )
        return request_id in reply.text.split(",")

    await wait_until_async(started, READY_TIMEOUT, f"the handler of {request_id} started")


@pytest.fixture
async def pool_caller(
    nats_url: str, service_pool: tuple[str, list[subprocess.Popen[bytes]]]
) -> AsyncIterator[tuple[Runtime, list[p.InstanceRecord]]]:
    namespace, processes = service_pool
    runtime = await Runtime.connect(nats_url, namespace, idle_timeout=5.0)
    try:
        records = await wait_for_pids(runtime, "svc", {proc.pid for proc in processes})
        yield runtime, records
    finally:
        await runtime.shutdown()
