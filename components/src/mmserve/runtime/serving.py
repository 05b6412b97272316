"""Serving endpoints: take requests, run their handlers, answer them.

A request is a `RequestFrame` with a reply subject under the caller's inbox; the server answers
`ReplyFrame`s (numbered), then one `EndFrame` (with the error if the handler failed), with
`KeepaliveFrame`s between so it is never silent for more than `keepalive_interval` seconds. On
a call to any instance the first keepalive goes out at once and names the instance that took
it (a call addressed to the instance needs no naming). A handler is
cancelled by a `CancelFrame` from its caller, its deadline, the caller's connection going away
(NATS answers no-responders on the reply subject of its frames), this instance losing NATS, or
shutdown once the graceful drain is over.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from mmserve import protocol
from mmserve.runtime.discovery import Registrar
from mmserve.runtime.errors import (
    Cancelled,
    DeadlineExceeded,
    Disconnected,
    RemoteError,
    Unavailable,
    WireProtocolError,
)
from mmserve.runtime.subjects import cancel_subject, check_name

if TYPE_CHECKING:
    from mmserve.runtime.connection import Runtime

log = logging.getLogger(__name__)

Handler = Callable[[Any, "RequestContext"], Awaitable[Any] | AsyncIterator[Any]]

_CANCELLED_MEMORY_S = 60.0


@dataclass
class RequestContext:
    """What a handler knows about the call it serves. Cancellation by the caller, the deadline
    or shutdown arrives as `asyncio.CancelledError` in the handler task; `cancelled` is set
    first, for work running outside the task (threads) that polls it."""

    request_id: str
    deadline: float  # unix seconds
    instance_id: str
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    def time_left(self) -> float:
        return self.deadline - time.time()

    def is_cancelled(self) -> bool:
        return self.cancelled.is_set()


@dataclass
class ServedEndpoint:
    component: str
    endpoint: str
    handler: Handler
    request_type: Any
    record: protocol.InstanceRecord
    streaming: bool
    subscriptions: list[Subscription] = field(default_factory=list)


@dataclass
class _ServerCall:
    reply_subject: str
    context: RequestContext
    # Reply subject of the frames sent to the caller: NATS answers "no responders" there once
    # the caller's connection is gone, and the call is cancelled.
    probe_subject: str = ""
    task: asyncio.Task[None] | None = None
    next_seq: int = 0
    last_sent: float = field(default_factory=time.monotonic)
    cancel_error: RemoteError | None = None


class Server:
    """The endpoints one runtime serves and the calls they are answering."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self.closing = False
        self._endpoints: list[ServedEndpoint] = []
        self._calls: dict[str, _ServerCall] = {}
        self._calls_by_probe: dict[str, _ServerCall] = {}
        self._recently_cancelled: dict[str, float] = {}
        self._registrar = Registrar(runtime.nc)
        self._keepalive_task: asyncio.Task[None] | None = None
        self._cancel_subscription: Subscription | None = None

    async def start(self) -> None:
        self._cancel_subscription = await self._runtime.nc.subscribe(
            cancel_subject(self._runtime.namespace), cb=self._on_cancel
        )

    async def serve(
        self,
        component: str,
        endpoint: str,
        handler: Handler,
        request_type: Any,
        *,
        facts: dict[str, str] | None = None,
    ) -> ServedEndpoint:
        runtime = self._runtime
        if self.closing:
            raise Unavailable(None, "runtime is shutting down")
        check_name("component", component)
        check_name("endpoint", endpoint)
        record = protocol.InstanceRecord(
            namespace=runtime.namespace,
            component=component,
            endpoint=endpoint,
            instance_id=runtime.instance_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=time.time(),
            facts=facts or {},
        )
        served = ServedEndpoint(
            component=component,
            endpoint=endpoint,
            handler=handler,
            request_type=request_type,
            record=record,
            streaming=inspect.isasyncgenfunction(handler),
        )

        async def on_request(msg: Msg) -> None:
            self._accept(served, msg, addressed=False)

        async def on_addressed_request(msg: Msg) -> None:
            self._accept(served, msg, addressed=True)

        subject = runtime.endpoint_subject(component, endpoint)
        served.subscriptions = [
            await runtime.nc.subscribe(subject, queue=subject, cb=on_request),
            await runtime.nc.subscribe(f"{subject}.{runtime.instance_id}", cb=on_addressed_request),
        ]
        self._endpoints.append(served)
        if self._keepalive_task is None:
            self._keepalive_task = asyncio.create_task(self._keepalive(), name="mmserve-keepalive")
        await self._registrar.register(record)
        return served

    async def leave_discovery(self) -> None:
        """Deregister and unsubscribe: routers stop choosing this instance at once and no new
        request reaches it, while the calls it is serving go on. Idempotent."""
        if self.closing:
            return
        self.closing = True
        await self._registrar.deregister_all()
        for served in self._endpoints:
            for subscription in served.subscriptions:
                with contextlib.suppress(nats.errors.Error):
                    await subscription.unsubscribe()

    async def close(self, graceful_timeout: float, force: asyncio.Event) -> None:
        """Leave discovery, let in-flight handlers finish for up to `graceful_timeout`
        seconds (or until `force` is set), cancel the rest."""
        await self.leave_discovery()
        tasks = {c.task for c in self._calls.values() if c.task is not None}
        if tasks:
            drained = asyncio.ensure_future(asyncio.wait(tasks))
            forced = asyncio.ensure_future(force.wait())
            await asyncio.wait(
                [drained, forced], timeout=graceful_timeout, return_when="FIRST_COMPLETED"
            )
            forced.cancel()
            for call in list(self._calls.values()):
                self._cancel(call, self._shutting_down())
            await asyncio.gather(*tasks, return_exceptions=True)

    def _shutting_down(self) -> Unavailable:
        """What a call this instance will not finish answers: its caller may migrate the
        request to another instance."""
        instance = self._runtime.instance_id
        return Unavailable(None, "instance shutting down", lost_instance=instance)

    def stop_keepalives(self) -> None:
        if self._keepalive_task is not None:
            self._keepalive_task.cancel()

    def on_probe_reply(self, subject: str, no_responders: bool) -> bool:
        """Handle a message on the reply subject of a served call's frames; False when
        `subject` is no such subject."""
        call = self._calls_by_probe.get(subject)
        if call is None:
            return False
        if no_responders:
            self._cancel(call, Cancelled(None, "the caller is gone (nothing listens for replies)"))
        return True

    def on_disconnected(self) -> None:
        for call in list(self._calls.values()):
            self._cancel(call, Disconnected(None, "the serving instance lost its NATS connection"))

    def _accept(self, served: ServedEndpoint, msg: Msg, *, addressed: bool) -> None:
        """Take one call; `addressed`: it came on this instance's own subject."""
        runtime = self._runtime
        reply_subject = msg.reply
        if not reply_subject:
            log.warning("dropping a request to %s without a reply subject", msg.subject)
            return
        call = _ServerCall(reply_subject, RequestContext("", 0.0, runtime.instance_id))
        try:
            frame = protocol.decode(msg.data, protocol.RequestFrame)
        except protocol.ProtocolError as exc:
            runtime._spawn(self._send_end(call, WireProtocolError(None, str(exc))))
            return
        call.context = RequestContext(frame.request_id, frame.deadline, runtime.instance_id)
        if self.closing:
            runtime._spawn(self._send_end(call, self._shutting_down()))
            return
        if self._recently_cancelled.pop(reply_subject, None) is not None:
            return
        call.probe_subject = runtime._inbox_subject("s")
        self._calls[reply_subject] = call
        self._calls_by_probe[call.probe_subject] = call
        # A first frame names this instance at once, so that a caller that sent to any
        # instance knows whose heartbeats to follow from the start, not from the first
        # keepalive or reply. A caller that addressed this instance knows already: it hears
        # from it with the first reply, or the keepalive due after an interval of silence (one
        # message less per call, most of which answer sooner).
        if not addressed:
            runtime._spawn(self._send_keepalive(call))
        call.task = asyncio.create_task(
            self._run_handler(served, frame, call), name=f"mmserve-{frame.request_id}"
        )
        # Also forgets a call cancelled before its task ever ran (so before its `finally`).
        call.task.add_done_callback(lambda _: self._forget(call))

    def _forget(self, call: _ServerCall) -> None:
        self._calls.pop(call.reply_subject, None)
        self._calls_by_probe.pop(call.probe_subject, None)

    async def _run_handler(
        self, served: ServedEndpoint, frame: protocol.RequestFrame, call: _ServerCall
    ) -> None:
        loop = asyncio.get_running_loop()
        expiry = loop.call_later(
            max(0.0, frame.deadline - time.time()),
            self._cancel,
            call,
            DeadlineExceeded(None, f"deadline of request {frame.request_id} passed"),
        )
        error: RemoteError | None = None
        try:
            request = protocol.decode(frame.payload, served.request_type)
            result: Any = served.handler(request, call.context)
            if served.streaming:
                async with contextlib.aclosing(result):
                    async for reply in result:
                        await self._send_reply(call, reply)
            else:
                await self._send_reply(call, await result)
        except asyncio.CancelledError:
            error = call.cancel_error or Cancelled(None, "cancelled")
        except RemoteError as exc:
            error = exc
        except protocol.ProtocolError as exc:
            error = WireProtocolError(None, str(exc))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # also a Rust panic: pyo3's PanicException is no Exception
            log.exception("%s.%s failed on %s", served.component, served.endpoint, frame.request_id)
            error = RemoteError(protocol.ERROR_INTERNAL, f"{type(exc).__name__}: {exc}")
        finally:
            expiry.cancel()
        self._forget(call)
        await self._send_end(call, error)

    async def _send_reply(self, call: _ServerCall, reply: protocol.WireMessage) -> None:
        payload = protocol.encode(reply)
        frame = protocol.ReplyFrame(
            request_id=call.context.request_id,
            seq=call.next_seq,
            payload=msgspec.Raw(payload),
            instance_id=self._runtime.instance_id,
        )
        await self._runtime._publish(
            call.reply_subject, protocol.encode(frame), "reply", reply=call.probe_subject
        )
        call.next_seq += 1
        call.last_sent = time.monotonic()

    async def _send_end(self, call: _ServerCall, error: RemoteError | None) -> None:
        end = protocol.EndFrame(
            request_id=call.context.request_id,
            seq=call.next_seq,
            error=error.to_message(call.context.request_id) if error else None,
        )
        with contextlib.suppress(nats.errors.Error):
            await self._runtime.nc.publish(call.reply_subject, protocol.encode(end))

    def _cancel(self, call: _ServerCall, error: RemoteError) -> None:
        if call.task is None or call.task.done():
            return
        call.cancel_error = call.cancel_error or error
        call.context.cancelled.set()
        call.task.cancel()

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            cancel = protocol.decode(msg.data, protocol.CancelFrame)
        except protocol.ProtocolError as exc:
            log.warning("ignoring a cancel frame: %s", exc)
            return
        call = self._calls.get(cancel.reply_subject)
        if call is None:
            # Instances that did not take the call remember it too, in case the cancel
            # overtook the request; the memory is short and pruned by the keepalive loop.
            self._recently_cancelled[cancel.reply_subject] = time.monotonic()
            return
        reason = RemoteError.from_message(
            protocol.ErrorMessage(code=cancel.reason, message="the caller cancelled the call")
        )
        self._cancel(call, reason)

    async def _keepalive(self) -> None:
        # Checking every half interval for calls quiet for half an interval bounds the silence
        # a caller sees to one interval.
        half = self._runtime.keepalive_interval / 2
        while True:
            await asyncio.sleep(half)
            now = time.monotonic()
            for call in list(self._calls.values()):
                if now - call.last_sent >= half:
                    await self._send_keepalive(call)
            forget_before = now - _CANCELLED_MEMORY_S
            for subject in [s for s, t in self._recently_cancelled.items() if t < forget_before]:
                del self._recently_cancelled[subject]

    async def _send_keepalive(self, call: _ServerCall) -> None:
        if not self._runtime.nc.is_connected:
            return
        call.last_sent = time.monotonic()
        keepalive = protocol.KeepaliveFrame(
            request_id=call.context.request_id, instance_id=self._runtime.instance_id
        )
        with contextlib.suppress(nats.errors.Error):
            await self._runtime.nc.publish(
                call.reply_subject, protocol.encode(keepalive), reply=call.probe_subject
            )
