"""Tensor transfer between processes: NIXL (UCX), same-host shared memory, or inline.

See docs/transfer.md. One `TransferAgent` per process, built by `create_transfer_agent` from
the `--transfer` options that `add_transfer_arguments` adds.
"""

from .base import (
    DEFAULT_INLINE_THRESHOLD,
    MAX_INLINE_BYTES,
    CompletedLease,
    Landing,
    Lease,
    TransferAgent,
    TransferError,
    TransferFailed,
    TransferTimeout,
)
from .options import add_transfer_arguments, create_transfer_agent, default_backend

__all__ = [
    "DEFAULT_INLINE_THRESHOLD",
    "MAX_INLINE_BYTES",
    "CompletedLease",
    "Landing",
    "Lease",
    "TransferAgent",
    "TransferError",
    "TransferFailed",
    "TransferTimeout",
    "add_transfer_arguments",
    "create_transfer_agent",
    "default_backend",
]
