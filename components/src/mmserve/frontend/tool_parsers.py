"""Tool calls read out of a completion's text as it streams (`--tool-call-parser`).

Each extractor takes the answer's text in pieces (`push`, then `finish`) and returns the text
that stays content and the calls' deltas: a call's id and name as soon as the name is known,
then its arguments (a JSON object's text) in fragments as they are generated. It holds back
only what could still be a tag or the whitespace beside one, so the same calls come out however
the text is cut: pushed whole, or a character at a time.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3-VL).
- `qwen3_coder`: `<tool_call><function=NAME><parameter=P>value</parameter>...</function>
  </tool_call>` (Qwen3.5, Qwen3-Coder); each value becomes its JSON by the tool's parameter
  schema (a string streams as it comes, other types when their value is complete).
- `RequiredCalls`: `tool_choice: "required"`'s constrained output, a JSON array of
  `{"name", "parameters"}` objects (vLLM's form); `NamedCall`: a named tool's arguments.

Text that stops following the format once a call began marks the extractor `broken` (a
non-streamed answer then returns the text as content, never an error).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_WHITESPACE = " \t\r\n"
_SCALAR_END = re.compile(r"[,}\]\s]")
_STRING_STOP = re.compile(r'["\\]')
_STRUCTURE = re.compile(r'[{}\[\]"]')


@dataclass(slots=True)
class CallDelta:
    """A piece of call `index`: its first carries the id and name, the rest argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class Extracted:
    """What a piece of the answer's text became: content and calls' deltas."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class Malformed(Exception):
    """The text stopped following the call format."""


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that begins `tag` (not all of it)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class _Calls:
    """The deltas of one push, and the calls' numbering and ids."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        self._new_id = new_id
        self.count = 0
        self.deltas: list[CallDelta] = []

    def start(self, name: str) -> None:
        self.deltas.append(CallDelta(self.count, self._new_id(), name))
        self.count += 1

    def arguments(self, fragment: str) -> None:
        if not fragment:
            return
        last = self.deltas[-1] if self.deltas else None
        if last is not None and last.index == self.count - 1:
            last.arguments += fragment
        else:
            self.deltas.append(CallDelta(self.count - 1, arguments=fragment))

    def take(self) -> list[CallDelta]:
        deltas, self.deltas = self.deltas, []
        return deltas


class _Value:
    """A JSON value's extent, scanned as it streams: where it ends, not what it means (a
    call's arguments are parsed whole when the call ends)."""

    def __init__(self) -> None:
        self.kind = ""  # "container", "string" or "scalar", from its first character
        self.done = False
        self._depth = 0
        self._in_string = False
        self._escaped = False  # the last character seen was a backslash inside a string

    def feed(self, text: str, pos: int) -> int:
        """Consume `text` from `pos`; the position after the value's end (a scalar's
        delimiter is left), or len(text) if it goes on."""
        if not self.kind:
            first = text[pos]
            if first in "{[":
                self.kind, self._depth = "container", 1
            elif first == '"':
                self.kind, self._in_string = "string", True
            elif first in "-0123456789tfn":
                self.kind = "scalar"
                pos -= 1
            else:
                raise Malformed(f"a JSON value cannot start with {first!r}")
            pos += 1
        if self.kind == "scalar":
            end = _SCALAR_END.search(text, pos)
            if end is None:
                return len(text)
            self.done = True
            return end.start()
        return self._scan(text, pos)

    def _scan(self, text: str, pos: int) -> int:
        size = len(text)
        while pos < size:
            if self._escaped:
                self._escaped = False
                pos += 1
                continue
            if self._in_string:
                stop = _STRING_STOP.search(text, pos)
                if stop is None:
                    return size
                pos = stop.start() + 1
                if text[pos - 1] == "\\":
                    self._escaped = True
                    continue
                self._in_string = False
                if self.kind == "string":
                    self.done = True
                    return pos
                continue
            mark = _STRUCTURE.search(text, pos)
            if mark is None:
                return size
            pos = mark.start() + 1
            char = text[pos - 1]
            if char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    self.done = True
                    return pos
        return size


