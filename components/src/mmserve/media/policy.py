"""Where media may come from, and how much of it: the frontend's policy (it is the one process
that fetches media), built from its command-line flags; the Rust core enforces it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from mmserve import _mm


@dataclass(frozen=True)
class MediaPolicy:
    """Fetch rules for media items.

    Hosts in `allowed_domains` may resolve to loopback or private addresses (a local image
    server, a cluster-internal bucket); every other host must resolve to public addresses only.
    Local files are refused unless they sit under one of `allowed_local_roots`. The Rust core
    enforces these rules during the fetch (each redirect hop included); this class only carries
    them.
    """

    allowed_domains: frozenset[str] = frozenset()
    allowed_local_roots: tuple[Path, ...] = ()
    fetch_timeout_s: float = 10.0
    max_items: int = _mm.MAX_ITEMS_PER_REQUEST

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("media fetch policy")
        group.add_argument(
            "--allowed-media-domains",
            nargs="*",
            default=[],
            metavar="HOST",
            help="hosts whose media may be fetched even when they resolve to loopback or "
            "private addresses (e.g. 127.0.0.1); others must resolve to public addresses",
        )
        group.add_argument(
            "--allowed-local-media-path",
            nargs="*",
            default=[],
            metavar="DIR",
            help="directories under which local files (absolute paths, file:// URLs) may be "
            "read as media; none by default",
        )
        group.add_argument(
            "--media-fetch-timeout",
            type=float,
            default=10.0,
            metavar="SECONDS",
            help="time limit for fetching one media item over http(s) (default: 10)",
        )
        group.add_argument(
            "--max-media-items",
            type=int,
            default=_mm.MAX_ITEMS_PER_REQUEST,
            metavar="N",
            help=f"most media items in one request (default: {_mm.MAX_ITEMS_PER_REQUEST}, "
            "also the core's own cap)",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MediaPolicy:
        return cls(
            allowed_domains=frozenset(host.lower() for host in args.allowed_media_domains),
            allowed_local_roots=tuple(
                Path(root).resolve() for root in args.allowed_local_media_path
            ),
            fetch_timeout_s=args.media_fetch_timeout,
            max_items=args.max_media_items,
        )
