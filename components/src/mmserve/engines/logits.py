"""The logits step: rows of logits (one per choice of a request, as one batch) through a chain
of processors to the chosen tokens, and the log-probabilities read from them. Every processor
works on the last dimension, on one row or many. The order and the formulas are vLLM's
sampler's:

0. a grammar's token mask (structured outputs: `mmserve.grammar`), on the model's logits, as
   vLLM applies it before its sampler: a token the grammar forbids is never chosen, and the
   log-probabilities are those of the masked logits;
1. the log-probabilities, of the model's own distribution (vLLM's "raw" logprobs mode);
2. ids that may not come yet (a stop id before `min_tokens`) and `logit_bias`;
3. the penalties: repetition over the prompt's and the completion's ids, frequency and
   presence over the completion's;
4. greedy: the argmax; else temperature, `min_p`, `top_k`, `top_p`, and a draw.

A draw's randomness comes from (seed, choice, token index) alone, so whichever worker samples a
token (the prefill its first, a decode worker the rest) draws what an aggregated one would.
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
from collections.abc import Collection, Sequence

import torch

from mmserve.engines.defaults import LogprobsMode
from mmserve.grammar.constraint import Constraint
from mmserve.grammar.mask import apply_bitmask, new_bitmask
from mmserve.protocol import SamplingParams, TokenLogprob

NEG_INF = float("-inf")

UNLIKELY = -9999.0  # OpenAI's value for a token without probability (JSON has no -inf)


def ban(logits: torch.Tensor, ids: Collection[int], spared: Sequence[int] = ()) -> torch.Tensor:
    """`logits` with `ids` (those inside the vocabulary) never chosen, but in the rows
    `spared`."""
    inside = [i for i in ids if 0 <= i < logits.shape[-1]]
    if not inside:
        return logits
    banned = logits.index_fill(-1, torch.tensor(inside, device=logits.device), NEG_INF)
    if spared:
        banned[list(spared)] = logits[list(spared)]
    return banned


def apply_grammars(
    logits: torch.Tensor, constraints: Sequence[Constraint | None], banned: Collection[int]
) -> tuple[torch.Tensor, list[int]]:
    """Each row of `logits` masked by its choice's grammar (None: free), and the rows whose
    grammar allows nothing but its end: there the ids `banned` (stop ids before
    `min_tokens`) give way, so a complete grammar ends the choice."""
    bitmask = new_bitmask(len(constraints), logits.shape[-1])
    rows: list[int] = []
    ending: list[int] = []
    for row, constraint in enumerate(constraints):
        if constraint is not None and constraint.fill(bitmask, row):
            rows.append(row)
            if banned and constraint.only_end(bitmask[row]):
                ending.append(row)
    return (apply_bitmask(logits, bitmask, rows) if rows else logits), ending


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    """OpenAI's `logit_bias`: each value added to its id's logit."""
    if not bias:
        return logits
    ids = torch.tensor(list(bias), device=logits.device)
    values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
    return logits.index_add(-1, ids, values.expand(*logits.shape[:-1], -1))


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    output_counts: torch.Tensor,
    params: SamplingParams,
) -> torch.Tensor:
    """vLLM's penalties: a repetition penalty divides the positive logits and multiplies the
    negative ones of every id seen in the prompt or the completion; the frequency penalty
    subtracts itself once per occurrence in the completion, the presence penalty once."""
    output_mask = output_counts > 0
    if params.repetition_penalty != 1:
        seen = output_mask if prompt_mask is None else output_mask | prompt_mask
        penalty = params.repetition_penalty
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if params.frequency_penalty:
        logits = logits - params.frequency_penalty * output_counts
    if params.presence_penalty:
        logits = logits - params.presence_penalty * output_mask.to(logits.dtype)
    return logits


def apply_min_p(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop the ids whose probability is under `min_p` times the most likely one's."""
    if min_p <= 0:
        return scores
    probs = torch.softmax(scores, dim=-1)
    return scores.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), NEG_INF)


