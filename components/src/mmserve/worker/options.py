"""Command-line options every worker shares, and the services they build."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from mmserve.engines.base import Engine
from mmserve.media import MediaPolicy
from mmserve.observability.metrics import serve_metrics
from mmserve.runtime import Runtime
from mmserve.transfer import TransferAgent, add_transfer_arguments, create_transfer_agent

log = logging.getLogger(__name__)

ENGINES = ("hf",)


def add_worker_arguments(parser: argparse.ArgumentParser, *, encodes: bool) -> None:
    """The options of every worker; `encodes` adds the media policy (workers that fetch)."""
    parser.add_argument(
        "--model-path",
        default=None,
        help="local Qwen-VL checkpoint dir (default: the tiny Qwen2-VL, built if missing)",
    )
    parser.add_argument("--engine", choices=ENGINES, default="hf", help="inference engine")
    parser.add_argument("--device", default="cpu", help="torch device for the hf engine")
    parser.add_argument(
        "--namespace",
        default=os.environ.get("MMSERVE_NAMESPACE", "mmserve"),
        help="deployment namespace on NATS (default: $MMSERVE_NAMESPACE or mmserve)",
    )
    parser.add_argument(
        "--block-size", type=int, default=16, help="KV block size in tokens (default: 16)"
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests admitted by the engine at once; more answer 503 (default: 64)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus /metrics on this port (default: 0, off)",
    )
    add_transfer_arguments(parser)
    if encodes:
        MediaPolicy.add_cli_args(parser)


def resolve_model_path(args: argparse.Namespace) -> Path:
    if args.model_path:
        path = Path(args.model_path).expanduser()
        if not (path / "config.json").is_file():
            raise SystemExit(f"--model-path {path}: no config.json there")
        return path
    from mmserve.models.tiny import default_model_path

    return default_model_path()


async def load_engine(args: argparse.Namespace, model_path: Path) -> Engine:
    if args.engine == "hf":
        from mmserve.engines.hf import HfEngine

        return await HfEngine.load(
            model_path, device=args.device, block_size=args.block_size, max_queue=args.max_queue
        )
    raise SystemExit(f"unknown engine {args.engine!r}")


@dataclass
class WorkerServices:
    """What a worker process holds for its whole life."""

    runtime: Runtime
    engine: Engine
    transfer: TransferAgent
    model_path: Path

    async def close(self) -> None:
        await self.runtime.shutdown()
        await self.engine.close()
        await self.transfer.close()


async def start_services(args: argparse.Namespace) -> WorkerServices:
    model_path = resolve_model_path(args)
    transfer = create_transfer_agent(args)
    engine = await load_engine(args, model_path)
    runtime = await Runtime.connect(namespace=args.namespace)
    serve_metrics(args.metrics_port)
    return WorkerServices(runtime=runtime, engine=engine, transfer=transfer, model_path=model_path)
