"""mmserve's worker as a Dynamo backend: Dynamo's frontend (1.6.1) in front of
`python -m mmserve.dynamo` answers what mmserve's own frontend answers in front of mmserve's
aggregated worker, greedy, on the trained tiny Qwen2-VL: text, streamed and not, one image
(about which the model answers right, so a dropped or swapped image cannot pass) and three; a
refused image is the client's 400 with the core's reason; a client that leaves stops the
engine. Behind Dynamo's KV router, two workers (mock engine): a repeated prompt, with or
without an image, goes back to the worker holding it; a worker killed mid-stream fails the
client's stream."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from PIL import Image

from mmserve.models import scenes
from mmserve.models.trained import build_trained_model
from tests.support.deployment import Deployment
from tests.support.dynamo import DynamoDeployment, dynamo_missing
from tests.support.images import png_data_url
from tests.support.waiting import wait_until

pytestmark = pytest.mark.skipif(bool(reason := dynamo_missing()), reason=reason or "")

TEXT = [{"role": "user", "content": "What colour is the sky in the picture?"}]


@pytest.fixture(scope="module")
def frontends(
    nats_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Deployment, DynamoDeployment]]:
    """mmserve's aggregated deployment and the Dynamo one, on the same model, both ready."""
    model_path = build_trained_model()
    log_dir = tmp_path_factory.mktemp("dynamo")
    ours = Deployment("agg", model_path, nats_url, log_dir)
    theirs = DynamoDeployment(model_path, nats_url, log_dir)
    try:
        ours.start()
        theirs.start()
        ours.wait_ready()
        theirs.wait_ready()
        yield ours, theirs
    finally:
        theirs.stop()
        ours.stop()


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=60, max_retries=0)


def _ask(
    base_url: str, model: str, messages: list[dict], **options: object
) -> tuple[str, str, int]:
    """(content, finish reason, completion tokens) of one greedy chat completion."""
    response = _client(base_url).chat.completions.create(
        model=model,
        messages=messages,
        temperature=0,
        **options,  # type: ignore[arg-type]
    )
    choice = response.choices[0]
    assert response.usage is not None
    return choice.message.content or "", str(choice.finish_reason), response.usage.completion_tokens


def _stream(base_url: str, model: str, messages: list[dict], **options: object) -> tuple[str, str]:
    text, finish = "", ""
    stream = _client(base_url).chat.completions.create(
        model=model,
        messages=messages,
        temperature=0,
        stream=True,
        **options,  # type: ignore[arg-type]
    )
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def test_text_gives_the_same_greedy_tokens(frontends: tuple[Deployment, DynamoDeployment]) -> None:
    ours, theirs = frontends
    model = ours.model_path.name
    # ignore_eos keeps both generating to max_tokens: many tokens compared, not one word.
    for options in ({"max_tokens": 8}, {"max_tokens": 24, "extra_body": {"ignore_eos": True}}):
        expected = _ask(ours.base_url, model, TEXT, **options)
        assert _ask(theirs.base_url, model, TEXT, **options) == expected, options
        assert _stream(theirs.base_url, model, TEXT, **options) == expected[:2], options
    assert expected[1:] == ("length", 24)


def test_images_give_the_same_greedy_tokens(
    frontends: tuple[Deployment, DynamoDeployment],
) -> None:
    ours, theirs = frontends
    model = ours.model_path.name
    text = scenes.COLOUR_TEXT.format(shape=scenes.SHAPES[0])
    questions = [
        q for q in map(lambda s: scenes.question("colour", s), range(100)) if q.text == text
    ]
    first = questions[0]
    second = next(q for q in questions if q.answer != first.answer)
    for question in (first, second):
        parts = [
            {"type": "image_url", "image_url": {"url": png_data_url(i)}} for i in question.images
        ]
        messages = [{"role": "user", "content": [*parts, {"type": "text", "text": question.text}]}]
        expected = _ask(ours.base_url, model, messages, max_tokens=8)
        assert expected[0] == question.answer
        assert _ask(theirs.base_url, model, messages, max_tokens=8) == expected
        assert _stream(theirs.base_url, model, messages, max_tokens=8) == expected[:2]
    # Three images in one request: each placeholder expanded and encoded in its place.
    images = [*first.images, *second.images, *first.images]
    parts = [{"type": "image_url", "image_url": {"url": png_data_url(i)}} for i in images]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
    expected = _ask(ours.base_url, model, messages, max_tokens=8)
    assert _ask(theirs.base_url, model, messages, max_tokens=8) == expected


