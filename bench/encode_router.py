"""Encode routing: the image-heavy chat workload over several encode workers, round robin
against embedding-cache routing, without and with peer pull (`--encode-router-mode`), and peer
pull with the encode of items the worker's KV cache holds skipped (`--skip-cached-encode`; the
other modes run with `--no-skip-cached-encode`, so that every shown image is looked up).

Multi-turn sessions show images from a shared pool (each turn resends the history, images
included), so an image recurs within a session and across sessions. The deployment is N encode
workers and one aggregated worker, all on the mock engine, whose vision tower costs
`--encode-us-per-token` per image token it computes (an embedding its encoder cache holds costs
nothing; one encode at a time per worker). Per mode: the encoder hit rate (hits / lookups over
every encode worker's `mmserve_encoder_cache_lookups`; a pulled embedding is its holder's hit),
the embeddings pulled from a peer (and the pulls that fell back to encoding), their mean time,
the vision-tower seconds spent (misses x
256 tokens x the cost per token: every image is 448x448), the encode stage's seconds (the
encoders' `encode` stage time, waiting for the tower included), and the mean and p99 time to
first token; with skipping, the items skipped (the worker's
`mmserve_encoder_skipped_items_total`, skipped / encoded after all), which no encoder looks up.
The first row is the bound: the hit rate one encoder holding every embedding would get (each
distinct image missed once, every shown image looked up).

    .venv/bin/python -m bench.encode_router [--quick] [--encoders 4] [--sessions 48]
        [--turns 4] [--images 16] [--encode-us-per-token 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.router import ChatWorkload, Measured, MockCosts, run_workload
from mmserve.runtime.nats_server import nats_url_from_env_or_private
from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.deployment import Deployment, free_port

IMAGE_TOKENS = 256  # a 448x448 image for Qwen2-VL


@dataclass(frozen=True)
class EncodeMode:
    """An `--encode-router-mode`, and whether the frontend skips the encode of the items the
    worker's prefix cache holds."""

    router_mode: str
    skip: bool = False

    @property
    def label(self) -> str:
        return f"{self.router_mode}+skip" if self.skip else self.router_mode

    def frontend_flags(self) -> list[str]:
        skip = "--skip-cached-encode" if self.skip else "--no-skip-cached-encode"
        return ["--encode-router-mode", self.router_mode, skip]


MODES = (
    EncodeMode("round-robin"),
    EncodeMode("embedding-cache"),
    EncodeMode("peer-pull"),
    EncodeMode("peer-pull", skip=True),
)


@dataclass
class EncoderTotals:
    """What the encode workers report, summed over them."""

    hits: int = 0
    misses: int = 0
    pulls: int = 0  # embeddings pulled from a peer encoder
    failed_pulls: int = 0  # pulls that fell back to encoding
    encode_s: float = 0.0
    pull_s: float = 0.0  # the successful pulls' time
    pull_calls: int = 0  # and their number (one per holder and request)
    skipped: int = 0  # items the worker's prefix cache served unencoded
    skipped_encoded: int = 0  # skipped items its cache had dropped, encoded after all
    lookups: list[int] = field(default_factory=list)  # per encode worker

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.hits + self.misses, 1)


@dataclass
class EncodeDeployment:
    deployment: Deployment
    encoder_ports: list[int]  # each encode worker's /metrics
    worker_port: int  # the aggregated worker's


def encode_deployment(
    model_path: Path,
    nats_url: str,
    log_dir: Path,
    mode: EncodeMode,
    encoders: int,
    costs: MockCosts,
) -> EncodeDeployment:
    """`encoders` encode workers and one aggregated worker (each serving /metrics on a port of
    its own) behind a frontend routing by `mode`."""
    ports = [free_port() for _ in range(encoders)]
    worker_port = free_port()
    components = [
        (f"encode{i}", "encode", ["--metrics-port", str(port)]) for i, port in enumerate(ports)
    ]
    deployment = Deployment(
        f"encode-{encoders}-{mode.label}",
        model_path,
        nats_url,
        log_dir,
        frontend_flags=mode.frontend_flags(),
        worker_flags=costs.worker_flags(),
        components=[*components, ("worker", "worker", ["--metrics-port", str(worker_port)])],
    )
    return EncodeDeployment(deployment, ports, worker_port)


def scrape_encoders(ports: list[int]) -> EncoderTotals:
    totals = EncoderTotals()
    for port in ports:
        before = totals.hits + totals.misses
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = sample.labels
                if sample.name == "mmserve_encoder_cache_lookups_total":
                    if labels.get("result") == "hit":
                        totals.hits += int(sample.value)
                    else:
                        totals.misses += int(sample.value)
                elif sample.name == "mmserve_encoder_peer_pulls_total":
                    if labels.get("result") == "ok":
                        totals.pulls += int(sample.value)
                    else:
                        totals.failed_pulls += int(sample.value)
                elif labels.get("component") == "encode" and labels.get("stage") in (
                    "encode",
                    "peer_pull",
                ):
                    if sample.name == "mmserve_stage_seconds_sum":
                        if labels["stage"] == "encode":
                            totals.encode_s += sample.value
                        else:
                            totals.pull_s += sample.value
                    elif sample.name == "mmserve_stage_seconds_count" and (
                        labels["stage"] == "peer_pull"
                    ):
                        totals.pull_calls += int(sample.value)
        totals.lookups.append(totals.hits + totals.misses - before)
    return totals


