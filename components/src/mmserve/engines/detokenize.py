"""Token ids back to text as they stream in, cut at the first stop string.

The engine that samples the tokens makes their text here, once (`sampling.stream_completion`),
and sends both in each `TokenChunk`; the frontend passes the text on. Every deployment pattern
decodes on the worker that runs decode, so the same tokens give the same text. Text that could
be the start of a stop string is held back until the next tokens decide, so a stop string never
leaks to the client, even split across tokens.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = [s for s in stop if s]
        self._held = ""
        self.stopped = False

    def push(self, token_ids: list[int]) -> str:
        """Text released by these tokens; after a stop string matched, always ""."""
        if self.stopped:
            return ""
        for token_id in token_ids:
            piece = self._stream.step(self._tokenizer, token_id)
            if piece:
                self._held += piece
        return self._release()

    def flush(self) -> str:
        """Text still held back when generation ended without a stop string."""
        if self.stopped:
            return ""
        text, self._held = self._held, ""
        return text

    def _release(self) -> str:
        if not self._stop:
            text, self._held = self._held, ""
            return text
        first_match = min(
            (pos for pos in (self._held.find(s) for s in self._stop) if pos >= 0), default=-1
        )
        if first_match >= 0:
            self.stopped = True
            text, self._held = self._held[:first_match], ""
            return text
        keep = self._longest_stop_prefix_suffix()
        cut = len(self._held) - keep
        text, self._held = self._held[:cut], self._held[cut:]
        return text

    def _longest_stop_prefix_suffix(self) -> int:
        """Length of the longest end of the held text that begins some stop string."""
        held = self._held
        for length in range(min(len(held), max(len(s) for s in self._stop) - 1), 0, -1):
            tail = held[-length:]
            if any(s.startswith(tail) for s in self._stop):
                return length
        return 0
