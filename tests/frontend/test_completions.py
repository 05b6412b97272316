"""`POST /v1/completions` through a real uvicorn server with the official openai client: the
prompt's forms, one choice per prompt, echo, streaming, the request handed to the pipeline, and
every refused input (the engines' prompt log-probabilities: tests/e2e/test_answers.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from mmserve.runtime.errors import RemoteError

from .conftest import RunningFrontend

IMAGE_PAD = 151655
VOCAB = 151936


def _client(frontend: RunningFrontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=frontend.url + "/v1", api_key="unused", max_retries=0)


def _ids(frontend: RunningFrontend, text: str) -> list[int]:
    return frontend.app.preprocessor.model.tokenizer.encode(text)


def test_a_string_prompt_is_tokenized_without_a_template(frontend: RunningFrontend) -> None:
    completion = _client(frontend).completions.create(
        model=frontend.model, prompt="The sky is", max_tokens=50, temperature=0, seed=3, user="u"
    )
    sent = frontend.dispatcher.requests[-1]
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    assert sent.plan.token_ids == _ids(frontend, "The sky is")
    assert sent.sampling.temperature == 0 and sent.sampling.seed == 3
    assert sent.sampling.logprobs is None and sent.sampling.prompt_logprobs is None
    assert sent.stop.max_tokens == 50
    (choice,) = completion.choices
    assert choice.index == 0 and choice.text == "The sky is"  # the echoing pipeline's
    assert choice.finish_reason == "stop" and choice.logprobs is None
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == completion.usage.completion_tokens == 3


def test_the_default_max_tokens_is_openais(frontend: RunningFrontend) -> None:
    _client(frontend).completions.create(model=frontend.model, prompt="Hi")
    assert frontend.dispatcher.requests[-1].stop.max_tokens == 16


@pytest.mark.parametrize("kind", ["strings", "token ids"])
def test_one_choice_per_prompt_by_index(frontend: RunningFrontend, kind: str) -> None:
    texts = ["one two three", "four", "five six"]
    prompt: Any = texts if kind == "strings" else [_ids(frontend, text) for text in texts]
    completion = _client(frontend).completions.create(
        model=frontend.model, prompt=prompt, max_tokens=2, echo=True
    )
    assert [choice.index for choice in completion.choices] == [0, 1, 2]
    for text, choice in zip(texts, completion.choices, strict=True):
        ids = _ids(frontend, text)
        head = frontend.app.preprocessor.model.tokenizer.decode(ids[:2])
        assert choice.text == text + head  # the prompt, then the echoing pipeline's completion
        assert choice.finish_reason == ("length" if len(ids) > 2 else "stop")
    sent = sorted(frontend.dispatcher.requests, key=lambda request: request.request_id)
    assert [request.request_id for request in sent] == [f"{completion.id}-{i}" for i in range(3)]
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == sum(len(_ids(frontend, text)) for text in texts)
    assert completion.usage.completion_tokens == 2 + 1 + 2


def test_token_ids_go_as_given(frontend: RunningFrontend) -> None:
    ids = [9707, 1879, 0, 151643]  # an id of a special token included
    _client(frontend).completions.create(model=frontend.model, prompt=ids, max_tokens=1)
    assert frontend.dispatcher.requests[-1].plan.token_ids == ids


def test_streamed_deltas_join_to_the_text(frontend: RunningFrontend) -> None:
    client = _client(frontend)
    options: dict[str, Any] = {
        "model": frontend.model,
        "prompt": ["Once upon a time", "there was"],
        "max_tokens": 8,
        "echo": True,
    }
    whole = client.completions.create(**options)
    stream = client.completions.create(
        **options, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert all(chunk.object == "text_completion" for chunk in chunks)
    for choice in whole.choices:
        deltas = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(delta.text for delta in deltas) == choice.text
        assert deltas[-1].finish_reason == choice.finish_reason
        assert all(delta.finish_reason is None for delta in deltas[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_logprobs_ask_the_engines_for_the_prompts_too_with_echo(
    frontend: RunningFrontend,
) -> None:
    client = _client(frontend)
    client.completions.create(model=frontend.model, prompt="a b", max_tokens=1, logprobs=2)
    sent = frontend.dispatcher.requests[-1].sampling
    assert sent.logprobs == 2 and sent.prompt_logprobs is None
    client.completions.create(
        model=frontend.model, prompt="a b", max_tokens=1, logprobs=2, echo=True
    )
    assert frontend.dispatcher.requests[-1].sampling.prompt_logprobs == 2
    client.completions.create(
        model=frontend.model,
        prompt="a b",
        max_tokens=1,
        logprobs=1,
        echo=True,
        extra_body={"prompt_logprobs": 4},
    )
    assert frontend.dispatcher.requests[-1].sampling.prompt_logprobs == 4


def _post(frontend: RunningFrontend, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(frontend.url + "/v1/completions", json=body, timeout=30)


@pytest.mark.parametrize(
    ("fields", "code", "param"),
    [
        ({"logprobs": 6}, "invalid_value", "logprobs"),
        ({"logprobs": -1}, "invalid_value", "logprobs"),
        ({"prompt": ""}, "invalid_value", "prompt"),
        ({"prompt": []}, "invalid_value", "prompt"),
        ({"prompt": [[]]}, "invalid_value", "prompt"),
        ({"prompt": ["a", ""]}, "invalid_value", "prompt"),
        ({"prompt": ["a", 1]}, "invalid_value", "prompt"),
        ({"prompt": [[1], 2]}, "invalid_value", "prompt"),
        ({"prompt": [1, VOCAB]}, "token_not_in_vocabulary", "prompt"),
        ({"prompt": [[1], [-1]]}, "token_not_in_vocabulary", "prompt"),
        ({"prompt": [IMAGE_PAD, 1]}, None, None),  # the core refuses the placeholder
        ({"max_tokens": 0}, "invalid_value", "max_tokens"),
        ({"max_tokens": -1}, "invalid_value", "max_tokens"),
        ({"suffix": "end"}, "unsupported_option", "suffix"),
        ({"n": 2, "best_of": 3}, "unsupported_option", "best_of"),
        ({"n": 17}, "invalid_value", "n"),
        ({"n": 0}, "invalid_value", "n"),
        ({"model": "other"}, "model_not_found", "model"),
        ({"min_tokens": 20, "max_tokens": 4}, "min_tokens_over_max_tokens", "min_tokens"),
        ({"logit_bias": {str(VOCAB): 1}}, "token_not_in_vocabulary", "logit_bias"),
        ({"prompt_logprobs": 21}, "invalid_value", "prompt_logprobs"),
    ],
)
def test_bad_input_is_refused_by_name_and_the_server_keeps_serving(
    frontend: RunningFrontend, fields: dict[str, Any], code: str | None, param: str | None
) -> None:
    body = {"model": frontend.model, "prompt": "Hello", **fields}
    response = _post(frontend, body)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    if code is not None:
        assert (error["code"], error["param"]) == (code, param), error
    assert frontend.dispatcher.requests == []  # nothing was scheduled
    ok = _post(frontend, {"model": frontend.model, "prompt": "Hello", "max_tokens": 1})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]


def test_a_prompt_past_the_context_is_refused(
    start_frontend: Callable[..., RunningFrontend],
) -> None:
    frontend = start_frontend("--context-length", "100")
    for prompt in ([1] * 100, ["short", "word " * 120]):
        response = _post(frontend, {"model": frontend.model, "prompt": prompt, "max_tokens": 1})
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
    assert frontend.dispatcher.requests == []
    response = _post(frontend, {"model": frontend.model, "prompt": [1] * 90, "max_tokens": 20})
    assert response.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_a_workers_failure_before_the_first_token_keeps_its_status(
    frontend: RunningFrontend, stream: bool
) -> None:
    frontend.dispatcher.failure = RemoteError("unavailable", "all busy", status=503)
    body = {"model": frontend.model, "prompt": ["a", "b"], "max_tokens": 2, "stream": stream}
    response = _post(frontend, body)
    assert response.status_code == 503 and response.json()["error"]["code"] == "unavailable"


def test_a_failure_after_the_first_token_ends_the_stream_with_an_error_event(
    frontend: RunningFrontend,
) -> None:
    frontend.dispatcher.failure = RemoteError("internal", "worker crashed")
    frontend.dispatcher.fail_after = 1
    body = {"model": frontend.model, "prompt": "one two three", "max_tokens": 3, "stream": True}
    response = _post(frontend, body)
    assert response.status_code == 200
    events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "worker crashed"
    assert json.loads(events[0])["choices"][0]["text"] == "one"
