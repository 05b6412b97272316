"""Prometheus metrics shared by every component, one definition each.

Each metric carries a `component` label (frontend, encode, worker, prefill, decode) so one
scrape configuration covers every process. Workers expose them with `serve_metrics(port)`;
the frontend serves them on its own `/metrics` route via `render()`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip

REQUESTS = Counter("mmserve_requests", "Requests received", ["component"])
ERRORS = Counter("mmserve_errors", "Requests that ended in an error", ["component", "code"])
ACTIVE = Gauge("mmserve_active_requests", "Requests in flight", ["component"])
TTFT = Histogram(
    "mmserve_ttft_seconds", "Time to first token", ["component"], buckets=_LATENCY_BUCKETS
)
ITL = Histogram(
    "mmserve_inter_token_latency_seconds",
    "Time between streamed tokens",
    ["component"],
    buckets=_LATENCY_BUCKETS,
)
STAGE_SECONDS = Histogram(
    "mmserve_stage_seconds",
    "Time spent per pipeline stage (preprocess, encode, transfer, prefill, decode)",
    ["component", "stage"],
    buckets=_LATENCY_BUCKETS,
)
CACHE_LOOKUPS = Counter(
    "mmserve_cache_lookups", "Cache lookups by cache and result", ["component", "cache", "result"]
)

ENCODE_ROUTED_TOKENS = Counter(
    "mmserve_router_encode_tokens",
    "Image tokens the frontend sent to each encode worker, by whether the router expected its "
    "encoder cache to hold them",
    ["worker", "result"],
)


def forget_encoder(worker: str) -> None:
    """Drop the series of an encode worker that left (`ENCODE_ROUTED_TOKENS`), so the
    frontend's label set stays the live encoders however often they restart (each start is a
    new instance id)."""
    for result in ("held", "new"):
        with contextlib.suppress(KeyError):  # never routed to
            ENCODE_ROUTED_TOKENS.remove(worker, result)


PEER_PULLS = Counter(
    "mmserve_encoder_peer_pulls",
    "Embeddings an encode worker pulled from a peer encoder's cache instead of encoding them, "
    "by result (failed: encoded here instead)",
    ["component", "worker", "result"],
)

SKIPPED_ENCODES = Counter(
    "mmserve_encoder_skipped_items",
    "Media items left unencoded because the worker's prefix cache held all their tokens (as "
    "the router or the worker itself found), by result (skipped: the cache served them; "
    "encoded: it had dropped them, so they were encoded after all)",
    ["component", "worker", "result"],
)

MIGRATIONS = Counter(
    "mmserve_migrations",
    "Requests the frontend moved to another instance after the one serving them was lost, by "
    "the lost instance's role and the reason (disconnected: it crashed, lost its connection "
    "or went silent past the idle timeout; unavailable: it stopped at its drain deadline)",
    ["role", "reason"],
)

CONTENT_TYPE = CONTENT_TYPE_LATEST


@contextlib.contextmanager
def timed_stage(component: str, stage: str) -> Iterator[None]:
    """Observe the time the block takes as `stage` of `component` (when it succeeds: a failed
    stage's time says nothing about the stage)."""
    started = time.perf_counter()
    yield
    STAGE_SECONDS.labels(component, stage).observe(time.perf_counter() - started)


def render() -> bytes:
    """The Prometheus text exposition of this process's metrics."""
    return generate_latest(REGISTRY)


def serve_metrics(port: int, host: str = "127.0.0.1") -> None:
    """Expose `/metrics` on its own port (workers; port 0 disables)."""
    if port:
        start_http_server(port, addr=host)


class _EncoderCacheCollector(Collector):
    def __init__(self, component: str, worker: str, stats: Callable[[], tuple[int, int]]) -> None:
        self.component = component
        self.worker = worker
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        hits, misses = self.stats()
        family = CounterMetricFamily(
            "mmserve_encoder_cache_lookups",
            "Encoder (vision tower) cache lookups by result",
            labels=["component", "worker", "result"],
        )
        family.add_metric([self.component, self.worker, "hit"], hits)
        family.add_metric([self.component, self.worker, "miss"], misses)
        yield family


def export_encoder_cache(component: str, worker: str, stats: Callable[[], tuple[int, int]]) -> None:
    """Expose an engine's encoder cache counters (read at scrape time), labelled with the
    worker's instance id (the router's name for it)."""
    REGISTRY.register(_EncoderCacheCollector(component, worker, stats))
