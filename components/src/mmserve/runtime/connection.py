"""The runtime: one NATS connection, its namespace, and its life from connect to drain.

Components over NATS serve named endpoints (`serving`), call them with one reply or a stream
(`calling`), broadcast on topics (`events`) and discover each other (`discovery`); the subjects
are in `subjects`. A `Runtime` holds what they share: the connection, the namespace, the
instance id, the inbox its calls are answered on, and shutdown (deregister, stop taking
requests, drain in-flight work under a timeout, cancel the rest, drain NATS).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sys
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import nats
import nats.errors
import uvloop
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from mmserve import protocol
from mmserve.runtime import events
from mmserve.runtime.calling import Caller, Client
from mmserve.runtime.discovery import InstanceWatcher, list_instances
from mmserve.runtime.errors import Cancelled, Disconnected, PayloadTooLarge
from mmserve.runtime.nats_options import nats_connect_options, nats_servers
from mmserve.runtime.serving import Handler, ServedEndpoint, Server
from mmserve.runtime.subjects import check_name, endpoint_subject, event_subject

log = logging.getLogger(__name__)

R = TypeVar("R")
M = TypeVar("M")

DEFAULT_NAMESPACE = "mmserve"
_NO_RESPONDERS = "503"


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
        self.namespace = check_name("namespace", namespace)
        self.instance_id = secrets.token_hex(8)
        self.keepalive_interval = keepalive_interval
        self.idle_timeout = idle_timeout
        self.default_timeout = default_timeout
        self.max_pending_replies = max_pending_replies
        self.graceful_timeout = graceful_timeout
        self.should_exit = asyncio.Event()
        self._force_exit = asyncio.Event()
        self._stopping = False
        self._inbox_prefix = f"_INBOX.{secrets.token_hex(11)}"
        self._next_inbox = 0
        self._background: set[asyncio.Task[Any]] = set()
        # Weak: watchers stopped by their owners and dropped leave no trace here.
        self._watchers: weakref.WeakSet[InstanceWatcher] = weakref.WeakSet()
        self._server = Server(self)
        self._caller = Caller(self)
        self._inbox_subscription: Subscription | None = None
        self._disconnected_at: float | None = None

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
        """Connect to NATS (`url`, else `$NATS_URL`, else the default loopback URL; several
        servers separated by commas; TLS and credentials from the environment, see
        `nats_options`).

        The first connection is retried for `connect_wait` seconds, then `Disconnected` is
        raised. Once connected, it reconnects forever after a connection loss (to any server
        listed or announced by the cluster); calls open at that moment fail with
        `Disconnected` and calls made while disconnected fail at once.
        """
        servers = nats_servers(url)
        url = ",".join(servers)
        runtime: Runtime | None = None

        async def on_disconnected() -> None:
            if runtime is not None:
                runtime._on_disconnected()

        async def on_reconnected() -> None:
            if runtime is not None:
                runtime._on_reconnected()

        refusals: list[Exception] = []  # the server's -ERR says more than "no servers"

        async def on_error(exc: Exception) -> None:
            log.debug("nats: %r", exc)
            if runtime is None and isinstance(exc, nats.errors.Error):
                refusals.append(exc)

        try:
            options = nats_connect_options()
            nc = await nats.connect(
                servers,
                name=name or f"mmserve-{os.getpid()}",
                reconnect_time_wait=reconnect_time_wait,
                max_reconnect_attempts=max(1, round(connect_wait / reconnect_time_wait)),
                connect_timeout=2,
                allow_reconnect=True,
                disconnected_cb=on_disconnected,
                reconnected_cb=on_reconnected,
                error_cb=on_error,
                **options,
            )
        except (OSError, ValueError, nats.errors.Error) as exc:
            refused = f", refused: {refusals[-1]!r}" if refusals and refusals[-1] is not exc else ""
            cause = f"{exc!r}{refused}"
            raise Disconnected(None, f"cannot connect to NATS at {url}: {cause}") from exc
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
            f"{self._inbox_prefix}.*", cb=self._on_inbox
        )
        await self._server.start()

    async def __aenter__(self) -> Runtime:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    def install_signal_handlers(self) -> None:
        """SIGINT/SIGTERM set `should_exit` (the owner then leaves discovery, drains and shuts
        down); a second one also cuts the drain short."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._on_signal)

    def _on_signal(self) -> None:
        if self.should_exit.is_set():
            self._force_exit.set()
        else:
            log.info("stopping: leaving discovery, draining for up to %g s", self.graceful_timeout)
        self.should_exit.set()

    async def leave_discovery(self) -> None:
        """Deregister every endpoint and stop taking requests; what is in flight goes on."""
        await self._server.leave_discovery()

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
        timeout = self.graceful_timeout if graceful_timeout is None else graceful_timeout
        await self._server.close(timeout, self._force_exit)
        for watcher in list(self._watchers):
            await watcher.stop()
        self._caller.fail_all(Cancelled(None, "runtime shut down"))
        self._server.stop_keepalives()
        self._caller.stop()
        if self._background:  # last end and cancel frames: let them go out before the drain
            await asyncio.wait(self._background, timeout=1.0)
        with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
            if self.nc.is_connected:
                await asyncio.wait_for(self.nc.drain(), timeout=5.0)
        await self.nc.close()

    # -- serving and calling --------------------------------------------------------------------

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
        return await self._server.serve(component, endpoint, handler, request_type, facts=facts)

    def endpoint_subject(self, component: str, endpoint: str) -> str:
        return endpoint_subject(self.namespace, component, endpoint)

    def client(self, component: str, endpoint: str) -> Client:
        return Client(self, check_name("component", component), check_name("endpoint", endpoint))

    # -- events ---------------------------------------------------------------------------------

    def event_subject(self, topic: str) -> str:
        return event_subject(self.namespace, topic)

    async def flush(self) -> None:
        """Return once the server has processed everything sent so far (a subscription made
        before it receives every message published after it)."""
        await flush_in_order(self.nc)

    async def publish(self, topic: str, message: protocol.WireMessage) -> None:
        """Fire-and-forget broadcast of `message` to every subscriber of `topic` (the cache
        events). Raises `PayloadTooLarge` or `Disconnected` like a call."""
        await events.publish(self, topic, message)

    async def subscribe(
        self,
        topic: str,
        message_type: type[M],
        callback: Callable[[M], Awaitable[None]],
    ) -> Subscription:
        """Call `callback(message)` for each message on `topic`, one at a time, in order.
        Undecodable messages are logged and skipped; end with `await subscription.unsubscribe()`
        (or shutdown)."""
        return await events.subscribe(self, topic, message_type, callback)

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

    # -- what serving, calling and events share -------------------------------------------------

    def _inbox_subject(self, kind: str) -> str:
        """A new subject under this runtime's inbox: `kind` "" for a call's replies, "s" for
        the reply subject of a served call's frames."""
        self._next_inbox += 1
        return f"{self._inbox_prefix}.{kind}{self._next_inbox}"

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

    async def _on_inbox(self, msg: Msg) -> None:
        no_responders = bool(msg.headers and msg.headers.get("Status") == _NO_RESPONDERS)
        if not self._server.on_probe_reply(msg.subject, no_responders):
            self._caller.on_reply(msg, no_responders)

    def _on_disconnected(self) -> None:
        if not self._stopping and self._disconnected_at is None:
            log.warning("lost the connection to NATS; reconnecting")
            self._disconnected_at = time.monotonic()
        self._caller.fail_all(Disconnected(None, "connection to NATS lost while the call was open"))
        self._server.on_disconnected()

    def _on_reconnected(self) -> None:
        """Say when and where the connection came back: a component that lost NATS for long
        (its discovery beats missed meanwhile) shows in its log."""
        since, self._disconnected_at = self._disconnected_at, None
        after = "" if since is None else f" after {time.monotonic() - since:.1f} s"
        server = self.nc.connected_url
        log.info("reconnected to NATS at %s%s", server.netloc if server else "?", after)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def flush_in_order(nc: NatsClient) -> None:
    """`nc.flush()` made to mean what it says. nats-py 2.16 writes the flush's PING straight to
    the socket, ahead of commands still queued for its flusher task, so one PONG proves nothing
    about a SUB or PUB just issued. The flusher runs before the first PONG can be read (it was
    woken first), so the second PING leaves behind those commands and its PONG follows them."""
    await nc.flush()
    await nc.flush()


def run(main: Coroutine[Any, Any, R]) -> R:
    """Run a component's main coroutine on uvloop, the event loop every component uses."""
    return uvloop.run(main)


def run_component(name: str, main: Coroutine[Any, Any, int]) -> int:
    """`run(main)` for a component's command: one that cannot start says why in one line on
    stderr (exit status 1) instead of a traceback."""
    try:
        return run(main)
    except SystemExit:
        raise
    except Exception as exc:
        print(f"{name}: cannot start: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
