"""Tools and reasoning at the frontend, through a real uvicorn server in front of the echo
pipeline: history with calls and results rendered by the families' real templates, the
variables of chat_template_kwargs, the grammar tool_choice required and named hand to the
workers (after the reasoning when a reasoning parser is on), and every bad input refused by
name before anything is dispatched, the server serving on."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from mmserve.protocol import Grammar, PreprocessedRequest
from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.images import photo_like, png_data_url

from .conftest import RunningFrontend

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters
HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Paris for 2 days?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
            },
            {"id": "call_b", "type": "function", "function": {"name": "now", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_b", "content": "noon"},
]


@pytest.fixture(scope="module")
def qwen3_vl(start_frontend: Callable[..., RunningFrontend]) -> RunningFrontend:
    return start_frontend("--model-path", str(build_tiny_model("qwen3_vl")))


@pytest.fixture(scope="module")
def qwen3_5(start_frontend: Callable[..., RunningFrontend]) -> RunningFrontend:
    return start_frontend(
        "--model-path", str(build_tiny_model("qwen3_5")), "--reasoning-parser", "qwen3"
    )


def _post(frontend: RunningFrontend, **fields: Any) -> httpx.Response:
    body = {"model": frontend.model, "messages": HISTORY, "max_tokens": 4, **fields}
    return httpx.post(frontend.url + "/v1/chat/completions", json=body, timeout=60)


def _sent(frontend: RunningFrontend) -> PreprocessedRequest:
    return frontend.dispatcher.requests[-1]


def _grammar(frontend: RunningFrontend) -> Grammar:
    grammar = _sent(frontend).sampling.grammar
    assert grammar is not None
    return grammar


def _tokenizer(frontend: RunningFrontend) -> Any:
    return frontend.app.preprocessor.model.tokenizer


def _reference_ids(tokenizer: Any, tools: list[dict], **kwargs: Any) -> list[int]:
    """transformers' own rendering of HISTORY, the calls' arguments as objects (as vLLM passes
    them to templates)."""
    messages = json.loads(json.dumps(HISTORY))
    for call in messages[2]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    messages[2]["content"] = ""
    text = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_history_with_calls_and_results_renders_through_the_real_template(
    family: str, request: pytest.FixtureRequest
) -> None:
    frontend: RunningFrontend = request.getfixturevalue(family)
    assert _post(frontend, tools=[WEATHER, NOW]).status_code == 200
    ids = list(_sent(frontend).plan.token_ids)
    tokenizer = _tokenizer(frontend)
    assert ids == _reference_ids(tokenizer, [WEATHER, {"type": "function", "function": {
        "name": "now", "parameters": {"type": "object", "properties": {}}}}])  # fmt: skip
    text = tokenizer.decode(ids)
    hermes = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
    xml = "<function=get_weather>\n<parameter=city>\nParis\n</parameter>"
    assert (hermes if family == "qwen3_vl" else xml) in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert '"name": "get_weather", "description": "The weather in a city"' in text


def test_chat_template_kwargs_reach_the_template(qwen3_5: RunningFrontend) -> None:
    tokenizer = _tokenizer(qwen3_5)
    assert _post(qwen3_5).status_code == 200
    assert tokenizer.decode(_sent(qwen3_5).plan.token_ids).endswith("assistant\n<think>\n")
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert _post(qwen3_5, **off).status_code == 200
    assert tokenizer.decode(_sent(qwen3_5).plan.token_ids).endswith("<think>\n\n</think>\n\n")


def test_required_and_named_hand_vllms_schemas_to_the_workers(qwen3_vl: RunningFrontend) -> None:
    assert _post(qwen3_vl, tools=[WEATHER, NOW], tool_choice="required").status_code == 200
    grammar = _sent(qwen3_vl).sampling.grammar
    assert grammar is not None and grammar.kind == "json_schema" and grammar.start_after is None
    schema = json.loads(grammar.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["now"]]
    parameters = schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert parameters == WEATHER["function"]["parameters"]

    single = {"tool_choice": "required", "parallel_tool_calls": False}
    assert _post(qwen3_vl, tools=[WEATHER, NOW], **single).status_code == 200
    assert json.loads(_grammar(qwen3_vl).spec)["maxItems"] == 1

    named = {"type": "function", "function": {"name": "now"}}
    assert _post(qwen3_vl, tools=[WEATHER, NOW], tool_choice=named).status_code == 200
    assert json.loads(_grammar(qwen3_vl).spec) == {"type": "object", "properties": {}}

    for choice in ("auto", "none"):
        assert _post(qwen3_vl, tools=[WEATHER], tool_choice=choice).status_code == 200
        assert _sent(qwen3_vl).sampling.grammar is None


def test_with_a_reasoning_parser_the_grammar_starts_after_the_reasoning(
    qwen3_5: RunningFrontend,
) -> None:
    end = _tokenizer(qwen3_5).convert_tokens_to_ids("</think>")
    assert _post(qwen3_5, tools=[WEATHER], tool_choice="required").status_code == 200
    assert _grammar(qwen3_5).start_after == end
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert _post(qwen3_5, tools=[WEATHER], tool_choice="required", **off).status_code == 200
    assert _grammar(qwen3_5).start_after is None  # the prompt closed it


def test_text_that_is_no_call_comes_back_as_content_streamed_or_not(
    qwen3_vl: RunningFrontend,
) -> None:
    # The echo pipeline answers with the prompt's text, which is no array of calls: it is the
    # content, as the model wrote it, and the finish is the engine's.
    client = openai.OpenAI(base_url=qwen3_vl.url + "/v1", api_key="x", max_retries=0)
    asked: dict[str, Any] = {
        "model": qwen3_vl.model,
        "messages": HISTORY,
        "max_tokens": 12,
        "tools": [WEATHER],
    }
    whole = client.chat.completions.create(**asked, tool_choice="required")
    message = whole.choices[0].message
    assert message.tool_calls is None and message.content
    assert whole.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(**asked, tool_choice="required", stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == message.content
    assert chunks[-1].choices[0].finish_reason == "length"


RESERVED = "template.reserved_variable"
BAD_INPUTS = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "thing"}}}]},
     "tools.schema", "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": 5}}}]},
     "tools.schema", "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.schema", "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools.duplicate_name", "tools[1]"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tools.choice", "tool_choice"),
    ({"tool_choice": "required"}, "tools.choice", "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "invalid_value", "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "invalid_value", "tool_choice"),
    ({"chat_template_kwargs": {"tokenize": True}}, RESERVED, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, RESERVED, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"namespace": 1}}, RESERVED, "chat_template_kwargs"),
    # The grammar of required and named: a keyword it would not enforce, a second grammar.
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
      "properties": {"a": {"allOf": [{"type": "string"}]}}}}}], "tool_choice": "required"},
     "grammar.unsupported", "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "response_format": {"type": "json_object"}}, "grammar.invalid", "response_format"),
    ({"messages": [*HISTORY[:2], {**HISTORY[2], "tool_calls": [{"id": "c", "type": "function",
      "function": {"name": "f", "arguments": "{not json"}}]}, HISTORY[3]]},
     "tools.arguments", "messages[2].tool_calls[0].function.arguments"),
    ({"messages": [*HISTORY[:2], {**HISTORY[2], "tool_calls": [{"id": "c", "type": "function",
      "function": {"name": "f", "arguments": "[1]"}}]}, HISTORY[3]]},
     "tools.arguments", "messages[2].tool_calls[0].function.arguments"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "code", "param"), BAD_INPUTS)
def test_bad_tool_inputs_are_refused_by_name_and_the_server_serves_on(
    qwen3_vl: RunningFrontend, fields: dict[str, Any], code: str, param: str
) -> None:
    dispatched = len(qwen3_vl.dispatcher.requests)
    response = _post(qwen3_vl, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["param"].startswith(param), error
    assert len(qwen3_vl.dispatcher.requests) == dispatched  # refused before dispatch
    assert _post(qwen3_vl, tools=[WEATHER]).status_code == 200


def test_a_template_that_cannot_render_tools_is_a_clear_400(frontend: RunningFrontend) -> None:
    # The tiny Qwen2-VL carries Qwen2-VL's template, which renders neither tools nor calls.
    body = {"model": frontend.model, "messages": HISTORY[:2], "tools": [WEATHER]}
    response = httpx.post(frontend.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "chat_template"
    assert response.json()["error"]["param"] == "tools"
    body = {"model": frontend.model, "messages": HISTORY}
    response = httpx.post(frontend.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.json()["error"]["param"] == "messages[2].tool_calls"
    ok = {"model": frontend.model, "messages": HISTORY[:2], "max_tokens": 2}
    assert httpx.post(frontend.url + "/v1/chat/completions", json=ok, timeout=60).status_code == 200


def test_tool_choice_auto_without_a_parser_is_refused(
    start_frontend: Callable[..., RunningFrontend],
) -> None:
    frontend = start_frontend(
        "--model-path", str(build_tiny_model("qwen3_vl")), "--tool-call-parser", "none"
    )
    response = _post(frontend, tools=[WEATHER])
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "unsupported_option"
    assert response.json()["error"]["param"] == "tool_choice"
    assert _post(frontend, tools=[WEATHER], tool_choice="required").status_code == 200


def test_a_processor_template_kept_apart_is_the_one_rendered(
    start_frontend: Callable[..., RunningFrontend], tmp_path_factory: pytest.TempPathFactory
) -> None:
    # As Qwen2.5-VL's checkpoints ship them: the text model's template (tools, no images) in
    # tokenizer_config.json, the processor's (images, no tools) in chat_template.json.
    tiny = build_tiny_model("qwen2_5_vl")
    checkpoint = tmp_path_factory.mktemp("qwen2_5_vl") / tiny.name
    shutil.copytree(tiny, checkpoint)
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    (checkpoint / "chat_template.json").write_text(
        json.dumps({"chat_template": config["chat_template"]})
    )
    config["chat_template"] = TEXT_TEMPLATE
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(config))
    frontend = start_frontend("--model-path", str(checkpoint))
    image = {"type": "image_url", "image_url": {"url": png_data_url(photo_like(64, 48, 0))}}
    content = [image, {"type": "text", "text": "What is it?"}]
    body = {"model": frontend.model, "messages": [{"role": "user", "content": content}]}
    response = httpx.post(frontend.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    response = httpx.post(
        frontend.url + "/v1/chat/completions", json={**body, "tools": [WEATHER]}, timeout=60
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"


# Qwen2.5's text template, in short: it renders tools and string contents only.
TEXT_TEMPLATE = (
    "{%- if tools %}{{- tools | tojson }}{%- endif %}{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_the_default_tool_call_parser_is_the_format_the_template_writes(
    qwen3_vl: RunningFrontend, qwen3_5: RunningFrontend, frontend: RunningFrontend
) -> None:
    assert qwen3_vl.app.preprocessor.tool_call_parser == "hermes"
    assert qwen3_5.app.preprocessor.tool_call_parser == "qwen3_coder"
    assert frontend.app.preprocessor.tool_call_parser is None  # Qwen2-VL's writes no calls
