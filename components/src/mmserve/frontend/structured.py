"""A request's structured-output form as the `Grammar` its completion follows, checked before
anything is scheduled.

The forms (`protocol.structured`): OpenAI's `response_format` (`json_object`, `json_schema`),
vLLM's `structured_outputs` (one of `json`, `regex`, `choice`, `grammar`, `json_object`) and
its older `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`. At most one
per request. The grammar is checked without a tokenizer, on a thread, within
`--grammar-compile-timeout` (`grammar.cache.check`): a schema that is not valid JSON Schema or
asks what the grammar would not enforce, a regex or EBNF grammar that does not compile, each
answers 400 naming the field. What the form leaves unsaid follows vLLM: JSON is compact unless
`structured_outputs.disable_any_whitespace` is false (then any whitespace JSON allows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmserve.frontend.errors import ApiError
from mmserve.grammar.base import GrammarError
from mmserve.grammar.cache import check
from mmserve.grammar.forms import CONSTRAINTS, constraint_grammar
from mmserve.protocol import (
    ERROR_GRAMMAR_INVALID,
    ERROR_UNSUPPORTED_OPTION,
    Grammar,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    StructuredOutputFields,
    StructuredOutputs,
)

# The guided_* fields, each with the structured_outputs field it is the older name of.
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


@dataclass(frozen=True)
class Form:
    """A structured-output form of a request: the field it is in, and its grammar."""

    field: str
    grammar: Grammar


async def request_grammar(request: StructuredOutputFields, timeout_s: float) -> Grammar | None:
    """The grammar `request` asks its completion to follow, checked (None: free text)."""
    form = structured_form(request)
    if form is None:
        return None
    try:
        await check(form.grammar, timeout_s)
    except GrammarError as err:
        raise ApiError(err.code, f"{form.field}: {err}", param=form.field) from None
    return form.grammar


def structured_form(request: StructuredOutputFields) -> Form | None:
    """The request's one structured-output form; two are refused, naming both."""
    forms = _forms(request)
    if len(forms) > 1:
        first, second = forms[0].field, forms[1].field
        raise ApiError(
            ERROR_GRAMMAR_INVALID,
            f"{first} and {second} both ask for a structured output; send one of them",
            param=second,
        )
    return forms[0] if forms else None


def _forms(request: StructuredOutputFields) -> list[Form]:
    if request.guided_whitespace_pattern is not None:
        _unsupported("guided_whitespace_pattern", _WHITESPACE)
    forms = []
    response_format = request.response_format
    if isinstance(response_format, ResponseFormatJsonObject):
        forms.append(Form("response_format", Grammar(kind="json_object")))
    elif isinstance(response_format, ResponseFormatJsonSchema):
        schema = response_format.json_schema.schema
        forms.append(_form("response_format.json_schema.schema", "json", schema))
    if request.structured_outputs is not None:
        forms.append(_structured_outputs(request.structured_outputs))
    for name, constraint in _GUIDED.items():
        value = getattr(request, name)
        if value is not None:
            forms.append(_form(name, constraint, value))
    return forms


def _form(field: str, constraint: str, value: Any, any_whitespace: bool = False) -> Form:
    try:
        return Form(field, constraint_grammar(constraint, value, any_whitespace))
    except GrammarError as err:
        raise ApiError(err.code, f"{field}: {err}", param=field) from None


def _structured_outputs(outputs: StructuredOutputs) -> Form:
    if outputs.whitespace_pattern is not None:
        _unsupported("structured_outputs.whitespace_pattern", _WHITESPACE)
    if outputs.structural_tag is not None:
        _unsupported("structured_outputs.structural_tag", "use json, regex, choice or grammar")
    given = [
        name
        for name in CONSTRAINTS
        if getattr(outputs, name) is not None and getattr(outputs, name) is not False
    ]
    if len(given) != 1:
        named = " and ".join(given) if given else "none"
        raise ApiError(
            ERROR_GRAMMAR_INVALID,
            f"structured_outputs must set exactly one of {', '.join(CONSTRAINTS)}; it sets {named}",
            param="structured_outputs",
        )
    any_whitespace = outputs.disable_any_whitespace is False
    value = getattr(outputs, given[0])
    return _form(f"structured_outputs.{given[0]}", given[0], value, any_whitespace)


_WHITESPACE = (
    "JSON is compact, or has any whitespace with structured_outputs.disable_any_whitespace false"
)


def _unsupported(field: str, instead: str) -> None:
    raise ApiError(ERROR_UNSUPPORTED_OPTION, f"{field} is not supported: {instead}", param=field)
