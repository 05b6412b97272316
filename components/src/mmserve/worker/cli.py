"""`mmserve worker`, `mmserve prefill`, `mmserve decode`, `mmserve encode`: the worker processes.

Each loads the engine, connects to NATS, serves its `generate` endpoint and registers it for
discovery, then runs until SIGINT/SIGTERM, when it stops taking requests, finishes the ones it
has (up to a grace period), deregisters and exits.
"""

from __future__ import annotations

import argparse
import logging
import sys

from mmserve.worker.options import add_worker_arguments

log = logging.getLogger(__name__)

ROLES = {
    "worker": (
        "aggregated worker: prefill and decode in one engine (E too with --encode)",
        True,
    ),
    "prefill": ("prefill worker for decode workers (E too with --encode)", True),
    "decode": ("decode worker: the entry point of prefill/decode disaggregation", False),
    "encode": ("encode worker: fetch, preprocess and run the vision tower", None),
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    for role, (description, can_encode) in ROLES.items():
        parser = subparsers.add_parser(role, help=description, description=description)
        add_worker_arguments(parser, encodes=can_encode is not False)
        if can_encode:
            parser.add_argument(
                "--encode",
                action="store_true",
                help="fetch, preprocess and encode media here instead of in an encode worker",
            )
        parser.set_defaults(handler=_handle, role=role)


def _handle(args: argparse.Namespace) -> int:
    from mmserve.observability.logging import configure_logging
    from mmserve.runtime import run

    configure_logging()
    try:
        return run(_main(args))
    except SystemExit:
        raise
    except Exception as exc:  # a component that cannot start says why in one line
        print(f"mmserve {args.role}: cannot start: {exc}", file=sys.stderr)
        return 1


async def _main(args: argparse.Namespace) -> int:
    from mmserve.encode.handler import EncodeHandler
    from mmserve.encode.stage import EncodeStage
    from mmserve.media import MediaPolicy
    from mmserve.worker.handlers import AggregatedHandler, DecodeHandler, PrefillHandler
    from mmserve.worker.options import start_services

    services = await start_services(args)
    try:
        stage = None
        if args.role == "encode" or getattr(args, "encode", False):
            stage = EncodeStage(
                services.engine,
                services.transfer,
                services.model_path,
                MediaPolicy.from_args(args),
                args.role,
            )
        if args.role == "encode":
            assert stage is not None
            handler: object = EncodeHandler(services.runtime, stage, services.transfer)
        else:
            role_class = {
                "worker": AggregatedHandler,
                "prefill": PrefillHandler,
                "decode": DecodeHandler,
            }[args.role]
            handler = role_class(services.runtime, services.engine, services.transfer, stage)
        await handler.serve()  # type: ignore[attr-defined]
        services.runtime.install_signal_handlers()
        log.info(
            "%s ready: instance %s, model %s, namespace %s",
            args.role,
            services.runtime.instance_id,
            services.model_path,
            args.namespace,
        )
        await services.runtime.wait_for_shutdown()
        log.info("%s shutting down", args.role)
    finally:
        await services.close()
    return 0
