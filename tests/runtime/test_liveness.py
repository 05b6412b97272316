"""Discovery and liveness across processes: crashes, signals and nats-server restarts."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from mmserve import protocol as p
from mmserve.runtime import Disconnected, NatsServer, Runtime, Unavailable
from mmserve.runtime.discovery import LEASE_TTL, SWEEP_INTERVAL, InstanceEvent
from tests.support.waiting import wait_until_async

from .conftest import StartService, wait_for_pids, wait_started


def fresh_namespace() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


def sleep_request() -> p.TokenChunk:
    return p.TokenChunk(request_id="")


async def test_sigkilled_instance_leaves_discovery_and_its_calls_fail_fast(
    nats_url: str, start_service: StartService
) -> None:
    namespace = fresh_namespace()
    victim = start_service(nats_url, namespace, "victim")
    survivor = start_service(nats_url, namespace, "victim")
    # The idle timeout is far away: discovery, not silence, must end the open call.
    async with await Runtime.connect(nats_url, namespace, idle_timeout=30.0) as caller:
        records = await wait_for_pids(caller, "victim", {victim.pid, survivor.pid})
        victim_id = next(r.instance_id for r in records if r.pid == victim.pid)
        listed = await caller.list_instances("victim", "echo")
        assert {r.pid for r in listed} == {victim.pid, survivor.pid}

        watcher = await caller.watch("victim", "echo")
        next_event = asyncio.ensure_future(anext(watcher.events()))
        in_flight = asyncio.create_task(
            caller.client("victim", "sleep").call(
                sleep_request(), p.TokenChunk, instance_id=victim_id, request_id="on-victim"
            )
        )
        await wait_started(caller, "victim", "on-victim", victim_id)
        victim.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()

        # Bounds: the lease plus slack for a loaded machine, far below the idle timeout.
        with pytest.raises(Disconnected, match="stopped heartbeating"):
            await asyncio.wait_for(in_flight, LEASE_TTL + 10.0)
        assert time.monotonic() - killed_at < LEASE_TTL + SWEEP_INTERVAL + 5.0

        event = await asyncio.wait_for(next_event, LEASE_TTL + 10.0)
        gone_after = time.monotonic() - killed_at
        assert (event.kind, event.record.pid, event.expired) == ("removed", victim.pid, True)
        assert gone_after < LEASE_TTL + SWEEP_INTERVAL + 5.0
        assert {r.pid for r in watcher.instances()} == {survivor.pid}

        started = time.monotonic()
        with pytest.raises(Unavailable):
            await caller.client("victim", "echo").call(
                sleep_request(), p.TokenChunk, instance_id=victim_id
            )
        assert time.monotonic() - started < 5.0
        # Balanced calls go to the survivor only.
        reply = await caller.client("victim", "echo").call(sleep_request(), p.TokenChunk)
        assert not reply.text.startswith(victim_id)
        assert {r.pid for r in await caller.list_instances("victim", "echo")} <= {
            survivor.pid,
            victim.pid,  # the bucket may keep the last put for up to LEASE_TTL
        }


async def test_a_call_to_any_instance_fails_fast_when_the_one_that_took_it_dies(
    nats_url: str, start_service: StartService
) -> None:
    """The instance that takes a balanced call names itself at once: its crash fails the
    call after the lease, although no keepalive or reply was due yet."""
    namespace = fresh_namespace()
    victim = start_service(nats_url, namespace, "victim", keepalive_interval=600.0)
    async with await Runtime.connect(nats_url, namespace, idle_timeout=60.0) as caller:
        await wait_for_pids(caller, "victim", {victim.pid})
        in_flight = asyncio.create_task(
            caller.client("victim", "sleep").call(
                sleep_request(), p.TokenChunk, request_id="on-any"
            )
        )
        await wait_started(caller, "victim", "on-any")
        victim.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(Disconnected, match="stopped heartbeating"):
            await asyncio.wait_for(in_flight, LEASE_TTL + 20.0)
        assert time.monotonic() - killed_at < LEASE_TTL + SWEEP_INTERVAL + 10.0


async def test_a_stalled_watcher_keeps_the_instances_it_could_not_hear(
    nats_url: str, start_service: StartService
) -> None:
    namespace = fresh_namespace()
    service = start_service(nats_url, namespace, "steady")
    async with await Runtime.connect(nats_url, namespace) as caller:
        await wait_for_pids(caller, "steady", {service.pid})
        watcher = await caller.watch("steady", "echo")
        events: list[InstanceEvent] = []

        async def collect() -> None:
            async for event in watcher.events():
                events.append(event)

        collecting = asyncio.create_task(collect())
        await asyncio.sleep(0)
        # Blocks this process's event loop (as heavy load does): the instance keeps beating,
        # its heartbeats wait unread on the socket.
        time.sleep(LEASE_TTL + 1.0)  # noqa: ASYNC251 (the stall is the point)
        await asyncio.sleep(LEASE_TTL / 2)
        collecting.cancel()
        assert events == []
        assert {r.pid for r in watcher.instances()} == {service.pid}


async def test_an_instance_frozen_but_connected_keeps_its_open_calls(
    nats_url: str, start_service: StartService, caplog: pytest.LogCaptureFixture
) -> None:
    # SIGSTOP: no heartbeats, but its NATS connection stays, as for an instance too busy to beat.
    namespace = fresh_namespace()
    service = start_service(nats_url, namespace, "frozen")
    async with await Runtime.connect(nats_url, namespace, idle_timeout=30.0) as caller:
        await wait_for_pids(caller, "frozen", {service.pid})
        watcher = await caller.watch("frozen", "count")
        next_event = asyncio.ensure_future(anext(watcher.events()))
        chunks = p.TokenChunk(request_id="", token_ids=[4], usage=p.Usage(prompt_tokens=200))
        replies: list[int] = []
        answered = asyncio.Event()

        async def consume() -> None:
            async for r in caller.client("frozen", "count").stream(chunks, p.TokenChunk):
                replies.append(r.token_ids[0])
                answered.set()

        in_flight = asyncio.create_task(consume())
        await asyncio.wait_for(answered.wait(), 10.0)
        service.send_signal(signal.SIGSTOP)
        try:
            event = await asyncio.wait_for(next_event, LEASE_TTL + 10.0)
            assert (event.kind, event.expired) == ("removed", True)
            # The caller probes the frozen instance, finds it connected and keeps the call.
            await wait_until_async(
                lambda: "still connected" in caplog.text, 10.0, "the probe of the instance"
            )
        finally:
            service.send_signal(signal.SIGCONT)
        await asyncio.wait_for(in_flight, 30.0)
        assert replies == [0, 1, 2, 3]


async def test_sigterm_drains_in_flight_calls_then_deregisters(
    nats_url: str, start_service: StartService
) -> None:
    namespace = fresh_namespace()
    service = start_service(nats_url, namespace, "graceful")
    async with await Runtime.connect(nats_url, namespace) as caller:
        await wait_for_pids(caller, "graceful", {service.pid})
        watcher = await caller.watch("graceful", "count")
        next_event = asyncio.ensure_future(anext(watcher.events()))
        slow = p.TokenChunk(request_id="", token_ids=[5], usage=p.Usage(prompt_tokens=100))
        replies: list[int] = []

        async def consume() -> None:
            client = caller.client("graceful", "count")
            async for r in client.stream(slow, p.TokenChunk, request_id="draining"):
                replies.append(r.token_ids[0])

        in_flight = asyncio.create_task(consume())
        await wait_started(caller, "graceful", "draining")
        service.send_signal(signal.SIGTERM)
        # Deregistered (not expired), while the call still runs to its end.
        event = await asyncio.wait_for(next_event, 10.0)
        assert (event.kind, event.expired) == ("removed", False)
        await asyncio.wait_for(in_flight, 10.0)
        assert replies == [0, 1, 2, 3, 4]
        assert await asyncio.to_thread(service.wait, 10.0) == 0


async def test_nats_server_restart_fails_open_calls_and_later_calls_succeed(
    private_nats: NatsServer, start_service: StartService, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mmserve.runtime.connection")
    namespace = fresh_namespace()
    service = start_service(private_nats.url, namespace, "restart")
    async with await Runtime.connect(
        private_nats.url, namespace, reconnect_time_wait=0.2
    ) as caller:
        await wait_for_pids(caller, "restart", {service.pid})
        client = caller.client("restart", "echo")
        assert (await client.call(sleep_request(), p.TokenChunk)).text.endswith(":")
        in_flight = asyncio.create_task(
            caller.client("restart", "sleep").call(
                sleep_request(), p.TokenChunk, request_id="across-restart"
            )
        )
        await wait_started(caller, "restart", "across-restart")
        private_nats.kill()
        with pytest.raises(Disconnected, match="connection to NATS lost"):
            await asyncio.wait_for(in_flight, 5.0)
        with pytest.raises(Disconnected, match="not connected"):
            await client.call(sleep_request(), p.TokenChunk)
        await asyncio.to_thread(private_nats.start)

        deadline = time.monotonic() + 15.0
        while True:
            try:
                reply = await client.call(sleep_request(), p.TokenChunk, timeout=2.0)
                break
            except (Disconnected, Unavailable):
                assert time.monotonic() < deadline, "calls did not recover after the restart"
                await asyncio.sleep(0.2)
        assert reply.text.endswith(":")
        # The service registers again in the new server's (empty) bucket.
        await wait_for_pids(caller, "restart", {service.pid})
    assert service.poll() is None
    said = [r.getMessage() for r in caplog.records if r.name == "mmserve.runtime.connection"]
    assert said[0] == "lost the connection to NATS; reconnecting"
    assert re.fullmatch(r"reconnected to NATS at 127\.0\.0\.1:\d+ after \d+\.\d s", said[1])


async def test_mmserve_nats_prints_a_loopback_url_and_stops_on_sigterm() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mmserve.cli", "nats", "--port", "0", stdout=subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        url = (await asyncio.wait_for(process.stdout.readline(), 60.0)).decode().strip()
        assert url.startswith("nats://127.0.0.1:")
        async with await Runtime.connect(url, "cli-check") as runtime:
            assert runtime.nc.is_connected
            # JetStream is on: discovery works against it.
            assert await runtime.list_instances() == []
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 10.0) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_unreachable_nats_fails_to_connect_with_a_clear_error() -> None:
    with NatsServer() as server:
        url = server.url
    started = time.monotonic()
    with pytest.raises(Disconnected, match="cannot connect to NATS"):
        await Runtime.connect(url, "nowhere", connect_wait=0.5, reconnect_time_wait=0.1)
    assert time.monotonic() - started < 5.0


async def test_serving_without_jetstream_fails_at_start_not_silently() -> None:
    with NatsServer(jetstream=False) as server:
        async with await Runtime.connect(server.url, "no-js") as runtime:

            async def echo(req: p.TokenChunk, ctx: object) -> p.TokenChunk:
                return req

            with pytest.raises(Unavailable, match="JetStream"):
                await runtime.serve("svc", "echo", echo, p.TokenChunk)


async def test_second_sigterm_skips_the_graceful_wait(
    nats_url: str, start_service: StartService
) -> None:
    namespace = fresh_namespace()
    service = start_service(nats_url, namespace, "forced")
    async with await Runtime.connect(nats_url, namespace) as caller:
        await wait_for_pids(caller, "forced", {service.pid})
        watcher = await caller.watch("forced", "sleep")
        deregistered = asyncio.ensure_future(anext(watcher.events()))
        in_flight = asyncio.create_task(
            caller.client("forced", "sleep").call(
                sleep_request(), p.TokenChunk, request_id="forced-out"
            )
        )
        await wait_started(caller, "forced", "forced-out")
        service.send_signal(signal.SIGTERM)
        # The first signal deregistered the instance, which then waits for in-flight calls.
        await asyncio.wait_for(deregistered, 10.0)
        assert not in_flight.done()  # the first signal waits for in-flight calls
        service.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        with pytest.raises(Unavailable, match="shutting down"):
            await asyncio.wait_for(in_flight, 20.0)
        assert await asyncio.to_thread(service.wait, 20.0) == 0
        # Well under the service's 60 s graceful timeout.
        assert time.monotonic() - signalled < 20.0
