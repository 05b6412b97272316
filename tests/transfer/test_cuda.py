"""VRAM buffers (GPU machines only): CUDA tensors offered, fetched and written over NIXL."""

from __future__ import annotations

import pytest
import torch

from mmserve.transfer.probe import digest, seeded_pattern
from tests.support.transfer import NIXL_MISSING

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(NIXL_MISSING, reason="nixl is not importable here"),
]


async def test_cuda_tensors_move_between_vram_and_dram() -> None:
    from mmserve.transfer.nixl_backend import NixlTransferAgent

    tensor = seeded_pattern((1024, 1024), torch.bfloat16, seed=9).cuda()
    async with (
        NixlTransferAgent(inline_threshold=0) as producer,
        NixlTransferAgent(inline_threshold=0) as consumer,
    ):
        for device in ("cuda", "cpu"):
            handle, lease = await producer.offer(tensor)
            received = await consumer.fetch(handle, device=device)
            await lease.wait()
            assert received.device.type == device and digest(received) == digest(tensor)

        landing = await consumer.offer_destination(tensor.shape, tensor.dtype, device="cuda")
        await producer.write(tensor.cpu(), landing.handle)
        received = await landing.receive()
        assert received.is_cuda and digest(received) == digest(tensor)
        assert producer.stats().in_use == consumer.stats().in_use == 0
