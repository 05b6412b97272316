"""The `mmserve <component> ...` entry point.

Each component registers a sub-command here; the component's own module does the work.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmserve",
        description="Disaggregated multimodal serving for vision-language models.",
    )
    parser.add_subparsers(dest="command", metavar="<component>", required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
