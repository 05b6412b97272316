"""Choosing the backend: `--transfer nixl|shm|inline` and the agent it builds."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import socket
import struct
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
_SIOCGIFADDR = 0x8915  # ioctl: an interface's (first) IPv4 address


def interface_holding(address: str) -> str:
    """The name of the network interface that holds the local IPv4 `address`."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            request = struct.pack("256s", name.encode()[:15])
            with contextlib.suppress(OSError):  # no IPv4 address on this one
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
                if socket.inet_ntoa(reply[20:24]) == address:
                    return name
    raise SystemExit(f"--transfer-bind-address {address}: no network interface here holds it")


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
        "--transfer-bind-address",
        default=None,
        metavar="ADDRESS",
        help="nixl: move tensors only through the network interface holding this local IPv4 "
        "address; peers reach this process at that interface's addresses. Default: every "
        "interface (UCX picks per peer)",
    )
    group.add_argument(
        "--transfer-same-host",
        choices=("shm", "nixl"),
        default="shm",
        help="nixl: how a peer on this process's host reaches its CPU buffers. shm (default): "
        "it maps them from shared memory and copies, without UCX; nixl: through UCX, as a "
        "peer on another host does. Peers on other hosts always use UCX",
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

        address = args.transfer_bind_address
        return NixlTransferAgent(
            **common,
            devices=interface_holding(address) if address else "",
            same_host=args.transfer_same_host,
        )
    if args.transfer_bind_address:
        raise SystemExit(f"--transfer-bind-address applies to --transfer nixl, not {backend}")
    from .shm_backend import ShmTransferAgent

    return ShmTransferAgent(**common)
