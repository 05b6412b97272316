"""Tensor transfer between processes: NIXL (UCX), same-host shared memory, or inline.

See docs/transfer.md. One `TransferAgent` per process, built by `create_transfer_agent` from
the `--transfer` options that `add_transfer_arguments` adds.

Names are imported lazily so that building the command line does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DEFAULT_INLINE_THRESHOLD": "defaults",
    "MAX_INLINE_BYTES": "defaults",
    "CompletedLease": "base",
    "Landing": "base",
    "Lease": "base",
    "TransferAgent": "base",
    "TransferError": "base",
    "TransferFailed": "base",
    "TransferTimeout": "base",
    "add_transfer_arguments": "options",
    "create_transfer_agent": "options",
    "default_backend": "options",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mmserve.transfer' has no attribute {name!r}")
    return getattr(importlib.import_module(f"mmserve.transfer.{_EXPORTS[name]}"), name)