def _object_arguments(text: str) -> str:
    """A call's whole arguments, checked: a JSON object's text."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise Malformed(f"the arguments are not JSON: {err}") from None
    if not isinstance(value, dict):
        raise Malformed("the arguments are not a JSON object")
    return text


class _CallObject:
    """One call written as a JSON object with a `name` and its arguments under `arguments_key`
    (keys in any order; others ignored): the name is announced when read, and an object of
    arguments streams once the name is known (before it, it waits for the name)."""

    _OPEN, _KEY, _COLON, _VALUE, _AFTER, _DONE = range(6)

    def __init__(self, calls: _Calls, arguments_key: str) -> None:
        self._calls = calls
        self._arguments_key = arguments_key
        self._state = self._OPEN
        self._value: _Value | None = None
        self._target = ""  # what the value being read is: "key", "name", "arguments", "skip"
        self._raw = ""  # the text of a key, a name, or arguments not yet announced
        self._key = ""
        self._name: str | None = None
        self._arguments: str | None = None  # the whole arguments' text, once read
        self._streamed = ""  # arguments announced as they came (a container after the name)

    @property
    def done(self) -> bool:
        return self._state == self._DONE

    def feed(self, text: str) -> str | None:
        """Consume `text`; what follows the object once it is closed, else None."""
        pos, size = 0, len(text)
        while pos < size:
            if self._value is not None:
                pos = self._read_value(text, pos)
                continue
            char = text[pos]
            pos += 1
            if char in _WHITESPACE:
                continue
            if self._state == self._OPEN and char == "{":
                self._state = self._KEY
            elif self._state == self._KEY and char == '"':
                self._begin("key", text, pos - 1)
                pos -= 1
            elif self._state in (self._KEY, self._AFTER) and char == "}":
                self._close()
                return text[pos:]
            elif self._state == self._COLON and char == ":":
                self._state = self._VALUE
            elif self._state == self._VALUE:
                target = "skip"
                if self._key == "name" and self._name is None:
                    target = "name"
                elif self._key == self._arguments_key and self._arguments is None:
                    target = "arguments"
                self._begin(target, text, pos - 1)
                pos -= 1
            elif self._state == self._AFTER and char == ",":
                self._state = self._KEY
            else:
                raise Malformed(f"unexpected {char!r} in a call")
        return None

    def _begin(self, target: str, text: str, pos: int) -> None:
        self._value = _Value()
        self._target = target
        self._raw = ""
        if target in ("key", "name") and text[pos] != '"':
            raise Malformed(f"a call's {target} must be a string")

    def _read_value(self, text: str, pos: int) -> int:
        value = self._value
        assert value is not None
        end = value.feed(text, pos)
        piece = text[pos:end]
        if self._target == "arguments" and value.kind == "container" and self._name is not None:
            self._streamed += piece
            self._calls.arguments(piece)
        elif self._target != "skip":
            self._raw += piece
        if value.done:
            self._value = None
            self._finish_value(value.kind)
        return end

    def _finish_value(self, kind: str) -> None:
        target, raw = self._target, self._raw
        if target == "key":
            self._key = json.loads(raw)
            self._state = self._COLON
            return
        self._state = self._AFTER
        if target == "name":
            self._name = json.loads(raw)
            self._calls.start(self._name)
            if self._arguments is not None:
                self._calls.arguments(self._arguments)
        elif target == "arguments":
            if kind == "container":
                self._arguments = self._streamed or raw
            elif raw == "null":
                self._arguments = "{}"
            elif kind == "string":  # arguments written as a JSON text in a string
                self._arguments = json.loads(raw)
            else:
                raise Malformed("a call's arguments must be an object")
            if self._name is not None and not self._streamed:
                self._calls.arguments(self._arguments)

    def _close(self) -> None:
        if self._name is None:
            raise Malformed("a call without a name")
        if self._arguments is None:  # a tool without parameters
            self._arguments = "{}"
            self._calls.arguments(self._arguments)
        _object_arguments(self._arguments)
        self._state = self._DONE


class CallExtractor:
    """Splits the answer's text into content and calls (`push` each piece, then `finish`)."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        self._calls = _Calls(new_id)
        self.broken = False

    @property
    def calls(self) -> int:
        """How many calls began."""
        return self._calls.count

    def push(self, text: str) -> Extracted:
        raise NotImplementedError

    def finish(self) -> Extracted:
        raise NotImplementedError


