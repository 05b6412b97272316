"""NIXL (UCX) backend: one NIXL agent per process, persistent registered pools on both sides.

READ mode: the producer copies the tensor into a pooled registered buffer and describes it (with
its partial agent metadata); the consumer loads that metadata once per remote buffer, READs into
its own pooled buffer and names the transfer in the READ's notification, which completes the
producer's lease. WRITE mode is the mirror image: the consumer describes a landing buffer, the
producer WRITEs into it with a notification that completes the landing. A side that fails sends
a failure notification so the other side frees its buffer without waiting for the timeout.

CPU tensors use DRAM registrations, CUDA tensors VRAM ones (same calls; NIXL picks the memory
type from the tensor's device).

The transfer path is chosen per peer. The CPU pool's buffers are shared-memory files
(`shm_backend.ShmFiles`), registered with NIXL like any memory, and a descriptor names both: a
peer on the owner's host (`mmserve.transfer.host`: same machine, network namespace and
/dev/shm) maps the file and copies, acknowledging in its header as the shm backend does, and
never touches UCX; a peer on another host READs or WRITEs through UCX. The owner completes a
reservation by whichever arrives. `same_host="nixl"` sends every peer through UCX.
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
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import torch

from mmserve.observability import nvtx
from mmserve.protocol import (
    NixlBufferDescriptor,
    ProtocolError,
    TensorHandle,
    TransferPoolStats,
    decode,
    encode,
)

from .base import (
    Landing,
    Lease,
    TransferAgent,
    TransferError,
    TransferFailed,
    TransferTimeout,
    copy_tensor,
    dtype_from_name,
    typed_view,
)
from .defaults import DEFAULT_INLINE_THRESHOLD, DEFAULT_LEASE_TIMEOUT_S, DEFAULT_POOL_BYTES
from .pool import BufferPool, PooledBuffer
from .shm_backend import DEFAULT_SHM_DIRECTORY, ShmFile, ShmFiles, ShmPeer

logger = logging.getLogger(__name__)

DONE_PREFIX = b"mmserve.done:"
FAIL_PREFIX = b"mmserve.fail:"
# Remote buffers whose metadata is loaded; past this many the set starts over (reloading
# metadata is harmless, only slower), so peers that come and go do not grow it forever.
MAX_LOADED_REMOTE_BUFFERS = 4096
# How long a transfer is polled on the spot, then between the event loop's other tasks, before
# the progress thread takes over.
SPIN_S = 50e-6
LOOP_POLL_S = 3e-3
# A peer must be done with a buffer this long before its lease ends (at most this share of the
# lease): room for clock skew between hosts and for the transfer itself.
LEASE_MARGIN_S = 1.0
LEASE_MARGIN_SHARE = 0.1


def _lease_over(remote: NixlBufferDescriptor) -> bool:
    """Whether the owner's lease on its buffer is (nearly) over: it then returns the buffer to
    its pool, and a transfer would read or overwrite another tensor's bytes."""
    return bool(remote.transfer_by) and time.time() > remote.transfer_by


def _check_lease(remote: NixlBufferDescriptor, operation: str) -> None:
    if _lease_over(remote):
        raise TransferTimeout(
            f"NIXL {operation} of transfer {remote.transfer_id} refused: it was due by "
            f"{remote.transfer_by:.3f}, before the owner's lease ends"
        )


@dataclass(frozen=True)
class _Registration:
    descs: Any  # nixlRegDList, for deregistration
    metadata: bytes  # partial agent metadata: connection info + this buffer's keys
    mem_type: Literal["DRAM", "VRAM"]
    device_id: int
    shm_file: ShmFile | None  # CPU buffers, when same-host peers copy directly


