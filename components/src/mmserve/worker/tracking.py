"""Per-request bookkeeping every handler shares: metrics, typed errors, one log line."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator

from mmserve.observability import metrics
from mmserve.protocol import PreprocessedRequest
from mmserve.runtime import RemoteError
from mmserve.worker.errors import typed_errors

log = logging.getLogger("mmserve.worker")


@contextlib.contextmanager
def tracked(component: str, request: PreprocessedRequest) -> Iterator[None]:
    """Count the request and its errors, turn failures into the `RemoteError` the caller
    should see, and log one line with its outcome, however it ends."""
    started = time.perf_counter()
    metrics.REQUESTS.labels(component).inc()
    metrics.ACTIVE.labels(component).inc()
    outcome = "failed"
    try:
        with typed_errors():
            yield
        outcome = "done"
    except (asyncio.CancelledError, GeneratorExit):
        outcome = "cancelled"
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
