"""Probe processes (`python -m mmserve.transfer.probe`) and agents for the transfer tests and the
transfer fault suite."""

from __future__ import annotations

import importlib.util
import itertools
import os

import pytest

from mmserve.transfer import TransferAgent
from mmserve.transfer.probe import ProbeProcess
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


async def start_probe(nats_url: str, backend: str) -> ProbeProcess:
    return await ProbeProcess.start(
        nats_url,
        f"test.transfer.probe.{os.getpid()}.{next(_subjects)}",
        [
            f"--transfer={backend}",
            "--transfer-inline-threshold=0",
            f"--transfer-timeout={PROBE_TIMEOUT_S}",
        ],
    )


def make_agent(backend: str) -> TransferAgent:
    if backend == "nixl":
        from mmserve.transfer.nixl_backend import NixlTransferAgent

        return NixlTransferAgent(inline_threshold=0, lease_timeout_s=AGENT_TIMEOUT_S)
    return ShmTransferAgent(inline_threshold=0, lease_timeout_s=AGENT_TIMEOUT_S)
