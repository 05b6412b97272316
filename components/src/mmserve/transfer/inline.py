"""Inline backend: every tensor travels inside its handle (no buffers, no completion).

For deployments whose tensors are all small; anything above `MAX_INLINE_BYTES` is refused
because the message would not fit under the NATS payload limit. WRITE mode needs a buffer to
write into, so it is not available here.
"""

from __future__ import annotations

import contextlib

import torch

from mmserve.protocol import TensorHandle, TransferPoolStats

from .base import (
    DEFAULT_LEASE_TIMEOUT_S,
    MAX_INLINE_BYTES,
    Landing,
    Lease,
    TransferAgent,
    TransferError,
)

_NO_WRITE_MODE = "the inline transfer backend has no WRITE mode; run with --transfer nixl or shm"


class InlineTransferAgent(TransferAgent):
    backend = "inline"

    def __init__(self, *, lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S) -> None:
        super().__init__(inline_threshold=MAX_INLINE_BYTES, lease_timeout_s=lease_timeout_s)

    def stats(self) -> TransferPoolStats:
        return TransferPoolStats(buffers=0, registered_bytes=0, in_use=0, registrations=0)

    async def _offer_buffer(self, tensor: torch.Tensor, nbytes: int) -> tuple[bytes, Lease]:
        raise TransferError(
            f"a {nbytes}-byte tensor is above the {MAX_INLINE_BYTES}-byte inline limit; "
            "run with --transfer nixl or shm"
        )

    def _fetch_buffer(
        self, handle: TensorHandle, nbytes: int, device: torch.device
    ) -> contextlib.AbstractAsyncContextManager[torch.Tensor]:
        raise TransferError(f"the inline transfer backend cannot fetch a {handle.backend} handle")

    async def _offer_landing(
        self, handle: TensorHandle, nbytes: int, device: torch.device
    ) -> Landing:
        raise TransferError(_NO_WRITE_MODE)

    async def _write_buffer(
        self, tensor: torch.Tensor, destination: TensorHandle, nbytes: int
    ) -> None:
        raise TransferError(_NO_WRITE_MODE)

    def _close_buffers(self) -> None:
        pass
