"""The tokenizer's ids of the texts the request driver writes into prompts (`_mm.process`'s
`text_pieces`): Qwen3-VL's timestamp text before each temporal group of a video, and a
family's own texts between items (`_mm.Spec.text_pieces`: Gemma 3's between an image and its
pan-and-scan crops). Each text sits between special tokens in the prompt, so it is tokenized
there, on its own; the frontend computes them once, at start-up, and checks them."""

from __future__ import annotations

from typing import Any

from mmserve.models.family import ModelSpec


def text_pieces(tokenizer: Any, spec: ModelSpec) -> dict[str, list[int]] | None:
    """The ids of every text the driver may write into `spec`'s prompts (None: it writes
    none), from `tokenizer` (transformers' fast tokenizer)."""
    pieces: dict[str, list[int]] = {}
    if spec.core.video_per_group:
        pieces |= timestamp_tokens(tokenizer, spec.vision_start_token_id)
    texts = spec.core.text_pieces
    ids = between_specials(tokenizer, spec.vision_start_token_id, texts)
    pieces |= dict(zip(texts, ids, strict=True))
    return pieces or None


def between_specials(tokenizer: Any, special: int, texts: list[str]) -> list[list[int]]:
    """The ids of each of `texts` in the context the prompt gives it: between two special
    tokens (`special`), which cut it off from its neighbours."""
    if not texts:
        return []
    token = tokenizer.convert_ids_to_tokens(special)
    encodings = tokenizer.backend_tokenizer.encode_batch(
        [token + text + token for text in texts], add_special_tokens=False
    )
    return [encoding.ids[1:-1] for encoding in encodings]


# The pieces Qwen3-VL's timestamp texts (`<{t:.1f} seconds>`) are made of.
TIMESTAMP_PIECES = ("<", *"0123456789", ".", " seconds>")


def timestamp_tokens(tokenizer: Any, vision_start: int) -> dict[str, list[int]]:
    """The ids `tokenizer` (transformers' fast tokenizer) gives each piece of a timestamp
    text, for the request driver to spell each group's text with (`_mm.process`'s
    `text_pieces`). The text sits between special tokens in the prompt, so it is
    tokenized on its own; checked here to be its pieces' ids in order for every time up to
    100 s by tenths, and some longer, as Qwen2's tokenizer writes digits one by one. A
    tokenizer that writes them otherwise is refused (ValueError)."""

    def encode(texts: list[str]) -> list[list[int]]:
        return between_specials(tokenizer, vision_start, texts)

    pieces = dict(zip(TIMESTAMP_PIECES, encode(list(TIMESTAMP_PIECES)), strict=True))
    seconds = [tenths / 10 for tenths in range(1000)] + [123.4, 1234.5, 3599.9, 86399.9]
    texts = [f"<{t:.1f} seconds>" for t in seconds]
    for text, ids in zip(texts, encode(texts), strict=True):
        spelled = [*pieces["<"]]
        for char in text[1 : -len(" seconds>")]:
            spelled += pieces[char]
        spelled += pieces[" seconds>"]
        if spelled != ids:
            raise ValueError(
                f"the tokenizer writes the timestamp text {text!r} as {ids}, not piece by "
                f"piece ({spelled}); its Qwen3-VL videos cannot be planned"
            )
    return pieces
