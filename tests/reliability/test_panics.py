"""A Rust panic reaches Python as pyo3's `PanicException`, which derives from BaseException,
not Exception: code that catches `Exception` lets it through. A served handler that meets one
must still answer its caller with an error at once, and the endpoint must keep serving; the
HTTP frontend must answer it with its own 500 JSON error."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from types import SimpleNamespace

import httpx
import pytest

from mmserve import protocol as p
from mmserve.frontend.app import FrontendApp
from mmserve.frontend.chat import ChatOptions
from mmserve.frontend.mm_options import PixelRange
from mmserve.media import MediaPolicy
from mmserve.runtime import RemoteError, RequestContext, Runtime

from .conftest import Trial


class PanicException(BaseException):
    """Stands in for `pyo3_runtime.PanicException` (not importable from Python)."""


async def _panics(request: p.TokenChunk, ctx: RequestContext) -> AsyncIterator[p.TokenChunk]:
    if request.text == "panic":
        raise PanicException("index out of bounds: the len is 3 but the index is 7")
    yield p.TokenChunk(request_id=ctx.request_id, text="fine")


async def test_a_panicking_handler_answers_internal_and_keeps_serving(
    nats_url: str, trial: Trial
) -> None:
    namespace = f"panic-{uuid.uuid4().hex[:8]}"
    # The idle timeout is the backstop for an answer that never comes: make it long, so only
    # a real error answer can end the call within the bound below.
    async with await Runtime.connect(nats_url, namespace, idle_timeout=60) as runtime:
        await runtime.serve("svc", "generate", _panics, p.TokenChunk)
        client = runtime.client("svc", "generate")
        for _ in range(3):
            started = time.monotonic()
            with pytest.raises(RemoteError) as raised:
                async for _chunk in client.stream(
                    p.TokenChunk(request_id="", text="panic"), p.TokenChunk, timeout=30
                ):
                    pass
            assert raised.value.code == p.ERROR_INTERNAL, raised.value
            assert "PanicException" in raised.value.message
            assert time.monotonic() - started < 10
            replies = [
                chunk.text
                async for chunk in client.stream(
                    p.TokenChunk(request_id="", text="ok"), p.TokenChunk, timeout=30
                )
            ]
            assert replies == ["fine"]
    trial("a handler raising a PanicException (BaseException)", 3,
          "caller gets `internal` at once; the next call is served")  # fmt: skip


class _PanickingPreprocessor:
    """The part of `ChatPreprocessor` the app calls first; it meets a panic."""

    options = ChatOptions(policy=MediaPolicy())
    model = SimpleNamespace(name="m")  # the app names it in its OpenAPI document
    pixel_range = PixelRange(3136, 12845056, model=(3136, 12845056))  # and the pixel bounds
    video_range = None  # and that it takes no video
    pan_and_scan = None  # nor pans and scans
    audio_in_video = False  # nor serves a video's own audio track

    def validate(self, request: p.ChatCompletionRequest) -> None:
        raise PanicException("attempt to multiply with overflow")


class _NoDispatcher:
    def ready(self) -> bool:
        return True


async def test_a_panic_in_the_frontend_answers_500_json(trial: Trial) -> None:
    app = FrontendApp(_PanickingPreprocessor(), _NoDispatcher())  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://frontend") as client:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(2):
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 500
            assert response.json()["error"]["code"] == "internal"
    trial("a PanicException while the frontend handles a request", 2,
          "500 with OpenAI's error JSON, code internal")  # fmt: skip
