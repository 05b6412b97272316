"""Inline tensors (inside the handle) and the choice of backend."""

from __future__ import annotations

import argparse

import pytest
import torch

from mmserve.protocol import TensorHandle, decode, encode
from mmserve.transfer import (
    MAX_INLINE_BYTES,
    TransferError,
    add_transfer_arguments,
    create_transfer_agent,
    default_backend,
)
from mmserve.transfer.inline import InlineTransferAgent
from mmserve.transfer.probe import digest, seeded_pattern
from mmserve.transfer.shm_backend import ShmTransferAgent


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8], ids=str
)
async def test_inline_round_trip_through_the_wire(dtype: torch.dtype) -> None:
    tensor = seeded_pattern((40, 30), dtype, seed=1).t()  # not contiguous
    async with InlineTransferAgent() as producer, InlineTransferAgent() as consumer:
        handle, lease = await producer.offer(tensor)
        assert handle.backend == "inline" and lease.done
        received = await consumer.fetch(decode(encode(handle), TensorHandle))
    assert received.shape == (30, 40) and received.dtype == dtype
    assert digest(received) == digest(tensor.contiguous())


async def test_empty_and_scalar_tensors_round_trip() -> None:
    async with InlineTransferAgent() as agent:
        for tensor in (torch.empty(0, 7, dtype=torch.bfloat16), torch.tensor(2.5)):
            handle, _ = await agent.offer(tensor)
            received = await agent.fetch(handle)
            assert received.shape == tensor.shape and torch.equal(received, tensor)


async def test_small_tensors_go_inline_whatever_the_backend() -> None:
    async with ShmTransferAgent(inline_threshold=1024) as agent:
        small, _ = await agent.offer(torch.arange(256, dtype=torch.int32))
        large, lease = await agent.offer(torch.arange(257, dtype=torch.int32))
        assert (small.backend, large.backend) == ("inline", "shm")
        assert torch.equal(await agent.fetch(small), torch.arange(256, dtype=torch.int32))
        assert torch.equal(await agent.fetch(large), torch.arange(257, dtype=torch.int32))
        await lease.wait()


async def test_inline_backend_refuses_what_does_not_fit_a_message() -> None:
    async with InlineTransferAgent() as agent:
        handle, _ = await agent.offer(torch.zeros(MAX_INLINE_BYTES, dtype=torch.uint8))
        assert len(encode(handle)) < 1024 * 1024  # NATS' default max_payload
        with pytest.raises(TransferError, match="inline limit"):
            await agent.offer(torch.zeros(MAX_INLINE_BYTES + 1, dtype=torch.uint8))
        with pytest.raises(TransferError, match="no WRITE mode"):
            await agent.offer_destination((4,), torch.float32)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_transfer_arguments(parser)
    return parser.parse_args(argv)


def test_transfer_flag_builds_the_chosen_agent() -> None:
    assert default_backend() in ("nixl", "shm")
    inline = create_transfer_agent(parse(["--transfer", "inline"]))
    assert inline.backend == "inline"
    shm = create_transfer_agent(parse(["--transfer=shm", "--transfer-inline-threshold=0"]))
    assert (shm.backend, shm.inline_threshold) == ("shm", 0)
    with pytest.raises(SystemExit):
        create_transfer_agent(parse(["--transfer-inline-threshold", str(MAX_INLINE_BYTES + 1)]))
