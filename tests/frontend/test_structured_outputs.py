"""Structured outputs at the HTTP edge, with the official `openai` client: each form a request
may use becomes the one `Grammar` the pipeline receives, on chat and text completions; every
bad form is refused with 400 naming its field before anything is scheduled, and the next good
request is served."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from mmserve.protocol import Grammar
from tests.frontend.conftest import RunningFrontend

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))


def _client(frontend: RunningFrontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0)


def _chat(frontend: RunningFrontend, **fields: Any) -> Any:
    extra = fields.pop("extra_body", None)
    return _client(frontend).chat.completions.create(
        model=frontend.model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        extra_body=extra,
        **fields,
    )


def _grammar(frontend: RunningFrontend) -> Grammar | None:
    return frontend.dispatcher.requests[-1].sampling.grammar


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": SCHEMA, "strict": True},
                }
            },
            Grammar(kind="json_schema", spec=SCHEMA_TEXT),
        ),
        ({"response_format": {"type": "json_object"}}, Grammar(kind="json_object")),
        ({"response_format": {"type": "text"}}, None),
        (
            {"extra_body": {"structured_outputs": {"json": SCHEMA}}},
            Grammar(kind="json_schema", spec=SCHEMA_TEXT),
        ),
        (
            {
                "extra_body": {
                    "structured_outputs": {
                        "json": json.dumps(SCHEMA),
                        "disable_any_whitespace": False,
                    }
                }
            },
            Grammar(kind="json_schema", spec=json.dumps(SCHEMA), any_whitespace=True),
        ),
        (
            {"extra_body": {"structured_outputs": {"regex": "[a-z]+"}}},
            Grammar(kind="regex", spec="[a-z]+"),
        ),
        (
            {"extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}},
            Grammar(kind="choice", spec='["yes", "no"]'),
        ),
        (
            {"extra_body": {"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}},
            Grammar(kind="ebnf", spec='root ::= "a" | "b"'),
        ),
        (
            {
                "extra_body": {
                    "structured_outputs": {"json_object": True, "disable_any_whitespace": True}
                }
            },
            Grammar(kind="json_object"),
        ),
        ({"extra_body": {"guided_json": SCHEMA}}, Grammar(kind="json_schema", spec=SCHEMA_TEXT)),
        ({"extra_body": {"guided_regex": r"\d+"}}, Grammar(kind="regex", spec=r"\d+")),
        ({"extra_body": {"guided_choice": ["a"]}}, Grammar(kind="choice", spec='["a"]')),
        (
            {"extra_body": {"guided_grammar": 'start: "x"'}},
            Grammar(kind="ebnf", spec='start: "x"'),
        ),
    ],
)
def test_each_form_becomes_the_grammar_the_pipeline_gets(
    frontend: RunningFrontend, fields: dict[str, Any], expected: Grammar | None
) -> None:
    _chat(frontend, **fields)
    assert _grammar(frontend) == expected


def test_text_completions_take_the_forms_too(frontend: RunningFrontend) -> None:
    client = _client(frontend)
    for body, expected in [
        ({"structured_outputs": {"regex": "ab"}}, Grammar(kind="regex", spec="ab")),
        ({"guided_choice": ["x", "y"]}, Grammar(kind="choice", spec='["x", "y"]')),
        ({"response_format": {"type": "json_object"}}, Grammar(kind="json_object")),
    ]:
        client.completions.create(model=frontend.model, prompt="Hi", max_tokens=2, extra_body=body)
        assert _grammar(frontend) == expected
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(
            model=frontend.model, prompt="Hi", extra_body={"guided_regex": "(ab"}
        )
    assert refused.value.code == "grammar.invalid" and refused.value.param == "guided_regex"


def _schema(schema: Any) -> dict[str, Any]:
    return {"extra_body": {"structured_outputs": {"json": schema}}}


BAD = [
    # two forms in one request
    (
        {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
        "grammar.invalid",
        "guided_regex",
        "both ask",
    ),
    (
        {"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}},
        "grammar.invalid",
        "structured_outputs",
        "regex and choice",
    ),
    ({"extra_body": {"structured_outputs": {}}}, "grammar.invalid", "structured_outputs", "none"),
    # an empty list of choices
    ({"extra_body": {"guided_choice": []}}, "invalid_value", "guided_choice", "length >= 1"),
    (
        {"extra_body": {"structured_outputs": {"choice": []}}},
        "invalid_value",
        "structured_outputs.choice",
        "length >= 1",
    ),
    # not JSON Schema, or not JSON
    (_schema({"type": "foo"}), "grammar.invalid", "structured_outputs.json", "JSON Schema"),
    (
        _schema({"type": "object", "properties": {"a": {"minimum": "x"}}}),
        "grammar.invalid",
        "structured_outputs.json",
        "JSON Schema",
    ),
    (
        {"extra_body": {"guided_json": "{not json"}},
        "grammar.invalid",
        "guided_json",
        "not valid JSON",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "invalid_value",
        "response_format.json_schema",
        "schema",
    ),
    # keywords the grammar would not enforce, each named
    (
        _schema({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
        "grammar.unsupported",
        "structured_outputs.json",
        "'uniqueItems' at #",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {
                        "type": "object",
                        "properties": {"a": {"allOf": [{"type": "string"}]}},
                    },
                },
            }
        },
        "grammar.unsupported",
        "response_format.json_schema.schema",
        "'allOf' at #/properties/a",
    ),
    (
        _schema({"type": "string", "format": "phone"}),
        "grammar.unsupported",
        "structured_outputs.json",
        "'phone'",
    ),
    (
        _schema({"type": "string", "pattern": "^a+$", "maxLength": 3}),
        "grammar.unsupported",
        "structured_outputs.json",
        "pattern with maxLength",
    ),
    (
        _schema({"type": "number", "multipleOf": 0.5}),
        "grammar.unsupported",
        "structured_outputs.json",
        "multipleOf",
    ),
    (
        _schema({"oneOf": [{"type": "integer"}, {"type": "number"}]}),
        "grammar.unsupported",
        "structured_outputs.json",
        "oneOf",
    ),
    (
        _schema({"type": "object", "properties": {}, "required": ["a"]}),
        "grammar.unsupported",
        "structured_outputs.json",
        "'a'",
    ),
    (
        {"extra_body": {"guided_json": {"if": {"type": "string"}}}},
        "grammar.unsupported",
        "guided_json",
        "'if'",
    ),
    # a regex or a grammar that does not compile
    ({"extra_body": {"guided_regex": "(ab"}}, "grammar.invalid", "guided_regex", "not closed"),
    (
        {"extra_body": {"structured_outputs": {"grammar": "root ::= foo"}}},
        "grammar.invalid",
        "structured_outputs.grammar",
        '"foo" is not defined',
    ),
    # options that are not implemented
    (
        {"extra_body": {"structured_outputs": {"json_object": True, "whitespace_pattern": " "}}},
        "unsupported_option",
        "structured_outputs.whitespace_pattern",
        "not supported",
    ),
    (
        {"extra_body": {"guided_regex": "a", "guided_whitespace_pattern": " "}},
        "unsupported_option",
        "guided_whitespace_pattern",
        "not supported",
    ),
]


@pytest.mark.parametrize(("fields", "code", "param", "says"), BAD)
def test_a_bad_form_is_refused_by_name_before_scheduling(
    frontend: RunningFrontend, fields: dict[str, Any], code: str, param: str, says: str
) -> None:
    scheduled = len(frontend.dispatcher.requests)
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(frontend, **fields)
    error = refused.value
    assert (error.code, error.param) == (code, param), error.body
    assert says in error.message, error.message
    assert len(frontend.dispatcher.requests) == scheduled
    assert _chat(frontend, response_format={"type": "json_object"}).choices[0].finish_reason


def test_a_grammar_past_the_timeout_is_refused(start_frontend: Any) -> None:
    frontend = start_frontend("--grammar-compile-timeout", "0")
    with pytest.raises(openai.BadRequestError) as refused:  # one no request checked before
        _chat(frontend, extra_body={"guided_regex": "timed out [0-9]+"})
    assert refused.value.code == "grammar.compile_timeout"
    assert refused.value.param == "guided_regex"
    assert _chat(frontend).choices[0].message.content is not None
