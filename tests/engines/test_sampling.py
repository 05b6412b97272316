"""Token choice and stop rules, on hand-made logits."""

from __future__ import annotations

import pytest
import torch

from mmserve.engines.base import EngineError
from mmserve.engines.sampling import StopRules, check_sampling, make_generator, sample_token
from mmserve.protocol import SamplingParams, StopConditions

LOGITS = torch.tensor([0.0, 3.0, 2.9, -1.0, 1.0])


def draws(params: SamplingParams, count: int = 200) -> set[int]:
    generator = make_generator(params, torch.device("cpu"))
    return {sample_token(LOGITS, params, generator) for _ in range(count)}


def test_greedy_takes_the_argmax_without_a_random_source():
    params = SamplingParams(temperature=0.0, seed=1)
    assert make_generator(params, torch.device("cpu")) is None
    assert draws(params) == {1}


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
    assert sample_token(LOGITS, greedy, None, frozenset({1, 99})) == 2
    params = SamplingParams(temperature=1.0, top_k=2, seed=0)
    generator = make_generator(params, torch.device("cpu"))
    assert {sample_token(LOGITS, params, generator, {1}) for _ in range(100)} == {2, 4}


@pytest.mark.parametrize(
    ("sampling", "stop", "message"),
    [
        (SamplingParams(temperature=-1.0), StopConditions(), "temperature"),
        (SamplingParams(top_p=0.0), StopConditions(), "top_p"),
        (SamplingParams(top_k=-2), StopConditions(), "top_k"),
        (SamplingParams(), StopConditions(max_tokens=0), "max_tokens"),
        (SamplingParams(), StopConditions(min_tokens=-1), "min_tokens"),
        (SamplingParams(), StopConditions(max_tokens=4, min_tokens=5), "min_tokens"),
    ],
)
def test_values_no_engine_can_honour_are_rejected(sampling, stop, message):
    with pytest.raises(EngineError, match=message):
        check_sampling(sampling, stop)
