"""SGLang's streamed outputs as mmserve's `TokenChunk`s: each choice's tokens sent once, their
log-probabilities beside them, the prompt's on the stream's first chunk, each choice's finish
reason on its last chunk and the usage on the stream's last.

An output is SGLang's `{"output_ids", "text", "meta_info"}`, each choice in its own stream
(`convert.generate_calls`). By default each output repeats its choice's ids, text and
`meta_info["output_token_logprobs"]` / `["output_top_logprobs"]` so far; with
`--incremental-streaming-output` it holds only what is new (SGLang slices those two lists by
the same offset as the ids). `meta_info["input_token_logprobs"]` (and `input_top_logprobs`,
`input_token_ids_logprobs`) hold every prompt position from `logprob_start_len` 0, the
first `(None, id, None)`, and come whole in every output once the prompt is scored. Each
entry is `(logprob, token_id, text)` (text None: `return_text_in_logprobs` is off); a top
list is a position's `top_logprobs_num` most likely entries (None for the first position).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mmserve.engines.base import EngineError, EngineRequest
from mmserve.engines.logits import UNLIKELY
from mmserve.engines.sglang.convert import finish_reason
from mmserve.protocol import FinishReason, TokenChunk, TokenLogprob, Usage

Entry = Sequence[Any]
"""One of SGLang's log-probability entries: `(logprob, token_id, text)`."""


def logprob_value(value: Any) -> float:
    """A log-probability as mmserve sends it: SGLang's -inf (or its clamp at the float's
    minimum) and NaN as `logits.UNLIKELY`, as the hf engine sends ids ruled out (JSON has no
    -inf)."""
    if value is None or not float(value) > UNLIKELY:
        return UNLIKELY
    return float(value)


def top_list(entries: Sequence[Entry] | None) -> list[tuple[int, float]]:
    """A position's top entries as (id, logprob), most likely first (a stable sort: SGLang's
    own order among equal values)."""
    pairs = [(int(entry[1]), logprob_value(entry[0])) for entry in entries or ()]
    return sorted(pairs, key=lambda pair: -pair[1])


def rank_in(value: float, top: Sequence[tuple[int, float]]) -> int | None:
    """The 1-based rank of a log-probability in its position's distribution, as the hf
    engine counts it (1 + the ids strictly more likely), where the top list decides it: the
    value is at least the list's last, so every more likely id is in the list. None where it
    is not (SGLang returns no ranks)."""
    if not top or value < top[-1][1]:
        return None
    return 1 + sum(other > value for _, other in top)


def prompt_logprobs(request: EngineRequest, meta: dict[str, Any]) -> list[TokenLogprob] | None:
    """The prompt's log-probabilities from an output's `meta_info`, one per prompt token after
    the first (the hf engine's convention), with each position's `prompt_logprobs` most
    likely ids and its rank where the top list decides it; None until SGLang has scored the
    prompt. The token ids are the request's: SGLang reports a media position's as 0 (its pad
    value, clipped) and scores the pad value there, so a media position's log-probability is
    its placeholder id's from `input_token_ids_logprobs` (`convert.logprob_kwargs` asks for
    it)."""
    entries = meta.get("input_token_logprobs") or []
    if not entries:
        return None
    ids = request.token_ids
    if len(entries) != len(ids):
        raise EngineError(
            f"SGLang scored {len(entries)} prompt positions of {len(ids)} (logprob_start_len 0)"
        )
    tops = meta.get("input_top_logprobs") or [None] * len(ids)
    placeholders = meta.get("input_token_ids_logprobs") or [None] * len(ids)
    media = {p for item in request.media for p in range(item.offset, item.end)}
    keep = request.sampling.prompt_logprobs or 0
    found = []
    for position in range(1, len(ids)):
        token = ids[position]
        top = top_list(tops[position])
        if position in media:
            scored = {int(e[1]): e[0] for e in placeholders[position] or ()}
            if token not in scored:
                raise EngineError(f"SGLang did not score placeholder id {token} at {position}")
            value = logprob_value(scored[token])
        else:
            value = logprob_value(entries[position][0])
        found.append(
            TokenLogprob(token_id=token, logprob=value, top=top[:keep], rank=rank_in(value, top))
        )
    return found


