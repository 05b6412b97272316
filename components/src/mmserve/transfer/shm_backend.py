"""Same-host shared-memory backend, the fallback when NIXL is not installed.

Each pooled buffer is a file `mmserve-xfer-<pid>-<token>-<buffer id>` in a shared-memory
directory (default /dev/shm), mapped by both sides with `torch.from_file(shared=True)`: a 64-byte
header, then the data. The header carries completion instead of NIXL notifications:

- word 0, posted: the sequence number the buffer's owner gave its current use (0: none);
- word 1, acknowledged: the sequence the peer finished (negated when the peer failed).

READ mode: the producer posts, the consumer copies out, checks the buffer still holds its
sequence (a lease that expired mid-read is detected, not silently mixed) and acknowledges.
WRITE mode: the consumer posts a landing buffer, the producer copies in and acknowledges.
The acknowledgement is stored after the data, and x86 keeps stores in order. The peer then
sends one datagram to the owner's socket beside its buffers (`<prefix>ack`): the owner's event
loop reads it and checks its posted buffers, so nothing polls while transfers are pending (a
datagram carries no data; one dropped because the socket's queue is full is covered by those
still queued). Where that socket cannot be bound, the owner polls the headers from the progress
thread instead.

Files of processes that died are removed when the next agent starts on the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import secrets
import socket
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec
import torch

from mmserve.protocol import (
    ProtocolError,
    ShmBufferDescriptor,
    TensorHandle,
    TransferPoolStats,
    decode,
    encode,
)
from mmserve.runtime.lifetime import process_exists

from .base import (
    Landing,
    Lease,
    TransferAgent,
    TransferError,
    TransferFailed,
    copy_tensor,
    dtype_from_name,
    typed_view,
)
from .defaults import DEFAULT_INLINE_THRESHOLD, DEFAULT_LEASE_TIMEOUT_S, DEFAULT_POOL_BYTES
from .host import host_identity
from .pool import BufferPool, PooledBuffer

logger = logging.getLogger(__name__)

DEFAULT_SHM_DIRECTORY = "/dev/shm"
FILE_PREFIX = "mmserve-xfer-"
HEADER_BYTES = 64
POSTED, ACKNOWLEDGED = 0, 1
ACK_SUFFIX = "ack"  # the owner's socket: its buffers' prefix, then this
# Peer files kept mapped; pooled buffers are long-lived, so this is a cache of mappings.
MAX_ATTACHED_FILES = 256


@dataclass(frozen=True)
class ShmFile:
    path: str
    header: torch.Tensor  # int64 words, see the module docstring


def remove_stale_files(directory: str) -> None:
    """Remove transfer files whose owning process no longer exists."""
    for name in os.listdir(directory):
        if not name.startswith(FILE_PREFIX):
            continue
        pid_text = name[len(FILE_PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit() or process_exists(int(pid_text)):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))


class ShmFiles:
    """The owner's side of shared-memory buffers, for any agent that keeps its host memory in
    them (this backend, and NIXL's CPU pool for its same-host peers): the files, the posted
    sequences and the acknowledgements a peer stores."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.host = host_identity(directory)
        remove_stale_files(directory)
        self.prefix = f"{FILE_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-"
        # Posted buffers still waiting for their peer: transfer id -> (header, sequence).
        self._watched: dict[str, tuple[torch.Tensor, int]] = {}

    @property
    def watching(self) -> bool:
        return bool(self._watched)

    def allocate(self, buffer_id: int, capacity: int) -> tuple[torch.Tensor, ShmFile]:
        """A new file of `capacity` data bytes: (its data, mapped, and the file)."""
        path = os.path.join(self.directory, f"{self.prefix}{buffer_id}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, HEADER_BYTES + capacity)
        finally:
            os.close(fd)
        mapping = torch.from_file(
            path, shared=True, size=HEADER_BYTES + capacity, dtype=torch.uint8
        )
        header = mapping[:HEADER_BYTES].view(torch.int64)
        return mapping[HEADER_BYTES:], ShmFile(path, header)

    @staticmethod
    def free(shm_file: ShmFile) -> None:
        # The mapping itself goes when the last tensor viewing it does.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(shm_file.path)

    def post(self, shm_file: ShmFile, transfer_id: str, nbytes: int) -> ShmBufferDescriptor:
        """Give the file's current use the sequence `transfer_id` (an integer) and watch for
        its acknowledgement."""
        sequence = int(transfer_id)
        shm_file.header[ACKNOWLEDGED] = 0
        shm_file.header[POSTED] = sequence
        self._watched[transfer_id] = (shm_file.header, sequence)
        return ShmBufferDescriptor(
            name=os.path.basename(shm_file.path), sequence=sequence, nbytes=nbytes, host=self.host
        )

    def unpost(self, shm_file: ShmFile, transfer_id: str) -> None:
        self._watched.pop(transfer_id, None)
        # A peer arriving late now sees that the buffer no longer holds its tensor.
        shm_file.header[POSTED] = 0

    def poll(self) -> list[tuple[str, TransferError | None]]:
        """What peers acknowledged since the last poll (each reported once)."""
        completions: list[tuple[str, TransferError | None]] = []
        for transfer_id, (header, sequence) in list(self._watched.items()):
            acknowledged = int(header[ACKNOWLEDGED])
            if acknowledged == sequence:
                completions.append((transfer_id, None))
            elif acknowledged == -sequence:
                completions.append((transfer_id, TransferFailed("the peer's copy failed")))
            else:
                continue
            self._watched.pop(transfer_id, None)
        return completions

    def close(self) -> None:
        self._watched.clear()


class ShmPeer:
    """The peer's side: maps other processes' buffers on this host, reads or writes them, and
    acknowledges (in the header, then a datagram to the owner's socket)."""

    def __init__(self, directory: str, host: str) -> None:
        self._directory = directory
        self.host = host
        self._attached: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._notifier = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._notifier.setblocking(False)

    def same_host(self, remote: ShmBufferDescriptor) -> bool:
        return remote.host == self.host

    @contextlib.asynccontextmanager
    async def reading(
        self, remote: ShmBufferDescriptor, nbytes: int
    ) -> AsyncIterator[torch.Tensor]:
        """The peer's `nbytes`, valid inside the context; acknowledged when it ends (as a
        failure when it ends by an exception, or when the buffer changed hands meanwhile)."""
        data, header = self.attach(remote, nbytes)
        try:
            yield data[:nbytes]
        except BaseException:
            self._acknowledge(remote, header, -remote.sequence)
            raise
        self._check_posted(remote, header)
        self._acknowledge(remote, header, remote.sequence)

    async def write(self, tensor: torch.Tensor, remote: ShmBufferDescriptor, nbytes: int) -> None:
        data, header = self.attach(remote, nbytes)
        try:
            await copy_tensor(typed_view(data, tensor.shape, tensor.dtype), tensor)
            self._check_posted(remote, header)
        except BaseException:
            self._acknowledge(remote, header, -remote.sequence)
            raise
        self._acknowledge(remote, header, remote.sequence)

    def _acknowledge(self, remote: ShmBufferDescriptor, header: torch.Tensor, value: int) -> None:
        """Store the acknowledgement, then wake the owner (its socket is named after its
        buffers' common prefix). An owner that is gone, that polls instead, or whose queue is
        full (it has wake-ups to read already), needs no datagram."""
        header[ACKNOWLEDGED] = value
        owner = remote.name.rpartition("-")[0] + "-" + ACK_SUFFIX
        with contextlib.suppress(OSError):
            self._notifier.sendto(b"", os.path.join(self._directory, owner))

    def attach(self, remote: ShmBufferDescriptor, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The peer's buffer: (data, header), mapped once per file."""
        if remote.host and remote.host != self.host:
            # Another host's /dev/shm may even be this one's (network namespaces of one
            # machine): reading it would work here and break on real machines, so never.
            raise TransferError(
                f"shared-memory handle {remote.name} comes from another host ({remote.host}; "
                f"this is {self.host}): --transfer shm works on one host only, use --transfer "
                "nixl for a deployment over several hosts"
            )
        if not remote.name.startswith(FILE_PREFIX) or os.sep in remote.name:
            raise TransferError(f"{remote.name!r} is not a transfer buffer name")
        mapping = self._attached.get(remote.name)
        if mapping is None:
            path = os.path.join(self._directory, remote.name)
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                raise TransferError(
                    f"shared-memory buffer {path} is gone (its owner exited, or it runs on "
                    "another host: use --transfer nixl across hosts)"
                ) from None
            mapping = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            self._attached[remote.name] = mapping
            if len(self._attached) > MAX_ATTACHED_FILES:
                self._attached.popitem(last=False)
        else:
            self._attached.move_to_end(remote.name)
        if mapping.numel() < HEADER_BYTES + nbytes or remote.nbytes < nbytes:
            raise TransferError(f"shared-memory buffer {remote.name} is smaller than {nbytes}")
        header = mapping[:HEADER_BYTES].view(torch.int64)
        self._check_posted(remote, header)
        return mapping[HEADER_BYTES:], header

    @staticmethod
    def _check_posted(remote: ShmBufferDescriptor, header: torch.Tensor) -> None:
        if int(header[POSTED]) != remote.sequence:
            raise TransferError(
                f"shared-memory buffer {remote.name} no longer holds transfer "
                f"{remote.sequence} (its reservation timed out or was closed)"
            )

    def close(self) -> None:
        self._notifier.close()
        self._attached.clear()


class ShmTransferAgent(TransferAgent):
    backend = "shm"

    def __init__(
        self,
        *,
        directory: str = DEFAULT_SHM_DIRECTORY,
        pool_bytes: int = DEFAULT_POOL_BYTES,
        inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
        lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
    ) -> None:
        super().__init__(inline_threshold=inline_threshold, lease_timeout_s=lease_timeout_s)
        self.shm_files = ShmFiles(directory)
        self._peer = ShmPeer(directory, self.shm_files.host)
        self.host = self.shm_files.host
        self._pool = BufferPool(
            self._allocate, self._free, pool_bytes, buffer_ids=itertools.count(1)
        )
        self._acks: _AckSocket | None = None  # bound when the first transfer is posted
        self._acks_tried = False

    def stats(self) -> TransferPoolStats:
        return TransferPoolStats(
            buffers=self._pool.buffers,
            registered_bytes=self._pool.registered_bytes,
            in_use=self._pool.in_use,
            registrations=self._pool.registrations,
        )

    # -- owner side: leases (READ) and landings (WRITE) ------------------------------------

    async def _offer_buffer(self, tensor: torch.Tensor, nbytes: int) -> tuple[bytes, Lease]:
        buffer = await self._pool.acquire(nbytes, self.lease_timeout_s)
        try:
            await copy_tensor(typed_view(buffer.tensor, tensor.shape, tensor.dtype), tensor)
        except BaseException:
            self._pool.release(buffer)
            raise
        transfer_id, descriptor, close = self._post(buffer, nbytes)
        return descriptor, Lease(transfer_id, self.lease_timeout_s, close)

    async def _offer_landing(
        self, handle: TensorHandle, nbytes: int, device: torch.device
    ) -> Landing:
        # Shared memory is host memory: `Landing.receive(device=...)` moves it afterwards.
        buffer = await self._pool.acquire(nbytes, self.lease_timeout_s)
        transfer_id, descriptor, close = self._post(buffer, nbytes)
        handle = msgspec.structs.replace(handle, descriptor=descriptor)
        view = typed_view(buffer.tensor, handle.shape, dtype_from_name(handle.dtype))
        return Landing(handle, transfer_id, view, self.lease_timeout_s, close)

    def _post(
        self, buffer: PooledBuffer, nbytes: int
    ) -> tuple[str, bytes, functools.partial[None]]:
        transfer_id = self._new_transfer_id()
        descriptor = self.shm_files.post(buffer.backend_state, transfer_id, nbytes)
        close = functools.partial(self._end_reservation, transfer_id, buffer)
        return transfer_id, encode(descriptor), close

    def _end_reservation(self, transfer_id: str, buffer: PooledBuffer) -> None:
        self._untrack(transfer_id)
        self.shm_files.unpost(buffer.backend_state, transfer_id)
        self._pool.release(buffer)

    # -- peer side -------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _fetch_buffer(
        self, handle: TensorHandle, nbytes: int, device: torch.device
    ) -> AsyncIterator[torch.Tensor]:
        remote = self._remote(handle)
        self.peer_paths["shm"] += 1
        async with self._peer.reading(remote, nbytes) as data:
            yield data

    async def _write_buffer(
        self, tensor: torch.Tensor, destination: TensorHandle, nbytes: int
    ) -> None:
        remote = self._remote(destination)
        self.peer_paths["shm"] += 1
        await self._peer.write(tensor, remote, nbytes)

    def _remote(self, handle: TensorHandle) -> ShmBufferDescriptor:
        self._check_backend(handle)
        try:
            return decode(handle.descriptor, ShmBufferDescriptor)
        except ProtocolError as exc:
            raise TransferError(f"bad shared-memory descriptor: {exc}") from exc

    # -- completions -----------------------------------------------------------------------

    def _wake_progress(self) -> None:
        if not self._acks_tried:
            self._acks_tried = True
            path = os.path.join(self.shm_files.directory, f"{self.shm_files.prefix}{ACK_SUFFIX}")
            self._acks = _AckSocket.bind(path, self._on_acks)
        if self._acks is None:
            super()._wake_progress()

    def _on_acks(self) -> None:
        """On the event loop, when the socket has datagrams: read them all, then complete what
        the headers say finished."""
        if self._acks is not None:
            self._acks.drain()
        self._deliver(self._poll_completions())

    def _has_pending(self) -> bool:
        return self.shm_files.watching

    def _poll_completions(self) -> list[tuple[str, TransferError | None]]:
        return self.shm_files.poll()

    # -- buffers ---------------------------------------------------------------------------

    def _allocate(self, buffer_id: int, capacity: int) -> PooledBuffer:
        data, shm_file = self.shm_files.allocate(buffer_id, capacity)
        return PooledBuffer(buffer_id, capacity, data, shm_file)

    def _free(self, buffer: PooledBuffer) -> None:
        self.shm_files.free(buffer.backend_state)

    def _close_buffers(self) -> None:
        if self._acks is not None:
            self._acks.close()
            self._acks = None
        self._peer.close()
        self.shm_files.close()
        self._pool.close()


class _AckSocket:
    """The owner's datagram socket that peers wake it through, read by its event loop."""

    def __init__(self, sock: socket.socket, path: str, loop: asyncio.AbstractEventLoop) -> None:
        self._sock = sock
        self._path = path
        self._loop = loop

    @classmethod
    def bind(cls, path: str, on_readable: Callable[[], None]) -> _AckSocket | None:
        """Bound at `path` and watched by the running loop; None where a Unix socket cannot be
        bound there (a path past the 107-byte limit, a file system without sockets)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(path)
        except OSError as exc:
            sock.close()
            logger.info("no acknowledgement socket at %s (%s): polling instead", path, exc)
            return None
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        loop.add_reader(sock.fileno(), on_readable)
        return cls(sock, path, loop)

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while True:
                self._sock.recv(1)

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
