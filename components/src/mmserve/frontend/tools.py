"""A chat request's tools (OpenAI's `tools` and `tool_choice`): their checks, their form for
the chat template, the parameter types a parser converts values by, and the grammar that
`tool_choice: "required"` or a named tool constrains decoding with (vLLM's schemas: an array
of `{"name", "parameters"}` objects, or the named tool's parameters), so the calls always
parse and validate."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any, Literal

import jsonschema_rs

from mmserve.frontend.errors import ApiError
from mmserve.frontend.structured import structured_form
from mmserve.grammar.base import GrammarError
from mmserve.grammar.cache import check
from mmserve.protocol import (
    ERROR_GRAMMAR_INVALID,
    ERROR_TOOLS_CHOICE,
    ERROR_TOOLS_DUPLICATE,
    ERROR_TOOLS_SCHEMA,
    ERROR_UNSUPPORTED_OPTION,
    ChatCompletionRequest,
    Grammar,
    NamedToolChoice,
    Tool,
)

ToolMode = Literal["none", "auto", "required"] | NamedToolChoice
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def tool_mode(request: ChatCompletionRequest) -> ToolMode:
    """What the request asks of the model's calls: OpenAI's default is `auto` with tools and
    `none` without."""
    if request.tool_choice is not None:
        return request.tool_choice
    return "auto" if request.tools else "none"


def check_tools(request: ChatCompletionRequest, parser: str | None) -> None:
    """The tools' names and parameter schemas, and a `tool_choice` they can serve; `auto`
    needs a tool-call parser (`parser`)."""
    names: set[str] = set()
    for t, tool in enumerate(request.tools or []):
        name = tool.function.name
        if name in names:
            raise ApiError(
                ERROR_TOOLS_DUPLICATE, f"two tools are named {name!r}", param=f"tools[{t}]"
            )
        names.add(name)
        _check_parameters(tool.function.parameters, f"tools[{t}].function.parameters")
    mode = tool_mode(request)
    if isinstance(mode, NamedToolChoice) and mode.function.name not in names:
        raise ApiError(
            ERROR_TOOLS_CHOICE,
            f"tool_choice names {mode.function.name!r}, which is not in tools",
            param="tool_choice",
        )
    if mode == "required" and not names:
        raise ApiError(
            ERROR_TOOLS_CHOICE, "tool_choice required needs at least one tool", param="tool_choice"
        )
    if mode == "auto" and names and parser is None:
        raise ApiError(
            ERROR_UNSUPPORTED_OPTION,
            "tool_choice auto needs a tool-call parser for this model, which the server has "
            "none of (--tool-call-parser); required or a named tool constrain the calls instead",
            param="tool_choice",
        )


def _check_parameters(parameters: dict[str, Any] | None, param: str) -> None:
    """A valid JSON Schema of an object (the arguments are one)."""
    if parameters is None:
        return
    try:
        jsonschema_rs.meta.validate(parameters)
    except jsonschema_rs.ValidationError as err:
        raise ApiError(
            ERROR_TOOLS_SCHEMA, f"not a valid JSON Schema: {err.message}", param=param
        ) from None
    kind = parameters.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise ApiError(
            ERROR_TOOLS_SCHEMA,
            f"a tool's parameters must describe an object (its arguments), not {kind!r}",
            param=param,
        )


def template_tools(request: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as chat templates read them (OpenAI's JSON, as transformers passes it)."""
    if not request.tools:
        return None
    return [_tool_json(tool) for tool in request.tools]


def _tool_json(tool: Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.function.name}
    if tool.function.description is not None:
        function["description"] = tool.function.description
    function["parameters"] = tool.function.parameters or _NO_PARAMETERS
    return {"type": tool.type, "function": function}


def tool_grammar(request: ChatCompletionRequest) -> Grammar | None:
    """The grammar of `required` or a named tool (None for `auto` and `none`): vLLM's JSON
    schemas, the tools' `$defs` hoisted to the top so their `$ref`s resolve; at most one call
    without `parallel_tool_calls`."""
    mode = tool_mode(request)
    tools = request.tools or []
    if isinstance(mode, NamedToolChoice):
        (tool,) = [t for t in tools if t.function.name == mode.function.name]
        schema = tool.function.parameters or _NO_PARAMETERS
    elif mode == "required":
        schema = _required_schema(tools, single=request.parallel_tool_calls is False)
    else:
        return None
    return Grammar(kind="json_schema", spec=json.dumps(schema, ensure_ascii=False))


async def check_tool_grammar(
    request: ChatCompletionRequest, grammar: Grammar, timeout_s: float
) -> None:
    """The tool_choice's grammar compiles and the request asks for no other (a
    structured-output form would be a second grammar)."""
    form = structured_form(request)
    if form is not None:
        raise ApiError(
            ERROR_GRAMMAR_INVALID,
            f"tool_choice and {form.field} both constrain the completion; send one of them",
            param=form.field,
        )
    try:
        await check(grammar, timeout_s)
    except GrammarError as err:
        raise ApiError(err.code, f"the tools' parameters: {err}", param="tools") from None


def _required_schema(tools: list[Tool], single: bool) -> dict[str, Any]:
    definitions: dict[str, Any] = {}
    calls = []
    for t, tool in enumerate(tools):
        parameters = copy.deepcopy(tool.function.parameters or _NO_PARAMETERS)
        for name, definition in parameters.pop("$defs", {}).items():
            if definitions.setdefault(name, definition) != definition:
                raise ApiError(
                    ERROR_TOOLS_SCHEMA,
                    f"$defs {name!r} differs between tools, which tool_choice required cannot "
                    "serve (their schemas are joined)",
                    param=f"tools[{t}].function.parameters",
                )
        calls.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": calls},
    }
    if single:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema


def parameter_types(request: ChatCompletionRequest) -> Callable[[str, str], tuple[str, ...]]:
    """(tool, parameter) -> the parameter's schema types, for parsers that write arguments
    as text (Qwen3-Coder's format)."""
    properties = {
        tool.function.name: (tool.function.parameters or {}).get("properties") or {}
        for tool in request.tools or []
    }

    def types(tool: str, parameter: str) -> tuple[str, ...]:
        schema = properties.get(tool, {}).get(parameter)
        kind = schema.get("type") if isinstance(schema, dict) else None
        if isinstance(kind, str):
            return (kind,)
        return tuple(k for k in kind if isinstance(k, str)) if isinstance(kind, list) else ()

    return types
