"""The logits step: each processor against a direct implementation of vLLM's formulas, the
log-probabilities against log_softmax, and the per-step seeds across a handover."""

from __future__ import annotations

import random

import pytest
import torch

from mmserve.engines.logits import (
    UNLIKELY,
    Sampler,
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    ban,
    draw,
    most_likely,
    next_tokens,
    step_seed,
)
from mmserve.protocol import SamplingParams

CPU = torch.device("cpu")
VOCAB = 64


def vllm_penalties(
    logits: torch.Tensor,
    prompt_ids: list[int],
    output_ids: list[int],
    repetition: float,
    frequency: float,
    presence: float,
) -> torch.Tensor:
    """vLLM's `apply_penalties` (model_executor/layers/utils.py), for one row."""
    vocab = logits.shape[-1]
    prompt_mask = torch.bincount(torch.tensor(prompt_ids, dtype=torch.long), minlength=vocab) > 0
    counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab)
    output_mask = counts > 0
    penalties = torch.full((vocab,), repetition)
    penalties[~(prompt_mask | output_mask)] = 1.0
    logits = torch.where(logits > 0, logits / penalties, logits * penalties)
    logits = logits - frequency * counts
    return logits - presence * output_mask


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    ("repetition", "frequency", "presence"),
    [(1.0, 0.0, 0.0), (1.3, 0.0, 0.0), (0.7, 0.5, -0.4), (1.0, -2.0, 2.0), (2.0, 1.1, 0.3)],
)
def test_penalties_equal_vllms_formulas(seed, repetition, frequency, presence):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, generator=generator) * 4
    prompt = torch.randint(0, VOCAB, (20,), generator=generator).tolist()
    output = torch.randint(0, VOCAB, (15,), generator=generator).tolist()
    params = SamplingParams(
        repetition_penalty=repetition, frequency_penalty=frequency, presence_penalty=presence
    )
    counts = torch.bincount(torch.tensor(output), minlength=VOCAB).float()
    prompt_mask = torch.bincount(torch.tensor(prompt), minlength=VOCAB) > 0
    ours = apply_penalties(logits, prompt_mask, counts, params)
    expected = vllm_penalties(logits, prompt, output, repetition, frequency, presence)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    # The sampler's own counts, made token by token, give the same.
    sampler = Sampler(params, prompt, VOCAB, CPU)
    for token in output:
        sampler.observe(token)
    greedy = SamplingParams(
        temperature=0.0,
        repetition_penalty=repetition,
        frequency_penalty=frequency,
        presence_penalty=presence,
    )
    assert sampler.with_params(greedy).next(logits)[0] == int(torch.argmax(expected))


def test_logit_bias_adds_to_its_ids_and_can_force_or_forbid_a_token():
    logits = torch.zeros(VOCAB)
    biased = apply_logit_bias(logits, {3: 100.0, 5: -100.0, 7: 0.5})
    assert biased[3] == 100 and biased[5] == -100 and biased[7] == 0.5
    assert biased.count_nonzero() == 3
    for seed in range(20):
        params = SamplingParams(temperature=1.0, seed=seed, logit_bias={11: 100.0})
        assert Sampler(params, [], VOCAB, CPU).next(torch.randn(VOCAB))[0] == 11
    params = SamplingParams(temperature=0.0, logit_bias={int(torch.argmax(logits + 1)): -100.0})
    row = torch.arange(VOCAB, dtype=torch.float32)
    assert Sampler(params, [], VOCAB, CPU).next(row)[0] == VOCAB - 1
    params = SamplingParams(temperature=0.0, logit_bias={VOCAB - 1: -100.0})
    assert Sampler(params, [], VOCAB, CPU).next(row)[0] == VOCAB - 2


def test_ban_leaves_ids_outside_the_vocabulary_alone():
    row = torch.arange(4, dtype=torch.float32)
    assert ban(row, {3, 99}).tolist() == [0, 1, 2, float("-inf")]
    assert ban(row, {-1, 4}) is row


def test_min_p_drops_what_is_under_its_share_of_the_most_likely():
    scores = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = apply_min_p(scores, 0.2)  # under 0.1 goes
    assert torch.isfinite(kept).tolist() == [True, True, True, False]


