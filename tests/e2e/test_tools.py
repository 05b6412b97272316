"""Reasoning output and tool calls through real deployments, under the official openai client,
instructor and LangChain: the tiny Qwen3.5 aggregated, whose real template opens `<think>` and
asks for Qwen3-Coder's XML calls, served with `--reasoning-parser qwen3`; and the tiny
Qwen3-VL with its prefill and decode workers apart (EP/D), whose template asks for Hermes-style
calls, with an image.

A tiny model with random weights neither ends its reasoning nor writes calls by itself; these
tests make it do so with what any client may send: a `logit_bias` on `</think>` (the reasoning
then ends after a few tokens, a different number for each seed), the grammars of tool_choice
required and named, and for `auto` a `structured_outputs` regex in the family's call format
(the model then writes a call, which the parser reads as it would any)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import instructor
import jsonschema_rs
import openai
import pydantic
import pytest
from langchain_openai import ChatOpenAI

from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.deployment import Deployment
from tests.support.images import photo_like, png_data_url
from tests.support.tools import WEATHER, WEATHER_PARAMETERS

MODEL = "tiny-qwen3_5-seed0"
THINK_END = 248069  # Qwen3.5's </think>
ENDS_REASONING = {str(THINK_END): 10}
THINKING_OFF = {"chat_template_kwargs": {"enable_thinking": False}}
NOW = {"type": "function", "function": {"name": "now", "description": "The time"}}
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "now": {"type": "object", "properties": {}}}


@pytest.fixture(scope="module")
def qwen3_5(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    deployment = Deployment(
        "agg",
        build_tiny_model("qwen3_5"),
        nats_url,
        tmp_path_factory.mktemp("tools-logs"),
        frontend_flags=["--reasoning-parser", "qwen3"],
    )
    with deployment.running():
        yield deployment


@pytest.fixture(scope="module")
def client(qwen3_5: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{qwen3_5.base_url}/v1", api_key="x", max_retries=0)


def _ask(client: openai.OpenAI, seed: int, **extra: Any) -> Any:
    asked = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Think, then answer."}],
        "max_tokens": 12,
        "seed": seed,
        "logit_bias": ENDS_REASONING,
    }
    return client.chat.completions.create(**{**asked, **extra})


@pytest.fixture(scope="module")
def thinking(client: openai.OpenAI) -> tuple[int, str]:
    """A seed whose completion reasons for a while, closes `</think>` (once: the bias may
    make it write the tag again in its answer, where it is text) and then answers, and that
    completion as the model wrote it (SGLang's `separate_reasoning: false`)."""
    for seed in range(16):
        raw = _ask(client, seed, extra_body={"separate_reasoning": False})
        text = raw.choices[0].message.content
        reasoning, _, answer = text.partition("</think>")
        if text.count("</think>") == 1 and reasoning.strip() and answer.strip():
            return seed, text
    raise AssertionError("no seed made the tiny model end its reasoning and answer")


def test_the_reasoning_is_split_from_the_answer_streamed_or_not(
    client: openai.OpenAI, thinking: tuple[int, str]
) -> None:
    seed, raw = thinking
    reasoning, _, answer = raw.partition("</think>")
    message = _ask(client, seed).choices[0].message
    assert message.model_extra["reasoning_content"] == reasoning.strip()
    assert message.model_extra["reasoning"] == reasoning.strip()  # vLLM's newer name
    assert message.content == answer.lstrip()
    assert "<think>" not in message.content and "</think>" not in message.content

    kinds, reasoning_parts, content_parts = [], [], []
    for chunk in _ask(client, seed, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        if extra.get("reasoning_content"):
            assert extra["reasoning"] == extra["reasoning_content"]
            kinds.append("reasoning")
            reasoning_parts.append(extra["reasoning_content"])
        if delta.content:
            kinds.append("content")
            content_parts.append(delta.content)
    assert "".join(reasoning_parts) == message.model_extra["reasoning_content"]
    assert "".join(content_parts) == message.content
    # Every reasoning delta comes before the first content delta, and there are several.
    assert kinds == sorted(kinds, key=["reasoning", "content"].index)
    assert kinds.count("reasoning") > 1 and kinds.count("content") > 1


def test_include_reasoning_false_leaves_it_out(
    client: openai.OpenAI, thinking: tuple[int, str]
) -> None:
    seed, raw = thinking
    message = _ask(client, seed, extra_body={"include_reasoning": False}).choices[0].message
    assert "reasoning_content" not in (message.model_extra or {})
    assert message.content == raw.partition("</think>")[2].lstrip()


def test_with_thinking_off_the_completion_is_all_answer(client: openai.OpenAI) -> None:
    # The template closes an empty reasoning section in the prompt; the parser then reads
    # the whole completion as the answer, a </think> in it included.
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    message = _ask(client, 0, extra_body=off).choices[0].message
    raw = _ask(client, 0, extra_body={**off, "separate_reasoning": False}).choices[0].message
    assert "reasoning_content" not in (message.model_extra or {})
    assert message.content == raw.content


def _valid_calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    """The message's calls, each with arguments that parse and validate against its tool."""
    assert message.tool_calls, message
    calls = []
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        arguments = json.loads(call.function.arguments)
        jsonschema_rs.validate(SCHEMAS[call.function.name], arguments)
        calls.append((call.function.name, arguments))
    return calls


def _tools_request(model: str, extra: dict[str, Any]) -> dict[str, Any]:
    asked = {
        "model": model,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER, NOW],
        "max_tokens": 96,  # the grammars end the calls
        "temperature": 0,
    }
    return {**asked, **extra}


def _ask_tools(client: openai.OpenAI, model: str, **extra: Any) -> Any:
    return client.chat.completions.create(**_tools_request(model, extra))


def _streamed_tools(client: openai.OpenAI, model: str, **extra: Any) -> tuple[Any, int]:
    """The openai client's own assembly of a streamed answer's calls, and how many argument
    fragments the stream carried."""
    fragments = 0
    with client.chat.completions.stream(**_tools_request(model, extra)) as stream:
        for event in stream:
            fragments += event.type == "tool_calls.function.arguments.delta"
        return stream.get_final_completion(), fragments


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_required_and_named_calls_validate_streamed_or_not(
    client: openai.OpenAI, tool_choice: Any
) -> None:
    # One call (a random model may go on adding calls to required's array; EP/D's test lets it).
    asked = {"tool_choice": tool_choice, "parallel_tool_calls": False, "extra_body": THINKING_OFF}
    whole = _ask_tools(client, MODEL, **asked)
    calls = _valid_calls(whole.choices[0].message)
    assert whole.choices[0].finish_reason == "tool_calls"
    assert whole.choices[0].message.content is None
    if isinstance(tool_choice, dict):
        assert [name for name, _ in calls] == ["get_weather"]
    streamed, fragments = _streamed_tools(client, MODEL, **asked)
    assert _valid_calls(streamed.choices[0].message) == calls
    assert streamed.choices[0].finish_reason == "tool_calls"
    assert fragments > 1  # the arguments stream as they are generated


def test_with_thinking_on_the_call_comes_after_the_reasoning(
    client: openai.OpenAI, thinking: tuple[int, str]
) -> None:
    # The grammar starts after </think>: the reasoning is free text, the call valid JSON.
    seed, _ = thinking
    named = {"type": "function", "function": {"name": "get_weather"}}
    answer = _ask(client, seed, tools=[WEATHER], tool_choice=named, max_tokens=96).choices[0]
    assert answer.message.model_extra["reasoning_content"]
    assert _valid_calls(answer.message)[0][0] == "get_weather"


def test_auto_reads_the_call_the_model_writes(client: openai.OpenAI) -> None:
    # The regex makes the model write a call in its own format; the qwen3_coder parser reads it.
    call = (
        "<tool_call>\\n<function=get_weather>\\n<parameter=city>\\n[A-Z][a-z]{2,4}\\n"
        "</parameter>\\n<parameter=days>\\n[1-7]\\n</parameter>\\n</function>\\n</tool_call>"
    )
    asked = {"extra_body": {**THINKING_OFF, "structured_outputs": {"regex": call}}}
    whole = _ask_tools(client, MODEL, tool_choice="auto", **asked).choices[0]
    [(name, arguments)] = _valid_calls(whole.message)
    assert name == "get_weather" and isinstance(arguments["days"], int)
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    streamed, fragments = _streamed_tools(client, MODEL, tool_choice="auto", **asked)
    assert _valid_calls(streamed.choices[0].message) == [(name, arguments)]
    assert fragments > 1
    none = _ask_tools(client, MODEL, tool_choice="none", max_tokens=12, **asked).choices[0]
    assert none.message.tool_calls is None and none.message.content.startswith("<tool_call>")


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    days: int = pydantic.Field(ge=1, le=7)


def test_instructor_tools_mode_returns_a_validated_object(qwen3_5: Deployment) -> None:
    client = instructor.from_openai(
        openai.OpenAI(base_url=f"{qwen3_5.base_url}/v1", api_key="x", max_retries=0),
        mode=instructor.Mode.TOOLS,
    )
    weather = client.chat.completions.create(
        model=MODEL,
        response_model=Weather,
        messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}],
        max_tokens=48,
        max_retries=0,
        extra_body=THINKING_OFF,
    )
    assert isinstance(weather, Weather)


