"""Hostile and broken media for the reliability suite, and a loopback server that misbehaves
on purpose (drips bytes, redirects anywhere, lies about content types)."""

from __future__ import annotations

import http.server
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar
from urllib.parse import parse_qs, urlparse

from PIL import Image

from tests.support.images import encoded, photo_like

FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")


def sample(fmt: str) -> bytes:
    return encoded(photo_like(64, 48, seed=1), fmt)


def gif_screen_bomb() -> bytes:
    """A 1x1 GIF frame on a logical screen of 65535 x 65535."""
    gif = bytearray(encoded(Image.new("P", (1, 1)), "GIF"))
    gif[6:10] = struct.pack("<HH", 65535, 65535)
    return bytes(gif)


def gif_many_frames(count: int = 2000) -> bytes:
    frames = [Image.new("RGB", (8, 8), (i % 256, i // 256, 7)) for i in range(count)]
    return encoded(frames[0], "GIF", save_all=True, append_images=frames[1:])


class _Handler(http.server.BaseHTTPRequestHandler):
    files: ClassVar[dict[str, tuple[str, bytes]]] = {}

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        url = urlparse(self.path)
        if url.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", parse_qs(url.query)["to"][0])
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif url.path == "/slow":
            self._drip()
        elif url.path in self.files:
            content_type, body = self.files[url.path]
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_error(404)

    def _drip(self) -> None:
        """A slow-loris image: one byte a second, for at most a minute."""
        body = sample("PNG")
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            for byte in body[:60]:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(1)
        except OSError:
            pass  # the client gave up, as it should


@contextmanager
def hostile_server(files: dict[str, tuple[str, bytes]]) -> Iterator[str]:
    """Base URL of a loopback server with `files` ({path: (content type, body)}), `/slow` and
    `/redirect?to=URL`."""
    handler = type("Handler", (_Handler,), {"files": files})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
