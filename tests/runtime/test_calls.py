"""Calls between processes through a real nats-server: unary, streamed, balanced, direct,
errors, cancellation and the payload limit."""

from __future__ import annotations

import asyncio
import collections
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import msgspec
import pytest
from nats.aio.msg import Msg

from mmserve import protocol as p
from mmserve.runtime import (
    DeadlineExceeded,
    PayloadTooLarge,
    RemoteError,
    RequestContext,
    Runtime,
    Unavailable,
)
from mmserve.runtime.subjects import cancel_subject
from tests.support.waiting import wait_until_async

from .conftest import wait_started

Pool = tuple[Runtime, list[p.InstanceRecord]]
CALLER = str(Path(__file__).with_name("caller.py"))


def chunk(text: str = "", token_ids: list[int] | None = None, delay_ms: int = 0) -> p.TokenChunk:
    return p.TokenChunk(
        request_id="",
        text=text,
        token_ids=token_ids or [],
        usage=p.Usage(prompt_tokens=delay_ms),
    )


async def test_unary_call_is_answered_by_another_process(pool_caller: Pool) -> None:
    runtime, records = pool_caller
    reply = await runtime.client("svc", "echo").call(
        chunk("hello"), p.TokenChunk, request_id="req-42"
    )
    instance_id, text = reply.text.split(":")
    assert text == "hello"
    assert reply.request_id == "req-42"
    assert instance_id in {r.instance_id for r in records}
    assert instance_id != runtime.instance_id


async def test_stream_delivers_every_reply_in_order(pool_caller: Pool) -> None:
    runtime, _ = pool_caller
    replies = [
        r.token_ids[0]
        async for r in runtime.client("svc", "count").stream(chunk(token_ids=[50]), p.TokenChunk)
    ]
    assert replies == list(range(50))


async def test_stream_keeps_a_slow_call_alive_with_keepalives(pool_caller: Pool) -> None:
    runtime, _ = pool_caller
    # Each reply takes 1.5 s, longer than this call's 1 s idle timeout: keepalives (the
    # service sends one at least every 0.25 s) must keep the call open.
    client = runtime.client("svc", "count")
    replies = [
        r.token_ids[0]
        async for r in client.stream(
            chunk(token_ids=[2], delay_ms=1500), p.TokenChunk, idle_timeout=1.0
        )
    ]
    assert replies == [0, 1]


async def test_queue_group_spreads_calls_over_the_three_instances(pool_caller: Pool) -> None:
    runtime, records = pool_caller
    client = runtime.client("svc", "echo")
    replies = await asyncio.gather(*(client.call(chunk("x"), p.TokenChunk) for _ in range(60)))
    by_instance = collections.Counter(r.text.split(":")[0] for r in replies)
    assert set(by_instance) == {r.instance_id for r in records}
    assert max(by_instance.values()) < 45


async def test_direct_addressing_reaches_the_named_instance(pool_caller: Pool) -> None:
    runtime, records = pool_caller
    client = runtime.client("svc", "echo")
    for record in records:
        for _ in range(5):
            reply = await client.call(chunk("x"), p.TokenChunk, instance_id=record.instance_id)
            assert reply.text == f"{record.instance_id}:x"


async def test_unknown_instance_or_endpoint_is_unavailable_at_once(pool_caller: Pool) -> None:
    runtime, _ = pool_caller
    started = time.monotonic()
    with pytest.raises(Unavailable):
        await runtime.client("svc", "echo").call(chunk(), p.TokenChunk, instance_id="0" * 16)
    with pytest.raises(Unavailable):
        await runtime.client("svc", "no-such-endpoint").call(chunk(), p.TokenChunk)
    assert time.monotonic() - started < 5.0


async def test_handler_errors_arrive_typed(pool_caller: Pool) -> None:
    runtime, _ = pool_caller
    client = runtime.client("svc", "fail")
    with pytest.raises(RemoteError) as typed:
        await client.call(chunk("typed"), p.TokenChunk)
    assert (typed.value.code, typed.value.status) == (p.ERROR_BAD_REQUEST, 400)
    assert typed.value.message == "typed failure"
    with pytest.raises(RemoteError) as untyped:
        await client.call(chunk("other"), p.TokenChunk)
    assert untyped.value.code == p.ERROR_INTERNAL
    assert "ValueError: untyped failure" in untyped.value.message
    # The endpoint keeps serving after failures.
    with pytest.raises(RemoteError, match="typed failure"):
        await client.call(chunk("typed"), p.TokenChunk)


