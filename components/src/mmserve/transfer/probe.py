"""A transfer peer served over NATS, to check a transfer path between two processes or hosts.

    python -m mmserve.transfer.probe --subject probe.a [--transfer nixl|shm|inline]

Endpoints (request/reply, msgpack `mmserve.protocol` messages):

- `<subject>.fetch` (`TransferProbeFetch`): fetch each handle, answer the content digests and
  how long each fetch took until the data was here;
- `<subject>.write` (`TransferProbeWrite`): write `seeded_pattern(shape, dtype, seed + i)` into
  each destination, answer the digests written and how long each write took;
- `<subject>.offer` (`TransferProbeOffer`): offer `seeded_pattern(shape, dtype, seed)` for a
  peer to fetch, answer its handle and digest;
- `<subject>.stats`: answer the agent's pool statistics.

It prints `ready` on stdout once it serves. `ProbeProcess` starts one and drives it (the tests
and `bench/transfer.py` do).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import nats
import torch

from mmserve.protocol import (
    TensorHandle,
    TransferPoolStats,
    TransferProbeFetch,
    TransferProbeOffer,
    TransferProbeReply,
    TransferProbeWrite,
    decode,
    encode,
)
from mmserve.runtime.connection import flush_in_order

from .base import TransferAgent, dtype_from_name, dtype_name
from .options import add_transfer_arguments, create_transfer_agent

if TYPE_CHECKING:
    from nats.aio.msg import Msg


def seeded_pattern(shape: Sequence[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor whose bytes depend on `seed` and on every position (cheap even at 64 MiB)."""
    nbytes = dtype.itemsize
    for dim in shape:
        nbytes *= dim
    words = torch.arange((nbytes + 3) // 4, dtype=torch.int32).mul_(2 * seed + 1).add_(seed)
    words.bitwise_xor_(words >> 13)
    return words.view(torch.uint8)[:nbytes].view(dtype).view(tuple(shape))


def digest(tensor: torch.Tensor) -> str:
    """Content digest of a tensor's bytes in C order (dtype-agnostic)."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    # The array's memoryview: numpy declares the buffer protocol only for Python >= 3.12.
    return hashlib.blake2b(data.data, digest_size=16).hexdigest()


async def _fetch(agent: TransferAgent, request: TransferProbeFetch) -> TransferProbeReply:
    await asyncio.sleep(request.pause_s)
    digests, seconds = [], []
    for handle in request.handles:
        start = time.perf_counter()
        async with agent.fetch_view(handle) as view:
            seconds.append(time.perf_counter() - start)
            if request.check:
                digests.append(await asyncio.to_thread(digest, view))
    return TransferProbeReply(digests=digests, seconds=seconds)


async def _write(agent: TransferAgent, request: TransferProbeWrite) -> TransferProbeReply:
    digests, seconds = [], []
    for index, destination in enumerate(request.destinations):
        tensor = seeded_pattern(
            destination.shape, dtype_from_name(destination.dtype), request.seed + index
        )
        start = time.perf_counter()
        await agent.write(tensor, destination)
        seconds.append(time.perf_counter() - start)
        digests.append(digest(tensor))
    return TransferProbeReply(digests=digests, seconds=seconds)


async def _offer(agent: TransferAgent, request: TransferProbeOffer) -> TransferProbeReply:
    tensor = seeded_pattern(request.shape, dtype_from_name(request.dtype), request.seed)
    # The agent holds the lease until the peer completes or `--transfer-timeout` passes.
    handle, _ = await agent.offer(tensor)
    return TransferProbeReply(digests=[digest(tensor)], handles=[handle])


async def serve(nats_url: str, subject: str, agent: TransferAgent) -> None:
    """Serve the probe endpoints until the process is stopped."""
    connection = await nats.connect(nats_url)

    def endpoint(
        answer: Callable[[bytes], Awaitable[TransferProbeReply]],
    ) -> Callable[[Msg], Awaitable[None]]:
        async def handle(msg: Msg) -> None:
            try:
                reply = await answer(msg.data)
            except Exception as exc:
                reply = TransferProbeReply(error=f"{type(exc).__name__}: {exc}")
            await msg.respond(encode(reply))

        return handle

    async def fetch(data: bytes) -> TransferProbeReply:
        return await _fetch(agent, decode(data, TransferProbeFetch))

    async def write(data: bytes) -> TransferProbeReply:
        return await _write(agent, decode(data, TransferProbeWrite))

    async def offer(data: bytes) -> TransferProbeReply:
        return await _offer(agent, decode(data, TransferProbeOffer))

    async def stats(_: bytes) -> TransferProbeReply:
        return TransferProbeReply(stats=agent.stats(), peer_paths=dict(agent.peer_paths))

    await connection.subscribe(f"{subject}.fetch", cb=endpoint(fetch))
    await connection.subscribe(f"{subject}.write", cb=endpoint(write))
    await connection.subscribe(f"{subject}.offer", cb=endpoint(offer))
    await connection.subscribe(f"{subject}.stats", cb=endpoint(stats))
    await flush_in_order(connection)
    print("ready", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await connection.close()
        await agent.close()


class ProbeError(RuntimeError):
    """The probe answered with an error."""


class ProbeProcess:
    """A probe started as a child process, and the calls to drive it over NATS."""

    def __init__(
        self, process: asyncio.subprocess.Process, subject: str, connection: nats.NATS
    ) -> None:
        self.process = process
        self.subject = subject
        self._connection = connection

    @classmethod
    async def start(
        cls,
        nats_url: str,
        subject: str,
        transfer_args: Sequence[str],
        *,
        timeout_s: float = 120,
        prefix: Sequence[str] = (),
    ) -> ProbeProcess:
        """Start `python -m mmserve.transfer.probe` and wait until it serves. `prefix` is a
        command it runs under (`ip netns exec HOST`: a probe on another host)."""
        process = await asyncio.create_subprocess_exec(
            *prefix,
            sys.executable,
            "-m",
            "mmserve.transfer.probe",
            f"--nats-url={nats_url}",
            f"--subject={subject}",
            *transfer_args,
            stdout=asyncio.subprocess.PIPE,
        )
        assert process.stdout is not None
        said = []
        while (line := await asyncio.wait_for(process.stdout.readline(), timeout_s)) != b"ready\n":
            said.append(line)
            if not line:  # it exited
                await process.wait()
                raise ProbeError(f"probe did not start: {b''.join(said).decode(errors='replace')}")
        return cls(process, subject, await nats.connect(nats_url))

    async def fetch(
        self,
        handles: Sequence[TensorHandle],
        *,
        pause_s: float = 0.0,
        check: bool = True,
        timeout_s: float = 60.0,
    ) -> TransferProbeReply:
        request = TransferProbeFetch(handles=list(handles), pause_s=pause_s, check=check)
        return await self._call("fetch", encode(request), timeout_s)

    async def write(
        self, destinations: Sequence[TensorHandle], seed: int, *, timeout_s: float = 60.0
    ) -> TransferProbeReply:
        request = TransferProbeWrite(destinations=list(destinations), seed=seed)
        return await self._call("write", encode(request), timeout_s)

    async def offer(
        self, shape: Sequence[int], dtype: torch.dtype, seed: int, *, timeout_s: float = 60.0
    ) -> tuple[TensorHandle, str]:
        """Have the probe offer `seeded_pattern(shape, dtype, seed)`: its handle and digest."""
        request = TransferProbeOffer(shape=tuple(shape), dtype=dtype_name(dtype), seed=seed)
        reply = await self._call("offer", encode(request), timeout_s)
        return reply.handles[0], reply.digests[0]

    async def peer_paths(self) -> dict[str, int]:
        """How many reads and writes the probe made by each path (`TransferAgent.peer_paths`)."""
        return (await self._call("stats", b"", 10.0)).peer_paths

    async def stats(self) -> TransferPoolStats:
        stats = (await self._call("stats", b"", 10.0)).stats
        if stats is None:
            raise ProbeError("probe answered no statistics")
        return stats

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()

    async def stop(self) -> None:
        await self._connection.close()
        self.kill()
        await self.process.wait()

    async def _call(self, endpoint: str, data: bytes, timeout_s: float) -> TransferProbeReply:
        msg = await self._connection.request(f"{self.subject}.{endpoint}", data, timeout=timeout_s)
        reply = decode(msg.data, TransferProbeReply)
        if reply.error:
            raise ProbeError(reply.error)
        return reply


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mmserve.transfer.probe", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--nats-url", default=os.environ.get("NATS_URL", "nats://127.0.0.1:4222"))
    parser.add_argument("--subject", required=True, help="subject prefix of the endpoints")
    add_transfer_arguments(parser)
    args = parser.parse_args(argv)
    agent = create_transfer_agent(args)
    try:
        asyncio.run(serve(args.nats_url, args.subject, agent))
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