def test_langchain_function_calling_and_bind_tools(qwen3_5: Deployment) -> None:
    llm = ChatOpenAI(
        model=MODEL,
        base_url=f"{qwen3_5.base_url}/v1",
        api_key="x",  # type: ignore[arg-type]
        max_completion_tokens=96,
        temperature=0,
        extra_body=THINKING_OFF,
    )
    weather = llm.with_structured_output(Weather, method="function_calling").invoke("Paris?")
    assert isinstance(weather, Weather)

    # A tool as LangChain binds a pydantic model (its fields bound, so a random model ends them).
    message = llm.bind_tools([Weather], tool_choice="Weather").invoke("Paris?")
    [call] = message.tool_calls
    assert call["name"] == "Weather" and (call["id"] or "").startswith("call_")
    Weather.model_validate(call["args"])
    streamed: Any = None
    # One call: a random model would go on adding calls to the array until max_tokens.
    single = llm.bind_tools([Weather], tool_choice="any", parallel_tool_calls=False)
    for chunk in single.stream("Paris?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None
    [call] = streamed.tool_calls
    assert call["name"] == "Weather"
    Weather.model_validate(call["args"])


@pytest.fixture(scope="module")
def ep_d(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """The tiny Qwen3-VL with its prefill and decode workers apart: Hermes-style calls."""
    deployment = Deployment(
        "ep_d", build_tiny_model("qwen3_vl"), nats_url, tmp_path_factory.mktemp("ep-d-logs")
    )
    with deployment.running():
        yield deployment


def test_calls_about_an_image_in_prefill_decode(ep_d: Deployment) -> None:
    """Required and named calls, the grammar handed from prefill to decode. (tool_choice auto
    is read by the frontend from the text the workers send, the same in every pattern.)"""
    client = openai.OpenAI(base_url=f"{ep_d.base_url}/v1", api_key="x", max_retries=0)
    image = {"type": "image_url", "image_url": {"url": png_data_url(photo_like(64, 48, 1))}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": "Where is it?"}]}]
    model = "tiny-qwen3_vl-seed0"
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        asked = {"tool_choice": tool_choice, "messages": messages}
        whole = _ask_tools(client, model, **asked).choices[0]
        calls = _valid_calls(whole.message)
        assert whole.finish_reason == "tool_calls"
        streamed, fragments = _streamed_tools(client, model, **asked)
        assert _valid_calls(streamed.choices[0].message) == calls and fragments > 1
