"""Reasoning output (`--reasoning-parser`): a thinking model's `<think>...</think>` section,
where a completion starts and where a grammar applies (both front doors: mmserve's frontend
and the Dynamo backend), and its split from the answer as the completion streams.

A format names its tags; where the completion starts is read from the end of the rendered
prompt (`Opening`): a thinking template's generation prompt opens `<think>` (Qwen3.5,
Qwen3-VL-Thinking), or closes an empty one when thinking is off (`enable_thinking: false`);
otherwise a `qwen3` completion may open `<think>` itself and a `deepseek_r1` one reasons until
`</think>` whatever the prompt says. The splitter holds back only what could still be a tag or
the whitespace around one, so its pieces stream as they are generated.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from mmserve.protocol import Grammar

# The prompt's last tokens that can hold the generation prompt's tags (`<think>\n\n</think>\n\n`).
_PROMPT_TAIL = 16


class Opening(enum.Enum):
    """Where a completion starts: in the reasoning, in the answer, or either (a `<think>` at
    its start opens the reasoning)."""

    REASONING = "reasoning"
    ANSWER = "answer"
    EITHER = "either"


@dataclass(frozen=True)
class ReasoningFormat:
    """A reasoning parser: its tags, and whether a completion is reasoning until the end tag
    even when the prompt did not open the section (DeepSeek-R1 writes no `<think>`)."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    always: bool = False


# vLLM's and SGLang's names (SGLang writes deepseek-r1).
REASONING_PARSERS = {
    "qwen3": ReasoningFormat("qwen3"),
    "deepseek_r1": ReasoningFormat("deepseek_r1", always=True),
}
REASONING_PARSER_ALIASES = {"deepseek-r1": "deepseek_r1"}


def reasoning_format(name: str) -> ReasoningFormat | None:
    """The format of a parser name (vLLM's or SGLang's spelling), or None for a name mmserve
    does not know (Dynamo's registry has more)."""
    return REASONING_PARSERS.get(REASONING_PARSER_ALIASES.get(name, name))


@dataclass(frozen=True)
class ReasoningTokens:
    """A format with its tags' token ids in the served tokenizer."""

    format: ReasoningFormat
    start_id: int
    end_id: int

    @classmethod
    def of(cls, parser: str, tokenizer: Any) -> ReasoningTokens:
        """The tags' ids under a parser's format; each must be one token of the vocabulary (a
        checkpoint without them has no reasoning section to parse)."""
        format = reasoning_format(parser)
        if format is None:
            raise ValueError(f"no reasoning parser is named {parser!r}")
        ids = []
        for tag in (format.start, format.end):
            encoded = tokenizer.encode(tag, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(
                    f"--reasoning-parser {format.name}: {tag} is not one token of this "
                    "model's vocabulary"
                )
            ids.append(encoded[0])
        return cls(format, ids[0], ids[1])

    def opening(self, prompt_ids: Sequence[int]) -> Opening:
        """Where a completion of `prompt_ids` starts: the last tag the generation prompt wrote
        decides; none: `always` formats reason, others may open with the start tag."""
        for token in reversed(prompt_ids[-_PROMPT_TAIL:]):
            if token == self.end_id:
                return Opening.ANSWER
            if token == self.start_id:
                return Opening.REASONING
        return Opening.REASONING if self.format.always else Opening.EITHER


def after_reasoning(
    grammar: Grammar | None, reasoning: ReasoningTokens | None, prompt_ids: Sequence[int]
) -> Grammar | None:
    """With a reasoning parser, a completion that starts in its reasoning follows `grammar`
    from the reasoning's end tag on (as vLLM applies it), so the JSON lands in the answer;
    one whose prompt closed the reasoning (thinking off), or that may not reason, from its
    first token."""
    if grammar is None or reasoning is None:
        return grammar
    if reasoning.opening(prompt_ids) is not Opening.REASONING:
        return grammar
    return msgspec.structs.replace(grammar, start_after=reasoning.end_id)


class _State(enum.Enum):
    OPENING = 0  # may open with the start tag
    REASONING = 1
    ANSWER = 2


_STATES = {
    Opening.REASONING: _State.REASONING,
    Opening.ANSWER: _State.ANSWER,
    Opening.EITHER: _State.OPENING,
}


class ReasoningSplitter:
    """One completion's text, pushed as it streams, split into (reasoning, answer) pieces:
    the reasoning without its tags and the whitespace around them, then the answer."""

    def __init__(self, format: ReasoningFormat, opening: Opening) -> None:
        self._start = format.start
        self._end = format.end
        self._state = _STATES[opening]
        self._pending = ""  # held back: a tag's beginning, or whitespace that may border one
        # At the start of a section the completion opened, its whitespace (and in the
        # reasoning a repeated start tag) is dropped; an answer the prompt opened is kept whole.
        self._at_section_start = opening is not Opening.ANSWER

    def push(self, text: str) -> tuple[str, str]:
        """The (reasoning, answer) pieces that `text` completes."""
        if self._state is _State.ANSWER and not self._at_section_start:
            return "", text
        text = self._pending + text
        self._pending = ""
        reasoning = ""
        if self._state is _State.OPENING:
            text = self._opening(text)
            if self._state is _State.OPENING:
                return "", ""
        if self._state is _State.REASONING:
            reasoning, text = self._reasoning(text)
            if self._state is _State.REASONING:
                return reasoning, ""
        return reasoning, self._answer(text)

    def finish(self) -> tuple[str, str]:
        """What was held back: a reasoning section never closed is all reasoning (the
        completion was cut short, as SGLang reads it); an unfinished tag is text."""
        pending, self._pending = self._pending, ""
        if self._state is _State.REASONING:
            return pending, ""
        return "", pending

    def _opening(self, text: str) -> str:
        stripped = text.lstrip()
        if stripped.startswith(self._start):
            self._state = _State.REASONING
            return stripped[len(self._start) :]
        if self._start.startswith(stripped):  # whitespace, or the tag's beginning
            self._pending = text
            return ""
        self._state = _State.ANSWER
        self._at_section_start = False  # an answer that opened without reasoning is kept whole
        return text

    def _reasoning(self, text: str) -> tuple[str, str]:
        """The reasoning `text` completes and what follows the end tag (the state moves on
        when it comes)."""
        if self._at_section_start:
            stripped = text.lstrip()
            while stripped.startswith(self._start):  # a repeated start tag (DeepSeek-R1-0528)
                stripped = stripped[len(self._start) :].lstrip()
            if not stripped or self._start.startswith(stripped):
                self._pending = text
                return "", ""
            text = stripped
            self._at_section_start = False
        end = text.find(self._end)
        if end >= 0:
            self._state = _State.ANSWER
            self._at_section_start = True
            return text[:end].rstrip(), text[end + len(self._end) :]
        held = _held_back(text, self._end)
        self._pending = text[len(text) - held :]
        return text[: len(text) - held], ""

    def _answer(self, text: str) -> str:
        if not self._at_section_start:
            return text
        stripped = text.lstrip()
        if not stripped:
            return ""
        self._at_section_start = False
        return stripped


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` to hold: the longest suffix that begins `tag`,
    and the whitespace before it (dropped if the tag follows)."""
    partial = 0
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            partial = size
            break
    body = text[: len(text) - partial]
    return partial + len(body) - len(body.rstrip())
