"""uvicorn's httptools HTTP/1.1 protocol with a bound on a request's head.

httptools (llhttp) parses faster than h11, but uvicorn's protocol over it buffers a request line
and headers of any size. This one answers 431 and closes the connection once the head of a
request passes `MAX_HEAD_BYTES`, the same bound h11 keeps by default.
"""

from __future__ import annotations

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


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """Measures each request's head as its bytes arrive, up to the blank line that ends it,
    before the parser sees them; past the bound it answers 431 and closes. After the head the
    body is not counted, until the parser reports the request complete. A chunk that ends one
    pipelined request and starts the next leaves that next head's first bytes uncounted, so a
    head can pass the bound by at most one read."""

    _head_bytes = 0
    _in_head = True
    _tail = b""  # the last bytes of the head so far, for a blank line split between reads

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
