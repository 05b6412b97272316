"""KV routing against round robin on the multimodal chat workload of `bench/router.py`: four
mock workers, multi-turn sessions that share system prompts and reuse images. The mock's
prefill time per uncached prompt token dominates the time to first token, so the cached tokens
that kv routing gains show in the mean TTFT as well as in the hit rate."""

from __future__ import annotations

from pathlib import Path

from bench import router as bench
from mmserve.tiny.checkpoints import build_tiny_model

WORKERS = 4
CONCURRENCY = 2  # sessions at once: a session's next turn finds its worker free
MIN_HIT_RATE_GAIN = 0.1


def test_kv_routing_caches_more_and_answers_sooner_than_round_robin(
    nats_url: str, tmp_path: Path
) -> None:
    workload = bench.ChatWorkload(sessions=16, turns=4, system_prompts=4, images=8, salt=0)
    costs = bench.MockCosts(prefill_us_per_token=400, decode_ms_per_token=1)
    model_path = build_tiny_model("qwen2_vl")
    measured = {
        mode: bench.measure(
            bench.mmserve_deployment(model_path, nats_url, tmp_path, mode, WORKERS, costs),
            workload,
            CONCURRENCY,
        )
        for mode in ("kv", "round-robin")
    }
    kv, round_robin = measured["kv"], measured["round-robin"]
    summary = {mode: (m.hit_rate, m.ttft_mean_s, len(m.ttfts)) for mode, m in measured.items()}
    assert len(kv.ttfts) == len(round_robin.ttfts) == 16 * 4, summary
    assert kv.hit_rate > round_robin.hit_rate + MIN_HIT_RATE_GAIN, summary
    assert kv.ttft_mean_s < round_robin.ttft_mean_s, summary
