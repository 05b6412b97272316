"""The checks of a request's sampling, the stop rules of a stream (EOS unless `ignore_eos`,
stop ids, `max_tokens`, and `min_tokens` before which neither ends it: as in vLLM, those ids
are not sampled until then; a grammar that ended, whatever they say), and the stream itself
(the token choice is `engines.logits`)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import msgspec
from tokenizers import Tokenizer

from mmserve.engines.base import EngineError, KvHandle
from mmserve.engines.detokenize import IncrementalDetokenizer
from mmserve.protocol import (
    FinishReason,
    FirstToken,
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
    if params.n < 1:
        raise EngineError(f"n must be at least 1, got {params.n}")
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


Step = tuple[int, int, frozenset[int]]
"""A choice's next step: (choice index, its previous token, the ids it may not sample; the
same for every choice of a round, which have all made as many tokens)."""

NextTokens = Callable[[list[Step]], Awaitable[list[tuple[int, TokenLogprob | None]]]]
"""The next token of each step (in one call: an engine may batch the choices), with its
log-probabilities where the request asks for them."""

GrammarEnded = Callable[[int], bool]
"""Whether a choice's grammar ended with its current token (a stop token it accepted):
the choice is complete, "stop", even where the stop rules would go on (`ignore_eos`,
`min_tokens`)."""


def _free(choice: int) -> bool:
    del choice
    return False


class _Choice:
    """One choice of a stream: its stop rules, text and token count; a resumed one's start
    after the tokens it had (`resumed`), whose text its instance already sent."""

    def __init__(
        self,
        index: int,
        first: FirstToken,
        stop: StopConditions,
        eos_token_ids: tuple[int, ...],
        tokenizer: Tokenizer,
        grammar_ended: GrammarEnded,
        resumed: Sequence[int] = (),
    ) -> None:
        self.index = index
        self.grammar_ended = grammar_ended
        self.rules = StopRules(stop, eos_token_ids)
        self.detokenizer = IncrementalDetokenizer(
            tokenizer,
            list(stop.stop),
            stop.min_tokens,
            skip_special_tokens=stop.skip_special_tokens,
            include_stop_str_in_output=stop.include_stop_str_in_output,
        )
        # The same pushes as where they were sampled: what they released was sent from there,
        # what they hold back (a stop string's start, a split character) is held here.
        for token in resumed:
            self.detokenizer.push([token])
        self.include_stop = stop.include_stop_str_in_output
        self.token, self.logprob = first.token_id, first.logprob
        self.completion_tokens = len(resumed)
        self.finish: FinishReason | None = None

    def step(self) -> tuple[list[int], str, list[TokenLogprob]]:
        """Take the current token: its ids, text and logprobs; `finish` says whether it ended
        the choice. Stop strings are cut from the text by the detokenizer, across token
        boundaries; the last chunk also carries the text of tokens that end inside a character
        (the tokenizer's decode of them)."""
        self.completion_tokens += 1
        finish = self.rules.on_token(self.token, self.completion_tokens)
        if finish != "stop" and self.grammar_ended(self.index):
            finish = "stop"
        text = ""
        if finish != "stop" or self.include_stop:  # a stop id's text, only if included
            text = self.detokenizer.push([self.token])
            if self.detokenizer.stopped:
                finish = "stop"
        if finish is not None:
            text += self.detokenizer.flush()
            if self.detokenizer.stopped:
                finish = "stop"
        self.finish = finish
        return [self.token], text, [] if self.logprob is None else [self.logprob]

    def next_step(self) -> Step:
        return self.index, self.token, self.rules.banned(self.completion_tokens)


async def stream_completion(
    kv: KvHandle,
    stop: StopConditions,
    eos_token_ids: Sequence[int],
    tokenizer: Tokenizer,
    next_tokens: NextTokens,
    grammar_ended: GrammarEnded = _free,
) -> AsyncIterator[TokenChunk]:
    """Token chunks of every choice from its first token in `kv.first_tokens` on, one round of
    the unfinished choices at a time, `next_tokens` making their next ones (never one of a
    step's banned ids: `StopRules.banned`), until a stop rule or its grammar
    (`grammar_ended`) ends each; a choice's last
    chunk carries its finish reason, the stream's last chunk the usage, and its first the
    prompt's log-probabilities (`kv.prompt_logprobs`). With `max_tokens` 0 the request was a
    prefill only: no first token is emitted, and the one chunk finishes with "length". A
    resumed completion (`kv.resumed`) goes on as its choice, its tokens so far counted in the
    stop rules and the usage's completion, not its prompt."""
    resumed = () if kv.resumed is None else kv.resumed.token_ids
    prompt_tokens = kv.prompt_tokens - len(resumed)
    usage = functools.partial(
        Usage, prompt_tokens=prompt_tokens, cached_tokens=min(kv.cached_tokens, prompt_tokens)
    )
    prompt_logprobs = kv.prompt_logprobs
    if stop.max_tokens == 0:
        yield TokenChunk(
            request_id=kv.request_id,
            prompt_logprobs=prompt_logprobs,
            finish_reason="length",
            usage=usage(completion_tokens=0),
        )
        return
    first_choice = 0 if kv.resumed is None else kv.resumed.choice
    every = [
        _Choice(
            first_choice + i, first, stop, tuple(eos_token_ids), tokenizer, grammar_ended, resumed
        )
        for i, first in enumerate(kv.first_tokens)
    ]
    choices = every
    while True:
        chunks = []
        for choice in choices:
            token_ids, text, logprobs = choice.step()
            chunks.append(
                TokenChunk(
                    request_id=kv.request_id,
                    index=choice.index,
                    token_ids=token_ids,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=choice.finish,
                )
            )
        if prompt_logprobs:
            chunks[0] = msgspec.structs.replace(chunks[0], prompt_logprobs=prompt_logprobs)
            prompt_logprobs = []
        choices = [choice for choice in choices if choice.finish is None]
        if not choices:
            completion_tokens = sum(choice.completion_tokens for choice in every)
            chunks[-1] = msgspec.structs.replace(
                chunks[-1], usage=usage(completion_tokens=completion_tokens)
            )
        for chunk in chunks:
            yield chunk
        if not choices:
            return
        drawn = await next_tokens([choice.next_step() for choice in choices])
        for choice, (token, logprob) in zip(choices, drawn, strict=True):
            choice.token, choice.logprob = token, logprob