def scrape_skipped(port: int) -> tuple[int, int]:
    """The worker's skipped items: (served by its prefix cache, encoded after all)."""
    counts = {"skipped": 0, "encoded": 0}
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "mmserve_encoder_skipped_items_total":
                counts[sample.labels["result"]] += int(sample.value)
    return counts["skipped"], counts["encoded"]


def measure_encode(
    deployed: EncodeDeployment, workload: ChatWorkload, concurrency: int
) -> tuple[Measured, EncoderTotals]:
    """Starts the deployment (cold caches), runs `workload`, reads the workers' counters."""
    deployment = deployed.deployment
    with deployment.running():
        model = deployment.model_path.name
        measured = asyncio.run(run_workload(deployment.base_url, model, workload, concurrency))
        totals = scrape_encoders(deployed.encoder_ports)
        totals.skipped, totals.skipped_encoded = scrape_skipped(deployed.worker_port)
        return measured, totals


def single_encoder_hit_rate(workload: ChatWorkload) -> float:
    """The hit rate of one encoder whose cache holds every image: each distinct image misses
    once, every later lookup (a turn resends the history's images) hits."""
    lookups = 0
    seen: set[str] = set()
    for number in range(workload.sessions):
        _, turns = workload.session(number)
        shown: list[str] = []
        for content in turns:
            shown += [part["image_url"]["url"] for part in content if part["type"] == "image_url"]
            lookups += len(shown)
            seen.update(shown)
    return 1 - len(seen) / max(lookups, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller run")
    parser.add_argument("--encoders", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=48)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--images", type=int, default=16, help="images the sessions draw from")
    parser.add_argument("--new-image-rate", type=float, default=0.5)
    parser.add_argument("--concurrency", type=int, default=0, help="default: 2 per encoder")
    parser.add_argument("--encode-us-per-token", type=float, default=1000.0)
    args = parser.parse_args()
    if args.quick:
        args.sessions, args.turns = min(args.sessions, 16), min(args.turns, 3)
    concurrency = args.concurrency or 2 * args.encoders
    costs = MockCosts(
        prefill_us_per_token=100,
        decode_ms_per_token=2,
        encode_us_per_token=args.encode_us_per_token,
    )
    model_path = build_tiny_model("qwen2_vl")
    log_dir = Path(tempfile.mkdtemp(prefix="mmserve-bench-encode-"))

    def workload(salt: int) -> ChatWorkload:
        return ChatWorkload(
            args.sessions, args.turns, 4, args.images, salt, new_image_rate=args.new_image_rate
        )

    print(
        f"workload: {args.sessions} sessions x {args.turns} turns, {args.images} images "
        f"(448x448, 256 tokens), a new image per later turn at {args.new_image_rate:.0%}, "
        f"{concurrency} sessions at once; {args.encoders} encode workers + 1 worker, mock "
        f"vision tower {costs.encode_us_per_token:g} us/token, prefill "
        f"{costs.prefill_us_per_token:g} us/token; logs {log_dir}"
    )
    print(
        f"{'mode':>16} {'enc hit rate':>12} {'pulls':>9} {'pull ms':>8} {'skipped':>8} "
        f"{'tower s':>8} {'stage s':>8} {'TTFT mean':>10} {'TTFT p99':>9}  lookups per encoder"
    )
    print(f"{'one encoder':>16} {single_encoder_hit_rate(workload(0)):>11.1%}")
    with nats_url_from_env_or_private() as nats_url:
        for mode in MODES:
            # The same sessions in every mode; the frontend's media caches start cold anyway.
            deployed = encode_deployment(model_path, nats_url, log_dir, mode, args.encoders, costs)
            measured, totals = measure_encode(deployed, workload(0), concurrency)
            tower_s = totals.misses * IMAGE_TOKENS * costs.encode_us_per_token / 1e6
            pulls = f"{totals.pulls}/{totals.failed_pulls}"
            skipped = f"{totals.skipped}/{totals.skipped_encoded}"
            pull_ms = 1000 * totals.pull_s / max(totals.pull_calls, 1)
            print(
                f"{mode.label:>16} {totals.hit_rate:>11.1%} {pulls:>9} {pull_ms:>8.2f} "
                f"{skipped:>8} {tower_s:>8.2f} {totals.encode_s:>8.2f} "
                f"{measured.ttft_mean_s * 1000:>8.1f}ms {measured.ttft_p99_s * 1000:>7.1f}ms  "
                f"{totals.lookups}",
                flush=True,
            )
    print(f"machine: load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
