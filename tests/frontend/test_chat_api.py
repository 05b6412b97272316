"""The chat completions API through a real uvicorn server: the official openai client (sync and
streaming), curl, and the token ids handed to the pipeline."""

from __future__ import annotations

import json
import subprocess

import httpx
import openai
import pytest

from mmserve.protocol import PreprocessedRequest

from .conftest import RunningFrontend

IMAGE_PAD = 151655


def _client(frontend: RunningFrontend, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=frontend.url + "/v1", api_key=api_key, max_retries=0)


def _echo_text(frontend: RunningFrontend, request: PreprocessedRequest, limit: int) -> str:
    tokenizer = frontend.app.preprocessor.model.tokenizer
    return tokenizer.decode(request.plan.token_ids[:limit], skip_special_tokens=True)


def test_non_streaming_completion_with_the_openai_client(frontend: RunningFrontend) -> None:
    completion = _client(frontend).chat.completions.create(
        model=frontend.model,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": [{"type": "text", "text": "What is two plus two?"}]},
        ],
        max_tokens=500,
        temperature=0.0,
        top_p=0.5,
        seed=7,
        extra_body={"top_k": 4},
    )
    sent = frontend.dispatcher.requests[-1]
    assert completion.id == sent.request_id and completion.id.startswith("chatcmpl-")
    assert completion._request_id == completion.id  # the x-request-id header
    text = completion.choices[0].message.content
    # The chat template's turns, in order, with the model's own role markers.
    assert text == (
        "system\nBe brief.\nuser\nHello there\nassistant\nHi.\nuser\nWhat is two plus two?\n"
        "assistant\n"
    )
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(sent.plan.token_ids)
    assert completion.usage.completion_tokens == len(sent.plan.token_ids)
    assert sent.sampling.temperature == 0.0 and sent.sampling.top_p == 0.5
    assert sent.sampling.top_k == 4 and sent.sampling.seed == 7
    assert sent.stop.max_tokens == 500
    assert sent.plan.media == [] and sent.payloads == [] and sent.plan.positions is None