async def seen_cancelled(runtime: Runtime, instance_id: str) -> list[str]:
    reply = await runtime.client("svc", "cancelled").call(
        chunk(), p.TokenChunk, instance_id=instance_id
    )
    return reply.text.split(",")


async def wait_seen_cancelled(runtime: Runtime, instance_id: str, request_id: str) -> None:
    deadline = time.monotonic() + 10.0
    while request_id not in await seen_cancelled(runtime, instance_id):
        assert time.monotonic() < deadline, f"{request_id} was not cancelled on the server"
        await asyncio.sleep(0.05)


async def test_caller_cancellation_reaches_the_handler(pool_caller: Pool) -> None:
    runtime, records = pool_caller
    target = records[0].instance_id
    call = asyncio.create_task(
        runtime.client("svc", "sleep").call(
            chunk(), p.TokenChunk, instance_id=target, request_id="cancel-me"
        )
    )
    await wait_started(runtime, "svc", "cancel-me", target)
    assert "cancel-me" not in await seen_cancelled(runtime, target)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await wait_seen_cancelled(runtime, target, "cancel-me")


async def test_leaving_a_stream_early_cancels_it(pool_caller: Pool) -> None:
    runtime, records = pool_caller
    target = records[1].instance_id
    stream = runtime.client("svc", "count").stream(
        chunk(token_ids=[1000], delay_ms=20),
        p.TokenChunk,
        instance_id=target,
        request_id="leave-early",
    )
    async for reply in stream:
        if reply.token_ids[0] == 2:
            break
    await stream.aclose()
    await wait_seen_cancelled(runtime, target, "leave-early")


async def test_a_stream_left_once_its_end_frame_arrived_sends_no_cancel(nats_url: str) -> None:
    async def three(req: p.TokenChunk, ctx: object) -> AsyncIterator[p.TokenChunk]:
        for i in range(3):
            yield p.TokenChunk(request_id="", token_ids=[i])

    async def endless(req: p.TokenChunk, ctx: object) -> AsyncIterator[p.TokenChunk]:
        for i in range(100_000):
            yield p.TokenChunk(request_id="", token_ids=[i])
            await asyncio.sleep(0.01)

    async with (
        await Runtime.connect(nats_url, "left-at-the-end") as server,
        await Runtime.connect(nats_url, "left-at-the-end") as caller,
    ):
        await server.serve("gen", "three", three, p.TokenChunk)
        await server.serve("gen", "endless", endless, p.TokenChunk)
        cancels: list[str] = []

        async def on_cancel(msg: Msg) -> None:
            cancels.append(p.decode(msg.data, p.CancelFrame).request_id)

        await caller.nc.subscribe(cancel_subject(caller.namespace), cb=on_cancel)
        await caller.flush()

        async def leave_at(endpoint: str, last: int, request_id: str) -> None:
            stream = caller.client("gen", endpoint).stream(
                chunk(), p.TokenChunk, instance_id=server.instance_id, request_id=request_id
            )
            async for reply in stream:
                if reply.token_ids[0] == last:
                    await asyncio.sleep(0.3)  # the frames after it arrive meanwhile
                    break
            await stream.aclose()

        # As a completion's consumer does: it stops at the last reply, before the end frame.
        await leave_at("three", 2, "at-the-end")
        await leave_at("endless", 2, "mid-stream")
        # One connection sends both streams' cancels in order: once the second has arrived,
        # a cancel of the first would have arrived before it.
        await wait_until_async(lambda: "mid-stream" in cancels, what="the mid-stream cancel")
        assert cancels == ["mid-stream"]


