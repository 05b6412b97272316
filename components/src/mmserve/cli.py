"""The `mmserve <component> ...` entry point.

Each component module in `COMPONENT_MODULES` exposes `add_parser(subparsers)`, which adds its
sub-command and sets `handler` (a callable taking the parsed args and returning an exit code).
Those modules stay light to import; heavy imports happen inside the handlers.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from typing import NoReturn

from mmserve.runtime.allocator import reexec_with_allocator
from mmserve.runtime.lifetime import exit_without_teardown, follow_launcher

COMPONENT_MODULES: list[str] = [
    "mmserve.tiny.checkpoints",
    "mmserve.tiny.training",
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


def run() -> NoReturn:
    """The `mmserve` command: `main()` on the command line, exiting as `sys.exit` would but
    without the interpreter's teardown (`exit_without_teardown`), also when `main()` fails:
    the traceback is printed as Python prints it, and no leak report follows it. The frontend
    first re-executes itself with its allocator preloaded (`runtime/allocator.py`); a component
    forked with `main(argv)` keeps the allocator of the process it was forked from."""
    if sys.argv[1:2] == ["frontend"]:
        reexec_with_allocator()
    try:
        status = main()
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            status = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            status = 1
    except KeyboardInterrupt:
        # Ctrl-C before the component handles SIGINT itself (while it starts): the shell's
        # status for it, without a traceback of wherever start-up was.
        status = 130
    except BaseException:
        traceback.print_exc()
        status = 1
    exit_without_teardown(status)


if __name__ == "__main__":
    run()