def apply_top_k(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the `top_k` most likely ids (0: all)."""
    if top_k <= 0 or top_k >= scores.shape[-1]:
        return scores
    kth = torch.topk(scores, top_k).values[..., -1:]
    return scores.masked_fill(scores < kth, NEG_INF)


def apply_top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely ids until their mass reaches `top_p`; the first always stays."""
    if top_p >= 1.0:
        return scores
    sorted_scores, order = torch.sort(scores, descending=True)
    probs = torch.softmax(sorted_scores, dim=-1)
    drop = (probs.cumsum(-1) - probs) >= top_p  # the ids before it already reach top_p
    return scores.scatter(-1, order, sorted_scores.masked_fill(drop, NEG_INF))


def step_seed(seed: int, choice: int, index: int) -> int:
    """The seed of one draw: choice `choice`'s token `index` (from 0) of a `seed`ed stream."""
    digest = hashlib.blake2b(struct.pack("<qqq", seed, choice, index), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


_DRAW_BLOCK = 1024  # ids per block of `draw`'s mass


def draw(probs: torch.Tensor, seeds: Sequence[int]) -> list[int]:
    """One id drawn from each row of `probs` (`[len(seeds), vocab]`, a softmax), its
    randomness all from its seed: the id where one uniform number falls in the row's
    cumulative distribution. One number, not one per id as `torch.multinomial` draws. The
    probabilities are summed by blocks of ids and only the block the number falls in is
    accumulated id by id: one pass over the row, where a cumulative sum of the whole row and a
    search for its last id cost 3x as much (0.3 ms a row of 152k ids on a CPU). Float32, as
    vLLM samples: ids without mass add nothing to the sum, so they are never drawn."""
    rows, vocab = probs.shape
    blocks = -(-vocab // _DRAW_BLOCK)
    if blocks * _DRAW_BLOCK > vocab:  # the last block padded with ids without mass
        probs = torch.nn.functional.pad(probs, (0, blocks * _DRAW_BLOCK - vocab))
    by_block = probs.view(rows, blocks, _DRAW_BLOCK)
    ends = by_block.sum(-1).cumsum(-1)  # the mass up to the end of each block
    starts = torch.nn.functional.pad(ends[:, :-1], (1, 0))
    uniform = [random.Random(seed).random() for seed in seeds]
    targets = torch.tensor(uniform, device=probs.device)[:, None] * ends[:, -1:]
    block = _fall(ends, targets)
    within = by_block[torch.arange(rows, device=probs.device), block].cumsum(-1)
    index = _fall(within, targets - starts.gather(-1, block[:, None]))
    return (block * _DRAW_BLOCK + index).tolist()


def _fall(cumulative: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Where each row's target (`[rows, 1]`) falls in its `cumulative` mass: the first
    position past it; a target rounded up to the whole mass, on the last position with any."""
    index = torch.searchsorted(cumulative, targets, right=True)[:, 0]
    last = (cumulative < cumulative[:, -1:]).sum(-1)
    return torch.minimum(index, last)


_TOP_BLOCK = 1024  # ids per block of `most_likely`'s first pass


def most_likely(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk(scores, k)` over the last dimension, most likely first, in two passes over
    a large vocabulary: each block's best, then the top k of the blocks whose best reaches the
    k-th best of those (with the ids past the last whole block), which hold the top k. On a
    CPU, 0.1 ms for a row of 152k ids where `torch.topk` takes 0.5."""
    k = min(k, scores.shape[-1])
    blocks = scores.shape[-1] // _TOP_BLOCK
    if blocks < max(k, 4):
        return torch.topk(scores, k)
    values, indices = [], []
    for row in scores.reshape(-1, scores.shape[-1]):
        whole = row[: blocks * _TOP_BLOCK].view(blocks, _TOP_BLOCK)
        maxima = whole.amax(-1)
        chosen = torch.nonzero(maxima >= torch.topk(maxima, k).values[-1]).squeeze(-1)
        tail = torch.arange(blocks * _TOP_BLOCK, row.shape[-1], device=row.device)
        ids = torch.cat([(chosen[:, None] * _TOP_BLOCK + torch.arange(_TOP_BLOCK)).flatten(), tail])
        best = torch.topk(row[ids], k)
        values.append(best.values)
        indices.append(ids[best.indices])
    shape = (*scores.shape[:-1], k)
    return torch.stack(values).reshape(shape), torch.stack(indices).reshape(shape)


def read_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], top: int, probs: torch.Tensor | None = None
) -> list[TokenLogprob]:
    """Each token's log-probability and the `top` most likely ids', from its row of logits
    (`[len(tokens), vocab]`), or from `probs`, their softmax, where the caller has it: then
    only the few values read are logged, unless one rounded to 0 (past float32's range), where
    `log_softmax` gives the finite value. `log_softmax` rather than a `logsumexp` to
    subtract: one fused pass, half the time on a CPU."""
    ids = torch.tensor(list(tokens), dtype=torch.long, device=logits.device)[:, None]
    if probs is not None:
        chosen, indices = probs.gather(-1, ids), None
        if top:
            values, indices = most_likely(probs, top)
            chosen = torch.cat([chosen, values], dim=-1)
        if bool((chosen > 0).all()):
            logged = chosen.log()
            return _logprob_rows(tokens, logged[:, 0], logged[:, 1:], indices)
    logprobs = torch.log_softmax(logits, dim=-1)
    values, indices = most_likely(logprobs, top) if top else (logprobs[:, :0], None)
    return _logprob_rows(tokens, logprobs.gather(-1, ids)[:, 0], values, indices)


def _logprob_rows(
    tokens: Sequence[int],
    chosen: torch.Tensor,
    top_values: torch.Tensor,
    top_ids: torch.Tensor | None,
) -> list[TokenLogprob]:
    tops: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if top_ids is not None:
        pairs = zip(top_ids.tolist(), top_values.tolist(), strict=True)
        tops = [list(zip(i, v, strict=True)) for i, v in pairs]
    return [
        TokenLogprob(token_id=token, logprob=value, top=row)
        for token, value, row in zip(tokens, chosen.tolist(), tops, strict=True)
    ]


def read_prompt_logprobs(
    logits: torch.Tensor, next_ids: Sequence[int], top: int
) -> list[TokenLogprob]:
    """Prompt tokens' log-probabilities: row i of `logits` (`[len(next_ids), vocab]`, the
    model's output at a prompt position) scores `next_ids[i]`, the token after that position;
    each with its rank in the row's distribution and the `top` most likely ids'."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(next_ids), dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(-1, ids[:, None])[:, 0]
    ranks = (logprobs > chosen[:, None]).sum(-1) + 1
    tops: list[list[tuple[int, float]]] = [[] for _ in range(len(ids))]
    if top:
        values, indices = most_likely(logprobs, top)
        pairs = zip(indices.tolist(), values.tolist(), strict=True)
        tops = [list(zip(i, v, strict=True)) for i, v in pairs]
    return [
        TokenLogprob(token_id=token, logprob=value, top=row, rank=rank)
        for token, value, rank, row in zip(
            ids.tolist(), chosen.tolist(), ranks.tolist(), tops, strict=True
        )
    ]


class Sampler:
    """One choice's tokens, step after step: the chain's state (the completion's id counts for
    the penalties, the prompt's ids for the repetition penalty, the grammar's matcher where the
    request has one) and the stream's seed (the request's own, else one drawn here, which a
    handover passes on)."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        vocab_size: int,
        device: torch.device,
        seed: int | None = None,
        choice: int = 0,
        logprobs_mode: LogprobsMode = "raw_logprobs",
        constraint: Constraint | None = None,
    ) -> None:
        self.params = params
        # The request's grammar, at this choice's place in it (None: free text).
        self.constraint = constraint
        self.logprobs_mode = logprobs_mode
        self.seed: int = next(
            value for value in (seed, params.seed, random.getrandbits(63)) if value is not None
        )
        self.choice = choice
        self.history: list[int] = []  # the completion's ids so far
        self._prompt_ids = prompt_ids
        self._vocab_size = vocab_size
        self._device = device
        # How often each id came in the completion, for the penalties (None: none asked).
        self.counts = (
            torch.zeros(vocab_size, dtype=torch.float32, device=device)
            if params.penalized
            else None
        )
        self.prompt_mask: torch.Tensor | None = None  # the prompt's ids, for repetition
        if params.repetition_penalty != 1:
            mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            ids = [i for i in prompt_ids if 0 <= i < vocab_size]
            if ids:
                mask[torch.tensor(ids, device=device)] = True
            self.prompt_mask = mask

    @property
    def generated(self) -> int:
        return len(self.history)

    def draw_seed(self) -> int:
        """The seed of this choice's next draw."""
        return step_seed(self.seed, self.choice, self.generated)

    @property
    def grammar_ended(self) -> bool:
        """Whether the choice's grammar ended: nothing may follow."""
        return self.constraint is not None and self.constraint.terminated

    def with_params(self, params: SamplingParams) -> Sampler:
        """This stream (seed, choice, history, grammar) under other sampling parameters of
        the same grammar."""
        if params.grammar != self.params.grammar:
            raise ValueError("a stream keeps the grammar it started with")
        sampler = Sampler(
            params,
            self._prompt_ids,
            self._vocab_size,
            self._device,
            self.seed,
            self.choice,
            self.logprobs_mode,
        )
        for token in self.history:  # the grammar's matcher is at the end of them already
            sampler.observe(token)
        sampler.constraint = self.constraint
        return sampler

    def next(
        self, logits: torch.Tensor, banned: Collection[int] = ()
    ) -> tuple[int, TokenLogprob | None]:
        """The next token from one row of logits (never one of `banned`), with its
        log-probabilities where the request asks for them; the token counts as generated."""
        return next_tokens([self], logits[None], banned)[0]

    def observe(self, token: int) -> None:
        """Count `token` as generated (one sampled elsewhere, such as the prefill's first);
        the grammar advances over it (`GrammarRejected` where it does not follow)."""
        if self.constraint is not None:
            self.constraint.observe(token)
        self.history.append(token)
        if self.counts is not None and 0 <= token < self.counts.shape[-1]:
            self.counts[token] += 1


