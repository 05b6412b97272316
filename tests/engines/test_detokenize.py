"""Streaming detokenization with the real Qwen tokenizer: multi-byte characters split across
tokens, and stop strings that never leak, even when they span tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from mmserve.engines.detokenize import IncrementalDetokenizer

TEXT = "Grüße aus Köln 🌍🚀 — naïve café, 東京タワー!"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_path / "tokenizer.json"))


def _stream(tokenizer: Tokenizer, stop: list[str], text: str = TEXT) -> tuple[list[str], bool]:
    detokenizer = IncrementalDetokenizer(tokenizer, stop)
    pieces = [detokenizer.push([token]) for token in tokenizer.encode(text).ids]
    pieces.append(detokenizer.flush())
    return pieces, detokenizer.stopped


def test_token_by_token_equals_the_whole_decode(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT).ids
    pieces, stopped = _stream(tokenizer, [])
    assert len(ids) > 15
    assert "" in pieces[:-1], "no token of the text ends inside a character"
    assert "".join(pieces) == TEXT == tokenizer.decode(ids)
    assert not stopped
    assert all("\ufffd" not in piece for piece in pieces)  # no half characters sent


@pytest.mark.parametrize("stop", ["Köln", "🚀", "café,", "タワ"])
def test_text_stops_before_the_stop_string(tokenizer: Tokenizer, stop: str) -> None:
    pieces, stopped = _stream(tokenizer, ["never there", stop])
    assert stopped
    assert "".join(pieces) == TEXT[: TEXT.index(stop)]


def test_a_partial_match_is_released_when_it_turns_out_not_to_match(tokenizer) -> None:
    pieces, stopped = _stream(tokenizer, ["Köln!"])
    assert not stopped and "".join(pieces) == TEXT
