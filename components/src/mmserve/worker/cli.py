"""`mmserve worker`, `mmserve prefill`, `mmserve decode`, `mmserve encode`: the worker processes.

Each loads the engine, connects to NATS, serves its `generate` and `reset_prefix_cache`
endpoints and registers them for discovery, then runs until SIGINT/SIGTERM, when it stops taking
requests, finishes the ones it has (up to a grace period), deregisters and exits.
"""

from __future__ import annotations

import argparse
import logging

from mmserve.topology import Role
from mmserve.worker.options import add_worker_arguments

log = logging.getLogger(__name__)

# role -> (description, whether it may also encode with --encode)
ROLES = {
    Role.WORKER: (
        "aggregated worker: prefill and decode in one engine (E too with --encode)",
        True,
    ),
    Role.PREFILL: ("prefill worker for decode workers (E too with --encode)", True),
    Role.DECODE: ("decode worker: the entry point of prefill/decode disaggregation", False),
    Role.ENCODE: ("encode worker: preprocess media in the Rust core, run the vision tower", False),
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    for role, (description, can_encode) in ROLES.items():
        parser = subparsers.add_parser(role.value, help=description, description=description)
        add_worker_arguments(parser)
        if can_encode:
            parser.add_argument(
                "--encode",
                action="store_true",
                help="preprocess and encode media here instead of in an encode worker",
            )
        parser.set_defaults(handler=_handle, role=role)


def _handle(args: argparse.Namespace) -> int:
    from mmserve.observability.logging import configure_logging
    from mmserve.runtime import run_component

    configure_logging()
    return run_component(f"mmserve {args.role}", _main(args))


async def _main(args: argparse.Namespace) -> int:
    from mmserve.encode.peer_pull import PeerPuller
    from mmserve.encode.stage import EncodeStage
    from mmserve.runtime.heap import freeze_startup_heap
    from mmserve.worker.endpoints import serve_role
    from mmserve.worker.options import encodes, start_services

    role: Role = args.role
    services = await start_services(args)
    try:
        stage = None
        if encodes(args):
            # Only encode workers are routed by their encoder caches, so only they pull.
            puller = (
                PeerPuller(services.runtime, services.transfer) if role is Role.ENCODE else None
            )
            stage = EncodeStage(
                services.engine, services.transfer, services.model_path, role.value, puller
            )
        freeze_startup_heap()
        await serve_role(role, services.runtime, services.engine, services.transfer, stage)
        services.runtime.install_signal_handlers()
        log.info(
            "%s ready: instance %s, model %s, namespace %s",
            role,
            services.runtime.instance_id,
            services.model_path,
            args.namespace,
        )
        await services.runtime.wait_for_shutdown()
        log.info("%s shutting down", role)
    finally:
        await services.close()
    return 0
