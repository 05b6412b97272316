"""The shared-memory backend's completions: a peer's datagram wakes the owner's event loop, and
polling takes over only where the owner's socket cannot be bound."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

from mmserve.transfer.shm_backend import ACK_SUFFIX, ShmTransferAgent

pytestmark = pytest.mark.asyncio


async def _read_through(owner: ShmTransferAgent, peer: ShmTransferAgent) -> None:
    tensor = torch.arange(64 * 1024, dtype=torch.int32)
    handle, lease = await owner.offer(tensor)
    assert torch.equal(await peer.fetch(handle), tensor)
    await asyncio.wait_for(lease.wait(), 5)


async def test_a_peer_acknowledgement_completes_the_lease_without_a_polling_thread(
    tmp_path: Path,
) -> None:
    async with (
        ShmTransferAgent(directory=str(tmp_path), inline_threshold=0) as owner,
        ShmTransferAgent(directory=str(tmp_path), inline_threshold=0) as peer,
    ):
        for _ in range(20):
            await _read_through(owner, peer)
        landing = await owner.offer_destination((8,), torch.float32)
        await peer.write(torch.ones(8), landing.handle)
        assert torch.equal(await asyncio.wait_for(landing.receive(), 5), torch.ones(8))
        assert owner._progress is None and peer._progress is None
        sockets = [name for name in os.listdir(tmp_path) if name.endswith(ACK_SUFFIX)]
        assert len(sockets) == 1  # the owner's: the peer never posted a buffer
    assert not os.listdir(tmp_path)  # buffers and sockets removed on close


async def test_an_owner_without_its_socket_polls_instead(tmp_path: Path) -> None:
    # A Unix socket path holds at most 107 bytes; the buffers' directory may be longer.
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    async with (
        ShmTransferAgent(directory=str(deep), inline_threshold=0) as owner,
        ShmTransferAgent(directory=str(deep), inline_threshold=0) as peer,
    ):
        await _read_through(owner, peer)
        assert owner._progress is not None
    assert not os.listdir(deep)
