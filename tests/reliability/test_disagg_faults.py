"""SIGKILL of the encode, prefill or decode worker of an E/P/D deployment (mock engine) while a
request is inside it: the client gets an error (a 5xx before the first token, an error event
after it) well within the bound, never a hang; a restarted encode worker serves again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.deployment import Deployment, free_port, serve_directory
from tests.support.images import photo_like
from tests.support.waiting import wait_until_async

from .conftest import Trial, metric, restart_worker
from .streams import BOUND_S, chat_body, stream_chat

# Prefill takes 0.2 s per uncached prompt token (a few seconds per prompt), so a kill lands
# inside it; decode 10 ms per token.
SLOW_PREFILL = ["--engine", "mock", "--mock-prefill-us-per-token", "200000"]
# Encode takes 0.1 s per image token: the 320x240 photo (88 tokens) takes 8.8 s, the 90x60
# one a fraction of a second.
SLOW_ENCODE = ["--engine", "mock", "--mock-encode-us-per-token", "100000"]
ENCODE_METRICS_PORT = free_port()
WITH_ENCODE_METRICS = [
    ("encode", "encode", ["--metrics-port", str(ENCODE_METRICS_PORT)]),
    ("prefill", "prefill", []),
    ("decode", "decode", []),
]


@pytest.fixture
def e_p_d(
    request: pytest.FixtureRequest, nats_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    flags, components = request.param
    deployment = Deployment(
        "e_p_d",
        build_tiny_model("qwen2_vl"),
        nats_url,
        tmp_path_factory.mktemp("epd-fault-logs"),
        worker_flags=flags,
        components=components,
    )
    with deployment.running():
        yield deployment


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("fault-images")
    photo_like(320, 240, 1).save(root / "photo.jpg", quality=90)
    photo_like(90, 60, 3).save(root / "small.png")
    with serve_directory(root) as (url, _server):
        yield url


def image_chat(max_tokens: int, url: str) -> dict[str, object]:
    body = chat_body(max_tokens)
    body["messages"] = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "Describe the image."},
            ],
        }
    ]
    return body


@pytest.mark.parametrize(
    "e_p_d", [pytest.param((SLOW_PREFILL, []), id="slow-prefill")], indirect=True
)
@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_sigkill_inside_a_request(e_p_d: Deployment, trial: Trial, victim: str) -> None:
    async def run() -> tuple[int, str | None, float]:
        async with httpx.AsyncClient(base_url=e_p_d.base_url, timeout=120) as client:
            first = asyncio.Event()
            stream = asyncio.ensure_future(
                stream_chat(client, chat_body(6000, "Once upon a time"), first)
            )
            if victim == "decode":
                await asyncio.wait_for(first.wait(), 120)
            else:
                await asyncio.sleep(1.5)  # inside the prefill of ~20 prompt tokens
                assert not first.is_set()
            e_p_d.kill(victim)
            killed_at = time.monotonic()
            outcome = await asyncio.wait_for(stream, BOUND_S)
            assert not outcome.finished and outcome.error, outcome
            return outcome.status, outcome.error, outcome.ended_at - killed_at

    status, code, ended = asyncio.run(run())
    assert (status >= 500) if victim == "prefill" else (status == 200), (status, code)
    for name, process in e_p_d.processes.items():
        if name != victim:
            assert process.poll() is None, f"{name} exited:\n{e_p_d.log(name)[-2000:]}"
    how = f"HTTP {status} {code}" if status != 200 else f"an error event ({code})"
    trial(f"E/P/D: SIGKILL {victim} inside a request", 1, f"{how} {ended:.1f} s after the kill")


def encode_metric(sample: str, labels: str = 'component="encode"') -> float:
    return metric(ENCODE_METRICS_PORT, sample, labels)


ENCODED = 'component="encode",stage="encode"'


def encode_counts() -> tuple[float, float]:
    """(requests in the encode worker, encodes it finished): read before a request, the
    baseline of `inside_encode`."""
    return (
        encode_metric("mmserve_active_requests"),
        encode_metric("mmserve_stage_seconds_count", ENCODED),
    )


async def inside_encode(first: asyncio.Event, before: tuple[float, float]) -> None:
    """Until the encode worker holds the request and its vision tower has not finished."""
    active_before, encoded_before = before

    async def holds_it() -> bool:
        return await asyncio.to_thread(encode_metric, "mmserve_active_requests") > active_before

    await wait_until_async(holds_it, BOUND_S, "the request reaching the encode worker", 0.1)
    encoded = await asyncio.to_thread(encode_metric, "mmserve_stage_seconds_count", ENCODED)
    assert encoded - encoded_before == 0
    assert not first.is_set()


@pytest.mark.parametrize(
    "e_p_d", [pytest.param((SLOW_ENCODE, WITH_ENCODE_METRICS), id="slow-encode")], indirect=True
)
def test_sigkill_of_encode_inside_a_request(e_p_d: Deployment, images: str, trial: Trial) -> None:
    async def killed() -> tuple[int, str | None, float]:
        async with httpx.AsyncClient(base_url=e_p_d.base_url, timeout=120) as client:
            first = asyncio.Event()
            body = image_chat(40, f"{images}/photo.jpg")
            before = await asyncio.to_thread(encode_counts)
            stream = asyncio.ensure_future(stream_chat(client, body, first))
            await inside_encode(first, before)  # of 8.8 s
            e_p_d.kill("encode")
            killed_at = time.monotonic()
            outcome = await asyncio.wait_for(stream, BOUND_S)
            return outcome.status, outcome.error, outcome.ended_at - killed_at

    status, code, ended = asyncio.run(killed())
    assert status >= 500 and code, (status, code)
    assert all(e_p_d.processes[name].poll() is None for name in ("frontend", "prefill", "decode"))

    restart_worker(e_p_d, "encode")

    async def served() -> bool:
        async with httpx.AsyncClient(base_url=e_p_d.base_url, timeout=120) as client:
            outcome = await stream_chat(client, image_chat(8, f"{images}/small.png"))
            return outcome.finished and outcome.error is None

    assert asyncio.run(served())
    trial(
        "E/P/D: SIGKILL encode inside a request with an image",
        1,
        f"HTTP {status} {code} {ended:.1f} s after the kill; "
        "the restarted encode worker served the next image request",
    )
