"""The one retry policy for an instance that is gone: every hop that calls a routed instance
(the frontend, the encode worker, decode calling prefill) streams through `stream_with_retry`.

A call addressed to one instance that fails as `Unavailable` before its first reply (the
instance left, or refused the request as overloaded) is made again: `attempt` is asked for the
request and the instance once more, with the instances that refused so far, and may pick another
one (the frontend's router) or any instance of the component (`instance_id` None). Once a reply
has arrived the failure is the caller's to see: a request is never run twice.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, TypeVar

from mmserve import protocol
from mmserve.runtime.calling import Client
from mmserve.runtime.errors import Unavailable

log = logging.getLogger(__name__)

R = TypeVar("R")

Attempt = Callable[[Sequence[str]], tuple[protocol.WireMessage, str | None]]
"""`attempt(gone)` -> (the request, the instance to address or None for any instance), the
instances in `gone` having refused it; raises `Unavailable` when none is left."""


async def stream_with_retry(
    client: Client,
    reply_type: type[R] | Any,
    attempt: Attempt,
    *,
    request_id: str,
    deadline: float,
) -> AsyncGenerator[R, None]:
    gone: list[str] = []
    while True:
        request, instance_id = attempt(gone)
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
            if replied or instance_id is None:
                raise
            log.warning(
                "request %s: %s instance %s unavailable (%s); trying another",
                request_id,
                client.component,
                instance_id,
                exc.message,
            )
            gone.append(instance_id)


def stream_routed(
    client: Client,
    request: protocol.WireMessage,
    reply_type: type[R] | Any,
    *,
    instance_id: str | None,
    request_id: str,
    deadline: float,
) -> AsyncGenerator[R, None]:
    """`client.stream` to the instance the router chose (`instance_id`), or to any instance
    once that one refused (or when none was chosen)."""

    def attempt(gone: Sequence[str]) -> tuple[protocol.WireMessage, str | None]:
        return request, None if gone else instance_id

    return stream_with_retry(client, reply_type, attempt, request_id=request_id, deadline=deadline)