def test_a_refused_image_is_the_clients_400_with_the_reason(
    frontends: tuple[Deployment, DynamoDeployment],
) -> None:
    _, theirs = frontends
    sliver = png_data_url(Image.new("RGB", (1000, 4), (200, 30, 30)))
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": sliver}},
                {"type": "text", "text": "what?"},
            ],
        }
    ]
    response = httpx.post(
        f"{theirs.base_url}/v1/chat/completions",
        json={"model": theirs.model_path.name, "messages": messages, "max_tokens": 4},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    assert "aspect ratio" in response.json()["message"]


def test_a_client_that_leaves_stops_the_engine(
    frontends: tuple[Deployment, DynamoDeployment],
) -> None:
    _, theirs = frontends
    stream = _client(theirs.base_url).chat.completions.create(
        model=theirs.model_path.name,
        messages=TEXT,  # type: ignore[arg-type]
        max_tokens=20000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = 0
    for _ in stream:
        chunks += 1
        if chunks == 3:
            break
    stream.close()
    # 20000 tokens take minutes on these cores; the engine stops within seconds.
    wait_until(lambda: " cancelled: " in theirs.log("worker"), timeout=20, what="the cancel")
    # The worker serves on.
    assert _ask(theirs.base_url, theirs.model_path.name, TEXT, max_tokens=4)[1] in (
        "stop",
        "length",
    )


@pytest.fixture(scope="module")
def mock_pair(
    nats_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DynamoDeployment]:
    """Dynamo's frontend with its KV router in front of two mmserve workers (mock engine)."""
    theirs = DynamoDeployment(
        build_trained_model(),
        nats_url,
        tmp_path_factory.mktemp("dynamo-mock"),
        worker_flags=["--engine", "mock"],
        workers=2,
        frontend_flags=["--router-mode", "kv"],
    )
    with theirs.running():
        yield theirs


def _instance(deployment: DynamoDeployment, worker: str) -> int:
    """The worker's Dynamo instance id, as its log line says it."""
    found = re.search(r" ready: instance ([0-9a-f]+)", deployment.log(worker))
    assert found is not None
    return int(found[1], 16)


def test_dynamos_kv_router_sends_a_repeated_prompt_to_the_worker_holding_it(
    mock_pair: DynamoDeployment,
) -> None:
    theirs = mock_pair
    model_path = theirs.model_path
    # A text prompt, and one with an image: Dynamo's router keys the image's blocks by its
    # own hash of the image, which the worker's events must follow.
    image = png_data_url(scenes.question("colour", 3).images[0])
    words = " ".join(f"word{i}" for i in range(40))
    prompts: list[list[dict]] = [
        [{"role": "user", "content": f"Story: {words}"}],
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image}},
                    {"type": "text", "text": f"Describe: {words}"},
                ],
            }
        ],
    ]

    def ask(messages: list[dict], pin: int | None = None) -> int:
        """The cached tokens of one request (`pin`: on that worker, else where Dynamo routes)."""
        body: dict = {"model": model_path.name, "messages": messages, "max_tokens": 2}
        if pin is not None:
            body["nvext"] = {"backend_instance_id": pin}
        response = httpx.post(f"{theirs.base_url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def served(name: str) -> int:
        return theirs.log(name).count(" done: ")

    instances = [_instance(theirs, name) for name in theirs.worker_names]
    # Each prompt cached on its own worker, then each asked again without a pin: the router
    # reads the workers' KV events and sends it back there (random or round-robin would send
    # one of the two to the other worker, which holds only the chat template's first block).
    for prompt, instance in zip(prompts, instances, strict=True):
        assert ask(prompt, pin=instance) <= 16
    # The routing below reads the router's index: wait until it applied every event the two
    # prefills published (at least one each).
    wait_until(
        lambda: theirs.kv_events_applied() >= theirs.kv_events_published() >= 2,
        timeout=30,
        what="the router applying the workers' KV events",
    )
    for _ in range(2):
        for prompt in prompts:
            assert ask(prompt) >= 16 * 4, prompt
    assert [served(name) for name in theirs.worker_names] == [3, 3]


def test_a_worker_killed_mid_stream_is_the_clients_error_not_a_hang(
    mock_pair: DynamoDeployment,
) -> None:
    theirs = mock_pair
    instance = _instance(theirs, "worker2")
    stream = _client(theirs.base_url).chat.completions.create(
        model=theirs.model_path.name,
        messages=TEXT,  # type: ignore[arg-type]
        max_tokens=5000,  # 50 s of decoding
        stream=True,
        extra_body={"ignore_eos": True, "nvext": {"backend_instance_id": instance}},
    )
    received = 0
    started = time.monotonic()
    with pytest.raises(openai.APIError):
        for chunk in stream:
            received += len(chunk.choices)
            if received == 3:
                theirs.kill("worker2")
    assert received >= 3
    assert time.monotonic() - started < 30
