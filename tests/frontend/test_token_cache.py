"""The cache of rendered prompts' token ids: a prompt sent again skips the tokenizer and gets
exactly the ids the tokenizer gives; the budget bounds it."""

from __future__ import annotations

import sys
import threading

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmserve.frontend.chat import ChatOptions, ChatPreprocessor, ServedModel
from mmserve.frontend.token_cache import TokenCache, message_boundary
from mmserve.media import MediaPolicy
from mmserve.observability import metrics
from mmserve.protocol import ChatCompletionRequest, ChatMessage
from mmserve.tiny.checkpoints import build_tiny_model


class CountingEncoder:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, text: str) -> list[int]:
        self.calls.append(text)
        return [ord(c) for c in text]


def _size(text: str, ids: int) -> int:
    return sys.getsizeof(text) + 4 * ids


def test_a_prompt_seen_before_skips_the_encoder() -> None:
    cache, encode = TokenCache(1 << 20), CountingEncoder()
    first = cache.tokens("hello", encode)
    again = cache.tokens("hello", encode)
    assert first == again == [ord(c) for c in "hello"]
    assert encode.calls == ["hello"]
    assert cache.tokens("hello!", encode) == [ord(c) for c in "hello!"]
    assert encode.calls == ["hello", "hello!"]


def test_least_recently_used_prompts_leave_first_under_the_budget() -> None:
    texts = [f"prompt {i}" for i in range(3)]
    cache, encode = TokenCache(2 * _size(texts[0], len(texts[0]))), CountingEncoder()
    cache.tokens(texts[0], encode)
    cache.tokens(texts[1], encode)
    cache.tokens(texts[0], encode)  # now the most recent
    cache.tokens(texts[2], encode)  # evicts texts[1]
    assert len(cache) == 2
    encode.calls.clear()
    cache.tokens(texts[0], encode)
    cache.tokens(texts[1], encode)
    assert encode.calls == [texts[1]]


def test_an_entry_over_the_budget_is_not_kept() -> None:
    cache, encode = TokenCache(16), CountingEncoder()
    assert cache.tokens("a long prompt", encode) == [ord(c) for c in "a long prompt"]
    assert len(cache) == 0


def test_threads_share_the_cache() -> None:
    cache, encode = TokenCache(1 << 20), CountingEncoder()
    results: list[list[int]] = []
    threads = [
        threading.Thread(target=lambda: results.append(cache.tokens("same", encode)))
        for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(result == [ord(c) for c in "same"] for result in results)
    assert 1 <= len(encode.calls) <= 8 and len(cache) == 1


def _hits() -> float:
    return metrics.CACHE_LOOKUPS.labels("frontend", "prompt_tokens", "hit")._value.get()


async def test_the_frontend_gives_the_tokenizers_ids_on_a_hit() -> None:
    model = ServedModel.load(build_tiny_model("qwen2_vl"))
    request = ChatCompletionRequest(
        model=model.name,
        messages=[ChatMessage(role="user", content="How many tokens is this, twice? " * 40)],
    )
    cached = ChatPreprocessor(model, ChatOptions(policy=MediaPolicy()))
    plain = ChatPreprocessor(model, ChatOptions(policy=MediaPolicy(), token_cache_bytes=0))
    hits = _hits()
    first = await cached.preprocess(request, "a", 1e12)
    second = await cached.preprocess(request, "b", 1e12)
    reference = await plain.preprocess(request, "c", 1e12)
    assert _hits() == hits + 1
    assert first.plan.token_ids == second.plan.token_ids == reference.plan.token_ids
    assert np.asarray(second.plan.token_ids).max() >= 2**16  # ids past uint16 survive the cache


# -- prefixes: a conversation's next turn tokenizes only its new messages ----------------------

_MODEL = None


def _served() -> ServedModel:
    global _MODEL
    if _MODEL is None:
        _MODEL = ServedModel.load(build_tiny_model("qwen2_vl"))
    return _MODEL


def _render(messages: list[dict[str, str]]) -> str:
    return _served().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _encode(text: str) -> list[int]:
    return list(_served().tokenizer.encode(text, add_special_tokens=False))


_PIECES = [*"ab \n\t.,!?", "é", "中", "🙂", "\u200b", "  ", "\r\n", "'s", "123", "user"]
_PIECES += [
    "assistant",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|><|image_pad|><|vision_end|>",
]
_CONTENT = st.lists(st.sampled_from(_PIECES), max_size=12).map("".join)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns=st.lists(st.tuples(_CONTENT, _CONTENT), min_size=1, max_size=5), system=_CONTENT)
def test_every_turn_of_a_conversation_gets_the_tokenizers_ids(
    turns: list[tuple[str, str]], system: str
) -> None:
    tokenizer = _served().tokenizer
    cache = TokenCache(1 << 22, message_boundary(tokenizer))
    assert cache.boundary is not None
    encoded: list[str] = []
    rendered: list[str] = []
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    for question, answer in turns:
        messages.append({"role": "user", "content": question})
        text = _render(messages)
        rendered.append(text)
        ids = cache.tokens(text, lambda t: (encoded.append(t), _encode(t))[1])
        assert ids == _encode(text)
        messages.append({"role": "assistant", "content": answer})
    # After the first turn, each turn tokenized only a tail of its prompt.
    assert len(encoded) == len(turns)
    assert all(len(tail) < len(full) for tail, full in zip(encoded[1:], rendered[1:], strict=True))


