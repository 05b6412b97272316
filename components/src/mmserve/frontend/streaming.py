"""One dispatched request's token chunks as the HTTP routes read them: the first-token range,
the time-to-first-token and inter-token metrics, a worker's failure as the client's error, and
the usage (the worker's, else counted here). Chat and text completions both read through it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator

from mmserve.frontend.dispatch import Dispatcher
from mmserve.frontend.errors import ApiError
from mmserve.observability import metrics, nvtx
from mmserve.protocol import ERROR_INCOMPLETE, PreprocessedRequest, TokenChunk, Usage
from mmserve.runtime.errors import RemoteError

COMPONENT = "frontend"
SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
# The frontend's series, looked up once: `labels()` validates and hashes its values each call.
_TTFT = metrics.TTFT.labels(COMPONENT)
_ITL = metrics.ITL.labels(COMPONENT)


class ChunkReader:
    """Reads one request's chunks from the dispatcher (once), observing each."""

    def __init__(
        self, dispatcher: Dispatcher, preprocessed: PreprocessedRequest, arrival: float
    ) -> None:
        self._dispatcher = dispatcher
        self.preprocessed = preprocessed
        self._arrival = arrival
        self.completion_tokens = 0
        self.worker_usage: Usage | None = None  # the last chunk's
        self.finished = False  # every choice has had its finish reason
        self._last_token_at: float | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.preprocessed.plan.token_ids)

    async def chunks(self) -> AsyncGenerator[TokenChunk]:
        """The chunks up to the one that finishes the last unfinished choice (`finished` is
        set as it comes); a worker's failure, or a stream that ends before, raises the
        `ApiError` the client sees."""
        chunks = self._dispatcher.generate(self.preprocessed)
        unfinished = set(range(self.preprocessed.sampling.n))
        first_token = nvtx.range_start(nvtx.FE_FIRST_TOKEN)
        try:
            async with contextlib.aclosing(chunks):  # type: ignore[type-var]
                async for chunk in chunks:
                    if first_token is not None:
                        nvtx.range_end(first_token)
                        first_token = None
                    self._observe(chunk)
                    if chunk.finish_reason is not None:
                        unfinished.discard(chunk.index)
                    self.finished = not unfinished
                    yield chunk
                    if self.finished:
                        return
        except RemoteError as err:
            raise ApiError(err.code, err.message, status=err.status) from err
        finally:
            if first_token is not None:
                nvtx.range_end(first_token)
        if not self.finished:
            raise ApiError(ERROR_INCOMPLETE, "the worker ended the stream without finishing")

    def _observe(self, chunk: TokenChunk) -> None:
        now = time.perf_counter()
        if chunk.token_ids:
            if self._last_token_at is None:
                _TTFT.observe(now - self._arrival)
            else:
                _ITL.observe(now - self._last_token_at)
            self._last_token_at = now
        self.completion_tokens += len(chunk.token_ids)
        if chunk.usage is not None:
            self.worker_usage = chunk.usage

    def usage(self) -> Usage:
        """The worker's usage (its last chunk carries it), else counted here."""
        if self.worker_usage is not None:
            return self.worker_usage
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens)
