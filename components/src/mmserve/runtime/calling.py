"""Calling endpoints: one reply or a stream, with deadlines, instance targeting and typed errors.

A call publishes a `RequestFrame` with a reply subject under the caller's inbox and reads the
server's frames from it. The caller fails a call with a typed `RemoteError` on the end frame's
error, on its deadline, when nothing arrived for `idle_timeout` seconds, when the instance
serving it stopped heartbeating and its NATS connection is gone, when the NATS connection
drops, or when it reads too slowly. Leaving a call early cancels it on the serving side.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import nats.errors
from nats.aio.msg import Msg

from mmserve import protocol
from mmserve.runtime.errors import (
    DeadlineExceeded,
    Disconnected,
    RemoteError,
    Unavailable,
    WireProtocolError,
)
from mmserve.runtime.subjects import cancel_subject

if TYPE_CHECKING:
    from mmserve.runtime.connection import Runtime

log = logging.getLogger(__name__)

R = TypeVar("R")

_LIVENESS_PROBE_TIMEOUT_S = 1.0


_Frame = protocol.ReplyFrame | protocol.EndFrame | protocol.KeepaliveFrame | RemoteError


class _FrameQueue:
    """A call's frames not read yet, for its one reader: `asyncio.Queue`'s non-blocking calls,
    and a `get` that waits under a timeout on one future and one timer (`asyncio.wait_for` on
    a queue's `get` makes a task per wait)."""

    def __init__(self, maxsize: int) -> None:
        self._items: collections.deque[_Frame] = collections.deque()
        self._maxsize = maxsize
        self._waiter: asyncio.Future[None] | None = None

    def empty(self) -> bool:
        return not self._items

    def put_nowait(self, item: _Frame) -> None:
        if 0 < self._maxsize <= len(self._items):
            raise asyncio.QueueFull
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def get_nowait(self) -> _Frame:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self, timeout: float) -> _Frame:
        """The next frame, waiting at most `timeout` seconds for one (then `TimeoutError`)."""
        if not self._items:
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = loop.call_later(timeout, _expire, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        return self._items.popleft()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(asyncio.TimeoutError())


@dataclass
class _CallerCall:
    reply_subject: str
    request_id: str
    endpoint: tuple[str, str]  # (component, endpoint)
    instance_id: str  # the serving instance, once known
    frames: _FrameQueue
    ended: bool = False
    probe_subject: str = ""  # the reply subject of the serving instance's frames, once known

    def fail(self, error: RemoteError) -> None:
        """Deliver `error` as the next item, dropping frames not read yet."""
        while not self.frames.empty():
            self.frames.get_nowait()
        self.frames.put_nowait(error)


def _end_arrived(call: _CallerCall) -> bool:
    """Whether the server's end frame is among the frames not read yet: a caller that stops at
    the reply it needs (a completion's last chunk) usually has it queued already, and a call
    the server ended needs no cancel."""
    while not call.frames.empty():
        if isinstance(call.frames.get_nowait(), protocol.EndFrame):
            return True
    return False


class Caller:
    """The calls one runtime has open, and the liveness of the instances serving them."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._calls: dict[str, _CallerCall] = {}
        self._liveness_tasks: dict[tuple[str, str], asyncio.Task[None]] = {}

    def open(self, request_id: str, endpoint: tuple[str, str], instance_id: str) -> _CallerCall:
        call = _CallerCall(
            reply_subject=self._runtime._inbox_subject(""),
            request_id=request_id,
            endpoint=endpoint,
            instance_id=instance_id,
            frames=_FrameQueue(self._runtime.max_pending_replies),
        )
        self._calls[call.reply_subject] = call
        if endpoint not in self._liveness_tasks:
            self._liveness_tasks[endpoint] = asyncio.create_task(
                self._fail_calls_of_dead_instances(*endpoint), name="mmserve-call-liveness"
            )
        return call

    def close(self, call: _CallerCall, reason: str) -> None:
        self._calls.pop(call.reply_subject, None)
        if call.ended or not self._runtime.nc.is_connected or _end_arrived(call):
            return
        cancel = protocol.CancelFrame(
            request_id=call.request_id, reply_subject=call.reply_subject, reason=reason
        )
        self._runtime._spawn(self._send_cancel(cancel))

    def fail_all(self, error: RemoteError) -> None:
        for call in list(self._calls.values()):
            call.fail(error)

    def stop(self) -> None:
        for task in self._liveness_tasks.values():
            task.cancel()

    def on_reply(self, msg: Msg, no_responders: bool) -> None:
        call = self._calls.get(msg.subject)
        if call is None:
            return
        if no_responders:
            call.fail(
                Unavailable(
                    None, "no instance serves this endpoint", lost_instance=call.instance_id
                )
            )
            return
        try:
            frame = protocol.decode(msg.data, protocol.ServerFrame)
        except protocol.ProtocolError as exc:
            call.fail(WireProtocolError(None, str(exc)))
            return
        if not call.instance_id and not isinstance(frame, protocol.EndFrame):
            call.instance_id = frame.instance_id
        if msg.reply:
            call.probe_subject = msg.reply
        try:
            call.frames.put_nowait(frame)
        except asyncio.QueueFull:
            call.fail(
                RemoteError(
                    protocol.ERROR_SLOW_CONSUMER,
                    f"more than {self._runtime.max_pending_replies} replies unread: call cancelled",
                )
            )

    async def _send_cancel(self, cancel: protocol.CancelFrame) -> None:
        with contextlib.suppress(nats.errors.Error):
            await self._runtime.nc.publish(
                cancel_subject(self._runtime.namespace), protocol.encode(cancel)
            )

    async def _fail_calls_of_dead_instances(self, component: str, endpoint: str) -> None:
        """Fail open calls served by an instance whose heartbeats stopped, sooner than their idle
        timeout would. Instances that deregister (graceful shutdown) still finish their calls."""
        try:
            watcher = await self._runtime.watch(component, endpoint)
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            log.debug("no liveness for calls to %s.%s: %r", component, endpoint, exc)
            return
        async for event in watcher.events():
            if event.kind != "removed" or not event.expired:
                continue
            dead = event.record.instance_id
            calls = [
                call
                for call in self._calls.values()
                if call.endpoint == (component, endpoint) and call.instance_id == dead
            ]
            if calls and await self._still_connected(calls):
                log.warning(
                    "instance %s of %s.%s stopped heartbeating but is still connected (busy?): "
                    "its %d open calls go on",
                    dead,
                    component,
                    endpoint,
                    len(calls),
                )
                continue
            for call in calls:
                call.fail(
                    Disconnected(
                        None,
                        f"instance {dead} of {component}.{endpoint} stopped heartbeating",
                        lost_instance=dead,
                    )
                )

    async def _still_connected(self, calls: list[_CallerCall]) -> bool:
        """Whether the instance serving `calls` still holds its NATS connection. NATS answers
        no-responders at once on the reply subject of its frames when it does not (a crash);
        one that is only too busy to heartbeat stays silent, and its calls keep their idle
        timeout and deadline."""
        probe = next((call.probe_subject for call in calls if call.probe_subject), None)
        if probe is None:
            return False
        try:
            await self._runtime.nc.request(probe, b"", timeout=_LIVENESS_PROBE_TIMEOUT_S)
        except nats.errors.TimeoutError:
            return True
        except nats.errors.Error:  # no responders, or our own connection is gone
            return False
        return True


class Client:
    """Calls one endpoint: round robin over its instances, or one instance by id."""

    def __init__(self, runtime: Runtime, component: str, endpoint: str) -> None:
        self.runtime = runtime
        self.component = component
        self.endpoint = endpoint
        self.subject = runtime.endpoint_subject(component, endpoint)

    async def call(
        self,
        request: protocol.WireMessage,
        reply_type: type[R] | Any,
        *,
        instance_id: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        deadline: float | None = None,
        idle_timeout: float | None = None,
    ) -> R:
        """Send `request` and return its one reply (decoded as `reply_type`)."""
        replies = self.stream(
            request,
            reply_type,
            instance_id=instance_id,
            request_id=request_id,
            timeout=timeout,
            deadline=deadline,
            idle_timeout=idle_timeout,
        )
        received: list[R] = []
        async with contextlib.aclosing(replies):
            async for reply in replies:
                received.append(reply)
        if len(received) != 1:
            raise WireProtocolError(
                None, f"{self.subject} answered {len(received)} replies to a unary call"
            )
        return received[0]

    async def stream(
        self,
        request: protocol.WireMessage,
        reply_type: type[R] | Any,
        *,
        instance_id: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        deadline: float | None = None,
        idle_timeout: float | None = None,
    ) -> AsyncGenerator[R, None]:
        """Send `request` and yield its replies until the server ends the stream.

        The deadline is `deadline` (unix seconds; pass the upstream one along), else now +
        `timeout`, else now + the runtime's default. Leaving the iteration early (break,
        cancellation, deadline) cancels the call on the serving side.
        """
        runtime = self.runtime
        request_id = request_id or uuid.uuid4().hex
        if deadline is None:
            deadline = time.time() + (runtime.default_timeout if timeout is None else timeout)
        idle = runtime.idle_timeout if idle_timeout is None else idle_timeout
        subject = f"{self.subject}.{instance_id}" if instance_id else self.subject
        frame = protocol.RequestFrame(
            request_id=request_id, deadline=deadline, payload=msgspec.Raw(protocol.encode(request))
        )
        caller = runtime._caller
        call = caller.open(request_id, (self.component, self.endpoint), instance_id or "")
        close_reason = protocol.ERROR_CANCELLED
        try:
            try:
                await runtime._publish(
                    subject, protocol.encode(frame), "request", reply=call.reply_subject
                )
            except RemoteError:
                call.ended = True  # never sent: nothing to cancel
                raise
            expected_seq = 0
            while True:
                left = deadline - time.time()
                if left <= 0:
                    close_reason = protocol.ERROR_DEADLINE_EXCEEDED
                    raise DeadlineExceeded(None, f"deadline of request {request_id} passed")
                try:
                    item = await call.frames.get(min(left, idle))
                except asyncio.TimeoutError:
                    if time.time() >= deadline:
                        continue
                    raise Disconnected(
                        None,
                        f"{subject} sent nothing for {idle:.1f}s: instance lost?",
                        lost_instance=call.instance_id,
                    ) from None
                if isinstance(item, RemoteError):
                    call.ended = item.code == protocol.ERROR_UNAVAILABLE
                    raise item
                if isinstance(item, protocol.EndFrame):
                    call.ended = True
                    if item.error is not None:
                        raise RemoteError.from_message(item.error)
                    if item.seq != expected_seq:
                        raise WireProtocolError(None, f"{subject}: replies lost before the end")
                    return
                if isinstance(item, protocol.KeepaliveFrame):
                    continue
                if item.seq != expected_seq:
                    raise WireProtocolError(None, f"{subject}: reply {expected_seq} was lost")
                expected_seq += 1
                try:
                    reply = protocol.decode(item.payload, reply_type)
                except protocol.ProtocolError as exc:
                    raise WireProtocolError(None, str(exc)) from exc
                yield reply
        finally:
            caller.close(call, close_reason)

    async def instances(self) -> list[protocol.InstanceRecord]:
        return await self.runtime.list_instances(self.component, self.endpoint)
