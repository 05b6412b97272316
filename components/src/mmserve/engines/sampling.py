"""Token choice (greedy, temperature, top-k, top-p, seed) and the stop rules of a stream
(EOS unless `ignore_eos`, stop ids, `max_tokens`, and `min_tokens` before which neither ends
it: as in vLLM, those ids are not sampled until then)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence

import torch
from tokenizers import Tokenizer

from mmserve.engines.base import EngineError, KvHandle
from mmserve.engines.detokenize import IncrementalDetokenizer
from mmserve.protocol import FinishReason, SamplingParams, StopConditions, TokenChunk, Usage


def check_sampling(params: SamplingParams, stop: StopConditions) -> None:
    """Reject values no engine can honour, with a message a client can act on."""
    if stop.max_tokens < 1:
        raise EngineError(f"max_tokens must be at least 1, got {stop.max_tokens}")
    if not 0 <= stop.min_tokens <= stop.max_tokens:
        raise EngineError(
            f"min_tokens must lie in [0, max_tokens={stop.max_tokens}], got {stop.min_tokens}"
        )
    if params.temperature < 0:
        raise EngineError(f"temperature must be >= 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise EngineError(f"top_p must lie in (0, 1], got {params.top_p}")
    if params.top_k < 0:
        raise EngineError(f"top_k must be >= 0, got {params.top_k}")


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The stream's random source: seeded when asked, None for greedy."""
    if params.temperature == 0:
        return None
    generator = torch.Generator(device=device)
    seed = params.seed if params.seed is not None else random.getrandbits(63)
    generator.manual_seed(seed)
    return generator


def sample_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    banned: Collection[int] = (),
) -> int:
    """The next token from one row of logits, never one of `banned`."""
    ids = [i for i in banned if 0 <= i < logits.shape[-1]]
    if ids:
        logits = logits.index_fill(0, torch.tensor(ids, device=logits.device), float("-inf"))
    if params.temperature == 0 or generator is None:
        return int(torch.argmax(logits))
    scores = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
        # Drop a token once the tokens before it already reach top_p; the first always stays.
        drop = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= params.top_p
        scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class StopRules:
    """When a stream ends on a token: stop ids, EOS and the token budget; before `min_tokens`
    tokens none of the ids ends it, and `banned` keeps them from being sampled."""

    def __init__(self, stop: StopConditions, eos_token_ids: tuple[int, ...]) -> None:
        self.max_tokens = stop.max_tokens
        self.min_tokens = stop.min_tokens
        self.stop_ids = frozenset(stop.stop_token_ids) | (
            frozenset() if stop.ignore_eos else frozenset(eos_token_ids)
        )

    def banned(self, completion_tokens: int) -> frozenset[int]:
        """The ids the next token may not be, after `completion_tokens` tokens."""
        return self.stop_ids if completion_tokens < self.min_tokens else frozenset()

    def on_token(self, token_id: int, completion_tokens: int) -> FinishReason | None:
        if token_id in self.stop_ids and completion_tokens > self.min_tokens:
            return "stop"
        if completion_tokens >= self.max_tokens:
            return "length"
        return None


async def stream_completion(
    kv: KvHandle,
    stop: StopConditions,
    eos_token_ids: Sequence[int],
    tokenizer: Tokenizer,
    next_token: Callable[[int, frozenset[int]], Awaitable[int]],
) -> AsyncIterator[TokenChunk]:
    """Token chunks from `kv.first_token` on, `next_token(previous, banned)` making each next
    one (never one of `banned`: `StopRules.banned`), until a stop rule ends the completion; the
    last chunk carries the finish reason and usage. Stop strings are cut from the text by the
    detokenizer, across token boundaries; the last chunk also carries the text of tokens that
    end inside a character (the tokenizer's decode of them)."""
    rules = StopRules(stop, tuple(eos_token_ids))
    detokenizer = IncrementalDetokenizer(tokenizer, list(stop.stop), stop.min_tokens)
    token = kv.first_token
    completion_tokens = 0
    while True:
        completion_tokens += 1
        finish = rules.on_token(token, completion_tokens)
        text = ""
        if finish != "stop":  # a stop id that ends the completion has no text
            text = detokenizer.push([token])
            if detokenizer.stopped:
                finish = "stop"
        if finish is None:
            yield TokenChunk(request_id=kv.request_id, token_ids=[token], text=text)
            token = await next_token(token, rules.banned(completion_tokens))
            continue
        text += detokenizer.flush()
        if detokenizer.stopped:
            finish = "stop"
        yield TokenChunk(
            request_id=kv.request_id,
            token_ids=[token],
            text=text,
            finish_reason=finish,
            usage=Usage(
                prompt_tokens=kv.prompt_tokens,
                completion_tokens=completion_tokens,
                cached_tokens=kv.cached_tokens,
            ),
        )
        return