def _local_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class NixlTransferAgent(TransferAgent):
    backend = "nixl"

    def __init__(
        self,
        *,
        name: str | None = None,
        pool_bytes: int = DEFAULT_POOL_BYTES,
        inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
        lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
        devices: str = "",
        same_host: Literal["shm", "nixl"] = "shm",
        shm_directory: str = DEFAULT_SHM_DIRECTORY,
    ) -> None:
        """`devices`: the network interfaces UCX may use, comma-separated ("": all of them).
        `same_host`: how peers on this host reach the CPU pool (module docstring)."""
        super().__init__(inline_threshold=inline_threshold, lease_timeout_s=lease_timeout_s)
        try:
            from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        except ImportError as exc:
            raise TransferError(
                f"the nixl transfer backend needs the nixl package ({exc}); "
                "install mmserve[nixl] or run with --transfer shm"
            ) from exc
        if "NIXL_LOG_LEVEL" not in os.environ:
            # nixl logs every agent and backend creation at INFO on stdout.
            logging.getLogger("nixl").setLevel(logging.WARNING)
        self.name = name or f"mmserve-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        # No NIXL progress thread: it spins without pause (a whole core per process). UCX makes
        # progress inside our calls instead, which `ProgressThread` keeps making while anything
        # is pending (connection set-up with a peer needs both sides to progress).
        # STRICT: that thread polls while the event loop posts transfers.
        config = nixl_agent_config(
            enable_prog_thread=False,
            backends=[],
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self._agent = nixl_agent(self.name, config)
        if "UCX" not in self._agent.get_plugin_list():
            raise TransferError("NIXL has no UCX plugin here; run with --transfer shm")
        # The devices' addresses are what the agent's metadata advertises to its peers.
        self._agent.create_backend("UCX", {"ucx_devices": devices} if devices else {})
        self._pool_bytes = pool_bytes
        self._pools: dict[torch.device, BufferPool] = {}
        self._buffer_ids = itertools.count(1)
        self._loaded_remote_buffers: set[tuple[str, int]] = set()
        # Posted transfers the progress thread checks; it removes those that finished.
        self._xfer_lock = threading.Lock()
        self._xfers: dict[str, Any] = {}
        self._xfer_waiters: dict[str, asyncio.Future[TransferError | None]] = {}
        self.shm_files = ShmFiles(shm_directory) if same_host == "shm" else None
        self._shm_peer = ShmPeer(shm_directory, self.shm_files.host) if self.shm_files else None

    def stats(self) -> TransferPoolStats:
        pools = self._pools.values()
        return TransferPoolStats(
            buffers=sum(pool.buffers for pool in pools),
            registered_bytes=sum(pool.registered_bytes for pool in pools),
            in_use=sum(pool.in_use for pool in pools),
            registrations=sum(pool.registrations for pool in pools),
        )

    # -- producer (READ) and consumer (WRITE) reservations ---------------------------------

    async def _offer_buffer(self, tensor: torch.Tensor, nbytes: int) -> tuple[bytes, Lease]:
        pool = self._pool(tensor.device)
        buffer = await pool.acquire(nbytes, self.lease_timeout_s)
        try:
            await copy_tensor(typed_view(buffer.tensor, tensor.shape, tensor.dtype), tensor)
        except BaseException:
            pool.release(buffer)
            raise
        transfer_id = self._new_transfer_id()
        # Described before the lease starts, so the expiry it announces is never late.
        descriptor = self._describe(buffer, transfer_id, nbytes)
        close = functools.partial(self._end_reservation, transfer_id, pool, buffer)
        return descriptor, Lease(transfer_id, self.lease_timeout_s, close)

    async def _offer_landing(
        self, handle: TensorHandle, nbytes: int, device: torch.device
    ) -> Landing:
        pool = self._pool(device)
        buffer = await pool.acquire(nbytes, self.lease_timeout_s)
        transfer_id = self._new_transfer_id()
        handle = msgspec.structs.replace(
            handle, descriptor=self._describe(buffer, transfer_id, nbytes)
        )
        view = typed_view(buffer.tensor, handle.shape, dtype_from_name(handle.dtype))
        close = functools.partial(self._end_reservation, transfer_id, pool, buffer)
        return Landing(handle, transfer_id, view, self.lease_timeout_s, close)

    def _end_reservation(self, transfer_id: str, pool: BufferPool, buffer: PooledBuffer) -> None:
        self._untrack(transfer_id)
        registration: _Registration = buffer.backend_state
        if self.shm_files is not None and registration.shm_file is not None:
            self.shm_files.unpost(registration.shm_file, transfer_id)
        pool.release(buffer)

    # -- consumer (READ) and producer (WRITE) transfers ------------------------------------

    @contextlib.asynccontextmanager
    async def _fetch_buffer(
        self, handle: TensorHandle, nbytes: int, device: torch.device
    ) -> AsyncIterator[torch.Tensor]:
        remote = self._remote_buffer(handle, nbytes)
        if self._shm_peer is not None and remote.shm and self._shm_peer.same_host(remote.shm):
            self.peer_paths["shm"] += 1
            async with self._shm_peer.reading(remote.shm, nbytes) as data:
                yield data
            return
        self.peer_paths["nixl"] += 1
        pool = self._pool(device)
        buffer = await pool.acquire(nbytes, self.lease_timeout_s)
        try:
            await self._transfer("READ", pool, buffer, remote, nbytes)
            yield buffer.tensor[:nbytes]
        finally:
            pool.release(buffer)

    async def _write_buffer(
        self, tensor: torch.Tensor, destination: TensorHandle, nbytes: int
    ) -> None:
        remote = self._remote_buffer(destination, nbytes)
        if self._shm_peer is not None and remote.shm and self._shm_peer.same_host(remote.shm):
            self.peer_paths["shm"] += 1
            await self._shm_peer.write(tensor, remote.shm, nbytes)
            return
        self.peer_paths["nixl"] += 1
        pool = self._pool(tensor.device)
        buffer = await pool.acquire(nbytes, self.lease_timeout_s)
        try:
            await copy_tensor(typed_view(buffer.tensor, tensor.shape, tensor.dtype), tensor)
            await self._transfer("WRITE", pool, buffer, remote, nbytes)
        finally:
            pool.release(buffer)

    async def _transfer(
        self,
        operation: str,
        pool: BufferPool,
        buffer: PooledBuffer,
        remote: NixlBufferDescriptor,
        nbytes: int,
    ) -> None:
        """Move `nbytes` between `buffer` and the remote buffer; the remote side gets the done
        notification from NIXL, or our failure notification."""
        registration: _Registration = buffer.backend_state
        reading = operation == "READ"
        _check_lease(remote, operation)
        begin_read = nvtx.range_start(nvtx.NIXL_BEGIN_READ) if reading else None
        try:
            self._load_remote(remote)
            local_descs = self._agent.get_xfer_descs(
                [(buffer.tensor.data_ptr(), nbytes, registration.device_id)],
                registration.mem_type,
            )
            remote_descs = self._agent.get_xfer_descs(
                [(remote.address, nbytes, remote.device_id)], remote.mem_type
            )
            xfer = self._agent.initialize_xfer(
                operation,
                local_descs,
                remote_descs,
                remote.agent,
                DONE_PREFIX + remote.transfer_id.encode(),
            )
        except Exception as exc:
            if reading:
                nvtx.range_end(begin_read)
            self._notify_failure(remote, f"{operation} setup failed: {exc}")
            raise TransferError(f"NIXL {operation} with {remote.agent} failed: {exc}") from exc
        try:
            try:
                posted = self._agent.transfer(xfer)
            finally:
                if reading:
                    nvtx.range_end(begin_read)
            with nvtx.nvtx_range(nvtx.NIXL_WAIT_COMPLETION):
                state = self._spin_until_done(xfer, posted)
                if state == "PROC":
                    state = await self._poll_between_tasks(xfer)
                error = None
                if state == "PROC":
                    error = await self._wait_for_xfer(xfer)
                elif state != "DONE":
                    error = TransferError(f"NIXL {operation} with {remote.agent} was rejected")
        except BaseException as exc:
            self._notify_failure(remote, f"{operation} interrupted: {exc!r}")
            self._release_xfer(xfer, pool, buffer)
            raise
        self._release_xfer(xfer, pool, buffer)
        if error is None and _lease_over(remote):
            # The owner may have reused its buffer while the bytes moved.
            error = TransferTimeout(
                f"NIXL {operation} of transfer {remote.transfer_id} ended after its lease; "
                "the bytes may belong to another transfer"
            )
        if error is not None:
            self._notify_failure(remote, str(error))
            raise error

    def _spin_until_done(self, xfer: Any, state: str) -> str:
        """Small transfers finish within microseconds: check a few times on the spot."""
        deadline = time.perf_counter() + SPIN_S
        while state == "PROC" and time.perf_counter() < deadline:
            state = self._agent.check_xfer_state(xfer)
        return state

    async def _poll_between_tasks(self, xfer: Any) -> str:
        """Medium transfers (about a millisecond): poll between the loop's other tasks, which
        on a busy machine beats two thread hand-offs; longer ones go to the progress thread."""
        deadline = time.perf_counter() + LOOP_POLL_S
        state = "PROC"
        while state == "PROC" and time.perf_counter() < deadline:
            await asyncio.sleep(0)
            state = self._agent.check_xfer_state(xfer)
        return state

    async def _wait_for_xfer(self, xfer: Any) -> TransferError | None:
        key = f"xfer-{self._new_transfer_id()}"
        done = asyncio.get_running_loop().create_future()
        self._xfer_waiters[key] = done
        with self._xfer_lock:
            self._xfers[key] = xfer
        self._wake_progress()
        try:
            return await asyncio.wait_for(done, self.lease_timeout_s)
        except TimeoutError:
            return TransferError(f"NIXL transfer did not finish in {self.lease_timeout_s}s")
        finally:
            with self._xfer_lock:
                self._xfers.pop(key, None)
            self._xfer_waiters.pop(key, None)

    def _release_xfer(self, xfer: Any, pool: BufferPool, buffer: PooledBuffer) -> None:
        try:
            xfer.release()
        except Exception:
            # NIXL could not cancel a transfer still in flight: the buffer may still be written,
            # so it never goes back to the pool.
            logger.exception("NIXL transfer could not be cancelled; retiring its buffer")
            pool.discard(buffer)

    def _notify_failure(self, remote: NixlBufferDescriptor, reason: str) -> None:
        message = FAIL_PREFIX + remote.transfer_id.encode() + b":" + reason.encode()[:200]
        try:
            self._agent.send_notif(remote.agent, message)
        except Exception as exc:  # the peer is gone or unknown; its own timeout frees it
            logger.debug("cannot tell %s about the failure: %s", remote.agent, exc)

    def _remote_buffer(self, handle: TensorHandle, nbytes: int) -> NixlBufferDescriptor:
        self._check_backend(handle)
        try:
            remote = decode(handle.descriptor, NixlBufferDescriptor)
        except ProtocolError as exc:
            raise TransferError(f"bad NIXL descriptor: {exc}") from exc
        if remote.nbytes < nbytes:
            raise TransferError(
                f"remote buffer holds {remote.nbytes} bytes, the handle needs {nbytes}"
            )
        return remote

    def _load_remote(self, remote: NixlBufferDescriptor) -> None:
        key = (remote.agent, remote.buffer_id)
        if key in self._loaded_remote_buffers:
            return
        # add_remote_agent() returns the peer's name as bytes in this NIXL build.
        loaded = self._agent.add_remote_agent(remote.agent_metadata)
        name = loaded.decode() if isinstance(loaded, bytes) else loaded
        if name != remote.agent:
            raise TransferError(f"descriptor names agent {remote.agent!r}, metadata is {name!r}")
        if len(self._loaded_remote_buffers) >= MAX_LOADED_REMOTE_BUFFERS:
            self._loaded_remote_buffers.clear()
        self._loaded_remote_buffers.add(key)

    # -- progress thread -------------------------------------------------------------------

    def _has_pending(self) -> bool:
        return bool(self._reservations) or bool(self._xfers)

    def _is_busy(self) -> bool:
        # Without NIXL's progress thread, a posted transfer moves only inside our polls.
        return bool(self._xfers)

    def _poll_completions(self) -> list[tuple[str, TransferError | None]]:
        completions: list[tuple[str, TransferError | None]] = []
        with self._xfer_lock:
            for key, xfer in list(self._xfers.items()):
                state = self._agent.check_xfer_state(xfer)
                if state != "PROC":
                    del self._xfers[key]
                    error = None if state == "DONE" else TransferError("NIXL transfer failed")
                    completions.append((key, error))
        if self.shm_files is not None:
            completions.extend(self.shm_files.poll())
        if self._reservations:
            for peer, messages in self._agent.get_new_notifs().items():
                for message in messages:
                    completions.extend(self._parse_notification(peer, message))
        return completions

    @staticmethod
    def _parse_notification(peer: str, message: bytes) -> list[tuple[str, TransferError | None]]:
        if message.startswith(DONE_PREFIX):
            return [(message[len(DONE_PREFIX) :].decode(), None)]
        if message.startswith(FAIL_PREFIX):
            transfer_id, _, reason = message[len(FAIL_PREFIX) :].partition(b":")
            failure = TransferFailed(f"{peer} failed: {reason.decode(errors='replace')}")
            return [(transfer_id.decode(), failure)]
        return []

    def _deliver(self, completions: list[tuple[str, TransferError | None]]) -> None:
        reservations = []
        for key, error in completions:
            waiter = self._xfer_waiters.get(key)
            if waiter is None:
                reservations.append((key, error))
            elif not waiter.done():
                waiter.set_result(error)
        super()._deliver(reservations)

    # -- buffers ---------------------------------------------------------------------------

    def _pool(self, device: torch.device | str) -> BufferPool:
        device = _local_device(device)
        pool = self._pools.get(device)
        if pool is None:
            pool = self._pools[device] = BufferPool(
                functools.partial(self._allocate, device),
                self._free,
                self._pool_bytes,
                buffer_ids=self._buffer_ids,
            )
        return pool

    def _allocate(self, device: torch.device, buffer_id: int, capacity: int) -> PooledBuffer:
        shm_file = None
        if device.type == "cpu" and self.shm_files is not None:
            tensor, shm_file = self.shm_files.allocate(buffer_id, capacity)
        else:
            tensor = torch.empty(capacity, dtype=torch.uint8, device=device)
        descs = self._agent.register_memory(tensor)  # DRAM or VRAM, from the tensor's device
        registration = _Registration(
            descs=descs,
            metadata=self._agent.get_partial_agent_metadata(descs, True, ["UCX"]),
            mem_type="VRAM" if tensor.is_cuda else "DRAM",
            device_id=tensor.device.index or 0,
            shm_file=shm_file,
        )
        return PooledBuffer(buffer_id, capacity, tensor, registration)

    def _free(self, buffer: PooledBuffer) -> None:
        registration: _Registration = buffer.backend_state
        self._agent.deregister_memory(registration.descs)
        if registration.shm_file is not None:
            ShmFiles.free(registration.shm_file)

    def _describe(self, buffer: PooledBuffer, transfer_id: str, nbytes: int) -> bytes:
        registration: _Registration = buffer.backend_state
        shm = None
        if self.shm_files is not None and registration.shm_file is not None:
            shm = self.shm_files.post(registration.shm_file, transfer_id, nbytes)
        return encode(
            NixlBufferDescriptor(
                transfer_id=transfer_id,
                agent=self.name,
                agent_metadata=registration.metadata,
                buffer_id=buffer.buffer_id,
                mem_type=registration.mem_type,
                device_id=registration.device_id,
                address=buffer.tensor.data_ptr(),
                nbytes=nbytes,
                transfer_by=time.time()
                + self.lease_timeout_s
                - min(LEASE_MARGIN_S, LEASE_MARGIN_SHARE * self.lease_timeout_s),
                shm=shm,
            )
        )

    def _close_buffers(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        if self.shm_files is not None and self._shm_peer is not None:
            self.shm_files.close()
            self._shm_peer.close()