def test_logprobs_are_the_models_own_distribution_whatever_the_sampling():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(VOCAB, generator=generator) * 3
    expected = torch.log_softmax(logits, dim=-1)
    for params in (
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=1.0, seed=1, logprobs=5),  # read from the draw's softmax
        SamplingParams(temperature=0.3, top_k=3, seed=1, logprobs=5),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=0),
    ):
        token, logprob = Sampler(params, [1, 2], VOCAB, CPU).next(logits)
        assert logprob is not None and logprob.token_id == token
        assert logprob.logprob == pytest.approx(float(expected[token]), abs=1e-6)
        assert len(logprob.top) == params.logprobs
        values = [value for _, value in logprob.top]
        assert values == sorted(values, reverse=True)
        for other, value in logprob.top:
            assert value == pytest.approx(float(expected[other]), abs=1e-6)
    token, logprob = Sampler(SamplingParams(temperature=0.0, logprobs=3), [], VOCAB, CPU).next(
        logits
    )
    assert logprob is not None and logprob.top[0][0] == token  # greedy: the top alternative
    assert Sampler(SamplingParams(), [], VOCAB, CPU).next(logits)[1] is None


def test_logprobs_past_float32s_range_of_probabilities_stay_finite():
    """At temperature 1 the logprobs come from the draw's probabilities; an alternative whose
    probability rounds to 0 there still gets its log_softmax value, not -inf."""
    logits = torch.full((VOCAB,), -200.0)
    logits[3], logits[5] = 10.0, -150.0
    params = SamplingParams(temperature=1.0, seed=1, logprobs=2)
    token, logprob = Sampler(params, [], VOCAB, CPU).next(logits)
    expected = torch.log_softmax(logits, dim=-1)
    assert token == 3 and logprob is not None
    assert logprob.top[1] == (5, pytest.approx(float(expected[5]), abs=1e-4))


def rows(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(VOCAB, generator=generator) for _ in range(count)]


def tokens(sampler: Sampler, logits: list[torch.Tensor]) -> list[int]:
    return [sampler.next(row)[0] for row in logits]


def test_a_seed_draws_the_same_tokens_and_a_handover_continues_them():
    logits = rows(12)
    params = SamplingParams(temperature=1.0, seed=1234, frequency_penalty=0.5)
    whole = tokens(Sampler(params, [], VOCAB, CPU), logits)
    assert whole == tokens(Sampler(params, [], VOCAB, CPU), logits)
    # The prefill draws the first token; a decode worker takes over from its seed and token.
    first = Sampler(params, [], VOCAB, CPU).next(logits[0])[0]
    decode = Sampler(params, [], VOCAB, CPU)
    decode.observe(first)
    assert [first, *tokens(decode, logits[1:])] == whole
    other = SamplingParams(temperature=1.0, seed=1235, frequency_penalty=0.5)
    assert tokens(Sampler(other, [], VOCAB, CPU), logits) != whole
    # Without a seed of its own, a stream draws one, which the handover passes on.
    unseeded = Sampler(SamplingParams(temperature=1.0), [], VOCAB, CPU)
    again = Sampler(SamplingParams(temperature=1.0), [], VOCAB, CPU, seed=unseeded.seed)
    assert tokens(unseeded, logits) == tokens(again, logits)


def test_a_draw_follows_the_distribution_and_never_picks_a_banned_id():
    scores = torch.tensor([0.0, 1.0, 2.0, float("-inf"), 0.5, float("-inf")])
    probs = torch.softmax(scores, dim=-1)
    draws = 20_000
    counts = torch.bincount(
        torch.tensor(draw(probs.expand(draws, -1), [step_seed(3, 0, i) for i in range(draws)])),
        minlength=6,
    )
    assert counts[3] == counts[5] == 0
    # Each id's share within five standard deviations of its probability.
    spread = 5 * torch.sqrt(probs * (1 - probs) / draws)
    assert torch.all((counts / draws - probs).abs() <= spread + 1e-9), counts
    assert draw(probs[None], [11]) == draw(probs[None], [11])
    # The last id with any mass is reachable, and one id alone is always drawn.
    assert draw(torch.tensor([[0.0, 1.0]]), [5]) == [1]
    assert set(draw(torch.ones(20, 1), list(range(20)))) == {0}


