"""Encode routing on the image-heavy chat workload of `bench/encode_router.py`: four encode
workers and one aggregated worker on the mock engine, multi-turn sessions that resend their
images and share a pool of them. Routing by what each encoder's cache holds must hit that cache
far more often than round robin does; pulling from the peer that holds an image must hit more
often again, where an image a session shows was cached by another encoder.

Every mode runs with `--no-skip-cached-encode`, so every shown image is looked up whatever the
worker's KV cache holds, and the hit rates compare."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from bench import encode_router as bench
from bench.router import ChatWorkload, MockCosts
from mmserve.tiny.checkpoints import build_tiny_model

ENCODERS = 4
# Four sessions at once over 12 images: a session often shows an image another encoder holds.
CONCURRENCY = 4
WORKLOAD = ChatWorkload(sessions=16, turns=3, system_prompts=2, images=12, salt=0)
MIN_HIT_RATE_GAIN = 0.1  # measured: 24 points (49.2% and 73.0%)

Measure = Callable[[str], bench.EncoderTotals]


@pytest.fixture(scope="module")
def measure(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Measure:
    """The encoders' totals of the workload under an `--encode-router-mode`, each mode run once
    per module (on a fresh deployment: cold caches)."""
    costs = MockCosts(prefill_us_per_token=0, decode_ms_per_token=0, encode_us_per_token=100)
    model_path = build_tiny_model("qwen2_vl")
    log_dir = tmp_path_factory.mktemp("encode-workload")
    totals: dict[str, bench.EncoderTotals] = {}

    def run(mode: str) -> bench.EncoderTotals:
        if mode not in totals:
            deployed = bench.encode_deployment(
                model_path, nats_url, log_dir, bench.EncodeMode(mode), ENCODERS, costs
            )
            measured, totals[mode] = bench.measure_encode(deployed, WORKLOAD, CONCURRENCY)
            assert len(measured.ttfts) == WORKLOAD.sessions * WORKLOAD.turns, mode
        return totals[mode]

    return run


def test_embedding_cache_routing_hits_the_encoder_caches_more_than_round_robin(
    measure: Measure,
) -> None:
    aware, round_robin = measure("embedding-cache"), measure("round-robin")
    summary = {"embedding-cache": aware, "round-robin": round_robin}
    # Every run looks up every image of every turn once, whatever the routing.
    assert aware.hits + aware.misses == round_robin.hits + round_robin.misses, summary
    assert aware.hit_rate > round_robin.hit_rate + MIN_HIT_RATE_GAIN, summary
    assert aware.hit_rate <= bench.single_encoder_hit_rate(WORKLOAD) + 1e-9, summary


def test_peer_pull_hits_more_than_embedding_cache_routing(measure: Measure) -> None:
    """A session that shows an image another encoder cached finds its other images on its own
    encoder: embedding-cache routing encodes that image again, peer pull fetches it."""
    aware, pulling = measure("embedding-cache"), measure("peer-pull")
    summary = {"embedding-cache": aware, "peer-pull": pulling}
    assert pulling.pulls > 0 and pulling.failed_pulls <= pulling.pulls // 4, summary
    # No margin: the order in which four sessions at once reach the encoders moves the
    # embedding-cache run's own hit rate by some 5 points (73.0% and 77.8% seen), so a margin
    # of 4 points failed now and then; peer pull measured 81.0% (the one-encoder bound).
    assert pulling.hit_rate > aware.hit_rate, summary
    assert pulling.misses < aware.misses, summary
    assert pulling.hit_rate <= bench.single_encoder_hit_rate(WORKLOAD) + 1e-9, summary
