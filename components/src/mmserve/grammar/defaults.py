"""Grammar settings the command lines show (importable without torch or xgrammar)."""

from __future__ import annotations

import argparse

DEFAULT_COMPILE_TIMEOUT_S = 10.0
"""The longest a grammar may take to compile (a JSON Schema of 50 properties takes ~10 ms; one
asking for strings of up to a million characters, seconds)."""

DEFAULT_CACHE_BYTES = 256 << 20
"""Budget of an engine's cache of compiled grammars (a 50-property schema holds ~0.7 MB)."""


def add_grammar_arguments(parser: argparse.ArgumentParser, where: str) -> None:
    """`--grammar-compile-timeout`; `where` says what the timeout bounds here."""
    parser.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=DEFAULT_COMPILE_TIMEOUT_S,
        metavar="S",
        help=f"structured outputs: {where} longer than this is refused with 400 "
        "grammar.compile_timeout, and the completion is not started (default: %(default)g)",
    )
