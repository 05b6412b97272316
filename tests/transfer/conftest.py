"""Probe processes (`python -m mmserve.transfer.probe`) and agents for the transfer tests."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import os
import signal
import sys
from collections.abc import AsyncIterator, Sequence

import nats
import pytest
import pytest_asyncio

from mmserve.protocol import (
    TensorHandle,
    TransferPoolStats,
    TransferProbeFetch,
    TransferProbeReply,
    TransferProbeWrite,
    decode,
    encode,
)
from mmserve.transfer import TransferAgent
from mmserve.transfer.nixl_backend import NixlTransferAgent
from mmserve.transfer.shm_backend import ShmTransferAgent

NIXL_MISSING = importlib.util.find_spec("nixl") is None
# Short, so that tests of abandoned transfers finish quickly.
PROBE_TIMEOUT_S = 5.0
AGENT_TIMEOUT_S = 5.0
_subjects = itertools.count()

BACKENDS = [
    pytest.param(
        "nixl", marks=pytest.mark.skipif(NIXL_MISSING, reason="nixl is not importable here")
    ),
    "shm",
]


class Probe:
    """A probe process and a NATS connection to drive it."""

    def __init__(
        self, process: asyncio.subprocess.Process, subject: str, nc: nats.aio.client.Client
    ) -> None:
        self.process = process
        self.subject = subject
        self._nc = nc

    async def fetch(
        self, handles: Sequence[TensorHandle], *, pause_s: float = 0.0, timeout_s: float = 60.0
    ) -> list[str]:
        request = TransferProbeFetch(handles=list(handles), pause_s=pause_s)
        return (await self._call("fetch", encode(request), timeout_s)).digests

    async def write(self, destinations: Sequence[TensorHandle], seed: int) -> list[str]:
        request = TransferProbeWrite(destinations=list(destinations), seed=seed)
        return (await self._call("write", encode(request), 60.0)).digests

    async def stats(self) -> TransferPoolStats:
        stats = (await self._call("stats", b"", 10.0)).stats
        assert stats is not None
        return stats

    async def _call(self, endpoint: str, data: bytes, timeout_s: float) -> TransferProbeReply:
        msg = await self._nc.request(f"{self.subject}.{endpoint}", data, timeout=timeout_s)
        reply = decode(msg.data, TransferProbeReply)
        if reply.error:
            raise ProbeError(reply.error)
        return reply

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGKILL)


class ProbeError(RuntimeError):
    """The probe answered with an error."""


async def start_probe(nats_url: str, backend: str) -> Probe:
    subject = f"test.transfer.probe.{os.getpid()}.{next(_subjects)}"
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "mmserve.transfer.probe",
        f"--nats-url={nats_url}",
        f"--subject={subject}",
        f"--transfer={backend}",
        "--transfer-inline-threshold=0",
        f"--transfer-timeout={PROBE_TIMEOUT_S}",
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    said = []
    while (line := await asyncio.wait_for(process.stdout.readline(), 120)) != b"ready\n":
        said.append(line)
        if not line:  # exited
            await process.wait()
            raise RuntimeError(f"probe did not start: {b''.join(said)!r}")
    return Probe(process, subject, await nats.connect(nats_url))


async def stop_probe(probe: Probe) -> None:
    await probe._nc.close()
    probe.kill()
    await probe.process.wait()


def make_agent(backend: str) -> TransferAgent:
    if backend == "nixl":
        return NixlTransferAgent(inline_threshold=0, lease_timeout_s=AGENT_TIMEOUT_S)
    return ShmTransferAgent(inline_threshold=0, lease_timeout_s=AGENT_TIMEOUT_S)


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def probe(nats_url: str, backend: str) -> AsyncIterator[Probe]:
    started = await start_probe(nats_url, backend)
    yield started
    await stop_probe(started)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def agent(backend: str) -> AsyncIterator[TransferAgent]:
    async with make_agent(backend) as created:
        yield created
