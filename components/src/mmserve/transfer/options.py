"""Choosing the backend: `--transfer nixl|shm|inline` and the agent it builds."""

from __future__ import annotations

import argparse
import importlib.util
from typing import TYPE_CHECKING

from .defaults import (
    DEFAULT_INLINE_THRESHOLD,
    DEFAULT_LEASE_TIMEOUT_S,
    DEFAULT_POOL_BYTES,
    MAX_INLINE_BYTES,
)

if TYPE_CHECKING:
    from .base import TransferAgent

BACKENDS = ("nixl", "shm", "inline")


def nixl_importable() -> bool:
    return importlib.util.find_spec("nixl") is not None


def default_backend() -> str:
    return "nixl" if nixl_importable() else "shm"


def add_transfer_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the tensor transfer options; `create_transfer_agent(args)` reads them."""
    group = parser.add_argument_group("tensor transfer")
    group.add_argument(
        "--transfer",
        choices=BACKENDS,
        default=None,
        help="how tensors move between processes: nixl (UCX, any host), shm (same host), inline "
        "(inside messages, small tensors only). Default: nixl when importable, else shm. Every "
        "component of a deployment must use the same one.",
    )
    group.add_argument(
        "--transfer-inline-threshold",
        type=int,
        default=DEFAULT_INLINE_THRESHOLD,
        metavar="BYTES",
        help=f"tensors up to this size travel inside the message (at most {MAX_INLINE_BYTES}; "
        "default %(default)s)",
    )
    group.add_argument(
        "--transfer-pool-mib",
        type=int,
        default=DEFAULT_POOL_BYTES >> 20,
        metavar="MIB",
        help="cap of registered transfer buffers per device (default %(default)s)",
    )
    group.add_argument(
        "--transfer-timeout",
        type=float,
        default=DEFAULT_LEASE_TIMEOUT_S,
        metavar="SECONDS",
        help="how long an offered buffer waits for its peer before it returns to the pool "
        "(default %(default)s)",
    )


def create_transfer_agent(args: argparse.Namespace) -> TransferAgent:
    """The agent chosen by `add_transfer_arguments`' options (one per process)."""
    backend = args.transfer or default_backend()
    if args.transfer_inline_threshold > MAX_INLINE_BYTES:
        raise SystemExit(
            f"--transfer-inline-threshold: at most {MAX_INLINE_BYTES} bytes fit in a message"
        )
    if backend == "inline":
        from .inline import InlineTransferAgent

        return InlineTransferAgent(lease_timeout_s=args.transfer_timeout)
    common = {
        "pool_bytes": args.transfer_pool_mib << 20,
        "inline_threshold": args.transfer_inline_threshold,
        "lease_timeout_s": args.transfer_timeout,
    }
    if backend == "nixl":
        from .nixl_backend import NixlTransferAgent

        return NixlTransferAgent(**common)
    from .shm_backend import ShmTransferAgent

    return ShmTransferAgent(**common)