def test_streaming_with_usage_and_max_completion_tokens(frontend: RunningFrontend) -> None:
    stream = _client(frontend).chat.completions.create(
        model=frontend.model,
        messages=[{"role": "user", "content": "Count with me"}],
        max_completion_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    sent = frontend.dispatcher.requests[-1]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == _echo_text(frontend, sent, 6)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert {c.id for c in chunks} == {sent.request_id}


def test_stop_string_cuts_the_text_and_ends_the_generation(frontend: RunningFrontend) -> None:
    completion = _client(frontend).chat.completions.create(
        model=frontend.model,
        messages=[{"role": "user", "content": "alpha beta gamma"}],
        stop=["beta", "never"],
    )
    assert (
        completion.choices[0].message.content
        == "system\nYou are a helpful assistant.\nuser\nalpha "
    )
    assert completion.choices[0].finish_reason == "stop"
    assert frontend.dispatcher.requests[-1].stop.stop == ["beta", "never"]
    assert frontend.dispatcher.cancelled.wait(5), "the pipeline was not told to stop"


def test_streaming_stop_string_split_across_tokens(frontend: RunningFrontend) -> None:
    stream = _client(frontend).chat.completions.create(
        model=frontend.model,
        messages=[{"role": "user", "content": "one twothree four"}],
        stop="twothree",
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.endswith("user\none ")
    assert "two" not in text


def test_curl_streams_server_sent_events(frontend: RunningFrontend) -> None:
    body = {
        "model": frontend.model,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": 3,
    }
    result = subprocess.run(
        ["curl", "-sS", "-N", frontend.url + "/v1/chat/completions",
         "-H", "Content-Type: application/json", "-d", json.dumps(body)],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    events = [line for line in result.stdout.split("\n\n") if line]
    assert all(event.startswith("data: ") for event in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(event[len("data: ") :]) for event in events[:-1]]
    assert {p["object"] for p in payloads} == {"chat.completion.chunk"}
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_curl_non_streaming(frontend: RunningFrontend) -> None:
    body = {"model": frontend.model, "messages": [{"role": "user", "content": "hi"}]}
    result = subprocess.run(
        ["curl", "-sS", "-w", "\n%{http_code}", frontend.url + "/v1/chat/completions",
         "-H", "Content-Type: application/json", "-d", json.dumps(body)],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    payload, status = result.stdout.rsplit("\n", 1)
    assert status == "200"
    response = json.loads(payload)
    assert response["id"] == frontend.dispatcher.requests[-1].request_id
    assert response["object"] == "chat.completion"
    assert response["choices"][0]["message"]["role"] == "assistant"
    assert response["usage"]["total_tokens"] == (
        response["usage"]["prompt_tokens"] + response["usage"]["completion_tokens"]
    )


def test_models_lists_the_served_model(frontend: RunningFrontend) -> None:
    models = _client(frontend).models.list()
    assert [m.id for m in models.data] == [frontend.model]


def test_health_follows_the_pipeline(frontend: RunningFrontend) -> None:
    assert httpx.get(frontend.url + "/health").status_code == 200
    frontend.dispatcher.is_ready = False
    response = httpx.get(frontend.url + "/health")
    assert response.status_code == 503
    assert "worker" in response.json()["reason"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/models"])
def test_api_key_is_required_when_set(start_frontend, path: str) -> None:
    frontend = start_frontend("--api-key", "s3cret")
    client = _client(frontend, api_key="wrong")
    with pytest.raises(openai.AuthenticationError) as info:
        if path == "/v1/models":
            client.models.list()
        else:
            client.chat.completions.create(
                model=frontend.model, messages=[{"role": "user", "content": "hi"}]
            )
    assert info.value.status_code == 401
    assert info.value.code == "invalid_api_key"
    authorized = _client(frontend, api_key="s3cret")
    assert [m.id for m in authorized.models.list().data] == [frontend.model]
    assert httpx.get(frontend.url + "/health").status_code == 200


def _sse_payloads(frontend: RunningFrontend, **fields: object) -> list[dict]:
    body = {"model": frontend.model, "stream": True, **fields}
    response = httpx.post(frontend.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    events = [event for event in response.text.split("\n\n") if event]
    assert events[-1] == "data: [DONE]"
    return [json.loads(event[len("data: ") :]) for event in events[:-1]]


@pytest.mark.parametrize("stream", [False, True])
def test_a_completion_cut_inside_a_character_keeps_its_end(
    frontend: RunningFrontend, stream: bool
) -> None:
    """max_tokens ends the echo on the first token of 東 (" " and its first bytes): the text is
    the tokenizer's decode of the ids, " �" last, streamed or not."""
    messages = [{"role": "user", "content": "a 東京"}]
    client = _client(frontend)
    client.chat.completions.create(model=frontend.model, messages=messages, max_tokens=1)
    ids = frontend.dispatcher.requests[-1].plan.token_ids
    cut = ids.index(60596) + 1  # " æĿ": a space and 東's first two bytes
    if stream:
        chunks = client.chat.completions.create(
            model=frontend.model, messages=messages, max_tokens=cut, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        completion = client.chat.completions.create(
            model=frontend.model, messages=messages, max_tokens=cut
        )
        text = completion.choices[0].message.content or ""
    sent = frontend.dispatcher.requests[-1]
    assert text == _echo_text(frontend, sent, cut) and text.endswith("a \ufffd")


def test_ignore_eos_and_min_tokens_reach_the_pipeline(frontend: RunningFrontend) -> None:
    client = _client(frontend)
    messages = [{"role": "user", "content": "hi"}]
    client.chat.completions.create(model=frontend.model, messages=messages, max_tokens=5)
    assert frontend.dispatcher.requests[-1].stop.ignore_eos is False
    assert frontend.dispatcher.requests[-1].stop.min_tokens == 0
    client.chat.completions.create(
        model=frontend.model,
        messages=messages,
        max_tokens=5,
        extra_body={"ignore_eos": True, "min_tokens": 5},
    )
    sent = frontend.dispatcher.requests[-1].stop
    assert (sent.ignore_eos, sent.min_tokens, sent.max_tokens) == (True, 5, 5)
    # Without max_tokens the budget is never below min_tokens.
    default = frontend.app.preprocessor.options.default_max_tokens
    client.chat.completions.create(
        model=frontend.model, messages=messages, extra_body={"min_tokens": default + 1}
    )
    assert frontend.dispatcher.requests[-1].stop.max_tokens >= default + 1


def test_a_stop_string_in_the_min_tokens_text_does_not_end_it(frontend: RunningFrontend) -> None:
    """The echo's text: "system ... user\\nalpha beta alpha beta"; the first "beta" falls in the
    first min_tokens tokens, so the second one stops the completion (vLLM's rule)."""
    messages = [{"role": "user", "content": "alpha beta alpha beta"}]
    client = _client(frontend)
    client.chat.completions.create(model=frontend.model, messages=messages, max_tokens=1)
    ids = frontend.dispatcher.requests[-1].plan.token_ids
    tokenizer = frontend.app.preprocessor.model.tokenizer
    first_beta = next(
        n for n in range(len(ids)) if tokenizer.decode(ids[:n]).endswith("alpha beta")
    )
    completion = client.chat.completions.create(
        model=frontend.model, messages=messages, stop="beta", extra_body={"min_tokens": first_beta}
    )
    text = completion.choices[0].message.content or ""
    assert text.endswith("user\nalpha beta alpha ")
    assert completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("include_usage", [True, False])
def test_continuous_usage_stats_put_usage_on_every_chunk(
    frontend: RunningFrontend, include_usage: bool
) -> None:
    payloads = _sse_payloads(
        frontend,
        messages=[{"role": "user", "content": "Count with me"}],
        max_tokens=6,
        stream_options={"include_usage": include_usage, "continuous_usage_stats": True},
    )
    prompt = len(frontend.dispatcher.requests[-1].plan.token_ids)
    usages = [p["usage"] for p in payloads]
    assert all(u is not None and u["prompt_tokens"] == prompt for u in usages)
    completions = [u["completion_tokens"] for u in usages]
    assert completions == sorted(completions) and completions[-1] == 6
    assert all(u["total_tokens"] == prompt + u["completion_tokens"] for u in usages)
    # The usage-only chunk comes last only with include_usage.
    assert (payloads[-1]["choices"] == []) == include_usage
    plain = _sse_payloads(
        frontend, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream_options={}
    )
    assert all(p["usage"] is None for p in plain)
