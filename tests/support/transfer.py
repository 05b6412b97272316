"""Probe processes (`python -m mmserve.transfer.probe`) and agents for the transfer tests and the
transfer fault suite."""

from __future__ import annotations

import importlib.util
import itertools
import os

import pytest

from mmserve.protocol import NixlBufferDescriptor, TensorHandle, decode
from mmserve.transfer import TransferAgent
from mmserve.transfer.probe import ProbeProcess
from mmserve.transfer.shm_backend import ShmTransferAgent

NIXL_MISSING = importlib.util.find_spec("nixl") is None
# Short, so that tests of abandoned transfers finish quickly.
PROBE_TIMEOUT_S = 5.0
AGENT_TIMEOUT_S = 5.0
_subjects = itertools.count()

# "nixl": NIXL as deployed, a same-host peer copying from shared memory; "nixl-ucx": every
# peer through UCX (`--transfer-same-host nixl`), what a peer on another host does.
_NEEDS_NIXL = pytest.mark.skipif(NIXL_MISSING, reason="nixl is not importable here")
BACKENDS = [
    pytest.param("nixl", marks=_NEEDS_NIXL),
    pytest.param("nixl-ucx", marks=_NEEDS_NIXL),
    "shm",
]


def transfer_args(backend: str) -> list[str]:
    """The `--transfer` options of a process that runs `backend` (a name of `BACKENDS`)."""
    name, _, path = backend.partition("-")
    return [f"--transfer={name}"] + (["--transfer-same-host=nixl"] if path == "ucx" else [])


async def start_probe(nats_url: str, backend: str) -> ProbeProcess:
    return await ProbeProcess.start(
        nats_url,
        f"test.transfer.probe.{os.getpid()}.{next(_subjects)}",
        [
            *transfer_args(backend),
            "--transfer-inline-threshold=0",
            f"--transfer-timeout={PROBE_TIMEOUT_S}",
        ],
    )


def make_agent(backend: str) -> TransferAgent:
    if backend.startswith("nixl"):
        from mmserve.transfer.nixl_backend import NixlTransferAgent

        return NixlTransferAgent(
            inline_threshold=0,
            lease_timeout_s=AGENT_TIMEOUT_S,
            same_host="nixl" if backend == "nixl-ucx" else "shm",
        )
    return ShmTransferAgent(inline_threshold=0, lease_timeout_s=AGENT_TIMEOUT_S)


def through_ucx(handle: TensorHandle) -> bool:
    """Whether a peer on this host moves `handle`'s bytes through UCX (its failures then come
    back as notifications) rather than through shared memory."""
    return handle.backend == "nixl" and decode(handle.descriptor, NixlBufferDescriptor).shm is None
