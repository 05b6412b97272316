"""aiperf, the benchmark client Dynamo is measured with, against an aggregated deployment: the
behaviours it relies on keep working (streamed and whole responses, both max-token fields,
ignore_eos, usage, images, multi-turn, fresh connections, the KV cache reset, the readiness
wait, /metrics), with no failed request."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.aiperf import offline_hub, run_aiperf
from tests.support.deployment import Deployment

OUTPUT_TOKENS = 8


@pytest.fixture(scope="module")
def agg(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with Deployment.mock_agg(
        nats_url, tmp_path_factory.mktemp("aiperf-logs")
    ).running() as deployment:
        yield deployment


@pytest.fixture(scope="module")
def hub(agg: Deployment, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return offline_hub(agg.model_path, tmp_path_factory.mktemp("hub"))


FIXED_LENGTHS = [
    "--synthetic-input-tokens-mean", "120", "--synthetic-input-tokens-stddev", "0",
    "--output-tokens-mean", str(OUTPUT_TOKENS), "--output-tokens-stddev", "0",
    "--extra-inputs", "ignore_eos:true",
    "--use-server-token-count",
]  # fmt: skip

# Two runs, each exercising several behaviours (each aiperf run starts a dozen processes).
RUNS = {
    "streamed with an image each, fresh connections, readiness probe and cache reset first": (
        "--streaming --concurrency 8 --request-count 24 --connection-reuse-strategy never "
        "--reset-kv-cache --wait-for-model-timeout 60 --wait-for-model-mode both "
        "--image-width-mean 128 --image-height-mean 96 --image-format jpeg "
        "--batch-size-image 1".split(),
        24,
    ),
    "whole responses, max_tokens, multi-turn": (
        "--concurrency 2 --conversation-num 4 --conversation-turn-mean 3 "
        "--conversation-turn-stddev 0 --use-legacy-max-tokens".split(),
        12,
    ),
}


def _stat(report: dict[str, Any], name: str) -> dict[str, float]:
    return report[name]


@pytest.mark.parametrize("run", list(RUNS))
def test_aiperf_runs_without_a_failed_request(
    agg: Deployment, hub: Path, tmp_path: Path, run: str
) -> None:
    args, requests = RUNS[run]
    report = run_aiperf(agg.base_url, agg.model_path.name, hub, tmp_path, FIXED_LENGTHS + args)
    assert report["error_summary"] == [] and report["request_error_rate"]["avg"] == 0
    assert report["was_cancelled"] is False and report["is_complete"] is True
    assert _stat(report, "request_count")["avg"] == requests
    # ignore_eos and the max-token field: every completion is exactly as long as asked, and
    # the usage the server reported agrees with the tokens streamed.
    osl = _stat(report, "output_sequence_length")
    assert osl["min"] == osl["max"] == OUTPUT_TOKENS
    assert _stat(report, "usage_completion_tokens")["avg"] == OUTPUT_TOKENS
    assert _stat(report, "osl_mismatch_count")["avg"] == 0
    prompts = _stat(report, "usage_prompt_tokens")
    if "multi-turn" in run:
        assert prompts["max"] > prompts["min"]  # each turn resends a longer history
    if "image" in run:
        assert prompts["min"] > 120  # the image's tokens came on top of the text
    scraped = json.loads((tmp_path / "server_metrics_export.json").read_text())
    assert scraped["summary"]["endpoints_successful"] == [f"{agg.base_url}/metrics"]
    assert "mmserve_ttft_seconds" in scraped["metrics"]
    if "--reset-kv-cache" in args:
        assert "caches cleared" in agg.log("worker")
