"""Embedding-cache routing against round robin on the image-heavy chat workload of
`bench/encode_router.py`: four encode workers and one aggregated worker on the mock engine,
multi-turn sessions that resend their images and share a pool of them. Routing by what each
encoder's cache holds must hit that cache far more often than round robin does."""

from __future__ import annotations

from pathlib import Path

from bench import encode_router as bench
from bench.router import ChatWorkload, MockCosts
from mmserve.models.tiny import build_tiny_model

ENCODERS = 4
CONCURRENCY = 2
MIN_HIT_RATE_GAIN = 0.1  # measured: 16 to 21 points


def test_embedding_cache_routing_hits_the_encoder_caches_more_than_round_robin(
    nats_url: str, tmp_path: Path
) -> None:
    workload = ChatWorkload(sessions=12, turns=3, system_prompts=2, images=6, salt=0)
    costs = MockCosts(prefill_us_per_token=0, decode_ms_per_token=0, encode_us_per_token=100)
    model_path = build_tiny_model("qwen2_vl")
    totals = {}
    for mode in ("embedding-cache", "round-robin"):
        deployment, ports = bench.encode_deployment(
            model_path, nats_url, tmp_path, mode, ENCODERS, costs
        )
        measured, totals[mode] = bench.measure_encode(deployment, ports, workload, CONCURRENCY)
        assert len(measured.ttfts) == 12 * 3, mode
    aware, round_robin = totals["embedding-cache"], totals["round-robin"]
    summary = {mode: (t.hits, t.misses) for mode, t in totals.items()}
    # Every run looks up every image of every turn once, whatever the routing.
    assert aware.hits + aware.misses == round_robin.hits + round_robin.misses, summary
    assert aware.hit_rate > round_robin.hit_rate + MIN_HIT_RATE_GAIN, summary
    assert aware.hit_rate <= bench.single_encoder_hit_rate(workload) + 1e-9, summary
