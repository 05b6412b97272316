"""Dynamo stopping a request (its client gone, the router's cancel): the part of Dynamo's request
context a handler reads (`StopSignal`), and steps and streams that end with `RequestStopped` once
Dynamo stops the request, their work in flight cancelled (which aborts the engine's request)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol, TypeVar

log = logging.getLogger("mmserve.dynamo")

T = TypeVar("T")


class RequestStopped(asyncio.CancelledError):
    """Dynamo stopped the request: counted and logged as cancelled, then the stream ends."""

    @classmethod
    def logged(cls, context: StopSignal) -> RequestStopped:
        log.info("request %s stopped by Dynamo", context.id())
        return cls(f"request {context.id()} stopped by Dynamo")


class StopSignal(Protocol):
    """The part of Dynamo's request `Context` the handler reads."""

    def id(self) -> str: ...

    def is_stopped(self) -> bool: ...

    def is_killed(self) -> bool: ...

    def async_killed_or_stopped(self) -> Any: ...


async def until_stopped(items: AsyncIterator[T], context: StopSignal) -> AsyncIterator[T]:
    """`items` until they end, or until Dynamo stops the request (client gone, router cancel):
    then the step in flight is cancelled, which aborts the engine's request, and
    `RequestStopped` raised."""
    stopped = asyncio.ensure_future(context.async_killed_or_stopped())
    try:
        while True:
            try:
                item = await _first_unless_stopped(anext(items), stopped, context)
            except StopAsyncIteration:
                return
            yield item
    finally:
        stopped.cancel()
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()


async def unless_stopped(step: Awaitable[T], context: StopSignal) -> T:
    """What `step` returns, unless Dynamo stops the request first: then `step` is cancelled (an
    encode in flight, the encode worker's reply awaited) and `RequestStopped` raised."""
    stopped = asyncio.ensure_future(context.async_killed_or_stopped())
    try:
        return await _first_unless_stopped(step, stopped, context)
    finally:
        stopped.cancel()


async def _first_unless_stopped(
    step: Awaitable[T], stopped: asyncio.Future[Any], context: StopSignal
) -> T:
    """What `step` returns, or `RequestStopped` (`step` cancelled) once `stopped` is done."""
    running = asyncio.ensure_future(step)
    await asyncio.wait({running, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if not running.done():
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
            await running
        raise RequestStopped.logged(context)
    return running.result()
