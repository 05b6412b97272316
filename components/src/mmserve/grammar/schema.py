"""The JSON Schemas a grammar is made from: valid ones (the 2020-12 meta-schema, or the draft
the schema's `$schema` names), whose every assertion the grammar enforces.

xgrammar 0.2.8 turns a schema into a grammar and leaves out, without a word, what it cannot
express; an output could then break the schema it was asked to follow. Each keyword below was
measured to be left out (outputs drawn at random through the compiled grammar broke it), and
is refused by name, with where it sits (a JSON pointer), rather than ignored.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jsonschema_rs

from mmserve.grammar.base import GrammarInvalid, GrammarUnsupported

# Keywords whose assertions the grammar leaves out.
UNENFORCED = frozenset(
    {
        "allOf",
        "not",
        "if",
        "then",
        "else",
        "contains",
        "minContains",
        "maxContains",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "$dynamicRef",
        "$recursiveRef",
    }
)
# The string formats the grammar spells out (others would be plain strings).
FORMATS = frozenset(
    {
        "date",
        "date-time",
        "time",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "uri",
        "uri-reference",
        "uri-template",
        "uuid",
        "json-pointer",
        "relative-json-pointer",
    }
)
MAX_DEPTH = 128  # subschemas inside each other, $refs aside

# Where subschemas sit: one, a list, or a map of them.
_ONE = (
    "items",
    "additionalProperties",
    "unevaluatedProperties",
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
)
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def check_schema(schema: Any) -> None:
    """Refuse a schema that is not valid JSON Schema (`GrammarInvalid`), or that asks what the
    grammar would not enforce (`GrammarUnsupported`, naming the keyword and where)."""
    if not isinstance(schema, dict | bool):
        raise GrammarInvalid(f"a JSON Schema is an object or a boolean, not {_kind(schema)}")
    subschemas = list(_subschemas(schema))  # first: the depth bounds the meta-schema's walk
    try:
        jsonschema_rs.meta.validate(schema)
    except jsonschema_rs.ValidationError as err:
        raise GrammarInvalid(f"not a valid JSON Schema: {err.message}") from None
    except jsonschema_rs.ReferencingError as err:
        raise GrammarInvalid(f"not a valid JSON Schema: {err}") from None
    for subschema, pointer in subschemas:
        _check_subschema(schema, subschema, pointer)


def _kind(value: Any) -> str:
    return type(value).__name__.replace("NoneType", "null")


def _subschemas(schema: dict | bool) -> Iterator[tuple[dict, str]]:
    """Every subschema that is an object, with its JSON pointer, parents first (iteratively:
    a deep schema meets `MAX_DEPTH`, never Python's recursion limit)."""
    pending: list[tuple[Any, str, int]] = [(schema, "#", 0)]
    while pending:
        node, pointer, depth = pending.pop()
        if not isinstance(node, dict):
            continue
        if depth > MAX_DEPTH:
            raise GrammarUnsupported(
                f"the schema nests deeper than {MAX_DEPTH} levels at {pointer}"
            )
        yield node, pointer
        children: list[tuple[Any, str]] = []
        for key in _ONE:
            if isinstance(node.get(key), dict):
                children.append((node[key], f"{pointer}/{key}"))
        for key in _LIST:
            if isinstance(node.get(key), list):
                children += [(child, f"{pointer}/{key}/{i}") for i, child in enumerate(node[key])]
        for key in _MAP:
            if isinstance(node.get(key), dict):
                children += [
                    (child, f"{pointer}/{key}/{_escape(name)}") for name, child in node[key].items()
                ]
        pending += [(child, where, depth + 1) for child, where in reversed(children)]


def _escape(name: str) -> str:
    """A name as a JSON pointer's segment."""
    return name.replace("~", "~0").replace("/", "~1")


def _check_subschema(root: dict | bool, schema: dict, pointer: str) -> None:
    def refuse(what: str) -> GrammarUnsupported:
        return GrammarUnsupported(f"{what} at {pointer} would not be enforced: refused")

    unenforced = sorted(UNENFORCED.intersection(schema))
    if unenforced:
        raise refuse(f"the keyword {unenforced[0]!r}")
    if schema.get("uniqueItems") is True:
        raise refuse("'uniqueItems'")
    if "multipleOf" in schema and _types(schema) != {"integer"}:
        raise refuse("'multipleOf' on anything but an integer")
    if "oneOf" in schema and not _exclusive(root, schema["oneOf"]):
        raise refuse("'oneOf' whose branches may overlap (enforced as anyOf)")
    if _describes_string(schema):
        _check_string(schema, refuse)
    properties = schema.get("properties")
    if isinstance(schema.get("required"), list):
        named = properties if isinstance(properties, dict) else {}
        missing = [name for name in schema["required"] if name not in named]
        if missing:
            raise refuse(f"a required property not in 'properties' ({missing[0]!r})")
    if isinstance(schema.get("patternProperties"), dict) and (
        properties is not None or len(schema["patternProperties"]) > 1
    ):
        raise refuse("'patternProperties' beside 'properties', or more than one pattern")
    if "propertyNames" in schema and (
        properties is not None
        or "patternProperties" in schema
        or isinstance(schema.get("additionalProperties"), dict)
    ):
        raise refuse("'propertyNames' beside other property keywords")


def _types(schema: dict) -> set[str]:
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    return {each for each in kind if isinstance(each, str)} if isinstance(kind, list) else set()


def _describes_string(schema: dict) -> bool:
    types = _types(schema)
    return not types or "string" in types


def _check_string(schema: dict, refuse: Any) -> None:
    if "format" in schema and schema["format"] not in FORMATS:
        raise refuse(f"the string format {schema['format']!r}")
    shaped = [key for key in ("pattern", "format") if key in schema]
    sized = [key for key in ("minLength", "maxLength") if key in schema]
    if len(shaped) > 1 or (shaped and sized):
        raise refuse(f"{' with '.join(shaped + sized)} together")


def _exclusive(root: dict | bool, branches: Any) -> bool:
    """Whether no value can match two of `branches`: each an object that requires one
    property (the same in all) to hold a constant no other branch holds (a discriminated
    union, as pydantic writes one)."""
    if not isinstance(branches, list):
        return True
    resolved = [_resolve(root, branch) for branch in branches]
    if len(resolved) < 2:
        return True
    keys: set[str] | None = None
    tags_by_key: dict[str, list[Any]] = {}
    for branch in resolved:
        tags = _tags(branch)
        keys = set(tags) if keys is None else keys & set(tags)
        for key, value in tags.items():
            tags_by_key.setdefault(key, []).append(value)
    for key in keys or ():
        values = [repr(value) for value in tags_by_key[key]]
        if len(set(values)) == len(values):
            return True
    return False


def _tags(branch: Any) -> dict[str, Any]:
    """A branch's required properties held to one constant, by name."""
    if not isinstance(branch, dict) or not isinstance(branch.get("properties"), dict):
        return {}
    required = branch.get("required")
    tags = {}
    for name in required if isinstance(required, list) else []:
        prop = branch["properties"].get(name)
        if isinstance(prop, dict) and "const" in prop:
            tags[name] = prop["const"]
        elif (
            isinstance(prop, dict) and isinstance(prop.get("enum"), list) and len(prop["enum"]) == 1
        ):
            tags[name] = prop["enum"][0]
    return tags


def _resolve(root: dict | bool, schema: Any) -> Any:
    """A `{"$ref": "#/..."}` to its target inside `root` (one hop); anything else as is."""
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return schema
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        node = node.get(part) if isinstance(node, dict) else None
    return node
