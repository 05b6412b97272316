"""Streaming detokenization with the real Qwen tokenizer: multi-byte characters split across
tokens, a stream that ends inside one, stop strings that never leak, even when they span
tokens, and min_tokens, whose text no stop string may end in."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Tokenizer

from mmserve.engines.detokenize import IncrementalDetokenizer
from mmserve.tiny.checkpoints import build_tiny_model

TEXT = "Grüße aus Köln 🌍🚀 — naïve café, 東京タワー!"
STOPS = ["Köln", "🚀", "café,", "タワ", " ", "\ufffd"]


@pytest.fixture(scope="module")
def auto_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tiny_model("qwen2_vl"))


@pytest.fixture(scope="module")
def tokenizer(auto_tokenizer: Any) -> Tokenizer:
    return auto_tokenizer.backend_tokenizer


def _stream(tokenizer: Tokenizer, stop: list[str], text: str = TEXT) -> tuple[list[str], bool]:
    return _stream_ids(tokenizer, stop, tokenizer.encode(text).ids)


def _stream_ids(
    tokenizer: Tokenizer, stop: list[str], ids: list[int], min_tokens: int = 0, **options: bool
) -> tuple[list[str], bool]:
    """The pieces a stream of `ids` releases, the last one from `flush`; whether it stopped."""
    detokenizer = IncrementalDetokenizer(tokenizer, stop, min_tokens, **options)
    pieces = []
    for token in ids:
        pieces.append(detokenizer.push([token]))
        if detokenizer.stopped:
            break
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


def _ends_mid_character(auto_tokenizer: Any, ids: list[int]) -> list[int]:
    """The lengths n at which `ids[:n]` decodes with an incomplete last character."""
    return [
        n
        for n in range(1, len(ids) + 1)
        if auto_tokenizer.decode(ids[:n], skip_special_tokens=True).endswith("\ufffd")
    ]


def test_a_completion_cut_inside_a_character_ends_as_the_tokenizer_decodes_it(
    tokenizer: Tokenizer, auto_tokenizer: Any
) -> None:
    """Cut by max_tokens after any token: the text is the tokenizer's own decode of the ids,
    U+FFFD for the incomplete character and the space before it kept."""
    ids = auto_tokenizer.encode(TEXT, add_special_tokens=False)
    cuts = _ends_mid_character(auto_tokenizer, ids)
    assert len(cuts) >= 3, "too few tokens of the text ends inside a character"
    for n in range(1, len(ids) + 1):
        pieces, stopped = _stream_ids(tokenizer, [], ids[:n])
        assert "".join(pieces) == auto_tokenizer.decode(ids[:n], skip_special_tokens=True)
        assert not stopped
    # The first token of " 🌍" is the space and the emoji's first bytes: alone it is " �", not "".
    (first, *_) = auto_tokenizer.encode(" 🌍", add_special_tokens=False)
    assert _stream_ids(tokenizer, [], [first]) == (["", " \ufffd"], False)
    (first, *_) = auto_tokenizer.encode("a 東京", add_special_tokens=False)[1:]
    assert "".join(_stream_ids(tokenizer, [], [first])[0]) == " \ufffd"


@pytest.mark.parametrize("stop", STOPS)
def test_a_cut_completion_still_stops_before_the_stop_string(
    tokenizer: Tokenizer, auto_tokenizer: Any, stop: str
) -> None:
    """Whatever token the completion is cut after, its text is the tokenizer's decode up to
    the first stop string, never including it (also one completed by the flushed text)."""
    ids = auto_tokenizer.encode(TEXT, add_special_tokens=False)
    for n in range(1, len(ids) + 1):
        whole = auto_tokenizer.decode(ids[:n], skip_special_tokens=True)
        pieces, stopped = _stream_ids(tokenizer, ["never there", stop], ids[:n])
        assert "".join(pieces) == (whole[: whole.index(stop)] if stop in whole else whole)
        assert stopped == (stop in whole)


@pytest.mark.parametrize("stop", STOPS)
def test_an_included_stop_string_ends_the_text(
    tokenizer: Tokenizer, auto_tokenizer: Any, stop: str
) -> None:
    """`include_stop_str_in_output`: wherever the completion is cut, its text is the
    tokenizer's decode up to the end of the first stop string, and nothing is held back (each
    piece is the decode's next characters as soon as they complete)."""
    ids = auto_tokenizer.encode(TEXT, add_special_tokens=False)
    for n in range(1, len(ids) + 1):
        whole = auto_tokenizer.decode(ids[:n], skip_special_tokens=True)
        pieces, stopped = _stream_ids(
            tokenizer, ["never there", stop], ids[:n], include_stop_str_in_output=True
        )
        end = whole.index(stop) + len(stop) if stop in whole else len(whole)
        assert "".join(pieces) == whole[:end]
        assert stopped == (stop in whole)
    pieces, _ = _stream(tokenizer, [], "Grüße")
    held = _stream_ids(tokenizer, ["Grüße!"], tokenizer.encode("Grüße").ids)[0]
    included = _stream_ids(
        tokenizer, ["Grüße!"], tokenizer.encode("Grüße").ids, include_stop_str_in_output=True
    )[0]
    assert included == pieces and held[-1] == "Grüße"  # one holds the prefix of the stop


def test_special_tokens_text_stays_unless_skipped(
    tokenizer: Tokenizer, auto_tokenizer: Any
) -> None:
    ids = auto_tokenizer.encode("Hi<|im_end|> there<|endoftext|>", add_special_tokens=False)
    assert "".join(_stream_ids(tokenizer, [], ids)[0]) == "Hi there"
    kept = _stream_ids(tokenizer, [], ids, skip_special_tokens=False)[0]
    assert "".join(kept) == "Hi<|im_end|> there<|endoftext|>"


def test_min_tokens_text_cannot_end_a_stop_string(tokenizer: Tokenizer) -> None:
    """As vLLM: a stop string that ends in the text of the first min_tokens tokens does not
    stop the stream (nor is it cut); one that starts there and ends after it does."""
    text = "alpha beta alpha beta gamma"
    ids = tokenizer.encode(text).ids
    assert [tokenizer.decode([i]) for i in ids][:2] == ["alpha", " beta"]
    stop = ["alpha beta"]

    assert _stream_ids(tokenizer, stop, ids) == (["", "", ""], True)
    # "alpha" alone is protected: the first match ends after it.
    assert _stream_ids(tokenizer, stop, ids, min_tokens=1) == (["", "", ""], True)
    # "alpha beta" is protected: the second match stops the stream.
    pieces, stopped = _stream_ids(tokenizer, stop, ids, min_tokens=2)
    assert stopped and "".join(pieces) == "alpha beta "
    pieces, stopped = _stream_ids(tokenizer, stop, ids, min_tokens=len(ids))
    assert not stopped and "".join(pieces) == text
