"""The cache of rendered prompts' token ids: a prompt sent again skips the tokenizer and gets
exactly the ids the tokenizer gives; the budget bounds it."""

from __future__ import annotations

import sys
import threading

import numpy as np

from mmserve.frontend.chat import ChatOptions, ChatPreprocessor, ServedModel
from mmserve.frontend.token_cache import TokenCache
from mmserve.media import MediaPolicy
from mmserve.models.tiny import build_tiny_model
from mmserve.observability import metrics
from mmserve.protocol import ChatCompletionRequest, ChatMessage


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
