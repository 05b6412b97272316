"""Per-request bookkeeping every handler shares: metrics, typed errors, one log line."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

from mmserve.observability import metrics
from mmserve.protocol import PreprocessedRequest, TokenChunk
from mmserve.roles.errors import typed_errors
from mmserve.runtime.errors import RemoteError

log = logging.getLogger("mmserve.worker")

T = TypeVar("T")


@dataclass
class Progress:
    """How far a streamed request got: once its last chunk has passed, the caller may close
    the stream before this hop reads the end, and the request still counts as done."""

    finished: bool = False

    def passing(self, reply: T) -> T:
        """Note `reply` on its way to the caller: a stream of token chunks ends with the one
        that has a finish reason."""
        if isinstance(reply, TokenChunk) and reply.finish_reason is not None:
            self.finished = True
        return reply


@contextlib.contextmanager
def tracked(component: str, request: PreprocessedRequest) -> Iterator[Progress]:
    """Count the request and its errors, turn failures into the `RemoteError` the caller
    should see, and log one line with its outcome, however it ends."""
    started = time.perf_counter()
    metrics.REQUESTS.labels(component).inc()
    metrics.ACTIVE.labels(component).inc()
    progress = Progress()
    outcome = "failed"
    try:
        with typed_errors():
            yield progress
        outcome = "done"
    except (asyncio.CancelledError, GeneratorExit):
        outcome = "done" if progress.finished else "cancelled"
        raise
    except RemoteError as exc:
        metrics.ERRORS.labels(component, exc.code).inc()
        raise
    finally:
        metrics.ACTIVE.labels(component).dec()
        log.info(
            "%s request %s %s: %d prompt ids, %d media, %.1f ms",
            component,
            request.request_id,
            outcome,
            len(request.plan.token_ids),
            len(request.plan.media),
            (time.perf_counter() - started) * 1000,
        )
