"""A thread that polls non-blocking completion checks off the event loop.

asyncio timers resolve to about a millisecond (epoll), too coarse for transfers that take tens
of microseconds. The thread polls every `MIN_POLL_INTERVAL_S` for `FAST_POLL_WINDOW_S` after
the last new work or completion (when answers are due), then backs off to
`MAX_POLL_INTERVAL_S` (a peer that takes its time costs little CPU), and parks on an Event when
nothing is pending.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

MIN_POLL_INTERVAL_S = 20e-6
MAX_POLL_INTERVAL_S = 1e-3
FAST_POLL_WINDOW_S = 20e-3

Completion = TypeVar("Completion")


class ProgressThread(Generic[Completion]):
    """Calls `poll()` while `has_pending()`; hands non-empty results to `deliver` on `loop`.
    While `busy()` (work that moves only when polled, like a NIXL transfer without a progress
    thread) it never backs off."""

    def __init__(
        self,
        name: str,
        *,
        poll: Callable[[], list[Completion]],
        has_pending: Callable[[], bool],
        deliver: Callable[[list[Completion]], None],
        loop: asyncio.AbstractEventLoop,
        busy: Callable[[], bool] = lambda: False,
    ) -> None:
        self._poll = poll
        self._has_pending = has_pending
        self._busy = busy
        self._deliver = deliver
        self._loop = loop
        self._work = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._work.set()

    def stop(self) -> None:
        self._stopped = True
        self._work.set()
        self._thread.join()

    def _run(self) -> None:
        interval = MIN_POLL_INTERVAL_S
        last_activity = time.monotonic()
        while not self._stopped:
            if self._work.is_set():
                self._work.clear()
                last_activity = time.monotonic()
            if not self._has_pending():
                self._work.wait()
                continue
            try:
                completions = self._poll()
            except Exception:
                logger.exception("transfer progress poll failed")
                completions = []
            now = time.monotonic()
            if completions:
                try:
                    self._loop.call_soon_threadsafe(self._deliver, completions)
                except RuntimeError:  # the loop is closed: nobody is waiting any more
                    return
                last_activity = now
            if self._busy() or now - last_activity < FAST_POLL_WINDOW_S:
                interval = MIN_POLL_INTERVAL_S
            else:
                interval = min(interval * 2, MAX_POLL_INTERVAL_S)
            time.sleep(interval)
