"""Token ids back to text as they stream in, cut at the first stop string.

The engine that samples the tokens makes their text here, once (`sampling.stream_completion`),
and sends both in each `TokenChunk`; the frontend passes the text on. Every deployment pattern
decodes on the worker that runs decode, so the same tokens give the same text. Text that could
be the start of a stop string is held back until the next tokens decide, so a stop string never
leaks to the client, even split across tokens. The text of the first `min_tokens` tokens cannot
complete a stop string (vLLM's rule: a match must end after it).

Tokens that end inside a character release nothing until the character completes; when the
stream ends first, `flush` gives what the tokenizer's own decode of them is (U+FFFD for the
incomplete character), so the whole text equals `tokenizer.decode(ids)`.

vLLM's output options: special tokens' text is left out unless `skip_special_tokens` is off,
and a matched stop string ends the text before it, or after it with
`include_stop_str_in_output` (then nothing is held back: a stop string is no secret).
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: list[str],
        min_tokens: int = 0,
        *,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._include_stop = include_stop_str_in_output
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stop = [s for s in stop if s]
        self._min_tokens = min_tokens
        self._ids: list[int] = []
        self._decoded = 0  # characters the stream has given for `_ids` so far
        self._pending = False  # the last ids end inside a character: the stream gave no text
        self._held = ""
        self._protected = 0  # leading characters of `_held` made by the first min_tokens tokens
        self._sent_tail = ""  # the end of the text sent, where an included stop string may begin
        self.stopped = False

    def push(self, token_ids: list[int]) -> str:
        """Text released by these tokens; after a stop string matched, always ""."""
        if self.stopped:
            return ""
        for token_id in token_ids:
            self._ids.append(token_id)
            piece = self._stream.step(self._tokenizer, token_id)
            self._pending = piece is None
            if piece:
                self._held += piece
                self._decoded += len(piece)
            if len(self._ids) <= self._min_tokens:
                self._protected = len(self._held)
        return self._release(final=False)

    def flush(self) -> str:
        """The text still held back when generation ends: with the tokenizer's decode of ids
        that end inside a character, and cut (setting `stopped`) if that completes a stop
        string."""
        if self.stopped:
            return ""
        if self._pending:
            whole = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip_special_tokens)
            self._held += whole[self._decoded :]
            self._pending = False
            if len(self._ids) <= self._min_tokens:
                self._protected = len(self._held)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        held = self._held
        if self._stop:
            # Included stop strings are not held back: one may begin in text already sent.
            seen = self._sent_tail
            match = self._first_match(seen + held, len(seen) + self._protected)
            if match is not None:
                position, stop = match
                self.stopped = True
                self._held = ""
                end = position + len(stop) if self._include_stop else position
                return (seen + held)[len(seen) : end]
        holds = self._stop and not final and not self._include_stop
        cut = len(held) - self._stop_prefix_suffix() if holds else len(held)
        self._held = held[cut:]
        self._protected = max(0, self._protected - cut)
        if self._include_stop and self._stop:
            sent = self._sent_tail + held[:cut]
            self._sent_tail = sent[max(0, len(sent) - max(map(len, self._stop)) + 1) :]
        return held[:cut]

    def _first_match(self, text: str, protected: int) -> tuple[int, str] | None:
        """Where in `text` the first stop string that ends past its first `protected`
        characters begins, and which it is (the longest of those that begin there), or None."""
        found = ((text.find(s, max(0, protected - len(s) + 1)), s) for s in self._stop)
        return min(
            ((pos, s) for pos, s in found if pos >= 0),
            key=lambda match: (match[0], -len(match[1])),
            default=None,
        )

    def _stop_prefix_suffix(self) -> int:
        """Length of the longest end of the held text that begins some stop string."""
        held = self._held
        for length in range(min(len(held), max(len(s) for s in self._stop) - 1), 0, -1):
            tail = held[-length:]
            if any(s.startswith(tail) for s in self._stop):
                return length
        return 0
