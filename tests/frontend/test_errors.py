"""Every refusal answers OpenAI's error JSON with its status, and the server keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from mmserve.runtime.errors import RemoteError
from tests.support.images import data_url, encode_image

from .conftest import RunningFrontend


def _post(frontend: RunningFrontend, body: Any, timeout: float = 30) -> httpx.Response:
    content = body if isinstance(body, bytes | Iterator) else json.dumps(body).encode()
    return httpx.post(
        frontend.url + "/v1/chat/completions",
        content=content,
        headers={"content-type": "application/json"},
        timeout=timeout,
    )


def _assert_error(response: httpx.Response, status: int, code: str, param: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def _chat(frontend: RunningFrontend, **fields: Any) -> dict[str, Any]:
    return {"model": frontend.model, "messages": [{"role": "user", "content": "hi"}], **fields}


def test_malformed_json(frontend: RunningFrontend) -> None:
    error = _assert_error(_post(frontend, b'{"model": "x", "messages": ['), 400, "invalid_json")
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"model": 3}, "model"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ],
)
def test_wrong_types_name_the_field(frontend: RunningFrontend, fields, param: str) -> None:
    _assert_error(_post(frontend, _chat(frontend, **fields)), 400, "invalid_value", param)


def test_unknown_content_part_type(frontend: RunningFrontend) -> None:
    messages = [{"role": "user", "content": [{"type": "input_file", "file": {}}]}]
    error = _assert_error(_post(frontend, _chat(frontend, messages=messages)), 400, "invalid_value")
    assert error["param"] == "messages[0].content[0].type"
    assert "input_file" in error["message"]


def test_an_audio_part_for_a_vision_model_names_the_part(frontend: RunningFrontend) -> None:
    clip = "UklGRiQAAABXQVZFZm10IBAAAAABAAEAgD4AAAB9AAACABAAZGF0YQAAAAA="
    part = {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hear:"}, part]}]
    error = _assert_error(
        _post(frontend, _chat(frontend, messages=messages)), 400, "process.modality_unsupported"
    )
    assert error["param"] == "messages[0].content[1].input_audio"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2, "best_of": 3}, "best_of"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
    ],
)
def test_unsupported_options_are_refused_by_name(frontend: RunningFrontend, fields, param) -> None:
    error = _assert_error(_post(frontend, _chat(frontend, **fields)), 400, "unsupported_option")
    assert error["param"] == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ],
)
def test_bad_sampling_values_are_refused_by_name_and_the_server_serves_on(
    frontend: RunningFrontend, fields, param
) -> None:
    error = _assert_error(_post(frontend, _chat(frontend, **fields)), 400, "invalid_value")
    assert error["param"] is not None and error["param"].startswith(param), error
    assert _post(frontend, _chat(frontend, max_tokens=2)).status_code == 200


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"top_logprobs": 2}, "top_logprobs", "top_logprobs_without_logprobs"),
        ({"logprobs": False, "top_logprobs": 0}, "top_logprobs", "top_logprobs_without_logprobs"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias", "token_not_in_vocabulary"),
    ],
)
def test_sampling_values_the_model_cannot_take_are_refused_by_name(
    frontend: RunningFrontend, fields, param, code
) -> None:
    _assert_error(_post(frontend, _chat(frontend, **fields)), 400, code, param)


def test_unsupported_options_at_their_defaults_are_accepted(frontend: RunningFrontend) -> None:
    fields = {"n": 1, "logprobs": False, "presence_penalty": 0.0, "max_tokens": 2}
    assert _post(frontend, _chat(frontend, **fields)).status_code == 200


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -1}, "top_k"),
        ({"min_tokens": -1}, "min_tokens"),
    ],
)
def test_out_of_range_values(frontend: RunningFrontend, fields, param: str) -> None:
    _assert_error(_post(frontend, _chat(frontend, **fields)), 400, "invalid_value", param)


def test_unknown_model_is_404(frontend: RunningFrontend) -> None:
    client = openai.OpenAI(base_url=frontend.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(
            model="gpt-nothing", messages=[{"role": "user", "content": "hi"}]
        )
    assert info.value.code == "model_not_found"


def test_no_worker_is_503_also_for_streams(frontend: RunningFrontend) -> None:
    frontend.dispatcher.is_ready = False
    _assert_error(_post(frontend, _chat(frontend)), 503, "no_worker")
    client = openai.OpenAI(base_url=frontend.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(
            model=frontend.model, messages=[{"role": "user", "content": "hi"}], stream=True
        )
    assert info.value.status_code == 503


def test_body_over_the_limit_is_413(start_frontend) -> None:
    frontend = start_frontend("--max-request-body-bytes", "2000", "--max-media-items", "2")
    text = "x" * 5000
    _assert_error(_post(frontend, _chat(frontend, messages=[
        {"role": "user", "content": text}
    ])), 413, "body_too_large")  # fmt: skip
    # Without a Content-Length header (chunked upload) the limit holds too.
    chunked = _post(frontend, iter([json.dumps(_chat(frontend, user=text)).encode()]))
    _assert_error(chunked, 413, "body_too_large")
    assert _post(frontend, _chat(frontend, max_tokens=1)).status_code == 200


def test_too_many_images(start_frontend) -> None:
    frontend = start_frontend("--max-request-body-bytes", "2000", "--max-media-items", "2")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [image, image, image, {"type": "text", "text": "?"}]}]
    error = _assert_error(
        _post(frontend, _chat(frontend, messages=messages)), 400, "request.too_many_items"
    )
    assert "at most 2" in error["message"]


def test_context_length_bounds_prompt_and_completion(start_frontend) -> None:
    frontend = start_frontend("--context-length", "100")
    assert _post(frontend, _chat(frontend)).status_code == 200
    prompt = len(frontend.dispatcher.requests[-1].plan.token_ids)
    # Without max_tokens the completion gets what the context leaves.
    assert frontend.dispatcher.requests[-1].stop.max_tokens == 100 - prompt
    assert _post(frontend, _chat(frontend, max_tokens=100 - prompt)).status_code == 200
    error = _assert_error(
        _post(frontend, _chat(frontend, max_tokens=101 - prompt)),
        400,
        "context_length_exceeded",
        "max_tokens",
    )
    assert (
        f"{prompt} tokens in the messages and {101 - prompt} in the completion" in error["message"]
    )
    long_text = [{"role": "user", "content": "word " * 200}]
    _assert_error(
        _post(frontend, _chat(frontend, messages=long_text)),
        400,
        "context_length_exceeded",
        "messages",
    )
    # An image counts with its expanded tokens (448 x 448: 256), not its one placeholder.
    image = {"type": "image_url", "image_url": {"url": data_url(encode_image(448, 448))}}
    with_image = [{"role": "user", "content": [image, {"type": "text", "text": "?"}]}]
    _assert_error(
        _post(frontend, _chat(frontend, messages=with_image)), 400, "context_length_exceeded"
    )
    assert _post(frontend, _chat(frontend, max_tokens=1)).status_code == 200


def test_min_tokens_over_max_tokens_is_refused_by_name(start_frontend) -> None:
    frontend = start_frontend("--context-length", "100")
    for field in ("max_tokens", "max_completion_tokens"):
        error = _assert_error(
            _post(frontend, _chat(frontend, min_tokens=5, **{field: 4})),
            400,
            "min_tokens_over_max_tokens",
            "min_tokens",
        )
        assert "(5)" in error["message"] and "(4)" in error["message"]
        assert _post(frontend, _chat(frontend, min_tokens=4, **{field: 4})).status_code == 200
    # Without max_tokens, min_tokens must fit in what the context leaves.
    _assert_error(
        _post(frontend, _chat(frontend, min_tokens=100)),
        400,
        "context_length_exceeded",
        "min_tokens",
    )


def test_the_model_bounds_the_context_by_default(frontend: RunningFrontend) -> None:
    limit = frontend.app.preprocessor.model.spec.max_position_embeddings
    assert limit is not None
    error = _assert_error(
        _post(frontend, _chat(frontend, max_tokens=limit)), 400, "context_length_exceeded"
    )
    assert str(limit) in error["message"]


def test_deadline_is_504_and_cancels_the_pipeline(start_frontend) -> None:
    frontend = start_frontend("--request-timeout", "0.5")
    frontend.dispatcher.hold_first_token = True
    error = _assert_error(_post(frontend, _chat(frontend)), 504, "deadline_exceeded")
    assert error["type"] == "server_error"
    assert frontend.dispatcher.cancelled.wait(5)


def test_client_disconnect_cancels_the_pipeline(frontend: RunningFrontend) -> None:
    frontend.dispatcher.hold_first_token = True
    with pytest.raises(httpx.ReadTimeout):
        _post(frontend, _chat(frontend, stream=True), timeout=0.5)
    assert frontend.dispatcher.cancelled.wait(5)


def test_pipeline_errors_keep_their_code_and_status(frontend: RunningFrontend) -> None:
    frontend.dispatcher.failure = RemoteError("engine.overloaded", "the engine queue is full", 503)
    error = _assert_error(_post(frontend, _chat(frontend)), 503, "engine.overloaded")
    assert error["message"] == "the engine queue is full"
    assert error["type"] == "server_error"


def test_pipeline_error_mid_stream_ends_with_an_error_event(frontend: RunningFrontend) -> None:
    frontend.dispatcher.failure = RemoteError("internal", "worker crashed", 500)
    frontend.dispatcher.fail_after = 3
    response = _post(frontend, _chat(frontend, stream=True))
    assert response.status_code == 200
    events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "worker crashed"
    assert json.loads(events[1])["choices"][0]["delta"]["content"]


def test_unknown_route_and_wrong_method(frontend: RunningFrontend) -> None:
    _assert_error(httpx.get(frontend.url + "/v1/embeddings"), 404, "not_found")
    _assert_error(httpx.get(frontend.url + "/v1/chat/completions"), 405, "method_not_allowed")
    _assert_error(httpx.get(frontend.url + "/v1/completions"), 405, "method_not_allowed")