class TaggedCalls(CallExtractor):
    """Calls between `<tool_call>` and `</tool_call>` in the answer's text, each read by the
    reader `_reader` makes; the text around them is content (the whitespace that borders a
    call left out)."""

    _TEXT, _CALL, _CLOSING = range(3)

    def __init__(self, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self._state = self._TEXT
        self._pending = ""
        self._after_call = False  # the text since the last call is whitespace so far
        self._reading: Any = None
        self._raw = ""  # the current call's text, returned as content if it breaks

    def _reader(self) -> Any:
        """A reader of one call's body: `feed(text)` -> what follows it once read, or None."""
        raise NotImplementedError

    def push(self, text: str) -> Extracted:
        text, self._pending = self._pending + text, ""
        if self.broken:
            return Extracted(text)
        content: list[str] = []
        try:
            while text:
                if self._state == self._TEXT:
                    text = self._text(text, content)
                elif self._state == self._CALL:
                    self._raw += text
                    rest = self._reading.feed(text)
                    if rest is None:
                        break
                    self._raw = self._raw[: len(self._raw) - len(rest)]
                    self._state, text = self._CLOSING, rest
                else:
                    rest = self._closing(text)
                    self._raw += text[: len(text) - len(rest) - len(self._pending)]
                    text = rest
        except Malformed:
            # From the broken call on, the text is content, as the model wrote it.
            self.broken = True
            content.append(self._raw if self._state == self._CALL else self._raw + text)
        return Extracted("".join(content), self._calls.take())

    def finish(self) -> Extracted:
        pending, self._pending = self._pending, ""
        if self._state == self._CALL and not self.broken:
            self.broken = True  # a call left open: the completion was cut short
            return Extracted(self._raw + pending, self._calls.take())
        if self._state == self._CLOSING or (self._after_call and not pending.strip()):
            pending = ""  # an end tag cut short, or whitespace after the last call
        return Extracted(pending, self._calls.take())

    def _text(self, text: str, content: list[str]) -> str:
        start = text.find(TOOL_CALL_START)
        segment = text if start < 0 else text[:start]
        if self._after_call:
            segment = segment.lstrip()
            self._after_call = not segment and start < 0
        if start >= 0:
            content.append(segment.rstrip())
            self._state, self._raw = self._CALL, TOOL_CALL_START
            self._reading = self._reader()
            return text[start + len(TOOL_CALL_START) :]
        body = segment[: len(segment) - partial_tag(segment, TOOL_CALL_START)]
        kept = len(body.rstrip())
        content.append(segment[:kept])
        self._pending = segment[kept:]
        return ""

    def _closing(self, text: str) -> str:
        stripped = text.lstrip()
        if stripped.startswith(TOOL_CALL_END):
            self._state, self._after_call = self._TEXT, True
            return stripped[len(TOOL_CALL_END) :]
        if stripped.startswith(TOOL_CALL_START):  # the next call, its end tag left out
            self._state = self._TEXT
            return stripped
        if TOOL_CALL_END.startswith(stripped) or TOOL_CALL_START.startswith(stripped):
            self._pending = stripped
            return ""
        raise Malformed("text after a call that is not its end tag")


class HermesCalls(TaggedCalls):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as vLLM's and SGLang's
    `hermes` parser reads it."""

    def _reader(self) -> _CallObject:
        return _CallObject(self._calls, "arguments")


class _XmlFunction:
    """A call's body in Qwen3-Coder's format: `<function=NAME>`, then `<parameter=P>` value
    `</parameter>` blocks (one newline after the opening tag and one before the closing tag
    belong to the markup), then `</function>`. The arguments are built as a JSON object: a
    string parameter streams as its characters come, another waits for its whole value and
    becomes its JSON by the parameter's schema type (vLLM's and SGLang's `qwen3_coder`)."""

    _HEAD, _PARAMETERS, _VALUE, _DONE = range(4)
    _FUNCTION = "<function="
    _FUNCTION_END = "</function>"
    _PARAMETER = "<parameter="
    _PARAMETER_END = "</parameter>"

    def __init__(self, calls: _Calls, types: Callable[[str, str], tuple[str, ...]]) -> None:
        self._calls = calls
        self._types = types  # (function, parameter) -> the parameter's schema types
        self._state = self._HEAD
        self._buffer = ""
        self._name = ""
        self._parameters = 0
        self._streams = False  # the value being read is a string, streamed
        self._value_types: tuple[str, ...] = ()
        self._value_start = False
        self._value = ""  # a value that waits to be whole
        self._arguments = ""

    def feed(self, text: str) -> str | None:
        text, self._buffer = self._buffer + text, ""
        while True:
            if self._state == self._VALUE:
                text = self._read_value(text)
                if self._state == self._VALUE:
                    return None
                continue
            stripped = text.lstrip()
            if self._state == self._HEAD:
                name = self._tag(stripped, self._FUNCTION)
                if name is None:
                    return None
                self._name = name[0]
                self._calls.start(self._name)
                self._state, text = self._PARAMETERS, name[1]
            elif stripped.startswith(self._FUNCTION_END):
                self._emit("}" if self._parameters else "{}")
                _object_arguments(self._arguments)
                self._state = self._DONE
                return stripped[len(self._FUNCTION_END) :]
            elif self._FUNCTION_END.startswith(stripped) and stripped:
                self._buffer = stripped
                return None
            else:
                parameter = self._tag(stripped, self._PARAMETER)
                if parameter is None:
                    return None
                self._begin_value(parameter[0])
                text = parameter[1]

    def _tag(self, text: str, opening: str) -> tuple[str, str] | None:
        """`opening`NAME`>` at the start of `text`: the name and what follows; None while it
        is incomplete (kept in the buffer)."""
        if not text or (len(text) < len(opening) and opening.startswith(text)):
            self._buffer = text
            return None
        if not text.startswith(opening):
            raise Malformed(f"expected {opening}")
        close = text.find(">", len(opening))
        name = text[len(opening) : close if close >= 0 else len(text)]
        if "<" in name or "\n" in name:
            raise Malformed(f"a broken {opening}...> tag")
        if close < 0:
            self._buffer = text
            return None
        if not name:
            raise Malformed(f"an empty name in {opening}>")
        return name, text[close + 1 :]

    def _begin_value(self, parameter: str) -> None:
        self._value_types = self._types(self._name, parameter)
        self._streams = _is_string(self._value_types)
        separator = ", " if self._parameters else "{"
        self._parameters += 1
        self._emit(f"{separator}{json.dumps(parameter, ensure_ascii=False)}: ")
        if self._streams:
            self._emit('"')
        self._state, self._value_start, self._value = self._VALUE, True, ""

    def _read_value(self, text: str) -> str:
        if self._value_start:
            if not text:
                return ""
            self._value_start = False
            if text[0] == "\n":
                text = text[1:]
        end = text.find(self._PARAMETER_END)
        if end < 0:
            held = max(
                partial_tag(text, "\n" + self._PARAMETER_END),
                partial_tag(text, self._PARAMETER_END),
            )
            self._buffer = text[len(text) - held :]
            self._take(text[: len(text) - held])
            return ""
        value = text[:end]
        self._take(value[:-1] if value.endswith("\n") else value)
        if self._streams:
            self._emit('"')
        else:
            converted = _convert(self._value, self._value_types)
            self._emit(json.dumps(converted, ensure_ascii=False))
        self._state = self._PARAMETERS
        return text[end + len(self._PARAMETER_END) :]

    def _take(self, piece: str) -> None:
        if self._streams:
            self._emit(json.dumps(piece, ensure_ascii=False)[1:-1])
        else:
            self._value += piece

    def _emit(self, fragment: str) -> None:
        self._arguments += fragment
        self._calls.arguments(fragment)


def _is_string(types: tuple[str, ...]) -> bool:
    """Whether a parameter's value is read as a string: its schema says string, or names no
    type this parser converts."""
    return not types or "string" in types or not set(types) & _CONVERTED


_CONVERTED = {"integer", "number", "boolean", "object", "array", "null"}


def _convert(value: str, types: tuple[str, ...]) -> Any:
    """A non-string parameter's value by its schema types; text that is none of them stays
    a string (as vLLM's and SGLang's parsers keep it)."""
    stripped = value.strip()
    if stripped == "null" and "null" in types:
        return None
    if "integer" in types or "number" in types:
        try:
            return int(stripped)
        except ValueError:
            pass
        if "number" in types:
            try:
                return float(stripped)
            except ValueError:
                pass
    if "boolean" in types and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    if "object" in types or "array" in types:
        try:
            return json.loads(stripped)
        except json.JSONDecodeError:
            pass
    return value


class Qwen3CoderCalls(TaggedCalls):
    """`<tool_call><function=...>...</function></tool_call>` (`_XmlFunction`)."""

    def __init__(
        self, new_id: Callable[[], str], types: Callable[[str, str], tuple[str, ...]]
    ) -> None:
        super().__init__(new_id)
        self._parameter_types = types

    def _reader(self) -> _XmlFunction:
        return _XmlFunction(self._calls, self._parameter_types)


class _CallsOnly(CallExtractor):
    """An output that is nothing but calls (a grammar's): no content; text that is not the
    calls' JSON, or that ends before it does, is broken (and returned whole)."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self._raw = ""

    @property
    def _complete(self) -> bool:
        raise NotImplementedError

    def _feed(self, text: str) -> None:
        raise NotImplementedError

    def push(self, text: str) -> Extracted:
        if self.broken:
            return Extracted(text)
        self._raw += text
        try:
            self._feed(text)
        except Malformed:
            self.broken = True
            return Extracted(self._raw, self._calls.take())
        return Extracted("", self._calls.take())

    def finish(self) -> Extracted:
        if not self._complete and not self.broken:
            self.broken = True
            return Extracted(self._raw, self._calls.take())
        return Extracted("", self._calls.take())


class RequiredCalls(_CallsOnly):
    """`tool_choice: "required"`'s output: a JSON array of `{"name": ..., "parameters":
    {...}}` objects, one call each."""

    _OPEN, _ITEM, _AFTER, _DONE = range(4)

    def __init__(self, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self._state = self._OPEN
        self._item: _CallObject | None = None

    @property
    def _complete(self) -> bool:
        return self._state == self._DONE

    def _feed(self, text: str) -> None:
        while text:
            if self._item is not None:
                rest = self._item.feed(text)
                if rest is None:
                    return
                self._item, self._state, text = None, self._AFTER, rest
                continue
            char, text = text[0], text[1:]
            if char in _WHITESPACE:
                continue
            if self._state == self._OPEN and char == "[":
                self._state = self._ITEM
            elif self._state == self._ITEM and char == "{":
                self._item = _CallObject(self._calls, "parameters")
                text = char + text
            elif self._state == self._AFTER and char == ",":
                self._state = self._ITEM
            elif self._state == self._AFTER and char == "]" and self.calls:
                self._state = self._DONE
            else:
                raise Malformed(f"unexpected {char!r} in the array of calls")


class NamedCall(_CallsOnly):
    """A named tool's output: the call's arguments object; the call is announced with the
    output's first character and its arguments stream as they come."""

    def __init__(self, new_id: Callable[[], str], name: str) -> None:
        super().__init__(new_id)
        self._name = name
        self._value: _Value | None = None
        self._arguments = ""

    @property
    def _complete(self) -> bool:
        return self._value is not None and self._value.done

    def _feed(self, text: str) -> None:
        if self._value is None:
            text = text.lstrip()
            if not text:
                return
            if text[0] != "{":
                raise Malformed("the arguments must be a JSON object")
            self._value = _Value()
            self._calls.start(self._name)
        if self._value.done:
            if text.strip():
                raise Malformed("text after the arguments")
            return
        end = self._value.feed(text, 0)
        self._arguments += text[:end]
        self._calls.arguments(text[:end])
        if self._value.done:
            _object_arguments(self._arguments)
            if text[end:].strip():
                raise Malformed("text after the arguments")


TOOL_CALL_PARSERS = ("hermes", "qwen3_coder")
