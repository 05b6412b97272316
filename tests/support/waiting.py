"""Waiting on a condition instead of sleeping for a time that is usually long enough."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


def wait_until(
    predicate: Callable[[], object], timeout: float = 10.0, what: str = "", interval: float = 0.05
) -> None:
    """Return once `predicate()` is true; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what or predicate} not within {timeout} s"
        time.sleep(interval)


async def wait_until_async(
    predicate: Callable[[], object | Awaitable[object]],
    timeout: float = 10.0,
    what: str = "",
    interval: float = 0.05,
) -> None:
    """`wait_until` for a test on an event loop: `predicate` may be a coroutine function, and
    the loop runs between checks."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        assert time.monotonic() < deadline, f"{what or predicate} not within {timeout} s"
        await asyncio.sleep(interval)
