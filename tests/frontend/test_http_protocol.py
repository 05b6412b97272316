"""The frontend's HTTP protocol: writes made in one turn of the event loop leave as one."""

from __future__ import annotations

import asyncio
import socket

from mmserve.frontend.http_protocol import _CoalescedWrites


class _Recorder(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]


async def test_writes_of_one_turn_go_out_together_and_close_sends_the_rest() -> None:
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    transport, _ = await loop.create_connection(_Recorder, sock=ours)
    writes: list[bytes] = []
    real_write = transport.write
    transport.write = lambda data: (writes.append(bytes(data)), real_write(data))[1]  # type: ignore[method-assign]
    coalesced = _CoalescedWrites(transport, loop)  # type: ignore[arg-type]
    coalesced.write(b"HTTP/1.1 200 OK\r\n\r\n")
    coalesced.write(b"data: 1\n\n")
    assert writes == []  # not before the turn ends
    await asyncio.sleep(0)
    assert writes == [b"HTTP/1.1 200 OK\r\n\r\ndata: 1\n\n"]
    coalesced.write(b"data: [DONE]\n\n")
    coalesced.close()  # flushes what is pending first
    assert writes[-1] == b"data: [DONE]\n\n"
    theirs.setblocking(False)
    received = b""
    while chunk := await asyncio.wait_for(loop.sock_recv(theirs, 1024), 5):
        received += chunk
    assert received == b"HTTP/1.1 200 OK\r\n\r\ndata: 1\n\ndata: [DONE]\n\n"
    assert coalesced.get_extra_info("socket") is not None  # the rest is the transport's
    theirs.close()