async def test_only_a_call_to_any_instance_opens_with_a_keepalive_naming_it(
    nats_url: str,
) -> None:
    async def echo(req: p.TokenChunk, ctx: object) -> p.TokenChunk:
        return req

    async with (
        await Runtime.connect(nats_url, "first-frame") as server,
        await Runtime.connect(nats_url, "first-frame") as caller,
    ):
        await server.serve("named", "echo", echo, p.TokenChunk)
        subject = server.endpoint_subject("named", "echo")

        async def frames_of(to: str) -> list[p.ReplyFrame | p.EndFrame | p.KeepaliveFrame]:
            frames: asyncio.Queue[bytes] = asyncio.Queue()

            async def collect(msg: Msg) -> None:
                frames.put_nowait(msg.data)

            inbox = caller.nc.new_inbox()
            subscription = await caller.nc.subscribe(inbox, cb=collect)
            request = p.RequestFrame(
                request_id="r", deadline=time.time() + 10, payload=msgspec.Raw(p.encode(chunk()))
            )
            await caller.nc.publish(to, p.encode(request), reply=inbox)
            received: list[p.ServerFrame] = []
            while not received or not isinstance(received[-1], p.EndFrame):
                data = await asyncio.wait_for(frames.get(), 5.0)
                received.append(p.decode(data, p.ServerFrame))
            await subscription.unsubscribe()
            return received

        balanced = await frames_of(subject)
        assert [type(f) for f in balanced] == [p.KeepaliveFrame, p.ReplyFrame, p.EndFrame]
        assert isinstance(balanced[0], p.KeepaliveFrame)
        assert balanced[0].instance_id == server.instance_id
        addressed = await frames_of(f"{subject}.{server.instance_id}")
        assert [type(f) for f in addressed] == [p.ReplyFrame, p.EndFrame]


async def test_a_killed_caller_stops_the_work_it_asked_for(
    pool_caller: Pool, nats_url: str, service_pool: tuple[str, list[subprocess.Popen[bytes]]]
) -> None:
    runtime, records = pool_caller
    target = records[0].instance_id
    argv = [CALLER, nats_url, service_pool[0], target, "orphaned"]
    caller = await asyncio.create_subprocess_exec(sys.executable, *argv, stdout=subprocess.PIPE)
    try:
        assert caller.stdout is not None
        line = await asyncio.wait_for(caller.stdout.readline(), 30.0)
        assert line.strip() == b"streaming"
        caller.kill()
        await caller.wait()
        await wait_seen_cancelled(runtime, target, "orphaned")
    finally:
        if caller.returncode is None:
            caller.kill()
            await caller.wait()


async def test_deadline_is_a_typed_timeout_and_cancels_the_handler(pool_caller: Pool) -> None:
    runtime, records = pool_caller
    target = records[2].instance_id
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        await runtime.client("svc", "sleep").call(
            chunk(), p.TokenChunk, instance_id=target, timeout=0.5, request_id="too-slow"
        )
    assert time.monotonic() - started < 10.0
    await wait_seen_cancelled(runtime, target, "too-slow")


async def test_messages_over_the_max_payload_never_travel_inline(pool_caller: Pool) -> None:
    runtime, _ = pool_caller
    limit = runtime.nc.max_payload
    with pytest.raises(PayloadTooLarge, match=r"max payload.*mmserve\.transfer"):
        await runtime.client("svc", "echo").call(chunk("x" * limit), p.TokenChunk)
    with pytest.raises(PayloadTooLarge, match="reply of"):
        await runtime.client("svc", "big").call(chunk(token_ids=[limit]), p.TokenChunk)
    small = await runtime.client("svc", "big").call(chunk(token_ids=[1000]), p.TokenChunk)
    assert len(small.text) == 1000


async def test_request_of_another_protocol_version_is_answered_with_an_error(
    pool_caller: Pool,
) -> None:
    runtime, _ = pool_caller
    frame = msgspec.msgpack.decode(
        p.encode(
            p.RequestFrame(request_id="r", deadline=time.time() + 5, payload=msgspec.Raw(b"\xc0"))
        )
    )
    frame["type"] = f"request_frame.v{p.PROTOCOL_VERSION + 1}"
    reply = await runtime.nc.request(
        runtime.endpoint_subject("svc", "echo"), msgspec.msgpack.encode(frame), timeout=5
    )
    end = p.decode(reply.data, p.EndFrame)
    assert end.error is not None
    assert end.error.code == p.ERROR_PROTOCOL
    assert f"v{p.PROTOCOL_VERSION + 1}" in end.error.message


