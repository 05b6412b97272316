"""The one log line and outcome a request's bookkeeping gives, however its stream ends."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

import pytest

from mmserve.protocol import PreprocessedRequest, RequestPlan, TokenChunk
from mmserve.roles.tracking import tracked

REQUEST = PreprocessedRequest(
    request_id="req-1", deadline=0.0, model="m", plan=RequestPlan(token_ids=[1, 2, 3])
)


async def relay(chunks: list[TokenChunk]) -> AsyncGenerator[TokenChunk, None]:
    """A hop that passes chunks on and then waits for its own upstream's end."""
    with tracked("encode", REQUEST) as progress:
        for chunk in chunks:
            yield progress.passing(chunk)
        await asyncio.Event().wait()  # never: the caller closes the stream


async def read(count: int, chunks: list[TokenChunk]) -> None:
    stream = relay(chunks)
    async with contextlib.aclosing(stream):
        for _ in range(count):
            await anext(stream)


STREAM = [
    TokenChunk(request_id="req-1", token_ids=[5]),
    TokenChunk(request_id="req-1", token_ids=[6], finish_reason="stop"),
]


@pytest.mark.parametrize(("read_chunks", "outcome"), [(2, "done"), (1, "cancelled")])
async def test_a_stream_closed_after_its_last_chunk_counts_as_done(
    read_chunks: int, outcome: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="mmserve.worker"):
        await read(read_chunks, STREAM)
    assert f"encode request req-1 {outcome}: 3 prompt ids" in caplog.text
