"""`python -m mmserve.dynamo`: mmserve's aggregated worker (encode, prefill and decode in one
process) served as an endpoint of a Dynamo deployment through `ai-dynamo-runtime`.

It registers the model for Dynamo's discovery with a card that asks Dynamo's frontend for token
ids (`ModelInput.Tokens`, chat and completions), so `python -m dynamo.frontend` routes requests
to it, and serves `generate` until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from mmserve.media.policy import MediaPolicy
from mmserve.roles import GENERATE, Role
from mmserve.worker.options import add_worker_arguments

log = logging.getLogger("mmserve.dynamo")

DEFAULT_MAX_TOKENS = 1024  # mmserve's frontend's default, for a request that gives none


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mmserve.dynamo",
        description="mmserve's aggregated worker as a Dynamo backend (ai-dynamo-runtime)",
    )
    dynamo = parser.add_argument_group("Dynamo")
    dynamo.add_argument(
        "--endpoint",
        default=None,
        help="Dynamo endpoint to serve, dyn://namespace.component.endpoint "
        f"(default: dyn://<--namespace>.{Role.WORKER.value}.{GENERATE})",
    )
    dynamo.add_argument(
        "--served-model-name", help="model name clients send (default: the dir's name)"
    )
    dynamo.add_argument(
        "--discovery-backend",
        choices=["etcd", "file", "mem", "kubernetes"],
        default=os.environ.get("DYN_DISCOVERY_BACKEND", "etcd"),
        help="Dynamo's discovery: etcd (ETCD_ENDPOINTS), file (a directory shared with the "
        "frontend, $DYN_FILE_KV), ... (default: $DYN_DISCOVERY_BACKEND or etcd)",
    )
    dynamo.add_argument(
        "--request-plane",
        choices=["tcp", "nats"],
        default=os.environ.get("DYN_REQUEST_PLANE", "tcp"),
        help="Dynamo's request plane; nats reads $NATS_SERVER (default: $DYN_REQUEST_PLANE or tcp)",
    )
    dynamo.add_argument(
        "--event-plane",
        choices=["nats", "zmq"],
        default=os.environ.get("DYN_EVENT_PLANE"),
        help="Dynamo's event plane (default: $DYN_EVENT_PLANE, else Dynamo's choice)",
    )
    dynamo.add_argument(
        "--default-max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="completion length for a request that sets no max_tokens (default: %(default)s)",
    )
    MediaPolicy.add_cli_args(parser)
    add_worker_arguments(parser)
    # Images reach this process as bytes and never leave it: no transfer backend is needed.
    parser.set_defaults(transfer="inline")
    return parser


def main(argv: list[str] | None = None) -> int:
    from mmserve.observability.logging import configure_logging
    from mmserve.runtime import run_component

    args = build_parser().parse_args(argv)
    args.role = Role.WORKER
    if args.engine == "sglang":
        print(
            "mmserve.dynamo: cannot start: --engine sglang is not served here yet; use "
            "Dynamo's own SGLang backend (python -m dynamo.sglang)",
            file=sys.stderr,
        )
        return 2
    configure_logging()
    return run_component("mmserve.dynamo", _serve(args))


async def _serve(args: argparse.Namespace) -> int:
    from dynamo.llm import KvEventPublisher, ModelInput, ModelType, WorkerType, register_model
    from dynamo.runtime import DistributedRuntime

    from mmserve.dynamo.handler import DynamoHandler
    from mmserve.dynamo.kv_events import DynamoKvEvents
    from mmserve.encode.stage import EncodeStage
    from mmserve.kv.pad import PadScheme
    from mmserve.observability.metrics import serve_metrics
    from mmserve.transfer import create_transfer_agent
    from mmserve.worker.options import load_engine, resolve_model_path

    model_path = resolve_model_path(args)
    engine = await load_engine(args, model_path)
    transfer = create_transfer_agent(args)
    try:
        loop = asyncio.get_running_loop()
        runtime = DistributedRuntime(
            loop, args.discovery_backend, args.request_plane, event_plane=args.event_plane
        )
        endpoint = runtime.endpoint(
            args.endpoint or f"{args.namespace}.{Role.WORKER.value}.{GENERATE}"
        )
        name = args.served_model_name or model_path.name
        kv_events = DynamoKvEvents(
            KvEventPublisher(endpoint, kv_block_size=args.block_size),
            args.block_size,
            PadScheme(args.pad_scheme),
        )
        engine.subscribe_kv_events(kv_events.sink)
        serve_metrics(args.metrics_port)
        handler = DynamoHandler(
            engine,
            EncodeStage(engine, transfer, model_path, Role.WORKER.value),
            MediaPolicy.from_args(args),
            name,
            args.default_max_tokens,
            kv_events,
        )
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, runtime.shutdown)
        serving = asyncio.ensure_future(
            endpoint.serve_endpoint(handler.generate, graceful_shutdown=True)
        )
        await register_model(
            ModelInput.Tokens,
            ModelType.Chat | ModelType.Completions,
            endpoint,
            str(model_path),
            name,
            worker_type=WorkerType.Aggregated,
            kv_cache_block_size=args.block_size,
        )
        log.info(
            "worker ready: instance %x, model %s, endpoint %s",
            endpoint.connection_id(),
            name,
            args.endpoint or f"{args.namespace}.{Role.WORKER.value}.{GENERATE}",
        )
        await serving
        log.info("worker shutting down")
    finally:
        await engine.close()
        await transfer.close()
    return 0
