"""The checks of a request's sampling, the stop rules of a stream (EOS unless `ignore_eos`,
stop ids, `max_tokens`, and `min_tokens` before which neither ends it: as in vLLM, those ids
are not sampled until then), and the stream itself (the token choice is `engines.logits`)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from tokenizers import Tokenizer

from mmserve.engines.base import EngineError, KvHandle
from mmserve.engines.detokenize import IncrementalDetokenizer
from mmserve.protocol import (
    FinishReason,
    SamplingParams,
    StopConditions,
    TokenChunk,
    TokenLogprob,
    Usage,
)

MAX_LOGPROBS = 20  # OpenAI's limit of top_logprobs
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's frequency and presence penalties
LOGIT_BIAS_RANGE = (-100.0, 100.0)


def check_sampling(params: SamplingParams, stop: StopConditions) -> None:
    """Reject values no engine can honour, with a message a client can act on."""
    if stop.max_tokens < 0:
        raise EngineError(f"max_tokens must be at least 0, got {stop.max_tokens}")
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
    if not 0 <= params.min_p <= 1:
        raise EngineError(f"min_p must lie in [0, 1], got {params.min_p}")
    low, high = PENALTY_RANGE
    for name in ("frequency_penalty", "presence_penalty"):
        if not low <= getattr(params, name) <= high:
            raise EngineError(f"{name} must lie in [{low}, {high}], got {getattr(params, name)}")
    if params.repetition_penalty <= 0:
        raise EngineError(f"repetition_penalty must be > 0, got {params.repetition_penalty}")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise EngineError(f"{name} must lie in [0, {MAX_LOGPROBS}], got {value}")
    low, high = LOGIT_BIAS_RANGE
    for token, bias in params.logit_bias.items():
        if not low <= bias <= high:
            raise EngineError(f"logit_bias[{token}] must lie in [{low}, {high}], got {bias}")


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
    next_token: Callable[[int, frozenset[int]], Awaitable[tuple[int, TokenLogprob | None]]],
) -> AsyncIterator[TokenChunk]:
    """Token chunks from `kv.first_token` on, `next_token(previous, banned)` making each next
    one (never one of `banned`: `StopRules.banned`) with its log-probabilities where the request
    asks for them, until a stop rule ends the completion; the
    last chunk carries the finish reason and usage, the first the prompt's log-probabilities
    (`kv.prompt_logprobs`). Stop strings are cut from the text by the detokenizer, across
    token boundaries; the last chunk also carries the text of tokens that end inside a
    character (the tokenizer's decode of them). With `max_tokens` 0 the request was a prefill
    only: the first token is not emitted, and the one chunk finishes with "length"."""
    usage = functools.partial(Usage, prompt_tokens=kv.prompt_tokens, cached_tokens=kv.cached_tokens)
    prompt_logprobs = kv.prompt_logprobs
    if stop.max_tokens == 0:
        yield TokenChunk(
            request_id=kv.request_id,
            prompt_logprobs=prompt_logprobs,
            finish_reason="length",
            usage=usage(completion_tokens=0),
        )
        return
    rules = StopRules(stop, tuple(eos_token_ids))
    detokenizer = IncrementalDetokenizer(tokenizer, list(stop.stop), stop.min_tokens)
    token, logprob = kv.first_token, kv.first_logprob
    completion_tokens = 0
    while True:
        completion_tokens += 1
        finish = rules.on_token(token, completion_tokens)
        text = ""
        if finish != "stop":  # a stop id that ends the completion has no text
            text = detokenizer.push([token])
            if detokenizer.stopped:
                finish = "stop"
        logprobs = [] if logprob is None else [logprob]
        if finish is None:
            yield TokenChunk(
                request_id=kv.request_id,
                token_ids=[token],
                text=text,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
            prompt_logprobs = []
            token, logprob = await next_token(token, rules.banned(completion_tokens))
            continue
        text += detokenizer.flush()
        if detokenizer.stopped:
            finish = "stop"
        yield TokenChunk(
            request_id=kv.request_id,
            token_ids=[token],
            text=text,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            finish_reason=finish,
            usage=usage(completion_tokens=completion_tokens),
        )
        return
