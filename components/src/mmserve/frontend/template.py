"""The model's chat template as the frontend renders it: the messages in the form HF templates
read (media parts, an assistant's tool calls with their arguments as objects, reasoning), the
variables a request may add (`chat_template_kwargs`), and what the template can render at all,
read once from its source: a template that never reads `tools` would drop them silently, so a
request with tools is refused instead."""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from typing import Any

from mmserve.frontend.errors import ApiError
from mmserve.frontend.tool_parsers import TOOL_CALL_START
from mmserve.protocol import (
    ERROR_CHAT_TEMPLATE,
    ERROR_TEMPLATE_VARIABLE,
    ERROR_TOOLS_ARGUMENTS,
    AudioEmbedsPart,
    AudioUrlPart,
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    InputAudioPart,
    TextPart,
    VideoUrlPart,
)


@dataclass(frozen=True)
class TemplateFacts:
    """What a chat template reads: the tools (`tools`) and an assistant's calls
    (`message.tool_calls`); and the names `chat_template_kwargs` may not take (those the
    renderer itself is called with, and the template's functions)."""

    renders_tools: bool
    renders_tool_calls: bool
    reserved: frozenset[str]
    # The format the template writes an assistant's calls in (`tool_parsers.py`'s names),
    # which is what its model was trained to write: the default `--tool-call-parser`.
    tool_call_format: str | None = None

    @classmethod
    def of(cls, tokenizer: Any, chat_template: str | None = None) -> TemplateFacts:
        """The facts of `chat_template`, else of the tokenizer's own template."""
        import jinja2
        from jinja2 import meta, nodes

        source = tokenizer.get_chat_template(chat_template, tools=[{}])
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
        reads_calls = any(
            (isinstance(node, nodes.Getattr) and node.attr == "tool_calls")
            or (
                isinstance(node, nodes.Getitem)
                and isinstance(node.arg, nodes.Const)
                and node.arg.value == "tool_calls"
            )
            for node in ast.find_all((nodes.Getattr, nodes.Getitem))
        )
        parameters = inspect.signature(tokenizer.apply_chat_template).parameters
        reserved = {name for name, p in parameters.items() if p.kind is not p.VAR_KEYWORD}
        # And the template's functions, which a variable of the same name would hide
        # (jinja's `namespace`, ...; transformers adds `raise_exception` and `strftime_now`).
        functions = {*jinja2.Environment().globals, "raise_exception", "strftime_now"}
        return cls(
            renders_tools="tools" in meta.find_undeclared_variables(ast),
            renders_tool_calls=reads_calls,
            reserved=frozenset(reserved | functions | {"messages"}),
            tool_call_format=call_format(source) if reads_calls else None,
        )

    def check(self, request: ChatCompletionRequest) -> None:
        """Refuse what this template would drop or what would break its renderer."""
        if request.tools and not self.renders_tools:
            raise ApiError(
                ERROR_CHAT_TEMPLATE,
                "this model's chat template does not render tools, so the model would never "
                "see them",
                param="tools",
            )
        for m, message in enumerate(request.messages):
            if message.tool_calls and not self.renders_tool_calls:
                raise ApiError(
                    ERROR_CHAT_TEMPLATE,
                    "this model's chat template does not render an assistant's tool calls",
                    param=f"messages[{m}].tool_calls",
                )
        for name in request.chat_template_kwargs or {}:
            if name in self.reserved:
                raise ApiError(
                    ERROR_TEMPLATE_VARIABLE,
                    f"chat_template_kwargs may not set {name!r}: the server sets it",
                    param="chat_template_kwargs",
                )


def call_format(source: str) -> str | None:
    """The call format a template writes: Qwen3-Coder's XML (`<tool_call>` then
    `<function=...>`: Qwen3.5), Hermes-style JSON in `<tool_call>` (Qwen2.5, Qwen3-VL), or
    one no parser here reads (None)."""
    if TOOL_CALL_START not in source:
        return None
    return "qwen3_coder" if "<function=" in source else "hermes"


def template_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages in the form HF chat templates read (`{"type": "image"}` per image,
    `{"type": "video"}` per video, an assistant's calls with their arguments as objects, as
    vLLM passes them: Qwen3.5's template iterates them)."""
    return [_template_message(m, message) for m, message in enumerate(request.messages)]


def _template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    role = "system" if message.role == "developer" else message.role
    content = message.content
    rendered: dict[str, Any] = {"role": role}
    if content is None:
        rendered["content"] = ""
    elif isinstance(content, str):
        rendered["content"] = content
    else:
        rendered["content"] = [_template_part(part) for part in content]
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type,
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(
                        call.function.arguments,
                        f"messages[{index}].tool_calls[{c}].function.arguments",
                    ),
                },
            }
            for c, call in enumerate(message.tool_calls)
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    reasoning = message.reasoning_content if message.reasoning is None else message.reasoning
    if reasoning is not None:
        rendered["reasoning_content"] = reasoning
    return rendered


def _arguments(text: str, param: str) -> dict[str, Any]:
    try:
        arguments = json.loads(text)
    except json.JSONDecodeError as err:
        raise ApiError(
            ERROR_TOOLS_ARGUMENTS, f"a tool call's arguments are not JSON: {err}", param=param
        ) from None
    if not isinstance(arguments, dict):
        raise ApiError(
            ERROR_TOOLS_ARGUMENTS, "a tool call's arguments must be a JSON object", param=param
        )
    return arguments


def _template_part(part: ContentPart) -> dict[str, str]:
    if isinstance(part, TextPart):
        return {"type": "text", "text": part.text}
    if isinstance(part, InputAudioPart | AudioUrlPart | AudioEmbedsPart):
        return {"type": "audio"}
    return {"type": "video" if isinstance(part, VideoUrlPart) else "image"}
