"""Command-line options every worker shares, and the services they build."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mmserve.engines.defaults import (
    DEFAULT_CACHE_BLOCKS,
    DEFAULT_DECODE_MS_PER_TOKEN,
    DEFAULT_ENCODE_US_PER_TOKEN,
    DEFAULT_MAX_QUEUE,
    DEFAULT_PREFILL_US_PER_TOKEN,
    LOGPROBS_MODES,
)
from mmserve.grammar.defaults import add_grammar_arguments
from mmserve.kv.hashing import add_block_size_argument
from mmserve.kv.pad import PadScheme, add_pad_scheme_argument
from mmserve.observability.metrics import export_encoder_cache, serve_metrics
from mmserve.runtime import Runtime
from mmserve.runtime.lifetime import add_drain_timeout_argument
from mmserve.topology import KV_CACHING_ROLES, Role
from mmserve.transfer import add_transfer_arguments, create_transfer_agent
from mmserve.worker.publishers import (
    EncoderEventPublisher,
    KvEventPublisher,
    publish_encoder_events,
    publish_kv_events,
)

if TYPE_CHECKING:
    from mmserve.engines.base import Engine
    from mmserve.transfer import TransferAgent

log = logging.getLogger(__name__)

ENGINES = ("hf", "mock", "sglang")


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of every worker."""
    parser.add_argument(
        "--model-path",
        default=None,
        help="checkpoint dir of the model (default: the trained tiny Qwen2-VL, built if missing)",
    )
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="hf",
        help="inference engine: hf (transformers), mock (no model, simulated timing, for "
        "routing at scale) or sglang (SGLang on GPUs; its own flags go after --) (default: hf)",
    )
    parser.add_argument("--device", default="cpu", help="torch device for the hf engine")
    parser.add_argument(
        "--logprobs-mode",
        choices=LOGPROBS_MODES,
        default="raw_logprobs",
        help="hf engine: the log-probabilities requests get, of the model's own distribution "
        "(raw_logprobs) or of the one each token is drawn from, after logit_bias, the penalties, "
        "temperature, min_p, top_k and top_p (processed_logprobs); vLLM's option "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--namespace",
        default=os.environ.get("MMSERVE_NAMESPACE", "mmserve"),
        help="deployment namespace on NATS (default: $MMSERVE_NAMESPACE or mmserve)",
    )
    add_block_size_argument(parser)
    add_pad_scheme_argument(parser)
    parser.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help="requests admitted by the engine at once; more answer 503 (default: %(default)s)",
    )
    add_drain_timeout_argument(parser, "requests in flight")
    add_grammar_arguments(parser, "a grammar (hf and mock engines) compiling")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus /metrics on this port (default: 0, off)",
    )
    mock = parser.add_argument_group("mock engine")
    mock.add_argument(
        "--mock-prefill-us-per-token",
        type=float,
        default=DEFAULT_PREFILL_US_PER_TOKEN,
        metavar="US",
        help="simulated prefill time per uncached prompt token "
        f"(default: {DEFAULT_PREFILL_US_PER_TOKEN:g})",
    )
    mock.add_argument(
        "--mock-decode-ms-per-token",
        type=float,
        default=DEFAULT_DECODE_MS_PER_TOKEN,
        metavar="MS",
        help=f"simulated time per decoded token (default: {DEFAULT_DECODE_MS_PER_TOKEN:g})",
    )
    mock.add_argument(
        "--mock-encode-us-per-token",
        type=float,
        default=DEFAULT_ENCODE_US_PER_TOKEN,
        metavar="US",
        help="simulated vision-tower time per image token "
        f"(default: {DEFAULT_ENCODE_US_PER_TOKEN:g})",
    )
    mock.add_argument(
        "--mock-cache-blocks",
        type=int,
        default=DEFAULT_CACHE_BLOCKS,
        metavar="N",
        help=f"prefix cache budget in KV blocks (default: {DEFAULT_CACHE_BLOCKS})",
    )
    parser.add_argument(
        "sglang_args",
        nargs=argparse.REMAINDER,
        metavar="-- SGLANG_FLAGS",
        help="with --engine sglang: SGLang's own flags after --, e.g. -- --tp 2 "
        "--mem-fraction-static 0.8 (see docs/sglang.md)",
    )
    add_transfer_arguments(parser)


