"""The transfer agent interface every backend implements, and the reservations it hands out.

A producer `offer()`s a tensor and gets a `TensorHandle` (small; it travels over NATS) and a
`Lease` that keeps the pooled buffer reserved until the consumer signals completion, fails, or
the lease times out. A consumer `fetch()`es the handle (READ mode). In WRITE mode the consumer
`offer_destination()`s a buffer (a `Landing`) and sends its handle; the producer `write()`s into
it and the landing completes when the write's notification arrives.

Tensors at or below `inline_threshold` bytes travel inside the handle, whatever the backend.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from typing import ClassVar

import numpy as np
import torch

from mmserve.protocol import TensorHandle, TransferPoolStats

from .defaults import (
    DEFAULT_INLINE_THRESHOLD,
    DEFAULT_LEASE_TIMEOUT_S,
    MAX_INLINE_BYTES,
)
from .progress import ProgressThread

logger = logging.getLogger(__name__)

# Copies at least this large (about a millisecond) run in a worker thread (torch releases the
# GIL) so the event loop stays responsive; smaller ones cost less than the hand-off.
THREADED_COPY_BYTES = 4 << 20

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class TransferError(RuntimeError):
    """A tensor could not be moved; the message says which side and why."""


class TransferTimeout(TransferError):
    """The peer did not complete in time; the reserved buffer went back to the pool."""


class TransferFailed(TransferError):
    """The peer reported that its side of the transfer failed."""


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise TransferError(f"dtype {dtype} cannot be transferred") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise TransferError(f"unknown dtype {name!r}; known: {', '.join(sorted(DTYPES))}") from None


def handle_nbytes(handle: TensorHandle) -> int:
    count = 1
    for dim in handle.shape:
        count *= dim
    return count * dtype_from_name(handle.dtype).itemsize


def typed_view(raw: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """`raw` (uint8, at least the tensor's size) seen as `shape` x `dtype`, without a copy."""
    nbytes = dtype.itemsize
    for dim in shape:
        nbytes *= dim
    return raw[:nbytes].view(dtype).view(tuple(shape))


def host_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a flat uint8 array sharing its memory."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


async def copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` (any strides), off the event loop when large; waits for CUDA copies."""

    def run() -> None:
        if dst.is_cuda or src.is_cuda:
            dst.copy_(src)
            for tensor in (dst, src):
                if tensor.is_cuda:
                    torch.cuda.current_stream(tensor.device).synchronize()
        elif dst.is_contiguous() and src.is_contiguous():
            # numpy copies on this thread; torch would split the copy over its intra-op pool
            # and wait for a second thread, which takes milliseconds on a loaded machine.
            np.copyto(host_bytes(dst), host_bytes(src))
        else:
            dst.copy_(src)

    if src.numel() * src.element_size() >= THREADED_COPY_BYTES:
        await asyncio.to_thread(run)
    else:
        run()


class Reservation:
    """A pooled buffer held for a peer until it signals completion, fails, or time runs out.

    `close` gives the buffer back; it runs exactly once, from completion, failure, timeout or an
    explicit call.
    """

    def __init__(self, transfer_id: str, timeout_s: float, on_close: Callable[[], None]) -> None:
        self.transfer_id = transfer_id
        self._on_close = on_close
        self._completed = asyncio.Event()
        self._error: TransferError | None = None
        self._closed = False
        self._timer = asyncio.get_running_loop().call_later(timeout_s, self._expire, timeout_s)

    @property
    def done(self) -> bool:
        return self._completed.is_set()

    @property
    def error(self) -> TransferError | None:
        return self._error

    async def wait(self) -> None:
        """Return when the peer completed; raise `TransferTimeout` / `TransferFailed` if not."""
        await self._completed.wait()
        if self._error is not None:
            raise self._error

    def complete(self, error: TransferError | None = None) -> None:
        """Called by the agent when the peer's notification (or a failure) arrives."""
        if self._completed.is_set():
            return
        self._timer.cancel()
        self._error = error
        self._completed.set()
        self._after_complete()

    def close(self) -> None:
        """Give the buffer back to the pool now. Only safe once the peer no longer touches it."""
        if self._closed:
            return
        self._closed = True
        self._timer.cancel()
        if not self._completed.is_set():
            self._error = TransferError(f"transfer {self.transfer_id} was closed before completion")
            self._completed.set()
        self._on_close()

    def _after_complete(self) -> None:
        self.close()

    def _expire(self, timeout_s: float) -> None:
        self.complete(TransferTimeout(f"peer did not complete {self.transfer_id} in {timeout_s}s"))


class Lease(Reservation):
    """Producer side of an offered tensor: the buffer returns to the pool on completion."""


class CompletedLease(Lease):
    """The lease of an inline tensor: nothing is reserved, nothing to wait for."""

    def __init__(self) -> None:
        self.transfer_id = ""
        self._closed = True
        self._error = None
        self._completed = asyncio.Event()
        self._completed.set()


class Landing(Reservation):
    """Consumer side of WRITE mode: a buffer the producer writes into; `receive()` returns it.

    Call `receive()` (or `close()` to give up): a completed landing keeps its buffer until then.
    """

    def __init__(
        self,
        handle: TensorHandle,
        transfer_id: str,
        view: torch.Tensor,
        timeout_s: float,
        on_close: Callable[[], None],
    ) -> None:
        super().__init__(transfer_id, timeout_s, on_close)
        self.handle = handle
        self._view = view

    async def receive(self, *, device: torch.device | str | None = None) -> torch.Tensor:
        """Wait for the write, then return the tensor (one copy out of the pooled buffer)."""
        try:
            await self.wait()
            out = torch.empty_like(self._view, device=device or self._view.device)
            await copy_tensor(out, self._view)
            return out
        finally:
            self.close()

    def _after_complete(self) -> None:
        if self._error is not None:
            self.close()


class TransferAgent(ABC):
    """One per process. Subclasses move buffers; this class handles inline tensors, dtypes,
    shapes, reservations and their completion events."""

    backend: ClassVar[str]

    def __init__(
        self,
        *,
        inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
        lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
    ) -> None:
        if inline_threshold > MAX_INLINE_BYTES:
            raise ValueError(
                f"inline_threshold {inline_threshold} exceeds the {MAX_INLINE_BYTES}-byte limit "
                "that keeps messages under the NATS payload limit"
            )
        self.inline_threshold = inline_threshold
        self.lease_timeout_s = lease_timeout_s
        self._reservations: dict[str, Reservation] = {}
        self._transfer_ids = itertools.count(1)
        # Reads and writes this process made as the peer, by the path the bytes took ("shm":
        # shared memory on this host, "nixl": through UCX).
        self.peer_paths: collections.Counter[str] = collections.Counter()
        self._progress: ProgressThread | None = None

    # -- public interface ------------------------------------------------------------------

    async def offer(self, tensor: torch.Tensor) -> tuple[TensorHandle, Lease]:
        """Make `tensor` fetchable by a peer; keep the `Lease` until it completes."""
        name = dtype_name(tensor.dtype)
        shape = tuple(tensor.shape)
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes <= self.inline_threshold:
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            handle = TensorHandle(shape=shape, dtype=name, backend="inline", descriptor=bytes(data))
            return handle, CompletedLease()
        descriptor, lease = await self._offer_buffer(tensor.detach(), nbytes)
        self._track(lease)
        return TensorHandle(
            shape=shape, dtype=name, backend=self.backend, descriptor=descriptor
        ), lease

    async def fetch(
        self, handle: TensorHandle, *, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """The tensor behind `handle`, as a new tensor on `device` (one copy out of the pooled
        buffer, which is back in the pool when this returns)."""
        async with self.fetch_view(handle, device=device) as view:
            out = torch.empty(view.shape, dtype=view.dtype, device=device)
            await copy_tensor(out, view)
            return out

    @contextlib.asynccontextmanager
    async def fetch_view(
        self, handle: TensorHandle, *, device: torch.device | str = "cpu"
    ) -> AsyncIterator[torch.Tensor]:
        """Zero-copy access: a view of the pooled buffer, valid only inside the `async with`."""
        dtype = dtype_from_name(handle.dtype)
        if handle.backend == "inline":
            # frombuffer refuses an empty buffer; an empty tensor is still a valid payload.
            raw = (
                torch.frombuffer(bytearray(handle.descriptor), dtype=torch.uint8)
                if handle.descriptor
                else torch.empty(0, dtype=torch.uint8)
            )
            yield typed_view(raw, handle.shape, dtype).to(device)
            return
        self._check_backend(handle)
        async with self._fetch_buffer(handle, handle_nbytes(handle), torch.device(device)) as raw:
            yield typed_view(raw, handle.shape, dtype).to(device)

    async def offer_destination(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        *,
        device: torch.device | str = "cpu",
    ) -> Landing:
        """WRITE mode: reserve a buffer a producer writes into; send `landing.handle` to it."""
        name = dtype_name(dtype)
        nbytes = dtype.itemsize
        for dim in shape:
            nbytes *= dim
        landing = await self._offer_landing(
            TensorHandle(shape=tuple(shape), dtype=name, backend=self.backend, descriptor=b""),
            nbytes,
            torch.device(device),
        )
        self._track(landing)
        return landing

    async def write(self, tensor: torch.Tensor, destination: TensorHandle) -> None:
        """WRITE mode: put `tensor` into the buffer a consumer offered; returns once written."""
        self._check_backend(destination)
        if tuple(tensor.shape) != tuple(destination.shape) or dtype_name(tensor.dtype) != (
            destination.dtype
        ):
            raise TransferError(
                f"destination holds {destination.dtype}{list(destination.shape)}, "
                f"got {dtype_name(tensor.dtype)}{list(tensor.shape)}"
            )
        await self._write_buffer(tensor.detach(), destination, handle_nbytes(destination))

    @abstractmethod
    def stats(self) -> TransferPoolStats:
        """Registered buffers right now (all devices)."""

    async def close(self) -> None:
        """Stop polling, give every reserved buffer back, free the pools."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        for reservation in list(self._reservations.values()):
            reservation.close()
        self._close_buffers()

    async def __aenter__(self) -> TransferAgent:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- for subclasses --------------------------------------------------------------------

    @abstractmethod
    async def _offer_buffer(self, tensor: torch.Tensor, nbytes: int) -> tuple[bytes, Lease]: ...

    @abstractmethod
    def _fetch_buffer(
        self, handle: TensorHandle, nbytes: int, device: torch.device
    ) -> contextlib.AbstractAsyncContextManager[torch.Tensor]:
        """A uint8 view of `nbytes` holding the handle's bytes, valid inside the context."""

    @abstractmethod
    async def _offer_landing(
        self, handle: TensorHandle, nbytes: int, device: torch.device
    ) -> Landing: ...

    @abstractmethod
    async def _write_buffer(
        self, tensor: torch.Tensor, destination: TensorHandle, nbytes: int
    ) -> None: ...

    @abstractmethod
    def _close_buffers(self) -> None: ...

    def _poll_completions(self) -> list[tuple[str, TransferError | None]]:
        """Run on the progress thread: non-blocking checks of what completed since last time."""
        return []

    def _has_pending(self) -> bool:
        """Run on the progress thread: whether anything is waiting for `_poll_completions`."""
        return bool(self._reservations)

    def _is_busy(self) -> bool:
        """Run on the progress thread: whether local work advances only while polled."""
        return False

    def _new_transfer_id(self) -> str:
        return str(next(self._transfer_ids))

    def _track(self, reservation: Reservation) -> None:
        self._reservations[reservation.transfer_id] = reservation
        self._wake_progress()

    def _wake_progress(self) -> None:
        """Tell the progress thread there is something to poll (starting it on first use)."""
        if self._progress is None:
            self._progress = ProgressThread(
                f"{self.backend}-transfer-progress",
                poll=self._poll_completions,
                has_pending=self._has_pending,
                deliver=self._deliver,
                loop=asyncio.get_running_loop(),
                busy=self._is_busy,
            )
        self._progress.wake()

    def _untrack(self, transfer_id: str) -> None:
        self._reservations.pop(transfer_id, None)

    def _deliver(self, completions: list[tuple[str, TransferError | None]]) -> None:
        """On the event loop: complete what the progress thread saw. Unknown ids are late
        notifications for reservations that already timed out."""
        for transfer_id, error in completions:
            reservation = self._reservations.get(transfer_id)
            if reservation is not None:
                reservation.complete(error)

    def _check_backend(self, handle: TensorHandle) -> None:
        if handle.backend != self.backend:
            raise TransferError(
                f"handle uses transfer backend {handle.backend!r} but this process runs "
                f"{self.backend!r}; start every component with the same --transfer"
            )
