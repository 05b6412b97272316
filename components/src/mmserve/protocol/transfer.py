"""Transfer (mmserve.transfer): what `TensorHandle.descriptor` holds, per backend, and the
probe's messages."""

from __future__ import annotations

from typing import Literal

from mmserve.protocol.pipeline import TensorHandle
from mmserve.protocol.wire import WireMessage

# backend "inline": the descriptor is the tensor's bytes (C order) themselves.


class ShmBufferDescriptor(WireMessage, frozen=True):
    """A pooled shared-memory file on this host holding the tensor after a 64-byte header.
    `sequence` names this use of the buffer; the peer acknowledges it in the header. `host`
    is the owner's `mmserve.transfer.host.host_identity` ("": a peer that predates it)."""

    name: str  # file name inside the shared-memory directory both sides use
    sequence: int
    nbytes: int
    host: str = ""


class NixlBufferDescriptor(WireMessage, frozen=True):
    """A registered buffer of one NIXL agent holding the tensor (READ mode: the producer's
    buffer; WRITE mode: the consumer's landing buffer). `agent_metadata` is the agent's partial
    metadata for this buffer (connection info + its memory keys); a peer loads it once per
    `(agent, buffer_id)`. Completion and failure travel as NIXL notifications naming
    `transfer_id`. The peer transfers only before `transfer_by` (Unix time; 0: not said): the
    owner's lease ends a little later, and then the buffer may hold another tensor.
    `shm`: the same buffer as a shared-memory file, for a peer on the owner's host (which
    copies it directly instead of through UCX; `mmserve.transfer.host`); None for GPU memory
    and for owners started with `--transfer-same-host nixl`."""

    transfer_id: str
    agent: str
    agent_metadata: bytes
    buffer_id: int
    mem_type: Literal["DRAM", "VRAM"]
    device_id: int
    address: int
    nbytes: int
    transfer_by: float = 0.0
    shm: ShmBufferDescriptor | None = None


class TransferPoolStats(WireMessage, frozen=True):
    """Registered buffers of one transfer agent (all devices together)."""

    buffers: int
    registered_bytes: int
    in_use: int
    registrations: int  # buffers ever registered: flat once the pool is warm


class TransferProbeFetch(WireMessage, frozen=True):
    """`python -m mmserve.transfer.probe`: fetch each handle, answer the content digests."""

    handles: list[TensorHandle]
    pause_s: float = 0.0  # wait this long before fetching (a slow consumer)
    check: bool = True  # answer digests (costly for large tensors); timings come either way


class TransferProbeWrite(WireMessage, frozen=True):
    """Probe: write a seeded pattern into each destination, answer the digests written."""

    destinations: list[TensorHandle]
    seed: int


class TransferProbeOffer(WireMessage, frozen=True):
    """Probe: offer `seeded_pattern(shape, dtype, seed)` to a peer, answer its handle and
    digest (the probe as the producer side)."""

    shape: tuple[int, ...]
    dtype: str
    seed: int


class TransferProbeReply(WireMessage, frozen=True):
    digests: list[str] = []
    handles: list[TensorHandle] = []  # `TransferProbeOffer`: the offered tensor's
    seconds: list[float] = []  # per tensor: the fetch (until the data is here) or the write
    stats: TransferPoolStats | None = None
    peer_paths: dict[str, int] = {}  # with `stats`: `TransferAgent.peer_paths`
    error: str = ""
