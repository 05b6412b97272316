"""Token choice and stop rules, on hand-made logits."""

from __future__ import annotations

import pytest
import torch

from mmserve.engines.base import EngineError
from mmserve.engines.logits import Sampler
from mmserve.engines.sampling import StopRules, check_sampling
from mmserve.protocol import SamplingParams, StopConditions

LOGITS = torch.tensor([0.0, 3.0, 2.9, -1.0, 1.0])
CPU = torch.device("cpu")


def sampler(params: SamplingParams) -> Sampler:
    return Sampler(params, [], LOGITS.shape[0], CPU)


def draws(
    params: SamplingParams, count: int = 200, banned: frozenset[int] = frozenset()
) -> set[int]:
    each = sampler(params)
    return {each.next(LOGITS, banned)[0] for _ in range(count)}


def test_greedy_takes_the_argmax():
    assert draws(SamplingParams(temperature=0.0, seed=1)) == {1}


def test_top_k_and_top_p_limit_the_candidates():
    assert draws(SamplingParams(temperature=1.0, top_k=2, seed=0)) == {1, 2}
    # softmax(LOGITS): token 1 ≈ 0.47, token 2 ≈ 0.43; 0.5 is reached only with both.
    assert draws(SamplingParams(temperature=1.0, top_p=0.5, seed=0)) == {1, 2}
    assert draws(SamplingParams(temperature=1.0, top_p=0.3, seed=0)) == {1}
    assert len(draws(SamplingParams(temperature=5.0, seed=0))) == 5


def test_eos_and_stop_ids_end_a_stream_unless_eos_is_ignored():
    rules = StopRules(StopConditions(max_tokens=5, stop_token_ids=[7]), eos_token_ids=(9,))
    assert rules.on_token(9, 1) == "stop"
    assert rules.on_token(7, 1) == "stop"
    assert rules.on_token(3, 4) is None
    assert rules.on_token(3, 5) == "length"
    ignoring = StopRules(StopConditions(max_tokens=5, ignore_eos=True), eos_token_ids=(9,))
    assert ignoring.on_token(9, 1) is None
    assert ignoring.on_token(7, 1) is None


def test_before_min_tokens_no_stop_id_ends_a_stream_or_is_sampled():
    """vLLM's min_tokens: EOS and stop ids are masked for the first min_tokens tokens and end
    nothing there; the next token may be one."""
    rules = StopRules(StopConditions(max_tokens=5, min_tokens=2, stop_token_ids=[7]), (9,))
    assert rules.banned(0) == rules.banned(1) == {7, 9}
    assert rules.banned(2) == frozenset()
    assert rules.on_token(9, 2) is None and rules.on_token(7, 1) is None
    assert rules.on_token(9, 3) == "stop"
    capped = StopRules(StopConditions(max_tokens=2, min_tokens=2), (9,))
    assert capped.on_token(9, 2) == "length"
    # The mask: the best token that is not banned, greedy or sampled; ids past the vocabulary
    # (a client's stop id) are no concern of the logits.
    greedy = SamplingParams(temperature=0.0)
    assert sampler(greedy).next(LOGITS, frozenset({1, 99}))[0] == 2
    params = SamplingParams(temperature=1.0, top_k=2, seed=0)
    assert draws(params, 100, frozenset({1})) == {2, 4}


@pytest.mark.parametrize(
    ("sampling", "stop", "message"),
    [
        (SamplingParams(temperature=-1.0), StopConditions(), "temperature"),
        (SamplingParams(top_p=0.0), StopConditions(), "top_p"),
        (SamplingParams(top_k=-2), StopConditions(), "top_k"),
        (SamplingParams(min_p=1.5), StopConditions(), "min_p"),
        (SamplingParams(frequency_penalty=2.5), StopConditions(), "frequency_penalty"),
        (SamplingParams(presence_penalty=-2.5), StopConditions(), "presence_penalty"),
        (SamplingParams(repetition_penalty=0.0), StopConditions(), "repetition_penalty"),
        (SamplingParams(logprobs=21), StopConditions(), "logprobs"),
        (SamplingParams(logit_bias={3: 101.0}), StopConditions(), "logit_bias"),
        (SamplingParams(), StopConditions(max_tokens=-1), "max_tokens"),
        (SamplingParams(prompt_logprobs=21), StopConditions(), "prompt_logprobs"),
        (SamplingParams(), StopConditions(min_tokens=-1), "min_tokens"),
        (SamplingParams(), StopConditions(max_tokens=4, min_tokens=5), "min_tokens"),
    ],
)
def test_values_no_engine_can_honour_are_rejected(sampling, stop, message):
    with pytest.raises(EngineError, match=message):
        check_sampling(sampling, stop)
