"""JSON Schemas drawn at random for the structured-output tests and the bench: nested objects,
arrays with bounds, enums, `anyOf`, discriminated `oneOf`, `$ref`s, string formats and
patterns, integers and numbers with bounds. Every string is bounded (a length, a pattern, a
format of bounded length or an enum), so any output the grammar allows ends within a few
hundred tokens, even from a model with random weights."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema_rs

# The formats the grammar spells exactly (jsonschema-rs validates them as the grammar writes
# them); `date`, `time`, `email`, `ipv4` and others are enforced as looser patterns.
EXACT_FORMATS = ("uuid", "duration")
PATTERNS = (r"^[a-z]{1,8}$", r"^[A-Z][0-9]{2,4}$", r"^(red|green|blue)-[0-9]$", r"^\d{3}-\d{2}$")
WORDS = ("alpha", "beta", "gamma", "delta", "x y", 'q"uote', "back\\slash", "ünï")


def random_schema(seed: int) -> dict[str, Any]:
    """An object schema of 1 to 5 properties, drawn from `seed`."""
    rng = random.Random(seed)
    schema = _object(rng, depth=0)
    if rng.random() < 0.2:  # a definition used by reference
        schema["$defs"] = {"point": _object(rng, depth=2)}
        schema["properties"]["ref"] = {"$ref": "#/$defs/point"}
        schema["required"].append("ref")
    return schema


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(
        ["id", "name", "kind", "size", "tags", "when", "score", "items", "ok"], rng.randint(1, 5)
    )
    properties = {name: _value(rng, depth + 1) for name in names}
    required = [name for name in names if rng.random() < 0.7]
    schema: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
    if rng.random() < 0.5:
        schema["additionalProperties"] = False
    return schema


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = [_string, _enum, _integer, _number, _boolean, _array, _any_of, _const]
    if depth < 3:
        kinds += [_object, _one_of]
    return rng.choice(kinds)(rng, depth)


def _string(rng: random.Random, depth: int) -> dict[str, Any]:
    shape = rng.random()
    if shape < 0.25:
        return {"type": "string", "format": rng.choice(EXACT_FORMATS)}
    if shape < 0.5:
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    # Short bounds: a bound of n characters costs the compile ~35n ms of CPU.
    low = rng.randint(0, 2)
    return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 4)}


def _enum(rng: random.Random, depth: int) -> dict[str, Any]:
    values: list[Any] = rng.sample(WORDS, rng.randint(1, 4))
    if rng.random() < 0.3:
        values += [rng.randint(-5, 5), None]
    return {"enum": values}


def _integer(rng: random.Random, depth: int) -> dict[str, Any]:
    low = rng.randint(-1000, 1000)
    schema: dict[str, Any] = {"type": "integer"}
    if rng.random() < 0.5:
        schema |= {"minimum": low, "maximum": low + rng.randint(0, 5000)}
    else:
        schema |= {"exclusiveMinimum": low, "exclusiveMaximum": low + rng.randint(2, 100)}
    if rng.random() < 0.2:
        schema = {"type": "integer", "multipleOf": rng.randint(2, 7), "minimum": 0, "maximum": 200}
    return schema


def _number(rng: random.Random, depth: int) -> dict[str, Any]:
    low = round(rng.uniform(-100, 100), 2)
    return {"type": "number", "minimum": low, "maximum": round(low + rng.uniform(0.5, 500), 2)}


def _boolean(rng: random.Random, depth: int) -> dict[str, Any]:
    return {"type": rng.choice(["boolean", "null"])}


def _const(rng: random.Random, depth: int) -> dict[str, Any]:
    return {"const": rng.choice([7, "fixed", True, None, {"k": [1, "v"]}])}


def _array(rng: random.Random, depth: int) -> dict[str, Any]:
    low = rng.randint(0, 2)
    items = rng.choice([_string, _integer, _boolean, _enum])(rng, depth + 1)
    return {"type": "array", "items": items, "minItems": low, "maxItems": low + rng.randint(0, 3)}


def _any_of(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = rng.sample([_string, _integer, _boolean, _enum, _number], rng.randint(2, 3))
    return {"anyOf": [kind(rng, depth + 1) for kind in kinds]}


def _one_of(rng: random.Random, depth: int) -> dict[str, Any]:
    """A discriminated union, as pydantic writes one: `kind` tells the branches apart."""
    branches = []
    for tag in rng.sample(["cat", "dog", "bird"], 2):
        branch = _object(rng, depth + 1)
        branch["properties"]["kind"] = {"const": tag}
        branch["required"] = sorted({*branch["required"], "kind"})
        branches.append(branch)
    return {"oneOf": branches}


def validates(schema: dict[str, Any], text: str) -> bool:
    """Whether `text` is strict JSON (no raw control characters in strings) that `schema`
    holds, formats included."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return jsonschema_rs.validator_for(schema, validate_formats=True).is_valid(value)
