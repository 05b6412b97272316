"""Calls that honour the router's choice of instance (`PreprocessedRequest.route`).

A hop that forwards a request to a routed component (the encode worker to `worker` or
`decode`, decode to `prefill`) addresses the instance the frontend's router chose. If that
instance is gone by then, or refuses the request as overloaded, the call falls back to any
instance of the component rather than failing.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import Any, TypeVar

from mmserve import protocol
from mmserve.runtime import Client, Unavailable

log = logging.getLogger(__name__)

R = TypeVar("R")


async def stream_routed(
    client: Client,
    request: protocol.WireMessage,
    reply_type: type[R] | Any,
    *,
    instance_id: str | None,
    request_id: str,
    deadline: float,
) -> AsyncGenerator[R, None]:
    """`client.stream` to `instance_id` when given; on `Unavailable` before its first reply,
    to any instance of the component."""
    if instance_id:
        replied = False
        replies = client.stream(
            request, reply_type, instance_id=instance_id, request_id=request_id, deadline=deadline
        )
        try:
            async with contextlib.aclosing(replies):
                async for reply in replies:
                    replied = True
                    yield reply
            return
        except Unavailable as exc:
            if replied:
                raise
            log.warning(
                "request %s: routed %s instance %s unavailable (%s); any instance takes it",
                request_id,
                client.component,
                instance_id,
                exc.message,
            )
    replies = client.stream(request, reply_type, request_id=request_id, deadline=deadline)
    async with contextlib.aclosing(replies):
        async for reply in replies:
            yield reply