async def test_a_slow_reader_is_cut_off_not_buffered_without_bound(nats_url: str) -> None:
    async with (
        await Runtime.connect(nats_url, "slow-reader") as server,
        await Runtime.connect(nats_url, "slow-reader", max_pending_replies=16) as caller,
    ):
        handler_cancelled = asyncio.Event()

        async def firehose(req: p.TokenChunk, ctx: object) -> AsyncIterator[p.TokenChunk]:
            try:
                for i in range(100_000):
                    yield p.TokenChunk(request_id="", token_ids=[i])
                    if i % 64 == 0:
                        await asyncio.sleep(0)
            except asyncio.CancelledError:
                handler_cancelled.set()
                raise

        await server.serve("hose", "out", firehose, p.TokenChunk)
        stream = caller.client("hose", "out").stream(chunk(), p.TokenChunk)
        with pytest.raises(RemoteError) as info:
            async for _ in stream:
                await asyncio.sleep(0.2)
        assert info.value.code == p.ERROR_SLOW_CONSUMER
        await asyncio.wait_for(handler_cancelled.wait(), 5.0)


async def test_shutdown_cancels_leftover_calls_with_a_typed_error(nats_url: str) -> None:
    async with await Runtime.connect(nats_url, "shutdown-cancel") as server:
        async with await Runtime.connect(nats_url, "shutdown-cancel") as caller:
            running = asyncio.Event()

            async def forever(req: p.TokenChunk, ctx: object) -> p.TokenChunk:
                running.set()
                await asyncio.sleep(3600)
                return req

            await server.serve("slow", "op", forever, p.TokenChunk)
            call = asyncio.create_task(caller.client("slow", "op").call(chunk(), p.TokenChunk))
            await asyncio.wait_for(running.wait(), 10.0)
            await server.shutdown(graceful_timeout=0.2)
            with pytest.raises(Unavailable, match="shutting down"):
                await call


async def test_events_reach_every_subscriber_in_order(nats_url: str) -> None:
    async with (
        await Runtime.connect(nats_url, "events") as publisher,
        await Runtime.connect(nats_url, "events") as subscriber,
    ):
        received: dict[str, list[int]] = {"a": [], "b": []}
        done = asyncio.Event()

        def collector(name: str) -> Callable[[p.KvEvent], Awaitable[None]]:
            async def collect(event: p.KvEvent) -> None:
                received[name].append(event.event_id)
                if all(len(ids) == 100 for ids in received.values()):
                    done.set()

            return collect

        await subscriber.subscribe("kv_events", p.KvEvent, collector("a"))
        await subscriber.subscribe("kv_events", p.KvEvent, collector("b"))
        await subscriber.flush()
        for event_id in range(100):
            data = p.KvRemoved(block_hashes=[event_id])
            await publisher.publish(
                "kv_events", p.KvEvent(worker_id="w", event_id=event_id, data=data)
            )
        await asyncio.wait_for(done.wait(), 5.0)
        assert received == {"a": list(range(100)), "b": list(range(100))}


async def test_work_in_a_thread_sees_the_cancellation_flag(nats_url: str) -> None:
    observed = asyncio.Event()
    loop = asyncio.get_running_loop()

    def blocking_work(ctx: RequestContext) -> None:
        while not ctx.is_cancelled():
            time.sleep(0.01)
        loop.call_soon_threadsafe(observed.set)

    async def handler(req: p.TokenChunk, ctx: RequestContext) -> p.TokenChunk:
        await asyncio.to_thread(blocking_work, ctx)
        return req

    async with (
        await Runtime.connect(nats_url, "thread-cancel") as server,
        await Runtime.connect(nats_url, "thread-cancel") as caller,
    ):
        await server.serve("threads", "work", handler, p.TokenChunk)
        with pytest.raises(DeadlineExceeded):
            await caller.client("threads", "work").call(chunk(), p.TokenChunk, timeout=0.3)
        await asyncio.wait_for(observed.wait(), 5.0)


async def test_a_flushed_subscription_hears_the_next_publish_from_another_connection(
    nats_url: str,
) -> None:
    # A lost race costs one message in a few hundred (the publish overtakes the SUB at the
    # server), so the pattern is tried many times.
    async with (
        await Runtime.connect(nats_url, "flush") as publisher,
        await Runtime.connect(nats_url, "flush") as subscriber,
    ):
        heard: asyncio.Queue[int] = asyncio.Queue()

        async def hear(event: p.KvEvent) -> None:
            heard.put_nowait(event.event_id)

        for attempt in range(400):
            subscription = await subscriber.subscribe(f"flush-{attempt}", p.KvEvent, hear)
            await subscriber.flush()
            data = p.KvRemoved(block_hashes=[])
            await publisher.publish(f"flush-{attempt}", p.KvEvent("w", attempt, data))
            try:
                assert await asyncio.wait_for(heard.get(), 2.0) == attempt
            finally:
                await subscription.unsubscribe()
