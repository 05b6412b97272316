"""Prompt text to token ids: the largest piece of the frontend's CPU on a new text prompt.

A Qwen tokenizer normalizes its input to Unicode NFC before splitting it, and that pass (with
its per-byte alignment bookkeeping) is about a fifth of the encode. Every Unicode normal form
leaves ASCII as it is, and most prompts are ASCII (`str.isascii` is a flag CPython keeps, free
to read). So an ASCII prompt goes to a twin of the tokenizer without the normalizer: the same
model object (vocabulary and merges shared, not copied), pre-tokenizer, post-processor and added
tokens. The twin is built only when the normalizer is a single Unicode normal form, in a few
milliseconds at start, and used only when its added tokens keep their ids and a probe text with
every added token encodes to the same ids both ways; any other text goes to the tokenizer itself.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.normalizers import NFC, NFD, NFKC, NFKD

UNICODE_FORMS = (NFC, NFD, NFKC, NFKD)
PROBE_TEXT = "The 3 quick brown foxes'd jump over 12,345 lazy dogs!\n\t  (ok?)  \r\n"


class PromptEncoder:
    """Encodes prompts with a tokenizers `Tokenizer` (transformers' `backend_tokenizer`), by
    its fast batch call: it skips the offsets nothing here reads, and releases the GIL."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ascii_twin = ascii_twin(tokenizer)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        twin = self.ascii_twin
        tokenizer = twin if twin is not None and text.isascii() else self.tokenizer
        (encoding,) = tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        ids: list[int] = encoding.ids
        return ids


def ascii_twin(tokenizer: Tokenizer) -> Tokenizer | None:
    """`tokenizer` without its normalizer, sharing its model, for ASCII text; None where that
    would not give the same ids (another normalizer, truncation or padding set, an added token
    that moves)."""
    if not isinstance(tokenizer.normalizer, UNICODE_FORMS):
        return None
    if tokenizer.truncation is not None or tokenizer.padding is not None:
        return None
    twin = Tokenizer(tokenizer.model)
    for part in ("pre_tokenizer", "post_processor"):
        if (value := getattr(tokenizer, part)) is not None:
            setattr(twin, part, value)
    twin.encode_special_tokens = tokenizer.encode_special_tokens
    added = tokenizer.get_added_tokens_decoder()
    for token_id in sorted(added):
        token = added[token_id]
        # One at a time, in id order, so that a token the model lacks gets the same next id.
        if token.special:
            twin.add_special_tokens([token])
        else:
            twin.add_tokens([token])
    if any(twin.token_to_id(token.content) != token_id for token_id, token in added.items()):
        return None
    probe = PROBE_TEXT + " ".join(token.content for token in added.values()) + PROBE_TEXT
    if not probe.isascii():
        probe = PROBE_TEXT
    for special in (False, True):
        if (
            twin.encode(probe, add_special_tokens=special).ids
            != tokenizer.encode(probe, add_special_tokens=special).ids
        ):
            return None
    return twin
