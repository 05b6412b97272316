"""The frontend's prompt encoder (`frontend/prompt_encoder.py`) gives the tokenizer's own ids:
ASCII prompts through the twin without the NFC normalizer, every other prompt through the
tokenizer itself; the twin exists only where it cannot change an id."""

from __future__ import annotations

import functools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from tokenizers.normalizers import NFC, Lowercase

from mmserve.frontend.prompt_encoder import PromptEncoder, ascii_twin
from mmserve.tiny.checkpoints import build_tiny_model

ASCII_PIECES = [*"aZ \n\t.,!?'\x00\x7f", "  ", "\r\n", "'s", "'LL", "123", "user", "Hello"]
ASCII_PIECES += ["<|im_start|>", "<|im_end|>", "<|vision_start|><|image_pad|><|vision_end|>"]
# NFC changes the first two (a decomposed accent, a compatibility ligature stays), so a twin
# without the normalizer would give other ids for them.
OTHER_PIECES = ["e\u0301", "A\u030a", "ﬁ", "é", "中", "🙂", "\u200b"]


@functools.cache
def qwen_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(build_tiny_model("qwen2_vl") / "tokenizer.json"))


@functools.cache
def qwen_encoder() -> PromptEncoder:
    return PromptEncoder(qwen_tokenizer())


def test_a_qwen_tokenizer_gets_a_twin_that_needs_no_copy_of_its_vocabulary() -> None:
    encoder = qwen_encoder()
    assert encoder.ascii_twin is not None
    assert encoder.ascii_twin.normalizer is None
    assert encoder.ascii_twin.get_vocab_size() == qwen_tokenizer().get_vocab_size()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pieces=st.lists(st.sampled_from(ASCII_PIECES + OTHER_PIECES), max_size=60),
    special=st.booleans(),
)
def test_every_prompt_gets_the_tokenizers_ids(pieces: list[str], special: bool) -> None:
    text = "".join(pieces)
    expected = qwen_tokenizer().encode(text, add_special_tokens=special).ids
    assert qwen_encoder().encode(text, add_special_tokens=special) == expected


def test_text_that_nfc_changes_goes_to_the_tokenizer_itself() -> None:
    encoder = qwen_encoder()
    assert encoder.ascii_twin is not None
    text = "cafe\u0301 A\u030angstrom"
    normalized = qwen_tokenizer().encode(text).ids
    assert encoder.ascii_twin.encode(text).ids != normalized  # the twin would be wrong here
    assert encoder.encode(text) == normalized


def test_no_twin_where_the_normalizer_changes_ascii_or_the_encoding_is_cut() -> None:
    # Tokenizers on the Qwen tokenizer's model (shared, not copied).
    lowercase = Tokenizer(qwen_tokenizer().model)
    lowercase.normalizer = Lowercase()
    assert ascii_twin(lowercase) is None
    truncated = Tokenizer(qwen_tokenizer().model)
    truncated.normalizer = NFC()
    assert ascii_twin(truncated) is not None
    truncated.enable_truncation(8)
    assert ascii_twin(truncated) is None


def test_a_tokenizer_without_normalizer_is_used_as_it_is() -> None:
    # Gemma 3's, for one, has none.
    bare = Tokenizer(qwen_tokenizer().model)
    assert bare.normalizer is None
    assert PromptEncoder(bare).ascii_twin is None
