"""A chat answer's choices read out of their text as it streams: the reasoning
(`mmserve.reasoning`), then the content and the tool calls (`frontend/tool_parsers.py`).
The frontend holds the client's stream and already has each chunk's text, so the reading runs
here, per choice, on the pieces as they come; a request that asks for neither (no reasoning
parser, no tools) is not read at all. A streamed answer and a collected one go through the same
reader, so the calls and text of one are the other's joined."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mmserve.frontend.tool_parsers import CallDelta, CallExtractor
from mmserve.protocol import (
    AssistantMessage,
    ChoiceDelta,
    ChoiceFinishReason,
    FinishReason,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
)
from mmserve.reasoning import Opening, ReasoningFormat, ReasoningSplitter

ExtractorFactory = Callable[[Callable[[], str]], CallExtractor]


@dataclass(frozen=True)
class OutputRules:
    """How one request's completions are read: the reasoning format (None: not split) and
    where the completion starts; whether the reasoning is returned; the extractor of its calls
    (None: no calls are read), and whether only the first call is returned."""

    reasoning: ReasoningFormat | None = None
    opening: Opening = Opening.EITHER
    include_reasoning: bool = True
    calls: ExtractorFactory | None = None
    single_call: bool = False

    @property
    def reads(self) -> bool:
        return self.reasoning is not None or self.calls is not None


@dataclass(slots=True)
class Piece:
    """What a piece of a choice's text became: reasoning, content and calls' deltas, and the
    answer's text as the model wrote it (the content a broken call falls back to)."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)
    answer: str = ""

    def extend(self, other: Piece) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        self.answer += other.answer


class ChoiceReader:
    """One choice's text, pushed chunk by chunk, then finished."""

    def __init__(self, rules: OutputRules, new_call_id: Callable[[], str]) -> None:
        self._rules = rules
        self._splitter = (
            None if rules.reasoning is None else ReasoningSplitter(rules.reasoning, rules.opening)
        )
        self._extractor = None if rules.calls is None else rules.calls(new_call_id)

    @property
    def called(self) -> bool:
        """Whether a call began (the choice then finishes with "tool_calls")."""
        return self._extractor is not None and self._extractor.calls > 0

    @property
    def broken(self) -> bool:
        """Whether the text stopped following the call format after a call began."""
        return self._extractor is not None and self._extractor.broken

    def push(self, text: str) -> Piece:
        if self._splitter is None:
            return self._answer("", text)
        return self._answer(*self._splitter.push(text))

    def finish(self) -> Piece:
        piece = self._answer(*self._splitter.finish()) if self._splitter else Piece()
        if self._extractor is not None:
            tail = self._extractor.finish()
            piece.content += tail.content
            piece.calls += self._kept(tail.calls)
        return piece

    def _answer(self, reasoning: str, answer: str) -> Piece:
        if not self._rules.include_reasoning:
            reasoning = ""
        if self._extractor is None or not answer:
            return Piece(reasoning, answer, answer=answer)
        extracted = self._extractor.push(answer)
        return Piece(reasoning, extracted.content, self._kept(extracted.calls), answer)

    def _kept(self, deltas: list[CallDelta]) -> list[CallDelta]:
        if self._rules.single_call:
            return [delta for delta in deltas if delta.index == 0]
        return deltas


def choice_finish(reason: FinishReason | None, called: bool) -> ChoiceFinishReason | None:
    """A choice that stopped after calling tools finishes with "tool_calls" (OpenAI's)."""
    return "tool_calls" if called and reason == "stop" else reason


def delta_events(piece: Piece) -> list[ChoiceDelta]:
    """A streamed piece's deltas: its reasoning first (under SGLang's and Dynamo's name and
    vLLM's), then its content and calls (each call's id, type and name with its first
    delta)."""
    deltas = []
    if piece.reasoning:
        deltas.append(ChoiceDelta(reasoning_content=piece.reasoning, reasoning=piece.reasoning))
    if piece.content or piece.calls:
        deltas.append(
            ChoiceDelta(
                content=piece.content or None,
                tool_calls=[_call_delta(call) for call in piece.calls] or None,
            )
        )
    return deltas


def _call_delta(call: CallDelta) -> ToolCallDelta:
    if call.id is None:
        return ToolCallDelta(index=call.index, function=FunctionCallDelta(arguments=call.arguments))
    return ToolCallDelta(
        index=call.index,
        id=call.id,
        type="function",
        function=FunctionCallDelta(name=call.name, arguments=call.arguments),
    )


class CollectedChoice:
    """One choice of a non-streamed answer: its text read piece by piece (or kept whole when
    the request asks for no reading), then its message."""

    def __init__(self, rules: OutputRules, new_call_id: Callable[[], str]) -> None:
        self._reader = ChoiceReader(rules, new_call_id) if rules.reads else None
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._answer: list[str] = []
        self._calls: dict[int, list[str]] = {}  # index -> [id, name, arguments...]

    def add(self, text: str) -> None:
        if self._reader is None:
            self._content.append(text)
        else:
            self._take(self._reader.push(text))

    def message(
        self, reason: FinishReason | None
    ) -> tuple[AssistantMessage, ChoiceFinishReason | None]:
        """The choice's message and finish reason; a call that broke leaves the answer's text
        as the model wrote it, in content, and no calls."""
        if self._reader is None:
            return AssistantMessage(role="assistant", content="".join(self._content)), reason
        self._take(self._reader.finish())
        reasoning = "".join(self._reasoning) or None
        if self._reader.broken:
            content, calls = "".join(self._answer), []
        else:
            content = "".join(self._content)
            calls = [
                ToolCall(
                    id=parts[0], function=FunctionCall(name=parts[1], arguments="".join(parts[2:]))
                )
                for parts in self._calls.values()
            ]
        message = AssistantMessage(
            role="assistant",
            content=content if content or not calls else None,
            reasoning_content=reasoning,
            reasoning=reasoning,
            tool_calls=calls or None,
        )
        return message, choice_finish(reason, bool(calls))

    def _take(self, piece: Piece) -> None:
        self._reasoning.append(piece.reasoning)
        self._content.append(piece.content)
        self._answer.append(piece.answer)
        for call in piece.calls:
            if call.id is not None:
                self._calls[call.index] = [call.id, call.name or ""]
            self._calls[call.index].append(call.arguments)
