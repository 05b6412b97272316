"""Components over NATS: serve named endpoints, call them (one reply or a stream), discover them.

Subjects (`<ns>` is the runtime's namespace):

* `mmserve.<ns>.<component>.<endpoint>`: requests, load-balanced by a NATS queue group.
* `mmserve.<ns>.<component>.<endpoint>.<instance_id>`: requests to one instance.
* `mmserve.<ns>._cancel`: `CancelFrame`s, heard by every instance of the namespace.

A call publishes a `RequestFrame` with a reply subject under the caller's inbox; the server
answers `ReplyFrame`s (numbered), then one `EndFrame` (with the error if the handler failed),
with `KeepaliveFrame`s between so it is never silent for more than `keepalive_interval` seconds.
The caller fails a call with a typed `RemoteError` on the end frame's error, on its deadline,
when nothing arrived for `idle_timeout` seconds, when the NATS connection drops, or when it
reads too slowly.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import re
import secrets
import signal
import socket
import time
import uuid
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
import uvloop
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from mmserve import protocol
from mmserve.runtime.discovery import InstanceWatcher, Registrar, list_instances
from mmserve.runtime.errors import (
    Cancelled,
    DeadlineExceeded,
    Disconnected,
    PayloadTooLarge,
    RemoteError,
    Unavailable,
    WireProtocolError,
)

log = logging.getLogger(__name__)

R = TypeVar("R")
M = TypeVar("M")
Handler = Callable[[Any, "RequestContext"], Awaitable[Any] | AsyncIterator[Any]]

SUBJECT_ROOT = "mmserve"
DEFAULT_NAMESPACE = "mmserve"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
_NO_RESPONDERS = "503"
_CANCELLED_MEMORY_S = 60.0
_LIVENESS_PROBE_TIMEOUT_S = 1.0


def _check_name(kind: str, name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"{kind} name {name!r} must match [A-Za-z0-9_-]+")
    return name


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


@dataclass
class _CallerCall:
    reply_subject: str
    request_id: str
    endpoint: tuple[str, str]  # (component, endpoint)
    instance_id: str  # the serving instance, once known
    frames: asyncio.Queue[
        protocol.ReplyFrame | protocol.EndFrame | protocol.KeepaliveFrame | RemoteError
    ]
    ended: bool = False
    probe_subject: str = ""  # the reply subject of the serving instance's frames, once known

    def fail(self, error: RemoteError) -> None:
        """Deliver `error` as the next item, dropping frames not read yet."""
        while not self.frames.empty():
            self.frames.get_nowait()
        self.frames.put_nowait(error)


class Runtime:
    """One NATS connection shared by the endpoints a process serves and the calls it makes.

    All endpoints of a runtime share its `instance_id`, the id callers use for direct addressing.
    """

    def __init__(
        self,
        nc: NatsClient,
        namespace: str,
        *,
        keepalive_interval: float,
        idle_timeout: float,
        default_timeout: float,
        max_pending_replies: int,
        graceful_timeout: float,
    ) -> None:
        self.nc = nc
        self.namespace = _check_name("namespace", namespace)
        self.instance_id = secrets.token_hex(8)
        self.keepalive_interval = keepalive_interval
        self.idle_timeout = idle_timeout
        self.default_timeout = default_timeout
        self.max_pending_replies = max_pending_replies
        self.graceful_timeout = graceful_timeout
        self.should_exit = asyncio.Event()
        self._force_exit = asyncio.Event()
        self._stopping = False
        self._endpoints: list[ServedEndpoint] = []
        self._server_calls: dict[str, _ServerCall] = {}
        self._server_calls_by_probe: dict[str, _ServerCall] = {}
        self._recently_cancelled: dict[str, float] = {}
        self._caller_calls: dict[str, _CallerCall] = {}
        self._inbox_prefix = f"_INBOX.{secrets.token_hex(11)}"
        self._next_call = 0
        self._background: set[asyncio.Task[Any]] = set()
        # Weak: watchers stopped by their owners and dropped leave no trace here.
        self._watchers: weakref.WeakSet[InstanceWatcher] = weakref.WeakSet()
        self._registrar = Registrar(nc)
        self._keepalive_task: asyncio.Task[None] | None = None
        self._liveness_tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._inbox_subscription: Subscription | None = None
        self._cancel_subscription: Subscription | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    @classmethod
    async def connect(
        cls,
        url: str | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        *,
        keepalive_interval: float = 1.0,
        idle_timeout: float = 10.0,
        default_timeout: float = 600.0,
        max_pending_replies: int = 4096,
        graceful_timeout: float = 10.0,
        reconnect_time_wait: float = 0.5,
        connect_wait: float = 10.0,
        name: str | None = None,
    ) -> Runtime:
        """Connect to NATS (`url`, else `$NATS_URL`, else the default loopback URL).

        The first connection is retried for `connect_wait` seconds, then `Disconnected` is
        raised. Once connected, it reconnects forever after a connection loss; calls open at
        that moment fail with `Disconnected` and calls made while disconnected fail at once.
        """
        url = url or os.environ.get("NATS_URL") or DEFAULT_NATS_URL
        runtime: Runtime | None = None

        async def on_disconnected() -> None:
            if runtime is not None:
                runtime._on_disconnected()

        async def on_error(exc: Exception) -> None:
            log.debug("nats: %r", exc)

        try:
            nc = await nats.connect(
                url,
                name=name or f"mmserve-{os.getpid()}",
                reconnect_time_wait=reconnect_time_wait,
                max_reconnect_attempts=max(1, round(connect_wait / reconnect_time_wait)),
                connect_timeout=2,
                allow_reconnect=True,
                disconnected_cb=on_disconnected,
                error_cb=on_error,
            )
        except (OSError, nats.errors.Error) as exc:
            raise Disconnected(None, f"cannot connect to NATS at {url}: {exc!r}") from exc
        # Bounded attempts only for the first connection: from now on, retry forever.
        nc.options["max_reconnect_attempts"] = -1
        runtime = cls(
            nc,
            namespace,
            keepalive_interval=keepalive_interval,
            idle_timeout=idle_timeout,
            default_timeout=default_timeout,
            max_pending_replies=max_pending_replies,
            graceful_timeout=graceful_timeout,
        )
        await runtime._start()
        return runtime

    async def _start(self) -> None:
        self._inbox_subscription = await self.nc.subscribe(
            f"{self._inbox_prefix}.*", cb=self._on_reply
        )
        self._cancel_subscription = await self.nc.subscribe(
            f"{SUBJECT_ROOT}.{self.namespace}._cancel", cb=self._on_cancel
        )

    async def __aenter__(self) -> Runtime:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    def install_signal_handlers(self) -> None:
        """SIGINT/SIGTERM set `should_exit`; a second one also skips the graceful drain."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._on_signal)

    def _on_signal(self) -> None:
        if self.should_exit.is_set():
            self._force_exit.set()
        self.should_exit.set()

    async def wait_for_shutdown(self) -> None:
        await self.should_exit.wait()

    async def shutdown(self, graceful_timeout: float | None = None) -> None:
        """Stop serving and close: deregister and unsubscribe (no new requests), let in-flight
        handlers finish for up to `graceful_timeout` seconds, cancel the rest, drain NATS.
        Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        self.should_exit.set()
        await self._registrar.deregister_all()
        for served in self._endpoints:
            for subscription in served.subscriptions:
                with contextlib.suppress(nats.errors.Error):
                    await subscription.unsubscribe()
        tasks = {c.task for c in self._server_calls.values() if c.task is not None}
        if tasks:
            timeout = self.graceful_timeout if graceful_timeout is None else graceful_timeout
            drained = asyncio.ensure_future(asyncio.wait(tasks))
            forced = asyncio.ensure_future(self._force_exit.wait())
            await asyncio.wait([drained, forced], timeout=timeout, return_when="FIRST_COMPLETED")
            forced.cancel()
            for call in list(self._server_calls.values()):
                self._cancel_server_call(call, Unavailable(None, "instance shutting down"))
            await asyncio.gather(*tasks, return_exceptions=True)
        for watcher in list(self._watchers):
            await watcher.stop()
        for caller_call in list(self._caller_calls.values()):
            caller_call.fail(Cancelled(None, "runtime shut down"))
        for task in [self._keepalive_task, *self._liveness_tasks.values()]:
            if task is not None:
                task.cancel()
        if self._background:  # last end and cancel frames: let them go out before the drain
            await asyncio.wait(self._background, timeout=1.0)
        with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
            if self.nc.is_connected:
                await asyncio.wait_for(self.nc.drain(), timeout=5.0)
        await self.nc.close()

    # -- serving --------------------------------------------------------------------------------

    async def serve(
        self,
        component: str,
        endpoint: str,
        handler: Handler,
        request_type: Any,
        *,
        facts: dict[str, str] | None = None,
    ) -> ServedEndpoint:
        """Serve `handler(request, ctx)` at `component.endpoint` and register it for discovery.

        `handler` is a coroutine function (one reply) or an async generator function (a stream
        of replies); requests are decoded as `request_type`, replies must be `WireMessage`s.
        Raise `RemoteError(code, message)` to answer a typed error.
        """
        if self._stopping:
            raise Unavailable(None, "runtime is shutting down")
        _check_name("component", component)
        _check_name("endpoint", endpoint)
        record = protocol.InstanceRecord(
            namespace=self.namespace,
            component=component,
            endpoint=endpoint,
            instance_id=self.instance_id,
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
            self._accept(served, msg)

        subject = self.endpoint_subject(component, endpoint)
        served.subscriptions = [
            await self.nc.subscribe(subject, queue=subject, cb=on_request),
            await self.nc.subscribe(f"{subject}.{self.instance_id}", cb=on_request),
        ]
        self._endpoints.append(served)
        if self._keepalive_task is None:
            self._keepalive_task = asyncio.create_task(self._keepalive(), name="mmserve-keepalive")
        await self._registrar.register(record)
        return served

    def endpoint_subject(self, component: str, endpoint: str) -> str:
        return f"{SUBJECT_ROOT}.{self.namespace}.{component}.{endpoint}"

    def _accept(self, served: ServedEndpoint, msg: Msg) -> None:
        reply_subject = msg.reply
        if not reply_subject:
            log.warning("dropping a request to %s without a reply subject", msg.subject)
            return
        call = _ServerCall(reply_subject, RequestContext("", 0.0, self.instance_id))
        try:
            frame = protocol.decode(msg.data, protocol.RequestFrame)
        except protocol.ProtocolError as exc:
            self._spawn(self._send_end(call, WireProtocolError(None, str(exc))))
            return
        call.context = RequestContext(frame.request_id, frame.deadline, self.instance_id)
        if self._stopping:
            self._spawn(self._send_end(call, Unavailable(None, "instance shutting down")))
            return
        if self._recently_cancelled.pop(reply_subject, None) is not None:
            return
        self._next_call += 1
        call.probe_subject = f"{self._inbox_prefix}.s{self._next_call}"
        self._server_calls[reply_subject] = call
        self._server_calls_by_probe[call.probe_subject] = call
        # A first frame names this instance at once, so that a caller that sent to any
        # instance knows whose heartbeats to follow from the start, not from the first
        # keepalive or reply.
        self._spawn(self._send_keepalive(call))
        call.task = asyncio.create_task(
            self._run_handler(served, frame, call), name=f"mmserve-{frame.request_id}"
        )
        # Also forgets a call cancelled before its task ever ran (so before its `finally`).
        call.task.add_done_callback(lambda _: self._forget_server_call(call))

    def _forget_server_call(self, call: _ServerCall) -> None:
        self._server_calls.pop(call.reply_subject, None)
        self._server_calls_by_probe.pop(call.probe_subject, None)

    async def _run_handler(
        self, served: ServedEndpoint, frame: protocol.RequestFrame, call: _ServerCall
    ) -> None:
        loop = asyncio.get_running_loop()
        expiry = loop.call_later(
            max(0.0, frame.deadline - time.time()),
            self._cancel_server_call,
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
        self._forget_server_call(call)
        await self._send_end(call, error)

    async def _send_reply(self, call: _ServerCall, reply: protocol.WireMessage) -> None:
        payload = protocol.encode(reply)
        frame = protocol.ReplyFrame(
            request_id=call.context.request_id,
            seq=call.next_seq,
            payload=msgspec.Raw(payload),
            instance_id=self.instance_id,
        )
        await self._publish(
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
            await self.nc.publish(call.reply_subject, protocol.encode(end))

    def _cancel_server_call(self, call: _ServerCall, error: RemoteError) -> None:
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
        call = self._server_calls.get(cancel.reply_subject)
        if call is None:
            # Instances that did not take the call remember it too, in case the cancel
            # overtook the request; the memory is short and pruned by the keepalive loop.
            self._recently_cancelled[cancel.reply_subject] = time.monotonic()
            return
        reason = RemoteError.from_message(
            protocol.ErrorMessage(code=cancel.reason, message="the caller cancelled the call")
        )
        self._cancel_server_call(call, reason)

    async def _keepalive(self) -> None:
        # Checking every half interval for calls quiet for half an interval bounds the silence
        # a caller sees to one interval.
        half = self.keepalive_interval / 2
        while True:
            await asyncio.sleep(half)
            now = time.monotonic()
            for call in list(self._server_calls.values()):
                if now - call.last_sent >= half:
                    await self._send_keepalive(call)
            forget_before = now - _CANCELLED_MEMORY_S
            for subject in [s for s, t in self._recently_cancelled.items() if t < forget_before]:
                del self._recently_cancelled[subject]

    async def _send_keepalive(self, call: _ServerCall) -> None:
        if not self.nc.is_connected:
            return
        call.last_sent = time.monotonic()
        keepalive = protocol.KeepaliveFrame(
            request_id=call.context.request_id, instance_id=self.instance_id
        )
        with contextlib.suppress(nats.errors.Error):
            await self.nc.publish(
                call.reply_subject, protocol.encode(keepalive), reply=call.probe_subject
            )

    # -- calling --------------------------------------------------------------------------------

    def client(self, component: str, endpoint: str) -> Client:
        return Client(self, _check_name("component", component), _check_name("endpoint", endpoint))

    async def _publish(self, subject: str, data: bytes, what: str, reply: str = "") -> None:
        if len(data) > self.nc.max_payload:
            raise PayloadTooLarge(
                None,
                f"{what} of {len(data)} bytes exceeds the NATS max payload of "
                f"{self.nc.max_payload} bytes: move tensors and media bytes through "
                "mmserve.transfer and send the TensorHandle instead",
            )
        if not self.nc.is_connected:
            raise Disconnected(None, "not connected to NATS (reconnecting)")
        try:
            await self.nc.publish(subject, data, reply=reply)
        except nats.errors.Error as exc:
            raise Disconnected(None, f"publish to {subject} failed: {exc!r}") from exc

    def _open_call(
        self, request_id: str, endpoint: tuple[str, str], instance_id: str
    ) -> _CallerCall:
        self._next_call += 1
        call = _CallerCall(
            reply_subject=f"{self._inbox_prefix}.{self._next_call}",
            request_id=request_id,
            endpoint=endpoint,
            instance_id=instance_id,
            frames=asyncio.Queue(maxsize=self.max_pending_replies),
        )
        self._caller_calls[call.reply_subject] = call
        if endpoint not in self._liveness_tasks:
            self._liveness_tasks[endpoint] = asyncio.create_task(
                self._fail_calls_of_dead_instances(*endpoint), name="mmserve-call-liveness"
            )
        return call

    async def _fail_calls_of_dead_instances(self, component: str, endpoint: str) -> None:
        """Fail open calls served by an instance whose heartbeats stopped, sooner than their idle
        timeout would. Instances that deregister (graceful shutdown) still finish their calls."""
        try:
            watcher = await self.watch(component, endpoint)
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            log.debug("no liveness for calls to %s.%s: %r", component, endpoint, exc)
            return
        async for event in watcher.events():
            if event.kind != "removed" or not event.expired:
                continue
            dead = event.record.instance_id
            calls = [
                call
                for call in self._caller_calls.values()
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
                        None, f"instance {dead} of {component}.{endpoint} stopped heartbeating"
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
            await self.nc.request(probe, b"", timeout=_LIVENESS_PROBE_TIMEOUT_S)
        except nats.errors.TimeoutError:
            return True
        except nats.errors.Error:  # no responders, or our own connection is gone
            return False
        return True

    def _close_call(self, call: _CallerCall, reason: str) -> None:
        self._caller_calls.pop(call.reply_subject, None)
        if call.ended or not self.nc.is_connected:
            return
        cancel = protocol.CancelFrame(
            request_id=call.request_id, reply_subject=call.reply_subject, reason=reason
        )
        self._spawn(self._send_cancel(cancel))

    async def _send_cancel(self, cancel: protocol.CancelFrame) -> None:
        with contextlib.suppress(nats.errors.Error):
            await self.nc.publish(
                f"{SUBJECT_ROOT}.{self.namespace}._cancel", protocol.encode(cancel)
            )

    async def _on_reply(self, msg: Msg) -> None:
        no_responders = bool(msg.headers and msg.headers.get("Status") == _NO_RESPONDERS)
        served = self._server_calls_by_probe.get(msg.subject)
        if served is not None:
            if no_responders:
                self._cancel_server_call(
                    served, Cancelled(None, "the caller is gone (nothing listens for replies)")
                )
            return
        call = self._caller_calls.get(msg.subject)
        if call is None:
            return
        if no_responders:
            call.fail(Unavailable(None, "no instance serves this endpoint"))
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
                    f"more than {self.max_pending_replies} replies unread: call cancelled",
                )
            )

    def _on_disconnected(self) -> None:
        for call in list(self._caller_calls.values()):
            call.fail(Disconnected(None, "connection to NATS lost while the call was open"))
        for server_call in list(self._server_calls.values()):
            self._cancel_server_call(
                server_call, Disconnected(None, "the serving instance lost its NATS connection")
            )

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- events ---------------------------------------------------------------------------------

    def event_subject(self, topic: str) -> str:
        return f"{SUBJECT_ROOT}.{self.namespace}._events.{_check_name('topic', topic)}"

    async def publish(self, topic: str, message: protocol.WireMessage) -> None:
        """Fire-and-forget broadcast of `message` to every subscriber of `topic` (KV events,
        load reports). Raises `PayloadTooLarge` or `Disconnected` like a call."""
        await self._publish(self.event_subject(topic), protocol.encode(message), topic)

    async def subscribe(
        self,
        topic: str,
        message_type: type[M],
        callback: Callable[[M], Awaitable[None]],
    ) -> Subscription:
        """Call `callback(message)` for each message on `topic`, one at a time, in order.
        Undecodable messages are logged and skipped; end with `await subscription.unsubscribe()`
        (or shutdown)."""

        async def on_message(msg: Msg) -> None:
            try:
                message = protocol.decode(msg.data, message_type)
            except protocol.ProtocolError as exc:
                log.warning("ignoring a message on %s: %s", topic, exc)
                return
            try:
                await callback(message)
            except Exception:
                log.exception("subscriber of %s failed", topic)

        return await self.nc.subscribe(self.event_subject(topic), cb=on_message)

    # -- discovery ------------------------------------------------------------------------------

    async def list_instances(
        self, component: str | None = None, endpoint: str | None = None
    ) -> list[protocol.InstanceRecord]:
        """Live instances of this namespace (optionally of one component / endpoint)."""
        return await list_instances(self.nc, self.namespace, component, endpoint)

    async def watch(
        self, component: str | None = None, endpoint: str | None = None
    ) -> InstanceWatcher:
        """A live view of the instances; stop it with `await watcher.stop()` (or shutdown)."""
        watcher = await InstanceWatcher(self.nc, self.namespace, component, endpoint).start()
        self._watchers.add(watcher)
        return watcher


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
        call = runtime._open_call(request_id, (self.component, self.endpoint), instance_id or "")
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
                    item = await asyncio.wait_for(call.frames.get(), min(left, idle))
                except asyncio.TimeoutError:
                    if time.time() >= deadline:
                        continue
                    raise Disconnected(
                        None, f"{subject} sent nothing for {idle:.1f}s: instance lost?"
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
            runtime._close_call(call, close_reason)

    async def instances(self) -> list[protocol.InstanceRecord]:
        return await self.runtime.list_instances(self.component, self.endpoint)


def run(main: Coroutine[Any, Any, R]) -> R:
    """Run a component's main coroutine on uvloop, the event loop every component uses."""
    return uvloop.run(main)
