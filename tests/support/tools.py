"""The tool the tool-call tests ask for: its arguments' schema bounds every value, so a model with
random weights that is held to it ends each one (a string of unbounded length would run to
max_tokens)."""

from __future__ import annotations

from typing import Any

WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": WEATHER_PARAMETERS,
    },
}
