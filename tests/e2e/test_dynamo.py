"""mmserve's worker as a Dynamo backend: Dynamo's frontend (1.6.1) in front of
`python -m mmserve.dynamo` answers what mmserve's own frontend answers in front of mmserve's
aggregated worker, greedy, on the trained tiny Qwen2-VL (the openai client, and curl with 0, 1
and 3 images): text, streamed and not, one image
(about which the model answers right, so a dropped or swapped image cannot pass) and three, by
`data:` URL and by http URL (fetched by Dynamo's frontend and again by the worker); a refused
image is the client's 400 with the core's reason; a client that leaves stops the engine. The
same on tiny Qwen2.5-VL and Qwen3-VL checkpoints (random weights: every image changes the
answer), and with the images planned and encoded by an encode worker apart (E/PD), which alone
fetches them and whose refusal is the client's 400; until the encode worker is there, the
frontend holds the model; a client that leaves mid-encode stops the encode worker's encode.
With prefill and decode workers apart (P/D, and E/P/D with the encode worker), behind Dynamo's
prefill router, the KV handed over by transfer: the same answers for text and images, streamed
and not, each request prefilled on the one and decoded on the other, with the prefill's cached
tokens and its refusals; a decode worker killed mid-stream fails the client's stream. Behind
Dynamo's KV router, two workers (mock engine; Qwen2-VL and Qwen3-VL): a repeated prompt, with
or without an image, goes back to the worker holding it; with Dynamo's `--migration-limit`, a
worker killed mid-stream, or a drained one cut at its deadline (`EngineShutdown`), has its
stream resent to the other worker, which serves Dynamo's resent request (the prompt with the
tokens so far, the budget left) to its last token."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs
import openai
import pytest
from openai.types.chat import ChatCompletionMessageFunctionToolCall, ChatCompletionTokenLogprob
from PIL import Image

from mmserve.tiny import scenes
from mmserve.tiny.checkpoints import build_tiny_model
from mmserve.tiny.trained import build_trained_model
from tests.support.deployment import STARTUP_TIMEOUT_S, Deployment, serve_directory
from tests.support.dynamo import DynamoDeployment, dynamo_missing
from tests.support.images import png_data_url
from tests.support.tools import WEATHER, WEATHER_PARAMETERS
from tests.support.waiting import wait_until

pytestmark = pytest.mark.skipif(bool(reason := dynamo_missing()), reason=reason or "")

TEXT = [{"role": "user", "content": "What colour is the sky in the picture?"}]


# Images by http URL come from a server on 127.0.0.1: Dynamo's frontend fetches such a URL only
# with DYN_MM_ALLOW_INTERNAL=1 (it refuses literal IPs, explicit ports and loopback names), the
# worker only from a host its media policy lists.
LOOPBACK_MEDIA_ENV = {"DYN_MM_ALLOW_INTERNAL": "1"}
LOOPBACK_MEDIA_FLAGS = ["--allowed-media-domains", "127.0.0.1"]


@contextlib.contextmanager
def _side_by_side(
    model_path: Path, nats_url: str, log_dir: Path
) -> Iterator[tuple[Deployment, DynamoDeployment]]:
    """mmserve's aggregated deployment and the Dynamo one, on the same model, both ready."""
    ours = Deployment("agg", model_path, nats_url, log_dir)
    theirs = DynamoDeployment(
        model_path, nats_url, log_dir, worker_flags=LOOPBACK_MEDIA_FLAGS, env=LOOPBACK_MEDIA_ENV
    )
    try:
        ours.start()
        theirs.start()
        ours.wait_ready()
        theirs.wait_ready()
        yield ours, theirs
    finally:
        theirs.stop()
        ours.stop()


@pytest.fixture(scope="module")
def frontends(
    nats_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Deployment, DynamoDeployment]]:
    """Both frontends on the trained tiny Qwen2-VL."""
    with _side_by_side(build_trained_model(), nats_url, tmp_path_factory.mktemp("dynamo")) as both:
        yield both


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def family_frontends(
    request: pytest.FixtureRequest, nats_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Deployment, DynamoDeployment]]:
    """Both frontends on the tiny checkpoint of another family."""
    log_dir = tmp_path_factory.mktemp(f"dynamo-{request.param}")
    with _side_by_side(build_tiny_model(request.param), nats_url, log_dir) as both:
        yield both


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