@dataclass
class _Choice:
    sent_ids: int = 0
    sent_text: str = ""
    finish: FinishReason | None = None
    meta: dict[str, Any] | None = None


class SglangStream:
    """One request's outputs, choice by choice, as `TokenChunk`s (`read`); `done` once every
    choice has finished. The usage counts the prompt once, as SGLang's own OpenAI server
    does: choice 0's prompt and cached tokens, every choice's completion tokens."""

    def __init__(self, request: EngineRequest, choices: int, *, incremental: bool) -> None:
        self.request = request
        self.incremental = incremental
        self.choices = [_Choice() for _ in range(choices)]
        self.prompt_pending = request.sampling.prompt_logprobs is not None
        self.prompt: list[TokenLogprob] = []

    @property
    def done(self) -> bool:
        return all(choice.finish is not None for choice in self.choices)

    def read(self, index: int, out: dict[str, Any]) -> TokenChunk | None:
        """The chunk of choice `index`'s output `out`: its new tokens (None when it has none
        and does not finish)."""
        if not 0 <= index < len(self.choices):
            raise EngineError(f"SGLang streamed choice {index} of {len(self.choices)}")
        choice = self.choices[index]
        ids = list(out.get("output_ids") or ())
        text = out.get("text") or ""
        meta = out.get("meta_info") or {}
        if self.incremental:  # --incremental-streaming-output: outputs are deltas
            new_ids, new_text, start = ids, text, 0
            choice.sent_ids += len(ids)
        else:  # SGLang's default: each output repeats everything so far
            start = choice.sent_ids
            new_ids, new_text = ids[start:], text[len(choice.sent_text) :]
            choice.sent_ids, choice.sent_text = len(ids), text
        logprobs = self._logprobs(new_ids, start, meta)
        if self.prompt_pending and not self.prompt:
            self.prompt = prompt_logprobs(self.request, meta) or []
        finish = meta.get("finish_reason")
        if finish is None and not new_ids:
            return None
        prompt: list[TokenLogprob] = []
        if self.prompt_pending and self.prompt:  # the stream's first chunk
            prompt, self.prompt_pending = self.prompt, False
        if finish is not None:
            choice.finish, choice.meta = finish_reason(finish), meta
        return TokenChunk(
            request_id=self.request.request_id,
            token_ids=new_ids,
            text=new_text,
            finish_reason=choice.finish if finish is not None else None,
            usage=self._usage() if finish is not None and self.done else None,
            logprobs=logprobs,
            index=self.request.first_choice + index,
            prompt_logprobs=prompt,
        )

    def _logprobs(self, ids: list[int], start: int, meta: dict[str, Any]) -> list[TokenLogprob]:
        """The new tokens' log-probabilities (`ids`, from position `start` of the lists SGLang
        sent), where the request asks for them."""
        top = self.request.sampling.logprobs
        if top is None or not ids:
            return []
        entries = (meta.get("output_token_logprobs") or [])[start : start + len(ids)]
        tops = (meta.get("output_top_logprobs") or [])[start : start + len(ids)]
        if len(entries) != len(ids):
            raise EngineError(f"SGLang sent {len(entries)} logprobs for {len(ids)} tokens")
        tops += [None] * (len(ids) - len(tops))
        return [
            TokenLogprob(token_id=token, logprob=logprob_value(entry[0]), top=top_list(row)[:top])
            for token, entry, row in zip(ids, entries, tops, strict=True)
        ]

    def _usage(self) -> Usage:
        """As SGLang counts, but for a resumed completion's tokens so far, which SGLang read
        as prompt and the client as completion."""
        first = self.choices[0].meta or {}
        resumed = len(self.request.resumed_ids)
        prompt = int(first.get("prompt_tokens", len(self.request.token_ids))) - resumed
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=resumed
            + sum(
                int((choice.meta or {}).get("completion_tokens", choice.sent_ids))
                for choice in self.choices
            ),
            cached_tokens=min(prompt, int(first.get("cached_tokens", 0))),
        )