@pytest.mark.parametrize("vocab", [1024, 3000, 151_936])
def test_a_draw_by_blocks_picks_the_id_of_the_whole_rows_cumulative_sum(vocab: int) -> None:
    """The block sums lead to the id a cumulative sum over the whole row finds for the same
    number, whether the mass is spread, in one block or past the last whole block."""
    generator = torch.Generator().manual_seed(vocab)
    rows = torch.randn(64, vocab, generator=generator) * 4
    rows[1, :] = float("-inf")
    rows[1, vocab // 2] = 0.0  # one id with any mass, in a middle block
    rows[2, : vocab - 7] = float("-inf")  # the mass only in the last few ids
    rows[3, 1:] = float("-inf")  # only the first
    seeds = [step_seed(5, 0, i) for i in range(len(rows))]
    cumulative = torch.softmax(rows, dim=-1).cumsum(-1)
    uniform = torch.tensor([random.Random(seed).random() for seed in seeds])[:, None]
    whole_row = torch.searchsorted(cumulative, uniform * cumulative[:, -1:], right=True)[:, 0]
    last = (cumulative < cumulative[:, -1:]).sum(-1)
    drawn = draw(torch.softmax(rows, dim=-1), seeds)
    assert drawn == torch.minimum(whole_row, last).tolist()
    assert drawn[1] == vocab // 2 and drawn[2] >= vocab - 7 and drawn[3] == 0


def test_processed_logprobs_are_of_the_distribution_drawn_from():
    """`--logprobs-mode processed_logprobs`: after the bias and the temperature; an id top_k
    rules out reads UNLIKELY (JSON has no -inf)."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(VOCAB, generator=generator) * 3
    params = SamplingParams(temperature=0.5, top_k=3, seed=2, logprobs=5, logit_bias={7: 30.0})
    sampler = Sampler(params, [], VOCAB, CPU, logprobs_mode="processed_logprobs")
    token, logprob = sampler.next(logits)
    biased = logits.clone()
    biased[7] += 30.0
    kept = torch.topk(biased, 3).indices
    processed = torch.full_like(logits, float("-inf"))
    processed[kept] = biased[kept] / 0.5
    expected = torch.log_softmax(processed, dim=-1)
    assert logprob is not None and token in kept.tolist()
    assert logprob.logprob == pytest.approx(float(expected[token]), abs=1e-5)
    assert [other for other, _ in logprob.top[:3]] == kept.tolist()
    assert [value for _, value in logprob.top[3:]] == [UNLIKELY, UNLIKELY]


@pytest.mark.parametrize("vocab", [5, 5000, 151_936])
def test_most_likely_is_torch_topk(vocab: int) -> None:
    generator = torch.Generator().manual_seed(vocab)
    rows = torch.randn(3, vocab, generator=generator)
    rows[0, -1] = 50.0  # past the last whole block
    rows[1, :] = float("-inf")
    rows[1, 3] = 0.0  # one id with any mass, the rest tied
    for k in (1, 5, 20):
        values, indices = most_likely(rows, k)
        expected = torch.topk(rows, min(k, vocab))
        assert torch.equal(values, expected.values)
        assert torch.equal(indices[[0, 2]], expected.indices[[0, 2]])  # row 1's ties: any order
        assert indices[1, 0] == 3 and torch.equal(rows[1, indices[1]], expected.values[1])
    assert int(most_likely(rows[0], 1)[1][0]) == vocab - 1


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.8, min_p=0.05, seed=4, logprobs=2),
        SamplingParams(
            temperature=1.2,
            seed=9,
            frequency_penalty=0.7,
            presence_penalty=0.2,
            repetition_penalty=1.3,
            logit_bias={5: 4.0, 9: -100.0},
        ),
    ],
)
def test_a_batch_of_choices_draws_what_each_would_alone(params: SamplingParams) -> None:
    batch = [Sampler(params, [1, 2, 3], VOCAB, CPU, seed=7, choice=i) for i in range(3)]
    alone = [Sampler(params, [1, 2, 3], VOCAB, CPU, seed=7, choice=i) for i in range(3)]
    steps = [torch.stack(rows(3)) + step for step in range(6)]
    for logits in steps:
        together = next_tokens(batch, logits, banned={11})
        for row, sampler, (token, logprob) in zip(logits, alone, together, strict=True):
            own_token, own_logprob = sampler.next(row, {11})
            assert token == own_token != 11
            if params.logprobs is not None:
                assert logprob is not None and own_logprob is not None
                assert logprob.logprob == pytest.approx(own_logprob.logprob, abs=1e-6)
                assert [i for i, _ in logprob.top] == [i for i, _ in own_logprob.top]
    assert [s.history for s in batch] == [s.history for s in alone]
    if params.temperature > 0:
        assert len({tuple(s.history) for s in batch}) > 1  # choices draw their own


def test_step_seeds_differ_by_seed_choice_and_index():
    seeds = {step_seed(s, c, i) for s in (-1, 0, 1) for c in range(3) for i in range(50)}
    assert len(seeds) == 3 * 3 * 50
    assert all(0 <= seed < 2**63 for seed in seeds)
