"""Events: fire-and-forget broadcasts on a topic of the namespace (the cache events)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from mmserve import protocol

if TYPE_CHECKING:
    from mmserve.runtime.connection import Runtime

log = logging.getLogger(__name__)

M = TypeVar("M")


async def publish(runtime: Runtime, topic: str, message: protocol.WireMessage) -> None:
    await runtime._publish(runtime.event_subject(topic), protocol.encode(message), topic)


async def subscribe(
    runtime: Runtime,
    topic: str,
    message_type: type[M],
    callback: Callable[[M], Awaitable[None]],
) -> Subscription:
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

    return await runtime.nc.subscribe(runtime.event_subject(topic), cb=on_message)
