"""The structured-output forms of a request (JSON at the HTTP edge): OpenAI's
`response_format`, vLLM's `structured_outputs` and the older `guided_*` fields vLLM removed but
clients still send. The frontend turns the one a request uses into a `protocol.Grammar`
(`frontend.structured`); a request with two is refused."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

JsonSchemaValue = dict[str, Any] | bool
# vLLM takes a schema as an object or as its JSON text.
JsonSchemaOrText = JsonSchemaValue | str
Choices = Annotated[list[str], msgspec.Meta(min_length=1)]


class ResponseFormatText(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="text"):
    """Free text (the default)."""


class ResponseFormatJsonObject(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="json_object"
):
    """Any JSON object."""


class JsonSchemaFormat(msgspec.Struct, frozen=True, kw_only=True):
    name: Annotated[str, msgspec.Meta(max_length=64)]
    description: str | None = None
    schema: Annotated[
        JsonSchemaValue, msgspec.Meta(description="The JSON Schema the output follows")
    ]
    strict: Annotated[
        bool | None,
        msgspec.Meta(
            description="Accepted; the output always follows the schema strictly, with no "
            "property or item it does not name"
        ),
    ] = None


class ResponseFormatJsonSchema(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="json_schema"
):
    """JSON that follows `json_schema.schema`."""

    json_schema: JsonSchemaFormat


ResponseFormat = ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema


class StructuredOutputs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """vLLM's structured outputs: exactly one of `json`, `regex`, `choice`, `grammar` and
    `json_object`, and how JSON is written. A request sets at most one of `response_format`
    (but of type `text`), `structured_outputs` and the `guided_*` fields (else 400
    `grammar.invalid`)."""

    json: JsonSchemaOrText | None = None
    regex: str | None = None
    choice: Choices | None = None
    grammar: Annotated[
        str | None,
        msgspec.Meta(description="An EBNF grammar (root rule `root`), or a Lark one"),
    ] = None
    json_object: bool | None = None
    disable_any_whitespace: Annotated[
        bool | None,
        msgspec.Meta(
            description="JSON with no whitespace but after `,` and `:` (the default here); "
            "false: whitespace wherever JSON allows it (vLLM's default)"
        ),
    ] = None
    disable_additional_properties: Annotated[
        bool,
        msgspec.Meta(description="Accepted: JSON never has a property its schema does not name"),
    ] = False
    disable_fallback: Annotated[
        bool, msgspec.Meta(description="Accepted: there is no other backend to fall back to")
    ] = False
    whitespace_pattern: Annotated[
        str | None, msgspec.Meta(description="Not supported: refused when set")
    ] = None
    structural_tag: Annotated[
        str | None, msgspec.Meta(description="Not supported: refused when set")
    ] = None


class StructuredOutputFields(msgspec.Struct, frozen=True, kw_only=True):
    """The structured-output fields of chat and text completion requests; at most one of them
    may be set (`response_format` of type `text` counts as unset)."""

    response_format: Annotated[
        ResponseFormat | None,
        msgspec.Meta(
            description="OpenAI's: text, any JSON object, or JSON following a JSON Schema"
        ),
    ] = None
    structured_outputs: Annotated[
        StructuredOutputs | None,
        msgspec.Meta(description="Extension (vLLM's): the output follows a grammar"),
    ] = None
    guided_json: Annotated[
        JsonSchemaOrText | None,
        msgspec.Meta(description="Extension (vLLM's older name of structured_outputs.json)"),
    ] = None
    guided_regex: Annotated[
        str | None,
        msgspec.Meta(description="Extension (vLLM's older name of structured_outputs.regex)"),
    ] = None
    guided_choice: Annotated[
        Choices | None,
        msgspec.Meta(description="Extension (vLLM's older name of structured_outputs.choice)"),
    ] = None
    guided_grammar: Annotated[
        str | None,
        msgspec.Meta(description="Extension (vLLM's older name of structured_outputs.grammar)"),
    ] = None
    guided_whitespace_pattern: Annotated[
        str | None, msgspec.Meta(description="Extension (vLLM's older): refused when set")
    ] = None