def next_tokens(
    samplers: Sequence[Sampler], logits: torch.Tensor, banned: Collection[int] = ()
) -> list[tuple[int, TokenLogprob | None]]:
    """The next token of each of one request's choices (`samplers`, on one prompt and one set
    of parameters) from its row of `logits` (`[len(samplers), vocab]`), as one batch, none of
    them `banned`, with its log-probabilities where the request asks for them; each token
    counts as its choice's."""
    logits = logits.float()
    first = samplers[0]
    params = first.params
    spared: list[int] = []
    if params.grammar is not None:
        constraints = [sampler.constraint for sampler in samplers]
        logits, spared = apply_grammars(logits, constraints, banned)
    scores = apply_logit_bias(ban(logits, banned, spared), params.logit_bias)
    counts = [sampler.counts for sampler in samplers]
    if params.penalized and all(each is not None for each in counts):
        stacked = torch.stack([each for each in counts if each is not None])
        scores = apply_penalties(scores, first.prompt_mask, stacked, params)
    probs = None  # the distribution drawn from
    if params.temperature == 0:
        tokens: list[int] = scores.argmax(-1).tolist()
    else:
        if params.temperature != 1.0:  # a pass over the vocabulary saved at the default
            scores = scores / params.temperature
        scores = apply_min_p(scores, params.min_p)
        scores = apply_top_p(apply_top_k(scores, params.top_k), params.top_p)
        probs = torch.softmax(scores, dim=-1)
        tokens = draw(probs, [sampler.draw_seed() for sampler in samplers])
    logprobs: list[TokenLogprob | None] = [None] * len(samplers)
    if params.logprobs is not None:
        source = logits if first.logprobs_mode == "raw_logprobs" else scores
        # Each processor returns its input where it is off: at temperature 1 with nothing
        # else asked, the raw logprobs are of the distribution just drawn from.
        drawn_from = probs if scores is source else None
        read = read_logprobs(source, tokens, params.logprobs, drawn_from)
        logprobs = [_finite(each) for each in read]
    for sampler, token in zip(samplers, tokens, strict=True):
        sampler.observe(token)
    return list(zip(tokens, logprobs, strict=True))


def _finite(logprob: TokenLogprob) -> TokenLogprob:
    """`logprob` with the ids the processing ruled out at `UNLIKELY` rather than -inf."""
    if math.isfinite(logprob.logprob) and all(math.isfinite(value) for _, value in logprob.top):
        return logprob
    return TokenLogprob(
        token_id=logprob.token_id,
        logprob=max(logprob.logprob, UNLIKELY),
        top=[(token, max(value, UNLIKELY)) for token, value in logprob.top],
    )
