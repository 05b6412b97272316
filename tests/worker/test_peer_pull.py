"""When an encoder pulls an embedding from a peer rather than running its vision tower."""

from __future__ import annotations

from mmserve.encode.peer_pull import PULL_FIXED_S, worth_pulling
from mmserve.engines.base import VisionCost


def test_a_pull_is_taken_when_it_costs_less_than_the_tower() -> None:
    slow = VisionCost(seconds_per_token=1e-3, row_bytes=4096)
    assert worth_pulling(256, slow)  # 256 ms of tower against a few ms of transfer
    assert not worth_pulling(1, slow)  # one token's tower time is below the round trip
    free = VisionCost(seconds_per_token=0.0, row_bytes=32)
    assert not worth_pulling(10_000, free)
    assert worth_pulling(1, None)  # an engine that does not know its cost always pulls
    assert PULL_FIXED_S > 0
