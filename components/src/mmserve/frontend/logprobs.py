"""The log-probabilities of a completion in OpenAI's chat format: each token's text and exact
UTF-8 bytes (a character split across tokens has its bytes split the same way), its
log-probability and the most likely tokens at its position."""

from __future__ import annotations

import functools
from typing import Any

from mmserve.protocol import ChatTokenLogprob, TokenLogprob, TopLogprob


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """The inverse of the byte-level BPE alphabet (GPT-2's `bytes_to_unicode`): each of the 256
    characters that stand for a byte in a byte-level token."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(256 + extra)
            extra += 1
    return {char: byte for byte, char in chars.items()}


class TokenTexts:
    """Each token id's text and bytes for a tokenizer, remembered per id."""

    def __init__(self, tokenizer: Any) -> None:  # transformers PreTrainedTokenizerFast
        self._tokenizer = tokenizer
        decoder = tokenizer.backend_tokenizer.decoder
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._special = frozenset(tokenizer.all_special_ids)
        self.of = functools.lru_cache(maxsize=1 << 16)(self._text_and_bytes)

    def _text_and_bytes(self, token_id: int) -> tuple[str, list[int]]:
        if self._byte_level and token_id not in self._special:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            table = _byte_of_char()
            if piece is not None and all(char in table for char in piece):
                raw = bytes(table[char] for char in piece)
                return raw.decode("utf-8", errors="replace"), list(raw)
        text = self._tokenizer.decode([token_id])
        return text, list(text.encode("utf-8"))

    def chat(self, logprobs: list[TokenLogprob]) -> list[ChatTokenLogprob]:
        """OpenAI's `logprobs.content` entries of `logprobs`, in order."""
        return [self._entry(each) for each in logprobs]

    def _entry(self, logprob: TokenLogprob) -> ChatTokenLogprob:
        text, raw = self.of(logprob.token_id)
        top = []
        for token_id, value in logprob.top:
            other, other_raw = self.of(token_id)
            top.append(TopLogprob(token=other, logprob=value, bytes=other_raw))
        return ChatTokenLogprob(token=text, logprob=logprob.logprob, bytes=raw, top_logprobs=top)
