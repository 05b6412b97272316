"""The frontend's graceful stop.

On the first SIGTERM or SIGINT the frontend drains: `/health` answers 503 `draining` (a load
balancer stops sending here), the requests in flight go on, and the HTTP server stops once none
is left or `--drain-timeout` has passed; uvicorn then closes the connections and cancels what
still runs within a second. A second signal stops at once. A drained frontend exits 0: uvicorn's
own handler would re-raise the signal after its shutdown, so that the process died by it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from types import FrameType

import uvicorn

log = logging.getLogger("mmserve.frontend")


class Drain:
    """What the app and the server share about stopping: the requests in flight (every route
    but `/health` and `/metrics`, which probes call) and the drain's deadline."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.in_flight = 0
        self._deadline: float | None = None

    @property
    def draining(self) -> bool:
        return self._deadline is not None

    def begin(self) -> None:
        if self._deadline is None:
            self._deadline = time.monotonic() + self.timeout_s
            log.info(
                "draining: %d requests in flight, stopping when they end or in %g s",
                self.in_flight,
                self.timeout_s,
            )

    def over(self) -> bool:
        """Whether the server should stop now: draining, and nothing left or out of time."""
        if self._deadline is None:
            return False
        return self.in_flight == 0 or time.monotonic() >= self._deadline

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server, stopped by `Drain` rather than at the first signal."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # The signal is not recorded for uvicorn to re-raise after its shutdown.
        if self.drain.draining:
            self.force_exit = True
            self.should_exit = True
        else:
            self.drain.begin()

    async def on_tick(self, counter: int) -> bool:
        # Called every 0.1 s by uvicorn's main loop, which stops once this returns True.
        return await super().on_tick(counter) or self.drain.over()
