"""READ and WRITE between two real processes (a probe process and this one), per backend."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from mmserve.protocol import NixlBufferDescriptor, ShmBufferDescriptor, TensorHandle, decode, encode
from mmserve.transfer import TransferAgent, TransferError, TransferFailed, TransferTimeout
from mmserve.transfer.probe import ProbeError, ProbeProcess, digest, seeded_pattern
from tests.support.transfer import start_probe, through_ucx

pytestmark = pytest.mark.asyncio(loop_scope="module")

KIB, MIB = 1024, 1024 * 1024
SIZES = [
    pytest.param(4 * KIB, id="4KiB"),
    pytest.param(1 * MIB, id="1MiB"),
    pytest.param(64 * MIB, id="64MiB"),
]


def float32_tensor(nbytes: int, seed: int) -> torch.Tensor:
    return seeded_pattern((nbytes // 256, 64), torch.float32, seed)


@pytest.mark.parametrize("nbytes", SIZES)
async def test_read_moves_exact_contents(
    agent: TransferAgent, probe: ProbeProcess, nbytes: int
) -> None:
    tensor = float32_tensor(nbytes, seed=nbytes)
    handle, lease = await agent.offer(tensor)
    assert handle.backend == agent.backend
    assert len(encode(handle)) < 2 * KIB  # the handle travels, not the data

    assert (await probe.fetch([handle])).digests == [digest(tensor)]
    await asyncio.wait_for(lease.wait(), 10)
    assert agent.stats().in_use == 0


@pytest.mark.parametrize("nbytes", SIZES)
async def test_write_moves_exact_contents(
    agent: TransferAgent, probe: ProbeProcess, nbytes: int
) -> None:
    landing = await agent.offer_destination((nbytes // 256, 64), torch.float32)

    written = (await probe.write([landing.handle], seed=7)).digests
    received = await asyncio.wait_for(landing.receive(), 10)

    assert written == [digest(seeded_pattern((nbytes // 256, 64), torch.float32, 7))]
    assert digest(received) == written[0]
    assert agent.stats().in_use == 0


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.int64, torch.uint8], ids=str
)
async def test_dtypes_and_strides_survive_both_modes(
    agent: TransferAgent, probe: ProbeProcess, dtype: torch.dtype
) -> None:
    base = seeded_pattern((512, 300), dtype, seed=3)
    transposed = base.t()  # not contiguous: offer copies it in C order
    handle, lease = await agent.offer(transposed)
    assert (handle.shape, handle.dtype) == ((300, 512), str(dtype).removeprefix("torch."))
    assert (await probe.fetch([handle])).digests == [digest(transposed.contiguous())]
    await lease.wait()

    landing = await agent.offer_destination((300, 512), dtype)
    [written] = (await probe.write([landing.handle], seed=11)).digests
    received = await landing.receive()
    assert received.dtype == dtype and received.shape == (300, 512)
    # Bytes, not values: random bit patterns include NaNs.
    assert digest(received) == written == digest(seeded_pattern((300, 512), dtype, seed=11))


async def test_thousand_transfers_do_not_grow_registered_memory(
    agent: TransferAgent, probe: ProbeProcess
) -> None:
    batch, batches = 20, 50
    stats_after_first = None
    for index in range(batches):
        tensors = [seeded_pattern((1024,), torch.float32, index * batch + i) for i in range(batch)]
        offers = [await agent.offer(tensor) for tensor in tensors]
        digests = (await probe.fetch([handle for handle, _ in offers])).digests
        assert digests == [digest(tensor) for tensor in tensors]
        await asyncio.gather(*(lease.wait() for _, lease in offers))
        if stats_after_first is None:
            stats_after_first = (agent.stats(), await probe.stats())

    producer, consumer = agent.stats(), await probe.stats()
    assert (producer, consumer) == stats_after_first
    assert producer.in_use == 0 and consumer.in_use == 0
    assert producer.buffers <= batch + 8  # the 4 KiB class plus earlier tests' sizes


def corrupt(handle: TensorHandle) -> TensorHandle:
    """A handle the consumer cannot use: an address outside the registration (through UCX),
    a sequence the buffer does not hold (shared memory)."""
    bad: NixlBufferDescriptor | ShmBufferDescriptor
    if handle.backend == "nixl":
        nixl = decode(handle.descriptor, NixlBufferDescriptor)
        if nixl.shm is None:
            bad = msgspec.structs.replace(nixl, address=nixl.address + (1 << 40))
        else:
            shm = msgspec.structs.replace(nixl.shm, sequence=nixl.shm.sequence + 10**9)
            bad = msgspec.structs.replace(nixl, shm=shm)
    else:
        shm = decode(handle.descriptor, ShmBufferDescriptor)
        bad = msgspec.structs.replace(shm, sequence=shm.sequence + 10**9)
    return msgspec.structs.replace(handle, descriptor=encode(bad))


async def fail_round(agent: TransferAgent, probe: ProbeProcess) -> None:
    """20 offers whose consumers fail; every lease must end with the failure."""
    offers = [await agent.offer(torch.full((64, 1024), float(i))) for i in range(20)]
    results = await asyncio.gather(
        *(probe.fetch([corrupt(handle)]) for handle, _ in offers), return_exceptions=True
    )
    assert all("TransferError" in str(result) for result in results)
    for handle, lease in offers:
        # UCX consumers report the failure by notification; a shared-memory consumer must not
        # touch a header that is not its own, so the producer times out.
        with pytest.raises(TransferFailed if through_ucx(handle) else TransferTimeout):
            await asyncio.wait_for(lease.wait(), 5)


async def test_failing_consumers_return_buffers_to_the_pool(
    agent: TransferAgent, probe: ProbeProcess, backend: str
) -> None:
    # Shared-memory producers wait out the timeout; UCX ones hear of the failure before it.
    agent.lease_timeout_s = 3.0 if backend == "nixl-ucx" else 1.0
    try:
        await fail_round(agent, probe)
        after_first = agent.stats()
        await fail_round(agent, probe)
        after_second = agent.stats()
    finally:
        agent.lease_timeout_s = 5.0

    assert after_first.in_use == 0
    assert after_second == after_first  # the failed round's buffers were all reused
    assert (await probe.stats()).in_use == 0

    tensor = torch.full((64, 1024), 3.0)
    handle, lease = await agent.offer(tensor)
    assert (await probe.fetch([handle])).digests == [digest(tensor)]
    await lease.wait()


async def test_killed_consumer_buffer_returns_after_timeout(
    agent: TransferAgent, nats_url: str, backend: str, probe: ProbeProcess
) -> None:
    doomed = await start_probe(nats_url, backend)
    agent.lease_timeout_s = 1.0
    try:
        handle, lease = await agent.offer(seeded_pattern((16, MIB), torch.uint8, 5))
        fetching = asyncio.create_task(doomed.fetch([handle], pause_s=30, timeout_s=30))
        await asyncio.sleep(0.2)  # the request is with the consumer, which holds the handle
        doomed.kill()
        assert agent.stats().in_use == 1
        with pytest.raises(TransferTimeout):
            await asyncio.wait_for(lease.wait(), 5)
        assert agent.stats().in_use == 0
    finally:
        agent.lease_timeout_s = 5.0
        fetching.cancel()
        await doomed.stop()

    # The freed buffer serves the next consumer.
    tensor = seeded_pattern((16, MIB), torch.uint8, 6)
    handle, lease = await agent.offer(tensor)
    assert (await probe.fetch([handle])).digests == [digest(tensor)]
    await lease.wait()


async def test_a_consumer_after_the_lease_gets_an_error_not_another_tensor(
    agent: TransferAgent, probe: ProbeProcess
) -> None:
    agent.lease_timeout_s = 1.0
    try:
        late, lease = await agent.offer(seeded_pattern((16, KIB), torch.uint8, 8))
        with pytest.raises(TransferTimeout):
            await asyncio.wait_for(lease.wait(), 5)
        # The pool hands the returned buffer to the next offer.
        tensor = seeded_pattern((16, KIB), torch.uint8, 9)
        handle, lease = await agent.offer(tensor)
        with pytest.raises(ProbeError):
            await probe.fetch([late])
        assert (await probe.fetch([handle])).digests == [digest(tensor)]
        await lease.wait()
    finally:
        agent.lease_timeout_s = 5.0


async def test_a_producer_after_the_landing_lease_gets_an_error(
    agent: TransferAgent, probe: ProbeProcess
) -> None:
    agent.lease_timeout_s = 1.0
    try:
        landing = await agent.offer_destination((16, 64), torch.float32)
        with pytest.raises(TransferTimeout):
            await asyncio.wait_for(landing.wait(), 5)
        with pytest.raises(ProbeError):
            await probe.write([landing.handle], seed=3)
    finally:
        agent.lease_timeout_s = 5.0


async def test_handle_of_another_backend_is_refused(agent: TransferAgent) -> None:
    other = "shm" if agent.backend == "nixl" else "nixl"
    handle = TensorHandle(shape=(4,), dtype="float32", backend=other, descriptor=b"")
    with pytest.raises(TransferError, match="same --transfer"):
        await agent.fetch(handle)


async def test_a_peer_on_this_host_takes_the_path_the_backend_names(
    agent: TransferAgent, probe: ProbeProcess, backend: str
) -> None:
    """NIXL's same-host peers copy from shared memory unless told to go through UCX; the
    shm backend's always do."""
    before = await probe.peer_paths()
    tensor = seeded_pattern((256, KIB), torch.uint8, 12)
    handle, lease = await agent.offer(tensor)
    assert (await probe.fetch([handle])).digests == [digest(tensor)]
    await asyncio.wait_for(lease.wait(), 10)
    landing = await agent.offer_destination((256, KIB), torch.uint8)
    await probe.write([landing.handle], seed=13)
    assert digest(await landing.receive()) == digest(seeded_pattern((256, KIB), torch.uint8, 13))
    after = await probe.peer_paths()
    path = "nixl" if backend == "nixl-ucx" else "shm"
    assert after.get(path, 0) - before.get(path, 0) == 2, (before, after)
    assert sum(after.values()) - sum(before.values()) == 2
