"""Property test of the frontend's request handling: any JSON body, and any chat request made
of plausible and implausible parts, gets an answer with a documented status and OpenAI's error
shape, never a 500. Media sources are inline or refused addresses only: nothing is fetched."""

from __future__ import annotations

import asyncio
import base64
import json
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmserve.frontend.app import FrontendApp
from mmserve.frontend.chat import ChatOptions, ChatPreprocessor, ServedModel
from mmserve.media import MediaPolicy
from mmserve.protocol import PreprocessedRequest, TokenChunk
from mmserve.tiny.checkpoints import build_tiny_model

from .conftest import Trial
from .media import sample
from .streams import MODEL

DOCUMENTED = {200, 400, 404, 413}


class _OneToken:
    """The pipeline, answering every request with one token for each of its choices."""

    def ready(self) -> bool:
        return True

    async def generate(self, request: PreprocessedRequest) -> AsyncIterator[TokenChunk]:
        for choice in range(request.sampling.n):
            yield TokenChunk(
                request_id=request.request_id, token_ids=[9], finish_reason="stop", index=choice
            )

    async def reset_prefix_cache(self) -> int:
        return 1


@pytest.fixture(scope="module")
def app() -> FrontendApp:
    model = ServedModel.load(build_tiny_model("qwen2_vl"))
    return FrontendApp(ChatPreprocessor(model, ChatOptions(policy=MediaPolicy())), _OneToken())


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)
png = base64.b64encode(sample("PNG")).decode()
sources = st.one_of(
    st.just(f"data:image/png;base64,{png}"),
    st.just(png),
    st.binary(max_size=64).map(lambda b: "data:image/png;base64," + base64.b64encode(b).decode()),
    st.text(max_size=40).filter(lambda t: "://" not in t),
    st.sampled_from(["http://127.0.0.1:9/x.png", "file:///etc/passwd", "/etc/passwd", "data:,"]),
)
parts = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=40)),
    st.builds(lambda u: {"type": "image_url", "image_url": {"url": u}}, sources),
    st.builds(lambda u: {"type": "image_url", "image_url": u}, sources),
    st.dictionaries(st.sampled_from(["type", "text", "image_url"]), json_values, max_size=3),
)
messages = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "bot"]),
        "content": st.one_of(st.text(max_size=40), st.lists(parts, max_size=3), st.none()),
    }
)
requests = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, "other"]), "messages": st.lists(messages, max_size=3)},
    optional={
        "max_tokens": st.integers(-2, 5),
        "temperature": st.floats(-1, 3, allow_nan=False),
        "top_p": st.floats(-1, 2, allow_nan=False),
        "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=2)),
        "stream": st.booleans(),
        "n": st.integers(0, 3),
    },
)
bodies = st.one_of(requests.map(json.dumps), json_values.map(json.dumps), st.text(max_size=50))


def _post(app: FrontendApp, body: str) -> httpx.Response:
    async def once() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://frontend") as client:
            return await client.post(
                "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
            )

    return asyncio.run(once())


def test_any_body_gets_a_documented_answer(app: FrontendApp, trial: Trial) -> None:
    seen: Counter[int] = Counter()

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(bodies)
    def answered(body: str) -> None:
        response = _post(app, body)
        seen[response.status_code] += 1
        assert response.status_code in DOCUMENTED, (body, response.text)
        if response.status_code != 200:
            error: dict[str, Any] = response.json()["error"]
            assert error["code"] and error["message"] and error["type"], error

    answered()
    assert seen.total() >= 100
    answers = ", ".join(f"{status}: {n}" for status, n in sorted(seen.items()))
    trial("random JSON and chat bodies (hypothesis) to the frontend", seen.total(),
          f"documented statuses only ({answers}); no 500")  # fmt: skip
