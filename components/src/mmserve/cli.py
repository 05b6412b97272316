"""The `mmserve <component> ...` entry point.

Each component module in `COMPONENT_MODULES` exposes `add_parser(subparsers)`, which adds its
sub-command and sets `handler` (a callable taking the parsed args and returning an exit code).
Those modules stay light to import; heavy imports happen inside the handlers.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from mmserve.runtime.lifetime import follow_launcher

COMPONENT_MODULES: list[str] = [
    "mmserve.models.tiny",
    "mmserve.models.training",
    "mmserve.frontend.cli",
    "mmserve.runtime.nats_server",
    "mmserve.runtime.ports",
    "mmserve.worker.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmserve",
        description="Disaggregated multimodal serving for vision-language models.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="<component>", required=True)
    for name in COMPONENT_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    follow_launcher()
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
