"""uvicorn's httptools HTTP/1.1 protocol with a bound on a request's head, and one write per
turn of the event loop.

httptools (llhttp) parses faster than h11, but uvicorn's protocol over it buffers a request line
and headers of any size. This one answers 431 and closes the connection once the head of a
request passes `MAX_HEAD_BYTES`, the same bound h11 keeps by default.

uvicorn writes a response's head as soon as the app starts it, then each body part: two system
calls for a streamed completion's head and its first events, which the app sends in the same
step. Writes made in one turn of the loop go out together at its end instead.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEAD_BYTES = 16 * 1024

_MESSAGE = b"request line and headers exceed 16 KiB\n"
_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-type: text/plain; charset=utf-8\r\n"
    b"content-length: %d\r\n"
    b"connection: close\r\n"
    b"\r\n%s" % (len(_MESSAGE), _MESSAGE)
)


class _CoalescedWrites:
    """A transport whose writes wait for the end of the current turn of the loop, then go out
    as one; anything else is the wrapped transport's."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)

    def _flush(self) -> None:
        if self._pending and not self._transport.is_closing():
            self._transport.write(b"".join(self._pending))
        self._pending.clear()

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """Measures each request's head as its bytes arrive, up to the blank line that ends it,
    before the parser sees them; past the bound it answers 431 and closes. After the head the
    body is not counted, until the parser reports the request complete. A chunk that ends one
    pipelined request and starts the next leaves that next head's first bytes uncounted, so a
    head can pass the bound by at most one read."""

    _head_bytes = 0
    _in_head = True
    _tail = b""  # the last bytes of the head so far, for a blank line split between reads

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        coalesced = _CoalescedWrites(transport, asyncio.get_running_loop())
        super().connection_made(coalesced)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            seen = self._tail + data
            end = seen.find(b"\r\n\r\n")
            if end >= 0:
                size = self._head_bytes - len(self._tail) + end + 4
                self._in_head, self._head_bytes, self._tail = False, 0, b""
            else:
                size = self._head_bytes = self._head_bytes + len(data)
                self._tail = seen[-3:]
            if size > MAX_HEAD_BYTES:
                self.transport.write(_TOO_LARGE)
                self.transport.close()
                return
        super().data_received(data)

    def on_message_complete(self) -> None:
        self._in_head = True
        super().on_message_complete()