def _image_messages(urls: list[str], text: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def test_text_gives_the_same_greedy_tokens(frontends: tuple[Deployment, DynamoDeployment]) -> None:
    ours, theirs = frontends
    model = ours.model_path.name
    # ignore_eos keeps both generating to max_tokens: many tokens compared, not one word.
    for options in ({"max_tokens": 8}, {"max_tokens": 24, "extra_body": {"ignore_eos": True}}):
        expected = _ask(ours.base_url, model, TEXT, **options)
        assert _ask(theirs.base_url, model, TEXT, **options) == expected, options
        assert _stream(theirs.base_url, model, TEXT, **options) == expected[:2], options
    assert expected[1:] == ("length", 24)


def _assert_same_answers_with_images(ours: str, theirs: str, model: str) -> None:
    """`theirs` answers as `ours` does, streamed and not: one image (two questions about the
    same shape with different right answers, each answered right) and three in one request."""
    text = scenes.COLOUR_TEXT.format(shape=scenes.SHAPES[0])
    questions = [
        q for q in map(lambda s: scenes.question("colour", s), range(100)) if q.text == text
    ]
    first = questions[0]
    second = next(q for q in questions if q.answer != first.answer)
    for question in (first, second):
        messages = _image_messages([png_data_url(i) for i in question.images], question.text)
        expected = _ask(ours, model, messages, max_tokens=8)
        assert expected[0] == question.answer
        assert _ask(theirs, model, messages, max_tokens=8) == expected
        assert _stream(theirs, model, messages, max_tokens=8) == expected[:2]
    # Three images in one request: each placeholder expanded and encoded in its place.
    images = [*first.images, *second.images, *first.images]
    messages = _image_messages([png_data_url(i) for i in images], text)
    expected = _ask(ours, model, messages, max_tokens=8)
    assert _ask(theirs, model, messages, max_tokens=8) == expected


Logprobs = list[tuple[str, float, list[tuple[str, float]]]]


def _chat_logprobs(base_url: str, model: str, messages: list[dict], stream: bool) -> Logprobs:
    """Each token's (text, logprob, [(text, logprob) of the top 3]) of one greedy chat
    completion asking for `logprobs` and `top_logprobs: 3` (12 tokens, EOS ignored). With
    `skip_special_tokens` false: Dynamo's detokenizer, which writes each token's text, writes
    an empty one for a special token otherwise (mmserve's frontend names it either way)."""
    options: dict = {
        "max_tokens": 12,
        "logprobs": True,
        "top_logprobs": 3,
        "extra_body": {"ignore_eos": True, "skip_special_tokens": False},
    }
    client = _client(base_url).chat.completions
    entries: list[ChatCompletionTokenLogprob] = []
    if stream:
        for chunk in client.create(
            model=model, messages=messages, temperature=0, stream=True, **options
        ):
            for choice in chunk.choices:
                if choice.logprobs is not None:
                    entries += choice.logprobs.content or []
    else:
        response = client.create(model=model, messages=messages, temperature=0, **options)
        assert response.choices[0].logprobs is not None
        entries = response.choices[0].logprobs.content or []
    return [
        (each.token, each.logprob, [(top.token, top.logprob) for top in each.top_logprobs])
        for each in entries
    ]


def _assert_same_logprobs(ours: str, theirs: str, model: str) -> None:
    """`theirs` gives the tokens, logprobs and top 3 that `ours` gives (within 1e-4), for text
    and with an image, streamed and not."""
    image = png_data_url(scenes.question("colour", 34).images[0])
    for messages in (TEXT, _image_messages([image], "What colour?")):
        expected = _chat_logprobs(ours, model, messages, stream=False)
        assert len(expected) == 12 and all(len(top) == 3 for _, _, top in expected)
        for stream in (False, True):
            got = _chat_logprobs(theirs, model, messages, stream=stream)
            assert [token for token, _, _ in got] == [token for token, _, _ in expected]
            for (_, logprob, top), (_, want, want_top) in zip(got, expected, strict=True):
                assert logprob == pytest.approx(want, abs=1e-4)
                assert [text for text, _ in top] == [text for text, _ in want_top]
                assert [value for _, value in top] == pytest.approx(
                    [value for _, value in want_top], abs=1e-4
                )


def test_chat_logprobs_are_mmserves(frontends: tuple[Deployment, DynamoDeployment]) -> None:
    ours, theirs = frontends
    model = ours.model_path.name
    _assert_same_logprobs(ours.base_url, theirs.base_url, model)
    # Out of the engines' range: the client's 400, from the worker (Dynamo's chat checks
    # top_logprobs itself; prompt_logprobs it passes on).
    response = httpx.post(
        f"{theirs.base_url}/v1/chat/completions",
        json={"model": model, "messages": TEXT, "max_tokens": 2, "prompt_logprobs": 21},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    assert "prompt_logprobs must lie in [0, 20]" in response.json()["message"]


def _choices(base_url: str, model: str, stream: bool) -> list[tuple[str, str | None]]:
    """Each choice's (text, finish reason) of one seeded chat completion with `n` 3."""
    options: dict = {"max_tokens": 10, "n": 3, "temperature": 1.0, "seed": 11}
    client = _client(base_url).chat.completions
    texts: list[str] = ["", "", ""]
    reasons: list[str | None] = [None, None, None]
    if stream:
        for chunk in client.create(model=model, messages=TEXT, stream=True, **options):
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    else:
        response = client.create(model=model, messages=TEXT, **options)
        for choice in response.choices:
            texts[choice.index], reasons[choice.index] = (
                choice.message.content or "",
                choice.finish_reason,
            )
    return list(zip(texts, reasons, strict=True))


def _assert_same_choices(ours: str, theirs: str, model: str) -> None:
    """`theirs` gives `ours`'s three seeded choices, each with its own text and finish
    reason, streamed and not."""
    expected = _choices(ours, model, stream=False)
    assert len({text for text, _ in expected}) == 3, expected  # three draws, not one
    for stream in (False, True):
        assert _choices(theirs, model, stream=stream) == expected


def test_n_seeded_choices_are_mmserves(frontends: tuple[Deployment, DynamoDeployment]) -> None:
    ours, theirs = frontends
    _assert_same_choices(ours.base_url, theirs.base_url, ours.model_path.name)


def test_chat_prompt_logprobs_come_back_in_vllms_form(
    frontends: tuple[Deployment, DynamoDeployment],
) -> None:
    _, theirs = frontends
    response = httpx.post(
        f"{theirs.base_url}/v1/chat/completions",
        json={
            "model": theirs.model_path.name,
            "messages": TEXT,
            "max_tokens": 2,
            "temperature": 0,
            "prompt_logprobs": 2,
        },
        timeout=60,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    scored = body["prompt_logprobs"]
    # None for the first prompt token, then per position the prompt's token and the 2 most
    # likely (one entry where the prompt's token is one of them), ranks from 1.
    assert len(scored) == body["usage"]["prompt_tokens"] and scored[0] is None
    for position in scored[1:]:
        assert 2 <= len(position) <= 3
        ranks = sorted(entry["rank"] for entry in position.values())
        assert ranks[:2] == [1, 2] and all(entry["logprob"] <= 0 for entry in position.values())


def test_images_give_the_same_greedy_tokens(
    frontends: tuple[Deployment, DynamoDeployment],
) -> None:
    ours, theirs = frontends
    _assert_same_answers_with_images(ours.base_url, theirs.base_url, ours.model_path.name)


def _curl_content(base_url: str, body: dict) -> str:
    done = subprocess.run(
        ["curl", "-sS", "--fail-with-body", f"{base_url}/v1/chat/completions",
         "-H", "Content-Type: application/json", "-d", json.dumps(body)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return json.loads(done.stdout)["choices"][0]["message"]["content"]


def test_curl_with_0_1_and_3_images_gets_mmserves_answer(
    frontends: tuple[Deployment, DynamoDeployment],
) -> None:
    ours, theirs = frontends
    question = scenes.question("colour", 34)  # the README's red circle
    image = png_data_url(question.images[0])
    for urls in ([], [image], [image] * 3):
        body = {
            "model": ours.model_path.name,
            "messages": _image_messages(urls, question.text),
            "max_tokens": 8,
            "temperature": 0,
        }
        assert _curl_content(theirs.base_url, body) == _curl_content(ours.base_url, body), urls


def test_an_image_by_http_url_is_fetched_by_dynamos_frontend_and_again_by_the_worker(
    frontends: tuple[Deployment, DynamoDeployment], tmp_path: Path
) -> None:
    ours, theirs = frontends
    model = ours.model_path.name
    question = scenes.question("colour", 3)
    question.images[0].save(tmp_path / "scene.png")
    with serve_directory(tmp_path) as (base_url, server):
        port = base_url.rsplit(":", 1)[1]
        messages = _image_messages([f"{base_url}/scene.png"], question.text)
        expected = _ask(ours.base_url, model, messages, max_tokens=8)
        assert expected[0] == question.answer
        assert server.gets["/scene.png"] == 1  # mmserve's frontend, which ships the bytes on
        assert _ask(theirs.base_url, model, messages, max_tokens=8) == expected
        # Dynamo's frontend (for its router's view of the image), then the worker (the plan and
        # the encoder): Dynamo's frontend sends the worker the URL, not the bytes.
        assert server.gets["/scene.png"] == 3
        # A host the worker's policy does not list: Dynamo's frontend fetches it, the worker
        # refuses it before fetching, as the client's 400.
        refused = _image_messages([f"http://localhost:{port}/scene.png"], question.text)
        response = httpx.post(
            f"{theirs.base_url}/v1/chat/completions",
            json={"model": model, "messages": refused, "max_tokens": 4},
            timeout=60,
        )
        assert response.status_code == 400, response.text
        assert "fetch.forbidden_address" in response.json()["message"]
        assert server.gets["/scene.png"] == 4


def test_qwen2_5_vl_and_qwen3_vl_give_the_same_greedy_tokens(
    family_frontends: tuple[Deployment, DynamoDeployment],
) -> None:
    ours, theirs = family_frontends
    model = ours.model_path.name
    first, second = (scenes.question("colour", seed).images[0] for seed in (3, 5))
    # ignore_eos: every answer is 12 tokens, compared in full.
    options: dict = {"max_tokens": 12, "extra_body": {"ignore_eos": True}}
    answers = []
    for images in ([], [first], [second], [first, second, first]):
        messages = _image_messages([png_data_url(image) for image in images], "What colour?")
        expected = _ask(ours.base_url, model, messages, **options)
        assert expected[1:] == ("length", 12)
        assert _ask(theirs.base_url, model, messages, **options) == expected, len(images)
        assert _stream(theirs.base_url, model, messages, **options) == expected[:2], len(images)
        answers.append(expected[0])
    # Each image changes the answer, so a dropped, swapped or misplaced one cannot pass.
    assert len(set(answers)) == len(answers), answers


STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "label": {"type": "string", "maxLength": 6},
    },
    "required": ["colour", "count", "label"],
}
JSON_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "s", "schema": STRUCTURED_SCHEMA},
}
STRUCTURED_FORMS: list[dict[str, Any]] = [
    {"response_format": JSON_SCHEMA_FORMAT},
    {"extra_body": {"guided_regex": r"[a-z]{2,5}-\d"}},
    {"extra_body": {"guided_choice": ["red", "green", "blue"]}},
    {"extra_body": {"guided_grammar": 'root ::= "sky " ("red" | "grey")'}},
]  # fmt: skip


def _assert_same_structured_outputs(ours: str, theirs: str, model: str) -> None:
    """Each structured-output form Dynamo's frontend forwards (`guided_decoding`) answers as
    mmserve's own frontend, streamed and not; a schema keyword the grammar would not enforce
    is the client's 400 naming it."""
    for form in STRUCTURED_FORMS:
        expected = _ask(ours, model, TEXT, max_tokens=64, **form)
        assert expected[1] == "stop", (form, expected)
        assert _ask(theirs, model, TEXT, max_tokens=64, **form) == expected, form
        assert _stream(theirs, model, TEXT, max_tokens=64, **form) == expected[:2], form
    unenforced = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        _ask(theirs, model, TEXT, max_tokens=8, extra_body={"guided_json": unenforced})
    assert _ask(theirs, model, TEXT, max_tokens=2)[2] == 2


def test_structured_outputs_are_mmserves(frontends: tuple[Deployment, DynamoDeployment]) -> None:
    ours, theirs = frontends
    _assert_same_structured_outputs(ours.base_url, theirs.base_url, ours.model_path.name)


def test_dynamos_tool_choice_grammar_gives_valid_calls(
    family_frontends: tuple[Deployment, DynamoDeployment],
) -> None:
    """Dynamo's frontend renders the tools, sends required and named as `guided_decoding`
    (vLLM's JSON schemas), which the worker enforces, and parses the calls itself. mmserve's
    frontend refuses tools for Qwen2.5-VL, whose template cannot render them; Dynamo's renders
    the prompt without them."""
    ours, theirs = family_frontends
    model = ours.model_path.name
    named = {"type": "function", "function": {"name": "get_weather"}}
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    for tool_choice in ("required", named):
        response = _client(theirs.base_url).chat.completions.create(
            model=model,
            messages=messages,
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice=tool_choice,  # type: ignore[arg-type]
            parallel_tool_calls=False,
            max_tokens=64,
            temperature=0,
        )
        calls = [
            call.function
            for call in response.choices[0].message.tool_calls or []
            if isinstance(call, ChatCompletionMessageFunctionToolCall)
        ]
        assert [call.name for call in calls] == ["get_weather"], response
        jsonschema_rs.validate(WEATHER_PARAMETERS, json.loads(calls[0].arguments))
    body = {"model": model, "messages": messages, "tools": [WEATHER], "tool_choice": named}
    refused = httpx.post(f"{ours.base_url}/v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == (400 if "qwen2_5_vl" in model else 200), refused.text


def test_a_refused_image_is_the_clients_400_with_the_reason(
    frontends: tuple[Deployment, DynamoDeployment],
) -> None:
    _, theirs = frontends
    _assert_a_sliver_is_refused(theirs.base_url, theirs.model_path.name)


def _assert_a_sliver_is_refused(base_url: str, model: str) -> None:
    """An image the core refuses (aspect ratio over 200) is the client's 400 with the reason."""
    sliver = png_data_url(Image.new("RGB", (1000, 4), (200, 30, 30)))
    response = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={"model": model, "messages": _image_messages([sliver], "what?"), "max_tokens": 4},
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
def encode_apart(
    nats_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DynamoDeployment]:
    """E/PD: Dynamo's frontend in front of an mmserve worker started with `--route-to-encoder`
    and an mmserve encode worker, on the trained tiny Qwen2-VL, embeddings by shared memory.
    Only the encode worker may fetch from 127.0.0.1."""
    theirs = DynamoDeployment(
        build_trained_model(),
        nats_url,
        tmp_path_factory.mktemp("dynamo-epd"),
        worker_flags=["--route-to-encoder", "--transfer", "shm"],
        encoders=1,
        encoder_flags=[
            "--disaggregation-mode",
            "encode",
            "--transfer",
            "shm",
            *LOOPBACK_MEDIA_FLAGS,
        ],
        env=LOOPBACK_MEDIA_ENV,
    )
    with theirs.running():
        yield theirs


def test_an_encode_worker_apart_gives_the_same_greedy_tokens(
    frontends: tuple[Deployment, DynamoDeployment], encode_apart: DynamoDeployment, tmp_path: Path
) -> None:
    ours, _ = frontends
    theirs = encode_apart
    model = ours.model_path.name
    assert _ask(theirs.base_url, model, TEXT, max_tokens=8) == _ask(
        ours.base_url, model, TEXT, max_tokens=8
    )
    assert " done: " not in theirs.log("encode1")  # text goes to the worker alone
    _assert_same_answers_with_images(ours.base_url, theirs.base_url, model)
    encoded = theirs.log("encode1").count(" done: ")
    assert encoded == 2 * 2 + 1  # each image request once, streamed or not
    # By http URL: Dynamo's frontend fetches it, then the encode worker; the worker, whose
    # policy would refuse 127.0.0.1, never does.
    question = scenes.question("colour", 3)
    question.images[0].save(tmp_path / "scene.png")
    with serve_directory(tmp_path) as (base_url, server):
        messages = _image_messages([f"{base_url}/scene.png"], question.text)
        assert _ask(theirs.base_url, model, messages, max_tokens=8)[0] == question.answer
        assert server.gets["/scene.png"] == 2
    assert theirs.log("encode1").count(" done: ") == encoded + 1
    # The encode worker's refusal is the client's 400 with its reason.
    _assert_a_sliver_is_refused(theirs.base_url, model)


def test_dynamos_frontend_serves_a_worker_routing_to_an_encoder_once_one_is_there(
    nats_url: str, tmp_path: Path
) -> None:
    mock = ["--engine", "mock", "--transfer", "shm"]
    # An image takes the encode worker 4 s (16 tokens), time for a client to leave mid-encode.
    slow_encode = ["--mock-encode-us-per-token", "250000"]
    theirs = DynamoDeployment(
        build_trained_model(),
        nats_url,
        tmp_path,
        worker_flags=[*mock, "--route-to-encoder"],
        encoders=1,
        encoder_flags=[*mock, *slow_encode, "--disaggregation-mode", "encode"],
    )
    body = {"model": theirs.model_path.name, "messages": TEXT, "max_tokens": 2}
    try:
        theirs.start_worker("worker")
        theirs.start_frontend()

        def refused_as_not_ready() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                response = httpx.post(f"{theirs.base_url}/v1/chat/completions", json=body)
                return response.status_code == 503 and "not ready" in response.text
            return False

        # The worker's card needs an encode worker: the frontend knows the model but holds it.
        wait_until(refused_as_not_ready, timeout=STARTUP_TIMEOUT_S, what="the held model")
        assert httpx.get(f"{theirs.base_url}/v1/models").json()["data"] == []
        theirs.start_worker("encode1")
        theirs.wait_ready()
        response = httpx.post(f"{theirs.base_url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text

        # A client that leaves while the encode worker encodes its image stops the encode and
        # the worker's wait for it; the next image request is answered.
        first, second = (scenes.question("colour", seed).images[0] for seed in (3, 5))
        leaving = {**body, "messages": _image_messages([png_data_url(first)], "what?")}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{theirs.base_url}/v1/chat/completions",
                json={**leaving, "stream": True},
                timeout=httpx.Timeout(60, read=1),
            )
        wait_until(
            lambda: " cancelled: " in theirs.log("encode1"), timeout=20, what="the encode's stop"
        )
        assert " stopped by Dynamo" in theirs.log("worker")
        assert "Error" not in theirs.log("worker")
        assert " done: " not in theirs.log("encode1")
        answered = {**body, "messages": _image_messages([png_data_url(second)], "what?")}
        response = httpx.post(f"{theirs.base_url}/v1/chat/completions", json=answered, timeout=60)
        assert response.status_code == 200, response.text
        assert theirs.log("encode1").count(" done: ") == 1
    finally:
        theirs.stop()


@pytest.fixture(scope="module", params=["pd", "epd"])
def prefill_apart(
    request: pytest.FixtureRequest, nats_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DynamoDeployment]:
    """P/D: Dynamo's frontend (its prefill router) in front of an mmserve prefill worker and a
    decode worker ("worker"), on the trained tiny Qwen2-VL, the KV by shared memory; E/P/D: the
    prefill worker started with `--route-to-encoder`, and an encode worker."""
    shm = ["--transfer", "shm"]
    epd = request.param == "epd"
    theirs = DynamoDeployment(
        build_trained_model(),
        nats_url,
        tmp_path_factory.mktemp(f"dynamo-{request.param}"),
        worker_flags=["--disaggregation-mode", "decode", *shm],
        prefills=1,
        prefill_flags=["--disaggregation-mode", "prefill", *shm]
        + (["--route-to-encoder"] if epd else []),
        encoders=int(epd),
        encoder_flags=["--disaggregation-mode", "encode", *shm],
    )
    with theirs.running():
        yield theirs


def test_prefill_and_decode_workers_apart_give_the_same_greedy_tokens(
    frontends: tuple[Deployment, DynamoDeployment], prefill_apart: DynamoDeployment
) -> None:
    ours, _ = frontends
    theirs = prefill_apart
    model = ours.model_path.name
    for options in ({"max_tokens": 8}, {"max_tokens": 24, "extra_body": {"ignore_eos": True}}):
        expected = _ask(ours.base_url, model, TEXT, **options)
        assert _ask(theirs.base_url, model, TEXT, **options) == expected, options
        assert _stream(theirs.base_url, model, TEXT, **options) == expected[:2], options
    _assert_same_answers_with_images(ours.base_url, theirs.base_url, model)
    # Every request ran its prompt on the prefill worker and its tokens on the decode worker;
    # with an encode worker, the image requests' images there.
    requests = 2 * 2 + 2 * 2 + 1
    assert theirs.log("prefill1").count(" done: ") == requests
    assert theirs.log("worker").count(" done: ") == requests
    if theirs.encoders:
        assert theirs.log("encode1").count(" done: ") == 2 * 2 + 1
    # The decode worker reports the prompt tokens the prefill worker's prefix cache held.
    response = httpx.post(
        f"{theirs.base_url}/v1/chat/completions",
        json={"model": model, "messages": TEXT, "max_tokens": 2},
        timeout=60,
    )
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    # A refusal where the images are planned (the prefill or the encode worker) is the
    # client's 400 with its reason, through Dynamo's prefill router.
    _assert_a_sliver_is_refused(theirs.base_url, model)


def test_prefill_and_decode_workers_apart_give_mmserves_logprobs(
    frontends: tuple[Deployment, DynamoDeployment], prefill_apart: DynamoDeployment
) -> None:
    # The first token's logprobs come from the prefill worker (`FirstToken.logprob`), the
    # rest from the decode worker.
    ours, _ = frontends
    _assert_same_logprobs(ours.base_url, prefill_apart.base_url, ours.model_path.name)


def test_prefill_and_decode_workers_apart_give_mmserves_structured_outputs(
    frontends: tuple[Deployment, DynamoDeployment], prefill_apart: DynamoDeployment
) -> None:
    # The first token is drawn under the grammar on the prefill worker; the decode worker
    # rebuilds each matcher past it.
    ours, _ = frontends
    _assert_same_structured_outputs(ours.base_url, prefill_apart.base_url, ours.model_path.name)


def test_prefill_and_decode_workers_apart_give_mmserves_seeded_choices(
    frontends: tuple[Deployment, DynamoDeployment], prefill_apart: DynamoDeployment
) -> None:
    # The prompt's KV crosses once; each choice's first token comes from the prefill worker.
    ours, _ = frontends
    _assert_same_choices(ours.base_url, prefill_apart.base_url, ours.model_path.name)


def test_a_decode_worker_killed_mid_stream_is_the_clients_error_not_a_hang(
    prefill_apart: DynamoDeployment,
) -> None:
    theirs = prefill_apart
    stream = _client(theirs.base_url).chat.completions.create(
        model=theirs.model_path.name,
        messages=TEXT,  # type: ignore[arg-type]
        max_tokens=20000,  # minutes of decoding on these cores
        stream=True,
        extra_body={"ignore_eos": True},
    )
    _assert_a_kill_fails_the_stream(theirs, "worker", stream)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl"])
def mock_pair(
    request: pytest.FixtureRequest, nats_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DynamoDeployment]:
    """Dynamo's frontend with its KV router and its migration (`--migration-limit 3`) in front
    of two mmserve workers (mock engine), on the trained Qwen2-VL and on the tiny Qwen3-VL
    (another patch size: Dynamo's router must count an image's tokens as the worker does)."""
    model_path = (
        build_trained_model() if request.param == "qwen2_vl" else build_tiny_model("qwen3_vl")
    )
    theirs = DynamoDeployment(
        model_path,
        nats_url,
        tmp_path_factory.mktemp(f"dynamo-mock-{request.param}"),
        # The drain's timeout cut short for the SIGTERM test, which needs a stream past it.
        worker_flags=["--engine", "mock", "--drain-timeout", "3"],
        workers=2,
        frontend_flags=["--router-mode", "kv", "--migration-limit", "3"],
    )
    with theirs.running():
        yield theirs


def _instance(deployment: DynamoDeployment, worker: str) -> int:
    """The worker's Dynamo instance id, as its log line says it."""
    found = re.search(r" ready: instance ([0-9a-f]+)", deployment.log(worker))
    assert found is not None
    return int(found[1], 16)


def _assert_a_kill_fails_the_stream(
    deployment: DynamoDeployment, worker: str, stream: Iterator[Any]
) -> None:
    """Killing `worker` after the stream's third chunk fails the stream within 30 s."""
    received = 0
    started = time.monotonic()
    with pytest.raises(openai.APIError):
        for chunk in stream:
            received += len(chunk.choices)
            if received == 3:
                deployment.kill(worker)
    assert received >= 3
    assert time.monotonic() - started < 30


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
        _image_messages([image], f"Describe: {words}"),
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
    # The worker holding the image's tokens did not encode it again: it found them in its own
    # prefix cache (Dynamo's router marks nothing).
    holder = theirs.worker_names[1]
    skipped = theirs.worker_counter(holder, "mmserve_encoder_skipped_items", result="skipped")
    assert skipped == 2


def _streamed(
    deployment: DynamoDeployment,
    max_tokens: int,
    pin: str | None = None,
    messages: list[dict] = TEXT,
) -> Any:
    """A streamed chat completion of `max_tokens` (10 ms each), where Dynamo's router sends
    it, or to worker `pin`. A pinned request is not migrated: Dynamo resends it to the same
    instance."""
    nvext = {} if pin is None else {"nvext": {"backend_instance_id": _instance(deployment, pin)}}
    chunks = _client(deployment.base_url).chat.completions.create(
        model=deployment.model_path.name,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, **nvext},
    )
    assert isinstance(chunks, openai.Stream)
    return iter(chunks)


def _requests(deployment: DynamoDeployment) -> dict[str, float]:
    return {
        name: deployment.worker_counter(name, "mmserve_requests", component="worker")
        for name in deployment.worker_names
    }


def _serving(deployment: DynamoDeployment, before: dict[str, float]) -> str:
    """The one worker that took a request since `before` (`_requests`)."""
    after = _requests(deployment)
    took = [name for name in deployment.worker_names if after[name] > before[name]]
    assert len(took) == 1, (before, after)
    return took[0]


def _to_the_end(stream: Any) -> tuple[int, str | None]:
    """The completion tokens of a stream read to its end (its usage), and its finish reason."""
    tokens, finish = 0, None
    for chunk in stream:
        finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens, finish


def test_a_worker_killed_mid_stream_migrates_under_dynamos_frontend(
    mock_pair: DynamoDeployment,
) -> None:
    """Dynamo's frontend resends the request to the other worker with the tokens so far
    appended to the prompt and `max_tokens` what is left, its image by URL again: the worker
    plans it with that prompt, and the stream ends with every token."""
    theirs = mock_pair
    before = _requests(theirs)
    image = png_data_url(scenes.question("colour", 4).images[0])
    stream = _streamed(theirs, 300, messages=_image_messages([image], "Describe it."))
    for _ in range(3):
        next(stream)
    victim = _serving(theirs, before)
    theirs.kill(victim)
    assert _to_the_end(stream) == (300, "length")
    theirs.start_worker(victim)
    theirs.wait_ready()


def test_a_worker_stopped_with_sigterm_drains_then_exits_0(mock_pair: DynamoDeployment) -> None:
    """After SIGTERM the worker finishes a short stream, cuts one that outlasts its
    `--drain-timeout` (3 s), which Dynamo's frontend migrates to the other worker, and exits
    0. Last: it stops a worker."""
    theirs = mock_pair
    before = _requests(theirs)
    long = _streamed(theirs, 600)
    assert next(long).choices
    worker = _serving(theirs, before)
    short = _streamed(theirs, 150, pin=worker)
    assert next(short).choices
    signalled = time.monotonic()
    theirs.processes[worker].send_signal(signal.SIGTERM)
    finished = [choice.finish_reason for chunk in short for choice in chunk.choices]
    assert finished[-1] == "length", finished[-5:]
    # Cut at the timeout (3 s into its 6 s), then resent to the other worker: it finishes.
    assert _to_the_end(long) == (600, "length")
    assert theirs.processes[worker].wait(timeout=30) == 0, theirs.log(worker)[-2000:]
    assert time.monotonic() - signalled < 30
    assert "drain timeout (3 s) reached: ending what is in flight" in theirs.log(worker)
