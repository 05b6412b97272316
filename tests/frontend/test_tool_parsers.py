"""The readers of a completion's text: tool-call extractors (hermes, qwen3_coder, required,
named) and the reasoning splitter, pushed whole, one character at a time and cut at every
boundary: the same calls, content and reasoning each way; malformed text becomes content."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from mmserve.frontend.answers import ChoiceReader, CollectedChoice, OutputRules
from mmserve.frontend.tool_parsers import (
    CallExtractor,
    HermesCalls,
    NamedCall,
    Qwen3CoderCalls,
    RequiredCalls,
)
from mmserve.reasoning import REASONING_PARSERS, Opening, ReasoningSplitter, reasoning_format

Make = Callable[[Callable[[], str]], CallExtractor]


@dataclass
class Read:
    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments)
    fragments: list[int] = field(default_factory=list)  # argument pieces per call
    broken: bool = False


def read(make: Make, pieces: list[str]) -> Read:
    ids = itertools.count()
    extractor = make(lambda: f"call_{next(ids)}")
    content: list[str] = []
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for result in [extractor.push(piece) for piece in pieces] + [extractor.finish()]:
        content.append(result.content)
        for delta in result.calls:
            if delta.id is not None:
                assert delta.index not in names and delta.name  # id and name come first, once
                names[delta.index] = delta.name
                arguments[delta.index] = []
            if delta.arguments:
                arguments[delta.index].append(delta.arguments)
    return Read(
        "".join(content),
        [(names[i], "".join(arguments[i])) for i in sorted(names)],
        [len(arguments[i]) for i in sorted(names)],
        extractor.broken,
    )


def same_every_way(make: Make, text: str) -> Read:
    """What `text` reads as: pushed whole, a character at a time, and cut once at every
    boundary, the same content, calls and brokenness."""
    whole = read(make, [text])
    by_character = read(make, list(text))
    assert (by_character.content, by_character.calls, by_character.broken) == (
        whole.content,
        whole.calls,
        whole.broken,
    )
    for cut in range(len(text) + 1):
        split = read(make, [text[:cut], text[cut:]])
        assert (split.content, split.calls, split.broken) == (
            whole.content,
            whole.calls,
            whole.broken,
        ), cut
    return whole


def hermes(new_id: Callable[[], str]) -> CallExtractor:
    return HermesCalls(new_id)


TYPES = {"days": ("integer",), "ratio": ("number",), "on": ("boolean",), "where": ("object",)}


def _types(tool: str, parameter: str) -> tuple[str, ...]:
    return TYPES.get(parameter, ("string",))


def qwen3_coder(new_id: Callable[[], str]) -> CallExtractor:
    return Qwen3CoderCalls(new_id, _types)


WEATHER = {"city": "Paris", "unit": "celsius", "days": [1, {"nested": "}{]["}], "q": 'say "hi"\\'}


def test_hermes_calls_stream_as_generated_and_match_the_whole_text() -> None:
    text = (
        "Let me look that up.\n\n<tool_call>\n"
        + json.dumps({"name": "get_weather", "arguments": WEATHER})
        + "\n</tool_call>\n<tool_call>\n"
        + json.dumps({"name": "now", "arguments": {}})
        + "\n</tool_call>"
    )
    result = same_every_way(hermes, text)
    assert result.content == "Let me look that up."
    assert [name for name, _ in result.calls] == ["get_weather", "now"]
    assert json.loads(result.calls[0][1]) == WEATHER
    assert result.calls[1][1] == "{}"
    assert not result.broken
    # Streamed a character at a time, the arguments come in many fragments, not at the end.
    assert read(hermes, list(text)).fragments[0] == len(json.dumps(WEATHER))


def test_hermes_keys_in_any_order_and_a_tool_without_parameters() -> None:
    text = '<tool_call>\n{"arguments": {"x": "é\\u00e9"}, "name": "f"}\n</tool_call>'
    assert same_every_way(hermes, text).calls == [("f", '{"x": "é\\u00e9"}')]
    for body in ('{"name": "ping"}', '{"name": "ping", "arguments": null}'):
        result = same_every_way(hermes, f"<tool_call>\n{body}\n</tool_call>")
        assert result.calls == [("ping", "{}")] and result.content == ""


def test_text_without_calls_passes_through_whole() -> None:
    text = "No tools needed: 2 < 3 and <tool is not a tag.  "
    result = same_every_way(hermes, text)
    assert result.content == text and result.calls == [] and not result.broken


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>not json at all</tool_call>",
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',  # unclosed object
        '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',  # not an object
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "f", "arguments": {"x": "cut sh',  # the completion ended
        '<tool_call>\n{"name": "f"}\nthen text instead of the end tag',
    ],
)
def test_malformed_calls_are_content_when_collected(text: str) -> None:
    assert same_every_way(hermes, text).broken
    answer = CollectedChoice(OutputRules(calls=hermes), lambda: "call_x")
    for character in text:
        answer.add(character)
    message, finish = answer.message("stop")
    assert message.content == text and message.tool_calls is None and finish == "stop"


def test_qwen3_coder_values_follow_the_parameter_types() -> None:
    text = (
        'Checking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew "York"\n'
        "second line\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=ratio>\n0.5\n"
        "</parameter>\n<parameter=on>\nTrue\n</parameter>\n<parameter=where>\n"
        '{"lat": 1}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n'
        "</function>\n</tool_call>"
    )
    result = same_every_way(qwen3_coder, text)
    assert result.content == "Checking."
    assert [name for name, _ in result.calls] == ["get_weather", "now"]
    assert json.loads(result.calls[0][1]) == {
        "city": 'New "York"\nsecond line',
        "days": 3,
        "ratio": 0.5,
        "on": True,
        "where": {"lat": 1},
    }
    assert result.calls[1][1] == "{}"
    # A string parameter streams as its characters come.
    assert read(qwen3_coder, list(text)).fragments[0] > len("New York")


def test_qwen3_coder_broken_markup_is_content() -> None:
    for text in (
        "<tool_call>\n<function=f>\n<parameter=x>\n1\n</function>\n</tool_call>",
        "<tool_call>\nplain words\n</tool_call>",
    ):
        assert same_every_way(qwen3_coder, text).broken


def test_required_and_named_outputs() -> None:
    text = ' [{"name": "a", "parameters": {"x": [1, "]"]}}, {"parameters": {}, "name": "b"}] '
    result = same_every_way(RequiredCalls, text)
    assert result.calls == [("a", '{"x": [1, "]"]}'), ("b", "{}")] and result.content == ""

    def named(new_id: Callable[[], str]) -> CallExtractor:
        return NamedCall(new_id, "get_weather")

    result = same_every_way(named, ' {"city": "Paris"} ')
    assert result.calls == [("get_weather", '{"city": "Paris"}')]
    assert same_every_way(named, '{"city": "Par').broken  # cut by max_tokens
    assert same_every_way(RequiredCalls, "[]").broken


def split(opening: Opening, pieces: list[str], name: str = "qwen3") -> tuple[str, str]:
    format = reasoning_format(name)
    assert format is not None
    splitter = ReasoningSplitter(format, opening)
    parts = [splitter.push(piece) for piece in pieces] + [splitter.finish()]
    reasoning, answer = ("".join(part[i] for part in parts) for i in (0, 1))
    return reasoning, answer


@pytest.mark.parametrize(
    ("opening", "text", "expected"),
    [
        (
            Opening.REASONING,
            "Let me think.\n</think>\n\nThe answer.",
            ("Let me think.", "The answer."),
        ),
        (Opening.EITHER, "<think>\nhmm\n</think>\n\n42", ("hmm", "42")),
        (Opening.EITHER, "  42, no thinking", ("", "  42, no thinking")),
        (Opening.REASONING, "<think>\nrepeated tag</think>ok", ("repeated tag", "ok")),
        (Opening.REASONING, "cut short before the end", ("cut short before the end", "")),
        (Opening.ANSWER, "\n</think> is text here", ("", "\n</think> is text here")),
        (Opening.REASONING, "</think>", ("", "")),
    ],
)
def test_reasoning_splits_the_same_every_way(opening: Opening, text: str, expected) -> None:
    assert split(opening, [text]) == expected
    assert split(opening, list(text)) == expected
    for cut in range(len(text) + 1):
        assert split(opening, [text[:cut], text[cut:]]) == expected, cut


def test_deepseek_r1_reasons_until_its_end_tag() -> None:
    assert split(Opening.REASONING, ["thoughts</think>answer"], "deepseek-r1") == (
        "thoughts",
        "answer",
    )


def test_reasoning_then_calls_in_one_choice() -> None:
    rules = OutputRules(
        reasoning=REASONING_PARSERS["qwen3"], opening=Opening.REASONING, calls=hermes
    )
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    text = "\nI should call it.\n</think>\n\n" + call
    seen = []  # the order of what a stream sends
    reader = ChoiceReader(rules, lambda: "call_1")
    for character in text:
        piece = reader.push(character)
        seen += ["reasoning"] * bool(piece.reasoning) + ["content"] * bool(piece.content)
        seen += ["call"] * bool(piece.calls)
    reader.finish()
    assert seen == sorted(seen, key=["reasoning", "content", "call"].index)
    assert "content" not in seen and reader.called
    answer = CollectedChoice(rules, lambda: "call_1")
    answer.add(text)
    message, finish = answer.message("stop")
    assert message.reasoning_content == message.reasoning == "I should call it."
    assert message.content is None and finish == "tool_calls"
    assert message.tool_calls is not None
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("call_1", "f", '{"a": 1}')
    ]
