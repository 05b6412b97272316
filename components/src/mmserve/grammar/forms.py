"""vLLM's structured-output constraints (`json`, `regex`, `choice`, `grammar`, `json_object`:
the fields of its `structured_outputs`, of its older `guided_*` names, and of the
`guided_decoding` Dynamo's frontend forwards) as a `Grammar`."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from mmserve.grammar.base import GrammarInvalid
from mmserve.protocol import Grammar, GrammarKind

CONSTRAINTS: dict[str, GrammarKind] = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "ebnf",
    "json_object": "json_object",
}


def constraint_grammar(constraint: str, value: Any, any_whitespace: bool = False) -> Grammar:
    """The grammar of vLLM's `constraint` (a key of `CONSTRAINTS`) set to `value`; a value of
    the wrong kind is `GrammarInvalid`."""
    kind = CONSTRAINTS[constraint]
    if kind == "json_schema":
        spec = schema_text(value)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise GrammarInvalid("the choices must be a non-empty list of strings")
        spec = json.dumps(value)
    elif kind == "json_object":
        spec = ""
    elif isinstance(value, str):
        spec = value
    else:
        raise GrammarInvalid(f"a {constraint} is a string, not {type(value).__name__}")
    return Grammar(kind=kind, spec=spec, any_whitespace=any_whitespace)


def schema_text(schema: Any) -> str:
    """A JSON Schema as JSON text (vLLM takes one as an object or as its text)."""
    if not isinstance(schema, str):
        if not isinstance(schema, dict | bool):
            raise GrammarInvalid(f"a JSON Schema is an object or a boolean, not {schema!r:.50}")
        return msgspec.json.encode(schema).decode()
    try:
        json.loads(schema)
    except ValueError as err:
        raise GrammarInvalid(f"the JSON Schema is not valid JSON: {err}") from None
    return schema