def test_the_next_turn_tokenizes_only_its_new_messages() -> None:
    cache = TokenCache(1 << 22, message_boundary(_served().tokenizer))
    calls: list[str] = []

    def counting(text: str) -> list[int]:
        calls.append(text)
        return _encode(text)

    history = [{"role": "user", "content": "Tell me a long story. " * 50}]
    cache.tokens(_render(history), counting)
    history += [
        {"role": "assistant", "content": "Once upon a time."},
        {"role": "user", "content": "And then?"},
    ]
    prefix_hits = metrics.CACHE_LOOKUPS.labels("frontend", "prompt_tokens", "prefix_hit")
    before = prefix_hits._value.get()
    text = _render(history)
    assert cache.tokens(text, counting) == _encode(text)
    assert prefix_hits._value.get() == before + 1
    assert calls[1].startswith("<|im_start|>assistant\nOnce upon a time.")
    assert "long story" not in calls[1]


def test_an_evicted_prompt_takes_its_prefixes_with_it() -> None:
    first = [{"role": "user", "content": "first " * 30}]
    probe = TokenCache(1 << 22, message_boundary(_served().tokenizer))
    probe.tokens(_render(first), _encode)
    (entry,) = probe._entries.values()
    cache = TokenCache(entry.size + 64, probe.boundary)  # room for one such prompt
    cache.tokens(_render(first), _encode)
    cache.tokens(_render([{"role": "user", "content": "other " * 30}]), _encode)  # evicts first
    assert len(cache) == 1
    live = {digest for kept in cache._entries.values() for digest in kept.digests}
    assert cache._prefixes.keys() <= live
    calls: list[str] = []
    longer = _render([*first, {"role": "assistant", "content": "x"}])
    assert cache.tokens(longer, lambda t: (calls.append(t), _encode(t))[1]) == _encode(longer)
    # Only the system prompt the two share was reused, not the evicted prompt's user message.
    assert len(calls) == 1 and calls[0].startswith("<|im_start|>user\nfirst first")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.lists(st.sampled_from([*_PIECES, "Ġ", "\x00", "ﬁ", "e\u0301"]), max_size=40))
def test_the_frontends_encoder_gives_the_tokenizers_ids(text: list[str]) -> None:
    # The frontend encodes through the tokenizers backend's batch call (it releases the GIL).
    served = _served()
    preprocessor = ChatPreprocessor(served, ChatOptions(policy=MediaPolicy()))
    joined = "".join(text)
    assert preprocessor.encoder.encode(joined) == _encode(joined)


def test_encoding_a_long_prompt_leaves_other_threads_running() -> None:
    preprocessor = ChatPreprocessor(_served(), ChatOptions(policy=MediaPolicy()))
    text = "the quick brown fox jumps over the lazy dog " * 8000  # 100 ms or more to encode
    started, done = threading.Event(), threading.Event()

    def encode() -> None:
        started.set()
        preprocessor.encoder.encode(text)
        done.set()

    worker = threading.Thread(target=encode)
    worker.start()
    started.wait()
    turns = 0
    while not done.is_set():
        turns += 1
    worker.join()
    # An encoder holding the GIL (the tokenizers backend's plain `encode` does) would let this
    # loop run only once it had finished.
    assert turns > 1000, turns