def resolve_model_path(args: argparse.Namespace) -> Path:
    if args.model_path:
        path = Path(args.model_path).expanduser()
        if not (path / "config.json").is_file():
            raise SystemExit(f"--model-path {path}: no config.json there")
        return path
    from mmserve.tiny.checkpoints import default_model_path

    return default_model_path()


async def load_engine(args: argparse.Namespace, model_path: Path) -> Engine:
    if args.engine != "sglang" and getattr(args, "sglang_args", None):
        raise SystemExit(f"SGLang flags given without --engine sglang: {args.sglang_args}")
    common = {
        "block_size": args.block_size,
        "max_queue": args.max_queue,
        "pad_scheme": PadScheme(args.pad_scheme),
    }
    if args.engine != "hf" and args.logprobs_mode != "raw_logprobs":
        raise SystemExit(f"--logprobs-mode {args.logprobs_mode} is an hf engine option")
    if args.engine == "hf":
        from mmserve.engines.hf import HfEngine

        return await HfEngine.load(
            model_path,
            device=args.device,
            logprobs_mode=args.logprobs_mode,
            grammar_compile_timeout_s=args.grammar_compile_timeout,
            **common,
        )
    if args.engine == "mock":
        from mmserve.engines.mock import MockEngine

        return await MockEngine.load(
            model_path,
            cache_blocks=args.mock_cache_blocks,
            prefill_us_per_token=args.mock_prefill_us_per_token,
            decode_ms_per_token=args.mock_decode_ms_per_token,
            encode_us_per_token=args.mock_encode_us_per_token,
            grammar_compile_timeout_s=args.grammar_compile_timeout,
            **common,
        )
    if args.engine == "sglang":
        from mmserve.engines.sglang.checks import SglangStartupError
        from mmserve.engines.sglang.engine import SglangEngine

        try:
            return await SglangEngine.load(
                model_path, role=args.role.value, sglang_args=args.sglang_args, **common
            )
        except SglangStartupError as exc:
            raise SystemExit(f"sglang: {exc}") from exc
    raise SystemExit(f"unknown engine {args.engine!r}")


@dataclass
class WorkerServices:
    """What a worker process holds for its whole life."""

    runtime: Runtime
    engine: Engine
    transfer: TransferAgent
    model_path: Path
    kv_events: KvEventPublisher | None = None
    encoder_events: EncoderEventPublisher | None = None

    async def close(self) -> None:
        """Leave discovery first (routers stop choosing this worker at once), stop the cache
        events, finish what is in flight (up to `--drain-timeout`), then close."""
        await self.runtime.leave_discovery()
        if self.kv_events is not None:
            await self.kv_events.stop()
        if self.encoder_events is not None:
            await self.encoder_events.stop()
        await self.runtime.shutdown()
        await self.engine.close()
        await self.transfer.close()


async def start_services(args: argparse.Namespace) -> WorkerServices:
    model_path = resolve_model_path(args)
    transfer = create_transfer_agent(args)
    engine = await load_engine(args, model_path)
    runtime = await Runtime.connect(namespace=args.namespace, graceful_timeout=args.drain_timeout)
    services = WorkerServices(runtime, engine, transfer, model_path)
    if args.role in KV_CACHING_ROLES:
        services.kv_events = await publish_kv_events(runtime, engine, args.role.value)
    if encodes(args):
        services.encoder_events = await publish_encoder_events(runtime, engine, args.role.value)
    export_encoder_cache(args.role.value, runtime.instance_id, engine.encoder_cache_stats)
    serve_metrics(args.metrics_port)
    return services


def encodes(args: argparse.Namespace) -> bool:
    """Whether the worker runs the vision tower: the encode role, or `--encode`."""
    return bool(args.role is Role.ENCODE or getattr(args, "encode", False))
